"""Low-level helpers for the lab: `ip` batches, namespace sockets, cgroups, leftovers and the kernel gate.

Nothing here knows the lab's topology; `lab.core` builds on it.

* `ip_batch(lines, ns=None)` runs many `ip` commands in one process (`ip [-n NS] -batch -`).
* `in_netns(ns, fn)` runs `fn` on a short-lived thread that has joined network namespace `ns`
  (setns(2) is per thread, so the rest of the process stays where it is). Sockets created there
  belong to `ns` for their whole life, whichever thread uses them later: that is how the lab's
  in-process clients (`Lab.http_get`, `Lab.udp_echo`, readiness polls) talk from inside a namespace
  without forking.
* `cleanup_leftovers()` / `find_leaks()` find what a lab run may leave behind: namespaces named
  `ekp<6 hex>-<role>`, cgroups `<cgroup2>/ekp<6 hex>`, bpffs pins `/sys/fs/bpf/ebpf-kube-proxy-lab-ekp...`,
  temporary directories `<tmp>/ekp<6 hex>-*`.
* `kernel_problem()` says why kernel tests cannot run here, or None.
* `scratch_netns(prefix)` makes a throwaway namespace with an xtables lock of its own
  (`XTABLES_LOCKFILE`, in a temporary directory `ekp<6 hex>-<namespace>-xtables-*`), for tests and
  benchmarks that program it from their own process.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

NETNS_DIR = "/run/netns"
BPFFS = "/sys/fs/bpf"
PIN_PREFIX = "ebpf-kube-proxy-lab-"
PREFIX_RE = re.compile(r"^ekp[0-9a-f]{6}$")
NS_RE = re.compile(r"^(ekp[0-9a-f]{6})-")
_LAB_NAME_RE = re.compile(r"^(ekp[0-9a-f]{6})(?:-|$)")  # NS_RE's, or a lab's cgroup: the prefix alone

CLONE_NEWNET = 0x40000000
# iptables-legacy (1.8.9 here) takes the lock file this variable names instead of the host-wide
# /run/xtables.lock. A real node has a /run of its own; the lab's namespaces share the host's,
# where one node's (or the bench's) long restore would make every other node's `-w 5` time out.
XTABLES_LOCKFILE = "XTABLES_LOCKFILE"
_libc = ctypes.CDLL(None, use_errno=True)


class LabError(RuntimeError):
    """A lab operation failed (command error, server not ready, teardown left something)."""


def new_prefix() -> str:
    """A fresh per-lab prefix: `ekp` + 6 random hex digits."""
    return "ekp" + secrets.token_hex(3)


# ---------------------------------------------------------------------------------------------- ip


def ip_batch(lines: Iterable[str], ns: str | None = None, *, force: bool = False) -> None:
    """Run `ip` commands, one per line, in a single `ip -batch -` process (inside `ns` if given).

    With `force`, errors do not stop the batch and are not raised (used by teardown).
    """
    text = "".join(line + "\n" for line in lines)
    if not text:
        return
    argv = ["ip"]
    if ns is not None:
        argv += ["-n", ns]
    if force:
        argv.append("-force")
    argv += ["-batch", "-"]
    res = subprocess.run(argv, input=text, capture_output=True, text=True, check=False)
    if res.returncode != 0 and not force:
        raise LabError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}\nbatch:\n{text}")


def ip_batches(batches: dict[str, list[str]]) -> None:
    """Run one `ip -n NS -batch -` per namespace, all processes at once; raise on the first failure."""
    procs: list[tuple[str, str, subprocess.Popen[str]]] = []
    for ns, lines in batches.items():
        text = "".join(line + "\n" for line in lines)
        if not text:
            continue
        p = subprocess.Popen(
            ["ip", "-n", ns, "-batch", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append((ns, text, p))
    errors: list[str] = []
    for ns, text, p in procs:
        _, err = p.communicate(text)
        if p.returncode != 0:
            errors.append(f"ip -n {ns} -batch failed ({p.returncode}): {err.strip()}\nbatch:\n{text}")
    if errors:
        raise LabError("\n".join(errors))


# ------------------------------------------------------------------------------------- namespaces


def netns_path(ns: str) -> str:
    return os.path.join(NETNS_DIR, ns)


def list_netns() -> list[str]:
    """Names of the named network namespaces (those under /run/netns)."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def netns_pids(ns: str) -> list[int]:
    """Pids of every process whose network namespace is `ns` (`ip netns pids`)."""
    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    return [int(tok) for tok in res.stdout.split() if tok.isdigit()]


