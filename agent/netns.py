"""Running code in another network namespace: the one the agent programs (`--netns`).

The lab runs one agent per node from the host namespace (it needs /sys/fs/bpf, which `ip netns
exec` hides), so everything that touches a node's network, netlink, sysctls and the sockets of the
health and metrics servers, goes through these two helpers. setns(2) acts on one thread, so
`run_in_netns` uses a short-lived thread; a socket created there stays in that namespace for life.

`netns_route` makes its rtnetlink socket that way too, not through pyroute2's `IPRoute(netns=...)`,
which forks a child process for every socket it makes in another namespace: about 0.1 s of wall
time each, and after it every page of the agent's heap takes a write-protect fault the next time
it is written (measured with a heap of 200 MB, about what the agent holds at 10,000 Services of
10 endpoints: 82,000 faults and 0.08 CPU s more to walk the heap once), several times per sync
that attaches (the node's addresses, the reconcile, the takeover's checks, the link watcher).
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pyroute2.iproute import IPRoute
from pyroute2.netlink import NETLINK_ROUTE


def _rtnetlink_socket() -> socket.socket:
    return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_ROUTE)


@contextmanager
def netns_route(netns: str) -> Iterator[Any]:
    """An IPRoute in `netns` ("" = our own); a missing namespace raises FileNotFoundError (it is
    never created). pyroute2 sets the socket up (buffers, bind) as for one of its own."""
    ipr = IPRoute(fileno=run_in_netns(netns, _rtnetlink_socket).detach()) if netns else IPRoute()
    try:
        yield ipr
    finally:
        ipr.close()


T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
NETNS_RUN_DIR = "/run/netns"


def run_in_netns(netns: str, fn: Callable[[], T]) -> T:
    """Run `fn` on a short-lived thread that joined `netns` ("" = here); setns(2) is per thread.

    Sockets created by `fn` stay in `netns` for their whole life, whichever thread uses them.
    """
    if not netns:
        return fn()
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(os.path.join(NETNS_RUN_DIR, netns), os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({netns}): {os.strerror(err)}")
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"ekp-netns-{netns}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
