"""kube-proxy's two nfacct counters: created before the rules that use them, read back for metrics.

kube-proxy (pkg/proxy/util/nfacct) talks nfnetlink_acct directly, without the `nfacct` tool, and so
do we: one NETLINK_NETFILTER socket, opened inside the node's network namespace (the counters, like
the rules, are per namespace). The rules match them with `-m nfacct --nfacct-name NAME`:

* `ct_state_invalid_dropped_pkts`: packets KUBE-FORWARD drops as conntrack INVALID
  (`kubeproxy_iptables_ct_state_invalid_dropped_packets_total`);
* `localhost_nps_accepted_pkts`: packets accepted for a NodePort on 127.0.0.0/8
  (`kubeproxy_iptables_localhost_nodeports_accepted_packets_total`).

`ensure` creates a counter unless it exists (kube-proxy's Ensure: the kernel answers EBUSY for an
existing name when neither NLM_F_EXCL nor NLM_F_REPLACE is set, and we must not reset it);
`read_nfacct_counters` is what the metrics collector calls at scrape time. A kernel without
nfnetlink_acct fails `ensure`, and the proxier then writes the rules without the nfacct matches, as
kube-proxy does.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterable
from typing import Protocol

from agent.iptables.chains import NFACCT_COUNTERS
from agent.netns import run_in_netns

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ACCT = 7
NFNL_MSG_ACCT_NEW = 0
NFNL_MSG_ACCT_GET = 1
NFACCT_NAME = 1
NFACCT_PKTS = 2
NFACCT_BYTES = 3
NFACCT_NAME_MAX = 32
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLM_F_CREATE = 0x400
NLMSG_ERROR = 2
NLMSG_DONE = 3
_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big endian, 0 here)
_ATTR = struct.Struct("=HH")


class NfacctError(OSError):
    """nfnetlink_acct refused or is missing (errno set)."""


class Counters(Protocol):
    """What the proxier needs: create the counters; the metrics collector reads them."""

    def ensure(self, name: str) -> None:
        """Create the counter unless it exists; raise NfacctError when the kernel cannot."""

    def read(self, names: Iterable[str] = NFACCT_COUNTERS) -> dict[str, int]:
        """Packets counted so far, per existing counter among `names`."""


def _attr(kind: int, payload: bytes) -> bytes:
    raw = _ATTR.pack(_ATTR.size + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(msg_type: int, flags: int, seq: int, attrs: bytes) -> bytes:
    body = _NFGEN.pack(socket.AF_UNSPEC, 0, 0) + attrs
    return _HDR.pack(_HDR.size + len(body), (NFNL_SUBSYS_ACCT << 8) | msg_type, flags, seq, 0) + body


def _name(name: str) -> bytes:
    raw = name.encode() + b"\0"
    if len(raw) > NFACCT_NAME_MAX:
        raise ValueError(f"nfacct name {name!r} is longer than {NFACCT_NAME_MAX - 1} bytes")
    return raw


def _parse_attrs(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    pos = 0
    while pos + _ATTR.size <= len(data):
        length, kind = _ATTR.unpack_from(data, pos)
        if length < _ATTR.size:
            break
        out[kind & 0x3FFF] = data[pos + _ATTR.size : pos + length]
        pos += (length + 3) & ~3
    return out


def _exchange(request: bytes, seq: int) -> list[dict[int, bytes]]:
    """Send one request; the attribute sets of the replies until the ACK or DONE."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
        sock.settimeout(5)
        sock.bind((0, 0))
        sock.send(request)
        replies: list[dict[int, bytes]] = []
        while True:
            data = sock.recv(65536)
            pos = 0
            while pos + _HDR.size <= len(data):
                length, kind, _flags, rseq, _pid = _HDR.unpack_from(data, pos)
                if length < _HDR.size:
                    return replies
                payload = data[pos + _HDR.size : pos + length]
                pos += (length + 3) & ~3
                if rseq != seq:
                    continue
                if kind == NLMSG_DONE:
                    return replies
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code:
                        raise NfacctError(code, os.strerror(code))
                    return replies
                replies.append(_parse_attrs(payload[_NFGEN.size :]))


class NetlinkCounters:
    """The real counters, in `netns` ("" = our own namespace). No side effect at construction."""

    def __init__(self, netns: str = "") -> None:
        self._netns = netns
        self._seq = 0

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def ensure(self, name: str) -> None:
        seq = self._next_seq()
        msg = _message(
            NFNL_MSG_ACCT_NEW, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE, seq, _attr(NFACCT_NAME, _name(name))
        )
        try:
            run_in_netns(self._netns, lambda: _exchange(msg, seq))
        except NfacctError as exc:
            if exc.errno not in (errno.EBUSY, errno.EEXIST):
                raise

    def read(self, names: Iterable[str] = NFACCT_COUNTERS) -> dict[str, int]:
        wanted = set(names)
        seq = self._next_seq()
        msg = _message(NFNL_MSG_ACCT_GET, NLM_F_REQUEST | NLM_F_DUMP, seq, b"")
        out: dict[str, int] = {}
        for attrs in run_in_netns(self._netns, lambda: _exchange(msg, seq)):
            name = attrs.get(NFACCT_NAME, b"").split(b"\0", 1)[0].decode(errors="replace")
            if name in wanted and NFACCT_PKTS in attrs:
                out[name] = int.from_bytes(attrs[NFACCT_PKTS][:8], "big")
        return out


def read_nfacct_counters(netns: str = "", names: Iterable[str] = NFACCT_COUNTERS) -> dict[str, int]:
    """Packets counted by kube-proxy's nfacct counters in `netns` ("" = the agent's own namespace):
    `{"ct_state_invalid_dropped_pkts": n, "localhost_nps_accepted_pkts": m}`, only those that exist.
    Raises OSError when nfnetlink_acct cannot be reached (the collector then exports nothing)."""
    return NetlinkCounters(netns).read(names)
