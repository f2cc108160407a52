"""The tc data path, packet by packet, through BPF_PROG_TEST_RUN: translation, conntrack,
SNAT, rejects, affinity, policy drops. One compile per module (pins in a private bpffs); the lab
(lab/dplab.py) is a private network namespace the FIB lookups resolve in. After each test
the counters must balance: PACKETS == sum of the outcomes.

Focused modules beside this one: test_datapath_fragments.py, test_datapath_icmp.py,
test_datapath_flows.py (flow state, membership, capacity, collisions), test_datapath_floods.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from agent.ebpf import abi
from agent.ebpf.abi import BackendFlag, CtFlag, FrontendFlag, Scope, Stat, ip_be, port_be
from agent.ebpf.loader import Datapath
from lab.dplab import (
    BE1,
    BE2,
    BE3,
    BE4,
    BE_NO_NEIGH,
    CLIENT,
    MAC,
    NODE,
    NODE2,
    POD_CLIENT,
    REMOTE_BE,
    SNAT_MAX,
    SNAT_MIN,
    TCP,
    UDP,
    VIP,
    Lab,
    Net,
    set_config,
)
from lab.packets import (
    TC_ACT_OK,
    TC_ACT_REDIRECT,
    TC_ACT_SHOT,
    XDP_PASS,
    checksums_valid,
    icmp_error,
    parse,
    tcp,
    udp,
)

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]


# ---- pass -------------------------------------------------------------------------------


def test_frontend_miss_passes_the_packet_unchanged(net: Net) -> None:
    net.add_service()
    frame = tcp(POD_CLIENT, "10.96.0.99", 12345, 80)
    verdict, out = net.from_pod(frame)
    assert verdict == TC_ACT_OK
    assert out == frame
    assert net.stats()[Stat.PASS] == 1


def test_frontend_of_the_other_scope_is_not_matched(net: Net) -> None:
    net.add_service(scope=Scope.INTERNAL)
    frame = tcp(CLIENT, VIP, 12345, 80)
    assert net.from_net(frame) == (TC_ACT_OK, frame)


def test_non_ip_icmp_and_ttl_1_pass(net: Net) -> None:
    from scapy.layers.inet import ICMP, IP
    from scapy.layers.l2 import ARP, Ether

    net.add_service()
    arp = bytes(Ether() / ARP(pdst=VIP))
    icmp = bytes(Ether() / IP(src=POD_CLIENT, dst=VIP) / ICMP())
    ttl1 = tcp(POD_CLIENT, VIP, 12345, 80, ttl=1)
    for frame in (arp, icmp, ttl1):
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    assert net.stats()[Stat.PASS] == 3


def test_ipv6_without_an_ipv6_frontend_passes_every_program_untouched(net: Net) -> None:
    """With IPv4 frontends only, every IPv6 packet leaves each program unchanged for the node's
    stack (the tc ingress programs hand it to their IPv6 twins, bpf/ekp_tc6.h, which count it once
    and find nothing of theirs), with no conntrack or fragment entry made; even one whose address
    ends in an IPv4 frontend's bytes (a v4-mapped address in the header, or an address whose last
    word is the VIP), which a parser that read the last word as an IPv4 address would translate."""
    from scapy.layers.inet import TCP as TCPHeader
    from scapy.layers.inet import UDP as UDPHeader
    from scapy.layers.inet6 import IPv6, IPv6ExtHdrFragment
    from scapy.layers.l2 import Ether

    net.add_service()
    net.add_service(proto=UDP, svc_id=2, set_id=2, rev_nat_id=2)
    hex_vip = "".join(f"{int(b):02x}" for b in VIP.split("."))
    tail = f"{hex_vip[:4]}:{hex_vip[4:]}"
    frames = [
        bytes(Ether() / IPv6(src="fd00:10:244:1::9", dst=dst) / TCPHeader(sport=12345, dport=80, flags="S"))
        for dst in ("fd00:10:96::a", f"::ffff:{VIP}", f"fd00::{tail}")
    ]
    frames.append(bytes(Ether() / IPv6(src="fd00:10:244:1::9", dst=f"fd00::{tail}") / UDPHeader(dport=80)))
    fragment = IPv6(src="fd00::1", dst="fd00:10:96::a") / IPv6ExtHdrFragment(m=1) / UDPHeader(dport=80)
    frames.append(bytes(Ether() / fragment / (b"x" * 64)))
    for frame in frames:
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
        assert net.from_net(frame) == (TC_ACT_OK, frame)
        assert net.to_pod(frame) == (TC_ACT_OK, frame)
        assert net.to_net(frame) == (TC_ACT_OK, frame)
        assert net.xdp(frame) == (XDP_PASS, frame)
    assert net.ct_count() == 0 and net.ct_count(UDP) == 0
    stats, xstats = net.stats(), net.xstats()
    assert {k: v for k, v in stats.items() if v} == {Stat.PACKETS: 10, Stat.PASS: 10}, "both ingress programs"
    # XDP leaves every IPv6 fragment to tc before any look-up (TO_TC: holding and recording
    # fragments needs the skb, bpf/ekp_decide6_hook.h); the other four pass as none of its own
    assert {k: v for k, v in xstats.items() if v} == {Stat.PACKETS: 5, Stat.PASS: 4, Stat.TO_TC: 1}


# ---- new flows, conntrack, replies ---------------------------------------------------------


def test_clusterip_tcp_syn_is_translated_and_redirected(net: Net, lab: Lab) -> None:
    net.add_service()
    verdict, out = net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    assert (p.src, p.sport, p.dst, p.dport) == (POD_CLIENT, 12345, BE1, 8080)
    assert (p.smac, p.dmac, p.ttl) == (lab.pod.mac, MAC[BE1], 63)
    assert checksums_valid(out)

    fwd = net.ct(POD_CLIENT, VIP, 12345, 80)
    assert fwd is not None
    assert (fwd.flags, fwd.backend_id, fwd.svc_id) == (0, 1, 1)
    assert (fwd.nat_addr, fwd.nat_port, fwd.snat_addr, fwd.snat_port) == (ip_be(BE1), port_be(8080), 0, 0)
    assert (fwd.fe_addr, fwd.fe_port) == (ip_be(VIP), port_be(80))
    assert 0 < fwd.last_seen_ns <= time.monotonic_ns()
    assert fwd.created_s == fwd.last_seen_ns // 10**9
    rep = net.ct(BE1, POD_CLIENT, 8080, 12345, reply=True)
    assert rep is not None
    assert (rep.flags, rep.backend_id, rep.svc_id) == (0, 1, 1)
    assert (rep.nat_addr, rep.nat_port, rep.fe_addr, rep.fe_port) == (0, 0, ip_be(VIP), port_be(80))
    # the direction is part of the key: neither tuple matches the other direction's entry
    assert net.ct(POD_CLIENT, VIP, 12345, 80, reply=True) is None
    assert net.ct(BE1, POD_CLIENT, 8080, 12345) is None
    assert net.stats()[Stat.NEW_FLOWS] == 1


def test_later_packets_of_a_flow_keep_their_backend(net: Net) -> None:
    net.add_service(backends=((1, BE1, 8080, BackendFlag.LOCAL), (2, BE2, 8080, BackendFlag.LOCAL)))
    first = parse(net.from_pod(tcp(POD_CLIENT, VIP, 23456, 80))[1]).dst
    for _ in range(10):
        verdict, out = net.from_pod(tcp(POD_CLIENT, VIP, 23456, 80, flags="A", payload=b"data"))
        assert verdict == TC_ACT_REDIRECT
        assert parse(out).dst == first
        assert checksums_valid(out)
    assert net.stats()[Stat.NEW_FLOWS] == 1
    assert net.stats()[Stat.CT_FORWARD] == 10


def test_backend_choice_is_spread_over_the_slots(net: Net) -> None:
    backends = tuple((i, addr, 8080, BackendFlag.LOCAL) for i, addr in enumerate((BE1, BE2, BE3, BE4), 1))
    net.add_service(backends=backends)
    chosen = {parse(net.from_pod(tcp(POD_CLIENT, VIP, 30000 + i, 80))[1]).dst for i in range(32)}
    assert len(chosen) >= 2  # 4 equally likely backends: all 32 on one has probability 4^-31


def test_reply_from_the_backend_appears_to_come_from_the_service(net: Net, lab: Lab) -> None:
    net.add_service()
    net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))
    verdict, out = net.from_pod(tcp(BE1, POD_CLIENT, 8080, 12345, flags="SA", payload=b"x"))
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    assert (p.src, p.sport, p.dst, p.dport) == (VIP, 80, POD_CLIENT, 12345)
    assert (p.smac, p.dmac) == (lab.pod.mac, MAC[POD_CLIENT])
    assert checksums_valid(out)
    assert net.stats()[Stat.CT_REPLY] == 1


def test_udp_is_translated_both_ways(net: Net) -> None:
    net.add_service(port=53, backends=((1, BE2, 5353, BackendFlag.LOCAL),), proto=UDP)
    verdict, out = net.from_pod(udp(POD_CLIENT, VIP, 40001, 53))
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    assert (p.dst, p.dport) == (BE2, 5353)
    assert p.l4_chksum != 0 and checksums_valid(out)
    verdict, out = net.from_pod(udp(BE2, POD_CLIENT, 5353, 40001))
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    assert (p.src, p.sport) == (VIP, 53)
    assert checksums_valid(out)


def test_udp_checksum_zero_stays_zero(net: Net) -> None:
    net.add_service(port=53, backends=((1, BE2, 5353, BackendFlag.LOCAL),), proto=UDP)
    verdict, out = net.from_pod(udp(POD_CLIENT, VIP, 40002, 53, chksum=0))
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    assert (p.dst, p.dport, p.l4_chksum) == (BE2, 5353, 0)
    assert checksums_valid(out)  # the IP header checksum
    verdict, out = net.from_pod(udp(BE2, POD_CLIENT, 5353, 40002, chksum=0))
    assert verdict == TC_ACT_REDIRECT
    assert parse(out).l4_chksum == 0


def test_unresolved_neighbour_goes_through_redirect_neigh(net: Net) -> None:
    net.add_service(backends=((1, BE_NO_NEIGH, 8080, BackendFlag.LOCAL),))
    frame = tcp(POD_CLIENT, VIP, 12346, 80)
    verdict, out = net.from_pod(frame)
    assert verdict == TC_ACT_REDIRECT  # the 4-argument helper accepted our parameters
    p, before = parse(out), parse(frame)
    assert (p.dst, p.ttl) == (BE_NO_NEIGH, 63)
    assert (p.smac, p.dmac) == (before.smac, before.dmac)  # the kernel fills them on transmit
    assert checksums_valid(out)


# ---- SNAT -------------------------------------------------------------------------------


def test_nodeport_to_remote_backend_is_source_translated_and_replies_are_restored(net: Net, lab: Lab) -> None:
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    net.add_service(NODE, 30080, ((7, REMOTE_BE, 8080, 0),), scope=Scope.EXTERNAL, flags=flags, rev_nat_id=3)
    verdict, out = net.from_net(tcp(CLIENT, NODE, 5555, 30080, smac=MAC[CLIENT], dmac=lab.ext.mac))
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    assert (p.src, p.dst, p.dport) == (NODE, REMOTE_BE, 8080)
    assert SNAT_MIN <= p.sport <= SNAT_MAX
    assert (p.smac, p.dmac) == (lab.ext.mac, MAC[NODE2])  # via node2, the route's gateway
    assert checksums_valid(out)
    snat_port = p.sport

    fwd = net.ct(CLIENT, NODE, 5555, 30080)
    assert fwd is not None
    assert (fwd.flags, fwd.snat_addr, fwd.snat_port) == (CtFlag.SNAT, ip_be(NODE), port_be(snat_port))
    rep = net.ct(REMOTE_BE, NODE, 8080, snat_port, reply=True)
    assert rep is not None
    assert (rep.flags, rep.fe_addr, rep.fe_port) == (CtFlag.SNAT, ip_be(NODE), port_be(30080))
    assert (rep.nat_addr, rep.nat_port) == (ip_be(CLIENT), port_be(5555))

    verdict, out = net.from_net(tcp(REMOTE_BE, NODE, 8080, snat_port, flags="SA", smac=MAC[NODE2]))
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    assert (p.src, p.sport, p.dst, p.dport) == (NODE, 30080, CLIENT, 5555)
    assert p.dmac == MAC[CLIENT]
    assert checksums_valid(out)
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.SNAT], stats[Stat.CT_REPLY]) == (1, 1, 1)


def test_local_backend_keeps_the_client_source(net: Net, lab: Lab) -> None:
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    net.add_service(NODE, 30080, scope=Scope.EXTERNAL, flags=flags)
    verdict, out = net.from_net(tcp(CLIENT, NODE, 5556, 30080))
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    assert (p.src, p.sport, p.dst, p.dport) == (CLIENT, 5556, BE1, 8080)
    assert (p.smac, p.dmac) == (lab.pod.mac, MAC[BE1])
    assert net.stats()[Stat.SNAT] == 0


def test_snat_port_exhaustion_drops(net: Net, dp: Datapath) -> None:
    """One SNAT port, held by an established flow: the next flow to the same backend is refused
    (an unanswered holder would be evicted instead: test_datapath_floods.py)."""
    set_config(dp, snat_port_max=SNAT_MIN)
    net.add_service(
        NODE, 30080, ((7, REMOTE_BE, 8080, 0),), scope=Scope.EXTERNAL, flags=FrontendFlag.SNAT_REMOTE
    )
    assert parse(net.from_net(tcp(CLIENT, NODE, 5557, 30080))[1]).sport == SNAT_MIN
    assert net.from_net(tcp(REMOTE_BE, NODE, 8080, SNAT_MIN, flags="SA"))[0] == TC_ACT_REDIRECT
    assert net.from_net(tcp(CLIENT, NODE, 5557, 30080, flags="A"))[0] == TC_ACT_REDIRECT
    assert net.from_net(tcp("192.168.0.101", NODE, 5557, 30080))[0] == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_SNAT_PORTS] == 1


# ---- drops ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (FrontendFlag.LOCAL, Stat.DROP_NO_LOCAL),  # Local policy, endpoints elsewhere: kube-proxy drops
        (0, Stat.DROP_NO_ENDPOINTS),  # neither flag (the agent never writes it): drop
    ],
)
def test_frontend_without_backends_drops(net: Net, flags: int, reason: Stat) -> None:
    net.add_service(backends=(), flags=flags)
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))[0] == TC_ACT_SHOT
    assert net.stats()[reason] == 1


# ---- reject: services without endpoints ------------------------------------------------------


def assert_port_unreachable(frame: bytes, out: bytes, src: str, dst: str, ihl: int = 20) -> None:
    """`out` is the ICMP port unreachable answering `frame`, from `src` (the frontend) to `dst`."""
    from scapy.layers.l2 import Ether

    e, before = icmp_error(out), Ether(frame)
    assert (e.type, e.code) == (3, 3)
    assert (e.src, e.dst, e.ttl) == (src, dst, 64)
    assert (e.smac, e.dmac) == (before.dst, before.src)  # back where it came from
    assert e.ip_chksum_ok and e.icmp_chksum_ok and e.length_ok
    assert e.quote == frame[14 : 14 + ihl + 8]  # RFC 792: the IP header + 64 bits of data
    assert len(out) == 14 + 20 + 8 + ihl + 8


@pytest.mark.parametrize("flags", ["S", "PA"])
def test_tcp_to_a_service_without_endpoints_gets_port_unreachable(net: Net, lab: Lab, flags: str) -> None:
    """A SYN, or any other segment but a RST; the quote cuts the TCP header after 8 bytes."""
    net.add_service(backends=(), flags=FrontendFlag.NO_ENDPOINTS)
    frame = tcp(
        POD_CLIENT, VIP, 12345, 80, flags=flags, smac=MAC[POD_CLIENT], dmac=lab.pod.mac, payload=b"x" * 100
    )
    verdict, out = net.from_pod(frame)
    assert verdict == TC_ACT_REDIRECT  # bpf_redirect(ingress ifindex): back out to the pod
    assert_port_unreachable(frame, out, VIP, POD_CLIENT)
    assert net.ct(POD_CLIENT, VIP, 12345, 80) is None
    stats = net.stats()
    assert (stats[Stat.DROP_NO_ENDPOINTS], stats[Stat.NEW_FLOWS]) == (1, 0)


@pytest.mark.parametrize("options", [b"", b"\x01" * 4, b"\x01" * 40], ids=["ihl5", "ihl6", "ihl15"])
def test_udp_to_a_service_without_endpoints_gets_port_unreachable(net: Net, lab: Lab, options: bytes) -> None:
    """The quote is the whole IP header, options included (here NOPs), and 8 bytes of UDP."""
    from scapy.layers.inet import IPOption

    net.add_service(port=53, proto=UDP, backends=(), flags=FrontendFlag.NO_ENDPOINTS)
    ip_opts: dict[str, Any] = {"options": [IPOption(options)]} if options else {}
    frame = udp(POD_CLIENT, VIP, 40000, 53, smac=MAC[POD_CLIENT], dmac=lab.pod.mac, tos=0x10, **ip_opts)
    verdict, out = net.from_pod(frame)
    assert verdict == TC_ACT_REDIRECT
    assert_port_unreachable(frame, out, VIP, POD_CLIENT, ihl=20 + len(options))
    assert icmp_error(out).tos == 0xC0 | 0x10  # as icmp_send: internetwork control + the TOS bits
    assert net.stats()[Stat.DROP_NO_ENDPOINTS] == 1


def test_a_frame_to_a_link_layer_group_address_is_not_answered(net: Net, lab: Lab) -> None:
    """As icmp_send ("no replies to physical multicast/broadcast": skb->pkt_type): a datagram to
    a frontend without endpoints in a frame to Ethernet broadcast or to a multicast address is
    dropped under DROP_NO_ENDPOINTS, unanswered; the same datagram to the device's own address is
    answered."""
    net.add_service(port=53, proto=UDP, backends=(), flags=FrontendFlag.NO_ENDPOINTS)
    for dmac in ("ff:ff:ff:ff:ff:ff", "01:00:5e:00:00:01"):
        frame = udp(POD_CLIENT, VIP, 40001, 53, smac=MAC[POD_CLIENT], dmac=dmac)
        assert net.from_pod(frame)[0] == TC_ACT_SHOT, dmac
    frame = udp(POD_CLIENT, VIP, 40001, 53, smac=MAC[POD_CLIENT], dmac=lab.pod.mac)
    assert net.from_pod(frame)[0] == TC_ACT_REDIRECT
    stats = net.stats()
    assert (stats[Stat.DROP_NO_ENDPOINTS], stats[Stat.DROP_ICMP_RATE]) == (3, 0)


def test_nodeport_without_endpoints_answers_from_the_node_address(net: Net, lab: Lab) -> None:
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE | FrontendFlag.NO_ENDPOINTS
    net.add_service(NODE, 30080, (), scope=Scope.EXTERNAL, flags=flags)
    frame = tcp(CLIENT, NODE, 5555, 30080, smac=MAC[CLIENT], dmac=lab.ext.mac)
    verdict, out = net.from_net(frame)
    assert verdict == TC_ACT_REDIRECT
    assert_port_unreachable(frame, out, NODE, CLIENT)


def test_rejects_carry_fresh_ip_ids(net: Net) -> None:
    net.add_service(backends=(), flags=FrontendFlag.NO_ENDPOINTS)
    ids = {icmp_error(net.from_pod(tcp(POD_CLIENT, VIP, 20000 + i, 80, id=7))[1]).ip_id for i in range(8)}
    assert len(ids) > 1  # random 16-bit ids: 8 equal ones have probability 2^-112


def test_what_is_not_answered(net: Net) -> None:
    """No ICMP for an ICMP, a TCP RST or a source that is not a unicast host (dropped). (A
    Local-only frontend drops: test_frontend_without_backends_drops; a first fragment is answered
    like a whole datagram: test_datapath_fragments.py.)"""
    from scapy.layers.inet import ICMP, IP
    from scapy.layers.l2 import Ether

    net.add_service(backends=(), flags=FrontendFlag.NO_ENDPOINTS)
    net.add_service(port=53, proto=UDP, backends=(), flags=FrontendFlag.NO_ENDPOINTS)
    icmp = bytes(Ether() / IP(src=POD_CLIENT, dst=VIP) / ICMP())
    quoted = IP(src=VIP, dst=POD_CLIENT)
    unreach = bytes(Ether() / IP(src=POD_CLIENT, dst=VIP) / ICMP(type=3, code=3) / quoted)
    for frame in (icmp, unreach):
        assert net.from_pod(frame) == (TC_ACT_OK, frame)  # not parsed: the stack's business
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="R"))[0] == TC_ACT_SHOT
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="RA"))[0] == TC_ACT_SHOT
    for src in ("0.0.0.0", "127.0.0.1", "224.0.0.1", "255.255.255.255"):
        assert net.from_pod(udp(src, VIP, 40000, 53))[0] == TC_ACT_SHOT
    stats = net.stats()
    assert (stats[Stat.PASS], stats[Stat.DROP_NO_ENDPOINTS]) == (2, 6)


def test_source_ranges(net: Net) -> None:
    net.add_service(NODE, 30080, scope=Scope.EXTERNAL, flags=FrontendFlag.SOURCE_RANGES, rev_nat_id=9)
    allow = abi.SrcRangeKey(prefixlen=32 + 24, rev_nat_id=9, addr=ip_be("192.168.0.0"))
    net.dp.maps["srcr"].update(allow, abi.SrcRange(1))
    assert net.from_net(tcp(CLIENT, NODE, 5558, 30080))[0] == TC_ACT_REDIRECT
    assert net.from_net(tcp("172.16.0.1", NODE, 5558, 30080))[0] == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_SOURCE_RANGE] == 1


def test_missing_slot_or_backend_drops(net: Net) -> None:
    net.add_service(slots=False)  # backend 1 written, slot 1 not
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))[0] == TC_ACT_SHOT
    net.dp.maps["slot"].update(abi.SlotKey(1, 1), abi.Slot(99))  # a slot to a missing backend
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12346, 80))[0] == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_NO_BACKEND] == 2


def test_a_flow_outlives_its_service_being_deleted_and_created_again(net: Net) -> None:
    """Replies need no service map (the REPLY entry holds the frontend): a TCP stream through a
    Service that is deleted, and created again with other ids, keeps going both ways, as with
    kube-proxy (its conntrack entries outlive the rules)."""
    net.add_service(rev_nat_id=4, svc_id=4, set_id=4)
    open_service_flow(net, 12345)
    for role in ("fe", "slot", "member", "rnat"):
        net.dp.maps[role].clear()
    assert parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, 12345, flags="PA"))[1]).src == VIP
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="PA"))[1]).dst == BE1
    net.add_service(rev_nat_id=9, svc_id=9, set_id=9)
    assert parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, 12345, flags="PA"))[1]).src == VIP
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="PA"))[1]).dst == BE1
    stats = net.stats()
    assert (stats[Stat.CT_REPLY], stats[Stat.CT_FORWARD], stats[Stat.NEW_FLOWS]) == (3, 3, 1)


def test_backend_without_route_drops(net: Net) -> None:
    net.add_service(backends=((1, "10.99.0.5", 8080, 0),))  # no default route in the lab
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))[0] == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_FIB] == 1


def test_malformed_headers_drop(net: Net) -> None:
    from scapy.layers.inet import IP
    from scapy.layers.inet import TCP as ScapyTCP
    from scapy.layers.l2 import Ether

    bad_ihl = bytes(Ether() / IP(src=POD_CLIENT, dst=VIP, ihl=4) / ScapyTCP(dport=80))
    truncated = tcp(POD_CLIENT, VIP, 12345, 80)[: 14 + 20 + 10]
    for frame in (bad_ihl, truncated):
        assert net.from_pod(frame)[0] == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_MALFORMED] == 2


# ---- affinity, expiry, closing ------------------------------------------------------------


def test_affinity_keeps_the_backend_across_new_flows(net: Net) -> None:
    backends = tuple((i, addr, 8080, BackendFlag.LOCAL) for i, addr in enumerate((BE1, BE2, BE3, BE4), 1))
    net.add_service(backends=backends, flags=FrontendFlag.AFFINITY, affinity_timeout=10800)
    chosen = {parse(net.from_pod(tcp(POD_CLIENT, VIP, 31000 + i, 80))[1]).dst for i in range(8)}
    assert len(chosen) == 1
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.AFFINITY_HIT]) == (8, 7)
    entry = net.dp.maps["aff"].lookup(abi.AffinityKey(ip_be(POD_CLIENT), 1))
    assert isinstance(entry, abi.Affinity)
    assert entry.backend_id == next(b[0] for b in backends if b[1] in chosen)


def test_expired_affinity_chooses_again(net: Net) -> None:
    net.add_service(flags=FrontendFlag.AFFINITY, affinity_timeout=10)
    net.dp.maps["aff"].update(
        abi.AffinityKey(ip_be(POD_CLIENT), 1), abi.Affinity(last_seen_ns=1, backend_id=1)
    )
    assert net.from_pod(tcp(POD_CLIENT, VIP, 31100, 80))[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.AFFINITY_HIT] == 0
    entry = net.dp.maps["aff"].lookup(abi.AffinityKey(ip_be(POD_CLIENT), 1))
    assert isinstance(entry, abi.Affinity) and entry.last_seen_ns > 1


def test_expired_conntrack_entry_starts_a_new_flow_only_with_a_syn(net: Net, dp: Datapath) -> None:
    """An expired flow is gone: its next segment is dropped (NO_FLOW), never sent to a newly
    chosen backend; a SYN on the tuple starts a new flow."""
    set_config(dp, tcp_established_s=5)  # the machine may be up < 1 h
    net.add_service()
    open_service_flow(net, 12345)
    old = net.ct(POD_CLIENT, VIP, 12345, 80)
    assert old is not None and old.flags & CtFlag.ESTABLISHED
    old.last_seen_ns = time.monotonic_ns() - 6 * 10**9  # bpf_ktime_get_ns is CLOCK_MONOTONIC
    net.ct_put(POD_CLIENT, VIP, 12345, 80, old)
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="A"))[0] == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_NO_FLOW] == 1
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="S"))[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.NEW_FLOWS] == 2


def test_fin_marks_both_entries_and_a_new_syn_reopens_the_tuple(net: Net) -> None:
    net.add_service()
    open_service_flow(net, 12345)
    net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="FA"))
    fwd = net.ct(POD_CLIENT, VIP, 12345, 80)
    rep = net.ct(BE1, POD_CLIENT, 8080, 12345, reply=True)
    assert fwd is not None and rep is not None
    assert fwd.flags == rep.flags == CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED | CtFlag.FIN_FWD
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="A"))[0] == TC_ACT_REDIRECT  # still the flow
    assert net.stats()[Stat.CT_FORWARD] == 3
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="S"))[0] == TC_ACT_REDIRECT
    fwd = net.ct(POD_CLIENT, VIP, 12345, 80)
    assert fwd is not None and fwd.flags == 0
    assert net.stats()[Stat.NEW_FLOWS] == 2


@pytest.mark.parametrize("same_backend", [True, False])
def test_new_flow_on_a_closing_tuple_rewrites_both_entries(net: Net, same_backend: bool) -> None:
    """Port reuse: the new flow's entries replace the closing ones (rewritten in place when they
    translate the same way, replaced otherwise); the other backend's REPLY entry is left to time out."""
    net.add_service(backends=((1, BE1, 8080, BackendFlag.LOCAL), (2, BE2, 8080, BackendFlag.LOCAL)))
    first = parse(net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))[1]).dst
    for _ in range(64):
        assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="FA"))[0] == TC_ACT_REDIRECT
        old_fwd = net.ct(POD_CLIENT, VIP, 12345, 80)
        assert old_fwd is not None and old_fwd.flags == CtFlag.FIN_FWD
        net.from_pod(tcp(BE1 if first == BE1 else BE2, POD_CLIENT, 8080, 12345, flags="FA"))
        again = parse(net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))[1]).dst
        if (again == first) == same_backend:
            break
        first = again
    else:
        pytest.fail("64 random backend choices all went the other way")
    fwd = net.ct(POD_CLIENT, VIP, 12345, 80)
    rep = net.ct(again, POD_CLIENT, 8080, 12345, reply=True)
    assert fwd is not None and rep is not None
    assert (fwd.flags, rep.flags) == (0, 0)
    assert fwd.last_seen_ns > old_fwd.last_seen_ns and rep.last_seen_ns >= fwd.last_seen_ns - 10**9
    backend_id = 1 if again == BE1 else 2
    assert (fwd.nat_addr, fwd.backend_id, rep.backend_id) == (ip_be(again), backend_id, backend_id)
    assert parse(net.from_pod(tcp(again, POD_CLIENT, 8080, 12345, flags="SA"))[1]).src == VIP


