"""The lab's switch behaves like a NIC's wire, so the agents' XDP program runs as on real nodes.

Two things a veth does that a wire does not, both fixed here for the node-facing links:

* A socket's packets cross a veth with their TCP/UDP checksum still partial (CHECKSUM_PARTIAL:
  the pseudo-header sum only, completed by whichever device transmits), and stay so through the
  bridge. An XDP program sees bytes, not that flag: its incremental checksum update would turn a
  partial sum into garbage. Transmit checksumming off on the client's and the nodes' eth0
  (`ethtool -K eth0 tx off`) makes the sender's stack compute full checksums, as a NIC's frames
  from the wire carry.
* A veth delivers what a native XDP program sends back out (XDP_TX) through its peer's NAPI,
  which exists only while the peer has an XDP program of its own (or GRO on; GRO would also merge
  frames into ones larger than XDP on a veth takes). Each switch port facing a node gets a
  two-instruction XDP_PASS program.

Nothing here is attached outside the lab's own namespaces.
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
from collections.abc import Iterable

from pyroute2 import IPRoute

BPF_PROG_LOAD = 5
BPF_PROG_TYPE_XDP = 6
XDP_FLAGS_DRV_MODE = 1 << 2
_SYSCALL_BPF = 321  # x86-64
# r0 = XDP_PASS (2); exit
_PASS = struct.pack("<BBhi", 0xB7, 0x00, 0, 2) + struct.pack("<BBhi", 0x95, 0x00, 0, 0)


def load_xdp_pass(name: str = "lab_wire_pass") -> int:
    """An fd of a minimal XDP program that passes every frame, named `name` (15 characters at
    most)."""
    libc = ctypes.CDLL(None, use_errno=True)
    insns = ctypes.create_string_buffer(_PASS, len(_PASS))
    license_ = ctypes.create_string_buffer(b"GPL")
    prog_name = name.encode()[:15].ljust(16, b"\0")
    # union bpf_attr for BPF_PROG_LOAD: prog_type, insn_cnt, insns, license, log_level, log_size,
    # log_buf, kern_version, prog_flags, prog_name[16]
    attr = struct.pack(
        "=IIQQIIQII16s",
        BPF_PROG_TYPE_XDP,
        len(_PASS) // 8,
        ctypes.addressof(insns),
        ctypes.addressof(license_),
        0,
        0,
        0,
        0,
        0,
        prog_name,
    )
    buf = ctypes.create_string_buffer(attr, 128)
    fd = int(libc.syscall(_SYSCALL_BPF, BPF_PROG_LOAD, buf, 128))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"loading the lab's XDP_PASS program: {os.strerror(err)}")
    return fd


def make_wire(switch_ns: str, ports: Iterable[str], ends: Iterable[str]) -> None:
    """XDP_PASS on each switch `port` facing a node; transmit checksumming off on eth0 of each
    namespace in `ends` (the client and the nodes)."""
    fd = load_xdp_pass()
    try:
        with IPRoute(netns=switch_ns, flags=0) as ipr:
            for port in ports:
                index = ipr.link_lookup(ifname=port)[0]
                ipr.link(
                    "set",
                    index=index,
                    xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", XDP_FLAGS_DRV_MODE)]},
                )
    finally:
        os.close(fd)
    for ns in ends:
        subprocess.run(
            ["ip", "netns", "exec", ns, "ethtool", "-K", "eth0", "tx", "off"],
            check=True,
            capture_output=True,
        )
