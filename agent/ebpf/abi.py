"""Python mirror of bpf/ekp_abi.h (ABI v2): the keys and values of every BPF map, and the map registry.

One ctypes Structure per C struct, fields in the same order and width; tests/ebpf/test_abi.py
compiles a probe from the header and checks every size and offset against these classes.
Byte order follows the header: fields named `addr`, `port`, `saddr`... marked "be" there hold
network-order values; use the helpers below to convert, never by hand.

`MAPS` is the one registry of map names: the C side declares the same names in bpf/ekp_maps.h,
and every name carries a version (the ABI's, or the map's own when its layout changed alone:
`ekp_stats_v3`) so a changed layout never reuses an old pinned map. Each
`MapSpec` says who writes the map (`writer`): the agent (service tables, config) or the data path
(flow state, counters); `inspect capacity` and the metrics collector read fill and pressure of
every map through this registry.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import TypeAlias

ABI_VERSION = 2
PREFIX = "ekp_"

u8, u16, u32, u64 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64


def ip_be(ip: str) -> int:
    """Dotted quad to the integer whose in-memory bytes are the address in network order."""
    return int.from_bytes(ipaddress.IPv4Address(ip).packed, "little")


def ip_str(be: int) -> str:
    return str(ipaddress.IPv4Address(be.to_bytes(4, "little")))


def ip6_words(ip: str) -> tuple[int, int, int, int]:
    """An IPv6 address as the four native-order ints whose bytes are it in network order (`__be32
    addr[4]` of the IPv6 structs)."""
    packed = ipaddress.IPv6Address(ip).packed
    return tuple(int.from_bytes(packed[i : i + 4], "little") for i in range(0, 16, 4))  # type: ignore[return-value]


def ip6_str(words: object) -> str:
    """The inverse of `ip6_words` (a ctypes `u32 * 4` or a sequence of four ints)."""
    return str(ipaddress.IPv6Address(b"".join(int(w).to_bytes(4, "little") for w in words)))  # type: ignore[attr-defined]


def port_be(port: int) -> int:
    return socket.htons(port)


def port_host(be: int) -> int:
    return socket.ntohs(be)


# A map key or value: one of the structures below, or a bare u32/u64.
CData: TypeAlias = ctypes.Structure | ctypes.c_uint32 | ctypes.c_uint64


def copy_struct(value: CData) -> CData:
    """A private copy of a map key or value (a map iterator may reuse its buffers)."""
    return type(value).from_buffer_copy(bytes(value))


class Scope(IntEnum):
    EXTERNAL = 0
    INTERNAL = 1
    HOST = 2  # the node's own sockets, only where an INTERNAL frontend has HOST_SCOPE


class FrontendFlag(IntEnum):
    NODEPORT = 1 << 0
    EXTERNAL_IP = 1 << 1
    LOADBALANCER = 1 << 2
    LOCAL = 1 << 3
    SNAT_REMOTE = 1 << 4
    NO_ENDPOINTS = 1 << 5
    SOURCE_RANGES = 1 << 6
    AFFINITY = 1 << 7
    SNAT_ALL = 1 << 8
    MAGLEV = 1 << 9
    HOST_SCOPE = 1 << 10
    HOST_BACKEND = 1 << 11  # IPv6 frontends: the set holds an endpoint on a node address (tc IPv6 path)


class BackendFlag(IntEnum):
    LOCAL = 1 << 0
    TERMINATING = 1 << 1
    HOST = 1 << 2  # the address is one of this node's own: delivered to the node's stack


class MemberFlag(IntEnum):
    CLUSTER = 1 << 0
    LOCAL = 1 << 1


class ConfigFlag(IntEnum):
    LOCAL_BY_SRC = 1 << 0  # the local-traffic detector by source (ClusterCIDR, NodeCIDR)
    HOST_LEGACY = 1 << 1  # --bpf-host-routing=legacy


class SockFlag(IntEnum):
    HOST_ONLY = 1 << 0


class CtDir(IntEnum):
    FORWARD = 0
    REPLY = 1


class CtFlag(IntEnum):
    SNAT = 1 << 0
    SEEN_REPLY = 1 << 1
    ESTABLISHED = 1 << 2
    FIN_FWD = 1 << 3
    FIN_REPLY = 1 << 4
    RST = 1 << 5
    MIGRATED = 1 << 6
    ADOPTED = 1 << 7
    ORPHAN = 1 << 8  # TCP: the backend left every Service; only its packets renew the flow
    HOST = 1 << 9  # the backend is this node's own address (BackendFlag.HOST)
    HANDOVER = 1 << 10  # ADOPTED, the kernel's NAT entry being replaced: forward packets drop
    NFPASS = 1 << 11  # ADOPTED, still nf_conntrack's (its NAT entry translates): packets pass untranslated


CT_HANDOVER_S = 10  # EKP_CT_HANDOVER_S: CtFlag.NFPASS, HANDOVER hold at most this long after created_s


class CtqRing(IntEnum):
    """Index of a conntrack table's early-drop ring in ekp_ctqh."""

    TCP = 0
    ANY = 1


