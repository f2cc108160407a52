"""Backoff, episodes and the token bucket: pure, with stepped clocks."""

from __future__ import annotations

import random

import pytest

from agent.kube.backoff import Backoff, BackoffState, Episode
from agent.kube.tokenbucket import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_backoff_doubles_to_the_cap_with_jitter_on_top() -> None:
    clock = Clock()
    state = BackoffState(Backoff(initial_s=0.8, cap_s=30, factor=2, jitter=1.0), random.Random(7), clock)
    delays = []
    for _ in range(8):
        delays.append(state.next())
        clock.t += 1
    bases = [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30, 30]
    for d, base in zip(delays, bases, strict=True):
        assert base <= d < 2 * base
    assert len({round(d / b, 6) for d, b in zip(delays, bases, strict=True)}) > 1, "jitter varies"


def test_backoff_resets_only_after_a_quiet_period() -> None:
    clock = Clock()
    state = BackoffState(Backoff(initial_s=1, cap_s=100, jitter=0.0, reset_after_s=120), clock=clock)
    assert [state.next() for _ in range(3)] == [1, 2, 4]
    clock.t += 119  # a flapping stream that fails every two minutes keeps growing
    assert state.next() == 8
    clock.t += 121
    assert state.next() == 1


def test_episode_logs_start_and_end_once() -> None:
    clock = Clock()
    ep = Episode(clock)
    assert ep.recover() is None
    assert ep.fail() is True
    clock.t = 5
    assert ep.fail() is False and ep.fail() is False
    assert ep.active
    assert ep.recover() == (3, 5.0)
    assert ep.recover() is None and not ep.active


def test_token_bucket_burst_then_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(per_s=0.5, burst=3, clock=clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    clock.t = 1.0
    assert bucket.take() is False  # half a token
    clock.t = 2.0
    assert bucket.take() is True
    clock.t = 1000.0  # refills to the burst, not beyond
    assert sum(bucket.take() for _ in range(10)) == 3
    with pytest.raises(ValueError):
        TokenBucket(per_s=1, burst=0)
