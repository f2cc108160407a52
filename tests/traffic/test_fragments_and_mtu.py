"""Large datagrams and small MTUs through services, per mode: fragments of a 4,000-byte UDP
datagram (DNS with EDNS0, NFS) both ways, fragments in reverse order (pod to pod, to the node's
address, through a ClusterIP), and path-MTU discovery through a ClusterIP and a NodePort (a large
TCP upload completes, it does not stall on a black hole).

iptables mode gets these from the kernel (nf_defrag reassembles before NAT; nf_nat translates ICMP
errors that quote a translated packet; the forwarding path sends fragmentation needed). eBPF mode
from the data path: ekp_frag, ekp_decide_related, and the FIB lookup's "fragmentation needed".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lab.harness import Cluster, ep
from lab.objects import Port, service, with_endpoints

pytestmark = pytest.mark.kernel

N1 = "192.168.0.11"
ECHO = Port("echo", 9000, 9000, "UDP")
SIZE = 4000
UPLOAD = 20_000_000


CASES = [
    ("pod-1-1", "pod-1-2", "clusterip"),  # same node
    ("pod-1-1", "pod-2-1", "clusterip"),  # through node1's uplink
    ("client", "pod-2-1", "nodeport"),  # external client, source translated to node1
    ("client", "pod-1-2", "nodeport"),  # external client, local backend (masqueraded)
    ("pod-1-1", "pod-2-1", "nodeport"),  # a pod to a node address
]


@pytest.mark.parametrize(("client", "backend", "via"), CASES)
def test_a_4000_byte_udp_datagram_crosses_a_service_both_ways(
    cluster: Cluster, client: str, backend: str, via: str
) -> None:
    """Each request and each echo is three fragments; every one must be translated (or, for the
    stack, reassembled and translated) or the datagram is lost. A Service of its own per case
    (changing one Service's endpoint between cases was seen to leave iptables mode answering from
    the previous endpoint for fragmented datagrams, which is not what this test is about)."""
    n = CASES.index((client, backend, via))
    vip, node_port = f"10.96.3.{10 + n}", 30910 + n
    svc = service(
        f"big-udp-{n}", vip, [Port("echo", 9000, 9000, "UDP", node_port=node_port)], type="NodePort"
    )
    cluster.apply(with_endpoints(svc, [ep(cluster, backend)]))
    addr, port = (vip, 9000) if via == "clusterip" else (N1, node_port)
    before = cluster.bpf_stats() if cluster.mode == "ebpf" else {}
    result = cluster.udp(client, addr, port, count=20, size=SIZE)
    assert result["lost"] == 0, result
    assert result["replies"] == {backend: 20}, result  # echoed whole: "<name> <4,000 bytes>"
    if cluster.mode == "ebpf":  # node1 translated the later fragments itself
        assert cluster.bpf_stats()["fragments"] - before["fragments"] >= 40


# (client, echo server, how): 3,000-byte datagrams sent as three fragments, last first
REVERSED = [
    ("pod-1-1", "pod-2-1", "pod"),  # pod to pod directly, across the nodes: no service involved
    ("client", "node1", "node"),  # from outside to the node's own address (where NodePorts live)
    ("pod-1-1", "pod-2-1", "clusterip"),  # through a ClusterIP
]


@pytest.mark.parametrize(("client", "server", "via"), REVERSED)
def test_a_reversed_three_fragment_datagram_arrives(
    cluster: Cluster, client: str, server: str, via: str
) -> None:
    """Some stacks send the last fragment first, and an ECMP fabric reorders fragments (the first
    hashes by its ports, the others by their addresses alone). The kernel, and so iptables mode,
    reassembles in any order. eBPF mode passes a fragment that comes before its first to the stack
    untouched when no translated flow can use its addresses (pod to pod), and holds it otherwise
    (the node's address carries NodePorts; a ClusterIP) until the first comes and puts it back:
    every datagram is echoed whole. (Before, each lost its two later fragments:
    `fragment_without_first`.)"""
    n = REVERSED.index((client, server, via))
    vip = f"10.96.3.{40 + n}"
    svc = service(
        f"reversed-{n}", vip, [Port("echo", 9000, 9000, "UDP", node_port=30940 + n)], type="NodePort"
    )
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-2-1")]))  # node1's address is a frontend
    lab = cluster.lab
    echo = None
    if via == "node":  # a UDP echo of the node's own, on no NodePort
        echo = lab.start_podserver(lab.node(server), http_ports=(18080,), udp_ports=(19000,))
    addr, port = (N1, 19000) if via == "node" else (vip if via == "clusterip" else lab.pod(server).ip, 9000)
    before = cluster.bpf_stats() if cluster.mode == "ebpf" else {}
    try:
        result = cluster.client(client, "frags", "--addr", addr, "--port", str(port), "--count", "5")
    finally:
        if echo is not None:
            lab.stop(echo)
    assert result == {"replies": {server: 5}, "lost": 0}, result
    if cluster.mode == "ebpf":
        after = cluster.bpf_stats()
        delta = {k: after[k] - before[k] for k in ("frag_held", "frag_released", "drop_frag_no_first")}
        held = 0 if via == "pod" else 10  # two later fragments of each datagram, on node1
        assert delta == {"frag_held": held, "frag_released": held, "drop_frag_no_first": 0}, delta


@contextmanager
def mtu(cluster: Cluster, where: list[tuple[str, str]], value: int) -> Iterator[None]:
    """Devices (namespace role or name, device) set to `value` for the body, restored after."""
    lab = cluster.lab
    before = []
    for ns, dev in where:
        out = lab.run(ns, "cat", f"/sys/class/net/{dev}/mtu").stdout.strip()
        before.append((ns, dev, out))
        lab.run(ns, "ip", "link", "set", dev, "mtu", str(value))
    try:
        yield
    finally:
        for ns, dev, old in before:
            lab.run(ns, "ip", "link", "set", dev, "mtu", old)
        # forget the learned path MTUs, both families
        for family in ("-4", "-6"):
            for node in lab.nodes:
                lab.run(node, "ip", family, "route", "flush", "cache", check=False)
            for pod in lab.pods:
                lab.run(pod, "ip", family, "route", "flush", "cache", check=False)


def upload(cluster: Cluster, client: str, url: str) -> dict[str, object]:
    result = cluster.client(client, "upload", "--url", url, "--bytes", str(UPLOAD), "--timeout", "30")
    assert result.get("received") == UPLOAD, result
    return result


def test_path_mtu_through_a_clusterip_when_the_nodes_uplink_is_smaller(cluster: Cluster) -> None:
    """node1's uplink (its eth0 and the switch port) carries 1,400 bytes; the pods have 1,500 and
    their TCP starts with 1,460-byte segments. node1 answers the first too big segment with a
    fragmentation needed from the ClusterIP (eBPF: the route lookup says so before redirecting;
    iptables: ip_forward), the client lowers its path MTU, the upload completes."""
    svc = service("pmtu", "10.96.3.2", [Port("http", 80, 8080)])
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-2-1")]))
    before = cluster.bpf_stats() if cluster.mode == "ebpf" else {}
    with mtu(cluster, [("node1", "eth0"), ("net", "sw-node1")], 1400):
        upload(cluster, "pod-1-1", "http://10.96.3.2/sink")
    if cluster.mode == "ebpf":
        assert cluster.bpf_stats()["drop_frag_needed"] > before["drop_frag_needed"]


@pytest.mark.parametrize("via", ["clusterip", "nodeport"])
def test_path_mtu_through_a_service_when_a_router_beyond_it_says_so(cluster: Cluster, via: str) -> None:
    """node2's veth to the backend carries 1,400 bytes (the pod itself has 1,500): node2's stack
    sends fragmentation needed to the packet's source (the client pod, or node1 for a NodePort
    flow it source-translated), quoting the packet as node1 translated it; node1 translates the
    error back (eBPF: ekp_decide_related; iptables: nf_nat) so the client's stack finds its
    socket. The upload completes."""
    svc = service("pmtu", "10.96.3.3", [Port("http", 80, 8080, node_port=30903)], type="NodePort")
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-2-1")]))
    backend_veth = cluster.lab.pod("pod-2-1").host_iface
    client, url = (
        ("pod-1-1", "http://10.96.3.3/sink") if via == "clusterip" else ("client", f"http://{N1}:30903/sink")
    )
    before = cluster.bpf_stats() if cluster.mode == "ebpf" else {}
    with mtu(cluster, [("node2", backend_veth)], 1400):
        upload(cluster, client, url)
    if cluster.mode == "ebpf":
        assert cluster.bpf_stats()["ct_related"] > before["ct_related"]
