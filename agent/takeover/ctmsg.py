"""ctnetlink requests of nfct.replace_flows (delete by tuple, create with NAT), encoded with struct.

pyroute2 encodes the same bytes (tests/agent/test_ctmsg.py compares them) at about 1.9 ms per flow's
three requests on a loaded lab machine (load 6.7, 2 vCPUs), which is the agent's whole cost per flow
while the carried flows wait for their turn (agent/takeover/into_ebpf.py); struct does it in tens
of microseconds. Attribute numbers are the kernel's (include/uapi/linux/netfilter/nfnetlink_conntrack.h).
"""

from __future__ import annotations

import socket
import struct

from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_CTNETLINK
from pyroute2.netlink.nfnetlink.nfctsocket import IPCTNL_MSG_CT_DELETE, IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_NEW

from agent.takeover.flows import SCTP, TCP, NatFlow, Timeouts, kernel_status, timeout_of

# enum ctattr_type
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_STATUS, CTA_PROTOINFO = 1, 2, 3, 4
CTA_NAT_SRC, CTA_TIMEOUT, CTA_NAT_DST = 6, 7, 13
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2  # enum ctattr_tuple
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3  # enum ctattr_l4proto
CTA_NAT_PROTO = 3  # enum ctattr_nat: V4_MINIP 1, V4_MAXIP 2, V6_MINIP 4, V6_MAXIP 5
CTA_PROTONAT_PORT_MIN, CTA_PROTONAT_PORT_MAX = 1, 2
CTA_PROTOINFO_TCP, CTA_PROTOINFO_SCTP = 1, 3
TCP_STATE, TCP_FLAGS_ORIGINAL, TCP_FLAGS_REPLY = 1, 4, 5  # enum ctattr_protoinfo_tcp
SCTP_STATE, SCTP_VTAG_ORIGINAL, SCTP_VTAG_REPLY = 1, 2, 3  # enum ctattr_protoinfo_sctp

# IP_CT_TCP_FLAG_BE_LIBERAL as (flags, mask): no window check for a created entry (nfct.py says why)
_LIBERAL = bytes((0x08, 0x08))
_CREATE = NLM_F_EXCL | NLM_F_CREATE
_NLA = struct.Struct("=HH")
_NLMSG = struct.Struct("=IHHII")
_NFGEN = struct.Struct("=BBH")


def _attr(kind: int, payload: bytes) -> bytes:
    pad = -len(payload) % 4
    return _NLA.pack(4 + len(payload), kind) + payload + b"\0" * pad


def _nest(kind: int, *attrs: bytes) -> bytes:
    # No NLA_F_NESTED, as pyroute2 sends them: ctnetlink parses its nests without asking for it.
    return _attr(kind, b"".join(attrs))


def _ip(family: int, addr: str) -> bytes:
    return socket.inet_pton(family, addr)


def _tuple(kind: int, family: int, proto: int, tuple_: tuple[str, str, int, int]) -> bytes:
    s, d, sp, dp = tuple_
    v6 = 2 if family == socket.AF_INET6 else 0  # CTA_IP_V6_SRC, _DST are V4's + 2
    return _nest(
        kind,
        _nest(CTA_TUPLE_IP, _attr(1 + v6, _ip(family, s)), _attr(2 + v6, _ip(family, d))),
        _nest(
            CTA_TUPLE_PROTO,
            _attr(CTA_PROTO_NUM, bytes((proto,))),
            _attr(CTA_PROTO_SRC_PORT, struct.pack(">H", sp)),
            _attr(CTA_PROTO_DST_PORT, struct.pack(">H", dp)),
        ),
    )


def _nat(kind: int, family: int, addr: str, port: int) -> bytes:
    v6 = 3 if family == socket.AF_INET6 else 0  # CTA_NAT_V6_MINIP, _MAXIP are V4's + 3
    ip, be = _ip(family, addr), struct.pack(">H", port)
    return _nest(
        kind,
        _attr(1 + v6, ip),
        _attr(2 + v6, ip),
        _nest(CTA_NAT_PROTO, _attr(CTA_PROTONAT_PORT_MIN, be), _attr(CTA_PROTONAT_PORT_MAX, be)),
    )


