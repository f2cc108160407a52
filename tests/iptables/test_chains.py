"""Chain names must be kube-proxy's, byte for byte (values taken from upstream's own tests)."""

from __future__ import annotations

import pytest

from agent.iptables import chains
from agent.model.types import Protocol, ServicePortName

KUBERNETES_HTTPS = ServicePortName("default", "kubernetes", "https", Protocol.TCP)
KUBE_DNS_DNS = ServicePortName("kube-system", "kube-dns", "dns", Protocol.UDP)
NS2_SVC2_P80 = ServicePortName("ns2", "svc2", "p80", Protocol.TCP)


def test_service_chain_of_the_api_server_service() -> None:
    assert chains.service_chain(KUBERNETES_HTTPS) == "KUBE-SVC-NPX46M4PTMTKRN6Y"


def test_service_chain_of_kube_dns_udp() -> None:
    assert chains.service_chain(KUBE_DNS_DNS) == "KUBE-SVC-TCOU7JCQXEZGVUNU"


def test_endpoint_chain_hashes_name_protocol_and_ip_port() -> None:
    assert chains.endpoint_chain(NS2_SVC2_P80, "10.180.0.2:80") == "KUBE-SEP-RS4RBKLTHTF2IUXJ"


def test_upstream_test_values_for_other_chain_kinds() -> None:
    # From upstream proxier_test.go: ns2/svc2:p80 uses KUBE-{SVC,SVL,EXT,FW}-GNZBNJ2PO5MGZ6GT.
    assert chains.local_chain(NS2_SVC2_P80) == "KUBE-SVL-GNZBNJ2PO5MGZ6GT"
    assert chains.external_chain(NS2_SVC2_P80) == "KUBE-EXT-GNZBNJ2PO5MGZ6GT"
    assert chains.firewall_chain(NS2_SVC2_P80) == "KUBE-FW-GNZBNJ2PO5MGZ6GT"
    assert (
        chains.service_chain(ServicePortName("ns1", "svc1", "p80", Protocol.TCP))
        == "KUBE-SVC-XPGD46QRK7WJZT7O"
    )


def test_protocol_is_part_of_the_hash() -> None:
    tcp = ServicePortName("kube-system", "kube-dns", "dns", Protocol.TCP)
    assert chains.service_chain(tcp) != chains.service_chain(KUBE_DNS_DNS)


def test_unnamed_port_hashes_without_colon() -> None:
    # str() of a port without a name is "ns/name", as upstream's ServicePortName.String().
    unnamed = ServicePortName("default", "web", "", Protocol.TCP)
    assert str(unnamed) == "default/web"
    assert chains.service_chain(unnamed) == "KUBE-SVC-" + chains._hash16("default/webtcp")


def test_chain_names_fit_iptables_limit() -> None:
    name = ServicePortName("n" * 63, "s" * 63, "p" * 15, Protocol.SCTP)
    for c in (
        chains.service_chain(name),
        chains.endpoint_chain(name, "10.0.0.1:1"),
        chains.firewall_chain(name),
    ):
        assert len(c) <= 28


@pytest.mark.parametrize(
    ("name", "ours"),
    [
        ("KUBE-SVC-NPX46M4PTMTKRN6Y", True),
        ("KUBE-SEP-RS4RBKLTHTF2IUXJ", True),
        ("KUBE-SVL-GNZBNJ2PO5MGZ6GT", True),
        ("KUBE-EXT-GNZBNJ2PO5MGZ6GT", True),
        ("KUBE-FW-GNZBNJ2PO5MGZ6GT", True),
        ("KUBE-SERVICES", False),
        ("KUBE-MARK-MASQ", False),
        ("CILIUM_OUTPUT_nat", False),
    ],
)
def test_is_service_chain(name: str, ours: bool) -> None:
    assert chains.is_service_chain(name) is ours


def test_jump_rule_args_match_upstream_text() -> None:
    fw = next(j for j in chains.JUMPS if j.dst_chain == chains.KUBE_PROXY_FIREWALL and j.src_chain == "INPUT")
    assert fw.rule_args() == (
        "-m",
        "conntrack",
        "--ctstate",
        "NEW",
        "-m",
        "comment",
        "--comment",
        "kubernetes load balancer firewall",
        "-j",
        "KUBE-PROXY-FIREWALL",
    )
    portals = [j for j in chains.JUMPS if j.table == "nat" and j.dst_chain == chains.KUBE_SERVICES]
    assert {j.src_chain for j in portals} == {"OUTPUT", "PREROUTING"}
    assert all(
        j.rule_args() == ("-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES")
        for j in portals
    )
