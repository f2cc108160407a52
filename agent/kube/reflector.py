"""List, then watch, one kind from the API server; deliver object events and `Synced` marks.

The loop of client-go's reflector, reduced to what a proxy needs and with its failure handling made
explicit:

* **List** as client-go's reflector does. The first list asks for `resourceVersion=0` with a
  `limit`: kube-apiserver serves that from its watch cache, whole, ignoring the limit (one
  request, so the client's rate limit, `--kube-api-qps` 5 with a burst of 10, is not paid per
  page: 20 pages of 500 for 10,000 Services cost 6 s of waiting, 200 pages for 50,000 cost 38 s).
  A server that answers in pages anyway (no watch cache) is followed page by page with the
  `continue` token, and later lists keep the limit. A relist after the version became unavailable
  (410 Gone, a resourceVersion ahead of the server) is a consistent read (no resourceVersion, in
  `limit`/`continue` pages from the first page's snapshot); any other relist asks for the last
  resourceVersion seen, from the cache. Each page, or each `page_size` items of a whole answer, is
  compared with what was delivered before and only the differences go to the sink: ADDED for a
  new key, MODIFIED when the resourceVersion changed, nothing when it did not; after the last,
  DELETED for every delivered key the list no longer holds, then `Synced(kind, resourceVersion)`.
  The first list and every relist take this one path, so a relist never flushes. A continue token
  that expired mid-list (410 Expired) restarts the list; after two expiries within one list it is
  fetched in one request, so a compaction faster than our paging cannot starve us.
* **Watch** from the list's resourceVersion with `allowWatchBookmarks=true` and a random
  `timeoutSeconds` in [5, 10] min (client-go's reflector). Every event and bookmark advances the
  resourceVersion, so a watch that breaks resumes where it stopped, and a quiet kind still moves
  forward past compactions. A stream the server ends is reopened at once (unless it ended within
  a second without a line: client-go's "very short watch", backed off); one that breaks, times
  out or fails to open is reopened after a backoff (backoff.py).
* **Resync** (`--config-sync-period`): once that long has passed since the last list, the next
  watch is cut short at that moment and the kind is listed again through the same reconciling
  path, counted as a relist with reason "resync".
* **410 Gone** (as a status or as an ERROR event), a resourceVersion the server reports as too
  large (a restored etcd), or an event that is not JSON: relist and reconcile as above.

Watch events are reconciled against the delivered objects too: an ADDED for a known key goes out
as MODIFIED, a DELETED for an unknown key is dropped, so the sink always sees a consistent story.
An object without a usable name cannot be keyed: it is skipped, logged once and counted in
`ekp_watch_unnamed_objects_total`; everything else in it is the model's business (it reports malformed
objects as Problems). If the sink raises, the batch's changes to the delivered map are rolled
back before the error is handled, so a retry reconciles against what the sink really received.

The delivered map holds each object's resourceVersion, not the object: the model keeps what it
parsed, and at 100,000 endpoints the raw dicts were the agent's largest resident item. (An object
without a resourceVersion, which no API server sends, is remembered by a digest of its bytes.)
A DELETED found by a relist therefore carries the object's identity and last resourceVersion
only; a DELETED from the watch carries what the server sent.

Responses are decoded straight from bytes into plain dicts (`_preload_content=False`, orjson),
never into the client's model classes, which cost several times the time and memory
(bench/apilist.py measures it). A list's envelope is split first (msgspec: the items as raw JSON
spans of the body, in C), then its items are decoded `page_size` at a time and handed on, so a
whole answer of 50,000 objects is never held decoded at once. A list's Services and
EndpointSlices are decoded into only the fields the parsers read (agent.model.wire: msgspec
Structs, an item whose fields are not of the expected types decoded whole as before); a Node, and
every watch event, whole with orjson. `metadata.managedFields` and the kubectl last-applied
annotation are dropped on arrival: the proxy never reads them and they are often most of an object.

A restart's first list can skip decoding most items: the sink's `kept` (the records the last run
left, agent.keptrecords) is asked for each item's record by kind, key, uid and resourceVersion,
read from its metadata alone (msgspec: about 0.04 CPU s for both lists at 10,000 Services of 10
endpoints, against about 1 s to decode them whole with orjson). An item it has a record for goes
out with that record (`ObjectEvent.kept`) and its identity only; any other is decoded whole as
before. Only the first list asks, and only while `kept` holds a record (a cold start's first list
decodes every item at once): the records describe the objects as the last run left them, and after
that list `kept` has none left to give.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import orjson
import urllib3
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from agent.goformat import format_duration
from agent.kube.backoff import Backoff, BackoffState, Episode
from agent.kube.resources import Resource
from agent.metrics.source import SourceMetrics
from agent.model import wire
from agent.model.problem import printable
from agent.sources.base import JSON_MAP_TYPES, Event, EventType, Kind, ObjectEvent, Sink, Synced, object_key

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_MISSING: Any = object()
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


@dataclass(frozen=True)
class WatchSettings:
    """Knobs of the list/watch loop; tests shrink them to keep fault tests short."""

    page_size: int = 500
    watch_timeout_s: tuple[int, int] = (300, 600)  # client-go: random in [minWatchTimeout, 2x]
    read_margin_s: float = 30.0  # a watch silent this long past its timeout is dead
    connect_timeout_s: float = 10.0
    list_timeout_s: float = 60.0  # per page read
    backoff: Backoff = field(default_factory=Backoff)
    # --config-sync-period: list again this long after the last list (0: never). kube-proxy's
    # informers resync on this period; here a relist reconciles against what was delivered, so
    # an event a watch lost is found and only the differences reach the sink.
    resync_s: float = 0.0


class Kept(Protocol):
    """The records a restart's first list asks for (agent.keptrecords.KeptRecords)."""

    def take(self, kind: Kind, key: str, uid: str, version: str) -> object | None:
        """The record of this object at this uid and resourceVersion, or None: decode the item."""

    def empty(self) -> bool:
        """Whether no record is left to take (a cold start's, from its first call): the list then
        stops asking, and decodes its items whole at once."""


