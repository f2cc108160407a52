"""plan: which frontends, sets, slots and backends a state becomes, and stable ids across syncs.

Golden cases: tests/ebpf/golden/<case>.yaml (Services and EndpointSlices) -> <case>.maps (the
dry-run text). Regenerate with `make golden` (EKP_REGEN_GOLDEN=1) and review the diff.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from agent.cli import resolve
from agent.config import Config, ConntrackSettings, HostRouting, NodeContext
from agent.ebpf import abi, render_dry_run
from agent.ebpf import planner as planner_module
from agent.ebpf.abi import FrontendFlag, FrontendKey, MemberFlag, Scope, SlotKey, ip_be, ip_str, port_be
from agent.ebpf.codec import VALUES
from agent.ebpf.plan import MapContents, plan, planner_contents
from agent.ebpf.planner import PlanError, Planner, config_entry
from agent.ebpf.render import render_contents
from agent.model import ProxyState
from tests.ebpf.support import GOLDEN, NODE, PlanRig, assert_ids_valid, broken, state_from_yaml

CASES = sorted(p.stem for p in GOLDEN.glob("*.yaml"))


@pytest.mark.parametrize("case", CASES)
def test_golden_dry_run(case: str) -> None:
    state = state_from_yaml((GOLDEN / f"{case}.yaml").read_text())
    got = render_dry_run(state, NODE, Config())
    expected_file = GOLDEN / f"{case}.maps"
    if os.environ.get("EKP_REGEN_GOLDEN") == "1":
        expected_file.write_text(got)
    assert expected_file.exists(), f"{expected_file} missing: run `make golden`"
    assert got == expected_file.read_text()


@pytest.mark.parametrize("case", CASES)
def test_golden_cases_are_whole_and_survive_a_dump(case: str) -> None:
    """What the maps hold after a flush renders like the plan; a restart over them writes nothing."""
    state = state_from_yaml((GOLDEN / f"{case}.yaml").read_text())
    planned = plan(state, NODE, Config())
    assert not broken(planned)
    assert_ids_valid(planned)
    rig = PlanRig()
    rig.sync(state)
    dumped = rig.contents()
    dumped.cfg = planned.cfg
    assert render_contents(dumped) == render_contents(planned)
    rig.restart()
    assert rig.sync(state).writes == 0


def test_golden_case_count() -> None:
    assert len(CASES) >= 7


# ---------------------------------------------------------------------------------- helpers

SVC = """
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: {type}
  clusterIP: {ip}
  {extra}
  ports: [{{port: 80, targetPort: 8080, protocol: TCP{nodeport}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{port: 8080, protocol: TCP}}]
endpoints:
{endpoints}
"""


def svc(
    name: str,
    ip: str,
    endpoints: list[str],
    *,
    type: str = "ClusterIP",
    extra: str = "",
    nodeport: int = 0,
) -> str:
    eps = "".join(
        f"  - addresses: [{e}]\n    nodeName: {'node1' if '.1.' in e else 'node2'}\n" for e in endpoints
    )
    return SVC.format(
        name=name,
        ip=ip,
        type=type,
        extra=extra,
        nodeport=f", nodePort: {nodeport}" if nodeport else "",
        endpoints=eps or "  []\n",
    )


def states(*docs: str) -> ProxyState:
    return state_from_yaml("\n---\n".join(docs))


def fe_key(addr: str, port: int, scope: Scope, proto: int = 6) -> FrontendKey:
    return FrontendKey(addr=ip_be(addr), port=port_be(port), proto=proto, scope=int(scope))


def backend_ids(c: MapContents) -> dict[str, int]:
    from agent.ebpf.abi import ip_str

    return {ip_str(v.addr): k.id for k, v in c.be.items()}


# ---------------------------------------------------------------------------------- frontends


def test_nodeport_answers_only_on_nodeport_addresses() -> None:
    node = NodeContext(node_ips=("192.168.0.11", "10.0.0.11"), primary_ip="192.168.0.11")
    state = states(svc("np", "10.96.0.5", ["10.244.1.2"], type="NodePort", nodeport=30005))
    every = plan(state, node, Config())
    assert fe_key("10.0.0.11", 30005, Scope.EXTERNAL) in every.fe
    only = plan(state, node, Config(nodeport_addresses=("192.168.0.0/24",)))
    assert fe_key("10.0.0.11", 30005, Scope.EXTERNAL) not in only.fe
    assert fe_key("192.168.0.11", 30005, Scope.EXTERNAL) in only.fe


def test_masquerade_all_and_cluster_cidr_snat_cluster_ip_traffic() -> None:
    """kube-proxy's KUBE-MARK-MASQ for the cluster IP: every backend, local ones too (SNAT_ALL)."""
    state = states(svc("a", "10.96.0.5", ["10.244.2.2"]))
    ext, internal = fe_key("10.96.0.5", 80, Scope.EXTERNAL), fe_key("10.96.0.5", 80, Scope.INTERNAL)
    snat = FrontendFlag.SNAT_ALL | FrontendFlag.SNAT_REMOTE
    plain = plan(state, NODE, Config())
    assert not plain.fe[ext].flags & snat
    cidr = plan(state, NODE, Config(cluster_cidr=("10.244.0.0/16",)))
    assert cidr.fe[ext].flags & snat == FrontendFlag.SNAT_ALL
    assert not cidr.fe[internal].flags & snat
    masq = plan(state, NODE, Config(masquerade_all=True))
    assert masq.fe[ext].flags & masq.fe[internal].flags & snat == FrontendFlag.SNAT_ALL


@pytest.mark.parametrize(
    ("flags", "pod_cidrs", "by_source"),
    [
        (["--cluster-cidr=fd00::/48,10.244.0.0/16"], (), ("10.244.0.0", 16)),
        (
            ["--detect-local-mode=NodeCIDR", "--cluster-cidr=10.0.0.0/8"],
            ("10.244.1.0/24",),
            ("10.244.1.0", 24),
        ),
        (["--detect-local-mode=NodeCIDR"], (), None),
        (["--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix=veth"], (), None),
        (["--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cbr0"], (), None),
        ([], (), None),
    ],
)
def test_a_detector_by_source_goes_into_the_config_entry(
    flags: list[str], pod_cidrs: tuple[str, ...], by_source: tuple[str, int] | None
) -> None:
    config = resolve(flags).config
    state = states(svc("a", "10.96.0.5", ["10.244.2.2"]))
    state = replace(state, node=replace(state.node, pod_cidrs=pod_cidrs))
    planned = plan(state, NODE, config)
    assert planned.cfg is not None
    got = (
        (ip_str(planned.cfg.local_net), planned.cfg.local_plen)
        if planned.cfg.flags & abi.ConfigFlag.LOCAL_BY_SRC
        else None
    )
    assert got == by_source
    # and the cluster IP's EXTERNAL frontend masquerades exactly when there is a detector
    ext = planned.fe[fe_key("10.96.0.5", 80, Scope.EXTERNAL)]
    assert bool(ext.flags & FrontendFlag.SNAT_ALL) == config.local_detector(pod_cidrs).implemented


def test_a_new_pod_cidr_on_the_node_replans_every_port() -> None:
    config = resolve(["--detect-local-mode=NodeCIDR"]).config
    planner = Planner(config)
    state = states(svc("a", "10.96.0.5", ["10.244.2.2"]))
    planner.update(state, NODE, None)
    ext = fe_key("10.96.0.5", 80, Scope.EXTERNAL)
    assert not planner_contents(planner).fe[ext].flags & FrontendFlag.SNAT_ALL
    touched = planner.update(replace(state, node=replace(state.node, pod_cidrs=("10.244.1.0/24",))), NODE, ())
    assert touched and planner_contents(planner).fe[ext].flags & FrontendFlag.SNAT_ALL


def test_etp_cluster_masquerades_toward_local_backends_unless_told_to_keep_the_client() -> None:
    """kube-proxy masquerades all externalTrafficPolicy Cluster traffic (the backend sees a node
    address); --bpf-keep-client-ip-for-local-backends keeps the client's address toward this
    node's backends (remote ones still need the node's address for replies to come back)."""
    state = states(svc("np", "10.96.0.5", ["10.244.1.2"], type="NodePort", nodeport=30005))
    ext = fe_key("192.168.0.11", 30005, Scope.EXTERNAL)
    assert plan(state, NODE, Config()).fe[ext].flags & FrontendFlag.SNAT_ALL
    kept = plan(state, NODE, Config(bpf_keep_client_ip_local=True)).fe[ext].flags
    assert kept & (FrontendFlag.SNAT_ALL | FrontendFlag.SNAT_REMOTE) == FrontendFlag.SNAT_REMOTE


def test_pods_reaching_an_etp_cluster_nodeport_are_masqueraded_as_kube_proxy_does() -> None:
    """kube-proxy's KUBE-SERVICES sends a pod's packet to a NodePort, external IP or LB IP into the
    same KUBE-EXT-* chain as an external client's, which masquerades under ETP Cluster and lets
    pod traffic through untranslated (to every endpoint) under ETP Local. Found by the
    differential suite (tests/differential, cases np-node1-from-pod1, lb-ip-from-pod1)."""
    snat = FrontendFlag.SNAT_ALL | FrontendFlag.SNAT_REMOTE
    pod = fe_key("192.168.0.11", 30005, Scope.INTERNAL)
    for policy, want in (("Cluster", FrontendFlag.SNAT_ALL), ("Local", 0)):
        state = states(
            svc(
                "np",
                "10.96.0.5",
                ["10.244.1.2"],
                type="NodePort",
                nodeport=30005,
                extra=f"externalTrafficPolicy: {policy}",
            )
        )
        c = plan(state, NODE, Config(cluster_cidr=("10.244.0.0/16",)))
        assert c.fe[pod].flags & snat == want, policy
        assert c.fe[pod].set_id == c.fe[fe_key("10.96.0.5", 80, Scope.INTERNAL)].set_id, "the cluster set"
        if policy == "Local":
            # Without a detector kube-proxy writes no `IfLocal -> KUBE-SVC-*` short-circuit: pods
            # are held to the local endpoints like anyone else.
            ext = fe_key("192.168.0.11", 30005, Scope.EXTERNAL)
            bare = plan(state, NODE, Config())
            assert (
                bare.fe[pod].set_id
                == bare.fe[ext].set_id
                != bare.fe[fe_key("10.96.0.5", 80, Scope.INTERNAL)].set_id
            )
            assert bare.fe[pod].flags == bare.fe[ext].flags | FrontendFlag.HOST_SCOPE
            # ...while the node itself reaches every endpoint (`--src-type LOCAL -> KUBE-SVC-*`,
            # whatever the detector): its sockets' frontend, of scope HOST, has the cluster set.
            node = bare.fe[fe_key("192.168.0.11", 30005, Scope.HOST)]
            assert node.set_id == bare.fe[fe_key("10.96.0.5", 80, Scope.INTERNAL)].set_id
            assert not node.flags & (FrontendFlag.LOCAL | FrontendFlag.HOST_SCOPE)
            with_detector = c.fe
            assert not any(k.scope == Scope.HOST for k in with_detector), "a detector: INTERNAL serves both"
            assert not with_detector[pod].flags & FrontendFlag.HOST_SCOPE
    state = states(svc("np", "10.96.0.5", ["10.244.1.2"], type="NodePort", nodeport=30005))
    kept = plan(state, NODE, Config(bpf_keep_client_ip_local=True)).fe[pod].flags
    assert kept & snat == FrontendFlag.SNAT_REMOTE


def test_svc_id_and_membership_per_service_port() -> None:
    """One svc_id for every frontend of a service port; a member entry per backend, flagged with
    each set (cluster, local) that holds it; a backend shared by two services is a member of each."""
    state = states(
        svc(
            "a",
            "10.96.0.5",
            ["10.244.1.2", "10.244.2.2"],
            type="NodePort",
            nodeport=30005,
            extra="externalTrafficPolicy: Local",
        ),
        svc("b", "10.96.0.6", ["10.244.1.2"]),
    )
    c = plan(state, NODE, Config())
    ids = {fe.svc_id for key, fe in c.fe.items() if key.addr != ip_be("10.96.0.6")}
    assert len(ids) == 1 and 0 not in ids
    (a_id,) = ids
    b_id = c.fe[fe_key("10.96.0.6", 80, Scope.INTERNAL)].svc_id
    assert b_id not in (0, a_id)
    be = backend_ids(c)
    members = {(k.svc_id, k.backend_id): m.flags for k, m in c.member.items()}
    assert members == {
        (a_id, be["10.244.1.2"]): MemberFlag.CLUSTER | MemberFlag.LOCAL,
        (a_id, be["10.244.2.2"]): MemberFlag.CLUSTER,
        (b_id, be["10.244.1.2"]): MemberFlag.CLUSTER,
    }
    # ids are re-adopted: a restart plans the same svc ids and writes nothing
    rig = PlanRig()
    rig.sync(state)
    written = rig.contents()
    written.cfg = c.cfg
    assert written.same_entries(c)
    rig.restart()
    assert rig.sync(state).writes == 0
    assert rig.contents().member == c.member


def test_source_range_holding_the_node_admits_the_lb_ip() -> None:
    lb = svc(
        "lb",
        "10.96.0.5",
        ["10.244.1.2"],
        type="LoadBalancer",
        nodeport=30007,
        extra="loadBalancerSourceRanges: [192.168.0.0/24]",
    ).replace(
        "---",
        "status: {loadBalancer: {ingress: [{ip: 203.0.113.7}]}}\n---",
        1,
    )
    text = render_contents(plan(states(lb), NODE, Config()))
    assert "srcr rnat=3 192.168.0.0/24 -> allow" in text
    assert "srcr rnat=3 203.0.113.7/32 -> allow" in text


def test_cfg_entry() -> None:
    c = plan(states(), NodeContext(("192.168.0.12",), "192.168.0.12"), Config(snat_ports=(40000, 40999)))
    assert render_contents(c) == (
        "cfg node=192.168.0.12 snat_ports=40000-40999 tcp=86400s/3600s/60s/10s tcp_backend_gone=300s"
        " udp=30s/120s icmp=1000/s,50 host_routing=legacy\n"
    )
    assert c.cfg is not None and c.cfg.flags == abi.ConfigFlag.HOST_LEGACY
    bpf = plan(
        states(), NodeContext(("192.168.0.12",), "192.168.0.12"), Config(bpf_host_routing=HostRouting.BPF)
    )
    assert bpf.cfg is not None and bpf.cfg.flags == 0
    assert render_contents(bpf).endswith(" host_routing=bpf\n")


def test_cfg_entry_carries_the_backend_gone_timeout() -> None:
    """--bpf-ct-timeout-tcp-backend-gone reaches the data path (tcp_orphan_s), 300 s by default."""
    cfg = VALUES["cfg"].to_ctype(config_entry(NODE, Config(ct_tcp_backend_gone_timeout_s=7.0)))
    assert cfg.tcp_orphan_s == 7
    assert VALUES["cfg"].to_ctype(config_entry(NODE, Config())).tcp_orphan_s == 300


def test_cfg_entry_honours_kube_proxys_conntrack_settings() -> None:
    """tcpEstablishedTimeout, tcpCloseWaitTimeout, udpTimeout and udpStreamTimeout apply to the
    flows eBPF mode tracks; 0 (kube-proxy's "leave it") keeps the kernel's default."""
    conntrack = ConntrackSettings(
        tcp_established_timeout_s=7200.0,
        tcp_close_wait_timeout_s=90.0,
        udp_timeout_s=15.0,
        udp_stream_timeout_s=0.0,
    )
    cfg = VALUES["cfg"].to_ctype(config_entry(NODE, Config(conntrack=conntrack)))
    assert (cfg.tcp_established_s, cfg.tcp_close_wait_s, cfg.udp_s, cfg.udp_stream_s) == (7200, 90, 15, 120)
    assert (cfg.tcp_syn_s, cfg.tcp_closed_s) == (60, 10)


# ---------------------------------------------------------------------------------- ids


def test_ids_are_re_adopted_from_a_dump_whatever_the_order() -> None:
    """A restart with new services sorted before the old ones keeps every old id."""
    rig = PlanRig()
    rig.sync(states(svc("m", "10.96.0.5", ["10.244.1.2", "10.244.2.2"])))
    first = rig.contents()
    rig.restart()
    new_state = states(
        svc("a", "10.96.0.4", ["10.244.1.9", "10.244.2.2"]),
        svc("m", "10.96.0.5", ["10.244.1.2", "10.244.2.2"]),
    )
    result = rig.sync(new_state)
    second = rig.contents()
    for role in ("fe", "slot", "be", "rnat", "member"):
        for key, value in first.table(role).items():
            assert second.table(role)[key] == value
    # only the new service's entries are written; its shared backend 10.244.2.2 keeps its id (and
    # its address entry): the new addresses are 10.96.0.4 and 10.244.1.9
    assert backend_ids(second)["10.244.2.2"] == backend_ids(first)["10.244.2.2"]
    assert result.updates == {"addr": 2, "be": 1, "member": 2, "rnat": 1, "srcr": 0, "slot": 2, "fe": 2}
    assert sum(result.deletes.values()) == 0


def test_fresh_ids_never_reuse_an_id_the_kernel_still_holds() -> None:
    rig = PlanRig()
    rig.sync(states(svc("a", "10.96.0.5", ["10.244.1.2"])))
    first = rig.contents()
    rig.sync(states(svc("b", "10.96.0.6", ["10.244.1.3"])))
    second = rig.contents()
    assert {fe.set_id for fe in second.fe.values()}.isdisjoint({fe.set_id for fe in first.fe.values()})
    assert set(second.be).isdisjoint(set(first.be))
    assert set(second.rnat).isdisjoint(set(first.rnat))


def test_fresh_ids_continue_above_the_last_one_handed_out() -> None:
    a, b, c = (
        svc("a", "10.96.0.5", ["10.244.1.2"]),
        svc("b", "10.96.0.6", ["10.244.1.3"]),
        svc("c", "10.96.0.7", ["10.244.1.4"]),
    )
    rig = PlanRig()
    rig.sync(states(a, b))
    rig.sync(states(a))  # b (set 2, backend 2, rnat 2) goes away
    rig.sync(states(a, c))
    third = rig.contents()
    assert sorted({fe.set_id for fe in third.fe.values()}) == [1, 3]
    assert sorted(k.id for k in third.be) == [1, 3]


def test_ids_wrap_to_the_lowest_free_at_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner_module, "REVNAT_ID_MAX", 3)
    a, b = svc("a", "10.96.0.5", ["10.244.1.2"]), svc("b", "10.96.0.6", ["10.244.1.3"])
    rig = PlanRig()
    rig.sync(states(a, b))  # rnat 1, 2
    rig.sync(states(b))  # rnat 2 stays
    rig.sync(states(b, svc("c", "10.96.0.7", ["10.244.1.4"])))  # 3
    third = rig.contents()
    rig.sync(states(svc("d", "10.96.0.8", []), b))  # c gone: 1 is free
    fourth = rig.contents()
    assert sorted(k.id for k in third.rnat) == [2, 3]
    assert sorted(k.id for k in fourth.rnat) == [1, 2]
    with pytest.raises(PlanError):
        plan(states(a, b, svc("c", "10.96.0.7", []), svc("d", "10.96.0.8", [])), NODE, Config())


