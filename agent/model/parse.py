"""Kubernetes objects (plain dicts in the API's JSON shape) to frozen proxy types.

Follows kube-proxy's `newBaseServiceInfo` and `endpointSliceCache.addEndpoints`: which services are
ignored (headless, ExternalName, `service.kubernetes.io/service-proxy-name`), which addresses are
kept (IPv4 only), what the defaults of absent conditions are (ready=true, serving=ready,
terminating=false). An object that cannot be understood raises ParseError naming the field; the
caller skips that one object and keeps the rest.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.model.types import (
    DEFAULT_AFFINITY_TIMEOUT_SECONDS,
    Endpoint,
    Protocol,
    ServicePort,
    ServicePortName,
    SessionAffinity,
)

SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

Obj = Mapping[str, Any]


class ParseError(ValueError):
    """A Kubernetes object this proxy cannot program; the message says which field and why."""


@dataclass(frozen=True)
class SlicePort:
    name: str
    port: int
    protocol: Protocol


@dataclass(frozen=True)
class ParsedSlice:
    """One EndpointSlice reduced to what the proxy uses."""

    namespace: str
    name: str
    service: str  # owning Service's name (from the kubernetes.io/service-name label)
    ports: tuple[SlicePort, ...]
    endpoints: tuple[Endpoint, ...]  # port 0: the slice's ports apply to each address


def object_ref(obj: Obj) -> str:
    """`Kind namespace/name` for log lines and events, tolerant of missing fields."""
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind', 'Object')} {meta.get('namespace', 'default')}/{meta.get('name', '?')}"


def _meta(obj: Obj) -> tuple[str, str, Mapping[str, str]]:
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping) or not meta.get("name"):
        raise ParseError("metadata.name is missing")
    labels = meta.get("labels") or {}
    if not isinstance(labels, Mapping):
        raise ParseError("metadata.labels is not a map")
    return str(meta.get("namespace") or "default"), str(meta["name"]), labels


def _is_ipv4(value: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(value), ipaddress.IPv4Address)
    except ValueError:
        return False


def _check_ip(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ParseError(f"{where}: {value!r} is not an IP address")
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ParseError(f"{where}: {value!r} is not an IP address") from None
    return value


def _protocol(value: Any, where: str) -> Protocol:
    try:
        return Protocol(value or "TCP")
    except ValueError:
        raise ParseError(f"{where}: unknown protocol {value!r} (want TCP, UDP or SCTP)") from None


def _port_number(value: Any, where: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParseError(f"{where}: {value!r} is not a port number")
    if not (0 if allow_zero else 1) <= value <= 65535:
        raise ParseError(f"{where}: {value} is out of range 1-65535")
    return value


def _source_ranges(values: Iterable[Any]) -> tuple[str, ...]:
    out: list[str] = []
    for raw in values:
        text = str(raw).strip()
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise ParseError(f"spec.loadBalancerSourceRanges: {raw!r} is not a CIDR") from None
        if isinstance(net, ipaddress.IPv4Network):
            out.append(text)
    return tuple(out)


def should_skip_service(svc: Obj) -> str | None:
    """Why kube-proxy ignores this Service, or None when it programs it."""
    _, _, labels = _meta(svc)
    spec = svc.get("spec") or {}
    if SERVICE_PROXY_NAME_LABEL in labels:
        return f"labelled {SERVICE_PROXY_NAME_LABEL}: another proxy handles it"
    if spec.get("type") == "ExternalName":
        return "type ExternalName"
    cluster_ip = spec.get("clusterIP")
    if cluster_ip in (None, "", "None"):
        return "headless (no cluster IP)"
    return None


def parse_service(svc: Obj) -> list[ServicePort]:
    """One Service to its ports; [] when the proxy ignores it (see should_skip_service)."""
    namespace, name, _ = _meta(svc)
    if should_skip_service(svc) is not None:
        return []
    spec = svc.get("spec")
    if not isinstance(spec, Mapping):
        raise ParseError("spec is missing")
    svc_type = spec.get("type") or "ClusterIP"
    if svc_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
        raise ParseError(f"spec.type: unknown type {svc_type!r}")

    cluster_ips = [_check_ip(ip, "spec.clusterIPs") for ip in (spec.get("clusterIPs") or [])]
    cluster_ips.append(_check_ip(spec.get("clusterIP"), "spec.clusterIP"))
    ipv4 = [ip for ip in cluster_ips if _is_ipv4(ip)]
    if not ipv4:
        return []  # an IPv6-only service: not ours to program in an IPv4 proxy
    cluster_ip = ipv4[0]

    external_ips = tuple(
        ip
        for ip in (_check_ip(ip, "spec.externalIPs") for ip in (spec.get("externalIPs") or []))
        if _is_ipv4(ip)
    )
    lb_ips: list[str] = []
    status = svc.get("status") or {}
    for ing in (status.get("loadBalancer") or {}).get("ingress") or []:
        ip = ing.get("ip")
        # Proxy-mode load balancers deliver to the node themselves; kube-proxy skips them.
        if not ip or ing.get("ipMode") == "Proxy":
            continue
        if _is_ipv4(_check_ip(ip, "status.loadBalancer.ingress.ip")):
            lb_ips.append(ip)

    externally_accessible_type = svc_type in ("NodePort", "LoadBalancer") or bool(external_ips)
    etp_local = externally_accessible_type and spec.get("externalTrafficPolicy") == "Local"
    itp_local = spec.get("internalTrafficPolicy") == "Local"
    affinity = SessionAffinity.NONE
    timeout = 0
    if spec.get("sessionAffinity") == "ClientIP":
        affinity = SessionAffinity.CLIENT_IP
        cfg = ((spec.get("sessionAffinityConfig") or {}).get("clientIP") or {}).get("timeoutSeconds")
        timeout = DEFAULT_AFFINITY_TIMEOUT_SECONDS if cfg is None else int(cfg)
        if not 0 < timeout <= 86400:
            raise ParseError(f"spec.sessionAffinityConfig.clientIP.timeoutSeconds: {timeout} not in 1-86400")
    elif spec.get("sessionAffinity") not in (None, "None"):
        raise ParseError(f"spec.sessionAffinity: unknown value {spec.get('sessionAffinity')!r}")
    hc_port = 0
    if svc_type == "LoadBalancer" and etp_local:
        hc_port = _port_number(
            spec.get("healthCheckNodePort") or 0, "spec.healthCheckNodePort", allow_zero=True
        )
    ranges = _source_ranges(spec.get("loadBalancerSourceRanges") or [])

    ports = spec.get("ports") or []
    if not isinstance(ports, list):
        raise ParseError("spec.ports is not a list")
    out: list[ServicePort] = []
    for i, p in enumerate(ports):
        where = f"spec.ports[{i}]"
        if not isinstance(p, Mapping):
            raise ParseError(f"{where} is not a map")
        proto = _protocol(p.get("protocol"), f"{where}.protocol")
        node_port = 0
        if svc_type in ("NodePort", "LoadBalancer"):
            node_port = _port_number(p.get("nodePort") or 0, f"{where}.nodePort", allow_zero=True)
        out.append(
            ServicePort(
                name=ServicePortName(namespace, name, str(p.get("name") or ""), proto),
                cluster_ip=cluster_ip,
                port=_port_number(p.get("port"), f"{where}.port"),
                protocol=proto,
                node_port=node_port,
                external_ips=external_ips,
                load_balancer_ips=tuple(lb_ips),
                load_balancer_source_ranges=ranges,
                external_policy_local=etp_local,
                internal_policy_local=itp_local,
                session_affinity=affinity,
                affinity_timeout_seconds=timeout,
                health_check_node_port=hc_port,
            )
        )
    names = [sp.name for sp in out]
    if len(set(names)) != len(names):
        raise ParseError("spec.ports: two ports share a name and protocol")
    return out


def _condition(conditions: Mapping[str, Any], key: str, default: bool) -> bool:
    value = conditions.get(key)
    return default if value is None else bool(value)


def _hint_names(hints: Mapping[str, Any], key: str) -> frozenset[str]:
    return frozenset(str(h.get("name")) for h in (hints.get(key) or []) if h.get("name"))


def parse_endpoint_slice(eps: Obj) -> ParsedSlice | None:
    """One EndpointSlice; None when it is not ours (not IPv4, or marked headless)."""
    namespace, name, labels = _meta(eps)
    if HEADLESS_LABEL in labels:
        return None
    service = labels.get(SERVICE_NAME_LABEL)
    if not service:
        raise ParseError(f"label {SERVICE_NAME_LABEL} is missing: cannot tell which Service owns it")
    if (eps.get("addressType") or "IPv4") != "IPv4":
        return None
    ports: list[SlicePort] = []
    for i, p in enumerate(eps.get("ports") or []):
        if p.get("port") is None:
            continue  # kube-proxy ignores ports without a number
        ports.append(
            SlicePort(
                name=str(p.get("name") or ""),
                port=_port_number(p.get("port"), f"ports[{i}].port"),
                protocol=_protocol(p.get("protocol"), f"ports[{i}].protocol"),
            )
        )
    endpoints: list[Endpoint] = []
    for i, ep in enumerate(eps.get("endpoints") or []):
        addresses = ep.get("addresses") or []
        if not addresses:
            continue
        ip = _check_ip(addresses[0], f"endpoints[{i}].addresses[0]")
        conditions = ep.get("conditions") or {}
        ready = _condition(conditions, "ready", True)
        hints = ep.get("hints") or {}
        endpoints.append(
            Endpoint(
                ip=ip,
                port=0,
                ready=ready,
                serving=_condition(conditions, "serving", ready),
                terminating=_condition(conditions, "terminating", False),
                node_name=str(ep.get("nodeName") or ""),
                zone=str(ep.get("zone") or ""),
                zone_hints=_hint_names(hints, "forZones"),
                node_hints=_hint_names(hints, "forNodes"),
            )
        )
    return ParsedSlice(namespace, name, service, tuple(ports), tuple(endpoints))
