"""One compile per source, whatever the map sizes and whichever programs a load takes (issue 18
item 5): the object declares placeholders for the sizes MapSizes decides, the loader creates each
map at its size, and the early-drop rings' slot counts reach the programs through their heads."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from agent.config import ConntrackSettings, MapSizes
from agent.ebpf import bpfsys, loader
from agent.ebpf.abi import CT_QUEUES, CTQ_HEADS, MAPS, CtqRing, MapSpec, Writer
from agent.ebpf.compile import compile_in_child
from agent.ebpf.link import link
from agent.ebpf.loader import Datapath
from agent.ebpf.maps import BpfMap, obj_pin
from agent.ebpf.objcache import ObjectCache, default_cache_dir
from lab.dplab import SIZES as PACKET_LAB_SIZES
from lab.packets import bpffs

AGENT = MapSizes().with_conntrack(ConntrackSettings(), os.cpu_count() or 1)
SMALL = MapSizes(fe=128, slot=256, ct_tcp=1024, ct_any=1024, frag=64)
EVERY_SIZES = {
    "packet lab": PACKET_LAB_SIZES,
    "agent defaults": MapSizes(),
    "agent, conntrack derived": AGENT,
    "agent, tc IPv6 path off": replace(AGENT, ipv6_tc=False),
    "agent, no XDP": replace(AGENT, xdp=False),
    "small": SMALL,
}


def test_every_size_and_ipv6_switch_is_one_build() -> None:
    builds = {what: Datapath("/x", sizes).build() for what, sizes in EVERY_SIZES.items()}
    assert len(set(builds.values())) == 1, builds
    assert Datapath("/x", replace(SMALL, maglev_table_size=251)).build() != builds["small"], (
        "the Maglev table size is ekp_maglev's value layout: compiled in"
    )


def _slot_counts(d: Datapath) -> dict[str, tuple[int, int]]:
    """Each ring's (slot count its head gives the programs, the ring map's max_entries)."""
    out = {}
    for table, ring_role in CT_QUEUES.items():
        index = CtqRing.TCP if table.endswith("tcp") else CtqRing.ANY
        head = d.maps[CTQ_HEADS[table]].lookup(ctypes.c_uint32(index))
        assert head is not None
        out[ring_role] = (loader.ring_slots(head.value), d.maps[ring_role].info().max_entries)
    return out


@pytest.mark.kernel
def test_two_agents_of_other_sizes_share_one_compile_and_get_their_own_sizes(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packet lab's sizes with the tc IPv6 path off and an agent's with it on: one object (at
    most one compile, the second load from the cache), each map created at its own load's size
    (read back from the kernel), each ring's slot count in its head; the first pin directory
    restarted with the IPv6 path on resizes its IPv6 rings and their heads follow."""
    caplog.set_level(logging.INFO)
    compiles: list[object] = []
    real = compile_in_child

    def counted(*args: object) -> object:
        compiles.append(args)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "compile_in_child", counted)
    cache = ObjectCache(default_cache_dir())
    lab_off = replace(PACKET_LAB_SIZES, ipv6_tc=False)
    with bpffs() as root:
        for pins, sizes in ((str(root / "a"), lab_off), (str(root / "b"), AGENT)):
            d = Datapath(pins, sizes, cache=cache)
            d.load()
            try:
                assert {role: m.info().max_entries for role, m in d.maps.items()} == {
                    role: loader.map_size(spec, sizes) for role, spec in MAPS.items()
                }
                assert {r: have for r, (have, _) in _slot_counts(d).items()} == {
                    r: ring for r, (_, ring) in _slot_counts(d).items()
                }
            finally:
                d.close()
        assert len(compiles) <= 1, "one object for both"
        assert caplog.text.count("data path loaded from the compile cache") >= 1
        d = Datapath(str(root / "a"), PACKET_LAB_SIZES, cache=cache)
        d.load()
        try:
            counts = _slot_counts(d)
            assert counts["ctq6_tcp"] == (PACKET_LAB_SIZES.ct_tcp // 4,) * 2, "resized, its head told"
            assert all(have == ring for have, ring in counts.values()), counts
        finally:
            d.close()
        assert len(compiles) <= 1


@pytest.mark.kernel
def test_a_retry_after_a_head_pin_went_writes_the_new_heads_slot_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load that failed after our maps were opened, retried after ekp_ctqh's pin was removed:
    link() creates that head anew, and its slot counts are written there too (without them the
    programs would queue at `pos % 0`)."""
    real: Callable[..., object] = link

    def verifier_says_no(*args: Any, **kwargs: Any) -> object:
        maps_pinned = args[4]

        def then_fail() -> None:
            maps_pinned()
            raise RuntimeError("the verifier said no (the test's)")

        return real(*args[:4], then_fail, *args[5:], **kwargs)

    with bpffs() as root:
        d = Datapath(str(root / "ekp"), PACKET_LAB_SIZES)
        monkeypatch.setattr(loader, "link", verifier_says_no)
        with pytest.raises(RuntimeError, match="the test's"):
            d.load(maps_ready=lambda: None)  # handed to a writer (the agent's sync): kept open
        assert d.maps, "our maps stay open for the retry"
        os.unlink(os.path.join(d.pin_path, MAPS["ctqh"].name))
        monkeypatch.setattr(loader, "link", real)
        d.load()
        try:
            # Read from the pin, not through another Datapath: its load would write the counts.
            head = BpfMap.open_pinned(MAPS["ctqh"], d.pin_path)
            try:
                counts = {int(k.value): loader.ring_slots(v.value) for k, v in head.items()}
            finally:
                head.close()
            ring = PACKET_LAB_SIZES.ct_tcp // 4
            assert counts == {CtqRing.TCP: ring, CtqRing.ANY: PACKET_LAB_SIZES.ct_any // 4}
        finally:
            d.close()


def _pin_maps(pins: str, sizes: MapSizes, roles: dict[str, int]) -> None:
    """Pins a map for each role as the load would create it, at the given max_entries."""
    os.makedirs(pins, mode=0o700, exist_ok=True)
    for role, entries in roles.items():
        info = loader.expected_info(MAPS[role], sizes)
        fd = bpfsys.map_create(
            info["type"], info["key_size"], info["value_size"], entries, info["flags"], MAPS[role].name
        )
        assert fd >= 0, f"creating {role}: errno {-fd}"
        try:
            obj_pin(fd, os.path.join(pins, MAPS[role].name))
        finally:
            os.close(fd)


@pytest.mark.kernel
def test_a_ring_pin_removed_takes_its_head_with_it_before_the_link() -> None:
    """check_pins' remedy after a --bpf-ct-global-*-max change removes a table and its ring, not
    their head: the load unpins that head too, so the link creates it fresh rather than rewriting
    the one the last load's programs still queue by. The other family's head, its rings pinned,
    is kept."""
    with bpffs() as root:
        pins = str(root / "ekp")
        _pin_maps(pins, SMALL, {r: 256 for r in ("ctq_tcp", "ctq_any", "ctq6_tcp", "ctq6_any")})
        _pin_maps(pins, SMALL, {"ctqh": 2, "ctqh6": 2})
        os.unlink(os.path.join(pins, MAPS["ctq_tcp"].name))
        assert loader.unlink_ring_heads(pins) == [MAPS["ctqh"].name]
        assert sorted(os.listdir(pins)) == sorted(
            MAPS[r].name for r in ("ctq_any", "ctq6_tcp", "ctq6_any", "ctqh6")
        )
        assert loader.unlink_ring_heads(pins) == [], "a plain restart unpins nothing"


@pytest.mark.kernel
def test_the_ipv6_switch_unpins_its_rings_head_before_the_rings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash between the unlinks must not leave the old head beside new rings: the head goes first."""
    unlinked: list[str] = []
    real_unlink = os.unlink

    def recording(path: str) -> None:
        unlinked.append(os.path.basename(path))
        real_unlink(path)

    with bpffs() as root:
        pins = str(root / "ekp")
        _pin_maps(pins, AGENT, {"ctq6_tcp": loader.IDLE_SIZE, "ctq6_any": loader.IDLE_SIZE, "ctqh6": 2})
        monkeypatch.setattr(os, "unlink", recording)
        removed = loader.replace_resized_ipv6_pins(pins, AGENT)
        monkeypatch.undo()
        assert unlinked[0] == MAPS["ctqh6"].name
        assert sorted(removed) == sorted(MAPS[r].name for r in ("ctqh6", "ctq6_tcp", "ctq6_any"))
        assert os.listdir(pins) == []


class _Heads:
    """A head map that records its updates (write_ring_slots' only calls on it)."""

    spec = MAPS["ctqh"]

    def __init__(self) -> None:
        self.values = {int(CtqRing.TCP): 0, int(CtqRing.ANY): 0}
        self.updates = 0

    def lookup(self, key: ctypes.c_uint32) -> ctypes.c_uint64:
        return ctypes.c_uint64(self.values[key.value])

    def update(self, key: ctypes.c_uint32, value: ctypes.c_uint64) -> None:
        self.values[key.value] = value.value
        self.updates += 1


class _Ring:
    spec = MAPS["ctq_tcp"]

    def __init__(self, slots: int) -> None:
        self.slots = slots

    def info(self) -> object:
        return type("Info", (), {"max_entries": self.slots})()


def test_a_restart_leaves_a_head_that_holds_its_count_alone() -> None:
    """Every plain restart finds each head holding its ring's count: not written again, so no
    read-modify-write races the running programs' position adds."""
    heads = {role: _Heads() for role in set(CTQ_HEADS.values())}
    rings = {ring: _Ring(1024) for ring in CT_QUEUES.values()}
    maps: dict[str, object] = {**heads, **rings}
    loader.write_ring_slots(maps)  # type: ignore[arg-type]
    assert all(h.updates for h in heads.values()), "a new head is written"
    before = {role: h.updates for role, h in heads.items()}
    loader.write_ring_slots(maps)  # type: ignore[arg-type]
    assert {role: h.updates for role, h in heads.items()} == before


def test_a_head_in_use_given_another_count_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """Only a fresh head is meant to be written (load() unpins one whose ring is replaced): a
    non-zero count about to change says a ring was replaced behind the agent's back."""
    caplog.set_level(logging.WARNING)
    heads = {role: _Heads() for role in set(CTQ_HEADS.values())}
    maps: dict[str, object] = {**heads, **{ring: _Ring(1024) for ring in CT_QUEUES.values()}}
    loader.write_ring_slots(maps)  # type: ignore[arg-type]
    assert not caplog.records, "a fresh head is written without a warning"
    maps.update({ring: _Ring(256) for ring in CT_QUEUES.values()})
    loader.write_ring_slots(maps)  # type: ignore[arg-type]
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 4
    assert "held 1024 slots" in caplog.records[0].getMessage()
    assert all(loader.ring_slots(v) == 256 for h in heads.values() for v in h.values.values())


def test_only_a_size_setting_sizes_a_map_at_load() -> None:
    """A map is sized at load by a MapSizes field, not by any attribute of that name: a role that
    names one of its methods keeps the C's size and its registry default."""
    spec = MapSpec(
        "with_conntrack", "array", ctypes.c_uint32, ctypes.c_uint64, 2, "EKP_X_MAX", Writer.DATAPATH
    )
    assert not loader.load_sized(spec)
    assert loader.map_size(spec, SMALL) == 2, "its own default, not the method"
    assert loader.load_sized(MAPS["fe"])
    assert loader.map_size(MAPS["fe"], SMALL) == SMALL.fe


def test_a_head_or_ring_pin_that_fails_to_open_leaks_none_opened_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """_write_pinned_ring_slots opens four pins: one failing closes those opened before it."""
    opened: list[_Opened] = []

    class _Opened:
        closed = False

        def __enter__(self) -> _Opened:
            return self

        def __exit__(self, *exc: object) -> None:
            self.closed = True

    def open_pinned(spec: MapSpec, pin_path: str) -> _Opened:
        if len(opened) == 2:
            raise FileNotFoundError(spec.name)
        opened.append(_Opened())
        return opened[-1]

    monkeypatch.setattr(BpfMap, "open_pinned", open_pinned)
    with pytest.raises(FileNotFoundError):
        Datapath("/nonexistent", SMALL)._write_pinned_ring_slots()
    assert len(opened) == 2
    assert all(m.closed for m in opened)
