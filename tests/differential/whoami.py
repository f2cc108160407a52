"""The differential suite's backend server: says who answered and whom it saw, in one reply.

Standard library only; run by path inside a pod's namespace (`python -I -S whoami.py --name N`).

  TCP on --port (default 7000): on accept, writes "<name> <peer address>\\n" and closes. The client
      sends nothing, so one connection is one observation: which backend, which source it saw.
  UDP on --port: a datagram `<payload>` is answered "<name> <peer address> <payload>". A large
      payload (4,000 bytes) arrives and leaves in fragments; the client checks it comes back intact.

With --ipv6 the same on IPv6 sockets too (the table in IPv6). Prints "whoami ready" once every
socket is bound. SIGTERM ends it.
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
    ap.add_argument("--ipv6", action="store_true")
    a = ap.parse_args()
    name = a.name.encode()
    families = [(socket.AF_INET, "0.0.0.0")] + ([(socket.AF_INET6, "::")] if a.ipv6 else [])
    tcps = []
    for af, wildcard in families:
        tcp = socket.socket(af, socket.SOCK_STREAM)
        udp = socket.socket(af, socket.SOCK_DGRAM)
        for sock in (tcp, udp):
            if af == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((wildcard, a.port))
        tcp.listen(512)
        tcps.append(tcp)
        threading.Thread(target=serve_udp, args=(udp, name), daemon=True).start()
    for tcp in tcps[1:]:
        threading.Thread(target=serve_tcp, args=(tcp, name), daemon=True).start()
    print(f"whoami ready: {a.name} tcp+udp {a.port}", flush=True)
    serve_tcp(tcps[0], name)


if __name__ == "__main__":
    main()
