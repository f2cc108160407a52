"""tests/parallel.py's run groups: which tests must share a worker."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tests import parallel


class _Item:
    """What run_group reads of a collected test."""

    def __init__(self, path: str, marker: Any = None) -> None:
        self.path = parallel.ROOT / path
        self._marker = marker

    def get_closest_marker(self, name: str) -> Any:
        return self._marker if name == "run_group" else None


def test_a_module_is_one_group_and_its_marked_tests_another() -> None:
    plain = cast(pytest.Item, _Item("tests/ebpf/test_compile.py"))
    marked = cast(pytest.Item, _Item("tests/ebpf/test_compile.py", pytest.mark.run_group("ipv6-builds").mark))
    assert parallel.run_group(plain) == "tests/ebpf/test_compile.py"
    assert parallel.run_group(marked) == "tests/ebpf/test_compile.py#ipv6-builds"
    assert Path(parallel.ROOT, "tests/ebpf/test_compile.py").is_file()


def test_a_marked_group_is_queued_with_the_lab_groups_not_the_session_labs() -> None:
    """Its name has no ':' (the session labs' groups, queued first)."""
    marked = cast(pytest.Item, _Item("tests/ebpf/test_compile.py", pytest.mark.run_group("x").mark))
    assert ":" not in parallel.run_group(marked)


class _Test:
    """What queue_order reads of a collected test: its module, whether it needs the kernel."""

    def __init__(self, path: str, name: str, kernel: bool = False) -> None:
        self.path = parallel.ROOT / path
        self.nodeid = f"{path}::{name}"
        self.fixturenames = ("kernel_required",) if kernel else ()

    def get_closest_marker(self, name: str) -> Any:
        return None


def _tests(path: str, n: int, kernel: bool = False) -> list[_Test]:
    return [_Test(path, f"t{i}", kernel) for i in range(n)]


def test_lab_groups_are_queued_before_pure_ones_the_larger_first_the_leak_check_last() -> None:
    items = [
        *_tests("tests/test_lab_leaks.py", 1, kernel=True),
        *_tests("tests/agent/test_many.py", 40),
        *_tests("tests/traffic/test_one.py", 1, kernel=True),
        *_tests("tests/agent/test_few.py", 2),
        *_tests("tests/traffic/test_three.py", 3, kernel=True),
    ]
    queued = cast(list[pytest.Item], items)
    groups = parallel.queue_order(queued)
    order = list(dict.fromkeys(groups[it.nodeid] for it in queued))
    assert order == [
        "tests/traffic/test_three.py",
        "tests/traffic/test_one.py",
        "tests/agent/test_many.py",
        "tests/agent/test_few.py",
        "tests/test_lab_leaks.py",
    ]


class _Worker:
    """What the scheduler uses of a worker: it is sent the indices of the tests to run."""

    shutting_down = False

    def __init__(self) -> None:
        self.sent: list[list[int]] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.append(list(indices))

    def shutdown(self) -> None:
        pass


def test_the_scheduler_dispatches_the_groups_in_queue_order(tmp_path: Path) -> None:
    """xdist's LoadScopeScheduling reorders its queue by tests per group (`--loadscope-reorder`, on
    by default): a lab group of one test went after every pure module of more, to the end of a run."""
    collection = ["tests/traffic/test_one.py::t0", *(f"tests/agent/test_many.py::t{i}" for i in range(3))]
    prefix = str(tmp_path / "groups")
    Path(f"{prefix}-gw0.json").write_text(json.dumps({n: n.split("::")[0] for n in collection}))
    config = SimpleNamespace(
        getvalue=lambda name: ["1*popen"] if name == "tx" else None,
        option=SimpleNamespace(loadscopereorder=True),  # xdist's default
    )
    scheduler = parallel.make_scheduler(cast(pytest.Config, config), None, prefix)
    worker = _Worker()
    scheduler.add_node(worker)
    scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    assert [[collection[i] for i in sent] for sent in worker.sent] == [
        ["tests/traffic/test_one.py::t0"],
        [f"tests/agent/test_many.py::t{i}" for i in range(3)],
    ]
