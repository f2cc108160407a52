"""Source translation on the tc programs' IPv6 path (the decision in bpf/ekp_tc6.h; the port and
the entries by IPv4's conntrack template, ekp_ct6_create), packet by packet through
BPF_PROG_TEST_RUN: a flow IPv4 would masquerade (a NodePort from outside to a backend on another
node, SNAT_ALL, a hairpin) leaves with the node's IPv6 address (ekp_cfg6) and a port of the SNAT
range, chosen by IPv4's port walk (bpf/ekp_snat_af.h); its reply gets the frontend and the client
back. Every L4 checksum is recomputed by scapy from the rewritten bytes (`seen`).

The IPv6 packet lab of test_datapath_ipv6 (its `lab` fixture: lab/dplab.py's `add_ipv6`).
"""

from __future__ import annotations

import ctypes as ct
import os
from pathlib import Path
from typing import Any, cast

import pytest

from agent.ebpf import abi
from agent.ebpf.abi import (
    BackendFlag,
    CtFlag,
    FrontendFlag,
    Scope,
    Stat,
    ip6_str,
    ip6_words,
    port_be,
    port_host,
)
from agent.ebpf.maps import read_config6, write_config6
from agent.ebpf.render6 import ct6_lines
from lab.cpurace import race_rounds
from lab.dplab import (
    BE6,
    BE6_2,
    CLIENT6,
    MAC6,
    NODE2_6,
    NODE6,
    POD6,
    REMOTE_BE6,
    SNAT_MAX,
    SNAT_MIN,
    VIP6,
    Net,
    TupleRace,
    add_service6,
    set_config,
)
from lab.packets import TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, PreparedRun
from tests.ebpf.test_datapath_ipv6 import (  # noqa: F401 (`lab`: the IPv6 packet lab, a fixture)
    LOCAL_BE,
    ct6,
    frame6,
    lab,
    seen,
)

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

NODEPORT = FrontendFlag.NODEPORT | FrontendFlag.SNAT_REMOTE
REMOTE_BE = ((1, REMOTE_BE6, 8080, 0),)
OTHER_CLIENT6 = "fd00:ff::102"  # a client of no neighbour entry: only its forward packets are sent


def snat_source(net: Net, addr: str) -> None:
    """The node's IPv6 address as the agent writes it (ekp_cfg6)."""
    write_config6(net.dp.maps, abi.Config6(node_addr=abi.Addr6(*ip6_words(addr))))


def nodeport_to_remote(net: Net) -> None:
    add_service6(net.dp.maps, NODE6, 30080, REMOTE_BE, scope=Scope.EXTERNAL, flags=NODEPORT)


