"""Maglev consistent hashing (Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load
Balancer", NSDI 2016, section 3.4): the lookup table of one backend set. Pure.

Each backend gets a permutation of the table's positions from two hashes of its name: `offset`
in [0, M) and `skip` in [1, M); its j-th preference is (offset + j * skip) mod M, which visits
every position because M is prime. The table is filled in rounds: in each round every backend, in
turn, takes its next preferred position still free, until all M are taken. So:

* balance: every backend holds floor(M/N) or ceil(M/N) positions (one per round, and the last
  round is cut short);
* disruption: a backend that leaves frees its positions, and the others' permutations say who
  takes them; positions of the survivors mostly stay with them, but not all (the rounds are
  filled in a different order once a backend is missing): Maglev trades a little disruption for
  its balance. tests/ebpf/test_maglev.py measures the extra.

The names are what every node sees alike (the endpoint's address and port), and the order of the
rounds follows the names sorted: every node with the same backends builds the same table, so a
flow's hash names the same backend whichever node it reaches, and again after its conntrack
entry is lost. The hashes are SHA-256 (the standard library's, the same on every machine and
Python): the first 8 bytes give the offset, the next 8 the skip.

Cost: 2-5 ms of CPU for M = 16381 and 2-100 backends in CPython here; a table is built again only
when its set's backends change (agent/ebpf/maglev_writer.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Sequence

from agent.ebpf.abi import FrontendFlag

DEFAULT_TABLE_SIZE = 16381  # Cilium's default (--bpf-lb-maglev-table-size)
MAGLEV_FLAG = int(FrontendFlag.MAGLEV)


def _offset_skip(name: str, m: int) -> tuple[int, int]:
    digest = hashlib.sha256(name.encode()).digest()
    h1 = int.from_bytes(digest[:8], "big")
    h2 = int.from_bytes(digest[8:16], "big")
    return h1 % m, h2 % (m - 1) + 1


def populate(names: Sequence[str], m: int = DEFAULT_TABLE_SIZE) -> list[int]:
    """The table: for each of the `m` positions, the index in `names` of the backend it names.
    `names` must be distinct; their order does not matter (they are filled in sorted order). An
    empty set has an empty table."""
    if m < 2:
        raise ValueError(f"a Maglev table needs a prime size, not {m}")
    if len(set(names)) != len(names):
        raise ValueError("backend names must be distinct")
    if not names:
        return []
    order = sorted(range(len(names)), key=lambda i: names[i])
    pos: list[int] = []
    skip: list[int] = []
    for i in order:
        o, s = _offset_skip(names[i], m)
        pos.append(o)
        skip.append(s)
    entry = [-1] * m
    filled = 0
    n = len(order)
    while True:
        for k in range(n):
            c, step = pos[k], skip[k]
            while entry[c] >= 0:
                c += step
                if c >= m:
                    c -= m
            entry[c] = order[k]
            c += step
            pos[k] = c - m if c >= m else c
            filled += 1
            if filled == m:
                return entry


def backend_name(addr: str, port: int) -> str:
    """A backend as every node names it (not its id, which each agent allocates)."""
    return f"{addr}:{port}"


# ---------------------------------------------------------------------------------- tables to write


def wanted_tables(
    frontends: Iterable[tuple[int, int, int]],
    slot_of: Callable[[int, int], int | None],
    backend_of: Callable[[int], tuple[str, int] | None],
) -> dict[int, tuple[tuple[str, ...], tuple[int, ...]]]:
    """The sets that need a table: set id -> (backend names, their ids), both in slot order.

    `frontends`: (set id, count, flags) of every desired frontend (those with FrontendFlag.MAGLEV
    and a count need their set's table); `slot_of(set id, position)`: the backend id there;
    `backend_of(id)`: its (address, port)."""
    out: dict[int, tuple[tuple[str, ...], tuple[int, ...]]] = {}
    for set_id, count, flags in frontends:
        if not flags & MAGLEV_FLAG or not count or set_id in out:
            continue
        names: list[str] = []
        ids: list[int] = []
        for pos in range(1, count + 1):
            bid = slot_of(set_id, pos)
            be = backend_of(bid) if bid else None
            if bid and be:
                names.append(backend_name(*be))
                ids.append(bid)
        if names:
            out[set_id] = (tuple(names), tuple(ids))
    return out


def table_bytes(names: Sequence[str], ids: Sequence[int], m: int) -> bytes:
    """The value of ekp_maglev for one set: each position's backend id, native-order u32s."""
    return array("I", [ids[i] for i in populate(names, m)]).tobytes()
