"""Backend ids and the flags of backend entries: one id per (address, port, protocol) that any
service port uses, refcounted across ports.

Pure. A backend's entry says LOCAL when any of its users says the endpoint is on this node,
TERMINATING when any says it is terminating and HOST when any says its address is one of this
node's own (a host-network endpoint here), so each user's say is counted: the counts of one backend
are packed in one int (users, local, terminating and host users, 21 bits each), kept only for a
backend whose counts are not those of one user saying nothing (most backends, which would
otherwise cost a dict entry each: 20 MiB at 50,000 Services of 10 endpoints). The planner asks for
ids as it plans a port (`id_of`) and hands over what the port used before and uses now (`update`);
it gets back the entries to desire or drop, and keeps them in the dict `Backends` reads (`entries`),
which is also the id pool's record of the ids in use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from agent.ebpf.abi import BackendFlag
from agent.ebpf.entries import BE_FLAGS, IDENT
from agent.ebpf.ids import BACKEND_ID_MAX, IdPool

LOCAL = int(BackendFlag.LOCAL)
TERMINATING = int(BackendFlag.TERMINATING)
HOST = int(BackendFlag.HOST)
_REF = 1
_REF_LOCAL = 1 << 21
_REF_TERMINATING = 1 << 42
_REF_HOST = 1 << 63
_REF_MASK = (1 << 21) - 1


class Backends:
    """Backend ids and their users' counts. `entries`: the desired backend entries (id -> value),
    the planner's, updated from what `update` returns before any other id is taken."""

    def __init__(self, entries: Mapping[int, int], limit: int = BACKEND_ID_MAX) -> None:
        self._entries = entries
        self.pool = IdPool(limit, "backend", self)
        self.ids: dict[int, int] = {}  # ident (entries.ident) -> id
        self._refs: dict[int, int] = {}  # id -> its users' counts (packed), where not one plain user
        self._new: dict[int, int] = {}  # id -> ident, between its allocation and its first update
        self.hints: dict[int, int] = {}  # ident -> the id the kernel holds it under (start only)

    def __contains__(self, bid: object) -> bool:
        """The id is in use by the plan (the pool's view)."""
        return bid in self._entries or bid in self._new

    def __len__(self) -> int:
        """How many ids the plan uses (the pool skips its checks while there are none)."""
        return len(self._entries) + len(self._new)

    def id_of(self, ident: int) -> int:
        """The backend's id, a new one (the kernel's, on start) the first time it is used."""
        bid = self.ids.get(ident)
        if bid is not None:
            return bid
        bid = self.pool.take(self.hints.get(ident, 0))
        self.ids[ident] = bid
        self._new[bid] = ident
        return bid

    def ids_of(self, idents: Iterable[int]) -> list[int]:
        """`id_of` of each (a set's endpoints, in order), with the kernel's id re-adopted inline
        where the plan does not use it (a restart's hundred thousand)."""
        ids, hints, entries, fresh, pool = self.ids, self.hints, self._entries, self._new, self.pool
        out: list[int] = []
        if not hints:  # no kernel ids to re-adopt (all but a restart's first plan)
            take = pool.take
            for ident in idents:
                bid = ids.get(ident)
                if bid is None:
                    bid = ids[ident] = take()
                    fresh[bid] = ident
                out.append(bid)
            return out
        for ident in idents:
            bid = ids.get(ident)
            if bid is None:
                hint = hints.get(ident, 0)
                bid = pool.adopt(hint) if hint and hint not in entries and hint not in fresh else pool.take()
                ids[ident] = bid
                fresh[bid] = ident
            out.append(bid)
        return out

    def update(self, old: Mapping[int, int], new: Mapping[int, int]) -> list[tuple[int, int | None]]:
        """A port used the backends of `old` and uses those of `new` (id -> the flags it gives
        each). Returns the entries that change: (id, value), or (id, None) for a backend no port
        uses any more (its id is released)."""
        out: list[tuple[int, int | None]] = []
        entries, refs_of, fresh = self._entries, self._refs, self._new
        for bid, flags in new.items():
            before = old.get(bid) if old else None
            if before == flags:
                continue
            ident = fresh.pop(bid, None)
            if ident is not None and not flags:
                # A new backend's first user, saying nothing (every backend of a start, nearly):
                # one plain user is what no counts kept stands for.
                out.append((bid, ident))
                continue
            if ident is None:
                refs, ident = refs_of.get(bid, _REF), entries[bid] & IDENT
            else:
                refs = 0
            refs += (_REF if before is None else -_count(before)) + _count(flags)
            self._keep(bid, refs)
            out.append((bid, ident | _flags(refs) << BE_FLAGS))
        for bid, before in old.items():
            if bid in new:
                continue
            refs = refs_of.get(bid, _REF) - _REF - _count(before)
            ident = entries[bid] & IDENT
            if refs & _REF_MASK:
                self._keep(bid, refs)
                out.append((bid, ident | _flags(refs) << BE_FLAGS))
                continue
            del self.ids[ident]
            refs_of.pop(bid, None)
            self.pool.release(bid)
            out.append((bid, None))
        return out

    def _keep(self, bid: int, refs: int) -> None:
        if refs == _REF:
            self._refs.pop(bid, None)
        else:
            self._refs[bid] = refs


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
