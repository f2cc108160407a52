"""The XDP program's IPv6 path (ekp_xdp_net6, bpf/ekp_xdp6.h), reached from ekp_xdp_net by a tail
call, packet by packet through BPF_PROG_TEST_RUN: a NodePort flow to a remote backend sent back out
with XDP_TX both ways (the rewrite, the route's MACs, hop limit - 1, the TCP checksum, the entries
tc reads), a source-range drop, and what it leaves to tc untouched before any side effect (a local
backend, a fragment, an ICMPv6 error, a refusal answered with an ICMPv6 error): no conntrack entry
and no counter but TO_TC. XDP's counters balance after each test (conftest's clean_maps).

The IPv6 packet lab (tests/ebpf/test_datapath_ipv6.py): the client fd00:ff::100 and node2
fd00:ff::12, the gateway of the remote pods fd00:a:2::/64, both on ext0, so a flow between them
leaves by the device it came in by.
"""

from __future__ import annotations

import pytest

from agent.ebpf import abi
from agent.ebpf.abi import Addr6, BackendFlag, Config6, ConfigFlag, FrontendFlag, Scope, Stat, ip6_words
from agent.ebpf.loader import ring_position
from agent.ebpf.maps import write_config6
from lab.dplab import (
    BE6_SMALL_MTU,
    CLIENT6,
    MAC6,
    NODE2_6,
    NODE6,
    REMOTE_BE6,
    SNAT_MAX,
    SNAT_MIN,
    UDP,
    Net,
    add_service6,
    set_config,
)
from lab.packets import TC_ACT_OK, TC_ACT_REDIRECT, XDP_DROP, XDP_PASS, XDP_TX
from tests.ebpf.test_datapath_ipv6 import (  # noqa: F401 (`lab`: the IPv6 packet lab, a fixture)
    LOCAL_BE,
    ct6,
    ct6_key,
    frame6,
    lab,
    seen,
)
from tests.ebpf.test_datapath_ipv6_udp import frags6

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

NODEPORT = 30080
ETP_CLUSTER = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
REMOTE_BE = ((1, REMOTE_BE6, 8080, 0),)
# The outcomes and marks a test may see; every other counter must stay 0.
SEEN = {Stat.PACKETS, Stat.PASS, Stat.TO_TC, Stat.NEW_FLOWS, Stat.CT_FORWARD, Stat.CT_REPLY, Stat.SNAT}


def snat_source(net: Net) -> None:
    """The node's IPv6 address as the agent writes it (ekp_cfg6): the source of IPv6 SNAT."""
    write_config6(net.dp.maps, Config6(node_addr=Addr6(*ip6_words(NODE6))))


def nodeport(
    net: Net, backends: tuple[tuple[int, str, int, int], ...] = REMOTE_BE, flags: int = ETP_CLUSTER
) -> None:
    add_service6(net.dp.maps, NODE6, NODEPORT, backends, scope=Scope.EXTERNAL, flags=flags)


def ct6_count(net: Net) -> int:
    return len(net.dp.maps["ct6_tcp"].keys()) + len(net.dp.maps["ct6_any"].keys())


def xstats(net: Net, **want: int) -> None:
    """XDP's counters are exactly `want` (Stat names), every other one 0."""
    got = {s.name: n for s, n in net.xstats().items() if n}
    assert got == want, got


