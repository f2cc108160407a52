"""tcx: the tc hooks through bpf_links (Linux 6.6), with no qdisc. Effects (bpf(2), bpffs pins).

Why: adding a clsact qdisc to a device grafts it with the device's transmit queues deactivated for
an RCU grace period, and what the node sends out of the device meanwhile is dropped (README
"Machine facts"; agent/ebpf/attach.py). A tcx link attaches a program to the device's ingress or
egress hook directly (kernel/bpf/tcx.c, the multi-program list of kernel/bpf/mprog.c): nothing is
grafted, nothing is dropped.

What the kernel does with them (net/core/dev.c sch_handle_ingress / sch_handle_egress): the hook's
tcx programs run first, in their list's order; one returning TCX_NEXT (-1, which is TC_ACT_UNSPEC)
hands the packet to the next, and after the last to the clsact qdisc's cls_bpf filters, if the
device has one; TC_ACT_OK, TC_ACT_SHOT and TC_ACT_REDIRECT are final (include/net/tcx.h
tcx_action_code; any other code counts as TCX_NEXT). So a program of ours on tcx naturally runs in
front of an older generation still on clsact, and its TC_ACT_UNSPEC falls through to it: the
hand-over needs no priority. On TC_ACT_OK the kernel sets skb->tc_index from skb->tc_classid as
cls_bpf does (the legacy host routing's tag, bpf/ekp_host.h).

One difference the programs would see: cls_bpf sets skb->tc_classid to the filter's classid before
the program runs; tcx sets nothing, and the field holds whatever the skb's control block held (the
sender's IP options may reach it). So no program of ours reads it: each ingress program writes it
(the tag, or 0) before it passes a packet (ekp_egress writes none: it reads the tag, from
tc_index), and a pod port's bridge, which an older generation read from there, comes from the map
ekp_port_v2 (attach.port_bridge, bpf/ekp_redirect.h).

That older generation put, first on every ingress hook, a program of four instructions
(`CLASSID_PROG_NAME`) that wrote the port's bridge there and returned TCX_NEXT, pinned as
`ekp_tcxcls_ingress_*` (`CLASSID`). An agent that finds one leaves it while an older program runs
behind it (a hand-over, until the rehome) and removes it once its own program serves the hook; it
counts as ours for `--cleanup`, `agent inspect hooks` and `agent doctor`.

Each link is pinned under the agent's pin directory, so it outlives the agent (a restart finds its
programs serving and swaps the new ones in with BPF_LINK_UPDATE: no moment without a program):

    ekp_tcx_<hook>_<device>_<ifindex>        our program (`MAIN`)
    ekp_tcxcls_ingress_<device>_<ifindex>    an older generation's classid program (`CLASSID`)
    ekp_tcxfront_<hook>_<device>_<ifindex>   a hand-over's new program in front of an older
                                             generation's tcx link (`FRONT`), until the rehome

(`bpftool link show pinned <pin>` names the device's ifindex and the hook.) The ifindex comes last
so that no device name makes a pin look like a map of another ABI version (loader.stale_pins). A
device that goes away takes its links off the hook: they live on, defunct (their ifindex 0), while
the pin holds them; `sweep_defunct` removes those pins.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from agent.ebpf import bpfsys
from agent.netns import run_in_netns

log = logging.getLogger(__name__)

BPF_PROG_TYPE_SCHED_CLS = 3
BPF_TCX_INGRESS = 46  # enum bpf_attach_type
BPF_TCX_EGRESS = 47
BPF_LINK_TYPE_TCX = 11
BPF_F_BEFORE = 1 << 3
BPF_F_LINK = 1 << 13
TCX_NEXT = -1

INGRESS, EGRESS = "ingress", "egress"
ATTACH_TYPES = {INGRESS: BPF_TCX_INGRESS, EGRESS: BPF_TCX_EGRESS}
MAIN, CLASSID, FRONT = "", "cls", "front"  # pin roles (module doc)
PIN_PREFIX = "ekp_tcx"
_PIN = re.compile(rf"^{PIN_PREFIX}(|{CLASSID}|{FRONT})_({INGRESS}|{EGRESS})_(.*)_(\d+)$")
CLASSID_PROG_NAME = "ekp_tcx_classid"  # an older generation's (module doc): recognised, never loaded


def pin_name(role: str, hook: str, device: str, index: int) -> str:
    return f"{PIN_PREFIX}{role}_{hook}_{device}_{index}"


class _LinkInfo(ctypes.Structure):
    """struct bpf_link_info: type, id, prog_id, then (tcx links) ifindex and attach_type."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("ifindex", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
    ]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        raise OSError(-ret, f"{what}: {os.strerror(-ret)}")
    return ret


