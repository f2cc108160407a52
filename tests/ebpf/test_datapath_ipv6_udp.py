"""UDP through the tc programs' IPv6 path (bpf/ekp_tc6.h), packet by packet (BPF_PROG_TEST_RUN):
datagrams to an IPv6 frontend and their answers, fragmented ones (IPv4's fragment code,
bpf/ekp_frag_af.h and ekp_tc_frag_af.h, instantiated for IPv6: the first fragment decides, the later
ones follow it by addresses and fragment id, those that come before it are held until it comes),
and ICMPv6 errors about a translated UDP flow (ekp_tc6_related), each checked as its receiver's
stack would: the datagram put back together, its UDP checksum and the quote's.

The packet lab (lab/dplab.py) with IPv6 beside IPv4 on the same devices (`add_ipv6`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.ebpf import abi
from agent.ebpf.abi import BackendFlag, FrontendFlag, Scope, Stat, ip6_str, ip6_words, port_host
from agent.ebpf.loader import Datapath
from agent.ebpf.maps import write_config6
from agent.takeover.flows import EbpfIds, NatFlow, ebpf_entries6
from lab.dplab import (
    BE6,
    BE6_2,
    CLIENT6,
    MAC6,
    NODE2_6,
    NODE6,
    POD6,
    REMOTE_BE6,
    UDP,
    VIP6,
    Lab,
    Net,
    add_ipv6,
    add_service6,
    packet_lab,
)
from lab.packets import TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, Capture
from tests.ebpf.test_datapath_ipv6 import ct6, ct6_count, frame6, seen

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

BIG = bytes(range(256)) * 15 + b"end of a 4,000-byte datagram"  # 3,868 bytes of UDP payload
LOCAL_BE = ((1, BE6, 8080, BackendFlag.LOCAL),)
ETH = {"src": "02:00:00:00:aa:01", "dst": "02:00:00:00:aa:02"}


@pytest.fixture(scope="module")
def lab(dp: Datapath) -> Iterator[Lab]:
    with packet_lab() as built:
        add_ipv6(built)
        yield built


def frags6(
    src: str,
    dst: str,
    sport: int,
    dport: int,
    payload: bytes,
    ident: int,
    smac: str = ETH["src"],
    *,
    dstopts: bool = False,
) -> list[bytes]:
    """A UDP datagram as its sender's stack fragments it for a 1,500-byte link: first fragment first.
    `dstopts`: a destination options header after the fragment header, RFC 8200's order (in the
    fragmentable part: only the first fragment holds it; Linux puts a socket's before it)."""
    from scapy.layers.inet import UDP as UDPh
    from scapy.layers.inet6 import IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrFragment, PadN, fragment6
    from scapy.layers.l2 import Ether

    datagram = IPv6(src=src, dst=dst) / IPv6ExtHdrFragment(id=ident)
    if dstopts:
        datagram = datagram / IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\x00" * 4)])
    datagram = datagram / UDPh(sport=sport, dport=dport) / payload
    pieces = fragment6(datagram, 1500)  # type: ignore[no-untyped-call]
    return [bytes(Ether(src=smac, dst=ETH["dst"]) / piece) for piece in pieces]


def reassembled(frames: list[bytes]) -> tuple[str, str, int, int, bytes]:
    """(src, dst, sport, dport, payload) of the datagram the fragments make, as a receiver puts it
    together (RFC 8200 4.5: by addresses and id), asserting its UDP checksum."""
    from scapy.layers.inet import UDP as UDPh
    from scapy.layers.inet6 import IPv6, defragment6
    from scapy.layers.l2 import Ether

    pieces = [Ether(f)[IPv6] for f in frames]
    assert len({(p.src, p.dst) for p in pieces}) == 1, "every fragment has the datagram's addresses"
    whole = defragment6(pieces)  # type: ignore[no-untyped-call]
    whole = IPv6(bytes(whole))
    udp = whole[UDPh]
    fresh = IPv6(bytes(whole))
    del fresh[UDPh].chksum
    assert IPv6(bytes(fresh))[UDPh].chksum == udp.chksum, "UDP checksum of the whole datagram"
    return whole.src, whole.dst, udp.sport, udp.dport, bytes(udp.payload)


