"""The fake API server's storage: etcd-like versioned objects plus a watch-cache window per kind.

Two mechanisms of the real control plane, kept apart because they expire independently:

* **MVCC history (etcd).** Every write bumps one global revision (`resourceVersion`) shared by all
  kinds. Each object key keeps its versions, so a paginated list reads one consistent snapshot:
  every page of a list is served at the revision of its first page, as kube-apiserver promises
  for `limit`/`continue`. `compact()` drops versions older than the current revision (etcd
  compaction); a continue token from before it then gets `410 Expired`.
* **Watch window (the apiserver's watch cache).** Each kind keeps its last `capacity` events. A
  watch from a resourceVersion older than the window gets `410` ("too old resource version"); the
  window of a kind only moves with that kind's own writes, as the per-resource cacher does.

Objects are stored as their JSON bytes too (item form without `kind`/`apiVersion`, as list items
come from kube-apiserver, and full form for watch events), so listing 10,000 objects costs a
join, not a re-serialisation: the server must not be the bottleneck of the client's measurement.
"""

from __future__ import annotations

import bisect
import json
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from lab.fakeapi.selectors import Selector

Obj = dict[str, Any]


@dataclass(frozen=True)
class ResourceType:
    kind: str
    group_version: str  # "v1" or "discovery.k8s.io/v1"
    plural: str
    namespaced: bool
    fields: frozenset[str] = frozenset({"metadata.name", "metadata.namespace"})

    @property
    def list_kind(self) -> str:
        return self.kind + "List"


# pkg/registry/core/service/strategy.go `SelectableFields`: kube-proxy selects on spec.clusterIP.
SERVICES = ResourceType(
    "Service",
    "v1",
    "services",
    True,
    frozenset({"metadata.name", "metadata.namespace", "spec.clusterIP", "spec.type"}),
)
ENDPOINT_SLICES = ResourceType("EndpointSlice", "discovery.k8s.io/v1", "endpointslices", True)
NODES = ResourceType("Node", "v1", "nodes", False, frozenset({"metadata.name", "spec.unschedulable"}))
EVENTS_V1 = ResourceType("Event", "events.k8s.io/v1", "events", True)
CORE_EVENTS = ResourceType("Event", "v1", "events", True)
TYPES = (SERVICES, ENDPOINT_SLICES, NODES, EVENTS_V1, CORE_EVENTS)
BY_PATH = {(t.group_version, t.plural): t for t in TYPES}


def type_of(obj: Mapping[str, Any]) -> ResourceType:
    kind, api_version = obj.get("kind"), obj.get("apiVersion")
    for t in TYPES:
        if t.kind == kind and t.group_version == api_version:
            return t
    for t in (SERVICES, ENDPOINT_SLICES, NODES):  # apiVersion left out by a test: the usual one
        if t.kind == kind and api_version is None:
            return t
    raise ValueError(f"unsupported kind/apiVersion {kind!r}/{api_version!r}")


