"""One agent per node: a lock per network namespace and per pin path, held for the agent's life.

Two agents programming the same node overwrite each other's rules and map entries, and an
`agent --cleanup` run beside a live agent removes what the live one serves with. So `acquire`
takes an exclusive, non-blocking flock(2) on one lock file per thing a node's agent owns:

* the network namespace it programs (`--netns`, else its own), named by the namespace's inode
  (`netns-4026531840.lock`): two names for one namespace are one lock;
* the bpffs pin path (eBPF mode and `--cleanup`, the two that touch pins), named after the
  resolved path plus a hash of it (`pin-sys-fs-bpf-ebpf-kube-proxy-<hash>.lock`).

A second agent (or cleanup) fails at once with `FatalError` naming the PID written in the lock
file by the holder. The kernel drops a flock when the last descriptor of its open file goes away,
so an agent that is SIGKILLed never blocks its restart; forked children (pyroute2's namespace
helpers) close their inherited copies at fork (`os.register_at_fork`), so only the agent process
holds the lock, and exec'd ones never get it (O_CLOEXEC).

The lock files live under /run/ebpf-kube-proxy/ (tmpfs, gone at reboot; bpffs cannot hold regular
files), a directory the agent creates with mode 0700, owned by the agent's user: a directory another
user could write into would let them hold our lock (and so stop the agent from starting) or unlink
it. An existing directory is refused only when group or others may write to it: the kubelet creates
a `DirectoryOrCreate` hostPath (pkg/volume/hostpath/host_path.go, `makeDir`; the Helm chart shares
this directory between an agent's pods, so one agent per node holds across a rolling update) with
mode 0755, which is as safe, since the lock files themselves are 0600. `release()` unlinks the file
while still holding it; an acquirer that locked a file somebody unlinked in the meantime notices
(the path no longer names its descriptor's inode) and tries again, so two agents can never both
believe they hold the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import time
from dataclasses import dataclass

from agent.config import Config, Mode
from agent.errors import FatalError
from agent.netns import NETNS_RUN_DIR

log = logging.getLogger(__name__)

LOCK_DIR = "/run/ebpf-kube-proxy"
OWN_NETNS = "/proc/self/ns/net"
_ATTEMPTS = 20  # opens of a lock file that another agent unlinked under us, before giving up
_HOLDER_WAIT_S = 0.5  # how long to wait for a fresh holder to write its PID

# Descriptors this process holds locks on; closed in forked children (see the module docstring).
_HELD: set[int] = set()


def _close_held_in_child() -> None:
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


@dataclass(frozen=True)
class LockTarget:
    """One lock file and what it stands for, in the words of the refusal message."""

    name: str  # file name under the lock directory
    what: str  # "network namespace 'lab-node1' (inode 4026532)" / "pin path /sys/fs/bpf/x"
    elsewhere: str  # how to run a second agent legitimately: "another --netns"


def pin_lock_name(pin_path: str) -> str:
    """`pin-<path with / as ->-<12 hex of its sha256>.lock`: readable, unique, short enough."""
    slug = re.sub(r"[^A-Za-z0-9._]+", "-", pin_path).strip("-")[:100]
    digest = hashlib.sha256(pin_path.encode()).hexdigest()[:12]
    return f"pin-{slug}-{digest}.lock"


def netns_lock_name(inode: int) -> str:
    return f"netns-{inode}.lock"


def netns_path(netns: str) -> str:
    return os.path.join(NETNS_RUN_DIR, netns) if netns else OWN_NETNS


def lock_targets(config: Config, netns_inode: int) -> list[LockTarget]:
    """What an agent with `config` must hold: its namespace always, its pin path when it touches pins."""
    where = f"network namespace {config.netns!r}" if config.netns else "the agent's own network namespace"
    targets = [LockTarget(netns_lock_name(netns_inode), f"{where} (inode {netns_inode})", "another --netns")]
    if config.mode is Mode.EBPF or config.cleanup:
        pin = os.path.realpath(config.pin_path)
        targets.append(LockTarget(pin_lock_name(pin), f"pin path {pin}", "another --bpf-pin-path"))
    return targets


class Lock:
    """Locks held by this process; `release()` (or leaving the `with` block) gives them back."""

    def __init__(self, held: list[tuple[int, str]]) -> None:
        self._held = held  # (fd, lock file path)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(path for _, path in self._held)

    def release(self) -> None:
        """Unlink each lock file (if it is still ours) while holding it, then close it."""
        for fd, path in reversed(self._held):
            try:
                if _same_file(fd, path):
                    os.unlink(path)
            except OSError as exc:
                log.warning("could not remove lock file %s: %s (harmless: it is reused)", path, exc)
            finally:
                _HELD.discard(fd)
                os.close(fd)
        self._held = []

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(config: Config, *, lock_dir: str = LOCK_DIR) -> Lock:
    """Lock the node for this agent, or raise FatalError naming the PID of the agent holding it."""
    try:
        inode = os.stat(netns_path(config.netns)).st_ino
    except FileNotFoundError:
        raise FatalError(
            f"network namespace {config.netns!r} does not exist ({netns_path(config.netns)}): "
            "create it first, or fix --netns"
        ) from None
    ensure_lock_dir(lock_dir)
    held: list[tuple[int, str]] = []
    try:
        for target in lock_targets(config, inode):
            path = os.path.join(lock_dir, target.name)
            held.append((_lock_file(path, target), path))
    except BaseException:
        Lock(held).release()
        raise
    return Lock(held)


def ensure_lock_dir(lock_dir: str) -> None:
    """Create the lock directory 0700; refuse one that is a symlink, foreign or writable by others
    (0755, as the kubelet creates a hostPath directory, is fine)."""
    try:
        os.mkdir(lock_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise FatalError(
            f"cannot create the lock directory {lock_dir}: {exc.strerror}. The agent runs as root and "
            "needs a writable /run (in a container: mount an emptyDir or the host's /run there)"
        ) from None
    st = os.lstat(lock_dir)
    problem = ""
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory (a symlink?)"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by the agent's uid {os.geteuid()}"
    elif st.st_mode & 0o022:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}, writable by other users"
    if problem:
        raise FatalError(
            f"the lock directory {lock_dir} {problem}: another user could hold or remove the lock that "
            f"keeps two agents apart. Remove it (rm -r {lock_dir}) and start the agent again"
        )


def _lock_file(path: str, target: LockTarget) -> int:
    for _ in range(_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FatalError(f"the lock file {path} is a symlink: remove it and start again") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise FatalError(
                f"another agent ({holder}) is already running for {target.what} (lock {path}): two "
                "agents would overwrite each other's rules and maps, and --cleanup would remove what "
                f"the running one serves with. Stop that agent first, or point this one at {target.elsewhere}"
            ) from None
        if not _same_file(fd, path):
            os.close(fd)  # the previous holder unlinked it between our open and our flock
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{target.what}\n".encode(), 0)
        _HELD.add(fd)
        return fd
    raise RuntimeError(f"lock file {path} kept being replaced while locking it ({_ATTEMPTS} attempts)")


def _same_file(fd: int, path: str) -> bool:
    try:
        on_path = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (on_path.st_dev, on_path.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(fd: int) -> str:
    """`PID 1234` from a held lock file (a fresh holder may not have written it yet: wait a little)."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        first = os.pread(fd, 64, 0).split(b"\n", 1)[0].strip()
        if first.isdigit():
            return f"PID {int(first)}"
        if time.monotonic() >= deadline:
            return "PID unknown: the lock file holds no PID yet"
        time.sleep(0.01)
