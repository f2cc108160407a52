"""What eBPF mode needs from the machine, checked before the first sync.

Each missing piece becomes one sentence saying what is wrong and what to do, so an operator reads
"install python3-bpfcc" at start-up instead of a traceback repeated by the sync retry loop.
"""

from __future__ import annotations

import importlib.util
import os
import platform


def problems(pin_path: str) -> list[str]:
    """Everything that would stop eBPF mode from loading, with the remedy; [] when all is there."""
    found: list[str] = []
    if os.geteuid() != 0:
        found.append("eBPF mode needs root (CAP_BPF, CAP_NET_ADMIN): run the agent as root")
    if importlib.util.find_spec("bcc") is None:
        found.append(
            "the bcc Python module is missing: install Debian's python3-bpfcc (scripts/setup.sh links "
            "it into the virtualenv), or run --mode=iptables"
        )
    build = f"/lib/modules/{platform.release()}/build"
    if not os.path.exists(os.path.join(build, "include")):
        found.append(
            f"no kernel headers at {build}: bcc compiles the data path against them. Install "
            "linux-headers-amd64 and link build/source there (scripts/setup.sh does), or run --mode=iptables"
        )
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        found.append("the kernel has no BTF (/sys/kernel/btf/vmlinux): maps will dump without field names")
    if not pin_path.startswith("/"):
        found.append(f"--bpf-pin-path must be absolute, got {pin_path!r}")
    return found


# Problems that still let eBPF mode work (only degrade what an operator sees).
WARNINGS_PREFIX = ("the kernel has no BTF",)
