"""The differential suite's one table: the Services it needs, and every case with kube-proxy's answer.

A case names a source (a pod on node1, a pod on node2, node1's own host network, the external
client), a destination (ClusterIP, NodePort on node1 or node2, external IP, LB IP) of one Service,
the protocol and how many new flows to open. Its `Expect` is what upstream kube-proxy does
(`pkg/proxy/iptables/proxier.go` for the chains, `pkg/proxy/topology.go` CategorizeEndpoints for
which endpoints serve): the verdict, exactly which backends answer, and whom the backends see as
the source (a role: the source itself, "node1"/"node2" when masqueraded). Both modes are held to
it, and to each other (tests/differential/test_differential.py); DIFFERENCES.md lists the
exceptions.

Every Service has its own ClusterIP (and NodePort, external IP, LB IP), so the whole table is
applied at once and one agent start serves it; only `--masquerade-all` (an agent flag) needs a
second start, for the cases of phase MASQUERADE_ALL.

Lab layout: 2 nodes (node1 in zone-a, node2 in zone-b), 4 pods each. pod-1-1 and pod-2-1 are the
clients, pod-N-2 .. pod-N-4 run the whoami server (tests/differential/whoami.py, TCP and UDP 7000)
and are the backends. The external client routes 10.96.0.0/16, 203.0.113.0/24 and 198.51.100.0/24
through node1.

Families: the table is written once, in IPv4, and runs in IPv6 too (`in_family`): every address
and CIDR has an IPv6 twin (the lab's ULA twins of node, pod and client addresses, `fd00:10:96::a:b`
for 10.96.a.b, `fd00:203:0:113::x` and `fd00:198:51:100::x` for the external and LB ranges), each
Service is IPv6-only (`ipFamilies: [IPv6]`, an `addressType: IPv6` slice) and kube-proxy's outcome
is the same, as its IPv6 proxier's rules are its IPv4 proxier's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lab.core import (
    CLIENT_IP,
    CLIENT_IP6,
    node_gateway,
    node_gateway6,
    node_ip,
    node_ip6,
    node_pod_cidr,
    node_pod_cidr6,
    pod_ip,
    pod_ip6,
)
from lab.objects import Port, endpoint_slice, service

TARGET_PORT = 7000
SERVICE_PORT = 80
ZONES = {"node1": "zone-a", "node2": "zone-b"}
CLIENT_ROUTES = ("10.96.0.0/16", "203.0.113.0/24", "198.51.100.0/24")  # via node1
BACKEND_PODS = ("pod-1-2", "pod-1-3", "pod-1-4", "pod-2-2", "pod-2-3", "pod-2-4")
PODS_PER_NODE = 4

IPV4, IPV6 = "IPv4", "IPv6"
FAMILIES = (IPV4, IPV6)
# The table's CIDRs and their IPv6 twins.
CIDRS6 = {
    "10.96.0.0/16": "fd00:10:96::/64",
    "203.0.113.0/24": "fd00:203:0:113::/64",
    "198.51.100.0/24": "fd00:198:51:100::/64",
    "172.16.0.0/12": "fd00:172:16::/48",
    node_pod_cidr(1): node_pod_cidr6(1),
    f"{CLIENT_IP}/32": f"{CLIENT_IP6}/128",
}

# Verdicts of a case (and of each attempt, see probe.py). REFUSED is an ICMP port unreachable (a
# reject); RESET a TCP RST, what a node's stack answers where nothing is programmed or listening.
ANSWERED, REFUSED, RESET, TIMED_OUT = "answered", "refused", "reset", "timed out"

# Phases: agent flags shared by a group of cases
DEFAULT, MASQUERADE_ALL = "default", "masquerade-all"
PHASE_FLAGS: dict[str, tuple[str, ...]] = {DEFAULT: (), MASQUERADE_ALL: ("--masquerade-all",)}

# How the backends of an answered case are compared
EXACT, STICKY, EXPIRING = "exact", "sticky", "expiring"


def pod_address(pod: str) -> str:
    m = re.fullmatch(r"pod-(\d+)-(\d+)", pod)
    assert m, pod
    return pod_ip(int(m[1]), int(m[2]))


def node_of(pod: str) -> str:
    return "node" + pod.split("-")[1]


def in_family(address: str, family: str) -> str:
    """The table's IPv4 address `address` as `family` has it (module doc: the IPv6 twins)."""
    if family == IPV4:
        return address
    for n in (1, 2):
        if address == node_ip(n):
            return node_ip6(n)
    if address == CLIENT_IP:
        return CLIENT_IP6
    a, b, c, d = address.split(".")
    if (a, b) == ("10", "244"):
        return pod_ip6(int(c), int(d) - 1)
    if (a, b) == ("10", "96"):
        return f"fd00:10:96::{c}:{d}"
    if (a, b, c) == ("203", "0", "113"):
        return f"fd00:203:0:113::{d}"
    if (a, b, c) == ("198", "51", "100"):
        return f"fd00:198:51:100::{d}"
    raise ValueError(f"no IPv6 twin for {address}")