class HandoverMode(IntEnum):
    """enum ekp_handover_mode: a build's programs in front of an older generation's during an
    upgrade (agent/ebpf/handover.py)."""

    OFF = 0  # alone on its hooks
    PASS = 1  # every packet on to the older program
    MISS = 2  # a packet this build's conntrack has no flow for on to the older program


class AddrFlag(IntEnum):
    FRONTEND_EXTERNAL = 1 << 0  # 1 << Scope.EXTERNAL
    FRONTEND_INTERNAL = 1 << 1  # 1 << Scope.INTERNAL
    BACKEND = 1 << 2


FRAGHOLD_SLOTS = 8
FRAGHOLD_LEN = 1520
ACT_SLOTS = 1 << 16  # ekp_act_v2 (bpf/ekp_act.h); slot 0 is the armed flag, no endpoint's
ACT_SHIFT = 30  # a stamp is bpf_ktime_get_ns() >> ACT_SHIFT


class Stat(IntEnum):
    PACKETS = 0
    NEW_FLOWS = 1
    CT_FORWARD = 2
    CT_REPLY = 3
    SNAT = 4
    AFFINITY_HIT = 5
    PASS = 6
    CT_RELATED = 7
    EARLY_DROP = 8
    CT_REBUILT = 9
    PORT_REMAP = 10
    FRAGMENTS = 11
    DROP_MALFORMED = 12
    DROP_NO_ENDPOINTS = 13
    DROP_NO_LOCAL = 14
    DROP_NO_BACKEND = 15
    DROP_SOURCE_RANGE = 16
    DROP_FIB = 17
    DROP_SNAT_PORTS = 18
    DROP_CT_FULL = 19
    DROP_FRAG_NO_FIRST = 20
    DROP_NO_FLOW = 21
    DROP_BACKEND_GONE = 22
    DROP_ICMP_RATE = 23
    DROP_FRAG_NEEDED = 24
    # Since ekp_stats_v3 new counters go at the end, whatever their kind (drops are named DROP_*).
    FRAG_HELD = 25
    FRAG_RELEASED = 26
    EVICT_UNREPLIED = 27
    EVICT_UNASSURED = 28
    EVICT_CLOSED = 29
    TO_TC = 30  # outcome, XDP only: left to the tc program to carry out
    CT_RESUMED = 31  # mark: a TCP segment without conntrack resumed its flow on Maglev's backend
    SOCK_CALLS = 32
    SOCK_PASS = 33
    SOCK_TRANSLATED = 34
    SOCK_REVNAT = 35
    SOCK_DESTROYED = 36
    DROP_SPOOFED = 37
    DROP_HANDOVER = 38
    DROP_TUPLE_TAKEN = 39  # a new flow whose reply tuple another CPU's new flow took (ekp_ct_place)
    DROP_HOP_LIMIT = 40  # the tc IPv6 path's last hop, answered with a time exceeded


