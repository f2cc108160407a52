"""The service maps read back while the agent starts (agent/ebpf/readback.py), and the first sync
that takes that read instead of reading the maps itself."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from agent.ebpf.abi import MAPS, MapSpec
from agent.ebpf.maps import FakeMap
from agent.ebpf.planner import ROLES
from agent.ebpf.readback import ReadBack, read_maps
from agent.ebpf.render import render_contents
from tests.ebpf.support import NODE
from tests.ebpf.test_proxier import MORE, Rig


class WatchedMap(FakeMap):
    """A FakeMap that records the thread of each read back (`dump_raw`); `fail` reads raise."""

    def __init__(self, spec: MapSpec) -> None:
        super().__init__(spec)
        self.reads: list[str] = []
        self.fail = 0

    def dump_raw(self) -> tuple[bytes, bytes]:
        self.reads.append(threading.current_thread().name)
        if self.fail:
            self.fail -= 1
            raise OSError(9, "Bad file descriptor")
        return super().dump_raw()


def watched(rig: Rig) -> dict[str, WatchedMap]:
    """The rig's service maps, written by a first agent, then watched."""
    first = rig.proxier()
    first.sync(MORE, NODE)
    first.close()
    out: dict[str, WatchedMap] = {}
    for role in ROLES:
        m = out[role] = WatchedMap(MAPS[role])
        m._data = rig.maps[role]._data  # the entries the first agent wrote, kept
        rig.maps[role] = m
    return out


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def test_a_read_back_gives_what_reading_the_maps_then_gives() -> None:
    maps = {role: FakeMap(MAPS[role]) for role in ROLES}
    owner = object()
    early = ReadBack(owner, maps, ROLES)
    early.start()
    assert early.take(owner) == read_maps(maps, ROLES)
    assert early.take(owner) is None  # taken once


def test_a_read_back_is_given_only_to_a_sync_of_the_data_path_it_read() -> None:
    maps = {role: FakeMap(MAPS[role]) for role in ROLES}
    early = ReadBack(object(), maps, ROLES)
    early.start()
    assert early.take(object()) is None


def test_a_restarts_first_sync_plans_from_the_read_its_load_started(rig: Rig) -> None:
    maps = watched(rig)
    before = render_contents(rig.contents())
    again = rig.proxier()
    again.prepare()  # the early load (agent/app.py start_loading): nothing read yet
    assert not any(m.reads for m in maps.values())
    again.prepare()  # the Agent's, as its source starts listing: the read starts
    again.sync(MORE, NODE)
    assert {role: tuple(m.reads) for role, m in maps.items()} == dict.fromkeys(ROLES, ("ekp-readback",))
    assert again.last_flush.writes == 0  # every id re-adopted, as from a read of its own
    assert render_contents(rig.contents()) == before
    # taken once: a later full sync reads the maps again, on its own thread
    again.sync(MORE, NODE, None)
    me = threading.current_thread().name
    assert {role: tuple(m.reads[1:]) for role, m in maps.items()} == dict.fromkeys(ROLES, (me,))


def test_a_first_sync_reads_the_maps_itself_when_the_early_read_failed(rig: Rig) -> None:
    maps = watched(rig)
    maps["slot"].fail = 1
    before = render_contents(rig.contents())
    again = rig.proxier()
    again.prepare()
    again.prepare()
    again.sync(MORE, NODE)
    me = threading.current_thread().name
    assert maps["slot"].reads == ["ekp-readback", me]
    assert again.last_flush.writes == 0
    assert render_contents(rig.contents()) == before


def test_a_first_sync_that_loads_the_data_path_itself_reads_the_maps_itself(rig: Rig) -> None:
    """No early load (or one that failed): nothing was read ahead, the sync reads in place."""
    maps = watched(rig)
    again = rig.proxier()
    again.sync(MORE, NODE)
    me = threading.current_thread().name
    assert {role: tuple(m.reads) for role, m in maps.items()} == dict.fromkeys(ROLES, (me,))
    assert again.last_flush.writes == 0


def test_no_read_ahead_once_a_sync_came(rig: Rig) -> None:
    """The Agent's prepare() after the first sync (a slow start of its thread) reads nothing: the
    next full sync reads for itself."""
    maps = watched(rig)
    again = rig.proxier()
    again.prepare()
    again.sync(MORE, NODE)
    again.prepare()
    again.sync(MORE, NODE, None)
    me = threading.current_thread().name
    assert {role: tuple(m.reads) for role, m in maps.items()} == dict.fromkeys(ROLES, (me, me))