def test_closed_flow_expires_after_the_closed_timeout(net: Net) -> None:
    net.add_service()
    open_service_flow(net, 12345)
    net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="R"))
    fwd = net.ct(POD_CLIENT, VIP, 12345, 80)
    assert fwd is not None and fwd.flags & CtFlag.RST
    fwd.last_seen_ns = time.monotonic_ns() - 9 * 10**9  # tcp_closed_s is 10
    net.ct_put(POD_CLIENT, VIP, 12345, 80, fwd)
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="A"))[0] == TC_ACT_REDIRECT
    fwd.last_seen_ns = time.monotonic_ns() - 11 * 10**9
    net.ct_put(POD_CLIENT, VIP, 12345, 80, fwd)
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="A"))[0] == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_NO_FLOW] == 1


# ---- hairpin, removed backends -------------------------------------------------------------


def test_hairpin_is_source_translated_to_the_node(net: Net, lab: Lab) -> None:
    """A pod reaching itself through its service gets the packet from the node, not from itself."""
    net.add_service(backends=((1, POD_CLIENT, 8080, BackendFlag.LOCAL),))
    verdict, out = net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    assert (p.src, p.dst, p.dport) == (NODE, POD_CLIENT, 8080)
    assert (p.dmac, checksums_valid(out)) == (MAC[POD_CLIENT], True)
    verdict, out = net.from_pod(tcp(POD_CLIENT, NODE, 8080, p.sport, flags="SA"))
    assert verdict == TC_ACT_REDIRECT
    back = parse(out)
    assert (back.src, back.sport, back.dst, back.dport) == (VIP, 80, POD_CLIENT, 12345)
    assert net.stats()[Stat.SNAT] == 1


