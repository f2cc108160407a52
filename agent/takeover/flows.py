"""Established service flows, moved between the kernel's conntrack and the eBPF conntrack (pure).

A node switching data paths (kube-proxy or iptables mode -> eBPF mode, and back) has flows that
the data path going away translated. The one coming in must translate them the same way (same
backend, same SNAT source), or every established connection through a Service breaks: eBPF mode
drops a mid-flow TCP segment it has no conntrack entry for (`NO_FLOW`), and netfilter would send
it through the Service's rules again, to a random backend. Both tables hold the same facts, so a
flow is carried by rewriting one table's entry into the other's layout:

  nf_conntrack (one entry, two tuples)          eBPF conntrack (two entries, agent/ebpf/abi.py)
    original  client:cport -> frontend:fport      FORWARD {client, frontend, cport, fport}
    reply     backend:bport -> snat:sport           -> backend:bport (+ SNAT source snat:sport)
              (snat:sport = client:cport when      REPLY   {backend, snat, bport, sport}
               the source was not translated)        -> frontend:fport (+ client:cport if SNAT)

`NatFlow` is the kernel's view, `ebpf_entries` turns it into the two eBPF entries and `nat_flow`
turns an eBPF FORWARD entry back into it. Which flows are carried:

* kernel -> eBPF: entries whose original destination is a frontend the eBPF maps hold (any scope:
  conntrack does not know the device a flow came in on), destination-translated (DST_NAT), not
  closed (TIME_WAIT, CLOSE), and whose client is not the node itself: a host-network client's
  replies leave through the node's own stack, which the tc programs do not serve (its flow keeps
  using the kernel's NAT binding, which outlives the rules). A UDP flow whose backend is no longer
  a backend of the maps is left behind, as kube-proxy clears such entries; a TCP flow keeps its
  backend, known or not, as it would under kube-proxy.
* eBPF -> kernel: FORWARD entries not expired and not closed (a RST, FINs both ways).

A carried flow whose backend is one of the node's own addresses (`host_backend`: the `kubernetes`
Service on a control-plane node) carries CtFlag.HOST, as the data path sets it for a new flow to a
BackendFlag.HOST backend: its packets are rewritten and handed to the node's stack, which delivers
them locally; without it the data path would route them to a local address and drop them.

With legacy host routing (--bpf-host-routing=legacy, bpf/ekp_host.h) the node's stack sees every
packet of an eBPF flow between its two translations, as client:cport <-> backend:bport with real
addresses both ways (`stack_flow`), and nf_conntrack tracks it as that plain flow. So it does for a
host-backend flow under either host routing (the stack delivers it). Until its NAT entry is
replaced (below), the data path passes such a flow's packets untranslated (CtFlag.NFPASS), so
that entry goes on translating them as before the attach; while the agent replaces it, the data
path drops its forward packets (CtFlag.HANDOVER, for one ctnetlink send(2); the sender
retransmits): the stack must not see them translated. Its reply tuple
is the reply tuple of the flow's NAT entry whenever the source was not translated, and the kernel
holds one entry per tuple: while the NAT entry is there, the stack's NAT gives the plain flow's
packets another source port (its null binding finds the reply tuple taken), and the backend resets
the stranger; while the plain entry is there, ctnetlink refuses the NAT entry. So each side
replaces the other's entry (agent/takeover/into_ebpf.py, out_of_ebpf.py).

State is carried as far as the other table can hold it: an established TCP flow stays
established (the long timeout), a flow with one FIN stays half-closed, a UDP flow that was
replied stays replied (a stream when the kernel had it assured).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum

from agent.ebpf.abi import (
    Addr6,
    Ct6Entry,
    Ct6Key,
    CtDir,
    CtEntry,
    CtFlag,
    CtKey,
    ip6_str,
    ip6_words,
    ip_be,
    ip_str,
    port_be,
    port_host,
)

TCP, UDP, SCTP = 6, 17, 132
NSEC = 1_000_000_000
# How often the flows held for the node's stack (CtFlag.NFPASS, HANDOVER), into eBPF mode
# (into_ebpf.py) and out of it (out_of_ebpf.py), get their hold again (EKP_CT_HANDOVER_S from
# created_s, which counts whole seconds): well inside it, so that a pass over thousands of entries,
# itself slow on a starved agent, ends before the hold does.
HOLD_RENEW_NS = 3 * NSEC

# nf_conntrack's status bits (include/uapi/linux/netfilter/nf_conntrack_common.h).
IPS_SEEN_REPLY = 1 << 1
IPS_ASSURED = 1 << 2
IPS_CONFIRMED = 1 << 3
IPS_SRC_NAT = 1 << 4
IPS_DST_NAT = 1 << 5
IPS_SRC_NAT_DONE = 1 << 7
IPS_DST_NAT_DONE = 1 << 8


class TcpState(IntEnum):
    """nf_conntrack's TCP states (enum tcp_conntrack)."""

    NONE = 0
    SYN_SENT = 1
    SYN_RECV = 2
    ESTABLISHED = 3
    FIN_WAIT = 4
    CLOSE_WAIT = 5
    LAST_ACK = 6
    TIME_WAIT = 7
    CLOSE = 8
    SYN_SENT2 = 9