def test_a_node_port_from_outside_to_a_remote_backend_is_masqueraded_and_its_reply_translated_back(
    net: Net,
) -> None:
    snat_source(net, NODE6)
    nodeport_to_remote(net)
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50000, 30080))
    assert verdict == TC_ACT_REDIRECT
    dmac, src, dst, sport, _, dport, hlim = seen(out)
    assert (dmac, src, dst, dport, hlim) == (MAC6[NODE2_6], NODE6, REMOTE_BE6, 8080, 63)
    assert SNAT_MIN <= sport <= SNAT_MAX
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.SNAT]) == (1, 1)

    fwd = ct6(net, CLIENT6, NODE6, 50000, 30080)
    assert (ip6_str(fwd.nat_addr), port_host(fwd.nat_port)) == (REMOTE_BE6, 8080)
    assert (ip6_str(fwd.snat_addr), port_host(fwd.snat_port)) == (NODE6, sport)
    assert fwd.flags == CtFlag.SNAT
    rev = ct6(net, REMOTE_BE6, NODE6, 8080, sport, reply=True)
    assert (ip6_str(rev.nat_addr), port_host(rev.nat_port)) == (CLIENT6, 50000), "the client, for the reply"
    assert (ip6_str(rev.fe_addr), port_host(rev.fe_port), any(rev.snat_addr)) == (NODE6, 30080, False)

    # the backend's answer comes back by the external device, to the node's address
    verdict, out = net.from_net(frame6(REMOTE_BE6, NODE6, 8080, sport, flags="SA"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[:4] == (MAC6[CLIENT6], NODE6, CLIENT6, 30080)
    assert seen(out)[5] == 50000
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50000, 30080, flags="A"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (NODE6, REMOTE_BE6, sport), "the flow keeps its SNAT port"
    assert ct6(net, CLIENT6, NODE6, 50000, 30080).flags & CtFlag.ESTABLISHED
    assert ct6(net, REMOTE_BE6, NODE6, 8080, sport, reply=True).flags & CtFlag.ESTABLISHED, "both entries"
    stats = net.stats()
    assert (stats[Stat.CT_REPLY], stats[Stat.CT_FORWARD], stats[Stat.PASS]) == (1, 1, 0)

    # as `agent inspect maps ct` shows them (but their times)
    lines = ct6_lines([*net.dp.maps["ct6_tcp"].items()], fwd.last_seen_ns)
    flags = "flags=SNAT|SEEN_REPLY|ESTABLISHED"
    assert [line.split(" idle=")[0] for line in lines] == [
        f"ct6 [{REMOTE_BE6}]:8080 -> [{NODE6}]:{sport}/TCP reply fe=[{NODE6}]:30080 nat=[{CLIENT6}]:50000 "
        f"svc=1 be=1 {flags}",
        f"ct6 [{CLIENT6}]:50000 -> [{NODE6}]:30080/TCP forward fe=[{NODE6}]:30080 nat=[{REMOTE_BE6}]:8080 "
        f"snat=[{NODE6}]:{sport} svc=1 be=1 {flags}",
    ]


def test_two_clients_with_one_source_port_to_one_backend_get_two_snat_ports(net: Net) -> None:
    """The reply tuple {backend, node, bport, snat port} is unique per flow: with a range of two
    ports, the second client (the same source port, the same backend) gets the other one, and each
    reply goes back to its own client."""
    snat_source(net, NODE6)
    set_config(net.dp, snat_port_min=SNAT_MIN, snat_port_max=SNAT_MIN + 1)
    nodeport_to_remote(net)
    ports = {}
    for client in (CLIENT6, NODE2_6):
        verdict, out = net.from_net(frame6(client, NODE6, 50000, 30080))
        assert verdict == TC_ACT_REDIRECT
        ports[client] = seen(out)[3]
    assert sorted(ports.values()) == [SNAT_MIN, SNAT_MIN + 1]
    for client, port in ports.items():
        verdict, out = net.from_net(frame6(REMOTE_BE6, NODE6, 8080, port, flags="SA"))
        assert verdict == TC_ACT_REDIRECT
        assert seen(out)[:4] == (MAC6[client], NODE6, client, 30080)
        assert seen(out)[5] == 50000


def test_a_full_range_takes_over_an_unanswered_flow_and_refuses_once_every_flow_is_established(
    net: Net,
) -> None:
    """IPv4's rules, from the same walk: when every port is held, the first flow that never
    completed its handshake is evicted for the newcomer (both its entries; EARLY_DROP), and when
    every one is established the newcomer is dropped (DROP_SNAT_PORTS)."""
    snat_source(net, NODE6)
    set_config(net.dp, snat_port_min=SNAT_MIN, snat_port_max=SNAT_MIN + 1)
    nodeport_to_remote(net)
    ports = {}
    for client in (CLIENT6, NODE2_6):
        ports[client] = seen(net.from_net(frame6(client, NODE6, 50001, 30080))[1])[3]
    verdict, out = net.from_net(frame6(OTHER_CLIENT6, NODE6, 50001, 30080))
    assert verdict == TC_ACT_REDIRECT
    taken = seen(out)[3]
    assert net.stats()[Stat.EARLY_DROP] == 1
    (evicted,) = [c for c, p in ports.items() if p == taken]
    assert ct6(net, evicted, NODE6, 50001, 30080) is None, "the evicted flow lost its forward entry"
    rev = ct6(net, REMOTE_BE6, NODE6, 8080, taken, reply=True)
    assert ip6_str(rev.nat_addr) == OTHER_CLIENT6

    # every port held by an established flow (the two survivors complete their handshakes)
    (kept,) = [c for c in ports if c != evicted]
    for client, port in ((kept, ports[kept]), (OTHER_CLIENT6, taken)):
        net.from_net(frame6(REMOTE_BE6, NODE6, 8080, port, flags="SA"))
        net.from_net(frame6(client, NODE6, 50001, 30080, flags="A"))
        assert ct6(net, client, NODE6, 50001, 30080).flags & CtFlag.ESTABLISHED
    verdict, _ = net.from_net(frame6(evicted, NODE6, 50002, 30080))
    assert verdict == TC_ACT_SHOT
    assert net.stats()[Stat.DROP_SNAT_PORTS] == 1
    assert ct6(net, evicted, NODE6, 50002, 30080) is None


def test_a_taken_over_snat_tuple_deletes_the_forward_entry_under_its_holders_key_only_if_it_points_there(
    net: Net,
) -> None:
    """The early drop takes an unanswered flow's SNAT tuple and deletes the FORWARD entry under that
    flow's FORWARD key (the test above) when that entry's reply tuple is the one taken, whichever
    flow wrote it (another backend here, written behind the holder's back): it would translate its
    client onto the newcomer's tuple. One whose reply tuple is another (the LRU reuses keys) is no
    part of the taken tuple and stays."""
    snat_source(net, NODE6)
    set_config(net.dp, snat_port_min=SNAT_MIN, snat_port_max=SNAT_MIN)
    nodeport_to_remote(net)
    for n, (field, value) in enumerate((("backend_id", 99), ("snat_port", port_be(SNAT_MIN + 1)))):
        cport = 50010 + n
        net.dp.maps["ct6_tcp"].clear()
        assert seen(net.from_net(frame6(CLIENT6, NODE6, cport, 30080))[1])[3] == SNAT_MIN
        fkey = abi.Ct6Key(
            abi.Addr6(*ip6_words(CLIENT6)), abi.Addr6(*ip6_words(NODE6)), port_be(cport), port_be(30080), 6, 0
        )
        other = ct6(net, CLIENT6, NODE6, cport, 30080)
        setattr(other, field, value)
        net.dp.maps["ct6_tcp"].update(fkey, other)
        verdict, out = net.from_net(frame6(NODE2_6, NODE6, cport, 30080))
        assert verdict == TC_ACT_REDIRECT and seen(out)[3] == SNAT_MIN
        assert net.stats()[Stat.EARLY_DROP] == n + 1
        kept = ct6(net, CLIENT6, NODE6, cport, 30080)
        if field == "backend_id":
            assert kept is None, "its reply tuple is the one taken: gone"
        else:
            assert kept is not None and kept.snat_port == value, "another reply tuple: left alone"


def test_a_syn_on_a_closed_flows_tuple_takes_its_snat_port_again(net: Net) -> None:
    """The client reusing its source port after a RST opens a new flow (decided again, not the
    closed flow's entries); with one port in the range it can only have the closed flow's, taken
    over as the kernel's NAT takes a TIME_WAIT tuple (a closed holder and a SYN: ekp_ct6_reusable),
    the closed flow's entries replaced by the new one's."""
    snat_source(net, NODE6)
    set_config(net.dp, snat_port_min=SNAT_MIN, snat_port_max=SNAT_MIN)
    nodeport_to_remote(net)
    assert seen(net.from_net(frame6(CLIENT6, NODE6, 50300, 30080))[1])[3] == SNAT_MIN
    assert net.from_net(frame6(CLIENT6, NODE6, 50300, 30080, flags="RA"))[0] == TC_ACT_REDIRECT
    assert ct6(net, REMOTE_BE6, NODE6, 8080, SNAT_MIN, reply=True).flags & CtFlag.RST
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50300, 30080))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:4] == (NODE6, REMOTE_BE6, SNAT_MIN)
    assert ct6(net, CLIENT6, NODE6, 50300, 30080).flags == CtFlag.SNAT, "a new flow's entries"
    assert ct6(net, REMOTE_BE6, NODE6, 8080, SNAT_MIN, reply=True).flags == CtFlag.SNAT
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.SNAT], stats[Stat.EARLY_DROP]) == (2, 2, 0)
    # a second client meanwhile: the one port is held by a live flow (unanswered: taken over)
    verdict, out = net.from_net(frame6(NODE2_6, NODE6, 50300, 30080))
    assert verdict == TC_ACT_REDIRECT and net.stats()[Stat.EARLY_DROP] == 1
    assert ct6(net, CLIENT6, NODE6, 50300, 30080) is None