def test_udp_flow_moves_when_its_backend_leaves_the_service(net: Net) -> None:
    """kube-proxy clears a removed UDP endpoint's conntrack entries: same tuple, new backend. The
    backend id stays in ekp_be (another service still uses it): membership decides."""
    net.add_service(port=53, backends=((1, BE1, 53, BackendFlag.LOCAL),), proto=UDP)
    assert parse(net.from_pod(udp(POD_CLIENT, VIP, 5353, 53))[1]).dst == BE1
    net.add_service(port=53, backends=((2, BE2, 53, BackendFlag.LOCAL),), proto=UDP)
    net.remove_member(1, 1)
    assert parse(net.from_pod(udp(POD_CLIENT, VIP, 5353, 53))[1]).dst == BE2
    assert net.stats()[Stat.NEW_FLOWS] == 2


def age(
    net: Net, saddr: str, daddr: str, sport: int, dport: int, seconds: float, *, reply: bool = False
) -> None:
    """Moves an entry's last packet `seconds` into the past (its next hit refreshes it)."""
    entry = net.ct(saddr, daddr, sport, dport, reply=reply)
    assert entry is not None
    entry.last_seen_ns = time.monotonic_ns() - int(seconds * 10**9)
    net.ct_put(saddr, daddr, sport, dport, entry, reply=reply)


