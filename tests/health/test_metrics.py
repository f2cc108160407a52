"""kube-proxy's metrics: names, help texts, labels and buckets against a literal list taken from
upstream (pkg/proxy/metrics/metrics.go; the Kubernetes v1.34 metrics reference for the labels),
the Go text exposition, and the record_* calls the sync loop makes. A fresh registry per test."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.clock import FakeClock
from agent.config import Mode
from agent.metrics import (
    NETWORK_PROGRAMMING_BUCKETS,
    SYNC_BUCKETS,
    Metrics,
    no_local_endpoints,
)
from agent.metrics.exposition import family_lines, render, sample_names
from agent.model import NodeInfo, build_state

# (name as scraped, type, help as scraped, labels) for every kube-proxy family both modes register.
UPSTREAM_COMMON = [
    (
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "histogram",
        "SyncProxyRules latency in seconds",
        ["ip_family"],
    ),
    (
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "gauge",
        "The last time a sync of proxy rules was queued",
        ["ip_family"],
    ),
    (
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "gauge",
        "The last time proxy rules were successfully synced",
        ["ip_family"],
    ),
    (
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
        "gauge",
        "Pending proxy rules Endpoint changes",
        [],
    ),
    (
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "counter",
        "Cumulative proxy rules Endpoint changes",
        [],
    ),
    (
        "kubeproxy_sync_proxy_rules_service_changes_pending",
        "gauge",
        "Pending proxy rules Service changes",
        [],
    ),
    (
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "counter",
        "Cumulative proxy rules Service changes",
        [],
    ),
    ("kubeproxy_proxy_healthz_total", "counter", "Cumulative proxy healthz HTTP status", ["code"]),
    ("kubeproxy_proxy_livez_total", "counter", "Cumulative proxy livez HTTP status", ["code"]),
    (
        "kubeproxy_network_programming_duration_seconds",
        "histogram",
        "In Cluster Network Programming Latency in seconds",
        ["ip_family"],
    ),
    (
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        "gauge",
        "Number of services with a Local traffic policy and no endpoints",
        ["ip_family", "traffic_policy"],
    ),
    (
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "histogram",
        "SyncProxyRules latency in seconds for full resyncs",
        ["ip_family"],
    ),
    (
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
        "histogram",
        "SyncProxyRules latency in seconds for partial resyncs",
        ["ip_family"],
    ),
]
UPSTREAM_IPTABLES = [
    (
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
        "counter",
        "Cumulative proxy iptables restore failures",
        ["ip_family"],
    ),
    (
        "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
        "counter",
        "Cumulative proxy iptables partial restore failures",
        ["ip_family"],
    ),
    (
        "kubeproxy_sync_proxy_rules_iptables_total",
        "gauge",
        "Total number of iptables rules owned by kube-proxy",
        ["ip_family", "table"],
    ),
    (
        "kubeproxy_sync_proxy_rules_iptables_last",
        "gauge",
        "Number of iptables rules written by kube-proxy in last sync",
        ["ip_family", "table"],
    ),
    (
        "kubeproxy_conntrack_reconciler_sync_duration_seconds",
        "histogram",
        "ReconcileConntrackFlowsLatency latency in seconds",
        ["ip_family"],
    ),
    (
        "kubeproxy_conntrack_reconciler_deleted_entries_total",
        "counter",
        "Cumulative conntrack flows deleted by conntrack reconciler",
        ["ip_family"],
    ),
    (
        "kubeproxy_iptables_ct_state_invalid_dropped_packets_total",
        "counter",
        "packets dropped by iptables to work around conntrack problems",
        [],
    ),
    (
        "kubeproxy_iptables_localhost_nodeports_accepted_packets_total",
        "counter",
        "Number of packets accepted on nodeports of loopback interface",
        [],
    ),
]
OURS = {
    "ekp_skipped_objects_total",
    "ekp_refused_frontends_total",
    "ekp_invalid_objects",
    "ekp_sync_failures_total",
    "ekp_failed_service_ports",
}
# Go's process collector, which kube-proxy registers too (prometheus_client writes the same names).
PROCESS = {
    "process_cpu_seconds_total",
    "process_max_fds",
    "process_open_fds",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_virtual_memory_bytes",
}
NFACCT = {"ct_state_invalid_dropped_pkts": 7, "localhost_nps_accepted_pkts": 3}


def families(registry: CollectorRegistry) -> dict[str, Any]:
    return {(m.name + "_total" if m.type == "counter" else m.name): m for m in registry.collect()}


@pytest.mark.parametrize("mode", [Mode.EBPF, Mode.IPTABLES])
def test_names_help_types_and_labels_are_upstreams(mode: Mode) -> None:
    registry = CollectorRegistry()
    m = Metrics(registry, mode, nfacct=lambda: NFACCT)
    # Create one series of every labelled family so the label names show in the samples.
    m.record_sync(True, 0.1)
    m.record_sync(False, 0.1)
    m.record_queued()
    m.count_health_probe("healthz", 200)
    m.count_health_probe("livez", 200)
    m.record_network_programming([])
    m.network_programming.labels("IPv4").observe(1)
    m.set_no_local_endpoints(0, 0)
    expected = UPSTREAM_COMMON + (UPSTREAM_IPTABLES if mode is Mode.IPTABLES else [])
    if mode is Mode.IPTABLES:
        m.record_restore_failure(partial=False)
        m.record_restore_failure(partial=True)
        m.set_iptables_rules({"nat": 1}, {"nat": 1})
        m.record_conntrack_cleanup(0.01, 2)
    got = families(registry)
    ebpf = (
        {"ekp_ipv6_snat_held_flows", "ekp_ipv6_snat_granted", "ekp_xdp_load_failures_total"}
        if mode is Mode.EBPF
        else set()
    )
    assert set(got) == {e[0] for e in expected} | OURS | ebpf | PROCESS
    for name, kind, text, labels in expected:
        fam = got[name]
        assert fam.type == kind, name
        assert fam.documentation == "[ALPHA] " + text, name
        series = [s for s in fam.samples if not s.name.endswith("_created")]
        assert series, name
        assert sorted(k for k in series[0].labels if k != "le") == sorted(labels), name


def test_buckets_are_upstreams() -> None:
    # ExponentialBuckets(0.001, 2, 15)
    assert SYNC_BUCKETS[0] == 0.001 and SYNC_BUCKETS[-1] == 16.384 and len(SYNC_BUCKETS) == 15
    # MergeBuckets(LinearBuckets(0.25, 0.25, 2), LinearBuckets(1, 1, 59), LinearBuckets(60, 5, 12),
    # LinearBuckets(120, 30, 7)) behind MergeBuckets' leading zero.
    expected = [0.0, 0.25, 0.5, *range(1, 60), *range(60, 120, 5), *range(120, 301, 30)]
    assert list(NETWORK_PROGRAMMING_BUCKETS) == expected
    registry = CollectorRegistry()
    Metrics(registry).network_programming.labels("IPv4")
    lines = render(registry).decode().splitlines()
    bounds = [
        line.split('le="')[1].split('"')[0]
        for line in lines
        if "network_programming_duration_seconds_bucket" in line
    ]
    assert bounds[:5] == ["0", "0.25", "0.5", "1", "2"] and bounds[-3:] == ["270", "300", "+Inf"]


def test_exposition_is_gos_text() -> None:
    registry = CollectorRegistry()
    clock = FakeClock(wall_ns=1_714_557_600_250_000_000)
    m = Metrics(registry, Mode.EBPF, clock=clock)
    m.record_sync(False, 0.003)
    text = render(registry).decode()
    # A histogram: Go's numbers, le last among labels, _sum before _count, no _created.
    assert family_lines(families(registry)["kubeproxy_sync_partial_proxy_rules_duration_seconds"]) == [
        "# HELP kubeproxy_sync_partial_proxy_rules_duration_seconds [ALPHA] SyncProxyRules latency "
        "in seconds for partial resyncs",
        "# TYPE kubeproxy_sync_partial_proxy_rules_duration_seconds histogram",
        'kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.001"} 0',
        'kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.002"} 0',
        *[
            f'kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{{ip_family="IPv4",le="{b}"}} 1'
            for b in (
                "0.004",
                "0.008",
                "0.016",
                "0.032",
                "0.064",
                "0.128",
                "0.256",
                "0.512",
                "1.024",
                "2.048",
            )
        ],
        'kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="4.096"} 1',
        'kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="8.192"} 1',
        'kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="16.384"} 1',
        'kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="+Inf"} 1',
        'kubeproxy_sync_partial_proxy_rules_duration_seconds_sum{ip_family="IPv4"} 0.003',
        'kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family="IPv4"} 1',
    ]
    # A timestamp as Go computes (`float64(UnixNano()) / 1e9`, inexact) and prints it.
    assert (
        'kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1.7145576002499998e+09\n' in text
    )
    assert "_created" not in text
    assert "kubeproxy_sync_proxy_rules_service_changes_total 0\n" in text
    # Families without series are not written (Go's Gather skips them).
    assert "kubeproxy_proxy_healthz_total" not in text
    assert "kubeproxy_sync_full_proxy_rules_duration_seconds" not in text
    # Sorted by family name, as Go's registry gathers them.
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
    assert helps == sorted(helps)


def test_label_values_and_help_are_escaped_as_go() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.record_skipped('Ser"vice\\\n')
    text = render(registry).decode()
    assert 'ekp_skipped_objects_total{kind="Ser\\"vice\\\\\\n"} 1\n' in text


def test_sync_records_durations_always_and_the_timestamp_on_success() -> None:
    registry = CollectorRegistry()
    clock = FakeClock(wall_ns=2_000_000_000 * 10**9)
    m = Metrics(registry, clock=clock)
    m.record_sync(True, 0.5, ok=False)
    assert (
        registry.get_sample_value("kubeproxy_sync_proxy_rules_duration_seconds_count", {"ip_family": "IPv4"})
        == 1
    )
    assert (
        registry.get_sample_value(
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count", {"ip_family": "IPv4"}
        )
        == 1
    )
    assert (
        registry.get_sample_value("kubeproxy_sync_proxy_rules_last_timestamp_seconds", {"ip_family": "IPv4"})
        is None
    )
    assert registry.get_sample_value("ekp_sync_failures_total", {"ip_family": "IPv4"}) == 1
    m.record_sync(False, 0.5, ok=False, family="IPv6")
    assert registry.get_sample_value("ekp_sync_failures_total", {"ip_family": "IPv6"}) == 1, "per family"
    clock.advance(2)
    m.record_sync(False, 0.01)
    assert (
        registry.get_sample_value("kubeproxy_sync_proxy_rules_last_timestamp_seconds", {"ip_family": "IPv4"})
        == 2e9 + 2
    )
    assert (
        registry.get_sample_value(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count", {"ip_family": "IPv4"}
        )
        == 1
    )


def test_changes_pending_and_queued() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry, clock=FakeClock(wall_ns=5 * 10**9))
    m.record_changes(services=2, endpoints=3)
    m.record_changes(endpoints=1)
    m.set_pending(services=1, endpoints=4)
    m.record_queued()
    assert registry.get_sample_value("kubeproxy_sync_proxy_rules_service_changes_total") == 2
    assert registry.get_sample_value("kubeproxy_sync_proxy_rules_endpoint_changes_total") == 4
    assert registry.get_sample_value("kubeproxy_sync_proxy_rules_service_changes_pending") == 1
    assert registry.get_sample_value("kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 4
    assert (
        registry.get_sample_value(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", {"ip_family": "IPv4"}
        )
        == 5
    )


def test_network_programming_from_trigger_times() -> None:
    registry = CollectorRegistry()
    start = 1_714_557_600 * 10**9  # 2024-05-01T10:00:00Z
    clock = FakeClock(wall_ns=start)
    m = Metrics(registry, clock=clock)
    clock.advance(10)
    observed = m.record_network_programming(
        [
            1_714_557_607.0,  # 2024-05-01T10:00:07Z: 3 s before the sync
            1_714_557_609.5,  # 0.5 s
            1_714_557_540.0,  # before the agent started: an initial list's old annotation
        ]
    )
    assert observed == 2
    count = registry.get_sample_value(
        "kubeproxy_network_programming_duration_seconds_count", {"ip_family": "IPv4"}
    )
    total = registry.get_sample_value(
        "kubeproxy_network_programming_duration_seconds_sum", {"ip_family": "IPv4"}
    )
    assert (count, total) == (2, 3.5)
    le = {"ip_family": "IPv4", "le": "0.5"}
    assert registry.get_sample_value("kubeproxy_network_programming_duration_seconds_bucket", le) == 1


def test_no_local_endpoints_as_kube_proxy() -> None:
    def svc(name: str, ip: str, node_port: int, **spec: Any) -> dict[str, Any]:
        port: dict[str, int] = {"port": 80, "nodePort": node_port} if spec.get("type") else {"port": 80}
        base = {"clusterIP": ip, "ports": [port], **spec}
        return {"kind": "Service", "metadata": {"name": name, "namespace": "ns"}, "spec": base}

    def slc(svc: str, node: str) -> dict[str, Any]:
        return {
            "kind": "EndpointSlice",
            "metadata": {"name": svc, "namespace": "ns", "labels": {"kubernetes.io/service-name": svc}},
            "addressType": "IPv4",
            "ports": [{"port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.244.2.2"], "nodeName": node, "conditions": {"ready": True}}],
        }

    services = [
        svc("itp-remote", "10.96.0.1", 30080, internalTrafficPolicy="Local"),  # internal: only elsewhere
        svc("etp-remote", "10.96.0.2", 30081, type="NodePort", externalTrafficPolicy="Local"),  # external
        svc("etp-here", "10.96.0.3", 30082, type="NodePort", externalTrafficPolicy="Local"),  # local: no
        svc("itp-none", "10.96.0.4", 30083, internalTrafficPolicy="Local"),  # no endpoints: REJECT, no
    ]
    slices = [slc("itp-remote", "node2"), slc("etp-remote", "node2"), slc("etp-here", "node1")]
    state = build_state(services, slices, NodeInfo("node1")).state
    counts = {spn.name: no_local_endpoints(sp, state.endpoints[spn]) for spn, sp in state.services.items()}
    assert counts == {"itp-remote": (1, 0), "etp-remote": (0, 1), "etp-here": (0, 0), "itp-none": (0, 0)}
    registry = CollectorRegistry()
    Metrics(registry).set_no_local_endpoints(1, 1)
    labels = {"ip_family": "IPv4", "traffic_policy": "internal"}
    assert registry.get_sample_value("kubeproxy_sync_proxy_rules_no_local_endpoints_total", labels) == 1


def test_nfacct_counters_are_read_at_scrape_time() -> None:
    values = {"ct_state_invalid_dropped_pkts": 1}
    registry = CollectorRegistry()
    Metrics(registry, Mode.IPTABLES, nfacct=lambda: values)
    assert registry.get_sample_value("kubeproxy_iptables_ct_state_invalid_dropped_packets_total") == 1
    # A counter the kernel does not have is left out, as upstream does when Get fails.
    assert registry.get_sample_value("kubeproxy_iptables_localhost_nodeports_accepted_packets_total") is None
    values["ct_state_invalid_dropped_pkts"] = 9
    values["localhost_nps_accepted_pkts"] = 2
    assert registry.get_sample_value("kubeproxy_iptables_ct_state_invalid_dropped_packets_total") == 9
    assert registry.get_sample_value("kubeproxy_iptables_localhost_nodeports_accepted_packets_total") == 2


def test_nfacct_reader_failure_costs_only_those_families(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> dict[str, int]:
        raise OSError("nfacct: no such table")

    registry = CollectorRegistry()
    Metrics(registry, Mode.IPTABLES, nfacct=broken)
    names = set(sample_names(registry))
    assert "kubeproxy_iptables_ct_state_invalid_dropped_packets_total" not in names
    assert "kubeproxy_sync_proxy_rules_duration_seconds" in names
    assert "cannot read nfacct counters" in caplog.text


def test_iptables_names_stay_out_of_ebpf_mode() -> None:
    registry = CollectorRegistry()
    Metrics(registry, Mode.EBPF, nfacct=lambda: NFACCT)
    assert not [n for n in sample_names(registry) if "iptables" in n or "conntrack_reconciler" in n]


def test_ebpf_mode_serving_ipv6_with_ip6tables_has_iptables_modes_families() -> None:
    """eBPF mode's IPv6 proxier is ip6tables (no eBPF IPv6 path yet): its rule counts, restore
    failures, conntrack cleanups and nfacct counters are iptables mode's families, labelled
    ip_family="IPv6" where upstream labels them."""
    registry = CollectorRegistry()
    m = Metrics(registry, Mode.EBPF, nfacct=lambda: NFACCT, iptables=True)
    m.set_iptables_rules({"nat": 4}, {"nat": 4}, "IPv6")
    m.record_restore_failure(partial=True, family="IPv6")
    names = set(sample_names(registry))
    assert {
        "kubeproxy_sync_proxy_rules_iptables_total",
        "kubeproxy_iptables_ct_state_invalid_dropped_packets_total",
    } <= names
    v6 = {"ip_family": "IPv6"}
    assert registry.get_sample_value("kubeproxy_sync_proxy_rules_iptables_total", {**v6, "table": "nat"}) == 4
    assert (
        registry.get_sample_value("kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total", v6)
        == 1
    )
