"""Maglev's table (agent/ebpf/maglev.py): balance, disruption when one backend leaves or joins, and
that the table depends on the backends' names alone (every node builds the same one)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.ebpf.maglev import DEFAULT_TABLE_SIZE, backend_name, populate

M = DEFAULT_TABLE_SIZE
# Positions that change hands between backends present in both tables, beyond what must move
# (the positions of a backend that left, or taken by one that joined), as a share of the table.
# Maglev gives up minimal disruption for balance (the paper's figure 12), and the extra is no
# bound: removing either of the first two of ['10.16.145.63:80', '10.108.148.206:443',
# '10.245.130.213:80'] moves 7% (`test_the_extra_is_small_on_the_whole_not_for_every_set`), and
# a Hypothesis test bounding every set failed now and then. So the extra is asserted over a fixed
# corpus of backend sets (seeded: the same 44 sets of 2-100 backends every run), where one removal
# and one addition each moved at most 1.4% and 0.53% on average; a skip that stops depending on
# the name (every skip 1) moves 45% at worst and 17% on average. The tests keep M >= 100 N, the
# paper's sizing rule.
EXTRA_MEAN_MAX = 0.01
EXTRA_WORST_MAX = 0.05

names = st.lists(
    st.builds(
        backend_name,
        st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(1, 254)).map(
            lambda t: f"10.{t[0]}.{t[1]}.{t[2]}"
        ),
        st.sampled_from([80, 443, 8080]),
    ),
    min_size=1,
    max_size=100,
    unique=True,
)


@settings(max_examples=60, deadline=None)
@given(names)
def test_every_backend_holds_its_share_within_one_position(backends: list[str]) -> None:
    table = populate(backends, M)
    assert len(table) == M
    counts = Counter(table)
    assert set(counts) == set(range(len(backends)))
    low = M // len(backends)
    assert all(low <= c <= low + 1 for c in counts.values()), counts


def _removal_extra(backends: list[str], gone: int) -> int:
    rest = backends[:gone] + backends[gone + 1 :]
    before, after = populate(backends, M), populate(rest, M)
    return sum(1 for b, a in zip(before, after, strict=True) if b != gone and backends[b] != rest[a])


def _addition_extra(backends: list[str], new: str) -> int:
    grown = [*backends, new]
    before, after = populate(backends, M), populate(grown, M)
    return sum(1 for b, a in zip(before, after, strict=True) if grown[a] != new and backends[b] != grown[a])


@settings(max_examples=40, deadline=None)
@given(names.filter(lambda b: len(b) >= 2), st.data())
def test_removing_one_backend_moves_every_position_it_held(backends: list[str], data: st.DataObject) -> None:
    gone = data.draw(st.integers(0, len(backends) - 1))
    rest = backends[:gone] + backends[gone + 1 :]
    before, after = populate(backends, M), populate(rest, M)
    freed = [i for i, b in enumerate(before) if b == gone]
    assert freed and all(rest[after[i]] != backends[gone] for i in freed)


def _corpus() -> list[list[str]]:
    """Fixed backend sets, 2 to 100 backends (seeded: every run the same)."""
    rnd = random.Random(20261127)
    sets = []
    for n in [2, 3, 4, 5, 6, 8, 10, 16, 25, 50, 100] * 4:
        chosen: set[str] = set()
        while len(chosen) < n:
            address = f"10.{rnd.randrange(256)}.{rnd.randrange(256)}.{rnd.randrange(1, 255)}"
            chosen.add(backend_name(address, rnd.choice([80, 443, 8080])))
        sets.append(sorted(chosen))
    return sets


def test_removing_or_adding_one_backend_moves_a_small_extra_over_a_corpus() -> None:
    rnd = random.Random(7)
    shares = []
    for backends in _corpus():
        shares.append(_removal_extra(backends, rnd.randrange(len(backends))) / M)
        shares.append(_addition_extra(backends, "10.255.255.1:80") / M)
    assert max(shares) <= EXTRA_WORST_MAX, max(shares)
    assert sum(shares) / len(shares) <= EXTRA_MEAN_MAX, sum(shares) / len(shares)


def test_the_extra_is_small_on_the_whole_not_for_every_set() -> None:
    """Why the extra is asserted over a corpus: a set of three where it is 7%."""
    backends = ["10.16.145.63:80", "10.108.148.206:443", "10.245.130.213:80"]
    assert [_removal_extra(backends, gone) for gone in range(3)] == [1174, 1177, 2]


@settings(max_examples=40, deadline=None)
@given(names.filter(lambda b: 1 <= len(b) <= 99), st.data())
def test_adding_one_backend_takes_its_new_share(backends: list[str], data: st.DataObject) -> None:
    new = data.draw(
        st.sampled_from([f"10.255.255.{i}:80" for i in range(1, 9)]).filter(lambda n: n not in backends)
    )
    grown = [*backends, new]
    after = populate(grown, M)
    taken = sum(1 for a in after if grown[a] == new)
    assert M // len(grown) <= taken <= M // len(grown) + 1


@given(names, st.randoms())
def test_the_table_depends_on_the_names_not_their_order(backends: list[str], rnd: object) -> None:
    shuffled = list(backends)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    m = 251  # small, prime: the property is the same
    one = [backends[i] for i in populate(backends, m)]
    other = [shuffled[i] for i in populate(shuffled, m)]
    assert one == other


def test_a_known_table_stays_the_same() -> None:
    """The hashes and the fill order are the contract between nodes running different builds: a
    change here would send a node's flows to other backends than its neighbours'."""
    table = populate(["10.244.1.2:8080", "10.244.2.2:8080", "10.244.2.3:8080"], 251)
    assert Counter(table) == {0: 84, 1: 84, 2: 83}
    assert "".join(str(i) for i in table[:24]) == "001221222112112211021220"


def test_empty_and_invalid_sets() -> None:
    assert populate([], M) == []
    with pytest.raises(ValueError):
        populate(["a", "a"], M)
    with pytest.raises(ValueError):
        populate(["a"], 1)
