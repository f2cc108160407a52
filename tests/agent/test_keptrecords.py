"""The model's records kept across a clean restart (agent/keptrecords.py): a restart takes a kept
record only for the same object (uid and resourceVersion), and ends in a cold start's state."""

from __future__ import annotations

import copy
import fcntl
import io
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from agent import keptfile
from agent.config import Config
from agent.daemon import Agent, Parts
from agent.keptrecords import KeptRecords, identity, records_path
from agent.kube.reflector import Reflector
from agent.kube.resources import Resource
from agent.metrics import Metrics
from agent.model.tracker import read_slice
from agent.sources.base import Event, EventType, Kind, ObjectEvent, Synced, object_key
from tests.agent.test_daemon import NODE, FakeEvents, FakeProxier, FakeSource
from tests.kube.test_reflector import SETTINGS, FakeListCall
from tests.model.test_state import endpoint, service, slice_

CONFIG = Config(hostname="node1", min_sync_period_s=0.0)


def _meta(obj: dict[str, Any], uid: str, version: str) -> dict[str, Any]:
    obj["metadata"].update(uid=uid, resourceVersion=version)
    return obj


def _cluster_v1() -> list[dict[str, Any]]:
    return [
        _meta(service("same", clusterIP="10.96.0.10"), "u-same", "10"),
        _meta(slice_("same-1", "same", endpoints=[endpoint("10.244.1.2", node="node1")]), "u-same-1", "11"),
        _meta(service("edited", clusterIP="10.96.0.11"), "u-edited", "12"),
        _meta(slice_("edited-1", "edited", endpoints=[endpoint("10.244.1.3")]), "u-edited-1", "13"),
        _meta(service("gone", clusterIP="10.96.0.12"), "u-gone", "14"),
        _meta(slice_("gone-1", "gone", endpoints=[endpoint("10.244.1.4")]), "u-gone-1", "15"),
        _meta(service("recreated", clusterIP="10.96.0.13"), "u-recreated", "16"),
        _meta(slice_("recreated-1", "recreated", endpoints=[endpoint("10.244.1.5")]), "u-recreated-1", "17"),
        # malformed, unchanged while the agent is down: their kept records must say so again
        _meta(service("broken", clusterIP="10.96.0.300"), "u-broken", "18"),
        _meta(slice_("broken-1", "same", endpoints=[endpoint("10.244.1.300")]), "u-broken-1", "19"),
    ]


def _cluster_v2() -> list[dict[str, Any]]:
    """v1 as the agent lists it after changes made while it was down."""
    objs = {o["metadata"]["name"]: o for o in _cluster_v1()}
    del objs["gone"], objs["gone-1"]
    # a new version of the same object: the same uid, another resourceVersion
    objs["edited"] = _meta(
        service("edited", clusterIP="10.96.0.11", sessionAffinity="ClientIP"), "u-edited", "20"
    )
    objs["edited-1"] = _meta(
        slice_(
            "edited-1", "edited", endpoints=[endpoint("10.244.1.3"), endpoint("10.244.1.9", node="node1")]
        ),
        "u-edited-1",
        "21",
    )
    # deleted and made again: another uid, and (a test's worst case) the same resourceVersion string
    objs["recreated"] = _meta(
        service("recreated", clusterIP="10.96.0.14", type="NodePort"), "u-recreated-2", "16"
    )
    objs["recreated-1"] = _meta(
        slice_("recreated-1", "recreated", endpoints=[endpoint("10.244.1.6", node="node1")]),
        "u-recreated-1b",
        "17",
    )
    objs["added"] = _meta(service("added", clusterIP="10.96.0.15"), "u-added", "22")
    objs["added-1"] = _meta(slice_("added-1", "added", endpoints=[endpoint("10.244.1.7")]), "u-added-1", "23")
    return list(objs.values())


def _agent(records: KeptRecords | None, events: FakeEvents | None = None, registry: Any = None) -> Agent:
    return Agent(
        CONFIG,
        Parts(
            source=FakeSource(),
            proxier=FakeProxier(),
            node_context=lambda: NODE,
            records=records,
            events=events or FakeEvents(),
            metrics=Metrics(registry or CollectorRegistry()),
        ),
    )


def _list(agent: Agent, objs: list[dict[str, Any]]) -> None:
    events: list[Event] = [
        ObjectEvent(Kind(o["kind"]), EventType.ADDED, object_key(Kind(o["kind"]), o), copy.deepcopy(o))
        for o in objs
    ]
    agent.deliver([*events, Synced(Kind.SERVICE, "1"), Synced(Kind.ENDPOINT_SLICE, "1")])
    assert agent.runner.run_once()


