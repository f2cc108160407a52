"""kube-proxy's configuration file (`--config`, `KubeProxyConfiguration` v1alpha1) and its writer.

An operator's kube-proxy ConfigMap carries over: every v1alpha1 field is known here (the field
set of k8s.io/kube-proxy/config/v1alpha1/types.go, defaults from pkg/proxy/apis/config/v1alpha1/
defaults.go). Each field is one of:

* **applied**: mapped to the flag of the same meaning (`FIELDS[path].dest`, an argparse dest), so
  the file and the command line go through one conversion and a flag given on the command line
  overrides the file (`agent.cli` tracks which flags were given);
* **not applicable** (IPVS, nftables, Windows, profiling, feature gates, logging format, ...):
  accepted, and a warning names it when its value differs from upstream's default, since only then
  did the operator ask for something this agent will not do;
* an unknown field, a wrong type or an invalid value is refused: `ConfigFileError` carries one
  line per problem naming the field path and what is allowed, and the agent exits with status 2.
  (Upstream decodes v1alpha1 leniently after a strict failure and only logs; refusing here turns a
  typo such as `nodePortAdresses` into an error instead of a silently ignored setting.)

Values upstream accepts but this agent cannot honour are refused, not ignored: `mode: ipvs` or
`nftables`, `detectLocalMode` other than ClusterCIDR. `mode: ""` means this agent's default (eBPF),
not kube-proxy's iptables.

Durations are Go durations (`30s`, `1h0m0s`) as metav1.Duration; a zero sync period means "the
default", as upstream's defaulting does. `document` produces the effective configuration in the
same shape (what `--write-config-to` writes and `/configz` shows), and `render_yaml` prints it as
kube-proxy's writer does: keys sorted, strings quoted only when YAML would misread them.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from agent.config import NODEPORT_PRIMARY, Config
from agent.goformat import DurationError, format_duration, parse_duration

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
HEALTHZ_PORT = 10256
METRICS_PORT = 10249
EBPF_MIN_SYNC_PERIOD_S = 0.1
IPTABLES_MIN_SYNC_PERIOD_S = 1.0  # kube-proxy's default
SYNC_PERIOD_S = 30.0

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ConfigFileError(ValueError):
    """The file cannot be used; `problems` holds one line per field."""

    def __init__(self, source: str, problems: Iterable[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__(f"{source}: " + "; ".join(self.problems))


# ----------------------------------------------------------------------------- value parsers
# Shared with the command line (agent.cli), so a value means the same in both places.


def bind_address(text: str, default_port: int) -> str:
    """`IP`, `IP:port` or `[IPv6]:port`; a bare IP gets the default port (upstream's
    AppendPortIfNeeded). "" stays "" (the server is off)."""
    text = text.strip()
    if not text:
        return ""
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        pass
    else:
        return f"[{ip}]:{default_port}" if ip.version == 6 else f"{ip}:{default_port}"
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"{text!r} is not IP or IP:port (e.g. 0.0.0.0:{default_port})")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ValueError(f"{text!r}: {host!r} is not an IP address (e.g. 0.0.0.0:{default_port})") from None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: {port!r} is not a port (1-65535)")
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def cidr_list(values: Iterable[str]) -> tuple[str, ...]:
    out = []
    for value in values:
        value = value.strip()
        if not value:
            continue
        try:
            ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise ValueError(f"{value!r} is not a CIDR (e.g. 10.244.0.0/16)") from None
        out.append(value)
    return tuple(out)


def nodeport_addresses(values: Iterable[str]) -> tuple[str, ...]:
    """CIDRs and kube-proxy's keywords: `primary` (the node's primary address), `localhost`
    (127.0.0.0/8) and `all` (every address, the same as leaving the list empty)."""
    out: list[str] = []
    every = False
    for value in (v.strip() for v in values):
        if not value:
            continue
        if value == "all":
            every = True
        elif value == "localhost":
            out.append("127.0.0.0/8")
        elif value == NODEPORT_PRIMARY:
            out.append(NODEPORT_PRIMARY)
        else:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError:
                raise ValueError(
                    f"{value!r} is not a CIDR or one of primary, localhost, all (e.g. 192.168.0.0/24)"
                ) from None
            out.append(value)
    return () if every else tuple(dict.fromkeys(out))


# ------------------------------------------------------------------------------------ schema


@dataclass(frozen=True)
class Field:
    kind: str  # str | bool | int | uint | float | duration | strlist | boolmap | any
    default: Any = None  # upstream's default after defaulting (for "not applicable" warnings)
    dest: str = ""  # the argparse dest it sets; "" = does not apply to this agent
    convert: Callable[[Any], Any] | None = None  # YAML value -> dest value; ValueError if invalid
    why: str = ""  # for fields that do not apply: why (ends the warning)


def _positive_duration(s: float) -> float:
    if s < 0:
        raise ValueError("must be greater than or equal to 0")
    return s


def _range(lo: int, hi: int) -> Callable[[Any], Any]:
    def check(v: int) -> int:
        if not lo <= v <= hi:
            raise ValueError(f"must be within the range [{lo}, {hi}]")
        return v

    return check


def _nonnegative(v: int) -> int:
    if v < 0:
        raise ValueError("must be greater than or equal to 0")
    return v


def _mode(v: str) -> str | None:
    if v in ("", "ebpf", "iptables"):
        return v or None  # "" = this agent's default
    raise ValueError(
        'unsupported value; supported values: "", "ebpf", "iptables" ("" means ebpf here; '
        "ipvs, nftables and kernelspace are not implemented by this agent)"
    )


def _detect_local_mode(v: str) -> None:
    if v not in ("", "ClusterCIDR"):
        raise ValueError(
            'unsupported value; supported values: "", "ClusterCIDR" (this agent tells pod traffic '
            "apart by clusterCIDR only)"
        )


def _sync_period(v: float) -> float | None:
    if v < 0:
        raise ValueError("must be greater than 0")
    return v or None  # 0 = the default, as upstream's defaulting


def _min_sync_period(v: float) -> float | None:
    if v < 0:
        raise ValueError("must be greater than or equal to 0")
    return v or None


def _healthz(v: str) -> str:
    return bind_address(v, HEALTHZ_PORT) or f"0.0.0.0:{HEALTHZ_PORT}"  # "" = the default upstream


def _metrics(v: str) -> str:
    return bind_address(v, METRICS_PORT) or f"127.0.0.1:{METRICS_PORT}"


def _hostname(v: str) -> str:
    return v.strip().lower()


def _cluster_cidr(v: str) -> tuple[str, ...]:
    return cidr_list(v.split(","))


def _ip(v: str) -> str:
    ipaddress.ip_address(v)
    return v


NA_IPVS = "IPVS mode is not implemented by this agent"
NA_NFT = "nftables mode is not implemented by this agent"
NA_WIN = "Windows settings"
NA_LOG = "the agent logs plain text through Python's logging"
NA_CLIENT = "the agent's API client does not take it from here"

FIELDS: dict[str, Field] = {
    "featureGates": Field("boolmap", {}, why="feature gates are kube-proxy's"),
    "clientConnection.kubeconfig": Field("str", "", "kubeconfig"),
    "clientConnection.acceptContentTypes": Field("str", "", why=NA_CLIENT),
    "clientConnection.contentType": Field("str", "application/vnd.kubernetes.protobuf", why=NA_CLIENT),
    "clientConnection.qps": Field("float", 5.0, why=NA_CLIENT),
    "clientConnection.burst": Field("int", 10, convert=_nonnegative, why=NA_CLIENT),
    "logging.format": Field("str", "text", why=NA_LOG),
    "logging.flushFrequency": Field("any", "5s", why=NA_LOG),
    "logging.verbosity": Field("uint", None, "verbosity"),
    "logging.vmodule": Field("any", None, why=NA_LOG),
    "logging.options": Field(
        "any", {"json": {"infoBufferSize": "0"}, "text": {"infoBufferSize": "0"}}, why=NA_LOG
    ),
    "hostnameOverride": Field("str", "", "hostname_override", _hostname),
    "bindAddress": Field("str", "0.0.0.0", convert=_ip, why="use --node-ip for the node's addresses"),
    "healthzBindAddress": Field("str", "", "healthz_bind_address", _healthz),
    "metricsBindAddress": Field("str", "", "metrics_bind_address", _metrics),
    "bindAddressHardFail": Field("bool", False, "bind_address_hard_fail"),
    "enableProfiling": Field("bool", False, why="there is no Go profiler in this agent"),
    "showHiddenMetricsForVersion": Field("str", "", why="the agent hides no metrics"),
    "mode": Field("str", "", "mode", _mode),
    "iptables.masqueradeBit": Field("int", 14, "iptables_masquerade_bit", _range(0, 31)),
    "iptables.masqueradeAll": Field("bool", False, "masquerade_all"),
    "iptables.localhostNodePorts": Field("bool", True, "iptables_localhost_nodeports"),
    "iptables.syncPeriod": Field("duration", 30.0, "iptables_sync_period", _sync_period),
    "iptables.minSyncPeriod": Field("duration", 1.0, "iptables_min_sync_period", _min_sync_period),
    "iptables.snatNodeInternalIP": Field("bool", False, why="the agent SNATs to the egress address"),
    "ipvs.syncPeriod": Field("duration", 0.0, why=NA_IPVS),
    "ipvs.minSyncPeriod": Field("duration", 0.0, why=NA_IPVS),
    "ipvs.scheduler": Field("str", "", why=NA_IPVS),
    "ipvs.excludeCIDRs": Field("strlist", None, why=NA_IPVS),
    "ipvs.strictARP": Field("bool", False, why=NA_IPVS),
    "ipvs.tcpTimeout": Field("duration", 0.0, why=NA_IPVS),
    "ipvs.tcpFinTimeout": Field("duration", 0.0, why=NA_IPVS),
    "ipvs.udpTimeout": Field("duration", 0.0, why=NA_IPVS),
    "ipvs.ipSet.hashSize": Field("int", 1024, why=NA_IPVS),
    "ipvs.ipSet.maxElements": Field("int", 65536, why=NA_IPVS),
    "nftables.masqueradeBit": Field("int", 14, why=NA_NFT),
    "nftables.masqueradeAll": Field("bool", False, why=NA_NFT),
    "nftables.syncPeriod": Field("duration", 0.0, why=NA_NFT),
    "nftables.minSyncPeriod": Field("duration", 0.0, why=NA_NFT),
    "winkernel.networkName": Field("str", "", why=NA_WIN),
    "winkernel.sourceVip": Field("str", "", why=NA_WIN),
    "winkernel.enableDSR": Field("bool", False, why=NA_WIN),
    "winkernel.rootHnsEndpointName": Field("str", "", why=NA_WIN),
    "winkernel.forwardHealthCheckVip": Field("bool", False, why=NA_WIN),
    "windowsRunAsService": Field("bool", False, why=NA_WIN),
    "detectLocalMode": Field("str", "", convert=_detect_local_mode, why=""),
    "detectLocal.bridgeInterface": Field("str", "", why="detectLocalMode BridgeInterface is not supported"),
    "detectLocal.interfaceNamePrefix": Field(
        "str", "", why="detectLocalMode InterfaceNamePrefix is not supported"
    ),
    "clusterCIDR": Field("str", "", "cluster_cidr", _cluster_cidr),
    "nodePortAddresses": Field("strlist", None, "nodeport_addresses", nodeport_addresses),
    "oomScoreAdj": Field(
        "int", -999, convert=_range(-1000, 1000), why="the agent leaves its OOM score alone"
    ),
    "conntrack.maxPerCore": Field("int", 32768, "conntrack_max_per_core", _nonnegative),
    "conntrack.min": Field("int", 131072, "conntrack_min", _nonnegative),
    "conntrack.tcpEstablishedTimeout": Field(
        "duration", 86400.0, "conntrack_tcp_timeout_established", _positive_duration
    ),
    "conntrack.tcpCloseWaitTimeout": Field(
        "duration", 3600.0, "conntrack_tcp_timeout_close_wait", _positive_duration
    ),
    "conntrack.tcpBeLiberal": Field("bool", False, "conntrack_tcp_be_liberal"),
    "conntrack.udpTimeout": Field("duration", 0.0, "conntrack_udp_timeout", _positive_duration),
    "conntrack.udpStreamTimeout": Field("duration", 0.0, "conntrack_udp_timeout_stream", _positive_duration),
    "configSyncPeriod": Field("duration", 900.0, why="the agent's sources relist on their own schedule"),
    "portRange": Field("str", "", why="the userspace proxy it configured is gone"),
}
_OBJECTS = {path.rpartition(".")[0] for path in FIELDS if "." in path}
_OBJECTS |= {p.rpartition(".")[0] for p in _OBJECTS if "." in p}


@dataclass(frozen=True)
class FileSettings:
    """What a configuration file says, as argparse dests (only the fields it sets)."""

    values: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    given: Mapping[str, Any] = field(default_factory=dict)  # path -> value as written, every field


# ------------------------------------------------------------------------------------- parse


def load(path: str) -> FileSettings:
    """Read and check a KubeProxyConfiguration file (YAML or JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(path, [f"cannot read it: {exc}"]) from None
    try:
        doc = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        raise ConfigFileError(path, [f"not YAML or JSON: {exc}".replace("\n", " ")]) from None
    return parse(doc, path)


def parse(doc: Any, source: str = "config") -> FileSettings:
    """Check a decoded document against v1alpha1 and map it to argparse dests."""
    problems: list[str] = []
    if not isinstance(doc, Mapping):
        raise ConfigFileError(source, [f"expected a {KIND} object, got {type(doc).__name__}"])
    if doc.get("apiVersion") != API_VERSION:
        problems.append(
            f"apiVersion: Unsupported value: {_show(doc.get('apiVersion'))}: must be {_show(API_VERSION)}"
        )
    if doc.get("kind") != KIND:
        problems.append(f"kind: Unsupported value: {_show(doc.get('kind'))}: must be {_show(KIND)}")
    flat: dict[str, Any] = {}
    _flatten({k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}, "", flat, problems)
    values: dict[str, Any] = {}
    warnings: list[str] = []
    for path, raw in flat.items():
        spec = FIELDS[path]
        if raw is None:
            continue  # JSON null: the field keeps its default, as Go's decoder leaves it unset
        try:
            value = _typed(spec.kind, raw)
            if spec.convert is not None:
                value = spec.convert(value)
        except ValueError as exc:
            problems.append(f"{path}: Invalid value: {_show(raw)}: {exc}")
            continue
        if spec.dest:
            if value is not None:
                values[spec.dest] = value
        elif spec.why and _differs(spec, raw):
            warnings.append(f"{path} is set to {_show(raw)} but does not apply: {spec.why}; ignored")
    if problems:
        raise ConfigFileError(source, problems)
    return FileSettings(values, tuple(warnings), flat)


def _flatten(node: Mapping[str, Any], prefix: str, out: dict[str, Any], problems: list[str]) -> None:
    for key, value in node.items():
        path = f"{prefix}{key}"
        if path in FIELDS:
            out[path] = value
        elif path in _OBJECTS:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                problems.append(f"{path}: Invalid value: {_show(value)}: must be an object")
                continue
            _flatten(value, path + ".", out, problems)
        else:
            siblings = [
                p.removeprefix(prefix).split(".")[0] for p in (*FIELDS, *_OBJECTS) if p.startswith(prefix)
            ]
            close = difflib.get_close_matches(str(key), sorted(set(siblings)), n=1)
            hint = f' (did you mean "{prefix}{close[0]}"?)' if close else ""
            problems.append(f'unknown field "{path}"{hint}')


def _typed(kind: str, raw: Any) -> Any:
    if kind == "str":
        if not isinstance(raw, str):
            raise ValueError("must be a string")
        return raw
    if kind == "bool":
        if not isinstance(raw, bool):
            raise ValueError("must be true or false")
        return raw
    if kind in ("int", "uint"):
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError("must be a whole number")
        if kind == "uint" and raw < 0:
            raise ValueError("must be greater than or equal to 0")
        return raw
    if kind == "float":
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ValueError("must be a number")
        return float(raw)
    if kind == "duration":
        if not isinstance(raw, str):
            raise ValueError("must be a duration string (e.g. 30s, 1m, 500ms)")
        try:
            return parse_duration(raw)
        except DurationError as exc:
            raise ValueError(str(exc)) from None
    if kind == "strlist":
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
            raise ValueError("must be a list of strings")
        return raw
    if kind == "boolmap":
        if not isinstance(raw, Mapping) or not all(isinstance(v, bool) for v in raw.values()):
            raise ValueError("must be a map of names to true or false")
        return dict(raw)
    return raw


def _differs(spec: Field, raw: Any) -> bool:
    if spec.kind == "duration" and isinstance(raw, str):
        return parse_duration(raw) != (spec.default or 0.0)
    if spec.kind in ("strlist", "boolmap", "any"):
        return raw not in (None, [], {}, spec.default)
    return bool(raw != spec.default)


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | int | float | bool | type(None)) else repr(value)


