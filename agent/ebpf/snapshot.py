"""The planner of the last run, kept across a restart so that the next start need not rebuild it.

A restart over pinned maps otherwise reads every entry back, re-adopts the kernel's ids and plans
every service port again only to find it wrote nothing (about 0.8 CPU s of a restart at 10,000
Services of 10 endpoints). At a clean stop (`EbpfProxier.close`) the planner, when the maps hold
exactly what it desired (their read-back decoded and compared), is written to one file next to
the agent's lock files (/run/ebpf-kube-proxy: tmpfs, root only, gone at reboot, the chart's
hostPath), with a digest of each service map's raw read-back. The next start reads its maps back
anyway (batch lookups in the kernel) and takes the planner only when every digest still matches
that read-back byte for byte: the maps hold what the planner believes, so it carries on as the
last run would have at its next full resync, and its first `update` skips every service port
whose Service and endpoints are as planned. Anything else falls back to the read-back path:

* no file, a file from another agent build or other flags (`identity`: the format, the Python,
  the agent's own source, the config), a file whose body does not match its checksum (truncated,
  corrupted), one that does not unpickle into the planner's own types;
* a map that holds anything else, or the same entries in another order (a write since, by anyone:
  the kernel's batch order of an unchanged map is stable; a rewrite of the same entries only
  costs the fallback).

The fragments' records (each port's Service and endpoints, which that skip compares) are not in
the pickled planner: they follow it in chunks, and the start compares each chunk with the model's
and keeps the model's own where equal (`_take_records`), so a planner taken holds no second copy
of every Service and endpoint (140 MiB of a restart's peak at 50,000 Services of 10 endpoints).
The endpoints are kept as plain tuples of their fields, not as `Endpoint`s: they are only ever
compared (a NamedTuple equals the plain tuple of its fields), and a plain tuple is unpickled in C
where an `Endpoint` goes through its Python `__new__` (about 0.1 CPU s of a restart at 10,000
Services of 10 endpoints).

The file is consumed (removed) by the start that reads it, whatever the outcome, so a later start
after a crash never meets it (nor any partial file a stop killed while writing it left). The body
is a pickle, read by an unpickler that builds only the planner's own classes (`_ALLOWED`): the
directory is root's alone, and even so a file put there cannot run code (it could set attributes
on those classes, agent.keptfile.Restricted says how far that goes). The collector is held
while the pickle is built or read: a third of a million objects would otherwise trigger
collections that find nothing to free (0.8 s against 0.15 s of loading at 10,000 Services). How
the file is written, opened, checked and unpickled is agent.keptfile's, shared with the model's
kept records (agent.keptrecords).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import pickle
from collections.abc import Mapping
from itertools import islice
from typing import Any, BinaryIO

from agent import keptfile
from agent.config import Config
from agent.ebpf.entries import from_dump
from agent.ebpf.planner import ROLES, Fragment, Planner
from agent.model.types import ProxyState, ServiceEndpoints, ServicePortName

log = logging.getLogger(__name__)

_MAGIC = b"EKP-PLANNER-2\n"
# What the pickle may build: the planner's own state types, nothing callable beyond them.
_ALLOWED = {
    ("agent.config", "NodeContext"),
    ("agent.ebpf.backends", "Backends"),
    ("agent.ebpf.ids", "IdPool"),
    ("agent.ebpf.planner", "Fragment"),
    ("agent.localdetect", "LocalDetector"),
    ("agent.localdetect", "LocalMode"),
    ("agent.model.types", "Endpoint"),
    ("agent.model.types", "Protocol"),
    ("agent.model.types", "ServiceEndpoints"),
    ("agent.model.types", "ServicePort"),
    ("agent.model.types", "ServicePortName"),
    ("agent.model.types", "SessionAffinity"),
}
# the new run's own; and what a resync verified in the last run, which the next verifies again
_NOT_KEPT = ("_config", "_ip", "_flushes", "_verified")
# A file larger than this is refused unread (the start reads the maps back instead, which costs
# only time): the pickle is about 14 MB at 10,000 Services of 10 endpoints and 70 MB at 50,000, and
# the agent holds several times its size in objects (680 MiB at 50,000: about ten), so 256 MiB is a
# planner of about 2.5 GiB, past the chart's memory limit (1536Mi): not one this node's agent could
# have left.
MAX_BYTES = 256 << 20
# service ports' records a chunk (about 0.7 MB of objects at 10 endpoints): what a start holds of
# the file's at once
_RECORDS = 256


def snapshot_path(directory: str, pin_path: str) -> str:
    """One file per pin path (resolved, as agent.lock names the pin path's lock file)."""
    digest = hashlib.sha256(os.path.realpath(pin_path).encode()).hexdigest()[:16]
    return os.path.join(directory, f"planner-{digest}.pickle")


def map_digests(dump: Mapping[str, tuple[bytes, bytes]]) -> bytes:
    """One sha256 per service map of its raw read-back (keys, then values), in ROLES order."""
    out = []
    for role in ROLES:
        keys, values = dump.get(role, (b"", b""))
        h = hashlib.sha256(len(keys).to_bytes(8, "little"))
        h.update(keys)
        h.update(values)
        out.append(h.digest())
    return b"".join(out)


def save(path: str, planner: Planner, dump: Mapping[str, tuple[bytes, bytes]], identity: bytes) -> str:
    """Write `planner` to `path` if `dump` (the maps' read-back now) holds exactly its desired
    entries; "" when written, else why not (for the log). Atomic: a new file renamed over.

    `identity`: the agent's (see `identity`), taken when its proxier was made: the sources on
    disk may have changed under it since (an upgrade in place); the file describes this run's layout.
    The pickle goes straight into the file through a hashing writer, its checksum patched into the
    header afterwards: the body is never whole in memory (70 MB at 50,000 Services of 10 endpoints)."""
    if not planner.in_sync:
        return "the planner has writes the maps have not taken"
    for role in ROLES:
        if from_dump(role, *dump.get(role, (b"", b""))) != planner.desired[role]:
            return f"the {role} map holds other entries than the planner desired"
    write(path, planner, dump, identity)
    return ""


def write(path: str, planner: Planner, dump: Mapping[str, tuple[bytes, bytes]], identity: bytes) -> None:
    """`save`'s file, written unchecked."""
    state = {k: v for k, v in planner.__dict__.items() if k not in _NOT_KEPT}
    frags: dict[ServicePortName, Fragment] = state["_frags"]
    records = [(frag.sp, frag.eps) for frag in frags.values()]

    def dump_planner(pickler: pickle.Pickler) -> None:
        # The fragments without their records (the model's Services and endpoints), which follow
        # in chunks (`_RECORDS`): see `_take_records`.
        try:
            for frag in frags.values():
                frag.sp = frag.eps = None
            pickler.dump(state)
        finally:
            for frag, (sp, eps) in zip(frags.values(), records, strict=True):
                frag.sp, frag.eps = sp, eps
        for at in range(0, len(records), _RECORDS):
            pickler.clear_memo()  # each chunk a pickle of its own, read and dropped alone
            pickler.dump([(sp, _plain(eps)) for sp, eps in records[at : at + _RECORDS]])

    keptfile.write(path, _MAGIC + identity + map_digests(dump), dump_planner)


def take(
    path: str, dump: Mapping[str, tuple[bytes, bytes]], identity: bytes, config: Config, state: ProxyState
) -> tuple[Planner | None, str]:
    """The planner saved at `path` if it was written by an agent of this `identity` and the maps
    (`dump`) still hold what it desired, and the file removed either way. (None, why not)
    otherwise; (None, "") when there was no file. The body is checked, then unpickled, from the
    file itself: no copy of it is held in memory besides the objects it builds."""
    f, why = keptfile.open_consumed(path)
    if f is None:
        return None, why
    with f:
        try:
            why = keptfile.check(
                f, _MAGIC, identity, MAX_BYTES, (map_digests(dump), "the maps changed since it was written")
            )
        except OSError as exc:  # an I/O error on the file costs this start its planner, not its sync
            why = f"cannot be read: {exc}"
        if why:
            return None, why
        planner = Planner(config)
        try:
            with keptfile.collector_held():
                kept = _restricted(f).load()
                if not isinstance(kept, dict) or set(kept) != set(planner.__dict__) - set(_NOT_KEPT):
                    return None, "it does not hold this planner's state"
                planner.__dict__.update(kept)
                if not planner.in_sync:
                    return None, "it holds writes the maps had not taken"
                _take_records(f, kept["_frags"], state)
        except Exception as exc:
            return None, f"cannot be read back: {exc}"
        return planner, ""


def _take_records(f: io.BufferedReader, frags: dict[ServicePortName, Fragment], state: ProxyState) -> None:
    """Each fragment given the model's own records where the file's equal them (a Service or its
    endpoints changed while the agent was down: left without, so the first update plans it again).

    Equal records are what the planner's first update skips a port for; the file's own copies,
    kept in the fragments, were a second copy of every Service and endpoint (about 30 MB at 10,000
    Services of 10 endpoints, 140 at 50,000: a restart taking the planner peaked 140 MiB over one
    reading the maps back) until that update swapped them. Read a chunk at a time, compared and
    dropped, they cost one chunk's objects."""
    services, endpoints = state.services, state.endpoints
    none = ServiceEndpoints()  # a port without endpoints (the planner plans it with empty ones)
    order = iter(frags.items())
    left = len(frags)
    while left:
        chunk = _restricted(f).load()
        if not isinstance(chunk, list) or not 0 < len(chunk) <= left:
            raise pickle.UnpicklingError("its records do not match its fragments")
        left -= len(chunk)
        for record, (spn, frag) in zip(chunk, islice(order, len(chunk)), strict=True):
            sp, eps = record
            now_sp, now_eps = services.get(spn), endpoints.get(spn, none)
            if now_sp is not None and now_sp == sp and eps is not None and _fields(now_eps) == eps:
                frag.sp, frag.eps = now_sp, now_eps


_EPS_FIELDS = tuple(f.name for f in dataclasses.fields(ServiceEndpoints))


def _plain(eps: ServiceEndpoints | None) -> tuple[Any, ...] | None:
    """`eps` as the file keeps it: its fields in order, each tuple of endpoints a tuple of their
    fields' tuples, one per tuple and per endpoint however often `eps` names it (`all_reachable` is
    mostly `cluster` itself), so the pickle keeps one copy. `_fields(e) == _plain(e)` (and for any
    other ServiceEndpoints exactly when it equals `e`): a NamedTuple is compared as the tuple of its
    fields, a dataclass by its fields in order."""
    if eps is None:
        return None
    done: dict[int, Any] = {}

    def plain(value: Any) -> Any:
        if not isinstance(value, tuple):
            return value
        if id(value) not in done:
            done[id(value)] = tuple([done.setdefault(id(e), tuple(e)) for e in value])
        return done[id(value)]

    return tuple(plain(getattr(eps, name)) for name in _EPS_FIELDS)


def _fields(eps: ServiceEndpoints) -> tuple[Any, ...]:
    return tuple(getattr(eps, name) for name in _EPS_FIELDS)


def _restricted(f: BinaryIO) -> keptfile.Restricted:
    return keptfile.Restricted(f, _ALLOWED, "a planner's state")


def identity(config: Config) -> bytes:
    """What a snapshot is only good for (`keptfile.identity`). Taken once when the proxier is made."""
    return keptfile.identity(_MAGIC, config)
