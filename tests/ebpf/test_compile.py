"""The compiler child and what it compiled: once per build on the machine, loaded against each
agent's own pinned maps, pinned programs reused by a restart; no bcc in the agent.

Three run groups (tests/parallel.py): the tests that switch the IPv6 paths off (`ipv6-builds`),
those of other sizes (`new-sizes`, in their order) and the rest; SMALL's compile is shared
(`cache`). Map sizes and the programs loaded are chosen at load, so every size here (SMALL, the
packet lab's `BIGGER`, the lab agents' `AGENT`, with the IPv6 paths off and on) is one build: the
module compiles it once (about 19 CPU s), into its own cache, through an agent process without
bcc; the tests that take the machine's cache find the same build there (lab/precompile.py)."""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.config import ConntrackSettings, MapSizes
from agent.ebpf import bpfobject, bpfsys, loader
from agent.ebpf import compile as compile_mod
from agent.ebpf.abi import MAPS, CtEntry, CtKey, MapSpec, ip_be, port_be
from agent.ebpf.bpfobject import INSN, BpfObject
from agent.ebpf.btf import vmlinux_has
from agent.ebpf.compile import PROG_PIN_PREFIX, build_id, prog_map_ids, prog_pin
from agent.ebpf.link import PinnedMapMismatch, link, verifier_threads
from agent.ebpf.loader import PRIVATE_MAPS, Datapath, DatapathError, PinMismatchError
from agent.ebpf.maps import map_info, obj_get
from agent.ebpf.objcache import DIR_ENV, ObjectCache, default_cache_dir
from agent.ebpf.programs import (
    BUILD_MAPS,
    PROG_EGRESS,
    PROG_EGRESS6,
    PROG_FROM_NET,
    PROG_FROM_NET6,
    PROG_FROM_POD,
    PROG_SCHED_CLS,
    PROG_XDP,
    PROG_XDP_NET,
    PROG_XDP_NET6,
    PROGRAMS,
    SNAT6_CALLBACK,
    SNAT_CALLBACK,
    TAIL_CALLS,
    kernel_needs,
)
from agent.ebpf.snatloop import CFLAG as SNAT_CFLAG
from agent.ebpf.sockattach import prog_id
from lab.dplab import SIZES as PACKET_LAB_SIZES
from lab.packets import bpffs

SMALL = MapSizes(
    fe=128, slot=256, be=128, rnat=128, member=256, ct_tcp=1024, ct_any=1024, frag=64, aff=128, srcr=32
)
# Other sizes than SMALL's, whose build the run compiles anyway (the packet lab's).
BIGGER = PACKET_LAB_SIZES
# A lab agent's sizes (defaults, conntrack derived from kube-proxy's settings on this machine's
# CPUs): its builds with the tc IPv6 path off and on are the lab's IPv4-only and dual-stack agents'.
AGENT = MapSizes().with_conntrack(ConntrackSettings(), os.cpu_count() or 1)


def test_the_build_id_follows_source_flags_abi_and_programs() -> None:
    types = {"ekp_a": 3, "ekp_b": 6}
    base = build_id("int x;", ["-DA=1"], 1, types)
    assert base == build_id("int x;", ["-DA=1"], 1, dict(reversed(types.items())))
    assert (
        len(
            {
                base,
                build_id("int y;", ["-DA=1"], 1, types),
                build_id("int x;", ["-DA=2"], 1, types),
                build_id("int x;", ["-DA=1"], 2, types),
                build_id("int x;", ["-DA=1"], 1, {"ekp_a": 3, "ekp_b": 3}),
                build_id("int x;", ["-DA=1"], 1, {"ekp_a": 3, "ekp_c": 6}),
            }
        )
        == 6
    )
    assert build_id("int x;", ["-DA=1", "-I/elsewhere/bpf"], 1, types) == base, (
        "where the tree lies is no part"
    )


