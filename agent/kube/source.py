"""`ApiSource`: Services, EndpointSlices and this node's Node, followed from the API server.

The API counterpart of the file source, behind the same `agent.sources.base.Source` contract:
construction has no side effects; `start(sink)` starts one thread per kind (reflector.py), each
listing then watching its kind and calling `sink` with small ordered batches (a list page, or
the events of one network read) and `Synced(kind, resourceVersion)` after every complete list.
The first-sync gate waits for a `Synced` of every kind in `kinds`. Threads never raise; failures
are retried with backoff, logged once per episode and counted (agent/metrics/source.py).

The three kinds are independent streams with their own resourceVersions, as kube-proxy's three
informers are: a slow EndpointSlice list does not hold back Service events.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import replace

from kubernetes import client as k8s

from agent.config import Config
from agent.kube.reflector import Kept, Reflector, WatchSettings
from agent.kube.resources import Resource, watched_resources
from agent.metrics.source import SourceMetrics
from agent.sources.base import Kind, Sink

log = logging.getLogger(__name__)


class ApiSource:
    """Lists and watches the API server through `api` (agent.kube.client.api_client)."""

    def __init__(
        self,
        config: Config,
        api: k8s.ApiClient,
        settings: WatchSettings | None = None,
        rand: random.Random | None = None,
        metrics: SourceMetrics | None = None,
        kept: Kept | None = None,
    ) -> None:
        self._metrics = metrics
        self._kept = kept  # the last run's records, for the first lists (reflector.py)
        self._resources: tuple[Resource, ...] = watched_resources(api, config.hostname)
        self._host = api.configuration.host
        self._settings = replace(settings or WatchSettings(), resync_s=config.config_sync_period_s)
        self._rand = rand or random.Random()
        self._stopping = threading.Event()
        self._reflectors: list[Reflector] = []
        self._threads: list[threading.Thread] = []

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset(r.kind for r in self._resources)

    def start(self, sink: Sink) -> None:
        if self._threads:
            raise RuntimeError("ApiSource.start called twice")
        log.info(
            "watching %s on %s",
            "; ".join(r.describe() for r in self._resources),
            self._host,
        )
        for res in self._resources:
            seed = self._rand.getrandbits(64)
            reflector = Reflector(
                res,
                sink,
                self._settings,
                self._stopping,
                random.Random(seed),
                metrics=self._metrics,
                kept=self._kept,
            )
            thread = threading.Thread(target=reflector.run, name=f"watch-{res.kind.value}", daemon=True)
            self._reflectors.append(reflector)
            self._threads.append(thread)
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every thread: interrupt open streams, wait up to `timeout_s` in all."""
        self._stopping.set()
        for reflector in self._reflectors:
            reflector.interrupt()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning(
                    "%s did not stop within %.0f s (a request is still in flight)", thread.name, timeout_s
                )

    def resource_versions(self) -> dict[Kind, str]:
        """The last resourceVersion seen per kind (lists, events and bookmarks advance it)."""
        return {r.kind: r.resource_version for r in self._reflectors}

    def list_counts(self) -> dict[Kind, int]:
        """Complete lists per kind so far: 1 after the first list, more after relists."""
        return {r.kind: r.lists for r in self._reflectors}
