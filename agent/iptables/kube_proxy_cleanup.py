"""Replacing kube-proxy: remove exactly what a previous kube-proxy left on the node, nothing else.

For the Helm chart's init container (`--cleanup-kube-proxy`), run once before the agent starts on a
node that ran kube-proxy. What kube-proxy leaves, by mode:

* iptables mode, in either backend (iptables-nft or iptables-legacy, whichever it used; both are
  looked at): the jumps from the built-in chains, KUBE-SERVICES, KUBE-NODEPORTS, KUBE-POSTROUTING,
  KUBE-MARK-MASQ and the per-service chains (KUBE-SVC-, KUBE-SVL-, KUBE-EXT-, KUBE-FW-, KUBE-SEP-,
  and KUBE-XLB- of releases before 1.24) in nat; KUBE-SERVICES, KUBE-EXTERNAL-SERVICES,
  KUBE-FORWARD, KUBE-NODEPORTS and KUBE-PROXY-FIREWALL in filter; KUBE-PROXY-CANARY in mangle, nat
  and filter. This is the list of kube-proxy's own `--cleanup` (cleanupLeftoversForFamily), except
  that every rule jumping into those chains is removed, whatever version wrote it.
* nftables mode: its tables `ip kube-proxy` and `ip6 kube-proxy`.

Left alone, as kube-proxy's own cleanup leaves them: KUBE-FIREWALL (kubelet created it before 1.28
and may own it), KUBE-KUBELET-CANARY and KUBE-IPTABLES-HINT (kubelet's), KUBE-MARK-DROP (kubelet's,
older releases), every chain and nftables table with another name. IPVS mode's leftovers (ipsets,
the kube-ipvs0 device) are not handled: this kernel has no IPVS.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace

from agent.config import Config
from agent.iptables import canonical
from agent.iptables.chains import (
    CLEANUP_FILTER_CHAINS,
    CLEANUP_NAT_CHAINS,
    KUBE_PROXY_CANARY,
    is_service_chain,
)
from agent.iptables.cleanup import CleanupReport, remove_chains
from agent.iptables.runner import IptablesError, IptablesRunner, Result, SubprocessRunner

log = logging.getLogger(__name__)

OLD_SERVICE_CHAIN_PREFIXES = ("KUBE-XLB-",)  # kube-proxy < 1.24
NFT_TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))
NFT_FAMILIES = ("ip", "ip6")
_NFT_TABLE = re.compile(r"^table (\S+) (\S+)", re.MULTILINE)


@dataclass
class KubeProxyCleanupReport:
    """What was removed: per iptables backend the chains (per table) and jump rules, and the
    nftables tables; `errors` says what could not be."""

    iptables: dict[str, CleanupReport] = field(default_factory=dict)
    nft_tables: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def removed_anything(self) -> bool:
        return bool(self.nft_tables) or any(
            r.chains_deleted or r.jumps_deleted for r in self.iptables.values()
        )


def kube_proxy_targets(saved: canonical.Dump) -> dict[str, list[str]]:
    """The chains of kube-proxy's iptables mode present in a ruleset, per table."""

    def service(chain: str) -> bool:
        return is_service_chain(chain) or chain.startswith(OLD_SERVICE_CHAIN_PREFIXES)

    return {
        "nat": list(CLEANUP_NAT_CHAINS) + sorted(c for c in saved.table("nat") if service(c)),
        "filter": list(CLEANUP_FILTER_CHAINS),
        "mangle": [KUBE_PROXY_CANARY],
    }


def cleanup_iptables(runner: IptablesRunner) -> CleanupReport:
    """kube-proxy's iptables-mode chains and every rule jumping to them, in one backend."""
    report = CleanupReport()
    saved = canonical.parse(runner.save())
    remove_chains(runner, saved, kube_proxy_targets(saved), report)
    return report


def _nft(runner: IptablesRunner, *args: str) -> Result:
    return runner.command(["nft", *args])


