"""bench.firstsync at a small scale: every phase runs, the first sync writes every entry, the
restart none."""

from __future__ import annotations

from agent.model.tracker import read_service, read_slice
from agent.model.wire import TRIGGER_TIME_ANNOTATION
from bench import firstsync
from lab.fakeapi.objects import scale_objects


def test_a_small_first_sync_and_restart() -> None:
    out = firstsync.run(40, 3)
    # fe, slot, be, rnat, member, and addr (the cluster IP and the endpoints' addresses) per service
    assert out["entries"] == 40 * (2 + 3 + 3 + 1 + 3 + 1 + 3)
    assert out["restart writes"] == 0
    assert all(out[phase] > 0 for phase in ("lists", "commit", "first sync", "restart"))


def test_the_varied_objects_miss_the_parsers_memos_and_sync_as_the_same() -> None:
    objects = scale_objects(60, 2, varied=True)
    services = [o for o in objects if o["kind"] == "Service"]
    slices = [o for o in objects if o["kind"] == "EndpointSlice"]
    assert len({repr(s["spec"]["ports"]) for s in services}) == 60, "a port list per Service"
    node_ports = [p["nodePort"] for s in services for p in s["spec"]["ports"] if "nodePort" in p]
    assert len(node_ports) == len(set(node_ports)) == 3
    assert len({repr(s["ports"]) for s in slices}) == 60
    times = [s["metadata"]["annotations"][TRIGGER_TIME_ANNOTATION] for s in slices]
    assert len(set(times)) == 60 and all(len(t) == len("2026-11-28T06:00:00.000000000Z") for t in times)
    assert all(read_service(s).error is None for s in services)
    assert all(read_slice(s, "node1").trigger_time is not None for s in slices)
    out = firstsync.run(40, 3, varied=True)
    assert out["entries"] > 40 * (2 + 3 + 3 + 1 + 3 + 1 + 3), "the two NodePorts' entries besides"
    assert out["restart writes"] == 0
