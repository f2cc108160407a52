"""The persistent planner: incremental re-plans, safe write order, full maps, repairs, restarts.

Every flush here goes through `WatchedMap`s, which write one entry at a time and check after each
that no frontend points at a missing slot or reverse-NAT entry and no slot at a missing backend:
the order is proven on every test, not only on the ones about order.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.config import Config
from agent.ebpf import planner as planner_module
from agent.ebpf.abi import MAPS, AddrFlag, ip_str
from agent.ebpf.entries import (
    BE_FLAGS,
    BE_PROTO,
    FE_RNAT,
    MEMBER_BACKEND,
    SLOT_POS,
    U16,
    fe_rnat,
    from_dump,
    ident,
    key_size,
    pack,
    srcr_key,
    to_tuples,
    value_size,
)
from agent.ebpf.planner import Planner
from agent.model import ProxyState
from agent.model.types import Endpoint, ServicePortName
from tests.ebpf.support import NODE, PlanRig, broken, proxy_states
from tests.ebpf.test_plan import states, svc


def many(n: int, endpoints: int = 2, first: int = 0) -> ProxyState:
    docs = [
        svc(
            f"s{i:04d}",
            f"10.96.{i // 250}.{i % 250 + 1}",
            [f"10.244.1.{(i + e) % 250 + 1}" for e in range(endpoints)],
        )
        for i in range(first, first + n)
    ]
    return states(*docs)


def changed_between(a: ProxyState, b: ProxyState) -> set[ServicePortName]:
    return {
        spn
        for spn in set(a.services) | set(b.services)
        if a.services.get(spn) != b.services.get(spn) or a.endpoints.get(spn) != b.endpoints.get(spn)
    }


def test_a_flush_writes_exactly_the_plan_and_then_nothing() -> None:
    rig = PlanRig()
    state = many(20)
    result = rig.sync(state)
    assert rig.planner.in_sync
    assert rig.held() == rig.planner.desired
    assert result.failed == {}
    assert rig.sync(state, changed=()).writes == 0
    assert rig.sync(state).writes == 0, "a full re-plan of the same state changes nothing"


def test_one_endpoint_change_re_plans_one_port_and_writes_a_handful_of_entries() -> None:
    rig = PlanRig()
    before = many(300)
    rig.sync(before, watch=False)
    spn = ServicePortName("default", "s0150", "", before.services[next(iter(before.services))].protocol)
    doc = svc("s0150", "10.96.0.151", ["10.244.1.151", "10.244.1.152", "10.244.9.9"])
    after = states(
        *[
            svc(
                f"s{i:04d}",
                f"10.96.{i // 250}.{i % 250 + 1}",
                [f"10.244.1.{(i + e) % 250 + 1}" for e in range(2)],
            )
            for i in range(300)
            if i != 150
        ],
        doc,
    )
    assert changed_between(before, after) == {spn}
    result = rig.sync(after, changed={spn})
    # the new backend's address goes into `addr` too (10.244.9.9 is on no other service)
    assert result.updates == {"addr": 1, "be": 1, "member": 1, "rnat": 0, "srcr": 0, "slot": 1, "fe": 2}
    assert sum(result.deletes.values()) == 0
    assert rig.planner.in_sync and rig.held() == rig.planner.desired


def test_a_removed_service_is_unlinked_before_its_slots_and_backends_go() -> None:
    rig = PlanRig()
    rig.sync(
        states(svc("a", "10.96.0.5", ["10.244.1.2", "10.244.1.3"]), svc("b", "10.96.0.6", ["10.244.1.3"]))
    )
    result = rig.sync(states(svc("b", "10.96.0.6", ["10.244.1.3"])))
    # the shared backend 10.244.1.3 stays; a's frontends, slots, rev-NAT entry and own backend go,
    # and the addresses only a used (10.96.0.5, 10.244.1.2)
    assert result.deletes == {"be": 1, "member": 2, "rnat": 1, "srcr": 0, "slot": 2, "fe": 2, "addr": 2}
    assert len(rig.contents().be) == 1


def test_replacing_every_service_in_full_maps_reaches_the_new_state() -> None:
    """Capacity never deadlocks: deletions that make room go first."""
    sizes = {"fe": 40, "slot": 40, "be": 40, "rnat": 20}
    rig = PlanRig(sizes=sizes)
    assert rig.sync(many(20, endpoints=2)).failed == {}
    assert len(rig.maps["fe"]) == 40 and len(rig.maps["slot"]) == 40
    result = rig.sync(many(20, endpoints=2, first=100))
    assert result.failed == {}
    assert rig.planner.in_sync and rig.held() == rig.planner.desired
    assert (
        sorted(k.set_id for k in rig.contents().slot)
        == sorted(fe.set_id for fe in rig.contents().fe.values() if fe.count)
        or len(rig.contents().slot) == 40
    )


def test_what_does_not_fit_is_reported_and_everything_else_programmed() -> None:
    rig = PlanRig(sizes={"fe": 10})
    result = rig.sync(many(8))
    # 8 services x 2 frontends: 5 fit (in sorted order), 3 do not
    assert sorted(str(s) for s in result.failed) == ["default/s0005", "default/s0006", "default/s0007"]
    assert all(f"{MAPS['fe'].name} is full: raise --bpf-fe-max" in why for why in result.failed.values())
    assert not broken(rig.contents())
    programmed = {name.split(":")[0] for name in rig.planner.fe_names().values()}
    assert len(rig.contents().fe) == 10
    assert "default/s0004" in programmed
    # room appears (two services deleted): the next sync programs the ones that failed
    smaller = states(
        *[
            svc(
                f"s{i:04d}",
                f"10.96.{i // 250}.{i % 250 + 1}",
                [f"10.244.1.{(i + e) % 250 + 1}" for e in range(2)],
            )
            for i in range(2, 7)
        ]
    )
    again = rig.sync(smaller)
    assert again.failed == {}
    assert rig.planner.in_sync and rig.held() == rig.planner.desired


def test_resync_repairs_entries_changed_behind_our_back() -> None:
    rig = PlanRig()
    state = many(10)
    rig.sync(state)
    fe_key, _ = rig.maps["fe"].items_raw()[0]
    rig.maps["fe"].delete_raw([fe_key])
    be_key, be_val = rig.maps["be"].items_raw()[0]
    rig.maps["be"].update_raw([be_key], [be_val[:-1] + b"\x07"])  # flags mangled
    rig.maps["slot"].update_raw([b"\x63\x00\x00\x00\x01\x00\x00\x00"], [b"\x01\x00\x00\x00"])  # stray
    repaired = rig.planner.reconcile(rig.dump())
    assert repaired == 3
    result = rig.sync(state, changed=())
    assert result.updates["fe"] == 1 and result.updates["be"] == 1 and result.deletes["slot"] == 1
    assert rig.planner.reconcile(rig.dump()) == 0


def test_a_resync_decodes_only_the_maps_written_since_it_last_found_them_as_desired(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The periodic resync reads every map back; at 50,000 Services decoding and comparing them
    is about 1.8 CPU s (bench.changecost). A map whose bytes are those the last resync found
    equal to the plan, and that no flush wrote since, holds the plan still: it is not decoded.
    Anything else is, whoever wrote it."""
    rig = PlanRig()
    rig.sync(many(10))
    assert rig.planner.reconcile(rig.dump()) == 0  # every map decoded, found as planned
    decoded: list[str] = []
    real = from_dump

    def counted(role: str, keys: bytes, values: bytes) -> dict[int, int]:
        decoded.append(role)
        return real(role, keys, values)

    monkeypatch.setattr(planner_module, "from_dump", counted)
    empty = {role for role in planner_module.ROLES if not rig.planner.desired[role]}
    assert empty == {"srcr"}
    assert rig.planner.reconcile(rig.dump()) == 0
    assert set(decoded) == empty, "only the empty map (nothing to verify) is decoded again"

    decoded.clear()
    rig.sync(many(10, endpoints=3), changed=changed_between(many(10), many(10, endpoints=3)))
    assert rig.planner.reconcile(rig.dump()) == 0
    assert {"be", "slot", "member", "addr", "fe"} <= set(decoded) and "rnat" not in decoded

    decoded.clear()
    assert rig.planner.reconcile(rig.dump()) == 0
    assert set(decoded) == empty
    be_key, be_val = rig.maps["be"].items_raw()[0]
    rig.maps["be"].update_raw([be_key], [be_val[:-1] + b"\x07"])  # behind our back, after a resync
    assert rig.planner.reconcile(rig.dump()) == 1
    assert rig.sync(many(10, endpoints=3), changed=()).updates["be"] == 1
    assert rig.planner.reconcile(rig.dump()) == 0


