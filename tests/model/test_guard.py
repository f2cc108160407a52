"""FrontendGuard: externalIPs, load-balancer IPs and node ports a node refuses to program.

The CVE-2020-8554 class: a Service's externalIPs (or a load balancer's ingress IP) capture that
address's traffic on every node, and a nodePort outside the API server's range captures a port
some other process owns. The guard runs in the pure model, so both modes program the same.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.model import FrontendGuard, NodeInfo, Protocol, ServicePortName, build_state
from agent.model.guard import REFUSED_EXTERNAL_IP, REFUSED_NODE_PORT, refuse_ports
from agent.model.parse import parse_service
from agent.model.tracker import ProxyModel
from tests.model.test_state import endpoint, service, slice_

NODE = NodeInfo("node1")
WEB = ServicePortName("default", "web", "http", Protocol.TCP)
GUARD = FrontendGuard.of(
    node_ips=["192.168.0.11"],
    cluster_cidrs=["10.244.0.0/16"],
    service_cidrs=["10.96.0.0/12"],
    node_port_range=(30000, 32767),
)


@pytest.mark.parametrize(
    ("guard", "address", "why"),
    [
        (GUARD, "203.0.113.7", None),
        (GUARD, "192.168.0.11", "an address of this node"),
        (GUARD, "192.168.0.12", None),  # another node: only the allow-list refuses it
        (GUARD, "10.244.1.3", "inside --cluster-cidr 10.244.0.0/16 (pod addresses)"),
        (GUARD, "10.96.0.10", "inside --service-cluster-ip-range 10.96.0.0/12 (Service addresses)"),
        (GUARD, "10.111.255.255", "inside --service-cluster-ip-range 10.96.0.0/12 (Service addresses)"),
        (GUARD, "10.112.0.1", None),
        (
            FrontendGuard.of(allowed_cidrs=["203.0.113.0/24", "198.51.100.0/24"]),
            "192.0.2.1",
            "outside --external-ip-cidrs 203.0.113.0/24,198.51.100.0/24",
        ),
        (FrontendGuard.of(allowed_cidrs=["203.0.113.0/24"]), "203.0.113.200", None),
        # The protected ranges win over the allow-list.
        (
            FrontendGuard.of(node_ips=["192.168.0.11"], allowed_cidrs=["192.168.0.0/16"]),
            "192.168.0.11",
            "an address of this node",
        ),
        (FrontendGuard(), "192.168.0.11", None),  # no guard configured: nothing refused
        # IPv6 entries of the flags protect nothing here (IPv4 proxy) and do not fail.
        (FrontendGuard.of(cluster_cidrs=["fd00::/64"]), "10.244.1.3", None),
    ],
)
def test_refuse_address(guard: FrontendGuard, address: str, why: str | None) -> None:
    assert guard.refuse_address(address) == why


@pytest.mark.parametrize(
    ("port", "why"),
    [
        (30000, None),
        (32767, None),
        (29999, "outside --node-port-range 30000-32767"),
        (32768, "outside --node-port-range 30000-32767"),
        (10256, "outside --node-port-range 30000-32767"),
    ],
)
def test_refuse_node_port(port: int, why: str | None) -> None:
    assert GUARD.refuse_node_port(port) == why
    assert FrontendGuard().refuse_node_port(port) is None


def lb_service(**spec: Any) -> dict[str, Any]:
    svc = service(type="LoadBalancer", **spec)
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}, {"ip": "10.244.2.2"}]}}
    return svc


def test_refused_addresses_leave_the_other_frontends_of_every_port() -> None:
    ports = parse_service(
        lb_service(
            externalIPs=["198.51.100.4", "192.168.0.11", "10.244.1.3"],
            ports=[
                {"name": "http", "port": 80, "nodePort": 30080},
                {"name": "admin", "port": 81, "nodePort": 10256},
            ],
            externalTrafficPolicy="Local",
            healthCheckNodePort=10249,
        )
    )
    kept, refused = refuse_ports(ports, GUARD)
    assert [p.external_ips for p in kept] == [("198.51.100.4",)] * 2
    assert [p.load_balancer_ips for p in kept] == [("203.0.113.9",)] * 2
    assert [p.node_port for p in kept] == [30080, 0]
    assert [p.health_check_node_port for p in kept] == [0, 0]
    assert [p.cluster_ip for p in kept] == ["10.96.0.10"] * 2
    assert refused.external_ips == (
        "spec.externalIPs 192.168.0.11 refused: an address of this node; "
        "spec.externalIPs 10.244.1.3 refused: inside --cluster-cidr 10.244.0.0/16 (pod addresses); "
        "status.loadBalancer.ingress IP 10.244.2.2 refused: inside --cluster-cidr 10.244.0.0/16 "
        "(pod addresses); not programmed on this node, the Service's other frontends are"
    )
    assert refused.node_ports == (
        "spec.ports port admin/TCP nodePort 10256 refused: outside --node-port-range 30000-32767; "
        "spec.healthCheckNodePort 10249 refused: outside --node-port-range 30000-32767; "
        "not programmed on this node, the Service's other frontends are"
    )


def test_nothing_refused_keeps_the_ports_as_they_are() -> None:
    ports = parse_service(service(externalIPs=["198.51.100.4"]))
    kept, refused = refuse_ports(ports, GUARD)
    assert kept == tuple(ports)
    assert (refused.external_ips, refused.node_ports) == ("", "")


def test_build_state_programs_the_rest_of_a_hijacking_service() -> None:
    hijack = service(
        "hijack", clusterIP="10.96.0.20", externalIPs=["10.244.1.3", "192.168.0.11"], type="NodePort"
    )
    hijack["spec"]["ports"] = [{"name": "http", "port": 10256, "nodePort": 10256}]
    result = build_state([hijack], [], NODE, GUARD)
    (sp,) = result.state.services.values()
    assert (sp.cluster_ip, sp.port, sp.external_ips, sp.node_port) == ("10.96.0.20", 10256, (), 0)
    assert [(p.refusal, p.ref) for p in result.problems] == [
        (REFUSED_EXTERNAL_IP, "Service default/hijack"),
        (REFUSED_NODE_PORT, "Service default/hijack"),
    ]
    # Without a guard (the tests of other behaviour, a bare build), everything is programmed.
    (plain,) = build_state([hijack], [], NODE).state.services.values()
    assert (plain.external_ips, plain.node_port) == (("10.244.1.3", "192.168.0.11"), 10256)


def test_a_refused_external_ip_claims_nothing() -> None:
    """A refused frontend is out before conflicts are decided: an older Service refused an
    external IP cannot hold it against a younger one the guard allows (here the guard changes
    between the two, as the node's addresses do)."""
    older = service("old", clusterIP="10.96.0.20", externalIPs=["198.51.100.4"])
    older["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z"
    younger = service("new", clusterIP="10.96.0.21", externalIPs=["198.51.100.4"])
    younger["metadata"]["creationTimestamp"] = "2021-01-01T00:00:00Z"
    m = ProxyModel(NODE, FrontendGuard.of(node_ips=["198.51.100.4"]))
    m.set_service("default/old", older)
    m.set_service("default/new", younger)
    m.commit()
    assert {str(n): sp.external_ips for n, sp in m.state.services.items()} == {
        "default/old:http": (),
        "default/new:http": (),
    }
    assert not [p for p in m.problems() if not p.refusal], "no conflict: neither claims the address"


def test_the_guard_follows_the_node_and_problems_come_and_go() -> None:
    m = ProxyModel(NODE, FrontendGuard.of(node_ips=["192.168.0.11"]))
    m.set_service("default/web", service(externalIPs=["192.168.0.20"]))
    m.set_slice("default/web-1", slice_("web-1", endpoints=[endpoint("10.244.1.2")]))
    first = m.commit()
    assert first.problems_added == ()
    assert m.state.services[WEB].external_ips == ("192.168.0.20",)

    # The node gains 192.168.0.20: every Service is checked again, in one full commit.
    m.set_guard(FrontendGuard.of(node_ips=["192.168.0.11", "192.168.0.20"]))
    assert m.full_pending
    moved = m.commit()
    assert moved.changed is None
    assert m.state.services[WEB].external_ips == ()
    assert [(p.refusal, p.reason) for p in moved.problems_added] == [
        (
            REFUSED_EXTERNAL_IP,
            "spec.externalIPs 192.168.0.20 refused: an address of this node; not programmed on this "
            "node, the Service's other frontends are",
        )
    ]
    assert [e.ip for e in m.state.endpoints[WEB].cluster] == ["10.244.1.2"], "the rest still served"

    # The same guard again is no change; the Service fixed clears the problem.
    m.set_guard(FrontendGuard.of(node_ips=["192.168.0.11", "192.168.0.20"]))
    assert not m.full_pending
    m.set_service("default/web", service(externalIPs=["203.0.113.1"]))
    fixed = m.commit()
    assert fixed.changed == frozenset({WEB})
    assert [p.refusal for p in fixed.problems_cleared] == [REFUSED_EXTERNAL_IP]
    assert m.problems() == []


def test_deleting_a_refused_service_clears_its_problems() -> None:
    m = ProxyModel(NODE, GUARD)
    svc = service(type="NodePort", externalIPs=["10.244.9.9"])
    svc["spec"]["ports"] = [{"name": "http", "port": 80, "nodePort": 22}]
    m.set_service("default/web", svc)
    assert {p.refusal for p in m.commit().problems_added} == {REFUSED_EXTERNAL_IP, REFUSED_NODE_PORT}
    m.delete_service("default/web")
    assert {p.refusal for p in m.commit().problems_cleared} == {REFUSED_EXTERNAL_IP, REFUSED_NODE_PORT}
    assert m.problems() == []


def test_an_invalid_update_keeps_the_guarded_version_and_its_refusal() -> None:
    m = ProxyModel(NODE, GUARD)
    m.set_service("default/web", service(externalIPs=["10.244.9.9", "203.0.113.1"]))
    m.commit()
    m.set_service("default/web", service(clusterIP="not-an-ip"))
    m.commit()
    assert m.state.services[WEB].external_ips == ("203.0.113.1",)
    assert sorted(p.refusal for p in m.problems()) == ["", REFUSED_EXTERNAL_IP]
