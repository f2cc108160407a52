"""ICMP errors about translated flows, and path-MTU discovery, packet by packet.

An ICMP error quotes the packet it is about as that packet travelled: translated. The client only
knows the frontend, the backend only knows the client (or the node, after SNAT), so the error is
translated back, outer header and quote (addresses, ports, the quote's IP and L4 checksums and the
ICMP checksum), in both directions, as nf_nat_icmp_reply_translation does. And a translated packet
too big for the device it would leave by (DF set) is answered with a fragmentation-needed from the
address its sender targeted, quoting it as sent: path-MTU discovery through a ClusterIP or NodePort.
"""

from __future__ import annotations

import pytest

from agent.ebpf.abi import BackendFlag, FrontendFlag, Scope, Stat
from lab.dplab import (
    BE1,
    BE2,
    BE_SMALL_MTU,
    CLIENT,
    CLIENT_SMALL_MTU,
    MAC,
    NODE,
    NODE2,
    POD_CLIENT,
    REMOTE_BE,
    SMALL_MTU,
    UDP,
    VIP,
    Lab,
    Net,
)
from lab.packets import (
    TC_ACT_OK,
    TC_ACT_REDIRECT,
    checksums_valid,
    icmp_error,
    parse,
    sh,
    tcp,
    udp,
)

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

ROUTER = "10.244.1.8"  # a hop on the backend's side (it has a neighbour entry in the lab)
KINDS = {"frag-needed": (3, 4), "port-unreachable": (3, 3), "time-exceeded": (11, 0)}


def error_about(
    frame: bytes, src: str, kind: str, *, quote_len: int = 28, smac: str = "02:00:00:00:aa:01", to: str = ""
) -> bytes:
    """The ICMP error `src` sends about `frame` (to its source, or to `to`), quoting `quote_len`
    bytes of it."""
    from scapy.layers.inet import ICMP, IP
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw

    quoted = frame[14 : 14 + quote_len]
    about = Ether(frame)[IP]
    icmp_type, code = KINDS[kind]
    icmp = ICMP(type=icmp_type, code=code, nexthopmtu=1400 if kind == "frag-needed" else 0)
    outer = IP(src=src, dst=to or about.src, ttl=64)
    return bytes(Ether(src=smac, dst="02:00:00:00:aa:02") / outer / icmp / Raw(quoted))


def quote_of(frame: bytes) -> tuple[str, str, int, int, bool, bytes]:
    """(src, dst, sport, dport, IP checksum right, L4 bytes) of the packet an ICMP error quotes."""
    from scapy.layers.inet import ICMP, IP
    from scapy.layers.l2 import Ether
    from scapy.utils import checksum

    icmp = Ether(frame)[IP][ICMP]
    raw = bytes(icmp.payload)
    ihl = (raw[0] & 0x0F) * 4
    src = ".".join(str(b) for b in raw[12:16])
    dst = ".".join(str(b) for b in raw[16:20])
    l4 = raw[ihl:]
    return (
        src,
        dst,
        int.from_bytes(l4[0:2], "big"),
        int.from_bytes(l4[2:4], "big"),
        checksum(raw[:ihl]) == 0,
        l4,
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_error_about_a_clusterip_packet_reaches_the_client_as_if_from_the_frontend(
    net: Net, kind: str
) -> None:
    net.add_service(port=53, backends=((2, BE2, 5353, BackendFlag.LOCAL),), proto=UDP)
    sent = udp(POD_CLIENT, VIP, 40001, 53, payload=b"query")
    out = net.from_pod(sent)[1]
    assert parse(out).dst == BE2
    verdict, back = net.from_pod(error_about(out, ROUTER, kind))
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(back)
    assert (e.type, e.code) == KINDS[kind]
    assert (e.src, e.dst, e.dmac) == (VIP, POD_CLIENT, MAC[POD_CLIENT])
    assert e.ip_chksum_ok and e.icmp_chksum_ok
    src, dst, sport, dport, ip_ok, l4 = quote_of(back)
    assert (src, dst, sport, dport, ip_ok) == (POD_CLIENT, VIP, 40001, 53, True)
    # the quoted UDP header is the client's own again: same checksum as it sent
    assert l4[:8] == sent[14 + 20 : 14 + 28]
    assert net.stats()[Stat.CT_RELATED] == 1


def test_an_error_longer_than_its_routes_mtu_is_still_translated_and_sent(net: Net) -> None:
    """A 576-byte ICMP error (Linux's longest) towards a client whose route has a 560-byte MTU (a
    learnt path MTU can be 552): an error about a flow is not checked against the route's MTU
    (nothing would answer it; a router forwards it whole), so it reaches the client translated
    instead of being dropped as a failed route lookup."""
    net.add_service(port=53, backends=((2, BE2, 5353, BackendFlag.LOCAL),), proto=UDP)
    out = net.from_pod(udp(POD_CLIENT, VIP, 40002, 53, payload=b"q" * 600))[1]
    assert parse(out).dst == BE2
    error = error_about(out, ROUTER, "time-exceeded", quote_len=548)
    assert len(error) - 14 == 576
    sh("ip", "route", "add", f"{POD_CLIENT}/32", "dev", "pod0", "mtu", "lock", "560")
    try:
        verdict, back = net.from_pod(error)
    finally:
        sh("ip", "route", "del", f"{POD_CLIENT}/32", "dev", "pod0")
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(back)
    assert (e.type, e.code, e.src, e.dst) == (11, 0, VIP, POD_CLIENT)
    assert net.stats()[Stat.CT_RELATED] == 1 and net.stats()[Stat.DROP_FIB] == 0


def test_tcp_error_with_a_long_quote_fixes_the_quoted_tcp_checksum(net: Net) -> None:
    """Linux quotes up to 576 bytes: the whole TCP header, checksum included, is restored."""
    net.add_service()
    sent = tcp(POD_CLIENT, VIP, 12345, 80, flags="PA", payload=b"x" * 64)
    net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))
    out = net.from_pod(sent)[1]
    assert parse(out).dst == BE1
    verdict, back = net.from_pod(error_about(out, BE1, "frag-needed", quote_len=20 + 20 + 64))
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(back)
    assert e.ip_chksum_ok and e.icmp_chksum_ok and (e.src, e.dst) == (VIP, POD_CLIENT)
    src, dst, sport, dport, ip_ok, l4 = quote_of(back)
    assert (src, dst, sport, dport, ip_ok) == (POD_CLIENT, VIP, 12345, 80, True)
    assert l4 == sent[14 + 20 :]  # header (checksum too) and payload as the client sent them


