"""Upgrading the agent under load drops no connection and fails no request.

The old agent is an older commit of main, run from `git archive` of that commit in a temp
directory (with this checkout's Python environment). It programs node1 and is stopped (SIGTERM:
its programs and pins stay and keep serving); this checkout's agent starts over the same pin path
and replaces the programs. Meanwhile a pod loops over a ClusterIP and the external client over a
NodePort, a new connection per request, and a long-lived connection exchanges a line every 50 ms:
every request must succeed and the long-lived connection must carry on.

* From ABI v1 (the last v1 commit): the v1 conntrack is carried over (agent/ebpf/upgrade.py)
  around replacing the programs, and the v1 pins removed.
* From the last agent before the early-drop queues, the fragment maps and ekp_stats_v3: the
  conntrack tables are the same maps (their layout unchanged), the new maps are created beside
  them, the counters of ekp_stats_v2 are carried into ekp_stats_v3 and its pin removed.

The commits must be in this clone's history: a shallow clone (CI's default fetch depth in some
systems) does not have them, and the test fails saying so rather than skipping.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab import Lab
from lab.core import PODSERVER
from lab.harness import CLIENT, REPO, Agent, Cluster, ep
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

# The last commit of main with EKP_ABI_VERSION 1 before ABI v2 (git merge-base of this branch and
# main when v2 was written).
V1_COMMIT = "f55b07c1a19a86171a0b7b99a5c93591666582bd"
# The last commit of main before the early-drop queues, ekp_addr, ekp_fraghold and ekp_stats_v3
# (git merge-base of that branch and main when they were written).
V2_STATS_COMMIT = "1a1629f3862fe2ceeb0dda77d5d836c12f55a85c"
ECHO_PORT = 7000


def old_tree(dest: Path, commit: str, what: str, marker: tuple[str, str]) -> Path:
    """An older agent's source, from this clone's history (fails loudly when the clone lacks it);
    `marker` is (file, text) the commit must hold, proving it is the agent it is taken for."""
    have = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"],
        capture_output=True,
        check=False,
    )
    if have.returncode != 0:
        pytest.fail(
            f"commit {commit} ({what}) is not in this clone's history: the upgrade test "
            "runs that agent from `git archive`. Clone with full history (git fetch --unshallow).",
            pytrace=False,
        )
    path, text = marker
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    assert text in shown, f"{commit} is not {what}"
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True
    ).stdout
    tar = dest / f"{commit}.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(dest / commit, filter="data")
    return dest / commit


def v1_tree(dest: Path) -> Path:
    return old_tree(dest, V1_COMMIT, "the last ABI v1 agent", ("bpf/ekp_abi.h", "#define EKP_ABI_VERSION 1"))


class OldAgent(Agent):
    """The same flags and node, an older agent's code (its own agent/ and bpf/ directories)."""

    def __init__(self, lab: Lab, agent: Agent, tree: Path, label: str = "v1") -> None:
        super().__init__(lab, agent.node, agent.mode, agent.source, agent.extra)
        self.tree = tree
        self.label = label
        self.log_path = agent.log_path.with_name(f"agent-{label}-{agent.node.name}.log")

    def flags(self) -> list[str]:
        # the older agents have no socket programs, nor their flags (they would refuse to start)
        return [f for f in super().flags() if not f.startswith("--bpf-socket-lb")]

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = self.lab.popen(
                None,
                sys.executable,
                "-m",
                "agent",
                *self.source,
                *self.flags(),
                name=f"agent-{self.label}-{self.node.name}",
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(self.tree),
            )
        finally:
            log.close()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=3) as built:
        built.start_podservers()
        echo = built.pod("pod-1-2")
        proc = built.popen(
            echo,
            sys.executable,
            "-I",
            "-S",
            str(PODSERVER),
            f"--name={echo.name}",
            "--http-port=8085",
            "--udp-port=9005",
            f"--tcp-echo-port={ECHO_PORT}",
            name="echo",
        )
        built.wait_tcp(echo, echo.ip, ECHO_PORT, proc=proc)
        yield built