def test_a_node_port_flow_to_a_remote_backend_goes_back_out_at_xdp_both_ways(net: Net) -> None:
    ext_mac = net.lab.ext.mac
    snat_source(net)
    nodeport(net)
    verdict, out = net.xdp(frame6(CLIENT6, NODE6, 50000, NODEPORT))
    assert verdict == XDP_TX
    dmac, src, dst, sport, smac, dport, hlim = seen(out)  # seen: the TCP checksum is right
    assert (dmac, smac, src, dst, dport, hlim) == (MAC6[NODE2_6], ext_mac, NODE6, REMOTE_BE6, 8080, 63)
    assert SNAT_MIN <= sport <= SNAT_MAX
    # the entries are the ones tc's IPv6 path writes for the same flow (test_datapath_ipv6_snat.py)
    fwd = ct6(net, CLIENT6, NODE6, 50000, NODEPORT)
    assert fwd is not None and fwd.flags & abi.CtFlag.SNAT and abi.port_host(fwd.snat_port) == sport
    assert ct6(net, REMOTE_BE6, NODE6, 8080, sport, reply=True) is not None
    xstats(net, PACKETS=1, NEW_FLOWS=1, SNAT=1)

    # the backend's SYN-ACK to the SNAT port: back to the client, from the frontend
    verdict, out = net.xdp(frame6(REMOTE_BE6, NODE6, 8080, sport, flags="SA"))
    assert verdict == XDP_TX
    dmac, src, dst, rsport, smac, rdport, hlim = seen(out)
    assert (dmac, smac, src, dst, rsport, rdport, hlim) == (
        MAC6[CLIENT6],
        ext_mac,
        NODE6,
        CLIENT6,
        NODEPORT,
        50000,
        63,
    )
    # and a mid-flow segment of the client's: the flow's SNAT port again
    verdict, out = net.xdp(frame6(CLIENT6, NODE6, 50000, NODEPORT, flags="A", hlim=9))
    assert verdict == XDP_TX
    assert seen(out)[1:] == (NODE6, REMOTE_BE6, sport, ext_mac, 8080, 8)
    xstats(net, PACKETS=3, NEW_FLOWS=1, SNAT=1, CT_REPLY=1, CT_FORWARD=1)
    assert fwd.flags & abi.CtFlag.SNAT
    assert ct6(net, CLIENT6, NODE6, 50000, NODEPORT).flags & abi.CtFlag.ESTABLISHED
    # tc finds the same flow: the next segment, handed to tc, is a hit there too
    assert net.from_net(frame6(CLIENT6, NODE6, 50000, NODEPORT, flags="A"))[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.CT_FORWARD] == 1


def test_a_flow_handed_to_nf_conntrack_drops_at_xdp_while_held_then_passes_both_ways(net: Net) -> None:
    """XDP reads a hit's hand-over flags in tc's order (bpf/ekp_decide6.h), as IPv4's XDP does: out of
    eBPF mode (agent/takeover/out_of_ebpf.py) a forward packet of a HANDOVER flow drops, and a
    NFPASS flow's packets pass untranslated both ways (tc passes them on to the stack), where XDP
    sent them translated before."""
    snat_source(net)
    nodeport(net)
    verdict, out = net.xdp(frame6(CLIENT6, NODE6, 50010, NODEPORT))
    assert verdict == XDP_TX
    sport = seen(out)[3]
    table = net.dp.maps["ct6_tcp"]
    keys = [ct6_key(CLIENT6, NODE6, 50010, NODEPORT), ct6_key(REMOTE_BE6, NODE6, 8080, sport, reply=True)]

    def flag(add: int, clear: int) -> None:
        for key in keys:
            entry = table.lookup(key)
            assert isinstance(entry, abi.Ct6Entry)
            entry.flags = (entry.flags | add) & ~clear
            table.update(key, entry)

    segment = frame6(CLIENT6, NODE6, 50010, NODEPORT, flags="PA")
    reply = frame6(REMOTE_BE6, NODE6, 8080, sport, flags="PA")
    flag(abi.CtFlag.HANDOVER, 0)
    assert net.xdp(segment)[0] == XDP_DROP
    flag(abi.CtFlag.NFPASS, abi.CtFlag.HANDOVER)
    assert net.xdp(segment) == (XDP_PASS, segment)
    assert net.xdp(reply) == (XDP_PASS, reply)
    xstats(net, PACKETS=4, NEW_FLOWS=1, SNAT=1, DROP_HANDOVER=1, PASS=2)


