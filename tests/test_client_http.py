"""lab/client.py's plain HTTP GET (`http` mode): the request urllib sent, each answer read as urllib
read it (whole, a byte a segment, a byte a read), and a start that imports no HTTP library (a suite
starts hundreds of clients). Loopback only: no lab, no root."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from lab import client as client_module

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

# A recorder thread that dies (an exception) fails its test rather than leaving the next client
# to time out in the listening socket's backlog.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

CLIENT = str(Path(__file__).resolve().parents[1] / "lab" / "client.py")

# Each answer a lab server (podserver, nginx, the agent's health and metrics servers) or a broken
# one may give, by path.
ANSWERS = {
    "/length": b"HTTP/1.0 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\npod-1\nNOT-BODY",
    "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\npod-\r\n2\r\n2\n\r\n0\r\n\r\n",
    "/to-close": b"HTTP/1.0 200 OK\r\n\r\nuntil the close\n",
    "/continue": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n",
    "/404": b"HTTP/1.0 404 Not Found\r\nContent-Length: 3\r\n\r\nno\n",
    "/503": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    "/nothing": b"",
    # Answers http.client reads by its own rules, each one a difference the review found.
    "/bad-length": b"HTTP/1.0 200 OK\r\nContent-Length: six\r\n\r\nto the close.",
    "/negative-length": b"HTTP/1.0 200 OK\r\nContent-Length: -1\r\n\r\nto the close.",
    "/two-lengths": b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\nContent-Length: 9\r\n\r\nok\nNOT-BODY",
    "/lf-only": b"HTTP/1.0 200 OK\nContent-Length: 3\n\nok\nNOT",
    "/204": b"HTTP/1.1 204 No Content\r\n\r\n",
    "/304": b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n",
    "/103": b"HTTP/1.1 103 Early Hints\r\nLink: </s>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n",
    "/302": b"HTTP/1.1 302 Found\r\nContent-Length: 0\r\n\r\n",
    "/trailer": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nok\n\r\n0\r\nX-T: 1\r\n\r\n",
    "/trailer-eof": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nok\n\r\n0\r\n",
    "/503-cut": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\n{",
}
# Answers after which the server keeps the connection open until the client closes it: a client
# reading them to the close would wait for its timeout.
HELD_OPEN = {"/204", "/304"}
# Cut mid-body: urllib's read() raised http.client.IncompleteRead (and the client crashed).
CUT = {
    "/cut": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\npod",
    "/chunk-cut": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8\r\npod",
}


class Recorder:
    """A loopback server answering by path, keeping each request's bytes; `drip`: each answer a
    byte a segment (TCP_NODELAY), so the client gets its head, chunk-size lines and body in
    pieces."""

    def __init__(self, host: str = "127.0.0.1", drip: bool = False) -> None:
        self.requests: list[bytes] = []
        self.peer_ports: list[int] = []  # each connection's source port, in order
        self.drip = drip
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, 0), family=family)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return  # shut down at the end of the test
            self.peer_ports.append(peer[1])
            with conn:
                conn.settimeout(10.0)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                self.requests.append(data)
                path = data.split(b" ")[1].decode().split("?")[0] if data else ""
                answer = {**ANSWERS, **CUT}.get(path, ANSWERS["/length"])
                try:
                    if self.drip:
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        for i in range(len(answer)):
                            conn.sendall(answer[i : i + 1])
                    else:
                        conn.sendall(answer)
                    if path in HELD_OPEN:
                        while conn.recv(4096):
                            pass
                except (BrokenPipeError, ConnectionResetError):
                    # The client closed once it had what it reads (an error status, the length
                    # it was told): the rest of a drip meets its reset. The next client is served.
                    pass

    def close(self) -> None:
        # close() alone does not wake a thread blocked in accept() on Linux; shutdown() does.
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(timeout=10.0)
        assert not self.thread.is_alive()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.close()


# The oracle: urllib as the client used it, minus the proxy variables it would have read.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def urllib_result(url: str, count: int) -> dict[str, object]:
    """What the client's `http` mode answered when it read through urllib (its code before)."""
    bodies: dict[str, int] = {}
    errors: dict[str, int] = {}
    for _ in range(count):
        try:
            with OPENER.open(url, timeout=3.0) as resp:
                body = resp.read().decode().strip()
            bodies[body] = bodies.get(body, 0) + 1
        except (OSError, urllib.error.URLError) as exc:
            reason = getattr(exc, "reason", exc)
            kind = type(reason).__name__ + ": " + str(reason)
            errors[kind] = errors.get(kind, 0) + 1
    return {"bodies": bodies, "errors": sum(errors.values()), "error_kinds": errors}


def client(*args: str) -> dict[str, object]:
    res = subprocess.run(
        [sys.executable, CLIENT, *args], capture_output=True, text=True, timeout=30, check=True
    )
    out: dict[str, object] = json.loads(res.stdout)
    return out


@pytest.mark.parametrize("drip", [False, True], ids=["whole", "drip"])
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
@pytest.mark.parametrize("path", [*ANSWERS, "/q?x=1", ""])
def test_the_http_client_sends_urllibs_request_and_reads_each_answer_as_it_did(
    path: str, host: str, drip: bool
) -> None:
    recorder = Recorder(host, drip)
    try:
        url = f"http://{host if ':' not in host else f'[{host}]'}:{recorder.port}{path}"
        expected = urllib_result(url, 2)
        by_urllib = list(recorder.requests)
        recorder.requests.clear()
        assert client("http", "--url", url, "--count", "2") == expected
        assert recorder.requests == by_urllib
    finally:
        recorder.close()


