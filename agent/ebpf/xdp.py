"""XDP on the external devices: attach `ekp_xdp_net` in the mode --bpf-xdp asks, find and remove ours.

Effects (pyroute2, through the IPRoute of the node's namespace the Attacher holds). Modes:

* `native`: the driver's XDP (XDP_FLAGS_DRV_MODE); a device whose driver has none is an error,
  logged once per device, and that device keeps its tc program alone;
* `generic`: XDP in the kernel's receive path (XDP_FLAGS_SKB_MODE), on any device: after the skb
  is allocated, so it saves less than native, but the verdicts are the same;
* `best-effort` (the default): native where the driver takes it and the device is no veth (nor a
  kind whose driver has none, NO_NATIVE_XDP), else none, with one log line per device; where every
  external device is such a one the programs are not even loaded (`loads_programs`), until one of
  another kind appears (agent/ebpf/proxier.py);
* `disabled`: none, and any program of ours still attached is removed.

A device holds one XDP program per mode, and native and generic cannot be attached at once: ours in
the other mode is removed first. Attaching over our own program replaces it atomically (no moment
without one). A program is ours when its name starts with `ekp_` (read through its id:
BPF_PROG_GET_FD_BY_ID, root only); another's is never replaced nor removed, and the device then
runs without our XDP, with a log line.

A veth delivers what XDP sends back out (XDP_TX) only when its peer has an XDP program of its own
or GRO on (its NAPI is what receives the frames): otherwise they are dropped by the peer. A NIC
has no such condition.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyroute2.netlink.exceptions import NetlinkError

from agent.ebpf import bpfsys

if TYPE_CHECKING:
    from agent.config import Config

log = logging.getLogger(__name__)

PROG_XDP = "ekp_xdp_net"
OUR_NAME_PREFIX = "ekp_"
MODES = ("disabled", "generic", "native", "best-effort")

XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
# IFLA_XDP_ATTACHED values
ATTACHED_NONE, ATTACHED_DRV, ATTACHED_SKB = 0, 1, 2
_MODE_FLAGS = {ATTACHED_DRV: XDP_FLAGS_DRV_MODE, ATTACHED_SKB: XDP_FLAGS_SKB_MODE}
_MODE_NAMES = {ATTACHED_NONE: "none", ATTACHED_DRV: "native", ATTACHED_SKB: "generic"}


@dataclass(frozen=True)
class XdpState:
    """What a device has on its XDP hook."""

    mode: int  # ATTACHED_*
    prog_id: int  # 0 when none

    @property
    def mode_name(self) -> str:
        return _MODE_NAMES.get(self.mode, f"mode {self.mode}")


def prog_info(fd: int) -> tuple[int, str]:
    """(id, name) of a loaded program."""
    info = bpfsys.ProgInfo()
    ret = bpfsys.obj_get_info_by_fd(fd, info)
    if ret < 0:
        raise OSError(-ret, f"bpf_obj_get_info(prog fd {fd}): {os.strerror(-ret)}")
    return int(info.id), info.name.decode(errors="replace")


def prog_name(prog_id: int) -> str:
    """The name of the loaded program `prog_id` ("" when it is gone or cannot be opened)."""
    fd = bpfsys.prog_get_fd_by_id(prog_id)
    if fd < 0:
        return ""
    try:
        return prog_info(fd)[1]
    finally:
        os.close(fd)


def xdp_state(ipr: Any, index: int) -> XdpState:
    msgs = ipr.get_links(index)
    if not msgs:
        return XdpState(ATTACHED_NONE, 0)
    xdp = msgs[0].get_attr("IFLA_XDP")
    if xdp is None:
        return XdpState(ATTACHED_NONE, 0)
    mode = xdp.get_attr("IFLA_XDP_ATTACHED") or 0
    mode = (
        {"xdp": ATTACHED_DRV, "xdpgeneric": ATTACHED_SKB}.get(mode, mode) if isinstance(mode, str) else mode
    )
    return XdpState(int(mode or 0), int(xdp.get_attr("IFLA_XDP_PROG_ID") or 0))


def _set(ipr: Any, index: int, fd: int, flags: int) -> None:
    ipr.link("set", index=index, xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", flags)]})


def is_ours(state: XdpState) -> bool:
    return state.prog_id != 0 and prog_name(state.prog_id).startswith(OUR_NAME_PREFIX)


def detach(ipr: Any, index: int) -> bool:
    """Remove our XDP program from one device; True when one was there."""
    state = xdp_state(ipr, index)
    if state.mode not in _MODE_FLAGS or not is_ours(state):
        return False
    _set(ipr, index, -1, _MODE_FLAGS[state.mode])
    return True


def link_kind(ipr: Any, index: int) -> str:
    """The device's rtnetlink kind ("veth", "bridge", ...; "" for a plain NIC)."""
    msgs = ipr.get_links(index)
    info = msgs[0].get_attr("IFLA_LINKINFO") if msgs else None
    kind = info.get_attr("IFLA_INFO_KIND") if info is not None else None
    return str(kind or "")