def test_tcp_flow_keeps_its_backend_when_it_leaves_the_service(net: Net) -> None:
    """A terminating endpoint finishes its TCP connections, as with kube-proxy: membership is not
    checked for TCP while the backend is still on the node."""
    net.add_service(backends=((1, BE1, 8080, BackendFlag.LOCAL),))
    open_service_flow(net, 12345)
    net.add_service(backends=((2, BE2, 8080, BackendFlag.LOCAL),))
    net.remove_member(1, 1)
    age(net, POD_CLIENT, VIP, 12345, 80, 2)  # the hit refreshes the entry and checks the backend
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="A"))[1]).dst == BE1
    assert net.stats()[Stat.CT_FORWARD] == 2


def test_tcp_flow_keeps_its_backend_when_its_service_is_deleted_and_recreated(net: Net) -> None:
    """Every entry of the Service goes (frontend, slots, member, backend, rev-NAT) and comes back
    with other ids: the established flow keeps its backend and its replies their frontend, as
    kube-proxy's DNAT in nf_conntrack does; checked across the once-a-second refresh."""
    net.add_service(backends=((1, BE1, 8080, BackendFlag.LOCAL),))
    open_service_flow(net, 12345)
    for role in ("fe", "slot", "member", "be", "rnat"):
        for key, _ in list(net.dp.maps[role].items()):
            net.dp.maps[role].delete(key)
    age(net, POD_CLIENT, VIP, 12345, 80, 2)  # the next hit refreshes the entry
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="A"))[1]).dst == BE1
    net.add_service(backends=((7, BE1, 8080, BackendFlag.LOCAL),), set_id=5, svc_id=5, rev_nat_id=5)
    age(net, POD_CLIENT, VIP, 12345, 80, 2)
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="A"))[1]).dst == BE1
    back = parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, 12345, flags="A"))[1])
    assert (back.src, back.sport) == (VIP, 80)
    stats = net.stats()
    assert stats[Stat.NEW_FLOWS] == 1 and stats[Stat.DROP_BACKEND_GONE] == 0


