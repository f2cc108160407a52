"""Command line for the lab.

python -m lab cleanup [--prefix ekpXXXXXX] [--dry-run]
    Remove what killed runs left: namespaces `ekp<6 hex>-*` (their processes killed first),
    lab cgroups, bpffs pins /sys/fs/bpf/ebpf-kube-proxy-lab-ekp*, tmp dirs `ekp<6 hex>-*`, and
    without --prefix the `ekp-scratch-*` staging dirs of killed runs. Prints each item. A lab
    whose owner still runs (a test run beside it, `python -m lab up`) is left whole, and named;
    so is a live scratch namespace's xtables lock dir.
python -m lab up [--nodes 2] [--pods 2] [--no-servers]
    Build a lab, start podservers (and dnsmasq on the first pod of each node), print how to reach
    it, and wait for Ctrl-C (or SIGTERM), then tear it down.
"""

from __future__ import annotations

import argparse
import sys
import threading

from .core import Lab
from .netns import cleanup_leftovers, live_prefixes


def _cleanup(args: argparse.Namespace) -> int:
    for prefix, pid in sorted(live_prefixes(args.prefix).items()):
        print(f"left lab {prefix}: its owner, pid {pid}, still runs")
    removed = cleanup_leftovers(args.prefix, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for item in removed:
        print(f"{verb} {item}")
    if not removed:
        print("nothing to clean up")
    return 0


def _up(args: argparse.Namespace) -> int:
    with Lab(nodes=args.nodes, pods_per_node=args.pods) as lab:
        if not args.no_servers:
            lab.start_podservers()
            for node in lab.nodes:
                if node.pods:
                    lab.start_dns(node.pods[0])
        print(lab.describe())
        print(f"built in {lab.build_seconds:.2f}s")
        if lab.pods:
            p = lab.pods[0]
            print("\ntry:")
            print(f"  ip netns exec {lab.client.ns} curl -s http://{lab.nodes[0].ip}:8080/")
            print(f"  ip netns exec {p.ns} curl -s http://{lab.pods[-1].ip}:8080/")
            print(f"  ip netns exec {p.ns} dig @{p.ip} whoami.lab TXT +short")
        print("\nCtrl-C to tear down", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print("\ntearing down", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m lab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cleanup", help="remove leftovers of killed lab runs")
    c.add_argument("--prefix", help="only this lab prefix (ekp + 6 hex digits)")
    c.add_argument("--dry-run", action="store_true")
    u = sub.add_parser("up", help="build a lab and wait for Ctrl-C")
    u.add_argument("--nodes", type=int, default=2)
    u.add_argument("--pods", type=int, default=2, help="pods per node")
    u.add_argument("--no-servers", action="store_true")
    args = ap.parse_args(argv)
    return _cleanup(args) if args.cmd == "cleanup" else _up(args)


if __name__ == "__main__":
    sys.exit(main())
