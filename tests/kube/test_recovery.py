"""ApiSource survives what API servers do: 410, expired continue tokens, dropped streams, 5xx,
429, downtime, a wiped etcd, and garbage on the wire. Each test also checks what must NOT happen
(no relist, no duplicate, no flush), so a source that relists on every hiccup would fail.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import pytest

from agent.sources.base import EventType, Kind, ObjectEvent, Synced
from lab.fakeapi import FakeApiServer, Request
from lab.fakeapi.objects import endpoint_slice, service
from tests.kube.conftest import REGISTRY, SourceFactory, wait_until


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def changes(events: Sequence[object]) -> list[tuple[EventType, str]]:
    return [(e.type, e.key) for e in events if isinstance(e, ObjectEvent)]


def is_service_list(r: Request) -> bool:
    return r.path == "/api/v1/services" and r.query.get("watch") != "true"


def is_service_watch(r: Request) -> bool:
    return r.path == "/api/v1/services" and r.query.get("watch") == "true"


def test_bookmarks_carry_a_quiet_watch_past_compaction(start_source: SourceFactory) -> None:
    # Bookmarks advance the resourceVersion of a kind nothing happens to, so after a compaction
    # and a dropped stream the watch resumes without a 410 and without a relist.
    with FakeApiServer(bookmark_interval_s=0.2) as server:
        server.create(service("web", "10.96.0.1"))
        source, sink = start_source(server)
        sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
        relists = metric("ekp_relists_total", kind="Service", reason="gone")
        # Churn that this watcher never sees (other proxies' Services) moves the revision on.
        for i in range(20):
            server.create(
                service(
                    f"other-{i}", f"10.96.1.{i}", labels={"service.kubernetes.io/service-proxy-name": "x"}
                )
            )
        target = server.resource_version
        wait_until(
            lambda: source.resource_versions()[Kind.SERVICE] == target, what="a bookmark at the new revision"
        )
        # Synced and the bookmark are the Service watch's; the other two kinds open theirs apart.
        wait_until(lambda: server.open_streams() == 3, what="every watch open")
        server.compact()
        assert server.drop_streams() == 3
        server.create(service("api", "10.96.0.2"))
        sink.wait(lambda: "default/api" in sink.state(Kind.SERVICE), what="the new Service")
        assert source.list_counts()[Kind.SERVICE] == 1, "no relist"
        assert metric("ekp_relists_total", kind="Service", reason="gone") == relists
        resumed = [r for r in server.requests if is_service_watch(r)][-1]
        assert int(resumed.query["resourceVersion"]) >= int(target)


def test_without_bookmarks_the_same_compaction_forces_a_relist(start_source: SourceFactory) -> None:
    # The control for the test above: with no bookmark in time, the old resourceVersion is gone.
    with FakeApiServer(bookmark_interval_s=1000) as server:
        server.create(service("web", "10.96.0.1"))
        source, sink = start_source(server)
        sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
        # As above, the watches are open before the compaction: the relist must come from a watch
        # resuming at its old version, not from one that happened to open after the compaction.
        # (A Service watch that had not read the writes yet is ended by the server as the window
        # empties, before the drop: not counted by drop_streams, resumed just the same.)
        wait_until(lambda: server.open_streams() == 3, what="every watch open")
        relists = metric("ekp_relists_total", kind="Service", reason="gone")
        for i in range(5):
            server.create(
                service(
                    f"other-{i}", f"10.96.1.{i}", labels={"service.kubernetes.io/service-proxy-name": "x"}
                )
            )
        server.compact()
        server.drop_streams()
        sink.wait(lambda: len(sink.synced(Kind.SERVICE)) == 2, what="a second Synced after the relist")
        assert source.list_counts()[Kind.SERVICE] == 2
        assert metric("ekp_relists_total", kind="Service", reason="gone") == relists + 1
        listed = sink.synced(Kind.SERVICE)[0].version
        first, resumed = [r for r in server.requests if is_service_watch(r)][:2]
        assert first.query["resourceVersion"] == resumed.query["resourceVersion"] == listed
        assert changes(sink.events) == [(EventType.ADDED, "default/web")], (
            "a relist of an unchanged cluster sends nothing"
        )


@pytest.mark.parametrize("gone_style", ["event", "status"])
def test_410_relists_and_sends_only_the_differences(start_source: SourceFactory, gone_style: str) -> None:
    # What changed while the watch was down arrives as ADDED/MODIFIED/DELETED after the relist;
    # untouched objects produce nothing, and nothing is flushed.
    with FakeApiServer(bookmark_interval_s=1000, gone_style=gone_style) as server:
        for name, ip in (("a", "10.96.0.1"), ("b", "10.96.0.2"), ("c", "10.96.0.3")):
            server.create(service(name, ip))
            server.create(endpoint_slice(name, [ip.replace("96.0", "244.1")]))
        source, sink = start_source(server)
        sink.wait(lambda: bool(sink.synced(Kind.SERVICE) and sink.synced(Kind.ENDPOINT_SLICE)))
        before = sink.synced(Kind.SERVICE)[0].version
        mark = sink.mark()

        server.stop()
        server.delete("Service", "default", "b")
        server.delete("EndpointSlice", "default", "b-abcde", "discovery.k8s.io/v1")
        server.update({**service("c", "10.96.0.33")})
        server.create(service("d", "10.96.0.4"))
        server.compact()
        server.start()

        sink.wait(lambda: len(sink.synced(Kind.SERVICE)) == 2 and len(sink.synced(Kind.ENDPOINT_SLICE)) == 2)
        after = sink.since(mark)
        assert sorted(changes([e for e in after if getattr(e, "kind", None) is Kind.SERVICE])) == [
            (EventType.ADDED, "default/d"),
            (EventType.DELETED, "default/b"),
            (EventType.MODIFIED, "default/c"),
        ]
        assert changes([e for e in after if getattr(e, "kind", None) is Kind.ENDPOINT_SLICE]) == [
            (EventType.DELETED, "default/b-abcde")
        ]
        deleted = next(
            e
            for e in after
            if isinstance(e, ObjectEvent) and e.type is EventType.DELETED and e.kind is Kind.SERVICE
        )
        # The reflector remembers versions, not objects: a DELETED found by a relist names the
        # object and the last version delivered.
        delivered_b = next(
            e for e in sink.events if isinstance(e, ObjectEvent) and e.key == "default/b" and e is not deleted
        )
        assert deleted.obj == {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "b",
                "namespace": "default",
                "resourceVersion": delivered_b.obj["metadata"]["resourceVersion"],
            },
        }
        # Synced comes after the differences, with the new list's resourceVersion.
        service_events = [e for e in after if e.kind is Kind.SERVICE]
        assert isinstance(service_events[-1], Synced) and not any(
            isinstance(e, Synced) for e in service_events[:-1]
        )
        assert int(sink.synced(Kind.SERVICE)[1].version) > int(before)
        assert source.list_counts()[Kind.SERVICE] == 2
        assert sink.state(Kind.SERVICE).keys() == {"default/a", "default/c", "default/d"}
        # client-go: the first list from the watch cache (resourceVersion=0); the relist after a
        # 410 reads consistently (no resourceVersion: the one it had is gone), in pages.
        lists = [r for r in server.requests if is_service_list(r)]
        assert lists[0].query.get("resourceVersion") == "0"
        assert "resourceVersion" not in lists[-1].query and lists[-1].query.get("limit") == "3"


def test_a_relist_after_410_reads_consistently_in_pages(start_source: SourceFactory) -> None:
    # With a watch cache the first list is one answer at resourceVersion=0; once the watch's
    # version is compacted away, the relist asks no version (a consistent read, which the server
    # pages: limit 3 for 7 Services is three requests, the later ones by continue token only).
    with FakeApiServer(bookmark_interval_s=1000) as server:
        for i in range(7):
            server.create(service(f"web-{i}", f"10.96.0.{i + 1}"))
        source, sink = start_source(server)
        sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
        wait_until(lambda: server.open_streams() == 3, what="every watch open")
        server.create(service("late", "10.96.0.99", labels={"service.kubernetes.io/service-proxy-name": "x"}))
        server.compact()
        server.drop_streams()
        sink.wait(lambda: len(sink.synced(Kind.SERVICE)) == 2, what="a second Synced after the relist")
        lists = [r.query for r in server.requests if is_service_list(r)]
        assert [(q.get("resourceVersion"), q.get("limit"), "continue" in q) for q in lists] == [
            ("0", "3", False),
            (None, "3", False),
            (None, "3", True),
            (None, "3", True),
        ]
        assert source.list_counts()[Kind.SERVICE] == 2
        assert sorted(changes(sink.events)) == sorted(
            (EventType.ADDED, f"default/web-{i}") for i in range(7)
        ), "the relist found nothing new and flushed nothing"


def test_expired_continue_token_restarts_the_list(
    paging_server: FakeApiServer, start_source: SourceFactory
) -> None:
    server = paging_server
    for i in range(10):
        server.create(service(f"web-{i}", f"10.96.0.{i + 1}"))
    expired: list[Request] = []

    def expire_on_second_page(r: Request) -> None:
        if is_service_list(r) and "continue" in r.query and not expired:
            expired.append(r)
            server.expire_continue_tokens()

    server.on_request(expire_on_second_page)
    before = metric("ekp_relists_total", kind="Service", reason="continue_expired")
    _, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    assert expired, "the second page was answered 410"
    assert metric("ekp_relists_total", kind="Service", reason="continue_expired") == before + 1
    # Page one was delivered before the expiry; the restarted list finds it unchanged: no duplicates.
    assert sorted(changes(sink.objects(Kind.SERVICE))) == sorted(
        (EventType.ADDED, f"default/web-{i}") for i in range(10)
    )
    assert len(sink.synced(Kind.SERVICE)) == 1
    lists = [r for r in server.requests if is_service_list(r)]
    assert len(lists) == 1 + 1 + 4  # page 1, the expired page 2, then four pages again


def test_continue_tokens_that_always_expire_fall_back_to_one_request(
    paging_server: FakeApiServer, start_source: SourceFactory
) -> None:
    server = paging_server
    for i in range(7):
        server.create(service(f"web-{i}", f"10.96.0.{i + 1}"))
    server.on_request(
        lambda r: server.expire_continue_tokens() if is_service_list(r) and "continue" in r.query else None
    )
    _, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    assert len(sink.state(Kind.SERVICE)) == 7
    last = [r for r in server.requests if is_service_list(r)][-1]
    assert "limit" not in last.query and "continue" not in last.query


def test_dropped_streams_resume_from_the_last_resource_version(
    server: FakeApiServer, start_source: SourceFactory
) -> None:
    source, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    dropped = metric("ekp_watch_restarts_total", kind="Service", reason="dropped")
    for i in range(4):
        wait_until(lambda: server.open_streams("Service") == 1, what="the Service watch open")
        server.create(service(f"web-{i}", f"10.96.0.{i + 1}"))
        sink.wait(lambda i=i: f"default/web-{i}" in sink.state(Kind.SERVICE))  # type: ignore[misc]
        server.drop_streams()
        server.create(service(f"api-{i}", f"10.96.1.{i + 1}"))  # while no stream is open
    sink.wait(lambda: len(sink.state(Kind.SERVICE)) == 8, what="all eight Services")
    assert sorted(changes(sink.objects(Kind.SERVICE))) == sorted(
        [(EventType.ADDED, f"default/web-{i}") for i in range(4)]
        + [(EventType.ADDED, f"default/api-{i}") for i in range(4)]
    ), "each exactly once"
    assert source.list_counts()[Kind.SERVICE] == 1
    assert metric("ekp_watch_restarts_total", kind="Service", reason="dropped") >= dropped + 4


def test_clean_stream_end_is_reopened_without_backoff_or_error(
    server: FakeApiServer, start_source: SourceFactory
) -> None:
    source, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    # An event on the stream first: a watch that carried a line is never client-go's "very short
    # watch" (closed at once without any event, backed off), however slow the machine is.
    server.create(service("web", "10.96.0.1"))
    sink.wait(lambda: "default/web" in sink.state(Kind.SERVICE), what="the Service on the first watch")
    closed = metric("ekp_watch_restarts_total", kind="Service", reason="closed")
    errors = {
        reason: metric("ekp_api_request_errors_total", kind="Service", verb="watch", reason=reason)
        for reason in ("dropped", "closed_early")
    }
    opened = server.watches_opened("Service")
    server.drop_streams(clean=True)
    # The source counts the restart before it asks for the next watch, so once the server has seen
    # that request the count is final. (Waiting for an object instead is racy: the old stream may
    # still deliver it before its end, and the count would be read before the end is.)
    wait_until(lambda: server.watches_opened("Service") == opened + 1, what="the watch reopened")
    server.create(service("api", "10.96.0.2"))
    sink.wait(lambda: "default/api" in sink.state(Kind.SERVICE), what="the Service on the new watch")
    assert metric("ekp_watch_restarts_total", kind="Service", reason="closed") == closed + 1
    for reason, before in errors.items():
        assert metric("ekp_api_request_errors_total", kind="Service", verb="watch", reason=reason) == before
    assert source.list_counts()[Kind.SERVICE] == 1


def test_5xx_on_list_and_watch_is_retried_with_backoff(
    server: FakeApiServer, start_source: SourceFactory
) -> None:
    server.create(service("web", "10.96.0.1"))
    server.fail_next(3, 503, match=is_service_list)
    before = metric("ekp_api_request_errors_total", kind="Service", verb="list", reason="http_503")
    _, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    assert (
        metric("ekp_api_request_errors_total", kind="Service", verb="list", reason="http_503") == before + 3
    )
    lists = [r for r in server.requests if is_service_list(r)]
    assert len(lists) == 4

    wait_until(lambda: server.open_streams("Service") == 1)
    server.fail_next(2, 500, match=is_service_watch)
    server.drop_streams()
    server.create(service("api", "10.96.0.2"))
    sink.wait(lambda: "default/api" in sink.state(Kind.SERVICE))
    assert metric("ekp_api_request_errors_total", kind="Service", verb="watch", reason="http_500") >= 2


def test_429_retry_after_is_honoured(server: FakeApiServer, start_source: SourceFactory) -> None:
    server.fail_next(1, 429, retry_after=1, match=is_service_list)
    _, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    first, second = [r for r in server.requests if is_service_list(r)][:2]
    assert second.at - first.at >= 1.0, "waited for Retry-After, not just the 0.05 s backoff"


def test_server_down_for_seconds_is_survived_and_logged_once(
    server: FakeApiServer, start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server.create(service("web", "10.96.0.1"))
    source, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    wait_until(lambda: server.open_streams() == 3)
    caplog.set_level(logging.INFO, logger="agent.kube")
    connect_errors = metric("ekp_api_request_errors_total", kind="Service", verb="watch", reason="connect")
    server.down_for(2.0)
    server.create(service("api", "10.96.0.2"))  # while down
    wait_until(lambda: server.running, timeout=10, what="the server back after 2 s")
    sink.wait(lambda: "default/api" in sink.state(Kind.SERVICE), timeout=10)
    assert source.list_counts()[Kind.SERVICE] == 1, "the watch window survived: resumed, no relist"
    # Many failed attempts (backoff 0.05-0.4 s over 2 s), one warning and one recovery line per kind.
    assert (
        metric("ekp_api_request_errors_total", kind="Service", verb="watch", reason="connect")
        >= connect_errors + 3
    )
    service_logs = [r for r in caplog.records if r.getMessage().startswith("Service watch")]
    assert [r.levelname for r in service_logs] == ["WARNING", "INFO"], [r.getMessage() for r in service_logs]
    assert "recovered after" in service_logs[1].getMessage()


def test_wiped_server_is_relisted_and_everything_it_lost_is_deleted(
    server: FakeApiServer, start_source: SourceFactory
) -> None:
    # A restored or rebuilt etcd: our resourceVersion is ahead of the server's, which answers
    # "Too large resource version" (504) after waiting; client-go relists, and so do we.
    for name in ("a", "b"):
        server.create(service(name, "10.96.0.1"))
    _, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    for i in range(5):
        server.create(service(f"more-{i}", f"10.96.2.{i}"))  # so the old revision is ahead of the new server
    sink.wait(lambda: len(sink.state(Kind.SERVICE)) == 7)
    server.restart(fresh=True)
    server.create(service("z", "10.96.0.26"))
    sink.wait(lambda: len(sink.synced(Kind.SERVICE)) == 2, timeout=15, what="a relist after the wipe")
    assert sink.state(Kind.SERVICE).keys() == {"default/z"}
    assert metric("ekp_relists_total", kind="Service", reason="too_large") >= 1


def test_garbage_on_the_wire_never_kills_the_watch(
    server: FakeApiServer, start_source: SourceFactory
) -> None:
    source, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    garbage = [
        b"this is not json",
        b"[1, 2, 3]",
        b'{"type": "ADDED", "object": "a string"}',
        b'{"type": "SOMETHING", "object": {}}',
        b'{"object": {"metadata": {"name": "x"}}}',
        b"\xff\xfe\x00binary",
    ]
    for i, line in enumerate(garbage):
        opened = server.watches_opened("Service")
        wait_until(lambda: server.open_streams("Service") >= 1, what="the Service watch open")
        assert server.inject_watch_line("Service", line) >= 1
        wait_until(lambda i=i: source.list_counts()[Kind.SERVICE] == 2 + i, what="a relist")  # type: ignore[misc]
        wait_until(lambda o=opened: server.watches_opened("Service") > o, what="a new watch")  # type: ignore[misc]
        server.create(service(f"after-{i}", f"10.96.0.{i + 1}"))
        sink.wait(lambda i=i: f"default/after-{i}" in sink.state(Kind.SERVICE))  # type: ignore[misc]
    # Each unreadable event cost a relist (the only safe reading of a broken stream), nothing more.
    assert source.list_counts()[Kind.SERVICE] == 1 + len(garbage)
    assert sorted(k for _, k in changes(sink.objects(Kind.SERVICE))) == sorted(
        f"default/after-{i}" for i in range(6)
    )


def test_objects_without_a_name_are_skipped_and_counted(
    server: FakeApiServer, start_source: SourceFactory
) -> None:
    source, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    skipped = metric("ekp_watch_unnamed_objects_total", kind="Service")
    wait_until(lambda: server.open_streams("Service") == 1)
    server.inject_watch_line("Service", b'{"type":"ADDED","object":{"metadata":{"namespace":"default"}}}')
    server.inject_watch_line(
        "Service", b'{"type":"ADDED","object":{"metadata":{"name":7,"resourceVersion":"x"}}}'
    )
    server.create(service("ok", "10.96.0.1"))
    sink.wait(lambda: "default/ok" in sink.state(Kind.SERVICE))
    assert metric("ekp_watch_unnamed_objects_total", kind="Service") == skipped + 2
    assert source.list_counts()[Kind.SERVICE] == 1, "a nameless object is not a broken stream"


def test_odd_objects_are_delivered_as_they_are(server: FakeApiServer, start_source: SourceFactory) -> None:
    # Shapes no validation would let through still reach the model, which reports them as Problems.
    odd = {
        "kind": "Service",
        "apiVersion": "v1",
        "metadata": {"name": "odd", "namespace": "default", "labels": {"a": "b"}},
        "spec": "not a map",
    }
    server.create(odd)
    _, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    assert sink.state(Kind.SERVICE)["default/odd"]["spec"] == "not a map"


def test_a_sink_that_raises_does_not_lose_events(server: FakeApiServer, start_source: SourceFactory) -> None:
    source, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    wait_until(lambda: server.open_streams("Service") == 1)
    sink.fail_kind, sink.fail_next = Kind.SERVICE, 1
    server.create(service("web", "10.96.0.1"))
    sink.wait(lambda: "default/web" in sink.state(Kind.SERVICE), what="the event again after the relist")
    assert source.list_counts()[Kind.SERVICE] == 2
    assert changes(sink.objects(Kind.SERVICE)) == [(EventType.ADDED, "default/web")]


def test_stop_returns_promptly_with_open_watches(server: FakeApiServer, start_source: SourceFactory) -> None:
    source, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    wait_until(lambda: server.open_streams() == 3)
    start = time.monotonic()
    source.stop()
    assert time.monotonic() - start < 1.0
    wait_until(lambda: server.open_streams() == 0, timeout=2)