# ---- a direct connection from the port of an ended service flow ----------------------------


def open_service_flow(net: Net, port: int) -> None:
    """POD_CLIENT:port -> VIP:80 -> BE1:8080, handshake done: both conntrack entries written."""
    assert net.from_pod(tcp(POD_CLIENT, VIP, port, 80))[0] == TC_ACT_REDIRECT
    assert parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, port, flags="SA"))[1]).src == VIP
    assert net.from_pod(tcp(POD_CLIENT, VIP, port, 80, flags="A"))[0] == TC_ACT_REDIRECT


ENDINGS = {
    # the packets that ended the service flow, each (from the client?, TCP flags)
    "client-rst": [(True, "R")],  # bench/probe.py's abortive close
    "client-fin-first": [(True, "FA"), (False, "FA"), (True, "A")],
    "backend-fin-first": [(False, "FA"), (True, "FA"), (False, "A")],
    "backend-rst": [(False, "R")],
    "client-fin-only": [(True, "FA")],  # half closed
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_direct_connection_from_an_ended_flows_port_is_answered_untranslated(net: Net, ending: str) -> None:
    """The bench's sequence: a ClusterIP connection from client port P to VIP:80 (DNAT to BE1:8080)
    ends; then the client connects from P straight to BE1:8080. The SYN clears the ended flow's
    pair, so the backend's SYN-ACK reaches the client as it was sent, not rewritten to VIP:80."""
    net.add_service()
    open_service_flow(net, 12345)
    for from_client, flags in ENDINGS[ending]:
        frame = (
            tcp(POD_CLIENT, VIP, 12345, 80, flags=flags)
            if from_client
            else tcp(BE1, POD_CLIENT, 8080, 12345, flags=flags)
        )
        assert net.from_pod(frame)[0] == TC_ACT_REDIRECT
    assert net.ct(BE1, POD_CLIENT, 8080, 12345, reply=True) is not None

    syn = tcp(POD_CLIENT, BE1, 12345, 8080)
    assert net.from_pod(syn) == (TC_ACT_OK, syn)
    assert net.ct(BE1, POD_CLIENT, 8080, 12345, reply=True) is None
    assert net.ct(POD_CLIENT, VIP, 12345, 80) is None
    for flags in ("SA", "A", "PA", "FA"):
        reply = tcp(BE1, POD_CLIENT, 8080, 12345, flags=flags)
        assert net.from_pod(reply) == (TC_ACT_OK, reply), flags
        forward = tcp(POD_CLIENT, BE1, 12345, 8080, flags="A" if flags == "SA" else flags)
        assert net.from_pod(forward) == (TC_ACT_OK, forward), flags

    # and the ClusterIP works again from the same port afterwards (a new flow)
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))[1]).dst == BE1
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.PASS]) == (2, 9)


