"""Time as the health and metrics code reads it: a wall clock to print, a monotonic one to decide.

kube-proxy compares `time.Time` values that carry Go's monotonic reading, so a wall-clock jump
(NTP, a VM resumed) never makes the proxy look late or early. `Clock` gives both readings apart:
`monotonic()` for every "has the timeout passed" decision, `wall_ns()` for the timestamps that
appear in /healthz bodies and metric values. `FakeClock` is the twin tests drive by hand.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never jumps (only differences mean anything)."""

    def wall_ns(self) -> int:
        """Nanoseconds since the Unix epoch, UTC."""


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ns(self) -> int:
        return time.time_ns()


class FakeClock:
    """A clock that moves only when told to; both readings advance together."""

    def __init__(self, wall_ns: int = 1_714_557_600 * 10**9, monotonic: float = 1000.0) -> None:
        self._lock = threading.Lock()
        self._wall_ns = wall_ns
        self._mono = monotonic

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def wall_ns(self) -> int:
        with self._lock:
            return self._wall_ns

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._mono += seconds
            self._wall_ns += round(seconds * 1e9)
