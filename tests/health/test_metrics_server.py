"""The metrics port's mux as kube-proxy's serveMetrics: /metrics, /proxyMode, /healthz, /configz,
/metrics/slis, 404s; then the same through a real socket on 127.0.0.1."""

from __future__ import annotations

import gzip
import http.client
import json
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from agent.config import Config, Mode
from agent.httpserve import AddressServer, request_from_target
from agent.metrics import Metrics
from agent.metrics.exposition import CONTENT_TYPE
from agent.metrics.server import MetricsHandlers, metrics_server


@pytest.fixture
def handlers() -> MetricsHandlers:
    registry = CollectorRegistry()
    Metrics(registry).record_sync(True, 0.01)
    return MetricsHandlers(registry, "ebpf", lambda: {"Mode": "ebpf", "SyncPeriod": "30s"})


def get(
    h: MetricsHandlers, target: str, method: str = "GET", **headers: str
) -> tuple[int, dict[str, str], bytes]:
    resp = h(request_from_target(method, target, headers))
    return resp.status, dict(resp.headers), resp.body


def test_metrics_is_the_go_text_format(handlers: MetricsHandlers) -> None:
    status, headers, body = get(handlers, "/metrics")
    assert status == 200
    assert headers == {"Content-Type": CONTENT_TYPE}
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8; escaping=underscores"
    assert b'kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"} 1\n' in body
    status, headers, zipped = get(handlers, "/metrics", **{"Accept-Encoding": "gzip, deflate"})
    assert headers["Content-Encoding"] == "gzip"
    # The process collector reads RSS at each render, and gzip's buffers move it in between.
    assert without_process(gzip.decompress(zipped)) == without_process(body)


def without_process(text: bytes) -> list[bytes]:
    return [line for line in text.splitlines() if b"process_" not in line]


def test_proxy_mode_is_plain_text(handlers: MetricsHandlers) -> None:
    assert get(handlers, "/proxyMode") == (
        200,
        {"Content-Type": "text/plain; charset=utf-8", "X-Content-Type-Options": "nosniff"},
        b"ebpf",
    )


def test_healthz_is_apiservers_ping(handlers: MetricsHandlers) -> None:
    assert get(handlers, "/healthz")[::2] == (200, b"ok")
    assert get(handlers, "/healthz?verbose")[2] == b"[+]ping ok\nhealthz check passed\n"
    assert (
        get(handlers, "/healthz?verbose&exclude=ping")[2] == b"[+]ping excluded: ok\nhealthz check passed\n"
    )
    assert get(handlers, "/healthz?verbose&exclude=etcd")[2] == (
        b"[+]ping ok\n"
        b'warn: some health checks cannot be excluded: no matches for "etcd"\n'
        b"healthz check passed\n"
    )
    assert get(handlers, "/healthz/ping")[::2] == (200, b"ok")


def test_slis_count_the_healthz_checks_and_reset_on_delete(handlers: MetricsHandlers) -> None:
    get(handlers, "/healthz")
    get(handlers, "/healthz?verbose")
    body = get(handlers, "/metrics/slis")[2].decode()
    assert (
        "# HELP kubernetes_healthcheck [STABLE] This metric records the result of a single healthcheck.\n"
        in body
    )
    assert 'kubernetes_healthcheck{name="ping",type="healthz"} 1\n' in body
    assert 'kubernetes_healthchecks_total{name="ping",status="success",type="healthz"} 2\n' in body
    assert get(handlers, "/metrics/slis", "DELETE")[0] == 200
    assert "kubernetes_healthchecks_total" not in get(handlers, "/metrics/slis")[2].decode()


def test_configz_wraps_the_config_in_its_group(handlers: MetricsHandlers) -> None:
    status, headers, body = get(handlers, "/configz")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"kubeproxy.config.k8s.io": {"Mode": "ebpf", "SyncPeriod": "30s"}}


def test_other_paths_are_gos_404(handlers: MetricsHandlers) -> None:
    assert get(handlers, "/debug/pprof/")[::2] == (404, b"404 page not found\n")
    assert get(handlers, "/metrics/")[0] == 404


@pytest.fixture
def served() -> Iterator[AddressServer]:
    registry = CollectorRegistry()
    Metrics(registry, Mode.IPTABLES).record_sync(False, 0.2)
    server = metrics_server(Config(mode=Mode.IPTABLES, metrics_bind_address="127.0.0.1:0"), registry)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_served_over_http_on_the_configured_address(served: AddressServer) -> None:
    assert served.bound is not None
    host, port = served.bound
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.request("GET", "/proxyMode")
    resp = conn.getresponse()
    assert (resp.status, resp.read()) == (200, b"iptables")
    conn.request("GET", "/metrics")  # the same kept-alive connection
    resp = conn.getresponse()
    headers = dict(resp.getheaders())
    assert headers["Content-Type"] == CONTENT_TYPE and "Date" in headers and "Server" not in headers
    assert b"kubeproxy_sync_partial_proxy_rules_duration_seconds_sum" in resp.read()
    conn.close()


def test_disabled_with_an_empty_address() -> None:
    server = metrics_server(Config(metrics_bind_address=""), CollectorRegistry())
    server.start()
    assert server.bound is None
    server.stop()