def test_surviving_backends_keep_their_slots() -> None:
    rig = PlanRig()
    rig.sync(states(svc("a", "10.96.0.5", ["10.244.1.2", "10.244.1.3", "10.244.1.4"])))
    first = rig.contents()
    rig.sync(states(svc("a", "10.96.0.5", ["10.244.1.3", "10.244.1.4", "10.244.1.5"])))
    second = rig.contents()
    ids = backend_ids(second)
    # 10.244.1.2 left slot 1; the newcomer takes it, 10.244.1.3 and .4 stay in slots 2 and 3
    assert second.slot[SlotKey(set_id=1, slot=1)].backend_id == ids["10.244.1.5"]
    assert second.slot[SlotKey(set_id=1, slot=2)] == first.slot[SlotKey(set_id=1, slot=2)]
    assert second.slot[SlotKey(set_id=1, slot=3)] == first.slot[SlotKey(set_id=1, slot=3)]


def test_set_kind_change_gets_a_new_set() -> None:
    """Switching ITP to Local moves the ClusterIP to another set; the old one is not rewritten in place."""
    rig = PlanRig()
    rig.sync(states(svc("a", "10.96.0.5", ["10.244.1.2", "10.244.2.2"])))
    cluster = rig.contents()
    rig.sync(
        states(svc("a", "10.96.0.5", ["10.244.1.2", "10.244.2.2"], extra="internalTrafficPolicy: Local"))
    )
    local = rig.contents()
    key = fe_key("10.96.0.5", 80, Scope.INTERNAL)
    assert local.fe[key].set_id != cluster.fe[key].set_id
    assert local.fe[key].flags & FrontendFlag.LOCAL and local.fe[key].count == 1


def test_dry_run_uses_node_context_for_nodeports(tmp_path: Path) -> None:
    text = render_dry_run(
        states(svc("np", "10.96.0.5", ["10.244.1.2"], type="NodePort", nodeport=30005)),
        NodeContext(("192.168.0.12",), "192.168.0.12"),
        Config(),
    )
    assert "fe 192.168.0.12:30005/TCP external -> svc=1 set=1 count=1 rnat=2 flags=NODEPORT|SNAT_ALL" in text
