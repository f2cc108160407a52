"""The Agent: first-sync gate, incremental syncs, periodic full syncs, retries, problems, health."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Mapping
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from agent.config import Config, NodeContext
from agent.daemon import Agent, Parts
from agent.errors import FatalError
from agent.kube.reflector import Reflector
from agent.kube.resources import Resource
from agent.metrics import Metrics
from agent.model.problem import Problem
from agent.model.types import ProxyState, ServicePortName
from agent.proxier import SyncResult
from agent.sources.base import Event, EventType, Kind, ObjectEvent, Sink, Synced, object_key
from tests.kube.test_reflector import SETTINGS, FakeListCall
from tests.model.test_state import endpoint, service, slice_

NODE = NodeContext(("192.168.0.11",), "192.168.0.11")


@pytest.fixture(autouse=True)
def _info_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeSource:
    kinds = frozenset({Kind.SERVICE, Kind.ENDPOINT_SLICE})

    def __init__(self) -> None:
        self.sink: Sink | None = None

    def start(self, sink: Sink) -> None:
        self.sink = sink

    def stop(self) -> None:
        self.sink = None


class FakeProxier:
    def __init__(self) -> None:
        self.prepared = 0
        self.calls: list[frozenset[ServicePortName] | None] = []
        self.nodes: list[NodeContext] = []
        self.fail: dict[ServicePortName, str] = {}
        self.raise_: BaseException | None = None

    def sync(
        self, state: ProxyState, node: NodeContext, changed: frozenset[ServicePortName] | None = None
    ) -> SyncResult:
        if self.raise_ is not None:
            raise self.raise_
        self.calls.append(changed)
        self.nodes.append(node)
        return SyncResult(full=changed is None, failed=dict(self.fail))

    def prepare(self) -> None:
        self.prepared += 1

    def cleanup(self) -> None:
        pass


class FakeHealth:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.services: list[dict[str, int]] = []
        self.endpoints: list[dict[str, int]] = []

    # IPv4 entries read as before the IPv6 proxier existed; IPv6 ones name their family.
    def queued_update(self, family: str) -> None:
        self.log.append("queued" if family == "IPv4" else f"queued {family}")

    def updated(self, family: str) -> None:
        self.log.append("updated" if family == "IPv4" else f"updated {family}")

    def sync_node(self, node: Mapping[str, Any] | None) -> None:
        self.log.append(f"node {None if node is None else node['metadata']['name']}")

    def sync_services(self, ports: Mapping[str, int]) -> None:
        self.services.append(dict(ports))

    def sync_endpoints(self, local: Mapping[str, int]) -> None:
        self.endpoints.append(dict(local))


class FakeEvents:
    def __init__(self) -> None:
        self.warned: list[Problem] = []
        self.uids: list[str | None] = []

    def warn(self, problem: Problem, uid: str | None = None) -> None:
        self.warned.append(problem)
        self.uids.append(uid)


class Rig:
    def __init__(self, sync_period: float = 30.0, **settings: Any) -> None:
        self.node = NODE
        self.clock = Clock()
        self.source = FakeSource()
        self.proxier = FakeProxier()
        self.health = FakeHealth()
        self.events = FakeEvents()
        self.registry = CollectorRegistry()
        self.node = NODE  # what the node's addresses read as
        config = Config(hostname="node1", sync_period_s=sync_period, min_sync_period_s=0.0, **settings)
        self.agent = Agent(
            config,
            Parts(
                source=self.source,
                proxier=self.proxier,
                node_context=lambda: self.node,
                metrics=Metrics(self.registry),
                health=self.health,
                service_health=self.health,
                events=self.events,
            ),
            clock=self.clock,
            wall=lambda: 2000.0,
        )

    def send(self, *objs: dict[str, Any], deleted: bool = False, synced: str = "") -> None:
        events: list[Event] = []
        for obj in objs:
            kind = Kind(obj["kind"])
            etype = EventType.DELETED if deleted else EventType.MODIFIED
            events.append(ObjectEvent(kind, etype, object_key(kind, obj), obj))
        if synced:
            events += [Synced(Kind.SERVICE, synced), Synced(Kind.ENDPOINT_SLICE, synced)]
        self.agent.deliver(events)

    def sync(self) -> bool:
        return self.agent.runner.run_once()


def spn(name: str) -> ServicePortName:
    from agent.model.types import Protocol

    return ServicePortName("default", name, "http", Protocol.TCP)


def test_nothing_is_synced_before_every_kind_was_listed() -> None:
    rig = Rig()
    rig.send(service("web"), slice_("web-1", endpoints=[endpoint("10.244.1.2")]))
    rig.agent.deliver([Synced(Kind.SERVICE, "v1")])
    rig.sync()
    assert rig.proxier.calls == [], "the EndpointSlices were not listed yet: nothing may be pruned"
    rig.agent.deliver([Synced(Kind.ENDPOINT_SLICE, "v1")])
    rig.sync()
    assert rig.proxier.calls == [None], "the first sync is a full one"
    assert set(rig.agent.model.state.services) == {spn("web")}


def test_the_first_full_sync_lets_the_collector_run_again() -> None:
    """The start holds automatic collection off (agent.collector.StartHold); the first full sync
    freezes the state and turns it back on, not an earlier sync that programmed nothing."""
    rig = Rig()
    gc.disable()
    try:
        rig.send(service("web"), slice_("web-1", endpoints=[endpoint("10.244.1.2")]))
        rig.agent.deliver([Synced(Kind.SERVICE, "v1")])
        rig.sync()
        assert rig.proxier.calls == [] and not gc.isenabled()
        rig.agent.deliver([Synced(Kind.ENDPOINT_SLICE, "v1")])
        rig.sync()
        assert rig.proxier.calls == [None] and gc.isenabled()
    finally:
        gc.enable()


def test_later_syncs_hand_over_only_what_changed_and_the_period_brings_a_full_one() -> None:
    rig = Rig(sync_period=30.0)
    rig.send(service("web"), service("api", clusterIP="10.96.0.11"), synced="v1")
    rig.sync()
    rig.clock.now += 1
    rig.send(slice_("web-1", endpoints=[endpoint("10.244.1.2")]))
    rig.sync()
    assert rig.proxier.calls[-1] == frozenset({spn("web")})
    rig.clock.now += 1
    rig.sync()
    assert rig.proxier.calls[-1] == frozenset(), "nothing changed: nothing handed over"
    rig.clock.now += 30
    rig.sync()
    assert rig.proxier.calls[-1] is None, "every sync period: a full sync that repairs the kernel"


def test_service_ports_that_failed_are_retried_until_they_go_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig()
    rig.send(service("web"), service("api", clusterIP="10.96.0.11"), synced="v1")
    rig.proxier.fail = {spn("api"): "BPF map ekp_fe_v1 is full: raise --bpf-fe-max"}
    rig.sync()
    assert rig.agent.runner.next_run_at() <= rig.clock.now + 1.2, "a retry within a second or so"
    rig.sync()
    assert rig.proxier.calls[-1] == frozenset({spn("api")})
    assert caplog.text.count("could not program default/api:http") == 1, "logged once, not per retry"
    rig.proxier.fail = {}
    rig.sync()
    assert "programmed default/api:http after all" in caplog.text
    rig.sync()
    assert rig.proxier.calls[-1] == frozenset()


def test_a_malformed_object_is_reported_once_as_log_metric_and_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig()
    bad = service("bad", clusterIP="10.96.0.300")
    bad["metadata"]["uid"] = "0b1d-uid"
    rig.send(service("web"), bad, synced="v1")
    rig.sync()
    rig.send(service("bad", clusterIP="10.96.0.301"))
    rig.sync()
    assert [p.ref for p in rig.events.warned] == ["Service default/bad", "Service default/bad"]
    # The Event names the object's uid (kubectl describe matches on it) while the object has one.
    assert rig.events.uids == ["0b1d-uid", None]
    assert rig.registry.get_sample_value("ekp_skipped_objects_total", {"kind": "Service"}) == 2
    assert rig.registry.get_sample_value("ekp_invalid_objects") == 1
    rig.send(service("bad", clusterIP="10.96.0.31"))
    rig.sync()
    assert "resolved: Service default/bad" in caplog.text
    assert set(rig.agent.model.state.services) == {spn("web"), spn("bad")}


def test_a_refused_frontend_is_logged_counted_and_reported_and_follows_the_node_addresses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(sync_period=30.0, cluster_cidr=("10.244.0.0/16",), nodeport_range=(30000, 32767))
    hijack = service("hijack", externalIPs=["10.244.1.3", "192.168.0.20"], type="NodePort")
    hijack["spec"]["ports"] = [{"name": "http", "port": 80, "nodePort": 10256}]
    hijack["metadata"]["uid"] = "hj-uid"
    rig.send(hijack, synced="v1")
    rig.sync()
    sp = rig.agent.model.state.services[spn("hijack")]
    assert (sp.cluster_ip, sp.external_ips, sp.node_port) == ("10.96.0.10", ("192.168.0.20",), 0)
    assert [(p.refusal, u) for p, u in zip(rig.events.warned, rig.events.uids, strict=True)] == [
        ("RefusedExternalIP", "hj-uid"),
        ("RefusedNodePort", "hj-uid"),
    ]
    assert "refusing part of Service default/hijack: spec.externalIPs 10.244.1.3 refused" in caplog.text
    for reason in ("RefusedExternalIP", "RefusedNodePort"):
        assert rig.registry.get_sample_value("ekp_refused_frontends_total", {"reason": reason}) == 1
    assert rig.registry.get_sample_value("ekp_skipped_objects_total", {"kind": "Service"}) is None
    assert rig.registry.get_sample_value("ekp_invalid_objects") in (None, 0), "not malformed"

    # The node takes 192.168.0.20 on: the next full sync re-reads the addresses before its commit.
    rig.node = NodeContext(("192.168.0.11", "192.168.0.20"), "192.168.0.11")
    rig.clock.now += 31
    rig.sync()
    assert rig.proxier.calls[-1] is None
    assert rig.agent.model.state.services[spn("hijack")].external_ips == ()
    assert "spec.externalIPs 192.168.0.20 refused: an address of this node" in rig.events.warned[-1].reason


def test_health_hears_of_queued_and_applied_updates_and_of_health_check_ports() -> None:
    rig = Rig()
    lb = service(
        "lb",
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=31000,
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
    )
    rig.send(lb, service("web", clusterIP="10.96.0.11"), synced="v1")
    assert rig.health.log == ["queued"]
    rig.sync()
    assert rig.health.log == ["queued", "updated"]
    assert rig.health.services == [{"default/lb": 31000}]
    assert rig.health.endpoints == [{"default/lb": 0}]
    rig.send(slice_("lb-1", svc="lb", endpoints=[endpoint("10.244.1.2", node="node1")]))
    rig.sync()
    assert rig.health.services == [{"default/lb": 31000}], "ports unchanged: not passed again"
    assert rig.health.endpoints[-1] == {"default/lb": 1}
    rig.send(slice_("web-1", svc="web", endpoints=[endpoint("10.244.1.3", node="node1")]))
    rig.sync()
    assert len(rig.health.endpoints) == 2, "a service without a health check port changes nothing"
    rig.send(lb, deleted=True)
    rig.sync()
    assert rig.health.services[-1] == {}


def test_the_node_object_feeds_the_zone_and_the_health_check() -> None:
    rig = Rig()
    rig.send(service("web"), synced="v1")
    rig.sync()
    node = {"kind": "Node", "metadata": {"name": "node1", "labels": {"topology.kubernetes.io/zone": "b"}}}
    rig.agent.deliver([ObjectEvent(Kind.NODE, EventType.ADDED, "node1", node)])
    rig.sync()
    assert rig.agent.model.node.zone == "b"
    assert rig.proxier.calls[-1] is None, "a zone change re-evaluates every topology hint"
    assert "node node1" in rig.health.log


def test_the_nodes_pod_cidrs_reach_the_state_and_outlive_its_deletion(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--detect-local-mode=NodeCIDR reads spec.podCIDRs (spec.podCIDR on a Node without the list);
    a change re-plans everything; a deleted Node keeps them (kube-proxy keeps its detector)."""
    rig = Rig()
    rig.send(service("web"), synced="v1")
    rig.sync()
    node: dict[str, Any] = {
        "kind": "Node",
        "metadata": {"name": "node1"},
        "spec": {"podCIDR": "10.244.1.0/24"},
    }
    rig.agent.deliver([ObjectEvent(Kind.NODE, EventType.ADDED, "node1", node)])
    rig.sync()

    def pod_cidrs() -> list[str]:
        return list(rig.agent.model.state.node.pod_cidrs)

    assert pod_cidrs() == ["10.244.1.0/24"]
    node["spec"] = {"podCIDR": "10.244.7.0/24", "podCIDRs": ["10.244.7.0/24", "fd00:7::/64"]}
    rig.agent.deliver([ObjectEvent(Kind.NODE, EventType.MODIFIED, "node1", node)])
    rig.sync()
    assert pod_cidrs() == ["10.244.7.0/24", "fd00:7::/64"]
    assert rig.proxier.calls[-1] is None, "the NodeCIDR detector changed: every port re-planned"
    rig.agent.deliver([ObjectEvent(Kind.NODE, EventType.DELETED, "node1", node)])
    rig.sync()
    assert pod_cidrs() == ["10.244.7.0/24", "fd00:7::/64"]


