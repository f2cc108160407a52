"""Attach the programs: clsact + a direct-action cls_bpf filter on each device that needs one, and
XDP ahead of it on the external devices (agent/ebpf/xdp.py, --bpf-xdp).

Effects (pyroute2). Which devices, in the network namespace Config.netns:

* external devices (Config.devices, or every device holding one of NodeContext.node_ips) get
  `ekp_from_net` on ingress: traffic from other nodes and clients, scope EXTERNAL; and
  `ekp_xdp_net` on XDP unless --bpf-xdp=disabled (best-effort: where the device is no veth, and
  asked for through `Attacher.xdp_wanted` where the load left it out);
* pod devices (names matching a Config.pod_interfaces glob, not external) get `ekp_from_pod` on
  ingress: traffic leaving pods, scope INTERNAL;
* both get `ekp_egress` on egress, in both host routings: what the node's own stack sends out of
  them, where the replies of flows handed to it (a backend on the node's own address) get their
  frontend back, and, with legacy host routing (bpf/ekp_host.h), the source translation of what
  the ingress programs handed to the stack. It is attached before the ingress program: a device
  never hands the stack a packet whose egress half is missing; and when legacy host routing is
  switched on (a node's first start), on every device before any ingress program
  (`Attacher.attach_egress`), so the config can say legacy from the first packet.

The local-traffic detector (agent/localdetect.py) moves that line in its interface modes, where
the device decides what kube-proxy counts as pod traffic (`-i BRIDGE`, `-i PREFIX+`):

* InterfaceNamePrefix: devices whose name starts with the prefix get `ekp_from_pod`; other pod
  devices `ekp_from_net`, so their traffic is external (masqueraded to a cluster IP);
* BridgeInterface: the bridge's ports get `ekp_from_pod` (a frame from a pod enters on its port
  before the bridge; a hook on the bridge device would miss replies bridged from pod to pod);
  other pod devices `ekp_from_net`; the bridge device itself nothing (only the node's own
  traffic enters there). A port that leaves the bridge loses its programs (or gets
  `ekp_from_net`, a pod device) as the link watcher sees its master change, not at a verify.

In the CIDR modes the programs decide by source (the config entry), so which of the two a pod
device carries does not matter; it gets `ekp_from_pod` as before.

Our filter is recognisable and alone at its spot: kind bpf, priority FILTER_PRIO, handle
FILTER_HANDLE, name = the program's name (`tc filter show dev X ingress` lists it). Attaching
uses "replace", so a restarted agent swaps its new program in atomically, with no moment without
a filter. The egress hook needs clsact (an `ingress` qdisc has none): on a device with an `ingress`
qdisc the attach fails before the ingress program is attached, and is retried as any failure.

The hand-over (an upgrade that carries conntrack over from tables the new programs do not read,
agent/ebpf/upgrade.py): a "replace" device by device would leave moments where a flow the older
programs started meets a new program on another device that has no entry for it. Instead
`reconcile(front=True)` puts each new program in front of the older generation's filter, at
FRONT_PRIO, on every hook that has one; the build's hand-over mode (bpf/ekp_abi.h `struct
ekp_handover`, set by the proxier) first passes every packet on (TC_ACT_UNSPEC: the next filter
decides), then, once every device has both, leaves only its conntrack misses to the older program
while the conntrack is carried over, then none; `rehome` then replaces the older filter at
FILTER_PRIO with the same new program and removes the front one. Ours at FRONT_PRIO is never
foreign, and `detach` removes it too (an agent stopped in the middle). "In front" only of another
build's program (TCA_BPF_ID against our fds' ids): where this build already sits at FILTER_PRIO (a
hook rehome moved before the agent stopped; `attach_egress`), a copy at FRONT_PRIO would share its
mode, so it is removed instead. A full reconcile outside a hand-over removes ours at FRONT_PRIO on
every hook (a hand-over cut short, then a rollback). Someone else's filter at FRONT_PRIO: the older
filter is replaced at FILTER_PRIO instead, with a warning.

The namespace is opened by `agent.netns.netns_route`: a missing namespace is an error, not
silently created. Pod devices come and go; `Attacher.start_watcher()` runs a thread that attaches
on RTM_NEWLINK of a matching device and forgets it on RTM_DELLINK. `detach_all` removes only our
filters, and the clsact qdisc only when it then holds no filter at all.

Adding the clsact qdisc to a device that has none is not free: the kernel grafts it with the
device's transmit queues deactivated (qdisc_graft: dev_deactivate, an RCU grace period, then
dev_activate), and whatever the node sends out of that device meanwhile is dropped (the noop
qdisc). On a node switching from kube-proxy (pod veths without clsact) each established flow may
lose what it sent through a device in that moment, once: TCP sends the segment again, a UDP
datagram or an SCTP chunk of a peer that does not retransmit is lost (seen in the lab: a few ms a
device on a loaded machine; README "Machine facts"). The attach says so in its log line
(`CLSACT_LOG`), with how long the adds took. A replace of a filter on an existing clsact drops
nothing.

tcx (`--bpf-tc-attach=tcx`, or `auto` where the kernel has it: Linux 6.6; agent/ebpf/tcx.py)
avoids that moment: the programs go on through bpf_links, no qdisc is added, so nothing is dropped
(CLSACT_LOG is never logged). The same effects, kept by the same methods:

* egress first, then ingress, one program of ours on each hook, each link pinned as
  `ekp_tcx*_<hook>_<device>_<ifindex>` in the pin directory. tcx sets no skb->tc_classid, where
  cls_bpf sets the filter's classid: no program of ours reads it, and a bridge port's bridge, for
  the bpf host routing's source check, is in ekp_port_v2 (`port_bridge`), written before the
  port's ingress program goes on (either attach). An older generation read it from tc_classid,
  written on tcx by a classid program first on each ingress hook (tcx.py): it is left while an
  older program runs behind ours and removed once ours serves the hook;
* a restart updates the pinned links in place (BPF_LINK_UPDATE: atomic, as "replace" was); our
  filters left on a clsact qdisc by an agent on clsact are deleted once the link is on (the link
  runs before them: nothing met them any more); the qdisc is left in place, empty, since a qdisc
  delete grafts and drops as an add does;
* the hand-over: in front of an older generation on clsact, our link runs first by itself and its
  TC_ACT_UNSPEC falls through to the older filter, so `rehome` deletes the older filters; in front
  of an older generation on tcx, ours gets a link right before the older one's (BPF_F_BEFORE,
  pinned as `ekp_tcxfront_*`), and `rehome` detaches the older link and pins ours in its place
  (the kernel holds a program once per hook, so the older link cannot be updated to ours while
  ours is in front);
* the watcher gives a new pod device its links; a deleted device's links go defunct (the kernel
  detaches them), and their pins are removed on RTM_DELLINK and by every verifying reconcile;
* `detach_all` detaches every tcx link of ours (a tcx query of each device, by program name), so
  it needs no pin path; the pins then hold defunct links until `remove_pins` or the next sweep.

An agent on clsact after one on tcx (the setting changed back) attaches its filters, then detaches
the pinned links (they would run in front of the filters): device by device, not in front of the
older generation as a hand-over would be. `fronts_left` (agent doctor) lists what a hand-over cut
short left in front with either (a filter at FRONT_PRIO, a tcx link in front of another program of
ours), and `hooks_report` (agent inspect hooks) what each device's hooks run, tcx links and filters.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import RTMGRP_LINK

from agent.config import Config, NodeContext
from agent.ebpf import abi, tcx, xdp
from agent.ebpf.maps import MapError, MapWriter
from agent.localdetect import LocalDetector
from agent.netns import netns_route, run_in_netns
from agent.node import matches_pod_pattern, read_node

log = logging.getLogger(__name__)

WATCHER_STOP_TIMEOUT = 5.0  # seconds `stop_watcher` waits for the watcher thread to end

PROG_FROM_NET = "ekp_from_net"
PROG_FROM_POD = "ekp_from_pod"
PROG_EGRESS = "ekp_egress"
OUR_NAME_PREFIX = "ekp_"

FILTER_PRIO = 17  # lower runs first; a fixed spot no one else is likely to take
# Where a new generation goes in front of an older one during an upgrade's hand-over (module doc).
FRONT_PRIO = FILTER_PRIO - 1
OUR_PRIOS = (FILTER_PRIO, FRONT_PRIO)
FILTER_HANDLE = 0xEB
# What would not fail where ekp_xdp_net's attach did, by --bpf-xdp: native fails where the driver
# has no XDP of its own; best-effort then attaches none and generic runs it anyway.
_XDP_ATTACH_HINTS = {"native": " (--bpf-xdp=best-effort or generic would not fail)"}
FILTER_CLASSID = 1  # (an older generation's ingress filters carried the port's bridge here)
TC_H_INGRESS_QDISC = 0xFFFFFFF1  # parent of the clsact / ingress qdisc
TC_H_INGRESS = 0xFFFFFFF2  # clsact ingress hook (`tc filter ... ingress`)
TC_H_EGRESS = 0xFFFFFFF3  # clsact egress hook
RT_SCOPE_LINK = 253  # an address valid on its link only (IPv6 fe80::/10)
TCA_BPF_ID = 11  # the id of a bpf filter's program (pyroute2 does not decode it)


# rtnetlink link events, read from a plain socket: pyroute2's buffered reader does not mix with
# select(), and a watcher must never sit on an event it has already read.
RTM_NEWLINK = 16
RTM_DELLINK = 17
IFLA_IFNAME = 3
IFLA_MASTER = 10
IFLA_LINKINFO = 18
IFLA_INFO_SLAVE_KIND = 4  # nested in IFLA_LINKINFO: the kind of the device's master ("bridge")
_NLMSG_HDR = struct.Struct("=IHHII")
_IFINFO = struct.Struct("=BxHiII")
_RTA = struct.Struct("=HH")


def link_event_socket() -> socket.socket:
    """A non-blocking rtnetlink socket subscribed to link events, in the caller's netns."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.bind((0, RTMGRP_LINK))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _rta_string(data: bytes, start: int, end: int) -> str:
    return data[start:end].split(b"\0", 1)[0].decode(errors="replace")


