"""Fixtures for the API source tests: a fake API server, a recording sink, a running ApiSource.

Every test talks to the fake server through the real kubernetes client (a kubeconfig the server
writes). Backoff and watch timeouts are shrunk through WatchSettings so fault tests take seconds;
nothing else differs from production.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.config import Config
from agent.kube.backoff import Backoff
from agent.kube.client import api_client
from agent.kube.reflector import WatchSettings
from agent.kube.source import ApiSource
from agent.metrics.source import SourceMetrics
from agent.sources.base import Event, EventType, Kind, ObjectEvent, Synced
from lab.fakeapi import FakeApiServer

FAST = WatchSettings(
    page_size=3,
    watch_timeout_s=(30, 40),
    read_margin_s=5.0,
    connect_timeout_s=2.0,
    list_timeout_s=5.0,
    backoff=Backoff(initial_s=0.05, cap_s=0.4, factor=2.0, jitter=0.5, reset_after_s=5.0),
)


class Recorded:
    """A thread-safe sink that keeps every batch; tests wait on conditions over what arrived."""

    def __init__(self) -> None:
        self.batches: list[list[Event]] = []
        self._cond = threading.Condition()
        self.fail_next = 0  # raise from the sink this many times (a buggy consumer)...
        self.fail_kind: Kind | None = None  # ...for batches of this kind only

    def __call__(self, events: Sequence[Event]) -> None:
        with self._cond:
            if self.fail_next and (self.fail_kind is None or any(e.kind is self.fail_kind for e in events)):
                self.fail_next -= 1
                raise RuntimeError("sink failure injected by the test")
            self.batches.append(list(events))
            self._cond.notify_all()

    @property
    def events(self) -> list[Event]:
        with self._cond:
            return [e for b in self.batches for e in b]

    def objects(self, kind: Kind | None = None) -> list[ObjectEvent]:
        return [e for e in self.events if isinstance(e, ObjectEvent) and (kind is None or e.kind is kind)]

    def synced(self, kind: Kind) -> list[Synced]:
        return [e for e in self.events if isinstance(e, Synced) and e.kind is kind]

    def mark(self) -> int:
        """The number of events so far; `since(mark)` returns what came after."""
        return len(self.events)

    def since(self, mark: int) -> list[Event]:
        return self.events[mark:]

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
                self._cond.wait(min(left, 0.05))

    def state(self, kind: Kind) -> dict[str, Any]:
        """The objects the sink holds now, replaying every event in order."""
        out: dict[str, Any] = {}
        for e in self.objects(kind):
            if e.type is EventType.DELETED:
                out.pop(e.key, None)
            else:
                out[e.key] = e.obj
        return out


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(0.02)


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    srv = FakeApiServer(bookmark_interval_s=0.3).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def paging_server() -> Iterator[FakeApiServer]:
    """A server without a watch cache: every list, the first included, is answered in pages."""
    srv = FakeApiServer(bookmark_interval_s=0.3, watch_cache=False).start()
    try:
        yield srv
    finally:
        srv.stop()


SourceFactory = Callable[..., tuple[ApiSource, Recorded]]

# Every source the tests start counts into this registry (metrics are cumulative: tests compare
# against the value before they act).
REGISTRY = CollectorRegistry()
SOURCE_METRICS = SourceMetrics(REGISTRY)


@pytest.fixture
def start_source(tmp_path: Path) -> Iterator[SourceFactory]:
    """`start_source(server, hostname="node1", settings=FAST)` -> (running ApiSource, sink)."""
    started: list[ApiSource] = []

    def factory(
        srv: FakeApiServer, hostname: str = "node1", settings: WatchSettings = FAST, token: str | None = None
    ) -> tuple[ApiSource, Recorded]:
        kubeconfig = srv.write_kubeconfig(tmp_path / f"kubeconfig-{len(started)}", token=token)
        config = Config(kubeconfig=kubeconfig, hostname=hostname)
        source = ApiSource(config, api_client(config), settings, metrics=SOURCE_METRICS)
        sink = Recorded()
        source.start(sink)
        started.append(source)
        return source, sink

    yield factory
    for source in started:
        source.stop()