def test_error_about_a_source_translated_nodeport_packet_reaches_the_external_client(net: Net) -> None:
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL
    net.add_service(NODE, 30080, ((7, REMOTE_BE, 8080, 0),), scope=Scope.EXTERNAL, flags=flags)
    out = net.from_net(tcp(CLIENT, NODE, 5555, 30080, smac=MAC[CLIENT]))[1]
    p = parse(out)
    assert (p.src, p.dst) == (NODE, REMOTE_BE)
    verdict, back = net.from_net(error_about(out, "10.244.2.1", "frag-needed", smac=MAC[NODE2]))
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(back)
    assert (e.src, e.dst, e.dmac) == (NODE, CLIENT, MAC[CLIENT])
    assert e.ip_chksum_ok and e.icmp_chksum_ok
    assert quote_of(back)[:5] == (CLIENT, NODE, 5555, 30080, True)


@pytest.mark.parametrize("kind", ["port-unreachable", "frag-needed"])
def test_error_about_a_reply_reaches_the_backend_as_if_from_the_client(net: Net, kind: str) -> None:
    """The other direction: the client (or a hop toward it) answers a reply, which it got from the
    frontend; the backend must see an error about the packet it sent."""
    net.add_service(port=53, backends=((2, BE2, 5353, BackendFlag.LOCAL),), proto=UDP)
    net.from_pod(udp(POD_CLIENT, VIP, 40002, 53))
    reply = net.from_pod(udp(BE2, POD_CLIENT, 5353, 40002, payload=b"answer"))[1]
    assert parse(reply).src == VIP
    verdict, back = net.from_pod(error_about(reply, POD_CLIENT, kind))
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(back)
    assert (e.src, e.dst, e.dmac) == (POD_CLIENT, BE2, MAC[BE2])
    assert e.ip_chksum_ok and e.icmp_chksum_ok
    assert quote_of(back)[:5] == (BE2, POD_CLIENT, 5353, 40002, True)


def test_error_about_a_nodeport_reply_reaches_the_remote_backend(net: Net) -> None:
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL
    net.add_service(NODE, 30080, ((7, REMOTE_BE, 8080, 0),), scope=Scope.EXTERNAL, flags=flags)
    snat_port = parse(net.from_net(tcp(CLIENT, NODE, 5556, 30080))[1]).sport
    reply = net.from_net(tcp(REMOTE_BE, NODE, 8080, snat_port, flags="SA", smac=MAC[NODE2]))[1]
    assert parse(reply).dst == CLIENT
    verdict, back = net.from_net(error_about(reply, "192.168.0.1", "frag-needed"))
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(back)
    assert (e.src, e.dst, e.dmac) == (NODE, REMOTE_BE, MAC[NODE2])
    assert e.ip_chksum_ok and e.icmp_chksum_ok
    assert quote_of(back)[:5] == (REMOTE_BE, NODE, 8080, snat_port, True)


