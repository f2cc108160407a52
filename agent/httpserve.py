"""The small HTTP server behind /healthz, the healthCheckNodePorts and /metrics.

Design, for a node with 10,000 `externalTrafficPolicy: Local` load balancers:

* Handlers are pure functions `Request -> Response`, so every body, status and header the agent
  serves is tested without a socket; this module only moves bytes.
* One acceptor thread watches every listening socket of a server with epoll (one socket per
  healthCheckNodePort and node address), and a small bounded pool of workers answers the accepted
  connections (HTTP/1.1, keep-alive until idle). Ten thousand ports cost ten thousand file
  descriptors, not ten thousand threads; a flood of connections queues up to a limit and is then
  refused, never grows without bound.
* Sockets are created by `listen_all`, on a short-lived thread that joined `--netns` when one is
  given (`agent.netns.run_in_netns`): a socket keeps the namespace it was created in, so the lab's
  agents, which run in the host namespace, serve inside their node's namespace. One namespace hop
  binds a whole batch.
* Answers look like Go's net/http: no `Server` header, a `Date`, a `Content-Length`, and Go's
  `404 page not found` for unknown paths (`not_found`).
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import ipaddress
import logging
import resource
import selectors
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

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
    host: str  # an IP literal; "0.0.0.0" and "::" listen everywhere
    port: int

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


def _listen(addr: Address, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As Go's listeners: a restarted agent rebinds while old connections sit in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and ipaddress.ip_address(addr.host).is_unspecified:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "[::]" takes IPv4 too
        sock.bind((addr.host, addr.port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_all(
    addrs: Sequence[Address], netns: str = "", backlog: int = 128
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


class _Connection(BaseHTTPRequestHandler):
    """http.server's request parsing, with our handler and Go's answer format."""

    protocol_version = "HTTP/1.1"
    server: Any  # the _Bridge below

    def _serve(self) -> None:
        request = request_from_target(self.command, self.path, dict(self.headers.items()))
        try:
            response = self.server.handler(request)
        except Exception:
            log.exception("HTTP handler for %s %s failed", self.command, self.path)
            response = Response(500, b"internal error\n", (("Content-Type", TEXT_PLAIN), NOSNIFF))
        self.send_response_only(response.status)
        for key, value in response.headers:
            self.send_header(key, value)
        self.send_header("Date", email.utils.formatdate(usegmt=True))
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    # Go's handlers answer any method; so do ours.
    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _serve

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s: " + format, self.client_address[0], *args)


@dataclass
class _Bridge:
    """What BaseHTTPRequestHandler expects of `server`."""

    handler: Handler


@dataclass
class _Running:
    """What exists only between start() and stop()."""

    selector: selectors.BaseSelector
    wake_r: socket.socket
    wake_w: socket.socket
    pool: ThreadPoolExecutor
    thread: threading.Thread


class HttpServer:
    """Serves any number of listening sockets, each with its own handler, from one acceptor
    thread and `workers` worker threads. Construction has no side effects; `start` runs it and
    must come before `add`."""

    def __init__(
        self,
        name: str,
        *,
        workers: int = 8,
        idle_timeout_s: float = 10.0,
        max_queued: int = 1024,
    ) -> None:
        self.name = name
        self._workers = workers
        self._idle_timeout_s = idle_timeout_s
        self._max_queued = max_queued
        self._lock = threading.Lock()
        self._handlers: dict[int, tuple[socket.socket, Handler]] = {}
        self._queued = 0
        self._run: _Running | None = None
        self._stopping = threading.Event()

    # -- listeners

    def add(self, sock: socket.socket, handler: Handler) -> None:
        """Serve `handler` on a listening socket (the server owns and closes it from now on)."""
        run = self._run
        if run is None:
            sock.close()
            raise RuntimeError(f"{self.name}: add() before start() or after stop()")
        sock.setblocking(False)
        with self._lock:
            self._handlers[sock.fileno()] = (sock, handler)
            run.selector.register(sock, selectors.EVENT_READ, handler)

    def remove(self, sock: socket.socket) -> None:
        """Stop serving `sock` and close it: its port is free again when this returns."""
        with self._lock:
            fd = sock.fileno()
            if fd >= 0 and self._handlers.get(fd, (None,))[0] is sock:
                del self._handlers[fd]
                if self._run is not None:
                    with contextlib.suppress(KeyError, ValueError):
                        self._run.selector.unregister(sock)
        sock.close()

    def listening(self) -> int:
        with self._lock:
            return len(self._handlers)

    # -- lifecycle

    def start(self) -> None:
        if self._run is not None:
            return
        selector = selectors.DefaultSelector()
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        selector.register(wake_r, selectors.EVENT_READ, None)
        pool = ThreadPoolExecutor(self._workers, thread_name_prefix=f"{self.name}-http")
        thread = threading.Thread(target=self._accept_loop, name=f"{self.name}-accept", daemon=True)
        self._run = _Running(selector, wake_r, wake_w, pool, thread)
        thread.start()

    def stop(self) -> None:
        """Close every listening socket; connections in progress finish on their own."""
        run, self._run = self._run, None
        self._stopping.set()
        with self._lock:
            socks = [s for s, _ in self._handlers.values()]
            self._handlers.clear()
        if run is not None:
            with contextlib.suppress(OSError):
                run.wake_w.send(b"x")
            run.thread.join(timeout=5)
            for sock in socks:
                with contextlib.suppress(KeyError, ValueError):
                    run.selector.unregister(sock)
            run.pool.shutdown(wait=False, cancel_futures=True)
            run.selector.close()
            run.wake_r.close()
            run.wake_w.close()
        for sock in socks:
            sock.close()

    # -- the acceptor

    def _accept_loop(self) -> None:
        run = self._run
        assert run is not None
        while not self._stopping.is_set():
            try:
                ready = run.selector.select(timeout=1.0)
            except OSError as exc:
                log.error("%s: select failed: %s", self.name, exc)
                continue
            for key, _ in ready:
                if key.data is None:
                    with contextlib.suppress(OSError):
                        run.wake_r.recv(64)
                    continue
                self._accept(key.fileobj, run.pool)  # type: ignore[arg-type]

    def _accept(self, sock: socket.socket, pool: ThreadPoolExecutor) -> None:
        while True:
            with self._lock:
                entry = self._handlers.get(sock.fileno()) if sock.fileno() >= 0 else None
                if entry is None or entry[0] is not sock:
                    return  # removed since select() reported it
                handler = entry[1]
            try:
                conn, peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    log.error(
                        "%s: cannot accept a connection: %s (raise the open-file limit)", self.name, exc
                    )
                return
            self._dispatch(conn, peer, handler, pool)

    def _dispatch(self, conn: socket.socket, peer: Any, handler: Handler, pool: ThreadPoolExecutor) -> None:
        with self._lock:
            if self._queued >= self._max_queued:
                conn.close()  # overloaded: refuse rather than queue without bound
                return
            self._queued += 1
        conn.setblocking(True)
        conn.settimeout(self._idle_timeout_s)
        try:
            pool.submit(self._serve_connection, conn, peer, handler)
        except RuntimeError:  # the pool is shut down
            conn.close()
            with self._lock:
                self._queued -= 1

    def _serve_connection(self, conn: socket.socket, peer: Any, handler: Handler) -> None:
        try:
            _Connection(conn, peer, cast(Any, _Bridge(handler)))
        except (OSError, ValueError):
            pass  # the client went away or timed out while idle
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with self._lock:
                self._queued -= 1


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
        self._server = server or HttpServer(name, workers=4)
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
