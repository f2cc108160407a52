"""The pin directory is ours: created 0700 by the agent, refused when anyone else could touch it.

/sys/fs/bpf is world-writable (mode 1777): any local user can create the default pin directory
before the agent does and keep the right to delete or replace every map pinned in it (conntrack,
the service maps), or plant a symlink that sends the agent's pins elsewhere. So, for every
component of the pin path from `/` down:

* none may be a symlink (the agent never follows one there: give it the real path);
* each must be a directory owned by root (or the agent's own uid);
* an ancestor writable by group or others must carry the sticky bit (as /sys/fs/bpf does), which
  stops other users from renaming or removing entries they do not own;
* the pin directory itself must not be writable by group or others at all.

A missing pin directory is created with mode 0700 (missing ancestors 0755) and checked again
after creation, so a race with another user's mkdir ends in a refusal, never in using their
directory. A refusal is `FatalError`: no retry fixes it, and the message says what to remove or
chmod. `pin_dir_problems` only looks (the pre-flight, before anything is created);
`ensure_pin_dir` creates and looks (the loader). Directories made by an older agent with 0755
pass: the rule is about who can write, not about the exact mode.
"""

from __future__ import annotations

import contextlib
import os
import stat

from agent.errors import FatalError


def component_problem(st: os.stat_result, euid: int, *, final: bool) -> str:
    """What is wrong with one component of the pin path ("" when nothing), and the fix."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "is a symlink, which the agent does not follow here: remove it or give the real path"
    if not stat.S_ISDIR(mode):
        return "is not a directory: remove it or choose another --bpf-pin-path"
    if st.st_uid not in (0, euid):
        return (
            f"is owned by uid {st.st_uid}, not root: that user can delete or replace the agent's pinned "
            "maps. Remove it (rm -r it; it was not made by the agent) and start the agent again"
        )
    bits = stat.S_IMODE(mode)
    if final and bits & 0o022:
        return (
            f"has mode {bits:04o}: group or other users can delete or replace the agent's pinned maps. "
            "Run chmod 0700 on it and start the agent again"
        )
    if not final and bits & 0o022 and not bits & stat.S_ISVTX:
        return (
            f"has mode {bits:04o}, writable by others without the sticky bit: they could replace the pin "
            "directory. Run chmod go-w (or chmod +t) on it, or choose another --bpf-pin-path"
        )
    return ""


def _components(pin_path: str) -> list[str]:
    """`/a/b/c` -> [`/a`, `/a/b`, `/a/b/c`] (normalised, not resolved: symlinks are checked, not followed)."""
    path = os.path.normpath(os.path.abspath(pin_path))
    out, current = [], ""
    for part in path.split("/")[1:]:
        current = f"{current}/{part}"
        out.append(current)
    return out


def pin_dir_problems(pin_path: str) -> list[str]:
    """Problems of the existing components of the pin path; creates nothing."""
    euid = os.geteuid()
    parts = _components(pin_path)
    for i, component in enumerate(parts):
        try:
            st = os.lstat(component)
        except FileNotFoundError:
            return []  # the rest will be created by the agent, 0700
        problem = component_problem(st, euid, final=i == len(parts) - 1)
        if problem:
            return [f"--bpf-pin-path {pin_path}: {component} {problem}"]
    return []


def ensure_pin_dir(pin_path: str) -> None:
    """Create what is missing of the pin path (the directory itself 0700) and check every component."""
    euid = os.geteuid()
    parts = _components(pin_path)
    for i, component in enumerate(parts):
        final = i == len(parts) - 1
        try:
            st = os.lstat(component)
        except FileNotFoundError:
            # Created by someone else meanwhile: FileExistsError, and judged below like any other.
            with contextlib.suppress(FileExistsError):
                os.mkdir(component, 0o700 if final else 0o755)
            st = os.lstat(component)
        problem = component_problem(st, euid, final=final)
        if problem:
            raise FatalError(f"--bpf-pin-path {pin_path}: {component} {problem}")
