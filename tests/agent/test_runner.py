"""The bounded-frequency runner, driven by a fake clock (no sleeping)."""

from __future__ import annotations

from agent.runner import BoundedFrequencyRunner


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_coalesces_and_bounds() -> None:
    clock = Clock()
    calls: list[float] = []
    r = BoundedFrequencyRunner(
        lambda: calls.append(clock.now), min_interval=1.0, max_interval=30.0, clock=clock
    )
    assert r.next_run_at() <= clock.now, "first run is due at once"
    assert r.run_once()
    assert r.next_run_at() == 130.0, "with nothing pending, the periodic resync is next"
    r.request()
    r.request()
    assert r.next_run_at() == 101.0, "requests wait for min_interval and coalesce"
    clock.now = 101.0
    r.run_once()
    assert calls == [100.0, 101.0]


def test_failure_retries() -> None:
    clock = Clock()
    fail = [True]

    def fn() -> None:
        if fail[0]:
            raise RuntimeError("boom")

    r = BoundedFrequencyRunner(fn, min_interval=0.5, max_interval=30.0, retry_interval=2.0, clock=clock)
    assert r.run_once() is False
    assert r.failures == 1
    assert r.next_run_at() == 102.0
    clock.now = 102.0
    fail[0] = False
    assert r.run_once() is True
    assert r.next_run_at() == 132.0
