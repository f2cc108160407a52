"""The documentation's pointers lead somewhere: links between the docs, and sections named in prose.

The README's history moved to files beside the results (bench/results/scale/ROUNDS.md,
bench/results/HISTORY.md), and code comments, tests and the other docs name sections by title
("README, "Machine facts""). A moved or renamed section would leave such a pointer naming
nothing, and nothing else would notice. Checked here, without a kernel:

- every relative Markdown link in the docs reaches a file, and its `#anchor` a heading there
  (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens);
- every section a file names as `README, "Title"` (or bpf/README.md's, or a history file's) is a
  heading, a bold lead or a paragraph's opening words in that document.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROUNDS = REPO / "bench" / "results" / "scale" / "ROUNDS.md"
BENCH_HISTORY = REPO / "bench" / "results" / "HISTORY.md"
SUITE_RUNS = REPO / "bench" / "results" / "suite" / "RUNS.md"
DOCS = [
    REPO / "README.md",
    REPO / "bpf" / "README.md",
    REPO / "tests" / "upstream_e2e.md",
    ROUNDS,
    BENCH_HISTORY,
    SUITE_RUNS,
]

LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)

# "README, "Title"", "bpf/README.md ("Title"", "bench/results/scale/ROUNDS.md, "Title"": a document,
# then a quoted title that starts as a title does (a capital or a code span), not a Python string.
POINTER = re.compile(
    r"(?<![\w/.\"])((?:bench/results/scale/)?ROUNDS\.md|bench/results/HISTORY\.md|bpf/README(?:\.md)?"
    r"|README(?:\.md)?)[,:]?\s*\(?\"([A-Z`][^\"]{3,100})\""
)
POINTED = {
    "README": REPO / "README.md",
    "README.md": REPO / "README.md",
    "bpf/README": REPO / "bpf" / "README.md",
    "bpf/README.md": REPO / "bpf" / "README.md",
    "ROUNDS.md": ROUNDS,
    "bench/results/scale/ROUNDS.md": ROUNDS,
    "bench/results/HISTORY.md": BENCH_HISTORY,
}
# Where pointers are written: the code, its tests, the lab, the chart, and the docs themselves
# (results files are records of their day and are left as they were written).
POINTER_ROOTS = ["agent", "bench", "tests", "lab", "bpf", "demo", "scripts", "charts"]
POINTER_SUFFIXES = {".py", ".h", ".c", ".md", ".sh", ".yaml"}


def anchor(title: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every heading's anchor; a repeated heading's later anchors take -1, -2, ... as GitHub's do."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(doc.read_text()):
        a = anchor(title)
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        name, _, frag = target.partition("#")
        path = (doc.parent / name).resolve() if name else doc
        reached = path.exists() and (not frag or (path.suffix == ".md" and frag in anchors(path)))
        if not reached:
            broken.append(target)
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_between_the_docs_resolves(doc: Path) -> None:
    assert doc.exists(), f"{doc} is gone: take it out of DOCS, or put it back"
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(REPO)} links to what is not there: {broken}"


def test_a_link_to_a_moved_heading_is_found(tmp_path: Path) -> None:
    """Positive control: an anchor no heading has, and a file that is not there, are both broken."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n### Cold start: what the verifier costs (round of 2026-11-27)\n\n"
        "[ok](#cold-start-what-the-verifier-costs-round-of-2026-11-27) [gone](#cold-start)"
        " [missing](nowhere.md) [web](https://example.com/x)\n"
    )
    assert broken_links(doc) == ["#cold-start", "nowhere.md"]


def titles(doc: Path) -> list[str]:
    """What a prose pointer may name in `doc`: its headings, its bold leads, and the opening words
    of its paragraphs; whitespace folded and code spans' backticks dropped."""
    text = doc.read_text()
    heads = HEADING.findall(text)
    bold = re.findall(r"\*\*(.+?)\*\*", " ".join(text.split()))
    paragraphs = [p.split("\n", 1)[0] for p in re.split(r"\n\s*\n", text)]
    return [" ".join(t.replace("`", "").split()) for t in heads + bold + paragraphs]


def prose(text: str) -> str:
    """`text` with comment markers at line starts dropped and whitespace folded, so that a pointer
    wrapped over comment lines reads as one."""
    return " ".join(
        " ".join(re.sub(r"^\s*(?:#+|\*+|//+)(?=\s)", "", line) for line in text.splitlines()).split()
    )


def dangling_pointers(files: list[Path]) -> list[tuple[Path, str, str]]:
    """(file, document, title) for every pointer whose title the document does not hold."""
    cache: dict[Path, list[str]] = {}
    dangling = []
    for path in files:
        for doc_name, title in POINTER.findall(prose(path.read_text(errors="replace"))):
            doc = POINTED[doc_name]
            known = cache.setdefault(doc, titles(doc))
            wanted = title.replace("`", "")
            if not any(t.startswith(wanted) for t in known):
                dangling.append((path, doc_name, title))
    return dangling


def pointer_files() -> list[Path]:
    files = [p for p in DOCS if p.parent != REPO / "tests"]
    for root in POINTER_ROOTS:
        for path in sorted((REPO / root).rglob("*")):
            parts = path.relative_to(REPO).parts
            if (
                path.suffix in POINTER_SUFFIXES
                and "__pycache__" not in parts
                and parts[:2] != ("bench", "results")
            ):
                files.append(path)
    return [p for p in files if p != Path(__file__).resolve()]  # this file's pointers are its controls


def test_every_section_a_pointer_names_is_there() -> None:
    files = pointer_files()
    assert REPO / "agent" / "model" / "parse.py" in files
    dangling = [f'{p.relative_to(REPO)}: {doc}, "{title}"' for p, doc, title in dangling_pointers(files)]
    assert not dangling, f"pointers to sections that are not there: {dangling}"


def test_a_pointer_to_a_moved_section_is_found(tmp_path: Path) -> None:
    """Positive control: the verifier's round moved from the README to ROUNDS.md, so a pointer to it
    in the README dangles and one to ROUNDS.md does not; a pointer wrapped over comment lines is
    read whole; "Machine facts" is the README's; a Python string is no pointer."""
    src = tmp_path / "x.py"
    src.write_text(
        '# (README, "Cold start: what the verifier costs"; ROUNDS.md, "Cold start: what the\n'
        '# verifier costs"; README "Machine facts")\nDOC = REPO / "README.md", "Not a title"\n'
    )
    assert dangling_pointers([src]) == [(src, "README", "Cold start: what the verifier costs")]
