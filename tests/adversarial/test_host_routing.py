"""Service traffic and the node's own filtering (issue 21 item 3): netfilter's FORWARD chain and the
reverse-path filter, with each host routing and in iptables mode.

The red team stood an iptables-based NetworkPolicy engine in with one rule in the node,
`iptables -I FORWARD -s 10.244.1.2 -d 10.244.1.3 -j DROP` (pod-1-1 to pod-1-2), and sent a UDP
datagram from pod-1-1 with a forged source (10.244.9.9) to a ClusterIP, with rp_filter=1. On main,
eBPF mode redirected both past the stack: the ClusterIP whose only backend is pod-1-2 answered
pod-1-1 despite the rule, and the forged datagram reached the backend (which answered the forged
address). iptables mode blocked both.

Here, per data path:

| data path | ClusterIP past the FORWARD rule | forged source |
| --- | --- | --- |
| iptables | blocked (FORWARD sees pod-1-1 -> pod-1-2) | dropped by rp_filter |
| ebpf, `--bpf-host-routing=legacy` (default) | blocked, as iptables | dropped by rp_filter |
| ebpf, `--bpf-host-routing=bpf` | served: the redirect skips FORWARD | dropped, `spoofed_source` counted |

A third case from the review after it: a `REJECT` in the node's FORWARD chain (tcp-reset or
icmp-port-unreachable) on a NodePort flow from the outside client, which is masqueraded. The node's
own RST or ICMP error carries the backend-side tuple; the client must get it as the answer to what
it sent (iptables: nf_conntrack's RELATED; legacy: ekp_egress, which on main let them leave
untranslated, and the client waited for its timeout).

Each test has its positive control (pod-1-3, which the rule does not name, is served; a datagram
from pod-1-1's own address arrives) so that "blocked" cannot mean "broken". One single-node lab
per data path, with kube-proxy's and Docker's `--ctstate INVALID -j DROP` in FORWARD (legacy host
routing must cope with it, as the traffic suite's nodes do).
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab import Lab
from lab.harness import Cluster, ep
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

FORGED = "10.244.9.9"
UDP_SINK = 9100
# (mode, agent flags): iptables, and eBPF mode with each host routing.
PATHS = {
    "iptables": ("iptables", ()),
    "legacy": ("ebpf", ("--bpf-host-routing=legacy",)),
    "bpf": ("ebpf", ("--bpf-host-routing=bpf",)),
}
SINK = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[2])))
out = open(sys.argv[1], "a", buffering=1)
print("sink ready", flush=True)
while True:
    data, (addr, port) = s.recvfrom(2048)
    out.write(f"{addr} {data.decode(errors='replace')}\n")
"""


