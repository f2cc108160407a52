"""How full each BPF map is, and how much of a conntrack table is live: `agent inspect capacity`.

Per map (the registry abi.MAPS): entries, capacity (max_entries as the kernel reports it), fill
(entries / capacity) and, for the conntrack tables (IPv4's and the tc IPv6 path's), how many
entries are live (not expired by the timeouts of the live config: an LRU table keeps dead
entries until it needs their room, so a full table is normal; a table full of *live* entries is
the pressure to act on: raise --bpf-ct-global-tcp-max / --bpf-ct-global-any-max, which size the
IPv6 tables too). Live conntrack entries are split by state:
assured (established, open), unassured (handshake not completed, UDP not a stream) and closed
(RST or FINs both ways); the early-drop queues (bpf/ekp_ctq.h) keep the last two to at most half
of each table, and the flows they deleted are counted by state (`early drops` line, from the
counters). Arrays are fixed: their entries are their capacity. Evictions of live assured flows
(a table full of them) show up as `drop_no_flow` in `agent inspect stats`.

`fill_of` and `render_capacity` are pure; `read_fill` walks the maps (one batch dump each) and is
what a metrics collector calls (agent.metrics' engineer: the `MapFill` fields are the gauges).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.ebpf import abi
from agent.ebpf.abi import (
    CT6_ROLES,
    CT_ROLES,
    EVICTIONS,
    MAPS,
    Ct6Entry,
    Ct6Key,
    CtEntry,
    CtFlag,
    CtKey,
    MapSpec,
    Stat,
)

_ARRAYS = frozenset({"array", "percpu_array"})

# The data path's defaults for a config entry left 0 (bpf/ekp_ct.h EKP_DEFAULT_*).
_DEFAULTS = {
    "tcp_established_s": 86400,
    "tcp_close_wait_s": 3600,
    "tcp_syn_s": 60,
    "tcp_closed_s": 10,
    "udp_s": 30,
    "udp_stream_s": 120,
    "tcp_orphan_s": 300,
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
    states: tuple[tuple[str, int], ...] = ()  # conntrack tables: live entries by CT_STATES

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
            state = get("tcp_closed_s")
        elif flags & (CtFlag.FIN_FWD | CtFlag.FIN_REPLY):
            state = get("tcp_close_wait_s")
        else:
            state = get("tcp_established_s") if flags & CtFlag.ESTABLISHED else get("tcp_syn_s")
        # bpf/ekp_ct.h ekp_ct_life: an ORPHAN flow (its backend left) is abandoned sooner
        return min(state, get("tcp_orphan_s")) if flags & CtFlag.ORPHAN else state
    return get("udp_stream_s") if flags & CtFlag.ESTABLISHED else get("udp_s")


CT_STATES = ("assured", "unassured", "closed")


def ct_state(flags: int) -> str:
    """What the early-drop queue sees in a flow (bpf/ekp_ctq.h ekp_ctq_evictable): closed (RST, or
    FINs both ways), else assured (established), else unassured."""
    if flags & CtFlag.RST or (flags & CtFlag.FIN_FWD and flags & CtFlag.FIN_REPLY):
        return "closed"
    return "assured" if flags & CtFlag.ESTABLISHED else "unassured"


def live_states(entries: Iterable[tuple[Any, Any]], cfg: abi.Config | None, now_ns: int) -> dict[str, int]:
    """Conntrack entries not expired at `now_ns` (CLOCK_MONOTONIC), by CT_STATES."""
    out = dict.fromkeys(CT_STATES, 0)
    for key, entry in entries:
        if not isinstance(key, CtKey | Ct6Key) or not isinstance(entry, CtEntry | Ct6Entry):
            continue
        idle_s = (now_ns - entry.last_seen_ns) / 1e9
        if idle_s <= ct_timeout_s(cfg, key.proto, entry.flags):
            out[ct_state(entry.flags)] += 1
    return out


def live_entries(entries: Iterable[tuple[Any, Any]], cfg: abi.Config | None, now_ns: int) -> int:
    """How many conntrack entries are not expired at `now_ns` (CLOCK_MONOTONIC)."""
    return sum(live_states(entries, cfg, now_ns).values())


def fill_of(
    spec: MapSpec, entries: int, capacity: int, live: int | None = None, states: dict[str, int] | None = None
) -> MapFill:
    return MapFill(
        spec.role,
        spec.name,
        spec.kind,
        spec.writer.value,
        entries,
        capacity,
        live,
        tuple((states or {}).items()),
    )


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
        elif role in CT_ROLES or role in CT6_ROLES:  # the tc IPv6 path's: the same timeouts
            items = m.items()
            states = live_states(items, cfg, now_ns)
            out.append(fill_of(spec, len(items), capacity, sum(states.values()), states))
        else:
            out.append(fill_of(spec, len(m.items()), capacity))  # batch dumps: faster than keys
    return out


def render_capacity(fills: Iterable[MapFill], counters: Mapping[Stat, int] | None = None) -> str:
    """One line per map: `ekp_ct_tcp_v2 lru_hash datapath 1200/262144 0.5% live 800 0.3% assured
    700 unassured 90 closed 10`; with `counters` (ekp_stats), the flows the early-drop queues
    deleted, by state: `early drops unreplied 0 unassured 52 closed 7`."""
    lines = []
    for f in fills:
        line = f"{f.name:<15} {f.kind:<12} {f.writer:<8} {f.entries}/{f.capacity} {100 * f.fill:.1f}%"
        if f.live is not None:
            line += f" live {f.live} {100 * f.pressure:.1f}%"
            line += "".join(f" {state} {n}" for state, n in f.states)
        if f.kind in _ARRAYS:
            line = f"{f.name:<15} {f.kind:<12} {f.writer:<8} {f.capacity} fixed"
        lines.append(line)
    if counters is not None:
        lines.append("early drops" + "".join(f" {state} {counters[s]}" for s, state in EVICTIONS.items()))
    return "".join(line + "\n" for line in lines)
