"""`python -m bench.capacity`: how many concurrent flows the default conntrack sizing holds.

A benchmark, not a test: nothing in `make test` depends on its numbers. As root, in a throwaway
bpffs and a private network namespace (lab/dplab.py's packet lab), the real data path is
loaded with the sizes the agent would derive on this machine (MapSizes.with_conntrack from
kube-proxy's default conntrack settings and this machine's CPUs), and TCP flows are opened
through a ClusterIP with BPF_PROG_TEST_RUN: SYN, SYN-ACK, ACK each, so every flow is established
(24-hour timeout) and live. The flows are opened in batches alternating between the CPUs (the
program runs on the caller's CPU), like connections spread over a node's CPUs.

After every batch the oldest flows are looked up: the first one missing is the first live flow
the LRU evicted. Reported: the flows open at that point against the table's capacity, and the
memory the table takes (the kernel's own account, `memlock` in the map's fdinfo).

`--one-cpu` opens every flow on one CPU (traffic concentrated on one receive queue): with the
kernel's common LRU list (ABI v2) that changes nothing; with one list per CPU (ABI v1's
BPF_F_NO_COMMON_LRU) a CPU owns only capacity / CPUs entries and evicts from its own share.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import struct
import sys
import time
from dataclasses import dataclass
from socket import inet_aton

from agent.config import ConntrackSettings, MapSizes, conntrack_max
from agent.ebpf.abi import BackendFlag
from agent.ebpf.loader import Datapath
from bench.report import Table, num
from lab.dplab import BE1, VIP, Net, packet_lab, reset_maps
from lab.packets import TC_ACT_REDIRECT, bpffs, sh

BATCH = 4096
FINE = 32  # flows between checks once the table is nearly full
OLDEST = 256  # the oldest flows looked up after each batch


@dataclass(frozen=True)
class Result:
    cpus: int
    flows_configured: int  # kube-proxy's max(maxPerCore x CPUs, min)
    capacity: int  # ekp_ct_tcp max_entries
    flows_at_first_eviction: int  # flows open when the first live one was gone
    entries_at_first_eviction: int
    memlock_bytes: int
    seconds: float

    @property
    def bytes_per_flow(self) -> float:
        return self.memlock_bytes / (self.capacity / 2)


def memlock(fd: int) -> int:
    """The kernel's account of a map's memory (bytes), from /proc/self/fdinfo."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("memlock:"):
                return int(line.split()[1])
    return 0


def client(i: int) -> tuple[str, int]:
    """The i-th flow's client address and port: 50,000 ports per address in 10.128.0.0/9."""
    addr = ipaddress.IPv4Address("10.128.0.1") + i // 50000
    return str(addr), 1024 + i % 50000


def segment(src: str, dst: str, sport: int, dport: int, flags: int) -> bytes:
    """A bare Ethernet/IPv4/TCP frame (checksums left 0: the programs fix them incrementally and
    nothing here checks them); scapy takes ~300 us a frame, this a few."""
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 0, 0x4000, 64, 6, 0, inet_aton(src), inet_aton(dst))
    tcp_header = struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 5 << 4, flags, 65535, 0, 0)
    return b"\x02\x00\x00\x00\xaa\x02\x02\x00\x00\x00\xaa\x01\x08\x00" + ip + tcp_header


SYN, SYN_ACK, ACK = 0x02, 0x12, 0x10


def open_flow(net: Net, i: int) -> bool:
    addr, port = client(i)
    ok = net.from_pod(segment(addr, VIP, port, 80, SYN))[0] == TC_ACT_REDIRECT
    ok = ok and net.from_pod(segment(BE1, addr, 8080, port, SYN_ACK))[0] == TC_ACT_REDIRECT
    return ok and net.from_pod(segment(addr, VIP, port, 80, ACK))[0] == TC_ACT_REDIRECT


def alive(net: Net, i: int) -> bool:
    addr, port = client(i)
    return net.ct(addr, VIP, port, 80) is not None and net.ct(BE1, addr, 8080, port, reply=True) is not None


