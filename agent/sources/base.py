"""What every source of Kubernetes objects hands the agent: object events, and "synced" marks.

A source (the YAML file, the API server) turns whatever it reads into a stream of events:

* `ObjectEvent(kind, type, key, obj)`: one object was added, changed or deleted. `key` is
  `namespace/name` (`name` for cluster-scoped kinds: Node). `obj` is the object as plain JSON data
  (dicts, lists, strings, numbers); for DELETED, what the source still knows of it: the whole
  last state (the file source, a watch's DELETED) or only its identity and last resourceVersion
  (the API source's relist, which keeps versions, not objects).
* `Synced(kind)`: every object of `kind` that exists has been delivered (the initial list, or a
  relist after `410 Gone` or a file re-read, is complete). A source that relists diffs the new list
  against what it delivered before and sends ADDED / MODIFIED / DELETED for the differences, so
  downstream never needs a "replace everything" operation and nothing is flushed.

The agent's first-sync gate waits for a `Synced` of every kind the source reports (`kinds`):
nothing already programmed is pruned before that.

Sources call `sink(events)` from their own thread, in order, with small batches; the sink only
enqueues. Sources never raise out of their thread: a failure is logged, counted and retried.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

# `dict` first, here and in the other readers of decoded JSON: a dict is what the decoder makes,
# and isinstance against the Mapping ABC alone runs a Python-level __instancecheck__ (380,000
# calls for a list of 10,000 Services and their slices). A constant: `dict | Mapping` written in
# the call builds the union at each call, which took four times the check itself.
JSON_MAP_TYPES = (dict, Mapping)


class Kind(StrEnum):
    SERVICE = "Service"
    ENDPOINT_SLICE = "EndpointSlice"
    NODE = "Node"


class EventType(StrEnum):
    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


@dataclass(frozen=True)
class ObjectEvent:
    kind: Kind
    type: EventType
    key: str  # "namespace/name"; "name" for Node
    obj: Mapping[str, Any]
    # The model's record of `obj` that the sink's kept records gave for its uid and
    # resourceVersion (agent.kube.reflector, a restart's first list); `obj` then holds only its
    # kind, apiVersion and metadata's name, namespace, uid and resourceVersion.
    kept: object = None


@dataclass(frozen=True)
class Synced:
    """Every object of `kind` has been delivered (initial list or relist complete)."""

    kind: Kind
    version: str = ""  # the source's version of what was listed (file hash, resourceVersion)


Event = ObjectEvent | Synced
Sink = Callable[[Sequence[Event]], None]


class Source(Protocol):
    """A source of object events. Construction has no side effects; `start` begins delivering."""

    @property
    def kinds(self) -> frozenset[Kind]:
        """The kinds this source reports `Synced` for (the first-sync gate waits for all)."""

    def start(self, sink: Sink) -> None: ...

    def stop(self) -> None: ...


def object_key(kind: Kind, obj: object) -> str:
    """`namespace/name` of a namespaced object, `name` of a Node; tolerant of malformed metadata
    (anything unusable reads as "default" and "")."""
    meta = obj.get("metadata") if isinstance(obj, JSON_MAP_TYPES) else None
    if not isinstance(meta, JSON_MAP_TYPES):
        meta = {}
    name = meta.get("name")
    name = name if isinstance(name, str) else ""
    if kind is Kind.NODE:
        return name
    namespace = meta.get("namespace")
    namespace = namespace if isinstance(namespace, str) and namespace else "default"
    return f"{namespace}/{name}"
