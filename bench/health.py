"""`make bench`'s health part (`--parts health`): how fast /healthz and a healthCheckNodePort
answer while slow clients drip headers (issue 21, item 1).

The lab test (tests/adversarial/test_slow_clients.py) asserts that probes are answered under that
load, with bounds loose enough for a machine shared with the test suite; this measures how fast,
on the quiet machine the bench runs on. The lab is the test's (lab/slowclients.py): per mode, one
agent for node1 of a two-node lab and an ETP=Local LoadBalancer Service whose endpoint is on node1.

Per mode, `probes` probes of each endpoint, alternating: GET /healthz on a fresh connection from
node1 itself (as the kubelet probes it) and GET / on node1's healthCheckNodePort from node2 (as a
load balancer's checker does), each timed from connect() to the whole answer. First with nothing
else connected (the baseline), then with `SLOW` slow clients per port sending one header line every
`DRIP_S` and `IDLE_PER_SOURCE` idle keep-alive connections per port from each of four addresses.
The agent closes those at its request-head deadline, so the loaded probes run in generations: the
clients are opened, probes run until shortly before the first deadline, every client is closed,
and the next generation opens them again (bounded: `MAX_GENERATIONS`).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.httpserve import Limits
from bench.report import Table, num
from bench.traffic import percentile
from lab import Lab
from lab.harness import Cluster
from lab.slowclients import (
    DRIP_S,
    EXTRA,
    HC_PORT,
    HEALTHZ,
    IDLE_PER_SOURCE,
    N1,
    SLOW,
    Drips,
    kept_alive,
    probe,
    set_up,
)

PROBES = 200
MAX_GENERATIONS = 10
MARGIN_S = 0.5  # a generation's probes end this long before its first client's head deadline
ENDPOINTS = ("/healthz", "healthCheckNodePort")
NONE, SLOW_LOAD = "none", "slow + idle"


@dataclass
class Series:
    """One endpoint's probes in one mode under one load: percentiles of the answered ones."""

    mode: str
    endpoint: str
    load: str
    probes: int
    failed: int  # not a 200, or no answer within 2 s
    p50_ms: float
    p99_ms: float
    max_ms: float
    slow_held_min: int | None = None  # the fewest slow clients (both ports) connected at a drip
    generations: int = 0


@dataclass
class Result:
    probes: int
    slow: int = SLOW
    idle_per_source: int = IDLE_PER_SOURCE
    drip_s: float = DRIP_S
    series: list[Series] = field(default_factory=list)
    load_average: list[float] = field(default_factory=list)  # 1-minute, at each mode's start

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "series": [asdict(s) for s in self.series]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Result:
        def ms(v: Any) -> float:  # JSON has no NaN: an unmeasured figure is null
            return float("nan") if v is None else float(v)

        series = [
            Series(**{**s, **{k: ms(s[k]) for k in ("p50_ms", "p99_ms", "max_ms")}}) for s in data["series"]
        ]
        return cls(**{**data, "series": series})


def series(
    mode: str, endpoint: str, load: str, got: list[tuple[int, float]], held: int | None, gens: int
) -> Series:
    ok = sorted(took * 1000 for status, took in got if status == 200)
    return Series(
        mode,
        endpoint,
        load,
        len(got),
        len(got) - len(ok),
        percentile(ok, 0.5),
        percentile(ok, 0.99),
        ok[-1] if ok else float("nan"),
        held,
        gens,
    )


def probe_both(lab: Lab, out: dict[str, list[tuple[int, float]]]) -> None:
    out[ENDPOINTS[0]].append(probe(lab, "node1", "127.0.0.1", HEALTHZ, "/healthz"))
    out[ENDPOINTS[1]].append(probe(lab, "node2", N1, HC_PORT, "/"))


