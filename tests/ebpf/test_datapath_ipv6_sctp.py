"""SCTP through the tc programs' IPv6 path (bpf/ekp_tc6.h), packet by packet: IPv4's conntrack
(only an INIT starts an association; UDP's timeouts, as IPv4's SCTP) and IPv4's CRC32c update
(bpf/ekp_sctp.h) for a port change, each packet's CRC32c checked by the bitwise CRC32c of
lab/sctppeer.py; an association ip6tables translated before (a DATA chunk without an entry) and
fragments go to the stack untouched; a frontend without endpoints answers an INIT with ICMPv6 port
unreachable quoting its common header, chunk header and initiate tag (what Linux's SCTP matches an
error about a tag-0 packet by).

The packet lab of test_datapath_ipv6.py (lab/dplab.py, `add_ipv6`).
"""

from __future__ import annotations

from collections.abc import Iterator
from ipaddress import IPv6Address

import pytest

from agent.ebpf import abi
from agent.ebpf.abi import BackendFlag, FrontendFlag, Scope, Stat, ip6_words
from agent.ebpf.loader import Datapath
from agent.ebpf.maps import write_config6
from lab.dplab import (
    BE6,
    CLIENT6,
    NODE6,
    POD6,
    REMOTE_BE6,
    SNAT_MAX,
    SNAT_MIN,
    VIP6,
    Lab,
    Net,
    add_ipv6,
    add_service6,
    packet_lab,
)
from lab.packets import TC_ACT_OK, TC_ACT_REDIRECT, sctp, sctp_checksum_ok
from tests.ebpf.test_datapath_icmp6 import error6, error_about
from tests.ebpf.test_datapath_ipv6 import ct6

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

SCTP = 132
LOCAL_BE = ((1, BE6, 5061, BackendFlag.LOCAL),)
VTAG_CLIENT, VTAG_SERVER = 0x1234, 0x5678  # the init tags of sctp()'s INIT and INIT-ACK


@pytest.fixture(scope="module")
def lab(dp: Datapath) -> Iterator[Lab]:
    with packet_lab() as built:
        add_ipv6(built)
        yield built


def seen(frame: bytes) -> tuple[str, int, str, int]:
    """(src, sport, dst, dport) of an IPv6 SCTP frame (no extension headers), asserting its
    CRC32c and that its payload length still spans the packet."""
    assert frame[20] == SCTP and int.from_bytes(frame[18:20], "big") == len(frame) - 54
    sctp_packet = frame[54:]
    assert sctp_checksum_ok(sctp_packet), "CRC32c"
    ports = sctp_packet[:4]
    return (
        str(IPv6Address(frame[22:38])),
        int.from_bytes(ports[:2], "big"),
        str(IPv6Address(frame[38:54])),
        int.from_bytes(ports[2:], "big"),
    )


def test_an_association_through_a_cluster_ip_keeps_valid_crc32cs_both_ways(net: Net) -> None:
    """ClusterIP 5060 -> backend 5061: the INIT starts the flow (ekp_ct6_any entries), the
    INIT-ACK comes back from the ClusterIP, then DATA chunks of many lengths both ways (the CRC
    update depends on the packet's length), each translated with a CRC32c that checks. Before
    this path took SCTP, every one of these went to the stack untouched."""
    add_service6(net.dp.maps, VIP6, 5060, LOCAL_BE, proto=SCTP)
    verdict, out = net.from_pod(sctp(POD6, VIP6, 40000, 5060))
    assert verdict == TC_ACT_REDIRECT and seen(out) == (POD6, 40000, BE6, 5061)
    assert ct6(net, POD6, VIP6, 40000, 5060, SCTP) is not None
    assert ct6(net, BE6, POD6, 5061, 40000, SCTP, reply=True) is not None
    verdict, out = net.from_pod(sctp(BE6, POD6, 5061, 40000, chunk="init-ack", tag=VTAG_CLIENT))
    assert verdict == TC_ACT_REDIRECT and seen(out) == (VIP6, 5060, POD6, 40000)
    payload = bytes(range(256)) * 6
    for size in (1, 2, 3, 4, 5, 7, 8, 15, 16, 31, 64, 255, 256, 1000, 1023, 1400):
        ahead = sctp(POD6, VIP6, 40000, 5060, chunk="data", tag=VTAG_SERVER, data=payload[:size])
        back = sctp(BE6, POD6, 5061, 40000, chunk="data", tag=VTAG_CLIENT, data=payload[-size:])
        verdict, out = net.from_pod(ahead)
        assert verdict == TC_ACT_REDIRECT and seen(out) == (POD6, 40000, BE6, 5061), size
        verdict, out = net.from_pod(back)
        assert verdict == TC_ACT_REDIRECT and seen(out) == (VIP6, 5060, POD6, 40000), size
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY]) == (1, 16, 17)


