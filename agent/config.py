"""The agent's configuration: what the flags say, as one frozen value.

Flag names follow kube-proxy where the meaning is the same (`--hostname-override`,
`--cluster-cidr`, `--masquerade-all`, `--nodeport-addresses`, `--iptables-sync-period`, ...);
the eBPF-only knobs carry a `--bpf-` prefix as in Cilium. `NodeContext` holds what is learnt
at run time about the node (its addresses) and is passed to the pure planners beside the state.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum


class Mode(StrEnum):
    EBPF = "ebpf"
    IPTABLES = "iptables"


DEFAULT_PIN_PATH = "/sys/fs/bpf/ebpf-kube-proxy"
NODEPORT_PRIMARY = "primary"  # --nodeport-addresses keyword: the node's primary address
DEFAULT_POD_INTERFACES = "lxc*,veth*,cali*"


# Conntrack entries when kube-proxy's conntrack.maxPerCore is 0 ("leave the kernel's limit"):
# Cilium's --bpf-ct-global-tcp-max / --bpf-ct-global-any-max defaults.
FALLBACK_CT_TCP = 524288
FALLBACK_CT_ANY = 262144


@dataclass(frozen=True)
class MapSizes:
    """Maximum entries of the eBPF maps (kube-proxy scale by default).

    `ct_tcp` and `ct_any` (`--bpf-ct-global-tcp-max`, `--bpf-ct-global-any-max`) are 0 by default:
    derived at start (`with_conntrack`) from kube-proxy's conntrack settings, as nf_conntrack_max
    is in iptables mode, or kept at the size of the tables already pinned.
    """

    fe: int = 65536
    slot: int = 262144
    be: int = 262144  # one per endpoint address:port: 10,000 services of 10 endpoints need 100,000
    rnat: int = 65536
    member: int = 262144
    ct_tcp: int = 0
    ct_any: int = 0
    frag: int = 8192
    aff: int = 65536
    srcr: int = 16384

    def with_conntrack(
        self, conntrack: ConntrackSettings, cpus: int, pinned: Mapping[str, int] | None = None
    ) -> MapSizes:
        """Concrete conntrack sizes: as set; else the size of the pinned table (a restart must not
        resize, which would mean a new table and every flow lost); else derived from kube-proxy's
        getConntrackMax, max(maxPerCore x CPUs, min) flows. Each flow takes two entries (one per
        direction), so ct_tcp holds 2 x that and ct_any (UDP, SCTP) as many again as flows,
        the half Cilium gives its non-TCP table."""
        flows = conntrack_max(conntrack, cpus)
        derived = {
            "ct_tcp": 2 * flows if flows else FALLBACK_CT_TCP,
            "ct_any": flows if flows else FALLBACK_CT_ANY,
        }
        held = pinned or {}
        sizes = {
            role: getattr(self, role) or held.get(role, 0) or derived[role] for role in ("ct_tcp", "ct_any")
        }
        return replace(self, **sizes)


def conntrack_max(conntrack: ConntrackSettings, cpus: int) -> int:
    """kube-proxy's getConntrackMax (cmd/kube-proxy/app/server_linux.go): max(maxPerCore x CPUs,
    min) when maxPerCore > 0, else 0 (leave the kernel's value)."""
    if conntrack.max_per_core <= 0:
        return 0
    return max(conntrack.max_per_core * cpus, conntrack.min)


@dataclass(frozen=True)
class ConntrackSettings:
    """kube-proxy's `conntrack` configuration (KubeProxyConfiguration.conntrack), in seconds.

    iptables mode writes them to the node's nf_conntrack sysctls as kube-proxy does; eBPF mode
    applies the same timeouts to the flows its own conntrack tracks. 0 leaves a value unchanged.
    """

    max_per_core: int = 32768
    min: int = 131072
    tcp_established_timeout_s: float = 86400.0
    tcp_close_wait_timeout_s: float = 3600.0
    tcp_be_liberal: bool = False
    udp_timeout_s: float = 0.0
    udp_stream_timeout_s: float = 0.0


@dataclass(frozen=True)
class Config:
    mode: Mode = Mode.EBPF
    hostname: str = ""
    services_file: str = ""
    kubeconfig: str = ""  # --kubeconfig; "" = in-cluster service account, else --master
    master: str = ""  # --master: API server URL (overrides the kubeconfig's server)
    healthz_bind_address: str = "0.0.0.0:10256"  # "" disables; bound in `netns`
    metrics_bind_address: str = "127.0.0.1:10249"  # "" disables; bound in `netns`
    bind_address_hard_fail: bool = False  # a healthz/metrics port that cannot be bound stops the agent
    conntrack: ConntrackSettings = field(default_factory=ConntrackSettings)
    netns: str = ""  # network namespace the agent programs; "" = its own
    dry_run: bool = False
    cleanup: bool = False
    cleanup_kube_proxy: bool = False  # remove what a previous kube-proxy left, then exit
    cluster_cidr: tuple[str, ...] = ()
    masquerade_all: bool = False
    masquerade_bit: int = 14
    nodeport_addresses: tuple[str, ...] = ()  # CIDRs and/or "primary"; () = every node address
    node_ips: tuple[str, ...] = ()  # --node-ip: the node's addresses; () = found on --devices
    sync_period_s: float = 30.0
    min_sync_period_s: float = 1.0
    # eBPF mode
    devices: tuple[str, ...] = ()  # external devices; () = those holding the node's addresses
    pod_interfaces: tuple[str, ...] = tuple(DEFAULT_POD_INTERFACES.split(","))
    pin_path: str = DEFAULT_PIN_PATH
    map_sizes: MapSizes = field(default_factory=MapSizes)
    snat_ports: tuple[int, int] = (61000, 65535)  # above the kernel's ephemeral 32768-60999
    nodeport_range: tuple[int, int] = (30000, 32767)  # --node-port-range: the apiserver's NodePort range
    # --bpf-keep-client-ip-for-local-backends: externalTrafficPolicy Cluster traffic to a backend on
    # this node keeps the client's address (kube-proxy masquerades it; off by default)
    bpf_keep_client_ip_local: bool = False
    # iptables mode
    iptables_backend: str = "auto"  # auto | nft | legacy
    iptables_localhost_nodeports: bool = True  # NodePorts answer on 127.0.0.1 too (route_localnet)


@dataclass(frozen=True)
class NodeContext:
    """Facts about the node found at run time, inputs to the pure planners."""

    node_ips: tuple[str, ...] = ()  # IPv4 addresses of the node (its external devices)
    primary_ip: str = ""  # the address used as SNAT source toward other nodes

    def nodeport_ips(self, cidrs: tuple[str, ...]) -> tuple[str, ...]:
        """Node addresses NodePorts answer on: all of them, or those inside `cidrs`; the keyword
        `primary` (kube-proxy's `--nodeport-addresses primary`) selects the primary address."""
        if not cidrs:
            return self.node_ips
        nets = [ipaddress.ip_network(c, strict=False) for c in cidrs if c != NODEPORT_PRIMARY]
        primary = NODEPORT_PRIMARY in cidrs
        return tuple(
            ip
            for ip in self.node_ips
            if any(ipaddress.ip_address(ip) in n for n in nets) or (primary and ip == self.primary_ip)
        )
