"""IPv4 fragments of translated flows, packet by packet (BPF_PROG_TEST_RUN).

A 4,000-byte UDP datagram (DNS with EDNS0, NFS) leaves its sender as three fragments; only the
first carries the ports. Every fragment of a translated datagram must be translated, in both
directions, so that the receiver reassembles a datagram whose addresses, ports and L4 checksum
are right. Checked here by reassembling what the programs emit, as the receiver's stack would.

Fragments that come before their first: passed untouched when no translated flow can use their
addresses, else held and put back into the device's ingress when the first comes (caught there
with an AF_PACKET socket, then run through the program again as the kernel would).
"""

from __future__ import annotations

import ctypes

import pytest

from agent.ebpf.abi import BackendFlag, FrontendFlag, Scope, Stat
from lab.dplab import (
    BE2,
    CLIENT,
    MAC,
    NODE,
    NODE2,
    POD_CLIENT,
    REMOTE_BE,
    SNAT_MAX,
    SNAT_MIN,
    UDP,
    VIP,
    Lab,
    Net,
)
from lab.packets import (
    TC_ACT_OK,
    TC_ACT_REDIRECT,
    TC_ACT_SHOT,
    Capture,
    fragments,
    icmp_error,
    parse,
    reassemble,
    udp,
)

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

BIG = bytes(range(256)) * 15 + b"end of a 4,000-byte datagram"  # 3,868 bytes of UDP payload


def run(net: Net, frames: list[bytes], *, external: bool = False) -> list[bytes]:
    """Every frame through the program; each must be redirected. The frames as they left."""
    out = []
    for frame in frames:
        verdict, sent = net.from_net(frame) if external else net.from_pod(frame)
        assert verdict == TC_ACT_REDIRECT
        out.append(sent)
    return out


def dns_service(net: Net) -> None:
    net.add_service(port=53, backends=((2, BE2, 5353, BackendFlag.LOCAL),), proto=UDP)


def test_every_fragment_of_a_clusterip_datagram_is_translated_both_ways(net: Net) -> None:
    dns_service(net)
    query = fragments(POD_CLIENT, VIP, 40001, 53, BIG, ip_id=1001)
    assert len(query) == 3
    got = reassemble(run(net, query))
    assert (got.src, got.dst, got.ports) == (POD_CLIENT, BE2, (40001, 5353))
    assert got.headers_ok and got.l4_checksum_ok()
    assert got.l4[8:] == BIG

    answer = fragments(BE2, POD_CLIENT, 5353, 40001, BIG[::-1], ip_id=2002)
    back = reassemble(run(net, answer))
    assert (back.src, back.dst, back.ports) == (VIP, POD_CLIENT, (53, 40001))
    assert back.headers_ok and back.l4_checksum_ok()
    assert back.l4[8:] == BIG[::-1]
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY]) == (1, 2, 3)
    assert stats[Stat.FRAGMENTS] == 4  # the later fragments, two each way


def test_a_direct_datagram_on_a_live_flows_tuple_moves_its_port_in_its_first_fragment(net: Net) -> None:
    """A datagram straight to the backend from the port a live ClusterIP flow holds (bpf/ekp_ct.h,
    ekp_ct_reclaim) that comes in three fragments: the first gets another source port and leaves
    the flow's entry, the later ones follow it, and the datagram put back together checks; the
    backend's fragmented answer to the moved port comes back to the client's own."""
    dns_service(net)
    assert parse(net.from_pod(udp(POD_CLIENT, VIP, 40003, 53))[1]).dst == BE2
    got = reassemble(run(net, fragments(POD_CLIENT, BE2, 40003, 5353, BIG, ip_id=1003)))
    moved = got.ports[0]
    assert (got.src, got.dst, got.ports[1]) == (POD_CLIENT, BE2, 5353) and SNAT_MIN <= moved <= SNAT_MAX
    assert got.headers_ok and got.l4_checksum_ok() and got.l4[8:] == BIG
    back = reassemble(run(net, fragments(BE2, POD_CLIENT, 5353, moved, BIG[::-1], ip_id=2003)))
    assert (back.src, back.dst, back.ports) == (BE2, POD_CLIENT, (5353, 40003))
    assert back.headers_ok and back.l4_checksum_ok() and back.l4[8:] == BIG[::-1]
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.PORT_REMAP], stats[Stat.FRAGMENTS]) == (2, 1, 4)