def _request(family: int, kind: int, flags: int, seq: int, attrs: bytes) -> bytes:
    body = _NFGEN.pack(family, 0, 0) + attrs
    head = _NLMSG.pack(
        _NLMSG.size + len(body),
        (NFNL_SUBSYS_CTNETLINK << 8) | kind,
        NLM_F_REQUEST | NLM_F_ACK | flags,
        seq,
        0,
    )
    return head + body


def family_of(flow: NatFlow) -> int:
    return socket.AF_INET6 if flow.family == 6 else socket.AF_INET


def delete_request(seq: int, flow: NatFlow) -> bytes:
    """Delete the entry on `flow`'s original tuple (the kernel finds it by either tuple)."""
    family = family_of(flow)
    return _request(
        family, IPCTNL_MSG_CT_DELETE, 0, seq, _tuple(CTA_TUPLE_ORIG, family, flow.proto, flow.orig)
    )


def get_request(seq: int, flow: NatFlow) -> bytes:
    """Read the entry on `flow`'s original tuple (an IPCTNL_MSG_CT_NEW message, then the ack)."""
    family = family_of(flow)
    return _request(family, IPCTNL_MSG_CT_GET, 0, seq, _tuple(CTA_TUPLE_ORIG, family, flow.proto, flow.orig))


def _attrs(data: bytes, start: int, end: int) -> dict[int, tuple[int, int]]:
    """The attributes of data[start:end] by type (nesting flags masked): their payloads' bounds."""
    found: dict[int, tuple[int, int]] = {}
    while start + _NLA.size <= end:
        length, kind = _NLA.unpack_from(data, start)
        if length < _NLA.size or start + length > end:
            raise ValueError(f"a netlink attribute of {length} bytes in {end - start}")
        found[kind & 0x3FFF] = (start + _NLA.size, start + length)
        start += (length + 3) & ~3
    return found


def tcp_state_of(message: bytes) -> int | None:
    """The TCP state (CTA_PROTOINFO_TCP_STATE) of a ctnetlink entry message (from its nlmsghdr),
    None when it has none."""
    top = _attrs(message, _NLMSG.size + _NFGEN.size, len(message))
    if CTA_PROTOINFO not in top:
        return None
    tcp = _attrs(message, *top[CTA_PROTOINFO]).get(CTA_PROTOINFO_TCP)
    if tcp is None:
        return None
    state = _attrs(message, *tcp).get(TCP_STATE)
    return message[state[0]] if state is not None and state[1] > state[0] else None


def create_request(seq: int, flow: NatFlow, timeouts: Timeouts) -> bytes:
    """Create `flow`'s entry (NLM_F_EXCL: EEXIST when one holds either tuple), both NAT bindings
    pinned (nfct._entry says why), a TCP entry window-liberal, an SCTP one with its tags."""
    family, (s, d, sp, dp), (rs, rd, rsp, rdp) = family_of(flow), flow.orig, flow.reply
    attrs = [
        _tuple(CTA_TUPLE_ORIG, family, flow.proto, flow.orig),
        _tuple(CTA_TUPLE_REPLY, family, flow.proto, (d, s, dp, sp)),
        _attr(CTA_STATUS, struct.pack(">I", kernel_status(flow))),
        _attr(CTA_TIMEOUT, struct.pack(">I", timeout_of(flow, timeouts))),
        _nat(CTA_NAT_DST, family, rs, rsp),
        _nat(CTA_NAT_SRC, family, rd, rdp),
    ]
    if flow.proto == TCP:
        tcp = (
            _attr(TCP_STATE, bytes((int(flow.tcp_state),))),
            _attr(TCP_FLAGS_ORIGINAL, _LIBERAL),
            _attr(TCP_FLAGS_REPLY, _LIBERAL),
        )
        attrs.append(_nest(CTA_PROTOINFO, _nest(CTA_PROTOINFO_TCP, *tcp)))
    elif flow.proto == SCTP:
        sctp = (
            _attr(SCTP_STATE, bytes((flow.sctp_state,))),
            _attr(SCTP_VTAG_ORIGINAL, struct.pack(">I", flow.vtags[0])),
            _attr(SCTP_VTAG_REPLY, struct.pack(">I", flow.vtags[1])),
        )
        attrs.append(_nest(CTA_PROTOINFO, _nest(CTA_PROTOINFO_SCTP, *sctp)))
    return _request(family, IPCTNL_MSG_CT_NEW, _CREATE, seq, b"".join(attrs))
