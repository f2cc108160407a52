"""kube-proxy's conntrack settings written to the node's sysctls, as kube-proxy does at start.

Follows cmd/kube-proxy/app/server_linux.go (`setupConntrack`, `getConntrackMax`) and conntrack.go
(`realConntracker`): nf_conntrack_max = max(maxPerCore x CPUs, min) when maxPerCore > 0, and the
hash table grown to max/4 buckets when it is smaller; then the TCP established and close-wait
timeouts, tcp_be_liberal, and the UDP timeouts, each only when set (0 / false = leave the kernel's
value). A value already in place is not written again.

Where the agent runs for a node in its own network namespace (`--netns`, the lab), not every one of
these can be written. Seen on Linux 6.18: in a non-initial namespace `nf_conntrack_max` and
`nf_conntrack_buckets` are read-only (mode 0444; writing fails with EINVAL) and the global
`/sys/module/nf_conntrack/parameters/hashsize` refuses writers outside the initial namespace,
while the timeouts and `nf_conntrack_tcp_be_liberal` are per namespace and writable. kube-proxy
tolerates the read-only case (a read-only /sys is logged as an event and it goes on); we log each
setting that could not be applied, say why and what value applies instead, and go on.

`plan` is pure (`conntrack_max`, upstream's getConntrackMax, is agent.config's);
`apply_conntrack_settings` runs `sysctl` through the runner's `command` (so inside the node's
namespace, and replaceable by a fake).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.config import ConntrackSettings, conntrack_max
from agent.iptables.runner import Result

log = logging.getLogger(__name__)

HASHSIZE_PATH = "/sys/module/nf_conntrack/parameters/hashsize"
MAX_KEY = "net.netfilter.nf_conntrack_max"
# Set only from the initial network namespace (read-only elsewhere, see above).
INIT_NET_ONLY = (MAX_KEY, HASHSIZE_PATH)


@dataclass(frozen=True)
class Setting:
    key: str  # a sysctl key, or HASHSIZE_PATH
    value: int


@dataclass
class ConntrackReport:
    """What applying the settings did: (key, old, new) written, keys already right, and
    (key, wanted, reason) for the ones the kernel refused."""

    written: list[tuple[str, str, int]] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    refused: list[tuple[str, int, str]] = field(default_factory=list)


def plan(settings: ConntrackSettings, cpus: int) -> list[Setting]:
    """The settings to make, in kube-proxy's order (hashsize is decided against the live value)."""
    out: list[Setting] = []
    limit = conntrack_max(settings, cpus)
    if limit > 0:
        out.append(Setting(MAX_KEY, limit))
    timeouts = (
        ("net.netfilter.nf_conntrack_tcp_timeout_established", settings.tcp_established_timeout_s),
        ("net.netfilter.nf_conntrack_tcp_timeout_close_wait", settings.tcp_close_wait_timeout_s),
    )
    out += [Setting(key, int(seconds)) for key, seconds in timeouts if seconds > 0]
    if settings.tcp_be_liberal:
        out.append(Setting("net.netfilter.nf_conntrack_tcp_be_liberal", 1))
    udp = (
        ("net.netfilter.nf_conntrack_udp_timeout", settings.udp_timeout_s),
        ("net.netfilter.nf_conntrack_udp_timeout_stream", settings.udp_stream_timeout_s),
    )
    out += [Setting(key, int(seconds)) for key, seconds in udp if seconds > 0]
    return out


def _why(key: str, error: str, current: str, netns: str) -> str:
    if key in INIT_NET_ONLY and netns:
        return (
            f"{error}; the kernel lets only the initial network namespace change it, so the "
            f"host's value ({current or 'unknown'}) applies to this node"
        )
    return error


def apply_conntrack_settings(
    settings: ConntrackSettings,
    command: Callable[[Sequence[str]], Result],
    *,
    netns: str = "",
    cpus: int | None = None,
) -> ConntrackReport:
    """Write the settings in the namespace `command` runs in; never raises for a refused one."""
    report = ConntrackReport()
    where = f"netns {netns}" if netns else "the host"
    for setting in plan(settings, cpus or os.cpu_count() or 1):
        current = command(["sysctl", "-n", setting.key])
        old = current.stdout.strip()
        if current.returncode == 0 and old == str(setting.value):
            report.unchanged.append(setting.key)
        else:
            w = command(["sysctl", "-w", f"{setting.key}={setting.value}"])
            # procps sysctl exits 0 even when the kernel refuses the write: read it back.
            after = command(["sysctl", "-n", setting.key])
            if w.returncode == 0 and after.returncode == 0 and after.stdout.strip() == str(setting.value):
                report.written.append((setting.key, old, setting.value))
                log.info("conntrack: set %s=%d in %s (was %s)", setting.key, setting.value, where, old or "?")
            else:
                reason = _why(
                    setting.key, (w.stderr or w.stdout).strip() or f"exit {w.returncode}", old, netns
                )
                report.refused.append((setting.key, setting.value, reason))
                log.warning(
                    "conntrack: cannot set %s=%d in %s (%s); continuing without it, as kube-proxy does",
                    setting.key,
                    setting.value,
                    where,
                    reason,
                )
        if setting.key == MAX_KEY:
            _hashsize(setting.value, command, report, netns, where)
    return report


def _hashsize(
    limit: int, command: Callable[[Sequence[str]], Result], report: ConntrackReport, netns: str, where: str
) -> None:
    """Grow the hash table to limit/4 buckets when it is smaller (upstream SetMax)."""
    read = command(["cat", HASHSIZE_PATH])
    try:
        current = int(read.stdout.strip())
    except ValueError:
        report.refused.append((HASHSIZE_PATH, limit // 4, f"cannot read it: {read.stderr.strip()}"))
        log.warning(
            "conntrack: cannot read %s (%s); hash size left alone", HASHSIZE_PATH, read.stderr.strip()
        )
        return
    if current >= limit // 4:
        report.unchanged.append(HASHSIZE_PATH)
        return
    w = command(["sh", "-c", 'echo "$1" > "$2"', "sh", str(limit // 4), HASHSIZE_PATH])
    if w.returncode == 0:
        report.written.append((HASHSIZE_PATH, str(current), limit // 4))
        log.info("conntrack: set hash size to %d in %s (was %d)", limit // 4, where, current)
        return
    reason = _why(HASHSIZE_PATH, w.stderr.strip() or f"exit {w.returncode}", str(current), netns)
    report.refused.append((HASHSIZE_PATH, limit // 4, reason))
    log.warning(
        "conntrack: cannot set the hash size to %d in %s (%s); continuing without it, as kube-proxy does",
        limit // 4,
        where,
        reason,
    )
