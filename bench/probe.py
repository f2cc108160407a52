"""TCP connect latency, run *inside* the client pod's namespace (`ip netns exec ... python probe.py`).

Standalone on purpose (standard library only, started with `python -I -S`). One connection at a
time: a fresh socket, `connect()` timed with perf_counter_ns (the SYN out, the SYN-ACK back, the ACK
queued: one round trip through the data path), then an abortive close (SO_LINGER 0 sends a RST, so
neither side keeps a TIME_WAIT socket and the client never runs short of ports). The probe's own
overhead (two clock reads, one syscall's Python wrapper) is the same for every target it is
pointed at, so differences between targets are the data path's.

    probe.py ADDR PORT COUNT MAX_SECONDS   ->  one JSON object: {"ns": [...], "errors": {kind: n}}

ADDR is an IPv4 or an IPv6 address (the socket's family follows it).

Bounded twice: at most COUNT connections, and never longer than MAX_SECONDS.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

WARMUP = 50
LINGER_RST = struct.pack("ii", 1, 0)


def connect_once(addr: str, port: int) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RST)
        s.settimeout(2.0)
        start = time.perf_counter_ns()
        s.connect((addr, port))
        return time.perf_counter_ns() - start


def main(argv: list[str]) -> int:
    addr, port, count, max_s = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    samples: list[int] = []
    errors: dict[str, int] = {}
    deadline = time.monotonic() + max_s
    for i in range(WARMUP + count):
        if time.monotonic() > deadline:
            break
        try:
            took = connect_once(addr, port)
        except OSError as exc:
            kind = type(exc).__name__
            errors[kind] = errors.get(kind, 0) + 1
            continue
        if i >= WARMUP:
            samples.append(took)
    json.dump({"ns": samples, "errors": errors}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
