"""Compiled data paths kept by build id, shared by every agent on the machine.

A build id (agent.ebpf.compile.build_id) hashes everything that decides the programs' bytes, and
nothing else (not the pin directory), so an object compiled once serves every agent that would
compile the same thing: a restart whose pinned programs were removed, the second node of a lab,
every later lab of a test run, the next pod of a rolling update on the node. A miss costs what it
always did: one compile.

The cache lives beside the agents' lock files, in `/run/ebpf-kube-proxy/bpf-objects` (tmpfs: gone
at reboot, when a new kernel would change the ids anyway; the chart mounts the host's
/run/ebpf-kube-proxy). `EKP_BPF_CACHE_DIR` names another directory; set to "" it turns the cache
off. What is in it gets loaded into the kernel, so it is trusted only as far as the pin directory
is: every component must be a real directory owned by root (or the agent's uid), the cache itself
writable by nobody else, an ancestor writable by others only with the sticky bit; each file owned
by us and writable by nobody else. Anything short of that, or unreadable, is a miss (logged), never
an error: the agent compiles instead. Files are written whole (a temporary file renamed over),
and only the newest `KEEP` are kept.

`compiling(build)` holds a lock per build (flock on `.lock-<build>` in the directory) around a miss
and its compile: agents that miss the same build at once (a lab's two nodes starting together, the
test workers of a fresh clone) compile it once, the others waiting for the first and taking its
object. A holder that dies releases it; a waiter gives up after `LOCK_WAIT_S` and compiles.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator

from agent.ebpf.bpfobject import BpfObject, ObjectError

log = logging.getLogger(__name__)

DEFAULT_DIR = "/run/ebpf-kube-proxy/bpf-objects"
DIR_ENV = "EKP_BPF_CACHE_DIR"
KEEP = 16
SUFFIX = ".json"
STALE_TMP_S = 3600.0  # a temporary file this old belongs to no live writer
LOCK_PREFIX = ".lock-"
# The start of the line logged while another agent's compile is awaited (lab/harness.py waits it out).
WAITING_LOG = "waiting for another agent compiling data path "
LOCK_WAIT_S = 300.0  # a compile's own timeout (agent.ebpf.compile.COMPILE_TIMEOUT_S)


def default_cache_dir() -> str:
    """The cache directory for this process ("" = no cache)."""
    return os.environ.get(DIR_ENV, DEFAULT_DIR)


def _problem(st: os.stat_result, final: bool) -> str:
    mode = st.st_mode
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        return "is not a directory"
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}"
    if mode & 0o022 and (final or not mode & stat.S_ISVTX):
        return f"has mode {stat.S_IMODE(mode):04o}, writable by other users"
    return ""


class ObjectCache:
    """One cache directory. Construction has no side effects; `get` and `put` never raise."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path) if path else ""
        self._refused = False

    def _usable(self, create: bool) -> bool:
        """Whether the directory exists (made 0700 when `create`) and only we can write it."""
        if not self.path or self._refused:
            return False
        parts = self.path.split("/")[1:]
        current = ""
        for i, part in enumerate(parts):
            current = f"{current}/{part}"
            final = i == len(parts) - 1
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                if not create:
                    return False
                try:
                    os.mkdir(current, 0o700)
                except FileExistsError:
                    pass
                except OSError as exc:
                    return self._refuse(f"cannot create {current}: {exc.strerror}")
                st = os.lstat(current)
            problem = _problem(st, final)
            if problem:
                return self._refuse(f"{current} {problem}")
        return True

    def _refuse(self, why: str) -> bool:
        log.warning(
            "not using the compiled data path cache %s: %s (every load compiles; set %s to a "
            'directory only root can write, or to "" to turn the cache off)',
            self.path,
            why,
            DIR_ENV,
        )
        self._refused = True
        return False

    def file(self, build: str) -> str:
        return os.path.join(self.path, build + SUFFIX)

    def get(self, build: str) -> BpfObject | None:
        """The object compiled for `build`, or None (absent, untrusted or unreadable)."""
        if not build.isalnum() or not self._usable(create=False):
            return None
        path = self.file(build)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
                log.warning("ignoring the cached data path %s: not a file only root can write", path)
                return None
            with os.fdopen(os.dup(fd), "rb") as f:
                obj = BpfObject.from_json(f.read())
        except (OSError, ObjectError) as exc:
            log.warning("ignoring the cached data path %s: %s (compiling instead)", path, exc)
            return None
        finally:
            os.close(fd)
        if obj.build != build:
            log.warning("ignoring the cached data path %s: it holds build %s", path, obj.build)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: kept by the pruning
        return obj

    @contextlib.contextmanager
    def compiling(self, build: str) -> Iterator[None]:
        """Held around a miss of `build` and its compile, so that one agent compiles what several
        missed at once; never raises of its own (no usable directory: no lock, as no cache)."""
        if not build.isalnum() or not self._usable(create=True):
            yield
            return
        path = os.path.join(self.path, LOCK_PREFIX + build)
        fd = -1
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            said = False
            while True:
                if fd < 0:
                    try:
                        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                    except OSError as exc:
                        log.warning(
                            "no compile lock %s: %s (this agent may compile what another is compiling)",
                            path,
                            exc,
                        )
                        break
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if not said:
                        log.info("%s%s (%s)", WAITING_LOG, build, path)
                        said = True
                    if time.monotonic() > deadline:
                        log.warning(
                            "another agent held the compile lock %s over %.0fs: compiling anyway",
                            path,
                            LOCK_WAIT_S,
                        )
                        break
                    time.sleep(0.05)
                    continue
                # A lock file the pruning removed between our open and our lock guards nothing
                # (the next agent opens a new one): lock the one that is there now. Held, it is
                # touched, so the pruning never takes it for a dead agent's.
                try:
                    current = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
                except OSError:
                    current = False
                if current or time.monotonic() > deadline:
                    with contextlib.suppress(OSError):
                        os.utime(fd)
                    break
                os.close(fd)
                fd = -1
            yield
        finally:
            if fd >= 0:
                os.close(fd)  # releases the lock

    def put(self, obj: BpfObject) -> None:
        """Keep `obj` for the next agent; failures are logged, not raised."""
        if not obj.build.isalnum() or not self._usable(create=True):
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-", suffix=SUFFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(obj.to_json())
                os.replace(tmp, self.file(obj.build))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("could not keep the compiled data path in %s: %s", self.path, exc)
            return
        self._prune()

    def _prune(self) -> None:
        """Remove all but the KEEP newest objects, and temporary files a killed writer left."""
        try:
            entries = [(e.name, e.stat().st_mtime, e.path) for e in os.scandir(self.path)]
        except OSError:
            return
        objects = sorted(((t, p) for n, t, p in entries if not n.startswith(".")), reverse=True)
        old = time.time() - STALE_TMP_S
        stale = [p for n, t, p in entries if n.startswith((".tmp-", LOCK_PREFIX)) and t < old]
        for path in [p for _, p in objects[KEEP:]] + stale:
            with contextlib.suppress(OSError):
                os.unlink(path)
