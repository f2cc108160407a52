"""EndpointSlices validated as the API server validates them (ValidateEndpointSlice), one rule per row."""

from __future__ import annotations

from typing import Any

import pytest

from agent.model import NodeInfo, Protocol, ServicePortName, build_state
from agent.model.parse import parse_endpoint_slice

NODE = NodeInfo("node1")
SPN = ServicePortName("default", "web", "http", Protocol.TCP)
SERVICE = {
    "kind": "Service",
    "metadata": {"name": "web", "namespace": "default"},
    "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]},
}
EP = {"addresses": ["10.244.1.2"], "conditions": {"ready": True}, "nodeName": "node2"}
PORT = {"name": "http", "port": 8080, "protocol": "TCP"}


def eps(
    *endpoints: dict[str, Any],
    ports: list[Any] | None = None,
    meta: dict[str, Any] | None = None,
    labels: dict[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """A valid IPv4 slice `default/web-1` of Service web; top-level keys replaced (None deletes)."""
    obj: dict[str, Any] = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-1",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": "web", **(labels or {})},
            **(meta or {}),
        },
        "addressType": "IPv4",
        "ports": [PORT] if ports is None else ports,
        "endpoints": list(endpoints) if endpoints else [EP],
    }
    for key, value in top.items():
        if value is None:
            obj.pop(key, None)
        else:
            obj[key] = value
    return obj


def ep(**fields: Any) -> dict[str, Any]:
    """EP with fields replaced (None deletes)."""
    out = {**EP, **fields}
    return {k: v for k, v in out.items() if v is not None}


