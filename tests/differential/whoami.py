"""The differential suite's backend server: says who answered and whom it saw, in one reply.

Standard library only; run by path inside a pod's namespace (`python -I -S whoami.py --name N`).

  TCP on --port (default 7000): on accept, writes "<name> <peer address>\\n" and closes. The client
      sends nothing, so one connection is one observation: which backend, which source it saw.
  UDP on --port: a datagram `<payload>` is answered "<name> <peer address> <payload>". A large
      payload (4,000 bytes) arrives and leaves in fragments; the client checks it comes back intact.

Prints "whoami ready" once both sockets are bound. SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import socket
import threading


def serve_tcp(sock: socket.socket, name: bytes) -> None:
    while True:
        conn, peer = sock.accept()
        with conn:
            conn.sendall(name + b" " + peer[0].encode() + b"\n")


def serve_udp(sock: socket.socket, name: bytes) -> None:
    while True:
        data, peer = sock.recvfrom(65535)
        sock.sendto(name + b" " + peer[0].encode() + b" " + data, peer)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, default=7000)
    a = ap.parse_args()
    name = a.name.encode()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", a.port))
    tcp.listen(512)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", a.port))
    threading.Thread(target=serve_udp, args=(udp, name), daemon=True).start()
    print(f"whoami ready: {a.name} tcp+udp {a.port}", flush=True)
    serve_tcp(tcp, name)


if __name__ == "__main__":
    main()
