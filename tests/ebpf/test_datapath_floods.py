"""Floods, packet by packet: spoofed SYNs cannot lock real clients out of a NodePort nor evict
established flows, and rejects are rate-limited so the node is no amplifier for spoofed sources.

The lab cases of tests/adversarial/test_floods.py, reduced to what the programs do with each packet:
an unanswered flow has the short handshake timeout and is the first to go when the SNAT range is
full (the kernel's early drop); a reject over the per-CPU token bucket is dropped and counted.
"""

from __future__ import annotations

import ctypes as ct
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest

from agent.ebpf.abi import CtFlag, CtqRing, CtqSlot, FrontendFlag, Scope, Stat
from agent.ebpf.loader import Datapath, ring_position, ring_slots
from lab.cpurace import race_rounds
from lab.dplab import (
    BE1,
    CLIENT,
    MAC,
    NODE,
    NODE2,
    POD_CLIENT,
    REMOTE_BE,
    SIZES,
    SNAT_MIN,
    TEST_ROLES,
    UDP,
    VIP,
    Lab,
    Net,
    TupleRace,
    reset_maps,
    set_config,
)
from lab.packets import (
    TC_ACT_REDIRECT,
    TC_ACT_SHOT,
    PreparedRun,
    icmp_error,
    loaded_datapath,
    parse,
    tcp,
    udp,
)

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

PORTS = 64  # a small SNAT range the flood fills


def nodeport(net: Net) -> None:
    flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL
    net.add_service(NODE, 30080, ((7, REMOTE_BE, 8080, 0),), scope=Scope.EXTERNAL, flags=flags)


def spoofed(i: int) -> str:
    return f"198.18.{i // 250}.{i % 250 + 1}"


def flood(net: Net, count: int, *, answered: bool = True) -> None:
    """`count` SYNs from spoofed sources; the backend answers each (its SYN-ACK comes back through
    the node) but no ACK ever follows."""
    for i in range(count):
        out = net.from_net(tcp(spoofed(i), NODE, 1024 + i, 30080))
        if out[0] != TC_ACT_REDIRECT or not answered:
            continue
        snat_port = parse(out[1]).sport
        net.from_net(tcp(REMOTE_BE, NODE, 8080, snat_port, flags="SA", smac=MAC[NODE2]))


def test_unanswered_and_half_open_flows_carry_the_short_timeout(net: Net) -> None:
    nodeport(net)
    flood(net, 20)
    for i in range(20):
        entry = net.ct(spoofed(i), NODE, 1024 + i, 30080)
        assert entry is not None
        assert entry.flags == CtFlag.SNAT | CtFlag.SEEN_REPLY  # never ESTABLISHED: tcp_syn_s, 60 s
    key = (spoofed(0), NODE, 1024, 30080)
    entry = net.ct(*key)
    assert entry is not None
    entry.last_seen_ns = time.monotonic_ns() - 61 * 10**9
    net.ct_put(*key, entry)
    # expired after 61 s: its retransmitted SYN is a new flow, no longer the old one
    assert net.from_net(tcp(spoofed(0), NODE, 1024, 30080))[0] == TC_ACT_REDIRECT
    assert net.stats()[Stat.NEW_FLOWS] == 21


def test_a_full_range_evicts_an_unanswered_flow_for_a_real_client(net: Net, dp: Datapath) -> None:
    """64 SNAT ports, 64 half-open spoofed flows hold them all: a real client still gets a port
    (the kernel's early drop), its handshake completes, and the flood cannot take it back."""
    set_config(dp, snat_port_max=SNAT_MIN + PORTS - 1)
    nodeport(net)
    flood(net, PORTS)
    assert net.stats()[Stat.EARLY_DROP] == 0
    out = net.from_net(tcp(CLIENT, NODE, 5000, 30080))
    assert out[0] == TC_ACT_REDIRECT
    port = parse(out[1]).sport
    assert net.stats()[Stat.EARLY_DROP] == 1
    victims = [i for i in range(PORTS) if net.ct(spoofed(i), NODE, 1024 + i, 30080) is None]
    assert len(victims) == 1  # the evicted flow lost both entries
    assert net.from_net(tcp(REMOTE_BE, NODE, 8080, port, flags="SA", smac=MAC[NODE2]))[0] == TC_ACT_REDIRECT
    assert net.from_net(tcp(CLIENT, NODE, 5000, 30080, flags="A"))[0] == TC_ACT_REDIRECT
    real = net.ct(CLIENT, NODE, 5000, 30080)
    assert real is not None and real.flags & CtFlag.ESTABLISHED
    flood(net, 3 * PORTS)  # the flood goes on, evicting itself
    assert net.ct(CLIENT, NODE, 5000, 30080) is not None
    back = parse(net.from_net(tcp(REMOTE_BE, NODE, 8080, port, flags="PA", smac=MAC[NODE2]))[1])
    assert (back.dst, back.dport) == (CLIENT, 5000)


