"""`agent --cleanup` for the iptables mode: remove our chains and jumps, nothing else.

Follows kube-proxy's cleanupLeftoversForFamily: delete the jump rules from the built-in chains
(each exact rule, every copy), then flush and delete, in one iptables-restore --noflush per run,
the top-level chains we own and every per-service chain (KUBE-SVC/SVL/EXT/FW/SEP), then the
mangle canary. Other rules in INPUT, FORWARD, OUTPUT, PREROUTING and POSTROUTING, and chains with
other names, are untouched.

KUBE-FIREWALL is shared history: kubelet used to create it and may still on old nodes. We remove
only our martian-drop rule from it, and the chain and its two jumps only when that leaves it empty.
(Upstream never deletes KUBE-FIREWALL; we do when it is certainly ours alone, so a node handed back
to another proxy keeps no rules of ours.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from agent.iptables.chains import (
    CLEANUP_FILTER_CHAINS,
    CLEANUP_NAT_CHAINS,
    FIREWALL_JUMPS,
    JUMPS,
    KUBE_FIREWALL,
    KUBE_PROXY_CANARY,
    MARTIAN_COMMENT,
    is_service_chain,
)
from agent.iptables.runner import IptablesRunner, chains_by_table, delete_rule

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


@dataclass
class CleanupReport:
    jumps_deleted: int = 0
    chains_deleted: dict[str, list[str]] = field(default_factory=dict)


def owns_something(save_output: str) -> bool:
    """Does this ruleset hold any chain we create? (Cheap test before cleaning a backend.)"""
    for table, chains in chains_by_table(save_output).items():
        ours = {KUBE_PROXY_CANARY} | set(CLEANUP_NAT_CHAINS) | set(CLEANUP_FILTER_CHAINS)
        if table in ("nat", "filter", "mangle") and any(c in ours or is_service_chain(c) for c in chains):
            return True
    return False


def _rules_in(save_output: str, table: str, chain: str) -> list[str]:
    rules: list[str] = []
    current = ""
    prefix = f"-A {chain} "
    for line in save_output.splitlines():
        if line.startswith("*"):
            current = line[1:].strip()
        elif current == table and line.startswith(prefix):
            rules.append(line)
    return rules


def cleanup(runner: IptablesRunner) -> CleanupReport:
    report = CleanupReport()
    for jump in JUMPS:
        report.jumps_deleted += delete_rule(runner, jump.table, jump.src_chain, jump.rule_args())

    before = runner.save()
    existing = chains_by_table(before)
    drop_firewall = False
    if KUBE_FIREWALL in existing.get("filter", set()):
        delete_rule(runner, "filter", KUBE_FIREWALL, MARTIAN_RULE_ARGS)
        if not _rules_in(runner.save("filter"), "filter", KUBE_FIREWALL):
            drop_firewall = True
            for jump in FIREWALL_JUMPS:
                report.jumps_deleted += delete_rule(runner, jump.table, jump.src_chain, jump.rule_args())

    nat_have = existing.get("nat", set())
    nat = [c for c in CLEANUP_NAT_CHAINS if c in nat_have]
    nat += sorted(c for c in nat_have if is_service_chain(c))
    filter_have = existing.get("filter", set())
    flt = [c for c in CLEANUP_FILTER_CHAINS if c in filter_have]
    if drop_firewall:
        flt.append(KUBE_FIREWALL)

    lines: list[str] = []
    for table, chains in (("nat", nat), ("filter", flt)):
        if not chains:
            continue
        lines.append(f"*{table}")
        lines += [f":{c} - [0:0]" for c in chains]
        lines += [f"-X {c}" for c in chains]
        lines.append("COMMIT")
        report.chains_deleted[table] = chains
    if lines:
        runner.restore("\n".join(lines) + "\n")

    if KUBE_PROXY_CANARY in existing.get("mangle", set()):
        runner.run("-t", "mangle", "-X", KUBE_PROXY_CANARY)
        report.chains_deleted["mangle"] = [KUBE_PROXY_CANARY]
    log.info(
        "iptables cleanup: %d jump rule(s) and %d chain(s) removed",
        report.jumps_deleted,
        sum(len(v) for v in report.chains_deleted.values()),
    )
    return report
