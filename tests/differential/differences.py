"""DIFFERENCES.md, read by the test: one row per case whose outcome is not kube-proxy's in both modes.

The file holds one Markdown table with the columns `case | family | kind | ebpf | iptables | reason`:
`family` is the run the row holds in (IPv4 or IPv6: IPv6 eBPF mode is the tc programs' IPv6 path,
not IPv4's code, so a case can differ in one family alone); `kind` is "intended" (a documented
choice, the reason says why) or "bug" (not fixed yet, the reason says what is wrong); `ebpf` and
`iptables` are the observed outcomes in `Observation.summary`'s words. The test requires each row
to still hold exactly, so a fix or a regression shows up as a failure and the row is updated or
removed in the same change: the list and the suite cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PATH = Path(__file__).with_name("DIFFERENCES.md")
KINDS = ("intended", "bug")
FAMILIES = ("IPv4", "IPv6")
COLUMNS = ["case", "family", "kind", "ebpf", "iptables", "reason"]


@dataclass(frozen=True)
class Difference:
    case: str
    family: str
    kind: str
    ebpf: str
    iptables: str
    reason: str


def _cells(line: str) -> list[str]:
    return [c.strip().strip("`").strip() for c in line.strip().strip("|").split("|")]


def load(path: Path = PATH) -> dict[tuple[str, str], Difference]:
    """The rows of the file's table by (case id, family); ValueError names a malformed or repeated
    row."""
    rows: dict[tuple[str, str], Difference] = {}
    header_seen = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.lstrip().startswith("|"):
            continue
        cells = _cells(line)
        if not header_seen:
            if [c.lower() for c in cells] != COLUMNS:
                raise ValueError(f"{path.name}:{n}: the table's header must be {' | '.join(COLUMNS)}")
            header_seen = True
            continue
        if set("".join(cells)) <= set("-: "):
            continue  # the separator row
        if len(cells) != len(COLUMNS):
            raise ValueError(f"{path.name}:{n}: {len(cells)} cells, want {len(COLUMNS)}")
        row = Difference(*cells)
        if row.family not in FAMILIES:
            raise ValueError(f"{path.name}:{n}: family {row.family!r} is not one of {FAMILIES}")
        if row.kind not in KINDS:
            raise ValueError(f"{path.name}:{n}: kind {row.kind!r} is not one of {KINDS}")
        if not row.reason:
            raise ValueError(f"{path.name}:{n}: a difference needs its reason")
        if (row.case, row.family) in rows:
            raise ValueError(f"{path.name}:{n}: case {row.case} is listed twice in {row.family}")
        rows[row.case, row.family] = row
    return rows
