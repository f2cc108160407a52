"""lab/precompile.py: the data path's build (the packet lab's and the agents') compiled into the
cache once, ahead of the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.ebpf.bpfobject import BpfObject
from agent.ebpf.loader import Datapath
from agent.ebpf.objcache import DIR_ENV, ObjectCache
from agent.ebpf.programs import PROGRAMS
from lab import precompile
from lab.dplab import SIZES
from tests.ebpf.test_objcache import obj


def test_the_packet_labs_build_is_compiled_into_the_cache_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The build the packet lab's session fixture loads (tests/ebpf/conftest.py's `dp`), so that
    fixture finds it, with every program of the source (a load chooses); a second run finds it
    there and compiles nothing."""
    lab = Datapath("/sys/fs/bpf/lab", SIZES)
    build = lab.build()
    compiles: list[str] = []

    def compile_in_child(
        entry: Path, cflags: list[str], build: str, programs: dict[str, int]
    ) -> tuple[BpfObject, float]:
        compiles.append(build)
        assert cflags == lab.cflags() and set(programs) == set(PROGRAMS)
        return obj(build), 1.0

    monkeypatch.setenv(DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(precompile, "compile_in_child", compile_in_child)
    assert precompile.main() == 0
    assert compiles == [build]
    assert ObjectCache(str(tmp_path / "cache")).get(build) == obj(build)
    assert precompile.main() == 0
    assert compiles == [build], "found in the cache: not compiled again"
    assert (
        f"the data path's build {build} ({precompile.WHOSE}) is in {tmp_path / 'cache'} already"
        in capsys.readouterr().out
    )
