"""The interim object store of agent/app.py: applies source events, gates the first sync."""

from __future__ import annotations

from agent.app import ObjectStore
from agent.sources.base import EventType, Kind, ObjectEvent, Synced

SVC = {"kind": "Service", "metadata": {"name": "web"}}
SLICE = {"kind": "EndpointSlice", "metadata": {"name": "web-1"}}
KINDS = frozenset({Kind.SERVICE, Kind.ENDPOINT_SLICE})


def test_nothing_before_every_kind_is_synced_then_the_objects_and_version() -> None:
    store = ObjectStore(KINDS)
    store.apply(
        [
            ObjectEvent(Kind.SERVICE, EventType.ADDED, "default/web", SVC),
            ObjectEvent(Kind.ENDPOINT_SLICE, EventType.ADDED, "default/web-1", SLICE),
            Synced(Kind.SERVICE, "v1"),
        ]
    )
    assert store.snapshot() is None, "EndpointSlices not listed yet: no sync may prune anything"
    store.apply([Synced(Kind.ENDPOINT_SLICE, "v1")])
    snap = store.snapshot()
    assert snap is not None
    assert (snap.services, snap.endpoint_slices, snap.version) == ((SVC,), (SLICE,), "v1")


def test_modified_and_deleted_objects() -> None:
    store = ObjectStore(KINDS)
    changed = {**SVC, "spec": {"clusterIP": "10.96.0.10"}}
    store.apply(
        [
            ObjectEvent(Kind.SERVICE, EventType.ADDED, "default/web", SVC),
            ObjectEvent(Kind.SERVICE, EventType.MODIFIED, "default/web", changed),
            ObjectEvent(Kind.ENDPOINT_SLICE, EventType.ADDED, "default/web-1", SLICE),
            ObjectEvent(Kind.ENDPOINT_SLICE, EventType.DELETED, "default/web-1", SLICE),
            Synced(Kind.SERVICE, "v2"),
            Synced(Kind.ENDPOINT_SLICE, "v2"),
        ]
    )
    snap = store.snapshot()
    assert snap is not None
    assert snap.services == (changed,) and snap.endpoint_slices == ()