def delete_netns(names: Iterable[str]) -> None:
    """Delete namespaces, ignoring ones already gone."""
    ip_batch((f"netns del {ns}" for ns in names), force=True)


@contextlib.contextmanager
def scratch_netns(prefix: str) -> Iterator[str]:
    """A new namespace `<prefix>-<8 hex>`, deleted on exit, whose xtables lock is its own.

    The lock is this process's `XTABLES_LOCKFILE` while the block runs (the value before put
    back after), so an in-process runner's `ip netns exec` children and the caller's own
    iptables calls share it, as one node's processes do, and nothing else does. One such block
    at a time per process: the variable is process-wide.
    """
    name = f"{prefix}-{secrets.token_hex(4)}"
    before = os.environ.get(XTABLES_LOCKFILE)
    lock_dir: str | None = None
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        # Named as a lab's tmp dir (`ekp<6 hex>-*`, `tmp_dirs`): a killed run's is one more
        # leftover `python -m lab cleanup` removes (a running one's it leaves: `owned_tmpdir`);
        # the namespace's name says whose it was.
        lock_dir = owned_tmpdir(f"{new_prefix()}-{name}-xtables-", name)
        os.environ[XTABLES_LOCKFILE] = os.path.join(lock_dir, "xtables.lock")
        yield name
    finally:
        if before is None:
            os.environ.pop(XTABLES_LOCKFILE, None)
        else:
            os.environ[XTABLES_LOCKFILE] = before
        delete_netns([name])
        if lock_dir is not None:
            shutil.rmtree(lock_dir, ignore_errors=True)


