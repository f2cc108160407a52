"""eBPF mode's start-up checks say what is missing and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.ebpf import preflight
from agent.errors import FatalError


def test_all_present_on_this_machine_when_root() -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("checks root")
    assert preflight.check("/sys/fs/bpf/ebpf-kube-proxy").errors == []


def test_missing_pieces_name_the_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.ebpf.preflight.os.geteuid", lambda: 1000)
    monkeypatch.setattr("agent.ebpf.preflight.importlib.util.find_spec", lambda name: None)
    monkeypatch.setattr("agent.ebpf.preflight.platform.release", lambda: "0.0-nonexistent")
    found = preflight.check("relative/pins").errors
    text = "\n".join(found)
    assert "run the agent as root" in text
    assert "install Debian's python3-bpfcc" in text
    assert "no kernel headers at /lib/modules/0.0-nonexistent/build" in text
    assert "--bpf-pin-path must be absolute" in text
    assert all("--mode=iptables" in p for p in found if "bcc" in p or "headers" in p)


@pytest.mark.parametrize(
    ("release", "fails"),
    [("5.11.22-generic", True), ("5.12.0", False), ("5.15.0-91-generic", False), ("6.18.0-1-amd64", False)],
)
def test_a_kernel_older_than_the_minimum_is_named_with_the_remedy(release: str, fails: bool) -> None:
    """5.12-5.16 lack bpf_loop and load all the same (the SNAT walk in a bounded loop)."""
    found = preflight.kernel_problems(release)
    assert bool(found) is fails
    if fails:
        assert found[0].startswith(f"the kernel is {release}, and the data path needs Linux 5.12 or later")
        assert found[0].endswith(": upgrade the node's kernel to 5.12+, or run --mode=iptables")


def test_the_start_checks_the_running_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.ebpf.preflight.platform.release", lambda: "5.11.22-generic")
    assert any("Linux 5.12 or later" in p for p in preflight.check("/sys/fs/bpf/ebpf-kube-proxy").errors)
    monkeypatch.setattr("agent.ebpf.preflight.platform.release", lambda: "5.15.0-91-generic")
    assert not any("Linux 5.12" in p for p in preflight.check("/sys/fs/bpf/ebpf-kube-proxy").errors)


MOUNTS = """\
sysfs /sys sysfs rw 0 0
tmpfs /tmp tmpfs rw 0 0
bpf /sys/fs/bpf bpf rw 0 0
bpf /srv/my\\040pins bpf rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/sys/fs/bpf", "bpf"),
        ("/sys/fs/bpf/ebpf-kube-proxy", "bpf"),  # not there yet: the filesystem that would hold it
        ("/sys/fs/bpfx", "sysfs"),
        ("/tmp/x", "tmpfs"),
        ("/srv/my pins/ekp", "bpf"),
        ("/srv", ""),
    ],
)
def test_mount_type(path: str, fstype: str) -> None:
    from agent.ebpf.loader import mount_type

    assert mount_type(path, MOUNTS) == fstype


def test_pin_path_off_bpffs_is_an_error_before_anything_is_created(tmp_path: Path) -> None:
    wanted = tmp_path / "x" / "pins"
    [problem] = preflight.pin_path_problems(str(wanted))
    assert f"--bpf-pin-path {wanted} is not on a bpf filesystem" in problem
    assert "mount -t bpf bpf DIR" in problem
    assert not (tmp_path / "x").exists()


def test_pin_path_under_an_unmounted_sys_fs_bpf_is_left_to_the_loader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/sys/fs/bpf not mounted yet: the loader mounts it (agent/ebpf/loader.py ensure_bpffs)."""
    monkeypatch.setattr(preflight, "fs_type", lambda path: "sysfs")
    monkeypatch.setattr(preflight, "pin_dir_problems", lambda path: [])
    assert preflight.pin_path_problems("/sys/fs/bpf/ebpf-kube-proxy") == []
    assert preflight.pin_path_problems("/var/pins")[0].startswith("--bpf-pin-path /var/pins is not on")


def test_require_raises_one_fatal_error_with_every_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.ebpf.preflight.os.geteuid", lambda: 1000)
    with pytest.raises(FatalError) as info:
        preflight.require("/tmp/not-bpffs")
    text = str(info.value)
    assert text.startswith("eBPF mode cannot start: ")
    assert "run the agent as root" in text and "is not on a bpf filesystem" in text
