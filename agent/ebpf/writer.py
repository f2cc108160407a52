"""The writer: one difference between the desired and the written map contents, turned into ordered
batch writes and deletions.

Pure apart from the maps it is handed (`RawMap`: agent.ebpf.maps.BpfMap, FakeMap). The planner
keeps the desired contents whole (`desired[role]`: key -> value, agent.ebpf.entries ints) and the
written side only where it differs (`pending[role]`: key -> what the map holds, None for nothing);
everywhere else the map holds what is desired. Every check below therefore looks at the pending
keys alone, never at a whole map: a flush after one EndpointSlice change looks at a handful.

Order (nothing a packet can reach ever points at something missing, and room is made before it is
needed, so a desired state that fits the maps is always reached):

1. deletions that are safe now, in the order fe, srcr, slot, member, be, rnat, addr: frontends no longer
   wanted; slots beyond the count of every frontend still pointing at their set; membership of a
   port no written frontend of it can still reach through a written slot; backends no written slot
   or membership entry points at; reverse-NAT entries and source ranges no written frontend uses;
   addresses (ekp_addr) no written frontend or backend is on;
2. writes, in the order addr, be, member, rnat, srcr, slot, fe: addresses first (ekp_addr names
   every address the other maps use), backends before the slots that point at
   them and their membership before a slot does, slots before the count that reaches them grows (a
   shrinking count is written before its slots go, in step 3). One batch per map; when a batch
   finds the map full, the rest is written service port by service port (all of a port or none,
   in kube-proxy's order), the ports that did not fit are reported, and their entries are left
   out of the later maps, so no frontend points further at what is missing;
3. deletions made safe by step 2, then once more the writes that failed, now that room may have
   been made, and the deletions that made safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.ebpf import abi
from agent.ebpf.entries import (
    MEMBER_BACKEND,
    SLOT_POS,
    U32,
    Entries,
    fe_count,
    fe_rnat,
    fe_set,
    fe_sort_key,
    fe_svc,
    key_size,
    pack,
    srcr_rnat,
    value_size,
)
from agent.model.types import Protocol as L4
from agent.model.types import ServicePortName

log = logging.getLogger(__name__)

WRITE_ORDER = ("addr", "be", "member", "rnat", "srcr", "slot", "fe")
DELETE_ORDER = ("fe", "srcr", "slot", "member", "be", "rnat", "addr")

Pending = dict[int, int | None]  # key -> what the map holds where it differs from desired (None: nothing)
Owners = Callable[[str, int], set[ServicePortName]]  # (role, key) -> the service ports it belongs to
ORPHAN = ServicePortName("", "", "", L4.TCP)  # owner of an entry no service port claims


class RawMap(Protocol):
    """What a flush needs of a map: packed batch writes (agent.ebpf.maps.BpfMap, FakeMap)."""

    def update_packed(self, keys: bytes, values: bytes) -> int:
        """Write entries (keys and values each concatenated) in order; returns how many were written
        before the first that found no room (all of them on success); raises for other errors."""

    def delete_packed(self, keys: bytes) -> None:
        """Delete every key (concatenated; missing keys are fine)."""


@dataclass
class FlushResult:
    failed: dict[ServicePortName, str] = field(default_factory=dict)
    updates: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WRITE_ORDER, 0))
    deletes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DELETE_ORDER, 0))

    def summary(self) -> str:
        parts = [f"update {r} x{n}" for r, n in self.updates.items() if n]
        parts += [f"delete {r} x{n}" for r, n in self.deletes.items() if n]
        return ", ".join(parts) or "no changes"

    @property
    def writes(self) -> int:
        return sum(self.updates.values()) + sum(self.deletes.values())

    def log(
        self, family: str, *, first: bool, frontends: int, backends: int, repaired: int, ms: float
    ) -> None:
        """The sync's one line (INFO when it wrote, repaired or failed something, or is the first;
        DEBUG otherwise). `family`: "" for IPv4, " (IPv6)" for the IPv6 maps."""
        level = logging.INFO if self.writes or first or repaired or self.failed else logging.DEBUG
        log.log(
            level,
            "eBPF sync%s%s: %s (%d frontends, %d backends%s%s, %.1f ms)",
            family,
            " (first, from the pinned maps)" if first else "",
            self.summary(),
            frontends,
            backends,
            f", {repaired} difference(s) with the kernel repaired" if repaired else "",
            f", {len(self.failed)} service port(s) not programmed" if self.failed else "",
            ms,
        )


def port_order(spn: ServicePortName) -> tuple[str, str]:
    """kube-proxy's order of service ports (by `ns/name:port`, then protocol)."""
    return str(spn), str(spn.protocol)


