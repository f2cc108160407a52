"""The agent's configuration: what the flags say, as one frozen value.

Flag names follow kube-proxy where the meaning is the same (`--hostname-override`,
`--cluster-cidr`, `--masquerade-all`, `--nodeport-addresses`, `--iptables-sync-period`, ...);
the eBPF-only knobs carry a `--bpf-` prefix as in Cilium. `NodeContext` holds what is learnt
at run time about the node (its addresses) and is passed to the pure planners beside the state.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.localdetect import LocalDetector, LocalMode, local_detector
from agent.settings.kinds import NODEPORT_PRIMARY
from agent.settings.table import BY_NAME, DEFAULT_PIN_PATH, SETTINGS, HostRouting, Mode, default

__all__ = [
    "DEFAULT_PIN_PATH",
    "NODEPORT_PRIMARY",
    "Config",
    "ConntrackSettings",
    "HostRouting",
    "MapSizes",
    "Mode",
]

EBPF_MIN_SYNC_PERIOD_S = 0.1
IPTABLES_MIN_SYNC_PERIOD_S = 1.0  # kube-proxy's default


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

    fe: int = default("map_sizes.fe")
    slot: int = default("map_sizes.slot")
    be: int = default("map_sizes.be")
    rnat: int = default("map_sizes.rnat")
    member: int = default("map_sizes.member")
    ct_tcp: int = default("map_sizes.ct_tcp")
    ct_any: int = default("map_sizes.ct_any")
    frag: int = default("map_sizes.frag")
    # fragments that came before their first, held until it comes (1.5 KiB each)
    fraghold: int = default("map_sizes.fraghold")
    aff: int = default("map_sizes.aff")
    srcr: int = default("map_sizes.srcr")
    # frontend and backend addresses (entries allocated as written; 4 MiB of hash buckets)
    addr: int = default("map_sizes.addr")
    # Maglev tables (one per backend set of a Maglev frontend, allocated as written) and their size
    maglev: int = default("map_sizes.maglev")
    maglev_table_size: int = default("map_sizes.maglev_table_size")
    # legacy host routing: the source each translated flow direction gets at egress
    hostnat: int = default("map_sizes.hostnat")
    sknat: int = default("map_sizes.sknat")
    # bridge ports of pods (ekp_port_v2: one entry per port, allocated as written)
    port: int = default("map_sizes.port")
    # Whether the tc programs' IPv6 path serves (Config.tc_ipv6 and an IPv6 half runs): its
    # conntrack tables then take their IPv4 twins' sizes and the program array ekp_calls6 is
    # filled; else each table holds one entry (no preallocated memory for a path nothing runs)
    # and IPv6 packets stop at the IPv4 programs' parser.
    ipv6_tc: bool = True
    # Whether the XDP programs (ekp_xdp_net, and its IPv6 path ekp_xdp_net6 behind ekp_xcalls6
    # where ipv6_tc is) are loaded: only when XDP may attach (--bpf-xdp not disabled), else their
    # verification (~160 ms of a cold start for the IPv4 one, ~250 ms for the IPv6 one) is on the
    # first sync's path and buys nothing. A start that changes it is another load id of the same
    # build, as ipv6_tc's.
    xdp: bool = True

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
        sizes: dict[str, int] = {
            role: getattr(self, role) or held.get(role, 0) or derived[role] for role in ("ct_tcp", "ct_any")
        }
        return replace(self, ct_tcp=sizes["ct_tcp"], ct_any=sizes["ct_any"])


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

    max_per_core: int = default("conntrack.max_per_core")
    min: int = default("conntrack.min")
    tcp_established_timeout_s: float = default("conntrack.tcp_established_timeout_s")
    tcp_close_wait_timeout_s: float = default("conntrack.tcp_close_wait_timeout_s")
    tcp_be_liberal: bool = default("conntrack.tcp_be_liberal")
    udp_timeout_s: float = default("conntrack.udp_timeout_s")
    udp_stream_timeout_s: float = default("conntrack.udp_stream_timeout_s")


@dataclass(frozen=True)
class Config:
    """What the settings say, typed, for the code that acts on them. Each field's default is the
    setting's (agent/settings/table.py); `hostname` and `min_sync_period_s` are derived
    (`from_values`)."""

    mode: Mode = default("mode")
    hostname: str = ""  # --hostname-override, else the host name (derived)
    services_file: str = default("services_file")
    kubeconfig: str = default("kubeconfig")  # "" = in-cluster service account, else --master
    master: str = default("master")
    api_qps: float = default("api_qps")  # client-go: 0 = 5, negative = no limit
    api_burst: int = default("api_burst")  # client-go: 0 = 10
    api_content_type: str = default("api_content_type")
    config_sync_period_s: float = default("config_sync_period_s")
    feature_gates: tuple[tuple[str, bool], ...] = default("feature_gates")
    oom_score_adj: int = default("oom_score_adj")
    healthz_bind_address: str = default("healthz_bind_address")  # "" disables; bound in `netns`
    metrics_bind_address: str = default("metrics_bind_address")  # "" disables; bound in `netns`
    bind_address_hard_fail: bool = default("bind_address_hard_fail")
    conntrack: ConntrackSettings = field(default_factory=lambda: ConntrackSettings())
    netns: str = default("netns")  # network namespace the agent programs; "" = its own
    dry_run: bool = default("dry_run")
    cleanup: bool = default("cleanup")
    cleanup_kube_proxy: bool = default("cleanup_kube_proxy")
    init_only: bool = default("init_only")
    cluster_cidr: tuple[str, ...] = default("cluster_cidr")
    service_cidrs: tuple[str, ...] = default("service_cidrs")
    external_ip_cidrs: tuple[str, ...] = default("external_ip_cidrs")  # () = any address
    detect_local_mode: LocalMode = default("detect_local_mode")
    pod_bridge_interface: str = default("pod_bridge_interface")
    pod_interface_name_prefix: str = default("pod_interface_name_prefix")
    masquerade_all: bool = default("masquerade_all")
    masquerade_bit: int = default("masquerade_bit")
    nodeport_addresses: tuple[str, ...] = default("nodeport_addresses")  # () = every node address
    node_ips: tuple[str, ...] = default("node_ips")  # () = found on --devices
    sync_period_s: float = default("sync_period_s")
    min_sync_period_s: float = IPTABLES_MIN_SYNC_PERIOD_S  # derived from the mode when not set
    # eBPF mode
    devices: tuple[str, ...] = default("devices")  # () = those holding the node's addresses
    pod_interfaces: tuple[str, ...] = default("pod_interfaces")
    pin_path: str = default("pin_path")
    map_sizes: MapSizes = field(default_factory=lambda: MapSizes())
    snat_ports: tuple[int, int] = default("snat_ports")  # above the kernel's ephemeral 32768-60999
    nodeport_range: tuple[int, int] = default("nodeport_range")
    bpf_keep_client_ip_local: bool = default("bpf_keep_client_ip_local")
    bpf_xdp: str = default("bpf_xdp")
    bpf_tc_attach: str = default("bpf_tc_attach")  # auto | tcx | clsact (agent/ebpf/tcx.py)
    bpf_lb_algorithm: str = default("bpf_lb_algorithm")
    bpf_host_routing: HostRouting = default("bpf_host_routing")  # bpf/ekp_host.h
    socket_lb: bool = default("socket_lb")  # cgroup socket programs for the node's own sockets
    socket_lb_cgroup: str = default("socket_lb_cgroup")  # "" = the root of the cgroup2 mount
    socket_lb_host_only: bool = default("socket_lb_host_only")
    ct_tcp_backend_gone_timeout_s: float = default("ct_tcp_backend_gone_timeout_s")
    # iptables mode
    iptables_backend: str = default("iptables_backend")  # auto | nft | legacy
    iptables_localhost_nodeports: bool = default("iptables_localhost_nodeports")

    @property
    def localhost_nodeports(self) -> bool:
        """Whether NodePorts answer on 127.0.0.1 for the node's own processes, in both modes:
        kube-proxy's `--iptables-localhost-nodeports` (true by default) when --nodeport-addresses
        selects every address or holds a loopback one (`cidr.IP.IsLoopback() ||
        cidr.Contains(127.0.0.0)`, proxy/util/nodeport_addresses.go); IPv6 never."""
        return self.iptables_localhost_nodeports and nodeport_addresses_hold_loopback(self.nodeport_addresses)

    def local_detector(self, node_pod_cidrs: Iterable[str] = (), family: int = 4) -> LocalDetector:
        """kube-proxy's local-traffic detector for the proxier of IP version `family`;
        `node_pod_cidrs` (the Node's spec.podCIDRs) is what NodeCIDR reads."""
        return local_detector(
            self.detect_local_mode,
            cluster_cidrs=self.cluster_cidr,
            node_pod_cidrs=node_pod_cidrs,
            bridge_interface=self.pod_bridge_interface,
            interface_name_prefix=self.pod_interface_name_prefix,
            family=family,
        )

    def node_ips_of(self, family: int) -> tuple[str, ...]:
        """The `--node-ip` addresses of IP version `family`."""
        return tuple(ip for ip in self.node_ips if (":" in ip) == (family == 6))

    @property
    def min_sync_period6_s(self) -> float:
        """The IPv6 proxier's floor (ip6tables in both modes). iptables mode: the IPv4 proxier's,
        as upstream's two proxiers share minSyncPeriod. eBPF mode: at least kube-proxy's 1 s
        default, or --iptables-min-sync-period when larger: the value there is tuned for the eBPF
        map writes (100 ms by default), and an ip6tables-restore rewrites the top-level chains at
        every call."""
        if self.mode is Mode.IPTABLES:
            return self.min_sync_period_s
        return max(self.min_sync_period_s, IPTABLES_MIN_SYNC_PERIOD_S)

    @property
    def ipv6_configured(self) -> bool:
        """Whether the flags describe IPv6 for this node (an IPv6 --node-ip, --cluster-cidr or
        --service-cluster-ip-range): iptables mode then runs an IPv6 proxier beside the IPv4 one
        (kube-proxy's metaproxier). Upstream runs both whenever ip6tables works; here the
        operator says so, so an IPv4-only node gets no ip6tables rules it never asked for."""
        return any(":" in text for text in (*self.node_ips, *self.cluster_cidr, *self.service_cidrs))

    @property
    def loads_xdp(self) -> bool:
        """Whether the data path may load its XDP programs (MapSizes.xdp): unless
        --bpf-xdp=disabled, where nothing would run them. Under best-effort the proxier's load
        and `agent doctor` (which warns about XDP helpers only where they are loaded) also look
        at the external devices: none loaded where every one is a veth (agent.ebpf.xdp
        loads_programs)."""
        return self.bpf_xdp != "disabled"

    @property
    def tc_ipv6(self) -> bool:
        """Whether the tc programs' IPv6 path serves (bpf/ekp_tc6.h; MapSizes.ipv6_tc): eBPF mode,
        IPv6 in the flags, socket-level load balancing (the eBPF IPv6 half, which writes the IPv6
        maps the path reads, exists only with it: agent/app.py make_proxier6), in either host
        routing (legacy: ekp_host6.h, the source at egress as IPv4's). The settings decide, ANDed
        by EbpfProxier with whether the node runs an IPv6 half (agent/app.py serves_ipv6, asked
        once before the early load, which may start before the IPv6 proxier is made): a node that
        falls back to single-stack (no ip6tables) gets no tc IPv6 path, no full-size IPv6
        conntrack tables and no filled ekp_calls6."""
        return self.mode is Mode.EBPF and self.ipv6_configured and self.socket_lb

    def gate(self, name: str, default: bool) -> bool:
        """A feature gate's value: as --feature-gates / featureGates set it, else `default`."""
        return dict(self.feature_gates).get(name, default)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> Config:
        """The Config of resolved settings (agent/settings/resolve.py): each setting with an
        `attr` lands there; nested attrs (`conntrack.min`) in their dataclass."""
        flat: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {"conntrack": {}, "map_sizes": {}}
        for setting in SETTINGS:
            if not setting.attr:
                continue
            value = values[setting.name]
            if setting.into is not None:
                value = setting.into(value)
            head, _, leaf = setting.attr.partition(".")
            if leaf:
                nested[head][leaf] = value
            else:
                flat[head] = value
        mode = Mode(flat["mode"])
        # --healthz-port / --metrics-port (deprecated upstream): 0 turns the server off.
        for port, address in (
            ("healthz_port", "healthz_bind_address"),
            ("metrics_port", "metrics_bind_address"),
        ):
            if values[port] == 0:
                flat[address] = ""
        min_sync = values[BY_NAME["iptables_min_sync_period"].name]
        return cls(
            **flat,
            hostname=(values["hostname_override"] or socket.gethostname()).strip().lower(),
            min_sync_period_s=default_min_sync_period(mode) if min_sync is None else min_sync,
            conntrack=ConntrackSettings(**nested["conntrack"]),
            map_sizes=MapSizes(**nested["map_sizes"]),
        )


def nodeport_addresses_of(cidrs: tuple[str, ...], version: int) -> tuple[str, ...] | None:
    """The --nodeport-addresses entries one IP family's proxier takes (upstream's
    NewNodePortAddresses(family, ...)): its own CIDRs and `primary`; None when that family matches
    every address (none of its CIDRs given, or 0.0.0.0/0 or ::/0 among them)."""
    own = []
    for text in cidrs:
        if text == NODEPORT_PRIMARY:
            own.append(text)
            continue
        try:
            net = ipaddress.ip_network(text.strip(), strict=False)
        except ValueError:
            continue
        if net.version == version:
            if net.prefixlen == 0:
                return None
            own.append(text)
    return tuple(own) or None


def nodeport_addresses_hold_loopback(cidrs: tuple[str, ...]) -> bool:
    """Whether --nodeport-addresses `cidrs` let NodePorts answer on 127.0.0.1: every address (no
    IPv4 CIDR given, or 0.0.0.0/0; never with `primary`), or a CIDR that is loopback or holds
    127.0.0.0 (upstream's test)."""
    if NODEPORT_PRIMARY in cidrs:
        return False
    nets = []
    for text in cidrs:
        try:
            net = ipaddress.ip_network(text.strip(), strict=False)
        except ValueError:
            continue
        if isinstance(net, ipaddress.IPv4Network):
            nets.append(net)
    if not nets or any(n.prefixlen == 0 for n in nets):
        return True
    start = ipaddress.IPv4Address("127.0.0.0")
    return any(n.network_address.is_loopback or start in n for n in nets)


def default_min_sync_period(mode: Mode) -> float:
    """kube-proxy's 1 s in iptables mode; 100 ms in eBPF mode, where a sync writes only the map
    entries that changed: the floor still turns a burst of events (a rollout) into one sync."""
    return IPTABLES_MIN_SYNC_PERIOD_S if mode is Mode.IPTABLES else EBPF_MIN_SYNC_PERIOD_S


@dataclass(frozen=True)
class NodeContext:
    """Facts about the node found at run time, inputs to the pure planners."""

    node_ips: tuple[str, ...] = ()  # IPv4 addresses of the node (its external devices)
    primary_ip: str = ""  # the address used as SNAT source toward other nodes
    # (address, port, protocol) the node itself listens on, on an address of its own other than
    # node_ips (NodeLocal DNSCache on the kube-dns ClusterIP): eBPF mode leaves such a ClusterIP
    # port to the local listener, as node-local-dns's NOTRACK rules do in iptables mode.
    local_listeners: frozenset[tuple[str, int, int]] = frozenset()

    def listens_locally(self, address: str, port: int, protocol: int) -> bool:
        return (address, port, protocol) in self.local_listeners

    def nodeport_ips(self, cidrs: tuple[str, ...], *, loopback: bool = False) -> tuple[str, ...]:
        """Node addresses NodePorts answer on: all of them, or those inside `cidrs`; the keyword
        `primary` (kube-proxy's `--nodeport-addresses primary`) selects the primary address.
        `loopback`: 127.0.0.1 first when a CIDR holds it (upstream's order, as `lo` is the first
        interface), for the iptables rules and the healthCheckNodePort listeners. The one
        implementation of the selection: both modes and the health servers call it."""
        if not cidrs:
            return self.node_ips
        nets = []
        for c in cidrs:
            if c == NODEPORT_PRIMARY:
                continue
            try:
                nets.append(ipaddress.ip_network(c, strict=False))
            except ValueError:
                continue  # checked where the flag is read; nothing to match here
        primary = NODEPORT_PRIMARY in cidrs
        out = ["127.0.0.1"] if loopback and any(ipaddress.ip_address("127.0.0.1") in n for n in nets) else []
        out += [
            ip
            for ip in self.node_ips
            if any(ipaddress.ip_address(ip) in n for n in nets) or (primary and ip == self.primary_ip)
        ]
        return tuple(dict.fromkeys(out))
