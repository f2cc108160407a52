"""`agent --cleanup` for the iptables mode: remove our chains and the rules that jump to them.

Follows kube-proxy's cleanupLeftoversForFamily, made robust: instead of deleting each jump by its
exact current spelling (a jump written by an older version, or a second copy, would then keep its
chain alive and make the whole `-X` restore fail), every rule outside the chains being removed that
jumps to one of them is deleted by the spec iptables-save printed for it. Then the chains are
flushed and deleted, in one iptables-restore --noflush per table: the top-level chains we own and
every per-service chain (KUBE-SVC/SVL/EXT/FW/SEP), in nat and filter, and the canary in mangle,
nat and filter. Other rules in INPUT, FORWARD, OUTPUT, PREROUTING and POSTROUTING, and chains with
other names, are untouched.

KUBE-FIREWALL is shared history: kubelet used to create it and may still on old nodes. We remove
only our martian-drop rule from it, and the chain and its two jumps only when that leaves it empty.
(Upstream never deletes KUBE-FIREWALL; we do when it is certainly ours alone, so a node handed back
to another proxy keeps no rules of ours.)

`remove_chains` is shared with `kube_proxy_cleanup.py`, which removes a previous kube-proxy's.
"""

from __future__ import annotations

import logging
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agent.iptables import canonical
from agent.iptables.chains import (
    CLEANUP_FILTER_CHAINS,
    CLEANUP_NAT_CHAINS,
    JUMPS,
    KUBE_FIREWALL,
    KUBE_NODEPORTS,
    KUBE_PROXY_CANARY,
    MARTIAN_COMMENT,
    is_service_chain,
)
from agent.iptables.runner import IptablesError, IptablesRunner, chains_by_table, delete_rule

log = logging.getLogger(__name__)

MARTIAN_RULE_ARGS = (
    "-m",
    "comment",
    "--comment",
    MARTIAN_COMMENT,
    "-d",
    "127.0.0.0/8",
    "!",
    "-s",
    "127.0.0.0/8",
    "-m",
    "conntrack",
    "!",
    "--ctstate",
    "RELATED,ESTABLISHED,DNAT",
    "-j",
    "DROP",
)
_TARGET = re.compile(r"(?:^|\s)-[jg] (\S+)")


@dataclass
class CleanupReport:
    jumps_deleted: int = 0
    chains_deleted: dict[str, list[str]] = field(default_factory=dict)


def owns_something(save_output: str) -> bool:
    """Does this ruleset hold any chain we create? (Cheap test before cleaning a backend.)"""
    ours = {KUBE_PROXY_CANARY} | set(CLEANUP_NAT_CHAINS) | set(CLEANUP_FILTER_CHAINS)
    for table, chains in chains_by_table(save_output).items():
        if table in ("nat", "filter", "mangle") and any(c in ours or is_service_chain(c) for c in chains):
            return True
    return False


def remove_chains(
    runner: IptablesRunner, saved: canonical.Dump, targets: Mapping[str, Iterable[str]], report: CleanupReport
) -> None:
    """Delete every rule that jumps into `targets` (per table) from elsewhere, then flush and
    delete the target chains that exist. Raises IptablesError when a table's restore fails."""
    for table, wanted in targets.items():
        existing = saved.table(table)
        chains = [c for c in dict.fromkeys(wanted) if c in existing]
        if not chains:
            continue
        doomed = set(chains)
        for chain, rules in existing.items():
            if chain in doomed:
                continue
            for rule in rules:
                m = _TARGET.search(rule)
                if m is None or m.group(1) not in doomed:
                    continue
                r = runner.run("-t", table, "-D", chain, *shlex.split(rule))
                if r.returncode == 0:
                    report.jumps_deleted += 1
                else:
                    log.warning("cleanup: cannot delete `-A %s %s` (%s)", chain, rule, r.stderr.strip())
        lines = [f"*{table}", *(f":{c} - [0:0]" for c in chains), *(f"-X {c}" for c in chains), "COMMIT", ""]
        runner.restore("\n".join(lines))
        report.chains_deleted.setdefault(table, []).extend(chains)


