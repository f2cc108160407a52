"""The two load generators, both run inside the client pod, and the CPU bookkeeping around them.

* New connections per second: `wrk` with a `Connection: close` request header, so every request is a
  fresh TCP connection (nginx answers and closes; wrk reconnects). wrk is compiled C on epoll, one
  event loop per thread: it is not the Python client that tops out near 8k connections/s.
* Connect latency: bench/probe.py, sequential blocking connects (see its docstring).
* While wrk runs, the CPU time of the nginx worker(s) and of the whole machine is sampled from /proc,
  so each row says whether the server was the bottleneck (a worker near 100 % of a core would be).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lab import Lab
from lab.core import Host

PROBE = str(Path(__file__).with_name("probe.py"))
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Load:
    conns_per_s: float
    requests: int
    errors: int
    seconds: float
    server_cpu_pct: float  # CPU time of the nginx workers over wall time, % of one core
    machine_busy_pct: float  # all CPUs, % of their total
    others_pct: float  # busy time not spent by the lab's processes (other work on the machine), % of all
    error_kinds: str = ""  # wrk's own words: "connect 0, read 2, write 0, timeout 0; non-2xx 0"


def children(pid: int) -> list[int]:
    """Direct children of a process (nginx's master -> its workers)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            continue
    return out


@contextlib.contextmanager
def pinned(pids: list[int], cpu: int) -> Iterator[None]:
    """Pin processes to one CPU for the block, then let them run anywhere again."""
    everywhere = os.sched_getaffinity(0)
    for pid in pids:
        os.sched_setaffinity(pid, {cpu})
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(pid, everywhere)


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def machine_ticks() -> tuple[int, int]:
    """(total, idle + iowait) jiffies of all CPUs."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    return sum(values), values[3] + values[4]


def cgroup_usage_s(path: str | None) -> float:
    """CPU time of a cgroup v2 subtree (cpu.stat usage_usec), seconds; 0 without cgroups."""
    if not path:
        return 0.0
    try:
        with open(os.path.join(path, "cpu.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
    except FileNotFoundError:
        pass
    return 0.0


_RATE = re.compile(r"^\s*(\d+) requests in ([\d.]+)(m?s)", re.MULTILINE)
_PER_S = re.compile(r"^Requests/sec:\s+([\d.]+)", re.MULTILINE)
_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")
_NON2XX = re.compile(r"Non-2xx or 3xx responses: (\d+)")


def parse_wrk(text: str) -> tuple[int, float, float, int, str]:
    """(requests, seconds, requests per second, errors, error kinds) from wrk's report."""
    m = _RATE.search(text)
    r = _PER_S.search(text)
    if not m or not r:
        raise ValueError(f"no rate in wrk output:\n{text}")
    requests, seconds = int(m.group(1)), float(m.group(2))
    if m.group(3) == "ms":
        seconds /= 1000
    errors = 0
    kinds = []
    if e := _ERRORS.search(text):
        # "read" errors count resets/EOFs on reads; with Connection: close they are real failures too.
        errors += sum(int(g) for g in e.groups())
        kinds.append(e.group(0))
    if n := _NON2XX.search(text):
        errors += int(n.group(1))
        kinds.append(n.group(0))
    return requests, seconds, float(r.group(1)), errors, "; ".join(kinds)


def wrk(
    lab: Lab,
    client: Host,
    addr: str,
    port: int,
    *,
    seconds: int,
    threads: int,
    connections: int,
    server_pids: list[int],
    lab_cgroup: str | None,
) -> Load:
    """`wrk -H 'Connection: close'` from inside `client` for `seconds`; conns/s and CPU while it ran.

    A hang (wrk's first, blocking connect() never completing) fails after `seconds + 15`.
    """
    cpu0 = sum(process_cpu_s(p) for p in server_pids)
    lab0 = cgroup_usage_s(lab_cgroup)
    total0, idle0 = machine_ticks()
    wall0 = time.monotonic()
    res = lab.run(
        client,
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{seconds}s",
        "--timeout",
        "2s",
        "-H",
        "Connection: close",
        f"http://{url_host(addr)}:{port}/",
        timeout=seconds + 15,
    )
    wall = time.monotonic() - wall0
    total1, idle1 = machine_ticks()
    lab1 = cgroup_usage_s(lab_cgroup)
    cpu1 = sum(process_cpu_s(p) for p in server_pids)
    requests, took, per_s, errors, kinds = parse_wrk(res.stdout)
    busy = 100.0 * (1 - (idle1 - idle0) / max(1, total1 - total0))
    lab_pct = 100.0 * (lab1 - lab0) / ((os.cpu_count() or 1) * wall)
    return Load(
        conns_per_s=per_s,
        requests=requests,
        errors=errors,
        seconds=took,
        server_cpu_pct=100.0 * (cpu1 - cpu0) / wall,
        machine_busy_pct=busy,
        others_pct=max(0.0, busy - lab_pct) if lab_cgroup else float("nan"),
        error_kinds=kinds,
    )


def url_host(addr: str) -> str:
    """An address as a URL's host: an IPv6 one in brackets."""
    return f"[{addr}]" if ":" in addr else addr


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (NaN when empty)."""
    if not sorted_values:
        return float("nan")
    rank = min(len(sorted_values), max(1, math.ceil(q * len(sorted_values))))
    return float(sorted_values[rank - 1])


def connect_samples(
    lab: Lab, client: Host, addr: str, port: int, *, count: int, max_s: float, cpu: int | None
) -> tuple[list[int], dict[str, int]]:
    """bench/probe.py inside `client`, on CPU `cpu` (None: wherever the scheduler puts it): `count`
    sequential connects to addr:port.

    Returns (ns per connect, errors by kind).
    """
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    res = lab.run(
        client,
        *pin,
        sys.executable,
        "-I",
        "-S",
        PROBE,
        addr,
        str(port),
        str(count),
        str(max_s),
        timeout=max_s + 30,
    )
    out = json.loads(res.stdout)
    return [int(x) for x in out["ns"]], {str(k): int(v) for k, v in out["errors"].items()}
