"""One state per address family, as kube-proxy's metaproxier feeds one proxier per family.

A dual-stack Service appears in both states, each with its own family's cluster IP, externalIPs,
ingress IPs and source ranges (upstream newBaseServiceInfo); an EndpointSlice feeds the state of
its addressType only; an IPv4-only Service is absent from the IPv6 state and the other way round.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.model import FrontendGuard, IPFamily, NodeInfo, Protocol, ServicePortName, build_state
from agent.model.parse import parse_endpoint_slice, parse_service_families
from agent.model.tracker import ProxyModel, read_service, read_slice
from agent.model.types import Endpoint, join_host_port

NODE = NodeInfo("node1")
SPN = ServicePortName("default", "web", "http", Protocol.TCP)


def dual_stack(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "type": "LoadBalancer",
        "clusterIP": "10.96.0.10",
        "clusterIPs": ["10.96.0.10", "fd00:10:96::a"],
        "ipFamilies": ["IPv4", "IPv6"],
        "ipFamilyPolicy": "RequireDualStack",
        "externalIPs": ["203.0.113.7", "2001:db8:7::7"],
        "loadBalancerSourceRanges": ["198.51.100.0/24", "2001:db8:100::/48"],
        "ports": [{"name": "http", "port": 80, "nodePort": 30080}],
    }
    base.update(spec)
    return {
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": base,
        "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}, {"ip": "2001:db8:1::1"}]}},
    }


def slice_(name: str, address_type: str, *ips: str, node: str = "node2") -> dict[str, Any]:
    return {
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": address_type,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "nodeName": node} for ip in ips],
    }


SLICES = [
    slice_("web-v4", "IPv4", "10.244.1.2", "10.244.2.3"),
    slice_("web-v6", "IPv6", "fd00:10:244:1::2", "fd00:10:244:2::3"),
]


def test_a_dual_stack_service_is_in_both_states_each_with_its_own_family() -> None:
    v4 = build_state([dual_stack()], SLICES, NODE).state
    v6 = build_state([dual_stack()], SLICES, NODE, family=IPFamily.IPv6).state
    assert (v4.family, v6.family) == (IPFamily.IPv4, IPFamily.IPv6)
    a, b = v4.services[SPN], v6.services[SPN]
    assert (a.cluster_ip, b.cluster_ip) == ("10.96.0.10", "fd00:10:96::a")
    assert (a.external_ips, b.external_ips) == (("203.0.113.7",), ("2001:db8:7::7",))
    assert (a.load_balancer_ips, b.load_balancer_ips) == (("192.0.2.1",), ("2001:db8:1::1",))
    assert (a.load_balancer_source_ranges, b.load_balancer_source_ranges) == (
        ("198.51.100.0/24",),
        ("2001:db8:100::/48",),
    )
    assert a.node_port == b.node_port == 30080
    assert [e.ip for e in v4.endpoints[SPN].cluster] == ["10.244.1.2", "10.244.2.3"]
    assert [e.ip for e in v6.endpoints[SPN].cluster] == ["fd00:10:244:1::2", "fd00:10:244:2::3"]


def test_the_primary_family_is_the_first_of_cluster_ips() -> None:
    spec = {"clusterIP": "fd00:10:96::a", "clusterIPs": ["fd00:10:96::a", "10.96.0.10"]}
    families = parse_service_families(dual_stack(**spec, ipFamilies=["IPv6", "IPv4"]))
    assert [sp.cluster_ip for sp in families[IPFamily.IPv6]] == ["fd00:10:96::a"]
    assert [sp.cluster_ip for sp in families[IPFamily.IPv4]] == ["10.96.0.10"]


@pytest.mark.parametrize(
    ("cluster_ip", "present", "absent"),
    [("10.96.0.10", IPFamily.IPv4, IPFamily.IPv6), ("fd00:10:96::a", IPFamily.IPv6, IPFamily.IPv4)],
    ids=["ipv4-only", "ipv6-only"],
)
def test_a_single_stack_service_is_only_in_its_family(
    cluster_ip: str, present: IPFamily, absent: IPFamily
) -> None:
    obj = dual_stack(clusterIP=cluster_ip, clusterIPs=[cluster_ip], ipFamilies=[str(present)])
    obj["spec"]["ipFamilyPolicy"] = "SingleStack"
    assert SPN in build_state([obj], SLICES, NODE, family=present).state.services
    result = build_state([obj], SLICES, NODE, family=absent)
    assert result.state.services == {} and result.problems == ()


def test_an_ipv6_slice_is_parsed_with_canonical_addresses_and_its_family() -> None:
    parsed = parse_endpoint_slice(slice_("s", "IPv6", "FD00:0010::0002"), "node1", family=None)
    assert parsed is not None and parsed.family is IPFamily.IPv6
    assert [e.ip for e in parsed.endpoints] == ["fd00:10::2"]
    assert parse_endpoint_slice(slice_("s", "IPv6", "fd00::2")) is None, "IPv4 is the default family"


def test_ipv6_endpoints_print_and_sort_as_go_joinhostport() -> None:
    """kube-proxy hashes and sorts `[ip]:port`: "[fd00::1:1]:80" before "[fd00::1]:80"."""
    assert str(Endpoint("fd00::1", 80)) == join_host_port("fd00::1", 80) == "[fd00::1]:80"
    assert str(Endpoint("10.0.0.1", 80)) == "10.0.0.1:80"
    obj = dual_stack()
    v6 = build_state([obj], [slice_("web-v6", "IPv6", "fd00::1", "fd00::1:1")], NODE, family=IPFamily.IPv6)
    assert [str(e) for e in v6.state.endpoints[SPN].cluster] == ["[fd00::1:1]:8080", "[fd00::1]:8080"]


def test_a_model_ignores_slices_of_the_other_family_and_reports_nothing() -> None:
    model = ProxyModel(NODE, family=IPFamily.IPv6)
    model.set_service("default/web", read_service(dual_stack()))
    model.set_slice("default/web-v4", read_slice(SLICES[0], "node1"))
    model.commit()
    assert model.state.endpoints[SPN].cluster == ()
    model.set_slice("default/web-v6", read_slice(SLICES[1], "node1"))
    commit = model.commit()
    assert commit.changed == frozenset({SPN})
    assert len(model.state.endpoints[SPN].cluster) == 2
    assert model.problems() == []


def test_the_guard_refuses_ipv6_external_addresses_of_the_node_and_its_cidrs() -> None:
    guard = FrontendGuard.of(
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        cluster_cidrs=("10.244.0.0/16", "fd00:10:244::/56"),
        service_cidrs=("10.96.0.0/12", "fd00:10:96::/112"),
    )
    assert guard.refuse_address("fd00:192:168::11") == "an address of this node"
    assert (
        guard.refuse_address("fd00:10:244:1::9") == "inside --cluster-cidr fd00:10:244::/56 (pod addresses)"
    )
    assert guard.refuse_address("fd00:10:96::99") is not None
    assert guard.refuse_address("2001:db8:7::7") is None
    assert guard.refuse_address("192.168.0.11") == "an address of this node"
    obj = dual_stack(externalIPs=["203.0.113.7", "fd00:192:168::11"])
    result = build_state([obj], SLICES, NODE, guard, family=IPFamily.IPv6)
    assert result.state.services[SPN].external_ips == ()
    assert [p.refusal for p in result.problems] == ["RefusedExternalIP"]
    assert build_state([obj], SLICES, NODE, guard).problems == ()


def test_an_allow_list_of_one_family_refuses_the_other() -> None:
    guard = FrontendGuard.of(allowed_cidrs=("203.0.113.0/24",))
    assert guard.refuse_address("203.0.113.7") is None
    assert guard.refuse_address("2001:db8:7::7") == "outside --external-ip-cidrs 203.0.113.0/24"


def test_a_service_that_drops_its_ipv6_family_leaves_the_ipv6_state() -> None:
    """The IPv6 model skips Services that never had IPv6 (an IPv4-only cluster costs it nothing),
    but one that had IPv6 ports and loses them is taken out."""
    model = ProxyModel(NODE, family=IPFamily.IPv6)
    single = dual_stack(clusterIPs=["10.96.0.10"], ipFamilies=["IPv4"])
    single["spec"]["ipFamilyPolicy"] = "SingleStack"
    model.set_service("default/web", read_service(single))
    assert model.commit().changed is None and model.state.services == {}
    model.set_service("default/web", read_service(dual_stack()))
    assert model.commit().changed == frozenset({SPN})
    model.set_service("default/web", read_service(single))
    assert model.commit().changed == frozenset({SPN})
    assert model.state.services == {}
