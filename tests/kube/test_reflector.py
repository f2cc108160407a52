"""The reflector over a fake list call: response bodies no real API server would send.

The fake stands in for the generated client method (`Resource.list_call`), returning canned
bodies, so each odd shape is exercised deterministically, without HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from agent.kube.backoff import Backoff
from agent.kube.reflector import Reflector, WatchSettings
from agent.kube.resources import Resource
from agent.sources.base import EventType, Kind, ObjectEvent, Synced
from tests.kube.conftest import Recorded

SETTINGS = WatchSettings(backoff=Backoff(initial_s=0.001, cap_s=0.002, jitter=0.0))


class FakeResponse:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, amt: int, decode_content: bool = True) -> Iterator[bytes]:
        if self.data:
            yield self.data

    def release_conn(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeListCall:
    """Answers list requests with `pages` in order; the first watch stops the reflector."""

    def __init__(self, pages: list[bytes], stopping: threading.Event, watch_body: bytes = b"") -> None:
        self.pages = pages
        self.stopping = stopping
        self.watch_body = watch_body
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kw: Any) -> FakeResponse:
        self.calls.append(kw)
        if kw.get("watch"):
            body, self.watch_body = self.watch_body, b""
            if not body:
                self.stopping.set()
            return FakeResponse(body)
        return FakeResponse(self.pages.pop(0))


def run(pages: list[bytes], watch_body: bytes = b"") -> tuple[Recorded, FakeListCall]:
    stopping = threading.Event()
    call = FakeListCall(pages, stopping, watch_body)
    sink = Recorded()
    Reflector(Resource(Kind.SERVICE, "v1", call), sink, SETTINGS, stopping).run()
    return sink, call


def test_unreadable_list_bodies_are_retried_and_odd_items_skipped() -> None:
    good = (
        b'{"kind":"ServiceList","metadata":{"resourceVersion":"5","continue":7},"items":['
        b'1,"x",null,{"metadata":{"name":"a","namespace":"ns"}},{"metadata":{"name":""}},'
        b'{"metadata":[]},{"metadata":{"name":"a","namespace":"ns"}}]}'
    )
    sink, call = run([b"not json", b"[1, 2]", b'{"items": 5}', good])
    assert [c.get("_continue") for c in call.calls if not c.get("watch")] == [None] * 4
    events = sink.events
    assert [(e.type, e.key) for e in events if isinstance(e, ObjectEvent)] == [(EventType.ADDED, "ns/a")]
    assert events[-1] == Synced(Kind.SERVICE, "5")
    assert events[0].obj["kind"] == "Service"  # type: ignore[union-attr]
    assert call.calls[-1]["resource_version"] == "5"


def test_a_null_items_list_is_empty() -> None:
    sink, _ = run([b'{"metadata":{"resourceVersion":"9"},"items":null}'])
    assert sink.events == [Synced(Kind.SERVICE, "9")]


def test_watch_410_relist_sends_the_differences() -> None:
    first = (
        b'{"metadata":{"resourceVersion":"5"},"items":['
        b'{"metadata":{"name":"a","namespace":"n","resourceVersion":"2"}},'
        b'{"metadata":{"name":"b","namespace":"n","resourceVersion":"3"}}]}'
    )
    second = (
        b'{"metadata":{"resourceVersion":"9"},"items":['
        b'{"metadata":{"name":"a","namespace":"n","resourceVersion":"7"}},'
        b'{"metadata":{"name":"c","namespace":"n","resourceVersion":"8"}}]}'
    )
    gone = b'{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired","message":"too old"}}\n'
    sink, call = run([first, second], watch_body=gone)
    after = sink.events[3:]
    assert [(e.type, e.key) for e in after if isinstance(e, ObjectEvent)] == [
        (EventType.MODIFIED, "n/a"),
        (EventType.ADDED, "n/c"),
        (EventType.DELETED, "n/b"),
    ]
    assert after[-1] == Synced(Kind.SERVICE, "9")
    deleted = next(e for e in after if isinstance(e, ObjectEvent) and e.type is EventType.DELETED)
    assert deleted.obj["metadata"]["resourceVersion"] == "3", "the last state delivered"
    assert call.calls[-1]["resource_version"] == "9"


def test_watch_events_are_reconciled_against_what_was_delivered() -> None:
    listed = b'{"metadata":{"resourceVersion":"5"},"items":[{"metadata":{"name":"a","namespace":"n"}}]}'
    stream = b"".join(
        [
            b'{"type":"ADDED","object":{"metadata":{"name":"a","namespace":"n","resourceVersion":"6"}}}\n',
            b'{"type":"DELETED","object":{"metadata":{"name":"zz","namespace":"n","resourceVersion":"7"}}}\n',
            b'{"type":"MODIFIED","object":{"metadata":{"name":"b","namespace":"n","resourceVersion":"8"}}}\n',
            b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"12"}}}\n',
        ]
    )
    sink, call = run([listed], watch_body=stream)
    assert [(e.type, e.key) for e in sink.objects()] == [
        (EventType.ADDED, "n/a"),
        (EventType.MODIFIED, "n/a"),  # ADDED for a known key
        (EventType.ADDED, "n/b"),  # MODIFIED for an unknown key; the unknown DELETED is dropped
    ]
    assert call.calls[-1]["resource_version"] == "12", "the bookmark moved the watch on"
