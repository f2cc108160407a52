"""Command line: `agent [flags]` runs the proxy; `agent inspect ...` reads what a node holds.

Flags read like kube-proxy's where the meaning is the same, so an operator's muscle memory and
DaemonSet manifests carry over; eBPF-only knobs start with `--bpf-`. A bad flag exits with status 2
and a message that says what is wrong and what would be right.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import re
import socket
import sys
from collections.abc import Sequence

from agent.config import DEFAULT_PIN_PATH, DEFAULT_POD_INTERFACES, Config, MapSizes, Mode
from agent.ebpf.abi import MAPS

EPILOG = """\
examples:
  agent --services-file examples/services.yaml --hostname-override node1
        run in eBPF mode from a YAML file of Services and EndpointSlices
  agent --mode=iptables --services-file svc.yaml --dry-run
        print the iptables-restore text kube-proxy's layout gives, touch nothing
  agent --mode=ebpf --services-file svc.yaml --node-ip 192.168.0.11 --dry-run
        print the BPF map entries the agent would write, one per line
  agent --cleanup
        remove every rule, program, map and pin either mode installed
  agent inspect maps --bpf-pin-path /sys/fs/bpf/ebpf-kube-proxy
        decode the live service maps of this node
"""

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?(?:(\d+)ms)?$")


def parse_duration(text: str) -> float:
    """Go-style durations as kube-proxy takes them: `30s`, `1m`, `1m30s`, `500ms`, or seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    m = _DURATION.match(text.strip())
    if not text.strip() or not m or not any(m.groups()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (use e.g. 30s, 1m, 500ms)")
    h, mi, s, ms = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + s + ms / 1000


def _csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _cidrs(text: str) -> tuple[str, ...]:
    out = _csv(text)
    for c in out:
        try:
            ipaddress.ip_network(c, strict=False)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{c!r} is not a CIDR (e.g. 10.244.0.0/16)") from None
    return out


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
    """kube-proxy's boolean flags take `--flag=true|false`."""
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() in ("true", "1")


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
    p.add_argument("--hostname-override", default="", help="name of the node this agent acts for")
    p.add_argument("--services-file", default="", help="YAML file of Services and EndpointSlices to watch")
    p.add_argument("--kubeconfig", default="", help="kubeconfig for the API server (not in this version)")
    p.add_argument(
        "--cleanup", action="store_true", help="remove everything either mode installed, then exit"
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be written and exit (no root)")
    p.add_argument(
        "--cluster-cidr", type=_cidrs, default=(), help="pod CIDRs; traffic from elsewhere is masqueraded"
    )
    p.add_argument("--masquerade-all", action="store_true", help="SNAT all traffic to service IPs (iptables)")
    p.add_argument("--iptables-masquerade-bit", type=int, default=14, choices=range(32), metavar="0-31")
    p.add_argument(
        "--nodeport-addresses",
        type=_cidrs,
        default=(),
        help="CIDRs of node addresses NodePorts answer on (default: all)",
    )
    p.add_argument(
        "--node-ip",
        type=_ipv4,
        action="append",
        default=[],
        help="a node address (repeatable); default: the addresses on --devices",
    )
    p.add_argument("--iptables-sync-period", type=parse_duration, default=30.0, help="full resync period")
    p.add_argument(
        "--iptables-min-sync-period", type=parse_duration, default=1.0, help="minimum time between syncs"
    )
    p.add_argument(
        "--iptables-backend",
        choices=["auto", "nft", "legacy"],
        default="auto",
        help="iptables binary family (auto: the one the node already uses)",
    )
    p.add_argument(
        "--iptables-localhost-nodeports",
        type=_bool,
        default=True,
        metavar="true|false",
        help="NodePorts also answer on 127.0.0.1 (iptables; sets route_localnet)",
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
    p.add_argument(
        "--bpf-keep-client-ip-for-local-backends",
        dest="bpf_keep_client_ip_local",
        type=_bool,
        default=False,
        metavar="true|false",
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


def config_from_args(ns: argparse.Namespace) -> Config:
    sizes = MapSizes(**{role: getattr(ns, f"bpf_{role}_max") for role in vars(MapSizes())})
    return Config(
        mode=Mode(ns.mode),
        hostname=(ns.hostname_override or socket.gethostname()).lower(),
        services_file=ns.services_file,
        kubeconfig=ns.kubeconfig,
        netns=ns.netns,
        dry_run=ns.dry_run,
        cleanup=ns.cleanup,
        cluster_cidr=ns.cluster_cidr,
        masquerade_all=ns.masquerade_all,
        masquerade_bit=ns.iptables_masquerade_bit,
        nodeport_addresses=ns.nodeport_addresses,
        node_ips=tuple(ns.node_ip),
        sync_period_s=ns.iptables_sync_period,
        min_sync_period_s=ns.iptables_min_sync_period,
        devices=ns.devices,
        pod_interfaces=ns.pod_interfaces,
        pin_path=ns.bpf_pin_path,
        map_sizes=sizes,
        snat_ports=ns.bpf_snat_ports,
        nodeport_range=ns.node_port_range,
        bpf_keep_client_ip_local=ns.bpf_keep_client_ip_local,
        iptables_backend=ns.iptables_backend,
        iptables_localhost_nodeports=ns.iptables_localhost_nodeports,
    )


def setup_logging(verbosity: int) -> None:
    level = logging.DEBUG if verbosity >= 4 else logging.INFO if verbosity >= 1 else logging.WARNING
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname).1s %(name)s: %(message)s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "inspect":
        from agent.inspect import main as inspect_main

        return inspect_main(args[1:])
    parser = build_parser()
    ns = parser.parse_args(args)
    if ns.iptables_min_sync_period > ns.iptables_sync_period:
        parser.error("--iptables-min-sync-period must not exceed --iptables-sync-period")
    config = config_from_args(ns)
    setup_logging(ns.verbosity)
    from agent.app import run

    return run(config)


if __name__ == "__main__":
    sys.exit(main())
