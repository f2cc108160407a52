"""The pure layout of one service port: slot order and frontends."""

from __future__ import annotations

from agent.config import Config, NodeContext
from agent.ebpf.abi import FrontendFlag, Scope
from agent.ebpf.entries import fe_key
from agent.ebpf.layout import frontends, ip_be, port_be, slots
from agent.model.types import Protocol, ServicePort, ServicePortName


def test_slots_keep_survivors_in_place_and_fill_the_gaps_in_order() -> None:
    assert slots([5, 6, 7], {}) == [5, 6, 7]
    assert slots([6, 8, 9], {1: 5, 2: 6, 3: 7}) == [8, 6, 9]
    assert slots([7, 5], {1: 5, 2: 6, 3: 7}) == [5, 7], "a survivor beyond the new count moves in"


def test_a_nodeport_with_local_policy_has_both_scopes_per_node_address() -> None:
    spn = ServicePortName("ns", "web", "", Protocol.TCP)
    sp = ServicePort(spn, "10.96.0.10", 80, Protocol.TCP, node_port=30080, external_policy_local=True)
    node = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")
    config = Config(cluster_cidr=("10.244.0.0/16",))
    fes = {fe.key: fe for fe in frontends(sp, node, config, config.local_detector())}
    ext = fes[fe_key(ip_be("192.168.0.11"), port_be(30080), 6, int(Scope.EXTERNAL))]
    pod = fes[fe_key(ip_be("192.168.0.11"), port_be(30080), 6, int(Scope.INTERNAL))]
    assert ext.kind == "local" and ext.flags & FrontendFlag.LOCAL
    assert pod.kind == "cluster" and not pod.flags & FrontendFlag.SNAT_ALL
    assert len(fes) == 5  # the ClusterIP's two, the node address's two, localhost's (below)
    # without a detector (no --cluster-cidr) pods are held to the local endpoints too
    bare = {fe.key: fe for fe in frontends(sp, node, Config(), Config().local_detector())}
    pod = bare[fe_key(ip_be("192.168.0.11"), port_be(30080), 6, int(Scope.INTERNAL))]
    assert pod.kind == "local" and pod.flags & FrontendFlag.LOCAL


def test_localhost_node_ports_are_internal_frontends_where_kube_proxys_configuration_allows() -> None:
    """127.0.0.1:<nodePort> with kube-proxy's defaults (every address, --iptables-localhost-nodeports),
    scope INTERNAL only (never for what comes from outside: CVE-2020-8558), the cluster set as
    KUBE-EXT-* sends the node's own traffic; none when either setting says no."""
    spn = ServicePortName("ns", "web", "", Protocol.TCP)
    sp = ServicePort(spn, "10.96.0.10", 80, Protocol.TCP, node_port=30080, external_policy_local=True)
    node = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")

    def localhost(config: Config) -> list[tuple[int, str, int]]:
        return [
            (scope, fe.kind, fe.flags)
            for fe in frontends(sp, node, config, config.local_detector())
            for scope in (int(Scope.EXTERNAL), int(Scope.INTERNAL))
            if fe.key == fe_key(ip_be("127.0.0.1"), port_be(30080), 6, scope)
        ]

    assert localhost(Config()) == [(int(Scope.INTERNAL), "cluster", int(FrontendFlag.NODEPORT))]
    assert localhost(Config(nodeport_addresses=("127.0.0.0/8",))) != []
    assert localhost(Config(iptables_localhost_nodeports=False)) == []
    assert localhost(Config(nodeport_addresses=("192.168.0.0/24",))) == []
    assert localhost(Config(nodeport_addresses=("primary",))) == []


def test_a_cluster_ip_port_the_node_listens_on_has_no_frontend() -> None:
    """NodeLocal DNSCache: the kube-dns ClusterIP bound on the node with a listener on 53 is left to
    the node's stack; its other ports (metrics), and the same port of another protocol without a
    listener, keep their frontends."""
    dns = ServicePort(
        ServicePortName("kube-system", "kube-dns", "dns", Protocol.UDP), "10.96.0.10", 53, Protocol.UDP
    )
    metrics = ServicePort(
        ServicePortName("kube-system", "kube-dns", "metrics", Protocol.TCP), "10.96.0.10", 9153, Protocol.TCP
    )
    dns_tcp = ServicePort(
        ServicePortName("kube-system", "kube-dns", "dns-tcp", Protocol.TCP), "10.96.0.10", 53, Protocol.TCP
    )
    node = NodeContext(node_ips=("192.168.0.11",), local_listeners=frozenset({("10.96.0.10", 53, 17)}))
    config = Config(cluster_cidr=("10.244.0.0/16",))
    detector = config.local_detector()
    assert frontends(dns, node, config, detector) == []
    assert len(frontends(metrics, node, config, detector)) == 2
    assert len(frontends(dns_tcp, node, config, detector)) == 2
    assert len(frontends(dns, NodeContext(node_ips=("192.168.0.11",)), config, detector)) == 2
