"""SCTP without SCTP sockets: the lab kernel has none (`CONFIG_IP_SCTP` is off; `socket(AF_INET,
SOCK_STREAM, IPPROTO_SCTP)` fails with EPROTONOSUPPORT), so the two ends of an association are
crafted packets sent and captured through raw IP sockets (protocol 132) inside lab namespaces.
A raw socket receives every SCTP packet the namespace is sent, as it arrived (the kernel has no
SCTP to check or answer it), and sends what it is given, its CRC32c included.

Standalone on purpose (standard library only), executed by path like lab/client.py:

  server --port P --seconds S [--ipv6]
                                 answers an INIT to port P with an INIT-ACK, a COOKIE-ECHO with a
                                 COOKIE-ACK and a DATA chunk with a DATA chunk echoing it; prints
                                 "ready", then one JSON line per SCTP packet that arrives (to any
                                 port), with "t": the wall-clock time it was read (whether and
                                 when a chunk a client lost reached the server); --stall-on D
                                 --stall-s T: the echo of DATA D waits T s
  client --addr A --port P --sport S [--seconds T]
                                 INIT from source port S, waits for the INIT-ACK from A:P, sends a
                                 DATA chunk with the verification tag it got, waits for the echo;
                                 prints {"init_ack": {...}, "echo": {...}} (null for what never
                                 came)
  hold --addr A --port P --sport S --stop-file F [--interval I] [--timeout T] [--max-s M]
                                 one association kept up: the four-way handshake (INIT, INIT-ACK,
                                 COOKIE-ECHO, COOKIE-ACK: established, as a conntrack sees it),
                                 then a DATA chunk every I s, each waiting T s for its echo, until
                                 F exists (bounded by M s); prints {"established": bool,
                                 "exchanges": n, "lost": n, "first_lost": exchange or null,
                                 "lost_sent_at": [...], "late": [lines], "late_sent_at": [...]}:
                                 lost never echoed, late echoed after its wait ran out

IPv6 when --addr is an IPv6 address (client, hold) or with --ipv6 (server): the raw socket then
sees the SCTP packet alone (an IPv6 raw socket never gets the IPv6 header), its destination from
IPV6_PKTINFO.

A packet is described as {"src", "dst", "sport", "dport", "vtag", "chunk", "init_tag", "data",
"crc_ok"}: `chunk` is the type of its first chunk (0 DATA, 1 INIT, 2 INIT-ACK), `crc_ok` whether
its CRC32c (RFC 9260 appendix A, little-endian over the packet with the field zeroed) is right.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct
import sys
import time
from typing import Any

PROTO = 132
DATA, INIT, INIT_ACK, COOKIE_ECHO, COOKIE_ACK = 0, 1, 2, 10, 11
CLIENT_TAG, SERVER_TAG = 0x1234ABCD, 0x5678EF01
_TABLE: list[int] = []


def _table() -> list[int]:
    if not _TABLE:
        for n in range(256):
            c = n
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            _TABLE.append(c)
    return _TABLE


def crc32c(data: bytes) -> int:
    """CRC32c (Castagnoli): preset and final value inverted, reflected polynomial 0x82f63b78."""
    table = _table()
    crc = 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def checksum_ok(packet: bytes) -> bool:
    """Whether an SCTP packet (common header to the end) carries its right CRC32c."""
    if len(packet) < 12:
        return False
    return int.from_bytes(packet[8:12], "little") == crc32c(packet[:8] + bytes(4) + packet[12:])


def build(sport: int, dport: int, vtag: int, chunks: bytes) -> bytes:
    """An SCTP packet: common header, the chunks, the CRC32c filled in."""
    head = struct.pack("!HHI", sport, dport, vtag)
    crc = crc32c(head + bytes(4) + chunks)
    return head + crc.to_bytes(4, "little") + chunks


def init_chunk(kind: int, tag: int, cookie: bytes = b"") -> bytes:
    """INIT or INIT-ACK: initiate tag, a_rwnd, 1 stream each way, initial TSN; INIT-ACK carries a
    State Cookie parameter (type 7)."""
    params = struct.pack("!HH", 7, 4 + len(cookie)) + cookie if cookie else b""
    body = struct.pack("!IIHHI", tag, 65535, 1, 1, 1) + params
    return struct.pack("!BBH", kind, 0, 4 + len(body)) + body


def data_chunk(payload: bytes) -> bytes:
    """One DATA chunk (beginning and end of a message), padded to four bytes."""
    chunk = struct.pack("!BBHIHHI", DATA, 0x03, 16 + len(payload), 1, 0, 0, 0) + payload
    return chunk + bytes(-len(chunk) % 4)


def cookie_chunk(kind: int, cookie: bytes = b"") -> bytes:
    """COOKIE-ECHO (the State Cookie the INIT-ACK carried) or COOKIE-ACK, padded to four bytes."""
    chunk = struct.pack("!BBH", kind, 0, 4 + len(cookie)) + cookie
    return chunk + bytes(-len(chunk) % 4)


def describe(packet: bytes) -> dict[str, Any] | None:
    """An IPv4 packet as received on the raw socket (IP header included); None if not SCTP."""
    if len(packet) < 20 or packet[9] != PROTO:
        return None
    ihl = (packet[0] & 0x0F) * 4
    total = int.from_bytes(packet[2:4], "big")
    return describe_sctp(packet[ihl:total], socket.inet_ntoa(packet[12:16]), socket.inet_ntoa(packet[16:20]))


def describe_sctp(sctp: bytes, src: str, dst: str) -> dict[str, Any] | None:
    """An SCTP packet (common header to the end) from `src` to `dst`; None if too short."""
    if len(sctp) < 16:
        return None
    sport, dport, vtag = struct.unpack("!HHI", sctp[:8])
    chunk, _, length = struct.unpack("!BBH", sctp[12:16])
    out: dict[str, Any] = {
        "src": src,
        "dst": dst,
        "sport": sport,
        "dport": dport,
        "vtag": vtag,
        "chunk": chunk,
        "init_tag": None,
        "data": None,
        "crc_ok": checksum_ok(sctp),
    }
    if chunk in (INIT, INIT_ACK) and len(sctp) >= 20:
        out["init_tag"] = int.from_bytes(sctp[16:20], "big")
    if chunk == DATA and length >= 16:
        out["data"] = sctp[28 : 12 + length].decode(errors="replace")
    return out


def raw_socket(ipv6: bool = False) -> socket.socket:
    if not ipv6:
        return socket.socket(socket.AF_INET, socket.SOCK_RAW, PROTO)
    sock = socket.socket(socket.AF_INET6, socket.SOCK_RAW, PROTO)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)  # the destination of each
    return sock


def read(sock: socket.socket) -> dict[str, Any] | None:
    """One packet off the raw socket, described (None if not SCTP)."""
    if sock.family == socket.AF_INET:
        return describe(sock.recv(65535))
    data, ancillary, _, peer = sock.recvmsg(65535, socket.CMSG_SPACE(20))
    dst = next(
        (
            socket.inet_ntop(socket.AF_INET6, body[:16])
            for level, kind, body in ancillary
            if level == socket.IPPROTO_IPV6 and kind == socket.IPV6_PKTINFO
        ),
        "",
    )
    return describe_sctp(data, peer[0], dst)


def receive(sock: socket.socket, until: float) -> dict[str, Any] | None:
    """The next SCTP packet before the monotonic time `until`, described; None at the deadline.
    A packet waiting at the deadline is taken, even when this process, stalled, looks only after
    it: what it waits for is the packet, not the process being scheduled in time."""
    while True:
        ready, _, _ = select.select([sock], [], [], max(0.0, until - time.monotonic()))
        if not ready:
            return None
        seen = read(sock)
        if seen is not None:
            return seen


def cmd_server(a: argparse.Namespace) -> int:
    sock = raw_socket(a.ipv6)
    print("ready", flush=True)
    until = time.monotonic() + a.seconds
    while (seen := receive(sock, until)) is not None:
        print(json.dumps({**seen, "t": round(time.time(), 4)}), flush=True)
        if seen["dport"] != a.port or not seen["crc_ok"]:
            continue  # not ours (the echo of a client in this namespace), or damaged
        to = (seen["src"], 0)
        if seen["chunk"] == INIT:
            answer = init_chunk(INIT_ACK, SERVER_TAG, cookie=b"cookie!!")
            sock.sendto(build(a.port, seen["sport"], seen["init_tag"], answer), to)
        elif seen["chunk"] == COOKIE_ECHO and seen["vtag"] == SERVER_TAG:
            sock.sendto(build(a.port, seen["sport"], CLIENT_TAG, cookie_chunk(COOKIE_ACK)), to)
        elif seen["chunk"] == DATA and seen["vtag"] == SERVER_TAG:
            if seen["data"] == a.stall_on:
                time.sleep(a.stall_s)  # a peer not scheduled in time: its echo comes late
            echo = data_chunk(f"echo {seen['data']}".encode())
            sock.sendto(build(a.port, seen["sport"], CLIENT_TAG, echo), to)
    return 0


def expect(sock: socket.socket, a: argparse.Namespace, until: float, chunk: int) -> dict[str, Any] | None:
    """The next packet of `chunk` from a.addr:a.port to our source port."""
    while (seen := receive(sock, until)) is not None:
        if (seen["src"], seen["sport"], seen["dport"], seen["chunk"]) == (a.addr, a.port, a.sport, chunk):
            return seen
    return None


def expect_echo(
    sock: socket.socket, a: argparse.Namespace, until: float, n: int, late: set[int]
) -> dict[str, Any] | None:
    """The echo of line `n`. The echo of an earlier line, come after its own wait ran out, is added
    to `late` and passed over: taken for this line's, one late echo was counted as two losses."""
    while (seen := expect(sock, a, until, DATA)) is not None:
        if seen["data"] == f"echo line {n}":
            return seen
        line = (seen["data"] or "").removeprefix("echo line ")
        if line.isdigit() and seen["vtag"] == CLIENT_TAG:
            late.add(int(line))
    return None