def frag_id6(frame: bytes) -> int:
    """The fragment id of an IPv6 frame whose first extension header is a fragment header, else 0."""
    if frame[12:14] != b"\x86\xdd" or frame[20] != 44:
        return 0
    return int.from_bytes(frame[58:62], "big")


def run(net: Net, frames: list[bytes], *, external: bool = False) -> list[bytes]:
    out = []
    for frame in frames:
        verdict, sent = net.from_net(frame) if external else net.from_pod(frame)
        assert verdict == TC_ACT_REDIRECT
        out.append(sent)
    return out


def test_a_datagram_to_a_cluster_ip_and_its_answer_are_translated_in_ct6_any(net: Net) -> None:
    """Before, UDP went to ip6tables untouched; now a datagram opens a flow in ekp_ct6_any and its
    answer comes back from the frontend."""
    add_service6(net.dp.maps, VIP6, 53, LOCAL_BE, proto=UDP)
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40040, 53, UDP))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (POD6, BE6, 40040) and seen(out)[5] == 8080
    entry = ct6(net, POD6, VIP6, 40040, 53, UDP)
    assert entry is not None and (ip6_str(entry.nat_addr), port_host(entry.nat_port)) == (BE6, 8080)
    verdict, back = net.from_pod(frame6(BE6, POD6, 8080, 40040, UDP))
    assert verdict == TC_ACT_REDIRECT
    assert seen(back)[1:4] == (VIP6, POD6, 53) and seen(back)[5] == 40040
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_REPLY]) == (1, 1)
    assert ct6_count(net) == 2


def test_every_fragment_of_a_cluster_ip_datagram_is_translated_both_ways(net: Net) -> None:
    """A 4,000-byte query in three fragments and the backend's 4,000-byte answer in three: the first
    fragment decides (a new flow; the answer's, a REPLY hit), the later ones follow it by
    (addresses, fragment id); each side's receiver puts together a datagram whose addresses, ports
    and UDP checksum are right."""
    add_service6(net.dp.maps, VIP6, 53, LOCAL_BE, proto=UDP)
    query = frags6(POD6, VIP6, 40001, 53, BIG, ident=0x1001)
    assert len(query) == 3
    assert reassembled(run(net, query)) == (POD6, BE6, 40001, 8080, BIG)
    answer = frags6(BE6, POD6, 8080, 40001, BIG[::-1], ident=0x2002)
    assert reassembled(run(net, answer)) == (VIP6, POD6, 53, 40001, BIG[::-1])
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY]) == (1, 2, 3)
    assert stats[Stat.FRAGMENTS] == 4  # the later fragments, two each way
    assert len(net.dp.maps["frag6"].items()) == 2, "one record per datagram"


def test_a_nodeport_datagram_masqueraded_to_a_remote_backend_in_every_fragment(net: Net) -> None:
    """From outside to a NodePort of policy Cluster (SNAT_ALL): every fragment leaves from the
    node's IPv6 address, the first with the SNAT port, and the answer returns to the client."""
    write_config6(net.dp.maps, abi.Config6(node_addr=abi.Addr6(*ip6_words(NODE6))))
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL
    add_service6(
        net.dp.maps, NODE6, 30053, ((7, REMOTE_BE6, 5353, 0),), proto=UDP, scope=Scope.EXTERNAL, flags=flags
    )
    sent = run(net, frags6(CLIENT6, NODE6, 7777, 30053, BIG, 0x3003, MAC6[CLIENT6]), external=True)
    src, dst, snat_port, be_port, payload = reassembled(sent)
    assert (src, dst, be_port, payload) == (NODE6, REMOTE_BE6, 5353, BIG)
    answer = frags6(REMOTE_BE6, NODE6, 5353, snat_port, BIG[:3000], 0x4004, MAC6[NODE2_6])
    assert reassembled(run(net, answer, external=True)) == (NODE6, CLIENT6, 30053, 7777, BIG[:3000])
    assert net.stats()[Stat.SNAT] == 1


