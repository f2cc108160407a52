"""kube-proxy's configuration file (`--config`, `KubeProxyConfiguration` v1alpha1) and its writer.

An operator's kube-proxy ConfigMap carries over: every v1alpha1 field is known here (the field
set of k8s.io/kube-proxy/config/v1alpha1/types.go, defaults from pkg/proxy/apis/config/v1alpha1/
defaults.go). Each field is one of:

* **applied**: one setting of agent/settings/table.py (`FIELDS[path]`), the same setting a flag
  sets, so the file and the command line go through one table and a flag given on the command
  line overrides the file;
* **not applicable** (IPVS, nftables, Windows, profiling, logging format, ...): accepted, and a
  warning names it when its value differs from upstream's default, since only then did the
  operator ask for something this agent will not do;
* an unknown field, a wrong type or an invalid value is refused: `ConfigFileError` carries one
  line per problem naming the field path and what is allowed, and the agent exits with status 2.
  (Upstream decodes v1alpha1 leniently after a strict failure and only logs; refusing here turns a
  typo such as `nodePortAdresses` into an error instead of a silently ignored setting.)

The file itself must be a regular file of at most 1 MiB holding one document; it is decoded by
the services file's hardened decoder (agent/sources/decode.py: no aliases, tags or endless
numbers) with duplicate keys refused, as kube-proxy's strict decoding (sigs.k8s.io/yaml) refuses
them; integers must fit the int32 and uint32 fields they fill.

Values upstream accepts but this agent cannot honour are refused, not ignored: `mode: ipvs` or
`nftables`. `mode: ""` means this agent's default (eBPF),
not kube-proxy's iptables.

Durations are Go durations (`30s`, `1h0m0s`) as metav1.Duration; a zero sync period means "the
default", as upstream's defaulting does. `document` produces the effective configuration in the
same shape (what `--write-config-to` writes and `/configz` shows), and `render_yaml` prints it as
kube-proxy's writer does: keys sorted, strings quoted only when YAML would misread them.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from agent.readfile import read_regular, reason
from agent.settings.table import BY_PATH, SETTINGS, Setting
from agent.sources.decode import Refused, decode

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"

# A KubeProxyConfiguration is about 2 KB with every field set.
MAX_BYTES = 1 << 20
WANTED = f"give the path of one {KIND} document (YAML or JSON, at most {MAX_BYTES >> 20} MiB)"


class ConfigFileError(ValueError):
    """The file cannot be used; `problems` holds one line per field."""

    def __init__(self, source: str, problems: Iterable[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__(f"{source}: " + "; ".join(self.problems))


# ------------------------------------------------------------------------------------ schema

FIELDS: Mapping[str, Setting] = BY_PATH  # every v1alpha1 field, from the settings table
_OBJECTS = {path.rpartition(".")[0] for path in FIELDS if "." in path}
_OBJECTS |= {p.rpartition(".")[0] for p in _OBJECTS if "." in p}


@dataclass(frozen=True)
class FileSettings:
    """What a configuration file says, as setting names (only the fields it sets)."""

    values: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    given: Mapping[str, Any] = field(default_factory=dict)  # path -> value as written, every field


# ------------------------------------------------------------------------------------- parse


def load(path: str) -> FileSettings:
    """Read and check a KubeProxyConfiguration file (YAML or JSON): a regular file of at most
    MAX_BYTES, decoded by the services file's hardened decoder with duplicate keys refused."""
    try:
        data = read_regular(path, MAX_BYTES)
    except OSError as exc:
        raise ConfigFileError(path, [f"cannot read it: {reason(exc)}; {WANTED}"]) from None
    try:
        docs = decode(data, max_bytes=MAX_BYTES, unique_keys=True)
    except Refused as exc:
        raise ConfigFileError(path, [f"not a usable YAML or JSON document: {exc}"]) from None
    if len(docs) != 1:
        raise ConfigFileError(path, [f"{len(docs)} YAML documents; {WANTED}"])
    return parse(docs[0], path)


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
        setting = FIELDS[path]
        if raw is None:
            continue  # JSON null: the field keeps its default, as Go's decoder leaves it unset
        try:
            value = setting.kind.file(raw)
        except ValueError as exc:
            problems.append(f"{path}: Invalid value: {_show(raw)}: {exc}")
            continue
        if setting.applies:
            if value is not None:  # None: "the default" (a zero sync period, an empty mode)
                values[setting.name] = value
        elif value != setting.default:
            warnings.append(f"{path} is set to {_show(raw)} but does not apply: {setting.ignored}; ignored")
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


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | int | float | bool | type(None)) else repr(value)


# ---------------------------------------------------------------------------------- document


def document(values: Mapping[str, Any], given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The effective configuration as a v1alpha1 KubeProxyConfiguration (every field, defaults
    included, as kube-proxy's --write-config-to writes it): each field of the settings table from
    the resolved `values`; a field that does not apply keeps what the file said (`given`, path ->
    value as written), else upstream's default."""
    given = given or {}
    doc: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND}
    for setting in SETTINGS:
        if not setting.path:
            continue
        if setting.applies:
            value = setting.kind.dump(values[setting.name])
        elif given.get(setting.path) is not None:
            value = given[setting.path]
        else:
            value = setting.kind.dump(setting.default)
        if setting.written == "given" and setting.path not in given:
            continue
        if setting.written == "omitempty" and not value:
            continue
        node = doc
        *parents, leaf = setting.path.split(".")
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
