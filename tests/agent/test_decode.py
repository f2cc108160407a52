"""Decoding a services file into JSON values, and checking its shape: types, limits, positions."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from agent.sources.base import Kind
from agent.sources.content import check_documents, collect
from agent.sources.decode import MAX_DEPTH, Reason, Refused, decode, yaml_documents


def one(text: str) -> Any:
    [doc] = decode(text.encode())
    return doc


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("a: 2001-02-30", "2001-02-30"),  # a timestamp stays a string (PyYAML raised ValueError)
        ("a: 2001-12-14t21:59:43.10-05:00", "2001-12-14t21:59:43.10-05:00"),
        ("a: 80", 80),
        ("a: -0x1F", -31),
        ("a: 1_000", 1000),
        ("a: 1.5", 1.5),
        ("a: true", True),
        ("a: yes", True),  # YAML 1.1, as go-yaml v2 (kubectl) reads it
        ("a: Off", False),
        ("a: ~", None),
        ("a:", None),
        ("a: '80'", "80"),
        ('a: "true"', "true"),
        ("a: !!str 80", "80"),
        ("a: !!int '80'", 80),
        ("a: |\n  80\n", "80\n"),
        ("a: web", "web"),
        ("a: <<", "<<"),
    ],
)
def test_scalars_get_json_types(text: str, value: Any) -> None:
    assert one(text) == {"a": value}
    assert type(one(text)["a"]) is type(value)


def test_same_values_as_pyyaml_for_a_kubernetes_object() -> None:
    text = """\
apiVersion: v1
kind: Service
metadata:
  name: web
  labels: {app: web, tier: "1"}
  annotations:
    note: |
      two
      lines
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
  - name: dns
    port: 53
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 10800}}
  externalIPs: []
