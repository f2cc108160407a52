"""Services and EndpointSlices from a file the agent watches: `agent --services-file FILE`.

The file holds one or more YAML documents, or `kind: List` documents as `kubectl get -o yaml` (or
`-o json`) prints them. `FileSource` implements the source contract of agent/sources/base.py:
`kinds` = {Service, EndpointSlice}; `start(sink)` starts a thread that reads the file, and again
whenever it changes, and delivers each successfully read content as the differences against what
it delivered before (ADDED / MODIFIED / DELETED `ObjectEvent`s, agent/sources/relist.py) followed
by `Synced(kind, version)` for both kinds. The version is `content_version(data)`, a hash of the
file's bytes, which the agent's `sync done: version=...` log line repeats, so an operator, or a
test, can tell which content is in force. One content is delivered in one `sink` call, so the
agent never programs a mix of two versions of the file.

Change detection polls stat() ten times a second (device, inode, size, mtime and ctime: an
editor's rename-over and a ConfigMap volume's symlink swap both count): a stat() is cheap, and
polling works the same on every filesystem and inside containers.

The file is the whole desired set, so a bad read must never be applied. A content that cannot be
read, decoded (agent/sources/decode.py: aliases, depth, numbers, tags, size, encoding) or that is
not a complete List or complete objects (agent/sources/content.py) is refused: the last good
content stays in force, one log line says why and what to do (write the new content to a temporary
file and rename it over: a rename is atomic, so the agent only ever sees whole files), and
`ekp_services_file_rejected_total{reason}` counts it; `ekp_services_file_stale` is 1 until a good
content is read. Each content is judged once (the stat stamp must change before the next read), so
a refused file costs nothing while it stays. Nothing the file holds can stop the watching thread:
a last-resort handler logs any unexpected error, counts it (reason `internal`) and retries after a
growing pause.

A file that cannot be opened when the agent starts is an error at start (a typo in the flag fails
fast); after that, a missing or unreadable file only keeps the last good content. A file that opens
but is refused at start delivers nothing: the agent's first-sync gate keeps whatever is already
programmed until a good content appears.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from agent.errors import FatalError
from agent.metrics.source import FileMetrics
from agent.readfile import FileTooLarge, NotRegularFile, check_regular, read_regular, reason
from agent.sources.base import Event, Kind, Sink, Synced
from agent.sources.content import KINDS, Content, collect
from agent.sources.decode import MAX_FILE_BYTES, Reason, Refused, decode
from agent.sources.relist import relist_events

log = logging.getLogger(__name__)

Obj = Mapping[str, Any]

# What reading a services file can raise: missing or unreadable (OSError), or refused.
LOAD_ERRORS = (OSError, Refused)

SAFE_WRITE = (
    "to replace the file safely, write the new content to a temporary file in the same directory and "
    "rename it over the services file (mv, os.replace)"
)
RETRY_MIN_S = 1.0  # pause after an unexpected error, doubled on each one in a row
RETRY_MAX_S = 60.0


@dataclass(frozen=True)
class Snapshot:
    """The objects of one file content (what `--dry-run` renders); `complete` once read in full."""

    services: tuple[Obj, ...] = ()
    endpoint_slices: tuple[Obj, ...] = ()
    complete: bool = False
    version: str = ""


def content_version(data: bytes) -> str:
    """The version a sync reports for this file content: the first 12 hex digits of its sha256."""
    return hashlib.sha256(data).hexdigest()[:12]


def read_bytes(path: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The file's bytes; OSError when it cannot be opened, Refused when not a regular file or too big
    (agent/readfile.py: a FIFO or a device named by mistake is refused instead of hanging)."""
    try:
        return read_regular(path, max_bytes)
    except NotRegularFile as exc:
        raise Refused(Reason.UNREADABLE, reason(exc)) from None
    except FileTooLarge as exc:
        raise Refused(Reason.TOO_LARGE, reason(exc)) from None


def parse(data: bytes, max_bytes: int = MAX_FILE_BYTES) -> Content:
    """Decode and check one content (agent/sources/decode.py, content.py); raises Refused."""
    return collect(decode(data, max_bytes=max_bytes))


def report(path: str, content: Content, metrics: FileMetrics | None = None) -> None:
    """Log what a read content leaves out: kinds not ours, and duplicates (counted)."""
    if content.ignored:
        log.info(
            "services file %s: ignoring %d object(s) that are not Services or EndpointSlices: %s",
            path,
            len(content.ignored),
            ", ".join(sorted(set(content.ignored))),
        )
    for dup in content.duplicates:
        log.warning(
            "services file %s: %s %s is defined twice, at %s and at %s: the first is used and the "
            "second ignored; remove one of them",
            path,
            dup.kind.value,
            dup.key,
            dup.kept,
            dup.dropped,
        )
        if metrics is not None:
            metrics.duplicates.labels(kind=dup.kind.value).inc()


def load_file(path: str, max_bytes: int = MAX_FILE_BYTES) -> Snapshot:
    """Read, decode and check one file (for `--dry-run`); raises one of LOAD_ERRORS."""
    data = read_bytes(path, max_bytes)
    content = parse(data, max_bytes)
    report(path, content)
    return Snapshot(
        tuple(content.of(Kind.SERVICE).values()),
        tuple(content.of(Kind.ENDPOINT_SLICE).values()),
        complete=True,
        version=content_version(data),
    )