class SctpState(IntEnum):
    """nf_conntrack's SCTP states (enum sctp_conntrack)."""

    NONE = 0
    CLOSED = 1
    COOKIE_WAIT = 2
    COOKIE_ECHOED = 3
    ESTABLISHED = 4
    SHUTDOWN_SENT = 5
    SHUTDOWN_RECD = 6
    SHUTDOWN_ACK_SENT = 7


HALF_CLOSED = (TcpState.FIN_WAIT, TcpState.CLOSE_WAIT, TcpState.LAST_ACK)
ENDED = (TcpState.TIME_WAIT, TcpState.CLOSE)

Tuple = tuple[str, str, int, int]  # source, destination, source port, destination port
Ident = tuple[str, int, int]  # address, port, protocol


@dataclass(frozen=True)
class NatFlow:
    """One flow as nf_conntrack holds it: the original tuple, the reply tuple, the state."""

    proto: int
    orig: Tuple
    reply: Tuple
    status: int = IPS_SEEN_REPLY | IPS_ASSURED
    tcp_state: TcpState = TcpState.ESTABLISHED
    # SCTP: the state and the verification tags each direction's packets carry (original, reply),
    # which the kernel checks on every chunk but INIT: an entry it is given must have them
    sctp_state: int = 0
    vtags: tuple[int, int] = (0, 0)

    @property
    def family(self) -> int:
        """4 or 6: the tc programs' IPv6 path's flows are handed back too (nat_flow)."""
        return 6 if ":" in self.orig[0] else 4

    @property
    def dnat(self) -> bool:
        """The destination was translated: the reply comes from elsewhere than it was sent to."""
        return (self.reply[0], self.reply[2]) != (self.orig[1], self.orig[3])

    @property
    def snat(self) -> bool:
        """The source was translated: the reply goes elsewhere than the client."""
        return (self.reply[1], self.reply[3]) != (self.orig[0], self.orig[2])

    def describe(self) -> str:
        s, d, sp, dp = self.orig
        rs, rd, rsp, rdp = self.reply
        proto = {TCP: "tcp", UDP: "udp", SCTP: "sctp"}.get(self.proto, str(self.proto))
        return f"{proto} {s}:{sp} -> {d}:{dp} (backend {rs}:{rsp}, reply to {rd}:{rdp})"


@dataclass(frozen=True)
class EbpfIds:
    """What the eBPF maps hold, for naming a carried flow's service port and backend."""

    services: Mapping[Ident, int]  # frontend (address, port, protocol) -> svc_id
    backends: Mapping[Ident, int]  # backend (address, port, protocol) -> backend id


class Skip(IntEnum):
    """Why a kernel flow is not carried into eBPF conntrack (counted in the log)."""

    NOT_A_SERVICE = 0  # no DNAT, or its destination is no frontend of ours
    ENDED = 1  # TIME_WAIT / CLOSE
    NODE_CLIENT = 2  # the node itself is the client (host network)
    BACKEND_GONE = 3  # UDP, the backend left the Service
    PROTOCOL = 4  # neither TCP, UDP nor SCTP


