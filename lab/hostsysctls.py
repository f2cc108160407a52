"""The machine's own (initial network namespace) sysctls that the agent's node set-up can write.

No test may change them: every lab node, and every agent a test starts, has its own namespace. A
test that lets an agent's set-up run in the machine's namespace instead (`Config.netns == ""` with
the real runner: `agent.nodeinit.init_node`, `setup_conntrack` at every start, the eBPF proxier's
`ip_forward`) changes them for the rest of the machine, and, since a new namespace inherits IPv4's
settings from the initial one (`net.core.devconf_inherit_init_net = 0`), for every namespace made
after it: later tests then pass or fail by the order they ran in.

The keys are taken from the agent's own code: `required_sysctls` of both modes (the iptables
proxier's route_localnet among them), the conntrack `plan` with every setting on, the eBPF
proxier's `SYSCTLS` and the hand-over's `TCP_BE_LIBERAL`; IPv6 forwarding is added by hand (the
packet labs set it in their namespaces). A new writer elsewhere needs its key added here. Of
these, `ip_forward`, `conf.all.*`, `nf_conntrack_max` and the hash size reach later labs (a new
namespace inherits IPv4's settings from the initial one; the conntrack limit is global); the others
are per namespace, and a change there is evidence of a leak alone.

`Machine()`, made when the run starts, holds the run's own namespace (the machine's: PID 1's
cannot be opened from here, EACCES in this VM's sandbox); its `snapshot()` reads them there from
any thread. `changed(before, after)` names the differences.
"""

from __future__ import annotations

import os

from agent.config import Config, ConntrackSettings, Mode
from agent.ebpf.proxier import SYSCTLS
from agent.iptables.conntrack_sysctls import HASHSIZE_PATH, plan
from agent.nodeinit import required_sysctls
from agent.takeover.into_ebpf import TCP_BE_LIBERAL
from lab.netns import in_netns_fd

# Written by the lab's own packet tests in their namespaces, never by the agent: watched all the same.
EXTRA_KEYS = ("net.ipv6.conf.all.forwarding",)


def watched_keys() -> list[str]:
    """Every sysctl key the node set-up can write in either mode, plus EXTRA_KEYS; sorted."""
    keys = {key for mode in Mode for key, _ in required_sysctls(Config(mode=mode))}
    every = ConntrackSettings(
        max_per_core=1,
        min=1,
        tcp_established_timeout_s=1,
        tcp_close_wait_timeout_s=1,
        tcp_be_liberal=True,
        udp_timeout_s=1,
        udp_stream_timeout_s=1,
    )
    keys |= {setting.key for setting in plan(every, 1)}
    keys |= {path.replace("/", ".") for path in (*SYSCTLS, TCP_BE_LIBERAL)}
    keys |= set(EXTRA_KEYS)
    return sorted(keys)


def read_values(keys: list[str]) -> dict[str, str]:
    """The keys (and the hash size) as the calling thread's network namespace has them."""
    out: dict[str, str] = {}
    paths = {key: "/proc/sys/" + key.replace(".", "/") for key in keys} | {HASHSIZE_PATH: HASHSIZE_PATH}
    for key, path in paths.items():
        try:
            with open(path, encoding="ascii") as f:
                out[key] = f.read().strip()
        except OSError as exc:  # a module not loaded (nf_conntrack, ipv6): compared as such
            out[key] = f"<unreadable: {exc.strerror}>"
    return out


class Machine:
    """The network namespace the calling thread is in when made (the test run's, the machine's
    own), held open so that it is read there later from any thread: the main thread itself may
    have joined a packet lab's namespace by then (lab/packets.py private_netns), and
    /proc/<pid>/ns/net follows it."""

    def __init__(self) -> None:
        self._fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._ino = os.fstat(self._fd).st_ino
        self.keys = watched_keys()

    def close(self) -> None:
        os.close(self._fd)

    def snapshot(self) -> dict[str, str]:
        """The watched values as that namespace has them (/proc/sys/net follows the reading
        thread's namespace: from another one the read runs on a thread that joined it)."""
        if os.stat("/proc/thread-self/ns/net").st_ino == self._ino:
            return read_values(self.keys)  # already there: no setns, so no root needed
        return in_netns_fd(self._fd, lambda: read_values(self.keys), name="host-sysctls")


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """`key: before -> after` for each watched value that differs. A key that was unreadable and
    now reads is not a change: its module (nf_conntrack, ipv6) was loaded by the first lab that
    needed it, on a kernel that has them as modules."""
    return [
        f"{key}: {before.get(key, '?')} -> {after.get(key, '?')}"
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key) and not before.get(key, "").startswith("<unreadable")
    ]