def test_a_restart_re_adopts_everything_and_prunes_only_what_went_away() -> None:
    rig = PlanRig()
    rig.sync(many(30))
    before = rig.contents()
    rig.restart()
    assert rig.sync(many(30)).writes == 0
    assert rig.contents().same_entries(before)
    rig.restart()
    result = rig.sync(many(29))
    assert result.deletes["fe"] == 2 and sum(result.updates.values()) == 0


def test_a_restart_repairs_exactly_what_the_maps_hold_differently() -> None:
    """A restart plans as a fresh start and then compares the plan with its read-back: a backend
    whose flags changed behind the agent's back and a slot that went missing are written again,
    a frontend no Service has is deleted, and nothing else is touched."""
    rig = PlanRig()
    rig.sync(many(30))
    before = rig.contents()
    held = rig.held()
    bid, value = next(iter(held["be"].items()))
    slot = next(iter(held["slot"]))
    stray = max(held["fe"]) + 1  # a frontend key none of the 30 Services has
    rig.maps["be"].update_packed(pack([bid], key_size("be")), pack([value ^ 1 << BE_FLAGS], value_size("be")))
    rig.maps["slot"].delete_packed(pack([slot], key_size("slot")))
    rig.maps["fe"].update_packed(
        pack([stray], key_size("fe")), pack([held["fe"][max(held["fe"])]], value_size("fe"))
    )
    rig.restart()
    result = rig.sync(many(30), watch=False)  # the maps start broken: no check after each write
    assert dict(result.updates) == {"be": 1, "slot": 1} | {
        r: 0 for r in result.updates if r not in ("be", "slot")
    }
    assert sum(result.deletes.values()) == result.deletes["fe"] == 1
    assert rig.contents().same_entries(before)
    assert rig.planner.in_sync


