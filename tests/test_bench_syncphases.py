"""bench.syncphases: the agent's CPU is its own process's; its reaped children's is reported apart; its
maps are sized for the Services it is given."""

from __future__ import annotations

import os
import time

from bench.syncphases import _children_cpu_s, _cpu_s, agent_flags, record


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


def test_the_agent_gets_the_map_sizes_the_api_bench_gives_it_at_50000_services() -> None:
    flags = agent_flags(50_000, 10)
    assert "--bpf-be-max=589824" in flags and "--bpf-addr-max=655360" in flags
    assert agent_flags(10_000, 10) == ["--iptables-sync-period=1h"]  # the defaults hold 10,000


def test_each_output_line_says_the_map_sizes_the_agent_was_given() -> None:
    line = record("main", 50_000, 10, 1.0, {"cold": {}, "restart": {}})
    assert line["flags"] == agent_flags(50_000, 10)
    assert "--bpf-be-max=589824" in line["flags"]