def decode(data: bytes | str) -> Any:
    """JSON bytes to plain Python data; raises ValueError."""
    return orjson.loads(data)


class _ListBody(msgspec.Struct):
    """A list response: its metadata, and its items as raw JSON spans of the body (decoded later,
    a page at a time)."""

    metadata: Any = None
    items: list[msgspec.Raw] | None = None


_LIST_BODY = msgspec.json.Decoder(_ListBody)


class _Meta(msgspec.Struct):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""


class _Head(msgspec.Struct):
    """An item's identity, decoded without the rest of it (msgspec skips unknown fields in C)."""

    metadata: _Meta | None = None


_HEAD = msgspec.json.Decoder(_Head)


class _Stopped(Exception):
    pass


class _Relist(Exception):
    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason = reason


class _ContinueExpired(Exception):
    pass


class _Failure(Exception):
    """A failed request: `reason` is the metric label, the message says what an operator checks."""

    def __init__(self, verb: str, reason: str, text: str, retry_after: float | None = None) -> None:
        super().__init__(text)
        self.verb, self.reason, self.retry_after = verb, reason, retry_after


def _retry_after(exc: ApiException) -> float | None:
    headers = exc.headers or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _too_large(exc: ApiException) -> bool:
    """kube-apiserver's answer to a resourceVersion ahead of it (a restored etcd)."""
    return exc.status == 504 and "ResourceVersionTooLarge" in str(exc.body or "")


def _status_message(exc: ApiException) -> str:
    try:
        body = decode(exc.body) if exc.body else {}
        message = body.get("message", "") if isinstance(body, dict) else ""
    except ValueError:
        message = ""
    return printable(message or exc.reason or "", 200)


