"""Node addresses that change at run time (a VIP that keepalived or kube-vip moves), both modes:
a NodePort answers on an address added to the node within a second, and stops on one removed,
from the external client. The agent reads the node's addresses on eth0 (no --node-ip) and follows
them through netlink (agent/nodewatch.py); before, they were re-read at full syncs only (30 s).

`--nodeport-addresses=192.168.0.0/24` in both modes: iptables mode then writes one `-d` jump per
node address, as eBPF mode writes one frontend per address (without it kube-proxy's `--dst-type
LOCAL` match follows the kernel by itself and the test would not involve the agent).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from lab import Lab
from lab.harness import Cluster, ep, started
from lab.netns import LabError
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

N1, VIP_ADDR = "192.168.0.11", "192.168.0.211"
NODE_PORT = 30811


@pytest.fixture(scope="module", params=["ebpf", "iptables"])
def one_node(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=2) as lab:
        lab.start_podservers()
        c = Cluster(lab, request.param, extra=["--nodeport-addresses=192.168.0.0/24"], node_ip=False)
        with started(c):
            yield c


def answers(cluster: Cluster, addr: str, timeout: float = 0.25) -> bool:
    try:
        return cluster.lab.http_get("client", addr, NODE_PORT, "/", timeout=timeout).strip() == "pod-1-1"
    except (OSError, LabError):
        return False


def first(cluster: Cluster, addr: str, want: bool, within: float) -> float:
    """Seconds until a new connection to addr:NODE_PORT first answers (want) or fails (not want)."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        if answers(cluster, addr) == want:
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"{addr}:{NODE_PORT} still {'silent' if want else 'answering'} after {within} s")


def test_a_nodeport_answers_on_an_address_added_at_run_time_and_stops_on_one_removed(
    one_node: Cluster,
) -> None:
    svc = service("vip", "10.96.8.1", [Port("http", 80, 8080, node_port=NODE_PORT)], type="NodePort")
    one_node.apply(with_endpoints(svc, [ep(one_node, "pod-1-1")]))
    assert answers(one_node, N1, timeout=2.0), "the positive control: the node's own address answers"
    node = one_node.lab.node(1)

    one_node.lab.run(node, "ip", "addr", "add", f"{VIP_ADDR}/24", "dev", "eth0")
    took = first(one_node, VIP_ADDR, want=True, within=3.0)
    assert took < 1.0, f"answered {took:.2f} s after the address was added"
    assert all(answers(one_node, VIP_ADDR) for _ in range(5))

    one_node.lab.run(node, "ip", "addr", "del", f"{VIP_ADDR}/24", "dev", "eth0")
    took = first(one_node, VIP_ADDR, want=False, within=3.0)
    assert took < 1.0, f"still answered {took:.2f} s after the address was removed"
    assert not any(answers(one_node, VIP_ADDR) for _ in range(3))
    assert answers(one_node, N1, timeout=2.0)
