"""A bounded-frequency runner: coalesces sync requests, retries failures, resyncs periodically.

kube-proxy's BoundedFrequencyRunner in small: `request()` asks for a run soon; runs are at least
`min_interval` apart (a burst of changes becomes one sync), at most `max_interval` apart (a periodic
full resync repairs anything changed behind our back), and a failed run is retried after
`retry_interval`. The function runs on one thread only, so backends need no locking.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BoundedFrequencyRunner:
    def __init__(
        self,
        fn: Callable[[], None],
        *,
        min_interval: float,
        max_interval: float,
        retry_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fn = fn
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.retry_interval = retry_interval
        self._clock = clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending = True  # the first run happens as soon as the loop starts
        self._last_run = float("-inf")
        self._retry_at: float | None = None
        self._thread: threading.Thread | None = None
        self.runs = 0
        self.failures = 0

    def request(self) -> None:
        """Ask for a run as soon as min_interval allows."""
        self._pending = True
        self._wake.set()

    def next_run_at(self) -> float:
        """When the next run is due (pure function of the runner's state, for tests)."""
        due = self._last_run + self.max_interval
        if self._pending:
            due = min(due, self._last_run + self.min_interval)
        if self._retry_at is not None:
            due = min(due, max(self._retry_at, self._last_run + self.min_interval))
        return due

    def run_once(self) -> bool:
        """Run fn now; True on success. Failures schedule a retry, never raise."""
        self._pending = False
        self._last_run = self._clock()
        self.runs += 1
        try:
            self._fn()
        except Exception:
            self.failures += 1
            self._retry_at = self._clock() + self.retry_interval
            log.exception("sync failed; retrying in %.1fs", self.retry_interval)
            return False
        self._retry_at = None
        return True

    def loop(self) -> None:
        while not self._stop.is_set():
            delay = self.next_run_at() - self._clock()
            if delay > 0:
                self._wake.wait(timeout=delay)
                self._wake.clear()
                continue
            self.run_once()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.loop, name="sync-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