def test_a_udp_datagram_to_a_remote_backend_goes_back_out_at_xdp(net: Net) -> None:
    snat_source(net)
    add_service6(net.dp.maps, NODE6, NODEPORT, REMOTE_BE, proto=UDP, scope=Scope.EXTERNAL, flags=ETP_CLUSTER)
    verdict, out = net.xdp(frame6(CLIENT6, NODE6, 50001, NODEPORT, UDP))
    assert verdict == XDP_TX
    assert seen(out)[1:3] == (NODE6, REMOTE_BE6) and seen(out)[5:] == (8080, 63)
    assert len(net.dp.maps["ct6_any"].keys()) == 2
    xstats(net, PACKETS=1, NEW_FLOWS=1, SNAT=1)


def test_a_client_outside_the_source_ranges_is_dropped_at_xdp_one_inside_is_sent(net: Net) -> None:
    snat_source(net)
    lb = "fd00:ff::50"  # a LoadBalancer IP
    add_service6(
        net.dp.maps, lb, 80, REMOTE_BE, scope=Scope.EXTERNAL, flags=FrontendFlag.SOURCE_RANGES, rev_nat_id=9
    )
    allowed = abi.SrcRange6Key(32 + 128, 9, 0, Addr6(*ip6_words(CLIENT6)))  # CLIENT6/128, rev_nat 9
    net.dp.maps["srcr6"].update(allowed, abi.SrcRange(1))
    assert net.xdp(frame6("fd00:ff::99", lb, 42301, 80))[0] == XDP_DROP
    assert ct6_count(net) == 0
    xstats(net, PACKETS=1, DROP_SOURCE_RANGE=1)
    assert net.xdp(frame6(CLIENT6, lb, 42302, 80))[0] == XDP_TX
    assert ct6_count(net) == 2
    assert net.stats()[Stat.PACKETS] == 0, "nothing reached tc"


def test_no_local_endpoint_is_dropped_at_xdp(net: Net) -> None:
    add_service6(
        net.dp.maps,
        NODE6,
        NODEPORT,
        REMOTE_BE,
        scope=Scope.EXTERNAL,
        flags=FrontendFlag.NODEPORT | FrontendFlag.LOCAL,
        count=0,
    )
    assert net.xdp(frame6(CLIENT6, NODE6, 42300, NODEPORT))[0] == XDP_DROP
    xstats(net, PACKETS=1, DROP_NO_LOCAL=1)


def to_tc(net: Net, frame: bytes) -> None:
    """`frame` passes to tc untouched, before any side effect: no entry, no counter but TO_TC."""
    verdict, out = net.xdp(frame)
    assert (verdict, out) == (XDP_PASS, frame)
    assert ct6_count(net) == 0
    assert len(net.dp.maps["aff6"].keys()) == 0
    xstats(net, PACKETS=1, TO_TC=1)


def test_a_new_flow_to_a_local_backend_goes_to_tc(net: Net) -> None:
    snat_source(net)
    nodeport(net, LOCAL_BE)
    to_tc(net, frame6(CLIENT6, NODE6, 50002, NODEPORT))


def test_a_backend_on_the_nodes_address_goes_to_tc(net: Net) -> None:
    snat_source(net)
    nodeport(net, ((1, NODE6, 6443, BackendFlag.HOST),))
    to_tc(net, frame6(CLIENT6, NODE6, 50003, NODEPORT))


def test_a_masquerade_without_the_nodes_ipv6_address_goes_to_tc(net: Net) -> None:
    nodeport(net)  # no ekp_cfg6: ip6tables masquerades
    to_tc(net, frame6(CLIENT6, NODE6, 50004, NODEPORT))


def test_a_frontend_without_endpoints_goes_to_tc_for_its_reject(net: Net) -> None:
    add_service6(
        net.dp.maps,
        NODE6,
        NODEPORT,
        (),
        scope=Scope.EXTERNAL,
        flags=FrontendFlag.NODEPORT | FrontendFlag.NO_ENDPOINTS,
    )
    to_tc(net, frame6(CLIENT6, NODE6, 50005, NODEPORT))