def test_nodeport_datagram_to_a_remote_backend_is_source_translated_in_every_fragment(net: Net) -> None:
    """The external client's datagram: every fragment leaves from the node (SNAT), the first with
    the SNAT port; the remote backend's answer comes back to the node and goes on to the client."""
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL
    net.add_service(NODE, 30053, ((7, REMOTE_BE, 5353, 0),), proto=UDP, scope=Scope.EXTERNAL, flags=flags)
    sent = run(net, fragments(CLIENT, NODE, 7777, 30053, BIG, ip_id=3003, smac=MAC[CLIENT]), external=True)
    assert {parse_ip(f) for f in sent} == {(NODE, REMOTE_BE)}
    assert {frame_dmac(f) for f in sent} == {MAC[NODE2]}  # routed via node2
    got = reassemble(sent)
    snat_port, backend_port = got.ports
    assert SNAT_MIN <= snat_port <= SNAT_MAX and backend_port == 5353
    assert got.l4_checksum_ok() and got.l4[8:] == BIG

    answer = fragments(REMOTE_BE, NODE, 5353, snat_port, BIG[:3000], ip_id=4004, smac=MAC[NODE2])
    back = reassemble(run(net, answer, external=True))
    assert (back.src, back.dst, back.ports) == (NODE, CLIENT, (30053, 7777))
    assert back.headers_ok and back.l4_checksum_ok() and back.l4[8:] == BIG[:3000]


def parse_ip(frame: bytes) -> tuple[str, str]:
    from scapy.layers.inet import IP
    from scapy.layers.l2 import Ether

    ip = Ether(frame)[IP]
    return ip.src, ip.dst


def frame_dmac(frame: bytes) -> str:
    from scapy.layers.l2 import Ether

    return str(Ether(frame).dst)


def frag_id(frame: bytes) -> int:
    """The IPv4 identification of a frame (0 for anything that is not IPv4)."""
    if frame[12:14] != b"\x08\x00":
        return 0
    return int.from_bytes(frame[18:20], "big")


def test_a_reversed_clusterip_datagram_is_held_then_translated_whole(net: Net, lab: Lab) -> None:
    """Last fragment first, then the middle one, then the first: the two come before anything says
    which flow they belong to, to a frontend address (ekp_addr), so they are held; the first
    starts the flow and puts them back into the pod device's ingress, where they run through the
    program again as ordinary later fragments. The backend gets the datagram whole."""
    dns_service(net)
    first, middle, last = fragments(POD_CLIENT, VIP, 40002, 53, BIG, ip_id=5005)
    with Capture(lab.pod.name) as cap:
        assert net.from_pod(last)[0] == TC_ACT_SHOT
        assert net.from_pod(middle)[0] == TC_ACT_SHOT
        assert net.stats()[Stat.FRAG_HELD] == 2
        assert len(net.dp.maps["fraghold"].items()) == 2
        verdict, first_out = net.from_pod(first)
        assert verdict == TC_ACT_REDIRECT
        back = cap.frames(2, lambda f: frag_id(f) == 5005)
    assert sorted(back) == sorted([last, middle])  # put back as they came, for the next pass
    assert net.dp.maps["fraghold"].items() == []
    got = reassemble([first_out, *run(net, back)])
    assert (got.src, got.dst, got.ports) == (POD_CLIENT, BE2, (40002, 5353))
    assert got.headers_ok and got.l4_checksum_ok() and got.l4[8:] == BIG
    stats = net.stats()
    assert (stats[Stat.FRAG_RELEASED], stats[Stat.FRAGMENTS], stats[Stat.DROP_FRAG_NO_FIRST]) == (2, 2, 0)
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_FORWARD]) == (1, 2)