def test_snat_all_from_a_pod_to_a_local_backend_and_its_reply(net: Net) -> None:
    snat_source(net, NODE6)
    add_service6(net.dp.maps, VIP6, 80, LOCAL_BE, flags=FrontendFlag.SNAT_ALL)
    verdict, out = net.from_pod(frame6(POD6, VIP6, 40100, 80))
    assert verdict == TC_ACT_REDIRECT
    dmac, src, dst, sport, _, dport, _ = seen(out)
    assert (dmac, src, dst, dport) == (MAC6[BE6], NODE6, BE6, 8080)
    verdict, out = net.from_pod(frame6(BE6, NODE6, 8080, sport, flags="SA"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[:4] == (MAC6[POD6], VIP6, POD6, 80)
    assert seen(out)[5] == 40100


def test_a_pod_reaching_itself_through_its_service_is_hairpinned_through_the_node(net: Net) -> None:
    """Its own address as the source would be dropped by its stack: the node's, as IPv4 and
    kube-proxy do."""
    snat_source(net, NODE6)
    add_service6(net.dp.maps, VIP6, 81, LOCAL_BE)
    verdict, out = net.from_pod(frame6(BE6, VIP6, 40200, 81))
    assert verdict == TC_ACT_REDIRECT
    dmac, src, dst, sport, _, dport, _ = seen(out)
    assert (dmac, src, dst, dport) == (MAC6[BE6], NODE6, BE6, 8080)
    verdict, out = net.from_pod(frame6(BE6, NODE6, 8080, sport, flags="SA"))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[:4] == (MAC6[BE6], VIP6, BE6, 81)
    assert seen(out)[5] == 40200


def test_affinity_with_snat_remote_is_translated_here_once_the_source_is_known(net: Net) -> None:
    """Left to ip6tables as a whole while no IPv6 node address is known (one owner of the
    service's affinity); once it is, every flow of the frontend is the tc path's, source-translated
    (its backends are all remote: a local one would keep the client's address, and a test that
    could pick it would pass half the time without any translation), the client's backend
    remembered in ekp_aff6."""
    flags = NODEPORT | FrontendFlag.AFFINITY
    backends = ((1, REMOTE_BE6, 8080, 0), (2, "fd00:a:2::8", 8080, 0))
    add_service6(net.dp.maps, NODE6, 30080, backends, scope=Scope.EXTERNAL, flags=flags, affinity_timeout=60)
    frame = frame6(CLIENT6, NODE6, 50100, 30080)
    assert net.from_net(frame) == (TC_ACT_OK, frame), "no SNAT source: ip6tables'"
    snat_source(net, NODE6)
    chosen = set()
    for i in range(8):
        verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50101 + i, 30080))
        assert verdict == TC_ACT_REDIRECT
        chosen.add(seen(out)[1:3])
    assert len(chosen) == 1, chosen
    stats = net.stats()
    assert (stats[Stat.AFFINITY_HIT], stats[Stat.SNAT]) == (7, 8)
    ((src, dst),) = chosen
    assert src == NODE6 and dst in (REMOTE_BE6, "fd00:a:2::8"), "masqueraded, to the remembered backend"


