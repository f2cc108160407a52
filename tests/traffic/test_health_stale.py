"""kube-proxy's /healthz and /livez on a running agent whose syncs stop going through: both turn 503
once a change has waited twice the sync period (kube-proxy's health timeout), and 200 again after
the next sync that goes through. Both modes. The syncs are made to fail from outside: the node's
network namespace loses its name (/run/netns/NODE unmounted, the namespace itself alive), so a
full sync, which reads the node's addresses in that namespace by its name, fails in either mode.

An eBPF-mode partial sync writes maps through descriptors the agent holds and would go through, so
the change is made only once a sync has failed: from then on the periodic full sync stays due until
one goes through, and every sync is a full one that fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from agent.netns import run_in_netns
from lab import Lab
from lab.apicluster import ApiCluster
from lab.harness import ep, started
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel
from tests.traffic.conftest import MODES

pytestmark = pytest.mark.kernel

N1 = "192.168.0.11"
SYNC_PERIOD_S = 2  # health timeout: 4 s


@pytest.fixture(scope="module", params=MODES)
def api(request: pytest.FixtureRequest) -> Iterator[ApiCluster]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=2) as lab:
        lab.start_podservers()
        cluster = ApiCluster(lab, request.param, extra=[f"--iptables-sync-period={SYNC_PERIOD_S}s"])
        with started(cluster):
            yield cluster


def status_of(api: ApiCluster, path: str) -> tuple[int, dict[str, object]]:
    out = api.lab.run(
        "client", "curl", "-s", "-o", "-", "-w", "\\n%{http_code}", "--max-time", "3",
        f"http://{N1}:10256{path}", check=False,
    ).stdout  # fmt: skip
    body, _, code = out.rpartition("\n")
    return int(code), json.loads(body)


def wait_status(api: ApiCluster, path: str, want: int, timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        code, doc = status_of(api, path)
        if code == want:
            return doc
        assert time.monotonic() < deadline, f"{path} still {code}, not {want}: {doc}"
        time.sleep(0.2)


def wait_log(api: ApiCluster, text: str, after: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in api.agents[0].log_since_start(after):
        assert time.monotonic() < deadline, f"no {text!r} in the agent's log within {timeout} s"
        time.sleep(0.2)


def test_healthz_and_livez_turn_503_when_syncs_stop_going_through(api: ApiCluster) -> None:
    ns = api.lab.node(1).ns
    name = f"/run/netns/{ns}"
    svc = service("stale", "10.96.9.1", [Port("http", 80, 8080)])
    api.apply(with_endpoints(svc, [ep(api, "pod-1-1")]))
    assert status_of(api, "/healthz")[0] == 200 and status_of(api, "/livez")[0] == 200
    # An fd on the namespace through procfs (one on the nsfs mount would keep it busy) holds it
    # while it has no name, and is what the name is mounted back from.
    keep = run_in_netns(ns, lambda: os.open("/proc/thread-self/ns/net", os.O_RDONLY))
    try:
        mark = api.agents[0].log_mark()
        subprocess.run(["umount", name], check=True)
        try:
            # The next periodic sync (a full one) fails in both modes; the change comes after it.
            wait_log(api, "sync failed", mark, timeout=2 * SYNC_PERIOD_S + 10)
            started = time.monotonic()
            api.server.apply(service("stale", "10.96.9.1", [Port("http", 80, 8080), Port("x", 81, 8080)]))
            doc = wait_status(api, "/healthz", 503, timeout=4 * SYNC_PERIOD_S + 10)
            waited = time.monotonic() - started
            assert doc["healthy"] is False and doc["nodeEligible"] is True, doc
            assert waited >= 2 * SYNC_PERIOD_S - 0.5, f"503 after {waited:.1f} s, before the health timeout"
            assert status_of(api, "/livez")[0] == 503
            assert ns in api.agents[0].log_since_start(mark), "the failure names the namespace"
        finally:
            subprocess.run(["mount", "--bind", f"/proc/{os.getpid()}/fd/{keep}", name], check=True)
    finally:
        os.close(keep)
    assert wait_status(api, "/healthz", 200, timeout=30)["healthy"] is True
    assert status_of(api, "/livez")[0] == 200
