"""Where an untranslated IPv6 packet's nanoseconds go in ekp_from_pod, against IPv4's (issue 20).

`python -m bench.v6cost` builds the data path several times from patched copies of bpf/ (each a
*variant*: the tree as it is, or the same with the program cut short at one stage, that is made
to return TC_ACT_OK there), loads every build at once into a throwaway bpffs, and times each
case on each build with BPF_PROG_TEST_RUN as bench/progcost.py does (REPEAT runs in one call, the
kernel's mean per run), in the packet lab of the data-path tests (lab/dplab.py, IPv6 beside
IPv4, one ClusterIP of each family whose backend is the server, the activity check armed and no
flow live). The rounds go through every build and case in turn, so the machine's load falls on all
of them alike, and the median of the rounds is kept. A stage's cost is the difference between two
cuts: what the program does between them (the verifier removes the dead code after a cut).

The translated packets (a conntrack hit each way, and the SYN that makes a flow, each family,
bpf host routing) are timed one run a call (the run rewrites the frame): the whole builds, and the
`x` variants, cut on the translated path (ekp_from_pod6's hit and new-flow stages, and IPv4's
matching ones in ekp_decide.h and ekp_tc_apply.h).

A cut build must pass (TC_ACT_OK) the translated packets it cuts (`Variant.cuts`) and redirect
the others as the tree does; anything else raises. The cuts leave by different paths (IPv4's
`v4x-ct` and `v4x-pick` return from void decide functions and the program goes on with an empty
decision, `v4x-dec` returns from the program, IPv6's skip the `out:` accounting except `v6x-rw`'s),
so a stage figure under about 30 ns is within the cuts' placement error. After the translated
table, each case's spread over the builds that leave its path as the tree has it
(`Variant.leaves_whole`): the noise of that column.

The cuts are text patches of this tree's C: a patch that no longer matches raises, naming it.
Only measurement builds: nothing here is loaded by the agent.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from agent.ebpf.loader import Datapath, default_bpf_dir
from agent.ebpf.objcache import ObjectCache
from lab.dplab import (
    BE1,
    BE6,
    POD6,
    POD_CLIENT,
    SIZES,
    VIP,
    VIP6,
    add_ipv6,
    add_service,
    add_service6,
    packet_lab,
    reset_maps,
)
from lab.packets import bpffs, prog_run_timed, tcp

REPEAT = 50_000
ROUNDS = 15
CPU = 0
QUIET = 9999  # a port of the server no Service has: no translated flow uses it
TC_ACT_OK = 0
TC_ACT_REDIRECT = 7
CUT = "return TC_ACT_OK; /* v6cost cut */"


@dataclass(frozen=True)
class Patch:
    file: str
    old: str
    new: str


# A translated packet's kind: a conntrack hit (either way) or a new flow's SYN.
HIT, NEW = "hit", "new"


@dataclass(frozen=True)
class Variant:
    name: str
    what: str
    patches: tuple[Patch, ...] = ()
    whole: bool = False  # translates as the tree does: its translated packets are timed too
    xlate: bool = False  # cut on the translated path: its translated packets are timed
    new_only: bool = False  # cut on the new-flow path: no flow opens, so only the SYNs are timed
    # (family, kind) of the translated packets the cut ends early: passed (TC_ACT_OK); the others
    # are redirected as by the tree.
    cuts: frozenset[tuple[str, str]] = frozenset()
    # (family, kind) whose path a whole build changes (a lookup dropped or flagged): its figure
    # there is not the tree's path.
    alters: frozenset[tuple[str, str]] = frozenset()

    def expected_verdict(self, family: str, kind: str) -> int:
        return TC_ACT_OK if (family, kind) in self.cuts else TC_ACT_REDIRECT

    def leaves_whole(self, family: str, kind: str) -> bool:
        """The build runs that packet's path as the tree does: it cuts nothing of that family's
        program (a cut anywhere in it changes its code) and alters none of that path."""
        return all(f != family for f, _ in self.cuts) and (family, kind) not in self.alters


def _on(family: str, *kinds: str) -> frozenset[tuple[str, str]]:
    return frozenset((family, k) for k in kinds)


def _after(file: str, anchor: str, code: str) -> Patch:
    return Patch(file, anchor, anchor + "\n" + code)


# The stages of an IPv6 packet (ekp_from_pod -> tail call -> ekp_from_pod6) and of an IPv4 one
# (ekp_from_pod -> ekp_main), each cut placed after the work it names. The IPv4 program's cuts
# test the family, so an IPv4 cut leaves the IPv6 path whole and the other way round.
V4 = "skb->protocol == htons(ETH_P_IP)"
V6 = "skb->protocol == htons(ETH_P_IPV6)"
FROM_POD = "int ekp_from_pod(struct __sk_buff *skb)\n{"
HANDOVER = "\tif (handover == EKP_HANDOVER_PASS)\n\t\treturn TC_ACT_UNSPEC;"
CALL6 = f"\n\tif ({V6})\n\t\tekp_calls6.call(skb, EKP_CALL6_FROM_POD);"
FROM_POD6 = "int ekp_from_pod6(struct __sk_buff *skb)\n{"
DECIDE6 = "ekp_decide6_hook.h"
AFTER_MEMSET6 = "\tstruct ekp_pkt6 *p = &w->pkt;"
AFTER_PARSE6 = "\tint parsed = hook == EKP_HOOK_XDP ? ekp_parse6_xdp(ctx, p) : ekp_parse6(ctx, p);"
AFTER_COUNT6 = "\tekp_count_in(ekp6_counters(hook), EKP_STAT_PACKETS);"
TC6 = "if (hook == EKP_HOOK_TC) " + CUT
MAY6 = "ekp_tc6.h"
BEFORE_ADDR6 = "\tstruct ekp_addr6_key k = {};\n\t__builtin_memcpy(k.addr, p->daddr, 16);"
CORE = "ekp_core.h"
PARSE4 = "\tint parsed = ekp_parse(skb, &w->work.pkt);\n"
DECIDE4_CALL = "\n\tekp_decide(&w->work"
DECIDE4 = "ekp_decide.h"
BEFORE_ADDR4 = "\tstruct ekp_addr_key k = {};\n\tk.addr = p->daddr;"

# The translated path's stages (a pod's packet under bpf host routing), each cut placed after the
# work it names. IPv6 (ekp_decide6_hook.h, ekp_tc6.h): a hit is conntrack, the source check (a
# bpf_fib_lookup), the flow's advance, the route out (a bpf_fib_lookup), the rewrite, the hop and
# the redirect; a new flow is conntrack's two misses, the frontend, the source check, the backend
# and the route, the entries, then the same rewrite and redirect. IPv4 (ekp_decide.h, then
# ekp_tc_apply.h): conntrack, the advance (or the frontend, the backend and the entries), then the
# source check, the route, the rewrite and the redirect, in that order for both kinds of packet.
HIT6 = "\tif (e) {\n\t\tw->reopens = 0;"
LAST_HOP6 = "\t\t/* The last hop, and a segment too big for the device its translation leaves by: answered"
HOST6 = "\t\t/* a backend on the node's own address: no route to look up (the stack delivers it) */"
ROUTED6 = (
    "\t\toutcome = k->dir == EKP_CT_FORWARD ? EKP_STAT_CT_FORWARD : EKP_STAT_CT_REPLY;\n"
    "\t\tif (p->b.frag == EKP_FRAG_LATER)"
)
FORWARD6 = "\treturn ekp_tc6_forward(skb, w, rc, outcome);\n}"
NEW_SRC6 = (
    "\tif (hook == EKP_HOOK_TC && scope == EKP_SCOPE_INTERNAL && !ekp_source_routed_here6(ctx, p, &w->fib))\n"
    "\t\tgoto out;"
)
CREATE6 = "\tint reason = ekp_ct6_create(p, f, cfg, now);"
CREATED6 = "\tsa = (f->b.ct_flags & EKP_CT_SNAT) ? f->snat_addr : p->saddr;\n\tsp ="
DECIDE_HIT4 = (
    "\t\t\t\t\t   __u64 now, struct ekp_decision *d, struct ekp_ctq_req *q)\n{\n"
    "\tint advanced = ekp_ct_advance(ep, k, p, now, q);"
)
DECIDED4 = "\tekp_decide(&w->work, parsed, scope, EKP_HOOK_TC);\n\tint verdict;"
APPLY4 = "ekp_tc_apply.h"
SRC4 = "\t\treturn ekp_tc_drop(d, EKP_DROP_SPOOFED);\n\t__builtin_memset(fib, 0, sizeof(*fib));"
ROUTED4 = (
    "\tif (legacy)\n"
    "\t\treturn ekp_host_hand_over(skb, p, d->saddr, d->sport, d->daddr, d->dport, &d->outcome);\n"
    "\tint rewritten ="
)
REDIRECT4 = "\treturn ekp_redirect(skb, p, fib, rc, &d->outcome);\n}"
PICKED4 = "\tekp_decide_create(p, f, cfg, now, d, q);\n}"
XCUT = "if (hook == EKP_HOOK_TC) return; /* v6cost cut */"


def _cut_before(file: str, anchor: str, code: str) -> Patch:
    return Patch(file, anchor, code + "\n" + anchor)


XLATE_VARIANTS = (
    Variant(
        "v6x-ct",
        "IPv6 hit: after conntrack (found, alive)",
        (_after(DECIDE6, HIT6, f"\t\t{TC6}"),),
        cuts=_on("IPv6", HIT),
        xlate=True,
    ),
    Variant(
        "v6x-src",
        "IPv6 hit: after the source check (a bpf_fib_lookup back to the source)",
        (_cut_before(DECIDE6, LAST_HOP6, f"\t\t{TC6}"),),
        cuts=_on("IPv6", HIT),
        xlate=True,
    ),
    Variant(
        "v6x-adv",
        "IPv6 hit: after the flow's advance (state, refresh)",
        (_cut_before(DECIDE6, HOST6, f"\t\t{TC6}"),),
        cuts=_on("IPv6", HIT),
        xlate=True,
    ),
    Variant(
        "v6x-route",
        "IPv6 hit: after the route out (a bpf_fib_lookup)",
        (_cut_before(DECIDE6, ROUTED6, f"\t\t{TC6}"),),
        cuts=_on("IPv6", HIT),
        xlate=True,
    ),
    Variant(
        "v6x-nsrc",
        "IPv6 new flow: after the misses, the frontend, the node address and the source check",
        (_after(DECIDE6, NEW_SRC6, f"\t{TC6}"),),
        cuts=_on("IPv6", NEW),
        xlate=True,
        new_only=True,
    ),
    Variant(
        "v6x-nroute",
        "IPv6 new flow: after the backend's choice and the route out",
        (_cut_before(DECIDE6, CREATE6, f"\t{TC6}"),),
        cuts=_on("IPv6", NEW),
        xlate=True,
        new_only=True,
    ),
    Variant(
        "v6x-create",
        "IPv6 new flow: after the entries (ekp_ct6_create, the ring's request)",
        (_cut_before(DECIDE6, CREATED6, f"\t{TC6}"),),
        cuts=_on("IPv6", NEW),
        xlate=True,
        new_only=True,
    ),
    Variant(
        "v6x-rw",
        "IPv6 both: after the rewrite (no hop, no redirect)",
        (Patch(MAY6, FORWARD6, f"\t{CUT}\n}}"),),
        cuts=_on("IPv6", HIT, NEW),
        xlate=True,
    ),
    Variant(
        "v4x-ct",
        "IPv4 hit: after conntrack (found, alive; no advance)",
        (
            Patch(
                DECIDE4,
                DECIDE_HIT4,
                DECIDE_HIT4.replace("\tint advanced", "\treturn; /* v6cost cut */\n\tint advanced"),
            ),
        ),
        cuts=_on("IPv4", HIT),
        xlate=True,
    ),
    Variant(
        "v4x-pick",
        "IPv4 new flow: after the misses, the frontend and the backend's choice",
        (_cut_before(DECIDE4, PICKED4, f"\t{XCUT}"),),
        cuts=_on("IPv4", NEW),
        xlate=True,
        new_only=True,
    ),
    Variant(
        "v4x-dec",
        "IPv4 both: after the decision (a hit's advance, a new flow's entries)",
        (Patch(CORE, DECIDED4, DECIDED4.replace("\tint verdict;", f"\tif ({V4}) {CUT}\n\tint verdict;")),),
        cuts=_on("IPv4", HIT, NEW),
        xlate=True,
    ),
    Variant(
        "v4x-src",
        "IPv4 both: after the source check (a bpf_fib_lookup back to the source)",
        (Patch(APPLY4, SRC4, SRC4.replace("\t__builtin_memset", f"\t{CUT}\n\t__builtin_memset")),),
        cuts=_on("IPv4", HIT, NEW),
        xlate=True,
    ),
    Variant(
        "v4x-route",
        "IPv4 both: after the route out (a bpf_fib_lookup)",
        (_cut_before(APPLY4, ROUTED4, f"\t{CUT}"),),
        cuts=_on("IPv4", HIT, NEW),
        xlate=True,
    ),
    Variant(
        "v4x-rw",
        "IPv4 both: after the rewrite (no TTL, no redirect)",
        (Patch(APPLY4, REDIRECT4, f"\t{CUT}\n}}"),),
        cuts=_on("IPv4", HIT, NEW),
        xlate=True,
    ),
)

# The source check's bpf_fib_lookup with a flag (measurements of the kernel's lookup, not proposals):
# BPF_FIB_LOOKUP_DIRECT (1) looks in the main table alone, where the full lookup with no policy rule
# looks in the local table first (fib6_lookup); BPF_FIB_LOOKUP_SKIP_NEIGH (4, Linux 6.5) looks up no
# neighbour (and returns before the device's MTU check of a lookup without tot_len).
SRC_FIB6 = "\tlong rc = ekp_fib6(skb, fib, p, p->daddr, p->saddr, p->b.dport, p->b.sport, 0);"


def _src_fib6_flags(flags: int) -> Patch:
    return Patch(
        MAY6,
        SRC_FIB6,
        "\t__builtin_memset(fib, 0, sizeof(*fib));\n"
        "\tfib->family = AF_INET6;\n"
        "\tfib->l4_protocol = p->b.proto;\n"
        "\tfib->sport = p->b.dport;\n"
        "\tfib->dport = p->b.sport;\n"
        "\t__builtin_memcpy(fib->ipv6_src, p->daddr, 16);\n"
        "\t__builtin_memcpy(fib->ipv6_dst, p->saddr, 16);\n"
        "\tfib->ifindex = skb->ingress_ifindex;\n"
        f"\tlong rc = bpf_fib_lookup(skb, fib, sizeof(*fib), {flags}); /* v6cost flags */",
    )


VARIANTS = (
    Variant("tree", "the tree as it is", whole=True),
    Variant(
        "v6-hit-norp",
        "IPv6: a hit from a pod without the reverse route lookup (one bpf_fib_lookup less)",
        (Patch(DECIDE6, "\t\t    !ekp_source_routed_here6(ctx, p, &w->fib)) {", "\t\t    0) {"),),
        alters=_on("IPv6", HIT),
        whole=True,
    ),
    Variant(
        "v4-hit-norp",
        "IPv4: a pod's hit or SYN without the source check's lookup (one bpf_fib_lookup less)",
        (Patch("ekp_tc_apply.h", "!legacy && !ekp_source_routed_here(skb, p, fib)", "0"),),
        alters=_on("IPv4", HIT, NEW),
        whole=True,
    ),
    Variant(
        "v6-src-direct",
        "IPv6: the source check's lookup in the main table alone (BPF_FIB_LOOKUP_DIRECT)",
        (_src_fib6_flags(1),),
        alters=_on("IPv6", HIT, NEW),
        whole=True,
    ),
    Variant(
        "v6-src-noneigh",
        "IPv6: the source check's lookup without its neighbour (BPF_FIB_LOOKUP_SKIP_NEIGH)",
        (_src_fib6_flags(4),),
        alters=_on("IPv6", HIT, NEW),
        whole=True,
    ),
    Variant(
        "v6-entry",
        "IPv6: ekp_from_pod returns at once",
        (_after("ekp_tc.c", FROM_POD, f"\tif ({V6}) {CUT}"),),
    ),
    Variant(
        "v6-dispatch",
        "IPv6: after ekp_from_pod's hand-over load and family test (no tail call)",
        (Patch("ekp_tc.c", "\t\tekp_calls6.call(skb, EKP_CALL6_FROM_POD);", f"\t\t{CUT}"),),
    ),
    Variant(
        "v6-tailcall", "IPv6: ekp_from_pod6 returns at once", (_after("ekp_tc.c", FROM_POD6, f"\t{CUT}"),)
    ),
    Variant(
        "v6-memset",
        "IPv6: after the scratch lookup and the packet's memset",
        (_after(DECIDE6, AFTER_MEMSET6, f"\t{TC6}"),),
    ),
    Variant("v6-parse", "IPv6: after ekp_parse6", (_after(DECIDE6, AFTER_PARSE6, f"\t{TC6}"),)),
    Variant(
        "v6-count",
        "IPv6: after the config and the PACKETS count",
        (_after(DECIDE6, AFTER_COUNT6, f"\t{TC6}"),),
    ),
    Variant(
        "v6-act",
        "IPv6: after the activity check's two slots (no ekp_addr6 lookup)",
        (Patch(MAY6, BEFORE_ADDR6, "\treturn 0; /* v6cost cut */\n" + BEFORE_ADDR6),),
    ),
    Variant(
        "v4-entry",
        "IPv4: ekp_from_pod returns at once",
        (_after("ekp_tc.c", FROM_POD, f"\tif ({V4}) {CUT}"),),
    ),
    Variant(
        "v4-dispatch",
        "IPv4: after ekp_from_pod's hand-over load and family test",
        (Patch("ekp_tc.c", HANDOVER + CALL6, HANDOVER + f"\n\tif ({V4}) {CUT}" + CALL6),),
    ),
    Variant(
        "v4-memset",
        "IPv4: after the scratch lookup and the packet's memset",
        (Patch(CORE, PARSE4 + DECIDE4_CALL, f"\tif ({V4}) {CUT}\n" + PARSE4 + DECIDE4_CALL),),
    ),
    Variant(
        "v4-parse",
        "IPv4: after ekp_parse",
        (Patch(CORE, PARSE4 + DECIDE4_CALL, PARSE4 + f"\tif ({V4}) {CUT}" + DECIDE4_CALL),),
    ),
    Variant(
        "v4-act",
        "IPv4: after the activity check's two slots (no ekp_addr lookup)",
        (Patch(DECIDE4, BEFORE_ADDR4, "\treturn 0; /* v6cost cut */\n" + BEFORE_ADDR4),),
    ),
    *XLATE_VARIANTS,
)


@dataclass(frozen=True)
class Case:
    name: str
    program: str
    frame: bytes


def cases() -> list[Case]:
    data = b"x" * 64
    return [
        Case(
            "IPv4 pod -> pod IP", "ekp_from_pod", tcp(POD_CLIENT, BE1, 40000, QUIET, flags="A", payload=data)
        ),
        Case("IPv4 its answer", "ekp_from_pod", tcp(BE1, POD_CLIENT, QUIET, 40000, flags="A", payload=data)),
        Case("IPv6 pod -> pod IP", "ekp_from_pod", tcp(POD6, BE6, 40000, QUIET, flags="A", payload=data)),
        Case("IPv6 its answer", "ekp_from_pod", tcp(BE6, POD6, QUIET, 40000, flags="A", payload=data)),
        Case(
            "IPv6 pod -> pod IP, ekp_from_pod6 itself",
            "ekp_from_pod6",
            tcp(POD6, BE6, 40000, QUIET, flags="A", payload=data),
        ),
        Case(
            "IPv6 pod -> pod IP, 8 bytes of destination options",
            "ekp_from_pod",
            _with_dstopts(POD6, BE6, data),
        ),
    ]


def _with_dstopts(src: str, dst: str, payload: bytes) -> bytes:
    from scapy.layers.inet import TCP
    from scapy.layers.inet6 import IPv6, IPv6ExtHdrDestOpt
    from scapy.layers.l2 import Ether

    frame = (
        Ether(src="02:00:00:00:aa:01", dst="02:00:00:00:aa:02") / IPv6(src=src, dst=dst) / IPv6ExtHdrDestOpt()
    )
    return bytes(frame / TCP(sport=40000, dport=QUIET, flags="A") / payload)


def patched_tree(root: Path, variant: Variant, source: Path) -> Path:
    """A copy of `source` (bpf/) with the variant's patches, under `root`."""
    dest = root / variant.name
    shutil.copytree(source, dest)
    for p in variant.patches:
        path = dest / p.file
        text = path.read_text()
        if text.count(p.old) != 1:
            raise SystemExit(
                f"variant {variant.name}: {p.file} holds {text.count(p.old)} copies of {p.old!r}"
            )
        path.write_text(text.replace(p.old, p.new))
    return dest


