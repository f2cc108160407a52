"""The bench times an installed agent's starts: the agent's modules byte-compiled first, as the
image's pip install does, not compiled from source by every agent it starts."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import api, syncphases


def _stale(root: Path) -> list[Path]:
    """The modules under `root` whose bytecode is missing or older than their source."""
    stale = []
    for source in root.rglob("*.py"):
        cached = Path(importlib.util.cache_from_source(str(source)))
        if not cached.exists() or cached.stat().st_mtime < source.stat().st_mtime:
            stale.append(source)
    return stale


def test_compile_agent_leaves_every_agent_module_with_its_bytecode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A prefix of its own: under scripts/test.sh's PYTHONPYCACHEPREFIX, an earlier run's bytecode for
    # the same /tmp/pytest-of-root/pytest-N path (newer than the copied sources) would count as fresh.
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pycache"))
    tree = tmp_path / "agent"
    shutil.copytree(api.AGENT_DIR, tree, ignore=shutil.ignore_patterns("__pycache__"))
    assert _stale(tree)  # a fresh copy: what a clone, or PYTHONDONTWRITEBYTECODE=1, leaves
    monkeypatch.setattr(api, "AGENT_DIR", tree)
    api.compile_agent()
    assert _stale(tree) == []


def test_compile_agent_raises_on_a_source_that_does_not_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken.py").write_text("def f(:\n")
    monkeypatch.setattr(api, "AGENT_DIR", tmp_path)
    with pytest.raises(RuntimeError, match="do not compile"):
        api.compile_agent()


class _Stop(Exception):
    pass


@pytest.mark.parametrize("measure", [lambda: api.measure("ebpf", 1, 1, 0), lambda: syncphases.measure(1, 1)])
def test_both_benches_compile_the_agent_before_they_start_anything(
    monkeypatch: pytest.MonkeyPatch, measure: Callable[[], object]
) -> None:
    order: list[str] = []

    def server(*_: object) -> None:
        order.append("server")
        raise _Stop

    monkeypatch.setattr(api, "compile_agent", lambda: order.append("compile"))
    monkeypatch.setattr(syncphases, "compile_agent", lambda: order.append("compile"))
    monkeypatch.setattr(api, "ApiServerProcess", server)
    monkeypatch.setattr(syncphases, "ApiServerProcess", server)
    with pytest.raises(_Stop):
        measure()
    assert order == ["compile", "server"]
