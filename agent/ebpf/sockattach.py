"""Attach the socket programs to a cgroup, through bpf_links pinned beside the maps. Effects.

The socket programs (agent/ebpf/programs.py SOCK_HOOKS: connect4, sendmsg4, recvmsg4, getpeername4,
their IPv6 twins, and sock_release, which forgets a closed socket's entry in ekp_sknat_v2)
translate the sockets of every process in the cgroup `--bpf-socket-lb-cgroup` names and its
descendants: by default the root of the cgroup v2 mount, the whole node (a real node's pods and
host-network processes all live below it). The lab names each lab node's own cgroup: never the
machine's root.

Each hook has one bpf_link, pinned at `<pin dir>/ekp_link_<hook>`: the pin keeps the link (and so
the attachment) alive when the agent exits, so a restarted or upgraded agent finds its programs
serving, and swaps the new ones in with BPF_LINK_UPDATE, atomically (no call is ever seen by no
program, nor by two). A pinned link on another cgroup (the flag changed, the cgroup was made anew)
is detached and replaced; a missing one is created. `detach_all` (`agent --cleanup`, or
`--bpf-socket-lb=false`) detaches and unpins them. Links run alongside other programs on the same
hooks (the kernel's multi-attach mode), so nobody else's cgroup programs are displaced.

The node's network namespace cookie (SO_NETNS_COOKIE of a socket made there) and the
host-namespace-only flag go to `ekp_skcfg_v2` before the programs are attached (`sock_config`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from agent.ebpf import bpfsys
from agent.ebpf.abi import SockConfig, SockFlag
from agent.ebpf.programs import SOCK_HOOKS
from agent.errors import FatalError
from agent.netns import run_in_netns

log = logging.getLogger(__name__)

LINK_PIN_PREFIX = "ekp_link_"
SO_NETNS_COOKIE = 71  # include/uapi/asm-generic/socket.h (Linux 5.14)
BPF_LINK_TYPE_CGROUP = 3


class _LinkInfo(ctypes.Structure):
    """struct bpf_link_info: type, id, prog_id, then (cgroup links) cgroup_id and attach_type."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("cgroup_id", ctypes.c_uint64),
        ("attach_type", ctypes.c_uint32),
        ("pad2", ctypes.c_uint32),
    ]


class _ProgId(ctypes.Structure):
    """The head of struct bpf_prog_info: type and id."""

    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32)]


@dataclass(frozen=True)
class LinkState:
    """What a pinned link says: its program, and the cgroup (0 once detached) and hook it holds."""

    hook: str
    link_id: int
    prog_id: int
    cgroup_id: int
    attach_type: int


def link_pin(pin_path: str, hook: str) -> str:
    return os.path.join(pin_path, LINK_PIN_PREFIX + hook)


def _check(ret: int, what: str) -> int:
    if ret < 0:
        raise OSError(-ret, f"{what}: {os.strerror(-ret)}")
    return ret


def prog_id(fd: int) -> int:
    info = _ProgId()
    _check(bpfsys.obj_get_info_by_fd(fd, info), "bpf_obj_get_info(prog)")
    return int(info.id)


def link_state(hook: str, fd: int) -> LinkState:
    info = _LinkInfo()
    _check(bpfsys.obj_get_info_by_fd(fd, info), f"bpf_obj_get_info(link {hook})")
    if info.type != BPF_LINK_TYPE_CGROUP:
        raise OSError(errno.EINVAL, f"pinned link {hook} is not a cgroup link (type {info.type})")
    return LinkState(hook, int(info.id), int(info.prog_id), int(info.cgroup_id), int(info.attach_type))


def pinned_links(pin_path: str) -> dict[str, LinkState]:
    """The socket hooks' links pinned under `pin_path`, by hook (those that can be read)."""
    out: dict[str, LinkState] = {}
    for hook in SOCK_HOOKS:
        fd = bpfsys.obj_get(link_pin(pin_path, hook))
        if fd < 0:
            continue
        try:
            out[hook] = link_state(hook, fd)
        except OSError as exc:
            log.warning("pinned link %s cannot be read: %s", link_pin(pin_path, hook), exc)
        finally:
            os.close(fd)
    return out


def cgroup2_mount(mounts: str) -> str | None:
    """The first cgroup v2 mount point in /proc/self/mounts text (the node's hierarchy)."""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return parts[1].replace("\\040", " ")
    return None


