"""The ABI contract: bpf/ekp_abi.h and bpf/ekp_maps.h against agent/ebpf/abi.py.

* A probe generated from the ctypes `_fields_` is compiled from ekp_abi.h with the host gcc and
  prints sizeof/offsetof of every field and the value of every constant: any layout drift fails.
* ekp_maps.h is parsed: the map names, kinds, key/value structs and size macros are the MAPS
  registry's, every name fits the kernel's 15 characters, and the declared map_flags are those
  the loader checks existing pins for.
* Kernel-marked: the loaded maps, as bpftool shows them, have those names and sizes, and BTF
  gives `bpftool map dump` named fields.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from enum import IntEnum
from pathlib import Path

import pytest

from agent.config import MapSizes
from agent.ebpf import abi, loader
from agent.ebpf.loader import PRIVATE_MAPS, Datapath, default_bpf_dir, expected_info, map_flags, stale_pins
from agent.ebpf.programs import PROGRAMS
from lab.dplab import SIZES as PACKET_LAB_SIZES
from lab.packets import loaded_datapath

BPF_DIR = default_bpf_dir()
C_TYPES = {ctypes.c_uint32: "u32", ctypes.c_uint64: "u64"}


# ---- constants: Python name -> C name -------------------------------------------------------


def c_constants() -> dict[str, int]:
    """Every constant abi.py mirrors, by its C name, with the Python value."""
    out: dict[str, int] = {"EKP_ABI_VERSION": abi.ABI_VERSION}
    groups: list[tuple[type[IntEnum], str]] = [
        (abi.Scope, "EKP_SCOPE_"),
        (abi.FrontendFlag, "EKP_FE_"),
        (abi.BackendFlag, "EKP_BE_"),
        (abi.MemberFlag, "EKP_MEMBER_"),
        (abi.CtDir, "EKP_CT_"),
        (abi.CtFlag, "EKP_CT_"),
        (abi.CtqRing, "EKP_CTQ_"),
        (abi.AddrFlag, "EKP_ADDR_"),
        (abi.ConfigFlag, "EKP_CFG_"),
        (abi.SockFlag, "EKP_SOCK_"),
        (abi.HandoverMode, "EKP_HANDOVER_"),
    ]
    for enum, prefix in groups:
        out.update({prefix + m.name: int(m) for m in enum})
    for stat in abi.Stat:
        out[("EKP_" if stat.name.startswith("DROP_") else "EKP_STAT_") + stat.name] = int(stat)
    out["EKP_STAT_DROP_FIRST"] = int(abi.STAT_DROP_FIRST)
    out["EKP_STAT_MAX"] = abi.STAT_COUNT
    out["EKP_STAT_COUNT"] = abi.STAT_COUNT
    out["EKP_STAT_SLOTS"] = abi.STAT_SLOTS
    out["EKP_FRAGHOLD_SLOTS"] = abi.FRAGHOLD_SLOTS
    out["EKP_FRAGHOLD_LEN"] = abi.FRAGHOLD_LEN
    out["EKP_CT_HANDOVER_S"] = abi.CT_HANDOVER_S
    out["EKP_CTQH_POS_SHIFT"] = abi.CTQH_POS_SHIFT
    out["EKP_CTQH_SLOTS_MASK"] = abi.CTQH_SLOTS_MASK
    return out


def probe_source() -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "ekp_abi.h"', "int main(void) {"]
    for cname, cls in abi.STRUCTS.items():
        lines.append(f'  printf("S {cname} %zu\\n", sizeof(struct {cname}));')
        for fname, *_ in cls._fields_:
            lines.append(
                f'  printf("F {cname} {fname} %zu %zu\\n", offsetof(struct {cname}, {fname}), '
                f"sizeof(((struct {cname} *)0)->{fname}));"
            )
    for name in c_constants():
        lines.append(f'  printf("C {name} %lld\\n", (long long)({name}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler for the ABI probe")
    tmp = tmp_path_factory.mktemp("abi_probe")
    (tmp / "probe.c").write_text(probe_source())
    subprocess.run(
        [gcc, "-Wall", "-Werror", "-I", str(BPF_DIR), "-o", str(tmp / "probe"), str(tmp / "probe.c")],
        check=True,
    )
    out = subprocess.run([str(tmp / "probe")], check=True, capture_output=True, text=True).stdout
    by_kind: dict[str, list[str]] = {"S": [], "F": [], "C": []}
    for line in out.splitlines():
        kind, rest = line.split(" ", 1)
        by_kind[kind].append(rest)
    return by_kind


def test_struct_sizes_match(probe: dict[str, list[str]]) -> None:
    c_sizes = {name: int(size) for name, size in (line.split() for line in probe["S"])}
    py_sizes = {name: ctypes.sizeof(cls) for name, cls in abi.STRUCTS.items()}
    assert c_sizes == py_sizes


def test_field_offsets_and_sizes_match(probe: dict[str, list[str]]) -> None:
    c_fields = {(s, f): (int(o), int(n)) for s, f, o, n in (line.split() for line in probe["F"])}
    py_fields = {
        (sname, fname): (getattr(cls, fname).offset, getattr(cls, fname).size)
        for sname, cls in abi.STRUCTS.items()
        for fname, *_ in cls._fields_
    }
    assert c_fields == py_fields


def test_constants_match(probe: dict[str, list[str]]) -> None:
    c_values = {name: int(value) for name, value in (line.split() for line in probe["C"])}
    assert c_values == c_constants()


def test_every_c_constant_is_mirrored() -> None:
    """A constant added to the header without its Python twin fails here (the probe checks values)."""
    text = (BPF_DIR / "ekp_abi.h").read_text()
    names = set(
        re.findall(
            r"\b(EKP_(?:SCOPE|FE|BE|MEMBER|CT|CTQ|CTQH|ADDR|FRAGHOLD|STAT|DROP|SOCK|HANDOVER)_[A-Z0-9_]+)\b",
            text,
        )
    )
    assert names - set(c_constants()) == set()


def test_every_header_struct_is_mirrored() -> None:
    text = (BPF_DIR / "ekp_abi.h").read_text()
    assert set(re.findall(r"^struct (ekp_\w+) \{", text, re.M)) == set(abi.STRUCTS)


# ---- map declarations -----------------------------------------------------------------------

# BPF_TABLE(kind, key, value, name, size) or BPF_F_TABLE(..., flags): no pin in the C (the loader pins
# every map of the registry, agent/ebpf/link.py).
_DECL = re.compile(
    r'BPF_(?:F_)?TABLE\(\s*"(?P<kind>\w+)",\s*(?P<key>[\w ]+?),\s*(?P<value>[\w ]+?),\s*(?P<name>\w+),\s*'
    r"(?P<macro>\w+)(?:,\s*(?P<flags>[\w |]+?))?\s*\);",
)


def declared_maps() -> dict[str, dict[str, str]]:
    text = (BPF_DIR / "ekp_maps.h").read_text()
    return {m["name"]: m.groupdict() for m in _DECL.finditer(text)}


def c_type_name(t: type) -> str:
    if t in C_TYPES:
        return C_TYPES[t]
    names = {cls: name for name, cls in abi.STRUCTS.items()}
    return f"struct {names[t]}"


def test_map_declarations_match_the_registry() -> None:
    declared = declared_maps()
    assert set(declared) == {spec.name for spec in abi.MAPS.values()}
    for spec in abi.MAPS.values():
        decl = declared[spec.name]
        assert decl["kind"] == spec.kind, spec.name
        assert decl["key"] == c_type_name(spec.key), spec.name
        assert decl["value"] == c_type_name(spec.value), spec.name
        assert decl["macro"] == spec.size_macro, spec.name


_FLAG_VALUES = {"BPF_F_NO_PREALLOC": 1 << 0, "BPF_F_NO_COMMON_LRU": 1 << 1}


def test_map_flags_declared_are_the_ones_pins_are_checked_for() -> None:
    """The 6th BPF_F_TABLE argument (map_flags) is what the loader expects of a pin."""
    declared = {
        name: sum(_FLAG_VALUES[f.strip()] for f in (m["flags"] or "").split("|") if f.strip())
        for name, m in declared_maps().items()
    }
    assert declared == {spec.name: map_flags(spec) for spec in abi.MAPS.values()}
    # ABI v2: the LRU maps share the kernel's common LRU list (bpf/README.md, "Conntrack capacity")
    assert declared["ekp_ct_tcp_v2"] == declared["ekp_ct_any_v2"] == declared["ekp_aff_v2"] == 0


def test_per_cpu_lru_maps_would_be_expected_rounded_to_the_possible_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """htab_map_alloc gives each CPU's LRU list the same share: max_entries rounds up (for a map
    declared with BPF_F_NO_COMMON_LRU; none is in ABI v2, the rule stays for whoever adds one)."""
    monkeypatch.setattr(loader, "possible_cpus", lambda: 3)
    monkeypatch.setattr(loader, "ROLE_FLAGS", {"ct_tcp": loader.BPF_F_NO_COMMON_LRU})
    sizes = MapSizes(fe=1000, ct_tcp=1000, aff=999)
    assert expected_info(abi.MAPS["ct_tcp"], sizes)["max_entries"] == 1002
    assert expected_info(abi.MAPS["aff"], sizes)["max_entries"] == 999
    assert expected_info(abi.MAPS["fe"], sizes)["max_entries"] == 1000  # a common hash: as asked
    huge = MapSizes(ct_tcp=(1 << 32) - 2)  # rounding up would overflow u32: the kernel rounds down
    assert expected_info(abi.MAPS["ct_tcp"], huge)["max_entries"] == (1 << 32) - 4


def test_map_names_fit_the_kernel_and_carry_the_version() -> None:
    """Every name carries the ABI version, or its own later one where its layout changed alone."""
    for spec in abi.MAPS.values():
        assert len(spec.name) <= 15
        assert spec.name == f"ekp_{spec.role}_v{spec.version}"
        assert spec.version >= abi.ABI_VERSION
    assert {s.name for s in abi.MAPS.values() if s.version != abi.ABI_VERSION} == {
        "ekp_stats_v3",
        "ekp_xstats_v3",
        "ekp_ct6_tcp_v3",  # the SNAT fields (v2 had none)
        "ekp_ct6_any_v3",
        "ekp_ctqh_v3",  # position high, count low (v2 the other way round)
        "ekp_ctqh6_v3",
        "ekp_ctq_tcp_v3",  # one ring per head: v2 heads went on with v2 rings in a hand-over
        "ekp_ctq_any_v3",
        "ekp_ctq6_tcp_v3",
        "ekp_ctq6_any_v3",
    }


def test_stale_pins_lists_other_versions_only(tmp_path: Path) -> None:
    names = (
        "ekp_ct_tcp_v2",
        "ekp_ct_v1",
        "ekp_ct_v0",
        "ekp_fe_v7",
        "ekp_gone_v1",
        "ekp_ctqh_v2",
        "other",
        "ekp_x",
    )
    for name in names:
        (tmp_path / name).touch()
    assert stale_pins(str(tmp_path)) == [
        str(tmp_path / n) for n in ("ekp_ct_v0", "ekp_ct_v1", "ekp_ctqh_v2", "ekp_fe_v7", "ekp_gone_v1")
    ], "the v2 heads (the other layout) go once our programs replaced theirs"
    assert stale_pins(str(tmp_path / "missing")) == []


def test_source_text_inlines_every_header() -> None:
    text = Datapath("/sys/fs/bpf/x", MapSizes()).source_text()
    assert "-DEKP_FE_MAX=" in text
    assert "/sys/fs/bpf/x" not in text, "the pin directory never reaches the C (one build serves all)"
    for header in BPF_DIR.glob("ekp_*.h"):
        assert f"// ---- {header.name} ----" in text
    assert '#include "' not in text
    # the per-family templates, as the compiler sees them: once for IPv4, once for IPv6
    for template in ("ekp_ct_af.h", "ekp_ctq_af.h", "ekp_snat_af.h"):
        assert text.count(f"// ---- {template} ----") == 2, template
    # the IPv6 path's order of checks: once for tc, once for XDP
    assert text.count("// ---- ekp_decide6_hook.h ----") == 2


# ---- the loaded maps, as bpftool sees them ------------------------------------------------

# The packet lab's sizes: its build is compiled once for the whole run (lab/precompile.py), where
# sizes of this module's own were a compile (about 19 CPU s) of their own.
SMALL = PACKET_LAB_SIZES


@pytest.fixture(scope="module")
def loaded() -> Iterator[Datapath]:
    with loaded_datapath(SMALL) as datapath:
        yield datapath


def bpftool(*argv: str) -> object:
    return json.loads(subprocess.run(["bpftool", "-j", *argv], check=True, capture_output=True).stdout)


def prog_id(fd: int) -> int:
    from agent.ebpf import bpfsys

    info = (ctypes.c_uint32 * 64)()  # struct bpf_prog_info: type, id, ...
    assert bpfsys.obj_get_info_by_fd(fd, info) == 0
    return int(info[1])


def test_the_layout_tests_sizes_tell_the_maps_apart() -> None:
    """Each map SMALL sizes gets a size no other has: where two were equal, a header sizing one
    map from the other's macro (ct_any from EKP_CT_TCP_MAX) would pass the layout test below."""
    sized = [f.name for f in dataclasses.fields(SMALL) if f.name in abi.MAPS]
    assert {"ct_tcp", "ct_any", "frag", "fe", "sknat", "slot"} <= set(sized)
    entries = {role: expected_info(abi.MAPS[role], SMALL)["max_entries"] for role in sized}
    shared = {n: sorted(r for r in entries if entries[r] == n) for n in entries.values()}
    assert {n: roles for n, roles in shared.items() if len(roles) > 1} == {}


