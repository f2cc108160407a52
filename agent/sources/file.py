"""Services and EndpointSlices from a YAML file that the agent watches.

The embedded default source: `agent --services-file FILE` with the file holding one or more YAML
documents, or `kind: List` documents as `kubectl get -o yaml` (or `-o json`) prints them. The
file is re-read when its modification time, size or inode changes (an editor's rename-over
counts), polled ten times a second: a stat() is cheap, and polling works the same on every
filesystem and inside containers. Each snapshot carries a version (a hash of the file's bytes)
that the sync log line repeats, so an operator, or a test, can tell which content is in force.

A file that does not parse keeps the last good content in force, so a half-saved edit never empties
the proxy; the error is logged once per change.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

log = logging.getLogger(__name__)

Obj = Mapping[str, Any]

# libyaml's C loader when PyYAML was built with it (the PyPI wheels are): about ten times faster
# than the pure-Python one, which matters at 10,000 Services. Same safe subset of YAML.
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# What reading a services file can raise: missing or unreadable, not UTF-8, not YAML.
LOAD_ERRORS = (OSError, UnicodeDecodeError, yaml.YAMLError)


@dataclass(frozen=True)
class Snapshot:
    """The objects a source holds at one moment; `complete` once the first full read succeeded."""

    services: tuple[Obj, ...] = ()
    endpoint_slices: tuple[Obj, ...] = ()
    complete: bool = False
    version: str = ""


def split_objects(docs: Iterable[Any]) -> tuple[list[Obj], list[Obj], list[str]]:
    """Services and EndpointSlices out of YAML documents; `kind: List` items are flattened.

    Returns (services, slices, ignored) where ignored names what was neither, for the log.
    """
    services: list[Obj] = []
    slices: list[Obj] = []
    ignored: list[str] = []
    stack = [d for d in docs if d is not None]
    stack.reverse()
    while stack:
        doc = stack.pop()
        if not isinstance(doc, Mapping):
            ignored.append(f"a {type(doc).__name__} document")
            continue
        kind = doc.get("kind")
        if kind == "List" or (isinstance(kind, str) and kind.endswith("List") and "items" in doc):
            stack.extend(reversed([i for i in doc.get("items") or [] if i is not None]))
        elif kind == "Service":
            services.append(doc)
        elif kind == "EndpointSlice":
            slices.append(doc)
        else:
            ignored.append(f"kind {kind!r}")
    return services, slices, ignored


def load_file(path: str) -> Snapshot:
    """Read and split one file; raises one of LOAD_ERRORS."""
    with open(path, "rb") as f:
        data = f.read()
    text = data.decode("utf-8")
    docs: list[Any]
    if text.lstrip()[:1] in ("{", "["):
        # JSON (`kubectl get -o json`) is YAML too, but the json module reads it ~20x faster.
        try:
            docs = [json.loads(text)]
        except json.JSONDecodeError:
            docs = list(yaml.load_all(text, Loader=_LOADER))
    else:
        docs = list(yaml.load_all(text, Loader=_LOADER))
    services, slices, ignored = split_objects(docs)
    if ignored:
        log.info(
            "%s: ignoring %d object(s) that are not Services or EndpointSlices: %s",
            path,
            len(ignored),
            ", ".join(sorted(set(ignored))),
        )
    return Snapshot(tuple(services), tuple(slices), complete=True, version=content_version(data))


def content_version(data: bytes) -> str:
    """The version a sync reports for this file content: the first 12 hex digits of its sha256."""
    return hashlib.sha256(data).hexdigest()[:12]


class FileSource:
    """Watches one YAML file; calls `on_change()` after each successful re-read.

    Construction reads nothing; `start()` reads the file once (raising if it cannot, so a typo in
    the flag fails fast) and starts the polling thread.
    """

    def __init__(self, path: str, on_change: Callable[[], None], interval_s: float = 0.1) -> None:
        self.path = path
        self._on_change = on_change
        self._interval = interval_s
        self._lock = threading.Lock()
        self._snapshot = Snapshot()
        self._stamp: tuple[int, int, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def poll(self) -> bool:
        """Re-read the file if it changed; True when the snapshot changed."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        if stamp is None:
            log.error("services file %s disappeared; keeping the last good content", self.path)
            return False
        try:
            snap = load_file(self.path)
        except LOAD_ERRORS as exc:
            log.error("services file %s does not parse, keeping the last good content: %s", self.path, exc)
            return False
        with self._lock:
            self._snapshot = snap
        log.info(
            "services file %s: %d Service(s), %d EndpointSlice(s)",
            self.path,
            len(snap.services),
            len(snap.endpoint_slices),
        )
        return True

    def start(self) -> None:
        self._stamp = self._stat()
        snap = load_file(self.path)
        with self._lock:
            self._snapshot = snap
        self._thread = threading.Thread(target=self._loop, name="file-source", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            if self.poll():
                self._on_change()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
