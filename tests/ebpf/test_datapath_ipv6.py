"""The tc programs' IPv6 path (bpf/ekp_tc6.h), packet by packet through BPF_PROG_TEST_RUN: the
IPv4 ingress programs hand IPv6 frames to ekp_from_pod6 / ekp_from_net6 by a tail call, which
translate the flows that need no source translation (a local backend, a frontend asking no SNAT)
with conntrack of their own (ekp_ct6_*) and leave every other packet to the node's stack untouched,
where the ip6tables proxier beside the eBPF programs serves it.

The packet lab (lab/dplab.py) with IPv6 beside IPv4 on the same devices (`add_ipv6`).
"""

from __future__ import annotations

import ctypes as ct
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from agent.ebpf import abi, activity
from agent.ebpf.abi import BackendFlag, CtDir, FrontendFlag, Scope, Stat, ip6_words, port_be
from agent.ebpf.loader import Datapath, ring_position
from agent.ebpf.proxier import render_live_maps
from lab.dplab import (
    BE6,
    BE6_2,
    CLIENT6,
    MAC6,
    NODE2_6,
    NODE6,
    POD6,
    REMOTE_BE6,
    SIZES,
    SNAT_MAX,
    SNAT_MIN,
    TCP,
    UDP,
    VIP6,
    Lab,
    Net,
    add_ipv6,
    add_service6,
    packet_lab,
    reset_maps,
    set_config,
)
from lab.packets import TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, loaded_datapath

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]


@pytest.fixture(scope="module")
def lab(dp: Datapath) -> Iterator[Lab]:
    with packet_lab() as built:
        add_ipv6(built)
        yield built


def frame6(
    src: str,
    dst: str,
    sport: int,
    dport: int,
    proto: int = TCP,
    *,
    flags: str = "S",
    ext: Any = None,
    hlim: int = 64,
) -> bytes:
    """An IPv6 TCP or UDP frame; `ext` (scapy extension headers) between IPv6 and the L4 header."""
    from scapy.layers.inet import TCP as TCPh
    from scapy.layers.inet import UDP as UDPh
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    l4 = TCPh(sport=sport, dport=dport, flags=flags) if proto == TCP else UDPh(sport=sport, dport=dport)
    l3 = IPv6(src=src, dst=dst, hlim=hlim)
    if ext is not None:
        l3 = l3 / ext
    return bytes(Ether(src="02:00:00:00:aa:01", dst="02:00:00:00:aa:02") / l3 / l4 / b"hello")


def seen(frame: bytes) -> tuple[str, str, str, int, str, int, int]:
    """(dmac, src, dst, sport, ... dport, hop limit) of an IPv6 frame, asserting its L4 checksum
    is what scapy computes for its addresses and bytes."""
    from scapy.layers.inet import TCP as TCPh
    from scapy.layers.inet import UDP as UDPh
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    pkt = Ether(frame)
    ip = pkt[IPv6]
    l4 = pkt[TCPh] if TCPh in pkt else pkt[UDPh]
    fresh = Ether(frame)
    del (fresh[TCPh] if TCPh in fresh else fresh[UDPh]).chksum
    again = Ether(bytes(fresh))
    assert (again[TCPh] if TCPh in again else again[UDPh]).chksum == l4.chksum, "L4 checksum"
    return pkt.dst, ip.src, ip.dst, l4.sport, pkt.src, l4.dport, ip.hlim


def ct6_key(src: str, dst: str, sport: int, dport: int, proto: int = TCP, *, reply: bool = False) -> Any:
    return abi.Ct6Key(
        abi.Addr6(*ip6_words(src)),
        abi.Addr6(*ip6_words(dst)),
        port_be(sport),
        port_be(dport),
        proto,
        CtDir.REPLY if reply else CtDir.FORWARD,
    )


def ct6(
    net: Net, src: str, dst: str, sport: int, dport: int, proto: int = TCP, *, reply: bool = False
) -> Any:
    key = ct6_key(src, dst, sport, dport, proto, reply=reply)
    return net.dp.maps["ct6_tcp" if proto == TCP else "ct6_any"].lookup(key)


def ct6_count(net: Net) -> int:
    return len(net.dp.maps["ct6_tcp"].keys()) + len(net.dp.maps["ct6_any"].keys())


LOCAL_BE = ((1, BE6, 8080, BackendFlag.LOCAL),)


