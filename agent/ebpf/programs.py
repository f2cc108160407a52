"""The programs of the data path (bpf/ekp_tc.c), how each is loaded and where it attaches. Pure.

* tc: `ekp_from_pod` on the ingress of every pod veth, `ekp_from_net` on the node's external
  devices (each continues IPv6 packets in `ekp_from_pod6` / `ekp_from_net6` by a tail call,
  bpf/ekp_tc6.h, where that path serves: elsewhere those two are not loaded, Datapath.programs),
  `ekp_egress` on the egress of both (the replies of the node's own stack for flows handed to it,
  the source of legacy host routing's flows: agent/ebpf/attach.py; IPv6 continues in `ekp_egress6`
  by a tail call, loaded where `ekp_from_pod6` is); XDP: `ekp_xdp_net` on the same external
  devices, ahead of `ekp_from_net` (agent/ebpf/xdp.py, --bpf-xdp), continuing IPv6 in
  `ekp_xdp_net6` (bpf/ekp_xdp6.h) the same way; neither is loaded with --bpf-xdp=disabled, where
  nothing would run them, nor with best-effort while every external device is a veth (MapSizes.xdp,
  Datapath.programs; agent/ebpf/proxier.py loads them when one that is no veth appears);
* cgroup: the socket programs on `--bpf-socket-lb-cgroup` (agent/ebpf/sockattach.py), each loaded
  for its hook (the kernel wants the hook, `expected_attach_type`, at load);
* an iterator: `ekp_sock_term` (iter/udp) ends connected UDP sockets whose backend left
  (agent/ebpf/sockterm.py). It calls the kernel function bpf_sock_destroy, which bcc 0.26 cannot
  compile a call to: the C calls a marker helper number and the loader patches the call
  (agent/ebpf/kfunc.py), then loads it itself with the iterator's target (`bpf_iter_udp`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# The oldest kernel the data path loads on (agent/doctor/checks.py HELPERS: 5.12, its tc route
# lookup's MTU answer). bpf_loop (5.17) is not needed: where the kernel lacks it the SNAT port
# walk is a bounded loop (agent/ebpf/snatloop.py)
MIN_KERNEL = (5, 12)


def kernel_version(release: str) -> tuple[int, int]:
    """(major, minor) of a kernel release string such as "6.18.0-1-amd64"; (0, 0) if unreadable."""
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


# enum bpf_prog_type
PROG_SCHED_CLS = 3
PROG_XDP = 6
PROG_CGROUP_SOCK = 9
PROG_CGROUP_SOCK_ADDR = 18
PROG_TRACING = 26
# enum bpf_attach_type
ATTACH_CGROUP_INET4_CONNECT = 10
ATTACH_CGROUP_INET6_CONNECT = 11
ATTACH_CGROUP_UDP4_SENDMSG = 14
ATTACH_CGROUP_UDP6_SENDMSG = 15
ATTACH_CGROUP_UDP4_RECVMSG = 19
ATTACH_CGROUP_UDP6_RECVMSG = 20
ATTACH_TRACE_ITER = 28
ATTACH_CGROUP_INET4_GETPEERNAME = 29
ATTACH_CGROUP_INET6_GETPEERNAME = 30
ATTACH_CGROUP_INET_SOCK_RELEASE = 34

# bpf/ekp_sock.h EKP_KFUNC_SOCK_DESTROY: the helper number standing for bpf_sock_destroy
KFUNC_SOCK_DESTROY_MARK = 0x1EA7


@dataclass(frozen=True)
class ProgSpec:
    prog_type: int
    attach_type: int = -1  # expected_attach_type at load; -1: none (tc)
    iter_target: str = ""  # an iterator's target: the kernel's bpf_iter_<target>
    kfuncs: tuple[tuple[int, str], ...] = ()  # (marker helper number, kernel function) to patch in
    # Kernel functions (BTF FUNC names: helpers, kfuncs, iterator targets) the program cannot load
    # without; a kernel lacking one loads the data path without it (available_programs)
    needs: tuple[str, ...] = ()
    # The bpf_loop callback the program passes (a function of the object, bpf/ekp_tc.c), linked into
    # it at load (agent/ebpf/calls.py); "" none: an unresolved reference in it is then an error
    callback: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "type": self.prog_type,
            "attach": self.attach_type,
            "iter": self.iter_target,
            "kfuncs": [list(k) for k in self.kfuncs],
            "callback": self.callback,
        }


PROG_FROM_POD = "ekp_from_pod"
PROG_FROM_NET = "ekp_from_net"
PROG_EGRESS = "ekp_egress"  # tc egress of both kinds of device
PROG_XDP_NET = "ekp_xdp_net"  # XDP of the external devices, ahead of ekp_from_net (--bpf-xdp)
PROG_SOCK_TERM = "ekp_sock_term"
# The IPv6 path of the two ingress programs (bpf/ekp_tc6.h), reached by a tail call, never attached
PROG_FROM_POD6 = "ekp_from_pod6"
PROG_FROM_NET6 = "ekp_from_net6"
# legacy host routing's egress half for IPv6 (bpf/ekp_host6.h), reached from ekp_egress likewise
PROG_EGRESS6 = "ekp_egress6"
# The XDP program's IPv6 path (bpf/ekp_xdp6.h), reached from ekp_xdp_net by a tail call, never attached
PROG_XDP_NET6 = "ekp_xdp_net6"

# Program arrays of the build (BPF_PROG_ARRAY in bpf/ekp_tc.c) and the programs the loader puts in
# them, by index (the C's EKP_CALL6_*). The kernel empties a program array when its last user
# reference goes, so the loader pins each one beside the programs of its build.
# A program array holds programs of one type: XDP's IPv6 path has an array of its own.
TAIL_CALLS: dict[str, tuple[str, ...]] = {
    "ekp_calls6": (PROG_FROM_POD6, PROG_FROM_NET6, PROG_EGRESS6),
    "ekp_xcalls6": (PROG_XDP_NET6,),
}
# Maps of one build that the agent writes (BPF_ARRAY in bpf/ekp_tc.c, not the registry's): pinned
# beside the build's programs, so a reused build is reached through them. ekp_handover: the mode of
# an upgrade's hand-over (struct ekp_handover; agent/ebpf/handover.py).
HANDOVER_MAP = "ekp_handover"
BUILD_MAPS: tuple[str, ...] = (HANDOVER_MAP,)

# The socket programs by hook name, with their attach type. The IPv6 hooks serve IPv4 addresses on
# IPv6 sockets (v4-mapped, ::ffff:a.b.c.d: Java and other dual-stack runtimes dial IPv4 that way).
SOCK_HOOKS: dict[str, tuple[str, int]] = {
    "connect4": ("ekp_sock_conn", ATTACH_CGROUP_INET4_CONNECT),
    "sendmsg4": ("ekp_sock_send", ATTACH_CGROUP_UDP4_SENDMSG),
    "recvmsg4": ("ekp_sock_recv", ATTACH_CGROUP_UDP4_RECVMSG),
    "getpeername4": ("ekp_sock_peer", ATTACH_CGROUP_INET4_GETPEERNAME),
    "connect6": ("ekp_sock_conn6", ATTACH_CGROUP_INET6_CONNECT),
    "sendmsg6": ("ekp_sock_send6", ATTACH_CGROUP_UDP6_SENDMSG),
    "recvmsg6": ("ekp_sock_recv6", ATTACH_CGROUP_UDP6_RECVMSG),
    "getpeername6": ("ekp_sock_peer6", ATTACH_CGROUP_INET6_GETPEERNAME),
    # a closed socket's entry in ekp_sknat goes with it (a cgroup sock program, not sock_addr)
    "sock_release": ("ekp_sock_free", ATTACH_CGROUP_INET_SOCK_RELEASE),
}

# What the socket programs call that older kernels lack: bpf_set_retval (Linux 5.18, refusing a call
# with an errno) and bpf_get_netns_cookie for sock_addr programs (5.7); the iterator bpf_sock_destroy
# (6.5) and the UDP socket iterator (5.9). The sock_release hook (5.9) is older than all of them.
SOCK_NEEDS = ("bpf_set_retval", "bpf_get_netns_cookie_sock_addr")
TERM_NEEDS = ("bpf_sock_destroy", "bpf_iter_udp")
# XDP's IPv6 path reads the header chain with bpf_xdp_load_bytes (Linux 5.18; the data path's
# minimum is 5.12, MIN_KERNEL): without it ekp_xcalls6 stays empty and IPv6 goes on from XDP to tc, which does
# all its work. bpf_xdp_load_bytes is a helper of XDP programs alone: agent/doctor's XDP_HELPERS.
XDP6_NEEDS = ("bpf_xdp_load_bytes",)

# The SNAT port walk's probes (bpf/ekp_snat_af.h), one callback per family, passed by every program
# that creates source-translated flows: tc's ingress and XDP. Only in a build with bpf_loop
# (EKP_SNAT_BPF_LOOP=1): in the other the same programs walk in a bounded loop and link nothing
# (agent/ebpf/link.py callback_of)
SNAT_CALLBACK = "ekp_snat_callback"
SNAT6_CALLBACK = "ekp_snat6_callback"

PROGRAMS: dict[str, ProgSpec] = {
    PROG_FROM_POD: ProgSpec(PROG_SCHED_CLS, callback=SNAT_CALLBACK),
    PROG_FROM_NET: ProgSpec(PROG_SCHED_CLS, callback=SNAT_CALLBACK),
    PROG_EGRESS: ProgSpec(PROG_SCHED_CLS),
    PROG_FROM_POD6: ProgSpec(PROG_SCHED_CLS, callback=SNAT6_CALLBACK),
    PROG_FROM_NET6: ProgSpec(PROG_SCHED_CLS, callback=SNAT6_CALLBACK),
    PROG_EGRESS6: ProgSpec(PROG_SCHED_CLS),
    PROG_XDP_NET: ProgSpec(PROG_XDP, callback=SNAT_CALLBACK),
    PROG_XDP_NET6: ProgSpec(PROG_XDP, needs=XDP6_NEEDS, callback=SNAT6_CALLBACK),
    **{
        name: ProgSpec(
            PROG_CGROUP_SOCK if attach == ATTACH_CGROUP_INET_SOCK_RELEASE else PROG_CGROUP_SOCK_ADDR,
            attach,
            needs=SOCK_NEEDS,
        )
        for name, attach in SOCK_HOOKS.values()
    },
    PROG_SOCK_TERM: ProgSpec(
        PROG_TRACING,
        ATTACH_TRACE_ITER,
        iter_target="udp",
        kfuncs=((KFUNC_SOCK_DESTROY_MARK, "bpf_sock_destroy"),),
        needs=TERM_NEEDS,
    ),
}


def callbacks(names: Iterable[str]) -> list[str]:
    """The callbacks the programs `names` pass (those of PROGRAMS), each once, sorted."""
    return sorted({PROGRAMS[n].callback for n in names if n in PROGRAMS and PROGRAMS[n].callback})


def kernel_needs() -> set[str]:
    """Every kernel function some program needs."""
    return {fn for spec in PROGRAMS.values() for fn in spec.needs}


def available_programs(kernel_has: set[str]) -> dict[str, ProgSpec]:
    """The programs this kernel can load: those whose needs are all in `kernel_has`."""
    return {name: spec for name, spec in PROGRAMS.items() if set(spec.needs) <= kernel_has}