@pytest.mark.kernel
def test_bpftool_shows_every_map_with_its_layout(loaded: Datapath) -> None:
    for role, spec in abi.MAPS.items():
        shown = bpftool("map", "show", "id", str(loaded.maps[role].info().id))
        assert isinstance(shown, dict)
        want = expected_info(spec, SMALL)
        assert shown["name"] == spec.name
        assert shown["type"] == spec.kind  # bpftool spells map types as bcc does
        assert (shown["bytes_key"], shown["bytes_value"]) == (want["key_size"], want["value_size"])
        assert shown["max_entries"] == want["max_entries"]


# What the XDP program never reads: it counts in its own map, hands nothing to the stack for egress
# (ekp_hostnat), and it leaves every reject to tc (the
# rate limiter's bucket is not in its code at all: the shared refusal sends a frontend without
# endpoints to tc before the reject's code, which the compiler leaves out of XDP's copy). (The code
# that records and holds fragments is compiled into it but never runs: XDP passes fragments on
# before it. It reads ekp_addr for the activity check's frontend test, bpf/ekp_act.h.)
XDP_UNUSED = {"rnat", "stats", "icmprl", "hostnat", "port"}
# The pinned maps each program reads or writes (bpftool's program type besides).
# The IPv6 service maps are read by the socket programs and the tc programs' IPv6 path (ekp_from_pod6,
# ekp_from_net6, which alone use the IPv6 conntrack), never by the IPv4 tc programs; connect4,
# sendmsg4 and their reverse twins never read them, the IPv6 hooks read both families' (an IPv4
# address on an IPv6 socket uses the IPv4 maps). ekp_addr6 is written for the tc programs' IPv6.
_V6 = {"fe6", "slot6", "be6", "rnat6", "member6", "srcr6", "addr6", "aff6", "sknat6"}
_SOCKETS = {"skcfg", "sknat"} | _V6
# the tc IPv6 path's own maps: its conntrack, the tables' early-drop rings, its settings (the SNAT
# source, ekp_cfg6), its fragments and legacy host routing's IPv6 egress sources (ekp_hostnat6)
_CT6 = {"ct6_tcp", "ct6_any", "ctq6_tcp", "ctq6_any", "ctqh6", "cfg6", "cfg6sel", "frag6", "frhold6"}
_CT6 |= {"hostnat6"}
# the IPv6 path: the activity stamps and frontend check (ekp_act, ekp_addr6), the backend check of
# a flow's refresh (ekp_addr6); no Maglev, no reject; its source translation reads the shared
# config's port range (ekp_cfg); its time exceeded takes the rejects' tokens (ekp_icmprl); a held
# fragment stamps the time of the last hold, shared with IPv4 (ekp_fraglast)
_TC6 = {"cfg", "cfgsel", "stats", "act", "addr6", "fe6", "srcr6", "aff6", "member6", "slot6", "be6", "icmprl"}
_TC6 |= _CT6 | {"fraglast"}
# XDP's IPv6 path (ekp_xdp_net6): the tc path's but for what it leaves to tc (fragments, answers),
# with XDP's counters
# (no legacy host routing's hand-over: XDP leaves its translations to tc, ekp_hostnat6 unread)
_XDP6 = (_TC6 - {"stats", "icmprl", "frag6", "frhold6", "fraglast", "hostnat6"}) | {"xstats"}
_SOCK_FORWARD = {"skcfg", "cfg", "cfgsel", "fe", "srcr", "aff", "member", "slot", "be", "sknat", "stats"}
_SOCK_FORWARD6 = _SOCK_FORWARD | {"fe6", "srcr6", "aff6", "member6", "slot6", "be6", "sknat6"}
_SOCK_REVERSE = {"sknat", "fe", "stats"}
_SOCK_REVERSE6 = _SOCK_REVERSE | {"sknat6", "fe6"}
# ekp_egress chooses no backend (no service table: only legacy host routing's sources, conntrack,
# the activity stamps and what they read), holds no fragment (the stack sends a datagram's first
# fragment first) and sends no reject
_EGRESS_UNUSED = {"fe", "slot", "be", "srcr", "aff", "rnat", "xstats", "member", "maglev"}
_EGRESS_UNUSED |= {"fraghold", "fraglast", "icmprl"}
# a pod port's bridge (ekp_port) is read only by the source check of what comes from pods (scope
# internal: ekp_from_pod and its IPv6 half), before a packet past the stack's rp_filter is redirected
_POD_ONLY = {"port"}
_EGRESS_UNUSED |= _POD_ONLY
PROGRAM_MAPS: dict[str, tuple[str, set[str]]] = {
    # every pinned map but ekp_rnat (written for the agent, read by no program since v2), the XDP
    # counters and the socket programs' own
    "ekp_from_pod": ("sched_cls", set(abi.MAPS) - {"rnat", "xstats"} - _SOCKETS - _CT6),
    "ekp_from_net": ("sched_cls", set(abi.MAPS) - {"rnat", "xstats"} - _SOCKETS - _CT6 - _POD_ONLY),
    "ekp_from_pod6": ("sched_cls", _TC6 | _POD_ONLY),
    "ekp_from_net6": ("sched_cls", _TC6),
    "ekp_egress": ("sched_cls", set(abi.MAPS) - _EGRESS_UNUSED - _SOCKETS - _CT6),
    # ekp_egress's IPv6 half: legacy host routing's sources (ekp_hostnat6), a fragmented
    # datagram's ports for its later fragments; the node's own replies of flows to it looked up in
    # the IPv6 conntrack (its refresh, rings and activity stamps: the backend check reads ekp_addr6),
    # counted when translated
    "ekp_egress6": (
        "sched_cls",
        {"hostnat6", "frag6", "ct6_tcp", "ct6_any", "ctq6_tcp", "ctq6_any", "ctqh6", "act", "addr6"}
        | {"cfg", "cfgsel", "stats"},
    ),
    # the same but for what it leaves to tc, with its own counters
    "ekp_xdp_net": ("xdp", set(abi.MAPS) - XDP_UNUSED - _SOCKETS - _CT6),
    "ekp_xdp_net6": ("xdp", _XDP6),
    "ekp_sock_conn": ("cgroup_sock_addr", _SOCK_FORWARD),
    "ekp_sock_send": ("cgroup_sock_addr", _SOCK_FORWARD),
    "ekp_sock_recv": ("cgroup_sock_addr", _SOCK_REVERSE),
    "ekp_sock_peer": ("cgroup_sock_addr", _SOCK_REVERSE),
    "ekp_sock_conn6": ("cgroup_sock_addr", _SOCK_FORWARD6),
    "ekp_sock_send6": ("cgroup_sock_addr", _SOCK_FORWARD6),
    "ekp_sock_recv6": ("cgroup_sock_addr", _SOCK_REVERSE6),
    "ekp_sock_peer6": ("cgroup_sock_addr", _SOCK_REVERSE6),
    "ekp_sock_free": ("cgroup_sock", {"skcfg", "sknat", "sknat6"}),
    "ekp_sock_term": ("tracing", {"sknat", "member", "sknat6", "member6", "stats"}),
}