def test_agent_inspect_ct_shows_the_ipv6_flows_beside_the_ipv4_ones(net: Net) -> None:
    """`agent inspect maps ct` on live pins: a flow the IPv6 path translated, both directions, as
    `ct6` lines after IPv4's (none here)."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    verdict, _ = net.from_pod(frame6(POD6, VIP6, 40000, 80))
    assert verdict == TC_ACT_REDIRECT
    created = ct6(net, POD6, VIP6, 40000, 80)
    text = render_live_maps(net.dp.pin_path, ("ct",), now_ns=created.last_seen_ns)
    assert text.splitlines() == [
        f"ct6 [{BE6}]:8080 -> [{POD6}]:40000/TCP reply fe=[{VIP6}]:80 svc=1 be=1 flags=- idle=0s age=0s",
        f"ct6 [{POD6}]:40000 -> [{VIP6}]:80/TCP forward fe=[{VIP6}]:80 nat=[{BE6}]:8080 svc=1 be=1 "
        "flags=- idle=0s age=0s",
    ]


# ---- translated ----------------------------------------------------------------------------


def test_a_pod_to_a_cluster_ip_is_translated_and_its_reply_reverse_translated(net: Net) -> None:
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40000, 80))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[:4] == (MAC6[BE6], POD6, BE6, 40000)
    assert seen(out)[5:] == (8080, 63)
    assert ct6(net, POD6, VIP6, 40000, 80) is not None
    assert ct6(net, BE6, POD6, 8080, 40000, reply=True) is not None
    assert net.stats()[Stat.NEW_FLOWS] == 1

    verdict, out = net.from_pod(frame6(BE6, POD6, 8080, 40000, flags="SA"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[:4] == (MAC6[POD6], VIP6, POD6, 80)
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40000, 80, flags="A"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (POD6, BE6, 40000)
    stats = net.stats()
    assert (stats[Stat.CT_REPLY], stats[Stat.CT_FORWARD], stats[Stat.PACKETS]) == (1, 1, 3)
    entry = ct6(net, POD6, VIP6, 40000, 80)
    assert entry.flags & abi.CtFlag.ESTABLISHED, "the handshake moved the flow's state"


def test_a_nodeport_from_outside_to_a_local_backend_is_translated_both_ways(net: Net) -> None:
    flags = FrontendFlag.NODEPORT | FrontendFlag.LOCAL  # externalTrafficPolicy Local
    add_service6(net.dp.maps, NODE6, 30080, LOCAL_BE, scope=Scope.EXTERNAL, flags=flags)
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50000, 30080))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[:4] == (MAC6[BE6], CLIENT6, BE6, 50000)
    verdict, out = net.from_pod(frame6(BE6, CLIENT6, 8080, 50000, flags="SA"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[:4] == (MAC6[CLIENT6], NODE6, CLIENT6, 30080), "the client sees the NodePort"


def test_a_cluster_ip_to_a_remote_backend_without_snat_goes_to_its_node(net: Net) -> None:
    add_service6(net.dp.maps, VIP6, 80, ((1, REMOTE_BE6, 8080, 0),))
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40001, 80))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[:4] == (MAC6[NODE2_6], POD6, REMOTE_BE6, 40001)
    verdict, out = net.from_net(frame6(REMOTE_BE6, POD6, 8080, 40001, flags="SA"))
    assert verdict == TC_ACT_REDIRECT, "the reply comes back by the external device"
    assert seen(out)[:4] == (MAC6[POD6], VIP6, POD6, 80)


def test_a_checksum_complete_packet_keeps_its_skb_csum_through_the_translation(net: Net) -> None:
    """A packet a NIC passed up CHECKSUM_COMPLETE (skb->csum: the sum of the data from the IPv6
    header on, which the stack checks the L4 checksum against): after the address, port and hop
    limit rewrites skb->csum must still be the data's sum, or the receiver drops the packet as
    corrupt. BPF_PROG_TEST_RUN seeds skb->csum and fails the run (EBADMSG) when the program left it
    stale. Both directions, a NodePort (both addresses change on the reply) and a ClusterIP."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40120, 80), csum_complete=True)
    assert verdict == TC_ACT_REDIRECT and seen(out)[1:4] == (POD6, BE6, 40120)
    verdict, out = net.from_pod(frame6(BE6, POD6, 8080, 40120, flags="SA"), csum_complete=True)
    assert verdict == TC_ACT_REDIRECT and seen(out)[1:4] == (VIP6, POD6, 80)
    flags = FrontendFlag.NODEPORT | FrontendFlag.LOCAL
    add_service6(net.dp.maps, NODE6, 30080, LOCAL_BE, scope=Scope.EXTERNAL, flags=flags, svc_id=2, set_id=2)
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50120, 30080), csum_complete=True)
    assert verdict == TC_ACT_REDIRECT and seen(out)[1:4] == (CLIENT6, BE6, 50120)
    verdict, out = net.from_pod(frame6(BE6, CLIENT6, 8080, 50120, flags="SA"), csum_complete=True)
    assert verdict == TC_ACT_REDIRECT and seen(out)[1:4] == (NODE6, CLIENT6, 30080)


def test_tcp_behind_extension_headers_is_translated_with_its_checksum(net: Net) -> None:
    from scapy.layers.inet6 import IPv6ExtHdrDestOpt, IPv6ExtHdrHopByHop, IPv6ExtHdrRouting

    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    ext = (
        IPv6ExtHdrHopByHop()
        / IPv6ExtHdrDestOpt()
        / IPv6ExtHdrRouting(segleft=0, addresses=[])
        / IPv6ExtHdrDestOpt()
    )
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40002, 80, ext=ext))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (POD6, BE6, 40002)
    assert seen(out)[5] == 8080
    assert ct6(net, POD6, VIP6, 40002, 80) is not None


def udp6(src: str, dst: str, sport: int, dport: int, payload: bytes) -> bytes:
    from scapy.layers.inet import UDP as UDPh
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    return bytes(
        Ether(src="02:00:00:00:aa:01", dst="02:00:00:00:aa:02")
        / IPv6(src=src, dst=dst)
        / UDPh(sport=sport, dport=dport)
        / payload
    )


