"""Which pod namespaces the socket terminator walks, and what it says about those it cannot see
(the kernel walk itself: test_datapath_sockets.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from agent.ebpf.sockterm import SocketTerminator, pod_namespaces


def own_netns() -> tuple[int, int]:
    st = os.stat("/proc/self/ns/net")
    return st.st_dev, st.st_ino


def test_processes_outside_our_pid_namespace_are_counted_not_walked(tmp_path: Path) -> None:
    # cgroup.procs as read from a container without the host's PID namespace: the kernel lists
    # each process it cannot number there as 0
    (tmp_path / "cgroup.procs").write_text("0\n0\n")
    child = tmp_path / "pod"
    child.mkdir()
    (child / "cgroup.procs").write_text(f"{os.getpid()}\n0\n")
    namespaces, hidden = pod_namespaces(str(tmp_path), (0, 0))
    assert hidden == 3
    assert list(namespaces.values()) == [f"/proc/{os.getpid()}/ns/net"]
    namespaces, hidden = pod_namespaces(str(tmp_path), own_netns())
    assert (namespaces, hidden) == ({}, 3), "the node's own namespace is never a pod's"


def test_unseen_pods_are_said_once_with_what_to_do(caplog: pytest.LogCaptureFixture) -> None:
    term = SocketTerminator(-1, "", "/sys/fs/cgroup/kubepods", pods=True, ended=lambda: 0)
    with caplog.at_level(logging.WARNING, logger="agent.ebpf.sockterm"):
        term.warn_hidden(0)
        assert not caplog.records
        term.warn_hidden(5)
        term.warn_hidden(7)
    [record] = caplog.records
    text = record.getMessage()
    assert text.startswith("5 process(es) in cgroup /sys/fs/cgroup/kubepods are outside")
    assert "hostPID: true" in text and "--bpf-socket-lb-host-namespace-only=true" in text