def test_a_state_change_leaves_another_clients_entry_under_the_snat_twin_key_alone(net: Net) -> None:
    """A masqueraded flow's twin key is the node's SNAT tuple, which another client's flow of the
    same frontend and backend may hold since (the LRU evicts and reuses keys; written behind the
    flow's back here): same frontend, backend and translation, so only its client tells it from the
    twin. A FIN moves the flow's own entry and leaves that one alone; the true twin moves with it."""
    snat_source(net, NODE6)
    nodeport_to_remote(net)
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50500, 30080))
    assert verdict == TC_ACT_REDIRECT
    sport = seen(out)[3]
    assert net.from_net(frame6(CLIENT6, NODE6, 50500, 30080, flags="FA"))[0] == TC_ACT_REDIRECT
    assert ct6(net, REMOTE_BE6, NODE6, 8080, sport, reply=True).flags & CtFlag.FIN_FWD, "the true twin"

    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50501, 30080))
    assert verdict == TC_ACT_REDIRECT
    sport = seen(out)[3]
    rkey = abi.Ct6Key(
        abi.Addr6(*ip6_words(REMOTE_BE6)),
        abi.Addr6(*ip6_words(NODE6)),
        port_be(8080),
        port_be(sport),
        6,  # TCP
        abi.CtDir.REPLY,
    )
    other = ct6(net, REMOTE_BE6, NODE6, 8080, sport, reply=True)
    other.nat_addr = abi.Addr6(*ip6_words(OTHER_CLIENT6))
    net.dp.maps["ct6_tcp"].update(rkey, other)
    assert net.from_net(frame6(CLIENT6, NODE6, 50501, 30080, flags="FA"))[0] == TC_ACT_REDIRECT
    assert ct6(net, CLIENT6, NODE6, 50501, 30080).flags & CtFlag.FIN_FWD, "the flow's own entry moved"
    held = ct6(net, REMOTE_BE6, NODE6, 8080, sport, reply=True)
    assert ip6_str(held.nat_addr) == OTHER_CLIENT6 and not held.flags & CtFlag.FIN_FWD


