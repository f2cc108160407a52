"""The eBPF planner: desired map entries kept between syncs, one fragment per service port.

Pure (no bcc, no pyroute2): the proxier owns one `Planner` for the agent's life and calls

    planner.update(state, node, changed)   # re-plan the changed service ports (None: all)
    planner.flush(maps)                    # write what differs, in a safe order; per-port failures
    planner.reconcile(dump)                # what the kernel really holds (start, periodic resync)

What the entries say is the data path's contract (bpf/ekp_abi.h, bpf/README.md):

* Every service port has up to two backend *sets*, "cluster" (ServiceEndpoints.cluster) and "local"
  (ServiceEndpoints.local): a run of slots `{set_id, 1..count} -> backend_id`.
* Every service port has a `svc_id`, carried by all its frontends: the data path keys affinity by
  (client, svc_id), so affinity spans every frontend of the port as kube-proxy's does, and checks
  membership `{svc_id, backend_id} -> CLUSTER|LOCAL` (one `member` entry per backend of the
  port's sets) before it honours an affinity entry or moves a UDP flow.
* Frontends follow kube-proxy's chains. ClusterIP, both scopes: ITP Local ? local set (LOCAL) :
  cluster set. NodePort (each node address), externalIPs, LB IPs: EXTERNAL scope: ETP Local ?
  local set (LOCAL) : cluster set + SNAT_ALL (kube-proxy's KUBE-MARK-MASQ; SNAT_REMOTE, toward
  remote backends only, with --bpf-keep-client-ip-for-local-backends); INTERNAL scope (pods): the
  cluster set, with the EXTERNAL scope's SNAT under ETP Cluster (kube-proxy sends pods' traffic to
  these addresses through the same masquerading KUBE-EXT-* chain), untranslated under ETP Local.
  With localhost NodePorts (Config.localhost_nodeports), each NodePort also on 127.0.0.1, INTERNAL
  scope only: the node's own processes reach it through the socket programs.
  masquerade-all (both scopes) and cluster-cidr (EXTERNAL scope) add SNAT_ALL to the ClusterIP.
  An empty set: NO_ENDPOINTS (reject) when nothing could serve or the cluster view is empty; an
  empty local set while others could serve keeps LOCAL alone (drop). loadBalancerSourceRanges:
  SOURCE_RANGES on the LB frontends of both scopes and one `srcr` entry per CIDR (plus the LB IP
  itself when a range holds a node address, as kube-proxy).

State kept between syncs, all plain ints and tuples (`agent.ebpf.codec` packs them at write time):

* `desired[role]`: every entry the maps should hold, maintained fragment by fragment, so a change
  of one EndpointSlice re-plans one service port and touches a handful of entries;
* `written[role]`: what the maps hold as far as the planner knows (read back at start and at each
  periodic resync, then updated by every successful write), with reverse indexes (which frontends
  point at a set, which slots at a backend, ...) that decide when a deletion is safe;
* `dirty[role]`: the keys where the two may differ; a flush looks at nothing else.
* Ids: a service port keeps its svc_id for its life; a set keeps its id while its service port
  keeps that kind of set; a backend keeps its id
  while any service port uses its (ip, port, protocol), refcounted; a reverse-NAT id belongs to a
  frontend (addr, port, protocol). Fresh ids count up from where the last one was handed out and
  wrap only at the field's limit, so conntrack and affinity entries of a service just removed do
  not meet a new one under the same id; an id returns to the pool only once the kernel holds no
  entry under it. On start, `reconcile` re-adopts the ids the pinned maps hold (a frontend's
  service port, set and reverse-NAT ids, a backend's id), so a restart rewrites nothing that is still right.
* `addr` (ekp_addr) is derived from the desired frontends and backends after each update: one
  entry per address, with a bit per scope it has frontends in and BACKEND when a backend is on
  it. The data path reads it only for a fragment that came before its first (bpf/ekp_frag.h).

Flush order (nothing a packet can reach ever points at something missing, and room is made before
it is needed, so a desired state that fits the maps is always reached):

1. deletions that are safe now: frontends that are no longer wanted, source ranges, slots no
   written frontend can reach, membership no written slot of the port backs, backends no written
   slot points at, reverse-NAT entries no written frontend uses;
2. writes, in the order addresses, backends, membership, reverse NAT, source ranges, slots,
   frontends (a set
   that grows gets its slots before its count grows, a backend its membership before a slot
   points at it; a frontend moving to another set finds it complete).
   One batch per map; when a batch fails (a full map), the rest is written entry by entry and the
   service ports whose entries failed are left out of the later maps and reported;
3. deletions made safe by step 2 (slots beyond a shrunk count, membership of backends that left,
   backends and reverse NAT left unreferenced, addresses no frontend or backend has any more),
   then once more the writes that failed, now that room may have been made.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import starmap
from socket import inet_aton
from typing import Any, Literal, NamedTuple, Protocol

from agent.config import Config, NodeContext
from agent.ebpf import abi
from agent.ebpf.abi import AddrFlag, BackendFlag, FrontendFlag, MemberFlag, Scope
from agent.ebpf.codec import KEYS, VALUES, Key, Value
from agent.model.types import Endpoint, ProxyState, ServiceEndpoints, ServicePort, ServicePortName
from agent.model.types import Protocol as L4

SetKind = Literal["cluster", "local"]
KINDS: tuple[SetKind, ...] = ("cluster", "local")

# The service maps, in the order they are rendered, and the order writes go in. `addr` is derived
# from the others (the addresses of the frontends and backends): written first, deleted last, so
# it always names at least every address the other maps use.
ROLES = ("fe", "slot", "be", "rnat", "member", "srcr", "addr")
WRITE_ORDER = ("addr", "be", "member", "rnat", "srcr", "slot", "fe")
DELETE_ORDER = ("fe", "srcr", "slot", "member", "be", "rnat", "addr")
_ADDR_BACKEND = int(AddrFlag.BACKEND)

# Conntrack timeouts of the config entry that kube-proxy's settings do not cover, or cover with 0
# ("leave the kernel's value"): the kernel's defaults (nf_conntrack_udp_timeout 30 s,
# nf_conntrack_udp_timeout_stream 120 s) and Cilium's for the TCP states kube-proxy leaves alone
# (CT_SYN_TIMEOUT 60 s for a handshake not completed, CT_CLOSE_TIMEOUT 10 s after a RST or FINs
# both ways). kube-proxy's own defaults for the rest: established 24 h, close-wait 1 h.
TCP_ESTABLISHED_TIMEOUT_S = 86400
TCP_CLOSE_WAIT_TIMEOUT_S = 3600
TCP_SYN_TIMEOUT_S = 60
TCP_CLOSED_TIMEOUT_S = 10
UDP_TIMEOUT_S = 30
UDP_STREAM_TIMEOUT_S = 120
# ICMP rejects per second and burst, per CPU: the kernel's net.ipv4.icmp_msgs_per_sec and
# icmp_msgs_burst defaults (its global limit on the ICMP errors a node sends).
ICMP_RATE = 1000
ICMP_BURST = 50

# Largest id each field can carry (ekp_frontend.rev_nat_id is a __u16).
SVC_ID_MAX = 0xFFFFFFFF
SET_ID_MAX = 0xFFFFFFFF
BACKEND_ID_MAX = 0xFFFFFFFF
REVNAT_ID_MAX = 0xFFFF

_BE_LOCAL = int(BackendFlag.LOCAL)
_BE_TERMINATING = int(BackendFlag.TERMINATING)
_MEMBER_FLAG: dict[SetKind, int] = {"cluster": int(MemberFlag.CLUSTER), "local": int(MemberFlag.LOCAL)}

LOCALHOST = "127.0.0.1"  # localhost NodePorts (Config.localhost_nodeports)

BeIdent = tuple[int, int, int]  # (addr be, port be, proto) as ekp_be holds them
RnatIdent = tuple[int, int, int]  # (addr be, port be, proto) of a frontend


class PlanError(RuntimeError):
    """The desired state cannot be expressed in the maps (ids exhausted)."""


def ip_be(ip: str) -> int:
    """Dotted quad to the int whose little-endian bytes are the address in network order (fast
    path of abi.ip_be for the model's canonical addresses)."""
    return int.from_bytes(inet_aton(ip), "little")


def port_be(port: int) -> int:
    return ((port & 0xFF) << 8) | (port >> 8)


# ---------------------------------------------------------------------------------- ids


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

    def reserve(self, ident: int) -> None:
        self._used.add(ident)
        self._next = max(self._next, ident + 1)

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

    def settle(self, still_held: Callable[[int], bool]) -> None:
        """Released ids the kernel no longer holds become free."""
        for ident in list(self._released):
            if not still_held(ident):
                self._released.discard(ident)
                self._used.discard(ident)


# ---------------------------------------------------------------------------------- fragments


class _Fe(NamedTuple):
    """A frontend before ids are known."""

    key: Key  # (addr, port, proto, scope)
    kind: SetKind
    flags: int
    affinity: int
    rnat: RnatIdent


@dataclass
class Fragment:
    """Everything one service port contributes to the maps."""

    spn: ServicePortName
    svc_id: int = 0
    fe: dict[Key, Value] = field(default_factory=dict)
    slot: dict[Key, Value] = field(default_factory=dict)
    member: dict[Key, Value] = field(default_factory=dict)  # (svc_id, backend id) -> (flags,)
    srcr: dict[Key, Value] = field(default_factory=dict)
    sets: dict[SetKind, int] = field(default_factory=dict)
    backends: dict[BeIdent, int] = field(default_factory=dict)  # ident -> flags this port gives it
    rnats: dict[RnatIdent, int] = field(default_factory=dict)  # frontend -> reverse-NAT id
    blocked: set[Key] = field(default_factory=set)  # frontends a port before this one holds
    taken_from: set[ServicePortName] = field(default_factory=set)  # ports after it that held one


@dataclass
class _RevNat:
    id: int
    users: set[ServicePortName]


def frontends(sp: ServicePort, node: NodeContext, config: Config) -> list[_Fe]:
    """The frontends of one service port, both scopes, before ids are known."""
    proto = sp.protocol.number
    affinity = sp.affinity_timeout
    base = int(FrontendFlag.AFFINITY) if affinity else 0
    out: list[_Fe] = []

    # ClusterIP: the internal traffic policy, whatever the scope.
    kind: SetKind = "local" if sp.internal_policy_local else "cluster"
    local = int(FrontendFlag.LOCAL) if kind == "local" else 0
    # kube-proxy's KUBE-MARK-MASQ for the cluster IP masquerades whatever the backend.
    snat_int = int(FrontendFlag.SNAT_ALL) if config.masquerade_all else 0
    snat_ext = int(FrontendFlag.SNAT_ALL) if config.masquerade_all or config.cluster_cidr else 0
    vip, port = ip_be(sp.cluster_ip), port_be(sp.port)
    for scope, snat in ((Scope.EXTERNAL, snat_ext), (Scope.INTERNAL, snat_int)):
        out.append(
            _Fe((vip, port, proto, int(scope)), kind, base | local | snat, affinity, (vip, port, proto))
        )

    # External frontends: ETP for traffic from outside, the cluster set for pods.
    externals: list[tuple[str, int, int]] = []
    if sp.node_port:
        externals += [
            (ip, sp.node_port, FrontendFlag.NODEPORT) for ip in node.nodeport_ips(config.nodeport_addresses)
        ]
    externals += [(ip, sp.port, FrontendFlag.EXTERNAL_IP) for ip in sp.external_ips]
    ranges = int(FrontendFlag.SOURCE_RANGES) if sp.load_balancer_source_ranges else 0
    snat_all, snat_keep_local = int(FrontendFlag.SNAT_ALL), int(FrontendFlag.SNAT_REMOTE)
    externals += [(ip, sp.port, FrontendFlag.LOADBALANCER | ranges) for ip in sp.load_balancer_ips]
    for addr_text, fe_port, what in externals:
        addr, p = ip_be(addr_text), port_be(fe_port)
        rnat = (addr, p, proto)
        if sp.external_policy_local:
            ext_kind: SetKind = "local"
            ext_flags = base | what | FrontendFlag.LOCAL
            # Pods reach every endpoint, untranslated (KUBE-EXT-*: -s clusterCIDR -> KUBE-SVC-*).
            pod_flags = base | what
        else:
            # ETP Cluster: kube-proxy masquerades all of it (KUBE-EXT-* -> KUBE-MARK-MASQ), traffic
            # from pods included (KUBE-SERVICES sends it to the same KUBE-EXT-* chain); keeping
            # the client's address toward local backends is an explicit choice.
            ext_kind = "cluster"
            ext_flags = base | what | (snat_keep_local if config.bpf_keep_client_ip_local else snat_all)
            pod_flags = ext_flags
        out.append(_Fe((addr, p, proto, int(Scope.EXTERNAL)), ext_kind, ext_flags, affinity, rnat))
        out.append(_Fe((addr, p, proto, int(Scope.INTERNAL)), "cluster", pod_flags, affinity, rnat))
    if sp.node_port and config.localhost_nodeports:
        # localhost:<nodePort> for the node's own processes (the socket programs; a pod's localhost
        # is its own): INTERNAL scope only, so nothing arriving from outside is ever translated for
        # 127.0.0.1 (CVE-2020-8558). kube-proxy sends it through KUBE-EXT-*: the cluster set.
        flags = base | FrontendFlag.NODEPORT
        if not sp.external_policy_local:
            flags |= snat_keep_local if config.bpf_keep_client_ip_local else snat_all
        addr, p = ip_be(LOCALHOST), port_be(sp.node_port)
        out.append(_Fe((addr, p, proto, int(Scope.INTERNAL)), "cluster", flags, affinity, (addr, p, proto)))
    return out


def source_ranges(sp: ServicePort, node: NodeContext) -> list[tuple[int, int]]:
    """(prefix length, network address be) the LB frontends of `sp` admit."""
    out: list[tuple[int, int]] = []
    node_in_range = False
    for text in sp.load_balancer_source_ranges:
        net = ipaddress.ip_network(text, strict=False)
        if not isinstance(net, ipaddress.IPv4Network):
            continue
        out.append((net.prefixlen, ip_be(str(net.network_address))))
        node_in_range = node_in_range or any(ipaddress.ip_address(ip) in net for ip in node.node_ips)
    if node_in_range:
        # kube-proxy: a VIP-like LB IP bound on the node loops back with itself as the source.
        out += [(32, ip_be(ip)) for ip in sp.load_balancer_ips]
    return out


def layout(members: Sequence[int], previous: Mapping[int, int]) -> dict[int, int]:
    """Slot -> backend for one set: survivors keep their slot when it is within the new count."""
    count = len(members)
    wanted = set(members)
    slots: dict[int, int] = {}
    placed: set[int] = set()
    for pos, bid in sorted(previous.items()):
        if 1 <= pos <= count and bid in wanted and bid not in placed:
            slots[pos] = bid
            placed.add(bid)
    free = (pos for pos in range(1, count + 1) if pos not in slots)
    for bid in members:
        if bid not in placed:
            slots[next(free)] = bid
    return slots


def config_entry(node: NodeContext, config: Config) -> Value:
    """The config entry (codec tuple of abi.Config): the node's SNAT source, the SNAT port range,
    the conntrack timeouts (kube-proxy's conntrack settings where they say something, as iptables
    mode applies them to nf_conntrack) and the reject rate limit."""
    lo, hi = config.snat_ports
    ct = config.conntrack
    return (
        ip_be(node.primary_ip) if node.primary_ip else 0,
        lo,
        hi,
        _seconds(ct.tcp_established_timeout_s, TCP_ESTABLISHED_TIMEOUT_S),
        _seconds(ct.tcp_close_wait_timeout_s, TCP_CLOSE_WAIT_TIMEOUT_S),
        TCP_SYN_TIMEOUT_S,
        TCP_CLOSED_TIMEOUT_S,
        _seconds(ct.udp_timeout_s, UDP_TIMEOUT_S),
        _seconds(ct.udp_stream_timeout_s, UDP_STREAM_TIMEOUT_S),
        ICMP_RATE,
        ICMP_BURST,
        0,
    )


def _seconds(value: float, default: int) -> int:
    """A kube-proxy timeout in whole seconds; 0 ("leave it") becomes the default."""
    return max(1, round(value)) if value > 0 else default


def _endpoints(eps: ServiceEndpoints, kind: SetKind) -> tuple[Endpoint, ...]:
    return eps.cluster if kind == "cluster" else eps.local


# ---------------------------------------------------------------------------------- writing


class RawMap(Protocol):
    """What a flush needs of a map: raw batch writes (agent.ebpf.maps.BpfMap, FakeMap)."""

    def update_raw(self, keys: Sequence[bytes], values: Sequence[bytes]) -> int:
        """Write entries in order; returns how many were written before the first failure
        (all of them on success) and raises only for errors other than "no room"."""

    def delete_raw(self, keys: Sequence[bytes]) -> None:
        """Delete every key (missing keys are fine)."""


@dataclass
class FlushResult:
    failed: dict[ServicePortName, str] = field(default_factory=dict)
    updates: dict[str, int] = field(default_factory=dict)  # role -> entries written
    deletes: dict[str, int] = field(default_factory=dict)  # role -> entries deleted

    def summary(self) -> str:
        parts = [f"update {r} x{n}" for r, n in self.updates.items() if n]
        parts += [f"delete {r} x{n}" for r, n in self.deletes.items() if n]
        return ", ".join(parts) or "no changes"

    @property
    def writes(self) -> int:
        return sum(self.updates.values()) + sum(self.deletes.values())


# ---------------------------------------------------------------------------------- planner


_EMPTY = Fragment(ServicePortName("", "", "", L4.TCP))
_ORPHAN = ServicePortName("", "", "", L4.TCP)  # owner of an entry no service port claims


class Planner:
    """Desired and written entries of the service maps, kept between syncs (see module doc)."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self.desired: dict[str, dict[Key, Value]] = {r: {} for r in ROLES}
        self.written: dict[str, dict[Key, Value]] = {r: {} for r in ROLES}
        self.dirty: dict[str, set[Key]] = {r: set() for r in ROLES}
        self._frags: dict[ServicePortName, Fragment] = {}
        self._fe_owner: dict[Key, ServicePortName] = {}
        self._fe_waiting: dict[Key, set[ServicePortName]] = {}  # frontend -> ports it is blocked for
        self._waits: dict[ServicePortName, set[Key]] = {}
        self._srcr_users: dict[Key, set[ServicePortName]] = {}
        self._set_owner: dict[int, ServicePortName] = {}
        self._svc_owner: dict[int, ServicePortName] = {}
        self._be_ids: dict[BeIdent, int] = {}
        # Per backend: [ports using it, of which say it is local, of which say it is terminating].
        self._be_refs: dict[BeIdent, list[int]] = {}
        self._be_by_id: dict[int, BeIdent] = {}
        self._replanned: set[ServicePortName] = set()  # since the last flush (failure attribution)
        self._rnats: dict[RnatIdent, _RevNat] = {}
        self._rnat_by_id: dict[int, RnatIdent] = {}
        self.svc_ids = IdPool(SVC_ID_MAX, "service port")
        self.set_ids = IdPool(SET_ID_MAX, "backend set")
        self.backend_ids = IdPool(BACKEND_ID_MAX, "backend")
        self.rnat_ids = IdPool(REVNAT_ID_MAX, "reverse-NAT")
        # Re-adoption hints from the kernel's contents (start only): frontend -> (set id, local
        # flag, rev-NAT id, service port id); backend ident -> id.
        self._fe_hints: dict[Key, tuple[int, bool, int, int]] = {}
        self._be_hints: dict[BeIdent, int] = {}
        # Indexes over `written`, deciding when a deletion is safe.
        self._w_set_fes: dict[int, dict[Key, int]] = {}  # set id -> {frontend key: count}
        self._w_set_slots: dict[int, int] = {}  # set id -> slots written
        self._w_be_slots: dict[int, int] = {}  # backend id -> slots pointing at it
        self._w_rnat_fes: dict[int, int] = {}  # rev-NAT id -> frontends using it
        self._w_rnat_srcr: dict[int, int] = {}  # rev-NAT id -> source range entries under it
        self._w_svc_sets: dict[int, dict[int, int]] = {}  # svc id -> {set id: frontends}
        self._w_set_be: dict[tuple[int, int], int] = {}  # (set id, backend id) -> slots
        self._w_svc_members: dict[int, int] = {}  # svc id -> member entries
        self.node = NodeContext()
        self.cfg: Value | None = None
        self._failed_now: set[ServicePortName] = set()
        self._be_owners: dict[BeIdent, set[ServicePortName]] | None = None
        # The `addr` role, derived: what each desired frontend or backend entry contributes
        # ((role, key) -> (address, flag)) and how many contribute each (address, flag).
        self._addr_of: dict[tuple[str, Key], tuple[int, int]] = {}
        self._addr_refs: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------------ planning

    def update(
        self, state: ProxyState, node: NodeContext, changed: Iterable[ServicePortName] | None
    ) -> set[ServicePortName]:
        """Re-plan the service ports in `changed` (every port when None, or when the node's
        addresses changed); returns the ports whose entries changed."""
        if changed is None or node != self.node:
            wanted = set(state.services) | set(self._frags)
        else:
            wanted = set(changed)
        self.node = node
        self.cfg = config_entry(node, self._config)
        touched: set[ServicePortName] = set()
        # Removals first (they free frontends and ids), then in kube-proxy's order, so the ids of
        # a fresh start follow the sorted ports as `--dry-run` and the golden files show them.
        # A frontend two ports want (possible only for a node address: the model resolves every
        # other conflict) goes to the first in that order, whatever the history: a port that
        # takes one from another, or releases one others waited for, has them planned again.
        gone = [spn for spn in wanted if spn not in state.services]
        queue = gone + sorted((spn for spn in wanted if spn in state.services), key=_order)
        while queue:
            woken: set[ServicePortName] = set()
            for spn in queue:
                sp = state.services.get(spn)
                eps = state.endpoints.get(spn, ServiceEndpoints()) if sp is not None else None
                if self._replan(spn, sp, eps, woken):
                    touched.add(spn)
            queue = sorted((spn for spn in woken if spn in state.services), key=_order)
        self._derive_addresses()
        return touched

    def _derive_addresses(self) -> None:
        """Bring desired `addr` in line with desired `fe` and `be`: an address carries the bit of
        each scope a frontend on it has (1 << scope) and BACKEND when a backend is on it. Only the
        dirty frontend and backend keys are looked at (every change of theirs marks one), and
        each key's contribution is remembered, so this costs what the change costs."""
        touched: set[int] = set()
        refs = self._addr_refs
        for role in ("fe", "be"):
            desired = self.desired[role]
            for key in self.dirty[role]:
                value = desired.get(key)
                new = None if value is None else _address_of(role, key, value)
                old = self._addr_of.get((role, key))
                if new == old:
                    continue
                if old is not None:
                    _bump(refs, old, -1)
                    touched.add(old[0])
                    del self._addr_of[(role, key)]
                if new is not None:
                    _bump(refs, new, +1)
                    touched.add(new[0])
                    self._addr_of[(role, key)] = new
        desired, dirty = self.desired["addr"], self.dirty["addr"]
        for addr in touched:
            flags = sum(flag for flag in _ADDR_FLAGS if (addr, flag) in refs)
            key = (addr,)
            if flags and desired.get(key) != (flags,):
                desired[key] = (flags,)
                dirty.add(key)
            elif not flags and key in desired:
                del desired[key]
                dirty.add(key)

    def _replan(
        self,
        spn: ServicePortName,
        sp: ServicePort | None,
        eps: ServiceEndpoints | None,
        woken: set[ServicePortName],
    ) -> bool:
        old = self._frags.get(spn) or Fragment(spn)
        new = Fragment(spn) if sp is None or eps is None else self._build(old, sp, eps)
        self._replanned.add(spn)
        if sp is None:
            self._frags.pop(spn, None)
        else:
            self._frags[spn] = new
        for key in self._waits.pop(spn, set()):
            waiting = self._fe_waiting[key]
            waiting.discard(spn)
            if not waiting:
                del self._fe_waiting[key]
        if new.blocked:
            self._waits[spn] = set(new.blocked)
            for key in new.blocked:
                self._fe_waiting.setdefault(key, set()).add(spn)
        woken.update(new.taken_from)
        changed = old.fe != new.fe
        desired, dirty = self.desired["fe"], self.dirty["fe"]
        for key in old.fe.keys() - new.fe.keys():
            if self._fe_owner.get(key) != spn:
                continue  # a port ordered before this one took it: its entry is in place
            del self._fe_owner[key]
            desired.pop(key, None)
            dirty.add(key)
            woken.update(self._fe_waiting.get(key, ()))
        for key, value in new.fe.items():
            self._fe_owner[key] = spn
            if desired.get(key) != value:
                desired[key] = value
                dirty.add(key)
        for role in ("slot", "member"):  # keyed by the port's own set and service ids: not shared
            before, after = getattr(old, role), getattr(new, role)
            if before == after:
                continue
            changed = True
            desired, dirty = self.desired[role], self.dirty[role]
            for key in before.keys() - after.keys():
                desired.pop(key, None)
                dirty.add(key)
            for key, value in after.items():
                if before.get(key) != value:
                    desired[key] = value
                    dirty.add(key)
        if old.srcr != new.srcr:
            # Keyed by reverse-NAT id, which two ports share while one takes a frontend from the
            # other: an entry goes only when its last user lets go.
            changed = True
            desired, dirty = self.desired["srcr"], self.dirty["srcr"]
            for key in old.srcr.keys() - new.srcr.keys():
                users = self._srcr_users[key]
                users.discard(spn)
                if not users:
                    del self._srcr_users[key]
                    desired.pop(key, None)
                    dirty.add(key)
            for key, value in new.srcr.items():
                self._srcr_users.setdefault(key, set()).add(spn)
                if desired.get(key) != value:
                    desired[key] = value
                    dirty.add(key)
        for kind, set_id in old.sets.items():
            if new.sets.get(kind) != set_id:
                self._set_owner.pop(set_id, None)
                self.set_ids.release(set_id)
        for set_id in new.sets.values():
            self._set_owner[set_id] = spn
        if old.svc_id and old.svc_id != new.svc_id:
            self._svc_owner.pop(old.svc_id, None)
            self.svc_ids.release(old.svc_id)
        if new.svc_id:
            self._svc_owner[new.svc_id] = spn
        changed |= self._update_backends(spn, old.backends, new.backends)
        changed |= self._update_rnats(spn, old.rnats, new.rnats)
        return changed

    def _build(self, old: Fragment, sp: ServicePort, eps: ServiceEndpoints) -> Fragment:
        spn = sp.name
        new = Fragment(spn)
        fes = []
        for fe in frontends(sp, self.node, self._config):
            owner = self._fe_owner.get(fe.key, spn)
            if owner == spn or _order(spn) < _order(owner):
                fes.append(fe)
                if owner != spn:
                    new.taken_from.add(owner)
            else:
                new.blocked.add(fe.key)
        # One id for every frontend of the port: the data path keys affinity and membership by it.
        new.svc_id = old.svc_id or self.svc_ids.take(self._svc_hint(fes))
        svc_id = new.svc_id
        kinds = [k for k in KINDS if any(fe.kind == k for fe in fes)]
        for kind in kinds:
            new.sets[kind] = old.sets.get(kind) or self.set_ids.take(self._set_hint(fes, kind))
        proto = sp.protocol.number
        counts: dict[SetKind, int] = {}
        backends = new.backends
        backend_id = self._backend_id
        be_ids = self._be_ids
        from_bytes = int.from_bytes
        for kind in kinds:
            members: list[int] = []
            for ep in eps.cluster if kind == "cluster" else eps.local:
                p = ep.port
                ident = (from_bytes(inet_aton(ep.ip), "little"), ((p & 0xFF) << 8) | (p >> 8), proto)
                flags = (_BE_LOCAL if ep.is_local else 0) | (_BE_TERMINATING if ep.terminating else 0)
                backends[ident] = backends.get(ident, 0) | flags
                bid = be_ids.get(ident)
                members.append(backend_id(ident) if bid is None else bid)
            if len(set(members)) != len(members):
                members = list(dict.fromkeys(members))
            set_id = new.sets[kind]
            previous = {k[1]: v[0] for k, v in old.slot.items() if k[0] == set_id}
            for pos, bid in layout(members, previous).items():
                new.slot[(set_id, pos)] = (bid,)
            counts[kind] = len(members)
            bit = _MEMBER_FLAG[kind]
            member = new.member
            for bid in members:
                held = member.get((svc_id, bid))
                member[(svc_id, bid)] = (held[0] | bit,) if held is not None else (bit,)
        for fe in fes:
            if fe.rnat not in new.rnats:
                new.rnats[fe.rnat] = old.rnats.get(fe.rnat) or self._rnat_id(fe.rnat, fe.key)
        ranges = source_ranges(sp, self.node) if sp.load_balancer_source_ranges else []
        for fe in fes:
            flags = fe.flags
            if counts[fe.kind] == 0 and (fe.kind == "cluster" or not eps.has_any):
                flags |= FrontendFlag.NO_ENDPOINTS
            rid = new.rnats[fe.rnat]
            new.fe[fe.key] = (svc_id, new.sets[fe.kind], counts[fe.kind], flags, fe.affinity, rid)
            if fe.flags & FrontendFlag.SOURCE_RANGES:
                for plen, net in ranges:
                    new.srcr[(32 + plen, rid, net)] = (1,)
        return new

    def _set_hint(self, fes: Sequence[_Fe], kind: SetKind) -> int:
        for fe in fes:
            hint = self._fe_hints.get(fe.key)
            if hint is not None and fe.kind == kind and hint[1] == (kind == "local"):
                return hint[0]
        return 0

    def _svc_hint(self, fes: Sequence[_Fe]) -> int:
        """The service port id the kernel's frontends of this port carried (start only)."""
        for fe in sorted(fes, key=lambda f: f.key):
            hint = self._fe_hints.get(fe.key)
            if hint is not None and hint[3]:
                return hint[3]
        return 0

    def _backend_id(self, ident: BeIdent) -> int:
        bid = self._be_ids.get(ident)
        if bid is not None:
            return bid
        bid = self.backend_ids.take(self._be_hints.get(ident, 0))
        self._be_ids[ident] = bid
        self._be_refs[ident] = [0, 0, 0]
        self._be_by_id[bid] = ident
        return bid

    def _rnat_id(self, ident: RnatIdent, fe_key: Key) -> int:
        rec = self._rnats.get(ident)
        if rec is not None:
            return rec.id
        hint = self._fe_hints.get(fe_key)
        rid = hint[2] if hint is not None else 0
        if rid and self.written["rnat"].get((rid,), (ident[0], ident[1])) != (ident[0], ident[1]):
            rid = 0  # the kernel's entry under that id names another frontend
        rid = self.rnat_ids.take(rid)
        self._rnats[ident] = _RevNat(rid, set())
        self._rnat_by_id[rid] = ident
        return rid

    def _update_backends(
        self, spn: ServicePortName, old: Mapping[BeIdent, int], new: Mapping[BeIdent, int]
    ) -> bool:
        """Refcount the backends `spn` stopped or started using (or whose flags it changed) and
        desire their entries with the flags all their users give them."""
        changed = False
        desired, dirty = self.desired["be"], self.dirty["be"]
        refs_of, ids = self._be_refs, self._be_ids
        for ident, flags in new.items():
            before = old.get(ident)
            if before == flags:
                continue
            changed = True
            refs = refs_of[ident]
            if before is None:
                refs[0] += 1
            else:
                refs[1] -= before & _BE_LOCAL
                refs[2] -= (before & _BE_TERMINATING) >> 1
            refs[1] += flags & _BE_LOCAL
            refs[2] += (flags & _BE_TERMINATING) >> 1
            value = (*ident, (_BE_LOCAL if refs[1] else 0) | (_BE_TERMINATING if refs[2] else 0))
            key = (ids[ident],)
            if desired.get(key) != value:
                desired[key] = value
                dirty.add(key)
        for ident in old.keys() - new.keys():
            changed = True
            refs = refs_of[ident]
            before = old[ident]
            refs[0] -= 1
            refs[1] -= before & _BE_LOCAL
            refs[2] -= (before & _BE_TERMINATING) >> 1
            bid = ids[ident]
            key = (bid,)
            dirty.add(key)
            if refs[0]:
                desired[key] = (*ident, (_BE_LOCAL if refs[1] else 0) | (_BE_TERMINATING if refs[2] else 0))
                continue
            del ids[ident], refs_of[ident], self._be_by_id[bid]
            self.backend_ids.release(bid)
            desired.pop(key, None)
        return changed

    def _update_rnats(
        self, spn: ServicePortName, old: Mapping[RnatIdent, int], new: Mapping[RnatIdent, int]
    ) -> bool:
        changed = False
        for ident in old.keys() | new.keys():
            if (ident in old) == (ident in new):
                continue
            changed = True
            rec = self._rnats[ident]
            if ident in new:
                rec.users.add(spn)
                key, value = (rec.id,), (ident[0], ident[1])
                self.desired["rnat"][key] = value
                self.dirty["rnat"].add(key)
            else:
                rec.users.discard(spn)
                if not rec.users:
                    del self._rnats[ident]
                    del self._rnat_by_id[rec.id]
                    self.rnat_ids.release(rec.id)
                    self.desired["rnat"].pop((rec.id,), None)
                    self.dirty["rnat"].add((rec.id,))
        return changed

    # ------------------------------------------------------------------ the kernel's view

    def reconcile(self, dump: Mapping[str, Iterable[tuple[Key, Value]]], *, adopt: bool = False) -> int:
        """Take `dump` (what the maps hold, as codec tuples) as the written state; returns how many
        entries differ from the desired state (to be repaired by the next flush). With `adopt` (the
        first sync after a start), the ids the dump holds are re-adopted by the next `update`."""
        self.written = {r: dict(dump.get(r, ())) for r in ROLES}
        self._rebuild_indexes()
        # Ids the kernel holds that the plan does not own stay taken until the kernel lets go of
        # them (or a re-adoption claims them).
        held = (
            (self.svc_ids, self._w_svc_sets.keys() | self._w_svc_members.keys(), self._svc_owner),
            (self.set_ids, self._w_set_slots.keys() | self._w_set_fes.keys(), self._set_owner),
            (self.backend_ids, {k[0] for k in self.written["be"]} | self._w_be_slots.keys(), self._be_by_id),
            (
                self.rnat_ids,
                {k[0] for k in self.written["rnat"]} | self._w_rnat_fes.keys() | self._w_rnat_srcr.keys(),
                self._rnat_by_id,
            ),
        )
        for pool, ids, owned in held:
            for ident in ids:
                if ident not in owned:
                    pool.reserve(ident)
                    pool.release(ident)
        if adopt:
            self._fe_hints = {
                k: (v[1], bool(v[3] & FrontendFlag.LOCAL), v[5], v[0]) for k, v in self.written["fe"].items()
            }
            hints: dict[BeIdent, int] = {}
            for (bid,), value in sorted(self.written["be"].items()):
                hints.setdefault((value[0], value[1], value[2]), bid)
            self._be_hints = hints
        differ = 0
        for role in ROLES:
            desired, written, dirty = self.desired[role], self.written[role], self.dirty[role]
            for key in desired.keys() | written.keys():
                if desired.get(key) != written.get(key):
                    dirty.add(key)
                    differ += 1
        return differ

    def forget_hints(self) -> None:
        self._fe_hints = {}
        self._be_hints = {}

    def _rebuild_indexes(self) -> None:
        self._w_set_fes, self._w_set_slots, self._w_be_slots = {}, {}, {}
        self._w_rnat_fes, self._w_rnat_srcr = {}, {}
        self._w_svc_sets, self._w_set_be, self._w_svc_members = {}, {}, {}
        for role in ROLES:
            for key, value in self.written[role].items():
                self._index(role, key, value, +1)

    def _index(self, role: str, key: Key, value: Value, sign: int) -> None:
        if role == "fe":
            svc_id, set_id, count = value[0], value[1], value[2]
            fes = self._w_set_fes.setdefault(set_id, {})
            if sign > 0:
                fes[key] = count
            else:
                fes.pop(key, None)
                if not fes:
                    del self._w_set_fes[set_id]
            sets = self._w_svc_sets.setdefault(svc_id, {})
            _bump(sets, set_id, sign)
            if not sets:
                del self._w_svc_sets[svc_id]
            _bump(self._w_rnat_fes, value[5], sign)
        elif role == "slot":
            _bump(self._w_set_slots, key[0], sign)
            _bump(self._w_be_slots, value[0], sign)
            _bump(self._w_set_be, (key[0], value[0]), sign)
        elif role == "member":
            _bump(self._w_svc_members, key[0], sign)
        elif role == "srcr":
            _bump(self._w_rnat_srcr, key[1], sign)

    def _wrote(self, role: str, key: Key, value: Value | None) -> None:
        written = self.written[role]
        old = written.get(key)
        if old is not None:
            self._index(role, key, old, -1)
        if value is None:
            written.pop(key, None)
        else:
            written[key] = value
            self._index(role, key, value, +1)

    def _wrote_many(self, role: str, entries: Sequence[tuple[Key, Value]]) -> None:
        """`_wrote` for a batch that went in whole; entries new to the map skip the unindexing."""
        written = self.written[role]
        if role in ("be", "rnat"):  # nothing indexes them
            written.update(entries)
            return
        for key, value in entries:
            old = written.get(key)
            if old is not None:
                self._index(role, key, old, -1)
            written[key] = value
            self._index(role, key, value, +1)

    # ------------------------------------------------------------------ flushing

    def _deletable(self, role: str, key: Key, late: bool) -> bool:
        """A written entry that is not desired, and that nothing written still needs. A source
        range goes early only when no frontend uses its reverse-NAT id (a frontend keeping its
        ranges keeps the old ones until the new ones are written), late when its users all got
        their writes through."""
        if key in self.desired[role] or key not in self.written[role]:
            return False
        if role == "srcr":
            if not self._w_rnat_fes.get(key[1]):
                return True
            return late and not self._owners(role, key) & self._failed_now
        if role == "slot":
            set_id, pos = key
            return all(count < pos for count in self._w_set_fes.get(set_id, {}).values())
        if role == "be":
            return not self._w_be_slots.get(key[0])
        if role == "rnat":
            return not self._w_rnat_fes.get(key[0])
        if role == "member":
            # Kept while a written frontend of the port can still reach the backend through a slot:
            # the data path honours affinity and UDP flows only toward members.
            svc_id, bid = key
            set_be = self._w_set_be
            return not any((set_id, bid) in set_be for set_id in self._w_svc_sets.get(svc_id, ()))
        return True  # frontends: nothing points at them

    def _owners(self, role: str, key: Key) -> set[ServicePortName]:
        if role == "fe":
            owner = self._fe_owner.get(key)
        elif role == "slot":
            owner = self._set_owner.get(key[0])
        elif role == "member":
            owner = self._svc_owner.get(key[0])
        elif role == "be":
            ident = self._be_by_id.get(key[0])
            if ident is None:
                return set()
            if self._be_owners is None:  # built once per flush, and only on the failure path
                self._be_owners = {}
                for spn in self._replanned:
                    for used in self._frags.get(spn, _EMPTY).backends:
                        self._be_owners.setdefault(used, set()).add(spn)
            return set(self._be_owners.get(ident, ()))
        elif role == "rnat":
            ident = self._rnat_by_id.get(key[0])
            rnat = self._rnats.get(ident) if ident is not None else None
            return set(rnat.users) if rnat is not None else set()
        elif role == "addr":
            return set()  # shared by every frontend and backend on the address
        else:  # srcr, by its reverse-NAT id
            ident = self._rnat_by_id.get(key[1])
            rnat = self._rnats.get(ident) if ident is not None else None
            return set(rnat.users) if rnat is not None else set()
        return {owner} if owner is not None else set()

    def flush(self, maps: Mapping[str, RawMap]) -> FlushResult:
        """Write what differs between desired and written, in the safe order (module doc)."""
        result = FlushResult(updates=dict.fromkeys(WRITE_ORDER, 0), deletes=dict.fromkeys(DELETE_ORDER, 0))
        self._failed_now = set()
        self._be_owners = None
        self._delete_safe(maps, result, late=False)
        self._write(maps, result)
        self._failed_now = set(result.failed)
        self._delete_safe(maps, result, late=True)
        if result.failed:
            retry = dict(result.failed)
            result.failed = {}
            self._write(maps, result, only=set(retry))
            self._failed_now = set(result.failed)
            self._delete_safe(maps, result, late=True)
        for role in ROLES:
            desired, written = self.desired[role], self.written[role]
            self.dirty[role] = {k for k in self.dirty[role] if desired.get(k) != written.get(k)}
        if not any(self.dirty.values()):
            self._replanned = set()
        self.svc_ids.settle(lambda s: s in self._w_svc_sets or s in self._w_svc_members)
        self.set_ids.settle(lambda s: s in self._w_set_fes or s in self._w_set_slots)
        self.backend_ids.settle(lambda b: (b,) in self.written["be"] or b in self._w_be_slots)
        self.rnat_ids.settle(
            lambda r: (r,) in self.written["rnat"] or r in self._w_rnat_fes or r in self._w_rnat_srcr
        )
        return result

    def _delete_safe(self, maps: Mapping[str, RawMap], result: FlushResult, *, late: bool) -> None:
        for role in DELETE_ORDER:
            desired, written = self.desired[role], self.written[role]
            # Walk the dirty keys (a few after one change), never the maps: `set - dict.keys()`
            # would iterate every key of the dict.
            keys = [
                k
                for k in self.dirty[role]
                if k not in desired and k in written and self._deletable(role, k, late)
            ]
            if not keys:
                continue
            maps[role].delete_raw(list(starmap(KEYS[role].struct.pack, keys)))
            for key in keys:
                self._wrote(role, key, None)
            result.deletes[role] += len(keys)

    def _write(
        self, maps: Mapping[str, RawMap], result: FlushResult, only: set[ServicePortName] | None = None
    ) -> None:
        failed = result.failed
        for role in WRITE_ORDER:
            desired, written = self.desired[role], self.written[role]
            entries: list[tuple[Key, Value]] = []
            filtering = only is not None or bool(failed)  # owners matter only after a failure
            for key in self.dirty[role]:
                value = desired.get(key)
                if value is None or written.get(key) == value:
                    continue
                if filtering:
                    owners = self._owners(role, key)
                    if only is not None and not owners & only:
                        continue
                    if owners and owners <= failed.keys():
                        continue  # every user of it already failed: do not point further at it
                entries.append((key, value))
            if not entries:
                continue
            if role == "fe":
                # A full map takes whole services in kube-proxy's order of addresses: both scopes of
                # a frontend sort next to each other (the other maps' order decides nothing).
                entries.sort()
            kc, vc = KEYS[role], VALUES[role]
            target = maps[role]
            new_keys = [k for k, _ in entries if k not in written]  # what takes room in the map
            done = target.update_raw(
                list(starmap(kc.struct.pack, (k for k, _ in entries))),
                list(starmap(vc.struct.pack, (v for _, v in entries))),
            )
            if done == len(entries):
                self._wrote_many(role, entries)
                result.updates[role] += done
                continue
            # The map is full. What went in first is arbitrary, and a service port missing one entry
            # is as unprogrammed as one missing all: take back this batch's new entries and write
            # whole service ports instead, in kube-proxy's order, as many as fit.
            fresh = set(new_keys)
            self._wrote_many(role, [e for e in entries[:done] if e[0] not in fresh])
            target.delete_raw(list(starmap(kc.struct.pack, (k for k, _ in entries[:done] if k in fresh))))
            result.updates[role] += self._write_by_service_port(role, target, entries, failed)

    def _write_by_service_port(
        self,
        role: str,
        target: RawMap,
        entries: Sequence[tuple[Key, Value]],
        failed: dict[ServicePortName, str],
    ) -> int:
        """Write `entries` service port by service port (sorted), each port's entries all or none; a
        port whose entries do not fit is taken back out and reported. Returns the entries written."""
        kc, vc = KEYS[role], VALUES[role]
        written = self.written[role]
        by_port: dict[ServicePortName, list[tuple[Key, Value]]] = {}
        for key, value in entries:
            for spn in self._owners(role, key) or {_ORPHAN}:
                by_port.setdefault(spn, []).append((key, value))
        count = 0
        why = f"BPF map {abi.MAPS[role].name} is full: raise {abi.MAPS[role].size_flag}"
        for spn in sorted(by_port, key=_order):
            todo = [(k, v) for k, v in by_port[spn] if written.get(k) != v]
            done = target.update_raw(
                list(starmap(kc.struct.pack, (k for k, _ in todo))),
                list(starmap(vc.struct.pack, (v for _, v in todo))),
            )
            if done == len(todo):
                self._wrote_many(role, todo)
                count += done
                continue
            fresh = [k for k, _ in todo[:done] if k not in written]
            target.delete_raw(list(starmap(kc.struct.pack, fresh)))
            kept = [(k, v) for k, v in todo[:done] if k in written]  # overwrites of existing entries
            self._wrote_many(role, kept)
            count += len(kept)
            if spn is not _ORPHAN:
                failed.setdefault(spn, why)
        return count

    # ------------------------------------------------------------------ views

    def fragment(self, spn: ServicePortName) -> Fragment | None:
        return self._frags.get(spn)

    def fe_names(self) -> dict[Key, str]:
        return {key: str(spn) for key, spn in self._fe_owner.items()}


_ADDR_FLAGS = tuple(int(f) for f in AddrFlag)


def _address_of(role: str, key: Key, value: Value) -> tuple[int, int]:
    """The (address, AddrFlag) a desired frontend (key: addr, port, proto, scope) or backend
    (value: addr, port, proto, flags) entry puts into `addr`."""
    if role == "fe":
        return key[0], 1 << key[3]
    return value[0], _ADDR_BACKEND


def _order(spn: ServicePortName) -> tuple[str, str]:
    return str(spn), str(spn.protocol)


def _bump(counter: dict[Any, int], key: Any, sign: int) -> None:
    n = counter.get(key, 0) + sign
    if n > 0:
        counter[key] = n
    else:
        counter.pop(key, None)


def decode(role: str, keys: bytes, values: bytes) -> list[tuple[Key, Value]]:
    """A map dump (every key, every value, each concatenated: `dump_raw`) as codec tuples."""
    return list(
        zip(KEYS[role].struct.iter_unpack(keys), VALUES[role].struct.iter_unpack(values), strict=True)
    )


def as_ctypes(role: str, entries: Mapping[Key, Value]) -> dict[Any, Any]:
    """Codec tuples as ctypes keys and values (for rendering)."""
    kc, vc = KEYS[role], VALUES[role]
    return {kc.to_ctype(k): vc.to_ctype(v) for k, v in entries.items()}
