"""The bpf_loop callback linker (agent/ebpf/calls.py): call sites patched, the callback appended with
its map references, the func BTF; and every object it cannot map without guessing refused."""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any

import pytest

from agent.config import MapSizes
from agent.ebpf import bpfsys
from agent.ebpf import link as link_mod
from agent.ebpf.bpfobject import (
    EXIT,
    INSN,
    LD_IMM64,
    MOV_K,
    BpfObject,
    FuncDef,
    MapDef,
    ObjectError,
    ProgDef,
    insn,
)
from agent.ebpf.btf import func_ids
from agent.ebpf.calls import (
    FIRST_FUNC_ID,
    HELPER_LOOP,
    JMP_CALL,
    PSEUDO_FUNC,
    CallError,
    func_btf,
    link_callback,
    unresolved,
)
from agent.ebpf.link import LinkError, load_program
from agent.ebpf.loader import Datapath
from agent.ebpf.programs import (
    PROG_EGRESS,
    PROG_FROM_NET,
    PROG_FROM_NET6,
    PROG_FROM_POD,
    PROG_FROM_POD6,
    PROG_XDP_NET,
    PROG_XDP_NET6,
    PROGRAMS,
    SNAT_CALLBACK,
    ProgSpec,
)
from bench.verifycost import the_object

MAP_LOOKUP = 1


def loop_call(dst: int = 2, between: bytes = b"", helper: int = HELPER_LOOP) -> bytes:
    """bpf_loop(8, <unresolved>, NULL, 0) as clang emits it: the callback's 64-bit load of 0."""
    return b"".join(
        [
            insn(MOV_K, dst=1, imm=8),
            insn(LD_IMM64, dst=dst),
            insn(0),
            insn(MOV_K, dst=3),
            insn(MOV_K, dst=4),
            between,
            insn(JMP_CALL, imm=helper),
        ]
    )


# 0: r1 = map (fd); 2-7: the loop (3: the callback's load); 8: r0 = 0; 9: exit
PROGRAM = insn(LD_IMM64, src=1, dst=1, imm=7) + insn(0) + loop_call() + insn(MOV_K) + insn(EXIT)
# 0: r1 = map; 2: r0 = 0; 3: exit
CALLBACK = insn(LD_IMM64, src=1, dst=1, imm=9) + insn(0) + insn(MOV_K) + insn(EXIT)


def prog(insns: bytes = PROGRAM) -> ProgDef:
    return ProgDef("ekp_from_pod", 3, insns, ((0, 0),))


def callback(insns: bytes = CALLBACK) -> FuncDef:
    return FuncDef("ekp_snat_callback", insns, ((0, 1),))


def test_the_call_site_points_at_the_callback_appended_after_the_program() -> None:
    linked = link_callback(prog(), callback())
    out = linked.prog.insns
    start = len(PROGRAM) // INSN.size
    assert out == out[: len(PROGRAM)] + CALLBACK and start == 10
    code, regs, off, imm = INSN.unpack_from(out, 3 * INSN.size)
    # the offset counts from the instruction after the load: 3 + 1 + 6 = 10
    assert (code, regs >> 4, regs & 0x0F, off, imm) == (LD_IMM64, PSEUDO_FUNC, 2, 0, 6)
    changed = [i for i in range(start) if out[i * 8 : i * 8 + 8] != PROGRAM[i * 8 : i * 8 + 8]]
    assert changed == [3]
    # the callback's map reference moves with it; the program's stays
    assert linked.prog.relocs == ((0, 0), (10, 1))
    assert linked.func_info == ((0, "ekp_from_pod"), (10, "ekp_snat_callback"))
    assert (linked.prog.name, linked.prog.type) == ("ekp_from_pod", 3)


def test_every_call_site_of_the_one_callback_is_patched() -> None:
    twice = PROGRAM[:-16] + loop_call() + insn(MOV_K) + insn(EXIT)
    linked = link_callback(prog(twice), callback())
    start = len(twice) // INSN.size
    for site in (3, 9):
        _, regs, _, imm = INSN.unpack_from(linked.prog.insns, site * INSN.size)
        assert (regs >> 4, imm) == (PSEUDO_FUNC, start - (site + 1))


def test_a_program_without_callback_or_sites_is_left_as_it_is() -> None:
    plain = insn(MOV_K) + insn(EXIT)
    linked = link_callback(prog(plain), None)
    assert linked.prog == prog(plain) and linked.func_info == ()


