"""Command line: `agent [flags]` runs the proxy; `agent inspect ...` reads what a node holds;
`agent doctor [flags]` checks the node for the mode (agent/doctor).

Every flag comes from the settings table (agent/settings/table.py): kube-proxy's flags (v1.31)
with their meaning, and the agent's own (`--bpf-*`, `--node-ip`, ...). Parsing follows pflag
(agent/settings/flags.py): no abbreviations, `--flag` / `--flag=false` for booleans. A bad flag
or file exits with status 2 and one line per problem saying what is wrong and what is allowed.

`--config FILE` reads a KubeProxyConfiguration (agent.configfile). Precedence, lowest first:
defaults, the file, flags given on the command line. Unlike kube-proxy, which ignores most flags
when --config is set, a flag here always wins, so one DaemonSet argument can adjust a shared
ConfigMap. `--write-config-to FILE` writes the effective configuration as v1alpha1 and exits.

The minimum sync period defaults by mode: 1 s in iptables mode (kube-proxy's default: an
iptables-restore per change would cost too much), 100 ms in eBPF mode, where a sync writes only
the map entries that changed; the floor still turns a burst of events into one sync.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent import configfile
from agent.config import Config, Mode, default_min_sync_period
from agent.configfile import render_yaml
from agent.goformat import format_duration
from agent.localdetect import LocalMode
from agent.settings.flags import FlagError, parse_flags
from agent.settings.flags import build_parser as _build_parser
from agent.settings.table import BY_NAME, defaults

log = logging.getLogger("agent")

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
  agent doctor --mode=ebpf --kubeconfig /etc/kubernetes/proxy.conf
        check the node for the mode before switching (a checklist, exit 1 on a FAIL)
"""


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the settings table, with the examples as the epilog."""
    return _build_parser(EPILOG)


@dataclass(frozen=True)
class Resolved:
    """The command line and the configuration file, merged and checked."""

    config: Config
    values: Mapping[str, Any]  # every setting, by name, as in force
    warnings: tuple[str, ...] = ()  # the file's fields that do not apply
    notes: tuple[str, ...] = ()  # the flags given that do not apply
    file_fields: Mapping[str, Any] = field(default_factory=dict)  # the file's fields as written

    def document(self) -> dict[str, Any]:
        """The effective configuration as a KubeProxyConfiguration (--write-config-to, /configz)."""
        return configfile.document(self.values, self.file_fields)


class UsageError(Exception):
    """The flags or the configuration file are wrong; each line says what and what is allowed."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.lines = tuple(lines)
        super().__init__("; ".join(self.lines))


def resolve(argv: Sequence[str]) -> Resolved:
    """Flags over file over defaults; UsageError for a bad flag, a bad file or an inconsistent
    result."""
    try:
        given = parse_flags(argv, build_parser())
    except FlagError as exc:
        raise UsageError([str(exc)]) from None
    values: dict[str, Any] = defaults()
    warnings: tuple[str, ...] = ()
    file_fields: Mapping[str, Any] = {}
    path = given.get("config", "")
    if path:
        try:
            settings = configfile.load(path)
        except configfile.ConfigFileError as exc:
            raise UsageError([f"--config {exc.source}: {problem}" for problem in exc.problems]) from None
        values.update(settings.values)
        warnings = tuple(f"--config {path}: {w}" for w in settings.warnings)
        file_fields = settings.given
    values.update(given)
    if values["iptables_min_sync_period"] is None:
        values["iptables_min_sync_period"] = default_min_sync_period(Mode(values["mode"]))
    config = Config.from_values(values)
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
    if config.config_sync_period_s <= 0:
        raise UsageError(["--config-sync-period / configSyncPeriod must be greater than 0 (e.g. 15m)"])
    problem = _detector_problem(config)
    if problem:
        raise UsageError([problem])
    notes = tuple(
        f"{BY_NAME[name].flag} is accepted and ignored: {BY_NAME[name].ignored}"
        for name in given
        if not BY_NAME[name].applies
    )
    return Resolved(config, values, warnings, notes, file_fields)


def _detector_problem(config: Config) -> str:
    """What makes the local-traffic detector unusable (kube-proxy's validateDetectLocalConfiguration,
    and NodeCIDR's need of a Node), or ""."""
    mode = config.detect_local_mode
    if mode is LocalMode.BRIDGE_INTERFACE and not config.pod_bridge_interface:
        return (
            "--detect-local-mode=BridgeInterface needs the pods' bridge: --pod-bridge-interface / "
            "detectLocal.bridgeInterface must not be empty (e.g. cni0)"
        )
    if mode is LocalMode.INTERFACE_NAME_PREFIX and not config.pod_interface_name_prefix:
        return (
            "--detect-local-mode=InterfaceNamePrefix needs the pod devices' name prefix: "
            "--pod-interface-name-prefix / detectLocal.interfaceNamePrefix must not be empty (e.g. veth)"
        )
    if mode is LocalMode.NODE_CIDR and config.services_file:
        return (
            "--detect-local-mode=NodeCIDR reads the Node's spec.podCIDRs from the API server: it cannot "
            "be used with --services-file (use ClusterCIDR with --cluster-cidr)"
        )
    return ""


def setup_logging(verbosity: int) -> None:
    level = logging.DEBUG if verbosity >= 4 else logging.INFO if verbosity >= 1 else logging.WARNING
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname).1s %(name)s: %(message)s"
    )


def write_config(resolved: Resolved, path: str) -> int:
    """kube-proxy's --write-config-to: the effective configuration as YAML, then exit 0."""
    text = render_yaml(resolved.document())
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        print(f"agent: --write-config-to {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    log.info("wrote the effective configuration to %s", path)
    return 0


def version() -> str:
    from importlib import metadata  # 15 ms of every start's imports, for --version alone

    try:
        return f"ebpf-kube-proxy {metadata.version('ebpf-kube-proxy')}"
    except metadata.PackageNotFoundError:
        return "ebpf-kube-proxy (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "inspect":
        from agent.inspect import main as inspect_main

        return inspect_main(args[1:])
    if args and args[0] == "doctor":
        from agent.doctor import main as doctor_main

        return doctor_main(args[1:])
    try:
        resolved = resolve(args)
    except UsageError as exc:
        for line in exc.lines:
            print(f"agent: {line}", file=sys.stderr)
        return 2
    if resolved.values["version"]:
        print(version())
        return 0
    setup_logging(resolved.values["verbosity"])
    for note in resolved.notes:
        log.info("%s", note)
    for warning in resolved.warnings:
        log.warning("%s", warning)
    if resolved.values["write_config_to"]:
        return write_config(resolved, resolved.values["write_config_to"])
    from agent.app import run

    return run(resolved.config, configz=lambda: configfile.configz(resolved.document()))


if __name__ == "__main__":
    sys.exit(main())
