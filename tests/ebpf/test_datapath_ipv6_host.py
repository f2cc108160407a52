"""Backends on the node's own IPv6 address (host-network endpoints) on the tc programs' IPv6 path,
packet by packet, as IPv4's (tests/ebpf/test_datapath_host.py): the ingress program translates
the destination and hands the packet to the node's stack (TC_ACT_OK, no route, hop limit kept,
the client's address kept whatever the frontend's SNAT flags) in either host routing; the stack's
replies leave through ekp_egress, whose IPv6 half (ekp_egress6, ekp_tc6_local) gives them their
frontend back from the REPLY entry. The node's other IPv6 traffic leaves egress untouched and
uncounted. Before, ekp_tc6.h left every frontend with such a backend to ip6tables
(EKP_FE_HOST_BACKEND).

The IPv6 packet lab of test_datapath_ipv6 (its `lab` fixture: lab/dplab.py's `add_ipv6`).
"""

from __future__ import annotations

import pytest

from agent.ebpf.abi import BackendFlag, ConfigFlag, CtFlag, FrontendFlag, Scope, Stat
from agent.ebpf.loader import Datapath
from lab.dplab import CLIENT6, NODE6, POD6, UDP, VIP6, Net, add_service6, set_config
from lab.packets import TC_ACT_OK
from tests.ebpf.test_datapath_ipv6 import (  # noqa: F401 (`lab`: the IPv6 packet lab, a fixture)
    ct6,
    ct6_count,
    frame6,
    lab,
    seen,
)
from tests.ebpf.test_datapath_ipv6_snat import snat_source

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

HOST = BackendFlag.HOST | BackendFlag.LOCAL  # what the planner gives an endpoint on a node address
API = 6443


@pytest.fixture(params=[0, ConfigFlag.HOST_LEGACY], ids=["bpf", "legacy"])
def routing(request: pytest.FixtureRequest, dp: Datapath) -> int:
    flags = int(request.param)
    set_config(dp, flags=flags)
    return flags


def test_a_pod_reaches_a_host_backend_through_an_ipv6_cluster_ip(net: Net, routing: int) -> None:
    """ClusterIP 443 -> the node's 6443, SNAT_ALL on the frontend (and the node's IPv6 address
    known): the pod's address is kept, the SYN goes to the stack with its hop limit, and the
    SYN-ACK the stack sends back leaves egress as the ClusterIP's."""
    snat_source(net, NODE6)
    add_service6(net.dp.maps, VIP6, 443, ((1, NODE6, API, HOST),), flags=FrontendFlag.SNAT_ALL)
    verdict, out = net.from_pod(frame6(POD6, VIP6, 45000, 443))
    assert verdict == TC_ACT_OK
    _, src, dst, sport, _, dport, hlim = seen(out)
    assert (src, dst, sport, dport, hlim) == (POD6, NODE6, 45000, API, 64)
    fwd = ct6(net, POD6, VIP6, 45000, 443)
    assert fwd is not None and fwd.flags == CtFlag.HOST, "no SNAT"
    verdict, out = net.to_pod(frame6(NODE6, POD6, API, 45000, flags="SA"))
    assert verdict == TC_ACT_OK
    assert seen(out)[1:4] == (VIP6, POD6, 443) and seen(out)[5] == 45000
    for _ in range(2):
        verdict, out = net.from_pod(frame6(POD6, VIP6, 45000, 443, flags="PA"))
        assert verdict == TC_ACT_OK and seen(out)[2] == NODE6 and seen(out)[5] == API
        verdict, out = net.to_pod(frame6(NODE6, POD6, API, 45000, flags="PA"))
        assert verdict == TC_ACT_OK and seen(out)[1:4] == (VIP6, POD6, 443)
    assert ct6(net, POD6, VIP6, 45000, 443).flags & CtFlag.ESTABLISHED
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY]) == (1, 2, 3)
    assert stats[Stat.SNAT] == 0


def test_an_external_client_reaches_a_host_backend_through_an_ipv6_node_port(net: Net, routing: int) -> None:
    """A NodePort of policy Cluster (SNAT_REMOTE) from outside to the node's own address: the
    client's address is kept both ways (a local delivery masquerades nothing)."""
    snat_source(net, NODE6)
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    add_service6(net.dp.maps, NODE6, 30443, ((1, NODE6, API, HOST),), scope=Scope.EXTERNAL, flags=flags)
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50000, 30443))
    assert verdict == TC_ACT_OK
    assert seen(out)[1:4] == (CLIENT6, NODE6, 50000) and seen(out)[5:] == (API, 64)
    verdict, out = net.to_net(frame6(NODE6, CLIENT6, API, 50000, flags="SA"))
    assert verdict == TC_ACT_OK
    assert seen(out)[1:4] == (NODE6, CLIENT6, 30443) and seen(out)[5] == 50000
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_REPLY], stats[Stat.SNAT]) == (1, 1, 0)


