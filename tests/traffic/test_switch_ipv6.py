"""A live switch on a dual-stack node keeps its IPv6 connections and rules (README, "IPv6 and
dual-stack"): the IPv6 half of test_switch.py.

Every data path writes kube-proxy's ip6tables layout for IPv6 Services: kube-proxy's iptables
mode, iptables mode, and eBPF mode's ip6tables proxier, which holds only the service ports its
programs leave to the stack (agent/model/tc6_leaves.py: none of this module's; the socket programs
and the tc programs' IPv6 path, under either host routing, serve the rest, and leaving eBPF mode
hands the tc path's flows to nf_conntrack with IPv4's: agent/takeover/out_of_ebpf.py). So a
switch between them hands the IPv6 chains over: the agent that starts adopts them at its first
full sync (eBPF mode's IPv6 proxier finds their backend in ip6tables, kube-proxy's legacy one
here, and thins them), and the IPv6 flows keep their nf_conntrack NAT bindings. Through the switch, three TCP
connections from a pod to an IPv6 ClusterIP and two from the external client to its IPv6 NodePort,
each answering a line every 50 ms: none fails, none changes backend; and one UDP flow (one source
port) from a pod to an IPv6 ClusterIP, a datagram every 50 ms: it keeps its backend, at most one
datagram lost (as IPv4's, test_switch.py; why, at the assertion). After it a new connection
reaches a backend, the IPv6 rules are in the backend the new agent uses, and the old data path's
own state is gone (after a switch to eBPF mode no IPv4 KUBE- chain; to iptables mode no pin).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab import Lab
from lab.harness import CLIENT, Agent, Cluster
from lab.objects import Ep, Port, endpoint_slice, service
from tests.conftest import require_kernel
from tests.traffic.test_switch import Client, Switch, kube_chains, start_client

pytestmark = pytest.mark.kernel

NAMED6 = r"""
import socket, socketserver, sys, threading

class Server(socketserver.ThreadingTCPServer):
    address_family = socket.AF_INET6
    daemon_threads = True
    allow_reuse_address = True

