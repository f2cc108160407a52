"""A services file's documents -> the Services and EndpointSlices it holds, by key, each once.

What counts as a file that may be applied. A file is the whole desired set of objects: applying one
that was cut short (an editor's half-saved buffer, `kubectl get -o yaml > file` caught mid-write)
deletes every object it lost. So each top-level document must be complete:

* a List: a mapping whose `kind` is `List` or ends in `List` (`ServiceList`) and whose `items` is a
  list. kubectl prints `kind: List` after `items`, so a cut `kubectl get -o yaml` output lacks it;
  an intentionally empty set is `kind: List` with `items: []`;
* or an object: a mapping with a `kind`, an `apiVersion` and a `metadata` mapping.

Null documents (a trailing `---`) are skipped; a file with no other document is refused as empty.
Anything else is `Refused` and the caller keeps the last good content. Inside a List, items are
taken as they come: an item that is not a Service or an EndpointSlice is ignored (and named for
the log), a malformed Service is the model's business (skipped with a Problem, the others kept).

Two objects of the same kind and `namespace/name`: the first one in the file wins, always (a
deterministic outcome whatever the order of later edits), and both positions are reported
(`document 1, items[3]`) so the operator finds the copy to remove.

Pure: documents in, `Content` out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.sources.base import Kind, object_key
from agent.sources.decode import Reason, Refused

Obj = Mapping[str, Any]

# The kinds a services file feeds to the proxy, in the order their events are delivered.
KINDS: tuple[Kind, ...] = (Kind.SERVICE, Kind.ENDPOINT_SLICE)
_BY_NAME = {k.value: k for k in KINDS}

EMPTY_HINT = "an intentionally empty set is `kind: List` with `items: []`"


@dataclass(frozen=True)
class Duplicate:
    """A second object with the key of an earlier one: `dropped` is ignored, `kept` is used."""

    kind: Kind
    key: str
    kept: str  # position in the file: "document 1, items[3]"
    dropped: str


@dataclass(frozen=True)
class Content:
    """The objects of one file content, by kind then key, in file order."""

    objects: Mapping[Kind, Mapping[str, Obj]]
    duplicates: tuple[Duplicate, ...] = ()
    ignored: tuple[str, ...] = ()  # what was neither a Service nor an EndpointSlice ("kind 'Pod'")

    def of(self, kind: Kind) -> Mapping[str, Obj]:
        return self.objects.get(kind, {})


def is_list(doc: Obj) -> bool:
    kind = doc.get("kind")
    return isinstance(kind, str) and (kind == "List" or kind.endswith("List"))


def check_documents(docs: Iterable[Any]) -> list[tuple[int, Obj]]:
    """(number from 1, document) of the non-null top-level documents, each a complete List or
    object; raises Refused."""
    out: list[tuple[int, Obj]] = []
    for number, doc in enumerate(docs, start=1):
        if doc is None:
            continue
        where = f"document {number}"
        if not isinstance(doc, Mapping):
            raise Refused(
                Reason.SHAPE, f"{where} is a {_json_type(doc)}, not a List or an object with a kind"
            )
        kind = doc.get("kind")
        if not isinstance(kind, str) or not kind:
            raise Refused(
                Reason.SHAPE,
                f"{where} has no kind: it is neither a complete List nor a complete object (a file cut "
                "short? kubectl's List output ends with `kind: List`)",
            )
        if is_list(doc):
            if not isinstance(doc.get("items"), list):
                raise Refused(
                    Reason.SHAPE,
                    f"{where} (kind {kind}) has no items list: not a complete List ({EMPTY_HINT})",
                )
        else:
            missing = [
                field
                for field, ok in (
                    ("apiVersion", isinstance(doc.get("apiVersion"), str) and doc.get("apiVersion")),
                    ("metadata", isinstance(doc.get("metadata"), Mapping)),
                )
                if not ok
            ]
            if missing:
                raise Refused(
                    Reason.SHAPE,
                    f"{where} (kind {kind}) has no {' and no '.join(missing)}: not a complete object "
                    "(a file cut short?)",
                )
        out.append((number, doc))
    if not out:
        raise Refused(Reason.EMPTY, f"the file holds no document (empty, or cut short); {EMPTY_HINT}")
    return out


def collect(docs: Iterable[Any]) -> Content:
    """Check the documents (raises Refused) and sort their objects by kind and key, first one winning."""
    objects: dict[Kind, dict[str, Obj]] = {k: {} for k in KINDS}
    positions: dict[tuple[Kind, str], str] = {}
    duplicates: list[Duplicate] = []
    ignored: list[str] = []
    # (object, position) pairs still to visit, in file order: Lists are flattened in place.
    todo: list[tuple[Any, str]] = [(doc, f"document {n}") for n, doc in check_documents(docs)]
    todo.reverse()
    while todo:
        obj, where = todo.pop()
        if obj is None:
            continue
        if not isinstance(obj, Mapping):
            ignored.append(f"a {_json_type(obj)} at {where}")
            continue
        if is_list(obj) and isinstance(obj.get("items"), list):
            items = obj["items"]
            todo.extend((items[i], f"{where}, items[{i}]") for i in reversed(range(len(items))))
            continue
        name = obj.get("kind")
        kind = _BY_NAME.get(name) if isinstance(name, str) else None
        if kind is None:
            ignored.append(f"kind {obj.get('kind')!r}")
            continue
        key = object_key(kind, obj)
        first = positions.get((kind, key))
        if first is not None:
            duplicates.append(Duplicate(kind, key, first, where))
            continue
        positions[(kind, key)] = where
        objects[kind][key] = obj
    return Content(objects, tuple(duplicates), tuple(ignored))


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__
