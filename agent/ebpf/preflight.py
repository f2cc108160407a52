"""What eBPF mode needs from the machine, checked before the first sync and before anything is created.

Each missing piece becomes one sentence saying what is wrong and what to do, so an operator reads
"install python3-bpfcc" at start-up instead of a traceback repeated by the sync retry loop. None
of these is fixed by retrying, so `require` turns the errors into one `FatalError`. The pin path
is checked here, before the loader creates it: it must be on a bpf filesystem (or under
/sys/fs/bpf, which the loader mounts when it is missing), and what exists of it must be ours
(agent/ebpf/pindir.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
from dataclasses import dataclass, field

from agent.config import DEFAULT_PIN_PATH
from agent.ebpf.loader import BPFFS_ROOT, fs_type
from agent.ebpf.pindir import pin_dir_problems
from agent.ebpf.programs import MIN_KERNEL, kernel_version
from agent.errors import FatalError

log = logging.getLogger(__name__)


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
    found += kernel_problems(platform.release())
    found += toolchain_problems()
    if not pin_path.startswith("/"):
        found.append(f"--bpf-pin-path must be absolute, got {pin_path!r}")
    else:
        found += pin_path_problems(pin_path)
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        out.warnings.append("the kernel has no BTF (/sys/kernel/btf/vmlinux): bpftool dumps lack field names")
    return out


def kernel_problems(release: str) -> list[str]:
    """Why the data path cannot load on kernel `release` ([] when it can)."""
    if kernel_version(release) >= MIN_KERNEL:
        return []
    need = ".".join(map(str, MIN_KERNEL))
    return [
        f"the kernel is {release}, and the data path needs Linux {need} or later (its tc route "
        f"lookup's MTU answer): upgrade the node's kernel to {need}+, or run --mode=iptables"
    ]


def toolchain_problems() -> list[str]:
    """What bcc needs to compile the data path here, each as "what is wrong: what to do"."""
    found: list[str] = []
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
    return found


def pin_path_problems(pin_path: str) -> list[str]:
    """Why maps cannot be pinned at `pin_path` ([] when they can); looks, creates nothing."""
    real = os.path.realpath(pin_path)
    under_root = real == BPFFS_ROOT or real.startswith(BPFFS_ROOT + "/")
    fstype = fs_type(real)
    if fstype != "bpf" and not (under_root and fs_type(BPFFS_ROOT) != "bpf"):
        return [
            f"--bpf-pin-path {pin_path} is not on a bpf filesystem (it is on {fstype or 'nothing known'}): "
            f"pinned maps can only live on bpffs. Use a directory under {BPFFS_ROOT} (the default is "
            f"{DEFAULT_PIN_PATH}), or mount one first: mount -t bpf bpf DIR"
        ]
    return pin_dir_problems(pin_path)


def require(pin_path: str) -> None:
    """Log the warnings of `check`; raise FatalError with every error in one message."""
    findings = check(pin_path)
    for text in findings.warnings:
        log.warning("%s", text)
    if findings.errors:
        raise FatalError("eBPF mode cannot start: " + "; ".join(findings.errors))
