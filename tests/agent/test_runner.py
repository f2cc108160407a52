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

    r = BoundedFrequencyRunner(
        fn, min_interval=0.5, max_interval=30.0, retry_interval=2.0, clock=clock, jitter=lambda: 1.0
    )
    assert r.run_once() is False
    assert r.failures == 1
    assert r.next_run_at() == 102.0
    clock.now = 102.0
    fail[0] = False
    assert r.run_once() is True
    assert r.next_run_at() == 132.0


def test_failures_back_off_exponentially_up_to_the_sync_period_with_jitter() -> None:
    clock = Clock()

    def fn() -> None:
        raise RuntimeError("api down")

    jitters = iter([1.0, 1.0, 1.2, 0.8, 1.0, 1.0, 1.0])
    r = BoundedFrequencyRunner(
        fn, min_interval=0.0, max_interval=8.0, retry_interval=1.0, clock=clock, jitter=lambda: next(jitters)
    )
    delays = []
    for _ in range(6):
        r.run_once()
        delays.append(round(r.next_run_at() - clock.now, 3))
        clock.now = r.next_run_at()
    assert delays == [1.0, 2.0, 4.8, 6.4, 8.0, 8.0]
    assert r.failures == 6


def test_success_resets_the_backoff_and_retry_soon_is_no_failure() -> None:
    clock = Clock()
    outcomes = iter(["fail", "fail", "partial", "ok"])
    r: BoundedFrequencyRunner

    def fn() -> None:
        what = next(outcomes)
        if what == "fail":
            raise RuntimeError("boom")
        if what == "partial":
            r.retry_soon()

    r = BoundedFrequencyRunner(
        fn, min_interval=0.0, max_interval=30.0, retry_interval=1.0, clock=clock, jitter=lambda: 1.0
    )
    r.run_once()
    r.run_once()
    assert r.next_run_at() == clock.now + 2.0
    assert r.run_once() is True, "a run that retries some ports succeeded"
    assert r.failures == 2
    assert r.next_run_at() == clock.now + 4.0, "its retry keeps backing off"
    r.run_once()
    assert r.next_run_at() == clock.now + 30.0, "all went through: only the periodic resync is next"


def test_a_fatal_error_stops_the_loop_and_is_reported() -> None:
    from agent.errors import FatalError

    seen: list[str] = []

    def fn() -> None:
        raise FatalError("pin path is not on bpffs: mount one")

    r = BoundedFrequencyRunner(fn, min_interval=0.0, max_interval=1.0, on_fatal=lambda e: seen.append(str(e)))
    r.loop()  # returns: the fatal error stopped it
    assert seen == ["pin path is not on bpffs: mount one"]
    assert r.runs == 1 and r.failures == 0


def test_request_at_runs_at_that_time_not_before_min_interval_and_only_once() -> None:
    """A part of the work held back by its own floor (the IPv6 family's) asks for the run that
    takes it, neither earlier nor at every run after."""
    clock = Clock()
    r = BoundedFrequencyRunner(
        lambda: r.request_at(clock.now + 0.7) if clock.now == 100.0 else None,
        min_interval=0.1,
        max_interval=30.0,
        clock=clock,
    )
    r.run_once()
    assert r.next_run_at() == 100.7
    r.request_at(100.05)
    assert r.next_run_at() == 100.1, "never before min_interval"
    clock.now = 100.7
    r.run_once()
    assert r.next_run_at() == 130.7, "the run forgets the request: the periodic resync is next"


def test_a_run_that_asks_for_a_retry_and_then_fails_backs_off_once() -> None:
    """One family's retry asked (retry_soon) and the other's failure in the same run: one retry,
    after the current backoff, which doubles once, not twice."""
    clock = Clock()
    r: BoundedFrequencyRunner

    def fn() -> None:
        r.retry_soon()
        raise RuntimeError("bpf map update: no space")

    r = BoundedFrequencyRunner(
        fn, min_interval=0.0, max_interval=30.0, retry_interval=1.0, clock=clock, jitter=lambda: 1.0
    )
    delays = []
    for _ in range(3):
        r.run_once()
        delays.append(r.next_run_at() - clock.now)
        clock.now = r.next_run_at()
    assert delays == [1.0, 2.0, 4.0]


def test_running_says_whether_the_loops_thread_is_alive() -> None:
    """What the agent's shutdown asks before keeping the records: alive while a run goes on, not
    once the stop's join returned with the loop ended (and not before the loop started)."""
    import threading

    entered, release = threading.Event(), threading.Event()

    def fn() -> None:
        entered.set()
        release.wait(10)

    r = BoundedFrequencyRunner(fn, min_interval=0.0, max_interval=30.0)
    assert not r.running()
    r.start()
    assert entered.wait(10)
    assert r.running()
    release.set()
    r.stop()
    assert not r.running()
