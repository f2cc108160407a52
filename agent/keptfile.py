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
held in tmpfs memory until reboot): the next write and the next start (`remove`) remove those of a
process that is gone, or that started after the file was last written (the pid reused, as in a new
container's pid namespace); a live writer's is left alone.
"""

from __future__ import annotations

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
    sweep(path)
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
    """Remove `<path>.<pid>.tmp` files whose writer is gone: its pid not a live process, or one
    that started after the file was last written (so not its writer). Unlinked, never followed (a
    link put there is removed itself). One log line names what was removed."""
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
            st = entry.stat(follow_symlinks=False)
            if _writing(int(m.group(2)), st.st_mtime):
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.name)
        freed += st.st_size
    if removed:
        log.info(
            "removed %s in %s (%d bytes): left by a stop killed while it wrote",
            ", ".join(sorted(removed)),
            directory,
            freed,
        )


def _writing(pid: int, mtime: float) -> bool:
    """Whether process `pid` may still be writing a file last written at `mtime`."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the fields after the command (which may hold spaces and parentheses): the 22nd of
            # the line, its start in clock ticks since boot, is the 20th after it
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return False  # no such process (or not one /proc can describe)
    started = _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    # the boot time is in whole seconds: a process started within a second of the write counts
    return started <= mtime + 1


def _boot_time() -> float:
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise OSError("/proc/stat holds no btime")


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
