"""Kubernetes Events about malformed objects, so `kubectl describe service X` says why it is skipped.

kube-proxy records through events.k8s.io/v1 (`events.NewBroadcaster(&events.EventSinkImpl{
Interface: client.EventsV1()})`), and so does `EventRecorder`. A Warning Event per problem:

* `regarding` the object (kind, apiVersion, namespace, name, uid when known); `reason`
  `InvalidService` / `InvalidEndpointSlice` / `InvalidNode`, or for a refused frontend the
  refusal (`RefusedExternalIP`, `RefusedNodePort`, agent/model/guard.py); `note` the Problem's
  reason; `action` `SkipObject` (`RefuseFrontend` for a refusal); `reportingController`
  `ebpf-kube-proxy`; `reportingInstance` `ebpf-kube-proxy-<node>` (client-go: controller + "-" +
  hostname). The Event lives in the object's namespace (`default` for a Node) and is named
  `<object>.<hex nanoseconds>` as client-go names it. `deprecatedSource` stays unset:
  events.k8s.io/v1 rejects it.
* Deduplicated as client-go's events broadcaster does: the same object, reason and note again
  within `series_ttl_s` (client-go's finishTime, 6 min) does not make a new Event; it grows the
  first one's `series` (count, lastObservedTime). The first repeat is PATCHed at once (as
  client-go), later ones at most every `series_flush_s` (client-go waits 30 min; an operator
  reading `kubectl get events` wants the count sooner). A PATCH answered 404 (the Event expired
  server-side) creates it again with its series. We add the note to the dedup key (client-go
  does not): two different problems of one object are two Events.
* Rate-limited: one token bucket (burst 25, one token per 5 s) for every write; a new Event that
  finds it empty is dropped and counted (`ekp_kube_events_total{outcome="rate_limited"}`), a
  series update waits for the next flush. client-go's legacy recorder uses the same burst per
  object; one bucket for all objects protects the API server from a node with thousands of
  malformed objects, and the log and `ekp_invalid_objects` still name every one of them.
* `warn` never waits on the network: it enqueues (bounded queue; overflow dropped and counted)
  for a background thread, so a sync never blocks on the API server. Writes that fail with a
  transport error, 429 or 5xx are retried a few times with backoff; other refusals are dropped.
  Failures are logged once per episode.

Requests go through the real client's ApiClient (authentication, TLS, connection pool) but not
through the generated `create_namespaced_event` wrapper: that one coerces the body into its
V1Event model and re-serialises `eventTime` with Python's isoformat, which drops the fraction
when the microseconds are zero, and kube-apiserver's MicroTime parser then rejects the Event.

Runs without an API server (the file source) record nothing: `agent.daemon.NoEvents`.
This module imports the kubernetes client only when an `EventRecorder` starts.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from agent.kube.backoff import Episode
from agent.kube.tokenbucket import TokenBucket
from agent.metrics.source import SourceMetrics
from agent.model.problem import Problem, printable

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

CONTROLLER = "ebpf-kube-proxy"
ACTION = "SkipObject"
REFUSE_ACTION = "RefuseFrontend"
API_VERSIONS = {"Service": "v1", "EndpointSlice": "discovery.k8s.io/v1", "Node": "v1"}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_EVENTS_PATH = "/apis/events.k8s.io/v1/namespaces/{namespace}/events"


@dataclass(frozen=True)
class EventSettings:
    burst: int = 25
    per_s: float = 0.2  # sustained: one write every 5 s
    queue_max: int = 1000
    series_flush_s: float = 30.0
    series_ttl_s: float = 360.0  # client-go's finishTime
    max_tries: int = 3
    retry_s: float = 2.0  # first retry delay, doubled per try
    request_timeout_s: float = 10.0


def micro_time(t: datetime) -> str:
    """metav1.MicroTime's JSON form: RFC 3339 with exactly six fraction digits, UTC."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_body(problem: Problem, uid: str | None, node: str, at: datetime) -> dict[str, Any]:
    """The events.k8s.io/v1 Event for one problem (see the module docstring for each field)."""
    cluster_scoped = problem.kind == "Node"
    regarding: dict[str, Any] = {
        "kind": problem.kind,
        "apiVersion": API_VERSIONS.get(problem.kind, "v1"),
        "name": problem.name,
    }
    if not cluster_scoped:
        regarding["namespace"] = problem.namespace
    if uid:
        regarding["uid"] = uid
    namespace = "default" if cluster_scoped or not _DNS_LABEL.match(problem.namespace) else problem.namespace
    base = problem.name if len(problem.name) <= 200 and _DNS_SUBDOMAIN.match(problem.name) else CONTROLLER
    nanos = int(at.timestamp() * 1e9)
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"{base}.{nanos:x}", "namespace": namespace},
        "eventTime": micro_time(at),
        "reportingController": CONTROLLER,
        "reportingInstance": f"{CONTROLLER}-{node}"[:128],
        "action": REFUSE_ACTION if problem.refusal else ACTION,
        "reason": (problem.refusal or f"Invalid{problem.kind}")[:128],
        "regarding": regarding,
        "note": printable(f"{problem.reason} (node {node} leaves it out of its proxy rules)", 1000),
        "type": "Warning",
    }


