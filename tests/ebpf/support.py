"""Helpers of the eBPF planning tests: YAML cases, a dict-backed map, hypothesis strategies, invariants."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from agent.config import NodeContext
from agent.ebpf.abi import (
    Backend,
    BackendKey,
    Frontend,
    FrontendFlag,
    FrontendKey,
    RevNat,
    RevNatKey,
    Slot,
    SlotKey,
    SrcRange,
    SrcRangeKey,
)
from agent.ebpf.delta import Op, apply_op
from agent.ebpf.plan import ROLES, MapContents
from agent.model import NodeInfo, ProxyState, build_state
from agent.model.topology import categorize_endpoints
from agent.model.types import Endpoint, Protocol, ServicePort, ServicePortName, SessionAffinity

NODE = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")
GOLDEN = Path(__file__).parent / "golden"


def _flatten(docs: Iterable[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for doc in docs:
        if doc is None:
            continue
        if doc.get("kind") == "List":
            out += _flatten(doc.get("items") or [])
        else:
            out.append(doc)
    return out


def state_from_yaml(text: str, node_name: str = "node1") -> ProxyState:
    objs = _flatten(yaml.safe_load_all(text))
    services = [o for o in objs if o.get("kind") == "Service"]
    slices = [o for o in objs if o.get("kind") == "EndpointSlice"]
    result = build_state(services, slices, NodeInfo(node_name))
    assert not result.problems, result.problems
    return result.state


class DictMap:
    """A dict-backed map with the loader's BpfMap surface (enough of it for these tests)."""

    def __init__(self) -> None:
        self.data: dict[Any, Any] = {}
        self.calls: list[tuple[str, int]] = []

    def items(self) -> list[tuple[Any, Any]]:
        return list(self.data.items())

    def update_batch(self, items: Sequence[tuple[Any, Any]]) -> None:
        self.calls.append(("update", len(items)))
        self.data.update(items)

    def delete_batch(self, keys: Sequence[Any]) -> None:
        self.calls.append(("delete", len(keys)))
        for k in keys:
            del self.data[k]


def fake_maps() -> dict[str, DictMap]:
    return {role: DictMap() for role in ROLES}


# ---------------------------------------------------------------------------------- invariants


def broken(contents: MapContents) -> list[str]:
    """What a packet could trip over in `contents`: [] when every reference resolves."""
    problems: list[str] = []
    for fkey, fe in contents.fe.items():
        for pos in range(1, fe.count + 1):
            if SlotKey(set_id=fe.set_id, slot=pos) not in contents.slot:
                problems.append(f"{fkey}: slot {fe.set_id}#{pos} missing")
        if RevNatKey(id=fe.rev_nat_id) not in contents.rnat:
            problems.append(f"{fkey}: rnat {fe.rev_nat_id} missing")
        if fe.flags & FrontendFlag.SOURCE_RANGES and not any(
            k.rev_nat_id == fe.rev_nat_id for k in contents.srcr
        ):
            problems.append(f"{fkey}: no source range for rnat {fe.rev_nat_id}")
    for skey, slot in contents.slot.items():
        if BackendKey(id=slot.backend_id) not in contents.be:
            problems.append(f"slot {skey.set_id}#{skey.slot}: backend {slot.backend_id} missing")
    for mkey in contents.member:
        if BackendKey(id=mkey.backend_id) not in contents.be:
            problems.append(f"member svc={mkey.svc_id}: backend {mkey.backend_id} missing")
    return problems


def replay(old: MapContents, ops: Sequence[Op]) -> MapContents:
    """Apply `ops` one by one, asserting the invariants after each."""
    cur = old.copy()
    for i, op in enumerate(ops):
        apply_op(cur, op)
        assert not broken(cur), f"after op {i} ({op}): {broken(cur)}"
    return cur


def assert_ids_valid(contents: MapContents) -> None:
    assert all(k.id != 0 for k in contents.be)
    assert all(k.id != 0 for k in contents.rnat)
    assert all(fe.rev_nat_id != 0 and fe.set_id != 0 for fe in contents.fe.values())
    assert all(k.slot >= 1 for k in contents.slot)


# ---------------------------------------------------------------------------------- strategies

_IPS = [f"10.244.{n}.{h}" for n in (1, 2) for h in (1, 2, 3)]