def test_node_events_re_read_the_addresses_and_a_change_syncs_everything() -> None:
    """agent.nodewatch's notification: the next sync re-reads the addresses (not only a full sync
    every sync period), and a change programs every service port; no change, no full sync."""
    rig = Rig()
    rig.send(service("web"), synced="v1")
    rig.sync()
    rig.send(service("api", clusterIP="10.96.0.11"))
    rig.sync()
    assert rig.proxier.calls[-1] == frozenset({spn("api")})
    rig.agent.refresh_node()
    rig.send(service("db", clusterIP="10.96.0.12"))
    rig.sync()
    assert rig.proxier.calls[-1] == frozenset({spn("db")}), "same addresses: a partial sync"
    rig.node = NodeContext(("192.168.0.11", "192.168.0.211"), "192.168.0.11")
    rig.agent.refresh_node()
    rig.sync()
    assert rig.proxier.calls[-1] is None, "an address added: every service port"
    assert rig.proxier.nodes[-1] == rig.node


def test_a_fatal_error_stops_the_agent_with_status_1(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig()
    rig.send(service("web"), synced="v1")
    rig.proxier.raise_ = FatalError("--bpf-pin-path /tmp/x is not on a bpf filesystem: mount one")
    rig.sync()
    assert rig.agent.exit_code == 1 and rig.agent.wait(0)
    assert "not on a bpf filesystem" in caplog.text


def test_sync_done_line_names_the_source_version(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig()
    rig.send(service("web"), synced="abc123")
    rig.sync()
    assert "sync done: version=abc123, full sync" in caplog.text


def test_a_list_decoded_typed_skips_only_its_malformed_item_with_log_metric_and_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cold start's lists go through the reflector's typed decode (agent.model.wire): a slice
    whose `ready` is a string is refused as the whole decode refused it, its neighbours of both
    families are programmed."""

    def listed(*objs: dict[str, Any]) -> bytes:
        items = []
        for i, obj in enumerate(objs):
            obj = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
            obj["metadata"] = {**obj["metadata"], "uid": f"u{i}", "resourceVersion": str(10 + i)}
            items.append(obj)
        return orjson.dumps({"metadata": {"resourceVersion": "50"}, "items": items})

    bad = slice_("bad-1", "bad", endpoints=[endpoint("10.244.1.9", ready="false")])  # type: ignore[arg-type]
    v6 = slice_("web-6", endpoints=[endpoint("fd00::2")])
    v6["addressType"] = "IPv6"
    services = listed(
        service("web", ipFamilies=["IPv4", "IPv6"], clusterIPs=["10.96.0.10", "fd00::10"]),
        service("bad", clusterIP="10.96.0.11"),
    )
    slices = listed(slice_("web-4", endpoints=[endpoint("10.244.1.2")]), bad, v6)
    rig = Rig()
    for kind, api_version, body in (
        (Kind.SERVICE, "v1", services),
        (Kind.ENDPOINT_SLICE, "discovery.k8s.io/v1", slices),
    ):
        stopping = threading.Event()
        call = FakeListCall([body], stopping, [b""])
        Reflector(Resource(kind, api_version, call), rig.agent.deliver, SETTINGS, stopping).run()
    rig.sync()
    assert [p.ref for p in rig.events.warned] == ["EndpointSlice default/bad-1"]
    assert rig.events.uids == ["u1"]
    assert "endpoints[0].conditions.ready" in caplog.text
    assert rig.registry.get_sample_value("ekp_skipped_objects_total", {"kind": "EndpointSlice"}) == 1
    assert rig.registry.get_sample_value("ekp_invalid_objects") == 1
    (web,) = rig.agent.model.state.endpoints[spn("web")].cluster
    assert web.ip == "10.244.1.2"
    v6_state = rig.agent._v6.model.state  # the IPv6 proxier's model
    (web6,) = [e for eps in v6_state.endpoints.values() for e in eps.cluster]
    assert web6.ip == "fd00::2"