def cidr_in_family(cidr: str, family: str) -> str:
    return cidr if family == IPV4 else CIDRS6[cidr]


def role_of(address: str) -> str:
    """Who an address is, in either family: a pod's name, "client", or the node owning it (node IP
    or pod gateway)."""
    for n in (1, 2):
        if address in (node_ip(n), node_gateway(n), node_ip6(n), node_gateway6(n)):
            return f"node{n}"
    if address in (CLIENT_IP, CLIENT_IP6):
        return "client"
    for pod in ("pod-1-1", "pod-2-1", *BACKEND_PODS):
        if address in (pod_address(pod), in_family(pod_address(pod), IPV6)):
            return pod
    return address


@dataclass(frozen=True)
class Backend:
    """One endpoint: a lab pod and its conditions; `hint` is its forZones hint ("" for none)."""

    pod: str
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    hint: str = ""


BOTH = (Backend("pod-1-2"), Backend("pod-2-2"))
FOUR = (Backend("pod-1-2"), Backend("pod-1-3"), Backend("pod-2-2"), Backend("pod-2-3"))


def draining(pod: str, serving: bool = True) -> Backend:
    return Backend(pod, ready=False, serving=serving, terminating=True)


@dataclass(frozen=True)
class Svc:
    """A Service with port 80 -> 7000 of one protocol, and one EndpointSlice of `backends`."""

    name: str
    cluster_ip: str
    backends: tuple[Backend, ...]
    protocol: str = "TCP"
    node_port: int = 0
    external_ip: str = ""
    lb_ip: str = ""
    source_ranges: tuple[str, ...] = ()
    etp_local: bool = False
    itp_local: bool = False
    affinity_s: int = 0

    def objects(self, family: str = IPV4) -> list[dict[str, Any]]:
        """The Service and its EndpointSlice, in `family` (IPv6: an IPv6-only Service)."""

        def ip(address: str) -> str:
            return in_family(address, family)

        port = Port("p", SERVICE_PORT, TARGET_PORT, self.protocol, self.node_port)
        spec: dict[str, Any] = {"ipFamilies": [family]} if family == IPV6 else {}
        kind = "ClusterIP"
        if self.node_port:
            kind = "NodePort"
        if self.lb_ip:
            kind = "LoadBalancer"
            spec["status"] = {"loadBalancer": {"ingress": [{"ip": ip(self.lb_ip)}]}}
            if self.source_ranges:
                spec["loadBalancerSourceRanges"] = [cidr_in_family(c, family) for c in self.source_ranges]
        if self.external_ip:
            spec["externalIPs"] = [ip(self.external_ip)]
        if self.node_port or self.external_ip or self.lb_ip:
            spec["externalTrafficPolicy"] = "Local" if self.etp_local else "Cluster"
        spec["internalTrafficPolicy"] = "Local" if self.itp_local else "Cluster"
        if self.affinity_s:
            spec["sessionAffinity"] = "ClientIP"
            spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": self.affinity_s}}
        svc = service(self.name, ip(self.cluster_ip), [port], type=kind, **spec)
        eps = endpoint_slice(self.name, [port], [])
        eps["addressType"] = family
        for b in self.backends:
            node = node_of(b.pod)
            entry: dict[str, Any] = {
                "addresses": [ip(pod_address(b.pod))],
                "conditions": {"ready": b.ready, "serving": b.serving, "terminating": b.terminating},
                "nodeName": node,
                "zone": ZONES[node],
            }
            if b.hint:
                entry["hints"] = {"forZones": [{"name": b.hint}]}
            eps["endpoints"].append(entry)
        return [svc, eps]