def probe() -> str:
    """ "" where the kernel attaches tcx links, else why not (a query of the loopback device's tcx
    ingress hook: Linux before 6.6 refuses the attach type with EINVAL; an ENOENT, from kernels
    before the fix that answers an empty hook with no entries, means the hook exists)."""
    ids = (ctypes.c_uint32 * 1)()
    links = (ctypes.c_uint32 * 1)()
    ret, _ = bpfsys.tcx_query(1, BPF_TCX_INGRESS, ids, links)
    if ret < 0 and ret != -errno.ENOENT:
        return f"the kernel refuses a tcx query ({os.strerror(-ret)}; tcx needs Linux 6.6)"
    return ""


@dataclass(frozen=True)
class Pinned:
    """One of our pinned tcx links, as its pin names it and the kernel describes it."""

    path: str
    role: str  # MAIN, CLASSID or FRONT
    hook: str  # INGRESS or EGRESS
    device: str  # the device's name when the link was pinned
    index: int  # the device's ifindex when the link was pinned
    link_id: int
    prog_id: int
    live_index: int  # the ifindex the link holds now; 0 when defunct (the device went)

    @property
    def live(self) -> bool:
        return self.live_index == self.index


def link_info(fd: int) -> tuple[int, int, int]:
    """(link id, program id, ifindex) of a tcx link."""
    info = _LinkInfo()
    _check(bpfsys.obj_get_info_by_fd(fd, info), "bpf_obj_get_info(link)")
    if info.type != BPF_LINK_TYPE_TCX:
        raise OSError(errno.EINVAL, f"not a tcx link (type {info.type})")
    return int(info.id), int(info.prog_id), int(info.ifindex)


def prog_id(fd: int) -> int:
    info = bpfsys.ProgInfo()
    _check(bpfsys.obj_get_info_by_fd(fd, info), "bpf_obj_get_info(prog)")
    return int(info.id)


def prog_name(prog_id_: int) -> str:
    """The name of a loaded program ("" when it is gone)."""
    fd = bpfsys.prog_get_fd_by_id(prog_id_)
    if fd < 0:
        return ""
    try:
        info = bpfsys.ProgInfo()
        if bpfsys.obj_get_info_by_fd(fd, info) < 0:
            return ""
        return str(info.name.decode(errors="replace"))
    finally:
        os.close(fd)


def pinned(pin_path: str, indexes: Collection[int] | None = None) -> list[Pinned]:
    """Our tcx links pinned under `pin_path`, those named for the ifindexes `indexes` when given.

    A pin that is gone meanwhile is skipped: the watcher's `_sweep` and a reconcile's
    `sweep_defunct` walk the same defunct pins, and a hand-over renames FRONT to MAIN. A pin the
    kernel says holds no tcx link (EINVAL) is removed: it holds nothing this agent can use. Any
    other error (EMFILE, ENOMEM, EPERM) says nothing about the pin, whose link may be serving: it
    is logged and skipped, never removed."""
    try:
        names = sorted(os.listdir(pin_path))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _PIN.match(name)
        if m is None or (indexes is not None and int(m.group(4)) not in indexes):
            continue
        path = os.path.join(pin_path, name)
        fd = bpfsys.obj_get(path)
        try:
            if fd < 0:
                raise OSError(-fd, os.strerror(-fd))
            link_id, prog, live = link_info(fd)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                continue
            if exc.errno != errno.EINVAL:
                log.warning("cannot read pin %s (left in place, skipped until it can be read): %s", path, exc)
                continue
            log.warning("removed pin %s, which holds no tcx link of ours: %s", path, exc)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            continue
        finally:
            if fd >= 0:
                os.close(fd)
        out.append(Pinned(path, m.group(1), m.group(2), m.group(3), int(m.group(4)), link_id, prog, live))
    return out


def find(pins: Iterable[Pinned], role: str, hook: str, index: int) -> Pinned | None:
    for pin in pins:
        if pin.role == role and pin.hook == hook and pin.index == index:
            return pin
    return None


def create(
    netns: str,
    pin_path: str,
    role: str,
    hook: str,
    device: str,
    index: int,
    prog_fd: int,
    *,
    before: str = "",
) -> Pinned:
    """A new tcx link of `prog_fd` on the device's hook, pinned. Placed last on the hook;
    `before`: right in front of the link pinned there."""
    flags, relative = 0, -1
    if before:
        relative = _check(bpfsys.obj_get(before), f"opening {before}")
        flags = BPF_F_BEFORE | BPF_F_LINK
    try:
        fd = _check(
            run_in_netns(
                netns,
                lambda: bpfsys.tcx_link_create(prog_fd, index, ATTACH_TYPES[hook], flags, max(relative, 0)),
            ),
            f"bpf_link_create(tcx {hook} on {device})",
        )
    finally:
        if relative >= 0:
            os.close(relative)
    path = os.path.join(pin_path, pin_name(role, hook, device, index))
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a pin of a device that had this name and ifindex before
        _check(bpfsys.obj_pin(fd, path), f"pinning {path}")
        link_id, prog, live = link_info(fd)
    except BaseException:
        bpfsys.link_detach(fd)
        raise
    finally:
        os.close(fd)
    return Pinned(path, role, hook, device, index, link_id, prog, live)