@contextmanager
def loaded(
    variants: list[Variant], source: Path, cache: ObjectCache, compare: Path | None = None
) -> Iterator[dict[str, Datapath]]:
    """Every variant of `source` built and loaded (and, as the variant "compare", the tree
    `compare` as it is: another commit's bpf/, measured in the same rounds)."""
    sizes = replace(SIZES, xdp=False)  # the XDP programs are not measured: not loaded
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="v6cost-") as tmp:
        trees = {v.name: patched_tree(Path(tmp), v, source) for v in variants}  # every patch checked first
        if compare is not None:
            variants = [Variant("compare", f"{compare} as it is"), *variants]
            trees["compare"] = compare
        pins = stack.enter_context(bpffs())
        out: dict[str, Datapath] = {}
        for v in variants:
            dp = Datapath(str(pins / v.name), sizes, bpf_dir=trees[v.name], cache=cache)
            print(f"loading {v.name}: {v.what}", file=sys.stderr, flush=True)
            dp.load()
            stack.callback(dp.close)
            out[v.name] = dp
        yield out


def measure(
    dps: dict[str, Datapath], rounds: int, pod_ifindex: Callable[[], int]
) -> dict[tuple[str, str], float]:
    """Median ns per run of every (variant, case), the rounds taken in turn over all of them."""
    ifindex = pod_ifindex()
    todo = cases()
    runs: dict[tuple[str, str], list[float]] = {}
    os.sched_setaffinity(0, {CPU})
    for _ in range(rounds):
        for name, dp in dps.items():
            for c in todo:
                verdict, ns = prog_run_timed(dp.prog_fd(c.program), c.frame, ifindex, None, REPEAT)
                if verdict != TC_ACT_OK:
                    raise RuntimeError(f"{name}, {c.name}: verdict {verdict}, expected it passed")
                runs.setdefault((name, c.name), []).append(float(ns))
    return {k: statistics.median(v) for k, v in runs.items()}


