"""The model's records of the last run, kept across a clean restart so that its lists need not be
parsed again.

A restart lists every Service and EndpointSlice anyway (the API server is the truth, and a restart
must end exactly where a cold start would), and reading each object into the model's record
(`read_service`, `read_slice`: the parser's checks, the endpoints' conditions, the ports) is about
half the CPU of those lists (0.6 CPU s at 10,000 Services of 10 endpoints, where reading this file
back costs 0.13). So at a clean stop the agent leaves, next to the planner's file, every record it
holds with the `metadata.uid` and `metadata.resourceVersion` of the object it was read from; the
next start still decodes every listed object, and takes a kept record instead of reading the object
only when its kind, key, uid and resourceVersion are all the same. The API server gives an object
a new resourceVersion at every write and a new uid when it is made again, so the same pair is the
same object and the record is the one a read of it makes now: the model is fed exactly what a cold
start feeds it. Everything else (an object changed, recreated, added while the agent was down) is
read as before; a kept record no list asks for is dropped.

Which records a start may take also depends on the agent's own code and flags (the parser's, and
`--hostname-override`: what counts as a local endpoint): the file names them (`identity`, as the
planner's file does) and a start of another build or other flags ignores it. The file is read on
the first list page that arrives (the list request already on its way), consumed by that start
whatever the outcome, checked (size, checksum) and unpickled by an unpickler that builds only the
records' own types (agent.keptfile).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from agent import keptfile
from agent.config import Config
from agent.model.tracker import ServiceRecord, SliceRecord
from agent.sources.base import Kind

log = logging.getLogger(__name__)

_MAGIC = b"EKP-RECORDS-1\n"
Record = ServiceRecord | SliceRecord
# (kind, "ns/name") -> (uid, resourceVersion, record read from that object)
Kept = dict[tuple[Kind, str], tuple[str, str, Record]]
_ALLOWED = {
    ("agent.model.parse", "ParsedSlice"),
    ("agent.model.parse", "SlicePort"),
    ("agent.model.tracker", "ServiceRecord"),
    ("agent.model.tracker", "SliceRecord"),
    ("agent.model.types", "Endpoint"),
    ("agent.model.types", "IPFamily"),
    ("agent.model.types", "Protocol"),
    ("agent.model.types", "ServicePort"),
    ("agent.model.types", "ServicePortName"),
    ("agent.model.types", "SessionAffinity"),
    ("agent.sources.base", "Kind"),
}
# About 9 MB at 10,000 Services of 10 endpoints and 45 at 50,000: 256 MiB is a cluster far past
# the chart's memory limit, not one this node's agent could have left.
MAX_BYTES = 256 << 20


def records_path(directory: str, pin_path: str) -> str:
    """One file per pin path, beside the planner's (agent.ebpf.snapshot): the lock on the pin path
    (agent.lock) makes its agent the only reader and writer."""
    digest = hashlib.sha256(os.path.realpath(pin_path).encode()).hexdigest()[:16]
    return os.path.join(directory, f"records-{digest}.pickle")


def identity(config: Config) -> bytes:
    return keptfile.identity(_MAGIC, config)


class KeptRecords:
    """The last run's records, for this start's lists (any thread), and this run's, for the next.

    `take` is called by the source's threads (one per kind) as their list pages arrive: the file
    is read by the first of them, under a lock, and each record can be taken once."""

    def __init__(self, path: str, identity: bytes) -> None:
        self._path = path
        self._identity = identity
        self._lock = threading.Lock()
        self._kept: Kept | None = None
        self.offered = 0  # records the file held
        self.taken = 0  # records a list used instead of reading its object

    def take(self, kind: Kind, key: str, uid: str, version: str) -> Record | None:
        """The record read from the object (`kind`, `key`) with this uid and resourceVersion by
        the last run, if it kept one; None: read the object."""
        kept = self._loaded()
        if not kept or not uid or not version:
            return None
        entry = kept.pop((kind, key), None)
        if entry is None or entry[0] != uid or entry[1] != version:
            return None
        self.taken += 1  # under the GIL from two threads: a count for the log, not a metric
        return entry[2]

    def empty(self) -> bool:
        """No record left to take (none kept, all taken, or dropped); reads the file if no call has."""
        return not self._loaded()

    def _loaded(self) -> Kept:
        kept = self._kept
        if kept is None:
            with self._lock:
                if self._kept is None:
                    self._kept = self._load()
                kept = self._kept
        return kept

    def drop(self) -> None:
        """The lists are complete: what none of them asked for is gone from the cluster."""
        with self._lock:
            if self.offered and self._kept:
                log.info(
                    "the first lists took %d of the %d records the last run kept and read the other objects",
                    self.taken,
                    self.offered,
                )
            elif self.offered:
                log.info("the first lists took all %d records the last run kept", self.taken)
            self.offered = 0
            self._kept = {}

    def _load(self) -> Kept:
        f, why = keptfile.open_consumed(self._path)
        if f is None:
            if why:
                log.warning(
                    "ignored the records the last run left in %s (%s): reading every object", self._path, why
                )
            return {}
        with f:
            try:
                why = keptfile.check(f, _MAGIC, self._identity, MAX_BYTES)
            except OSError as exc:  # an I/O error on the file costs this start its records, not its lists
                why = f"cannot be read: {exc}"
            if not why:
                try:
                    with keptfile.collector_held():
                        kept = keptfile.Restricted(f, _ALLOWED, "a kept record").load()
                    if _valid(kept):
                        self.offered = len(kept)
                        log.info(
                            "took the records of %d objects the last run left (%s)", len(kept), self._path
                        )
                        return kept  # type: ignore[no-any-return]
                    why = "it does not hold records"
                except Exception as exc:
                    why = f"cannot be read back: {exc}"
        log.warning("ignored the records the last run left in %s (%s): reading every object", self._path, why)
        return {}

    def save(self, records: Mapping[tuple[Kind, str], tuple[str, str, Record]]) -> None:
        """At a clean stop: this run's records for the next start (a failure only costs it time)."""
        try:
            keptfile.write(self._path, _MAGIC + self._identity, lambda pickler: pickler.dump(dict(records)))
        except Exception as exc:
            log.warning("could not keep the model's records for the next start in %s: %s", self._path, exc)
            return
        log.info("kept the records of %d objects for the next start in %s", len(records), self._path)


def _valid(kept: Any) -> bool:
    """A dict of (Kind, str) -> (str, str, record): what `take` relies on, checked once."""
    if not isinstance(kept, dict):
        return False
    for key, entry in kept.items():
        if not (
            isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], Kind) and isinstance(key[1], str)
        ):
            return False
        if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)):
            return False
        if not isinstance(entry[1], str) or not isinstance(entry[2], ServiceRecord | SliceRecord):
            return False
        if isinstance(entry[2], ServiceRecord) is not (key[0] is Kind.SERVICE):
            return False
    return True
