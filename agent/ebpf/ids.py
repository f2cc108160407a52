"""Id allocation for the service maps: one pool per kind of id (service port, backend set, backend,
reverse-NAT entry).

Fresh ids count up from where the last one was handed out and wrap only at the field's limit, so
conntrack and affinity entries of a service just removed do not meet a new one under the same id.
An id given back returns to the pool only once the kernel holds no entry under it (`settle`, at the
end of a flush). On start, the ids the pinned maps hold are offered back as hints (`take(hint)`),
so a restarted agent re-adopts them and rewrites nothing that is still right.

A pool keeps no set of the ids in use: the plan already keys a dict by them (the backends' entries,
the owner of each service port or set id), and a second set of 500,000 backend ids was 16 to 32 MiB
at 50,000 Services. The pool reads that dict (`owned`) and keeps only the ids the kernel may still
hold that the plan does not.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

# Largest id each field can carry (ekp_frontend.rev_nat_id is a __u16).
SVC_ID_MAX = 0xFFFFFFFF
SET_ID_MAX = 0xFFFFFFFF
BACKEND_ID_MAX = 0xFFFFFFFF
REVNAT_ID_MAX = 0xFFFF


class PlanError(RuntimeError):
    """The desired state cannot be expressed in the maps (ids exhausted)."""


class IdPool:
    """Ids of one kind: handed out counting up from the last one, wrapping only at `limit`.

    `owned`: the ids the plan uses, kept by the pool's owner, who records each id `take` returns
    before it takes the next. An id in use is owned, or held: given back (`release`) or found in
    the kernel (`hold`), and free again only after `settle` (the end of a flush), once the kernel
    no longer holds it.
    """

    def __init__(self, limit: int, what: str, owned: Container[int]) -> None:
        self._limit = limit
        self._what = what
        self._owned = owned
        self._held: set[int] = set()
        self._next = 1
        # Every id in use (owned or held) is below `_next` until the pool first wraps: `take`
        # hands `_next` out unchecked until then (a first sync's hundred thousand backend ids).
        self._wrapped = False

    def __contains__(self, ident: int) -> bool:
        return ident in self._owned or ident in self._held

    def take(self, hint: int = 0) -> int:
        """`hint` when the plan does not use it (re-adoption of an id the kernel holds), else the
        next free id."""
        owned, held = self._owned, self._held
        if 0 < hint <= self._limit and hint not in owned:
            held.discard(hint)
            if hint >= self._next:  # `_seen`, inline: a start takes a hundred thousand hints
                self._next = hint + 1
            return hint
        ident = self._next
        if not self._wrapped and ident <= self._limit:
            self._next = ident + 1
            return ident
        for _ in range(2):
            ident = self._next
            while ident <= self._limit:
                if ident not in owned and ident not in held:
                    self._next = ident + 1
                    return ident
                ident += 1
            self._next = 1  # wrap once
            self._wrapped = True
        raise PlanError(f"no free {self._what} id left (limit {self._limit})")

    def adopt(self, hint: int) -> int:
        """`take(hint)` where the caller knows the plan does not use `hint` (0 < hint: an id
        the kernel holds); the next free id when `hint` is past the limit."""
        # The caller's promise, checked: an id the plan uses handed out twice sends one backend's
        # traffic to another (a dict lookup per call, a few ms per 100,000 backends).
        assert hint > 0 and hint not in self._owned, f"{self._what} id {hint} adopted while in use"
        if hint > self._limit:
            return self.take()
        self._held.discard(hint)
        if hint >= self._next:
            self._next = hint + 1
        return hint

    def release(self, ident: int) -> None:
        """No one in the plan uses `ident` any more (it may still be in the kernel)."""
        self._held.add(ident)

    def hold(self, ident: int) -> None:
        """The kernel holds `ident`: taken until the kernel lets it go (or a re-adoption claims
        it)."""
        self.hold_all((ident,))

    def hold_all(self, idents: Iterable[int]) -> None:
        """`hold` of many (the whole kernel's ids on start); those the plan owns stay its own."""
        owned = self._owned
        # nothing owned yet (a start): no id to look up in it (an owner that tells its size)
        new = {i for i in idents if i not in owned} if owned else set(idents)
        if new:
            self._held |= new
            self._seen(max(new))

    def settle(self, still_held: Callable[[int], bool]) -> None:
        """Ids the kernel no longer holds and the plan does not use become free."""
        owned = self._owned
        self._held = {i for i in self._held if still_held(i) and i not in owned}

    def _seen(self, ident: int) -> None:
        """Fresh ids count up from the highest one seen."""
        if ident >= self._next:
            self._next = ident + 1
