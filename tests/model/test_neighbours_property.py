"""Property: a malformed object changes nothing but its own Problem, in the model and both renderers.

A fixed set of valid objects (Services of every type and policy, with their EndpointSlices) is
rendered once by both renderers. Each example takes one of those objects and mutates it one to
three times at random places ("neighbours" of a valid object): wrong types, missing fields, huge
values and 5,000-digit integers, control characters and spaces in names, addresses of the wrong
family, strings for booleans, nesting thousands of levels deep. Then:

* `build_state` never raises, whatever the neighbour;
* when the model reports a Problem for the neighbour, both renderings of the valid objects plus
  the neighbour are byte-identical to the renderings without it;
* when the model accepts the neighbour, both renderers render the state it builds, and the
  iptables text is made of well-formed lines only (the model never hands a renderer something it
  cannot program, nor text that forges a rule).

Each valid object is its own test case (so every one of them is mutated, not just the ones a random
draw favours), with `EKP_PROPERTY_EXAMPLES` examples each (default 15: 255 per property), no
deadline, derandomized so a `make test` run is reproducible; raise the count locally to search
harder (`EKP_PROPERTY_EXAMPLES=500`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from agent.config import Config, Mode, NodeContext
from agent.ebpf import render_dry_run as render_ebpf
from agent.iptables import render_dry_run as render_iptables
from agent.model import BuildResult, NodeInfo, build_state

EXAMPLES = int(os.environ.get("EKP_PROPERTY_EXAMPLES", "15"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
NODE = NodeInfo("node1", (("topology.kubernetes.io/zone", "zone-a"),))
CONTEXT = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")
IPTABLES = Config(mode=Mode.IPTABLES, hostname="node1", cluster_cidr=("10.244.0.0/16",))
EBPF = Config(mode=Mode.EBPF, hostname="node1")

Obj = dict[str, Any]


def service(name: str, **spec: Any) -> Obj:
    status = spec.pop("status", None)
    obj: Obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "apps"},
        "spec": spec,
    }
    if status is not None:
        obj["status"] = status
    return obj


def endpoint_slice(name: str, service_name: str, ports: list[Obj], endpoints: list[Obj], **extra: Any) -> Obj:
    labels = {"kubernetes.io/service-name": service_name, **extra.pop("labels", {})}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "apps", "labels": labels},
        "addressType": extra.pop("addressType", "IPv4"),
        "ports": ports,
        "endpoints": endpoints,
    }


def ep(ip: str, node: str, **conditions: bool) -> Obj:
    return {"addresses": [ip], "nodeName": node, "conditions": {"ready": True, **conditions}}


HTTP = {"name": "http", "port": 8080, "protocol": "TCP"}
VALID: list[Obj] = [
    service(
        "web",
        clusterIP="10.96.0.10",
        ports=[
            {"name": "http", "port": 80, "targetPort": "http"},
            {"name": "dns", "port": 53, "protocol": "UDP"},
        ],
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
    ),
    endpoint_slice(
        "web-a",
        "web",
        [HTTP, {"name": "dns", "port": 5353, "protocol": "UDP"}],
        [
            ep("10.244.1.2", "node1"),
            {**ep("10.244.2.2", "node2"), "zone": "zone-b", "hints": {"forZones": [{"name": "zone-b"}]}},
            ep("10.244.2.3", "node2", ready=False, serving=True, terminating=True),
        ],
    ),
    endpoint_slice("web-v6", "web", [HTTP], [ep("fd00::2", "node2")], addressType="IPv6"),
    service(
        "np",
        type="NodePort",
        clusterIP="10.96.0.11",
        clusterIPs=["10.96.0.11"],
        ipFamilies=["IPv4"],
        ipFamilyPolicy="SingleStack",
        externalTrafficPolicy="Local",
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
    ),
    endpoint_slice("np-a", "np", [HTTP], [ep("10.244.1.3", "node1"), ep("10.244.2.4", "node2")]),
    service(
        "lb",
        type="LoadBalancer",
        clusterIP="10.96.0.12",
        externalTrafficPolicy="Local",
        healthCheckNodePort=31000,
        loadBalancerSourceRanges=["198.51.100.0/24"],
        externalIPs=["203.0.113.7"],
        ports=[{"name": "https", "port": 443, "nodePort": 30443, "targetPort": 8443}],
        status={
            "loadBalancer": {
                "ingress": [{"ip": "203.0.113.9", "ipMode": "VIP"}, {"ip": "203.0.113.10", "ipMode": "Proxy"}]
            }
        },
    ),
    endpoint_slice("lb-a", "lb", [{"name": "https", "port": 8443}], [ep("10.244.1.4", "node1")]),
    service(
        "ext",
        clusterIP="10.96.0.13",
        externalIPs=["203.0.113.8"],
        externalTrafficPolicy="Cluster",
        internalTrafficPolicy="Local",
        ports=[{"port": 80, "protocol": "TCP"}],
    ),
    endpoint_slice(
        "ext-a", "ext", [{"port": 8080}], [ep("10.244.001.005", "node1"), ep("10.244.2.5", "node2")]
    ),
    service("sctp", clusterIP="10.96.0.14", ports=[{"name": "s", "port": 9999, "protocol": "SCTP"}]),
    endpoint_slice(
        "sctp-a", "sctp", [{"name": "s", "port": 9999, "protocol": "SCTP"}], [ep("10.244.2.6", "node2")]
    ),
    service("empty", clusterIP="10.96.0.15", ports=[{"name": "http", "port": 80}]),
    service("dual", clusterIP="fd00::16", clusterIPs=["fd00::16", "10.96.0.16"], ports=[{"port": 80}]),
    endpoint_slice("dual-a", "dual", [{"port": 8080}], [ep("10.244.2.7", "node2")]),
    service("headless", clusterIP="None", ports=[{"port": 80}]),
    endpoint_slice(
        "headless-a",
        "headless",
        [{"port": 80}],
        [ep("10.244.2.8", "node2")],
        labels={"service.kubernetes.io/headless": ""},
    ),
    service("alias", type="ExternalName", externalName="db.example.com", ports=[{"port": 5432}]),
]


def split(objects: Sequence[Obj]) -> tuple[list[Obj], list[Obj]]:
    return [o for o in objects if o.get("kind") == "Service"], [
        o for o in objects if o.get("kind") != "Service"
    ]


def render(result: BuildResult) -> tuple[str, str]:
    return (
        render_iptables(result.state, CONTEXT, IPTABLES),
        render_ebpf(result.state, CONTEXT, EBPF),
    )


IPTABLES_LINE = re.compile(r"\*(filter|nat)|:KUBE-[A-Z0-9-]+ - \[0:0\]|-A [A-Z][A-Z0-9-]* [ -~]*|COMMIT")
IDS = [f"{o['kind']}-{o['metadata']['name']}" for o in VALID]
BASE = build_state(*split(VALID), NODE)
assert BASE.problems == (), BASE.problems
BASE_TEXT = render(BASE)


# ---- neighbours --------------------------------------------------------------------------------


def nested(depth: int) -> Any:
    value: Any = "10.244.1.2"
    for i in range(depth):
        value = [value] if i % 2 else {"addresses": value}
    return value


NAMES = st.sampled_from(
    [
        "x\n-I INPUT 1 -s 6.6.6.6/32 -j ACCEPT\n#",
        "a b",
        "Web",
        "web\t",
        "-web",
        "web-",
        "a" * 64,
        "a" * 254,
        "",
        "web.apps",
        "wéb",
        "web\x00",
        "web\u2028",
        "\ud800",
    ]
)
ADDRESSES = st.sampled_from(
    [
        "fd00::5",
        "::",
        "0.0.0.0",
        "127.0.0.1",
        "169.254.169.254",
        "224.0.0.1",
        "10.244.1.256",
        "10.244.1",
        "10.244.01.002",
        "::ffff:10.244.1.9",
        "fe80::1%eth0",
        "10.96.0.10/32",
        "10.0.0.0/8",
        " 10.0.0.0/8",
        "None",
        "",
        "example.com",
    ]
)
WEIRD: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(
        ["true", "false", "True", "1", "0", "Local", "Cluster", "ClientIP", "TCP", "UDP", "SCTP", "IPv6"]
    ),
    st.integers(min_value=-(2**33), max_value=2**33),
    st.sampled_from([0, -1, 65535, 65536, 86400, 86401, 2**31 - 1, 2**31, 10**5000, -(10**5000)]),
    st.floats(allow_nan=True, allow_infinity=True),
    NAMES,
    ADDRESSES,
    st.text(max_size=20),
    st.integers(min_value=1, max_value=3000).map(nested),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def paths(obj: Any, max_depth: int = 8) -> list[tuple[Any, ...]]:
    """Places in an object: keys of maps and indexes of lists, not below `max_depth` (a deeply
    nested value from an earlier mutation is a leaf here; walking it would be the recursion the
    model must not do)."""
    out: list[tuple[Any, ...]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), obj)]
    while stack:
        prefix, value = stack.pop()
        out.append(prefix)
        if len(prefix) >= max_depth:
            continue
        if isinstance(value, dict):
            stack += [((*prefix, key), child) for key, child in value.items()]
        elif isinstance(value, list):
            stack += [((*prefix, i), child) for i, child in enumerate(value)]
    return sorted(out, key=repr)


def mutate(obj: Any, where: tuple[Any, ...], action: str, new: Any) -> Any:
    """`obj` with the value at `where` replaced, removed, wrapped in a list or given an extra key.

    Copies only the containers along `where`, so VALID is never changed and deep values are
    never walked.
    """
    if not where:
        return new if action == "replace" else [obj] if action == "wrap" else obj
    head, rest = where[0], where[1:]
    out: Any = dict(obj) if isinstance(obj, dict) else list(obj)
    if rest:
        out[head] = mutate(out[head], rest, action, new)
    elif action == "delete":
        out.pop(head)
    elif action == "insert" and isinstance(out[head], dict):
        out[head] = {**out[head], "unexpected": new}
    elif action == "wrap":
        out[head] = [out[head]]
    else:
        out[head] = new
    return out


def at(obj: Any, where: tuple[Any, ...]) -> Any:
    for step in where:
        obj = obj[step]
    return obj


def is_address(value: Any) -> bool:
    return isinstance(value, str) and any(c.isdigit() for c in value) and ("." in value or ":" in value)


def other_family(value: str) -> st.SearchStrategy[str]:
    if ":" in value:
        return st.sampled_from(["10.244.9.9", "10.96.9.9", "::ffff:10.96.9.9"])
    if "/" in value:
        return st.sampled_from(["fd00::/64", "::/0"])
    return st.sampled_from(["fd00::5", "fd00::" + value.replace(".", ":"), "::"])


# Fields whose text ends up in rendered rules and map comments: names, namespaces, the owner label.
IDENTITY_KEYS = frozenset({"name", "namespace", "kubernetes.io/service-name", "nodeName"})
# What a mutation does: a kind of wrongness, the places it applies to, and the new value there.
MUTATIONS: dict[str, tuple[Callable[[Any], bool], Callable[[Any], st.SearchStrategy[Any]]]] = {
    "family": (is_address, other_family),
    "address": (is_address, lambda _: ADDRESSES),
    "identity": (
        lambda v: False,  # chosen by place, see IDENTITY_KEYS
        lambda _: NAMES,
    ),
    "boolean": (
        lambda v: isinstance(v, bool),
        lambda _: st.sampled_from(["false", "true", "False", 0, 1, [], {}]),
    ),
    "name": (
        lambda v: isinstance(v, str) and not is_address(v),
        lambda v: st.one_of(NAMES, st.sampled_from([v.upper(), v + " ", v + "\n#", f"{v}.x", ""])),
    ),
    "number": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v.bit_length() < 64,
        lambda v: st.sampled_from(
            [0, -1, -v, v + 65536, 2**31, 10**5000, -(10**5000), str(v), float(v), True]
        ),
    ),
    "list": (
        lambda v: isinstance(v, list),
        lambda v: st.sampled_from([[], [None], [v], v * 2, v[:1] * 1001, "x", {}]),
    ),
    "map": (lambda v: isinstance(v, dict), lambda v: st.sampled_from([{}, [v], "x", nested(2000)])),
    "anything": (lambda _: True, lambda _: WEIRD),
}


# The kinds of the holes found so far come up more often than the rest.
KINDS = [*MUTATIONS, "delete", "wrap", "insert", "identity", "identity", "family", "boolean"]


@st.composite
def neighbours(draw: Callable[..., Any], origin: Obj) -> Any:
    """`origin` after one to three mutations, each of a kind chosen first, then a place."""
    obj: Any = origin
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        kind = draw(st.sampled_from(KINDS))
        applies, values = MUTATIONS.get(kind, MUTATIONS["anything"])
        if kind == "identity":
            places = [p for p in paths(obj) if p and p[-1] in IDENTITY_KEYS]
        else:
            places = [p for p in paths(obj) if applies(at(obj, p))]
        if not places:  # nothing of that kind left (an earlier mutation replaced it)
            places, values = paths(obj), MUTATIONS["anything"][1]
        where = draw(st.sampled_from(places))
        action = kind if kind in ("delete", "wrap", "insert") else "replace"
        obj = mutate(obj, where, action, draw(values(at(obj, where))))
    return obj


def with_neighbour(neighbour: Any) -> BuildResult:
    services, slices = split(VALID)
    if isinstance(neighbour, dict) and neighbour.get("kind") == "EndpointSlice":
        slices.append(neighbour)
    else:
        services.append(neighbour)
    return build_state(services, slices, NODE)


@pytest.mark.parametrize("origin", VALID, ids=IDS)
@SETTINGS
@given(data=st.data())
def test_a_reported_neighbour_changes_no_byte_of_either_rendering(origin: Obj, data: st.DataObject) -> None:
    result = with_neighbour(data.draw(neighbours(origin), label="neighbour"))
    assume(result.problems)
    assert len(result.problems) == 1, result.problems
    assert render(result) == BASE_TEXT


@pytest.mark.parametrize("origin", VALID, ids=IDS)
@SETTINGS
@given(data=st.data())
def test_an_accepted_neighbour_renders_cleanly_in_both_modes(origin: Obj, data: st.DataObject) -> None:
    result = with_neighbour(data.draw(neighbours(origin), label="neighbour"))
    if result.problems:
        return  # reported: the test above compares its renderings byte for byte
    iptables_text, ebpf_text = render(result)
    assert "6.6.6.6" not in iptables_text
    for line in iptables_text.splitlines():
        assert IPTABLES_LINE.fullmatch(line), line
    for line in ebpf_text.splitlines():
        assert line.isprintable() and line.isascii(), line


@settings(SETTINGS, max_examples=EXAMPLES * 10)
@given(
    st.one_of(WEIRD, st.lists(WEIRD, max_size=3), st.dictionaries(st.text(max_size=10), WEIRD, max_size=4))
)
def test_any_json_value_at_all_is_a_problem_never_an_exception(value: Any) -> None:
    for kind_of in ("Service", "EndpointSlice"):
        result = build_state(
            [value] if kind_of == "Service" else [], [value] if kind_of != "Service" else [], NODE
        )
        assert len(result.problems) == 1 and result.problems[0].kind == kind_of
