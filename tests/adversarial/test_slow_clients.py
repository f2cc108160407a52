"""Slow and idle clients against a real agent's health ports, both modes (issue 21, item 1).

Port 10256 listens on every node address, and healthCheckNodePorts are what cloud load balancers
probe: anyone who can reach the node can open connections to them. Before this the agent served
each port from a fixed pool of workers (4 for /healthz, 8 shared by every healthCheckNodePort) with
a timeout per read, so four clients sending one header line every few seconds silenced /healthz for
ever: the chart's liveness probe restarted the agent and load balancers pulled the node. kube-proxy
serves each connection on its own goroutine.

Here, with one agent for node1 of a two-node lab and a `LoadBalancer` Service with
`externalTrafficPolicy: Local` whose endpoint is on node1:

* 64 clients drip a request head to 10256 and 64 to the healthCheckNodePort, one header line every
  0.3 s, while 128 idle keep-alive connections (from four more addresses of the external client)
  sit on each port: /healthz probed from the node itself (as the kubelet does) and the
  healthCheckNodePort probed from node2 (standing in for a load balancer's checker) are answered
  at once (80% within 100 ms, every one within 1 s; before, none within 2 s), and every slow
  client is still connected meanwhile;
* the agent closes the slow and the idle connections at the request-head deadline;
* a source address over its connection cap has its extra connections closed on arrival, with one
  log line, and other sources are served.

Traffic stays in the lab: the clients are sockets created in the lab's namespaces.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Sequence

import pytest

from agent.httpserve import Limits
from lab import Lab
from lab.core import NsLike
from lab.harness import Cluster, ep
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

N1 = "192.168.0.11"
HEALTHZ = 10256
HC_PORT = 32100
# More addresses of the external client, for connections that must not share one source's cap.
EXTRA = [f"192.168.0.{150 + i}" for i in range(5)]
LIMITS = Limits()  # the agent's own
SLOW = 64
IDLE_PER_SOURCE = 32
DRIP_S = 0.3
ROUNDS = 10  # 3 s of dripping, inside the 5 s head deadline
FAST_S = 0.1


@pytest.fixture(scope="module", params=["ebpf", "iptables"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=2, pods_per_node=1) as lab:
        lab.start_podservers()
        c = Cluster(lab, request.param, agent_nodes=[1])
        c.start()
        try:
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
                lab.run("client", "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
            assert probe(lab, "node2", N1, HC_PORT, "/")[0] == 200
            yield c
        finally:
            failures = c.stop()
        assert not failures, failures


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
        for _ in range(count):
            s = connect(lab, "client", ip, port, source)
            self.opened[s] = time.monotonic()
            self.socks.append(s)
            s.sendall(b"GET / HTTP/1.1\r\nHost: lab\r\n")
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
                assert read_answer(s)[0] in (200, 503)
                out[s] = time.monotonic()
    except BaseException:
        for s in out:
            s.close()
        raise
    return out


def test_health_answers_within_100ms_while_64_slow_clients_drip_and_idle_ones_wait(cluster: Cluster) -> None:
    """Before, no probe was answered at all: every worker was held. Now each is answered at once:
    on this shared two-CPU machine single probes were seen taking 100-200 ms while the agent did
    nothing (its log silent, its threads not waiting for a CPU), so the test holds 80% of the
    probes to 100 ms (typically 1-10 ms) and every one to 1 s, rather than each to 100 ms."""
    lab = cluster.lab
    idle = kept_alive(lab, N1, HEALTHZ, "/healthz", EXTRA[:4], IDLE_PER_SOURCE)
    idle |= kept_alive(lab, N1, HC_PORT, "/", EXTRA[:4], IDLE_PER_SOURCE)
    slow = [Drips(lab, N1, HEALTHZ, SLOW), Drips(lab, N1, HC_PORT, SLOW)]
    probes: dict[str, list[tuple[int, float]]] = {"healthz": [], "hc": []}
    try:
        # Inside the request-head deadline, so every slow client stays connected and holds
        # whatever it can hold.
        for _ in range(ROUNDS):
            assert [d.drip() for d in slow] == [SLOW, SLOW], "every slow client is still connected"
            # As the kubelet probes the agent, and as a load balancer's checker probes the node.
            probes["healthz"].append(probe(lab, "node1", "127.0.0.1", HEALTHZ, "/healthz"))
            probes["hc"].append(probe(lab, "node2", N1, HC_PORT, "/"))
            time.sleep(DRIP_S)
        # Every idle connection is held until its head deadline, counted from its answer: the
        # 256 take a while to set up on a loaded machine (the first ones' deadline had passed
        # here when 197 of 256 were open: closed on time, not early).
        now = time.monotonic()
        early = [now - answered for s, answered in idle.items() if not is_open(s)]
        assert len(idle) == 2 * 4 * IDLE_PER_SOURCE
        assert all(age >= LIMITS.head_timeout_s - 0.2 for age in early), (
            f"closed before the deadline: {early}"
        )
        shown = {what: [(status, round(took, 4)) for status, took in got] for what, got in probes.items()}
        print(f"\n{cluster.mode}: (status, seconds) per probe: {shown}")
        for got in probes.values():
            assert all(status == 200 and took < 1.0 for status, took in got), shown
            assert sum(took < FAST_S for _, took in got) >= 0.8 * len(got), shown
    finally:
        for d in slow:
            d.close()
        for s in idle:
            s.close()


def test_slow_and_idle_connections_are_closed_at_the_head_deadline(cluster: Cluster) -> None:
    lab = cluster.lab
    idle = kept_alive(lab, N1, HEALTHZ, "/livez", EXTRA[:2], IDLE_PER_SOURCE)
    slow = Drips(lab, N1, HEALTHZ, SLOW)
    deadline = LIMITS.head_timeout_s
    idle_closed: list[float] = []
    try:
        while (slow.socks or len(idle_closed) < len(idle)) and time.monotonic() - slow.started < deadline + 3:
            slow.drip()
            for s in idle:
                if s.fileno() != -1 and not is_open(s):
                    idle_closed.append(time.monotonic() - idle[s])
                    s.close()
            time.sleep(0.1)
        assert not slow.socks, f"{len(slow.socks)} slow clients still connected after {deadline + 3}s"
        assert deadline - 0.2 <= min(slow.closed_after) and max(slow.closed_after) < deadline + 1.5, (
            slow.closed_after
        )
        assert len(idle_closed) == len(idle), "every idle keep-alive connection is closed"
        assert deadline - 0.2 <= min(idle_closed) and max(idle_closed) < deadline + 1.5, idle_closed
    finally:
        slow.close()
        for s in idle:
            s.close()


def test_a_source_over_its_connection_cap_is_refused_and_others_are_served(cluster: Cluster) -> None:
    lab = cluster.lab
    agent = cluster.agents[0]
    extra = 16
    held = [connect(lab, "client", N1, HEALTHZ, EXTRA[4]) for _ in range(LIMITS.per_source + extra)]
    try:
        time.sleep(0.5)  # far less than the head deadline: only the cap closes anything
        open_now = sum(is_open(s) for s in held)
        assert open_now == LIMITS.per_source, f"{open_now} of {len(held)} open"
        status, took = probe(lab, "node1", "127.0.0.1", HEALTHZ, "/healthz")
        assert status == 200 and took < 1.0, (status, took)
        status, took = probe(lab, "client", N1, HEALTHZ, "/healthz")  # the client's main address
        assert status == 200 and took < 1.0, (status, took)
        assert (
            f"healthz: closing new connections from {EXTRA[4]}: it has {LIMITS.per_source} open already, "
            "the limit per source address" in agent.log()
        ), agent.log()[-2000:]
    finally:
        for s in held:
            s.close()
