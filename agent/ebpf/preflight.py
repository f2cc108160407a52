"""What eBPF mode needs from the machine, checked before the first sync.

Each missing piece becomes one sentence saying what is wrong and what to do, so an operator reads
"install python3-bpfcc" at start-up instead of a traceback repeated by the sync retry loop.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from dataclasses import dataclass, field


@dataclass
class Findings:
    errors: list[str] = field(default_factory=list)  # eBPF mode cannot start
    warnings: list[str] = field(default_factory=list)  # it works, an operator sees less


def check(pin_path: str) -> Findings:
    """Everything that would stop or degrade eBPF mode, each with its remedy."""
    out = Findings()
    found = out.errors
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
    if not pin_path.startswith("/"):
        found.append(f"--bpf-pin-path must be absolute, got {pin_path!r}")
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        out.warnings.append("the kernel has no BTF (/sys/kernel/btf/vmlinux): bpftool dumps lack field names")
    return out
