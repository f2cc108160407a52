"""An upgrade's hand-over, packet by packet (BPF_PROG_TEST_RUN): the build's mode (ekp_handover,
bpf/ekp_abi.h) says how its programs behave in front of an older generation's filter
(agent/ebpf/attach.py). TC_ACT_UNSPEC is cls_bpf's "no verdict": the next filter, the older
program, decides the packet.

  OFF   (a plain start): a miss is decided here (NO_FLOW dropped, the rest passed to the stack);
  PASS  every packet goes on, nothing decided, nothing counted, no entry made;
  MISS  new flows and conntrack hits are ours; a miss goes on, counted PASS (never NO_FLOW).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.ebpf.abi import FrontendFlag, HandoverMode, Scope, Stat
from agent.ebpf.loader import Datapath
from lab.dplab import BE1, CLIENT, MAC, NODE, POD_CLIENT, REMOTE_BE, VIP, Lab, Net
from lab.packets import TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, XDP_PASS, XDP_TX, tcp

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps", "mode_off_after")]


@pytest.fixture
def mode_off_after(dp: Datapath) -> Iterator[None]:
    yield
    dp.set_handover(HandoverMode.OFF)


def test_a_mid_flow_segment_without_conntrack_goes_on_to_the_older_program_only_in_hand_over(
    net: Net, dp: Datapath
) -> None:
    """A segment of a flow the older generation translated (its entry not carried over yet) is
    dropped as no_flow by a build alone on its hook; in hand-over it goes on, unchanged."""
    net.add_service()
    ack = tcp(POD_CLIENT, VIP, 40000, 80, flags="A")
    assert net.from_pod(ack) == (TC_ACT_SHOT, ack)
    assert net.stats()[Stat.DROP_NO_FLOW] == 1
    dp.set_handover(HandoverMode.MISS)
    assert net.from_pod(ack) == (TC_ACT_UNSPEC, ack)
    stats = net.stats()
    assert (stats[Stat.DROP_NO_FLOW], stats[Stat.PASS], stats[Stat.PACKETS]) == (1, 1, 2)
    assert net.ct(POD_CLIENT, VIP, 40000, 80) is None


def test_a_reply_of_an_older_flow_goes_on_in_hand_over_and_to_the_stack_otherwise(
    net: Net, dp: Datapath
) -> None:
    net.add_service()
    reply = tcp(BE1, POD_CLIENT, 8080, 40000, flags="SA")
    assert net.from_pod(reply) == (TC_ACT_OK, reply)
    dp.set_handover(HandoverMode.MISS)
    assert net.from_pod(reply) == (TC_ACT_UNSPEC, reply)
    assert net.stats()[Stat.PASS] == 2


def test_new_flows_and_their_hits_are_ours_in_hand_over(net: Net, dp: Datapath) -> None:
    net.add_service()
    dp.set_handover(HandoverMode.MISS)
    verdict, _ = net.from_pod(tcp(POD_CLIENT, VIP, 40001, 80))
    assert verdict == TC_ACT_REDIRECT
    assert net.ct(POD_CLIENT, VIP, 40001, 80) is not None
    verdict, _ = net.from_pod(tcp(POD_CLIENT, VIP, 40001, 80, flags="A"))
    assert verdict == TC_ACT_REDIRECT
    verdict, _ = net.from_pod(tcp(BE1, POD_CLIENT, 8080, 40001, flags="SA"))
    assert verdict == TC_ACT_REDIRECT
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY], stats[Stat.PASS]) == (
        1,
        1,
        1,
        0,
    )


def test_pass_mode_leaves_every_packet_to_the_older_program_untouched_and_uncounted(
    net: Net, dp: Datapath, lab: Lab
) -> None:
    net.add_service()
    net.add_service(
        NODE,
        30080,
        ((7, REMOTE_BE, 8080, 0),),
        scope=Scope.EXTERNAL,
        flags=FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL,
        rev_nat_id=3,
        svc_id=3,
        set_id=3,
    )
    dp.set_handover(HandoverMode.PASS)
    syn = tcp(POD_CLIENT, VIP, 40002, 80)
    from_client = tcp(CLIENT, NODE, 5555, 30080, flags="S", smac=MAC[CLIENT], dmac=lab.ext.mac)
    assert net.from_pod(syn) == (TC_ACT_UNSPEC, syn)
    assert net.from_net(from_client) == (TC_ACT_UNSPEC, from_client)
    assert net.to_net(syn) == (TC_ACT_UNSPEC, syn)
    assert net.xdp(from_client) == (XDP_PASS, from_client)
    assert net.ct(POD_CLIENT, VIP, 40002, 80) is None and net.ct(CLIENT, NODE, 5555, 30080) is None
    assert not any(net.stats().values()) and not any(net.xstats().values())


def test_xdp_leaves_everything_to_tc_in_hand_over_and_translates_alone(
    net: Net, dp: Datapath, lab: Lab
) -> None:
    """XDP has no older program behind it on its hook: in hand-over every packet goes to tc, where
    the older generation's filter is behind ours."""
    net.add_service(
        NODE,
        30080,
        ((7, REMOTE_BE, 8080, 0),),
        scope=Scope.EXTERNAL,
        flags=FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL,
        rev_nat_id=3,
        svc_id=3,
        set_id=3,
    )
    from_client = tcp(CLIENT, NODE, 5555, 30080, flags="S", smac=MAC[CLIENT], dmac=lab.ext.mac)
    dp.set_handover(HandoverMode.MISS)
    assert net.xdp(from_client) == (XDP_PASS, from_client)
    assert not any(net.xstats().values())
    dp.set_handover(HandoverMode.OFF)
    verdict, _ = net.xdp(from_client)
    assert verdict == XDP_TX


def test_what_the_egress_program_leaves_alone_goes_on_to_the_older_egress_program_in_hand_over(
    net: Net, dp: Datapath
) -> None:
    """The node's own packets that are no reply of ours, and forwarded ones."""
    frame = tcp(NODE, POD_CLIENT, 8080, 40003, flags="A")
    assert net.to_pod(frame) == (TC_ACT_OK, frame)
    dp.set_handover(HandoverMode.MISS)
    assert net.to_pod(frame) == (TC_ACT_UNSPEC, frame)
    assert net.to_pod(frame, came_in_by=net.lab.ext.ifindex) == (TC_ACT_UNSPEC, frame)


def test_the_pinned_mode_reads_back_for_the_build_and_for_agent_doctor(dp: Datapath) -> None:
    """A restarted agent resumes a hand-over from the mode pinned with its build (never lowers
    it); agent doctor lists every pinned build's mode."""
    from agent.ebpf.loader import pinned_handover_modes

    assert dp.handover_mode() == HandoverMode.OFF
    dp.set_handover(HandoverMode.MISS)
    assert dp.handover_mode() == HandoverMode.MISS
    modes = pinned_handover_modes(dp.pin_path)
    assert HandoverMode.MISS in modes.values(), modes
    dp.set_handover(HandoverMode.OFF)
    assert set(pinned_handover_modes(dp.pin_path).values()) == {HandoverMode.OFF}
