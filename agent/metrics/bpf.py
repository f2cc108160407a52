"""What the eBPF data path holds and counts, read from its pinned maps at scrape time.

A `prometheus_client` Collector: nothing is copied on a timer, every scrape opens the maps, reads
them and closes them again, so the numbers are the kernel's at that moment and a restarted agent
(or `agent inspect` in another process) sees the same.

Families (`map` is the kernel name, e.g. `ekp_ct_tcp_v2`):

* `ekp_bpf_map_entries{map}`, `ekp_bpf_map_capacity{map}` (max_entries) and
  `ekp_bpf_map_fill_ratio{map}` for every map; `ekp_conntrack_entries` repeats the conntrack
  tables' count (TCP and the rest) by `ip_family` (`IPv4`: IPv4's tables, `IPv6`: the tc IPv6
  path's; kube-proxy's label and values) under the name operators look for. Arrays are always full (the
  kernel preallocates every slot). An LRU table near full is normal (dead entries stay until their
  room is needed): `agent inspect capacity` tells live entries from expired ones, and
  `ekp_datapath_drops_total{reason="no_flow"}` counts the live flows an eviction cost.
* `ekp_bpf_map_up{map}`: 1 when the map could be read at this scrape, 0 otherwise (not pinned
  yet, or pinned by a different layout).
* the data path's counters from `ekp_stats_v3`, summed over CPUs: packets, new flows, conntrack
  hits by direction (ICMP errors about a flow count as `related`), SNAT, affinity hits, packets
  passed to the stack, drops by reason, flow events (SNAT port early drops and remaps,
  conntrack entries rebuilt, fragments translated, held before their first and put back), and
  `ekp_datapath_conntrack_evictions_total{state}`: flows the early-drop queues deleted
  (bpf/ekp_ctq.h), by state: `unreplied`, `unassured` (replied, never established), `closed`.
  An established flow is never among them; one the LRU had to evict (a table full of
  established flows) shows as `drops_total{reason="no_flow"}` when its next segment comes.
* the XDP program's counters from `ekp_xstats_v3`: `ekp_datapath_xdp_packets_total{outcome}`
  (`new_flow`, `forward`, `reply`: translated and sent back out at XDP; `to_tc`: a service packet
  it left to the tc program, which counts it again; `pass`: not its business; `drop`) and
  `ekp_datapath_xdp_drops_total{reason}` with the tc drops' reasons.
  The socket programs' connect()/sendmsg() calls by outcome (their refusals count among the
  drops, by the same reasons), reverse translations and UDP sockets ended.
* `ekp_bpf_maps_scrape_duration_seconds`: what this scrape cost.

Counting a hash map's entries has no kernel call, so `BpfMap.count` walks it with
`BPF_MAP_LOOKUP_BATCH` in chunks of 16,384 entries into buffers allocated once: per-chunk Python
work, not per-entry. A 250,000-entry conntrack map is counted in about 0.08 s (printed by
tests/health/test_bpf_metrics.py: 74-83 ms on the VM of 2026-11-27); the LPM trie (no batch
support) is walked key by key, which its size (source ranges) keeps cheap.

The map opener is a parameter, so tests pass `agent.ebpf.maps.FakeMap`s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent.ebpf.abi import CT6_ROLES, CT_ROLES, DROPS, EVICTIONS, MAPS, MapSpec, Stat
from agent.ebpf.maps import MapWriter, open_pinned_as_held, read_stats
from agent.model.types import IPFamily

log = logging.getLogger(__name__)

MapOpener = Callable[[MapSpec], MapWriter]


# Label values of every drop counter (tests/health/test_bpf_metrics.py checks none is missing).
_DROP_REASONS = {
    Stat.DROP_MALFORMED: "malformed",
    Stat.DROP_NO_ENDPOINTS: "no_endpoints",
    Stat.DROP_NO_LOCAL: "no_local_endpoints",
    Stat.DROP_NO_BACKEND: "no_backend",
    Stat.DROP_SOURCE_RANGE: "source_range",
    Stat.DROP_FIB: "fib_lookup",
    Stat.DROP_SNAT_PORTS: "snat_ports_exhausted",
    Stat.DROP_CT_FULL: "conntrack_full",
    Stat.DROP_FRAG_NO_FIRST: "fragment_without_first",
    Stat.DROP_NO_FLOW: "no_flow",
    Stat.DROP_BACKEND_GONE: "backend_gone",
    Stat.DROP_ICMP_RATE: "icmp_rate_limited",
    Stat.DROP_FRAG_NEEDED: "fragmentation_needed",
    Stat.DROP_SPOOFED: "spoofed_source",
    Stat.DROP_HANDOVER: "handover",
    Stat.DROP_TUPLE_TAKEN: "reply_tuple_taken",
    Stat.DROP_HOP_LIMIT: "hop_limit_exceeded",
}
assert set(_DROP_REASONS) == set(DROPS)
_FLOW_EVENTS = {
    Stat.EARLY_DROP: "snat_early_drop",
    Stat.PORT_REMAP: "snat_port_remap",
    Stat.CT_REBUILT: "conntrack_rebuilt",
    Stat.FRAGMENTS: "fragment_translated",
    Stat.FRAG_HELD: "fragment_held",
    Stat.FRAG_RELEASED: "fragment_released",
    Stat.CT_RESUMED: "conntrack_resumed",
}
# The XDP program's outcomes (ekp_xstats_v3), by label: what it carried out itself, what it left to
# the tc program behind it, what was none of its business.
_XDP_OUTCOMES = {
    Stat.NEW_FLOWS: "new_flow",
    Stat.CT_FORWARD: "forward",
    Stat.CT_REPLY: "reply",
    Stat.TO_TC: "to_tc",
    Stat.PASS: "pass",
}


def pinned_opener(pin_path: str) -> MapOpener:
    """Opens each map from its pin under `--bpf-pin-path` (needs root), with the value size it
    was created with (a Maglev table's follows the table size)."""

    def open_map(spec: MapSpec) -> MapWriter:
        return open_pinned_as_held(spec, pin_path)

    return open_map


IPV4, IPV6 = str(IPFamily.IPv4), str(IPFamily.IPv6)  # the ip_family label's values


class _Families:
    """One scrape's metric families (empty ones are left out of the text by the exposition)."""

    def __init__(self) -> None:
        g, c = GaugeMetricFamily, CounterMetricFamily
        self.entries = g("ekp_bpf_map_entries", "Entries in the eBPF map now", labels=["map"])
        self.capacity = g(
            "ekp_bpf_map_capacity", "Maximum entries of the eBPF map (--bpf-*-max)", labels=["map"]
        )
        self.fill = g("ekp_bpf_map_fill_ratio", "Entries / capacity of the eBPF map", labels=["map"])
        self.up = g("ekp_bpf_map_up", "1 if the eBPF map could be read at this scrape", labels=["map"])
        self.conntrack = g(
            "ekp_conntrack_entries",
            "Entries in the eBPF data path's conntrack maps (two per flow), by family: IPv4's tables and"
            " the tc IPv6 path's",
            labels=["ip_family"],
        )
        self.packets = c("ekp_datapath_packets", "Packets the eBPF programs looked at")
        self.flows = c("ekp_datapath_new_flows", "Connections the eBPF data path load-balanced")
        self.hits = c(
            "ekp_datapath_conntrack_hits",
            "Packets of known flows, by direction (forward: client to backend)",
            labels=["direction"],
        )
        self.snat = c("ekp_datapath_snat", "Packets source-translated to the node (remote backends, hairpin)")
        self.affinity = c("ekp_datapath_affinity_hits", "New flows sent to a sessionAffinity backend")
        self.passed = c(
            "ekp_datapath_passed", "Packets left to the kernel's stack untouched (not for a service)"
        )
        self.drops = c(
            "ekp_datapath_drops", "Packets the eBPF data path dropped, by reason", labels=["reason"]
        )
        self.events = c(
            "ekp_datapath_flow_events",
            "Flow events of the eBPF data path (SNAT port early drops and remaps, conntrack entries"
            " rebuilt from their twin, non-first fragments translated, fragments held before their"
            " first and put back when it came)",
            labels=["event"],
        )
        self.evictions = c(
            "ekp_datapath_conntrack_evictions",
            "Flows the eBPF conntrack's early-drop queues deleted to keep room for established"
            " ones, by the state they were in (unreplied, unassured: replied but never"
            " established, closed)",
            labels=["state"],
        )
        self.sock_calls = c(
            "ekp_socket_lb_calls",
            "connect() and sendmsg() calls of the node's sockets seen by the socket programs, by outcome"
            " (translated: sent to a backend; passed: not a frontend; refused: see ekp_datapath_drops)",
            labels=["outcome"],
        )
        self.sock_revnat = c(
            "ekp_socket_lb_reverse_translations",
            "recvmsg() and getpeername() calls shown the frontend address instead of the backend's",
        )
        self.sock_ended = c(
            "ekp_socket_lb_udp_sockets_ended",
            "Connected UDP sockets ended because the backend chosen at connect() left its service",
        )

        self.xdp_packets = c(
            "ekp_datapath_xdp_packets",
            "Packets the XDP program of the external devices looked at, by outcome (new_flow, forward,"
            " reply: translated and sent back out at XDP; to_tc: a service packet left to the tc"
            " program; pass: none of its business; drop: see ekp_datapath_xdp_drops)",
            labels=["outcome"],
        )
        self.xdp_drops = c(
            "ekp_datapath_xdp_drops", "Packets the XDP program dropped, by reason", labels=["reason"]
        )

    def all(self) -> list[Metric]:
        return [
            self.entries,
            self.capacity,
            self.fill,
            self.up,
            self.conntrack,
            self.packets,
            self.flows,
            self.hits,
            self.snat,
            self.affinity,
            self.passed,
            self.drops,
            self.events,
            self.evictions,
            self.xdp_packets,
            self.xdp_drops,
            self.sock_calls,
            self.sock_revnat,
            self.sock_ended,
        ]

    def add_stats(self, values: dict[Stat, int]) -> None:
        self.packets.add_metric([], values[Stat.PACKETS])
        self.flows.add_metric([], values[Stat.NEW_FLOWS])
        self.hits.add_metric(["forward"], values[Stat.CT_FORWARD])
        self.hits.add_metric(["reply"], values[Stat.CT_REPLY])
        self.hits.add_metric(["related"], values[Stat.CT_RELATED])
        self.snat.add_metric([], values[Stat.SNAT])
        self.affinity.add_metric([], values[Stat.AFFINITY_HIT])
        self.passed.add_metric([], values[Stat.PASS])
        for stat, reason in _DROP_REASONS.items():
            self.drops.add_metric([reason], values[stat])
        for stat, event in _FLOW_EVENTS.items():
            self.events.add_metric([event], values[stat])
        for stat, state in EVICTIONS.items():
            self.evictions.add_metric([state], values[stat])
        translated, passed = values[Stat.SOCK_TRANSLATED], values[Stat.SOCK_PASS]
        self.sock_calls.add_metric(["translated"], translated)
        self.sock_calls.add_metric(["passed"], passed)
        self.sock_calls.add_metric(["refused"], max(0, values[Stat.SOCK_CALLS] - translated - passed))
        self.sock_revnat.add_metric([], values[Stat.SOCK_REVNAT])
        self.sock_ended.add_metric([], values[Stat.SOCK_DESTROYED])

    def add_xdp_stats(self, values: dict[Stat, int]) -> None:
        for stat, outcome in _XDP_OUTCOMES.items():
            self.xdp_packets.add_metric([outcome], values[stat])
        self.xdp_packets.add_metric(["drop"], sum(values[stat] for stat in _DROP_REASONS))
        for stat, reason in _DROP_REASONS.items():
            self.xdp_drops.add_metric([reason], values[stat])


class BpfMapsCollector(Collector):
    """Reads the data path's maps at every scrape (see the module docstring for the families)."""

    def __init__(self, open_map: MapOpener, specs: Iterable[MapSpec] | None = None) -> None:
        self._open = open_map
        self._specs = tuple(specs if specs is not None else MAPS.values())
        self._failing: dict[str, str] = {}

    def describe(self) -> Iterable[Metric]:
        # Names only, so registering the collector reads no map.
        return [*_Families().all(), self._took(0.0)]

    def collect(self) -> Iterator[Metric]:
        start = time.perf_counter()
        f = _Families()
        conntrack: dict[str, int] = {}  # by family, for the tables that could be read
        for spec in self._specs:
            read = self._read(spec, f)
            f.up.add_metric([spec.name], 1 if read is not None else 0)
            if read is None:
                continue
            n, size = read
            f.entries.add_metric([spec.name], n)
            f.capacity.add_metric([spec.name], size)
            f.fill.add_metric([spec.name], n / size if size else 0.0)
            family = IPV4 if spec.role in CT_ROLES else IPV6 if spec.role in CT6_ROLES else None
            if family is not None:
                conntrack[family] = conntrack.get(family, 0) + n
        for family, n in conntrack.items():
            f.conntrack.add_metric([family], n)
        yield from f.all()
        yield self._took(time.perf_counter() - start)

    # -- helpers

    def _read(self, spec: MapSpec, f: _Families) -> tuple[int, int] | None:
        """(entries, capacity) of one map, and the counters when it is the stats map."""
        try:
            m = self._open(spec)
        except OSError as exc:
            self._note_failure(spec, exc)
            return None
        try:
            n, size = m.count(), m.capacity()
            if spec.role == "stats":
                f.add_stats(read_stats(m))
            elif spec.role == "xstats":
                f.add_xdp_stats(read_stats(m))
        except OSError as exc:
            self._note_failure(spec, exc)
            return None
        finally:
            close = getattr(m, "close", None)
            if close is not None:
                with contextlib.suppress(OSError):
                    close()
        self._note_ok(spec)
        return n, size

    @staticmethod
    def _took(seconds: float) -> Metric:
        took = GaugeMetricFamily(
            "ekp_bpf_maps_scrape_duration_seconds", "Time this scrape spent reading the eBPF maps"
        )
        took.add_metric([], seconds)
        return took

    def _note_failure(self, spec: MapSpec, exc: OSError) -> None:
        text = exc.strerror or str(exc)
        if self._failing.get(spec.name) != text:
            log.warning(
                "cannot read eBPF map %s for /metrics: %s (normal before the first sync; otherwise "
                "check --bpf-pin-path and that the agent runs as root)",
                spec.name,
                text,
            )
        self._failing[spec.name] = text

    def _note_ok(self, spec: MapSpec) -> None:
        if self._failing.pop(spec.name, None) is not None:
            log.info("eBPF map %s is readable again for /metrics", spec.name)
