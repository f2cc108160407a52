"""Clients on the node itself: host-network pods and the node's own processes, as kube-proxy's OUTPUT
chain serves them (eBPF mode: the socket programs, bpf/ekp_sock.h), in both modes.

"The node" is a process in the node's network namespace and in the node's own cgroup (Node.cgroup,
where a node's system services run); "a host-network pod" one in the node's namespace and in a pod's
cgroup under the node's (Node.hostnet_cgroup, where the kubelet puts a hostNetwork pod). The lab's
agents attach their socket programs to each node's cgroup (lab/harness.py), never the machine's.
Upstream's node-sourced tests (`DialFromNode`, hostNetwork exec pods) map here; the rest of the
suite adds node dials to the tests it already had (tests/upstream_e2e.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lab.core import Node
from lab.harness import CLIENT, Agent, Cluster, ep
from lab.objects import Ep, Port, service, with_endpoints

pytestmark = pytest.mark.kernel

N1, N2 = "192.168.0.11", "192.168.0.12"
HTTP = Port("http", 80, 8080, node_port=30750)
ECHO = Port("udp", 90, 9000, "UDP", node_port=30751)
WEB = "10.96.50.1"
DNS_VIP = "10.96.50.53"
DNS_PORTS = [Port("dns", 53, 53, "UDP", node_port=30753), Port("dns-tcp", 53, 53, "TCP", node_port=30753)]


def web(cluster: Cluster, *backends: str) -> None:
    svc = service("node-clients", WEB, [HTTP, ECHO], type="NodePort")
    cluster.apply(with_endpoints(svc, [ep(cluster, b) for b in backends]))


@dataclass(frozen=True)
class Where:
    """A client on node1: `cgroup` None is the node's own cgroup."""

    label: str
    cgroup: str | None


def clients(cluster: Cluster) -> list[Where]:
    node = cluster.lab.node(1)
    return [Where("node1", None), Where("host-network pod on node1", node.hostnet_cgroup)]