class StoreError(Exception):
    """A request the store refuses; `code`/`reason` become the Status the server answers."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = dict(details or {})


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _copy(obj: Mapping[str, Any]) -> Obj:
    """A deep copy that also proves the object is JSON (what the API would store)."""
    out: Obj = json.loads(json.dumps(obj))
    return out


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Version:
    """One stored version of an object; `obj is None` is a deletion (tombstone)."""

    rv: int
    obj: Obj | None
    item_json: bytes = b""  # without kind/apiVersion, as list items are served
    full_json: bytes = b""


def _version(rv: int, obj: Obj | None) -> Version:
    if obj is None:
        return Version(rv, None)
    item = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
    return Version(rv, obj, _dumps(item), _dumps(obj))


@dataclass
class WatchEvent:
    """A write as the watch cache keeps it: the new object and the one it replaced."""

    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    namespace: str
    new: Obj | None
    new_json: bytes
    old: Obj | None

    def old_at_rv_json(self) -> bytes:
        """The previous object with this event's resourceVersion: what a DELETED carries upstream
        (also when a MODIFIED moves an object out of a watcher's selector)."""
        assert self.old is not None
        old = dict(self.old)
        old["metadata"] = {**old.get("metadata", {}), "resourceVersion": str(self.rv)}
        return _dumps(old)


@dataclass
class Window:
    """A kind's watch-cache window: events in revision order, the oldest ones trimmed."""

    capacity: int
    events: list[WatchEvent] = field(default_factory=list)
    base_seq: int = 0  # sequence number of events[0]
    oldest_valid_rv: int = 0  # a watch from an older resourceVersion gets 410

    def append(self, ev: WatchEvent) -> None:
        self.events.append(ev)
        over = len(self.events) - self.capacity
        if over > 0 and (over >= 64 or len(self.events) < 1024):
            self.oldest_valid_rv = self.events[over - 1].rv
            del self.events[:over]
            self.base_seq += over

    def clear(self, rv: int) -> None:
        self.base_seq += len(self.events)
        self.events.clear()
        self.oldest_valid_rv = rv

    @property
    def end_seq(self) -> int:
        return self.base_seq + len(self.events)

    def seq_after(self, rv: int) -> int:
        """Sequence number of the first event newer than `rv`."""
        return self.base_seq + bisect.bisect_right(self.events, rv, key=lambda e: e.rv)

    def since(self, seq: int) -> list[WatchEvent]:
        return self.events[max(0, seq - self.base_seq) :]


@dataclass(frozen=True)
class ListPage:
    items: list[bytes]
    rv: int
    continue_token: str
    remaining: int | None


def key_of(t: ResourceType, namespace: str, name: str) -> str:
    return f"{namespace}/{name}" if t.namespaced else name


class Store:
    """All objects of the fake cluster; every method is thread-safe (one condition variable)."""

    def __init__(self, watch_capacity: int = 1000) -> None:
        self.cond = threading.Condition()
        self.rv = 1
        self.compacted_rv = 0
        self._history: dict[ResourceType, dict[str, list[Version]]] = {t: {} for t in TYPES}
        self._keys: dict[ResourceType, list[str]] = {t: [] for t in TYPES}
        self._windows = {t: Window(watch_capacity) for t in TYPES}

    # ---- writes ------------------------------------------------------------------------------

    def _meta(self, obj: Mapping[str, Any]) -> tuple[str, str]:
        meta = obj.get("metadata")
        if not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str) or not meta["name"]:
            raise StoreError(422, "Invalid", "metadata.name: Required value: name is required")
        ns = meta.get("namespace", "")
        return (ns if isinstance(ns, str) else ""), meta["name"]

    def _write(self, t: ResourceType, key: str, namespace: str, obj: Obj | None) -> Version:
        self.rv += 1
        history = self._history[t].setdefault(key, [])
        old = history[-1].obj if history else None
        if obj is not None:
            obj["metadata"]["resourceVersion"] = str(self.rv)
        version = _version(self.rv, obj)
        if not history:
            bisect.insort(self._keys[t], key)
        history.append(version)
        if obj is None:
            ev = WatchEvent(self.rv, "DELETED", namespace, None, b"", old)
        else:
            ev = WatchEvent(
                self.rv, "ADDED" if old is None else "MODIFIED", namespace, obj, version.full_json, old
            )
        self._windows[t].append(ev)
        self.cond.notify_all()
        return version

    def create(self, obj: Mapping[str, Any]) -> Obj:
        t = type_of(obj)
        fresh: Obj = _copy(obj)
        fresh.setdefault("kind", t.kind)
        fresh.setdefault("apiVersion", t.group_version)
        namespace, name = self._meta(fresh)
        if t.namespaced:
            namespace = namespace or "default"
            fresh["metadata"]["namespace"] = namespace
        else:
            fresh["metadata"].pop("namespace", None)
            namespace = ""
        key = key_of(t, namespace, name)
        with self.cond:
            current = self._current(t, key)
            if current is not None:
                raise StoreError(
                    409,
                    "AlreadyExists",
                    f'{t.plural} "{name}" already exists',
                    {"name": name, "kind": t.plural},
                )
            meta = fresh["metadata"]
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta.pop("resourceVersion", None)
            self._write(t, key, namespace, fresh)
            return _copy(fresh)

    def update(self, obj: Mapping[str, Any]) -> Obj:
        """Replace an object (PUT semantics); a resourceVersion in `obj` must match (409 if not)."""
        t = type_of(obj)
        fresh: Obj = _copy(obj)
        fresh.setdefault("kind", t.kind)
        fresh.setdefault("apiVersion", t.group_version)
        namespace, name = self._meta(fresh)
        namespace = (namespace or "default") if t.namespaced else ""
        key = key_of(t, namespace, name)
        with self.cond:
            current = self._current(t, key)
            if current is None:
                raise StoreError(404, "NotFound", f'{t.plural} "{name}" not found', {"name": name})
            meta = fresh["metadata"]
            want = meta.get("resourceVersion")
            if want and want != current["metadata"]["resourceVersion"]:
                raise StoreError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {t.plural} "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                )
            meta["uid"] = current["metadata"]["uid"]
            meta["creationTimestamp"] = current["metadata"]["creationTimestamp"]
            if t.namespaced:
                meta["namespace"] = namespace
            self._write(t, key, namespace, fresh)
            return _copy(fresh)

    def delete(self, t: ResourceType, namespace: str, name: str) -> Obj:
        namespace = (namespace or "default") if t.namespaced else ""
        key = key_of(t, namespace, name)
        with self.cond:
            current = self._current(t, key)
            if current is None:
                raise StoreError(404, "NotFound", f'{t.plural} "{name}" not found', {"name": name})
            self._write(t, key, namespace, None)
            gone = _copy(current)
            gone["metadata"]["resourceVersion"] = str(self.rv)
            return gone

    # ---- reads -------------------------------------------------------------------------------

    def _current(self, t: ResourceType, key: str) -> Obj | None:
        history = self._history[t].get(key)
        return history[-1].obj if history else None

    def get(self, t: ResourceType, namespace: str, name: str) -> Obj | None:
        with self.cond:
            key = key_of(t, (namespace or "default") if t.namespaced else "", name)
            obj = self._current(t, key)
            return None if obj is None else _copy(obj)

    def objects(self, t: ResourceType) -> list[Obj]:
        with self.cond:
            out = []
            for key in self._keys[t]:
                obj = self._current(t, key)
                if obj is not None:
                    out.append(_copy(obj))
            return out

    @staticmethod
    def _at(history: list[Version], rv: int) -> Version | None:
        for v in reversed(history):
            if v.rv <= rv:
                return v
        return None

    def list_page(
        self,
        t: ResourceType,
        namespace: str,
        match: Selector,
        limit: int,
        start_key: str,
        at_rv: int | None,
    ) -> ListPage:
        """One page of a list at revision `at_rv` (None: now), keys from `start_key` on."""
        with self.cond:
            rv = self.rv if at_rv is None else at_rv
            if at_rv is not None and at_rv < self.compacted_rv:
                raise StoreError(410, "Expired", "too old resource version")
            keys = self._keys[t]
            prefix = f"{namespace}/" if namespace else ""
            i = bisect.bisect_left(keys, max(start_key, prefix))
            items: list[bytes] = []
            next_key = ""
            while i < len(keys):
                key = keys[i]
                if prefix and not key.startswith(prefix):
                    break
                i += 1
                v = self._at(self._history[t][key], rv)
                if v is None or v.obj is None or not match.matches(v.obj):
                    continue
                if limit and len(items) == limit:
                    next_key = key
                    break
                items.append(v.item_json)
            remaining = None
            if next_key and match.empty:
                remaining = sum(
                    1
                    for k in keys[i - 1 :]
                    if (not prefix or k.startswith(prefix))
                    and (v := self._at(self._history[t][k], rv)) is not None
                    and v.obj is not None
                )
            token = encode_continue(rv, next_key) if next_key else ""
            return ListPage(items, rv, token, remaining)

    # ---- watch -------------------------------------------------------------------------------

    def window(self, t: ResourceType) -> Window:
        return self._windows[t]

    def current_objects_json(
        self, t: ResourceType, namespace: str, match: Selector
    ) -> list[tuple[Obj, bytes]]:
        """Every live object (for a watch without resourceVersion: synthetic ADDED events)."""
        out = []
        for key in self._keys[t]:
            history = self._history[t][key]
            v = history[-1]
            if v.obj is None or (namespace and v.obj["metadata"].get("namespace") != namespace):
                continue
            if match.matches(v.obj):
                out.append((v.obj, v.full_json))
        return out

    # ---- history control ---------------------------------------------------------------------

    def compact(self) -> None:
        """etcd compaction at a new revision: older versions and tombstones go.

        The revision is bumped first, as the control plane's own writes (leases, other kinds)
        would have, so every snapshot handed out before, continue tokens included, is older.
        """
        with self.cond:
            self.rv += 1
            self.compacted_rv = self.rv
            for t in TYPES:
                history = self._history[t]
                for key in list(history):
                    kept = history[key][-1:]
                    if kept and kept[0].obj is None:
                        del history[key]
                        self._keys[t].remove(key)
                    else:
                        history[key] = kept

    def drop_watch_history(self) -> None:
        """Empty every kind's watch window: a watch from any older resourceVersion gets 410."""
        with self.cond:
            for w in self._windows.values():
                w.clear(self.rv)
            self.cond.notify_all()


def encode_continue(rv: int, start: str) -> str:
    """kube-apiserver's continue token: base64 of {"v":"meta.k8s.io/v1","rv":N,"start":KEY}."""
    import base64

    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, str]:
    import base64

    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        rv, start = data["rv"], data["start"]
        if data.get("v") != "meta.k8s.io/v1" or not isinstance(rv, int) or not isinstance(start, str):
            raise ValueError
        return rv, start
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(400, "BadRequest", f"continue key is not valid: {token!r}") from exc
