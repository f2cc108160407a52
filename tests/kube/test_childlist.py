"""The first EndpointSlice list read in a child process (agent/kube/childlist.py), against the fake
API server: what reaches the sink is what the in-process list and the agent's reader make of the
same objects, field for field; the list's state, metrics and log lines reach the parent; a child
that dies is replaced by the in-process list.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

import pytest

from agent.daemon import _Read, read_events
from agent.handover import read_and_pack, unpack
from agent.kube.childlist import BatchReader
from agent.model.tracker import SliceRecord
from agent.sources.base import Event, EventType, Kind, ObjectEvent, Synced
from lab.fakeapi import FakeApiServer
from lab.fakeapi.objects import endpoint_slice
from tests.kube.conftest import Recorded, SourceFactory, wait_until
from tests.kube.test_recovery import metric

HOST = "node1"


def read(events: Sequence[Event]) -> Sequence[object]:
    return read_events(events, HOST)


READER = BatchReader(functools.partial(read_and_pack, hostname=HOST), unpack)


def fill(server: FakeApiServer, count: int = 8) -> None:
    """`count` slices of several shapes, and a malformed one."""
    for i in range(count):
        server.create(
            endpoint_slice(
                f"web-{i}",
                [f"10.244.{i}.{j + 1}" for j in range(i % 3 + 1)],
                node="node1" if i % 2 else "node2",
                ports=(("http", 8080 + i), ("metrics", 9090)),
            )
        )
    bad = endpoint_slice("bad", ["10.244.99.1"])
    bad["ports"] = [{"name": "http", "port": "not-a-port", "protocol": "TCP"}]
    server.create(bad)


def slice_events(sink: Recorded) -> list[object]:
    return [e for e in sink.events if getattr(e, "kind", None) is Kind.ENDPOINT_SLICE]


def in_process(start_source: SourceFactory, server: FakeApiServer) -> list[object]:
    _, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.ENDPOINT_SLICE)), what="the in-process list")
    return list(read(slice_events(sink)))  # type: ignore[arg-type]


def test_child_list_delivers_the_records_the_in_process_list_reads(
    server: FakeApiServer, start_source: SourceFactory
) -> None:
    fill(server)
    expected = in_process(start_source, server)
    lists_before = metric("ekp_api_list_duration_seconds_count", kind="EndpointSlice")
    source, sink = start_source(server, reader=READER)
    sink.wait(lambda: bool(sink.synced(Kind.ENDPOINT_SLICE)), what="the child's list")

    got = slice_events(sink)
    # Read in the child: records, not the objects the in-process list delivers.
    assert all(isinstance(e, _Read) for e in got[:-1]) and isinstance(got[-1], Synced)
    # Every field of every record (kind, key, resourceVersion, uid, the parsed slice and its
    # error) and the Synced version, as the agent reads the same objects in process.
    assert got == expected
    records = [e for e in got if isinstance(e, _Read)]
    assert len(records) == 9 and all(r.uid and r.version for r in records)
    bad = next(r for r in records if r.key == "default/bad-abcde")
    assert isinstance(bad.record, SliceRecord) and bad.record.error, "the malformed slice keeps its error"
    listed_at = server.resource_version
    # As after an in-process list, the reflector takes the version just after the Synced's batch.
    wait_until(lambda: source.list_counts()[Kind.ENDPOINT_SLICE] == 1, what="the list counted")
    assert source.resource_versions()[Kind.ENDPOINT_SLICE] == listed_at
    assert metric("ekp_api_list_duration_seconds_count", kind="EndpointSlice") == lists_before + 1

    # The watch that follows starts from the child's list: a change to a listed slice is a
    # MODIFIED (the delivered map came back), a new one ADDED, a deleted one DELETED.
    mark = sink.mark()
    server.update(endpoint_slice("web-1", ["10.244.1.9"], node="node1", ports=(("http", 8081),)))
    server.create(endpoint_slice("web-new", ["10.244.50.1"]))
    server.delete("EndpointSlice", "default", "web-2-abcde")
    sink.wait(lambda: len([e for e in sink.since(mark) if isinstance(e, ObjectEvent)]) == 3, what="3 events")
    assert [(e.type, e.key) for e in sink.since(mark) if isinstance(e, ObjectEvent)] == [
        (EventType.MODIFIED, "default/web-1-abcde"),
        (EventType.ADDED, "default/web-new-abcde"),
        (EventType.DELETED, "default/web-2-abcde"),
    ]
    watches = [r for r in server.requests if "endpointslices" in r.path and r.query.get("watch") == "true"]
    assert watches[-1].query.get("resourceVersion") == listed_at


def test_child_list_follows_pages_and_an_expired_continue_token(
    paging_server: FakeApiServer, start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = paging_server
    fill(server, 10)  # page size 3: four pages
    expected = in_process(start_source, server)
    expired: list[object] = []

    def expire_once(r: object) -> None:
        if "endpointslices" in r.path and "continue" in r.query and not expired:  # type: ignore[attr-defined]
            expired.append(r)
            server.expire_continue_tokens()

    server.on_request(expire_once)
    before = metric("ekp_relists_total", kind="EndpointSlice", reason="continue_expired")
    caplog.set_level(logging.INFO)
    _, sink = start_source(server, reader=READER)
    sink.wait(lambda: bool(sink.synced(Kind.ENDPOINT_SLICE)), what="the child's list")
    assert expired
    # The counter the child moved, and its log lines, reach the parent.
    assert metric("ekp_relists_total", kind="EndpointSlice", reason="continue_expired") == before + 1
    lines = [r for r in caplog.records if r.process != os.getpid()]
    assert any("continue token expired" in r.getMessage() for r in lines)
    assert any(
        r.getMessage().startswith("EndpointSlices") and "listed 11 at" in r.getMessage() for r in lines
    )
    # The restarted list re-reads page one, unchanged: no duplicates (the compaction moved the
    # list's resourceVersion on).
    got = slice_events(sink)
    assert got[:-1] == expected[:-1]
    assert got[-1] == Synced(Kind.ENDPOINT_SLICE, server.resource_version)


def test_a_child_that_dies_mid_list_is_replaced_by_the_in_process_list(
    paging_server: FakeApiServer, start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = paging_server
    fill(server, 10)
    calls = [0]

    def dies_at_the_second_page(events: Sequence[Event]) -> bytes:
        calls[0] += 1  # in the child's memory
        if calls[0] == 2:
            os._exit(3)
        return read_and_pack(events, HOST)

    caplog.set_level(logging.INFO)
    source, sink = start_source(server, reader=BatchReader(dies_at_the_second_page, unpack))
    sink.wait(lambda: bool(sink.synced(Kind.ENDPOINT_SLICE)), what="the fallback list")
    got = slice_events(sink)
    # Page one came from the child as records; the in-process list found it unchanged and sent the
    # rest as objects: every slice once, then one Synced.
    first = [e for e in got if isinstance(e, _Read)]
    rest = [e for e in got if isinstance(e, ObjectEvent)]
    assert len(first) == 3 and all(e.type is EventType.ADDED for e in rest)
    assert sorted([e.key for e in first] + [e.key for e in rest]) == sorted(
        [f"default/web-{i}-abcde" for i in range(10)] + ["default/bad-abcde"]
    )
    assert [e for e in got if isinstance(e, Synced)] == [Synced(Kind.ENDPOINT_SLICE, server.resource_version)]
    assert any(
        "the list read in a child process failed" in r.getMessage()
        and "exited with status 3" in r.getMessage()
        for r in caplog.records
    )
    wait_until(lambda: source.list_counts()[Kind.ENDPOINT_SLICE] == 1, what="one list counted")


def test_stop_ends_a_child_still_listing(server: FakeApiServer, start_source: SourceFactory) -> None:
    fill(server, 2)
    # Every EndpointSlice list fails: the child retries with backoff until the source stops.
    server.fail_next(1000, 503, match=lambda r: "endpointslices" in r.path)
    source, sink = start_source(server, reader=READER)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)), what="the Services list")
    reflector = next(r for r in source._reflectors if r.kind is Kind.ENDPOINT_SLICE)
    child = reflector._first_list
    assert child is not None and child.pid is not None  # type: ignore[attr-defined]
    pid = child.pid  # type: ignore[attr-defined]
    source.stop()
    assert not any(t.is_alive() for t in source._threads)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: gone
    assert not sink.synced(Kind.ENDPOINT_SLICE)
