"""Legacy host routing on the tc programs' IPv6 path (bpf/ekp_host6.h: IPv4's ekp_host_af.h for
IPv6), packet by packet through BPF_PROG_TEST_RUN: a translated IPv6 packet gets its destination
at tc ingress and goes to the node's stack (TC_ACT_OK, hop limit untouched: the stack forwards
it), so ip6tables' FORWARD chain and nf_conntrack see client <-> backend; the source it must get at
egress (SNAT, or a reply's frontend) is left in ekp_hostnat6_v2 under the tuple it leaves with.
The egress half (ekp_egress6) needs skb->tc_index, which BPF_PROG_TEST_RUN cannot set: the lab
tests carry it (tests/traffic/test_ipv6_tc.py, legacy routing).

The IPv6 packet lab of test_datapath_ipv6 (its `lab` fixture: lab/dplab.py's `add_ipv6`).
"""

from __future__ import annotations

import pytest

from agent.ebpf import abi
from agent.ebpf.abi import ConfigFlag, CtFlag, FrontendFlag, Scope, Stat, ip6_str, port_host
from lab.dplab import (
    BE6,
    BE6_2,
    CLIENT6,
    NODE6,
    POD6,
    REMOTE_BE6,
    SNAT_MAX,
    SNAT_MIN,
    VIP6,
    Net,
    add_service6,
    set_config,
)
from lab.packets import TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT
from tests.ebpf.test_datapath_icmp6 import error6, error_about
from tests.ebpf.test_datapath_ipv6 import (  # noqa: F401 (`lab`: the IPv6 packet lab, a fixture)
    LOCAL_BE,
    ct6,
    ct6_key,
    frame6,
    lab,
    seen,
)
from tests.ebpf.test_datapath_ipv6_snat import snat_source

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]


def legacy(net: Net) -> None:
    set_config(net.dp, flags=ConfigFlag.HOST_LEGACY)


def hostnat6(net: Net, *, stack: bool = False) -> dict[tuple[str, str, int, int, int], tuple[str, int, int]]:
    """ekp_hostnat6_v2 as {(saddr, daddr, sport, dport, proto): (new saddr, new sport, tag)}: the
    tagged entries (egress's source), or with `stack` those of tag 0 (the stack's reply tuples of
    SNAT flows, for the packets the stack itself sends about them), as IPv4's test reads them."""
    out = {}
    for k, v in net.dp.maps["hostnat6"].items():
        assert isinstance(k, abi.HostNat6Key) and isinstance(v, abi.HostNat6)
        if (k.tag == 0) != stack:
            continue
        key = (ip6_str(k.saddr), ip6_str(k.daddr), port_host(k.sport), port_host(k.dport), k.proto)
        out[key] = (ip6_str(v.saddr), port_host(v.sport), k.tag)
    return out


def test_a_pods_cluster_ip_flow_gets_its_destination_at_ingress_and_goes_to_the_stack(net: Net) -> None:
    """The SYN leaves ingress client -> backend with its hop limit (the stack spends it), and no
    source for egress (it keeps the pod's); the reply leaves backend -> client, its frontend left
    for egress under a tag. Both directions are the tc path's conntrack's (ekp_ct6_tcp), counted as
    bpf routing counts them."""
    legacy(net)
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40000, 80))
    assert verdict == TC_ACT_OK
    _, src, dst, sport, _, dport, hlim = seen(out)
    assert (src, dst, sport, dport, hlim) == (POD6, BE6, 40000, 8080, 64)
    assert hostnat6(net) == {}, "the source stays: nothing for egress to do"
    assert ct6(net, POD6, VIP6, 40000, 80) is not None
    assert ct6(net, BE6, POD6, 8080, 40000, reply=True) is not None

    verdict, out = net.from_pod(frame6(BE6, POD6, 8080, 40000, flags="SA"))
    assert verdict == TC_ACT_OK
    _, src, dst, sport, _, dport, hlim = seen(out)
    assert (src, dst, sport, dport, hlim) == (BE6, POD6, 8080, 40000, 64), "the source waits for egress"
    ((key, (new_src, new_sport, tag)),) = hostnat6(net).items()
    assert key == (BE6, POD6, 8080, 40000, 6)
    assert (new_src, new_sport) == (VIP6, 80)
    assert tag != 0
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_REPLY], stats[Stat.PASS]) == (1, 1, 0)


