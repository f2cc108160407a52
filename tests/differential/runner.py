"""Run the differential table in one mode: one lab, one agent start per phase, every case observed.

`run_mode(mode)` builds a two-node lab whose agents follow a fake API server (the Node objects carry
zone labels: node1 zone-a, node2 zone-b, which topology hints need), starts the whoami server in the
backend pods, applies every Service of the table at once and runs each case's probe
(tests/differential/probe.py) in the case's source namespace, a few at a time (the cases share
nothing: each has its own Service). Cases of the MASQUERADE_ALL phase run after the agents were
restarted with `--masquerade-all` (over their own pinned maps / chains, as an operator would).

An `Observation` keeps every attempt (verdict, backend, address the backend saw); `summary()` turns
it into the one line the test compares between modes, with kube-proxy's expectation
(`expected_summary`) and with DIFFERENCES.md. Backends are compared as a set for EXACT cases (20
flows over at most 3 backends: a backend is missed with probability below 1e-3), as "one backend"
for STICKY ones and as "one backend per round, changing after expiry" for EXPIRING ones.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lab import Lab
from lab.apicluster import ApiCluster
from lab.fakeapi.objects import node as node_object
from lab.harness import Cluster
from tests.differential.cases import (
    ANSWERED,
    BACKEND_PODS,
    CASES,
    CLIENT_ROUTES,
    DEFAULT,
    EXACT,
    EXPIRING,
    IPV4,
    IPV6,
    PHASE_FLAGS,
    PODS_PER_NODE,
    REFUSED,
    RESET,
    STICKY,
    TARGET_PORT,
    TIMED_OUT,
    ZONES,
    Case,
    Svc,
    all_objects,
    cidr_in_family,
    role_of,
)
from tests.differential.paths import Decided, decided

HERE = Path(__file__).resolve().parent
PROBE = str(HERE / "probe.py")
WHOAMI = str(HERE / "whoami.py")
WORKERS = 4

Attempt = tuple[int, str, str, str]  # round, verdict ("ok", "refused", "reset", ...), backend, seen


@dataclass(frozen=True)
class Observation:
    """What one case saw in one mode."""

    attempts: tuple[Attempt, ...]
    seconds: float
    decided: Decided | None = None  # which path's conntrack holds the case's flows (paths.py)

    @property
    def verdicts(self) -> Counter[str]:
        return Counter(a[1] for a in self.attempts)

    @property
    def backends(self) -> Counter[str]:
        return Counter(a[2] for a in self.attempts if a[1] == "ok")

    @property
    def seen(self) -> frozenset[str]:
        """Raw source addresses the backends saw."""
        return frozenset(a[3] for a in self.attempts if a[1] == "ok")

    def verdict(self) -> str:
        v = self.verdicts
        if set(v) == {"ok"}:
            return ANSWERED
        if set(v) == {"refused"}:
            return REFUSED
        if set(v) == {"reset"}:
            return RESET
        if set(v) == {"timeout"}:
            return TIMED_OUT
        return "mixed " + " ".join(f"{k}={n}" for k, n in sorted(v.items()))

    def summary(self, case: Case) -> str:
        """The line compared between modes: verdict, backends (as the case compares them), roles seen."""
        text = self.verdict()
        if not self.backends:
            return text
        names = set(self.backends)
        if case.compare == EXACT:
            text += " by " + " ".join(sorted(names))
        else:
            outside = names - case.expect.backends
            if outside:
                text += " by backends outside the pool: " + " ".join(sorted(outside))
            elif case.compare == STICKY:
                text += " by one backend" if len(names) == 1 else f" by {len(names)} backends"
            else:
                per_round = [
                    {a[2] for a in self.attempts if a[0] == r and a[1] == "ok"} for r in range(case.rounds)
                ]
                if any(len(s) > 1 for s in per_round):
                    text += " by several backends within a round"
                else:
                    text += " by one backend per round, " + (
                        "changing after expiry" if len(names) > 1 else "never changing"
                    )
        return text + ", seen as " + " ".join(sorted({role_of(a) for a in self.seen}))

    def detail(self) -> str:
        """Counts per backend and raw addresses, for the printed table."""
        counts = " ".join(f"{b}={n}" for b, n in sorted(self.backends.items()))
        parts = [f"{counts} | {' '.join(sorted(self.seen))}"] if counts else []
        parts += [self.decided.text()] if self.decided else []
        return "; ".join(parts)


def expected_summary(case: Case) -> str:
    """kube-proxy's outcome of `case`, in `Observation.summary`'s words."""
    e = case.expect
    if e.verdict != ANSWERED:
        return e.verdict
    if case.compare == EXACT:
        who = " ".join(sorted(e.backends))
    elif case.compare == STICKY:
        who = "one backend"
    else:
        assert case.compare == EXPIRING
        who = "one backend per round, changing after expiry"
    return f"{ANSWERED} by {who}, seen as " + " ".join(sorted(e.seen_as))


class ZonedApiCluster(ApiCluster):
    """An ApiCluster whose Node objects carry the table's zones (ApiCluster puts all in zone-a);
    `family`: the table's family, which the phase markers take too."""

    family = IPV4

    def start(self) -> None:
        self.server.start()
        self.server.write_kubeconfig(self.kubeconfig)
        nodes = [node_object(n.name, n.ip, zone=ZONES[n.name], pod_cidr=n.pod_cidr) for n in self.lab.nodes]
        wanted = self._record([self.server.apply(obj) for obj in nodes])
        for a in self.agents:
            a.start()
        self.wait_synced(wanted)

    def restart_agents(self, extra: Sequence[str], marker: Svc) -> None:
        """Restart every agent with `extra` flags; return once they programmed everything again
        (a marker Service applied after the restart proves a full sync)."""
        for a in self.agents:
            a.stop()
            a.extra = [f for f in a.extra if f not in ALL_PHASE_FLAGS] + list(extra)
            a.start()
        self.apply(marker.objects(self.family))


