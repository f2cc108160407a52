"""What the generation before ekp_port_v2 put on a tcx ingress hook, to build one in tests.

That generation read a pod port's bridge from skb->tc_classid, which tcx does not set as cls_bpf
does, so first on every ingress hook it linked a program of four instructions writing the port's
bridge there and returning TCX_NEXT, named tcx.CLASSID_PROG_NAME and pinned as
`ekp_tcxcls_ingress_<device>_<ifindex>` (agent/ebpf/tcx.py, module doc). This agent never loads
one; it must hand over from one, and remove, show and clean it up as ours.
"""

from __future__ import annotations

import ctypes
import os
import struct

from agent.ebpf import bpfsys, tcx
from agent.netns import run_in_netns

SKB_TC_CLASSID = 72  # offsetof(struct __sk_buff, tc_classid)
# BPF instructions (include/uapi/linux/bpf_common.h): code, dst|src<<4, off, imm.
_INSN = struct.Struct("<BBhi")


def classid_program(classid: int) -> bytes:
    """skb->tc_classid = classid; return TCX_NEXT: the older generation's program, byte for byte."""
    return b"".join(
        (
            _INSN.pack(0xB7, 2, 0, classid),  # r2 = classid (BPF_ALU64 | BPF_MOV | BPF_K)
            _INSN.pack(0x63, 1 | 2 << 4, SKB_TC_CLASSID, 0),  # *(u32 *)(r1 + 72) = r2 (BPF_STX|BPF_MEM|BPF_W)
            _INSN.pack(0xB7, 0, 0, tcx.TCX_NEXT),  # r0 = -1
            _INSN.pack(0x95, 0, 0, 0),  # exit
        )
    )


def load_classid_program(classid: int, name: str = tcx.CLASSID_PROG_NAME) -> int:
    """The program for one value, loaded under `name`; its fd (the caller closes it)."""
    log_buf = ctypes.create_string_buffer(4096)
    fd = bpfsys.prog_load(tcx.BPF_PROG_TYPE_SCHED_CLS, classid_program(classid), "GPL", name, log=log_buf)
    if fd < 0:
        raise OSError(-fd, f"loading {name}: {os.strerror(-fd)}: {log_buf.value.decode(errors='replace')}")
    return fd


def link_classid_program(netns: str, pin_path: str, device: str, index: int, classid: int) -> str:
    """The older generation's classid link: first on the device's tcx ingress hook, pinned where it
    pinned it; the pin's path."""
    prog = load_classid_program(classid)
    try:
        fd = run_in_netns(
            netns,
            lambda: bpfsys.tcx_link_create(prog, index, tcx.BPF_TCX_INGRESS, tcx.BPF_F_BEFORE, 0),
        )
        if fd < 0:
            raise OSError(-fd, f"linking {tcx.CLASSID_PROG_NAME} on {device}: {os.strerror(-fd)}")
        try:
            path = os.path.join(pin_path, tcx.pin_name(tcx.CLASSID, tcx.INGRESS, device, index))
            ret = bpfsys.obj_pin(fd, path)
            if ret < 0:
                raise OSError(-ret, f"pinning {path}: {os.strerror(-ret)}")
        finally:
            os.close(fd)
    finally:
        os.close(prog)
    return path
