"""Upgrade from ABI v1: conntrack entries of a v1 agent carried into the v2 tables; and the
counters of ekp_stats_v2 into ekp_stats_v3.

Pure: `convert_v1_entry` with literal entries. Kernel: v1 conntrack and reverse-NAT maps pinned
with their v1 layout (as a v1 agent left them), the v2 data path loaded beside them, the carry-over
run, and the flows' next packets translated by the v2 programs as the v1 ones did. The counters:
a v2 stats map pinned with its 25 slots, the data path loaded beside it, the copy.
"""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Iterator

import pytest

from agent.config import MapSizes
from agent.ebpf import abi, activity
from agent.ebpf.abi import BackendFlag, CtDir, CtFlag, FrontendFlag, Scope, Stat, ip_be, port_be
from agent.ebpf.loader import Datapath, stale_pins
from agent.ebpf.upgrade import (
    V1_CLOSING,
    V1_CT,
    V1_RNAT,
    V1_SNAT,
    V2_STATS,
    Upgrade,
    V1CtEntry,
    V1CtKey,
    V2Ids,
    convert_v1_entry,
)
from lab.dplab import (
    BE1,
    CLIENT,
    MAC,
    NODE,
    NODE2,
    POD_CLIENT,
    REMOTE_BE,
    SIZES,
    VIP,
    Net,
    packet_lab,
    reset_maps,
)
from lab.packets import bpffs, parse, tcp

S = 10**9
IDS = V2Ids(
    backends={(ip_be(BE1), port_be(8080), 6): 11, (ip_be(REMOTE_BE), port_be(8080), 6): 12},
    services={(ip_be(VIP), port_be(80), 6): 3, (ip_be(NODE), port_be(30080), 6): 4},
)
RNAT_V1 = {5: abi.RevNat(ip_be(VIP), port_be(80)), 6: abi.RevNat(ip_be(NODE), port_be(30080))}


def v1_key(saddr: str, daddr: str, sport: int, dport: int, proto: int = 6) -> V1CtKey:
    return V1CtKey(ip_be(saddr), ip_be(daddr), port_be(sport), port_be(dport), proto)


def test_a_forward_entry_gets_its_direction_frontend_and_v2_ids() -> None:
    key = v1_key(POD_CLIENT, VIP, 40000, 80)
    entry = V1CtEntry(
        last_seen_ns=7 * S, nat_addr=ip_be(BE1), nat_port=port_be(8080), backend_id=1, rev_nat_id=5, dir=0
    )
    converted = convert_v1_entry(key, entry, RNAT_V1, IDS)
    assert converted is not None
    new_key, new = converted
    assert new_key == abi.CtKey(ip_be(POD_CLIENT), ip_be(VIP), port_be(40000), port_be(80), 6, CtDir.FORWARD)
    assert (new.nat_addr, new.nat_port, new.fe_addr, new.fe_port) == (
        ip_be(BE1),
        port_be(8080),
        ip_be(VIP),
        port_be(80),
    )
    assert (new.backend_id, new.svc_id, new.last_seen_ns, new.created_s) == (11, 3, 7 * S, 7)
    assert new.flags == CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED | CtFlag.MIGRATED


def test_a_source_translated_reply_entry_finds_its_frontend_through_the_v1_rev_nat_map() -> None:
    key = v1_key(REMOTE_BE, NODE, 8080, 61234)
    entry = V1CtEntry(
        last_seen_ns=S,
        nat_addr=ip_be(CLIENT),
        nat_port=port_be(5555),
        rev_nat_id=6,
        dir=1,
        flags=V1_SNAT | V1_CLOSING,
    )
    converted = convert_v1_entry(key, entry, RNAT_V1, IDS)
    assert converted is not None
    new_key, new = converted
    assert new_key.dir == CtDir.REPLY
    assert (new.fe_addr, new.fe_port, new.nat_addr, new.nat_port) == (
        ip_be(NODE),
        port_be(30080),
        ip_be(CLIENT),
        port_be(5555),
    )
    assert (new.snat_addr, new.snat_port, new.backend_id, new.svc_id) == (0, 0, 12, 4)
    assert new.flags == CtFlag.SNAT | CtFlag.RST | CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED | CtFlag.MIGRATED


def test_flows_that_cannot_be_carried_are_left_behind() -> None:
    reply_of_unknown_frontend = V1CtEntry(rev_nat_id=99, dir=1)
    assert (
        convert_v1_entry(v1_key(BE1, POD_CLIENT, 8080, 40000), reply_of_unknown_frontend, RNAT_V1, IDS)
        is None
    )
    to_a_backend_gone = V1CtEntry(nat_addr=ip_be("10.244.9.9"), nat_port=port_be(8080), dir=0)
    assert convert_v1_entry(v1_key(POD_CLIENT, VIP, 40000, 80), to_a_backend_gone, RNAT_V1, IDS) is None


# ---- kernel ---------------------------------------------------------------------------------


def v1_pin(pins: str, spec: abi.MapSpec, entries: int, flags: int) -> None:
    argv = ["bpftool", "map", "create", f"{pins}/{spec.name}", "type", spec.kind]
    argv += ["key", str(ctypes.sizeof(spec.key)), "value", str(ctypes.sizeof(spec.value))]
    argv += ["entries", str(entries), "name", spec.name, "flags", str(flags)]
    subprocess.run(argv, check=True, capture_output=True)