def start(cluster: Cluster, pod: str, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    assert cluster.lab.tmpdir is not None
    stop, out = cluster.lab.tmpdir / f"stop-{name}", cluster.lab.tmpdir / f"{name}.json"
    with open(out, "wb") as f:
        proc = cluster.lab.popen(
            pod, sys.executable, CLIENT, *args, "--stop-file", str(stop), name=name, stdout=f
        )
    return proc, stop, out


def finish(proc: subprocess.Popen[bytes], stop: Path, out: Path) -> dict[str, Any]:
    stop.touch()
    proc.wait(timeout=30)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def upgrade_under_load(lab: Lab, tree: Path, label: str) -> tuple[Cluster, Agent, list[dict[str, Any]]]:
    """The older agent at `tree` programs node1; under load, it is stopped and this checkout's
    agent started over its pins. Returns the cluster (with the new agent), the new agent and the
    loops' results (ClusterIP loop, NodePort loop, the long-lived connection)."""
    cluster = Cluster(lab, "ebpf")
    new = cluster.agents[0]
    old = OldAgent(lab, new, tree, label)
    cluster.agents = [old]
    web = service("web", "10.96.5.1", [Port("http", 80, 8080, node_port=30500)], type="NodePort")
    echo = service("echo", "10.96.5.2", [Port("echo", ECHO_PORT, ECHO_PORT)])
    objects = [
        *with_endpoints(web, [ep(cluster, "pod-1-2"), ep(cluster, "pod-1-3")]),
        *with_endpoints(echo, [ep(cluster, "pod-1-2")]),
    ]
    cluster.start()
    cluster.apply(objects)
    loop = ["loop", "--interval", "0.01", "--max-s", "60", "--url"]
    loops = [
        start(cluster, "pod-1-1", "clusterip", *loop, "http://10.96.5.1/"),
        start(cluster, "client", "nodeport", *loop, "http://192.168.0.11:30500/"),
        start(
            cluster,
            "pod-1-1",
            "held",
            "hold",
            "--addr",
            "10.96.5.2",
            "--port",
            str(ECHO_PORT),
            "--max-s",
            "60",
        ),
    ]
    results: list[dict[str, Any]] = []
    try:
        time.sleep(2)
        old.stop()  # SIGTERM: the old programs and maps stay and keep serving
        time.sleep(1)
        cluster.agents = [new]
        new.start()
        new.wait_version(cluster.version)
        time.sleep(3)
    finally:
        results = [finish(*loop) for loop in loops]
    clusterip, nodeport, held = results
    assert clusterip["errors"] == 0 and clusterip["ok"] > 100, clusterip
    assert nodeport["errors"] == 0 and nodeport["ok"] > 100, nodeport
    assert held["errors"] == 0 and held["exchanges"] > 80, held  # one connection, all along
    return cluster, new, results


def test_upgrade_from_abi_v1_under_load_fails_no_request(lab: Lab, tmp_path: Path) -> None:
    cluster, new, _ = upgrade_under_load(lab, v1_tree(tmp_path), "v1")
    pins = Path(new.pin_path)
    log = new.log()
    carried = [
        int(n)
        for n in re.findall(r"upgrade from ABI v1 \(before .*?\): (\d+) conntrack entries carried over", log)
    ]
    assert carried and carried[0] > 0, log[-3000:]  # the live flows of the loops and the held connection
    assert sorted(p.name for p in pins.iterdir() if p.name.endswith("_v1")) == []
    assert (pins / "ekp_ct_tcp_v2").exists()
    # Flows the v1 programs start between the first carry-over and the attach get their entries
    # in the second pass, a few ms later: a segment of theirs arriving in between is dropped (and
    # retransmitted by TCP: no request failed above). A few at most.
    stats = cluster.bpf_stats()
    assert stats["drop_no_flow"] <= 10, stats
    assert not cluster.stop(), "agent --cleanup failed"


def test_upgrade_from_the_agent_before_the_early_drop_queues_under_load_fails_no_request(
    lab: Lab, tmp_path: Path
) -> None:
    """The conntrack tables are kept as they are (same names, same layout): every flow goes on, the
    long-lived connection included; the new maps are created beside them and the counters go on
    in ekp_stats_v3."""
    tree = old_tree(
        tmp_path, V2_STATS_COMMIT, "the last agent with ekp_stats_v2", ("bpf/ekp_maps.h", "ekp_stats_v2")
    )
    cluster, new, _ = upgrade_under_load(lab, tree, "stats-v2")
    pins = Path(new.pin_path)
    names = {p.name for p in pins.iterdir() if p.name.startswith("ekp_") and "_v" in p.name}
    assert "ekp_stats_v2" not in names
    assert {"ekp_stats_v3", "ekp_ct_tcp_v2", "ekp_ctq_tcp_v2", "ekp_addr_v2", "ekp_fraghold_v2"} <= names
    carried = re.findall(r"upgrade from ekp_stats_v2: (\d+) counters carried over", new.log())
    assert carried and int(carried[0]) > 5, new.log()[-3000:]
    stats = cluster.bpf_stats()
    assert stats["packets"] > stats["new_flows"] > 200, stats  # counted before the upgrade and after
    assert stats["drop_no_flow"] == 0, stats
    assert not cluster.stop(), "agent --cleanup failed"
