"""The agent's two families (kube-proxy's metaproxier, agent/metaproxier.py).

In iptables mode with IPv6 configured, every sync programs the IPv4 state with the IPv4 proxier
and the IPv6 state with the IPv6 one, each with its own changes, node addresses and retries; an
IPv6 failure never holds back IPv4. In eBPF mode the IPv6 state is computed and not programmed,
and the agent says so once.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.config import Config, Mode, NodeContext
from agent.daemon import Agent, Parts
from agent.metrics import Metrics
from agent.model.types import IPFamily, ProxyState, ServicePortName
from agent.proxier import SyncResult
from tests.agent.test_daemon import NODE, Clock, FakeEvents, FakeHealth, FakeProxier, FakeSource, spn
from tests.model.test_state import endpoint, service, slice_

NODE6 = NodeContext(("fd00:192:168::11",), "fd00:192:168::11")
UNSERVED = "IPv6 Services are served only in iptables mode"


@pytest.fixture(autouse=True)
def _info_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)


class StateProxier(FakeProxier):
    """FakeProxier that also keeps the cluster IPs and families of the states it was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[IPFamily, dict[ServicePortName, str]]] = []

    def sync(
        self, state: ProxyState, node: NodeContext, changed: frozenset[ServicePortName] | None = None
    ) -> SyncResult:
        result = super().sync(state, node, changed)
        self.seen.append((state.family, {k: v.cluster_ip for k, v in state.services.items()}))
        return result


class Rig:
    def __init__(self, mode: Mode, *, ipv6: bool) -> None:
        self.clock = Clock()
        self.source = FakeSource()
        self.proxier = StateProxier()
        self.proxier6 = StateProxier() if ipv6 else None
        self.node6 = NODE6
        config = Config(mode=mode, hostname="node1", sync_period_s=30.0, min_sync_period_s=0.0)
        self.agent = Agent(
            config,
            Parts(
                source=self.source,
                proxier=self.proxier,
                node_context=lambda: NODE,
                metrics=Metrics(CollectorRegistry()),
                health=FakeHealth(),
                events=FakeEvents(),
                proxier6=self.proxier6,
                node_context6=lambda: self.node6,
            ),
            clock=self.clock,
            wall=lambda: 2000.0,
        )

    def send(self, *objs: dict[str, Any], synced: str = "") -> None:
        from agent.sources.base import EventType, Kind, ObjectEvent, Synced, object_key

        events: list[Any] = [
            ObjectEvent(Kind(o["kind"]), EventType.MODIFIED, object_key(Kind(o["kind"]), o), o) for o in objs
        ]
        if synced:
            events += [Synced(Kind.SERVICE, synced), Synced(Kind.ENDPOINT_SLICE, synced)]
        self.agent.deliver(events)

    def sync(self) -> None:
        self.clock.now += 1
        self.agent.runner.run_once()


def dual(name: str = "web", v4: str = "10.96.0.10", v6: str = "fd00:10:96::a") -> dict[str, Any]:
    return service(name, clusterIP=v4, clusterIPs=[v4, v6], ipFamilies=["IPv4", "IPv6"])


def slice6(name: str, *ips: str, svc: str = "web") -> dict[str, Any]:
    obj = slice_(name, svc, endpoints=[endpoint(ip) for ip in ips])
    obj["addressType"] = "IPv6"
    return obj


def test_each_family_is_programmed_by_its_own_proxier_with_its_own_changes() -> None:
    rig = Rig(Mode.IPTABLES, ipv6=True)
    assert rig.proxier6 is not None
    rig.send(dual(), service("v4only", clusterIP="10.96.0.20"), synced="v1")
    rig.send(slice_("web-v4", endpoints=[endpoint("10.244.1.2")]), slice6("web-v6", "fd00:10:244:1::2"))
    rig.sync()
    assert rig.proxier.seen[-1] == (IPFamily.IPv4, {spn("web"): "10.96.0.10", spn("v4only"): "10.96.0.20"})
    assert rig.proxier6.seen[-1] == (IPFamily.IPv6, {spn("web"): "fd00:10:96::a"})
    assert rig.proxier6.calls == [None] and rig.proxier6.nodes == [NODE6]
    rig.send(slice6("web-v6", "fd00:10:244:1::3"))
    rig.sync()
    assert rig.proxier6.calls[-1] == frozenset({spn("web")}), "an IPv6 slice changes the IPv6 state"
    assert rig.proxier.calls[-1] == frozenset(), "and not the IPv4 one"
    eps = rig.agent.ipv6.model.state.endpoints[spn("web")].cluster
    assert [e.ip for e in eps] == ["fd00:10:244:1::3"]


def test_an_ipv6_failure_holds_back_nothing_and_is_retried_in_full(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(Mode.IPTABLES, ipv6=True)
    assert rig.proxier6 is not None
    rig.send(dual(), synced="v1")
    rig.proxier6.raise_ = RuntimeError("ip6tables-restore: exit 2")
    rig.sync()
    assert rig.proxier.calls == [None], "IPv4 programmed"
    assert "IPv6 sync failed" in caplog.text
    assert rig.agent.runner.next_run_at() <= rig.clock.now + 1.2, "a retry within a second or so"
    rig.proxier6.raise_ = None
    rig.sync()
    assert rig.proxier6.calls == [None], "the retry writes every IPv6 chain"


def test_new_ipv6_node_addresses_make_the_ipv6_sync_a_full_one() -> None:
    rig = Rig(Mode.IPTABLES, ipv6=True)
    assert rig.proxier6 is not None
    rig.send(dual(), synced="v1")
    rig.sync()
    rig.node6 = NodeContext(("fd00:192:168::12",), "fd00:192:168::12")
    rig.agent.refresh_node()
    rig.sync()
    assert rig.proxier6.calls[-1] is None and rig.proxier6.nodes[-1] == rig.node6


def test_ebpf_mode_computes_ipv6_and_says_once_that_it_does_not_serve_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(Mode.EBPF, ipv6=False)
    rig.send(service("v4only", clusterIP="10.96.0.20"), synced="v1")
    rig.sync()
    assert UNSERVED not in caplog.text, "no IPv6 Service: nothing to say"
    rig.send(dual())
    rig.sync()
    rig.send(dual("api", "10.96.0.11", "fd00:10:96::b"))
    rig.sync()
    assert caplog.text.count(UNSERVED) == 1
    (line,) = [r for r in caplog.records if UNSERVED in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert "1 IPv6 service port(s) (default/web:http)" in line.getMessage()
    assert rig.proxier.seen[-1][1] == {
        spn("v4only"): "10.96.0.20",
        spn("web"): "10.96.0.10",
        spn("api"): "10.96.0.11",
    }, "the eBPF data path still gets the IPv4 state, dual-stack Services' IPv4 side included"
    assert set(rig.agent.ipv6.model.state.services) == {spn("web"), spn("api")}


def test_a_malformed_service_is_reported_once_though_both_families_read_it() -> None:
    rig = Rig(Mode.IPTABLES, ipv6=True)
    bad = service("bad", clusterIP="10.96.0.30", ports=[{"name": "http", "port": 0}])
    rig.send(bad, synced="v1")
    rig.sync()
    events = rig.agent._parts.events
    assert isinstance(events, FakeEvents)
    assert [p.name for p in events.warned] == ["bad"]
