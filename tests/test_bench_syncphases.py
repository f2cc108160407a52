"""bench.syncphases: the agent's CPU is its own process's; its reaped children's is reported apart."""

from __future__ import annotations

import os
import time

from bench.syncphases import _children_cpu_s, _cpu_s


def test_a_reaped_childs_cpu_is_counted_apart_from_the_process_own() -> None:
    pid = os.getpid()
    own, children = _cpu_s(pid), _children_cpu_s(pid)
    child = os.fork()
    if child == 0:  # burn 0.3 CPU s, then leave without running the parent's cleanup
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        os._exit(0)
    os.waitpid(child, 0)
    assert _children_cpu_s(pid) - children >= 0.25
    assert _cpu_s(pid) - own < 0.2
