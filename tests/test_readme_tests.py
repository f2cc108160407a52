"""Every test the documentation names as evidence exists.

The README's feature table says, row by row, which test shows a behaviour; a renamed or deleted
test would leave the row pointing at nothing, and the table would still read as proven. A name
ending in `_` or `...` stands for the tests it begins (a row naming a family of tests).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The round-by-round histories moved out of the README name tests as evidence too.
DOCS = [
    REPO / "README.md",
    REPO / "bpf" / "README.md",
    REPO / "tests" / "upstream_e2e.md",
    REPO / "bench" / "results" / "scale" / "ROUNDS.md",
    REPO / "bench" / "results" / "suite" / "RUNS.md",
]
NAMED = re.compile(r"`(test_[A-Za-z0-9_]+)(\.\.\.)?")
DEFINED = re.compile(r"^\s*(?:async\s+)?def (test_[A-Za-z0-9_]+)", re.M)


def defined_tests() -> set[str]:
    names: set[str] = set()
    for root in ("tests", "lab"):
        for path in (REPO / root).rglob("*.py"):
            names.update(DEFINED.findall(path.read_text()))
    return names


def named_tests(doc: Path) -> set[tuple[str, bool]]:
    """(name, is_prefix) for every backticked test name in `doc`."""
    return {(m[1], bool(m[2]) or m[1].endswith("_")) for m in NAMED.finditer(doc.read_text())}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_the_doc_names_exists(doc: Path) -> None:
    defined = defined_tests()
    named = named_tests(doc)
    missing = sorted(
        name
        for name, prefix in named
        if not (any(d.startswith(name) for d in defined) if prefix else name in defined)
    )
    assert named, f"{doc.name} names no test: the pattern no longer reads it"
    assert not missing, f"{doc.name} names tests that do not exist: {missing}"


def test_a_missing_name_is_found() -> None:
    """Positive control: the check reads a name that is not defined as missing."""
    defined = defined_tests()
    assert "test_every_test_the_doc_names_exists" in defined
    assert "test_no_such_test_at_all" not in defined