def test_two_cpus_claiming_one_free_snat_port_at_once_never_both_count_it(net: Net, dp: Datapath) -> None:
    """IPv4's conntrack (the template's ekp_ct_place, as IPv6's, test_datapath_ipv6_snat.py): one
    SNAT port, two new flows each round at one moment on two CPUs (lab/cpurace.py), the table empty
    before. Each round leaves exactly one flow, whole (no FORWARD entry without its twin), and
    keeps one flow more than it early-dropped (lab/dplab.py TupleRace); a race's loser drops as
    DROP_TUPLE_TAKEN, never writing over the winner's entries uncounted."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert len(cpus) == 2, "the race needs two CPUs"
    set_config(dp, snat_port_max=SNAT_MIN)
    nodeport(net)
    fd, ifindex = dp.prog_fd("ekp_from_net"), net.lab.ext.ifindex
    runs = [
        [PreparedRun(fd, tcp(client, NODE, 20000 + r, 30080), ifindex) for r in range(RACE_ROUNDS)]
        for client in (CLIENT, spoofed(0))
    ]
    check = TupleRace(net, "ct_tcp")
    rounds = race_rounds(cpus, runs, check, timeout_s=60)
    check()
    assert rounds == RACE_ROUNDS == check.rounds, f"{rounds} rounds run, {check.raced} of them raced"


RACE_ROUNDS = 1500


def test_a_range_full_of_established_flows_refuses_the_next(net: Net, dp: Datapath) -> None:
    set_config(dp, snat_port_max=SNAT_MIN + 3)
    nodeport(net)
    for i in range(4):
        out = net.from_net(tcp(spoofed(i), NODE, 2000 + i, 30080))
        port = parse(out[1]).sport
        net.from_net(tcp(REMOTE_BE, NODE, 8080, port, flags="SA", smac=MAC[NODE2]))
        net.from_net(tcp(spoofed(i), NODE, 2000 + i, 30080, flags="A"))
    assert net.from_net(tcp(CLIENT, NODE, 5001, 30080))[0] == TC_ACT_SHOT
    stats = net.stats()
    assert (stats[Stat.DROP_SNAT_PORTS], stats[Stat.EARLY_DROP]) == (1, 0)


@contextmanager
def on_one_cpu() -> Iterator[None]:
    """BPF_PROG_TEST_RUN runs the program on the caller's CPU: stay on one, one bucket."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def test_rejects_are_rate_limited_per_cpu(net: Net, dp: Datapath, lab: Lab) -> None:
    """A burst of 10, 100 per second: 300 datagrams to a NodePort without endpoints in a few ms
    get about 10 port unreachables; the rest are dropped and counted, and the bucket refills."""
    set_config(dp, icmp_rate=100, icmp_burst=10)
    net.add_service(NODE, 30053, (), proto=UDP, scope=Scope.EXTERNAL, flags=FrontendFlag.NO_ENDPOINTS)
    with on_one_cpu():
        started = time.monotonic()
        answered = sum(
            net.from_net(udp(spoofed(i), NODE, 3000 + i, 30053, smac=MAC[CLIENT], dmac=lab.ext.mac))[0]
            == TC_ACT_REDIRECT
            for i in range(300)
        )
        elapsed = time.monotonic() - started
    assert 10 <= answered <= 10 + 100 * elapsed + 1
    stats = net.stats()
    assert stats[Stat.DROP_NO_ENDPOINTS] == answered and stats[Stat.DROP_ICMP_RATE] == 300 - answered
    time.sleep(0.05)  # 5 tokens
    out = net.from_net(udp(CLIENT, NODE, 4000, 30053, smac=MAC[CLIENT], dmac=lab.ext.mac))
    assert out[0] == TC_ACT_REDIRECT and (icmp_error(out[1]).type, icmp_error(out[1]).code) == (3, 3)


