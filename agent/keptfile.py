"""A file the agent leaves at a clean stop for its next start (agent.keptrecords), and how that
start reads it without trusting it.

The directory (/run/ebpf-kube-proxy: tmpfs, root's alone, gone at reboot) is the lock files'. The
file is written to a temporary name (O_EXCL|O_NOFOLLOW: a link put there is refused) through a
hashing writer and renamed over; its header holds a magic, the writer's `identity` (the format, the
Python, the agent's source, the flags) and a checksum of the body. A start opens it without
following a link or blocking on a FIFO, removes it at once (consumed whatever the outcome, so a
start after a crash never meets a stale one, nor a partial one a killed stop left), refuses
anything but a regular file under a size bound, checks the identity and the checksum in 1 MiB
reads (the body is never whole in memory) and unpickles it with an unpickler that builds only the
classes it is given. The collector is held while a large pickle is built or read: tens of thousands
of objects would otherwise trigger collections that find nothing to free.

A stop killed while it wrote leaves `<file>.<pid>.tmp` (70 MB of the planner's at 50,000 Services,
held in tmpfs memory until reboot): the next write and the next start (`remove`) remove those no
live writer holds. A writer holds an exclusive flock on its temporary file from right after it
made it until it renamed it over, and the sweep takes that lock (without waiting) before it
unlinks: a pid says nothing across pid namespaces (a container's writer's pid 7 is a host
kthread's, hostPID toggled), the lock does (the kernel drops it with the writer's last fd, so a
killed writer's goes with it; forked children close their copies, `_WRITING`).
"""

from __future__ import annotations

import errno
import fcntl
import gc
import hashlib
import io
import logging
import os
import pickle
import re
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO

from agent.config import Config

log = logging.getLogger(__name__)

_HASH = 32  # sha256
_TEMPORARY = re.compile(r"(.+)\.([0-9]{1,10})\.tmp")  # `write`'s <file>.<pid>.tmp
_AGENT_DIR = Path(__file__).resolve().parent
_ATTEMPTS = 3  # makes of the temporary file, each unlinked by a sweep before its lock was taken

# The fds of the temporary files being written: a child forked meanwhile (a helper's fork, no
# exec) must not keep the flock after the writer died, or its file would never be swept.
_WRITING: set[int] = set()


def _close_writing_in_child() -> None:
    for fd in list(_WRITING):
        with suppress(OSError):
            os.close(fd)
    _WRITING.clear()


os.register_at_fork(after_in_child=_close_writing_in_child)


def identity(magic: bytes, config: Config) -> bytes:
    """What a file is only good for: this format, this Python, this agent's source (every
    agent/**/*.py, read now: about 4 ms), these flags."""
    h = hashlib.sha256()
    sources = sorted(_AGENT_DIR.rglob("*.py"))
    if not sources:
        # Installed without its sources (bytecode or a zip alone): nothing says which agent wrote
        # a file, so no file is taken (a random identity), rather than every version's.
        h.update(os.urandom(32))
    for file in sources:
        h.update(str(file.relative_to(_AGENT_DIR)).encode() + b"\0")
        h.update(file.read_bytes())
    return hashlib.sha256(magic + sys.version.encode() + h.digest() + repr(config).encode()).digest()