@contextlib.contextmanager
def flock_held(path: str, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """Hold flock(2) on `path`, as iptables-legacy takes its xtables lock, for `seconds` at most
    from the time the block starts (a child process lets go when its sleep ends, or when the
    block ends, whichever is first). The child is still running while the lock is held."""
    holder = subprocess.Popen(
        # --close: only flock(1) itself holds the lock, so killing its group lets go at once.
        [
            "flock",
            "--exclusive",
            "--timeout",
            "30",
            "--close",
            path,
            "sh",
            "-c",
            'echo held; exec sleep "$0"',
            str(seconds),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None
        if holder.stdout.readline() != "held\n":  # the command runs only once the lock is taken
            raise LabError(f"flock on {path} not taken within 30 s (exit {holder.wait()})")
        yield holder
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """Call `fn` on a fresh thread that has joined network namespace `ns`; return its result.

    Only that thread moves (network namespaces may be joined per thread), so the caller and every
    other thread stay in their namespace. Whatever `fn` creates that is bound to a namespace at
    creation time (sockets, /proc/sys/net files opened there) stays bound to `ns`.
    """
    dest = os.open(netns_path(ns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        return in_netns_fd(dest, fn, name=f"netns:{ns}")
    finally:
        os.close(dest)


def in_netns_fd(dest: int, fn: Callable[[], T], *, name: str = "netns") -> T:
    """in_netns for a namespace held open as `dest` (an fd of /proc/.../ns/net or /run/netns/X)."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(dest)
                try:
                    result.append(fn())
                finally:
                    _setns(own)
            finally:
                os.close(own)
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def ns_socket(ns: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket that lives in network namespace `ns` (usable from any thread)."""
    return in_netns(ns, lambda: socket.socket(family, type))


# ------------------------------------------------------------------------------------- processes


def proc_starttime(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    # fields[0] is the state (field 3), so field 22 is fields[19].
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return int(fields[19])


def alive(pid: int, starttime: int | None = None) -> bool:
    """True if `pid` runs (not a zombie) and, when given, still has the same start time."""
    st = proc_starttime(pid)
    return st is not None and (starttime is None or st == starttime)


def kill_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_netns(ns: str, *, timeout: float = 2.0) -> list[int]:
    """SIGKILL every process in namespace `ns` until none is left (or `timeout`); return the pids seen."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in netns_pids(ns) if p != os.getpid()]
        if not pids:
            return seen
        seen += [p for p in pids if p not in seen]
        kill_pids(pids)
        if time.monotonic() > deadline:
            return seen
        time.sleep(0.01)


# --------------------------------------------------------------------------------------- cgroups


@functools.cache
def cgroup2_root() -> str | None:
    """Mount point of the cgroup v2 hierarchy (`/sys/fs/cgroup` or `/sys/fs/cgroup/unified`), or None."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "cgroup2" and os.access(parts[1], os.W_OK):
                    return parts[1]
    except OSError:
        pass
    return None


def cgroup_procs(path: str) -> list[int]:
    """Pids in cgroup `path` and all its descendants."""
    pids: list[int] = []
    for dirpath, _dirs, _files in os.walk(path):
        with contextlib.suppress(OSError), open(os.path.join(dirpath, "cgroup.procs"), encoding="ascii") as f:
            pids += [int(x) for x in f.read().split()]
    return pids


def remove_cgroup_tree(path: str, *, timeout: float = 2.0) -> bool:
    """Kill every process in cgroup tree `path` and remove it; return True when it is gone."""
    if not os.path.isdir(path):
        return True
    deadline = time.monotonic() + timeout
    while True:
        kill_file = os.path.join(path, "cgroup.kill")
        if os.path.exists(kill_file):
            with contextlib.suppress(OSError), open(kill_file, "w", encoding="ascii") as f:
                f.write("1")
        else:
            kill_pids(cgroup_procs(path))
        busy = False
        for dirpath, _dirs, _files in os.walk(path, topdown=False):
            try:
                os.rmdir(dirpath)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                    raise
                busy = True
        if not busy or time.monotonic() > deadline:
            return not os.path.isdir(path)
        time.sleep(0.01)


# ------------------------------------------------------------------------------------- leftovers


def pin_dirs(prefix: str | None = None) -> list[str]:
    """bpffs entries `/sys/fs/bpf/ebpf-kube-proxy-lab-<prefix>-*` (any prefix when None)."""
    pattern = f"{PIN_PREFIX}{prefix}-*" if prefix else f"{PIN_PREFIX}ekp*"
    return sorted(glob.glob(os.path.join(BPFFS, pattern)))


def tmp_dirs(prefix: str | None = None) -> list[str]:
    """Temporary directories `<tmp>/<prefix>-*` (any lab prefix, `ekp<6 hex>`, when None)."""
    pattern = f"{prefix}-*" if prefix else "ekp*-*"
    found = glob.glob(os.path.join(tempfile.gettempdir(), pattern))
    # glob's `?` takes any character: `ekp??????-*` also named other tests' `ekp-guard-*` dirs.
    return sorted(d for d in found if NS_RE.match(os.path.basename(d)) and os.path.isdir(d))


OWNER_FILE = "owner"
AGENT_STATE_DIR = "/run/ebpf-kube-proxy"  # agent.lock.LOCK_DIR (a test checks it)
_LIBERAL_RE = re.compile(r"^takeover-netns-(\d+)\.liberal(\.\d+\.tmp)?$")
STAGING = "ekp-scratch-"  # scratch_netns's lock dir before it has a lab name
_STAGING_RE = re.compile(rf"^{STAGING}(\d+)\.(\d+)-")


def _staging_prefix(ns: str) -> str:
    """`ekp-scratch-<pid>.<start time>-<ns>-`: the owner in the name, there from mkdtemp on (an
    owner file comes a moment later: a cleanup in between would take the dir for a dead one's)."""
    pid, start = _this_process()
    return f"{STAGING}{pid}.{start}-{ns}-"


def _this_process() -> tuple[int, int]:
    """This process's pid and start time: what names it as a tmp dir's owner (`alive`)."""
    pid = os.getpid()
    start = proc_starttime(pid)
    if start is None:  # no owner named would read as a dead one's: the dir removed from under us
        raise RuntimeError(f"cannot read this process's start time (/proc/{pid}/stat)")
    return pid, start


def sweep_staging(*, dry_run: bool = False) -> list[str]:
    """Remove scratch_netns's staging dirs whose owner (named in the dir's name) is gone: a run
    killed between mkdtemp and the rename to a lab name; return them. One named the older way
    (no owner in its name) is removed only once its owner file names a process gone."""
    removed = []
    for d in sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"{STAGING}*"))):
        if not os.path.isdir(d) or os.path.islink(d):
            continue
        m = _STAGING_RE.match(os.path.basename(d))
        if m is not None:
            if alive(int(m.group(1)), int(m.group(2))):
                continue
        elif not os.path.exists(os.path.join(d, OWNER_FILE)) or owner_alive(d) is not None:
            continue  # maybe an older process's, between its mkdtemp and its mark_owner
        if not dry_run:
            shutil.rmtree(d, ignore_errors=True)
        removed.append(f"temporary directory {d}")
    return removed


def owned_tmpdir(prefix: str, label: str) -> str:
    """A new tmp dir `<prefix><8 hex>` naming this process as its owner (`mark_owner`) from the
    moment it has that name: `python -m lab cleanup`, run beside it, leaves it, and everything of
    its lab prefix, while this process runs (`live_prefixes`). Made and marked under a staging
    name first, which carries the owner itself (`sweep_staging`: a run killed before the rename
    leaves that to cleanup); `label` says whose it is there."""
    staging = tempfile.mkdtemp(prefix=_staging_prefix(label))
    try:
        mark_owner(staging)
        path = os.path.join(os.path.dirname(staging), f"{prefix}{secrets.token_hex(4)}")
        os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def live_prefixes(prefix: str | None = None) -> dict[str, int]:
    """The lab prefixes (of one prefix, or all) whose tmp dir names a process that still runs:
    prefix -> that pid. A lab marks its tmp dir before it makes anything else (lab.core.Lab.up)."""
    live = {}
    for d in tmp_dirs(prefix):
        pid = owner_alive(d)
        m = NS_RE.match(os.path.basename(d))
        if pid is not None and m is not None:
            live[m.group(1)] = pid
    return live


def mark_owner(path: str) -> None:
    """Name this process (pid and start time) as the user of tmp dir `path`: `python -m lab
    cleanup`, run beside it, leaves the dir while the process runs (`owner_alive`)."""
    pid, start = _this_process()
    owner = os.path.join(path, OWNER_FILE)
    with open(f"{owner}.tmp", "w", encoding="ascii") as f:
        f.write(f"{pid} {start}\n")
    os.replace(f"{owner}.tmp", owner)  # never read half-written


def owner_alive(path: str) -> int | None:
    """The pid `mark_owner` wrote into tmp dir `path` if that process still runs (the same start
    time: a reused pid is not it), else None (no owner named, or it is gone)."""
    try:
        with open(os.path.join(path, OWNER_FILE), encoding="ascii") as f:
            pid, start = (int(tok) for tok in f.read().split())
    except (OSError, ValueError):
        return None
    return pid if alive(pid, start) else None


def lab_cgroups(prefix: str | None = None) -> list[str]:
    root = cgroup2_root()
    if root is None:
        return []
    if prefix is not None:
        path = os.path.join(root, prefix)
        return [path] if os.path.isdir(path) else []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(os.path.join(root, n) for n in names if PREFIX_RE.match(n))


HOST_LINK_RE = re.compile(r"^(sw-(node\d+|client)|lxc-p\d+)$")


def host_lab_links() -> list[str]:
    """Links in the caller's namespace that look like lab veths (`sw-*`, `lxc-p*`, peer in a lab ns)."""
    res = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False)
    found = []
    for line in res.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) < 3:
            continue
        name = parts[1].strip().split("@", 1)[0]
        if HOST_LINK_RE.match(name) or re.search(r"link-netns ekp[0-9a-f]{6}-", line):
            found.append(name)
    return found


def host_veths() -> set[str]:
    """Names of every veth in the caller's namespace."""
    res = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True)
    return {line.split(":", 2)[1].strip().split("@", 1)[0] for line in res.stdout.splitlines() if ":" in line}


