"""The proxy's own health, with kube-proxy's semantics (pkg/proxy/healthcheck/proxy_health.go).

State, fed by the sync loop:

* `updated()` when a sync completed (kube-proxy's `Updated`), and once when the sync loop starts,
  as kube-proxy's `SyncLoop` does, so a first sync that never finishes is noticed;
* `queued_update()` when a Service or EndpointSlice change is queued (`QueuedUpdate`); only the
  oldest pending change counts, until the next `updated()`;
* `sync_node(node)` with this node's Node object as the API gives it (`NodeEligible`).

The proxy is healthy unless a change has been pending for the health timeout or longer, which
kube-proxy derives as twice the sync period (cmd/kube-proxy/app/server.go:
`NewProxyHealthServer(addr, 2*config.SyncPeriod.Duration, ...)`). Before the first `updated()` it
is healthy: starting up is not a failure. The node is eligible unless its Node object has a
deletion timestamp or the cluster autoscaler's `ToBeDeletedByClusterAutoscaler` taint, or the
Node object is gone (`sync_node(None)`); until the first `sync_node` it is eligible, so a source
without Node objects (the YAML file) never fails /healthz for that reason.

`/healthz` = healthy and eligible, `/livez` = healthy; both answer 200 or 503 with the JSON of
kube-proxy's `ProxyHealth` struct (`json.Marshal`: `lastUpdated`, `currentTime`, `nodeEligible`
on /healthz only, `healthy`, `status` per IP family), `Content-Type: application/json` and
`X-Content-Type-Options: nosniff`. As upstream, a healthy answer reports `lastUpdated` as the
current time ("the returned lastUpdated value is recent if the server is healthy").

Per IP family, as upstream's ProxyHealthServer since the metaproxier shares it between the two
proxiers: `lastUpdated` and the oldest pending change are kept per family ("IPv4", "IPv6"), each
family's proxier feeding its own; the proxy is healthy only when every family that has synced
is, and `status` has one entry per such family. The agent tracks IPv6 when it runs an IPv6
proxier (IPv6 configured, in either mode: in eBPF mode the IPv6 proxier is ip6tables).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.clock import Clock, SystemClock
from agent.goformat import format_time
from agent.httpserve import NOSNIFF, Request, Response, not_found
from agent.sources.base import JSON_MAP_TYPES

IPV4 = "IPv4"
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
JSON = "application/json"


def health_timeout_s(sync_period_s: float) -> float:
    """kube-proxy's health timeout: twice the sync period."""
    return 2 * sync_period_s


def node_eligible(node: Mapping[str, Any] | None) -> bool:
    """kube-proxy's NodeEligible: the Node exists, is not being deleted, is not tainted for
    deletion by the cluster autoscaler."""
    if node is None:
        return False
    meta = node.get("metadata")
    if isinstance(meta, JSON_MAP_TYPES) and meta.get("deletionTimestamp"):
        return False
    spec = node.get("spec")
    taints = spec.get("taints") if isinstance(spec, JSON_MAP_TYPES) else None
    if isinstance(taints, list):
        for taint in taints:
            if isinstance(taint, JSON_MAP_TYPES) and taint.get("key") == TO_BE_DELETED_TAINT:
                return False
    return True


@dataclass(frozen=True)
class HealthStatus:
    """kube-proxy's ProxyHealth: one reading of the state."""

    healthy: bool
    last_updated_ns: int  # wall time of the last updated(); 0 = never (Go's zero time)
    current_ns: int
    families: tuple[tuple[str, bool, int], ...]  # (family, healthy, last updated ns), sorted


class ProxyHealth:
    """Thread-safe: the sync loop writes, HTTP workers read."""

    def __init__(self, timeout_s: float, clock: Clock | None = None) -> None:
        self.timeout_s = timeout_s
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._last_updated: dict[str, tuple[int, float]] = {}  # family -> (wall ns, monotonic)
        self._oldest_queued: dict[str, float] = {}  # family -> monotonic
        self._node_eligible = True

    def updated(self, family: str = IPV4) -> None:
        with self._lock:
            self._oldest_queued.pop(family, None)
            self._last_updated[family] = (self._clock.wall_ns(), self._clock.monotonic())

    def queued_update(self, family: str = IPV4) -> None:
        with self._lock:
            self._oldest_queued.setdefault(family, self._clock.monotonic())

    def sync_node(self, node: Mapping[str, Any] | None) -> None:
        """This node's Node object as last seen (None: it no longer exists)."""
        eligible = node_eligible(node)
        with self._lock:
            self._node_eligible = eligible

    @property
    def node_eligible(self) -> bool:
        with self._lock:
            return self._node_eligible

    def status(self) -> HealthStatus:
        with self._lock:
            now_mono = self._clock.monotonic()
            now_ns = self._clock.wall_ns()
            families = []
            healthy = True
            for family, (wall_ns, _mono) in sorted(self._last_updated.items()):
                queued = self._oldest_queued.get(family)
                ok = queued is None or now_mono - queued < self.timeout_s
                healthy = healthy and ok
                families.append((family, ok, wall_ns))
            last = max((w for _, _, w in families), default=0)
            return HealthStatus(healthy, last, now_ns, tuple(families))

    def is_healthy(self) -> bool:
        return self.status().healthy


def _body(status: HealthStatus, node_eligible: bool | None, ok: bool) -> bytes:
    # Field order and spelling of kube-proxy's ProxyHealth struct tags; Go's json.Marshal writes
    # no spaces and sorts map keys (the per-family `status`). `healthy` is the proxy's own health;
    # `lastUpdated` is "now" whenever the answer is 200, as upstream.
    last = status.current_ns if ok else status.last_updated_ns
    doc: dict[str, Any] = {"lastUpdated": format_time(last), "currentTime": format_time(status.current_ns)}
    if node_eligible is not None:
        doc["nodeEligible"] = node_eligible
    doc["healthy"] = status.healthy
    if status.families:
        doc["status"] = {
            family: {"lastUpdated": format_time(wall_ns), "healthy": ok}
            for family, ok, wall_ns in status.families
        }
    return json.dumps(doc, separators=(",", ":")).encode()


CodeCounter = Callable[[str, int], None]  # (endpoint "healthz" | "livez", HTTP status)


class ProxyHealthHandlers:
    """The /healthz and /livez handlers of the healthz port (10256); anything else is a 404."""

    def __init__(self, health: ProxyHealth, count: CodeCounter | None = None) -> None:
        self._health = health
        self._count = count

    def healthz(self, _request: Request | None = None) -> Response:
        status = self._health.status()
        eligible = self._health.node_eligible
        return self._answer("healthz", status, status.healthy and eligible, eligible)

    def livez(self, _request: Request | None = None) -> Response:
        status = self._health.status()
        return self._answer("livez", status, status.healthy, None)

    def __call__(self, request: Request) -> Response:
        if request.path == "/healthz":
            return self.healthz(request)
        if request.path == "/livez":
            return self.livez(request)
        return not_found(request)

    def _answer(self, what: str, status: HealthStatus, ok: bool, eligible: bool | None) -> Response:
        code = 200 if ok else 503
        if self._count is not None:
            self._count(what, code)
        return Response(code, _body(status, eligible, ok), (("Content-Type", JSON), NOSNIFF))
