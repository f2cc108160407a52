"""The first list of one kind read in a child process (`ChildList`), for the agent's second CPU.

The agent lists on one CPU of two (one GIL). At 10,000 Services x 10 endpoints the EndpointSlice
list is 35 MB of JSON: its TLS and HTTP, the decode and the reading of each slice into the model's
record cost the agent about 0.3 CPU s more than receiving the records ready-made
(bench/handover.py). So the first EndpointSlice list runs in a forked child: the same reflector
code (reflector.py: limit/continue pages, the resourceVersion of the watch that follows, a 410 on
a continue token and the relist, backoff on failures) through the same kubernetes client and
configuration (the parent's, copied by the fork, with a connection pool of its own), its batches
read into the model's records by the agent's reader and sent back as they come, packed as plain
tuples (`BatchReader`: agent.handover), with the delivered-map entries they make. The child's log
records go to the parent's handlers, and its counters and list duration are added to the parent's
metrics at the end (`ListDone`). A malformed slice is read into a record carrying its error, as in
process, and reported by the model when the agent applies it.

The parent's reflector delivers each batch as it arrives and takes the child's `ListDone` as the
end of its first list; then it watches from that resourceVersion as after any list. A child that
fails or dies before its `ListDone` raises ListFailed in the parent, which logs it and lists in
process, reconciling against what the child did deliver. Relists after that stay in process: they
are rare, and a watch's events are small.

Forked, not spawned: a spawned interpreter would first import the client and the model (about
0.4 s) while the agent's own list has started. The fork is taken before the source's threads start,
so no lock of theirs is held in the child; logging's are reinitialised by the logging module at
fork, the agent's lock files by agent.lock. The child ends when its list does, or when the parent's
end of the pipe closes (the agent died, or `close`).
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kubernetes.client import rest
from prometheus_client import CollectorRegistry

from agent.kube.reflector import ListDone, ListedBatch, ListFailed, Reflector, WatchSettings
from agent.kube.resources import Resource
from agent.metrics.source import SourceMetrics
from agent.sources.base import Event, EventType, ObjectEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchReader:
    """How a batch crosses: `pack` reads it into the model's records and packs them (in the
    child: agent.handover.read_and_pack), `unpack` rebuilds them (in the agent)."""

    pack: Callable[[Sequence[Event]], bytes]
    unpack: Callable[[bytes], Sequence[object]]


class _Send:
    """The queue of the child's QueueHandler: each log record goes down the pipe, in order with the
    batches."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def put_nowait(self, record: logging.LogRecord) -> None:
        self._conn.send(record)


class ChildList:
    """The first list of `resource` run in a forked child by a reflector of its own (its counters
    in a registry of its own: what it sends back are the list's increments only)."""

    def __init__(self, resource: Resource, settings: WatchSettings, reader: BatchReader) -> None:
        self._resource = resource
        self._settings = settings
        self._reader = reader
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._closed = threading.Event()

    def start(self) -> None:
        ours, theirs = multiprocessing.get_context("fork").Pipe()
        process = multiprocessing.get_context("fork").Process(
            target=self._child, args=(theirs, ours), name=f"list-{self._resource.kind.value}", daemon=True
        )
        process.start()
        theirs.close()
        self._process, self._conn = process, ours
        log.debug("%s: first list read in child process %d", self._resource.kind.value, process.pid)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def messages(self) -> Iterator[ListedBatch | ListDone]:
        conn = self._conn
        if conn is None:
            raise ListFailed("the child process was not started")
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError) as exc:
                raise ListFailed(self._how_it_ended()) from exc
            if isinstance(message, logging.LogRecord):
                logging.getLogger(message.name).handle(message)
            elif isinstance(message, tuple):
                delivered, blob = message
                yield ListedBatch(delivered, self._reader.unpack(blob))
            elif isinstance(message, ListDone):
                yield message
                return
            else:
                raise ListFailed(str(message))

    def _how_it_ended(self) -> str:
        process = self._process
        if self._closed.is_set():
            return "stopped"
        if process is None:
            return "no child process"
        process.join(1.0)
        code = process.exitcode
        if code is None:
            return "its pipe closed"
        return (
            f"child process {process.pid} exited with status {code}"
            if code >= 0
            else (f"child process {process.pid} was killed by signal {-code}")
        )

    def close(self) -> None:
        """End the child wherever it is (after its `ListDone` it has ended by itself)."""
        self._closed.set()
        process, conn = self._process, self._conn
        if process is not None and process.is_alive():
            process.kill()
            process.join(5.0)
        if conn is not None:
            conn.close()

    # ---- in the child ------------------------------------------------------------------------

    def _child(self, conn: Connection, parents: Connection) -> None:
        parents.close()
        # A pool of its own: the parent's connections (if any) stay the parent's.
        api: Any = getattr(self._resource.list_call, "_api", None)
        if api is not None:
            api.rest_client = rest.RESTClientObject(api.configuration)
        root = logging.getLogger()
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        root.addHandler(logging.handlers.QueueHandler(_Send(conn)))  # type: ignore[arg-type]
        # The parent never writes: the pipe reads EOF when it closes its end or dies.
        threading.Thread(target=_exit_at_eof, args=(conn,), daemon=True).start()
        try:
            done = self._list(conn)
        except BaseException as exc:
            conn.send(f"{type(exc).__name__}: {exc}")
            os._exit(1)
        conn.send(done)
        conn.close()

    def _list(self, conn: Connection) -> ListDone:
        pack = self._reader.pack

        def sink(events: Sequence[Event]) -> None:
            delivered = tuple(
                (e.key, None if e.type is EventType.DELETED else Reflector.version_of(e.obj))
                for e in events
                if isinstance(e, ObjectEvent)
            )
            conn.send((delivered, pack(events)))

        metrics = SourceMetrics(CollectorRegistry())
        reflector = Reflector(self._resource, sink, self._settings, threading.Event(), metrics=metrics)
        return reflector.list_once()


def _exit_at_eof(conn: Connection) -> None:
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    os._exit(0)
