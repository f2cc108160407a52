"""The one bounded, regular-files-only read behind every file the agent is pointed at."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from agent.readfile import FileTooLarge, NotRegularFile, check_regular, read_regular


def test_a_regular_file_and_a_symlink_to_one(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "link").symlink_to(tmp_path / "f")  # a ConfigMap volume's ..data links
    assert read_regular(str(tmp_path / "link"), 3) == b"abc"
    check_regular(str(tmp_path / "link"))


@pytest.mark.parametrize(
    ("path", "kind"),
    [("/dev/zero", "a character device"), ("fifo", "a FIFO"), ("dir", "a directory"), ("sock", "a socket")],
)
def test_anything_else_is_refused_at_once(tmp_path: Path, path: str, kind: str) -> None:
    os.mkfifo(tmp_path / "fifo")  # no writer: opening it blocking would wait for ever
    (tmp_path / "dir").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        for check in (lambda p: read_regular(p, 1 << 20), check_regular):
            with pytest.raises(NotRegularFile) as err:
                check(str(tmp_path / path))
            assert err.value.strerror == f"not a regular file ({kind})"
    finally:
        sock.close()


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # a terabyte that costs nothing on disk, and must cost nothing here
    with pytest.raises(FileTooLarge) as err:
        read_regular(str(path), 1 << 20)
    assert err.value.strerror == f"{1 << 40} bytes, over the limit of {1 << 20}"
    path.write_bytes(b"x" * 10)
    assert read_regular(str(path), 10) == b"x" * 10
    with pytest.raises(FileTooLarge):
        read_regular(str(path), 9)


def test_what_open_says_is_passed_on(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_regular(str(tmp_path / "missing"), 10)