def run(cluster: Cluster, where: Where, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return cluster.lab.run("node1", *argv, cgroup=where.cgroup if where.cgroup else True, check=check)


def client(cluster: Cluster, where: Where, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(run(cluster, where, sys.executable, CLIENT, *args).stdout)
    return out


# Requests per check that every endpoint must answer. Each is a new flow (a new socket and source
# port) balanced on its own, so all of them land on one of two endpoints by chance with probability
# 2^(1 - SAMPLES). At 16 that was 3e-5 per check, 7e-4 per suite run over this test's 24 checks, and
# it happened once (iptables mode: 16 UDP requests from 16 new sockets, all answered by pod-2-3,
# none lost). At 32 it is 5e-10 per check.
SAMPLES = 32


def udp_failure(cluster: Cluster, where: Where, addr: str, port: int, udp: dict[str, Any]) -> str:
    """What a failed UDP check saw: each request's source port and who answered it, and each node's
    nf_conntrack UDP entries to `port` (which entry each flow met, where it was sent). A string:
    pytest cuts any other message to 240 characters."""
    flows = ", ".join(f"{sport}:{who}" for sport, who in udp["flows"])
    lines = [
        f"{where.label} -> {addr}:{port}: replies {udp['replies']}, lost {udp['lost']}",
        f"source port:answered by: {flows}",
    ]
    for node in cluster.lab.nodes:
        listed = cluster.lab.run(
            node, "conntrack", "-L", "-p", "udp", "--orig-port-dst", str(port), check=False
        ).stdout
        lines += [f"{node.name}'s conntrack entries to UDP port {port}:", *listed.splitlines()]
    return "\n".join(lines)


def test_node_service_http_and_udp_from_the_node_and_a_host_network_pod(cluster: Cluster) -> None:
    """ "should function for node-Service: http" and "...: udp" (networking.go, `DialFromNode`): from
    the node and from a host-network pod, curl and a UDP client reach the ClusterIP and the NodePorts
    on this node's and the other node's address, every endpoint of both nodes answering."""
    web(cluster, "pod-1-2", "pod-2-3")
    both = {"pod-1-2", "pod-2-3"}
    n = str(SAMPLES)
    for where in clients(cluster):
        for addr, port, uport in (
            (WEB, 80, 90),
            (N1, HTTP.node_port, ECHO.node_port),
            (N2, HTTP.node_port, 30751),
        ):
            url = f"http://{addr}:{port}/"
            body = run(cluster, where, "curl", "-sS", "--fail", "--max-time", "5", url).stdout.strip()
            assert body in both, (where.label, url, body)
            result = client(cluster, where, "http", "--url", url, "--count", n)
            assert result["errors"] == 0 and set(result["bodies"]) == both, (where.label, url, result)
            udp = client(cluster, where, "udp", "--addr", addr, "--port", str(uport), "--count", n, "--flows")
            ok = udp["lost"] == 0 and set(udp["replies"]) == both
            assert ok, udp_failure(cluster, where, addr, uport, udp)


def test_dig_from_the_node_to_a_dns_cluster_ip_and_node_ports(cluster: Cluster) -> None:
    """A node's resolver pointed at the cluster DNS Service (the kubelet's, a node-local cache's),
    over UDP and TCP, through the ClusterIP and the NodePort on both nodes' addresses."""
    cluster.apply(
        with_endpoints(service("node-dns", DNS_VIP, DNS_PORTS, type="NodePort"), [ep(cluster, "pod-2-2")])
    )
    for where in clients(cluster):
        for server, port in ((DNS_VIP, 53), (N1, 30753), (N2, 30753)):
            for tcp in ("+notcp", "+tcp"):
                argv = [
                    "dig",
                    f"@{server}",
                    "-p",
                    str(port),
                    "whoami.lab",
                    "TXT",
                    "+short",
                    "+time=2",
                    "+tries=1",
                ]
                out = run(cluster, where, *argv, tcp).stdout.strip()
                assert out == '"pod-2-2"', (where.label, server, port, tcp, out)


def test_a_udp_client_on_the_node_sees_replies_from_the_cluster_ip(cluster: Cluster) -> None:
    """An unconnected UDP socket of the node sends to the ClusterIP and recvfrom() names the ClusterIP
    as the reply's source (kube-proxy: conntrack's reverse NAT; eBPF mode: recvmsg4), so a client that
    checks where the answer came from (a resolver does) takes it."""
    web(cluster, "pod-1-2", "pod-2-3")
    for where in clients(cluster):
        out = client(cluster, where, "udp", "--addr", WEB, "--port", "90", "--count", "8", "--sources")
        assert out["sources"] == {f"{WEB}:90": 8} and out["lost"] == 0, (where.label, out)


def test_getpeername_on_the_node_shows_the_cluster_ip(cluster: Cluster) -> None:
    """A TCP connection of the node to the ClusterIP: getpeername() reports the ClusterIP and port the
    application dialled (kube-proxy translates packets, not the socket; eBPF mode: getpeername4)."""
    web(cluster, "pod-1-2", "pod-2-3")
    for where in clients(cluster):
        bodies = set()
        for _ in range(6):
            out = client(cluster, where, "peer", "--addr", WEB, "--port", "80")
            assert out["peer"] == f"{WEB}:80", (where.label, out)
            bodies.add(out["body"])
        assert bodies <= {"pod-1-2", "pod-2-3"} and bodies, bodies


def restart(agent: Agent, extra: list[str], version: str) -> None:
    agent.stop()
    agent.extra = extra
    agent.start()
    agent.wait_version(version)


@pytest.fixture
def node1_agent(cluster: Cluster) -> Iterator[Agent]:
    """node1's agent, started again with its own flags after the test (which restarts it with others)."""
    agent = cluster.agents[0]
    flags = list(agent.extra)
    yield agent
    restart(agent, flags, cluster.version)


def test_localhost_node_ports_answer_as_kube_proxys_configuration_says(
    cluster: Cluster, node1_agent: Agent
) -> None:
    """`localhost:<nodePort>` from the node: answered with kube-proxy's defaults
    (--iptables-localhost-nodeports=true, every node address); refused with it false, and with
    --nodeport-addresses not holding 127.0.0.1; answered with --nodeport-addresses=127.0.0.0/8, where
    the node's own address then is no NodePort (nothing listens there: refused)."""
    web(cluster, "pod-1-2")
    node = Where("node1", None)

    def probe(addr: str) -> str:
        out = client(cluster, node, "peer", "--addr", addr, "--port", str(HTTP.node_port), "--timeout", "2")
        return str(out.get("body") or out["error"])

    assert probe("127.0.0.1") == "pod-1-2"
    base = list(node1_agent.extra)
    for flags, localhost, own in (
        (["--iptables-localhost-nodeports=false"], "ECONNREFUSED", "pod-1-2"),
        (["--nodeport-addresses=192.168.0.0/24"], "ECONNREFUSED", "pod-1-2"),
        (["--nodeport-addresses=127.0.0.0/8"], "pod-1-2", "ECONNREFUSED"),
    ):
        restart(node1_agent, base + flags, cluster.version)
        assert (probe("127.0.0.1"), probe(N1)) == (localhost, own), flags


def test_internal_traffic_policy_local_host_network_pod_to_pod(cluster: Cluster) -> None:
    """ "should respect internalTrafficPolicy=Local Pod (hostNetwork: true) to Pod": a host-network
    client on the endpoint's node reaches it through the ClusterIP; one on the other node gets no
    answer (kube-proxy drops, "has no local endpoints"; eBPF mode refuses the connect() at once)."""
    svc = service("itp-hostnet", "10.96.50.18", [Port("http", 80, 8080)], internalTrafficPolicy="Local")
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-1-4")]))
    node1, node2 = cluster.lab.node(1), cluster.lab.node(2)
    for node in (node1, node2):
        assert node.hostnet_cgroup is not None
    here = json.loads(
        cluster.lab.run(
            node1,
            sys.executable,
            CLIENT,
            "http",
            "--url",
            "http://10.96.50.18/",
            "--count",
            "5",
            cgroup=node1.hostnet_cgroup,
        ).stdout
    )
    assert here["errors"] == 0 and here["bodies"] == {"pod-1-4": 5}, here
    there = json.loads(
        cluster.lab.run(
            node2,
            sys.executable,
            CLIENT,
            "http",
            "--url",
            "http://10.96.50.18/",
            "--count",
            "2",
            "--timeout",
            "1",
            cgroup=node2.hostnet_cgroup,
        ).stdout
    )
    assert there["errors"] == 2 and not there["bodies"], there


def _dig_loop(cluster: Cluster, target: Node | str, stop: Path, out: Path) -> subprocess.Popen[bytes]:
    """dig in a loop until `stop` exists, one line per lookup: its answer, or `fail`."""
    script = (
        f'while [ ! -e "{stop}" ]; do '
        f"a=$(dig @{DNS_VIP} whoami.lab TXT +short +time=1 +tries=1 2>/dev/null | head -1); "
        'case "$a" in \\"*) echo "$a";; *) echo fail;; esac; sleep 0.05; done'
    )
    with open(out, "wb") as f:
        return cluster.lab.popen(target, "/bin/sh", "-c", script, name="dig-loop", stdout=f)


def _longest_failure_run(lines: list[str]) -> int:
    run = longest = 0
    for line in lines:
        run = run + 1 if line == "fail" else 0
        longest = max(longest, run)
    return longest


def test_dns_keeps_answering_from_the_node_and_a_pod_while_its_only_pod_is_replaced(cluster: Cluster) -> None:
    """The cluster DNS Service's only pod is replaced (the new one ready first, then the old one gone)
    while the node and a pod keep resolving: dig in a loop (a new socket per lookup) and a long-lived
    resolver on one connected UDP socket (lab/client.py resolver), on the node and in a pod. No lookup
    fails for longer than one resolver retry (one 1 s timeout, or an error and an immediate retry).
    kube-proxy clears the old endpoint's UDP conntrack entries; eBPF mode moves the pod's flow off it
    (membership) and ends the node's connected socket (the UDP socket iterator), whose resolver then
    opens a new one."""
    lab = cluster.lab
    assert lab.tmpdir is not None
    old = lab.add_pod(2)
    lab.start_dns(old)
    dns = service("replaced-dns", DNS_VIP, [Port("dns", 53, 53, "UDP"), Port("dns-tcp", 53, 53, "TCP")])
    cluster.apply(with_endpoints(dns, [Ep(old.ip, "node2")]))
    stop = lab.tmpdir / "dns-replace-stop"
    stop.unlink(missing_ok=True)
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    new = None
    try:
        for where in ("node1", "pod-1-1"):
            ready, out = lab.tmpdir / f"resolver-{where}.ready", lab.tmpdir / f"resolver-{where}.json"
            ready.unlink(missing_ok=True)
            with open(out, "wb") as f:
                proc = lab.popen(
                    where,
                    sys.executable,
                    CLIENT,
                    "resolver",
                    "--dns",
                    "--addr",
                    DNS_VIP,
                    "--port",
                    "53",
                    "--stop-file",
                    str(stop),
                    "--ready-file",
                    str(ready),
                    "--interval",
                    "0.05",
                    "--timeout",
                    "1",
                    "--max-s",
                    "120",
                    name=f"resolver-{where}",
                    stdout=f,
                )
            procs[f"resolver {where}"] = (proc, out)
            deadline = time.monotonic() + 10
            while not ready.exists():
                assert proc.poll() is None and time.monotonic() < deadline, (
                    f"resolver in {where} got no answer"
                )
                time.sleep(0.05)
            loop_out = lab.tmpdir / f"dig-{where}.txt"
            procs[f"dig {where}"] = (_dig_loop(cluster, where, stop, loop_out), loop_out)
        time.sleep(1)
        new = lab.add_pod(2)
        lab.start_dns(new)
        cluster.apply(with_endpoints(dns, [Ep(old.ip, "node2"), Ep(new.ip, "node2")]))  # surge
        time.sleep(1)
        cluster.apply(with_endpoints(dns, [Ep(new.ip, "node2")]))  # the old pod leaves the Service
        lab.remove_pod(old)
        time.sleep(3)
    finally:
        stop.touch()
        for proc, _ in procs.values():
            proc.wait(timeout=30)
    assert new is not None
    if cluster.mode == "ebpf":
        # the node's connected socket was ended by the iterator (the pod's flow moved by membership)
        assert cluster.bpf_stats(1)["sock_destroyed"] >= 1
    for what, (_, out) in procs.items():
        if what.startswith("resolver"):
            result = json.loads(out.read_text())
            assert result["answers"].get(new.name), (what, result)  # it moved to the new pod
            assert set(result["answers"]) <= {old.name, new.name}, (what, result)
            assert result["longest_gap"] < 2.0, (what, result)  # at most one retry's wait
        else:
            lines = out.read_text().split()
            assert lines and lines[-1] == f'"{new.name}"', (what, lines[-5:])
            assert _longest_failure_run(lines) <= 1, (what, lines)


def crafted_syn(cluster: Cluster, dst: str, dport: int, sport: int) -> str:
    """A TCP SYN from the external client to `dst`:`dport`, sent as a frame to node1's eth0 whatever
    the destination (a neighbour can address anything to a node); what comes back: "syn-ack",
    "reset" or "none" within 2 s."""
    import socket

    from lab.packets import parse, tcp

    lab = cluster.lab
    node_mac = json.loads(lab.run("node1", "ip", "-j", "link", "show", "eth0").stdout)[0]["address"]
    client_mac = json.loads(lab.run("client", "ip", "-j", "link", "show", "eth0").stdout)[0]["address"]
    frame = tcp(lab.client.ip, dst, sport, dport, smac=client_mac, dmac=node_mac)

    def probe() -> str:
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800)) as s:
            s.bind(("eth0", 0))
            s.settimeout(0.2)
            s.send(frame)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                try:
                    data = s.recv(65535)
                except TimeoutError:
                    continue
                if len(data) < 34 or data[23] != 6:  # IPv4, TCP
                    continue
                p = parse(data)
                if (p.sport, p.dport) == (dport, sport) and p.dst == lab.client.ip:
                    return (
                        "syn-ack"
                        if "S" in p.flags and "A" in p.flags
                        else "reset"
                        if "R" in p.flags
                        else p.flags
                    )
        return "none"

    return lab.in_netns("client", probe)


