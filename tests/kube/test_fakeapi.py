"""The fake API server answers as kube-apiserver does, for the behaviours the agent relies on.

Raw HTTP (urllib3) where status codes, headers and stream framing are the point; each test names
the upstream behaviour it mirrors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3

from lab.fakeapi import FakeApiServer
from lab.fakeapi.objects import node, service
from lab.fakeapi.selectors import SelectorError, parse_label_selector

http = urllib3.PoolManager(retries=False)


def get(server: FakeApiServer, path: str, **headers: str) -> tuple[int, Any]:
    r = http.request("GET", server.url + path, headers=headers or None, timeout=5)
    return r.status, json.loads(r.data)


def watch_lines(
    server: FakeApiServer, path: str, stop_after: int, timeout: float = 5
) -> Iterator[dict[str, Any]]:
    r = http.request("GET", server.url + path, preload_content=False, timeout=timeout)
    assert r.status == 200, r.data
    buf = b""
    seen = 0
    for chunk in r.stream(65536):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)
            seen += 1
            if seen == stop_after:
                r.close()  # unread data: never hand this connection back for reuse
                r.release_conn()
                return


def names(body: dict[str, Any]) -> list[str]:
    return [i["metadata"]["name"] for i in body["items"]]


def test_paginated_list_is_one_consistent_snapshot(server: FakeApiServer) -> None:
    # "objects returned when using continue will be identical to issuing a single list call
    # without a limit" (ListOptions.limit): later changes do not leak into later pages.
    for n in "abcd":
        server.create(service(n, "10.96.0.1"))
    code, page1 = get(server, "/api/v1/services?limit=2")
    assert code == 200 and names(page1) == ["a", "b"]
    assert page1["kind"] == "ServiceList" and page1["apiVersion"] == "v1"
    assert page1["metadata"]["remainingItemCount"] == 2
    assert "kind" not in page1["items"][0], "list items carry no kind/apiVersion"
    server.delete("Service", "default", "c")
    server.apply(service("d", "10.96.0.99"))
    _, page2 = get(server, f"/api/v1/services?limit=2&continue={page1['metadata']['continue']}")
    assert names(page2) == ["c", "d"]
    assert page2["items"][1]["spec"]["clusterIP"] == "10.96.0.1"
    assert page2["metadata"]["resourceVersion"] == page1["metadata"]["resourceVersion"]
    assert "continue" not in page2["metadata"]
    _, fresh = get(server, "/api/v1/services")
    assert names(fresh) == ["a", "b", "d"] and fresh["items"][2]["spec"]["clusterIP"] == "10.96.0.99"


def test_continue_token_after_compaction_is_410_expired(server: FakeApiServer) -> None:
    for n in "abc":
        server.create(service(n, "10.96.0.1"))
    _, page1 = get(server, "/api/v1/services?limit=1")
    server.expire_continue_tokens()
    code, body = get(server, f"/api/v1/services?limit=1&continue={page1['metadata']['continue']}")
    assert code == 410
    assert body["reason"] == "Expired" and body["code"] == 410
    assert body["message"].startswith("The provided continue parameter is too old")
    assert body["metadata"]["continue"] == page1["metadata"]["continue"]


def test_label_selector_grammar() -> None:
    labels = {"app": "web", "tier": "front"}

    def match(sel: str, lbl: dict[str, str] = labels) -> bool:
        return all(r.matches(lbl) for r in parse_label_selector(sel))

    assert match("app") and not match("!app") and match("!missing")
    assert match("app=web") and match("app==web") and not match("app=db")
    assert match("app!=db") and match("missing!=x"), "!= matches objects without the key (upstream)"
    assert match("tier in (front, back)") and not match("tier notin (front,back)")
    assert match("missing notin (a)") and not match("missing in (a)")
    assert match("app=web,tier in (front),!service.kubernetes.io/headless")
    for bad in ("app=", "=web", "app in front", "a b"):
        if bad == "app=":
            assert match("app=", {"app": ""}), "an empty value is allowed"
            continue
        with pytest.raises(SelectorError):
            parse_label_selector(bad)


def test_selectors_over_http(server: FakeApiServer) -> None:
    server.create(service("plain", "10.96.0.1"))
    server.create(service("headless", "10.96.0.2", labels={"service.kubernetes.io/headless": ""}))
    _, body = get(server, "/api/v1/services?labelSelector=!service.kubernetes.io/headless")
    assert names(body) == ["plain"]
    assert "remainingItemCount" not in body["metadata"]
    _, body = get(server, "/api/v1/services?fieldSelector=metadata.name%3Dheadless")
    assert names(body) == ["headless"]
    code, body = get(server, "/api/v1/services?fieldSelector=spec.foo%3Dx")
    assert code == 400 and body["reason"] == "BadRequest" and "field label not supported" in body["message"]
    code, _ = get(server, "/api/v1/namespaces/default/services/plain")
    assert code == 200
    code, body = get(server, "/api/v1/namespaces/default/services/nope")
    assert code == 404 and body["reason"] == "NotFound"


def test_watch_from_too_old_version_is_an_error_event(server: FakeApiServer) -> None:
    # The cacher answers 200 and one ERROR event with a 410 Status ("too old resource version").
    server.create(service("a", "10.96.0.1"))
    old = server.resource_version
    server.create(service("b", "10.96.0.2"))
    server.drop_watch_history()
    (event,) = list(watch_lines(server, f"/api/v1/services?watch=true&resourceVersion={old}", 1))
    assert event["type"] == "ERROR"
    assert event["object"]["kind"] == "Status" and event["object"]["code"] == 410
    assert event["object"]["reason"] == "Expired"


def test_gone_style_status_answers_a_plain_410() -> None:
    with FakeApiServer(gone_style="status") as server:
        server.create(service("a", "10.96.0.1"))
        server.drop_watch_history()
        code, body = get(server, "/api/v1/services?watch=true&resourceVersion=1")
        assert code == 410 and body["reason"] == "Expired"


def test_watch_window_trims_and_old_versions_expire() -> None:
    with FakeApiServer(watch_capacity=3) as server:
        first = server.create(service("s0", "10.96.0.1"))["metadata"]["resourceVersion"]
        for i in range(1, 6):
            server.create(service(f"s{i}", "10.96.0.1"))
        (event,) = list(watch_lines(server, f"/api/v1/services?watch=true&resourceVersion={first}", 1))
        assert event["type"] == "ERROR"
        recent = int(server.resource_version) - 2
        events = list(watch_lines(server, f"/api/v1/services?watch=true&resourceVersion={recent}", 2))
        assert [e["object"]["metadata"]["name"] for e in events] == ["s4", "s5"]


def test_a_watcher_the_window_left_behind_has_its_stream_ended(server: FakeApiServer) -> None:
    # The cacher terminates a watcher it cannot serve and the response ends (cache_watcher.go
    # closes the result channel); the client watches again and is told 410. A stream left open
    # with nothing more to carry would hold the client until its read timeout.
    server.create(service("a", "10.96.0.1"))
    rv = server.resource_version
    r = http.request(
        "GET",
        server.url + f"/api/v1/services?watch=true&resourceVersion={rv}",
        preload_content=False,
        timeout=3,
    )
    assert r.status == 200
    with server.store.cond:  # the watcher cannot read the write before the window loses it
        server.create(service("b", "10.96.0.2"))
        server.drop_watch_history()
    assert r.read() == b"", "the stream ended, with no event"
    r.release_conn()
    (event,) = list(watch_lines(server, f"/api/v1/services?watch=true&resourceVersion={rv}", 1))
    assert event["type"] == "ERROR" and event["object"]["code"] == 410


def test_watch_selector_transitions_are_added_and_deleted(server: FakeApiServer) -> None:
    # cacher convertToWatchEvent: entering the selector is ADDED; leaving is DELETED with the
    # previous content and the event's resourceVersion.
    server.create(service("web", "10.96.0.1"))
    rv = server.resource_version
    server.apply(service("web", "10.96.0.1", labels={"service.kubernetes.io/headless": ""}))
    leave_rv = server.resource_version
    server.apply(service("web", "10.96.0.2"))
    path = f"/api/v1/services?watch=true&resourceVersion={rv}&labelSelector=!service.kubernetes.io/headless"
    left, back = list(watch_lines(server, path, 2))
    assert left["type"] == "DELETED"
    assert "service.kubernetes.io/headless" not in left["object"]["metadata"]["labels"]
    assert left["object"]["metadata"]["resourceVersion"] == leave_rv
    assert back["type"] == "ADDED" and back["object"]["spec"]["clusterIP"] == "10.96.0.2"
    assert back["object"]["kind"] == "Service", "watch objects carry kind/apiVersion"


def test_watch_without_version_starts_with_every_object(server: FakeApiServer) -> None:
    server.create(service("a", "10.96.0.1"))
    server.create(service("b", "10.96.0.2"))
    events = list(watch_lines(server, "/api/v1/services?watch=true", 2))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "a"), ("ADDED", "b")]


def test_bookmarks_and_timeout() -> None:
    with FakeApiServer(bookmark_interval_s=0.2) as server:
        rv = server.create(service("a", "10.96.0.1"))["metadata"]["resourceVersion"]
        server.create(node("node2"))  # another kind moves the global revision
        start = time.monotonic()
        r = http.request(
            "GET",
            server.url
            + f"/api/v1/services?watch=true&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=1",
            preload_content=False,
            timeout=5,
        )
        lines = [json.loads(line) for line in r.data.splitlines()]
        assert 0.9 < time.monotonic() - start < 2.0, "the stream ends cleanly at timeoutSeconds"
        assert lines and all(e["type"] == "BOOKMARK" for e in lines)
        assert lines[-1]["object"]["metadata"]["resourceVersion"] == server.resource_version
        assert lines[-1]["object"]["kind"] == "Service"
        no_bookmarks = http.request(
            "GET",
            server.url + f"/api/v1/services?watch=true&resourceVersion={rv}&timeoutSeconds=1",
            timeout=5,
        )
        assert no_bookmarks.data == b""


def test_update_with_a_stale_resource_version_conflicts(server: FakeApiServer) -> None:
    from lab.fakeapi.store import StoreError

    stored = server.create(service("a", "10.96.0.1"))
    server.update(stored)
    with pytest.raises(StoreError) as err:
        server.update(stored)
    assert err.value.code == 409 and err.value.reason == "Conflict"
    with pytest.raises(StoreError) as err:
        server.create(service("a", "10.96.0.1"))
    assert err.value.reason == "AlreadyExists"
    assert stored["metadata"]["uid"] and stored["metadata"]["creationTimestamp"].endswith("Z")


def post_event(server: FakeApiServer, body: dict[str, Any], ns: str = "default") -> tuple[int, Any]:
    r = http.request(
        "POST",
        server.url + f"/apis/events.k8s.io/v1/namespaces/{ns}/events",
        body=json.dumps(body),
        headers={"Content-Type": "application/json"},
        timeout=5,
    )
    return r.status, json.loads(r.data)


EVENT = {
    "metadata": {"name": "web.1"},
    "eventTime": "2026-01-01T00:00:00.000000Z",
    "reportingController": "ebpf-kube-proxy",
    "reportingInstance": "ebpf-kube-proxy-node1",
    "action": "SkipObject",
    "reason": "InvalidService",
    "regarding": {"kind": "Service", "namespace": "default", "name": "web"},
    "note": "bad",
    "type": "Warning",
}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"deprecatedSource": {"component": "x"}}, "source"),
        ({"eventTime": None}, "eventTime"),
        ({"type": "Info"}, "type"),
        ({"action": ""}, "action"),
        ({"note": "x" * 1025}, "message"),
        ({"series": {"count": 1, "lastObservedTime": "2026-01-01T00:00:00.000000Z"}}, "series.count"),
        ({"metadata": {"name": "Web.1"}}, "metadata.name"),
    ],
)
def test_events_v1_validation(server: FakeApiServer, change: dict[str, Any], field: str) -> None:
    code, body = post_event(server, {**EVENT, **change})
    assert code == 422 and body["reason"] == "Invalid"
    assert field in body["message"]


def test_events_create_patch_and_errors(server: FakeApiServer) -> None:
    assert post_event(server, EVENT)[0] == 201
    code, body = post_event(server, EVENT)
    assert code == 409 and body["reason"] == "AlreadyExists"
    code, _ = post_event(server, {**EVENT, "metadata": {"name": "x", "namespace": "other"}})
    assert code == 400
    # A cluster-scoped object's Events live in "default" (or kube-system), nowhere else.
    about_node = {**EVENT, "metadata": {"name": "n.1"}, "regarding": {"kind": "Node", "name": "n"}}
    code, body = post_event(server, about_node, ns="kube-public")
    assert code == 422 and "involvedObject.namespace" in body["message"]
    assert post_event(server, about_node)[0] == 201
    url = server.url + "/apis/events.k8s.io/v1/namespaces/default/events/"
    patch = json.dumps({"series": {"count": 2, "lastObservedTime": "2026-01-01T00:00:01.000000Z"}})
    r = http.request(
        "PATCH", url + "web.1", body=patch, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert r.status == 200 and json.loads(r.data)["series"]["count"] == 2
    r = http.request(
        "PATCH", url + "gone", body=patch, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert r.status == 404
    r = http.request(
        "PATCH", url + "web.1", body="[]", headers={"Content-Type": "application/json-patch+json"}
    )
    assert r.status == 415
    assert [e["series"]["count"] for e in server.events() if e["metadata"]["name"] == "web.1"] == [2]


def test_faults_latency_and_auth() -> None:
    with FakeApiServer(tokens=("t",)) as server:
        code, body = get(server, "/api/v1/services")
        assert code == 401 and body["reason"] == "Unauthorized"
        server.fail_next(1, 429, retry_after=3)
        r = http.request("GET", server.url + "/api/v1/services", headers={"Authorization": "Bearer t"})
        assert r.status == 429 and r.headers["Retry-After"] == "3"
        assert json.loads(r.data)["reason"] == "TooManyRequests"
        server.latency_s = 0.3
        start = time.monotonic()
        assert get(server, "/version", Authorization="Bearer t")[0] == 200
        assert time.monotonic() - start >= 0.3


def test_down_for_refuses_then_serves_the_same_state_on_the_same_port(server: FakeApiServer) -> None:
    server.create(service("a", "10.96.0.1"))
    port = server.port
    server.down_for(0.5)
    with pytest.raises(urllib3.exceptions.HTTPError):
        http.request("GET", server.url + "/api/v1/services", timeout=1)
    time.sleep(0.8)
    assert server.port == port
    code, body = get(server, "/api/v1/services")
    assert code == 200 and names(body) == ["a"]
    server.restart(fresh=True)
    assert names(get(server, "/api/v1/services")[1]) == []


def test_tls_serves_with_its_ca() -> None:
    with FakeApiServer(tls=True) as server:
        tls = urllib3.PoolManager(ca_certs=str(server.ca_path), retries=False)
        r = tls.request("GET", server.url + "/version", timeout=5)
        assert r.status == 200 and json.loads(r.data)["major"] == "1"
        assert server.url.startswith("https://127.0.0.1:")
