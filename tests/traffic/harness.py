"""A lab cluster with one real agent process per node, in either mode.

Each agent runs in the host namespace (it needs /sys/fs/bpf, which `ip netns exec` hides) and
programs its node's namespace through `--netns`, with its own pin path: two agents on one machine
share nothing. Tests change the cluster by rewriting the services file and wait until every agent
logs `sync done: version=<hash of that content>`: no sleeps, no guessing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from agent.sources.file import content_version
from tests.lab import Lab
from tests.lab.core import Node
from tests.traffic.objects import Ep

REPO = Path(__file__).resolve().parents[2]
CLIENT = str(Path(__file__).with_name("client.py"))
PIN_ROOT = "/sys/fs/bpf"
CLUSTER_CIDR = "10.244.0.0/16"


class AgentDied(AssertionError):
    pass


class Agent:
    """One `agent` process acting for one lab node."""

    def __init__(
        self, lab: Lab, node: Node, mode: str, services_file: Path, extra: Sequence[str] = ()
    ) -> None:
        self.lab = lab
        self.node = node
        self.mode = mode
        self.services_file = services_file
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        assert lab.tmpdir is not None
        self.log_path = lab.tmpdir / f"agent-{node.name}.log"
        self._log_offset = 0

    @property
    def pin_path(self) -> str:
        return f"{PIN_ROOT}/ebpf-kube-proxy-lab-{self.lab.prefix}-{self.node.name}"

    def flags(self) -> list[str]:
        return [
            f"--mode={self.mode}",
            f"--hostname-override={self.node.name}",
            f"--netns={self.node.ns}",
            f"--node-ip={self.node.ip}",
            "--devices=eth0",
            "--pod-interfaces=lxc-p*",
            f"--bpf-pin-path={self.pin_path}",
            f"--cluster-cidr={CLUSTER_CIDR}",
            "--iptables-min-sync-period=0",
            *self.extra,
        ]

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = self.lab.popen(
                None,
                sys.executable,
                "-m",
                "agent",
                f"--services-file={self.services_file}",
                *self.flags(),
                name=f"agent-{self.node.name}",
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(REPO),
            )
        finally:
            log.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_version(self, version: str, timeout: float = 60.0) -> None:
        marker = f"sync done: version={version}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in self.log():
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise AgentDied(
                    f"agent for {self.node.name} exited {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            time.sleep(0.05)
        raise AssertionError(
            f"agent for {self.node.name} did not sync version {version} in {timeout}s:\n{self.log()[-4000:]}"
        )

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.lab.stop(self.proc, timeout=10)

    def cleanup(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agent", "--cleanup", *self.flags()],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=str(REPO),
            check=False,
        )


class Cluster:
    """A lab plus agents; `apply(objects)` replaces the whole set of Services and EndpointSlices."""

    def __init__(
        self, lab: Lab, mode: str, agent_nodes: Iterable[int] | None = None, extra: Sequence[str] = ()
    ) -> None:
        assert lab.tmpdir is not None
        self.lab = lab
        self.mode = mode
        self.services_file = lab.tmpdir / "services.yaml"
        self.services_file.write_text("")
        wanted = set(agent_nodes) if agent_nodes is not None else {i + 1 for i in range(len(lab.nodes))}
        self.agents = [
            Agent(lab, n, mode, self.services_file, extra) for i, n in enumerate(lab.nodes) if i + 1 in wanted
        ]
        self.version = ""

    def start(self) -> None:
        self.version = self.write([])
        for a in self.agents:
            a.start()
        for a in self.agents:
            a.wait_version(self.version)

    def write(self, objects: Sequence[dict[str, Any]]) -> str:
        # JSON is YAML too, and the agent reads it far faster (10,000 services: under 0.1 s).
        items = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
        data = json.dumps(items, sort_keys=True).encode()
        tmp = self.services_file.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.services_file)
        return content_version(data)

    def apply(self, objects: Sequence[dict[str, Any]], timeout: float = 60.0) -> None:
        self.version = self.write(objects)
        for a in self.agents:
            a.wait_version(self.version, timeout)

    def stop(self) -> list[str]:
        """Stop agents and clean up what they installed; returns cleanup failures."""
        failures = []
        for a in self.agents:
            a.stop()
            res = a.cleanup()
            if res.returncode != 0:
                failures.append(f"{a.node.name}: {res.stdout}{res.stderr}")
        return failures

    # ---- traffic helpers -------------------------------------------------------------------

    def client(self, target: Any, *args: str, timeout: float = 120.0) -> dict[str, Any]:
        """Run tests/traffic/client.py inside a namespace and decode its JSON result."""
        res = self.lab.run(target, sys.executable, CLIENT, *args, timeout=timeout)
        result: dict[str, Any] = json.loads(res.stdout)
        return result

    def http(self, target: Any, url: str, count: int = 1, timeout: float = 3.0) -> dict[str, Any]:
        return self.client(target, "http", "--url", url, "--count", str(count), "--timeout", str(timeout))

    def udp(self, target: Any, addr: str, port: int, count: int = 1, size: int = 0) -> dict[str, Any]:
        args = ["udp", "--addr", addr, "--port", str(port), "--count", str(count)]
        return self.client(target, *args, *(["--size", str(size)] if size else []))

    def bpf_stats(self, node_index: int = 1) -> dict[str, int]:
        """eBPF mode: the data path's counters on a node (as `agent inspect stats` shows them)."""
        from agent.ebpf.abi import MAPS
        from agent.ebpf.maps import BpfMap, read_stats

        with BpfMap.open_pinned(MAPS["stats"], self.agents[node_index - 1].pin_path) as stats:
            return {stat.name.lower(): count for stat, count in read_stats(stats).items()}

    def ruleset(self, node: Node) -> str:
        """Everything netfilter holds in a node: both iptables backends and nftables."""
        parts = []
        for argv in (["iptables-nft-save"], ["iptables-legacy-save"], ["nft", "list", "ruleset"]):
            res = self.lab.run(node, *argv, check=False)
            parts.append(res.stdout)
        return "\n".join(parts)


def ep(cluster: Cluster, pod: str) -> Ep:
    """The endpoint of a lab pod, on the node that runs it."""
    p = cluster.lab.pod(pod)
    return Ep(p.ip, cluster.lab.nodes[p.node - 1].name)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-squared variable with `df` degrees of freedom (regularized gamma Q)."""
    import math

    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:  # series for P, then Q = 1 - P
        term = total = 1.0 / a
        n = a
        while abs(term) > 1e-14 * abs(total):
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    # continued fraction for Q (Lentz)
    b = z + 1 - a
    c = 1e300
    d = 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-14:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


def uniformity_p_value(counts: Sequence[int]) -> float:
    """Pearson's chi-squared test of `counts` against a uniform distribution."""
    total = sum(counts)
    expected = total / len(counts)
    stat = sum((c - expected) ** 2 / expected for c in counts)
    return chi2_sf(stat, len(counts) - 1)