STAT_DROP_FIRST = Stat.DROP_MALFORMED
STAT_COUNT = 41
STAT_SLOTS = 64  # ekp_stats_v3's size: room for later counters without a new map
# The drop reasons, by name (a reason added later goes at the end of the enum, after other kinds).
DROPS: tuple[Stat, ...] = tuple(s for s in Stat if s.name.startswith("DROP_"))
# Every packet counts PACKETS and every connect()/sendmsg() the socket programs see counts
# SOCK_CALLS; each of them counts exactly one of OUTCOMES (bpf/ekp_stats.h, ekp_abi.h), so
# PACKETS + SOCK_CALLS == sum(OUTCOMES). The rest are marks.
CALLS: tuple[Stat, ...] = (Stat.PACKETS, Stat.SOCK_CALLS)
OUTCOMES: tuple[Stat, ...] = (
    Stat.PASS,
    Stat.NEW_FLOWS,
    Stat.CT_FORWARD,
    Stat.CT_REPLY,
    Stat.CT_RELATED,
    Stat.FRAG_HELD,
    Stat.TO_TC,
    Stat.SOCK_PASS,
    Stat.SOCK_TRANSLATED,
    *DROPS,
)
# Flows the early-drop queues deleted, by the state they were in (bpf/ekp_ctq.h).
EVICTIONS: dict[Stat, str] = {
    Stat.EVICT_UNREPLIED: "unreplied",
    Stat.EVICT_UNASSURED: "unassured",
    Stat.EVICT_CLOSED: "closed",
}


class _Struct(ctypes.Structure):
    """Equality and repr by field values, so planned entries compare with dumped ones."""

    def values(self) -> tuple[object, ...]:
        return tuple(
            tuple(v) if isinstance(v := getattr(self, name), ctypes.Array) else v
            for name, *_ in self._fields_
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Struct) and type(self) is type(other) and self.values() == other.values()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.values()))

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{name}={getattr(self, name)!r}" for name, *_ in self._fields_ if "pad" not in name
        )
        return f"{type(self).__name__}({inner})"


class FrontendKey(_Struct):
    _fields_ = [("addr", u32), ("port", u16), ("proto", u8), ("scope", u8)]


class Frontend(_Struct):
    _fields_ = [
        ("svc_id", u32),
        ("set_id", u32),
        ("count", u16),
        ("flags", u16),
        ("affinity_timeout", u32),
        ("rev_nat_id", u16),
        ("pad", u16),
    ]


# Positions of a Maglev table (bpf/ekp_abi.h EKP_MAGLEV_TABLE_SIZE): a prime, Cilium's default. The
# C is compiled with the configured size (-DEKP_MAGLEV_TABLE_SIZE); `maglev_value(m)` is the value
# type of a table of m positions, `Maglev` the default's (what the ABI probe checks).
MAGLEV_TABLE_SIZE = 16381


class MaglevKey(_Struct):
    _fields_ = [("set_id", u32)]


def maglev_value(m: int) -> type[_Struct]:
    """The value type of ekp_maglev for tables of `m` positions."""
    if m == MAGLEV_TABLE_SIZE:
        return Maglev
    return _maglev_types.setdefault(
        m, type(f"Maglev{m}", (_Struct,), {"_fields_": [("backend_id", u32 * m)]})
    )


class Maglev(_Struct):
    _fields_ = [("backend_id", u32 * MAGLEV_TABLE_SIZE)]


_maglev_types: dict[int, type[_Struct]] = {}


class SlotKey(_Struct):
    _fields_ = [("set_id", u32), ("slot", u32)]


class Slot(_Struct):
    _fields_ = [("backend_id", u32)]


class BackendKey(_Struct):
    _fields_ = [("id", u32)]


class Backend(_Struct):
    _fields_ = [("addr", u32), ("port", u16), ("proto", u8), ("flags", u8)]


class MemberKey(_Struct):
    _fields_ = [("svc_id", u32), ("backend_id", u32)]


class Member(_Struct):
    _fields_ = [("flags", u8), ("pad", u8 * 3)]


class RevNatKey(_Struct):
    _fields_ = [("id", u32)]


class RevNat(_Struct):
    _fields_ = [("addr", u32), ("port", u16), ("pad", u16)]


class CtKey(_Struct):
    _fields_ = [
        ("saddr", u32),
        ("daddr", u32),
        ("sport", u16),
        ("dport", u16),
        ("proto", u8),
        ("dir", u8),
        ("pad", u16),
    ]


class CtEntry(_Struct):
    _fields_ = [
        ("last_seen_ns", u64),
        ("nat_addr", u32),
        ("snat_addr", u32),
        ("fe_addr", u32),
        ("nat_port", u16),
        ("snat_port", u16),
        ("fe_port", u16),
        ("flags", u16),
        ("svc_id", u32),
        ("backend_id", u32),
        ("created_s", u32),
    ]


