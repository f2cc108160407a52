"""SCTP through the tc data path, packet by packet: translated both ways through a ClusterIP and a
source-translated NodePort with its CRC32c kept right (bpf/ekp_sctp.h), checked by a bitwise
CRC32c written apart from scapy's (lab/packets.py); only an INIT starts a flow, and one on a live
association's reply tuple gets another source port; fragments pass; an INIT to a frontend
without endpoints is answered with a port unreachable whose quote Linux's SCTP can match.
"""

from __future__ import annotations

import pytest

from agent.ebpf.abi import BackendFlag, FrontendFlag, Scope, Stat
from lab.dplab import (
    BE1,
    CLIENT,
    NODE,
    POD_CLIENT,
    REMOTE_BE,
    SNAT_MAX,
    SNAT_MIN,
    VIP,
    Net,
)
from lab.packets import (
    TC_ACT_OK,
    TC_ACT_REDIRECT,
    TC_ACT_SHOT,
    checksums_valid,
    icmp_error,
    parse,
    sctp,
    sctp_checksum_ok,
)

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

SCTP = 132
LOCAL = BackendFlag.LOCAL
VTAG_CLIENT, VTAG_SERVER = 0x1234, 0x5678  # the init tags of sctp()'s INIT and INIT-ACK


def l4(frame: bytes) -> bytes:
    """The SCTP packet of a frame (Ethernet + a 20-byte IPv4 header)."""
    total = int.from_bytes(frame[16:18], "big")
    return frame[34 : 14 + total]


def test_an_association_through_a_cluster_ip_keeps_valid_crc32cs_both_ways(net: Net) -> None:
    """ClusterIP 5060 -> backend 5061: INIT, INIT-ACK, then DATA chunks of every length from 1 to
    1,400 bytes in both directions (so the packet length, which the CRC update depends on, takes
    many values), each translated with a CRC32c that checks."""
    net.add_service(port=5060, backends=((1, BE1, 5061, LOCAL),), proto=SCTP)
    verdict, out = net.from_pod(sctp(POD_CLIENT, VIP, 40000, 5060))
    assert verdict == TC_ACT_REDIRECT
    p = parse(out)
    assert (p.src, p.sport, p.dst, p.dport) == (POD_CLIENT, 40000, BE1, 5061)
    assert sctp_checksum_ok(l4(out)) and checksums_valid(out)
    verdict, out = net.from_pod(sctp(BE1, POD_CLIENT, 5061, 40000, chunk="init-ack", tag=VTAG_CLIENT))
    p = parse(out)
    assert verdict == TC_ACT_REDIRECT and (p.src, p.sport, p.dst, p.dport) == (VIP, 5060, POD_CLIENT, 40000)
    assert checksums_valid(out)
    for size in (1, 2, 3, 4, 5, 7, 8, 15, 16, 31, 64, 100, 255, 256, 511, 1000, 1023, 1024, 1400):
        payload = bytes(range(256)) * 6
        ahead = sctp(POD_CLIENT, VIP, 40000, 5060, chunk="data", tag=VTAG_SERVER, data=payload[:size])
        back = sctp(BE1, POD_CLIENT, 5061, 40000, chunk="data", tag=VTAG_CLIENT, data=payload[-size:])
        for frame, want in ((ahead, (BE1, 5061)), (back, (POD_CLIENT, 40000))):
            verdict, out = net.from_pod(frame)
            assert verdict == TC_ACT_REDIRECT and (parse(out).dst, parse(out).dport) == want
            assert checksums_valid(out), size
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY]) == (1, 19, 20)


def test_a_node_port_with_snat_rewrites_both_ports_and_keeps_the_crc32c(net: Net) -> None:
    """From outside through a NodePort (masqueraded): source address and port, destination address
    and port all change, and the CRC32c follows; the INIT-ACK goes back to the client's own."""
    net.add_service(
        NODE, 30660, ((7, REMOTE_BE, 5061, 0),), proto=SCTP, scope=Scope.EXTERNAL, flags=FrontendFlag.SNAT_ALL
    )
    verdict, out = net.from_net(sctp(CLIENT, NODE, 41000, 30660))
    p = parse(out)
    assert verdict == TC_ACT_REDIRECT and (p.src, p.dst, p.dport) == (NODE, REMOTE_BE, 5061)
    assert SNAT_MIN <= p.sport <= SNAT_MAX and checksums_valid(out)
    verdict, out = net.from_net(sctp(REMOTE_BE, NODE, 5061, p.sport, chunk="init-ack", tag=VTAG_CLIENT))
    back = parse(out)
    assert verdict == TC_ACT_REDIRECT and (back.src, back.sport, back.dst, back.dport) == (
        NODE,
        30660,
        CLIENT,
        41000,
    )
    assert checksums_valid(out)