def socket_cgroup(configured: str) -> str:
    """The cgroup directory to attach to: `configured`, else the root of the cgroup2 mount.
    FatalError when there is none or it is no cgroup v2 directory: a wrong path is the operator's
    to fix, not a sync to retry."""
    path = configured
    if not path:
        with open("/proc/self/mounts") as f:
            found = cgroup2_mount(f.read())
        if found is None:
            raise FatalError(
                "no cgroup v2 hierarchy is mounted: mount one (mount -t cgroup2 none /sys/fs/cgroup), "
                "name it with --bpf-socket-lb-cgroup, or turn socket-level load balancing off with "
                "--bpf-socket-lb=false (host-network clients then reach no Service)"
            )
        path = found
    if not os.path.isfile(os.path.join(path, "cgroup.procs")):
        raise FatalError(
            f"--bpf-socket-lb-cgroup {path} is not a cgroup v2 directory (no cgroup.procs): name the "
            "node's cgroup2 mount (or a cgroup below it), or use --bpf-socket-lb=false"
        )
    return path


def netns_cookie(netns: str) -> int:
    """The cookie of network namespace `netns` ("" = ours), as bpf_get_netns_cookie() sees it."""

    def read() -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            return int.from_bytes(s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), "little")

    return run_in_netns(netns, read)


def sock_config(host_netns: int, host_only: bool) -> SockConfig:
    return SockConfig(host_netns=host_netns, flags=int(SockFlag.HOST_ONLY) if host_only else 0)


class SocketAttacher:
    """Keeps the socket programs linked to one cgroup. The constructor does nothing."""

    def __init__(self, pin_path: str, cgroup: str, prog_fds: Mapping[str, int]) -> None:
        self._pin_path = pin_path
        self._cgroup = cgroup
        self._fds = dict(prog_fds)  # program name -> fd, for every program of SOCK_HOOKS

    @property
    def cgroup(self) -> str:
        return self._cgroup

    def reconcile(self) -> list[str]:
        """Every hook linked to our cgroup with our program; the hooks changed (created, moved or
        given the new program), logged in one line per kind of change."""
        done: dict[str, list[str]] = {}
        cg_fd = os.open(self._cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            cg_id = os.fstat(cg_fd).st_ino  # a cgroup v2 directory's inode number is the cgroup id
            for hook, (prog, attach_type) in SOCK_HOOKS.items():
                what = self._reconcile_hook(hook, self._fds[prog], attach_type, cg_fd, cg_id)
                if what:
                    done.setdefault(what, []).append(hook)
        finally:
            os.close(cg_fd)
        for what, hooks in done.items():
            log.info("socket programs %s %s cgroup %s", ",".join(hooks), what, self._cgroup)
        return [hook for hooks in done.values() for hook in hooks]

    def _reconcile_hook(self, hook: str, fd: int, attach_type: int, cg_fd: int, cg_id: int) -> str:
        """What was done to the hook's link ("" when it was ours already)."""
        pin = link_pin(self._pin_path, hook)
        link_fd = bpfsys.obj_get(pin)
        what = "attached to"
        if link_fd >= 0:
            try:
                state = link_state(hook, link_fd)
                if state.cgroup_id == cg_id and state.attach_type == attach_type:
                    if state.prog_id == prog_id(fd):
                        return ""
                    _check(bpfsys.link_update(link_fd, fd), f"bpf_link_update({hook})")
                    return "given the new build in place on"
                bpfsys.link_detach(link_fd)
                what = f"moved from cgroup id {state.cgroup_id} to"
            finally:
                os.close(link_fd)
            os.unlink(pin)
        new = _check(bpfsys.link_create(fd, cg_fd, attach_type), f"bpf_link_create({hook} on {self._cgroup})")
        try:
            _check(bpfsys.obj_pin(new, pin), f"pinning {pin}")
        finally:
            os.close(new)
        return what


def detach_all(pin_path: str) -> list[str]:
    """Detach and unpin every socket hook's link under `pin_path`; the hooks that had one."""
    done = []
    for hook in SOCK_HOOKS:
        pin = link_pin(pin_path, hook)
        fd = bpfsys.obj_get(pin)
        if fd < 0:
            continue
        try:
            bpfsys.link_detach(fd)
        finally:
            os.close(fd)
        os.unlink(pin)
        done.append(hook)
    return done
