"""The reflector over a fake list call: response bodies no real API server would send.

The fake stands in for the generated client method (`Resource.list_call`), returning canned
bodies, so each odd shape is exercised deterministically, without HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from kubernetes.client.exceptions import ApiException

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
    """Answers list requests with `pages` in order (an exception is raised as the client would);
    the watches get `watch_bodies` in order, and the first watch after them stops the reflector."""

    def __init__(
        self, pages: list[bytes | ApiException], stopping: threading.Event, watch_bodies: list[bytes]
    ) -> None:
        self.pages = pages
        self.stopping = stopping
        self.watch_bodies = watch_bodies
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kw: Any) -> FakeResponse:
        self.calls.append(kw)
        if kw.get("watch"):
            body = self.watch_bodies.pop(0) if self.watch_bodies else b""
            if not body:
                self.stopping.set()
            return FakeResponse(body)
        page = self.pages.pop(0)
        if isinstance(page, ApiException):
            raise page
        return FakeResponse(page)

    def lists(self) -> list[tuple[Any, Any, Any]]:
        """(resource_version, limit, _continue) of each list request."""
        return [(c["resource_version"], c["limit"], c["_continue"]) for c in self.calls if not c.get("watch")]


def run(
    pages: list[bytes | ApiException], watch_body: bytes = b"", *more_watches: bytes
) -> tuple[Recorded, FakeListCall]:
    stopping = threading.Event()
    call = FakeListCall(pages, stopping, [watch_body, *more_watches])
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


def listing(rv: str, *names: str, token: str = "") -> bytes:
    """A list page of Services `names` (each at resourceVersion 1), with a continue token or not."""
    meta = f',"continue":"{token}"' if token else ""
    items = ",".join(f'{{"metadata":{{"name":"{n}","namespace":"n","resourceVersion":"1"}}}}' for n in names)
    return f'{{"metadata":{{"resourceVersion":"{rv}"{meta}}},"items":[{items}]}}'.encode()


UNREADABLE = b"not an event\n"  # the watch breaks without a 410: a relist at the last version
GONE = b'{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired","message":"too old"}}\n'
PAGE = WatchSettings().page_size


def test_a_cache_answering_whole_is_relisted_at_the_last_version_whole() -> None:
    # client-go's reflector: the first list at resourceVersion=0 with the pager's limit (the watch
    # cache ignores it); the server answered whole, so a relist at the last version asks no limit.
    sink, call = run([listing("5", "a", "b"), listing("7", "a", "b")], UNREADABLE)
    assert call.lists() == [("0", PAGE, None), ("5", None, None)]
    assert [e for e in sink.events if isinstance(e, Synced)] == [
        Synced(Kind.SERVICE, "5"),
        Synced(Kind.SERVICE, "7"),
    ]
    assert len(sink.objects()) == 2, "the relist found nothing new"


def test_a_paging_server_is_followed_and_later_lists_keep_the_limit() -> None:
    # A server without a watch cache pages even the resourceVersion=0 list: each continue token is
    # followed (no resourceVersion beside it: the token carries the snapshot), and a later relist
    # asks the last version with the limit, as client-go does once it saw a paginated result.
    pages: list[bytes | ApiException] = [
        listing("5", "a", token="t1"),
        listing("5", "b", token="t2"),
        listing("5", "c"),
        listing("8", "a", token="t3"),
        listing("8", "b", "c"),
    ]
    sink, call = run(pages, UNREADABLE)
    assert call.lists() == [
        ("0", PAGE, None),
        (None, PAGE, "t1"),
        (None, PAGE, "t2"),
        ("5", PAGE, None),
        (None, PAGE, "t3"),
    ]
    assert [(e.type, e.key) for e in sink.objects()] == [(EventType.ADDED, f"n/{k}") for k in "abc"]
    assert sink.events[-1] == Synced(Kind.SERVICE, "8")


def test_a_relist_after_410_reads_consistently_in_pages_then_at_versions_again() -> None:
    # The version is gone: client-go lists with no resourceVersion (a consistent read, paged by the
    # limit from the first page's snapshot) rather than ask for a version the server lacks. The
    # next relist, not after a 410, asks the last version again.
    pages: list[bytes | ApiException] = [
        listing("5", "a", "b"),
        listing("9", "a", token="t1"),
        listing("9", "b"),
        listing("11", "a", "b"),
    ]
    sink, call = run(pages, GONE, UNREADABLE)
    assert call.lists() == [("0", PAGE, None), (None, PAGE, None), (None, PAGE, "t1"), ("9", None, None)]
    assert [e.version for e in sink.events if isinstance(e, Synced)] == ["5", "9", "11"]


def test_a_list_at_a_version_the_server_lacks_is_read_consistently() -> None:
    # A relist at the last version answered 410 (compacted) or 504 ResourceVersionTooLarge (an
    # etcd restored from a backup): the retry asks no version, not the same one again.
    too_large = ApiException(status=504, reason="Gateway Timeout")
    too_large.body = (
        '{"kind":"Status","code":504,"reason":"Timeout",'
        '"details":{"causes":[{"reason":"ResourceVersionTooLarge"}]}}'
    )
    gone = ApiException(status=410, reason="Gone")
    gone.body = '{"kind":"Status","code":410,"reason":"Expired"}'
    pages: list[bytes | ApiException] = [
        listing("5", "a"),
        gone,
        listing("9", "a"),
        listing("12", "a"),
        too_large,
        listing("3", "a"),
    ]
    sink, call = run(pages, UNREADABLE, UNREADABLE, UNREADABLE)
    assert call.lists() == [
        ("0", PAGE, None),
        ("5", None, None),
        (None, PAGE, None),
        ("9", None, None),
        ("12", None, None),
        (None, PAGE, None),
    ]
    assert [e.version for e in sink.events if isinstance(e, Synced)] == ["5", "9", "12", "3"]


def test_the_first_list_takes_kept_records_by_the_items_identity_alone() -> None:
    # A restart's first list asks the last run's records by kind, key, uid and resourceVersion,
    # read from each item's metadata; an item with a record goes out with it and its identity
    # only (the rest of it never decoded), any other whole. A relist never asks.
    kept = FakeKept({("n/a", "u-a", "2"): "record of a", ("n/b", "u-b", "3"): "record of b"})

    first = (
        b'{"metadata":{"resourceVersion":"5"},"items":['
        b'{"metadata":{"name":"a","namespace":"n","uid":"u-a","resourceVersion":"2"},"spec":{"x":1}},'
        b'{"metadata":{"name":"b","namespace":"n","uid":"u-b","resourceVersion":"4"},"spec":{"x":2}},'
        b'{"metadata":{"name":"c","uid":"u-c","resourceVersion":"6"},"spec":{"x":3}},'
        b'{"metadata":{"name":"d","namespace":"n","resourceVersion":"7"},"spec":{"x":4}},'
        b'{"metadata":{"name":"e","namespace":"n","uid":7,"resourceVersion":"8"},"spec":{"x":5}}]}'
    )
    relist = (
        b'{"metadata":{"resourceVersion":"9"},"items":['
        b'{"metadata":{"name":"a","namespace":"n","uid":"u-a","resourceVersion":"2"},"spec":{"x":1}},'
        b'{"metadata":{"name":"f","namespace":"n","uid":"u-f","resourceVersion":"9"},"spec":{"x":6}}]}'
    )
    stopping = threading.Event()
    call = FakeListCall([first, relist], stopping, [GONE])
    sink = Recorded()
    Reflector(Resource(Kind.SERVICE, "v1", call), sink, SETTINGS, stopping, kept=kept).run()

    synced = sink.events.index(Synced(Kind.SERVICE, "5"))
    events = [e for e in sink.events[:synced] if isinstance(e, ObjectEvent)]
    assert [(e.type, e.key, e.kept) for e in events] == [
        (EventType.ADDED, "n/a", "record of a"),
        (EventType.ADDED, "n/b", None),
        (EventType.ADDED, "default/c", None),
        (EventType.ADDED, "n/d", None),
        (EventType.ADDED, "n/e", None),
    ]
    assert events[0].obj == {
        "kind": "Service",
        "apiVersion": "v1",
        "metadata": {"name": "a", "namespace": "n", "uid": "u-a", "resourceVersion": "2"},
    }
    assert [e.obj["spec"] for e in events[1:]] == [{"x": 2}, {"x": 3}, {"x": 4}, {"x": 5}]
    relisted = [e for e in sink.events[synced:] if isinstance(e, ObjectEvent) and e.type is EventType.ADDED]
    assert [(e.key, e.kept, e.obj["spec"]) for e in relisted] == [("n/f", None, {"x": 6})]
    assert kept.asked == [
        (Kind.SERVICE, "n/a", "u-a", "2"),
        (Kind.SERVICE, "n/b", "u-b", "4"),
        (Kind.SERVICE, "default/c", "u-c", "6"),
    ], "only the first list asks, and only for items with a name, uid and resourceVersion"
    assert kept.records == {("n/b", "u-b", "3"): "record of b"}


def test_a_first_list_with_no_kept_record_left_asks_for_none() -> None:
    # A cold start (no file, or one ignored) reads no item's identity apart: it decodes them whole.
    kept = FakeKept({})
    stopping = threading.Event()
    body = (
        b'{"metadata":{"resourceVersion":"5"},"items":['
        b'{"metadata":{"name":"a","namespace":"n","uid":"u-a","resourceVersion":"2"},"spec":{"x":1}}]}'
    )
    sink = Recorded()
    Reflector(
        Resource(Kind.SERVICE, "v1", FakeListCall([body], stopping, [])), sink, SETTINGS, stopping, kept=kept
    ).run()
    assert [(e.key, e.kept, e.obj["spec"]) for e in sink.objects()] == [("n/a", None, {"x": 1})]
    assert kept.asked == []
    assert kept.emptied, "the reflector asked whether a record is left"


class FakeKept:
    """Records by (key, uid, resourceVersion), each taken once, as agent.keptrecords's."""

    def __init__(self, records: dict[tuple[str, str, str], object]) -> None:
        self.records = records
        self.asked: list[tuple[Kind, str, str, str]] = []
        self.emptied = 0

    def take(self, kind: Kind, key: str, uid: str, version: str) -> object | None:
        self.asked.append((kind, key, uid, version))
        return self.records.pop((key, uid, version), None)

    def empty(self) -> bool:
        self.emptied += 1
        return not self.records


def test_a_first_list_item_whose_name_is_not_utf8_is_skipped_and_the_list_syncs() -> None:
    # msgspec raises UnicodeDecodeError (not its own errors) on invalid UTF-8 in a field it reads:
    # the item is what orjson makes of it (not JSON: skipped as unnamed), the rest of the list
    # goes on and the kind syncs, instead of an error that lists the kind again and again.
    kept = FakeKept({("n/a", "u-a", "2"): "record of a"})
    first = (
        b'{"metadata":{"resourceVersion":"5"},"items":['
        b'{"metadata":{"name":"\xff","namespace":"n","uid":"u-x","resourceVersion":"3"},"spec":{"x":0}},'
        b'{"metadata":{"name":"a","namespace":"n","uid":"u-a","resourceVersion":"2"},"spec":{"x":1}}]}'
    )
    stopping = threading.Event()
    call = FakeListCall([first], stopping, [])
    sink = Recorded()
    Reflector(Resource(Kind.SERVICE, "v1", call), sink, SETTINGS, stopping, kept=kept).run()
    assert Synced(Kind.SERVICE, "5") in sink.events
    events = [e for e in sink.events if isinstance(e, ObjectEvent)]
    assert [(e.key, e.kept) for e in events] == [("n/a", "record of a")]
