"""A list item decoded typed (agent.model.wire) reads into the very record the whole decode gives."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.model import parse, wire
from agent.model.parse import SlicePort
from agent.model.tracker import read_service, read_slice
from agent.model.types import Protocol
from agent.model.wire import TRIGGER_TIME_ANNOTATION
from tests.model.test_common_endpoint import endpoints
from tests.model.test_common_service import bool_twin, float_twin, twin

TRIGGER = "2026-11-27T10:00:00Z"


def slice_obj(address_type: Any = "IPv4", **fields: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {
            "name": "web-abcde",
            "namespace": "default",
            "uid": "u-1",
            "resourceVersion": "7",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"kubernetes.io/service-name": "web"},
            "annotations": {TRIGGER_TIME_ANNOTATION: TRIGGER, "other": "x"},
            "managedFields": [{"manager": "kcm", "fieldsV1": {"f:endpoints": {}}}],
            "ownerReferences": [{"kind": "Service", "name": "web", "uid": "s-1"}],
        },
        "addressType": address_type,
        "endpoints": [
            {
                "addresses": ["10.244.1.2" if address_type == "IPv4" else "fd00::2"],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": "node1",
                "zone": "zone-a",
                "targetRef": {"kind": "Pod", "name": "web-1", "uid": "p-1"},
                "deprecatedTopology": {"a": "b"},
            }
        ],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }
    obj.update(fields)
    return obj


def service_obj(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "clusterIP": "10.96.0.10",
        "clusterIPs": ["10.96.0.10"],
        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        "type": "ClusterIP",
    }
    body.update(spec)
    return {
        "metadata": {
            "name": "web",
            "namespace": "default",
            "uid": "s-1",
            "resourceVersion": "5",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": "web"},
            "managedFields": [{"manager": "kubectl"}],
        },
        "spec": body,
        "status": {"loadBalancer": {}},
    }


def both_slice(obj: Any) -> tuple[Any, Any, Any]:
    """(typed item, typed record, whole record) of `obj` as a list item's bytes."""
    raw = orjson.dumps(obj)
    item = wire.endpoint_slice(raw)
    return item, read_slice(item, "node1"), read_slice(orjson.loads(raw), "node1")


def both_service(obj: Any) -> tuple[Any, Any, Any]:
    raw = orjson.dumps(obj)
    item = wire.service(raw)
    return item, read_service(item), read_service(orjson.loads(raw))


def test_the_common_slice_is_read_from_structs_without_the_fields_nobody_reads() -> None:
    for family in ("IPv4", "IPv6"):
        item, typed, whole = both_slice(slice_obj(family))
        assert all(type(e) is wire.WireEndpoint for e in item["endpoints"]), "the typed path was taken"
        assert "managedFields" not in item["metadata"] and "ownerReferences" not in item["metadata"]
        assert item["metadata"]["annotations"] == {TRIGGER_TIME_ANNOTATION: TRIGGER}
        assert typed == whole
        assert typed.parsed is not None and str(typed.parsed.family) == family
        assert typed.trigger_time is not None
        (ep,) = typed.parsed.endpoints
        assert (ep.ready, ep.serving, ep.terminating, ep.node_name, ep.zone, ep.is_local) == (
            True,
            True,
            False,
            "node1",
            "zone-a",
            True,
        )


def test_a_field_of_the_wrong_type_gives_the_whole_decodes_malformed_outcome() -> None:
    cases: list[dict[str, Any]] = [
        slice_obj(endpoints=[{"addresses": ["10.244.1.2"], "conditions": {"ready": "false"}}]),
        slice_obj(endpoints=[{"addresses": [7]}]),
        slice_obj(endpoints=[{"addresses": "10.244.1.2"}]),
        slice_obj(endpoints=[{"addresses": ["10.244.1.2"], "nodeName": 5}]),
        slice_obj(endpoints="all"),
        slice_obj(metadata="web"),
        slice_obj(metadata=None),
    ]
    for obj in cases:
        item, typed, whole = both_slice(obj)
        assert typed.error is not None, obj
        assert typed == whole, obj
        assert not any(type(e) is wire.WireEndpoint for e in item.get("endpoints") or ()), "decoded whole"
    for spec in ({"ports": "http"}, {"clusterIP": 10}, {"ports": [{"name": "http", "port": "80"}]}):
        _, typed_svc, whole_svc = both_service(service_obj(**spec))
        assert typed_svc.error is not None and typed_svc == whole_svc, spec
    # A value the typed decode accepts but the parser refuses: the same message from the Structs.
    _, typed, whole = both_slice(slice_obj(endpoints=[{"addresses": ["10.244.1.300"], "nodeName": "n"}]))
    assert typed.error is not None and "endpoints[0].addresses[0]" in typed.error
    assert typed == whole