def _slave_kind(data: bytes, start: int, end: int) -> str:
    """IFLA_INFO_SLAVE_KIND within the IFLA_LINKINFO attribute payload data[start:end] ("" none)."""
    while start + _RTA.size <= end:
        alen, atype = _RTA.unpack_from(data, start)
        if alen < _RTA.size:
            break
        if atype & 0x3FFF == IFLA_INFO_SLAVE_KIND:
            return _rta_string(data, start + _RTA.size, min(start + alen, end))
        start += (alen + 3) & ~3
    return ""


def parse_link_events(data: bytes) -> list[tuple[int, int, str, int, str]]:
    """(message type, ifindex, ifname, master ifindex or 0, the master's kind or "") of each
    RTM_NEWLINK / RTM_DELLINK in a netlink datagram, except the bridge's own (family AF_BRIDGE):
    every enslave and release also comes as an AF_UNSPEC notice carrying IFLA_MASTER and
    IFLA_INFO_SLAVE_KIND, or none, while the bridge's say little the device's would not, or mislead:
    an AF_BRIDGE RTM_DELLINK is a port leaving the bridge, not a device going, and the bridge's
    notice about itself (`bridge vlan add ... self`) names the bridge as its own master."""
    out: list[tuple[int, int, str, int, str]] = []
    off = 0
    while off + _NLMSG_HDR.size <= len(data):
        length, mtype, _, _, _ = _NLMSG_HDR.unpack_from(data, off)
        if length < _NLMSG_HDR.size or off + length > len(data):
            break
        body = off + _NLMSG_HDR.size
        if (
            mtype in (RTM_NEWLINK, RTM_DELLINK)
            and length >= _NLMSG_HDR.size + _IFINFO.size
            and _IFINFO.unpack_from(data, body)[0] != socket.AF_BRIDGE
        ):
            _, _, index, _, _ = _IFINFO.unpack_from(data, body)
            name, master, kind = "", 0, ""
            attr, end = body + _IFINFO.size, off + length
            while attr + _RTA.size <= end:
                alen, atype = _RTA.unpack_from(data, attr)
                if alen < _RTA.size:
                    break
                if atype & 0x3FFF == IFLA_IFNAME:
                    name = _rta_string(data, attr + _RTA.size, attr + alen)
                elif atype & 0x3FFF == IFLA_MASTER and alen >= _RTA.size + 4:
                    (master,) = struct.unpack_from("=I", data, attr + _RTA.size)
                elif atype & 0x3FFF == IFLA_LINKINFO:
                    kind = _slave_kind(data, attr + _RTA.size, min(attr + alen, end))
                attr += (alen + 3) & ~3
            out.append((mtype, index, name, master, kind))
        off += (length + 3) & ~3
    return out


def read_link_events(sock: socket.socket) -> list[tuple[int, int, str, int, str]]:
    """Every link event queued on `sock` (empty when none)."""
    out: list[tuple[int, int, str, int, str]] = []
    while True:
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return out
        out += parse_link_events(data)


@dataclass(frozen=True)
class Link:
    index: int
    name: str
    master: int = 0  # ifindex of the bridge (or bond, VRF) it is a port of; 0: none
    master_kind: str = ""  # its master's kind (IFLA_INFO_SLAVE_KIND: "bridge", "bond", "vrf")


def _master_kind(msg: Any) -> str:
    info = msg.get_attr("IFLA_LINKINFO")
    return str(info.get_attr("IFLA_INFO_SLAVE_KIND") or "") if info is not None else ""


def list_links(ipr: Any) -> list[Link]:
    return [
        Link(int(m["index"]), str(m.get("ifname")), int(m.get("master") or 0), _master_kind(m))
        for m in ipr.get_links()
    ]


def pod_side_program(link: Link, config: Config, local: LocalDetector, bridge: int) -> str | None:
    """The program a device that is not external carries, or None (see the module docstring).
    `bridge`: the ifindex of the detector's bridge (BridgeInterface), 0 when missing."""
    if link.name == "lo":
        return None
    pod_device = matches_pod_pattern(link.name, config.pod_interfaces)
    if local.interface:
        if bridge and link.master == bridge:
            return PROG_FROM_POD
        return PROG_FROM_NET if pod_device and link.index != bridge else None
    if local.prefix:
        if local.is_local_device(link.name):
            return PROG_FROM_POD
        return PROG_FROM_NET if pod_device else None
    return PROG_FROM_POD if pod_device else None


def port_bridge(link: Link) -> int:
    """The bridge a device is a port of (its master's ifindex; 0 for none, and for a master of
    another kind: a bond, a VRF), which the Attacher writes to ekp_port_v2 before the device's
    ingress program runs: the node routes a bridged pod's addresses by the bridge, and the bpf host
    routing's source check (bpf/ekp_redirect.h) accepts a route back by the port's bridge."""
    return link.master if link.master_kind == "bridge" else 0


def bridge_index(ipr: Any, local: LocalDetector) -> int:
    """The ifindex of the detector's bridge (BridgeInterface), 0 when none or missing."""
    if not local.interface:
        return 0
    found = ipr.link_lookup(ifname=local.interface)
    return int(found[0]) if found else 0


def devices_with_addresses(ipr: Any, addresses: Iterable[str]) -> set[int]:
    """ifindexes of the devices holding any of `addresses`, IPv4 or IPv6 (the tc IPv6 path's
    replies come back by the device of an IPv6 node address, which may hold no IPv4 one). An
    IPv6 address of link scope never counts: every pod's veth holds an fe80:: one, unique to its
    link only, and a node address is global (agent/node.py discover_node)."""
    wanted = {str(ipaddress.ip_address(a)) for a in addresses}
    families = {socket.AF_INET6 if ":" in a else socket.AF_INET for a in wanted}
    return {
        int(m["index"])
        for family in sorted(families)
        for m in ipr.get_addr(family=family)
        if (family == socket.AF_INET or int(m["scope"]) != RT_SCOPE_LINK) and str(m.get("address")) in wanted
    }


def external_devices(ipr: Any, config: Config, node: NodeContext, *, quiet: bool = False) -> dict[int, str]:
    """ifindex -> name of the external devices: --devices, else those holding a node IP (of either
    family: `node.node_ips` holds the IPv6 ones too where the tc IPv6 path serves). `quiet`: a
    device --devices names that is missing is not warned about (the reconcile that attaches does).

    Looks devices up one by one (no dump of every link: a node may have hundreds of pod veths).
    """
    out: dict[int, str] = {}
    if config.devices:
        missing = []
        for name in config.devices:
            found = ipr.link_lookup(ifname=name)
            if found:
                out[int(found[0])] = name
            else:
                missing.append(name)
        if missing and not quiet:
            log.warning(
                "--devices names %s, not found in netns %s", ",".join(missing), config.netns or "(own)"
            )
        return out
    for index in sorted(devices_with_addresses(ipr, node.node_ips)):
        for msg in ipr.get_links(index):
            name = str(msg.get("ifname"))
            if name != "lo":
                out[index] = name
    return out


def external_kinds(config: Config, *, ipv6: bool) -> dict[str, str]:
    """Name -> rtnetlink kind (xdp.link_kind) of each device the first reconcile would find external
    now: the node's addresses as the agent reads them (--node-ip, else what its devices hold; the
    IPv6 ones too with `ipv6`, where the tc IPv6 path serves). What the start's load reads to tell
    whether --bpf-xdp=best-effort could attach ekp_xdp_net anywhere (agent/ebpf/proxier.py)."""

    def node_ips(family: int) -> tuple[str, ...]:
        return config.node_ips_of(family) or read_node(config, family).node_ips

    node = NodeContext(node_ips=(*node_ips(4), *(node_ips(6) if ipv6 else ())))
    with netns_route(config.netns) as ipr:
        return {
            name: xdp.link_kind(ipr, index)
            for index, name in external_devices(ipr, config, node, quiet=True).items()
        }


def wanted_devices(ipr: Any, config: Config, node: NodeContext) -> dict[int, tuple[str, str]]:
    """ifindex -> (device name, program name) for every device that should carry a program."""
    out = {index: (name, PROG_FROM_NET) for index, name in external_devices(ipr, config, node).items()}
    local = config.local_detector()
    bridge = bridge_index(ipr, local)
    if local.interface and not bridge:
        log.warning(
            "--pod-bridge-interface %s not found in netns %s: no pod traffic is local until it exists",
            local.interface,
            config.netns or "(own)",
        )
    for link in list_links(ipr):
        if link.index in out:
            continue
        prog = pod_side_program(link, config, local, bridge)
        if prog is not None:
            out[link.index] = (link.name, prog)
    return out


def _is_ours(msg: Any, prio: int = FILTER_PRIO) -> bool:
    name = msg.get_nested("TCA_OPTIONS", "TCA_BPF_NAME")
    return (
        msg.get("kind") == "bpf"
        and (msg["info"] >> 16) == prio
        and msg["handle"] == FILTER_HANDLE
        and isinstance(name, str)
        and name.startswith(OUR_NAME_PREFIX)
    )


def _filters(ipr: Any, index: int, parent: int) -> list[Any]:
    """Filters on one hook, without the per-priority chain headers (handle 0)."""
    try:
        return [m for m in ipr.get_filters(index=index, parent=parent) if m["handle"] != 0]
    except NetlinkError as exc:
        if exc.code == errno.EINVAL:  # no clsact/ingress qdisc: no hook
            return []
        raise


def foreign_filters(ipr: Any, index: int) -> list[tuple[str, int]]:
    """(name or kind, priority) of every filter on the device's ingress hook that is not ours."""
    out = []
    for msg in _filters(ipr, index, TC_H_INGRESS):
        if not any(_is_ours(msg, prio) for prio in OUR_PRIOS):
            name = msg.get_nested("TCA_OPTIONS", "TCA_BPF_NAME") or msg.get("kind")
            entry = (str(name), int(msg["info"]) >> 16)
            if entry not in out:  # u32 dumps its hash table as one more filter at its priority
                out.append(entry)
    return out