@pytest.mark.kernel
def test_every_program_uses_its_maps(loaded: Datapath) -> None:
    """Each program's pinned maps as PROGRAM_MAPS lists them; the tc and XDP programs also one
    unpinned map of their own load, the per-CPU working memory (bpf/ekp_tc_scratch.h; PRIVATE), which the
    socket programs never touch (they run preemptible, in process context)."""
    assert set(PROGRAM_MAPS) == set(PROGRAMS)
    pinned = {role: m.info().id for role, m in loaded.maps.items()}
    for name, (kind, roles) in PROGRAM_MAPS.items():
        shown = bpftool("prog", "show", "id", str(prog_id(loaded.prog_fd(name))))
        assert isinstance(shown, dict)
        assert (shown["name"], shown["type"]) == (name, kind)
        used = set(shown["map_ids"])
        assert {r for r, ident in pinned.items() if ident in used} == roles, name
        own = used - set(pinned.values())
        if kind not in ("sched_cls", "xdp"):
            assert not own, name
            continue
        names = set()
        for ident in own:
            shown_map = bpftool("map", "show", "id", str(ident))
            assert isinstance(shown_map, dict)
            names.add(shown_map["name"])
        assert names == PRIVATE[name], name


# The maps of each tc and XDP program's own load, outside the registry: the per-CPU working memory of
# its family's path, for the IPv4 programs of tc and XDP the program array their IPv6 packets
# continue through, and for the programs attached to a hook the build's hand-over mode
# (ekp_handover). Their
# counts are loader.PRIVATE_MAPS (a reused program with more is compiled again).
PRIVATE = {
    "ekp_from_pod": {"ekp_scratch", "ekp_calls6", "ekp_handover"},
    "ekp_from_net": {"ekp_scratch", "ekp_calls6", "ekp_handover"},
    "ekp_from_pod6": {"ekp_scratch6"},
    "ekp_from_net6": {"ekp_scratch6"},
    "ekp_egress": {"ekp_scratch", "ekp_calls6", "ekp_handover"},
    "ekp_egress6": {"ekp_scratch6"},
    "ekp_xdp_net": {"ekp_scratch", "ekp_xcalls6", "ekp_handover"},
    "ekp_xdp_net6": {"ekp_scratch6"},
}


def test_private_map_counts_are_the_loaders() -> None:
    assert {name: len(maps) for name, maps in PRIVATE.items()} == {
        name: n for name, n in PRIVATE_MAPS.items() if n
    }


@pytest.mark.kernel
def test_map_dump_has_named_fields(loaded: Datapath) -> None:
    fe = loaded.maps["fe"]
    fe.update(
        abi.FrontendKey(abi.ip_be("10.96.0.10"), abi.port_be(80), 6, abi.Scope.INTERNAL),
        abi.Frontend(set_id=1, count=2, rev_nat_id=1),
    )
    try:
        dumped = bpftool("map", "dump", "id", str(fe.info().id))
    finally:
        fe.clear()
    assert isinstance(dumped, list) and len(dumped) == 1
    formatted = dumped[0]["formatted"]
    assert set(formatted["key"]) == {"addr", "port", "proto", "scope"}
    assert set(formatted["value"]) >= {"set_id", "count", "flags", "affinity_timeout", "rev_nat_id"}
