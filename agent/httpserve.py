"""The HTTP servers behind /healthz, the healthCheckNodePorts and /metrics.

Design, for a port open to anyone (10256 listens on 0.0.0.0) on a node with 10,000
`externalTrafficPolicy: Local` load balancers:

* Handlers are pure functions `Request -> Response`, so every body, status and header the agent
  serves is tested without a socket; this module only moves bytes.
* aiohttp does the HTTP (its C parser, keep-alive, pipelining, header size limits, lingering
  close). Each `HttpServer` runs one asyncio event loop on its own thread, and every connection is
  a protocol object on that loop, as kube-proxy serves each connection on its own goroutine: no
  pool of workers that slow clients can fill, so no number of them delays an honest probe.
  Ten thousand listening sockets cost ten thousand file descriptors and one thread.
* What a connection may cost is bounded (`Limits`): its request head must be complete within
  `head_timeout_s` of the connection's start or of its previous answer, so a client dripping one
  header line at a time and an idle keep-alive connection are both closed then (aiohttp's
  keep-alive timer, which it also arms at the start of a connection); a client that stops reading
  its answer is cut off after `write_timeout_s`; a request body nobody reads is drained for at
  most `head_timeout_s`; one source address holds at most `per_source` connections to a server
  at a time, further ones are closed as soon as they are accepted.
* Sockets are created by `listen_all`, on a short-lived thread that joined `--netns` when one is
  given (`agent.netns.run_in_netns`): a socket keeps the namespace it was created in, so the lab's
  agents, which run in the host namespace, serve inside their node's namespace. One namespace hop
  binds a whole batch, and one call hands a whole batch to the loop (`add_all`, `remove_all`).
* Answers look like Go's net/http: no `Server` header, a `Date`, a `Content-Length`, and Go's
  `404 page not found` for unknown paths (`not_found`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ipaddress
import logging
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from aiohttp import web

from agent.netns import run_in_netns

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string
    query: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None


Handler = Callable[[Request], Response]

TEXT_PLAIN = "text/plain; charset=utf-8"
NOSNIFF = ("X-Content-Type-Options", "nosniff")


def not_found(_request: Request | None = None) -> Response:
    """Go's http.NotFound, which kube-proxy's muxes answer for paths they do not serve."""
    return Response(404, b"404 page not found\n", (("Content-Type", TEXT_PLAIN), NOSNIFF))


def request_from_target(method: str, target: str, headers: Mapping[str, str] | None = None) -> Request:
    """A Request from a request line's target (`/healthz?verbose`); tests build them this way too."""
    parts = urlsplit(target)
    query = {k: tuple(v) for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    return Request(
        method.upper(), parts.path or "/", query, {k.lower(): v for k, v in (headers or {}).items()}
    )


# ------------------------------------------------------------------------------------- sockets


@dataclass(frozen=True)
class Address:
    """Where to listen. As Go's `net.Listen("tcp", ...)`, which kube-proxy's servers use, the
    wildcards "0.0.0.0" and "::" both listen on every address of both families (one IPv6 socket
    that takes IPv4 too, or IPv4 alone where the kernel has no IPv6). `family_only` is Go's
    "tcp4"/"tcp6": the wildcard of the host's own family only, as upstream binds each IP family's
    healthCheckNodePorts (kubernetes#137370), so the IPv4 and IPv6 servers of one port coexist."""

    host: str  # an IP literal
    port: int
    family_only: bool = False

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str) -> Address:
    """`IP:port` or `[IPv6]:port` into an Address; ValueError says what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not IP:port (e.g. 0.0.0.0:10256)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{text!r}: {host!r} is not an IP address") from None
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: {port!r} is not a port (1-65535; 0 picks a free one)")
    return Address(str(ip), int(port))


# As Go's listeners, which take the kernel's net.core.somaxconn.
BACKLOG = socket.SOMAXCONN


def _listen(addr: Address, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr.host else socket.AF_INET
    host = addr.host
    wildcard = ipaddress.ip_address(host).is_unspecified
    if wildcard and not addr.family_only and family == socket.AF_INET and socket.has_ipv6:
        try:
            return _bind(socket.AF_INET6, "::", addr.port, backlog, v6only=False)
        except OSError as exc:
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
            # No IPv6 in this kernel or namespace: Go falls back to IPv4 alone, so do we.
    return _bind(family, host, addr.port, backlog, v6only=addr.family_only)


def _bind(family: socket.AddressFamily, host: str, port: int, backlog: int, *, v6only: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As Go's listeners: a restarted agent rebinds while old connections sit in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # Explicit either way: the default follows net.ipv6.bindv6only, which nodes may set.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1 if v6only else 0)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_all(
    addrs: Sequence[Address], netns: str = "", backlog: int = BACKLOG
) -> list[socket.socket | OSError]:
    """Listening sockets for `addrs`, created in `netns` ("" = ours); an OSError in place of each
    socket that could not be bound, so one taken port never costs the others."""

    def bind_each() -> list[socket.socket | OSError]:
        out: list[socket.socket | OSError] = []
        for addr in addrs:
            try:
                out.append(_listen(addr, backlog))
            except OSError as exc:
                out.append(exc)
        return out

    if not addrs:
        return []
    try:
        return run_in_netns(netns, bind_each)
    except OSError as exc:  # the namespace itself is missing or cannot be joined
        failed = OSError(exc.errno, f"network namespace {netns}: {exc.strerror or exc}")
        return [failed for _ in addrs]


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit, as the Go runtime does for kube-proxy at
    start: one healthCheckNodePort per Local load balancer can mean thousands of sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


# ------------------------------------------------------------------------------------- serving


@dataclass(frozen=True)
class Limits:
    """What one connection may cost; the defaults serve probes, load balancers and Prometheus."""

    # A complete request head within this long of the connection's start or of its previous
    # answer; a keep-alive connection idle this long is closed. Probes send their head in one
    # segment; a scraper that keeps its connection between scrapes simply opens a new one.
    head_timeout_s: float = 5.0
    # A client whose unread answer has filled the socket buffers for this long is cut off.
    write_timeout_s: float = 5.0
    # Open connections from one source address to one server (every healthCheckNodePort counts
    # towards the same one). High enough for a cloud's health checkers, which probe every node's
    # ports from a handful of addresses (Azure: one, 168.63.129.16), low enough that one address
    # cannot take a meaningful share of the node's file descriptors.
    per_source: int = 128


REFUSAL_LOG_INTERVAL_S = 60.0


def _source(peer: Any) -> str:
    """The address a connection comes from; an IPv4-mapped IPv6 peer counts as its IPv4 address."""
    host = peer[0] if isinstance(peer, tuple) and peer else str(peer)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return str(host)
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


class _Connection(asyncio.Protocol):
    """One accepted connection: admitted under the per-source cap, then handed to aiohttp's
    protocol; aborted when its client stops reading for `write_timeout_s`."""

    def __init__(self, serving: _Serving, handler: Handler) -> None:
        self._serving = serving
        self._handler = handler
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._source = ""
        self._stalled: asyncio.TimerHandle | None = None
        self._first_head: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._source = _source(transport.get_extra_info("peername"))
        if not self._serving.admit(self._source):
            transport.abort()
            return
        self._transport = transport
        self._serving.connections[transport] = self
        # aiohttp's keep-alive timer bounds every head after an answer (and, in recent versions,
        # the first one too); this bounds the first head whatever the version.
        self._first_head = self._serving.loop.call_later(self._serving.limits.head_timeout_s, transport.abort)
        self._inner = self._serving.protocol()
        self._inner.connection_made(transport)

    def head_complete(self) -> Handler:
        """A request head arrived: the first-head deadline is met; the handler to answer it."""
        if self._first_head is not None:
            self._first_head.cancel()
            self._first_head = None
        return self._handler

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        # The client is not reading what we send: give it write_timeout_s to start again.
        if self._transport is not None and self._stalled is None:
            self._stalled = self._serving.loop.call_later(
                self._serving.limits.write_timeout_s, self._transport.abort
            )
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._stalled, self._first_head):
            if timer is not None:
                timer.cancel()
        self._stalled = self._first_head = None
        if self._inner is None:
            return
        self._serving.release(self._source)
        if self._transport is not None:
            self._serving.connections.pop(self._transport, None)
        self._inner.connection_lost(exc)


class _Serving:
    """The loop-side state of a running HttpServer; touched only on its loop thread."""

    def __init__(
        self, name: str, loop: asyncio.AbstractEventLoop, runner: web.AppRunner, limits: Limits
    ) -> None:
        self.name = name
        self.loop = loop
        self.runner = runner
        self.limits = limits
        self.listeners: dict[socket.socket, asyncio.AbstractServer] = {}
        self.connections: dict[asyncio.Transport, _Connection] = {}  # the admitted ones
        self.per_source: dict[str, int] = {}
        self.refused = 0
        self._refused_since_log = 0
        self._last_refusal_log = float("-inf")

    def protocol(self) -> asyncio.Protocol:
        server = self.runner.server
        assert server is not None
        proto: asyncio.Protocol = server()
        return proto

    def admit(self, source: str) -> bool:
        count = self.per_source.get(source, 0)
        if count < self.limits.per_source:
            self.per_source[source] = count + 1
            return True
        self.refused += 1
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._last_refusal_log >= REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "%s: closing new connections from %s: it has %d open already, the limit per source "
                "address (%d closed since this was last logged; logged at most once a minute). A "
                "client that opens so many is misbehaving or hostile: find it, or firewall it",
                self.name,
                source,
                count,
                self._refused_since_log,
            )
            self._last_refusal_log = now
            self._refused_since_log = 0
        return False

    def release(self, source: str) -> None:
        count = self.per_source.get(source, 0) - 1
        if count > 0:
            self.per_source[source] = count
        else:
            self.per_source.pop(source, None)

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        conn = self.connections.get(request.transport) if request.transport is not None else None
        if conn is None:  # the connection closed while its request waited: nobody reads this
            return web.Response(status=503)
        handler = conn.head_complete()
        ours = request_from_target(request.method, request.raw_path, dict(request.headers.items()))
        try:
            response = handler(ours)
        except Exception:
            log.exception("%s: HTTP handler for %s %s failed", self.name, request.method, request.raw_path)
            response = Response(500, b"internal error\n", (("Content-Type", TEXT_PLAIN), NOSNIFF))
        headers = list(response.headers)
        if response.body and response.header("Content-Type") is None:
            headers.append(("Content-Type", TEXT_PLAIN))  # what Go sniffs from the text bodies here
        return web.Response(status=response.status, body=response.body, headers=headers)

    def on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            log.error(
                "%s: cannot accept connections: %s; retrying in 1 s. Raise the agent's open-file "
                "limit (nofile)",
                self.name,
                exc.strerror,
            )
            return
        log.error("%s: %s: %s", self.name, context.get("message", "event loop error"), exc or "")


T = TypeVar("T")


class HttpServer:
    """Serves any number of listening sockets, each with its own handler, from one event loop on
    one thread. Construction has no side effects; `start` runs it and must come before `add`.
    Thread-safe: add, remove and stop may be called from any thread but the loop's own."""

    def __init__(self, name: str, *, limits: Limits | None = None) -> None:
        self.name = name
        self.limits = limits or Limits()
        self._lock = threading.Lock()
        self._serving: _Serving | None = None
        self._thread: threading.Thread | None = None

    # -- listeners

    def add(self, sock: socket.socket, handler: Handler) -> None:
        """Serve `handler` on a listening socket (the server owns and closes it from now on)."""
        self.add_all([(sock, handler)])

    def add_all(self, pairs: Sequence[tuple[socket.socket, Handler]]) -> None:
        """`add` for a batch, in one hop to the loop thread."""
        if not pairs:
            return
        try:
            self._call(self._add_all, pairs)
        except RuntimeError:
            for sock, _ in pairs:
                sock.close()
            raise

    def remove(self, sock: socket.socket) -> None:
        """Stop serving `sock` and close it: its port is free again when this returns.
        Connections it accepted finish on their own (within the limits)."""
        self.remove_all([sock])

    def remove_all(self, socks: Iterable[socket.socket]) -> None:
        socks = list(socks)
        try:
            self._call(self._remove_all, socks)
        except RuntimeError:  # not running: nothing serves them
            for sock in socks:
                sock.close()

    def listening(self) -> int:
        serving = self._serving
        return 0 if serving is None else len(serving.listeners)

    def connections(self) -> int:
        """Connections open now (admitted ones)."""
        serving = self._serving
        return 0 if serving is None else sum(serving.per_source.values())

    def refused(self) -> int:
        """Connections closed on arrival so far because their source had `per_source` open."""
        serving = self._serving
        return 0 if serving is None else serving.refused

    # -- lifecycle

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            loop = asyncio.new_event_loop()
            ready: Future[_Serving] = Future()
            thread = threading.Thread(
                target=self._run, args=(loop, ready), name=f"{self.name}-http", daemon=True
            )
            thread.start()
            self._serving = ready.result(timeout=30)
            self._thread = thread

    def stop(self) -> None:
        """Close every listening socket and every connection, then end the loop thread."""
        with self._lock:
            serving, thread = self._serving, self._thread
            self._serving = self._thread = None
        if serving is None or thread is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(serving), serving.loop).result(timeout=10)
        serving.loop.call_soon_threadsafe(serving.loop.stop)
        thread.join(timeout=10)

    # -- on the loop thread

    def _run(self, loop: asyncio.AbstractEventLoop, ready: Future[_Serving]) -> None:
        asyncio.set_event_loop(loop)
        try:
            serving = loop.run_until_complete(self._setup(loop))
        except BaseException as exc:
            ready.set_exception(exc)
            loop.close()
            return
        ready.set_result(serving)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _setup(self, loop: asyncio.AbstractEventLoop) -> _Serving:
        limits = self.limits
        serving: _Serving | None = None

        @web.middleware
        async def answer(request: web.Request, handler: Any) -> web.StreamResponse:
            # Every path goes to the listener's own handler; aiohttp's router (and its 404) is
            # never used.
            assert serving is not None
            return await serving.dispatch(request)

        async def go_headers(_request: web.Request, response: web.StreamResponse) -> None:
            response.headers.popall("Server", None)  # Go's net/http sends none

        app = web.Application(middlewares=[answer])
        app.on_response_prepare.append(go_headers)
        runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=limits.head_timeout_s,
            lingering_time=limits.head_timeout_s,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        serving = _Serving(self.name, loop, runner, limits)
        loop.set_exception_handler(serving.on_loop_error)
        return serving

    async def _add_all(self, serving: _Serving, pairs: Sequence[tuple[socket.socket, Handler]]) -> None:
        for i, (sock, handler) in enumerate(pairs):
            try:
                server = await serving.loop.create_server(
                    functools.partial(_Connection, serving, handler), sock=sock, backlog=BACKLOG
                )
            except BaseException:
                for later, _ in pairs[i:]:
                    later.close()
                raise
            serving.listeners[sock] = server

    async def _remove_all(self, serving: _Serving, socks: Sequence[socket.socket]) -> None:
        for sock in socks:
            server = serving.listeners.pop(sock, None)
            if server is not None:
                server.close()  # closes the listening socket now; accepted connections live on
            else:
                sock.close()

    async def _shutdown(self, serving: _Serving) -> None:
        for server in serving.listeners.values():
            server.close()
        serving.listeners.clear()
        await serving.runner.cleanup()
        for transport in list(serving.connections):
            transport.abort()

    def _call(self, fn: Callable[[_Serving, T], Any], arg: T) -> None:
        serving = self._serving
        if serving is None:
            raise RuntimeError(f"{self.name}: add() before start() or after stop()")
        asyncio.run_coroutine_threadsafe(fn(serving, arg), serving.loop).result(timeout=60)


