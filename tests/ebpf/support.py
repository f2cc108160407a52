"""Helpers of the eBPF planning tests: YAML cases, a dict-backed map, hypothesis strategies, invariants."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from agent.config import Config, NodeContext
from agent.ebpf.abi import (
    MAPS,
    BackendKey,
    FrontendFlag,
    RevNatKey,
    SlotKey,
)
from agent.ebpf.entries import Entries, from_dump
from agent.ebpf.maps import FakeMap
from agent.ebpf.plan import MapContents, read_contents
from agent.ebpf.planner import ROLES, FlushResult, Planner
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


class WatchedMap:
    """A FakeMap whose raw writes go in one entry at a time, each followed by `check()`: a flush
    through these maps proves that no packet could ever meet a half-written service."""

    def __init__(self, inner: FakeMap, check: Callable[[], None]) -> None:
        self.inner = inner
        self.check = check

    def update_packed(self, keys: bytes, values: bytes) -> int:
        ks, vs = ctypes.sizeof(self.inner.spec.key), ctypes.sizeof(self.inner.spec.value)
        for i in range(len(keys) // ks):
            if self.inner.update_packed(keys[i * ks : (i + 1) * ks], values[i * vs : (i + 1) * vs]) == 0:
                return i
            self.check()
        return len(keys) // ks

    def delete_packed(self, keys: bytes) -> None:
        ks = ctypes.sizeof(self.inner.spec.key)
        for i in range(0, len(keys), ks):
            self.inner.delete_packed(keys[i : i + ks])
            self.check()


class PlanRig:
    """A planner over fake maps that outlive it, as pins do; `sizes` limits map entries."""

    def __init__(self, config: Config | None = None, sizes: dict[str, int] | None = None) -> None:
        self.config = config or Config()
        self.maps = {role: FakeMap(MAPS[role], (sizes or {}).get(role)) for role in ROLES}
        self.planner = Planner(self.config)
        self.writes: list[str] = []

    def _check(self) -> None:
        problems = broken(self.contents())
        assert not problems, problems

    def watched(self) -> dict[str, WatchedMap]:
        return {role: WatchedMap(m, self._check) for role, m in self.maps.items()}

    def sync(
        self, state: ProxyState, changed: Iterable[ServicePortName] | None = None, *, watch: bool = True
    ) -> FlushResult:
        """Plan and flush; `watch` checks every service is whole after every single write (costs a
        read of all maps per write: turn it off for large states)."""
        self.planner.update(state, NODE, None if changed is None else frozenset(changed))
        return self.planner.flush(self.watched() if watch else self.maps)

    def contents(self) -> MapContents:
        return read_contents(self.maps)

    def dump(self) -> dict[str, tuple[bytes, bytes]]:
        """What the maps hold, as the proxier reads it back."""
        return {role: m.dump_raw() for role, m in self.maps.items()}

    def held(self) -> dict[str, Entries]:
        """What the maps hold, as the planner's ints."""
        return {role: from_dump(role, *m.dump_raw()) for role, m in self.maps.items()}

    def restart(self) -> None:
        """A new planner (a restarted agent) over the same maps."""
        self.planner = Planner(self.config)
        self.planner.reconcile(self.dump(), adopt=True)


def assert_ids_valid(contents: MapContents) -> None:
    assert all(k.id != 0 for k in contents.be)
    assert all(k.id != 0 for k in contents.rnat)
    assert all(fe.rev_nat_id != 0 and fe.set_id != 0 and fe.svc_id != 0 for fe in contents.fe.values())
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


def failing_once(
    call: Callable[[], tuple[bytes, bytes]], error: BaseException
) -> Callable[[], tuple[bytes, bytes]]:
    """A map's `dump_raw` that raises `error` the first time only (a read-back that fails once:
    ENOMEM at a node's memory limit), then reads as `call` does."""
    left = [error]

    def dump() -> tuple[bytes, bytes]:
        if left:
            raise left.pop()
        return call()

    return dump
