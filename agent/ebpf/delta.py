"""Old MapContents, new MapContents -> the ordered map writes that turn one into the other.

Pure. The order is what keeps a packet from ever seeing a half-written service (Katran's and
Cilium's rule: write what is pointed at before what points at it, unlink before deleting):

1. backends, their membership, reverse-NAT entries and source ranges that are new or changed;
2. slots that are new or changed (a set that grows gets its new slots before its count grows;
   a slot whose backend changes points at a backend written in step 1);
3. frontends that are new or changed (counts grow after their slots exist, shrink before the
   slots beyond them go; a frontend moving to another set finds that set complete);
4. frontends that are gone;
5. slots that are gone (beyond the new counts, or of sets no frontend uses any more);
6. membership and source ranges that are gone (a backend that left a service port stops
   being honoured by affinity and UDP flows once no slot holds it);
7. reverse-NAT entries that are gone (no frontend points at them after step 4);
8. backends that are gone (no slot points at them after step 5).

An entry whose key and value are unchanged is never written, and never deleted and re-added.
Consecutive writes of the same map and kind form one batch (one `Op`). Conntrack and affinity
are not part of MapContents: they are never flushed (the data path checks that a remembered
backend still exists). cfg[0] is written by the proxier before the delta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from agent.ebpf.plan import MapContents


class OpKind(StrEnum):
    UPDATE = "update"
    DELETE = "delete"


@dataclass(frozen=True)
class Op:
    """One batch: update `entries` (key, value) or delete their keys (value None) in one map."""

    role: str
    kind: OpKind
    entries: tuple[tuple[Any, Any], ...]

    @property
    def keys(self) -> list[Any]:
        return [k for k, _ in self.entries]

    def __str__(self) -> str:
        return f"{self.kind.value} {self.role} x{len(self.entries)}"


def _updates(old: Mapping[Any, Any], new: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    return [(k, v) for k, v in new.items() if old.get(k) != v]


def _deletes(old: Mapping[Any, Any], new: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    return [(k, None) for k in old if k not in new]


def diff(old: MapContents, new: MapContents) -> list[Op]:
    """The ordered, batched writes that make maps holding `old` hold `new`."""
    steps: list[tuple[str, OpKind, list[tuple[Any, Any]]]] = [
        ("be", OpKind.UPDATE, _updates(old.be, new.be)),
        ("member", OpKind.UPDATE, _updates(old.member, new.member)),
        ("rnat", OpKind.UPDATE, _updates(old.rnat, new.rnat)),
        ("srcr", OpKind.UPDATE, _updates(old.srcr, new.srcr)),
        ("slot", OpKind.UPDATE, _updates(old.slot, new.slot)),
        ("fe", OpKind.UPDATE, _updates(old.fe, new.fe)),
        ("fe", OpKind.DELETE, _deletes(old.fe, new.fe)),
        ("slot", OpKind.DELETE, _deletes(old.slot, new.slot)),
        ("member", OpKind.DELETE, _deletes(old.member, new.member)),
        ("srcr", OpKind.DELETE, _deletes(old.srcr, new.srcr)),
        ("rnat", OpKind.DELETE, _deletes(old.rnat, new.rnat)),
        ("be", OpKind.DELETE, _deletes(old.be, new.be)),
    ]
    ops: list[Op] = []
    for role, kind, entries in steps:
        if not entries:
            continue
        if ops and ops[-1].role == role and ops[-1].kind is kind:
            ops[-1] = Op(role, kind, ops[-1].entries + tuple(entries))
        else:
            ops.append(Op(role, kind, tuple(entries)))
    return ops


def apply_op(contents: MapContents, op: Op) -> None:
    """Change `contents` in place as `op` changes the maps (to track what was written)."""
    table = contents.table(op.role)
    if op.kind is OpKind.UPDATE:
        table.update(op.entries)
    else:
        for key in op.keys:
            table.pop(key, None)


def apply_ops(contents: MapContents, ops: Sequence[Op]) -> MapContents:
    """A copy of `contents` with every op applied."""
    out = contents.copy()
    for op in ops:
        apply_op(out, op)
    return out


class BatchWriter(Protocol):
    """The writes `write_op` needs of a map (agent.ebpf.maps.BpfMap and FakeMap have them)."""

    def update_batch(self, entries: Sequence[tuple[Any, Any]], /) -> object: ...

    def delete_batch(self, keys: Sequence[Any], /) -> object: ...


def write_op(maps: Mapping[str, BatchWriter], op: Op) -> None:
    """Perform one op on real (or fake) maps."""
    target = maps[op.role]
    if op.kind is OpKind.UPDATE:
        target.update_batch(list(op.entries))
    else:
        target.delete_batch(op.keys)


def summary(ops: Sequence[Op]) -> str:
    """`update be x2, update fe x4` for the sync log line; `no changes` when empty."""
    return ", ".join(str(op) for op in ops) or "no changes"