def filter_prog_id(msg: Any) -> int:
    """The id of the program a bpf filter runs (TCA_BPF_ID, read from the message's bytes), 0 if
    the kernel gave none."""
    opts = msg.get_attr("TCA_OPTIONS")
    if opts is None:
        return 0
    data, at, end = opts.data, opts.offset + _RTA.size, opts.offset + opts.length
    while at + _RTA.size <= end:
        alen, atype = _RTA.unpack_from(data, at)
        if alen < _RTA.size:
            break
        if atype & 0x3FFF == TCA_BPF_ID and alen >= _RTA.size + 4:
            return int(struct.unpack_from("=I", data, at + _RTA.size)[0])
        at += (alen + 3) & ~3
    return 0


def our_prog_id(ipr: Any, index: int, parent: int, prio: int) -> int | None:
    """The program id of our filter on one hook at `prio` (0: unknown), None when there is none."""
    for msg in _filters(ipr, index, parent):
        if _is_ours(msg, prio):
            return filter_prog_id(msg)
    return None


def foreign_at(ipr: Any, index: int, parent: int, prio: int) -> str | None:
    """Name (or kind) of a filter not ours at `prio` on one hook, None when there is none."""
    for msg in _filters(ipr, index, parent):
        if (int(msg["info"]) >> 16) == prio and not _is_ours(msg, prio):
            return str(msg.get_nested("TCA_OPTIONS", "TCA_BPF_NAME") or msg.get("kind"))
    return None


def our_filter(ipr: Any, index: int, parent: int = TC_H_INGRESS, prio: int = FILTER_PRIO) -> str | None:
    """Name of our filter on the device's ingress (or `parent`) hook at `prio`, or None."""
    for msg in _filters(ipr, index, parent):
        if _is_ours(msg, prio):
            name = msg.get_nested("TCA_OPTIONS", "TCA_BPF_NAME")
            return str(name)
    return None


def _log_attached(prog: str, name: str, bridge: int, where: Iterable[str], how: str) -> None:
    """The line an attach of one device logs, for clsact filters and tcx links alike."""
    where = list(where)
    log.info(
        "attached %s to %s ingress%s and %s to its egress%s%s",
        prog,
        name,
        f" (a port of ifindex {bridge})" if bridge else "",
        PROG_EGRESS,
        how,
        f" (in front of the older generation's on {' and '.join(where)}, until the hand-over ends)"
        if where
        else "",
    )


def ensure_clsact(ipr: Any, index: int) -> bool:
    """The clsact qdisc on the device; whether it was added now (the device's transmit queue was
    stopped meanwhile: module doc)."""
    kinds = {q.get("kind") for q in ipr.get_qdiscs(index) if q["parent"] == TC_H_INGRESS_QDISC}
    if kinds & {"clsact", "ingress"}:
        return False
    try:
        ipr.tc("add", "clsact", index)
    except NetlinkError as exc:
        if exc.code != errno.EEXIST:
            raise
        return False
    return True


# Logged whenever the attach added clsact qdiscs (module doc); tests/traffic/test_switch.py reads
# the milliseconds to tell a datagram lost in that moment from one lost elsewhere.
CLSACT_LOG = (
    "added the clsact qdisc to %d device(s) that had none (%s) in %.1f ms: the kernel stops a"
    " device's transmit queue while it adds one, so what the node sent out of it meanwhile was"
    " dropped (TCP sends it again; a UDP datagram or an SCTP chunk is lost)"
)


def attach(
    ipr: Any,
    index: int,
    prog_name: str,
    fd: int,
    parent: int = TC_H_INGRESS,
    *,
    prio: int = FILTER_PRIO,
) -> bool:
    """clsact (if missing) and our direct-action filter on the ingress (or `parent`) hook,
    replacing whatever held our spot (`prio`: FRONT_PRIO in front of an older generation).
    Returns whether the clsact qdisc was added (`ensure_clsact`)."""
    added = ensure_clsact(ipr, index)
    ipr.tc(
        "replace-filter",
        "bpf",
        index,
        FILTER_HANDLE,
        fd=fd,
        name=prog_name,
        parent=parent,
        prio=prio,
        # What cls_bpf puts in skb->tc_classid before the program runs: nothing of ours reads it
        # (the programs overwrite it with the legacy host routing's tag or 0: bpf/ekp_host.h).
        classid=FILTER_CLASSID,
        direct_action=True,
    )
    return added


def drop_front(ipr: Any, index: int, parent: int) -> bool:
    """Remove our filter at FRONT_PRIO from one hook (a hand-over's, done or cut short); True if
    one was there."""
    if our_filter(ipr, index, parent, FRONT_PRIO) is None:
        return False
    ipr.tc("del-filter", "bpf", index, FILTER_HANDLE, parent=parent, prio=FRONT_PRIO)
    return True


def detach(ipr: Any, index: int) -> bool:
    """Remove our filters from one device, ingress first, then egress (and clsact if nothing else
    is left); True if one was there."""
    found = False
    for parent in (TC_H_INGRESS, TC_H_EGRESS):
        for prio in OUR_PRIOS:
            if our_filter(ipr, index, parent, prio) is not None:
                ipr.tc("del-filter", "bpf", index, FILTER_HANDLE, parent=parent, prio=prio)
                found = True
    if found and not _filters(ipr, index, TC_H_INGRESS) and not _filters(ipr, index, TC_H_EGRESS):
        kinds = {q.get("kind") for q in ipr.get_qdiscs(index) if q["parent"] == TC_H_INGRESS_QDISC}
        if "clsact" in kinds:
            ipr.tc("del", "clsact", index)
    return found


@dataclass(frozen=True)
class HookProgram:
    """One program a device's tc hook runs: through a tcx link, or a clsact qdisc's filter."""

    kind: str  # "tcx" or "clsact"
    name: str  # the program's name (a filter that is no bpf one: its kind)
    prog_id: int  # 0: unknown
    at: int  # the tcx link's id (0: attached without a link), or the filter's priority

    def __str__(self) -> str:
        where = f"link {self.at}" if self.kind == "tcx" else f"pref {self.at}"
        return f"{self.kind} {self.name or '?'} (prog {self.prog_id}, {where})"

    @property
    def ours(self) -> bool:
        return self.name.startswith(OUR_NAME_PREFIX) and self.name != tcx.CLASSID_PROG_NAME


def hook_programs(ipr: Any, netns: str, index: int, hook: str) -> list[HookProgram]:
    """What one tc hook (tcx.INGRESS or tcx.EGRESS) of a device runs, in the kernel's order: the
    tcx programs first, in their list's order, then the clsact filters by priority (tcx.py's
    module doc); `ipr` and `netns` name the same namespace (a tcx query takes an ifindex)."""

    def query() -> list[HookProgram]:
        return [HookProgram("tcx", tcx.prog_name(p), p, link) for p, link in tcx.hook_links(index, hook)]

    out = run_in_netns(netns, query)
    filters = sorted(
        _filters(ipr, index, TC_H_INGRESS if hook == tcx.INGRESS else TC_H_EGRESS),
        key=lambda m: int(m["info"]) >> 16,
    )
    for msg in filters:
        name = msg.get_nested("TCA_OPTIONS", "TCA_BPF_NAME") if msg.get("kind") == "bpf" else None
        prog = filter_prog_id(msg) if msg.get("kind") == "bpf" else 0
        entry = HookProgram("clsact", str(name or msg.get("kind") or ""), prog, int(msg["info"]) >> 16)
        if not out or out[-1] != entry:  # u32 dumps its hash table as one more filter at its priority
            out.append(entry)
    return out


def hooks_report(ipr: Any, netns: str) -> list[str]:
    """One line for each device's tc hook that runs a program, "DEVICE HOOK: PROGRAM -> ..." in
    run order (agent inspect hooks: which programs run where, whichever way they were attached)."""
    out = []
    for link in list_links(ipr):
        for hook in (tcx.INGRESS, tcx.EGRESS):
            progs = hook_programs(ipr, netns, link.index, hook)
            if progs:
                out.append(f"{link.name} {hook}: " + " -> ".join(map(str, progs)))
    return out


def fronts_left(ipr: Any, netns: str) -> list[str]:
    """ "DEVICE HOOK: PROGRAM ..." of each program of ours in front of another of ours (agent
    doctor: outside a hand-over, one left by a hand-over cut short): a filter at FRONT_PRIO, a tcx
    link before another of our tcx links (`ekp_tcxfront_*`), or our tcx link in front of our
    filter at FILTER_PRIO (an older generation on clsact, whose filters the rehome deletes). An
    older generation's classid program (tcx.py) is no program of ours for this: it went first."""
    out = []
    for link in list_links(ipr):
        for hook in (tcx.INGRESS, tcx.EGRESS):
            progs = [p for p in hook_programs(ipr, netns, link.index, hook) if p.ours]
            for i, ahead in enumerate(progs):
                behind = progs[i + 1] if i + 1 < len(progs) else None
                if (ahead.kind == "clsact" and ahead.at == FRONT_PRIO) or (ahead.kind == "tcx" and behind):
                    out.append(
                        f"{link.name} tc {hook}: {ahead}" + (f" in front of {behind}" if behind else "")
                    )
    return out


class DetachFailed(NetlinkError):  # type: ignore[misc]  # pyroute2 is untyped
    """detach_all could not detach from some devices (`failed`, "DEVICE: error"; they still run
    our programs) after it went on with the others (`detached`: those it detached ours from)."""

    def __init__(self, code: int, detached: list[str], failed: list[str]) -> None:
        super().__init__(code, f"cannot detach from {'; '.join(failed)}")
        self.detached = detached
        self.failed = failed