def _http_failure(verb: str, exc: ApiException) -> _Failure:
    code = exc.status or 0
    hint = {
        401: "the API server rejected the credentials: check the token or client certificate "
        "(--kubeconfig, or the pod's service account)",
        403: "forbidden: the agent's identity needs get/list/watch on services, "
        "endpointslices.discovery.k8s.io and nodes (ClusterRole system:node-proxier grants them)",
    }.get(code, f"the API server answered {code}: {_status_message(exc)}")
    return _Failure(verb, f"http_{code}" if code else "other", hint, _retry_after(exc))


def _transport_failure(verb: str, exc: BaseException) -> _Failure:
    if isinstance(exc, urllib3.exceptions.ReadTimeoutError):
        return _Failure(verb, "read_timeout", f"no data within the read timeout ({exc})")
    if isinstance(exc, urllib3.exceptions.NewConnectionError | urllib3.exceptions.ConnectTimeoutError):
        return _Failure(verb, "connect", f"cannot connect to the API server: {exc}")
    if isinstance(exc, urllib3.exceptions.ProtocolError):
        return _Failure(verb, "dropped", f"the connection broke: {exc}")
    if isinstance(exc, urllib3.exceptions.SSLError):
        return _Failure(verb, "connect", f"TLS failed (check the CA and the server name): {exc}")
    return _Failure(
        verb, "connect" if isinstance(exc, ConnectionError) else "other", f"{type(exc).__name__}: {exc}"
    )


_TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, OSError)


def _release(resp: Any, clean: bool) -> None:
    """Give the connection back to the pool; one with unread data is closed first, never reused."""
    if not clean:
        resp.close()
    resp.release_conn()