def write(path: str, header: bytes, dump: Callable[[pickle.Pickler], None]) -> None:
    """`header`, the body's checksum, then what `dump` pickles; atomic (a new file renamed over),
    the temporary file locked while it exists under its name (module doc)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    sweep(path)  # an earlier process's of the same pid, killed while it wrote, too (or a link)
    fd = _made_locked(tmp)  # in _WRITING from its open on
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                f.write(header + bytes(_HASH))
                body = Hashing(f)
                with collector_held():
                    dump(pickle.Pickler(body, protocol=pickle.HIGHEST_PROTOCOL))
                f.seek(len(header))
                f.write(body.digest())
                f.flush()
                # under the lock: a sweep may not take the name between the close and the rename
                os.replace(tmp, path)
            finally:
                # before the close: a child forked after it must not close a later fd of that number
                _WRITING.discard(fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def _made_locked(tmp: str) -> int:
    """`tmp` made (O_EXCL|O_NOFOLLOW: a link put there is refused) and flocked, still the file at
    that name: a sweep may open it between the make and the lock, find it unlocked and unlink it
    (then it is made again)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_ATTEMPTS):
        fd = os.open(tmp, flags, 0o600)
        _WRITING.add(fd)  # at once: a child forked before the lock would hold it after us
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.stat(tmp, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd  # left in _WRITING: the writer's until it closes it
        except FileNotFoundError:
            pass  # unlinked by a sweep before the lock
        except BaseException:
            _WRITING.discard(fd)
            os.close(fd)
            raise
        _WRITING.discard(fd)
        os.close(fd)
    raise OSError(f"{tmp} was removed {_ATTEMPTS} times between its creation and its lock")


def open_consumed(path: str) -> tuple[io.BufferedReader | None, str]:
    """The file at `path`, removed from the directory (with any partial one); (None, why not),
    (None, "") when there is none."""
    try:
        # O_NOFOLLOW: not a link put at the name; O_NONBLOCK: a FIFO put there cannot hang the start
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"cannot open it: {exc}"
    finally:
        remove(path)
    try:
        # a directory opens O_RDONLY too, and fdopen would raise on it
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None, "not a regular file"
        return os.fdopen(fd, "rb"), ""
    except OSError as exc:
        with suppress(OSError):
            os.close(fd)
        return None, f"cannot open it: {exc}"


def check(
    f: io.BufferedReader, magic: bytes, ident: bytes, max_bytes: int, then: tuple[bytes, str] = (b"", "")
) -> str:
    """Why the file `write` made cannot be used ("" when it can: `f` is then at its body).

    `then`: what the header must hold after the identity (the planner's map digests) and why the
    file cannot be used when it does not."""
    size = os.fstat(f.fileno()).st_size
    if size > max_bytes:
        return f"{size} bytes, more than the {max_bytes} such a file may have"
    more, why_not = then
    at = len(magic) + _HASH + len(more)
    head = f.read(at + _HASH)
    if head[: len(magic)] != magic or len(head) != at + _HASH:
        return "not a file of this format"
    if head[len(magic) : len(magic) + _HASH] != ident:
        return "written by another agent build or with other flags"
    if head[len(magic) + _HASH : at] != more:
        return why_not
    h = hashlib.sha256()
    chunk = bytearray(1 << 20)
    while n := f.readinto(chunk):
        h.update(memoryview(chunk)[:n])
    if h.digest() != head[at:]:
        return "its body does not match its checksum (truncated or corrupted)"
    f.seek(len(head))
    return ""


def remove(path: str) -> None:
    """The file at `path` and what killed writers left beside it (`sweep`)."""
    with suppress(OSError):
        os.unlink(path)
    sweep(path)


def sweep(path: str) -> None:
    """Remove the `<path>.<pid>.tmp` files no writer holds (module doc): each opened without
    following a link or blocking on a FIFO, its lock tried without waiting (held: a live writer's,
    left), unlinked under the lock if the name still names it. A link put there is removed itself,
    never followed. One log line names what was removed."""
    directory, base = os.path.split(path)
    removed: list[str] = []
    freed = 0
    try:
        entries = list(os.scandir(directory or "."))
    except OSError:
        return
    for entry in entries:
        m = _TEMPORARY.fullmatch(entry.name)
        if m is None or m.group(1) != base:
            continue
        try:
            size = _unlink_unheld(entry.path)
        except OSError:
            continue
        if size is not None:
            removed.append(entry.name)
            freed += size
    if removed:
        log.info(
            "removed %s in %s (%d bytes): left by a stop killed while it wrote",
            ", ".join(sorted(removed)),
            directory,
            freed,
        )


def _unlink_unheld(name: str) -> int | None:
    """Unlink the file at `name` unless a writer holds its lock; its size if unlinked."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        size = os.lstat(name).st_size  # a link: removed, not followed
        os.unlink(name)
        return size
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a live writer's
        st = os.fstat(fd)
        if os.stat(name, follow_symlinks=False).st_ino != st.st_ino:
            return None  # renamed over, or made again since the open: not the file locked
        os.unlink(name)
        return st.st_size
    finally:
        os.close(fd)


class Restricted(pickle.Unpickler):
    """Builds only the `allowed` (module, name) classes, calling no other callable: a file put in
    the directory runs no code. pickle's BUILD can still set attributes on an allowed class (its
    state set on the class, not an instance), which only a file that passed the checksum could
    do: the directory is root's alone, and root needs no file to change this process."""

    def __init__(self, f: BinaryIO, allowed: set[tuple[str, str]], what: str) -> None:
        super().__init__(f)
        self._allowed = allowed
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of {self._what}")
        return super().find_class(module, name)


@contextmanager
def collector_held() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Hashing:
    """A file the pickler writes to, hashing what it writes (the body's checksum)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._h = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        self._h.update(data)
        return self._f.write(data)

    def digest(self) -> bytes:
        return self._h.digest()
