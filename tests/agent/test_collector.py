"""agent.collector.StartHold: no automatic collection while the agent starts, for a bounded time."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from agent.collector import StartHold


@pytest.fixture(autouse=True)
def collector_back_on() -> Iterator[None]:
    yield
    gc.enable()  # whatever a test left, the rest of the suite runs with the collector on


def test_the_hold_stops_automatic_collection_until_released() -> None:
    hold = StartHold(limit_s=60.0)
    assert not gc.isenabled()
    hold.release()
    assert gc.isenabled()


def test_the_hold_ends_by_itself_at_its_limit() -> None:
    """No full sync comes (an API server that cannot be reached): the collector runs again."""
    StartHold(limit_s=0.05)
    assert not gc.isenabled()
    deadline = time.monotonic() + 10.0
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gc.isenabled(), "the hold outlived its limit"


def test_a_release_before_the_limit_leaves_the_collector_alone_afterwards() -> None:
    """A hold released early (the agent stopped) does not touch the collector when its limit
    passes: the timer is cancelled."""
    hold = StartHold(limit_s=0.05)
    hold.release()
    gc.disable()  # whoever holds the process now turned it off again
    time.sleep(0.2)
    assert not gc.isenabled()