@dataclass
class _Series:
    key: tuple[str, ...]
    body: dict[str, Any]
    last_seen: float
    last_observed: str
    count: int = 1
    sent: int = 0  # count the API server has (0: not created yet)
    failed: bool = False

    @property
    def namespace(self) -> str:
        return str(self.body["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])


@dataclass
class Counters:
    """What this recorder did (the metric is process-wide; tests read these)."""

    created: int = 0
    series_updated: int = 0
    dropped: int = 0
    failed: int = 0


class EventRecorder:
    """Posts Warning Events from a background thread; see the module docstring. The daemon calls it as
    its `EventSink` (`warn`) and starts and stops it as one of its `Service`s."""

    def __init__(
        self,
        api: ApiClient,
        node_name: str,
        settings: EventSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        metrics: SourceMetrics | None = None,
    ) -> None:
        self._api = api
        self._metrics = metrics
        self._node = node_name
        self._settings = settings or EventSettings()
        self._clock = clock
        self._wall = wall
        self._bucket = TokenBucket(self._settings.per_s, self._settings.burst, clock)
        self._queue: queue.Queue[_Series | None] = queue.Queue(self._settings.queue_max)
        self._series: dict[tuple[str, ...], _Series] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._episode = Episode(clock)
        self._logged_rate_limit = False
        self.counters = Counters()

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.kube_events.labels(outcome).inc()

    # ---- the caller's side -------------------------------------------------------------------

    def warn(self, problem: Problem, uid: str | None = None) -> None:
        """Record a Warning about `problem`'s object; never blocks, never raises."""
        try:
            self._warn(problem, uid)
        except Exception:  # an Event is a courtesy: it must never fail the sync that reports it
            log.exception("event recorder: cannot record %s", problem.ref)

    def _warn(self, problem: Problem, uid: str | None) -> None:
        note_key = problem.reason
        key = (problem.kind, problem.namespace, problem.name, uid or "", note_key)
        now = self._clock()
        observed = micro_time(self._wall())
        with self._lock:
            series = self._series.get(key)
            if (
                series is not None
                and not series.failed
                and now - series.last_seen <= self._settings.series_ttl_s
            ):
                series.count += 1
                series.last_seen, series.last_observed = now, observed
                if series.count == 2 and series.sent:
                    self._wake()  # a series starts: client-go patches it at once
                return
            if not self._bucket.take():
                self._drop("rate_limited", problem)
                return
            body = event_body(problem, uid, self._node, self._wall())
            series = _Series(key, body, now, observed)
            try:
                self._queue.put_nowait(series)
            except queue.Full:
                self._drop("queue_full", problem)
                return
            self._series[key] = series

    def _drop(self, outcome: str, problem: Problem) -> None:
        self._count(outcome)
        self.counters.dropped += 1
        if not self._logged_rate_limit:
            self._logged_rate_limit = True
            log.warning(
                "not posting the Event about %s (%s): too many Events in a short time; further "
                "drops are only counted in ekp_kube_events_total{outcome=%r} (every problem is "
                "still logged and counted in ekp_invalid_objects)",
                problem.ref,
                outcome,
                outcome,
            )

    def _wake(self) -> None:
        # A full queue means the thread is busy anyway; it flushes series when it gets there.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="event-recorder", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    # ---- the background thread ---------------------------------------------------------------

    def _run(self) -> None:
        next_flush = self._clock() + self._settings.series_flush_s
        while not self._stopping.is_set():
            try:
                item = self._queue.get(timeout=max(0.01, next_flush - self._clock()))
            except queue.Empty:
                item = None
            if self._stopping.is_set():
                break
            try:
                if item is not None:
                    self._create(item)
                flush = self._clock() >= next_flush
                self._update_series(flush)
                if flush:
                    self._expire()
                    next_flush = self._clock() + self._settings.series_flush_s
            except Exception:
                log.exception("event recorder: unexpected error (the recorder keeps running)")

    def _create(self, series: _Series, with_series: bool = False) -> None:
        with self._lock:
            body = dict(series.body)
            count = series.count
            if with_series:
                body["series"] = {"count": count, "lastObservedTime": series.last_observed}
        path = _EVENTS_PATH.replace("{namespace}", series.namespace)
        if self._write("POST", path, body, series):
            with self._lock:
                series.sent = count if with_series else 1
            self._count("created")
            self.counters.created += 1
            self._logged_rate_limit = False  # a later burst of drops is a new episode

    def _update_series(self, flush: bool) -> None:
        with self._lock:
            due = [
                s
                for s in self._series.values()
                if s.sent and not s.failed and s.count > s.sent and (flush or s.sent == 1)
            ]
        for series in due:
            if self._stopping.is_set():
                return
            if not self._bucket.take():
                return  # stays due; the next flush tries again
            with self._lock:
                count, observed = series.count, series.last_observed
            patch = {"series": {"count": count, "lastObservedTime": observed}}
            path = _EVENTS_PATH.replace("{namespace}", series.namespace) + "/" + series.name
            try:
                ok = self._write("PATCH", path, patch, series, missing_ok=True)
            except _Missing:
                self._create(series, with_series=True)
                continue
            if ok:
                with self._lock:
                    series.sent = max(series.sent, count)
                self._count("series_updated")
                self.counters.series_updated += 1

    def _expire(self) -> None:
        now = self._clock()
        with self._lock:
            for key in [
                k
                for k, s in self._series.items()
                if (s.failed or now - s.last_seen > self._settings.series_ttl_s)
                and (s.count <= s.sent or s.failed)
            ]:
                del self._series[key]

    # ---- one write, with retries -------------------------------------------------------------

    def _write(
        self, method: str, path: str, body: dict[str, Any], series: _Series, missing_ok: bool = False
    ) -> bool:
        """POST or PATCH with retries; True on success. Raises _Missing for a PATCH answered 404."""
        from kubernetes.client.exceptions import ApiException

        s = self._settings
        delay = s.retry_s
        regarding = series.body["regarding"]
        what = (
            f"Event {series.namespace}/{series.name} about {regarding['kind']} {printable(regarding['name'])}"
        )
        for attempt in range(1, s.max_tries + 1):
            try:
                status = self._request(method, path, body)
            except ApiException as exc:
                status = exc.status or 0
                text = f"{status} {printable(exc.reason or '', 100)}"
            except Exception as exc:  # transport: urllib3/OSError; keep the thread alive regardless
                status, text = 0, f"{type(exc).__name__}: {printable(str(exc), 200)}"
            else:
                ended = self._episode.recover()
                if ended is not None:
                    log.info("posting Events works again after %d failure(s) over %.0f s", *ended)
                return True
            if status == 404 and missing_ok:
                raise _Missing
            retriable = status == 0 or status == 429 or status >= 500
            if not retriable or attempt == s.max_tries:
                with self._lock:
                    # A refused write is final; an Event the server never got cannot grow a
                    # series. An unreachable server only delays a series update to the next flush.
                    series.failed = series.failed or not retriable or series.sent == 0
                self._count("failed")
                self.counters.failed += 1
                if self._episode.fail():
                    log.warning(
                        "cannot post %s: %s (%s); further failures are counted in "
                        'ekp_kube_events_total{outcome="failed"} and logged again when posting works',
                        what,
                        text,
                        f"gave up after {attempt} tries" if retriable else "not retried",
                    )
                return False
            if self._stopping.wait(delay):
                return False
            delay *= 2
        return False

    def _request(self, method: str, path: str, body: dict[str, Any]) -> int:
        from kubernetes.client.exceptions import ApiException

        content_type = "application/strategic-merge-patch+json" if method == "PATCH" else "application/json"
        serialized = self._api.param_serialize(
            method=method,
            resource_path=path,
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        resp: Any = self._api.call_api(*serialized, _request_timeout=self._settings.request_timeout_s)
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException(http_resp=resp)
        return int(resp.status)


class _Missing(Exception):
    """A series PATCH found no Event (404): create it again."""