def test_errors_about_no_flow_of_ours_and_other_icmp_pass(net: Net) -> None:
    from scapy.layers.inet import ICMP, IP
    from scapy.layers.l2 import Ether

    net.add_service()
    stranger = error_about(tcp(POD_CLIENT, BE1, 1111, 8080), ROUTER, "port-unreachable")
    echo = bytes(Ether() / IP(src=POD_CLIENT, dst=VIP) / ICMP())
    for frame in (stranger, echo):
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    assert net.stats()[Stat.PASS] == 2


def test_an_error_not_addressed_to_the_quoted_source_passes_untranslated(net: Net) -> None:
    """An error quoting a live flow's packet but sent to another address than that packet's source
    is no flow's (nf_conntrack_inet_error: "outer daddr != inner", no conntrack): it goes on as it
    came, or anyone could have an error of their making translated and delivered to a flow's client
    or backend by quoting its tuple. Both directions; the same errors addressed right are."""
    net.add_service(port=53, backends=((2, BE2, 5353, BackendFlag.LOCAL),), proto=UDP)
    out = net.from_pod(udp(POD_CLIENT, VIP, 40003, 53))[1]
    reply = net.from_pod(udp(BE2, POD_CLIENT, 5353, 40003, payload=b"answer"))[1]
    assert (parse(out).dst, parse(reply).src) == (BE2, VIP)
    forged = [
        error_about(out, ROUTER, "port-unreachable", to=BE1),  # would be from VIP, about POD_CLIENT's flow
        error_about(reply, POD_CLIENT, "frag-needed", to=BE1),  # would reach BE2, from POD_CLIENT
    ]
    for frame in forged:
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    assert net.stats()[Stat.CT_RELATED] == 0
    assert net.from_pod(error_about(out, ROUTER, "port-unreachable"))[0] == TC_ACT_REDIRECT
    assert net.from_pod(error_about(reply, POD_CLIENT, "frag-needed"))[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.CT_RELATED] == 2


# ---- path MTU: the route says "fragmentation needed" ----------------------------------------


def big_segment(
    src: str, dst: str, sport: int, dport: int, *, df: bool = True, smac: str, dmac: str, data: int = 1400
) -> bytes:
    """A 1,454-byte TCP segment (1,400 bytes of data), DF set or not; `data` bytes of data instead
    (a GSO skb's)."""
    from scapy.layers.inet import IP, TCP
    from scapy.layers.l2 import Ether

    ip = IP(src=src, dst=dst, ttl=64, flags="DF" if df else 0)
    return bytes(Ether(src=smac, dst=dmac) / ip / TCP(sport=sport, dport=dport, flags="PA") / (b"p" * data))


def test_too_big_for_the_backends_path_with_df_answers_fragmentation_needed(net: Net, lab: Lab) -> None:
    """The backend is behind a 1,280-byte MTU: the client is told so, by the frontend, about the
    packet it sent (to the frontend), and lowers its path MTU for the ClusterIP."""
    net.add_service(backends=((3, BE_SMALL_MTU, 8080, BackendFlag.LOCAL),))
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))[1]).dst == BE_SMALL_MTU
    big = big_segment(POD_CLIENT, VIP, 12345, 80, smac=MAC[POD_CLIENT], dmac=lab.pod.mac)
    verdict, out = net.from_pod(big)
    assert verdict == TC_ACT_REDIRECT  # back out of the device it came in by
    e = icmp_error(out)
    assert (e.type, e.code, e.src, e.dst, e.dmac) == (3, 4, VIP, POD_CLIENT, MAC[POD_CLIENT])
    assert e.ip_chksum_ok and e.icmp_chksum_ok and e.length_ok
    assert mtu_of(out) == SMALL_MTU
    assert e.quote[:20] == big[14:34]  # the client's own header: its stack finds the socket
    assert net.stats()[Stat.DROP_FRAG_NEEDED] == 1
    # a segment that fits goes through
    fits = tcp(POD_CLIENT, VIP, 12345, 80, flags="PA", payload=b"p" * 1000)
    assert parse(net.from_pod(fits)[1]).dst == BE_SMALL_MTU


