"""The long-running agent: one object owns the source, the model, the sync loop and the proxier.

    source (file | API) --events--> Agent.deliver (any thread: enqueue, mark the health check
                                    "update queued", wake the runner)
    runner thread:  drain the queue into ProxyModel -> commit (changed service ports)
                    -> proxier.sync(state, node, changed | None) -> health, metrics, events, log

* **First-sync gate.** Nothing is synced, so nothing already programmed is pruned, until the source
  has delivered a complete list of every kind it watches (`Synced` for each of `source.kinds`): a
  restart whose API server is away, or whose first list fails, leaves the maps and rules alone.
* **Incremental, with a periodic full sync.** A sync hands the proxier only the service ports that
  changed (plus those that failed last time); every `sync_period` (and when the node's zone or
  addresses change) it asks for a full sync, which also reads the kernel back and repairs it.
  The node's addresses are re-read at full syncs and whenever `node_events` (netlink,
  agent/nodewatch.py) says they may have changed.
* **Failures.** A sync that raises is retried by the runner with backoff; service ports the
  proxier could not program are retried at the next sync and logged once each; an
  `agent.errors.FatalError` stops the agent with exit status 1 and its message.
* **Two families** (kube-proxy's metaproxier, agent/metaproxier.py): every Service and
  EndpointSlice also feeds an IPv6 model; when the mode programs IPv6 (`Parts.proxier6`), each
  sync offers it to the IPv6 family right after IPv4 (after a failed IPv4 sync too), which calls
  its proxier only when something is due for it and at most once per its own floor
  (`IPv6Family`), else the agent says once that IPv6 Services exist unserved.
  As upstream's two proxiers, each family then has its own entry in the proxy health (queued by
  the objects that touch it, updated by its own successful sync), its own healthCheckNodePort
  server (`Parts.service_health6`, fed from the IPv6 commits) and its own `ip_family` in the sync
  metrics.
* **Problems** (malformed objects, conflicts) are logged and counted once when they appear,
  reported as Kubernetes Events through `events`, and logged again when they go away. So are
  frontends the node refuses (`frontend_guard`: externalIPs and load-balancer IPs on its own
  addresses, the pod or Service CIDRs or outside `--external-ip-cidrs`, node ports outside
  `--node-port-range`), counted in `ekp_refused_frontends_total`; the guard follows the node's
  addresses, read before the commit that needs them.

Construction has no side effects; `start()` starts the source, the servers and the runner;
`run()` also handles SIGTERM/SIGINT and returns the exit status. Stopping removes nothing: programs,
maps and rules keep serving traffic while the agent is away.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NamedTuple, Protocol

from prometheus_client import CollectorRegistry

from agent.config import Config, NodeContext
from agent.errors import FatalError
from agent.featuregates import node_info
from agent.localdetect import LocalMode
from agent.metaproxier import IPv6Family, Outcome, frontend_guard
from agent.metrics import Metrics, no_local_endpoints
from agent.model.problem import Problem, printable
from agent.model.tracker import Commit, ProxyModel, ServiceRecord, SliceRecord, read_service, read_slice
from agent.model.types import FAMILIES, IPFamily, ServicePortName
from agent.proxier import Proxier, SyncResult
from agent.runner import BoundedFrequencyRunner
from agent.sources.base import JSON_MAP_TYPES, Event, EventType, Kind, ObjectEvent, Source, Synced

log = logging.getLogger("agent")

# Service ports named one by one when they fail or recover in a sync; the rest are counted (a map
# too small for 50,000 services fails thousands at once).
FAILURES_LOGGED = 10


class ProxierHealth(Protocol):
    """kube-proxy's proxy health (agent.health): /healthz and /livez follow it, per IP family
    ("IPv4", "IPv6") as upstream's ProxyHealthServer, which each family's proxier feeds."""

    def queued_update(self, family: str) -> None: ...

    def updated(self, family: str) -> None: ...

    def sync_node(self, node: Mapping[str, Any] | None) -> None: ...


class ServiceHealth(Protocol):
    """kube-proxy's healthCheckNodePort servers (agent.health)."""

    def sync_services(self, ports: Mapping[str, int]) -> None: ...

    def sync_endpoints(self, local: Mapping[str, int]) -> None: ...


