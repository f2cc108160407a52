"""eBPF mode leaves a node's IPv6 packets untracked when its programs leave nothing to ip6tables
(agent/metaproxier.py EbpfAndIp6tables, issue 20), with real traffic through the dual-stack lab.

Any conntrack match or nat chain in the node's netns registers nf_conntrack's hooks there, and
then every IPv6 packet of the node is tracked: a plain pod -> pod IPv6 connection cost about 25%
more with the agent running than without it, where IPv4's eBPF mode writes no iptables rule at
all. With the IPv6 SNAT granted and only Services the eBPF programs serve, node1's ip6tables keeps
the healthCheckNodePort's ACCEPT and nothing else, and `conntrack -L -f ipv6` stays empty under
IPv6 traffic to a pod IP and to a ClusterIP. A Service the programs leave to the stack (SCTP)
brings every rule back, and its going takes them away again.

eBPF mode only: iptables mode's rules are conntrack's by nature (its DNAT is nf_nat's).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lab import Lab
from lab.harness import Cluster, started
from lab.objects import Ep, Obj, Port, endpoint_slice, service
from tests.conftest import require_kernel
from tests.traffic.test_ipv6 import HTTP6_PORT, SERVER6, fetch

VIP, LB_VIP, LB_IP, HC_PORT, SCTP_VIP = (
    "fd00:10:96::d1",
    "fd00:10:96::d2",
    "fd00:10:97::d",
    32123,
    "fd00:10:96::d3",
)
SERVER = "pod-1-2"
HC_ACCEPT = f"--dport {HC_PORT} -j ACCEPT"


# The server pod's other IPv6 peers: a TCP sink for a long-lived stream and a UDP echo that answers
# each datagram with itself (a 4,000-byte one is fragmented both ways).
STREAM_PORT, UDP_ECHO_PORT = 7777, 9977
PEERS6 = r"""
import socket, sys, threading

def sink(conn):
    while conn.recv(1 << 20):
        pass

def tcp(port):
    srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("::", port))
    srv.listen(16)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=sink, args=(conn,), daemon=True).start()

def udp(port):
    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    sock.bind(("::", port))
    while True:
        data, peer = sock.recvfrom(65535)
        sock.sendto(data, peer)

