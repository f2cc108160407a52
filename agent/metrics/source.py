"""Metrics of the API server source and the Event recorder (agent/kube/).

`kind` is Service, EndpointSlice or Node. Restarts count every watch stream that ended and was
reopened (most are the server's own timeout: reason "closed"); relists count only the lists a lost
watch forced after the first one. They are kept apart on purpose: a steady restart rate is healthy,
a steady relist rate means the watch keeps falling behind.

`SourceMetrics(registry)` registers them into the agent's registry (tests: a fresh one each).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class SourceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.watch_restarts = Counter(
            "ekp_watch_restarts_total",
            "Watch streams that ended and were reopened, by kind and why: closed (the server ended it, "
            "normally its timeout), dropped (the connection broke), read_timeout, error (an ERROR event "
            "other than 410), gone (410: relist), decode (an unreadable event: relist), too_large "
            "(resourceVersion ahead of the server: relist)",
            ["kind", "reason"],
            registry=registry,
        )
        self.relists = Counter(
            "ekp_relists_total",
            "Full lists after the first, by kind and cause: gone (watch answered 410), continue_expired "
            "(a paginated list's continue token expired, list restarted), decode, too_large, resync "
            "(--config-sync-period)",
            ["kind", "reason"],
            registry=registry,
        )
        self.api_errors = Counter(
            "ekp_api_request_errors_total",
            "Failed list/watch requests, by kind, verb and reason (http_<status>, connect, read_timeout, "
            "dropped, decode, closed_early (a watch closed at once without events), other); retried "
            "with backoff",
            ["kind", "verb", "reason"],
            registry=registry,
        )
        self.list_seconds = Histogram(
            "ekp_api_list_duration_seconds",
            "Time a complete (paginated) list of one kind took, decoding included",
            ["kind"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.watch_events = Counter(
            "ekp_watch_events_total",
            "Watch events received, by kind and type (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR)",
            ["kind", "type"],
            registry=registry,
        )
        self.kube_events = Counter(
            "ekp_kube_events_total",
            "Kubernetes Events (Warnings about malformed objects) by outcome: created, series_updated, "
            "rate_limited and queue_full (dropped before sending), failed (the API refused or was "
            "unreachable)",
            ["outcome"],
            registry=registry,
        )
        self.unnamed_objects = Counter(
            "ekp_watch_unnamed_objects_total",
            "Objects the API server sent without a usable metadata.name, skipped by kind",
            ["kind"],
            registry=registry,
        )


class FileMetrics:
    """Metrics of the services file source (agent/sources/file.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rejected = Counter(
            "ekp_services_file_rejected_total",
            "Reads of the services file that were not applied, by reason (the last good content "
            "stays in force; the log says why and what to do)",
            ["reason"],
            registry=registry,
        )
        self.stale = Gauge(
            "ekp_services_file_stale",
            "1 while the services file on disk is not the content in force (refused, missing or "
            "unreadable), else 0",
            registry=registry,
        )
        self.duplicates = Counter(
            "ekp_services_file_duplicates_total",
            "Objects defined twice in the services file (the first is used), by kind",
            ["kind"],
            registry=registry,
        )
