"""healthCheckNodePort servers, with kube-proxy's semantics (pkg/proxy/healthcheck/service_health.go).

A LoadBalancer Service with `externalTrafficPolicy: Local` gets a `spec.healthCheckNodePort`;
cloud load balancers probe it on every node and send traffic only to nodes that answer 200. The
node answers 200 when it has a ready local endpoint for the Service and the proxy is healthy
(`ProxyHealth`), 503 otherwise, always with this body (upstream's template, tabs included):

    {
        "service": {
                "namespace": "ns",
                "name": "svc"
        },
        "localEndpoints": 1,
        "serviceProxyHealthy": true
    }

and the headers `Content-Type: application/json`, `X-Content-Type-Options: nosniff` and
`X-Load-Balancing-Endpoint-Weight: <localEndpoints>`. Any path answers, as upstream's handler
serves the whole port.

The sync loop calls, every sync:

* `sync_services({"ns/name": port})`: the Services that need a health check. Listeners open and
  close as Services come and go or change port; a port that cannot be bound is logged and retried
  at the next call, never fatal (upstream also records an Event; `on_listen_error` is the hook).
* `sync_endpoints({"ns/name": ready local endpoints})`: a Service missing from the map has 0.

Both compare the new map with the previous one in C (dict equality, dict-view set differences),
so at 10,000 Services a call costs under a millisecond when nothing changed and a few when
something did, plus the listeners that actually open or close (measured in
tests/health/test_service_health.py); nothing is reopened unless its port changed.

Listeners bind where kube-proxy binds them: the family's wildcard (0.0.0.0, or :: for the IPv6
server, each taking its own family only) when every node address of the family takes NodePorts,
otherwise each node address that the family's `--nodeport-addresses` CIDRs select
(`health_check_addresses`), in `Config.netns`. All listeners of a family share one `HttpServer`:
one event loop thread, one file descriptor per listener, each connection on its own (so slow
clients of one port delay no other probe), and one hop to the loop per sync however many ports
open or close.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.config import Config, NodeContext, nodeport_addresses_of
from agent.health.proxy import JSON, ProxyHealth
from agent.httpserve import (
    NOSNIFF,
    Address,
    Handler,
    HttpServer,
    Request,
    Response,
    listen_all,
    raise_open_file_limit,
)
from agent.model.types import IPFamily

log = logging.getLogger(__name__)

Listen = Callable[[Sequence[Address], str], list[socket.socket | OSError]]
ListenError = Callable[[str, int, str], None]  # (service "ns/name", port, error text)


def health_check_addresses(
    config: Config, node: NodeContext, family: IPFamily = IPFamily.IPv4
) -> tuple[str, ...]:
    """Where one IP family's healthCheckNodePorts listen (newServiceHealthServer, one per
    family's proxier): every address of the family (its wildcard), or each of `node`'s addresses
    (those of `family`) that the family's `--nodeport-addresses` CIDRs select (loopback first,
    as `lo` is the first interface)."""
    wildcard = "::" if family is IPFamily.IPv6 else "0.0.0.0"
    own = nodeport_addresses_of(config.nodeport_addresses, family.value)
    if own is None:
        return (wildcard,)
    out = node.nodeport_ips(own, loopback=True)
    if not out:
        log.error(
            "no %s node address matches --nodeport-addresses %s: %s healthCheckNodePorts listen on "
            "every %s address instead (as kube-proxy does); check the flag against the node's addresses",
            family,
            ",".join(config.nodeport_addresses),
            family,
            family,
        )
        return (wildcard,)
    return out


def service_response(service: str, local_endpoints: int, proxy_healthy: bool) -> Response:
    """The answer of one Service's healthCheckNodePort."""
    namespace, _, name = service.partition("/")
    body = (
        "{\n"
        '\t"service": {\n'
        f'\t\t"namespace": {_go_quote(namespace)},\n'
        f'\t\t"name": {_go_quote(name)}\n'
        "\t},\n"
        f'\t"localEndpoints": {local_endpoints},\n'
        f'\t"serviceProxyHealthy": {"true" if proxy_healthy else "false"}\n'
        "}"
    )
    status = 200 if local_endpoints != 0 and proxy_healthy else 503
    headers = (("Content-Type", JSON), NOSNIFF, ("X-Load-Balancing-Endpoint-Weight", str(local_endpoints)))
    return Response(status, body.encode(), headers)


def _go_quote(text: str) -> str:
    """Go's %q for the names a Service can have (DNS labels): a double-quoted string."""
    out = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in out) + '"'


@dataclass
class _Open:
    port: int
    sockets: list[socket.socket]
    endpoints: int = 0