def host_backend(flow: NatFlow, node_addresses: Collection[str]) -> bool:
    """The flow's backend is on one of the node's own addresses (a host-network endpoint: the API
    server behind `kubernetes` on a control-plane node): eBPF mode hands its packets to the node's
    stack (CtFlag.HOST), where a route lookup would only say "local" and drop them."""
    return flow.reply[0] in node_addresses


def ebpf_flags(flow: NatFlow, *, host: bool = False, nfpass: bool = False) -> int:
    """eBPF flow state (CtFlag) for the kernel's; `host`: the backend is the node's own address;
    `nfpass`: the flow meets the node's stack (legacy host routing, or `host`), whose NAT entry
    goes on translating it until the agent replaced that entry (module doc)."""
    flags = CtFlag.HOST if host else 0
    if nfpass:
        flags |= CtFlag.NFPASS
    if flow.snat:
        flags |= CtFlag.SNAT
    if flow.status & IPS_SEEN_REPLY:
        flags |= CtFlag.SEEN_REPLY
    if flow.proto == TCP:
        if flow.tcp_state in (TcpState.ESTABLISHED, *HALF_CLOSED):
            flags |= CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED
        if flow.tcp_state in HALF_CLOSED:
            flags |= CtFlag.FIN_FWD  # one FIN: the close-wait timeout, as the kernel gives it
    elif flow.status & IPS_ASSURED:
        flags |= CtFlag.ESTABLISHED
    return flags | CtFlag.ADOPTED


def why_not_carried(flow: NatFlow, ids: EbpfIds, node_addresses: Collection[str]) -> Skip | None:
    """None when `flow` is carried into eBPF conntrack, else why not (module doc)."""
    if flow.proto not in (TCP, UDP, SCTP):
        return Skip.PROTOCOL
    if not flow.dnat or (flow.orig[1], flow.orig[3], flow.proto) not in ids.services:
        return Skip.NOT_A_SERVICE
    if (flow.proto == TCP and flow.tcp_state in ENDED) or (
        flow.proto == SCTP and flow.sctp_state == SctpState.CLOSED
    ):
        return Skip.ENDED
    if flow.orig[0] in node_addresses:
        return Skip.NODE_CLIENT
    if flow.proto == UDP and (flow.reply[0], flow.reply[2], flow.proto) not in ids.backends:
        return Skip.BACKEND_GONE
    return None


def ct_keys(flow: NatFlow) -> tuple[CtKey, CtKey]:
    """The keys of a carried flow's FORWARD and REPLY entries."""

    def key(tuple_: Tuple, direction: CtDir) -> CtKey:
        s, d, sp, dp = tuple_
        return CtKey(
            saddr=ip_be(s),
            daddr=ip_be(d),
            sport=port_be(sp),
            dport=port_be(dp),
            proto=flow.proto,
            dir=direction,
        )

    return key(flow.orig, CtDir.FORWARD), key(flow.reply, CtDir.REPLY)


def ebpf_entries(
    flow: NatFlow, ids: EbpfIds, now_ns: int, *, host: bool = False, nfpass: bool = False
) -> list[tuple[CtKey, CtEntry]]:
    """The FORWARD and REPLY entries of a carried flow (check `why_not_carried` first); `host`:
    its backend is the node's own address (`host_backend`); `nfpass`: it meets the node's stack
    (`ebpf_flags`)."""
    s, d, sp, dp = flow.orig
    rs, rd, rsp, rdp = flow.reply
    snat = flow.snat
    forward_key, reply_key = ct_keys(flow)
    common = {
        "last_seen_ns": now_ns,
        "fe_addr": ip_be(d),
        "fe_port": port_be(dp),
        "flags": ebpf_flags(flow, host=host, nfpass=nfpass),
        "svc_id": ids.services.get((d, dp, flow.proto), 0),
        "backend_id": ids.backends.get((rs, rsp, flow.proto), 0),
        "created_s": now_ns // NSEC,
    }
    forward = CtEntry(
        nat_addr=ip_be(rs),
        nat_port=port_be(rsp),
        snat_addr=ip_be(rd) if snat else 0,
        snat_port=port_be(rdp) if snat else 0,
        **common,
    )
    reply = CtEntry(
        nat_addr=ip_be(s) if snat else 0,
        nat_port=port_be(sp) if snat else 0,
        snat_addr=0,
        snat_port=0,
        **common,
    )
    return [(reply_key, reply), (forward_key, forward)]  # the REPLY entry first, as the data path