@st.composite
def service_ports(draw: st.DrawFn, index: int) -> tuple[ServicePort, tuple[Endpoint, ...]]:
    proto = draw(st.sampled_from([Protocol.TCP, Protocol.UDP]))
    name = ServicePortName("ns", f"svc{index}", draw(st.sampled_from(["", "a"])), proto)
    node_port = draw(st.sampled_from([0, 30000 + index]))
    lb = draw(st.sampled_from([(), ("203.0.113.1",), ("203.0.113.2",)]))
    external = draw(st.sampled_from([(), ("192.168.0.200",)]))
    accessible = bool(node_port or lb or external)
    affinity = draw(st.booleans())
    sp = ServicePort(
        name=name,
        cluster_ip=f"10.96.0.{draw(st.integers(1, 6))}",
        port=draw(st.sampled_from([80, 443])),
        protocol=proto,
        node_port=node_port,
        external_ips=external,
        load_balancer_ips=lb,
        load_balancer_source_ranges=draw(st.sampled_from([(), ("198.51.100.0/24",), ("192.168.0.0/24",)])),
        external_policy_local=accessible and draw(st.booleans()),
        internal_policy_local=draw(st.booleans()),
        session_affinity=SessionAffinity.CLIENT_IP if affinity else SessionAffinity.NONE,
        affinity_timeout_seconds=600 if affinity else 0,
    )
    ips = draw(st.lists(st.sampled_from(_IPS), unique=True, max_size=4))
    eps = tuple(
        Endpoint(
            ip=ip,
            port=draw(st.sampled_from([8080, 8443])),
            ready=(ready := draw(st.booleans())),
            serving=ready or draw(st.booleans()),
            terminating=not ready and draw(st.booleans()),
            node_name="node1" if ip.startswith("10.244.1.") else "node2",
            is_local=ip.startswith("10.244.1."),
        )
        for ip in ips
    )
    return sp, tuple(sorted(eps, key=lambda e: e.sort_key))


@st.composite
def proxy_states(draw: st.DrawFn) -> ProxyState:
    node = NodeInfo("node1")
    indexes = draw(st.lists(st.integers(0, 5), unique=True, max_size=4))
    services = {}
    endpoints = {}
    for i in indexes:
        sp, eps = draw(service_ports(i))
        services[sp.name] = sp
        endpoints[sp.name] = categorize_endpoints(eps, sp, node)
    return ProxyState(node=node, services=services, endpoints=endpoints)


@st.composite
def valid_contents(draw: st.DrawFn) -> MapContents:
    """Arbitrary self-consistent contents over small id pools, so two draws overlap a lot."""
    out = MapContents()
    be_ids = draw(st.lists(st.integers(1, 8), unique=True, max_size=6))
    for bid in be_ids:
        out.be[BackendKey(id=bid)] = Backend(
            addr=draw(st.integers(1, 4)), port=draw(st.sampled_from([80, 81])), proto=6, flags=0
        )
    sets: dict[int, int] = {}
    for sid in draw(st.lists(st.integers(1, 4), unique=True, max_size=4)):
        members = draw(st.lists(st.sampled_from(be_ids), max_size=4)) if be_ids else []
        for pos, bid in enumerate(members, start=1):
            out.slot[SlotKey(set_id=sid, slot=pos)] = Slot(backend_id=bid)
        sets[sid] = len(members)
    rnat_ids = draw(st.lists(st.integers(1, 5), unique=True, min_size=1, max_size=4))
    for rid in rnat_ids:
        out.rnat[RevNatKey(id=rid)] = RevNat(addr=draw(st.integers(1, 3)), port=80)
    if sets:
        for addr in draw(st.lists(st.integers(1, 5), unique=True, max_size=5)):
            sid = draw(st.sampled_from(sorted(sets)))
            rid = draw(st.sampled_from(rnat_ids))
            ranges = draw(st.booleans())
            flags = int(FrontendFlag.SOURCE_RANGES) if ranges else 0
            if ranges:
                key = SrcRangeKey(prefixlen=32 + 24, rev_nat_id=rid, addr=draw(st.integers(1, 2)))
                out.srcr[key] = SrcRange(allow=1)
            out.fe[FrontendKey(addr=addr, port=80, proto=6, scope=draw(st.integers(0, 1)))] = Frontend(
                set_id=sid,
                count=draw(st.integers(0, sets[sid])),
                flags=flags | draw(st.sampled_from([0, int(FrontendFlag.AFFINITY)])),
                affinity_timeout=0,
                rev_nat_id=rid,
            )
    return out
