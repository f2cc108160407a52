"""Kubernetes objects (plain dicts in the API's JSON shape) to frozen proxy types, validated first.

Two steps per object, in the order a real cluster applies them:

1. **Validate as the API server does** (pkg/apis/core/validation/validation.go `ValidateService`,
   pkg/apis/discovery/validation/validation.go `ValidateEndpointSlice`, after the defaulting of
   pkg/apis/core/v1/defaults.go and the registry's allocators). Absent fields the API server
   would default or allocate are taken as defaulted (`type` ClusterIP, `protocol` TCP,
   `sessionAffinity` None with a 10800 s timeout for ClientIP, the traffic policies Cluster,
   `ipMode` VIP, `clusterIPs` from `clusterIP`) or as not yet allocated (`nodePort`,
   `healthCheckNodePort` 0). Everything the model reads, and every rule that decides how it is
   read, is checked; a field it never reads (selector, annotations, loadBalancerClass, ...) is
   not. An object the API server would refuse raises ParseError naming the field and what would
   be right: the caller reports it and programs everything else. Nothing but ParseError is ever
   raised, whatever the input.
2. **Ignore as kube-proxy does**: objects its informers never receive, Services without a cluster
   IP, headless and ExternalName Services (`ShouldSkipService`, pkg/proxy/util/utils.go), FQDN
   EndpointSlices, load-balancer ingress IPs with `ipMode: Proxy` (`IsVIPMode`), and EndpointSlice
   ports without a number (`endpointInfoByServicePort`, pkg/proxy/endpointslicecache.go). Ignored
   is not a problem: nothing is reported.
3. **Split by family as the metaproxier does** (pkg/proxy/metaproxier): every Service goes to both
   families' proxiers, and each keeps its own family's cluster IP, externalIPs, ingress IPs and
   source ranges (`newBaseServiceInfo`, pkg/proxy/serviceport.go; a Service without a cluster IP
   of a family is ignored by that family's proxier); an EndpointSlice goes to the proxier of its
   `addressType`. `parse_service_families` gives both at once; `parse_service(svc, family)` one.

   The informers' selectors are per kind, as cmd/kube-proxy/app/server.go (`ProxyServer.Run`)
   builds them: Services with the label selector `!service.kubernetes.io/service-proxy-name` and
   the field selector `spec.clusterIP!=None`; EndpointSlices with `!service.kubernetes.io/headless`
   alone. So a Service labelled `service-proxy-name` is ignored whole, and a slice labelled
   `headless` is ignored, but a Service that carries the `headless` label itself (with a cluster
   IP) is programmed, and since the EndpointSlice controller copies a Service's labels onto its
   slices, it is programmed without endpoints: its cluster IP rejects, as kube-proxy's does. (The
   releases before the split gave both informers one selector `!service-proxy-name,!headless`;
   they ignored such a Service whole, which left its cluster IP unprogrammed instead of rejecting.)
   A slice labelled `service-proxy-name` whose Service is not is used, as upstream uses it.

Two rules go beyond the API server because a backend cannot program what it accepts: an
EndpointSlice port outside 1-65535 (the API only requires an int32; kube-proxy would write it and
have iptables-restore refuse the whole ruleset), and load-balancer ingress on a Service that is
not of type LoadBalancer (refused by the API server unless the deprecated
AllowServiceLBStatusOnNonLB gate is on, so never programmed here, but not reported either: such a
Service may be a legacy object that is otherwise fine).

Addresses are read as kube-proxy reads them (`addresses.parse_ip_sloppy`: leading zeros allowed
in stored objects) and kept in canonical form, so renderers never see the raw text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address
from socket import inet_aton
from typing import Any, NamedTuple

from msgspec import UNSET

from agent.model.addresses import IPAddress, parse_cidr_sloppy, parse_ip_sloppy, special_ip_reason
from agent.model.types import (
    DEFAULT_AFFINITY_TIMEOUT_SECONDS,
    FAMILIES,
    Endpoint,
    IPFamily,
    Protocol,
    ServicePort,
    ServicePortName,
    SessionAffinity,
)
from agent.model.validate import (
    DNS1035_LABEL_RULE,
    DNS1123_LABEL_RULE,
    DNS1123_SUBDOMAIN_RULE,
    IANA_SVC_NAME_RULE,
    LABEL_VALUE_RULE,
    QUALIFIED_NAME_RULE,
    ParseError,
    check_name,
    describe,
    invalid,
    is_dns1035_label,
    is_dns1123_label,
    is_dns1123_subdomain,
    is_fqdn,
    is_iana_svc_name,
    is_label_value,
    is_qualified_name,
    labels,
    one_of,
    opt_bool,
    opt_int,
    opt_list,
    opt_map,
    opt_str,
    require_int,
    require_map,
    require_str,
)
from agent.model.wire import Conditions, WireEndpoint, WirePort
from agent.sources.base import JSON_MAP_TYPES

__all__ = [
    "HEADLESS_LABEL",
    "SERVICE_NAME_LABEL",
    "SERVICE_PROXY_NAME_LABEL",
    "Obj",
    "ParseError",
    "ParsedSlice",
    "SlicePort",
    "object_key",
    "parse_endpoint_slice",
    "parse_service",
    "parse_service_families",
    "should_skip_service",
]

SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

Obj = Mapping[str, Any]

PROTOCOLS = ("TCP", "UDP", "SCTP")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
TRAFFIC_POLICIES = ("Cluster", "Local")
IP_FAMILIES = ("IPv4", "IPv6")
IP_FAMILY_POLICIES = ("SingleStack", "PreferDualStack", "RequireDualStack")
IP_MODES = ("VIP", "Proxy")
ADDRESS_TYPES = ("IPv4", "IPv6", "FQDN")
MAX_AFFINITY_TIMEOUT_SECONDS = 86400  # core.MaxClientIPServiceAffinitySeconds
# Per-slice limits, pkg/apis/discovery/validation/validation.go.
MAX_SLICE_ENDPOINTS = 1000
MAX_SLICE_PORTS = 20000
MAX_ENDPOINT_ADDRESSES = 100
MAX_HINTS = 8  # forZones, and forNodes, each


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
    # Per address; with the slice's port and `is_local` set when it has one port, else port 0 (the
    # slice's ports apply to each address)
    endpoints: tuple[Endpoint, ...]
    family: IPFamily = IPFamily.IPv4  # the addressType: which family's proxier the slice feeds


def object_key(obj: object) -> tuple[str, str]:
    """(namespace, name) of any object, for a Problem: "default" and "?" where unusable."""
    meta = obj.get("metadata") if isinstance(obj, JSON_MAP_TYPES) else None
    if not isinstance(meta, JSON_MAP_TYPES):
        return "default", "?"
    namespace, name = meta.get("namespace"), meta.get("name")
    return (
        namespace if isinstance(namespace, str) and namespace else "default",
        name if isinstance(name, str) and name else "?",
    )


# ---- metadata and the informers' label selector -----------------------------------------------


# A NamedTuple, one per object of a list: its generated `__new__` (Python) calls tuple's once,
# where a frozen dataclass's `__init__` makes one `object.__setattr__` call per field.
class _Meta(NamedTuple):
    namespace: str
    name: str
    labels: Mapping[str, str]


def _metadata(obj: object, name_ok: Callable[[str], bool], name_rule: str) -> _Meta:
    meta = require_map(require_map(obj, "object").get("metadata"), "metadata")
    name = opt_str(meta, "name", "metadata.name")
    if not name:
        raise invalid("metadata.name", f"is required: it {name_rule}")
    check_name(name, "metadata.name", name_ok(name), name_rule)
    # A file may leave the namespace out, as `kubectl apply` does: the API server fills it in.
    namespace = opt_str(meta, "namespace", "metadata.namespace") or "default"
    check_name(namespace, "metadata.namespace", _is_namespace(namespace), DNS1123_LABEL_RULE)
    return _Meta(namespace, name, labels(meta, "metadata.labels"))


@functools.lru_cache(maxsize=4096)
def _is_namespace(text: str) -> bool:
    """Cached: a list's objects name the same few namespaces."""
    return is_dns1123_label(text)