class ServiceHealthServer:
    """kube-proxy's ServiceHealthServer. Construction has no side effects; `start` serves."""

    def __init__(
        self,
        health: ProxyHealth,
        addresses: Sequence[str] = ("0.0.0.0",),
        netns: str = "",
        *,
        hostname: str = "",
        listen: Listen = listen_all,
        server: HttpServer | None = None,
        on_listen_error: ListenError | None = None,
    ) -> None:
        self._health = health
        self._addresses = tuple(addresses)
        self._netns = netns
        self._hostname = hostname
        self._listen = listen
        self._server = server or HttpServer("hc-nodeports")
        self._on_listen_error = on_listen_error
        self._lock = threading.Lock()  # guards _open against HTTP workers
        self._open: dict[str, _Open] = {}
        self._wanted: dict[str, int] = {}
        self._failed: dict[str, str] = {}  # service -> last error, retried at every sync_services
        self._endpoints: dict[str, int] = {}
        self._fresh: set[str] = set()  # opened since the last sync_endpoints

    @classmethod
    def for_node(
        cls, config: Config, node: NodeContext, health: ProxyHealth, family: IPFamily = IPFamily.IPv4
    ) -> ServiceHealthServer:
        """The server of one IP family's proxier; `node` holds that family's addresses."""
        return cls(
            health,
            health_check_addresses(config, node, family),
            config.netns,
            hostname=config.hostname,
            server=HttpServer("hc-nodeports" if family is IPFamily.IPv4 else "hc-nodeports6"),
        )

    def start(self) -> None:
        limit = raise_open_file_limit()
        if limit < 4096:
            log.warning(
                "open-file limit is %d: each healthCheckNodePort needs one per node address; "
                "raise the container's nofile limit for clusters with many Local load balancers",
                limit,
            )
        self._server.start()

    def stop(self) -> None:
        with self._lock:
            opened = list(self._open.values())
            self._open.clear()
        self._server.remove_all(sock for entry in opened for sock in entry.sockets)
        self._server.stop()

    # -------------------------------------------------------------------------------- syncing

    def sync_services(self, ports: Mapping[str, int]) -> None:
        """Open a listener for every Service in `ports` ("ns/name" -> healthCheckNodePort), close
        the others; a Service whose port changed is closed and reopened."""
        if ports == self._wanted and not self._failed:
            return  # the common case: one C-level comparison
        new = dict(ports)
        old = self._wanted
        gone = old.items() - new.items()  # removed, or their port changed
        came = new.items() - old.items()
        self._wanted = new
        self._close_all(gone)
        for service, _ in gone:
            self._failed.pop(service, None)
        retry = [(s, new[s]) for s in self._failed if s in new and (s, new[s]) not in came]
        self._failed = {s: e for s, e in self._failed.items() if s in new}
        self._open_all(sorted(came) + retry)

    def sync_endpoints(self, local: Mapping[str, int]) -> None:
        """Ready local endpoints per Service; a Service missing from `local` has none."""
        if local == self._endpoints and not self._fresh:
            return
        new = dict(local)
        changed = new.items() - self._endpoints.items()
        dropped = self._endpoints.keys() - new.keys()
        self._endpoints = new
        with self._lock:
            for service, count in changed:
                entry = self._open.get(service)
                if entry is not None:
                    entry.endpoints = count
            for service in dropped:
                entry = self._open.get(service)
                if entry is not None:
                    entry.endpoints = 0
            # Opened since the last call: upstream starts them at 0 and sets every count again
            # at each SyncEndpoints; here the counts they missed are set now.
            for service in self._fresh:
                entry = self._open.get(service)
                if entry is not None:
                    entry.endpoints = new.get(service, 0)
            self._fresh.clear()

    def open_services(self) -> dict[str, int]:
        """Service -> port of every listener open now."""
        with self._lock:
            return {s: e.port for s, e in self._open.items()}

    def failed_services(self) -> dict[str, str]:
        """Service -> why its port could not be bound (retried at the next sync_services)."""
        return dict(self._failed)

    # -------------------------------------------------------------------------------- details

    def _close_all(self, gone: Iterable[tuple[str, int]]) -> None:
        closing: list[socket.socket] = []
        with self._lock:
            for service, port in gone:
                entry = self._open.get(service)
                if entry is None or entry.port != port:
                    continue
                del self._open[service]
                log.info("closing healthCheckNodePort %d of Service %s", port, service)
                closing += entry.sockets
        self._server.remove_all(closing)

    def _open_all(self, wanted: list[tuple[str, int]]) -> None:
        if not wanted:
            return
        # Each family's wildcard alone (Go's tcp4 / tcp6, kubernetes#137370): the IPv4 and IPv6
        # servers of a dual-stack Service's port both bind it, each answering its own family's count.
        addrs = [Address(host, port, family_only=True) for _, port in wanted for host in self._addresses]
        results = self._listen(addrs, self._netns)
        per = len(self._addresses)
        serve: list[tuple[socket.socket, Handler]] = []
        for i, (service, port) in enumerate(wanted):
            got = results[i * per : (i + 1) * per]
            errors = [r for r in got if isinstance(r, OSError)]
            socks = [r for r in got if isinstance(r, socket.socket)]
            if errors:
                for sock in socks:  # all or nothing, so a retry (or a new owner) finds the port free
                    sock.close()
                self._report_failure(service, port, errors[0])
                continue
            if service in self._failed:
                log.info("healthCheckNodePort %d of Service %s is listening now", port, service)
                del self._failed[service]
            entry = _Open(port, socks)
            with self._lock:
                self._open[service] = entry
                self._fresh.add(service)
            answer = self._handler(service)
            serve += [(sock, answer) for sock in socks]
            log.debug(
                "opened healthCheckNodePort %d of Service %s on %s", port, service, ",".join(self._addresses)
            )
        self._server.add_all(serve)

    def _report_failure(self, service: str, port: int, exc: OSError) -> None:
        text = exc.strerror or str(exc)
        if self._failed.get(service) != text:
            log.error(
                "node %s cannot listen on healthCheckNodePort %d of Service %s: %s; load balancers "
                "will treat this node as down for the Service. Retrying at every sync: free the port "
                "or change the Service's spec.healthCheckNodePort",
                self._hostname or "(this node)",
                port,
                service,
                text,
            )
            if self._on_listen_error is not None:
                self._on_listen_error(service, port, text)
        self._failed[service] = text

    def _handler(self, service: str) -> Handler:
        def answer(_request: Request) -> Response:
            entry = self._open.get(service)
            # Upstream answers an empty 200 for a Service closed while a request was in flight;
            # 503 is the safe answer, so a load balancer never counts a closed port as healthy.
            count = entry.endpoints if entry is not None else 0
            healthy = self._health.is_healthy() if entry is not None else False
            return service_response(service, count, healthy)

        return answer
