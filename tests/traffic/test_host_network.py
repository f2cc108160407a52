"""Backends on the nodes' own addresses (host-network endpoints), both modes: the `kubernetes`
Service of a control-plane node (its endpoint is the API server on the node's address, port 6443)
and upstream's "should function for service endpoints using hostNetwork" (a host-network server on
every node behind a ClusterIP and NodePorts, http and udp, large requests too), from pods on both
nodes, from the external client and from node1 itself (upstream's node-Service(hostNetwork) dials),
with the source each backend sees checked.

Servers listen in the lab nodes' own namespaces (lab/podserver.py, answering with the node's name
and `/ip` with the source it sees). kube-proxy DNATs in PREROUTING: a flow to this node's address
is delivered locally and never meets POSTROUTING's masquerade, so the backend sees the client's own
address even through a NodePort; a flow to the other node's address leaves the node and is
masqueraded when the frontend says so. eBPF mode hands such flows to the node's stack the same way
(bpf/ekp_tc_apply.h) and translates the stack's replies at tc egress (ekp_egress).

From node1 itself (a process in its namespace and its own cgroup) kube-proxy's OUTPUT chain
translates; eBPF mode's socket programs (bpf/ekp_sock.h) send the connect()/sendmsg() straight to
the backend, node1's own address or node2's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from lab.harness import CLIENT, Agent, Cluster
from lab.objects import Ep, Port, service, with_endpoints
from tests.traffic.test_pods_at_connect import restart

pytestmark = pytest.mark.kernel

N1, N2 = "192.168.0.11", "192.168.0.12"
API, HTTP, ECHO = 6443, 18443, 19443  # the servers' ports in the nodes' namespaces
KUBERNETES = "10.96.0.1"
HOSTNET = "10.96.7.10"
HTTP_NP, UDP_NP = 30790, 30791
REUSED_VIP, REUSED_NP = "10.96.7.11", 30792


@pytest.fixture(scope="module")
def host_servers(cluster: Cluster) -> Iterator[None]:
    """A host-network server on each node: HTTP on API and HTTP, UDP echo on ECHO."""
    lab = cluster.lab
    procs = [lab.start_podserver(lab.node(n), http_ports=(API, HTTP), udp_ports=(ECHO,)) for n in (1, 2)]
    try:
        yield
    finally:
        for proc in procs:
            lab.stop(proc)


def bodies(cluster: Cluster, source: str, url: str, count: int) -> dict[str, int]:
    result = cluster.http(source, url, count=count)
    assert result["errors"] == 0, (source, url, result)
    got: dict[str, int] = result["bodies"]
    return got


def source_ip(cluster: Cluster, source: str) -> str:
    lab = cluster.lab
    return lab.client.ip if source == "client" else lab.pod(source).ip


@pytest.mark.parametrize("source", ["pod-1-1", "pod-2-1"])
def test_kubernetes_service_reaches_the_api_server_on_the_control_plane_nodes_address(
    cluster: Cluster, host_servers: None, source: str
) -> None:
    """`kubernetes` (443 -> 6443) on a one control-plane cluster: node1's API server, from a pod on
    node1 (delivered to node1's own stack) and from a pod on node2 (routed to node1), each seen
    with its own address."""
    port = Port("https", 443, API)
    cluster.apply(with_endpoints(service("kubernetes", KUBERNETES, [port]), [Ep(N1, "node1")]))
    assert bodies(cluster, source, f"http://{KUBERNETES}:443/", 10) == {"node1": 10}
    assert bodies(cluster, source, f"http://{KUBERNETES}:443/ip", 5) == {source_ip(cluster, source): 5}


def host_network_service(cluster: Cluster) -> None:
    ports = [
        Port("http", 80, HTTP, node_port=HTTP_NP),
        Port("udp", 90, ECHO, "UDP", node_port=UDP_NP),
    ]
    svc = service("hostnet", HOSTNET, ports, type="NodePort")
    cluster.apply(with_endpoints(svc, [Ep(N1, "node1"), Ep(N2, "node2")]))


@pytest.mark.parametrize("source", ["pod-1-1", "pod-2-1", "client", "node1"])
def test_service_endpoints_using_host_network(cluster: Cluster, host_servers: None, source: str) -> None:
    """ "should function for service endpoints using hostNetwork": both nodes' servers answer
    through the cluster IP (from pods and the node) and both NodePorts, http and udp, and a
    2,000-byte datagram (fragmented on its way) and request come back whole. Every UDP answer comes
    from the frontend asked, also when an ephemeral port drawn for the cluster IP was used for a
    NodePort within the last 30 s (test_a_udp_client_port_reused_on_another_frontend_of_a_host_
    network_backend pins that case down)."""
    host_network_service(cluster)
    urls: list[str] = [f"http://{N1}:{HTTP_NP}/", f"http://{N2}:{HTTP_NP}/"]
    udp: list[tuple[str, int]] = [(N1, UDP_NP), (N2, UDP_NP)]
    if source != "client":
        urls.append(f"http://{HOSTNET}/")
        udp.append((HOSTNET, 90))
    for url in urls:
        assert set(bodies(cluster, source, url, 30)) == {"node1", "node2"}, url
    for addr, port in udp:
        for size in (0, 2000):
            replies: dict[str, Any] = cluster.udp(source, addr, port, count=30, size=size, sources=True)
            assert replies["lost"] == 0 and set(replies["replies"]) == {"node1", "node2"}, (
                addr,
                size,
                replies,
            )
            assert replies["sources"] == {f"{addr}:{port}": 30}, (addr, size, replies)


# (client pod, node of the one host-network endpoint): the pod's own node, where one conntrack
# holds both flows, and the other node, whose NodePort flow the datagrams of the ClusterIP, translated
# on the pod's node, meet on the endpoint's node (eBPF mode: ekp_ct_reclaim, bpf/ekp_ct.h).
REUSE_CASES = [("pod-1-1", 1), ("pod-2-1", 2), ("pod-2-1", 1), ("pod-1-1", 2)]


def reuse_port_twice(cluster: Cluster, source: str, node: int, sport: int) -> None:
    """`source` from port `sport`: the NodePort of `node`, the cluster IP, and both again (the older
    flow still live), three datagrams each; every answer from the address and port asked."""
    node_ip = N1 if node == 1 else N2
    ports = [Port("udp", 90, ECHO, "UDP", node_port=REUSED_NP)]
    svc = service("hostnet-reused-port", REUSED_VIP, ports, type="NodePort")
    cluster.apply(with_endpoints(svc, [Ep(node_ip, f"node{node}")]))
    frontends = [(node_ip, REUSED_NP), (REUSED_VIP, 90)] * 2
    got = [cluster.udp(source, a, p, count=3, sport=sport, sources=True) for a, p in frontends]
    want = [{"replies": {f"node{node}": 3}, "lost": 0, "sources": {f"{a}:{p}": 3}} for a, p in frontends]
    assert got == want


@pytest.mark.parametrize(("source", "node"), REUSE_CASES, ids=[f"{s}-to-node{n}" for s, n in REUSE_CASES])
def test_a_udp_client_port_reused_on_another_frontend_of_a_host_network_backend(
    cluster: Cluster, host_servers: None, source: str, node: int
) -> None:
    """One client port (a resolver's fixed port, or an ephemeral port drawn again) to a NodePort
    and then the cluster IP of a Service whose one endpoint is a host-network server: both flows
    DNAT to the same backend address and port, so their conntrack reply tuples would be equal, and
    the proxy moves the second flow's source port (nf_nat's unique tuple; eBPF mode's conntrack
    does the same, bpf/ekp_ct.h). With the server on the pod's own node one node translates both;
    with the server on the other node the cluster IP is translated on the pod's node and the
    NodePort on the server's, where the cluster IP's datagrams arrive addressed to the server
    itself and meet the NodePort flow's reply tuple (eBPF mode moves their port as it moves a TCP
    SYN's, ekp_ct_reclaim; before, their answers came back from the NodePort). The answer reaches
    the client's port, from the frontend asked, only because the server answers from the address
    the request was sent to (the node's), which conntrack matches to the flow: seen as one datagram
    lost in 30 in test_service_endpoints_using_host_network when the ephemeral port repeated, the
    server answering from the pod gateway to the moved port."""
    reuse_port_twice(cluster, source, node, 40_000 + 10 * int(source[4]) + node)


@pytest.fixture
def node2_pods_at_connect(cluster: Cluster) -> Iterator[Agent]:
    """node2's agent restarted with the agent's own default for pods' sockets (balanced at
    connect(); the lab pins the per-packet path), and restarted as the lab pins it after the test."""
    agent = cluster.agents[1]
    restart(agent, None, cluster.version)
    try:
        yield agent
    finally:
        restart(agent, False, cluster.version)


def test_a_udp_client_port_reused_on_a_cluster_ip_balanced_at_connect(
    cluster: Cluster, host_servers: None, node2_pods_at_connect: Agent
) -> None:
    """The same reuse from a pod on node2 to node1's server, with node2 balancing its pods' sockets
    at connect() (the agent's default): node2's socket programs send the cluster IP's datagrams to
    node1's address themselves, so node1 meets them on its NodePort flow's reply tuple as with
    the per-packet path, and recvmsg4 shows the cluster IP. eBPF mode: node2's sendmsg4 translated
    the six datagrams to the cluster IP, not those to node1's NodePort (kube-proxy translates a
    NodePort on the node that owns the address)."""
    before = cluster.bpf_stats(2) if cluster.mode == "ebpf" else {}
    reuse_port_twice(cluster, "pod-2-1", 1, 40_121)
    if cluster.mode == "ebpf":
        after = cluster.bpf_stats(2)
        assert after["sock_translated"] - before["sock_translated"] == 6, (before, after)


def test_host_network_backends_see_the_source_kube_proxy_gives_them(
    cluster: Cluster, host_servers: None
) -> None:
    """Through a cluster IP the pod's own address, to either node. Through node1's NodePort: node1's
    own server sees the external client (delivered locally: no masquerade), node2's sees node1
    (the flow left node1, masqueraded as kube-proxy's KUBE-EXT chain says)."""
    host_network_service(cluster)
    pod = source_ip(cluster, "pod-2-1")
    assert set(bodies(cluster, "pod-2-1", f"http://{HOSTNET}/ip", 30)) == {pod}
    client = source_ip(cluster, "client")
    assert set(bodies(cluster, "client", f"http://{N1}:{HTTP_NP}/ip", 40)) == {client, N1}


def test_internal_traffic_policy_local_to_a_host_network_endpoint_from_pods_and_nodes(
    cluster: Cluster, host_servers: None
) -> None:
    """ "should respect internalTrafficPolicy=Local Pod and Node, to Pod (hostNetwork: true)": the one
    endpoint is node1's host-network server; a pod and a host-network pod on node1 reach it through
    the cluster IP, those on node2 get no answer (no local endpoint there: kube-proxy drops, eBPF
    mode drops the SYN from the pod and refuses the host-network pod's connect())."""
    svc = service("itp-hostnet-ep", "10.96.7.18", [Port("http", 80, HTTP)], internalTrafficPolicy="Local")
    cluster.apply(with_endpoints(svc, [Ep(N1, "node1")]))
    lab = cluster.lab
    for index, expect in ((1, True), (2, False)):
        node = lab.node(index)
        assert node.hostnet_cgroup is not None
        count = 5 if expect else 2
        args = ["http", "--url", "http://10.96.7.18/", "--count", str(count), "--timeout", "1"]
        pod = cluster.client(f"pod-{index}-1", *args)
        hostnet = json.loads(lab.run(node, sys.executable, CLIENT, *args, cgroup=node.hostnet_cgroup).stdout)
        for who, result in ((f"pod-{index}-1", pod), (f"host-network pod on node{index}", hostnet)):
            if expect:
                assert result["errors"] == 0 and result["bodies"] == {"node1": count}, (who, result)
            else:
                assert result["errors"] == count and not result["bodies"], (who, result)
