"""Slow and idle clients of the agent's health ports, and a probe that times an honest check.

Shared by the lab test of issue 21's first case (tests/adversarial/test_slow_clients.py), which
asserts that probes are answered while slow clients drip headers, and the bench's health part
(bench/health.py), which measures how fast. The lab both use: one agent for node1 of a two-node
lab, a `LoadBalancer` Service with `externalTrafficPolicy: Local` whose endpoint is on node1 (so
node1's healthCheckNodePort answers 200), and more addresses on the external client, for
connections that must not share one source's connection cap.

Every client is a socket created in a lab namespace: traffic stays in the lab.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from lab.core import Lab, NsLike
from lab.harness import Cluster, ep
from lab.objects import Port, service, with_endpoints

N1 = "192.168.0.11"
HEALTHZ = 10256
HC_PORT = 32100
# More addresses of the external client, for connections that must not share one source's cap.
EXTRA = [f"192.168.0.{150 + i}" for i in range(5)]
SLOW = 64  # slow clients per port
IDLE_PER_SOURCE = 32  # idle keep-alive connections per port from each of four EXTRA addresses
DRIP_S = 0.3  # between two header lines of a slow client


def set_up(c: Cluster) -> None:
    """The health lab's Service and client addresses, on a started cluster; node1's
    healthCheckNodePort answers 200 from node2 when this returns."""
    lb = service(
        "lb-local",
        "10.96.5.1",
        [Port("http", 80, 8080, node_port=30500)],
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=HC_PORT,
    )
    c.apply(with_endpoints(lb, [ep(c, "pod-1-1")]))
    for ip in EXTRA:
        c.lab.run("client", "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
    status = probe(c.lab, "node2", N1, HC_PORT, "/")[0]
    if status != 200:
        raise RuntimeError(f"node1's healthCheckNodePort answered {status}, not 200")


def connect(lab: Lab, where: NsLike, ip: str, port: int, source: str = "") -> socket.socket:
    s = lab.socket(where)
    try:
        s.settimeout(2.0)
        if source:
            s.bind((source, 0))
        s.connect((ip, port))
    except BaseException:
        s.close()
        raise
    return s


def read_answer(s: socket.socket) -> tuple[int, bytes]:
    """One HTTP response with a Content-Length; the connection stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        int(v) for k, _, v in (line.partition(": ") for line in lines[1:]) if k.lower() == "content-length"
    )
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed in the body")
        body += chunk
    return int(lines[0].split()[1]), body


def probe(lab: Lab, where: NsLike, ip: str, port: int, path: str) -> tuple[int, float]:
    """(status, seconds from connect to the whole answer) of one GET on a fresh connection, as a
    probe makes it; status 0 when it failed or took over 2 s."""
    with lab.socket(where) as s:  # made before the clock starts: joining a namespace takes a thread
        s.settimeout(2.0)
        start = time.monotonic()
        try:
            s.connect((ip, port))
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: {ip}:{port}\r\nConnection: close\r\n\r\n".encode())
            status, _ = read_answer(s)
        except OSError:
            return 0, time.monotonic() - start
        return status, time.monotonic() - start


def is_open(s: socket.socket) -> bool:
    """Whether the agent has not closed `s` (nothing is expected to arrive on it)."""
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.setblocking(True)


class Drips:
    """`count` connections from the external client, each sending a request line and then one
    header line per `drip()`: a request head that never completes."""

    def __init__(self, lab: Lab, ip: str, port: int, count: int, source: str = "") -> None:
        self.socks: list[socket.socket] = []
        self.opened: dict[socket.socket, float] = {}
        self.closed_after: list[float] = []  # seconds from each one's connect to its close seen
        self.started = time.monotonic()
        try:
            for _ in range(count):
                s = connect(lab, "client", ip, port, source)
                self.opened[s] = time.monotonic()
                self.socks.append(s)
                s.sendall(b"GET / HTTP/1.1\r\nHost: lab\r\n")
        except BaseException:
            self.close()
            raise
        self._round = 0

    def drip(self) -> int:
        """One more header line on every connection still open; how many are open."""
        self._round += 1
        for s in list(self.socks):
            try:
                if not is_open(s):
                    raise ConnectionResetError
                s.sendall(b"X-Drip-%d: 1\r\n" % self._round)
            except OSError:
                self.socks.remove(s)
                s.close()
                self.closed_after.append(time.monotonic() - self.opened[s])
        return len(self.socks)

    def close(self) -> None:
        for s in self.socks:
            s.close()


def kept_alive(
    lab: Lab, ip: str, port: int, path: str, sources: Sequence[str], each: int
) -> dict[socket.socket, float]:
    """Connections that asked once, got their answer, and stay open without a word (keep-alive),
    each with the time its answer arrived."""
    out: dict[socket.socket, float] = {}
    try:
        for source in sources:
            for _ in range(each):
                s = connect(lab, "client", ip, port, source)
                out[s] = 0.0
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: {ip}:{port}\r\n\r\n".encode())
                status = read_answer(s)[0]
                if status not in (200, 503):
                    raise RuntimeError(f"{ip}:{port}{path} answered {status}")
                out[s] = time.monotonic()
    except BaseException:
        for s in out:
            s.close()
        raise
    return out
