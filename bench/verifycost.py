"""What the kernel's verifier costs for each program of the data path, at a cold start.

    python -m bench.verifycost [--rounds 3] [--json FILE]

A cold start (no pinned programs of this build) loads every program with BPF_PROG_LOAD, and the
verifier walks each one state by state: seconds of CPU that the first sync waits for before it
attaches (bench/results/scale/ROUNDS.md, "Cold start: what the verifier costs"). This loads
each program of the build the agent would load here (from the machine's compile cache, compiled
in a child when missing) against maps created for the measurement alone (unpinned, gone when it
exits), one program at a time, and reports per program:

* `insns`: the instructions loaded;
* `processed`, `peak states`, `total states`: the verifier's own totals (log level BPF_LOG_STATS,
  "processed N insns (limit 1000000) max_states_per_insn N total_states N peak_states N");
* `verify ms`: the verifier's own "verification time" (the kernel's clock around the walk);
* `load ms` and `CPU ms`: wall and thread CPU time of the whole bpf() call (the verifier, JIT and
  the rest), the median of `--rounds` loads.

Nothing is pinned or attached. The figures are CPU work of one thread: on a shared machine the
wall time grows with the load, the verifier's count of states does not.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from agent.config import MapSizes
from agent.ebpf import bpfsys
from agent.ebpf.bpfobject import BpfObject
from agent.ebpf.compile import compile_in_child
from agent.ebpf.link import load_program
from agent.ebpf.loader import Datapath, load_sizes
from agent.ebpf.programs import PROGRAMS

LOG_STATS = 4  # BPF_LOG_STATS: the totals only
LOG_BYTES = 1 << 16
_PROCESSED = re.compile(
    r"processed (\d+) insns \(limit \d+\) max_states_per_insn (\d+) total_states (\d+) peak_states (\d+)"
)
_TIME = re.compile(r"verification time (\d+) usec")


@dataclass(frozen=True)
class ProgCost:
    name: str
    insns: int
    processed: int
    max_states_per_insn: int
    total_states: int
    peak_states: int
    verify_ms: float  # the verifier's own clock, median
    load_ms: float  # wall time of bpf(BPF_PROG_LOAD), median
    cpu_ms: float  # this thread's CPU time in that call, median


def the_object(dp: Datapath) -> BpfObject:
    """The object a cold agent would load here: the compile cache's, else compiled now. A miss
    compiles under the cache entry's lock, as an agent's does (ObjectCache.compiling): in a fresh
    clone's test run the lab's agents miss the same (default) build at about the same time, and
    without the lock this was a second compile of it."""
    build = dp.build()
    obj = dp.cache.get(build)
    if obj is None:
        with dp.cache.compiling(build):
            obj = dp.cache.get(build)  # compiled by whoever held the lock while we waited
            if obj is None:
                types = {name: spec.prog_type for name, spec in PROGRAMS.items()}
                obj, _ = compile_in_child(dp.entry_file, dp.cflags(), build, types)
                dp.cache.put(obj)
    # What the agent's load takes of it: the programs this kernel and these sizes load, the maps
    # at the sizes the load creates (the object declares placeholders: loader.compile_cflags).
    programs, sizes = dp.programs(), load_sizes(dp.sizes)
    return replace(
        obj,
        maps=tuple(replace(m, max_entries=sizes.get(m.name, m.max_entries)) for m in obj.maps),
        programs=tuple(p for p in obj.programs if p.name in programs),
    )


def _create_maps(obj: BpfObject) -> list[int]:
    btf_fd = bpfsys.btf_load(obj.btf) if obj.btf else -1
    fds = []
    try:
        for m in obj.maps:
            args = (m.type, m.key_size, m.value_size, m.max_entries, m.flags, m.name)
            fd = bpfsys.map_create(*args, max(btf_fd, 0), m.btf_key_type_id, m.btf_value_type_id)
            if fd < 0:
                fd = bpfsys.map_create(*args)
            if fd < 0:
                raise OSError(-fd, f"creating map {m.name}: {os.strerror(-fd)}")
            fds.append(fd)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        if btf_fd >= 0:
            os.close(btf_fd)
    return fds


def _load_once(obj: BpfObject, name: str, map_fds: list[int]) -> tuple[str, float, float]:
    """One load with the verifier's totals: (its log, wall s, thread CPU s)."""
    buf = ctypes.create_string_buffer(LOG_BYTES)
    wall, cpu = time.perf_counter(), time.thread_time()
    fd = load_program(obj, name, map_fds, log=buf, log_level=LOG_STATS)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    text = buf.value.decode(errors="replace")
    if fd < 0:
        raise OSError(-fd, f"loading {name}: {os.strerror(-fd)}\n{text[-2000:]}")
    os.close(fd)
    return text, wall, cpu


def measure(obj: BpfObject, rounds: int) -> list[ProgCost]:
    map_fds = _create_maps(obj)
    try:
        out = []
        for prog in sorted(obj.programs, key=lambda p: -len(p.insns)):
            logs, walls, cpus, verify = [], [], [], []
            for _ in range(rounds):
                text, wall, cpu = _load_once(obj, prog.name, map_fds)
                logs.append(text)
                walls.append(wall)
                cpus.append(cpu)
                t = _TIME.search(text)
                verify.append(int(t.group(1)) / 1000 if t else float("nan"))
            m = _PROCESSED.search(logs[-1])
            if m is None:
                raise RuntimeError(f"{prog.name}: no verifier totals in its log: {logs[-1][-500:]!r}")
            processed, per_insn, total, peak = (int(g) for g in m.groups())
            out.append(
                ProgCost(
                    name=prog.name,
                    insns=len(prog.insns) // 8,
                    processed=processed,
                    max_states_per_insn=per_insn,
                    total_states=total,
                    peak_states=peak,
                    verify_ms=statistics.median(verify),
                    load_ms=statistics.median(walls) * 1000,
                    cpu_ms=statistics.median(cpus) * 1000,
                )
            )
        return out
    finally:
        for fd in map_fds:
            os.close(fd)


def table(costs: Sequence[ProgCost]) -> str:
    head = "| program | insns | processed | peak states | total states | verify ms | load ms | CPU ms |"
    rows = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in costs:
        rows.append(
            f"| {c.name} | {c.insns} | {c.processed} | {c.peak_states} | {c.total_states} | "
            f"{c.verify_ms:.0f} | {c.load_ms:.0f} | {c.cpu_ms:.0f} |"
        )
    rows.append(
        f"| all {len(costs)} | {sum(c.insns for c in costs)} | {sum(c.processed for c in costs)} | "
        f"{sum(c.peak_states for c in costs)} | {sum(c.total_states for c in costs)} | "
        f"{sum(c.verify_ms for c in costs):.0f} | {sum(c.load_ms for c in costs):.0f} | "
        f"{sum(c.cpu_ms for c in costs):.0f} |"
    )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.verifycost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="loads per program (the median is reported)")
    p.add_argument("--json", help="also write the figures here")
    ns = p.parse_args(argv)
    dp = Datapath("/sys/fs/bpf/unused", MapSizes())
    obj = the_object(dp)
    costs = measure(obj, ns.rounds)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"build {obj.build}, {ns.rounds} loads per program, load average {load}")
    print(table(costs))
    if ns.json:
        with open(ns.json, "w") as f:
            doc = {"build": obj.build, "load": float(load), "programs": [asdict(c) for c in costs]}
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
