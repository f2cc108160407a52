"""nf_conntrack through ctnetlink (pyroute2), in the namespace the agent programs.

`dump_flows` lists the IPv4 TCP, UDP and SCTP entries as `NatFlow`s; `create_flows` writes flows as new
entries with their NAT bindings, so netfilter goes on translating them as the eBPF programs did;
`delete_flows` removes entries by tuple; `replace_flows` replaces entries one by one.
ctnetlink sets a created entry's NAT up from CTA_NAT_DST / CTA_NAT_SRC applied to the inverse of
the original tuple (an entry given its translated reply tuple directly holds no NAT status bit,
and the kernel would not rewrite its packets); a TCP entry is window-liberal (below). Each call
joins `netns` on a short-lived thread (agent/netns.py), where the netlink socket is opened and
used.

Measured here (Linux 6.18, pyroute2 0.9.7): a dump costs about 0.3 ms per entry it returns (the
kernel filters on DST_NAT: 20 translated entries among 2,020 dumped in 21 ms), a create about
2 ms per entry, both mostly pyroute2's own per-message work.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pyroute2.netlink import (
    NETLINK_NETFILTER,
    NLMSG_ERROR,
)
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.nfnetlink.nfctsocket import (
    NFCTAttrTuple,
    NFCTSocket,
)

from agent.netns import netns_route, run_in_netns
from agent.takeover import ctmsg
from agent.takeover.flows import (
    IPS_DST_NAT,
    IPS_SRC_NAT,
    SCTP,
    TCP,
    UDP,
    NatFlow,
    TcpState,
    Timeouts,
    Tuple,
    kernel_status,
    timeout_of,
)

log = logging.getLogger(__name__)

# IP_CT_TCP_FLAG_BE_LIBERAL: no window check for this entry. A created entry knows neither side's
# sequence numbers; the kernel learns them from the next packets, but a segment it judges out of
# window meanwhile is INVALID, goes on untranslated, and reaches the node's own stack (a NodePort:
# answered with a RST) or the backend from the wrong address. Seen in the lab, now and then.
TCP_FLAG_BE_LIBERAL = 0x08


def _tuple(attr: Any) -> tuple[str, str, int, int, int]:
    ip, proto = attr.get_attr("CTA_TUPLE_IP"), attr.get_attr("CTA_TUPLE_PROTO")
    v = "V6" if ip.get_attr("CTA_IP_V4_SRC") is None and ip.get_attr("CTA_IP_V6_SRC") is not None else "V4"
    return (
        str(ip.get_attr(f"CTA_IP_{v}_SRC")),
        str(ip.get_attr(f"CTA_IP_{v}_DST")),
        int(proto.get_attr("CTA_PROTO_SRC_PORT") or 0),
        int(proto.get_attr("CTA_PROTO_DST_PORT") or 0),
        int(proto.get_attr("CTA_PROTO_NUM")),
    )


def _flow(msg: Any) -> NatFlow | None:
    orig, reply = msg.get_attr("CTA_TUPLE_ORIG"), msg.get_attr("CTA_TUPLE_REPLY")
    if orig is None or reply is None:
        return None
    o, r = _tuple(orig), _tuple(reply)
    if o[4] not in (TCP, UDP, SCTP) or not o[0] or o[0] == "None":
        return None
    state = TcpState.NONE
    sctp_state, vtags = 0, (0, 0)
    info = msg.get_attr("CTA_PROTOINFO")
    tcp = info.get_attr("CTA_PROTOINFO_TCP") if info is not None else None
    if tcp is not None:
        state = TcpState(int(tcp.get_attr("CTA_PROTOINFO_TCP_STATE")))
    sctp = info.get_attr("CTA_PROTOINFO_SCTP") if info is not None else None
    if sctp is not None:
        sctp_state = int(sctp.get_attr("CTA_PROTOINFO_SCTP_STATE") or 0)
        vtags = (
            int(sctp.get_attr("CTA_PROTOINFO_SCTP_VTAG_ORIGINAL") or 0),
            int(sctp.get_attr("CTA_PROTOINFO_SCTP_VTAG_REPLY") or 0),
        )
    return NatFlow(
        proto=o[4],
        orig=o[:4],
        reply=r[:4],
        status=int(msg.get_attr("CTA_STATUS") or 0),
        tcp_state=state,
        sctp_state=sctp_state,
        vtags=vtags,
    )


def dump_flows(netns: str, family: int = socket.AF_INET) -> list[NatFlow]:
    """The TCP, UDP and SCTP entries of nf_conntrack in `netns` (IPv4's, or `family`'s) whose
    destination was translated: the kernel filters on the status bit (Linux 5.15+), so a node's
    untranslated flows, however many, cost nothing here."""

    def run() -> list[NatFlow]:
        with NFCTSocket(nfgen_family=family) as ct:
            dumped = ct.dump(status=IPS_DST_NAT, status_mask=IPS_DST_NAT)
            return [f for f in (_flow(m) for m in dumped) if f is not None]

    return run_in_netns(netns, run)


def translated_any(netns: str, family: int = socket.AF_INET6) -> bool:
    """Whether nf_conntrack in `netns` holds an entry of `family` (any protocol) whose source or
    destination was translated: one whose packets nf_nat still rewrites while its hooks are
    registered (eBPF mode's ip6tables keeps them for it, agent/metaproxier.py). The kernel filters
    on the status bit (Linux 5.15+), so the untranslated entries cost nothing; an older kernel
    ignores that filter and dumps every entry, so the bit is checked here too."""

    def run() -> bool:
        with NFCTSocket(nfgen_family=family) as ct:
            return any(
                any(int(m.get_attr("CTA_STATUS") or 0) & bit for m in ct.dump(status=bit, status_mask=bit))
                for bit in (IPS_SRC_NAT, IPS_DST_NAT)
            )

    return run_in_netns(netns, run)


@dataclass
class Created:
    """What `create_flows` did."""

    created: int = 0
    present: int = 0  # an entry on that tuple existed (netfilter's own, or created by a pass before)
    failed: list[str] = field(default_factory=list)
    taken: list[NatFlow] = field(default_factory=list)  # the flows counted in `present`
    unwritten: list[NatFlow] = field(default_factory=list)  # the flows `failed` names (create_flows)


def _family(flow: NatFlow) -> int:
    return socket.AF_INET6 if flow.family == 6 else socket.AF_INET


def _nat(addr: str, port: int) -> dict[str, Any]:
    v = "V6" if ":" in addr else "V4"
    return {
        "attrs": [
            (f"CTA_NAT_{v}_MINIP", addr),
            (f"CTA_NAT_{v}_MAXIP", addr),
            ("CTA_NAT_PROTO", {"attrs": [("CTA_PROTONAT_PORT_MIN", port), ("CTA_PROTONAT_PORT_MAX", port)]}),
        ]
    }


def _entry(flow: NatFlow, timeouts: Timeouts) -> dict[str, Any]:
    s, d, sp, dp = flow.orig
    rs, rd, rsp, rdp = flow.reply
    attrs: dict[str, Any] = {
        "tuple_orig": NFCTAttrTuple(
            family=_family(flow), saddr=s, daddr=d, proto=flow.proto, sport=sp, dport=dp
        ),
        "tuple_reply": NFCTAttrTuple(
            family=_family(flow), saddr=d, daddr=s, proto=flow.proto, sport=dp, dport=sp
        ),
        "status": kernel_status(flow),
        "timeout": timeout_of(flow, timeouts),
    }
    # Both bindings given, an untranslated side as itself: without one, ctnetlink sets that side up
    # as netfilter's null binding, which takes another source port when an entry holds the reply
    # tuple (under legacy host routing, the plain client <-> backend entry the stack made for this
    # very flow: agent/takeover/flows.py). Pinned, the port cannot move and the kernel refuses the
    # entry (EEXIST) instead of making one whose packets the backend resets.
    attrs["nat_dst"] = _nat(rs, rsp)
    attrs["nat_src"] = _nat(rd, rdp)
    if flow.proto == TCP:
        liberal = (TCP_FLAG_BE_LIBERAL, TCP_FLAG_BE_LIBERAL)  # (flags, mask)
        tcp = [
            ("CTA_PROTOINFO_TCP_STATE", int(flow.tcp_state)),
            ("CTA_PROTOINFO_TCP_FLAGS_ORIGINAL", {"value": liberal}),
            ("CTA_PROTOINFO_TCP_FLAGS_REPLY", {"value": liberal}),
        ]
        attrs["protoinfo"] = {"attrs": [("CTA_PROTOINFO_TCP", {"attrs": tcp})]}
    elif flow.proto == SCTP:
        sctp = [
            ("CTA_PROTOINFO_SCTP_STATE", flow.sctp_state),
            ("CTA_PROTOINFO_SCTP_VTAG_ORIGINAL", flow.vtags[0]),
            ("CTA_PROTOINFO_SCTP_VTAG_REPLY", flow.vtags[1]),
        ]
        attrs["protoinfo"] = {"attrs": [("CTA_PROTOINFO_SCTP", {"attrs": sctp})]}
    return attrs


class Hold(Protocol):
    """What stops the data path translating one flow while its NAT entry replaces the entry the
    stack tracks it under (agent/takeover/out_of_ebpf.py)."""

    def hold(self, flow: NatFlow) -> bool:
        """Before the flow's entries change: its packets are neither translated nor passed.
        Whether it holds it (a flow the stack does not track under its NAT entry's reply tuple
        needs no hold)."""

    def release(self, flow: NatFlow) -> None:
        """Its NAT entry is written: its packets pass untranslated to it."""

    def renew(self) -> None:
        """Between two flows: the holds and passes made so far started again when they would
        otherwise lapse before the pass over every flow ends."""


def create_flows(
    netns: str,
    flows: Iterable[NatFlow],
    timeouts: Timeouts,
    *,
    clear_first: Callable[[NatFlow], NatFlow] | None = None,
    hold: Hold | None = None,
) -> Created:
    """Create an nf_conntrack entry, NAT included, for each flow (IPv4 or IPv6); one on the tuple
    already is kept. With `clear_first`, the entry on `clear_first(flow)`'s original tuple is
    deleted right before the flow's own is created (the gap a packet could fill is one netlink
    round trip). With `hold`, each flow is held right before that and released once its own entry
    is written (a flow refused or failed stays held), so the hold lasts two round trips a flow; and
    before each flow `hold.renew()`, so that the earlier flows' holds outlast a long pass."""
    wanted = list(flows)

    def run() -> Created:
        done = Created()
        for family in (socket.AF_INET, socket.AF_INET6):
            group = [f for f in wanted if _family(f) == family]
            if not group:
                continue
            with NFCTSocket(nfgen_family=family) as ct:
                for flow in group:
                    held = False
                    if hold is not None:
                        hold.renew()
                        held = hold.hold(flow)
                    if clear_first is not None:
                        _delete(ct, clear_first(flow))
                    try:
                        ct.entry("add", **_entry(flow, timeouts))
                        done.created += 1
                        if hold is not None:
                            hold.release(flow)
                    except NetlinkError as exc:
                        if exc.code == errno.EEXIST:
                            done.present += 1
                            # a round trip more, for the held flows alone (the others lose
                            # nothing waiting for the round after the detach)
                            if hold is not None and held and _written_before(ct, flow):
                                hold.release(flow)  # a killed hand-back wrote it: it takes the packets
                            else:
                                done.taken.append(flow)
                        else:
                            done.failed.append(f"{flow.describe()}: {exc}")
                            done.unwritten.append(flow)
        return done

    return run_in_netns(netns, run)