def test_egress_leaves_the_nodes_other_ipv6_traffic_and_forwarded_packets_alone(
    net: Net, routing: int
) -> None:
    """The node's own packets of no flow (its own connection out, a reply whose flow is not a host
    backend's) and a forwarded one leave egress untouched and uncounted."""
    add_service6(net.dp.maps, VIP6, 443, ((1, NODE6, API, HOST),))
    own = frame6(NODE6, CLIENT6, 40000, 443)
    assert net.to_net(own) == (TC_ACT_OK, own)
    reply = frame6(NODE6, POD6, API, 45999, flags="SA")  # no flow of the pod's port
    assert net.to_pod(reply) == (TC_ACT_OK, reply)
    forwarded = frame6(CLIENT6, POD6, 443, 45000, flags="A")
    assert net.to_pod(forwarded, came_in_by=1) == (TC_ACT_OK, forwarded)
    assert ct6_count(net) == 0
    assert net.stats()[Stat.PACKETS] == 0


def test_packet_too_big_about_a_host_backends_reply_reaches_the_backends_socket(
    net: Net, routing: int
) -> None:
    """A router on the client's side answers the host backend's reply (which left as the NodePort's)
    with Packet Too Big: found through the flow's FORWARD entry, it is rewritten to quote the
    backend's own segment (NODE6:6443) and handed to the stack (no route: the node is local), its
    hop limit kept, so the socket lowers its path MTU. Before, the local route ended the lookup and
    the error reached the stack untranslated: no socket of 30443, the TCP flow stalled."""
    from tests.ebpf.test_datapath_icmp6 import error6, error_about

    snat_source(net, NODE6)
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    add_service6(net.dp.maps, NODE6, 30443, ((1, NODE6, API, HOST),), scope=Scope.EXTERNAL, flags=flags)
    assert net.from_net(frame6(CLIENT6, NODE6, 50001, 30443))[0] == TC_ACT_OK
    verdict, reply = net.to_net(frame6(NODE6, CLIENT6, API, 50001, flags="SA"))
    assert verdict == TC_ACT_OK and seen(reply)[3] == 30443
    router = "fd00:ff::1"
    verdict, back = net.from_net(error_about(reply, router, "packet-too-big"))
    assert verdict == TC_ACT_OK
    e = error6(back)
    assert (e.src, e.dst, e.hlim, e.checksum_ok) == (router, NODE6, 64, True)
    assert int.from_bytes(e.head[4:8], "big") == 1280
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport) == (NODE6, CLIENT6, API, 50001)
    assert e.in_tcp_checksum_ok is True
    assert net.stats()[Stat.CT_RELATED] == 1


def test_the_nodes_port_unreachable_about_a_host_backends_datagram_leaves_as_the_cluster_ips(
    net: Net, routing: int
) -> None:
    """A pod's datagram to an IPv6 ClusterIP whose backend is a closed UDP port on the node: the
    stack answers the translated datagram (POD6 -> NODE6:5353) with port unreachable, which egress
    gives the ClusterIP back (outer source and quote, found through the REPLY entry), so the
    pod's connected socket gets ECONNREFUSED at once. Before, it left untranslated: the pod's
    stack matched no socket to it and the client waited for its timeout."""
    from tests.ebpf.test_datapath_icmp6 import error6, error_about

    snat_source(net, NODE6)
    add_service6(net.dp.maps, VIP6, 53, ((1, NODE6, 5353, HOST),), proto=UDP)
    sent = frame6(POD6, VIP6, 45100, 53, UDP)
    verdict, out = net.from_pod(sent)
    assert verdict == TC_ACT_OK and seen(out)[2] == NODE6
    verdict, back = net.to_pod(error_about(out, NODE6, "port-unreachable"))
    assert verdict == TC_ACT_OK
    e = error6(back)
    assert (e.src, e.dst, e.checksum_ok, e.head[:2]) == (VIP6, POD6, True, bytes([1, 4]))
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport, e.in_l4[8:]) == (POD6, VIP6, 45100, 53, sent[62:])
    stats = net.stats()
    assert (stats[Stat.CT_RELATED], stats[Stat.NEW_FLOWS]) == (1, 1)
