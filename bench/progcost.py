"""The tc programs' cost per packet, by kind of packet, measured on the lab agent's own programs
and maps in the middle of the run (its services, its conntrack, its activity stamps).

kernel.bpf_stats_enabled (bench/bpfstats.py) averages whatever wrk's traffic happened to be and
costs two clock reads per run; here each kind of packet is timed alone with BPF_PROG_TEST_RUN:
the program is taken by the id tc shows on the lab node's devices, run from a thread in the
node's namespace (so its route lookups resolve there) pinned to one CPU, on a frame built for the
case. A frame the program passes untouched is run `REPEAT` times in one call (the kernel times the
loop); a frame it translates would be run again as rewritten, so those are timed one call at a
time, which adds what a single run costs the timer and a cold skb (about 100 ns here): from such a
figure the same per-call figure of an untouched frame is taken away and that frame's loop figure
added back, so every figure reads as a loop figure. Each case is measured `ROUNDS` times and the
median kept. The cases that pass are measured first: a translated case stamps its endpoints as
live (bpf/ekp_act.h), which sends later packets to them through the conntrack lookups.

Two kinds of untranslated traffic: to an endpoint no translated flow uses (what a pod's connection
to a backend is with socket-level load balancing, when nothing else reaches that backend through
tc), and to a backend that live flows through the ClusterIP use (whose every packet has to be
looked up: it may be one of theirs).

In a dual-stack lab the untranslated IPv4 cases of pods' traffic have IPv6 twins (named with the
`V6` prefix): the tc ingress programs hand IPv6 to their IPv6 twins by a tail call
(bpf/ekp_tc6.h), which pass a packet no live flow stamped after the activity check, so their ns
per packet is what untranslated IPv6 traffic pays for the programs being there.

The translated cases use a client port no real connection uses (their flows live in the agent's
conntrack until they expire: a few dozen entries, never answered).
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from agent.netns import run_in_netns
from bench import bpfstats
from lab import Lab
from lab.core import Node, Pod
from lab.packets import prog_run_timed, tcp

REPEAT = 50_000
ONE_AT_A_TIME = 800
ROUNDS = 5
CPU = 0
TC_ACT_OK = 0
# Client ports of the translated cases, below the lab's ephemeral ranges: each measurement takes a
# block of its own, so a new flow's SYN never meets the flow an earlier measurement left there.
PORTS = iter(range(1024, 32768 - 5000, 5000))


V6 = "IPv6: "  # the traffic of an IPv6 case: its IPv4 twin's, so prefixed


def ipv4_twin(traffic: str) -> str | None:
    """The IPv4 case an IPv6 case mirrors (None for an IPv4 case)."""
    return traffic.removeprefix(V6) if traffic.startswith(V6) else None


@dataclass(frozen=True)
class PacketCost:
    program: str
    traffic: str
    translated: bool  # the packet needed translation (False: the cheapest check should let it go)
    ns: float  # median over ROUNDS of the mean ns per packet


@dataclass(frozen=True)
class _Case:
    program: str
    traffic: str
    translated: bool
    device: str  # the node's device the program runs on
    came_in_by: str | None  # egress: the device the packet came in by ("" = the node's own); None: ingress
    frames: Callable[[int], bytes]  # call number -> the frame (a new flow: a new port per call)
    setup: bytes | None = None  # run once first (the SYN of the flow whose segments are timed)


def prog_fd(prog_id: int) -> int:
    from bcc import libbcc

    fn = libbcc.lib.bpf_prog_get_fd_by_id
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_uint32]
    fd = int(fn(prog_id))
    if fd < 0:
        raise OSError(-fd, f"bpf_prog_get_fd_by_id({prog_id}): {os.strerror(-fd)}")
    return fd


def ifindex(lab: Lab, node: Node, dev: str) -> int:
    out = lab.run(node, "ip", "-j", "link", "show", "dev", dev).stdout
    return int(json.loads(out)[0]["ifindex"])


def cases(node: Node, client: Pod, server: Pod, vip: str, port: int, server_port: int) -> list[_Case]:
    """What pod -> pod connections, a pod -> ClusterIP connection and the node's own traffic look
    like to the programs on the client's and the server's devices: untranslated first."""
    c, s = client.ip, server.ip
    data = b"x" * 64
    base = next(PORTS)
    quiet = server_port + 8000  # a port of the server no Service has: no translated flow uses it
    v6: list[_Case] = []
    if client.ip6 and server.ip6:
        c6, s6 = client.ip6, server.ip6
        v6 = [
            _Case(
                "ekp_from_pod",
                V6 + "pod -> pod IP, an endpoint no translated flow uses",
                False,
                client.host_iface,
                None,
                lambda n: tcp(c6, s6, 40000, quiet, flags="A", payload=data),
            ),
            _Case(
                "ekp_from_pod",
                V6 + "its answer",
                False,
                server.host_iface,
                None,
                lambda n: tcp(s6, c6, quiet, 40000, flags="A", payload=data),
            ),
            _Case(
                "ekp_egress",
                V6 + "a packet the node forwards to a pod",
                False,
                server.host_iface,
                client.host_iface,
                lambda n: tcp(c6, s6, 40000, quiet, flags="A", payload=data),
            ),
        ]
    return [
        _Case(
            "ekp_from_pod",
            "pod -> pod IP, an endpoint no translated flow uses",
            False,
            client.host_iface,
            None,
            lambda n: tcp(c, s, 40000, quiet, flags="A", payload=data),
        ),
        _Case(
            "ekp_from_pod",
            "its answer",
            False,
            server.host_iface,
            None,
            lambda n: tcp(s, c, quiet, 40000, flags="A", payload=data),
        ),
        _Case(
            "ekp_from_pod",
            "pod -> pod IP, a backend live ClusterIP flows use",
            False,
            client.host_iface,
            None,
            lambda n: tcp(c, s, 40002, server_port, flags="A", payload=data),
        ),
        _Case(
            "ekp_from_pod",
            "its answer (looked up: it may be a reply of theirs)",
            False,
            server.host_iface,
            None,
            lambda n: tcp(s, c, server_port, 40002, flags="A", payload=data),
        ),
        _Case(
            "ekp_egress",
            "a packet the node forwards to a pod",
            False,
            server.host_iface,
            client.host_iface,
            lambda n: tcp(c, s, 40000, quiet, flags="A", payload=data),
        ),
        _Case(
            "ekp_egress",
            "the node's own packet to a pod",
            False,
            server.host_iface,
            "",
            lambda n: tcp(node.ip, s, 40001, quiet, flags="A", payload=data),
        ),
        *v6,
        _Case(
            "ekp_from_pod",
            "pod -> ClusterIP, a new flow (SYN)",
            True,
            client.host_iface,
            None,
            lambda n: tcp(c, vip, base + 1 + n, port),
        ),
        _Case(
            "ekp_from_pod",
            "pod -> ClusterIP, a segment of a flow (conntrack hit)",
            True,
            client.host_iface,
            None,
            lambda n: tcp(c, vip, base, port, flags="A", payload=data),
            setup=tcp(c, vip, base, port),
        ),
    ]


def measure(
    lab: Lab,
    node: Node,
    client: Pod,
    server: Pod,
    vip: str,
    port: int,
    server_port: int,
    *,
    translated: bool = True,
) -> list[PacketCost]:
    """Every case of `cases` (`translated=False`: only those passed untouched, which stamp
    nothing), on the programs attached in `node` now."""
    ids = {p.name: p.id for p in bpfstats.attached_programs(lab, node, hooks=("ingress", "egress"))}
    fds = {name: prog_fd(pid) for name, pid in ids.items() if name in ("ekp_from_pod", "ekp_egress")}
    todo = [c for c in cases(node, client, server, vip, port, server_port) if translated or not c.translated]
    index = {
        d: ifindex(lab, node, d) for d in {c.device for c in todo} | {c.came_in_by or "" for c in todo} if d
    }
    try:
        return run_in_netns(node.ns, lambda: _measure_all(todo, fds, index))
    finally:
        for fd in fds.values():
            os.close(fd)


def _measure_all(cases: list[_Case], fds: dict[str, int], index: dict[str, int]) -> list[PacketCost]:
    os.sched_setaffinity(0, {CPU})  # this thread only: it lives for this measurement
    out: list[PacketCost] = []
    # the per-call figure of the first (untouched) case, and its loop figure: the baseline a
    # translated case's per-call figure is brought back to a loop figure with
    baseline: tuple[float, float] | None = None
    for case in cases:
        fd, dev = fds[case.program], index[case.device]
        came_in_by = None if case.came_in_by is None else index.get(case.came_in_by, 0)
        if case.setup is not None:
            prog_run_timed(fd, case.setup, dev, came_in_by)
        if not case.translated:
            frame = case.frames(0)
            loops = []
            for _ in range(ROUNDS):
                verdict, ns = prog_run_timed(fd, frame, dev, came_in_by, REPEAT)
                if verdict != TC_ACT_OK:
                    raise RuntimeError(
                        f"{case.program}, {case.traffic}: verdict {verdict}, expected it passed"
                    )
                loops.append(float(ns))
            loop = statistics.median(loops)
            if baseline is None:
                baseline = (_per_call(case.frames, fd, dev, came_in_by), loop)
            out.append(PacketCost(case.program, case.traffic, False, loop))
            continue
        assert baseline is not None, "a passed case comes first"
        per_call = _per_call(case.frames, fd, dev, came_in_by)
        out.append(PacketCost(case.program, case.traffic, True, per_call - baseline[0] + baseline[1]))
    return out


def _per_call(frames: Callable[[int], bytes], fd: int, dev: int, came_in_by: int | None) -> float:
    """Median over ROUNDS of the mean of ONE_AT_A_TIME single-run calls (frame n of call n)."""
    n = 0
    rounds = []
    for _ in range(ROUNDS):
        total = 0
        for _ in range(ONE_AT_A_TIME):
            total += prog_run_timed(fd, frames(n), dev, came_in_by)[1]
            n += 1
        rounds.append(total / ONE_AT_A_TIME)
    return statistics.median(rounds)