@pytest.fixture(scope="module", params=list(PATHS))
def path(request: pytest.FixtureRequest) -> Iterator[tuple[str, Cluster]]:
    require_kernel()
    mode, flags = PATHS[request.param]
    with Lab(nodes=1, pods_per_node=3) as lab:
        lab.start_podservers()
        node = lab.node(1)
        lab.set_sysctl(node, "net.ipv4.conf.all.rp_filter", "1")
        lab.run(node, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")
        cluster = Cluster(lab, mode, extra=flags)
        cluster.start()
        try:
            yield request.param, cluster
        finally:
            failures = cluster.stop()
        assert not failures, f"agent --cleanup failed: {failures}"


def test_the_forward_chain_sees_clusterip_traffic(path: tuple[str, Cluster]) -> None:
    """`iptables -I FORWARD -s pod-1-1 -d pod-1-2 -j DROP` blocks pod-1-1 -> pod-1-2 directly and
    through a ClusterIP whose only backend is pod-1-2 (except with bpf host routing, which skips
    the node's netfilter: the documented price of the redirect)."""
    name, cluster = path
    lab = cluster.lab
    client, backend = lab.pod("pod-1-1"), lab.pod("pod-1-2")
    cluster.apply(
        with_endpoints(service("guarded", "10.96.4.2", [Port("http", 80, 8080)]), [ep(cluster, "pod-1-2")])
    )
    assert cluster.http("pod-1-3", "http://10.96.4.2/", count=3)["bodies"] == {"pod-1-2": 3}, "control"
    assert cluster.http("pod-1-1", "http://10.96.4.2/", count=3)["bodies"] == {"pod-1-2": 3}, (
        "before the rule"
    )

    rule = ["FORWARD", "-s", client.ip, "-d", backend.ip, "-j", "DROP"]
    lab.run(lab.node(1), "iptables", "-I", *rule)
    try:
        direct = cluster.http("pod-1-1", f"http://{backend.ip}:8080/", count=3, timeout=1.0)
        assert direct["errors"] == 3, f"the rule blocks the pods directly: {direct}"
        through = cluster.http("pod-1-1", "http://10.96.4.2/", count=3, timeout=1.0)
        if name == "bpf":
            assert through["bodies"] == {"pod-1-2": 3}, through
        else:
            assert through["errors"] == 3 and not through["bodies"], f"ClusterIP past FORWARD: {through}"
        assert cluster.http("pod-1-3", "http://10.96.4.2/", count=3)["bodies"] == {"pod-1-2": 3}, "control"
    finally:
        lab.run(lab.node(1), "iptables", "-D", *rule)
    assert cluster.http("pod-1-1", "http://10.96.4.2/", count=3)["bodies"] == {"pod-1-2": 3}, "after the rule"


def send_udp(lab: Lab, pod: str, src: str, dst: str, dport: int, payload: bytes) -> None:
    """One UDP datagram from `pod` with the source address `src` (a raw socket: any source)."""
    from scapy.layers.inet import IP, UDP

    datagram = bytes(IP(src=src, dst=dst, ttl=64) / UDP(sport=40000, dport=dport) / payload)
    raw = lab.in_netns(pod, lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW))
    with raw:
        raw.sendto(datagram, (dst, 0))


