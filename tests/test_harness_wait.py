"""lab/harness.py's wait for an agent's sync: the timeout counts the agent's own work, not a compile
of its data path (CPU-bound: several times slower on a loaded machine, where a session lab's first
agents once missed 60 s while compiling and every test of that lab errored)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from agent.ebpf.loader import COMPILING_LOG
from agent.ebpf.objcache import WAITING_LOG
from lab.harness import Agent

TIMEOUT = 0.4


def agent_logging_to(path: Path) -> Agent:
    agent = object.__new__(Agent)  # no lab: only the log is read
    agent.log_path = path
    agent._log_offset = 0
    agent.proc = None
    cast(Any, agent).node = SimpleNamespace(name="node1")
    return agent


def write_later(path: Path, lines: list[tuple[float, str]]) -> threading.Thread:
    def run() -> None:
        for delay, line in lines:
            time.sleep(delay)
            with open(path, "a") as f:
                f.write(line + "\n")

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "start", [COMPILING_LOG + "abc123 (not in the compile cache)", WAITING_LOG + "abc123 (/x)"]
)
def test_a_compile_longer_than_the_timeout_is_waited_out_then_the_sync_counts(
    tmp_path: Path, start: str
) -> None:
    log = tmp_path / "agent.log"
    # a line that says "failed" about something else does not end the compile's allowance
    log.write_text(
        "starting\n" + start + "\nI agent.kube: Service list recovered after 1 failed attempt(s)\n"
    )
    writer = write_later(
        log,
        [
            (
                TIMEOUT * 2.5,
                "data path compiled in 9.9s, build abc123 (ABI v2, maps pinned under /p), ready in 9.9s",
            ),
            (TIMEOUT / 2, "sync done: version=v1 took 1 ms"),
        ],
    )
    try:
        agent_logging_to(log).wait_version("v1", timeout=TIMEOUT)
    finally:
        writer.join()


def test_without_a_compile_the_timeout_holds(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_text("starting\n")
    writer = write_later(log, [(TIMEOUT * 2.5, "sync done: version=v1 took 1 ms")])
    try:
        with pytest.raises(AssertionError, match="did not sync version v1"):
            agent_logging_to(log).wait_version("v1", timeout=TIMEOUT)
    finally:
        writer.join()


def test_a_sync_that_does_not_come_after_the_compile_still_times_out(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_text(COMPILING_LOG + "abc123\n" + "data path compiled in 1s, build abc123, ready in 1.0s\n")
    began = time.monotonic()
    with pytest.raises(AssertionError, match="did not sync version v1"):
        agent_logging_to(log).wait_version("v1", timeout=TIMEOUT)
    assert time.monotonic() - began < TIMEOUT * 3


def test_a_compile_that_failed_is_no_reason_to_wait_longer(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_text(
        COMPILING_LOG
        + "abc123 (not in the compile cache)\n"
        + "W agent.daemon: preparing the ebpf data path failed (the first sync tries again): compiling "
        + "ekp_tc.c failed: boom\n"
        + "I agent.reflector: Service list recovered after 1 failed attempt(s)\n"
        + COMPILING_LOG
        + "abc123 (not in the compile cache)\n"
    )
    began = time.monotonic()
    with pytest.raises(AssertionError, match="did not sync version v1"):
        agent_logging_to(log).wait_version("v1", timeout=TIMEOUT)
    assert time.monotonic() - began < TIMEOUT * 3