def test_a_masqueraded_node_port_leaves_its_source_to_egress_both_ways(net: Net) -> None:
    """A NodePort from outside to a backend on another node (SNAT_REMOTE): ingress gives the
    backend, egress the node's IPv6 address and the port the tc path's SNAT walk chose; the reply
    gets the client at ingress and the NodePort as its source at egress."""
    legacy(net)
    snat_source(net, NODE6)
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    add_service6(net.dp.maps, NODE6, 30080, ((1, REMOTE_BE6, 8080, 0),), scope=Scope.EXTERNAL, flags=flags)
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50000, 30080))
    assert verdict == TC_ACT_OK
    _, src, dst, sport, _, dport, hlim = seen(out)
    assert (src, dst, sport, dport, hlim) == (CLIENT6, REMOTE_BE6, 50000, 8080, 64)
    fwd = ct6(net, CLIENT6, NODE6, 50000, 30080)
    assert fwd.flags & CtFlag.SNAT
    snat_port = port_host(fwd.snat_port)
    assert SNAT_MIN <= snat_port <= SNAT_MAX
    ((key, (new_src, new_sport, fwd_tag)),) = hostnat6(net).items()
    assert key == (CLIENT6, REMOTE_BE6, 50000, 8080, 6)
    assert (new_src, new_sport) == (NODE6, snat_port)

    verdict, out = net.from_net(frame6(REMOTE_BE6, NODE6, 8080, snat_port, flags="SA"))
    assert verdict == TC_ACT_OK
    _, src, dst, sport, _, dport, _ = seen(out)
    assert (src, dst, sport, dport) == (REMOTE_BE6, CLIENT6, 8080, 50000), "the client, at ingress"
    reply = hostnat6(net)[(REMOTE_BE6, CLIENT6, 8080, 50000, 6)]
    assert reply[:2] == (NODE6, 30080), "the NodePort, at egress"
    assert reply[2] not in (0, fwd_tag)
    # the stack's reply tuples, both ways, for what the stack itself sends about the flow
    assert hostnat6(net, stack=True) == {
        (REMOTE_BE6, CLIENT6, 8080, 50000, 6): (NODE6, 30080, 0),
        (CLIENT6, REMOTE_BE6, 50000, 8080, 6): (NODE6, snat_port, 0),
    }
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.SNAT], stats[Stat.CT_REPLY]) == (1, 1, 1)


def test_an_icmpv6_error_about_a_translated_flow_is_translated_back_with_either_routing(net: Net) -> None:
    """As IPv4's: nf_conntrack never saw the flow's translation (the stack saw client <-> backend),
    so an error quoting the segment as it left (to the backend) is translated here and redirected,
    legacy routing too: the client gets it from the frontend, about the segment it sent."""
    legacy(net)
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    assert net.from_pod(frame6(POD6, VIP6, 41000, 80))[0] == TC_ACT_OK
    verdict, out = net.from_pod(frame6(POD6, VIP6, 41000, 80, flags="PA"))
    assert verdict == TC_ACT_OK and seen(out)[2] == BE6
    verdict, back = net.from_pod(error_about(out, BE6_2, "packet-too-big"))
    assert verdict == TC_ACT_REDIRECT
    e = error6(back)
    assert (e.src, e.dst) == (VIP6, POD6)
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport) == (POD6, VIP6, 41000, 80)
    assert net.stats()[Stat.CT_RELATED] == 1


