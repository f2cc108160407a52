"""EventRecorder against the fake API server, which validates Events as kube-apiserver does.

Time is stepped through injected clocks where the behaviour depends on it (series windows, the
token bucket), so nothing sleeps longer than the background thread needs to act.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agent.config import Config
from agent.kube.client import api_client
from agent.kube.events import EventRecorder, EventSettings, event_body, micro_time
from agent.model.problem import Problem
from lab.fakeapi import FakeApiServer
from lab.fakeapi.events import validate_v1_event
from tests.kube.conftest import wait_until

BAD_PORT = Problem("Service", "shop", "web", "spec.ports[0].port: 70000 is out of range 1-65535")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


Factory = Callable[..., EventRecorder]


@pytest.fixture
def recorder_factory(server: FakeApiServer, tmp_path: Path) -> Iterator[Factory]:
    """`recorder_factory(settings=None, clock=..., wall=...)`: a recorder for node1, stopped after."""
    made: list[EventRecorder] = []

    def make(settings: EventSettings | None = None, **kw: Any) -> EventRecorder:
        config = Config(kubeconfig=server.write_kubeconfig(tmp_path / "kc"))
        rec = EventRecorder(api_client(config), "node1", settings, **kw)
        made.append(rec)
        return rec

    yield make
    for r in made:
        r.stop()


def test_event_shape_is_what_kube_apiserver_accepts(server: FakeApiServer, recorder_factory: Factory) -> None:
    rec = recorder_factory()
    rec.start()
    rec.warn(BAD_PORT, uid="1234-abcd")
    # The recorder counts an Event once its POST returned, after the server stored it: waiting for
    # the server's copy and then reading the count raced the recorder's thread.
    wait_until(lambda: rec.counters.created == 1, what="the Event created and counted")
    (ev,) = server.events()
    assert ev["type"] == "Warning"
    assert ev["reason"] == "InvalidService"
    assert ev["action"] == "SkipObject"
    assert ev["reportingController"] == "ebpf-kube-proxy"
    assert ev["reportingInstance"] == "ebpf-kube-proxy-node1"
    assert ev["regarding"] == {
        "kind": "Service",
        "apiVersion": "v1",
        "namespace": "shop",
        "name": "web",
        "uid": "1234-abcd",
    }
    assert ev["metadata"]["namespace"] == "shop"
    assert ev["metadata"]["name"].startswith("web.")
    assert "70000 is out of range" in ev["note"] and "node1" in ev["note"]
    assert "deprecatedSource" not in ev  # events.k8s.io/v1 rejects it
    assert ev["eventTime"].endswith("Z") and len(ev["eventTime"].split(".")[1]) == 7  # 6 digits + Z
    posts = [r for r in server.requests if r.method == "POST"]
    assert posts[0].path == "/apis/events.k8s.io/v1/namespaces/shop/events"


def test_microtime_keeps_six_digits_at_zero_microseconds() -> None:
    # The generated client's isoformat would send "...:00+00:00", which kube-apiserver rejects.
    at = datetime(2026, 1, 2, 3, 4, 5, 0, tzinfo=UTC)
    assert micro_time(at) == "2026-01-02T03:04:05.000000Z"
    body = event_body(BAD_PORT, None, "node1", at)
    assert body["eventTime"] == "2026-01-02T03:04:05.000000Z"
    assert validate_v1_event(body | {"metadata": {**body["metadata"]}}) == []


def test_node_and_odd_names_still_make_valid_events() -> None:
    at = datetime(2026, 1, 2, tzinfo=UTC)
    node = event_body(Problem("Node", "", "node1", "no addresses"), None, "node1", at)
    assert node["metadata"]["namespace"] == "default" and "namespace" not in node["regarding"]
    odd = event_body(Problem("Service", "default", "Web\nService", "bad"), None, "node1", at)
    assert odd["metadata"]["name"].startswith("ebpf-kube-proxy.")
    assert odd["regarding"]["name"] == "Web\nService", "the reference names the real object"
    long_note = event_body(Problem("EndpointSlice", "default", "s", "x" * 5000), None, "n", at)
    for body in (node, odd, long_note):
        assert validate_v1_event(body) == [], body


def test_a_refused_frontend_is_a_refusal_event_not_an_invalid_object() -> None:
    at = datetime(2026, 1, 2, tzinfo=UTC)
    refused = Problem("Service", "shop", "web", "spec.externalIPs 10.244.1.3 refused", "RefusedExternalIP")
    body = event_body(refused, "1234", "node1", at)
    assert (body["reason"], body["action"], body["type"]) == (
        "RefusedExternalIP",
        "RefuseFrontend",
        "Warning",
    )
    assert body["note"].startswith("spec.externalIPs 10.244.1.3 refused")
    assert validate_v1_event(body) == []


def test_the_same_problem_again_grows_a_series_instead_of_new_events(
    server: FakeApiServer, recorder_factory: Factory
) -> None:
    clock = Clock()
    rec = recorder_factory(EventSettings(series_flush_s=0.2), clock=clock)
    rec.start()
    rec.warn(BAD_PORT)
    wait_until(lambda: rec.counters.created == 1)
    rec.warn(BAD_PORT)  # first repeat: PATCHed at once (client-go starts the series immediately)
    wait_until(lambda: rec.counters.series_updated == 1, what="the series PATCH")
    for _ in range(3):
        rec.warn(BAD_PORT)
    clock.t += 1  # the flush is due
    wait_until(lambda: rec.counters.series_updated == 2, what="the flushed count")
    events = server.events()
    assert len(events) == 1
    assert events[0]["series"]["count"] == 5
    assert [p[2]["series"]["count"] for p in server.patches] == [2, 5]
    patch_request = [r for r in server.requests if r.method == "PATCH"][-1]
    assert patch_request.headers["content-type"] == "application/strategic-merge-patch+json"

    # A different problem of the same object is a different Event; so is the same one after the
    # series window (client-go's 6 minutes) passed.
    rec.warn(Problem("Service", "shop", "web", "spec.type: unknown type 'Foo'"))
    clock.t += 400
    rec.warn(BAD_PORT)
    wait_until(lambda: len(server.events()) == 3, what="two new Events")


def test_rate_limit_drops_and_counts_the_excess(server: FakeApiServer, recorder_factory: Factory) -> None:
    clock = Clock()
    rec = recorder_factory(EventSettings(burst=3, per_s=0.1), clock=clock)
    rec.start()
    for i in range(10):
        rec.warn(Problem("Service", "default", f"svc-{i}", "broken"))
    wait_until(lambda: rec.counters.created == 3)
    assert rec.counters.dropped == 7
    clock.t += 10  # one token back
    rec.warn(Problem("Service", "default", "late", "broken"))
    rec.warn(Problem("Service", "default", "later", "broken"))
    wait_until(lambda: rec.counters.created == 4)
    assert rec.counters.dropped == 8
    time.sleep(0.2)
    assert sorted(e["regarding"]["name"] for e in server.events()) == ["late", "svc-0", "svc-1", "svc-2"]


def test_warn_never_waits_for_the_api_server(server: FakeApiServer, recorder_factory: Factory) -> None:
    server.latency_s = 0.5
    rec = recorder_factory()
    rec.start()
    start = time.monotonic()
    for i in range(5):
        rec.warn(Problem("Service", "default", f"svc-{i}", "broken"))
    # one warn that waited for the server would take its latency: no speed bound beyond that
    assert time.monotonic() - start < server.latency_s
    wait_until(lambda: rec.counters.created == 5, timeout=10)


def test_full_queue_drops_instead_of_blocking(server: FakeApiServer, recorder_factory: Factory) -> None:
    rec = recorder_factory(EventSettings(queue_max=2, burst=100))  # never started: nothing drains
    for i in range(5):
        rec.warn(Problem("Service", "default", f"svc-{i}", "broken"))
    assert rec.counters.dropped == 3


def test_a_series_whose_event_expired_is_created_again(
    server: FakeApiServer, recorder_factory: Factory
) -> None:
    rec = recorder_factory()
    rec.start()
    rec.warn(BAD_PORT)
    wait_until(lambda: rec.counters.created == 1)
    name = server.events()[0]["metadata"]["name"]
    server.delete("Event", "shop", name, "events.k8s.io/v1")  # the API server's event TTL
    rec.warn(BAD_PORT)
    wait_until(lambda: rec.counters.created == 2, what="the Event created again")
    again = server.events()
    assert len(again) == 1 and again[0]["metadata"]["name"] == name
    assert again[0]["series"]["count"] == 2


def test_api_server_down_is_retried_then_counted_and_the_thread_survives(
    server: FakeApiServer, recorder_factory: Factory
) -> None:
    rec = recorder_factory(EventSettings(max_tries=2, retry_s=0.05))
    rec.start()
    server.fail_next(2, 503)
    rec.warn(Problem("Service", "default", "a", "broken"))
    wait_until(lambda: rec.counters.failed == 1, what="given up after two tries")
    server.fail_next(1, 500)
    rec.warn(Problem("Service", "default", "b", "broken"))  # the first try fails, the retry works
    wait_until(lambda: rec.counters.created == 1)
    server.fail_next(1, 422)  # not retriable: one try
    rec.warn(Problem("Service", "default", "c", "broken"))
    wait_until(lambda: rec.counters.failed == 2)
    posts = [r for r in server.requests if r.method == "POST"]
    assert len(posts) == 2 + 2 + 1
    rec.warn(Problem("Service", "default", "a", "broken"))  # a failed one may be tried again
    wait_until(lambda: rec.counters.created == 2)


def test_stop_returns_promptly(server: FakeApiServer, recorder_factory: Factory) -> None:
    rec = recorder_factory()
    rec.start()
    start = time.monotonic()
    rec.stop()
    assert time.monotonic() - start < 1.0


def test_event_time_is_the_wall_clock(server: FakeApiServer, recorder_factory: Factory) -> None:
    at = datetime(2026, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    rec = recorder_factory(wall=lambda: at)
    rec.start()
    rec.warn(BAD_PORT)
    wait_until(lambda: len(server.events()) == 1)
    ev = server.events()[0]
    assert ev["eventTime"] == "2026-05-06T07:08:09.123456Z"
    assert ev["metadata"]["name"] == f"web.{int(at.timestamp() * 1e9):x}"