def test_a_fragment_goes_to_tc(net: Net) -> None:
    snat_source(net)
    add_service6(net.dp.maps, NODE6, NODEPORT, REMOTE_BE, proto=UDP, scope=Scope.EXTERNAL, flags=ETP_CLUSTER)
    first = frags6(CLIENT6, NODE6, 50006, NODEPORT, b"x" * 3000, 77)[0]
    to_tc(net, first)
    assert len(net.dp.maps["frag6"].keys()) == 0, "no fragment record"


def test_a_fragment_the_activity_check_would_dismiss_goes_to_tc_too(net: Net) -> None:
    """tc never asks the activity check of a fragment (a later one carries no ports to look up), and
    XDP decides in tc's order (bpf/ekp_decide6.h): every fragment, first or later, of addresses no
    flow stamped and no frontend holds, is tc's, counted TO_TC, not PASS."""
    first, later = frags6(CLIENT6, NODE2_6, 50008, 9999, b"x" * 3000, 78)[:2]
    to_tc(net, first)
    assert net.xdp(later) == (XDP_PASS, later)
    xstats(net, PACKETS=2, TO_TC=2)
    assert len(net.dp.maps["frag6"].keys()) == 0, "no fragment record"


def test_an_icmpv6_error_goes_to_tc(net: Net) -> None:
    from scapy.layers.inet import TCP as TCPh
    from scapy.layers.inet6 import ICMPv6PacketTooBig, IPv6
    from scapy.layers.l2 import Ether

    snat_source(net)
    nodeport(net)
    quote = IPv6(src=NODE6, dst=REMOTE_BE6) / TCPh(sport=SNAT_MIN, dport=8080, flags="S")
    error = Ether() / IPv6(src=NODE2_6, dst=NODE6) / ICMPv6PacketTooBig(mtu=1280) / quote
    to_tc(net, bytes(error))


def test_the_last_hop_goes_to_tc(net: Net) -> None:
    snat_source(net)
    nodeport(net)
    to_tc(net, frame6(CLIENT6, NODE6, 50007, NODEPORT, hlim=1))


AFFINITY = ETP_CLUSTER | FrontendFlag.AFFINITY


def aff_backends(net: Net) -> list[int]:
    """The backend of each IPv6 affinity entry."""
    out = []
    for _, v in net.dp.maps["aff6"].items():
        assert isinstance(v, abi.Affinity)
        out.append(int(v.backend_id))
    return out


def test_an_affinity_frontends_choice_is_remembered_at_xdp_only_when_xdp_carries_the_flow(net: Net) -> None:
    """ClientIP affinity: a new flow XDP sends remembers its backend (the client's next flow is an
    AFFINITY_HIT at XDP, to the same backend); one XDP leaves to tc (a local backend, or a remote
    one whose route leaves by another device) writes no affinity entry, so tc's choice is a first
    choice, counted as one (no AFFINITY_HIT), and remembered by tc."""
    snat_source(net)
    add_service6(
        net.dp.maps, NODE6, NODEPORT, REMOTE_BE, scope=Scope.EXTERNAL, flags=AFFINITY, affinity_timeout=10800
    )
    assert net.xdp(frame6(CLIENT6, NODE6, 50020, NODEPORT))[0] == XDP_TX
    assert aff_backends(net) == [1]
    assert net.xdp(frame6(CLIENT6, NODE6, 50021, NODEPORT))[0] == XDP_TX
    xstats(net, PACKETS=2, NEW_FLOWS=2, SNAT=2, AFFINITY_HIT=1)