def _written_before(ct: NFCTSocket, flow: NatFlow) -> bool:
    """Whether the entry on `flow`'s original tuple is its own NAT entry (both tuples, DST_NAT), as
    an earlier hand-back killed after the write (SIGKILL) left it: written, not refused. Another
    (the stack's plain entry holding the reply tuple, a NAT entry to another backend) is not."""
    s, d, sp, dp = flow.orig
    tuple_orig = NFCTAttrTuple(family=_family(flow), saddr=s, daddr=d, proto=flow.proto, sport=sp, dport=dp)
    try:
        found = [f for f in (_flow(m) for m in ct.entry("get", tuple_orig=tuple_orig)) if f is not None]
    except NetlinkError:
        return False  # ENOENT: the entry holding its reply tuple is another's
    return any(
        _same(f.orig, flow.orig) and _same(f.reply, flow.reply) and f.status & IPS_DST_NAT for f in found
    )


def _same(a: Tuple, b: Tuple) -> bool:
    """The same tuple, whichever way its addresses are written (the kernel's IPv6 text need not
    be ours)."""
    return a[2:] == b[2:] and all(
        ipaddress.ip_address(x) == ipaddress.ip_address(y) for x, y in zip(a[:2], b[:2], strict=True)
    )


def delete_flows(netns: str, flows: Iterable[NatFlow]) -> int:
    """Delete the entry on each flow's original tuple (the kernel finds it by either of an
    entry's tuples); returns how many there were. A missing one is no error: the flow ended, or
    the stack never tracked it."""
    wanted = list(flows)

    def run() -> int:
        deleted = 0
        for family in (socket.AF_INET, socket.AF_INET6):
            group = [f for f in wanted if _family(f) == family]
            if not group:
                continue
            with NFCTSocket(nfgen_family=family) as ct:
                for flow in group:
                    deleted += _delete(ct, flow)
        return deleted

    return run_in_netns(netns, run)


