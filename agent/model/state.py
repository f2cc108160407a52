"""Build the whole desired proxy state from Services, EndpointSlices and this node.

`build_state` is the single entry point of the pure layer: the sources (file, API server) hand it
plain dicts, both backends consume the ProxyState it returns. A malformed object becomes a
Problem (kept for the log line, the event and the metric) and is left out; everything else is
still built.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from agent.model.parse import (
    Obj,
    ParsedSlice,
    ParseError,
    object_key,
    parse_endpoint_slice,
    parse_service,
)
from agent.model.problem import Problem
from agent.model.topology import categorize_endpoints
from agent.model.types import Endpoint, NodeInfo, ProxyState, ServiceEndpoints, ServicePort, ServicePortName


@dataclass(frozen=True)
class BuildResult:
    state: ProxyState
    problems: tuple[Problem, ...]


def problem_of(kind: str, obj: Obj, exc: ParseError) -> Problem:
    """The Problem of an object that failed to parse, tolerant of any shape of metadata.

    The parser quotes caller text through `printable` already; the reason is used as it is.
    """
    namespace, name = object_key(obj)
    return Problem(kind, namespace, name, str(exc))


def merge_slices(
    slices: Iterable[ParsedSlice], node_name: str
) -> dict[ServicePortName, tuple[Endpoint, ...]]:
    """Endpoints per service port across all slices, deduplicated and sorted as kube-proxy does.

    Duplicates (the same ip:port in two slices, as during a slice hand-over) collapse to one,
    preferring the copy that says it is on this node.
    """
    by_port: dict[ServicePortName, dict[str, Endpoint]] = {}
    for sl in sorted(slices, key=lambda s: (s.namespace, s.service, s.name)):
        for port in sl.ports:
            spn = ServicePortName(sl.namespace, sl.service, port.name, port.protocol)
            seen = by_port.setdefault(spn, {})
            for ep in sl.endpoints:
                local = bool(node_name) and ep.node_name == node_name
                info = replace(ep, port=port.port, is_local=local)
                key = str(info)
                if key not in seen or local:
                    seen[key] = info
    return {spn: tuple(sorted(eps.values(), key=lambda e: e.sort_key)) for spn, eps in by_port.items()}


def build_state(services: Iterable[Obj], slices: Iterable[Obj], node: NodeInfo) -> BuildResult:
    problems: list[Problem] = []
    ports: dict[ServicePortName, ServicePort] = {}
    for svc in services:
        try:
            for sp in parse_service(svc):
                ports[sp.name] = sp
        except ParseError as exc:
            problems.append(problem_of("Service", svc, exc))
    parsed: list[ParsedSlice] = []
    for eps in slices:
        try:
            sl = parse_endpoint_slice(eps)
        except ParseError as exc:
            problems.append(problem_of("EndpointSlice", eps, exc))
            continue
        if sl is not None:
            parsed.append(sl)
    raw = merge_slices(parsed, node.name)
    chosen: dict[ServicePortName, ServiceEndpoints] = {}
    raw_for_ports: dict[ServicePortName, tuple[Endpoint, ...]] = {}
    for spn, sp in ports.items():
        port_eps = raw.get(spn, ())
        raw_for_ports[spn] = port_eps
        chosen[spn] = categorize_endpoints(port_eps, sp, node)
    state = ProxyState(node=node, services=ports, endpoints=chosen, raw_endpoints=raw_for_ports)
    return BuildResult(state=state, problems=tuple(problems))
