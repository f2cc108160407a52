"""`--init-only`: the node set-up that needs full privileges, done once, then exit.

kube-proxy's `--init-only` (v1.29+) lets a privileged init container do what the long-running,
CAP_NET_ADMIN-only proxy cannot: kernel settings written through /proc/sys, which a container
runtime mounts read-only unless the container is privileged. This does the same for each mode:

* both modes: `net.ipv4.ip_forward=1` (the node forwards Service traffic to pods on other nodes)
  and kube-proxy's conntrack sysctls (`nf_conntrack_max` and the timeouts: `--conntrack-*`);
* iptables mode with localhost NodePorts (`--iptables-localhost-nodeports`, the default):
  `net.ipv4.conf.all.route_localnet=1`, as kube-proxy's iptables proxier sets it;
* eBPF mode: bpffs mounted on /sys/fs/bpf when the pins go there and it is missing, so the pinned
  maps outlive the agent's container.

Every setting is read back; the exit status is 1 when a required one could not be made (the
conntrack ones are logged and tolerated, as kube-proxy tolerates them). The conntrack sysctls are
also written at every start of the agent, in either mode (`setup_conntrack`, as kube-proxy's
platformSetup), so a node whose container may write them needs no init container for them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from agent.config import Config, Mode
from agent.iptables.conntrack_sysctls import HASHSIZE_PATH, ConntrackReport, apply_conntrack_settings
from agent.iptables.runner import Result, SubprocessRunner
from agent.netns import run_in_netns

log = logging.getLogger(__name__)

Command = Callable[[Sequence[str]], Result]


def required_sysctls(config: Config) -> list[tuple[str, str]]:
    out = [("net.ipv4.ip_forward", "1")]
    if config.mode is Mode.IPTABLES and config.iptables_localhost_nodeports:
        out.append(("net.ipv4.conf.all.route_localnet", "1"))
    return out


def set_sysctl(command: Command, key: str, value: str) -> str:
    """Write and read back; returns "" when done, else why not."""
    w = command(["sysctl", "-w", f"{key}={value}"])
    after = command(["sysctl", "-n", key])
    if after.returncode == 0 and after.stdout.strip() == value:
        return ""
    return (w.stderr or w.stdout or after.stderr).strip() or f"exit {w.returncode}"


def setup_conntrack(
    config: Config, command: Command | None = None, cpus: int | None = None
) -> ConntrackReport:
    """kube-proxy's conntrack sysctls (`--conntrack-*`), written at every start in either mode,
    as kube-proxy's platformSetup writes them whatever its mode: nf_conntrack still tracks the
    node's other traffic in eBPF mode (upstream's CLOSE_WAIT e2e test reads such an entry).
    A value the kernel refuses is logged and tolerated."""
    run = command or reads_in_process(SubprocessRunner(config).command, config.netns)
    return apply_conntrack_settings(config.conntrack, run, netns=config.netns, cpus=cpus)


def reads_in_process(command: Command, netns: str) -> Command:
    """`command`, with `sysctl -n KEY` and `cat FILE` of a file under /proc/sys (or the conntrack
    hash size) answered by reading the file from a thread in `netns` instead of an `ip netns exec`
    and a tool process each: 5 of the 6 to 8 processes every lab start's conntrack settings ran.
    A read that fails goes to `command` after all, so the error logged is the tool's own, as
    before. Only /proc/sys follows the reading thread's namespace (the kernel looks its tables up
    in the thread's own); /proc/net shows the main thread's and /sys/class/net the one sysfs was
    mounted in, the host's here, so a `cat` of anything else runs the tool, in the namespace."""

    def run(argv: Sequence[str]) -> Result:
        if len(argv) == 3 and argv[0] == "sysctl" and argv[1] == "-n":
            path = "/proc/sys/" + argv[2].replace(".", "/")
        elif len(argv) == 2 and argv[0] == "cat" and _per_thread(argv[1]):
            path = argv[1]
        else:
            return command(argv)
        try:
            return Result(0, run_in_netns(netns, lambda: _read(path)), "")
        except OSError:
            return command(argv)

    return run


def _per_thread(path: str) -> bool:
    """A file a thread in the namespace reads as that namespace's: a sysctl, or the hash size (a
    module parameter: one for the host, whichever namespace reads it)."""
    return path == HASHSIZE_PATH or os.path.normpath(path).startswith("/proc/sys/")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def init_node(config: Config, command: Command | None = None) -> int:
    run = command or SubprocessRunner(config).command
    where = f"netns {config.netns}" if config.netns else "the host"
    failed = False
    for key, value in required_sysctls(config):
        why = set_sysctl(run, key, value)
        if why:
            failed = True
            log.error("--init-only: cannot set %s=%s in %s: %s", key, value, where, why)
        else:
            log.info("--init-only: %s=%s in %s", key, value, where)
    setup_conntrack(config, run)
    if config.mode is Mode.EBPF:
        from agent.ebpf.loader import DatapathError, ensure_bpffs

        try:
            ensure_bpffs(config.pin_path)
        except (OSError, DatapathError) as exc:
            failed = True
            log.error("--init-only: %s", exc)
    if failed:
        return 1
    log.info("--init-only: the node is ready for the %s mode; exiting", config.mode.value)
    return 0
