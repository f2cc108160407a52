"""Retry delays for API calls: capped exponential backoff with jitter, and "episodes" for the log.

`Backoff` mirrors what client-go's reflector uses between failed list/watch attempts
(`wait.NewExponentialBackoffManager(800ms, 30s, 2m, 2.0, 1.0)`): the delay starts at 0.8 s,
doubles per failure up to 30 s, each sleep is stretched by a random factor in [1, 1 + jitter)
so a fleet of agents does not reconnect in lockstep after an API server restart, and the delay
returns to the start only after `reset_after_s` without a failure. Resetting on the first success
instead would let a stream that opens and breaks at once (a flapping load balancer) spin at the
initial delay forever.

`Episode` turns a run of failures into two log lines, one when it starts and one when it ends,
so an API server down for an hour costs two lines, not thousands; every failure is still counted
by a metric.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.8
    cap_s: float = 30.0
    factor: float = 2.0
    jitter: float = 1.0  # each sleep is delay * (1 + jitter * U[0, 1))
    reset_after_s: float = 120.0


class BackoffState:
    """The growing delay of one retry loop; `next()` returns the time to sleep now."""

    def __init__(
        self,
        policy: Backoff,
        rand: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self._rand = rand or random.Random()
        self._clock = clock
        self._delay = 0.0
        self._last = float("-inf")

    def next(self) -> float:
        now = self._clock()
        p = self.policy
        if self._delay == 0.0 or now - self._last > p.reset_after_s:
            self._delay = p.initial_s
        else:
            self._delay = min(self._delay * p.factor, p.cap_s)
        self._last = now
        return self._delay * (1.0 + p.jitter * self._rand.random())


class Episode:
    """Tracks whether a retry loop is in trouble; says when to log the start and the end."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.failures = 0
        self._since = 0.0

    @property
    def active(self) -> bool:
        return self.failures > 0

    def fail(self) -> bool:
        """Count a failure; True when it starts an episode (log it)."""
        self.failures += 1
        if self.failures == 1:
            self._since = self._clock()
            return True
        return False

    def recover(self) -> tuple[int, float] | None:
        """End the episode; (failures, seconds) when one was active (log it), else None."""
        if not self.failures:
            return None
        out = (self.failures, self._clock() - self._since)
        self.failures = 0
        return out