def test_with_the_nodes_ipv6_address_every_flow_of_snat_and_host_backend_frontends_is_the_tc_paths(
    net: Net,
) -> None:
    """The pre-choice rule once the node's IPv6 address is known (bpf/ekp_tc6.h): a SNAT_REMOTE
    frontend's flows are all the tc path's (the local backend's kept, the remote ones
    source-translated), and so are those of a frontend with a backend on a node address, SNAT_ALL
    or not: that backend's flows are handed to the node's stack with the client's address
    (TC_ACT_OK), the others translated as any. 30 SYNs each, none left to ip6tables (before, the
    host-backend frontends' 60 all were)."""
    snat_source(net, NODE6)
    remote_too = ((1, BE6, 8080, BackendFlag.LOCAL), (2, REMOTE_BE6, 8080, 0), (3, "fd00:a:2::8", 8080, 0))
    add_service6(net.dp.maps, NODE6, 30080, remote_too, scope=Scope.EXTERNAL, flags=NODEPORT)
    host_too = ((4, BE6_2, 8080, BackendFlag.LOCAL), (5, NODE6, 10250, BackendFlag.HOST))
    add_service6(net.dp.maps, VIP6, 80, host_too, svc_id=2, set_id=2, rev_nat_id=2)
    add_service6(
        net.dp.maps, VIP6, 81, host_too, svc_id=3, set_id=3, rev_nat_id=3, flags=FrontendFlag.SNAT_ALL
    )
    to_host = 0
    for n in range(30):
        assert net.from_net(frame6(CLIENT6, NODE6, 50300 + n, 30080))[0] == TC_ACT_REDIRECT
        for port in (80, 81):
            verdict, out = net.from_pod(frame6(POD6, VIP6, 41300 + 2 * n + port - 80, port))
            if verdict == TC_ACT_OK:  # the node's own address: the stack's, the pod's address kept
                assert seen(out)[1:3] == (POD6, NODE6) and seen(out)[5] == 10250
                to_host += 1
            else:
                assert verdict == TC_ACT_REDIRECT and seen(out)[2] == BE6_2
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.PASS]) == (90, 0)
    assert 0 < to_host < 60, "both backends of the host frontends chosen"