class FragKey(_Struct):
    _fields_ = [("saddr", u32), ("daddr", u32), ("id", u16), ("proto", u8), ("pad", u8)]


class Frag(_Struct):
    _fields_ = [("sport", u16), ("dport", u16), ("pad", u32)]


class HostNatKey(_Struct):
    _fields_ = [
        ("saddr", u32),
        ("daddr", u32),
        ("sport", u16),
        ("dport", u16),
        ("proto", u8),
        ("pad", u8),
        ("tag", u16),
    ]


class HostNat(_Struct):
    _fields_ = [("saddr", u32), ("sport", u16), ("pad", u16)]


class FragHoldKey(_Struct):
    _fields_ = [("saddr", u32), ("daddr", u32), ("id", u16), ("proto", u8), ("slot", u8)]


class FragHold(_Struct):
    _fields_ = [("ifindex", u32), ("len", u16), ("pad", u16), ("data", u8 * FRAGHOLD_LEN)]


class AddrKey(_Struct):
    _fields_ = [("addr", u32)]


class Addr(_Struct):
    _fields_ = [("flags", u8), ("pad", u8 * 3)]


class Act(_Struct):
    _fields_ = [("stamp", u32)]


class CtqSlot(_Struct):
    _fields_ = [
        ("saddr", u32),
        ("daddr", u32),
        ("sport", u16),
        ("dport", u16),
        ("proto", u8),
        ("dir", u8),
        ("pad", u16),
        ("created_s", u32),
    ]


class AffinityKey(_Struct):
    _fields_ = [("client", u32), ("svc_id", u32)]


class Affinity(_Struct):
    _fields_ = [("last_seen_ns", u64), ("backend_id", u32), ("pad", u32)]


class SrcRangeKey(_Struct):
    _fields_ = [("prefixlen", u32), ("rev_nat_id", u16), ("pad", u16), ("addr", u32)]


class SrcRange(_Struct):
    _fields_ = [("allow", u8), ("pad", u8 * 3)]


class ConfigSel(_Struct):
    _fields_ = [("slot", u32)]


class Handover(_Struct):
    _fields_ = [("mode", u32)]


class Config(_Struct):
    _fields_ = [
        ("node_addr", u32),
        ("snat_port_min", u16),
        ("snat_port_max", u16),
        ("tcp_established_s", u32),
        ("tcp_close_wait_s", u32),
        ("tcp_syn_s", u32),
        ("tcp_closed_s", u32),
        ("udp_s", u32),
        ("udp_stream_s", u32),
        ("icmp_rate", u32),
        ("icmp_burst", u32),
        ("local_net", u32),
        ("local_plen", u8),
        ("flags", u8),  # ConfigFlag; the byte that was local_by_src (0 or 1), bit 0 keeps its meaning
        ("tcp_orphan_s", u16),
    ]


class RateLimit(_Struct):
    _fields_ = [("last_ns", u64), ("tokens_ns", u64)]


class SockKey(_Struct):
    _fields_ = [("cookie", u64), ("addr", u32), ("port", u16), ("proto", u8), ("pad", u8)]


class SockNat(_Struct):
    _fields_ = [("fe_addr", u32), ("fe_port", u16), ("pad", u16), ("svc_id", u32), ("backend_id", u32)]


class SockConfig(_Struct):
    _fields_ = [("host_netns", u64), ("flags", u32), ("pad", u32)]


class Port(_Struct):
    """A pod port's bridge (ekp_port_v2, keyed by the port's ifindex; agent/ebpf/attach.py)."""

    _fields_ = [("bridge", u32)]


# ---- IPv6 pairs (bpf/ekp_abi.h): 16-byte addresses as `u32 * 4`, network order ---------------

Addr6 = u32 * 4


class Frontend6Key(_Struct):
    _fields_ = [("addr", Addr6), ("port", u16), ("proto", u8), ("scope", u8)]


class Backend6(_Struct):
    _fields_ = [("addr", Addr6), ("port", u16), ("proto", u8), ("flags", u8)]


class RevNat6(_Struct):
    _fields_ = [("addr", Addr6), ("port", u16), ("pad", u16)]


