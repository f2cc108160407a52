"""A line-echo TCP server that also sends out-of-window segments to its peers (run inside a pod).

The lab's counterpart of upstream's `regression-issue-74839` image (test/e2e/network/conntrack.go,
"should drop INVALID conntrack entries"): after each line it echoes, it sends `--bursts` TCP
segments from its own address and port to the peer with a random sequence number, which
conntrack marks INVALID. A proxy that lets such a segment through without reverse NAT hands the
client a packet from the backend's address that no socket of the client owns, and the client
answers with a RST. The server sniffs its interface for RSTs from its peers and counts them.

Standalone (standard library and scapy), executed by path in a pod namespace. On SIGTERM (or when
--stop-file exists) it writes {"connections": n, "injected": n, "resets": n} to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import threading
import time
from typing import Any

from scapy.config import conf
from scapy.layers.inet import IP, TCP
from scapy.sendrecv import AsyncSniffer, send

counts = {"connections": 0, "injected": 0, "resets": 0}
lock = threading.Lock()


def serve(conn: socket.socket, bursts: int) -> None:
    own_ip, own_port = conn.getsockname()
    peer_ip, peer_port = conn.getpeername()
    reader = conn.makefile("rb")
    with conn:
        for line in reader:
            conn.sendall(line)
            bogus = IP(src=own_ip, dst=peer_ip) / TCP(
                sport=own_port,
                dport=peer_port,
                flags="PA",
                seq=random.randrange(1 << 32),
                ack=random.randrange(1 << 32),
            )
            send(bogus / b"boom", count=bursts, verbose=False)
            with lock:
                counts["injected"] += bursts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-file", required=True)
    a = ap.parse_args()
    conf.verb = 0

    def is_reset(pkt: Any) -> bool:
        return bool(pkt.haslayer(TCP) and pkt[TCP].dport == a.port and int(pkt[TCP].flags) & 0x04)

    def on_reset(_: Any) -> None:
        with lock:
            counts["resets"] += 1

    sniffer = AsyncSniffer(lfilter=is_reset, prn=on_reset, store=False)
    sniffer.start()
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", a.port))
    srv.listen(16)
    srv.settimeout(0.2)
    print(f"boom ready on {a.port}", flush=True)
    while not os.path.exists(a.stop_file):
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        with lock:
            counts["connections"] += 1
        threading.Thread(target=serve, args=(conn, a.bursts), daemon=True).start()
    time.sleep(0.5)  # a RST answering the last burst
    sniffer.stop()
    with lock:
        data = json.dumps(counts)
    with open(a.out, "w") as f:
        f.write(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