class EventSink(Protocol):
    """Kubernetes Events for problems (agent.kube.events), or nothing (the file source)."""

    def warn(self, problem: Problem, uid: str | None = None) -> None: ...


class NodeEvents(Protocol):
    """Tells the agent when the node's addresses may have changed (agent.nodewatch)."""

    def start(self, notify: Callable[[], None]) -> None: ...

    def stop(self) -> None: ...


class Service(Protocol):
    """A server or helper the agent starts and stops with itself (health, metrics, events)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


Record = ServiceRecord | SliceRecord


class RecordKeeper(Protocol):
    """The model's records kept across a clean restart (agent.keptrecords)."""

    def take(self, kind: Kind, key: str, uid: str, version: str) -> Record | None: ...

    def drop(self) -> None: ...

    def save(self, records: Mapping[tuple[Kind, str], tuple[str, str, Record]]) -> None: ...


class NoEvents:
    """Events for runs without an API server (the file source): none."""

    def warn(self, problem: Problem, uid: str | None = None) -> None:
        return None


@dataclass
class Parts:
    """What an Agent is made of; the app wires real ones, tests pass fakes."""

    source: Source
    proxier: Proxier
    node_context: Callable[[], NodeContext]  # the node's addresses (re-read at full syncs)
    node_events: NodeEvents | None = None  # and when these say they changed
    metrics: Metrics = field(default_factory=lambda: Metrics(CollectorRegistry()))
    health: ProxierHealth | None = None
    service_health: ServiceHealth | None = None  # the IPv4 proxier's healthCheckNodePorts
    events: EventSink = field(default_factory=NoEvents)
    services: Sequence[Service] = ()  # started before the source, stopped after it
    close: Callable[[], None] | None = None  # release the proxier's resources on stop
    # The IPv6 proxier and the node's IPv6 addresses, when this mode programs IPv6.
    proxier6: Proxier | None = None
    node_context6: Callable[[], NodeContext] | None = None
    service_health6: ServiceHealth | None = None  # the IPv6 proxier's, on IPv6 sockets
    # The last run's records for the first lists, and this run's kept at the stop for the next.
    records: RecordKeeper | None = None
    # No IPv6 proxier though the flags ask for one (the node cannot do IPv6): the start said so.
    ipv6_unserved_said: bool = False