class Affinity6Key(_Struct):
    _fields_ = [("client", Addr6), ("svc_id", u32)]


class SrcRange6Key(_Struct):
    _fields_ = [("prefixlen", u32), ("rev_nat_id", u16), ("pad", u16), ("addr", Addr6)]


class Addr6Key(_Struct):
    _fields_ = [("addr", Addr6)]


class Sock6Key(_Struct):
    _fields_ = [("cookie", u64), ("addr", Addr6), ("port", u16), ("proto", u8), ("pad", u8), ("pad2", u32)]


class Sock6Nat(_Struct):
    _fields_ = [("fe_addr", Addr6), ("fe_port", u16), ("pad", u16), ("svc_id", u32), ("backend_id", u32)]


class HostNat6Key(_Struct):
    _fields_ = [
        ("saddr", Addr6),
        ("daddr", Addr6),
        ("sport", u16),
        ("dport", u16),
        ("proto", u8),
        ("pad", u8),
        ("tag", u16),
    ]


class HostNat6(_Struct):
    _fields_ = [("saddr", Addr6), ("sport", u16), ("pad", u16)]


class Ct6Key(_Struct):
    _fields_ = [
        ("saddr", Addr6),
        ("daddr", Addr6),
        ("sport", u16),
        ("dport", u16),
        ("proto", u8),
        ("dir", u8),
        ("pad", u16),
    ]


class Ct6Entry(_Struct):
    _fields_ = [
        ("last_seen_ns", u64),
        ("nat_addr", Addr6),
        ("snat_addr", Addr6),
        ("fe_addr", Addr6),
        ("nat_port", u16),
        ("snat_port", u16),
        ("fe_port", u16),
        ("flags", u16),
        ("svc_id", u32),
        ("backend_id", u32),
        ("created_s", u32),
        ("pad", u32),
    ]


class Ctq6Slot(_Struct):
    _fields_ = [
        ("saddr", Addr6),
        ("daddr", Addr6),
        ("sport", u16),
        ("dport", u16),
        ("proto", u8),
        ("dir", u8),
        ("pad", u16),
        ("created_s", u32),
    ]


class Config6(_Struct):
    _fields_ = [("node_addr", Addr6)]


class Frag6Key(_Struct):
    _fields_ = [("saddr", Addr6), ("daddr", Addr6), ("id", u32), ("proto", u8), ("pad", u8 * 3)]


class FragHold6Key(_Struct):
    _fields_ = [("saddr", Addr6), ("daddr", Addr6), ("id", u32), ("proto", u8), ("slot", u8), ("pad", u16)]


# Every struct of the header, by its C name; the ABI test walks this.
STRUCTS: dict[str, type[_Struct]] = {
    "ekp_frontend_key": FrontendKey,
    "ekp_frontend": Frontend,
    "ekp_maglev_key": MaglevKey,
    "ekp_maglev": Maglev,
    "ekp_slot_key": SlotKey,
    "ekp_slot": Slot,
    "ekp_backend_key": BackendKey,
    "ekp_backend": Backend,
    "ekp_member_key": MemberKey,
    "ekp_member": Member,
    "ekp_revnat_key": RevNatKey,
    "ekp_revnat": RevNat,
    "ekp_ct_key": CtKey,
    "ekp_ct_entry": CtEntry,
    "ekp_frag_key": FragKey,
    "ekp_frag": Frag,
    "ekp_fraghold_key": FragHoldKey,
    "ekp_fraghold": FragHold,
    "ekp_addr_key": AddrKey,
    "ekp_addr": Addr,
    "ekp_act": Act,
    "ekp_ctq_slot": CtqSlot,
    "ekp_hostnat_key": HostNatKey,
    "ekp_hostnat": HostNat,
    "ekp_hostnat6_key": HostNat6Key,
    "ekp_hostnat6": HostNat6,
    "ekp_affinity_key": AffinityKey,
    "ekp_affinity": Affinity,
    "ekp_srcrange_key": SrcRangeKey,
    "ekp_srcrange": SrcRange,
    "ekp_config_sel": ConfigSel,
    "ekp_config": Config,
    "ekp_ratelimit": RateLimit,
    "ekp_sock_key": SockKey,
    "ekp_sock_nat": SockNat,
    "ekp_sock_config": SockConfig,
    "ekp_port": Port,
    "ekp_frontend6_key": Frontend6Key,
    "ekp_backend6": Backend6,
    "ekp_revnat6": RevNat6,
    "ekp_affinity6_key": Affinity6Key,
    "ekp_srcrange6_key": SrcRange6Key,
    "ekp_addr6_key": Addr6Key,
    "ekp_sock6_key": Sock6Key,
    "ekp_sock6_nat": Sock6Nat,
    "ekp_ct6_key": Ct6Key,
    "ekp_ct6_entry": Ct6Entry,
    "ekp_config6": Config6,
    "ekp_ctq6_slot": Ctq6Slot,
    "ekp_frag6_key": Frag6Key,
    "ekp_fraghold6_key": FragHold6Key,
    "ekp_handover": Handover,
}


