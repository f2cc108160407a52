"""Backends on the node's own address (host-network endpoints: the API server behind `kubernetes`),
packet by packet: the ingress programs translate the destination and hand the packet to the node's
stack (TC_ACT_OK, no route, TTL kept, the client's address kept whatever the frontend's SNAT
flags); the stack's replies leave through ekp_egress, which gives them their frontend back, as it
does an ICMP error the stack sends about such a flow; an ICMP error about such a flow's reply (a
port unreachable from the client, a fragmentation needed from a hop) is translated and handed to
the same stack. Packets the node forwards, and the node's own
other traffic, leave egress untouched and uncounted.
"""

from __future__ import annotations

import pytest

from agent.ebpf.abi import BackendFlag, ConfigFlag, CtFlag, FrontendFlag, Scope, Stat
from agent.ebpf.loader import Datapath
from lab.dplab import (
    CLIENT,
    NODE,
    POD_CLIENT,
    SNAT_MAX,
    SNAT_MIN,
    UDP,
    VIP,
    Lab,
    Net,
    set_config,
)
from lab.packets import (
    TC_ACT_OK,
    checksums_valid,
    fragments,
    icmp_error,
    icmp_error_about,
    parse,
    reassemble,
    tcp,
    udp,
)
from tests.ebpf.test_datapath_icmp import error_about, quote_of

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

HOST = BackendFlag.HOST | BackendFlag.LOCAL  # what the planner gives an endpoint on a node address
API = 6443


@pytest.fixture(params=[0, ConfigFlag.HOST_LEGACY], ids=["bpf", "legacy"])
def routing(request: pytest.FixtureRequest, dp: Datapath) -> int:
    """Either host routing: a host backend's flows are the stack's in both (the apply step's
    `host` comes before the routing's choice), untagged, with nothing left for the egress source."""
    flags = int(request.param)
    set_config(dp, flags=flags)
    return flags


def test_a_pod_reaches_the_api_server_on_the_nodes_address_through_kubernetes(net: Net, routing: int) -> None:
    """ClusterIP 443 -> the node's 6443, masquerade-all set on the frontend: the pod's address is
    kept (a local delivery masquerades nothing, in kube-proxy neither), the packet goes to the
    stack with its TTL, and the SYN-ACK the stack sends back leaves as the ClusterIP's."""
    net.add_service(port=443, backends=((1, NODE, API, HOST),), flags=FrontendFlag.SNAT_ALL)
    syn = tcp(POD_CLIENT, VIP, 45000, 443)
    verdict, out = net.from_pod(syn)
    p = parse(out)
    assert verdict == TC_ACT_OK and (p.src, p.sport, p.dst, p.dport) == (POD_CLIENT, 45000, NODE, API)
    assert p.ttl == 64 and out[:12] == syn[:12] and checksums_valid(out)  # MACs and TTL as they came
    fwd = net.ct(POD_CLIENT, VIP, 45000, 443)
    assert fwd is not None and fwd.flags == CtFlag.HOST  # no SNAT
    verdict, out = net.to_pod(tcp(NODE, POD_CLIENT, API, 45000, flags="SA"))
    p = parse(out)
    assert verdict == TC_ACT_OK and (p.src, p.sport, p.dst, p.dport) == (VIP, 443, POD_CLIENT, 45000)
    assert checksums_valid(out)
    for _ in range(3):
        p = parse(net.from_pod(tcp(POD_CLIENT, VIP, 45000, 443, flags="PA", payload=b"GET"))[1])
        assert (p.dst, p.dport) == (NODE, API)
        p = parse(net.to_pod(tcp(NODE, POD_CLIENT, API, 45000, flags="PA", payload=b"200"))[1])
        assert (p.src, p.sport) == (VIP, 443)
    fwd = net.ct(POD_CLIENT, VIP, 45000, 443)
    assert fwd is not None and fwd.flags & CtFlag.ESTABLISHED
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY]) == (1, 3, 4)
    assert stats[Stat.DROP_FIB] == 0
    assert len(net.dp.maps["hostnat"].items()) == 0, "nothing for legacy routing's egress source"


def test_an_external_client_reaches_a_host_backend_through_a_node_port(net: Net, routing: int) -> None:
    net.add_service(NODE, 30443, ((1, NODE, API, HOST),), scope=Scope.EXTERNAL, flags=FrontendFlag.SNAT_ALL)
    verdict, out = net.from_net(tcp(CLIENT, NODE, 46000, 30443))
    p = parse(out)
    assert verdict == TC_ACT_OK and (p.src, p.sport, p.dst, p.dport) == (CLIENT, 46000, NODE, API)
    verdict, out = net.to_net(tcp(NODE, CLIENT, API, 46000, flags="SA"))
    p = parse(out)
    assert verdict == TC_ACT_OK and (p.src, p.sport, p.dst, p.dport) == (NODE, 30443, CLIENT, 46000)
    assert checksums_valid(out)
    assert len(net.dp.maps["hostnat"].items()) == 0


