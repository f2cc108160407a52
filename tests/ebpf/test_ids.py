"""Id pools: count up, wrap at the limit, re-adopt hints, reuse an id only once the kernel let go."""

from __future__ import annotations

import pytest

from agent.ebpf.ids import IdPool, PlanError


class Owner:
    """The plan's side of a pool: the ids it uses (a dict keyed by them, in the planner)."""

    def __init__(self, limit: int) -> None:
        self.owned: set[int] = set()
        self.pool = IdPool(limit, "thing", self.owned)

    def take(self, hint: int = 0) -> int:
        ident = self.pool.take(hint)
        self.owned.add(ident)
        return ident

    def release(self, ident: int) -> None:
        self.owned.discard(ident)
        self.pool.release(ident)


def test_ids_count_up_and_wrap_only_at_the_limit() -> None:
    plan = Owner(3)
    assert [plan.take(), plan.take()] == [1, 2]
    plan.release(1)
    plan.pool.settle(lambda _: False)
    assert plan.take() == 3, "a freed id is not reused before the counter wraps"
    assert plan.take() == 1
    with pytest.raises(PlanError, match="no free thing id left"):
        plan.take()


def test_a_released_id_returns_only_after_the_kernel_let_go() -> None:
    plan = Owner(2)
    assert plan.take() == 1 and plan.take() == 2
    plan.release(1)
    plan.pool.settle(lambda ident: ident == 1)  # the kernel still holds it
    with pytest.raises(PlanError):
        plan.take()
    plan.pool.settle(lambda _: False)
    assert plan.take() == 1


def test_a_hint_is_re_adopted_unless_someone_holds_it() -> None:
    plan = Owner(100)
    plan.pool.hold(42)  # the kernel holds it, the plan does not (yet)
    assert plan.take(42) == 42
    assert plan.take(42) != 42, "taken: the next one gets a fresh id"
    assert plan.take() == 44, "ids count up from the highest seen"


def test_the_pool_reads_the_plans_ids_and_holds_only_the_kernels_others() -> None:
    plan = Owner(100)
    plan.owned.update({1, 2})  # the plan's own dict, which the pool keeps no copy of
    plan.pool.hold_all({2, 7})  # what the kernel holds: 2 is the plan's, 7 is not
    assert 1 in plan.pool and 7 in plan.pool
    assert plan.take() == 8, "neither the plan's ids nor the kernel's are handed out"
    plan.pool.settle(lambda _: False)  # the kernel let go of 7
    assert 7 not in plan.pool
    assert 2 in plan.pool, "the plan's own id stays in use whatever the kernel holds"
    plan.owned.discard(2)
    assert 2 not in plan.pool


class Counted(set[int]):
    """The plan's ids, counting how often the pool looks one up."""

    lookups = 0

    def __contains__(self, ident: object) -> bool:
        self.lookups += 1
        return super().__contains__(ident)


def test_until_it_wraps_the_pool_hands_out_ids_without_looking_them_up() -> None:
    """Every id in use is below the next one until the pool wraps: a first sync's hundred
    thousand backend ids cost no lookup in the plan's dict; after the wrap, ids in use are skipped."""
    owned = Counted()
    pool = IdPool(4, "thing", owned)
    for _ in range(4):
        owned.add(pool.take())
    assert sorted(owned) == [1, 2, 3, 4] and owned.lookups == 0
    owned.discard(2)
    pool.release(2)
    pool.settle(lambda ident: False)  # the kernel let go of it
    assert pool.take() == 2, "wrapped: the one free id, found past the ids in use"
    assert owned.lookups > 0


def test_ids_the_kernel_holds_before_any_take_are_skipped_without_a_lookup() -> None:
    """A restart holds the read-back's ids first (hold_all): the unchecked takes start past them."""
    owned = Counted()
    pool = IdPool(100, "thing", owned)
    pool.hold_all({10, 3})
    assert pool.take() == 11 and owned.lookups == 0
