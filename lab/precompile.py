"""Compile the data path into the machine's compile cache ahead of the tests.

`scripts/test.sh` starts it while the virtualenv is made and filled (pip keeps one CPU busy, the
other idles), by path and with the system's Python: it needs only the standard library, bcc and
the agent's `agent.ebpf` modules, none of the virtualenv's packages, so it runs before they are
installed. Every packet-lab module (tests/ebpf/test_datapath*.py and their kin, `lab.dplab.SIZES`)
and every lab agent (IPv4-only or dual-stack, any sizes but the Maglev table size) loads that one
build (map sizes and the programs loaded are chosen at load: agent/ebpf/loader.py compile_cflags;
tests/test_precompile.py checks the packet lab's sizes give this build), so its compile, the first
thing the first of them would wait for in a fresh clone, is done by then, or under way and waited
for on the cache entry's lock (`ObjectCache.compiling`), never done twice. A build already in the
cache costs nothing. Prints one line; exits 0 unless the compile failed (the tests would then fail
on it with the compiler's message).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    # Run by path (`python3 lab/precompile.py`): the repository's root, not lab/, on the path; the
    # lab package itself is never imported (it needs the virtualenv's pyroute2).
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from agent.config import MapSizes
from agent.ebpf.compile import compile_in_child
from agent.ebpf.loader import Datapath
from agent.ebpf.programs import PROGRAMS

# Any sizes but the Maglev table's give the build: the defaults, as the packet lab's and the
# agents' (their Maglev table is the default too).
SIZES = MapSizes()
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