@pytest.mark.parametrize(
    "backends",
    [LOCAL_BE, ((1, BE6_SMALL_MTU, 8080, 0),)],
    ids=["local backend", "remote backend routed by another device"],
)
def test_an_affinity_choice_xdp_leaves_to_tc_is_tcs_first_choice(
    net: Net, backends: tuple[tuple[int, str, int, int], ...]
) -> None:
    snat_source(net)
    add_service6(
        net.dp.maps, NODE6, NODEPORT, backends, scope=Scope.EXTERNAL, flags=AFFINITY, affinity_timeout=10800
    )
    syn = frame6(CLIENT6, NODE6, 50022, NODEPORT)
    to_tc(net, syn)  # asserts no affinity entry
    assert net.from_net(syn)[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.AFFINITY_HIT] == 0, "tc's first choice"
    assert aff_backends(net) == [1], "remembered by tc"


def ring_heads(net: Net) -> dict[int, int]:
    """How many flows each IPv6 early-drop ring was given (ekp_ctqh6: TCP, ANY)."""
    return {int(k.value): ring_position(v.value) for k, v in net.dp.maps["ctqh6"].items()}


def test_a_hit_whose_route_leaves_by_another_device_goes_to_tc_before_its_state_moves(net: Net) -> None:
    """A RST on a flow to a local backend (tc's: its route leaves by the pod's device, not ext0)
    is looked up at XDP and passed to tc untouched: the entry's flags and last_seen as they were,
    nothing given to the early-drop ring. Then tc moves the flow (the RST closes it, into the
    ring). A hit whose state moved at XDP would be moved twice, or closed by XDP for a packet tc
    then carries."""
    snat_source(net)
    nodeport(net, LOCAL_BE)
    syn = frame6(CLIENT6, NODE6, 50010, NODEPORT)
    assert net.from_net(syn)[0] == TC_ACT_REDIRECT
    before = bytes(ct6(net, CLIENT6, NODE6, 50010, NODEPORT))
    heads = ring_heads(net)
    assert heads[abi.CtqRing.TCP] == 1, "the flow's beginning"
    rst = frame6(CLIENT6, NODE6, 50010, NODEPORT, flags="R")
    assert net.xdp(rst) == (XDP_PASS, rst)
    xstats(net, PACKETS=1, TO_TC=1)
    assert bytes(ct6(net, CLIENT6, NODE6, 50010, NODEPORT)) == before, "flags and last_seen unchanged"
    assert ring_heads(net) == heads, "nothing pushed to the early-drop ring"
    assert net.from_net(rst)[0] == TC_ACT_REDIRECT
    moved = ct6(net, CLIENT6, NODE6, 50010, NODEPORT)
    assert moved is not None and bytes(moved) != before and moved.flags & abi.CtFlag.RST
    assert ring_heads(net)[abi.CtqRing.TCP] == 2, "closed by tc: into the ring"


def test_a_destination_options_header_is_kept_through_the_rewrite(net: Net) -> None:
    """The L4 header 8 bytes further in (l4_off 62, not 54): the ports and checksum rewritten
    there, the extension header sent on as it came, both ways."""
    from scapy.layers.inet import TCP as TCPh
    from scapy.layers.inet6 import IPv6ExtHdrDestOpt
    from scapy.layers.l2 import Ether

    snat_source(net)
    nodeport(net)
    verdict, out = net.xdp(frame6(CLIENT6, NODE6, 50011, NODEPORT, ext=IPv6ExtHdrDestOpt()))
    assert verdict == XDP_TX
    _, src, dst, sport, _, dport, hlim = seen(out)  # seen: the TCP checksum is right
    assert (src, dst, dport, hlim) == (NODE6, REMOTE_BE6, 8080, 63)
    assert IPv6ExtHdrDestOpt in Ether(out) and len(out) == len(
        frame6(CLIENT6, NODE6, 1, 1, ext=IPv6ExtHdrDestOpt())
    )
    verdict, out = net.xdp(frame6(REMOTE_BE6, NODE6, 8080, sport, flags="SA", ext=IPv6ExtHdrDestOpt()))
    assert verdict == XDP_TX
    assert seen(out)[1:4] == (NODE6, CLIENT6, NODEPORT) and Ether(out)[TCPh].dport == 50011
    assert IPv6ExtHdrDestOpt in Ether(out)
    xstats(net, PACKETS=2, NEW_FLOWS=1, SNAT=1, CT_REPLY=1)