def hints(**kinds: Any) -> dict[str, Any]:
    return ep(hints=kinds)


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    # metadata and the owning Service
    (
        "name",
        eps(meta={"name": "Web_1"}),
        'metadata.name: "Web_1" is not valid: must be a DNS-1123 subdomain',
    ),
    ("name too long", eps(meta={"name": "a" * 254}), "metadata.name: "),
    (
        "service label missing",
        eps(labels={"kubernetes.io/service-name": None}),
        "metadata.labels[kubernetes.io/",
    ),
    (
        "service label empty",
        eps(labels={"kubernetes.io/service-name": ""}),
        "metadata.labels[kubernetes.io/service-name]: is required",
    ),
    (
        "service label not a Service name",
        eps(labels={"kubernetes.io/service-name": "web.x"}),
        'metadata.labels[kubernetes.io/service-name]: "web.x" is not valid: must name a Service',
    ),
    ("addressType missing", eps(addressType=None), "addressType: is required: one of IPv4, IPv6, FQDN"),
    (
        "addressType IP",
        eps(addressType="IP"),
        'addressType: "IP" is not supported: must be one of IPv4, IPv6, FQDN',
    ),
    # endpoints
    ("too many endpoints", eps(*[EP] * 1001), "endpoints: has 1001 endpoints: at most 1000 are allowed"),
    ("endpoints not a list", eps(endpoints={"a": EP}), "endpoints: must be a list"),
    ("endpoint not a map", eps(endpoints=["10.244.1.2"]), 'endpoints[0]: must be a map, not "10.244.1.2"'),
    ("no address", eps(ep(addresses=[])), "endpoints[0].addresses: must contain at least 1 address"),
    (
        "too many addresses",
        eps(ep(addresses=["10.244.1.2"] * 101)),
        "endpoints[0].addresses: has 101 addresses",
    ),
    ("address not a string", eps(ep(addresses=[167772161])), "endpoints[0].addresses[0]: must be a string"),
    (
        "address text",
        eps(ep(addresses=["10.244.1"])),
        'endpoints[0].addresses[0]: "10.244.1" must be a valid IPv4',
    ),
    ("second address IPv6", eps(ep(addresses=["10.244.1.2", "fd00::2"])), "endpoints[0].addresses[1]: "),
    (
        "IPv4 in an IPv6 slice",
        eps(addressType="IPv6"),
        'endpoints[0].addresses[0]: "10.244.1.2" must be a valid IPv6 address (the slice\'s addressType)',
    ),
    (
        "loopback",
        eps(ep(addresses=["127.0.0.1"])),
        'endpoints[0].addresses[0]: "127.0.0.1" may not be in the loop',
    ),
    ("link-local", eps(ep(addresses=["169.254.169.254"])), "endpoints[0].addresses[0]: "),
    (
        "FQDN",
        eps(ep(addresses=["web"]), addressType="FQDN"),
        'endpoints[0].addresses[0]: "web" is not valid: must',
    ),
    # conditions
    ("conditions not a map", eps(ep(conditions=["ready"])), "endpoints[0].conditions: must be a map"),
    (
        "serving string",
        eps(ep(conditions={"serving": "true"})),
        "endpoints[0].conditions.serving: must be true,",
    ),
    (
        "terminating int",
        eps(ep(conditions={"terminating": 1})),
        "endpoints[0].conditions.terminating: must be",
    ),
    # nodeName, zone, hostname
    (
        "nodeName",
        eps(ep(nodeName="Node_2")),
        'endpoints[0].nodeName: "Node_2" is not valid: must be a node name',
    ),
    ("nodeName empty", eps(ep(nodeName="")), 'endpoints[0].nodeName: "" is not valid'),
    (
        "nodeName injection",
        eps(ep(nodeName="node2\n-A X")),
        'endpoints[0].nodeName: "node2\\n-A X" is not valid',
    ),
    ("zone type", eps(ep(zone=5)), "endpoints[0].zone: must be a string, not 5"),
    (
        "hostname",
        eps(ep(hostname="a.b")),
        'endpoints[0].hostname: "a.b" is not valid: must be a DNS-1123 label',
    ),
    # hints
    ("hints not a map", eps(ep(hints=[])), "endpoints[0].hints: must be a map"),
    (
        "nine zones",
        eps(hints(forZones=[{"name": f"z{i}"} for i in range(9)])),
        "endpoints[0].hints.forZones: has 9",
    ),
    (
        "zone hint twice",
        eps(hints(forZones=[{"name": "a"}, {"name": "a"}])),
        "endpoints[0].hints.forZones[1].name:",
    ),
    (
        "zone hint value",
        eps(hints(forZones=[{"name": "a b"}])),
        'endpoints[0].hints.forZones[0].name: "a b" is not',
    ),
    (
        "zone hint not a map",
        eps(hints(forZones=["a"])),
        'endpoints[0].hints.forZones[0]: must be a map, not "a"',
    ),
    (
        "nine nodes",
        eps(hints(forNodes=[{"name": f"n{i}"} for i in range(9)])),
        "endpoints[0].hints.forNodes: has 9",
    ),
    (
        "node hint empty",
        eps(hints(forNodes=[{"name": ""}])),
        'endpoints[0].hints.forNodes[0].name: "" is not valid',
    ),
    (
        "node hint twice",
        eps(hints(forNodes=[{"name": "n"}, {"name": "n"}])),
        "endpoints[0].hints.forNodes[1].name:",
    ),
    # ports
    (
        "too many ports",
        eps(ports=[{**PORT, "name": f"p{i}"} for i in range(20001)]),
        "ports: has 20001 ports",
    ),
    ("port not a map", eps(ports=[8080]), "ports[0]: must be a map, not 8080"),
    (
        "port name",
        eps(ports=[{**PORT, "name": "HTTP"}]),
        'ports[0].name: "HTTP" is not valid: must be a DNS-1123',
    ),
    ("port name twice", eps(ports=[PORT, {**PORT, "port": 9090}]), 'ports[1].name: duplicate name "http"'),
    ("two unnamed", eps(ports=[{"port": 1}, {"port": 2}]), 'ports[1].name: duplicate name ""'),
    ("protocol", eps(ports=[{**PORT, "protocol": "ICMP"}]), 'ports[0].protocol: "ICMP" is not supported'),
    (
        "port above 65535",
        eps(ports=[{**PORT, "port": 70000}]),
        "ports[0].port: 70000 is out of range 1-65535",
    ),
    ("port negative", eps(ports=[{**PORT, "port": -1}]), "ports[0].port: -1 is out of range 1-65535"),
    ("port beyond int32", eps(ports=[{**PORT, "port": 2**31}]), "ports[0].port: 2147483648 is out of range"),
    ("port string", eps(ports=[{**PORT, "port": "8080"}]), 'ports[0].port: must be an integer, not "8080"'),
    ("appProtocol", eps(ports=[{**PORT, "appProtocol": "a b"}]), 'ports[0].appProtocol: "a b" is not valid'),
]


