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
"""

from __future__ import annotations

import gc
import glob
import hashlib
import io
import os
import pickle
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO

from agent.config import Config

_HASH = 32  # sha256
_AGENT_DIR = Path(__file__).resolve().parent


def identity(magic: bytes, config: Config) -> bytes:
    """What a file is only good for: this format, this Python, this agent's source (every
    agent/**/*.py, read now: about 4 ms), these flags."""
    h = hashlib.sha256()
    for file in sorted(_AGENT_DIR.rglob("*.py")):
        h.update(str(file.relative_to(_AGENT_DIR)).encode() + b"\0")
        h.update(file.read_bytes())
    return hashlib.sha256(magic + sys.version.encode() + h.digest() + repr(config).encode()).digest()


def write(path: str, header: bytes, dump: Callable[[pickle.Pickler], None]) -> None:
    """`header`, the body's checksum, then what `dump` pickles; atomic (a new file renamed over)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with suppress(FileNotFoundError):
        os.unlink(tmp)  # an earlier process's of the same pid, killed while it wrote (or a link put there)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header + bytes(_HASH))
            body = Hashing(f)
            with collector_held():
                dump(pickle.Pickler(body, protocol=pickle.HIGHEST_PROTOCOL))
            f.seek(len(header))
            f.write(body.digest())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


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


def check(f: io.BufferedReader, magic: bytes, ident: bytes, max_bytes: int) -> str:
    """Why the file `write` made cannot be used ("" when it can: `f` is then at its body)."""
    size = os.fstat(f.fileno()).st_size
    if size > max_bytes:
        return f"{size} bytes, more than the {max_bytes} such a file may have"
    head = f.read(len(magic) + 2 * _HASH)
    if head[: len(magic)] != magic or len(head) != len(magic) + 2 * _HASH:
        return "not a file of this format"
    if head[len(magic) : len(magic) + _HASH] != ident:
        return "written by another agent build or with other flags"
    h = hashlib.sha256()
    chunk = bytearray(1 << 20)
    while n := f.readinto(chunk):
        h.update(memoryview(chunk)[:n])
    if h.digest() != head[len(magic) + _HASH :]:
        return "its body does not match its checksum (truncated or corrupted)"
    f.seek(len(head))
    return ""


def remove(path: str) -> None:
    for name in (path, *glob.glob(glob.escape(path) + ".*.tmp")):  # a stop killed while it wrote
        with suppress(OSError):
            os.unlink(name)


class Restricted(pickle.Unpickler):
    """Builds only the `allowed` (module, name) classes: a file put in the directory runs no code."""

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