HIT_CALLS = 400  # single-run calls per round of a translated case
SYN_PORT = 42000  # a new flow's source ports: SYN_PORT .. SYN_PORT + HIT_CALLS - 1, one a call


@dataclass(frozen=True)
class XCase:
    """A translated packet: `frames` are sent one a call, in turn (each SYN its own flow)."""

    name: str
    family: str
    kind: str  # HIT or NEW
    opening: tuple[bytes, ...]
    frames: tuple[bytes, ...]


def hit_cases() -> list[XCase]:
    """A conntrack hit each way and a new flow's SYN, each family, a pod's packets to a ClusterIP
    whose backend is another pod of the node (bpf host routing: routed, rewritten, redirected). The
    frame is rewritten by the run, so timed one run a call (a single run also pays the timer and a
    cold skb: compare these figures with each other, not with the loop figures)."""
    data = b"x" * 64
    out = []
    for fam, client, vip, be in (("IPv4", POD_CLIENT, VIP, BE1), ("IPv6", POD6, VIP6, BE6)):
        opening = (tcp(client, vip, 41000, 80), tcp(be, client, 8080, 41000, flags="SA"))
        out.append(
            XCase(
                f"{fam} pod -> ClusterIP, a segment (hit)",
                fam,
                HIT,
                opening,
                (tcp(client, vip, 41000, 80, flags="A", payload=data),),
            )
        )
        out.append(
            XCase(
                f"{fam} its answer (hit)",
                fam,
                HIT,
                opening,
                (tcp(be, client, 8080, 41000, flags="A", payload=data),),
            )
        )
        syns = tuple(tcp(client, vip, SYN_PORT + i, 80) for i in range(HIT_CALLS))
        out.append(XCase(f"{fam} pod -> ClusterIP, SYN (new flow)", fam, NEW, (), syns))
    return out


