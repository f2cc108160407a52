"""What a SYN that opens a source-translated flow costs, by how far the SNAT port walk goes.

    python -m bench.snatcost [--syns 3000] [--rounds 3]

Only such a packet runs the walk (bpf/ekp_snat.h), which bench/progcost.py's lab never does (its
backend is on the node, untranslated). Here the packet lab of the data-path tests (lab/dplab.py)
holds a NodePort to a backend on another node with SNAT_ALL, and `ekp_from_net` runs SYNs from new
client ports one BPF_PROG_TEST_RUN call at a time (a translated packet cannot be repeated in one
call), on CPU 0:

* **free range**: the first probed port is free (one lookup), then the flow's two entries are
  inserted;
* **full range of 64**: the range is cut to 64 ports, all held by unanswered flows (64 SYNs
  first), so each SYN probes all 64 and takes an unanswered flow's port (early drop).

Per round, the median and mean ns per call. Compare two trees by running this from each, one after
the other: the figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Iterable, Sequence

from agent.ebpf.abi import FrontendFlag, Scope
from lab.dplab import CLIENT, NODE, REMOTE_BE, SIZES, SNAT_MIN, Lab, Net, packet_lab, reset_maps, set_config
from lab.packets import loaded_datapath, prog_run_timed, tcp

NODEPORT = 30080
FULL_RANGE = 64


def _syns(net: Net, lab: Lab, client_ports: Iterable[int]) -> list[int]:
    fd = net.dp.prog_fd("ekp_from_net")
    return [prog_run_timed(fd, tcp(CLIENT, NODE, p, NODEPORT), lab.ext.ifindex)[1] for p in client_ports]


def _nodeport(net: Net) -> None:
    net.add_service(
        NODE, NODEPORT, ((7, REMOTE_BE, 8080, 0),), scope=Scope.EXTERNAL, flags=FrontendFlag.SNAT_ALL
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.snatcost", description=__doc__.split("\n\n")[0])
    p.add_argument("--syns", type=int, default=3000, help="SYNs per case and round (default 3000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ns = p.parse_args(argv)
    os.sched_setaffinity(0, {0})
    with loaded_datapath(SIZES) as dp, packet_lab() as lab:
        net = Net(dp, lab)
        for rnd in range(ns.rounds):
            reset_maps(dp)
            _nodeport(net)
            cases = [("free range", _syns(net, lab, range(10000, 10000 + ns.syns)))]
            reset_maps(dp)
            set_config(dp, snat_port_max=SNAT_MIN + FULL_RANGE - 1)
            _nodeport(net)
            _syns(net, lab, range(20000, 20000 + FULL_RANGE))  # every port held, unanswered
            cases.append((f"full range of {FULL_RANGE}", _syns(net, lab, range(30000, 30000 + ns.syns))))
            for label, times in cases:
                print(
                    f"round {rnd} {label}: median {statistics.median(times):.0f} ns, "
                    f"mean {statistics.mean(times):.0f} ns over {len(times)} SYNs",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
