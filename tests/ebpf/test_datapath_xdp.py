"""The XDP program of the external devices (ekp_xdp_net), packet by packet through
BPF_PROG_TEST_RUN: every verdict (drop by source range and the other drops, XDP_TX translated
both ways, pass to tc), and that the entries it writes are the ones the tc program reads, and the
other way round. Maglev's table lookup and the resumption of a flow whose conntrack was lost.

The lab is lab/dplab.py's: ext0 is the external device; node2 (192.168.0.12) is the gateway of the
pods on node2 (10.244.2.0/24) and the client 192.168.0.100 is on ext0 too, so a flow between them
leaves by the device it came in by (XDP_TX). Both counters (tc's, XDP's) balance after each test.
"""

from __future__ import annotations

import pytest

from agent.ebpf import abi
from agent.ebpf.abi import BackendFlag, CtFlag, FrontendFlag, Scope, Stat, ip_be, port_be
from lab.dplab import (
    BE1,
    BE_SMALL_MTU,
    CLIENT,
    MAC,
    NODE,
    NODE2,
    REMOTE_BE,
    SNAT_MAX,
    SNAT_MIN,
    Lab,
    Net,
)
from lab.packets import (
    TC_ACT_REDIRECT,
    TC_ACT_SHOT,
    XDP_DROP,
    XDP_PASS,
    XDP_TX,
    checksums_valid,
    icmp_error,
    parse,
    tcp,
    udp,
)

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

REMOTE_BE2 = "10.244.2.8"
NODEPORT = 30080
ETP_CLUSTER = FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL


def nodeport(net: Net, backends: tuple[tuple[int, str, int, int], ...], flags: int = ETP_CLUSTER) -> None:
    net.add_service(NODE, NODEPORT, backends, scope=Scope.EXTERNAL, flags=flags, rev_nat_id=3)


def from_client(
    lab: Lab, sport: int = 5555, flags: str = "S", dst: str = NODE, dport: int = NODEPORT
) -> bytes:
    return tcp(CLIENT, dst, sport, dport, flags=flags, smac=MAC[CLIENT], dmac=lab.ext.mac)


# ---- XDP_TX: both ways, and the entries tc reads ------------------------------------------


def test_nodeport_to_a_remote_backend_is_translated_and_sent_back_out_at_xdp(net: Net, lab: Lab) -> None:
    nodeport(net, ((7, REMOTE_BE, 8080, 0),))
    verdict, out = net.xdp(from_client(lab))
    assert verdict == XDP_TX
    p = parse(out)
    assert (p.src, p.dst, p.dport) == (NODE, REMOTE_BE, 8080)
    assert SNAT_MIN <= p.sport <= SNAT_MAX
    assert (p.smac, p.dmac, p.ttl) == (lab.ext.mac, MAC[NODE2], 63)  # via node2, the route's gateway
    assert checksums_valid(out)
    snat_port = p.sport
    # the entries are the ones tc writes for the same flow (test_datapath.py)
    fwd = net.ct(CLIENT, NODE, 5555, NODEPORT)
    assert fwd is not None
    assert (fwd.flags, fwd.snat_addr, fwd.snat_port) == (CtFlag.SNAT, ip_be(NODE), port_be(snat_port))
    rep = net.ct(REMOTE_BE, NODE, 8080, snat_port, reply=True)
    assert rep is not None
    assert (rep.nat_addr, rep.nat_port, rep.fe_addr, rep.fe_port) == (
        ip_be(CLIENT),
        port_be(5555),
        ip_be(NODE),
        port_be(NODEPORT),
    )

    # the reply from node2 comes back to the SNAT address: XDP restores it and sends it out again
    reply = tcp(REMOTE_BE, NODE, 8080, snat_port, flags="SA", smac=MAC[NODE2], dmac=lab.ext.mac)
    verdict, out = net.xdp(reply)
    assert verdict == XDP_TX
    p = parse(out)
    assert (p.src, p.sport, p.dst, p.dport) == (NODE, NODEPORT, CLIENT, 5555)
    assert (p.smac, p.dmac, p.ttl) == (lab.ext.mac, MAC[CLIENT], 63)
    assert checksums_valid(out)
    x = net.xstats()
    assert (x[Stat.PACKETS], x[Stat.NEW_FLOWS], x[Stat.SNAT], x[Stat.CT_REPLY]) == (2, 1, 1, 1)
    assert net.stats()[Stat.PACKETS] == 0  # tc never saw them