class Named(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(sys.argv[1].encode() + b" " + line)
            self.wfile.flush()

class Echo(socketserver.ThreadingUDPServer):
    address_family = socket.AF_INET6
    allow_reuse_address = True

class Named6Udp(socketserver.DatagramRequestHandler):
    def handle(self):
        self.wfile.write(sys.argv[1].encode() + b" " + self.rfile.read())

server = Server(("::", int(sys.argv[2])), Named)
udp = Echo(("::", int(sys.argv[3])), Named6Udp)
threading.Thread(target=udp.serve_forever, daemon=True).start()
print("ready", flush=True)
server.serve_forever()
"""

PORT, NODE_PORT, UDP_PORT = 7006, 30661, 9006
VIP6, UDP_VIP6 = "fd00:10:96::61", "fd00:10:96::62"
BACKENDS = ("pod-1-2", "pod-1-3")

SWITCHES = {
    "kube-proxy-iptables-to-ebpf": Switch("iptables", "ebpf", ("--iptables-backend=legacy",)),
    "iptables-to-ebpf": Switch("iptables", "ebpf", ("--iptables-backend=nft",)),
    "ebpf-to-iptables": Switch("ebpf", "iptables"),
    "ebpf-bpf-host-routing-to-iptables": Switch("ebpf", "iptables", ("--bpf-host-routing=bpf",)),
    "iptables-to-ebpf-bpf-host-routing": Switch(
        "iptables", "ebpf", ("--iptables-backend=nft",), ("--bpf-host-routing=bpf",)
    ),
}
# The chart's way from kube-proxy: its init container runs `agent --cleanup-kube-proxy` before the
# agent starts, which removes kube-proxy's IPv4 chains (both backends) and leaves the IPv6 ones
# serving: eBPF mode's IPv6 proxier must find their backend in ip6tables, not in the emptied iptables.
# Without localhost NodePorts kube-proxy leaves no KUBE-FIREWALL (kubelet's chain, which the
# cleanup keeps) behind: nothing at all in iptables-legacy to point at the backend.
CLEANED = {
    "kube-proxy-iptables-cleaned-up-to-ebpf": Switch(
        "iptables", "ebpf", ("--iptables-backend=legacy", "--iptables-localhost-nodeports=false")
    )
}


@pytest.fixture
def lab() -> Iterator[Lab]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=3, ipv6=True) as built:
        for name in BACKENDS:
            proc = built.popen(
                built.pod(name), sys.executable, "-c", NAMED6, name, str(PORT), str(UDP_PORT), name="named6"
            )
            built.wait_log(proc, "ready")
        yield built


def objects(lab: Lab) -> list[dict[str, Any]]:
    port = Port("echo", PORT, PORT, node_port=NODE_PORT)
    svc = service("echo6", VIP6, [port], type="NodePort", ipFamilies=["IPv6"])
    eps = endpoint_slice("echo6", [port], [Ep(lab.pod(p).ip6, "node1") for p in BACKENDS], suffix="v6")
    eps["addressType"] = "IPv6"
    udp_port = Port("udp", UDP_PORT, UDP_PORT, "UDP")
    udp = service("udp6", UDP_VIP6, [udp_port], ipFamilies=["IPv6"])
    udp_eps = endpoint_slice("udp6", [udp_port], [Ep(lab.pod(p).ip6, "node1") for p in BACKENDS], suffix="v6")
    udp_eps["addressType"] = "IPv6"
    return [svc, eps, udp, udp_eps]


def start_traffic(lab: Lab) -> list[Client]:
    named = ["named", "--port", str(PORT), "--interval", "0.05", "--addr", VIP6]
    clients = [start_client(lab, "pod-1-1", f"clusterip6-{i}", *named) for i in range(3)]
    nodeport = ["named", "--port", str(NODE_PORT), "--interval", "0.05", "--addr", lab.nodes[0].ip6]
    clients += [start_client(lab, "client", f"nodeport6-{i}", *nodeport) for i in range(2)]
    udpflow = ["udpflow", "--addr", UDP_VIP6, "--port", str(UDP_PORT)]
    return [*clients, start_client(lab, "pod-1-1", "udpflow6", *udpflow)]


def one_connection(lab: Lab) -> dict[str, Any]:
    """A new connection to the IPv6 ClusterIP from a pod, a few lines long."""
    out = lab.run(
        "pod-1-1",
        sys.executable,
        CLIENT,
        "named",
        *("--addr", VIP6, "--port", str(PORT), "--interval", "0.05"),
        *("--stop-file", "/nonexistent", "--max-s", "0.3"),
    ).stdout
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.mark.parametrize("switch", [*SWITCHES.values(), *CLEANED.values()], ids=[*SWITCHES, *CLEANED])
def test_a_live_switch_keeps_every_ipv6_connection_and_the_ipv6_rules(lab: Lab, switch: Switch) -> None:
    cluster = Cluster(lab, switch.before, extra=switch.before_flags)
    first = cluster.agents[0]
    second = Agent(lab, first.node, switch.after, first.source, switch.after_flags)
    second.log_path = first.log_path.with_name(f"agent-{switch.after}-{first.node.name}.log")
    cluster.start()
    cluster.apply(objects(lab))
    clients = start_traffic(lab)
    results: dict[str, dict[str, Any]] = {}
    try:
        time.sleep(2)  # every client exchanging under the first data path
        first.stop()  # as the chart stops a pod: rules, or programs and pins, stay
        cluster.agents = [second]
        if switch in CLEANED.values():
            cleanup = second.cleanup("--cleanup-kube-proxy")
            assert cleanup.returncode == 0, cleanup.stderr
            assert kube_chains(cluster) == [], "kube-proxy's IPv4 chains are gone before the agent starts"
        second.start()
        second.wait_version(cluster.version)
        time.sleep(3)  # every client exchanging under the second data path
    finally:
        results = {c.name: c.finish() for c in clients}
    try:
        log = second.log_since_start()
        flow = results.pop("udpflow6")
        for name, r in results.items():
            assert r["errors"] == 0 and r["exchanges"] > 60, (name, r, log[-3000:])
            assert len(r["backends"]) == 1 and r["backends"][0] in BACKENDS, (name, r)
        # One source port, one flow: it keeps its backend (into eBPF mode: carried from
        # nf_conntrack into ekp_ct6_any within the first IPv6 sync, before its frontends,
        # agent/takeover/into_ebpf.py `_carry6`). At most one datagram lost, as IPv4's UDP flow
        # (test_switch.py): the client never retransmits, and into eBPF mode under legacy host
        # routing the flow's NAT entry is replaced by the plain one without IPv4's NFPASS hold
        # (`_to_stack6`), so the one datagram tc translated before its flow's turn may lose its
        # reply: the NAT entry's null binding gives it another source port, and the reply reaches
        # the client from the backend's own address (a stranger: this unconnected socket takes it,
        # a connected one would not, so it counts as that datagram's loss). Out of eBPF mode no
        # stranger: the flow is held while its NAT entry replaces the plain one and then passed
        # to it (NFPASS, bpf/ekp_tc6.h), as IPv4's (agent/takeover/out_of_ebpf.py `StackHolds`);
        # before, each datagram tc translated between that write and the detach got one (1 or 2
        # a run of ebpf-to-iptables).
        assert len(flow["backends"]) == 1 and flow["backends"][0] in BACKENDS, (flow, log[-3000:])
        handback = [line for line in log.splitlines() if "took over" in line]
        assert switch.after == "ebpf" or flow["strangers"] == 0, f"{flow} {handback}"
        missed = flow["lost"] + flow["strangers"]
        assert flow["sent"] > 60 and missed <= 1, (flow, log[-3000:])
        print(
            f"\n{switch.before} -> {switch.after}: IPv6 UDP flow {flow['sent']} sent, {flow['lost']} lost"
            f" {flow['lost_at']}, {flow['strangers']} replies from another address {flow['strangers_at']};"
            f" {' '.join(handback)}"
        )
        fresh = one_connection(lab)
        assert fresh["errors"] == 0 and fresh["exchanges"] > 0 and fresh["backends"][0] in BACKENDS, fresh
        node = lab.nodes[0]
        legacy = "--iptables-backend=legacy" in switch.before_flags
        backend = "legacy" if legacy else "nft"
        v6_rules = lab.run(node, f"ip6tables-{backend}-save", "-t", "nat").stdout
        # eBPF mode's ip6tables holds only what its programs leave to the stack (none of these
        # Services: agent/model/tc6_leaves.py), and its masquerade; iptables mode every Service
        assert (f"-d {VIP6}/128" in v6_rules) is (switch.after != "ebpf"), v6_rules
        assert "-j KUBE-POSTROUTING" in v6_rules, v6_rules
        other = lab.run(node, f"ip6tables-{'nft' if legacy else 'legacy'}-save", check=False).stdout
        assert "KUBE-" not in other, f"the IPv6 rules are in one backend only:\n{other}"
        if switch.after == "ebpf":
            assert f"ip6tables-{backend}" in log, log[-3000:]
            assert "ip6tables rules (kube-proxy's iptables layout) serve every other IPv6 packet" in log, log[
                -3000:
            ]
            assert kube_chains(cluster) == [], "the IPv4 chains are removed once eBPF serves"
            # The UDP flow was carried from nf_conntrack: an uncarried one keeps its backend by
            # chance half the time (tc decides it as a new flow), which the checks above miss.
            carried6 = (
                r"took over IPv6 UDP flows from nf_conntrack \([^)]*\): 1 carried into the tc IPv6 path's"
            )
            assert re.search(carried6, log), log[-3000:]
        else:
            assert "took over from eBPF mode" in log, log[-3000:]
            assert not Path(first.pin_path).exists(), "the eBPF pins are removed"
            if "--bpf-host-routing=bpf" in switch.before_flags:
                # no IPv4 flow here: what was handed back is the tc IPv6 path's (the NodePort's)
                handed = re.search(r"took over from eBPF mode: (\d+) established flows", log)
                assert handed and int(handed.group(1)) >= 2, log[-3000:]
    finally:
        second.stop()
        cluster.agents = [second, first]
        failures = cluster.stop()
    assert failures == []
