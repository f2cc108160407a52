"""Rules compared by meaning, not by spelling: what we wrote against what iptables-save prints. Pure.

A full sync must notice that the kernel no longer holds what we programmed (a `iptables -t nat -F`
that left the chains, a rule deleted or inserted by hand) without rewriting every chain on every
sync: at 10,000 services a complete iptables-nft-restore takes minutes. So the proxier keeps a
digest per chain of what it wrote, reads the kernel back with one iptables-save, and compares.

iptables-save does not print a rule the way it was written: it reorders matches (`-d` and `-p`
first), adds `/32` to addresses, quotes every comment, spells `--or-mark 0x4000` as
`--set-xmark 0x4000/0x4000` (nft backend), prints the probability `0.5000000000` as `0.50000000000`
and adds defaults (`--reject-with icmp-port-unreachable`, recent's `--mask 255.255.255.255
--rsource`; ip6tables-save `icmp6-port-unreachable`, a 128-bit mask and `/128` on addresses).
`canonical_rule` maps both spellings to one string: the rule's options as a sorted set
of normalised `(option, values)` groups, module loads (`-m tcp`) dropped, since every option we use
names its module unambiguously. The kernel test loads every golden ruleset into both backends and
checks that each chain's digest read back equals the digest of the text we wrote.

Only our own rules need to map exactly; anything foreign in our chains merely has to differ, and it
does (an extra rule changes the digest whatever its spelling).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|(\S+)')
_ADDRESS_OPTIONS = {
    "-s": "-s",
    "--source": "-s",
    "--src": "-s",
    "-d": "-d",
    "--destination": "-d",
    "--dst": "-d",
}
# Options whose value iptables-save (and ip6tables-save: ICMPv6's port-unreachable, a 128-bit
# mask) adds when it was left at its default.
_DEFAULTS = {
    ("--reject-with", "icmp-port-unreachable"),
    ("--reject-with", "icmp6-port-unreachable"),
    ("--mask", "255.255.255.255"),
    ("--mask", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
    ("--rsource",),
}
_GROUP_SEP = "\x1f"
_TOKEN_SEP = "\x1e"


@dataclass
class Dump:
    """iptables-restore input or iptables-save output, per table: chains in order of appearance,
    each with its rules (the text after `-A CHAIN `), and the chains deleted (`-X`)."""

    chains: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    deleted: dict[str, set[str]] = field(default_factory=dict)

    def table(self, name: str) -> dict[str, list[str]]:
        return self.chains.get(name, {})


def parse(text: str) -> Dump:
    """Lines of either format: `*table`, `:CHAIN POLICY [c:b]` (declares, and in a restore flushes),
    `-A CHAIN args`, `-X CHAIN`, `COMMIT`; comments and blank lines skipped."""
    dump = Dump()
    table: dict[str, list[str]] | None = None
    table_name = ""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            table_name = line[1:].strip()
            table = dump.chains.setdefault(table_name, {})
        elif line == "COMMIT":
            table = None
        elif table is None:
            continue
        elif line.startswith(":"):
            table.setdefault(line[1:].split(" ", 1)[0], [])
        elif line.startswith("-A "):
            chain, _, rest = line[3:].partition(" ")
            table.setdefault(chain, []).append(rest)
        elif line.startswith("-X "):
            dump.deleted.setdefault(table_name, set()).add(line[3:].strip())
    return dump


def _tokens(args: str) -> list[tuple[str, bool]]:
    """(token, quoted) pairs; a quoted token is always a value, never an option."""
    out: list[tuple[str, bool]] = []
    for m in _TOKEN.finditer(args):
        if m.group(1) is not None:
            out.append((re.sub(r"\\(.)", r"\1", m.group(1)), True))
        else:
            out.append((m.group(2), False))
    return out


def _hex(value: str) -> str:
    try:
        return hex(int(value, 16))
    except ValueError:
        return value


def _mark(value: str, default_mask: str = "0xffffffff") -> str:
    mark, _, mask = value.partition("/")
    return f"{_hex(mark)}/{_hex(mask or default_mask)}"


_HOST_IPV4 = re.compile(r"(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3})(?:/32)?")


def _address(value: str) -> str:
    m = _HOST_IPV4.fullmatch(value)
    if m is not None:  # the common case, fast: one address, with or without its /32
        return f"{m.group(1)}/32"
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        return value


def _normalise(group: list[str]) -> tuple[str, ...] | None:
    """One option with its values in a single spelling; None for groups that carry no meaning."""
    negated = group[0] == "!"
    opt, values = (group[1], group[2:]) if negated else (group[0], group[1:])
    bang = ("!",) if negated else ()
    if opt in ("-m", "--match"):
        return None
    if (opt, *values) in _DEFAULTS:
        return None
    if opt in _ADDRESS_OPTIONS:
        return (*bang, _ADDRESS_OPTIONS[opt], *(_address(v) for v in values))
    if opt in ("-p", "--protocol"):
        return (*bang, "-p", *(v.lower() for v in values))
    if opt == "-j" or opt == "--jump":
        return ("-j", *values)
    if opt == "--probability" and values:
        return (opt, f"{float(values[0]):.6f}")
    if opt == "--or-mark" and values:
        return ("--set-xmark", _mark(f"{values[0]}/{values[0]}"))
    if opt == "--xor-mark" and values:
        return ("--set-xmark", _mark(f"{values[0]}/0"))
    if opt in ("--set-xmark", "--mark") and values:
        return (*bang, opt, _mark(values[0]))
    if opt in ("--ctstate", "--state") and values:
        return (*bang, "--ctstate", ",".join(sorted(values[0].split(","))))
    if opt in ("--dport", "--sport", "--seconds") and values:
        return (*bang, opt, str(int(values[0])) if values[0].isdigit() else values[0])
    return (*bang, opt, *values)


@lru_cache(maxsize=1 << 16)
def canonical_rule(args: str) -> str:
    """A rule's arguments (after `-A CHAIN`) as one string that is the same for our spelling and
    iptables-save's."""
    groups: list[list[str]] = []
    pending_bang = False
    for token, quoted in _tokens(args):
        if not quoted and token == "!":
            pending_bang = True
            continue
        if not quoted and token.startswith("-") and not _is_number(token):
            groups.append(["!", token] if pending_bang else [token])
            pending_bang = False
        elif groups:
            groups[-1].append(token)
            if pending_bang:  # `--opt ! value` (old spelling): the negation belongs to the option
                groups[-1].insert(0, "!")
                pending_bang = False
        else:
            groups.append([token])
    normalised = (_normalise(g) for g in groups)
    return _GROUP_SEP.join(sorted(_TOKEN_SEP.join(g) for g in normalised if g is not None))