def _service_not_for_this_proxy(object_labels: Mapping[str, str]) -> str | None:
    """The Service informer's label selector, `!service-proxy-name` (any value, even "")."""
    if SERVICE_PROXY_NAME_LABEL in object_labels:
        return f"labelled {SERVICE_PROXY_NAME_LABEL}: another proxy handles it"
    return None


def _slice_not_for_this_proxy(object_labels: Mapping[str, str]) -> bool:
    """The EndpointSlice informer's label selector, `!headless`: DNS serves those addresses."""
    return HEADLESS_LABEL in object_labels


# ---- Services ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Skip:
    reason: str


class _Port(NamedTuple):
    name: str
    port: int
    protocol: Protocol
    node_port: int


def _common_cluster_ip(spec: Obj, svc_type: str) -> IPv4Address | None:
    """The cluster IP of nearly every Service, read without the checks: one canonical IPv4
    address in both fields, no other family, a valid or no policy. None for anything else:
    `_cluster_ips` then checks it in full (and gives this same answer for what this accepts;
    tests/model test both on the same inputs)."""
    cluster_ip = spec.get("clusterIP")
    if (
        type(cluster_ip) is str
        and svc_type != "ExternalName"
        and spec.get("clusterIPs") == [cluster_ip]
        and spec.get("ipFamilies") in _IPV4_FAMILIES
        and spec.get("ipFamilyPolicy") in _POLICY_OR_NONE
        and _CANONICAL_V4.fullmatch(cluster_ip) is not None
    ):
        return IPv4Address(int.from_bytes(inet_aton(cluster_ip), "big"))
    return None


def _cluster_ips(spec: Obj, svc_type: str) -> tuple[bool, list[IPAddress]]:
    """(headless, addresses) after ValidateServiceClusterIPsRelatedFields; (False, []) when unset."""
    common = _common_cluster_ip(spec, svc_type)
    if common is not None:
        return False, [common]
    return _checked_cluster_ips(spec, svc_type)