def test_addresses_alone_leave_the_crc32c_as_it_was(net: Net) -> None:
    """SCTP's checksum covers no pseudo header: a frontend on the backend's own port rewrites the
    destination address only, and the checksum bytes do not change."""
    net.add_service(port=5061, backends=((1, BE1, 5061, LOCAL),), proto=SCTP)
    frame = sctp(POD_CLIENT, VIP, 40100, 5061)
    out = net.from_pod(frame)[1]
    assert parse(out).dst == BE1 and l4(out)[8:12] == l4(frame)[8:12] and checksums_valid(out)


def test_a_corrupt_packet_stays_corrupt(net: Net) -> None:
    """The CRC is updated, not recomputed: a packet that arrived damaged is not made to look whole."""
    net.add_service(port=5060, backends=((1, BE1, 5061, LOCAL),), proto=SCTP)
    damaged = bytearray(sctp(POD_CLIENT, VIP, 40200, 5060))
    damaged[-1] ^= 0x40  # a bit of the INIT chunk
    verdict, out = net.from_pod(bytes(damaged))
    assert verdict == TC_ACT_REDIRECT and parse(out).dport == 5061 and not sctp_checksum_ok(l4(out))


def test_only_an_init_starts_an_sctp_flow(net: Net) -> None:
    """A DATA chunk to a frontend with no flow belongs to an association we no longer have: dropped
    (counted NO_FLOW), never sent to a newly chosen backend, which could only ABORT it."""
    net.add_service(port=5060, backends=((1, BE1, 5061, LOCAL),), proto=SCTP)
    assert net.from_pod(sctp(POD_CLIENT, VIP, 40300, 5060, chunk="data", tag=VTAG_SERVER))[0] == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_NO_FLOW] == 1


def test_an_association_keeps_its_backend_when_the_backend_leaves_the_service(net: Net) -> None:
    """As TCP, and unlike UDP (kube-proxy clears the conntrack of UDP endpoints alone)."""
    net.add_service(port=5060, backends=((1, BE1, 5061, LOCAL),), proto=SCTP)
    net.from_pod(sctp(POD_CLIENT, VIP, 40400, 5060))
    net.remove_member(1, 1)
    out = net.from_pod(sctp(POD_CLIENT, VIP, 40400, 5060, chunk="heartbeat", tag=VTAG_SERVER))[1]
    assert parse(out).dst == BE1 and checksums_valid(out)


def test_sctp_fragments_are_passed_untouched(net: Net) -> None:
    """The first fragment holds the checksum but not the packet's length, which its update needs."""
    from scapy.layers.inet import IP, fragment
    from scapy.layers.l2 import Ether

    net.add_service(port=5060, backends=((1, BE1, 5061, LOCAL),), proto=SCTP)
    whole = Ether(sctp(POD_CLIENT, VIP, 40500, 5060, chunk="data", tag=VTAG_SERVER, data=bytes(600)))
    for piece in fragment(whole[IP], fragsize=256):  # type: ignore[no-untyped-call]
        frame = bytes(Ether(src=whole.src, dst=whole.dst) / piece)
        assert net.from_pod(frame) == (TC_ACT_OK, frame)