def test_tc_carries_on_a_flow_xdp_began_and_xdp_one_tc_began(net: Net, lab: Lab) -> None:
    """One conntrack entry, whichever hook wrote it: a flow begun at XDP continues through tc with
    the same translation (XDP detached, or a packet it passed), and the other way round."""
    nodeport(net, ((7, REMOTE_BE, 8080, 0),))
    assert net.xdp(from_client(lab, 5601))[0] == XDP_TX
    verdict, out = net.from_net(from_client(lab, 5601, flags="A"))
    assert verdict == TC_ACT_REDIRECT
    fwd = net.ct(CLIENT, NODE, 5601, NODEPORT)
    assert fwd is not None
    assert (port_be(parse(out).sport), parse(out).dst) == (fwd.snat_port, REMOTE_BE)

    assert net.from_net(from_client(lab, 5602))[0] == TC_ACT_REDIRECT
    tc_fwd = net.ct(CLIENT, NODE, 5602, NODEPORT)
    assert tc_fwd is not None
    verdict, out = net.xdp(from_client(lab, 5602, flags="A"))
    assert verdict == XDP_TX
    assert port_be(parse(out).sport) == tc_fwd.snat_port
    assert (net.stats()[Stat.CT_FORWARD], net.xstats()[Stat.CT_FORWARD]) == (1, 1)


def test_udp_to_a_remote_backend_is_translated_at_xdp(net: Net, lab: Lab) -> None:
    net.add_service(
        NODE, NODEPORT, ((7, REMOTE_BE, 9000, 0),), proto=17, scope=Scope.EXTERNAL, flags=ETP_CLUSTER
    )
    verdict, out = net.xdp(udp(CLIENT, NODE, 5353, NODEPORT, smac=MAC[CLIENT], dmac=lab.ext.mac))
    assert verdict == XDP_TX
    p = parse(out)
    assert (p.src, p.dst, p.dport) == (NODE, REMOTE_BE, 9000)
    assert checksums_valid(out)


# ---- drops --------------------------------------------------------------------------------


def test_source_ranges_drop_one_client_at_xdp_and_let_another_through(net: Net, lab: Lab) -> None:
    flags = FrontendFlag.LOADBALANCER | FrontendFlag.SOURCE_RANGES | FrontendFlag.SNAT_ALL
    lb_ip = "203.0.113.7"
    net.add_service(lb_ip, 80, ((7, REMOTE_BE, 8080, 0),), scope=Scope.EXTERNAL, flags=flags, rev_nat_id=9)
    allow = abi.SrcRangeKey(prefixlen=32 + 32, rev_nat_id=9, addr=ip_be(CLIENT))
    net.dp.maps["srcr"].update(allow, abi.SrcRange(1))
    denied = tcp("192.168.0.101", lb_ip, 5558, 80, smac=MAC[CLIENT], dmac=lab.ext.mac)
    assert net.xdp(denied)[0] == XDP_DROP
    assert net.xdp(from_client(lab, 5559, dst=lb_ip, dport=80))[0] == XDP_TX
    x = net.xstats()
    assert (x[Stat.DROP_SOURCE_RANGE], x[Stat.NEW_FLOWS]) == (1, 1)
    assert net.ct("192.168.0.101", lb_ip, 5558, 80) is None


def test_mid_flow_segment_without_a_flow_drops_at_xdp(net: Net, lab: Lab) -> None:
    nodeport(net, ((7, REMOTE_BE, 8080, 0),))
    assert net.xdp(from_client(lab, 5560, flags="A"))[0] == XDP_DROP
    assert net.xstats()[Stat.DROP_NO_FLOW] == 1


