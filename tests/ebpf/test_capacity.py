"""capacity: fill and pressure of every map, live conntrack entries by the data path's timeouts."""

from __future__ import annotations

from typing import Any

from agent.ebpf import abi
from agent.ebpf.abi import MAPS, CtDir, CtEntry, CtFlag, CtKey
from agent.ebpf.capacity import ct_timeout_s, live_entries, live_states, read_fill, render_capacity
from agent.ebpf.maps import FakeMap

S = 10**9
CFG = abi.Config(
    tcp_established_s=3600, tcp_close_wait_s=600, tcp_syn_s=60, tcp_closed_s=10, udp_s=30, udp_stream_s=120
)


def test_timeouts_mirror_the_data_path() -> None:
    """bpf/ekp_ct.h ekp_ct_timeout_ns, state by state; 0 in the config means the default."""
    tcp, udp = 6, 17
    assert ct_timeout_s(CFG, tcp, 0) == 60
    assert ct_timeout_s(CFG, tcp, CtFlag.SEEN_REPLY) == 60
    assert ct_timeout_s(CFG, tcp, CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED) == 3600
    assert ct_timeout_s(CFG, tcp, CtFlag.ESTABLISHED | CtFlag.FIN_FWD) == 600
    assert ct_timeout_s(CFG, tcp, CtFlag.FIN_FWD | CtFlag.FIN_REPLY) == 10
    assert ct_timeout_s(CFG, tcp, CtFlag.ESTABLISHED | CtFlag.RST) == 10
    assert ct_timeout_s(CFG, udp, CtFlag.SEEN_REPLY) == 30
    assert ct_timeout_s(CFG, udp, CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED) == 120
    assert ct_timeout_s(None, tcp, CtFlag.ESTABLISHED) == 86400


def entry(last_seen_s: int, flags: int) -> CtEntry:
    return CtEntry(last_seen_ns=last_seen_s * S, flags=flags)


def test_live_entries_count_only_unexpired_ones() -> None:
    now = 10_000 * S
    items: list[tuple[Any, Any]] = [
        (CtKey(proto=6, dir=CtDir.FORWARD), entry(10_000 - 59, 0)),  # handshake, 59 s: live
        (CtKey(proto=6, dir=CtDir.REPLY), entry(10_000 - 61, 0)),  # handshake, 61 s: dead
        (CtKey(proto=6, sport=1), entry(10_000 - 3000, CtFlag.ESTABLISHED)),  # live
        (CtKey(proto=17), entry(10_000 - 31, CtFlag.SEEN_REPLY)),  # dead
    ]
    assert live_entries(items, CFG, now) == 2


def test_live_entries_by_state() -> None:
    """As the early-drop queue sees them: closed first, then assured, else unassured."""
    now = 10_000 * S
    items: list[tuple[Any, Any]] = [
        (CtKey(proto=6, sport=1), entry(10_000, CtFlag.ESTABLISHED)),
        (CtKey(proto=6, sport=2), entry(10_000, CtFlag.SEEN_REPLY)),
        (CtKey(proto=6, sport=3), entry(10_000, 0)),
        (CtKey(proto=6, sport=4), entry(10_000, CtFlag.ESTABLISHED | CtFlag.RST)),
        (CtKey(proto=6, sport=5), entry(10_000, CtFlag.ESTABLISHED | CtFlag.FIN_FWD)),  # half closed
        (CtKey(proto=6, sport=6), entry(10_000, CtFlag.ESTABLISHED | CtFlag.FIN_FWD | CtFlag.FIN_REPLY)),
        (CtKey(proto=6, sport=7), entry(10_000 - 61, 0)),  # expired
    ]
    assert live_states(items, CFG, now) == {"assured": 2, "unassured": 2, "closed": 2}


def test_read_fill_and_render() -> None:
    maps = {
        role: FakeMap(spec, max_entries=100)
        for role, spec in MAPS.items()
        if role in ("fe", "ct_tcp", "stats")
    }
    maps["fe"].update(abi.FrontendKey(addr=1), abi.Frontend(svc_id=1))
    for port in range(40):
        key = CtKey(sport=port, proto=6)
        maps["ct_tcp"].update(key, entry(100 if port < 30 else 0, CtFlag.ESTABLISHED))
    fills = read_fill(maps, {"fe": 100, "ct_tcp": 100, "stats": 64}, CFG, now_ns=200 * S)
    by_role = {f.role: f for f in fills}
    assert (by_role["fe"].entries, by_role["fe"].fill, by_role["fe"].live) == (1, 0.01, None)
    ct = by_role["ct_tcp"]
    assert (ct.entries, ct.live, ct.fill, ct.pressure) == (40, 40, 0.4, 0.4)
    assert ct.states == (("assured", 40), ("unassured", 0), ("closed", 0))
    counters = dict.fromkeys(abi.Stat, 0) | {abi.Stat.EVICT_UNASSURED: 52, abi.Stat.EVICT_CLOSED: 7}
    assert render_capacity(fills, counters).splitlines() == [
        "ekp_fe_v2       hash         agent    1/100 1.0%",
        "ekp_ct_tcp_v2   lru_hash     datapath 40/100 40.0% live 40 40.0% assured 40 unassured 0 closed 0",
        "ekp_stats_v3    percpu_array datapath 64 fixed",
        "early drops unreplied 0 unassured 52 closed 7",
    ]
    later = {
        f.role: f for f in read_fill(maps, {"fe": 100, "ct_tcp": 100, "stats": 64}, CFG, now_ns=3650 * S)
    }
    assert later["ct_tcp"].live == 30 and later["ct_tcp"].pressure == 0.3


def test_the_tc_ipv6_paths_conntrack_tables_show_their_live_entries_by_state() -> None:
    """`agent inspect capacity`: ekp_ct6_* (the tc IPv6 path's) as IPv4's tables, live entries by
    the same timeouts and states."""
    maps = {role: FakeMap(MAPS[role], max_entries=100) for role in ("ct6_tcp", "ct6_any")}
    for port in range(3):
        live = abi.Ct6Entry(last_seen_ns=100 * S, flags=CtFlag.ESTABLISHED)
        maps["ct6_tcp"].update(abi.Ct6Key(sport=port, proto=6), live)
    reset = abi.Ct6Entry(last_seen_ns=195 * S, flags=CtFlag.ESTABLISHED | CtFlag.RST)  # closed, 5 s ago
    maps["ct6_tcp"].update(abi.Ct6Key(sport=3, proto=6), reset)
    maps["ct6_any"].update(abi.Ct6Key(sport=1, proto=17), abi.Ct6Entry(last_seen_ns=0))  # expired
    fills = {f.role: f for f in read_fill(maps, {"ct6_tcp": 100, "ct6_any": 100}, CFG, now_ns=200 * S)}
    tcp, other = fills["ct6_tcp"], fills["ct6_any"]
    assert (tcp.entries, tcp.live, tcp.states) == (4, 4, (("assured", 3), ("unassured", 0), ("closed", 1)))
    assert (other.entries, other.live) == (1, 0)
    assert "live 4 4.0% assured 3 unassured 0 closed 1" in render_capacity([tcp])
