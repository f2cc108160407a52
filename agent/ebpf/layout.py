"""The pure layout of one service port in the maps: its frontends, source ranges and slots, and the
config entry. No ids are allocated here and no state is kept: `agent.ebpf.planner` calls these with
what it knows and records the result.

What the entries say is the data path's contract (bpf/ekp_abi.h, bpf/README.md):

* Every service port has up to two backend *sets*, "cluster" (ServiceEndpoints.cluster) and "local"
  (ServiceEndpoints.local): a run of slots `{set_id, 1..count} -> backend_id`.
* Every service port has a `svc_id`, carried by all its frontends: the data path keys affinity by
  (client, svc_id), so affinity spans every frontend of the port as kube-proxy's does, and checks
  membership `{svc_id, backend_id} -> CLUSTER|LOCAL` (one `member` entry per backend of the
  port's sets) before it honours an affinity entry or moves a UDP flow.
* Frontends follow kube-proxy's chains. ClusterIP, both scopes: ITP Local ? local set (LOCAL) :
  cluster set. NodePort (each node address), externalIPs, LB IPs: EXTERNAL scope: ETP Local ?
  local set (LOCAL) : cluster set + SNAT_ALL (kube-proxy's KUBE-MARK-MASQ; SNAT_REMOTE, toward
  remote backends only, with --bpf-keep-client-ip-for-local-backends); INTERNAL scope (pods): the
  cluster set, with the EXTERNAL scope's SNAT under ETP Cluster (kube-proxy sends pods' traffic to
  these addresses through the same masquerading KUBE-EXT-* chain), untranslated under ETP Local.
  With localhost NodePorts (Config.localhost_nodeports), each NodePort also on 127.0.0.1, INTERNAL
  scope only: the node's own processes reach it through the socket programs.
  masquerade-all (both scopes) and cluster-cidr (EXTERNAL scope) add SNAT_ALL to the ClusterIP.
  An empty set: NO_ENDPOINTS (reject) when nothing could serve or the cluster view is empty; an
  empty local set while others could serve keeps LOCAL alone (drop). loadBalancerSourceRanges:
  SOURCE_RANGES on the LB frontends of both scopes and one `srcr` entry per CIDR (plus the LB IP
  itself when a range holds a node address, as kube-proxy).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping, Sequence
from socket import inet_aton, inet_ntoa
from typing import Literal, NamedTuple

from agent.config import Config, HostRouting, NodeContext
from agent.ebpf.abi import ConfigFlag, FrontendFlag, Scope
from agent.ebpf.codec import Value
from agent.ebpf.entries import BE_PORT, U16, U32, fe_count, fe_flags, fe_key, fe_set, ident, slot_key
from agent.ebpf.maglev import wanted_tables
from agent.localdetect import LocalDetector
from agent.model.types import ServicePort

LOCALHOST = "127.0.0.1"  # localhost NodePorts (Config.localhost_nodeports)

SetKind = Literal["cluster", "local"]
KINDS: tuple[SetKind, ...] = ("cluster", "local")

# Conntrack timeouts of the config entry that kube-proxy's settings do not cover, or cover with 0
# ("leave the kernel's value"): the kernel's defaults (nf_conntrack_udp_timeout 30 s,
# nf_conntrack_udp_timeout_stream 120 s) and Cilium's for the TCP states kube-proxy leaves alone
# (CT_SYN_TIMEOUT 60 s for a handshake not completed, CT_CLOSE_TIMEOUT 10 s after a RST or FINs
# both ways). kube-proxy's own defaults for the rest: established 24 h, close-wait 1 h.
TCP_ESTABLISHED_TIMEOUT_S = 86400
TCP_CLOSE_WAIT_TIMEOUT_S = 3600
TCP_SYN_TIMEOUT_S = 60
TCP_CLOSED_TIMEOUT_S = 10
UDP_TIMEOUT_S = 30
UDP_STREAM_TIMEOUT_S = 120
# A TCP flow whose backend left every Service: nf_conntrack's timeout for unacknowledged data
# (nf_conntrack_tcp_timeout_unacknowledged), counted from the backend's last packet.
TCP_ORPHAN_TIMEOUT_S = 300
# ICMP rejects per second and burst, per CPU: the kernel's net.ipv4.icmp_msgs_per_sec and
# icmp_msgs_burst defaults (its global limit on the ICMP errors a node sends).
ICMP_RATE = 1000
ICMP_BURST = 50


def ip_be(ip: str) -> int:
    """Dotted quad to the int whose native-order bytes are the address in network order (fast
    path of abi.ip_be for the model's canonical addresses)."""
    return int.from_bytes(inet_aton(ip), "little")


def port_be(port: int) -> int:
    return ((port & 0xFF) << 8) | (port >> 8)


class Fe(NamedTuple):
    """A frontend before ids are known."""

    key: int  # entries.fe_key
    kind: SetKind
    flags: int
    affinity: int
    rnat: int  # entries.ident of the address the replies must come from


def frontends(
    sp: ServicePort,
    node: NodeContext,
    config: Config,
    detector: LocalDetector,
    ip: Callable[[str], int] = ip_be,
    *,
    localhost: bool = True,
) -> list[Fe]:
    """The frontends of one service port, both scopes, before ids are known.

    INTERNAL frontends serve traffic from this node's pods, EXTERNAL ones any other, as the
    local-traffic detector `detector` tells them apart (see agent/localdetect.py). `ip`: an address
    as the entries hold it (the IPv6 planner's handles, agent/ebpf/family6.py); `localhost`: the
    localhost NodePorts may exist (IPv4 only: kube-proxy's IPv6 proxier has none)."""
    proto = sp.protocol.number
    affinity = sp.affinity_timeout
    base = int(FrontendFlag.AFFINITY) if affinity else 0
    out: list[Fe] = []

    # ClusterIP: the internal traffic policy, whatever the scope.
    kind: SetKind = "local" if sp.internal_policy_local else "cluster"
    local = int(FrontendFlag.LOCAL) if kind == "local" else 0
    # kube-proxy's KUBE-MARK-MASQ for the cluster IP masquerades whatever the backend.
    snat_int = int(FrontendFlag.SNAT_ALL) if config.masquerade_all else 0
    # ... and traffic that is not local (KUBE-SVC-*: IfNotLocal -> KUBE-MARK-MASQ): none without a
    # detector, as kube-proxy writes no such rule then.
    snat_ext = int(FrontendFlag.SNAT_ALL) if config.masquerade_all or detector.implemented else 0
    vip, port = ip(sp.cluster_ip), port_be(sp.port)
    rnat = ident(vip, port, proto)
    # A ClusterIP port the node itself listens on (NodeLocal DNSCache binds the kube-dns ClusterIP
    # on a dummy device) has no frontend: its packets reach the node's stack, which delivers them
    # to the listener, as node-local-dns's NOTRACK rules keep kube-proxy's DNAT off it. Once the
    # listener or the address goes, the frontend is back (the next sync that reads the node).
    if not node.listens_locally(sp.cluster_ip, sp.port, proto):
        for scope, snat in ((Scope.EXTERNAL, snat_ext), (Scope.INTERNAL, snat_int)):
            out.append(Fe(fe_key(vip, port, proto, int(scope)), kind, base | local | snat, affinity, rnat))

    # External frontends: ETP for traffic from outside, the cluster set for pods.
    externals: list[tuple[str, int, int]] = []
    if sp.node_port:
        externals += [
            (ip, sp.node_port, FrontendFlag.NODEPORT) for ip in node.nodeport_ips(config.nodeport_addresses)
        ]
    externals += [(ip, sp.port, FrontendFlag.EXTERNAL_IP) for ip in sp.external_ips]
    ranges = int(FrontendFlag.SOURCE_RANGES) if sp.load_balancer_source_ranges else 0
    snat_all, snat_keep_local = int(FrontendFlag.SNAT_ALL), int(FrontendFlag.SNAT_REMOTE)
    # Maglev chooses for traffic from outside only, as Cilium's loadBalancer.algorithm does.
    maglev = int(FrontendFlag.MAGLEV) if config.bpf_lb_algorithm == "maglev" else 0
    externals += [(ip, sp.port, FrontendFlag.LOADBALANCER | ranges) for ip in sp.load_balancer_ips]
    for addr_text, fe_port, what in externals:
        addr, p = ip(addr_text), port_be(fe_port)
        rnat = ident(addr, p, proto)
        pod_kind: SetKind = "cluster"
        if sp.external_policy_local:
            ext_kind: SetKind = "local"
            ext_flags = base | what | FrontendFlag.LOCAL
            # Pods reach every endpoint, untranslated (KUBE-EXT-*: IfLocal -> KUBE-SVC-*); without
            # a detector that rule is missing and pods are held to the local endpoints too. The
            # node itself reaches every endpoint whatever the detector (`--src-type LOCAL ->
            # KUBE-SVC-*`): without one its sockets get a frontend of their own (scope HOST).
            pod_flags = base | what
            if not detector.implemented:
                pod_kind, pod_flags = ext_kind, ext_flags | FrontendFlag.HOST_SCOPE
                host = base | what
                out.append(Fe(fe_key(addr, p, proto, int(Scope.HOST)), "cluster", int(host), affinity, rnat))
        else:
            # ETP Cluster: kube-proxy masquerades all of it (KUBE-EXT-* -> KUBE-MARK-MASQ), traffic
            # from pods included (KUBE-SERVICES sends it to the same KUBE-EXT-* chain); keeping
            # the client's address toward local backends is an explicit choice.
            ext_kind = "cluster"
            ext_flags = base | what | (snat_keep_local if config.bpf_keep_client_ip_local else snat_all)
            pod_flags = ext_flags
        out.append(
            Fe(fe_key(addr, p, proto, int(Scope.EXTERNAL)), ext_kind, int(ext_flags) | maglev, affinity, rnat)
        )
        out.append(Fe(fe_key(addr, p, proto, int(Scope.INTERNAL)), pod_kind, int(pod_flags), affinity, rnat))
    if sp.node_port and config.localhost_nodeports and localhost:
        # localhost:<nodePort> for the node's own processes (the socket programs; a pod's localhost
        # is its own): INTERNAL scope only, so nothing arriving from outside is ever translated for
        # 127.0.0.1 (CVE-2020-8558). kube-proxy sends it through KUBE-EXT-*: the cluster set.
        flags = base | FrontendFlag.NODEPORT
        if not sp.external_policy_local:
            flags |= snat_keep_local if config.bpf_keep_client_ip_local else snat_all
        addr, p = ip_be(LOCALHOST), port_be(sp.node_port)
        rnat = ident(addr, p, proto)
        out.append(Fe(fe_key(addr, p, proto, int(Scope.INTERNAL)), "cluster", int(flags), affinity, rnat))
    return out


def source_ranges(
    sp: ServicePort, node: NodeContext, ip: Callable[[str], int] = ip_be, version: int = 4
) -> list[tuple[int, int]]:
    """(prefix length, network address as `ip` gives it) the LB frontends of `sp` admit: the
    ranges of IP version `version` (each family's proxier takes its own, as kube-proxy's)."""
    out: list[tuple[int, int]] = []
    node_in_range = False
    for text in sp.load_balancer_source_ranges:
        net = ipaddress.ip_network(text, strict=False)
        if net.version != version:
            continue
        out.append((net.prefixlen, ip(str(net.network_address))))
        node_in_range = node_in_range or any(ipaddress.ip_address(ip) in net for ip in node.node_ips)
    if node_in_range:
        # kube-proxy: a VIP-like LB IP bound on the node loops back with itself as the source.
        full = 32 if version == 4 else 128
        out += [(full, ip(lb)) for lb in sp.load_balancer_ips]
    return out


def slots(members: Sequence[int], previous: Mapping[int, int]) -> list[int]:
    """The backends of one set in slot order (slot 1 first): survivors keep their slot when it is
    within the new count (`previous`: slot -> backend before), newcomers fill the gaps in order."""
    count = len(members)
    if not previous or all(previous.get(pos) == bid for pos, bid in enumerate(members, 1)):
        return list(members)  # nothing held, or held in this order (a restart's sets, nearly all)
    wanted = set(members)
    out = [0] * count
    placed: set[int] = set()
    for pos, bid in sorted(previous.items()):
        if 1 <= pos <= count and bid in wanted and bid not in placed:
            out[pos - 1] = bid
            placed.add(bid)
    fresh = iter([bid for bid in members if bid not in placed])
    return [bid or next(fresh) for bid in out]


def config_entry(node: NodeContext, config: Config, detector: LocalDetector | None = None) -> Value:
    """The config entry (codec tuple of abi.Config): the node's SNAT source, the SNAT port range,
    the conntrack timeouts (kube-proxy's conntrack settings where they say something, as iptables
    mode applies them to nf_conntrack; --bpf-ct-timeout-tcp-backend-gone for flows whose backend
    left), the reject rate limit and the flags: the host routing and, for a detector by source
    (ClusterCIDR, NodeCIDR), LOCAL_BY_SRC with its CIDR (the programs then pick the frontends'
    scope by source)."""
    lo, hi = config.snat_ports
    ct = config.conntrack
    net, plen, flags = 0, 0, 0
    if detector is not None and detector.by_source:
        cidr = ipaddress.IPv4Network(detector.cidr)
        net, plen, flags = ip_be(str(cidr.network_address)), cidr.prefixlen, int(ConfigFlag.LOCAL_BY_SRC)
    if config.bpf_host_routing is HostRouting.LEGACY:
        flags |= ConfigFlag.HOST_LEGACY
    return (
        ip_be(node.primary_ip) if node.primary_ip else 0,
        lo,
        hi,
        _seconds(ct.tcp_established_timeout_s, TCP_ESTABLISHED_TIMEOUT_S),
        _seconds(ct.tcp_close_wait_timeout_s, TCP_CLOSE_WAIT_TIMEOUT_S),
        TCP_SYN_TIMEOUT_S,
        TCP_CLOSED_TIMEOUT_S,
        _seconds(ct.udp_timeout_s, UDP_TIMEOUT_S),
        _seconds(ct.udp_stream_timeout_s, UDP_STREAM_TIMEOUT_S),
        ICMP_RATE,
        ICMP_BURST,
        net,
        plen,
        flags,
        _seconds(config.ct_tcp_backend_gone_timeout_s, TCP_ORPHAN_TIMEOUT_S),  # at most 65,535: the setting
    )


def _seconds(value: float, default: int) -> int:
    """A kube-proxy timeout in whole seconds; 0 ("leave it") becomes the default."""
    return max(1, round(value)) if value > 0 else default


def maglev_tables(
    fe: Mapping[int, int], slot: Mapping[int, int], be: Mapping[int, int]
) -> dict[int, tuple[tuple[str, ...], tuple[int, ...]]]:
    """The Maglev tables desired frontends need, from the desired entries (agent/ebpf/entries.py
    ints): set id -> (backend names, ids) in slot order (agent/ebpf/maglev.py wanted_tables)."""

    def slot_of(set_id: int, pos: int) -> int | None:
        return slot.get(slot_key(set_id, pos))

    def backend_of(bid: int) -> tuple[str, int] | None:
        v = be.get(bid)
        if v is None:
            return None
        return inet_ntoa((v & U32).to_bytes(4, "little")), port_host(v >> BE_PORT & U16)

    frontends_ = ((fe_set(v), fe_count(v), fe_flags(v)) for v in fe.values())
    return wanted_tables(frontends_, slot_of, backend_of)


def port_host(port: int) -> int:
    return ((port & 0xFF) << 8) | (port >> 8)
