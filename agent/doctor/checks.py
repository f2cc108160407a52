"""`agent doctor`'s checklist: what was found on the node (`Facts`) -> one line per check. Pure.

Each line has a verdict (ok, warn, FAIL), what was found, and for anything not ok what to do.
FAIL: the chosen mode will not start, or will mistranslate traffic; warn: it works, something
is degraded or worth knowing. The facts are gathered by agent/doctor/facts.py; tests build them
by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from agent.config import Mode
from agent.ebpf.programs import MIN_KERNEL, kernel_version

# What the data path uses (bpf/): its program type, map kinds and helpers. The kernel release
# (MIN_KERNEL, agent/ebpf/programs.py) is the first that has all of them and checks a tc route
# lookup's tot_len against the route's MTU, answering in mtu_result (5.12: before it the tc helper
# ignored tot_len and left the field, which shares tot_len's bytes, as given, so a too-big answer
# advertised the packet's own length). bpf_loop (5.17, or a backport) is optional: OPTIONAL_HELPER.
PROGRAM_TYPE = "sched_cls"
MAP_KINDS = ("hash", "lru_hash", "lpm_trie", "array", "percpu_array")
HELPERS = (
    "bpf_clone_redirect",
    "bpf_csum_diff",
    "bpf_fib_lookup",
    "bpf_get_prandom_u32",
    "bpf_ktime_get_coarse_ns",
    "bpf_ktime_get_ns",
    "bpf_l3_csum_replace",
    "bpf_l4_csum_replace",
    "bpf_redirect",
    "bpf_redirect_neigh",
    "bpf_skb_adjust_room",
    "bpf_skb_change_tail",
    "bpf_skb_load_bytes",
    "bpf_skb_pull_data",
    "bpf_skb_store_bytes",
)
# The socket programs' helpers (cgroup_sock_addr, bpf/ekp_sock.h and the decision they share with
# tc); a kernel without one loads the data path without them (agent/ebpf/programs.py) and the
# node's own clients reach no Service.
SOCKET_PROGRAM_TYPE = "cgroup_sock_addr"
SOCKET_HELPERS = (
    "bpf_get_netns_cookie",
    "bpf_get_prandom_u32",
    "bpf_get_socket_cookie",
    "bpf_ktime_get_ns",
    "bpf_set_retval",
)
# The helpers only the XDP program calls (probed for xdp programs). bpf_xdp_load_bytes (Linux 5.18)
# reads the IPv6 header chain: a kernel without it loads the data path without ekp_xdp_net6
# (agent/ebpf/programs.py), and IPv6 goes on from XDP to tc, which does all its work.
XDP_PROGRAM_TYPE = "xdp"
XDP_HELPERS = ("bpf_xdp_load_bytes",)
# Runs the SNAT port walk's probes where the kernel has it; without it the walk is a bounded loop
# (agent/ebpf/snatloop.py, which asks the kernel itself at the agent's load), the same work per
# packet, a longer verification at a cold start.
OPTIONAL_HELPER = "bpf_loop"


@dataclass(frozen=True)
class OptionalHook:
    """A hook only some flags attach, and the only program type it needs."""

    name: str
    wanted: Callable[[Facts], bool]  # whether the flags attach it
    kernel: str  # what a kernel needs for its program type
    off: str  # the flag that turns it off


def _wants_xdp(f: Facts) -> bool:
    return f.xdp


def _wants_socket_lb(f: Facts) -> bool:
    return f.socket_lb


OPTIONAL_PROGRAM_TYPES: Mapping[str, OptionalHook] = {
    # no kernel option of its own: the xdp program type comes with CONFIG_BPF_SYSCALL and a
    # network stack (CONFIG_XDP_SOCKETS is AF_XDP, which the data path does not use)
    XDP_PROGRAM_TYPE: OptionalHook("XDP", _wants_xdp, "the xdp program type (4.8+)", "--bpf-xdp=disabled"),
    SOCKET_PROGRAM_TYPE: OptionalHook(
        "socket-level", _wants_socket_lb, "CONFIG_CGROUP_BPF", "--bpf-socket-lb=false"
    ),
}
FILL_WARN = 0.8  # a table fuller than this: warn


class Verdict(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Line:
    verdict: Verdict
    check: str
    found: str
    fix: str = ""


@dataclass(frozen=True)
class BpfFeatures:
    """What `bpftool feature probe kernel` says (None: not probed, `error` says why)."""

    program_types: frozenset[str] = frozenset()
    map_kinds: frozenset[str] = frozenset()
    helpers: frozenset[str] = frozenset()  # of sched_cls programs
    socket_helpers: frozenset[str] = frozenset()  # of cgroup_sock_addr programs
    xdp_helpers: frozenset[str] = frozenset()  # of xdp programs
    error: str = ""


@dataclass(frozen=True)
class ForeignHook:
    device: str
    hook: str  # "tc ingress" or "xdp"
    what: str  # the program's name, kind, priority as the kernel lists it
    before_ours: bool  # runs before ekp_from_* and may end the chain


@dataclass(frozen=True)
class ApiFacts:
    url: str
    via_service: str = ""  # why the URL is the `kubernetes` Service ("" = it is not)
    error: str = ""  # the API server could not be reached or read ("" = it was)
    services: int = 0
    service_ports: int = 0
    endpoints: int = 0
    entries: Mapping[str, int] = field(default_factory=dict)  # eBPF map role -> entries planned


@dataclass(frozen=True)
class Facts:
    mode: Mode
    node: str
    netns: str = ""
    kernel: str = ""  # uname release, "6.18.0-..."
    missing_caps: tuple[str, ...] = ()
    features: BpfFeatures | None = None
    btf: bool = True
    # agent/ebpf/preflight.py's messages, each "what is wrong: what to do"
    toolchain_problems: tuple[str, ...] = ()  # bcc, kernel headers
    pin_problems: tuple[str, ...] = ()  # the pin path: bpffs, ownership
    pin_path: str = ""
    cgroup2: str = ""  # where cgroup2 is mounted ("" = nowhere)
    iptables_problem: str = ""  # agent/iptables/runner.py's preflight, "" = usable
    ip_forward: str = "1"
    kube_proxy_chains: Mapping[str, Sequence[str]] = field(default_factory=dict)  # backend -> chains
    kube_proxy_tables: tuple[str, ...] = ()  # nftables tables of kube-proxy's nftables mode
    foreign_hooks: tuple[ForeignHook, ...] = ()
    api: ApiFacts | None = None  # None: --services-file, no API server
    map_sizes: Mapping[str, int] = field(default_factory=dict)  # eBPF map role -> max entries
    conntrack: tuple[int, int] | None = None  # nf_conntrack_count, nf_conntrack_max
    unlocked_route_mtus: tuple[str, ...] = ()  # IPv4 routes with an unlocked mtu metric, "DST dev N mtu M"
    # What an upgrade's hand-over cut short left: our filters in front ("eth0 tc ingress: ekp_from_net
    # pref 16"), loads whose pinned mode is not OFF ("load 1a2b: hand-over mode MISS").
    handover_left: tuple[str, ...] = ()
    # the XDP programs are loaded (MapSizes.xdp): --bpf-xdp not disabled, and not best-effort
    # with every external device a veth (facts.xdp_loaded)
    xdp: bool = True
    socket_lb: bool = True  # the socket programs are attached (--bpf-socket-lb)


def checklist(f: Facts) -> list[Line]:
    """Every check for the mode, in the order an operator would fix them."""
    lines = [_privileges(f)]
    if f.mode is Mode.EBPF:
        lines += [_kernel(f), _features(f), *_snat_walk(f), _btf(f), *_ebpf_problems(f), _cgroup2(f)]
    else:
        lines.append(_iptables(f))
    lines += [_forwarding(f), _kube_proxy(f)]
    if f.mode is Mode.EBPF:
        lines += [_hooks(f), _handover(f), _route_mtus(f)]
    lines += _api(f)
    lines += _sizing(f)
    return lines


def _privileges(f: Facts) -> Line:
    if f.missing_caps:
        return Line(
            Verdict.FAIL,
            "privileges",
            f"lacks {', '.join(f.missing_caps)}",
            "run the agent as root (the chart's container: NET_ADMIN, BPF, PERFMON, SYS_ADMIN)",
        )
    return Line(Verdict.OK, "privileges", "the capabilities the mode needs")


def _kernel(f: Facts) -> Line:
    have = kernel_version(f.kernel)
    need = ".".join(map(str, MIN_KERNEL))
    if have < MIN_KERNEL:
        return Line(
            Verdict.FAIL,
            "kernel",
            f"{f.kernel or 'unknown'}: eBPF mode needs {need} or later (the route lookup's MTU answer)",
            f"upgrade the node's kernel to {need}+, or run --mode=iptables",
        )
    return Line(Verdict.OK, "kernel", f"{f.kernel} ({need} or later needed)")


def _features(f: Facts) -> Line:
    feats = f.features
    if feats is None or feats.error:
        why = feats.error if feats is not None else "not probed"
        return Line(
            Verdict.WARN,
            "BPF features",
            f"not probed: {why}",
            "install bpftool (Debian: apt-get install bpftool) so the doctor can probe them",
        )
    missing = []
    if PROGRAM_TYPE not in feats.program_types:
        missing.append(f"program type {PROGRAM_TYPE}")
    missing += [f"map {kind}" for kind in MAP_KINDS if kind not in feats.map_kinds]
    missing += [helper for helper in HELPERS if helper not in feats.helpers]
    if missing:
        return Line(
            Verdict.FAIL,
            "BPF features",
            "the kernel lacks " + ", ".join(missing),
            "a kernel built with CONFIG_BPF_SYSCALL, CONFIG_NET_CLS_BPF and CONFIG_NET_SCH_INGRESS "
            f"({'.'.join(map(str, MIN_KERNEL))}+), or run --mode=iptables",
        )
    # A hook the flags turn off needs nothing of the kernel: what it would lack changes nothing.
    extra = [
        t for t, hook in OPTIONAL_PROGRAM_TYPES.items() if hook.wanted(f) and t not in feats.program_types
    ]
    found = f"tc ({PROGRAM_TYPE}) with {len(HELPERS)} helpers, maps {', '.join(MAP_KINDS)}"
    lacking = [h for h in SOCKET_HELPERS if h not in feats.socket_helpers]
    if f.socket_lb and SOCKET_PROGRAM_TYPE in feats.program_types and lacking:
        return Line(
            Verdict.WARN,
            "BPF features",
            f"{found}; {SOCKET_PROGRAM_TYPE} programs lack {', '.join(lacking)}: the socket "
            "programs are not loaded, and the node's own clients (host-network pods, node "
            "processes) reach no Service",
            "Linux 5.18+ (bpf_set_retval) for the socket programs, or --bpf-socket-lb=false if "
            "nothing on the node's network dials a Service",
        )
    lacking = [h for h in XDP_HELPERS if h not in feats.xdp_helpers]
    if f.xdp and XDP_PROGRAM_TYPE in feats.program_types and lacking:
        return Line(
            Verdict.WARN,
            "BPF features",
            f"{found}; {XDP_PROGRAM_TYPE} programs lack {', '.join(lacking)}: XDP's IPv6 path "
            "(ekp_xdp_net6) is not loaded, and IPv6 packets go on from XDP to tc, which does all "
            "their work (IPv4 at XDP as before)",
            "Linux 5.18+ (bpf_xdp_load_bytes) for XDP's IPv6 path; nothing to do if tc's cost for "
            "IPv6 is acceptable",
        )
    if extra:
        wanted = [OPTIONAL_PROGRAM_TYPES[t] for t in extra]
        both = len(wanted) > 1
        return Line(
            Verdict.WARN,
            "BPF features",
            f"{found}; no {', '.join(extra)} programs (the {' and '.join(h.name for h in wanted)}"
            f" hook{'s' if both else ''} need{'' if both else 's'} them)",
            f"a kernel with {' and '.join(h.kernel for h in wanted)},"
            f" or {' and '.join(h.off for h in wanted)}",
        )
    hooks = [name for name, on in (("XDP", f.xdp), ("cgroup socket", f.socket_lb)) if on]
    if not hooks:
        return Line(Verdict.OK, "BPF features", found)
    return Line(Verdict.OK, "BPF features", f"{found}; {' and '.join(hooks)} programs too")


def _snat_walk(f: Facts) -> list[Line]:
    """bpf_loop or not: optional, never a FAIL. Unprobed, nothing (the BPF features line says how
    to probe; the agent asks the kernel itself at its load and logs which walk runs)."""
    feats = f.features
    if feats is None or feats.error:
        return []
    if OPTIONAL_HELPER in feats.helpers:
        return [
            Line(Verdict.OK, "SNAT walk", f"{OPTIONAL_HELPER}: the SNAT walk runs in a bpf_loop callback")
        ]
    return [
        Line(
            Verdict.WARN,
            "SNAT walk",
            f"no {OPTIONAL_HELPER}: the SNAT walk runs in a bounded loop: a cold start verifies longer "
            "(the same work per packet)",
            "nothing to do; a kernel with bpf_loop (Linux 5.17+, or a backport) verifies a cold start "
            "with about a third less work",
        )
    ]


def _btf(f: Facts) -> Line:
    if not f.btf:
        return Line(
            Verdict.WARN,
            "BTF",
            "no /sys/kernel/btf/vmlinux: bpftool dumps of the maps lack field names",
            "a kernel with CONFIG_DEBUG_INFO_BTF (agent inspect decodes the maps either way)",
        )
    return Line(Verdict.OK, "BTF", "/sys/kernel/btf/vmlinux")


def _ebpf_problems(f: Facts) -> list[Line]:
    out = [_problem("bcc and headers", p) for p in f.toolchain_problems] or [
        Line(Verdict.OK, "bcc and headers", "the bcc module and the kernel headers bcc compiles against")
    ]
    out += [_problem("bpffs", p) for p in f.pin_problems] or [
        Line(Verdict.OK, "bpffs", f"{f.pin_path} can hold pinned maps")
    ]
    return out


def _problem(check: str, message: str) -> Line:
    what, _, fix = message.partition(": ")
    return Line(Verdict.FAIL, check, what, fix or message)


def _cgroup2(f: Facts) -> Line:
    if not f.socket_lb:
        return Line(Verdict.OK, "cgroup2", "not needed: --bpf-socket-lb=false attaches no socket programs")
    if not f.cgroup2:
        return Line(
            Verdict.WARN,
            "cgroup2",
            "not mounted: socket-level translation (the node's own traffic) needs it",
            "mount -t cgroup2 none /sys/fs/cgroup",
        )
    return Line(Verdict.OK, "cgroup2", f"mounted at {f.cgroup2}")


def _iptables(f: Facts) -> Line:
    if f.iptables_problem:
        return Line(Verdict.FAIL, "iptables", f.iptables_problem, "see the line above for what to install")
    return Line(Verdict.OK, "iptables", "iptables-save and iptables-restore of a backend found")


def _forwarding(f: Facts) -> Line:
    if f.ip_forward != "1":
        return Line(
            Verdict.FAIL,
            "forwarding",
            f"net.ipv4.ip_forward={f.ip_forward or '?'}: Service traffic to other nodes' pods is not routed"
            + (" and bpf_fib_lookup refuses every redirect" if f.mode is Mode.EBPF else ""),
            "sysctl -w net.ipv4.ip_forward=1 (agent --init-only sets it)",
        )
    return Line(Verdict.OK, "forwarding", "net.ipv4.ip_forward=1")


def _kube_proxy(f: Facts) -> Line:
    found = [
        f"iptables-{b}: {', '.join(chains)}" for b, chains in sorted(f.kube_proxy_chains.items()) if chains
    ]
    found += [f"nftables table {t}" for t in f.kube_proxy_tables]
    if not found:
        return Line(Verdict.OK, "kube-proxy", "none of kube-proxy's rules or tables")
    fix = (
        "stop kube-proxy (kubectl -n kube-system delete ds kube-proxy); the agent carries its established"
        " flows over and removes its rules and tables once it serves (agent --cleanup-kube-proxy removes them"
        " at once, and new connections fail until an agent serves)"
    )
    if f.mode is Mode.IPTABLES and not f.kube_proxy_tables:
        return Line(
            Verdict.WARN,
            "kube-proxy",
            "KUBE-* chains present (" + "; ".join(found) + "): kube-proxy's, or this agent's own (the same "
            "layout)",
            f"if kube-proxy still runs here: {fix}",
        )
    return Line(
        Verdict.FAIL,
        "kube-proxy",
        "kube-proxy's rules are on the node (" + "; ".join(found) + "): they translate Service traffic too",
        fix,
    )


def _few(names: Sequence[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _hooks(f: Facts) -> Line:
    if not f.foreign_hooks:
        return Line(Verdict.OK, "tc/XDP hooks", "no other program on the devices' tc ingress or XDP hooks")
    first = [h for h in f.foreign_hooks if h.before_ours]
    listed = "; ".join(f"{h.device} {h.hook}: {h.what}" for h in f.foreign_hooks)
    if first:
        return Line(
            Verdict.FAIL,
            "tc/XDP hooks",
            f"another program runs before ours and may end the chain: {listed}",
            "remove it (tc filter del dev DEVICE ingress pref N; bpftool link detach id N; ip link set "
            "DEVICE xdp off), or another "
            "CNI's kube-proxy replacement (Cilium, Calico eBPF) is active: use one",
        )
    return Line(
        Verdict.WARN,
        "tc/XDP hooks",
        f"another program shares the hooks, after ours: {listed}",
        "a tc program after ours runs only during an upgrade's hand-over (ours ends every packet's tc "
        "chain): remove it if it must see the node's packets; an XDP program sees them before any "
        "translation: check that it expects that",
    )


def _handover(f: Facts) -> Line:
    if not f.handover_left:
        return Line(Verdict.OK, "hand-over", "no upgrade hand-over left half done")
    return Line(
        Verdict.WARN,
        "hand-over",
        f"an upgrade's hand-over was cut short: {_few(f.handover_left)}; while the agent is not "
        "running, the programs in front may pass packets on to older ones",
        "start the agent (its first sync resumes the hand-over, or removes what is in front), or "
        "agent --cleanup",
    )


def _route_mtus(f: Facts) -> Line:
    # bpf_fib_lookup (bpf/ekp_redirect.h) checks a route's mtu metric only when locked (or with
    # net.ipv4.ip_forward_use_pmtu), while IPv4 forwarding always does: unlocked, a packet between
    # that MTU and the device's leaves whole from the data path but would get a fragmentation
    # needed from the stack.
    if not f.unlocked_route_mtus:
        return Line(Verdict.OK, "route MTUs", "no IPv4 route with an unlocked mtu")
    return Line(
        Verdict.WARN,
        "route MTUs",
        f"unlocked mtu on {_few(f.unlocked_route_mtus)}: IP forwarding enforces it, the eBPF data "
        "path's route lookup does not (packets up to the device's MTU leave whole, no ICMP)",
        "lock it: ip route change ROUTE mtu lock N",
    )


def _api(f: Facts) -> list[Line]:
    api = f.api
    if api is None:
        return [Line(Verdict.OK, "API server", "none (--services-file)")]
    out = []
    if api.via_service:
        out.append(
            Line(
                Verdict.FAIL,
                "API server",
                f"{api.url} is the `kubernetes` Service ({api.via_service}), which this agent programs "
                "itself: after a restart it cannot reach the API to program it",
                "give the agent an API server address: --master https://ADDRESS:6443, a kubeconfig, or "
                "the chart's apiServer.host",
            )
        )
    if api.error:
        out.append(
            Line(
                Verdict.FAIL,
                "API server",
                f"{api.url}: {api.error}",
                "check the address, the credentials and that the node can reach it",
            )
        )
    elif not api.via_service:
        out.append(Line(Verdict.OK, "API server", f"{api.url} answers, not through a Service"))
    return out


def _sizing(f: Facts) -> list[Line]:
    out = []
    api = f.api
    if f.mode is Mode.EBPF and api is not None and not api.error and api.entries:
        full = []
        fill = []
        for role, need in sorted(api.entries.items()):
            size = f.map_sizes.get(role, 0)
            if not size:
                continue
            share = need / size
            text = f"{role} {need}/{size}"
            if share > 1:
                full.append(text)
            elif share > FILL_WARN:
                fill.append(text)
        found = (
            f"{api.services} Services, {api.service_ports} service ports, {api.endpoints} endpoints need "
            + ", ".join(f"{r} {n}" for r, n in sorted(api.entries.items()))
        )
        if full:
            out.append(
                Line(
                    Verdict.FAIL,
                    "map sizes",
                    f"{found}: too many for {', '.join(full)}",
                    "raise the --bpf-<map>-max of each (a new size takes a new map: restart the agent)",
                )
            )
        elif fill:
            out.append(
                Line(
                    Verdict.WARN,
                    "map sizes",
                    f"{found}: over 80% of {', '.join(fill)}",
                    "raise --bpf-<map>-max",
                )
            )
        else:
            out.append(Line(Verdict.OK, "map sizes", f"{found}: every map under 80%"))
    if f.conntrack is not None:
        count, limit = f.conntrack
        if limit and count > FILL_WARN * limit:
            out.append(
                Line(
                    Verdict.WARN,
                    "conntrack",
                    f"nf_conntrack holds {count} of {limit} entries",
                    "raise --conntrack-max-per-core / --conntrack-min (kube-proxy's; nf_conntrack_max is "
                    "written from the initial namespace only)",
                )
            )
        else:
            out.append(Line(Verdict.OK, "conntrack", f"nf_conntrack holds {count} of {limit} entries"))
    return out


def render(f: Facts, lines: Sequence[Line]) -> str:
    """The checklist as text, one line per check (and its fix indented under it), and a verdict."""
    where = f"netns {f.netns}" if f.netns else "this network namespace"
    out = [f"agent doctor: {f.mode.value} mode, node {f.node}, {where}"]
    for line in lines:
        out.append(f"  {line.verdict.value:<5} {line.check:<16} {line.found}")
        if line.fix and line.verdict is not Verdict.OK:
            out.append(f"  {'':<5} {'':<16} -> {line.fix}")
    fails = sum(1 for line in lines if line.verdict is Verdict.FAIL)
    warns = sum(1 for line in lines if line.verdict is Verdict.WARN)
    if fails:
        out.append(f"verdict: {fails} FAIL, {warns} warn: {f.mode.value} mode will not work here until fixed")
    elif warns:
        out.append(f"verdict: ready for {f.mode.value} mode, {warns} warn")
    else:
        out.append(f"verdict: ready for {f.mode.value} mode")
    return "\n".join(out) + "\n"