def find_leaks(
    prefixes: Iterable[str], pids: Iterable[tuple[int, int | None]] = (), *, host_links: bool = True
) -> list[str]:
    """What labs with these prefixes left behind: namespaces, cgroups, pins, tmp dirs, live processes.

    `pids` are (pid, start time) pairs; `host_links` also reports lab-like links in the host namespace.
    """
    leaks: list[str] = []
    prefixes = sorted(set(prefixes))
    namespaces = list_netns()
    for prefix in prefixes:
        leaks += [f"network namespace {ns}" for ns in namespaces if ns.startswith(prefix + "-")]
        leaks += [f"cgroup {cg}" for cg in lab_cgroups(prefix)]
        leaks += [f"bpffs pin {p}" for p in pin_dirs(prefix)]
        leaks += [f"temporary directory {d}" for d in tmp_dirs(prefix)]
    for pid, start in pids:
        if alive(pid, start):
            leaks.append(f"process {pid} ({_cmdline(pid)})")
    if host_links:
        leaks += [f"lab-like link {name} in the host namespace" for name in host_lab_links()]
    leaks += [f"{name} on the machine's root cgroup ({hook})" for hook, name in root_cgroup_programs()]
    return leaks


def root_cgroup_programs() -> list[tuple[str, str]]:
    """(hook, program name) of the agent's programs (`ekp_*`) attached to the root of the machine's
    cgroup v2 hierarchy: there they would translate every socket of the machine. Nothing of a lab
    may ever be there (the lab attaches to each lab node's own cgroup)."""
    root = cgroup2_root()
    if root is None:
        return []
    argv = ["bpftool", "cgroup", "show", root, "-j"]
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    try:
        items = json.loads(res.stdout.strip() or "[]")
    except json.JSONDecodeError:
        return [("?", f"unreadable bpftool output: {res.stdout[:200]!r} {res.stderr[:200]!r}")]
    return [(i["attach_type"], i["name"]) for i in items if str(i.get("name", "")).startswith("ekp_")]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def cleanup_leftovers(prefix: str | None = None, *, dry_run: bool = False) -> list[str]:
    """Remove lab leftovers (of one prefix, or of every `ekp<6 hex>` prefix); return what was removed.

    Kills processes in each namespace first, then deletes namespaces, cgroups, pins and tmp dirs.
    A lab whose owner still runs (`live_prefixes`: a test run beside this one, another engineer's
    lab) is left whole.
    """
    removed: list[str] = []
    if prefix is not None and not PREFIX_RE.match(prefix):
        raise ValueError(f"not a lab prefix: {prefix!r}")
    live = live_prefixes(prefix)

    def dead(path: str) -> bool:  # a namespace, a cgroup (named the prefix), a pin, a tmp dir
        m = _LAB_NAME_RE.match(os.path.basename(path).removeprefix(PIN_PREFIX))
        return m is None or m.group(1) not in live

    namespaces = [
        ns
        for ns in list_netns()
        if (m := NS_RE.match(ns)) is not None and (prefix is None or m.group(1) == prefix) and dead(ns)
    ]
    for ns in namespaces:
        pids = netns_pids(ns)
        if not dry_run:
            kill_netns(ns)
        removed.append(f"network namespace {ns}" + (f" (killed pids {pids})" if pids else ""))
    for cg in filter(dead, lab_cgroups(prefix)):
        procs = cgroup_procs(cg)
        if not dry_run:
            remove_cgroup_tree(cg)
        removed.append(f"cgroup {cg}" + (f" (killed pids {procs})" if procs else ""))
    if not dry_run:
        delete_netns(namespaces)
    for pin in filter(dead, pin_dirs(prefix)):
        if not dry_run:
            remove_path(pin)
        removed.append(f"bpffs pin {pin}")
    for d in filter(dead, tmp_dirs(prefix)):
        if owner_alive(d) is not None:
            # A scratch namespace's xtables lock dir while its process runs: without it that
            # process's next iptables-legacy fails ("can't open lock file").
            continue
        if not dry_run:
            shutil.rmtree(d, ignore_errors=True)
        removed.append(f"temporary directory {d}")
    if prefix is None:  # a staging dir has no lab prefix yet: the whole cleanup's
        removed += sweep_staging(dry_run=dry_run)
        removed += sweep_kept_liberal(dry_run=dry_run)  # named by a namespace's inode, not a prefix
    return removed


