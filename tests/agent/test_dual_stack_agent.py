"""The agent's two families (kube-proxy's metaproxier, agent/metaproxier.py).

With IPv6 configured, every sync programs the IPv4 state with the IPv4 proxier and the IPv6 state
with the IPv6 one, each with its own changes, node addresses and retries; an IPv6 failure never
holds back IPv4. The IPv6 proxier is ip6tables in both modes; in eBPF mode the eBPF data path's
IPv6 maps (the socket programs) are written beside it (agent/app.py wires it, tested at the
end). Without IPv6 in the flags no IPv6 proxier runs, the IPv6 state is computed and not
programmed, and the agent says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.config import Config, HostRouting, Mode, NodeContext
from agent.daemon import Agent, Parts, ProxierHealth
from agent.metrics import Metrics
from agent.model.types import IPFamily, NodeInfo, ProxyState, ServicePortName
from agent.proxier import SyncResult
from tests.agent.test_daemon import NODE, Clock, FakeEvents, FakeHealth, FakeProxier, FakeSource, spn
from tests.model.test_state import endpoint, service, slice_

if TYPE_CHECKING:
    from pathlib import Path

    from agent.iptables import IptablesProxier
    from tests.iptables.fakes import FakeRunner

NODE6 = NodeContext(("fd00:192:168::11",), "fd00:192:168::11")
UNSERVED = "are not programmed on this node: no IPv6 proxier runs"


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
    def __init__(
        self, mode: Mode, *, ipv6: bool, health: ProxierHealth | None = None, **settings: Any
    ) -> None:
        self.clock = Clock()
        self.source = FakeSource()
        self.proxier = StateProxier()
        self.proxier6 = StateProxier() if ipv6 else None
        self.node6 = NODE6
        self.health = FakeHealth()
        self.health6 = FakeHealth()
        self.registry = CollectorRegistry()
        settings = {"sync_period_s": 30.0, "min_sync_period_s": 0.0, **settings}
        config = Config(mode=mode, hostname="node1", **settings)
        self.agent = Agent(
            config,
            Parts(
                source=self.source,
                proxier=self.proxier,
                node_context=lambda: NODE,
                metrics=Metrics(self.registry),
                health=health or self.health,
                service_health=self.health,
                events=FakeEvents(),
                proxier6=self.proxier6,
                node_context6=lambda: self.node6,
                service_health6=self.health6 if ipv6 else None,
            ),
            clock=self.clock,
            wall=lambda: 2000.0,
        )

    def send(self, *objs: dict[str, Any], synced: str = "", deleted: bool = False) -> None:
        from agent.sources.base import EventType, Kind, ObjectEvent, Synced, object_key

        kind = EventType.DELETED if deleted else EventType.MODIFIED
        events: list[Any] = [
            ObjectEvent(Kind(o["kind"]), kind, object_key(Kind(o["kind"]), o), o) for o in objs
        ]
        if synced:
            events += [Synced(Kind.SERVICE, synced), Synced(Kind.ENDPOINT_SLICE, synced)]
        self.agent.deliver(events)

    def refresh_node_unchanged(self) -> None:
        """The node watcher fires and neither family's addresses moved."""
        self.agent.refresh_node()

    def sync(self, after: float = 1.0) -> None:
        self.clock.now += after
        self.agent.runner.run_once()


def dual(name: str = "web", v4: str = "10.96.0.10", v6: str = "fd00:10:96::a") -> dict[str, Any]:
    return service(name, clusterIP=v4, clusterIPs=[v4, v6], ipFamilies=["IPv4", "IPv6"])


def slice6(name: str, *ips: str, svc: str = "web", node: str = "node2") -> dict[str, Any]:
    obj = slice_(name, svc, endpoints=[endpoint(ip, node=node) for ip in ips])
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


def test_the_ipv6_proxier_is_called_only_when_something_is_due_for_it() -> None:
    """As upstream, where a proxier syncs when its own change tracker took a change: IPv4-only
    changes never reach the ip6tables proxier (an empty partial sync still rewrites its top-level
    chains); IPv6 ones, a retry and its own periodic full sync do."""
    rig = Rig(Mode.EBPF, ipv6=True, min_sync_period_s=0.1)
    assert rig.proxier6 is not None
    rig.send(dual(), synced="v1")
    rig.sync()
    assert rig.proxier6.calls == [None]
    for n in range(5):
        rig.send(service(f"v4-{n}", clusterIP=f"10.96.0.{30 + n}"))
        rig.sync(after=0.2)
    rig.refresh_node_unchanged()
    rig.sync(after=0.2)
    assert len(rig.proxier.calls) == 7 and rig.proxier6.calls == [None], "six IPv4 syncs, no IPv6 call"
    rig.send(slice6("web-v6", "fd00:10:244:1::2"))
    rig.sync()
    assert rig.proxier6.calls[-1] == frozenset({spn("web")})
    rig.proxier6.fail = {spn("web"): "no room"}
    rig.send(slice6("web-v6", "fd00:10:244:1::3"))
    rig.sync()
    rig.proxier6.fail = {}
    rig.send(service("v4-9", clusterIP="10.96.0.49"))
    rig.sync()
    assert rig.proxier6.calls[-1] == frozenset({spn("web")}), "the port that failed is retried"
    calls = len(rig.proxier6.calls)
    rig.sync()
    assert len(rig.proxier6.calls) == calls, "then nothing is due"
    rig.sync(after=30.0)
    assert rig.proxier6.calls[-1] is None, "its own periodic full sync (the drift repair)"


