"""The node's addresses and links, followed through netlink (both modes).

NodePorts answer on the node's addresses: eBPF mode writes a frontend per address, iptables mode
with `--nodeport-addresses` a `-d` jump per address. A VIP that keepalived or kube-vip adds at
run time must answer at once, not at the next full sync (every `--iptables-sync-period`, 30 s by
default), and one that moves away must stop answering here.

`AddressWatcher` subscribes to rtnetlink's IPv4 address and link groups (and the IPv6 address
group when iptables mode runs its IPv6 proxier) in the node's network
namespace (`--netns`; the socket is created there, so it hears that namespace only) and calls
`notify` once per burst of changes that may concern node addresses; the agent then re-reads the
addresses (agent/node.py) at its next sync and programs them in full when they changed. Changes
on pod devices (Config.pod_interfaces, the detector's bridge or prefix) are not node addresses
and are ignored: pods come and go by the hundred. An IPv6 address event names no device (no
IFA_LABEL): it counts unless its scope is link-local, which no node address has (a pod device's
global IPv6 gateway address costs one re-read that finds nothing changed).

Messages are decoded by pyroute2's rtnetlink marshal; the socket itself is a plain non-blocking
one read after `select()`, so the thread stops within half a second of `stop()` (pyroute2's own
reader blocks). A kernel buffer overflow (ENOBUFS: events were lost) notifies too, which re-reads
everything. Not started when `--node-ip` fixes the addresses.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from pyroute2.netlink.rtnl import RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR, RTMGRP_LINK
from pyroute2.netlink.rtnl.marshal import MarshalRtnl

from agent.config import Config
from agent.netns import run_in_netns
from agent.node import matches_pod_pattern, pod_device_patterns

log = logging.getLogger(__name__)

EVENTS = ("RTM_NEWADDR", "RTM_DELADDR", "RTM_NEWLINK", "RTM_DELLINK")


RT_SCOPE_LINK = 253


def address_socket(ipv6: bool = False) -> socket.socket:
    """A non-blocking rtnetlink socket subscribed to IPv4 (and, `ipv6`, IPv6) address and link
    events, in the caller's netns."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.bind((0, RTMGRP_IPV4_IFADDR | RTMGRP_LINK | (RTMGRP_IPV6_IFADDR if ipv6 else 0)))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def concerns_node(messages: Iterable[Any], pod_patterns: tuple[str, ...]) -> bool:
    """Whether any decoded rtnetlink message may change the node's addresses: an address or link
    event of a device that is not a pod device (an IPv4 address's label is its device's name)."""
    for msg in messages:
        event = msg.get("event")
        if event not in EVENTS:
            continue
        if event.endswith("ADDR") and msg.get("family") == socket.AF_INET6:
            if msg.get("scope") != RT_SCOPE_LINK:
                return True
            continue
        name = msg.get_attr("IFA_LABEL") if event.endswith("ADDR") else msg.get_attr("IFLA_IFNAME")
        if not (isinstance(name, str) and matches_pod_pattern(name.split(":", 1)[0], pod_patterns)):
            return True
    return False


class AddressWatcher:
    """Calls `notify` when the node's addresses or links may have changed. Construction has no
    side effects; `start(notify)` opens the socket and starts the thread."""

    def __init__(self, config: Config) -> None:
        self._netns = config.netns
        self._patterns = pod_device_patterns(config)
        self._ipv6 = config.ipv6_configured  # an IPv6 proxier runs (ip6tables, in both modes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._marshal = MarshalRtnl()
        self.notified = 0

    def start(self, notify: Callable[[], None]) -> None:
        sock = run_in_netns(self._netns, lambda: address_socket(self._ipv6))
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(sock, notify), name="ekp-node-addresses", daemon=True
        )
        self._thread.start()
        log.info(
            "following the node's addresses through netlink in netns %s (NodePorts follow within a sync)",
            self._netns or "(own)",
        )

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self, sock: socket.socket, notify: Callable[[], None]) -> None:
        with sock:
            while not self._stop.is_set():
                try:
                    readable, _, _ = select.select([sock], [], [], 0.5)
                    if readable and self._drain(sock):
                        self.notified += 1
                        notify()
                except Exception:
                    log.exception(
                        "following the node's addresses failed; they are re-read at every full sync instead"
                    )
                    return

    def _drain(self, sock: socket.socket) -> bool:
        """Read every queued datagram; whether one of them concerns the node's addresses."""
        relevant = False
        while True:
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                return relevant
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                log.warning("netlink address events overflowed: re-reading the node's addresses")
                relevant = True
                continue
            relevant = concerns_node(self._marshal.parse(data), self._patterns) or relevant