def test_without_the_nodes_ipv6_address_a_source_translation_is_left_to_the_stack(net: Net) -> None:
    """ekp_cfg6 zero (an agent with no IPv6 half, before its first IPv6 sync): ip6tables'
    masquerade serves the flow, as before this path translated sources; written, the next flow is
    the tc path's."""
    nodeport_to_remote(net)
    frame = frame6(CLIENT6, NODE6, 50200, 30080)
    assert net.from_net(frame) == (TC_ACT_OK, frame)
    assert ct6(net, CLIENT6, NODE6, 50200, 30080) is None
    snat_source(net, NODE6)
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50201, 30080))
    assert verdict == TC_ACT_REDIRECT
    assert seen(out)[1:3] == (NODE6, REMOTE_BE6)
    cfg6 = read_config6(net.dp.maps)
    assert cfg6 is not None and ip6_str(cfg6.node_addr) == NODE6


def test_the_nodes_ipv6_address_changing_leaves_live_flows_their_source_and_is_never_read_half_written(
    net: Net,
) -> None:
    """ekp_cfg6 is double-buffered as ekp_cfg: the programs read the slot ekp_cfg6sel names, and
    the agent writes the other one, then flips it (write_config6). A slot being rewritten (written
    here behind the selector's back, another address) is never what a new flow gets; a flip is,
    from the next new flow on, while a live flow keeps the source its entries hold."""
    snat_source(net, NODE6)
    nodeport_to_remote(net)
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50300, 30080))
    assert verdict == TC_ACT_REDIRECT and seen(out)[1] == NODE6
    first_port = seen(out)[3]
    sel = net.dp.maps["cfg6sel"].lookup(ct.c_uint32(0))
    spare = 1 - (int(getattr(sel, "slot", 0)) & 1)
    half = abi.Config6(node_addr=abi.Addr6(*ip6_words("fd00:ff::99")))
    net.dp.maps["cfg6"].update(ct.c_uint32(spare), half)  # the agent's write before its flip
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50301, 30080))
    assert verdict == TC_ACT_REDIRECT and seen(out)[1] == NODE6, "the live slot, not the one being written"
    snat_source(net, NODE2_6)  # the node's address moved: write_config6 flips
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50302, 30080))
    assert verdict == TC_ACT_REDIRECT and seen(out)[1] == NODE2_6, "a new flow: the new address"
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50300, 30080, flags="A"))
    assert verdict == TC_ACT_REDIRECT and seen(out)[1:4] == (NODE6, REMOTE_BE6, first_port), "a live flow"


def test_a_restart_never_translates_a_new_flow_with_the_snat_source_an_earlier_run_left_pinned(
    net: Net, tmp_path: Path
) -> None:
    """ekp_cfg6 is pinned: the address an earlier run wrote was granted against that run's
    ip6tables rules and --bpf-snat-ports (which a restart may change). The restarted agent's load
    writes it zero before any sync or attach (the programs of the earlier run read it meanwhile),
    so until sync6 grants again a new flow that asks SNAT is left to ip6tables; a flow translated
    before keeps the source its entries hold. Here with the real programs and maps, the proxier's
    load over them (its attacher and sysctls are fakes)."""
    from tests.ebpf.test_proxier import Rig

    snat_source(net, NODE6)  # the earlier run, granted
    nodeport_to_remote(net)
    verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50400, 30080))
    assert verdict == TC_ACT_REDIRECT and seen(out)[1] == NODE6, "the earlier run's flow, translated"
    live_port = seen(out)[3]

    rig = Rig(tmp_path)
    rig.maps = cast(Any, net.dp.maps)  # the pinned maps, as the restarted agent opens them
    p = rig.proxier()
    p.prepare()  # the load: nothing granted yet (no ip6tables restore, no sync6)
    try:
        frame = frame6(CLIENT6, NODE6, 50401, 30080)
        assert net.from_net(frame) == (TC_ACT_OK, frame), "left to ip6tables' masquerade"
        assert ct6(net, CLIENT6, NODE6, 50401, 30080) is None
        cfg6 = read_config6(net.dp.maps)
        assert cfg6 is not None and not any(cfg6.node_addr)
        verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50400, 30080, flags="A"))
        assert verdict == TC_ACT_REDIRECT and seen(out)[1:4] == (NODE6, REMOTE_BE6, live_port), (
            "the live flow keeps its source"
        )
    finally:
        p.close()