def cmd_client(a: argparse.Namespace) -> int:
    sock = raw_socket(":" in a.addr)
    to = (a.addr, 0)
    deadline = time.monotonic() + a.seconds
    result: dict[str, Any] = {"init_ack": None, "echo": None}
    # An INIT a second until answered (the first may meet an unresolved neighbour), bounded.
    while result["init_ack"] is None and time.monotonic() < deadline:
        sock.sendto(build(a.sport, a.port, 0, init_chunk(INIT, CLIENT_TAG)), to)
        result["init_ack"] = expect(sock, a, min(deadline, time.monotonic() + 1.0), INIT_ACK)
    if result["init_ack"] is not None:
        sock.sendto(build(a.sport, a.port, result["init_ack"]["init_tag"], data_chunk(b"hello sctp")), to)
        result["echo"] = expect(sock, a, deadline, DATA)
    print(json.dumps(result), flush=True)
    return 0


def cmd_hold(a: argparse.Namespace) -> int:
    sock = raw_socket(":" in a.addr)
    to = (a.addr, 0)
    start = time.monotonic()
    end = start + a.max_s
    result: dict[str, Any] = {"established": False, "exchanges": 0, "lost": 0, "first_lost": None}
    unanswered: dict[int, float] = {}  # line -> wall-clock time it was sent, its wait run out
    late: set[int] = set()  # lines whose echo came after their wait ran out
    ack = None
    while ack is None and time.monotonic() < min(end, start + 10):
        sock.sendto(build(a.sport, a.port, 0, init_chunk(INIT, CLIENT_TAG)), to)
        ack = expect(sock, a, time.monotonic() + 1.0, INIT_ACK)
    if ack is not None:
        peer = ack["init_tag"]
        sock.sendto(build(a.sport, a.port, peer, cookie_chunk(COOKIE_ECHO, b"cookie!!")), to)
        result["established"] = expect(sock, a, time.monotonic() + a.timeout, COOKIE_ACK) is not None
        n = 0
        while result["established"] and not os.path.exists(a.stop_file) and time.monotonic() < end:
            sent = time.time()
            sock.sendto(build(a.sport, a.port, peer, data_chunk(f"line {n}".encode())), to)
            echo = expect_echo(sock, a, time.monotonic() + a.timeout, n, late)
            if echo is not None and echo["vtag"] == CLIENT_TAG:
                result["exchanges"] += 1
            else:
                unanswered[n] = sent
            n += 1
            time.sleep(a.interval)
        # Echoes still on their way when the stop file came (or the bound) count late, not lost.
        until = time.monotonic() + a.timeout
        while unanswered.keys() - late and expect_echo(sock, a, until, -1, late) is not None:
            pass
    # Lost: never echoed. Late: echoed after the wait ran out (a stall of this process, or of the
    # peer's, longer than --timeout): the data path carried both ways.
    lost = sorted(unanswered.keys() - late)
    result["lost"] = len(lost)
    result["first_lost"] = lost[0] if lost else None
    result["lost_sent_at"] = [round(unanswered[n], 3) for n in lost[:10]]
    result["late"] = sorted(late & unanswered.keys())
    result["late_sent_at"] = [round(unanswered[n], 3) for n in result["late"][:10]]
    print(json.dumps(result), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("server")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--seconds", type=float, default=30.0)
    s.add_argument("--ipv6", action="store_true", help="IPv6 (an IPv6 raw socket)")
    s.add_argument("--stall-on", default="", help="DATA whose echo waits --stall-s (e.g. 'line 3')")
    s.add_argument("--stall-s", type=float, default=0.0)
    c = sub.add_parser("client")
    c.add_argument("--addr", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--sport", type=int, required=True)
    c.add_argument("--seconds", type=float, default=10.0)
    h = sub.add_parser("hold")
    h.add_argument("--addr", required=True)
    h.add_argument("--port", type=int, required=True)
    h.add_argument("--sport", type=int, required=True)
    h.add_argument("--stop-file", required=True)
    h.add_argument("--interval", type=float, default=0.05)
    h.add_argument("--timeout", type=float, default=2.0)
    h.add_argument("--max-s", type=float, default=90.0)
    a = p.parse_args()
    return {"server": cmd_server, "client": cmd_client, "hold": cmd_hold}[a.mode](a)


if __name__ == "__main__":
    sys.exit(main())