def test_optional_fields_absent_or_null_read_as_before() -> None:
    minimal: dict[str, Any] = {
        "metadata": {
            "name": "web-1",
            "resourceVersion": "3",
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "addressType": "IPv4",
    }
    item, typed, whole = both_slice(minimal)
    assert set(item) == {"metadata", "addressType"} and typed == whole
    assert typed.parsed is not None and typed.parsed.endpoints == ()
    bare = {"addresses": ["10.244.1.2"]}
    nulls = {"addresses": ["10.244.1.2"], "conditions": None, "nodeName": None, "zone": None}
    partial = {"addresses": ["10.244.1.2"], "conditions": {"ready": False, "serving": None}}
    ending = {
        "addresses": ["10.244.1.2"],
        "conditions": {"ready": False, "serving": True, "terminating": True},
    }
    hinted = {"addresses": ["10.244.1.2"], "hostname": "h1", "hints": {"forZones": [{"name": "a"}]}}
    for ep in (bare, nulls, partial, ending, hinted):
        _, typed, whole = both_slice(slice_obj(endpoints=[ep], ports=None, metadata=minimal["metadata"]))
        assert typed == whole, ep
        assert typed.parsed is not None and len(typed.parsed.endpoints) == 1
    _, typed_svc, whole_svc = both_service({"metadata": {"name": "web", "resourceVersion": "1"}})
    assert typed_svc == whole_svc and typed_svc.error is not None  # no ports: refused alike


def test_an_item_without_a_resource_version_is_decoded_whole() -> None:
    obj = slice_obj()
    del obj["metadata"]["resourceVersion"]
    item = wire.endpoint_slice(orjson.dumps(obj))
    assert item == obj, "whole, so the reflector's digest covers every field"


SLICE_KEYS = ["metadata", "addressType", "endpoints", "ports"]


@st.composite
def slice_ports(draw: st.DrawFn) -> Any:
    """A slice's ports: valid, refused (a bad name, number, protocol, a duplicate), or of a type
    the typed decode refuses (a bool or float number, a string for a port)."""
    port: dict[str, Any] = {}
    for key, values in (
        ("name", ["http", "", None, "HTTP", 5]),
        ("port", [8080, 1, 0, 70000, None, True, 8080.0, "8080"]),
        ("protocol", ["TCP", "UDP", "BOGUS", None, 3]),
        ("appProtocol", [None, "http", "not valid!"]),
        ("other", ["x"]),
    ):
        if draw(st.booleans()):
            port[key] = draw(st.sampled_from(values))
    return draw(st.sampled_from([[port], [port, dict(port)], [port, {"name": "b", "port": 9}], "x"]))


@st.composite
def slices(draw: st.DrawFn) -> Any:
    obj = slice_obj(draw(st.sampled_from(["IPv4", "IPv6", "FQDN", 4, None])))
    obj["endpoints"] = draw(st.lists(endpoints(), max_size=3))
    if draw(st.integers(0, 2)) == 0:
        obj["ports"] = draw(slice_ports())
    if draw(st.integers(0, 4)) == 0:
        obj["metadata"][draw(st.sampled_from(["name", "labels", "annotations", "uid"]))] = draw(
            st.sampled_from([None, "x", 3, [], {}, {TRIGGER_TIME_ANNOTATION: 5}])
        )
    if draw(st.integers(0, 4)) == 0:
        obj[draw(st.sampled_from(SLICE_KEYS))] = draw(st.sampled_from([None, "x", 3, [], {}]))
    return obj


@settings(max_examples=400, deadline=None)
@given(slices())
def test_typed_and_whole_decodes_agree_on_any_slice(obj: Any) -> None:
    # From an empty memo, then the slice's twins (a bool for a 1, a float for an int: equal in
    # Python, not the same JSON) and the slice again, kept: each has the whole decode's outcome.
    parse._PORTS_CHECKED.clear()
    for one in (obj, ports_twin(obj, bool_twin), ports_twin(obj, float_twin), obj):
        _, typed, whole = both_slice(one)
        assert typed == whole, one.get("ports")


def ports_twin(obj: Any, value: Any) -> Any:
    return {**obj, "ports": twin(obj["ports"], value)} if "ports" in obj else obj


def test_a_slices_ports_are_checked_once_per_distinct_list_and_a_refused_list_each_time(
    monkeypatch: Any,
) -> None:
    checked: list[Any] = []
    check = parse._check_slice_ports

    def counting(raw: Any) -> Any:
        checked.append(raw)
        return check(raw)

    monkeypatch.setattr(parse, "_check_slice_ports", counting)
    monkeypatch.setattr(parse, "_PORTS_CHECKED", {})

    def typed(obj: Any) -> Any:
        return read_slice(wire.endpoint_slice(orjson.dumps(obj)), "node1")

    ports = [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}]
    first, second = typed(slice_obj(ports=ports)), typed(slice_obj(ports=ports))
    assert first == second and first.parsed is not None
    assert first.parsed.ports == (SlicePort("http", 8080, Protocol.TCP),)
    assert first.parsed.ports is second.parsed.ports, "one tuple of ports for the two slices"
    assert len(checked) == 1
    bad = [{"name": "http", "port": 70000}]
    refused = [typed(slice_obj(ports=bad)) for _ in range(2)]
    assert refused[0] == refused[1] and refused[0].error is not None and "ports[0].port" in refused[0].error
    assert len(checked) == 3, "a refused list is not kept"
    long = [{"name": f"p{i}", "port": 80 + i} for i in range(9)]
    assert typed(slice_obj(ports=long)) == typed(slice_obj(ports=long))
    assert len(checked) == 5 and len(parse._PORTS_CHECKED) == 1, "a long list is not kept"
    monkeypatch.setattr(parse, "_PORTS_CHECKED_MAX", 1)
    other = [{"name": "http", "port": 8081}]
    assert typed(slice_obj(ports=other)) == typed(slice_obj(ports=other))
    assert len(checked) == 7 and len(parse._PORTS_CHECKED) == 1, "full: new lists checked each time"