def test_a_restart_holds_every_id_its_read_back_holds_as_a_resync_would() -> None:
    """A start holds the ids of its read-back (service port, set, backend, reverse-NAT) taking
    the large sets in C (Planner._adopt); they are the ids a resync's entry-by-entry walk finds
    (Planner._held), strays the plan never made included: a membership, a slot, a backend, a
    reverse-NAT entry and a source range under ids no frontend names."""
    rig = PlanRig()
    rig.sync(many(30))
    strays = {
        "member": (999 | 666 << MEMBER_BACKEND, 1),
        "slot": (777 | 1 << SLOT_POS, 888),
        "be": (555, next(iter(rig.held()["be"].values()))),
        "rnat": (444, 1),
        "srcr": (srcr_key(40, 333, 0x0A000001), 1),
    }
    for role, (key, value) in strays.items():
        rig.maps[role].update_packed(pack([key], key_size(role)), pack([value], value_size(role)))
    adopting, walking = Planner(rig.config), Planner(rig.config)
    adopting.reconcile(rig.dump(), adopt=True)
    walking.reconcile(rig.dump())

    def pools(p: Planner) -> dict[str, set[int]]:
        return {
            "svc": p.svc_ids._held,
            "set": p.set_ids._held,
            "be": p.backends.pool._held,
            "rnat": p.rnat_ids._held,
        }

    held = pools(adopting)
    assert held == pools(walking)
    assert (
        999 in held["svc"]
        and 777 in held["set"]
        and {555, 666, 888} <= held["be"]
        and {444, 333} <= held["rnat"]
    )
    # The pools hand out ids unchecked until they wrap: the next new ones must be past the strays.
    assert adopting.svc_ids.take() > 999 and adopting.set_ids.take() > 777
    assert adopting.backends.pool.take() > 888 and adopting.rnat_ids.take() > 444


