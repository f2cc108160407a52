"""The file source: documents and Lists, per-object events, versions, keeping the last good content."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from agent.errors import FatalError
from agent.metrics.source import FileMetrics
from agent.sources import file as file_source
from agent.sources.base import Event, EventType, Kind, ObjectEvent, Synced
from agent.sources.file import FileSource, FileWatch, content_version, load_file

REGISTRY = CollectorRegistry()
METRICS = FileMetrics(REGISTRY)

SVC = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}
"""
SLICE = """\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.244.1.2]}]
"""


class Recorder:
    """A sink that keeps every batch."""

    def __init__(self) -> None:
        self.batches: list[list[Event]] = []
        self.delivered = threading.Event()

    def __call__(self, events: Sequence[Event]) -> None:
        self.batches.append(list(events))
        self.delivered.set()

    def last(self) -> list[Event]:
        return self.batches[-1]


def changes(events: Sequence[Event]) -> list[tuple[str, str, str]]:
    return [(e.kind.value, e.type.value, e.key) for e in events if isinstance(e, ObjectEvent)]


def rewrite(path: Path, text: str | bytes) -> None:
    """Replace the file's content the safe way (rename over), as the README tells operators."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(text.encode() if isinstance(text, str) else text)
    os.replace(tmp, path)


def rejected(reason: str) -> float:
    value = REGISTRY.get_sample_value("ekp_services_file_rejected_total", {"reason": reason})
    return value or 0.0


def test_multi_document_and_list(tmp_path: Path) -> None:
    lst = "apiVersion: v1\nkind: List\nitems:\n- " + SVC.replace("\n", "\n  ").rstrip() + "\n"
    path = tmp_path / "s.yaml"
    path.write_text(SLICE + "---\n" + lst + "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    snap = load_file(str(path))
    assert [s["metadata"]["name"] for s in snap.services] == ["web"]
    assert [s["metadata"]["name"] for s in snap.endpoint_slices] == ["web-1"]
    assert snap.complete
    assert snap.version == content_version(path.read_bytes())


def test_json_file_is_read_too(tmp_path: Path) -> None:
    """`kubectl get -o json` output: JSON is YAML, read by the json module for speed."""
    doc = {"apiVersion": "v1", "kind": "List", "items": [yaml.safe_load(SVC), yaml.safe_load(SLICE)]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    snap = load_file(str(path))
    assert [s["metadata"]["name"] for s in snap.services] == ["web"]
    assert [s["metadata"]["name"] for s in snap.endpoint_slices] == ["web-1"]


def test_first_read_delivers_every_object_then_synced_for_both_kinds(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SVC + "---\n" + SLICE)
    sink = Recorder()
    watch = FileWatch(str(path), metrics=METRICS)
    assert watch.poll(sink) is True
    events = sink.last()
    assert changes(events) == [
        ("Service", "ADDED", "default/web"),
        ("EndpointSlice", "ADDED", "default/web-1"),
    ]
    version = content_version(path.read_bytes())
    assert events[-2:] == [Synced(Kind.SERVICE, version), Synced(Kind.ENDPOINT_SLICE, version)]
    assert watch.poll(sink) is False, "no change on disk, no read"


def test_rereads_deliver_only_the_differences(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SVC + "---\n" + SLICE)
    sink = Recorder()
    watch = FileWatch(str(path), metrics=METRICS)
    watch.poll(sink)

    other = SVC.replace("name: web,", "name: api,").replace("10.96.0.10", "10.96.0.11")
    changed_slice = SLICE.replace("10.244.1.2", "10.244.1.3")
    rewrite(path, SVC + "---\n" + other + "---\n" + changed_slice)
    assert watch.poll(sink) is True
    assert changes(sink.last()) == [
        ("Service", "ADDED", "default/api"),
        ("EndpointSlice", "MODIFIED", "default/web-1"),
    ]
    modified = next(e for e in sink.last() if isinstance(e, ObjectEvent) and e.type is EventType.MODIFIED)
    assert modified.obj["endpoints"][0]["addresses"] == ["10.244.1.3"]

    rewrite(path, other)
    watch.poll(sink)
    deleted = [e for e in sink.last() if isinstance(e, ObjectEvent)]
    assert changes(deleted) == [
        ("Service", "DELETED", "default/web"),
        ("EndpointSlice", "DELETED", "default/web-1"),
    ]
    assert deleted[1].obj["endpoints"][0]["addresses"] == ["10.244.1.3"], "DELETED carries the last state"


def test_same_objects_with_new_bytes_deliver_only_synced_with_the_new_version(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SVC)
    sink = Recorder()
    watch = FileWatch(str(path), metrics=METRICS)
    watch.poll(sink)
    rewrite(path, "# a comment changes the bytes, not the objects\n" + SVC)
    assert watch.poll(sink) is True
    version = content_version(path.read_bytes())
    assert sink.last() == [Synced(Kind.SERVICE, version), Synced(Kind.ENDPOINT_SLICE, version)]


def test_an_edit_that_keeps_size_and_mtime_is_still_seen(tmp_path: Path) -> None:
    """ctime cannot be set back by utime(), so an edit is seen even when mtime and size are restored."""
    path = tmp_path / "s.yaml"
    path.write_text(SVC)
    st = path.stat()
    sink = Recorder()
    watch = FileWatch(str(path), metrics=METRICS)
    watch.poll(sink)
    path.write_text(SVC.replace("10.96.0.10", "10.96.0.12"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert watch.poll(sink) is True
    assert changes(sink.last()) == [("Service", "MODIFIED", "default/web")]


def test_a_broken_file_keeps_the_last_good_content_and_is_judged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SVC)
    sink = Recorder()
    watch = FileWatch(str(path), metrics=METRICS)
    watch.poll(sink)
    good = watch.version
    before = rejected("syntax")

    rewrite(path, "kind: Service\nmetadata: [unclosed\n")
    assert watch.poll(sink) is False
    assert len(sink.batches) == 1, "nothing delivered"
    assert watch.version == good and watch.stale
    assert rejected("syntax") == before + 1
    [line] = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    assert f"the last good content (version {good}) stays in force" in line
    assert "rename it over" in line
    assert watch.poll(sink) is False
    assert rejected("syntax") == before + 1, "the same content is judged once"

    path.unlink()
    assert watch.poll(sink) is False
    assert rejected("missing") >= 1

    rewrite(path, SVC)
    assert watch.poll(sink) is False, "the content in force again: nothing to deliver"
    assert not watch.stale
    assert REGISTRY.get_sample_value("ekp_services_file_stale") == 0


def test_duplicate_objects_first_wins_with_both_positions_logged_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    second = SVC.replace("10.96.0.10", "10.96.0.99")
    path = tmp_path / "s.yaml"
    lst = {"apiVersion": "v1", "kind": "List", "items": [yaml.safe_load(SLICE), yaml.safe_load(second)]}
    path.write_text(SVC + "---\n" + json.dumps(lst))
    before = REGISTRY.get_sample_value("ekp_services_file_duplicates_total", {"kind": "Service"}) or 0.0
    sink = Recorder()
    FileWatch(str(path), metrics=METRICS).poll(sink)
    [svc] = [e for e in sink.last() if isinstance(e, ObjectEvent) and e.kind is Kind.SERVICE]
    assert svc.obj["spec"]["clusterIP"] == "10.96.0.10", "the first one in the file wins"
    assert REGISTRY.get_sample_value("ekp_services_file_duplicates_total", {"kind": "Service"}) == before + 1
    [line] = [r.getMessage() for r in caplog.records if "defined twice" in r.getMessage()]
    assert "Service default/web is defined twice, at document 1 and at document 2, items[1]" in line


def test_start_fails_fast_on_a_file_that_cannot_be_opened(tmp_path: Path) -> None:
    """Fatal (the agent exits 1 with the message), not a traceback: no retry fixes a wrong path."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, why in (
        (tmp_path / "typo.yaml", "No such file or directory"),
        (tmp_path, r"not a regular file \(a directory\)"),
        (fifo, r"not a regular file \(a FIFO\)"),
    ):
        with pytest.raises(
            FatalError, match=rf"--services-file {re.escape(str(path))}: {why}: give the path"
        ):
            FileSource(str(path)).start(Recorder())