def _checked_cluster_ips(spec: Obj, svc_type: str) -> tuple[bool, list[IPAddress]]:
    cluster_ip = opt_str(spec, "clusterIP", "spec.clusterIP")
    listed = [
        require_str(v, f"spec.clusterIPs[{i}]")
        for i, v in enumerate(opt_list(spec, "clusterIPs", "spec.clusterIPs"))
    ]
    families = [
        one_of(require_str(v, f"spec.ipFamilies[{i}]"), IP_FAMILIES, f"spec.ipFamilies[{i}]")
        for i, v in enumerate(opt_list(spec, "ipFamilies", "spec.ipFamilies"))
    ]
    if len(set(families)) != len(families):
        raise invalid("spec.ipFamilies", "may hold each family once")
    policy = spec.get("ipFamilyPolicy")
    if policy is not None:
        one_of(require_str(policy, "spec.ipFamilyPolicy"), IP_FAMILY_POLICIES, "spec.ipFamilyPolicy")
    if svc_type == "ExternalName":
        for key, value in (("clusterIP", cluster_ip), ("clusterIPs", listed), ("ipFamilies", families)):
            if value:
                raise invalid(f"spec.{key}", "may not be set for ExternalName services")
        if policy is not None:
            raise invalid("spec.ipFamilyPolicy", "may not be set for ExternalName services")
        return False, []
    where = "spec.clusterIPs"
    if cluster_ip:
        if not listed:
            listed = [cluster_ip]  # the API server's strategy copies the singular field
            where = "spec.clusterIP"
        elif listed[0] != cluster_ip:
            raise invalid(
                "spec.clusterIPs",
                f"first value {describe(listed[0])} must match spec.clusterIP {describe(cluster_ip)}",
            )
    elif listed:
        raise invalid("spec.clusterIPs", "must be empty when spec.clusterIP is not set")
    if len(listed) > 2:
        raise invalid("spec.clusterIPs", f"may only hold up to 2 values, not {len(listed)}")
    if listed == ["None"]:
        if svc_type in ("NodePort", "LoadBalancer"):
            raise invalid("spec.clusterIPs[0]", f"may not be set to 'None' for {svc_type} services")
        return True, []
    addresses: list[IPAddress] = []
    for i, text in enumerate(listed):
        ip = parse_ip_sloppy(text)
        path = where if where == "spec.clusterIP" else f"{where}[{i}]"
        if text == "None":
            raise invalid(path, "'None' (headless) must be the first and only value")
        if ip is None:
            raise invalid(path, f"{describe(text)} must be a valid IP address, e.g. 10.96.0.10")
        addresses.append(ip)
    if len(addresses) == 2 and addresses[0].version == addresses[1].version:
        raise invalid("spec.clusterIPs", "may specify no more than one IP for each IP family")
    for i, (ip, family) in enumerate(zip(addresses, families, strict=False)):
        if family != f"IPv{ip.version}":
            raise invalid(
                f"spec.clusterIPs[{i}]", f"expected an {family} value as indicated by spec.ipFamilies[{i}]"
            )
    return False, addresses


_IPV4_FAMILIES: tuple[object, ...] = (None, ["IPv4"])
_POLICY_OR_NONE: tuple[object, ...] = (None, *IP_FAMILY_POLICIES)


def _target_port(value: Any, path: str) -> None:
    """ValidatePortNumOrName; 0 and "" are what the defaulter replaces by `port`."""
    if value is None or value == 0 or value == "":
        return
    if isinstance(value, str):
        check_name(value, path, is_iana_svc_name(value), IANA_SVC_NAME_RULE)
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(path, f"{describe(value)} is not valid: {IANA_SVC_NAME_RULE}")
    require_int(value, path, 1, 65535)


def _app_protocol(port: Obj, path: str) -> None:
    value = port.get("appProtocol")
    if value is not None:
        text = require_str(value, path)
        check_name(text, path, is_qualified_name(text), QUALIFIED_NAME_RULE)


def _service_ports(spec: Obj, svc_type: str, headless: bool) -> tuple[_Port, ...]:
    """`_check_service_ports`, kept per distinct short list of ports, for the ClusterIP Services
    that share a list (all of the bench's do; how many of a real cluster's do was not measured:
    bench/results/scale/ROUNDS.md, "The bench's objects are the memos' best case"). Only what
    can repeat is kept, so the memo's bytes stay bounded and it does not fill with one-offs: at
    most `_MEMO_PORTS` ports, only the fields the check reads, no nodePort (unique cluster-wide,
    so a NodePort or LoadBalancer list never repeats). Once full, the key is not even built. A refused list is
    not kept: it is checked, and refused with the same message, each time."""
    raw = spec.get("ports")
    if type(raw) is not list or len(raw) > _MEMO_PORTS or len(_SERVICE_PORTS_CHECKED) >= _PORTS_CHECKED_MAX:
        return _check_service_ports(spec, svc_type, headless)
    ports: list[tuple[tuple[str, str | int], ...]] = []
    for item in raw:
        if type(item) is not dict or not _MEMO_PORT_FIELDS.issuperset(item):
            return _check_service_ports(spec, svc_type, headless)
        fields = tuple(item.items())
        for _, value in fields:
            kind = type(value)
            # str or int exactly: equal keys are then the same JSON (True == 1, 80.0 == 80)
            if kind is not str and kind is not int:
                return _check_service_ports(spec, svc_type, headless)
        ports.append(fields)
    key = (tuple(ports), svc_type, headless)
    kept = _SERVICE_PORTS_CHECKED.get(key)
    if kept is None:
        kept = _check_service_ports(spec, svc_type, headless)
        _SERVICE_PORTS_CHECKED[key] = kept
    return kept


# The fields of a Service port that `_check_service_ports` reads, less nodePort: a port with any
# other field is checked each time (an unknown field's value, unchecked, could be any size).
_MEMO_PORT_FIELDS = frozenset(("name", "port", "protocol", "targetPort", "appProtocol"))
# The most ports of a list (a Service's or a slice's) that the memos keep: longer lists are rare
# and each would pin its own entry.
_MEMO_PORTS = 8
_SERVICE_PORTS_CHECKED: dict[
    tuple[tuple[tuple[tuple[str, str | int], ...], ...], str, bool], tuple[_Port, ...]
] = {}


