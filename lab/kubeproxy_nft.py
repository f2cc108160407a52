"""kube-proxy's nftables mode, as an `nft -f` script, for the lab's switch tests.

This project has no nftables mode; to show that a node run by kube-proxy in nftables mode
switches to eBPF mode with its connections, the lab writes the table kube-proxy (v1.31+,
pkg/proxy/nftables/proxier.go) writes for the same Services: the `ip kube-proxy` table, its sets
and verdict maps (`cluster-ips`, `nodeport-ips`, `service-ips`, `service-nodeports`, the
no-endpoint and firewall maps), its base chains at kube-proxy's hooks and priorities, the
dispatch (`services`: `ip daddr . meta l4proto . th dport vmap @service-ips`), the masquerade
mark (0x4000) and `masquerading` chain, and per service port a `service-HASH-ns/name/proto/port`
chain (masquerade off-cluster sources, then `numgen random mod N vmap` to the endpoints), an
`external-...` chain for NodePorts (ETP Cluster: masquerade, then the service chain) and an
`endpoint-HASH-...__IP/PORT` chain per endpoint (hairpin masquerade, `dnat to`). The layout
follows upstream's TestOverallNFTablesRules text; the 8-character hashes in the chain names are
computed the way upstream's hashAndTruncate does (base32 of a SHA-256) over the chain's name,
not checked against upstream's exact input. Only what the lab's Services use is written (no
LoadBalancer IPs, source ranges or affinity).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NftPort:
    namespace: str
    name: str
    port_name: str
    protocol: str  # "tcp" | "udp"
    cluster_ip: str
    port: int
    endpoints: tuple[tuple[str, int], ...]
    node_port: int = 0


def _hash(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:8]


def _base(cluster_cidr: str, service_cidr: str, node_ips: Sequence[str]) -> list[str]:
    t = "ip kube-proxy"
    addr_map = "type ipv4_addr . inet_proto . inet_service : verdict"
    port_map = "type inet_proto . inet_service : verdict"
    lines = [
        f'add table {t} {{ comment "rules for kube-proxy" ; }}',
        f'add set {t} cluster-ips {{ type ipv4_addr ; comment "Active ClusterIPs" ; }}',
        f'add set {t} nodeport-ips {{ type ipv4_addr ; comment "IPs that accept NodePort traffic" ; }}',
        f'add map {t} firewall-ips {{ {addr_map} ; comment "destinations that are subject'
        f' to LoadBalancerSourceRanges" ; }}',
        f'add map {t} no-endpoint-nodeports {{ {port_map} ; comment "vmap to drop or'
        f' reject packets to service nodeports with no endpoints" ; }}',
        f'add map {t} no-endpoint-services {{ {addr_map} ; comment "vmap to drop or'
        f' reject packets to services with no endpoints" ; }}',
        f'add map {t} service-ips {{ {addr_map} ; comment "ClusterIP, ExternalIP and'
        f' LoadBalancer IP traffic" ; }}',
        f'add map {t} service-nodeports {{ {port_map} ; comment "NodePort traffic" ; }}',
        f"add chain {t} cluster-ips-check",
        f"add chain {t} filter-prerouting-pre-dnat {{ type filter hook prerouting priority -110 ; }}",
        f"add chain {t} filter-output-pre-dnat {{ type filter hook output priority -110 ; }}",
        f"add chain {t} filter-forward {{ type filter hook forward priority 0 ; }}",
        f"add chain {t} filter-input {{ type filter hook input priority 0 ; }}",
        f"add chain {t} filter-output {{ type filter hook output priority 0 ; }}",
        f"add chain {t} firewall-check",
        f"add chain {t} mark-for-masquerade",
        f"add chain {t} masquerading",
        f"add chain {t} nat-output {{ type nat hook output priority -100 ; }}",
        f"add chain {t} nat-postrouting {{ type nat hook postrouting priority 100 ; }}",
        f"add chain {t} nat-prerouting {{ type nat hook prerouting priority -100 ; }}",
        f"add chain {t} nodeport-endpoints-check",
        f'add chain {t} reject-chain {{ comment "helper for @no-endpoint-services /'
        f' @no-endpoint-nodeports" ; }}',
        f"add chain {t} services",
        f"add chain {t} service-endpoints-check",
        f'add rule {t} cluster-ips-check ip daddr @cluster-ips reject comment "Reject'
        f' traffic to invalid ports of ClusterIPs"',
        f'add rule {t} cluster-ips-check ip daddr {{ {service_cidr} }} drop comment "Drop'
        f' traffic to unallocated ClusterIPs"',
        f"add rule {t} filter-prerouting-pre-dnat ct state new jump firewall-check",
        f"add rule {t} filter-forward ct state new jump service-endpoints-check",
        f"add rule {t} filter-forward ct state new jump cluster-ips-check",
        f"add rule {t} filter-input ct state new jump nodeport-endpoints-check",
        f"add rule {t} filter-input ct state new jump service-endpoints-check",
        f"add rule {t} filter-output ct state new jump service-endpoints-check",
        f"add rule {t} filter-output-pre-dnat ct state new jump firewall-check",
        f"add rule {t} filter-output ct state new jump cluster-ips-check",
        f"add rule {t} firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips",
        f"add rule {t} mark-for-masquerade mark set mark or 0x4000",
        f"add rule {t} masquerading mark and 0x4000 == 0 return",
        f"add rule {t} masquerading mark set mark xor 0x4000",
        f"add rule {t} masquerading masquerade fully-random",
        f"add rule {t} nat-output jump services",
        f"add rule {t} nat-postrouting jump masquerading",
        f"add rule {t} nat-prerouting jump services",
        f"add rule {t} nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th"
        f" dport vmap @no-endpoint-nodeports",
        f"add rule {t} reject-chain reject",
        f"add rule {t} services ip daddr . meta l4proto . th dport vmap @service-ips",
        f"add rule {t} services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
        f"add rule {t} service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services",
    ]
    lines += [f"add element {t} nodeport-ips {{ {ip} }}" for ip in node_ips]
    return lines


def _port(sp: NftPort, cluster_cidr: str) -> list[str]:
    t = "ip kube-proxy"
    base = f"{sp.namespace}/{sp.name}/{sp.protocol}/{sp.port_name}"
    svc = f"service-{_hash('service-' + base)}-{base}"
    ext = f"external-{_hash('service-' + base)}-{base}"
    endpoint_chains = []
    for ip, port in sp.endpoints:
        name = f"{base}__{ip}/{port}"
        endpoint_chains.append((f"endpoint-{_hash('endpoint-' + name)}-{name}", ip, port))
    # A vmap names its chains: they exist first (kube-proxy's transaction adds every chain before
    # the rules that jump to it).
    lines = [f"add chain {t} {chain}" for chain, _, _ in endpoint_chains]
    lines.append(f"add chain {t} {svc}")
    lines.append(
        f"add rule {t} {svc} ip daddr {sp.cluster_ip} ip saddr != {cluster_cidr} jump mark-for-masquerade"
    )
    vmap = " , ".join(f"{i} : goto {chain}" for i, (chain, _, _) in enumerate(endpoint_chains))
    lines.append(f"add rule {t} {svc} numgen random mod {len(endpoint_chains)} vmap {{ {vmap} }}")
    if sp.node_port:
        lines += [
            f"add chain {t} {ext}",
            f"add rule {t} {ext} jump mark-for-masquerade",
            f"add rule {t} {ext} goto {svc}",
        ]
    for chain, ip, port in endpoint_chains:
        lines += [
            f"add rule {t} {chain} ip saddr {ip} jump mark-for-masquerade",
            f"add rule {t} {chain} meta l4proto {sp.protocol} dnat to {ip}:{port}",
        ]
    lines += [
        f"add element {t} cluster-ips {{ {sp.cluster_ip} }}",
        f"add element {t} service-ips {{ {sp.cluster_ip} . {sp.protocol} . {sp.port} : goto {svc} }}",
    ]
    if sp.node_port:
        lines.append(f"add element {t} service-nodeports {{ {sp.protocol} . {sp.node_port} : goto {ext} }}")
    return lines


def ruleset(
    ports: Sequence[NftPort], *, cluster_cidr: str, service_cidr: str, node_ips: Sequence[str]
) -> str:
    """The `nft -f` input kube-proxy's nftables mode would apply for `ports` on a node."""
    lines = _base(cluster_cidr, service_cidr, node_ips)
    for sp in ports:
        lines += _port(sp, cluster_cidr)
    return "\n".join(lines) + "\n"