def test_a_restart_whose_pinned_grant_still_holds_keeps_masquerading_new_flows_in_tc(
    net: Net, tmp_path: Path
) -> None:
    """The earlier run was granted, and its ip6tables, thinned, holds no rule for the NodePort tc
    masquerades. The restarted agent's load finds the pinned address still the node's primary IPv6
    one and ekp_config's range its own --bpf-snat-ports: the grant stays, and a new flow is still
    masqueraded by tc (zeroed, it would go to a stack with no rule for it until the first IPv6
    restore). Real programs and maps, the proxier's load over them."""
    from dataclasses import replace

    from agent.config import HostRouting, NodeContext
    from tests.ebpf.test_proxier import Rig

    snat_source(net, NODE6)  # the earlier run, granted
    nodeport_to_remote(net)
    rig = Rig(tmp_path)
    rig.maps = cast(Any, net.dp.maps)
    rig.config = replace(
        rig.config,
        node_ips=("192.168.0.11", NODE6),
        socket_lb=True,
        bpf_host_routing=HostRouting.BPF,
        snat_ports=(SNAT_MIN, SNAT_MAX),
    )
    rig.local_ports = "32768\t39999"  # the range beside the kernel's ephemeral ports
    rig.node6 = NodeContext(node_ips=(NODE6,), primary_ip=NODE6)
    p = rig.proxier()
    p.prepare()
    try:
        verdict, out = net.from_net(frame6(CLIENT6, NODE6, 50402, 30080))
        assert verdict == TC_ACT_REDIRECT and seen(out)[1] == NODE6, "masqueraded by tc across the restart"
        assert SNAT_MIN <= seen(out)[3] <= SNAT_MAX
    finally:
        p.close()


def test_two_cpus_claiming_one_free_snat_port_at_once_never_both_count_it(net: Net) -> None:
    """The SNAT range is one port; each round two new flows (two clients) are decided at the same
    moment on the machine's two CPUs (lab/cpurace.py), the table empty before. Each walk sees the
    port free, or held by the other's unanswered flow (then it early-drops that flow, counted). A
    flow that wrote over the other's entry after its walk saw the port free (the other claimed it
    in between: ekp_ct_place) would take it uncounted, the other's entries gone behind its
    NEW_FLOWS; so each round must leave exactly one flow, whole (no FORWARD entry without its
    twin), one more than it early-dropped (lab/dplab.py TupleRace), the loser of a race dropped as
    DROP_TUPLE_TAKEN."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert len(cpus) == 2, "the race needs two CPUs"
    snat_source(net, NODE6)
    set_config(net.dp, snat_port_min=SNAT_MIN, snat_port_max=SNAT_MIN)
    nodeport_to_remote(net)
    fd, ifindex = net.dp.prog_fd("ekp_from_net"), net.lab.ext.ifindex
    runs = [
        [PreparedRun(fd, frame6(client, NODE6, 20000 + r, 30080), ifindex) for r in range(RACE_ROUNDS)]
        for client in (CLIENT6, OTHER_CLIENT6)
    ]
    check = TupleRace(net, "ct6_tcp")
    rounds = race_rounds(cpus, runs, check, timeout_s=60)
    check()
    assert rounds == RACE_ROUNDS == check.rounds, f"{rounds} rounds run, {check.raced} of them raced"


RACE_ROUNDS = 1500