def _ours(ipr: Any, index: int) -> int:
    """How many filters of ours the device's hooks hold."""
    return sum(
        _is_ours(msg, prio)
        for parent in (TC_H_INGRESS, TC_H_EGRESS)
        for msg in _filters(ipr, index, parent)
        for prio in OUR_PRIOS
    )


def detach_all(
    netns: str, detached: list[str] | None = None, *, between: Callable[[], None] | None = None
) -> list[str]:
    """Remove our filters, tcx links and XDP programs from every device of `netns`; names of the devices
    that had one, each appended to `detached` (the caller's, if given) as soon as one of our
    programs left it, so that a caller stopped by any exception knows; `between` is called
    before each device (a hand-back renews its holds there).

    A namespace that no longer exists holds nothing of ours: returns []. A device that refuses,
    or whose answer cannot be read, does not stop the others; one half detached (XDP gone and a
    filter not, ingress gone and egress not) counts as detached: its programs no longer see every
    packet of its flows. DetachFailed at the end says which were detached and which not (a caller
    undoing what it did before the detach must know whether any device was).
    """
    done: list[str] = [] if detached is None else detached
    try:
        with netns_route(netns) as ipr:
            failed: list[str] = []
            code = 0
            for link in list_links(ipr):
                if between is not None:
                    between()
                ours = -1  # not counted yet
                xdp_ours = in_xdp = False
                try:
                    xdp_ours = xdp.is_ours(xdp.xdp_state(ipr, link.index))
                    in_xdp = True
                    if xdp_ours and xdp.detach(ipr, link.index):
                        done.append(link.name)
                    in_xdp = False
                    ours = _ours(ipr, link.index) + _tcx_ours(netns, link.index)
                    if _detach_tcx(netns, link.index) and link.name not in done:
                        done.append(link.name)
                    if detach(ipr, link.index) and link.name not in done:
                        done.append(link.name)
                except Exception as exc:
                    gone = isinstance(exc, NetlinkError) and exc.code in (errno.ENODEV, errno.ENOENT)
                    try:
                        if in_xdp:  # its answer lost: whether ours is still there says
                            half = xdp_ours and (gone or not xdp.is_ours(xdp.xdp_state(ipr, link.index)))
                        else:
                            left = _ours(ipr, link.index) + _tcx_ours(netns, link.index)
                            half = ours > 0 and (gone or left < ours)
                    except Exception:  # unreadable: counted as left, the side whose mistake
                        half = xdp_ours if in_xdp else ours > 0  # costs strangers, not flows moved elsewhere
                    if gone:  # the device or the filter gone meanwhile: nothing left to detach
                        if half and link.name not in done:
                            done.append(link.name)
                        continue
                    if half and link.name not in done:
                        done.append(link.name)
                    code = code or getattr(exc, "code", 0) or getattr(exc, "errno", 0) or errno.EIO
                    failed.append(
                        f"{link.name}: {exc if isinstance(exc, NetlinkError | OSError) else repr(exc)}"
                    )
            if failed:
                raise DetachFailed(code, list(done), failed)
            return done
    except FileNotFoundError:
        log.info("netns %s does not exist: nothing to detach", netns)
        return done


# A hand-over of a clsact start from an older generation on tcx: through a tcx link in front of
# the older one until the rehome (`_attach`).
TO_CLSACT = "to-clsact"


def _hook(parent: int) -> str:
    return tcx.INGRESS if parent == TC_H_INGRESS else tcx.EGRESS


def _tcx_ours(netns: str, index: int) -> int:
    """How many tcx links of ours the device's hooks hold (0 where the kernel has no tcx, or the
    namespace went meanwhile)."""

    def count() -> int:
        return sum(
            tcx.prog_name(prog).startswith(OUR_NAME_PREFIX)
            for hook in (tcx.INGRESS, tcx.EGRESS)
            for prog, link_id in tcx.hook_links(index, hook)
            if link_id
        )

    try:
        return run_in_netns(netns, count)
    except FileNotFoundError:
        return 0


def _detach_tcx(netns: str, index: int) -> int:
    """Detach our tcx links from one device (in its namespace: a tcx query names the device by
    ifindex); how many. Their pins, if any, then hold defunct links: the caller's remove_pins, or
    the next agent's sweep, removes them."""
    try:
        return run_in_netns(netns, lambda: tcx.detach_ours(index, OUR_NAME_PREFIX))
    except FileNotFoundError:  # the namespace went meanwhile: nothing of ours is left in it
        return 0


@dataclass(frozen=True)
class HandoverState:
    """Our filters on a namespace's hooks, as a hand-over sees them at an agent's start."""

    own_front: bool  # this build in front somewhere: its hand-over started (then was cut short)
    other_front: bool  # another build of ours in front somewhere: a hand-over of its, cut short
    older_behind: bool  # another build's filter at FILTER_PRIO somewhere: something to hand over from