def test_the_default_limit_is_the_kernels(net: Net, dp: Datapath, lab: Lab) -> None:
    """CFG carries icmp_msgs_per_sec 1000 and icmp_msgs_burst 50: 5,000 datagrams at once get the
    burst and what a second of refill allows, not 5,000 answers."""
    net.add_service(NODE, 30053, (), proto=UDP, scope=Scope.EXTERNAL, flags=FrontendFlag.NO_ENDPOINTS)
    with on_one_cpu():
        started = time.monotonic()
        answered = sum(
            net.from_net(udp(spoofed(i), NODE, 3000, 30053, smac=MAC[CLIENT], dmac=lab.ext.mac))[0]
            == TC_ACT_REDIRECT
            for i in range(5000)
        )
        elapsed = time.monotonic() - started
    assert 50 <= answered <= 50 + 1000 * elapsed + 1
    assert net.stats()[Stat.DROP_ICMP_RATE] == 5000 - answered


# ---- the early-drop queue of conntrack (bpf/ekp_ctq.h) -------------------------------------
#
# SIZES gives the TCP table 4,096 entries (2,048 flows), so its ring has 1,024 slots: at most
# 1,024 flows are ever unassured or closed at once. The flows below come from one pod address
# with many source ports (a flood of any source looks the same to conntrack).

RING = SIZES.ct_tcp // 4


def syns(src: str, dst: str, dport: int, sports: range) -> Iterator[bytes]:
    """SYN frames differing only in their source port (the TCP checksum is left as built: the
    programs neither check nor need it)."""
    frame = bytearray(tcp(src, dst, sports.start, dport))
    for sport in sports:
        frame[34:36] = sport.to_bytes(2, "big")
        yield bytes(frame)


def established(net: Net, sport: int) -> None:
    """A ClusterIP connection from POD_CLIENT:sport through its handshake."""
    assert net.from_pod(tcp(POD_CLIENT, VIP, sport, 80))[0] == TC_ACT_REDIRECT
    assert net.from_pod(tcp(BE1, POD_CLIENT, 8080, sport, flags="SA"))[0] == TC_ACT_REDIRECT
    assert net.from_pod(tcp(POD_CLIENT, VIP, sport, 80, flags="A"))[0] == TC_ACT_REDIRECT


def answers(net: Net, sport: int) -> bool:
    """The connection still carries a segment each way, translated."""
    out = net.from_pod(tcp(POD_CLIENT, VIP, sport, 80, flags="PA", payload=b"ping"))
    back = net.from_pod(tcp(BE1, POD_CLIENT, 8080, sport, flags="PA", payload=b"pong"))
    return (
        out[0] == back[0] == TC_ACT_REDIRECT
        and parse(out[1]).dst == BE1
        and (parse(back[1]).src, parse(back[1]).sport) == (VIP, 80)
    )


def test_a_syn_flood_six_times_the_table_leaves_every_established_flow(net: Net) -> None:
    """12,000 SYNs never answered into a table of 2,048 flows, behind 50 idle established ones.
    An LRU alone evicts the idle ones (the oldest); the queue deletes the flood's flows a ring
    after they began, so the table never fills and every established flow still answers."""
    net.add_service()
    for sport in range(1000, 1050):
        established(net, sport)
    for frame in syns(POD_CLIENT, VIP, 80, range(20000, 32000)):
        assert net.from_pod(frame)[0] == TC_ACT_REDIRECT
    assert all(answers(net, sport) for sport in range(1000, 1050))
    stats = net.stats()
    assert stats[Stat.DROP_NO_FLOW] == 0
    assert stats[Stat.EVICT_UNREPLIED] == 12000 - RING  # all but the last ring of the flood
    assert (stats[Stat.EVICT_UNASSURED], stats[Stat.EVICT_CLOSED]) == (0, 0)
    assert net.ct_count() == 2 * (50 + RING)


