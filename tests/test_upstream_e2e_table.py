"""tests/upstream_e2e.md cannot point at nothing nor claim more than its tests: every project test
it names exists, every row has a status of the agreed forms, a row that names no test says why, a
row is "both" only when the project's tests dial from every source upstream's test dials from, and
the counts the README quotes are the table's.

Pure: the test files are parsed (their `def test_` names), nothing is collected or run.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "tests" / "upstream_e2e.md"
README = REPO / "README.md"
UPSTREAM_FILES = {
    "service.go",
    "networking.go",
    "conntrack.go",
    "loadbalancer.go",
    "kube_proxy.go",
    "dual_stack.go",
}
REF = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")
STATUS = re.compile(r"^(both\b|fails in (ebpf|iptables): |needs |not covered\b)")
SOURCES = {"pod", "endpoint pod", "host network", "external", "none"}
COLUMNS = ["File", "Upstream test", "Upstream sources", "Project test(s)", "Project sources", "Status"]


def rows() -> list[list[str]]:
    out = []
    for line in TABLE.read_text().splitlines():
        if not line.startswith("| ") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip()[1:-1].split("|")]
        if cells[0] == "File":
            assert cells == COLUMNS, cells
            continue
        if cells[0] not in UPSTREAM_FILES:
            continue  # another table (the README's feature table, if the rows move there)
        assert len(cells) == len(COLUMNS), line
        out.append(cells)
    return out


def sources(cell: str) -> set[str]:
    return {s.strip() for s in cell.split(",")}


LAB_TESTS = ("tests/traffic/", "tests/differential/")  # real agents, real traffic, both modes


def defined_tests(path: str) -> set[str]:
    return set(re.findall(r"^def (test_\w+)\(", (REPO / path).read_text(), flags=re.M))


def test_the_table_has_one_row_per_upstream_test() -> None:
    table = rows()
    assert len(table) == 102
    assert {r[0] for r in table} == UPSTREAM_FILES
    dupes = [k for k, n in Counter((r[0], r[1]) for r in table).items() if n > 1]
    assert not dupes, dupes


@pytest.mark.parametrize("row", rows(), ids=lambda r: f"{r[0]}:{r[1][:60]}")
def test_every_named_project_test_exists_and_every_row_has_a_status(row: list[str]) -> None:
    _, name, upstream, tests, project, status = row
    assert STATUS.match(status), f"{name}: status {status!r}"
    assert sources(upstream) <= SOURCES and sources(project) <= SOURCES, f"{name}: {upstream!r} {project!r}"
    refs = REF.findall(tests)
    assert refs or not tests, f"{name}: unparsable project tests {tests!r}"
    for path, func in refs:
        assert (REPO / path).exists(), f"{name}: {path} does not exist"
        assert func in defined_tests(path), f"{name}: {path} has no {func}"
    if status.startswith(("both", "fails in")):
        assert refs, f"{name}: a covered row names its test"
        assert any(p.startswith(LAB_TESTS) for p, _ in refs), f"{name}: covered by a lab test"
    if not refs:
        assert status.startswith(("needs ", "not covered")), f"{name}: no test, so it says why"
        assert project == "none", f"{name}: no project test, so no project source"


@pytest.mark.parametrize("row", rows(), ids=lambda r: f"{r[0]}:{r[1][:60]}")
def test_both_only_when_the_project_dials_from_every_upstream_source(row: list[str]) -> None:
    """A row whose upstream test also dials from a source the project's tests do not (the node's own
    network namespace, say) cannot be "both" on the strength of the sources they do dial from."""
    _, name, upstream, _, project, status = row
    missing = sources(upstream) - sources(project)
    if status.startswith("both"):
        assert not missing, f"{name}: 'both', but the project never dials from {sorted(missing)}"


# What "needs" rows may lack, as their status names it, and how the README counts each.
CAPABILITIES = {
    "SCTP": "SCTP from the node's own sockets in eBPF mode",
    "localhost NodePort packets": "a count of localhost NodePort packets in eBPF mode",
}


def counts() -> dict[str, int]:
    table = rows()
    needs = [r[5] for r in table if r[5].startswith("needs ")]
    for status in needs:
        named = [c for c in CAPABILITIES if c in status]
        assert len(named) == 1, f"needs what? one of {list(CAPABILITIES)}: {status}"
    return {
        "total": len(table),
        "both": sum(r[5].startswith("both") for r in table),
        "fails": sum(r[5].startswith("fails in") for r in table),
        "needs": len(needs),
        **{c: sum(c in s for s in needs) for c in CAPABILITIES},
        "not covered": sum(r[5].startswith("not covered") for r in table),
    }


def readme_sentence(c: dict[str, int]) -> str:
    """The README's sentence about the table, as these counts make it."""
    lacking = "; ".join(f"{what}: {c[key]}" for key, what in CAPABILITIES.items())
    return (
        f"{c['total']} tests. {c['both']} run in the lab in both modes from every source upstream's test "
        f"dials from; {c['needs']} need a capability the lab or eBPF mode lacks ({lacking}); "
        f"{c['not covered']} are not covered:"
    )


def test_the_counts_by_status_are_the_readmes() -> None:
    """The README quotes the table's counts: they are recomputed here and looked up there."""
    c = counts()
    assert c["total"] == c["both"] + c["fails"] + c["needs"] + c["not covered"], c
    readme = " ".join(README.read_text().split())
    assert readme_sentence(c) in readme, (
        f"README.md's upstream paragraph is out of date; it should read: {readme_sentence(c)!r}"
    )


def test_the_readme_check_fails_on_a_changed_count() -> None:
    """The check above compares figures, not a fixed string: one row more changes the sentence."""
    c = counts()
    assert readme_sentence({**c, "both": c["both"] + 1}) not in " ".join(README.read_text().split())