def test_a_full_size_packet_with_bytes_after_it_in_the_frame_is_not_too_big(net: Net, lab: Lab) -> None:
    """A DF packet exactly the backend's path MTU (1,280 bytes by its IP header) followed in its
    frame by 20 bytes that are not the packet's (Ethernet padding, a trailer): it fits, and goes
    through translated; the frame's length (1,300 bytes of IP and more) would have been refused."""
    net.add_service(backends=((3, BE_SMALL_MTU, 8080, BackendFlag.LOCAL),))
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 12351, 80))[1]).dst == BE_SMALL_MTU
    full = big_segment(
        POD_CLIENT, VIP, 12351, 80, smac=MAC[POD_CLIENT], dmac=lab.pod.mac, data=SMALL_MTU - 40
    )
    verdict, out = net.from_pod(full + bytes(20))
    assert verdict == TC_ACT_REDIRECT and parse(out).dst == BE_SMALL_MTU
    assert net.stats()[Stat.DROP_FRAG_NEEDED] == 0


def test_a_gso_burst_of_segments_too_big_for_the_backends_path_answers_fragmentation_needed(
    net: Net, lab: Lab
) -> None:
    """A pod's TSO burst reaches tc as one GSO skb and leaves as segments: segments of 1,400 bytes
    of data (1,440-byte packets, DF) are too big for the backend's 1,280-byte path, so the pod is
    told, as for one such segment (the route lookup without the segments' length passes every GSO
    skb: the segments were dropped at the device, no ICMP). A burst of segments that fit goes
    through, however long the skb."""
    net.add_service(backends=((3, BE_SMALL_MTU, 8080, BackendFlag.LOCAL),))
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 12350, 80))[1]).dst == BE_SMALL_MTU
    burst = big_segment(POD_CLIENT, VIP, 12350, 80, smac=MAC[POD_CLIENT], dmac=lab.pod.mac, data=2800)
    verdict, out = net.from_pod(burst, gso_size=1400)
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(out)
    assert (e.type, e.code, e.src, e.dst, e.dmac) == (3, 4, VIP, POD_CLIENT, MAC[POD_CLIENT])
    assert e.ip_chksum_ok and e.icmp_chksum_ok and e.length_ok
    assert mtu_of(out) == SMALL_MTU and e.quote[:20] == burst[14:34]
    assert net.stats()[Stat.DROP_FRAG_NEEDED] == 1
    verdict, out = net.from_pod(burst, gso_size=1000)  # 1,040-byte segments
    assert verdict == TC_ACT_REDIRECT and parse(out).dst == BE_SMALL_MTU
    assert net.stats()[Stat.DROP_FRAG_NEEDED] == 1


def test_too_big_for_the_clients_path_tells_the_backend(net: Net, lab: Lab) -> None:
    """A reply too big for the client's path: the backend is told, about the packet it sent."""
    net.add_service()
    net.from_pod(tcp(CLIENT_SMALL_MTU, VIP, 23456, 80), via=lab.small)  # the client's own device
    big = big_segment(BE1, CLIENT_SMALL_MTU, 8080, 23456, smac=MAC[BE1], dmac=lab.pod.mac)
    verdict, out = net.from_pod(big)
    assert verdict == TC_ACT_REDIRECT
    e = icmp_error(out)
    assert (e.type, e.code, e.src, e.dst, e.dmac) == (3, 4, CLIENT_SMALL_MTU, BE1, MAC[BE1])
    assert mtu_of(out) == SMALL_MTU and e.quote[:20] == big[14:34]


def test_too_big_without_df_is_translated_and_left_to_the_stack_to_fragment(net: Net, lab: Lab) -> None:
    net.add_service(backends=((3, BE_SMALL_MTU, 8080, BackendFlag.LOCAL),))
    net.from_pod(tcp(POD_CLIENT, VIP, 12346, 80))
    big = big_segment(POD_CLIENT, VIP, 12346, 80, df=False, smac=MAC[POD_CLIENT], dmac=lab.pod.mac)
    verdict, out = net.from_pod(big)
    assert verdict == TC_ACT_OK
    p = parse(out)
    assert (p.dst, p.dport, p.ttl) == (BE_SMALL_MTU, 8080, 64) and checksums_valid(out)


def test_fragmentation_needed_is_not_rate_limited_but_not_sent_to_non_unicast(net: Net, lab: Lab) -> None:
    net.add_service(backends=((3, BE_SMALL_MTU, 8080, BackendFlag.LOCAL),))
    for port in range(30000, 30100):  # more than the reject burst
        net.from_pod(tcp(POD_CLIENT, VIP, port, 80))
        out = net.from_pod(big_segment(POD_CLIENT, VIP, port, 80, smac=MAC[POD_CLIENT], dmac=lab.pod.mac))
        assert out[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.DROP_FRAG_NEEDED] == 100 and net.stats()[Stat.DROP_ICMP_RATE] == 0


def mtu_of(frame: bytes) -> int:
    """The next-hop MTU of an ICMP fragmentation needed (bytes 6-7 of the ICMP header)."""
    return int.from_bytes(frame[14 + 20 + 6 : 14 + 20 + 8], "big")