@dataclass
class Replaced:
    """What `replace_flows` did."""

    retired: int = 0  # entries deleted on the flows' own tuples
    stray: int = 0  # entries deleted on their replacements' tuples (made by packets meanwhile)
    # creates refused with EEXIST: the entry on the replacement's own tuple went in the same send,
    # so another entry holds its reply tuple (or a packet made one between the two messages)
    refused: list[NatFlow] = field(default_factory=list)
    moved_on: int = 0  # TCP flows whose entry was in another state than the dump's (closed meanwhile)
    made: Created = field(default_factory=Created)  # its `present` is never counted here: `refused`


def replace_flows(
    netns: str,
    flows: Iterable[NatFlow],
    by: Callable[[NatFlow], NatFlow],
    timeouts: Timeouts,
    *,
    before: Callable[[NatFlow], None],
    after: Callable[[NatFlow], None],
) -> Replaced:
    """Each flow's entry replaced by the entry of `by(flow)`, one flow after the other: `before(flow)`,
    then in one send(2) the entry on the flow's tuple deleted, the one on the new flow's deleted (a
    packet made it meanwhile) and the new one created, then `after(flow)` (also when a step failed:
    counted in `made.failed`, and the next flow goes on). The kernel runs the messages of one send in
    order before it returns (netlink_rcv_skb), so between `before` and `after` there is one system
    call, not three round trips through pyroute2's per-message work (about 2 ms each, and tens of ms
    when the agent waits for a CPU): the caller holds the flow's packets there. The messages are
    encoded with struct (agent/takeover/ctmsg.py) before `before`; only the acks are read here.
    A TCP flow's entry is read first (one more round trip, before `before`): the plain entry is made
    in the state netfilter holds now, which saw the flow's packets alone while it waited (NFPASS: a
    FIN or RST then moved only that entry on).
    Raises PermissionError when the first flow's read or delete is refused with EPERM (no NET_ADMIN: none
    would be replaced), and OSError when a send fails or STALLS_IN_A_ROW requests in a row got no
    answer (the socket is unusable)."""
    wanted = list(flows)

    def run() -> Replaced:
        done = Replaced()
        for family in (socket.AF_INET, socket.AF_INET6):
            group = [f for f in wanted if _family(f) == family]
            if not group:
                continue
            with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
                sock.bind((0, 0))
                sock.settimeout(ACK_WAIT_S)  # never an agent stuck at its start: the flow fails instead
                replace_group(sock, family, group, by, timeouts, done, before=before, after=after)
        return done

    return run_in_netns(netns, run)