def ct6_keys(flow: NatFlow) -> tuple[Ct6Key, Ct6Key]:
    """The keys of an IPv6 flow's FORWARD and REPLY entries in the tc IPv6 path's conntrack."""

    def key(tuple_: Tuple, direction: CtDir) -> Ct6Key:
        a, b, ap, bp = tuple_
        return Ct6Key(
            Addr6(*ip6_words(a)), Addr6(*ip6_words(b)), port_be(ap), port_be(bp), flow.proto, direction
        )

    return key(flow.orig, CtDir.FORWARD), key(flow.reply, CtDir.REPLY)


def ebpf_entries6(flow: NatFlow, ids: EbpfIds, now_ns: int) -> list[tuple[Ct6Key, Ct6Entry]]:
    """The FORWARD and REPLY entries of an IPv6 flow carried into the tc IPv6 path's conntrack
    (ekp_ct6_*: `ebpf_entries`' fields at 16 bytes; `ids` those of the IPv6 maps). Never NFPASS nor
    HOST: the IPv6 path has no NFPASS hand-over (bpf/ekp_tc6.h), so flows to a host backend are
    not carried (agent/takeover/into_ebpf.py, _carry6), and the NAT entries of those that meet the
    node's stack are replaced after the attach without a hold (into_ebpf.py, _to_stack6)."""
    s, d, sp, dp = flow.orig
    rs, rd, rsp, rdp = flow.reply
    snat = flow.snat
    zero = Addr6()
    forward_key, reply_key = ct6_keys(flow)
    common = {
        "last_seen_ns": now_ns,
        "fe_addr": Addr6(*ip6_words(d)),
        "fe_port": port_be(dp),
        "flags": ebpf_flags(flow),
        "svc_id": ids.services.get((d, dp, flow.proto), 0),
        "backend_id": ids.backends.get((rs, rsp, flow.proto), 0),
        "created_s": now_ns // NSEC,
    }
    forward = Ct6Entry(
        nat_addr=Addr6(*ip6_words(rs)),
        nat_port=port_be(rsp),
        snat_addr=Addr6(*ip6_words(rd)) if snat else zero,
        snat_port=port_be(rdp) if snat else 0,
        **common,
    )
    reply = Ct6Entry(
        nat_addr=Addr6(*ip6_words(s)) if snat else zero,
        nat_port=port_be(sp) if snat else 0,
        snat_addr=zero,
        snat_port=0,
        **common,
    )
    return [(reply_key, reply), (forward_key, forward)]


def stack_flow(flow: NatFlow) -> NatFlow:
    """`flow` as the node's stack tracks it under legacy host routing: client <-> backend, no
    translation (module doc), in the same state."""
    s, _, sp, _ = flow.orig
    backend, bport = flow.reply[0], flow.reply[2]
    return NatFlow(
        proto=flow.proto,
        orig=(s, backend, sp, bport),
        reply=(backend, s, bport, sp),
        status=flow.status,
        tcp_state=flow.tcp_state,
        sctp_state=flow.sctp_state,
        vtags=flow.vtags,
    )


@dataclass(frozen=True)
class Timeouts:
    """Seconds an exported flow lives in nf_conntrack without traffic (the node's own timeouts
    take over at its next packet)."""

    tcp_established: int = 86400
    tcp_close_wait: int = 3600
    tcp_syn: int = 60
    udp: int = 30
    udp_stream: int = 120
    sctp_established: int = 210  # nf_conntrack_sctp_timeout_established


