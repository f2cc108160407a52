"""Helpers for the packet-level data path tests: a private bpffs, a private network namespace,
BPF_PROG_TEST_RUN through libbpf, and scapy packet builders and checks.

Context managers rather than fixtures, so each test module declares its own fixtures and no
conftest is shared with other test files.

* `bpffs()` mounts a bpf filesystem on a temporary directory: tests never touch real pins.
* `private_netns()` moves the calling thread into a fresh, anonymous network namespace (unshare)
  and back (setns) afterwards; bpf_fib_lookup inside BPF_PROG_TEST_RUN resolves routes and
  neighbours in the namespace of the thread that runs the test, so the lab's devices, routes and
  neighbours are set up there. The namespace dies with its last reference: nothing to clean up,
  nothing visible in `ip netns`.
"""

from __future__ import annotations

import ctypes as ct
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import MapSizes
from agent.ebpf.loader import Datapath

TC_ACT_UNSPEC = 0xFFFFFFFF  # -1 as BPF_PROG_TEST_RUN's u32 retval: cls_bpf goes on to the next filter
TC_ACT_OK = 0
TC_ACT_SHOT = 2
TC_ACT_REDIRECT = 7

CLONE_NEWNET = 0x40000000

_libc = ct.CDLL(None, use_errno=True)


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


