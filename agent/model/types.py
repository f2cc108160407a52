"""Value types of the desired proxy state (frozen records, and the state as a read-only view).

These mirror kube-proxy's `ServicePortName`, `BaseServicePortInfo` and `BaseEndpointInfo`
(pkg/proxy/serviceport.go, endpoint.go): the Kubernetes objects are reduced once, at the edge,
to small immutable records that both backends (eBPF and iptables) consume. Nothing here knows
about the kernel or the API server.

One state holds one address family (`IPFamily`), as kube-proxy runs one proxier per family (its
metaproxier, pkg/proxy/metaproxier): a dual-stack Service appears in the IPv4 state with its IPv4
cluster IP and in the IPv6 state with its IPv6 one, each with the endpoints of its own family's
EndpointSlices. Addresses are canonical strings (dotted quads; RFC 5952 IPv6 text, as Go's
`net.IP.String()` prints it): parse.py reads the API's text as kube-proxy does, leading zeros
included, and writes it back canonically, so that rendered rules and decoded map dumps read like
the objects they came from and never carry raw caller text. Source ranges are canonical CIDRs
(`10.0.0.0/8`, `2001:db8::/64`, host bits cleared).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from functools import cached_property
from typing import NamedTuple


class IPFamily(IntEnum):
    """An address family; the value is the IP version. `str()` is Kubernetes' spelling (`IPv4`)."""

    IPv4 = 4
    IPv6 = 6

    def __str__(self) -> str:
        return f"IPv{self.value}"

    @classmethod
    def of(cls, address: str) -> IPFamily:
        """The family of a canonical address or CIDR text (a colon makes it IPv6)."""
        return cls.IPv6 if ":" in address else cls.IPv4


FAMILIES = (IPFamily.IPv4, IPFamily.IPv6)


