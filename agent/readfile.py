"""Reading a file the agent is pointed at: regular files only, never more than a limit.

Every file named on the command line or in a file named there goes through `read_regular`:
`--config`, `--kubeconfig` and the certificate, key and token files its current context names, the
service account's token and CA, and `--services-file`. A path can name anything: `/dev/zero` read
without bound grew the agent by 11 GB in 30 s, and a FIFO (or a device that never answers) hung
it at start. So the file is opened non-blocking (opening a FIFO with no writer returns at once
instead of waiting for one), refused unless fstat() says it is a regular file, refused when it is
larger than the limit, and read only up to the limit even if it grows meanwhile.

Failures are OSErrors whose `strerror` says what is wrong in words an operator can act on:
what open(2) reports (FileNotFoundError, PermissionError, ...), `NotRegularFile`, `FileTooLarge`.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFile(OSError):
    """The path names a directory, a FIFO, a device or a socket."""


class FileTooLarge(OSError):
    """More bytes than the caller's limit."""


def _not_regular(path: str, mode: int) -> NotRegularFile:
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    return NotRegularFile(errno.EINVAL, f"not a regular file ({kind})", path)


def _open_regular(path: str) -> tuple[BinaryIO, os.stat_result]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a Unix socket cannot be opened at all: say what it is
            raise _not_regular(path, os.stat(path).st_mode) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str) -> None:
    """Raises what `read_regular` would, but for the size: the file opens and is a regular file."""
    f, _ = _open_regular(path)
    f.close()


def read_regular(path: str, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed), at most `max_bytes` of them."""
    f, st = _open_regular(path)
    with f:
        if st.st_size > max_bytes:
            raise FileTooLarge(errno.EFBIG, f"{st.st_size} bytes, over the limit of {max_bytes}", path)
        # Sized by what stat() said (read(n) allocates n bytes up front), then on in steps while
        # the file grows under us, never past the limit.
        chunks = [f.read(st.st_size + 1)]
        total = len(chunks[0])
        while total > st.st_size and total <= max_bytes:
            chunk = f.read(min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    if total > max_bytes:
        raise FileTooLarge(errno.EFBIG, f"over the limit of {max_bytes} bytes (it grew while read)", path)
    return b"".join(chunks)


def reason(exc: OSError) -> str:
    """What went wrong, without the path (callers name the file in their own words)."""
    return exc.strerror or str(exc)
