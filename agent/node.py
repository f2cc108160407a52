"""The node's addresses of one family, found on its external devices in the agent's network namespace.

Effects (pyroute2, read only). The external devices are Config.devices in the order given;
without them, every device holding a global address of the family except loopback and pod devices
(Config.pod_interfaces, and the bridge or name prefix of --detect-local-mode's interface modes),
the device of the default route first, then by interface index. The
primary address (SNAT source toward other nodes) is the first address of the first device; for
IPv6 the first that is neither temporary, deprecated nor tentative (`_primary`).
`pick_node_addresses` is the pure core, tested with literal netlink-like records.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.config import Config, NodeContext
from agent.netns import netns_route, run_in_netns

log = logging.getLogger(__name__)

RT_SCOPE_UNIVERSE = 0
# IPv6 address flags (linux/if_addr.h IFA_F_*): an address that is no good SNAT source. A temporary
# (privacy) address is replaced within hours and a deprecated one is on its way out: a flow
# translated from it loses its replies when it goes; a tentative one (DAD under way) or one whose
# DAD failed sends nothing. (For IPv4 bit 0x01 means a secondary address: not applied.)
IFA_F_TEMPORARY = 0x01
IFA_F_DADFAILED = 0x08
IFA_F_DEPRECATED = 0x20
IFA_F_TENTATIVE = 0x40
_UNUSABLE6 = IFA_F_TENTATIVE | IFA_F_DADFAILED
_FLEETING6 = IFA_F_TEMPORARY | IFA_F_DEPRECATED


def matches_pod_pattern(name: str, patterns: Iterable[str]) -> bool:
    """Whether a device name matches one of the --pod-interfaces globs."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns if p)


@dataclass(frozen=True)
class AddrInfo:
    index: int
    device: str
    address: str
    scope: int = RT_SCOPE_UNIVERSE
    flags: int = 0  # IFA_F_* (the IFA_FLAGS attribute, else the header's)


def pick_node_addresses(
    addrs: Sequence[AddrInfo],
    devices: Sequence[str],
    pod_patterns: Iterable[str],
    default_route_indexes: Iterable[int] = (),
) -> NodeContext:
    """NodeContext from the namespace's addresses (kernel order within a device kept)."""
    patterns = tuple(pod_patterns)
    if devices:
        order = {name: i for i, name in enumerate(devices)}
        chosen = [a for a in addrs if a.device in order]
        chosen.sort(key=lambda a: order[a.device])  # stable: kernel order within a device
    else:
        first = set(default_route_indexes)
        chosen = [
            a
            for a in addrs
            if a.device != "lo"
            and a.scope == RT_SCOPE_UNIVERSE
            and not a.address.startswith("127.")
            and not matches_pod_pattern(a.device, patterns)
        ]
        chosen.sort(key=lambda a: (a.index not in first, a.index))
    ips = tuple(dict.fromkeys(a.address for a in chosen))
    return NodeContext(node_ips=ips, primary_ip=_primary(chosen))


def _primary(chosen: Sequence[AddrInfo]) -> str:
    """The first address (the SNAT source toward other nodes), an IPv6 one chosen by its flags:
    a stable one first, else a temporary or deprecated one (it still sends), never a tentative
    one or one whose DAD failed ("" when only those: ip6tables' masquerade then picks)."""

    def rank(a: AddrInfo) -> int:
        if ":" not in a.address:
            return 0
        return 2 if a.flags & _UNUSABLE6 else 1 if a.flags & _FLEETING6 else 0

    ranked = sorted(range(len(chosen)), key=lambda i: (rank(chosen[i]), i))
    if not ranked or rank(chosen[ranked[0]]) == 2:
        return ""
    return chosen[ranked[0]].address


