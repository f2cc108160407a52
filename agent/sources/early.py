"""A source started before the agent that consumes it is built, so that its first lists are on
their way while the rest of the agent is imported and made.

A restart spends about 0.6 CPU s before its first list request, a third of it importing the health
and metrics servers (aiohttp), and then waits for the API server to answer each list whole (its
watch cache serialising every object: 0.19 CPU s of the fake API server's for 10,000 Services and
EndpointSlices). `begin()` sends the requests before those imports, so the answers are made while
the agent imports. A source thread with a batch to hand over before the agent's `start(sink)`
waits for it: the list's body is read by then (the reflector reads it whole before decoding it a
page at a time), and no more than that one batch of decoded objects is held in the meantime, so
the lists never pile up as dicts (agent.daemon `deliver` reads each batch into the model's records
at once). Each thread's batches reach the sink in order; `stop()` releases a waiting thread
without handing its batch over.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from agent.sources.base import Event, Kind, Sink, Source


class EarlySource:
    """`source`, started by `begin()` before there is a sink; `start(sink)` connects it (and
    starts it, if `begin()` was not called)."""

    def __init__(self, source: Source) -> None:
        self._source = source
        self._sink: Sink | None = None
        self._connected = threading.Event()
        self._begun = False

    @property
    def kinds(self) -> frozenset[Kind]:
        return self._source.kinds

    def begin(self) -> None:
        self._begun = True
        self._source.start(self._deliver)

    def start(self, sink: Sink) -> None:
        self._sink = sink
        self._connected.set()
        if not self._begun:
            self.begin()

    def stop(self) -> None:
        self._connected.set()
        self._source.stop()

    def _deliver(self, events: Sequence[Event]) -> None:
        self._connected.wait()
        sink = self._sink
        if sink is not None:  # None: stopped before the agent connected
            sink(events)
