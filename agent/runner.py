"""A bounded-frequency runner: coalesces sync requests, retries failures with backoff, resyncs.

kube-proxy's BoundedFrequencyRunner in small: `request()` asks for a run soon; runs are at least
`min_interval` apart (a burst of changes becomes one sync), at most `max_interval` apart (the
periodic full resync that repairs anything changed behind our back). A failed run is retried after
a backoff that starts at `retry_interval` and doubles up to `max_interval`, with +-20% jitter so a
fleet of nodes does not retry in step; `retry_soon()` asks for that retry without counting a
failure (a run that programmed everything but some service ports); `request_at(t)` asks for a
run at `t` (a part of the work held back by its own floor). `agent.errors.FatalError`
stops the loop and is handed to `on_fatal`: no retry fixes it. The function runs on one thread
only, so backends need no locking, and never two runs at once.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from agent.errors import FatalError

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
        jitter: Callable[[], float] = lambda: random.uniform(0.8, 1.2),
        on_fatal: Callable[[FatalError], None] | None = None,
    ) -> None:
        self._fn = fn
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.retry_interval = retry_interval
        self._clock = clock
        self._jitter = jitter
        self._on_fatal = on_fatal
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending = True  # the first run happens as soon as the loop starts
        self._last_run = float("-inf")
        self._retry_at: float | None = None
        self._due_at: float | None = None
        self._backoff = retry_interval
        self._thread: threading.Thread | None = None
        self.runs = 0
        self.failures = 0
        self.fatal: FatalError | None = None

    def request(self) -> None:
        """Ask for a run as soon as min_interval allows (thread-safe)."""
        self._pending = True
        self._wake.set()

    def retry_soon(self) -> None:
        """From within a run: ask for another after the current backoff, without a failure."""
        self._schedule_retry()

    def request_at(self, when: float) -> None:
        """From within a run: ask for a run at `when` (on this runner's clock; not before
        min_interval), without a failure. The run after it forgets the request."""
        self._due_at = when if self._due_at is None else min(self._due_at, when)

    def next_run_at(self) -> float:
        """When the next run is due (pure function of the runner's state, for tests)."""
        due = self._last_run + self.max_interval
        if self._pending:
            due = min(due, self._last_run + self.min_interval)
        if self._retry_at is not None:
            due = min(due, max(self._retry_at, self._last_run + self.min_interval))
        if self._due_at is not None:
            due = min(due, max(self._due_at, self._last_run + self.min_interval))
        return due

    def _schedule_retry(self) -> float:
        """The retry after the current backoff, which doubles once per run: a run that asked for a
        retry (retry_soon) and then failed keeps the retry it asked for."""
        if self._retry_at is not None:  # asked already in this run (run_once clears it)
            return max(0.0, self._retry_at - self._clock())
        delay = self._backoff * self._jitter()
        self._retry_at = self._clock() + delay
        self._backoff = min(self._backoff * 2, max(self.max_interval, self.retry_interval))
        return delay

    def run_once(self) -> bool:
        """Run fn now; True on success. Failures schedule a retry, never raise; a FatalError
        stops the loop."""
        self._pending = False
        self._last_run = self._clock()
        self.runs += 1
        self._retry_at = None
        self._due_at = None
        try:
            self._fn()
        except FatalError as exc:
            self.fatal = exc
            self._stop.set()
            if self._on_fatal is not None:
                self._on_fatal(exc)
            return False
        except Exception:
            self.failures += 1
            log.exception("sync failed; retrying in %.1fs", self._schedule_retry())
            return False
        if self._retry_at is None:  # no retry_soon() during the run: all went through
            self._backoff = self.retry_interval
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
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def running(self) -> bool:
        """Whether the loop's thread is still alive: after `stop`, a run longer than its wait."""
        return self._thread is not None and self._thread.is_alive()
