"""bench/v6cost.py without a kernel: every variant's cut applies to this tree's C once, where it
says (a stale anchor raises, naming it), and the translated cases are the packets they claim."""

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


def test_a_variant_is_timed_on_the_translated_packets_when_whole_or_cut_on_their_path() -> None:
    xlate = [v for v in v6cost.VARIANTS if v.xlate]
    assert {v.name for v in xlate} == {v.name for v in v6cost.XLATE_VARIANTS}
    assert all(not v.whole and v.patches for v in xlate)
    # each cut on the translated path ends the program there, in the hook it names
    for v in xlate:
        assert all("v6cost cut" in p.new for p in v.patches), v.name


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