def measure(limit_flows: int | None = None, one_cpu: bool = False) -> Result:
    cpus = sorted(os.sched_getaffinity(0))[:1] if one_cpu else sorted(os.sched_getaffinity(0))
    settings = ConntrackSettings()
    sizes = MapSizes().with_conntrack(settings, os.cpu_count() or 1)
    started = time.monotonic()
    with bpffs() as root, packet_lab() as lab:
        dp = Datapath(str(root / "ekp"), sizes)
        dp.load()
        try:
            reset_maps(dp)
            sh("ip", "route", "add", "10.128.0.0/9", "dev", "pod0")  # the clients, behind the pods' device
            net = Net(dp, lab)
            net.add_service(backends=((1, BE1, 8080, BackendFlag.LOCAL),))
            table = dp.maps["ct_tcp"]
            capacity = table.info().max_entries
            opened = 0
            first_gone = 0
            batch = 0
            try:
                while opened < (limit_flows or capacity):  # a table holds capacity / 2 flows at most
                    os.sched_setaffinity(0, {cpus[batch % len(cpus)]})
                    near = opened >= capacity // 2 // len(cpus) - 2 * BATCH
                    for _ in range(FINE if near else BATCH):
                        if not open_flow(net, opened):
                            raise RuntimeError(f"flow {opened} was not translated")
                        opened += 1
                    batch += 1
                    if not all(alive(net, i) for i in range(min(OLDEST, opened))):
                        first_gone = opened
                        break
            finally:
                os.sched_setaffinity(0, set(cpus))
            entries = len(table.items())
            return Result(
                cpus=len(cpus),
                flows_configured=conntrack_max(settings, os.cpu_count() or 1),
                capacity=capacity,
                flows_at_first_eviction=first_gone,
                entries_at_first_eviction=entries,
                memlock_bytes=memlock(table.fd),
                seconds=time.monotonic() - started,
            )
        finally:
            dp.close()


def table(r: Result) -> Table:
    share = 2 * r.flows_at_first_eviction / r.capacity if r.capacity else 0.0
    return Table(
        "Conntrack capacity: concurrent TCP flows the default sizing holds (ekp_ct_tcp_v2)",
        [
            "CPUs",
            "kube-proxy conntrack max",
            "table entries",
            "flows open when the first live eviction was seen",
            "memory",
            "per flow",
        ],
        [
            [
                num(r.cpus),
                num(r.flows_configured),
                num(r.capacity),
                f"{num(r.flows_at_first_eviction)} ({share:.1%} of entries)"
                if r.flows_at_first_eviction
                else "none",
                f"{r.memlock_bytes / 2**20:.1f} MiB",
                f"{r.bytes_per_flow:.0f} B",
            ]
        ],
        [True, True, True, True, True, True],
        notes=[
            "flows opened with BPF_PROG_TEST_RUN (SYN, SYN-ACK, ACK: established, 24 h timeout), "
            "alternating CPUs; two entries per flow; memory is the kernel's memlock account of the table",
            f"a table of N entries holds N / 2 flows; the oldest {OLDEST} flows are looked up after each "
            f"batch ({BATCH:,} flows, {FINE} near the limit), so the eviction is seen up to one batch "
            "after it happened",
        ],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit-flows", type=int, default=None, help="stop after this many flows (a quick look)")
    p.add_argument("--one-cpu", action="store_true", help="open every flow on one CPU")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.capacity needs root (BPF, network namespaces)", file=sys.stderr)
        return 2
    r = measure(args.limit_flows, args.one_cpu)
    share = 2 * r.flows_at_first_eviction / r.capacity
    eviction = (
        f"{r.flows_at_first_eviction:,} flows ({share:.1%} of the entries)"
        if r.flows_at_first_eviction
        else "none"
    )
    print(
        f"ekp_ct_tcp: {r.capacity:,} entries (2 x kube-proxy's conntrack max {r.flows_configured:,}),"
        f" flows opened on {r.cpus} CPU(s)\n"
        f"first live flow evicted after: {eviction}; entries then: {r.entries_at_first_eviction:,}\n"
        f"memory (memlock): {r.memlock_bytes / 2**20:.1f} MiB, {r.bytes_per_flow:.0f} bytes per flow\n"
        f"run: {r.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
