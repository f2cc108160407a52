"""The differential suite's client: N attempts at one destination, each classified, as JSON.

Standard library only; run by path inside a lab namespace (a pod, a node, the external client), so
a node's host-network processes are probed from the node's own cgroup as a real one would be.

  probe.py --proto tcp|udp --addr A --port P --count N [--size S] [--rounds R --gap G]

An IPv6 address (the table in IPv6) is dialled over IPv6, its reject read as ICMPv6.

Each attempt is a new flow (a new socket, so a new source port) and ends as one of
  ok <backend> <address the backend saw>   an answer from the whoami server (UDP: payload intact)
  refused        an ICMP (ICMPv6) port unreachable (kube-proxy's `-j REJECT`, eBPF mode's reject)
  reset          TCP: a RST, what a node's own stack answers on a port nothing listens on; told
                 apart from a reject by the ICMP error IP_RECVERR queues (ECONNREFUSED either way),
                 so an unprogrammed NodePort cannot pass for a rejected one
  timeout        nothing within --timeout
  bad            a UDP answer whose echoed payload differs from what was sent
  error:<name>   anything else (unreachable, reset after connect, ...)
`--rounds R --gap G` repeats the N attempts R times with G seconds between rounds (affinity expiry).
A round stops after two timeouts without any answer: an expected drop costs two timeouts, not N.
Output: {"attempts": [[round, verdict, backend, seen], ...]}.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time

IP_RECVERR = 11  # linux/in.h; the socket module of Python 3.11 does not name it
IPV6_RECVERR = 25  # linux/in6.h
SO_EE_ORIGIN_ICMP, SO_EE_ORIGIN_ICMP6 = 2, 3
ICMP_DEST_UNREACH, ICMP_PORT_UNREACH = 3, 3
ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH = 1, 4
# Per address family: the socket family, the error-queue option, and the port unreachable it reports.
FAMILY = {
    4: (socket.AF_INET, socket.SOL_IP, IP_RECVERR, (SO_EE_ORIGIN_ICMP, ICMP_DEST_UNREACH, ICMP_PORT_UNREACH)),
    6: (
        socket.AF_INET6,
        socket.IPPROTO_IPV6,
        IPV6_RECVERR,
        (SO_EE_ORIGIN_ICMP6, ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH),
    ),
}


def version(addr: str) -> int:
    return 6 if ":" in addr else 4


def rejected_by_icmp(s: socket.socket, ip: int) -> bool:
    """Whether the error queue holds an ICMP (ICMPv6) port unreachable (struct sock_extended_err)."""
    _, level, option, port_unreachable = FAMILY[ip]
    s.settimeout(0)
    try:
        _, ancillary, _, _ = s.recvmsg(512, 512, socket.MSG_ERRQUEUE)
    except BlockingIOError:
        return False  # nothing queued: the refusal was a RST
    for cmsg_level, kind, data in ancillary:
        if cmsg_level == level and kind == option and len(data) >= 8:
            _, origin, icmp_type, icmp_code = struct.unpack_from("=IBBB", data)
            if (origin, icmp_type, icmp_code) == port_unreachable:
                return True
    return False


def tcp_attempt(addr: str, port: int, timeout: float) -> list[str]:
    ip = version(addr)
    af, level, option, _ = FAMILY[ip]
    try:
        with socket.socket(af, socket.SOCK_STREAM) as s:
            s.setsockopt(level, option, 1)
            s.settimeout(timeout)
            try:
                s.connect((addr, port))
            except ConnectionRefusedError:
                return ["refused" if rejected_by_icmp(s, ip) else "reset", "", ""]
            s.setsockopt(level, option, 0)  # connected: ICMP errors soft again, as by default
            chunks = []
            while chunk := s.recv(4096):
                chunks.append(chunk)
    except TimeoutError:
        return ["timeout", "", ""]
    except OSError as exc:
        return [f"error:{type(exc).__name__}:{exc.errno}", "", ""]
    parts = b"".join(chunks).decode(errors="replace").split()
    if len(parts) != 2:
        return ["bad", "", ""]
    return ["ok", parts[0], parts[1]]


def udp_attempt(addr: str, port: int, timeout: float, size: int, seq: int) -> list[str]:
    payload = f"probe-{seq}-".encode()
    if size:
        payload = (payload + b"0123456789abcdef" * (size // 16 + 1))[:size]
    with socket.socket(FAMILY[version(addr)][0], socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        try:
            s.connect((addr, port))  # connected: ICMP port unreachable comes back as ECONNREFUSED
            s.send(payload)
            data = s.recv(65535)
        except ConnectionRefusedError:
            return ["refused", "", ""]
        except TimeoutError:
            return ["timeout", "", ""]
        except OSError as exc:
            return [f"error:{type(exc).__name__}:{exc.errno}", "", ""]
    name, _, rest = data.partition(b" ")
    seen, _, echoed = rest.partition(b" ")
    if echoed != payload:
        return ["bad", name.decode(errors="replace"), seen.decode(errors="replace")]
    return ["ok", name.decode(), seen.decode()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proto", choices=["tcp", "udp"], required=True)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1.5)
    ap.add_argument("--size", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--gap", type=float, default=0.0)
    a = ap.parse_args()
    attempts: list[list[object]] = []
    seq = 0
    for r in range(a.rounds):
        if r:
            time.sleep(a.gap)
        timeouts = answered = 0
        for _ in range(a.count):
            seq += 1
            if a.proto == "tcp":
                result = tcp_attempt(a.addr, a.port, a.timeout)
            else:
                result = udp_attempt(a.addr, a.port, a.timeout, a.size, seq)
            attempts.append([r, *result])
            answered += result[0] == "ok"
            timeouts += result[0] == "timeout"
            if timeouts >= 2 and not answered:
                break
    json.dump({"attempts": attempts}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