def cleanup(runner: IptablesRunner) -> CleanupReport:
    report = CleanupReport()
    saved = canonical.parse(runner.save())
    filter_chains = list(CLEANUP_FILTER_CHAINS)
    if KUBE_FIREWALL in saved.table("filter"):
        delete_rule(runner, "filter", KUBE_FIREWALL, MARTIAN_RULE_ARGS)
        if not _rules_in(runner.save("filter"), KUBE_FIREWALL):
            filter_chains.append(KUBE_FIREWALL)  # empty now: ours alone, its jumps go with it
    nat = list(CLEANUP_NAT_CHAINS) + sorted(c for c in saved.table("nat") if is_service_chain(c))
    errors: list[str] = []
    for table, chains in (("nat", nat), ("filter", filter_chains), ("mangle", [KUBE_PROXY_CANARY])):
        try:
            remove_chains(runner, saved, {table: chains}, report)
        except IptablesError as exc:
            errors.append(f"{table}: {exc}")
    log.info(
        "iptables cleanup: %d jump rule(s) and %d chain(s) removed",
        report.jumps_deleted,
        sum(len(v) for v in report.chains_deleted.values()),
    )
    if errors:
        raise IptablesError("cleanup incomplete: " + "; ".join(errors))
    return report


def _rules_in(filter_save: str, chain: str) -> list[str]:
    return [line for line in filter_save.splitlines() if line.startswith(f"-A {chain} ")]


def withdrawal(saved: canonical.Dump, accepts: Iterable[str]) -> str:
    """The one restore (atomic per table) that takes the kernel's `saved` rules of ours to eBPF
    mode's withdrawn ip6tables (agent/iptables/proxier.py `withdraw`): KUBE-NODEPORTS in filter
    holding `accepts` (rules after `-A KUBE-NODEPORTS `) with INPUT's jump to it first, as
    upstream's prepended jump (a node's `-A INPUT -j REJECT` must not come before it), and no other
    chain of ours or jump to one in filter, nat or mangle. Each table's jumps are deleted, its
    chains flushed and deleted and the ACCEPTs written in the same transaction, so the ACCEPTs are
    never missing. "" when the kernel holds that already (nothing to write). KUBE-FIREWALL is left
    alone: only IPv4's localhost NodePorts write to it, and this is the IPv6 proxier's."""
    accepts = list(accepts)
    jump = next(j for j in JUMPS if j.table == "filter" and j.dst_chain == KUBE_NODEPORTS)
    jump_args = " ".join(f'"{a}"' if " " in a else a for a in jump.rule_args())
    want_jump = canonical.canonical_rule(jump_args)
    out: list[str] = []
    ours_by_table = {
        "filter": set(CLEANUP_FILTER_CHAINS),
        "nat": set(CLEANUP_NAT_CHAINS),
        "mangle": {KUBE_PROXY_CANARY},
    }
    for table, ours in ours_by_table.items():
        existing = saved.table(table)
        mine = [c for c in existing if c in ours or (table != "mangle" and is_service_chain(c))]
        keep = KUBE_NODEPORTS if table == "filter" and accepts else None
        jumps = [
            (chain, rule)
            for chain, rules in existing.items()
            if chain not in mine
            for rule in rules
            if (m := _TARGET.search(rule)) is not None and m.group(1) in mine
        ]
        if keep is not None:
            first = existing.get(jump.src_chain, [])[:1]
            in_place = (
                first
                and canonical.canonical_rule(first[0]) == want_jump
                and jumps == [(jump.src_chain, first[0])]
                and [canonical.canonical_rule(r) for r in existing.get(keep, [])]
                == [canonical.canonical_rule(r) for r in accepts]
                and mine == [keep]
            )
            if in_place:
                continue
        elif not mine:
            continue
        out.append(f"*{table}")
        out += [f":{c} - [0:0]" for c in dict.fromkeys([*mine, *([keep] if keep else [])])]
        out += [f"-D {chain} {rule}" for chain, rule in jumps]
        if keep is not None:
            out.append(f"-I {jump.src_chain} 1 {jump_args}")
            out += [f"-A {keep} {rule}" for rule in accepts]
        out += [f"-X {c}" for c in mine if c != keep]
        out.append("COMMIT")
    return "\n".join(out) + "\n" if out else ""
