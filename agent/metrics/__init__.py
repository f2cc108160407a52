"""Every Prometheus metric of the agent, declared in one place, and the calls that record them.

kube-proxy's metrics keep kube-proxy's names, help texts, labels and buckets (pkg/proxy/metrics/
metrics.go and the Kubernetes metrics reference for v1.34, where most carry `ip_family`), so
existing dashboards and alerts keep working. Details that show in a scrape of kube-proxy:

* component-base builds each name as `kubeproxy_` + name, and prints the stability level in front
  of the help text (`# HELP kubeproxy_sync_proxy_rules_duration_seconds [ALPHA] SyncProxyRules
  latency in seconds`); the help strings below carry that prefix;
* sync durations use `ExponentialBuckets(0.001, 2, 15)` (1 ms .. 16.384 s); network programming
  uses `MergeBuckets` of 0.25 s steps, 1 s steps to 59 s, 5 s steps to 115 s and 30 s steps to
  5 min, behind a leading 0 bucket;
* some families exist only in iptables mode (`RegisterMetrics(mode)`): the full/partial sync
  histograms, the iptables-restore failures, rule counts, and the nfacct counters. This agent
  registers the full/partial histograms in eBPF mode too, since its eBPF syncs are partial or full
  as well; every other iptables name stays out of eBPF mode, unless eBPF mode serves IPv6 Services
  with ip6tables (`iptables=True`): then they are the IPv6 rules', labelled ip_family="IPv6".

The `process_*` families (CPU, memory, file descriptors) have the names of Go's process collector.
The project's own metrics start with `ekp_`. Values owned by the kernel (BPF map fill, the data
path's counters, nfacct counters) are read at scrape time by collectors (`agent.metrics.bpf`,
`NfacctCollector` here), never copied on a timer.

`Metrics(registry, mode)` registers into the registry it is given (tests use a fresh one each);
the sync loop calls its `record_*` / `set_*` methods, which keep the loop readable. The text the
metrics server writes is Go's (`agent.metrics.exposition`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent.clock import Clock, SystemClock
from agent.config import Mode
from agent.model.types import ServiceEndpoints, ServicePort

log = logging.getLogger(__name__)

IPV4 = "IPv4"
ALPHA = "[ALPHA] "


def exponential_buckets(start: float, factor: float, count: int) -> tuple[float, ...]:
    return tuple(start * factor**i for i in range(count))


def linear_buckets(start: float, width: float, count: int) -> tuple[float, ...]:
    return tuple(start + width * i for i in range(count))


SYNC_BUCKETS = exponential_buckets(0.001, 2, 15)
# component-base metrics.MergeBuckets starts from a zero bucket: `result := make([]float64, 1)`.
NETWORK_PROGRAMMING_BUCKETS = (
    0.0,
    *linear_buckets(0.25, 0.25, 2),  # 0.25s, 0.50s
    *linear_buckets(1, 1, 59),  # 1s .. 59s
    *linear_buckets(60, 5, 12),  # 60s .. 115s
    *linear_buckets(120, 30, 7),  # 2min .. 5min
)

# nfacct counter names the iptables rules count into (pkg/proxy/metrics, pkg/proxy/iptables).
NFACCT_CT_STATE_INVALID = "ct_state_invalid_dropped_pkts"
NFACCT_LOCALHOST_NODEPORTS = "localhost_nps_accepted_pkts"

NfacctReader = Callable[[], Mapping[str, int]]  # counter name -> packets


class NfacctCollector(Collector):
    """kube-proxy's nfacct collectors (iptables mode): packets the INVALID-drop rule dropped and
    packets accepted on localhost NodePorts, read from the kernel's nfacct counters at scrape
    time. A counter that cannot be read is left out of the scrape, as upstream does."""

    FAMILIES = (
        (
            "kubeproxy_iptables_ct_state_invalid_dropped_packets",
            "packets dropped by iptables to work around conntrack problems",
            NFACCT_CT_STATE_INVALID,
        ),
        (
            "kubeproxy_iptables_localhost_nodeports_accepted_packets",
            "Number of packets accepted on nodeports of loopback interface",
            NFACCT_LOCALHOST_NODEPORTS,
        ),
    )

    def __init__(self, read: NfacctReader) -> None:
        self._read = read

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(name, ALPHA + text) for name, text, _ in self.FAMILIES]

    def collect(self) -> Iterator[Metric]:
        try:
            counters = self._read()
        except Exception as exc:
            log.error("cannot read nfacct counters for /metrics: %s", exc)
            return
        for name, text, counter in self.FAMILIES:
            if counter in counters:
                family = CounterMetricFamily(name, ALPHA + text)
                family.add_metric([], float(counters[counter]))
                yield family


def no_local_endpoints(sp: ServicePort, eps: ServiceEndpoints) -> tuple[int, int]:
    """(internal, external) for one service port: 1 where its Local traffic policy finds
    endpoints elsewhere and none on this node (traffic dropped), as kube-proxy's
    serviceNoLocalEndpointsTotalInternal / ...External count it. No endpoints at all is a reject,
    not counted."""
    if not eps.has_any or eps.local:
        return 0, 0
    return int(sp.internal_policy_local), int(sp.external_policy_local)


class Metrics:
    """The agent's metrics in one registry. Construction registers them; nothing else happens."""

    def __init__(
        self,
        registry: CollectorRegistry,
        mode: Mode = Mode.EBPF,
        *,
        nfacct: NfacctReader | None = None,
        clock: Clock | None = None,
        iptables: bool | None = None,
    ) -> None:
        self.mode = mode
        self._clock = clock or SystemClock()
        self._started_s = self._clock.wall_ns() / 1e9
        r = registry
        fam = ["ip_family"]
        self.sync_seconds = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            ALPHA + "SyncProxyRules latency in seconds",
            fam,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.sync_full_seconds = Histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            ALPHA + "SyncProxyRules latency in seconds for full resyncs",
            fam,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.sync_partial_seconds = Histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            ALPHA + "SyncProxyRules latency in seconds for partial resyncs",
            fam,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            ALPHA + "The last time proxy rules were successfully synced",
            fam,
            registry=r,
        )
        self.last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            ALPHA + "The last time a sync of proxy rules was queued",
            fam,
            registry=r,
        )
        self.network_programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            ALPHA + "In Cluster Network Programming Latency in seconds",
            fam,
            buckets=NETWORK_PROGRAMMING_BUCKETS,
            registry=r,
        )
        self.endpoint_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            ALPHA + "Pending proxy rules Endpoint changes",
            registry=r,
        )
        self.endpoint_changes = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            ALPHA + "Cumulative proxy rules Endpoint changes",
            registry=r,
        )
        self.service_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            ALPHA + "Pending proxy rules Service changes",
            registry=r,
        )
        self.service_changes = Counter(
            "kubeproxy_sync_proxy_rules_service_changes_total",
            ALPHA + "Cumulative proxy rules Service changes",
            registry=r,
        )
        self.healthz = Counter(
            "kubeproxy_proxy_healthz_total",
            ALPHA + "Cumulative proxy healthz HTTP status",
            ["code"],
            registry=r,
        )
        self.livez = Counter(
            "kubeproxy_proxy_livez_total", ALPHA + "Cumulative proxy livez HTTP status", ["code"], registry=r
        )
        self.no_local_endpoints = Gauge(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            ALPHA + "Number of services with a Local traffic policy and no endpoints",
            ["ip_family", "traffic_policy"],
            registry=r,
        )
        # `iptables`: whether iptables rules are written (default: in iptables mode; eBPF mode
        # writes ip6tables rules for IPv6 Services, whose families then carry ip_family="IPv6").
        if mode is Mode.IPTABLES if iptables is None else iptables:
            self._iptables(r, nfacct)
        # process_cpu_seconds_total, process_resident_memory_bytes, ...: the names and help texts
        # of Go's process collector, which kube-proxy's registry has too.
        ProcessCollector(registry=r)
        self.skipped_objects = Counter(
            "ekp_skipped_objects_total",
            "Kubernetes objects skipped because they could not be understood (see the log for which and why)",
            ["kind"],
            registry=r,
        )
        self.refused_frontends = Counter(
            "ekp_refused_frontends_total",
            "Services whose externalIPs, load-balancer IPs or node ports this node refused to program "
            "(reason RefusedExternalIP or RefusedNodePort; the log and the Service's Events say which)",
            ["reason"],
            registry=r,
        )
        self.invalid_objects = Gauge(
            "ekp_invalid_objects",
            "Kubernetes objects currently left out of the proxy state because they are malformed",
            registry=r,
        )
        self.sync_failures = Counter(
            "ekp_sync_failures_total",
            "Syncs that failed as a whole and will be retried (the log says why)",
            fam,
            registry=r,
        )
        self.failed_service_ports = Gauge(
            "ekp_failed_service_ports",
            "Service ports the last sync could not program (a full map, a rejected rule; the log says which)",
            registry=r,
        )
        # eBPF mode's: the flows the tc IPv6 path's SNAT waits for (agent/ebpf/proxier.py
        # _snat6_ports_held), set by the proxier at each look
        self.ipv6_snat_held_flows: Gauge | None = None
        # ... and whether it is granted (agent/ebpf/proxier.py _snat6_granted), at each IPv6 sync
        self.ipv6_snat_granted: Gauge | None = None
        # ... and the loads with the XDP programs that failed (agent/ebpf/proxier.py _load_xdp)
        self.xdp_load_failures: Counter | None = None
        if mode is Mode.EBPF:
            self.ipv6_snat_granted = Gauge(
                "ekp_ipv6_snat_granted",
                "1 while the tc programs' IPv6 path source-translates masqueraded flows itself (ekp_cfg6"
                " holds the node's IPv6 address), 0 while it leaves them to ip6tables (the log says why"
                " when it changes: the path off, an ip6tables restore or an nf_conntrack read that failed,"
                " no usable IPv6 address, held flows, --bpf-snat-ports not written yet)",
                registry=r,
            )
            self.xdp_load_failures = Counter(
                "ekp_xdp_load_failures_total",
                "Loads of the data path with the XDP programs (--bpf-xdp=best-effort, once an external"
                " device that takes native XDP (no veth, bridge nor vxlan) appeared) that failed: the tc"
                " programs serve meanwhile, and periodic syncs try again with a backoff (the log says why)",
                registry=r,
            )
            self.ipv6_snat_held_flows = Gauge(
                "ekp_ipv6_snat_held_flows",
                "IPv6 TCP and UDP flows ip6tables masqueraded to the node's IPv6 SNAT address and a port of"
                " --bpf-snat-ports before its rule kept out of them: while above 0 the tc programs'"
                " IPv6 path leaves source translations to ip6tables (the log names them)",
                registry=r,
            )

    def _iptables(self, r: CollectorRegistry, nfacct: NfacctReader | None) -> None:
        fam = ["ip_family"]
        self.restore_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
            ALPHA + "Cumulative proxy iptables restore failures",
            fam,
            registry=r,
        )
        self.partial_restore_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
            ALPHA + "Cumulative proxy iptables partial restore failures",
            fam,
            registry=r,
        )
        self.iptables_rules = Gauge(
            "kubeproxy_sync_proxy_rules_iptables_total",
            ALPHA + "Total number of iptables rules owned by kube-proxy",
            ["ip_family", "table"],
            registry=r,
        )
        self.iptables_rules_last = Gauge(
            "kubeproxy_sync_proxy_rules_iptables_last",
            ALPHA + "Number of iptables rules written by kube-proxy in last sync",
            ["ip_family", "table"],
            registry=r,
        )
        self.conntrack_reconciler_seconds = Histogram(
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            ALPHA + "ReconcileConntrackFlowsLatency latency in seconds",
            fam,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.conntrack_reconciler_deleted = Counter(
            "kubeproxy_conntrack_reconciler_deleted_entries_total",
            ALPHA + "Cumulative conntrack flows deleted by conntrack reconciler",
            fam,
            registry=r,
        )
        if nfacct is not None:
            r.register(NfacctCollector(nfacct))

    # ------------------------------------------------------------------------ the sync loop

    def _now_s(self) -> float:
        # Gauge.SetToCurrentTime: float64(time.Now().UnixNano()) / 1e9, the same rounding as here.
        return self._clock.wall_ns() / 1e9

    def record_queued(self, family: str = IPV4) -> None:
        """A change was queued for the next sync of `family`'s proxier (kube-proxy: every
        Service/EndpointSlice event its change tracker takes)."""
        self.last_queued.labels(family).set(self._now_s())

    def record_changes(self, *, services: int = 0, endpoints: int = 0) -> None:
        """Service / EndpointSlice events that changed the tracked state (counted once each)."""
        if services:
            self.service_changes.inc(services)
        if endpoints:
            self.endpoint_changes.inc(endpoints)

    def set_pending(self, *, services: int, endpoints: int) -> None:
        """Changes tracked but not yet synced (kube-proxy sets these from its change trackers)."""
        self.service_changes_pending.set(services)
        self.endpoint_changes_pending.set(endpoints)

    def serve_families(self, *families: str) -> None:
        """The families this agent programs: their failure counters exist at 0 from the start (a
        labelled counter has no series until its first label, and a rate() or an alert on a series
        that appears only at the first failure misses it)."""
        for family in families:
            self.sync_failures.labels(family)

    def record_sync(self, full: bool, seconds: float, ok: bool = True, family: str = IPV4) -> None:
        """One sync of `family`'s proxier took `seconds`. Durations are observed for failed syncs
        too, as upstream's deferred Observe; the last-sync timestamp moves only when the sync
        succeeded."""
        self.sync_seconds.labels(family).observe(seconds)
        (self.sync_full_seconds if full else self.sync_partial_seconds).labels(family).observe(seconds)
        if ok:
            self.last_sync.labels(family).set(self._now_s())
        else:
            self.sync_failures.labels(family).inc()

    def record_network_programming(self, trigger_times: Iterable[float], family: str = IPV4) -> int:
        """After a successful sync: one observation per EndpointSlice change it programmed, from
        the slice's `endpoints.kubernetes.io/last-change-trigger-time` (as epoch seconds: the model
        parses the annotation) to now. As upstream's tracker, times from before this agent
        started are skipped (an initial list carries old annotations). Returns how many were
        observed."""
        now = self._now_s()
        observed = 0
        child = self.network_programming.labels(family)
        for t in trigger_times:
            if t <= self._started_s:
                continue
            child.observe(max(0.0, now - t))
            observed += 1
        return observed

    def set_no_local_endpoints(self, internal: int, external: int, family: str = IPV4) -> None:
        """Service ports whose Local policy finds no local endpoint (`no_local_endpoint_counts`)."""
        self.no_local_endpoints.labels(family, "internal").set(internal)
        self.no_local_endpoints.labels(family, "external").set(external)

    def set_failed_service_ports(self, count: int) -> None:
        self.failed_service_ports.set(count)

    def count_health_probe(self, endpoint: str, code: int) -> None:
        """/healthz or /livez answered `code` (ProxyHealthHandlers' `count` hook)."""
        (self.healthz if endpoint == "healthz" else self.livez).labels(str(code)).inc()

    def record_skipped(self, kind: str) -> None:
        self.skipped_objects.labels(kind=kind).inc()

    def record_refused(self, reason: str) -> None:
        self.refused_frontends.labels(reason=reason).inc()

    def set_invalid_objects(self, count: int) -> None:
        self.invalid_objects.set(count)

    # ------------------------------------------------------------------------ iptables mode

    def record_restore_failure(self, partial: bool, family: str = IPV4) -> None:
        """iptables-restore (ip6tables-restore: `family` IPv6) failed; a failed partial restore
        falls back to a full one."""
        (self.partial_restore_failures if partial else self.restore_failures).labels(family).inc()

    def set_iptables_rules(
        self, total: Mapping[str, int], written: Mapping[str, int], family: str = IPV4
    ) -> None:
        """Rules per table after the sync, and rules written by it (`filter`, `nat`), of one
        family's proxier (kube-proxy's `ip_family` label)."""
        for table, n in total.items():
            self.iptables_rules.labels(family, table).set(n)
        for table, n in written.items():
            self.iptables_rules_last.labels(family, table).set(n)

    def record_conntrack_cleanup(self, seconds: float, deleted: int, family: str = IPV4) -> None:
        self.conntrack_reconciler_seconds.labels(family).observe(seconds)
        if deleted:
            self.conntrack_reconciler_deleted.labels(family).inc(deleted)
