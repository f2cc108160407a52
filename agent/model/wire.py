"""A list item decoded into only what the parsers read (msgspec Structs), for a list's Services and slices.

A list of 10,000 Services and their EndpointSlices is 43 MB of JSON, most of it fields the proxy
never reads (managedFields, ownerReferences, each endpoint's targetRef, ...). orjson decoded every
item whole into dicts; here msgspec decodes each item into Structs that declare only the fields
parse.py and the daemon read (in C: unknown fields are skipped without building anything), and
`item` hands the parsers the same mapping shape as before with the unread fields left out:

* a Service: `metadata` (name, namespace, uid, resourceVersion, labels, creationTimestamp),
  `spec` and `status` as decoded JSON, whole (parse.py reads most of them, with checks of its own);
* an EndpointSlice: `metadata` as a Service's plus the last-change-trigger-time annotation,
  `addressType`, `ports` as a tuple of `WirePort` Structs (hashable: parse.py checks each distinct
  tuple once, as dicts, and reuses the result), and `endpoints` as `WireEndpoint` Structs, whose
  fields msgspec has already checked for type: parse.py reads the common endpoint from them
  without its per-field checks, and turns any other into the dict it validates in full (`as_dict`).

The outcome is the orjson path's, malformed objects included: a field where the Structs expect
another type (a string for `ready`, a number for an address, `metadata: null`, ...) fails the
typed decode, and that item alone is decoded whole with orjson as before, so the parser reports
it with the same message. So is an item without a resourceVersion (the reflector then tells its
versions apart by a digest of the whole object). Absent and null stay apart (`UNSET` and None),
as the dicts kept them. (One exception: an integer beyond 64 bits, which no API server sends,
decodes as an int where orjson made a float: the parser refuses it either way, with another
message: "an integer of 67 bits is out of range" from the typed path, "must be an integer, not
1e+20" from the whole one.)

Only a list's items take this path; a watch event is decoded whole (reflector.py), one at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import orjson
from msgspec import UNSET, UnsetType

TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"

Obj = dict[str, Any]


class _Meta(msgspec.Struct):
    name: Any = UNSET
    namespace: Any = UNSET
    uid: Any = UNSET
    resourceVersion: Any = UNSET
    labels: Any = UNSET
    creationTimestamp: Any = UNSET

    def as_dict(self) -> Obj:
        out: Obj = {}
        for key in _META_FIELDS:
            value = getattr(self, key)
            if value is not UNSET:
                out[key] = value
        return out


_META_FIELDS = _Meta.__struct_fields__


class _Annotations(msgspec.Struct):
    trigger: Any = msgspec.field(default=UNSET, name=TRIGGER_TIME_ANNOTATION)


class _SliceMeta(_Meta):
    annotations: _Annotations | UnsetType = UNSET

    def as_dict(self) -> Obj:
        out = super().as_dict()
        if self.annotations is not UNSET:
            trigger = self.annotations.trigger
            out["annotations"] = {} if trigger is UNSET else {TRIGGER_TIME_ANNOTATION: trigger}
        return out


class _Service(msgspec.Struct):
    metadata: _Meta
    spec: Any = UNSET
    status: Any = UNSET


class Conditions(msgspec.Struct):
    ready: bool | UnsetType | None = UNSET
    serving: bool | UnsetType | None = UNSET
    terminating: bool | UnsetType | None = UNSET


class WireEndpoint(msgspec.Struct):
    """One endpoint of a slice, its types checked by the decode (parse.py reads it)."""

    addresses: list[str] | UnsetType | None = UNSET
    conditions: Conditions | UnsetType | None = UNSET
    nodeName: str | UnsetType | None = UNSET
    zone: str | UnsetType | None = UNSET
    hostname: Any = UNSET
    hints: Any = UNSET

    def as_dict(self) -> Obj:
        """The endpoint as the orjson path decoded it, less the fields nobody reads."""
        out: Obj = {}
        for key in _ENDPOINT_FIELDS:
            value = getattr(self, key)
            if value is UNSET:
                continue
            if isinstance(value, Conditions):
                value = {k: v for k in _CONDITION_FIELDS if (v := getattr(value, k)) is not UNSET}
            out[key] = value
        return out


_ENDPOINT_FIELDS = WireEndpoint.__struct_fields__
_CONDITION_FIELDS = Conditions.__struct_fields__


class WirePort(msgspec.Struct, frozen=True):
    """One port of a slice, its types checked by the decode. Frozen, so hashable: parse.py checks each
    distinct short tuple of them once, for the slices that share one. Typed, so
    equal means the same JSON (a `true` or `80.0` for `port` fails the typed decode: orjson's
    path refuses it as before, where a memo keyed by Any would take it for the valid 1 or 80)."""

    name: str | UnsetType | None = UNSET
    port: int | UnsetType | None = UNSET
    protocol: str | UnsetType | None = UNSET
    appProtocol: str | UnsetType | None = UNSET

    def as_dict(self) -> Obj:
        """The port as the orjson path decoded it, less the fields nobody reads."""
        return {k: v for k in _PORT_FIELDS if (v := getattr(self, k)) is not UNSET}


_PORT_FIELDS = WirePort.__struct_fields__


class _Slice(msgspec.Struct):
    metadata: _SliceMeta
    addressType: Any = UNSET
    endpoints: list[WireEndpoint] | UnsetType | None = UNSET
    ports: tuple[WirePort, ...] | UnsetType | None = UNSET


_SERVICE = msgspec.json.Decoder(_Service)
_SLICE = msgspec.json.Decoder(_Slice)


def whole(raw: bytes | memoryview | msgspec.Raw) -> Any:
    """The item decoded whole into dicts (orjson); None if it is not JSON."""
    try:
        return orjson.loads(memoryview(raw) if isinstance(raw, msgspec.Raw) else raw)
    except orjson.JSONDecodeError:
        return None


def _versioned(meta: _Meta) -> bool:
    version = meta.resourceVersion
    return isinstance(version, str) and bool(version)


def service(raw: bytes | memoryview | msgspec.Raw) -> Any:
    """A list's Service item as parse.py reads it (see the module doc)."""
    try:
        svc = _SERVICE.decode(raw)
    # msgspec's own errors (ValueErrors only from msgspec 0.21), invalid UTF-8, deep nesting
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return whole(raw)
    if not _versioned(svc.metadata):
        return whole(raw)
    out: Obj = {"metadata": svc.metadata.as_dict()}
    if svc.spec is not UNSET:
        out["spec"] = svc.spec
    if svc.status is not UNSET:
        out["status"] = svc.status
    return out


def endpoint_slice(raw: bytes | memoryview | msgspec.Raw) -> Any:
    """A list's EndpointSlice item as parse.py reads it: its endpoints as `WireEndpoint`s."""
    try:
        eps = _SLICE.decode(raw)
    # msgspec's own errors (ValueErrors only from msgspec 0.21), invalid UTF-8, deep nesting
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return whole(raw)
    if not _versioned(eps.metadata):
        return whole(raw)
    out: Obj = {"metadata": eps.metadata.as_dict()}
    if eps.addressType is not UNSET:
        out["addressType"] = eps.addressType
    if eps.endpoints is not UNSET:
        out["endpoints"] = eps.endpoints
    if eps.ports is not UNSET:
        out["ports"] = eps.ports
    return out


def decoder(kind: str) -> Callable[[msgspec.Raw], Any]:
    """How a list item of `kind` (Kind.value) is decoded: typed for the parsed kinds, whole otherwise."""
    return {"Service": service, "EndpointSlice": endpoint_slice}.get(kind, whole)