def update(pin: Pinned, prog_fd: int) -> None:
    """Swap the program of a pinned link in place (BPF_LINK_UPDATE: no packet meets none)."""
    fd = _check(bpfsys.obj_get(pin.path), f"opening {pin.path}")
    try:
        _check(bpfsys.link_update(fd, prog_fd), f"bpf_link_update({pin.path})")
    finally:
        os.close(fd)


def remove(pin: Pinned) -> None:
    """Detach a pinned link from its hook and remove its pin."""
    fd = bpfsys.obj_get(pin.path)
    if fd >= 0:
        try:
            bpfsys.link_detach(fd)  # ENOLINK once defunct: nothing left to detach
        finally:
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pin.path)


def rename(pin: Pinned, device: str, pin_path: str) -> Pinned:
    """The pin renamed for the device's current name (a device renamed keeps its ifindex)."""
    path = os.path.join(pin_path, pin_name(pin.role, pin.hook, device, pin.index))
    with contextlib.suppress(FileNotFoundError):  # swept or renamed meanwhile (`pinned`)
        os.rename(pin.path, path)
    return Pinned(path, pin.role, pin.hook, device, pin.index, pin.link_id, pin.prog_id, pin.live_index)


def removal_order(pin: Pinned) -> tuple[bool, bool]:
    """A sort key for removing a device's links as the clsact path removes its filters: ingress's
    programs, then an older generation's classid program (its program behind reads what it writes),
    then egress (no packet translated at ingress lacks its egress half)."""
    return (pin.hook == EGRESS, pin.role == CLASSID)


def sweep_defunct(pin_path: str, pins: Iterable[Pinned] | None = None) -> list[str]:
    """Remove the pins of links whose device went (or whose ifindex now names another device);
    their names."""
    out = []
    for pin in pinned(pin_path) if pins is None else pins:
        if not pin.live:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pin.path)
            out.append(os.path.basename(pin.path))
    return out


def hook_links(index: int, hook: str) -> list[tuple[int, int]]:
    """(program id, link id) of every program on one tcx hook of the caller's netns, in run order
    (link id 0: attached without a link); [] where the kernel has no tcx or the device is gone, and
    where the device has neither tcx nor clsact (ENOENT, from kernels without the fix for it)."""
    size = 64
    while True:
        ids = (ctypes.c_uint32 * size)()
        links = (ctypes.c_uint32 * size)()
        ret, count = bpfsys.tcx_query(index, ATTACH_TYPES[hook], ids, links)
        if ret == -errno.ENOSPC and count > size:
            size = count
            continue
        if ret < 0:
            if ret in (-errno.EINVAL, -errno.ENODEV, -errno.ENOENT):
                return []
            raise OSError(-ret, f"tcx query of ifindex {index} {hook}: {os.strerror(-ret)}")
        return [(int(ids[i]), int(links[i])) for i in range(count)]


def detach_ours(index: int, prefix: str) -> int:
    """Detach every tcx link on the device (caller's netns) whose program's name starts with
    `prefix`, pinned or not (a pin left then holds a defunct link); how many. In the order the
    clsact path removes ours: the ingress programs, then an older generation's classid program in
    front of them (so no older program of ours reads a tc_classid nobody wrote), then egress (so
    no packet translated at ingress lacks its egress half)."""
    done = 0
    ingress = hook_links(index, INGRESS)
    names = {prog: prog_name(prog) for prog, _ in ingress}
    ordered = [(p, lk) for p, lk in ingress if names[p] != CLASSID_PROG_NAME]
    ordered += [(p, lk) for p, lk in ingress if names[p] == CLASSID_PROG_NAME]
    for prog, link_id in [*ordered, *hook_links(index, EGRESS)]:
        if not link_id or not (names.get(prog) or prog_name(prog)).startswith(prefix):
            continue
        fd = bpfsys.link_get_fd_by_id(link_id)
        if fd < 0:
            continue  # gone meanwhile
        try:
            _check(bpfsys.link_detach(fd), f"bpf_link_detach(tcx link {link_id})")
        finally:
            os.close(fd)
        done += 1
    return done