def test_local_policy_without_local_endpoints_drops_at_xdp(net: Net, lab: Lab) -> None:
    nodeport(net, (), flags=FrontendFlag.NODEPORT | FrontendFlag.LOCAL)
    assert net.xdp(from_client(lab, 5561))[0] == XDP_DROP
    assert net.xstats()[Stat.DROP_NO_LOCAL] == 1


def test_malformed_headers_drop_at_xdp(net: Net, lab: Lab) -> None:
    frame = from_client(lab)
    truncated = frame[: 14 + 20 + 10]  # half a TCP header
    assert net.xdp(truncated)[0] == XDP_DROP
    assert net.xstats()[Stat.DROP_MALFORMED] == 1


# ---- pass to tc ---------------------------------------------------------------------------


def test_new_flow_to_a_local_backend_is_left_to_tc_untouched_and_without_entries(net: Net, lab: Lab) -> None:
    nodeport(net, ((1, BE1, 8080, BackendFlag.LOCAL),))
    frame = from_client(lab, 5570)
    assert net.xdp(frame) == (XDP_PASS, frame)
    assert net.ct(CLIENT, NODE, 5570, NODEPORT) is None  # tc writes it, deciding again
    assert net.xstats()[Stat.TO_TC] == 1
    verdict, out = net.from_net(frame)
    assert verdict == TC_ACT_REDIRECT
    assert parse(out).dst == BE1
    assert net.stats()[Stat.NEW_FLOWS] == 1


def test_established_flow_to_a_local_backend_is_left_to_tc(net: Net, lab: Lab) -> None:
    nodeport(net, ((1, BE1, 8080, BackendFlag.LOCAL),))
    assert net.from_net(from_client(lab, 5571))[0] == TC_ACT_REDIRECT
    ack = from_client(lab, 5571, flags="A")
    assert net.xdp(ack) == (XDP_PASS, ack)  # the route goes into a pod's veth, not back out of ext0
    assert net.from_net(ack)[0] == TC_ACT_REDIRECT
    assert (net.xstats()[Stat.TO_TC], net.stats()[Stat.CT_FORWARD]) == (1, 1)


def test_route_out_of_another_device_is_left_to_tc(net: Net, lab: Lab) -> None:
    nodeport(net, ((5, BE_SMALL_MTU, 8080, 0),))  # a remote-flagged backend behind small0
    frame = from_client(lab, 5572)
    assert net.xdp(frame) == (XDP_PASS, frame)
    assert net.xstats()[Stat.TO_TC] == 1
    # XDP wrote the flow; tc finds it and carries it out
    assert net.ct(CLIENT, NODE, 5572, NODEPORT) is not None
    assert net.from_net(frame)[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.CT_FORWARD] == 1


def test_reject_is_left_to_tc(net: Net, lab: Lab) -> None:
    nodeport(net, (), flags=ETP_CLUSTER | FrontendFlag.NO_ENDPOINTS)
    frame = from_client(lab, 5573)
    assert net.xdp(frame) == (XDP_PASS, frame)
    verdict, out = net.from_net(frame)
    assert verdict == TC_ACT_REDIRECT
    assert icmp_error(out).type == 3
    assert (net.xstats()[Stat.TO_TC], net.stats()[Stat.DROP_NO_ENDPOINTS]) == (1, 1)


def test_what_is_not_ours_passes_at_xdp(net: Net, lab: Lab) -> None:
    from scapy.layers.inet import ICMP, IP
    from scapy.layers.l2 import ARP, Ether

    nodeport(net, ((7, REMOTE_BE, 8080, 0),))
    no_frontend = from_client(lab, 5574, dport=22)
    arp = bytes(Ether() / ARP(pdst=NODE))
    ping = bytes(Ether() / IP(src=CLIENT, dst=NODE) / ICMP())
    fragment = bytes(
        Ether(src=MAC[CLIENT], dst=lab.ext.mac)
        / IP(src=CLIENT, dst=NODE, flags="MF", id=7, proto=17)
        / udp(CLIENT, NODE, 5353, NODEPORT)[34:]
    )
    for frame in (no_frontend, arp, ping, fragment):
        assert net.xdp(frame) == (XDP_PASS, frame)
    x = net.xstats()
    assert (x[Stat.PACKETS], x[Stat.PASS]) == (4, 4)
    assert net.stats()[Stat.PACKETS] == 0


