"""The machine's cache of compiled data paths: what one agent compiled, the next one loads, as
long as nobody else could have written it; anything doubtful is a miss, never an error."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from agent.ebpf.bpfobject import INSN, BpfObject, MapDef, ProgDef
from agent.ebpf.objcache import KEEP, ObjectCache

PROGRAM = INSN.pack(0x18, 0x11, 0, 3) + INSN.pack(0, 0, 0, 0) + INSN.pack(0x95, 0, 0, 0)


def obj(build: str = "0123456789ab") -> BpfObject:
    return BpfObject(
        build=build,
        license="GPL",
        kern_version=0,
        btf=b"",
        maps=(MapDef("ekp_fe_v2", 1, 8, 16, 128, 0),),
        programs=(ProgDef("ekp_from_pod", 3, PROGRAM, ((0, 0),)),),
    )


def test_what_is_put_is_got_back_by_its_build(tmp_path: Path) -> None:
    cache = ObjectCache(str(tmp_path / "a" / "cache"))
    assert cache.get("0123456789ab") is None
    cache.put(obj())
    assert cache.get("0123456789ab") == obj()
    assert cache.get("ba9876543210") is None
    assert cache.get("../../etc/x") is None
    mode = os.stat(cache.path).st_mode & 0o777
    assert mode == 0o700, oct(mode)
    assert os.stat(cache.file("0123456789ab")).st_mode & 0o077 == 0


def test_an_empty_path_turns_the_cache_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cache = ObjectCache("")
    cache.put(obj())
    assert cache.get(obj().build) is None and os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["file", "dir", "parent"])
def test_anything_others_could_have_written_is_not_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    parent = tmp_path / "p"
    cache = ObjectCache(str(parent / "cache"))
    cache.put(obj())
    target = {"file": Path(cache.file(obj().build)), "dir": Path(cache.path), "parent": parent}[where]
    os.chmod(target, 0o666 if where == "file" else 0o777)
    assert ObjectCache(cache.path).get(obj().build) is None
    assert "writable by" in caplog.text or "only root can write" in caplog.text
    if where == "parent":
        os.chmod(parent, 0o1777)  # the sticky bit, as /tmp and /sys/fs/bpf: others cannot replace it
        assert ObjectCache(cache.path).get(obj().build) == obj()


def test_a_symlinked_file_or_directory_is_not_followed(tmp_path: Path) -> None:
    real = ObjectCache(str(tmp_path / "real"))
    real.put(obj())
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert ObjectCache(str(tmp_path / "link")).get(obj().build) is None
    other = ObjectCache(str(tmp_path / "other"))
    other.put(obj("aaaaaaaaaaaa"))
    os.symlink(real.file(obj().build), other.file(obj().build))
    assert other.get(obj().build) is None


def test_garbage_and_a_file_of_another_build_are_misses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    cache = ObjectCache(str(tmp_path / "cache"))
    cache.put(obj())
    Path(cache.file(obj().build)).write_bytes(b"not json")
    assert cache.get(obj().build) is None
    os.replace(cache.file(obj().build), cache.file("bbbbbbbbbbbb"))
    cache.put(obj())
    os.replace(cache.file(obj().build), cache.file("cccccccccccc"))
    assert cache.get("cccccccccccc") is None
    assert "holds build 0123456789ab" in caplog.text


def test_only_the_newest_are_kept(tmp_path: Path) -> None:
    cache = ObjectCache(str(tmp_path / "cache"))
    old = [f"{i:012x}" for i in range(KEEP)]
    for i, build in enumerate(old):
        cache.put(obj(build))
        os.utime(cache.file(build), (1000 + i, 1000 + i))
    assert cache.get(old[0]) is not None  # used now: the newest of the old ones
    new = [f"f{i:011x}" for i in range(3)]
    for build in new:
        cache.put(obj(build))
    kept = {n.removesuffix(".json") for n in os.listdir(cache.path)}
    assert kept == {old[0], *old[4:], *new}


def test_agents_missing_one_build_at_once_compile_it_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second agent to miss a build waits for the first one's compile and loads its object
    (a lab's two nodes, the test workers of a fresh clone): one compile, not one per agent."""
    from agent.config import MapSizes
    from agent.ebpf import loader

    caplog.set_level(logging.INFO)
    d = loader.Datapath("/x", MapSizes())
    build = d.build()
    compiled = obj(build)
    calls: list[str] = []
    inside, release = threading.Event(), threading.Event()

    def compile_in_child(*args: object) -> tuple[BpfObject, float]:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            inside.set()
            release.wait(10)
        return compiled, 0.5

    linked: dict[str, str] = {}

    def link(o: BpfObject, *args: object, **kwargs: object) -> dict[str, int]:
        linked[threading.current_thread().name] = o.build
        return {}

    monkeypatch.setattr(loader, "compile_in_child", compile_in_child)
    monkeypatch.setattr(loader, "link", link)
    cache = str(tmp_path / "cache")
    hows: dict[str, str] = {}

    def load(name: str) -> None:
        _, hows[name] = loader.Datapath("/x", MapSizes(), cache=ObjectCache(cache))._link(
            build, {}, lambda: None
        )

    first = threading.Thread(target=load, args=("first",), name="first")
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=load, args=("second",), name="second")
    second.start()
    # released once the second agent waits for the lock, or (without one) compiled on its own
    while "waiting for another agent compiling" not in caplog.text and len(calls) < 2:
        second.join(0.01)
    release.set()
    first.join(10)
    second.join(10)
    assert calls == ["first"], "one compile"
    assert hows == {
        "first": "compiled in 0.5s",
        "second": "loaded from the compile cache (compiled by an earlier agent)",
    }
    assert linked == {"first": build, "second": build}