class Agent:
    def __init__(
        self,
        config: Config,
        parts: Parts,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._parts = parts
        self._clock = clock
        self._wall = wall
        self._model = ProxyModel(node_info(config))
        self._v6 = IPv6Family(
            config, parts.proxier6, parts.node_context6, clock, unserved_said=parts.ipv6_unserved_said
        )
        self._lock = threading.Lock()
        self._queue: list[Event | _Read] = []
        self._synced: set[Kind] = set()
        # What the source says it delivered, per kind: the list's version (a file's content hash,
        # an API list's resourceVersion), then the resourceVersion of each object event after it.
        self._versions: dict[Kind, str] = {}
        # metadata.uid by (kind, key): an Event's `regarding.uid` is what `kubectl describe` matches.
        self._uids: dict[tuple[str, str], str] = {}
        # With a RecordKeeper: every Service's and EndpointSlice's record with the uid and
        # resourceVersion it was read from, for the next start (agent.keptrecords).
        self._records: dict[tuple[Kind, str], tuple[str, str, Record]] = {}
        self._waiting_logged = False
        self._detector_logged = ""
        self._node: NodeContext | None = None
        self._node_stale = threading.Event()
        self._last_full = float("-inf")
        self._retry: dict[ServicePortName, str] = {}
        self._hc_feeds = [_HealthCheckFeed(parts.service_health), _HealthCheckFeed(parts.service_health6)]
        # The families whose proxier runs, each tracked by the proxy health as upstream's
        # per-family proxiers; with two, the families of each Service and EndpointSlice key.
        self._health_families = (IPFamily.IPv4,) + ((IPFamily.IPv6,) if parts.proxier6 is not None else ())
        self._key_families: dict[tuple[Kind, str], frozenset[IPFamily]] = {}
        self._no_local: dict[IPFamily, dict[ServicePortName, tuple[int, int]]] = {}
        self._stopped = threading.Event()
        self.exit_code = 0
        self.syncs = 0
        self.last_result: SyncResult | None = None
        self._runner = BoundedFrequencyRunner(
            self.sync_once,
            min_interval=config.min_sync_period_s,
            max_interval=config.sync_period_s,
            clock=clock,
            on_fatal=self._fatal,
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def runner(self) -> BoundedFrequencyRunner:
        return self._runner

    @property
    def model(self) -> ProxyModel:
        return self._model

    @property
    def ipv6(self) -> IPv6Family:
        return self._v6

    @property
    def version(self) -> str:
        """What the last sync included: one version when every kind has the same (a services
        file's content hash), else `Kind=version` per kind (API resourceVersions advance per kind)."""
        distinct = set(self._versions.values())
        if len(distinct) == 1:
            return distinct.pop()
        return ",".join(f"{kind}={v}" for kind, v in sorted(self._versions.items()))

    def start(self) -> None:
        if self._config.detect_local_mode is not LocalMode.NODE_CIDR:
            self._log_detector()  # NodeCIDR: once the Node is listed
        for svc in self._parts.services:
            svc.start()
        if self._parts.health is not None:
            for family in self._health_families:  # as each proxier's SyncLoop: healthy until a change waits
                self._parts.health.updated(str(family))
        # The source first: a source that cannot start (a --services-file that cannot be read) is
        # fatal before the proxier's set-up has created pins (the app checks it before it touches
        # the node at all, agent/app.py `check_source`; this prepare() then waits for the early
        # load).
        self._parts.source.start(self.deliver)
        if self._parts.node_events is not None:
            self._parts.node_events.start(self.refresh_node)
        threading.Thread(target=self._prepare, name="prepare-proxier", daemon=True).start()
        self._runner.start()

    def stop(self) -> None:
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def shutdown(self) -> None:
        """Stop everything this agent started; nothing programmed is removed."""
        self._runner.stop()
        self._parts.source.stop()
        if self._parts.node_events is not None:
            self._parts.node_events.stop()
        for svc in reversed(self._parts.services):
            svc.stop()
        if self._parts.close is not None:
            self._parts.close()
        if self._parts.records is not None and self._records:
            if self._runner.running():
                # the sync still running changes the records while they would be written
                log.warning(
                    "a sync was still running 30 s after the stop: the model's records are not kept, "
                    "so the next start reads every object"
                )
            else:
                self._parts.records.save(self._records)

    def run(self) -> int:
        """start(), serve until SIGTERM/SIGINT or a fatal error, shutdown(); the exit status."""
        agent_pid = os.getpid()

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            if os.getpid() != agent_pid:
                os._exit(0)  # a forked helper (pyroute2's netns worker) inherited this handler
            log.info(
                "received %s: stopping (programs, maps and rules stay in place)", signal.Signals(signum).name
            )
            self.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            self.start()
            while not self._stopped.wait(1.0):
                pass
        except FatalError as exc:
            log.error("%s", exc)
            self.exit_code = 1
        finally:
            self.shutdown()
        return self.exit_code

    def _prepare(self) -> None:
        """The proxier's slow set-up (compiling the data path), while the source lists."""
        try:
            self._parts.proxier.prepare()
            if self._parts.proxier6 is not None:
                self._parts.proxier6.prepare()
        except FatalError as exc:
            self._fatal(exc)
        except Exception as exc:
            log.warning(
                "preparing the %s data path failed (the first sync tries again): %s", self._config.mode, exc
            )

    def _fatal(self, exc: FatalError) -> None:
        log.error("%s", exc)
        self.exit_code = 1
        self.stop()

    # ------------------------------------------------------------------ input (any thread)

    def deliver(self, events: Sequence[Event]) -> None:
        """The source's sink: read Services and EndpointSlices into the model's records here, on
        the source's thread, then enqueue and ask for a sync. The decoded objects go as soon as
        their batch (a list page) is read, whatever the sync thread is busy with: a list of 10,000
        of each is never queued whole as dicts."""
        if not events:
            return
        read = [_read(e, self._config.hostname, self._parts.records) for e in events]
        with self._lock:
            self._queue.extend(read)
            touched = self._families_touched(read)
        for family in touched:
            if self._parts.health is not None:
                self._parts.health.queued_update(str(family))
            self._parts.metrics.record_queued(str(family))
        self._runner.request()

    def _families_touched(self, events: Sequence[Event | _Read]) -> list[IPFamily]:
        """The tracked families whose state `events` may change (under self._lock): a Service's
        or EndpointSlice's families now and before, every family for a Node; as upstream, where
        only the proxier whose change tracker took a change calls QueuedUpdate. With one family
        tracked, any object event counts (nothing is remembered per key)."""
        if len(self._health_families) == 1:
            changed = any(isinstance(e, _Read | ObjectEvent) for e in events)
            return list(self._health_families) if changed else []
        touched: set[IPFamily] = set()
        for event in events:
            if isinstance(event, _Read):
                key = (event.kind, event.key)
                now = _families(event.record)
                touched |= now | self._key_families.get(key, _NONE)
                self._key_families[key] = now
            elif isinstance(event, ObjectEvent):
                if event.kind is Kind.NODE:
                    touched.update(self._health_families)
                elif event.type is EventType.DELETED:
                    touched |= self._key_families.pop((event.kind, event.key), _NONE)
        return [f for f in self._health_families if f in touched]

    def refresh_node(self) -> None:
        """The node's addresses may have changed: re-read them at the next sync (any thread)."""
        self._node_stale.set()
        self._runner.request()

    # ------------------------------------------------------------------ the sync (runner thread)

    def sync_once(self) -> None:
        # The IPv6 floor is measured from here, as the runner measures its own from the run's start:
        # read after the events are applied, an apply longer than the last one's held IPv6 early.
        began = self._clock()
        with self._lock:
            events, self._queue = self._queue, []
        for event in events:
            self._apply(event)
        metrics = self._parts.metrics
        metrics.record_changes(
            services=self._model.pending_service_changes, endpoints=self._model.pending_endpoint_changes
        )
        missing = self._parts.source.kinds - self._synced
        if missing:
            if not self._waiting_logged:
                log.info(
                    "waiting for the first complete list of %s before programming anything "
                    "(what is programmed stays as it is)",
                    ", ".join(sorted(missing)),
                )
                self._waiting_logged = True
            return
        start = self._clock()
        periodic = start - self._last_full >= self._config.sync_period_s
        moved = read_node = False
        if periodic or self._model.full_pending or self._node is None or self._node_stale.is_set():
            read_node = True
            # Before the commit: the guard of external frontends depends on the node's addresses.
            self._node_stale.clear()  # before reading: a change while we read asks again
            node = self._parts.node_context()
            if node != self._node and self._node is not None:
                log.info("node addresses changed: %s", ",".join(node.node_ips) or "none")
                moved = True  # NodePorts (and the SNAT source) change on every service port
            self._node = node
            self._model.set_guard(frontend_guard(self._config, node))
        commit = self._model.commit()
        self._report(commit)
        full = commit.changed is None or periodic or moved
        changed: frozenset[ServicePortName] | None = None
        if not full:
            changed = (commit.changed or frozenset()) | frozenset(self._retry)
        failure: Exception | None = None
        try:
            result = self._parts.proxier.sync(self._model.state, self._node, changed)
        except FatalError:
            raise
        except Exception as exc:
            # Raised again below, after the IPv6 family's turn: as upstream's two proxiers, one
            # family's failure does not leave the other's Services unprogrammed.
            metrics.record_sync(full, self._clock() - start, ok=False)
            failure = exc
        elapsed = self._clock() - start  # the IPv4 proxier's sync, as upstream times each proxier
        if failure is None and self._parts.health is not None:
            self._parts.health.updated(str(IPFamily.IPv4))
        commit6 = self._v6.sync(read_node=read_node, now=began)
        self._report(commit6, reported=commit)
        if self._parts.proxier6 is not None:
            self._after_sync6()
        if failure is not None:
            raise failure  # the runner retries with backoff
        self.last_result = result
        self.syncs += 1
        if full:
            if self._last_full == float("-inf"):
                # The state of a whole cluster now lives for the agent's life: keep the collector
                # from walking it again and again (gc.freeze: into the permanent generation), and
                # let it run again (agent.collector holds it off while the agent starts).
                gc.freeze()
                gc.enable()
            self._last_full = start
        self._after_sync(commit, result, elapsed, full)

    def _apply(self, event: Event | _Read) -> None:
        if isinstance(event, Synced):
            self._synced.add(event.kind)
            if event.version:
                self._versions[event.kind] = event.version
            if self._parts.records is not None and {Kind.SERVICE, Kind.ENDPOINT_SLICE} <= self._synced:
                self._parts.records.drop()  # what no first list asked for is gone from the cluster
            return
        if isinstance(event, _Read):
            if event.version:
                self._versions[event.kind] = event.version
            self._remember(event.kind, event.key, event.uid)
            self._keep(event.kind, event.key, event.uid, event.version, event.record)
            for model in (self._model, self._v6.model):
                if isinstance(event.record, ServiceRecord):
                    model.set_service(event.key, event.record)
                else:
                    model.set_slice(event.key, event.record)
            return
        rv = _resource_version(event.obj)
        if rv:
            self._versions[event.kind] = rv
        deleted = event.type is EventType.DELETED
        obj = None if deleted else event.obj
        self._remember_uid(event.kind, event.key, obj)
        if event.kind in (Kind.SERVICE, Kind.ENDPOINT_SLICE):
            self._keep(event.kind, event.key, _uid(obj), rv, None)
        if event.kind is Kind.SERVICE:
            record = None if deleted else read_service(event.obj)
            for model in (self._model, self._v6.model):
                if record is None:
                    model.delete_service(event.key)
                else:
                    model.set_service(event.key, record)
        elif event.kind is Kind.ENDPOINT_SLICE:
            sliced = None if deleted else read_slice(event.obj, self._config.hostname)
            for model in (self._model, self._v6.model):
                if sliced is None:
                    model.delete_slice(event.key)
                else:
                    model.set_slice(event.key, sliced)
        elif event.kind is Kind.NODE:
            # A deleted Node keeps its pod CIDRs: kube-proxy's detector does not change until it restarts.
            pod_cidrs = _pod_cidrs(obj) if obj is not None else self._model.node.pod_cidrs
            self._model.set_node(node_info(self._config, _labels(obj), pod_cidrs))
            self._v6.set_node(self._model.node)
            self._log_detector()
            if self._parts.health is not None:
                self._parts.health.sync_node(obj)

    def _keep(self, kind: Kind, key: str, uid: str, version: str, record: Record | None) -> None:
        """This run's records as the model has them, for the next start; an object read here
        (not by `deliver`) or deleted leaves none (its next list reads it)."""
        if self._parts.records is None:
            return
        if record is not None and uid and version:
            self._records[(kind, key)] = (uid, version, record)
        else:
            self._records.pop((kind, key), None)

    def _log_detector(self) -> None:
        """One line when what counts as local traffic is first known or changes."""
        described = self._config.local_detector(self._model.node.pod_cidrs).describe()
        if described != self._detector_logged:
            log.info("local traffic (--detect-local-mode) %s", described)
            self._detector_logged = described

    def _remember_uid(self, kind: Kind, key: str, obj: object) -> None:
        self._remember(kind, key, _uid(obj))

    def _remember(self, kind: Kind, key: str, uid: str) -> None:
        if uid:
            self._uids[(kind.value, key)] = uid
        else:
            self._uids.pop((kind.value, key), None)

    def _uid_of(self, problem: Problem) -> str | None:
        key = f"{problem.namespace}/{problem.name}" if problem.kind != Kind.NODE.value else problem.name
        return self._uids.get((problem.kind, key))

    def _report(self, commit: Commit, reported: Commit | None = None) -> None:
        """Problems that appeared or went away; `reported`: the other family's commit, whose
        problems were reported already (a malformed Service is one problem, read by both)."""
        cleared = [
            p for p in commit.problems_cleared if reported is None or p not in reported.problems_cleared
        ]
        added = [p for p in commit.problems_added if reported is None or p not in reported.problems_added]
        for problem in cleared:
            log.info("resolved: %s", problem)
        for problem in added:
            if problem.refusal:
                log.error("refusing part of %s", problem)
                self._parts.metrics.record_refused(problem.refusal)
            else:
                log.error("skipping %s (every other object is still programmed)", problem)
                self._parts.metrics.record_skipped(problem.kind)
            self._parts.events.warn(problem, self._uid_of(problem))
        if added or cleared:
            self._parts.metrics.set_invalid_objects(sum(1 for p in self._model.problems() if not p.refusal))

    def _after_sync(self, commit: Commit, result: SyncResult, elapsed: float, full: bool) -> None:
        fresh = [(spn, why) for spn, why in result.failed.items() if self._retry.get(spn) != why]
        for spn, why in fresh[:FAILURES_LOGGED]:
            log.error("could not program %s: %s (retried; every other service is programmed)", spn, why)
        if len(fresh) > FAILURES_LOGGED:
            log.error(
                "could not program %d more service port(s) for the same kind of reason (retried); "
                "%d in all are not programmed",
                len(fresh) - FAILURES_LOGGED,
                len(result.failed),
            )
        recovered = sorted(self._retry.keys() - result.failed.keys())
        for spn in recovered[:FAILURES_LOGGED]:
            log.info("programmed %s after all", spn)
        if len(recovered) > FAILURES_LOGGED:
            log.info("programmed %d more service port(s) after all", len(recovered) - FAILURES_LOGGED)
        self._retry = dict(result.failed)
        if result.failed:
            self._runner.retry_soon()
        if result.repaired:
            log.warning(
                "full sync repaired %d difference(s) between the kernel and the desired state "
                "(changed behind the agent's back)",
                result.repaired,
            )
        self._hc_feeds[0].feed(commit)
        metrics = self._parts.metrics
        metrics.record_sync(full, elapsed)
        metrics.record_network_programming(commit.trigger_times)
        metrics.set_failed_service_ports(len(result.failed))
        metrics.set_pending(services=0, endpoints=0)
        self._count_no_local(self._model, commit)
        changed = "all" if commit.changed is None else str(len(commit.changed))
        # "sync done: version=V" says V is programmed in every family (the lab waits for it); while
        # the IPv6 family is held by its floor or failed, the line says IPv4 alone is.
        v6 = self._v6
        done = "sync done" if v6.in_step else "sync done for IPv4 only"
        behind = (
            ""
            if v6.in_step
            else f", IPv6 {'waits for its floor' if v6.outcome is Outcome.HELD else 'failed'}"
        )
        log.info(
            "%s: version=%s, %s sync, %s service port(s) changed, %d in all, %.1f ms%s",
            done,
            printable(self.version),
            "full" if full else "partial",
            changed,
            len(self._model.state.services),
            elapsed * 1000,
            behind,
        )

    def _after_sync6(self) -> None:
        """The IPv6 proxier's share of what `_after_sync` does for IPv4: its health, its
        healthCheckNodePorts and its metrics (labelled ip_family="IPv6", as upstream's IPv6
        proxier's), after what the IPv6 family did (`Outcome`). A failed call is timed and
        counted and moves nothing else; a family with nothing to program is in step (healthy);
        one held back by its floor asks the runner for a run when the floor has passed."""
        v6, metrics, family = self._v6, self._parts.metrics, str(IPFamily.IPv6)
        if v6.outcome in (Outcome.SYNCED, Outcome.FAILED):
            metrics.record_sync(v6.last_full, v6.elapsed, ok=v6.outcome is Outcome.SYNCED, family=family)
        if v6.retry_wanted:
            self._runner.retry_soon()
        if v6.again_at is not None:
            self._runner.request_at(v6.again_at)
        if v6.outcome is Outcome.HELD:
            self._runner.request_at(v6.due_at)
        commit = v6.programmed
        if commit is None:  # failed or held
            return
        if self._parts.health is not None:
            self._parts.health.updated(family)
        self._hc_feeds[1].feed(commit)
        if v6.outcome is Outcome.SYNCED:
            metrics.record_network_programming(commit.trigger_times, family)
        self._count_no_local(v6.model, commit)

    def _count_no_local(self, model: ProxyModel, commit: Commit) -> None:
        """kube-proxy's sync_proxy_rules_no_local_endpoints_total of `model`'s family, kept per
        changed service port."""
        state = model.state
        no_local = self._no_local.setdefault(model.family, {})
        ports = state.services if commit.changed is None else commit.changed
        if commit.changed is None:
            no_local.clear()
        for spn in ports:
            sp, eps = state.services.get(spn), state.endpoints.get(spn)
            counts = (0, 0) if sp is None or eps is None else no_local_endpoints(sp, eps)
            if counts == (0, 0):
                no_local.pop(spn, None)
            else:
                no_local[spn] = counts
        self._parts.metrics.set_no_local_endpoints(
            sum(i for i, _ in no_local.values()), sum(e for _, e in no_local.values()), str(model.family)
        )


class _HealthCheckFeed:
    """One family's healthCheckNodePort server fed from that family's commits: only what changed
    among the Services that have a healthCheckNodePort is passed on."""

    def __init__(self, server: ServiceHealth | None) -> None:
        self._server = server
        self._ports: dict[str, int] = {}
        self._local_ready: dict[str, int] = {}

    def feed(self, commit: Commit) -> None:
        if self._server is None:
            return
        ports_changed = endpoints_changed = False
        for key, port in commit.health_check_ports.items():
            if self._ports.get(key, 0) != port:
                ports_changed = True
                if port:
                    self._ports[key] = port
                else:
                    self._ports.pop(key, None)
                    self._local_ready.pop(key, None)
            if port and self._local_ready.get(key) != commit.local_endpoints.get(key, 0):
                self._local_ready[key] = commit.local_endpoints.get(key, 0)
                endpoints_changed = True
        if ports_changed:
            self._server.sync_services(dict(self._ports))
        if ports_changed or endpoints_changed:
            self._server.sync_endpoints(dict(self._local_ready))


class _Read(NamedTuple):
    """An added or changed Service or EndpointSlice, read into the model's record by `deliver`
    (a NamedTuple, as a list makes one per object: cheaper to build than a frozen dataclass, whose
    `__init__` makes one `object.__setattr__` call per field)."""

    kind: Kind
    key: str
    version: str  # resourceVersion
    uid: str
    record: ServiceRecord | SliceRecord


_NONE: frozenset[IPFamily] = frozenset()


def _families(record: ServiceRecord | SliceRecord) -> frozenset[IPFamily]:
    """The families whose proxier takes `record`: a Service's with ports of that family, a
    slice's addressType (none for a slice the model ignores)."""
    if isinstance(record, ServiceRecord):
        return frozenset(f for f in FAMILIES if record.ports_of(f))
    return frozenset() if record.parsed is None else frozenset({record.parsed.family})


def _read(event: Event, hostname: str, kept: RecordKeeper | None = None) -> Event | _Read:
    """`event` with its object read into a model record, for the kinds the model parses; the
    record the last run read from the same object (uid and resourceVersion) when `kept` has it."""
    if not isinstance(event, ObjectEvent) or event.type is EventType.DELETED:
        return event
    if event.kind not in (Kind.SERVICE, Kind.ENDPOINT_SLICE):
        return event
    obj = event.obj
    uid, version = _uid(obj), _resource_version(obj)
    record = event.kept if isinstance(event.kept, ServiceRecord | SliceRecord) else None
    if record is None and kept is not None:
        record = kept.take(event.kind, event.key, uid, version)
    if record is None:
        record = read_service(obj) if event.kind is Kind.SERVICE else read_slice(obj, hostname)
    return _Read(event.kind, event.key, version, uid, record)


def _uid(obj: object) -> str:
    meta = obj.get("metadata") if isinstance(obj, JSON_MAP_TYPES) else None
    uid = meta.get("uid") if isinstance(meta, JSON_MAP_TYPES) else None
    return uid if isinstance(uid, str) else ""


def _resource_version(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") if isinstance(obj, JSON_MAP_TYPES) else None
    rv = meta.get("resourceVersion") if isinstance(meta, JSON_MAP_TYPES) else None
    return rv if isinstance(rv, str) else ""


def _pod_cidrs(obj: Mapping[str, Any] | None) -> tuple[str, ...]:
    """spec.podCIDRs, else spec.podCIDR (a Node written before dual-stack), as strings."""
    spec = obj.get("spec") if obj is not None else None
    if not isinstance(spec, JSON_MAP_TYPES):
        return ()
    cidrs = spec.get("podCIDRs")
    if isinstance(cidrs, list) and cidrs:
        return tuple(c for c in cidrs if isinstance(c, str))
    single = spec.get("podCIDR")
    return (single,) if isinstance(single, str) and single else ()


def _labels(obj: Mapping[str, Any] | None) -> tuple[tuple[str, str], ...]:
    meta = obj.get("metadata") if obj is not None else None
    labels = meta.get("labels") if isinstance(meta, JSON_MAP_TYPES) else None
    if not isinstance(labels, JSON_MAP_TYPES):
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in labels.items() if isinstance(v, str)))