@pytest.mark.parametrize("payload", [b"", b"hello", b"x" * 64], ids=["empty", "5-bytes", "64-bytes"])
def test_a_datagram_whatever_its_length_is_translated_both_ways(net: Net, payload: bytes) -> None:
    """ekp_parse6 reads the IPv6 header and 14 bytes of the L4 header straight from the frame where
    they are (no extension header before it), and through the helper otherwise: a UDP datagram of
    fewer than 6 payload bytes has its 8 read by the helper, one of 64 from the frame (TCP behind
    extension headers: the test above). Each translated alike, both ways, ports and checksum right."""
    add_service6(net.dp.maps, VIP6, 53, LOCAL_BE, proto=UDP)
    verdict, out = net.from_pod(udp6(POD6, VIP6, 40050, 53, payload))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (POD6, BE6, 40050) and seen(out)[5] == 8080
    verdict, back = net.from_pod(udp6(BE6, POD6, 8080, 40050, payload))
    assert verdict == TC_ACT_REDIRECT
    assert seen(back)[1:4] == (VIP6, POD6, 53) and seen(back)[5] == 40050
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_REPLY]) == (1, 1)


def test_a_syn_on_a_flow_that_saw_a_rst_or_fin_is_a_new_flow_decided_again(net: Net) -> None:
    """The client reusing its port after a RST (or FINs) opens a new connection: a new backend
    choice, as nf_conntrack and IPv4's ekp_ct_usable_forward do, not the ended flow's backend; a
    SYN-ACK on the ended flow's reply tuple answers something else and passes untranslated."""
    for n, ending in enumerate(("R", "F")):
        cport = 40050 + n
        add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
        assert seen(net.from_pod(frame6(POD6, VIP6, cport, 80))[1])[2] == BE6
        assert net.from_pod(frame6(POD6, VIP6, cport, 80, flags=ending + "A"))[0] == TC_ACT_REDIRECT
        if ending == "F":  # both sides' FINs end it
            assert net.from_pod(frame6(BE6, POD6, 8080, cport, flags="FA"))[0] == TC_ACT_REDIRECT
        synack = frame6(BE6, POD6, 8080, cport, flags="SA")
        assert net.from_pod(synack) == (TC_ACT_OK, synack), "no translation for another connection"
        add_service6(net.dp.maps, VIP6, 80, ((2, BE6_2, 8080, BackendFlag.LOCAL),))  # BE6 left
        verdict, out = net.from_pod(frame6(POD6, VIP6, cport, 80))
        assert verdict == TC_ACT_REDIRECT
        assert seen(out)[2] == BE6_2, "the SYN chose again"
        assert not ct6(net, POD6, VIP6, cport, 80).flags & (abi.CtFlag.RST | abi.CtFlag.FIN_FWD)
    assert net.stats()[Stat.NEW_FLOWS] == 4


def test_a_syn_reopening_an_ended_flow_that_goes_to_ip6tables_takes_the_ended_entries_along(
    net: Net,
) -> None:
    """A SYN on an ended flow's tuple is a new flow; decided for ip6tables (its frontend now
    masquerades, SNAT_ALL, and no IPv6 node address is known), it passes untouched, and the ended
    flow's entries go: the
    connection's next segment, no SYN, would hit them and be sent to the old backend past the
    stack that translated its SYN."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    assert seen(net.from_pod(frame6(POD6, VIP6, 40070, 80))[1])[2] == BE6
    assert net.from_pod(frame6(POD6, VIP6, 40070, 80, flags="FA"))[0] == TC_ACT_REDIRECT
    assert net.from_pod(frame6(BE6, POD6, 8080, 40070, flags="FA"))[0] == TC_ACT_REDIRECT
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE, flags=FrontendFlag.SNAT_ALL)
    syn = frame6(POD6, VIP6, 40070, 80)
    assert net.from_pod(syn) == (TC_ACT_OK, syn), "ip6tables' new flow"
    ack = frame6(POD6, VIP6, 40070, 80, flags="A")
    assert net.from_pod(ack) == (TC_ACT_OK, ack), "its next segment: the stack's, not the old backend's"
    assert ct6(net, POD6, VIP6, 40070, 80) is None and ct6(net, BE6, POD6, 8080, 40070, reply=True) is None


def test_a_state_change_leaves_another_flows_entry_under_the_twin_key_alone(net: Net) -> None:
    """A FIN moves the flow's entry and its twin; an entry of another flow that sits under the twin
    key (written behind its back here; the LRU evicts and reuses keys) keeps its state, as IPv4's
    ekp_ct_is_twin decides: a foreign frontend, or a foreign backend, is not the twin."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    for n, foreign in enumerate(({"fe_port": port_be(81)}, {"backend_id": 7})):
        cport = 40090 + n
        assert net.from_pod(frame6(POD6, VIP6, cport, 80))[0] == TC_ACT_REDIRECT
        rkey = abi.Ct6Key(
            abi.Addr6(*ip6_words(BE6)),
            abi.Addr6(*ip6_words(POD6)),
            port_be(8080),
            port_be(cport),
            TCP,
            CtDir.REPLY,
        )
        other = ct6(net, BE6, POD6, 8080, cport, reply=True)
        for field, value in foreign.items():
            setattr(other, field, value)
        net.dp.maps["ct6_tcp"].update(rkey, other)
        assert net.from_pod(frame6(POD6, VIP6, cport, 80, flags="FA"))[0] == TC_ACT_REDIRECT
        assert ct6(net, POD6, VIP6, cport, 80).flags & abi.CtFlag.FIN_FWD, "the flow's own entry moved"
        assert not ct6(net, BE6, POD6, 8080, cport, reply=True).flags & abi.CtFlag.FIN_FWD, foreign
    # the true twin moves with it
    assert net.from_pod(frame6(POD6, VIP6, 40092, 80))[0] == TC_ACT_REDIRECT
    assert net.from_pod(frame6(POD6, VIP6, 40092, 80, flags="FA"))[0] == TC_ACT_REDIRECT
    assert ct6(net, BE6, POD6, 8080, 40092, reply=True).flags & abi.CtFlag.FIN_FWD