def _check_service_ports(spec: Obj, svc_type: str, headless: bool) -> tuple[_Port, ...]:
    raw = opt_list(spec, "ports", "spec.ports")
    if not raw and not headless and svc_type != "ExternalName":
        raise invalid("spec.ports", "at least one port is required")
    names: set[str] = set()
    seen_ports: set[tuple[int, str]] = set()
    seen_node_ports: set[tuple[int, str]] = set()
    out: list[_Port] = []
    for i, item in enumerate(raw):
        where = f"spec.ports[{i}]"
        p = require_map(item, where)
        name = opt_str(p, "name", f"{where}.name")
        if name:
            check_name(name, f"{where}.name", is_dns1123_label(name), DNS1123_LABEL_RULE)
            if name in names:
                raise invalid(f"{where}.name", f"duplicate name {describe(name)}: port names must be unique")
            names.add(name)
        elif len(raw) > 1:
            raise invalid(
                f"{where}.name", f"is required when a Service has more than one port: it {DNS1123_LABEL_RULE}"
            )
        number = require_int(p.get("port"), f"{where}.port", 1, 65535)
        protocol = one_of(
            opt_str(p, "protocol", f"{where}.protocol") or "TCP", PROTOCOLS, f"{where}.protocol"
        )
        _target_port(p.get("targetPort"), f"{where}.targetPort")
        _app_protocol(p, f"{where}.appProtocol")
        node_port = opt_int(p, "nodePort", f"{where}.nodePort", 0, 65535)
        if (number, protocol) in seen_ports:
            raise invalid(where, f"duplicate port {number}/{protocol}: each port and protocol once")
        seen_ports.add((number, protocol))
        if node_port:
            if svc_type == "ClusterIP":
                raise invalid(f"{where}.nodePort", "may not be used when spec.type is ClusterIP")
            if (node_port, protocol) in seen_node_ports:
                raise invalid(f"{where}.nodePort", f"duplicate nodePort {node_port}/{protocol}")
            seen_node_ports.add((node_port, protocol))
        out.append(_Port(name, number, Protocol(protocol), node_port))
    return tuple(out)


def _affinity_timeout(spec: Obj) -> int:
    """The ClientIP affinity timeout in seconds, 0 without affinity (validateClientIPAffinityConfig)."""
    affinity = opt_str(spec, "sessionAffinity", "spec.sessionAffinity") or "None"
    one_of(affinity, ("ClientIP", "None"), "spec.sessionAffinity")
    if affinity == "None":
        if spec.get("sessionAffinityConfig") is not None:
            raise invalid("spec.sessionAffinityConfig", "must not be set when spec.sessionAffinity is None")
        return 0
    config = opt_map(spec, "sessionAffinityConfig", "spec.sessionAffinityConfig") or {}
    client = opt_map(config, "clientIP", "spec.sessionAffinityConfig.clientIP") or {}
    timeout = client.get("timeoutSeconds")
    if timeout is None:
        return DEFAULT_AFFINITY_TIMEOUT_SECONDS
    return require_int(
        timeout, "spec.sessionAffinityConfig.clientIP.timeoutSeconds", 1, MAX_AFFINITY_TIMEOUT_SECONDS
    )


def _ip_list(obj: Obj, key: str, path: str, *, non_special: bool) -> list[IPAddress]:
    out: list[IPAddress] = []
    for i, value in enumerate(opt_list(obj, key, path)):
        text = require_str(value, f"{path}[{i}]")
        ip = parse_ip_sloppy(text)
        if ip is None:
            raise invalid(f"{path}[{i}]", f"{describe(text)} must be a valid IP address, e.g. 203.0.113.7")
        reason = special_ip_reason(ip) if non_special else None
        if reason:
            raise invalid(f"{path}[{i}]", f"{describe(text)} {reason}")
        out.append(ip)
    return out


def _external_policy_local(spec: Obj, accessible: bool) -> bool:
    policy = opt_str(spec, "externalTrafficPolicy", "spec.externalTrafficPolicy")
    if not accessible:
        if policy:
            raise invalid(
                "spec.externalTrafficPolicy",
                "may only be set for externally-accessible services (type NodePort or LoadBalancer, "
                "or with spec.externalIPs)",
            )
        return False
    return one_of(policy or "Cluster", TRAFFIC_POLICIES, "spec.externalTrafficPolicy") == "Local"


def _health_check_node_port(spec: Obj, needs: bool) -> int:
    """NeedsHealthCheck (LoadBalancer + Local): the allocated port, or 0 until it is allocated.

    The API server refuses a port on any other Service, but kube-proxy only ignores it (its own
    proxier tests carry one on an `externalTrafficPolicy: Cluster` load balancer), and a port
    nobody serves cannot break a backend: ignored, not refused."""
    port = require_int(
        opt_int(spec, "healthCheckNodePort", "spec.healthCheckNodePort"), "spec.healthCheckNodePort", 0, 65535
    )
    return port if needs else 0


def _source_ranges(spec: Obj, svc_type: str) -> list[str]:
    raw = opt_list(spec, "loadBalancerSourceRanges", "spec.loadBalancerSourceRanges")
    if raw and svc_type != "LoadBalancer":
        raise invalid("spec.loadBalancerSourceRanges", "may only be used when spec.type is LoadBalancer")
    out: list[str] = []
    for i, value in enumerate(raw):
        path = f"spec.loadBalancerSourceRanges[{i}]"
        # Space padding is allowed, a historical accident the API server keeps (ValidateService).
        text = require_str(value, path).strip()
        net = parse_cidr_sloppy(text)
        if net is None:
            raise invalid(path, f"{describe(value)} must be a valid CIDR, e.g. 198.51.100.0/24")
        if str(net) not in out:
            out.append(str(net))
    return out