def test_egress_leaves_forwarded_packets_and_the_nodes_other_traffic_alone(net: Net, lab: Lab) -> None:
    """The same reply, forwarded (it came in by a device) rather than sent by the node's stack, is
    not the node's: untouched. The node's own traffic to a pod (a probe): untouched, uncounted."""
    net.add_service(port=443, backends=((1, NODE, API, HOST),))
    net.from_pod(tcp(POD_CLIENT, VIP, 45100, 443))
    forwarded = tcp(NODE, POD_CLIENT, API, 45100, flags="SA")
    assert net.to_pod(forwarded, came_in_by=lab.ext.ifindex) == (TC_ACT_OK, forwarded)
    probe = tcp(NODE, POD_CLIENT, 43210, 8080)
    before = net.stats()[Stat.PACKETS]
    assert net.to_pod(probe) == (TC_ACT_OK, probe)
    assert net.stats()[Stat.PACKETS] == before


def test_an_icmp_error_the_stack_sends_about_a_host_flow_is_translated_back(net: Net) -> None:
    """A UDP host backend with nothing listening: the stack answers port unreachable, quoting the
    datagram as it got it (to the node's 53); the pod must see it from the ClusterIP, quoting what
    it sent."""
    from scapy.layers.inet import IP
    from scapy.layers.inet import UDP as UDPLayer

    net.add_service(port=53, backends=((1, NODE, 5353, HOST),), proto=UDP)
    verdict, out = net.from_pod(udp(POD_CLIENT, VIP, 47000, 53))
    assert verdict == TC_ACT_OK and parse(out).dport == 5353
    err = icmp_error_about(out, NODE, POD_CLIENT)
    verdict, back = net.to_pod(err)
    e = icmp_error(back)
    assert verdict == TC_ACT_OK and (e.src, e.dst, e.type, e.code) == (VIP, POD_CLIENT, 3, 3)
    inner = IP(e.quote)
    assert (inner.src, inner.dst, inner[UDPLayer].sport, inner[UDPLayer].dport) == (
        POD_CLIENT,
        VIP,
        47000,
        53,
    )
    assert e.ip_chksum_ok and e.icmp_chksum_ok
    assert net.stats()[Stat.CT_RELATED] == 1


def test_a_port_unreachable_about_a_host_flows_reply_reaches_the_node_as_if_about_what_it_sent(
    net: Net, routing: int
) -> None:
    """The other direction: the pod answers the reply it got from the ClusterIP with a port
    unreachable (its socket is gone). The error's destination is the backend, the node's own
    address: handed to the node's stack (a route lookup would say "local" and drop it), quoting
    the datagram as the node's socket sent it, from 5353 to the pod."""
    net.add_service(port=53, backends=((1, NODE, 5353, HOST),), proto=UDP)
    net.from_pod(udp(POD_CLIENT, VIP, 47100, 53))
    reply = net.to_pod(udp(NODE, POD_CLIENT, 5353, 47100, payload=b"answer"))[1]
    assert parse(reply).src == VIP
    verdict, back = net.from_pod(error_about(reply, POD_CLIENT, "port-unreachable"))
    e = icmp_error(back)
    assert verdict == TC_ACT_OK and (e.src, e.dst, e.type, e.code) == (POD_CLIENT, NODE, 3, 3)
    assert e.ip_chksum_ok and e.icmp_chksum_ok
    assert quote_of(back)[:5] == (NODE, POD_CLIENT, 5353, 47100, True)
    stats = net.stats()
    assert (stats[Stat.CT_RELATED], stats[Stat.DROP_FIB]) == (1, 0)


def test_a_fragmentation_needed_about_a_host_backends_node_port_reply_reaches_the_node(
    net: Net, routing: int
) -> None:
    """Path-MTU discovery toward an external client through a NodePort to a host-network backend:
    a hop on the way says the node's reply (from the NodePort) is too big. The node's stack must
    get it about the segment its socket sent (6443 -> the client), or the connection stalls."""
    net.add_service(NODE, 30443, ((1, NODE, API, HOST),), scope=Scope.EXTERNAL)
    net.from_net(tcp(CLIENT, NODE, 46100, 30443))
    reply = net.to_net(tcp(NODE, CLIENT, API, 46100, flags="PA", payload=b"x" * 64))[1]
    assert (parse(reply).src, parse(reply).sport) == (NODE, 30443)
    verdict, back = net.from_net(error_about(reply, "192.168.0.1", "frag-needed", quote_len=20 + 20 + 64))
    e = icmp_error(back)
    assert verdict == TC_ACT_OK and (e.src, e.dst, e.type, e.code) == ("192.168.0.1", NODE, 3, 4)
    assert e.ip_chksum_ok and e.icmp_chksum_ok
    src, dst, sport, dport, ip_ok, l4 = quote_of(back)
    assert (src, dst, sport, dport, ip_ok) == (NODE, CLIENT, API, 46100, True)
    # the quoted TCP header is the node's own again, checksum included
    sent = tcp(NODE, CLIENT, API, 46100, flags="PA", payload=b"x" * 64)
    assert l4 == sent[14 + 20 :]
    stats = net.stats()
    assert (stats[Stat.CT_RELATED], stats[Stat.DROP_FIB]) == (1, 0)


