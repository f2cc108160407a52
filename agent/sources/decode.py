"""The bytes of a services file -> JSON documents, refusing whatever could hang, exhaust or kill the reader.

Kubernetes objects are JSON: mappings with string keys, lists, strings, numbers, booleans and null.
This module reads YAML (and JSON, which is YAML too) into exactly those types, and refuses, with a
`Refused` that says why, every input that PyYAML's own loaders turned into a failure seen on a live
agent:

* an alias (`*name`): the 29-byte `&a {kind: List, items: [*a]}` built a list that contains itself
  (the watcher walked it forever at 100% CPU) and a 588-byte "billion laughs" file grew past 1 GB
  once walked. kubectl never writes aliases, so every alias is refused, not only expanding ones;
* nesting deeper than MAX_DEPTH: libyaml's C composer recursed until it overflowed the C stack
  (a segfault, not an exception, at 100,000 levels of `[`), and `json.loads` raised RecursionError.
  Newer libyaml stops at its own limit (1,000 levels) with a scanner error: that is refused as
  depth too, so the reason does not depend on the parser's version;
* a timestamp-looking plain scalar (`x-date: 2001-02-30` raised ValueError in PyYAML's timestamp
  constructor): timestamps stay strings, as sigs.k8s.io/yaml (go-yaml v2) leaves them when it
  decodes into an untyped value;
* a number literal longer than MAX_NUMBER_CHARS (Python refuses to convert ints over 4,300 digits
  and spends quadratic time below that; no Kubernetes field holds more than a 64-bit integer);
* a tag that is not one of JSON's types (`!!binary`, `!!set`, `!!timestamp`, local `!tags`), and a
  mapping key that is a list or mapping;
* more than `max_bytes` of input, and bytes that are not UTF-8;
* with `unique_keys=True`, a key repeated in one mapping (the agent's own configuration files, as
  kube-proxy's strict decoding refuses them; the services file keeps "the last one wins", as
  PyYAML and encoding/json do).

YAML is read from libyaml's event stream (`yaml.parse` with the C parser, a state machine with its
own heap stack, so it does not recurse) and the documents are built here, iteratively: no
composer, no constructor, no recursion, and every limit checked as the events arrive. Plain
scalars are resolved with PyYAML's YAML 1.1 rules (the ones go-yaml v2 and `kubectl apply` use:
`yes`/`no` are booleans, `0x1F` is an int) except timestamps. Mapping keys are taken as written,
strings always. It is also about three times faster than PyYAML's CSafeLoader on a 7 MB file,
because the constructor's per-node bookkeeping is gone. A file that starts with `{` or `[` is
tried with the json module first (about twenty times faster again); JSON's own nesting and number
limits are enforced the same way.

Pure: no file system, no logging. `agent/sources/content.py` checks the shape of the documents.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Any

import yaml
from yaml import events as ev
from yaml.constructor import SafeConstructor
from yaml.nodes import ScalarNode
from yaml.resolver import Resolver

# 64 MiB: about 90,000 Services of one port and 1-2 endpoints each as JSON (the benchmark's 10,000
# are 7 MB), nine times Kubernetes' documented 10,000-Service scalability threshold.
MAX_FILE_BYTES = 64 << 20
# A Service or EndpointSlice is under 10 levels deep (List > items > object > spec > ports > port);
# 100 leaves room for any other kind in the file and keeps every later walk far from Python's
# recursion limit (1,000).
MAX_DEPTH = 100
# Characters of one number literal: int64 has 19 digits; 64 allows any spelling of any real value.
MAX_NUMBER_CHARS = 64

# libyaml's C parser when PyYAML was built with it (the PyPI wheels are): the event stream then
# costs a fraction of building the objects. The pure-Python parser yields the same events.
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_TAG = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = (_TAG + t for t in ("str", "int", "float", "bool", "null"))
_MAP, _SEQ = _TAG + "map", _TAG + "seq"
_SCALAR_TAGS = frozenset({_STR, _INT, _FLOAT, _BOOL, _NULL})
# Implicit resolution of plain scalars: PyYAML's YAML 1.1 table, indexed by first character.
_IMPLICIT = Resolver.yaml_implicit_resolvers
# Used only for its int and float spelling rules (signs, `_`, 0x/0o/0b, sexagesimal); it keeps no
# state for scalars, so one instance serves every thread.
_NUMBERS = SafeConstructor()
_LONG_DIGITS = re.compile(rf"\d{{{MAX_NUMBER_CHARS - 1},}}")
# What libyaml (0.2.5 as bundled since PyYAML 6.0.4) says when its scanner's flow or block nesting
# passes its own limit ("while increasing flow level exceeded maximum nesting depth").
_PARSER_DEPTH = "exceeded maximum nesting depth"


class Reason(StrEnum):
    """Why a file was not applied: the `reason` label of ekp_services_file_rejected_total."""

    MISSING = "missing"  # the file does not exist (any more)
    UNREADABLE = "unreadable"  # permissions, not a regular file, an I/O error
    TOO_LARGE = "too_large"
    ENCODING = "encoding"  # not UTF-8
    SYNTAX = "syntax"  # not YAML / JSON
    ALIAS = "alias"
    DEPTH = "depth"
    NUMBER = "number"
    TAG = "tag"  # a tag or a key that JSON cannot hold
    DUPLICATE_KEY = "duplicate_key"  # only with unique_keys (configuration files, not services files)
    EMPTY = "empty"  # no document at all
    SHAPE = "shape"  # a top-level document that is not a complete List or object
    INTERNAL = "internal"  # a bug: caught by the watcher's last-resort handler


class Refused(ValueError):
    """The content cannot be applied. `reason` labels the counter; `str()` says why, for the log."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def decode(data: bytes, *, max_bytes: int = MAX_FILE_BYTES, unique_keys: bool = False) -> list[Any]:
    """The documents of a services file as JSON values (None for an empty document); raises Refused.
    `unique_keys`: a key given twice in one mapping is refused instead of the last one winning."""
    if len(data) > max_bytes:
        raise Refused(Reason.TOO_LARGE, f"{len(data)} bytes, more than the limit of {max_bytes}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise Refused(Reason.ENCODING, f"not UTF-8 (byte {exc.start}: {exc.reason})") from None
    if text.lstrip()[:1] in ("{", "["):
        # The number hooks cost a Python call per number; without a long run of digits anywhere
        # (strings included) no number can be too long, and the C decoder runs alone.
        hooks: dict[str, Any] = {}
        if _LONG_DIGITS.search(text):
            hooks = {"parse_int": _json_int, "parse_float": _json_float}
        if unique_keys:
            hooks["object_pairs_hook"] = _json_object
        try:
            doc = json.loads(text, **hooks)
        except json.JSONDecodeError:
            pass  # flow-style YAML starts with { or [ too: the YAML reader says what is wrong
        except RecursionError:
            raise Refused(Reason.DEPTH, f"JSON nested deeper than {MAX_DEPTH} levels") from None
        else:
            if _deeper_than(doc, MAX_DEPTH):
                raise Refused(Reason.DEPTH, f"JSON nested deeper than {MAX_DEPTH} levels")
            return [doc]
    return yaml_documents(text, unique_keys=unique_keys)


def _duplicate(key: str, line: str = "") -> Refused:
    return Refused(
        Reason.DUPLICATE_KEY,
        f"{line}the key {json.dumps(key)} is given twice in one mapping: remove one (which one was "
        "meant cannot be told)",
    )


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _duplicate(key)
            seen.add(key)
    return out


def _number_too_long(text: str, line: str = "") -> Refused:
    shown = text[:20] + "..." if len(text) > 20 else text
    return Refused(
        Reason.NUMBER,
        f"{line}a number of {len(text)} characters ({shown}), more than {MAX_NUMBER_CHARS}: Kubernetes "
        "numbers are 64-bit (quote it if it is meant as a string)",
    )


def _json_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise _number_too_long(text)
    return int(text)


def _json_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _number_too_long(text)
    return float(text)


def _deeper_than(root: Any, limit: int) -> bool:
    """Whether `root` nests more than `limit` containers deep; level by level, no recursion."""
    frontier = [root] if isinstance(root, dict | list) else []
    for _ in range(limit):
        deeper: list[Any] = []
        for node in frontier:
            for value in node.values() if type(node) is dict else node:
                if type(value) is dict or type(value) is list:
                    deeper.append(value)
        if not deeper:
            return False
        frontier = deeper
    return bool(frontier)


def yaml_documents(text: str, *, unique_keys: bool = False) -> list[Any]:
    """Every YAML document of `text` as JSON values, built from libyaml's events; raises Refused."""
    docs: list[Any] = []
    # Open collections, innermost last; for a mapping, the key waiting for its value (None: the
    # next scalar is a key).
    stack: list[list[Any] | dict[str, Any]] = []
    keys: list[str | None] = []
    try:
        for event in yaml.parse(text, Loader=_LOADER):
            if isinstance(event, ev.ScalarEvent):
                if stack and type(stack[-1]) is dict and keys[-1] is None:
                    _check_tag(event, _SCALAR_TAGS)
                    if unique_keys and event.value in stack[-1]:
                        raise _duplicate(event.value, _line(event))
                    keys[-1] = event.value
                else:
                    _add(docs, stack, keys, _scalar(event))
            elif isinstance(event, ev.MappingStartEvent | ev.SequenceStartEvent):
                is_map = isinstance(event, ev.MappingStartEvent)
                if stack and type(stack[-1]) is dict and keys[-1] is None:
                    raise Refused(
                        Reason.TAG,
                        f"{_line(event)}a mapping key that is a {'mapping' if is_map else 'list'}: keys of "
                        "Kubernetes objects are strings",
                    )
                _check_tag(event, frozenset({_MAP if is_map else _SEQ}))
                if len(stack) >= MAX_DEPTH:
                    raise Refused(Reason.DEPTH, f"{_line(event)}nested deeper than {MAX_DEPTH} levels")
                node: list[Any] | dict[str, Any] = {} if is_map else []
                _add(docs, stack, keys, node)
                stack.append(node)
                keys.append(None)
            elif isinstance(event, ev.MappingEndEvent | ev.SequenceEndEvent):
                stack.pop()
                keys.pop()
            elif isinstance(event, ev.AliasEvent):
                raise Refused(
                    Reason.ALIAS,
                    f"{_line(event)}a YAML alias (*{event.anchor}): aliases are refused because one can "
                    "expand a small file into gigabytes or into an endless loop; kubectl never writes "
                    "them, write the object out in full",
                )
    except yaml.YAMLError as exc:
        text = " ".join(str(exc).split())
        if _PARSER_DEPTH in text:
            # libyaml's own nesting limit (PyYAML 6.0.4's wheels: 1,000 levels) stopped the scanner
            # before MAX_DEPTH could: the same refusal, whichever limit came first.
            raise Refused(Reason.DEPTH, f"nested deeper than the YAML parser allows: {text}") from None
        raise Refused(Reason.SYNTAX, f"not valid YAML: {text}") from None
    return docs


def _add(
    docs: list[Any], stack: list[list[Any] | dict[str, Any]], keys: list[str | None], value: Any
) -> None:
    """Put `value` where the event stream says it goes: a document, a list item, a mapping value."""
    if not stack:
        docs.append(value)
        return
    top = stack[-1]
    if type(top) is list:
        top.append(value)
        return
    key = keys[-1]
    assert key is not None and isinstance(top, dict)  # the caller turned a key-position scalar into a key
    top[key] = value  # a repeated key: the last one wins, as in PyYAML and encoding/json
    keys[-1] = None


def _line(event: ev.Event) -> str:
    mark = event.start_mark
    return f"line {mark.line + 1}: " if mark is not None else ""


def _check_tag(event: Any, allowed: frozenset[str]) -> None:
    tag = event.tag
    if tag is None or tag == "!" or tag in allowed:
        return
    raise Refused(
        Reason.TAG,
        f"{_line(event)}the tag {tag}: Kubernetes objects are JSON (strings, numbers, booleans, null, "
        "lists, mappings); remove the tag",
    )


def _scalar(event: ev.ScalarEvent) -> Any:
    """A scalar as JSON value: plain ones resolved by YAML 1.1 rules minus timestamps, the rest str."""
    value: str = event.value
    tag = event.tag
    if tag is None or tag == "!":
        if not event.implicit[0]:
            return value  # quoted, or a block scalar: a string
        tag = _STR
        for candidate, pattern in _IMPLICIT.get(value[:1] if value else "", ()):
            if pattern.match(value):
                tag = candidate
                break
    else:
        _check_tag(event, _SCALAR_TAGS)
    if tag == _NULL:
        return None
    if tag == _BOOL:
        try:
            return _NUMBERS.bool_values[value.lower()]
        except KeyError:
            raise Refused(Reason.TAG, f"{_line(event)}{value!r} is not a boolean") from None
    if tag in (_INT, _FLOAT):
        if len(value) > MAX_NUMBER_CHARS:
            raise _number_too_long(value, _line(event))
        node = ScalarNode(tag, value)
        try:
            if tag == _INT:
                return _NUMBERS.construct_yaml_int(node)
            return _NUMBERS.construct_yaml_float(node)
        except ValueError:
            raise Refused(Reason.NUMBER, f"{_line(event)}{value!r} is not a number") from None
    return value  # str, and what YAML 1.1 calls timestamp, merge (<<) and value (=)
