"""--kubeconfig read by the agent (agent/kube/kubeconfig.py): the file and the files its current
context names, each a bounded regular-file read, decoded strictly, handed to the client inline."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from agent.config import Config
from agent.kube.client import api_client
from agent.kube.kubeconfig import MAX_BYTES, KubeconfigError, load_kubeconfig
from lab.fakeapi import FakeApiServer
from lab.fakeapi.objects import service


def kubeconfig(cluster: dict[str, Any], user: dict[str, Any], others: bool = False) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    if others:  # another context whose files are gone: never read, as kubectl never reads them
        doc["clusters"].append({"name": "old", "cluster": {"certificate-authority": "/nonexistent/ca"}})
        doc["users"].append({"name": "old", "user": {"tokenFile": "/nonexistent/token"}})
        doc["contexts"].append({"name": "old", "context": {"cluster": "old", "user": "old"}})
    return doc


def test_files_of_the_current_context_are_read_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    with FakeApiServer(tls=True, tokens=("s3cret",)) as server:
        server.create(service("web", "10.96.0.1"))
        (tmp_path / "pki").mkdir()
        (tmp_path / "pki" / "ca.crt").write_bytes(server.ca_path.read_bytes())
        (tmp_path / "token").write_text("s3cret\n")
        path = tmp_path / "kubeconfig"
        cluster = {"server": server.url, "certificate-authority": "pki/ca.crt"}
        path.write_text(yaml.safe_dump(kubeconfig(cluster, {"tokenFile": "token"}, others=True)))

        doc = load_kubeconfig(str(path))
        [c, _] = doc["clusters"]
        assert base64.b64decode(c["cluster"]["certificate-authority-data"]) == server.ca_path.read_bytes()
        assert "certificate-authority" not in c["cluster"]
        assert doc["users"][0]["user"] == {"token": "s3cret"}

        api = api_client(Config(kubeconfig=str(path)), kubeconfig=doc)
        resp: Any = k8s.CoreV1Api(api).list_service_for_all_namespaces(_preload_content=False)
        assert [i["metadata"]["name"] for i in json.loads(resp.data)["items"]] == ["web"]
        assert server.requests[-1].headers["authorization"] == "Bearer s3cret"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda p: os.mkfifo(p),
            "cannot read it: not a regular file (a FIFO); give the path of a kubeconfig",
        ),
        (lambda p: p.write_bytes(b"a: 1\na: 2\n"), 'line 2: the key "a" is given twice in one mapping'),
        (lambda p: p.write_bytes(b"clusters: &c []\nusers: *c\n"), "a YAML alias (*c)"),
        (lambda p: p.write_bytes(b"x: " + b"1" * 100_000 + b"\n"), "a number of 100000 characters"),
        (lambda p: os.truncate(p, MAX_BYTES + 1) if p.touch() is None else None, "over the limit of"),
        (lambda p: p.write_bytes(b"- a list\n"), "not a kubeconfig"),
    ],
    ids=["fifo", "duplicate key", "alias", "huge number", "too large", "a list"],
)
def test_a_kubeconfig_that_cannot_be_used_says_why_in_one_line(
    tmp_path: Path, make: Any, expected: str
) -> None:
    path = tmp_path / "kubeconfig"
    make(path)
    with pytest.raises(KubeconfigError) as err:
        load_kubeconfig(str(path))
    text = str(err.value)
    assert text.startswith(f"--kubeconfig {path}: ") and expected in text and "\n" not in text, text


def test_a_file_the_kubeconfig_names_is_read_the_same_way(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "ca.crt")
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(kubeconfig({"server": "https://x", "certificate-authority": "ca.crt"}, {}))
    )
    with pytest.raises(KubeconfigError) as err:
        load_kubeconfig(str(path))
    assert str(err.value) == (
        f"--kubeconfig {path}: certificate-authority {tmp_path}/ca.crt: cannot read it: not a regular "
        "file (a FIFO); point it at the file, or put the content inline"
    )
