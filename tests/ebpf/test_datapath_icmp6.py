"""ICMPv6 errors about the flows the tc programs' IPv6 path translated (bpf/ekp_tc6.h,
ekp_tc6_related), packet by packet through BPF_PROG_TEST_RUN.

An ICMPv6 error quotes the packet it is about as that packet travelled: translated. The node's
stack has no nf_conntrack entry for a flow tc translated, so the error must be translated back
here, as nf_nat_icmpv6_reply_translation does for ip6tables' flows: the outer addresses, the quoted
packet's addresses and ports, the quoted TCP checksum (adjusted, when the quote holds it), and the
ICMPv6 checksum, which covers a pseudo header with the outer addresses. Every checksum is checked
here by a computation of its own (`ones_sum`), not by the code under test nor scapy's.

And the errors the path sends itself about a segment of one of its flows (bpf/ekp_icmp6.h), as
IPv4's answers a segment too big for the backend's device: a Packet Too Big with the device's MTU,
a time exceeded on the segment's last hop, quoting the segment as its sender sent it.

The packet lab of test_datapath_ipv6.py (lab/dplab.py, `add_ipv6`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from ipaddress import IPv6Address

import pytest

from agent.ebpf.abi import Addr6, BackendFlag, Config6, FrontendFlag, Scope, Stat, ip6_words
from agent.ebpf.loader import Datapath
from agent.ebpf.maps import write_config6
from lab.dplab import (
    BE6,
    BE6_2,
    BE6_SMALL_MTU,
    CLIENT6,
    CLIENT6_SMALL_MTU,
    MAC6,
    NODE2_6,
    NODE6,
    POD6,
    REMOTE_BE6,
    SMALL_MTU,
    UDP,
    VIP6,
    Lab,
    Net,
    add_ipv6,
    add_service6,
    packet_lab,
    set_config,
)
from lab.packets import TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT
from tests.ebpf.test_datapath_floods import on_one_cpu
from tests.ebpf.test_datapath_ipv6 import LOCAL_BE, ct6_key, frame6
from tests.ebpf.test_datapath_ipv6_udp import frags6

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

# ICMPv6 error kinds (RFC 4443): type, code, the 32-bit word after the checksum
KINDS = {
    "packet-too-big": (2, 0, 1280),  # the MTU
    "unreachable": (1, 3, 0),  # address unreachable
    "port-unreachable": (1, 4, 0),
    "time-exceeded": (3, 0, 0),
    "parameter-problem": (4, 0, 40),  # the pointer
}
ICMPV6, TCP_PROTO = 58, 6


@pytest.fixture(scope="module")
def lab(dp: Datapath) -> Iterator[Lab]:
    with packet_lab() as built:
        add_ipv6(built)
        yield built


def ones_sum(data: bytes) -> int:
    """The 16-bit one's complement sum of `data` (RFC 1071): 0xffff over a message whose checksum
    is right."""
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def pseudo(src: bytes, dst: bytes, length: int, proto: int) -> bytes:
    """The IPv6 pseudo header (RFC 8200 8.1)."""
    return src + dst + length.to_bytes(4, "big") + bytes(3) + bytes([proto])


def error_about(
    frame: bytes, src: str, kind: str, *, quote_len: int | None = None, smac: str = "", to: str = ""
) -> bytes:
    """The ICMPv6 error `src` sends about `frame` (to its source, or to `to`), quoting its IPv6
    packet: whole (RFC 4443 quotes up to 1280 bytes), or its first `quote_len` bytes."""
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw

    quoted = frame[14:] if quote_len is None else frame[14 : 14 + quote_len]
    icmp_type, code, word = KINDS[kind]
    head = bytes([icmp_type, code, 0, 0]) + word.to_bytes(4, "big")
    dst = IPv6Address(to) if to else IPv6Address(frame[22:38])
    ip = IPv6(src=src, dst=str(dst), nh=ICMPV6, hlim=64)
    message = bytearray(head + quoted)
    length = len(message)
    check = 0xFFFF - ones_sum(pseudo(IPv6Address(src).packed, dst.packed, length, ICMPV6) + message)
    message[2:4] = check.to_bytes(2, "big")
    return bytes(Ether(src=smac or "02:00:00:00:aa:01", dst="02:00:00:00:aa:02") / ip / Raw(bytes(message)))


@dataclass(frozen=True)
class Error6:
    dmac: str
    src: str
    dst: str
    hlim: int
    head: bytes  # type, code, checksum, word
    checksum_ok: bool  # the ICMPv6 checksum over its pseudo header and message
    in_src: str
    in_dst: str
    in_sport: int
    in_dport: int
    in_l4: bytes  # the quoted L4 bytes
    in_tcp_checksum_ok: bool | None  # the quoted TCP checksum, when the whole segment is quoted


def error6(frame: bytes) -> Error6:
    """An ICMPv6 error frame (no extension headers, outer or quoted) read byte by byte."""
    ip, msg = frame[14:54], frame[54:]
    assert ip[6] == ICMPV6
    inner = msg[8:48]
    l4 = msg[48:]
    payload_len = int.from_bytes(inner[4:6], "big")
    whole = inner[6] == TCP_PROTO and len(l4) == payload_len
    return Error6(
        dmac=":".join(f"{b:02x}" for b in frame[0:6]),
        src=str(IPv6Address(ip[8:24])),
        dst=str(IPv6Address(ip[24:40])),
        hlim=ip[7],
        head=msg[:8],
        checksum_ok=ones_sum(pseudo(ip[8:24], ip[24:40], len(msg), ICMPV6) + msg) == 0xFFFF,
        in_src=str(IPv6Address(inner[8:24])),
        in_dst=str(IPv6Address(inner[24:40])),
        in_sport=int.from_bytes(l4[0:2], "big"),
        in_dport=int.from_bytes(l4[2:4], "big"),
        in_l4=l4,
        in_tcp_checksum_ok=(
            ones_sum(pseudo(inner[8:24], inner[24:40], len(l4), TCP_PROTO) + l4) == 0xFFFF if whole else None
        ),
    )


def client_segment(net: Net, sport: int, *, to: str = VIP6) -> tuple[bytes, bytes]:
    """A flow from POD6:sport to [to]:80 opened by its SYN, then a data segment: (as the client
    sent it, as the path translated it)."""
    assert net.from_pod(frame6(POD6, to, sport, 80))[0] == TC_ACT_REDIRECT
    sent = frame6(POD6, to, sport, 80, flags="PA")
    verdict, out = net.from_pod(sent)
    assert verdict == TC_ACT_REDIRECT
    return sent, out


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_error_about_a_clients_segment_reaches_the_client_as_if_from_the_frontend(
    net: Net, kind: str
) -> None:
    """A hop toward the backend (here the backend's neighbour BE6_2) answers the client's segment,
    which it saw going to the backend; the client must get it from the frontend, about the segment
    it sent, byte for byte (TCP checksum included), to find its socket."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    sent, out = client_segment(net, 41000)
    assert str(IPv6Address(out[38:54])) == BE6
    verdict, back = net.from_pod(error_about(out, BE6_2, kind))
    assert verdict == TC_ACT_REDIRECT
    e = error6(back)
    assert (e.dmac, e.src, e.dst, e.hlim) == (MAC6[POD6], VIP6, POD6, 63)
    icmp_type, code, word = KINDS[kind]
    assert (e.head[0], e.head[1], int.from_bytes(e.head[4:8], "big")) == (icmp_type, code, word)
    assert e.checksum_ok, "ICMPv6 checksum"
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport) == (POD6, VIP6, 41000, 80)
    assert e.in_l4 == sent[54:], "the client's own segment, its checksum as it sent it"
    assert e.in_tcp_checksum_ok is True
    assert net.stats()[Stat.CT_RELATED] == 1


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_error_about_a_reply_reaches_the_backend_as_if_from_the_client(net: Net, kind: str) -> None:
    """The other direction: the client (or a hop toward it) answers a reply it got from the
    frontend; the backend must see an error about the segment it sent."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    client_segment(net, 41001)
    reply = frame6(BE6, POD6, 8080, 41001, flags="PA")
    verdict, out = net.from_pod(reply)
    assert verdict == TC_ACT_REDIRECT and str(IPv6Address(out[22:38])) == VIP6
    verdict, back = net.from_pod(error_about(out, POD6, kind))
    assert verdict == TC_ACT_REDIRECT
    e = error6(back)
    assert (e.dmac, e.src, e.dst, e.hlim) == (MAC6[BE6], POD6, BE6, 63)
    assert e.checksum_ok, "ICMPv6 checksum"
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport) == (BE6, POD6, 8080, 41001)
    assert e.in_l4 == reply[54:], "the backend's own segment"
    assert e.in_tcp_checksum_ok is True
    assert net.stats()[Stat.CT_RELATED] == 1


def test_packet_too_big_from_beyond_a_remote_backends_node_reaches_the_client(net: Net) -> None:
    """The traffic lab's case: a link on node2's side is smaller than the client's path, node2
    answers from its own address about the segment on its way to the remote backend, the error
    comes in by the external device and must reach the pod that sent the segment, about its own
    segment to the ClusterIP, so its stack lowers the path MTU of that destination."""
    add_service6(net.dp.maps, VIP6, 80, ((1, REMOTE_BE6, 8080, 0),))
    sent, out = client_segment(net, 41002)
    assert str(IPv6Address(out[38:54])) == REMOTE_BE6
    verdict, back = net.from_net(error_about(out, NODE2_6, "packet-too-big", smac=MAC6[NODE2_6]))
    assert verdict == TC_ACT_REDIRECT
    e = error6(back)
    assert (e.dmac, e.src, e.dst) == (MAC6[POD6], VIP6, POD6)
    assert int.from_bytes(e.head[4:8], "big") == 1280 and e.checksum_ok
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport, e.in_l4) == (POD6, VIP6, 41002, 80, sent[54:])


def test_an_error_about_a_remote_backends_reply_goes_out_to_its_node(net: Net) -> None:
    """The client answers a reply that came in by the external device (a remote backend): the
    error goes back out of that device, to node2's MAC, the backend's own tuple quoted."""
    add_service6(net.dp.maps, VIP6, 80, ((1, REMOTE_BE6, 8080, 0),))
    client_segment(net, 41009)
    reply = frame6(REMOTE_BE6, POD6, 8080, 41009, flags="PA")
    verdict, out = net.from_net(reply)
    assert verdict == TC_ACT_REDIRECT and str(IPv6Address(out[22:38])) == VIP6
    verdict, back = net.from_pod(error_about(out, POD6, "unreachable"))
    assert verdict == TC_ACT_REDIRECT
    e = error6(back)
    assert (e.dmac, e.src, e.dst, e.checksum_ok) == (MAC6[NODE2_6], POD6, REMOTE_BE6, True)
    assert (e.in_src, e.in_dst, e.in_l4, e.in_tcp_checksum_ok) == (REMOTE_BE6, POD6, reply[54:], True)


def test_a_nodeport_flows_error_reaches_the_external_client_from_the_node(net: Net) -> None:
    """An externalTrafficPolicy Local NodePort (no source translation: the tc path's): an error
    from the backend's side about the client's segment reaches the client from the node's
    address, out of the external device."""
    flags = FrontendFlag.NODEPORT | FrontendFlag.LOCAL  # externalTrafficPolicy Local
    add_service6(net.dp.maps, NODE6, 30080, LOCAL_BE, scope=Scope.EXTERNAL, flags=flags)
    assert net.from_net(frame6(CLIENT6, NODE6, 51000, 30080))[0] == TC_ACT_REDIRECT
    sent = frame6(CLIENT6, NODE6, 51000, 30080, flags="PA")
    verdict, out = net.from_net(sent)
    assert verdict == TC_ACT_REDIRECT
    verdict, back = net.from_pod(error_about(out, BE6, "packet-too-big"))
    assert verdict == TC_ACT_REDIRECT
    e = error6(back)
    assert (e.dmac, e.src, e.dst, e.checksum_ok) == (MAC6[CLIENT6], NODE6, CLIENT6, True)
    assert (e.in_src, e.in_dst, e.in_dport, e.in_l4) == (CLIENT6, NODE6, 30080, sent[54:])


def test_a_quote_of_eight_tcp_bytes_gets_its_ports_and_the_icmpv6_checksum_right(net: Net) -> None:
    """A quote that ends before the TCP checksum (8 bytes: the minimum the parser takes) has its
    ports translated; the checksum it does not hold is not written past its end."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    sent, out = client_segment(net, 41003)
    verdict, back = net.from_pod(error_about(out, BE6_2, "time-exceeded", quote_len=40 + 8))
    assert verdict == TC_ACT_REDIRECT
    e = error6(back)
    assert len(back) == 14 + 40 + 8 + 40 + 8 and e.checksum_ok
    assert (e.in_src, e.in_dst, e.in_l4) == (POD6, VIP6, sent[54:62])


def test_a_quote_behind_extension_headers_is_translated(net: Net) -> None:
    """The client's segment carried a destination options header: the quote's own headers are
    walked to its TCP header as the packet's are."""
    from scapy.layers.inet6 import IPv6ExtHdrDestOpt

    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    ext = IPv6ExtHdrDestOpt()
    assert net.from_pod(frame6(POD6, VIP6, 41004, 80, ext=ext))[0] == TC_ACT_REDIRECT
    sent = frame6(POD6, VIP6, 41004, 80, flags="PA", ext=ext)
    out = net.from_pod(sent)[1]
    verdict, back = net.from_pod(error_about(out, BE6_2, "packet-too-big"))
    assert verdict == TC_ACT_REDIRECT
    msg = back[54:]
    assert ones_sum(pseudo(back[22:38], back[38:54], len(msg), ICMPV6) + msg) == 0xFFFF
    assert msg[8 + 8 : 8 + 40] == IPv6Address(POD6).packed + IPv6Address(VIP6).packed
    assert msg[8:][40:] == sent[54:], "the options header and the segment as the client sent them"


def test_errors_about_no_flow_of_the_path_pass_untouched(net: Net) -> None:
    """An error quoting a flow the path never translated (pod to pod, a UDP datagram: ip6tables'),
    or a later fragment (no ports), goes to the stack as it came: nf_conntrack's business."""
    from scapy.layers.inet6 import IPv6ExtHdrFragment

    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    client_segment(net, 41005)
    strangers = [
        error_about(frame6(POD6, BE6, 41006, 8080), BE6_2, "packet-too-big"),
        error_about(frame6(POD6, VIP6, 41007, 53, UDP), BE6_2, "unreachable"),
        error_about(frame6(POD6, BE6, 41005, 8080, ext=IPv6ExtHdrFragment(offset=8)), BE6_2, "time-exceeded"),
    ]
    for frame in strangers:
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    stats = net.stats()
    assert (stats[Stat.PASS], stats[Stat.CT_RELATED]) == (3, 0)


def test_an_error_not_addressed_to_the_quoted_source_passes_untranslated(net: Net) -> None:
    """An error quoting a live flow's segment but sent to another address than that segment's
    source is no flow's (nf_conntrack_inet_error: "outer daddr != inner", no conntrack): it goes to
    the stack as it came, or anyone could have an error of their making translated and delivered
    to a flow's client or backend by quoting its tuple. Both directions; the same errors addressed
    right are."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    _, out = client_segment(net, 41011)
    verdict, reply = net.from_pod(frame6(BE6, POD6, 8080, 41011, flags="PA"))
    assert verdict == TC_ACT_REDIRECT and str(IPv6Address(reply[22:38])) == VIP6
    forged = [
        error_about(out, BE6_2, "packet-too-big", to=BE6),  # would be from VIP6, about POD6's flow
        error_about(reply, POD6, "unreachable", to=BE6_2),  # would reach BE6, from POD6
    ]
    for frame in forged:
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    assert net.stats()[Stat.CT_RELATED] == 0
    assert net.from_pod(error_about(out, BE6_2, "packet-too-big"))[0] == TC_ACT_REDIRECT
    assert net.from_pod(error_about(reply, POD6, "unreachable"))[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.CT_RELATED] == 2


def test_an_error_claiming_a_source_not_routed_to_its_pod_is_dropped(net: Net) -> None:
    """Redirected past the stack's reverse-path filter, an error from a pod passes the same check
    as the flow's packets: a source routed elsewhere (node2's pods) drops as spoofed."""
    add_service6(net.dp.maps, VIP6, 80, ((1, BE6, 8080, BackendFlag.LOCAL),))
    _, out = client_segment(net, 41008)
    verdict, _ = net.from_pod(error_about(out, "fd00:a:2::99", "packet-too-big"))
    assert verdict != TC_ACT_REDIRECT
    assert net.stats()[Stat.DROP_SPOOFED] == 1


def test_packet_too_big_about_a_masqueraded_segment_reaches_the_client_not_the_node(net: Net) -> None:
    """A NodePort flow masqueraded to a remote backend (bpf/ekp_tc6.h): the error about its
    segment from NODE6:snat port comes back to the node's address, and must go on to the client,
    about the segment the client sent to the NodePort (IPv4's ekp_decide_related, its SNAT half)."""
    write_config6(net.dp.maps, Config6(node_addr=Addr6(*ip6_words(NODE6))))
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    add_service6(net.dp.maps, NODE6, 30080, ((1, REMOTE_BE6, 8080, 0),), scope=Scope.EXTERNAL, flags=flags)
    assert net.from_net(frame6(CLIENT6, NODE6, 50400, 30080))[0] == TC_ACT_REDIRECT
    sent = frame6(CLIENT6, NODE6, 50400, 30080, flags="PA")
    verdict, out = net.from_net(sent)
    assert verdict == TC_ACT_REDIRECT
    assert (str(IPv6Address(out[22:38])), str(IPv6Address(out[38:54]))) == (NODE6, REMOTE_BE6)
    verdict, back = net.from_net(error_about(out, NODE2_6, "packet-too-big", smac=MAC6[NODE2_6]))
    assert verdict == TC_ACT_REDIRECT
    e = error6(back)
    assert (e.dmac, e.src, e.dst) == (MAC6[CLIENT6], NODE6, CLIENT6)
    assert e.checksum_ok, "ICMPv6 checksum"
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport) == (CLIENT6, NODE6, 50400, 30080)
    assert e.in_l4 == sent[54:], "the client's own segment"
    assert net.stats()[Stat.CT_RELATED] == 1