def test_a_restart_refuses_a_rev_nat_id_the_kernels_entry_gives_another_frontend() -> None:
    """A frontend whose pinned value carries another frontend's rev-NAT id (written behind the
    agent's back) does not take that id on a restart: the kernel's rev-NAT entry under it names
    the other frontend, which keeps it and its entry (its live flows' replies get their frontend
    back from it)."""
    rig = PlanRig()
    rig.sync(many(3))
    held = rig.held()
    (a, va), (b, vb) = sorted(held["fe"].items())[:2]
    ra, rb = fe_rnat(va), fe_rnat(vb)
    assert ra != rb
    forged = va & ~(U16 << FE_RNAT) | rb << FE_RNAT
    rig.maps["fe"].update_packed(pack([a], key_size("fe")), pack([forged], value_size("fe")))
    rig.restart()
    rig.sync(many(3), watch=False)
    after = rig.held()
    assert fe_rnat(after["fe"][b]) == rb and after["rnat"][rb] == held["rnat"][rb], (
        "the other frontend keeps its id"
    )
    assert fe_rnat(after["fe"][a]) not in (0, rb)
    assert after["rnat"][fe_rnat(after["fe"][a])] == held["rnat"][ra], "its own entry under its new id"


def test_a_restarts_first_plan_raising_halfway_is_retried_over_the_maps_and_writes_nothing(
    monkeypatch: Any,
) -> None:
    """A restart's first `update` raising halfway (a port that fails to plan) leaves a read-back
    half used; the retry (the proxier's: a read-back, not adopted, and a full update) re-adopts
    every id, writes nothing over unchanged maps, and drops the kernel's id hints once every port
    is planned (kept, they would hand a later Service an id released in this run)."""
    rig = PlanRig()
    rig.sync(many(30))
    before = rig.contents()
    rig.restart()
    calls, replan = [0], Planner._replan

    def failing(self: Planner, *args: Any) -> None:
        calls[0] += 1
        if calls[0] == 12:
            raise RuntimeError("a port that fails to plan")
        replan(self, *args)

    monkeypatch.setattr(Planner, "_replan", failing)
    with pytest.raises(RuntimeError):
        rig.planner.update(many(30), NODE, None)
    assert rig.planner._fe_hints, "the hints stay for the retry"
    rig.planner.reconcile(rig.dump())
    result = rig.sync(many(30), watch=False)
    assert sum(result.updates.values()) == sum(result.deletes.values()) == 0
    assert rig.contents().same_entries(before)
    assert not rig.planner._fe_hints and not rig.planner.backends.hints and not rig.planner._slot_hints


def test_a_first_plan_keeps_no_second_copy_of_its_keys_and_a_restart_lets_go_of_the_kernels() -> None:
    """Memory at scale: on empty maps the written side names nothing (every map is `fresh`);
    after a restart's re-plan, only what the kernel holds differently is left of its read-back."""
    rig = PlanRig()
    rig.planner.reconcile(rig.dump(), adopt=True)
    rig.planner.update(many(30), NODE, None)
    assert all(rig.planner.desired[r] for r in ("fe", "slot", "be", "member", "rnat", "addr"))
    assert not any(rig.planner.pending.values()) and not rig.planner.in_sync
    rig.planner.flush(rig.maps)
    assert rig.planner.in_sync and not rig.planner.fresh
    entries = sum(len(d) for d in rig.planner.desired.values())
    rig.planner = Planner(rig.config)  # a restart, its read-back counted
    assert rig.planner.reconcile(rig.dump(), adopt=True) == entries, "before the re-plan, all of it differs"
    assert not rig.planner.in_sync
    rig.planner.update(many(29), NODE, None)
    left = {r: len(p) for r, p in rig.planner.pending.items() if p}
    # the removed service's two frontends, two slots and members, its reverse-NAT entry, the
    # backend no one else uses, its address and the VIP's: nothing of the 29 re-adopted
    assert left == {"fe": 2, "slot": 2, "be": 1, "rnat": 1, "member": 2, "addr": 2}
    assert rig.sync(many(29)).deletes["fe"] == 2


