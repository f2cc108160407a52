"""Running iptables: the small interface the proxier uses, and the real subprocess implementation.

`IptablesRunner` is all the proxier and the cleanup need: `restore` (one iptables-restore
--noflush per sync), `restore_test` (the same with --test, to find a rejected service), `save`
(iptables-save, to read the kernel back), `run` (one iptables command, always with the xtables
lock `-w`) and `command` (any other tool, e.g. conntrack or sysctl, in the same network namespace).
Tests pass a fake; `SubprocessRunner` is the real thing.

Choosing the binary family as kube-proxy's users expect (the iptables-wrapper logic shipped in
kube-proxy's image): the node's other components (kubelet, the CNI) have already written rules with
one of iptables-nft and iptables-legacy, and kube-proxy must use the same one or its rules are
invisible to half of the system. `choose_backend` looks, in order, for kubelet's hint chains
(KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY) or our own canary in nft's mangle table, then in legacy's
output, then compares rule counts; with nothing anywhere it picks nft. `--iptables-backend=nft|legacy`
skips the detection. The choice is logged once.

What no retry fixes is checked before the first command (`preflight`, also run by the runner on
first use): the capability to change netfilter (CAP_NET_ADMIN; CAP_SYS_ADMIN too to enter
`--netns`) and the binaries of the chosen family (`iptables`, `-save`, `-restore`, plus `ip` for
`--netns` and `sysctl` for localhost NodePorts). Each missing piece raises `FatalError` with the
fix; a failed command after that is transient (`IptablesError`) and retried by the runner. With
only one family installed, auto-detection takes it instead of asking the one that is not there.

IPv6: a runner of family 6 runs ip6tables-{nft,legacy}{,-save,-restore} with the backend its IPv4
twin chose (`follow`): kube-proxy's two proxiers always use one backend, and the node's other
components write both families with the same one.

Base-chain jumps are managed like upstream's EnsureRule: `-C` to check, `-I` to insert only when
missing, so repeated syncs never duplicate a jump (an iptables-restore --noflush would).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from agent import caps
from agent.config import Config, Mode
from agent.errors import FatalError

log = logging.getLogger(__name__)

# Seconds to wait for the xtables lock, as kube-proxy (`-w 5`).
LOCK_WAIT_SECONDS = "5"
RANDOM_FULLY_MIN_VERSION = (1, 6, 2)
IPV6_IN_EBPF_MODE = "eBPF mode's IPv6 Services (served by ip6tables)"
IF_INET6 = "/proc/net/if_inet6"  # the kernel's IPv6 addresses: absent when IPv6 is turned off
_HINT_RE = re.compile(r"^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY|KUBE-PROXY-CANARY) ", re.MULTILINE)


class IptablesError(RuntimeError):
    """An iptables command failed; the message carries its stderr."""


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str = ""
    stderr: str = ""


class IptablesRunner(Protocol):
    @property
    def backend(self) -> str:
        """ "nft" or "legacy"."""

    def restore(self, text: str) -> None:
        """iptables-restore --noflush --counters with the xtables lock; raise IptablesError on failure."""

    def restore_test(self, text: str) -> str | None:
        """iptables-restore --test: parse and build the ruleset without committing it. The error
        message when it would be rejected, else None (how a failing service is found)."""

    def save(self, table: str | None = None) -> str:
        """iptables-save output (one table, or all); raise IptablesError on failure."""

    def run(self, *args: str) -> Result:
        """One `iptables -w 5 ARGS...`; the caller interprets the return code."""

    def command(self, argv: Sequence[str]) -> Result:
        """Any other command, in the same network namespace."""

    def version(self) -> tuple[int, ...]:
        """The iptables version, e.g. (1, 8, 9)."""


def choose_backend(nft_mangle: str, legacy_all: str, nft_all: str | None = None) -> tuple[str, str]:
    """(backend, reason) from iptables-save outputs, as kube-proxy's iptables-wrapper decides.

    `nft_all` (the whole nft ruleset) is needed only when neither output holds a hint chain; with
    None the function returns ("", "need nft_all") in that case, so callers fetch it lazily.
    """
    if _HINT_RE.search(nft_mangle):
        return "nft", "kubelet/kube-proxy hint chains found in iptables-nft"
    if _HINT_RE.search(legacy_all):
        return "legacy", "kubelet/kube-proxy hint chains found in iptables-legacy"
    if nft_all is None:
        return "", "need nft_all"
    legacy_rules = sum(1 for line in legacy_all.splitlines() if line.startswith("-"))
    nft_rules = sum(1 for line in nft_all.splitlines() if line.startswith("-"))
    if legacy_rules > nft_rules:
        return "legacy", f"{legacy_rules} legacy rules vs {nft_rules} nft rules"
    if nft_rules:
        return "nft", f"{nft_rules} nft rules vs {legacy_rules} legacy rules"
    return "nft", "no rules in either; nft is the default"


def parse_version(text: str) -> tuple[int, ...]:
    """`iptables v1.8.9 (nf_tables)` -> (1, 8, 9); () when unreadable."""
    m = re.search(r"v(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return ()
    return tuple(int(g) for g in m.groups() if g is not None)


def supports_random_fully(version: tuple[int, ...]) -> bool:
    return version >= RANDOM_FULLY_MIN_VERSION


FAMILIES = ("nft", "legacy")


def family_tools(backend: str, binary: str = "iptables") -> tuple[str, ...]:
    return (f"{binary}-{backend}", f"{binary}-{backend}-save", f"{binary}-{backend}-restore")


def installed_families(
    which: Callable[[str], str | None] = shutil.which, binary: str = "iptables"
) -> list[str]:
    """The iptables families whose three binaries (of `binary`: iptables, ip6tables) are all on PATH."""
    return [b for b in FAMILIES if all(which(tool) for tool in family_tools(b, binary))]


def nat_chain_listable(config: Config, tool: str) -> str:
    """Why `tool` (an ip6tables binary) cannot list the nat table's POSTROUTING chain, "" when it
    can: upstream's `Present()` (utiliptables), what platformCheckSupported asks of each family. A
    kernel without IPv6 NAT (no ip6table_nat, or nf_tables without its nat chain type) fails here
    though the binaries are installed."""
    prefix = ["ip", "netns", "exec", config.netns] if config.netns else []
    try:
        done = subprocess.run(
            [*prefix, tool, "-w", "5", "-t", "nat", "-S", "POSTROUTING"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{tool} -t nat -S POSTROUTING: {exc}"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return f"{tool} -t nat -S POSTROUTING: exit {done.returncode}: {why[0] if why else 'no output'}"
    return ""


def ipv6_missing(
    config: Config,
    *,
    which: Callable[[str], str | None] = shutil.which,
    if_inet6: str = IF_INET6,
    nat_probe: Callable[[Config, str], str] = nat_chain_listable,
) -> str:
    """What this node lacks for an IPv6 proxier, "" when nothing: upstream's
    platformCheckSupported (cmd/kube-proxy/app/server_linux.go), which runs single-stack when
    ip6tables is not usable. Here: the kernel's IPv6 (`if_inet6` is absent when the node booted
    with ipv6.disable=1), ip6tables with its -save and -restore, of --iptables-backend when
    given, else of either backend, and a nat table that backend can list (`nat_probe`, upstream's
    Present())."""
    if not os.path.exists(if_inet6):
        return f"the kernel has IPv6 turned off ({if_inet6} is absent: booted with ipv6.disable=1?)"
    wanted = (config.iptables_backend,) if config.iptables_backend in FAMILIES else FAMILIES
    installed = [b for b in wanted if all(which(tool) for tool in family_tools(b, "ip6tables"))]
    if not installed:
        if len(wanted) == 1:
            return f"ip6tables-{wanted[0]} (with its -save and -restore) is not on PATH (--iptables-backend)"
        return "neither ip6tables-nft nor ip6tables-legacy (with its -save and -restore) is on PATH"
    failures = []
    for backend in installed:
        why = nat_probe(config, f"ip6tables-{backend}")
        if not why:
            return ""
        failures.append(why)
    return "the IPv6 nat table is not usable (" + "; ".join(failures) + ")"


def preflight(
    config: Config,
    *,
    which: Callable[[str], str | None] = shutil.which,
    cap_mask: Callable[[], int] = caps.effective,
    who: str = "iptables mode",
    binary: str = "iptables",
) -> None:
    """Raise FatalError when iptables mode cannot work here whatever is retried; say what to do.
    `who`: what needs the rules, for the message (eBPF mode's IPv6 Services need ip6tables);
    `binary`: whose tools must be there (ip6tables for the IPv6 proxier)."""
    problems: list[str] = []
    wanted = (caps.CAP_NET_ADMIN, caps.CAP_SYS_ADMIN) if config.netns else (caps.CAP_NET_ADMIN,)
    lacking = caps.missing(wanted, cap_mask())
    if lacking:
        problems.append(
            f"the agent lacks {' and '.join(lacking)}, which writing iptables rules needs: run it as root "
            "(in a container: privileged, or with the NET_ADMIN capability)"
        )
    if config.iptables_backend in FAMILIES:
        absent = [tool for tool in family_tools(config.iptables_backend, binary) if not which(tool)]
        if absent:
            problems.append(
                f"{', '.join(absent)} not found on PATH (--iptables-backend={config.iptables_backend}): "
                "install the iptables package (Debian: apt-get install iptables), or choose the other "
                "--iptables-backend"
            )
    elif not installed_families(which, binary):
        other = (
            "or leave IPv6 out of --node-ip, --cluster-cidr and --service-cluster-ip-range"
            if who == IPV6_IN_EBPF_MODE
            else "or run --mode=ebpf"
        )
        problems.append(
            f"neither {binary}-nft nor {binary}-legacy (with their -save and -restore) is on PATH: install "
            f"the iptables package (Debian: apt-get install iptables), {other}"
        )
    others = [("ip", bool(config.netns), "--netns needs `ip netns exec`: install iproute2")]
    others.append(
        ("sysctl", config.iptables_localhost_nodeports, "localhost NodePorts need it: install procps")
    )
    problems += [
        f"{tool} not found on PATH ({why})" for tool, needed, why in others if needed and not which(tool)
    ]
    if problems:
        raise FatalError(f"{who} cannot start: " + "; ".join(problems))


class SubprocessRunner:
    """The real runner: the chosen iptables binaries, inside `Config.netns` when set.

    No side effect at construction; the backend is detected on first use.
    """

    def __init__(
        self,
        config: Config,
        *,
        which: Callable[[str], str | None] = shutil.which,
        cap_mask: Callable[[], int] = caps.effective,
        family: int = 4,
        follow: Callable[[], str] | None = None,
    ) -> None:
        self._config = config
        self._which = which
        self._cap_mask = cap_mask
        self._netns = config.netns
        self._wanted = config.iptables_backend
        self._backend = ""
        # ip6tables for the IPv6 proxier; `follow`: the IPv4 runner's backend, which this one uses.
        self._binary = "ip6tables" if family == 6 else "iptables"
        self._follow = follow
        # In eBPF mode only the IPv6 Services need ip6tables: say so when they cannot have it.
        ebpf_v6 = family == 6 and config.mode is Mode.EBPF
        self._who = IPV6_IN_EBPF_MODE if ebpf_v6 else "iptables mode"

    def _prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self._netns] if self._netns else []

    def command(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        try:
            p = subprocess.run(
                [*self._prefix(), *argv],
                input=stdin,
                capture_output=True,
                text=True,
                check=False,
            )
        except FileNotFoundError as exc:
            return Result(127, "", str(exc))
        return Result(p.returncode, p.stdout, p.stderr)

    @property
    def backend(self) -> str:
        if not self._backend:
            preflight(
                self._config, which=self._which, cap_mask=self._cap_mask, who=self._who, binary=self._binary
            )
            if self._wanted in ("nft", "legacy"):
                self._backend = self._wanted
                reason = "--iptables-backend"
            elif self._follow is not None:
                self._backend, reason = self._follow(), "the backend of the IPv4 rules"
            else:
                self._backend, reason = self._detect()
            if self._binary != "iptables":
                absent = [t for t in family_tools(self._backend, self._binary) if not self._which(t)]
                if absent:
                    raise FatalError(
                        f"the IPv6 proxier needs {', '.join(absent)}: install the iptables package "
                        "(Debian: apt-get install iptables), or leave IPv6 out of --node-ip, "
                        "--cluster-cidr and --service-cluster-ip-range"
                    )
            where = f" in netns {self._netns}" if self._netns else ""
            log.info("iptables mode: using %s-%s%s (%s)", self._binary, self._backend, where, reason)
        return self._backend

    def _detect(self) -> tuple[str, str]:
        """The backend from this runner's own family's tables: an IPv6 runner that follows no IPv4
        one (eBPF mode's) reads ip6tables, where kubelet's IPv6 hint chains are and where
        kube-proxy's IPv6 chains, which it adopts, were written; the IPv4 ones may be gone already
        (the eBPF start removes kube-proxy's)."""
        binary = self._binary
        installed = installed_families(self._which, binary)
        if len(installed) == 1:
            return installed[0], f"only {binary}-{installed[0]} is installed"
        # Only nft is asked for mangle alone: `iptables-legacy-save -t mangle` would make the
        # kernel create a legacy mangle table that nobody uses.
        nft_mangle = self.command([f"{binary}-nft-save", "-t", "mangle"]).stdout
        legacy_all = self.command([f"{binary}-legacy-save"]).stdout
        backend, reason = choose_backend(nft_mangle, legacy_all)
        if not backend:
            backend, reason = choose_backend(
                nft_mangle, legacy_all, self.command([f"{binary}-nft-save"]).stdout
            )
        return backend, f"{reason} ({binary})" if binary != "iptables" else reason

    def _tool(self, suffix: str) -> str:
        # iptables-nft, iptables-nft-save, iptables-nft-restore (and -legacy, and ip6tables-, likewise).
        return f"{self._binary}-{self.backend}{suffix}"

    def restore(self, text: str) -> None:
        argv = [self._tool("-restore"), "-w", LOCK_WAIT_SECONDS, "--noflush", "--counters"]
        r = self.command(argv, stdin=text)
        if r.returncode != 0:
            raise IptablesError(f"{' '.join(argv)} failed (exit {r.returncode}): {r.stderr.strip()}")

    def restore_test(self, text: str) -> str | None:
        argv = [self._tool("-restore"), "-w", LOCK_WAIT_SECONDS, "--noflush", "--test"]
        r = self.command(argv, stdin=text)
        return None if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()}"

    def save(self, table: str | None = None) -> str:
        argv = [self._tool("-save")] + (["-t", table] if table else [])
        r = self.command(argv)
        if r.returncode != 0:
            raise IptablesError(f"{' '.join(argv)} failed (exit {r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def run(self, *args: str) -> Result:
        return self.command([self._tool(""), "-w", LOCK_WAIT_SECONDS, *args])

    def version(self) -> tuple[int, ...]:
        r = self.command([self._tool(""), "--version"])
        return parse_version(r.stdout + r.stderr)


# ----------------------------------------------------------------------------- helpers on any runner


def chains_by_table(save_output: str) -> dict[str, set[str]]:
    """Chain names per table from iptables-save output (`*nat`, then `:CHAIN POLICY [p:b]` lines)."""
    out: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in save_output.splitlines():
        if line.startswith("*"):
            current = out.setdefault(line[1:].strip(), set())
        elif line.startswith(":") and current is not None:
            current.add(line[1:].split(" ", 1)[0])
    return out


def ensure_chain(runner: IptablesRunner, table: str, chain: str) -> bool:
    """Create `chain` unless it exists; True when it already existed."""
    r = runner.run("-t", table, "-N", chain)
    if r.returncode == 0:
        return False
    if "exists" in r.stderr:
        return True
    raise IptablesError(f"iptables -t {table} -N {chain}: {r.stderr.strip()}")


def ensure_rule(
    runner: IptablesRunner, table: str, chain: str, args: Sequence[str], *, prepend: bool
) -> bool:
    """Add the rule unless an identical one is there (`-C`); True when it already existed."""
    check = runner.run("-t", table, "-C", chain, *args)
    if check.returncode == 0:
        return True
    if check.returncode != 1:
        raise IptablesError(f"iptables -t {table} -C {chain}: {check.stderr.strip()}")
    add = runner.run("-t", table, "-I" if prepend else "-A", chain, *args)
    if add.returncode != 0:
        raise IptablesError(f"iptables -t {table} -I {chain}: {add.stderr.strip()}")
    return False


def delete_rule(runner: IptablesRunner, table: str, chain: str, args: Sequence[str]) -> int:
    """Delete every copy of the rule; the number deleted (0 when it was not there)."""
    deleted = 0
    while deleted < 100:  # a copy per iteration; bounded in case -D keeps succeeding
        if runner.run("-t", table, "-C", chain, *args).returncode != 0:
            break
        if runner.run("-t", table, "-D", chain, *args).returncode != 0:
            break
        deleted += 1
    return deleted
