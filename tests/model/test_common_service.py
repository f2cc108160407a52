"""The fast readings of a Service's common fields agree with the full validation on all they accept."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.model import parse
from agent.model.parse import _check_service_ports, _checked_cluster_ips, _common_cluster_ip, _service_ports
from agent.model.validate import ParseError

CLUSTER_IPS: list[Any] = [
    "10.96.0.10",
    "0.0.0.0",
    "127.0.0.1",
    "010.96.0.10",
    "10.96.0.256",
    "None",
    "",
    "fd00::10",
    " 10.96.0.10",
    None,
    5,
]
TYPES = ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]


@st.composite
def cluster_ip_specs(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    spec: dict[str, Any] = {}
    ip = draw(st.sampled_from(CLUSTER_IPS))
    if draw(st.integers(0, 9)):
        spec["clusterIP"] = ip
    if draw(st.integers(0, 9)):  # mostly [ip]: the fast path's shape, so its other checks are tried
        spec["clusterIPs"] = draw(
            st.sampled_from([[ip]] * 6 + [[ip, "fd00::10"], [ip, "10.96.0.11"], ["10.96.0.11"], [], ip, None])
        )
    if draw(st.booleans()):
        spec["ipFamilies"] = draw(
            st.sampled_from([["IPv4"], ["IPv6"], ["IPv4", "IPv4"], ["IPv4", "IPv6"], [], "IPv4", None])
        )
    if draw(st.booleans()):
        spec["ipFamilyPolicy"] = draw(
            st.sampled_from(["SingleStack", "PreferDualStack", "RequireDualStack", "Other", 3, None])
        )
    return spec, draw(st.sampled_from(TYPES))


@settings(max_examples=600, deadline=None)
@given(cluster_ip_specs())
def test_the_common_cluster_ip_is_what_the_full_checks_read(case: tuple[dict[str, Any], str]) -> None:
    spec, svc_type = case
    fast = _common_cluster_ip(spec, svc_type)
    if fast is None:
        return  # the full checks decide alone
    try:
        full = _checked_cluster_ips(spec, svc_type)
    except ParseError as exc:
        raise AssertionError(f"fast path accepted what the full checks refuse: {exc}") from exc
    assert full == (False, [fast])


def test_the_common_cluster_ip_takes_the_usual_service_and_leaves_the_rest() -> None:
    usual = {"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"], "ipFamilies": ["IPv4"]}
    assert str(_common_cluster_ip(usual, "ClusterIP")) == "10.96.0.10"
    assert str(_common_cluster_ip({**usual, "ipFamilyPolicy": "SingleStack"}, "NodePort")) == "10.96.0.10"
    for spec, svc_type in (
        ({**usual, "clusterIP": "010.96.0.10", "clusterIPs": ["010.96.0.10"]}, "ClusterIP"),
        ({**usual, "clusterIPs": ["10.96.0.10", "fd00::10"]}, "ClusterIP"),
        ({**usual, "ipFamilies": ["IPv4", "IPv4"]}, "ClusterIP"),
        ({**usual, "ipFamilyPolicy": "Other"}, "ClusterIP"),
        (usual, "ExternalName"),
        ({"clusterIP": "None", "clusterIPs": ["None"]}, "ClusterIP"),
    ):
        assert _common_cluster_ip(spec, svc_type) is None, spec


PORT_FIELDS: list[tuple[str, list[Any]]] = [
    ("name", ["http", "", None, "HTTP", 5]),
    ("port", [80, 1, 0, 70000, None, True, 80.0, "80"]),
    ("protocol", ["TCP", "UDP", "BOGUS", None]),
    ("targetPort", [8080, 1, "web", 0, "", True, 70000, "Not_A_Name"]),
    ("appProtocol", [None, "http", "not valid!"]),
    ("nodePort", [0, 1, 30080, 70000, True, None]),
    ("other", ["x", [1], {"a": 1}]),
]


@st.composite
def service_ports(draw: st.DrawFn) -> Any:
    def one() -> dict[str, Any]:
        return {key: draw(st.sampled_from(values)) for key, values in PORT_FIELDS if draw(st.booleans())}

    return draw(
        st.sampled_from(
            [
                [one()],
                [one(), one()],
                [{"name": "a", "port": 1}, {"name": "a", "port": 1}],
                [],
                "x",
                None,
                ["x"],
            ]
        )
    )


def outcome(check: Any, spec: dict[str, Any], svc_type: str, headless: bool) -> Any:
    try:
        return check(spec, svc_type, headless)
    except ParseError as exc:
        return str(exc)


def twin(ports: Any, value: Any) -> Any:
    """`ports` with each field's value passed through `value`: lists not of maps as they are."""
    if type(ports) is not list or not all(type(p) is dict for p in ports):
        return ports
    return [{k: value(v) for k, v in p.items()} for p in ports]


