"""The program table, the kfunc patch and the BTF reader: pure, on crafted bytes; and, kernel-marked,
the reader against this kernel's BTF and the marker against the C."""

from __future__ import annotations

import re
import struct

import pytest

from agent.ebpf.btf import BTF_MAGIC, BtfError, func_ids, vmlinux_func_ids, vmlinux_has
from agent.ebpf.kfunc import patch_kfunc_calls
from agent.ebpf.loader import default_bpf_dir
from agent.ebpf.programs import (
    KFUNC_SOCK_DESTROY_MARK,
    PROG_EGRESS,
    PROG_EGRESS6,
    PROG_FROM_NET,
    PROG_FROM_NET6,
    PROG_FROM_POD,
    PROG_FROM_POD6,
    PROG_SOCK_TERM,
    PROG_XDP_NET,
    PROG_XDP_NET6,
    PROGRAMS,
    SOCK_HOOKS,
    SOCK_NEEDS,
    TERM_NEEDS,
    XDP6_NEEDS,
    available_programs,
    kernel_needs,
)

INSN = struct.Struct("<BBhi")


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return INSN.pack(code, dst | (src << 4), off, imm)


def test_a_kernel_without_the_helpers_loads_the_packet_programs_alone() -> None:
    socket_programs = {name for name, _ in SOCK_HOOKS.values()}
    # 5.12-5.17: no bpf_xdp_load_bytes, so no ekp_xdp_net6 (the verifier would refuse it, and with
    # it the whole build); IPv4's XDP program and tc's IPv6 path load all the same
    packet = {
        PROG_FROM_POD,
        PROG_FROM_NET,
        PROG_FROM_POD6,
        PROG_FROM_NET6,
        PROG_EGRESS,
        PROG_EGRESS6,
        PROG_XDP_NET,
    }
    assert set(available_programs(set())) == packet
    assert set(available_programs(set(XDP6_NEEDS))) == {*packet, PROG_XDP_NET6}
    assert set(available_programs(set(SOCK_NEEDS))) == {*packet, *socket_programs}
    assert set(available_programs(kernel_needs())) == set(PROGRAMS)
    assert kernel_needs() == set(SOCK_NEEDS) | set(TERM_NEEDS) | set(XDP6_NEEDS)


def test_marker_calls_become_kfunc_calls_and_nothing_else_changes() -> None:
    code = b"".join(
        [
            insn(0xBF, dst=1, src=6),  # r1 = r6
            insn(0x85, imm=KFUNC_SOCK_DESTROY_MARK),  # call marker
            insn(0x85, imm=1),  # call bpf_map_lookup_elem: a helper, left alone
            insn(0x18, dst=1, src=1, imm=KFUNC_SOCK_DESTROY_MARK),  # ld_imm64 of the same number
            insn(0x00, imm=0),
            insn(0x85, src=1, imm=KFUNC_SOCK_DESTROY_MARK),  # a bpf-to-bpf call (src 1): not a helper
            insn(0x95),
        ]
    )
    out, patched = patch_kfunc_calls(code, {KFUNC_SOCK_DESTROY_MARK: 65741})
    assert patched == {KFUNC_SOCK_DESTROY_MARK: 1}
    assert out[8:16] == insn(0x85, src=2, imm=65741)
    assert out[:8] + out[16:] == code[:8] + code[16:]
    with pytest.raises(ValueError, match="whole number"):
        patch_kfunc_calls(code[:-1], {})


def btf_blob(types: list[tuple[str, int, int, bytes]]) -> bytes:
    """A BTF blob: (name, kind, vlen, the kind's extra bytes) per type."""
    strings = b"\0"
    body = b""
    for name, kind, vlen, extra in types:
        off = len(strings)
        strings += name.encode() + b"\0"
        body += struct.pack("<III", off, (kind << 24) | vlen, 0) + extra
    header = struct.pack("<HBBIIIII", BTF_MAGIC, 1, 0, 24, 0, len(body), len(body), len(strings))
    return header + body + strings


def test_func_ids_walks_every_kind_length() -> None:
    blob = btf_blob(
        [
            ("int", 1, 0, b"\0" * 4),  # 1 INT
            ("sock", 4, 2, b"\0" * 24),  # 2 STRUCT with two members
            ("bpf_iter_udp", 12, 0, b""),  # 3 FUNC
            ("proto", 13, 3, b"\0" * 24),  # 4 FUNC_PROTO, three params
            ("e", 6, 1, b"\0" * 8),  # 5 ENUM
            ("bpf_sock_destroy", 12, 0, b""),  # 6 FUNC
            ("arr", 3, 0, b"\0" * 12),  # 7 ARRAY
        ]
    )
    assert func_ids(blob, ["bpf_sock_destroy", "bpf_iter_udp", "nope"]) == {
        "bpf_iter_udp": 3,
        "bpf_sock_destroy": 6,
    }
    assert func_ids(blob, ["sock"]) == {}, "a STRUCT of that name is not a function"
    with pytest.raises(BtfError, match="magic"):
        func_ids(b"\0" * 32, ["x"])


@pytest.mark.kernel
def test_this_kernel_has_what_the_socket_programs_need() -> None:
    """Linux 6.18 here: every program loads (the lab tests rely on it)."""
    assert vmlinux_has(kernel_needs()) == kernel_needs()
    ids = vmlinux_func_ids(["bpf_sock_destroy"])
    assert ids["bpf_sock_destroy"] > 0
    with pytest.raises(BtfError, match="no function ekp_nope"):
        vmlinux_func_ids(["ekp_nope"])


def test_the_c_marker_is_the_loaders() -> None:
    text = (default_bpf_dir() / "ekp_sock.h").read_text()
    m = re.search(r"#define EKP_KFUNC_SOCK_DESTROY (0x[0-9a-f]+)", text)
    assert m and int(m.group(1), 16) == KFUNC_SOCK_DESTROY_MARK
    assert PROGRAMS[PROG_SOCK_TERM].kfuncs == ((KFUNC_SOCK_DESTROY_MARK, "bpf_sock_destroy"),)


def test_every_ingress_pass_that_writes_no_tag_clears_tc_classid_and_a_miss_keeps_it() -> None:
    """cls_bpf (clsact) copies skb->tc_classid into tc_index on TC_ACT_OK, and ekp_egress reads a
    nonzero tc_index as a legacy host routing tag: each ingress TC_ACT_OK writes tc_classid first
    (ekp_tc_apply, and the scratch lookup's failure, which no packet reaches: a one-element per-CPU
    array; a source check, as no test run can make that lookup fail). MISS mode's TC_ACT_UNSPEC
    leaves it for the older generation behind ours, so ekp_main clears nothing before its lookup."""
    text = (default_bpf_dir() / "ekp_core.h").read_text()
    start = text.index("static __always_inline int ekp_main(")
    body = text[start : text.index("\n}\n", start)]
    assert re.search(r"if \(!w\) \{[^}]*skb->tc_classid = 0;\s*return TC_ACT_OK;", body), body
    assert body.index("tc_classid") > body.index("if (!w)")
    assert body.count("return TC_ACT_OK") == 1
