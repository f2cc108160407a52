"""healthCheckNodePort servers: kube-proxy's TestServer sequence, bodies and headers over real
HTTP on 127.0.0.1, bind failures retried, and the cost of a sync at 10,000 Services."""

from __future__ import annotations

import errno
import gc
import http.client
import json
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pytest

from agent.clock import FakeClock
from agent.config import Config, NodeContext
from agent.health import (
    ProxyHealth,
    ServiceHealthServer,
    health_check_addresses,
    service_response,
)
from agent.httpserve import Address, Handler, HttpServer
from agent.model.types import IPFamily


class FakeListen:
    """Records the addresses asked for; hands out real sockets on 127.0.0.1 (ephemeral ports)."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.sockets: dict[str, socket.socket] = {}
        self.busy: set[int] = set()
        self.netns: set[str] = set()

    def __call__(self, addrs: Sequence[Address], netns: str) -> list[socket.socket | OSError]:
        self.netns.add(netns)
        out: list[socket.socket | OSError] = []
        for addr in addrs:
            self.asked.append(str(addr))
            if addr.port in self.busy:
                out.append(OSError(errno.EADDRINUSE, "Address already in use"))
                continue
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(16)
            self.sockets[str(addr)] = sock
            out.append(sock)
        return out

    def open(self) -> set[str]:
        return {a for a, s in self.sockets.items() if s.fileno() != -1}

    def get(self, addr: str) -> tuple[int, dict[str, str], bytes]:
        port = self.sockets[addr].getsockname()[1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()


@pytest.fixture
def parts() -> Iterator[tuple[ServiceHealthServer, FakeListen, ProxyHealth, FakeClock]]:
    clock = FakeClock()
    health = ProxyHealth(10.0, clock)
    listen = FakeListen()
    server = ServiceHealthServer(health, ("0.0.0.0",), "node1-ns", listen=listen)
    server.start()
    try:
        yield server, listen, health, clock
    finally:
        server.stop()


def check(listen: FakeListen, addr: str, status: int, endpoints: int, healthy: bool = True) -> None:
    code, headers, body = listen.get(addr)
    assert code == status
    doc: dict[str, Any] = json.loads(body)
    assert doc["localEndpoints"] == endpoints
    assert doc["serviceProxyHealthy"] is healthy
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Load-Balancing-Endpoint-Weight"] == str(endpoints)


def test_kube_proxy_TestServer_sequence(
    parts: tuple[ServiceHealthServer, FakeListen, ProxyHealth, FakeClock],
) -> None:
    hcs, listen, health, clock = parts
    hcs.sync_services({})
    hcs.sync_endpoints({})
    hcs.sync_endpoints({"a/b": 93})  # unknown Service: dropped
    assert hcs.open_services() == {}

    hcs.sync_services({"a/b": 9376})
    assert hcs.open_services() == {"a/b": 9376}
    assert listen.open() == {"0.0.0.0:9376"}
    assert listen.netns == {"node1-ns"}
    check(listen, "0.0.0.0:9376", 503, 0)
    hcs.sync_endpoints({"a/b": 18})
    check(listen, "0.0.0.0:9376", 200, 18)
    hcs.sync_endpoints({"a/b": 0})
    check(listen, "0.0.0.0:9376", 503, 0)
    hcs.sync_endpoints({"a/b": 11})
    check(listen, "0.0.0.0:9376", 200, 11)
    hcs.sync_endpoints({})  # missing from the map: 0
    check(listen, "0.0.0.0:9376", 503, 0)
    hcs.sync_endpoints({"a/b": 18})
    hcs.sync_services({})
    assert hcs.open_services() == {} and listen.open() == set()

    hcs.sync_services({"a/b": 9376, "c/d": 12909, "e/f": 11113})
    assert listen.open() == {"0.0.0.0:9376", "0.0.0.0:12909", "0.0.0.0:11113"}
    check(listen, "0.0.0.0:9376", 503, 0)  # a new listener has no endpoints until sync_endpoints
    check(listen, "0.0.0.0:12909", 503, 0)
    hcs.sync_endpoints({"a/b": 9, "c/d": 3, "e/f": 7})
    check(listen, "0.0.0.0:9376", 200, 9)
    check(listen, "0.0.0.0:12909", 200, 3)
    check(listen, "0.0.0.0:11113", 200, 7)

    kept = listen.sockets["0.0.0.0:12909"]
    hcs.sync_services({"c/d": 12909, "e/f": 11114, "g/h": 11878})  # remove a/b, move e/f, add g/h
    assert hcs.open_services() == {"c/d": 12909, "e/f": 11114, "g/h": 11878}
    assert listen.open() == {"0.0.0.0:12909", "0.0.0.0:11114", "0.0.0.0:11878"}
    assert listen.sockets["0.0.0.0:12909"] is kept and kept.fileno() != -1  # left alone
    check(listen, "0.0.0.0:12909", 200, 3)
    hcs.sync_endpoints({"a/b": 9, "c/d": 3, "e/f": 7, "g/h": 6})
    check(listen, "0.0.0.0:11114", 200, 7)
    check(listen, "0.0.0.0:11878", 200, 6)
    hcs.sync_endpoints({"e/f": 7, "g/h": 6})  # c/d missing
    check(listen, "0.0.0.0:12909", 503, 0)

    # An unhealthy proxy fails every Service, even those with endpoints.
    health.updated()
    health.queued_update()
    clock.advance(11)
    check(listen, "0.0.0.0:11114", 503, 7, healthy=False)
    health.updated()
    check(listen, "0.0.0.0:11114", 200, 7, healthy=True)


def test_body_is_upstreams_template_with_tabs() -> None:
    resp = service_response("default/web", 2, True)
    assert resp.status == 200
    assert resp.body == (
        b'{\n\t"service": {\n\t\t"namespace": "default",\n\t\t"name": "web"\n\t},\n'
        b'\t"localEndpoints": 2,\n\t"serviceProxyHealthy": true\n}'
    )
    assert resp.headers == (
        ("Content-Type", "application/json"),
        ("X-Content-Type-Options", "nosniff"),
        ("X-Load-Balancing-Endpoint-Weight", "2"),
    )
    assert service_response("default/web", 0, True).status == 503
    assert service_response("default/web", 3, False).status == 503


def test_any_path_answers_like_upstreams_handler(
    parts: tuple[ServiceHealthServer, FakeListen, ProxyHealth, FakeClock],
) -> None:
    hcs, listen, _, _ = parts
    hcs.sync_services({"a/b": 30001})
    hcs.sync_endpoints({"a/b": 1})
    port = listen.sockets["0.0.0.0:30001"].getsockname()[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/")
    first = conn.getresponse()
    assert first.status == 200 and json.loads(first.read())["service"] == {"namespace": "a", "name": "b"}
    conn.request("HEAD", "/anything")  # same kept-alive connection
    second = conn.getresponse()
    assert second.status == 200 and second.read() == b""
    assert "Server" not in dict(second.getheaders())
    conn.close()


def test_port_that_cannot_be_bound_is_logged_and_retried(
    parts: tuple[ServiceHealthServer, FakeListen, ProxyHealth, FakeClock], caplog: pytest.LogCaptureFixture
) -> None:
    hcs, listen, _, _ = parts
    errors: list[tuple[str, int, str]] = []
    hcs._on_listen_error = lambda s, p, e: errors.append((s, p, e))
    listen.busy.add(30002)
    hcs.sync_services({"a/b": 30002, "c/d": 30003})
    assert hcs.open_services() == {"c/d": 30003}
    assert "a/b" in hcs.failed_services()
    assert "cannot listen on healthCheckNodePort 30002 of Service a/b: Address already in use" in caplog.text
    assert errors == [("a/b", 30002, "Address already in use")]
    hcs.sync_services({"a/b": 30002, "c/d": 30003})  # retried, still busy: logged once
    assert listen.asked.count("0.0.0.0:30002") == 2 and listen.asked.count("0.0.0.0:30003") == 1
    assert caplog.text.count("cannot listen on healthCheckNodePort 30002") == 1
    listen.busy.clear()
    hcs.sync_endpoints({"a/b": 4})
    hcs.sync_services({"a/b": 30002, "c/d": 30003})
    assert hcs.open_services() == {"a/b": 30002, "c/d": 30003}
    assert hcs.failed_services() == {}
    check(listen, "0.0.0.0:30002", 503, 0)
    hcs.sync_endpoints({"a/b": 4})  # the same map as before: the new listener still gets its count
    check(listen, "0.0.0.0:30002", 200, 4)


def test_all_addresses_or_none() -> None:
    health = ProxyHealth(10.0, FakeClock())
    listen = FakeListen()
    calls: list[list[str]] = []

    def partial(addrs: Sequence[Address], netns: str) -> list[socket.socket | OSError]:
        calls.append([str(a) for a in addrs])
        out = listen(addrs[:1], netns)
        return [*out, OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")]

    hcs = ServiceHealthServer(health, ("192.168.0.11", "10.0.0.1"), listen=partial)
    hcs.start()
    try:
        hcs.sync_services({"a/b": 30004})
        assert calls == [["192.168.0.11:30004", "10.0.0.1:30004"]]
        assert hcs.open_services() == {}
        assert listen.open() == set(), "the address that did bind is closed again"
    finally:
        hcs.stop()


def test_addresses_follow_nodeport_addresses() -> None:
    node = NodeContext(node_ips=("192.168.0.11", "10.0.0.5"), primary_ip="192.168.0.11")
    assert health_check_addresses(Config(), node) == ("0.0.0.0",)
    assert health_check_addresses(Config(nodeport_addresses=("192.168.0.0/24",)), node) == ("192.168.0.11",)
    assert health_check_addresses(Config(nodeport_addresses=("127.0.0.0/8", "10.0.0.0/8")), node) == (
        "127.0.0.1",
        "10.0.0.5",
    )
    assert health_check_addresses(Config(nodeport_addresses=("primary",)), node) == ("192.168.0.11",)
    # Nothing matches: upstream logs and listens everywhere.
    assert health_check_addresses(Config(nodeport_addresses=("172.16.0.0/12",)), node) == ("0.0.0.0",)


def test_each_family_takes_its_own_nodeport_addresses_for_health_checks() -> None:
    """Upstream's NewNodePortAddresses(family, ...): a family none of whose CIDRs is given (or
    with its zero CIDR) listens on its own wildcard; the IPv6 server never on an IPv4 one."""
    node6 = NodeContext(("fd00:192:168::11", "fd00:10::5"), "fd00:192:168::11")
    v6 = IPFamily.IPv6
    assert health_check_addresses(Config(), node6, v6) == ("::",)
    assert health_check_addresses(Config(nodeport_addresses=("192.168.0.0/24",)), node6, v6) == ("::",)
    dual = Config(nodeport_addresses=("192.168.0.0/24", "fd00:192:168::/64"))
    assert health_check_addresses(dual, node6, v6) == ("fd00:192:168::11",)
    v4node = NodeContext(("192.168.0.11",), "192.168.0.11")
    assert health_check_addresses(dual, v4node) == ("192.168.0.11",)
    assert health_check_addresses(Config(nodeport_addresses=("fd00:192:168::/64",)), v4node) == ("0.0.0.0",)
    assert health_check_addresses(Config(nodeport_addresses=("::/0", "192.168.0.0/24")), node6, v6) == ("::",)


def _svc(name: str, hc: int, etp: str = "Local", ports: int = 1) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": "LoadBalancer",
        "clusterIP": f"10.96.0.{10 + hc % 200}",
        "externalTrafficPolicy": etp,
        "ports": [{"name": f"p{i}", "port": 80 + i, "nodePort": 30080 + i + hc % 100} for i in range(ports)],
    }
    if hc:
        spec["healthCheckNodePort"] = hc
    return {"kind": "Service", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def _slice(svc: str, eps: list[dict[str, Any]], ports: int = 1) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{svc}-1",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": "IPv4",
        "ports": [{"name": f"p{i}", "port": 8080 + i, "protocol": "TCP"} for i in range(ports)],
        "endpoints": eps,
    }


def _ep(ip: str, node: str, ready: bool = True, terminating: bool = False) -> dict[str, Any]:
    return {
        "addresses": [ip],
        "nodeName": node,
        "conditions": {"ready": ready, "serving": ready or terminating, "terminating": terminating},
    }


class Recorded(HttpServer):
    """Keeps what it is handed instead of serving it (real listeners: test_health_in_lab.py)."""

    def __init__(self) -> None:
        super().__init__("recorded")
        self.served: dict[socket.socket, Handler] = {}

    def add_all(self, pairs: Sequence[tuple[socket.socket, Handler]]) -> None:
        self.served.update(pairs)

    def remove_all(self, socks: Iterable[socket.socket]) -> None:
        for sock in socks:
            del self.served[sock]
            sock.close()


def test_cost_at_10000_services_grows_with_the_change_not_the_cluster() -> None:
    health = ProxyHealth(10.0, FakeClock())
    asked: list[str] = []

    def cheap(addrs: Sequence[Address], netns: str) -> list[socket.socket | OSError]:
        asked.extend(str(a) for a in addrs)
        return [socket.socket() for _ in addrs]  # an fd each, never bound: no port is used

    server = Recorded()
    hcs = ServiceHealthServer(health, ("0.0.0.0",), listen=cheap, server=server)
    hcs.start()
    try:
        ports = {f"ns/svc-{i}": 20000 + i for i in range(10_000)}
        counts = {f"ns/svc-{i}": 1 + i % 3 for i in range(10_000)}
        hcs.sync_services(ports)
        hcs.sync_endpoints(counts)
        assert len(asked) == 10_000
        ports2 = dict(ports)
        ports2["ns/svc-7"] = 29999
        counts2 = dict(counts)
        counts2["ns/svc-8"] = 0
        opened = dict(hcs._open)
        gc.collect()
        t0 = time.perf_counter()
        hcs.sync_services(ports2)
        t1 = time.perf_counter()
        hcs.sync_endpoints(counts2)
        t2 = time.perf_counter()
        hcs.sync_services(dict(ports2))
        hcs.sync_endpoints(dict(counts2))
        t3 = time.perf_counter()
        assert asked[10_000:] == ["0.0.0.0:29999"]  # only the moved Service was touched
        assert len(server.served) == 10_000
        # what a change costs is shown structurally (speed is make bench's): nothing but the moved
        # Service's listener was made again
        assert [k for k in opened if hcs._open[k] is not opened[k]] == ["ns/svc-7"]
        assert hcs._open["ns/svc-8"].endpoints == 0 and hcs._open["ns/svc-9"].endpoints == 1 + 9 % 3
        print(
            f"\n10,000 Services: sync_services with 1 change {1e3 * (t1 - t0):.2f} ms, "
            f"sync_endpoints with 1 change {1e3 * (t2 - t1):.2f} ms, both unchanged {1e3 * (t3 - t2):.2f} ms"
        )
    finally:
        hcs.stop()
