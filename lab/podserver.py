"""The lab's pod server: standard library only, started as a script inside a pod's namespace.

HTTP (HTTP/1.0, one request per connection) on every `--http-port` (default 8080), bound to 0.0.0.0:
  GET /       -> "<name>\\n"
  GET /ip     -> "<client source IP as seen by the server>\\n"
  GET /blob   -> the file given with `--blob` (application/octet-stream, sendfile), 404 without it
  GET /healthz -> "ok\\n"
  POST /sink  -> reads the whole body, answers "<bytes received>\\n" (uploads, path-MTU tests)
UDP echo on every `--udp-port` (default 9000): a datagram `<payload>` is answered `<name> <payload>`,
  from the address it was sent to (a node has many).
TCP line echo on every `--tcp-echo-port` (none by default): each line comes back as it went.
Named TCP line echo on every `--tcp-named-echo-port` (none by default): a line comes back as
`<name> <line>` (which backend a long-lived connection is on, line by line).
`--ipv6`: the HTTP and TCP echo ports listen on [::] as well (IPv6 only there, beside 0.0.0.0), for
the dual-stack lab's IPv6 endpoints; UDP stays IPv4.

UDP sockets are bound before the HTTP sockets listen, so a successful TCP connect means the whole
server is ready. SIGTERM ends it.

Usage: python podserver.py --name pod-1-1 [--http-port 8080 ...] [--udp-port 9000 ...] [--blob FILE]
"""

from __future__ import annotations

import argparse
import os
import socket
import socketserver
import struct
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    allow_reuse_port = False  # a second server on the same port must fail, not share it
    request_queue_size = 1024
    pod_name = ""
    blob: str | None = None

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a DNS lookup that can stall in a namespace.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


class Server6(Server):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # IPv6 only: the IPv4 server of the same port owns 0.0.0.0
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        super().server_bind()


class Handler(BaseHTTPRequestHandler):
    server_version = "ekp-podserver/1"
    protocol_version = "HTTP/1.0"
    server: Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._text(self.server.pod_name + "\n")
        elif path == "/ip":
            self._text(f"{self.client_address[0]}\n")
        elif path == "/healthz":
            self._text("ok\n")
        elif path == "/blob" and self.server.blob:
            self._blob(self.server.blob)
        else:
            self._text("not found\n", 404)

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/sink":
            self._text("not found\n", 404)
            return
        left = int(self.headers.get("Content-Length", "0"))
        received = 0
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 20))
            if not chunk:
                break
            received += len(chunk)
            left -= len(chunk)
        self._text(f"{received}\n")

    def _text(self, body: str, status: int = 200) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _blob(self, path: str) -> None:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.flush()
            self.connection.sendfile(f)

    def log_message(self, format: str, *args: object) -> None:
        pass


# Linux's value: Python 3.11's socket module does not name it.
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
PKTINFO = struct.Struct("=i4s4s")  # struct in_pktinfo: ipi_ifindex, ipi_spec_dst, ipi_addr


def udp_echo(sock: socket.socket, name: bytes) -> None:
    """Answer each datagram from the address it was sent to (IP_PKTINFO, as DNS servers do). A
    socket on 0.0.0.0 would answer from the source its route to the peer prefers: on a lab node,
    for a pod of that node, the pod gateway 10.244.N.1 and not the node address a proxy DNATed the
    request to. conntrack then cannot match the answer to its flow: it is not reverse-translated,
    and when NAT had moved the flow's source port to keep conntrack tuples unique (a client
    port reused on another frontend of this backend), it goes to a port nobody listens on."""
    sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
    while True:
        data, ancillary, _flags, peer = sock.recvmsg(65535, socket.CMSG_SPACE(PKTINFO.size))
        source = [
            (level, kind, PKTINFO.pack(0, PKTINFO.unpack(body)[2], bytes(4)))
            for level, kind, body in ancillary
            if (level, kind) == (socket.IPPROTO_IP, IP_PKTINFO)
        ]
        sock.sendmsg([name + b" " + data], source, 0, peer)


class LineEcho(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for line in self.rfile:
            self.wfile.write(line)
            self.wfile.flush()


class NamedLineEcho(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        name = self.server.pod_name.encode()  # type: ignore[attr-defined]
        for line in self.rfile:
            self.wfile.write(name + b" " + line)
            self.wfile.flush()


class EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class EchoServer6(EchoServer):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        super().server_bind()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True)
    ap.add_argument("--http-port", type=int, action="append")
    ap.add_argument("--udp-port", type=int, action="append")
    ap.add_argument("--blob")
    ap.add_argument("--tcp-echo-port", type=int, action="append", default=[])
    ap.add_argument("--tcp-named-echo-port", type=int, action="append", default=[])
    ap.add_argument("--ipv6", action="store_true", help="HTTP and TCP echo on [::] too")
    args = ap.parse_args(argv)
    http_ports = args.http_port or [8080]
    udp_ports = args.udp_port if args.udp_port is not None else [9000]

    threads: list[threading.Thread] = []
    for port in udp_ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        threads.append(threading.Thread(target=udp_echo, args=(sock, args.name.encode()), daemon=True))
    http_servers = [(Server, "0.0.0.0"), *([(Server6, "::")] if args.ipv6 else [])]
    for (server_class, any_addr), port in ((s, p) for s in http_servers for p in http_ports):
        server = server_class((any_addr, port), Handler)
        server.pod_name = args.name
        server.blob = args.blob
        threads.append(threading.Thread(target=server.serve_forever, daemon=True))
    echo_servers = [(EchoServer, "0.0.0.0"), *([(EchoServer6, "::")] if args.ipv6 else [])]
    for (echo_class, any_addr), port in ((s, p) for s in echo_servers for p in args.tcp_echo_port):
        echo = echo_class((any_addr, port), LineEcho)
        threads.append(threading.Thread(target=echo.serve_forever, daemon=True))
    for port in args.tcp_named_echo_port:
        named = EchoServer(("0.0.0.0", port), NamedLineEcho)
        named.pod_name = args.name  # type: ignore[attr-defined]
        threads.append(threading.Thread(target=named.serve_forever, daemon=True))
    for t in threads:
        t.start()
    print(f"podserver ready: {args.name} http {http_ports} udp {udp_ports}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