def live_netns_inodes() -> set[int]:
    """The inodes of every network namespace a process is in or a /run/netns name holds."""
    inodes = set()
    paths = glob.glob("/proc/[0-9]*/ns/net") + glob.glob(os.path.join(NETNS_DIR, "*"))
    for path in paths:
        with contextlib.suppress(OSError):  # a process that exited, a name deleted meanwhile
            inodes.add(os.stat(path).st_ino)
    return inodes


def sweep_kept_liberal(*, dry_run: bool = False) -> list[str]:
    """Remove the tcp_be_liberal values a lab agent kept mid-takeover (agent.takeover.into_ebpf's
    liberal_path, and its `.<pid>.tmp` after a kill) for a namespace that no longer exists: its
    sysctl went with it, and the inode may name a later namespace, whose agent would set its
    tcp_be_liberal from that file. One whose namespace lives is its agent's: left."""
    live = live_netns_inodes()
    removed = []
    for path in sorted(glob.glob(os.path.join(AGENT_STATE_DIR, "takeover-netns-*.liberal*"))):
        m = _LIBERAL_RE.match(os.path.basename(path))
        if m is None or int(m.group(1)) in live:
            continue
        if not dry_run:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        removed.append(f"kept tcp_be_liberal {path}")
    return removed


def remove_path(path: str) -> None:
    """Remove a file or directory tree (bpffs pins are unpinned by unlink)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# ---------------------------------------------------------------------------------- kernel gate


def _bpffs_mounted() -> bool:
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            return any(len(p) >= 3 and p[1] == BPFFS and p[2] == "bpf" for p in (ln.split() for ln in f))
    except OSError:
        return False


@functools.cache
def kernel_problem() -> str | None:
    """Why kernel tests (root, network namespaces, BPF) cannot run here, or None when they can.

    Mounts bpffs on /sys/fs/bpf when it is missing (idempotent, as scripts/setup.sh does).
    """
    if os.geteuid() != 0:
        return "kernel tests need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"{new_prefix()}-probe"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    if not _bpffs_mounted():
        res = subprocess.run(
            ["mount", "-t", "bpf", "bpf", BPFFS], capture_output=True, text=True, check=False
        )
        if res.returncode != 0:
            return f"bpffs is not mounted on {BPFFS} and mounting failed: {res.stderr.strip()}"
    if shutil.which("bpftool") is None:
        return "bpftool is not installed"
    res = subprocess.run(["bpftool", "prog", "show"], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return f"BPF is not usable (`bpftool prog show`: {res.stderr.strip()})"
    return None
