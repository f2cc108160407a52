"""The differential suite: the table of tests/differential/cases.py in eBPF and iptables mode, in
each address family.

One module-scoped fixture, parametrised by family (IPv4, IPv6), runs the whole table in each mode,
the two modes at once (a fresh two-node lab each, about 30 s per mode; a dual-stack lab with
IPv6-only Services for IPv6), and prints both modes' observations side by side. In IPv6 eBPF mode
runs with `--bpf-host-routing=bpf` (runner.mode_flags), so the table's IPv6 cases are decided by the
tc programs' IPv6 path (bpf/ekp_tc6.h) wherever it serves and by the ip6tables proxier beside it
elsewhere (what the path leaves to the stack: its header comment lists it). Each case's printed
detail says which path decided it (paths.py: the case's flows in the tc conntrack tables, against
nf_conntrack's DNATed entries), and the IPv6 run checks that the tc path decided the cases it
always serves (TC6_DECIDES). The tests then hold every case to:

* kube-proxy's outcome (the case's `Expect`): so both modes being equally wrong fails too;
* the other mode: the same verdict, the same backends, the same roles of source address;

unless DIFFERENCES.md has a row for the case in that family, which must then state both modes'
outcomes exactly as observed (a row that no longer holds, or names no case, fails: the list cannot drift).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import require_kernel
from tests.differential import differences
from tests.differential.cases import ANSWERED, CASE_IDS, CASES, FAMILIES, IPV4, REFUSED, TIMED_OUT, Case
from tests.differential.runner import ModeRun, expected_summary, run_mode

MODES = ("ebpf", "iptables")
WALL_BUDGET_S = 90.0  # per mode, lab and agents included
# IPv6 cases the tc IPv6 path decides whatever else it leaves to ip6tables: TCP from a pod to a
# ClusterIP (no source translation), from outside to a NodePort of policy Cluster (translated to
# the node's IPv6 address) and of policy Local (the client's address kept)
TC6_DECIDES = ("cip-from-pod1", "np-node1-from-client", "etp-local-node1-from-client")


def table(runs: dict[str, ModeRun]) -> str:
    """Both modes side by side, one block per case, for an operator reading `pytest -s`."""
    rows = differences.load()
    family = runs[MODES[0]].family
    lines = [
        "",
        f"differential suite, {family}: observations per case (ebpf | iptables | kube-proxy);"
        " 'tc flows': the case's flows in the eBPF conntrack of the tc programs, 'nf_conntrack DNAT':"
        " those iptables/ip6tables translated (neither: refused, dropped, or the socket programs'"
        " at connect(), as the node's own sockets are in eBPF mode)",
    ]
    for case in CASES:
        obs = {m: runs[m].observations[case.id] for m in MODES}
        sums = {m: obs[m].summary(case) for m in MODES}
        want = expected_summary(case)
        mark = "ok  " if sums["ebpf"] == sums["iptables"] == want else "DIFF"
        row = rows.get((case.id, family))
        addr, port = case.address(family)
        lines.append(
            f"{mark} {case.id}: {case.source} -> {case.dest} {addr}:{port}/{case.protocol}"
            + (f" ({case.size} B)" if case.size else "")
            + (f"  [DIFFERENCES.md: {row.kind}]" if row else "")
        )
        for m in MODES:
            detail = obs[m].detail()
            lines.append(f"       {m:<9} {sums[m]}  ({obs[m].seconds}s{'; ' + detail if detail else ''})")
        lines.append(f"       {'expected':<9} {want}")
    for m in MODES:
        lines.append(f"timings {m}: {runs[m].timings}")
    return "\n".join(lines)


@pytest.fixture(scope="module", params=FAMILIES)
def runs(request: pytest.FixtureRequest) -> Iterator[dict[str, ModeRun]]:
    require_kernel()
    family: str = request.param
    # The two modes' labs share nothing and their runs mostly wait (timeouts, affinity expiry):
    # side by side, the table costs the slower mode's time, not the sum.
    with ThreadPoolExecutor(len(MODES)) as pool:
        result = dict(zip(MODES, pool.map(lambda mode: run_mode(mode, CASES, family), MODES), strict=True))
    print(table(result))
    yield result


def outcome(runs: dict[str, ModeRun], case: Case) -> tuple[str, str]:
    return runs["ebpf"].observations[case.id].summary(case), runs["iptables"].observations[case.id].summary(
        case
    )


@pytest.mark.kernel
def test_modes_agree_with_each_other_and_with_kube_proxy(runs: dict[str, ModeRun]) -> None:
    """Every case gives kube-proxy's outcome in both modes, except those with a DIFFERENCES.md row,
    whose row (of this run's family) must match exactly what was observed and be a real difference
    (a fix removes its row in the same change)."""
    documented = differences.load()
    family = runs[MODES[0]].family
    failures = [
        f"{row.case}: no such case in tests/differential/cases.py"
        for row in documented.values()
        if row.case not in CASE_IDS and row.family == family
    ]
    for case in CASES:
        ebpf, iptables = outcome(runs, case)
        want = expected_summary(case)
        row = documented.get((case.id, family))
        if row is None:
            if not ebpf == iptables == want:
                failures.append(f"{case.id}:\n  ebpf:     {ebpf}\n  iptables: {iptables}\n  expected: {want}")
            continue
        if row.ebpf == row.iptables == want:
            failures.append(f"{row.case}: the row records no difference; remove it")
        if (ebpf, iptables) != (row.ebpf, row.iptables):
            failures.append(
                f"{row.case} ({row.kind}) changed:\n  ebpf:     {ebpf}\n            (listed: {row.ebpf})"
                f"\n  iptables: {iptables}\n            (listed: {row.iptables})\n  expected: {want}"
            )
    assert not failures, (
        "differences not as tests/differential/DIFFERENCES.md lists them (fix them, or list them there):\n"
        + "\n".join(failures)
    )


@pytest.mark.kernel
def test_the_tc_path_decides_the_cases_it_always_serves(runs: dict[str, ModeRun]) -> None:
    """In IPv6 eBPF mode the tc IPv6 path, not ip6tables, translated every flow of TC6_DECIDES (a
    run with the path off, `--bpf-socket-lb=false`, leaves them all to ip6tables, and fails here;
    on main before v6legacy a run with legacy host routing did too). In iptables mode,
    either family, nf_conntrack holds them all: the counts read the right tables (a count that
    read nothing would pass the check of nf_conntrack in eBPF mode)."""
    family = runs[MODES[0]].family
    assert set(TC6_DECIDES) <= set(CASE_IDS), "a case of TC6_DECIDES is no longer in the table"
    failures = []
    for case in (c for c in CASES if c.id in TC6_DECIDES):
        for mode in MODES:
            d = runs[mode].observations[case.id].decided
            assert d is not None, (mode, case.id)
            tc_path = mode == "ebpf" and family != IPV4
            if tc_path and (d.tc_total < case.count or d.nf_total):
                failures.append(f"{case.id} ({mode}): not the tc IPv6 path's: {d.text()}")
            if mode == "iptables" and d.nf_total < case.count:
                failures.append(f"{case.id} ({mode}): not nf_conntrack's: {d.text()}")
    assert not failures, "\n".join(failures)


@pytest.mark.kernel
def test_each_mode_runs_the_table_within_its_budget(runs: dict[str, ModeRun]) -> None:
    for mode in MODES:
        assert runs[mode].timings["total"] < WALL_BUDGET_S, (mode, runs[mode].timings)
        assert set(runs[mode].observations) == set(CASE_IDS), mode


def test_every_drop_and_reject_has_a_positive_control() -> None:
    """A drop is a timeout, and an address nothing programmed times out too (the lab routes a stray
    cluster IP or LB IP nowhere): a dropped case proves nothing unless the same address, port and
    protocol answers in another case, from a source the Service allows. A TCP reject is an ICMP port
    unreachable, which probe.py tells from the RST a node's own stack sends on a NodePort nothing
    programmed; a UDP one is not distinguishable at a node address, so it needs the same control."""
    answered = {(c.address(), c.protocol) for c in CASES if c.expect.verdict == ANSWERED}
    node_ips = {c.address()[0] for c in CASES if c.dest.startswith("nodeport@")}
    missing = [
        c.id
        for c in CASES
        if (
            c.expect.verdict == TIMED_OUT
            or (c.expect.verdict == REFUSED and c.protocol == "UDP" and c.address()[0] in node_ips)
        )
        and (c.address(), c.protocol) not in answered
    ]
    assert not missing, f"cases without a positive control at their address: {missing}"


def test_differences_file_parses_and_rejects_bad_rows(tmp_path: Path) -> None:
    """The reader refuses what would let the list and the suite drift apart silently."""
    differences.load()  # the real file parses
    head = "| case | family | kind | ebpf | iptables | reason |\n| --- | --- | --- | --- | --- | --- |\n"
    bad = {
        "| x | IPv4 | maybe | a | b | r |\n": "kind",
        "| x | IPv5 | bug | a | b | r |\n": "family",
        "| x | IPv6 | bug | a | b |  |\n": "reason",
        "| x | IPv6 | bug | a | b | r |\n| x | IPv6 | bug | a | b | r |\n": "twice",
        "| x | IPv4 | bug | a | b |\n": "cells",
    }
    for body, word in bad.items():
        path = tmp_path / "d.md"
        path.write_text(head + body)
        with pytest.raises(ValueError, match=word):
            differences.load(path)
    path.write_text(head + "| x | IPv4 | bug | a | b | r |\n| x | IPv6 | bug | a | b | r |\n")
    assert set(differences.load(path)) == {("x", "IPv4"), ("x", "IPv6")}, "one row per family"