"""
    assert decode(text.encode()) == list(yaml.safe_load_all(text))


def test_keys_are_strings_as_written() -> None:
    assert one("80: a\ntrue: b\n'x': c\n") == {"80": "a", "true": "b", "x": "c"}


def test_a_repeated_key_keeps_the_last_value_like_json() -> None:
    assert one("a: 1\na: 2\n") == {"a": 2}
    assert one('{"a": 1, "a": 2}') == {"a": 2}


def test_anchors_without_aliases_are_harmless() -> None:
    assert one("a: &x {b: 1}\n") == {"a": {"b": 1}}


def test_multiple_documents_and_empty_ones() -> None:
    assert decode(b"a: 1\n---\n---\nb: 2\n") == [{"a": 1}, None, {"b": 2}]
    assert decode(b"") == []


def test_flow_yaml_that_is_not_json_is_read_as_yaml() -> None:
    assert decode(b"{a: 1, b: [x, y]}") == [{"a": 1, "b": ["x", "y"]}]


def test_utf8_bom_is_accepted() -> None:
    assert decode("\ufeffa: 1\n".encode()) == [{"a": 1}]


@pytest.mark.parametrize(
    ("data", "reason", "message"),
    [
        (b"&a {kind: List, items: [*a]}", Reason.ALIAS, "line 1: a YAML alias (*a)"),
        (b"a: &x 1\nb: *x\n", Reason.ALIAS, "line 2: a YAML alias (*x)"),
        (b"a: " + b"1" * 5000, Reason.NUMBER, "a number of 5000 characters"),
        (b'{"a": ' + b"1" * 5000 + b"}", Reason.NUMBER, "a number of 5000 characters"),
        (b'{"a": "' + b"1" * 5000 + b'", "b": 1}', None, ""),  # digits in a string are a string
        (b'{"a": 1.' + b"5" * 100 + b"}", Reason.NUMBER, "a number of 102 characters"),
        (b"[" * 100_000 + b"]" * 100_000, Reason.DEPTH, "JSON nested deeper than 100"),
        (b"[" * 100_000, Reason.DEPTH, "nested deeper than 100"),  # not JSON: YAML, cut at the limit
        (b"a: [" * 150 + b"]" * 150, Reason.DEPTH, "nested deeper than 100"),
        # libyaml's scanner looks ahead for a simple key after `items: ` and hits its own nesting
        # limit (1,000) before the first event reaches ours: refused as depth all the same.
        (
            b"kind: List\nitems: " + b"[" * 100_000 + b"]" * 100_000,
            Reason.DEPTH,
            "nested deeper than the YAML parser allows: while increasing flow level exceeded maximum "
            "nesting depth",
        ),
        (b"a: !!binary aGVsbG8=", Reason.TAG, "the tag tag:yaml.org,2002:binary"),
        (b"a: !!timestamp 2001-01-01", Reason.TAG, "timestamp"),
        (b"a: !!python/object/apply:os.system [true]", Reason.TAG, "python/object/apply:os.system"),
        (b"a: !!set {x}", Reason.TAG, "tag:yaml.org,2002:set"),
        (b"a: !local 1", Reason.TAG, "the tag !local"),
        (b"? [a]\n: b\n", Reason.TAG, "a mapping key that is a list"),
        (b"a: !!bool maybe", Reason.TAG, "'maybe' is not a boolean"),
        (b"a: !!int twelve", Reason.NUMBER, "'twelve' is not a number"),
        (b"\xff\xfe\x00a", Reason.ENCODING, "not UTF-8 (byte 0"),
        (b"kind: Service\nmetadata: [unclosed\n", Reason.SYNTAX, "not valid YAML"),
        (b"a: \x00", Reason.SYNTAX, "not valid YAML"),
    ],
)
def test_refused_inputs_say_why(data: bytes, reason: Reason | None, message: str) -> None:
    if reason is None:
        decode(data)
        return
    with pytest.raises(Refused) as info:
        decode(data)
    assert info.value.reason is reason
    assert message in str(info.value)


def test_depth_limit_is_exact() -> None:
    nested: Any = []
    for _ in range(MAX_DEPTH - 1):
        nested = [nested]
    assert decode(json.dumps(nested).encode()) == [nested]
    assert yaml_documents(json.dumps(nested)) == [nested]
    with pytest.raises(Refused):
        decode(json.dumps([nested]).encode())
    with pytest.raises(Refused):
        yaml_documents(json.dumps([nested]))


def test_size_limit() -> None:
    with pytest.raises(Refused) as info:
        decode(b"a: 1\n" * 10, max_bytes=49)
    assert info.value.reason is Reason.TOO_LARGE
    assert decode(b"a: 1\n" * 10, max_bytes=50) == [{"a": 1}]


SVC = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {}}


@pytest.mark.parametrize(
    ("docs", "message"),
    [
        ([], "the file holds no document"),
        ([None, None], "the file holds no document"),
        ([{"apiVersion": "v1", "items": [SVC]}], "document 1 has no kind"),
        ([SVC, {"apiVersion": "v1", "kind": "Service"}], "document 2 (kind Service) has no metadata"),
        ([{"kind": "Service", "metadata": {}}], "has no apiVersion"),
        ([{"kind": "Service", "metadata": "web", "apiVersion": "v1"}], "has no metadata"),
        ([{"kind": "List"}], "document 1 (kind List) has no items list"),
        ([{"kind": "List", "items": None}], "items: []"),
        ([["a"]], "document 1 is a list"),
        (["text"], "document 1 is a string"),
        ([None, 3], "document 2 is a number"),
    ],
)
def test_incomplete_documents_are_refused(docs: list[Any], message: str) -> None:
    with pytest.raises(Refused) as info:
        check_documents(docs)
    assert info.value.reason in (Reason.EMPTY, Reason.SHAPE)
    assert message in str(info.value)


def test_an_empty_list_is_an_intentionally_empty_set() -> None:
    content = collect([{"apiVersion": "v1", "kind": "List", "items": []}])
    assert content.of(Kind.SERVICE) == {} and content.of(Kind.ENDPOINT_SLICE) == {}


def test_nested_typed_lists_are_flattened_and_other_kinds_ignored() -> None:
    slice_ = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {"name": "s"}}
    doc = {"kind": "List", "items": [{"kind": "ServiceList", "items": [SVC]}, None, "x", {"kind": "Pod"}]}
    content = collect([slice_, doc])
    assert list(content.of(Kind.SERVICE)) == ["default/web"]
    assert list(content.of(Kind.ENDPOINT_SLICE)) == ["default/s"]
    assert content.ignored == ("a string at document 2, items[2]", "kind 'Pod'")


def test_duplicates_keep_the_first_and_name_both_positions() -> None:
    other = {**SVC, "spec": {"clusterIP": "10.96.0.99"}}
    content = collect([SVC, {"kind": "List", "items": [other]}])
    assert content.of(Kind.SERVICE)["default/web"] is SVC
    [dup] = content.duplicates
    assert (dup.kind, dup.key, dup.kept, dup.dropped) == (
        Kind.SERVICE,
        "default/web",
        "document 1",
        "document 2, items[0]",
    )