def test_a_reversed_datagram_is_held_then_translated_whole(net: Net, lab: Lab) -> None:
    """Last fragment first, then the middle one, then the first: the two come before anything says
    which flow they belong to, to a frontend address (ekp_addr6), so they are held (ekp_frhold6);
    the first starts the flow and puts them back into the pod device's ingress, where they run
    through the program again as ordinary later fragments."""
    add_service6(net.dp.maps, VIP6, 53, LOCAL_BE, proto=UDP)
    first, middle, last = frags6(POD6, VIP6, 40002, 53, BIG, ident=0x5005)
    with Capture(lab.pod.name) as cap:
        assert net.from_pod(last)[0] == TC_ACT_SHOT
        assert net.from_pod(middle)[0] == TC_ACT_SHOT
        assert net.stats()[Stat.FRAG_HELD] == 2
        assert len(net.dp.maps["frhold6"].items()) == 2
        verdict, first_out = net.from_pod(first)
        assert verdict == TC_ACT_REDIRECT
        back = cap.frames(2, lambda f: frag_id6(f) == 0x5005)
    assert sorted(back) == sorted([last, middle])
    assert net.dp.maps["frhold6"].items() == []
    assert reassembled([first_out, *run(net, back)]) == (POD6, BE6, 40002, 8080, BIG)
    stats = net.stats()
    assert (stats[Stat.FRAG_RELEASED], stats[Stat.FRAGMENTS], stats[Stat.DROP_FRAG_NO_FIRST]) == (2, 2, 0)


def test_a_reversed_datagram_no_translated_flow_can_use_passes_untouched(net: Net) -> None:
    """Pod to pod (neither address a frontend, the SNAT address or a backend): the stack
    reassembles it, whatever the order."""
    add_service6(net.dp.maps, VIP6, 53, LOCAL_BE, proto=UDP)
    first, middle, last = frags6(POD6, "fd00:a:1::42", 40003, 53, BIG, ident=0x6006)
    for frame in (last, middle, first):
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    assert net.stats()[Stat.FRAG_HELD] == 0
    assert ct6_count(net) == 0


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_a_fragmented_datagram_with_destination_options_goes_to_the_stack_whole(net: Net, order: str) -> None:
    """Destination options after the fragment header (RFC 8200's order): the first fragment's walk would need
    to go past the fragment header to find UDP, and a later fragment's bytes there are payload, not
    a header. So the walk stops at the fragment header and every piece, in any order, goes to the
    stack untouched (ip6tables translates the datagram it puts together, as before the tc path took
    UDP): none translated, recorded or held, to a frontend address though it is."""
    add_service6(net.dp.maps, VIP6, 53, LOCAL_BE, proto=UDP)
    pieces = frags6(POD6, VIP6, 40005, 53, BIG, ident=0x7007, dstopts=True)
    assert len(pieces) == 3
    for frame in pieces if order == "in order" else pieces[::-1]:
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    stats = net.stats()
    assert (stats[Stat.FRAG_HELD], stats[Stat.FRAGMENTS], stats[Stat.NEW_FLOWS]) == (0, 0, 0)
    assert net.dp.maps["frag6"].items() == [] and net.dp.maps["frhold6"].items() == []
    assert ct6_count(net) == 0


def icmp6_error(src: str, dst: str, quoted: bytes, *, kind: str) -> bytes:
    """An ICMPv6 error from `src` to `dst` quoting the IPv6 packet of the frame `quoted`."""
    from scapy.layers.inet6 import ICMPv6DestUnreach, ICMPv6PacketTooBig, IPv6
    from scapy.layers.l2 import Ether

    head = ICMPv6DestUnreach(code=4) if kind == "port unreachable" else ICMPv6PacketTooBig(mtu=1400)
    return bytes(
        Ether(src=ETH["src"], dst=ETH["dst"]) / IPv6(src=src, dst=dst) / head / bytes(Ether(quoted)[IPv6])
    )


def error_seen(frame: bytes) -> tuple[str, str, str, str, int, int]:
    """(outer src, dst, quote src, dst, quoted sport, dport) of an ICMPv6 error frame, asserting its
    checksum and the quoted UDP checksum are what its bytes make."""
    from scapy.layers.inet import UDPerror
    from scapy.layers.inet6 import IPerror6, IPv6
    from scapy.layers.l2 import Ether

    pkt = Ether(frame)
    icmp = pkt[IPv6].payload
    fresh = Ether(frame)
    del fresh[IPv6].payload.cksum
    assert Ether(bytes(fresh))[IPv6].payload.cksum == icmp.cksum, "ICMPv6 checksum"
    quote, qudp = pkt[IPerror6], pkt[UDPerror]
    qfresh = IPv6(bytes(quote))
    del qfresh[UDPerror if UDPerror in qfresh else type(qfresh.payload)].chksum
    again = IPv6(bytes(qfresh))
    assert again.payload.chksum == qudp.chksum, "the quoted UDP checksum"
    return pkt[IPv6].src, pkt[IPv6].dst, quote.src, quote.dst, qudp.sport, qudp.dport