class Reflector:
    """One kind's list/watch loop; `run` is the thread body and never raises."""

    def __init__(
        self,
        resource: Resource,
        sink: Sink,
        settings: WatchSettings,
        stopping: threading.Event,
        rand: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: SourceMetrics | None = None,
        kept: Kept | None = None,
    ) -> None:
        self.resource = resource
        self._kept = kept  # asked during the first list only (see the module doc)
        self._metrics = metrics or SourceMetrics(CollectorRegistry())
        self.kind = resource.kind
        # a list's items: the parsed kinds into only what their parsers read (agent.model.wire);
        # None (an item without a name) where the item is not JSON
        self._decode_item = wire.decoder(resource.kind.value)
        self._sink = sink
        self._settings = settings
        self._stopping = stopping
        self._rand = rand or random.Random()
        self._clock = clock
        self._backoff = BackoffState(settings.backoff, self._rand, clock)
        self._episode = Episode(clock)
        self._delivered: dict[str, str] = {}  # key -> resourceVersion (or digest): what was delivered
        self._undo: list[tuple[str, Any]] = []
        self._response: Any = None
        self._response_lock = threading.Lock()
        self._logged_unnamed = False
        self.resource_version = ""
        self.lists = 0  # complete lists so far (the first one included)
        self._paginated = False  # a list was answered in pages: the server honours limit
        self._consistent = False  # the next list reads consistently (the version went away)
        self._listed_at = 0.0  # clock() at the end of the last complete list

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._loop()
        except _Stopped:
            pass
        except BaseException:  # the loop handles everything; this is the last line of defence
            log.critical("%s watch thread stopped by an unexpected error", self.kind.value, exc_info=True)

    def _loop(self) -> None:
        need_list = True
        while not self._stopping.is_set():
            try:
                if need_list:
                    self._list()
                    need_list = False
                self._watch()
                if self._resync_due() <= 0:
                    need_list = True
                    self._metrics.relists.labels(self.kind.value, "resync").inc()
                    log.info(
                        "%s: %s since the last list (--config-sync-period); listing again",
                        self.kind.value,
                        format_duration(self._settings.resync_s),
                    )
            except _Stopped:
                raise
            except _Relist as r:
                self._rollback()
                need_list = True
                # client-go: a version the server no longer has (or not yet) is not asked for again
                self._consistent = r.reason in ("gone", "too_large")
                self._metrics.watch_restarts.labels(self.kind.value, r.reason).inc()
                self._metrics.relists.labels(self.kind.value, r.reason).inc()
                log.info("%s watch: %s; listing again and sending only the differences", self.kind.value, r)
                self._sleep(self._backoff.next())
            except _Failure as f:
                self._rollback()
                self._failed(f)
                self._sleep(max(self._backoff.next(), f.retry_after or 0.0))
            except Exception:
                # A bug, or a sink that raised: never let the thread die; start from a fresh list.
                self._rollback()
                need_list = True
                if self._episode.fail():
                    log.exception(
                        "%s watch: unexpected error; listing again after a backoff", self.kind.value
                    )
                self._metrics.api_errors.labels(self.kind.value, "watch", "other").inc()
                self._sleep(self._backoff.next())

    def _resync_due(self) -> float:
        """Seconds until the next resync list (inf when resyncs are off)."""
        if self._settings.resync_s <= 0:
            return float("inf")
        return self._listed_at + self._settings.resync_s - self._clock()

    def interrupt(self) -> None:
        """Unblock a read in progress (used by stop); the loop then sees `stopping` and ends."""
        with self._response_lock:
            resp = self._response
        if resp is not None:
            try:
                resp.shutdown()
            except Exception as exc:  # best effort: the read timeout ends it anyway
                log.debug("could not interrupt the %s stream: %s", self.kind.value, exc)

    def _sleep(self, seconds: float) -> None:
        if self._stopping.wait(seconds):
            raise _Stopped

    def _failed(self, f: _Failure) -> None:
        self._metrics.api_errors.labels(self.kind.value, f.verb, f.reason).inc()
        if self._episode.fail():
            log.warning(
                "%s %s failing: %s; retrying with backoff (at most %g s apart). Further failures "
                "are counted in ekp_api_request_errors_total{kind=%r} and logged again when it recovers",
                self.kind.value,
                f.verb,
                f,
                self._settings.backoff.cap_s,
                self.kind.value,
            )

    def _recovered(self, what: str) -> None:
        ended = self._episode.recover()
        if ended is not None:
            failures, seconds = ended
            log.info(
                "%s %s recovered after %d failed attempt(s) over %.1f s",
                self.kind.value,
                what,
                failures,
                seconds,
            )

    # ---- delivery ----------------------------------------------------------------------------

    def _set(self, key: str, obj: Mapping[str, Any] | None) -> None:
        self._undo.append((key, self._delivered.get(key, _MISSING)))
        if obj is None:
            self._delivered.pop(key, None)
        else:
            self._delivered[key] = self._version_of(obj)

    @classmethod
    def _version_of(cls, obj: Mapping[str, Any]) -> str:
        """What tells two states of an object apart: its resourceVersion, else a digest."""
        rv = cls._rv_of(obj)
        if rv:
            return rv
        return (
            "#" + hashlib.blake2b(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS), digest_size=16).hexdigest()
        )

    def _tombstone(self, key: str) -> Obj:
        """The last known identity of `key`, for a DELETED that a relist found."""
        namespace, _, name = key.rpartition("/")
        meta: Obj = {"name": name}
        if namespace:
            meta["namespace"] = namespace
        version = self._delivered.get(key, "")
        if version and not version.startswith("#"):
            meta["resourceVersion"] = version
        return {"apiVersion": self.resource.api_version, "kind": self.kind.value, "metadata": meta}

    def _deliver(self, batch: list[Event]) -> None:
        """Hand `batch` to the sink; the delivered map keeps its changes only if that worked."""
        if batch:
            try:
                self._sink(batch)
            except BaseException:
                self._rollback()
                raise
        self._undo.clear()

    def _rollback(self) -> None:
        """Undo the delivered-map changes of a batch that never reached the sink."""
        for key, old in reversed(self._undo):
            if old is _MISSING:
                self._delivered.pop(key, None)
            else:
                self._delivered[key] = old
        self._undo.clear()

    def _key(self, obj: Any) -> str | None:
        """The object's key after filling the kind/apiVersion list items lack; None if unusable."""
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(meta, dict) or not isinstance(name, str) or not name:
            self._metrics.unnamed_objects.labels(self.kind.value).inc()
            if not self._logged_unnamed:
                self._logged_unnamed = True
                log.warning(
                    "%s without a usable metadata.name skipped: %s (further ones are only counted "
                    "in ekp_watch_unnamed_objects_total)",
                    self.kind.value,
                    printable(obj, 200),
                )
            return None
        obj.setdefault("kind", self.kind.value)
        obj.setdefault("apiVersion", self.resource.api_version)
        # Never read by the proxy, and often the bulk of an object (managedFields of a slice list
        # every endpoint; last-applied is a full copy): client-go's TransformStripManagedFields.
        meta.pop("managedFields", None)
        annotations = meta.get("annotations")
        if isinstance(annotations, dict):
            annotations.pop(LAST_APPLIED, None)
        return object_key(self.kind, obj)

    @staticmethod
    def _rv_of(obj: Mapping[str, Any]) -> str:
        meta = obj.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, JSON_MAP_TYPES) else None
        return rv if isinstance(rv, str) else ""

    # ---- list --------------------------------------------------------------------------------

    def _call(self, **kw: Any) -> Any:
        sel = self.resource
        return sel.list_call(
            label_selector=sel.label_selector or None,
            field_selector=sel.field_selector or None,
            _preload_content=False,
            **kw,
        )

    def _page(self, token: str | None, limit: int | None, rv: str | None) -> _ListBody:
        s = self._settings
        try:
            resp = self._call(
                limit=limit,
                _continue=token,
                resource_version=rv,
                _request_timeout=(s.connect_timeout_s, s.list_timeout_s),
            )
            clean = False
            try:
                data = resp.data
                clean = True
            finally:
                _release(resp, clean)
        except ApiException as exc:
            if exc.status == 410 and token:
                raise _ContinueExpired from exc
            if rv and rv != "0" and (exc.status == 410 or _too_large(exc)):
                self._consistent = True  # that version is gone (or not there yet): read what is
            raise _http_failure("list", exc) from exc
        except _TRANSPORT_ERRORS as exc:
            raise _transport_failure("list", exc) from exc
        try:
            body = _LIST_BODY.decode(data)
        except msgspec.ValidationError as exc:
            raise _Failure("list", "decode", f"the list response is not a {self.kind.value}List") from exc
        except msgspec.DecodeError as exc:
            raise _Failure("list", "decode", f"the list response is not JSON: {exc}") from exc
        return body

    def _list_options(self, expired: int) -> tuple[str | None, int | None]:
        """(resourceVersion, limit) of a list's first request (see the module doc)."""
        size = self._settings.page_size
        if expired >= 2:
            return None, None  # the compaction outruns our paging: one consistent request
        if self._consistent:
            return None, size
        if not self.resource_version:
            return "0", size  # the watch cache answers whole; a server without one, in pages
        return self.resource_version, size if self._paginated else None

    def _list(self) -> None:
        started = self._clock()
        seen: set[str] = set()
        token: str | None = None
        expired = 0
        pages = 0
        asked: str | None = None  # the resourceVersion this list's first request asked for
        while True:
            rv, limit = self._list_options(expired)
            if token is None:
                asked = rv
            else:
                rv, limit = None, self._settings.page_size  # continuing: the first page's snapshot
            try:
                body = self._page(token, limit, rv)
            except _ContinueExpired:
                expired += 1
                token, seen, pages = None, set(), 0
                self._metrics.relists.labels(self.kind.value, "continue_expired").inc()
                log.info(
                    "%s list: the continue token expired mid-list (410); listing again%s",
                    self.kind.value,
                    " in one request" if expired >= 2 else "",
                )
                continue
            except _Failure as f:
                self._failed(f)
                self._sleep(max(self._backoff.next(), f.retry_after or 0.0))
                continue
            pages += 1
            self._recovered("list")
            meta = body.metadata if isinstance(body.metadata, dict) else {}
            token = meta.get("continue")
            if not isinstance(token, str) or not token:
                token = None
            elif asked == "0":
                # client-go: only a paged answer at resourceVersion=0 says the server has no watch
                # cache (a consistent read pages even with one): later lists keep the limit
                self._paginated = True
            items = body.items or []
            size = max(1, self._settings.page_size)
            chunks = [items[i : i + size] for i in range(0, len(items), size)] or [[]]
            batch: list[Event] = []
            kept = self._kept if self.lists == 0 else None
            for n, chunk in enumerate(chunks, 1):
                batch = []
                if kept is not None and kept.empty():
                    kept = None
                for raw in chunk:
                    if kept is None or not self._reconcile_kept(raw, kept, seen, batch):
                        self._reconcile(self._decode_item(raw), seen, batch)
                if n < len(chunks) or token is not None:
                    self._deliver(batch)
            if token is None:  # the last page: its last chunk goes with the deletions and Synced
                version = meta.get("resourceVersion")
                version = version if isinstance(version, str) else ""
                for key in [k for k in self._delivered if k not in seen]:
                    batch.append(ObjectEvent(self.kind, EventType.DELETED, key, self._tombstone(key)))
                    self._set(key, None)
                batch.append(Synced(self.kind, version))
                self._deliver(batch)
                self.resource_version = version
                break
        self._consistent = False
        self.lists += 1
        self._listed_at = self._clock()
        elapsed = self._listed_at - started
        self._metrics.list_seconds.labels(self.kind.value).observe(elapsed)
        log.info(
            "%s: listed %d at resourceVersion %s in %.2f s (%d page(s))",
            self.resource.describe(),
            len(self._delivered),
            self.resource_version or "?",
            elapsed,
            pages,
        )

    def _reconcile(
        self, item: Any, seen: set[str], batch: list[Event], record: object = None, key: str | None = None
    ) -> None:
        """`key`: what `_key(item)` returned already (it also strips the item: not twice)."""
        if key is None:
            key = self._key(item)
        if key is None or key in seen:
            return
        seen.add(key)
        old = self._delivered.get(key)
        if old is None:
            batch.append(ObjectEvent(self.kind, EventType.ADDED, key, item, record))
        elif old != self._version_of(item):
            batch.append(ObjectEvent(self.kind, EventType.MODIFIED, key, item, record))
        else:
            return
        self._set(key, item)

    def _reconcile_kept(self, raw: msgspec.Raw, kept: Kept, seen: set[str], batch: list[Event]) -> bool:
        """`_reconcile` of an item `kept` has a record for, from its identity alone; False when it
        has none (or the identity cannot be read that way): decode the item whole."""
        try:
            meta = _HEAD.decode(raw).metadata
        # msgspec's own errors (ValueErrors only from msgspec 0.21), invalid UTF-8, deep nesting
        except (msgspec.MsgspecError, ValueError, RecursionError):
            return False
        if meta is None or not meta.name or not meta.uid or not meta.resourceVersion:
            return False
        identity: Obj = {"name": meta.name, "uid": meta.uid, "resourceVersion": meta.resourceVersion}
        if meta.namespace:
            identity["namespace"] = meta.namespace
        item: Obj = {"metadata": identity}
        key = self._key(item)
        if key is None or key in seen:
            return False
        record = kept.take(self.kind, key, meta.uid, meta.resourceVersion)
        if record is None:
            return False
        self._reconcile(item, seen, batch, record, key)
        return True

    # ---- watch -------------------------------------------------------------------------------

    def _watch(self) -> None:
        s = self._settings
        timeout_s = self._rand.randint(*s.watch_timeout_s)
        # The server ends the watch when the resync is due (whole seconds, at least 1).
        timeout_s = max(1, min(timeout_s, math.ceil(self._resync_due()) if s.resync_s > 0 else timeout_s))
        try:
            resp = self._call(
                watch=True,
                resource_version=self.resource_version or None,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_s,
                _request_timeout=(s.connect_timeout_s, timeout_s + s.read_margin_s),
            )
        except ApiException as exc:
            if exc.status == 410:
                raise _Relist("gone", f"resourceVersion {self.resource_version} is too old (410)") from exc
            if _too_large(exc):
                raise _Relist("too_large", "resourceVersion is ahead of the server") from exc
            raise _http_failure("watch", exc) from exc
        except _TRANSPORT_ERRORS as exc:
            raise _transport_failure("watch", exc) from exc
        with self._response_lock:
            self._response = resp
        opened = self._clock()
        clean = False
        try:
            if self._stopping.is_set():
                raise _Stopped
            lines = self._stream(resp)
            clean = True
        except _TRANSPORT_ERRORS as exc:
            if self._stopping.is_set():
                raise _Stopped from exc
            f = _transport_failure("watch", exc)
            self._metrics.watch_restarts.labels(self.kind.value, f.reason).inc()
            raise f from exc
        except _Failure as f:
            self._metrics.watch_restarts.labels(self.kind.value, "error").inc()
            raise f
        finally:
            with self._response_lock:
                self._response = None
            _release(resp, clean)
        if self._stopping.is_set():
            raise _Stopped
        self._metrics.watch_restarts.labels(self.kind.value, "closed").inc()
        if not lines and self._clock() - opened < 1.0:
            # client-go's "very short watch": a server that closes every watch at once must not
            # be hammered in a tight loop.
            raise _Failure("watch", "closed_early", "the server closed the watch at once, without any event")
        self._recovered("watch")

    def _stream(self, resp: Any) -> int:
        """Read the stream to its end; returns how many lines it carried."""
        buf = b""
        count = 0
        for chunk in resp.stream(65536, decode_content=True):
            lines = (buf + chunk).split(b"\n")
            buf = lines.pop()
            batch: list[Event] = []
            for line in lines:
                if line.strip():
                    count += 1
                    self._handle_line(line, batch)
            if lines:
                # Before the delivery: whoever sees these events applied also sees the recovery logged.
                self._recovered("watch")
            self._deliver(batch)
        return count

    def _handle_line(self, line: bytes, batch: list[Event]) -> None:
        try:
            ev = decode(line)
        except ValueError:
            ev = None
        typ = ev.get("type") if isinstance(ev, dict) else None
        obj = ev.get("object") if isinstance(ev, dict) else None
        if typ not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR") or not isinstance(obj, dict):
            self._deliver(batch)  # what came before the bad line is good
            batch.clear()
            self._metrics.watch_events.labels(self.kind.value, "other").inc()
            self._metrics.api_errors.labels(self.kind.value, "watch", "decode").inc()
            raise _Relist("decode", f"unreadable watch event {printable(line, 120)}")
        self._metrics.watch_events.labels(self.kind.value, typ).inc()
        rv = self._rv_of(obj)
        if typ == "BOOKMARK":
            if rv:
                self.resource_version = rv
            return
        if typ == "ERROR":
            code = obj.get("code")
            message = printable(obj.get("message", ""), 200)
            self._deliver(batch)
            batch.clear()
            if code == 410:
                raise _Relist("gone", f"watch expired: {message}")
            causes = (
                (obj.get("details") or {}).get("causes") if isinstance(obj.get("details"), dict) else None
            )
            if code == 504 and any(
                isinstance(c, dict) and c.get("reason") == "ResourceVersionTooLarge" for c in causes or ()
            ):
                raise _Relist("too_large", f"resourceVersion ahead of the server: {message}")
            raise _Failure("watch", f"http_{code}", f"the watch stream reported an error {code}: {message}")
        key = self._key(obj)
        if key is not None:
            old = self._delivered.get(key)
            if typ == "DELETED":
                if old is not None:
                    batch.append(ObjectEvent(self.kind, EventType.DELETED, key, obj))
                    self._set(key, None)
            else:
                batch.append(
                    ObjectEvent(self.kind, EventType.ADDED if old is None else EventType.MODIFIED, key, obj)
                )
                self._set(key, obj)
        if rv:
            self.resource_version = rv