Stamp = tuple[int, ...]


class FileWatch:
    """One services file's reading state, synchronous: what was delivered, the stat stamp last judged.

    `poll(sink)` reads the file when its stamp changed and hands the differences to `sink`; it
    handles every refusal itself (log, counter, gauge) and raises only on a bug, after which
    `forget()` makes the next poll read again. FileSource runs it on a thread; tests call it.
    """

    def __init__(
        self, path: str, max_bytes: int = MAX_FILE_BYTES, metrics: FileMetrics | None = None
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.metrics = metrics or FileMetrics(CollectorRegistry())
        self._stamp: Stamp | None = None
        self._delivered: dict[Kind, Mapping[str, Obj]] = {k: {} for k in KINDS}
        self.version = ""  # of the content in force ("" before the first good read)
        self.stale = False  # the file on disk is not the content in force

    def forget(self) -> None:
        """Judge the file again at the next poll (after an unexpected error, counted by the caller)."""
        self._stamp = None
        self._set_stale(True)

    def _current_stamp(self) -> Stamp:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            return (-1, exc.errno or 0)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def poll(self, sink: Sink) -> bool:
        """Read the file if it changed and deliver what differs; True when something was delivered."""
        stamp = self._current_stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            data = read_bytes(self.path, self.max_bytes)
        except FileNotFoundError:
            self._refuse(Reason.MISSING, "the file does not exist (deleted, or being replaced)", "")
            return False
        except OSError as exc:
            self._refuse(Reason.UNREADABLE, f"cannot be read: {exc.strerror or exc}", "")
            return False
        except Refused as exc:
            self._refuse(exc.reason, str(exc), "")
            return False
        version = content_version(data)
        if version == self.version:
            if self.stale:
                log.info("services file %s: back to the content in force (version %s)", self.path, version)
            self._set_stale(False)
            return False
        try:
            content = parse(data, self.max_bytes)
        except Refused as exc:
            self._refuse(exc.reason, str(exc), version)
            return False
        report(self.path, content, self.metrics)
        events: list[Event] = []
        for kind in KINDS:
            events += relist_events(kind, self._delivered[kind], content.of(kind))
        events += [Synced(kind, version) for kind in KINDS]
        sink(events)
        self._delivered = {kind: content.of(kind) for kind in KINDS}
        self.version = version
        self._set_stale(False)
        log.info(
            "services file %s: %d Service(s), %d EndpointSlice(s), version %s (%d object change(s))",
            self.path,
            len(content.of(Kind.SERVICE)),
            len(content.of(Kind.ENDPOINT_SLICE)),
            version,
            len(events) - len(KINDS),
        )
        return True

    def _set_stale(self, stale: bool) -> None:
        self.stale = stale
        self.metrics.stale.set(1 if stale else 0)

    def _refuse(self, reason: Reason, why: str, version: str) -> None:
        self.metrics.rejected.labels(reason=reason.value).inc()
        self._set_stale(True)
        in_force = (
            f"the last good content (version {self.version}) stays in force"
            if self.version
            else "nothing is applied until a good content is read"
        )
        log.error(
            "services file %s%s not applied: %s. %s; %s",
            self.path,
            f" (content {version})" if version else "",
            why,
            in_force,
            SAFE_WRITE,
        )


def check_services_file(path: str) -> None:
    """FatalError unless `path` opens as a regular file: no retry makes a wrong path right. The
    source's start checks it, and the agent before it loads the data path (agent/app.py)."""
    try:
        check_regular(path)
    except OSError as exc:
        raise FatalError(
            f"--services-file {path}: {exc.strerror or exc}: give the path of a readable "
            "YAML or JSON file of Services and EndpointSlices (write it before the agent starts)"
        ) from exc


class FileSource:
    """The file source (agent/sources/base.py `Source`). Construction reads nothing."""

    def __init__(
        self,
        path: str,
        *,
        interval_s: float = 0.1,
        max_bytes: int = MAX_FILE_BYTES,
        metrics: FileMetrics | None = None,
    ) -> None:
        self.path = path
        self._interval = interval_s
        self._watch = FileWatch(path, max_bytes, metrics)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset(KINDS)

    @property
    def version(self) -> str:
        """The version of the content in force ("" before the first good read)."""
        return self._watch.version

    def start(self, sink: Sink) -> None:
        """Check the file opens (FatalError if not: no retry makes a wrong path right), then read
        and watch it on a thread. Once started, a file that goes away is refused and waited for."""
        check_services_file(self.path)
        self._thread = threading.Thread(target=self._run, args=(sink,), name="file-source", daemon=True)
        self._thread.start()

    def _run(self, sink: Sink) -> None:
        pause = RETRY_MIN_S
        while not self._stop.is_set():
            wait = self._interval
            try:
                self._watch.poll(sink)
                pause = RETRY_MIN_S
            except Exception:
                # Last resort: nothing in a file may end the watcher. A bug, not a bad file (those
                # are refused above): logged with its traceback, counted, retried after a pause.
                log.exception(
                    "services file %s: unexpected error while reading it (a bug, please report it); "
                    "the last good content stays in force, retrying in %.0fs",
                    self.path,
                    pause,
                )
                self._watch.metrics.rejected.labels(reason=Reason.INTERNAL.value).inc()
                self._watch.forget()
                wait, pause = pause, min(pause * 2, RETRY_MAX_S)
            self._stop.wait(wait)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