def test_a_refused_file_at_start_delivers_nothing_until_a_good_one_appears(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("")
    sink = Recorder()
    source = FileSource(str(path), interval_s=0.01, metrics=METRICS)
    source.start(sink)
    try:
        time.sleep(0.1)
        assert sink.batches == [], "an empty file is not an empty set"
        rewrite(path, "apiVersion: v1\nkind: List\nitems: []\n")
        assert sink.delivered.wait(5)
        version = content_version(path.read_bytes())
        assert sink.last() == [Synced(Kind.SERVICE, version), Synced(Kind.ENDPOINT_SLICE, version)]
    finally:
        source.stop()


def test_the_watching_thread_survives_an_unexpected_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The last-resort handler logs, counts and retries: the thread never dies."""
    path = tmp_path / "s.yaml"
    path.write_text(SVC)
    real_parse = file_source.parse
    calls: list[int] = []

    def broken_once(data: bytes, max_bytes: int = 0) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the reader")
        return real_parse(data)

    monkeypatch.setattr(file_source, "parse", broken_once)
    monkeypatch.setattr(file_source, "RETRY_MIN_S", 0.05)
    before = rejected("internal")
    sink = Recorder()
    source = FileSource(str(path), interval_s=0.01, metrics=METRICS)
    source.start(sink)
    try:
        assert sink.delivered.wait(5), "the read is retried after the error"
    finally:
        source.stop()
    assert changes(sink.last()) == [("Service", "ADDED", "default/web")]
    assert rejected("internal") == before + 1
    assert any("unexpected error" in r.getMessage() for r in caplog.records)


def test_stop_ends_the_thread(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SVC)
    source = FileSource(str(path), interval_s=0.01, metrics=METRICS)
    assert source.kinds == frozenset({Kind.SERVICE, Kind.ENDPOINT_SLICE})
    source.start(Recorder())
    source.stop()
    assert not any(t.name == "file-source" and t.is_alive() for t in threading.enumerate())
