"""delta.diff: ordered, batched, minimal writes; replayed op by op, no packet sees a broken service."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.config import Config
from agent.ebpf.abi import Backend, BackendKey, Frontend, FrontendKey, RevNat, RevNatKey, Slot, SlotKey
from agent.ebpf.delta import Op, OpKind, apply_ops, diff, summary, write_op
from agent.ebpf.plan import MapContents, plan, read_contents
from agent.model import ProxyState
from tests.ebpf.support import NODE, broken, fake_maps, proxy_states, replay, state_from_yaml, valid_contents

FE = FrontendKey(addr=1, port=80, proto=6, scope=1)


def contents(count: int, members: list[int], rnat: int = 1) -> MapContents:
    c = MapContents()
    for bid in set(members):
        c.be[BackendKey(id=bid)] = Backend(addr=bid, port=80, proto=6, flags=0)
    for pos, bid in enumerate(members, start=1):
        c.slot[SlotKey(set_id=1, slot=pos)] = Slot(backend_id=bid)
    c.rnat[RevNatKey(id=rnat)] = RevNat(addr=1, port=80)
    c.fe[FE] = Frontend(set_id=1, count=count, flags=0, affinity_timeout=0, rev_nat_id=rnat)
    return c


def kinds(ops: list[Op]) -> list[tuple[str, str]]:
    return [(op.role, op.kind.value) for op in ops]


def test_no_changes_no_ops() -> None:
    c = contents(2, [1, 2])
    assert diff(c, c.copy()) == []
    assert summary([]) == "no changes"


def test_growing_writes_backend_then_slot_then_count() -> None:
    old, new = contents(1, [1]), contents(2, [1, 2])
    ops = diff(old, new)
    assert kinds(ops) == [("be", "update"), ("slot", "update"), ("fe", "update")]
    assert ops[0].entries == ((BackendKey(id=2), new.be[BackendKey(id=2)]),)
    assert replay(old, ops).same_entries(new)


def test_shrinking_lowers_count_before_deleting_slot_and_backend() -> None:
    old, new = contents(2, [1, 2]), contents(1, [1])
    ops = diff(old, new)
    assert kinds(ops) == [("fe", "update"), ("slot", "delete"), ("be", "delete")]
    assert replay(old, ops).same_entries(new)


def test_replacing_a_backend_rewrites_its_slot_in_place() -> None:
    old, new = contents(2, [1, 2]), contents(2, [1, 3])
    ops = diff(old, new)
    assert kinds(ops) == [("be", "update"), ("slot", "update"), ("be", "delete")]
    assert replay(old, ops).same_entries(new)


def test_removing_a_service_unlinks_frontend_first() -> None:
    old, new = contents(2, [1, 2]), MapContents()
    ops = diff(old, new)
    assert kinds(ops) == [("fe", "delete"), ("slot", "delete"), ("rnat", "delete"), ("be", "delete")]
    assert replay(old, ops).same_entries(new)


def test_consecutive_same_kind_writes_are_one_batch() -> None:
    old = MapContents()
    new = contents(2, [1, 2])
    new.rnat[RevNatKey(id=2)] = RevNat(addr=2, port=80)
    ops = diff(old, new)
    assert kinds(ops) == [("be", "update"), ("rnat", "update"), ("slot", "update"), ("fe", "update")]
    assert len(ops[0].entries) == 2 and len(ops[1].entries) == 2


def test_write_op_reaches_the_maps() -> None:
    maps = fake_maps()
    new = contents(2, [1, 2])
    for op in diff(MapContents(), new):
        write_op(maps, op)
    assert read_contents(maps).same_entries(new)
    assert maps["be"].calls == [("update", 2)]
    for op in diff(new, MapContents()):
        write_op(maps, op)
    assert all(not m.data for m in maps.values())


@settings(max_examples=300, deadline=None)
@given(valid_contents(), valid_contents())
def test_any_valid_old_to_any_valid_new(old: MapContents, new: MapContents) -> None:
    assert not broken(old) and not broken(new)
    ops = diff(old, new)
    # every intermediate state is whole, and the end is exactly `new`
    assert replay(old, ops).same_entries(new)
    # minimal: nothing unchanged is written, nothing kept is deleted
    for op in ops:
        table_old, table_new = old.table(op.role), new.table(op.role)
        for key, value in op.entries:
            if op.kind is OpKind.UPDATE:
                assert table_old.get(key) != value
            else:
                assert key in table_old and key not in table_new
    # batched: no two neighbours share map and kind
    assert all((a.role, a.kind) != (b.role, b.kind) for a, b in itertools.pairwise(ops))
    assert diff(new, apply_ops(old, ops)) == []


@settings(max_examples=200, deadline=None)
@given(proxy_states(), proxy_states(), st.booleans(), st.booleans())
def test_plan_to_plan_transitions(a: ProxyState, b: ProxyState, masq: bool, restart: bool) -> None:
    """Real plans: the first state, then the second planned from the first (or from a dump)."""
    config = Config(masquerade_all=masq)
    first = plan(a, NODE, config)
    assert not broken(first)
    previous = first
    if restart:
        maps = fake_maps()
        for op in diff(MapContents(), first):
            write_op(maps, op)
        previous = read_contents(maps, first.cfg)
    second = plan(b, NODE, config, previous)
    assert not broken(second)
    assert replay(previous, diff(previous, second)).same_entries(second)
    # planning the same state again from what was written changes nothing
    assert diff(second, plan(b, NODE, config, second)) == []


def test_endpoint_churn_on_a_live_service_is_a_few_slot_writes() -> None:
    base = """
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.20
  ports: [{port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 80, protocol: TCP}]
endpoints:
"""
    eps = [f"  - addresses: [10.244.1.{i}]\n    nodeName: node1\n" for i in range(1, 5)]
    first = plan(state_from_yaml(base + "".join(eps)), NODE, Config())
    # drop the first endpoint: the last one moves into its slot, the count shrinks
    second = plan(state_from_yaml(base + "".join(eps[1:])), NODE, Config(), first)
    ops = diff(first, second)
    assert kinds(ops) == [
        ("slot", "update"),
        ("fe", "update"),
        ("slot", "delete"),
        ("member", "delete"),
        ("be", "delete"),
    ]
    assert len(ops[0].entries) == 1 and len(ops[2].entries) == len(ops[3].entries) == 1
    assert replay(first, ops).same_entries(second)