def test_an_address_keeps_each_bit_while_any_user_has_it() -> None:
    """ekp_addr: a frontend scope's bit or BACKEND stays while one of its users does, and the
    entry goes with the last (users beyond the first are counted, the first is the bit)."""

    def addr(rig: PlanRig) -> dict[str, int]:
        return {ip_str(k.addr): v.flags for k, v in rig.contents().addr.items()}

    node, backend = AddrFlag.FRONTEND_EXTERNAL | AddrFlag.FRONTEND_INTERNAL, AddrFlag.BACKEND
    nodeport = [
        svc(n, ip, eps, type="NodePort", nodeport=port)
        for n, ip, eps, port in (
            ("a", "10.96.0.1", ["10.244.1.2", "10.244.1.3"], 30001),
            ("b", "10.96.0.2", ["10.244.1.2"], 30002),
            ("c", "10.96.0.3", ["10.244.1.2"], 30003),
        )
    ]
    rig = PlanRig()
    rig.sync(states(*nodeport))
    held = addr(rig)
    assert held["192.168.0.11"] & node and held["10.244.1.2"] == backend and held["10.244.1.3"] == backend
    rig.sync(states(*nodeport[1:]))  # one of the node address's three users, and of 10.244.1.2's
    held = addr(rig)
    assert held["192.168.0.11"] & node and held["10.244.1.2"] == backend
    assert "10.244.1.3" not in held and "10.96.0.1" not in held
    rig.sync(states(*nodeport[2:]))
    assert addr(rig)["192.168.0.11"] & node and addr(rig)["10.244.1.2"] == backend
    rig.sync(states())
    assert addr(rig) == {}
    assert rig.planner._addr_extra == {}


@settings(max_examples=150, deadline=None)
@given(st.lists(proxy_states(), min_size=2, max_size=4), st.booleans(), st.booleans(), st.data())
def test_any_sequence_of_states_incremental_or_full_with_restarts(
    seq: list[ProxyState], masq: bool, restart: bool, data: st.DataObject
) -> None:
    """Incremental updates (only what changed) reach exactly what a fresh plan of the same state
    holds, entry for entry up to ids; every single write keeps every service whole."""
    rig = PlanRig(Config(masquerade_all=masq))
    prev: ProxyState | None = None
    for state in seq:
        if restart and data.draw(st.booleans()):
            rig.restart()
            rig.sync(state)
        elif prev is None or data.draw(st.booleans()):
            rig.sync(state)
        else:
            rig.sync(state, changed=changed_between(prev, state))
        prev = state
        assert rig.planner.in_sync and rig.held() == rig.planner.desired
        fresh = Planner(rig.config)
        fresh.update(state, NODE, None)
        assert _shape(rig.planner) == _shape(fresh)
        assert not broken(rig.contents())


def _shape(p: Planner) -> dict[str, object]:
    """Entries with ids replaced by what they stand for, so two plans compare across ids (and slot
    positions, which keep a survivor in place and so depend on history)."""
    desired = {role: to_tuples(role, entries.items()) for role, entries in p.desired.items()}
    be = {k[0]: v for k, v in desired["be"].items()}
    sets: dict[int, list[tuple[Any, ...]]] = {}
    for (set_id, _), (bid,) in desired["slot"].items():
        sets.setdefault(set_id, []).append(be[bid])
    rnat = {k[0]: v for k, v in desired["rnat"].items()}
    members: dict[int, list[tuple[Any, ...]]] = {}
    for (svc_id, bid), (flags,) in desired["member"].items():
        members.setdefault(svc_id, []).append((be[bid], flags))
    fe = {
        key: (sorted(sets.get(v[1], [])), sorted(members.get(v[0], [])), v[2], v[3], v[4], rnat[v[5]])
        for key, v in desired["fe"].items()
    }
    srcr = sorted((k[0], rnat[k[1]], k[2]) for k in desired["srcr"])
    return {"fe": fe, "srcr": srcr, "be": sorted(be.values())}


