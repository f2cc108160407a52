"""Two BPF_PROG_TEST_RUN calls at the same moment on two CPUs, round after round: what shows a race
between two CPUs' runs of a data path program (two new flows claiming one conntrack tuple).

Each CPU gets a forked child pinned to it (Python threads would take turns at the GIL); for each
round the parent announces a start time half a millisecond ahead in shared memory, both children
spin until it and make their call (`PreparedRun`: nothing but the system call left to do), and the
parent waits for both before the next round. Most rounds still run one after the other: the race
is timing, a few rounds in a hundred here.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import mmap
import os
import time
from collections.abc import Callable, Sequence

from lab.packets import PreparedRun

_LEAD_NS = 500_000  # the start time's lead over its announcement: both children are spinning by then


def race_rounds(
    cpus: Sequence[int],
    runs: Sequence[Sequence[PreparedRun]],
    before_round: Callable[[], None],
    timeout_s: float,
) -> int:
    """Runs round r's runs[0][r] on cpus[0] and runs[1][r] on cpus[1] at one moment, before_round()
    ahead of each round, every round or until `timeout_s`; the rounds both children ran (fewer
    than asked when the deadline came first: the caller's count says so). Raises when a child
    failed."""
    assert len(cpus) == len(runs) == 2
    shared = mmap.mmap(-1, 32)  # anonymous and shared: the children see the parent's stores
    # the round announced (-1: stop), its start (monotonic ns), the last round each child ran
    words = (ct.c_int64 * 4).from_buffer(shared)
    deadline = time.monotonic() + timeout_s
    children: list[int] = []
    rounds, total = 0, min(len(runs[0]), len(runs[1]))
    try:
        for i in (0, 1):  # inside the try: a failed second fork still stops and reaps the first
            children.append(_child(cpus[i], runs[i], words, i, deadline))
        while rounds < total and time.monotonic() < deadline:
            before_round()
            words[1] = time.monotonic_ns() + _LEAD_NS
            words[0] = rounds + 1
            while (words[2], words[3]) != (rounds + 1, rounds + 1) and time.monotonic() < deadline:
                time.sleep(50e-6)
            if (words[2], words[3]) != (rounds + 1, rounds + 1):
                break  # the deadline came before both ran this round
            rounds += 1
    finally:
        words[0] = -1
        statuses = [os.waitpid(pid, 0)[1] for pid in children]
        del words
        # a raising fork's traceback still holds a view of the memory (_child's argument): the
        # mapping then goes with the traceback instead
        with contextlib.suppress(BufferError):
            shared.close()
    if statuses != [0, 0]:
        raise RuntimeError(f"a racing child failed: wait statuses {statuses}")
    return rounds


def _child(
    cpu: int, runs: Sequence[PreparedRun], words: ct.Array[ct.c_int64], me: int, deadline: float
) -> int:
    """A child on `cpu` that runs runs[r - 1] at round r's start; its pid (to the parent)."""
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        os.sched_setaffinity(0, {cpu})
        for r, run in enumerate(runs, start=1):
            while words[0] != r:
                if words[0] < 0 or time.monotonic() > deadline:
                    status = 0  # the parent stopped, or the time is up, before this round
                    return 0
                time.sleep(20e-6)
            start = words[1]
            while time.monotonic_ns() < start:
                pass
            run()
            words[2 + me] = r
        status = 0
    finally:
        os._exit(status)
