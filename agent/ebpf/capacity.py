"""How full each BPF map is, and how much of a conntrack table is live: `agent inspect capacity`.

Per map (the registry abi.MAPS): entries, capacity (max_entries as the kernel reports it), fill
(entries / capacity) and, for the conntrack tables, how many entries are live (not expired by the
timeouts of the live config: an LRU table keeps dead entries until it needs their room, so a
full table is normal; a table full of *live* entries is the pressure to act on: raise
--bpf-ct-global-tcp-max / --bpf-ct-global-any-max). Arrays are fixed: their entries are their
capacity. Evictions of live flows show up as `drop_no_flow` in `agent inspect stats`.

`fill_of` and `render_capacity` are pure; `read_fill` walks the maps (one batch dump each) and is
what a metrics collector calls (agent.metrics' engineer: the `MapFill` fields are the gauges).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.ebpf import abi
from agent.ebpf.abi import CT_ROLES, MAPS, CtEntry, CtFlag, CtKey, MapSpec

_ARRAYS = frozenset({"array", "percpu_array"})

# The data path's defaults for a config entry left 0 (bpf/ekp_ct.h EKP_DEFAULT_*).
_DEFAULTS = {
    "tcp_established_s": 86400,
    "tcp_close_wait_s": 3600,
    "tcp_syn_s": 60,
    "tcp_closed_s": 10,
    "udp_s": 30,
    "udp_stream_s": 120,
}


@dataclass(frozen=True)
class MapFill:
    role: str
    name: str
    kind: str
    writer: str
    entries: int
    capacity: int
    live: int | None = None  # conntrack tables: entries not expired

    @property
    def fill(self) -> float:
        return self.entries / self.capacity if self.capacity else 0.0

    @property
    def pressure(self) -> float:
        """Live entries (or all, where liveness is not known) over capacity."""
        used = self.entries if self.live is None else self.live
        return used / self.capacity if self.capacity else 0.0


def ct_timeout_s(cfg: abi.Config | None, proto: int, flags: int) -> int:
    """The idle timeout of a conntrack entry, as bpf/ekp_ct.h ekp_ct_timeout_ns computes it."""

    def get(name: str) -> int:
        value = int(getattr(cfg, name, 0)) if cfg is not None else 0
        return value or _DEFAULTS[name]

    if proto == socket.IPPROTO_TCP:
        if flags & CtFlag.RST or (flags & CtFlag.FIN_FWD and flags & CtFlag.FIN_REPLY):
            return get("tcp_closed_s")
        if flags & (CtFlag.FIN_FWD | CtFlag.FIN_REPLY):
            return get("tcp_close_wait_s")
        return get("tcp_established_s") if flags & CtFlag.ESTABLISHED else get("tcp_syn_s")
    return get("udp_stream_s") if flags & CtFlag.ESTABLISHED else get("udp_s")


def live_entries(entries: Iterable[tuple[Any, Any]], cfg: abi.Config | None, now_ns: int) -> int:
    """How many conntrack entries are not expired at `now_ns` (CLOCK_MONOTONIC)."""
    live = 0
    for key, entry in entries:
        if not isinstance(key, CtKey) or not isinstance(entry, CtEntry):
            continue
        idle_s = (now_ns - entry.last_seen_ns) / 1e9
        if idle_s <= ct_timeout_s(cfg, key.proto, entry.flags):
            live += 1
    return live


def fill_of(spec: MapSpec, entries: int, capacity: int, live: int | None = None) -> MapFill:
    return MapFill(spec.role, spec.name, spec.kind, spec.writer.value, entries, capacity, live)


def read_fill(
    maps: Mapping[str, Any], capacities: Mapping[str, int], cfg: abi.Config | None, now_ns: int
) -> list[MapFill]:
    """MapFill of every map of the registry found in `maps` (BpfMap or alike), in registry order."""
    out = []
    for role, spec in MAPS.items():
        m = maps.get(role)
        if m is None:
            continue
        capacity = capacities[role]
        if spec.kind in _ARRAYS:
            out.append(fill_of(spec, capacity, capacity))
        elif role in CT_ROLES:
            items = m.items()
            out.append(fill_of(spec, len(items), capacity, live_entries(items, cfg, now_ns)))
        else:
            out.append(fill_of(spec, len(m.items()), capacity))  # batch dumps: faster than keys
    return out


def render_capacity(fills: Iterable[MapFill]) -> str:
    """One line per map: `ekp_ct_tcp_v2 lru_hash datapath 1200/262144 0.5% live 800 0.3%`."""
    lines = []
    for f in fills:
        line = f"{f.name:<15} {f.kind:<12} {f.writer:<8} {f.entries}/{f.capacity} {100 * f.fill:.1f}%"
        if f.live is not None:
            line += f" live {f.live} {100 * f.pressure:.1f}%"
        if f.kind in _ARRAYS:
            line = f"{f.name:<15} {f.kind:<12} {f.writer:<8} {f.capacity} fixed"
        lines.append(line)
    return "".join(line + "\n" for line in lines)