class Writer(StrEnum):
    AGENT = "agent"  # the planner (service tables) or the proxier (config)
    DATAPATH = "datapath"  # the programs: flow state, rate limiter, counters


@dataclass(frozen=True)
class MapSpec:
    """One BPF map: its kernel name (version included), kind, layout, default size and writer."""

    role: str  # short name used in code and the inspect command
    kind: str  # bcc table type: hash, lru_hash, array, percpu_array, lpm_trie
    key: type[ctypes.Structure] | type[ctypes.c_uint32]
    value: type[ctypes.Structure] | type[ctypes.c_uint64]
    default_size: int  # 0: derived at start (the conntrack tables, agent/config.py MapSizes)
    size_macro: str  # the -D macro the C side reads the size from
    writer: Writer = Writer.AGENT
    flag: str = ""  # the agent flag that sets the size, when there is one
    # ABI_VERSION unless this map's layout changed alone (ekp_stats_v3), or an older layout's map
    # is described (agent/ebpf/upgrade.py)
    version: int = ABI_VERSION
    # the IPv4 map this one is the IPv6 twin of (Cilium's v4/v6 pairs): sized by its flag
    pair: str = ""

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.role}_v{self.version}"

    @property
    def sized_by(self) -> str:
        """The role whose size setting (agent/config.py MapSizes) this map takes."""
        return self.pair or self.role

    @property
    def size_flag(self) -> str:
        if self.pair:
            return MAPS[self.pair].size_flag
        return self.flag or f"--bpf-{self.role}-max"


_DP = Writer.DATAPATH