def test_the_nodes_reject_of_a_handed_over_segment_leaves_as_the_cluster_ips(net: Net) -> None:
    """An ip6tables REJECT in FORWARD (port unreachable, its default) answers the SYN the stack was
    handed as POD6 -> BE6:8080: the node's own error, at egress, gets the ClusterIP back (outer
    source and quote) from the REPLY entry, so the pod's connect() fails at once. Before, it left
    untranslated, quoting a destination the pod never sent to: its stack ignored it and the client
    waited for its timeout."""
    legacy(net)
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    sent = frame6(POD6, VIP6, 40010, 80)
    verdict, out = net.from_pod(sent)
    assert verdict == TC_ACT_OK and seen(out)[2] == BE6
    verdict, back = net.to_pod(error_about(out, NODE6, "port-unreachable"))
    assert verdict == TC_ACT_OK
    e = error6(back)
    assert (e.src, e.dst, e.checksum_ok) == (VIP6, POD6, True)
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport) == (POD6, VIP6, 40010, 80)
    assert e.in_l4 == sent[54:] and e.in_tcp_checksum_ok is True
    assert net.stats()[Stat.CT_RELATED] == 1


def test_a_syn_reopening_an_ended_flow_keeps_the_new_flows_entries_for_its_syn_ack(net: Net) -> None:
    """The client reusing a ClusterIP connection's port after both FINs (the backend's TIME_WAIT
    takes the new SYN): the SYN makes a new flow here and goes to the stack translated (TC_ACT_OK,
    as ip6tables' new flows do), so the verdict does not say the ended flow's entries must go; they
    are the new flow's. Deleted, the SYN-ACK found no entry, reached the client from the backend's
    address, was reset and the SYN sent again 1 s later (issue 20: test_bench_ports' legacy row)."""
    legacy(net)
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    assert seen(net.from_pod(frame6(POD6, VIP6, 40100, 80))[1])[2] == BE6
    assert net.from_pod(frame6(BE6, POD6, 8080, 40100, flags="SA"))[0] == TC_ACT_OK
    assert net.from_pod(frame6(BE6, POD6, 8080, 40100, flags="FA"))[0] == TC_ACT_OK
    assert net.from_pod(frame6(POD6, VIP6, 40100, 80, flags="FA"))[0] == TC_ACT_OK
    net.dp.maps["hostnat6"].clear()  # an LRU's entry may be gone by then: the SYN-ACK must make it

    verdict, out = net.from_pod(frame6(POD6, VIP6, 40100, 80))
    assert verdict == TC_ACT_OK
    assert seen(out)[1:4] == (POD6, BE6, 40100)
    fwd = ct6(net, POD6, VIP6, 40100, 80)
    assert fwd is not None and not fwd.flags & (CtFlag.RST | CtFlag.FIN_FWD), "the new flow's entry"
    assert ct6(net, BE6, POD6, 8080, 40100, reply=True) is not None
    verdict, out = net.from_pod(frame6(BE6, POD6, 8080, 40100, flags="SA"))
    assert verdict == TC_ACT_OK
    assert hostnat6(net)[(BE6, POD6, 8080, 40100, 6)][:2] == (VIP6, 80), "the frontend, at egress"
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_REPLY]) == (2, 3)


def test_the_stacks_own_reset_and_icmpv6_error_about_a_masqueraded_flow_leave_as_the_cluster_ips(
    net: Net,
) -> None:
    """IPv4's test_legacy_translates_the_stacks_own_reset_and_icmp_error_about_a_snat_flow for IPv6:
    an ip6tables REJECT in FORWARD answers a masqueraded flow's SYN with a RST (backend -> client)
    or an ICMPv6 port unreachable quoting client -> backend: the tuple the stack saw, which no
    conntrack key holds (the REPLY key has the SNAT port). The flow's tag-0 ekp_hostnat6_v2 entry
    (IPv4's code, ekp_host_af.h) gives them the ClusterIP at egress, so the pod's connect() fails at
    once. Before, both left untranslated and the client waited for its timeout."""
    legacy(net)
    snat_source(net, NODE6)
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE, flags=FrontendFlag.SNAT_ALL)
    sent = frame6(POD6, VIP6, 40020, 80)
    verdict, out = net.from_pod(sent)
    assert verdict == TC_ACT_OK and seen(out)[1:4] == (POD6, BE6, 40020)
    assert hostnat6(net, stack=True) == {(BE6, POD6, 8080, 40020, 6): (VIP6, 80, 0)}

    verdict, back = net.to_pod(frame6(BE6, POD6, 8080, 40020, flags="R"))
    assert verdict == TC_ACT_OK
    _, src, dst, sport, _, dport, _ = seen(back)
    assert (src, dst, sport, dport) == (VIP6, POD6, 80, 40020)
    assert net.stats()[Stat.CT_REPLY] == 1

    verdict, back = net.to_pod(error_about(out, NODE6, "port-unreachable"))
    assert verdict == TC_ACT_OK
    e = error6(back)
    assert (e.src, e.dst, e.checksum_ok) == (VIP6, POD6, True)
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport) == (POD6, VIP6, 40020, 80)
    assert e.in_l4 == sent[54:] and e.in_tcp_checksum_ok is True
    assert net.stats()[Stat.CT_RELATED] == 1