class Sock(Protocol):
    """What `replace_group` uses of a netlink socket."""

    def send(self, data: bytes, /) -> int: ...

    def recv(self, size: int, /) -> bytes: ...


def replace_group(
    sock: Sock,
    family: int,
    group: Iterable[NatFlow],
    by: Callable[[NatFlow], NatFlow],
    timeouts: Timeouts,
    done: Replaced,
    *,
    before: Callable[[NatFlow], None],
    after: Callable[[NatFlow], None],
) -> None:
    """`replace_flows` for the flows of one family, on an open ctnetlink socket; what happened
    counted into `done`. Each flow's messages have their own sequence numbers, so the acks of a
    flow that timed out cannot be read as the next one's."""
    seq = 0
    stalls = 0  # requests in a row whose answers did not come
    for flow in group:
        seq += 4
        if flow.proto == TCP:
            # The flow's state now, not the dump's: while it waited (NFPASS) its packets went through
            # netfilter alone, which saw it close (FIN, RST) if it did. The plain entry is made in
            # that state, with that state's timeout, rather than ESTABLISHED for a day.
            try:
                state = _tcp_state(sock, seq - 3, flow)
            except (OSError, ValueError) as exc:
                if isinstance(exc, PermissionError) and seq == 4:
                    raise
                stalls = _stalled(exc, stalls)
                done.made.failed.append(f"{flow.describe()}: its entry could not be read ({exc})")
                continue
            if state is not None and state != flow.tcp_state:
                flow = replace(flow, tcp_state=TcpState(state))
                done.moved_on += 1
        new = by(flow)
        seqs = (seq - 2, seq - 1, seq)
        batch = b"".join(
            (
                ctmsg.delete_request(seqs[0], flow),
                ctmsg.delete_request(seqs[1], new),
                ctmsg.create_request(seqs[2], new, timeouts),
            )
        )
        before(flow)
        try:
            sock.send(batch)
        finally:
            after(flow)
        try:
            errors = _acks(sock, seqs)
        except (OSError, ValueError) as exc:  # no ack within ACK_WAIT_S, ENOBUFS, a malformed ack
            stalls = _stalled(exc, stalls)
            done.made.failed.append(f"{new.describe()}: its acks could not be read ({exc})")
            continue
        stalls = 0
        if seq == 4 and errors[seqs[0]] == errno.EPERM:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        gone, stray, made = (errors[s] for s in seqs)
        if gone not in (0, errno.ENOENT):
            done.made.failed.append(f"{flow.describe()}: its NAT entry not deleted: {os.strerror(gone)}")
            continue
        if stray not in (0, errno.ENOENT):
            done.made.failed.append(
                f"{new.describe()}: the entry on its tuple not deleted: {os.strerror(stray)}"
            )
            continue
        done.retired += gone == 0
        done.stray += stray == 0
        if made == 0:
            done.made.created += 1
        elif made == errno.EEXIST:
            done.refused.append(new)
        else:
            done.made.failed.append(f"{new.describe()}: {os.strerror(made)}")


