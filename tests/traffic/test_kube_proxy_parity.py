"""kube-proxy behaviours an independent remap of upstream's e2e tests found untested (issue 19 item 6),
on the two-node `cluster` in both modes, each named after the upstream test where one exists:

* kube_proxy.go "should set TCP CLOSE_WAIT timeout": kube-proxy's conntrack sysctls, which it
  writes whatever its mode, on the node's own nf_conntrack entries;
* conntrack.go's ITP Local UDP flow through the window with only a remote endpoint (kubernetes#126934);
* loadbalancer.go "should only allow access from service loadbalancer source ranges": the ranges
  edited on a live Service (the allowed source swapped, then the field removed);
* external IPs and load-balancer IPs of a Service without endpoints refused at once, TCP and UDP
  (kube-proxy's KUBE-EXTERNAL-SERVICES REJECT), from outside and from a pod.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest

from lab.core import PODSERVER
from lab.harness import Cluster, ep
from lab.objects import Obj, Port, service, with_endpoints
from tests.traffic.test_upstream_e2e import ECHO, HTTP, apply, not_served, served, udp_from

pytestmark = pytest.mark.kernel

# upstream's nat-closewait-client: connect, the server closes its side after answering, the client
# keeps its own open (CLOSE_WAIT on the client's node) and leaks the connection.
HALF_CLOSED_CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
while s.recv(4096):
    pass
print("half-closed", flush=True)
time.sleep(60)
"""
CLOSE_WAIT_PORT = 11302  # upstream's testDaemonTCPPort


def test_should_set_tcp_close_wait_timeout(cluster: Cluster) -> None:
    """kube_proxy.go "should set TCP CLOSE_WAIT timeout [Privileged]": a pod on one node connects to a
    server on another node's address (not a Service), the server closes, the client does not; the
    client node's nf_conntrack entry is in CLOSE_WAIT with kube-proxy's one-hour timeout (within
    upstream's 60 s). kube-proxy writes its conntrack sysctls in every mode; eBPF mode wrote none
    before, and the entry had the kernel's 60 s. (The nodes' netfilter tracks connections: in
    iptables mode for the agent's rules, in eBPF mode for the fixture's INVALID rule, as a real
    node's CNI or Docker rules make it.)"""
    lab = cluster.lab
    node1, node2 = lab.node(1), lab.node(2)
    for key, want in (
        ("nf_conntrack_tcp_timeout_established", "86400"),
        ("nf_conntrack_tcp_timeout_close_wait", "3600"),
    ):
        assert lab.get_sysctl(node2, f"net.netfilter.{key}") == want, key
    server = lab.popen(
        node1, sys.executable, str(PODSERVER), "--name", "closewait", "--http-port", str(CLOSE_WAIT_PORT),
        name=f"closewait-server-{cluster.mode}",
    )  # fmt: skip
    client = None
    try:
        lab.wait_tcp(node1, node1.ip, CLOSE_WAIT_PORT, proc=server)
        client = lab.popen(
            "pod-2-1", sys.executable, "-c", HALF_CLOSED_CLIENT, node1.ip, str(CLOSE_WAIT_PORT),
            name=f"closewait-client-{cluster.mode}",
        )  # fmt: skip
        lab.wait_log(client, "half-closed", timeout=10)
        entry = ""
        deadline = time.monotonic() + 10
        while not entry and time.monotonic() < deadline:
            listed = lab.run(node2, "conntrack", "-L", "-f", "ipv4", "-d", node1.ip, check=False).stdout
            entry = next(
                (
                    line
                    for line in listed.splitlines()
                    if "CLOSE_WAIT" in line and f"dport={CLOSE_WAIT_PORT}" in line
                ),
                "",
            )
            time.sleep(0.1)
        assert entry, f"no CLOSE_WAIT entry on node2 for {node1.ip}:{CLOSE_WAIT_PORT}"
        assert abs(int(entry.split()[2]) - 3600) < 60, entry
    finally:
        if client is not None:
            lab.stop(client)
        lab.stop(server)


def test_udp_itp_local_flow_through_the_window_with_only_a_remote_endpoint(cluster: Cluster) -> None:
    """kubernetes#126934 (conntrack.go "should be able to preserve UDP traffic when server pod cycles
    for a ClusterIP service with InternalTrafficPolicy set to Local", with the gap a DaemonSet's
    rollout leaves): one UDP flow (the same source port all along) from node1 while node1's only
    endpoint goes, leaving only node2's, which ITP Local does not use (datagrams dropped, none
    answered by node2's pod), and a new one comes on node1: the flow reaches the new pod at once,
    no stale conntrack entry blackholes it."""
    svc = service("svc-udp-itp-gap", "10.96.41.1", [ECHO], internalTrafficPolicy="Local")
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-1-5"), ep(cluster, "pod-2-5")]))
    assert udp_from(cluster, "pod-1-1", "10.96.41.1", 90)["replies"] == {"pod-1-5": 3}
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-2-5")]))
    gap = udp_from(cluster, "pod-1-1", "10.96.41.1", 90, count=2)
    assert gap == {"replies": {}, "lost": 2}, gap
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-1-6"), ep(cluster, "pod-2-5")]))
    after = udp_from(cluster, "pod-1-1", "10.96.41.1", 90, count=3)
    assert after == {"replies": {"pod-1-6": 3}, "lost": 0}, after


