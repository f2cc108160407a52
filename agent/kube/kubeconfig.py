"""Reading `--kubeconfig`: the file and the files its current context names, each read once, bounded.

The kubernetes client's own loader opens the kubeconfig and every file it names with a plain
`open()` and PyYAML: a FIFO hangs it and `/dev/zero` fills the memory. So the agent reads them
itself, the way it reads every file it is pointed at (agent/readfile.py: regular files only, at
most MAX_BYTES each), decodes the kubeconfig with the services file's hardened decoder
(agent/sources/decode.py) with duplicate keys refused, and hands the client a document in which
the current context's `certificate-authority`, `client-certificate`, `client-key` and `tokenFile`
are replaced by their contents (`*-data`, `token`): the client then opens no file of ours.
Relative paths are taken from the kubeconfig's directory, as kubectl takes them.

Pure apart from reading the files; imports no kubernetes module. Every failure is a
`KubeconfigError` whose text names the file and says what to do.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from typing import Any

from agent.readfile import read_regular, reason
from agent.sources.decode import Refused, decode

# Kubeconfigs with dozens of clusters and their certificates inline stay under a megabyte.
MAX_BYTES = 4 << 20
WANTED = "give the path of a kubeconfig file (YAML or JSON with clusters, users and contexts)"
# The file fields clientcmd resolves, with the field that holds the same content inline.
CLUSTER_FILES = {"certificate-authority": "certificate-authority-data"}
USER_FILES = {"client-certificate": "client-certificate-data", "client-key": "client-key-data"}


class KubeconfigError(ValueError):
    """The kubeconfig, or a file it names, cannot be used; `str()` is one line for the operator."""


def load_kubeconfig(path: str) -> dict[str, Any]:
    """The kubeconfig at `path` with its current context's files inlined; raises KubeconfigError."""
    try:
        data = read_regular(path, MAX_BYTES)
    except OSError as exc:
        raise KubeconfigError(f"--kubeconfig {path}: cannot read it: {reason(exc)}; {WANTED}") from None
    try:
        docs = decode(data, max_bytes=MAX_BYTES, unique_keys=True)
    except Refused as exc:
        raise KubeconfigError(f"--kubeconfig {path}: not usable YAML or JSON: {exc}") from None
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise KubeconfigError(f"--kubeconfig {path}: not a kubeconfig; {WANTED}")
    doc: dict[str, Any] = docs[0]
    base = os.path.dirname(os.path.abspath(path))
    context = _named(doc, "contexts", doc.get("current-context"))
    if isinstance(context, dict):
        _inline(path, base, _named(doc, "clusters", context.get("cluster")), CLUSTER_FILES)
        user = _named(doc, "users", context.get("user"))
        _inline(path, base, user, USER_FILES)
        if isinstance(user, dict) and "tokenFile" in user and not user.get("token"):
            token = _read(path, base, "tokenFile", user.pop("tokenFile"))
            user["token"] = token.decode("utf-8", errors="replace").strip()
    return doc


def _named(doc: Mapping[str, Any], section: str, name: Any) -> Any:
    """The inner object of the entry called `name` in `section` (clusters, users, contexts)."""
    entries = doc.get(section)
    if not isinstance(entries, list) or not isinstance(name, str):
        return None
    inner = section[:-1]  # clusters -> cluster
    for entry in entries:
        if isinstance(entry, dict) and entry.get("name") == name:
            return entry.get(inner)
    return None


def _inline(path: str, base: str, obj: Any, fields: Mapping[str, str]) -> None:
    if not isinstance(obj, dict):
        return
    for file_field, data_field in fields.items():
        if file_field in obj and not obj.get(data_field):
            content = _read(path, base, file_field, obj.pop(file_field))
            obj[data_field] = base64.b64encode(content).decode()


def _read(path: str, base: str, field: str, value: Any) -> bytes:
    if not isinstance(value, str) or not value:
        raise KubeconfigError(f"--kubeconfig {path}: {field} must be the path of a file")
    named = os.path.join(base, value)
    try:
        return read_regular(named, MAX_BYTES)
    except OSError as exc:
        raise KubeconfigError(
            f"--kubeconfig {path}: {field} {named}: cannot read it: {reason(exc)}; point it at the "
            "file, or put the content inline"
        ) from None
