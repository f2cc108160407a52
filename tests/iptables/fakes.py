"""A fake IptablesRunner: an in-memory iptables that understands what the proxier and cleanup use.

It keeps tables -> chains -> rule texts and applies iptables-restore --noflush input the way the
kernel does: a `:CHAIN` line creates or flushes, `-A` appends, `-I CHAIN [n]` inserts, `-D` deletes
the first rule of that spec, `-X` deletes an unreferenced chain,
all or nothing per call; rule lines containing a string of `refuse` fail the restore (and --test),
as a kernel refusing a rule would. It answers `-N/-C/-I/-A/-D/-X` commands and renders
iptables-save output. Other commands are recorded and answered from `responses`; `sysctl -n/-w`
default to the `sysctls` dict.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Sequence

from agent.iptables.canonical import canonical_rule
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
        # A kernel that refuses some rules: rule lines containing any of these strings fail the
        # whole restore (and --test), as a rejected rule fails a real iptables-restore.
        self.refuse: set[str] = set()
        self.tests: list[str] = []
        self.saves = 0
        self.iptables_version: tuple[int, ...] = (1, 8, 9)  # >= 1.6.2: --random-fully
        # `sysctl -n/-w` answered from here (unless `responses` has a handler for "sysctl").
        self.sysctls: dict[str, str] = {}

    # ---------------------------------------------------------------------- IptablesRunner

    def restore(self, text: str) -> None:
        self.restores.append(text)
        if self.fail_next_restore:
            self.fail_next_restore = False
            raise IptablesError("iptables-restore: line 3 failed (fake)")
        self.tables = self._apply(text)

    def restore_test(self, text: str) -> str | None:
        self.tests.append(text)
        try:
            self._apply(text)
        except IptablesError as exc:
            return str(exc)
        return None

    def _apply(self, text: str) -> dict[str, dict[str, list[str]]]:
        for n, line in enumerate(text.splitlines(), 1):
            if any(marker in line for marker in self.refuse):
                raise IptablesError(f"iptables-restore: line {n} failed (fake refusal)")
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
            elif line.startswith("-D "):
                chain, _, rest = line[3:].partition(" ")
                want = canonical_rule(rest)
                hit = next((i for i, r in enumerate(table.get(chain, [])) if canonical_rule(r) == want), None)
                if hit is None:
                    raise IptablesError(f"fake restore: -D {chain}: no such rule {rest!r}")
                del table[chain][hit]
            elif line.startswith("-I "):
                chain, _, rest = line[3:].partition(" ")
                at, _, spec = rest.partition(" ")
                if not at.isdigit():
                    at, spec = "1", rest
                if chain not in table:
                    raise IptablesError(f"fake restore: no chain {chain}")
                table[chain].insert(int(at) - 1, spec)
            elif line.startswith("-X "):
                chain = line[3:].strip()
                if chain not in table:
                    raise IptablesError(f"fake restore: -X of missing chain {chain}")
                users = [c for c, rules in table.items() for r in rules if r.endswith(f"-j {chain}")]
                if users:
                    raise IptablesError(f"fake restore: -X {chain}: still referenced from {users[0]}")
                del table[chain]
            else:
                raise IptablesError(f"fake restore: cannot parse {line!r}")
        return staged

    def save(self, table: str | None = None) -> str:
        self.saves += 1
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
        if handler:
            return handler(list(argv))
        if argv[:2] == ["sysctl", "-n"]:
            value = self.sysctls.get(argv[2])
            return (
                Result(0, f"{value}\n")
                if value is not None
                else Result(255, "", f"sysctl: cannot stat {argv[2]}")
            )
        if argv[:2] == ["sysctl", "-w"]:
            key, _, value = argv[2].partition("=")
            self.sysctls[key] = value
        return Result(0)

    def version(self) -> tuple[int, ...]:
        return self.iptables_version

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


class FakeCounters:
    """nfacct counters in memory; `missing` makes ensure fail as on a kernel without nfnetlink_acct."""

    def __init__(self, *, missing: bool = False) -> None:
        self.missing = missing
        self.counters: dict[str, int] = {}

    def ensure(self, name: str) -> None:
        if self.missing:
            raise OSError(2, "No such file or directory (fake: no nfnetlink_acct)")
        self.counters.setdefault(name, 0)

    def read(self, names: Iterable[str] = ()) -> dict[str, int]:
        wanted = set(names) or set(self.counters)
        return {k: v for k, v in self.counters.items() if k in wanted}