SOURCE_RANGE_LB = "198.51.104.30"


def lb_with_ranges(ranges: list[str] | None) -> Obj:
    spec: dict[str, Any] = {"type": "LoadBalancer"}
    if ranges is not None:
        spec["loadBalancerSourceRanges"] = ranges
    status = {"loadBalancer": {"ingress": [{"ip": SOURCE_RANGE_LB}]}}
    return service(
        "lb-ranges", "10.96.41.2", [Port("http", 80, 8080, node_port=30731)], status=status, **spec
    )


def test_should_only_allow_access_from_service_loadbalancer_source_ranges(cluster: Cluster) -> None:
    """loadbalancer.go "should only allow access from service loadbalancer source ranges", on a live
    Service: the range admits pod-1-1 and not pod-2-1; swapped, pod-2-1 and not pod-1-1; the field
    removed, both. Each denial is checked beside an answer to the other pod on the same address."""
    pod11, pod21 = cluster.lab.pod("pod-1-1").ip, cluster.lab.pod("pod-2-1").ip
    url = f"http://{SOURCE_RANGE_LB}/"
    eps = [ep(cluster, "pod-1-4")]
    apply(cluster, with_endpoints(lb_with_ranges([f"{pod11}/32"]), eps))
    assert served(cluster, "pod-1-1", url, count=3) == {"pod-1-4"}
    not_served(cluster, "pod-2-1", url)
    apply(cluster, with_endpoints(lb_with_ranges([f"{pod21}/32"]), eps))
    assert served(cluster, "pod-2-1", url, count=3) == {"pod-1-4"}
    not_served(cluster, "pod-1-1", url)
    apply(cluster, with_endpoints(lb_with_ranges(None), eps))
    assert served(cluster, "pod-1-1", url, count=3) == {"pod-1-4"}
    assert served(cluster, "pod-2-1", url, count=3) == {"pod-1-4"}


EXTERNAL_IP, REJECT_LB = "203.0.113.41", "198.51.104.41"


@pytest.mark.parametrize("source", ["client", "pod-2-1"])
def test_external_and_load_balancer_ips_without_endpoints_are_refused_at_once(
    cluster: Cluster, source: str
) -> None:
    """kube-proxy's KUBE-EXTERNAL-SERVICES: an external IP and a load-balancer IP of a Service without
    endpoints answer a TCP SYN and a UDP datagram with an ICMP port unreachable (connection
    refused at once), not silence; with an endpoint the same addresses answered first (the
    positive control: what refuses is the agent's reject of a programmed address)."""
    lab = cluster.lab
    lab.add_client_route("203.0.113.0/24", via_node=1)
    lab.add_client_route("198.51.104.0/24", via_node=1)
    # node1's default route points back at the client: a forwarded packet to an address without
    # a rule would leave by the interface it came in on, and the kernel's ICMP redirect logic then
    # silences iptables' REJECT toward that sender (README, machine facts). A node's upstream
    # router is not its client; redirects off on node1 make the lab's topology that of a node.
    node1 = lab.node(1)
    before = {k: lab.get_sysctl(node1, f"net.ipv4.conf.{k}.send_redirects") for k in ("all", "eth0")}
    for k in before:
        lab.set_sysctl(node1, f"net.ipv4.conf.{k}.send_redirects", "0")
    try:
        refused_at_once(cluster, source)
    finally:
        for k, v in before.items():
            lab.set_sysctl(node1, f"net.ipv4.conf.{k}.send_redirects", v)


def refused_at_once(cluster: Cluster, source: str) -> None:
    lab = cluster.lab
    svc = service(
        "reject-ext",
        "10.96.41.3",
        [HTTP, ECHO],
        type="LoadBalancer",
        externalIPs=[EXTERNAL_IP],
        status={"loadBalancer": {"ingress": [{"ip": REJECT_LB}]}},
    )
    apply(cluster, with_endpoints(svc, [ep(cluster, "pod-1-3")]))
    for addr in (EXTERNAL_IP, REJECT_LB):
        assert lab.http_get(source, addr, 80, timeout=3.0).strip() == "pod-1-3", addr
        assert lab.udp_echo(source, addr, 90, timeout=3.0).startswith("pod-1-3 "), addr
    apply(cluster, with_endpoints(svc, []))
    for addr in (EXTERNAL_IP, REJECT_LB):
        start = time.monotonic()
        assert lab.tcp_probe(source, addr, 80, timeout=3.0) == "refused", addr
        with pytest.raises(ConnectionRefusedError):
            lab.udp_echo(source, addr, 90, timeout=3.0)
        elapsed = time.monotonic() - start
        assert elapsed < 1.0, f"{addr}: refusals took {elapsed:.2f} s: dropped, not rejected"