def test_an_unresolved_reference_in_a_program_naming_no_callback_is_refused() -> None:
    with pytest.raises(CallError, match=r"instruction\(s\) 3 and no callback named"):
        link_callback(prog(), None)


def test_the_loader_refuses_a_program_it_cannot_link_before_loading_anything() -> None:
    """ekp_egress names no callback (agent/ebpf/programs.py): an unresolved reference in it is a
    LinkError naming the program and the build, raised before any system call."""
    obj = BpfObject("abcdef012345", "GPL", 0, b"", (), (ProgDef(PROG_EGRESS, 3, PROGRAM[16:], ()),))
    with pytest.raises(
        LinkError, match=r"linking program ekp_egress \(build abcdef012345\): .*no callback named"
    ):
        load_program(obj, PROG_EGRESS, [])


def _walking_object() -> BpfObject:
    """ekp_from_pod calling bpf_loop with its callback, no maps: loadable as it is."""
    program = loop_call() + insn(MOV_K) + insn(EXIT)
    return BpfObject(
        "abcdef012345",
        "GPL",
        0,
        b"",
        (),
        (ProgDef(PROG_FROM_POD, 3, program, ()),),
        functions=(FuncDef(SNAT_CALLBACK, insn(MOV_K) + insn(EXIT), ()),),
        bpf_loop=True,
    )


def test_every_load_attribute_of_the_spec_reaches_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_insns' attributes are spread into prog_load, not picked by name: one added to it later
    is not dropped on the way (mypy then names the prog_load parameter it lacks)."""
    real = link_mod.load_insns
    seen: list[dict[str, object]] = []

    def more(spec: ProgSpec, name: str, insns: bytes) -> tuple[bytes, Any]:
        insns, attrs = real(spec, name, insns)
        return insns, {**attrs, "attach_prog_fd": 7}  # as if LoadAttrs had grown a key

    def prog_load(*_: object, **kw: object) -> int:
        seen.append(kw)
        return 99

    monkeypatch.setattr(link_mod, "load_insns", more)
    monkeypatch.setattr(bpfsys, "prog_load", prog_load)
    obj = BpfObject(
        "abcdef012345", "GPL", 0, b"", (), (ProgDef(PROG_EGRESS, 3, insn(MOV_K) + insn(EXIT), ()),)
    )
    assert load_program(obj, PROG_EGRESS, []) == 99
    assert [(kw["attach_prog_fd"], kw["expected_attach_type"], kw["attach_btf_id"]) for kw in seen] == [
        (7, 0, 0)
    ]


@pytest.mark.kernel
def test_a_refused_function_btf_is_an_error_with_the_kernels_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only strerror: the BTF is loaded again with a log buffer, as a refused program is."""

    def bad_magic(func_info: Sequence[tuple[int, str]]) -> tuple[bytes, bytes]:
        blob, records = func_btf(func_info)
        return b"\0\0" + blob[2:], records

    obj = _walking_object()
    fd = load_program(obj, PROG_FROM_POD, [])
    assert fd >= 0, os.strerror(-fd)  # the object loads with its own BTF: the magic is what fails
    os.close(fd)
    monkeypatch.setattr(link_mod, "func_btf", bad_magic)
    with pytest.raises(
        LinkError, match=r"(?s)ekp_from_pod \(build abcdef012345\).*refused the BTF.*\n.*magic"
    ):
        load_program(obj, PROG_FROM_POD, [])


def test_a_named_callback_the_program_never_passes_is_refused() -> None:
    with pytest.raises(CallError, match="passes no function to bpf_loop"):
        link_callback(prog(insn(MOV_K) + insn(EXIT)), callback())


@pytest.mark.parametrize(
    "site",
    [
        loop_call(dst=3),  # not bpf_loop's callback argument
        loop_call(helper=MAP_LOOKUP),  # another helper's call
        loop_call(between=insn(MOV_K, dst=2, imm=1)),  # r2 overwritten before the call
        loop_call(between=insn(0x05, off=0)),  # a jump before any call
    ],
    ids=["other-register", "other-helper", "r2-overwritten", "jump-first"],
)
def test_an_unresolved_load_that_is_not_bpf_loops_callback_is_refused(site: bytes) -> None:
    with pytest.raises(CallError, match="not bpf_loop's callback argument"):
        link_callback(prog(site + insn(EXIT)), callback())


def test_a_callback_with_unresolved_references_of_its_own_is_refused() -> None:
    with pytest.raises(CallError, match="of its own"):
        link_callback(prog(), callback(loop_call() + insn(EXIT)))


