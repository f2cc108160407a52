"""The eBPF programs' own cost per packet: kernel.bpf_stats_enabled run time over run count.

`kernel.bpf_stats_enabled` is one global switch of the machine (not per namespace): `enabled()`
records the old value, sets 1, and always puts the old value back. While it is on, the kernel adds
two clock reads around every BPF program run, so the throughput and latency rows are measured with
it off and the cost is read in a separate window.

Only the lab agent's programs are read: their ids come from the tc hooks of the lab node's devices
(tcx links or clsact filters, agent/ebpf/attach.py `hook_programs`; other labs on the same machine
load programs with the same names).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from agent.ebpf import attach
from agent.netns import netns_route
from lab import Lab
from lab.core import Node

SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"


@contextlib.contextmanager
def enabled() -> Iterator[str]:
    """Turn kernel.bpf_stats_enabled on for the block; yields the value it had before."""
    with open(SYSCTL) as f:
        old = f.read().strip()
    try:
        with open(SYSCTL, "w") as f:
            f.write("1\n")
        yield old
    finally:
        with open(SYSCTL, "w") as f:
            f.write(old + "\n")


@dataclass(frozen=True)
class Prog:
    id: int
    name: str
    where: str  # "lxc-p1 ingress"


def attached_programs(lab: Lab, node: Node, hooks: tuple[str, ...] = ("ingress", "egress")) -> list[Prog]:
    """BPF programs attached to tc `hooks` of the node's devices (eth0 and every pod veth), through
    tcx links or clsact filters (`--bpf-tc-attach`)."""
    progs: dict[int, Prog] = {}
    with netns_route(node.ns) as ipr:
        for dev in [node.iface, *node.pod_ifaces]:
            found = ipr.link_lookup(ifname=dev)
            if not found:
                continue
            for hook in hooks:
                for p in attach.hook_programs(ipr, node.ns, int(found[0]), hook):
                    if not p.prog_id:
                        continue
                    where = f"{dev} {hook}"
                    if p.prog_id in progs:
                        where = f"{progs[p.prog_id].where}, {where}"
                    progs[p.prog_id] = Prog(p.prog_id, p.name or "?", where)
    return sorted(progs.values(), key=lambda p: (p.name, p.id))


def run_counters(prog_id: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of one program, from bpftool (0, 0 before stats were ever on)."""
    res = subprocess.run(
        ["bpftool", "-j", "prog", "show", "id", str(prog_id)],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    info = json.loads(res.stdout)
    return int(info.get("run_time_ns", 0)), int(info.get("run_cnt", 0))


@dataclass(frozen=True)
class Cost:
    name: str
    runs: int
    ns_per_run: float


def snapshot(progs: list[Prog]) -> dict[int, tuple[int, int]]:
    return {p.id: run_counters(p.id) for p in progs}


def costs(
    progs: list[Prog], before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]
) -> list[Cost]:
    """Per program name (a name attached to several devices is one program, or summed): ns per run."""
    by_name: dict[str, list[int]] = {}
    for p in progs:
        t0, c0 = before[p.id]
        t1, c1 = after[p.id]
        acc = by_name.setdefault(p.name, [0, 0])
        acc[0] += t1 - t0
        acc[1] += c1 - c0
    return [
        Cost(name, runs, (ns / runs) if runs else float("nan"))
        for name, (ns, runs) in sorted(by_name.items())
    ]
