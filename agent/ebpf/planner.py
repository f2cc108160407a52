"""The eBPF planner: the desired contents of the service maps, kept between syncs port by port.

Pure (no bcc, no pyroute2): the proxier owns one `Planner` for the agent's life and calls

    planner.update(state, node, changed)   # re-plan the changed service ports (None: all)
    planner.flush(maps)                    # write what differs, in a safe order (agent.ebpf.writer)
    planner.reconcile(dump)                # what the kernel really holds (start, periodic resync)

The pieces it puts together, each in its own module: `agent.ebpf.layout` (the frontends, source
ranges and slot order of one port: what the entries say), `agent.ebpf.ids` (id pools),
`agent.ebpf.entries` (keys and values as ints) and `agent.ebpf.writer` (a difference turned into
ordered batch writes).

State, compact on purpose (10,000 services of 10 endpoints are a third of a million entries):

* `desired[role]`: every entry the maps should hold, key -> value as ints, maintained fragment by
  fragment, so a change of one EndpointSlice re-plans one service port and touches a handful of
  entries. It is the one copy of the map contents: fragments keep ids and keys, not entries.
* `pending[role]`: the written side, only where it differs from `desired`: key -> what the map
  holds (None: nothing). Every change to `desired` records the value it replaces (what the map
  holds, since the two agreed there), a flush empties it, `reconcile` fills it from a read-back.
  A role in `fresh` (its map held nothing at the start or at a read-back while nothing was
  desired, and nothing was written since) has an empty `pending` standing for "the map holds
  none of `desired`": on a first sync `pending` would otherwise name every desired key with None,
  a second dict as large as `desired` (about 20 MiB at 10,000 Services). On a restart the
  kernel's contents are held aside (`_adopted`) while the first `update` plans as a fresh start
  would, the ids and slot order taken from them; then `pending` is their difference from the plan,
  found in one comparison per map (none to make when they are equal, as after a restart over an
  unchanged state). Matched entry by entry while the plan grew, as before, each put looked its
  key up in the kernel's dicts, filled in the kernel's bucket order: random against the plan's,
  about a third of a restart's sync in cache misses at 10,000 Services.
* `desired["addr"]` (ekp_addr) is derived from the desired frontends and backends as they change:
  one entry per address, a bit per scope it has frontends in and BACKEND when a backend is on it;
  a bit stands for its first user, and only users beyond the first are counted (`_address`).
* Per service port a `Fragment`: its service port id, its sets (id and count), the frontend keys it
  holds, the backends it uses (and the flags it gives them), its reverse-NAT ids.
* Ids: a service port keeps its svc_id for its life; a set keeps its id while its service port
  keeps that kind of set; a backend keeps its id while any service port uses its (ip, port,
  protocol), refcounted; a reverse-NAT id belongs to a frontend (addr, port, protocol). On start,
  `reconcile(adopt=True)` offers the ids and slot order the pinned maps hold back to the next
  `update`, so a restart over unchanged state writes nothing.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter
from socket import inet_aton
from typing import cast

from agent.config import Config, NodeContext
from agent.ebpf import backends
from agent.ebpf.abi import AddrFlag, FrontendFlag, MemberFlag, Scope
from agent.ebpf.backends import Backends
from agent.ebpf.codec import Value
from agent.ebpf.entries import (
    FE_PROTO,
    FE_RNAT,
    FE_SCOPE,
    FE_SET,
    IDENT,
    MEMBER_BACKEND,
    SLOT_POS,
    U16,
    U32,
    Entries,
    fe_flags,
    fe_rnat,
    fe_set,
    fe_sort_key,
    fe_svc,
    fe_value,
    from_dump,
    key_size,
    member_key,
    slot_key,
    srcr_key,
    srcr_rnat,
)
from agent.ebpf.ids import (
    REVNAT_ID_MAX,
    SET_ID_MAX,
    SVC_ID_MAX,
    IdPool,
    PlanError,
)
from agent.ebpf.layout import KINDS, Fe, SetKind, config_entry, frontends, maglev_tables, slots, source_ranges
from agent.ebpf.writer import FlushResult, Pending, RawMap, flush, port_order
from agent.localdetect import LocalDetector
from agent.model.types import Endpoint, ProxyState, ServiceEndpoints, ServicePort, ServicePortName

__all__ = ["ROLES", "FlushResult", "PlanError", "Planner", "RawMap", "config_entry"]

# The service maps, in the order they are rendered. `addr` is derived from the others: one entry
# per address of a desired frontend (a bit per scope) or backend (BACKEND).
ROLES = ("fe", "slot", "be", "rnat", "member", "srcr", "addr")
_ADDR_BACKEND = int(AddrFlag.BACKEND)
_SCOPE_HOST = int(Scope.HOST)

_BE_LOCAL = backends.LOCAL
_BE_TERMINATING = backends.TERMINATING
_BE_HOST = backends.HOST
_MEMBER_FLAG: dict[SetKind, int] = {"cluster": int(MemberFlag.CLUSTER), "local": int(MemberFlag.LOCAL)}
_NO_ENDPOINTS = int(FrontendFlag.NO_ENDPOINTS)
_LOCAL = int(FrontendFlag.LOCAL)
_SOURCE_RANGES = int(FrontendFlag.SOURCE_RANGES)
_HOST_BACKEND = int(FrontendFlag.HOST_BACKEND)
_NO_EPS = ServiceEndpoints()
_IP, _PORT = attrgetter("ip"), attrgetter("port")
_IS_LOCAL, _TERMINATING = attrgetter("is_local"), attrgetter("terminating")
_U32_CODE = next(code for code in ("I", "L") if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"
_ADDRESSED = ("fe", "be")  # the roles `addr` is derived from
_RNAT_VALUE = (1 << FE_PROTO) - 1  # a reverse-NAT entry: the frontend's address and port


# Empty frozensets are not shared by CPython 3.11 (216 bytes each): most fragments hold these.
_NO_KEYS: frozenset[int] = frozenset()
_NO_PORTS: frozenset[ServicePortName] = frozenset()


class Fragment:
    """What one service port holds in the maps (its entries are in `Planner.desired`)."""

    __slots__ = ("backends", "blocked", "eps", "fes", "rnats", "sets", "sp", "srcr", "svc_id", "taken_from")

    def __init__(self) -> None:
        self.sp: ServicePort | None = None  # what it was planned from: an unchanged port is not re-planned
        self.eps: ServiceEndpoints | None = None
        self.svc_id = 0
        # (kind, set id, count) per kind of set, and reverse-NAT (ident, id) pairs flat: tuples,
        # where the dicts of one or two items were 224 bytes each (`_sets_of`, `_rnats_of`)
        self.sets: tuple[tuple[SetKind, int, int], ...] = ()
        self.fes: tuple[int, ...] = ()  # the frontend keys it holds
        # backend id << 16 | the flags this port gives it, packed (`_backends_of`): 8 bytes a
        # backend where a dict took about 36 (3 MiB at 10,000 Services of 10 endpoints)
        self.backends = b""
        self.rnats: tuple[int, ...] = ()
        self.srcr: tuple[int, ...] = ()
        self.blocked = _NO_KEYS  # frontends a port before this one holds
        self.taken_from = _NO_PORTS  # ports after it that held one


_GONE = Fragment()
_BE_ID = 16  # a fragment's packed backend: id << 16 | flags (agent.ebpf.abi.BackendFlag: 10 bits)
_BE_FLAGS = (1 << _BE_ID) - 1


class Planner:
    """Desired entries of the service maps and where the maps differ (see module doc)."""

    def __init__(self, config: Config, ip: Callable[[str], int] | None = None) -> None:
        """`ip`: how the entries hold an address of the family planned. None: IPv4, the address
        itself (network order); the IPv6 planner passes its 32-bit handles (agent/ebpf/family6.py
        widens them into the IPv6 maps' 16-byte addresses), so every entry keeps IPv4's shape."""
        self._config = config
        self._ip = ip
        self.desired: dict[str, Entries] = {r: {} for r in ROLES}
        self.pending: dict[str, Pending] = {r: {} for r in ROLES}
        self.fresh: set[str] = set(ROLES)  # roles whose map holds none of desired (pending empty)
        # Per role, the flushes that had something to write there, and the read-back a resync
        # last found equal to the desired entries (its digest, and that count then): `reconcile`
        # skips decoding a map whose bytes and the planner's side are both as they were then.
        self._flushes: dict[str, int] = dict.fromkeys(ROLES, 0)
        self._verified: dict[str, tuple[bytes, int]] = {}
        self._frags: dict[ServicePortName, Fragment] = {}
        self._fe_owner: dict[int, ServicePortName] = {}
        self._fe_waiting: dict[int, set[ServicePortName]] = {}  # frontend -> ports it is blocked for
        self._waits: dict[ServicePortName, frozenset[int]] = {}
        self._srcr_users: dict[int, set[ServicePortName]] = {}
        self._set_owner: dict[int, ServicePortName] = {}
        self._svc_owner: dict[int, ServicePortName] = {}
        self.backends = Backends(self.desired["be"])
        # ident -> (id, the ports using it): a tuple, rebuilt on the rare change (a set per
        # frontend was 200 bytes more, 2 MiB at 10,000 Services)
        self._rnats: dict[int, tuple[int, tuple[ServicePortName, ...]]] = {}
        self._rnat_by_id: dict[int, int] = {}
        self.svc_ids = IdPool(SVC_ID_MAX, "service port", self._svc_owner)
        self.set_ids = IdPool(SET_ID_MAX, "backend set", self._set_owner)
        self.rnat_ids = IdPool(REVNAT_ID_MAX, "reverse-NAT", self._rnat_by_id)
        # Re-adoption hints from the kernel's contents (start only): frontend key -> its value,
        # backend ident -> id, the kernel's slots.
        self._fe_hints: Entries = {}
        self._slot_hints: Pending = {}
        # What the maps held at a start (role -> entries), while the first `update` plans as a
        # fresh start would; `pending` is then their difference from the plan (`_adopt_done`).
        self._adopted: dict[str, Entries] | None = None
        self._replanned: set[ServicePortName] = set()  # since the last complete flush
        self._be_owners: dict[int, set[ServicePortName]] | None = None
        self._changes = 0  # entries of `desired` changed so far (tells a re-plan that changed nothing)
        # `addr`, derived: how many desired frontends and backends beyond the first put each
        # (address, flag) there (keyed address << 8 | flag; see `_address`).
        self._addr_extra: dict[int, int] = {}
        self.node = NodeContext()
        self.local = LocalDetector()
        self.cfg: Value | None = None

    # ------------------------------------------------------------------ desired, and what it replaces

    def _put(self, role: str, key: int, value: int) -> None:
        d = self.desired[role]
        old = d.get(key)
        if old == value:
            return
        p = self.pending[role]
        if key in p:
            if p[key] == value:
                del p[key]  # the map holds it already (a restart re-adopting the kernel's entry)
        elif role not in self.fresh:
            p[key] = old  # the map holds what was desired here
        d[key] = value
        self._changes += 1
        if old is None and role in _ADDRESSED:
            self._address(role, key, value, +1)

    def _drop(self, role: str, key: int) -> None:
        d = self.desired[role]
        old = d.pop(key, None)
        if old is None:
            return
        p = self.pending[role]
        if key not in p and role not in self.fresh:
            p[key] = old
        self._changes += 1
        if role in _ADDRESSED:
            self._address(role, key, old, -1)

    def _address(self, role: str, key: int, value: int, sign: int) -> None:
        """A frontend (its address, the bit of its scope) or a backend (its address, BACKEND)
        comes into or leaves `addr`: the bit is set while any user has it. A bit's first user is
        the bit itself; only the users beyond it are counted (most addresses have one), so this
        costs a dict entry where an address is shared and nothing where it is not."""
        if role == "fe" and key >> FE_SCOPE == _SCOPE_HOST:
            return  # the socket programs' alone: no packet asks ekp_addr about it
        addr, flag = (key & U32, 1 << (key >> FE_SCOPE)) if role == "fe" else (value & U32, _ADDR_BACKEND)
        flags = self.desired["addr"].get(addr, 0)
        extra = self._addr_extra
        ref = addr << 8 | flag
        if sign > 0:
            if flags & flag:
                extra[ref] = extra.get(ref, 0) + 1
            else:
                self._put("addr", addr, flags | flag)
            return
        n = extra.get(ref)
        if n is None:  # its last user
            if flags & ~flag:
                self._put("addr", addr, flags & ~flag)
            else:
                self._drop("addr", addr)
        elif n == 1:
            del extra[ref]
        else:
            extra[ref] = n - 1

    @property
    def in_sync(self) -> bool:
        """The maps hold what is desired, as far as the planner knows."""
        return (
            self._adopted is None
            and not any(self.pending.values())
            and not any(self.desired[r] for r in self.fresh)
        )

    # ------------------------------------------------------------------ planning

    def maglev_tables(self) -> dict[int, tuple[tuple[str, ...], tuple[int, ...]]]:
        """The Maglev tables the desired frontends need (agent.ebpf.layout.maglev_tables)."""
        return maglev_tables(self.desired["fe"], self.desired["slot"], self.desired["be"])

    def update(
        self, state: ProxyState, node: NodeContext, changed: Iterable[ServicePortName] | None
    ) -> set[ServicePortName]:
        """Re-plan the service ports in `changed` (every port when None, or when the node's
        addresses changed: then ports whose service port and endpoints are as last planned are
        skipped unless the node changed); returns the ports whose entries changed."""
        detector = self._config.local_detector(state.node.pod_cidrs, int(state.family))
        moved = node != self.node or detector != self.local  # every port's frontends may change
        every = changed is None or moved
        wanted = set(state.services) | set(self._frags) if every else set(changed or ())
        self.node = node
        self.local = detector
        # the config is the IPv4 planner's (it holds no IPv6 address; the IPv6 one leaves it alone)
        self.cfg = config_entry(node, self._config, detector) if self._ip is None else None
        touched: set[ServicePortName] = set()
        # Removals first (they free frontends and ids), then in kube-proxy's order, so the ids of
        # a fresh start follow the sorted ports as `--dry-run` and the golden files show them.
        # A frontend two ports want (possible only for a node address: the model resolves every
        # other conflict) goes to the first in that order, whatever the history: a port that
        # takes one from another, or releases one others waited for, has them planned again.
        services, endpoints = state.services, state.endpoints
        gone = [spn for spn in wanted if spn not in services]
        queue = gone + sorted((spn for spn in wanted if spn in services), key=port_order)
        skip_same = every and not moved
        while queue:
            woken: set[ServicePortName] = set()
            for spn in queue:
                sp = services.get(spn)
                eps = endpoints.get(spn, _NO_EPS) if sp is not None else None
                old = self._frags.get(spn)
                # A fragment without records (a planner kept across a restart whose port changed,
                # or went, while the agent was down: agent.ebpf.snapshot) is planned again.
                if skip_same and old is not None and sp is not None and old.sp == sp and old.eps == eps:
                    old.sp, old.eps = (
                        sp,
                        eps,
                    )  # the model's own, if it made equal ones: compared by identity next
                    continue
                before = self._changes
                self._replan(spn, sp, eps, woken)
                if self._changes != before:
                    touched.add(spn)
            queue = sorted((spn for spn in woken if spn in services), key=port_order)
            skip_same = False
        if self._adopted is not None:
            self._adopt_done(self._adopted)
        if every:
            # Every port is planned: the kernel's ids are re-adopted or released. Hints kept
            # longer would hand a later Service an id released in this run (ids.py counts up).
            self.forget_hints()
        return touched

    def _replan(
        self,
        spn: ServicePortName,
        sp: ServicePort | None,
        eps: ServiceEndpoints | None,
        woken: set[ServicePortName],
    ) -> None:
        old = self._frags.get(spn) or _GONE
        self._replanned.add(spn)
        new_be: dict[int, int] = {}  # the backends of the new fragment, unpacked
        new = Fragment() if sp is None or eps is None else self._build(spn, old, sp, eps, new_be)
        old_be = _backends_of(old.backends) if old.backends else {}
        if sp is None:
            self._frags.pop(spn, None)
        else:
            self._frags[spn] = new
        for key in self._waits.pop(spn, ()):
            waiting = self._fe_waiting[key]
            waiting.discard(spn)
            if not waiting:
                del self._fe_waiting[key]
        if new.blocked:
            self._waits[spn] = new.blocked
            for key in new.blocked:
                self._fe_waiting.setdefault(key, set()).add(spn)
        woken.update(new.taken_from)
        for key in set(old.fes).difference(new.fes) if old.fes else ():
            if self._fe_owner.get(key) != spn:
                continue  # a port ordered before this one took it: its entry is in place
            del self._fe_owner[key]
            self._drop("fe", key)
            woken.update(self._fe_waiting.get(key, ()))
        # Sets the port no longer has (or has under another id): every slot goes, the id is freed.
        new_sets = _sets_of(new) if old.sets else {}
        for kind, set_id, count in old.sets:
            now = new_sets.get(kind)
            if now is not None and now[0] == set_id:
                continue
            for pos in range(1, count + 1):
                self._drop("slot", slot_key(set_id, pos))
            self._set_owner.pop(set_id, None)
            self.set_ids.release(set_id)
        # Membership: what the old sets held and the new ones do not.
        if old.svc_id:
            kept = new_be if new.svc_id == old.svc_id else {}
            for bid in old_be:
                if bid not in kept:
                    self._drop("member", member_key(old.svc_id, bid))
            if old.svc_id != new.svc_id:
                self._svc_owner.pop(old.svc_id, None)
                self.svc_ids.release(old.svc_id)
        if old.srcr != new.srcr:
            # Keyed by reverse-NAT id, which two ports share while one takes a frontend from the
            # other: an entry goes only when its last user lets go.
            for key in set(old.srcr) - set(new.srcr):
                users = self._srcr_users[key]
                users.discard(spn)
                if not users:
                    del self._srcr_users[key]
                    self._drop("srcr", key)
            for key in new.srcr:
                self._srcr_users.setdefault(key, set()).add(spn)
                self._put("srcr", key, 1)
        self._update_backends(old_be, new_be)
        self._update_rnats(spn, _rnats_of(old), _rnats_of(new))

    def _build(
        self,
        spn: ServicePortName,
        old: Fragment,
        sp: ServicePort,
        eps: ServiceEndpoints,
        new_be: dict[int, int],
    ) -> Fragment:
        """The new fragment of a port; `new_be` is filled with its backends (id -> flags)."""
        new = Fragment()
        new.sp, new.eps = sp, eps
        fes: list[Fe] = []
        blocked: set[int] = set()
        taken: set[ServicePortName] = set()
        ip = self._ip
        fronts = (
            frontends(sp, self.node, self._config, self.local)
            if ip is None
            else frontends(sp, self.node, self._config, self.local, ip, localhost=False)
        )
        for fe in fronts:
            owner = self._fe_owner.get(fe.key, spn)
            if owner == spn or port_order(spn) < port_order(owner):
                fes.append(fe)
                if owner != spn:
                    taken.add(owner)
            else:
                blocked.add(fe.key)
        new.blocked = frozenset(blocked) if blocked else _NO_KEYS
        new.taken_from = frozenset(taken) if taken else _NO_PORTS
        # One id for every frontend of the port: the data path keys affinity and membership by it.
        svc_id = new.svc_id = old.svc_id or self.svc_ids.take(self._svc_hint(fes))
        self._svc_owner[svc_id] = spn
        sets: dict[SetKind, tuple[int, int]] = {}
        old_sets = _sets_of(old)
        rnats: dict[int, int] = {}
        old_rnats = _rnats_of(old)
        # The 16-bit reverse-NAT ids can run out (PlanError): taken before anything is desired.
        for fe in fes:
            if fe.rnat not in rnats:
                rnats[fe.rnat] = old_rnats.get(fe.rnat) or self._rnat_id(fe.rnat, fe.key)
        proto = sp.protocol.number << 48
        node_ips = frozenset(self.node.node_ips)  # an endpoint on one of them is a host-network one here
        backends = new_be
        ids_of = self.backends.ids_of
        put, drop = self._put, self._drop
        sd, sp_ = self.desired["slot"], self.pending["slot"]
        md, mp = self.desired["member"], self.pending["member"]
        slot_fresh, member_fresh = "slot" in self.fresh, "member" in self.fresh
        changes = 0
        members: dict[int, int] = {}  # backend id -> member flags
        counts: dict[SetKind, int] = {}
        hosted: set[SetKind] = set()  # sets with an endpoint on a node address
        kinds = {fe.kind for fe in fes}
        for kind in KINDS:
            if kind not in kinds:
                continue
            chosen = eps.cluster if kind == "cluster" else eps.local
            order = ids_of(_idents(chosen, proto, ip))
            # Flags only where an endpoint says something: checked for the whole set in C first
            # (on a start nearly every set says nothing: no per-endpoint loop in Python).
            if (
                any(map(_IS_LOCAL, chosen))
                or any(map(_TERMINATING, chosen))
                or not node_ips.isdisjoint(map(_IP, chosen))
            ):
                for ep, bid in zip(chosen, order, strict=True):
                    if ep.is_local or ep.terminating or ep.ip in node_ips:
                        flags = (_BE_LOCAL if ep.is_local else 0) | (_BE_TERMINATING if ep.terminating else 0)
                        if ep.ip in node_ips:
                            flags |= _BE_HOST
                            if ip is not None:  # the IPv6 planner's alone: the tc IPv6 path reads it
                                hosted.add(kind)
                        backends[bid] = backends.get(bid, 0) | flags
                    elif bid not in backends:
                        backends[bid] = 0
            elif backends:
                for bid in order:
                    backends.setdefault(bid, 0)
            else:
                backends.update(dict.fromkeys(order, 0))
            if len(set(order)) != len(order):
                order = list(dict.fromkeys(order))
            held = old_sets.get(kind)
            if held is not None:
                set_id, before = held
                previous = {pos: self.desired["slot"][slot_key(set_id, pos)] for pos in range(1, before + 1)}
            else:
                set_id, before = self.set_ids.take(self._set_hint(fes, kind)), 0
                previous = self._kernel_slots(set_id)
            self._set_owner[set_id] = spn
            placed = slots(order, previous)
            if slot_fresh and held is None:
                # A set new to the port in a map that holds none of desired: none of its keys is
                # desired yet (its id was free) and nothing is pending: every entry is new.
                sd.update(zip(_slot_keys(set_id, len(placed)), placed, strict=True))
                changes += len(placed)
            else:
                changes += _put_all(
                    sd,
                    sp_,
                    [(set_id | pos << SLOT_POS, bid) for pos, bid in enumerate(placed, 1)],
                    slot_fresh,
                )
            for pos in range(len(placed) + 1, before + 1):
                drop("slot", set_id | pos << SLOT_POS)
            sets[kind] = (set_id, len(placed))
            counts[kind] = len(placed)
            bit = _MEMBER_FLAG[kind]
            if members:
                for bid in placed:
                    members[bid] = members.get(bid, 0) | bit
            else:
                members = dict.fromkeys(placed, bit)
        shift = MEMBER_BACKEND
        if member_fresh and not old.svc_id:
            # A new service port id in a map that holds none of desired: every entry is new.
            md.update(zip([svc_id | bid << shift for bid in members], members.values(), strict=True))
            changes += len(members)
        else:
            changes += _put_all(
                md, mp, [(svc_id | bid << shift, bits) for bid, bits in members.items()], member_fresh
            )
        self._changes += changes
        ranges: list[tuple[int, int]] = []
        if sp.load_balancer_source_ranges:
            ranges = source_ranges(sp, self.node) if ip is None else source_ranges(sp, self.node, ip, 6)
        srcr: list[int] = []
        for fe in fes:
            flags = fe.flags
            count = counts[fe.kind]
            if count == 0 and (fe.kind == "cluster" or not eps.has_any):
                flags |= _NO_ENDPOINTS
            if fe.kind in hosted:
                flags |= _HOST_BACKEND
            rid = rnats[fe.rnat]
            self._fe_owner[fe.key] = spn
            put("fe", fe.key, fe_value(svc_id, sets[fe.kind][0], count, flags, fe.affinity, rid))
            if fe.flags & _SOURCE_RANGES:
                srcr += [srcr_key(32 + plen, rid, net) for plen, net in ranges]
        new.fes = tuple(fe.key for fe in fes)
        new.srcr = tuple(dict.fromkeys(srcr))
        new.backends = array("Q", [bid << _BE_ID | flags for bid, flags in new_be.items()]).tobytes()
        new.sets = tuple((kind, set_id, count) for kind, (set_id, count) in sets.items())
        new.rnats = tuple(v for pair in rnats.items() for v in pair)
        return new

    def _kernel_slots(self, set_id: int) -> dict[int, int]:
        """The slot order the kernel holds for a re-adopted set (start only), else none."""
        hints = self._slot_hints
        if not hints:
            return {}
        out: dict[int, int] = {}
        pos = 1
        while (bid := hints.get(set_id | pos << SLOT_POS)) is not None:
            out[pos] = bid
            pos += 1
        return out

    def _set_hint(self, fes: list[Fe], kind: SetKind) -> int:
        if not self._fe_hints:
            return 0
        for fe in fes:
            hint = self._fe_hints.get(fe.key)
            if hint is not None and fe.kind == kind and bool(fe_flags(hint) & _LOCAL) == (kind == "local"):
                return fe_set(hint)
        return 0

    def _svc_hint(self, fes: list[Fe]) -> int:
        """The service port id the kernel's frontends of this port carried (start only): the
        first frontend's, in kube-proxy's order."""
        hints = self._fe_hints
        if not hints:
            return 0
        held = [fe.key for fe in fes if fe_svc(hints.get(fe.key, 0))]
        return fe_svc(hints[min(held, key=fe_sort_key)]) if held else 0

    def _rnat_id(self, ident: int, fe_key: int) -> int:
        rec = self._rnats.get(ident)
        if rec is not None:
            return rec[0]
        hint = self._fe_hints.get(fe_key)
        rid = fe_rnat(hint) if hint is not None else 0
        if rid:
            held = (self.pending if self._adopted is None else self._adopted)["rnat"].get(rid)
            if held is not None and held != ident & _RNAT_VALUE:
                rid = 0  # the kernel's entry under that id names another frontend
        rid = self.rnat_ids.take(rid)
        self._rnats[ident] = (rid, ())
        self._rnat_by_id[rid] = ident
        return rid

    def _update_backends(self, old: Mapping[int, int], new: Mapping[int, int]) -> None:
        d, p, fresh = self.desired["be"], self.pending["be"], "be" in self.fresh
        addr, extra = self.desired["addr"], self._addr_extra
        addr_p, addr_fresh = self.pending["addr"], "addr" in self.fresh
        for bid, value in self.backends.update(old, new):
            if value is None:
                self._drop("be", bid)
                continue
            # `_put("be", ...)` and, for a new entry, `_address`'s first half, inline: a start
            # puts a hundred thousand of these.
            was = d.get(bid)
            if was == value:
                continue
            if bid in p:
                if p[bid] == value:
                    del p[bid]
            elif not fresh:
                p[bid] = was
            d[bid] = value
            self._changes += 1
            if was is None:
                ip = value & U32
                held = addr.get(ip)
                flags = held or 0
                if flags & _ADDR_BACKEND:
                    ref = ip << 8 | _ADDR_BACKEND
                    extra[ref] = extra.get(ref, 0) + 1
                    continue
                # `_put("addr", ip, ...)`, inline: the bit is new, so the entry changes
                flags |= _ADDR_BACKEND
                if ip in addr_p:
                    if addr_p[ip] == flags:
                        del addr_p[ip]
                elif not addr_fresh:
                    addr_p[ip] = held
                addr[ip] = flags
                self._changes += 1

    def _update_rnats(self, spn: ServicePortName, old: Mapping[int, int], new: Mapping[int, int]) -> None:
        for ident in old.keys() | new.keys():
            if (ident in old) == (ident in new):
                continue
            rid, users = self._rnats[ident]
            if ident in new:
                if spn not in users:
                    self._rnats[ident] = (rid, (*users, spn))
                self._put("rnat", rid, ident & _RNAT_VALUE)
            else:
                users = tuple(u for u in users if u != spn)
                self._rnats[ident] = (rid, users)
                if not users:
                    del self._rnats[ident], self._rnat_by_id[rid]
                    self.rnat_ids.release(rid)
                    self._drop("rnat", rid)

    # ------------------------------------------------------------------ the kernel's view

    def reconcile(self, dump: Mapping[str, tuple[bytes, bytes]], *, adopt: bool = False) -> int:
        """Take `dump` (what the maps hold: `dump_raw` per role) as the written state; returns how
        many entries differ from the desired state (to be repaired by the next flush). With `adopt`
        (the first sync after a start), the ids and slot order the dump holds are re-adopted by the
        next `update`."""
        assert not (adopt and any(self.desired.values())), "re-adoption is for a new planner's first plan"
        self._adopted = None  # a read-back the last start's update did not get to is superseded
        if adopt:
            return self._adopt(dump)
        differ = 0
        for role in ROLES:
            keys, values = dump.get(role, (b"", b""))
            digest = _digest(keys, values)
            if self._verified.get(role) == (digest, self._flushes[role]) and self._settled(role):
                continue  # the very bytes found equal to desired, and nothing desired changed since
            kernel = from_dump(role, keys, values)
            if self.desired[role]:
                differs = self._differ(role, kernel)
                if not differs:
                    self._verified[role] = (digest, self._flushes[role])
                differ += differs
                continue
            # Nothing planned here: all of it differs (an empty map: what gets planned next is
            # missing from it, `fresh`).
            self.pending[role] = cast(Pending, kernel)  # its only reference: widened safely
            if kernel:
                self.fresh.discard(role)
            else:
                self.fresh.add(role)
            differ += len(kernel)
        self._hold_kernel_ids()
        return differ

    def _settled(self, role: str) -> bool:
        """Whether `desired[role]` is what the map held after the last flush: every change to it
        leaves an entry in `pending` (`_put`, `_drop`) until a flush writes it, counted in
        `_flushes`; a fresh role's changes leave none, so it never counts as settled."""
        return not self.pending[role] and role not in self.fresh

    def _adopt(self, dump: Mapping[str, tuple[bytes, bytes]]) -> int:
        """A start: the dump held aside while the first `update` plans as a fresh start would
        (nothing recorded per put), the kernel's ids held and offered back as hints; `update` then
        diffs the plan against it (`_adopt_done`). Returns the entries the dump holds."""
        adopted = {role: from_dump(role, *dump.get(role, (b"", b""))) for role in ROLES}
        self._hold(_kernel_ids(adopted, dump))
        for role in adopted:
            self.pending[role] = {}
            self.fresh.add(role)
        self._adopted = adopted
        self._fe_hints = adopted["fe"]
        held = list(adopted["be"].items())
        hints = {v & IDENT: k for k, v in held}
        if len(hints) != len(held):  # one backend under two ids: the lowest is re-adopted
            hints = {}
            for bid, value in sorted(held):
                hints.setdefault(value & IDENT, bid)
        self.backends.hints = hints
        self._slot_hints = cast(Pending, adopted["slot"])
        return sum(len(kernel) for kernel in adopted.values())

    def _adopt_done(self, adopted: Mapping[str, Entries]) -> None:
        """After the first `update` of a start: `pending` becomes where the maps (`adopted`, what
        they held) differ from the plan, as `reconcile` finds it on a resync. A map that held
        nothing stays `fresh`."""
        self._adopted = None
        for role, kernel in adopted.items():
            if kernel:
                self._differ(role, kernel)

    def _differ(self, role: str, kernel: Entries) -> int:
        """`pending[role]` set to where `kernel` (what the map holds) differs from the plan; how many."""
        self.fresh.discard(role)
        d = self.desired[role]
        if kernel == d:  # one comparison in C: a restart or resync over an unchanged state
            self.pending[role] = {}
            return 0
        p: Pending = {k: v for k, v in kernel.items() if d.get(k) != v}
        p.update(dict.fromkeys(d.keys() - kernel.keys()))
        self.pending[role] = p
        return len(p)

    def _held(self) -> tuple[set[int], set[int], set[int], set[int]]:
        """The ids the maps hold where they differ from the plan: service port, set, backend and
        reverse-NAT ids (everywhere else they hold the plan's own)."""
        p = self.pending
        w_fe = [w for w in p["fe"].values() if w is not None]
        svc = {fe_svc(w) for w in w_fe} | {k & U32 for k, w in p["member"].items() if w is not None}
        sets = {fe_set(w) for w in w_fe} | {k & U32 for k, w in p["slot"].items() if w is not None}
        bids = (
            {k for k, w in p["be"].items() if w is not None}
            | {w for w in p["slot"].values() if w is not None}
            | {k >> MEMBER_BACKEND for k, w in p["member"].items() if w is not None}
        )
        rnat = (
            {k for k, w in p["rnat"].items() if w is not None}
            | {fe_rnat(w) for w in w_fe}
            | {srcr_rnat(k) for k, w in p["srcr"].items() if w is not None}
        )
        return svc, sets, bids, rnat

    def _hold_kernel_ids(self) -> None:
        """Ids the kernel holds that the plan does not own stay taken until the kernel lets go of
        them (or a re-adoption claims them)."""
        self._hold(self._held())

    def _hold(self, held: tuple[set[int], set[int], set[int], set[int]]) -> None:
        svc, sets, bids, rnat = held
        for pool, ids in (
            (self.svc_ids, svc),
            (self.set_ids, sets),
            (self.backends.pool, bids),
            (self.rnat_ids, rnat),
        ):
            pool.hold_all(ids)

    def forget_hints(self) -> None:
        self._fe_hints = {}
        self.backends.hints = {}
        self._slot_hints = {}

    # ------------------------------------------------------------------ flushing

    def flush(self, maps: Mapping[str, RawMap]) -> FlushResult:
        """Write what differs between desired and written, in the safe order (agent.ebpf.writer)."""
        self._be_owners = None
        for role in ROLES:
            if not self._settled(role):
                self._flushes[role] += 1  # the map may change here: no resync skips it unread
        result = flush(self.desired, self.pending, maps, self._owners, self.fresh)
        if self.in_sync:
            self._replanned = set()
        svc, sets, bids, rnat = self._held()
        self.svc_ids.settle(svc.__contains__)
        self.set_ids.settle(sets.__contains__)
        self.backends.pool.settle(bids.__contains__)
        self.rnat_ids.settle(rnat.__contains__)
        return result

    def _owners(self, role: str, key: int) -> set[ServicePortName]:
        """The service ports an entry belongs to (the writer attributes a full map to them)."""
        owner: ServicePortName | None
        if role == "fe":
            owner = self._fe_owner.get(key)
        elif role == "slot":
            owner = self._set_owner.get(key & U32)
        elif role == "member":
            owner = self._svc_owner.get(key & U32)
        elif role == "be":
            if self._be_owners is None:  # built once per flush, and only on the failure path
                self._be_owners = {}
                for spn in self._replanned:
                    for bid in _backends_of(self._frags.get(spn, _GONE).backends):
                        self._be_owners.setdefault(bid, set()).add(spn)
            return set(self._be_owners.get(key, ()))
        elif role == "addr":
            return set()  # shared by every frontend and backend on the address
        else:
            ident = self._rnat_by_id.get(key if role == "rnat" else srcr_rnat(key))
            rec = self._rnats.get(ident) if ident is not None else None
            return set(rec[1]) if rec is not None else set()
        return {owner} if owner is not None else set()

    # ------------------------------------------------------------------ views

    def fe_names(self) -> dict[int, str]:
        return {key: str(spn) for key, spn in self._fe_owner.items()}


def _digest(keys: bytes, values: bytes) -> bytes:
    """A map's raw read-back, hashed: the kernel dumps an unchanged hash map in the same order, so
    equal digests mean the same entries (a map rewritten with the same entries in another order
    only costs the decode)."""
    h = hashlib.sha256(len(keys).to_bytes(8, "little"))
    h.update(keys)
    h.update(values)
    return h.digest()


def _kernel_ids(
    adopted: Mapping[str, Entries], dump: Mapping[str, tuple[bytes, bytes]]
) -> tuple[set[int], set[int], set[int], set[int]]:
    """`Planner._held` of a start's read-back (every entry held, none None): the same service
    port, set, backend and reverse-NAT ids, the 100,000-entry sets taken in C (a whole key or
    value, or the low half of an 8-byte key read from the dump's bytes) instead of one Python
    step per entry, about 25 ms of a restart's 34 at 10,000 Services."""
    fe = adopted["fe"].values()
    svc = {w & U32 for w in fe}
    svc.update(_low_halves(dump.get("member", (b"", b""))[0]))  # svc_id | backend_id << 32
    sets = {w >> FE_SET & U32 for w in fe}
    sets.update(_low_halves(dump.get("slot", (b"", b""))[0]))  # set_id | slot << 32
    bids = set(adopted["be"])
    bids.update(adopted["slot"].values())
    # A stray membership's backend id too: a new backend given it would be taken for a member of
    # that service port until the stray entry is deleted, after the writes.
    bids.update(_low_halves(dump.get("member", (b"", b""))[0], high=True))
    rnat = set(adopted["rnat"])
    rnat.update({w >> FE_RNAT & U16 for w in fe})
    rnat.update({srcr_rnat(k) for k in adopted["srcr"]})
    return svc, sets, bids, rnat


_LOW = 0 if sys.byteorder == "little" else 1  # where an 8-byte key's low 32 bits are, as two u32
assert key_size("member") == key_size("slot") == 8 and MEMBER_BACKEND == SLOT_POS == 32


def _low_halves(keys: bytes, high: bool = False) -> array[int]:
    """The low (or high) 32 bits of each 8-byte key in `keys` (a dump's, native order)."""
    return array(_U32_CODE, keys)[_LOW ^ high :: 2]


def _sets_of(frag: Fragment) -> dict[SetKind, tuple[int, int]]:
    """A fragment's sets: kind -> (set id, count)."""
    return {kind: (set_id, count) for kind, set_id, count in frag.sets}


def _rnats_of(frag: Fragment) -> dict[int, int]:
    """A fragment's reverse-NAT ids: ident -> id."""
    flat = frag.rnats
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _backends_of(packed: bytes) -> dict[int, int]:
    """A fragment's backends: id -> the flags the port gives it."""
    return {v >> _BE_ID: v & _BE_FLAGS for v in array("Q", packed)}


def _idents(chosen: Sequence[Endpoint], proto: int, ip: Callable[[str], int] | None) -> list[int]:
    """The backend idents of a set's endpoints (agent.ebpf.entries.ident: the address as the
    entries hold it, IPv4's own or the IPv6 planner's handle, the port in network order, the
    protocol), in C where it can be: the addresses packed as one array, one port for them all."""
    if ip is None:
        packed = array(_U32_CODE, b"".join(map(inet_aton, map(_IP, chosen))))
        if _BIG_ENDIAN:
            packed.byteswap()  # the entries hold an address as its bytes read little-endian
        addrs: Iterable[int] = packed
    else:
        addrs = map(ip, map(_IP, chosen))
    ports = set(map(_PORT, chosen))
    if len(ports) == 1:
        (port,) = ports
        return list(map((((port & 0xFF) << 8 | port >> 8) << 32 | proto).__or__, addrs))
    return [
        a | ((p & 0xFF) << 8 | p >> 8) << 32 | proto for a, p in zip(addrs, map(_PORT, chosen), strict=True)
    ]


def _slot_keys(set_id: int, count: int) -> range:
    """The keys of slots 1..count of a set (slot_key), in order."""
    return range(set_id | 1 << SLOT_POS, set_id | (count + 1) << SLOT_POS, 1 << SLOT_POS)


def _put_all(desired: Entries, pending: Pending, entries: list[tuple[int, int]], fresh: bool) -> int:
    """`Planner._put` of many entries of one map (the hot loop of a first sync); returns how many
    changed."""
    changed = 0
    for key, value in entries:
        old = desired.get(key)
        if old != value:
            if key in pending:
                if pending[key] == value:
                    del pending[key]
            elif not fresh:
                pending[key] = old
            desired[key] = value
            changed += 1
    return changed