def test_half_open_flows_are_evicted_as_unassured(net: Net) -> None:
    """Answered by the backend (SYN-ACK) but never acked: replied, not assured."""
    net.add_service()
    for sport in range(2000, 2000 + RING + 76):
        assert net.from_pod(tcp(POD_CLIENT, VIP, sport, 80))[0] == TC_ACT_REDIRECT
        net.from_pod(tcp(BE1, POD_CLIENT, 8080, sport, flags="SA"))
    stats = net.stats()
    assert (stats[Stat.EVICT_UNASSURED], stats[Stat.EVICT_UNREPLIED]) == (76, 0)
    assert (
        net.ct(POD_CLIENT, VIP, 2075, 80) is None and net.ct(BE1, POD_CLIENT, 8080, 2075, reply=True) is None
    )
    assert net.ct(POD_CLIENT, VIP, 2076, 80) is not None


def test_closed_flows_go_a_ring_after_they_close_and_half_closed_ones_stay(net: Net) -> None:
    """Ten connections reset and five half closed (one FIN: a stream may still flow the other way,
    for an hour), then a ring of new flows: the reset ones are deleted when the queue comes round
    to them, the half-closed ones stay."""
    net.add_service()
    for sport in range(3000, 3015):
        established(net, sport)
    for sport in range(3000, 3010):
        net.from_pod(tcp(POD_CLIENT, VIP, sport, 80, flags="R"))
    for sport in range(3010, 3015):
        net.from_pod(tcp(POD_CLIENT, VIP, sport, 80, flags="FA"))
    for frame in syns(POD_CLIENT, VIP, 80, range(20000, 20000 + RING)):
        net.from_pod(frame)
    stats = net.stats()
    assert (stats[Stat.EVICT_CLOSED], stats[Stat.EVICT_UNREPLIED]) == (10, 0)
    assert all(net.ct(POD_CLIENT, VIP, sport, 80) is None for sport in range(3000, 3010))
    assert all(answers(net, sport) for sport in range(3010, 3015))


def test_a_later_flow_on_the_tuple_is_not_taken_for_the_one_queued(net: Net) -> None:
    """The queue names a flow by its key and when it began: a flow that began later on the same
    tuple (queued in a slot of its own) is left alone when the old slot comes round."""
    net.add_service()
    assert net.from_pod(tcp(POD_CLIENT, VIP, 4000, 80))[0] == TC_ACT_REDIRECT
    entry = net.ct(POD_CLIENT, VIP, 4000, 80)
    assert entry is not None
    entry.created_s += 1
    net.ct_put(POD_CLIENT, VIP, 4000, 80, entry)
    for frame in syns(POD_CLIENT, VIP, 80, range(20000, 20000 + RING)):
        net.from_pod(frame)
    assert net.ct(POD_CLIENT, VIP, 4000, 80) is not None
    assert net.stats()[Stat.EVICT_UNREPLIED] == 0