def test_bpf_routing_keeps_no_stack_reply_tuple_and_leaves_such_a_reset_alone(net: Net) -> None:
    """bpf host routing hands a masqueraded flow's packets to no stack: no tag-0 entry is written,
    and a RST with that tuple at egress is none of the path's business."""
    snat_source(net, NODE6)
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE, flags=FrontendFlag.SNAT_ALL)
    assert net.from_pod(frame6(POD6, VIP6, 40030, 80))[0] == TC_ACT_REDIRECT
    assert hostnat6(net, stack=True) == {}
    rst = frame6(BE6, POD6, 8080, 40030, flags="R")
    assert net.to_pod(rst) == (TC_ACT_OK, rst)
    assert net.stats()[Stat.CT_REPLY] == 0


def test_the_stacks_own_reset_and_error_toward_the_backend_about_a_masqueraded_reply_get_the_snat_port(
    net: Net,
) -> None:
    """The reply direction's tag-0 entry: an ip6tables REJECT in FORWARD of a masqueraded
    NodePort flow's reply (the SYN-ACK the stack saw as backend -> client) answers the backend
    with a RST (client -> backend) or an ICMPv6 error quoting backend -> client. The backend knows
    the flow as backend <-> node:snat_port: the RST gets that source, the error's quote that
    destination (outer source the node's), or its stack ignores both."""
    legacy(net)
    snat_source(net, NODE6)
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
    add_service6(net.dp.maps, NODE6, 30080, ((1, REMOTE_BE6, 8080, 0),), scope=Scope.EXTERNAL, flags=flags)
    assert net.from_net(frame6(CLIENT6, NODE6, 50010, 30080))[0] == TC_ACT_OK
    snat_port = port_host(ct6(net, CLIENT6, NODE6, 50010, 30080).snat_port)
    verdict, reply = net.from_net(frame6(REMOTE_BE6, NODE6, 8080, snat_port, flags="SA"))
    assert verdict == TC_ACT_OK and seen(reply)[1:4] == (REMOTE_BE6, CLIENT6, 8080)
    assert hostnat6(net, stack=True)[(CLIENT6, REMOTE_BE6, 50010, 8080, 6)] == (NODE6, snat_port, 0)
    before = net.stats()

    verdict, out = net.to_net(frame6(CLIENT6, REMOTE_BE6, 50010, 8080, flags="R"))
    assert verdict == TC_ACT_OK
    _, src, dst, sport, _, dport, _ = seen(out)
    assert (src, dst, sport, dport) == (NODE6, REMOTE_BE6, snat_port, 8080)
    assert net.stats()[Stat.CT_REPLY] == before[Stat.CT_REPLY] + 1

    verdict, out = net.to_net(error_about(reply, NODE6, "port-unreachable"))
    assert verdict == TC_ACT_OK
    e = error6(out)
    assert (e.src, e.dst, e.checksum_ok) == (NODE6, REMOTE_BE6, True)
    assert (e.in_src, e.in_dst, e.in_sport, e.in_dport) == (REMOTE_BE6, NODE6, 8080, snat_port)
    assert e.in_tcp_checksum_ok is True
    assert net.stats()[Stat.CT_RELATED] == before[Stat.CT_RELATED] + 1


