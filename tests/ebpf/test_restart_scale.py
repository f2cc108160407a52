"""A restart at 10,000 Services: the pinned maps are re-adopted whole and nothing is written, both
by reading them back and through the planner the stopped agent left (agent/ebpf/snapshot.py).

The proxier runs over maps that count every entry written or deleted, as the kernel's maps would
see them (packed batch calls), and outlive the proxier as pins do. The state is what the model
makes of the bench's objects (lab/fakeapi/objects.py): 10,000 Services of 10 endpoints each.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import tracemalloc
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import ParamSpec, TypeVar

import pytest

from agent import keptfile
from agent.config import Config
from agent.ebpf import EbpfProxier, snapshot
from agent.ebpf.abi import MAPS, MapSpec
from agent.ebpf.maps import FakeMap, MapWriter
from agent.ebpf.planner import ROLES
from agent.model.tracker import ProxyModel
from agent.model.types import NodeInfo, ProxyState
from lab.fakeapi.objects import scale_objects
from tests.ebpf.support import NODE
from tests.ebpf.test_proxier import FakeAttacher, FakeDatapath, FakeUpgrade

P = ParamSpec("P")
T = TypeVar("T")


class CountingMap(FakeMap):
    """The service maps' raw side, counting entries written and deleted (the rest is FakeMap's)."""

    def __init__(self, spec: MapSpec) -> None:
        super().__init__(spec, 1 << 20)
        self.raw: dict[bytes, bytes] = {}
        self.ks, self.vs = ctypes.sizeof(spec.key), ctypes.sizeof(spec.value)
        self.written = self.deleted = 0

    def update_packed(self, keys: bytes, values: bytes) -> int:
        n = len(keys) // self.ks
        ks, vs = self.ks, self.vs
        self.raw.update((keys[i * ks : (i + 1) * ks], values[i * vs : (i + 1) * vs]) for i in range(n))
        self.written += n
        return n

    def delete_packed(self, keys: bytes) -> None:
        for i in range(0, len(keys), self.ks):
            self.raw.pop(keys[i : i + self.ks], None)
            self.deleted += 1

    def dump_raw(self) -> tuple[bytes, bytes]:
        return b"".join(self.raw), b"".join(self.raw.values())

    def capacity(self) -> int:
        return self.max_entries


def state(services: int) -> ProxyState:
    model = ProxyModel(NodeInfo("node1"))
    for obj in scale_objects(services, 10):
        meta = obj["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        if obj["kind"] == "Service":
            model.set_service(key, obj)
        else:
            model.set_slice(key, obj)
    model.commit()
    return model.state


def proxier(maps: Mapping[str, MapWriter], tmp: Path, snapshot_dir: str | None = None) -> EbpfProxier:
    return EbpfProxier(
        Config(pin_path=str(tmp / "pins")),
        datapath_factory=lambda pin_path, sizes: FakeDatapath(maps),  # type: ignore[arg-type]
        attacher_factory=lambda config, fds, ports: FakeAttacher([], maps),
        sysctl_writer=lambda netns, path, value: None,
        sysctl_reader=lambda netns, path: "32768\t60999",
        sizes_reader=lambda pin_path: {},
        upgrade_factory=lambda pin_path: FakeUpgrade([]),
        xdp_devices_reader=lambda config, ipv6: {},
        snapshot_dir=snapshot_dir,
        ipv6=False,
    )


def traced(run: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> tuple[T, int, int]:
    """`run(...)`'s result, what it left allocated (traced) and its peak over that. The collector
    is held from right after a full collection until both figures are read: an automatic
    collection comes due wherever the counters that every earlier test moved put it, and one that
    came in the window freed an earlier step's copy's cycles there and took them off the figure
    (the planner with copies of the records: 21.8 MB instead of 28.3, one run in a few)."""
    gc.collect()
    with keptfile.collector_held():
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = run(*args, **kwargs)
        at_end, peak = tracemalloc.get_traced_memory()
    return result, at_end - before, peak - at_end


@pytest.fixture(scope="module")
def big() -> ProxyState:
    return state(10_000)


@pytest.fixture(scope="module")
def medium() -> ProxyState:
    """Enough for the planner file's body (4 MB) to stand out of the memos' noise, at a third of
    the time tracemalloc takes at 10,000 Services (20 s)."""
    return state(3_000)


@pytest.mark.parametrize("kept", [False, True], ids=["read-back", "planner-kept"])
def test_a_restart_over_unchanged_state_re_adopts_every_entry_and_writes_nothing(
    big: ProxyState, tmp_path: Path, kept: bool, caplog: pytest.LogCaptureFixture
) -> None:
    counting = {role: CountingMap(MAPS[role]) for role in ROLES}
    maps: dict[str, MapWriter] = {**{r: FakeMap(s) for r, s in MAPS.items()}, **counting}
    snapshot_dir = str(tmp_path / "run") if kept else None
    first = proxier(maps, tmp_path, snapshot_dir)
    first.sync(big, NODE)
    held = {role: len(m.raw) for role, m in counting.items()}
    assert held == {
        "fe": 20_000,
        "slot": 100_000,
        "be": 100_000,
        "rnat": 10_000,
        "member": 100_000,
        "srcr": 0,
        "addr": 110_000,  # the cluster IPs and the endpoints' addresses
    }
    assert sum(m.written for m in counting.values()) == sum(held.values())
    # A history the maps remember: one port's last endpoint replaced by one that sorts first takes
    # the freed last slot (survivors keep theirs), not the first as a fresh plan would give it.
    spn = next(iter(big.services))
    eps = big.endpoints[spn]
    newcomer = eps.cluster[0]._replace(ip="10.0.0.1")
    cluster = (newcomer, *eps.cluster[:-1])
    big = ProxyState(
        node=big.node,
        services=big.services,
        endpoints={**big.endpoints, spn: replace(eps, cluster=cluster, all_reachable=cluster)},
    )
    first.sync(big, NODE, frozenset({spn}))
    assert first.last_flush.summary() == (
        "update addr x1, update be x1, update member x1, update slot x1, delete member x1, delete be x1, "
        "delete addr x1"
    )
    before = {role: dict(m.raw) for role, m in counting.items()}
    for m in counting.values():
        m.written = m.deleted = 0
    first.close()

    again = proxier(maps, tmp_path, snapshot_dir)  # the agent restarted over its pins
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        again.sync(big, NODE)
    assert ("took the last run's planner" in caplog.text) is kept
    # one line says what the start does with the maps it found, and it is true
    found = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pinned maps hold")]
    assert len(found) == 1 and ("re-adopting their ids" in found[0]) is not kept, found
    assert {role: (m.written, m.deleted) for role, m in counting.items()} == dict.fromkeys(ROLES, (0, 0))
    assert {role: m.raw for role, m in counting.items()} == before
    assert again.last_flush.writes == 0

    # the next change after the restart is written as a change, not as a rewrite
    one = next(iter(big.services))
    changed = ProxyState(
        node=big.node,
        services={spn: sp for spn, sp in big.services.items() if spn != one},
        endpoints={spn: eps for spn, eps in big.endpoints.items() if spn != one},
    )
    again.sync(changed, NODE, frozenset({one}))
    assert again.last_flush.summary() == (
        "delete fe x2, delete slot x10, delete member x10, delete be x10, delete rnat x1, delete addr x11"
    )


def test_the_planners_file_is_written_and_read_without_its_body_whole_in_memory(
    medium: ProxyState, tmp_path: Path
) -> None:
    """At 50,000 Services the body is 70 MB: held whole at the stop (on top of the pickler's memo
    and the file, which tmpfs charges to the pod) and twice at the start (the bytes read and a
    copy), it took the agent near the chart's memory limit. Only the objects the planner is made
    of, and the pickler's memo, may come on top of what the agent holds anyway (traced here: what
    was allocated above the end's level at the peak of each). The memo is what it is: about 2.5
    times the body (a slot for every object pickled). The records (each port's Service and
    endpoints) are read a chunk at a time and the model's equal ones kept: the planner taken holds
    no copy of them (140 MB at 50,000 Services)."""
    maps: dict[str, MapWriter] = {r: FakeMap(s) for r, s in MAPS.items()}
    first = proxier(maps, tmp_path, str(tmp_path / "run"))
    first.sync(medium, NODE)
    planner, config = first._planner, first._config
    assert planner is not None
    identity = snapshot.identity(config)
    dump = {role: maps[role].dump_raw() for role in ROLES}
    path = snapshot.snapshot_path(str(tmp_path / "run"), config.pin_path)

    class Nowhere:
        def write(self, data: bytes) -> int:
            return len(data)

    def pickle_nowhere(obj: object) -> None:  # the pickler and its memo gone when it returns
        pickle.Pickler(Nowhere(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)

    state = {k: v for k, v in planner.__dict__.items() if k not in snapshot._NOT_KEPT}
    whole = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)  # the planner with its records
    records = pickle.dumps(
        [(frag.sp, frag.eps) for frag in planner._frags.values()], protocol=pickle.HIGHEST_PROTOCOL
    )
    tracemalloc.start()
    try:
        # what pickling costs anyway: the pickler's memo, a frame
        _, _, memo = traced(pickle_nowhere, state)
        # what `save` writes once it checked the maps
        _, _, saving = traced(snapshot.write, path, planner, dump, identity)
        size = os.path.getsize(path)
        body = Path(path).read_bytes()[len(snapshot._MAGIC) + 32 * (2 + len(ROLES)) :]
        loaded, _, unmemo = traced(pickle.loads, body)  # what unpickling costs anyway: its memo
        del body, loaded
        copy, with_copies, _ = traced(pickle.loads, whole)  # the planner with copies of the records
        del copy
        copy, records_held, _ = traced(pickle.loads, records)  # one copy of every port's records
        del copy
        (taken, why), held, taking = traced(snapshot.take, path, dump, identity, config, medium)
    finally:
        tracemalloc.stop()
    assert taken is not None, why
    print(
        f"file {size}, write {saving} over a memo of {memo}, take {taking} over a memo of {unmemo}, "
        f"the taken planner holds {held} (with copies of the records: {with_copies}; "
        f"the records alone {records_held})"
    )
    # The model's records are taken, not copied: each fragment holds the model's own (by identity),
    # and the taken planner holds no second set of them anywhere (by bytes).
    assert taken._frags.keys() == medium.services.keys()
    copied = [
        spn
        for spn, frag in taken._frags.items()
        if frag.sp is not medium.services[spn] or frag.eps is not medium.endpoints[spn]
    ]
    assert not copied, (len(copied), copied[:3])
    assert held < with_copies - records_held // 2, (held, with_copies, records_held)
    assert size > 3 << 20  # about 4 MB at 3,000 x 10 (14 MB at 10,000)
    assert saving < memo + (1 << 20), (saving, memo, size)  # nothing of the body's size on top
    assert taking < unmemo + (2 << 20), (taking, unmemo, size)  # a read buffer on top, no copy of the body
