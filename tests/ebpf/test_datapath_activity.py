"""Flow activity (bpf/ekp_act.h, agent/ebpf/activity.py), packet by packet: a packet whose endpoints
no live flow stamped leaves without a conntrack lookup once the agent armed the check; flows keep
translating through everything that stamps (new flows, refreshes, a frontend that went away);
the agent's slot hash is the data path's; arming stamps what the tables hold.

The observable of "no lookup" is a conntrack entry the data path did not stamp: a packet that
would hit it is passed untranslated when the check says its endpoints are idle.
"""

from __future__ import annotations

import ctypes as ct
import random
import time

import pytest

from agent.ebpf import abi, activity
from agent.ebpf.abi import BackendFlag, CtFlag, Stat, ip_be, port_be
from agent.ebpf.loader import Datapath
from lab.dplab import (
    BE1,
    BE2,
    BE3,
    POD_CLIENT,
    TCP,
    UDP,
    VIP,
    Net,
    ct_key,
    set_config,
)
from lab.packets import TC_ACT_OK, TC_ACT_REDIRECT, parse, tcp, udp

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

LOCAL = BackendFlag.LOCAL


def unstamped_flow(net: Net, client: str, server: str, cport: int, sport: int, proto: int = TCP) -> None:
    """A FORWARD entry client -> server translated to BE3, written without any stamp (as programs
    that kept none would have left it); no service port (svc_id 0), so a UDP flow needs no
    membership."""
    entry = abi.CtEntry(
        last_seen_ns=time.monotonic_ns(),
        nat_addr=ip_be(BE3),
        nat_port=port_be(8080),
        fe_addr=ip_be(server),
        fe_port=port_be(sport),
        flags=int(CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED),
    )
    net.dp.maps[abi.ct_role(proto)].update(ct_key(client, server, cport, sport, proto), entry)


def frame(proto: int, src: str, dst: str, sport: int, dport: int) -> bytes:
    if proto == TCP:
        return tcp(src, dst, sport, dport, flags="PA", payload=b"x")
    return udp(src, dst, sport, dport)


def test_a_packet_of_no_live_flow_leaves_without_a_conntrack_lookup(net: Net) -> None:
    """Armed: the entry is never looked up (the packet leaves as it came); disarmed (an agent
    starting, before it stamped what the tables hold): every packet takes the lookups."""
    unstamped_flow(net, POD_CLIENT, BE2, 41000, 8080)
    packet = frame(TCP, POD_CLIENT, BE2, 41000, 8080)
    assert net.from_pod(packet) == (TC_ACT_OK, packet)
    assert net.stats()[Stat.PASS] == 1
    activity.disarm(net.dp.maps["act"])
    verdict, out = net.from_pod(packet)
    assert verdict == TC_ACT_REDIRECT and parse(out).dst == BE3


@pytest.mark.parametrize("proto", [TCP, UDP])
def test_the_agents_slot_hash_is_the_data_paths(net: Net, proto: int) -> None:
    """Endpoints stamped by the agent (activity.slot) send their packets to the lookups; endpoints
    in slots nobody stamped do not."""
    rng = random.Random(16)
    servers: list[tuple[str, int]] = []
    while len(servers) < 48:
        addr = f"10.{rng.randrange(1, 250)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
        servers.append((addr, rng.randrange(1, 65535)))
    stamped = servers[::2]
    for addr, port in servers:
        unstamped_flow(net, POD_CLIENT, addr, 42000, port, proto)
    net.stamp(*((ip_be(addr), port_be(port), proto) for addr, port in stamped))
    slots = {activity.slot(ip_be(a), port_be(p), proto) for a, p in stamped}
    client_slot = activity.slot(ip_be(POD_CLIENT), port_be(42000), proto)
    for addr, port in servers:
        verdict, out = net.from_pod(frame(proto, POD_CLIENT, addr, 42000, port))
        if (addr, port) in stamped:
            assert verdict == TC_ACT_REDIRECT and parse(out).dst == BE3, (addr, port)
        elif activity.slot(ip_be(addr), port_be(port), proto) not in slots | {client_slot}:
            assert verdict == TC_ACT_OK, (addr, port)


def test_flows_translate_both_ways_with_the_check_armed(net: Net) -> None:
    """The data path stamps what it creates and refreshes: a whole flow through a ClusterIP."""
    net.add_service(backends=((1, BE1, 8080, LOCAL),))
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 43000, 80))[1]).dst == BE1
    assert parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, 43000, flags="SA"))[1]).src == VIP
    for _ in range(3):
        assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 43000, 80, flags="PA"))[1]).dst == BE1
        assert parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, 43000, flags="PA"))[1]).src == VIP
    stats = net.stats()
    assert (stats[Stat.NEW_FLOWS], stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY]) == (1, 3, 4)


