"""Tables as aligned text (stdout) and as Markdown (build/bench.md, the README)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Table:
    title: str
    headers: Sequence[str]
    rows: Sequence[Sequence[str]]
    right: Sequence[bool]  # per column: right-aligned (numbers)
    notes: Sequence[str] = ()

    def text(self) -> str:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

        def line(cells: Sequence[str]) -> str:
            parts = [
                c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, self.right, strict=True)
            ]
            return "  ".join(parts).rstrip()

        out = [self.title, line(self.headers), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.rows]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out) + "\n"

    def markdown(self) -> str:
        out = [f"**{self.title}**", ""]
        out.append("| " + " | ".join(self.headers) + " |")
        out.append("| " + " | ".join("---:" if r else "---" for r in self.right) + " |")
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self.rows]
        if self.notes:
            out.append("")
            out += [f"- {n}" for n in self.notes]
        return "\n".join(out) + "\n"


def num(value: float, digits: int = 0) -> str:
    """Thousands separators, fixed digits; NaN as a dash."""
    if value != value:  # NaN
        return "-"
    return f"{value:,.{digits}f}"


def ratio(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"
