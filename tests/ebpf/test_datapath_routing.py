"""Host routing, packet by packet (BPF_PROG_TEST_RUN): the apply step of `bpf` and `legacy`.

`bpf` (redirect past the node's stack) checks, for a packet from a pod device, what the stack's
strict reverse-path filter would: the route back to its source leaves by that device; a forged
source drops as EKP_DROP_SPOOFED. `legacy` hands translated packets to the stack: only the
destination is translated at ingress, the TTL is left to the stack, and the source a packet must
get at egress (SNAT, or a reply's frontend) is left in ekp_hostnat_v2 (bpf/ekp_host.h). The
egress half needs skb->tc_index, which BPF_PROG_TEST_RUN cannot set: the lab tests
(tests/adversarial/test_host_routing.py, and the traffic suite run with legacy) carry it.

Same packet lab as test_datapath.py (lab/dplab.py).
"""

from __future__ import annotations

import pytest

from agent.ebpf import abi
from agent.ebpf.abi import BackendFlag, ConfigFlag, FrontendFlag, Stat, ip_be, port_be
from agent.ebpf.loader import Datapath
from lab.dplab import (
    BE1,
    BE_SMALL_MTU,
    CLIENT,
    MAC,
    NODE,
    POD_CLIENT,
    REMOTE_BE,
    SNAT_MAX,
    SNAT_MIN,
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
    icmp_error_about,
    parse,
    tcp,
    udp,
)
from tests.ebpf.test_datapath_icmp import big_segment, error_about

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

FORGED = "10.244.9.9"  # routed nowhere near pod0 (the red team's forged source)


def legacy(dp: Datapath) -> None:
    set_config(dp, flags=ConfigFlag.HOST_LEGACY)


def hostnat(
    dp: Datapath, *, stack: bool = False
) -> dict[tuple[str, str, int, int, int], tuple[str, int, int]]:
    """ekp_hostnat_v2 as {(saddr, daddr, sport, dport, proto): (new saddr, new sport, tag)}: the
    tagged entries (egress's source), or with `stack` those of tag 0 (the stack's reply tuples of
    SNAT flows, for the packets the stack itself sends about them)."""
    out = {}
    for k, v in dp.maps["hostnat"].items():
        assert isinstance(k, abi.HostNatKey) and isinstance(v, abi.HostNat)
        if (k.tag == 0) != stack:
            continue
        key = (
            abi.ip_str(k.saddr),
            abi.ip_str(k.daddr),
            abi.port_host(k.sport),
            abi.port_host(k.dport),
            k.proto,
        )
        out[key] = (abi.ip_str(v.saddr), abi.port_host(v.sport), k.tag)
    return out


# ---- bpf host routing: the source check ------------------------------------------------------


@pytest.mark.parametrize("forged", [FORGED, CLIENT, "10.244.3.6"])
def test_bpf_drops_a_forged_source_from_a_pod_device_and_counts_it(net: Net, forged: str) -> None:
    """10.244.9.9 has no route, 192.168.0.100 is routed by ext0, 10.244.3.6 by small0: none by pod0."""
    net.add_service(port=53, backends=((1, BE1, 5353, BackendFlag.LOCAL),), proto=UDP)
    verdict, _ = net.from_pod(udp(forged, VIP, 40000, 53, payload=b"query"))
    assert verdict == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_SPOOFED] == 1
    # The same datagram from the pod's own address is served: the check is the source, nothing else.
    verdict, out = net.from_pod(udp(POD_CLIENT, VIP, 40000, 53, payload=b"query"))
    assert verdict == TC_ACT_REDIRECT and parse(out).dst == BE1
    assert net.stats()[Stat.DROP_SPOOFED] == 1


def test_bpf_source_check_follows_the_fib_not_a_list(net: Net, lab: Lab) -> None:
    """A source routed to another pod device is refused on pod0 and accepted on its own device:
    what the node routes where, at the moment the packet passes."""
    net.add_service()
    frame = tcp("10.244.3.6", VIP, 23456, 80)
    assert net.from_pod(frame)[0] == TC_ACT_SHOT
    assert net.from_pod(frame, via=lab.small)[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.DROP_SPOOFED] == 1


