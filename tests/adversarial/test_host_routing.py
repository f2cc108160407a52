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

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab import Lab
from lab.harness import Cluster, ep
from lab.objects import Ep, Port, endpoint_slice, service, with_endpoints
from lab.sctppeer import COOKIE_ECHO, DATA, INIT
from tests.conftest import require_kernel
from tests.traffic.test_ipv6 import HTTP6_PORT, SERVER6

pytestmark = pytest.mark.kernel

FORGED = "10.244.9.9"
# IPv6 (the lab is dual-stack): the IPv6 HTTP server (tests/traffic/test_ipv6.py) on the backends,
# a ClusterIP whose only backend is pod-1-2, and a NodePort of policy Cluster to it
BACKENDS6 = ("pod-1-2",)
GUARDED6, NODE_PORT6 = "fd00:10:96::42", 30742
# and a Service whose one endpoint is the node's own IPv6 address (a host-network server)
HOSTNET6, HOST_NODE_PORT6, HOST6_PORT = "fd00:10:96::43", 30743, 8096
UDP_SINK = 9100
# an IPv6 SCTP ClusterIP whose one backend is pod-1-2 (lab/sctppeer.py answers at the target port)
SCTP6, SCTP_PORT, SCTP_TARGET = "fd00:10:96::44", 5060, 5061
PEER = str(Path(__file__).resolve().parents[2] / "lab" / "sctppeer.py")
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
    with Lab(nodes=1, pods_per_node=3, ipv6=True) as lab:
        lab.start_podservers()
        for name in BACKENDS6:
            proc = lab.popen(
                lab.pod(name), sys.executable, "-c", SERVER6, name, str(HTTP6_PORT), name="http6"
            )
            lab.wait_log(proc, "ready")
        node = lab.node(1)
        # a host-network endpoint: the IPv6 server in the node's own namespace
        proc = lab.popen(node, sys.executable, "-c", SERVER6, "node1", str(HOST6_PORT), name="host6")
        lab.wait_log(proc, "ready")
        lab.set_sysctl(node, "net.ipv4.conf.all.rp_filter", "1")
        for tool in ("iptables", "ip6tables"):
            lab.run(node, tool, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")
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


def reach6(cluster: Cluster, source: object, url: str) -> str | None:
    """The body `url` answers `source` with over IPv6, or None when nothing answered in a second."""
    res = cluster.lab.run(source, "curl", "-sS", "-g", "--fail", "--max-time", "1", url, check=False)  # type: ignore[arg-type]
    return res.stdout.strip() if res.returncode == 0 else None


def nf_flows6(cluster: Cluster, dst: str) -> str:
    """node1's nf_conntrack entries whose original destination is `dst`."""
    lab = cluster.lab
    return lab.run(lab.node(1), "conntrack", "-L", "-f", "ipv6", "--orig-dst", dst, check=False).stdout


def services6(cluster: Cluster) -> None:
    lab = cluster.lab
    ports = [Port("http", 80, HTTP6_PORT, node_port=NODE_PORT6)]
    svc = service("guarded6", GUARDED6, ports, type="NodePort", ipFamilies=["IPv6"])
    eps = endpoint_slice("guarded6", ports, [Ep(lab.pod("pod-1-2").ip6, "node1")], "v6")
    eps["addressType"] = "IPv6"
    cluster.apply([svc, eps])


def test_the_ip6tables_forward_chain_sees_clusterip_traffic(path: tuple[str, Cluster]) -> None:
    """IPv6, as IPv4 above: `ip6tables -I FORWARD -s pod-1-1 -d pod-1-2 -j DROP` blocks pod-1-1 ->
    pod-1-2 directly and through an IPv6 ClusterIP whose only backend is pod-1-2, but with bpf host
    routing. In eBPF mode the tc IPv6 path translates the flows with either routing (its counters
    move, nf_conntrack holds no DNAT entry to the ClusterIP); with legacy routing it hands them to
    the stack, whose nf_conntrack sees a plain pod-1-1 -> pod-1-2 flow (ip6tables no longer
    translates them: on main it did, legacy routing left IPv6 to it)."""
    name, cluster = path
    lab = cluster.lab
    client, backend = lab.pod("pod-1-1"), lab.pod("pod-1-2")
    services6(cluster)
    url = f"http://[{GUARDED6}]:80/"
    assert reach6(cluster, lab.pod("pod-1-3"), url) == "pod-1-2", "control"
    lab.run(lab.node(1), "conntrack", "-D", "-f", "ipv6", "--orig-dst", GUARDED6, check=False)
    lab.run(lab.node(1), "conntrack", "-D", "-f", "ipv6", "--orig-src", client.ip6, check=False)
    before = cluster.bpf_stats(1)["new_flows"] if name != "iptables" else 0
    assert [reach6(cluster, client, url) for _ in range(3)] == ["pod-1-2"] * 3, "before the rule"
    if name == "iptables":
        assert f"sport={HTTP6_PORT} " in nf_flows6(cluster, GUARDED6), "ip6tables' DNAT (its reply tuple)"
    else:
        assert cluster.bpf_stats(1)["new_flows"] - before >= 3, "translated by tc"
        assert nf_flows6(cluster, GUARDED6) == "", "no DNAT in nf_conntrack"
        plain = nf_flows6(cluster, backend.ip6)
        assert (f"src={client.ip6} dst={backend.ip6} " in plain) is (name == "legacy"), plain

    rule = ["FORWARD", "-s", client.ip6, "-d", backend.ip6, "-j", "DROP"]
    lab.run(lab.node(1), "ip6tables", "-I", *rule)
    try:
        direct = reach6(cluster, client, f"http://[{backend.ip6}]:{HTTP6_PORT}/")
        assert direct is None, "the rule blocks the pods directly"
        through = [reach6(cluster, client, url) for _ in range(3)]
        if name == "bpf":
            assert through == ["pod-1-2"] * 3, through
        else:
            assert through == [None] * 3, f"ClusterIP past FORWARD: {through}"
        assert reach6(cluster, lab.pod("pod-1-3"), url) == "pod-1-2", "control"
    finally:
        lab.run(lab.node(1), "ip6tables", "-D", *rule)
    assert reach6(cluster, client, url) == "pod-1-2", "after the rule"


def test_an_ipv6_node_port_from_outside_is_masqueraded_with_either_routing(path: tuple[str, Cluster]) -> None:
    """The external client reaches the IPv6 NodePort (policy Cluster): the backend sees the node's
    address. In eBPF mode the tc IPv6 path translates both addresses (legacy routing: the
    destination at ingress, the source at egress, ekp_hostnat6), counted as SNAT, and nf_conntrack
    holds no DNAT entry for it; in iptables mode ip6tables' DNAT and MASQUERADE do."""
    name, cluster = path
    lab = cluster.lab
    node = lab.node(1)
    services6(cluster)
    lab.run(node, "conntrack", "-D", "-f", "ipv6", "--orig-dst", node.ip6, check=False)
    stats = cluster.bpf_stats(1) if name != "iptables" else {"new_flows": 0, "snat": 0}
    url = f"http://[{node.ip6}]:{NODE_PORT6}"
    assert [reach6(cluster, lab.client, f"{url}/") for _ in range(3)] == ["pod-1-2"] * 3
    source = reach6(cluster, lab.client, f"{url}/ip")
    assert source is not None and source != lab.client.ip6, source
    flows = nf_flows6(cluster, node.ip6)
    if name == "iptables":
        assert f"dport={NODE_PORT6} " in flows, "ip6tables' DNAT"
        return
    assert source == node.ip6, "masqueraded by tc to the node's IPv6 address"
    after = cluster.bpf_stats(1)
    assert after["new_flows"] - stats["new_flows"] >= 4
    assert after["snat"] - stats["snat"] >= 4, "every flow source-translated by tc"
    assert f"dport={NODE_PORT6} " not in flows, flows


def test_an_ipv6_endpoint_on_the_nodes_own_address_sees_the_clients_address(
    path: tuple[str, Cluster],
) -> None:
    """A Service whose endpoint is the node's own IPv6 address (a host-network server): a pod
    through the ClusterIP and the external client through the NodePort (policy Cluster) both reach
    it with their own address (delivered locally: no masquerade, as kube-proxy's DNAT in
    PREROUTING). In eBPF mode the tc IPv6 path translates them, with either routing (its counters
    move, nf_conntrack holds no DNAT entry), and gives the node's replies their frontend back at
    egress (ekp_egress6); on main it left such a frontend to ip6tables."""
    name, cluster = path
    lab = cluster.lab
    node, pod = lab.node(1), lab.pod("pod-1-1")
    ports = [Port("http", 80, HOST6_PORT, node_port=HOST_NODE_PORT6)]
    svc = service("hostnet6", HOSTNET6, ports, type="NodePort", ipFamilies=["IPv6"])
    eps = endpoint_slice("hostnet6", ports, [Ep(node.ip6, "node1")], "v6")
    eps["addressType"] = "IPv6"
    cluster.apply([svc, eps])
    for dst in (HOSTNET6, node.ip6):
        lab.run(node, "conntrack", "-D", "-f", "ipv6", "--orig-dst", dst, check=False)
    before = cluster.bpf_stats(1)["new_flows"] if name != "iptables" else 0
    assert [reach6(cluster, pod, f"http://[{HOSTNET6}]:80/") for _ in range(2)] == ["node1"] * 2
    assert reach6(cluster, pod, f"http://[{HOSTNET6}]:80/ip") == pod.ip6
    url = f"http://[{node.ip6}]:{HOST_NODE_PORT6}"
    assert reach6(cluster, lab.client, f"{url}/") == "node1"
    assert reach6(cluster, lab.client, f"{url}/ip") == lab.client.ip6, "the client's own address"
    to_vip, to_node = nf_flows6(cluster, HOSTNET6), nf_flows6(cluster, node.ip6)
    if name == "iptables":
        assert f"sport={HOST6_PORT} " in to_vip, "ip6tables' DNAT"
        return
    assert cluster.bpf_stats(1)["new_flows"] - before >= 5, "translated by tc"
    assert to_vip == "", to_vip
    assert f"dport={HOST_NODE_PORT6} " not in to_node, to_node


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


@pytest.mark.parametrize("reject", ["tcp-reset", "icmp6-port-unreachable"])
def test_the_node_s_own_ipv6_rejects_reach_an_outside_client_translated(
    path: tuple[str, Cluster], reject: str
) -> None:
    """IPv6, as IPv4 above: `ip6tables -I FORWARD -d pod-1-2 -p tcp --dport 8086 -j REJECT` on the
    IPv6 NodePort flow from the outside client, which is masqueraded (ETP Cluster): the RST or
    ICMPv6 port unreachable the node's own stack sends carries the backend-side tuple (backend ->
    client; or quoting client -> backend). The client's connect() must fail at once: iptables mode
    by nf_conntrack's RELATED; legacy host routing by ekp_egress6, from the flow's tag-0
    ekp_hostnat6_v2 entry (IPv4's code, bpf/ekp_host_af.h), which IPv6 did not keep before, so both
    left untranslated and the client waited for its timeout. bpf host routing never shows the flow
    to FORWARD: served."""
    name, cluster = path
    lab = cluster.lab
    node = lab.node(1)
    backend = lab.pod("pod-1-2")
    services6(cluster)
    assert lab.tcp_probe("client", node.ip6, NODE_PORT6) == "open", "before the rule"
    source = reach6(cluster, lab.client, f"http://[{node.ip6}]:{NODE_PORT6}/ip")
    assert source is not None and source != lab.client.ip6, (
        f"the flow is masqueraded (the backend saw {source})"
    )
    rule = ["FORWARD", "-d", backend.ip6, "-p", "tcp", "--dport", str(HTTP6_PORT), "-j", "REJECT"]
    rule += ["--reject-with", reject]
    # The node rate-limits its ICMPv6 errors (icmp/ratelimit, 1 s): unlimited here, restored after.
    ratelimit = lab.get_sysctl(node, "net.ipv6.icmp.ratelimit")
    lab.set_sysctl(node, "net.ipv6.icmp.ratelimit", "0")
    lab.run(node, "ip6tables", "-I", *rule)
    try:
        tcp = [lab.tcp_probe("client", node.ip6, NODE_PORT6, timeout=2.0) for _ in range(3)]
        if name == "bpf":
            assert tcp == ["open"] * 3
        else:
            assert tcp == ["refused"] * 3, f"the node's {reject} must reach the client translated: {tcp}"
    finally:
        lab.run(node, "ip6tables", "-D", *rule)
        lab.set_sysctl(node, "net.ipv6.icmp.ratelimit", ratelimit)
    assert lab.tcp_probe("client", node.ip6, NODE_PORT6) == "open", "after the rule"


def test_an_ipv6_sctp_association_through_a_cluster_ip(path: tuple[str, Cluster]) -> None:
    """upstream's "should function for pod-Service: sctp" over IPv6 with each data path (the lab
    kernel has no SCTP sockets: lab/sctppeer.py crafts the chunks over IPv6 raw sockets): pod-1-1
    opens an association to an IPv6 ClusterIP whose backend is pod-1-2 by the four-way handshake
    (INIT, INIT-ACK, COOKIE ECHO, COOKIE ACK, each answer from the ClusterIP's address and port)
    and sends DATA chunks the backend echoes, none lost; the backend sees the pod's own address.
    iptables mode: ip6tables' DNAT (its entry in nf_conntrack). eBPF mode: the tc IPv6 path, under
    legacy host routing (the default) its destination at ingress and the node's stack between, so
    nf_conntrack holds no DNAT entry to the ClusterIP (the node's own SCTP sockets are left to
    ip6tables: agent/model/tc6_leaves.py, none here)."""
    name, cluster = path
    lab = cluster.lab
    client, backend = lab.pod("pod-1-1"), lab.pod("pod-1-2")
    ports = [Port("sip", SCTP_PORT, SCTP_TARGET, "SCTP")]
    svc = service("sctp6", SCTP6, ports, ipFamilies=["IPv6"])
    eps = endpoint_slice("sctp6", ports, [Ep(backend.ip6, "node1")], "v6")
    eps["addressType"] = "IPv6"
    cluster.apply([svc, eps])
    lab.run(lab.node(1), "conntrack", "-D", "-f", "ipv6", "-p", "sctp", check=False)
    stats = cluster.bpf_stats(1) if name != "iptables" else {}
    server = lab.popen(
        backend,
        *(sys.executable, PEER, "server", "--port", str(SCTP_TARGET), "--seconds", "30", "--ipv6"),
        name="sctp6-server",
    )
    try:
        lab.wait_log(server, "ready", timeout=10)
        res = lab.run(
            client,
            *(sys.executable, PEER, "hold", "--addr", SCTP6, "--port", str(SCTP_PORT), "--sport", "42100"),
            *("--stop-file", "/nonexistent", "--max-s", "2"),
            timeout=30,
        )
        flows = nf_flows6(cluster, SCTP6)
    finally:
        lab.stop(server, timeout=5)
    assoc = json.loads(res.stdout)
    assert assoc["established"], assoc
    assert assoc["exchanges"] >= 10 and assoc["lost"] == 0, assoc
    seen = [
        json.loads(line)
        for line in lab.log_of(server, limit=None).splitlines()
        if line.startswith("{") and json.loads(line)["dport"] == SCTP_TARGET
    ]
    kinds = {p["chunk"] for p in seen}
    assert {INIT, COOKIE_ECHO, DATA} <= kinds, seen
    assert all(
        (p["src"], p["sport"], p["dst"], p["crc_ok"]) == (client.ip6, 42100, backend.ip6, True) for p in seen
    ), seen
    if name == "iptables":
        assert f"dport={SCTP_PORT} " in flows, flows
        return
    assert flows == "", f"translated by tc, not by ip6tables: {flows}"
    after = cluster.bpf_stats(1)
    assert after["new_flows"] - stats["new_flows"] >= 1