def test_an_init_from_the_port_of_a_live_association_gets_another_port(net: Net) -> None:
    """An INIT straight to a backend (a ClusterIP another node translated) from the port of a live
    association through a ClusterIP to that backend: both would have one reply tuple, so the newcomer
    gets another source port, as nf_nat's unique tuple gives it, its CRC32c following; each
    association's chunks come back to the client's port from the address it asked."""
    net.add_service(port=5060, backends=((1, BE1, 5061, LOCAL),), proto=SCTP)
    assert parse(net.from_pod(sctp(POD_CLIENT, VIP, 40600, 5060))[1]).dst == BE1
    verdict, out = net.from_pod(sctp(POD_CLIENT, BE1, 40600, 5061))
    moved = parse(out)
    assert verdict == TC_ACT_REDIRECT and sctp_checksum_ok(l4(out)) and checksums_valid(out)
    assert (moved.src, moved.dst, moved.dport) == (POD_CLIENT, BE1, 5061)
    assert moved.sport != 40600 and SNAT_MIN <= moved.sport <= SNAT_MAX
    verdict, out = net.from_pod(sctp(BE1, POD_CLIENT, 5061, moved.sport, chunk="init-ack", tag=VTAG_CLIENT))
    back = parse(out)
    assert (back.src, back.sport, back.dst, back.dport) == (BE1, 5061, POD_CLIENT, 40600)
    assert sctp_checksum_ok(l4(out))
    # the older association is untouched
    out = net.from_pod(sctp(BE1, POD_CLIENT, 5061, 40600, chunk="init-ack", tag=VTAG_CLIENT))[1]
    assert (parse(out).src, parse(out).sport) == (VIP, 5060) and sctp_checksum_ok(l4(out))
    assert net.stats()[Stat.PORT_REMAP] == 1


def test_an_init_refused_is_answered_quoting_its_chunk_header_and_initiate_tag(net: Net) -> None:
    """kube-proxy's REJECT for SCTP: a port unreachable from the ClusterIP quoting the IP header and
    20 bytes of the INIT, common header, chunk header and initiate tag: its verification tag is 0,
    and Linux's SCTP (sctp_err_lookup) drops an error about a tag-0 packet unless the quote shows the
    INIT and an initiate tag it knows. RFC 792's 8 bytes stop inside the common header."""
    net.add_service(port=5060, backends=(), proto=SCTP, flags=FrontendFlag.NO_ENDPOINTS)
    init = sctp(POD_CLIENT, VIP, 40600, 5060)
    verdict, out = net.from_pod(init)
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(out)
    assert (e.type, e.code, e.src, e.dst) == (3, 3, VIP, POD_CLIENT)
    assert e.ip_chksum_ok and e.icmp_chksum_ok and e.length_ok
    assert e.quote == init[14 : 14 + 20 + 20]
    assert e.quote[20 + 12] == 1 and int.from_bytes(e.quote[20 + 16 : 20 + 20], "big") == VTAG_CLIENT
    assert net.stats()[Stat.DROP_NO_ENDPOINTS] == 1


def test_a_malformed_init_shorter_than_its_quote_is_quoted_to_rfc_792s_8_bytes(net: Net) -> None:
    """An INIT cut to its chunk header (16 bytes of SCTP; a real one is at least 32) is answered
    with the plain 8-byte quote: the 20-byte INIT quote would pad it with zeros past its end."""
    from scapy.layers.inet import IP
    from scapy.layers.l2 import Ether

    net.add_service(port=5060, backends=(), proto=SCTP, flags=FrontendFlag.NO_ENDPOINTS)
    whole = Ether(sctp(POD_CLIENT, VIP, 40700, 5060))
    ip = IP(bytes(whole[IP])[: 20 + 16])
    del ip.len, ip.chksum
    short = bytes(Ether(src=whole.src, dst=whole.dst) / IP(bytes(ip)))
    assert len(short) == 14 + 20 + 16 and short[14 + 20 + 12] == 1  # the INIT chunk's type
    verdict, out = net.from_pod(short)
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(out)
    assert e.icmp_chksum_ok and e.length_ok and e.quote == short[14 : 14 + 20 + 8]


def test_a_crc_left_to_the_device_stays_zero(net: Net) -> None:
    """A local socket's SCTP packet whose CRC the device is to compute carries 0 in the field; the
    kernel's software fallback computes the CRC over the field as it stands, so an update there
    would make every translated packet's CRC wrong: the ports change, the field stays 0."""
    net.add_service(port=5060, backends=((1, BE1, 5061, LOCAL),), proto=SCTP)
    unsummed = bytearray(sctp(POD_CLIENT, VIP, 40300, 5060))
    unsummed[34 + 8 : 34 + 12] = bytes(4)
    verdict, out = net.from_pod(bytes(unsummed))
    assert verdict == TC_ACT_REDIRECT and parse(out).dport == 5061
    assert l4(out)[8:12] == bytes(4)
