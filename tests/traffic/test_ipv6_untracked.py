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

import pytest

from lab import Lab
from lab.harness import Cluster
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


@pytest.fixture(scope="module")
def lab6() -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=2, ipv6=True) as lab:
        proc = lab.popen(
            lab.pod(SERVER), sys.executable, "-c", SERVER6, SERVER, str(HTTP6_PORT), name="http6"
        )
        lab.wait_log(proc, "ready")
        c = Cluster(lab, "ebpf", extra=["--bpf-host-routing=bpf"])
        c.start()
        try:
            yield c
        finally:
            failures = c.stop()
        assert not failures, f"agent --cleanup failed: {failures}"


def objects(c: Cluster, *, sctp: bool) -> list[Obj]:
    """A ClusterIP and an ETP Local LoadBalancer (its healthCheckNodePort) on the server pod; with
    `sctp`, an SCTP ClusterIP too, which the socket programs leave to ip6tables."""
    ep = [Ep(c.lab.pod(SERVER).ip6, "node1")]
    http = Port("http", 80, HTTP6_PORT)
    lport = Port("http", 80, HTTP6_PORT, node_port=30123)
    out: list[Obj] = [
        service("untracked", VIP, [http], ipFamilies=["IPv6"]),
        endpoint_slice("untracked", [http], ep, "v6"),
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


def traffic(c: Cluster) -> None:
    """A pod's IPv6 connections to the server pod's IP and to the ClusterIP (tc's)."""
    client, server = c.lab.pod("pod-1-1"), c.lab.pod(SERVER)
    for _ in range(3):
        assert fetch(c, client, f"http://[{server.ip6}]:{HTTP6_PORT}/") == SERVER
        assert fetch(c, client, f"http://[{VIP}]:80/") == SERVER


def test_no_ipv6_packet_is_tracked_while_the_ebpf_programs_leave_ip6tables_nothing(lab6: Cluster) -> None:
    c = lab6
    node = c.lab.node(1)
    c.apply(objects(c, sctp=False))
    # the grant comes at a sync, the rules go at the next IPv6 one
    until("withdrawn", lambda: hook_users(c) == [])
    assert HC_ACCEPT in save(c), "the healthCheckNodePort's ACCEPT stays"
    c.lab.run(node, "conntrack", "-F", "-f", "ipv6", check=False)
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
    c.lab.run(node, "conntrack", "-F", "-f", "ipv6", check=False)
    traffic(c)
    assert tracked6(c) == []
