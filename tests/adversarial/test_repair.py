"""Faults behind the agent's back, repaired by its periodic full sync (issue 8, item 5), in the lab.

An operator (or another tool) deletes a frontend entry with `bpftool map delete` and removes a
pinned map's file: the service is dead until the next full sync, which reads the maps back,
writes what differs and pins the map again. The full-sync period is 3 s here (kube-proxy's
`--iptables-sync-period`, 30 s by default).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from agent.ebpf import abi
from lab import Lab
from lab.harness import Cluster, ep
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

VIP = "10.96.7.10"
HTTP = Port("http", 80, 8080)
SYNC_PERIOD_S = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=2) as lab:
        lab.start_podservers()
        c = Cluster(lab, "ebpf", extra=[f"--iptables-sync-period={SYNC_PERIOD_S}s"])
        c.start()
        try:
            yield c
        finally:
            assert not c.stop(), "agent --cleanup failed"


def serves(cluster: Cluster) -> bool:
    try:
        return cluster.lab.http_get("pod-1-1", VIP, 80, timeout=0.5).strip() == "pod-1-2"
    except OSError:
        return False


def test_a_deleted_frontend_and_a_removed_pin_are_repaired_by_the_next_full_sync(cluster: Cluster) -> None:
    cluster.apply(with_endpoints(service("repair", VIP, [HTTP]), [ep(cluster, "pod-1-2")]))
    assert serves(cluster)
    (agent,) = cluster.agents
    mark = len(agent.log())
    key = abi.FrontendKey(addr=abi.ip_be(VIP), port=abi.port_be(80), proto=6, scope=int(abi.Scope.INTERNAL))
    fe_pin = os.path.join(agent.pin_path, abi.MAPS["fe"].name)
    subprocess.run(
        ["bpftool", "map", "delete", "pinned", fe_pin, "key", "hex", *(f"{b:02x}" for b in bytes(key))],
        check=True,
        capture_output=True,
    )
    # Checked in the map, at once: a request could race the next full sync (every 3 s) that
    # repairs it.
    looked_up = subprocess.run(
        ["bpftool", "map", "lookup", "pinned", fe_pin, "key", "hex", *(f"{b:02x}" for b in bytes(key))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert looked_up.returncode != 0, f"the frontend entry is still in the kernel: {looked_up.stdout}"
    slot_pin = os.path.join(agent.pin_path, abi.MAPS["slot"].name)
    os.unlink(slot_pin)

    # Waited for in the log, which the agent writes once the sync's writes are done: the service
    # answers as soon as the frontend is back, a moment before that line. (A full sync between the
    # deletion and the unlink would repair them in two syncs: both lines are waited for.)
    pin_line = f"pin {slot_pin} is missing (removed behind our back): pinning our map again"
    deadline = time.monotonic() + 4 * SYNC_PERIOD_S
    while not ("full sync repaired" in (log := agent.log()[mark:]) and pin_line in log):
        assert time.monotonic() < deadline, f"not repaired within {4 * SYNC_PERIOD_S} s:\n{log[-3000:]}"
        time.sleep(0.1)
    assert serves(cluster), "repaired: the service answers"
    assert os.path.exists(slot_pin), "the removed pin was made again"
