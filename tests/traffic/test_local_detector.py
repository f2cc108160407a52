"""kube-proxy's local-traffic detector (`--detect-local-mode`) on running agents, both modes: which
traffic to a cluster IP is masqueraded, and which pod traffic to an externalTrafficPolicy Local
NodePort short-circuits to every endpoint, decided by the device a packet entered on
(InterfaceNamePrefix) or by the Node's spec.podCIDRs (NodeCIDR), checked by the source address a
backend sees (its `/ip` answer).

Each test runs its own agents (flags differ) against a fake API server in one two-node lab per
mode. The lab's pod devices are `lxc-p<j>` (pod-1-1 behind lxc-p1, pod-1-2 behind lxc-p2, ...).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from lab import Lab
from lab.apicluster import ApiCluster
from lab.fakeapi.objects import node as node_object
from lab.harness import ep, started
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

HTTP = Port("http", 80, 8080)
N1 = "192.168.0.11"
VIP = "10.96.7.1"


@pytest.fixture(scope="module", params=["ebpf", "iptables"])
def lab_mode(request: pytest.FixtureRequest) -> Iterator[tuple[Lab, str]]:
    require_kernel()
    with Lab(nodes=2, pods_per_node=3) as lab:
        lab.start_podservers()
        lab.add_client_route("10.96.0.0/16", via_node=1)
        yield lab, request.param


@contextmanager
def agents(lab: Lab, mode: str, *flags: str) -> Iterator[ApiCluster]:
    api = ApiCluster(lab, mode, extra=flags)
    with started(api):
        yield api


def set_pod_cidr(api: ApiCluster, cidr: str) -> None:
    """Give node1's Node another spec.podCIDR(s), and wait for node1's agent (node2's agent
    watches only its own Node)."""
    written = api.server.apply(node_object("node1", N1, pod_cidr=cidr))
    api.agents[0].wait_resource_versions({"Node": int(written["metadata"]["resourceVersion"])})


def seen_as(api: ApiCluster, source: str, url: str, count: int = 4) -> set[str]:
    """The source addresses the backend saw for `count` new connections, every one answered."""
    result: dict[str, Any] = api.http(source, url, count=count)
    assert result["errors"] == 0, (source, url, result)
    return set(result["bodies"])


def test_detect_local_mode_interface_name_prefix_masquerades_by_the_device(lab_mode: tuple[Lab, str]) -> None:
    """InterfaceNamePrefix `lxc-p1`: pod-1-1 (lxc-p1) is local, pod-1-2 (lxc-p2) is not. Its traffic
    to a cluster IP is masqueraded (`! -i lxc-p1+ -j KUBE-MARK-MASQ`; eBPF: lxc-p2 carries
    ekp_from_net), pod-1-1's is not; an ETP Local NodePort whose only endpoint is on node2
    answers pod-1-1 (`-i lxc-p1+ -j KUBE-SVC-*`) and drops pod-1-2's connection (no local
    endpoint)."""
    lab, mode = lab_mode
    with agents(
        lab, mode, "--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix=lxc-p1"
    ) as api:
        web = service("web", VIP, [HTTP])
        local = service(
            "etp-local",
            "10.96.7.2",
            [Port("http", 80, 8080, node_port=30771)],
            type="NodePort",
            externalTrafficPolicy="Local",
        )
        api.apply([*with_endpoints(web, [ep(api, "pod-2-1")]), *with_endpoints(local, [ep(api, "pod-2-2")])])
        pod11 = lab.pod("pod-1-1").ip
        assert seen_as(api, "pod-1-1", f"http://{VIP}/ip") == {pod11}
        assert seen_as(api, "pod-1-2", f"http://{VIP}/ip") == {N1}, "a device outside the prefix: masqueraded"
        assert seen_as(api, "pod-1-1", f"http://{N1}:30771/ip") == {pod11}
        dropped = api.http("pod-1-2", f"http://{N1}:30771/ip", count=1, timeout=1.0)
        assert dropped["errors"] == 1 and not dropped["bodies"], dropped


def test_detect_local_mode_node_cidr_masquerades_by_the_nodes_pod_cidr(lab_mode: tuple[Lab, str]) -> None:
    """NodeCIDR: the detector is the Node's spec.podCIDRs, followed at run time. With node1's podCIDR
    10.244.1.0/30, pod-1-1 (10.244.1.2) is local and pod-1-3 (10.244.1.4) is not: its traffic to
    a cluster IP is masqueraded, though it sits behind a pod device like pod-1-1 and inside
    --cluster-cidr (so ClusterCIDR would not). The external client is masqueraded too. Once the
    Node's podCIDR is 10.244.1.0/24, pod-1-3 is local and keeps its address."""
    lab, mode = lab_mode
    with agents(lab, mode, "--detect-local-mode=NodeCIDR") as api:
        set_pod_cidr(api, "10.244.1.0/30")
        web = service("web", VIP, [HTTP])
        api.apply(with_endpoints(web, [ep(api, "pod-2-1")]))
        pod11, pod13 = lab.pod("pod-1-1").ip, lab.pod("pod-1-3").ip
        assert seen_as(api, "pod-1-1", f"http://{VIP}/ip") == {pod11}
        assert seen_as(api, "pod-1-3", f"http://{VIP}/ip") == {N1}, "outside the Node's podCIDR: masqueraded"
        assert seen_as(api, "client", f"http://{VIP}/ip") == {N1}
        set_pod_cidr(api, "10.244.1.0/24")
        assert seen_as(api, "pod-1-3", f"http://{VIP}/ip") == {pod13}, "inside it now: not masqueraded"
        assert seen_as(api, "client", f"http://{VIP}/ip") == {N1}


def test_no_local_detector_the_node_reaches_every_endpoint_of_an_etp_local_node_port(
    lab_mode: tuple[Lab, str],
) -> None:
    """No detector (ClusterCIDR mode with no cluster CIDR: kube-proxy writes no IfLocal rule): a pod
    on node1 is held to the node's own endpoints of an externalTrafficPolicy Local NodePort
    (KUBE-EXT-* falls through to KUBE-SVL-*: none here, dropped), while node1 itself and a
    host-network pod reach every endpoint, since KUBE-EXT-* sends `--src-type LOCAL` traffic to
    KUBE-SVC-* (masqueraded) whatever the detector (proxier.go: "route LOCAL traffic for ...
    external destinations"). eBPF mode: the node's own sockets take the frontend of scope HOST."""
    lab, mode = lab_mode
    node1 = lab.node(1)
    with agents(lab, mode, "--cluster-cidr=") as api:
        local = service(
            "etp-local-nodet",
            "10.96.7.3",
            [Port("http", 80, 8080, node_port=30772)],
            type="NodePort",
            externalTrafficPolicy="Local",
        )
        api.apply(with_endpoints(local, [ep(api, "pod-2-2")]))
        url = f"http://{N1}:30772/ip"
        for cgroup in (node1.cgroup, node1.hostnet_cgroup):
            res = lab.run(node1, "curl", "-sS", "--fail", "--max-time", "5", url, cgroup=cgroup, check=False)
            assert res.returncode == 0 and res.stdout.strip() == N1, (
                cgroup,
                res.returncode,
                res.stdout,
                res.stderr,
            )
        dropped = api.http("pod-1-1", url, count=1, timeout=1.0)
        assert dropped["errors"] == 1 and not dropped["bodies"], dropped
