"""The agent mounts bpffs on /sys/fs/bpf when it is missing (checked in a private mount namespace)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lab.harness import REPO

pytestmark = pytest.mark.kernel

SCRIPT = """
import os
from agent.ebpf.loader import _on_bpffs, ensure_bpffs
assert not _on_bpffs("/sys/fs/bpf"), "umount in the private namespace did not take"
assert ensure_bpffs("/sys/fs/bpf/ebpf-kube-proxy") is True
assert _on_bpffs("/sys/fs/bpf")
assert ensure_bpffs("/sys/fs/bpf/ebpf-kube-proxy") is False, "second call mounts nothing"
assert ensure_bpffs("/tmp/elsewhere") is False, "pins elsewhere are left to the operator"
print("ok")
"""


def test_mounts_missing_bpffs_in_private_mount_namespace() -> None:
    # --propagation private: the umount and mount below never reach the machine's namespace.
    res = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"umount /sys/fs/bpf 2>/dev/null; exec {sys.executable} -c '{SCRIPT}'",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
        check=False,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
