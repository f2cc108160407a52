"""lab/cpurace.py's own behaviour at its edges: a deadline that comes first ends the race with the
rounds run (the caller's count then fails with its own message), and a fork that fails leaves no
child behind."""

from __future__ import annotations

import os
import time
from typing import Any, cast

import pytest

from lab import cpurace
from lab.packets import PreparedRun

# Both children on one CPU this process may run on (CPU 0 need not be in its affinity mask: a
# container's cpuset, taskset): race_rounds pins each child to its CPU.
CPU = sorted(os.sched_getaffinity(0))[0]


def noop_runs(n: int) -> list[list[PreparedRun]]:
    """Two CPUs' runs that do nothing (a race_rounds run only calls them)."""
    return [[cast(PreparedRun, lambda: None)] * n for _ in (0, 1)]


def test_a_deadline_before_the_rounds_end_returns_the_rounds_both_children_ran() -> None:
    """before_round outlasting the deadline: the children stop waiting for a round that will not
    come, successfully, and race_rounds says how many rounds ran (none) instead of raising."""
    assert cpurace.race_rounds([CPU, CPU], noop_runs(5), lambda: time.sleep(0.4), timeout_s=0.2) == 0


def test_the_rounds_all_run_within_the_deadline() -> None:
    assert cpurace.race_rounds([CPU, CPU], noop_runs(20), lambda: None, timeout_s=30) == 20


def test_a_failed_second_fork_stops_and_reaps_the_first_child(monkeypatch: pytest.MonkeyPatch) -> None:
    forked: list[int] = []
    real_fork = os.fork

    def fork_once() -> int:
        if forked:
            raise OSError(11, "fork refused (the test's)")
        pid = real_fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(cast(Any, cpurace).os, "fork", fork_once)
    with pytest.raises(OSError, match="fork refused"):
        cpurace.race_rounds([CPU, CPU], noop_runs(5), lambda: None, timeout_s=30)
    assert len(forked) == 1
    with pytest.raises(ChildProcessError):  # reaped already
        os.waitpid(forked[0], os.WNOHANG)
