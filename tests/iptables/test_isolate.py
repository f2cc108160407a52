"""Finding the service ports a restore rejects, by halving."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from agent.iptables.isolate import isolate


class Oracle:
    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.calls = 0

    def __call__(self, items: Sequence[int]) -> bool:
        self.calls += 1
        return not (set(items) & self.bad)


def test_nothing_failing_costs_one_test() -> None:
    oracle = Oracle(set())
    assert isolate(list(range(1000)), oracle) == []
    assert oracle.calls == 1


def test_one_failing_port_among_10000_in_about_2_log2_n_tests() -> None:
    oracle = Oracle({6789})
    assert isolate(list(range(10000)), oracle) == [6789]
    assert oracle.calls <= 2 * 14 + 1


def test_a_failure_needing_two_ports_names_no_single_culprit() -> None:
    def passes(items: Sequence[int]) -> bool:
        return not {1, 8} <= set(items)

    assert isolate(list(range(10)), passes) == []


@given(st.integers(1, 300), st.sets(st.integers(0, 299), max_size=6))
def test_finds_exactly_the_failing_ones(n: int, bad: set[int]) -> None:
    bad = {b for b in bad if b < n}
    assert isolate(list(range(n)), Oracle(bad)) == sorted(bad)
