"""Carrying the conntrack of an ABI v1 agent over to ABI v2, so an upgrade drops no connection, and
the counters of `ekp_stats_v2` over to `ekp_stats_v3`.

An agent of this version started over maps pinned by a v1 agent finds the v1 programs still
attached and serving (the old agent left them in place) and their flows in `ekp_ct_v1`. The v2
data path drops a mid-flow TCP segment it has no conntrack entry for (it never re-balances an
established flow), so every v1 entry that still describes a live flow is translated into the v2
layout and inserted before the v2 programs take over, then once more right after (flows the v1
programs started in between), with BPF_NOEXIST so nothing the v2 programs wrote is overwritten.
Only then are the v1 pins removed (the v1 maps go with the last v1 program).

v1 -> v2, per entry (`convert_v1_entry`, pure):
  * key: the direction moves from the value into the key;
  * frontend: a FORWARD key's destination; a REPLY entry's rev-NAT id through `ekp_rnat_v1`
    (an entry whose id is unknown there is left behind: its flow cannot be reverse-translated);
  * backend id and service port id: the v2 ids the first v2 sync gave the backend's (address,
    port, protocol) and the frontend; a flow whose backend the v2 maps do not have is left
    behind (there is no v2 backend id to give it);
  * state: v1 tracked only SNAT and CLOSING. Every carried flow is marked SEEN_REPLY|ESTABLISHED
    (an established flow: the long timeout, never early-dropped) and MIGRATED; CLOSING becomes RST
    (the same 10 s closing timeout and port-reuse rule v1 applied).

The conversion is pure and tested with literal entries; `V1Maps` reads the v1 pins.

Counters: `ekp_stats_v3` has room for 64 counters where v2 had exactly its 25 (a pinned map is
never resized, so a counter added meant a new map). Before the new programs take over, while the
old ones still count into v2 and nothing has counted into v3, every v2 counter is copied into v3
(summed over CPUs, written on CPU 0), so `agent inspect stats` and the metrics go on from where
they were; the v2 pin goes with the other stale pins. Packets the old programs count between the
copy and the attach (milliseconds) are not carried. Nothing is copied into a v3 map that counted
already (an agent that stopped between the copy and the removal of the v2 pin).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.ebpf import abi
from agent.ebpf.abi import CtDir, CtEntry, CtFlag, CtKey, MapSpec, Writer, ip_str, port_host
from agent.ebpf.maps import MapWriter

log = logging.getLogger(__name__)

V1 = 1
_u8, _u16, _u32, _u64 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64


class V1CtKey(abi._Struct):
    """struct ekp_ct_key of ABI v1 (no direction)."""

    _fields_ = [
        ("saddr", _u32),
        ("daddr", _u32),
        ("sport", _u16),
        ("dport", _u16),
        ("proto", _u8),
        ("pad", _u8 * 3),
    ]


class V1CtEntry(abi._Struct):
    """struct ekp_ct_entry of ABI v1."""

    _fields_ = [
        ("last_seen_ns", _u64),
        ("nat_addr", _u32),
        ("snat_addr", _u32),
        ("nat_port", _u16),
        ("snat_port", _u16),
        ("backend_id", _u32),
        ("rev_nat_id", _u16),
        ("dir", _u8),
        ("flags", _u8),
        ("pad", _u32),
    ]


V1_SNAT, V1_CLOSING = 1 << 0, 1 << 1

V1_CT = MapSpec("ct", "lru_hash", V1CtKey, V1CtEntry, 524288, "EKP_CT_MAX", Writer.DATAPATH, version=V1)
V1_RNAT = MapSpec("rnat", "hash", abi.RevNatKey, abi.RevNat, 65536, "EKP_RNAT_MAX", version=V1)
# ekp_stats_v2: its 25 counters are the first 25 of v3, index for index.
V2_STATS = MapSpec("stats", "percpu_array", _u32, _u64, 25, "EKP_STATS_MAX", Writer.DATAPATH, version=2)

# (address be, port be, protocol) -> id, as the v2 maps hold them.
Ident = tuple[int, int, int]


@dataclass(frozen=True)
class V2Ids:
    """What the first v2 sync wrote, indexed for the conversion."""

    backends: Mapping[Ident, int]  # backend (addr, port, proto) -> backend id
    services: Mapping[Ident, int]  # frontend (addr, port, proto) -> svc_id

    @classmethod
    def of(cls, be: Iterable[tuple[Any, Any]], fe: Iterable[tuple[Any, Any]]) -> V2Ids:
        """From the (key, value) pairs of ekp_be_v2 and ekp_fe_v2."""
        return cls(
            backends={(v.addr, v.port, v.proto): k.id for k, v in be if isinstance(v, abi.Backend)},
            services={(k.addr, k.port, k.proto): v.svc_id for k, v in fe if isinstance(v, abi.Frontend)},
        )


def convert_v1_entry(
    key: V1CtKey, entry: V1CtEntry, rnat_v1: Mapping[int, abi.RevNat], ids: V2Ids
) -> tuple[CtKey, CtEntry] | None:
    """The v2 entry for a v1 one, or None when its flow cannot be carried (see the module doc)."""
    forward = entry.dir == CtDir.FORWARD
    if forward:
        fe_addr, fe_port = key.daddr, key.dport
        backend = (entry.nat_addr, entry.nat_port, key.proto)
    else:
        rn = rnat_v1.get(entry.rev_nat_id)
        if rn is None:
            return None
        fe_addr, fe_port = rn.addr, rn.port
        backend = (key.saddr, key.sport, key.proto)
    backend_id = ids.backends.get(backend)
    if backend_id is None:
        return None
    flags = CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED | CtFlag.MIGRATED
    if entry.flags & V1_SNAT:
        flags |= CtFlag.SNAT
    if entry.flags & V1_CLOSING:
        flags |= CtFlag.RST
    new_key = CtKey(
        saddr=key.saddr, daddr=key.daddr, sport=key.sport, dport=key.dport, proto=key.proto, dir=entry.dir
    )
    new = CtEntry(
        last_seen_ns=entry.last_seen_ns,
        nat_addr=entry.nat_addr,
        snat_addr=entry.snat_addr if forward and entry.flags & V1_SNAT else 0,
        fe_addr=fe_addr,
        nat_port=entry.nat_port,
        snat_port=entry.snat_port if forward and entry.flags & V1_SNAT else 0,
        fe_port=fe_port,
        flags=int(flags),
        svc_id=ids.services.get((fe_addr, fe_port, key.proto), 0),
        backend_id=backend_id,
        created_s=entry.last_seen_ns // 1_000_000_000,
    )
    return new_key, new


def describe(key: V1CtKey) -> str:
    source = f"{ip_str(key.saddr)}:{port_host(key.sport)}"
    return f"{source} -> {ip_str(key.daddr)}:{port_host(key.dport)}/{key.proto}"


@dataclass
class Carried:
    """What one pass did: entries inserted, already in v2, left behind."""

    inserted: int = 0
    present: int = 0
    left: int = 0


class Upgrade:
    """The v1 -> v2 carry-over of one agent start; a no-op when no v1 conntrack is pinned.

    The proxier calls `before_attach(maps)` after its first sync wrote the v2 service maps and
    before the v2 programs replace the v1 ones, and `after_attach(maps)` right after, then removes
    the pins of other ABI versions.
    """

    def __init__(self, pin_path: str) -> None:
        self.pin_path = pin_path
        self.carried = Carried()

    @property
    def pending(self) -> bool:
        return os.path.exists(os.path.join(self.pin_path, V1_CT.name))

    @property
    def hands_over(self) -> bool:
        """The v1 programs keep their flows in tables the v2 ones do not read: the v2 programs go
        in front of them until the conntrack is carried over (agent/ebpf/attach.py, hand-over)."""
        return self.pending

    def before_attach(self, maps: Mapping[str, MapWriter]) -> None:
        if self.pending:
            self._carry(maps, "before the v2 programs take over")
        if os.path.exists(os.path.join(self.pin_path, V2_STATS.name)):
            self._carry_counters(maps["stats"])

    def after_attach(self, maps: Mapping[str, MapWriter]) -> None:
        if self.pending:
            self._carry(maps, "after the v2 programs took over")

    def abort(self, *, attached: bool) -> None:
        """Nothing to put back: the carry changes only our own maps."""

    def close(self) -> None:
        """Nothing to put back."""

    def after_first_sync6(
        self, maps: Mapping[str, MapWriter], frontends: Mapping[tuple[str, int, int], int] | None = None
    ) -> None:
        """The v1 ABI had no IPv6 maps: nothing to carry."""

    def serving(self) -> None:
        """Nothing left to do once every hook serves."""

    def _carry_counters(self, stats: MapWriter) -> None:
        from agent.ebpf.maps import BpfMap, read_stats

        if any(read_stats(stats).values()):
            log.info(
                "%s counts already: the counters of %s are not carried over", stats.spec.name, V2_STATS.name
            )
            return
        with BpfMap.open_pinned(V2_STATS, self.pin_path) as old:
            counters = [(k, v) for k, v in old.items() if int(getattr(v, "value", 0))]
        for key, value in counters:
            stats.update(key, value)
        log.info(
            "upgrade from %s: %d counters carried over into %s", V2_STATS.name, len(counters), stats.spec.name
        )

    def _carry(self, maps: Mapping[str, MapWriter], when: str) -> None:
        from agent.ebpf.maps import BpfMap, MapError, UpdateFlag

        started = time.monotonic()
        with BpfMap.open_pinned(V1_CT, self.pin_path) as ct_v1:
            entries = ct_v1.items()
        rnat_v1: dict[int, abi.RevNat] = {}
        if os.path.exists(os.path.join(self.pin_path, V1_RNAT.name)):
            with BpfMap.open_pinned(V1_RNAT, self.pin_path) as rn:
                rnat_v1 = {
                    k.id: v
                    for k, v in rn.items()
                    if isinstance(k, abi.RevNatKey) and isinstance(v, abi.RevNat)
                }
        ids = V2Ids.of(maps["be"].items(), maps["fe"].items())
        done = Carried()
        for key, entry in entries:
            assert isinstance(key, V1CtKey) and isinstance(entry, V1CtEntry)
            converted = convert_v1_entry(key, entry, rnat_v1, ids)
            if converted is None:
                done.left += 1
                log.debug("v1 flow %s not carried over (its backend or frontend is gone)", describe(key))
                continue
            new_key, new = converted
            try:
                maps[abi.ct_role(key.proto)].update(new_key, new, UpdateFlag.NOEXIST)
                done.inserted += 1
            except MapError as exc:
                if exc.errno != errno.EEXIST:
                    raise
                done.present += 1
        self.carried.inserted += done.inserted
        self.carried.left += done.left
        log.info(
            "upgrade from ABI v1 (%s): %d conntrack entries carried over, %d already there, %d left behind"
            " (backend or frontend gone), %.0f ms",
            when,
            done.inserted,
            done.present,
            done.left,
            (time.monotonic() - started) * 1000,
        )
