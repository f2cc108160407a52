"""Decoded map contents (`MapContents`): what `--dry-run`, the golden files and `agent inspect` print.

Pure. The planner (`agent.ebpf.planner`) keeps entries as plain tuples; this module turns them, or
the entries of live maps, into ctypes keys and values that `agent.ebpf.render` prints, so a plan
and a live node render the same text and can be compared with `diff`.

    plan(state, node, config)   the contents a first sync on an empty node writes
    read_contents(maps, cfg)    the contents of live (or fake) maps
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from agent.config import Config, NodeContext
from agent.ebpf import abi
from agent.ebpf.abi import (
    Addr,
    AddrKey,
    Backend,
    BackendKey,
    Frontend,
    FrontendKey,
    Member,
    MemberKey,
    RevNat,
    RevNatKey,
    Slot,
    SlotKey,
    SrcRange,
    SrcRangeKey,
)
from agent.ebpf.codec import KEYS, VALUES
from agent.ebpf.entries import ORDER, to_ctypes
from agent.ebpf.planner import ROLES, Planner
from agent.model.types import ProxyState


@dataclass
class MapContents:
    """Entries of the service maps, by role, as ctypes keys and values (equal by field values).

    `fe_names` (frontend -> "ns/name:port") annotates dry-run output and is not part of any map.
    """

    fe: dict[FrontendKey, Frontend] = field(default_factory=dict)
    slot: dict[SlotKey, Slot] = field(default_factory=dict)
    be: dict[BackendKey, Backend] = field(default_factory=dict)
    rnat: dict[RevNatKey, RevNat] = field(default_factory=dict)
    member: dict[MemberKey, Member] = field(default_factory=dict)
    srcr: dict[SrcRangeKey, SrcRange] = field(default_factory=dict)
    addr: dict[AddrKey, Addr] = field(default_factory=dict)
    cfg: abi.Config | None = None
    fe_names: dict[FrontendKey, str] = field(default_factory=dict)

    def table(self, role: str) -> dict[Any, Any]:
        """The entries of one map role ("fe", "slot", "be", "rnat", "member", "srcr" or "addr")."""
        if role not in ROLES:
            raise KeyError(role)
        table: dict[Any, Any] = getattr(self, role)
        return table

    def copy(self) -> MapContents:
        return replace(
            self,
            fe=dict(self.fe),
            slot=dict(self.slot),
            be=dict(self.be),
            rnat=dict(self.rnat),
            member=dict(self.member),
            srcr=dict(self.srcr),
            addr=dict(self.addr),
            fe_names=dict(self.fe_names),
        )

    def same_entries(self, other: MapContents) -> bool:
        """Equal map entries (cfg included); names are not compared."""
        return self.cfg == other.cfg and all(self.table(r) == other.table(r) for r in ROLES)


class MapReader(Protocol):
    """What `read_contents` needs of a map: its entries as (key, value) ctypes pairs."""

    def items(self) -> Iterable[tuple[Any, Any]]: ...


def read_contents(maps: Mapping[str, MapReader], cfg: abi.Config | None = None) -> MapContents:
    """MapContents of live (or fake) maps, keyed by role; missing roles read as empty."""
    out = MapContents(cfg=cfg)
    for role in ROLES:
        reader = maps.get(role)
        if reader is None:
            continue
        table = out.table(role)
        for key, value in reader.items():
            table[abi.copy_struct(key)] = abi.copy_struct(value)
    return out


def planner_contents(planner: Planner) -> MapContents:
    """What the planner wants the maps to hold, decoded."""
    out = MapContents()
    for role in ROLES:
        out.table(role).update(to_ctypes(role, planner.desired[role]))
    if planner.cfg is not None:
        out.cfg = VALUES["cfg"].to_ctype(planner.cfg)
    fe_key, size = KEYS["fe"].ctype, KEYS["fe"].size
    out.fe_names = {
        fe_key.from_buffer_copy(k.to_bytes(size, ORDER)): name for k, name in planner.fe_names().items()
    }
    return out


def plan(state: ProxyState, node: NodeContext, config: Config) -> MapContents:
    """The contents a first sync of `state` on an empty node writes (the `--dry-run` output)."""
    planner = Planner(config)
    planner.update(state, node, None)
    return planner_contents(planner)
