"""What one EndpointSlice change costs once a node holds the whole state: `python -m bench.changecost`.

The API part of `make bench` times a change from the server's write to the pinned map, beside other
jobs on a shared machine: its p99 at 50,000 Services says a change is slow now and then, not why.
This builds the state in one process as `bench.firstsync` does (the real reflector and the real
`Agent`, its eBPF proxier over maps that keep bytes as the kernel would; no HTTP, no bpf()), syncs
it once, then makes `--changes` changes as the bench does (a slice gains an 11th endpoint, then
goes back to the one listed) through `Agent.deliver` and one run of the agent's sync, and times
each phase of each change:

* **read**: `Agent.deliver` (the object read into the model's record, queued);
* **commit**: the model re-evaluates the touched Service;
* **plan** / **flush**: the planner's update and its writes (agent/ebpf/planner.py);
* **sync**: the proxier's whole sync; **run**: the agent's whole run (`sync_once`), the rest of it
  being the agent's own bookkeeping after the proxier (metrics, health, the log line);
* **cpu**: the process's CPU time over the change (the wall total less what other jobs took);
* **gc**: the collector's passes inside the change (gc.callbacks), with their generation.

The slowest changes are listed with what each phase took, so a tail is attributed, not guessed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from agent.collector import StartHold, set_thresholds
from agent.config import Config
from agent.daemon import Agent, Parts
from agent.ebpf import snapshot
from agent.ebpf.abi import MAPS
from agent.ebpf.entries import from_dump
from agent.ebpf.planner import Planner
from agent.keptrecords import KeptRecords, identity, records_path
from agent.kube.reflector import Reflector, WatchSettings
from agent.kube.resources import Resource
from agent.sources.base import EventType, Kind, ObjectEvent, Sink, object_key
from bench.firstsync import NODE, KernelMap, _Server, pages, proxier
from lab.fakeapi.objects import scale_objects


class _Source:
    kinds = frozenset({Kind.SERVICE, Kind.ENDPOINT_SLICE})

    def start(self, sink: Sink) -> None:
        return None

    def stop(self) -> None:
        return None


class Phases:
    """Wall time (perf_counter) spent in wrapped calls and in the collector, since `reset`."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.collections: list[tuple[int, float]] = []
        self._gc_began = 0.0

    def reset(self) -> None:
        self.spent = {}
        self.cpu = {}
        self.collections = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            began, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - began
                self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - cpu

        return timed

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self.collections.append((info["generation"], time.perf_counter() - self._gc_began))


def grown(obj: dict[str, Any], n: int) -> dict[str, Any]:
    """The slice with one more endpoint (as bench/api.py's "grow"), a new resourceVersion."""
    sl = copy.deepcopy(obj)
    extra = {**sl["endpoints"][0], "addresses": [f"10.250.{n >> 8 & 255}.{n & 255}"]}
    sl["endpoints"] = [*sl["endpoints"], extra]
    sl["metadata"]["resourceVersion"] = str(200_000 + 2 * n)
    return sl


