"""A token bucket: `burst` tokens at most, refilled at `per_s` tokens a second.

`take` never waits. `reserve` always succeeds and says how long to wait first (the bucket may go
negative: a reservation is a promise of a future token), the shape of client-go's
flowcontrol.NewTokenBucketRateLimiter (golang.org/x/time/rate `Wait`), which paces the API client
at `--kube-api-qps` with bursts of `--kube-api-burst`.

The event recorder spends one token per write to the API server and drops what finds the bucket
empty, as client-go's EventSourceObjectSpamFilter does (its default: burst 25, one token per five
minutes per object; ours is one bucket for all objects, see events.py). The clock is injectable
so tests step time instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    def __init__(self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or per_s < 0:
            raise ValueError(f"token bucket needs burst >= 1 and a rate >= 0, got {burst}, {per_s}")
        self.per_s = per_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Spend one token if there is one."""
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False

    def reserve(self) -> float:
        """Spend one token, now or in the future: the seconds to wait before using it."""
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s)
            self._at = now
            self._tokens -= 1.0
            if self._tokens >= 0 or self.per_s <= 0:
                return 0.0
            return -self._tokens / self.per_s
