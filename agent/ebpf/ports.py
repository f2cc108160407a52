"""The SNAT port range against the ranges it must not overlap, checked once at start, and the ports
an earlier run's range left held (pure).

The data path source-translates flows to the node's address with ports from `--bpf-snat-ports`,
and takes any packet to node:port in that range for a reply of such a flow. So the range must
not overlap:
  * the NodePort range (`--node-port-range`, the apiserver's 30000-32767 unless configured): a
    client reaching a NodePort in the range would be taken for a reply;
  * the node's `net.ipv4.ip_local_port_range` (read in `--netns`): the node's own connections
    choose their source ports there, and their replies would be taken for SNAT replies.
The kernel's NAT does not need this (its conntrack sees every flow); ours sees only the flows it
translates, so the ranges are kept apart, as Cilium does with --node-port-range and its own SNAT
range.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agent.ebpf.abi import Config, Ct6Entry, Ct6Key, CtDir, ip6_str, port_host
from agent.ebpf.capacity import ct_timeout_s

Range = tuple[int, int]


def overlaps(a: Range, b: Range) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def fmt(r: Range) -> str:
    return f"{r[0]}-{r[1]}"


def snat_ports_problem(snat: Range, nodeports: Range, local: Range, netns: str = "") -> str | None:
    """A sentence saying what is wrong and what to do, or None when the SNAT range is fine."""
    clashes = []
    if overlaps(snat, nodeports):
        clashes.append(f"the NodePort range {fmt(nodeports)} (--node-port-range)")
    if overlaps(snat, local):
        where = f"netns {netns}" if netns else "this node"
        clashes.append(f"net.ipv4.ip_local_port_range {fmt(local)} of {where}")
    if not clashes:
        return None
    return (
        f"--bpf-snat-ports {fmt(snat)} overlaps {' and '.join(clashes)}: replies to those ports would be"
        " taken for replies of source-translated flows. Choose a range outside both (NodePorts "
        f"{fmt(nodeports)}, local ports {fmt(local)}), e.g. --bpf-snat-ports=61000-65535 with the "
        "kernel's default local range 32768-60999"
    )


def parse_port_range(text: str) -> Range:
    """net.ipv4.ip_local_port_range's text: two numbers, whitespace between."""
    lo, hi = (int(part) for part in text.split())
    return lo, hi


def held_outside(
    entries: Iterable[tuple[Any, Any]], snat: Range, cfg: Config | None, now_ns: int
) -> Range | None:
    """The lowest and highest source port the tc IPv6 path's live flows (the entries of ekp_ct6_tcp
    and ekp_ct6_any: it source-translates TCP and UDP) were translated to outside `snat`: flows an
    earlier run translated with another --bpf-snat-ports, whose reply tuples {backend, node, port}
    nf_nat knows nothing of. None when none does. A flow translated to the client's own address (a
    port remapped around a live reply tuple) is not counted: its replies never come to a node
    address, where MASQUERADE's do. `now_ns`: CLOCK_MONOTONIC, as the entries' last_seen_ns; an expired entry
    holds nothing."""
    lo, hi = snat
    ports = [
        port
        for key, entry in entries
        if isinstance(key, Ct6Key)
        and isinstance(entry, Ct6Entry)
        and key.dir == CtDir.FORWARD
        and entry.snat_port
        and not lo <= (port := port_host(entry.snat_port)) <= hi
        and ip6_str(entry.snat_addr) != ip6_str(key.saddr)
        and (now_ns - entry.last_seen_ns) / 1e9 <= ct_timeout_s(cfg, key.proto, entry.flags)
    ]
    return (min(ports), max(ports)) if ports else None
