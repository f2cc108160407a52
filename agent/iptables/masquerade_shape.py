"""Whether the nat rules in place keep ip6tables' MASQUERADE out of a port range. Pure.

eBPF mode's ip6tables, beside the tc programs' IPv6 path, masquerades TCP and UDP with `--to-ports`
outside --bpf-snat-ports (agent/iptables/rules.py `masquerade_ports_beside`). An agent restarting
over pinned maps may keep an earlier run's IPv6 SNAT grant only while the rules in place still have
that shape: iptables mode and kube-proxy write a MASQUERADE over every port, and a tc flow could then
take a reply tuple nf_nat gives another flow.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable

from agent.iptables.canonical import parse
from agent.iptables.chains import KUBE_POSTROUTING

_SNAT_PROTOCOLS = frozenset({"tcp", "udp"})  # those the tc IPv6 path source-translates
# What eBPF mode's TCP and UDP MASQUERADE may hold besides `-p P -j MASQUERADE --to-ports R`: a rule
# with any other match covers part of its protocol only, and what it leaves falls through.
_OPTIONS = frozenset({"--random-fully", "--random"})


def _bare(tokens: list[str]) -> list[str]:
    """`tokens` without the comment match and the port-choice options."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        if tokens[i : i + 3] == ["-m", "comment", "--comment"]:
            i += 4
        elif tokens[i] in _OPTIONS:
            i += 1
        else:
            out.append(tokens[i])
            i += 1
    return out


def _ports(value: str) -> tuple[int, int] | None:
    lo, _, hi = value.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        return None


def masquerade_kept_out(save_text: str, snat: tuple[int, int], *, elsewhere: Callable[[], bool]) -> bool:
    """Whether `save_text` (ip6tables-save of the nat table) masquerades TCP and UDP in
    KUBE-POSTROUTING only into ports outside `snat`: the first MASQUERADE rule that can match each
    of them is eBPF mode's (`-p tcp|udp ... --to-ports LO-HI`, disjoint from `snat`). Anything else
    (no such rule, a catch-all MASQUERADE before it, a negation, a narrower match) is not. A nat
    table without KUBE-POSTROUTING masquerades nothing of ours: eBPF mode's ip6tables when its
    programs leave it no port (agent/metaproxier.py EbpfAndIp6tables `withdraw`), unless
    `elsewhere()` says another proxy's rules masquerade (kube-proxy's `ip6 kube-proxy` nftables
    table, a KUBE-POSTROUTING of the other iptables backend): a node that kube-proxy ran on is not
    eBPF mode's withdrawn one. No nat table in `save_text` at all tells nothing (not kept out)."""
    dump = parse(save_text)
    if "nat" not in dump.chains:
        return False
    nat = dump.table("nat")
    if KUBE_POSTROUTING not in nat:
        return not elsewhere()
    found: set[str] = set()
    for rule in nat[KUBE_POSTROUTING]:
        try:
            tokens = shlex.split(rule)
        except ValueError:
            return False
        jump = tokens.index("-j") if "-j" in tokens else -1
        if jump < 0 or tokens[jump + 1 : jump + 2] != ["MASQUERADE"]:
            continue
        if "!" in tokens:
            return False
        proto = tokens[tokens.index("-p") + 1] if "-p" in tokens[:-1] else ""
        if proto and proto not in _SNAT_PROTOCOLS:
            continue  # SCTP, ICMPv6: the tc path leaves them to ip6tables whole
        if not proto:
            return found == _SNAT_PROTOCOLS  # a catch-all: harmless only after both
        if proto in found:
            continue
        bare = _bare(tokens)
        if bare[:5] != ["-p", proto, "-j", "MASQUERADE", "--to-ports"] or len(bare) != 6:
            return False
        ports = _ports(bare[5])
        if ports is None:
            return False
        if not (ports[1] < snat[0] or ports[0] > snat[1]):
            return False
        found.add(proto)
    return found == _SNAT_PROTOCOLS
