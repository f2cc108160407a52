"""The planner kept across a restart (agent/ebpf/snapshot.py): a restart that takes it carries on
as the stopped agent would have, and one that must not (a file from another state, truncated,
corrupted, from other flags, foreign, or maps written since) falls back to the read-back and
ends with the maps a read-back restart gives."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent import keptfile
from agent.config import Config, NodeContext
from agent.ebpf import EbpfProxier, snapshot
from agent.ebpf.abi import FrontendKey, Scope, ip_be, port_be
from agent.ebpf.planner import ROLES
from agent.ebpf.render import render_contents
from agent.keptrecords import records_path
from agent.model.types import ProxyState
from tests.agent.test_keptrecords import dead_pid
from tests.ebpf.support import NODE
from tests.ebpf.test_proxier import MORE, STATE, Rig, bpffs, cgroup, live, node_ns

__all__ = ["bpffs", "cgroup", "node_ns"]  # the kernel test's fixtures

TAKEN = "took the last run's planner"
NOT_USED = "is not used"


def snapshot_rig(tmp: Path, name: str, with_snapshot: bool = True) -> Rig:
    rig = Rig(tmp / name)
    rig.config = replace(rig.config, pin_path=str(tmp / "pins"))  # the same pin path: the same file name
    rig.snapshot_dir = str(tmp / f"run-{name}") if with_snapshot else None
    return rig


def raw(rig: Rig) -> dict[str, tuple[bytes, bytes]]:
    return {role: rig.maps[role].dump_raw() for role in ROLES}


def moved_endpoint(state: ProxyState) -> ProxyState:
    """One port's first endpoint replaced by another address (a change while the agent is down)."""
    spn = sorted(state.endpoints)[0]
    eps = state.endpoints[spn]
    cluster = (eps.cluster[0]._replace(ip="10.244.9.9"), *eps.cluster[1:])
    return ProxyState(
        node=state.node,
        services=state.services,
        endpoints={**state.endpoints, spn: replace(eps, cluster=cluster, all_reachable=cluster)},
    )


def history(rig: Rig) -> None:
    """A first start, a change the maps remember (a backend freed and another taken), a stop."""
    p = rig.proxier()
    p.sync(MORE, NODE)
    p.sync(moved_endpoint(MORE), NODE, frozenset(MORE.services))
    p.sync(MORE, NODE, frozenset(MORE.services))
    p.close()


def never_stopped(tmp: Path) -> tuple[Rig, EbpfProxier]:
    """`history` on an agent that does not stop (no planner file): what a restart must match."""
    kept = snapshot_rig(tmp, "kept", with_snapshot=False)
    k = kept.proxier()
    k.sync(MORE, NODE)
    k.sync(moved_endpoint(MORE), NODE, frozenset(MORE.services))
    k.sync(MORE, NODE, frozenset(MORE.services))
    return kept, k


@pytest.mark.parametrize(
    "after",
    [MORE, STATE, moved_endpoint(MORE)],
    ids=["unchanged", "a-service-deleted-while-down", "an-endpoint-moved-while-down"],
)
def test_a_restart_that_takes_the_planner_writes_what_the_agent_would_have_written_had_it_not_stopped(
    tmp_path: Path, after: ProxyState, caplog: pytest.LogCaptureFixture
) -> None:
    restarted = snapshot_rig(tmp_path, "restarted")
    history(restarted)
    path = snapshot.snapshot_path(str(restarted.snapshot_dir), restarted.config.pin_path)
    assert os.path.exists(path), "a clean stop over maps that hold the plan leaves the planner"

    # the same history on an agent that never stopped, its next full sync seeing `after`
    kept, k = never_stopped(tmp_path)
    k.sync(after, NODE)

    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        p = restarted.proxier()
        p.sync(after, NODE)
    assert TAKEN in caplog.text and NOT_USED not in caplog.text
    assert not os.path.exists(path), "the start that read it consumed it"
    assert p.last_flush.summary() == k.last_flush.summary()
    assert raw(restarted) == raw(kept)
    if after is MORE:
        assert p.last_flush.writes == 0 and not any(p.last_flush.deletes.values())
    # the next periodic resync reads the maps back and finds them as the kept planner believes
    assert p.sync(after, NODE).repaired == 0 and p.last_flush.writes == 0

    # and the next change after it is written as a change, the same on both
    p.sync(moved_endpoint(after), NODE, frozenset(after.services))
    k.sync(moved_endpoint(after), NODE, frozenset(after.services))
    assert p.last_flush.summary() == k.last_flush.summary() != ""
    assert raw(restarted) == raw(kept)