SERVICES = (
    Svc("web", "10.96.10.1", BOTH, node_port=30701),
    Svc("web-udp", "10.96.10.2", BOTH, protocol="UDP", node_port=30702),
    Svc("etp-local", "10.96.10.3", BOTH, node_port=30703, etp_local=True),
    Svc("etp-local-remote", "10.96.10.4", (Backend("pod-2-2"),), node_port=30704, etp_local=True),
    Svc("itp-local", "10.96.10.5", BOTH, itp_local=True),
    Svc("itp-local-remote", "10.96.10.6", (Backend("pod-2-2"),), itp_local=True),
    Svc("sticky", "10.96.10.7", FOUR, node_port=30707, affinity_s=300),
    Svc("expiring", "10.96.10.8", FOUR, affinity_s=1),
    Svc("empty", "10.96.10.9", (), node_port=30709),
    Svc("empty-udp", "10.96.10.10", (), protocol="UDP"),
    Svc(
        "draining",
        "10.96.10.11",
        (draining("pod-1-3"), draining("pod-2-3"), draining("pod-1-4", serving=False)),
        node_port=30711,
    ),
    Svc(
        "draining-local",
        "10.96.10.12",
        (draining("pod-1-3"), draining("pod-1-4", serving=False), Backend("pod-2-2")),
        node_port=30712,
        etp_local=True,
    ),
    Svc(
        "zoned",
        "10.96.10.13",
        (
            Backend("pod-1-2", hint="zone-a"),
            Backend("pod-1-3", hint="zone-a"),
            Backend("pod-2-2", hint="zone-b"),
        ),
    ),
    Svc("external", "10.96.10.14", BOTH, external_ip="203.0.113.14"),
    Svc("lb-open", "10.96.10.15", BOTH, node_port=30715, lb_ip="198.51.100.15"),
    Svc(
        "lb-allowed",
        "10.96.10.16",
        BOTH,
        node_port=30716,
        lb_ip="198.51.100.16",
        source_ranges=(f"{CLIENT_IP}/32",),
    ),
    Svc(
        "lb-denied",
        "10.96.10.17",
        BOTH,
        node_port=30717,
        lb_ip="198.51.100.17",
        source_ranges=("172.16.0.0/12", "10.244.1.0/24"),  # node1's pods, not the external client
    ),
    Svc("masq", "10.96.10.20", BOTH),
    Svc("hairpin", "10.96.10.21", (Backend("pod-1-2"),)),
    Svc("sticky-udp", "10.96.10.22", FOUR, protocol="UDP", affinity_s=300),
    Svc("external-local", "10.96.10.23", BOTH, external_ip="203.0.113.23", etp_local=True),
    Svc("zoned-partly", "10.96.10.24", (Backend("pod-1-2", hint="zone-a"), Backend("pod-2-2"))),
    Svc("itp-draining", "10.96.10.25", (draining("pod-1-3"), Backend("pod-2-2")), itp_local=True),
)
SERVICE_BY_NAME = {s.name: s for s in SERVICES}


@dataclass(frozen=True)
class Expect:
    """kube-proxy's outcome: verdict, backends that answer, roles of the source the backends see.

    `backends` is exact for EXACT cases and the pool one backend is picked from for STICKY and
    EXPIRING ones."""

    verdict: str
    backends: frozenset[str] = frozenset()
    seen_as: frozenset[str] = frozenset()