def _state(agent: Agent) -> tuple[Any, ...]:
    state = agent.model.state
    return dict(state.services), dict(state.endpoints), dict(state.raw_endpoints), agent.model.problems()


def test_a_restart_after_changes_while_the_agent_was_down_ends_in_a_cold_starts_state(tmp_path: Path) -> None:
    path = records_path(str(tmp_path), "/sys/fs/bpf/ekp-test")
    first = _agent(KeptRecords(path, identity(CONFIG)))
    _list(first, _cluster_v1())
    first.shutdown()
    assert os.path.exists(path), "a clean stop keeps the model's records"

    kept = KeptRecords(path, identity(CONFIG))
    events, registry = FakeEvents(), CollectorRegistry()
    restarted = _agent(kept, events, registry)
    _list(restarted, _cluster_v2())
    cold_events, cold_registry = FakeEvents(), CollectorRegistry()
    cold = _agent(None, cold_events, cold_registry)
    _list(cold, _cluster_v2())

    assert _state(restarted) == _state(cold)
    assert len(restarted.model.problems()) == 2, "the malformed Service and slice"
    assert (events.warned, events.uids) == (cold_events.warned, cold_events.uids)
    assert sorted(events.uids, key=str) == ["u-broken", "u-broken-1"]
    assert _metrics(registry) == _metrics(cold_registry) == (1.0, 1.0, 2.0)
    assert kept.taken == 4, (
        "only the unchanged Services and slices ('same', 'broken') may be taken, the rest read"
    )
    assert not os.path.exists(path), "the start consumed the file"


def _list_through_reflectors(
    agent: Agent, objs: list[dict[str, Any]], kept: KeptRecords | None
) -> list[Event]:
    """The first lists as the API source makes them: each kind's through the reflector, which asks
    `kept` for each item's record by its identity alone. Returns what the agent was delivered."""
    delivered: list[Event] = []

    def sink(events: Any) -> None:
        delivered.extend(events)
        agent.deliver(events)

    for kind, api_version in ((Kind.SERVICE, "v1"), (Kind.ENDPOINT_SLICE, "discovery.k8s.io/v1")):
        items = [o for o in objs if o["kind"] == kind.value]
        body = orjson.dumps({"metadata": {"resourceVersion": "1"}, "items": items})
        stopping = threading.Event()
        Reflector(
            Resource(kind, api_version, FakeListCall([body], stopping, [])),
            sink,
            SETTINGS,
            stopping,
            kept=kept,
        ).run()
    assert agent.runner.run_once()
    return delivered


def test_a_restart_whose_lists_skip_the_kept_objects_decode_ends_in_a_cold_starts_state(
    tmp_path: Path,
) -> None:
    path = records_path(str(tmp_path), "/sys/fs/bpf/ekp-test")
    first = _agent(KeptRecords(path, identity(CONFIG)))
    _list_through_reflectors(first, _cluster_v1(), None)
    first.shutdown()

    kept = KeptRecords(path, identity(CONFIG))
    events, registry = FakeEvents(), CollectorRegistry()
    restarted = _agent(kept, events, registry)
    delivered = _list_through_reflectors(restarted, _cluster_v2(), kept)
    cold_events, cold_registry = FakeEvents(), CollectorRegistry()
    cold = _agent(None, cold_events, cold_registry)
    _list_through_reflectors(cold, _cluster_v2(), None)

    assert _state(restarted) == _state(cold)
    assert len(restarted.model.problems()) == 2, "the malformed Service and slice"
    assert (events.warned, events.uids) == (cold_events.warned, cold_events.uids)
    assert _metrics(registry) == _metrics(cold_registry) == (1.0, 1.0, 2.0)
    identities = sorted(e.key for e in delivered if isinstance(e, ObjectEvent) and e.kept is not None)
    assert identities == ["default/broken", "default/broken-1", "default/same", "default/same-1"], (
        "the unchanged objects go to the agent as their identity and kept record, undecoded"
    )
    assert all(
        set(e.obj) == {"kind", "apiVersion", "metadata"}
        for e in delivered
        if isinstance(e, ObjectEvent) and e.kept is not None
    )
    assert kept.taken == 4


def _metrics(registry: CollectorRegistry) -> tuple[float | None, ...]:
    return (
        registry.get_sample_value("ekp_skipped_objects_total", {"kind": "Service"}),
        registry.get_sample_value("ekp_skipped_objects_total", {"kind": "EndpointSlice"}),
        registry.get_sample_value("ekp_invalid_objects"),
    )


