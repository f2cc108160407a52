"""End the connected UDP sockets whose backend left its Service (bpf/ekp_sock.h, `ekp_sock_term`).

A UDP socket connected to a ClusterIP (most DNS resolvers) was sent to one backend at connect();
the kernel keeps it there, and no sendmsg() hook runs for a connected socket's datagrams. When that
backend leaves the service port, kube-proxy clears the UDP conntrack entries so the next datagram
chooses again; here the iterator program ends such sockets with bpf_sock_destroy (the application's
next call fails with ECONNABORTED and a resolver opens a new socket, which connect4 sends to a
backend that serves). The program reads the same membership map the packet path's UDP flows
follow, and the socket programs' record of where each socket was sent (ekp_sknat_v2), so it ends
only sockets the socket programs translated, and only when their backend left.

A socket iterator walks the sockets of the network namespace its iterator is created in: the
node's own, and with socket-level load balancing for pods (host-namespace-only off) each network
namespace of a process in the attached cgroup (pods: /proc/<pid>/ns/net, which needs the host's
PID namespace: the kernel lists a process outside the agent's PID namespace as pid 0, and those
are not walked, which one warning says with what to do).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

from agent.ebpf import bpfsys
from agent.ebpf.programs import ATTACH_TRACE_ITER
from agent.netns import NETNS_RUN_DIR, run_in_netns

log = logging.getLogger(__name__)


def _drain(link_fd: int) -> None:
    """Run the iterator once in the calling thread's network namespace."""
    fd = bpfsys.iter_create(link_fd)
    if fd < 0:
        raise OSError(-fd, f"bpf_iter_create: {os.strerror(-fd)}")
    try:
        while os.read(fd, 4096):
            pass
    finally:
        os.close(fd)


def cgroup_pids(cgroup: str) -> Iterator[int]:
    """Pids of every process in cgroup `cgroup` and its descendants; 0 for each one outside the
    reader's PID namespace (the kernel has no number to give it there)."""
    for dirpath, _, files in os.walk(cgroup):
        if "cgroup.procs" not in files:
            continue
        try:
            with open(os.path.join(dirpath, "cgroup.procs"), encoding="ascii") as f:
                text = f.read()
        except OSError:
            continue
        yield from (int(p) for p in text.split())


def pod_namespaces(cgroup: str, skip: tuple[int, int]) -> tuple[dict[tuple[int, int], str], int]:
    """(device, inode) -> a /proc path of each network namespace of the processes in `cgroup`,
    but `skip` (the node's own); and how many of its processes are outside our PID namespace."""
    out: dict[tuple[int, int], str] = {}
    hidden = 0
    for pid in cgroup_pids(cgroup):
        if pid <= 0:
            hidden += 1
            continue
        path = f"/proc/{pid}/ns/net"
        try:
            st = os.stat(path)
        except OSError:
            continue  # gone, or not in our PID namespace
        key = (st.st_dev, st.st_ino)
        if key != skip and key not in out:
            out[key] = path
    return out, hidden


class SocketTerminator:
    """Runs `ekp_sock_term` where sockets may need ending. The constructor does nothing; the
    iterator's link is made at the first `run` and kept until `close`."""

    def __init__(
        self,
        prog_fd: int,
        netns: str,
        cgroup: str,
        *,
        pods: bool,
        ended: Callable[[], int],
    ) -> None:
        self._prog_fd = prog_fd
        self._netns = netns  # the node's ("" = ours)
        self._cgroup = cgroup
        self._pods = pods  # pods' sockets are translated too: walk their namespaces as well
        self._ended = ended  # the SOCK_DESTROYED counter, summed over CPUs
        self._link = -1
        self._warned_hidden = False

    def run(self) -> int:
        """Walk the sockets; how many were ended."""
        if self._link < 0:
            fd = bpfsys.link_create(self._prog_fd, 0, ATTACH_TRACE_ITER)
            if fd < 0:
                raise OSError(-fd, f"bpf_link_create(ekp_sock_term): {os.strerror(-fd)}")
            self._link = fd
        before = self._ended()
        run_in_netns(self._netns, lambda: _drain(self._link))
        if self._pods:
            node = os.stat(os.path.join(NETNS_RUN_DIR, self._netns) if self._netns else "/proc/self/ns/net")
            namespaces, hidden = pod_namespaces(self._cgroup, (node.st_dev, node.st_ino))
            self.warn_hidden(hidden)
            for path in namespaces.values():
                try:
                    run_in_netns(path, lambda: _drain(self._link))
                except OSError as exc:
                    log.debug("cannot walk the sockets of %s: %s", path, exc)
        ended = self._ended() - before
        if ended:
            log.info(
                "ended %d connected UDP socket(s) whose backend left its Service (their next call "
                "fails with ECONNABORTED; a new socket is sent to a serving backend)",
                ended,
            )
        return ended

    def warn_hidden(self, hidden: int) -> None:
        """Say once that pods' sockets cannot be ended: connect() balances pods' sockets, but the
        agent cannot enter their network namespaces without the host's PID namespace."""
        if hidden and not self._warned_hidden:
            self._warned_hidden = True
            log.warning(
                "%d process(es) in cgroup %s are outside this agent's PID namespace: their connected "
                "UDP sockets are balanced at connect() but cannot be ended when their backend leaves "
                "(a resolver keeps asking a gone DNS pod). Run the agent in the host's PID namespace "
                "(hostPID: true, as the chart does), or set --bpf-socket-lb-host-namespace-only=true "
                "to leave pods to the per-packet path",
                hidden,
                self._cgroup,
            )

    def close(self) -> None:
        if self._link >= 0:
            os.close(self._link)
            self._link = -1
