"""The pin directory is ours: created 0700, refused when another user made it or can write to it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from agent.ebpf.pindir import component_problem, pin_dir_problems
from lab.harness import REPO

ROOT = 0
AGENT = 0


def st(mode: int, uid: int = ROOT) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 0, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("mode", "uid", "final", "problem"),
    [
        (stat.S_IFDIR | 0o700, ROOT, True, ""),
        (stat.S_IFDIR | 0o755, ROOT, True, ""),  # made by an older agent: nobody else can write
        (stat.S_IFDIR | 0o1777, ROOT, False, ""),  # /sys/fs/bpf itself: sticky
        (stat.S_IFDIR | 0o555, ROOT, False, ""),
        (stat.S_IFDIR | 0o700, 1000, True, "is owned by uid 1000, not root"),
        (stat.S_IFDIR | 0o755, 1000, False, "is owned by uid 1000, not root"),
        (stat.S_IFDIR | 0o777, ROOT, True, "has mode 0777: group or other users"),
        (stat.S_IFDIR | 0o1777, ROOT, True, "has mode 1777"),  # sticky is not enough for our own dir
        (stat.S_IFDIR | 0o775, ROOT, True, "has mode 0775"),
        (stat.S_IFDIR | 0o777, ROOT, False, "writable by others without the sticky bit"),
        (stat.S_IFLNK | 0o777, ROOT, True, "is a symlink"),
        (stat.S_IFLNK | 0o777, ROOT, False, "is a symlink"),
        (stat.S_IFREG | 0o600, ROOT, True, "is not a directory"),
    ],
)
def test_component_problems(mode: int, uid: int, final: bool, problem: str) -> None:
    found = component_problem(st(mode, uid), AGENT, final=final)
    assert (problem in found) if problem else found == ""


def test_only_existing_components_are_judged(tmp_path: Path) -> None:
    assert pin_dir_problems(str(tmp_path / "not" / "yet")) == []
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    [problem] = pin_dir_problems(str(tmp_path / "open"))
    assert problem.startswith(f"--bpf-pin-path {tmp_path}/open: {tmp_path}/open has mode 0777")
    assert "chmod 0700" in problem


SCRIPT = r"""
import os, stat, subprocess, sys
from agent.errors import FatalError
from agent.ebpf.loader import Datapath, _on_bpffs
from agent.ebpf.pindir import ensure_pin_dir
from agent.ebpf.preflight import pin_path_problems

root = sys.argv[1]
assert _on_bpffs(root)

def refused(path, text):
    try:
        ensure_pin_dir(path)
    except FatalError as exc:
        assert text in str(exc), str(exc)
    else:
        raise AssertionError(f"{path} accepted")
    assert any(text in p for p in pin_path_problems(path)), pin_path_problems(path)

# Made by another user in the world-writable (1777) bpffs root, as on /sys/fs/bpf.
subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                "mkdir", root + "/foreign"], check=True)
assert os.stat(root + "/foreign").st_uid == 65534
refused(root + "/foreign", "is owned by uid 65534, not root")
try:
    Datapath(root + "/foreign").load()
except FatalError as exc:
    assert "owned by uid 65534" in str(exc)
else:
    raise AssertionError("the loader used a foreign pin directory")
assert os.listdir(root + "/foreign") == [], "nothing pinned there"

# Another user's directory above ours.
subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                "mkdir", "-m", "0755", root + "/team"], check=True)
refused(root + "/team/ekp", "is owned by uid 65534")

os.mkdir(root + "/open")
os.chmod(root + "/open", 0o777)
refused(root + "/open", "has mode 0777")

os.mkdir(root + "/real", 0o700)
os.symlink(root + "/real", root + "/link")
refused(root + "/link", "is a symlink")
refused(root + "/link/ekp", "is a symlink")

ensure_pin_dir(root + "/fresh/ekp")
fresh = os.stat(root + "/fresh/ekp")
assert stat.S_IMODE(fresh.st_mode) == 0o700 and fresh.st_uid == 0, oct(fresh.st_mode)
assert stat.S_IMODE(os.stat(root + "/fresh").st_mode) & 0o022 == 0
ensure_pin_dir(root + "/fresh/ekp")  # a second start accepts its own directory
assert pin_path_problems(root + "/fresh/ekp") == []
print("ok")
"""


@pytest.mark.kernel
def test_pin_directories_in_a_private_bpffs() -> None:
    # Outside pytest's 0700 tmp tree: the user 65534 must reach the bpffs to make its directory.
    mnt = Path(tempfile.mkdtemp(prefix="ekp-pindir-"))
    mnt.chmod(0o755)
    # A private mount namespace: the bpffs mounted here is gone with the process, nothing reaches
    # the machine's /sys/fs/bpf.
    res = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'mount -t bpf bpf "$1" && exec {sys.executable} -c "$2" "$1"',
            "sh",
            str(mnt),
            textwrap.dedent(SCRIPT),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
        check=False,
    )
    mnt.rmdir()  # the mount lived in the private namespace only
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