ACK_WAIT_S = 5.0  # the kernel acks each request in the send itself; this only bounds the unexpected
STALLS_IN_A_ROW = 3  # requests in a row without an answer (timed out, ENOBUFS) that end the pass


def _stalled(exc: Exception, stalls: int) -> int:
    """The count of requests in a row whose answer did not come, `exc` counted; an OSError (the
    socket is unusable: the caller stops) once they are STALLS_IN_A_ROW, rather than
    ACK_WAIT_S for every flow left while the waiting flows' holds run out."""
    if not (isinstance(exc, TimeoutError) or getattr(exc, "errno", None) == errno.ENOBUFS):
        return 0
    stalls += 1
    if stalls >= STALLS_IN_A_ROW:
        raise OSError(errno.ETIMEDOUT, f"{stalls} ctnetlink requests in a row got no answer ({exc})") from exc
    return stalls


def _tcp_state(sock: Sock, seq: int, flow: NatFlow) -> int | None:
    """The TCP state of the entry on `flow`'s original tuple, None when there is none."""
    sock.send(ctmsg.get_request(seq, flow))
    state: int | None = None
    while True:
        for msg, kind, got in _messages(sock.recv(65536)):
            if got != seq:
                continue
            if kind != NLMSG_ERROR:
                state = ctmsg.tcp_state_of(msg)
                continue
            err = _ack_errno(msg)
            if err == errno.EPERM:
                raise PermissionError(err, os.strerror(err))
            if err not in (0, errno.ENOENT):
                raise OSError(err, os.strerror(err))
            return state


