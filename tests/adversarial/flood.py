"""Flood tools run *inside* a lab namespace (`ip netns exec NS python flood.py ...`); stdlib only.

syn      --iface eth0 --src-mac M --dst-mac M --dst A --dport P --count N
         N TCP SYNs from spoofed sources (198.18.0.0/15, the benchmarking range; random ports),
         written straight to the device with an AF_PACKET socket. Prints {"sent", "seconds"}.
rejects  --dst A --dport P --count N [--listen S]
         N UDP datagrams from one socket as fast as it goes, while a raw ICMP socket counts the
         port unreachables that come back, for S seconds after the last one. Prints
         {"sent", "seconds", "unreachables", "socket_drops"}. The ICMP socket is read only after
         the sending, so its buffer is made large enough for every answer (a default one holds
         about 170 of them) and the kernel's count of what it still dropped is reported
         (SO_RXQ_OVFL): the count of unreachables is exact only when that is 0.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import sys
import time


def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return int(~total & 0xFFFF)


def syn_frame(src_mac: bytes, dst_mac: bytes, src: bytes, dst: bytes, sport: int, dport: int) -> bytes:
    seq = random.getrandbits(32)
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, 0x02, 64240, 0, 0)
    pseudo = src + dst + struct.pack("!BBH", 0, 6, len(tcp))
    tcp = tcp[:16] + struct.pack("!H", checksum(pseudo + tcp)) + tcp[18:]
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), random.getrandbits(16), 0x4000, 64, 6, 0, src, dst
    )
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    return dst_mac + src_mac + b"\x08\x00" + ip + tcp


def cmd_syn(a: argparse.Namespace) -> dict[str, object]:
    src_mac, dst_mac = bytes.fromhex(a.src_mac.replace(":", "")), bytes.fromhex(a.dst_mac.replace(":", ""))
    dst = socket.inet_aton(a.dst)
    frames = []
    for i in range(a.count):
        src = bytes([198, 18 + (i >> 16 & 1), i >> 8 & 0xFF, i & 0xFF or 1])
        frames.append(syn_frame(src_mac, dst_mac, src, dst, random.randint(1024, 65535), a.dport))
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    s.bind((a.iface, 0))
    start = time.monotonic()
    for frame in frames:
        s.send(frame)
    return {"sent": len(frames), "seconds": round(time.monotonic() - start, 3)}


SO_RCVBUFFORCE = 33  # <asm-generic/socket.h>; root may exceed net.core.rmem_max
SO_RXQ_OVFL = 40  # a cmsg with the socket's cumulative count of dropped packets


def cmd_rejects(a: argparse.Namespace) -> dict[str, object]:
    icmp = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    icmp.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    icmp.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
    icmp.setblocking(False)
    drops = 0
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    start = time.monotonic()
    for i in range(a.count):
        udp.sendto(b"x%d" % i, (a.dst, a.dport))
    sent_in = time.monotonic() - start
    unreachables = 0
    deadline = time.monotonic() + a.listen
    while time.monotonic() < deadline:
        try:
            packet, ancillary, _, _ = icmp.recvmsg(2048, socket.CMSG_SPACE(4))
        except BlockingIOError:
            time.sleep(0.005)
            continue
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL:
                drops = struct.unpack("=I", data[:4])[0]
        ihl = (packet[0] & 0x0F) * 4
        if packet[ihl] == 3 and packet[ihl + 1] == 3:
            unreachables += 1
    return {
        "sent": a.count,
        "seconds": round(sent_in, 3),
        "unreachables": unreachables,
        "socket_drops": drops,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("syn")
    s.add_argument("--iface", required=True)
    s.add_argument("--src-mac", required=True)
    s.add_argument("--dst-mac", required=True)
    s.add_argument("--dst", required=True)
    s.add_argument("--dport", type=int, required=True)
    s.add_argument("--count", type=int, required=True)
    r = sub.add_parser("rejects")
    r.add_argument("--dst", required=True)
    r.add_argument("--dport", type=int, required=True)
    r.add_argument("--count", type=int, required=True)
    r.add_argument("--listen", type=float, default=1.0)
    a = p.parse_args()
    result = cmd_syn(a) if a.cmd == "syn" else cmd_rejects(a)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