def _ingress_ips(svc: Obj, svc_type: str) -> list[IPAddress]:
    """status.loadBalancer.ingress as ValidateLoadBalancerStatus checks it; VIP-mode IPs kept."""
    status = opt_map(svc, "status", "status") or {}
    balancer = opt_map(status, "loadBalancer", "status.loadBalancer") or {}
    out: list[IPAddress] = []
    for i, item in enumerate(opt_list(balancer, "ingress", "status.loadBalancer.ingress")):
        where = f"status.loadBalancer.ingress[{i}]"
        ingress = require_map(item, where)
        text = opt_str(ingress, "ip", f"{where}.ip")
        ip = parse_ip_sloppy(text) if text else None
        if text and ip is None:
            raise invalid(f"{where}.ip", f"{describe(text)} must be a valid IP address")
        mode = ingress.get("ipMode")
        if mode is not None:
            one_of(require_str(mode, f"{where}.ipMode"), IP_MODES, f"{where}.ipMode")
            if not text:
                raise invalid(f"{where}.ip", "must be specified when ipMode is set")
        hostname = opt_str(ingress, "hostname", f"{where}.hostname")
        if hostname:
            check_name(hostname, f"{where}.hostname", is_dns1123_subdomain(hostname), DNS1123_SUBDOMAIN_RULE)
            if parse_ip_sloppy(hostname) is not None:
                raise invalid(
                    f"{where}.hostname", f"{describe(hostname)} must be a DNS name, not an IP address"
                )
        if ip is None or mode == "Proxy" or svc_type != "LoadBalancer":
            continue  # Proxy mode: the load balancer delivers to the node itself (IsVIPMode)
        if ip not in out:
            out.append(ip)
    return out


def _service(svc: object) -> dict[IPFamily, list[ServicePort]] | _Skip:
    meta = _metadata(svc, is_dns1035_label, DNS1035_LABEL_RULE)
    skip = _service_not_for_this_proxy(meta.labels)
    if skip:
        return _Skip(skip)
    assert isinstance(svc, JSON_MAP_TYPES)  # _metadata checked it
    spec = opt_map(svc, "spec", "spec") or {}
    svc_type = one_of(opt_str(spec, "type", "spec.type") or "ClusterIP", SERVICE_TYPES, "spec.type")
    headless, cluster_ips = _cluster_ips(spec, svc_type)
    if svc_type == "ExternalName":
        target = opt_str(spec, "externalName", "spec.externalName").removesuffix(".")
        if not target:
            raise invalid("spec.externalName", "is required for ExternalName services")
        check_name(target, "spec.externalName", is_dns1123_subdomain(target), DNS1123_SUBDOMAIN_RULE)
    ports = _service_ports(spec, svc_type, headless)
    timeout = _affinity_timeout(spec)
    external_ips = _ip_list(spec, "externalIPs", "spec.externalIPs", non_special=True)
    # apiservice.ExternallyAccessible: the type, or externalIPs of any family on a ClusterIP.
    accessible = svc_type in ("NodePort", "LoadBalancer") or (svc_type == "ClusterIP" and bool(external_ips))
    etp_local = _external_policy_local(spec, accessible)
    hc_port = _health_check_node_port(spec, svc_type == "LoadBalancer" and etp_local)
    itp = opt_str(spec, "internalTrafficPolicy", "spec.internalTrafficPolicy") or "Cluster"
    itp_local = one_of(itp, TRAFFIC_POLICIES, "spec.internalTrafficPolicy") == "Local"
    ranges = _source_ranges(spec, svc_type)
    lb_ips = _ingress_ips(svc, svc_type)

    if svc_type == "ExternalName":
        return _Skip("type ExternalName")
    if headless:
        return _Skip("headless (clusterIP None)")
    if not cluster_ips:
        return _Skip("no cluster IP allocated")
    affinity = SessionAffinity.CLIENT_IP if timeout else SessionAffinity.NONE
    out: dict[IPFamily, list[ServicePort]] = {}
    for family in FAMILIES:
        # newBaseServiceInfo for the proxier of `family`: its cluster IP, and the external IPs,
        # ingress IPs and source ranges of its family (the others belong to the other proxier).
        own = [ip for ip in cluster_ips if ip.version == family]
        if not own:
            continue
        external = tuple(dict.fromkeys(str(ip) for ip in external_ips if ip.version == family))
        balancers = tuple(str(ip) for ip in lb_ips if ip.version == family)
        own_ranges = tuple(r for r in ranges if IPFamily.of(r) is family)
        out[family] = [
            ServicePort(
                name=ServicePortName(meta.namespace, meta.name, p.name, p.protocol),
                cluster_ip=str(own[0]),
                port=p.port,
                protocol=p.protocol,
                node_port=p.node_port if svc_type in ("NodePort", "LoadBalancer") else 0,
                external_ips=external,
                load_balancer_ips=balancers,
                load_balancer_source_ranges=own_ranges,
                external_policy_local=etp_local,
                internal_policy_local=itp_local,
                session_affinity=affinity,
                affinity_timeout_seconds=timeout,
                health_check_node_port=hc_port,
            )
            for p in ports
        ]
    return out


def parse_service_families(svc: object) -> dict[IPFamily, list[ServicePort]]:
    """One Service to its ports per family, as each family's proxier sees it: a dual-stack Service
    has both, a single-stack one one; {} when every proxier ignores it. Raises ParseError, and
    only ParseError, when the API server would refuse the object."""
    result = _service(svc)
    return {} if isinstance(result, _Skip) else result