class Attacher:
    """Keeps our programs on the devices that need them, in one network namespace.

    `prog_fds` maps program names (PROG_FROM_NET, PROG_FROM_POD, PROG_EGRESS; xdp.PROG_XDP where the
    load took it, MapSizes.xdp: not with --bpf-xdp=disabled, nor with best-effort while every
    external device was a veth, `xdp_wanted`) to loaded program fds; they must stay open while the
    Attacher is used (`use_programs` hands it another load's). `ports` is ekp_port_v2 (abi.MAPS["port"]),
    which it keeps holding each attached bridge port's bridge (`port_bridge`), written before the
    device's ingress program is attached and deleted when the device goes or stops being a port.
    The constructor does nothing; `reconcile` attaches (called by every sync) and `start_watcher`
    starts the pod-device thread.
    """

    def __init__(self, config: Config, prog_fds: Mapping[str, int], ports: MapWriter) -> None:
        self._config = config
        self._fds = dict(prog_fds)
        self._ports = ports
        self._lock = threading.Lock()
        self._attached: dict[int, tuple[str, str]] = {}  # ifindex -> (name, program)
        self._external: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.attachments = 0  # filters attached (or replaced) since construction
        self._xdp: dict[int, str] = {}  # external ifindex -> XDP mode it runs in ("" none)
        # External devices best-effort would try XDP on while no XDP program is loaded (the start's
        # load left it out: every external device was a veth then), ifindex -> name: the proxier
        # loads the programs again with XDP and hands them over (`use_programs`).
        self._xdp_wanted: dict[int, str] = {}
        # Held across each ekp_port_v2 write and the caches' update, so that the watcher and a
        # reconcile cannot leave the map and `_bridges` disagreeing.
        self._ports_lock = threading.Lock()
        self._bridges: dict[int, int] = {}  # ifindex -> its bridge as ekp_port_v2 holds it (port_bridge)
        self._port_writes = 0  # ekp_port_v2 writes (updates and deletes) so far
        self._written: dict[int, int] = {}  # ifindex -> `_port_writes` after its latest write
        # ifindexes whose latest write the map refused: logged once as an error, not on every
        # verify and watcher event that tries again.
        self._refused: set[int] = set()
        # (ifindex, hook) -> the program put in front of an older generation's by a hand-over's
        # reconcile, until `rehome` moves it to FILTER_PRIO.
        self._fronts: dict[tuple[int, int], str] = {}
        self._ids: frozenset[int] | None = None  # _own_ids
        self._tcx: bool | None = None  # through tcx links (`use_tcx`), decided at the first attach
        # (ifindex, hook) -> what a tcx hand-over's rehome does there: "clsact" (delete the older
        # generation's filters behind our link) or "tcx" (take the older link over, drop our front).
        self._front_kinds: dict[tuple[int, int], str] = {}

    @property
    def attached(self) -> dict[int, tuple[str, str]]:
        with self._lock:
            return dict(self._attached)

    @property
    def use_tcx(self) -> bool:
        """Whether the tc programs go on through tcx links (--bpf-tc-attach; probed once: a
        kernel without tcx gets clsact, with one log line saying why)."""
        if self._tcx is None:
            mode = self._config.bpf_tc_attach
            why = "" if mode == "clsact" else tcx.probe()
            self._tcx = mode != "clsact" and not why
            if why:
                # Asked for by name, it is worth a warning; the default's fallback is what the
                # kernel allows, nothing an operator must act on.
                log.log(
                    logging.WARNING if mode == "tcx" else logging.INFO,
                    "--bpf-tc-attach=%s: %s; attaching through clsact qdiscs instead (adding one to a "
                    "device drops what the node sends out of it meanwhile)",
                    mode,
                    why,
                )
            elif self._tcx:
                log.info(
                    "attaching the tc programs through tcx links (no qdisc added), pinned in %s as %s*",
                    self._config.pin_path,
                    tcx.PIN_PREFIX,
                )
        return self._tcx

    def _set_bridge(self, index: int, bridge: int, *, force: bool = False, since: int = -1) -> None:
        """ekp_port_v2 says `bridge` (0: no entry) for the device: before its ingress program is
        attached or swapped, so that no packet of a bridged pod meets one without it. `force`:
        write though the cache says it is there (a verify found the map saying otherwise), unless
        the device's entry was written after `since` (`_port_mark`): that writer listed the
        device later, so it knows better."""
        with self._ports_lock:
            if self._written.get(index, -1) > since >= 0:
                return
            if not force and self._bridges.get(index, -1) == bridge:
                return
            key = ctypes.c_uint32(index)
            try:
                if bridge:
                    self._ports.update(key, abi.Port(bridge=bridge))
                else:
                    self._ports.delete(key)
            except MapError as exc:
                # The device gets its programs all the same (and the devices after it theirs); with
                # no cached entry, the next verify finds the map lacking and writes it again.
                self._bridges.pop(index, None)
                if index in self._refused:
                    log.debug("ekp_port_v2 still refuses ifindex %d's bridge (%d): %s", index, bridge, exc)
                    return
                self._refused.add(index)
                log.error(
                    "cannot write ifindex %d's bridge (%d; 0: none) to ekp_port_v2: %s. Until a verify "
                    "writes it, Service traffic of this port's pods that bpf host routing redirects "
                    "is dropped as spoofed_source (legacy host routing is unaffected); if the map is "
                    "full, raise --bpf-port-max, remove the pin %s (the agent refills the map before "
                    "it attaches) and restart: a pinned map keeps its size; on ENOMEM, give the "
                    "agent's memory cgroup room (the map allocates each entry as written)",
                    index,
                    bridge,
                    exc,
                    os.path.join(self._config.pin_path, abi.MAPS["port"].name),
                )
                return
            if index in self._refused:
                self._refused.discard(index)
                log.info("ekp_port_v2 took ifindex %d's bridge (%d; 0: none) at last", index, bridge)
            self._bridges[index] = bridge
            self._port_writes += 1
            self._written[index] = self._port_writes

    def _forget_bridge(self, index: int) -> None:
        """The device went or no longer carries ours: its entry goes (its ifindex may come back as
        another device's). A write all the same: a reconcile that listed the device before it went
        must not write its entry again (`since`); the tombstone goes with the prune after the
        next listing."""
        with self._ports_lock:
            had = self._bridges.pop(index, -1)
            self._port_writes += 1
            self._written[index] = self._port_writes
            self._refused.discard(index)
            if had != 0:
                self._ports.delete(ctypes.c_uint32(index))

    def _port_mark(self) -> int:
        """Taken before a reconcile lists the devices: an entry written after it is the watcher's
        (a device that came, or changed bridge, after the listing), which that reconcile leaves."""
        with self._ports_lock:
            return self._port_writes

    def _untouched_since(self, gone: set[int], known: dict[int, tuple[str, str]], mark: int) -> set[int]:
        """Of the devices a reconcile found no longer wanted, those the watcher has not attached or
        written an entry for since `known` and `mark` were taken: the watcher saw them later (a pod
        veth the CNI enslaved after the listing), so they are not the reconcile's to detach."""
        with self._ports_lock:
            fresh = {index for index in gone if self._written.get(index, -1) > mark}
        with self._lock:
            return {index for index in gone - fresh if self._attached.get(index) == known[index]}

    def _live_bridges(self) -> dict[int, int]:
        """ekp_port_v2 as the kernel holds it ({port ifindex: bridge}; few entries, one per pod
        port): what a verify checks, rather than our cache of it."""
        with self._ports_lock:
            return {int(k.value): int(v.bridge) for k, v in self._ports.items() if isinstance(v, abi.Port)}

    def _cached_bridge(self, index: int, default: int = 0) -> int:
        with self._ports_lock:
            return self._bridges.get(index, default)

    def _prune_bridges(self, keep: Collection[int], since: int) -> None:
        """Remove the entries of devices not in `keep` (a device that went while no agent ran, or
        whose RTM_DELLINK the watcher missed), except those written after `since` (`_port_mark`,
        taken before `keep` was listed: a device the watcher attached since, not in `keep`)."""
        with self._ports_lock:
            stale = [
                index
                for index in (int(k.value) for k, _ in self._ports.items())
                if index not in keep and self._written.get(index, -1) <= since
            ]
            for index in stale:
                self._bridges.pop(index, None)
                self._written.pop(index, None)
                self._ports.delete(ctypes.c_uint32(index))
            present = set(self._bridges) | {int(k.value) for k, _ in self._ports.items()}
            for index in [i for i, n in self._written.items() if n <= since and i not in present]:
                del self._written[index]  # a tombstone older than the listing `keep` comes from
        if stale:
            log.info("removed the bridge entries of ifindexes %s (no longer pod ports of ours)", stale)

    def _classid_kept(self, pins: list[tcx.Pinned], index: int) -> bool:
        """No older classid link is left on the device's ingress, or a hand-over's program of ours
        is in front there (the older program behind it still reads what the classid program
        writes, until `rehome`)."""
        with self._lock:
            front = (index, TC_H_INGRESS) in self._fronts
        return front or tcx.find(pins, tcx.CLASSID, tcx.INGRESS, index) is None

    def _drop_classid(self, pins: list[tcx.Pinned], index: int) -> None:
        """An older generation's classid program (tcx.py) in front of ingress goes, once our own
        program there no longer reads what it writes (every hook served by this build's)."""
        pin = tcx.find(pins, tcx.CLASSID, tcx.INGRESS, index)
        if pin is not None:
            tcx.remove(pin)
            log.info(
                "removed the older generation's %s link on %s ingress (ours reads ekp_port_v2)",
                tcx.CLASSID_PROG_NAME,
                pin.device,
            )

    def _tcx_link(
        self, pins: list[tcx.Pinned], role: str, hook: str, name: str, index: int, fd: int, before: str = ""
    ) -> tcx.Pinned | None:
        """Our link of `role` on one hook runs `fd`'s program: updated in place where one is
        pinned and live, else created (a defunct pin of the same ifindex removed first). None: the
        hook runs the program already through a link another thread (the watcher, a verifying
        reconcile) created meanwhile, not pinned yet."""
        pin = tcx.find(pins, role, hook, index)
        if pin is not None and pin.live:
            if pin.prog_id != tcx.prog_id(fd):
                tcx.update(pin, fd)
            if pin.device != name:
                pin = tcx.rename(pin, name, self._config.pin_path)
            return pin
        netns = self._config.netns
        try:
            return tcx.create(netns, self._config.pin_path, role, hook, name, index, fd, before=before)
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                raise
            # The kernel holds a program once per hook: another thread attached this one first.
            again = tcx.find(tcx.pinned(self._config.pin_path, {index}), role, hook, index)
            if again is not None and again.live and again.prog_id == tcx.prog_id(fd):
                return again
            log.debug(
                "%s %s runs %s already (attached meanwhile by another thread)", name, hook, role or "ours"
            )
            return None

    def _tcx_prog(self, ipr: Any, pins: list[tcx.Pinned], index: int, parent: int) -> str | None:
        """The name of the program our live tcx link runs on one hook (None: no such link)."""
        pin = tcx.find(pins, tcx.MAIN, _hook(parent), index)
        if pin is None or not pin.live:
            return None
        return tcx.prog_name(pin.prog_id)

    def _hook_prog(
        self, ipr: Any, pins: list[tcx.Pinned] | None, index: int, parent: int = TC_H_INGRESS
    ) -> str | None:
        """The program of ours serving one hook: our live tcx link's where tcx is used, else our
        filter's (also on tcx where no link of ours is: a device a clsact generation served)."""
        if pins is not None:
            prog = self._tcx_prog(ipr, pins, index, parent)
            if prog is not None:
                return prog
        return our_filter(ipr, index, parent)

    def _pins(self, indexes: Collection[int] | None = None) -> list[tcx.Pinned] | None:
        """Our pinned tcx links (of the devices `indexes` when given) where tcx is used (None: clsact)."""
        return tcx.pinned(self._config.pin_path, indexes) if self.use_tcx else None

    def _detach(self, ipr: Any, index: int, pins: list[tcx.Pinned] | None) -> bool:
        """Ours off one device: filters, and tcx links with their pins; whether any was detached
        (`pins` may be older than the device's deletion: its links defunct, or swept meanwhile)."""
        found = detach(ipr, index)
        for pin in sorted((p for p in pins or () if p.index == index), key=tcx.removal_order):
            if tcx.remove(pin):
                found = True
        return found

    def _drop_filters(self, ipr: Any, index: int, parent: int) -> bool:
        """Remove our filters (both priorities) from one hook, the clsact qdisc left in place (a
        qdisc delete grafts too: module doc); whether one was there."""
        found = False
        for prio in OUR_PRIOS:
            if our_filter(ipr, index, parent, prio) is not None:
                ipr.tc("del-filter", "bpf", index, FILTER_HANDLE, parent=parent, prio=prio)
                found = True
        return found

    def attach_egress(self, node: NodeContext) -> None:
        """ekp_egress on every device that should carry our programs, ingress programs left as
        they are: before legacy host routing is switched on (the proxier), so that no ingress
        program hands the stack a packet that could leave by a device without its egress half."""
        added: list[str] = []
        started = time.monotonic()
        pins = self._pins()
        with netns_route(self._config.netns) as ipr:
            for index, (name, _) in sorted(wanted_devices(ipr, self._config, node).items()):
                try:
                    if pins is not None:
                        self._tcx_link(pins, tcx.MAIN, tcx.EGRESS, name, index, self._fds[PROG_EGRESS])
                        self._drop_filters(ipr, index, TC_H_EGRESS)
                    elif attach(ipr, index, PROG_EGRESS, self._fds[PROG_EGRESS], TC_H_EGRESS):
                        added.append(name)
                except NetlinkError as exc:
                    if exc.code != errno.ENODEV:  # gone again: nothing to hand over there
                        raise
                except OSError as exc:
                    if exc.errno != errno.ENODEV:
                        raise
        if added:
            log.info(CLSACT_LOG, len(added), ", ".join(added), (time.monotonic() - started) * 1000)

    @property
    def fronts(self) -> dict[tuple[int, int], str]:
        """(ifindex, hook) -> the program of each filter or link in front of an older generation's."""
        with self._lock:
            return dict(self._fronts)

    def reconcile(
        self,
        node: NodeContext,
        *,
        full: bool = False,
        verify: bool = False,
        keep_external: bool = False,
        front: bool = False,
    ) -> None:
        """Attach where missing.

        * default (every sync): only the external devices are looked up and checked; pod devices
          are the watcher's job, so a sync on a node with hundreds of pods stays cheap;
        * `verify` (now and then): every wanted device's filter is checked, in case ours was
          removed behind our back or the watcher missed a device;
        * `full` (first sync): every filter of ours is replaced with the current programs and
          devices that no longer match are detached; with `keep_external`, a device that carries
          our ekp_from_net stays external (its program replaced) though `node` does not name it:
          the agent's first sync before the IPv6 family's (`node` holds no IPv6 node address yet,
          and a device holding only one is external where the tc IPv6 path serves). A later
          reconcile with the full node detaches it if it does not qualify;
        * `front` (with `full`, an upgrade's hand-over): on each hook where another build's
          filter of ours is at FILTER_PRIO (the older generation's), ours goes in front of it at
          FRONT_PRIO, in the mode the build's hand-over map says (the caller chose it from
          `handover_state`), until `rehome`; a hook without one gets ours at FILTER_PRIO as
          always, and its copy at FRONT_PRIO goes. A full reconcile without `front` removes ours
          at FRONT_PRIO from every hook it attaches.
        """
        pins = self._pins() if full or verify else None
        # Links a run on tcx left: in clsact mode read too by a full reconcile, for removal only
        # (on devices no longer wanted, and defunct ones); `_attach` removes the wanted devices'.
        stale = pins if pins is not None or not full else tcx.pinned(self._config.pin_path)
        with netns_route(self._config.netns) as ipr:
            links: dict[int, Link] = {}
            # Both taken before the listing: a device the watcher attaches after it is in neither,
            # so this reconcile neither detaches it nor removes its entry as no longer wanted.
            mark = self._port_mark()
            known = self.attached
            if full or verify:
                wanted = wanted_devices(ipr, self._config, node)
                links = {link.index: link for link in list_links(ipr)}
                if full and keep_external:
                    for link in links.values():
                        if (
                            link.index not in wanted
                            and self._hook_prog(ipr, pins, link.index) == PROG_FROM_NET
                        ):
                            wanted[link.index] = (link.name, PROG_FROM_NET)
            else:
                wanted = {i: (n, PROG_FROM_NET) for i, n in external_devices(ipr, self._config, node).items()}
                # Every sync: only the pins of the devices it looks at (a node has many pods).
                looked_at = {i for i, (_, prog) in self.attached.items() if prog == PROG_FROM_NET}
                pins = self._pins(set(wanted) | looked_at)
            external = {i for i, (_, prog) in wanted.items() if prog == PROG_FROM_NET}
            with self._lock:
                self._external = external
            if not external:
                log.warning(
                    "no external device found in netns %s (node IPs %s, --devices %s): "
                    "traffic from other nodes is not translated",
                    self._config.netns or "(own)",
                    ",".join(node.node_ips) or "none",
                    ",".join(self._config.devices) or "auto",
                )
            gone: set[int] = set()
            if full:
                gone = self._untouched_since(set(known) - set(wanted), known, mark)
                for link in list_links(ipr):
                    if link.index not in wanted and self._detach(ipr, link.index, stale):
                        log.info("detached from %s (no longer matches)", link.name)
            else:
                # Devices we attached that no longer qualify (a node IP moved, a pod device renamed).
                if verify:
                    gone = set(known) - set(wanted)
                else:
                    gone = {i for i, (_, prog) in known.items() if prog == PROG_FROM_NET} - external
                gone = self._untouched_since(gone, known, mark)
                for index in gone:
                    try:
                        if self._detach(ipr, index, pins):
                            log.info("detached from %s (no longer matches)", known[index][0])
                    except NetlinkError as exc:
                        if exc.code != errno.ENODEV:
                            raise
            if full or verify:
                self._prune_bridges(wanted, mark)
            live = self._live_bridges() if verify and not full else None
            for index, (name, prog) in sorted(wanted.items()):
                if index in links:
                    bridge = port_bridge(links[index]) if prog == PROG_FROM_POD else 0
                else:
                    bridge = self._cached_bridge(index)
                # A verify's (a plain sync looks at external devices only, which have no bridge
                # entry). Written here, so before an attach below, as `_attach` would.
                if live is not None and index in links and live.get(index, 0) != bridge:
                    # The cache agreeing with the listing, only something else changed the map;
                    # otherwise the agent knew (a write the map refused, logged then) or the
                    # watcher has yet to see the change.
                    behind_our_back = self._cached_bridge(index, -1) == bridge
                    log.log(
                        logging.WARNING if behind_our_back else logging.DEBUG,
                        "ekp_port_v2 held bridge ifindex %d for %s, whose bridge is %d (0: none): "
                        "rewriting it%s",
                        live.get(index, 0),
                        name,
                        bridge,
                        " (an entry changed behind the agent's back)" if behind_our_back else "",
                    )
                    self._set_bridge(index, bridge, force=True, since=mark)
                if (
                    not full
                    and self._hook_prog(ipr, pins, index) == prog
                    and self._hook_prog(ipr, pins, index, TC_H_EGRESS) == PROG_EGRESS
                    and (pins is None or self._classid_kept(pins, index))
                ):
                    self._remember(index, name, prog)
                    continue
                self._attach(
                    ipr, index, name, prog, bridge, front=front, clear_front=full, pins=pins, since=mark
                )
            if stale is not None and (full or verify):
                # Moved away with an RTM_DELLINK the watcher missed (a device listed is still here).
                self._drop_moved(ipr, [p for p in tcx.pinned(self._config.pin_path) if p.index not in links])
                swept = tcx.sweep_defunct(self._config.pin_path)
                if swept:
                    log.info("removed the pins of tcx links whose device is gone: %s", ", ".join(swept))
            gone = self._untouched_since(gone, known, mark)
            for index in gone:
                self._xdp_off(ipr, index, known[index][0])
            for index in sorted(external):
                self._xdp_on(ipr, index, wanted[index][0], check=full or verify)
            for index in gone:
                self._forget_bridge(index)
            with self._lock:
                for index in gone:
                    self._attached.pop(index, None)

    @property
    def xdp_modes(self) -> dict[int, str]:
        """External ifindex -> the XDP mode ekp_xdp_net runs in there ("" none)."""
        with self._lock:
            return dict(self._xdp)

    @property
    def xdp_wanted(self) -> dict[int, str]:
        """ifindex -> name of the external devices --bpf-xdp=best-effort would try ekp_xdp_net on,
        which this Attacher was given no fd of (the start's load left it out)."""
        with self._lock:
            return dict(self._xdp_wanted)

    def use_programs(self, prog_fds: Mapping[str, int], ports: MapWriter) -> None:
        """Another load's programs (the same build, loaded again with XDP) and its ekp_port_v2 fd,
        for every attach from here: a full reconcile then replaces ours on every device (each
        filter or link in place, no moment without one). The pod-device watcher must be stopped
        meanwhile: an attach of its under way would put the older program back."""
        with self._ports_lock:
            self._ports = ports
        with self._lock:
            self._fds = dict(prog_fds)
            self._ids = None
            self._xdp.clear()
            self._xdp_wanted.clear()

    def _xdp_on(self, ipr: Any, index: int, name: str, *, check: bool) -> None:
        """ekp_xdp_net on one external device as --bpf-xdp says (off when disabled). Looked at
        again only by full and verifying reconciles: a device seen once keeps its verdict. A
        device best-effort would try while no XDP program is loaded is `xdp_wanted` (looked at
        again by every reconcile until the proxier loads one)."""
        mode = self._config.bpf_xdp
        fd = self._fds.get(xdp.PROG_XDP)
        if not check and index in self._xdp:
            return
        if mode == "best-effort" and fd is None:
            # Nothing to detach: an earlier run's program there is replaced in place once the
            # programs are loaded with XDP, and a veth keeps whatever it has, as with the program.
            try:
                left = xdp.leaves_alone(ipr, index, name, mode)
            except NetlinkError as exc:
                if exc.code == errno.ENODEV:
                    return
                raise
            with self._lock:
                if left:
                    self._xdp[index] = ""
                else:
                    self._xdp_wanted[index] = name
            return
        if mode == "disabled" or fd is None:
            # No XDP program this run (the loader leaves it out with --bpf-xdp=disabled): only an
            # earlier run's, still ahead of tc, is taken off.
            try:
                if xdp.detach(ipr, index):
                    log.info("detached %s from %s (--bpf-xdp=%s)", xdp.PROG_XDP, name, mode)
            except NetlinkError as exc:
                if exc.code == errno.ENODEV:
                    return
                log.error(
                    "cannot detach the earlier run's %s from %s: %s; it still runs ahead of tc, "
                    "retried every sync period; `ip link set dev %s xdp off` removes it",
                    xdp.PROG_XDP,
                    name,
                    exc,
                    name,
                )
            running = ""
        else:
            try:
                running = xdp.attach(ipr, index, name, fd, mode)
            except NetlinkError as exc:
                if exc.code == errno.ENODEV:
                    return
                log.error(
                    "cannot attach %s to %s in %s mode: %s; its tc program serves all of its traffic%s",
                    xdp.PROG_XDP,
                    name,
                    mode,
                    exc,
                    _XDP_ATTACH_HINTS.get(mode, ""),
                )
                running = ""
        with self._lock:
            self._xdp[index] = running

    def _xdp_off(self, ipr: Any, index: int, name: str) -> None:
        try:
            if xdp.detach(ipr, index):
                log.info("detached %s from %s (no longer an external device)", xdp.PROG_XDP, name)
        except NetlinkError as exc:
            if exc.code != errno.ENODEV:
                raise
        with self._lock:
            self._xdp.pop(index, None)
            self._xdp_wanted.pop(index, None)

    def _own_ids(self) -> frozenset[int]:
        """The ids of this Attacher's programs: a filter running one of them is this generation's."""
        if self._ids is None:
            self._ids = frozenset(xdp.prog_info(fd)[0] for fd in self._fds.values())
        return self._ids

    def handover_state(self) -> HandoverState:
        """Where a hand-over stands on this namespace's hooks (read before the mode is set)."""
        own = self._own_ids()
        own_front = other_front = older = False
        # Our tcx links (whichever --bpf-tc-attach this start has: an older generation's may be
        # there). A link in front (FRONT) is a hand-over's; a main link of another build is an
        # older generation to hand over from; ours in front of an older filter, a hand-over begun.
        pins = [p for p in tcx.pinned(self._config.pin_path) if p.live]
        behind_filters: set[tuple[int, str]] = set()
        with netns_route(self._config.netns) as ipr:
            for link in list_links(ipr):
                for parent in (TC_H_INGRESS, TC_H_EGRESS):
                    try:
                        msgs = _filters(ipr, link.index, parent)  # one dump per hook: a node has many
                    except NetlinkError as exc:
                        if exc.code != errno.ENODEV:  # a pod device gone meanwhile holds nothing
                            raise
                        msgs = []
                    for msg in msgs:
                        if _is_ours(msg, FRONT_PRIO):
                            mine = filter_prog_id(msg) in own
                            own_front |= mine
                            other_front |= not mine
                        elif _is_ours(msg, FILTER_PRIO) and filter_prog_id(msg) not in own:
                            older = True
                            behind_filters.add((link.index, _hook(parent)))
        for pin in pins:
            if pin.role == tcx.FRONT:
                own_front |= pin.prog_id in own
                other_front |= pin.prog_id not in own
            elif pin.role == tcx.MAIN and pin.prog_id not in own:
                older = True
                other_front |= (pin.index, pin.hook) in behind_filters
            elif pin.role == tcx.MAIN:
                own_front |= (pin.index, pin.hook) in behind_filters
        return HandoverState(own_front, other_front, older)

    def _attach(
        self,
        ipr: Any,
        index: int,
        name: str,
        prog: str,
        bridge: int = 0,
        *,
        front: bool = False,
        clear_front: bool = False,
        appeared: bool = False,
        pins: list[tcx.Pinned] | None = None,
        since: int = -1,
    ) -> None:
        """`since` (a reconcile's `_port_mark`): the device's entry stays if the watcher wrote it after
        the listing `bridge` comes from (that listing may predate the CNI enslaving it)."""
        if self.use_tcx:
            self._attach_tcx(
                ipr,
                index,
                name,
                prog,
                bridge,
                front=front,
                pins=tcx.pinned(self._config.pin_path, {index}) if pins is None else pins,
                since=since,
            )
            return
        # Egress first: nothing is handed to the node's stack before its replies (and, with legacy
        # host routing, its own source translation) can be translated. `appeared`: a device the
        # watcher saw come (a new pod's: nothing sent through it yet that a clsact add could drop).
        self._set_bridge(index, bridge, since=since)
        where = []
        left = tcx.pinned(self._config.pin_path, {index})
        behind_links: set[str] = set()
        for parent, program in ((TC_H_EGRESS, PROG_EGRESS), (TC_H_INGRESS, prog)):
            hook = "egress" if parent == TC_H_EGRESS else "ingress"
            older = tcx.find(left, tcx.MAIN, hook, index) if front else None
            if older is not None and older.live and older.prog_id not in self._own_ids():
                # An older generation on tcx (a switch back to clsact under a hand-over): a filter
                # of ours would run after its link, and removing the link would leave nothing that
                # hands the older flows to its program. So this start hands over through tcx, right
                # before the older link (its ingress keeps its classid program in front, if it has
                # one: the older program reads it), until `rehome` puts the filter on and removes
                # the links.
                self._tcx_link(left, tcx.FRONT, hook, name, index, self._fds[program], before=older.path)
                behind_links.add(hook)
                where.append(hook)
                with self._lock:
                    self._fronts[(index, parent)] = program
                    self._front_kinds[(index, parent)] = TO_CLSACT
                continue
            prio = FILTER_PRIO
            if front:
                # In front only of an older generation's filter: where ours already sits at 17 (a
                # hook rehome moved, or attach_egress reached), a copy at 16 would share its mode.
                behind = our_prog_id(ipr, index, parent, FILTER_PRIO)
                if behind is not None and behind not in self._own_ids():
                    prio = FRONT_PRIO
                    other = foreign_at(ipr, index, parent, FRONT_PRIO)
                    if other is not None:
                        log.warning(
                            "%s on %s %s sits at priority %d, where the hand-over puts this build in "
                            "front of the older one: replacing the older one at %d instead (flows it "
                            "started meanwhile may break there); move %s to free priority %d",
                            other,
                            name,
                            hook,
                            FRONT_PRIO,
                            FILTER_PRIO,
                            other,
                            FRONT_PRIO,
                        )
                        prio = FILTER_PRIO
            started = time.monotonic()
            if attach(ipr, index, program, self._fds[program], parent, prio=prio):
                level = logging.DEBUG if appeared else logging.INFO
                log.log(level, CLSACT_LOG, 1, name, (time.monotonic() - started) * 1000)
            if prio == FRONT_PRIO:
                where.append(hook)
                with self._lock:
                    self._fronts[(index, parent)] = program
            elif front or clear_front:
                # Ours at 17 now: a copy left at 16 (this hand-over's, or one cut short) goes.
                if drop_front(ipr, index, parent):
                    log.info(
                        "removed our filter in front on %s %s (ours serves at %d)", name, hook, FILTER_PRIO
                    )
                with self._lock:
                    self._fronts.pop((index, parent), None)
        _log_attached(prog, name, bridge, where, "")
        # Links an agent on tcx left run in front of these filters: they go now that ours are on
        # (those of a hook handed over through tcx at its rehome; the classid program with ingress's).
        left = [
            p
            for p in left
            if p.hook not in behind_links and not (p.role == tcx.CLASSID and tcx.INGRESS in behind_links)
        ]
        for pin in sorted(left, key=tcx.removal_order):
            tcx.remove(pin)
        if left:
            log.info("detached the tcx links on %s (--bpf-tc-attach=clsact: its filters serve)", name)
        self._remember(index, name, prog)
        self.attachments += 1

    def _attach_tcx(
        self,
        ipr: Any,
        index: int,
        name: str,
        prog: str,
        bridge: int,
        *,
        front: bool,
        pins: list[tcx.Pinned],
        since: int = -1,
    ) -> None:
        """`_attach` through tcx links (tcx.py): egress first, as there, then ingress. Ours replaces
        the one pinned there in place
        (a restart: atomic), and our filters on a clsact qdisc, if any, are then removed (the tcx
        link runs before them, so nothing meets them any more). `front` (a hand-over): in front of
        an older generation, which is either a filter on clsact (our link runs before it anyway, and
        its TC_ACT_UNSPEC falls through to it: the filter stays until `rehome`), or another build's
        tcx link (ours goes right before it, pinned as FRONT, until `rehome` updates the older link
        and removes ours in front). An older generation's classid program (tcx.py) in front of
        ingress goes once ours serves there, and stays while an older program does (`rehome`)."""
        self._set_bridge(index, bridge, since=since)
        where = []
        own = self._own_ids()
        for parent, program in ((TC_H_EGRESS, PROG_EGRESS), (TC_H_INGRESS, prog)):
            hook = _hook(parent)
            fd = self._fds[program]
            main = tcx.find(pins, tcx.MAIN, hook, index)
            behind = our_prog_id(ipr, index, parent, FILTER_PRIO)
            kind = ""
            if front and main is not None and main.live and main.prog_id not in own:
                self._tcx_link(pins, tcx.FRONT, hook, name, index, fd, before=main.path)
                kind = "tcx"
            else:
                ahead = tcx.find(pins, tcx.FRONT, hook, index)
                if ahead is not None:
                    # A hand-over cut short: its link in front runs this program (a hook holds a
                    # program once: it takes the older link's place) or another (it goes).
                    self._take_place(ahead, tcx.find(pins, tcx.MAIN, hook, index), fd)
                    pins = [p for p in pins if p.index != index]
                    pins += tcx.pinned(self._config.pin_path, {index})
                self._tcx_link(pins, tcx.MAIN, hook, name, index, fd)
                if front and behind is not None and behind not in own:
                    kind = "clsact"
                elif self._drop_filters(ipr, index, parent):
                    log.info(
                        "removed our clsact filters on %s %s: its tcx link serves (the qdisc stays)",
                        name,
                        hook,
                    )
            with self._lock:
                if kind:
                    where.append(hook)
                    self._fronts[(index, parent)] = program
                    self._front_kinds[(index, parent)] = kind
                else:
                    self._fronts.pop((index, parent), None)
                    self._front_kinds.pop((index, parent), None)
            if parent == TC_H_INGRESS and kind != "tcx":
                # Ours serves the hook first now (an older program behind a "clsact" front reads
                # its tc_classid from its filter's classid, never from the classid link).
                self._drop_classid(pins, index)
        _log_attached(prog, name, bridge, where, " through tcx links")
        self._remember(index, name, prog)
        self.attachments += 1

    def _rehome_tcx(self, ipr: Any, index: int, parent: int, program: str, kind: str) -> None:
        """`rehome` of one hook a tcx hand-over put us in front on."""
        if kind == TO_CLSACT:
            # Ours as a filter, then the older link, then ours in front of it (and, on ingress, an
            # older classid program in front of both): at every moment a program of ours serves.
            attach(ipr, index, program, self._fds[program], parent)
            hook = _hook(parent)
            pins = tcx.pinned(self._config.pin_path, {index})
            roles = (tcx.MAIN, tcx.FRONT, tcx.CLASSID) if hook == tcx.INGRESS else (tcx.MAIN, tcx.FRONT)
            for role in roles:
                pin = tcx.find(pins, role, hook, index)
                if pin is not None:
                    tcx.remove(pin)
            return
        if kind == "clsact":
            # Our link already serves; the older filters behind it go (the clsact qdisc stays).
            self._drop_filters(ipr, index, parent)
            return
        pins = tcx.pinned(self._config.pin_path, {index})
        main = tcx.find(pins, tcx.MAIN, _hook(parent), index)
        ahead = tcx.find(pins, tcx.FRONT, _hook(parent), index)
        if ahead is not None:
            self._take_place(ahead, main, self._fds[program])
        elif main is not None and main.live:
            tcx.update(main, self._fds[program])
        if parent == TC_H_INGRESS:
            # No older program is left behind ours to read what the classid program writes.
            self._drop_classid(pins, index)

    def _take_place(self, ahead: tcx.Pinned, main: tcx.Pinned | None, fd: int) -> None:
        """A link of ours in front of an older one on its hook takes its place, running `fd`'s
        program: updated to it in place if it runs another (a hand-over cut short), then the older
        link removed, then the one in front pinned as MAIN. The kernel refuses a program twice on
        one hook, so the older link cannot be updated to it; the one in front serves all along, so
        the hook never runs the older program alone nor none. A defunct one in front goes."""
        if not ahead.live:
            tcx.remove(ahead)
            return
        want = tcx.prog_id(fd)
        if main is not None and main.live and main.prog_id == want:
            tcx.remove(ahead)  # the older link runs this program already (a rehome cut short)
            return
        if ahead.prog_id != want:
            tcx.update(ahead, fd)
        if main is not None:
            tcx.remove(main)
        main_pin = tcx.pin_name(tcx.MAIN, ahead.hook, ahead.device, ahead.index)
        with contextlib.suppress(FileNotFoundError):  # renamed meanwhile by another thread
            os.rename(ahead.path, os.path.join(self._config.pin_path, main_pin))

    def _remember(self, index: int, name: str, prog: str) -> None:
        with self._lock:
            self._attached[index] = (name, prog)

    def rehome(self) -> None:
        """The end of a hand-over: each filter in front moves to FILTER_PRIO (a "replace" of the
        older generation's filter there with the same program and maps: every packet
        meets one of ours all along), then its FRONT_PRIO copy is removed. Hooks whose device went
        meanwhile are skipped; on another error the hooks not done yet stay in `fronts`."""
        fronts = self.fronts
        if not fronts:
            return
        with netns_route(self._config.netns) as ipr:
            for (index, parent), program in sorted(fronts.items()):
                with self._lock:
                    kind = self._front_kinds.get((index, parent), "")
                try:
                    if kind:
                        self._rehome_tcx(ipr, index, parent, program, kind)
                    else:
                        attach(ipr, index, program, self._fds[program], parent)
                        drop_front(ipr, index, parent)
                except NetlinkError as exc:
                    if exc.code != errno.ENODEV:
                        raise
                with self._lock:
                    self._fronts.pop((index, parent), None)
                    self._front_kinds.pop((index, parent), None)
        if self.use_tcx:
            log.info(
                "hand-over done: %d tcx links in place, the older generation's filters and links gone",
                len(fronts),
            )
        else:
            log.info(
                "hand-over done: %d filters moved to priority %d, the older generation's gone",
                len(fronts),
                FILTER_PRIO,
            )

    # ------------------------------------------------------------------ pod-device watcher

    @property
    def watching(self) -> bool:
        """The pod-device watcher thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def start_watcher(self, timeout: float = 5.0) -> None:
        """Start (or restart) the thread that attaches to new pod devices; returns once it listens
        and has looked at every device there (`_watch`: a change made after that is an event)."""
        if self.watching:
            return
        self._stop.clear()
        self._ready.clear()
        self._thread = threading.Thread(target=self._watch, name="ekp-link-watcher", daemon=True)
        self._thread.start()
        self._ready.wait(timeout)

    def stop_watcher(self) -> bool:
        """Stop the pod-device thread; whether it ended (WATCHER_STOP_TIMEOUT). One that did not (in an
        attach's netlink call) is kept: `watching` stays true, so no second one starts beside it
        before it ends."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=WATCHER_STOP_TIMEOUT)
            if self._thread.is_alive():
                log.warning(
                    "the pod-device watcher did not end within %.0fs of being told to (in an attach?): "
                    "it ends after that attach",
                    WATCHER_STOP_TIMEOUT,
                )
                return False
            self._thread = None
        return True

    def _watch(self) -> None:
        try:
            events = run_in_netns(self._config.netns, link_event_socket)
            with events, netns_route(self._config.netns) as ipr:
                # Devices created or changed between the last reconcile and the bind, before
                # start_watcher returns: a change its caller makes after that then comes as an
                # event queued behind this listing. Were the listing later than such a change, the
                # change's queued notices (older than the listing: a port leaving its bridge first
                # sends one still naming the bridge) would undo, for a moment, what it did.
                self._catch_up(ipr)
                self._ready.set()
                while not self._stop.is_set():
                    readable, _, _ = select.select([events], [], [], 0.5)
                    if not readable:
                        continue
                    try:
                        batch = read_link_events(events)
                    except OSError as exc:
                        if exc.errno != errno.ENOBUFS:
                            raise
                        log.warning("link events overflowed: checking every device")
                        self._catch_up(ipr)
                        continue
                    for event, index, name, master, kind in batch:
                        if event == RTM_NEWLINK:
                            self._on_new_link(ipr, Link(index, name, master, kind))
                        elif event == RTM_DELLINK:
                            with self._lock:
                                if self._attached.pop(index, None) is not None:
                                    log.info("pod device %s is gone", name)
                            self._forget_bridge(index)
                            if self.use_tcx:
                                self._sweep(ipr, index)
        except Exception:
            log.exception(
                "link watcher of netns %s stopped; the next sync restarts it and checks every device",
                self._config.netns,
            )
        finally:
            self._ready.set()

    def _sweep(self, ipr: Any, index: int) -> None:
        """Remove the pins of our tcx links on a device that went: defunct ones (deleted), and live
        ones whose device left this namespace (`ip link set X netns other` keeps its tcx links:
        the kernel takes them off only when the device is unregistered)."""
        pins = tcx.pinned(self._config.pin_path, {index})
        self._drop_moved(ipr, pins)
        swept = tcx.sweep_defunct(self._config.pin_path, [p for p in pins if os.path.exists(p.path)])
        if swept:
            log.info("removed the pins of tcx links whose device is gone: %s", ", ".join(swept))

    def _drop_moved(self, ipr: Any, pins: list[tcx.Pinned]) -> None:
        """Detach our live links on devices no longer in this namespace (moved to another: its
        programs must not run in a pod's namespace), and remove their pins."""
        for index in sorted({p.index for p in pins if p.live}):
            try:
                ipr.link("get", index=index)
                continue
            except NetlinkError as exc:
                if exc.code != errno.ENODEV:
                    raise
            moved = sorted((p for p in pins if p.index == index), key=tcx.removal_order)
            for pin in moved:
                tcx.remove(pin)
            log.info(
                "detached our tcx links from ifindex %d (%s), which left netns %s with them: %s",
                index,
                moved[0].device,
                self._config.netns or "(own)",
                ", ".join(os.path.basename(p.path) for p in moved),
            )

    def _drop_unwanted(self, ipr: Any, link: Link, bridge: int, was: tuple[str, str]) -> None:
        """The watcher's detach of a device of ours that no longer qualifies, as a verify's: its
        programs, links and entry go, and it is no longer ours (its hand-over front too). `was`:
        its (name, program) as we attached it, which tells why it no longer qualifies."""
        try:
            detached = self._detach(ipr, link.index, self._pins({link.index}))
        except (NetlinkError, OSError) as exc:
            # Still ours in `_attached`, so the next verify looks at it again rather than the
            # watcher dying here.
            code = exc.code if isinstance(exc, NetlinkError) else exc.errno
            if code in (errno.ENOENT, errno.ENODEV):  # a verify detached it meanwhile, or it went
                log.info(
                    "%s (ifindex %d), which no longer qualifies (%s), is already gone or detached;"
                    " the next verify looks at it again",
                    link.name,
                    link.index,
                    self._unwanted_why(link, bridge, was),
                )
            else:
                log.warning(
                    "cannot detach from %s (ifindex %d), which no longer qualifies (%s): %s; retried at"
                    " the next verify",
                    link.name,
                    link.index,
                    self._unwanted_why(link, bridge, was),
                    exc,
                )
            return
        self._forget_bridge(link.index)
        with self._lock:
            self._attached.pop(link.index, None)
            for parent in (TC_H_INGRESS, TC_H_EGRESS):
                self._fronts.pop((link.index, parent), None)
                self._front_kinds.pop((link.index, parent), None)
        if detached:
            log.info("detached from %s: %s", link.name, self._unwanted_why(link, bridge, was))

    def _unwanted_why(self, link: Link, bridge: int, was: tuple[str, str]) -> str:
        """Why a device we attached (`was`: its name and program then) no longer qualifies."""
        name, prog = was
        bridge_name = self._config.local_detector().interface
        if bridge_name and prog == PROG_FROM_POD:
            if not bridge:
                return f"its bridge {bridge_name} is gone (no device of that name in the namespace)"
            return f"not a port of bridge {bridge_name} (ifindex {bridge}) any more"
        if name != link.name:
            return f"renamed from {name}, a name that marks no pod device"
        return "no longer a pod device"

    def _catch_up(self, ipr: Any) -> None:
        for link in list_links(ipr):
            self._on_new_link(ipr, link)

    def _on_new_link(self, ipr: Any, link: Link) -> None:
        """A device appeared or changed (a veth enslaved to the bridge gets its master here)."""
        local = self._config.local_detector()
        bridge = bridge_index(ipr, local) if local.interface else 0
        prog = pod_side_program(link, self._config, local, bridge)
        if prog is None:
            with self._lock:
                was = self._attached.get(link.index) if link.index not in self._external else None
            if was is not None:
                # A port that left the bridge (or a pod device renamed) and no longer qualifies:
                # its programs would go on translating its packets as a pod's until a verify.
                self._drop_unwanted(ipr, link, bridge, was)
            elif not port_bridge(link) and self._cached_bridge(link.index):
                self._set_bridge(link.index, 0)
            return
        bridge = port_bridge(link) if prog == PROG_FROM_POD else 0
        with self._lock:
            if link.index in self._external:
                return
            same = self._attached.get(link.index, ("", ""))[1] == prog
        try:
            if same:
                # Enslaved or freed: only its entry changes (the programs read it per packet).
                self._set_bridge(link.index, bridge)
                return
            self._attach(ipr, link.index, link.name, prog, bridge, appeared=True)
        except (NetlinkError, OSError) as exc:
            # The device may be gone again, or be moving to another namespace.
            log.warning("cannot attach %s to %s: %s", prog, link.name, exc)