def test_a_kept_record_is_taken_only_for_the_same_kind_key_uid_and_version(tmp_path: Path) -> None:
    path = str(tmp_path / "records.pickle")
    obj = _meta(slice_("web-1", endpoints=[endpoint("10.244.1.2")]), "u1", "7")
    record = read_slice(obj, "node1")
    KeptRecords(path, b"i" * 32).save({(Kind.ENDPOINT_SLICE, "default/web-1"): ("u1", "7", record)})
    kept = KeptRecords(path, b"i" * 32)
    assert kept.take(Kind.ENDPOINT_SLICE, "default/web-1", "u1", "8") is None, "another version"
    kept = _reloaded(path, record)
    assert kept.take(Kind.ENDPOINT_SLICE, "default/web-1", "u2", "7") is None, "another uid"
    kept = _reloaded(path, record)
    assert kept.take(Kind.SERVICE, "default/web-1", "u1", "7") is None, "another kind"
    kept = _reloaded(path, record)
    assert kept.take(Kind.ENDPOINT_SLICE, "default/web-2", "u1", "7") is None, "another key"
    kept = _reloaded(path, record)
    assert kept.take(Kind.ENDPOINT_SLICE, "default/web-1", "u1", "7") == record
    assert kept.take(Kind.ENDPOINT_SLICE, "default/web-1", "u1", "7") is None, "each record is taken once"


def test_the_records_are_empty_without_a_file_once_all_are_taken_and_once_dropped(tmp_path: Path) -> None:
    path = str(tmp_path / "records.pickle")
    assert KeptRecords(path, b"i" * 32).empty(), "no file"
    record = read_slice(_meta(slice_("web-1", endpoints=[endpoint("10.244.1.2")]), "u1", "7"), "node1")
    kept = _reloaded(path, record)
    assert not kept.empty(), "the file read by the first call, its record not taken yet"
    assert kept.take(Kind.ENDPOINT_SLICE, "default/web-1", "u1", "7") == record
    assert kept.empty()
    kept = _reloaded(path, record)
    kept.drop()
    assert kept.empty()


def _reloaded(path: str, record: Any) -> KeptRecords:
    KeptRecords(path, b"i" * 32).save({(Kind.ENDPOINT_SLICE, "default/web-1"): ("u1", "7", record)})
    return KeptRecords(path, b"i" * 32)


@pytest.mark.parametrize(
    "spoil",
    ["identity", "truncated", "flipped", "foreign class", "not records"],
)
def test_a_file_that_cannot_be_trusted_is_ignored_and_removed(
    tmp_path: Path, spoil: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "records.pickle")
    obj = _meta(slice_("web-1", endpoints=[endpoint("10.244.1.2")]), "u1", "7")
    good = {(Kind.ENDPOINT_SLICE, "default/web-1"): ("u1", "7", read_slice(obj, "node1"))}
    ident = b"i" * 32
    if spoil == "foreign class":
        keptfile.write(path, b"EKP-RECORDS-1\n" + ident, lambda p: p.dump({"x": os.system}))
    elif spoil == "not records":
        keptfile.write(
            path, b"EKP-RECORDS-1\n" + ident, lambda p: p.dump({(Kind.SERVICE, "a/b"): ("u", "1", 3)})
        )
    else:
        KeptRecords(path, ident).save(good)
    data = Path(path).read_bytes()
    if spoil == "truncated":
        Path(path).write_bytes(data[:-10])
    elif spoil == "flipped":
        Path(path).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    kept = KeptRecords(path, b"j" * 32 if spoil == "identity" else ident)
    assert kept.take(Kind.ENDPOINT_SLICE, "default/web-1", "u1", "7") is None
    assert not os.path.exists(path)
    assert "ignored the records the last run left" in caplog.text


