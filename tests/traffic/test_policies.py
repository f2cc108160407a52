"""Traffic policies, affinity, rejects, hairpin and UDP flows across endpoint changes, per mode.

Same fixture and lab as test_services.py: each test replaces the cluster's whole set of objects.
"""

from __future__ import annotations

import time

import pytest

from lab.harness import Cluster, ep
from lab.objects import Ep, Port, service, with_endpoints

pytestmark = pytest.mark.kernel

N1, N2, CLIENT_IP = "192.168.0.11", "192.168.0.12", "192.168.0.100"


def test_etp_local_preserves_client_source_ip(cluster: Cluster) -> None:
    """ "should preserve source IP with externalTrafficPolicy Local": only this node's endpoints."""
    svc = service(
        "web-local",
        "10.96.2.1",
        [Port("http", 80, 8080, node_port=30090)],
        type="NodePort",
        externalTrafficPolicy="Local",
    )
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-1-1"), ep(cluster, "pod-2-1")]))
    via1 = cluster.http("client", f"http://{N1}:30090/", count=20)
    via2 = cluster.http("client", f"http://{N2}:30090/", count=20)
    assert via1["errors"] == 0 and set(via1["bodies"]) == {"pod-1-1"}, via1
    assert via2["errors"] == 0 and set(via2["bodies"]) == {"pod-2-1"}, via2
    seen = cluster.http("client", f"http://{N1}:30090/ip")
    assert set(seen["bodies"]) == {CLIENT_IP}, "the backend sees the external client's own address"


def test_etp_cluster_masquerades_traffic_to_a_local_backend(cluster: Cluster) -> None:
    """externalTrafficPolicy Cluster: kube-proxy masquerades external traffic whatever the backend
    (KUBE-EXT-* -> KUBE-MARK-MASQ), so a backend on the node that got it sees a node address, not
    the client's; replies go back through that node either way. eBPF mode does the same by default
    (--bpf-keep-client-ip-for-local-backends keeps the client's address instead)."""
    svc = service(
        "web-masq",
        "10.96.2.5",
        [Port("http", 80, 8080, node_port=30091)],
        type="NodePort",
        externalTrafficPolicy="Cluster",
    )
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-1-1")]))
    seen = cluster.http("client", f"http://{N1}:30091/ip", count=5)
    assert seen["errors"] == 0, seen
    node1_addresses = {N1, cluster.lab.node(1).gateway}  # MASQUERADE picks the route's source
    assert set(seen["bodies"]) <= node1_addresses, seen
    assert CLIENT_IP not in seen["bodies"]


def test_session_affinity_client_ip(cluster: Cluster) -> None:
    """ "should have session affinity work for service with type clusterIP"."""
    svc = service(
        "sticky",
        "10.96.2.2",
        [Port("http", 80, 8080)],
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 300}},
    )
    backends = ["pod-1-2", "pod-2-1", "pod-2-2"]
    cluster.apply(with_endpoints(svc, [ep(cluster, b) for b in backends]))
    for client in ("pod-1-1", "pod-1-3"):
        result = cluster.http(client, "http://10.96.2.2/", count=30)
        assert result["errors"] == 0, result
        assert len(result["bodies"]) == 1, f"{client} was spread over {result['bodies']}"


def test_service_without_endpoints_rejects(cluster: Cluster) -> None:
    """ "should be rejected when no endpoints exist": connection refused at once, not a timeout.
    The same Service answers first, with an endpoint: its cluster IP is programmed, and what
    refuses it afterwards is the agent's reject, not an address nothing programmed."""
    svc = service("empty", "10.96.2.3", [Port("http", 80, 8080)])
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-2-1")]))
    before = cluster.http("pod-1-1", "http://10.96.2.3/", count=3)
    assert before["errors"] == 0 and set(before["bodies"]) == {"pod-2-1"}, before
    cluster.apply(with_endpoints(svc, []))
    start = time.monotonic()
    result = cluster.http("pod-1-1", "http://10.96.2.3/", count=3, timeout=5)
    elapsed = time.monotonic() - start
    assert result["errors"] == 3
    assert all("Connection refused" in k for k in result["error_kinds"]), result
    assert elapsed < 4, f"rejects took {elapsed:.1f}s: packets were dropped, not refused"


def test_hairpin_pod_reaches_itself_through_its_service(cluster: Cluster) -> None:
    """ "should allow pods to hairpin back to themselves through services"."""
    cluster.apply(
        with_endpoints(service("self", "10.96.2.4", [Port("http", 80, 8080)]), [ep(cluster, "pod-1-1")])
    )
    result = cluster.http("pod-1-1", "http://10.96.2.4/", count=5)
    assert result["errors"] == 0, result
    assert set(result["bodies"]) == {"pod-1-1"}


def test_udp_dns_client_survives_dns_pod_replacement(cluster: Cluster) -> None:
    """kube-proxy clears stale UDP conntrack entries: a resolver that keeps its source port
    reaches the new DNS pod as soon as the old one leaves the endpoints."""
    lab = cluster.lab
    ports = [Port("dns", 53, 53, "UDP"), Port("dns-tcp", 53, 53, "TCP")]
    dns_svc = service("kube-dns", "10.96.0.10", ports)
    old = lab.add_pod(2)
    lab.start_dns(old)
    cluster.apply(with_endpoints(dns_svc, [Ep(old.ip, "node2")]))

    def query() -> str:
        # The same source port every time: the same conntrack tuple, as a long-lived resolver.
        res = lab.run(
            "pod-1-1",
            "dig",
            "-b",
            f"{lab.pod('pod-1-1').ip}#5353",
            "@10.96.0.10",
            "whoami.lab",
            "TXT",
            "+short",
            "+time=1",
            "+tries=1",
            check=False,
        )
        return res.stdout.strip().strip('"')

    assert query() == old.name
    new = lab.add_pod(2)
    lab.start_dns(new)
    cluster.apply(with_endpoints(dns_svc, [Ep(new.ip, "node2")]))
    lab.remove_pod(old)
    answers = [query() for _ in range(3)]
    assert answers == [new.name] * 3, answers
