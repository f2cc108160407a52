"""`agent inspect`: decode what a node's pinned BPF maps hold, without the running agent.

`maps` prints the same lines as `agent --mode=ebpf --dry-run`, so a live node can be diffed against
the plan for a services file (`maps6`: the IPv6 maps the socket programs read); `conntrack`,
`affinity` and `stats` show flows, sticky clients and the data path's counters (drops by reason
included); `capacity` shows how full every map is, and how many conntrack entries are live
(agent/ebpf/capacity.py); `sockets` shows the socket programs' settings, their cgroup links and
which sockets were sent to which backend; `hooks` shows which programs each device's tc hooks run,
in the kernel's order, whichever way they were attached (tcx links, listed first since they run
first, then clsact filters: `--bpf-tc-attach`), read from the devices, not the pins. Reads only;
needs root for the bpf() syscall.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from agent.config import DEFAULT_PIN_PATH

SECTIONS = {
    "maps": "services",
    "maps6": "services6",
    "conntrack": "ct",
    "affinity": "aff",
    "stats": "stats",
    "capacity": "capacity",
    "maglev": "maglev",
    "sockets": "sockets",
}
HOOKS = "hooks"  # not a map: the devices' tc hooks (agent/ebpf/attach.py hooks_report)

EPILOG = """\
examples:
  agent inspect maps                 frontends, slots, backends, reverse NAT, source ranges, config
  agent inspect maps6                the same for IPv6 Services (fe6, slot6, be6, ...: the maps the
                                     socket programs translate IPv6 connections with)
  agent inspect conntrack            every tracked flow: tuple, direction, rewrite, backend, age
  agent inspect stats                packets, flows, SNAT, affinity hits, drops by reason,
                                     conntrack evictions by state, fragments held and released;
                                     the XDP program's counters beside the tc programs' (xdp ...)
  agent inspect maglev               each Maglev table: its frontends, every backend's share, the
                                     first positions, a digest to compare nodes by
  agent inspect capacity             entries / capacity of every map, live conntrack entries by
                                     state (assured, unassured, closed), early drops by state
  agent inspect sockets              socket programs: settings, cgroup links, sockets sent to backends
                                     (sock6 lines: IPv6 sockets)
  agent inspect hooks                every device's tc ingress and egress hooks: the programs they
                                     run, in order (tcx: program and link ids, as `bpftool link`
                                     lists them, type 11 or tcx; clsact: the filter's priority)
  agent inspect maps conntrack --bpf-pin-path /sys/fs/bpf/ebpf-kube-proxy-node2
  agent inspect hooks --netns node2  the hooks of the devices of another network namespace
"""


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="agent inspect",
        description="Decode the pinned BPF maps of ebpf-kube-proxy on this node.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "what",
        nargs="*",
        choices=sorted([*SECTIONS, HOOKS]),
        default=["maps"],
        help="what to show (default: maps)",
    )
    p.add_argument("--bpf-pin-path", default=DEFAULT_PIN_PATH, help="bpffs directory of the agent's pins")
    p.add_argument("--netns", default="", help="network namespace of the devices (hooks; default: this one)")
    args = p.parse_args(argv)
    from agent.ebpf.proxier import render_live_maps

    try:
        sections = [SECTIONS[w] for w in args.what if w != HOOKS]
        text = render_live_maps(args.bpf_pin_path, sections) if sections else ""
        if HOOKS in args.what:
            text += _hooks(args.netns)
    except FileNotFoundError as exc:
        print(f"agent inspect: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    except PermissionError as exc:
        print(f"agent inspect: {exc} (reading BPF maps needs root)", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


def _hooks(netns: str) -> str:
    from agent.ebpf.attach import hooks_report
    from agent.netns import netns_route

    with netns_route(netns) as ipr:
        lines = hooks_report(ipr, netns)
    return "".join(f"hook {line}\n" for line in lines) or "hook none: no device runs a tc program\n"
