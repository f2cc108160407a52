"""CategorizeEndpoints, table-driven after kube-proxy's topology_test.go, plus properties."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.model import Endpoint, NodeInfo, Protocol, ServicePort, ServicePortName, categorize_endpoints

NODE = NodeInfo("node1", (("topology.kubernetes.io/zone", "zone-a"),))
SPN = ServicePortName("ns", "svc", "http", Protocol.TCP)


def svc(**kw: object) -> ServicePort:
    base = ServicePort(name=SPN, cluster_ip="10.96.0.1", port=80, protocol=Protocol.TCP)
    return replace(base, **kw)  # type: ignore[arg-type]


def ep(
    ip: str,
    *,
    ready: bool = True,
    serving: bool | None = None,
    terminating: bool = False,
    local: bool = False,
    zones: tuple[str, ...] = (),
    nodes: tuple[str, ...] = (),
) -> Endpoint:
    return Endpoint(
        ip=ip,
        port=80,
        ready=ready,
        serving=ready if serving is None else serving,
        terminating=terminating,
        node_name="node1" if local else "node2",
        zone_hints=frozenset(zones),
        node_hints=frozenset(nodes),
        is_local=local,
    )


def ips(eps: tuple[Endpoint, ...]) -> set[str]:
    return {e.ip for e in eps}


CASES = [
    # (description, service, endpoints, cluster, local, all_reachable, has_any)
    (
        "ready endpoints, cluster policy",
        svc(),
        [ep("10.0.0.1"), ep("10.0.0.2", local=True)],
        {"10.0.0.1", "10.0.0.2"},
        set(),
        {"10.0.0.1", "10.0.0.2"},
        True,
    ),
    (
        "not-ready and not-serving endpoints are never used",
        svc(),
        [ep("10.0.0.1"), ep("10.0.0.2", ready=False, serving=False)],
        {"10.0.0.1"},
        set(),
        {"10.0.0.1"},
        True,
    ),
    (
        "no ready: serving-terminating fallback",
        svc(),
        [
            ep("10.0.0.1", ready=False, serving=True, terminating=True),
            ep("10.0.0.2", ready=False, serving=False, terminating=True),
        ],
        {"10.0.0.1"},
        set(),
        {"10.0.0.1"},
        True,
    ),
    (
        "ready wins over serving-terminating",
        svc(),
        [ep("10.0.0.1"), ep("10.0.0.2", ready=False, serving=True, terminating=True)],
        {"10.0.0.1"},
        set(),
        {"10.0.0.1"},
        True,
    ),
    ("nothing usable", svc(), [ep("10.0.0.1", ready=False, serving=False)], set(), set(), set(), False),
    (
        "zone hints all present, one matches",
        svc(),
        [ep("10.0.0.1", zones=("zone-a",)), ep("10.0.0.2", zones=("zone-b",))],
        {"10.0.0.1"},
        set(),
        {"10.0.0.1"},
        True,
    ),
    (
        "zone hints missing on one ready endpoint: topology ignored",
        svc(),
        [ep("10.0.0.1", zones=("zone-a",)), ep("10.0.0.2")],
        {"10.0.0.1", "10.0.0.2"},
        set(),
        {"10.0.0.1", "10.0.0.2"},
        True,
    ),
    (
        "zone hints none match: topology ignored",
        svc(),
        [ep("10.0.0.1", zones=("zone-b",)), ep("10.0.0.2", zones=("zone-c",))],
        {"10.0.0.1", "10.0.0.2"},
        set(),
        {"10.0.0.1", "10.0.0.2"},
        True,
    ),
    (
        "node hints win over zone hints",
        svc(),
        [
            ep("10.0.0.1", zones=("zone-a",), nodes=("node2",)),
            ep("10.0.0.2", zones=("zone-a",), nodes=("node1",)),
        ],
        {"10.0.0.2"},
        set(),
        {"10.0.0.2"},
        True,
    ),
    (
        "hints on a not-ready endpoint do not count",
        svc(),
        [ep("10.0.0.1", zones=("zone-a",)), ep("10.0.0.2", ready=False, serving=False)],
        {"10.0.0.1"},
        set(),
        {"10.0.0.1"},
        True,
    ),
    (
        "ITP Local: only local ready",
        svc(internal_policy_local=True),
        [ep("10.0.0.1"), ep("10.0.0.2", local=True)],
        set(),
        {"10.0.0.2"},
        {"10.0.0.2"},
        True,
    ),
    (
        "ITP Local, no local endpoint: has_any still true",
        svc(internal_policy_local=True),
        [ep("10.0.0.1")],
        set(),
        set(),
        set(),
        True,
    ),
    (
        "ITP Local, local terminating fallback",
        svc(internal_policy_local=True),
        [ep("10.0.0.1"), ep("10.0.0.2", local=True, ready=False, serving=True, terminating=True)],
        set(),
        {"10.0.0.2"},
        {"10.0.0.2"},
        True,
    ),
    (
        "ETP Local NodePort: cluster and local sets",
        svc(node_port=30080, external_policy_local=True),
        [ep("10.0.0.1"), ep("10.0.0.2", local=True)],
        {"10.0.0.1", "10.0.0.2"},
        {"10.0.0.2"},
        {"10.0.0.1", "10.0.0.2"},
        True,
    ),
    (
        "ETP Local with remote ready and local terminating: union",
        svc(node_port=30080, external_policy_local=True),
        [ep("10.0.0.1"), ep("10.0.0.2", local=True, ready=False, serving=True, terminating=True)],
        {"10.0.0.1"},
        {"10.0.0.2"},
        {"10.0.0.1", "10.0.0.2"},
        True,
    ),
    (
        "ETP Local without external access is ignored",
        svc(external_policy_local=True),
        [ep("10.0.0.1")],
        {"10.0.0.1"},
        set(),
        {"10.0.0.1"},
        True,
    ),
    (
        # Externally reachable: the cluster set still serves the short-circuit of pod traffic
        # to the external addresses (kube-proxy's UsesClusterEndpoints).
        "ETP and ITP Local on a NodePort: cluster set kept for short-circuit",
        svc(node_port=30080, external_policy_local=True, internal_policy_local=True),
        [ep("10.0.0.1"), ep("10.0.0.2", local=True)],
        {"10.0.0.1", "10.0.0.2"},
        {"10.0.0.2"},
        {"10.0.0.1", "10.0.0.2"},
        True,
    ),
    (
        "ITP Local on a ClusterIP: no cluster set",
        svc(internal_policy_local=True, external_policy_local=True),
        [ep("10.0.0.1"), ep("10.0.0.2", local=True)],
        set(),
        {"10.0.0.2"},
        {"10.0.0.2"},
        True,
    ),
]


@pytest.mark.parametrize(
    ("desc", "service", "endpoints", "cluster", "local", "reachable", "has_any"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_categorize(
    desc: str,
    service: ServicePort,
    endpoints: list[Endpoint],
    cluster: set[str],
    local: set[str],
    reachable: set[str],
    has_any: bool,
) -> None:
    got = categorize_endpoints(endpoints, service, NODE)
    assert ips(got.cluster) == cluster
    assert ips(got.local) == local
    assert ips(got.all_reachable) == reachable
    assert got.has_any is has_any


endpoint_st = st.builds(
    lambda i, ready, serving, term, local, zh, nh: ep(
        f"10.0.{i // 250}.{i % 250 + 1}",
        ready=ready,
        serving=serving or ready,
        terminating=term,
        local=local,
        zones=zh,
        nodes=nh,
    ),
    st.integers(0, 2000),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([(), ("zone-a",), ("zone-b",), ("zone-a", "zone-b")]),
    st.sampled_from([(), ("node1",), ("node2",)]),
)
service_st = st.builds(
    lambda np, etp, itp: svc(
        node_port=30000 if np else 0, external_policy_local=etp and np, internal_policy_local=itp
    ),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)


@given(st.lists(endpoint_st, max_size=12, unique_by=lambda e: e.ip), service_st)
def test_properties(endpoints: list[Endpoint], service: ServicePort) -> None:
    got = categorize_endpoints(endpoints, service, NODE)
    for e in (*got.cluster, *got.local, *got.all_reachable):
        # never an endpoint that is neither ready nor serving
        assert e.ready or e.serving
    # local endpoints are on this node and among the candidates
    assert all(e.is_local for e in got.local)
    assert set(got.local) <= set(endpoints)
    assert set(got.cluster) <= set(endpoints)
    # all_reachable is exactly the union
    assert set(got.all_reachable) == set(got.cluster) | set(got.local)
    # a usable endpoint anywhere means has_any, and has_any means something somewhere could serve
    usable = [e for e in endpoints if e.ready or (e.serving and e.terminating)]
    assert got.has_any == bool(usable)
    # ready endpoints, when present, exclude terminating fallbacks from the cluster set
    if any(e.ready for e in endpoints):
        assert all(e.ready for e in got.cluster)
    if not service.uses_cluster_endpoints:
        assert got.cluster == ()
    if not service.uses_local_endpoints:
        assert got.local == ()


def test_feature_gates_turn_node_and_zone_hints_off() -> None:
    """PreferSameTrafficDistribution=false ignores forNodes hints (then zone hints apply);
    TopologyAwareHints and ServiceTrafficDistribution both false ignore forZones hints."""
    eps = [
        ep("10.0.0.1", nodes=("node1",), zones=("zone-b",)),
        ep("10.0.0.2", nodes=("node2",), zones=("zone-a",)),
        ep("10.0.0.3", nodes=("node2",), zones=("zone-b",)),
    ]
    on = categorize_endpoints(eps, svc(), NODE)
    assert ips(on.cluster) == {"10.0.0.1"}
    no_node = categorize_endpoints(eps, svc(), replace(NODE, node_hints=False))
    assert ips(no_node.cluster) == {"10.0.0.2"}
    neither = categorize_endpoints(eps, svc(), replace(NODE, node_hints=False, zone_hints=False))
    assert ips(neither.cluster) == {"10.0.0.1", "10.0.0.2", "10.0.0.3"}
