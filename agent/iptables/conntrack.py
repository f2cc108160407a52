"""Clearing stale UDP conntrack entries after endpoints change, as kube-proxy does.

UDP has no connection end: a client that keeps sending from the same source port (a DNS
resolver, for instance) keeps matching the conntrack entry that DNATed its first packet, so it
keeps talking to the old endpoint after that pod is gone, or never reaches any endpoint when its
first packet arrived while the service had none. kube-proxy (pkg/proxy/conntrack/cleanup.go)
therefore lists the UDP entries after each sync that changed endpoints and deletes those whose
original destination is a service frontend (cluster IP, external IP or LB IP with the port, or
any address with the NodePort) while the reply source is not one of that service port's serving
endpoints. Traffic policies, topology and terminating state are deliberately ignored: a serving
endpoint keeps its flows, as a TCP connection would.

Split as the rest of the package: `udp_frontends`, `parse_entries` and `stale_filters` are pure and
table-tested; `ConntrackCleaner` runs `conntrack -L` / `conntrack -D` through the runner's
`command` (so inside the agent's network namespace, and replaceable by a fake).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.iptables.runner import Result
from agent.model.types import Protocol, ProxyState

log = logging.getLogger(__name__)

IPPort = tuple[str, int]


@dataclass(frozen=True)
class UdpFrontends:
    """Serving endpoints (`ip:port` pairs) per UDP frontend, for ports with at least one."""

    by_ip_port: Mapping[IPPort, frozenset[IPPort]]
    by_node_port: Mapping[int, frozenset[IPPort]]

    def __bool__(self) -> bool:
        return bool(self.by_ip_port) or bool(self.by_node_port)


@dataclass(frozen=True)
class FlowEntry:
    """One conntrack entry: the original tuple's destination and the reply tuple's source."""

    orig_src: str
    orig_dst: str
    orig_sport: int
    orig_dport: int
    reply_src: str
    reply_sport: int


@dataclass(frozen=True, order=True)
class StaleFilter:
    """What to delete: entries to `orig_dst:orig_port_dst` (any address when orig_dst is "", the
    NodePort case) answered by `reply_src:reply_port_src`."""

    orig_dst: str
    orig_port_dst: int
    reply_src: str
    reply_port_src: int
    family: str = "ipv4"  # conntrack's -f: the table of the state's family

    def delete_args(self) -> list[str]:
        dst = ["--orig-dst", self.orig_dst] if self.orig_dst else []
        return [
            "conntrack",
            "-D",
            "-p",
            "udp",
            "-f",
            self.family,
            *dst,
            "--orig-port-dst",
            str(self.orig_port_dst),
            "--reply-src",
            self.reply_src,
            "--reply-port-src",
            str(self.reply_port_src),
        ]


def udp_frontends(state: ProxyState) -> UdpFrontends:
    by_ip_port: dict[IPPort, frozenset[IPPort]] = {}
    by_node_port: dict[int, frozenset[IPPort]] = {}
    for spn, sp in state.services.items():
        if sp.protocol is not Protocol.UDP:
            continue
        serving = frozenset((ep.ip, ep.port) for ep in state.raw_endpoints.get(spn, ()) if ep.serving)
        if not serving:
            continue  # nothing could answer: no entry can be stale in a way we could fix
        for ip in (sp.cluster_ip, *sp.load_balancer_ips, *sp.external_ips):
            by_ip_port[(ip, sp.port)] = serving
        if sp.node_port:
            by_node_port[sp.node_port] = serving
    return UdpFrontends(by_ip_port, by_node_port)


def parse_entries(text: str) -> list[FlowEntry]:
    """`conntrack -L` lines to entries; lines without both tuples are skipped."""
    out: list[FlowEntry] = []
    for line in text.splitlines():
        orig: dict[str, str] = {}
        reply: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if not sep or key not in ("src", "dst", "sport", "dport"):
                continue
            (reply if key in orig else orig)[key] = value
        try:
            out.append(
                FlowEntry(
                    orig_src=orig["src"],
                    orig_dst=orig["dst"],
                    orig_sport=int(orig["sport"]),
                    orig_dport=int(orig["dport"]),
                    reply_src=reply["src"],
                    reply_sport=int(reply["sport"]),
                )
            )
        except (KeyError, ValueError):
            continue
    return out


def stale_filters(
    frontends: UdpFrontends, entries: Iterable[FlowEntry], family: str = "ipv4"
) -> list[StaleFilter]:
    """The deletions upstream's CleanStaleEntries would make for these entries, deduplicated;
    `family`: conntrack's name of the table they were listed from (ipv4, ipv6)."""
    out: set[StaleFilter] = set()
    for e in entries:
        reply = (e.reply_src, e.reply_sport)
        serving = frontends.by_ip_port.get((e.orig_dst, e.orig_dport))
        if serving is not None and reply not in serving:
            out.add(StaleFilter(e.orig_dst, e.orig_dport, e.reply_src, e.reply_sport, family))
        serving = frontends.by_node_port.get(e.orig_dport)
        if serving is not None and reply not in serving:
            out.add(StaleFilter("", e.orig_dport, e.reply_src, e.reply_sport, family))
    return sorted(out)


_DELETED = re.compile(r"(\d+) flow entr(?:y|ies) ha(?:s|ve) been deleted")


class ConntrackError(RuntimeError):
    pass


class ConntrackCleaner:
    """Lists UDP conntrack entries and deletes the stale ones, with the `conntrack` tool."""

    def __init__(self, command: Callable[[Sequence[str]], Result]) -> None:
        self._command = command
        self.deleted = 0  # entries the last clean() deleted, as the conntrack tool reported them

    def clean(self, state: ProxyState) -> list[StaleFilter]:
        """Delete stale entries for `state`; the filters applied. Raises ConntrackError when the
        table cannot be listed; a failed deletion is logged and the others still run."""
        self.deleted = 0
        frontends = udp_frontends(state)
        if not frontends:
            return []
        family = f"ipv{state.family.value}"
        listed = self._command(["conntrack", "-L", "-p", "udp", "-f", family])
        if listed.returncode != 0:
            raise ConntrackError(f"conntrack -L failed (exit {listed.returncode}): {listed.stderr.strip()}")
        filters = stale_filters(frontends, parse_entries(listed.stdout), family)
        for f in filters:
            r = self._command(f.delete_args())
            m = _DELETED.search(r.stderr)
            self.deleted += int(m.group(1)) if m else 0
            # Exit 1 with "0 flow entries have been deleted": the entry expired meanwhile.
            if r.returncode not in (0, 1):
                log.warning("conntrack delete %s failed: %s", " ".join(f.delete_args()), r.stderr.strip())
        if filters:
            log.info("cleared %d stale UDP conntrack filter(s)", len(filters))
        return filters
