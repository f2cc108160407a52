"""Tables as aligned text (stdout) and as Markdown (bench/results/*.md, the README).

`python -m bench.report --readme` puts the newest run of bench/results/ (or `--file`'s) into the
README, between the two `bench-results` markers, exactly as `bench.record.render` renders it;
tests/test_bench_results.py checks that the README holds what its cited file renders. Without
`--readme` it prints the rendering.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


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


README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"<!-- bench-results: (\S+) -->\n.*?<!-- /bench-results -->\n", re.DOTALL)
# The flood part's block: the newest run that measured it (bench/flood.py), which may be a run of
# that part alone.
FLOOD_BLOCK = re.compile(r"<!-- bench-flood: (\S+) -->\n.*?<!-- /bench-flood -->\n", re.DOTALL)


def readme_block(path: Path, marker: str = "bench-results") -> str:
    """The README's benchmark block for one results file, markers included. The flood block holds
    the flood table alone (its file may be a whole run, whose other tables are in the main block)."""
    from bench import record

    rel = path.resolve().relative_to(record.REPO)
    parts = ("flood",) if marker == "bench-flood" else None
    return f"<!-- {marker}: {rel} -->\n{record.render(record.load(path), rel, parts)}<!-- /{marker} -->\n"


def cited(readme: str, block: re.Pattern[str] = BLOCK) -> Path:
    """The results file the README's block names."""
    from bench import record

    m = block.search(readme)
    if m is None:
        raise ValueError(f"README.md has no {block.pattern.split(':')[0][5:]} block")
    return record.REPO / m.group(1)


def main(argv: Sequence[str] | None = None) -> int:
    from bench import record

    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    p.add_argument("--file", type=Path, help="a results file (default: the newest in bench/results/)")
    p.add_argument("--readme", action="store_true", help="rewrite README.md's benchmark block")
    a = p.parse_args(argv)
    path = a.file or record.newest()
    if not a.readme:
        sys.stdout.write(record.render(record.load(path), path))
        return 0
    text = README.read_text()
    if BLOCK.search(text) is None:
        print("README.md has no <!-- bench-results: ... --> block to rewrite", file=sys.stderr)
        return 1
    text = BLOCK.sub(lambda _: readme_block(path), text, count=1)
    print(f"README.md: benchmark tables from {path}")
    if a.file is None and FLOOD_BLOCK.search(text) is not None:
        flood_path = record.newest(part="flood")
        text = FLOOD_BLOCK.sub(lambda _: readme_block(flood_path, "bench-flood"), text, count=1)
        print(f"README.md: flood table from {flood_path}")
    README.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