@contextmanager
def bpffs() -> Iterator[Path]:
    """A bpf filesystem mounted on a fresh temporary directory, unmounted and removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="ekp-bpffs-"))
    try:
        sh("mount", "-t", "bpf", "bpf", str(path))
        try:
            yield path
        finally:
            subprocess.run(["umount", str(path)], check=False)
    finally:
        os.rmdir(path)


@contextmanager
def loaded_datapath(sizes: MapSizes) -> Iterator[Datapath]:
    """The real data path compiled and loaded, its maps pinned in a throwaway bpffs."""
    with bpffs() as root:
        datapath = Datapath(str(root / "ekp"), sizes)
        datapath.load()
        try:
            yield datapath
        finally:
            datapath.close()


@contextmanager
def private_netns() -> Iterator[None]:
    """Runs the body in a new network namespace (this thread only), then returns to the old one."""
    old = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if _libc.unshare(CLONE_NEWNET) != 0:
            err = ct.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
        try:
            yield
        finally:
            if _libc.setns(old, CLONE_NEWNET) != 0:
                err = ct.get_errno()
                raise OSError(err, f"setns back to the original namespace: {os.strerror(err)}")
    finally:
        os.close(old)


@dataclass(frozen=True)
class Link:
    name: str
    ifindex: int
    mac: str


def link(name: str) -> Link:
    """A device of the current namespace (read with `ip -j`: /sys shows the host's namespace)."""
    info = json.loads(sh("ip", "-j", "link", "show", "dev", name))[0]
    return Link(name, int(info["ifindex"]), str(info["address"]))


# ---- BPF_PROG_TEST_RUN -----------------------------------------------------------------


class _TestRunOpts(ct.Structure):
    """libbpf's struct bpf_test_run_opts (libbpf 1.x)."""

    _fields_ = [
        ("sz", ct.c_size_t),
        ("data_in", ct.c_void_p),
        ("data_out", ct.c_void_p),
        ("data_size_in", ct.c_uint32),
        ("data_size_out", ct.c_uint32),
        ("ctx_in", ct.c_void_p),
        ("ctx_out", ct.c_void_p),
        ("ctx_size_in", ct.c_uint32),
        ("ctx_size_out", ct.c_uint32),
        ("retval", ct.c_uint32),
        ("repeat", ct.c_int),
        ("duration", ct.c_uint32),
        ("flags", ct.c_uint32),
        ("cpu", ct.c_uint32),
        ("batch_size", ct.c_uint32),
    ]


class _SkBuffHead(ct.Structure):
    """struct __sk_buff up to ifindex: all a test sets (the kernel zero-fills the rest)."""

    _fields_ = [
        ("len", ct.c_uint32),
        ("pkt_type", ct.c_uint32),
        ("mark", ct.c_uint32),
        ("queue_mapping", ct.c_uint32),
        ("protocol", ct.c_uint32),
        ("vlan_present", ct.c_uint32),
        ("vlan_tci", ct.c_uint32),
        ("vlan_proto", ct.c_uint32),
        ("priority", ct.c_uint32),
        ("ingress_ifindex", ct.c_uint32),
        ("ifindex", ct.c_uint32),
    ]


class _SkBuffGso(_SkBuffHead):
    """struct __sk_buff on to gso_size (linux/bpf.h): a GSO skb's gso_segs and gso_size, which
    BPF_PROG_TEST_RUN copies into the skb's shared info (net/bpf/test_run.c, since 5.7 and 5.11);
    the fields between stay 0, as the kernel requires."""

    _fields_ = [
        ("tc_index", ct.c_uint32),
        ("cb", ct.c_uint32 * 5),
        ("hash", ct.c_uint32),
        ("tc_classid", ct.c_uint32),
        ("data", ct.c_uint32),
        ("data_end", ct.c_uint32),
        ("napi_id", ct.c_uint32),
        ("family", ct.c_uint32),
        ("remote_ip4", ct.c_uint32),
        ("local_ip4", ct.c_uint32),
        ("remote_ip6", ct.c_uint32 * 4),
        ("local_ip6", ct.c_uint32 * 4),
        ("remote_port", ct.c_uint32),
        ("local_port", ct.c_uint32),
        ("data_meta", ct.c_uint32),
        ("flow_keys", ct.c_uint64),
        ("tstamp", ct.c_uint64),
        ("wire_len", ct.c_uint32),
        ("gso_segs", ct.c_uint32),
        ("sk", ct.c_uint64),
        ("gso_size", ct.c_uint32),
    ]


# BPF_PROG_TEST_RUN's flag (linux/bpf.h; this machine's 6.18 takes it): the skb starts
# CHECKSUM_COMPLETE, skb->csum the sum from the network header on, and the run fails with EBADMSG
# when the program leaves skb->csum that no longer matches the data (what a NIC that reports full
# checksums would pass up).
BPF_F_TEST_SKB_CHECKSUM_COMPLETE = 1 << 2


def prog_run(
    prog_fd: int,
    frame: bytes,
    ifindex: int,
    ingress_ifindex: int | None = None,
    *,
    csum_complete: bool = False,
    gso_size: int = 0,
) -> tuple[int, bytes]:
    """Runs a SCHED_CLS program on `frame` as if it arrived on `ifindex` (an egress program: as if
    it left by `ifindex`, having come in by `ingress_ifindex`, 0 for the node's own packets);
    (verdict, frame out). `csum_complete`: as a CHECKSUM_COMPLETE skb, its skb->csum checked after
    the run (OSError EBADMSG when stale). `gso_size`: a GSO skb (a TSO burst, a GRO merge) that
    leaves as segments of that many payload bytes each."""
    flags = BPF_F_TEST_SKB_CHECKSUM_COMPLETE if csum_complete else 0
    verdict, out, _ = _test_run(prog_fd, frame, ifindex, ingress_ifindex, 1, flags, gso_size)
    return verdict, out


def prog_run_timed(
    prog_fd: int, frame: bytes, ifindex: int, ingress_ifindex: int | None = None, repeat: int = 1
) -> tuple[int, int]:
    """`repeat` runs of the program on `frame` in one BPF_PROG_TEST_RUN (the kernel runs it again on
    the frame it left, so only a frame the program does not rewrite measures one path); (verdict,
    mean nanoseconds per run as the kernel timed them)."""
    verdict, _, ns = _test_run(prog_fd, frame, ifindex, ingress_ifindex, repeat)
    return verdict, ns


def _test_run(
    prog_fd: int,
    frame: bytes,
    ifindex: int,
    ingress_ifindex: int | None,
    repeat: int,
    flags: int = 0,
    gso_size: int = 0,
) -> tuple[int, bytes, int]:
    from bcc import libbcc

    fn = libbcc.lib.bpf_prog_test_run_opts  # libbpf's, reached through libbcc's handle
    fn.restype = ct.c_int
    fn.argtypes = [ct.c_int, ct.POINTER(_TestRunOpts)]
    data_in = ct.create_string_buffer(frame, len(frame))
    data_out = ct.create_string_buffer(len(frame) + 256)
    ctx = (_SkBuffGso if gso_size else _SkBuffHead)(
        ingress_ifindex=ifindex if ingress_ifindex is None else ingress_ifindex, ifindex=ifindex
    )
    if isinstance(ctx, _SkBuffGso):
        ctx.gso_size = gso_size
        ctx.gso_segs = -(-len(frame) // gso_size)  # an upper bound; the data path reads gso_size
    opts = _TestRunOpts(
        sz=ct.sizeof(_TestRunOpts),
        data_in=ct.cast(data_in, ct.c_void_p),
        data_out=ct.cast(data_out, ct.c_void_p),
        data_size_in=len(frame),
        data_size_out=len(data_out),
        ctx_in=ct.cast(ct.pointer(ctx), ct.c_void_p),
        ctx_size_in=ct.sizeof(ctx),
        repeat=repeat,
        flags=flags,
    )
    ret = fn(prog_fd, ct.byref(opts))
    if ret < 0:
        err = -ret if ret < -1 else ct.get_errno()
        raise OSError(err, f"BPF_PROG_TEST_RUN: {os.strerror(err)}")
    return int(opts.retval), data_out.raw[: opts.data_size_out], int(opts.duration)


class PreparedRun:
    """prog_run with every buffer built beforehand: calling it runs the SCHED_CLS program on `frame`
    arriving on `ifindex` and gives the verdict, with no Python work between the call and the
    system call but the call itself (for two CPUs timed to run a program at the same moment)."""

    def __init__(self, prog_fd: int, frame: bytes, ifindex: int) -> None:
        from bcc import libbcc

        self._fn = libbcc.lib.bpf_prog_test_run_opts
        self._fn.restype = ct.c_int
        self._fn.argtypes = [ct.c_int, ct.POINTER(_TestRunOpts)]
        self._fd = prog_fd
        self._data_in = ct.create_string_buffer(frame, len(frame))
        self._data_out = ct.create_string_buffer(len(frame) + 256)
        self._ctx = _SkBuffHead(ingress_ifindex=ifindex, ifindex=ifindex)
        self._opts = _TestRunOpts(
            sz=ct.sizeof(_TestRunOpts),
            data_in=ct.cast(self._data_in, ct.c_void_p),
            data_out=ct.cast(self._data_out, ct.c_void_p),
            data_size_in=len(frame),
            data_size_out=len(self._data_out),
            ctx_in=ct.cast(ct.pointer(self._ctx), ct.c_void_p),
            ctx_size_in=ct.sizeof(self._ctx),
            repeat=1,
        )
        self._ref = ct.byref(self._opts)

    def __call__(self) -> int:
        if self._fn(self._fd, self._ref) < 0:
            raise OSError(ct.get_errno(), "BPF_PROG_TEST_RUN")
        return int(self._opts.retval)


XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = 0, 1, 2, 3, 4


class _XdpMd(ct.Structure):
    """struct xdp_md: a test sets the device (and its receive queue 0) the frame arrives on."""

    _fields_ = [
        ("data", ct.c_uint32),
        ("data_end", ct.c_uint32),
        ("data_meta", ct.c_uint32),
        ("ingress_ifindex", ct.c_uint32),
        ("rx_queue_index", ct.c_uint32),
        ("egress_ifindex", ct.c_uint32),
    ]


def xdp_run(prog_fd: int, frame: bytes, ifindex: int, repeat: int = 1) -> tuple[int, bytes, int]:
    """Runs an XDP program on `frame` as if it arrived on `ifindex` (a device of the calling
    thread's namespace); (verdict, frame out, mean ns per run)."""
    from bcc import libbcc

    fn = libbcc.lib.bpf_prog_test_run_opts
    fn.restype = ct.c_int
    fn.argtypes = [ct.c_int, ct.POINTER(_TestRunOpts)]
    data_in = ct.create_string_buffer(frame, len(frame))
    data_out = ct.create_string_buffer(len(frame) + 256)
    ctx = _XdpMd(data_end=len(frame), ingress_ifindex=ifindex)  # the kernel checks data_end == size
    opts = _TestRunOpts(
        sz=ct.sizeof(_TestRunOpts),
        data_in=ct.cast(data_in, ct.c_void_p),
        data_out=ct.cast(data_out, ct.c_void_p),
        data_size_in=len(frame),
        data_size_out=len(data_out),
        ctx_in=ct.cast(ct.pointer(ctx), ct.c_void_p),
        ctx_size_in=ct.sizeof(ctx),
        repeat=repeat,
    )
    ret = fn(prog_fd, ct.byref(opts))
    if ret < 0:
        err = -ret if ret < -1 else ct.get_errno()
        raise OSError(err, f"BPF_PROG_TEST_RUN (XDP): {os.strerror(err)}")
    return int(opts.retval), data_out.raw[: opts.data_size_out], int(opts.duration)


class Capture:
    """The frames that enter one device of the current namespace (an AF_PACKET socket): what a
    program puts back into a device's receive path (bpf_clone_redirect to ingress) shows here."""

    PACKET_OUTGOING = 4

    def __init__(self, device: str) -> None:
        import socket

        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
        self._sock.bind((device, 0))

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def frames(self, count: int, keep: Any, timeout: float = 2.0) -> list[bytes]:
        """The next `count` incoming frames for which `keep(frame)` is true; fewer when `timeout`
        seconds pass without the next one (the program's clones are queued to the CPU's backlog:
        they arrive within microseconds, the timeout only bounds a failing test)."""
        import select

        out: list[bytes] = []
        while len(out) < count:
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if not ready:
                break
            frame, addr = self._sock.recvfrom(65535)
            if addr[2] != self.PACKET_OUTGOING and keep(frame):
                out.append(frame)
        return out

    def drain(self) -> None:
        """Forget what arrived so far."""
        self._sock.setblocking(False)
        try:
            while True:
                self._sock.recv(65535)
        except BlockingIOError:
            pass
        finally:
            self._sock.setblocking(True)


# ---- scapy ------------------------------------------------------------------------------


def tcp(
    src: str,
    dst: str,
    sport: int,
    dport: int,
    *,
    flags: str = "S",
    smac: str = "02:00:00:00:aa:01",
    dmac: str = "02:00:00:00:aa:02",
    ttl: int = 64,
    payload: bytes = b"",
    **ip: Any,
) -> bytes:
    """A TCP frame; IPv6 when `src` is an IPv6 address (`ttl` as the hop limit, `ip` its fields)."""
    from scapy.layers.inet import IP, TCP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    l3 = IPv6(src=src, dst=dst, hlim=ttl, **ip) if ":" in src else IP(src=src, dst=dst, ttl=ttl, **ip)
    return bytes(Ether(src=smac, dst=dmac) / l3 / TCP(sport=sport, dport=dport, flags=flags) / payload)


def udp(
    src: str,
    dst: str,
    sport: int,
    dport: int,
    *,
    chksum: int | None = None,
    smac: str = "02:00:00:00:aa:01",
    dmac: str = "02:00:00:00:aa:02",
    ttl: int = 64,
    payload: bytes = b"hello",
    **ip: Any,
) -> bytes:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    l4 = UDP(sport=sport, dport=dport) if chksum is None else UDP(sport=sport, dport=dport, chksum=chksum)
    return bytes(Ether(src=smac, dst=dmac) / IP(src=src, dst=dst, ttl=ttl, **ip) / l4 / payload)


def sctp(
    src: str,
    dst: str,
    sport: int,
    dport: int,
    *,
    chunk: str = "init",
    tag: int = 0,
    smac: str = "02:00:00:00:aa:01",
    dmac: str = "02:00:00:00:aa:02",
    ttl: int = 64,
    data: bytes = b"hello sctp",
    **ip: Any,
) -> bytes:
    """An SCTP packet with one chunk: `init` (starts an association: verification tag 0),
    `init-ack`, `data`, `heartbeat`; `tag` is the verification tag of the other chunks. Its CRC32c
    is scapy's. IPv6 when the addresses are (`ttl` its hop limit, `ip` its header's fields)."""
    from scapy.layers.inet import IP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether
    from scapy.layers.sctp import (
        SCTP,
        SCTPChunkData,
        SCTPChunkHeartbeatReq,
        SCTPChunkInit,
        SCTPChunkInitAck,
        SCTPChunkParamStateCookie,
    )

    layer: Any
    if chunk == "init":
        layer = SCTPChunkInit(init_tag=0x1234, a_rwnd=65535, n_out_streams=1, n_in_streams=1, init_tsn=1)
    elif chunk == "init-ack":
        cookie = SCTPChunkParamStateCookie(cookie=b"cookie!!")
        layer = SCTPChunkInitAck(
            init_tag=0x5678, a_rwnd=65535, n_out_streams=1, n_in_streams=1, init_tsn=1, params=[cookie]
        )
    elif chunk == "data":
        layer = SCTPChunkData(tsn=1, stream_id=0, stream_seq=0, proto_id=0, data=data)
    else:
        layer = SCTPChunkHeartbeatReq()
    vtag = 0 if chunk == "init" else tag
    return bytes(
        Ether(src=smac, dst=dmac)
        / (IPv6(src=src, dst=dst, hlim=ttl, **ip) if ":" in src else IP(src=src, dst=dst, ttl=ttl, **ip))
        / SCTP(sport=sport, dport=dport, tag=vtag)
        / layer
    )


def sctp_checksum_ok(packet: bytes) -> bool:
    """Whether an SCTP packet (from its common header to the end) carries its right CRC32c: the
    bitwise CRC32c of lab/sctppeer.py, written apart from scapy's, so a check does not rest on the
    code that built the packet."""
    from lab.sctppeer import checksum_ok

    return checksum_ok(packet)


@dataclass(frozen=True)
class Parsed:
    smac: str
    dmac: str
    src: str
    dst: str
    sport: int
    dport: int
    ttl: int
    ip_chksum: int
    l4_chksum: int
    flags: str


def parse(frame: bytes) -> Parsed:
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.l2 import Ether
    from scapy.layers.sctp import SCTP

    pkt = Ether(frame)
    ip = pkt[IP]
    l4 = ip[TCP] if TCP in ip else ip[SCTP] if SCTP in ip else ip[UDP]
    return Parsed(
        smac=pkt.src,
        dmac=pkt.dst,
        src=ip.src,
        dst=ip.dst,
        sport=l4.sport,
        dport=l4.dport,
        ttl=ip.ttl,
        ip_chksum=ip.chksum,
        l4_chksum=l4.chksum,
        flags=str(l4.flags) if TCP in ip else "",
    )


def checksums_valid(frame: bytes) -> bool:
    """IP and TCP/UDP checksums equal scapy's recomputation (a UDP checksum of 0 means none); an
    SCTP packet's CRC32c is right (sctp_checksum_ok)."""
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.l2 import Ether
    from scapy.layers.sctp import SCTP

    pkt = Ether(frame)
    ip = pkt[IP]
    if SCTP in ip:
        fresh_ip = Ether(frame)
        del fresh_ip[IP].chksum
        ip_ok = Ether(bytes(fresh_ip))[IP].chksum == ip.chksum
        return bool(ip_ok) and sctp_checksum_ok(bytes(ip.payload)[: ip.len - ip.ihl * 4])
    l4 = ip[TCP] if TCP in ip else ip[UDP]
    want_ip, want_l4 = ip.chksum, l4.chksum
    fresh = Ether(frame)
    del fresh[IP].chksum
    l4_fresh = fresh[IP][TCP] if TCP in ip else fresh[IP][UDP]
    del l4_fresh.chksum
    again = Ether(bytes(fresh))
    l4_again = again[IP][TCP] if TCP in ip else again[IP][UDP]
    if UDP in ip and want_l4 == 0:
        return bool(again[IP].chksum == want_ip)
    return bool(again[IP].chksum == want_ip and l4_again.chksum == want_l4)


@dataclass(frozen=True)
class IcmpError:
    """An ICMP error frame as the data path built it, checked byte by byte."""

    smac: str
    dmac: str
    src: str
    dst: str
    ttl: int
    tos: int
    ip_id: int
    type: int
    code: int
    quote: bytes  # the ICMP data: the offending packet's IP header and the start of its payload
    ip_chksum_ok: bool  # the IPv4 header sums to zero
    icmp_chksum_ok: bool  # the ICMP message (header + quote) sums to zero
    length_ok: bool  # tot_len covers exactly the frame after the Ethernet header


def icmp_error_about(frame: bytes, src: str, dst: str, type_: int = 3, code: int = 3) -> bytes:
    """The ICMP error a host at `src` sends to `dst` about `frame` (a frame the data path put
    out), quoting its IP header and first 8 bytes as RFC 792 asks."""
    from scapy.layers.inet import ICMP, IP
    from scapy.layers.l2 import Ether

    quoted = bytes(Ether(frame)[IP])[:28]
    return bytes(
        Ether(src="02:00:00:00:aa:02", dst="02:00:00:00:aa:01")
        / IP(src=src, dst=dst)
        / ICMP(type=type_, code=code)
        / quoted
    )


def icmp_error(frame: bytes) -> IcmpError:
    from scapy.layers.inet import ICMP, IP
    from scapy.layers.l2 import Ether
    from scapy.utils import checksum

    pkt = Ether(frame)
    ip = pkt[IP]
    icmp = ip[ICMP]
    ihl = ip.ihl * 4
    raw_ip = frame[14 : 14 + ihl]
    raw_icmp = frame[14 + ihl : 14 + ip.len]
    return IcmpError(
        smac=pkt.src,
        dmac=pkt.dst,
        src=ip.src,
        dst=ip.dst,
        ttl=ip.ttl,
        tos=ip.tos,
        ip_id=ip.id,
        type=icmp.type,
        code=icmp.code,
        quote=raw_icmp[8:],
        ip_chksum_ok=checksum(raw_ip) == 0,
        icmp_chksum_ok=checksum(raw_icmp) == 0,
        length_ok=ip.len == len(frame) - 14,
    )


# ---- fragments ----------------------------------------------------------------------------


def fragments(
    src: str,
    dst: str,
    sport: int,
    dport: int,
    payload: bytes,
    *,
    ip_id: int = 4242,
    fragsize: int = 1480,
    proto: str = "udp",
    smac: str = "02:00:00:00:aa:01",
    dmac: str = "02:00:00:00:aa:02",
) -> list[bytes]:
    """The Ethernet frames of one UDP (or TCP) datagram cut into IPv4 fragments, in order."""
    from scapy.layers.inet import IP, TCP, UDP, fragment
    from scapy.layers.l2 import Ether

    l4 = UDP(sport=sport, dport=dport) if proto == "udp" else TCP(sport=sport, dport=dport, flags="PA")
    datagram = IP(src=src, dst=dst, id=ip_id, ttl=64) / l4 / payload
    pieces = fragment(IP(bytes(datagram)), fragsize=fragsize)  # type: ignore[no-untyped-call]
    return [bytes(Ether(src=smac, dst=dmac) / piece) for piece in pieces]


@dataclass(frozen=True)
class Datagram:
    """A datagram put back together from its fragments, as the receiver's stack would."""

    src: str
    dst: str
    ip_id: int
    l4: bytes  # the L4 header and payload
    headers_ok: bool  # every fragment's IP header checksum is right

    @property
    def ports(self) -> tuple[int, int]:
        return int.from_bytes(self.l4[0:2], "big"), int.from_bytes(self.l4[2:4], "big")

    def l4_checksum_ok(self, proto: int = 17) -> bool:
        """The UDP/TCP checksum over the pseudo header and the whole reassembled segment."""
        import socket

        from scapy.utils import checksum

        pseudo = (
            socket.inet_aton(self.src)
            + socket.inet_aton(self.dst)
            + bytes([0, proto])
            + len(self.l4).to_bytes(2, "big")
        )
        return checksum(pseudo + self.l4) == 0


def reassemble(frames: list[bytes]) -> Datagram:
    from scapy.layers.inet import IP
    from scapy.layers.l2 import Ether
    from scapy.utils import checksum

    ips = [Ether(f)[IP] for f in frames]
    assert len({(ip.src, ip.dst, ip.id, ip.proto) for ip in ips}) == 1, "fragments of different datagrams"
    data = b""
    for ip in sorted(ips, key=lambda ip: ip.frag):
        assert ip.frag * 8 == len(data), "a gap or overlap between fragments"
        data += bytes(ip.payload)[: ip.len - ip.ihl * 4]
    headers_ok = all(checksum(bytes(f)[14 : 14 + ip.ihl * 4]) == 0 for f, ip in zip(frames, ips, strict=True))
    return Datagram(ips[0].src, ips[0].dst, ips[0].id, data, headers_ok)