def test_syn_ack_on_a_closing_reply_entry_passes_untranslated_and_does_not_refresh_it(net: Net) -> None:
    """Even without the SYN that clears it (the client's SYN took another path), a SYN-ACK is never
    part of a closing flow: it passes as it is and leaves the entry to its closing timeout."""
    net.add_service()
    open_service_flow(net, 12346)
    assert net.from_pod(tcp(BE1, POD_CLIENT, 8080, 12346, flags="FA"))[0] == TC_ACT_REDIRECT
    rep = net.ct(BE1, POD_CLIENT, 8080, 12346, reply=True)
    assert rep is not None and rep.flags & CtFlag.FIN_REPLY
    rep.last_seen_ns = time.monotonic_ns() - 5 * 10**9
    net.ct_put(BE1, POD_CLIENT, 8080, 12346, rep, reply=True)
    for _ in range(3):  # retransmitted SYN-ACKs
        frame = tcp(BE1, POD_CLIENT, 8080, 12346, flags="SA")
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    after = net.ct(BE1, POD_CLIENT, 8080, 12346, reply=True)
    assert after is not None and after.last_seen_ns == rep.last_seen_ns
    # the flow's own closing packets still go through it
    assert parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, 12346, flags="A"))[1]).src == VIP


def test_direct_syn_from_the_port_of_a_live_service_flow_gets_another_port(net: Net) -> None:
    """Neither direction closed: the backend holds a connection on this very 4-tuple, which the
    direct one cannot share. As nf_conntrack's NAT does, the newcomer keeps its addresses and
    gets another source port; both connections work, neither sees the other's packets."""
    net.add_service()
    open_service_flow(net, 12347)
    verdict, out = net.from_pod(tcp(POD_CLIENT, BE1, 12347, 8080))
    assert verdict == TC_ACT_REDIRECT
    moved = parse(out)
    assert (moved.src, moved.dst, moved.dport) == (POD_CLIENT, BE1, 8080)
    assert moved.sport != 12347 and SNAT_MIN <= moved.sport <= SNAT_MAX
    assert checksums_valid(out)
    # the live service flow is untouched
    assert parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, 12347, flags="PA"))[1]).src == VIP
    # the direct connection's answer comes back to its own port, from the backend itself
    back = parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, moved.sport, flags="SA"))[1])
    assert (back.src, back.sport, back.dst, back.dport) == (BE1, 8080, POD_CLIENT, 12347)
    again = parse(net.from_pod(tcp(POD_CLIENT, BE1, 12347, 8080, flags="A"))[1])
    assert again.sport == moved.sport
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.PORT_REMAP]) == (2, 1)


