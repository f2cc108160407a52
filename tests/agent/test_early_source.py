"""agent/sources/early.py: a source started before the agent that consumes it exists."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from agent.sources.base import Event, Kind, Sink, Synced
from agent.sources.early import EarlySource


class ThreadedSource:
    """One thread delivering `batches` in order, as a reflector does."""

    kinds = frozenset({Kind.SERVICE})

    def __init__(self, batches: list[list[Event]]) -> None:
        self.batches = batches
        self.started = 0
        self.stopped = False
        self.thread: threading.Thread | None = None
        self.done = threading.Event()

    def start(self, sink: Sink) -> None:
        self.started += 1

        def run() -> None:
            for batch in self.batches:
                sink(batch)
            self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True


def _batches(n: int) -> list[list[Event]]:
    return [[Synced(Kind.SERVICE, str(i))] for i in range(n)]


def test_batches_wait_for_the_agent_then_reach_it_in_order() -> None:
    inner = ThreadedSource(_batches(5))
    early = EarlySource(inner)
    early.begin()
    assert inner.started == 1, "the lists start before the agent exists"
    assert not inner.done.wait(0.2), "the first batch waits for the agent's sink"
    got: list[Sequence[Event]] = []
    early.start(got.append)
    assert inner.done.wait(10)
    assert got == inner.batches
    assert inner.started == 1, "connected, not started a second time"


def test_a_stop_before_the_agent_connects_releases_the_waiting_thread_and_delivers_nothing() -> None:
    inner = ThreadedSource(_batches(3))
    early = EarlySource(inner)
    early.begin()
    early.stop()
    assert inner.done.wait(10), "the source thread is not left waiting"
    assert inner.stopped


def test_start_without_begin_starts_the_source() -> None:
    inner = ThreadedSource(_batches(2))
    got: list[Sequence[Event]] = []
    EarlySource(inner).start(got.append)
    assert inner.done.wait(10)
    assert inner.started == 1 and got == inner.batches
