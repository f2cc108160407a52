"""lab/client.py's plain HTTP GET (`http` mode): the request urllib sent, each answer read as urllib
read it, and a start that imports no HTTP library (a suite starts hundreds of clients). Loopback
only: no lab, no root."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

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
}


class Recorder:
    """A loopback server answering by path, keeping each request's bytes."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed at the end of the test
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                self.requests.append(data)
                path = data.split(b" ")[1].decode().split("?")[0] if data else ""
                conn.sendall(ANSWERS.get(path, ANSWERS["/length"]))


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.sock.close()


def urllib_result(url: str, count: int) -> dict[str, object]:
    """What the client's `http` mode answered when it read through urllib (its code before)."""
    bodies: dict[str, int] = {}
    errors: dict[str, int] = {}
    for _ in range(count):
        try:
            with urllib.request.urlopen(url, timeout=3.0) as resp:
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


@pytest.mark.parametrize("path", [*ANSWERS, "/q?x=1", ""])
def test_the_http_client_sends_urllibs_request_and_reads_each_answer_as_it_did(
    recorder: Recorder, path: str
) -> None:
    url = f"http://127.0.0.1:{recorder.port}{path}"
    expected = urllib_result(url, 2)
    by_urllib = list(recorder.requests)
    recorder.requests.clear()
    assert client("http", "--url", url, "--count", "2") == expected
    assert recorder.requests == by_urllib


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


HEAVY = ("urllib.request", "http.client", "ssl", "email.parser", "hashlib")


@pytest.mark.parametrize(
    "args",
    [
        ["http", "--url", "http://127.0.0.1:1/", "--count", "1"],
        ["udp", "--addr", "127.0.0.1", "--port", "1", "--timeout", "0.01"],
    ],
    ids=["http", "udp"],
)
def test_a_client_start_imports_no_http_library(args: list[str]) -> None:
    """The modes a suite starts hundreds of times load none of urllib.request, http.client, ssl,
    email or hashlib (the half of a start's CPU they cost; `loop`, `blob`, `upload` still do)."""
    probe = (
        "import runpy, sys\n"
        f"sys.argv = [{CLIENT!r}, *{args!r}]\n"
        "try:\n"
        f"    runpy.run_path({CLIENT!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert res.stderr.strip().splitlines()[-1] == "[]", res.stderr