def test_bpf_checks_icmp_errors_from_pods_too(net: Net) -> None:
    """An ICMP error about a flow is redirected past the stack with either host routing: a forged
    outer source is refused, the backend's own is translated back to the client."""
    net.add_service(port=53, backends=((1, BE1, 5353, BackendFlag.LOCAL),), proto=UDP)
    out = net.from_pod(udp(POD_CLIENT, VIP, 40001, 53, payload=b"query"))[1]
    for flags in (0, ConfigFlag.HOST_LEGACY):
        set_config(net.dp, flags=flags)
        assert net.from_pod(error_about(out, FORGED, "port-unreachable"))[0] == TC_ACT_SHOT
        assert net.from_pod(error_about(out, BE1, "port-unreachable"))[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.DROP_SPOOFED] == 2


def test_bpf_does_not_check_traffic_from_external_devices(net: Net) -> None:
    """Routers forward from any source: only pod devices are checked (the node's own rp_filter
    settings still apply to what the stack sees)."""
    net.add_service(scope=abi.Scope.EXTERNAL, addr=NODE, port=30080)
    verdict, out = net.from_net(tcp("203.0.113.50", NODE, 40000, 30080))
    assert verdict == TC_ACT_REDIRECT and parse(out).dst == BE1
    assert net.stats()[Stat.DROP_SPOOFED] == 0


# ---- legacy host routing: half at ingress, half at egress ---------------------------------


def test_legacy_translates_the_destination_and_hands_the_packet_to_the_stack(net: Net) -> None:
    legacy(net.dp)
    net.add_service()
    sent = tcp(POD_CLIENT, VIP, 12345, 80)
    verdict, out = net.from_pod(sent)
    assert verdict == TC_ACT_OK
    p = parse(out)
    assert (p.src, p.sport, p.dst, p.dport) == (POD_CLIENT, 12345, BE1, 8080)
    assert p.ttl == 64, "the stack decrements the TTL when it forwards"
    assert out[:12] == sent[:12], "the stack writes the Ethernet addresses"
    assert checksums_valid(out)
    assert len(net.dp.maps["hostnat"].items()) == 0, "the source stays: nothing for egress to do"
    assert net.stats()[Stat.NEW_FLOWS] == 1

    # The reply: the stack sees the backend's own address (rp_filter, conntrack, FORWARD); egress
    # gives it the frontend's.
    verdict, back = net.from_pod(tcp(BE1, POD_CLIENT, 8080, 12345, flags="SA"))
    assert verdict == TC_ACT_OK
    r = parse(back)
    assert (r.src, r.sport, r.dst, r.dport) == (BE1, 8080, POD_CLIENT, 12345)
    ((key, (src, sport, tag)),) = hostnat(net.dp).items()
    assert key == (BE1, POD_CLIENT, 8080, 12345, 6)
    assert (src, sport) == (VIP, 80) and tag != 0
    assert net.stats()[Stat.CT_REPLY] == 1


def test_legacy_snat_happens_at_egress_and_the_reply_is_unsnatted_at_ingress(net: Net) -> None:
    """A source-translated flow (masquerade-all): the stack sees client -> backend and backend ->
    client, never the node's own address as a source (no martian, no accept_local)."""
    legacy(net.dp)
    net.add_service(flags=FrontendFlag.SNAT_ALL)
    out = net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))[1]
    p = parse(out)
    assert (p.src, p.sport, p.dst, p.dport) == (POD_CLIENT, 12345, BE1, 8080)
    ((key, (src, snat_port, fwd_tag)),) = hostnat(net.dp).items()
    assert key == (POD_CLIENT, BE1, 12345, 8080, 6)
    assert src == NODE and SNAT_MIN <= snat_port <= SNAT_MAX
    fwd = net.ct(POD_CLIENT, VIP, 12345, 80)
    assert fwd is not None and fwd.snat_port == port_be(snat_port), "egress gives the conntrack's port"
    # the stack's reply tuple, for what the stack itself sends back (a REJECT): the frontend
    assert hostnat(net.dp, stack=True) == {(BE1, POD_CLIENT, 8080, 12345, 6): (VIP, 80, 0)}

    verdict, back = net.from_pod(tcp(BE1, NODE, 8080, snat_port, flags="SA"))
    assert verdict == TC_ACT_OK
    r = parse(back)
    assert (r.src, r.sport, r.dst, r.dport) == (BE1, 8080, POD_CLIENT, 12345)
    assert checksums_valid(back)
    table = hostnat(net.dp)
    src, sport, reply_tag = table[(BE1, POD_CLIENT, 8080, 12345, 6)]
    assert (src, sport) == (VIP, 80) and reply_tag not in (0, fwd_tag)


