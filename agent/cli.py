"""Command line: `agent [flags]` runs the proxy; `agent inspect ...` reads what a node holds.

Flags read like kube-proxy's where the meaning is the same, so an operator's muscle memory and
DaemonSet manifests carry over; eBPF-only knobs start with `--bpf-`. Boolean flags take pflag's
forms (`--masquerade-all`, `--masquerade-all=true|false`). A bad flag exits with status 2 and a
message that says what is wrong and what would be right.

`--config FILE` reads a KubeProxyConfiguration (agent.configfile). Precedence, lowest first:
defaults, the file, flags given on the command line (`given_dests` finds which ones were given,
by parsing again with every default suppressed). Unlike kube-proxy, which ignores most flags when
--config is set, a flag here always wins, so one DaemonSet argument can adjust a shared
ConfigMap. `--write-config-to FILE` writes the effective configuration as v1alpha1 and exits.

The minimum sync period defaults by mode: 1 s in iptables mode (kube-proxy's default: an
iptables-restore per change would cost too much), 100 ms in eBPF mode, where a sync writes only
the map entries that changed; the floor still turns a burst of events into one sync.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent import configfile
from agent.config import DEFAULT_PIN_PATH, DEFAULT_POD_INTERFACES, Config, ConntrackSettings, MapSizes, Mode
from agent.ebpf.abi import MAPS
from agent.goformat import DurationError, format_duration
from agent.goformat import parse_duration as parse_go_duration

EPILOG = """\
examples:
  agent --services-file examples/services.yaml --hostname-override node1
        run in eBPF mode from a YAML file of Services and EndpointSlices
  agent --config /var/lib/kube-proxy/config.conf --hostname-override node1
        take kube-proxy's KubeProxyConfiguration file (flags given here override it)
  agent --config kube-proxy.yaml --write-config-to effective.yaml
        check a configuration file and write the effective configuration, then exit
  agent --mode=iptables --services-file svc.yaml --dry-run
        print the iptables-restore text kube-proxy's layout gives, touch nothing
  agent --mode=ebpf --services-file svc.yaml --node-ip 192.168.0.11 --dry-run
        print the BPF map entries the agent would write, one per line
  agent --cleanup
        remove every rule, program, map and pin either mode installed
  agent inspect maps --bpf-pin-path /sys/fs/bpf/ebpf-kube-proxy
        decode the live service maps of this node
"""


def parse_duration(text: str) -> float:
    """Go durations as kube-proxy's flags take them (`30s`, `1m`, `1m30s`, `500ms`); a bare
    number is taken as seconds too."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_go_duration(text.strip())
    except DurationError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration (use e.g. 30s, 1m, 500ms): {exc}"
        ) from None


def _nonnegative_duration(text: str) -> float:
    seconds = parse_duration(text)
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return seconds


