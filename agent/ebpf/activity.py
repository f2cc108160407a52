"""Arming the flow-activity check of the data path (`ekp_act_v2`, bpf/ekp_act.h).

The programs stamp both endpoints of a flow (its frontend, its backend) in `ekp_act` whenever they
stamp one of its conntrack entries, and a packet whose two endpoints no live flow stamped leaves
without a conntrack lookup. That is right only when every live flow has its stamps: flows that
programs of an older agent started (an upgrade; a downgrade and back) have none. So slot 0 of the
array says whether the stamps are complete, and at every start the agent

1. `disarm`s the check before its programs are attached (every packet takes the lookups);
2. attaches them, replacing whatever ran before: from then on every new stamp is written;
3. `arm`s it: stamps the endpoints of every live entry the conntrack tables hold (entries that
   older programs wrote included) with the time now, then sets slot 0.

The stamp is "now", not the entry's own last_seen_ns, so a slot the programs stamped meanwhile is
never set back: an endpoint stamped here looks active for one longest timeout, which only costs
the lookups. Expired entries (an LRU table keeps them until it needs their room) are left out.

`slot` mirrors ekp_act_slot (tests/ebpf/test_datapath_activity.py checks the two agree).
"""

from __future__ import annotations

import ctypes
import logging
import struct
import time
from collections.abc import Iterable, Mapping
from typing import Any

from agent.ebpf.abi import (
    ACT_SHIFT,
    ACT_SLOTS,
    CT6_ROLES,
    CT_ROLES,
    Act,
    Ct6Entry,
    Ct6Key,
    CtDir,
    CtEntry,
    CtKey,
)
from agent.ebpf.capacity import ct_timeout_s
from agent.ebpf.codec import KEYS, VALUES
from agent.ebpf.maps import MapWriter, read_config

log = logging.getLogger(__name__)

ARMED = 0  # the slot that says the stamps are complete (no endpoint hashes to it)
_M32 = 0xFFFFFFFF
_WORDS6 = struct.Struct("=4I")  # the four __be32 words as the programs load them


def slot(addr_be: int, port_be: int, proto: int) -> int:
    """ekp_act_slot: the slot of an endpoint (address and port as abi.ip_be / abi.port_be give them)."""
    h = (addr_be * 0x9E3779B1) & _M32
    h ^= (((port_be << 8) | proto) * 0x85EBCA6B) & _M32
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & _M32
    h ^= h >> 12
    h &= ACT_SLOTS - 1
    return h or 1


def _as_is(addr: Any) -> int:
    return int(addr)


def fold6(addr: bytes) -> int:
    """ekp_fold6: an IPv6 address (16 bytes, network order) folded to the 32 bits an IPv4 one has
    in a slot (abi.ip_be's form)."""
    a, b, c, d = _WORDS6.unpack(addr)
    return int(a ^ b ^ c ^ d)


def stamp_of(now_ns: int) -> int:
    """ekp_act_stamp_of: the stamp of a CLOCK_MONOTONIC time (never 0)."""
    return ((now_ns >> ACT_SHIFT) & _M32) or 1


def age_ns(now_ns: int, then_ns: int) -> int:
    """ekp_age_ns: how long ago `then_ns` was, in 64-bit serial arithmetic (a time written as "N s
    before now" on a machine up for less than N s wrapped below zero)."""
    age = (now_ns - then_ns) & 0xFFFFFFFFFFFFFFFF
    return age - (1 << 64) if age >= 1 << 63 else age


def endpoints(key: CtKey, entry: CtEntry) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The (address, port, protocol) of a flow's frontend and backend, from one of its entries."""
    frontend = (entry.fe_addr, entry.fe_port, key.proto)
    if key.dir == CtDir.FORWARD:
        return frontend, (entry.nat_addr, entry.nat_port, key.proto)
    return frontend, (key.saddr, key.sport, key.proto)