class AddressServer:
    """One handler on one configured address (`--healthz-bind-address`, `--metrics-bind-address`),
    as kube-proxy's serveHealthz / serveMetrics: "" disables it; a bind failure is logged and
    retried every `retry_s` (upstream: `wait.Until(fn, 5*time.Second, ...)`), or raised when
    `hard_fail` (`--bind-address-hard-fail`), so the caller can stop the agent."""

    def __init__(
        self,
        name: str,
        address: str,
        handler: Handler,
        *,
        netns: str = "",
        hard_fail: bool = False,
        retry_s: float = 5.0,
        listen: Callable[[Sequence[Address], str], list[socket.socket | OSError]] = listen_all,
        server: HttpServer | None = None,
    ) -> None:
        self.name = name
        self.address = address
        self._handler = handler
        self._netns = netns
        self._hard_fail = hard_fail
        self._retry_s = retry_s
        self._listen = listen
        self._server = server or HttpServer(name)
        self._stop = threading.Event()
        self._retry: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def bound(self) -> tuple[str, int] | None:
        """The address actually listening (port 0 in tests resolves here), or None."""
        sock = self._sock
        return None if sock is None else sock.getsockname()[:2]

    def start(self) -> None:
        """Bind and serve; OSError (only with hard_fail) when the address cannot be bound."""
        if not self.address:
            log.info("%s server disabled (empty bind address)", self.name)
            return
        addr = parse_address(self.address)
        self._server.start()
        error = self._try_bind(addr)
        if error is None:
            return
        if self._hard_fail:
            self._server.stop()
            raise error
        self._log_failure(addr, error)
        self._retry = threading.Thread(
            target=self._retry_loop, args=(addr,), name=f"{self.name}-bind", daemon=True
        )
        self._retry.start()

    def stop(self) -> None:
        self._stop.set()
        if self._retry is not None:
            self._retry.join(timeout=self._retry_s + 1)
        self._server.stop()
        self._sock = None

    def _try_bind(self, addr: Address) -> OSError | None:
        (result,) = self._listen([addr], self._netns)
        if isinstance(result, OSError):
            return result
        try:
            self._server.add(result, self._handler)
        except RuntimeError:  # stop() won the race with a retry
            return None
        self._sock = result
        log.info(
            "%s server listening on %s%s", self.name, addr, f" in netns {self._netns}" if self._netns else ""
        )
        return None

    def _retry_loop(self, addr: Address) -> None:
        while not self._stop.wait(self._retry_s):
            if self._try_bind(addr) is None:
                return

    def _log_failure(self, addr: Address, exc: OSError) -> None:
        log.error(
            "%s server cannot listen on %s%s: %s; retrying every %.0f s. Free the port or change "
            "the bind address (--bind-address-hard-fail makes this fatal)",
            self.name,
            addr,
            f" in netns {self._netns}" if self._netns else "",
            exc.strerror or exc,
            self._retry_s,
        )
