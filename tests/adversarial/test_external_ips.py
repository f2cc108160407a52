"""externalIPs, load-balancer IPs and node ports that would hijack traffic are refused (issue 21
item 5, the CVE-2020-8554 class), both modes, through a fake API server and real traffic.

Anyone who may create a Service may set its externalIPs: upstream kube-proxy then captures that
address's traffic on every node. The red team pointed a Service's externalIPs at another pod
(its port 8080), at the node's own address (port 10256, the health port cloud load balancers
probe) and at an outside address, and gave a NodePort Service `nodePort: 10256`, which a real API
server never allocates: each captured the traffic. Here the agents run with
`--cluster-cidr=10.244.0.0/16` (the lab harness's), `--service-cluster-ip-range=10.96.0.0/12` and
`--external-ip-cidrs=203.0.113.0/24`: each hijacking frontend is refused with a Warning Event on
the Service and a count in `ekp_refused_frontends_total`, the traffic it aimed at reaches its
real destination, and the Service's other frontends (its cluster IP, an allowed externalIP, its
other ports) keep working.

On main (no guard) every case is captured: the pod's port answers with the attacker's backend,
node:10256 answers with the attacker's page instead of /healthz, the outside address is served
by the attacker's backend, and no Event is written.

One single-node lab per mode: pod-1-1 is the client, pod-1-2 the attacker's backend, pod-1-3
the victim pod.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from lab import Lab
from lab.apicluster import ApiCluster
from lab.harness import ep, started
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel
from tests.traffic.test_api import scrape

pytestmark = pytest.mark.kernel

NODE_IP = "192.168.0.11"
ALLOWED = "203.0.113.5"
OUTSIDE = "198.51.100.7"
GUARD_FLAGS = ("--service-cluster-ip-range=10.96.0.0/12", "--external-ip-cidrs=203.0.113.0/24")


@pytest.fixture(scope="module", params=["ebpf", "iptables"])
def api(request: pytest.FixtureRequest) -> Iterator[ApiCluster]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=3) as lab:
        lab.start_podservers()
        cluster = ApiCluster(lab, request.param, extra=GUARD_FLAGS)
        with started(cluster):
            yield cluster


def events_about(api: ApiCluster, name: str, reason: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The Events of `reason` about Service `name`, waited for (the recorder writes them from its
    own thread)."""
    deadline = time.monotonic() + timeout
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        found = [
            e
            for e in api.server.events()
            if e.get("regarding", {}).get("name") == name and e.get("reason") == reason
        ]
        if found:
            return found
        time.sleep(0.2)
    return found


def body(api: ApiCluster, url: str) -> str:
    """What `url` answers from pod-1-1 ("" when nothing answered)."""
    result = api.http("pod-1-1", url, count=1, timeout=2.0)
    return "".join(result["bodies"]) if result["errors"] == 0 else ""


def test_external_ips_on_a_pod_the_node_and_an_outside_address_are_refused(api: ApiCluster) -> None:
    """spec.externalIPs at another pod (8080), at the node (10256) and outside the allow-list: none
    captures anything; the allowed externalIP and the cluster IP of the same Service are served."""
    victim = api.lab.pod("pod-1-3")
    hijack = service(
        "hijack",
        "10.96.3.1",
        [Port("web", 8080, 8080), Port("health", 10256, 8080), Port("http", 80, 8080)],
        externalIPs=[victim.ip, NODE_IP, OUTSIDE, ALLOWED],
    )
    api.apply(with_endpoints(hijack, [ep(api, "pod-1-2")]))

    assert body(api, f"http://{victim.ip}:8080/") == "pod-1-3", "the pod's own server answers"
    health = body(api, f"http://{NODE_IP}:10256/healthz")
    assert '"lastUpdated"' in health, f"the node's /healthz answers, not the attacker's pod: {health!r}"
    assert body(api, f"http://{OUTSIDE}/") == "", "an address outside --external-ip-cidrs is not served"
    # The Service's other frontends work: its cluster IP and the externalIP the allow-list admits.
    assert body(api, "http://10.96.3.1/") == "pod-1-2"
    assert body(api, f"http://{ALLOWED}/") == "pod-1-2"

    (event, *_) = events_about(api, "hijack", "RefusedExternalIP")
    assert event["type"] == "Warning" and event["action"] == "RefuseFrontend"
    for address, why in (
        (victim.ip, "inside --cluster-cidr 10.244.0.0/16"),
        (NODE_IP, "an address of this node"),
        (OUTSIDE, "outside --external-ip-cidrs 203.0.113.0/24"),
    ):
        assert f"spec.externalIPs {address} refused: {why}" in event["note"], event["note"]
    assert ALLOWED not in event["note"]
    stored = api.server.get("Service", "default", "hijack")
    assert stored is not None and event["regarding"]["uid"] == stored["metadata"]["uid"]
    refused = dict((labels["reason"], v) for labels, v in scrape(api, "node1", "ekp_refused_frontends_total"))
    assert refused.get("RefusedExternalIP", 0) >= 1, refused


def test_a_load_balancer_ingress_ip_on_a_pod_is_refused(api: ApiCluster) -> None:
    """status.loadBalancer.ingress is written by whoever may update a Service's status: an ingress
    IP on another pod is refused like an externalIP; the allowed one is served."""
    victim = api.lab.pod("pod-1-3")
    lb = service(
        "lb-hijack",
        "10.96.3.2",
        [Port("web", 8080, 8080, node_port=30808)],
        type="LoadBalancer",
        status={"loadBalancer": {"ingress": [{"ip": victim.ip}, {"ip": "203.0.113.6"}]}},
    )
    api.apply(with_endpoints(lb, [ep(api, "pod-1-2")]))
    assert body(api, f"http://{victim.ip}:8080/") == "pod-1-3"
    assert body(api, "http://203.0.113.6:8080/") == "pod-1-2"
    (event, *_) = events_about(api, "lb-hijack", "RefusedExternalIP")
    assert f"status.loadBalancer.ingress IP {victim.ip} refused: inside --cluster-cidr" in event["note"]


def test_a_node_port_outside_the_range_is_refused(api: ApiCluster) -> None:
    """nodePort 10256 (outside --node-port-range 30000-32767): the node's /healthz keeps its port,
    from a pod and from outside the cluster; the Service's cluster IP and its other port's
    NodePort are served."""
    svc = service(
        "np-hijack",
        "10.96.3.3",
        [Port("health", 81, 8080, node_port=10256), Port("web", 82, 8080, node_port=30082)],
        type="NodePort",
    )
    api.apply(with_endpoints(svc, [ep(api, "pod-1-2")]))
    for target in ("pod-1-1", "client"):
        result = api.http(target, f"http://{NODE_IP}:10256/healthz", count=1, timeout=2.0)
        assert result["errors"] == 0 and '"lastUpdated"' in "".join(result["bodies"]), (target, result)
    assert body(api, "http://10.96.3.3:81/") == "pod-1-2"
    outside = api.http("client", f"http://{NODE_IP}:30082/", count=1, timeout=2.0)
    assert list(outside["bodies"]) == ["pod-1-2"], outside
    (event, *_) = events_about(api, "np-hijack", "RefusedNodePort")
    assert "nodePort 10256 refused: outside --node-port-range 30000-32767" in event["note"]
    refused = dict((labels["reason"], v) for labels, v in scrape(api, "node1", "ekp_refused_frontends_total"))
    assert refused.get("RefusedNodePort", 0) >= 1, refused