# rtnetlink kinds whose driver has no native XDP: attaching there fails with EOPNOTSUPP (seen on this
# kernel, tests/ebpf/test_xdp_attach.py; README "Machine facts"). Only those shown here: a kind
# not listed is tried, and a refusal then said by `attach`.
NO_NATIVE_XDP = frozenset({"bridge", "vxlan"})


def best_effort_tries(kind: str) -> bool:
    """Whether --bpf-xdp=best-effort tries native XDP on a device of this rtnetlink kind (`attach`):
    not on a veth (`leaves_alone`), nor on a kind whose driver has none (NO_NATIVE_XDP); on the
    rest (a NIC's "", a bond, a tap's "tun"), whose driver may still refuse it."""
    return kind != "veth" and kind not in NO_NATIVE_XDP


def loads_programs(mode: str, kinds: Iterable[str]) -> bool:
    """Whether a start loads the XDP programs (MapSizes.xdp) under --bpf-xdp `mode`, its external
    devices being of rtnetlink `kinds`: not with disabled, nor with best-effort where every one is
    a veth or a kind without native XDP (it attaches none there: `best_effort_tries`); with native
    and generic always (they attach to veths too).
    No external device found counts as unknown, so loads them: a real node's may get its address
    after the start (DHCP), be made later (a bond --devices names), or hold no --node-ip; a
    veth-only node (kind's, the lab's) always finds its eth0."""
    if mode == "disabled":
        return False
    found = list(kinds)
    return mode != "best-effort" or not found or any(best_effort_tries(kind) for kind in found)


def start_loads_programs(
    config: Config, tc_ipv6: bool, read_kinds: Callable[[Config, bool], Mapping[str, str]]
) -> tuple[bool, str]:
    """Whether an agent's start on this node now loads the XDP programs (MapSizes.xdp), and a line
    saying why where best-effort read the devices ("" otherwise): the one rule of the proxier's
    load (agent/ebpf/proxier.py `_loads_xdp`, which logs the line) and of `agent doctor`.
    `read_kinds(config, tc_ipv6)`: name -> rtnetlink kind of each external device
    (agent.ebpf.attach.external_kinds; with `tc_ipv6`, where the tc IPv6 path serves, the devices
    holding the IPv6 node addresses too). Devices that cannot be read, or none found, count as
    one that takes XDP (`loads_programs`)."""
    if config.bpf_xdp != "best-effort":
        return config.loads_xdp, ""
    try:
        kinds = read_kinds(config, tc_ipv6)
    except Exception as exc:
        return True, (
            f"cannot read the kinds of the external devices ({exc}): loading {PROG_XDP} in case one takes it"
        )
    if not kinds:
        return True, (
            "no external device found yet (no device holds a node IP, or none --devices names "
            f"exists): loading {PROG_XDP} in case one that is no veth appears (--bpf-xdp=best-effort)"
        )
    if loads_programs(config.bpf_xdp, kinds.values()):
        return True, ""
    if all(kind == "veth" for kind in kinds.values()):
        return False, (
            f"all external devices are veths ({', '.join(sorted(kinds))}): {PROG_XDP} not loaded "
            "(--bpf-xdp=best-effort never attaches it to a veth; native or generic would): it is "
            "loaded, with the tc programs again, once an external device that is no veth appears"
        )
    return False, (
        f"no external device takes native XDP ({', '.join(f'{n} {k}' for n, k in sorted(kinds.items()))}): "
        f"{PROG_XDP} not loaded (--bpf-xdp=best-effort attaches it to no veth, and the bridge and "
        "vxlan drivers have none; generic would run it): it is loaded, with the tc programs again, "
        "once an external device of another kind appears"
    )