def run(
    services: int, endpoints: int, changes: int, top: int, stop_dir: str | None = None, periodic: int = 0
) -> str:
    set_thresholds()
    objects = scale_objects(services, endpoints)
    by_kind = {kind: pages(objects, kind) for kind in ("Service", "EndpointSlice")}
    slices = [o for o in objects if o["kind"] == "EndpointSlice"]
    del objects
    maps = {role: KernelMap(spec) for role, spec in MAPS.items()}
    # As the API part (--iptables-sync-period=1h): no periodic resync among the changes timed (on a
    # loaded machine the lists alone outlast the default 30 s); `resync` times one on purpose.
    config = Config(hostname="node1", pin_path="/nonexistent", socket_lb=False, sync_period_s=3600.0)
    px = proxier(maps, stop_dir)
    records = KeptRecords(records_path(stop_dir, config.pin_path), identity(config)) if stop_dir else None
    agent = Agent(
        config,
        Parts(source=_Source(), proxier=px, node_context=lambda: NODE, records=records, close=px.close),
    )
    hold = StartHold()  # as agent.app: no automatic collection until the first full sync
    began = time.process_time()
    for kind, todo in (
        (Kind.SERVICE, by_kind["Service"]),
        (Kind.ENDPOINT_SLICE, by_kind["EndpointSlice"]),
    ):
        stopping = threading.Event()
        Reflector(
            Resource(kind, "v1", _Server((todo[0], list(todo[1])), stopping)),
            agent.deliver,
            WatchSettings(),
            stopping,
        ).run()
    assert agent.runner.run_once(), "the first sync failed"
    hold.release()
    synced_cpu = time.process_time() - began
    del by_kind
    for m in maps.values():
        m._dict()  # a kernel map deletes in place: not the bench map's one-off unpacking

    phases = Phases()
    px.sync = phases.wrap("sync", px.sync)  # type: ignore[method-assign]
    agent.model.commit = phases.wrap("commit", agent.model.commit)  # type: ignore[method-assign]
    update, flush = Planner.update, Planner.flush
    Planner.update = phases.wrap("plan", update)  # type: ignore[method-assign]
    Planner.flush = phases.wrap("flush", flush)  # type: ignore[method-assign]
    gc.callbacks.append(phases.on_gc)
    rows: list[dict[str, Any]] = []
    step = max(1, services // changes)
    try:
        for i in range(changes):
            base = slices[(i // 2) * step % len(slices)]
            obj = grown(base, i) if i % 2 == 0 else copy.deepcopy(base)
            if i % 2:
                obj["metadata"]["resourceVersion"] = str(200_000 + 2 * i + 1)
            event = ObjectEvent(
                Kind.ENDPOINT_SLICE, EventType.MODIFIED, object_key(Kind.ENDPOINT_SLICE, obj), obj
            )
            phases.reset()
            writes = sum(m.writes for m in maps.values())
            c0, t0 = time.process_time(), time.perf_counter()
            agent.deliver([event])
            t1 = time.perf_counter()
            assert agent.runner.run_once(), f"change {i} failed"
            t2, c2 = time.perf_counter(), time.process_time()
            # a change that wrote nothing would time a no-op, not the path
            assert sum(m.writes for m in maps.values()) > writes, f"change {i} wrote nothing"
            rows.append(
                {
                    "i": i,
                    "total": t2 - t0,
                    "cpu": c2 - c0,
                    "read": t1 - t0,
                    "run": t2 - t1,
                    **phases.spent,
                    "gc": sum(d for _, d in phases.collections),
                    "gcs": list(phases.collections),
                }
            )
    finally:
        gc.callbacks.remove(phases.on_gc)
        setattr(Planner, "update", update)  # noqa: B010 - a method put back
        setattr(Planner, "flush", flush)  # noqa: B010
    out = report(services, endpoints, synced_cpu, rows, top)
    for _ in range(periodic):
        out += "\n" + resync(agent, px, maps, phases)
    if stop_dir is not None:
        out += "\n" + stop(agent, px, records, phases)
    return out


def resync(agent: Agent, px: Any, maps: dict[str, KernelMap], phases: Phases) -> str:
    """One periodic full resync (every --sync-period, 30 s by default) with nothing to repair."""
    for m in maps.values():
        m.settle()  # packed again: the dump below is what a kernel's batch read costs the agent, not a dict's
    phases.reset()
    dump, reconcile = px._dump, Planner.reconcile
    px._dump = phases.wrap("read back", dump)
    Planner.reconcile = phases.wrap("reconcile", reconcile)  # type: ignore[method-assign]
    agent._last_full = time.monotonic() - 10 * agent._config.sync_period_s
    gc.callbacks.append(phases.on_gc)
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        assert agent.runner.run_once(), "the resync failed"
    finally:
        gc.callbacks.remove(phases.on_gc)
        px._dump = dump
        setattr(Planner, "reconcile", reconcile)  # noqa: B010 - a method put back
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    parts = ", ".join(f"{k} {phases.cpu[k]:.2f} CPU s" for k in phases.spent)
    gcs = sum(d for _, d in phases.collections)
    return (
        f"periodic resync: {cpu:.2f} CPU s, {wall:.2f} wall s ({parts}; collections "
        f"{len(phases.collections)}, {gcs:.2f} s)"
    )


def stop(agent: Agent, px: Any, records: KeptRecords | None, phases: Phases) -> str:
    """The agent's clean stop (`Agent.shutdown`): what it writes for the next start, phase by phase."""
    phases.reset()
    dump, write = px._dump, snapshot.write
    save = records.save if records is not None else None
    px._dump = phases.wrap("read the maps back", dump)
    setattr(snapshot, "from_dump", phases.wrap("decode and compare", from_dump))  # noqa: B010
    setattr(snapshot, "write", phases.wrap("write the planner", write))  # noqa: B010
    if records is not None and save is not None:
        records.save = phases.wrap("write the records", save)  # type: ignore[method-assign]
    gc.callbacks.append(phases.on_gc)
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        agent.shutdown()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    finally:
        # put back as resync() does: a later bench in the same process times the real functions
        gc.callbacks.remove(phases.on_gc)
        px._dump = dump
        setattr(snapshot, "from_dump", from_dump)  # noqa: B010
        setattr(snapshot, "write", write)  # noqa: B010
        if records is not None and save is not None:
            records.save = save  # type: ignore[method-assign]
    parts = ", ".join(f"{k} {phases.cpu[k]:.2f} CPU s ({v:.2f} wall)" for k, v in phases.spent.items())
    gcs = sum(d for _, d in phases.collections)
    return (
        f"stop: {cpu:.2f} CPU s, {wall:.2f} wall s ({parts}; collections {len(phases.collections)}, "
        f"{gcs:.2f} s)"
    )


def _ms(xs: Sequence[float]) -> str:
    s = sorted(xs)

    def p(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return f"p50 {p(0.5) * 1000:.2f} / p99 {p(0.99) * 1000:.2f} / max {s[-1] * 1000:.2f} ms"


def report(services: int, endpoints: int, synced_cpu: float, rows: list[dict[str, Any]], top: int) -> str:
    names = ("total", "cpu", "read", "run", "commit", "sync", "plan", "flush", "gc")
    lines = [
        f"{services:,} services x {endpoints} endpoints: lists and first sync {synced_cpu:.2f} CPU s; "
        f"{len(rows)} changes (wall, one process)"
    ]
    for name in names:
        lines.append(f"  {name:7s} {_ms([r.get(name, 0.0) for r in rows])}")
    gens = [g for r in rows for g, _ in r["gcs"]]
    lines.append(
        "  collections in changes: "
        + ", ".join(f"gen{g} x{gens.count(g)}" for g in sorted(set(gens)))
        + f" (mean total {statistics.mean(r['gc'] for r in rows) * 1000:.2f} ms per change)"
    )
    lines.append(f"  slowest {top}:")
    for r in sorted(rows, key=lambda r: -r["total"])[:top]:
        parts = " ".join(f"{n} {r.get(n, 0.0) * 1000:.2f}" for n in names)
        gcs = " ".join(f"gen{g}:{d * 1000:.1f}ms" for g, d in r["gcs"])
        lines.append(f"    change {r['i']:4d}: {parts} [{gcs}]")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.changecost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--changes", type=int, default=400)
    ap.add_argument("--top", type=int, default=10, help="the slowest changes listed with their phases")
    ap.add_argument(
        "--stop-dir",
        help="time the agent's clean stop too, leaving the planner and the records in this directory",
    )
    ap.add_argument(
        "--periodic", type=int, default=0, help="time this many periodic full resyncs after the changes"
    )
    a = ap.parse_args(argv)
    print(run(a.services, a.endpoints, a.changes, a.top, a.stop_dir, a.periodic))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