def test_first_fragments_look_for_held_ones_only_within_the_reassembly_time(net: Net) -> None:
    """A fragment held more than 30 s ago (net.ipv4.ipfrag_time: the receiver would have given the
    datagram up) is not looked for: in-order fragments pay no lookup on a node that holds none."""
    dns_service(net)
    first, _middle, last = fragments(POD_CLIENT, VIP, 40013, 53, BIG, ip_id=9191)
    assert net.from_pod(last)[0] == TC_ACT_SHOT
    held_at = net.dp.maps["fraglast"].lookup(ctypes.c_uint32(0))
    assert isinstance(held_at, ctypes.c_uint64) and held_at.value > 0
    net.dp.maps["fraglast"].update(ctypes.c_uint32(0), ctypes.c_uint64(held_at.value - 31 * 10**9))
    assert net.from_pod(first)[0] == TC_ACT_REDIRECT
    stats = net.stats()
    assert (stats[Stat.FRAG_HELD], stats[Stat.FRAG_RELEASED]) == (1, 0)
    assert len(net.dp.maps["fraghold"].items()) == 1  # left to the LRU


def test_a_reversed_reply_from_a_backend_is_held_then_translated(net: Net, lab: Lab) -> None:
    """The answer's fragments reordered on the way back: from a backend address (ekp_addr), so
    held, then translated from the frontend once the first one came."""
    dns_service(net)
    run(net, fragments(POD_CLIENT, VIP, 40007, 53, b"query", ip_id=1111))  # one whole datagram
    first, middle, last = fragments(BE2, POD_CLIENT, 5353, 40007, BIG[::-1], ip_id=2222)
    with Capture(lab.pod.name) as cap:
        assert [net.from_pod(f)[0] for f in (middle, last)] == [TC_ACT_SHOT, TC_ACT_SHOT]
        verdict, first_out = net.from_pod(first)
        assert verdict == TC_ACT_REDIRECT
        back = cap.frames(2, lambda f: frag_id(f) == 2222)
    got = reassemble([first_out, *run(net, back)])
    assert (got.src, got.dst, got.ports) == (VIP, POD_CLIENT, (53, 40007))
    assert got.headers_ok and got.l4_checksum_ok() and got.l4[8:] == BIG[::-1]
    assert net.stats()[Stat.FRAG_RELEASED] == 2


def test_a_reversed_datagram_to_the_nodes_own_address_is_held_then_passed(net: Net, lab: Lab) -> None:
    """From outside to the node's address, where NodePorts live, but to no NodePort: held (a
    NodePort datagram would look the same until its first fragment came), then passed to the
    stack with its first fragment, untouched: the node reassembles it."""
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL
    net.add_service(NODE, 30053, ((7, REMOTE_BE, 5353, 0),), proto=UDP, scope=Scope.EXTERNAL, flags=flags)
    first, middle, last = fragments(
        CLIENT, NODE, 7777, 5000, BIG, ip_id=3333, smac=MAC[CLIENT], dmac=lab.ext.mac
    )
    with Capture(lab.ext.name) as cap:
        assert [net.from_net(f)[0] for f in (last, middle)] == [TC_ACT_SHOT, TC_ACT_SHOT]
        assert net.from_net(first) == (TC_ACT_OK, first)
        back = cap.frames(2, lambda f: frag_id(f) == 3333)
    assert sorted(back) == sorted([last, middle])
    for frame in back:
        assert net.from_net(frame) == (TC_ACT_OK, frame)
    stats = net.stats()
    assert (stats[Stat.FRAG_HELD], stats[Stat.FRAG_RELEASED], stats[Stat.PASS]) == (2, 2, 3)


def test_a_reversed_datagram_no_translated_flow_can_use_passes_untouched(net: Net) -> None:
    """Pod to pod: neither address is a frontend, the SNAT address or a backend, so a fragment
    before its first is left to the stack (which reassembles in any order), with no map write."""
    dns_service(net)
    frames = fragments(POD_CLIENT, "10.244.1.99", 40003, 5000, BIG, ip_id=6006)
    for frame in reversed(frames):
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    stats = net.stats()
    assert (stats[Stat.PASS], stats[Stat.FRAG_HELD], stats[Stat.DROP_FRAG_NO_FIRST]) == (3, 0, 0)
    assert net.dp.maps["fraghold"].items() == []


