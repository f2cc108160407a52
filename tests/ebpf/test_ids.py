"""Id pools: count up, wrap at the limit, re-adopt hints, reuse an id only once the kernel let go."""

from __future__ import annotations

import pytest

from agent.ebpf.ids import IdPool, PlanError


def test_ids_count_up_and_wrap_only_at_the_limit() -> None:
    pool = IdPool(3, "thing")
    assert [pool.take(), pool.take()] == [1, 2]
    pool.release(1)
    pool.settle(lambda _: False)
    assert pool.take() == 3, "a freed id is not reused before the counter wraps"
    assert pool.take() == 1
    with pytest.raises(PlanError, match="no free thing id left"):
        pool.take()


def test_a_released_id_returns_only_after_the_kernel_let_go() -> None:
    pool = IdPool(2, "thing")
    assert pool.take() == 1 and pool.take() == 2
    pool.release(1)
    pool.settle(lambda ident: ident == 1)  # the kernel still holds it
    with pytest.raises(PlanError):
        pool.take()
    pool.settle(lambda _: False)
    assert pool.take() == 1


def test_a_hint_is_re_adopted_unless_someone_holds_it() -> None:
    pool = IdPool(100, "thing")
    pool.hold(42)  # the kernel holds it, the plan does not (yet)
    assert pool.take(42) == 42
    assert pool.take(42) != 42, "taken: the next one gets a fresh id"
    assert pool.take() == 44, "ids count up from the highest seen"