def answered(backends: Iterable[str], *seen_as: str) -> Expect:
    return Expect(ANSWERED, frozenset(backends), frozenset(seen_as))


REFUSE = Expect(REFUSED)
DROP = Expect(TIMED_OUT)
PAIR = ("pod-1-2", "pod-2-2")
POOL = ("pod-1-2", "pod-1-3", "pod-2-2", "pod-2-3")


@dataclass(frozen=True)
class Case:
    """One row: `source` opens `count` new flows (`rounds` times) to `dest` of `service`.

    dest: "cluster-ip", "nodeport@node1", "nodeport@node2", "external-ip", "lb-ip"."""

    id: str
    source: str
    service: str
    dest: str
    expect: Expect
    count: int = 20
    size: int = 0  # UDP payload bytes (4000: fragmented both ways)
    compare: str = EXACT
    rounds: int = 1
    gap_s: float = 0.0
    phase: str = DEFAULT
    timeout_s: float = 1.5  # per attempt
    why: str = ""  # the kube-proxy rule that decides the expectation, where it is not obvious
    svc: Svc = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "svc", SERVICE_BY_NAME[self.service])

    @property
    def protocol(self) -> str:
        return self.svc.protocol

    def address(self, family: str = IPV4) -> tuple[str, int]:
        """The destination address and port the source dials, in `family`."""
        if self.dest == "cluster-ip":
            addr, port = self.svc.cluster_ip, SERVICE_PORT
        elif self.dest.startswith("nodeport@node"):
            addr, port = node_ip(int(self.dest.removeprefix("nodeport@node"))), self.svc.node_port
        elif self.dest == "external-ip":
            addr, port = self.svc.external_ip, SERVICE_PORT
        elif self.dest == "lb-ip":
            addr, port = self.svc.lb_ip, SERVICE_PORT
        else:
            raise ValueError(f"{self.id}: unknown destination {self.dest!r}")
        return in_family(addr, family), port