def test_fragments_that_cannot_be_held_are_dropped_and_counted(net: Net) -> None:
    """Eight fragments of a datagram are held at most, each a frame of 1,520 bytes at most (a
    jumbo frame is not held): the rest drop as fragments without their first."""
    dns_service(net)
    small = fragments(POD_CLIENT, VIP, 40010, 53, BIG, ip_id=7070, fragsize=400)
    later = small[1:]
    assert len(later) == 9
    assert {net.from_pod(f)[0] for f in reversed(later)} == {TC_ACT_SHOT}
    stats = net.stats()
    assert (stats[Stat.FRAG_HELD], stats[Stat.DROP_FRAG_NO_FIRST]) == (8, 1)
    jumbo = fragments(POD_CLIENT, VIP, 40011, 53, bytes(9000), ip_id=7171, fragsize=2960)[1]
    assert len(jumbo) > 1520
    assert net.from_pod(jumbo)[0] == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_FRAG_NO_FIRST] == 2


def test_fragments_of_a_datagram_nobody_translates_pass_unchanged(net: Net) -> None:
    dns_service(net)
    frames = fragments(POD_CLIENT, "10.244.1.99", 40003, 53, BIG, ip_id=6006)
    for frame in frames:
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    assert net.stats()[Stat.PASS] == 3


def test_later_fragments_of_a_flow_that_is_gone_are_dropped(net: Net) -> None:
    """The first fragment was seen (its record is there) but its flow is not: a later fragment to a
    frontend never starts a flow."""
    dns_service(net)
    first, middle, _last = fragments(POD_CLIENT, VIP, 40004, 53, BIG, ip_id=7007)
    run(net, [first])
    assert net.ct_del(POD_CLIENT, VIP, 40004, 53, UDP)
    assert net.from_pod(middle)[0] == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_NO_FLOW] == 1


def test_first_fragment_to_a_service_without_endpoints_is_rejected(net: Net, lab: Lab) -> None:
    """The first fragment carries the ports: answered with a port unreachable like a datagram."""
    net.add_service(port=53, proto=UDP, backends=(), flags=FrontendFlag.NO_ENDPOINTS)
    first = fragments(POD_CLIENT, VIP, 40005, 53, BIG, ip_id=8008, smac=MAC[POD_CLIENT], dmac=lab.pod.mac)[0]
    verdict, out = net.from_pod(first)
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(out)
    assert (e.type, e.code, e.src, e.dst) == (3, 3, VIP, POD_CLIENT)
    assert e.ip_chksum_ok and e.icmp_chksum_ok and e.quote == first[14 : 14 + 20 + 8]


def test_later_fragments_to_a_service_without_endpoints_get_no_icmp_error(net: Net, lab: Lab) -> None:
    """RFC 1122: no ICMP error about a fragment other than the first. Dropped, counted with the
    refused datagram."""
    net.add_service(port=53, proto=UDP, backends=(), flags=FrontendFlag.NO_ENDPOINTS)
    frames = fragments(POD_CLIENT, VIP, 40012, 53, BIG, ip_id=8118, smac=MAC[POD_CLIENT], dmac=lab.pod.mac)
    assert net.from_pod(frames[0])[0] == TC_ACT_REDIRECT  # the reject
    assert [net.from_pod(f)[0] for f in frames[1:]] == [TC_ACT_SHOT, TC_ACT_SHOT]
    assert net.stats()[Stat.DROP_NO_ENDPOINTS] == 3


def test_a_first_fragment_that_is_its_own_datagram_is_a_whole_packet(net: Net) -> None:
    """A datagram that fits one frame has no MF: translated with nothing recorded."""
    dns_service(net)
    (whole,) = fragments(POD_CLIENT, VIP, 40006, 53, b"small", ip_id=9009)
    assert parse(run(net, [whole])[0]).dst == BE2
    assert len(net.dp.maps["frag"].items()) == 0