def test_a_restart_on_a_node_whose_address_moved_while_down_takes_the_planner_and_moves_its_frontends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The node's address changed while the agent was down (NodePort and node-address frontends
    move with it): the taken planner compares the node with the one it planned for, not with
    nothing, and writes what an agent that never stopped writes for the same change."""
    moved = NodeContext(node_ips=("192.168.0.21",), primary_ip="192.168.0.21")
    restarted = snapshot_rig(tmp_path, "restarted")
    history(restarted)
    kept, k = never_stopped(tmp_path)
    k.sync(MORE, moved)

    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        p = restarted.proxier()
        p.sync(MORE, moved)
    assert TAKEN in caplog.text
    assert p.last_flush.writes > 0, "the frontends on the node's address moved"
    assert p.last_flush.summary() == k.last_flush.summary()
    assert raw(restarted) == raw(kept)


def _truncate(path: str | None) -> None:
    if path is None:
        return  # the rig without a file
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


def _flip_last_byte(path: str | None) -> None:
    if path is None:
        return
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def _forget_one_frontend(rig: Rig) -> None:
    key, _ = rig.maps["fe"].items_raw()[0]
    rig.maps["fe"].delete_raw([key])


def _rewrite_one_backend(rig: Rig) -> None:
    """Someone (bpftool, another agent) rewrote a backend's entry with another port."""
    key, value = rig.maps["be"].items_raw()[0]  # a backend STATE keeps
    changed = bytearray(value)
    changed[4] ^= 0x01
    rig.maps["be"].update_raw([key], [bytes(changed)])


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda rig, path: _truncate(path), "checksum"),
        (lambda rig, path: _flip_last_byte(path), "checksum"),
        (lambda rig, path: _forget_one_frontend(rig), "the maps changed"),
        (lambda rig, path: _rewrite_one_backend(rig), "the maps changed"),
        (lambda rig, path: path and Path(path).write_bytes(b""), "not a file of this format"),
    ],
    ids=["truncated", "corrupted", "a-frontend-deleted-since", "a-backend-rewritten-since", "empty"],
)
def test_a_snapshot_that_does_not_match_is_not_used_and_the_maps_end_as_a_read_back_restart_leaves_them(
    tmp_path: Path, damage: object, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    with_snap = snapshot_rig(tmp_path, "with")
    without = snapshot_rig(tmp_path, "without", with_snapshot=False)
    history(with_snap)
    history(without)
    path = snapshot.snapshot_path(str(with_snap.snapshot_dir), with_snap.config.pin_path)
    assert callable(damage)
    damage(with_snap, path)
    damage(without, None)  # the same change to its maps (it has no file)

    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        p = with_snap.proxier()
        p.sync(STATE, NODE)
    assert NOT_USED in caplog.text and why in caplog.text and TAKEN not in caplog.text
    assert not os.path.exists(path)
    q = without.proxier()
    q.sync(STATE, NODE)
    assert p.last_flush.summary() == q.last_flush.summary()
    assert raw(with_snap) == raw(without)
    assert with_snap.contents() == without.contents()


def test_a_snapshot_of_another_nodes_state_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file left by a run over other maps (another state) finds its digests wrong: the maps of
    this node, which hold STATE, are re-adopted and nothing is written."""
    other = snapshot_rig(tmp_path, "other")
    history(other)  # MORE
    here = snapshot_rig(tmp_path, "here")
    p = here.proxier()
    p.sync(STATE, NODE)
    p.close()
    src = snapshot.snapshot_path(str(other.snapshot_dir), other.config.pin_path)
    dst = snapshot.snapshot_path(str(here.snapshot_dir), here.config.pin_path)
    os.replace(src, dst)
    before = raw(here)

    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        again = here.proxier()
        again.sync(STATE, NODE)
    assert "the maps changed" in caplog.text and TAKEN not in caplog.text
    assert again.last_flush.writes == 0 and not any(again.last_flush.deletes.values())
    assert raw(here) == before


def test_a_snapshot_written_with_other_flags_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = snapshot_rig(tmp_path, "rig")
    history(rig)
    rig.config = replace(rig.config, masquerade_all=True)
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        rig.proxier().sync(MORE, NODE)
    assert "other flags" in caplog.text and TAKEN not in caplog.text


def test_a_snapshot_that_names_anything_but_the_planners_types_is_refused_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file put there with a valid header and checksum still cannot run code: the unpickler
    builds the planner's own classes only."""
    rig = snapshot_rig(tmp_path, "rig")
    history(rig)
    path = snapshot.snapshot_path(str(rig.snapshot_dir), rig.config.pin_path)
    canary = tmp_path / "canary"
    canary.write_text("still here")

    class Remove:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.remove, (str(canary),))

    body = pickle.dumps(Remove())
    header = Path(path).read_bytes()[: len(snapshot._MAGIC) + 32 * (1 + len(ROLES))]
    Path(path).write_bytes(header + hashlib.sha256(body).digest() + body)
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        p = rig.proxier()
        p.sync(MORE, NODE)
    assert canary.read_text() == "still here"
    assert "is not part of a planner's state" in caplog.text and TAKEN not in caplog.text
    assert p.last_flush.writes == 0


