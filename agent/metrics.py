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
SERVICES_FILE_REJECTED = Counter(
    "ekp_services_file_rejected_total",
    "Reads of the services file that were not applied, by reason (the last good content stays in force; "
    "the log says why and what to do)",
    ["reason"],
)
SERVICES_FILE_STALE = Gauge(
    "ekp_services_file_stale",
    "1 while the services file on disk is not the content in force (refused, missing or unreadable), else 0",
)