# ---------------------------------------------------------------------------------- document


def default_min_sync_period(mode: str) -> float:
    """kube-proxy's 1 s in iptables mode; 100 ms in eBPF mode, where a sync writes only the map
    entries that changed: the floor still turns a burst of events (a rollout) into one sync."""
    return IPTABLES_MIN_SYNC_PERIOD_S if mode == "iptables" else EBPF_MIN_SYNC_PERIOD_S


def document(
    config: Config,
    *,
    hostname_override: str = "",
    verbosity: int = 0,
    given: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The effective configuration as a v1alpha1 KubeProxyConfiguration (every field, defaults
    included, as kube-proxy's --write-config-to writes it). Fields that do not apply keep what
    the configuration file said (`given`), else upstream's default."""
    c = config.conntrack
    doc: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "bindAddress": "0.0.0.0",
        "bindAddressHardFail": config.bind_address_hard_fail,
        "clientConnection": {
            "acceptContentTypes": "",
            "burst": 10,
            "contentType": "application/vnd.kubernetes.protobuf",
            "kubeconfig": config.kubeconfig,
            "qps": 5,
        },
        "clusterCIDR": ",".join(config.cluster_cidr),
        "configSyncPeriod": "15m0s",
        "conntrack": {
            "maxPerCore": c.max_per_core,
            "min": c.min,
            "tcpBeLiberal": c.tcp_be_liberal,
            "tcpCloseWaitTimeout": format_duration(c.tcp_close_wait_timeout_s),
            "tcpEstablishedTimeout": format_duration(c.tcp_established_timeout_s),
            "udpStreamTimeout": format_duration(c.udp_stream_timeout_s),
            "udpTimeout": format_duration(c.udp_timeout_s),
        },
        "detectLocal": {"bridgeInterface": "", "interfaceNamePrefix": ""},
        "detectLocalMode": "",
        "enableProfiling": False,
        "healthzBindAddress": config.healthz_bind_address,
        "hostnameOverride": hostname_override,
        "iptables": {
            "localhostNodePorts": config.iptables_localhost_nodeports,
            "masqueradeAll": config.masquerade_all,
            "masqueradeBit": config.masquerade_bit,
            "minSyncPeriod": format_duration(config.min_sync_period_s),
            "syncPeriod": format_duration(config.sync_period_s),
        },
        "ipvs": {
            "excludeCIDRs": None,
            "minSyncPeriod": "0s",
            "scheduler": "",
            "strictARP": False,
            "syncPeriod": "0s",
            "tcpFinTimeout": "0s",
            "tcpTimeout": "0s",
            "udpTimeout": "0s",
        },
        "logging": {
            "flushFrequency": "5s",
            "format": "text",
            "options": {"json": {"infoBufferSize": "0"}, "text": {"infoBufferSize": "0"}},
            "verbosity": verbosity,
        },
        "metricsBindAddress": config.metrics_bind_address,
        "mode": config.mode.value,
        "nftables": {"masqueradeAll": False, "masqueradeBit": 14, "minSyncPeriod": "0s", "syncPeriod": "0s"},
        "nodePortAddresses": list(config.nodeport_addresses) or None,
        "oomScoreAdj": -999,
        "portRange": "",
        "showHiddenMetricsForVersion": "",
        "winkernel": {
            "enableDSR": False,
            "forwardHealthCheckVip": False,
            "networkName": "",
            "rootHnsEndpointName": "",
            "sourceVip": "",
        },
    }
    for path, value in (given or {}).items():
        spec = FIELDS.get(path)
        if spec is None or spec.dest or value is None:
            continue
        node = doc
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return doc


def configz(doc: Mapping[str, Any]) -> dict[str, Any]:
    """kube-proxy's /configz view: the internal KubeProxyConfiguration as encoding/json writes it
    (Go field names, sync periods at the top level, conntrack under Linux)."""
    d: Any = doc
    cidrs = [c for c in d["clusterCIDR"].split(",") if c]
    return {
        "Linux": {
            "Conntrack": {
                "MaxPerCore": d["conntrack"]["maxPerCore"],
                "Min": d["conntrack"]["min"],
                "TCPEstablishedTimeout": d["conntrack"]["tcpEstablishedTimeout"],
                "TCPCloseWaitTimeout": d["conntrack"]["tcpCloseWaitTimeout"],
                "TCPBeLiberal": d["conntrack"]["tcpBeLiberal"],
                "UDPTimeout": d["conntrack"]["udpTimeout"],
                "UDPStreamTimeout": d["conntrack"]["udpStreamTimeout"],
            },
            "MasqueradeAll": d["iptables"]["masqueradeAll"],
            "OOMScoreAdj": d["oomScoreAdj"],
        },
        "Windows": {"RunAsService": d.get("windowsRunAsService", False)},
        "FeatureGates": d.get("featureGates") or {},
        "ClientConnection": {
            "Kubeconfig": d["clientConnection"]["kubeconfig"],
            "AcceptContentTypes": d["clientConnection"]["acceptContentTypes"],
            "ContentType": d["clientConnection"]["contentType"],
            "QPS": d["clientConnection"]["qps"],
            "Burst": d["clientConnection"]["burst"],
        },
        "Logging": d["logging"],
        "HostnameOverride": d["hostnameOverride"],
        "BindAddress": d["bindAddress"],
        "HealthzBindAddress": d["healthzBindAddress"],
        "MetricsBindAddress": d["metricsBindAddress"],
        "BindAddressHardFail": d["bindAddressHardFail"],
        "EnableProfiling": d["enableProfiling"],
        "ShowHiddenMetricsForVersion": d["showHiddenMetricsForVersion"],
        "Mode": d["mode"],
        "IPTables": {
            "MasqueradeBit": d["iptables"]["masqueradeBit"],
            "LocalhostNodePorts": d["iptables"]["localhostNodePorts"],
        },
        "IPVS": {
            "Scheduler": d["ipvs"]["scheduler"],
            "ExcludeCIDRs": d["ipvs"]["excludeCIDRs"],
            "StrictARP": d["ipvs"]["strictARP"],
            "TCPTimeout": d["ipvs"]["tcpTimeout"],
            "TCPFinTimeout": d["ipvs"]["tcpFinTimeout"],
            "UDPTimeout": d["ipvs"]["udpTimeout"],
        },
        "Winkernel": {
            "NetworkName": d["winkernel"]["networkName"],
            "SourceVip": d["winkernel"]["sourceVip"],
            "EnableDSR": d["winkernel"]["enableDSR"],
            "RootHnsEndpointName": d["winkernel"]["rootHnsEndpointName"],
            "ForwardHealthCheckVip": d["winkernel"]["forwardHealthCheckVip"],
        },
        "NFTables": {"MasqueradeBit": d["nftables"]["masqueradeBit"]},
        "DetectLocalMode": d["detectLocalMode"],
        "DetectLocal": {
            "BridgeInterface": d["detectLocal"]["bridgeInterface"],
            "ClusterCIDRs": cidrs or None,
            "InterfaceNamePrefix": d["detectLocal"]["interfaceNamePrefix"],
        },
        "NodePortAddresses": d["nodePortAddresses"],
        "SyncPeriod": d["iptables"]["syncPeriod"],
        "MinSyncPeriod": d["iptables"]["minSyncPeriod"],
        "ConfigSyncPeriod": d["configSyncPeriod"],
    }


# -------------------------------------------------------------------------------------- YAML

_PLAIN_UNSAFE = re.compile(r"^[\s!&*\-?\[\]{}|>@`'\"%,#:]|[\s]$|: | #")


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    text = str(value)
    if not text or _PLAIN_UNSAFE.search(text) or yaml.safe_load(text) != text:
        return json.dumps(text)
    return text


def _yaml_lines(node: Mapping[str, Any], indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    for key in sorted(node):
        value = node[key]
        if isinstance(value, Mapping):
            if value:
                out.append(f"{pad}{key}:")
                out += _yaml_lines(value, indent + 2)
            else:
                out.append(f"{pad}{key}: {{}}")
        elif isinstance(value, list):
            if value:
                out.append(f"{pad}{key}:")
                out += [f"{pad}- {_scalar(item)}" for item in value]
            else:
                out.append(f"{pad}{key}: []")
        else:
            out.append(f"{pad}{key}: {_scalar(value)}")
    return out


def render_yaml(doc: Mapping[str, Any]) -> str:
    """YAML as kube-proxy's writer prints it (sigs.k8s.io/yaml): keys sorted, block style."""
    return "\n".join(_yaml_lines(doc, 0)) + "\n"