class OneByteSocket(socket.socket):
    """A client socket whose every read returns at most one byte: each boundary split, always."""

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        return super().recv(min(bufsize, 1), flags)

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        return super().recv_into(buffer, 1, flags)


@pytest.mark.parametrize("path", [*ANSWERS, *CUT])
def test_a_port_less_url_read_a_byte_at_a_time_is_read_as_urllib_read_it(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """In-process, both fetchers' connect redirected: the URL's port (80, none written) is the one
    asked for, the Host header has none, and reads of one byte each give the answers urllib gave
    (the cut ones excepted: urllib raised IncompleteRead there)."""
    asked: list[tuple[str, int]] = []

    def create_connection(address: tuple[str, int], timeout: float, *_: object) -> socket.socket:
        asked.append(address)
        s = OneByteSocket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(("127.0.0.1", recorder.port))
        return s

    monkeypatch.setattr(socket, "create_connection", create_connection)
    url = f"http://127.0.0.1{path}"
    ours = client_module.cmd_http(argparse.Namespace(url=url, count=1, timeout=3.0, sport=0))
    if path in CUT:
        with pytest.raises(http.client.IncompleteRead):
            OPENER.open(url, timeout=3.0).read()
        kind = f"OSError: incomplete read of {url}: the connection closed mid-body"
        assert ours == {"bodies": {}, "errors": 1, "error_kinds": {kind: 1}}
    else:
        assert ours == urllib_result(url, 1)
    assert asked == [("127.0.0.1", 80)] * 2
    assert recorder.requests[0] == recorder.requests[1]
    assert b"\r\nHost: 127.0.0.1\r\n" in recorder.requests[0]


@pytest.mark.parametrize("drip", [False, True], ids=["whole", "drip"])
def test_an_answer_cut_mid_body_is_counted_as_an_error(drip: bool) -> None:
    recorder = Recorder(drip=drip)
    try:
        for path in CUT:
            url = f"http://127.0.0.1:{recorder.port}{path}"
            kind = f"OSError: incomplete read of {url}: the connection closed mid-body"
            assert client("http", "--url", url) == {"bodies": {}, "errors": 1, "error_kinds": {kind: 1}}
    finally:
        recorder.close()


def test_a_refused_or_silent_server_is_the_same_error_as_urllibs() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed_port = unused.getsockname()[1]
    refused = f"http://127.0.0.1:{closed_port}/"
    assert client("http", "--url", refused, "--count", "1") == urllib_result(refused, 1)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (the backlog), never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        out = client("http", "--url", url, "--count", "1", "--timeout", "0.3")
        assert out == {"bodies": {}, "errors": 1, "error_kinds": {"TimeoutError: timed out": 1}}, out


def test_sport_sends_every_request_from_that_source_port(recorder: Recorder) -> None:
    """`--sport`: each connection from the port given (a probe's one 5-tuple, lab/harness.py
    PROBE_SPORT), the answers read as without it; without it, ports the kernel picks. The server
    closes first: a client's own close would leave the tuple in TIME_WAIT, and the next connect of
    the same tuple fails (EADDRNOTAVAIL), as the option's help says."""
    url = f"http://127.0.0.1:{recorder.port}/to-close"
    sport = 20729  # below the ephemeral range: never one the kernel picks for the run without it
    expected = {"bodies": {"until the close": 2}, "errors": 0, "error_kinds": {}}
    assert client("http", "--url", url, "--count", "2", "--sport", str(sport)) == expected
    assert client("http", "--url", url, "--count", "2") == expected
    ports = recorder.peer_ports
    assert ports[:2] == [sport, sport] and sport not in ports[2:], ports


HEAVY = ("urllib.request", "http.client", "ssl", "email.parser", "hashlib")


@pytest.mark.parametrize("mode", ["http", "udp"])
def test_a_client_start_imports_no_http_library(recorder: Recorder, mode: str) -> None:
    """The modes a suite starts hundreds of times load none of urllib.request, http.client, ssl,
    email or hashlib (a third of a start's CPU; `loop`, `blob`, `upload` still do), their answer
    read and printed: http from the recorder, udp from a loopback echo."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as echo:
        echo.bind(("127.0.0.1", 0))
        if mode == "http":
            args = ["http", "--url", f"http://127.0.0.1:{recorder.port}/chunked"]
            expected: dict[str, object] = {"bodies": {"pod-2": 1}, "errors": 0, "error_kinds": {}}
        else:
            args = ["udp", "--addr", "127.0.0.1", "--port", str(echo.getsockname()[1])]
            expected = {"replies": {"echo": 1}, "lost": 0}

            def answer() -> None:
                data, peer = echo.recvfrom(65535)
                echo.sendto(b"echo " + data, peer)

            threading.Thread(target=answer, daemon=True).start()
        probe = (
            "import runpy, sys\n"
            f"sys.argv = [{CLIENT!r}, *{args!r}]\n"
            "try:\n"
            f"    runpy.run_path({CLIENT!r}, run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    assert exc.code == 0, exc.code\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
        )
        res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == expected
    assert res.stderr.strip().splitlines()[-1] == "[]", res.stderr