def test_a_held_compile_lock_is_never_pruned_nor_passed_over(tmp_path: Path) -> None:
    """A lock file an earlier run left (older than the pruning's hour) held again: the pruning must
    not remove it under its holder (the next agent would lock a new file and compile the same
    build at once)."""
    cache = ObjectCache(str(tmp_path / "cache"))
    build = "0123456789ab"
    cache.put(obj("aaaaaaaaaaaa"))  # makes the directory
    lock = tmp_path / "cache" / f".lock-{build}"
    lock.touch()
    os.utime(lock, (1.0, 1.0))
    held, release, second_in = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with cache.compiling(build):
            held.set()
            release.wait(10)

    def second() -> None:
        with cache.compiling(build):
            second_in.set()

    a = threading.Thread(target=first)
    a.start()
    assert held.wait(10)
    cache.put(obj("bbbbbbbbbbbb"))  # any put prunes
    assert lock.exists(), "the held lock file was pruned"
    b = threading.Thread(target=second)
    b.start()
    assert not second_in.wait(0.5), "a second agent took the lock while the first held it"
    release.set()
    a.join(10)
    b.join(10)
    assert second_in.is_set()


def test_the_verifier_cost_benchs_object_waits_for_an_agent_compiling_the_same_build(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench.verifycost.the_object (tests/ebpf/test_verifier_cost.py) misses the default build in a
    fresh clone's run while the lab's agents compile it: it waits for their compile on the entry's
    lock and takes their object, as an agent does, instead of compiling it a second time."""
    from agent.config import MapSizes
    from agent.ebpf import loader
    from agent.ebpf.objcache import WAITING_LOG
    from bench import verifycost

    caplog.set_level(logging.INFO)
    cache = ObjectCache(str(tmp_path / "cache"))
    dp = loader.Datapath("/x", MapSizes(), cache=cache)
    build = dp.build()
    compiles: list[str] = []

    def compile_in_child(*args: object) -> tuple[BpfObject, float]:
        compiles.append(build)
        return obj(build), 0.5

    monkeypatch.setattr(verifycost, "compile_in_child", compile_in_child)
    got: list[BpfObject] = []
    bench = threading.Thread(target=lambda: got.append(verifycost.the_object(dp)))
    with cache.compiling(build):  # an agent's compile of it, under way
        bench.start()
        deadline = time.monotonic() + 10
        while WAITING_LOG not in caplog.text and bench.is_alive() and time.monotonic() < deadline:
            bench.join(0.01)
        assert WAITING_LOG + build in caplog.text, "the bench waits on the entry's lock"
        cache.put(obj(build))
    bench.join(10)
    assert compiles == [], "compiled once, by the agent"
    assert [(o.build, o.programs) for o in got] == [(build, obj(build).programs)], "the agent's object"
