"""Hostile Service names against a real agent: nothing reaches netfilter, valid services keep serving.

Three inputs that were seen to break iptables mode (each was reproduced against main first):

* `x\\n-I INPUT 1 -s 6.6.6.6/32 -j ACCEPT\\n#` with endpoints: the newline ended the comment's rule
  and the attacker's rule went into the live nat table, once more on every sync;
* the same trick in a Service without endpoints: its name is written into the filter table's REJECT
  rule, so the attacker's FORWARD rule landed in filter, where `--cleanup` left it behind;
* `a b` (a space): the unquoted comment split into stray arguments and every restore failed, so no
  service at all was programmed any more.

Each case runs in both modes (in eBPF mode the names are only map-planner input and must not put a
single rule into netfilter). A loop in a pod keeps requesting a valid service while the bad input
is applied; it must see no error, then or after. iptables-save in the node shows no injected rule
in any table (both backends and nftables), and `agent --cleanup` leaves no rule of ours.

One lab for the module (1 node, 2 pods); one agent per test, stopped and cleaned up by the test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lab import Lab
from lab.harness import CLIENT, Cluster, ep
from lab.objects import Ep, Port, endpoint_slice, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

HTTP = Port("http", 80, 8080)
WEB_IP = "10.96.0.10"
INJECTED = "6.6.6.6"
CASES = {
    "newline-with-endpoints": ("x\n-I INPUT 1 -s 6.6.6.6/32 -j ACCEPT\n#", True),
    "newline-without-endpoints": ("y\n-I FORWARD 1 -s 6.6.6.6/32 -j ACCEPT\n#", False),
    "space": ("a b", True),
}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=2) as lab:
        lab.start_podservers()
        yield lab


def bad_objects(name: str, with_eps: bool, backend: Ep) -> list[dict[str, Any]]:
    svc = service(name, "10.96.0.66", [HTTP])
    if not with_eps:
        return [svc]
    return [svc, endpoint_slice(name, [HTTP], [backend])]


def netfilter(cluster: Cluster) -> str:
    return cluster.ruleset(cluster.lab.nodes[0])


class Loop:
    """New connections to a URL from a pod, one after the other, until stopped (client.py loop)."""

    def __init__(self, cluster: Cluster, pod: str, url: str, name: str) -> None:
        assert cluster.lab.tmpdir is not None
        self.lab = cluster.lab
        self.stop_file = cluster.lab.tmpdir / f"stop-{name}"
        self.ready_file = cluster.lab.tmpdir / f"ready-{name}"
        self.out = cluster.lab.tmpdir / f"loop-{name}.json"
        for path in (self.stop_file, self.ready_file):
            path.unlink(missing_ok=True)
        argv = [
            "loop",
            "--url",
            url,
            "--stop-file",
            str(self.stop_file),
            "--ready-file",
            str(self.ready_file),
        ]
        argv += ["--max-s", "120", "--timeout", "5", "--interval", "0.005"]
        with open(self.out, "wb") as out:
            self.proc = cluster.lab.popen(
                pod, sys.executable, CLIENT, *argv, name=f"loop-{name}", stdout=out, stderr=subprocess.DEVNULL
            )
        deadline = time.monotonic() + 20
        while not self.ready_file.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "the request loop did not start"
            time.sleep(0.02)

    def finish(self, *, at_least_s: float = 0.5) -> dict[str, Any]:
        time.sleep(at_least_s)  # some requests strictly after the last change
        self.stop_file.touch()
        self.proc.wait(timeout=30)
        result: dict[str, Any] = json.loads(self.out.read_text())
        return result


@pytest.mark.parametrize("mode", ["iptables", "ebpf"])
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_service_name_injects_nothing_and_valid_services_keep_serving(
    lab: Lab, mode: str, case: str
) -> None:
    name, with_eps = CASES[case]
    cluster = Cluster(lab, mode)
    cluster.start()
    stopped = False
    try:
        web = with_endpoints(service("web", WEB_IP, [HTTP]), [ep(cluster, "pod-1-2")])
        cluster.apply(web)
        first = cluster.http("pod-1-1", f"http://{WEB_IP}/", count=5)
        assert first["errors"] == 0, first

        loop = Loop(cluster, "pod-1-1", f"http://{WEB_IP}/", f"{mode}-{case}")
        cluster.apply(web + bad_objects(name, with_eps, ep(cluster, "pod-1-2")))
        # A further change after the bad input: syncs still go through.
        web2 = with_endpoints(
            service("web", WEB_IP, [HTTP]), [ep(cluster, "pod-1-2"), ep(cluster, "pod-1-1")]
        )
        cluster.apply(web2 + bad_objects(name, with_eps, ep(cluster, "pod-1-2")))
        during = loop.finish()
        assert during["errors"] == 0 and during["ok"] > 0, during
        after = cluster.http("pod-1-1", f"http://{WEB_IP}/", count=20)
        assert after["errors"] == 0 and set(after["bodies"]) <= {"pod-1-1", "pod-1-2"}, after

        rules = netfilter(cluster)
        assert INJECTED not in rules, rules
        assert not re.search(r"^-I ", rules, re.MULTILINE)
        if mode == "ebpf":
            assert "KUBE-" not in rules and "10.96." not in rules, rules
        else:
            assert f"-d {WEB_IP}/32" in rules  # the valid service is programmed
            log = cluster.agents[0].log_since_start()
            # Refused by the renderer ("not programmed") or, once the model refuses such names
            # too, skipped before it ("skipping Service").
            assert "not programmed" in log or "skipping Service" in log, log[-3000:]
            assert "\n-I INPUT" not in log and "\n-I FORWARD" not in log  # no forged log line

        failures = cluster.stop()
        stopped = True
        assert failures == []
        left = netfilter(cluster)
        assert "KUBE-" not in left and INJECTED not in left, left
    finally:
        if not stopped:
            cluster.stop()
