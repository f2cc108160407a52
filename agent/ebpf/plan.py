"""Desired map contents: ProxyState + NodeContext + Config (+ what the maps held) -> MapContents.

Pure: no kernel, no bcc, no pyroute2. The eBPF proxier feeds it the state of one sync and the
contents it last wrote (or, on start, what it dumped from the pinned maps) and hands the result
to `delta.diff`, which orders the writes.

What the entries say (the data path's contract, see bpf/ekp_abi.h):

* Every service port has up to two backend *sets*, one per traffic policy view: "cluster"
  (ServiceEndpoints.cluster) and "local" (ServiceEndpoints.local). A set is a run of slots
  `{set_id, 1..count} -> backend_id`; only sets some frontend uses are written.
* Frontends follow kube-proxy's iptables chains:
  - ClusterIP, both scopes: ITP Local ? local set (LOCAL) : cluster set.
  - NodePort (each NodeContext.nodeport_ips address), externalIPs, load-balancer IPs:
    EXTERNAL scope: ETP Local ? local set (LOCAL) : cluster set + SNAT_REMOTE;
    INTERNAL scope (pods): the cluster set (kube-proxy short-circuits pod traffic to the
    cluster chain, "pod traffic for svc external destinations").
  - masquerade-all (ClusterIP traffic, both scopes) and cluster-cidr (ClusterIP traffic from
    outside the pods, approximated by the EXTERNAL scope) add SNAT_REMOTE as kube-proxy's
    KUBE-MARK-MASQ rules for the cluster IP do.
  - An empty set: NO_ENDPOINTS (reject) when nothing anywhere could serve, or when the cluster
    view is empty; a local set that is empty while others could serve keeps LOCAL alone (drop).
  - loadBalancerSourceRanges: SOURCE_RANGES on the load-balancer frontends of both scopes
    (kube-proxy's KUBE-FW chain sees pod traffic too) and one `srcr` entry per CIDR; like
    kube-proxy, a range holding the node's address also admits the LB IP itself as a source.
* Every service port has a `svc_id`, carried by all its frontends: the data path checks
  membership `{svc_id, backend_id} -> CLUSTER|LOCAL` (one `member` entry per backend of the
  port's sets) before it honours an affinity entry or moves a UDP flow, and keys affinity by
  (client, svc_id), so affinity spans every frontend of the port as kube-proxy's does.
* External frontends with ETP Cluster masquerade toward every backend (SNAT_ALL, kube-proxy's
  KUBE-MARK-MASQ), or only toward remote ones (SNAT_REMOTE) with
  `--bpf-keep-client-ip-for-local-backends`.
* Ids are stable. A set keeps the id of the frontend that used it (matched by frontend key and
  the LOCAL flag), a service port the svc_id any of its frontends had, a backend the id its
  (ip, port, proto) had, a reverse-NAT entry the id its frontend (addr, port, proto) pointed at.
  Fresh ids never reuse an id the previous contents
  hold (so no live frontend or slot ever points at a reused id mid-update) and count up from the
  high-water mark, wrapping to the lowest free id only at the field's limit, so conntrack and
  affinity entries of a just-removed service do not meet a new one under the same id.
  Reverse-NAT ids are per (addr, port, proto), so two services sharing an LB IP on one port
  with two protocols keep separate source ranges.
* Slots change little: a backend that stays keeps its slot when it still fits the new count;
  newcomers fill the holes, in kube-proxy's endpoint order.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NewType, Protocol

from agent.config import Config, NodeContext
from agent.ebpf import abi
from agent.ebpf.abi import (
    Backend,
    BackendFlag,
    BackendKey,
    Frontend,
    FrontendFlag,
    FrontendKey,
    Member,
    MemberFlag,
    MemberKey,
    RevNat,
    RevNatKey,
    Scope,
    Slot,
    SlotKey,
    SrcRange,
    SrcRangeKey,
    ip_be,
    port_be,
)
from agent.model.types import Endpoint, ProxyState, ServiceEndpoints, ServicePort, ServicePortName

SetId = NewType("SetId", int)
BackendId = NewType("BackendId", int)
RevNatId = NewType("RevNatId", int)

SetKind = Literal["cluster", "local"]

# Conntrack timeouts of the config entry that kube-proxy's settings do not cover, or cover with 0
# ("leave the kernel's value"): the kernel's defaults (nf_conntrack_udp_timeout 30 s,
# nf_conntrack_udp_timeout_stream 120 s) and Cilium's for the TCP states kube-proxy leaves alone
# (CT_SYN_TIMEOUT 60 s for a handshake not completed, CT_CLOSE_TIMEOUT 10 s after a RST or FINs
# both ways).
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

# The map roles MapContents holds, in the order they are rendered.
ROLES = ("fe", "slot", "be", "rnat", "member", "srcr")


class PlanError(RuntimeError):
    """The desired state cannot be expressed in the maps (ids exhausted)."""


@dataclass(frozen=True)
class HighWater:
    """Largest id ever handed out per kind; not stored in any map (recomputed from a dump)."""

    set_id: int = 0
    backend_id: int = 0
    rev_nat_id: int = 0
    svc_id: int = 0


@dataclass
class MapContents:
    """Entries of the service maps, by role, as ctypes keys and values (equal by field values).

    Built by `plan` or read back from live maps (`read_contents`). Treat as immutable once built;
    `copy()` before changing. `fe_names` (frontend -> "ns/name:port") annotates dry-run output
    and is not part of any map.
    """

    fe: dict[FrontendKey, Frontend] = field(default_factory=dict)
    slot: dict[SlotKey, Slot] = field(default_factory=dict)
    be: dict[BackendKey, Backend] = field(default_factory=dict)
    rnat: dict[RevNatKey, RevNat] = field(default_factory=dict)
    member: dict[MemberKey, Member] = field(default_factory=dict)
    srcr: dict[SrcRangeKey, SrcRange] = field(default_factory=dict)
    cfg: abi.Config | None = None
    high: HighWater = field(default_factory=HighWater)
    fe_names: dict[FrontendKey, str] = field(default_factory=dict)

    def table(self, role: str) -> dict[Any, Any]:
        """The entries of one map role ("fe", "slot", "be", "rnat", "member" or "srcr")."""
        if role not in ROLES:
            raise KeyError(role)
        table: dict[Any, Any] = getattr(self, role)
        return table

    def copy(self) -> MapContents:
        return replace(
            self,
            fe=dict(self.fe),
            slot=dict(self.slot),
            be=dict(self.be),
            rnat=dict(self.rnat),
            member=dict(self.member),
            srcr=dict(self.srcr),
            fe_names=dict(self.fe_names),
        )

    def same_entries(self, other: MapContents) -> bool:
        """Equal map entries (cfg included); high-water marks and names are not compared."""
        return self.cfg == other.cfg and all(self.table(r) == other.table(r) for r in ROLES)


class MapReader(Protocol):
    """What `read_contents` needs of a map: its entries as (key, value) ctypes pairs."""

    def items(self) -> Iterable[tuple[Any, Any]]: ...


def read_contents(maps: Mapping[str, MapReader], cfg: abi.Config | None = None) -> MapContents:
    """MapContents of live (or fake) maps, keyed by role; missing roles read as empty.

    The high-water marks are the largest ids found, so fresh ids continue above them.
    """
    out = MapContents(cfg=cfg)
    for role in ROLES:
        reader = maps.get(role)
        if reader is None:
            continue
        table = out.table(role)
        for key, value in reader.items():
            table[copy_struct(key)] = copy_struct(value)
    out.high = HighWater(
        set_id=max([k.set_id for k in out.slot] + [v.set_id for v in out.fe.values()], default=0),
        backend_id=max([k.id for k in out.be] + [v.backend_id for v in out.slot.values()], default=0),
        rev_nat_id=max([k.id for k in out.rnat] + [v.rev_nat_id for v in out.fe.values()], default=0),
        svc_id=max([v.svc_id for v in out.fe.values()] + [k.svc_id for k in out.member], default=0),
    )
    return out


def copy_struct(value: Any) -> Any:
    """A private copy of a ctypes value (a map iterator may reuse its buffers)."""
    cls = type(value)
    return cls.from_buffer_copy(bytes(value))


def config_entry(node: NodeContext, config: Config) -> abi.Config:
    """The config entry: the node's SNAT source, the SNAT port range, the conntrack timeouts (kube-
    proxy's conntrack settings where they say something, as iptables mode applies them to
    nf_conntrack) and the reject rate limit."""
    lo, hi = config.snat_ports
    ct = config.conntrack
    return abi.Config(
        node_addr=ip_be(node.primary_ip) if node.primary_ip else 0,
        snat_port_min=lo,
        snat_port_max=hi,
        tcp_established_s=_seconds(ct.tcp_established_timeout_s, 86400),
        tcp_close_wait_s=_seconds(ct.tcp_close_wait_timeout_s, 3600),
        tcp_syn_s=TCP_SYN_TIMEOUT_S,
        tcp_closed_s=TCP_CLOSED_TIMEOUT_S,
        udp_s=_seconds(ct.udp_timeout_s, UDP_TIMEOUT_S),
        udp_stream_s=_seconds(ct.udp_stream_timeout_s, UDP_STREAM_TIMEOUT_S),
        icmp_rate=ICMP_RATE,
        icmp_burst=ICMP_BURST,
        flags=0,
    )


def _seconds(value: float, default: int) -> int:
    """A kube-proxy timeout in whole seconds; 0 ("leave it") becomes the default."""
    return max(1, round(value)) if value > 0 else default


# ---------------------------------------------------------------------------------- ids


class _Ids:
    """Hands out fresh ids of one kind: above the high-water mark, never one `taken`."""

    def __init__(self, taken: Iterable[int], high: int, limit: int, what: str) -> None:
        self._taken = set(taken)
        self._next = max(high, max(self._taken, default=0)) + 1
        self._limit = limit
        self._what = what
        self._low = 1  # lowest id that may still be free once wrapped
        self._claimed: set[int] = set()
        self.high = high

    def claim(self, ident: int) -> bool:
        """Reserve an id the previous contents held; False when another user claimed it first."""
        if ident in self._claimed:
            return False
        self._claimed.add(ident)
        self.high = max(self.high, ident)
        return True

    def fresh(self) -> int:
        while self._next <= self._limit:
            ident = self._next
            self._next += 1
            if ident not in self._taken and ident not in self._claimed:
                return self._take(ident)
        while self._low <= self._limit:
            ident = self._low
            self._low += 1
            if ident not in self._taken and ident not in self._claimed:
                return self._take(ident)
        raise PlanError(f"no free {self._what} id left (limit {self._limit})")

    def _take(self, ident: int) -> int:
        self._claimed.add(ident)
        self.high = max(self.high, ident)
        return ident


# ---------------------------------------------------------------------------------- frontends


@dataclass(frozen=True)
class _Fe:
    """A frontend before ids are known."""

    key: FrontendKey
    spn: ServicePortName
    kind: SetKind
    flags: int
    affinity: int
    rnat: tuple[str, int, int]  # (addr, port, proto): the reverse-NAT identity


def _key(addr: str, port: int, proto: int, scope: Scope) -> FrontendKey:
    return FrontendKey(addr=ip_be(addr), port=port_be(port), proto=proto, scope=int(scope))


def _frontends(sp: ServicePort, node: NodeContext, config: Config) -> list[_Fe]:
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
    rnat = (sp.cluster_ip, sp.port, proto)
    for scope, snat in ((Scope.EXTERNAL, snat_ext), (Scope.INTERNAL, snat_int)):
        out.append(
            _Fe(
                _key(sp.cluster_ip, sp.port, proto, scope), sp.name, kind, base | local | snat, affinity, rnat
            )
        )

    # External frontends: ETP for traffic from outside, the cluster set for pods.
    externals: list[tuple[str, int, int]] = []
    if sp.node_port:
        externals += [
            (ip, sp.node_port, FrontendFlag.NODEPORT) for ip in node.nodeport_ips(config.nodeport_addresses)
        ]
    externals += [(ip, sp.port, FrontendFlag.EXTERNAL_IP) for ip in sp.external_ips]
    ranges = int(FrontendFlag.SOURCE_RANGES) if sp.load_balancer_source_ranges else 0
    externals += [(ip, sp.port, FrontendFlag.LOADBALANCER | ranges) for ip in sp.load_balancer_ips]
    for addr, port, what in externals:
        rnat = (addr, port, proto)
        if sp.external_policy_local:
            ext_kind: SetKind = "local"
            ext_flags = base | what | FrontendFlag.LOCAL
        else:
            # ETP Cluster: kube-proxy masquerades all of it (KUBE-EXT-* -> KUBE-MARK-MASQ); keeping
            # the client's address toward local backends is an explicit choice.
            ext_kind = "cluster"
            masq = FrontendFlag.SNAT_REMOTE if config.bpf_keep_client_ip_local else FrontendFlag.SNAT_ALL
            ext_flags = base | what | masq
        out.append(_Fe(_key(addr, port, proto, Scope.EXTERNAL), sp.name, ext_kind, ext_flags, affinity, rnat))
        out.append(
            _Fe(_key(addr, port, proto, Scope.INTERNAL), sp.name, "cluster", base | what, affinity, rnat)
        )
    return out


def _set_endpoints(eps: ServiceEndpoints, kind: SetKind) -> tuple[Endpoint, ...]:
    return eps.cluster if kind == "cluster" else eps.local


def _source_ranges(sp: ServicePort, node: NodeContext) -> list[tuple[int, str]]:
    """(prefix length, network address) the LB frontends of `sp` admit."""
    out: list[tuple[int, str]] = []
    node_in_range = False
    for text in sp.load_balancer_source_ranges:
        net = ipaddress.ip_network(text, strict=False)
        if not isinstance(net, ipaddress.IPv4Network):
            continue
        out.append((net.prefixlen, str(net.network_address)))
        node_in_range = node_in_range or any(ipaddress.ip_address(ip) in net for ip in node.node_ips)
    if node_in_range:
        # kube-proxy: a VIP-like LB IP bound on the node loops back with itself as the source.
        out += [(32, ip) for ip in sp.load_balancer_ips]
    return out


# ---------------------------------------------------------------------------------- plan


def plan(
    state: ProxyState,
    node: NodeContext,
    config: Config,
    previous: MapContents | None = None,
) -> MapContents:
    """The map contents that program `state` on this node, re-adopting the ids of `previous`."""
    prev = previous if previous is not None else MapContents()

    # Frontends (without ids) and the sets they use. A key two services claim (an invalid
    # state, e.g. the same external IP and port) goes to the first in sorted order.
    fes: dict[FrontendKey, _Fe] = {}
    sets: dict[_SetRef, tuple[Endpoint, ...]] = {}
    ports = state.sorted_ports()
    for sp in ports:
        eps = state.endpoints.get(sp.name, ServiceEndpoints())
        for fe in _frontends(sp, node, config):
            if fe.key not in fes:
                fes[fe.key] = fe
                sets.setdefault((fe.spn, fe.kind), _set_endpoints(eps, fe.kind))
    set_order = sorted(sets, key=lambda s: (str(s[0]), s[0].protocol, s[1]))

    backends, be_high = _backend_ids(set_order, sets, prev)
    set_id, set_high = _set_ids(set_order, fes, prev)
    rnat_id, rnat_high = _rev_nat_ids(fes, prev)
    svc_id, svc_high = _svc_ids(fes, prev)

    out = MapContents(cfg=config_entry(node, config))
    out.high = HighWater(set_id=set_high, backend_id=be_high, rev_nat_id=rnat_high, svc_id=svc_high)
    for (addr, port, proto), (bid, flags) in backends.items():
        out.be[BackendKey(id=bid)] = Backend(addr=addr, port=port, proto=proto, flags=flags)

    prev_slots: dict[int, dict[int, int]] = {}
    for slot_key, slot in prev.slot.items():
        prev_slots.setdefault(slot_key.set_id, {})[slot_key.slot] = slot.backend_id
    counts: dict[_SetRef, int] = {}
    for ref in set_order:
        proto = ref[0].protocol.number
        members = list(dict.fromkeys(backends[_ep_ident(ep, proto)][0] for ep in sets[ref]))
        sid = set_id[ref]
        for pos, bid in _layout(members, prev_slots.get(sid, {})).items():
            out.slot[SlotKey(set_id=sid, slot=pos)] = Slot(backend_id=bid)
        counts[ref] = len(members)
        _add_members(out, svc_id[ref[0]], ref[1], members)

    by_name = {sp.name: sp for sp in ports}
    for fe in fes.values():
        ref = (fe.spn, fe.kind)
        flags = fe.flags
        if counts[ref] == 0:
            has_any = state.endpoints.get(fe.spn, ServiceEndpoints()).has_any
            if fe.kind == "cluster" or not has_any:
                flags |= FrontendFlag.NO_ENDPOINTS
        rid = rnat_id[fe.rnat]
        out.fe[fe.key] = Frontend(
            svc_id=svc_id[fe.spn],
            set_id=set_id[ref],
            count=counts[ref],
            flags=flags,
            affinity_timeout=fe.affinity,
            rev_nat_id=rid,
        )
        out.fe_names[fe.key] = str(fe.spn)
        fe_addr, fe_port, _ = fe.rnat
        out.rnat[RevNatKey(id=rid)] = RevNat(addr=ip_be(fe_addr), port=port_be(fe_port))
        if fe.flags & FrontendFlag.SOURCE_RANGES:
            for plen, net in _source_ranges(by_name[fe.spn], node):
                key = SrcRangeKey(prefixlen=32 + plen, rev_nat_id=rid, addr=ip_be(net))
                out.srcr[key] = SrcRange(allow=1)
    return out


_SetRef = tuple[ServicePortName, SetKind]
_BeIdent = tuple[int, int, int]  # (addr be, port be, proto) as the backend map holds them


def _ep_ident(ep: Endpoint, proto: int) -> _BeIdent:
    return (ip_be(ep.ip), port_be(ep.port), proto)


def _backend_ids(
    set_order: list[_SetRef], sets: Mapping[_SetRef, tuple[Endpoint, ...]], prev: MapContents
) -> tuple[dict[_BeIdent, tuple[int, int]], int]:
    """(ip, port, proto) -> (backend id, flags) in order of first use; and the high-water mark."""
    prev_be: dict[_BeIdent, int] = {}
    for bkey, bval in sorted(prev.be.items(), key=lambda kv: kv[0].id):
        prev_be.setdefault((bval.addr, bval.port, bval.proto), bkey.id)
    ids = _Ids(
        [k.id for k in prev.be] + [v.backend_id for v in prev.slot.values()],
        prev.high.backend_id,
        BACKEND_ID_MAX,
        "backend",
    )
    backends: dict[_BeIdent, tuple[int, int]] = {}
    for ref in set_order:
        proto = ref[0].protocol.number
        for ep in sets[ref]:
            ident = _ep_ident(ep, proto)
            flags = (BackendFlag.LOCAL if ep.is_local else 0) | (
                BackendFlag.TERMINATING if ep.terminating else 0
            )
            if ident in backends:
                bid, seen = backends[ident]
                backends[ident] = (bid, seen | flags)
                continue
            adopted = prev_be.get(ident)
            bid = adopted if adopted is not None and ids.claim(adopted) else ids.fresh()
            backends[ident] = (bid, int(flags))
    return backends, ids.high


def _set_ids(
    set_order: list[_SetRef], fes: Mapping[FrontendKey, _Fe], prev: MapContents
) -> tuple[dict[_SetRef, int], int]:
    """Set ids, re-adopted through the frontends that used them (same key, same LOCAL-ness)."""
    ids = _Ids(
        [v.set_id for v in prev.fe.values()] + [k.set_id for k in prev.slot],
        prev.high.set_id,
        SET_ID_MAX,
        "backend set",
    )
    users: dict[_SetRef, list[FrontendKey]] = {}
    for fe in fes.values():
        users.setdefault((fe.spn, fe.kind), []).append(fe.key)
    out: dict[_SetRef, int] = {}
    for ref in set_order:
        want_local = ref[1] == "local"
        chosen = 0
        for fkey in users[ref]:
            old = prev.fe.get(fkey)
            if old is None or old.set_id == 0 or bool(old.flags & FrontendFlag.LOCAL) != want_local:
                continue
            if ids.claim(old.set_id):
                chosen = old.set_id
                break
        out[ref] = chosen or ids.fresh()
    return out, ids.high


def _add_members(out: MapContents, sid: int, kind: SetKind, members: list[int]) -> None:
    """member {svc_id, backend} -> the sets of the service port that hold the backend."""
    bit = int(MemberFlag.LOCAL if kind == "local" else MemberFlag.CLUSTER)
    for bid in members:
        key = MemberKey(svc_id=sid, backend_id=bid)
        held = out.member.get(key)
        out.member[key] = Member(flags=(held.flags if held is not None else 0) | bit)


def _svc_ids(fes: Mapping[FrontendKey, _Fe], prev: MapContents) -> tuple[dict[ServicePortName, int], int]:
    """Service-port ids, re-adopted through the frontends that carried them (any of the port's)."""
    ids = _Ids(
        [v.svc_id for v in prev.fe.values()] + [k.svc_id for k in prev.member],
        prev.high.svc_id,
        SVC_ID_MAX,
        "service port",
    )
    users: dict[ServicePortName, list[FrontendKey]] = {}
    for fe in fes.values():
        users.setdefault(fe.spn, []).append(fe.key)
    out: dict[ServicePortName, int] = {}
    for spn in sorted(users, key=lambda n: (str(n), n.protocol)):
        chosen = 0
        for fkey in sorted(users[spn], key=bytes):
            old = prev.fe.get(fkey)
            if old is not None and old.svc_id and ids.claim(old.svc_id):
                chosen = old.svc_id
                break
        out[spn] = chosen or ids.fresh()
    return out, ids.high


def _rev_nat_ids(
    fes: Mapping[FrontendKey, _Fe], prev: MapContents
) -> tuple[dict[tuple[str, int, int], int], int]:
    """Reverse-NAT ids per frontend (addr, port, proto), re-adopted through the frontends."""
    ids = _Ids(
        [k.id for k in prev.rnat] + [v.rev_nat_id for v in prev.fe.values()],
        prev.high.rev_nat_id,
        REVNAT_ID_MAX,
        "reverse-NAT",
    )
    users: dict[tuple[str, int, int], list[FrontendKey]] = {}
    for fe in fes.values():
        users.setdefault(fe.rnat, []).append(fe.key)
    out: dict[tuple[str, int, int], int] = {}
    for ident, keys in users.items():
        addr, port, _ = ident
        want = RevNat(addr=ip_be(addr), port=port_be(port))
        chosen = 0
        for fkey in keys:
            old = prev.fe.get(fkey)
            if old is None or not old.rev_nat_id:
                continue
            held = prev.rnat.get(RevNatKey(id=old.rev_nat_id))
            if (held is None or held == want) and ids.claim(old.rev_nat_id):
                chosen = old.rev_nat_id
                break
        out[ident] = chosen or ids.fresh()
    return out, ids.high


def _layout(members: list[int], previous: Mapping[int, int]) -> dict[int, int]:
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
