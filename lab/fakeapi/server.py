"""A fake kube-apiserver: real HTTP (optionally TLS), kube-apiserver's paths, JSON and semantics.

The agent reaches it through a kubeconfig (or the in-cluster service-account files) with the real
`kubernetes` client, exactly as it would a real control plane; nothing in the client is mocked.
Tests drive the cluster through a Python API (`create` / `update` / `delete` of plain dicts) and
inject faults (`fail_next`, `latency_s`, `drop_streams`, `expire_continue_tokens`, `compact`,
`drop_watch_history`, `stop` / `start` / `restart` / `down_for`, `inject_watch_line`).

What is like kube-apiserver (each checked against upstream source or API docs):

* Paths: `/version`, `/api`, `/apis`, `/api/v1/{services,nodes,events}`,
  `/api/v1/namespaces/{ns}/{services,events}[/{name}]`, `/apis/discovery.k8s.io/v1/[namespaces/
  {ns}/]endpointslices[/{name}]`, `/apis/events.k8s.io/v1/namespaces/{ns}/events[/{name}]`.
* Lists: `{"kind": "ServiceList", "apiVersion": "v1", "metadata": {"resourceVersion", "continue",
  "remainingItemCount"}, "items": [...]}`; items carry no `kind`/`apiVersion` (as upstream's JSON).
  `remainingItemCount` only without selectors, as documented for ListMeta.
* One global resourceVersion (etcd revision); objects get `uid`, `creationTimestamp`,
  `resourceVersion`; an update with a stale resourceVersion is a 409 Conflict.
* `limit`/`continue`: every page is read at the first page's revision (a consistent snapshot);
  the continue token is base64 JSON `{"v":"meta.k8s.io/v1","rv":N,"start":KEY}` like upstream's.
  After compaction a token from an older revision is answered `410` reason `Expired` with
  upstream's message. A list at `resourceVersion=0` is answered whole, whatever its `limit`, as
  the watch cache does (`FakeApiServer(watch_cache=False)`: in pages, as without one).
* Label selectors (`!key`, `key=v`, `in`, `notin`, ...) and field selectors (`metadata.name`,
  `metadata.namespace`; unsupported fields are a 400 as upstream).
* Watch (`watch=true`): chunked newline-delimited JSON `{"type", "object"}` events from a
  resourceVersion, served from a bounded per-kind window like the watch cache. An object that
  starts matching a watcher's selector arrives as ADDED, one that stops matching as DELETED with
  its previous content and the event's resourceVersion (cacher's `convertToWatchEvent`). A too-old
  resourceVersion gets an ERROR event `{"kind":"Status","code":410,"reason":"Expired"}` on a 200
  stream, as the cacher answers; `gone_style="status"` answers a plain 410 status instead (what
  the non-cached etcd path does for a compacted revision). A resourceVersion from the future waits
  up to 3 s, then an ERROR 504 "Too large resource version" (cacher's `waitUntilFreshAndBlock`).
  No resourceVersion (or "0") starts with synthetic ADDED events of every object.
* Bookmarks when `allowWatchBookmarks=true`: every `bookmark_interval_s` (upstream: about a
  minute) and 2 s before the watch's deadline (cacher's `nextBookmarkTime`), carrying the current
  global revision, so a quiet watcher still moves forward. `timeoutSeconds` ends the stream
  cleanly; without it the stream lasts `default_watch_timeout_s`.
* Events: events.k8s.io/v1 POST is validated as upstream's `ValidateEventCreate` (eventTime,
  reportingController, reportingInstance, action, reason, type, note length, `deprecatedSource`
  unset, namespace rules), 409 AlreadyExists on a duplicate name; PATCH with
  `application/strategic-merge-patch+json` or `application/merge-patch+json` merges, 404 when
  the Event is gone. core/v1 Events are accepted with legacy validation only.
* Errors are `Status` objects with upstream's reasons (NotFound, BadRequest, Invalid,
  AlreadyExists, Conflict, Expired, Unauthorized, InternalError, ServiceUnavailable,
  TooManyRequests with `Retry-After`).

What is simplified: JSON only (no protobuf, no CBOR); one bearer token set instead of authn/authz
(no RBAC); strategic merge patch is applied as a JSON merge patch (the same for Event fields);
`resourceVersionMatch` is ignored and `resourceVersion=N` on a list reads the latest state; the two
Event APIs are separate stores; watchers read the shared window instead of being sent each event
as it is written, so one that had not read events the window then lost (trimmed, or emptied by
`drop_watch_history`/`compact`) cannot be served: its stream is ended, as the cacher ends a
watcher it terminates; no server-side apply, no admission, no defaulting of object fields.
"""

