"""How the suite runs on several pytest-xdist workers (`make test`: five, `EKP_TEST_WORKERS`):
which tests go together.

Every test has a run group (`run_group`): the tests that must run on one worker, one after the
other, in their order, because they share a lab.

* a module (its module-scoped labs are made once);
* a module's tests marked `run_group(name)`: a group of their own (`path#name`), for a module
  whose tests need no lab in common (what they share, they take from `session_dir`, made once);
* for a test whose mode (`ebpf`, `iptables`) comes from a mode-parametrised fixture of its module,
  that module's mode (the two modes' labs are made on two workers, once each);
* for a test whose mode comes from a session-scoped fixture (tests/traffic's `cluster` and `api`),
  every test of that fixture in that mode, whatever its module (`tests/traffic:cluster-ebpf`).

So a lab is made once, and a test never shares its lab with a test running beside it. The groups
sharing a session lab (the longest) are queued first, other groups with lab tests next, pure ones
after them, the leak check (tests/test_lab_leaks.py) last.

xdist's own `--dist loadgroup` cannot carry these groups under pytest 9 (it renames each item's
`nodeid`, which pytest 9 no longer reads back), and the controller never collects: so each worker
writes the groups of what it collected to a file the controller named (`pytest_configure_node`),
and the controller's scheduler (`GroupScheduling`, xdist's LoadScopeScheduling with these groups
as its scopes) reads them. A test the file does not name is a group of its own module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

MODES = ("ebpf", "iptables")
ROOT = Path(__file__).resolve().parent.parent
GROUPS_FILE = "ekp_run_groups"  # workerinput key: where a worker writes {nodeid: group}


def item_mode(item: pytest.Item) -> str | None:
    """The mode a test runs in, when a parameter (of it or of a fixture it uses) names one."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    return next((v for v in callspec.params.values() if isinstance(v, str) and v in MODES), None)


def _session_lab(item: pytest.Item, mode: str) -> str | None:
    """The session-scoped fixture that gives `item` its mode (a lab shared across modules)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    for name, fixturedefs in defs.items():
        if fixturedefs and fixturedefs[-1].scope == "session" and params.get(name) == mode:
            return str(name)
    return None


def run_group(item: pytest.Item) -> str:
    """The tests that must run on one worker, in order (see the module docstring)."""
    path = item.path.relative_to(ROOT).as_posix()
    marker = item.get_closest_marker("run_group")
    if marker is not None:
        return f"{path}#{marker.args[0]}"
    mode = item_mode(item)
    if mode is None:
        return path
    shared = _session_lab(item, mode)
    if shared is not None:
        return f"{Path(path).parent.as_posix()}:{shared}-{mode}"
    return f"{path}-{mode}"


def _is_lab_test(item: pytest.Item) -> bool:
    return item.get_closest_marker("kernel") is not None or "kernel_required" in getattr(
        item, "fixturenames", ()
    )


def queue_order(items: list[pytest.Item]) -> dict[str, str]:
    """Sort `items` group by group, each group's tests in their order (see the module docstring);
    returns each test's group by nodeid."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(run_group(item), []).append(item)

    def rank(group: str) -> int:
        members = groups[group]
        if any(it.path.name == "test_lab_leaks.py" for it in members):
            return 3
        if ":" in group:
            return 0
        return 1 if any(_is_lab_test(it) for it in members) else 2

    items[:] = [it for group in sorted(groups, key=rank) for it in groups[group]]
    return {it.nodeid: group for group, members in groups.items() for it in members}


def write_groups(config: pytest.Config, groups: dict[str, str]) -> None:
    """In a worker: hand the groups to the controller's scheduler."""
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    prefix = workerinput.get(GROUPS_FILE)
    if prefix:
        Path(f"{prefix}-{workerinput.get('workerid', 'gw')}.json").write_text(json.dumps(groups))


def read_groups(prefix: str) -> dict[str, str]:
    """In the controller: the groups a worker wrote (workers collect the same tests)."""
    folder, stem = os.path.split(prefix)
    for name in sorted(os.listdir(folder)):
        if name.startswith(f"{stem}-") and name.endswith(".json"):
            groups: dict[str, str] = json.loads(Path(folder, name).read_text())
            return groups
    return {}


def make_scheduler(config: pytest.Config, log: Any, prefix: str) -> Any:
    """xdist's LoadScopeScheduling, its scopes our run groups."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]  # untyped base
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                self._groups = read_groups(prefix)
            return self._groups.get(nodeid) or nodeid.split("::", 1)[0]

    return GroupScheduling(config, log)
