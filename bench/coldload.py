"""How long the agent's load of the data path takes at a cold start (no pinned programs of its build).

    python -m bench.coldload [--ipv6-tc off|on] [--xdp on|off] [--runs 3]

Each run mounts a fresh bpffs of its own, times `Datapath.load()` there (maps created, every
program of the build loaded by the verifier and pinned; the compiled object from the machine's
compile cache, compiled in a child by an untimed first load when missing) and unmounts it.
Printed per run: the wall time of load() and the CPU time of this process in it (the verifier
runs in the loading threads). Nothing is attached. On a shared machine the wall time grows with
the load; compare runs alternated in one session, not figures taken apart. `--xdp off` loads what
`--bpf-xdp=disabled` does (MapSizes.xdp: neither XDP program), `on` what every other mode does.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from agent.config import MapSizes
from agent.ebpf.loader import Datapath
from lab.packets import bpffs


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cold_load(sizes: MapSizes) -> tuple[float, float, int]:
    """One cold load in a fresh bpffs: (wall s, process CPU s, programs loaded)."""
    with bpffs() as root:
        dp = Datapath(str(root / "ekp"), sizes)
        wall, cpu = time.perf_counter(), _cpu_s()
        dp.load()
        wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
        try:
            return wall, cpu, len(dp.programs())
        finally:
            dp.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.coldload", description=__doc__.split("\n\n")[0])
    p.add_argument("--ipv6-tc", choices=("off", "on"), default="off", help="MapSizes.ipv6_tc")
    p.add_argument(
        "--xdp", choices=("on", "off"), default="on", help="MapSizes.xdp (off: --bpf-xdp=disabled)"
    )
    p.add_argument("--runs", type=int, default=3)
    ns = p.parse_args(argv)
    sizes = replace(MapSizes(), ipv6_tc=ns.ipv6_tc == "on", xdp=ns.xdp == "on")
    cold_load(sizes)  # untimed: fills the compile cache when the build is not in it
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    dp = Datapath("/unused", sizes)
    print(
        f"build {dp.build()}, load {dp.load_id(dp.programs())}, ipv6_tc {ns.ipv6_tc}, xdp {ns.xdp}, "
        f"load average {load}"
    )
    for run in range(ns.runs):
        wall, cpu, programs = cold_load(sizes)
        print(
            f"run {run + 1}: {programs} programs, load() {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