def cleanup_kube_proxy(
    config: Config,
    runners: dict[str, IptablesRunner] | None = None,
    nft_families: tuple[str, ...] = NFT_FAMILIES,
) -> KubeProxyCleanupReport:
    """Remove a previous kube-proxy's rules from the node (`config.netns`, "" = this namespace):
    iptables mode's in both backends, nftables mode's tables of `nft_families`. Never raises for a
    backend that is missing or fails; the report's `errors` says what was left."""
    report = KubeProxyCleanupReport()
    if runners is None:
        runners = {b: SubprocessRunner(replace(config, iptables_backend=b)) for b in ("nft", "legacy")}
    for backend, runner in runners.items():
        try:
            result = cleanup_iptables(runner)
        except IptablesError as exc:
            report.errors.append(f"iptables-{backend}: {exc}")
            log.warning("kube-proxy cleanup: iptables-%s: %s", backend, exc)
            continue
        report.iptables[backend] = result
        if result.chains_deleted or result.jumps_deleted:
            log.info(
                "kube-proxy cleanup: iptables-%s: removed %d jump rule(s) and chains %s",
                backend,
                result.jumps_deleted,
                {t: len(c) for t, c in result.chains_deleted.items()},
            )
    cleanup_nft_tables(next(iter(runners.values())), report, nft_families)
    if not report.removed_anything and not report.errors:
        log.info("kube-proxy cleanup: nothing of kube-proxy's found")
    return report


class NftTakeover:
    """Removes kube-proxy's nftables tables of `families` once our rules serve (a proxier's
    take-over step): each call tries again until none is left, and returns whether none is. A
    table that stays keeps kube-proxy's hooks in the kernel beside our rules, where they may still
    translate traffic to endpoints long gone: so a failure is a warning, once per distinct error,
    and the line after it says when the table went after all."""

    def __init__(self, runner: IptablesRunner, families: tuple[str, ...] = NFT_FAMILIES) -> None:
        self._runner = runner
        self._families = families
        self._said = ""  # the errors last logged

    def __call__(self) -> bool:
        report = KubeProxyCleanupReport()
        cleanup_nft_tables(self._runner, report, families=self._families)
        if not report.errors:
            if self._said:
                log.info("kube-proxy's nftables table(s) removed after all")
            self._said = ""
            return True
        said = "; ".join(report.errors)
        if said != self._said:
            tables = " and ".join(f"{f} kube-proxy" for f in self._families)
            log.warning(
                "could not remove kube-proxy's nftables table %s: %s. Its rules stay in the kernel "
                "beside ours and may send traffic to endpoints that are gone; retried at each sync "
                "(by hand: nft delete table <family> kube-proxy)",
                tables,
                said,
            )
            self._said = said
        return False


def cleanup_nft_tables(
    nft: IptablesRunner, report: KubeProxyCleanupReport, families: tuple[str, ...] = NFT_FAMILIES
) -> None:
    """kube-proxy's nftables tables of `families` ("ip", "ip6"), deleted with `nft` through the
    runner (so in its namespace). Also what iptables mode removes once it serves, on a node
    kube-proxy ran in nftables mode: the table's established flows go on through nf_conntrack's
    NAT bindings, under iptables mode's nat hooks. In eBPF mode the IPv6 proxier (ip6tables)
    removes `ip6 kube-proxy` once its own rules serve, the eBPF start only `ip kube-proxy`."""
    listed = _nft(nft, "list", "tables")
    if listed.returncode != 0:
        report.errors.append(f"nft list tables: {listed.stderr.strip() or listed.returncode}")
        return
    present = set(_NFT_TABLE.findall(listed.stdout))
    for family, name in NFT_TABLES:
        if family not in families or (family, name) not in present:
            continue
        r = _nft(nft, "delete", "table", family, name)
        if r.returncode == 0:
            report.nft_tables.append(f"{family} {name}")
            log.info("kube-proxy cleanup: deleted nftables table %s %s", family, name)
        else:
            report.errors.append(f"nft delete table {family} {name}: {r.stderr.strip()}")