MAPS: dict[str, MapSpec] = {
    spec.role: spec
    for spec in (
        MapSpec("fe", "hash", FrontendKey, Frontend, 65536, "EKP_FE_MAX"),
        MapSpec("slot", "hash", SlotKey, Slot, 262144, "EKP_SLOT_MAX"),
        MapSpec("be", "hash", BackendKey, Backend, 262144, "EKP_BE_MAX"),
        MapSpec("rnat", "hash", RevNatKey, RevNat, 65536, "EKP_RNAT_MAX"),
        MapSpec("member", "hash", MemberKey, Member, 262144, "EKP_MEMBER_MAX"),
        MapSpec("srcr", "lpm_trie", SrcRangeKey, SrcRange, 16384, "EKP_SRCR_MAX"),
        MapSpec("cfg", "array", ctypes.c_uint32, Config, 2, "EKP_CFG_MAX"),
        MapSpec("cfgsel", "array", ctypes.c_uint32, ConfigSel, 1, "EKP_CFGSEL_MAX"),
        MapSpec("addr", "hash", AddrKey, Addr, 262144, "EKP_ADDR_MAX"),
        # one table per backend set of a Maglev frontend, allocated as written (64 KiB each)
        MapSpec("maglev", "hash", MaglevKey, Maglev, 16384, "EKP_MAGLEV_MAX"),
        MapSpec("ct_tcp", "lru_hash", CtKey, CtEntry, 0, "EKP_CT_TCP_MAX", _DP, "--bpf-ct-global-tcp-max"),
        MapSpec("ct_any", "lru_hash", CtKey, CtEntry, 0, "EKP_CT_ANY_MAX", _DP, "--bpf-ct-global-any-max"),
        # v3 with their heads: a ring is one head's, and an older generation's programs, attached
        # until ours replace them, go on queuing at their v2 head's position in their v2 ring
        MapSpec("ctq_tcp", "array", ctypes.c_uint32, CtqSlot, 0, "EKP_CTQ_TCP_MAX", _DP, version=3),
        MapSpec("ctq_any", "array", ctypes.c_uint32, CtqSlot, 0, "EKP_CTQ_ANY_MAX", _DP, version=3),
        # v3: position high, count low (bpf/ekp_abi.h), the other way round from v2
        MapSpec("ctqh", "array", ctypes.c_uint32, ctypes.c_uint64, 2, "EKP_CTQH_MAX", _DP, version=3),
        MapSpec("frag", "lru_hash", FragKey, Frag, 8192, "EKP_FRAG_MAX", _DP),
        MapSpec("fraghold", "lru_hash", FragHoldKey, FragHold, 1024, "EKP_FRAGHOLD_MAX", _DP),
        MapSpec("fraglast", "array", ctypes.c_uint32, ctypes.c_uint64, 1, "EKP_FRAGLAST_MAX", _DP),
        MapSpec("aff", "lru_hash", AffinityKey, Affinity, 65536, "EKP_AFF_MAX", _DP),
        MapSpec("hostnat", "lru_hash", HostNatKey, HostNat, 65536, "EKP_HOSTNAT_MAX", _DP),
        MapSpec("act", "array", ctypes.c_uint32, Act, ACT_SLOTS, "EKP_ACT_MAX", _DP),
        MapSpec("icmprl", "percpu_array", ctypes.c_uint32, RateLimit, 1, "EKP_ICMPRL_MAX", _DP),
        # v3: 64 slots (v2 had exactly its 25 counters, so a counter added grew the map)
        MapSpec(
            "stats",
            "percpu_array",
            ctypes.c_uint32,
            ctypes.c_uint64,
            STAT_SLOTS,
            "EKP_STATS_MAX",
            _DP,
            version=3,
        ),
        # the XDP program's counters, the same slots as ekp_stats_v3
        MapSpec(
            "xstats",
            "percpu_array",
            ctypes.c_uint32,
            ctypes.c_uint64,
            STAT_SLOTS,
            "EKP_XSTATS_MAX",
            _DP,
            version=3,
        ),
        MapSpec("skcfg", "array", ctypes.c_uint32, SockConfig, 1, "EKP_SKCFG_MAX"),
        # a pod port's bridge by the port's ifindex (the attacher's; allocated as written)
        MapSpec("port", "hash", ctypes.c_uint32, Port, 16384, "EKP_PORT_MAX"),
        MapSpec("sknat", "lru_hash", SockKey, SockNat, 65536, "EKP_SKNAT_MAX", _DP),
        # IPv6 twins (bpf/ekp_abi.h "IPv6 pairs"), each sized as its IPv4 map (`pair`): the service
        # maps of the IPv6 planner (`V6_ROLES`), the affinity and socket tables of the data path
        MapSpec("fe6", "hash", Frontend6Key, Frontend, 65536, "EKP_FE6_MAX", pair="fe"),
        MapSpec("slot6", "hash", SlotKey, Slot, 262144, "EKP_SLOT6_MAX", pair="slot"),
        MapSpec("be6", "hash", BackendKey, Backend6, 262144, "EKP_BE6_MAX", pair="be"),
        MapSpec("rnat6", "hash", RevNatKey, RevNat6, 65536, "EKP_RNAT6_MAX", pair="rnat"),
        MapSpec("member6", "hash", MemberKey, Member, 262144, "EKP_MEMBER6_MAX", pair="member"),
        MapSpec("srcr6", "lpm_trie", SrcRange6Key, SrcRange, 16384, "EKP_SRCR6_MAX", pair="srcr"),
        MapSpec("addr6", "hash", Addr6Key, Addr, 262144, "EKP_ADDR6_MAX", pair="addr"),
        MapSpec("aff6", "lru_hash", Affinity6Key, Affinity, 65536, "EKP_AFF6_MAX", _DP, pair="aff"),
        MapSpec("sknat6", "lru_hash", Sock6Key, Sock6Nat, 65536, "EKP_SKNAT6_MAX", _DP, pair="sknat"),
        # the tc programs' IPv6 conntrack (bpf/ekp_tc6.h), each sized as its IPv4 twin where that
        # path serves (one entry where not, agent/ebpf/loader.py TC6_ROLES);
        # v3: IPv4's entry field for field (v2's entries had no SNAT fields: that path left source
        # translations to ip6tables)
        MapSpec("ct6_tcp", "lru_hash", Ct6Key, Ct6Entry, 0, "EKP_CT6_TCP_MAX", _DP, version=3, pair="ct_tcp"),
        MapSpec("ct6_any", "lru_hash", Ct6Key, Ct6Entry, 0, "EKP_CT6_ANY_MAX", _DP, version=3, pair="ct_any"),
        # their early-drop rings, sized from the table as IPv4's (CT_QUEUES), and where each writes
        MapSpec("ctq6_tcp", "array", ctypes.c_uint32, Ctq6Slot, 0, "EKP_CTQ6_TCP_MAX", _DP, version=3),
        MapSpec("ctq6_any", "array", ctypes.c_uint32, Ctq6Slot, 0, "EKP_CTQ6_ANY_MAX", _DP, version=3),
        MapSpec("ctqh6", "array", ctypes.c_uint32, ctypes.c_uint64, 2, "EKP_CTQH6_MAX", _DP, version=3),
        # the IPv6 path's settings: the node's IPv6 address, the source of its SNAT (written by the
        # IPv6 family's sync, agent/ebpf/family6.py), two slots and a selector as cfg / cfgsel
        MapSpec("cfg6", "array", ctypes.c_uint32, Config6, 2, "EKP_CFG6_MAX"),
        MapSpec("cfg6sel", "array", ctypes.c_uint32, ConfigSel, 1, "EKP_CFG6SEL_MAX"),
        # the tc IPv6 path's fragments (bpf/ekp_frag6.h), sized as IPv4's where that path serves
        MapSpec("frag6", "lru_hash", Frag6Key, Frag, 8192, "EKP_FRAG6_MAX", _DP, pair="frag"),
        MapSpec("frhold6", "lru_hash", FragHold6Key, FragHold, 1024, "EKP_FRHOLD6_MAX", _DP, pair="fraghold"),
        # legacy host routing's egress sources for IPv6 (bpf/ekp_host6.h), sized as IPv4's where
        # the tc IPv6 path serves (one entry where not, as its conntrack tables)
        MapSpec(
            "hostnat6", "lru_hash", HostNat6Key, HostNat6, 65536, "EKP_HOSTNAT6_MAX", _DP, pair="hostnat"
        ),
    )
}

