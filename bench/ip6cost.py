"""Where iptables mode's IPv6 new connection pays more than IPv4's at many Services (issue 20).

A standalone tool, not part of `make bench`: it needs root, `perf` (for --perf-seconds) and
iptables-legacy beside iptables-nft. Three network namespaces of our own, named as the lab's
(`ekp<6 hex>-pod`, `-srv`, and the node's `ekp<6 hex>-node-<8 hex>` with an xtables lock of its
own; deleted at the end, a killed run's by `python -m lab cleanup`): the node holds our iptables
mode's rules for `n_services` TCP Services of each family (the IptablesProxier, kube-proxy's
layout; bench/iptables_restore.py's synthetic state without NodePorts, the last Service's one
endpoint the server), forwards between a pod and a server. The pod connects to the last
Service's ClusterIP of each family (one connection at a time, closed with a RST, as
bench/probe.py's), so each new connection's first packet walks the whole nat KUBE-SERVICES chain
in PREROUTING. The rules are synced once with the nft backend, measured, then moved byte for byte
to the legacy backend (`to_legacy`) and measured again.

    python -m bench.ip6cost [--services N] [--seconds S] [--perf-seconds S --perf-dir DIR]

prints one JSON object: per backend and family two runs' conn/s (connections / the client loop's
seconds) and connect p50 in µs; with --perf-seconds, a `perf record -a -g` of that many seconds
during a further run of each family's client, its report (the client's process only) written to
DIR, with the head of each family's nat KUBE-SERVICES as nft lists it.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from agent.config import Config, Mode, NodeContext
from agent.iptables.proxier import IptablesProxier
from agent.model.types import Endpoint, IPFamily, ProxyState
from bench.iptables_restore import synthetic_state
from lab.netns import delete_netns, ip_batch, new_prefix, scratch_netns

# bench/probe.py's connection (SO_LINGER 0: a RST, no TIME_WAIT), timed by the loop itself so
# the interpreter's start-up is not in the rate. "up" on stderr after the first connection: what
# `profile` waits for before it records.
CLIENT = (
    "import json, socket, struct, sys, time\n"
    "addr, secs = sys.argv[1], float(sys.argv[2])\n"
    "fam = socket.AF_INET6 if ':' in addr else socket.AF_INET\n"
    "rst = struct.pack('ii', 1, 0)\n"
    "lat, errors = [], 0\n"
    "start = time.perf_counter(); end = start + secs\n"
    "while time.perf_counter() < end:\n"
    "    with socket.socket(fam, socket.SOCK_STREAM) as s:\n"
    "        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, rst); s.settimeout(2.0)\n"
    "        t = time.perf_counter_ns()\n"
    "        try:\n"
    "            s.connect((addr, 80))\n"
    "        except OSError:\n"
    "            errors += 1; continue\n"
    "        lat.append(time.perf_counter_ns() - t)\n"
    "        if len(lat) == 1:\n"
    "            sys.stderr.write('up\\n'); sys.stderr.flush()\n"
    "json.dump({'n': len(lat), 'secs': time.perf_counter() - start,"
    " 'ns': sorted(lat)[len(lat) // 2] if lat else None, 'errors': errors}, sys.stdout)\n"
)
# Exits when its stdin closes: this process holds the other end, so a run killed by any signal
# leaves no server accepting for ever in a namespace `python -m lab cleanup` is about to remove.
SERVER = (
    "import os, socket, sys, threading\n"
    "def _orphaned():\n"
    "    sys.stdin.buffer.read(); os._exit(0)\n"
    "threading.Thread(target=_orphaned, daemon=True).start()\n"
    "s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)\n"
    "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('::', int(sys.argv[1]) if len(sys.argv) > 1 else 8080)); s.listen(4096)\n"
    "while True:\n"
    "    s.accept()[0].close()\n"
)
# family -> (service base, pod, node side of the pod link, node side of the server link, server)
ADDRS = {
    IPFamily.IPv4: ("10.96.0.0", "10.244.1.2", "10.244.1.1", "10.244.2.1", "10.244.2.2", 24),
    IPFamily.IPv6: (
        "fd00:10:96::",
        "fd00:10:244:1::2",
        "fd00:10:244:1::1",
        "fd00:10:244:2::1",
        "fd00:10:244:2::2",
        64,
    ),
}
CONFIG = Config(mode=Mode.IPTABLES, hostname="node1", cluster_cidr=("10.244.0.0/16", "fd00:10:244::/56"))
NODES = {
    IPFamily.IPv4: NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11"),
    IPFamily.IPv6: NodeContext(node_ips=("fd00:192:168::11",), primary_ip="fd00:192:168::11"),
}


def state(family: IPFamily, n_services: int) -> ProxyState:
    """`n_services` single-port TCP Services, two remote endpoints each (bench/iptables_restore.py's,
    without NodePorts); the last one's one endpoint the server. Names padded to the count's width:
    the last Service's ClusterIP rule is then the last of KUBE-SERVICES, the one measured."""
    server = Endpoint(ip=ADDRS[family][4], port=8080, node_name="node1")
    return synthetic_state(n_services, family=family, last_endpoint=server, pad=True, node_ports=False)


