"""One agent per node: the lock files, kernel-free (a temporary lock directory, this process's netns)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.config import Config, Mode
from agent.errors import FatalError
from agent.lock import acquire, lock_targets, netns_lock_name, pin_lock_name
from lab.harness import REPO

EBPF = Config(mode=Mode.EBPF, pin_path="/sys/fs/bpf/ebpf-kube-proxy")
OWN_NETNS_INODE = os.stat("/proc/self/ns/net").st_ino


def test_targets_name_the_namespace_always_and_the_pin_path_when_pins_are_touched() -> None:
    names = [t.name for t in lock_targets(EBPF, 4026531840)]
    assert names == ["netns-4026531840.lock", pin_lock_name("/sys/fs/bpf/ebpf-kube-proxy")]
    iptables = Config(mode=Mode.IPTABLES, netns="lab-node1")
    [only] = lock_targets(iptables, 7)
    assert only.name == netns_lock_name(7)
    assert only.what == "network namespace 'lab-node1' (inode 7)"
    cleanup = Config(mode=Mode.IPTABLES, cleanup=True)
    assert len(lock_targets(cleanup, 7)) == 2, "--cleanup removes pins of both modes"


def test_pin_lock_names_are_readable_and_distinct() -> None:
    a = pin_lock_name("/sys/fs/bpf/a-b")
    b = pin_lock_name("/sys/fs/bpf/a/b")
    assert a.startswith("pin-sys-fs-bpf-a-b-") and a.endswith(".lock")
    assert a != b, "paths that slug alike still get their own lock"
    assert len(pin_lock_name("/x" * 500)) < 160


def test_second_acquire_fails_naming_the_holder_and_release_frees_it(tmp_path: Path) -> None:
    lock_dir = str(tmp_path / "locks")
    first = acquire(EBPF, lock_dir=lock_dir)
    assert os.stat(lock_dir).st_mode & 0o777 == 0o700
    for path in first.paths:
        assert Path(path).read_text().splitlines()[0] == str(os.getpid())

    with pytest.raises(FatalError) as info:
        acquire(Config(mode=Mode.IPTABLES, pin_path="/elsewhere"), lock_dir=lock_dir)
    text = str(info.value)
    assert (
        f"another agent (PID {os.getpid()}) is already running for the agent's own network namespace" in text
    )
    assert f"(inode {OWN_NETNS_INODE})" in text and "another --netns" in text

    first.release()
    assert os.listdir(lock_dir) == [], "a clean release removes the lock files"
    with acquire(EBPF, lock_dir=lock_dir) as again:
        assert len(again.paths) == 2


def test_one_pin_path_spelled_two_ways_is_one_lock(tmp_path: Path) -> None:
    pins = tmp_path / "pins"
    pins.mkdir()
    (tmp_path / "alias").symlink_to(pins)
    names = {
        lock_targets(Config(mode=Mode.EBPF, pin_path=spelling), 1)[1].name
        for spelling in (str(pins), f"{pins}/./", f"{tmp_path}/alias", f"{pins}/../pins")
    }
    assert len(names) == 1


@pytest.mark.kernel
def test_a_failed_acquire_gives_back_what_it_took(tmp_path: Path) -> None:
    """A holder in another network namespace holds the pin path: the namespace lock taken first is
    released again when the pin lock is refused."""
    lock_dir = tmp_path / "locks"
    holder = _hold_in_child(str(lock_dir), EBPF, own_netns=True)
    try:
        held_by_child = set(os.listdir(lock_dir))
        with pytest.raises(FatalError, match=f"another agent \\(PID {holder.pid}\\).*pin path"):
            acquire(EBPF, lock_dir=str(lock_dir))
        assert set(os.listdir(lock_dir)) == held_by_child, "our namespace lock was given back"
        assert netns_lock_name(OWN_NETNS_INODE) not in held_by_child
    finally:
        holder.kill()
        holder.wait()


def test_a_sigkilled_holder_never_blocks_the_next_agent(tmp_path: Path) -> None:
    lock_dir = str(tmp_path / "locks")
    holder = _hold_in_child(lock_dir, EBPF, fork_grandchild=True)
    try:
        with pytest.raises(FatalError, match=f"PID {holder.pid}"):
            acquire(EBPF, lock_dir=lock_dir)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        # The holder's forked child is still alive, with copies of every descriptor it had: the
        # lock must be gone with the holder anyway.
        with acquire(EBPF, lock_dir=lock_dir) as lock:
            assert len(lock.paths) == 2
    finally:
        holder.kill()
        holder.wait()
        _kill_grandchild(tmp_path)


def test_the_lock_directory_must_be_ours(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(FatalError, match=r"has mode 0777, writable by other users.*rm -r"):
        acquire(EBPF, lock_dir=str(open_dir))
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o770)
    with pytest.raises(FatalError, match=r"has mode 0770, writable by other users"):
        acquire(EBPF, lock_dir=str(group))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(FatalError, match="is not a directory"):
        acquire(EBPF, lock_dir=str(link))
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(FatalError, match="is owned by uid 65534"):
            acquire(EBPF, lock_dir=str(foreign))


def test_a_hostpath_directory_made_by_the_kubelet_is_accepted(tmp_path: Path) -> None:
    """The Helm chart mounts /run/ebpf-kube-proxy from the host (type DirectoryOrCreate, which
    the kubelet creates 0755): readable by others, writable by nobody else, so usable."""
    kubelet_made = tmp_path / "run-ebpf-kube-proxy"
    kubelet_made.mkdir()
    kubelet_made.chmod(0o755)
    with acquire(EBPF, lock_dir=str(kubelet_made)) as lock:
        assert len(lock.paths) == 2
        assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in lock.paths)


def test_a_missing_network_namespace_is_fatal(tmp_path: Path) -> None:
    with pytest.raises(FatalError, match="network namespace 'no-such-ns-ekp' does not exist"):
        acquire(Config(netns="no-such-ns-ekp"), lock_dir=str(tmp_path))


def _hold_in_child(
    lock_dir: str, config: Config, *, fork_grandchild: bool = False, own_netns: bool = False
) -> subprocess.Popen[str]:
    """A child process that takes the lock, prints `held`, then sleeps (after forking a sleeper);
    with `own_netns`, in a network namespace of its own (unshare -n, root only)."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from agent.config import Config, Mode
        from agent.lock import acquire
        lock = acquire(Config(mode=Mode({config.mode.value!r}), pin_path={config.pin_path!r}),
                       lock_dir={lock_dir!r})
        if {fork_grandchild!r}:
            pid_file = {lock_dir!r} + "/../grandchild.pid"
            if os.fork() == 0:
                # Past fork's after-in-child hooks: the state the agent's forked helpers run in.
                with open(pid_file + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(pid_file + ".tmp", pid_file)
                time.sleep(60)
                os._exit(0)
            while not os.path.exists(pid_file):
                time.sleep(0.01)
        print("held", flush=True)
        time.sleep(60)
        """
    )
    argv = [sys.executable, "-c", script]
    proc = subprocess.Popen(
        ["unshare", "-n", *argv] if own_netns else argv, cwd=str(REPO), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill_grandchild(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
