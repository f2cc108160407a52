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

NETWORK_PROGRAMMING_SECONDS = Histogram(
    "kubeproxy_network_programming_duration_seconds",
    "In Cluster Network Programming Latency in seconds",
    buckets=(
        0.25,
        0.5,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        9,
        10,
        11,
        12,
        13,
        14,
        15,
        16,
        17,
        18,
        19,
        20,
        21,
        22,
        23,
        24,
        25,
        26,
        27,
        28,
        29,
        30,
        31,
        32,
        33,
        34,
        35,
        36,
        37,
        38,
        39,
        40,
        41,
        42,
        43,
        44,
        45,
        46,
        47,
        48,
        49,
        50,
        51,
        52,
        53,
        54,
        55,
        56,
        57,
        58,
        59,
        60,
        65,
        70,
        75,
        80,
        85,
        90,
        95,
        100,
        105,
        110,
        115,
        120,
        150,
        180,
        210,
        240,
        270,
        300,
    ),
)


def observe_network_programming(seconds: float) -> None:
    """From an EndpointSlice's last-change-trigger-time to its change programmed."""
    NETWORK_PROGRAMMING_SECONDS.observe(seconds)
