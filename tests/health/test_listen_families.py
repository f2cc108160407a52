"""Which families the agent's listeners take, as kube-proxy's Go listeners do.

* `/healthz` on the default `0.0.0.0:10256`: Go's `net.Listen("tcp", "0.0.0.0:port")` opens one
  IPv6 socket that takes IPv4 too, so a probe over IPv6 reaches it on a dual-stack node.
* healthCheckNodePorts: each IP family's proxier owns a ServiceHealthServer, and since
  kubernetes#137370 each binds its own family's sockets (Go's tcp4 / tcp6), so the IPv4 and IPv6
  servers of one dual-stack Service's port coexist, each answering its own family's count.

Everything runs in a scratch network namespace (its loopback only).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from agent.clock import FakeClock
from agent.health import ProxyHealth, ServiceHealthServer
from agent.httpserve import Address, HttpServer, listen_all
from agent.netns import run_in_netns

pytestmark = pytest.mark.kernel

PORT = 31000


@pytest.fixture
def netns(kernel_required: None) -> Iterator[str]:
    name = f"ekp-listen-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def connects(netns: str, host: str, port: int) -> bool:
    def attempt() -> bool:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            return sock.connect_ex((host, port)) == 0

    return run_in_netns(netns, attempt)


def fetch(netns: str, host: str, port: int) -> tuple[int, dict[str, object]]:
    def get() -> tuple[int, dict[str, object]]:
        conn = http.client.HTTPConnection(host, port, timeout=5)
        try:
            conn.request("GET", "/")
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    return run_in_netns(netns, get)


def test_the_ipv4_wildcard_listens_on_both_families_as_go_does(netns: str) -> None:
    (sock,) = listen_all([Address("0.0.0.0", PORT)], netns)
    assert isinstance(sock, socket.socket)
    try:
        assert sock.family == socket.AF_INET6
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        assert connects(netns, "127.0.0.1", PORT) and connects(netns, "::1", PORT)
    finally:
        sock.close()


def test_family_only_wildcards_share_a_port_and_each_takes_its_own_family(netns: str) -> None:
    v4, v6 = listen_all(
        [Address("0.0.0.0", PORT, family_only=True), Address("::", PORT, family_only=True)], netns
    )
    assert isinstance(v4, socket.socket) and isinstance(v6, socket.socket)
    try:
        assert v4.family == socket.AF_INET and v6.family == socket.AF_INET6
        assert v6.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        assert connects(netns, "127.0.0.1", PORT) and connects(netns, "::1", PORT)
    finally:
        v4.close()
        v6.close()


def test_two_dual_stack_wildcards_collide_as_upstream_did_before_137370(netns: str) -> None:
    first, second = listen_all([Address("0.0.0.0", PORT), Address("::", PORT)], netns)
    try:
        assert isinstance(first, socket.socket)
        assert isinstance(second, OSError) and "Address already in use" in str(second)
    finally:
        for sock in (first, second):
            if isinstance(sock, socket.socket):
                sock.close()


def test_each_familys_health_check_server_answers_with_its_own_count_on_one_port(netns: str) -> None:
    health = ProxyHealth(60.0, FakeClock())
    health.updated("IPv4")
    health.updated("IPv6")
    v4 = ServiceHealthServer(health, ("0.0.0.0",), netns, server=HttpServer("hc4"))
    v6 = ServiceHealthServer(health, ("::",), netns, server=HttpServer("hc6"))
    v4.start()
    v6.start()
    try:
        v4.sync_services({"default/web": PORT})
        v6.sync_services({"default/web": PORT})
        assert v4.failed_services() == {} and v6.failed_services() == {}, "both bind the port"
        v4.sync_endpoints({"default/web": 1})
        v6.sync_endpoints({"default/web": 2})
        status, body = fetch(netns, "127.0.0.1", PORT)
        assert status == 200 and body["localEndpoints"] == 1
        status, body = fetch(netns, "::1", PORT)
        assert status == 200 and body["localEndpoints"] == 2
        v6.sync_endpoints({})
        status, body = fetch(netns, "::1", PORT)
        assert status == 503 and body["localEndpoints"] == 0, "no IPv6 endpoint here: IPv6 probes fail"
        assert fetch(netns, "127.0.0.1", PORT)[0] == 200, "while IPv4 ones pass"
    finally:
        v4.stop()
        v6.stop()