def test_the_shape_helper_sees_a_difference() -> None:
    a = Planner(Config())
    a.update(states(svc("a", "10.96.0.5", ["10.244.1.2"])), NODE, None)
    b = Planner(Config())
    b.update(states(svc("a", "10.96.0.5", ["10.244.1.3"])), NODE, None)
    assert _shape(a) != _shape(b)
    c = Planner(replace(Config(), masquerade_all=True))
    c.update(states(svc("a", "10.96.0.5", ["10.244.1.2"])), NODE, None)
    assert _shape(a) != _shape(c)


def test_a_full_backend_map_programs_whole_service_ports_not_a_bit_of_each() -> None:
    """Ten services of ten backends each, room for 65 backends: six whole services are programmed
    (in kube-proxy's order), four are reported; none is left with part of its backends."""
    state = states(
        *[svc(f"s{i:02d}", f"10.96.0.{i + 1}", [f"10.244.{i}.{e + 1}" for e in range(10)]) for i in range(10)]
    )
    rig = PlanRig(sizes={"be": 65})
    result = rig.sync(state)
    assert sorted(str(s) for s in result.failed) == [f"default/s{i:02d}" for i in range(6, 10)]
    assert len(rig.maps["be"]) == 60, "the backends of failed ports were taken back out"
    assert {n.split(":")[0] for n in rig.planner.fe_names().values()} >= {
        f"default/s{i:02d}" for i in range(6)
    }
    contents = rig.contents()
    assert not broken(contents)
    assert {fe.count for fe in contents.fe.values()} == {10}, "every programmed port has all its slots"
    # room appears: the failed ones go in at the next sync
    rig.maps["be"].max_entries = 100
    assert rig.sync(state, changed=set(result.failed)).failed == {}
    assert rig.planner.in_sync and rig.held() == rig.planner.desired


def test_an_endpoint_on_a_node_address_is_host_and_follows_the_nodes_addresses() -> None:
    """A host-network endpoint on this node (the API server behind `kubernetes`) is BackendFlag.HOST
    (the data path hands its flows to the node's stack); when the node's addresses change, every
    port is planned again and the flag follows."""
    from agent.config import NodeContext
    from agent.ebpf.abi import BackendFlag, ip_be

    rig = PlanRig()
    state = states(svc("kubernetes", "10.96.0.1", ["192.168.0.11", "192.168.0.12"]))
    rig.sync(state)

    def flags() -> dict[int, int]:
        return {be.addr: be.flags & BackendFlag.HOST for be in rig.contents().be.values()}

    assert flags() == {ip_be("192.168.0.11"): BackendFlag.HOST, ip_be("192.168.0.12"): 0}
    rig.planner.update(state, NodeContext(node_ips=("192.168.0.12",), primary_ip="192.168.0.12"), None)
    rig.planner.flush(rig.watched())
    assert flags() == {ip_be("192.168.0.11"): 0, ip_be("192.168.0.12"): BackendFlag.HOST}


def test_a_sets_backend_idents_are_the_entries_own() -> None:
    """`_idents` (the addresses packed and read in one C call, one port for all where they share
    it) gives what `entries.ident` gives endpoint by endpoint: IPv4's address in network order,
    the port in network order, the protocol; and the IPv6 planner's handles where it passes them."""
    one_port = (Endpoint("10.0.0.1", 8080), Endpoint("192.168.7.254", 8080))
    mixed = (Endpoint("10.0.0.1", 80), Endpoint("10.0.0.2", 443), Endpoint("10.0.0.1", 80))

    def expected(eps: tuple[Endpoint, ...], addr: Callable[[str], int]) -> list[int]:
        return [ident(addr(ep.ip), socket.htons(ep.port), 6) for ep in eps]

    def be(text: str) -> int:
        return int.from_bytes(socket.inet_aton(text), "little")

    for eps in (one_port, mixed, ()):
        assert planner_module._idents(eps, 6 << BE_PROTO, None) == expected(eps, be)
    handles = {"10.0.0.1": 7, "10.0.0.2": 9, "192.168.7.254": 11}
    assert planner_module._idents(mixed, 6 << BE_PROTO, handles.__getitem__) == expected(
        mixed, handles.__getitem__
    )
