"""Id allocation for the service maps: one pool per kind of id (service port, backend set, backend,
reverse-NAT entry).

Fresh ids count up from where the last one was handed out and wrap only at the field's limit, so
conntrack and affinity entries of a service just removed do not meet a new one under the same id.
An id given back returns to the pool only once the kernel holds no entry under it (`settle`, at the
end of a flush). On start, the ids the pinned maps hold are offered back as hints (`take(hint)`),
so a restarted agent re-adopts them and rewrites nothing that is still right.
"""

from __future__ import annotations

from collections.abc import Callable

# Largest id each field can carry (ekp_frontend.rev_nat_id is a __u16).
SVC_ID_MAX = 0xFFFFFFFF
SET_ID_MAX = 0xFFFFFFFF
BACKEND_ID_MAX = 0xFFFFFFFF
REVNAT_ID_MAX = 0xFFFF


class PlanError(RuntimeError):
    """The desired state cannot be expressed in the maps (ids exhausted)."""


class IdPool:
    """Ids of one kind: handed out counting up from the last one, wrapping only at `limit`.

    `reserve` marks an id held (by the kernel's contents on start); `release` gives one back, but it
    becomes reusable only after `settle` (the end of a flush), once the kernel no longer holds it.
    """

    def __init__(self, limit: int, what: str) -> None:
        self._limit = limit
        self._what = what
        self._used: set[int] = set()
        self._released: set[int] = set()
        self._next = 1

    def __contains__(self, ident: int) -> bool:
        return ident in self._used

    def __len__(self) -> int:
        return len(self._used)

    def reserve(self, ident: int) -> None:
        self._used.add(ident)
        if ident >= self._next:
            self._next = ident + 1

    def take(self, hint: int = 0) -> int:
        """`hint` when no one else uses it (re-adoption of an id the kernel holds), else the next
        free id."""
        used = self._used
        if 0 < hint <= self._limit and (hint not in used or hint in self._released):
            self._released.discard(hint)
            self.reserve(hint)
            return hint
        for _ in range(2):
            ident = self._next
            while ident <= self._limit:
                if ident not in used:
                    used.add(ident)
                    self._next = ident + 1
                    return ident
                ident += 1
            self._next = 1  # wrap once
        raise PlanError(f"no free {self._what} id left (limit {self._limit})")

    def release(self, ident: int) -> None:
        """No one in the plan uses `ident` any more (it may still be in the kernel)."""
        self._released.add(ident)

    def hold(self, ident: int) -> None:
        """The kernel holds `ident` and the plan does not: taken until the kernel lets it go (or a
        re-adoption claims it)."""
        self.reserve(ident)
        self._released.add(ident)

    def hold_all(self, idents: set[int]) -> None:
        """`hold` of many (the whole kernel's ids on start)."""
        if idents:
            self._used |= idents
            self._released |= idents
            self._next = max(self._next, max(idents) + 1)

    def settle(self, still_held: Callable[[int], bool]) -> None:
        """Released ids the kernel no longer holds become free."""
        for ident in [i for i in self._released if not still_held(i)]:
            self._released.discard(ident)
            self._used.discard(ident)
