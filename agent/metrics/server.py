"""The metrics port (`--metrics-bind-address`, default 127.0.0.1:10249), as kube-proxy's serveMetrics.

kube-proxy's mux there (cmd/kube-proxy/app/server.go) serves, and so does this one:

* `/metrics`: the registry in Go's text format (`agent.metrics.exposition`), gzip when asked;
* `/proxyMode`: the mode as plain text (`iptables`; here also `ebpf`), which tools such as
  kubeadm's upgrade checks and Cilium's kube-proxy detection read;
* `/healthz` and `/healthz/ping`: k8s.io/apiserver's healthz with its one default `ping` check
  (`ok`; `?verbose` lists the checks; `?exclude=ping`), not the proxy's health, which lives on the
  healthz port;
* `/metrics/slis`: the healthz check SLIs (`kubernetes_healthcheck`,
  `kubernetes_healthchecks_total`); a DELETE resets them, as `SLIMetricsWithReset`;
* `/configz`: `{"kubeproxy.config.k8s.io": <the effective configuration>}` as JSON.

Not served, because they do not apply: `/debug/pprof` (`enableProfiling`, a Go profiler),
`/flagz` and `/statusz` (alpha feature gates, off by default upstream).
"""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.config import Config
from agent.httpserve import NOSNIFF, TEXT_PLAIN, AddressServer, Request, Response, not_found
from agent.metrics import exposition

CONFIGZ_GROUP = "kubeproxy.config.k8s.io"
JSON = "application/json"


class HealthzSlis:
    """k8s.io/component-base/metrics/prometheus/slis for the one `ping` check."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._gauge = Gauge(
            "kubernetes_healthcheck",
            "[STABLE] This metric records the result of a single healthcheck.",
            ["name", "type"],
            registry=self.registry,
        )
        self._total = Counter(
            "kubernetes_healthchecks",
            "[STABLE] This metric records the results of all healthcheck.",
            ["name", "status", "type"],
            registry=self.registry,
        )
        self._lock = threading.Lock()

    def observe_success(self, check: str, kind: str) -> None:
        with self._lock:
            self._gauge.labels(check, kind).set(1)
            self._total.labels(check, "success", kind).inc()

    def reset(self) -> None:
        with self._lock:
            self._gauge.clear()
            self._total.clear()


class MetricsHandlers:
    """The mux of the metrics port; every answer is built here, without a socket."""

    def __init__(
        self,
        registry: CollectorRegistry,
        mode: str,
        configz: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self._registry = registry
        self._mode = mode
        self._configz = configz
        self.slis = HealthzSlis()

    def __call__(self, request: Request) -> Response:
        route = {
            "/metrics": self.metrics,
            "/proxyMode": self.proxy_mode,
            "/healthz": self.healthz,
            "/healthz/ping": self.ping,
            "/metrics/slis": self.metrics_slis,
            "/configz": self.configz,
        }.get(request.path)
        return route(request) if route is not None else not_found(request)

    def metrics(self, request: Request) -> Response:
        return _exposition(exposition.render(self._registry), request)

    def metrics_slis(self, request: Request) -> Response:
        if request.method == "DELETE":
            self.slis.reset()
            return Response(200, b"metrics reset\n", (("Content-Type", TEXT_PLAIN),))
        return _exposition(exposition.render(self.slis.registry), request)

    def proxy_mode(self, _request: Request) -> Response:
        return Response(200, self._mode.encode(), (("Content-Type", TEXT_PLAIN), NOSNIFF))

    def healthz(self, request: Request) -> Response:
        excluded = set(request.query.get("exclude", ()))
        if "ping" in excluded:
            lines = "[+]ping excluded: ok\n"
        else:
            self.slis.observe_success("ping", "healthz")
            lines = "[+]ping ok\n"
        unknown = sorted(excluded - {"ping"})
        if unknown:
            quoted = ",".join(f'"{name}"' for name in unknown)
            lines += f"warn: some health checks cannot be excluded: no matches for {quoted}\n"
        body = lines + "healthz check passed\n" if "verbose" in request.query else "ok"
        return Response(200, body.encode(), (("Content-Type", TEXT_PLAIN), NOSNIFF))

    def ping(self, _request: Request) -> Response:
        # Upstream writes "ok" without a Content-Type; Go's server sniffs it as plain text.
        return Response(200, b"ok", (("Content-Type", TEXT_PLAIN),))

    def configz(self, _request: Request) -> Response:
        if self._configz is None:
            return not_found()
        body = json.dumps({CONFIGZ_GROUP: self._configz()}, separators=(",", ":")).encode()
        return Response(200, body, (("Content-Type", JSON), NOSNIFF))


def _exposition(text: bytes, request: Request) -> Response:
    headers: tuple[tuple[str, str], ...] = (("Content-Type", exposition.CONTENT_TYPE),)
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(200, gzip.compress(text, 6), (*headers, ("Content-Encoding", "gzip")))
    return Response(200, text, headers)


def metrics_server(
    config: Config,
    registry: CollectorRegistry,
    configz: Callable[[], Mapping[str, Any]] | None = None,
) -> AddressServer:
    """The metrics port for `config`, bound in `Config.netns`."""
    return AddressServer(
        "metrics",
        config.metrics_bind_address,
        MetricsHandlers(registry, config.mode.value, configz),
        netns=config.netns,
        hard_fail=config.bind_address_hard_fail,
    )
