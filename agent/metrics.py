"""Every Prometheus metric of the agent, declared in one place.

Names follow kube-proxy's where the meaning is the same (`kubeproxy_sync_proxy_rules_duration_seconds`)
so existing dashboards keep working. The HTTP endpoint (127.0.0.1:10249) is served by the daemon.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SYNC_SECONDS = Histogram(
    "kubeproxy_sync_proxy_rules_duration_seconds",
    "Time a sync of the proxy rules or maps took",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
SKIPPED_OBJECTS = Counter(
    "ekp_skipped_objects_total",
    "Kubernetes objects skipped because they could not be understood (see the log for which and why)",
    ["kind"],
)
INVALID_OBJECTS = Gauge(
    "ekp_invalid_objects",
    "Kubernetes objects currently left out of the proxy state because they are malformed",
)

# ---- API server source and event recorder (agent/kube/) ----------------------------------------
# `kind` is Service, EndpointSlice or Node. Restarts count every watch stream that ended and was
# reopened (most are the server's own timeout: reason "closed"); relists count only the lists a
# lost watch forced after the first one. Both would otherwise hide in one number: a steady
# restart rate is healthy, a steady relist rate means the watch keeps falling behind.

WATCH_RESTARTS = Counter(
    "ekp_watch_restarts_total",
    "Watch streams that ended and were reopened, by kind and why: closed (the server ended it, "
    "normally its timeout), dropped (the connection broke), read_timeout, error (an ERROR event "
    "other than 410), gone (410: relist), decode (an unreadable event: relist), too_large "
    "(resourceVersion ahead of the server: relist)",
    ["kind", "reason"],
)
RELISTS = Counter(
    "ekp_relists_total",
    "Full lists after the first, by kind and cause: gone (watch answered 410), continue_expired "
    "(a paginated list's continue token expired, list restarted), decode, too_large",
    ["kind", "reason"],
)
API_ERRORS = Counter(
    "ekp_api_request_errors_total",
    "Failed list/watch requests, by kind, verb and reason (http_<status>, connect, read_timeout, "
    "dropped, decode, closed_early (a watch closed at once without events), other); retried "
    "with backoff",
    ["kind", "verb", "reason"],
)
LIST_SECONDS = Histogram(
    "ekp_api_list_duration_seconds",
    "Time a complete (paginated) list of one kind took, decoding included",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
WATCH_EVENTS = Counter(
    "ekp_watch_events_total",
    "Watch events received, by kind and type (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR)",
    ["kind", "type"],
)
KUBE_EVENTS = Counter(
    "ekp_kube_events_total",
    "Kubernetes Events (Warnings about malformed objects) by outcome: created, series_updated, "
    "rate_limited and queue_full (dropped before sending), failed (the API refused or was unreachable)",
    ["outcome"],
)
