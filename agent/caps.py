"""The agent's effective Linux capabilities, read from /proc/self/status.

Root is not the question the kernel asks: a root process in a container without NET_ADMIN cannot
write iptables rules, and a non-root process with the capabilities can. Pre-flight checks ask for
the capability each mode needs and name it in the message.
"""

from __future__ import annotations

CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
CAP_BPF = 39

NAMES = {CAP_NET_ADMIN: "CAP_NET_ADMIN", CAP_SYS_ADMIN: "CAP_SYS_ADMIN", CAP_BPF: "CAP_BPF"}


def parse_effective(status_text: str) -> int:
    """The CapEff bit mask from the text of /proc/<pid>/status (0 when the line is missing)."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split(":", 1)[1].strip(), 16)
    return 0


def effective() -> int:
    with open("/proc/self/status") as f:
        return parse_effective(f.read())


def missing(wanted: tuple[int, ...], mask: int) -> list[str]:
    """Names of the capabilities of `wanted` that `mask` lacks, in the order given."""
    return [NAMES.get(cap, f"capability {cap}") for cap in wanted if not mask & (1 << cap)]
