"""The model's records kept across a clean restart (agent/keptrecords.py): a restart takes a kept
record only for the same object (uid and resourceVersion), and ends in a cold start's state."""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from agent import keptfile
from agent.config import Config
from agent.daemon import Agent, Parts
from agent.keptrecords import KeptRecords, identity, records_path
from agent.model.tracker import read_slice
from agent.sources.base import Event, EventType, Kind, ObjectEvent, Synced, object_key
from tests.agent.test_daemon import NODE, FakeProxier, FakeSource
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


def _agent(records: KeptRecords | None) -> Agent:
    return Agent(
        CONFIG, Parts(source=FakeSource(), proxier=FakeProxier(), node_context=lambda: NODE, records=records)
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
    restarted = _agent(kept)
    _list(restarted, _cluster_v2())
    cold = _agent(None)
    _list(cold, _cluster_v2())

    assert _state(restarted) == _state(cold)
    assert kept.taken == 2, "only the unchanged Service and slice ('same') may be taken, the rest read"
    assert not os.path.exists(path), "the start consumed the file"


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
