"""What one connection may cost the HTTP servers (`agent.httpserve.Limits`), over real sockets on
127.0.0.1 with short limits: a request head that does not complete in time, an idle keep-alive
connection, a source over its connection cap and a client that stops reading are each cut off,
and none of them delays anyone else's request.

Before aiohttp (issue 21) a pool of workers served the connections with a timeout per read: a
client dripping one header line at a time held a worker for ever, and four of them silenced
/healthz. The lab version, against real agents, is tests/adversarial/test_slow_clients.py.
"""

from __future__ import annotations

import http.client
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from agent.httpserve import Address, HttpServer, Limits, Request, Response, listen_all

HEAD_S = 0.4
LIMITS = Limits(head_timeout_s=HEAD_S, write_timeout_s=HEAD_S, per_source=3)
BIG = 8 << 20  # far more than the socket buffers of one loopback connection hold
SLACK_S = 1.0  # for the server's thread to get a CPU on a busy shared machine


def answer(request: Request) -> Response:
    if request.path == "/big":
        return Response(200, b"x" * BIG, (("Content-Type", "application/octet-stream"),))
    return Response(200, b"ok\n", (("Content-Type", "text/plain; charset=utf-8"),))


@pytest.fixture
def served() -> Iterator[tuple[HttpServer, int]]:
    server = HttpServer("test", limits=LIMITS)
    server.start()
    try:
        (sock,) = listen_all([Address("127.0.0.1", 0)])
        assert isinstance(sock, socket.socket)
        port = sock.getsockname()[1]
        server.add(sock, answer)
        yield server, port
    finally:
        server.stop()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.settimeout(5)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def closed_by_server(s: socket.socket, within_s: float) -> float | None:
    """Seconds until the server closed `s` (EOF or reset) while we keep reading, or None."""
    start = time.monotonic()
    s.settimeout(within_s)
    try:
        while s.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def get(port: int, path: str = "/", source: str = "127.0.0.1") -> tuple[int, bytes, float]:
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0))
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read(), time.monotonic() - start
    finally:
        conn.close()


def wait_for(condition: object, timeout: float = 5.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_request_head_must_be_complete_within_the_deadline(served: tuple[HttpServer, int]) -> None:
    """One header line every 50 ms keeps the connection busy but never completes the head: it is
    closed at the deadline, as is a connection that sends nothing at all."""
    _, port = served
    silent = connect(port)
    dripping = connect(port)
    start = time.monotonic()
    dripping.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
    closed_at = None
    for i in range(40):  # at most 2 s
        try:
            dripping.sendall(b"X-Drip-%d: 1\r\n" % i)
        except (BrokenPipeError, ConnectionResetError):
            closed_at = time.monotonic() - start
            break
        if closed_by_server(dripping, 0.05) is not None:
            closed_at = time.monotonic() - start
            break
    assert closed_at is not None, "a head dripped for 2 s was never cut off"
    assert HEAD_S - 0.05 <= closed_at < HEAD_S + SLACK_S, closed_at
    waited = closed_by_server(silent, 2.0)
    assert waited is not None and waited < HEAD_S + SLACK_S, waited
    silent.close()
    dripping.close()


def test_an_idle_keep_alive_connection_is_closed(served: tuple[HttpServer, int]) -> None:
    _, port = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/")
    first = conn.getresponse()
    assert (first.status, first.read()) == (200, b"ok\n")
    assert first.getheader("Connection") is None, "kept alive"
    time.sleep(HEAD_S / 2)
    conn.request("GET", "/")  # within the deadline: the same connection answers
    assert conn.getresponse().read() == b"ok\n"
    assert conn.sock is not None
    idle = closed_by_server(conn.sock, 3.0)
    assert idle is not None and HEAD_S - 0.05 <= idle < HEAD_S + SLACK_S, idle
    conn.close()


def test_connections_per_source_are_capped(served: tuple[HttpServer, int]) -> None:
    server, port = served
    held = [connect(port) for _ in range(LIMITS.per_source)]
    wait_for(lambda: server.connections() == LIMITS.per_source)
    over = connect(port)
    assert closed_by_server(over, 1.0) is not None, "the connection over the cap is closed at once"
    assert server.refused() == 1
    # Another source is not affected, and neither are the held connections.
    assert get(port, source="127.0.0.2")[:2] == (200, b"ok\n")
    held[0].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert held[0].recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    # A connection that ends gives its place back.
    held.pop().close()
    wait_for(lambda: server.connections() == LIMITS.per_source - 1)
    assert get(port)[:2] == (200, b"ok\n")
    for s in [*held, over]:
        s.close()


def test_a_client_that_stops_reading_is_cut_off(served: tuple[HttpServer, int]) -> None:
    """A client that asks for 8 MiB and reads nothing holds its connection until the socket
    buffers fill, then for write_timeout_s more: then the server drops it and what it queued."""
    server, port = served
    s = connect(port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    wait_for(lambda: server.connections() == 1)
    start = time.monotonic()
    wait_for(lambda: server.connections() == 0, timeout=HEAD_S + 2.0)
    assert time.monotonic() - start >= HEAD_S - 0.05
    # The agent's part has ended; a reset makes the kernel drop what it still queued for us.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_64_slow_clients_and_200_idle_ones_delay_no_request() -> None:
    """The issue's case in miniature, with the default limits: every slow client is connected and
    dripping (none refused, none timed out yet) while each honest request is answered at once."""
    server = HttpServer("test")
    server.start()
    slow: list[socket.socket] = []
    idle: list[http.client.HTTPConnection] = []
    try:
        (sock,) = listen_all([Address("127.0.0.1", 0)])
        assert isinstance(sock, socket.socket)
        port = sock.getsockname()[1]
        server.add(sock, answer)
        for i in range(200):
            conn = http.client.HTTPConnection(
                "127.0.0.1", port, timeout=5, source_address=(f"127.0.1.{i}", 0)
            )
            conn.request("GET", "/")
            assert conn.getresponse().read() == b"ok\n"
            idle.append(conn)
        for _ in range(64):
            s = connect(port, "127.0.0.3")
            s.sendall(b"GET / HTTP/1.1\r\n")
            slow.append(s)
        took = []
        for round in range(10):
            for s in slow:
                s.sendall(b"X-Drip-%d: 1\r\n" % round)
            status, body, seconds = get(port, source="127.0.0.4")
            assert (status, body) == (200, b"ok\n")
            took.append(seconds)
            time.sleep(0.1)
        assert server.connections() == 64 + 200 and server.refused() == 0
        # Each is answered at once; a shared machine may stall one now and then.
        assert max(took) < 1.0 and sum(t < 0.1 for t in took) >= 0.8 * len(took), took
    finally:
        for s in slow:
            s.close()
        for conn in idle:
            conn.close()
        server.stop()


def test_answers_look_like_gos(served: tuple[HttpServer, int]) -> None:
    _, port = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/")
    resp = conn.getresponse()
    assert resp.read() == b"ok\n"
    names = [name for name, _ in resp.getheaders()]
    assert sorted(names) == ["Content-Length", "Content-Type", "Date"], names
    assert resp.getheader("Date", "").endswith(" GMT")
    conn.close()


def test_stop_closes_the_listeners_and_the_connections(served: tuple[HttpServer, int]) -> None:
    server, port = served
    s = connect(port)
    wait_for(lambda: server.connections() == 1)
    server.stop()
    assert closed_by_server(s, 2.0) is not None
    with pytest.raises(ConnectionRefusedError):
        connect(port)
    s.close()