def test_under_legacy_routing_a_reset_or_error_without_a_stack_reply_tuple_leaves_untouched_and_uncounted(
    net: Net,
) -> None:
    """The node's own RST and ICMPv6 error about a flow the path never translated both ways (a
    pod's direct connection to a backend, next to a masqueraded flow's tag-0 entries) match no
    tag-0 entry: they leave byte for byte as the stack sent them, and no counter moves."""
    legacy(net)
    snat_source(net, NODE6)
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE, flags=FrontendFlag.SNAT_ALL)
    assert net.from_pod(frame6(POD6, VIP6, 40040, 80))[0] == TC_ACT_OK
    assert hostnat6(net, stack=True) == {(BE6, POD6, 8080, 40040, 6): (VIP6, 80, 0)}
    before = net.stats()

    rst = frame6(BE6, POD6, 8080, 40041, flags="R")
    assert net.to_pod(rst) == (TC_ACT_OK, rst)
    error = error_about(frame6(POD6, BE6, 40041, 8080), NODE6, "port-unreachable")
    assert net.to_pod(error) == (TC_ACT_OK, error)
    assert net.stats() == before


@pytest.mark.parametrize("late", [False, True], ids=["held", "hold-expired"])
def test_a_flow_handed_to_nf_conntrack_drops_while_held_then_passes_both_ways(net: Net, late: bool) -> None:
    """Out of eBPF mode (agent/takeover/out_of_ebpf.py, StackHolds), as IPv4's ekp_ct_nf_held:
    while the flow's NAT entry replaces the plain one the stack tracked it under (HANDOVER) a
    forward packet drops, where translated it would take another source port from the stack's NAT
    and its reply would reach the client from the backend's own address; once that entry is there
    (NFPASS) both directions pass untranslated, for it to translate. A flag EKP_CT_HANDOVER_S old
    (an agent that died in between) holds no more: translated as before."""
    legacy(net)
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE)
    assert net.from_pod(frame6(POD6, VIP6, 40000, 80))[0] == TC_ACT_OK  # the SYN makes the flow
    table = net.dp.maps["ct6_tcp"]
    keys = [ct6_key(POD6, VIP6, 40000, 80), ct6_key(BE6, POD6, 8080, 40000, reply=True)]

    def flag(add: int, clear: int) -> None:
        for key in keys:
            entry = table.lookup(key)
            assert isinstance(entry, abi.Ct6Entry)
            entry.flags = (entry.flags | add) & ~clear
            if late:
                entry.created_s -= abi.CT_HANDOVER_S
            table.update(key, entry)

    segment = frame6(POD6, VIP6, 40000, 80, flags="PA")
    reply = frame6(BE6, POD6, 8080, 40000, flags="PA")
    flag(CtFlag.HANDOVER, 0)
    held = net.from_pod(segment)[0]
    flag(CtFlag.NFPASS, CtFlag.HANDOVER)
    forward, out = net.from_pod(segment)
    backward, back = net.from_pod(reply)
    assert (forward, backward) == (TC_ACT_OK, TC_ACT_OK)
    _, _, dst, _, _, dport, _ = seen(out)
    _, src, _, sport, _, _, _ = seen(back)
    assert (src, sport) == (BE6, 8080)  # at ingress either way: a reply gets its frontend at egress
    if late:
        assert held == TC_ACT_OK and net.stats()[Stat.DROP_HANDOVER] == 0
        assert (dst, dport) == (BE6, 8080)
        assert hostnat6(net) != {}, "the frontend left for egress to give the reply"
    else:
        assert held == TC_ACT_SHOT and net.stats()[Stat.DROP_HANDOVER] == 1
        assert (dst, dport) == (VIP6, 80), "untranslated: the NAT entry's to translate"
        assert hostnat6(net) == {}, "no frontend left for egress to give the reply: the NAT entry's"