def received(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def wait_received(log: Path, line: str, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while line not in received(log) and time.monotonic() < deadline:
        time.sleep(0.02)
    return received(log)


def rp_filter_drops(lab: Lab) -> int:
    out = lab.run(lab.node(1), "nstat", "-az", "TcpExtIPReversePathFilter").stdout
    return int(
        next(line.split()[1] for line in out.splitlines() if line.startswith("TcpExtIPReversePathFilter"))
    )


def test_a_forged_source_never_reaches_the_backend(path: tuple[str, Cluster]) -> None:
    """A UDP datagram from pod-1-1 with the source 10.244.9.9 to a ClusterIP: never delivered; one
    from pod-1-1's own address, sent after it on the same path, is (and shows the order)."""
    name, cluster = path
    lab = cluster.lab
    assert lab.tmpdir is not None
    log = lab.tmpdir / f"sink-{name}.log"
    sink = lab.popen(lab.pod("pod-1-2"), sys.executable, "-c", SINK, str(log), str(UDP_SINK), name="udp-sink")
    lab.wait_log(sink, "sink ready")
    svc = service("sink", "10.96.4.1", [Port("udp", UDP_SINK, UDP_SINK, "UDP")])
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-1-2")]))
    client = lab.pod("pod-1-1")
    before_rp = rp_filter_drops(lab)
    before = cluster.bpf_stats().get("drop_spoofed", 0) if cluster.mode == "ebpf" else 0

    send_udp(lab, "pod-1-1", FORGED, "10.96.4.1", UDP_SINK, b"forged")
    send_udp(lab, "pod-1-1", client.ip, "10.96.4.1", UDP_SINK, b"genuine")
    lines = wait_received(log, f"{client.ip} genuine")
    assert f"{client.ip} genuine" in lines, f"the genuine datagram must arrive: {lines}"
    assert not [line for line in lines if "forged" in line], f"the forged source reached the backend: {lines}"

    if name == "bpf":
        assert cluster.bpf_stats()["drop_spoofed"] == before + 1
        assert rp_filter_drops(lab) == before_rp, "dropped by the program, before the stack"
    else:
        assert rp_filter_drops(lab) == before_rp + 1, "dropped by the node's rp_filter"
    lab.stop(sink)


def udp_probe(lab: Lab, target: str, ip: str, port: int, timeout: float) -> str:
    """One datagram from a connected UDP socket: "answered", "refused" (an ICMP port unreachable
    that quotes the datagram as sent, so the kernel matched it to this socket) or "timeout"."""
    try:
        lab.udp_echo(target, ip, port, timeout=timeout)
        return "answered"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"


@pytest.mark.parametrize("reject", ["tcp-reset", "icmp-port-unreachable"])
def test_the_node_s_own_rejects_reach_an_outside_client_translated(
    path: tuple[str, Cluster], reject: str
) -> None:
    """A NetworkPolicy REJECT stood in by `iptables -I FORWARD -d pod-1-2 ... -j REJECT` on a
    NodePort flow from the outside client, which is masqueraded (ETP Cluster): the RST or ICMP
    port unreachable the node's own stack sends back carries the backend-side tuple (backend ->
    client; or quoting client -> backend). The client must get it as a reply to what it sent
    (node:nodePort), so its connect() or recv() fails at once rather than waiting for a timeout:
    iptables mode by nf_conntrack; legacy host routing by ekp_egress, which on main looked up the
    flow's REPLY entry under the SNAT port and let them leave untranslated. bpf host routing never
    shows the flow to FORWARD: served (the documented price of the redirect)."""
    name, cluster = path
    lab = cluster.lab
    node = lab.node(1)
    backend = lab.pod("pod-1-2")
    ports = [Port("http", 80, 8080, node_port=30080), Port("udp", 81, 9000, "UDP", node_port=30081)]
    cluster.apply(
        with_endpoints(service("rejected", "10.96.4.3", ports, type="NodePort"), [ep(cluster, "pod-1-2")])
    )
    seen = lab.http_get("client", node.ip, 30080, "/ip").strip()
    assert seen in (node.ip, node.gateway), f"the flow is masqueraded (the backend saw {seen})"
    assert lab.tcp_probe("client", node.ip, 30080) == "open", "before the rule"
    assert udp_probe(lab, "client", node.ip, 30081, 1.0) == "answered", "before the rule"

    rules = [
        [
            "FORWARD",
            "-d",
            backend.ip,
            "-p",
            "tcp",
            "--dport",
            "8080",
            "-j",
            "REJECT",
            "--reject-with",
            reject,
        ],
        ["FORWARD", "-d", backend.ip, "-p", "udp", "--dport", "9000", "-j", "REJECT"],
    ]
    # The node rate-limits its ICMP errors per destination (icmp_ratelimit: 1 s after a burst of
    # 6), and this test sends up to 6 per parameter to one client: unlimited here, restored after.
    ratelimit = lab.get_sysctl(node, "net.ipv4.icmp_ratelimit")
    lab.set_sysctl(node, "net.ipv4.icmp_ratelimit", "0")
    for rule in rules:
        lab.run(node, "iptables", "-I", *rule)
    try:
        tcp = [lab.tcp_probe("client", node.ip, 30080, timeout=2.0) for _ in range(3)]
        udp = [udp_probe(lab, "client", node.ip, 30081, 2.0) for _ in range(3)]
        if name == "bpf":
            assert (tcp, udp) == (["open"] * 3, ["answered"] * 3)
        else:
            assert tcp == ["refused"] * 3, f"the node's {reject} must reach the client translated: {tcp}"
            assert udp == ["refused"] * 3, (
                f"the node's port unreachable must reach the client translated: {udp}"
            )
    finally:
        for rule in rules:
            lab.run(node, "iptables", "-D", *rule)
        lab.set_sysctl(node, "net.ipv4.icmp_ratelimit", ratelimit)
    assert lab.tcp_probe("client", node.ip, 30080) == "open", "after the rule"
