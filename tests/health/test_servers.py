"""The healthz and metrics listeners: served over real sockets on 127.0.0.1, a taken port retried
(kube-proxy retries every 5 s) or fatal with --bind-address-hard-fail."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from agent.clock import FakeClock
from agent.config import Config
from agent.health import ProxyHealth, healthz_server
from agent.httpserve import AddressServer, Response, parse_address


def fetch(host: str, port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_healthz_port_serves_healthz_and_livez() -> None:
    health = ProxyHealth(60.0, FakeClock())
    codes: list[tuple[str, int]] = []
    server = healthz_server(
        Config(healthz_bind_address="127.0.0.1:0"), health, lambda w, c: codes.append((w, c))
    )
    server.start()
    try:
        assert server.bound is not None
        host, port = server.bound
        status, headers, body = fetch(host, port, "/healthz")
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert json.loads(body)["nodeEligible"] is True
        health.sync_node({"metadata": {"name": "n", "deletionTimestamp": "2024-01-01T00:00:00Z"}})
        assert fetch(host, port, "/healthz")[0] == 503
        assert fetch(host, port, "/livez")[0] == 200
        assert fetch(host, port, "/metrics")[0] == 404
        assert codes == [("healthz", 200), ("healthz", 503), ("livez", 200)]
    finally:
        server.stop()


def test_a_taken_port_is_retried_until_it_is_free(caplog: pytest.LogCaptureFixture) -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    server = AddressServer("healthz", f"127.0.0.1:{port}", lambda r: Response(200, b"ok"), retry_s=0.05)
    server.start()
    try:
        assert server.bound is None
        assert (
            f"healthz server cannot listen on 127.0.0.1:{port}: Address already in use; retrying"
            in caplog.text
        )
        blocker.close()
        deadline = time.monotonic() + 5
        while server.bound is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.bound == ("127.0.0.1", port)
        assert fetch("127.0.0.1", port, "/")[::2] == (200, b"ok")
    finally:
        blocker.close()
        server.stop()


def test_hard_fail_raises_instead_of_retrying() -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    server = AddressServer("metrics", f"127.0.0.1:{port}", lambda r: Response(200), hard_fail=True)
    try:
        with pytest.raises(OSError) as exc:
            server.start()
        assert exc.value.errno == 98
    finally:
        blocker.close()
        server.stop()


@pytest.mark.parametrize(
    ("text", "error"),
    [("10256", "is not IP:port"), ("node:10256", "is not an IP address"), ("0.0.0.0:99999", "is not a port")],
)
def test_parse_address_errors(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_address(text)
    assert str(parse_address("[::1]:10249")) == "[::1]:10249"


def test_http_server_has_no_side_effects_before_start() -> None:
    from agent.httpserve import HttpServer

    server = HttpServer("t")
    sock = socket.socket()
    with pytest.raises(RuntimeError, match="add\\(\\) before start\\(\\)"):
        server.add(sock, lambda r: Response(200))
    assert sock.fileno() == -1, "the socket it was handed is closed, not leaked"
    server.stop()  # stopping a server that never started is fine


def test_a_missing_namespace_is_a_bind_error_not_a_crash() -> None:
    from agent.httpserve import Address, listen_all

    (result,) = listen_all([Address("0.0.0.0", 10256)], "ekp-no-such-netns")
    assert isinstance(result, OSError)
    assert "network namespace ekp-no-such-netns: No such file or directory" in str(result)