def last_cluster_ip(family: IPFamily, n_services: int) -> str:
    return str(ipaddress.ip_address(int(ipaddress.ip_address(ADDRS[family][0])) + n_services))


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True)


def in_ns(ns: str, *argv: str) -> None:
    sh("ip", "netns", "exec", ns, *argv)


def build(pod: str, node: str, srv: str, created: list[str]) -> None:
    """`node` exists (scratch_netns's); `pod` and `srv` are added here, each appended to `created`
    once it exists, so that a failed `ip netns add` (a name taken) deletes nobody else's."""
    for ns in (pod, srv):
        sh("ip", "netns", "add", ns)
        created.append(ns)
    lines: dict[str, list[str]] = {ns: ["link set lo up"] for ns in (pod, node, srv)}
    lines[node] += [
        f"link add tp type veth peer name eth0 netns {pod}",
        f"link add ts type veth peer name eth0 netns {srv}",
    ]
    for family, (_b, p_addr, n_p, n_s, s_addr, plen) in ADDRS.items():
        nodad = " nodad" if family is IPFamily.IPv6 else ""
        lines[pod].append(f"addr add {p_addr}/{plen} dev eth0{nodad}")
        lines[node] += [f"addr add {n_p}/{plen} dev tp{nodad}", f"addr add {n_s}/{plen} dev ts{nodad}"]
        lines[srv].append(f"addr add {s_addr}/{plen} dev eth0{nodad}")
    lines[node] += ["link set tp up", "link set ts up"]
    for ns, via in ((pod, 2), (srv, 3)):
        lines[ns].append("link set eth0 up")
        lines[ns] += [f"route add default via {addrs[via]}" for addrs in ADDRS.values()]
    ip_batch(lines[node], node)  # first: it makes the veths the others' lines address
    for ns in (pod, srv):
        ip_batch(lines[ns], ns)
    in_ns(node, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1")


def probe(pod: str, addr: str, seconds: float) -> tuple[float, float, int]:
    """(conn/s over the wall time, p50 connect µs, errors)."""
    out = subprocess.run(
        ["ip", "netns", "exec", pod, sys.executable, "-I", "-S", "-c", CLIENT, addr, str(seconds)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return parse_probe(out, addr, seconds)


def parse_probe(out: str, addr: str, seconds: float) -> tuple[float, float, int]:
    got = json.loads(out)
    if got["ns"] is None:
        raise SystemExit(
            f"ip6cost: no connection to {addr}:80 succeeded in {seconds} s ({got['errors']} failed): "
            "is the server up and the node's rules synced? (the namespaces are deleted on exit)"
        )
    return int(got["n"]) / float(got["secs"]), int(got["ns"]) / 1000, int(got["errors"])


def profile(pod: str, addr: str, seconds: float, perf_seconds: float, out: Path) -> None:
    """A system-wide `perf record -a -g` of `perf_seconds` while the probe runs `seconds`; the
    report keeps the client's own process (its connect() runs the SYN through the veths, the
    node's netfilter hooks included, in its own softirq context), not the other work the machine
    is doing."""
    client = subprocess.Popen(
        ["ip", "netns", "exec", pod, sys.executable, "-I", "-S", "-c", CLIENT, addr, str(seconds)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    data = out.with_suffix(".data")
    try:
        assert client.stderr is not None
        # The first connection made: past the client's start-up, into its steady connect loop.
        if client.stderr.readline() != "up\n":
            raise SystemExit(f"ip6cost: the profiled client never connected to {addr}:80")
        sh("perf", "record", "-q", "-a", "-g", "-o", str(data), "--", "sleep", str(perf_seconds))
        report = subprocess.run(
            [
                "perf",
                "report",
                "-i",
                str(data),
                "--pid",
                str(client.pid),
                "--no-children",
                "--percentage",
                "relative",
                "--sort",
                "symbol",
                "--stdio",
                "-g",
                "none",
                "--percent-limit",
                "0.3",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        out.write_text(report)
    finally:
        data.unlink(missing_ok=True)  # system-wide call graphs: hundreds of MB
        client.wait(timeout=seconds + 30)


def to_legacy(node: str) -> None:
    """The same rules, byte for byte, moved from the nft backend to the legacy one (a save
    restored), rather than a second 10,000-Service sync: the layout stays what we wrote. `-w`:
    the lock is the run's own (scratch_netns's XTABLES_LOCKFILE), never the host-wide one."""
    for tool in ("iptables", "ip6tables"):
        save = subprocess.run(
            ["ip", "netns", "exec", node, f"{tool}-nft-save"], check=True, capture_output=True
        )
        text = save.stdout.decode()
        restore = f"{tool}-legacy-restore"
        subprocess.run(["ip", "netns", "exec", node, restore, "-w", "5"], input=text, check=True, text=True)
    in_ns(node, "nft", "flush", "ruleset")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--perf-seconds", type=float, default=0.0)
    ap.add_argument("--perf-dir", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    # The lab's names (`ekp<6 hex>-<role>`): a killed run's namespaces are `python -m lab
    # cleanup`'s to remove. The node's is scratch_netns's, for its xtables lock of its own.
    prefix = new_prefix()
    pod, srv = f"{prefix}-pod", f"{prefix}-srv"
    result: dict[str, object] = {"services": args.services, "netns": prefix}
    created: list[str] = []
    server = None
    with scratch_netns(f"{prefix}-node") as node:
        try:
            build(pod, node, srv, created)
            server = subprocess.Popen(
                ["ip", "netns", "exec", srv, sys.executable, "-c", SERVER], stdin=subprocess.PIPE
            )
            run(args, pod, node, result)
        finally:
            if server is not None:
                server.terminate()
                server.wait()
            delete_netns(created)
    print(json.dumps(result))
    return 0


def run(args: argparse.Namespace, pod: str, node: str, result: dict[str, object]) -> None:
    for family in (IPFamily.IPv4, IPFamily.IPv6):
        p = IptablesProxier(replace(CONFIG, netns=node, iptables_backend="nft"), family=family)
        p.sync(state(family, args.services), NODES[family])
    for family in (IPFamily.IPv4, IPFamily.IPv6):
        # Unmeasured: a fresh namespace's first IPv6 SYN waited a retransmit (1 s) once, which
        # a short run's conn/s would carry.
        probe(pod, last_cluster_ip(family, args.services), 0.5)
    for backend in ("nft", "legacy"):
        if backend == "legacy":
            to_legacy(node)
        elif args.perf_seconds:  # the chains beside the profiles, in --perf-dir
            for table in ("ip", "ip6"):
                chain = subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        node,
                        "nft",
                        "-a",
                        "list",
                        "chain",
                        table,
                        "nat",
                        "KUBE-SERVICES",
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                head = "\n".join(chain.splitlines()[:8])
                (args.perf_dir / f"nft-{table}-kube-services-head.txt").write_text(head)
        runs: dict[str, list[dict[str, float]]] = {}
        for family in (IPFamily.IPv4, IPFamily.IPv6, IPFamily.IPv4, IPFamily.IPv6):
            rate, p50, errors = probe(pod, last_cluster_ip(family, args.services), args.seconds)
            runs.setdefault(f"ipv{int(family)}", []).append(
                {"conn_s": round(rate), "p50_us": round(p50, 1), "errors": errors}
            )
            # Said as it is measured: a run cut short still leaves what it measured.
            print(backend, family.name, runs[f"ipv{int(family)}"][-1], file=sys.stderr, flush=True)
        result[backend] = runs
        if args.perf_seconds:
            for family in (IPFamily.IPv4, IPFamily.IPv6):
                out = args.perf_dir / f"perf-{backend}-ipv{int(family)}-{args.services}.txt"
                addr = last_cluster_ip(family, args.services)
                profile(pod, addr, args.perf_seconds + 3, args.perf_seconds, out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