def test_udp_flows_have_a_ring_of_their_own(net: Net) -> None:
    """Unanswered datagrams fill the other table's ring: a UDP flood never moves the TCP ring."""
    net.add_service()
    net.add_service(port=53, proto=UDP, backends=((2, BE1, 5353, 1),), svc_id=2, set_id=2, rev_nat_id=2)
    established(net, 5000)
    frame = bytearray(udp(POD_CLIENT, VIP, 0, 53))
    extra = 76
    for sport in range(10000, 10000 + SIZES.ct_any // 4 + extra):
        frame[34:36] = sport.to_bytes(2, "big")
        assert net.from_pod(bytes(frame))[0] == TC_ACT_REDIRECT
    stats = net.stats()
    assert stats[Stat.EVICT_UNREPLIED] == extra
    heads = {int(k.value): ring_position(v.value) for k, v in net.dp.maps["ctqh"].items()}
    assert heads == {CtqRing.TCP: 1, CtqRing.ANY: SIZES.ct_any // 4 + extra}
    assert answers(net, 5000)


def _head(net: Net) -> int:
    value = net.dp.maps["ctqh"].lookup(ct.c_uint32(CtqRing.TCP))
    assert value is not None
    return int(value.value)


def _queued_sport(net: Net, slot: int) -> int:
    """The client port of the flow queued in the TCP ring's `slot` (network order in the map)."""
    s = net.dp.maps["ctq_tcp"].lookup(ct.c_uint32(slot))
    assert isinstance(s, CtqSlot)
    return int.from_bytes(int(s.sport).to_bytes(2, "little"), "big")


def test_the_position_wraps_off_the_top_of_the_head_leaving_the_count(net: Net) -> None:
    """The position is the head's high half (one atomic add of 2^32 per flow queued): at the last
    position before the wrap a flow goes in the ring's last slot, the next add's carry falls off
    the top of the word, and the next flow goes in slot 0 with the count (the low half) as the
    agent wrote it. (RING divides 2^32: no slot is taken early at this wrap.)"""
    net.add_service()
    last = (1 << 32) - 1
    net.dp.maps["ctqh"].update(ct.c_uint32(CtqRing.TCP), ct.c_uint64(last << 32 | RING))
    for frame in syns(POD_CLIENT, VIP, 80, range(21000, 21002)):
        assert net.from_pod(frame)[0] == TC_ACT_REDIRECT
    head = _head(net)
    assert (ring_position(head), ring_slots(head)) == (1, RING), "wrapped; the count untouched"
    assert (_queued_sport(net, RING - 1), _queued_sport(net, 0)) == (21000, 21001)
    assert net.stats()[Stat.EVICT_UNREPLIED] == 0, "the slots were empty: nothing reclaimed"


def test_a_count_that_does_not_divide_the_wrap_restarts_the_ring_early(net: Net) -> None:
    """Where the count does not divide 2^32 the ring restarts at slot 0 at the wrap: the flow
    queued there less than a ring ago is reclaimed early (bpf/ekp_abi.h; at most 2^32 mod slots
    flows, once every 2^32). Here a head preset to 1,000 slots, two positions before the wrap: the
    flows go in slots 294 and 295 (2^32 - 2 and - 1 mod 1,000), then slot 0."""
    net.add_service()
    slots = 1000
    net.dp.maps["ctqh"].update(ct.c_uint32(CtqRing.TCP), ct.c_uint64(((1 << 32) - 2) << 32 | slots))
    for frame in syns(POD_CLIENT, VIP, 80, range(22000, 22003)):
        assert net.from_pod(frame)[0] == TC_ACT_REDIRECT
    head = _head(net)
    assert (ring_position(head), ring_slots(head)) == (1, slots)
    assert [_queued_sport(net, i) for i in (294, 295, 0)] == [22000, 22001, 22002]


def test_a_ring_of_another_size_queues_by_its_own_slot_count(net: Net, lab: Lab) -> None:
    """The ring's slot count is the load's, read by the programs from its head (ekp_ctqh's low
    half, written from the ring's max_entries), not compiled in: the same build loaded with an
    eighth of the packet lab's TCP table has a ring of 128 slots, and a SYN flood is evicted a
    ring of 128 after it began, where the packet lab's programs' ring is 1,024 (RING)."""
    small = replace(SIZES, ct_tcp=SIZES.ct_tcp // 8)
    ring = small.ct_tcp // 4
    with loaded_datapath(small) as dp:
        assert dp.build() == net.dp.build(), "the same object, other sizes"
        assert dp.maps["ctq_tcp"].info().max_entries == ring
        reset_maps(dp)
        other = Net(dp, lab)
        other.add_service()
        extra = 40
        for frame in syns(POD_CLIENT, VIP, 80, range(20000, 20000 + ring + extra)):
            assert other.from_pod(frame)[0] == TC_ACT_REDIRECT
        assert other.stats()[Stat.EVICT_UNREPLIED] == extra, "a ring of 128 slots went round"
        head = dp.maps["ctqh"].lookup(ct.c_uint32(CtqRing.TCP))
        assert head is not None
        assert (ring_slots(head.value), ring_position(head.value)) == (ring, ring + extra)
        for role in TEST_ROLES:
            dp.maps[role].clear()