CASES = (
    # ---- ClusterIP and NodePort, ETP Cluster: masqueraded whenever the traffic is external
    Case("cip-from-pod1", "pod-1-1", "web", "cluster-ip", answered(PAIR, "pod-1-1")),
    Case("cip-from-pod2", "pod-2-1", "web", "cluster-ip", answered(PAIR, "pod-2-1")),
    Case(
        "cip-from-client",
        "client",
        "web",
        "cluster-ip",
        answered(PAIR, "node1"),
        why="KUBE-SVC-*: ! -s clusterCIDR -d clusterIP -> KUBE-MARK-MASQ",
    ),
    Case(
        "cip-from-node1",
        "node1",
        "web",
        "cluster-ip",
        answered(PAIR, "node1"),
        why="OUTPUT -> KUBE-SERVICES; the node's address is outside the cluster CIDR: masqueraded",
    ),
    Case("np-node1-from-client", "client", "web", "nodeport@node1", answered(PAIR, "node1")),
    Case("np-node2-from-client", "client", "web", "nodeport@node2", answered(PAIR, "node2")),
    Case(
        "np-node1-from-pod1",
        "pod-1-1",
        "web",
        "nodeport@node1",
        answered(PAIR, "node1"),
        why="KUBE-EXT-* of an ETP Cluster service starts with KUBE-MARK-MASQ, whoever the source",
    ),
    Case("np-node2-from-pod1", "pod-1-1", "web", "nodeport@node2", answered(PAIR, "node2")),
    Case("np-node1-from-node1", "node1", "web", "nodeport@node1", answered(PAIR, "node1")),
    Case("np-node2-from-node1", "node1", "web", "nodeport@node2", answered(PAIR, "node2")),
    Case("udp-cip-from-node1", "node1", "web-udp", "cluster-ip", answered(PAIR, "node1")),
    Case("udp-np-node1-from-node1", "node1", "web-udp", "nodeport@node1", answered(PAIR, "node1")),
    Case("udp-np-node2-from-node1", "node1", "web-udp", "nodeport@node2", answered(PAIR, "node2")),
    # ---- UDP, and 4,000-byte datagrams (three fragments each way)
    Case("udp-cip-from-pod1", "pod-1-1", "web-udp", "cluster-ip", answered(PAIR, "pod-1-1")),
    Case("udp-np-node1-from-client", "client", "web-udp", "nodeport@node1", answered(PAIR, "node1")),
    Case("frag-cip-from-pod1", "pod-1-1", "web-udp", "cluster-ip", answered(PAIR, "pod-1-1"), size=4000),
    Case("frag-cip-from-pod2", "pod-2-1", "web-udp", "cluster-ip", answered(PAIR, "pod-2-1"), size=4000),
    Case(
        "frag-np-node1-from-client",
        "client",
        "web-udp",
        "nodeport@node1",
        answered(PAIR, "node1"),
        size=4000,
    ),
    Case(
        "frag-np-node2-from-pod1",
        "pod-1-1",
        "web-udp",
        "nodeport@node2",
        answered(PAIR, "node2"),
        size=4000,
    ),
    Case("frag-cip-from-node1", "node1", "web-udp", "cluster-ip", answered(PAIR, "node1"), size=4000),
    # ---- externalTrafficPolicy Local
    Case(
        "etp-local-node1-from-client",
        "client",
        "etp-local",
        "nodeport@node1",
        answered(["pod-1-2"], "client"),
    ),
    Case(
        "etp-local-node2-from-client",
        "client",
        "etp-local",
        "nodeport@node2",
        answered(["pod-2-2"], "client"),
    ),
    Case(
        "etp-local-node1-from-pod1",
        "pod-1-1",
        "etp-local",
        "nodeport@node1",
        answered(PAIR, "pod-1-1"),
        why="KUBE-EXT-*: -s clusterCIDR -> KUBE-SVC-* (pod traffic short-circuits to every endpoint)",
    ),
    Case(
        "etp-local-node1-from-node1",
        "node1",
        "etp-local",
        "nodeport@node1",
        answered(PAIR, "node1"),
        why="KUBE-EXT-*: --src-type LOCAL -> KUBE-MARK-MASQ and KUBE-SVC-* (the node's own traffic"
        " reaches every endpoint)",
    ),
    Case(
        "etp-local-no-local-endpoint-from-client",
        "client",
        "etp-local-remote",
        "nodeport@node1",
        DROP,
        why="KUBE-SVL-* without endpoints: KUBE-MARK-DROP ('has no local endpoints')",
    ),
    Case(
        "etp-local-remote-node1-from-pod1",
        "pod-1-1",
        "etp-local-remote",
        "nodeport@node1",
        answered(["pod-2-2"], "pod-1-1"),
        why="the positive control of the drop above: the same NodePort serves pod traffic, which"
        " KUBE-EXT-* sends to every endpoint (-s clusterCIDR -> KUBE-SVC-*)",
    ),
    Case(
        "etp-local-remote-node2-from-client",
        "client",
        "etp-local-remote",
        "nodeport@node2",
        answered(["pod-2-2"], "client"),
    ),
    # ---- internalTrafficPolicy Local
    Case("itp-local-from-pod1", "pod-1-1", "itp-local", "cluster-ip", answered(["pod-1-2"], "pod-1-1")),
    Case("itp-local-from-pod2", "pod-2-1", "itp-local", "cluster-ip", answered(["pod-2-2"], "pod-2-1")),
    Case(
        "itp-local-from-node1",
        "node1",
        "itp-local",
        "cluster-ip",
        answered(["pod-1-2"], "node1"),
        why="OUTPUT -> KUBE-SERVICES -> KUBE-SVL-*: the node's own traffic stays on its node's endpoints",
    ),
    Case(
        "itp-local-no-local-endpoint-from-pod1",
        "pod-1-1",
        "itp-local-remote",
        "cluster-ip",
        DROP,
        why="filter KUBE-SERVICES: 'has no local endpoints' -> DROP (not REJECT: others could serve)",
    ),
    Case(
        "itp-local-remote-from-pod2",
        "pod-2-1",
        "itp-local-remote",
        "cluster-ip",
        answered(["pod-2-2"], "pod-2-1"),
        why="the positive control of the drop above: the same cluster IP serves node2's pods",
    ),
    # ---- session affinity
    Case(
        "affinity-cip-from-pod1",
        "pod-1-1",
        "sticky",
        "cluster-ip",
        answered(POOL, "pod-1-1"),
        count=16,
        compare=STICKY,
    ),
    Case(
        "affinity-np-node1-from-client",
        "client",
        "sticky",
        "nodeport@node1",
        answered(POOL, "node1"),
        count=16,
        compare=STICKY,
        why="recent --rsource sees the client's address (SNAT happens later, in POSTROUTING)",
    ),
    Case(
        "affinity-cip-from-node1",
        "node1",
        "sticky",
        "cluster-ip",
        answered(POOL, "node1"),
        count=16,
        compare=STICKY,
        why="recent --rsource sees the node's address, the source of its route to the cluster IP",
    ),
    Case(
        "affinity-expiry-from-pod1",
        "pod-1-1",
        "expiring",
        "cluster-ip",
        answered(POOL, "pod-1-1"),
        count=3,
        compare=EXPIRING,
        rounds=8,
        gap_s=2.2,
        why="timeoutSeconds 1: a flow 2.2 s after the last one is balanced anew (P(no change) = 4^-7)",
    ),
    Case(
        "affinity-udp-cip-from-pod1",
        "pod-1-1",
        "sticky-udp",
        "cluster-ip",
        answered(POOL, "pod-1-1"),
        count=16,
        compare=STICKY,
    ),
    # ---- hairpin: a backend reaching itself through its service
    Case(
        "hairpin-cip-from-backend",
        "pod-1-2",
        "hairpin",
        "cluster-ip",
        answered(["pod-1-2"], "node1"),
        why="KUBE-SEP-*: -s <endpoint IP> -> KUBE-MARK-MASQ, so the reply comes back through the node",
    ),
    # ---- no endpoints: rejected at once, TCP and UDP
    Case("no-endpoints-cip-from-pod1", "pod-1-1", "empty", "cluster-ip", REFUSE, count=3, timeout_s=3.5),
    Case(
        "no-endpoints-np-node1-from-client",
        "client",
        "empty",
        "nodeport@node1",
        REFUSE,
        count=3,
        timeout_s=3.5,
        why="REJECT's ICMP shares the kernel's per-peer ICMP budget (1/s after a burst of 6) with the"
        " redirects node1 sends the client for the flows it forwards back out of eth0 (iptables mode):"
        " a reject can take a SYN retransmission (1 s, 3 s) to get through, hence 3.5 s per attempt",
    ),
    Case(
        "no-endpoints-udp-cip-from-pod1", "pod-1-1", "empty-udp", "cluster-ip", REFUSE, count=3, timeout_s=3.5
    ),
    # ---- terminating endpoints (pkg/proxy/topology.go: Cluster and Local fall back independently)
    Case(
        "terminating-only-cip-from-pod1",
        "pod-1-1",
        "draining",
        "cluster-ip",
        answered(["pod-1-3", "pod-2-3"], "pod-1-1"),
        why="no ready endpoint anywhere: serving-and-terminating ones serve cluster traffic",
    ),
    Case(
        "terminating-only-np-node2-from-client",
        "client",
        "draining",
        "nodeport@node2",
        answered(["pod-1-3", "pod-2-3"], "node2"),
    ),
    Case(
        "terminating-local-fallback-node1-from-client",
        "client",
        "draining-local",
        "nodeport@node1",
        answered(["pod-1-3"], "client"),
        why="no local ready endpoint on node1: its serving-and-terminating one (not the non-serving)",
    ),
    Case(
        "terminating-local-ready-node2-from-client",
        "client",
        "draining-local",
        "nodeport@node2",
        answered(["pod-2-2"], "client"),
    ),
    Case(
        "terminating-local-cip-from-pod1",
        "pod-1-1",
        "draining-local",
        "cluster-ip",
        answered(["pod-2-2"], "pod-1-1"),
        why="cluster traffic: a ready endpoint exists, so terminating ones are not used",
    ),
    Case(
        "itp-local-terminating-fallback-from-pod1",
        "pod-1-1",
        "itp-draining",
        "cluster-ip",
        answered(["pod-1-3"], "pod-1-1"),
        why="ITP Local: no local ready endpoint on node1, so its serving-and-terminating one",
    ),
    # ---- topology hints (node1 is in zone-a, node2 in zone-b)
    Case(
        "topology-zone-a-from-pod1",
        "pod-1-1",
        "zoned",
        "cluster-ip",
        answered(["pod-1-2", "pod-1-3"], "pod-1-1"),
    ),
    Case("topology-zone-b-from-pod2", "pod-2-1", "zoned", "cluster-ip", answered(["pod-2-2"], "pod-2-1")),
    Case(
        "topology-ignored-unless-every-endpoint-has-hints",
        "pod-1-1",
        "zoned-partly",
        "cluster-ip",
        answered(PAIR, "pod-1-1"),
        why="topologyModeFromHints: one ready endpoint without a zone hint turns hints off",
    ),
    # ---- external IPs and load-balancer IPs, source ranges
    Case("external-ip-from-client", "client", "external", "external-ip", answered(PAIR, "node1")),
    Case(
        "external-ip-from-pod1",
        "pod-1-1",
        "external",
        "external-ip",
        answered(PAIR, "node1"),
        why="KUBE-SERVICES -d externalIP -> KUBE-EXT-* -> KUBE-MARK-MASQ, pods included",
    ),
    Case(
        "external-ip-etp-local-from-client",
        "client",
        "external-local",
        "external-ip",
        answered(["pod-1-2"], "client"),
    ),
    Case("lb-ip-from-client", "client", "lb-open", "lb-ip", answered(PAIR, "node1")),
    Case("lb-ip-from-pod1", "pod-1-1", "lb-open", "lb-ip", answered(PAIR, "node1")),
    Case("lb-source-range-allowed-from-client", "client", "lb-allowed", "lb-ip", answered(PAIR, "node1")),
    Case(
        "lb-source-range-excludes-pod1",
        "pod-1-1",
        "lb-allowed",
        "lb-ip",
        DROP,
        why="KUBE-FW-*: only the listed sources reach KUBE-EXT-*; KUBE-PROXY-FIREWALL drops the rest",
    ),
    Case("lb-source-range-denied-from-client", "client", "lb-denied", "lb-ip", DROP),
    Case(
        "lb-source-range-allowed-from-pod1",
        "pod-1-1",
        "lb-denied",
        "lb-ip",
        answered(PAIR, "node1"),
        why="the positive control of the denial above: node1's pod CIDR is in the same Service's"
        " ranges (KUBE-FW-*: -s 10.244.1.0/24 -> KUBE-EXT-*, which masquerades)",
    ),
    Case(
        "lb-source-range-nodeport-unaffected",
        "client",
        "lb-denied",
        "nodeport@node1",
        answered(PAIR, "node1"),
        why="loadBalancerSourceRanges guard the LB IP only",
    ),
    # ---- --masquerade-all (a second agent start)
    Case(
        "masquerade-all-cip-from-pod1",
        "pod-1-1",
        "masq",
        "cluster-ip",
        answered(PAIR, "node1"),
        phase=MASQUERADE_ALL,
    ),
    Case(
        "masquerade-all-cip-from-pod2",
        "pod-2-1",
        "masq",
        "cluster-ip",
        answered(PAIR, "node2"),
        phase=MASQUERADE_ALL,
    ),
)
CASE_IDS = [c.id for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS), "case ids are unique"


def all_objects(family: str = IPV4) -> list[dict[str, Any]]:
    """Every Service and EndpointSlice of the table, applied at once."""
    return [obj for svc in SERVICES for obj in svc.objects(family)]