def test_legacy_translates_the_stacks_own_reset_and_icmp_error_about_a_snat_flow(net: Net) -> None:
    """A REJECT in the node's FORWARD chain answers a SNAT flow's SYN with a RST (backend ->
    client) or an ICMP port unreachable quoting client -> backend: the tuple the stack saw, which
    no conntrack key holds (the REPLY key has the SNAT port). ekp_egress gives them the frontend
    (tests/adversarial/test_host_routing.py: the client's connect() refused at once)."""
    from scapy.layers.inet import IP

    legacy(net.dp)
    net.add_service(flags=FrontendFlag.SNAT_ALL)
    verdict, out = net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))
    assert verdict == TC_ACT_OK
    verdict, back = net.to_pod(tcp(BE1, POD_CLIENT, 8080, 12345, flags="R"))
    r = parse(back)
    assert verdict == TC_ACT_OK and (r.src, r.sport, r.dst, r.dport) == (VIP, 80, POD_CLIENT, 12345)
    assert checksums_valid(back)
    assert net.stats()[Stat.CT_REPLY] == 1

    err = icmp_error_about(out, NODE, POD_CLIENT)
    verdict, back = net.to_pod(err)
    e = icmp_error(back)
    assert verdict == TC_ACT_OK and (e.src, e.dst, e.type, e.code) == (VIP, POD_CLIENT, 3, 3)
    inner = IP(e.quote[:20])
    ports = (int.from_bytes(e.quote[20:22], "big"), int.from_bytes(e.quote[22:24], "big"))
    assert (inner.src, inner.dst, ports) == (POD_CLIENT, VIP, (12345, 80))
    assert net.stats()[Stat.CT_RELATED] == 1

    # bpf host routing hands nothing to the stack: no such entry, the same RST left alone
    set_config(net.dp, flags=0)
    net.dp.maps["hostnat"].clear()
    net.from_pod(tcp(POD_CLIENT, VIP, 12346, 80))
    rst = tcp(BE1, POD_CLIENT, 8080, 12346, flags="R")
    assert len(net.dp.maps["hostnat"].items()) == 0
    assert net.to_pod(rst) == (TC_ACT_OK, rst)


def test_legacy_gives_the_stacks_own_reset_toward_the_backend_about_a_snat_reply_the_snat_port(
    net: Net,
) -> None:
    """The reply direction's tag-0 entry: a REJECT in FORWARD of a SNAT flow's reply (the SYN-ACK
    the stack saw as backend -> client) answers the backend with a RST client -> backend, whose
    source (the client) is no flow's endpoint: the activity check also looks at its destination
    (the backend), and the RST leaves from the node's SNAT port, as the backend knows the flow.
    Before, it skipped the lookups and left from the client's address: the backend ignored it."""
    legacy(net.dp)
    net.add_service(flags=FrontendFlag.SNAT_ALL)
    net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))
    snat_port = hostnat(net.dp)[(POD_CLIENT, BE1, 12345, 8080, 6)][1]
    assert net.from_pod(tcp(BE1, NODE, 8080, snat_port, flags="SA"))[0] == TC_ACT_OK
    assert hostnat(net.dp, stack=True)[(POD_CLIENT, BE1, 12345, 8080, 6)] == (NODE, snat_port, 0)
    replies = net.stats()[Stat.CT_REPLY]
    verdict, out = net.to_pod(tcp(POD_CLIENT, BE1, 12345, 8080, flags="R"))
    r = parse(out)
    assert verdict == TC_ACT_OK and (r.src, r.sport, r.dst, r.dport) == (NODE, snat_port, BE1, 8080)
    assert checksums_valid(out)
    assert net.stats()[Stat.CT_REPLY] == replies + 1


