"""Keeps ekp_maglev_v2 equal to the tables the desired frontends need (agent/ebpf/maglev.py).

Called by the proxier after each planner flush with the planner's desired frontends, slots and
backends: a table is built and written only when its set's backends (names and ids, in slot
order) changed since it was written, and deleted when no Maglev frontend uses its set any more.
The data path never trips over the order of these writes: a Maglev frontend whose table is
missing, or names a backend that left its set, chooses by its slots (bpf/ekp_lb.h).

What the map holds is read back at the first sync and at every full sync (`reconcile`): a table
whose bytes differ from what its set needs is written again (counted as a repair).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping

from agent.ebpf.maglev import table_bytes
from agent.ebpf.maps import MapWriter

log = logging.getLogger(__name__)

_KEY = struct.Struct("=I")
Wanted = Mapping[int, tuple[tuple[str, ...], tuple[int, ...]]]


class MaglevWriter:
    """The written side of ekp_maglev: set id -> the (names, ids) its table was built from."""

    def __init__(self, table_size: int) -> None:
        self.table_size = table_size
        self._written: dict[int, tuple[tuple[str, ...], tuple[int, ...]]] = {}
        self._unknown = True  # the map's contents are not known: read them back first
        self.writes = 0  # tables written since construction (tests, logs)

    def reconcile(self, m: MapWriter, wanted: Wanted) -> int:
        """Reads the map back; returns how many tables differ from `wanted` (then `sync` fixes them)."""
        keys, values = m.dump_raw()
        vsize = 4 * self.table_size
        held = {
            _KEY.unpack_from(keys, i * _KEY.size)[0]: values[i * vsize : (i + 1) * vsize]
            for i in range(len(keys) // _KEY.size)
        }
        self._written = {}
        differ = 0
        for set_id, value in held.items():
            want = wanted.get(set_id)
            if want is not None and value == table_bytes(*want, self.table_size):
                self._written[set_id] = want
            else:
                differ += 1
                if want is None:
                    self._written[set_id] = ((), ())  # to delete
        differ += sum(1 for s in wanted if s not in held)
        self._unknown = False
        return differ

    def sync(self, m: MapWriter, wanted: Wanted, *, full: bool = False) -> int:
        """Writes the tables that changed and deletes those no longer wanted; returns the number of
        differences a read-back found (0 unless this is the first or a `full` sync)."""
        differ = self.reconcile(m, wanted) if self._unknown or full else 0
        for set_id, want in sorted(wanted.items()):
            if self._written.get(set_id) == want:
                continue
            key = _KEY.pack(set_id)
            if m.update_raw([key], [table_bytes(*want, self.table_size)]) != 1:
                log.error(
                    "ekp_maglev is full: set %d keeps choosing by its slots (raise --bpf-maglev-max)", set_id
                )
                continue
            self._written[set_id] = want
            self.writes += 1
        gone = [s for s in self._written if s not in wanted]
        if gone:
            m.delete_raw([_KEY.pack(s) for s in gone])
            for s in gone:
                del self._written[s]
        return differ

    def forget(self) -> None:
        """What the map holds is unknown again (a failed write, a new data path)."""
        self._unknown = True