def ebpf_closed(flags: int) -> bool:
    """A RST, or FINs both ways (ekp_ct_closed)."""
    both = CtFlag.FIN_FWD | CtFlag.FIN_REPLY
    return bool(flags & CtFlag.RST) or flags & both == both


def nat_flow(key: CtKey | Ct6Key, entry: CtEntry | Ct6Entry) -> NatFlow | None:
    """The kernel's view of an eBPF FORWARD entry, IPv4's or the tc IPv6 path's (the same fields,
    16-byte addresses); None for a REPLY entry, a closed flow or a protocol the kernel entry cannot
    be made for (SCTP: the eBPF conntrack does not keep the verification tags the kernel would
    check every chunk against)."""
    if key.dir != CtDir.FORWARD or key.proto not in (TCP, UDP) or ebpf_closed(entry.flags):
        return None
    snat = bool(entry.flags & CtFlag.SNAT)
    text = ip6_str if isinstance(key, Ct6Key) else ip_str
    orig = (text(key.saddr), text(key.daddr), port_host(key.sport), port_host(key.dport))
    reply = (
        text(entry.nat_addr),
        text(entry.snat_addr) if snat else orig[0],
        port_host(entry.nat_port),
        port_host(entry.snat_port) if snat else orig[2],
    )
    status = 0
    if entry.flags & CtFlag.SEEN_REPLY:
        status |= IPS_SEEN_REPLY
    if entry.flags & CtFlag.ESTABLISHED:
        status |= IPS_ASSURED
    state = TcpState.NONE
    if key.proto == TCP:
        if entry.flags & (CtFlag.FIN_FWD | CtFlag.FIN_REPLY):
            state = TcpState.CLOSE_WAIT
        elif entry.flags & CtFlag.ESTABLISHED:
            state = TcpState.ESTABLISHED
        else:
            state = TcpState.SYN_RECV if entry.flags & CtFlag.SEEN_REPLY else TcpState.SYN_SENT
    return NatFlow(proto=key.proto, orig=orig, reply=reply, status=status, tcp_state=state)


def masqueraded_into(flows: Iterable[NatFlow], ports: tuple[int, int], to: str) -> list[NatFlow]:
    """The TCP and UDP flows among `flows` whose source nf_nat translated to address `to` and a port of
    `ports` (the reply comes back to that address and port): ip6tables' masquerades whose reply
    tuple a tc flow source-translated to `to` (the node's IPv6 SNAT address) with a port of
    --bpf-snat-ports could take. A flow masqueraded to another address, or outside the range,
    never can (the tc path's reply tuples all end at `to`, in the range)."""
    lo, hi = ports
    node = ipaddress.ip_address(to)
    return [
        f
        for f in flows
        if f.proto in (TCP, UDP)
        and f.snat
        and lo <= f.reply[3] <= hi
        and ipaddress.ip_address(f.reply[1]) == node
    ]


def timeout_of(flow: NatFlow, timeouts: Timeouts) -> int:
    """The timeout an exported flow gets in nf_conntrack, from its state."""
    if flow.proto == TCP:
        if flow.tcp_state == TcpState.ESTABLISHED:
            return timeouts.tcp_established
        if flow.tcp_state in HALF_CLOSED:
            return timeouts.tcp_close_wait
        return timeouts.tcp_syn
    if flow.proto == SCTP and flow.sctp_state == SctpState.ESTABLISHED:
        return timeouts.sctp_established
    return timeouts.udp_stream if flow.status & IPS_ASSURED else timeouts.udp


def kernel_status(flow: NatFlow) -> int:
    """CTA_STATUS of a created entry: its state, and the NAT bits of the translations it carries
    (ctnetlink refuses a status that differs from what its NAT setup set, and CONFIRMED, which it
    sets before reading the status)."""
    status = IPS_CONFIRMED | (flow.status & (IPS_SEEN_REPLY | IPS_ASSURED))
    if flow.dnat:
        status |= IPS_DST_NAT | IPS_DST_NAT_DONE
    if flow.snat:
        status |= IPS_SRC_NAT | IPS_SRC_NAT_DONE
    return status
