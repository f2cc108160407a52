"""agent.ebpf.maps: FakeMap (pure) and BpfMap on real maps (kernel) behave the same way."""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Iterator
from dataclasses import replace

import pytest

from agent.ebpf import abi
from agent.ebpf.abi import MAPS, Stat
from agent.ebpf.loader import Datapath
from agent.ebpf.maps import BpfMap, FakeMap, MapError, MapFullError, MapWriter, UpdateFlag, read_stats
from lab.dplab import SIZES
from lab.packets import loaded_datapath

# The packet lab's sizes (fe 256, conntrack 4096 and 4096): its build is compiled once for the
# whole run (lab/precompile.py), where sizes of this module's own were a compile (about 19 CPU s)
# of their own. Filling its 256 frontends costs nothing next to that.


def fe_key(i: int) -> abi.FrontendKey:
    return abi.FrontendKey(abi.ip_be(f"10.96.{i >> 8}.{i & 0xFF}"), abi.port_be(80), 6, abi.Scope.INTERNAL)


def fe_value(i: int) -> abi.Frontend:
    return abi.Frontend(set_id=i, count=1, rev_nat_id=i)


def check_writer(m: MapWriter, size: int) -> None:
    """The MapWriter contract, run against both implementations."""
    assert m.items() == []
    assert m.lookup(fe_key(1)) is None
    m.update(fe_key(1), fe_value(1))
    assert m.lookup(fe_key(1)) == fe_value(1)
    with pytest.raises(MapError) as exists:
        m.update(fe_key(1), fe_value(2), UpdateFlag.NOEXIST)
    assert exists.value.errno == errno.EEXIST
    with pytest.raises(MapError) as missing:
        m.update(fe_key(2), fe_value(2), UpdateFlag.EXIST)
    assert missing.value.errno == errno.ENOENT
    assert (m.count(), m.capacity()) == (1, size)
    m.update_batch([(fe_key(i), fe_value(i)) for i in range(2, size + 1)])
    assert m.count() == size
    assert sorted(m.items(), key=lambda kv: bytes(kv[0])) == sorted(
        [(fe_key(i), fe_value(i)) for i in range(1, size + 1)], key=lambda kv: bytes(kv[0])
    )
    with pytest.raises(MapFullError, match="--bpf-fe-max"):
        m.update(fe_key(size + 1), fe_value(1))
    assert m.delete_batch([fe_key(1), fe_key(2), fe_key(size + 1)]) == 2  # the last never written
    assert m.delete(fe_key(3)) is True
    assert m.delete(fe_key(3)) is False
    assert len(m.items()) == size - 3
    with pytest.raises(TypeError):
        m.update(abi.BackendKey(1), fe_value(1))


def test_fake_map_contract() -> None:
    check_writer(FakeMap(MAPS["fe"], max_entries=8), 8)


def test_fake_lru_map_evicts_instead_of_failing() -> None:
    ct = FakeMap(MAPS["ct_tcp"], max_entries=2)
    for port in range(3):
        ct.update(abi.CtKey(sport=port), abi.CtEntry())
    assert [bytes(k) for k, _ in ct.items()] == [bytes(abi.CtKey(sport=p)) for p in (1, 2)]


def test_fake_map_stores_copies() -> None:
    m = FakeMap(MAPS["fe"])
    value = fe_value(1)
    m.update(fe_key(1), value)
    value.count = 9
    assert m.lookup(fe_key(1)) == fe_value(1)


@pytest.fixture(scope="module")
def dp() -> Iterator[Datapath]:
    with loaded_datapath(SIZES) as datapath:
        yield datapath


@pytest.mark.kernel
def test_bpf_map_contract(dp: Datapath) -> None:
    dp.maps["fe"].clear()
    check_writer(dp.maps["fe"], SIZES.fe)
    dp.maps["fe"].clear()


@pytest.mark.kernel
def test_lpm_trie_without_batch_support(dp: Datapath) -> None:
    srcr = dp.maps["srcr"]
    entries = [(abi.SrcRangeKey(32 + 24, i, 0, abi.ip_be(f"10.{i}.0.0")), abi.SrcRange(1)) for i in range(3)]
    srcr.update_batch(entries)  # the LPM trie has no batch ops: falls back to a loop
    assert len(srcr.items()) == 3
    assert srcr.delete_batch([k for k, _ in entries]) == 3
    assert srcr.items() == []