def bool_twin(v: Any) -> Any:
    """True for 1 and 1 for True (False and 0 alike): equal in Python, not the same JSON."""
    if type(v) is bool:
        return int(v)
    return bool(v) if type(v) is int and v in (0, 1) else v


def float_twin(v: Any) -> Any:
    return float(v) if type(v) is int else v


@settings(max_examples=600, deadline=None)
@given(service_ports(), st.sampled_from(TYPES), st.booleans())
def test_service_ports_kept_or_not_read_as_the_full_checks_do(
    ports: Any, svc_type: str, headless: bool
) -> None:
    # Each example from an empty memo, then the spec and its twins one after another: a twin that
    # the memo took for the spec (a bool for a 1, 80.0 for 80, another type or headlessness) would
    # get the spec's outcome instead of its own.
    parse._SERVICE_PORTS_CHECKED.clear()
    other_type = TYPES[(TYPES.index(svc_type) + 1) % len(TYPES)]
    for spec, kind, none in (
        ({"ports": ports}, svc_type, headless),
        ({"ports": twin(ports, bool_twin)}, svc_type, headless),
        ({"ports": twin(ports, float_twin)}, svc_type, headless),
        ({"ports": ports}, other_type, headless),
        ({"ports": ports}, svc_type, not headless),
        ({"ports": ports}, svc_type, headless),  # kept, or refused again
    ):
        full = outcome(_check_service_ports, spec, kind, none)
        assert outcome(_service_ports, spec, kind, none) == full, (spec, kind, none)


def test_a_services_ports_are_checked_once_per_distinct_list_and_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked: list[Any] = []

    def counting(spec: Any, svc_type: str, headless: bool) -> Any:
        checked.append(spec)
        return _check_service_ports(spec, svc_type, headless)

    monkeypatch.setattr(parse, "_check_service_ports", counting)
    monkeypatch.setattr(parse, "_SERVICE_PORTS_CHECKED", {})
    spec = {"ports": [{"name": "http", "port": 1, "protocol": "TCP", "targetPort": 8080}]}
    first = _service_ports(spec, "NodePort", False)
    assert _service_ports({"ports": [dict(spec["ports"][0])]}, "NodePort", False) is first
    assert len(checked) == 1
    assert _service_ports(spec, "ClusterIP", False) is not first  # another type, another entry
    # equal in Python but not the same JSON: a bool is no port number
    with pytest.raises(ParseError, match=r"spec.ports\[0\].port"):
        _service_ports({"ports": [{**spec["ports"][0], "port": True}]}, "NodePort", False)
    refused = {"ports": [{"name": "http", "port": 70000}]}
    for _ in range(2):
        with pytest.raises(ParseError, match="70000"):
            _service_ports(refused, "ClusterIP", False)
    assert len(checked) == 5, "a refused list is checked each time"
    assert len(parse._SERVICE_PORTS_CHECKED) == 2


def test_only_short_lists_without_a_node_port_are_kept_and_none_once_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memo: dict[Any, Any] = {}
    monkeypatch.setattr(parse, "_SERVICE_PORTS_CHECKED", memo)
    port = {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}
    one_offs = [
        # nodePort is unique cluster-wide: a NodePort Service's list never repeats
        ({"ports": [{**port, "nodePort": 30080}]}, "NodePort"),
        ({"ports": [{**port, "name": f"p{i}", "port": 80 + i} for i in range(9)]}, "ClusterIP"),
        ({"ports": [{**port, "x-unknown": "y" * 10_000}]}, "ClusterIP"),  # unchecked: any size
    ]
    for spec, svc_type in one_offs:
        assert _service_ports(spec, svc_type, False) == _check_service_ports(spec, svc_type, False)
    assert memo == {}
    monkeypatch.setattr(parse, "_PORTS_CHECKED_MAX", 1)
    _service_ports({"ports": [port]}, "ClusterIP", False)
    assert len(memo) == 1
    built: list[Any] = []
    monkeypatch.setattr(parse, "_MEMO_PORT_FIELDS", Spy(built))
    other = {"ports": [{**port, "port": 81}]}
    assert _service_ports(other, "ClusterIP", False) == _check_service_ports(other, "ClusterIP", False)
    assert len(memo) == 1 and built == [], "full: the key is not even built"


class Spy(frozenset[str]):
    """The memo's field set, recording each look at it (the start of building a key)."""

    def __new__(cls, seen: list[Any]) -> Spy:
        made = super().__new__(cls, parse._MEMO_PORT_FIELDS)
        made.seen = seen
        return made

    seen: list[Any]

    def issuperset(self, other: Any) -> bool:
        self.seen.append(other)
        return super().issuperset(other)