def test_a_packet_of_no_frontend_and_no_flow_passes_uncounted_but_pass(net: Net) -> None:
    snat_source(net)
    nodeport(net)
    frame = frame6(CLIENT6, NODE6, 50008, 22)
    assert net.xdp(frame) == (XDP_PASS, frame)
    xstats(net, PACKETS=1, PASS=1)


def test_the_counters_balance_over_a_mix(net: Net) -> None:
    """PACKETS == PASS + TO_TC + NEW_FLOWS + CT_FORWARD + CT_REPLY + drops, for XDP alone."""
    snat_source(net)
    nodeport(net)
    for n in range(5):
        net.xdp(frame6(CLIENT6, NODE6, 51000 + n, NODEPORT))  # new flows
        net.xdp(frame6(CLIENT6, NODE6, 51000 + n, NODEPORT, flags="A"))  # hits
        net.xdp(frame6(CLIENT6, NODE6, 51000 + n, 22))  # none of ours
        net.xdp(frame6(CLIENT6, NODE6, 51000 + n, NODEPORT, hlim=1))  # tc's
    x = net.xstats()
    outcomes = x[Stat.PASS] + x[Stat.TO_TC] + x[Stat.NEW_FLOWS] + x[Stat.CT_FORWARD] + x[Stat.CT_REPLY]
    drops = sum(n for s, n in x.items() if s.name.startswith("DROP_"))
    assert x[Stat.PACKETS] == outcomes + drops == 20
    assert (x[Stat.NEW_FLOWS], x[Stat.CT_FORWARD], x[Stat.PASS], x[Stat.TO_TC]) == (5, 5, 5, 5)


def test_under_legacy_host_routing_xdp_keeps_its_drops_and_leaves_translations_to_tc(net: Net) -> None:
    """As IPv4's XDP under legacy routing (bpf/README, "XDP"): a source-range drop stays at XDP; a
    new flow and a hit, which the node's stack must see (its FORWARD chain, nf_conntrack), pass to
    tc untouched before any side effect (no entry; a hit's state not moved), and tc hands each to
    the stack with its destination rewritten (ekp_host6.h)."""
    set_config(net.dp, flags=ConfigFlag.HOST_LEGACY)
    snat_source(net)
    nodeport(net)
    lb = "fd00:ff::50"
    add_service6(
        net.dp.maps,
        lb,
        80,
        REMOTE_BE,
        scope=Scope.EXTERNAL,
        flags=FrontendFlag.SOURCE_RANGES,
        rev_nat_id=9,
        svc_id=2,
    )
    assert net.xdp(frame6(CLIENT6, lb, 42310, 80))[0] == XDP_DROP
    syn = frame6(CLIENT6, NODE6, 50030, NODEPORT)
    assert net.xdp(syn) == (XDP_PASS, syn)
    assert ct6_count(net) == 0
    verdict, out = net.from_net(syn)
    assert verdict == TC_ACT_OK and seen(out)[1:3] == (CLIENT6, REMOTE_BE6), "tc's hand-over to the stack"
    entry = bytes(ct6(net, CLIENT6, NODE6, 50030, NODEPORT))
    ack = frame6(CLIENT6, NODE6, 50030, NODEPORT, flags="A")
    assert net.xdp(ack) == (XDP_PASS, ack)
    assert bytes(ct6(net, CLIENT6, NODE6, 50030, NODEPORT)) == entry, "the hit's state is tc's to move"
    verdict, out = net.from_net(ack)
    assert verdict == TC_ACT_OK and seen(out)[2] == REMOTE_BE6
    xstats(net, PACKETS=3, DROP_SOURCE_RANGE=1, TO_TC=2)