@pytest.mark.parametrize(("obj", "message"), [(o, m) for _, o, m in REFUSED], ids=[i for i, _, _ in REFUSED])
def test_refused_like_the_api_server(obj: dict[str, Any], message: str) -> None:
    r = build_state([SERVICE], [obj], NODE)
    assert r.state.endpoints[SPN].cluster == ()
    (problem,) = r.problems
    assert problem.kind == "EndpointSlice" and problem.namespace == "default"
    assert problem.reason.startswith(message), problem.reason


def test_addresses_with_leading_zeros_are_canonical() -> None:
    parsed = parse_endpoint_slice(eps(ep(addresses=["10.244.001.002", "10.244.1.3"])))
    assert parsed is not None
    assert [e.ip for e in parsed.endpoints] == ["10.244.1.2"]


@pytest.mark.parametrize(
    "obj",
    [
        eps(ep(addresses=["fd00::2"]), addressType="IPv6"),
        eps(ep(addresses=["web.example.com"]), addressType="FQDN"),
        eps(ep(addresses=["bogus"]), labels={"service.kubernetes.io/headless": ""}),
    ],
    ids=["ipv6", "fqdn", "headless-label"],
)
def test_not_ours_is_ignored_not_reported(obj: dict[str, Any]) -> None:
    assert parse_endpoint_slice(obj) is None
    assert build_state([SERVICE], [obj], NODE).problems == ()


@pytest.mark.parametrize("port", [None, 0])
def test_a_port_without_a_number_is_ignored_as_kube_proxy_does(port: int | None) -> None:
    parsed = parse_endpoint_slice(
        eps(ports=[{"name": "http", "port": port}, {"name": "metrics", "port": 9090}])
    )
    assert parsed is not None
    assert [p.name for p in parsed.ports] == ["metrics"]


def test_null_conditions_take_the_defaults() -> None:
    parsed = parse_endpoint_slice(eps(ep(conditions={"ready": None, "serving": None, "terminating": None})))
    assert parsed is not None
    (e,) = parsed.endpoints
    assert e.ready and e.serving and not e.terminating


def test_false_is_false() -> None:
    parsed = parse_endpoint_slice(eps(ep(conditions={"ready": False, "serving": True, "terminating": True})))
    assert parsed is not None
    (e,) = parsed.endpoints
    assert (e.ready, e.serving, e.terminating) == (False, True, True)


def test_hints_are_kept() -> None:
    parsed = parse_endpoint_slice(eps(hints(forZones=[{"name": "zone-a"}], forNodes=[{"name": "node1"}])))
    assert parsed is not None
    (e,) = parsed.endpoints
    assert e.zone_hints == {"zone-a"} and e.node_hints == {"node1"}


def test_the_limits_themselves_are_allowed() -> None:
    many = [ep(addresses=[f"10.244.{i // 250}.{i % 250 + 1}"]) for i in range(1000)]
    parsed = parse_endpoint_slice(
        eps(*many, ports=[{**PORT, "name": f"p{i}", "port": i + 1} for i in range(100)])
    )
    assert parsed is not None and len(parsed.endpoints) == 1000 and len(parsed.ports) == 100