def open_flows(dp: Datapath, todo: list[XCase], ifindex: int) -> None:
    """The maps as the run began (no flow, the two Services) and the hit cases' flows opened."""
    reset_maps(dp)
    add_service(dp.maps, VIP, 80, ((1, BE1, 8080, 1),))
    add_service6(dp.maps, VIP6, 80, ((1, BE6, 8080, 1),))
    for c in todo:
        for frame in c.opening:
            prog_run_timed(dp.prog_fd("ekp_from_pod"), frame, ifindex)


def check_verdict(variant: Variant, case: XCase, verdict: int) -> None:
    """A cut build passes the packets it cuts and redirects the others, as the tree does: a cut
    that never ran, or one that broke the other family's path, is not timed as if it measured."""
    want = variant.expected_verdict(case.family, case.kind)
    if verdict != want:
        raise RuntimeError(
            f"{variant.name}, {case.name}: verdict {verdict}, expected {want} "
            f"({'cut' if want == TC_ACT_OK else 'not cut'} by this build)"
        )


def measure_hits(
    dps: dict[str, Datapath], timed: list[Variant], rounds: int, ifindex: int
) -> dict[tuple[str, str], float]:
    """Median over the rounds of the mean ns of HIT_CALLS single runs, for the builds `timed`, each
    run's verdict checked (`check_verdict`); a cut on the new-flow path (`new_only`) on the SYNs
    alone: no flow opens there. Each round starts from fresh maps (the SYNs' flows gone, the hits'
    flows opened again)."""
    todo = hit_cases()
    runs: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for variant in timed:
            name, dp = variant.name, dps[variant.name]
            open_flows(dp, todo, ifindex)
            fd = dp.prog_fd("ekp_from_pod")
            for case in todo:
                if variant.new_only and case.opening:
                    continue  # its cut opens no flow: a hit case would time a miss
                total = 0
                for i in range(HIT_CALLS):
                    verdict, ns = prog_run_timed(fd, case.frames[i % len(case.frames)], ifindex)
                    check_verdict(variant, case, verdict)
                    total += ns
                runs.setdefault((name, case.name), []).append(total / HIT_CALLS)
    return {k: statistics.median(v) for k, v in runs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(v.name for v in VARIANTS), help="comma-separated names")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--bpf-dir", type=Path, default=default_bpf_dir(), help="the tree to patch (bpf/)")
    ap.add_argument("--compare", type=Path, help="another bpf/ tree, measured as it is beside the variants")
    ap.add_argument(
        "--cache",
        default=os.path.join(tempfile.gettempdir(), "ekp-v6cost-cache"),
        help="compiled objects by build id, kept across runs (a variant's build id is its text's)",
    )
    args = ap.parse_args(argv)
    by_name = {v.name: v for v in VARIANTS}
    chosen = [by_name[n] for n in args.variants.split(",")]
    with loaded(chosen, args.bpf_dir, ObjectCache(args.cache), args.compare) as dps, packet_lab() as lab:
        add_ipv6(lab)
        for dp in dps.values():
            reset_maps(dp)
            add_service(dp.maps, VIP, 80, ((1, BE1, 8080, 1),))
            add_service6(dp.maps, VIP6, 80, ((1, BE6, 8080, 1),))
        figures = measure(dps, args.rounds, lambda: lab.pod.ifindex)
        compare = [Variant("compare", f"{args.compare} as it is", whole=True)] if args.compare else []
        timed = [v for v in [*compare, *chosen] if v.whole or v.xlate]
        hits = measure_hits(dps, timed, args.rounds, lab.pod.ifindex)
    names = [c.name for c in cases()]
    print(f"ns per run, median of {args.rounds} rounds of {REPEAT:,} runs (BPF_PROG_TEST_RUN, CPU {CPU})")
    print(f"{'variant':<12} " + " | ".join(f"{n[:26]:>26}" for n in names))
    shown = [*([Variant("compare", f"{args.compare} as it is")] if args.compare else []), *chosen]
    for v in shown:
        print(
            f"{v.name:<12} " + " | ".join(f"{figures.get((v.name, n), float('nan')):>26.1f}" for n in names)
        )
    for v in shown:
        print(f"  {v.name}: {v.what}")
    if hits:
        print(f"translated, one run a call: ns per call, median of {args.rounds} rounds of {HIT_CALLS} calls")
        hit_names = [c.name for c in hit_cases()]
        print(f"{'variant':<12} " + " | ".join(f"{n[:34]:>34}" for n in hit_names))
        for v in timed:
            print(
                f"{v.name:<12} "
                + " | ".join(f"{hits.get((v.name, n), float('nan')):>34.1f}" for n in hit_names)
            )
        for line in whole_spreads(hits, timed):
            print(line)
    return 0


def whole_spreads(hits: dict[tuple[str, str], float], timed: list[Variant]) -> list[str]:
    """Per translated case, the spread over the builds that leave its path as the tree has it
    (`Variant.leaves_whole`): the noise of that column, with no build's change in it."""
    out = []
    for case in hit_cases():
        got = sorted(
            (hits[(v.name, case.name)], v.name)
            for v in timed
            if v.leaves_whole(case.family, case.kind) and (v.name, case.name) in hits
        )
        if not got:
            continue
        figures = [f for f, _ in got]
        out.append(
            f"  {case.name}: median {statistics.median(figures):.1f}, {figures[0]:.1f}-{figures[-1]:.1f} "
            f"over the {len(got)} builds that leave it whole ({', '.join(n for _, n in got)})"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
