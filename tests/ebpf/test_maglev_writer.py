"""The Maglev tables the planner's frontends need, written and kept by MaglevWriter (fake maps)."""

from __future__ import annotations

from array import array
from dataclasses import replace

from agent.config import Config
from agent.ebpf.abi import MAPS, FrontendFlag
from agent.ebpf.maglev import DEFAULT_TABLE_SIZE, populate
from agent.ebpf.maglev_writer import MaglevWriter
from agent.ebpf.maps import FakeMap
from agent.model.types import ProxyState
from tests.ebpf.support import GOLDEN, PlanRig, state_from_yaml

M = DEFAULT_TABLE_SIZE
NODEPORT = (GOLDEN / "nodeport-etp-cluster.yaml").read_text()


def tables(m: FakeMap) -> dict[int, list[int]]:
    keys, values = m.dump_raw()
    out = {}
    for i in range(len(keys) // 4):
        set_id = int.from_bytes(keys[4 * i : 4 * i + 4], "little")
        out[set_id] = array("I", values[4 * M * i : 4 * M * (i + 1)]).tolist()
    return out


def without_endpoint(state: ProxyState, ip: str) -> ProxyState:
    eps = {
        name: replace(e, cluster=tuple(x for x in e.cluster if x.ip != ip))
        for name, e in state.endpoints.items()
    }
    return replace(state, endpoints=eps)


def test_maglev_marks_only_external_frontends_of_the_external_scope() -> None:
    rig = PlanRig(Config(bpf_lb_algorithm="maglev"))
    rig.sync(state_from_yaml(NODEPORT))
    marked = {
        (k.addr, k.port, k.scope) for k, fe in rig.contents().fe.items() if fe.flags & FrontendFlag.MAGLEV
    }
    assert len(marked) == 1  # the NodePort, EXTERNAL scope; not the ClusterIP, not the pods' scope
    (only,) = marked
    assert only[2] == 0


def test_the_table_of_a_nodeport_set_names_its_backends_as_maglev_fills_it() -> None:
    rig = PlanRig(Config(bpf_lb_algorithm="maglev"))
    rig.sync(state_from_yaml(NODEPORT))
    wanted = rig.planner.maglev_tables()
    assert wanted == {1: (("10.244.2.10:8080", "10.244.3.11:8080"), (1, 2))}
    m = FakeMap(MAPS["maglev"])
    writer = MaglevWriter(M)
    assert writer.sync(m, wanted) == 1  # nothing held yet: one table to write
    ids = (1, 2)
    assert tables(m) == {1: [ids[i] for i in populate(["10.244.2.10:8080", "10.244.3.11:8080"], M)]}
    assert writer.writes == 1
    assert writer.sync(m, wanted) == 0 and writer.writes == 1  # unchanged: not written again


def test_a_backend_leaving_rewrites_the_table_and_no_maglev_frontend_deletes_it() -> None:
    rig = PlanRig(Config(bpf_lb_algorithm="maglev"))
    state = state_from_yaml(NODEPORT)
    rig.sync(state)
    m = FakeMap(MAPS["maglev"])
    writer = MaglevWriter(M)
    writer.sync(m, rig.planner.maglev_tables())
    rig.sync(without_endpoint(state, "10.244.3.11"))
    writer.sync(m, rig.planner.maglev_tables())
    assert tables(m) == {1: [1] * M}
    writer.sync(m, {})
    assert tables(m) == {}


def test_a_restarted_agent_reads_the_tables_back_and_repairs_a_wrong_one() -> None:
    rig = PlanRig(Config(bpf_lb_algorithm="maglev"))
    rig.sync(state_from_yaml(NODEPORT))
    wanted = rig.planner.maglev_tables()
    m = FakeMap(MAPS["maglev"])
    MaglevWriter(M).sync(m, wanted)
    again = MaglevWriter(M)
    assert again.sync(m, wanted) == 0 and again.writes == 0  # the same table: adopted, not rewritten
    m.update_raw([(1).to_bytes(4, "little")], [array("I", [2] * M).tobytes()])  # changed behind our back
    m.update_raw([(9).to_bytes(4, "little")], [array("I", [2] * M).tobytes()])  # a set no one uses
    assert again.sync(m, wanted, full=True) == 2
    assert set(tables(m)) == {1} and tables(m)[1] != [2] * M


def test_random_algorithm_marks_nothing_and_needs_no_table() -> None:
    rig = PlanRig(Config())
    rig.sync(state_from_yaml(NODEPORT))
    assert not any(fe.flags & FrontendFlag.MAGLEV for fe in rig.contents().fe.values())
    assert rig.planner.maglev_tables() == {}