def test_no_snapshot_is_left_while_the_maps_hold_other_than_the_plan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = snapshot_rig(tmp_path, "rig")
    p = rig.proxier()
    p.sync(MORE, NODE)
    _forget_one_frontend(rig)  # behind the agent's back, before it stops
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        p.close()
    assert "the fe map holds other entries" in caplog.text
    assert not os.path.exists(snapshot.snapshot_path(str(rig.snapshot_dir), rig.config.pin_path))


def test_cleanup_removes_the_planner_left_for_the_next_start(tmp_path: Path) -> None:
    rig = snapshot_rig(tmp_path, "rig")
    history(rig)
    path = snapshot.snapshot_path(str(rig.snapshot_dir), rig.config.pin_path)
    assert os.path.exists(path)
    records = Path(records_path(str(rig.snapshot_dir), rig.config.pin_path))  # agent.keptrecords'
    records.write_bytes(b"the model's records")
    rig.proxier().cleanup()
    assert not os.path.exists(path) and not records.exists()


def test_on_a_real_data_path_a_clean_stop_leaves_the_planner_and_the_restart_takes_it(
    node_ns: str, bpffs: Path, cgroup: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel's batch read-back of an unchanged map comes back in the same order after a
    restart (its digests match), so a real restart takes the planner and writes nothing."""
    config = Config(
        netns=node_ns,
        pin_path=str(bpffs / "ekp"),
        pod_interfaces=("lxc*",),
        # The default sizes: the build the lab's IPv4-only agents load (and test_proxier's end to
        # end test), compiled once for the whole run, not one of its own.
        socket_lb_cgroup=cgroup,
    )
    node = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")
    run = str(tmp_path / "run")
    first = EbpfProxier(config, ipv6=False, snapshot_dir=run)
    try:
        first.sync(MORE, node)
        after_more = render_contents(live(config))
    finally:
        first.close()
    path = snapshot.snapshot_path(run, config.pin_path)
    assert os.path.exists(path)

    second = EbpfProxier(config, ipv6=False, snapshot_dir=run)
    try:
        with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
            second.sync(MORE, node)
        assert TAKEN in caplog.text and NOT_USED not in caplog.text
        assert second.last_flush.writes == 0
        assert render_contents(live(config)) == after_more
        second.sync(STATE, node)  # kube-dns deleted: its frontend goes, as after a read-back
        key = FrontendKey(addr=ip_be("10.96.0.10"), port=port_be(53), proto=17, scope=int(Scope.INTERNAL))
        assert key not in live(config).fe
    finally:
        second.cleanup()
    assert not os.path.exists(path)


def test_a_start_removes_the_partial_file_a_stop_killed_while_writing_left(tmp_path: Path) -> None:
    rig = snapshot_rig(tmp_path, "rig")
    history(rig)
    path = snapshot.snapshot_path(str(rig.snapshot_dir), rig.config.pin_path)
    partial = Path(f"{path}.{dead_pid()}.tmp")
    partial.write_bytes(Path(path).read_bytes()[:100])
    rig.proxier().sync(MORE, NODE)
    assert not partial.exists() and not os.path.exists(path)


def test_after_a_restart_that_took_it_the_planner_holds_the_models_own_records(tmp_path: Path) -> None:
    """The kept planner's records are unpickled copies: the first full plan swaps in the model's
    equal ones, so later full re-plans skip unchanged ports by identity and no copy stays held."""
    rig = snapshot_rig(tmp_path, "rig")
    history(rig)
    p = rig.proxier()
    p.sync(MORE, NODE)
    planner = p._planner
    assert planner is not None
    for spn, sp in MORE.services.items():
        frag = planner._frags[spn]
        assert frag.sp is sp
        assert spn not in MORE.endpoints or frag.eps is MORE.endpoints[spn]


def test_a_taken_planner_holds_the_models_records_not_the_files_and_none_for_a_port_changed_since(
    tmp_path: Path,
) -> None:
    """The file's records (each port's Service and endpoints) are compared with the model's as
    they are read and dropped: the planner taken holds the model's own objects, never a second
    copy (140 MB at 50,000 Services), and none for a port that changed while the agent was down,
    which its first update then plans again."""
    rig = snapshot_rig(tmp_path, "rig")
    history(rig)
    after = moved_endpoint(MORE)
    moved = sorted(MORE.endpoints)[0]
    path = snapshot.snapshot_path(str(rig.snapshot_dir), rig.config.pin_path)
    planner, why = snapshot.take(path, raw(rig), snapshot.identity(rig.config), rig.config, after)
    assert planner is not None, why
    frags = planner._frags
    assert set(frags) == set(MORE.services)
    for spn, frag in frags.items():
        if spn == moved:
            assert frag.sp is None and frag.eps is None
        else:
            assert frag.sp is after.services[spn] and frag.eps is after.endpoints[spn]


def test_the_files_records_keep_the_endpoints_as_plain_tuples(tmp_path: Path) -> None:
    """Unpickling 100,000 `Endpoint`s runs their Python `__new__`; the records are only compared,
    so the file keeps each endpoint as the plain tuple of its fields (snapshot._plain), and a chunk
    of records reads back with the `Endpoint` class refused."""
    rig = snapshot_rig(tmp_path, "rig")
    history(rig)
    path = snapshot.snapshot_path(str(rig.snapshot_dir), rig.config.pin_path)
    with open(path, "rb") as f:
        f.seek(len(snapshot._MAGIC) + 32 * (2 + len(ROLES)))
        state = keptfile.Restricted(f, snapshot._ALLOWED, "a planner's state").load()
        no_endpoint = snapshot._ALLOWED - {("agent.model.types", "Endpoint")}
        records: list[Any] = []
        while len(records) < len(state["_frags"]):
            records += keptfile.Restricted(f, no_endpoint, "a chunk of records").load()
    endpoints = {spn: eps for spn, (_, eps) in zip(state["_frags"], records, strict=True)}
    assert endpoints == {spn: snapshot._plain(MORE.endpoints.get(spn)) for spn in state["_frags"]}
    assert any(eps[0] for eps in endpoints.values() if eps is not None), "some port has endpoints"


@pytest.mark.parametrize(
    "field", ["port", "ready", "serving", "terminating", "node_name", "zone", "zone_hints", "is_local"]
)
def test_kept_endpoints_equal_the_models_exactly_when_the_records_are_equal(field: str) -> None:
    eps = next(e for e in MORE.endpoints.values() if e.cluster)
    kept = snapshot._plain(eps)
    assert snapshot._fields(eps) == kept
    value = getattr(eps.cluster[0], field)
    other: Any
    if isinstance(value, bool):
        other = not value
    elif isinstance(value, int):
        other = value + 1
    elif isinstance(value, str):
        other = value + "x"
    else:
        other = frozenset({"zone-b"})
    moved = (eps.cluster[0]._replace(**{field: other}), *eps.cluster[1:])
    assert snapshot._fields(replace(eps, cluster=moved, all_reachable=moved)) != kept
    assert snapshot._fields(replace(eps, has_any=not eps.has_any)) != kept


def test_a_snapshot_written_by_an_agent_whose_sources_changed_under_it_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An upgrade in place while the agent runs: the stopping agent's planner is of the code it
    started with, and the new code (another layout under the same names, maybe) must refuse it."""
    sources = tmp_path / "agent"
    sources.mkdir()
    (sources / "planner.py").write_text("LAYOUT = 1\n")
    monkeypatch.setattr(keptfile, "_AGENT_DIR", sources)
    rig = snapshot_rig(tmp_path, "rig")
    p = rig.proxier()  # started with LAYOUT = 1
    p.sync(MORE, NODE)
    (sources / "planner.py").write_text("LAYOUT = 2\n")  # upgraded under it
    p.close()
    assert os.path.exists(snapshot.snapshot_path(str(rig.snapshot_dir), rig.config.pin_path))
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        rig.proxier().sync(MORE, NODE)  # the new code starts
    assert "another agent build" in caplog.text and TAKEN not in caplog.text


