"""The writer: a difference (desired, and the written side where it differs) in a safe order.

The maps here record every operation; each test reads the order back, and `broken` (the data
path's reference checks) runs after every single write.
"""

from __future__ import annotations

import ctypes
from typing import Any

from agent.ebpf.abi import MAPS
from agent.ebpf.entries import Entries, fe_key, fe_value, ident, member_key, slot_key
from agent.ebpf.maps import FakeMap
from agent.ebpf.plan import read_contents
from agent.ebpf.planner import ROLES
from agent.ebpf.writer import Pending, flush
from agent.model.types import Protocol, ServicePortName
from tests.ebpf.support import broken

A = ServicePortName("ns", "a", "", Protocol.TCP)
B = ServicePortName("ns", "b", "", Protocol.TCP)


class Recorder:
    """A FakeMap taking one entry at a time, logging `role op`, checking every reference after each."""

    def __init__(self, role: str, log: list[str], maps: dict[str, FakeMap], size: int | None = None) -> None:
        self.role, self.log, self.all = role, log, maps
        self.inner = maps[role] = FakeMap(MAPS[role], size)
        self.ks, self.vs = ctypes.sizeof(MAPS[role].key), ctypes.sizeof(MAPS[role].value)

    def update_packed(self, keys: bytes, values: bytes) -> int:
        for i in range(len(keys) // self.ks):
            if not self.inner.update_packed(
                keys[i * self.ks : (i + 1) * self.ks], values[i * self.vs : (i + 1) * self.vs]
            ):
                return i
            self.log.append(f"{self.role} +")
            assert not broken(read_contents(self.all))
        return len(keys) // self.ks

    def delete_packed(self, keys: bytes) -> None:
        for i in range(0, len(keys), self.ks):
            self.inner.delete_packed(keys[i : i + self.ks])
            self.log.append(f"{self.role} -")
            assert not broken(read_contents(self.all))


def rig(sizes: dict[str, int] | None = None) -> tuple[dict[str, Recorder], list[str], dict[str, FakeMap]]:
    log: list[str] = []
    maps: dict[str, FakeMap] = {}
    recs = {role: Recorder(role, log, maps, (sizes or {}).get(role)) for role in ROLES}
    return recs, log, maps


def service(vip: int, svc: int, set_id: int, bids: list[int], rid: int) -> dict[str, Entries]:
    """One ClusterIP frontend (one scope) over `bids`."""
    return {
        "fe": {fe_key(vip, 80, 6, 1): fe_value(svc, set_id, len(bids), 0, 0, rid)},
        "slot": {slot_key(set_id, pos): bid for pos, bid in enumerate(bids, 1)},
        "be": {bid: ident(0x0A000000 + bid, 0x901F, 6) for bid in bids},
        "member": {member_key(svc, bid): 1 for bid in bids},
        "rnat": {rid: vip | 80 << 32},
        "srcr": {},
        "addr": {vip: 2, **{0x0A000000 + bid: 4 for bid in bids}},  # INTERNAL scope, BACKEND
    }


def diff(held: dict[str, Entries], desired: dict[str, Entries]) -> dict[str, Pending]:
    out: dict[str, Pending] = {}
    for role in ROLES:
        h, d = held[role], desired[role]
        p: Pending = {k: v for k, v in h.items() if d.get(k) != v}
        p.update({k: None for k in d.keys() - h.keys()})
        out[role] = p
    return out


def owners(table: dict[str, set[ServicePortName]]) -> Any:
    return lambda role, key: table.get(role, set())


def load(maps: dict[str, Recorder], entries: dict[str, Entries]) -> None:
    empty: dict[str, Entries] = {r: {} for r in ROLES}
    flush(entries, diff(empty, entries), maps, owners({}))


def test_a_new_service_goes_in_backends_first_frontend_last() -> None:
    maps, log, _ = rig()
    desired = service(1, 7, 3, [11, 12], 5)
    pending = diff({r: {} for r in ROLES}, desired)
    result = flush(desired, pending, maps, owners({}))
    assert list(dict.fromkeys(log)) == ["addr +", "be +", "member +", "rnat +", "slot +", "fe +"]
    assert result.updates == {"addr": 3, "be": 2, "member": 2, "rnat": 1, "srcr": 0, "slot": 2, "fe": 1}
    assert not any(pending.values()), "the written side now agrees everywhere"


def test_a_shrinking_set_shrinks_its_count_first_and_its_backend_goes_last() -> None:
    maps, log, _ = rig()
    before = service(1, 7, 3, [11, 12, 13], 5)
    load(maps, before)
    log.clear()
    after = service(1, 7, 3, [11, 12], 5)
    flush(after, diff(before, after), maps, owners({}))
    assert log == ["fe +", "slot -", "member -", "be -", "addr -"]


def test_a_flush_looks_at_the_pending_keys_alone() -> None:
    maps, log, _ = rig()
    desired = service(1, 7, 3, list(range(100, 400)), 5)
    load(maps, desired)
    log.clear()
    desired["slot"][slot_key(3, 1)] = 101  # a change the planner did not record: not written
    result = flush(desired, {r: {} for r in ROLES}, maps, owners({}))
    assert log == [] and result.writes == 0


def test_room_is_made_before_it_is_needed() -> None:
    """Maps with room for one service: replacing it by another deletes the old first."""
    maps, log, _ = rig({"fe": 1, "slot": 2, "be": 2, "member": 2, "rnat": 1, "addr": 3})
    old = service(1, 7, 3, [11, 12], 5)
    load(maps, old)
    log.clear()
    new = service(2, 8, 4, [21, 22], 6)
    result = flush(new, diff(old, new), maps, owners({}))
    assert result.failed == {}
    deletions = ["fe -", "slot -", "slot -", "member -", "member -", "be -", "be -", "rnat -"]
    deletions += ["addr -"] * 3
    writes = ["addr +"] * 3 + ["be +", "be +", "member +", "member +", "rnat +", "slot +", "slot +", "fe +"]
    assert log == deletions + writes


def test_a_port_that_does_not_fit_is_reported_and_left_out_of_the_later_maps() -> None:
    maps, _, fakes = rig({"be": 3})
    a, b = service(1, 7, 3, [11, 12], 5), service(2, 8, 4, [21, 22], 6)
    desired = {r: {**a[r], **b[r]} for r in ROLES}
    table = {
        "be": {11: {A}, 12: {A}, 21: {B}, 22: {B}},
    }

    def owner(role: str, key: int) -> set[ServicePortName]:
        if role == "be":
            return table["be"][key]
        return {A} if key in a[role] else {B}

    pending = diff({r: {} for r in ROLES}, desired)
    result = flush(desired, pending, maps, owner)
    assert set(result.failed) == {B} and "raise --bpf-be-max" in result.failed[B]
    assert len(fakes["be"]) == 2, "b's backend that fitted was taken back out"
    assert len(fakes["fe"]) == 1 and len(fakes["slot"]) == 2, "nothing points at b's missing backends"
    assert set(pending["fe"]) == set(b["fe"]), "what failed is still pending"


def test_a_fresh_map_is_written_whole_without_pending_naming_its_keys() -> None:
    """A role in `fresh` holds none of desired: an empty pending stands for every key with None."""
    maps, log, fakes = rig()
    desired = service(1, 7, 3, [11, 12], 5)
    pending: dict[str, Pending] = {r: {} for r in ROLES}
    fresh = set(ROLES)
    result = flush(desired, pending, maps, owners({}), fresh)
    assert list(dict.fromkeys(log)) == ["addr +", "be +", "member +", "rnat +", "slot +", "fe +"]
    assert result.updates == {"addr": 3, "be": 2, "member": 2, "rnat": 1, "srcr": 0, "slot": 2, "fe": 1}
    assert fresh == set(), "written: a key missing from pending now means the map holds it"
    assert {r: len(fakes[r]) for r in ROLES} == {r: len(desired[r]) for r in ROLES}


def test_a_fresh_map_that_fills_up_fails_by_port_as_a_named_one_does() -> None:
    maps, _, fakes = rig({"be": 3})
    a, b = service(1, 7, 3, [11, 12], 5), service(2, 8, 4, [21, 22], 6)
    desired = {r: {**a[r], **b[r]} for r in ROLES}
    table = {11: {A}, 12: {A}, 21: {B}, 22: {B}}

    def owner(role: str, key: int) -> set[ServicePortName]:
        return table[key] if role == "be" else {A} if key in a[role] else {B}

    pending: dict[str, Pending] = {r: {} for r in ROLES}
    result = flush(desired, pending, maps, owner, set(ROLES))
    assert set(result.failed) == {B} and "raise --bpf-be-max" in result.failed[B]
    assert len(fakes["be"]) == 2 and len(fakes["fe"]) == 1 and len(fakes["slot"]) == 2
    assert pending["fe"] == dict.fromkeys(b["fe"]), "what failed is pending, named with None"
    assert pending["be"] == {21: None, 22: None}, "b's backends, the one that fitted taken back"


def test_a_fresh_map_whose_write_fails_stays_fresh() -> None:
    """A batch write that raises leaves the role `fresh`: its keys are still to be written."""
    maps, _, _ = rig()

    class Broken(Recorder):
        def update_packed(self, keys: bytes, values: bytes) -> int:
            raise OSError("EPERM")

    maps["slot"] = Broken("slot", [], {})
    desired = service(1, 7, 3, [11, 12], 5)
    pending: dict[str, Pending] = {r: {} for r in ROLES}
    fresh = set(ROLES)
    try:
        flush(desired, pending, maps, owners({}), fresh)
    except OSError:
        pass
    else:
        raise AssertionError("the write did not fail")
    assert {"slot", "fe"} <= fresh and "be" not in fresh and not any(pending.values())
