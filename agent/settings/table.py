"""Every setting of the agent, once: flag names, KubeProxyConfiguration path, Config attribute,
kind (parser and validator), default, help, and whether it applies.

Everything else is generated from `SETTINGS`: the argparse flags (agent/settings/flags.py), the
config-file reader's field schema and `--write-config-to`'s document (agent/configfile.py), the
typed `Config` and its defaults (agent/config.py: `default(attr)`), and the README's flag table
(`python -m agent.settings.readme`, checked by tests/agent/test_settings.py).

The flags are kube-proxy's (v1.31, the list in tests/agent/test_settings.py), so a kube-proxy
command line starts the agent: those that apply do what kube-proxy does; those that cannot
(IPVS, profiling, klog) are accepted, and one log line says each one given is ignored and why
(`ignored`). The agent's own flags (`--bpf-*`, `--node-ip`, `--devices`, ...) have no file
field.

How to add a setting
--------------------
1. Add one `Setting(...)` to `SETTINGS` below, in the README section (`group`) it belongs to:
   `name` (the key in the resolved values, also the argparse dest), `flags` (none for a
   file-only field), `path` (the v1alpha1 field, "" for a flag of the agent's own), `kind`
   (agent/settings/kinds.py: Bool, Int(lo, hi), Duration, StrList(check), ...), `default`, `help`,
   and either `attr` (where the behaviour reads it) or `ignored` (why it does not apply).
2. If it has an `attr`, add the typed field to `Config` in agent/config.py as
   `name: type = default("attr")` (the default stays here; nested attrs such as
   `conntrack.min` go to the nested dataclass).
3. Run `python -m agent.settings.readme` to regenerate the README's flag table.
The flag, the file field, `--write-config-to`, `/configz` and the README then follow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from agent.ebpf.abi import MAPS
from agent.localdetect import LOCAL_MODES, local_mode
from agent.settings.kinds import (
    BindAddress,
    Bool,
    BoolMap,
    Choice,
    Duration,
    Float,
    Int,
    IPAddress,
    Kind,
    Opaque,
    PortRange,
    Prime,
    StrList,
    Text,
    cidr_list,
    nodeport_addresses,
)

HEALTHZ_PORT = 10256
METRICS_PORT = 10249
DEFAULT_PIN_PATH = "/sys/fs/bpf/ebpf-kube-proxy"
DEFAULT_POD_INTERFACES = ("lxc*", "veth*", "cali*")
PROTOBUF = "application/vnd.kubernetes.protobuf"


class Mode(StrEnum):
    EBPF = "ebpf"
    IPTABLES = "iptables"


class HostRouting(StrEnum):
    """--bpf-host-routing: how eBPF mode delivers a translated packet (bpf/ekp_host.h)."""

    LEGACY = "legacy"  # through the node's stack: netfilter and rp_filter see it
    BPF = "bpf"  # redirected past the stack


MAP_SIZE_ROLES = (
    "fe",
    "slot",
    "be",
    "rnat",
    "member",
    "ct_tcp",
    "ct_any",
    "frag",
    "fraghold",
    "aff",
    "srcr",
    "addr",
    "maglev",
    "hostnat",
    "sknat",
    "port",
)


@dataclass(frozen=True)
class Setting:
    name: str  # key of the resolved values and argparse dest
    kind: Kind
    default: Any
    help: str
    flags: tuple[str, ...] = ()  # command-line names, first is the main one
    path: str = ""  # KubeProxyConfiguration v1alpha1 field ("iptables.syncPeriod"); "" = flag only
    attr: str = ""  # Config attribute the behaviour reads ("conntrack.min"); "" = read elsewhere
    ignored: str = ""  # why it does not apply ("" = it applies)
    into: Callable[[Any], Any] | None = None  # value -> Config attribute type (e.g. Mode)
    group: str = ""  # README section
    # When --write-config-to writes the field: "always"; "omitempty" (Go's tag: not when empty or
    # false); "given" (only when the file set it: fields upstream's writer does not emit).
    written: str = "always"

    @property
    def applies(self) -> bool:
        return not self.ignored

    @property
    def flag(self) -> str:
        return self.flags[0] if self.flags else ""


# README sections, in order.
SOURCE = "Source, configuration, actions"
API = "API client"
HEALTH = "Health and metrics"
NODE = "Node and addresses"
SYNC = "Syncs and iptables mode"
CONNTRACK = "Conntrack"
EBPF = "eBPF mode"
LOGGING = "Logging"
NOT_APPLICABLE = "Accepted, not applied"
GROUPS = (SOURCE, API, HEALTH, NODE, SYNC, CONNTRACK, EBPF, LOGGING, NOT_APPLICABLE)

NA_IPVS = "IPVS mode is not implemented by this agent"
NA_NFT = "nftables mode is not implemented by this agent"
NA_WIN = "Windows settings"
NA_LOG = "the agent logs plain text to stderr through Python's logging"
NA_KLOG = (
    "klog's own flags, which kube-proxy stopped registering in v1.26 (its v1.31 reference page still "
    "lists them); the agent logs to stderr"
)


def _hostname(text: str) -> str:
    return text.strip().lower()


class _FileMode(Choice):
    """`mode: ""` in a file means this agent's default (eBPF), not kube-proxy's iptables."""

    def file(self, raw: Any) -> Any:
        if raw == "":
            return None
        return super().file(raw)


MODE = _FileMode(
    ("ebpf", "iptables"),
    file_hint='unsupported value; supported values: "", "ebpf", "iptables" ("" means ebpf here; '
    "ipvs, nftables and kernelspace are not implemented by this agent)",
    metavar="ebpf|iptables",
)


class _DetectLocalMode(Choice):
    """pflag takes any text for kube-proxy's LocalMode and validation refuses the unknown; "" (in
    a file or a flag) is the default, ClusterCIDR."""

    def flag(self, text: str) -> Any:
        return "" if text == "" else super().flag(text)

    def file(self, raw: Any) -> Any:
        if raw == "":
            return ""
        return super().file(raw)


class _FlushFrequency(Duration):
    """logging.flushFrequency: a duration string or whole nanoseconds (TimeOrMetaDuration)."""

    def file(self, raw: Any) -> Any:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw / 1e9
        return super().file(raw)


class _Version(Kind):
    """`--version`, `--version=raw` or `--version=vX.Y.Z` (verflag): print the version, exit."""

    boolean = True
    metavar = "true|raw"

    def flag(self, text: str) -> Any:
        return "" if text in ("false", "0", "f", "F", "FALSE", "False") else text


def _map_size(role: str) -> Setting:
    spec = MAPS[role]
    if spec.default_size == 0:
        help_ = (
            f"entries of map {spec.name}: derived from kube-proxy's conntrack max, "
            "max(conntrack-max-per-core x CPUs, conntrack-min) flows, 2 entries each for TCP, 1 for the "
            "rest (524288 / 262144 with --conntrack-max-per-core=0); a pinned table keeps its size"
        )
    else:
        help_ = f"entries of map {spec.name}"
    return Setting(
        f"bpf_{role}_max",
        Int(lo=1),
        spec.default_size,
        help_,
        flags=(spec.size_flag,),
        attr=f"map_sizes.{role}",
        group=EBPF,
    )


def _ignored(
    name: str,
    kind: Kind,
    default: Any,
    why: str,
    *,
    flags: tuple[str, ...] = (),
    path: str = "",
    written: str = "always",
) -> Setting:
    return Setting(
        name, kind, default, why, flags=flags, path=path, ignored=why, group=NOT_APPLICABLE, written=written
    )


SETTINGS: tuple[Setting, ...] = (
    # ---------------------------------------------------------------- source, configuration, actions
    Setting(
        "mode",
        MODE,
        "ebpf",
        'data path: ebpf, or iptables (kube-proxy\'s iptables layout); `mode: ""` in a file is ebpf',
        flags=("--mode", "--proxy-mode"),
        path="mode",
        attr="mode",
        into=Mode,
        group=SOURCE,
    ),
    Setting(
        "hostname_override",
        Text(_hostname),
        "",
        "name of the node the agent acts for (default: the host name): which endpoints are local, "
        "which Node to watch",
        flags=("--hostname-override",),
        path="hostnameOverride",
        group=SOURCE,
    ),
    Setting(
        "kubeconfig",
        Text(metavar="FILE"),
        "",
        "kubeconfig of the API server (default: the pod's service account)",
        flags=("--kubeconfig",),
        path="clientConnection.kubeconfig",
        attr="kubeconfig",
        group=SOURCE,
    ),
    Setting(
        "master",
        Text(metavar="URL"),
        "",
        "API server URL (overrides the kubeconfig's server)",
        flags=("--master",),
        attr="master",
        group=SOURCE,
    ),
    Setting(
        "services_file",
        Text(metavar="FILE"),
        "",
        "YAML file of Services and EndpointSlices to follow instead of an API server",
        flags=("--services-file",),
        attr="services_file",
        group=SOURCE,
    ),
    Setting(
        "config",
        Text(metavar="FILE"),
        "",
        "kube-proxy's KubeProxyConfiguration file (v1alpha1); flags given on the command line win",
        flags=("--config",),
        group=SOURCE,
    ),
    Setting(
        "write_config_to",
        Text(metavar="FILE"),
        "",
        "write the effective configuration there (v1alpha1) and exit",
        flags=("--write-config-to",),
        group=SOURCE,
    ),
    Setting(
        "cleanup",
        Bool(),
        False,
        "remove every rule, program, map and pin of both modes, then exit; refused while an agent runs "
        "for the node",
        flags=("--cleanup",),
        attr="cleanup",
        group=SOURCE,
    ),
    Setting(
        "cleanup_kube_proxy",
        Bool(),
        False,
        "remove what a previous kube-proxy left (its KUBE-* chains in both iptables backends, its "
        "nftables tables), then exit. An eBPF-mode agent does this itself once its programs serve, "
        "after carrying kube-proxy's established flows over; run before the agent, new connections "
        "fail until it serves",
        flags=("--cleanup-kube-proxy",),
        attr="cleanup_kube_proxy",
        group=SOURCE,
    ),
    Setting(
        "init_only",
        Bool(),
        False,
        "do the node set-up that needs full privileges (sysctls of the mode; bpffs in eBPF mode), "
        "then exit, as kube-proxy's privileged init container",
        flags=("--init-only",),
        attr="init_only",
        group=SOURCE,
    ),
    Setting(
        "dry_run",
        Bool(),
        False,
        "print what would be written for --services-file, then exit (no root)",
        flags=("--dry-run",),
        attr="dry_run",
        group=SOURCE,
    ),
    Setting(
        "feature_gates",
        BoolMap(),
        {},
        "Kubernetes feature gates (Name=true,Other=false); those that change proxy behaviour are "
        "honoured where the agent has the behaviour, the rest accepted and logged once",
        flags=("--feature-gates",),
        path="featureGates",
        attr="feature_gates",
        written="omitempty",
        into=lambda gates: tuple(sorted(gates.items())),
        group=SOURCE,
    ),
    Setting(
        "oom_score_adj",
        Int(lo=-1000, hi=1000),
        -999,
        "written to /proc/self/oom_score_adj at start, as kube-proxy (range [-1000, 1000])",
        flags=("--oom-score-adj",),
        path="oomScoreAdj",
        attr="oom_score_adj",
        group=SOURCE,
    ),
    Setting(
        "version",
        _Version(),
        "",
        "print the agent's version and exit",
        flags=("--version",),
        group=SOURCE,
    ),
    # ---------------------------------------------------------------------------- API client
    Setting(
        "kube_api_qps",
        Float(),
        5.0,
        "requests per second to the API server, as client-go's token bucket (0: 5; negative: no limit)",
        flags=("--kube-api-qps",),
        path="clientConnection.qps",
        attr="api_qps",
        group=API,
    ),
    Setting(
        "kube_api_burst",
        Int(lo=0),
        10,
        "requests the API client may send at once before --kube-api-qps paces them (0: 10)",
        flags=("--kube-api-burst",),
        path="clientConnection.burst",
        attr="api_burst",
        group=API,
    ),
    Setting(
        "kube_api_content_type",
        Text(),
        PROTOBUF,
        "content type of requests: the Python client reads and writes JSON only, so any value is "
        "served as application/json (a value other than these two is logged once)",
        flags=("--kube-api-content-type",),
        path="clientConnection.contentType",
        attr="api_content_type",
        group=API,
    ),
    Setting(
        "config_sync_period",
        Duration(positive=True),
        900.0,
        "how often Services, EndpointSlices and the Node are listed again (reconciled, only the "
        "differences applied); must be greater than 0",
        flags=("--config-sync-period",),
        path="configSyncPeriod",
        attr="config_sync_period_s",
        group=API,
    ),
    # ------------------------------------------------------------------------ health and metrics
    Setting(
        "healthz_bind_address",
        BindAddress(HEALTHZ_PORT, f"0.0.0.0:{HEALTHZ_PORT}"),
        f"0.0.0.0:{HEALTHZ_PORT}",
        "/healthz and /livez (empty: off; in a file empty means the default)",
        flags=("--healthz-bind-address",),
        path="healthzBindAddress",
        attr="healthz_bind_address",
        group=HEALTH,
    ),
    Setting(
        "metrics_bind_address",
        BindAddress(METRICS_PORT, f"127.0.0.1:{METRICS_PORT}"),
        f"127.0.0.1:{METRICS_PORT}",
        "/metrics, /proxyMode, /configz (empty: off; 0.0.0.0:10249 for every interface)",
        flags=("--metrics-bind-address",),
        path="metricsBindAddress",
        attr="metrics_bind_address",
        group=HEALTH,
    ),
    Setting(
        "healthz_port",
        Int(lo=0, hi=65535),
        HEALTHZ_PORT,
        "deprecated upstream: 0 turns /healthz off; another port is ignored, as upstream does once the "
        "address carries one",
        flags=("--healthz-port",),
        group=HEALTH,
    ),
    Setting(
        "metrics_port",
        Int(lo=0, hi=65535),
        METRICS_PORT,
        "deprecated upstream: 0 turns /metrics off; another port is ignored, as upstream does",
        flags=("--metrics-port",),
        group=HEALTH,
    ),
    Setting(
        "bind_address_hard_fail",
        Bool(),
        False,
        "exit when the healthz or metrics port cannot be bound (otherwise retried every 5 s)",
        flags=("--bind-address-hard-fail",),
        path="bindAddressHardFail",
        attr="bind_address_hard_fail",
        group=HEALTH,
    ),
    # ------------------------------------------------------------------------ node and addresses
    Setting(
        "node_ip",
        IPAddress(repeatable=True),
        (),
        "a node address (repeatable, either family; an IPv6 one turns on the IPv6 proxier, ip6tables "
        "in both modes); default: the addresses on --devices",
        flags=("--node-ip",),
        attr="node_ips",
        group=NODE,
    ),
    Setting(
        "nodeport_addresses",
        StrList(nodeport_addresses),
        (),
        "CIDRs, or primary / localhost / all: the node addresses NodePorts answer on (default: all)",
        flags=("--nodeport-addresses",),
        path="nodePortAddresses",
        attr="nodeport_addresses",
        group=NODE,
    ),
    Setting(
        "cluster_cidr",
        StrList(cidr_list, joined=True),
        (),
        "the cluster's pod CIDRs: with --detect-local-mode=ClusterCIDR (the default) traffic from the "
        "first IPv4 one is local, and other traffic to a cluster IP is masqueraded; empty: no detector",
        flags=("--cluster-cidr",),
        path="clusterCIDR",
        attr="cluster_cidr",
        group=NODE,
    ),
    Setting(
        "service_cluster_ip_range",
        StrList(cidr_list),
        (),
        "the cluster's Service CIDRs (kube-apiserver's --service-cluster-ip-range): never programmed as "
        "externalIPs or load-balancer IPs",
        flags=("--service-cluster-ip-range",),
        attr="service_cidrs",
        group=NODE,
    ),
    Setting(
        "external_ip_cidrs",
        StrList(cidr_list),
        (),
        "CIDRs spec.externalIPs and load-balancer ingress IPs must be in to be programmed (default: "
        "any address, as kube-proxy); this node's addresses, --cluster-cidr and "
        "--service-cluster-ip-range are refused whatever it says (a log line, an Event, a metric)",
        flags=("--external-ip-cidrs",),
        attr="external_ip_cidrs",
        group=NODE,
    ),
    Setting(
        "detect_local_mode",
        _DetectLocalMode(
            LOCAL_MODES,
            file_hint='unsupported value; supported values: "", "ClusterCIDR", "NodeCIDR", '
            '"BridgeInterface", "InterfaceNamePrefix"',
            metavar="|".join(LOCAL_MODES),
        ),
        "",
        "how traffic from this node's pods is told apart (kube-proxy's local-traffic detector): by "
        "source, ClusterCIDR (--cluster-cidr) or NodeCIDR (the Node's spec.podCIDRs, from the API "
        "server); by the device it enters on, BridgeInterface (--pod-bridge-interface) or "
        "InterfaceNamePrefix (--pod-interface-name-prefix). Other traffic to a cluster IP is "
        'masqueraded. "" is ClusterCIDR',
        flags=("--detect-local-mode",),
        path="detectLocalMode",
        attr="detect_local_mode",
        into=local_mode,
        group=NODE,
    ),
    Setting(
        "pod_bridge_interface",
        Text(metavar="NAME"),
        "",
        "the pods' bridge (--detect-local-mode=BridgeInterface): traffic entering on it is local; "
        "eBPF mode attaches ekp_from_pod to the bridge's ports (a frame from a pod enters on its "
        "port before the bridge), not to the bridge itself",
        flags=("--pod-bridge-interface",),
        path="detectLocal.bridgeInterface",
        attr="pod_bridge_interface",
        group=NODE,
    ),
    Setting(
        "pod_interface_name_prefix",
        Text(metavar="PREFIX"),
        "",
        "(--detect-local-mode=InterfaceNamePrefix) traffic entering on a device whose name starts "
        "with it is local; eBPF mode attaches ekp_from_pod to those devices and ekp_from_net to other "
        "--pod-interfaces devices",
        flags=("--pod-interface-name-prefix",),
        path="detectLocal.interfaceNamePrefix",
        attr="pod_interface_name_prefix",
        group=NODE,
    ),
    Setting(
        "devices",
        StrList(),
        (),
        "external devices: node addresses are read there, ekp_from_net attaches there (default: "
        "those holding a node address: IPv4, and IPv6 too where the tc IPv6 path serves, so that its "
        "replies arriving on a device with only an IPv6 node address are translated back)",
        flags=("--devices",),
        attr="devices",
        group=NODE,
    ),
    Setting(
        "pod_interfaces",
        StrList(),
        DEFAULT_POD_INTERFACES,
        "glob patterns of pod-facing devices (ekp_from_pod attaches there)",
        flags=("--pod-interfaces",),
        attr="pod_interfaces",
        group=NODE,
    ),
    Setting(
        "node_port_range",
        PortRange(),
        (30000, 32767),
        "the cluster's NodePort range (the API server's --service-node-port-range); node ports "
        "outside it are refused (a log line, an Event, a metric)",
        flags=("--node-port-range",),
        attr="nodeport_range",
        group=NODE,
    ),
    Setting(
        "netns",
        Text(metavar="NAME"),
        "",
        "network namespace to program (default: the agent's own; how the lab runs one agent per node)",
        flags=("--netns",),
        attr="netns",
        group=NODE,
    ),
    # -------------------------------------------------------------------- syncs and iptables mode
    Setting(
        "iptables_sync_period",
        Duration(zero_is_default=True, positive=True),
        30.0,
        "full resync period, both modes; it also repairs what changed behind the agent's back",
        flags=("--iptables-sync-period", "--sync-period"),
        path="iptables.syncPeriod",
        attr="sync_period_s",
        group=SYNC,
    ),
    Setting(
        "iptables_min_sync_period",
        Duration(zero_is_default=True),
        None,
        "minimum time between syncs of each IP family's proxier (default 1s in iptables mode, 100ms in "
        "eBPF mode); in eBPF mode the IPv6 proxier (ip6tables) keeps at least 1s, this value when larger",
        flags=("--iptables-min-sync-period", "--min-sync-period"),
        path="iptables.minSyncPeriod",
        group=SYNC,
    ),
    Setting(
        "masquerade_all",
        Bool(),
        False,
        "SNAT all traffic to ClusterIPs (both modes)",
        flags=("--masquerade-all",),
        path="iptables.masqueradeAll",
        attr="masquerade_all",
        group=SYNC,
    ),
    Setting(
        "iptables_masquerade_bit",
        Int(lo=0, hi=31),
        14,
        "the fwmark bit KUBE-MARK-MASQ sets on packets to masquerade (0-31; in eBPF mode, of the "
        "ip6tables rules that serve IPv6 Services)",
        flags=("--iptables-masquerade-bit",),
        path="iptables.masqueradeBit",
        attr="masquerade_bit",
        group=SYNC,
    ),
    Setting(
        "iptables_localhost_nodeports",
        Bool(),
        True,
        "NodePorts also answer on 127.0.0.1 (iptables; sets route_localnet)",
        flags=("--iptables-localhost-nodeports",),
        path="iptables.localhostNodePorts",
        attr="iptables_localhost_nodeports",
        group=SYNC,
    ),
    Setting(
        "iptables_backend",
        Choice(("auto", "nft", "legacy"), metavar="auto|nft|legacy"),
        "auto",
        "iptables binary family (auto: the one the node already uses); in eBPF mode, of the "
        "ip6tables rules that serve IPv6 Services",
        flags=("--iptables-backend",),
        attr="iptables_backend",
        group=SYNC,
    ),
    # ---------------------------------------------------------------------------------- conntrack
    Setting(
        "conntrack_max_per_core",
        Int(lo=0),
        32768,
        "conntrack entries per CPU (0: leave nf_conntrack_max and --conntrack-min alone)",
        flags=("--conntrack-max-per-core",),
        path="conntrack.maxPerCore",
        attr="conntrack.max_per_core",
        group=CONNTRACK,
    ),
    Setting(
        "conntrack_min",
        Int(lo=0),
        131072,
        "conntrack entries at least",
        flags=("--conntrack-min",),
        path="conntrack.min",
        attr="conntrack.min",
        group=CONNTRACK,
    ),
    Setting(
        "conntrack_tcp_timeout_established",
        Duration(),
        86400.0,
        "idle timeout of established TCP flows (0: leave as is)",
        flags=("--conntrack-tcp-timeout-established",),
        path="conntrack.tcpEstablishedTimeout",
        attr="conntrack.tcp_established_timeout_s",
        group=CONNTRACK,
    ),
    Setting(
        "conntrack_tcp_timeout_close_wait",
        Duration(),
        3600.0,
        "timeout of TCP flows in CLOSE_WAIT",
        flags=("--conntrack-tcp-timeout-close-wait",),
        path="conntrack.tcpCloseWaitTimeout",
        attr="conntrack.tcp_close_wait_timeout_s",
        group=CONNTRACK,
    ),
    Setting(
        "conntrack_tcp_be_liberal",
        Bool(),
        False,
        "nf_conntrack_tcp_be_liberal=1 (iptables)",
        flags=("--conntrack-tcp-be-liberal",),
        path="conntrack.tcpBeLiberal",
        attr="conntrack.tcp_be_liberal",
        group=CONNTRACK,
    ),
    Setting(
        "conntrack_udp_timeout",
        Duration(),
        0.0,
        "idle timeout of unreplied UDP flows (0: the kernel's, 30 s)",
        flags=("--conntrack-udp-timeout",),
        path="conntrack.udpTimeout",
        attr="conntrack.udp_timeout_s",
        group=CONNTRACK,
    ),
    Setting(
        "conntrack_udp_timeout_stream",
        Duration(),
        0.0,
        "idle timeout of assured UDP flows (0: the kernel's, 120 s)",
        flags=("--conntrack-udp-timeout-stream",),
        path="conntrack.udpStreamTimeout",
        attr="conntrack.udp_stream_timeout_s",
        group=CONNTRACK,
    ),
    # ----------------------------------------------------------------------------------- eBPF mode
    Setting(
        "bpf_pin_path",
        Text(metavar="DIR"),
        DEFAULT_PIN_PATH,
        "bpffs directory of the pinned maps and programs",
        flags=("--bpf-pin-path",),
        attr="pin_path",
        group=EBPF,
    ),
    Setting(
        "bpf_snat_ports",
        PortRange(),
        (61000, 65535),
        "source ports for SNAT; must not overlap --node-port-range nor the node's ip_local_port_range",
        flags=("--bpf-snat-ports",),
        attr="snat_ports",
        group=EBPF,
    ),
    Setting(
        "bpf_host_routing",
        Choice(("legacy", "bpf"), metavar="legacy|bpf"),
        "legacy",
        "legacy: translated packets go through the node's stack, so its netfilter FORWARD chain (an "
        "iptables-based NetworkPolicy engine) and rp_filter see them as in iptables mode; bpf: "
        "redirected past the stack (faster), with the data path's own source check on pod devices",
        flags=("--bpf-host-routing",),
        attr="bpf_host_routing",
        into=HostRouting,
        group=EBPF,
    ),
    Setting(
        "bpf_ct_timeout_tcp_backend_gone",
        Duration(most=65535.0),  # ekp_config.tcp_orphan_s is a __u16
        300.0,
        "TCP flows whose backend left every Service: how long they live after the backend's last "
        "packet (only its packets renew them; nf_conntrack's unacknowledged-data timeout)",
        flags=("--bpf-ct-timeout-tcp-backend-gone",),
        attr="ct_tcp_backend_gone_timeout_s",
        group=EBPF,
    ),
    Setting(
        "bpf_keep_client_ip_for_local_backends",
        Bool(),
        False,
        "externalTrafficPolicy Cluster: keep the client's address toward backends on this node "
        "(kube-proxy masquerades it)",
        flags=("--bpf-keep-client-ip-for-local-backends",),
        attr="bpf_keep_client_ip_local",
        group=EBPF,
    ),
    Setting(
        "bpf_socket_lb",
        Bool(),
        True,
        "translate the node's own sockets at connect()/sendmsg() (cgroup programs): host-network "
        "pods and node processes reach Services as kube-proxy's OUTPUT chain lets them",
        flags=("--bpf-socket-lb",),
        attr="socket_lb",
        group=EBPF,
    ),
    Setting(
        "bpf_socket_lb_cgroup",
        Text(metavar="DIR"),
        "",
        "cgroup v2 directory the socket programs attach to (default: the root of the cgroup2 mount, "
        "the whole node); every socket of its processes and their descendants is served",
        flags=("--bpf-socket-lb-cgroup",),
        attr="socket_lb_cgroup",
        group=EBPF,
    ),
    Setting(
        "bpf_socket_lb_host_namespace_only",
        Bool(),
        False,
        "translate at connect() only the sockets of the node's network namespace; pods keep the "
        "per-packet path and their packets carry the Service address (service meshes that redirect "
        "by it need this; Cilium's socketLB.hostNamespaceOnly). Off: a pod's connection to a "
        "Service goes to the backend from connect() on, unless the frontend needs the pod's address "
        "(affinity, source ranges, SNAT)",
        flags=("--bpf-socket-lb-host-namespace-only",),
        attr="socket_lb_host_only",
        group=EBPF,
    ),
    Setting(
        "bpf_xdp",
        Choice(("disabled", "generic", "native", "best-effort")),
        "best-effort",
        "XDP on the external devices, ahead of their tc program (NodePort, LoadBalancer and external "
        "IP traffic: source-range drops, flows to backends on other nodes): native (the driver's; "
        "fails where the driver has none), generic (any device, slower than native), best-effort "
        "(native where the driver supports it and the device is no veth, else none, with a log "
        "line; the XDP programs are loaded, verified, only where an external device takes native "
        "XDP (no veth, bridge nor vxlan) or none is found, else once one appears: the data path is "
        "then loaded again with them and put in place of "
        'the first load\'s, see "XDP" under the data path), disabled (none, and no XDP program '
        "is loaded: a start saves their verification)",
        flags=("--bpf-xdp",),
        attr="bpf_xdp",
        group=EBPF,
    ),
    Setting(
        "bpf_tc_attach",
        Choice(("auto", "tcx", "clsact")),
        "auto",
        "how the tc programs are attached: tcx (Linux 6.6 bpf_links, pinned; no qdisc, so nothing the "
        "node sends is dropped while a device gets its programs), clsact (a clsact qdisc and cls_bpf "
        "filters: adding the qdisc to a device that has none drops what it sends meanwhile), or auto "
        "(tcx where the kernel has it, else clsact, said once in the log); tcx on a kernel without "
        "it attaches through clsact too, with a warning",
        flags=("--bpf-tc-attach",),
        attr="bpf_tc_attach",
        group=EBPF,
    ),
    Setting(
        "bpf_lb_algorithm",
        Choice(("random", "maglev")),
        "random",
        "backend choice for traffic from outside (NodePort, LoadBalancer, external IPs), as Cilium's "
        "loadBalancer.algorithm: random, or maglev (consistent hashing: every node picks the same "
        "backend for a flow, and a flow keeps it when its conntrack entry is lost)",
        flags=("--bpf-lb-algorithm",),
        attr="bpf_lb_algorithm",
        group=EBPF,
    ),
    Setting(
        "bpf_lb_maglev_table_size",
        Prime(lo=251, hi=131071),
        16381,
        "positions of each Maglev table, a prime (Cilium's default; 64 KiB per table); the same on "
        "every node, and a pinned table map keeps the size it was created with",
        flags=("--bpf-lb-maglev-table-size",),
        attr="map_sizes.maglev_table_size",
        group=EBPF,
    ),
    *(_map_size(role) for role in MAP_SIZE_ROLES),
    # ------------------------------------------------------------------------------------ logging
    Setting(
        "verbosity",
        Int(lo=0),
        2,
        "log verbosity: 0 warnings, 1-3 info, 4 and up debug",
        flags=("-v", "--v"),
        path="logging.verbosity",
        group=LOGGING,
    ),
    # ------------------------------------------------------------------- accepted, not applied
    _ignored(
        "logging_format",
        Choice(("text", "json")),
        "text",
        NA_LOG,
        flags=("--logging-format",),
        path="logging.format",
    ),
    _ignored(
        "log_flush_frequency",
        _FlushFrequency(),
        5.0,
        NA_LOG,
        flags=("--log-flush-frequency",),
        path="logging.flushFrequency",
    ),
    _ignored(
        "vmodule", Opaque(), None, NA_LOG, flags=("--vmodule",), path="logging.vmodule", written="given"
    ),
    _ignored(
        "logging_options",
        Opaque(),
        {"json": {"infoBufferSize": "0"}, "text": {"infoBufferSize": "0"}},
        NA_LOG,
        path="logging.options",
    ),
    _ignored("log_json_split_stream", Bool(), False, NA_LOG, flags=("--log-json-split-stream",)),
    _ignored("log_json_info_buffer_size", Text(), "0", NA_LOG, flags=("--log-json-info-buffer-size",)),
    _ignored("log_text_split_stream", Bool(), False, NA_LOG, flags=("--log-text-split-stream",)),
    _ignored("log_text_info_buffer_size", Text(), "0", NA_LOG, flags=("--log-text-info-buffer-size",)),
    _ignored(
        "kube_api_accept_content_types",
        Text(),
        "",
        "the Python client decodes JSON only, so it always asks for application/json",
        path="clientConnection.acceptContentTypes",
    ),
    _ignored(
        "bind_address",
        IPAddress(),
        "0.0.0.0",
        "use --node-ip for the node's addresses",
        flags=("--bind-address",),
        path="bindAddress",
    ),
    _ignored(
        "profiling",
        Bool(),
        False,
        "there is no Go profiler in this agent",
        flags=("--profiling",),
        path="enableProfiling",
    ),
    _ignored(
        "show_hidden_metrics_for_version",
        Text(),
        "",
        "the agent hides no metrics",
        flags=("--show-hidden-metrics-for-version",),
        path="showHiddenMetricsForVersion",
    ),
    _ignored(
        "iptables_snat_node_internal_ip",
        Bool(),
        False,
        "the agent SNATs to the egress address",
        path="iptables.snatNodeInternalIP",
        written="given",
    ),
    _ignored(
        "ipvs_sync_period", Duration(), 0.0, NA_IPVS, flags=("--ipvs-sync-period",), path="ipvs.syncPeriod"
    ),
    _ignored(
        "ipvs_min_sync_period",
        Duration(),
        0.0,
        NA_IPVS,
        flags=("--ipvs-min-sync-period",),
        path="ipvs.minSyncPeriod",
    ),
    _ignored("ipvs_scheduler", Text(), "", NA_IPVS, flags=("--ipvs-scheduler",), path="ipvs.scheduler"),
    _ignored(
        "ipvs_exclude_cidrs",
        StrList(),
        (),
        NA_IPVS,
        flags=("--ipvs-exclude-cidrs",),
        path="ipvs.excludeCIDRs",
    ),
    _ignored("ipvs_strict_arp", Bool(), False, NA_IPVS, flags=("--ipvs-strict-arp",), path="ipvs.strictARP"),
    _ignored(
        "ipvs_tcp_timeout", Duration(), 0.0, NA_IPVS, flags=("--ipvs-tcp-timeout",), path="ipvs.tcpTimeout"
    ),
    _ignored(
        "ipvs_tcpfin_timeout",
        Duration(),
        0.0,
        NA_IPVS,
        flags=("--ipvs-tcpfin-timeout",),
        path="ipvs.tcpFinTimeout",
    ),
    _ignored(
        "ipvs_udp_timeout", Duration(), 0.0, NA_IPVS, flags=("--ipvs-udp-timeout",), path="ipvs.udpTimeout"
    ),
    _ignored("ipvs_ipset_hash_size", Int(), 1024, NA_IPVS, path="ipvs.ipSet.hashSize", written="given"),
    _ignored(
        "ipvs_ipset_max_elements", Int(), 65536, NA_IPVS, path="ipvs.ipSet.maxElements", written="given"
    ),
    _ignored("nftables_masquerade_bit", Int(), 14, NA_NFT, path="nftables.masqueradeBit"),
    _ignored("nftables_masquerade_all", Bool(), False, NA_NFT, path="nftables.masqueradeAll"),
    _ignored("nftables_sync_period", Duration(), 0.0, NA_NFT, path="nftables.syncPeriod"),
    _ignored("nftables_min_sync_period", Duration(), 0.0, NA_NFT, path="nftables.minSyncPeriod"),
    _ignored("winkernel_network_name", Text(), "", NA_WIN, path="winkernel.networkName"),
    _ignored("winkernel_source_vip", Text(), "", NA_WIN, path="winkernel.sourceVip"),
    _ignored("winkernel_enable_dsr", Bool(), False, NA_WIN, path="winkernel.enableDSR"),
    _ignored("winkernel_root_hns_endpoint_name", Text(), "", NA_WIN, path="winkernel.rootHnsEndpointName"),
    _ignored(
        "winkernel_forward_health_check_vip", Bool(), False, NA_WIN, path="winkernel.forwardHealthCheckVip"
    ),
    _ignored(
        "windows_run_as_service", Bool(), False, NA_WIN, path="windowsRunAsService", written="omitempty"
    ),
    _ignored("port_range", Text(), "", "the userspace proxy it configured is gone", path="portRange"),
    *(
        _ignored(name.replace("-", "_"), kind, default, NA_KLOG, flags=(f"--{name}",))
        for name, kind, default in (
            ("add-dir-header", Bool(), False),
            ("alsologtostderr", Bool(), False),
            ("log-backtrace-at", Text(), ":0"),
            ("log-dir", Text(), ""),
            ("log-file", Text(), ""),
            ("log-file-max-size", Int(lo=0), 1800),
            ("logtostderr", Bool(), True),
            ("one-output", Bool(), False),
            ("skip-headers", Bool(), False),
            ("skip-log-headers", Bool(), False),
            ("stderrthreshold", Int(), 2),
        )
    ),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
BY_PATH: dict[str, Setting] = {s.path: s for s in SETTINGS if s.path}
BY_ATTR: dict[str, Setting] = {s.attr: s for s in SETTINGS if s.attr}


def default(attr: str) -> Any:
    """The default of the Config attribute `attr` (the one home of every default)."""
    setting = BY_ATTR[attr]
    return setting.into(setting.default) if setting.into else setting.default


def defaults() -> dict[str, Any]:
    """Every setting's default, by name."""
    return {s.name: s.default for s in SETTINGS}
