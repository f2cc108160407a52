"""A batch of list events read into the model's records in another process, handed over as
marshalled plain tuples (agent/kube/childlist.py sends them; bench/handover.py measures them).

Pickling the records costs the sender about twice what marshal does (frozen dataclasses go through
`__reduce_ex__`, 0.19 against 0.09 CPU s at 10,000 slices x 10), and the receiver about the same
(0.06 to 0.07 s): each EndpointSlice record goes as a tuple of strings, numbers and tuples, its
`Endpoint`s rebuilt with `tuple.__new__` (no Python `__new__` per endpoint). The rest of a batch
(a Synced, an object event the reader leaves as it is) is marshalled as plain data too, and
anything else pickled, so any batch goes through; `unpack(pack(b)) == b`.
"""

from __future__ import annotations

import marshal
import pickle
from collections.abc import Sequence
from typing import Any

from agent.daemon import _Read, read_events
from agent.model.parse import ParsedSlice, SlicePort
from agent.model.tracker import SliceRecord
from agent.model.types import Endpoint, IPFamily, Protocol
from agent.sources.base import Event, EventType, Kind, ObjectEvent, Synced

_SLICE, _OBJECT, _SYNCED, _PICKLED = 0, 1, 2, 3


def read_and_pack(events: Sequence[Event], hostname: str) -> bytes:
    """`events` read into records (agent.daemon.read_events), packed (in the child)."""
    return pack(read_events(events, hostname))


def pack(events: Sequence[object]) -> bytes:
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, _Read) and isinstance(e.record, SliceRecord) and e.kind is Kind.ENDPOINT_SLICE:
            rec = e.record
            p = rec.parsed
            parsed = (
                None
                if p is None
                else (
                    p.namespace,
                    p.name,
                    p.service,
                    tuple((sp.name, sp.port, str(sp.protocol)) for sp in p.ports),
                    tuple(tuple(ep) for ep in p.endpoints),
                    int(p.family),
                )
            )
            out.append(
                (
                    _SLICE,
                    e.key,
                    e.version,
                    e.uid,
                    rec.namespace,
                    rec.name,
                    parsed,
                    rec.error,
                    rec.trigger_time,
                )
            )
        elif isinstance(e, ObjectEvent):
            out.append((_OBJECT, str(e.kind), str(e.type), e.key, dict(e.obj)))
        elif isinstance(e, Synced):
            out.append((_SYNCED, str(e.kind), e.version))
        else:
            out.append((_PICKLED, pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)))
    return marshal.dumps(out)


def unpack(blob: bytes) -> list[object]:
    """What `pack` packed (in the agent)."""
    new = tuple.__new__
    out: list[object] = []
    for item in marshal.loads(blob):
        tag = item[0]
        if tag == _SLICE:
            _, key, version, uid, namespace, name, p, error, trigger = item
            parsed = None
            if p is not None:
                pns, pname, service, ports, endpoints, family = p
                parsed = ParsedSlice(
                    pns,
                    pname,
                    service,
                    tuple(SlicePort(a, b, Protocol(c)) for a, b, c in ports),
                    tuple([new(Endpoint, ep) for ep in endpoints]),
                    IPFamily(family),
                )
            out.append(
                _Read(
                    Kind.ENDPOINT_SLICE,
                    key,
                    version,
                    uid,
                    SliceRecord(namespace, name, parsed, error, trigger),
                )
            )
        elif tag == _OBJECT:
            _, kind, typ, key, obj = item
            out.append(ObjectEvent(Kind(kind), EventType(typ), key, obj))
        elif tag == _SYNCED:
            out.append(Synced(Kind(item[1]), item[2]))
        else:
            out.append(pickle.loads(item[1]))
    return out