def stamp4(act: MapWriter, entries: Iterable[tuple[CtKey, CtEntry]], now_ns: int | None = None) -> int:
    """`stamp6` for IPv4 conntrack entries the agent stamped seen (the hand-back out of eBPF mode,
    agent/takeover/out_of_ebpf.py): every stamp of an entry stamps both endpoints of its flow
    (bpf/ekp_act.h). The number of slots stamped."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    slots = {slot(*end) for key, entry in entries for end in endpoints(key, entry)}
    if slots:
        stamp = Act(stamp=stamp_of(now))
        act.update_batch([(ctypes.c_uint32(i), stamp) for i in sorted(slots)])
    return len(slots)


def stamp6(act: MapWriter, entries: Iterable[tuple[Ct6Key, Ct6Entry]], now_ns: int | None = None) -> int:
    """Stamp the endpoints of IPv6 conntrack entries the agent wrote after `arm` (the IPv6 flows
    carried at the first IPv6 sync, agent/takeover/into_ebpf.py): the programs stamp only the
    entries they write or refresh, so until a refresh the packets of such a flow whose two ends
    were stamped by no other flow (a reply, backend -> client) leave without the conntrack lookups,
    untranslated. The number of slots stamped."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    slots: set[int] = set()
    for key, entry in entries:
        slots.add(slot(fold6(bytes(entry.fe_addr)), entry.fe_port, key.proto))
        if key.dir == CtDir.FORWARD:
            slots.add(slot(fold6(bytes(entry.nat_addr)), entry.nat_port, key.proto))
        else:
            slots.add(slot(fold6(bytes(key.saddr)), key.sport, key.proto))
    if slots:
        stamp = Act(stamp=stamp_of(now))
        act.update_batch([(ctypes.c_uint32(i), stamp) for i in sorted(slots)])
    return len(slots)


def armed(act: MapWriter) -> bool:
    value = act.lookup(ctypes.c_uint32(ARMED))
    return isinstance(value, Act) and value.stamp != 0


def disarm(act: MapWriter) -> None:
    """Every packet takes the conntrack lookups until `arm`."""
    act.update(ctypes.c_uint32(ARMED), Act(stamp=0))


def arm(maps: Mapping[str, MapWriter], now_ns: int | None = None) -> int:
    """Stamp the endpoints of every live conntrack entry, then arm the check; the number of slots
    stamped. Call it once the agent's own programs are the only ones running."""
    started = time.monotonic()
    now = time.monotonic_ns() if now_ns is None else now_ns
    cfg = read_config(maps)
    timeouts: dict[tuple[int, int], float] = {}  # (proto, flags) -> seconds
    slots: set[int] = set()
    entries = 0
    # IPv4's tables, then the tc IPv6 path's, whose addresses are folded as ekp_fold6 folds them
    for roles, fold in ((CT_ROLES, _as_is), (CT6_ROLES, fold6)):
        for role in roles:
            if role not in maps:
                continue
            keys, values = maps[role].dump_raw()
            rows = KEYS[role].struct.iter_unpack(keys)
            pairs = zip(rows, VALUES[role].struct.iter_unpack(values), strict=True)
            for (saddr, _daddr, sport, _dport, proto, direction), value in pairs:
                entries += 1
                last_seen, nat_addr, _snat_addr, fe_addr, nat_port, _snat_port, fe_port, flags = value[:8]
                limit = timeouts.get((proto, flags))
                if limit is None:
                    limit = timeouts[(proto, flags)] = ct_timeout_s(cfg, proto, flags) * 1e9
                if age_ns(now, last_seen) > limit:
                    continue
                slots.add(slot(fold(fe_addr), fe_port, proto))
                if direction == CtDir.FORWARD:
                    slots.add(slot(fold(nat_addr), nat_port, proto))
                else:
                    slots.add(slot(fold(saddr), sport, proto))
    stamp = Act(stamp=stamp_of(now))
    act = maps["act"]
    if slots:
        act.update_batch([(ctypes.c_uint32(i), stamp) for i in sorted(slots)])
    act.update(ctypes.c_uint32(ARMED), Act(stamp=1))
    log.info(
        "flow activity armed: %d endpoint slot(s) of live flows stamped from %d conntrack entries "
        "in %.2f s (packets of no live flow now skip the conntrack lookups)",
        len(slots),
        entries,
        time.monotonic() - started,
    )
    return len(slots)