_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_ERRNO = struct.Struct("=i")  # nlmsgerr's error, right after the header


def _messages(data: bytes) -> Iterator[tuple[bytes, int, int]]:
    """(message, type, sequence number) of each netlink message of one recv's `data`. ValueError
    for a message shorter than its header, or longer than what is left of `data`."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _flags, seq, _pid = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise ValueError(f"a netlink message of {length} bytes in {len(data) - offset}")
        yield data[offset : offset + length], kind, seq
        offset += (length + 3) & ~3


def _ack_errno(msg: bytes) -> int:
    """The errno of an ack (NLMSG_ERROR; 0 for success). ValueError for one too short to hold it."""
    if len(msg) < _HEADER.size + _ERRNO.size:
        raise ValueError(f"an ack of {len(msg)} bytes")
    return -int(_ERRNO.unpack_from(msg, _HEADER.size)[0])


def _acks(sock: Sock, seqs: Collection[int]) -> dict[int, int]:
    """The errno of the acks (NLMSG_ERROR, 0 for success) of the requests numbered `seqs`, read as
    they come, over as many recv calls as they take; other messages (a late ack of a flow that timed
    out) are skipped. ValueError for a message shorter than its header says."""
    errors: dict[int, int] = {}
    while not all(s in errors for s in seqs):
        for msg, kind, seq in _messages(sock.recv(65536)):
            if kind == NLMSG_ERROR and seq in seqs:
                errors[seq] = _ack_errno(msg)
    return errors


def _delete(ct: NFCTSocket, flow: NatFlow) -> int:
    s, d, sp, dp = flow.orig
    try:
        tuple_orig = NFCTAttrTuple(
            family=_family(flow), saddr=s, daddr=d, proto=flow.proto, sport=sp, dport=dp
        )
        ct.entry("del", tuple_orig=tuple_orig)
    except NetlinkError as exc:
        if exc.code != errno.ENOENT:
            raise
        return 0
    return 1


def local_addresses(netns: str) -> frozenset[str]:
    """Every IPv4 and IPv6 address on the namespace's devices (loopback included): a flow from one
    of them has the node itself as its client, a flow to one a host backend. Both families: the
    IPv6 carry (into_ebpf.py `_carry6`) checks its flows against the same set."""
    with netns_route(netns) as ipr:
        return frozenset(
            str(m.get("address"))
            for family in (socket.AF_INET, socket.AF_INET6)
            for m in ipr.get_addr(family=family)
        )