@pytest.mark.parametrize("why", ["forward-taken", "reply-expired"])
def test_direct_syn_clears_an_orphaned_or_expired_reply_entry(net: Net, dp: Datapath, why: str) -> None:
    backends = ((1, BE1, 8080, BackendFlag.LOCAL), (2, BE2, 8080, BackendFlag.LOCAL))
    net.add_service(backends=backends)
    port = 12348
    while parse(net.from_pod(tcp(POD_CLIENT, VIP, port, 80))[1]).dst != BE1:  # the choice is random
        port += 1
    if why == "forward-taken":  # the FORWARD key now belongs to a flow to BE2
        fwd = net.ct(POD_CLIENT, VIP, port, 80)
        assert fwd is not None
        fwd.nat_addr, fwd.backend_id = ip_be(BE2), 2
        net.ct_put(POD_CLIENT, VIP, port, 80, fwd)
    else:
        set_config(dp, tcp_syn_s=5)  # the machine may be up < 1 h
        rep = net.ct(BE1, POD_CLIENT, 8080, port, reply=True)
        assert rep is not None
        rep.last_seen_ns = time.monotonic_ns() - 6 * 10**9
        net.ct_put(BE1, POD_CLIENT, 8080, port, rep, reply=True)
    syn = tcp(POD_CLIENT, BE1, port, 8080)
    assert net.from_pod(syn) == (TC_ACT_OK, syn)
    assert net.ct(BE1, POD_CLIENT, 8080, port, reply=True) is None
    fwd_left = net.ct(POD_CLIENT, VIP, port, 80)
    if why == "forward-taken":
        assert fwd_left is not None and fwd_left.nat_addr == ip_be(BE2)  # not ours to delete
    else:
        assert fwd_left is None
    reply = tcp(BE1, POD_CLIENT, 8080, port, flags="SA")
    assert net.from_pod(reply) == (TC_ACT_OK, reply)


