"""Backend ids and the flags of backend entries: one id per (address, port, protocol) that any
service port uses, refcounted across ports.

Pure. A backend's entry says LOCAL when any of its users says the endpoint is on this node,
TERMINATING when any says it is terminating and HOST when any says its address is one of this
node's own (a host-network endpoint here), so each user's say is counted: the counts of one backend
are packed in one int (users, local, terminating and host users, 21 bits each), and a dict of ints
is all this keeps. The planner asks for ids as it plans a port (`id_of`) and hands over what
the port used before and uses now (`update`); it gets back the entries to desire or drop.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.ebpf.abi import BackendFlag
from agent.ebpf.entries import BE_FLAGS, IDENT
from agent.ebpf.ids import IdPool

LOCAL = int(BackendFlag.LOCAL)
TERMINATING = int(BackendFlag.TERMINATING)
HOST = int(BackendFlag.HOST)
_REF = 1
_REF_LOCAL = 1 << 21
_REF_TERMINATING = 1 << 42
_REF_HOST = 1 << 63
_REF_MASK = (1 << 21) - 1


class Backends:
    def __init__(self, pool: IdPool) -> None:
        self.pool = pool
        self.ids: dict[int, int] = {}  # ident (entries.ident) -> id
        self.refs: dict[int, int] = {}  # id -> its users' counts (packed)
        self._new: dict[int, int] = {}  # id -> ident, between its allocation and its first update
        self.hints: dict[int, int] = {}  # ident -> the id the kernel holds it under (start only)

    def id_of(self, ident: int) -> int:
        """The backend's id, a new one (the kernel's, on start) the first time it is used."""
        bid = self.ids.get(ident)
        if bid is not None:
            return bid
        bid = self.pool.take(self.hints.get(ident, 0))
        self.ids[ident] = bid
        self.refs[bid] = 0
        self._new[bid] = ident
        return bid

    def update(
        self, old: Mapping[int, int], new: Mapping[int, int], entries: Mapping[int, int]
    ) -> list[tuple[int, int | None]]:
        """A port used the backends of `old` and uses those of `new` (id -> the flags it gives
        each); `entries`: the backend entries desired now. Returns the entries that change: (id,
        value), or (id, None) for a backend no port uses any more (its id is released)."""
        out: list[tuple[int, int | None]] = []
        refs_of = self.refs
        for bid, flags in new.items():
            before = old.get(bid)
            if before == flags:
                continue
            refs = refs_of[bid] + (_REF if before is None else -_count(before)) + _count(flags)
            refs_of[bid] = refs
            ident = entries[bid] & IDENT if bid in entries else self._new.pop(bid)
            out.append((bid, ident | _flags(refs) << BE_FLAGS))
        for bid, before in old.items():
            if bid in new:
                continue
            refs = refs_of[bid] - _REF - _count(before)
            ident = entries[bid] & IDENT
            if refs & _REF_MASK:
                refs_of[bid] = refs
                out.append((bid, ident | _flags(refs) << BE_FLAGS))
                continue
            del self.ids[ident], refs_of[bid]
            self.pool.release(bid)
            out.append((bid, None))
        return out


def _count(flags: int) -> int:
    """A user's flags as its share of a backend's packed counts."""
    return (
        (_REF_LOCAL if flags & LOCAL else 0)
        + (_REF_TERMINATING if flags & TERMINATING else 0)
        + (_REF_HOST if flags & HOST else 0)
    )


def _flags(refs: int) -> int:
    """The backend's flags from its packed counts: local, terminating or host if any user says so."""
    return (
        (LOCAL if refs >> 21 & _REF_MASK else 0)
        | (TERMINATING if refs >> 42 & _REF_MASK else 0)
        | (HOST if refs >> 63 & _REF_MASK else 0)
    )
