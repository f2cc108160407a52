"""/healthz and /livez: kube-proxy's state machine, bodies, codes and headers, on a fake clock.

The sequence in `test_health_follows_queued_and_updated_like_kube_proxy` is upstream's
testProxyHealthUpdater (pkg/proxy/healthcheck/healthcheck_test.go) step by step; the bodies are
what upstream's handlers print (`json.Marshal` of ProxyHealth) for the same clock readings.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.clock import FakeClock
from agent.health import ProxyHealth, ProxyHealthHandlers, health_timeout_s, node_eligible
from agent.httpserve import request_from_target

T0 = 1_714_557_600 * 10**9  # 2024-05-01T10:00:00Z


def make(
    timeout_s: float = 10.0,
) -> tuple[ProxyHealth, ProxyHealthHandlers, FakeClock, list[tuple[str, int]]]:
    clock = FakeClock(wall_ns=T0)
    health = ProxyHealth(timeout_s, clock)
    counted: list[tuple[str, int]] = []
    return (
        health,
        ProxyHealthHandlers(health, lambda what, code: counted.append((what, code))),
        clock,
        counted,
    )


def test_health_timeout_is_twice_the_sync_period() -> None:
    assert health_timeout_s(30.0) == 60.0


def test_health_follows_queued_and_updated_like_kube_proxy() -> None:
    health, handlers, clock, counted = make()

    def code() -> int:
        return handlers.healthz().status

    assert code() == 200  # by default
    health.updated("IPv4")
    health.updated("IPv6")
    assert code() == 200
    clock.advance(25)
    assert code() == 200  # no update queued: stays healthy however long
    health.queued_update("IPv4")
    clock.advance(25)
    assert code() == 503  # IPv4 late
    health.updated("IPv4")
    health.updated("IPv6")
    clock.advance(5)
    assert code() == 200
    health.queued_update("IPv6")
    clock.advance(25)
    assert code() == 503  # IPv6 late
    health.updated("IPv4")
    health.updated("IPv6")
    clock.advance(5)
    assert code() == 200
    health.queued_update("IPv4")
    health.queued_update("IPv6")
    clock.advance(25)
    assert code() == 503
    health.updated("IPv4")
    health.updated("IPv6")
    clock.advance(5)
    assert code() == 200
    health.queued_update("IPv6")
    clock.advance(25)
    assert code() == 503
    health.updated("IPv4")
    assert code() == 503  # updating the other family does not help
    health.updated("IPv6")
    assert code() == 200
    health.queued_update("IPv4")
    health.queued_update("IPv6")
    clock.advance(25)
    assert code() == 503
    health.updated("IPv4")
    assert code() == 503
    health.updated("IPv6")
    assert code() == 200
    assert counted.count(("healthz", 200)) == 8 and counted.count(("healthz", 503)) == 7


def test_only_the_oldest_queued_change_counts() -> None:
    health, handlers, clock, _ = make()
    health.updated()
    health.queued_update()
    clock.advance(9)
    health.queued_update()  # a newer change does not restart the timer
    clock.advance(1)
    assert handlers.livez().status == 503


def test_queued_change_is_healthy_until_the_timeout() -> None:
    health, handlers, clock, _ = make()
    health.updated()
    health.queued_update()
    clock.advance(9.999)
    assert handlers.livez().status == 200
    clock.advance(0.001)
    assert handlers.livez().status == 503


def test_healthz_body_healthy_is_kube_proxys_json() -> None:
    health, handlers, clock, _ = make()
    health.updated()
    clock.advance(2.5)
    resp = handlers.healthz()
    assert resp.status == 200
    assert resp.headers == (("Content-Type", "application/json"), ("X-Content-Type-Options", "nosniff"))
    # lastUpdated is "now" when healthy (upstream: "the returned lastUpdated value is recent").
    assert resp.body == (
        b'{"lastUpdated":"2024-05-01T10:00:02.5Z","currentTime":"2024-05-01T10:00:02.5Z",'
        b'"nodeEligible":true,"healthy":true,'
        b'"status":{"IPv4":{"lastUpdated":"2024-05-01T10:00:00Z","healthy":true}}}'
    )


def test_healthz_body_unhealthy_reports_the_last_sync() -> None:
    health, handlers, clock, _ = make()
    health.updated()
    health.queued_update()
    clock.advance(12)
    resp = handlers.healthz()
    assert resp.status == 503
    assert resp.body == (
        b'{"lastUpdated":"2024-05-01T10:00:00Z","currentTime":"2024-05-01T10:00:12Z",'
        b'"nodeEligible":true,"healthy":false,'
        b'"status":{"IPv4":{"lastUpdated":"2024-05-01T10:00:00Z","healthy":false}}}'
    )


def test_before_the_first_sync_the_body_has_go_zero_time_and_no_status() -> None:
    _, handlers, _, _ = make()
    resp = handlers.livez()
    assert resp.status == 200
    assert (
        resp.body
        == b'{"lastUpdated":"2024-05-01T10:00:00Z","currentTime":"2024-05-01T10:00:00Z","healthy":true}'
    )


def test_livez_has_no_node_eligibility_and_ignores_the_node() -> None:
    health, handlers, _, counted = make()
    health.updated()
    health.sync_node({"metadata": {"name": "n1", "deletionTimestamp": "2024-05-01T09:00:00Z"}})
    live = handlers.livez()
    assert live.status == 200
    assert "nodeEligible" not in json.loads(live.body)
    ready = handlers.healthz()
    assert ready.status == 503
    doc = json.loads(ready.body)
    assert doc["nodeEligible"] is False and doc["healthy"] is True
    # Not healthy as an answer, so lastUpdated is the last sync, not "now".
    assert doc["lastUpdated"] == "2024-05-01T10:00:00Z"
    assert counted == [("livez", 200), ("healthz", 503)]


@pytest.mark.parametrize(
    ("node", "eligible"),
    [
        ({"metadata": {"name": "n1"}}, True),
        ({"metadata": {"name": "n1"}, "spec": {"taints": [{"key": "other", "effect": "NoSchedule"}]}}, True),
        (
            {"metadata": {"name": "n1"}, "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler"}]}},
            False,
        ),
        ({"metadata": {"name": "n1", "deletionTimestamp": "2024-05-01T09:00:00Z"}}, False),
        ({"metadata": {"name": "n1", "deletionTimestamp": None}}, True),
        (None, False),
    ],
)
def test_node_eligibility_as_upstream(node: dict[str, Any] | None, eligible: bool) -> None:
    assert node_eligible(node) is eligible
    health, handlers, _, _ = make()
    health.sync_node(node)
    assert handlers.healthz().status == (200 if eligible else 503)
    assert handlers.livez().status == 200


def test_node_can_become_eligible_again() -> None:
    health, handlers, _, _ = make()
    health.sync_node(
        {"metadata": {"name": "n1"}, "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler"}]}}
    )
    assert handlers.healthz().status == 503
    health.sync_node({"metadata": {"name": "n1"}, "spec": {"taints": [{"key": "other"}]}})
    assert handlers.healthz().status == 200


def test_routes_and_404() -> None:
    _, handlers, _, _ = make()
    assert handlers(request_from_target("GET", "/healthz")).status == 200
    assert handlers(request_from_target("POST", "/livez?x=1")).status == 200
    missing = handlers(request_from_target("GET", "/metrics"))
    assert missing.status == 404
    assert missing.body == b"404 page not found\n"
    assert missing.header("Content-Type") == "text/plain; charset=utf-8"
    # Go's mux matches /healthz exactly, not /healthz/...
    assert handlers(request_from_target("GET", "/healthz/ping")).status == 404
