"""bench/v6cost.py without a kernel: every variant's cut applies to this tree's C once, where it
says (a stale anchor raises, naming it), a cut build must pass what it cuts and redirect the rest,
the SYN column's spread leaves out the builds that change its path, and the translated cases are
the packets they claim."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.ebpf.loader import default_bpf_dir
from bench import v6cost


@pytest.mark.parametrize("variant", v6cost.VARIANTS, ids=lambda v: v.name)
def test_every_variant_patches_this_tree_once_per_patch(tmp_path: Path, variant: v6cost.Variant) -> None:
    source = Path(default_bpf_dir())
    tree = v6cost.patched_tree(tmp_path, variant, source)
    for p in variant.patches:
        text = (tree / p.file).read_text()
        assert p.new in text and (source / p.file).read_text().count(p.old) == 1
    changed = sum(
        1 for f in source.iterdir() if f.is_file() and (tree / f.name).read_bytes() != f.read_bytes()
    )
    assert changed == len({p.file for p in variant.patches})


def test_a_cut_build_must_pass_the_packets_it_cuts_and_redirect_the_others() -> None:
    by = {v.name: v for v in v6cost.VARIANTS}
    cases = {(c.family, c.kind): c for c in v6cost.hit_cases()}
    assert len(cases) == 4  # a hit each way shares its (family, kind)
    # A hit cut of one family: that family's hits passed, its SYN and the other family redirected.
    v6ct = by["v6x-ct"]
    v6cost.check_verdict(v6ct, cases["IPv6", v6cost.HIT], v6cost.TC_ACT_OK)
    for key in (("IPv6", v6cost.NEW), ("IPv4", v6cost.HIT), ("IPv4", v6cost.NEW)):
        v6cost.check_verdict(v6ct, cases[key], v6cost.TC_ACT_REDIRECT)
        with pytest.raises(RuntimeError, match=r"expected 7 \(not cut by this build\)"):
            v6cost.check_verdict(v6ct, cases[key], v6cost.TC_ACT_OK)
    with pytest.raises(RuntimeError, match=r"v6x-ct, IPv6 .*: verdict 7, expected 0 \(cut by this build\)"):
        v6cost.check_verdict(v6ct, cases["IPv6", v6cost.HIT], v6cost.TC_ACT_REDIRECT)
    # A whole build redirects everything, whatever it changed on the way.
    for case in cases.values():
        with pytest.raises(RuntimeError):
            v6cost.check_verdict(by["v4-hit-norp"], case, v6cost.TC_ACT_OK)
    # Every cut on the translated path says what it cuts, in one family, and only a cut does.
    for v in v6cost.VARIANTS:
        assert bool(v.cuts) == v.xlate and len({f for f, _ in v.cuts}) <= 1, v.name
        assert not (v.new_only and (v.cuts & {("IPv4", v6cost.HIT), ("IPv6", v6cost.HIT)})), v.name


# The SYN column of bench/results/v6xlate-attribution-2026-11-28.txt, section 1.
SYN_FIGURES = {
    "IPv4": {"tree": 2372.8, "v6-hit-norp": 2513.4, "v4-hit-norp": 2349.2, "v6-src-direct": 2509.3,
             "v6-src-noneigh": 2567.1, "v6x-ct": 2397.2, "v6x-src": 2430.0, "v6x-adv": 2561.6,
             "v6x-route": 2458.5, "v6x-rw": 2451.4, "v6x-nsrc": 2449.4, "v6x-nroute": 2478.3,
             "v6x-create": 2489.3, "v4x-ct": 2514.6, "v4x-pick": 781.3, "v4x-dec": 1661.1,
             "v4x-src": 1992.1, "v4x-route": 2102.7, "v4x-rw": 2472.2},
    "IPv6": {"tree": 3125.5, "v6-hit-norp": 3166.2, "v4-hit-norp": 3041.5, "v6-src-direct": 3217.0,
             "v6-src-noneigh": 3151.8, "v6x-ct": 3112.3, "v6x-src": 3024.9, "v6x-adv": 3151.1,
             "v6x-route": 3039.9, "v6x-rw": 2995.0, "v6x-nsrc": 1284.2, "v6x-nroute": 1733.2,
             "v6x-create": 2646.6, "v4x-ct": 3054.6, "v4x-pick": 3147.1, "v4x-dec": 3017.2,
             "v4x-src": 3055.7, "v4x-route": 3165.6, "v4x-rw": 3129.1},
}  # fmt: skip


def test_the_syn_columns_noise_is_taken_over_builds_that_leave_its_path_as_the_tree_has_it() -> None:
    hits = {
        (name, f"{fam} pod -> ClusterIP, SYN (new flow)"): ns
        for fam, figures in SYN_FIGURES.items()
        for name, ns in figures.items()
    }
    lines = v6cost.whole_spreads(hits, list(v6cost.VARIANTS))
    v4 = next(line for line in lines if line.startswith("  IPv4 pod -> ClusterIP, SYN"))
    v6 = next(line for line in lines if line.startswith("  IPv6 pod -> ClusterIP, SYN"))
    # v4-hit-norp drops the SYN's source check too, v6-src-* change its lookup: neither counts.
    assert "median 2468.4, 2372.8-2567.1 over the 12 builds" in v4 and "v4-hit-norp" not in v4
    assert "median 3125.5, 3017.2-3166.2 over the 9 builds" in v6 and "v6-src-" not in v6
    assert "v4x-" not in v4 and "v6x-" not in v6  # a cut in the family's own program changes its code


def test_the_translated_cases_are_a_hit_each_way_and_a_syn_per_call_each_family() -> None:
    from scapy.layers.inet import IP, TCP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    cases = {c.name: c for c in v6cost.hit_cases()}
    assert len(cases) == 6
    for fam, layer in (("IPv4", IP), ("IPv6", IPv6)):
        syn = cases[f"{fam} pod -> ClusterIP, SYN (new flow)"]
        assert not syn.opening and len(syn.frames) == v6cost.HIT_CALLS
        ports = {Ether(f)[TCP].sport for f in syn.frames}
        assert len(ports) == v6cost.HIT_CALLS  # each call a flow of its own
        assert all(Ether(f)[TCP].flags == "S" and layer in Ether(f) for f in syn.frames)
        hit = cases[f"{fam} pod -> ClusterIP, a segment (hit)"]
        answer = cases[f"{fam} its answer (hit)"]
        assert hit.opening == answer.opening and len(hit.frames) == len(answer.frames) == 1
        assert [Ether(f)[TCP].flags for f in hit.opening] == ["S", "SA"]
        assert Ether(hit.frames[0])[TCP].sport == Ether(hit.opening[0])[TCP].sport
        assert Ether(answer.frames[0])[TCP].dport == Ether(hit.opening[0])[TCP].sport
