"""The local-traffic detector by source in the programs (`ekp_local_scope`): with
`EKP_CFG_LOCAL_BY_SRC`, a packet whose source is in the detector's CIDR looks up INTERNAL frontends
and any other EXTERNAL ones, whichever program it entered by; without, the program's own scope decides.
A service with both scopes on one VIP tells them apart: the EXTERNAL frontend masquerades
(kube-proxy's `IfNotLocal -j KUBE-MARK-MASQ`), the INTERNAL one does not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.ebpf.abi import ConfigFlag, FrontendFlag, Scope, ip_be
from agent.ebpf.loader import Datapath
from lab.dplab import (
    CLIENT,
    NODE,
    POD_CLIENT,
    REMOTE_BE,
    SNAT_MAX,
    SNAT_MIN,
    VIP,
    Lab,
    Net,
    packet_lab,
    set_config,
)
from lab.packets import TC_ACT_REDIRECT, parse, sh, tcp

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

OUTSIDE_POD = "172.16.9.5"


@pytest.fixture(scope="module")
def lab(dp: Datapath) -> Iterator[Lab]:
    with packet_lab() as built:
        # A pod whose address is outside the detector's CIDR (an IP pool beyond clusterCIDR): the
        # node routes it to the pod's device, so `bpf` host routing's source check passes it.
        sh("ip", "route", "add", f"{OUTSIDE_POD}/32", "dev", built.pod.name)
        yield built


@pytest.fixture
def net(dp: Datapath, lab: Lab) -> Net:
    n = Net(dp, lab)
    n.add_service(scope=Scope.INTERNAL)
    n.add_service(scope=Scope.EXTERNAL, flags=FrontendFlag.SNAT_ALL)
    return n


def masqueraded(verdict: int, out: bytes) -> bool:
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    return p.src == NODE and SNAT_MIN <= p.sport <= SNAT_MAX


def test_without_a_detector_by_source_the_program_decides(net: Net) -> None:
    assert not masqueraded(*net.from_pod(tcp(OUTSIDE_POD, VIP, 1000, 80)))
    assert masqueraded(*net.from_net(tcp(POD_CLIENT, VIP, 1001, 80)))


@pytest.mark.parametrize(("cidr", "plen"), [("10.244.1.0", 24), ("10.244.0.0", 16), ("10.244.1.9", 32)])
def test_a_source_in_the_cidr_is_local_whichever_program_it_entered_by(
    net: Net, cidr: str, plen: int
) -> None:
    set_config(net.dp, local_net=ip_be(cidr), local_plen=plen, flags=ConfigFlag.LOCAL_BY_SRC)
    assert not masqueraded(*net.from_net(tcp(POD_CLIENT, VIP, 1000, 80)))
    assert not masqueraded(*net.from_pod(tcp(POD_CLIENT, VIP, 1001, 80)))
    assert masqueraded(*net.from_pod(tcp(OUTSIDE_POD, VIP, 1002, 80)))
    assert masqueraded(*net.from_net(tcp(CLIENT, VIP, 1003, 80)))


def test_node_cidr_tells_this_nodes_pods_from_another_nodes(net: Net) -> None:
    # NodeCIDR: 10.244.1.0/24 here; a pod of node2 (10.244.2.0/24) is not local.
    set_config(net.dp, local_net=ip_be("10.244.1.0"), local_plen=24, flags=ConfigFlag.LOCAL_BY_SRC)
    assert masqueraded(*net.from_net(tcp(REMOTE_BE, VIP, 1000, 80)))
    assert not masqueraded(*net.from_pod(tcp(POD_CLIENT, VIP, 1001, 80)))


def test_a_zero_length_prefix_makes_every_source_local(net: Net) -> None:
    set_config(net.dp, local_net=0, local_plen=0, flags=ConfigFlag.LOCAL_BY_SRC)
    assert not masqueraded(*net.from_net(tcp(CLIENT, VIP, 1000, 80)))