def loaded(lab: Lab, probes: int) -> tuple[dict[str, list[tuple[int, float]]], int, int]:
    """(probes per endpoint, the fewest slow clients held at a drip, generations) under load."""
    head_s = Limits().head_timeout_s
    out: dict[str, list[tuple[int, float]]] = {e: [] for e in ENDPOINTS}
    held_min = 2 * SLOW
    gens = 0
    while len(out[ENDPOINTS[0]]) < probes and gens < MAX_GENERATIONS:
        gens += 1
        idle = kept_alive(lab, N1, HEALTHZ, "/healthz", EXTRA[:4], IDLE_PER_SOURCE)
        slow: list[Drips] = []
        try:
            idle |= kept_alive(lab, N1, HC_PORT, "/", EXTRA[:4], IDLE_PER_SOURCE)
            slow.append(Drips(lab, N1, HEALTHZ, SLOW))
            slow.append(Drips(lab, N1, HC_PORT, SLOW))
            end = min(min(idle.values()), *(d.started for d in slow)) + head_s - MARGIN_S
            next_drip = 0.0
            while time.monotonic() < end and len(out[ENDPOINTS[0]]) < probes:
                if time.monotonic() >= next_drip:
                    held_min = min(held_min, sum(d.drip() for d in slow))
                    next_drip = time.monotonic() + DRIP_S
                probe_both(lab, out)
        finally:
            for d in slow:
                d.close()
            for s in idle:
                s.close()
    return out, held_min, gens


def measure_mode(mode: str, probes: int, result: Result) -> None:
    with Lab(nodes=2, pods_per_node=1) as lab:
        lab.start_podservers()
        c = Cluster(lab, mode, agent_nodes=[1])
        c.start()
        try:
            set_up(c)
            quiet: dict[str, list[tuple[int, float]]] = {e: [] for e in ENDPOINTS}
            for _ in range(probes):
                probe_both(lab, quiet)
            busy, held, gens = loaded(lab, probes)
        finally:
            failures = c.stop()
        if failures:
            raise RuntimeError(f"{mode}: agent --cleanup failed: {'; '.join(failures)}")
    for e in ENDPOINTS:
        result.series.append(series(mode, e, NONE, quiet[e], None, 1))
        result.series.append(series(mode, e, SLOW_LOAD, busy[e], held, gens))
    for s in result.series[-4:]:
        print(
            f"   {mode:<8} {s.endpoint:<19} {s.load:<11} {s.probes:>4} probes  p50 {s.p50_ms:6.2f} ms"
            f"  p99 {s.p99_ms:6.2f} ms  max {s.max_ms:6.2f} ms  failed {s.failed}",
            flush=True,
        )


def measure(modes: list[str], probes: int = PROBES) -> Result:
    result = Result(probes)
    for mode in modes:
        result.load_average.append(round(os.getloadavg()[0], 2))
        measure_mode(mode, probes, result)
    return result


def table(r: Result) -> Table:
    rows = [
        [
            s.mode,
            s.endpoint,
            s.load,
            num(s.probes),
            num(s.p50_ms, 2),
            num(s.p99_ms, 2),
            num(s.max_ms, 2),
            num(s.failed),
            "-" if s.slow_held_min is None else f"{s.slow_held_min} of {2 * r.slow}",
        ]
        for s in r.series
    ]
    return Table(
        "Health probes while slow clients drip headers: /healthz and a healthCheckNodePort (ms)",
        ["mode", "endpoint", "other clients", "probes", "p50", "p99", "max", "failed", "slow held"],
        rows,
        [False, False, False, True, True, True, True, True, True],
        notes=[
            "a probe: GET on a fresh connection, timed from connect() to the whole answer; /healthz from "
            "node1 itself, the healthCheckNodePort from node2; the two alternate; failed: not a 200 "
            "within 2 s (left out of the percentiles)",
            f"slow + idle: {r.slow} slow clients per port, each sending one header line every "
            f"{r.drip_s:g} s, and {4 * r.idle_per_source} idle keep-alive connections per port; slow "
            "held: the fewest slow clients still connected at a drip (the agent closes them at its "
            "request-head deadline, so the probes run in generations that end before it)",
            "load average at each mode's start: " + ", ".join(f"{x:g}" for x in r.load_average),
        ],
    )
