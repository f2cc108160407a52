"""agent.nodeinit.reads_in_process: which reads it answers from a thread, which it leaves to the tool.

A thread that joined a namespace sees that namespace's /proc/sys only: /proc/net and /sys/class/net
would show the host's, so those must still go through `ip netns exec NS cat`. The lab test
(tests/iptables/test_lab_conntrack.py) checks the values read in a real namespace.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from agent import nodeinit
from agent.iptables.conntrack_sysctls import HASHSIZE_PATH
from agent.iptables.runner import Result


def test_only_sysctls_and_the_hash_size_are_read_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    asked: list[list[str]] = []

    def fake_read(path: str) -> str:
        read.append(path)
        return "in-process\n"

    def command(argv: Sequence[str]) -> Result:
        asked.append(list(argv))
        return Result(0, "tool\n", "")

    monkeypatch.setattr(nodeinit, "_read", fake_read)
    run = nodeinit.reads_in_process(command, "")
    inside = [
        ["sysctl", "-n", "net.netfilter.nf_conntrack_max"],
        ["cat", "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established"],
        ["cat", HASHSIZE_PATH],
    ]
    outside = [
        ["cat", "/proc/net/nf_conntrack"],
        ["cat", "/sys/class/net/eth0/mtu"],
        ["cat", "/proc/sys/../net/dev"],
        ["cat", "/sys/module/nf_conntrack/parameters/expect_hashsize"],
    ]
    assert [run(argv).stdout for argv in inside] == ["in-process\n"] * 3
    assert [run(argv).stdout for argv in outside] == ["tool\n"] * 4
    assert read == [
        "/proc/sys/net/netfilter/nf_conntrack_max",
        "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established",
        HASHSIZE_PATH,
    ]
    assert asked == outside
