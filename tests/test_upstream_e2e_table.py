"""tests/upstream_e2e.md cannot point at nothing: every project test it names exists, every row
has a status of the agreed forms, and a row that names no test says why.

Pure: the test files are parsed (their `def test_` names), nothing is collected or run.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "tests" / "upstream_e2e.md"
UPSTREAM_FILES = {"service.go", "networking.go", "conntrack.go", "loadbalancer.go", "kube_proxy.go"}
REF = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")
STATUS = re.compile(r"^(both\b|fails in (ebpf|iptables): |needs |not covered\b)")


def rows() -> list[list[str]]:
    out = []
    for line in TABLE.read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| File") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip()[1:-1].split("|")]
        if cells[0] not in UPSTREAM_FILES:
            continue  # another table (the README's feature table, if the rows move there)
        assert len(cells) == 4, line
        out.append(cells)
    return out


LAB_TESTS = ("tests/traffic/", "tests/differential/")  # real agents, real traffic, both modes


def defined_tests(path: str) -> set[str]:
    return set(re.findall(r"^def (test_\w+)\(", (REPO / path).read_text(), flags=re.M))


def test_the_table_has_one_row_per_upstream_test() -> None:
    table = rows()
    assert len(table) == 87
    assert {r[0] for r in table} == UPSTREAM_FILES
    dupes = [k for k, n in Counter((r[0], r[1]) for r in table).items() if n > 1]
    assert not dupes, dupes


@pytest.mark.parametrize("row", rows(), ids=lambda r: f"{r[0]}:{r[1][:60]}")
def test_every_named_project_test_exists_and_every_row_has_a_status(row: list[str]) -> None:
    _, name, tests, status = row
    assert STATUS.match(status), f"{name}: status {status!r}"
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


def test_the_counts_by_status() -> None:
    """The figures the README quotes; update both together."""
    counts = Counter(r[3].split(":")[0].split(" (")[0].split()[0] for r in rows())
    assert counts == {"both": 75, "needs": 10, "not": 2}, counts
