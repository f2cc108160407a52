"""agent.handover: a batch read into records in the child process crosses as marshalled tuples and
comes back equal, field for field, whatever it holds."""

from __future__ import annotations

from typing import Any

from agent.daemon import _Read, read_events
from agent.handover import pack, read_and_pack, unpack
from agent.model.tracker import SliceRecord
from agent.model.types import Endpoint
from agent.sources.base import Event, EventType, Kind, ObjectEvent, Synced, object_key
from lab.fakeapi.objects import endpoint_slice, service


def added(kind: Kind, obj: dict[str, Any], rv: str) -> ObjectEvent:
    obj["metadata"]["resourceVersion"] = rv
    obj["metadata"]["uid"] = f"uid-{rv}"
    return ObjectEvent(kind, EventType.ADDED, object_key(kind, obj), obj)


def shapes() -> list[Event]:
    plain = endpoint_slice(
        "web", ["10.244.1.1", "10.244.2.1"], node="node1", ports=(("http", 8080), ("m", 9090))
    )
    hinted = endpoint_slice("hinted", ["10.244.3.1"], node="node2")
    hinted["endpoints"][0]["hints"] = {"forZones": [{"name": "zone-a"}], "forNodes": [{"name": "node2"}]}
    hinted["endpoints"][0]["conditions"] = {"ready": False, "serving": True, "terminating": True}
    six = endpoint_slice("six", ["fd00::1"])
    six["addressType"] = "IPv6"
    fqdn = endpoint_slice("fqdn", ["example.com"])
    fqdn["addressType"] = "FQDN"  # not ours: no parsed slice
    bad = endpoint_slice("bad", ["10.244.9.1"])
    bad["ports"] = [{"name": "http", "port": "not-a-port", "protocol": "TCP"}]
    no_trigger = endpoint_slice("quiet", ["10.244.8.1"])
    del no_trigger["metadata"]["annotations"]
    slices = [plain, hinted, six, fqdn, bad, no_trigger]
    events: list[Event] = [added(Kind.ENDPOINT_SLICE, s, str(10 + i)) for i, s in enumerate(slices)]
    events.append(added(Kind.SERVICE, service("web", "10.96.0.1"), "30"))
    gone = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "old", "namespace": "ns"},
    }
    events.append(ObjectEvent(Kind.ENDPOINT_SLICE, EventType.DELETED, "ns/old", gone))
    events.append(Synced(Kind.ENDPOINT_SLICE, "42"))
    return events


def test_every_field_of_every_record_round_trips() -> None:
    read = read_events(shapes(), "node1")
    records = [e.record for e in read if isinstance(e, _Read) and isinstance(e.record, SliceRecord)]
    # The shapes really differ: a parsed slice of each family, one with hints and conditions
    # off their defaults, one the model ignores, one refused with its error, one without a trigger.
    assert len(records) == 6
    assert {r.parsed is None for r in records} == {True, False}
    assert any(r.error for r in records) and any(r.trigger_time is None for r in records)
    assert any(ep.zone_hints and ep.terminating for r in records if r.parsed for ep in r.parsed.endpoints)

    back = unpack(read_and_pack(shapes(), "node1"))

    assert back == read
    assert [type(e) for e in back] == [type(e) for e in read]
    for got in back:
        rec = got.record if isinstance(got, _Read) else None
        if isinstance(rec, SliceRecord) and rec.parsed is not None:
            assert all(type(ep) is Endpoint for ep in rec.parsed.endpoints)


def test_a_batch_of_only_what_is_not_a_slice_record_goes_too() -> None:
    batch: list[object] = [Synced(Kind.SERVICE, "7")]
    assert unpack(pack(batch)) == batch
    assert unpack(pack([])) == []
