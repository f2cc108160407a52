"""Which IPv6 service ports eBPF mode still writes ip6tables rules for (agent/model/tc6_leaves.py):
what the socket programs and the tc programs' IPv6 path leave to the stack, per bpf/ekp_sock.h and
bpf/ekp_tc6.h."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.model.tc6_leaves import Left, Tc6Facts, left_to_ip6tables, ports_left
from agent.model.types import (
    Endpoint,
    IPFamily,
    NodeInfo,
    Protocol,
    ProxyState,
    ServiceEndpoints,
    ServicePort,
    ServicePortName,
    SessionAffinity,
)

NODE_IPS = frozenset({"fd00:192:168::11"})
SPN = ServicePortName("default", "web", "http", Protocol.TCP)
CLUSTER_IP = ServicePort(SPN, "fd00:10:96::a", 80, Protocol.TCP)
REMOTE = Endpoint("fd00:10:244:2::2", 8080, node_name="node2")
LOCAL = Endpoint("fd00:10:244:1::2", 8080, node_name="node1", is_local=True)
HOST = Endpoint("fd00:192:168::11", 6443, node_name="node1", is_local=True)
HOST_REMOTE = Endpoint("fd00:192:168::12", 6443, node_name="node2")  # another node's address

GRANTED = Tc6Facts(serves=True, leaves_host_backends=True, snat_granted=True, detector=True)
NOT_GRANTED = replace(GRANTED, snat_granted=False)


def eps(*endpoints: Endpoint) -> ServiceEndpoints:
    local = tuple(ep for ep in endpoints if ep.is_local)
    return ServiceEndpoints(cluster=endpoints, local=local, all_reachable=endpoints, has_any=bool(endpoints))


NODE_PORT = replace(CLUSTER_IP, node_port=30080)
NODE_PORT_LOCAL = replace(NODE_PORT, external_policy_local=True)
LB_RANGES = replace(
    CLUSTER_IP, load_balancer_ips=("fd00:203::5",), load_balancer_source_ranges=("fd00:1::/64",)
)

CASES = [
    # (service port, endpoints, facts, why)
    (CLUSTER_IP, eps(REMOTE), GRANTED, Left.NONE),
    (CLUSTER_IP, eps(LOCAL), GRANTED, Left.NONE),  # a hairpin is masqueraded by tc once granted
    (NODE_PORT, eps(REMOTE, LOCAL), GRANTED, Left.NONE),
    (CLUSTER_IP, eps(), GRANTED, Left.NONE),  # rejects: tc answers, the socket programs refuse
    (CLUSTER_IP, None, GRANTED, Left.NONE),
    # a backend on the node's own address: tc hands the frontend whole to the stack
    (CLUSTER_IP, eps(REMOTE, HOST), GRANTED, Left.HOST_BACKEND),
    (CLUSTER_IP, eps(HOST_REMOTE), GRANTED, Left.NONE),  # another node's: a remote backend
    (CLUSTER_IP, eps(REMOTE, HOST), replace(GRANTED, leaves_host_backends=False), Left.NONE),
    # not granted: SNAT_ALL / SNAT_REMOTE frontends and hairpins go to ip6tables' masquerade
    (CLUSTER_IP, eps(REMOTE), NOT_GRANTED, Left.SNAT),  # the detector: non-local ClusterIP traffic
    (CLUSTER_IP, eps(REMOTE), replace(NOT_GRANTED, detector=False), Left.NONE),
    (CLUSTER_IP, eps(REMOTE), replace(NOT_GRANTED, detector=False, masquerade_all=True), Left.SNAT),
    (CLUSTER_IP, eps(LOCAL), replace(NOT_GRANTED, detector=False), Left.HAIRPIN),
    (NODE_PORT, eps(REMOTE), replace(NOT_GRANTED, detector=False), Left.SNAT),
    (NODE_PORT_LOCAL, eps(REMOTE), replace(NOT_GRANTED, detector=False), Left.NONE),
    (CLUSTER_IP, eps(HOST), NOT_GRANTED, Left.HOST_BACKEND | Left.SNAT | Left.HAIRPIN),
    # what the socket programs leave of the node's own sockets, which tc ingress never sees
    (replace(CLUSTER_IP, protocol=Protocol.SCTP), eps(REMOTE), GRANTED, Left.SCTP),
    (replace(CLUSTER_IP, protocol=Protocol.UDP), eps(REMOTE), GRANTED, Left.NONE),
    (LB_RANGES, eps(REMOTE), GRANTED, Left.SOURCE_RANGES),
    (replace(LB_RANGES, load_balancer_ips=()), eps(REMOTE), GRANTED, Left.NONE),
    # the tc path off (legacy host routing, no socket LB): ip6tables serves every port
    (CLUSTER_IP, eps(REMOTE), replace(GRANTED, serves=False), Left.UNSERVED),
]


@pytest.mark.parametrize(("sp", "endpoints", "facts", "why"), CASES)
def test_a_port_is_left_to_ip6tables_for_what_the_ebpf_programs_leave_to_the_stack(
    sp: ServicePort, endpoints: ServiceEndpoints | None, facts: Tc6Facts, why: Left
) -> None:
    assert left_to_ip6tables(sp, endpoints, NODE_IPS, facts) == why


def test_ports_left_names_the_ports_of_the_state_with_a_reason() -> None:
    api = ServicePortName("default", "kubernetes", "https", Protocol.TCP)
    state = ProxyState(
        NodeInfo("node1"),
        {SPN: CLUSTER_IP, api: replace(CLUSTER_IP, name=api, cluster_ip="fd00:10:96::1")},
        {SPN: eps(REMOTE), api: eps(HOST)},
        family=IPFamily.IPv6,
    )
    assert ports_left(state, NODE_IPS, GRANTED) == {api}
    assert ports_left(state, NODE_IPS, NOT_GRANTED) == {api, SPN}
    assert ports_left(state, (), GRANTED) == set(), "a host backend is one on the node's own address"


EXTERNAL_IP = replace(CLUSTER_IP, external_ips=("fd00:203::7",))
LB = replace(CLUSTER_IP, load_balancer_ips=("fd00:203::5",), node_port=30081)
SPREAD = [
    CLUSTER_IP,
    replace(CLUSTER_IP, internal_policy_local=True),
    replace(NODE_PORT, session_affinity=SessionAffinity.CLIENT_IP, affinity_timeout_seconds=10800),
    NODE_PORT,
    NODE_PORT_LOCAL,
    EXTERNAL_IP,
    replace(EXTERNAL_IP, external_policy_local=True),
    LB,
    replace(LB, external_policy_local=True),
    replace(LB_RANGES, node_port=30082),
    replace(CLUSTER_IP, protocol=Protocol.UDP, node_port=30083),
]


@pytest.mark.parametrize("masquerade_all", [False, True])
@pytest.mark.parametrize("cluster_cidr", [("10.244.0.0/16",), ("10.244.0.0/16", "fd00:10:244::/56")])
@pytest.mark.parametrize("keep_client_ip", [False, True])
def test_the_snat_reason_matches_the_ipv6_planners_frontend_flags(
    masquerade_all: bool, cluster_cidr: tuple[str, ...], keep_client_ip: bool
) -> None:
    """tc6_leaves reads SNAT from the service port and the flags, never from the planner: for a
    spread of ports and flags, a port is left to ip6tables for SNAT (not granted) exactly when the
    planner's layout gives one of its frontends SNAT_ALL or SNAT_REMOTE, which the tc IPv6 path
    hands to the stack until granted. A new SNAT reason in the layout fails here until tc6_leaves
    knows it (left out, its frontends would reach a stack without their rules)."""
    from agent.config import Config, HostRouting, Mode, NodeContext
    from agent.ebpf.abi import FrontendFlag
    from agent.ebpf.layout import frontends
    from agent.metaproxier import tc6_facts

    config = Config(
        mode=Mode.EBPF,
        hostname="node1",
        cluster_cidr=cluster_cidr,
        masquerade_all=masquerade_all,
        bpf_keep_client_ip_local=keep_client_ip,
        bpf_host_routing=HostRouting.BPF,
    )
    node = NodeContext(node_ips=tuple(NODE_IPS), primary_ip=next(iter(NODE_IPS)))
    handles: dict[str, int] = {}
    snat = int(FrontendFlag.SNAT_ALL) | int(FrontendFlag.SNAT_REMOTE)
    for sp in SPREAD:
        state = ProxyState(NodeInfo("node1"), {sp.name: sp}, {sp.name: eps(REMOTE)}, family=IPFamily.IPv6)
        facts = tc6_facts(config, state, serves=True, granted=False)
        detector = config.local_detector(state.node.pod_cidrs, 6)
        flagged = frontends(sp, node, config, detector, lambda a: handles.setdefault(a, len(handles) + 1))
        planner_snat = any(fe.flags & snat for fe in flagged)
        assert (Left.SNAT in left_to_ip6tables(sp, eps(REMOTE), NODE_IPS, facts)) == planner_snat, sp