ALL_PHASE_FLAGS = {f for flags in PHASE_FLAGS.values() for f in flags}


def probe(cluster: Cluster, case: Case, family: str = IPV4) -> Observation:
    lab = cluster.lab
    addr, port = case.address(family)
    argv = [
        sys.executable,
        "-I",
        "-S",
        PROBE,
        f"--proto={case.protocol.lower()}",
        f"--addr={addr}",
        f"--port={port}",
        f"--count={case.count}",
        f"--timeout={case.timeout_s}",
        f"--rounds={case.rounds}",
        f"--gap={case.gap_s}",
    ]
    if case.size:
        argv.append(f"--size={case.size}")
    start = time.monotonic()
    limit = case.rounds * (case.count * (case.timeout_s + 0.5) + case.gap_s) + 30
    res = lab.run(case.source, *argv, timeout=limit)
    attempts = tuple((int(r), str(v), str(b), str(s)) for r, v, b, s in json.loads(res.stdout)["attempts"])
    seconds = round(time.monotonic() - start, 2)
    return Observation(attempts, seconds, decided(cluster, case, family))


@dataclass(frozen=True)
class ModeRun:
    mode: str
    observations: dict[str, Observation]
    timings: dict[str, float]  # lab and agents up, each phase, total
    family: str = IPV4


@contextmanager
def _lab(family: str) -> Iterator[Lab]:
    # IPv6: a dual-stack lab, whose agents get an IPv6 --node-ip and pod CIDR (lab/harness.py),
    # which turns their IPv6 proxier on; the table's Services are IPv6-only there.
    ipv6 = family == IPV6
    with Lab(nodes=2, pods_per_node=PODS_PER_NODE, ipv6=ipv6) as lab:
        servers = [
            lab.popen(
                pod,
                sys.executable,
                "-I",
                "-S",
                WHOAMI,
                f"--name={pod}",
                f"--port={TARGET_PORT}",
                *(["--ipv6"] if ipv6 else []),
                name="whoami",
            )
            for pod in BACKEND_PODS
        ]
        for pod, proc in zip(BACKEND_PODS, servers, strict=True):
            lab.wait_log(proc, "whoami ready", timeout=10)
            lab.wait_tcp(pod, lab.pod(pod).ip, TARGET_PORT, proc=proc, timeout=10)
        for cidr in CLIENT_ROUTES:
            lab.add_client_route(cidr_in_family(cidr, family), via_node=1)
        for node in lab.nodes:
            # As tests/traffic/conftest.py: the rule kube-proxy and Docker install; both modes cope.
            tool = "ip6tables" if ipv6 else "iptables"
            lab.run(node, tool, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")
        yield lab


def mode_flags(mode: str, family: str) -> tuple[str, ...]:
    """The agents' flags of a mode's run. IPv6 eBPF mode: the tc programs' IPv6 path with
    `--bpf-host-routing=bpf` (bpf/ekp_tc6.h; it translates under legacy host routing too, by the
    same decisions, with the stack between its two halves: tests/adversarial/test_host_routing.py
    and tests/traffic/test_ipv6.py run that one). Pods' sockets
    stay on the per-packet path (the harness's default), so a pod's flows are the tc path's to
    decide, not the socket programs' at connect(): that covers the most of the tc path's decisions
    (the node's own sockets are the socket programs' in every eBPF run)."""
    return ("--bpf-host-routing=bpf",) if mode == "ebpf" and family == IPV6 else ()


def run_mode(mode: str, cases: Sequence[Case] = CASES, family: str = IPV4) -> ModeRun:
    """Every case of `cases` in `mode` and `family`, phase by phase; raises if an agent's cleanup
    fails."""
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    observations: dict[str, Observation] = {}
    with _lab(family) as lab:
        cluster = ZonedApiCluster(lab, mode, extra=mode_flags(mode, family))
        cluster.family = family
        cluster.start()
        try:
            cluster.apply(all_objects(family))
            timings["lab and agents up"] = round(time.monotonic() - t0, 1)
            phases = [DEFAULT, *sorted({c.phase for c in cases} - {DEFAULT})]
            for i, phase in enumerate(phases):
                t = time.monotonic()
                if phase != DEFAULT:
                    cluster.restart_agents(PHASE_FLAGS[phase], Svc(f"phase-{i}", f"10.96.11.{i}", ()))
                todo = [c for c in cases if c.phase == phase]
                # the slow ones first, so they overlap with the rest
                todo.sort(key=lambda c: -(c.rounds * c.gap_s + (c.expect.verdict != ANSWERED) * c.timeout_s))
                with ThreadPoolExecutor(WORKERS) as pool:
                    seen = pool.map(lambda c: probe(cluster, c, family), todo)
                    for case, obs in zip(todo, seen, strict=True):
                        observations[case.id] = obs
                timings[f"phase {phase}"] = round(time.monotonic() - t, 1)
        finally:
            failures = cluster.stop()
        assert not failures, f"agent --cleanup failed: {failures}"
    timings["total"] = round(time.monotonic() - t0, 1)
    return ModeRun(mode, observations, timings, family)