def test_ipv6_changes_inside_the_ipv6_floor_wait_for_it_and_are_programmed_together(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """eBPF mode's IPv4 syncs may come every 100 ms; the ip6tables proxier keeps iptables mode's
    1 s floor, and the runner is asked for the run that takes what waited. Meanwhile the sync
    line says IPv4 alone is done: `sync done: version=` (what the lab waits for) only once both
    families hold the version."""
    rig = Rig(Mode.EBPF, ipv6=True, min_sync_period_s=0.1)
    assert rig.proxier6 is not None
    rig.send(dual(), dual("api", "10.96.0.11", "fd00:10:96::b"), synced="v1")
    rig.sync()
    first = rig.clock.now
    rig.send(slice6("web-v6", "fd00:10:244:1::2"))
    rig.sync(after=0.1)
    rig.send(slice6("api-v6", "fd00:10:244:1::3", svc="api"))
    rig.sync(after=0.1)
    assert rig.proxier6.calls == [None] and len(rig.proxier.calls) == 3, "IPv4 synced, IPv6 waits"
    last = caplog.records[-1].getMessage()
    assert last.startswith("sync done for IPv4 only: version=") and last.endswith("IPv6 waits for its floor")
    caplog.clear()
    assert rig.agent.runner.next_run_at() == pytest.approx(first + 1.0), "a run when the floor has passed"
    rig.clock.now = first + 1.0
    rig.agent.runner.run_once()
    assert rig.proxier6.calls == [None, frozenset({spn("web"), spn("api")})]
    assert [e.ip for e in rig.agent.ipv6.model.state.endpoints[spn("api")].cluster] == ["fd00:10:244:1::3"]
    assert "sync done: version=" in caplog.records[-1].getMessage()


def test_an_ipv6_sync_that_asks_to_be_called_again_leaves_the_shared_failure_backoff_alone() -> None:
    """`SyncResult.again` (eBPF mode's ip6tables thinned once the maps serve a port) is a run at
    the IPv6 floor, not a retry: while it comes run after run, an IPv4 failure is still retried
    after the runner's first backoff (doubled at each such run, it would wait 8 s and more)."""
    from dataclasses import replace as replaced

    rig = Rig(Mode.EBPF, ipv6=True, min_sync_period_s=0.1)
    assert rig.proxier6 is not None
    plain = rig.proxier6.sync

    def again(state: ProxyState, node: NodeContext, changed: Any = None) -> SyncResult:
        return replaced(plain(state, node, changed), again=frozenset({spn("web")}))

    rig.proxier6.sync = again  # type: ignore[method-assign]
    rig.send(dual(), synced="v1")
    rig.sync()
    for _ in range(4):
        assert rig.agent.runner.next_run_at() == pytest.approx(rig.clock.now + 1.0), "the IPv6 floor"
        rig.clock.now = rig.agent.runner.next_run_at()
        rig.agent.runner.run_once()
    assert len(rig.proxier6.calls) == 5
    rig.proxier6.sync = plain  # type: ignore[method-assign]  # no more asked: only the retry is due
    rig.proxier.raise_ = RuntimeError("IPv4 restore failed")
    rig.clock.now = rig.agent.runner.next_run_at()
    rig.agent.runner.run_once()
    assert rig.agent.runner.failures == 1 and rig.proxier6.calls[-1] == frozenset({spn("web")})
    assert rig.agent.runner.next_run_at() <= rig.clock.now + 1.2, "the first backoff, not a doubled one"


def test_with_one_floor_for_both_families_the_ipv6_call_is_never_held() -> None:
    """iptables mode: both families share the floor, measured from the start of the agent's
    sync, so the IPv6 call, made after a slow full IPv4 one, is not held at the next sync for the
    difference (held, it would wait a whole second more for the run after)."""
    rig = Rig(Mode.IPTABLES, ipv6=True, min_sync_period_s=1.0)
    assert rig.proxier6 is not None
    slow = rig.proxier.sync

    def slow_ipv4(state: ProxyState, node: NodeContext, changed: Any = None) -> SyncResult:
        if changed is None:
            rig.clock.now += 0.3  # a full IPv4 restore takes 300 ms, a partial one no time
        return slow(state, node, changed)

    rig.proxier.sync = slow_ipv4  # type: ignore[method-assign]
    rig.send(dual(), synced="v1")
    rig.sync()
    rig.send(slice6("web-v6", "fd00:10:244:1::2"))
    rig.clock.now = rig.agent.runner.next_run_at()
    rig.agent.runner.run_once()
    assert rig.proxier6.calls == [None, frozenset({spn("web")})]


def test_the_shared_floor_is_measured_from_the_start_of_the_run_for_ipv6_as_for_the_runner() -> None:
    """iptables mode: a run whose queued events took 300 ms to apply does not hold the next run's
    IPv6 call, which the runner starts one floor after that run's start (measured after the apply,
    the IPv6 floor would end 300 ms after the runner's, and the call would wait for a run more)."""
    rig = Rig(Mode.IPTABLES, ipv6=True, min_sync_period_s=1.0)
    assert rig.proxier6 is not None
    apply = rig.agent._apply
    slow = [True]

    def slow_apply(event: Any) -> None:
        if slow[0]:
            rig.clock.now += 0.1
        apply(event)

    rig.agent._apply = slow_apply  # type: ignore[method-assign]
    rig.send(dual(), synced="v1")  # three events: 300 ms
    rig.sync()
    slow[0] = False
    rig.send(slice6("web-v6", "fd00:10:244:1::2"))
    rig.clock.now = rig.agent.runner.next_run_at()
    rig.agent.runner.run_once()
    assert rig.proxier6.calls == [None, frozenset({spn("web")})]


def test_an_unreadable_ipv6_node_address_fails_the_ipv6_family_alone_and_is_read_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Reading the node's IPv6 addresses raising is the IPv6 family's failure: an IPv4 failure of
    the same sync still reaches the runner as itself, and the next run reads the addresses again
    and programs IPv6 in full."""
    rig = Rig(Mode.EBPF, ipv6=True)
    assert rig.proxier6 is not None

    def unreadable() -> NodeContext:
        raise OSError("netlink: no buffer space")

    rig.agent._v6._node_context = unreadable
    rig.send(dual(), slice6("web-v6", "fd00:10:244:1::2"), synced="v1")
    rig.proxier.raise_ = RuntimeError("bpf map update: no space")
    with pytest.raises(RuntimeError, match="no space"):
        rig.agent.sync_once()
    assert rig.proxier6.calls == [], "no IPv6 call without its addresses"
    assert "cannot read the node's IPv6 addresses" in caplog.text and "netlink" in caplog.text
    rig.proxier.raise_ = None
    rig.agent._v6._node_context = lambda: rig.node6
    rig.sync()
    assert rig.proxier.calls[-1] is None and rig.proxier6.calls == [None]
    assert rig.proxier6.nodes == [NODE6]
    assert rig.agent.ipv6.in_step


def test_a_failing_ipv4_sync_does_not_stop_the_ipv6_one_each_counted_in_its_family(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(Mode.EBPF, ipv6=True)
    assert rig.proxier6 is not None
    rig.send(dual(), slice6("web-v6", "fd00:10:244:1::2"), synced="v1")
    rig.proxier.raise_ = RuntimeError("bpf map update: no space")
    rig.sync()
    assert rig.proxier6.calls == [None], "the IPv6 Services are programmed while eBPF fails"
    assert rig.agent.runner.failures == 1, "the IPv4 failure still reaches the runner (its backoff)"
    failures = "ekp_sync_failures_total"
    assert rig.registry.get_sample_value(failures, {"ip_family": "IPv4"}) == 1
    assert not rig.registry.get_sample_value(failures, {"ip_family": "IPv6"})
    assert rig.health.log[-1] == "updated IPv6", "IPv6 healthy, IPv4 not updated"
    assert "updated IPv4" not in rig.health.log
    rig.proxier.raise_ = None
    rig.proxier6.raise_ = RuntimeError("ip6tables-restore: exit 4")
    rig.send(slice6("web-v6", "fd00:10:244:1::3"))
    rig.sync()
    assert rig.proxier.calls == [None], "IPv4 programmed (in full: none succeeded yet) while ip6tables fails"
    assert rig.registry.get_sample_value(failures, {"ip_family": "IPv4"}) == 1
    assert rig.registry.get_sample_value(failures, {"ip_family": "IPv6"}) == 1


def test_new_ipv6_node_addresses_make_the_ipv6_sync_a_full_one() -> None:
    rig = Rig(Mode.IPTABLES, ipv6=True)
    assert rig.proxier6 is not None
    rig.send(dual(), synced="v1")
    rig.sync()
    rig.node6 = NodeContext(("fd00:192:168::12",), "fd00:192:168::12")
    rig.agent.refresh_node()
    rig.sync()
    assert rig.proxier6.calls[-1] is None and rig.proxier6.nodes[-1] == rig.node6


def test_without_ipv6_flags_ipv6_is_computed_and_the_agent_says_once_that_nothing_serves_it(
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
    assert "an IPv6 entry and the socket programs (IPv6 maps) and ip6tables" in line.getMessage()
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


def test_the_proxy_health_tracks_each_family_as_its_own_proxier_would() -> None:
    """Upstream's ProxyHealthServer keeps lastUpdated and oldestPendingQueued per IP family: each
    proxier calls QueuedUpdate(family) when its own change tracker took a change and
    Updated(family) when its own sync succeeded (and once as its SyncLoop starts)."""
    rig = Rig(Mode.IPTABLES, ipv6=True)
    assert rig.proxier6 is not None
    rig.agent.start()
    rig.agent.shutdown()
    assert rig.health.log == ["updated", "updated IPv6"], "each family's SyncLoop start"
    rig = Rig(Mode.IPTABLES, ipv6=True)
    assert rig.proxier6 is not None
    rig.health.log.clear()
    rig.send(dual(), synced="v1")
    assert rig.health.log == ["queued", "queued IPv6"], "a dual-stack Service: both families"
    rig.sync()
    assert rig.health.log[-2:] == ["updated", "updated IPv6"]
    rig.health.log.clear()
    rig.send(service("v4only", clusterIP="10.96.0.20"))
    assert rig.health.log == ["queued"], "an IPv4-only Service queues nothing for IPv6"
    rig.health.log.clear()
    rig.send(slice6("web-v6", "fd00:10:244:1::2"))
    assert rig.health.log == ["queued IPv6"], "an IPv6 slice queues nothing for IPv4"
    rig.health.log.clear()
    rig.send(dual("v4only", "10.96.0.20", "fd00:10:96::14"))
    assert rig.health.log == ["queued", "queued IPv6"], "a Service that gains IPv6"
    rig.health.log.clear()
    rig.send(service("v4only", clusterIP="10.96.0.20"))
    assert rig.health.log == ["queued", "queued IPv6"], "and loses it again: the IPv6 state changes"
    rig.health.log.clear()
    rig.send(slice6("web-v6"), deleted=True)
    assert rig.health.log == ["queued IPv6"], "a deleted slice: the family it had"
    rig.health.log.clear()
    rig.sync()
    assert rig.health.log == ["updated", "updated IPv6"]
    rig.health.log.clear()
    rig.proxier6.raise_ = RuntimeError("ip6tables-restore: exit 2")
    rig.send(slice6("web-v6", "fd00:10:244:1::3"))
    rig.sync()
    assert rig.health.log == ["queued IPv6", "updated"], "a failed IPv6 sync leaves IPv6 pending"


def test_a_failed_ipv6_sync_turns_healthz_unhealthy_after_the_timeout() -> None:
    """With the real ProxyHealth: /healthz is healthy only when each family's proxier is; the
    IPv6 family's pending change outlives the timeout while IPv4 syncs fine."""
    from agent.clock import FakeClock
    from agent.health import ProxyHealth, ProxyHealthHandlers

    clock = FakeClock()
    health = ProxyHealth(60.0, clock)
    rig = Rig(Mode.IPTABLES, ipv6=True, health=health)
    assert rig.proxier6 is not None
    health.updated("IPv4")
    health.updated("IPv6")
    rig.send(dual(), synced="v1")
    rig.proxier6.raise_ = RuntimeError("ip6tables-restore: exit 2")
    rig.sync()
    clock.advance(61.0)
    rig.send(service("v4only", clusterIP="10.96.0.20"))
    rig.sync()
    answer = ProxyHealthHandlers(health).healthz()
    assert answer.status == 503
    body = answer.body.decode()
    assert '"IPv4":{"lastUpdated"' in body and '"healthy":true}' in body
    assert '"IPv6":{"lastUpdated"' in body and '"healthy":false}' in body
    rig.proxier6.raise_ = None
    rig.sync()
    assert ProxyHealthHandlers(health).healthz().status == 200


def test_each_familys_health_check_server_counts_its_own_familys_local_endpoints() -> None:
    """Upstream's two proxiers each own a ServiceHealthServer (pkg/proxy/iptables NewProxier),
    fed from their own family's state: a dual-stack eTP=Local Service's healthCheckNodePort
    answers on IPv4 with the IPv4 local endpoints and on IPv6 with the IPv6 ones."""
    rig = Rig(Mode.IPTABLES, ipv6=True)
    local = {"type": "LoadBalancer", "externalTrafficPolicy": "Local"}
    ports = [{"name": "http", "port": 80, "nodePort": 30080, "targetPort": "web"}]
    lb = dual()
    lb["spec"].update(local, healthCheckNodePort=31000, ports=ports)
    v4ports = [{**ports[0], "nodePort": 30081}]
    v4lb = service("v4lb", clusterIP="10.96.0.20", healthCheckNodePort=31001, ports=v4ports, **local)
    rig.send(lb, v4lb, synced="v1")
    rig.send(
        slice_("web-v4", endpoints=[endpoint("10.244.1.2", node="node1")]),
        slice6("web-v6", "fd00:10:244:1::2", "fd00:10:244:1::3", node="node1"),
    )
    rig.sync()
    assert rig.health.services == [{"default/web": 31000, "default/v4lb": 31001}]
    assert rig.health6.services == [{"default/web": 31000}], "the IPv6 server: Services with IPv6"
    assert rig.health.endpoints[-1] == {"default/web": 1, "default/v4lb": 0}
    assert rig.health6.endpoints[-1] == {"default/web": 2}
    rig.send(slice6("web-v6", "fd00:10:244:1::2", node="node1"))
    rig.sync()
    assert rig.health6.endpoints[-1] == {"default/web": 1}
    assert rig.health.endpoints[-1] == {"default/web": 1, "default/v4lb": 0}, "IPv4 unchanged"
    assert len(rig.health.endpoints) == 1, "and not passed again"


def test_without_an_ipv6_proxier_ipv6_endpoints_reach_no_health_check_server() -> None:
    rig = Rig(Mode.EBPF, ipv6=False)
    lb = dual()
    lb["spec"].update(type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=31000)
    rig.send(lb, slice6("web-v6", "fd00:10:244:1::2", node="node1"), synced="v1")
    rig.sync()
    assert rig.health.endpoints == [{"default/web": 0}], "the IPv4 count holds no IPv6 endpoint"
    assert rig.health6.services == []


def test_the_ipv6_proxiers_syncs_carry_ip_family_ipv6_in_the_sync_metrics() -> None:
    """Upstream labels each proxier's sync metrics with its ip_family (pkg/proxy/metrics): the
    duration histograms, the last-synced and last-queued timestamps, network programming and the
    no-local-endpoints gauge; a failed IPv6 sync is timed but moves no timestamp."""
    rig = Rig(Mode.IPTABLES, ipv6=True)
    assert rig.proxier6 is not None
    v6 = {"ip_family": "IPv6"}
    lb = dual()
    lb["spec"].update(type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=31000)
    lb["spec"]["ports"] = [{"name": "http", "port": 80, "nodePort": 30080, "targetPort": "web"}]
    rig.send(lb, slice6("web-v6", "fd00:10:244:1::2"), synced="v1")
    assert rig.registry.get_sample_value("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", v6)
    rig.sync()
    count = "kubeproxy_sync_proxy_rules_duration_seconds_count"
    assert rig.registry.get_sample_value(count, v6) == 1
    assert rig.registry.get_sample_value(count, {"ip_family": "IPv4"}) == 1
    assert rig.registry.get_sample_value("kubeproxy_sync_full_proxy_rules_duration_seconds_count", v6) == 1
    last = rig.registry.get_sample_value("kubeproxy_sync_proxy_rules_last_timestamp_seconds", v6)
    assert last is not None
    no_local = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"
    assert rig.registry.get_sample_value(no_local, {**v6, "traffic_policy": "external"}) == 1, (
        "the IPv6 endpoint is on node2: the Local policy finds none here"
    )
    assert (
        rig.registry.get_sample_value(no_local, {"ip_family": "IPv4", "traffic_policy": "external"}) == 0
    ), "no IPv4 endpoint at all: not counted"
    rig.proxier6.raise_ = RuntimeError("ip6tables-restore: exit 2")
    rig.send(slice6("web-v6", "fd00:10:244:1::3"))
    rig.sync()
    assert rig.registry.get_sample_value(count, v6) == 2, "a failed sync is timed"
    assert rig.registry.get_sample_value("kubeproxy_sync_partial_proxy_rules_duration_seconds_count", v6) == 1
    assert rig.registry.get_sample_value("kubeproxy_sync_proxy_rules_last_timestamp_seconds", v6) == last
    assert rig.registry.get_sample_value("ekp_sync_failures_total", v6) == 1, "the family that failed"
    assert not rig.registry.get_sample_value("ekp_sync_failures_total", {"ip_family": "IPv4"})


def test_without_an_ipv6_proxier_no_metric_carries_ipv6() -> None:
    rig = Rig(Mode.EBPF, ipv6=False)
    rig.send(dual(), slice6("web-v6", "fd00:10:244:1::2"), synced="v1")
    rig.sync()
    text = generate_latest(rig.registry).decode()
    assert 'ip_family="IPv4"' in text and 'ip_family="IPv6"' not in text


# ---------------------------------------------------------------- the wiring (agent/app.py)

V6_CIDRS = ("10.244.0.0/16", "fd00:10:244::/56")


@pytest.mark.parametrize("mode", [Mode.EBPF, Mode.IPTABLES])
def test_an_ipv6_proxier_on_ip6tables_runs_in_both_modes_when_ipv6_is_configured(mode: Mode) -> None:
    """iptables mode: ip6tables. eBPF mode: the eBPF data path's IPv6 maps (socket-level load
    balancing) and ip6tables for every other packet; ip6tables alone without socket-level load
    balancing."""
    from agent.app import make_proxier, make_proxier6
    from agent.ebpf.proxier import EbpfIpv6
    from agent.iptables import IptablesProxier
    from agent.iptables.runner import SubprocessRunner
    from agent.metaproxier import EbpfAndIp6tables

    dual_stack = Config(mode=mode, hostname="node1", cluster_cidr=V6_CIDRS)
    proxier = make_proxier(dual_stack, ipv6=True)
    proxier6 = make_proxier6(dual_stack, proxier)
    if mode is Mode.EBPF:
        assert isinstance(proxier6, EbpfAndIp6tables) and isinstance(proxier6.ebpf, EbpfIpv6)
        assert proxier6.ebpf._ebpf is proxier, "the IPv6 maps of the data path the IPv4 proxier loads"
        ip6tables: object = proxier6.ip6tables
        assert isinstance(ip6tables, IptablesProxier)
        # its MASQUERADE keeps off the ports the tc IPv6 path's flows hold (EbpfProxier.snat6_held)
        assert ip6tables._snat6_held == proxier.snat6_held
        no_sockets = Config(mode=mode, hostname="node1", cluster_cidr=V6_CIDRS, socket_lb=False)
        assert isinstance(make_proxier6(no_sockets, make_proxier(no_sockets, ipv6=True)), IptablesProxier)
    else:
        ip6tables = proxier6
    assert isinstance(ip6tables, IptablesProxier) and ip6tables.family is IPFamily.IPv6
    assert isinstance(ip6tables.runner, SubprocessRunner), "ip6tables itself, not a stand-in"
    ipv4_only = Config(mode=mode, hostname="node1", cluster_cidr=V6_CIDRS[:1])
    assert make_proxier6(ipv4_only, make_proxier(ipv4_only, ipv6=False)) is None


EMPTY6 = ProxyState(NodeInfo("node1"), {}, {}, family=IPFamily.IPv6)


def nat_flow_lives() -> bool:
    """A translated IPv6 flow in nf_conntrack: ip6tables keeps the rules of an empty state."""
    return True


class Half:
    """One of EbpfAndIp6tables' two proxiers: records its calls, fails or not as told."""

    def __init__(
        self, name: str, calls: list[str], fail: Exception | None = None, failed: Any = None
    ) -> None:
        self.name, self.calls, self.fail, self.failed = name, calls, fail, failed or {}
        self.tc_serves = self.snat_granted = False  # the tc IPv6 path off: ip6tables gets every port

    def prepare(self) -> None:
        self.calls.append(f"{self.name}.prepare")

    def masquerade_apart(self, apart: bool) -> None:
        self.calls.append(f"{self.name}.apart" if apart else f"{self.name}.not apart")

    def snat_preview(self, node: NodeContext) -> bool:
        return False

    def sync(self, state: ProxyState, node: NodeContext, changed: Any = None) -> SyncResult:
        self.calls.append(f"{self.name}.sync")
        if self.fail is not None:
            raise self.fail
        return SyncResult(full=changed is None, failed=self.failed, repaired=1)

    def withdraw(self, state: ProxyState, *, full: bool) -> SyncResult:
        self.calls.append(f"{self.name}.withdraw")
        return SyncResult(full=True, failed={})

    def cleanup(self) -> None:
        self.calls.append(f"{self.name}.cleanup")


def test_ebpf_modes_ipv6_proxier_syncs_both_halves_and_reports_either_failure() -> None:
    from agent.errors import FatalError
    from agent.metaproxier import EbpfAndIp6tables

    calls: list[str] = []
    a, b = spn("a"), spn("b")
    config = Config(mode=Mode.EBPF, hostname="node1", cluster_cidr=V6_CIDRS)
    both = EbpfAndIp6tables(
        Half("ebpf", calls, failed={a: "full"}),
        Half("ip6", calls, failed={b: "rejected"}),
        config,
        nat_live=nat_flow_lives,
    )
    result = both.sync(EMPTY6, NODE6, None)
    # ip6tables first: the maps may take the node's address as the tc path's SNAT source only once
    # a restore put the MASQUERADE rule that keeps out of --bpf-snat-ports in place
    assert calls == ["ip6.sync", "ebpf.apart", "ebpf.sync"] and result.full and result.repaired == 2
    assert result.failed == {a: "full", b: "rejected"}
    calls.clear()
    broken = EbpfAndIp6tables(
        Half("ebpf", calls, fail=RuntimeError("maps")),
        Half("ip6", calls),
        config,
        nat_live=nat_flow_lives,
    )
    with pytest.raises(RuntimeError, match="maps"):
        broken.sync(EMPTY6, NODE6, frozenset())
    assert calls == ["ip6.sync", "ebpf.apart", "ebpf.sync"]
    calls.clear()
    no_rules = EbpfAndIp6tables(
        Half("ebpf", calls),
        Half("ip6", calls, fail=RuntimeError("restore")),
        config,
        nat_live=nat_flow_lives,
    )
    with pytest.raises(RuntimeError, match="restore"):
        no_rules.sync(EMPTY6, NODE6, frozenset())
    # the maps synced even when ip6tables failed, told the grant is gone (the rules in place are
    # not known to keep out of the range): the tc path's SNAT source is zero until a restore succeeds
    assert calls == ["ip6.sync", "ebpf.not apart", "ebpf.sync"]
    calls.clear()
    fatal = EbpfAndIp6tables(
        Half("ebpf", calls),
        Half("ip6", calls, fail=FatalError("gone")),
        config,
        nat_live=nat_flow_lives,
    )
    with pytest.raises(FatalError):
        fatal.sync(EMPTY6, NODE6, None)
    assert calls == ["ip6.sync"]
    calls.clear()
    both.prepare()
    both.cleanup()
    assert calls == ["ebpf.prepare", "ip6.prepare", "ebpf.cleanup", "ip6.cleanup"]


class HandbackRecorder:
    """Stands in for agent.takeover.out_of_ebpf.EbpfHandback: records that it ran."""

    runs: list[str] = []
    pending = True  # pins of an earlier eBPF mode are there (a switch from it)

    def __init__(self, config: Config) -> None:
        self._pins = config.pin_path

    def run(self) -> bool:
        HandbackRecorder.runs.append(self._pins)
        return True

    def put_back_liberal(self) -> None:
        pass


def test_ebpf_modes_ipv6_proxier_writes_ip6tables_and_removes_only_kube_proxys_ip6_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """eBPF mode's ip6tables proxier: its first sync writes kube-proxy's layout for the IPv6
    Services, then removes kube-proxy's `ip6 kube-proxy` nftables table (left to it by the eBPF
    start) and nothing else: neither `ip kube-proxy` (the eBPF start's) nor the eBPF data path,
    which iptables mode's IPv4 proxier hands back to nf_conntrack (EbpfHandback) and this one
    must never touch."""
    from agent.app import ip6tables_beside_ebpf
    from agent.model.state import build_state
    from agent.model.types import NodeInfo
    from tests.iptables.fakes import FakeCounters, FakeRunner
    from tests.iptables.test_kube_proxy_cleanup import nft_responder

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    HandbackRecorder.runs = []
    runner = FakeRunner()
    deleted, respond = nft_responder(["ip kube-proxy", "ip6 kube-proxy", "inet filter"])
    runner.responses["nft"] = respond  # type: ignore[assignment]
    config = Config(mode=Mode.EBPF, hostname="node1", cluster_cidr=V6_CIDRS)
    registry = CollectorRegistry()
    proxier6 = ip6tables_beside_ebpf(
        config, runner, Metrics(registry, Mode.EBPF, iptables=True), counters=FakeCounters()
    )
    result = build_state(
        [dual()], [slice6("web-v6", "fd00:10:244:1::2")], NodeInfo("node1"), family=IPFamily.IPv6
    )
    proxier6.sync(result.state, NODE6)
    assert "-d fd00:10:96::a --dport 80" in runner.save("nat") and "10.96.0.10" not in runner.save()
    assert deleted == [["ip6", "kube-proxy"]]
    assert HandbackRecorder.runs == [], "the eBPF data path serves IPv4 beside it: never handed back"
    rules = registry.get_sample_value(
        "kubeproxy_sync_proxy_rules_iptables_total", {"ip_family": "IPv6", "table": "nat"}
    )
    assert rules is not None and rules > 0, "iptables mode's rule counts, labelled IPv6"


def handback_pair(
    config: Config, clock: Callable[[], float]
) -> tuple[IptablesProxier, IptablesProxier, FakeRunner]:
    """iptables mode's two proxiers as the agent wires them (the IPv6 one's take-over is the IPv4
    one's hand-back wait), nft answering that kube-proxy left no table; the IPv6 runner returned."""
    from agent.iptables import IptablesProxier
    from tests.iptables.fakes import FakeCounters, FakeRunner
    from tests.iptables.test_kube_proxy_cleanup import nft_responder

    runner4, runner6 = FakeRunner(), FakeRunner()
    for runner in (runner4, runner6):
        runner.responses["nft"] = nft_responder([])[1]  # type: ignore[assignment]
    ipv4 = IptablesProxier(config, runner=runner4, counters=FakeCounters(), clock=clock)
    ipv6 = IptablesProxier(
        config,
        family=IPFamily.IPv6,
        runner=runner6,
        counters=FakeCounters(),
        take_over=ipv4.hand_back_after(IPFamily.IPv6),
    )
    return ipv4, ipv6, runner6


def test_iptables_mode_hands_the_ebpf_data_path_back_only_once_both_families_rules_are_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A switch from eBPF mode: the ip6tables in place is eBPF mode's, with only the ports its
    programs left to the stack. The IPv4 proxier's first sync comes first; detaching the programs
    then would leave every other IPv6 port dark until the IPv6 restore: the hand-back waits for
    it, a failed one included, and runs once, from whichever family restores last."""
    from agent.app import make_proxier, make_proxier6
    from agent.iptables import IptablesProxier
    from agent.model.state import build_state

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    HandbackRecorder.runs = []
    config = Config(mode=Mode.IPTABLES, hostname="node1", cluster_cidr=V6_CIDRS)
    ipv4, ipv6, runner6 = handback_pair(config, lambda: 0.0)
    state4 = build_state([dual()], [], NodeInfo("node1")).state
    state6 = build_state(
        [dual()], [slice6("web-v6", "fd00:10:244:1::2")], NodeInfo("node1"), family=IPFamily.IPv6
    ).state
    ipv4.sync(state4, NODE)
    assert HandbackRecorder.runs == [], "IPv6 is still on eBPF mode's thinned ip6tables"
    runner6.fail_next_restore = True
    with pytest.raises(Exception, match="fake"):
        ipv6.sync(state6, NODE6)
    ipv4.sync(state4, NODE, frozenset())
    assert HandbackRecorder.runs == [], "the IPv6 restore failed: its rules are not in place"
    ipv6.sync(state6, NODE6)
    assert HandbackRecorder.runs == [config.pin_path], "handed back once both families' rules serve"
    ipv4.sync(state4, NODE, frozenset())
    ipv6.sync(state6, NODE6, frozenset())
    assert HandbackRecorder.runs == [config.pin_path], "and only once"
    # the agent wires it so: the IPv6 proxier's take-over is the IPv4 one's wait
    proxier = make_proxier(config, ipv6=True)
    assert isinstance(proxier, IptablesProxier)
    proxier6 = make_proxier6(config, proxier)
    assert isinstance(proxier6, IptablesProxier)
    assert proxier._handback_waits == {IPFamily.IPv4, IPFamily.IPv6}
    alone = make_proxier(replace(config, cluster_cidr=V6_CIDRS[:1]), ipv6=False)
    assert isinstance(alone, IptablesProxier) and alone._handback_waits == {IPFamily.IPv4}


def test_the_hand_back_waits_for_the_ipv6_restore_one_sync_period_at_most_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The programs a switch from eBPF mode left attached translate from maps nobody writes: while
    the IPv6 restore fails the hand-back waits, told once, and goes after one --iptables-sync-period
    from the IPv4 rules' first restore, with a warning that the thinned IPv6 ports have no rule."""
    from agent.model.state import build_state

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    HandbackRecorder.runs = []
    config = Config(mode=Mode.IPTABLES, hostname="node1", cluster_cidr=V6_CIDRS, sync_period_s=30.0)
    now = [1000.0]
    ipv4, ipv6, runner6 = handback_pair(config, lambda: now[0])
    state4 = build_state([dual()], [], NodeInfo("node1")).state
    state6 = build_state(
        [dual()], [slice6("web-v6", "fd00:10:244:1::2")], NodeInfo("node1"), family=IPFamily.IPv6
    ).state

    def waits() -> list[str]:
        return [r.getMessage() for r in caplog.records if "keep serving until the IPv6" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="agent"):
        ipv4.sync(state4, NODE)
        for _ in range(2):
            runner6.fail_next_restore = True
            with pytest.raises(Exception, match="fake"):
                ipv6.sync(state6, NODE6)
            now[0] += 14.0
            ipv4.sync(state4, NODE, frozenset())
        assert HandbackRecorder.runs == [], "28s of 30: still waiting"
        assert len(waits()) == 1, "said once, at the first IPv4 restore"
        now[0] += 2.0
        ipv4.sync(state4, NODE, frozenset())
        assert HandbackRecorder.runs == [config.pin_path], "one sync period: handed back without IPv6"
        assert any(
            "IPv6 rules' first restore has not succeeded in 30s" in r.getMessage() for r in caplog.records
        )
        ipv6.sync(state6, NODE6)
        assert HandbackRecorder.runs == [config.pin_path], "and only once"


def test_a_node_that_never_ran_ebpf_mode_starts_iptables_mode_without_a_hand_back_wait(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No pins of an earlier eBPF mode: nothing is handed back, so the dual-stack start neither
    waits for the IPv6 restore nor warns about programs that are not there."""
    from agent.model.state import build_state

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    monkeypatch.setattr(HandbackRecorder, "pending", False)
    HandbackRecorder.runs = []
    config = Config(mode=Mode.IPTABLES, hostname="node1", cluster_cidr=V6_CIDRS)
    ipv4, _, _ = handback_pair(config, lambda: 0.0)
    state4 = build_state([dual()], [], NodeInfo("node1")).state
    with caplog.at_level(logging.WARNING, logger="agent"):
        ipv4.sync(state4, NODE)
    assert not [r for r in caplog.records if "eBPF programs" in r.getMessage()], caplog.text
    assert HandbackRecorder.runs == [config.pin_path], "run once, at once: its put-back of a kept sysctl"


def test_iptables_mode_with_nothing_pinned_puts_back_a_kept_tcp_be_liberal_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No pins (nothing to hand back), but an eBPF agent killed mid-takeover may have kept the
    node's tcp_be_liberal: the first good restore puts it back through EbpfHandback.run, and the
    restores after do not again."""
    from agent.model.state import build_state
    from agent.takeover.out_of_ebpf import EbpfHandback

    put_backs: list[str] = []

    def handback(config: Config) -> EbpfHandback:
        return EbpfHandback(
            config,
            snapshot_dir=str(tmp_path),
            put_back_liberal=lambda config, directory: put_backs.append(directory),
        )

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", handback)
    config = Config(mode=Mode.IPTABLES, hostname="node1", pin_path=str(tmp_path / "pins"))
    ipv4 = handback_pair(config, lambda: 0.0)[0]
    state4 = build_state([dual()], [], NodeInfo("node1")).state
    ipv4.sync(state4, NODE)
    assert put_backs == [str(tmp_path)], "the first restore puts the kept value back"
    ipv4.sync(state4, NODE)
    assert put_backs == [str(tmp_path)], "once"


def test_a_kube_proxy_ip6_table_that_cannot_be_removed_is_a_warning_and_retried_until_gone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The table left in place keeps kube-proxy's hooks beside ours: the operator is told once
    (not at every sync), each sync tries again, and the line after says it went after all."""
    from agent.app import ip6tables_beside_ebpf
    from agent.iptables.runner import Result
    from agent.model.state import build_state
    from agent.model.types import NodeInfo
    from tests.iptables.fakes import FakeCounters, FakeRunner

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    busy = ["Error: Could not process rule: Device or resource busy"]
    tries: list[list[str]] = []
    gone: list[bool] = []

    def respond(argv: list[str]) -> Result:
        if argv[1:3] == ["list", "tables"]:
            return Result(0, "" if gone else "table ip6 kube-proxy\n")
        tries.append(argv[3:])
        if busy:
            return Result(1, "", busy[0])
        gone.append(True)
        return Result(0)

    runner = FakeRunner()
    runner.responses["nft"] = respond
    config = Config(mode=Mode.EBPF, hostname="node1", cluster_cidr=V6_CIDRS)
    proxier6 = ip6tables_beside_ebpf(config, runner, counters=FakeCounters())
    state = build_state(
        [dual()], [slice6("web-v6", "fd00:10:244:1::2")], NodeInfo("node1"), family=IPFamily.IPv6
    )
    for _ in range(3):
        proxier6.sync(state.state, NODE6, frozenset())
    assert tries == [["ip6", "kube-proxy"]] * 3, "tried at every sync"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "could not remove kube-proxy's nftables table ip6 kube-proxy" in warned[0]
    assert "Device or resource busy" in warned[0] and "nft delete table" in warned[0]
    busy.clear()
    proxier6.sync(state.state, NODE6, frozenset())
    proxier6.sync(state.state, NODE6, frozenset())
    assert len(tries) == 4, "removed at the fourth try, and not tried again"
    assert "kube-proxy's nftables table(s) removed after all" in caplog.text


def test_the_ebpf_start_leaves_kube_proxys_ip6_table_to_the_ipv6_proxier() -> None:
    """The eBPF start removes kube-proxy's rules once its programs serve; with IPv6 configured the
    `ip6 kube-proxy` table stays until the ip6tables proxier serves (previous test), so IPv6
    Services are never without rules; without IPv6 both tables go, as before."""
    from agent.iptables.kube_proxy_cleanup import cleanup_kube_proxy
    from agent.takeover.into_ebpf import nft_families_to_remove
    from tests.iptables.fakes import FakeRunner
    from tests.iptables.test_kube_proxy_cleanup import nft_responder

    dual_stack = Config(mode=Mode.EBPF, hostname="node1", cluster_cidr=V6_CIDRS)
    ipv4_only = Config(mode=Mode.EBPF, hostname="node1", cluster_cidr=V6_CIDRS[:1])
    for config, gone in (
        (dual_stack, [["ip", "kube-proxy"]]),
        (ipv4_only, [["ip", "kube-proxy"], ["ip6", "kube-proxy"]]),
    ):
        runner = FakeRunner()
        deleted, respond = nft_responder(["ip kube-proxy", "ip6 kube-proxy"])
        runner.responses["nft"] = respond  # type: ignore[assignment]
        cleanup_kube_proxy(config, {"nft": runner}, nft_families=nft_families_to_remove(config))
        assert deleted == gone, config.cluster_cidr


def test_dry_run_in_ebpf_mode_prints_the_ip6tables_input_after_the_ebpf_maps(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    from agent.app import dry_run

    services = tmp_path / "services.yaml"
    services.write_text(yaml.safe_dump_all([dual(), slice6("web-v6", "fd00:10:244:1::2")]))
    config = Config(
        mode=Mode.EBPF,
        hostname="node1",
        cluster_cidr=V6_CIDRS,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        services_file=str(services),
        dry_run=True,
    )
    # The tc IPv6 path serves with either host routing (the default, legacy, here): what ip6tables
    # holds beside it once granted (agent/model/tc6_leaves.py), here no Service (its one endpoint
    # is a pod's), the layout's own chains still
    for routing in (config.bpf_host_routing, HostRouting.BPF):
        assert dry_run(replace(config, bpf_host_routing=routing)) == 0
        out = capsys.readouterr().out
        ebpf, marker, ip6tables = out.partition(
            "# ip6tables-restore input (IPv6): the service ports the tc IPv6"
        )
        assert marker, out
        ebpf4, marker6, ebpf6 = ebpf.partition("# eBPF IPv6 maps (the socket programs)\n")
        assert marker6 and "10.96.0.10" in ebpf4 and "fd00:10:96::a" not in ebpf4
        assert "fe6 [fd00:10:96::a]:80/TCP internal -> svc=1 set=1 count=1" in ebpf6
        assert "be6 1 -> [fd00:10:244:1::2]:8080/TCP" in ebpf6 and "10.96.0.10" not in ebpf6
        assert "fd00:10:96::a" not in ip6tables and "-A KUBE-POSTROUTING" in ip6tables, ip6tables
    # Without it (no socket-level load balancing): every Service's rules
    assert dry_run(replace(config, socket_lb=False)) == 0
    out = capsys.readouterr().out
    _, marker, ip6tables = out.partition("# ip6tables-restore input (IPv6)\n")
    assert marker, out
    assert "*nat" in ip6tables and "-d fd00:10:96::a --dport 80" in ip6tables and "COMMIT" in ip6tables


@pytest.mark.parametrize("mode", [Mode.EBPF, Mode.IPTABLES])
def test_the_node_addresses_are_followed_for_ipv6_when_an_ipv6_proxier_runs(mode: Mode) -> None:
    from agent.app import _address_watcher

    both = ("192.168.0.11", "fd00:192:168::11")
    assert _address_watcher(Config(mode=mode, node_ips=both, cluster_cidr=V6_CIDRS)) is None
    assert _address_watcher(Config(mode=mode, node_ips=both[:1], cluster_cidr=V6_CIDRS)) is not None
    assert _address_watcher(Config(mode=mode, node_ips=both[:1], cluster_cidr=V6_CIDRS[:1])) is None


def test_ebpf_mode_without_ip6tables_says_what_needs_it() -> None:
    """eBPF mode with IPv6 configured needs ip6tables for its IPv6 Services: without the binaries
    the agent stops with a message that names them and the way out (no IPv6 in the flags)."""
    from agent.errors import FatalError
    from agent.iptables.runner import SubprocessRunner

    config = Config(mode=Mode.EBPF, hostname="node1", cluster_cidr=V6_CIDRS)
    runner = SubprocessRunner(config, family=6, which=lambda tool: None, cap_mask=lambda: (1 << 41) - 1)
    with pytest.raises(FatalError) as err:
        _ = runner.backend
    assert "eBPF mode's IPv6 Services (served by ip6tables) cannot start" in str(err.value)
    assert "leave IPv6 out of --node-ip, --cluster-cidr and --service-cluster-ip-range" in str(err.value)


def test_the_ipv6_check_names_what_the_node_lacks(tmp_path: Any) -> None:
    """Upstream's platformCheckSupported: ip6tables present and the kernel's IPv6 on (a node
    booted with ipv6.disable=1 has no /proc/net/if_inet6)."""
    from agent.iptables.runner import ipv6_missing

    on = tmp_path / "if_inet6"
    on.write_text("00000000000000000000000000000001 01 80 10 80       lo\n")
    config = Config(mode=Mode.EBPF, hostname="node1", cluster_cidr=V6_CIDRS)

    def legacy_only(tool: str) -> str | None:
        return f"/usr/sbin/{tool}" if "legacy" in tool or not tool.startswith("ip6") else None

    probed: list[str] = []

    def nat_listable(config: Config, tool: str) -> str:
        probed.append(tool)
        return ""

    assert ipv6_missing(config, which=legacy_only, if_inet6=str(on), nat_probe=nat_listable) == ""
    assert probed == ["ip6tables-legacy"], "the nat table is asked of the installed backend"
    off = ipv6_missing(config, which=legacy_only, if_inet6=str(tmp_path / "absent"), nat_probe=nat_listable)
    assert "the kernel has IPv6 turned off" in off and "ipv6.disable=1" in off
    none = ipv6_missing(config, which=lambda tool: None, if_inet6=str(on), nat_probe=nat_listable)
    assert none == "neither ip6tables-nft nor ip6tables-legacy (with its -save and -restore) is on PATH"
    nft = Config(mode=Mode.IPTABLES, hostname="node1", cluster_cidr=V6_CIDRS, iptables_backend="nft")
    assert ipv6_missing(nft, which=legacy_only, if_inet6=str(on), nat_probe=nat_listable) == (
        "ip6tables-nft (with its -save and -restore) is not on PATH (--iptables-backend)"
    ), "--iptables-backend=nft: legacy's ip6tables is no use"


def test_ip6tables_that_cannot_list_the_nat_table_is_no_ipv6_proxier(tmp_path: Any) -> None:
    """Upstream's Present(): the binaries installed are not enough, the nat table's POSTROUTING
    chain must list (a kernel without IPv6 NAT fails there). One backend that can is enough."""
    from agent.iptables.runner import ipv6_missing, nat_chain_listable

    on = tmp_path / "if_inet6"
    on.write_text("00000000000000000000000000000001 01 80 10 80       lo\n")
    config = Config(mode=Mode.EBPF, hostname="node1", cluster_cidr=V6_CIDRS)

    def no_nat(config: Config, tool: str) -> str:
        return f"{tool} -t nat -S POSTROUTING: exit 3: can't initialize ip6tables table `nat'"

    def legacy_nat(config: Config, tool: str) -> str:
        return "" if tool.endswith("legacy") else no_nat(config, tool)

    everything = "/usr/sbin/{}".format
    missing = ipv6_missing(config, which=everything, if_inet6=str(on), nat_probe=no_nat)
    assert missing.startswith("the IPv6 nat table is not usable (ip6tables-nft -t nat -S POSTROUTING: exit 3")
    assert "; ip6tables-legacy -t nat" in missing, "both backends named"
    assert ipv6_missing(config, which=everything, if_inet6=str(on), nat_probe=legacy_nat) == ""
    # The real probe, of a binary that is not there: the reason, not an exception.
    absent = nat_chain_listable(config, "ip6tables-absent-ekp")
    assert absent.startswith("ip6tables-absent-ekp -t nat -S POSTROUTING: ") and "No such file" in absent


@pytest.mark.parametrize("mode", [Mode.EBPF, Mode.IPTABLES])
def test_a_node_that_cannot_do_ipv6_runs_single_stack_and_says_so_once(
    mode: Mode, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """As upstream: no IPv6 proxier, one warning that says what is missing and what it means, and
    the IPv6 family out of the proxy health (a node booted with ipv6.disable=1 serves IPv4 and
    stays live, instead of failing every IPv6 sync and being restarted for it)."""
    import yaml

    from agent.app import build_agent

    services = tmp_path / "services.yaml"
    services.write_text(yaml.safe_dump_all([dual(), slice6("web-v6", "fd00:10:244:1::2")]))
    config = Config(
        mode=mode,
        hostname="node1",
        cluster_cidr=V6_CIDRS,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        services_file=str(services),
        healthz_bind_address="",
        metrics_bind_address="",
    )
    lacking = "the kernel has IPv6 turned off (/proc/net/if_inet6 is absent: booted with ipv6.disable=1?)"
    agent = build_agent(config, ipv6_check=lambda c: lacking)
    assert agent.ipv6.proxier is None
    assert agent._health_families == (IPFamily.IPv4,)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"no iptables support for family IPv6: {lacking}. Running single-stack:")
    assert "IPv6 Services are not programmed on this node" in warnings[0]
    assert "/healthz and /livez follow IPv4 only" in warnings[0]
    assert failure_series(agent) == {"IPv4": 0.0}, "the family served counts from 0, the other has none"
    served = build_agent(config, ipv6_check=lambda c: "")
    assert served.ipv6.proxier is not None
    assert served._health_families == (IPFamily.IPv4, IPFamily.IPv6)
    assert failure_series(served) == {"IPv4": 0.0, "IPv6": 0.0}
    if mode is Mode.EBPF:
        # the tc IPv6 path is built only where the IPv6 half runs (settings that turn it on)
        from agent.ebpf import EbpfProxier

        path_on = replace(config, socket_lb=True, bpf_host_routing=HostRouting.BPF)
        for lacks, built in ((lacking, False), ("", True)):

            def check(c: Config, lacks: str = lacks) -> str:
                return lacks

            proxier = build_agent(path_on, ipv6_check=check)._parts.proxier
            assert isinstance(proxier, EbpfProxier) and proxier._tc_ipv6 is built, lacks
        # the proxier tells the gauge how many flows the IPv6 SNAT grant waits for
        metrics = served._parts.metrics
        assert metrics.ipv6_snat_held_flows is not None
        proxier = served._parts.proxier
        assert isinstance(proxier, EbpfProxier)
        proxier.on_snat6_held(2)
        [gauge] = metrics.ipv6_snat_held_flows.collect()
        assert gauge.samples[0].value == 2
        # ... and whether it is granted
        assert metrics.ipv6_snat_granted is not None
        proxier.on_snat6_granted(1)
        [gauge] = metrics.ipv6_snat_granted.collect()
        assert gauge.samples[0].value == 1


def failure_series(agent: Agent) -> dict[str, float]:
    """ekp_sync_failures_total's series by family, as /metrics shows them."""
    [family] = agent._parts.metrics.sync_failures.collect()
    return {s.labels["ip_family"]: s.value for s in family.samples if s.name == "ekp_sync_failures_total"}


def test_ebpf_modes_ipv6_preflight_checks_ip6tables_not_iptables() -> None:
    """The IPv6 proxier's preflight asks for the binaries it runs: with iptables there and
    ip6tables missing it does not pass."""
    from agent.errors import FatalError
    from agent.iptables.runner import IPV6_IN_EBPF_MODE, preflight

    config = Config(mode=Mode.EBPF, hostname="node1", cluster_cidr=V6_CIDRS)

    def iptables_only(tool: str) -> str | None:
        return None if tool.startswith("ip6tables") else f"/usr/sbin/{tool}"

    with pytest.raises(FatalError) as err:
        preflight(
            config,
            which=iptables_only,
            cap_mask=lambda: (1 << 41) - 1,
            who=IPV6_IN_EBPF_MODE,
            binary="ip6tables",
        )
    assert "neither ip6tables-nft nor ip6tables-legacy" in str(err.value)