def test_an_error_about_a_reply_of_a_masqueraded_flow_reaches_the_backend_about_its_segment(net: Net) -> None:
    """The other direction: the client answers a reply it got from the NodePort; the remote backend
    must see an error from the node's address about the segment it sent to the node's SNAT port."""
    write_config6(net.dp.maps, Config6(node_addr=Addr6(*ip6_words(NODE6))))
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    add_service6(net.dp.maps, NODE6, 30080, ((1, REMOTE_BE6, 8080, 0),), scope=Scope.EXTERNAL, flags=flags)
    verdict, syn = net.from_net(frame6(CLIENT6, NODE6, 50401, 30080))
    assert verdict == TC_ACT_REDIRECT
    snat_port = int.from_bytes(syn[54:56], "big")
    reply = frame6(REMOTE_BE6, NODE6, 8080, snat_port, flags="PA")
    verdict, out = net.from_net(reply)
    assert verdict == TC_ACT_REDIRECT and str(IPv6Address(out[38:54])) == CLIENT6
    verdict, back = net.from_net(error_about(out, CLIENT6, "unreachable", smac=MAC6[CLIENT6]))
    assert verdict == TC_ACT_REDIRECT
    e = error6(back)
    assert (e.dmac, e.src, e.dst) == (MAC6[NODE2_6], NODE6, REMOTE_BE6)
    assert e.checksum_ok, "ICMPv6 checksum"
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport) == (REMOTE_BE6, NODE6, 8080, snat_port)
    assert e.in_l4 == reply[54:], "the backend's own segment"
    assert net.stats()[Stat.CT_RELATED] == 1