@pytest.fixture
def upgraded() -> Iterator[tuple[Datapath, str]]:
    from agent.ebpf.maps import BpfMap

    with bpffs() as root:
        pins = root / "ekp"
        pins.mkdir()
        v1_pin(str(pins), V1_CT, 1024, 2)  # v1: per-CPU LRU lists
        v1_pin(str(pins), V1_RNAT, 64, 0)
        with BpfMap.open_pinned(V1_CT, str(pins)) as ct, BpfMap.open_pinned(V1_RNAT, str(pins)) as rn:
            rn.update(abi.RevNatKey(5), abi.RevNat(ip_be(VIP), port_be(80)))
            rn.update(abi.RevNatKey(6), abi.RevNat(ip_be(NODE), port_be(30080)))
            import time

            now = time.monotonic_ns()
            # an established ClusterIP flow pod -> VIP -> BE1, both entries
            ct.update(
                v1_key(POD_CLIENT, VIP, 40000, 80),
                V1CtEntry(now, ip_be(BE1), 0, port_be(8080), 0, 1, 5, 0, 0),
            )
            ct.update(v1_key(BE1, POD_CLIENT, 8080, 40000), V1CtEntry(now, 0, 0, 0, 0, 1, 5, 1, 0))
            # an established NodePort flow client -> node -> remote backend, source-translated
            fwd = V1CtEntry(
                now, ip_be(REMOTE_BE), ip_be(NODE), port_be(8080), port_be(61000), 2, 6, 0, V1_SNAT
            )
            ct.update(v1_key(CLIENT, NODE, 5555, 30080), fwd)
            rep = V1CtEntry(now, ip_be(CLIENT), 0, port_be(5555), 0, 2, 6, 1, V1_SNAT)
            ct.update(v1_key(REMOTE_BE, NODE, 8080, 61000), rep)
        sizes = MapSizes(**{**vars(SIZES)})
        dp = Datapath(str(pins), sizes)
        dp.load()
        try:
            yield dp, str(pins)
        finally:
            dp.close()


@pytest.mark.kernel
def test_v1_flows_go_on_through_the_v2_programs(upgraded: tuple[Datapath, str]) -> None:
    dp, pins = upgraded
    with packet_lab() as lab:
        reset_maps(dp)
        net = Net(dp, lab)
        net.add_service(backends=((21, BE1, 8080, BackendFlag.LOCAL),), svc_id=3)
        flags = FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL
        net.add_service(
            NODE,
            30080,
            ((22, REMOTE_BE, 8080, 0),),
            scope=Scope.EXTERNAL,
            flags=flags,
            set_id=2,
            svc_id=4,
            rev_nat_id=2,
        )
        upgrade = Upgrade(pins)
        assert upgrade.pending
        upgrade.before_attach(dp.maps)
        assert upgrade.carried.inserted == 4
        upgrade.after_attach(dp.maps)  # again: everything is there already
        assert upgrade.carried.inserted == 4
        # As the agent once its programs are attached: the carried flows' endpoints get their
        # activity stamps (v1 programs wrote none). Without them a reply skipped the conntrack
        # lookups unless the test ran a second after the entries' last_seen, when the forward
        # hit's refresh stamped them: it failed whenever the data path loaded in under a second.
        assert activity.arm(dp.maps) > 0
        migrated = net.ct(POD_CLIENT, VIP, 40000, 80)
        assert migrated is not None and (migrated.backend_id, migrated.svc_id) == (21, 3)

        # mid-flow segments of both flows, both ways: translated as before the upgrade
        assert parse(net.from_pod(tcp(POD_CLIENT, VIP, 40000, 80, flags="PA"))[1]).dst == BE1
        assert parse(net.from_pod(tcp(BE1, POD_CLIENT, 8080, 40000, flags="PA"))[1]).src == VIP
        out = parse(net.from_net(tcp(CLIENT, NODE, 5555, 30080, flags="PA", smac=MAC[CLIENT]))[1])
        assert (out.src, out.sport, out.dst) == (NODE, 61000, REMOTE_BE)
        back = parse(net.from_net(tcp(REMOTE_BE, NODE, 8080, 61000, flags="PA", smac=MAC[NODE2]))[1])
        assert (back.src, back.sport, back.dst, back.dport) == (NODE, 30080, CLIENT, 5555)
        stats = net.stats()
        assert (stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY], stats[Stat.DROP_NO_FLOW]) == (2, 2, 0)
    assert [p.rsplit("/", 1)[1] for p in stale_pins(pins)] == ["ekp_ct_v1", "ekp_rnat_v1"]


@pytest.mark.kernel
def test_counters_of_ekp_stats_v2_go_on_in_ekp_stats_v3() -> None:
    from agent.ebpf.maps import BpfMap, read_stats

    with bpffs() as root:
        pins = root / "ekp"
        pins.mkdir()
        v1_pin(str(pins), V2_STATS, 25, 0)  # as the previous agent left it
        with BpfMap.open_pinned(V2_STATS, str(pins)) as old:
            old.update(ctypes.c_uint32(Stat.PACKETS), ctypes.c_uint64(1000))
            old.update(ctypes.c_uint32(Stat.DROP_FRAG_NEEDED), ctypes.c_uint64(7))
        with Datapath(str(pins), MapSizes(**{**vars(SIZES)})) as dp:
            upgrade = Upgrade(str(pins))
            assert not upgrade.pending  # no v1 conntrack
            upgrade.before_attach(dp.maps)
            counters = read_stats(dp.maps["stats"])
            assert (counters[Stat.PACKETS], counters[Stat.DROP_FRAG_NEEDED], counters[Stat.PASS]) == (
                1000,
                7,
                0,
            )
            dp.maps["stats"].update(ctypes.c_uint32(Stat.PACKETS), ctypes.c_uint64(1001))  # v3 counts on
            upgrade.before_attach(dp.maps)  # an agent restarted before the v2 pin was removed
            assert read_stats(dp.maps["stats"])[Stat.PACKETS] == 1001
        assert [p.rsplit("/", 1)[1] for p in stale_pins(str(pins))] == ["ekp_stats_v2"]
