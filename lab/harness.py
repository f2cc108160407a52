"""A lab cluster with one real agent process per node, in either mode.

Each agent runs in the host namespace (it needs /sys/fs/bpf, which `ip netns exec` hides) and
programs its node's namespace through `--netns`, with its own pin path: two agents on one machine
share nothing. Tests change the cluster by rewriting the services file and wait until every agent
logs `sync done: version=<hash of that content>`: no sleeps, no guessing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from agent.ebpf.compile import COMPILE_TIMEOUT_S
from agent.ebpf.loader import COMPILING_LOG, FAILED_RE
from agent.ebpf.objcache import LOCK_WAIT_S, WAITING_LOG
from agent.sources.file import content_version
from lab import Lab
from lab.core import POD_SUPERNET6, Node
from lab.objects import Ep

REPO = Path(__file__).resolve().parents[1]
CLIENT = str(Path(__file__).with_name("client.py"))
PIN_ROOT = "/sys/fs/bpf"
CLUSTER_CIDR = "10.244.0.0/16"
# The source port of a TCP probe that expects no answer (a test's `not_served`): below the
# ephemeral range (32768-60999), so no later connection that must be served shares its 5-tuple.
# The unanswered SYN leaves a conntrack entry (SYN_SENT, 120 s) with no DNAT; a SYN of the same
# tuple after the Service's rules are back follows that entry untranslated and times out, and the
# kernel's connect() port choice starts afresh every 10 s (the ephemeral port offset hashes
# jiffies / 10 s), so an autobound port repeats within the entry's lifetime now and then.
# Upstream kube-proxy clears no TCP entries either: the test's probe must not make one.
PROBE_SPORT = 20720


class AgentDied(AssertionError):
    pass


class Agent:
    """One `agent` process acting for one lab node."""

    def __init__(
        self,
        lab: Lab,
        node: Node,
        mode: str,
        source: Sequence[str],
        extra: Sequence[str] = (),
        *,
        node_ip: bool = True,
    ) -> None:
        self.lab = lab
        self.node = node
        self.mode = mode
        self.source = list(source)  # --services-file=... or --kubeconfig=...
        self.extra = list(extra)
        self.node_ip = node_ip  # --node-ip: else the agent reads (and follows) eth0's addresses
        # Pods' sockets: False pins --bpf-socket-lb-host-namespace-only=true, so a pod's traffic to
        # a Service takes the per-packet path (the one the lab's packet-level checks read: tc
        # conntrack, SNAT ports, flows carried across restarts); True: =false; None: the agent's
        # default (pods balanced at connect()).
        self.socket_lb_pods: bool | None = False
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
            *([f"--node-ip={self.node.ip}"] if self.node_ip else []),
            # A Lab(ipv6=True) is dual-stack: the IPv6 pod CIDR (and node address) turn on the
            # agent's IPv6 proxier (ip6tables, in both modes).
            *([f"--node-ip={self.node.ip6}"] if self.node_ip and self.node.ip6 else []),
            "--devices=eth0",
            "--pod-interfaces=lxc-p*",
            f"--bpf-pin-path={self.pin_path}",
            f"--cluster-cidr={CLUSTER_CIDR}" + (f",{POD_SUPERNET6}" if self.lab.ipv6 else ""),
            "--iptables-min-sync-period=0",
            # The socket programs serve the node's cgroup (the node, its host-network pod and its
            # pods): never the machine's root, the flag's default on a real node.
            *(
                [f"--bpf-socket-lb-cgroup={self.node.cgroup_root}"]
                if self.node.cgroup_root
                else ["--bpf-socket-lb=false"]
            ),
            *(
                []
                if self.socket_lb_pods is None
                else [f"--bpf-socket-lb-host-namespace-only={str(not self.socket_lb_pods).lower()}"]
            ),
            *self.extra,
        ]

    def start(self) -> None:
        # The log file outlives a restart: only what this run writes answers `wait_version` (a
        # previous run's "sync done" for the same content would otherwise match at once).
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = self.lab.popen(
                None,
                sys.executable,
                "-m",
                "agent",
                *self.source,
                *self.flags(),
                name=f"agent-{self.node.name}",
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(REPO),
                xtables=self.node,
            )
        finally:
            log.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_since_start(self, after: int = 0) -> str:
        """What the current run wrote to the log (from the log mark `after`, when that is later)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self._log_offset, after))
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_mark(self) -> int:
        """Where the log ends now: `wait_version(..., after=mark)` reads only what comes later."""
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def wait_version(self, version: str, timeout: float = 60.0, *, after: int = 0) -> None:
        """Until this run logged a sync of `version` (a services file's content hash), after the log
        mark `after` when given: content applied earlier and again now has an older line."""
        marker = f"sync done: version={version}"
        self._wait(lambda log: marker in log, f"version {version}", timeout, after=after)

    def wait_logged(self, text: str, timeout: float = 60.0, *, after: int = 0) -> None:
        """Until this run logged `text` (after the log mark `after`, when given)."""
        self._wait(lambda log: text in log, repr(text), timeout, after=after)

    def wait_resource_versions(self, wanted: Mapping[str, int], timeout: float = 60.0) -> None:
        """Until this run logged a sync that includes, for each kind, its resourceVersion in `wanted`
        (or a later one). The agent logs `version=Kind=rv,...`, or one rv when all kinds agree."""

        def seen(log: str) -> bool:
            for text in re.findall(r"sync done: version=(\S+?),? ", log):
                have = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
                if all(
                    int(have.get(kind, text if text.isdigit() else 0)) >= rv for kind, rv in wanted.items()
                ):
                    return True
            return False

        self._wait(seen, f"resourceVersions {dict(wanted)}", timeout)

    def _compiling(self) -> bool:
        """Whether this run is compiling its data path (or waiting for another agent's compile of
        it) and has said neither that the data path is ready nor that anything failed since: a
        compile that fails is retried by the agent, and is no reason to wait longer."""
        log = self.log_since_start()
        first = min((i for i in (log.find(COMPILING_LOG), log.find(WAITING_LOG)) if i >= 0), default=-1)
        if first < 0 or FAILED_RE.search(log, first):
            return False  # none, or one failed: the agent compiles again, no reason to wait longer
        last = max(log.rfind(COMPILING_LOG), log.rfind(WAITING_LOG))
        return ", ready in " not in log[last:]

    def _wait(self, done: Callable[[str], bool], what: str, timeout: float, *, after: int = 0) -> None:
        """Until `done(log)`. `timeout` counts the agent's own work: while it compiles its data path
        (a cold cache; CPU-bound, so several times slower on a loaded machine) the clock restarts,
        bounded by the compile's and the compile lock's own limits."""
        now = time.monotonic()
        deadline = now + timeout
        limit = now + timeout + COMPILE_TIMEOUT_S + LOCK_WAIT_S
        began = now
        while time.monotonic() < deadline:
            if done(self.log_since_start(after)):
                return
            if self._compiling():
                deadline = min(max(deadline, time.monotonic() + timeout), limit)
            if self.proc is not None and self.proc.poll() is not None:
                raise AgentDied(
                    f"agent for {self.node.name} exited {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            time.sleep(0.05)
        raise AssertionError(
            f"agent for {self.node.name} did not sync {what} in {timeout}s of its own work "
            f"({time.monotonic() - began:.0f}s in all, any compile of its data path not counted):\n"
            f"{self.log()[-4000:]}"
        )

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, SIGKILL after `timeout`; the exit status (-9: killed), None if not running."""
        if self.proc is not None and self.proc.poll() is None:
            return self.lab.stop(self.proc, timeout=timeout)
        return None

    def cleanup(self, flag: str = "--cleanup") -> subprocess.CompletedProcess[str]:
        """`agent --cleanup` (or `--cleanup-kube-proxy`, the chart's init container) with this
        agent's flags, run to its end, taking the node's xtables lock as the agent does (a legacy
        cleanup of thousands of Services holds it for seconds: never the machine's)."""
        return subprocess.run(
            self.lab.command(
                None, sys.executable, "-m", "agent", flag, *self.flags(), cgroup=None, xtables=self.node
            ),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=str(REPO),
            check=False,
        )


class Cluster:
    """A lab plus agents; `apply(objects)` replaces the whole set of Services and EndpointSlices."""

    def __init__(
        self,
        lab: Lab,
        mode: str,
        agent_nodes: Iterable[int] | None = None,
        extra: Sequence[str] = (),
        *,
        node_ip: bool = True,
    ) -> None:
        assert lab.tmpdir is not None
        self.lab = lab
        self.mode = mode
        self.services_file = lab.tmpdir / "services.yaml"
        self.services_file.write_text("")
        wanted = set(agent_nodes) if agent_nodes is not None else {i + 1 for i in range(len(lab.nodes))}
        self.agents = [
            Agent(lab, n, mode, [f"--services-file={self.services_file}"], extra, node_ip=node_ip)
            for i, n in enumerate(lab.nodes)
            if i + 1 in wanted
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
        """Write the services file and wait until every agent synced it. Content equal to the content
        in force is not synced again (the file source skips it); any other content is waited for
        from this write on, so returning to an earlier content waits for its new sync, not the old
        line (the scale-down of test_no_disruption_... returned at once, before the sync)."""
        marks = [a.log_mark() for a in self.agents]
        version = self.write(objects)
        if version == self.version:
            return
        self.version = version
        for a, mark in zip(self.agents, marks, strict=True):
            a.wait_version(version, timeout, after=mark)

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
        """Run lab/client.py inside a namespace and decode its JSON result."""
        res = self.lab.run(target, sys.executable, CLIENT, *args, timeout=timeout)
        result: dict[str, Any] = json.loads(res.stdout)
        return result

    def http(
        self, target: Any, url: str, count: int = 1, timeout: float = 3.0, *, sport: int = 0
    ) -> dict[str, Any]:
        """`count` GETs of `url`, each on a new connection (lab/client.py http); `sport`: all from
        that source port (PROBE_SPORT), else each from one the kernel picks."""
        args = ["http", "--url", url, "--count", str(count), "--timeout", str(timeout)]
        return self.client(target, *args, *(["--sport", str(sport)] if sport else []))

    def udp(
        self,
        target: Any,
        addr: str,
        port: int,
        count: int = 1,
        size: int = 0,
        *,
        sport: int = 0,
        sources: bool = False,
    ) -> dict[str, Any]:
        """`count` request/reply pairs (lab/client.py udp); `sources`: also count the address each
        reply came from."""
        args = ["udp", "--addr", addr, "--port", str(port), "--count", str(count)]
        args += ["--size", str(size)] if size else []
        args += ["--sport", str(sport)] if sport else []
        return self.client(target, *args, *(["--sources"] if sources else []))

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


ClusterT = TypeVar("ClusterT", bound=Cluster)


@contextmanager
def started(cluster: ClusterT) -> Iterator[ClusterT]:
    """`cluster`'s agents started for the block, stopped and cleaned up after it: a cleanup that
    failed (`agent --cleanup` left something installed) fails the module that used the cluster."""
    cluster.start()
    try:
        yield cluster
    finally:
        failures = cluster.stop()
    assert not failures, f"agent --cleanup failed: {failures}"


class Loop:
    """A client in a lab pod making one new connection per request to `url` until `finish()`."""

    def __init__(self, lab: Lab, pod: str, url: str, name: str, max_s: float = 240.0) -> None:
        assert lab.tmpdir is not None
        self._stop = lab.tmpdir / f"stop-{name}"
        self._stop.unlink(missing_ok=True)
        self._out = lab.tmpdir / f"loop-{name}.json"
        with open(self._out, "wb") as f:
            self._proc = lab.popen(
                pod,
                sys.executable,
                CLIENT,
                "loop",
                "--url",
                url,
                "--stop-file",
                str(self._stop),
                "--max-s",
                str(max_s),
                "--timeout",
                "5",
                "--interval",
                "0.005",
                name=f"loop-{name}",
                stdout=f,
                stderr=subprocess.DEVNULL,
            )

    def finish(self) -> dict[str, Any]:
        """Stop the loop; its counts: ok, errors, error_kinds, bodies, first_error_at, seconds."""
        self._stop.touch()
        self._proc.wait(timeout=30)
        result: dict[str, Any] = json.loads(self._out.read_text())
        return result


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
