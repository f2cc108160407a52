"""A fake IptablesRunner: an in-memory iptables that understands what the proxier and cleanup use.

It keeps tables -> chains -> rule texts, applies iptables-restore --noflush input the way the
kernel does (a `:CHAIN` line creates or flushes, `-A` appends, `-X` deletes, all-or-nothing per
call), answers `-N/-C/-I/-A/-D/-X` commands and renders iptables-save output. Commands other than
iptables (sysctl, conntrack) are recorded and answered from `responses`.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence

from agent.iptables.runner import IptablesError, Result

BUILTIN = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
}


def _rule_text(args: Sequence[str]) -> str:
    return " ".join(f'"{a}"' if " " in a else a for a in args)


class FakeRunner:
    backend = "nft"

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, list[str]]] = {t: {c: [] for c in cs} for t, cs in BUILTIN.items()}
        self.restores: list[str] = []
        self.commands: list[list[str]] = []
        self.iptables_calls: list[tuple[str, ...]] = []
        self.fail_next_restore = False
        self.responses: dict[str, Callable[[list[str]], Result]] = {}

    # ---------------------------------------------------------------------- IptablesRunner

    def restore(self, text: str) -> None:
        self.restores.append(text)
        if self.fail_next_restore:
            self.fail_next_restore = False
            raise IptablesError("iptables-restore: line 3 failed (fake)")
        staged = {t: {c: list(r) for c, r in chains.items()} for t, chains in self.tables.items()}
        table: dict[str, list[str]] | None = None
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("*"):
                table = staged.setdefault(line[1:], {})
            elif line == "COMMIT":
                table = None
            elif table is None:
                raise IptablesError(f"fake restore: {line!r} outside a table")
            elif line.startswith(":"):
                table[line[1:].split()[0]] = []
            elif line.startswith("-A "):
                chain, _, rest = line[3:].partition(" ")
                if chain not in table:
                    raise IptablesError(f"fake restore: no chain {chain}")
                parts = f" {rest}".split(" -j ")
                target = parts[-1].split()[0] if len(parts) > 1 else ""
                if target.startswith("KUBE-") and target not in table:
                    raise IptablesError(f"fake restore: jump to missing chain {target}")
                table[chain].append(rest)
            elif line.startswith("-X "):
                chain = line[3:].strip()
                if chain not in table:
                    raise IptablesError(f"fake restore: -X of missing chain {chain}")
                del table[chain]
            else:
                raise IptablesError(f"fake restore: cannot parse {line!r}")
        self.tables = staged

    def save(self, table: str | None = None) -> str:
        out: list[str] = []
        for name, chains in self.tables.items():
            if table and name != table:
                continue
            out.append(f"*{name}")
            for chain in chains:
                policy = "ACCEPT" if chain in BUILTIN.get(name, ()) else "-"
                out.append(f":{chain} {policy} [0:0]")
            for chain, rules in chains.items():
                out += [f"-A {chain} {r}" for r in rules]
            out.append("COMMIT")
        return "\n".join(out) + "\n"

    def run(self, *args: str) -> Result:
        self.iptables_calls.append(args)
        argv = list(args)
        table = "filter"
        if argv[:1] == ["-t"]:
            table, argv = argv[1], argv[2:]
        op, chain, rest = argv[0], argv[1], argv[2:]
        chains = self.tables.setdefault(table, {})
        text = _rule_text(rest)
        if op == "-N":
            if chain in chains:
                return Result(1, "", "iptables: Chain already exists.")
            chains[chain] = []
            return Result(0)
        if chain not in chains:
            return Result(1, "", f"iptables: No chain/target/match by that name ({chain}).")
        if op == "-C":
            return Result(0 if text in chains[chain] else 1)
        if op == "-I":
            chains[chain].insert(0, text)
            return Result(0)
        if op == "-A":
            chains[chain].append(text)
            return Result(0)
        if op == "-D":
            if text not in chains[chain]:
                return Result(1, "", "iptables: Bad rule (does a matching rule exist in that chain?).")
            chains[chain].remove(text)
            return Result(0)
        if op == "-X":
            del chains[chain]
            return Result(0)
        raise AssertionError(f"fake iptables: unsupported {args}")

    def command(self, argv: Sequence[str]) -> Result:
        self.commands.append(list(argv))
        handler = self.responses.get(argv[0])
        return handler(list(argv)) if handler else Result(0)

    def version(self) -> tuple[int, ...]:
        return (1, 8, 9)

    # ---------------------------------------------------------------------- test helpers

    def rules(self, table: str, chain: str) -> list[str]:
        return list(self.tables.get(table, {}).get(chain, []))

    def chains(self, table: str) -> set[str]:
        return set(self.tables.get(table, {}))

    def load(self, argv_lines: str) -> None:
        """Preload rules written by someone else, `iptables -t T -A CHAIN ...` style lines."""
        for line in argv_lines.strip().splitlines():
            r = self.run(*shlex.split(line))
            assert r.returncode == 0, (line, r)