# The IPv6 service map of each IPv4 one the planner writes (the IPv6 planner's maps).
V6_ROLES: dict[str, str] = {
    spec.pair: spec.role for spec in MAPS.values() if spec.pair and spec.writer is Writer.AGENT
}

# The early-drop ring of each conntrack table, and how it is sized: a ring of N slots lets at most
# N flows be unassured or closed (2 N entries), half the table (bpf/ekp_ctq.h).
CT_QUEUES = {"ct_tcp": "ctq_tcp", "ct_any": "ctq_any", "ct6_tcp": "ctq6_tcp", "ct6_any": "ctq6_any"}
CTQ_DIVISOR = 4  # ring slots = table entries / 4
# The head map each ring's position and slot count are in (ekp_ctqh*[CtqRing]), by its table.
CTQ_HEADS = {"ct_tcp": "ctqh", "ct_any": "ctqh", "ct6_tcp": "ctqh6", "ct6_any": "ctqh6"}
# An ekp_ctqh entry: position in the high 32 bits, slot count in the low ones (bpf/ekp_abi.h).
CTQH_POS_SHIFT = 32
CTQH_SLOTS_MASK = (1 << CTQH_POS_SHIFT) - 1

# The conntrack tables, by protocol: TCP flows in ct_tcp, every other protocol in ct_any.
CT_ROLES = ("ct_tcp", "ct_any")
CT6_ROLES = ("ct6_tcp", "ct6_any")  # the tc IPv6 path's (bpf/ekp_tc6.h)


def ct_role(proto: int) -> str:
    """The conntrack table that holds flows of IP protocol `proto`."""
    return "ct_tcp" if proto == socket.IPPROTO_TCP else "ct_any"


# Names fit the kernel's BPF_OBJ_NAME_LEN (16 with the NUL).
assert all(len(s.name) <= 15 for s in MAPS.values())
