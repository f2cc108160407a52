"""The three holes found on main, each as the object that exposed it.

1. An address of the wrong family in an IPv4 EndpointSlice was accepted and then failed every sync
   in both modes; a Service whose metadata was not a map (or whose name was not a string) made the
   error handler itself raise.
2. Service names that the API server refuses (a newline, a space) reached iptables-restore.
3. `ready: "false"` counted as ready (`bool("false")`).

Each test checks that the object is reported as a Problem naming the field, that the valid
objects beside it are still programmed, and that both renderers still render.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.config import Config, Mode, NodeContext
from agent.model import NodeInfo, Protocol, ServicePortName, build_state
from agent.model.types import ProxyState

NODE = NodeInfo("node1")
CONTEXT = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")
SPN = ServicePortName("default", "web", "http", Protocol.TCP)
INJECTION = "x\n-I INPUT 1 -s 6.6.6.6/32 -j ACCEPT\n#"


def service(name: Any = "web", **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "clusterIP": "10.96.0.10",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
    }
    base.update(spec)
    return {"kind": "Service", "metadata": {"name": name, "namespace": "default"}, "spec": base}


def slice_(name: str, *endpoints: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": list(endpoints),
    }


def render_both(state: ProxyState) -> None:
    from agent.ebpf import render_dry_run as render_ebpf
    from agent.iptables import render_dry_run as render_iptables

    render_ebpf(state, CONTEXT, Config(mode=Mode.EBPF, hostname="node1"))
    text = render_iptables(state, CONTEXT, Config(mode=Mode.IPTABLES, hostname="node1"))
    assert "6.6.6.6" not in text


def test_ipv6_address_in_ipv4_slice_is_a_problem_and_the_rest_still_renders() -> None:
    good = slice_("web-a", {"addresses": ["10.244.1.2"]})
    bad = slice_("web-b", {"addresses": ["fd00::5"]})
    r = build_state([service()], [good, bad], NODE)
    (problem,) = r.problems
    assert problem.ref == "EndpointSlice default/web-b"
    assert "endpoints[0].addresses[0]" in problem.reason and "IPv4" in problem.reason
    assert [e.ip for e in r.state.endpoints[SPN].cluster] == ["10.244.1.2"]
    render_both(r.state)


@pytest.mark.parametrize(
    "metadata",
    ["web", ["web"], 7, {"name": 10**5000, "namespace": "default"}, {"name": "web", "namespace": 10**5000}],
    ids=["string", "list", "int", "name-5000-digit-int", "namespace-5000-digit-int"],
)
def test_malformed_metadata_is_a_problem_not_a_crash(metadata: Any) -> None:
    bad = service()
    bad["metadata"] = metadata
    r = build_state([bad, service()], [], NODE)
    (problem,) = r.problems
    assert problem.kind == "Service" and "metadata" in problem.reason
    assert list(r.state.services) == [SPN]


@pytest.mark.parametrize("name", [INJECTION, "a b", "Web", "web.x", "-web", "9web", "w" * 64, ""])
def test_service_names_the_api_server_refuses_are_problems(name: str) -> None:
    r = build_state([service(name), service()], [], NODE)
    (problem,) = r.problems
    assert problem.reason.startswith("metadata.name: ")
    assert "DNS-1035 label" in problem.reason or "required" in problem.reason
    assert "\n" not in str(problem), "the name is escaped wherever the problem is printed"
    assert list(r.state.services) == [SPN]
    render_both(r.state)


@pytest.mark.parametrize("value", ["false", "true", "False", 0, 1, [], {}])
def test_a_condition_that_is_not_a_boolean_is_a_problem(value: Any) -> None:
    bad = slice_("web-b", {"addresses": ["10.244.1.3"], "conditions": {"ready": value}})
    r = build_state([service()], [slice_("web-a", {"addresses": ["10.244.1.2"]}), bad], NODE)
    (problem,) = r.problems
    assert problem.reason.startswith("endpoints[0].conditions.ready: must be true, false or absent")
    assert [e.ip for e in r.state.endpoints[SPN].cluster] == ["10.244.1.2"]
