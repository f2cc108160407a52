"""Which service ports make iptables-restore reject the input: adaptive group testing. Pure.

A restore is all or nothing per table, so one rule the kernel refuses (a match module missing on
this node, a value it will not take) would keep every other service from being programmed. The
proxier asks `iptables-restore --test` about halves of the service ports, recursively, and programs
every port except the ones that fail on their own. With k failing ports out of n this costs about
2·k·log2(n) test restores, each of a subset's rules only; one failing port among 10,000 is found
with 28.

Assumes failures are monotone: a set fails exactly when it holds a port that fails alone. A failure
that only a combination of ports produces shows up as "no culprit found"; the caller then fails the
whole sync, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def isolate(items: Sequence[T], passes: Callable[[Sequence[T]], bool]) -> list[T]:
    """The items that fail on their own, in input order; [] when `items` pass together."""
    if passes(items):
        return []
    return _failing(items, passes)


def _failing(items: Sequence[T], passes: Callable[[Sequence[T]], bool]) -> list[T]:
    # Known: `items` fail together. Both halves are tested: if neither fails alone, the failure
    # needs a combination and no single culprit is named for this part.
    if len(items) == 1:
        return list(items)
    mid = len(items) // 2
    out: list[T] = []
    for half in (items[:mid], items[mid:]):
        if not passes(half):
            out += _failing(half, passes)
    return out