def test_a_flow_outlives_its_frontend_through_its_stamps(net: Net) -> None:
    """A Service deleted (frontend and address gone): the stream's packets still take the lookups,
    because the flow stamped its frontend and backend."""
    net.add_service(backends=((1, BE1, 8080, LOCAL),))
    net.from_pod(tcp(POD_CLIENT, VIP, 43100, 80))
    net.from_pod(tcp(BE1, POD_CLIENT, 8080, 43100, flags="SA"))
    net.from_pod(tcp(POD_CLIENT, VIP, 43100, 80, flags="A"))
    net.dp.maps["fe"].clear()
    assert net.dp.maps["addr"].delete(abi.AddrKey(ip_be(VIP)))
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 43100, 80, flags="PA"))[1]).dst == BE1
    assert parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, 43100, flags="PA"))[1]).src == VIP


def test_stamps_older_than_the_longest_timeout_say_no_flow_is_left(net: Net, dp: Datapath) -> None:
    """Every timeout 5 s: a slot stamped 20 s ago holds no live flow (its entries expired since);
    one stamped 3 s ago may. Packets to a frontend take the lookups whatever the stamps."""
    set_config(
        dp, tcp_established_s=5, tcp_close_wait_s=5, tcp_syn_s=5, tcp_closed_s=5, udp_s=5, udp_stream_s=5
    )
    net.add_service(backends=((1, BE1, 8080, LOCAL),))
    net.from_pod(tcp(POD_CLIENT, VIP, 43200, 80))
    endpoints = [(ip_be(VIP), port_be(80), TCP), (ip_be(BE1), port_be(8080), TCP)]
    reply = tcp(BE1, POD_CLIENT, 8080, 43200, flags="SA")
    net.stamp(*endpoints, ago_s=20)
    assert net.from_pod(reply) == (TC_ACT_OK, reply)
    assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 43200, 80, flags="A"))[1]).dst == BE1
    net.stamp(*endpoints, ago_s=3)
    assert parse(net.from_pod(reply)[1]).src == VIP


def test_arming_stamps_the_live_entries_the_tables_hold(net: Net) -> None:
    """What `agent` does at start, once its programs run: the flows older programs left (no stamps)
    translate again; an expired entry gets no stamp."""
    net.add_service(backends=((1, BE1, 8080, LOCAL),))
    live = abi.CtEntry(
        last_seen_ns=time.monotonic_ns(),
        fe_addr=ip_be(VIP),
        fe_port=port_be(80),
        flags=int(CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED),
        svc_id=1,
        backend_id=1,
    )
    maps = net.dp.maps
    maps["ct_tcp"].update(ct_key(BE1, POD_CLIENT, 8080, 43300, reply=True), live)
    dead = abi.CtEntry.from_buffer_copy(bytes(live))
    dead.last_seen_ns = time.monotonic_ns() - 7200 * 10**9  # past CFG's 3600 s
    maps["ct_tcp"].update(ct_key(BE2, POD_CLIENT, 8080, 43301, reply=True), dead)
    reply = tcp(BE1, POD_CLIENT, 8080, 43300, flags="PA")
    assert net.from_pod(reply) == (TC_ACT_OK, reply)  # armed, and no stamp: not looked up
    activity.disarm(maps["act"])
    assert not activity.armed(maps["act"])
    assert activity.arm(maps) == 2  # VIP:80 and BE1:8080
    assert activity.armed(maps["act"])
    assert parse(net.from_pod(reply)[1]).src == VIP
    dead_slot = activity.slot(ip_be(BE2), port_be(8080), TCP)
    value = maps["act"].lookup(ct.c_uint32(dead_slot))
    assert isinstance(value, abi.Act) and value.stamp == 0


def test_each_protocol_is_idle_after_its_own_longest_timeout(net: Net, dp: Datapath) -> None:
    """UDP's timeouts 5 s, TCP's the defaults (a day established): a UDP slot stamped 20 s ago holds
    no live UDP flow, so its packets leave without the lookups (the entry written behind the data
    path's back, as fresh, is not consulted); a TCP slot stamped as long ago may still hold an
    established flow, and its packets take them."""
    set_config(dp, udp_s=5, udp_stream_s=5)
    for proto, port in ((UDP, 8053), (TCP, 8080)):
        unstamped_flow(net, POD_CLIENT, BE2, 44000, port, proto)
        net.stamp((ip_be(BE2), port_be(port), proto), ago_s=20)
    quiet = frame(UDP, POD_CLIENT, BE2, 44000, 8053)
    assert net.from_pod(quiet) == (TC_ACT_OK, quiet)
    verdict, out = net.from_pod(frame(TCP, POD_CLIENT, BE2, 44000, 8080))
    assert verdict == TC_ACT_REDIRECT and parse(out).dst == BE3