def test_an_established_tcp_flow_keeps_a_backend_removed_from_its_service(net: Net) -> None:
    """As kube-proxy (and IPv4's ekp_ct_usable_forward, whose membership test is UDP's alone): a
    terminating pod finishes its connections. What this guards is that the membership half of the
    forward test (ekp_ct_usable_forward, shared) is UDP's alone: a TCP forward hit that followed
    membership would lose the flow (its segments left to a stack with no entry for it).
    The path had no forward test before ekp_ct6_usable, so this held there too: no fix claims it."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    assert net.from_pod(frame6(POD6, VIP6, 40060, 80))[0] == TC_ACT_REDIRECT
    assert net.from_pod(frame6(BE6, POD6, 8080, 40060, flags="SA"))[0] == TC_ACT_REDIRECT
    assert net.from_pod(frame6(POD6, VIP6, 40060, 80, flags="A"))[0] == TC_ACT_REDIRECT
    assert ct6(net, POD6, VIP6, 40060, 80).flags & abi.CtFlag.ESTABLISHED
    add_service6(net.dp.maps, VIP6, 80, ((2, BE6_2, 8080, BackendFlag.LOCAL),))
    assert net.dp.maps["member6"].delete(abi.MemberKey(1, 1)), "BE6 is no member any more"
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40060, 80, flags="PA"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[2] == BE6


def test_a_new_flow_whose_reply_tuple_another_frontends_flow_holds_gets_another_source_port(
    net: Net,
) -> None:
    """One client port reaching one backend through two frontends: the second flow's replies
    would carry the same tuple as the first's, so it keeps the client's address with another
    source port (EKP_STAT_PORT_REMAP), as ip6tables' nf_nat does and IPv4's ekp_ct_create: both
    flows work, each gets its own replies."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    add_service6(net.dp.maps, VIP6, 81, LOCAL_BE, svc_id=2, set_id=2, rev_nat_id=2)
    assert net.from_pod(frame6(POD6, VIP6, 40070, 80))[0] == TC_ACT_REDIRECT
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40070, 81))
    assert verdict == TC_ACT_REDIRECT
    _, src, dst, moved, _, dport, _ = seen(out)
    assert (src, dst, dport) == (POD6, BE6, 8080)
    assert moved != 40070 and SNAT_MIN <= moved <= SNAT_MAX
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.PORT_REMAP], stats[Stat.DROP_TUPLE_TAKEN]) == (2, 1, 0)
    fwd = ct6(net, POD6, VIP6, 40070, 81)
    assert fwd.flags & abi.CtFlag.SNAT and port_be(moved) == fwd.snat_port
    verdict, out = net.from_pod(frame6(BE6, POD6, 8080, 40070, flags="SA"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (VIP6, POD6, 80), "the first flow keeps its replies"
    verdict, out = net.from_pod(frame6(BE6, POD6, 8080, moved, flags="SA"))
    assert verdict == TC_ACT_REDIRECT
    _, src, dst, sport, _, dport, _ = seen(out)
    assert (src, dst, sport, dport) == (VIP6, POD6, 81, 40070), "the second's, to the client's own port"
    again = seen(net.from_pod(frame6(POD6, VIP6, 40070, 81, flags="A"))[1])
    assert again[3] == moved, "the second flow keeps its port"


def handshake6(net: Net, cport: int) -> None:
    """POD6:cport -> VIP6:80 -> BE6:8080 through its handshake (assured)."""
    assert net.from_pod(frame6(POD6, VIP6, cport, 80))[0] == TC_ACT_REDIRECT
    assert net.from_pod(frame6(BE6, POD6, 8080, cport, flags="SA"))[0] == TC_ACT_REDIRECT
    assert net.from_pod(frame6(POD6, VIP6, cport, 80, flags="A"))[0] == TC_ACT_REDIRECT


def test_a_lost_reply_entry_is_rebuilt_from_the_forward_one(net: Net) -> None:
    """The LRU evicted the REPLY entry of an established flow: the client's next packet (its
    FORWARD entry refreshed once a second) rebuilds it (EKP_STAT_CT_REBUILT), so the backend's
    answers still come from the frontend, never untranslated (IPv4's ekp_ct_refresh)."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    handshake6(net, 40080)
    assert net.dp.maps["ct6_tcp"].delete(ct6_key(BE6, POD6, 8080, 40080, reply=True))
    fwd = ct6(net, POD6, VIP6, 40080, 80)
    fwd.last_seen_ns = time.monotonic_ns() - 2 * 10**9
    net.dp.maps["ct6_tcp"].update(ct6_key(POD6, VIP6, 40080, 80), fwd)
    assert seen(net.from_pod(frame6(POD6, VIP6, 40080, 80, flags="PA"))[1])[2] == BE6
    assert net.stats()[Stat.CT_REBUILT] == 1
    rebuilt = ct6(net, BE6, POD6, 8080, 40080, reply=True)
    assert rebuilt is not None
    assert (tuple(rebuilt.fe_addr), rebuilt.fe_port) == (tuple(ip6_words(VIP6)), port_be(80))
    verdict, out = net.from_pod(frame6(BE6, POD6, 8080, 40080, flags="PA"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (VIP6, POD6, 80)


def test_an_entry_whose_twin_key_holds_another_flows_is_a_miss_at_its_refresh(net: Net) -> None:
    """IPv4's test_an_entry_whose_twin_key_holds_another_flows_entry_goes_at_its_refresh for this
    path: the refresh deletes the FORWARD entry whose REPLY key holds another flow's entry, and the
    segment that found it is not translated from the deleted entry (an LRU element is handed out
    again at once): dropped as NO_FLOW, not passed to ip6tables (a new flow to it mid-stream)."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    handshake6(net, 40085)
    other = ct6(net, BE6, POD6, 8080, 40085, reply=True)
    other.fe_port = port_be(81)  # another frontend's flow on the reply tuple
    net.dp.maps["ct6_tcp"].update(ct6_key(BE6, POD6, 8080, 40085, reply=True), other)
    fwd = ct6(net, POD6, VIP6, 40085, 80)
    fwd.last_seen_ns = time.monotonic_ns() - 2 * 10**9
    net.dp.maps["ct6_tcp"].update(ct6_key(POD6, VIP6, 40085, 80), fwd)
    assert net.from_pod(frame6(POD6, VIP6, 40085, 80, flags="PA"))[0] == TC_ACT_SHOT
    assert ct6(net, POD6, VIP6, 40085, 80) is None
    assert ct6(net, BE6, POD6, 8080, 40085, reply=True).fe_port == port_be(81)
    assert net.stats()[Stat.DROP_NO_FLOW] == 1


def test_a_direct_syn_on_a_closed_flows_tuple_clears_its_entries(net: Net) -> None:
    """A connection straight to the backend (no frontend: another node translated its ClusterIP)
    from the port of a flow that ended (a RST) reuses that flow's reply tuple: both its entries go
    (IPv4's ekp_ct_reclaim), the SYN passes untouched, and the backend's answers to it are not
    rewritten to come from the old flow's frontend."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    handshake6(net, 40090)
    assert net.from_pod(frame6(POD6, VIP6, 40090, 80, flags="RA"))[0] == TC_ACT_REDIRECT
    syn = frame6(POD6, BE6, 40090, 8080)
    assert net.from_pod(syn) == (TC_ACT_OK, syn)
    assert ct6(net, BE6, POD6, 8080, 40090, reply=True) is None
    assert ct6(net, POD6, VIP6, 40090, 80) is None
    for flags in ("SA", "PA"):
        answer = frame6(BE6, POD6, 8080, 40090, flags=flags)
        assert net.from_pod(answer) == (TC_ACT_OK, answer), flags


def test_a_direct_syn_on_a_live_flows_tuple_gets_another_source_port(net: Net) -> None:
    """The same connection while the service flow lives: the backend holds a connection on this
    very 4-tuple, so the newcomer keeps its addresses with another source port (IPv4's
    ekp_flow_direct); both connections get their own answers."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    handshake6(net, 40095)
    verdict, out = net.from_pod(frame6(POD6, BE6, 40095, 8080))
    assert verdict == TC_ACT_REDIRECT
    _, src, dst, moved, _, dport, _ = seen(out)
    assert (src, dst, dport) == (POD6, BE6, 8080)
    assert moved != 40095 and SNAT_MIN <= moved <= SNAT_MAX
    assert seen(net.from_pod(frame6(BE6, POD6, 8080, 40095, flags="PA"))[1])[1:4] == (VIP6, POD6, 80)
    _, src, dst, sport, _, dport, _ = seen(net.from_pod(frame6(BE6, POD6, 8080, moved, flags="SA"))[1])
    assert (src, dst, sport, dport) == (BE6, POD6, 8080, 40095)
    assert net.stats()[Stat.PORT_REMAP] == 1


def test_a_flow_whose_backend_left_lives_tcp_orphan_s_after_the_backends_last_packet(net: Net) -> None:
    """The backend's address leaves ekp_addr6 (its pod deleted): the flow is ORPHAN (IPv4's
    ekp_ct_follow_backend), the client's packets no longer renew it, and tcp_orphan_s after the
    backend's last packet both entries are deleted; the next segment is left to the stack."""
    set_config(net.dp, tcp_orphan_s=30)
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    handshake6(net, 40097)
    assert net.dp.maps["addr6"].delete(abi.Addr6Key(abi.Addr6(*ip6_words(BE6))))
    fwd_key, rep_key = ct6_key(POD6, VIP6, 40097, 80), ct6_key(BE6, POD6, 8080, 40097, reply=True)

    def age(seconds: int) -> None:
        for key in (fwd_key, rep_key):
            entry: Any = net.dp.maps["ct6_tcp"].lookup(key)
            assert entry is not None
            entry.last_seen_ns = time.monotonic_ns() - seconds * 10**9
            net.dp.maps["ct6_tcp"].update(key, entry)

    age(2)
    data = frame6(POD6, VIP6, 40097, 80, flags="PA")
    assert net.from_pod(data)[0] == TC_ACT_REDIRECT  # still its flow: the backend may answer
    fwd, rep = ct6(net, POD6, VIP6, 40097, 80), ct6(net, BE6, POD6, 8080, 40097, reply=True)
    assert fwd.flags & abi.CtFlag.ORPHAN and rep.flags & abi.CtFlag.ORPHAN
    assert time.monotonic_ns() - fwd.last_seen_ns > 1.5e9, "the client's packet did not renew it"
    age(29)
    assert net.from_pod(data)[0] == TC_ACT_REDIRECT  # 29 s after the backend's last packet: alive
    age(31)
    assert net.from_pod(data) == (TC_ACT_OK, data)  # abandoned: deleted, the segment the stack's
    assert ct6_count(net) == 0


# ---- the early-drop ring (bpf/ekp_ctq.h): ct6_tcp has one of its own ------------------------

RING6 = SIZES.ct_tcp // 4  # ct6_tcp is sized as ct_tcp, its ring a quarter of it


def syns6(src: str, dst: str, dport: int, sports: range) -> Iterator[bytes]:
    """SYN frames differing only in their source port (the checksum left as built: the programs
    neither check nor need it)."""
    frame = bytearray(frame6(src, dst, sports.start, dport))
    for sport in sports:
        frame[54:56] = sport.to_bytes(2, "big")  # Ethernet 14 + IPv6 40
        yield bytes(frame)


def test_a_syn_flood_six_times_the_table_leaves_every_established_ipv6_flow(net: Net) -> None:
    """12,000 SYNs never answered into a table of 2,048 flows, behind 50 idle established ones:
    an LRU alone would evict the idle ones (the oldest); the ring deletes the flood's flows a ring
    after they began, so every established flow still answers (IPv4's twin in
    test_datapath_floods.py)."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    for cport in range(1000, 1050):
        handshake6(net, cport)
    for frame in syns6(POD6, VIP6, 80, range(20000, 32000)):
        assert net.from_pod(frame)[0] == TC_ACT_REDIRECT
    for cport in range(1000, 1050):
        assert seen(net.from_pod(frame6(POD6, VIP6, cport, 80, flags="PA"))[1])[2] == BE6, cport
        assert seen(net.from_pod(frame6(BE6, POD6, 8080, cport, flags="PA"))[1])[1:4] == (VIP6, POD6, 80), (
            cport
        )
    stats = net.stats()
    assert stats[Stat.EVICT_UNREPLIED] == 12000 - RING6  # all but the last ring of the flood
    assert (stats[Stat.EVICT_UNASSURED], stats[Stat.EVICT_CLOSED]) == (0, 0)
    assert ct6_count(net) == 2 * (50 + RING6)
    heads = {
        role: {int(k.value): ring_position(v.value) for k, v in net.dp.maps[role].items()}
        for role in ("ctqh6", "ctqh")
    }
    assert heads == {
        "ctqh6": {abi.CtqRing.TCP: 50 + 12000, abi.CtqRing.ANY: 0},
        "ctqh": {abi.CtqRing.TCP: 0, abi.CtqRing.ANY: 0},
    }, "IPv6 flows go in a ring of their own"


def test_a_start_turning_the_path_off_leaves_the_attached_programs_their_ring(lab: Lab) -> None:
    """A start with the tc IPv6 path off recreates the IPv6 rings at one slot while the last load's
    programs are still attached: they keep their own head, so they keep queuing in their full
    ring by its count, where a head shared with the new ring (count 1) would have each new IPv6
    flow reclaim the one queued before it, deleted before its reply."""
    with loaded_datapath(SIZES) as running:
        reset_maps(running)
        nxt = Datapath(running.pin_path, replace(SIZES, ipv6_tc=False))
        nxt.load()
        try:
            assert nxt.maps["ctq6_tcp"].info().max_entries == 1
            old = Net(running, lab)
            add_service6(running.maps, VIP6, 80, LOCAL_BE)
            for frame in syns6(POD6, VIP6, 80, range(20000, 20010)):
                assert old.from_pod(frame)[0] == TC_ACT_REDIRECT
            assert old.stats()[Stat.EVICT_UNREPLIED] == 0
            assert ct6_count(old) == 2 * 10, "every SYN's flow is still there, both ways"
        finally:
            nxt.close()


# ---- left to the stack (ip6tables) --------------------------------------------------------


def _passes(net: Net, frame: bytes, *, via_net: bool = False) -> None:
    verdict, out = net.from_net(frame) if via_net else net.from_pod(frame)
    assert (verdict, out) == (TC_ACT_OK, frame), "handed to the stack untouched"
    assert ct6_count(net) == 0


def test_a_remote_backend_needing_snat_is_left_to_ip6tables(net: Net) -> None:
    """While no IPv6 node address is known (ekp_cfg6 zero, as here); with one, the tc path
    source-translates (test_datapath_ipv6_snat.py)."""
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    add_service6(net.dp.maps, NODE6, 30080, ((1, REMOTE_BE6, 8080, 0),), scope=Scope.EXTERNAL, flags=flags)
    _passes(net, frame6(CLIENT6, NODE6, 50001, 30080), via_net=True)
    assert net.stats()[Stat.PASS] == 1


def test_a_frontend_that_needs_ip6tables_for_some_backends_leaves_it_all_its_flows(net: Net) -> None:
    """One proxier chooses each flow's backend: a frontend whose SNAT_REMOTE (ETP Cluster with
    --bpf-keep-client-ip-for-local-backends) would send some choices to ip6tables while no IPv6
    node address is known sends every flow there before choosing. Chosen here first, the flows
    left to ip6tables would be chosen for again there, and the one local backend of three would
    get 5/9 of them, not 1/3. Counted over 30 SYNs: none is translated (one chosen here would be
    with p = 1/3 each before, so all 30 passing by chance: 5e-6). (A backend on the node's own
    address no longer sends its frontend there: tests/ebpf/test_datapath_ipv6_host.py.)"""
    remote_too = ((1, BE6, 8080, BackendFlag.LOCAL), (2, REMOTE_BE6, 8080, 0), (3, "fd00:a:2::8", 8080, 0))
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    add_service6(net.dp.maps, NODE6, 30080, remote_too, scope=Scope.EXTERNAL, flags=flags)
    for n in range(30):
        _passes(net, frame6(CLIENT6, NODE6, 50100 + n, 30080), via_net=True)
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.PASS]) == (0, 30)


def test_snat_all_and_the_hairpin_are_left_to_ip6tables_without_the_nodes_address(net: Net) -> None:
    """SNAT_ALL and the hairpin while no IPv6 node address is known (ekp_cfg6 zero, as here: see
    test_datapath_ipv6_snat.py for them with one)."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE, flags=FrontendFlag.SNAT_ALL)
    _passes(net, frame6(POD6, VIP6, 40003, 80))
    add_service6(net.dp.maps, VIP6, 81, LOCAL_BE, svc_id=2, set_id=2, rev_nat_id=2)
    _passes(net, frame6(BE6, VIP6, 40004, 81))  # the backend is its own client: a hairpin


def test_mid_flow_segments_icmpv6_and_unfinished_routing_are_left_to_the_stack(net: Net) -> None:
    from scapy.layers.inet6 import ICMPv6EchoRequest, ICMPv6ND_NS, IPv6, IPv6ExtHdrRouting
    from scapy.layers.l2 import Ether

    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    _passes(net, frame6(POD6, VIP6, 40008, 80, flags="A"))  # a flow ip6tables translated
    eth = Ether(src="02:00:00:00:aa:01", dst="02:00:00:00:aa:02")
    _passes(net, bytes(eth / IPv6(src=POD6, dst=VIP6) / ICMPv6EchoRequest()))
    _passes(net, bytes(eth / IPv6(src=POD6, dst="ff02::1:ff00:5") / ICMPv6ND_NS(tgt=BE6)))
    routed = IPv6ExtHdrRouting(segleft=1, addresses=["fd00:99::1"])
    _passes(net, frame6(POD6, VIP6, 40009, 80, ext=routed))  # VIP6 is not its final destination
    _passes(net, frame6(POD6, VIP6, 40010, 80, hlim=1))  # the stack answers the last hop


def test_an_ipv6_packet_is_counted_once_by_the_ipv6_program(net: Net) -> None:
    """The tail call leaves the IPv4 program: one PACKETS and one outcome per IPv6 packet, that
    outcome the IPv6 program's (a new flow, which the IPv4 program's fall-through, passing IPv6
    untouched, never counts), on both hooks; a packet to no frontend passed once."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    flags = FrontendFlag.NODEPORT | FrontendFlag.LOCAL
    add_service6(
        net.dp.maps,
        NODE6,
        30080,
        LOCAL_BE,
        scope=Scope.EXTERNAL,
        flags=flags,
        svc_id=2,
        set_id=2,
        rev_nat_id=2,
    )
    assert net.from_pod(frame6(POD6, VIP6, 40011, 80))[0] == TC_ACT_REDIRECT
    assert net.from_net(frame6(CLIENT6, NODE6, 40011, 30080))[0] == TC_ACT_REDIRECT
    stats = net.stats()
    assert (stats[Stat.PACKETS], stats[Stat.NEW_FLOWS], stats[Stat.PASS]) == (2, 2, 0)
    net.from_pod(frame6(POD6, BE6, 40012, 8080))
    stats = net.stats()
    assert (stats[Stat.PACKETS], stats[Stat.NEW_FLOWS], stats[Stat.PASS]) == (3, 2, 1)


# ---- the activity check (bpf/ekp_act.h) -----------------------------------------------------


def test_a_live_flow_keeps_its_translation_after_its_addresses_leave_ekp_addr6(net: Net) -> None:
    """The flow stamped its endpoints: its reply is translated though neither address is in
    ekp_addr6 any more (a Service and its endpoint removed while the flow lives)."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    assert net.from_pod(frame6(POD6, VIP6, 40020, 80))[0] == TC_ACT_REDIRECT
    net.dp.maps["addr6"].clear()
    verdict, out = net.from_pod(frame6(BE6, POD6, 8080, 40020, flags="SA"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (VIP6, POD6, 80)


def test_a_packet_of_no_stamped_endpoint_skips_conntrack_once_the_check_is_armed(net: Net) -> None:
    """An entry written behind the data path's back (no stamp of its endpoints) is not looked up
    while the check is armed, and is once the agent has not armed it (after an upgrade, the
    entries the tables held before these programs)."""
    entry = abi.Ct6Entry(
        last_seen_ns=time.monotonic_ns(),
        nat_addr=abi.Addr6(*ip6_words(BE6)),
        fe_addr=abi.Addr6(*ip6_words(VIP6)),
        nat_port=port_be(8080),
        fe_port=port_be(80),
    )
    key = abi.Ct6Key(
        abi.Addr6(*ip6_words(POD6)), abi.Addr6(*ip6_words(VIP6)), port_be(40021), port_be(80), TCP, 0
    )
    net.dp.maps["ct6_tcp"].update(key, entry)
    frame = frame6(POD6, VIP6, 40021, 80, flags="A")
    assert net.from_pod(frame) == (TC_ACT_OK, frame), "not looked up"
    net.dp.maps["act"].update(ct.c_uint32(0), abi.Act(stamp=0))
    verdict, out = net.from_pod(frame)
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (POD6, BE6, 40021)


def test_arming_stamps_the_endpoints_of_the_live_ipv6_flows_too(net: Net) -> None:
    """activity.arm (at the first attach, after an upgrade) stamps what the IPv6 conntrack holds,
    its addresses folded as ekp_fold6 does: an IPv6 flow an older build's programs translated
    (no stamp) keeps its translation once the check is armed; an expired one is not stamped."""
    now = time.monotonic_ns()
    for cport, last_seen in ((40022, now), (40023, now - 3600 * 10**9)):
        entry = abi.Ct6Entry(
            last_seen_ns=last_seen,
            nat_addr=abi.Addr6(*ip6_words(BE6)),
            fe_addr=abi.Addr6(*ip6_words(VIP6)),
            nat_port=port_be(8080),
            fe_port=port_be(80),
            flags=abi.CtFlag.ESTABLISHED | abi.CtFlag.SEEN_REPLY,
        )
        key = abi.Ct6Key(
            abi.Addr6(*ip6_words(POD6)), abi.Addr6(*ip6_words(VIP6)), port_be(cport), port_be(80), TCP, 0
        )
        net.dp.maps["ct6_tcp"].update(key, entry)
    frame = frame6(POD6, VIP6, 40022, 80, flags="A")
    assert net.from_pod(frame) == (TC_ACT_OK, frame), "armed, nothing stamped: not looked up"
    assert activity.arm(net.dp.maps) == 2, "the live flow's frontend and backend"
    verdict, out = net.from_pod(frame)
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (POD6, BE6, 40022)


def test_a_pod_claiming_a_source_not_routed_to_its_device_is_passed_when_new_dropped_on_a_hit(
    net: Net,
) -> None:
    """A new flow from a pod with a source its device does not route back is left to the stack
    untouched, as without this path (IPv6 has no rp_filter); a packet that hits a flow's entry
    would be redirected past the stack, so the program checks it as rp_filter would and drops."""
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    frame = frame6(CLIENT6, VIP6, 40031, 80)  # an address of the external network, from a pod
    assert net.from_pod(frame) == (TC_ACT_OK, frame)
    assert ct6_count(net) == 0
    # a flow of the external client (ETP Local NodePort), then its tuple claimed from a pod device
    flags = FrontendFlag.NODEPORT | FrontendFlag.LOCAL
    add_service6(net.dp.maps, NODE6, 30080, LOCAL_BE, scope=Scope.EXTERNAL, flags=flags, svc_id=2, set_id=2)
    assert net.from_net(frame6(CLIENT6, NODE6, 40032, 30080))[0] == TC_ACT_REDIRECT
    assert net.from_pod(frame6(CLIENT6, NODE6, 40032, 30080, flags="A"))[0] == TC_ACT_SHOT
    stats = net.stats()
    assert (stats[Stat.DROP_SPOOFED], stats[Stat.NEW_FLOWS], stats[Stat.PASS]) == (1, 1, 1)


def test_client_ip_affinity_keeps_a_client_on_its_backend(net: Net) -> None:
    backends = ((1, BE6, 8080, BackendFlag.LOCAL), (2, BE6_2, 8080, BackendFlag.LOCAL))
    add_service6(net.dp.maps, VIP6, 80, backends, flags=FrontendFlag.AFFINITY, affinity_timeout=60)
    chosen = {seen(net.from_pod(frame6(POD6, VIP6, 41000 + i, 80))[1])[2] for i in range(12)}
    assert len(chosen) == 1, chosen
    assert net.stats()[Stat.AFFINITY_HIT] == 11
    assert len(net.dp.maps["aff6"].keys()) == 1