def test_errors_rewritten_on_a_checksum_complete_skb_keep_its_skb_csum(net: Net) -> None:
    """The error's rewrite (outer addresses, quote, quoted TCP and ICMPv6 checksums) on a
    CHECKSUM_COMPLETE skb (BPF_F_TEST_SKB_CHECKSUM_COMPLETE: the run fails if skb->csum no longer
    sums the packet): plain stores whose changes the ICMPv6 checksum balances, so skb->csum must be
    left as it was, both directions and a masqueraded flow's."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    _, out = client_segment(net, 41010)
    verdict, back = net.from_pod(error_about(out, BE6_2, "packet-too-big"), csum_complete=True)
    assert verdict == TC_ACT_REDIRECT and error6(back).checksum_ok
    reply = frame6(BE6, POD6, 8080, 41010, flags="PA")
    verdict, out = net.from_pod(reply)
    assert verdict == TC_ACT_REDIRECT
    verdict, back = net.from_pod(error_about(out, POD6, "unreachable"), csum_complete=True)
    assert verdict == TC_ACT_REDIRECT and error6(back).checksum_ok
    write_config6(net.dp.maps, Config6(node_addr=Addr6(*ip6_words(NODE6))))
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    add_service6(
        net.dp.maps,
        NODE6,
        30080,
        ((1, REMOTE_BE6, 8080, 0),),
        scope=Scope.EXTERNAL,
        flags=flags,
        svc_id=2,
        set_id=2,
    )
    assert net.from_net(frame6(CLIENT6, NODE6, 50410, 30080))[0] == TC_ACT_REDIRECT
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50410, 30080, flags="PA"))
    assert verdict == TC_ACT_REDIRECT
    error = error_about(out, NODE2_6, "packet-too-big", smac=MAC6[NODE2_6])
    verdict, back = net.from_net(error, csum_complete=True)
    assert verdict == TC_ACT_REDIRECT and error6(back).dst == CLIENT6
    assert net.stats()[Stat.CT_RELATED] == 3


# ---- the path's own errors: Packet Too Big, time exceeded (bpf/ekp_icmp6.h) ----------------


def big_segment6(
    src: str, dst: str, sport: int, dport: int, *, smac: str, dmac: str, hlim: int = 64, data: int = 1400
) -> bytes:
    """A 1,474-byte IPv6 TCP segment (1,400 bytes of data): too big for small0's 1,280; `data`
    bytes of data instead (a GSO skb's)."""
    from scapy.layers.inet import TCP as TCPh
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    ip = IPv6(src=src, dst=dst, hlim=hlim)
    return bytes(Ether(src=smac, dst=dmac) / ip / TCPh(sport=sport, dport=dport, flags="PA") / (b"p" * data))


def assert_answers(out: bytes, sent: bytes, *, icmp: tuple[int, int, int], src: str, dst: str) -> None:
    """`out` is the ICMPv6 error (type, code, word) from `src` to `dst` quoting `sent`'s IPv6 header
    and TCP base header as sent, back to the MAC `sent` came from, every checksum right."""
    e = error6(out)
    assert (e.dmac, e.src, e.dst, e.hlim) == (":".join(f"{b:02x}" for b in sent[6:12]), src, dst, 64)
    assert (e.head[0], e.head[1], int.from_bytes(e.head[4:8], "big")) == icmp
    assert e.checksum_ok, "ICMPv6 checksum"
    assert out[62:] == sent[14 : 14 + 40 + 20], "the segment as sent, cut after its TCP header"
    assert int.from_bytes(out[18:20], "big") == len(out) - 54, "payload length"


def test_too_big_for_the_backends_device_answers_packet_too_big_from_the_frontend(net: Net, lab: Lab) -> None:
    """The backend is behind a 1,280-byte MTU: the client is told so by the frontend, about the
    segment it sent (to the frontend), and lowers its path MTU for the ClusterIP; the node's stack
    would have answered about a flow it does not know (ip6tables translating it again)."""
    add_service6(net.dp.maps, VIP6, 80, ((1, BE6_SMALL_MTU, 8080, BackendFlag.LOCAL),))
    assert net.from_pod(frame6(POD6, VIP6, 42000, 80))[0] == TC_ACT_REDIRECT
    big = big_segment6(POD6, VIP6, 42000, 80, smac=MAC6[POD6], dmac=lab.pod.mac)
    verdict, out = net.from_pod(big)
    assert verdict == TC_ACT_REDIRECT  # back out of the device it came in by
    assert_answers(out, big, icmp=(2, 0, SMALL_MTU), src=VIP6, dst=POD6)
    assert net.stats()[Stat.DROP_FRAG_NEEDED] == 1
    # a segment that fits goes through, translated
    verdict, out = net.from_pod(frame6(POD6, VIP6, 42000, 80, flags="PA"))
    assert verdict == TC_ACT_REDIRECT and str(IPv6Address(out[38:54])) == BE6_SMALL_MTU


def test_a_new_flows_first_datagram_too_big_for_the_backend_answers_packet_too_big_without_a_flow(
    net: Net, lab: Lab
) -> None:
    """A UDP datagram that would open a flow, too big for its backend's device: the client is told
    so by the frontend, as a hit's segment is, and no flow is made (the next, smaller datagram
    opens it). Left to the stack, with ip6tables' rules thinned to what the eBPF programs leave,
    it would be routed to the ClusterIP untranslated and no Packet Too Big would reach the client."""
    from scapy.layers.inet import UDP as UDPh
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    add_service6(net.dp.maps, VIP6, 53, ((1, BE6_SMALL_MTU, 5353, BackendFlag.LOCAL),), proto=UDP)
    big = bytes(
        Ether(src=MAC6[POD6], dst=lab.pod.mac)
        / IPv6(src=POD6, dst=VIP6)
        / UDPh(sport=42100, dport=53)
        / (b"q" * 1400)
    )
    verdict, out = net.from_pod(big)
    assert verdict == TC_ACT_REDIRECT  # back out of the device it came in by
    e = error6(out)
    assert (e.dmac, e.src, e.dst, e.hlim) == (MAC6[POD6], VIP6, POD6, 64)
    assert (e.head[0], e.head[1], int.from_bytes(e.head[4:8], "big")) == (2, 0, SMALL_MTU)
    assert e.checksum_ok, "ICMPv6 checksum"
    assert out[62 : 62 + 48] == big[14 : 14 + 48], "the datagram as sent, to the frontend"
    stats = net.stats()
    assert stats[Stat.DROP_FRAG_NEEDED] == 1 and stats[Stat.NEW_FLOWS] == 0
    assert len(net.dp.maps["ct6_any"].keys()) == 0, "no flow made"
    small = bytes(
        Ether(src=MAC6[POD6], dst=lab.pod.mac) / IPv6(src=POD6, dst=VIP6) / UDPh(sport=42100, dport=53) / b"q"
    )
    verdict, out = net.from_pod(small)
    assert verdict == TC_ACT_REDIRECT and str(IPv6Address(out[38:54])) == BE6_SMALL_MTU
    assert net.stats()[Stat.NEW_FLOWS] == 1


def test_a_full_size_segment_with_bytes_after_it_in_the_frame_is_not_too_big(net: Net, lab: Lab) -> None:
    """A segment exactly the backend's device MTU by its header (40 + payload length: 1,280)
    followed in its frame by 20 bytes that are not the packet's: it fits, and goes through
    translated; the frame's length would have been answered with a Packet Too Big."""
    add_service6(net.dp.maps, VIP6, 80, ((1, BE6_SMALL_MTU, 8080, BackendFlag.LOCAL),))
    assert net.from_pod(frame6(POD6, VIP6, 42011, 80))[0] == TC_ACT_REDIRECT
    full = big_segment6(POD6, VIP6, 42011, 80, smac=MAC6[POD6], dmac=lab.pod.mac, data=SMALL_MTU - 60)
    verdict, out = net.from_pod(full + bytes(20))
    assert verdict == TC_ACT_REDIRECT and str(IPv6Address(out[38:54])) == BE6_SMALL_MTU
    assert net.stats()[Stat.DROP_FRAG_NEEDED] == 0


def test_a_gso_burst_of_segments_too_big_for_the_backends_device_answers_packet_too_big(
    net: Net, lab: Lab
) -> None:
    """A pod's TSO burst reaches tc as one GSO skb and leaves as segments: segments of 1,400 bytes
    of data (1,460-byte packets) are too big for the backend's 1,280-byte device, so the pod is
    told, as for one such segment (the route lookup without the segments' length passes every GSO
    skb: the segments were dropped at the device, no Packet Too Big, the sender waiting for its
    retransmission timeout). A burst of segments that fit goes through, however long the skb."""
    add_service6(net.dp.maps, VIP6, 80, ((1, BE6_SMALL_MTU, 8080, BackendFlag.LOCAL),))
    assert net.from_pod(frame6(POD6, VIP6, 42010, 80))[0] == TC_ACT_REDIRECT
    burst = big_segment6(POD6, VIP6, 42010, 80, smac=MAC6[POD6], dmac=lab.pod.mac, data=2800)
    verdict, out = net.from_pod(burst, gso_size=1400)
    assert verdict == TC_ACT_REDIRECT
    assert_answers(out, burst, icmp=(2, 0, SMALL_MTU), src=VIP6, dst=POD6)
    assert net.stats()[Stat.DROP_FRAG_NEEDED] == 1
    verdict, out = net.from_pod(burst, gso_size=1000)  # 1,060-byte segments
    assert verdict == TC_ACT_REDIRECT and str(IPv6Address(out[38:54])) == BE6_SMALL_MTU
    assert net.stats()[Stat.DROP_FRAG_NEEDED] == 1


def test_too_big_for_the_clients_device_tells_the_backend(net: Net, lab: Lab) -> None:
    """A reply too big for the client's device: the backend is told, by the client's address (the
    one it sent to), about the segment it sent."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    assert net.from_pod(frame6(CLIENT6_SMALL_MTU, VIP6, 42001, 80), via=lab.small)[0] == TC_ACT_REDIRECT
    big = big_segment6(BE6, CLIENT6_SMALL_MTU, 8080, 42001, smac=MAC6[BE6], dmac=lab.pod.mac)
    verdict, out = net.from_pod(big)
    assert verdict == TC_ACT_REDIRECT
    assert_answers(out, big, icmp=(2, 0, SMALL_MTU), src=CLIENT6_SMALL_MTU, dst=BE6)


def test_the_last_hop_of_a_flows_segment_is_answered_with_time_exceeded(net: Net, lab: Lab) -> None:
    """Hop limit 1 on a hit: this hop would spend it, so the sender gets a time exceeded from the
    address it targeted, about what it sent (a traceroute through the ClusterIP), and the segment
    goes nowhere; both directions. A SYN at its last hop still goes to the stack (no flow yet)."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    assert net.from_pod(frame6(POD6, VIP6, 42002, 80))[0] == TC_ACT_REDIRECT
    last = frame6(POD6, VIP6, 42002, 80, flags="PA", hlim=1)
    verdict, out = net.from_pod(last)
    assert verdict == TC_ACT_REDIRECT
    assert_answers(out, last, icmp=(3, 0, 0), src=VIP6, dst=POD6)
    reply = frame6(BE6, POD6, 8080, 42002, flags="PA", hlim=1)
    verdict, out = net.from_pod(reply)
    assert verdict == TC_ACT_REDIRECT
    assert_answers(out, reply, icmp=(3, 0, 0), src=POD6, dst=BE6)
    assert net.stats()[Stat.DROP_HOP_LIMIT] == 2
    syn = frame6(POD6, VIP6, 42003, 80, hlim=1)
    assert net.from_pod(syn) == (TC_ACT_OK, syn)


# ---- refusals (ekp_tc6_refuse: IPv4's decision, ekp_decide_refusal) ------------------------


def test_a_syn_to_a_frontend_without_endpoints_is_answered_with_port_unreachable_from_it(
    net: Net, lab: Lab
) -> None:
    """ip6tables' `-j REJECT` (icmp6-port-unreachable): the client's SYN comes back as a
    destination unreachable, port unreachable (1, 4) from the ClusterIP it targeted, quoting the
    SYN as sent, out of the device it came in by; no flow is made. A segment that opens no flow
    (one of a connection ip6tables translated before) still goes to the stack, as upstream's
    REJECT matches new connections only."""
    add_service6(net.dp.maps, VIP6, 80, (), flags=FrontendFlag.NO_ENDPOINTS)
    syn = frame6(POD6, VIP6, 42200, 80)
    verdict, out = net.from_pod(syn)
    assert verdict == TC_ACT_REDIRECT
    assert_answers(out, syn, icmp=(1, 4, 0), src=VIP6, dst=POD6)
    assert net.stats()[Stat.DROP_NO_ENDPOINTS] == 1
    assert len(net.dp.maps["ct6_tcp"].keys()) == 0
    mid = frame6(POD6, VIP6, 42201, 80, flags="A")
    assert net.from_pod(mid) == (TC_ACT_OK, mid)
    assert net.stats()[Stat.DROP_NO_ENDPOINTS] == 1


def test_a_datagram_to_a_node_port_without_endpoints_is_answered_quoting_its_udp_header(
    net: Net, lab: Lab
) -> None:
    """A UDP datagram from outside: the answer quotes its IPv6 header and the 8-byte UDP header
    (what a CHECKSUM_PARTIAL skb may be cut to; no more, so a short datagram is never padded), the
    ICMPv6 checksum right over the pseudo header and the quote."""
    from scapy.layers.inet import UDP as UDPh
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    flags = FrontendFlag.NODEPORT | FrontendFlag.NO_ENDPOINTS
    add_service6(net.dp.maps, NODE6, 30053, (), proto=UDP, scope=Scope.EXTERNAL, flags=flags)
    sent = bytes(
        Ether(src=MAC6[CLIENT6], dst=lab.ext.mac)
        / IPv6(src=CLIENT6, dst=NODE6)
        / UDPh(sport=5353, dport=30053)
        / b"q"
    )
    verdict, out = net.from_net(sent)
    assert verdict == TC_ACT_REDIRECT
    e = error6(out)
    assert (e.dmac, e.src, e.dst, e.hlim) == (MAC6[CLIENT6], NODE6, CLIENT6, 64)
    assert (e.head[0], e.head[1], int.from_bytes(e.head[4:8], "big")) == (1, 4, 0)
    assert e.checksum_ok, "ICMPv6 checksum"
    assert out[62:] == sent[14 : 14 + 40 + 8], "the datagram's IPv6 and UDP headers as sent"
    assert int.from_bytes(out[18:20], "big") == 8 + 40 + 8, "payload length"
    assert net.stats()[Stat.DROP_NO_ENDPOINTS] == 1 and len(net.dp.maps["ct6_any"].keys()) == 0


def test_port_unreachables_are_rate_limited_and_unwanted_ones_dropped(net: Net, dp: Datapath) -> None:
    """The rejects' bucket (a burst of 10, 100 per second here), IPv4's: 300 SYNs at once get about
    10 answers, the rest dropped under DROP_ICMP_RATE. Before them, SYNs no answer is owed (a frame
    to Ethernet broadcast or to a multicast address, as icmp6_send refuses by skb->pkt_type; a SYN
    with RST; a multicast source) are dropped under DROP_NO_ENDPOINTS, taking no token."""
    set_config(dp, icmp_rate=100, icmp_burst=10)
    add_service6(net.dp.maps, VIP6, 80, (), flags=FrontendFlag.NO_ENDPOINTS)
    syn = frame6(POD6, VIP6, 42990, 80)
    unwanted = {
        "broadcast frame": b"\xff" * 6 + syn[6:],
        "multicast frame": bytes.fromhex("333300000001") + syn[6:],
        "SYN with RST": frame6(POD6, VIP6, 42991, 80, flags="SR"),
        "multicast source": frame6("ff02::1", VIP6, 42992, 80),
    }
    for name, frame in unwanted.items():
        assert net.from_pod(frame)[0] == TC_ACT_SHOT, name
    assert (net.stats()[Stat.DROP_NO_ENDPOINTS], net.stats()[Stat.DROP_ICMP_RATE]) == (4, 0)
    with on_one_cpu():
        started = time.monotonic()
        answered = sum(
            net.from_pod(frame6(POD6, VIP6, 43000 + i, 80))[0] == TC_ACT_REDIRECT for i in range(300)
        )
        elapsed = time.monotonic() - started
    assert 10 <= answered <= 10 + 100 * elapsed + 1
    stats = net.stats()
    assert (stats[Stat.DROP_NO_ENDPOINTS], stats[Stat.DROP_ICMP_RATE]) == (4 + answered, 300 - answered)


def test_the_later_fragments_of_a_refused_datagram_are_dropped_under_its_reason(net: Net) -> None:
    """A datagram in three fragments to a frontend without endpoints: the first is answered (port
    unreachable); the later ones, whose quote would hold no ports, are dropped under the same
    reason, as IPv4's path drops them, rather than left to the stack, which would reassemble a
    datagram whose first fragment it never got."""
    add_service6(net.dp.maps, VIP6, 53, (), proto=UDP, flags=FrontendFlag.NO_ENDPOINTS)
    first, *later = frags6(POD6, VIP6, 5353, 53, bytes(3000), ident=77)
    assert len(later) == 2
    verdict, out = net.from_pod(first)
    assert verdict == TC_ACT_REDIRECT and (error6(out).head[0], error6(out).head[1]) == (1, 4)
    for piece in later:
        assert net.from_pod(piece)[0] == TC_ACT_SHOT
    stats = net.stats()
    assert (stats[Stat.DROP_NO_ENDPOINTS], stats[Stat.DROP_ICMP_RATE], stats[Stat.NEW_FLOWS]) == (3, 0, 0)
    assert len(net.dp.maps["ct6_any"].keys()) == 0


def test_the_later_fragments_of_a_tcp_segment_without_an_entry_go_to_the_stack(net: Net) -> None:
    """A fragmented TCP segment that opens no flow (no SYN: a flow ip6tables translated, whose
    nf_conntrack entry the stack has) to a frontend that refuses now: its first fragment goes to the
    stack, and so do the later ones, whatever the frontend says, or the stack could never put the
    segment back together."""
    from scapy.layers.inet import TCP as TCPh
    from scapy.layers.inet6 import IPv6, IPv6ExtHdrFragment, fragment6
    from scapy.layers.l2 import Ether

    add_service6(net.dp.maps, VIP6, 80, (), flags=FrontendFlag.NO_ENDPOINTS)
    segment = IPv6(src=POD6, dst=VIP6) / IPv6ExtHdrFragment(id=78) / TCPh(sport=40078, dport=80, flags="A")
    pieces = fragment6(segment / (b"x" * 3000), 1280)  # type: ignore[no-untyped-call]
    assert len(pieces) >= 3
    for piece in pieces:
        frame = bytes(Ether(src="02:00:00:00:aa:01", dst="02:00:00:00:aa:02") / piece)
        assert net.from_pod(frame) == (TC_ACT_OK, frame)
    assert net.stats()[Stat.DROP_NO_ENDPOINTS] == 0


def test_no_local_endpoint_and_a_source_outside_the_ranges_are_dropped(net: Net) -> None:
    """What IPv4's path and kube-proxy (KUBE-MARK-DROP) do: a NodePort of policy Local with no
    endpoint on this node, and a LoadBalancer IP's client outside loadBalancerSourceRanges, are
    dropped unanswered and counted; a client inside the ranges is translated."""
    from agent.ebpf import abi

    local = FrontendFlag.NODEPORT | FrontendFlag.LOCAL
    add_service6(
        net.dp.maps, NODE6, 30080, ((1, REMOTE_BE6, 8080, 0),), scope=Scope.EXTERNAL, flags=local, count=0
    )
    assert net.from_net(frame6(CLIENT6, NODE6, 42300, 30080))[0] == TC_ACT_SHOT
    lb = "fd00:ff::50"  # a LoadBalancer IP
    add_service6(
        net.dp.maps,
        lb,
        80,
        LOCAL_BE,
        scope=Scope.EXTERNAL,
        flags=FrontendFlag.SOURCE_RANGES,
        svc_id=2,
        set_id=2,
        rev_nat_id=9,
    )
    allowed = abi.SrcRange6Key(32 + 128, 9, 0, Addr6(*ip6_words(CLIENT6)))  # CLIENT6/128, rev_nat 9
    net.dp.maps["srcr6"].update(allowed, abi.SrcRange(1))
    assert net.from_net(frame6("fd00:ff::99", lb, 42301, 80))[0] == TC_ACT_SHOT
    assert net.from_net(frame6(CLIENT6, lb, 42302, 80))[0] == TC_ACT_REDIRECT
    stats = net.stats()
    assert (stats[Stat.DROP_NO_LOCAL], stats[Stat.DROP_SOURCE_RANGE], stats[Stat.NEW_FLOWS]) == (1, 1, 1)
    assert len(net.dp.maps["ct6_tcp"].keys()) == 2  # the allowed client's flow alone


def test_no_error_goes_to_a_source_the_stack_would_drop_as_a_martian(net: Net) -> None:
    """A segment at its last hop of a flow from the unspecified, loopback, an IPv4-mapped or a
    multicast source (entries written behind the data path's back: no pod sends from those) is
    dropped unanswered, as ip6_rcv_core would drop an answer's way back and IPv4's refuses 0/8 and
    127/8; a real client's is answered."""
    add_service6(net.dp.maps, NODE6, 30080, LOCAL_BE, scope=Scope.EXTERNAL, flags=FrontendFlag.NODEPORT)
    assert net.from_net(frame6(CLIENT6, NODE6, 42100, 30080))[0] == TC_ACT_REDIRECT
    forward = net.dp.maps["ct6_tcp"].lookup(ct6_key(CLIENT6, NODE6, 42100, 30080))
    assert forward is not None
    for src in ("::", "::1", "::ffff:10.0.0.1", "ff02::1"):
        net.dp.maps["ct6_tcp"].update(ct6_key(src, NODE6, 42100, 30080), forward)
        last = frame6(src, NODE6, 42100, 30080, flags="PA", hlim=1)
        assert net.from_net(last)[0] == TC_ACT_SHOT, src
    assert net.stats()[Stat.DROP_HOP_LIMIT] == 4
    assert net.from_net(frame6(CLIENT6, NODE6, 42100, 30080, flags="PA", hlim=1))[0] == TC_ACT_REDIRECT


def test_time_exceeded_is_rate_limited_packet_too_big_is_not(net: Net, dp: Datapath, lab: Lab) -> None:
    """Time exceeded takes the rejects' tokens (a burst of 3, 1 per second here), as the kernel
    limits it; Packet Too Big is exempt, as IPv4's fragmentation needed and the kernel's
    icmpv6_xrlim_allow: path-MTU discovery depends on it."""
    set_config(dp, icmp_rate=1, icmp_burst=3)
    add_service6(net.dp.maps, VIP6, 80, ((1, BE6_SMALL_MTU, 8080, BackendFlag.LOCAL),))
    assert net.from_pod(frame6(POD6, VIP6, 42004, 80))[0] == TC_ACT_REDIRECT
    with on_one_cpu():
        started = time.monotonic()
        answered = sum(
            net.from_pod(frame6(POD6, VIP6, 42004, 80, flags="PA", hlim=1))[0] == TC_ACT_REDIRECT
            for _ in range(20)
        )
        elapsed = time.monotonic() - started
        big = big_segment6(POD6, VIP6, 42004, 80, smac=MAC6[POD6], dmac=lab.pod.mac)
        too_big = [net.from_pod(big)[0] for _ in range(20)]
    assert 3 <= answered <= 3 + elapsed + 1
    assert too_big == [TC_ACT_REDIRECT] * 20
    stats = net.stats()
    assert (stats[Stat.DROP_HOP_LIMIT], stats[Stat.DROP_ICMP_RATE]) == (answered, 20 - answered)
    assert stats[Stat.DROP_FRAG_NEEDED] == 20
