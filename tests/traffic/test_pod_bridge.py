"""Pods on a Linux bridge (kubenet's cbr0; kube-proxy's `--detect-local-mode=BridgeInterface` with
`--pod-bridge-interface`): every pod veth of node1 is a port of `cbr0`, which holds the pods'
gateway 10.244.1.1/24, so the node routes its pods' addresses by the bridge rather than by each
veth (issues 19 and 21).

pod -> ClusterIP -> pod across the bridge, in iptables mode and in eBPF mode with each host
routing: served, not masqueraded (the bridge is the detector's, so the traffic is local). With
`--bpf-host-routing=bpf` the program's source check (bpf/ekp_redirect.h) sees the route back to a
pod leave by the bridge, not by the port the packet came in by: on main it dropped every
translated packet from a bridged pod as `spoofed_source`. A forged source is still dropped there.
bpf host routing runs on both attaches (`--bpf-tc-attach`): the port's bridge comes from
ekp_port_v2, which the agent writes for each port, whichever way the program is attached (before
it, cls_bpf's filter classid on clsact, and on tcx a classid program in front of every ingress
program, run on every packet).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from lab import Lab, hooks
from lab.harness import Cluster, ep
from lab.objects import Port, service, with_endpoints
from tests.adversarial.test_host_routing import (
    FORGED,
    SINK,
    UDP_SINK,
    rp_filter_drops,
    send_udp,
    wait_received,
)
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

BRIDGE = "cbr0"
VIP = "10.96.5.1"
DETECTOR = ("--detect-local-mode=BridgeInterface", f"--pod-bridge-interface={BRIDGE}")
# (mode, agent flags): iptables, and eBPF mode with each host routing.
PATHS = {
    "iptables": ("iptables", DETECTOR),
    "legacy": ("ebpf", (*DETECTOR, "--bpf-host-routing=legacy")),
    "bpf": ("ebpf", (*DETECTOR, "--bpf-host-routing=bpf", "--bpf-tc-attach=tcx")),
    "bpf-clsact": ("ebpf", (*DETECTOR, "--bpf-host-routing=bpf", "--bpf-tc-attach=clsact")),
}


@pytest.fixture(scope="module", params=list(PATHS))
def path(request: pytest.FixtureRequest) -> Iterator[tuple[str, Cluster]]:
    require_kernel()
    mode, flags = PATHS[request.param]
    with Lab(nodes=1, pods_per_node=3, pod_bridge=BRIDGE) as lab:
        lab.start_podservers()
        lab.set_sysctl(lab.node(1), "net.ipv4.conf.all.rp_filter", "1")
        cluster = Cluster(lab, mode, extra=flags)
        cluster.start()
        try:
            yield request.param, cluster
        finally:
            failures = cluster.stop()
        assert not failures, f"agent --cleanup failed: {failures}"


def test_the_lab_bridges_the_pods(path: tuple[str, Cluster]) -> None:
    """The premise: the veths are ports of cbr0 and the node routes the pods by cbr0."""
    _, cluster = path
    lab = cluster.lab
    node = lab.node(1)
    for pod in node.pods:
        assert f"master {BRIDGE}" in lab.run(node, "ip", "-o", "link", "show", pod.host_iface).stdout
    assert f"dev {BRIDGE}" in lab.run(node, "ip", "route", "get", lab.pod("pod-1-2").ip).stdout


def test_each_bridge_port_s_ingress_runs_one_program_ours(path: tuple[str, Cluster]) -> None:
    """Every pod port's ingress hook runs exactly one program, ekp_from_pod, with either attach (on
    main, tcx ran a classid program in front of it on every packet, 62-72 ns a run, to give it
    the port's bridge); none in iptables mode."""
    _, cluster = path
    node = cluster.lab.node(1)
    want = ["ekp_from_pod"] if cluster.mode == "ebpf" else []
    got = {pod.host_iface: hooks.hook_programs(node.ns, pod.host_iface) for pod in node.pods}
    assert got == {pod.host_iface: want for pod in node.pods}, got


def test_pod_to_clusterip_to_pod_across_the_bridge(path: tuple[str, Cluster]) -> None:
    """ "should be able to connect to a Service from a pod" with both ends on the bridge: every
    request served by the backend, which sees the client pod's own address (local traffic by
    the bridge: not masqueraded); the other backend on the bridge serves too."""
    name, cluster = path
    lab = cluster.lab
    cluster.apply(
        with_endpoints(
            service("bridged", VIP, [Port("http", 80, 8080)]),
            [ep(cluster, "pod-1-2"), ep(cluster, "pod-1-3")],
        )
    )
    client = lab.pod("pod-1-1")
    before = cluster.bpf_stats().get("drop_spoofed", 0) if cluster.mode == "ebpf" else 0
    got = cluster.http("pod-1-1", f"http://{VIP}/", count=20, timeout=2.0)
    assert not got["errors"] and set(got["bodies"]) == {"pod-1-2", "pod-1-3"}, got
    assert sum(got["bodies"].values()) == 20, got
    assert lab.http_get(client, VIP, 80, "/ip").strip() == client.ip, "local by the bridge: not masqueraded"
    if cluster.mode == "ebpf":
        assert cluster.bpf_stats().get("drop_spoofed", 0) == before, f"{name}: none taken for forged"


def test_a_forged_source_from_a_bridged_pod_never_reaches_the_backend(path: tuple[str, Cluster]) -> None:
    """A UDP datagram from pod-1-1 with the source 10.244.9.9 (routed out of eth0, not by the
    bridge) to a ClusterIP never reaches the backend; one from pod-1-1's own address sent after it
    does. bpf host routing drops and counts it (the bridge passes the check only for sources routed
    by it); legacy host routing leaves it to the node's rp_filter on cbr0. (iptables mode drops it
    too, but not in rp_filter: the node's IPReversePathFilter counter stays, and no forwarding is
    counted; not asserted beyond "never delivered".)"""
    name, cluster = path
    lab = cluster.lab
    assert lab.tmpdir is not None
    log = lab.tmpdir / f"sink-{name}.log"
    sink = lab.popen(lab.pod("pod-1-2"), sys.executable, "-c", SINK, str(log), str(UDP_SINK), name="udp-sink")
    lab.wait_log(sink, "sink ready")
    svc = service("sink", VIP, [Port("udp", UDP_SINK, UDP_SINK, "UDP")])
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-1-2")]))
    client = lab.pod("pod-1-1")
    before = cluster.bpf_stats().get("drop_spoofed", 0) if cluster.mode == "ebpf" else 0
    before_rp = rp_filter_drops(lab)

    send_udp(lab, "pod-1-1", FORGED, VIP, UDP_SINK, b"forged")
    send_udp(lab, "pod-1-1", client.ip, VIP, UDP_SINK, b"genuine")
    lines = wait_received(log, f"{client.ip} genuine")
    assert f"{client.ip} genuine" in lines, f"the genuine datagram must arrive: {lines}"
    assert not [line for line in lines if "forged" in line], f"the forged source reached the backend: {lines}"
    if name.startswith("bpf"):
        assert cluster.bpf_stats()["drop_spoofed"] == before + 1
        assert rp_filter_drops(lab) == before_rp, "dropped by the program, before the stack"
    elif name == "legacy":
        assert rp_filter_drops(lab) == before_rp + 1, "dropped by the node's rp_filter"
    lab.stop(sink)
