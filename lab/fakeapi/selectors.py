"""Label and field selectors as kube-apiserver parses and applies them.

Label selectors follow apimachinery's `labels.Parse` grammar: comma-separated requirements, each
one of `key`, `!key`, `key=value`, `key==value`, `key!=value`, `key in (a,b)`, `key notin (a,b)`.
As upstream, `!=` and `notin` also match objects that lack the key. Field selectors are
`path=value`, `path==value` or `path!=value` terms joined by commas; each resource type accepts
only the fields kube-apiserver indexes for it (here `metadata.name` and `metadata.namespace`), and
any other field is a 400 "field label not supported", as upstream answers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Obj = Mapping[str, Any]


class SelectorError(ValueError):
    """The selector does not parse; the server answers 400 BadRequest with this message."""


_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_EXISTS = re.compile(rf"^(?P<neg>!?)\s*(?P<key>{_KEY})$")
_EQUALITY = re.compile(rf"^(?P<key>{_KEY})\s*(?P<op>==|!=|=)\s*(?P<value>{_VALUE})$")
_SET = re.compile(rf"^(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # exists, !exists, =, !=, in, notin
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, Any]) -> bool:
        has = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return has
        if self.op == "!exists":
            return not has
        if self.op in ("=", "in"):
            return has and value in self.values
        return not has or value not in self.values  # != and notin


def _split_terms(text: str) -> list[str]:
    """Top-level comma split: commas inside `in (...)` value lists do not separate terms."""
    terms: list[str] = []
    depth = 0
    current = ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    terms.append(current)
    return [t.strip() for t in terms]


def parse_label_selector(text: str) -> tuple[Requirement, ...]:
    if not text.strip():
        return ()
    reqs: list[Requirement] = []
    for term in _split_terms(text):
        if m := _EXISTS.match(term):
            reqs.append(Requirement(m["key"], "!exists" if m["neg"] else "exists"))
        elif m := _EQUALITY.match(term):
            op = "!=" if m["op"] == "!=" else "="
            reqs.append(Requirement(m["key"], op, frozenset({m["value"]})))
        elif m := _SET.match(term):
            values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
            reqs.append(Requirement(m["key"], m["op"], values))
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")
    return tuple(reqs)


@dataclass(frozen=True)
class FieldTerm:
    path: str
    value: str
    negate: bool


def parse_field_selector(text: str, supported: frozenset[str]) -> tuple[FieldTerm, ...]:
    if not text.strip():
        return ()
    terms: list[FieldTerm] = []
    for raw in text.split(","):
        m = re.match(r"^\s*([A-Za-z0-9.]+)\s*(==|!=|=)\s*(.*?)\s*$", raw)
        if m is None:
            raise SelectorError(f"invalid selector: {raw!r}; can't understand {raw!r}")
        path, op, value = m.groups()
        if path not in supported:
            raise SelectorError(f'field label not supported: "{path}"')
        terms.append(FieldTerm(path, value, op == "!="))
    return tuple(terms)


def _field_value(obj: Obj, path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, Mapping) else None
    return "" if cur is None else str(cur)


def _labels(obj: Obj) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    return labels if isinstance(labels, Mapping) else {}


@dataclass(frozen=True)
class Selector:
    labels: tuple[Requirement, ...] = ()
    fields: tuple[FieldTerm, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.labels and not self.fields

    def matches(self, obj: Obj) -> bool:
        if self.labels:
            labels = _labels(obj)
            if not all(r.matches(labels) for r in self.labels):
                return False
        return all((_field_value(obj, t.path) == t.value) != t.negate for t in self.fields)


def build_selector(label_text: str, field_text: str, supported_fields: frozenset[str]) -> Selector:
    return Selector(parse_label_selector(label_text), parse_field_selector(field_text, supported_fields))