def join_host_port(ip: str, port: int) -> str:
    """Go's `net.JoinHostPort`: `10.0.0.1:80`, `[fd00::1]:80` (kube-proxy's endpoint string)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Protocol(StrEnum):
    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"

    @property
    def number(self) -> int:
        """IANA protocol number, as the kernel and the BPF maps carry it."""
        return _PROTO_NUMBERS[self]


_PROTO_NUMBERS = {Protocol.TCP: 6, Protocol.UDP: 17, Protocol.SCTP: 132}


class SessionAffinity(StrEnum):
    NONE = "None"
    CLIENT_IP = "ClientIP"


# kube-proxy's default for sessionAffinityConfig.clientIP.timeoutSeconds (3 hours).
DEFAULT_AFFINITY_TIMEOUT_SECONDS = 10800


class ServicePortName(NamedTuple):
    """`namespace/name:port`, the identity of one service port (kube-proxy's ServicePortName).

    `port` is the port's *name* (often empty for single-port services), not its number. A
    NamedTuple: it keys every dict of the state and the planner, and a tuple hashes in C.
    """

    namespace: str
    name: str
    port: str
    protocol: Protocol

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" + (f":{self.port}" if self.port else "")

    @property
    def service(self) -> str:
        """`namespace/name` of the owning Service."""
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class ServicePort:
    """One port of one Service, with everything the proxy needs to program it."""

    name: ServicePortName
    cluster_ip: str
    port: int
    protocol: Protocol
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    load_balancer_ips: tuple[str, ...] = ()
    load_balancer_source_ranges: tuple[str, ...] = ()
    external_policy_local: bool = False
    internal_policy_local: bool = False
    session_affinity: SessionAffinity = SessionAffinity.NONE
    affinity_timeout_seconds: int = 0
    health_check_node_port: int = 0

    @property
    def externally_accessible(self) -> bool:
        """NodePort, externalIPs or load-balancer IPs make a port reachable from off the cluster."""
        return self.node_port != 0 or bool(self.external_ips) or bool(self.load_balancer_ips)

    @property
    def uses_cluster_endpoints(self) -> bool:
        """Some traffic to this port may go to any endpoint in the cluster.

        True for any externally reachable port, even with externalTrafficPolicy Local: pods and the
        node reaching an external address are short-circuited to the cluster endpoints.
        """
        return not self.internal_policy_local or self.externally_accessible

    @property
    def uses_local_endpoints(self) -> bool:
        """Some traffic to this port may only go to endpoints on this node."""
        return self.internal_policy_local or (self.externally_accessible and self.external_policy_local)

    @property
    def affinity_timeout(self) -> int:
        """Seconds a client sticks to its backend; 0 when affinity is off."""
        return self.affinity_timeout_seconds if self.session_affinity is SessionAffinity.CLIENT_IP else 0


_NO_HINTS: frozenset[str] = frozenset()


class Endpoint(NamedTuple):
    """One backend address of one service port (kube-proxy's BaseEndpointInfo).

    A NamedTuple, not a dataclass: a cluster of 10,000 services holds a hundred thousand of these,
    built on every list, and a tuple is made and compared in C. Ordering and equality are by
    `ip:port` first, then the conditions, so sorted endpoint lists match kube-proxy's when sorted by
    `sort_key` (the `ip:port` string: "10.0.0.10:80" sorts before "10.0.0.2:80"; an IPv6 endpoint
    is `[ip]:port`, Go's JoinHostPort, which is also what kube-proxy hashes into its chain names).
    """

    ip: str
    port: int
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node_name: str = ""
    zone: str = ""
    zone_hints: frozenset[str] = _NO_HINTS
    node_hints: frozenset[str] = _NO_HINTS
    is_local: bool = False

    def __str__(self) -> str:
        return join_host_port(self.ip, self.port)

    @property
    def sort_key(self) -> str:
        return join_host_port(self.ip, self.port)


@dataclass(frozen=True)
class ServiceEndpoints:
    """The endpoints chosen for one service port by the traffic policies (see topology.py).

    - `cluster`: for traffic that may go anywhere in the cluster (empty when unused).
    - `local`: for traffic that must stay on this node (empty when unused or none local).
    - `all_reachable`: the union; the iptables mode writes a KUBE-SEP chain for each.
    - `has_any`: some endpoint anywhere could serve (decides REJECT vs DROP for Local policy).
    """

    cluster: tuple[Endpoint, ...] = ()
    local: tuple[Endpoint, ...] = ()
    all_reachable: tuple[Endpoint, ...] = ()
    has_any: bool = False


@dataclass(frozen=True)
class NodeInfo:
    """The node this agent acts for."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()
    # Topology hints this node uses (feature gates, agent/featuregates.py): node hints
    # (PreferSameTrafficDistribution), zone hints (TopologyAwareHints / ServiceTrafficDistribution).
    node_hints: bool = True
    zone_hints: bool = True
    # spec.podCIDRs (else spec.podCIDR): what --detect-local-mode=NodeCIDR reads.
    pod_cidrs: tuple[str, ...] = ()

    @cached_property
    def zone(self) -> str:
        return dict(self.labels).get("topology.kubernetes.io/zone", "")


@dataclass(frozen=True)
class ProxyState:
    """Everything both backends need: service ports and the endpoints chosen for each.

    A read-only view, not a frozen value: the mappings are typed `Mapping`, so a consumer cannot
    write to them (mypy refuses it), but the model that owns them (`ProxyModel`) updates them in
    place at each commit, so they always show the latest commit. Copying 10,000 or 50,000 entries
    at every commit would put the cluster's size back into the cost of a one-endpoint change, so
    consumers read the state during a sync and keep what they need of it (the records themselves,
    `ServicePort` and `ServiceEndpoints`, are immutable), never the mappings.

    `services` and `endpoints` are keyed by ServicePortName; every key of `services` is in
    `endpoints` (possibly with an empty ServiceEndpoints). Iterate `sorted_ports()` for a
    deterministic order. Every address in it is of `family`.
    """

    node: NodeInfo
    services: Mapping[ServicePortName, ServicePort]
    endpoints: Mapping[ServicePortName, ServiceEndpoints]
    # Raw (unfiltered) endpoint lists as the slices gave them, sorted like kube-proxy's.
    raw_endpoints: Mapping[ServicePortName, tuple[Endpoint, ...]] = field(default_factory=dict)
    family: IPFamily = IPFamily.IPv4
    # Service ports of the family left out of `services` because other programs translate their
    # packets (eBPF mode's IPv6 ports the eBPF programs serve, agent/metaproxier.py `only`). The
    # iptables renderer writes their healthCheckNodePort's filter ACCEPT alone: that port is
    # answered by the agent's own server whoever translates the Service, and a node whose INPUT
    # policy drops lets the load balancer's checks in by that rule only.
    elsewhere: Mapping[ServicePortName, ServicePort] = field(default_factory=dict)

    def sorted_ports(self) -> list[ServicePort]:
        return [self.services[k] for k in sorted(self.services, key=lambda n: (str(n), n.protocol))]