def flush(
    desired: Mapping[str, Entries],
    pending: Mapping[str, Pending],
    maps: Mapping[str, RawMap],
    owners: Owners,
    fresh: set[str] | None = None,
) -> FlushResult:
    """Write what differs, in the safe order (module doc); `pending` is updated to what still differs.
    `fresh`: roles whose map holds none of the desired entries (their `pending` is empty instead
    of naming every desired key with None); emptied as they are written."""
    return _Flush(desired, pending, maps, owners, fresh if fresh is not None else set()).run()


class _Flush:
    def __init__(
        self,
        desired: Mapping[str, Entries],
        pending: Mapping[str, Pending],
        maps: Mapping[str, RawMap],
        owners: Owners,
        fresh: set[str],
    ) -> None:
        self.desired = desired
        self.pending = pending
        self.maps = maps
        self.owners = owners
        self.fresh = fresh
        self.result = FlushResult()
        self.failed_now: set[ServicePortName] = set()

    def run(self) -> FlushResult:
        for role, p in self.pending.items():
            d = self.desired[role]
            same = [k for k, w in p.items() if d.get(k) == w]
            if len(same) == len(p):
                p.clear()
            else:
                for k in same:
                    del p[k]
        self._delete(late=False)
        self._write()
        failed = self.result.failed
        self.failed_now = set(failed)
        self._delete(late=True)
        if failed:
            retry = set(failed)
            failed.clear()
            self._write(only=retry)
            self.failed_now = set(failed)
            self._delete(late=True)
        return self.result

    # ---- what the maps hold, where it differs -------------------------------------------------

    def _written_fe(self) -> list[int]:
        return [w for w in self.pending["fe"].values() if w is not None]

    def _written_slot_backends(self) -> set[int]:
        return {w for w in self.pending["slot"].values() if w is not None}

    # ---- deletions ----------------------------------------------------------------------------

    def _delete(self, *, late: bool) -> None:
        for role in DELETE_ORDER:
            p, d = self.pending[role], self.desired[role]
            doomed = [k for k, w in p.items() if w is not None and k not in d]
            if not doomed:
                continue
            doomed = self._deletable(role, doomed, late)
            if not doomed:
                continue
            self.maps[role].delete_packed(pack(doomed, key_size(role)))
            for k in doomed:
                del p[k]
            self.result.deletes[role] += len(doomed)

    def _deletable(self, role: str, keys: list[int], late: bool) -> list[int]:
        """The keys (written, not desired) that nothing written still needs (module doc, step 1)."""
        if role == "fe":
            return keys
        if role == "slot":
            # Blocked only by a frontend whose written value still points at the set with a count
            # reaching the slot: a frontend as desired points at a desired set, whose slots are
            # 1..count exactly.
            reach: dict[int, int] = {}
            for w in self._written_fe():
                s = fe_set(w)
                reach[s] = max(reach.get(s, 0), fe_count(w))
            return [k for k in keys if (k >> SLOT_POS) > reach.get(k & U32, 0)]
        if role == "member":
            svcs = {fe_svc(w) for w in self._written_fe()}
            bids = self._written_slot_backends()
            return [k for k in keys if (k & U32) not in svcs and (k >> MEMBER_BACKEND) not in bids]
        if role == "be":
            # Nothing written may point at it: no slot, and no membership entry (the data path
            # follows a member's backend id for affinity and UDP flows).
            bids = self._written_slot_backends()
            bids.update(k >> MEMBER_BACKEND for k, w in self.pending["member"].items() if w is not None)
            return [k for k in keys if k not in bids]
        if role == "addr":
            # Named while a written frontend or backend is on the address.
            used = {k & U32 for k, w in self.pending["fe"].items() if w is not None}
            used.update(w & U32 for w in self.pending["be"].values() if w is not None)
            return [k for k in keys if k not in used]
        rnats = {fe_rnat(w) for w in self._written_fe()}
        if role == "rnat":
            return [k for k in keys if k not in rnats]
        # srcr: goes early only when no frontend uses its reverse-NAT id (a frontend keeping its
        # ranges keeps the old ones until the new ones are written), late when its users all got
        # their writes through.
        wanted = self.desired["rnat"]
        out = []
        for k in keys:
            rid = srcr_rnat(k)
            if rid in rnats:
                continue
            if rid not in wanted or (late and not self.owners(role, k) & self.failed_now):
                out.append(k)
        return out

    # ---- writes -------------------------------------------------------------------------------

    def _write(self, only: set[ServicePortName] | None = None) -> None:
        failed = self.result.failed
        for role in WRITE_ORDER:
            p, d = self.pending[role], self.desired[role]
            # a map that holds none of desired, no port failed (a first sync): all of it, in order
            whole = role in self.fresh and not p and only is None and not failed
            keys = [k for k, w in p.items() if k in d and d[k] != w] if p else []
            unwritten: list[int] = []  # desired keys the map lacks that `pending` does not name
            if role in self.fresh:
                unwritten = list(d) if not p else [k for k in d if k not in p]
            if only is not None or failed:  # owners matter only after a failure
                self._name(role, unwritten)  # the by-port path reads them in `pending`
                keys = [k for k in keys + unwritten if self._wanted(role, k, only)]
                unwritten = []
            named = len(keys)
            keys += unwritten
            if not keys:
                self.fresh.discard(role)  # nothing desired: nothing the map lacks
                continue
            if role == "fe":
                # A full map takes whole services in kube-proxy's order of addresses: both scopes
                # of a frontend sort next to each other (the other maps' order decides nothing).
                keys.sort(key=fe_sort_key)
            target = self.maps[role]
            ks, vs = key_size(role), value_size(role)
            values = list(d.values()) if whole and role != "fe" else [d[k] for k in keys]
            done = target.update_packed(pack(keys, ks), pack(values, vs))
            if done == len(keys):
                if named == len(p):
                    p.clear()
                else:
                    for k in keys:
                        p.pop(k, None)
                self.fresh.discard(role)
                self.result.updates[role] += done
                continue
            self._name(role, unwritten)  # the by-port path below reads them in `pending`
            # The map is full. What went in first is arbitrary, and a service port missing one entry
            # is as unprogrammed as one missing all: take back this batch's new entries and write
            # whole service ports instead, in kube-proxy's order, as many as fit.
            went = keys[:done]
            fresh = [k for k in went if p[k] is None]
            if fresh:
                target.delete_packed(pack(fresh, ks))
            for k in went:
                if p[k] is not None:
                    del p[k]  # an overwrite of an existing entry: it stays written
            self.result.updates[role] += done - len(fresh)
            self.result.updates[role] += self._write_by_service_port(role, keys)

    def _name(self, role: str, unwritten: list[int]) -> None:
        """A fresh role's pending names its unwritten keys (None: the map lacks them) from here on."""
        self.pending[role].update(dict.fromkeys(unwritten))
        self.fresh.discard(role)

    def _wanted(self, role: str, key: int, only: set[ServicePortName] | None) -> bool:
        users = self.owners(role, key)
        if only is not None and not users & only:
            return False
        # every user of it already failed: do not point further at it
        return not (users and users <= self.result.failed.keys())

    def _write_by_service_port(self, role: str, keys: Sequence[int]) -> int:
        """Write `keys` service port by service port (sorted), each port's entries all or none; a
        port whose entries do not fit is taken back out and reported. Returns the entries written."""
        p, d = self.pending[role], self.desired[role]
        target = self.maps[role]
        ks, vs = key_size(role), value_size(role)
        by_port: dict[ServicePortName, list[int]] = {}
        for k in keys:
            if k not in p:
                continue  # written above (an overwrite)
            for spn in self.owners(role, k) or {ORPHAN}:
                by_port.setdefault(spn, []).append(k)
        count = 0
        spec = abi.MAPS[role]
        why = f"BPF map {spec.name} is full: raise {spec.size_flag}"
        for spn in sorted(by_port, key=port_order):
            todo = [k for k in by_port[spn] if k in p]
            done = target.update_packed(pack(todo, ks), pack([d[k] for k in todo], vs))
            if done == len(todo):
                for k in todo:
                    del p[k]
                count += done
                continue
            went = todo[:done]
            fresh = [k for k in went if p[k] is None]
            if fresh:
                target.delete_packed(pack(fresh, ks))
            for k in went:
                if p[k] is not None:
                    del p[k]
                    count += 1
            if spn is not ORPHAN:
                self.result.failed.setdefault(spn, why)
        return count