def _csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _cidrs(text: str) -> tuple[str, ...]:
    try:
        return configfile.cidr_list(_csv(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nodeport_addresses(text: str) -> tuple[str, ...]:
    try:
        return configfile.nodeport_addresses(_csv(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bind(default_port: int) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            return configfile.bind_address(text, default_port)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(text)


def _ipv4(text: str) -> str:
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4 address") from None


def _port_range(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)-(\d+)", text)
    if not m or not 1024 <= int(m[1]) <= int(m[2]) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range like 61000-65535 (within 1024-65535)")
    return int(m[1]), int(m[2])


def _bool(text: str) -> bool:
    """kube-proxy's boolean flags take `--flag=true|false` (pflag also accepts 1/0, t/f)."""
    if text.lower() not in ("true", "false", "1", "0", "t", "f"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() in ("true", "1", "t")


def _flag_bool(p: argparse.ArgumentParser, *names: str, default: bool, help: str) -> None:
    """A pflag-style boolean: `--flag` alone is true, `--flag=false` is false."""
    p.add_argument(
        *names, type=_bool, nargs="?", const=True, default=default, metavar="true|false", help=help
    )


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def _size_help(role: str, default: int) -> str:
    spec = MAPS[role]
    if default == 0:
        return (
            f"entries of map {spec.name} (default: 2 x kube-proxy's conntrack max for TCP, 1 x for the"
            " rest: max(conntrack.maxPerCore x CPUs, conntrack.min) flows; a pinned table keeps its size)"
        )
    return f"entries of map {spec.name} (default {default})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agent",
        description="ebpf-kube-proxy: a kube-proxy replacement with an eBPF data path.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--mode",
        "--proxy-mode",
        dest="mode",
        choices=[m.value for m in Mode],
        default="ebpf",
        help="data path: ebpf (default) or iptables (kube-proxy's layout)",
    )
    p.add_argument(
        "--config", default="", metavar="FILE", help="kube-proxy's KubeProxyConfiguration file (v1alpha1)"
    )
    p.add_argument(
        "--write-config-to",
        default="",
        metavar="FILE",
        help="write the effective configuration here and exit",
    )
    p.add_argument("--hostname-override", default="", help="name of the node this agent acts for")
    p.add_argument("--services-file", default="", help="YAML file of Services and EndpointSlices to watch")
    p.add_argument("--kubeconfig", default="", help="kubeconfig of the API server (default: in-cluster)")
    p.add_argument("--master", default="", help="API server URL (overrides the kubeconfig's server)")
    p.add_argument(
        "--healthz-bind-address",
        type=_bind(configfile.HEALTHZ_PORT),
        default=f"0.0.0.0:{configfile.HEALTHZ_PORT}",
        metavar="IP[:PORT]",
        help="/healthz and /livez (empty: off)",
    )
    p.add_argument(
        "--metrics-bind-address",
        type=_bind(configfile.METRICS_PORT),
        default=f"127.0.0.1:{configfile.METRICS_PORT}",
        metavar="IP[:PORT]",
        help="/metrics, /proxyMode, /configz (empty: off; 0.0.0.0:10249 for every interface)",
    )
    _flag_bool(
        p, "--bind-address-hard-fail", default=False, help="exit when a healthz/metrics port cannot be bound"
    )
    _flag_bool(p, "--cleanup", default=False, help="remove everything either mode installed, then exit")
    p.add_argument(
        "--cleanup-kube-proxy",
        action="store_true",
        help="remove what a previous kube-proxy left on this node (its KUBE-* chains in both iptables "
        "backends, its nftables tables), then exit; the Helm chart's init container runs this",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be written and exit (no root)")
    p.add_argument(
        "--cluster-cidr", type=_cidrs, default=(), help="pod CIDRs; traffic from elsewhere is masqueraded"
    )
    _flag_bool(p, "--masquerade-all", default=False, help="SNAT all traffic to service IPs (both modes)")
    p.add_argument(
        "--iptables-masquerade-bit",
        type=int,
        default=14,
        choices=range(32),
        metavar="0-31",
        help="the fwmark bit KUBE-MARK-MASQ sets on packets to masquerade (iptables mode; "
        "kube-proxy's default 14)",
    )
    p.add_argument(
        "--nodeport-addresses",
        type=_nodeport_addresses,
        default=(),
        help="CIDRs, or primary / localhost / all, of the node addresses NodePorts answer on (default: all)",
    )
    p.add_argument(
        "--node-ip",
        type=_ipv4,
        action="append",
        default=[],
        help="a node address (repeatable); default: the addresses on --devices",
    )
    p.add_argument(
        "--iptables-sync-period",
        "--sync-period",
        dest="iptables_sync_period",
        type=parse_duration,
        default=configfile.SYNC_PERIOD_S,
        help="full resync period (default 30s)",
    )
    p.add_argument(
        "--iptables-min-sync-period",
        "--min-sync-period",
        dest="iptables_min_sync_period",
        type=parse_duration,
        default=None,
        help="minimum time between syncs (default 1s in iptables mode, 100ms in eBPF mode)",
    )
    p.add_argument(
        "--iptables-backend",
        choices=["auto", "nft", "legacy"],
        default="auto",
        help="iptables binary family (auto: the one the node already uses)",
    )
    _flag_bool(
        p,
        "--iptables-localhost-nodeports",
        default=True,
        help="NodePorts also answer on 127.0.0.1 (iptables; sets route_localnet)",
    )
    conntrack = ConntrackSettings()
    p.add_argument(
        "--conntrack-max-per-core",
        type=_count,
        default=conntrack.max_per_core,
        metavar="N",
        help="conntrack entries to allow per CPU (0: leave nf_conntrack_max and --conntrack-min alone)",
    )
    p.add_argument(
        "--conntrack-min", type=_count, default=conntrack.min, metavar="N", help="conntrack entries at least"
    )
    p.add_argument(
        "--conntrack-tcp-timeout-established",
        type=_nonnegative_duration,
        default=conntrack.tcp_established_timeout_s,
        metavar="DURATION",
        help="idle timeout of established TCP flows (0: leave as is; default 24h)",
    )
    p.add_argument(
        "--conntrack-tcp-timeout-close-wait",
        type=_nonnegative_duration,
        default=conntrack.tcp_close_wait_timeout_s,
        metavar="DURATION",
        help="timeout of TCP flows in CLOSE_WAIT (default 1h)",
    )
    _flag_bool(
        p,
        "--conntrack-tcp-be-liberal",
        default=conntrack.tcp_be_liberal,
        help="nf_conntrack_tcp_be_liberal=1",
    )
    p.add_argument(
        "--conntrack-udp-timeout",
        type=_nonnegative_duration,
        default=conntrack.udp_timeout_s,
        metavar="DURATION",
        help="idle timeout of UNREPLIED UDP flows (0: leave as is)",
    )
    p.add_argument(
        "--conntrack-udp-timeout-stream",
        type=_nonnegative_duration,
        default=conntrack.udp_stream_timeout_s,
        metavar="DURATION",
        help="idle timeout of ASSURED UDP flows (0: leave as is)",
    )
    p.add_argument("--netns", default="", help="network namespace to program (default: the agent's own)")
    p.add_argument("--devices", type=_csv, default=(), help="external devices (default: those with node IPs)")
    p.add_argument(
        "--pod-interfaces",
        type=_csv,
        default=tuple(DEFAULT_POD_INTERFACES.split(",")),
        help=f"glob patterns of pod-facing devices (default {DEFAULT_POD_INTERFACES})",
    )
    p.add_argument("--bpf-pin-path", default=DEFAULT_PIN_PATH, help="bpffs directory for our pinned maps")
    p.add_argument(
        "--bpf-snat-ports",
        type=_port_range,
        default=(61000, 65535),
        help="source ports for SNAT (must not overlap --node-port-range nor the node's ip_local_port_range)",
    )
    p.add_argument(
        "--node-port-range",
        type=_port_range,
        default=(30000, 32767),
        help="the cluster's NodePort range (the apiserver's --service-node-port-range)",
    )
    _flag_bool(
        p,
        "--bpf-keep-client-ip-for-local-backends",
        default=False,
        help="externalTrafficPolicy Cluster: keep the client's address toward backends on this node"
        " (kube-proxy masquerades it; default false)",
    )
    for role, default in vars(MapSizes()).items():
        p.add_argument(
            MAPS[role].size_flag,
            dest=f"bpf_{role}_max",
            type=_positive,
            default=default,
            metavar="N",
            help=_size_help(role, default),
        )
    p.add_argument(
        "-v", "--v", dest="verbosity", type=int, default=2, help="log verbosity (kube-proxy style)"
    )
    return p


def given_dests(argv: Sequence[str]) -> frozenset[str]:
    """The argparse dests the command line set explicitly (a flag equal to its default counts)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(list(argv))))


def config_from_args(ns: argparse.Namespace) -> Config:
    sizes = MapSizes(**{role: getattr(ns, f"bpf_{role}_max") for role in vars(MapSizes())})
    mode = Mode(ns.mode)
    min_sync = ns.iptables_min_sync_period
    if min_sync is None:
        min_sync = configfile.default_min_sync_period(mode.value)
    return Config(
        mode=mode,
        hostname=(ns.hostname_override or socket.gethostname()).strip().lower(),
        services_file=ns.services_file,
        kubeconfig=ns.kubeconfig,
        master=ns.master,
        healthz_bind_address=ns.healthz_bind_address,
        metrics_bind_address=ns.metrics_bind_address,
        bind_address_hard_fail=ns.bind_address_hard_fail,
        conntrack=ConntrackSettings(
            max_per_core=ns.conntrack_max_per_core,
            min=ns.conntrack_min,
            tcp_established_timeout_s=ns.conntrack_tcp_timeout_established,
            tcp_close_wait_timeout_s=ns.conntrack_tcp_timeout_close_wait,
            tcp_be_liberal=ns.conntrack_tcp_be_liberal,
            udp_timeout_s=ns.conntrack_udp_timeout,
            udp_stream_timeout_s=ns.conntrack_udp_timeout_stream,
        ),
        netns=ns.netns,
        dry_run=ns.dry_run,
        cleanup=ns.cleanup,
        cleanup_kube_proxy=ns.cleanup_kube_proxy,
        cluster_cidr=ns.cluster_cidr,
        masquerade_all=ns.masquerade_all,
        masquerade_bit=ns.iptables_masquerade_bit,
        nodeport_addresses=ns.nodeport_addresses,
        node_ips=tuple(ns.node_ip),
        sync_period_s=ns.iptables_sync_period,
        min_sync_period_s=min_sync,
        devices=ns.devices,
        pod_interfaces=ns.pod_interfaces,
        pin_path=ns.bpf_pin_path,
        map_sizes=sizes,
        snat_ports=ns.bpf_snat_ports,
        nodeport_range=ns.node_port_range,
        bpf_keep_client_ip_local=ns.bpf_keep_client_ip_for_local_backends,
        iptables_backend=ns.iptables_backend,
        iptables_localhost_nodeports=ns.iptables_localhost_nodeports,
    )


@dataclass(frozen=True)
class Resolved:
    """The command line and the configuration file, merged and checked."""

    config: Config
    namespace: argparse.Namespace
    warnings: tuple[str, ...] = ()
    file_fields: Mapping[str, Any] = field(default_factory=dict)  # the file's fields as written

    def document(self) -> dict[str, Any]:
        """The effective configuration as a KubeProxyConfiguration (--write-config-to, /configz)."""
        return configfile.document(
            self.config,
            hostname_override=self.namespace.hostname_override.strip().lower(),
            verbosity=self.namespace.verbosity,
            given=self.file_fields,
        )


class UsageError(Exception):
    """The flags or the configuration file are wrong; each line says what and what is allowed."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.lines = tuple(lines)
        super().__init__("; ".join(self.lines))


def resolve(argv: Sequence[str]) -> Resolved:
    """Flags over file over defaults. UsageError for a bad file or an inconsistent result; a bad
    flag ends in argparse's own exit 2, as before."""
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    warnings: tuple[str, ...] = ()
    file_fields: Mapping[str, Any] = {}
    if ns.config:
        try:
            settings = configfile.load(ns.config)
        except configfile.ConfigFileError as exc:
            raise UsageError([f"--config {exc.source}: {problem}" for problem in exc.problems]) from None
        given = given_dests(argv)
        for dest, value in settings.values.items():
            if dest not in given:
                setattr(ns, dest, value)
        warnings = tuple(f"--config {ns.config}: {w}" for w in settings.warnings)
        file_fields = settings.given
    config = config_from_args(ns)
    if config.min_sync_period_s > config.sync_period_s:
        raise UsageError(
            [
                f"the minimum sync period ({format_duration(config.min_sync_period_s)}) exceeds the sync "
                f"period ({format_duration(config.sync_period_s)}): --iptables-min-sync-period / "
                "iptables.minSyncPeriod must not exceed --iptables-sync-period / iptables.syncPeriod"
            ]
        )
    if config.sync_period_s <= 0:
        raise UsageError(["--iptables-sync-period / iptables.syncPeriod must be greater than 0"])
    return Resolved(config, ns, warnings, file_fields)


def setup_logging(verbosity: int) -> None:
    level = logging.DEBUG if verbosity >= 4 else logging.INFO if verbosity >= 1 else logging.WARNING
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname).1s %(name)s: %(message)s"
    )


def write_config(resolved: Resolved, path: str) -> int:
    """kube-proxy's --write-config-to: the effective configuration as YAML, then exit 0."""
    text = configfile.render_yaml(resolved.document())
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        print(f"agent: --write-config-to {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    logging.getLogger("agent").info("wrote the effective configuration to %s", path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "inspect":
        from agent.inspect import main as inspect_main

        return inspect_main(args[1:])
    try:
        resolved = resolve(args)
    except UsageError as exc:
        for line in exc.lines:
            print(f"agent: {line}", file=sys.stderr)
        return 2
    setup_logging(resolved.namespace.verbosity)
    for warning in resolved.warnings:
        logging.getLogger("agent").warning("%s", warning)
    if resolved.namespace.write_config_to:
        return write_config(resolved, resolved.namespace.write_config_to)
    from agent import configfile
    from agent.app import run

    return run(resolved.config, configz=lambda: configfile.configz(resolved.document()))


if __name__ == "__main__":
    sys.exit(main())
