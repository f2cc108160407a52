"""NodeLocal DNSCache: a ClusterIP the node itself listens on answers from the node (issue 19 item 3).

node-local-dns binds the kube-dns ClusterIP and 169.254.20.10 to a dummy device (`nodelocaldns`;
this kernel has no dummy devices, a bridge without ports stands in),
listens there, and installs NOTRACK rules (raw table) for them so kube-proxy's DNAT never sees
their DNS packets; when it stops it removes the rules and the device, and kube-proxy's rules send
the ClusterIP's traffic to the kube-dns pods again. Here a real DNS server (dnsmasq) plays the
cache on such a device in the lab node, with node-local-dns's rules, and the kube-dns Service has
one pod running dnsmasq. A pod asks `whoami.lab TXT` through the ClusterIP, over UDP and TCP:

* with the cache running the answer comes from the node, to pods and to the node's own clients
  (iptables mode: the NOTRACK rules keep the DNAT off; eBPF mode: a ClusterIP port the node
  listens on has no frontend, so neither tc nor the socket programs translate it and the packet
  reaches the node's stack, which delivers it to the listener);
* once the cache is stopped as node-local-dns stops (the process, then its rules and its device),
  the answer comes from the Service's pod, within the agent's next full sync (1 s here).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from lab import Lab
from lab.core import CommandError
from lab.harness import Cluster, ep
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

DNS_IP = "10.96.0.10"
LINK_LOCAL = "169.254.20.10"
CACHE = "node-cache"


def nodelocal_rules(action: str) -> list[list[str]]:
    """node-local-dns's iptables rules for its two addresses (cmd/node-cache's iptables rule set,
    the DNS port only): NOTRACK both ways in raw, ACCEPT in filter."""
    rules = []
    for ip in (DNS_IP, LINK_LOCAL):
        for proto in ("udp", "tcp"):
            rules += [
                ["-t", "raw", action, "PREROUTING", "-p", proto, "-d", ip, "--dport", "53", "-j", "NOTRACK"],
                ["-t", "filter", action, "INPUT", "-p", proto, "-d", ip, "--dport", "53", "-j", "ACCEPT"],
                ["-t", "raw", action, "OUTPUT", "-p", proto, "-s", ip, "--sport", "53", "-j", "NOTRACK"],
                ["-t", "filter", action, "OUTPUT", "-p", proto, "-s", ip, "--sport", "53", "-j", "ACCEPT"],
                ["-t", "raw", action, "OUTPUT", "-p", proto, "-d", ip, "--dport", "53", "-j", "NOTRACK"],
            ]
    return rules


@pytest.fixture(params=["ebpf", "iptables"])
def dns_cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=2) as lab:
        lab.start_dns(lab.pod("pod-1-2"))
        built = Cluster(lab, request.param, extra=("--iptables-sync-period=1s", "--iptables-backend=nft"))
        try:
            yield built
        finally:
            assert built.stop() == []


def whoami(cluster: Cluster, tcp: bool) -> str:
    return cluster.lab.dns_whoami("pod-1-1", DNS_IP, tcp=tcp)


def test_a_cluster_ip_the_node_listens_on_answers_from_the_node_then_from_the_pods(
    dns_cluster: Cluster,
) -> None:
    cluster = dns_cluster
    lab, node = cluster.lab, cluster.lab.nodes[0]
    for cmd in (
        "link add nodelocaldns type bridge",  # no dummy devices in this kernel: a bridge without ports
        f"addr add {LINK_LOCAL}/32 dev nodelocaldns",
        f"addr add {DNS_IP}/32 dev nodelocaldns",
        "link set nodelocaldns up",
    ):
        lab.run(node, "ip", *cmd.split())
    for rule in nodelocal_rules("-A"):
        lab.run(node, "iptables-nft", *rule)
    cache = lab.start_dns(
        node, txt=CACHE, extra_args=[f"--listen-address={DNS_IP}", f"--listen-address={LINK_LOCAL}"]
    )
    cluster.start()
    ports = [Port("dns", 53, 53, "UDP"), Port("dns-tcp", 53, 53, "TCP")]
    cluster.apply(with_endpoints(service("kube-dns", DNS_IP, ports), [ep(cluster, "pod-1-2")]))
    for tcp in (False, True):
        assert whoami(cluster, tcp) == CACHE, "the node's cache answers through the ClusterIP"
        # the node's own clients too (eBPF mode: the socket programs find no frontend either)
        assert lab.dns_whoami(node, DNS_IP, tcp=tcp) == CACHE, "from the node, the node's cache"
    assert lab.dns_whoami("pod-1-1", LINK_LOCAL) == CACHE

    lab.stop(cache)  # node-local-dns stops: the process, then its rules and its device
    for rule in nodelocal_rules("-D"):
        lab.run(node, "iptables-nft", *rule)
    lab.run(node, "ip", "link", "del", "nodelocaldns")
    deadline = time.monotonic() + 10
    answers: list[str] = []
    while time.monotonic() < deadline:
        try:
            answers = [whoami(cluster, False), whoami(cluster, True)]
        except CommandError:
            answers = []
        if answers == ["pod-1-2", "pod-1-2"]:
            break
        time.sleep(0.2)
    assert answers == ["pod-1-2", "pod-1-2"], "the Service's pod answers once the cache is gone"
    from_node = [lab.dns_whoami(node, DNS_IP, tcp=tcp) for tcp in (False, True)]
    assert from_node == ["pod-1-2", "pod-1-2"], "and to the node's own clients, through the ClusterIP"