def test_direct_syn_clears_an_ended_source_translated_flow(net: Net, lab: Lab) -> None:
    """The same for a NodePort flow to a remote backend: its REPLY entry is keyed by the node's
    address and SNAT port, and its FORWARD twin is found through the entry's client address."""
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    net.add_service(NODE, 30080, ((7, REMOTE_BE, 8080, 0),), scope=Scope.EXTERNAL, flags=flags, rev_nat_id=3)
    out = net.from_net(tcp(CLIENT, NODE, 5555, 30080))[1]
    snat_port = parse(out).sport
    assert net.from_net(tcp(CLIENT, NODE, 5555, 30080, flags="R"))[0] == TC_ACT_REDIRECT
    syn = tcp(NODE, REMOTE_BE, snat_port, 8080)  # as if from the node's SNAT port (test only)
    assert net.from_net(syn) == (TC_ACT_OK, syn)
    assert net.ct(REMOTE_BE, NODE, 8080, snat_port, reply=True) is None
    assert net.ct(CLIENT, NODE, 5555, 30080) is None


# ---- a direct UDP datagram from the port of a service flow ----------------------------------


def udp_service_flow(net: Net, port: int, *, answered: bool) -> None:
    """POD_CLIENT:port -> VIP:53 -> BE1:5353, answered by the backend or not."""
    assert parse(net.from_pod(udp(POD_CLIENT, VIP, port, 53))[1]).dst == BE1
    if answered:
        assert parse(net.from_pod(udp(BE1, POD_CLIENT, 5353, port))[1]).src == VIP


@pytest.mark.parametrize("answered", [True, False], ids=["answered", "unanswered"])
def test_direct_udp_datagram_from_the_port_of_a_live_service_flow_gets_another_port(
    net: Net, answered: bool
) -> None:
    """UDP has no handshake: a flow holds its reply tuple until its timeout, answered or not, as
    nf_conntrack's entry does (nf_nat takes a tuple in use over only for a TCP SYN on a closing
    flow). A datagram straight to the backend from that port (a ClusterIP another node translated
    to the same backend) keeps its addresses and gets another source port, as the TCP SYN does;
    each flow's answers come back to the client's port from the address it asked."""
    net.add_service(port=53, backends=((1, BE1, 5353, BackendFlag.LOCAL),), proto=UDP)
    udp_service_flow(net, 12400, answered=answered)
    verdict, out = net.from_pod(udp(POD_CLIENT, BE1, 12400, 5353, payload=b"direct"))
    moved = parse(out)
    assert verdict == TC_ACT_REDIRECT and checksums_valid(out)
    assert (moved.src, moved.dst, moved.dport) == (POD_CLIENT, BE1, 5353)
    assert moved.sport != 12400 and SNAT_MIN <= moved.sport <= SNAT_MAX
    back = parse(net.from_pod(udp(BE1, POD_CLIENT, 5353, moved.sport))[1])
    assert (back.src, back.sport, back.dst, back.dport) == (BE1, 5353, POD_CLIENT, 12400)
    again = parse(net.from_pod(udp(POD_CLIENT, BE1, 12400, 5353))[1])
    assert (again.sport, again.dport) == (moved.sport, 5353)  # one flow: the port it was given
    # the older flow is untouched, both ways
    assert parse(net.from_pod(udp(BE1, POD_CLIENT, 5353, 12400))[1]).src == VIP
    fwd = parse(net.from_pod(udp(POD_CLIENT, VIP, 12400, 53))[1])
    assert (fwd.sport, fwd.dst, fwd.dport) == (12400, BE1, 5353)
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.PORT_REMAP]) == (2, 1)


def test_direct_udp_datagram_clears_an_expired_service_flow(net: Net) -> None:
    """Past its timeout (30 s unanswered) the flow holds nothing: its entries go, and the
    datagram and its answer pass as they are, the client's own port kept."""
    net.add_service(port=53, backends=((1, BE1, 5353, BackendFlag.LOCAL),), proto=UDP)
    udp_service_flow(net, 12401, answered=False)
    entry = net.ct(BE1, POD_CLIENT, 5353, 12401, UDP, reply=True)
    assert entry is not None
    entry.last_seen_ns = time.monotonic_ns() - 31 * 10**9
    net.ct_put(BE1, POD_CLIENT, 5353, 12401, entry, UDP, reply=True)
    direct = udp(POD_CLIENT, BE1, 12401, 5353)
    assert net.from_pod(direct) == (TC_ACT_OK, direct)
    assert net.ct(BE1, POD_CLIENT, 5353, 12401, UDP, reply=True) is None
    assert net.ct(POD_CLIENT, VIP, 12401, 53, UDP) is None
    answer = udp(BE1, POD_CLIENT, 5353, 12401)
    assert net.from_pod(answer) == (TC_ACT_OK, answer)
    assert net.stats()[Stat.PORT_REMAP] == 0


@pytest.mark.parametrize("proto", [TCP, UDP])
def test_a_live_flow_whose_forward_entry_was_evicted_keeps_its_tuple(net: Net, proto: int) -> None:
    """The LRU evicted the FORWARD entry of a live flow through the ClusterIP; its REPLY entry still
    answers for it (the next packet rebuilds the twin). A direct SYN or datagram on that reply tuple
    moves to another port, as for any live flow: clearing the entry would leave the older flow's
    answers untranslated, lost to a client that dialled the ClusterIP."""

    def frame(src: str, dst: str, sport: int, dport: int, flags: str = "S") -> bytes:
        return tcp(src, dst, sport, dport, flags=flags) if proto == TCP else udp(src, dst, sport, dport)

    net.add_service(port=53, backends=((1, BE1, 5353, BackendFlag.LOCAL),), proto=proto)
    assert parse(net.from_pod(frame(POD_CLIENT, VIP, 12402, 53))[1]).dst == BE1
    assert net.ct_del(POD_CLIENT, VIP, 12402, 53, proto)
    verdict, out = net.from_pod(frame(POD_CLIENT, BE1, 12402, 5353))
    moved = parse(out)
    assert verdict == TC_ACT_REDIRECT and moved.dst == BE1 and moved.sport != 12402
    answer = net.from_pod(frame(BE1, POD_CLIENT, 5353, 12402, flags="SA"))[1]
    assert parse(answer).src == VIP  # the older flow still answers from the ClusterIP
    assert net.stats()[Stat.PORT_REMAP] == 1