def test_a_direct_connection_on_a_host_flows_tuple_moves_to_another_port_and_reaches_the_node(
    net: Net,
) -> None:
    """The pod dials the node's 6443 itself from the port a live flow through the ClusterIP holds
    there: it gets another source port (as nf_conntrack's NAT gives it) and is handed to the
    node's stack like the flow it collided with, never dropped for want of a route."""
    net.add_service(port=443, backends=((1, NODE, API, HOST),))
    net.from_pod(tcp(POD_CLIENT, VIP, 45200, 443))
    net.to_pod(tcp(NODE, POD_CLIENT, API, 45200, flags="SA"))
    net.from_pod(tcp(POD_CLIENT, VIP, 45200, 443, flags="A"))
    verdict, out = net.from_pod(tcp(POD_CLIENT, NODE, 45200, API))
    moved = parse(out)
    assert verdict == TC_ACT_OK and (moved.src, moved.dst, moved.dport) == (POD_CLIENT, NODE, API)
    assert SNAT_MIN <= moved.sport <= SNAT_MAX
    back = parse(net.to_pod(tcp(NODE, POD_CLIENT, API, moved.sport, flags="SA"))[1])
    assert (back.src, back.sport, back.dport) == (NODE, API, 45200)
    assert net.stats()[Stat.PORT_REMAP] == 1


def test_a_udp_port_live_through_the_node_port_reused_for_a_cluster_ip_another_node_translated(
    net: Net, routing: int
) -> None:
    """The pod on node2 sends from one port to this node's NodePort (a flow of ours, to the
    host-network server here), then to a ClusterIP that node2 translates to the same server: the
    datagram comes in addressed to the server itself, on the tuple the NodePort flow's replies
    hold. It gets another source port (nf_nat's unique tuple), is handed to the node's stack like
    the flow it collided with, and the server's answers to each port leave from the address that
    port asked: the server itself for the moved one (node2 gives it its ClusterIP back), the
    NodePort for the older flow, which keeps working."""
    remote_pod = "10.244.2.9"
    net.add_service(NODE, 30091, ((1, NODE, 5353, HOST),), proto=UDP, scope=Scope.EXTERNAL)
    assert parse(net.from_net(udp(remote_pod, NODE, 47300, 30091))[1]).dport == 5353
    answer = parse(net.to_net(udp(NODE, remote_pod, 5353, 47300))[1])
    assert (answer.src, answer.sport) == (NODE, 30091)
    verdict, out = net.from_net(udp(remote_pod, NODE, 47300, 5353, payload=b"cluster-ip"))
    moved = parse(out)
    assert verdict == TC_ACT_OK and (moved.src, moved.dst, moved.dport) == (remote_pod, NODE, 5353)
    assert SNAT_MIN <= moved.sport <= SNAT_MAX and checksums_valid(out)
    fwd = net.ct(remote_pod, NODE, 47300, 5353, UDP)
    # to the node's stack, like the flow it collided with; SNAT of the port alone (the pod's address)
    assert fwd is not None and fwd.flags & CtFlag.HOST and fwd.flags & CtFlag.SNAT
    for _ in range(2):
        back = parse(net.to_net(udp(NODE, remote_pod, 5353, moved.sport, payload=b"to the moved port"))[1])
        assert (back.src, back.sport, back.dst, back.dport) == (NODE, 5353, remote_pod, 47300)
        old = parse(net.to_net(udp(NODE, remote_pod, 5353, 47300, payload=b"for the node port"))[1])
        assert (old.src, old.sport, old.dst, old.dport) == (NODE, 30091, remote_pod, 47300)
        again = parse(net.from_net(udp(remote_pod, NODE, 47300, 5353))[1])
        assert again.sport == moved.sport
        assert parse(net.from_net(udp(remote_pod, NODE, 47300, 30091))[1]).sport == 47300
    assert net.stats()[Stat.PORT_REMAP] == 1


def test_a_reply_the_stack_fragments_is_translated_fragment_by_fragment(net: Net) -> None:
    """A 3,000-byte UDP answer of a host backend leaves in three fragments, first first: the first
    records its ports for the others, and all three leave from the ClusterIP; the datagram put back
    together checks."""
    net.add_service(port=53, backends=((1, NODE, 5353, HOST),), proto=UDP)
    assert net.from_pod(udp(POD_CLIENT, VIP, 47100, 53))[0] == TC_ACT_OK
    out = []
    for frame in fragments(NODE, POD_CLIENT, 5353, 47100, bytes(range(256)) * 12, fragsize=1200):
        verdict, translated = net.to_pod(frame)
        assert verdict == TC_ACT_OK
        out.append(translated)
    whole = reassemble(out)
    assert (whole.src, whole.dst, whole.ports) == (VIP, POD_CLIENT, (53, 47100))
    assert whole.headers_ok and whole.l4_checksum_ok()
    assert net.stats()[Stat.FRAGMENTS] == 2