def test_legacy_tells_two_flows_leaving_with_the_same_tuple_apart(net: Net) -> None:
    """One client port to one backend through two frontends, both source-translated: the packets
    leave ingress with the same tuple, and egress tells them apart by the tag."""
    legacy(net.dp)
    net.add_service(flags=FrontendFlag.SNAT_ALL)
    net.add_service(addr="10.96.0.11", flags=FrontendFlag.SNAT_ALL, set_id=2, svc_id=2, rev_nat_id=2)
    net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))
    net.from_pod(tcp(POD_CLIENT, "10.96.0.11", 12345, 80))
    entries = [(k, v) for k, v in net.dp.maps["hostnat"].items() if isinstance(k, abi.HostNatKey) and k.tag]
    assert len(entries) == 2
    (k1, v1), (k2, v2) = entries
    assert isinstance(k1, abi.HostNatKey) and isinstance(k2, abi.HostNatKey)
    assert isinstance(v1, abi.HostNat) and isinstance(v2, abi.HostNat)
    assert (k1.saddr, k1.daddr, k1.sport, k1.dport) == (k2.saddr, k2.daddr, k2.sport, k2.dport)
    assert k1.tag != k2.tag and v1.sport != v2.sport


def test_legacy_relies_on_the_stack_for_the_source_check(net: Net) -> None:
    """A forged source is handed to the stack as it is: the node's rp_filter judges it there, as
    in iptables mode (tests/adversarial/test_host_routing.py shows it dropped)."""
    legacy(net.dp)
    net.add_service(port=53, backends=((1, BE1, 5353, BackendFlag.LOCAL),), proto=UDP)
    verdict, out = net.from_pod(udp(FORGED, VIP, 40000, 53, payload=b"query"))
    assert verdict == TC_ACT_OK and parse(out).src == FORGED
    assert net.stats()[Stat.DROP_SPOOFED] == 0


def test_legacy_still_answers_fragmentation_needed_itself(net: Net, lab: Lab) -> None:
    """The route lookup stays: a DF packet too big for the backend's path is answered from the
    frontend, quoting what the client sent (the stack would quote the translated packet)."""
    legacy(net.dp)
    net.add_service(backends=((3, BE_SMALL_MTU, 8080, BackendFlag.LOCAL),))
    net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))
    big = big_segment(POD_CLIENT, VIP, 12345, 80, smac=MAC[POD_CLIENT], dmac=lab.pod.mac)
    assert net.from_pod(big)[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.DROP_FRAG_NEEDED] == 1
    fits = tcp(POD_CLIENT, VIP, 12345, 80, flags="PA", payload=b"p" * 1000)
    verdict, out = net.from_pod(fits)
    assert verdict == TC_ACT_OK and parse(out).dst == BE_SMALL_MTU


def test_switching_back_to_bpf_redirects_the_same_flow(net: Net, lab: Lab) -> None:
    """The choice is the config's, read per packet: a flow begun under one carries on under the
    other (an agent restarted with the other value)."""
    legacy(net.dp)
    net.add_service()
    assert net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80))[0] == TC_ACT_OK
    set_config(net.dp, flags=0)
    verdict, out = net.from_pod(tcp(POD_CLIENT, VIP, 12345, 80, flags="A"))
    assert verdict == TC_ACT_REDIRECT
    assert (parse(out).dst, parse(out).ttl) == (BE1, 63)
    assert ip_be(BE1) == net.ct(POD_CLIENT, VIP, 12345, 80).nat_addr  # type: ignore[union-attr]


def test_legacy_leaves_what_xdp_would_send_past_the_stack_to_tc(net: Net, lab: Lab) -> None:
    """A NodePort flow to a backend on another node is XDP's to finish (XDP_TX) with bpf routing;
    with legacy routing XDP leaves it to tc, which hands it to the node's stack, so netfilter sees
    it there too."""
    legacy(net.dp)
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL
    net.add_service(
        NODE, 30080, ((7, REMOTE_BE, 8080, 0),), scope=abi.Scope.EXTERNAL, flags=flags, rev_nat_id=3
    )
    frame = tcp(CLIENT, NODE, 5555, 30080, smac=MAC[CLIENT], dmac=lab.ext.mac)
    verdict, out = net.xdp(frame)
    assert verdict == XDP_PASS and out == frame
    assert net.xstats()[Stat.TO_TC] == 1
    verdict, out = net.from_net(frame)
    assert verdict == TC_ACT_OK
    p = parse(out)
    assert (p.src, p.sport, p.dst, p.dport, p.ttl) == (CLIENT, 5555, REMOTE_BE, 8080, 64)
    ((key, (src, snat_port, _)),) = hostnat(net.dp).items()
    assert key == (CLIENT, REMOTE_BE, 5555, 8080, 6)
    assert src == NODE and SNAT_MIN <= snat_port <= SNAT_MAX
