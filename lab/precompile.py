"""Compile the data path into the machine's compile cache ahead of the tests.

`scripts/test.sh` starts it beside the lint step (mypy keeps one CPU busy, the other idles): every
packet-lab module (tests/ebpf/test_datapath*.py and their kin, `lab.dplab.SIZES`) and every lab
agent (IPv4-only or dual-stack, any sizes but the Maglev table size) loads that one build (map
sizes and the programs loaded are chosen at load: agent/ebpf/loader.py compile_cflags), so its
compile, the first thing the first of them would wait for in a fresh clone, is done by then, or
under way and waited for on the cache entry's lock (`ObjectCache.compiling`), never done twice.
A build already in the cache costs nothing. Prints one line; exits 0 unless the compile failed
(the tests would then fail on it with the compiler's message).
"""

from __future__ import annotations

import subprocess
import sys
import time

from agent.ebpf.compile import compile_in_child
from agent.ebpf.loader import Datapath
from agent.ebpf.programs import PROGRAMS
from lab.dplab import SIZES

WHOSE = "the packet lab's and every lab agent's"


def main() -> int:
    started = time.monotonic()
    d = Datapath("/sys/fs/bpf/unused", SIZES)  # nothing is loaded or pinned: the build alone
    build = d.build()
    with d.cache.compiling(build):
        if d.cache.get(build) is not None:
            print(f"precompile: the data path's build {build} ({WHOSE}) is in {d.cache.path} already")
            return 0
        try:
            obj, _ = compile_in_child(
                d.entry_file, d.cflags(), build, {name: spec.prog_type for name, spec in PROGRAMS.items()}
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(
                f"precompile: compiling the data path's build {build} ({WHOSE}) failed: {exc}",
                file=sys.stderr,
            )
            return 1
        d.cache.put(obj)
    print(
        f"precompile: the data path's build {build} ({WHOSE}) compiled in {time.monotonic() - started:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