def leaves_alone(ipr: Any, index: int, name: str, mode: str) -> bool:
    """Whether `mode` attaches nothing to the device: best-effort on a veth or a kind without
    native XDP (`attach`), said in a log line."""
    if mode != "best-effort":
        return False
    kind = link_kind(ipr, index)
    if best_effort_tries(kind):
        return False
    if kind in NO_NATIVE_XDP:
        log.info(
            "%s: no native XDP in a %s's driver: %s not attached (--bpf-xdp=best-effort); its tc "
            "program does all, and --bpf-xdp=generic would run it anyway",
            name,
            kind,
            PROG_XDP,
        )
        return True
    log.info(
        "%s is a veth: %s not attached (--bpf-xdp=best-effort; frames XDP sends back out need "
        "an XDP program or GRO on its peer, and local senders' partial checksums a NIC's wire "
        "would have completed); --bpf-xdp=native attaches it anyway",
        name,
        PROG_XDP,
    )
    return True


def attach(ipr: Any, index: int, name: str, fd: int, mode: str) -> str:
    """Ours on the device in `mode` (not "disabled"); returns the mode it runs in ("native",
    "generic"), or "" when it does not run there (logged).

    `best-effort` leaves a veth alone: its driver takes native XDP, but what XDP sends back out is
    dropped unless the peer has NAPI (an XDP program or GRO), and frames a local socket sent
    through it carry a partial checksum that XDP's rewrite cannot complete (a node that is a
    container, kind's, sees exactly those). `native` and `generic` attach there anyway: the
    operator says the peer and the senders are fit (the lab's wire, lab/wire.py)."""
    if leaves_alone(ipr, index, name, mode):
        return ""
    our_id = prog_info(fd)[0]
    state = xdp_state(ipr, index)
    want = XDP_FLAGS_SKB_MODE if mode == "generic" else XDP_FLAGS_DRV_MODE
    want_attached = ATTACHED_SKB if mode == "generic" else ATTACHED_DRV
    if state.prog_id == our_id and state.mode == want_attached:
        return _MODE_NAMES[want_attached]
    if state.prog_id and not is_ours(state):
        log.warning(
            "%s has another XDP program (id %d, %s): %s not attached there, its tc program does all",
            name,
            state.prog_id,
            state.mode_name,
            PROG_XDP,
        )
        return ""
    if state.prog_id and state.mode != want_attached:
        _set(ipr, index, -1, _MODE_FLAGS.get(state.mode, 0))  # ours in the other mode
    try:
        _set(ipr, index, fd, want)
    except NetlinkError as exc:
        if mode == "best-effort" and exc.code in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP):
            log.info(
                "%s: no native XDP in its driver (%s): %s not attached (--bpf-xdp=best-effort); "
                "its tc program does all, and --bpf-xdp=generic would run it anyway",
                name,
                os.strerror(exc.code),
                PROG_XDP,
            )
            return ""
        raise
    log.info("attached %s to %s XDP (%s)", PROG_XDP, name, _MODE_NAMES[want_attached])
    return _MODE_NAMES[want_attached]