def test_a_file_whose_header_cannot_be_read_is_ignored_and_the_object_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An I/O error while checking the file's header (EIO on a failing disk): `take` answers None
    (the list reads every object) and says why, instead of failing the list."""
    path = str(tmp_path / "records.pickle")
    obj = _meta(slice_("web-1", endpoints=[endpoint("10.244.1.2")]), "u1", "7")
    KeptRecords(path, b"i" * 32).save(
        {(Kind.ENDPOINT_SLICE, "default/web-1"): ("u1", "7", read_slice(obj, "node1"))}
    )

    def failing(*args: Any) -> str:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(keptfile, "check", failing)
    kept = KeptRecords(path, b"i" * 32)
    assert kept.take(Kind.ENDPOINT_SLICE, "default/web-1", "u1", "7") is None
    assert kept.offered == 0
    assert "ignored the records the last run left" in caplog.text and "Input/output error" in caplog.text


def test_a_stop_while_a_sync_still_runs_keeps_no_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sync still running after the runner's stop wait would change the records while they are
    written: the shutdown writes none and says so; once it is over, they are kept."""
    path = str(tmp_path / "records.pickle")
    agent = _agent(KeptRecords(path, b"i" * 32))
    _list(agent, [_meta(service("web"), "u1", "7")])
    monkeypatch.setattr(agent.runner, "running", lambda: True)
    agent.shutdown()
    assert not os.path.exists(path)
    assert "the model's records are not kept" in caplog.text
    monkeypatch.setattr(agent.runner, "running", lambda: False)
    agent.shutdown()
    assert os.path.exists(path)


def test_a_link_at_the_files_name_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    KeptRecords(str(target), b"i" * 32).save({})
    path = tmp_path / "records.pickle"
    path.symlink_to(target)
    assert KeptRecords(str(path), b"i" * 32).take(Kind.SERVICE, "a/b", "u", "1") is None
    assert not path.is_symlink() and target.exists(), "the link removed, its target untouched"


def test_the_files_body_holds_only_records_and_their_keys(tmp_path: Path) -> None:
    """What `save` writes unpickles (plainly) into exactly the mapping it was given."""
    path = str(tmp_path / "records.pickle")
    obj = _meta(service("web"), "u1", "7")
    agent = _agent(KeptRecords(path, b"i" * 32))
    _list(agent, [obj])
    agent.shutdown()
    with open(path, "rb") as f:
        f.seek(len(b"EKP-RECORDS-1\n") + 64)
        body = pickle.load(f)
    assert list(body) == [(Kind.SERVICE, "default/web")]
    assert body[(Kind.SERVICE, "default/web")][:2] == ("u1", "7")


def dead_pid() -> int:
    """A pid no process has now (one that has just exited and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    assert not os.path.exists(f"/proc/{child.pid}")
    return child.pid


def locked_by_another_process(path: Path) -> subprocess.Popen[bytes]:
    """A process that made `path` and holds its flock (a writer in another pid namespace, or this
    one's), until killed."""
    script = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(path)!r}, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)\n"
        "os.write(fd, b'partial')\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert writer.stdout is not None and writer.stdout.readline() == b"locked\n"
    return writer


@pytest.mark.parametrize("by", ["start", "write"])
def test_temporary_files_of_writers_that_are_gone_are_removed_and_a_live_ones_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, by: str
) -> None:
    """A stop killed while it wrote leaves `<file>.<pid>.tmp` (tmpfs: memory until reboot): the next
    start (which consumes the file) and the next write remove those no live writer holds (its
    flock), whatever process has that pid now: a pid means nothing across pid namespaces."""
    directory = tmp_path / "run"
    directory.mkdir()
    path = str(directory / "records-0123456789abcdef.pickle")
    victim = tmp_path / "victim"
    victim.write_bytes(b"not the agent's")
    dead, dead_too = dead_pid(), dead_pid()
    left = Path(f"{path}.{dead}.tmp")
    left.write_bytes(b"x" * 1000)
    link = Path(f"{path}.{dead_too}.tmp")
    link.symlink_to(victim)
    # a container's writer killed while it wrote, its pid a host kthread's (kthreadd: 2) here
    kthread = Path(f"{path}.2.tmp")
    kthread.write_bytes(b"stale")
    mine = Path(f"{path}.{os.getpid()}.tmp")  # this pid's, from a killed writer of another namespace
    mine.write_bytes(b"")
    other = directory / f"planner-0123456789abcdef.pickle.{dead}.tmp"  # another file's
    other.write_bytes(b"")
    writing = Path(f"{path}.{dead_pid()}.tmp")  # its pid names no process here: another namespace's
    writer = locked_by_another_process(writing)
    try:
        with caplog.at_level(logging.INFO, logger="agent.keptfile"):
            if by == "start":
                assert KeptRecords(path, b"i" * 32).take(Kind.SERVICE, "a/b", "u", "1") is None
            else:
                KeptRecords(path, b"i" * 32).save({})
        assert not left.exists() and not kthread.exists()
        assert not link.is_symlink(), "the link itself removed"
        assert victim.read_bytes() == b"not the agent's", "not followed"
        assert writing.read_bytes() == b"partial", "a live writer's file kept"
        assert other.exists(), "only this file's leftovers"
        assert not mine.exists()
    finally:
        writer.kill()
        writer.wait()
    lines = [r.getMessage() for r in caplog.records if r.name == "agent.keptfile"]
    assert len(lines) == 1, lines
    assert all(n.name in lines[0] for n in (left, link, kthread, mine))
    assert f"({1005 + len(str(victim))} bytes)" in lines[0], "the bytes freed"
    keptfile.sweep(path)
    assert not writing.exists(), "its writer killed: the lock went with it"


