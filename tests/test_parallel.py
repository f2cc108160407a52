"""tests/parallel.py's run groups: which tests must share a worker."""

from __future__ import annotations

from pathlib import Path
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