def test_tc_still_serves_the_same_frontend_without_xdp(net: Net, lab: Lab) -> None:
    """XDP off (or generic, or best-effort without a driver): ekp_from_net does it all, unchanged."""
    nodeport(net, ((7, REMOTE_BE, 8080, 0),))
    verdict, out = net.from_net(from_client(lab, 5575))
    assert verdict == TC_ACT_REDIRECT
    assert parse(out).dst == REMOTE_BE
    assert net.xstats()[Stat.PACKETS] == 0


# ---- Maglev -------------------------------------------------------------------------------


def test_maglev_table_names_the_backend(net: Net, lab: Lab) -> None:
    backends = ((7, REMOTE_BE, 8080, 0), (8, REMOTE_BE2, 8080, 0))
    nodeport(net, backends, flags=ETP_CLUSTER | FrontendFlag.MAGLEV)
    net.set_maglev(1, [8])  # every position names backend 8
    for sport in range(5600, 5620):
        verdict, out = net.xdp(from_client(lab, sport))
        assert verdict == XDP_TX
        assert parse(out).dst == REMOTE_BE2


def test_maglev_table_naming_a_backend_outside_the_set_falls_back_to_the_slots(net: Net, lab: Lab) -> None:
    nodeport(net, ((7, REMOTE_BE, 8080, 0),), flags=ETP_CLUSTER | FrontendFlag.MAGLEV)
    net.dp.maps["be"].update(abi.BackendKey(9), abi.Backend(ip_be(REMOTE_BE2), port_be(8080), 6, 0))
    net.set_maglev(1, [9])  # backend 9 exists but is no member of this service port
    verdict, out = net.xdp(from_client(lab, 5630))
    assert verdict == XDP_TX
    assert parse(out).dst == REMOTE_BE


def test_maglev_flow_resumes_on_its_backend_after_its_conntrack_is_lost(net: Net, lab: Lab) -> None:
    backends = ((7, REMOTE_BE, 8080, 0), (8, REMOTE_BE2, 8080, 0))
    nodeport(net, backends, flags=ETP_CLUSTER | FrontendFlag.MAGLEV)
    net.set_maglev(1, [7, 8])
    verdict, out = net.xdp(from_client(lab, 5640))
    assert verdict == XDP_TX
    first = parse(out)
    net.dp.maps["ct_tcp"].clear()  # a restart elsewhere, an ECMP change: the entries are gone
    verdict, out = net.xdp(from_client(lab, 5640, flags="PA"))
    assert verdict == XDP_TX
    again = parse(out)
    # the same backend, and the same SNAT port (the walk starts at the tuple's hash): the backend
    # sees the connection it had
    assert (again.dst, again.sport) == (first.dst, first.sport)
    x = net.xstats()
    assert (x[Stat.CT_RESUMED], x[Stat.NEW_FLOWS]) == (1, 2)
    # through tc too: the same code
    net.dp.maps["ct_tcp"].clear()
    verdict, out = net.from_net(from_client(lab, 5640, flags="A"))
    assert verdict == TC_ACT_REDIRECT
    assert (parse(out).dst, parse(out).sport) == (first.dst, first.sport)


def test_without_maglev_a_flow_whose_conntrack_is_lost_drops(net: Net, lab: Lab) -> None:
    nodeport(net, ((7, REMOTE_BE, 8080, 0),))
    assert net.xdp(from_client(lab, 5650))[0] == XDP_TX
    net.dp.maps["ct_tcp"].clear()
    assert net.xdp(from_client(lab, 5650, flags="PA"))[0] == XDP_DROP
    assert net.from_net(from_client(lab, 5650, flags="PA"))[0] == TC_ACT_SHOT
    assert (net.xstats()[Stat.DROP_NO_FLOW], net.stats()[Stat.DROP_NO_FLOW]) == (1, 1)