from __future__ import annotations

import base64
import contextlib
import json
import random
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from lab.fakeapi.events import merge_patch, validate_v1_event
from lab.fakeapi.selectors import Selector, SelectorError, build_selector
from lab.fakeapi.store import (
    BY_PATH,
    CORE_EVENTS,
    EVENTS_V1,
    ResourceType,
    Store,
    StoreError,
    WatchEvent,
    decode_continue,
    type_of,
)
from lab.fakeapi.tls import server_certs

Obj = dict[str, Any]

CONTINUE_EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. You can start "
    "a new list without the continue parameter, or use the continue token in this response to "
    "retrieve the remainder of the results. Continuing with the provided token results in an "
    "inconsistent list - objects that were created, modified, or deleted between the time the "
    "first chunk was returned and now may show up in the list."
)
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def status(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> Obj:
    body: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = dict(details)
    return body


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    at: float  # time.monotonic() when it arrived


@dataclass
class _Fault:
    remaining: int
    code: int
    retry_after: int | None
    match: Callable[[Request], bool] | None


@dataclass
class _Stream:
    """An open watch: its socket (to cut it), its kind and raw lines queued for it.

    Each raw line carries the kind's window position when it was injected, so it goes out after
    the writes made before the injection and before those made after it.
    """

    kind: ResourceType
    sock: socket.socket
    raw: list[tuple[int, bytes]] = field(default_factory=list)
    end_clean: bool = False


class _HTTPServer(ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    api: FakeApiServer
    tls: ssl.SSLContext | None = None

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = self.socket.accept()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        self.api._track(sock)
        return sock, addr

    def shutdown_request(self, request: Any) -> None:
        self.api._untrack(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away mid-response is normal here (drop_streams, stop)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.settimeout(10)
            self.connection.do_handshake()
            self.connection.settimeout(None)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.api._handle(self, "GET")

    def do_POST(self) -> None:
        self.server.api._handle(self, "POST")

    def do_PUT(self) -> None:
        self.server.api._handle(self, "PUT")

    def do_PATCH(self) -> None:
        self.server.api._handle(self, "PATCH")

    def do_DELETE(self) -> None:
        self.server.api._handle(self, "DELETE")

    # ---- response helpers --------------------------------------------------------------------

    def send_body(self, code: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, code: int, obj: Any, headers: Mapping[str, str] | None = None) -> None:
        self.send_body(code, json.dumps(obj, separators=(",", ":")).encode(), headers)

    def send_status(
        self, code: int, message: str, reason: str = "", headers: Mapping[str, str] | None = None
    ) -> None:
        self.send_json(code, status(code, reason or _REASONS.get(code, "Unknown"), message), headers)

    def start_chunked(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class FakeApiServer:
    """A kube-apiserver stand-in on 127.0.0.1; see the module docstring for what it implements.

    `start()` binds (port 0 picks a free one, kept for later restarts); use as a context manager.
    """

    def __init__(
        self,
        *,
        tls: bool = False,
        tokens: tuple[str, ...] = (),
        watch_capacity: int = 1000,
        bookmark_interval_s: float = 60.0,
        default_watch_timeout_s: tuple[int, int] = (1800, 3600),
        gone_style: str = "event",
        port: int = 0,
        watch_cache: bool = True,
    ) -> None:
        self.store = Store(watch_capacity)
        # kube-apiserver answers a list at resourceVersion=0 from its watch cache, whole, ignoring
        # `limit`; with --watch-cache=false (False here) it pages every list.
        self.watch_cache = watch_cache
        self.tls = tls
        self.tokens = set(tokens)  # empty: no authentication
        self.bookmark_interval_s = bookmark_interval_s
        self.default_watch_timeout_s = default_watch_timeout_s
        self.gone_style = gone_style
        self.latency_s = 0.0
        self.port = port
        self.requests: list[Request] = []
        self.patches: list[tuple[str, str, Obj]] = []  # (namespace, name, patch) of Event PATCHes
        self._watch_capacity = watch_capacity
        self._faults: list[_Fault] = []
        self._hooks: list[Callable[[Request], None]] = []
        self._lock = threading.Lock()
        self._conns: set[Any] = set()
        self._streams: list[_Stream] = []
        self._opened: dict[str, int] = {}
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._restart_timer: threading.Timer | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def ca_path(self) -> Path:
        return server_certs().ca

    @property
    def running(self) -> bool:
        return self._httpd is not None

    def start(self) -> FakeApiServer:
        with self._lock:
            if self._httpd is not None:
                return self
            httpd = _HTTPServer(("127.0.0.1", self.port), _Handler)
            httpd.api = self
            if self.tls:
                certs = server_certs()
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.load_cert_chain(certs.cert, certs.key)
                httpd.tls = ctx
            self.port = httpd.server_address[1]
            self._stopping = False
            self._httpd = httpd
            self._thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection (watches and idle keep-alives), as a crash does."""
        with self._lock:
            httpd, self._httpd = self._httpd, None
            if self._restart_timer is not None:
                self._restart_timer.cancel()
                self._restart_timer = None
        if httpd is None:
            return
        self._stopping = True
        httpd.shutdown()
        httpd.server_close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _hard_close(conn)
        with self.store.cond:
            self.store.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def restart(self, fresh: bool = False) -> None:
        """Stop and start on the same port; `fresh` loses every object (and the revision counter)."""
        self.stop()
        if fresh:
            self.store = Store(self._watch_capacity)
        self.start()

    def down_for(self, seconds: float) -> None:
        """Stop now and start again on the same port after `seconds` (connections are refused)."""
        self.stop()
        timer = threading.Timer(seconds, self.start)
        timer.daemon = True
        with self._lock:
            self._restart_timer = timer
        timer.start()

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the cluster, as tests drive it ------------------------------------------------------

    def create(self, obj: Mapping[str, Any]) -> Obj:
        return self.store.create(obj)

    def update(self, obj: Mapping[str, Any]) -> Obj:
        return self.store.update(obj)

    def apply(self, obj: Mapping[str, Any]) -> Obj:
        """Create, or update ignoring resourceVersion: the `kubectl apply` of tests."""
        t = type_of(obj)
        meta = obj.get("metadata") or {}
        if self.store.get(t, meta.get("namespace", ""), meta.get("name", "")) is None:
            return self.create(obj)
        fresh: Obj = json.loads(json.dumps(obj))
        fresh["metadata"].pop("resourceVersion", None)
        return self.update(fresh)

    def delete(self, kind: str, namespace: str, name: str, api_version: str | None = None) -> Obj:
        t = type_of({"kind": kind, "apiVersion": api_version})
        return self.store.delete(t, namespace, name)

    def get(self, kind: str, namespace: str, name: str, api_version: str | None = None) -> Obj | None:
        return self.store.get(type_of({"kind": kind, "apiVersion": api_version}), namespace, name)

    @property
    def resource_version(self) -> str:
        return str(self.store.rv)

    def events(self) -> list[Obj]:
        """events.k8s.io/v1 Events as stored (POSTed, then PATCHed)."""
        return self.store.objects(EVENTS_V1)

    def core_events(self) -> list[Obj]:
        return self.store.objects(CORE_EVENTS)

    def write_kubeconfig(self, path: str | Path, token: str | None = None, server: str | None = None) -> str:
        cluster: Obj = {"server": server or self.url}
        if self.tls:
            cluster["certificate-authority-data"] = base64.b64encode(self.ca_path.read_bytes()).decode()
        user: Obj = {"token": token} if token else {}
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": cluster}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        Path(path).write_text(yaml.safe_dump(doc))
        return str(path)

    # ---- faults ------------------------------------------------------------------------------

    def fail_next(
        self,
        n: int,
        code: int = 503,
        retry_after: int | None = None,
        match: Callable[[Request], bool] | None = None,
    ) -> None:
        """Answer the next `n` requests (those `match` accepts) with `code` and a Status body."""
        with self._lock:
            self._faults.append(_Fault(n, code, retry_after, match))

    def on_request(self, hook: Callable[[Request], None]) -> None:
        """Call `hook(request)` before each request is served (from the server's thread)."""
        self._hooks.append(hook)

    def drop_streams(self, clean: bool = False) -> int:
        """Cut every open watch now (clean: end the chunked stream properly). Returns how many."""
        with self._lock:
            streams = list(self._streams)
        for s in streams:
            if clean:
                s.end_clean = True
            else:
                _hard_close(s.sock)
        with self.store.cond:
            self.store.cond.notify_all()
        return len(streams)

    def open_streams(self, kind: str | None = None) -> int:
        """Watch streams open now (one the client abandoned counts until the server notices)."""
        with self._lock:
            return sum(1 for s in self._streams if kind is None or s.kind.kind == kind)

    def watches_opened(self, kind: str) -> int:
        """Watch streams of `kind` opened since the server was made (restarts included)."""
        with self._lock:
            return self._opened.get(kind, 0)

    def inject_watch_line(self, kind: str, line: bytes) -> int:
        """Send `line` (any bytes; a newline is added) on every open watch of `kind`."""
        with self.store.cond, self._lock:
            streams = [s for s in self._streams if s.kind.kind == kind]
            for s in streams:
                s.raw.append((self.store.window(s.kind).end_seq, line))
            self.store.cond.notify_all()
        return len(streams)

    def expire_continue_tokens(self) -> None:
        """Compact at the current revision: every outstanding continue token now gets 410."""
        self.store.compact()

    def drop_watch_history(self) -> None:
        self.store.drop_watch_history()

    def compact(self) -> None:
        """Both: a watch from before now gets 410, and continue tokens handed out so far expire."""
        self.store.drop_watch_history()
        self.store.compact()

    # ---- connection tracking -----------------------------------------------------------------

    def _track(self, conn: Any) -> None:
        with self._lock:
            self._conns.add(conn)

    def _untrack(self, conn: Any) -> None:
        with self._lock:
            self._conns.discard(conn)

    # ---- request handling --------------------------------------------------------------------

    def _handle(self, h: _Handler, method: str) -> None:
        parts = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        req = Request(
            method, parts.path, query, {k.lower(): v for k, v in h.headers.items()}, time.monotonic()
        )
        with self._lock:
            self.requests.append(req)
        for hook in list(self._hooks):
            hook(req)
        if self.latency_s:
            time.sleep(self.latency_s)
        fault = self._take_fault(req)
        if fault is not None:
            self._drain_body(h)
            headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else None
            h.send_status(fault.code, f"injected fault: {fault.code}", headers=headers)
            return
        if self.tokens and h.headers.get("Authorization", "") not in {f"Bearer {t}" for t in self.tokens}:
            self._drain_body(h)
            h.send_status(401, "Unauthorized")
            return
        try:
            self._route(h, method, req)
        except StoreError as exc:
            h.send_json(exc.code, status(exc.code, exc.reason, exc.message, exc.details))
        except SelectorError as exc:
            h.send_status(400, str(exc))

    def _take_fault(self, req: Request) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.remaining > 0 and (f.match is None or f.match(req)):
                    f.remaining -= 1
                    return f
            self._faults = [f for f in self._faults if f.remaining > 0]
        return None

    @staticmethod
    def _drain_body(h: _Handler) -> bytes:
        length = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(length) if length else b""

    def _route(self, h: _Handler, method: str, req: Request) -> None:
        path = req.path.rstrip("/")
        if path == "/version":
            h.send_json(
                200,
                {
                    "major": "1",
                    "minor": "33",
                    "gitVersion": "v1.33.0-fakeapi",
                    "platform": "linux/amd64",
                },
            )
            return
        if path == "/api":
            h.send_json(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
            return
        if path == "/apis":
            groups = [
                {
                    "name": g,
                    "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
                    "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"},
                }
                for g in ("discovery.k8s.io", "events.k8s.io")
            ]
            h.send_json(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
            return
        segs = path.strip("/").split("/")
        if segs[:2] == ["api", "v1"]:
            gv, rest = "v1", segs[2:]
        elif len(segs) >= 3 and segs[0] == "apis":
            gv, rest = f"{segs[1]}/{segs[2]}", segs[3:]
        else:
            self._drain_body(h)
            h.send_status(404, "the server could not find the requested resource")
            return
        namespace = ""
        if len(rest) >= 2 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        t = BY_PATH.get((gv, rest[0])) if rest else None
        if t is None or len(rest) > 2 or (namespace and not t.namespaced):
            self._drain_body(h)
            h.send_status(404, "the server could not find the requested resource")
            return
        name = rest[1] if len(rest) == 2 else ""
        if method == "GET" and not name:
            if req.query.get("watch") in ("true", "1"):
                self._watch(h, t, namespace, req)
            else:
                self._list(h, t, namespace, req)
        elif method == "GET":
            obj = self.store.get(t, namespace, name)
            if obj is None:
                raise StoreError(404, "NotFound", f'{t.plural} "{name}" not found', {"name": name})
            h.send_json(200, obj)
        elif method == "POST" and not name and t in (EVENTS_V1, CORE_EVENTS) and namespace:
            self._create_event(h, t, namespace)
        elif method == "PATCH" and name and t in (EVENTS_V1, CORE_EVENTS) and namespace:
            self._patch_event(h, t, namespace, name, req)
        else:
            self._drain_body(h)
            h.send_status(405, f"{method} is not supported on {req.path} by this fake server")

    # ---- list --------------------------------------------------------------------------------

    def _list(self, h: _Handler, t: ResourceType, namespace: str, req: Request) -> None:
        q = req.query
        selector = build_selector(q.get("labelSelector", ""), q.get("fieldSelector", ""), t.fields)
        limit = int(q.get("limit") or 0)
        token = q.get("continue", "")
        at_rv, start = None, ""
        if token:
            at_rv, start = decode_continue(token)
            if at_rv < self.store.compacted_rv:
                h.send_json(
                    410,
                    status(410, "Expired", CONTINUE_EXPIRED) | {"metadata": {"continue": token}},
                )
                return
        if q.get("resourceVersion") == "0" and not token and self.watch_cache:
            limit = 0  # served from the watch cache upstream, which ignores limit
        page = self.store.list_page(t, namespace, selector, limit, start, at_rv)
        meta: Obj = {"resourceVersion": str(page.rv)}
        if page.continue_token:
            meta["continue"] = page.continue_token
        if page.remaining is not None:
            meta["remainingItemCount"] = page.remaining
        head = json.dumps({"kind": t.list_kind, "apiVersion": t.group_version, "metadata": meta})
        body = head[:-1].encode() + b',"items":[' + b",".join(page.items) + b"]}"
        h.send_body(200, body)

    # ---- watch -------------------------------------------------------------------------------

    def _watch(self, h: _Handler, t: ResourceType, namespace: str, req: Request) -> None:
        q = req.query
        selector = build_selector(q.get("labelSelector", ""), q.get("fieldSelector", ""), t.fields)
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        if q.get("timeoutSeconds"):
            timeout = float(q["timeoutSeconds"])
        else:
            timeout = float(random.randint(*self.default_watch_timeout_s))
        start = time.monotonic()
        deadline = start + timeout
        rv_param = q.get("resourceVersion", "")
        store = self.store
        initial: list[bytes] = []
        error: Obj | None = None
        with store.cond:
            window = store.window(t)
            if rv_param in ("", "0"):
                initial = [j for _, j in store.current_objects_json(t, namespace, selector)]
                seq = window.end_seq
            else:
                try:
                    rv = int(rv_param)
                except ValueError:
                    h.send_status(
                        400, f'resourceVersion: Invalid value: "{rv_param}": must be a number', "Invalid"
                    )
                    return
                if rv < window.oldest_valid_rv:
                    message = f"too old resource version: {rv} ({window.oldest_valid_rv})"
                    if self.gone_style == "status":
                        h.send_status(410, message, "Expired")
                        return
                    error = status(410, "Expired", message)
                else:
                    wait_until = time.monotonic() + 3.0
                    while store.rv < rv and time.monotonic() < wait_until:
                        store.cond.wait(0.1)
                    if store.rv < rv:
                        error = status(
                            504, "Timeout", f"Too large resource version: {rv}, current: {store.rv}"
                        )
                        error["details"] = {
                            "causes": [
                                {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
                            ]
                        }
                seq = window.seq_after(rv) if error is None else 0
            # Registered in the critical section of the version check, so a watch accepted before
            # a compaction is always one that a later drop_streams() cuts.
            stream = _Stream(t, h.connection)
            with self._lock:
                self._streams.append(stream)
                self._opened[t.kind] = self._opened.get(t.kind, 0) + 1
        try:
            h.start_chunked()
            for j in initial:
                h.chunk(b'{"type":"ADDED","object":' + j + b"}\n")
            if error is not None:
                h.chunk(json.dumps({"type": "ERROR", "object": error}).encode() + b"\n")
                h.end_chunked()
                return
            self._stream_events(h, t, namespace, selector, bookmarks, seq, start, deadline, stream)
        except OSError:
            h.close_connection = True
        finally:
            with self._lock:
                if stream in self._streams:
                    self._streams.remove(stream)

    def _next_bookmark(self, now: float, deadline: float) -> float:
        beat = now + self.bookmark_interval_s
        return min(beat, deadline - 2.0) if deadline - 2.0 > now else beat

    def _stream_events(
        self,
        h: _Handler,
        t: ResourceType,
        namespace: str,
        selector: Selector,
        bookmarks: bool,
        seq: int,
        start: float,
        deadline: float,
        stream: _Stream,
    ) -> None:
        store = self.store
        next_bookmark = self._next_bookmark(start, deadline) if bookmarks else float("inf")
        while True:
            with store.cond:
                window = store.window(t)
                while True:
                    now = time.monotonic()
                    if (
                        window.end_seq > seq
                        or stream.raw
                        or stream.end_clean
                        or self._stopping
                        or now >= next_bookmark
                        or now >= deadline
                        or seq < window.base_seq
                    ):
                        break
                    store.cond.wait(min(next_bookmark, deadline, now + 0.2) - now)
                    if _peer_gone(stream.sock):
                        break
                if self._stopping or _peer_gone(stream.sock):
                    return
                # Events this watcher had not read yet were trimmed or dropped from the window.
                left_behind = seq < window.base_seq
                events = [] if left_behind else window.since(seq)
                seq = window.end_seq
                snapshot_rv = store.rv
                with self._lock:
                    raw, stream.raw = stream.raw, []
            if left_behind:
                # The cacher terminates a watcher it cannot serve and its response ends
                # (cache_watcher.go closes the result channel): the client watches again from its
                # last resourceVersion and is answered 410. Left open, the stream would carry
                # nothing more and the client would wait out its read timeout.
                h.end_chunked()
                return
            first_seq = seq - len(events)
            for i, ev in enumerate(events):
                while raw and raw[0][0] <= first_seq + i:
                    h.chunk(raw.pop(0)[1] + b"\n")
                line = _watch_line(ev, namespace, selector)
                if line is not None:
                    h.chunk(line)
            for _, line in raw:
                h.chunk(line + b"\n")
            now = time.monotonic()
            if stream.end_clean or now >= deadline:
                h.end_chunked()
                return
            if now >= next_bookmark:
                mark = {
                    "kind": t.kind,
                    "apiVersion": t.group_version,
                    "metadata": {"resourceVersion": str(snapshot_rv)},
                }
                h.chunk(
                    json.dumps({"type": "BOOKMARK", "object": mark}, separators=(",", ":")).encode() + b"\n"
                )
                next_bookmark = self._next_bookmark(now, deadline)

    # ---- events ------------------------------------------------------------------------------

    def _read_json(self, h: _Handler) -> Any:
        body = self._drain_body(h)
        try:
            return json.loads(body)
        except ValueError as exc:
            raise StoreError(400, "BadRequest", f"error decoding request body: {exc}") from exc

    def _create_event(self, h: _Handler, t: ResourceType, namespace: str) -> None:
        obj = self._read_json(h)
        if not isinstance(obj, dict):
            raise StoreError(400, "BadRequest", "the request body is not an object")
        obj.setdefault("kind", t.kind)
        obj.setdefault("apiVersion", t.group_version)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise StoreError(400, "BadRequest", "metadata is not an object")
        if meta.get("namespace", namespace) != namespace:
            raise StoreError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        meta["namespace"] = namespace
        if t is EVENTS_V1:
            errors = validate_v1_event(obj)
            if errors:
                name = meta.get("name", "")
                raise StoreError(
                    422, "Invalid", f'Event.events.k8s.io "{name}" is invalid: [{", ".join(errors)}]'
                )
        h.send_json(201, self.store.create(obj))

    def _patch_event(self, h: _Handler, t: ResourceType, namespace: str, name: str, req: Request) -> None:
        ctype = req.headers.get("content-type", "").split(";")[0].strip()
        patch = self._read_json(h)
        if ctype not in ("application/strategic-merge-patch+json", "application/merge-patch+json"):
            raise StoreError(
                415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ctype}"
            )
        if not isinstance(patch, dict):
            raise StoreError(400, "BadRequest", "a merge patch must be an object")
        current = self.store.get(t, namespace, name)
        if current is None:
            raise StoreError(404, "NotFound", f'events.events.k8s.io "{name}" not found', {"name": name})
        with self._lock:
            self.patches.append((namespace, name, patch))
        merged = merge_patch(current, patch)
        merged["metadata"].pop("resourceVersion", None)
        if t is EVENTS_V1:
            errors = validate_v1_event(merged)
            if errors:
                raise StoreError(
                    422, "Invalid", f'Event.events.k8s.io "{name}" is invalid: [{", ".join(errors)}]'
                )
        h.send_json(200, self.store.update(merged))


def _watch_line(ev: WatchEvent, namespace: str, selector: Selector) -> bytes | None:
    """The watch event one watcher gets for one write, or None (cacher's convertToWatchEvent)."""
    if namespace and ev.namespace != namespace:
        return None
    cur = ev.new is not None and selector.matches(ev.new)
    old = ev.old is not None and selector.matches(ev.old)
    if cur and not old:
        return b'{"type":"ADDED","object":' + ev.new_json + b"}\n"
    if cur and old:
        return b'{"type":"MODIFIED","object":' + ev.new_json + b"}\n"
    if old:
        return b'{"type":"DELETED","object":' + ev.old_at_rv_json() + b"}\n"
    return None


def _peer_gone(sock: Any) -> bool:
    """Whether the client closed its end (a watch client never sends anything while streaming)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        if isinstance(sock, ssl.SSLSocket):
            return sock.pending() == 0 and not sock.recv(1)
        return not sock.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):
        return True


def _hard_close(conn: Any) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