threading.Thread(target=udp, args=(int(sys.argv[2]),), daemon=True).start()
threading.Thread(target=tcp, args=(int(sys.argv[1]),), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""
# One TCP connection sending 256 KiB every 10 ms (its window many times over while untracked),
# the bytes sendall() took written to a file every 0.1 s: a stalled connection stops counting.
STREAM6 = r"""
import os, socket, sys, time
addr, port, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sock = socket.create_connection((addr, port), timeout=120)
chunk, sent, said = b"x" * (256 << 10), 0, 0.0
while True:
    sock.sendall(chunk)
    sent += len(chunk)
    now = time.monotonic()
    if now - said > 0.1:
        with open(progress + ".tmp", "w") as f:
            f.write(str(sent))
        os.replace(progress + ".tmp", progress)
        said = now
    time.sleep(0.01)
"""
ROUTINGS = ["legacy", "bpf"]


@pytest.fixture(scope="module", params=ROUTINGS)
def lab6(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Both host routings: `legacy` (the default) hands the tc path's packets to the node's stack."""
    require_kernel()
    with Lab(nodes=1, pods_per_node=2, ipv6=True) as lab:
        proc = lab.popen(
            lab.pod(SERVER), sys.executable, "-c", SERVER6, SERVER, str(HTTP6_PORT), name="http6"
        )
        lab.wait_log(proc, "ready")
        peers = lab.popen(
            lab.pod(SERVER), sys.executable, "-c", PEERS6, str(STREAM_PORT), str(UDP_ECHO_PORT), name="peers6"
        )
        lab.wait_log(peers, "ready")
        c = Cluster(lab, "ebpf", extra=[f"--bpf-host-routing={request.param}"])
        with started(c):
            yield c


def objects(c: Cluster, *, sctp: bool) -> list[Obj]:
    """A ClusterIP and an ETP Local LoadBalancer (its healthCheckNodePort) on the server pod; with
    `sctp`, an SCTP ClusterIP too, which the socket programs leave to ip6tables."""
    ep = [Ep(c.lab.pod(SERVER).ip6, "node1")]
    http = Port("http", 80, HTTP6_PORT)
    echo = Port("echo", 53, UDP_ECHO_PORT, "UDP")
    lport = Port("http", 80, HTTP6_PORT, node_port=30123)
    out: list[Obj] = [
        service("untracked", VIP, [http, echo], ipFamilies=["IPv6"]),
        endpoint_slice("untracked", [http, echo], ep, "v6"),
        service(
            "untracked-lb",
            LB_VIP,
            [lport],
            type="LoadBalancer",
            ipFamilies=["IPv6"],
            externalTrafficPolicy="Local",
            healthCheckNodePort=HC_PORT,
            status={"loadBalancer": {"ingress": [{"ip": LB_IP}]}},
        ),
        endpoint_slice("untracked-lb", [lport], ep, "v6"),
    ]
    if sctp:
        sport = Port("sip", 5060, 5061, "SCTP")
        out += [service("untracked-sctp", SCTP_VIP, [sport], ipFamilies=["IPv6"])]
        out += [endpoint_slice("untracked-sctp", [sport], ep, "v6")]
    for obj in out:
        if obj["kind"] == "EndpointSlice":
            obj["addressType"] = "IPv6"
    return out


def save(c: Cluster) -> str:
    return c.lab.run(c.lab.node(1), "ip6tables-save").stdout


def hook_users(c: Cluster) -> list[str]:
    """node1's ip6tables rules that register nf_conntrack or nf_nat hooks: nat rules, conntrack
    matches (the built-in chains of an empty nat table register none: checked by this test)."""
    return [
        line
        for line in save(c).splitlines()
        if line.startswith("-A ")
        and ("conntrack" in line or "MASQUERADE" in line or " -j KUBE-" in line)
        and "health check" not in line
    ]


def until(what: str, ok: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"still not {what} after {timeout:.0f}s"
        time.sleep(0.2)


def tracked6(c: Cluster) -> list[str]:
    out = c.lab.run(c.lab.node(1), "conntrack", "-L", "-f", "ipv6", check=False).stdout
    return [line for line in out.splitlines() if line.strip()]


def flush6(c: Cluster) -> None:
    """node1's IPv6 nf_conntrack emptied: the agent leaves the entries the rules' hooks made (they
    time out), so what is tracked after this is the traffic sent after it."""
    c.lab.run(c.lab.node(1), "conntrack", "-F", "-f", "ipv6")
    assert tracked6(c) == []


def traffic(c: Cluster) -> None:
    """A pod's IPv6 connections to the server pod's IP and to the ClusterIP (tc's)."""
    client, server = c.lab.pod("pod-1-1"), c.lab.pod(SERVER)
    for _ in range(3):
        assert fetch(c, client, f"http://[{server.ip6}]:{HTTP6_PORT}/") == SERVER
        assert fetch(c, client, f"http://[{VIP}]:80/") == SERVER


def test_no_ipv6_packet_is_tracked_while_the_ebpf_programs_leave_ip6tables_nothing(lab6: Cluster) -> None:
    c = lab6
    c.apply(objects(c, sctp=False))
    # the grant comes at a sync, the rules go at the next IPv6 one
    until("withdrawn", lambda: hook_users(c) == [])
    assert HC_ACCEPT in save(c), "the healthCheckNodePort's ACCEPT stays"
    # the entries made under the first sync's rules stay (the agent deletes none): a baseline
    flush6(c)
    traffic(c)
    assert tracked6(c) == [], "no IPv6 conntrack hook in node1's netns"
    # an SCTP Service is left to ip6tables: every rule back, IPv6 tracked again
    c.apply(objects(c, sctp=True))
    until("restored", lambda: any("MASQUERADE" in line for line in hook_users(c)))
    assert SCTP_VIP in save(c) and HC_ACCEPT in save(c)
    traffic(c)
    assert tracked6(c) != [], "the rules of a port left to ip6tables track IPv6 again"
    # ... and its going takes them away once no translated flow holds them (none: no NAT here)
    c.apply(objects(c, sctp=False))
    until("withdrawn again", lambda: hook_users(c) == [])
    flush6(c)
    traffic(c)
    assert tracked6(c) == [], "no IPv6 conntrack hook in node1's netns once the rules are withdrawn"


def udp_echo(c: Cluster, size: int) -> int:
    """One datagram of `size` bytes from pod-1-1 to the ClusterIP's UDP echo: the reply's length."""
    script = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n"
        "s.settimeout(3)\n"
        f"s.sendto(b'f' * {size}, ('{VIP}', 53))\n"
        "print(len(s.recvfrom(65535)[0]))\n"
    )
    out = c.lab.run(c.lab.pod("pod-1-1"), sys.executable, "-c", script, check=False)
    return int(out.stdout.strip() or 0)


def test_a_fragmented_ipv6_datagram_reaches_a_cluster_ip_and_back_untracked(lab6: Cluster) -> None:
    """Withdrawn, nf_defrag_ipv6 reassembles nothing for the node: a 4,000-byte UDP datagram over
    IPv6 (fragments both ways on the lab's 1500-byte MTU) through the ClusterIP is the tc path's
    fragment handling alone (bpf/ekp_frag6.h), and comes back whole."""
    c = lab6
    c.apply(objects(c, sctp=False))
    until("withdrawn", lambda: hook_users(c) == [])
    flush6(c)
    assert [udp_echo(c, 4000) for _ in range(3)] == [4000] * 3
    assert tracked6(c) == []


def test_a_long_lived_ipv6_stream_keeps_moving_when_the_rules_come_back(
    lab6: Cluster, tmp_path: Path
) -> None:
    """A pod -> pod IPv6 TCP stream through node1's FORWARD chain, open while the rules go (the SCTP
    Service removed) and come back (added again). Its nf_conntrack entry from before the withdraw
    is kept by the withdraw (deleting entries would hurt the node's own connections where another
    conntrack user keeps the hooks) and is far out of window once the hooks return (the stream moved
    on untracked); Linux 6.18 picks the stream up again and it keeps moving, no INVALID drop. A
    kernel that marked it INVALID would stall it (KUBE-FORWARD's drop): README's IPv6 section says
    so, with its remedy."""
    c = lab6
    progress = tmp_path / "sent"
    c.apply(objects(c, sctp=True))
    until("rules", lambda: any("MASQUERADE" in line for line in hook_users(c)))
    server = c.lab.pod(SERVER).ip6
    stream = c.lab.popen(
        c.lab.pod("pod-1-1"),
        sys.executable,
        "-c",
        STREAM6,
        server,
        str(STREAM_PORT),
        str(progress),
        name="stream6",
    )

    def sent() -> int:
        try:
            return int(progress.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    try:
        until("streaming", lambda: sent() > 0)
        assert any(f"dport={STREAM_PORT}" in line for line in tracked6(c)), "tracked under the rules"
        c.apply(objects(c, sctp=False))
        until("withdrawn", lambda: hook_users(c) == [])
        moved = sent()
        until("64 MB past the withdraw, untracked", lambda: sent() > moved + (64 << 20))
        c.apply(objects(c, sctp=True))
        until("rules back", lambda: any("MASQUERADE" in line for line in hook_users(c)))
        back = sent()
        until("moving with the rules back", lambda: sent() > back + (16 << 20), timeout=15.0)
        assert stream.poll() is None, "the stream's connection failed"
    finally:
        stream.terminate()
        stream.wait(timeout=10)