def test_localhost_bound_services_stay_out_of_reach_of_other_hosts_cve_2020_8558(cluster: Cluster) -> None:
    """CVE-2020-8558: a neighbour sends a SYN to 127.0.0.1 through node1's eth0, aimed at a service
    bound to the node's localhost (the agent's own metrics port, 127.0.0.1:10249): no answer, in
    both modes (iptables mode: kube-proxy's "block incoming localnet connections" drop, as it sets
    route_localnet for localhost NodePorts; eBPF mode: route_localnet stays 0 and nothing is
    translated for 127.0.0.1 from outside). The positive control: the same crafted SYN to the
    node's address and a NodePort is answered."""
    web(cluster, "pod-1-2")
    assert crafted_syn(cluster, N1, HTTP.node_port, 41001) == "syn-ack"
    served_locally = client(
        cluster, Where("node1", None), "http", "--url", "http://127.0.0.1:10249/proxyMode"
    )
    assert served_locally["errors"] == 0, served_locally  # the target listens, on the node's localhost
    assert crafted_syn(cluster, "127.0.0.1", 10249, 41002) == "none"


def test_an_ipv6_socket_on_the_node_reaches_a_cluster_ip_as_a_v4_mapped_address(cluster: Cluster) -> None:
    """Java (by default) and other dual-stack runtimes dial an IPv4 address from an IPv6 socket, as
    ::ffff:a.b.c.d: the node's TCP and UDP reach the ClusterIP that way, and getpeername() and
    recvfrom() name it (kube-proxy: the packets are IPv4, translated as any; eBPF mode: the socket
    programs' IPv6 hooks)."""
    web(cluster, "pod-1-2", "pod-2-3")
    code = (
        "import json, socket\n"
        "out = []\n"
        "for _ in range(4):\n"
        "    t = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); t.settimeout(3)\n"
        f"    t.connect(('::ffff:{WEB}', 80)); peer = t.getpeername()[:2]\n"
        "    t.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); body = b''\n"
        "    while (c := t.recv(4096)): body += c\n"
        "    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.settimeout(3)\n"
        f"    u.sendto(b'x', ('::ffff:{WEB}', 90)); data, src = u.recvfrom(100)\n"
        "    out.append([list(peer), body.split(b'\\r\\n\\r\\n')[1].decode().strip(), list(src[:2]),"
        " data.decode().split()[0]])\n"
        "print(json.dumps(out))\n"
    )
    for where in clients(cluster):
        for peer, body, src, echoed in json.loads(run(cluster, where, sys.executable, "-c", code).stdout):
            assert peer == [f"::ffff:{WEB}", 80] and src == [f"::ffff:{WEB}", 90], where.label
            assert {body, echoed} <= {"pod-1-2", "pod-2-3"}, (where.label, body, echoed)