def test_a_64_bit_constant_and_a_map_load_are_not_unresolved_references() -> None:
    assert unresolved(insn(LD_IMM64, dst=2, imm=5) + insn(0) + insn(LD_IMM64, src=1, dst=2) + insn(0)) == []
    assert unresolved(insn(LD_IMM64, dst=2) + INSN.pack(0, 0, 0, 1)) == []  # high half set
    assert unresolved(PROGRAM) == [3]


def test_the_func_btf_names_each_function_and_the_records_point_at_them() -> None:
    blob, records = func_btf(((0, "ekp_from_pod"), (11, "ekp_snat_callback")))
    ids = func_ids(blob, ["ekp_from_pod", "ekp_snat_callback"])
    assert ids == {"ekp_from_pod": FIRST_FUNC_ID, "ekp_snat_callback": FIRST_FUNC_ID + 1}
    assert [struct.unpack_from("<II", records, i) for i in (0, 8)] == [
        (0, FIRST_FUNC_ID),
        (11, FIRST_FUNC_ID + 1),
    ]
    # static linkage (a FUNC's vlen 0): a global function would be verified apart from its caller
    hdr_len, _, types_len = struct.unpack_from("<III", blob, 4)
    off, kinds = hdr_len, []
    while off < hdr_len + types_len:
        _, info, _ = struct.unpack_from("<III", blob, off)
        kind, vlen = info >> 24 & 0x1F, info & 0xFFFF
        kinds.append((kind, vlen if kind == 12 else None))
        off += 12 + {1: 4, 13: 8 * vlen}.get(kind, 0)
    assert kinds[FIRST_FUNC_ID - 1 :] == [(12, 0), (12, 0)]


def test_the_json_form_keeps_the_functions_and_the_old_format_is_refused() -> None:
    obj = BpfObject(
        build="abcdef012345",
        license="GPL",
        kern_version=0,
        btf=b"",
        maps=(MapDef("ekp_a_v2", 1, 4, 8, 16, 0), MapDef("ekp_b_v2", 2, 4, 4, 1, 0)),
        programs=(prog(),),
        functions=(callback(),),
    )
    back = BpfObject.from_json(obj.to_json())
    assert back == obj and back.function("ekp_snat_callback") == callback()
    with pytest.raises(ObjectError, match="no function"):
        back.function("ekp_other")
    with pytest.raises(ObjectError, match="format 1, expected 2"):
        BpfObject.from_json(obj.to_json().replace(b'"format": 2', b'"format": 1'))
    with pytest.raises(ObjectError, match="relocation"):  # the functions' references are checked too
        BpfObject.from_json(
            BpfObject(**{**obj.__dict__, "functions": (FuncDef("f", CALLBACK, ((0, 5),)),)}).to_json()
        )


@pytest.mark.kernel
def test_each_program_of_the_build_passes_exactly_the_callback_its_spec_names() -> None:
    """The table (agent/ebpf/programs.py) against the compiled C: a program calling bpf_loop that
    names no callback, one naming a callback it never passes, or the other family's, fails here,
    not at a node's load."""
    obj = the_object(Datapath("/sys/fs/bpf/unused", MapSizes()))
    assert obj.bpf_loop, "this kernel has bpf_loop: the build should have the callbacks"
    walking = set()
    for p in obj.programs:
        spec = PROGRAMS[p.name]
        callback = obj.function(spec.callback) if spec.callback else None
        linked = link_callback(p, callback)
        if callback is None:
            continue
        walking.add(p.name)
        # One walk per program, and the callback of its family: the IPv4 callback's scratch
        # (ekp_scratch) is no map of the IPv6 programs, nor ekp_scratch6 of the IPv4 ones, so
        # callbacks swapped in the table fail here even though each links.
        assert len(unresolved(p.insns)) == 1, f"{p.name}: one bpf_loop call site"
        theirs = {obj.maps[m].name for _, m in callback.relocs}
        ours = {obj.maps[m].name for _, m in p.relocs}
        assert theirs <= ours, f"{p.name} with {callback.name}: maps {sorted(theirs - ours)} it never uses"
        assert linked.func_info == ((0, p.name), (len(p.insns) // INSN.size, callback.name))
    assert walking == {
        PROG_FROM_POD,
        PROG_FROM_NET,
        PROG_FROM_POD6,
        PROG_FROM_NET6,
        PROG_XDP_NET,
        PROG_XDP_NET6,
    } & {p.name for p in obj.programs}
    assert walking >= {PROG_FROM_POD, PROG_FROM_NET}