def test_a_chunk_without_an_entry_and_fragments_go_to_the_stack(net: Net) -> None:
    """Only an INIT starts an association here: a DATA chunk without an entry belongs to one
    ip6tables translated before (nf_conntrack has it: no carry needed, as for TCP); an SCTP packet
    in fragments cannot have its CRC32c updated (its length is not in the first fragment, as IPv4's
    path passes them)."""
    from scapy.layers.inet6 import IPv6, IPv6ExtHdrFragment, fragment6
    from scapy.layers.l2 import Ether

    add_service6(net.dp.maps, VIP6, 5060, LOCAL_BE, proto=SCTP)
    data = sctp(POD6, VIP6, 40100, 5060, chunk="data", tag=VTAG_SERVER)
    assert net.from_pod(data) == (TC_ACT_OK, data)
    whole = Ether(sctp(POD6, VIP6, 40101, 5060, chunk="data", tag=VTAG_SERVER, data=bytes(600)))
    pkt = whole[IPv6]
    pieces = fragment6(IPv6(bytes(pkt)[:40]) / IPv6ExtHdrFragment(id=9) / pkt.payload, 400)  # type: ignore[no-untyped-call]
    assert len(pieces) >= 2
    for piece in pieces:
        frame = bytes(Ether(src=whole.src, dst=whole.dst) / piece)
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    assert len(net.dp.maps["ct6_any"].keys()) == 0
    assert net.stats()[Stat.NEW_FLOWS] == 0


def test_an_init_to_a_frontend_without_endpoints_is_refused_with_port_unreachable(net: Net) -> None:
    """ip6tables' REJECT for SCTP: destination unreachable, port unreachable from the ClusterIP,
    quoting the IPv6 header and 20 bytes of the INIT as sent: the common header (ports, tag 0,
    CRC32c), the chunk header and the initiate tag, without which Linux's SCTP (sctp_err_lookup)
    drops an error about a packet whose verification tag is 0."""
    add_service6(net.dp.maps, VIP6, 5060, (), proto=SCTP, flags=FrontendFlag.NO_ENDPOINTS)
    init = sctp(POD6, VIP6, 40200, 5060)
    verdict, out = net.from_pod(init)
    assert verdict == TC_ACT_REDIRECT
    e = error6(out)
    assert (e.src, e.dst, e.head[0], e.head[1]) == (VIP6, POD6, 1, 4) and e.checksum_ok
    assert out[62:] == init[14 : 14 + 40 + 20]
    assert out[62 + 40 + 12] == 1 and int.from_bytes(out[62 + 40 + 16 : 62 + 40 + 20], "big") == VTAG_CLIENT
    assert net.stats()[Stat.DROP_NO_ENDPOINTS] == 1


def test_a_node_port_to_a_remote_backend_masquerades_both_ports_and_keeps_the_crc32c(net: Net) -> None:
    """From outside through a NodePort to a backend on another node (source-translated to the
    node's IPv6 address, a port of the SNAT range: the walk in ekp_ct6_any): both addresses and
    both ports change and the CRC32c follows; the INIT-ACK goes back to the client's own tuple."""
    write_config6(net.dp.maps, abi.Config6(node_addr=abi.Addr6(*ip6_words(NODE6))))
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    backends = ((7, REMOTE_BE6, 5061, 0),)
    add_service6(net.dp.maps, NODE6, 30660, backends, proto=SCTP, scope=Scope.EXTERNAL, flags=flags)
    verdict, out = net.from_net(sctp(CLIENT6, NODE6, 41000, 30660))
    assert verdict == TC_ACT_REDIRECT
    src, sport, dst, dport = seen(out)
    assert (src, dst, dport) == (NODE6, REMOTE_BE6, 5061) and SNAT_MIN <= sport <= SNAT_MAX
    verdict, out = net.from_net(sctp(REMOTE_BE6, NODE6, 5061, sport, chunk="init-ack", tag=VTAG_CLIENT))
    assert verdict == TC_ACT_REDIRECT and seen(out) == (NODE6, 30660, CLIENT6, 41000)
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.SNAT], stats[Stat.CT_REPLY]) == (1, 1, 1)


def test_an_icmpv6_error_about_a_translated_association_goes_back_to_the_client(net: Net) -> None:
    """A destination unreachable from the backend's side quoting the INIT as it left the node (to
    the backend): translated back as IPv4's path does for SCTP (ekp_tc6_related): from the ClusterIP,
    its quote the INIT as the client sent it (to the ClusterIP's port), the ICMPv6 checksum right.
    Before, the path left every error quoting SCTP to the stack, which has no conntrack for it."""
    add_service6(net.dp.maps, VIP6, 5060, LOCAL_BE, proto=SCTP)
    verdict, out = net.from_pod(sctp(POD6, VIP6, 40300, 5060))
    assert verdict == TC_ACT_REDIRECT
    verdict, back = net.from_pod(error_about(out, BE6, "unreachable"))
    assert verdict == TC_ACT_REDIRECT
    e = error6(back)
    assert (e.src, e.dst, e.in_src, e.in_dst, e.in_sport, e.in_dport) == (VIP6, POD6, POD6, VIP6, 40300, 5060)
    assert e.checksum_ok
    assert net.stats()[Stat.CT_RELATED] == 1