def test_a_slices_ports_read_from_structs_as_from_the_whole_decode() -> None:
    typed_cases: list[Any] = [  # of the types WirePort declares: read from the Structs
        [{"name": "http", "port": 8080, "protocol": "UDP", "appProtocol": "kubernetes.io/h2c", "x": 1}],
        [{"port": 8080}],
        [{"name": "http", "port": 0}],  # no number: ignored
        [],
        [{"name": "http", "port": 8080, "appProtocol": "not valid!"}],
        [{"name": "HTTP", "port": 8080}],
        [{"name": "http", "port": 8080, "protocol": "SCTPX"}],
        [{"name": "a", "port": 1}, {"name": "a", "port": 2}],
        [{"name": "a", "port": 70000}],
        [{"name": f"p{i}", "port": 80 + i} for i in range(9)],  # longer than the memo keeps
    ]
    whole_cases: list[Any] = [  # of another type: the item decoded whole
        [{"name": "a", "port": True}],
        [{"name": "a", "port": 8080.0}],
        [{"name": "a", "port": "8080"}],
        [{"name": 5, "port": 8080}],
        ["http"],
        "http",
    ]
    for ports in [*typed_cases, None, *whole_cases]:
        for _ in range(2):  # checked, then kept
            item, typed, whole = both_slice(slice_obj(ports=ports))
            assert typed == whole, ports
            if ports in typed_cases:
                assert type(item["ports"]) is tuple, ports
                assert all(type(p) is wire.WirePort for p in item["ports"]), ports


def test_an_explicit_empty_node_name_is_refused_from_the_structs_too() -> None:
    for node in ("", "Node1"):
        ep = {"addresses": ["10.244.1.2"], "nodeName": node}
        _, typed, whole = both_slice(slice_obj(endpoints=[ep]))
        assert typed.error is not None and "endpoints[0].nodeName" in typed.error
        assert typed == whole


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["spec", "status", "metadata"]),
    st.sampled_from([None, "x", 3, [], {}, {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}]),
)
def test_typed_and_whole_decodes_agree_on_any_service(field: str, value: Any) -> None:
    obj = service_obj(type="LoadBalancer")
    obj[field] = value
    _, typed, whole = both_service(obj)
    assert typed == whole


def test_an_item_msgspec_cannot_read_as_text_or_that_nests_too_deep_is_the_whole_decode_s_outcome() -> None:
    """Invalid UTF-8 (msgspec: UnicodeDecodeError) or nesting past the decoders' limits
    (RecursionError) in one item: what orjson's whole decode makes of it (None: not JSON, an item
    without a name), never an exception that would fail the whole list and list it again forever."""
    good = orjson.dumps(slice_obj())
    bad_utf8 = good.replace(b'"IPv4"', b'"IPv\xff"', 1)
    bad_name = good.replace(b'"web-abcde"', b'"web-\xff"', 1)
    deep = good[:-1] + b',"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    for raw in (bad_utf8, bad_name, deep):
        assert wire.endpoint_slice(raw) == wire.whole(raw) is None
    assert wire.service(bad_name) is None  # a field the Service decoder reads
