"""Upstream e2e tests (test/e2e/network/service.go, networking.go, conntrack.go) the lab runs, on
the two-node `cluster` in both modes, each named after the upstream test it checks.

The upstream tests create pods and wait for the EndpointSlice controller; here the slices are
written directly with the conditions that controller would give them (for example
`publishNotReadyAddresses` marks every endpoint ready, serving as the pod's readiness). What each
test checks is the same observable outcome: which backends answer, which requests fail and how.
tests/upstream_e2e.md maps every upstream test to the project test that covers it.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lab.core import PODSERVER
from lab.harness import PROBE_SPORT, Cluster, ep
from lab.objects import Obj, Port, endpoint_slice, service, with_endpoints

pytestmark = pytest.mark.kernel

HTTP = Port("http", 80, 8080)
ECHO = Port("udp", 90, 9000, "UDP")
N1, N2 = "192.168.0.11", "192.168.0.12"
SPORT = 12345  # conntrack.go's client: `nc -u -p 12345`, one UDP flow all along


_applied = itertools.count()


def apply(cluster: Cluster, objects: list[Obj]) -> None:
    """`cluster.apply`, with an orphan EndpointSlice (no Service: nothing programmed) whose name
    changes every time. The harness waits for a log line naming the content's hash since the
    agent started, so applying content seen before (ClientIP, None, ClientIP again; or the empty
    set of the start) would return before the agent synced it."""
    marker = endpoint_slice("apply-marker", [], [], suffix=str(next(_applied)))
    cluster.apply([*objects, marker])


# A UDP client's source port below the ephemeral range (32768-60999 by default), for a check that
# a new flow is not answered: an autobound port may repeat one of the test's earlier flows, whose
# conntrack entry still forwards it (CleanStaleEntries keeps a deleted Service's entries).
NEW_FLOW_SPORT = 20700


def names(result: dict[str, Any]) -> set[str]:
    return set(result["bodies"])


def served(cluster: Cluster, target: str, url: str, count: int = 10) -> set[str]:
    result = cluster.http(target, url, count=count)
    assert result["errors"] == 0, (url, result)
    return names(result)


def refused(cluster: Cluster, target: str, url: str) -> None:
    result = cluster.http(target, url, count=2, timeout=2.0)
    assert result["errors"] == 2, (url, result)
    assert all("Connection refused" in k for k in result["error_kinds"]), (url, result)


def not_served(cluster: Cluster, target: str, url: str) -> None:
    # From PROBE_SPORT, as tests/traffic/test_ignored_objects.py's not_served, for its reason.
    result = cluster.http(target, url, count=2, timeout=1.0, sport=PROBE_SPORT)
    assert result["errors"] == 2 and not result["bodies"], (url, result)


def test_updated_after_adding_or_deleting_ports(cluster: Cluster) -> None:
    """ "should be updated after adding or deleting ports": a second port serves once added, and
    stops once deleted while the first keeps serving."""
    one = service("edit-port", "10.96.40.1", [HTTP])
    two = service("edit-port", "10.96.40.1", [HTTP, Port("http2", 81, 8080)])
    apply(cluster, with_endpoints(one, [ep(cluster, "pod-1-2")]))
    assert served(cluster, "pod-2-1", "http://10.96.40.1/") == {"pod-1-2"}
    not_served(cluster, "pod-2-1", "http://10.96.40.1:81/")
    apply(cluster, with_endpoints(two, [ep(cluster, "pod-1-2")]))
    assert served(cluster, "pod-2-1", "http://10.96.40.1:81/") == {"pod-1-2"}
    apply(cluster, with_endpoints(one, [ep(cluster, "pod-1-2")]))
    assert served(cluster, "pod-2-1", "http://10.96.40.1/") == {"pod-1-2"}
    not_served(cluster, "pod-2-1", "http://10.96.40.1:81/")


def test_endpoints_on_same_port_and_different_protocols(cluster: Cluster) -> None:
    """ "should serve endpoints on same port and different protocols" (conformance): TCP and UDP on
    port 80 both forward; with only TCP left UDP stops, with only UDP left TCP stops. Also the
    NodePort variant ("should be able to update service type to NodePort listening on same port
    number but different protocols") and the LoadBalancer one ("...for internal traffic on Type
    LoadBalancer"): both protocols through the NodePort and the cluster IP."""
    tcp, udp = Port("tcp-port", 80, 8080), Port("udp-port", 80, 9000, "UDP")
    backends = [ep(cluster, "pod-2-2")]
    apply(cluster, with_endpoints(service("multiproto", "10.96.40.2", [tcp, udp]), backends))
    assert served(cluster, "pod-1-1", "http://10.96.40.2/") == {"pod-2-2"}
    assert cluster.udp("pod-1-1", "10.96.40.2", 80, count=3)["replies"] == {"pod-2-2": 3}
    apply(cluster, with_endpoints(service("multiproto", "10.96.40.2", [tcp]), backends))
    assert served(cluster, "pod-1-1", "http://10.96.40.2/") == {"pod-2-2"}
    assert cluster.udp("pod-1-1", "10.96.40.2", 80, count=2, sport=NEW_FLOW_SPORT)["lost"] == 2
    apply(cluster, with_endpoints(service("multiproto", "10.96.40.2", [udp]), backends))
    assert cluster.udp("pod-1-1", "10.96.40.2", 80, count=3)["replies"] == {"pod-2-2": 3}
    not_served(cluster, "pod-1-1", "http://10.96.40.2/")

    for type in ("NodePort", "LoadBalancer"):
        ports = [replace(tcp, node_port=30701), replace(udp, node_port=30701)]
        apply(cluster, with_endpoints(service("multiproto", "10.96.40.2", ports, type=type), backends))
        for node_ip in (N1, N2):
            assert served(cluster, "client", f"http://{node_ip}:30701/") == {"pod-2-2"}, type
            assert cluster.udp("client", node_ip, 30701, count=3)["replies"] == {"pod-2-2": 3}, type
        assert served(cluster, "pod-1-1", "http://10.96.40.2/") == {"pod-2-2"}, type
        assert cluster.udp("pod-1-1", "10.96.40.2", 80, count=3)["replies"] == {"pod-2-2": 3}, type


def _start_echo(cluster: Cluster, pod: str, port: int) -> None:
    """A TCP line-echo server in `pod` (besides its podserver), once per lab."""
    key = f"echo-{pod}-{port}"
    started: set[str] = cluster.lab.__dict__.setdefault("_upstream_e2e_started", set())
    if key in started:
        return
    host = cluster.lab.pod(pod)
    proc = cluster.lab.popen(
        host,
        sys.executable,
        "-I",
        "-S",
        str(PODSERVER),
        f"--name={pod}",
        "--http-port=8086",
        "--udp-port=9006",
        f"--tcp-echo-port={port}",
        name=key,
    )
    cluster.lab.wait_tcp(host, host.ip, port, proc=proc)
    started.add(key)


def test_service_deleted_and_recreated_while_a_tcp_stream_runs(
    cluster: Cluster, request: pytest.FixtureRequest
) -> None:
    """ "should work after the service has been recreated", with a TCP connection through the
    Service held open across the deletion and the recreation: kube-proxy leaves established TCP
    conntrack entries alone, so the stream keeps exchanging lines, and new connections are served
    again once the Service is back. eBPF mode's conntrack entries hold the backend and the
    frontend themselves, so the Service's map entries may all go and come back with other ids."""
    from tests.traffic.test_upgrade import finish, start

    _start_echo(cluster, "pod-2-3", 7000)
    svc = service("recreated", "10.96.40.3", [HTTP, Port("echo", 7000, 7000)])
    objects = with_endpoints(svc, [ep(cluster, "pod-2-3")])
    apply(cluster, objects)
    for source in ("pod-1-1", "node1"):  # upstream dials from a host-network pod too
        assert served(cluster, source, "http://10.96.40.3/") == {"pod-2-3"}, source
    held = start(cluster, "pod-1-1", f"held-{cluster.mode}", "hold", "--addr", "10.96.40.3", "--port", "7000")
    held_node = start(
        cluster, "node1", f"held-node-{cluster.mode}", "hold", "--addr", "10.96.40.3", "--port", "7000"
    )
    try:
        time.sleep(1.0)
        apply(cluster, [])  # deleted
        for source in ("pod-1-3", "node1"):
            not_served(cluster, source, "http://10.96.40.3/")
        time.sleep(1.0)
        apply(cluster, objects)  # recreated, same cluster IP
        for source in ("pod-1-3", "node1"):
            assert served(cluster, source, "http://10.96.40.3/") == {"pod-2-3"}, source
        time.sleep(1.0)
    finally:
        result = finish(held)
        node_result = finish(held_node)
    assert result["errors"] == 0 and result["exchanges"] > 40, result
    assert node_result["errors"] == 0 and node_result["exchanges"] > 40, node_result


def affinity_service(name: str, ip: str, type: str = "ClusterIP", **spec: Any) -> Obj:
    ports = [Port("http", 80, 8080, node_port=30702 if type == "NodePort" else 0), ECHO]
    return service(name, ip, ports, type=type, sessionAffinity="ClientIP", **spec)


BACKENDS = ["pod-1-4", "pod-2-4", "pod-2-5"]


def sticky(cluster: Cluster, target: str, url: str) -> bool:
    return len(served(cluster, target, url, count=15)) == 1


@pytest.mark.parametrize("type", ["ClusterIP", "NodePort"])
def test_switch_session_affinity(cluster: Cluster, type: str) -> None:
    """ "should be able to switch session affinity for service with type clusterIP" and "... for
    NodePort service" (conformance), which include "should have session affinity work for ...":
    ClientIP sticks to one backend, None spreads over all three, ClientIP again sticks. The NodePort
    is dialled from a pod, as upstream's exec pod does, and from the external client."""
    eps = [ep(cluster, b) for b in BACKENDS]
    targets = (
        [("pod-1-1", "http://10.96.40.4/")]
        if type == "ClusterIP"
        else [("pod-1-1", f"http://{N1}:30702/"), ("client", f"http://{N1}:30702/")]
    )
    apply(cluster, with_endpoints(affinity_service("affinity", "10.96.40.4", type), eps))
    for target, url in targets:
        assert sticky(cluster, target, url), target
    off = affinity_service("affinity", "10.96.40.4", type)
    off["spec"]["sessionAffinity"] = "None"
    apply(cluster, with_endpoints(off, eps))
    for target, url in targets:
        assert served(cluster, target, url, count=40) == set(BACKENDS), target
    apply(cluster, with_endpoints(affinity_service("affinity", "10.96.40.4", type), eps))
    for target, url in targets:
        assert sticky(cluster, target, url), target


def test_client_ip_session_affinity_udp(cluster: Cluster) -> None:
    """ "should function for client IP based session affinity: udp": every new UDP flow from one
    client reaches the same backend."""
    apply(
        cluster,
        with_endpoints(affinity_service("affinity-udp", "10.96.40.5"), [ep(cluster, b) for b in BACKENDS]),
    )
    replies = cluster.udp("pod-1-2", "10.96.40.5", 90, count=20)
    assert replies["lost"] == 0 and len(replies["replies"]) == 1, replies


@pytest.mark.parametrize("type", ["ClusterIP", "NodePort"])
def test_session_affinity_timeout(cluster: Cluster, type: str) -> None:
    """ "should have session affinity timeout work for service with type clusterIP" and "... for
    NodePort service": sticky within the timeout, and another backend once it has passed."""
    eps = [ep(cluster, b) for b in BACKENDS]
    svc = affinity_service(
        "affinity-timeout", "10.96.40.6", type, sessionAffinityConfig={"clientIP": {"timeoutSeconds": 2}}
    )
    target, url = (  # from a pod, as upstream's exec pod
        ("pod-1-1", "http://10.96.40.6/") if type == "ClusterIP" else ("pod-1-1", f"http://{N2}:30702/")
    )
    apply(cluster, with_endpoints(svc, eps))
    assert sticky(cluster, target, url)
    seen = served(cluster, target, url, count=1)
    for _ in range(8):
        time.sleep(2.5)
        seen |= served(cluster, target, url, count=1)
        if len(seen) > 1:
            return
    pytest.fail(f"still sticky after the timeout: {seen}")


def test_publish_not_ready_addresses(cluster: Cluster) -> None:
    """ "should be able to connect to terminating and unready endpoints if PublishNotReadyAddresses
    is true" (and "should create endpoints for unready pods"): the controller publishes the
    terminating, unready pod as ready, so the cluster IP and both NodePorts reach it; "should not be
    able to connect to terminating and unready endpoints if PublishNotReadyAddresses is false": not
    ready, not serving, so the Service has no endpoint and rejects."""
    svc = service("tolerate-unready", "10.96.40.7", [replace(HTTP, node_port=30703)], type="NodePort")
    pod = ep(cluster, "pod-1-5")
    apply(cluster, with_endpoints(svc, [replace(pod, ready=True, serving=False, terminating=True)]))
    for target, url in (
        ("pod-2-1", "http://10.96.40.7/"),
        ("pod-2-1", f"http://{N1}:30703/"),
        ("pod-2-1", f"http://{N2}:30703/"),
    ):
        assert served(cluster, target, url, count=3) == {"pod-1-5"}, url
    apply(cluster, with_endpoints(svc, [replace(pod, ready=False, serving=False, terminating=True)]))
    refused(cluster, "pod-2-1", "http://10.96.40.7/")
    for node_ip in (N1, N2):
        refused(cluster, "pod-2-1", f"http://{node_ip}:30703/")


def udp_from(cluster: Cluster, target: str, addr: str, port: int, count: int = 3) -> dict[str, Any]:
    return cluster.client(
        target,
        "udp",
        "--addr",
        addr,
        "--port",
        str(port),
        "--count",
        str(count),
        "--sport",
        str(SPORT),
        "--timeout",
        "1",
    )


@pytest.mark.parametrize("via", ["NodePort", "ClusterIP", "ClusterIP from the node"])
def test_udp_traffic_preserved_when_server_pod_cycles(cluster: Cluster, via: str) -> None:
    """ "should be able to preserve UDP traffic when server pod cycles for a NodePort service",
    "... for a ClusterIP service" and "... for a ClusterIP service and client is hostNetwork"
    (conntrack.go): one UDP flow (fixed source port) from a pod on node1 (upstream's client pod),
    or from node1 itself, reaches backend 1 on node2; backend 2 replaces it; the same flow reaches
    backend 2 within a few datagrams."""
    svc = service("svc-udp", "10.96.40.8", [replace(ECHO, node_port=30704)], type="NodePort")
    addr, port = (N2, 30704) if via == "NodePort" else ("10.96.40.8", 90)
    # "... for a ClusterIP service and client is hostNetwork": the same from node1's own network
    target = "node1" if via == "ClusterIP from the node" else "pod-1-1"
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-2-5")]))
    assert udp_from(cluster, target, addr, port)["replies"] == {"pod-2-5": 3}
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-2-6")]))
    replies = udp_from(cluster, target, addr, port, count=5)["replies"]
    assert replies.get("pod-2-6", 0) >= 4 and "pod-2-5" not in replies, replies


def test_udp_traffic_preserved_when_server_pod_cycles_with_itp_local(cluster: Cluster) -> None:
    """ "should be able to preserve UDP traffic when server pod cycles for a ClusterIP service with
    InternalTrafficPolicy set to Local": the flow from node1 keeps reaching node1's backend while a
    second endpoint on node2 comes and the first is replaced by another on node1."""
    svc = service("svc-udp-local", "10.96.40.9", [ECHO], internalTrafficPolicy="Local")
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-1-5")]))
    assert udp_from(cluster, "pod-1-1", "10.96.40.9", 90)["replies"] == {"pod-1-5": 3}
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-1-5"), ep(cluster, "pod-2-5")]))
    assert udp_from(cluster, "pod-1-1", "10.96.40.9", 90)["replies"] == {"pod-1-5": 3}
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-1-6"), ep(cluster, "pod-2-5")]))
    replies = udp_from(cluster, "pod-1-1", "10.96.40.9", 90, count=5)["replies"]
    assert replies.get("pod-1-6", 0) >= 4 and set(replies) <= {"pod-1-6"}, replies


def test_udp_traffic_preserved_when_initial_unready_endpoints_get_ready(cluster: Cluster) -> None:
    """ "should be able to preserve UDP traffic when initial unready endpoints get ready"
    (conntrack.go, issue 105657): a UDP flow to a Service without endpoints, then an unready
    endpoint, then ready: the same flow is answered at once, no stale entry blackholes it."""
    svc = service("svc-udp-unready", "10.96.40.10", [ECHO])
    apply(cluster, with_endpoints(svc, []))
    assert udp_from(cluster, "pod-1-1", "10.96.40.10", 90, count=2)["lost"] == 2
    apply(cluster, with_endpoints(svc, [replace(ep(cluster, "pod-2-6"), ready=False)]))
    assert udp_from(cluster, "pod-1-1", "10.96.40.10", 90, count=2)["lost"] == 2
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-2-6")]))
    replies = udp_from(cluster, "pod-1-1", "10.96.40.10", 90, count=5)["replies"]
    assert replies == {"pod-2-6": 5}, replies


def test_multiple_services_with_the_same_endpoints_and_up_and_down(cluster: Cluster) -> None:
    """ "should function for multiple endpoint-Services with same selector" and "should be able to
    up and down services": deleting one of two Services over the same pods leaves the other (and
    its NodePort) serving; a third one added later serves too. Dialled from an endpoint pod, as
    upstream's endpoint-Service tests dial, from another pod and the node (its up-and-down test
    dials from an exec pod and a host-network pod) and from the external client."""
    eps = [ep(cluster, "pod-1-3"), ep(cluster, "pod-2-3")]
    first = service("same-a", "10.96.40.11", [replace(HTTP, node_port=30705)], type="NodePort")
    second = service("same-b", "10.96.40.12", [replace(HTTP, node_port=30706)], type="NodePort")
    third = service("same-c", "10.96.40.13", [HTTP])
    both = {"pod-1-3", "pod-2-3"}
    apply(cluster, [*with_endpoints(first, eps), *with_endpoints(second, eps)])
    for url in ("http://10.96.40.11/", "http://10.96.40.12/", f"http://{N1}:30705/"):
        # upstream's up-and-down test dials from an exec pod and from the host too
        for source in ("pod-1-3", "pod-1-1", "node1"):
            assert served(cluster, source, url, count=30) == both, (source, url)
    assert served(cluster, "client", f"http://{N1}:30705/", count=30) == both
    apply(cluster, with_endpoints(second, eps))
    for source in ("pod-1-3", "pod-1-1", "node1"):
        not_served(cluster, source, "http://10.96.40.11/")
    not_served(cluster, "client", f"http://{N1}:30705/")
    for source in ("pod-1-3", "node1"):
        assert served(cluster, source, "http://10.96.40.12/", count=30) == both, source
    assert served(cluster, "client", f"http://{N1}:30706/", count=30) == both
    apply(cluster, [*with_endpoints(second, eps), *with_endpoints(third, eps)])
    for source in ("pod-1-3", "node1"):
        assert served(cluster, source, "http://10.96.40.13/", count=30) == both, source
        assert served(cluster, source, "http://10.96.40.12/", count=30) == both, source


@pytest.mark.parametrize("proto", ["http", "udp"])
def test_update_node_port_closes_with_its_service(cluster: Cluster, proto: str) -> None:
    """ "should update nodePort: http" and "should update nodePort: udp" (and "should support basic
    nodePort: udp functionality"): the NodePort answers on both nodes from every backend, and
    nothing answers once the Service is deleted; from the node (upstream dials from a host-network
    pod), a pod and the external client."""
    port = replace(HTTP if proto == "http" else ECHO, node_port=30707)
    svc = service("np-update", "10.96.40.14", [port], type="NodePort")
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-1-6"), ep(cluster, "pod-2-6")]))
    sources = [(source, node_ip) for source in ("client", "pod-1-1", "node1") for node_ip in (N1, N2)]
    for source, node_ip in sources:  # upstream dials from a host-network pod
        if proto == "http":
            assert served(cluster, source, f"http://{node_ip}:30707/", count=30) == {"pod-1-6", "pod-2-6"}
        else:
            assert set(cluster.udp(source, node_ip, 30707, count=30)["replies"]) == {"pod-1-6", "pod-2-6"}
    apply(cluster, [])

    def closed(source: str, node_ip: str) -> None:
        if proto == "http":
            not_served(cluster, source, f"http://{node_ip}:30707/")
        else:
            # A new flow from a source port below the ephemeral range (NEW_FLOW_SPORT), one per
            # check as two run from node1 at once: an autobound port may be one an earlier datagram
            # of this test used, whose conntrack entry, DNATed to a backend, lives 30 s after the
            # Service went (kube-proxy's CleanStaleEntries clears only Services that remain).
            sport = NEW_FLOW_SPORT + sources.index((source, node_ip))
            assert cluster.udp(source, node_ip, 30707, count=2, sport=sport)["lost"] == 2, (source, node_ip)

    # Each check waits out its timeouts (2 x 2 s for UDP): the six run at once, each in its own
    # client process, so the test waits for one of them, not six in a row.
    with ThreadPoolExecutor(len(sources)) as pool:
        for done in [pool.submit(closed, source, node_ip) for source, node_ip in sources]:
            done.result()


def test_multiport_endpoints_from_pods(cluster: Cluster) -> None:
    """ "should serve multiport endpoints from pods" (conformance): two Service ports, each with its
    own pod on its own target port; each port reaches its pod, and the ports follow the endpoints."""
    _start_echo(cluster, "pod-2-3", 7000)  # also serves HTTP on 8086
    p1, p2 = Port("portname1", 80, 8080), Port("portname2", 81, 8086)
    svc = service("multi-endpoint", "10.96.40.15", [p1, p2])
    one = endpoint_slice("multi-endpoint", [p1], [ep(cluster, "pod-1-2")], suffix="a")
    two = endpoint_slice("multi-endpoint", [p2], [ep(cluster, "pod-2-3")], suffix="b")
    apply(cluster, [svc, one, two])
    assert served(cluster, "pod-1-1", "http://10.96.40.15:80/") == {"pod-1-2"}
    assert served(cluster, "pod-1-1", "http://10.96.40.15:81/") == {"pod-2-3"}
    apply(cluster, [svc, two])
    refused(cluster, "pod-1-1", "http://10.96.40.15:80/")
    assert served(cluster, "pod-1-1", "http://10.96.40.15:81/") == {"pod-2-3"}


def test_source_pod_ip_preserved_through_cluster_ip(cluster: Cluster) -> None:
    """ "should preserve source pod IP for traffic thru service cluster IP": from a pod on the
    backend's node and from one on the other node, the backend sees the client pod's address."""
    apply(cluster, with_endpoints(service("sourceip", "10.96.40.16", [HTTP]), [ep(cluster, "pod-1-2")]))
    for client in ("pod-1-1", "pod-2-1"):
        assert served(cluster, client, "http://10.96.40.16/ip", count=3) == {cluster.lab.pod(client).ip}


def test_endpoint_pods_reach_their_own_service(cluster: Cluster) -> None:
    """ "should function for endpoint-Service: http" and "...: udp": a backend pod dialing its own
    Service's cluster IP and NodePort reaches every backend, itself included."""
    ports = [replace(HTTP, node_port=30708), replace(ECHO, node_port=30709)]
    backends = {"pod-1-3", "pod-2-3"}
    apply(
        cluster,
        with_endpoints(
            service("ep-svc", "10.96.40.17", ports, type="NodePort"), [ep(cluster, b) for b in backends]
        ),
    )
    for url in ("http://10.96.40.17/", f"http://{N1}:30708/", f"http://{N2}:30708/"):
        assert served(cluster, "pod-1-3", url, count=30) == backends, url
    for addr, port in (("10.96.40.17", 90), (N1, 30709), (N2, 30709)):
        replies = cluster.udp("pod-1-3", addr, port, count=30)
        assert replies["lost"] == 0 and set(replies["replies"]) == backends, (addr, replies)


def test_internal_traffic_policy_local_pod_to_pod(cluster: Cluster) -> None:
    """ "should respect internalTrafficPolicy=Local Pod to Pod": a pod on the backend's node
    reaches it through the cluster IP; a pod on the other node gets no answer (kube-proxy drops:
    "has no local endpoints")."""
    svc = service("svc-itp", "10.96.40.18", [HTTP], internalTrafficPolicy="Local")
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-1-4")]))
    for _ in range(5):
        assert served(cluster, "pod-1-1", "http://10.96.40.18/", count=1) == {"pod-1-4"}
    not_served(cluster, "pod-2-1", "http://10.96.40.18/")


LB_IP = "198.51.103.20"


def lb_service(name: str, ip: str, node_port: int, **spec: Any) -> Obj:
    ports = [Port("http", 80, 8080, node_port=node_port), Port("udp", 90, 9000, "UDP", node_port=node_port)]
    status = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    return service(name, ip, ports, type="LoadBalancer", status=status, **spec)


@pytest.mark.parametrize("etp", ["Local", "Cluster"])
def test_session_affinity_on_a_load_balancer_ip(cluster: Cluster, etp: str) -> None:
    """ "should have session affinity work for LoadBalancer service with ESIPP on" / "... off" and
    "should be able to switch session affinity for LoadBalancer service with ESIPP on" / "... off":
    through the ingress IP (routed to node1, as a cloud balancer would), ClientIP sticks, None
    spreads, ClientIP sticks again. With ESIPP on the backends are node1's, the only ones it uses."""
    cluster.lab.add_client_route("198.51.103.0/24", via_node=1)
    backends = ["pod-1-4", "pod-1-5", "pod-1-6"]
    eps = [ep(cluster, b) for b in backends]
    url = f"http://{LB_IP}/"

    def svc(affinity: str) -> Obj:
        return lb_service(
            "affinity-lb", "10.96.40.19", 30710, externalTrafficPolicy=etp, sessionAffinity=affinity
        )

    apply(cluster, with_endpoints(svc("ClientIP"), eps))
    assert sticky(cluster, "client", url)
    apply(cluster, with_endpoints(svc("None"), eps))
    assert served(cluster, "client", url, count=40) == set(backends)
    apply(cluster, with_endpoints(svc("ClientIP"), eps))
    assert sticky(cluster, "client", url)


def test_esipp_through_a_load_balancer_ip_from_outside_and_from_pods(cluster: Cluster) -> None:
    """ESIPP "should work for type=LoadBalancer" and "should work from pods": with
    externalTrafficPolicy Local the backend sees the external client's address through the ingress
    IP, and a pod's own address when the pod dials the ingress IP."""
    cluster.lab.add_client_route("198.51.103.0/24", via_node=1)
    apply(
        cluster,
        with_endpoints(
            lb_service("esipp", "10.96.40.20", 30711, externalTrafficPolicy="Local"), [ep(cluster, "pod-1-4")]
        ),
    )
    assert served(cluster, "client", f"http://{LB_IP}/ip", count=3) == {cluster.lab.client.ip}
    assert served(cluster, "pod-2-1", f"http://{LB_IP}/ip", count=3) == {cluster.lab.pod("pod-2-1").ip}


def test_load_balancer_without_node_port_then_with(cluster: Cluster) -> None:
    """ "should be able to create LoadBalancer Service without NodePort and change it": the ingress
    IP serves with no NodePort allocated (allocateLoadBalancerNodePorts false), and once a NodePort
    is added both serve."""
    cluster.lab.add_client_route("198.51.103.0/24", via_node=1)
    eps = [ep(cluster, "pod-2-4")]
    apply(
        cluster,
        with_endpoints(lb_service("no-np", "10.96.40.21", 0, allocateLoadBalancerNodePorts=False), eps),
    )
    assert served(cluster, "client", f"http://{LB_IP}/") == {"pod-2-4"}
    apply(cluster, with_endpoints(lb_service("no-np", "10.96.40.21", 30712), eps))
    assert served(cluster, "client", f"http://{LB_IP}/") == {"pod-2-4"}
    assert served(cluster, "client", f"http://{N2}:30712/") == {"pod-2-4"}


@pytest.mark.parametrize("nodes", ["different", "same"])
def test_udp_traffic_preserved_when_server_pod_cycles_for_a_load_balancer(
    cluster: Cluster, nodes: str
) -> None:
    """ "should be able to preserve UDP traffic when server pod cycles for a LoadBalancer service on
    different nodes" / "... on the same nodes": one UDP flow through the ingress IP follows the
    backend replacement."""
    cluster.lab.add_client_route("198.51.103.0/24", via_node=1)
    first, second = ("pod-1-5", "pod-2-5") if nodes == "different" else ("pod-1-5", "pod-1-6")
    svc = lb_service("svc-udp-lb", "10.96.40.22", 30713)
    apply(cluster, with_endpoints(svc, [ep(cluster, first)]))
    assert udp_from(cluster, "client", LB_IP, 90)["replies"] == {first: 3}
    apply(cluster, with_endpoints(svc, [ep(cluster, second)]))
    replies = udp_from(cluster, "client", LB_IP, 90, count=5)["replies"]
    assert replies.get(second, 0) >= 4 and first not in replies, replies


BOOM = Path(__file__).with_name("boom.py")


@pytest.mark.parametrize("backend", ["pod-2-4", "pod-1-4"], ids=["other-node", "same-node"])
def test_invalid_conntrack_segments_never_reset_a_service_connection(cluster: Cluster, backend: str) -> None:
    """ "should drop INVALID conntrack entries [Privileged]" (issue 74839): a backend that sends
    out-of-window segments on a connection made through a cluster IP must never make the client
    reset it. The server (tests/traffic/boom.py) injects two bogus segments after every echoed line
    and counts the RSTs it sniffs; the held connection keeps exchanging lines."""
    from tests.traffic.test_upgrade import finish, start

    assert cluster.lab.tmpdir is not None
    tag = f"boom-{backend}-{cluster.mode}"
    out, stop = cluster.lab.tmpdir / f"{tag}.json", cluster.lab.tmpdir / f"stop-{tag}"
    host = cluster.lab.pod(backend)
    proc = cluster.lab.popen(
        host, sys.executable, str(BOOM), "--port=9100", f"--out={out}", f"--stop-file={stop}", name=tag
    )
    try:
        cluster.lab.wait_tcp(host, host.ip, 9100, proc=proc)
        svc = service("boom-server", "10.96.40.23", [Port("boom", 9000, 9100)])
        apply(cluster, with_endpoints(svc, [ep(cluster, backend)]))
        held = start(cluster, "pod-1-1", f"held-{tag}", "hold", "--addr", "10.96.40.23", "--port", "9000")
        time.sleep(3.0)
        result = finish(held)
    finally:
        stop.touch()
        proc.wait(timeout=10)
    counts = json.loads(out.read_text())
    assert counts["injected"] >= 40, counts
    assert counts["resets"] == 0, f"the client reset the connection: {counts}"
    assert result["errors"] == 0 and result["exchanges"] >= 20, result


@pytest.mark.parametrize("etp", ["Cluster", "Local"])
def test_no_connectivity_disruption_during_a_rolling_update(cluster: Cluster, etp: str) -> None:
    """ "should not have connectivity disruption during rolling update with externalTrafficPolicy=
    Cluster" / "...=Local": a client hammers the ingress IP (one connection per request) while each
    node's backend is replaced as a DaemonSet rolls (the new pod ready, the old one terminating,
    then gone). Upstream accepts 95 %; kube-proxy's rules lose nothing, and neither may we."""
    from lab.harness import Loop

    cluster.lab.add_client_route("198.51.103.0/24", via_node=1)
    svc = lb_service("rolling", "10.96.40.24", 30714, externalTrafficPolicy=etp)

    def pod(name: str, terminating: bool = False) -> Any:
        e = ep(cluster, name)
        return replace(e, ready=False, serving=True, terminating=True) if terminating else e

    steps = [
        [pod("pod-1-2"), pod("pod-2-2")],
        [pod("pod-1-2", True), pod("pod-1-3"), pod("pod-2-2")],
        [pod("pod-1-3"), pod("pod-2-2")],
        [pod("pod-1-3"), pod("pod-2-2", True), pod("pod-2-3")],
        [pod("pod-1-3"), pod("pod-2-3")],
    ]
    apply(cluster, with_endpoints(svc, steps[0]))
    loop = Loop(cluster.lab, "client", f"http://{LB_IP}/", f"rolling-{etp}-{cluster.mode}")
    try:
        for step in steps[1:]:
            time.sleep(0.7)
            apply(cluster, with_endpoints(svc, step))
        time.sleep(0.7)
    finally:
        result = loop.finish()
    assert result["errors"] == 0 and result["ok"] > 100, result
    expected = {"pod-1-2", "pod-1-3"} if etp == "Local" else {"pod-1-2", "pod-1-3", "pod-2-2", "pod-2-3"}
    assert set(result["bodies"]) == expected, result["bodies"]
