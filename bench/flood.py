"""`python -m bench.flood` (and `make bench`'s flood part): packets per second a node handles per
CPU, under a flood the external client generates itself, for two jobs and three paths:

* drop: UDP to a LoadBalancer IP whose loadBalancerSourceRanges leave the client out;
* forward: UDP to a NodePort whose backend is on the other node (ETP Cluster: DNAT and SNAT);

each through the XDP program (`--bpf-xdp=native`), the tc program alone (`--bpf-xdp=disabled`),
and iptables mode, in one run, on one lab per path.

Method. The client sends with `trafgen` (netsniff-ng), pinned to CPU 0, at a fixed offered rate
(`--rate`, EKP_FLOOD_PPS, 150,000 by default: trafgen's TX ring at full speed stops at the first
full receive backlog with EAGAIN), bounded in time (`timeout`, `--num`), 64 flows (source ports
counted round). Receive processing is steered to CPU 1: RPS on the switch port the client's frames enter
(`sw-client`) puts the bridge and node1 (XDP in its veth's NAPI, or the stack with its tc
program or netfilter) on CPU 1; RPS on node2's eth0 puts node2's receive on CPU 0. So CPU 1's busy
time during the flood, less its busy share just before it (the machine is shared), is what the
switch and node1 spent. Handled packets: for drops, the frames the switch delivered to node1
(`sw-node1` tx, all of them dropped there); for forwarding, the frames node2's eth0 received.
`pps per CPU` = handled per second / CPU 1's extra share of time in softirq (receive processing
runs there; the other engineers' processes on the shared machine do not). The bridge's own cost is in
every figure alike, so the ratios between paths understate the difference in node1's own work.

Each path runs `rounds` windows of `seconds`; the medians are reported, with the spread of the
ratios across rounds (the noise of a shared machine) in the notes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.report import Table, num

PATHS = ("xdp", "tc", "iptables")
JOBS = ("drop", "forward")
GEN_CPU, RX_CPU = 0, 1
LB_IP = "203.0.113.80"
NODE_PORT = 30980
FLOWS = 64
MAX_PPS = 5_000_000  # bounds --num whatever the generator manages
RATE = int(os.environ.get("EKP_FLOOD_PPS", "150000"))


@dataclass
class Window:
    handled: int
    seconds: float
    busy: float  # CPU 1's share in softirq during the window
    baseline: float  # ... in the second just before it
    counted_at: dict[str, dict[str, int]] = field(default_factory=dict)  # the programs' counters after it

    @property
    def pps(self) -> float:
        return self.handled / self.seconds if self.seconds else 0.0

    @property
    def pps_per_cpu(self) -> float:
        return self.pps / max(self.busy - self.baseline, 0.02)


@dataclass
class Result:
    seconds: int
    rounds: int
    rate: int = RATE
    windows: dict[str, list[Window]] = field(default_factory=dict)  # "drop/xdp" -> windows
    load_average: list[float] = field(default_factory=list)

    def median(self, job: str, path: str, what: str = "pps_per_cpu") -> float:
        ws = self.windows.get(f"{job}/{path}", [])
        return statistics.median(getattr(w, what) for w in ws) if ws else float("nan")

    def ratio_spread(self, job: str, a: str, b: str) -> tuple[float, float]:
        """(min, max) of the round-by-round ratio a/b of pps per CPU."""
        wa, wb = self.windows.get(f"{job}/{a}", []), self.windows.get(f"{job}/{b}", [])
        ratios = [x.pps_per_cpu / y.pps_per_cpu for x, y in zip(wa, wb, strict=False) if y.pps_per_cpu]
        return (min(ratios), max(ratios)) if ratios else (float("nan"), float("nan"))

    def to_json(self) -> dict[str, object]:
        return {
            "seconds": self.seconds,
            "rounds": self.rounds,
            "rate": self.rate,
            "load_average": self.load_average,
            "windows": {k: [asdict(w) for w in ws] for k, ws in self.windows.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Result:
        raw = data["windows"]
        assert isinstance(raw, dict)
        return cls(
            seconds=int(str(data["seconds"])),
            rounds=int(str(data["rounds"])),
            rate=int(str(data.get("rate", RATE))),
            load_average=list(data.get("load_average") or []),  # type: ignore[call-overload]
            windows={k: [Window(**w) for w in ws] for k, ws in raw.items()},
        )


# ---------------------------------------------------------------------------------- counters


def cpu_ticks(cpu: int) -> tuple[int, int]:
    """(softirq, total) jiffies of one CPU from /proc/stat. Receive processing (the bridge, XDP in
    a veth's NAPI, the stack with tc and netfilter) runs in the NET_RX softirq, and its time goes
    to that column whether it ran on return from an interrupt or in ksoftirqd; the other
    engineers' processes on the shared machine go to the others."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{cpu} "):
                v = [int(x) for x in line.split()[1:]]
                return v[6], sum(v)
    raise RuntimeError(f"cpu{cpu} not in /proc/stat")


def busy_between(a: tuple[int, int], b: tuple[int, int]) -> float:
    total = b[1] - a[1]
    return (b[0] - a[0]) / total if total else 0.0


def link_stat(ns: str, dev: str, what: str) -> int:
    out = subprocess.run(
        ["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev], check=True, capture_output=True, text=True
    ).stdout
    stats = json.loads(out)[0]["stats64"]
    rx_tx, name = what.split("_", 1)
    return int(stats[rx_tx][name])


def set_rps(ns: str, dev: str, cpu: int) -> None:
    path = f"/sys/class/net/{dev}/queues/rx-0/rps_cpus"
    subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", f"echo {1 << cpu:x} > {path}"], check=True)


# ---------------------------------------------------------------------------------- the lab


def trafgen_conf(smac: str, dmac: str, src: str, dst: str, dport: int) -> str:
    return (
        "{\n"
        f"  eth(da={dmac}, sa={smac}),\n"
        f"  ipv4(saddr={src}, daddr={dst}, ttl=64),\n"
        f"  udp(sp=dinc(40000, {40000 + FLOWS - 1}), dp={dport}),\n"
        "  fill(0x41, 18)\n"
        "}\n"
    )


@contextmanager
def flood(lab: object, conf: Path, seconds: float) -> Iterator[None]:
    """trafgen in the client's namespace on CPU 0 for `seconds` + 1.5 s at most (SIGINT, then its
    log holds the count it sent)."""
    from lab import Lab

    assert isinstance(lab, Lab)
    argv = [
        "taskset",
        "-c",
        str(GEN_CPU),
        "timeout",
        "-s",
        "INT",
        f"{seconds + 1.5:.1f}",
        "trafgen",
        "--no-sock-mem",
        "--notouch-irq",
        "--rate",
        f"{RATE}pps",
        "--cpus",
        "1",
        "--dev",
        "eth0",
        "--conf",
        str(conf),
        "--num",
        str(int(MAX_PPS * (seconds + 2))),
    ]
    proc = lab.popen(lab.client, *argv, name="trafgen")
    try:
        time.sleep(0.5)  # past the start
        if proc.poll() is not None:
            raise RuntimeError(f"trafgen stopped at once: {lab.log_of(proc)}")
        yield
    finally:
        proc.wait(timeout=seconds + 10)


def handled_count(c: object, job: str, path: str) -> int:
    """What node1 did to the flood so far: drops by source range, or packets forwarded to node2.
    eBPF: the counters of the program that handles them (XDP's, or tc's); iptables: the packet
    counters of the filter table's DROP rules (kube-proxy's source-range chains), or what node1's
    eth0 sent out (the forwarded packets)."""
    from lab.harness import Cluster

    assert isinstance(c, Cluster)
    node1 = c.lab.node(1)
    if path in ("xdp", "tc"):
        stats = c_stats(c, "xstats" if path == "xdp" else "stats")
        if job == "drop":
            return stats.get("drop_source_range", 0)
        return stats.get("ct_forward", 0) + stats.get("new_flows", 0)
    if job == "forward":
        return link_stat(node1.ns, "eth0", "tx_packets")
    dump = c.lab.run(node1, "iptables-save", "-c", "-t", "filter").stdout
    return sum(
        int(line[1:].split(":", 1)[0])
        for line in dump.splitlines()
        if line.startswith("[") and "-j DROP" in line
    )


def measure_window(c: object, job: str, path: str, conf: Path, seconds: float) -> Window:
    from lab.harness import Cluster

    assert isinstance(c, Cluster)
    b0 = cpu_ticks(RX_CPU)
    time.sleep(1.0)
    b1 = cpu_ticks(RX_CPU)
    with flood(c.lab, conf, seconds):
        h0, c0, t0 = handled_count(c, job, path), cpu_ticks(RX_CPU), time.monotonic()
        time.sleep(seconds)
        h1, c1, t1 = handled_count(c, job, path), cpu_ticks(RX_CPU), time.monotonic()
    return Window(handled=h1 - h0, seconds=t1 - t0, busy=busy_between(c0, c1), baseline=busy_between(b0, b1))


def run_path(path: str, seconds: float, rounds: int, result: Result) -> None:
    from lab import Lab
    from lab.harness import Cluster, ep
    from lab.objects import Port, service, with_endpoints

    mode = "iptables" if path == "iptables" else "ebpf"
    extra = ["--sync-period=1h"]
    if mode == "ebpf":
        extra.append("--bpf-xdp=" + ("native" if path == "xdp" else "disabled"))
    with Lab(nodes=2, pods_per_node=1, wire=True) as lab:
        # node2 runs no agent: it only receives what node1 forwards, on CPU 0 (RPS), as a plain
        # host would (an XDP program there would run its NAPI on CPU 1 beside node1's work)
        c = Cluster(lab, mode, agent_nodes=[1], extra=extra)
        c.start()
        try:
            lb = service(
                "flood-lb",
                "10.96.80.1",
                [Port("udp", 80, 9999, "UDP")],
                type="LoadBalancer",
                loadBalancerSourceRanges=["10.0.0.0/8"],
                status={"loadBalancer": {"ingress": [{"ip": LB_IP}]}},
            )
            np_ = service(
                "flood-np", "10.96.80.2", [Port("udp", 80, 9999, "UDP", node_port=NODE_PORT)], type="NodePort"
            )
            c.apply([*with_endpoints(lb, [ep(c, "pod-2-1")]), *with_endpoints(np_, [ep(c, "pod-2-1")])])
            lab.add_client_route(f"{LB_IP}/32", via_node=1)
            set_rps(lab.switch_ns, "sw-client", RX_CPU)
            set_rps(lab.node(2).ns, "eth0", GEN_CPU)
            node1 = lab.node(1)
            mac = json.loads(lab.run(node1, "ip", "-j", "link", "show", "dev", "eth0").stdout)[0]["address"]
            cmac = json.loads(lab.run(lab.client, "ip", "-j", "link", "show", "dev", "eth0").stdout)[0][
                "address"
            ]
            assert lab.tmpdir is not None
            confs = {
                "drop": lab.tmpdir / "drop.cfg",
                "forward": lab.tmpdir / "forward.cfg",
            }
            confs["drop"].write_text(trafgen_conf(cmac, mac, lab.client.ip, LB_IP, 80))
            confs["forward"].write_text(trafgen_conf(cmac, mac, lab.client.ip, node1.ip, NODE_PORT))
            for job in JOBS:
                for _ in range(rounds):
                    w = measure_window(c, job, path, confs[job], seconds)
                    if mode == "ebpf":
                        w.counted_at = {"xdp": c_stats(c, "xstats"), "tc": c_stats(c, "stats")}
                    result.windows.setdefault(f"{job}/{path}", []).append(w)
                    print(
                        f"   {job:8} {path:9} {w.pps:12,.0f} pps  CPU{RX_CPU} softirq {w.busy:.0%} "
                        f"(before {w.baseline:.0%})  {w.pps_per_cpu:12,.0f} pps per CPU",
                        flush=True,
                    )
        finally:
            c.stop()


def c_stats(c: object, role: str) -> dict[str, int]:
    from agent.ebpf.abi import MAPS
    from agent.ebpf.maps import BpfMap, read_stats
    from lab.harness import Cluster

    assert isinstance(c, Cluster)
    with BpfMap.open_pinned(MAPS[role], c.agents[0].pin_path) as m:
        return {s.name.lower(): v for s, v in read_stats(m).items() if v}


def measure(seconds: int = 4, rounds: int = 3, paths: Sequence[str] = PATHS) -> Result:
    result = Result(seconds=seconds, rounds=rounds, load_average=list(os.getloadavg()))
    for path in paths:
        print(f"== flood: {path}", flush=True)
        run_path(path, seconds, rounds, result)
    return result


def table(r: Result) -> Table:
    rows = []
    for job in JOBS:
        for path in PATHS:
            if f"{job}/{path}" not in r.windows:
                continue
            rows.append(
                [
                    job,
                    path,
                    num(r.median(job, path, "pps")),
                    f"{r.median(job, path, 'busy'):.0%} ({r.median(job, path, 'baseline'):.0%})",
                    num(r.median(job, path)),
                    f"{r.median(job, path) / r.median(job, 'tc'):.2f}",
                    f"{r.median(job, path) / r.median(job, 'iptables'):.2f}",
                ]
            )
    notes = [
        f"UDP from the external client (trafgen on CPU {GEN_CPU}, {FLOWS} flows, {r.rate:,} pps "
        f"offered), {r.rounds} windows of {r.seconds} s per job and path, medians; receive work "
        f"steered to CPU {RX_CPU} (RPS): pps per CPU = handled pps / CPU {RX_CPU}'s share of time in "
        "softirq above its share just before",
        "drop: to a LoadBalancer IP whose source ranges leave the client out (counted where node1 "
        "dropped them: the XDP or tc program's counter, or the filter table's DROP rules); forward: to "
        "a NodePort, backend on node2, DNAT + SNAT (counted: the program's forwarded packets, or "
        "node1's eth0 output). The switch's bridge work is in every figure: the ratios understate "
        "node1's own difference",
    ]
    for job in JOBS:
        lo, hi = r.ratio_spread(job, "xdp", "tc")
        if lo == lo:
            notes.append(f"{job}: XDP / tc per CPU, round by round: {lo:.2f} to {hi:.2f}")
    notes.append(
        f"load average at the start {', '.join(f'{x:.2f}' for x in r.load_average)} (a shared machine)"
    )
    return Table(
        "Floods from outside: packets per second per node CPU, XDP vs tc vs iptables",
        [
            "job",
            "path",
            "handled pps",
            f"CPU {RX_CPU} softirq (before)",
            "pps per CPU",
            "vs tc",
            "vs iptables",
        ],
        rows,
        [False, False, True, True, True, True, True],
        notes=notes,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--paths", default=",".join(PATHS))
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.flood needs root", file=sys.stderr)
        return 2
    r = measure(a.seconds, a.rounds, [x for x in a.paths.split(",") if x])
    print(table(r).text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
