"""Backend ids and flags: refcounted across service ports, flagged by what any user says."""

from __future__ import annotations

from collections.abc import Callable

from agent.ebpf.backends import LOCAL, TERMINATING, Backends
from agent.ebpf.entries import BE_FLAGS, ident

BE = ident(0x0201F40A, 0x901F, 6)  # 10.244.1.2:8080/TCP

Update = Callable[[dict[int, int], dict[int, int]], list[tuple[int, int | None]]]


def applying() -> tuple[Backends, Update]:
    """A table over its own backend entries, and an update that applies what it returns to them
    (as the planner's desired side does)."""
    entries: dict[int, int] = {}
    table = Backends(entries, limit=100)

    def update(old: dict[int, int], new: dict[int, int]) -> list[tuple[int, int | None]]:
        out = table.update(old, new)
        for bid, value in out:
            if value is None:
                entries.pop(bid)
            else:
                entries[bid] = value
        return out

    return table, update


def test_a_shared_backend_keeps_its_id_and_carries_what_any_user_says() -> None:
    table, update = applying()

    bid = table.id_of(BE)
    assert table.id_of(BE) == bid
    assert update({}, {bid: LOCAL}) == [(bid, BE | LOCAL << BE_FLAGS)]  # port a: on this node
    assert update({}, {bid: TERMINATING}) == [(bid, BE | (LOCAL | TERMINATING) << BE_FLAGS)]  # port b
    assert update({bid: LOCAL}, {}) == [(bid, BE | TERMINATING << BE_FLAGS)], "a left: b's say remains"
    assert update({bid: TERMINATING}, {}) == [(bid, None)], "the last user left: the entry goes"
    assert BE not in table.ids
    table.pool.settle(lambda _: False)
    assert table.id_of(BE) != bid, "a fresh id (ids count up), not the one just given back"


def test_a_backend_the_kernel_holds_gets_its_id_back_on_start() -> None:
    table = Backends({}, limit=100)
    table.pool.hold_all({42})
    table.hints = {BE: 42}
    assert table.id_of(BE) == 42


def test_plain_users_are_counted_without_a_count_kept_for_one() -> None:
    table, update = applying()

    bid = table.id_of(BE)
    assert bid in table, "in use from its allocation on"
    assert update({}, {bid: 0}) == [(bid, BE)]  # port a
    assert update({}, {bid: 0}) == [(bid, BE)]  # port b
    assert update({bid: 0}, {}) == [(bid, BE)], "b still uses it"
    assert update({}, {bid: LOCAL}) == [(bid, BE | LOCAL << BE_FLAGS)]  # port c, on this node
    assert update({bid: LOCAL}, {}) == [(bid, BE)], "c's say went with it; a remains"
    assert update({bid: 0}, {}) == [(bid, None)], "the last user left"
    assert bid not in table and BE not in table.ids