def test_the_build_id_follows_the_object_format(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two trees of one C source whose objects differ in format are two builds: one cache entry
    would have each refuse the other's object (BpfObject.from_json), compile and overwrite it."""
    progs = {"ekp_a": 3}
    before = build_id("int x;", ["-DA=1"], 1, progs)
    monkeypatch.setattr(bpfobject, "FORMAT", bpfobject.FORMAT + 1)
    assert build_id("int x;", ["-DA=1"], 1, progs) != before


def _fake_child_run(seen: list[dict[str, object]]) -> object:
    """subprocess.run for compile_in_child: records the child's JSON args, prints an empty object."""

    def run(argv: list[str], **_: object) -> subprocess.CompletedProcess[bytes]:
        seen.append(json.loads(argv[-1]))
        out = BpfObject("abcdef012345", "GPL", 0, b"", (), ()).to_json()
        return subprocess.CompletedProcess(argv, 0, out, b"")

    return run


@pytest.mark.parametrize("loop, want", [("1", [SNAT6_CALLBACK, SNAT_CALLBACK]), ("0", [])])
def test_the_compile_child_is_told_the_callbacks_of_the_programs_the_parent_hashed(
    monkeypatch: pytest.MonkeyPatch, loop: str, want: list[str]
) -> None:
    seen: list[dict[str, object]] = []
    monkeypatch.setattr(subprocess, "run", _fake_child_run(seen))
    programs = {PROG_FROM_POD: 3, PROG_FROM_NET6: 3, PROG_EGRESS: 3}
    compile_mod.compile_in_child(Path("x.c"), [f"{SNAT_CFLAG}{loop}"], "abcdef012345", programs)
    assert [a["callbacks"] for a in seen] == [want]


def test_the_compile_child_puts_in_the_object_the_callbacks_it_is_told(
    monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """Not those its own PROGRAMS would name: the parent's hashed the build id. A fake bcc: the
    child dumps what it is asked for, by name."""
    dumped: list[str] = []
    body = INSN.pack(0xB7, 0, 0, 0) + INSN.pack(0x95, 0, 0, 0)  # r0 = 0; exit

    class FakeBPF:
        module = None

        def __init__(self, **_: object) -> None:
            pass

        def dump_func(self, name: bytes) -> bytes:
            dumped.append(name.decode())
            return body

        def cleanup(self) -> None:
            pass

    lib = SimpleNamespace(
        bpf_num_tables=lambda _: 0,
        bpf_table_name=SimpleNamespace(),  # no maps: never called
        bpf_table_fd_id=SimpleNamespace(),
        bpf_module_license=lambda _: b"GPL",
        bpf_module_kern_version=lambda _: 0,
    )
    monkeypatch.setitem(sys.modules, "bcc", SimpleNamespace(BPF=FakeBPF, lib=lib))
    args = {
        "entry_file": "x.c",
        "cflags": [],
        "build": "abcdef012345",
        "programs": {PROG_FROM_POD: 3},
        "bpf_loop": True,
        "callbacks": ["ekp_told_callback"],
    }
    assert compile_mod.main([json.dumps(args)]) == 0
    obj = BpfObject.from_json(capsysbinary.readouterr().out)
    assert dumped == [PROG_FROM_POD, "ekp_told_callback"]
    assert [f.name for f in obj.functions] == ["ekp_told_callback"]


def test_the_build_id_follows_a_headers_package_replaced_in_place(tmp_path: Path) -> None:
    """Same release, same paths, new headers (a package rebuilt and reinstalled over the old: dpkg
    writes each file anew, with the package's mtime): another build, so the compile cache's
    object of the old headers is not loaded. Reinstalling the same package is the same build."""
    mod = tmp_path / "lib-modules-release"
    mod.mkdir()
    for tree, markers in compile_mod.HEADER_MARKERS.items():
        root = tmp_path / f"usr-src-{tree}"
        for rel in markers:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(f"{rel} of the first package\n")
            os.utime(root / rel, ns=(1_700_000_000 * 10**9, 1_700_000_000 * 10**9))
        (mod / tree).symlink_to(root)
    before = compile_mod.kernel_headers(str(mod))
    real = os.path.realpath(tmp_path)  # kernel_headers names the trees resolved: tmp_path may not be
    assert os.path.join(real, "usr-src-build") in before and os.path.join(real, "usr-src-source") in before
    assert compile_mod.kernel_headers(str(mod)) == before

    def reinstall(rel: str, text: str, mtime_s: int) -> None:
        path = tmp_path / "usr-src-build" / rel
        new = path.with_name(path.name + ".dpkg-new")
        new.write_text(text)
        os.utime(new, ns=(mtime_s * 10**9, mtime_s * 10**9))
        os.replace(new, path)

    autoconf = "include/generated/autoconf.h"
    reinstall(autoconf, f"{autoconf} of the first package\n", 1_700_000_000)
    assert compile_mod.kernel_headers(str(mod)) == before, "the same package again: the same build"
    reinstall(autoconf, f"{autoconf} of the second package\n", 1_700_100_000)
    assert compile_mod.kernel_headers(str(mod)) != before


def test_a_changed_prog_type_is_another_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile child records each program's type in the object: a type changed in PROGRAMS
    must not load a cached object of the old one."""
    before = Datapath("/x", SMALL).build()
    name, spec = next(iter(PROGRAMS.items()))
    monkeypatch.setitem(PROGRAMS, name, replace(spec, prog_type=spec.prog_type + 1))
    assert Datapath("/x", SMALL).build() != before


def test_the_pin_directory_is_not_part_of_the_build() -> None:
    """One build per source, whatever the pin directory and the sizes: the maps are bound and
    sized at load (tests/ebpf/test_onebuild.py: every size and IPv6 switch)."""
    a = Datapath("/sys/fs/bpf/node-a", SMALL)
    assert a.build() == Datapath("/sys/fs/bpf/node-b", SMALL).build()
    assert a.build() == Datapath("/sys/fs/bpf/node-a", replace(SMALL, fe=256)).build()


def test_importing_and_using_the_agent_s_ebpf_modules_never_loads_bcc() -> None:
    code = (
        "import sys, agent.cli, agent.ebpf.proxier, agent.ebpf.loader, agent.ebpf.maps, agent.inspect; "
        "assert 'bcc' not in sys.modules, sorted(m for m in sys.modules if m.startswith('bcc'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _prog_pins(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(PROG_PIN_PREFIX))


def _pinned_ids(pins: str, specs: Iterable[MapSpec] = MAPS.values()) -> dict[str, int]:
    out = {}
    for spec in specs:
        fd = obj_get(os.path.join(pins, spec.name))
        try:
            out[spec.name] = map_info(fd).id
        finally:
            os.close(fd)
    return out


def _tail_calls(pins: str, d: Datapath) -> dict[str, list[int]]:
    """The program ids each pinned program array of `d`'s build holds, by index."""
    out: dict[str, list[int]] = {}
    for name, progs in TAIL_CALLS.items():
        fd = bpfsys.obj_get(prog_pin(pins, d.load_id(d.programs()), name))
        assert fd >= 0, name
        try:
            ids = []
            for index in range(len(progs)):
                value = ctypes.c_uint32()
                assert bpfsys.map_lookup_elem(fd, ctypes.c_uint32(index), value) == 0, (name, index)
                ids.append(value.value)
            out[name] = ids
        finally:
            os.close(fd)
    return out


def _uses_only_its_own_maps(d: Datapath) -> set[int]:
    """The ids of `d`'s pinned maps, after checking each program uses them and, the tc and XDP
    programs, one map of their own (the socket programs none)."""
    ids = {m.info().id for m in d.maps.values()}
    for name in PROGRAMS:
        used = prog_map_ids(d.prog_fd(name))
        assert used & ids, "the programs use the pinned maps"
        # the IPv4 programs of tc and XDP: their scratch, the program array of their IPv6 packets
        # and the build's hand-over mode; the IPv6 programs their scratch
        ipv4 = (PROG_FROM_POD, PROG_FROM_NET, PROG_EGRESS, PROG_XDP_NET)
        private = 3 if name in ipv4 else 1 if name in loader.TC6_PROGRAMS else 2
        private = private if PROGRAMS[name].prog_type in (PROG_SCHED_CLS, PROG_XDP) else 0
        assert len(used - ids) == private == PRIVATE_MAPS[name], f"{name}: besides them, only its load's own"
    return ids


def _no_compile(*args: object, **kwargs: object) -> object:
    raise AssertionError("compiled, though the build was in the cache")


@pytest.fixture(scope="module")
def cache(session_dir: str) -> ObjectCache:
    """The run's cache for this module (shared by its run groups, on whichever workers), holding
    the one build every size here shares: the machine's object (lab/precompile.py compiles it
    beside the lint step, and the packet lab and the lab agents load it), else compiled into the
    machine's cache by an agent process whose own memory never sees bcc (the compiler child
    does), so the run compiles it once in all. A copy of its own: a test here replaces its entry."""
    cache = ObjectCache(os.path.join(session_dir, "test_compile-objects"))
    machine = ObjectCache(default_cache_dir())
    build = Datapath("/x", SMALL).build()
    with cache.compiling(build):
        if cache.get(build) is None:
            with machine.compiling(build):
                obj = machine.get(build)
                if obj is None:
                    obj = _compiled_by_a_child_without_bcc(SMALL, build)
                    machine.put(obj)
            cache.put(obj)
    assert cache.get(build) is not None, "what the child compiled is kept"
    return cache


def _compiled_by_a_child_without_bcc(sizes: MapSizes, build: str) -> BpfObject:
    """`sizes`' data path compiled and loaded by an agent process that never imports bcc (the
    compiler child does), into a cache of its own: what it compiled."""
    with tempfile.TemporaryDirectory() as own, bpffs() as root:
        loads_without_bcc = (
            "import logging, sys; from agent.ebpf.loader import Datapath; from agent.config import MapSizes; "
            "logging.basicConfig(level=logging.INFO); "
            f"d = Datapath({str(root / 'ekp')!r}, MapSizes(**{sizes.__dict__!r})); d.load(); d.close(); "
            "assert 'bcc' not in sys.modules, 'compiling must happen in a child process'"
        )
        env = {**os.environ, DIR_ENV: os.path.join(own, "cache")}
        res = subprocess.run(
            [sys.executable, "-c", loads_without_bcc], env=env, capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr
        assert "data path compiled in" in res.stderr
        obj = ObjectCache(os.path.join(own, "cache")).get(build)
    assert obj is not None, "what the child compiled is kept"
    return obj


@pytest.mark.kernel
@pytest.mark.run_group("new-sizes")
def test_a_second_load_reuses_the_pinned_programs_and_new_sizes_load_the_same_build_again(
    caplog: pytest.LogCaptureFixture, cache: ObjectCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    with bpffs() as root:
        pins = str(root / "ekp")
        first = Datapath(pins, SMALL, cache=cache)
        first.load()
        first.close()
        built = _prog_pins(pins)
        assert len(built) == len(PROGRAMS) + len(TAIL_CALLS) + len(BUILD_MAPS), (
            "each program, each program array, each map of the build"
        )
        caplog.clear()
        again = Datapath(pins, SMALL, cache=cache)
        again.load()
        try:
            _uses_only_its_own_maps(again)
            assert _tail_calls(pins, again) == {
                array: [prog_id(again.prog_fd(name)) for name in names] for array, names in TAIL_CALLS.items()
            }, "the pinned program arrays still hold the reused IPv6 programs"
        finally:
            again.close()
        assert "data path reused" in caplog.text, "a restart reuses the pinned programs"
        assert _prog_pins(pins) == built

        # Other sizes are the same build (sizes are the load's, not compiled in): no compile, the
        # object from the cache, and the pinned programs loaded again, not reused, as the maps they
        # use are gone (the existing pins must match the sizes, so start from an empty directory of
        # maps); pinned under the same names, with the new sizes' maps.
        for name in os.listdir(pins):
            if not name.startswith(PROG_PIN_PREFIX):
                os.unlink(os.path.join(pins, name))
        caplog.clear()
        monkeypatch.setattr(loader, "compile_in_child", _no_compile)
        bigger = Datapath(pins, BIGGER, cache=cache)
        bigger.load()
        try:
            assert bigger.build() == again.build()
            assert bigger.release_older_builds() == [], "no other build's pins"
            assert {role: m.info().max_entries for role, m in bigger.maps.items()} == {
                role: loader.map_size(spec, BIGGER) for role, spec in MAPS.items()
            }
            assert {n: prog_id(bigger.prog_fd(n)) for n in bigger.programs()}.keys() == set(PROGRAMS)
            _uses_only_its_own_maps(bigger)
        finally:
            bigger.close()
        assert "data path reused" not in caplog.text
        assert "data path loaded from the compile cache" in caplog.text
        assert _prog_pins(pins) == built


@pytest.mark.kernel
def test_one_compile_serves_every_pin_directory_and_they_share_no_map(
    caplog: pytest.LogCaptureFixture, cache: ObjectCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two agents on one machine (two lab nodes) load what one compile made, each against maps of
    its own, created with the layout bpftool shows."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(loader, "compile_in_child", _no_compile)
    with bpffs() as root:
        a = Datapath(str(root / "node-a"), SMALL, cache=cache)
        b = Datapath(str(root / "node-b"), SMALL, cache=cache)
        a.load()
        b.load()
        try:
            assert caplog.text.count("data path loaded from the compile cache") == 2
            ids_a, ids_b = _uses_only_its_own_maps(a), _uses_only_its_own_maps(b)
            assert not ids_a & ids_b, "no map shared between the two pin directories"
            assert _pinned_ids(str(root / "node-b")) == {m.spec.name: m.info().id for m in b.maps.values()}
            for name in PROGRAMS:
                own_a, own_b = prog_map_ids(a.prog_fd(name)) - ids_a, prog_map_ids(b.prog_fd(name)) - ids_b
                assert not own_a & own_b, "nor their scratch memory"
            dumped = subprocess.run(
                ["bpftool", "-j", "map", "dump", "pinned", str(root / "node-b" / MAPS["cfgsel"].name)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            assert '"formatted"' in dumped, "maps created from the cache carry the compiler's BTF"
        finally:
            a.close()
            b.close()


@pytest.mark.kernel
def test_programs_whose_maps_were_replaced_are_loaded_again(
    caplog: pytest.LogCaptureFixture, cache: ObjectCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(loader, "compile_in_child", _no_compile)
    with bpffs() as root:
        pins = str(root / "ekp")
        first = Datapath(pins, SMALL, cache=cache)
        first.load()
        old_fe = first.maps["fe"].info().id
        users = {name for name in PROGRAMS if old_fe in prog_map_ids(first.prog_fd(name))}
        first.close()
        assert {"ekp_from_pod", "ekp_from_net", "ekp_sock_conn"} <= users, "the frontends' readers"
        built = _prog_pins(pins)
        os.unlink(os.path.join(pins, MAPS["fe"].name))  # a new, empty map will be made
        caplog.clear()
        second = Datapath(pins, SMALL, cache=cache)
        second.load()
        try:
            assert "pinned program ekp_from_pod uses maps that are no longer pinned" in caplog.text
            assert "data path loaded from the compile cache" in caplog.text
            fe = second.maps["fe"].info().id
            for name in PROGRAMS:
                used = prog_map_ids(second.prog_fd(name))
                assert old_fe not in used, f"{name} still uses the map that was replaced"
                assert (fe in used) == (name in users), "the new programs use the new map"
            _uses_only_its_own_maps(second)
            assert _prog_pins(pins) == built, "same build, pinned again under the same names"
        finally:
            second.close()


class _MapsPinned(Exception):
    """Raised by `_stop_at_maps_pinned`: a load that fails once its maps are pinned."""


def _stop_at_maps_pinned() -> None:
    raise _MapsPinned


@pytest.mark.kernel
def test_socket_programs_whose_own_map_was_replaced_are_loaded_again(
    caplog: pytest.LogCaptureFixture, cache: ObjectCache
) -> None:
    """Private maps are counted per program (loader.PRIVATE_MAPS): a socket program has none of
    its own, so one map it uses that is not pinned now is a map that was replaced, though the tc
    ingress programs may have two. With one count for every program, the socket programs of a map
    only they use kept the replaced one. The replacement here: another agent's map of the same
    shape pinned under the name (a load that pinned its maps and failed before its programs)."""
    caplog.set_level(logging.INFO)
    with bpffs() as root:
        pins, other = str(root / "ekp"), str(root / "other")
        first = Datapath(pins, SMALL, cache=cache)
        first.load()
        users = {
            role: {
                name for name in PROGRAMS if first.maps[role].info().id in prog_map_ids(first.prog_fd(name))
            }
            for role in MAPS
        }
        first.close()
        role = next(r for r, u in sorted(users.items()) if u and not any(PRIVATE_MAPS[n] for n in u))
        old = _pinned_ids(pins)[MAPS[role].name]
        # Stopped where its maps are pinned and no program is loaded yet: that load's maps are
        # the replacement, and the verifier's seconds for a second full data path are spared.
        replacement = Datapath(other, SMALL, cache=cache)
        with pytest.raises(_MapsPinned):
            replacement.load(maps_ready=_stop_at_maps_pinned)
        try:
            assert not _prog_pins(other), "the replacement load stopped before its programs"
            os.unlink(os.path.join(pins, MAPS[role].name))
            fd = obj_get(os.path.join(other, MAPS[role].name))
            try:
                assert bpfsys.obj_pin(fd, os.path.join(pins, MAPS[role].name)) == 0
            finally:
                os.close(fd)
        finally:
            replacement.close()
        caplog.clear()
        second = Datapath(pins, SMALL, cache=cache)
        second.load()
        try:
            assert "uses maps that are no longer pinned" in caplog.text, role
            for name in sorted(users[role]):
                assert old not in prog_map_ids(second.prog_fd(name)), f"{name} still uses the replaced {role}"
            _uses_only_its_own_maps(second)
        finally:
            second.close()


def test_the_tc_ipv6_paths_tables_take_their_ipv4_twins_sizes_where_it_serves() -> None:
    """Where the tc IPv6 path serves, each of its tables is sized as its IPv4 twin: ekp_ct6_any and
    its fragment tables too, now that it translates UDP (before, ekp_ct6_any held one entry with
    the path on: no program wrote it); where it does not, each holds one entry."""
    want = {"ct6_tcp": SMALL.ct_tcp, "ct6_any": SMALL.ct_any, "frag6": SMALL.frag, "frhold6": SMALL.fraghold}
    assert {r: loader.map_size(MAPS[r], SMALL) for r in want} == want
    assert loader.map_size(MAPS["ctq6_any"], SMALL) == loader.map_size(MAPS["ctq_any"], SMALL)
    off = replace(SMALL, ipv6_tc=False)
    assert {loader.map_size(MAPS[r], off) for r in loader.TC6_ROLES} == {loader.IDLE_SIZE}


@pytest.mark.kernel
@pytest.mark.run_group("ipv6-builds")
def test_the_xdp_programs_are_loaded_only_where_xdp_attaches_and_ipv6s_where_the_kernel_has_its_helper(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, cache: ObjectCache
) -> None:
    """Neither XDP program (ekp_xdp_net, ekp_xdp_net6) is verified nor pinned where XDP cannot
    attach (MapSizes.xdp false with --bpf-xdp=disabled): ekp_xcalls6 is there, empty, and the tc
    programs and their IPv6 path serve all the same. ekp_xdp_net6 is loaded only where the kernel
    has bpf_xdp_load_bytes (5.18; on 5.12-5.17 the verifier refused it and with it the whole
    build): without it ekp_xcalls6 is empty, and the log line says why. Each is a load id of the
    one build (a lab agent's sizes: no compile of their own)."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(loader, "compile_in_child", _no_compile)
    with bpffs() as root:
        pins = str(root / "ekp")
        d = Datapath(pins, replace(AGENT, xdp=False), cache=cache)
        d.load()
        try:
            assert not d.has_program(PROG_XDP_NET6)
            assert not d.has_program(PROG_XDP_NET)
            assert not [p for p in _prog_pins(pins) if p.endswith((PROG_XDP_NET6, PROG_XDP_NET))]
            assert d.has_program(PROG_FROM_NET) and d.has_program(PROG_FROM_NET6)
            assert _slots(pins, d, "ekp_xcalls6") == [0]
            assert 0 not in _slots(pins, d), "the tc IPv6 path serves all the same"
            assert (
                "at XDP passed on to tc (ekp_xdp_net6 not loaded: no XDP program is loaded "
                "(--bpf-xdp=disabled" in (caplog.text)
            )
            disabled = d.load_id(d.programs())
        finally:
            d.close()
        lacking = kernel_needs() - {"bpf_xdp_load_bytes"}
        monkeypatch.setattr(loader, "vmlinux_has", lambda names: set(names) & lacking)
        caplog.clear()
        d = Datapath(pins, AGENT, cache=cache)
        d.load()
        try:
            assert not d.has_program(PROG_XDP_NET6)
            assert d.has_program(PROG_XDP_NET)
            assert d.load_id(d.programs()) != disabled
            assert (
                "this kernel lacks bpf_xdp_load_bytes: loading the data path without ekp_xdp_net6"
                in caplog.text
            )
            assert "ekp_xdp_net6 not loaded: this kernel lacks bpf_xdp_load_bytes, Linux 5.18" in caplog.text
            assert _slots(pins, d, "ekp_xcalls6") == [0]
        finally:
            d.close()
        monkeypatch.setattr(loader, "vmlinux_has", vmlinux_has)
        caplog.clear()
        d = Datapath(pins, AGENT, cache=cache)
        d.load()
        try:
            assert _slots(pins, d, "ekp_xcalls6") == [prog_id(d.prog_fd(PROG_XDP_NET6))]
            assert "and at XDP in ekp_xdp_net6" in caplog.text
        finally:
            d.close()


def test_a_program_these_sizes_leave_out_is_not_reported_missing_for_the_kernel(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --bpf-xdp=disabled (MapSizes.xdp false) ekp_xdp_net6 is left out whatever the kernel
    has: a kernel lacking bpf_xdp_load_bytes is nothing to warn about there. With XDP it is."""
    lacking = kernel_needs() - {"bpf_xdp_load_bytes"}
    monkeypatch.setattr(loader, "vmlinux_has", lambda names: set(names) & lacking)
    assert PROG_XDP_NET6 not in Datapath("/nonexistent", replace(AGENT, xdp=False)).programs()
    assert "this kernel lacks" not in caplog.text
    assert PROG_XDP_NET6 not in Datapath("/nonexistent", AGENT).programs()
    assert "this kernel lacks bpf_xdp_load_bytes: loading the data path without ekp_xdp_net6" in caplog.text


@pytest.mark.kernel
def test_the_ipv6_maps_are_added_beside_the_pins_of_an_agent_that_had_none(
    caplog: pytest.LogCaptureFixture, cache: ObjectCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upgrade to the IPv6 maps is additive: over pins without them (an agent before them), the
    load makes the IPv6 maps and keeps every other pinned map, the same map with its entries (an
    established IPv4 flow's conntrack entry here), and the programs use both."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(loader, "compile_in_child", _no_compile)
    v6 = {role for role, spec in MAPS.items() if spec.pair}
    assert v6 == {
        "fe6",
        "slot6",
        "be6",
        "rnat6",
        "member6",
        "srcr6",
        "addr6",
        "aff6",
        "sknat6",
        "ct6_tcp",
        "ct6_any",
        "frag6",
        "frhold6",
        "hostnat6",
    }
    key = CtKey(ip_be("10.244.1.5"), ip_be("10.96.0.10"), port_be(40000), port_be(80), 6, 0)
    with bpffs() as root:
        pins = str(root / "ekp")
        first = Datapath(pins, SMALL, cache=cache)
        first.load()
        first.maps["ct_tcp"].update(key, CtEntry(last_seen_ns=1, nat_addr=ip_be("10.244.2.7"), flags=4))
        first.close()
        for role in v6:
            os.unlink(os.path.join(pins, MAPS[role].name))
        before = _pinned_ids(pins, [spec for role, spec in MAPS.items() if role not in v6])
        second = Datapath(pins, SMALL, cache=cache)
        second.load()
        try:
            after = _pinned_ids(pins)
            assert {n: i for n, i in after.items() if n in before} == before, "every IPv4 map kept"
            assert set(after) - set(before) == {MAPS[r].name for r in v6}
            kept = second.maps["ct_tcp"].lookup(key)
            assert isinstance(kept, CtEntry) and kept.nat_addr == ip_be("10.244.2.7")
            conn6 = prog_map_ids(second.prog_fd("ekp_sock_conn6"))
            assert {second.maps[r].info().id for r in ("fe6", "be6", "fe", "be")} <= conn6
        finally:
            second.close()


def _slots(pins: str, d: Datapath, array: str = "ekp_calls6") -> list[int]:
    """The program ids the program array `array` of `d`'s build holds, 0 for an empty slot."""
    fd = bpfsys.obj_get(prog_pin(pins, d.load_id(d.programs()), array))
    assert fd >= 0
    try:
        out = []
        for index in range(len(TAIL_CALLS[array])):
            value = ctypes.c_uint32()
            ret = bpfsys.map_lookup_elem(fd, ctypes.c_uint32(index), value)
            assert ret in (0, -errno.ENOENT), os.strerror(-ret)
            out.append(value.value if ret == 0 else 0)
        return out
    finally:
        os.close(fd)


@pytest.mark.kernel
@pytest.mark.run_group("ipv6-builds")
def test_the_tc_ipv6_path_switched_off_and_on_resizes_its_conntrack_alone_and_sets_its_tail_calls(
    caplog: pytest.LogCaptureFixture, cache: ObjectCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the tc programs' IPv6 path (MapSizes.ipv6_tc false: no IPv6 half, or no socket-level
    load balancing) its conntrack tables, their early-drop rings, its fragment tables and
    ekp_hostnat6 hold one entry
    each, ekp_calls6 is empty and its programs are neither loaded (verified) nor pinned; a restart
    with it loads and pins them, recreates every one of those tables at its IPv4 twin's size and
    fills the array; a restart without it again shrinks them and empties it. The rings' head
    (ekp_ctqh6) is recreated with them. Every other pinned map is the
    same map throughout, and an established IPv4 flow's conntrack entry is kept. (A lab agent's
    sizes, the lab's IPv4-only and dual-stack agents': one build, never compiled here.)"""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(loader, "compile_in_child", _no_compile)
    off, on = replace(AGENT, ipv6_tc=False), AGENT
    # The IPv6 rings' head goes with them (replace_resized_ipv6_pins).
    tc6 = {MAPS[r].name for r in (*loader.TC6_ROLES, "ctqh6")}
    key = CtKey(ip_be("10.244.1.5"), ip_be("10.96.0.10"), port_be(40000), port_be(80), 6, 0)
    with bpffs() as root:
        pins = str(root / "ekp")
        first = Datapath(pins, off, cache=cache)
        first.load()
        try:
            assert {r: first.maps[r].info().max_entries for r in loader.TC6_ROLES} == dict.fromkeys(
                loader.TC6_ROLES, 1
            )
            assert _slots(pins, first) == [0, 0, 0], "no IPv6 program behind the IPv4 ones"
            assert not [p for p in _prog_pins(pins) if p.endswith(tuple(loader.TC6_PROGRAMS))], (
                "the IPv6 programs neither verified nor pinned where nothing reaches them"
            )
            assert not any(first.has_program(n) for n in loader.TC6_PROGRAMS)
            assert all(first.has_program(n) for n in set(PROGRAMS) - loader.TC6_PROGRAMS)
            first.maps["ct_tcp"].update(key, CtEntry(last_seen_ns=1, nat_addr=ip_be("10.244.2.7"), flags=4))
        finally:
            first.close()
        before = _pinned_ids(pins)
        # AGENT's IPv4 sizes for the tables, a quarter of them for their rings
        full = {
            "ct6_tcp": AGENT.ct_tcp,
            "ct6_any": AGENT.ct_any,
            "ctq6_tcp": AGENT.ct_tcp // 4,
            "ctq6_any": AGENT.ct_any // 4,
            "frag6": AGENT.frag,
            "frhold6": AGENT.fraghold,
            "hostnat6": AGENT.hostnat,
        }
        idle = dict.fromkeys(full, 1)
        for sizes, entries in ((on, full), (off, idle)):
            caplog.clear()
            d = Datapath(pins, sizes, cache=cache)
            d.load()
            try:
                assert (
                    "IPv6 conntrack, early-drop ring, fragment and host-routing tables "
                    "ekp_ct6_any_v3, ekp_ct6_tcp_v3, ekp_ctq6_any_v3, ekp_ctq6_tcp_v3, ekp_frag6_v2, "
                    "ekp_frhold6_v2, ekp_hostnat6_v2 recreated at "
                ) in caplog.text
                assert "and their rings' head ekp_ctqh6_v3 with them (its 2 entries fresh)" in caplog.text
                assert {r: d.maps[r].info().max_entries for r in loader.TC6_ROLES} == entries
                after = _pinned_ids(pins)
                assert {n: i for n, i in after.items() if n not in tc6} == {
                    n: i for n, i in before.items() if n not in tc6
                }, "every other map kept"
                assert not {after[n] for n in tc6} & {before[n] for n in tc6}, "TCP table, ring recreated"
                kept = d.maps["ct_tcp"].lookup(key)
                assert isinstance(kept, CtEntry) and kept.nat_addr == ip_be("10.244.2.7")
                v6_pins = [p for p in _prog_pins(pins) if p.endswith(tuple(loader.TC6_PROGRAMS))]
                if sizes.ipv6_tc:
                    want = [prog_id(d.prog_fd(n)) for n in TAIL_CALLS["ekp_calls6"]]
                    assert _slots(pins, d) == want, "the array serves the IPv6 programs loaded now"
                    assert sorted(v6_pins) == sorted(
                        os.path.basename(prog_pin(pins, d.load_id(d.programs()), n))
                        for n in loader.TC6_PROGRAMS
                    ), "pinned with their build"
                    ct6_users = prog_map_ids(d.prog_fd("ekp_from_pod6"))
                    assert {d.maps[r].info().id for r in loader.TC6_ROLES} <= ct6_users, "the new tables used"
                else:
                    assert _slots(pins, d) == [0, 0, 0]
                    assert not v6_pins, "the IPv6 programs of the build that served them unpinned with it"
                    assert not any(d.has_program(n) for n in loader.TC6_PROGRAMS)
            finally:
                d.close()
            before = after
        # The same flags again: the pinned programs reused, the array left as it was set.
        again = Datapath(pins, off, cache=cache)
        caplog.clear()
        again.load()
        try:
            assert "data path reused" in caplog.text and "recreated" not in caplog.text
            assert _slots(pins, again) == [0, 0, 0]
        finally:
            again.close()


def _a_cache_whose_entry_does_not_load(
    cache: ObjectCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, BpfObject, BpfObject, ObjectCache, list[object]]:
    """(build, the good object, the broken one, a cache holding the broken one, the compiles made):
    every map reference of the cached entry bound to map 0 (it parses, and the verifier refuses it);
    a compile of the build, stubbed, prints the good object and is recorded."""
    build = Datapath("/x", SMALL).build()
    good = cache.get(build)
    assert good is not None
    compiles: list[object] = []

    def compile_in_child(*args: object) -> tuple[BpfObject, float]:
        compiles.append(args)
        return good, 0.5

    monkeypatch.setattr(loader, "compile_in_child", compile_in_child)
    mine = ObjectCache(str(tmp_path / "cache"))
    broken = replace(
        good, programs=tuple(replace(p, relocs=tuple((i, 0) for i, _ in p.relocs)) for p in good.programs)
    )
    mine.put(broken)
    return build, good, broken, mine, compiles


@pytest.mark.kernel
def test_a_cached_object_that_does_not_load_is_compiled_again(
    caplog: pytest.LogCaptureFixture, cache: ObjectCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache entry is a hint: one that parses but fails to load costs a compile, not the node."""
    caplog.set_level(logging.INFO)
    build, good, _, mine, compiles = _a_cache_whose_entry_does_not_load(cache, tmp_path, monkeypatch)
    with bpffs() as root:
        d = Datapath(str(root / "ekp"), SMALL, cache=mine)
        d.load()
        try:
            assert f"cached data path {build} did not load" in caplog.text
            assert "data path compiled in 0.5s" in caplog.text and len(compiles) == 1
            _uses_only_its_own_maps(d)
            assert mine.get(build) == good, "the fresh compile replaced the broken entry"
        finally:
            d.close()


@pytest.mark.kernel
def test_a_reload_that_does_not_load_from_the_cache_fails_without_compiling(
    cache: ObjectCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxier's reload with the XDP programs (`load(recompile=False)`): the cached object
    loaded the tc programs already, so its failing is the load's; a compile (tens of seconds under
    the proxier's lock, at every retry) would not mend it."""
    build, _, broken, mine, compiles = _a_cache_whose_entry_does_not_load(cache, tmp_path, monkeypatch)
    with bpffs() as root:
        d = Datapath(str(root / "ekp"), SMALL, cache=mine)
        with pytest.raises(DatapathError, match=f"loading the data path \\(build {build}\\) failed"):
            d.load(recompile=False)
        d.close()
    assert not compiles and mine.get(build) == broken, "not compiled, the entry left as it was"


@pytest.mark.kernel
def test_a_pinned_map_of_another_shape_is_refused_at_load(cache: ObjectCache) -> None:
    """The last line of defence: a map pinned under a registry name after the pre-load check must
    still be exactly the compiled one, or nothing is loaded against it."""
    obj = cache.get(Datapath("/x", SMALL).build())
    assert obj is not None
    with bpffs() as root:
        pins = root / "b"
        pins.mkdir()
        fe = obj.maps[obj.map_index(MAPS["fe"].name)]
        fd = bpfsys.map_create(fe.type, fe.key_size, fe.value_size, fe.max_entries * 2, fe.flags, fe.name)
        assert fd >= 0
        try:
            assert bpfsys.obj_pin(fd, str(pins / fe.name)) == 0
        finally:
            os.close(fd)
        with pytest.raises(PinnedMapMismatch, match=f"max_entries is {fe.max_entries * 2}, expected"):
            link(obj, str(pins), {s.name for s in MAPS.values()}, lambda n: str(pins / n))
        assert not _prog_pins(str(pins)), "nothing loaded against the wrong map"
        with pytest.raises(PinMismatchError):
            Datapath(str(pins), SMALL, cache=cache).load()


@pytest.mark.kernel
def test_the_maps_are_pinned_before_the_programs_load_side_by_side(
    cache: ObjectCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first sync writes the maps while the verifier runs (maps_pinned comes first), and the
    verifier runs for several programs at once (it takes seconds for the two largest)."""
    import threading

    from agent.ebpf import link as link_module

    obj = cache.get(Datapath("/x", SMALL).build())
    assert obj is not None
    events: list[str] = []
    running: list[str] = []
    most = [0]
    lock = threading.Lock()
    real = link_module._load

    def load(o: BpfObject, name: str, fds: list[int]) -> int:
        with lock:
            running.append(name)
            most[0] = max(most[0], len(running))
            events.append(f"load {name}")
        try:
            return real(o, name, fds)
        finally:
            with lock:
                running.remove(name)

    monkeypatch.setattr(link_module, "_load", load)
    with bpffs() as root:
        pins = root / "p"
        pins.mkdir()
        maps = {s.name for s in MAPS.values()}

        def pinned() -> None:
            events.append("maps pinned")
            assert maps <= set(os.listdir(pins))

        fds = link(obj, str(pins), maps, lambda n: str(pins / f"{PROG_PIN_PREFIX}{n}"), pinned, threads=2)
        try:
            assert events[0] == "maps pinned" and len(events) == 1 + len(obj.programs)
            assert most[0] == 2
            assert sorted(fds) == sorted(p.name for p in obj.programs)
        finally:
            for fd in fds.values():
                os.close(fd)


def test_the_programs_load_on_every_cpu_but_the_agents_own() -> None:
    assert [verifier_threads(n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]


@pytest.mark.kernel
def test_a_program_the_verifier_refuses_leaves_none_of_the_others_pinned(
    cache: ObjectCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.ebpf import link as link_module
    from agent.ebpf.link import LinkError

    obj = cache.get(Datapath("/x", SMALL).build())
    assert obj is not None
    real = link_module._load
    closed: list[int] = []
    loaded: list[int] = []

    def load(o: BpfObject, name: str, fds: list[int]) -> int:
        if name == "ekp_egress":
            raise LinkError("loading program ekp_egress: refused")
        fd = real(o, name, fds)
        loaded.append(fd)
        return fd

    real_close = os.close

    def close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)

    monkeypatch.setattr(link_module, "_load", load)
    monkeypatch.setattr(os, "close", close)
    with bpffs() as root:
        pins = root / "q"
        pins.mkdir()
        maps = {s.name for s in MAPS.values()}
        with pytest.raises(LinkError, match="ekp_egress: refused"):
            link(obj, str(pins), maps, lambda n: str(pins / f"{PROG_PIN_PREFIX}{n}"), threads=2)
        monkeypatch.undo()
        assert not _prog_pins(str(pins))
        assert loaded and set(loaded) <= set(closed), "every program loaded before the error is closed"


@pytest.mark.kernel
@pytest.mark.run_group("new-sizes")
def test_an_older_build_s_program_array_stays_filled_until_its_programs_are_replaced(
    cache: ObjectCache,
) -> None:
    """The kernel empties a program array when its last user reference goes (attached programs
    hold none): unpinned at the new build's load, the old tc programs still attached would send
    every IPv6 packet to the stack untranslated until the first sync attaches the new ones. The
    old build's array keeps its pin and its programs through the load, and goes with
    release_older_builds, called once the new programs are attached. (The older load here is the
    same build without the XDP programs: another set of programs, pinned under another id, as
    an older build's are; one compile serves both.)"""
    with bpffs() as root:
        pins = str(root / "ekp")
        old = Datapath(pins, replace(SMALL, xdp=False), cache=cache)
        old.load()
        old_array = prog_pin(pins, old.load_id(old.programs()), "ekp_calls6")
        want = [prog_id(old.prog_fd(n)) for n in TAIL_CALLS["ekp_calls6"]]
        old.close()  # in an upgrade its programs stay attached, and hold no reference to the array
        for name in os.listdir(pins):
            if not name.startswith(PROG_PIN_PREFIX):
                os.unlink(os.path.join(pins, name))
        new = Datapath(pins, BIGGER, cache=cache)
        new.load()
        try:
            assert new.load_id(new.programs()) != old.load_id(old.programs())
            assert os.path.exists(old_array), "the old build's program array is still pinned"
            assert _slots(pins, old) == want, "and still holds the old build's IPv6 programs"
            old_prefix = f"{PROG_PIN_PREFIX}{old.load_id(old.programs())}_"
            kept = sorted([*(f"{old_prefix}{array}" for array in TAIL_CALLS), f"{old_prefix}ekp_handover"])
            assert [p for p in _prog_pins(pins) if p.startswith(old_prefix)] == kept, (
                "its programs unpinned, its arrays and its hand-over mode (read by them) alone kept"
            )
            assert new.release_older_builds() == kept
            assert not os.path.exists(old_array)
            assert new.release_older_builds() == []
        finally:
            new.close()


def test_ekp_egress6_is_filled_first_and_emptied_last_in_its_program_array() -> None:
    """The loader's slot order for the IPv6 path's program array (ekp_calls6): ekp_egress6 before
    the ingress programs when the path is switched on, after them when it is switched off, so an
    IPv6 packet ingress handed to the stack under legacy host routing always finds its egress half
    (a first start attaches egress before ingress for the same reason)."""
    names = TAIL_CALLS["ekp_calls6"]
    assert PROG_EGRESS6 in names and names.index(PROG_EGRESS6) > 0, "the order comes from the sort"
    filling = loader.tail_call_order(names, filling=True)
    emptying = loader.tail_call_order(names, filling=False)
    assert filling[0] == (names.index(PROG_EGRESS6), PROG_EGRESS6)
    assert emptying[-1] == (names.index(PROG_EGRESS6), PROG_EGRESS6)
    assert sorted(filling) == sorted(emptying) == list(enumerate(names)), "every slot, once"