def test_a_write_whose_temporary_file_a_sweep_removed_before_its_lock_makes_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the writer's O_EXCL make and its flock a sweep can find the file unlocked and
    unlink it: the writer must not write into an unlinked inode (its rename would fail, or take
    a name made since), but make the file again."""
    path = str(tmp_path / "run" / "records.pickle")
    tmp = f"{path}.{os.getpid()}.tmp"
    flock = fcntl.flock
    swept: list[str] = []

    def racing(fd: int, op: int) -> None:
        if not swept:  # a sweep in another process, right before this lock
            swept.append(tmp)
            keptfile.sweep(path)
            assert not os.path.exists(tmp)
        flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", racing)  # as keptfile calls it
    keptfile.write(path, b"H", lambda pickler: pickler.dump({"a": 1}))
    assert swept == [tmp] and not os.path.exists(tmp)
    with open(path, "rb") as f:
        assert f.read(1) == b"H"
        f.seek(1 + 32)
        assert pickle.load(f) == {"a": 1}


def test_a_forked_child_does_not_keep_a_dead_writers_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child forked while the agent writes (no exec) closes its copy of the temporary file's fd:
    the lock ends with the writer, not with the child."""
    path = str(tmp_path / "run" / "records.pickle")
    tmp = f"{path}.{os.getpid()}.tmp"
    children: list[int] = []

    def dump(pickler: pickle.Pickler) -> None:
        ready, child_ready = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(child_ready, b"!")  # the fork's hooks ran
            time.sleep(60)
            os._exit(0)
        children.append(pid)
        os.close(child_ready)
        assert os.read(ready, 1) == b"!"
        os.close(ready)
        pickler.dump({})
        raise KeyboardInterrupt  # stopped while it wrote; the file left as a kill would leave it

    unlink = os.unlink
    monkeypatch.setattr(os, "unlink", lambda p, *a, **k: None if p == tmp else unlink(p, *a, **k))
    try:
        with pytest.raises(KeyboardInterrupt):
            keptfile.write(path, b"H", dump)
        monkeypatch.undo()
        assert os.path.exists(tmp)
        keptfile.sweep(path)
        assert not os.path.exists(tmp), "the child kept the lock"
    finally:
        os.kill(children[0], 9)
        os.waitpid(children[0], 0)


def test_the_temporary_files_fd_is_closed_in_forked_children_from_its_open_to_its_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child forked between the O_EXCL open and the flock would hold the lock once taken (a
    copy of the fd), and one forked after the writer's close must not close another file that
    took the fd's number: the fd is in the at-fork registry from its open until right before its
    close."""
    path = str(tmp_path / "run" / "records.pickle")
    at_lock: list[bool] = []
    at_close: list[bool] = []
    flock = fcntl.flock
    fdopen = os.fdopen

    def locking(fd: int, op: int) -> None:
        at_lock.append(fd in keptfile._WRITING)
        flock(fd, op)

    class Closing(io.BufferedWriter):
        def close(self) -> None:
            at_close.append(self.fileno() in keptfile._WRITING)
            super().close()

    def opening(fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode == "wb":
            return Closing(io.FileIO(fd, "wb"))
        return fdopen(fd, mode, *args, **kwargs)

    monkeypatch.setattr(fcntl, "flock", locking)
    monkeypatch.setattr(os, "fdopen", opening)
    keptfile.write(path, b"H", lambda pickler: pickler.dump({"a": 1}))
    assert at_lock == [True] and at_close == [False]
    assert not keptfile._WRITING


def test_an_agent_installed_without_its_sources_takes_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The identity hashes the agent's sources; an install without them (bytecode alone) cannot
    say which version wrote a file, so no two starts share an identity and no file is taken."""
    assert keptfile.identity(b"m", Config()) == keptfile.identity(b"m", Config())
    monkeypatch.setattr(keptfile, "_AGENT_DIR", tmp_path)
    assert keptfile.identity(b"m", Config()) != keptfile.identity(b"m", Config())
