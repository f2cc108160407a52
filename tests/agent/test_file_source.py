"""The YAML file source: splitting documents, Lists, versions, keeping the last good content."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from agent.sources.file import FileSource, content_version, load_file, split_objects

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


def test_multi_document_and_list(tmp_path: Path) -> None:
    lst = "apiVersion: v1\nkind: List\nitems:\n- " + SVC.replace("\n", "\n  ").rstrip() + "\n"
    path = tmp_path / "s.yaml"
    path.write_text(SLICE + "---\n" + lst + "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    snap = load_file(str(path))
    assert [s["metadata"]["name"] for s in snap.services] == ["web"]
    assert [s["metadata"]["name"] for s in snap.endpoint_slices] == ["web-1"]
    assert snap.complete
    assert snap.version == content_version(path.read_bytes())


def test_split_nested_typed_lists() -> None:
    doc = {"kind": "ServiceList", "items": [{"kind": "Service", "metadata": {"name": "a"}}]}
    services, slices, ignored = split_objects([doc, None, "text", {"kind": "Pod"}])
    assert [s["metadata"]["name"] for s in services] == ["a"]
    assert slices == []
    assert ignored == ["a str document", "kind 'Pod'"]


def test_poll_rereads_on_change_and_keeps_last_good(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SVC)
    changes = threading.Event()
    src = FileSource(str(path), on_change=changes.set, interval_s=60)
    src.start()
    src.stop()
    v1 = src.snapshot().version
    assert len(src.snapshot().services) == 1
    assert src.poll() is False, "no change, no re-read"

    path.write_text(SVC + "---\n" + SLICE)
    os.utime(path, ns=(1, 10**18))
    assert src.poll() is True
    assert len(src.snapshot().endpoint_slices) == 1
    assert src.snapshot().version != v1

    good = src.snapshot()
    path.write_text("kind: Service\nmetadata: [unclosed\n")
    os.utime(path, ns=(1, 2 * 10**18))
    assert src.poll() is False
    assert src.snapshot() is good, "a broken file keeps the last good content"

    path.unlink()
    assert src.poll() is False
    assert src.snapshot() is good


def test_json_file_is_read_too(tmp_path: Path) -> None:
    """`kubectl get -o json` output: JSON is YAML, read by the json module for speed."""
    import json

    import yaml

    doc = {"apiVersion": "v1", "kind": "List", "items": [yaml.safe_load(SVC), yaml.safe_load(SLICE)]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    snap = load_file(str(path))
    assert [s["metadata"]["name"] for s in snap.services] == ["web"]
    assert [s["metadata"]["name"] for s in snap.endpoint_slices] == ["web-1"]