def _records(ipr: Any, af: int = socket.AF_INET) -> tuple[list[AddrInfo], list[int]]:
    names = {int(m["index"]): str(m.get("ifname")) for m in ipr.get_links()}
    addrs = [
        AddrInfo(
            index=int(m["index"]),
            device=names.get(int(m["index"]), "?"),
            address=str(m.get("address")),
            scope=int(m["scope"]),
            flags=int(m.get_attr("IFA_FLAGS") or m["flags"]),
        )
        for m in ipr.get_addr(family=af)
    ]
    defaults = []
    for r in ipr.get_routes(family=af, table=254):
        if r["dst_len"] == 0 and r.get("oif") is not None:
            defaults.append(int(r.get("oif")))
    return addrs, defaults


def pod_device_patterns(config: Config) -> tuple[str, ...]:
    """Globs of the devices pods sit behind: --pod-interfaces, and the local-traffic detector's
    bridge or name prefix (their addresses are pod gateways, not node addresses)."""
    local = config.local_detector()
    extra = (
        (local.interface,) if local.interface else (f"{glob.escape(local.prefix)}*",) if local.prefix else ()
    )
    return (*config.pod_interfaces, *extra)


def read_node(config: Config, family: int = 4) -> NodeContext:
    """The node's addresses of IP version `family` in Config.netns (global scope only: an IPv6
    link-local address is no node address); a missing namespace raises FileNotFoundError. Says
    nothing: `discover_node` is the start's reading, which logs what it found."""
    af = socket.AF_INET6 if family == 6 else socket.AF_INET
    with netns_route(config.netns) as ipr:
        addrs, defaults = _records(ipr, af)
    if family == 6:
        addrs = [a for a in addrs if a.scope == RT_SCOPE_UNIVERSE]
    return pick_node_addresses(addrs, config.devices, pod_device_patterns(config), defaults)


def discover_node(config: Config, family: int = 4) -> NodeContext:
    """`read_node`, and a log line saying what it found (a warning when nothing)."""
    node = read_node(config, family)
    if not node.node_ips:
        log.warning(
            "no IPv%d address found on %s in netns %s: IPv%d NodePorts answer nowhere; pass --node-ip",
            family,
            ",".join(config.devices) or "any external device",
            config.netns or "(own)",
            family,
        )
    else:
        log.info("node IPv%d addresses %s (primary %s)", family, ",".join(node.node_ips), node.primary_ip)
    return node


# /proc/net/tcp state of a listening socket; a UDP socket that is bound and not connected.
TCP_LISTEN, UDP_UNCONNECTED = "0A", "07"


def parse_proc_net(text: str, proto: int, state: str) -> set[tuple[str, int, int]]:
    """(address, port, protocol) of the sockets in one /proc/net/{tcp,udp} text in `state`."""
    out = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] != state:
            continue
        addr_hex, _, port_hex = fields[1].partition(":")
        address = socket.inet_ntoa(int(addr_hex, 16).to_bytes(4, "little"))
        out.add((address, int(port_hex, 16), proto))
    return out


def local_listeners(netns: str, node_ips: Iterable[str] = ()) -> frozenset[tuple[str, int, int]]:
    """(address, port, protocol) where a socket of the node listens on an address of its own that
    is not one of `node_ips`: NodeLocal DNSCache binds the kube-dns ClusterIP on a dummy device
    and listens there, and eBPF mode then leaves that ClusterIP port to the node's stack
    (agent/ebpf/layout.py). Sockets bound to 0.0.0.0 are not counted: a ClusterIP is served
    locally only where something binds it by name."""

    def read() -> tuple[str, str]:
        with open("/proc/thread-self/net/tcp") as tcp, open("/proc/thread-self/net/udp") as udp:
            return tcp.read(), udp.read()

    tcp_text, udp_text = run_in_netns(netns, read)
    with netns_route(netns) as ipr:
        mine = {str(m.get("address")) for m in ipr.get_addr(family=socket.AF_INET)}
    mine -= set(node_ips)
    bound = parse_proc_net(tcp_text, socket.IPPROTO_TCP, TCP_LISTEN)
    bound |= parse_proc_net(udp_text, socket.IPPROTO_UDP, UDP_UNCONNECTED)
    return frozenset(b for b in bound if b[0] in mine and not b[0].startswith("127."))