def parse_service(svc: object, family: IPFamily = IPFamily.IPv4) -> list[ServicePort]:
    """One Service to its ports of `family`; [] when that family's proxier ignores it (see
    should_skip_service).

    Raises ParseError, and only ParseError, when the API server would refuse the object.
    """
    return parse_service_families(svc).get(family, [])


def should_skip_service(svc: object, family: IPFamily = IPFamily.IPv4) -> str | None:
    """Why kube-proxy's proxier of `family` ignores this valid Service, or None when it programs
    it; ParseError if invalid."""
    result = _service(svc)
    if isinstance(result, _Skip):
        return result.reason
    return None if family in result else f"no {family} cluster IP (the {family} proxier ignores it)"


# ---- EndpointSlices ----------------------------------------------------------------------------


# A canonical dotted quad (no leading zeros) outside the special ranges below needs no more work:
# nearly every endpoint address of a cluster. Anything else takes the full ParseIPSloppy path.
_CANONICAL_V4 = re.compile(r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?:\.(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}")
_SPECIAL_V4_PREFIXES = ("0.", "127.", "169.254.", "224.0.0.")


def _slice_address(text: str, address_type: str, path: str) -> str:
    """One address checked against the slice's addressType; the canonical IPv4 text, or ""."""
    if (
        address_type == "IPv4"
        and _CANONICAL_V4.fullmatch(text) is not None
        and not text.startswith(_SPECIAL_V4_PREFIXES)
    ):
        return text
    if address_type == "FQDN":
        check_name(text, path, is_fqdn(text), "must be a fully qualified domain name (addressType FQDN)")
        return ""
    ip = parse_ip_sloppy(text)
    if ip is None or f"IPv{ip.version}" != address_type:
        raise invalid(
            path, f"{describe(text)} must be a valid {address_type} address (the slice's addressType)"
        )
    reason = special_ip_reason(ip)
    if reason:
        raise invalid(path, f"{describe(text)} {reason}")
    return str(ip)


def _node_name(value: Any, path: str) -> str:
    text = require_str(value, path)
    return check_name(text, path, _is_node_name(text), "must be a node name: " + DNS1123_SUBDOMAIN_RULE)


@functools.lru_cache(maxsize=4096)
def _is_node_name(text: str) -> bool:
    """Cached: a cluster's endpoints name the same few node names a hundred thousand times."""
    return is_dns1123_subdomain(text)


def _hint_names(hints: Obj, key: str, path: str, valid: Callable[[str], bool], rule: str) -> frozenset[str]:
    raw = opt_list(hints, key, path)
    if len(raw) > MAX_HINTS:
        raise invalid(path, f"has {len(raw)} entries: at most {MAX_HINTS} are allowed")
    names: set[str] = set()
    for i, item in enumerate(raw):
        where = f"{path}[{i}].name"
        name = opt_str(require_map(item, f"{path}[{i}]"), "name", where)
        check_name(name, where, valid(name), rule)
        if name in names:
            raise invalid(where, f"duplicate {describe(name)}")
        names.add(name)
    # An empty zone name is valid but names no zone: it never matches (as before this validation).
    return frozenset(n for n in names if n)


_NO_HINTS: frozenset[str] = frozenset()
# One str per node name and zone for the agent's life: a cluster names the same few a hundred
# thousand times, and a decoded JSON value is a fresh str each time (bounded: past the limit, names
# are kept as they came).
_names: dict[str, str] = {}
_NAMES_MAX = 65536


def _name(text: str) -> str:
    if len(_names) < _NAMES_MAX:
        return _names.setdefault(text, text)
    return _names.get(text, text)


_COMMON_KEYS = frozenset({"addresses", "conditions", "nodeName", "zone", "targetRef"})


def _common_endpoint(item: Any, port: int = 0, here: str = "") -> Endpoint | None:
    """The endpoint every cluster is full of, read without the per-field checks: a dict with one
    canonical IPv4 address, boolean (or absent) conditions, a valid node name and zone, and nothing
    else that needs checking. None for anything else: `_endpoint` then validates it in full (and
    gives the same answer for what this accepts; tests/model test both on the same inputs)."""
    if type(item) is not dict or not item.keys() <= _COMMON_KEYS:
        return None
    addresses = item.get("addresses")
    if type(addresses) is not list or len(addresses) != 1:
        return None
    ip = addresses[0]
    if type(ip) is not str or _CANONICAL_V4.fullmatch(ip) is None or ip.startswith(_SPECIAL_V4_PREFIXES):
        return None
    conditions = item.get("conditions")
    if conditions is None:
        ready = serving = terminating = None
    elif type(conditions) is dict:
        ready, serving, terminating = (
            conditions.get("ready"),
            conditions.get("serving"),
            conditions.get("terminating"),
        )
        if not (
            type(ready) in _BOOL_OR_NONE
            and type(serving) in _BOOL_OR_NONE
            and type(terminating) in _BOOL_OR_NONE
        ):
            return None
    else:
        return None
    node = item.get("nodeName")
    if node is None:
        node = ""
    elif type(node) is not str or not _is_node_name(node):
        return None
    zone = item.get("zone")
    if zone is None:
        zone = ""
    elif type(zone) is not str:
        return None
    ready_now = True if ready is None else ready
    # `_name`, inline for the names already kept (all but the first few)
    kept_node, kept_zone = _names.get(node), _names.get(zone)
    # Endpoint(...) without its Python-level __new__ (the fields in their order): a list of
    # 10,000 slices makes a hundred thousand of these
    return _new_tuple(
        Endpoint,
        (
            ip,
            port,
            ready_now,
            ready_now if serving is None else serving,
            terminating is True,
            _name(node) if kept_node is None else kept_node,
            _name(zone) if kept_zone is None else kept_zone,
            _NO_HINTS,
            _NO_HINTS,
            bool(here) and node == here,
        ),
    )


_BOOL_OR_NONE = frozenset({bool, type(None)})
_new_tuple = tuple.__new__


def _wire_endpoint(item: WireEndpoint, port: int, here: str) -> Endpoint | None:
    """`_common_endpoint` of an endpoint a list decoded typed (agent.model.wire): msgspec checked
    the types of its fields already; the same shape takes this path, anything else gets None."""
    addresses = item.addresses
    if type(addresses) is not list or len(addresses) != 1:
        return None
    if item.hostname is not UNSET or item.hints is not UNSET:
        return None
    ip = addresses[0]
    if _CANONICAL_V4.fullmatch(ip) is None or ip.startswith(_SPECIAL_V4_PREFIXES):
        return None
    conditions = item.conditions
    if isinstance(conditions, Conditions):
        ready, serving, terminating = conditions.ready, conditions.serving, conditions.terminating
    else:
        ready = serving = terminating = None
    node = item.nodeName
    if not isinstance(node, str):
        node = ""
    elif not _is_node_name(node):
        return None
    zone = item.zone
    if not isinstance(zone, str):
        zone = ""
    ready_now = ready if isinstance(ready, bool) else True
    kept_node, kept_zone = _names.get(node), _names.get(zone)
    return _new_tuple(
        Endpoint,
        (
            ip,
            port,
            ready_now,
            serving if isinstance(serving, bool) else ready_now,
            terminating is True,
            _name(node) if kept_node is None else kept_node,
            _name(zone) if kept_zone is None else kept_zone,
            _NO_HINTS,
            _NO_HINTS,
            bool(here) and node == here,
        ),
    )


def _ipv4_endpoints(raw: list[Any], port: int, here: str) -> list[Endpoint | None]:
    """`_endpoint` of each endpoint of an IPv4 slice, in order (so the first refused one raises
    first): a typed one of the common shape through `_wire_endpoint` directly, any other through
    `_endpoint` (which tries `_wire_endpoint` once more before the full checks: those are rare)."""
    out: list[Endpoint | None] = []
    append = out.append
    wire = _wire_endpoint
    for i, item in enumerate(raw):
        common = wire(item, port, here) if type(item) is WireEndpoint else None
        append(common if common is not None else _endpoint(item, "IPv4", i, port, here))
    return out


def _endpoint(item: Any, address_type: str, index: int, port: int, here: str) -> Endpoint | None:
    if type(item) is WireEndpoint:
        if address_type == "IPv4":
            common = _wire_endpoint(item, port, here)
            if common is not None:
                return common
        item = item.as_dict()
    elif address_type == "IPv4":
        common = _common_endpoint(item, port, here)
        if common is not None:
            return common
    return _endpoint_checked(item, address_type, f"endpoints[{index}]", port, here)


def _endpoint_checked(
    item: Any, address_type: str, where: str, port: int = 0, here: str = ""
) -> Endpoint | None:
    ep = require_map(item, where)
    addresses = opt_list(ep, "addresses", f"{where}.addresses")
    if not addresses:
        raise invalid(f"{where}.addresses", "must contain at least 1 address")
    if len(addresses) > MAX_ENDPOINT_ADDRESSES:
        raise invalid(
            f"{where}.addresses",
            f"has {len(addresses)} addresses: at most {MAX_ENDPOINT_ADDRESSES} are allowed",
        )
    canonical = [
        _slice_address(require_str(a, f"{where}.addresses[{j}]"), address_type, f"{where}.addresses[{j}]")
        for j, a in enumerate(addresses)
    ]
    conditions = opt_map(ep, "conditions", f"{where}.conditions") or {}
    ready = opt_bool(conditions, "ready", f"{where}.conditions.ready")
    serving = opt_bool(conditions, "serving", f"{where}.conditions.serving")
    terminating = opt_bool(conditions, "terminating", f"{where}.conditions.terminating")
    node_name = ep.get("nodeName")
    node = "" if node_name is None else _node_name(node_name, f"{where}.nodeName")
    zone = opt_str(ep, "zone", f"{where}.zone")
    hostname = ep.get("hostname")
    if hostname is not None:
        text = require_str(hostname, f"{where}.hostname")
        check_name(text, f"{where}.hostname", is_dns1123_label(text), DNS1123_LABEL_RULE)
    hints = opt_map(ep, "hints", f"{where}.hints")
    zone_hints = node_hints = frozenset[str]()
    if hints:
        zone_hints = _hint_names(
            hints, "forZones", f"{where}.hints.forZones", is_label_value, LABEL_VALUE_RULE
        )
        node_hints = _hint_names(
            hints,
            "forNodes",
            f"{where}.hints.forNodes",
            is_dns1123_subdomain,
            "must be a node name: " + DNS1123_SUBDOMAIN_RULE,
        )
    if address_type == "FQDN":
        return None
    ready_now = True if ready is None else ready
    return Endpoint(
        ip=canonical[0],  # kube-proxy uses the first address; the others are fungible
        port=port,
        ready=ready_now,
        serving=ready_now if serving is None else serving,
        terminating=bool(terminating),
        node_name=_name(node),
        zone=_name(zone),
        zone_hints=zone_hints,
        node_hints=node_hints,
        is_local=bool(here) and node == here,
    )


def _slice_ports(eps: Obj) -> tuple[SlicePort, ...]:
    raw = opt_list(eps, "ports", "ports")
    if (
        type(raw) is tuple
        and len(raw) <= _MEMO_PORTS
        and len(_PORTS_CHECKED) < _PORTS_CHECKED_MAX
        and all(type(p) is WirePort for p in raw)
    ):
        # a short list decoded typed (agent.model.wire): hashable, and most slices of a cluster
        # carry one of a few lists of ports, checked here once each (a refused list is not kept:
        # it is checked, and refused with the same message, each time)
        kept = _PORTS_CHECKED.get(raw)
        if kept is None:
            kept = _check_slice_ports([p.as_dict() for p in raw])
            _PORTS_CHECKED[raw] = kept
        return kept
    if type(raw) is tuple:
        raw = [p.as_dict() if type(p) is WirePort else p for p in raw]
    return _check_slice_ports(raw)


# Each distinct short tuple of a typed slice's ports, checked. Bounded in entries, and in bytes
# by what the check accepts (names of at most 63 characters, at most `_MEMO_PORTS` ports); once
# full, new lists are checked each time without a look-up.
_PORTS_CHECKED: dict[tuple[WirePort, ...], tuple[SlicePort, ...]] = {}
_PORTS_CHECKED_MAX = 4096


def _check_slice_ports(raw: Sequence[Any]) -> tuple[SlicePort, ...]:
    if len(raw) > MAX_SLICE_PORTS:
        raise invalid("ports", f"has {len(raw)} ports: at most {MAX_SLICE_PORTS} are allowed")
    names: set[str] = set()
    out: list[SlicePort] = []
    for i, item in enumerate(raw):
        where = f"ports[{i}]"
        p = require_map(item, where)
        name = opt_str(p, "name", f"{where}.name")
        if name:
            check_name(name, f"{where}.name", is_dns1123_label(name), DNS1123_LABEL_RULE)
        if name in names:
            raise invalid(
                f"{where}.name", f"duplicate name {describe(name)}: port names must be unique in a slice"
            )
        names.add(name)
        protocol = one_of(
            opt_str(p, "protocol", f"{where}.protocol") or "TCP", PROTOCOLS, f"{where}.protocol"
        )
        _app_protocol(p, f"{where}.appProtocol")
        number = opt_int(p, "port", f"{where}.port")
        if number == 0:
            continue  # kube-proxy ignores a port without a number
        if not 1 <= number <= 65535:
            raise invalid(
                f"{where}.port", f"{number} is out of range 1-65535: no data path can forward to it"
            )
        out.append(SlicePort(name, number, Protocol(protocol)))
    return tuple(out)


def parse_endpoint_slice(
    eps: object, node_name: str = "", family: IPFamily | None = IPFamily.IPv4
) -> ParsedSlice | None:
    """One EndpointSlice; None when it is not ours (FQDN, labelled away, or of an addressType
    other than `family`; `family` None takes either). `node_name`: this node, so endpoints on it
    say `is_local` (merge_slices decides it either way).

    Raises ParseError, and only ParseError, when the API server would refuse the object.
    """
    meta = _metadata(eps, is_dns1123_subdomain, DNS1123_SUBDOMAIN_RULE)
    if _slice_not_for_this_proxy(meta.labels):
        return None
    assert isinstance(eps, JSON_MAP_TYPES)  # _metadata checked it
    label_path = f"metadata.labels[{SERVICE_NAME_LABEL}]"
    service = meta.labels.get(SERVICE_NAME_LABEL, "")
    if not service:
        raise invalid(label_path, "is required: the name of the Service the slice belongs to")
    check_name(service, label_path, is_dns1035_label(service), "must name a Service: " + DNS1035_LABEL_RULE)
    address_type = opt_str(eps, "addressType", "addressType")
    if not address_type:
        raise invalid("addressType", f"is required: one of {', '.join(ADDRESS_TYPES)}")
    one_of(address_type, ADDRESS_TYPES, "addressType")
    raw = opt_list(eps, "endpoints", "endpoints")
    if len(raw) > MAX_SLICE_ENDPOINTS:
        raise invalid("endpoints", f"has {len(raw)} endpoints: at most {MAX_SLICE_ENDPOINTS} are allowed")
    try:
        ports = _slice_ports(eps)
        bad_ports: ParseError | None = None
    except ParseError as exc:  # reported after the endpoints' own problems, as before
        ports, bad_ports = (), exc
    # A slice of one port (nearly all) gets its endpoints with that port and whether they are on
    # `node_name` already: `merge_slices` then keeps these very records (one copy of each).
    port = ports[0].port if len(ports) == 1 else 0
    if address_type == "IPv4" and type(raw) is list:
        endpoints = _ipv4_endpoints(raw, port, node_name)
    else:
        endpoints = [_endpoint(item, address_type, i, port, node_name) for i, item in enumerate(raw)]
    if bad_ports is not None:
        raise bad_ports
    if address_type == "FQDN":
        return None
    slice_family = IPFamily.IPv4 if address_type == "IPv4" else IPFamily.IPv6
    if family is not None and slice_family is not family:
        return None
    return ParsedSlice(
        meta.namespace,
        meta.name,
        service,
        ports,
        tuple(ep for ep in endpoints if ep is not None),
        slice_family,
    )