def _is_number(token: str) -> bool:
    return token[1:].isdigit()


def digest(rules: Iterable[str]) -> bytes:
    """The digest of one chain: its rules in order, each in canonical form."""
    h = hashlib.blake2b(digest_size=16)
    for rule in rules:
        h.update(canonical_rule(rule).encode())
        h.update(b"\n")
    return h.digest()


def chain_digests(
    dump: Dump, tables: Iterable[str] = ("filter", "nat"), cache: DigestCache | None = None
) -> dict[tuple[str, str], bytes]:
    """(table, chain) -> digest for every chain of `tables` in the dump."""
    compute = cache.digest if cache is not None else digest
    return {(t, c): compute(rules) for t in tables for c, rules in dump.table(t).items()}


class DigestCache:
    """Canonical digests of chains already seen, keyed by a hash of their text as spelled.

    Canonicalising every rule of a 10,000-service ruleset (84,000 rules, twice: the kernel's and
    ours) on every full sync took tens of seconds; the text of an unchanged chain is byte for byte
    what it was at the previous sync, on either side. So the raw text is hashed (fast, in C) and
    only chains not seen before are canonicalised. Entries not used for two generations (`age()`,
    once per full sync) are dropped, so the cache holds about the current ruleset.
    """

    def __init__(self) -> None:
        self._current: dict[bytes, bytes] = {}
        self._previous: dict[bytes, bytes] = {}

    def digest(self, rules: list[str]) -> bytes:
        raw = hashlib.blake2b("\n".join(rules).encode(), digest_size=16).digest()
        found = self._current.get(raw)
        if found is None:
            found = self._previous.get(raw)
            if found is None:
                found = digest(rules)
            self._current[raw] = found
        return found

    def age(self) -> None:
        self._previous, self._current = self._current, {}