@pytest.mark.parametrize("kind", ["port unreachable", "packet too big"])
def test_an_icmpv6_error_about_a_translated_datagram_goes_back_to_the_client(net: Net, kind: str) -> None:
    """The backend's port unreachable (nothing listens on its port), or its Packet Too Big (its
    device smaller than the datagram), quotes the datagram as it left the node (to the backend):
    translated back (the frontend as the quote's destination and the outer source), the client's
    stack finds its socket (a connected
    UDP socket's ECONNREFUSED, its path MTU lowered). Before, no UDP flow was the path's."""
    add_service6(net.dp.maps, VIP6, 53, LOCAL_BE, proto=UDP)
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40050, 53, UDP))
    assert verdict == TC_ACT_REDIRECT
    verdict, back = net.from_pod(icmp6_error(BE6, POD6, out, kind=kind))
    assert verdict == TC_ACT_REDIRECT
    # from the frontend either way (nf_nat's outer manip, as for TCP's errors: ekp_tc6_related)
    assert error_seen(back) == (VIP6, POD6, POD6, VIP6, 40050, 53)
    assert net.stats()[Stat.CT_RELATED] == 1


def test_tcp_fragments_follow_their_first_as_udp_ones_do(net: Net) -> None:
    """The fragment code is the protocol's no more than IPv4's: a SYN in three fragments opens the
    flow with its first, the later ones follow (before, all went to the stack)."""
    from scapy.layers.inet import TCP as TCPh
    from scapy.layers.inet6 import IPv6, IPv6ExtHdrFragment, fragment6
    from scapy.layers.l2 import Ether

    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    datagram = IPv6(src=POD6, dst=VIP6) / IPv6ExtHdrFragment(id=7) / TCPh(sport=40007, dport=80, flags="S")
    pieces = fragment6(datagram / (b"x" * 3000), 1280)  # type: ignore[no-untyped-call]
    assert len(pieces) >= 3
    out = run(net, [bytes(Ether(src=ETH["src"], dst=ETH["dst"]) / piece) for piece in pieces])
    assert {seen_addrs(f) for f in out} == {(POD6, BE6)}
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.FRAGMENTS]) == (1, len(pieces) - 1)


def seen_addrs(frame: bytes) -> tuple[str, str]:
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    ip: Any = Ether(frame)[IPv6]
    return ip.src, ip.dst


def test_udp_flows_carried_from_nf_conntrack_keep_their_backend(net: Net) -> None:
    """The entries a restart carries from nf_conntrack for UDP flows ip6tables translated
    (agent/takeover/flows.py ebpf_entries6, ADOPTED): each flow's next datagram goes on to the
    backend ip6tables chose, though the path would choose among two (20 flows all to the one: by
    chance 2**-20), and none is a new flow."""
    two = ((1, BE6, 8080, BackendFlag.LOCAL), (2, BE6_2, 8080, BackendFlag.LOCAL))
    add_service6(net.dp.maps, VIP6, 53, two, proto=UDP)
    ids = EbpfIds(services={(VIP6, 53, UDP): 1}, backends={(BE6_2, 8080, UDP): 2})
    for n in range(20):
        flow = NatFlow(UDP, (POD6, VIP6, 41000 + n, 53), (BE6_2, POD6, 8080, 41000 + n))
        for key, entry in ebpf_entries6(flow, ids, time.monotonic_ns()):
            net.dp.maps["ct6_any"].update(key, entry)
    for n in range(20):
        verdict, out = net.from_pod(frame6(POD6, VIP6, 41000 + n, 53, UDP))
        assert verdict == TC_ACT_REDIRECT and seen(out)[2] == BE6_2, n
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_FORWARD]) == (0, 20)