def _saved(tmp_path: Path) -> tuple[Rig, str]:
    rig = snapshot_rig(tmp_path, "rig")
    history(rig)
    path = snapshot.snapshot_path(str(rig.snapshot_dir), rig.config.pin_path)
    assert os.path.exists(path)
    return rig, path


def test_a_link_at_the_snapshots_name_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig, path = _saved(tmp_path)
    target = tmp_path / "elsewhere.pickle"
    os.replace(path, target)  # a valid snapshot, reached only through the link
    os.symlink(target, path)
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        rig.proxier().sync(MORE, NODE)
    assert "cannot open it" in caplog.text and TAKEN not in caplog.text
    assert not os.path.lexists(path) and target.exists()  # the link removed, never its target


def test_a_fifo_at_the_snapshots_name_neither_hangs_the_start_nor_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig, path = _saved(tmp_path)
    os.unlink(path)
    os.mkfifo(path, 0o600)  # opened without O_NONBLOCK, the start would wait for a writer forever
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        rig.proxier().sync(MORE, NODE)
    assert "not a regular file" in caplog.text and TAKEN not in caplog.text
    assert not os.path.lexists(path)


def test_a_directory_at_the_snapshots_name_is_refused_without_failing_the_sync_or_leaking_its_fd(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig, path = _saved(tmp_path)
    os.unlink(path)
    os.mkdir(path)  # opens O_RDONLY as a file would; reading it raises IsADirectoryError
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        rig.proxier().sync(MORE, NODE)
    assert "not a regular file" in caplog.text and TAKEN not in caplog.text
    fds = os.listdir("/proc/self/fd")
    assert path not in {
        os.readlink(f"/proc/self/fd/{n}") for n in fds if os.path.lexists(f"/proc/self/fd/{n}")
    }


def test_a_file_larger_than_any_planner_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rig, path = _saved(tmp_path)
    size = os.path.getsize(path)
    monkeypatch.setattr(snapshot, "MAX_BYTES", size - 1)
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        rig.proxier().sync(MORE, NODE)
    assert f"{size} bytes, more than the {size - 1}" in caplog.text and TAKEN not in caplog.text


def test_a_snapshot_whose_header_cannot_be_read_is_not_used_and_the_sync_reads_the_maps_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An I/O error while checking the file's header (EIO on a failing disk) costs the start its
    planner, not its first sync: the maps are read back, and the log says why."""
    rig, path = _saved(tmp_path)

    def failing(*args: object) -> str:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(keptfile, "check", failing)
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        rig.proxier().sync(MORE, NODE)
    assert NOT_USED in caplog.text and "cannot be read: [Errno 5] Input/output error" in caplog.text
    assert TAKEN not in caplog.text and not os.path.exists(path)


def test_a_stop_replaces_a_link_at_its_temporary_name_instead_of_writing_through_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link left at the temporary file's name (this pid's) would have the stop write the pickle
    wherever it points."""
    rig = snapshot_rig(tmp_path, "rig")
    p = rig.proxier()
    p.sync(MORE, NODE)
    path = snapshot.snapshot_path(str(rig.snapshot_dir), rig.config.pin_path)
    victim = tmp_path / "victim"
    victim.write_text("kept")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    p.close()
    assert victim.read_text() == "kept"
    assert os.stat(path).st_mode & 0o777 == 0o600 and not os.path.islink(path)
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        rig.proxier().sync(MORE, NODE)
    assert TAKEN in caplog.text