@pytest.mark.kernel
def test_percpu_stats_are_summed(dp: Datapath) -> None:
    stats = dp.maps["stats"]
    stats.clear()
    stats.update(ctypes.c_uint32(Stat.DROP_FIB), ctypes.c_uint64(5))
    assert read_stats(stats)[Stat.DROP_FIB] == 5
    per_cpu = stats.lookup_percpu(ctypes.c_uint32(Stat.DROP_FIB))
    assert sum(int(getattr(v, "value", 0)) for v in per_cpu) == 5
    stats.clear()
    assert set(read_stats(stats).values()) == {0}


@pytest.mark.kernel
def test_reopening_a_pin_sees_the_same_map(dp: Datapath) -> None:
    dp.maps["be"].update(abi.BackendKey(5), abi.Backend(abi.ip_be("10.244.1.5"), abi.port_be(8080), 6, 1))
    with BpfMap.open_pinned(MAPS["be"], dp.pin_path) as again:
        assert again.lookup(abi.BackendKey(5)) == abi.Backend(
            abi.ip_be("10.244.1.5"), abi.port_be(8080), 6, 1
        )
        assert again.info().id == dp.maps["be"].info().id
    dp.maps["be"].clear()


@pytest.mark.kernel
def test_reload_reuses_pins_and_refuses_other_sizes(dp: Datapath) -> None:
    """A restarted agent re-adopts the pinned maps (conntrack survives); a resized one is refused."""
    key = abi.CtKey(abi.ip_be("10.244.1.9"), abi.ip_be("10.96.0.10"), 1, 2, 6)
    dp.maps["ct_tcp"].update(key, abi.CtEntry(backend_id=3))
    with Datapath(dp.pin_path, SIZES) as again:
        assert again.maps["ct_tcp"].info().id == dp.maps["ct_tcp"].info().id
        assert again.maps["ct_tcp"].lookup(key) == abi.CtEntry(backend_id=3)
    held, asked = SIZES.ct_tcp, 2 * SIZES.ct_tcp
    refused = rf"ekp_ct_tcp_v2: max_entries is {held}, expected {asked}.*--cleanup"
    with pytest.raises(Exception, match=refused):
        Datapath(dp.pin_path, replace(SIZES, ct_tcp=asked)).load()
    dp.maps["ct_tcp"].clear()


@pytest.mark.kernel
def test_pinned_sizes_keep_derived_conntrack_sizes_across_restarts(dp: Datapath) -> None:
    """A derived (unset) conntrack size takes the pinned table's, so a restart on a machine whose
    CPU count changed neither resizes (a new, empty table) nor refuses to start."""
    from agent.config import ConntrackSettings
    from agent.ebpf.loader import pinned_sizes

    held = pinned_sizes(dp.pin_path)
    assert (held["ct_tcp"], held["ct_any"], held["fe"]) == (SIZES.ct_tcp, SIZES.ct_any, SIZES.fe)
    unset = replace(SIZES, ct_tcp=0, ct_any=0)
    resolved = unset.with_conntrack(ConntrackSettings(max_per_core=1 << 20), 64, held)
    assert (resolved.ct_tcp, resolved.ct_any) == (SIZES.ct_tcp, SIZES.ct_any)
    with Datapath(dp.pin_path, resolved) as again:
        assert again.maps["ct_tcp"].info().id == dp.maps["ct_tcp"].info().id


@pytest.mark.kernel
def test_pin_made_with_other_map_flags_is_refused() -> None:
    """A conntrack pin with per-CPU LRU lists (same layout, BPF_F_NO_COMMON_LRU) is not reused."""
    import subprocess

    from agent.ebpf.loader import PinMismatchError
    from lab.packets import bpffs

    spec = MAPS["ct_tcp"]
    with bpffs() as root:
        pins = root / "ekp"
        pins.mkdir()
        argv = ["bpftool", "map", "create", str(pins / spec.name), "type", "lru_hash"]
        argv += ["key", str(ctypes.sizeof(spec.key)), "value", str(ctypes.sizeof(spec.value))]
        argv += ["entries", str(SIZES.ct_tcp), "name", spec.name, "flags", "2"]
        subprocess.run(argv, check=True, capture_output=True)
        with pytest.raises(PinMismatchError, match=r"ekp_ct_tcp_v2: flags is 2, expected 0.*--cleanup"):
            Datapath(str(pins), SIZES).load()
