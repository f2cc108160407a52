"""What reading the EndpointSlice list in a second process would take off the agent:
`python -m bench.handover`.

The agent lists on one CPU of two (one GIL); a child process could decode and parse the slices and
hand the records back. This measures, in one process and in CPU seconds, the pieces of that split
at N Services x E endpoints (one slice each, as the fake API server's): the decode of each item
(orjson) and its reading into the model's record (`agent.daemon._read`), which the child would
take off the agent; and two hand-overs of the records, what the child would pay to send them and
what the agent would pay to receive them: pickle, and marshal of plain tuples rebuilt into the
records (`tuple.__new__` for the `Endpoint` NamedTuples, no Python `__new__` per endpoint). Each
rebuilt record is checked equal to the one read in place.

`--collector` sets the garbage collector as in the agent: `held` (off, as while it starts until
its first full sync: agent.collector.StartHold), `thresholds` (agent.collector.GC_THRESHOLDS) or
`default` (Python's, as a plain script runs).
"""

from __future__ import annotations

import argparse
import gc
import marshal
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import orjson

from agent.collector import GC_THRESHOLDS
from agent.daemon import _Read, _read
from agent.model.parse import ParsedSlice, SlicePort
from agent.model.tracker import SliceRecord
from agent.model.types import Endpoint, IPFamily, Protocol
from agent.sources.base import EventType, Kind, ObjectEvent, object_key
from lab.fakeapi.objects import scale_objects

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def read_all(raws: Sequence[bytes]) -> tuple[list[_Read], float, float]:
    """The records of `raws`, with the CPU seconds of the decode and of the reading."""
    items, decode = timed(lambda: [orjson.loads(r) for r in raws])

    def read() -> list[_Read]:
        out = []
        for obj in items:
            got = _read(
                ObjectEvent(Kind.ENDPOINT_SLICE, EventType.ADDED, object_key(Kind.ENDPOINT_SLICE, obj), obj),
                "node1",
            )
            assert isinstance(got, _Read)
            out.append(got)
        return out

    reads, parse = timed(read)
    return reads, decode, parse


def pack(reads: Sequence[_Read]) -> bytes:
    """The records as plain tuples, marshalled (what the child would send)."""
    plain: list[tuple[Any, ...]] = []
    for r in reads:
        rec = r.record
        assert isinstance(rec, SliceRecord)
        p = rec.parsed
        parsed = (
            None
            if p is None
            else (
                p.namespace,
                p.name,
                p.service,
                tuple((sp.name, sp.port, str(sp.protocol)) for sp in p.ports),
                tuple(tuple(e) for e in p.endpoints),
                int(p.family),
            )
        )
        plain.append((r.key, r.version, r.uid, rec.namespace, rec.name, parsed, rec.error, rec.trigger_time))
    return marshal.dumps(plain)


def unpack(blob: bytes) -> list[_Read]:
    """The records rebuilt from `pack`'s bytes (what the agent would do with them)."""
    new = tuple.__new__
    out = []
    for key, version, uid, ns, name, p, error, trigger in marshal.loads(blob):
        parsed = None
        if p is not None:
            pns, pname, service, ports, endpoints, family = p
            parsed = ParsedSlice(
                pns,
                pname,
                service,
                tuple(SlicePort(a, b, Protocol(c)) for a, b, c in ports),
                tuple([new(Endpoint, e) for e in endpoints]),
                IPFamily(family),
            )
        out.append(
            _Read(Kind.ENDPOINT_SLICE, key, version, uid, SliceRecord(ns, name, parsed, error, trigger))
        )
    return out


def run(services: int, endpoints: int) -> dict[str, float]:
    objects = [o for o in scale_objects(services, endpoints) if o["kind"] == "EndpointSlice"]
    raws = [orjson.dumps(o) for o in objects]
    del objects
    reads, decode, parse = read_all(raws)
    blob, packed = timed(lambda: pack(reads))
    back, unpacked = timed(lambda: unpack(blob))
    assert [b.record for b in back] == [r.record for r in reads], "the hand-over changed a record"
    pickled, dumped = timed(lambda: pickle.dumps(reads, protocol=pickle.HIGHEST_PROTOCOL))
    again, loaded = timed(lambda: pickle.loads(pickled))
    assert [b.record for b in again] == [r.record for r in reads]
    return {
        "decode": decode,
        "parse": parse,
        "marshal pack": packed,
        "marshal unpack": unpacked,
        "marshal MB": len(blob) / 1e6,
        "pickle dump": dumped,
        "pickle load": loaded,
        "pickle MB": len(pickled) / 1e6,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.handover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--collector", choices=("held", "thresholds", "default"), default="held")
    a = ap.parse_args(argv)
    if a.collector == "held":
        gc.disable()
    elif a.collector == "thresholds":
        gc.set_threshold(*GC_THRESHOLDS)
    for _ in range(a.runs):
        out = run(a.services, a.endpoints)
        print(
            f"{a.services:,} slices of {a.endpoints}, collector {a.collector}, CPU s: decode "
            f"{out['decode']:.3f}, read into records {out['parse']:.3f}; marshal: child "
            f"{out['marshal pack']:.3f}, agent {out['marshal unpack']:.3f} ({out['marshal MB']:.1f} MB); "
            f"pickle: child {out['pickle dump']:.3f}, agent {out['pickle load']:.3f} "
            f"({out['pickle MB']:.1f} MB)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
