"""render: one decoded line per entry, sorted numerically, flags by name."""

from __future__ import annotations

from agent.ebpf.abi import (
    Addr6,
    Affinity,
    AffinityKey,
    Backend,
    BackendKey,
    Ct6Entry,
    Ct6Key,
    CtDir,
    CtEntry,
    CtFlag,
    CtKey,
    Frontend,
    FrontendFlag,
    FrontendKey,
    Member,
    MemberFlag,
    MemberKey,
    SockConfig,
    SockFlag,
    SockKey,
    SockNat,
    Stat,
    ip6_words,
    ip_be,
    port_be,
)
from agent.ebpf.plan import MapContents
from agent.ebpf.render import (
    render_affinity,
    render_conntrack,
    render_contents,
    render_maglev,
    render_sockets,
    render_stats,
)
from agent.ebpf.render6 import ct6_lines

S = 1_000_000_000


def fe(addr: str) -> FrontendKey:
    return FrontendKey(addr=ip_be(addr), port=port_be(80), proto=6, scope=1)


def test_frontends_sort_by_address_value_not_text() -> None:
    c = MapContents()
    for addr in ("10.96.0.10", "10.96.0.2"):
        c.fe[fe(addr)] = Frontend(
            svc_id=4, set_id=1, count=0, flags=int(FrontendFlag.NO_ENDPOINTS) | 0x8000, rev_nat_id=1
        )
    line = "-> svc=4 set=1 count=0 rnat=1 flags=NO_ENDPOINTS|0x8000 affinity=0s"
    assert render_contents(c, {fe("10.96.0.2"): "ns/a"}).splitlines() == [
        f"fe 10.96.0.2:80/TCP internal {line}  # ns/a",
        f"fe 10.96.0.10:80/TCP internal {line}",
    ]


def test_membership_lines() -> None:
    c = MapContents()
    c.member[MemberKey(svc_id=2, backend_id=7)] = Member(flags=int(MemberFlag.CLUSTER | MemberFlag.LOCAL))
    c.member[MemberKey(svc_id=1, backend_id=9)] = Member(flags=int(MemberFlag.LOCAL))
    assert render_contents(c) == "member svc=1 be 9 -> local\nmember svc=2 be 7 -> cluster|local\n"


def test_backend_flags_and_unknown_protocol() -> None:
    c = MapContents()
    c.be[BackendKey(id=10)] = Backend(addr=ip_be("10.244.1.2"), port=port_be(53), proto=17, flags=3)
    c.be[BackendKey(id=9)] = Backend(addr=ip_be("10.244.1.3"), port=port_be(9), proto=99, flags=0)
    assert render_contents(c) == "be 9 -> 10.244.1.3:9/99\nbe 10 -> 10.244.1.2:53/UDP local,terminating\n"


def test_conntrack_lines() -> None:
    key = CtKey(
        saddr=ip_be("10.244.1.5"),
        daddr=ip_be("10.96.0.10"),
        sport=port_be(40000),
        dport=port_be(53),
        proto=17,
        dir=int(CtDir.FORWARD),
    )
    entry = CtEntry(
        last_seen_ns=5 * S,
        nat_addr=ip_be("10.244.2.3"),
        nat_port=port_be(53),
        snat_addr=ip_be("192.168.0.11"),
        snat_port=port_be(40001),
        fe_addr=ip_be("10.96.0.10"),
        fe_port=port_be(53),
        svc_id=3,
        backend_id=7,
        created_s=2,
        flags=int(CtFlag.SNAT | CtFlag.SEEN_REPLY),
    )
    assert render_conntrack([(key, entry)], now_ns=8 * S) == (
        "ct 10.244.1.5:40000 -> 10.96.0.10:53/UDP forward fe=10.96.0.10:53 nat=10.244.2.3:53"
        " snat=192.168.0.11:40001 svc=3 be=7 flags=SNAT|SEEN_REPLY idle=3s age=6s\n"
    )


def test_an_ipv6_conntrack_entry_reads_as_an_ipv4_one_with_bracketed_addresses() -> None:
    key = Ct6Key(
        Addr6(*ip6_words("fd00:a:1::9")), Addr6(*ip6_words("fd00:96::10")), port_be(40000), port_be(53), 17, 0
    )
    entry = Ct6Entry(
        last_seen_ns=5 * S,
        nat_addr=Addr6(*ip6_words("fd00:a:2::3")),
        nat_port=port_be(5353),
        fe_addr=Addr6(*ip6_words("fd00:96::10")),
        fe_port=port_be(53),
        svc_id=3,
        backend_id=7,
        created_s=2,
        flags=int(CtFlag.SEEN_REPLY),
    )
    bare = Ct6Entry(last_seen_ns=5 * S, fe_addr=Addr6(*ip6_words("fd00:96::10")), fe_port=port_be(53))
    assert ct6_lines([(key, entry)], now_ns=8 * S) == [
        "ct6 [fd00:a:1::9]:40000 -> [fd00:96::10]:53/UDP forward fe=[fd00:96::10]:53 nat=[fd00:a:2::3]:5353"
        " svc=3 be=7 flags=SEEN_REPLY idle=3s age=6s"
    ]
    assert "nat=" not in ct6_lines([(key, bare)], now_ns=8 * S)[0], "no backend address: none shown"
    entry.snat_addr, entry.snat_port = Addr6(*ip6_words("fd00:a:1::9")), port_be(40007)
    entry.flags |= int(CtFlag.SNAT)
    assert ct6_lines([(key, entry)], now_ns=8 * S)[0].endswith(
        " nat=[fd00:a:2::3]:5353 snat=[fd00:a:1::9]:40007 svc=3 be=7 flags=SNAT|SEEN_REPLY idle=3s age=6s"
    ), "a remapped port shown as IPv4's"


def test_affinity_and_stats() -> None:
    key = AffinityKey(client=ip_be("10.244.1.5"), svc_id=3)
    assert render_affinity([(key, Affinity(last_seen_ns=S, backend_id=7))], now_ns=11 * S) == (
        "aff 10.244.1.5 svc=3 -> be 7 idle=10s\n"
    )
    text = render_stats({int(Stat.PACKETS): [1, 2], int(Stat.DROP_FIB): 4})
    assert "stat packets 3\n" in text and "stat drop_fib 4\n" in text and "stat snat 0\n" in text
    assert len(text.splitlines()) == len(Stat)


def test_socket_lines() -> None:
    cfg = SockConfig(host_netns=4096, flags=SockFlag.HOST_ONLY)
    links = {"connect4": (7, 70, 1234), "recvmsg4": (8, 71, 0)}
    key = SockKey(cookie=99, addr=ip_be("10.244.1.3"), port=port_be(8080), proto=6)
    nat = SockNat(fe_addr=ip_be("10.96.0.10"), fe_port=port_be(80), svc_id=3, backend_id=5)
    assert render_sockets(cfg, links, [(key, nat)]) == (
        "sockcfg host_netns=4096 host-namespace-only\n"
        "socklink connect4 link=7 prog=70 cgroup=1234\n"
        "socklink recvmsg4 link=8 prog=71 cgroup=0\n"
        "sock 99 10.244.1.3:8080/TCP shown as 10.96.0.10:80 svc=3 be=5\n"
    )
    assert render_sockets(None, {}, []).startswith("sockcfg none")
    all_ns = SockConfig(host_netns=4096, flags=0)
    assert render_sockets(all_ns, {}, []) == "sockcfg host_netns=4096 all namespaces\n"


def test_xdp_counters_print_under_their_own_prefix() -> None:
    text = render_stats({int(Stat.TO_TC): [2, 3]}, prefix="xdp")
    assert "xdp to_tc 5\n" in text and "xdp packets 0\n" in text and "stat " not in text


def test_a_maglev_table_in_a_few_lines() -> None:
    table = [1, 1, 2, 1, 2, 2, 2]
    text = render_maglev(
        {3: table}, {1: "10.244.2.10:8080", 2: "10.244.3.11:8080"}, {3: ["192.168.0.11:30080/TCP"]}, head=5
    )
    lines = text.splitlines()
    assert lines[0].startswith("maglev set 3 size=7 digest=") and lines[0].endswith(
        "<- 192.168.0.11:30080/TCP"
    )
    assert lines[1] == "maglev set 3 be 2 10.244.3.11:8080 positions=4 share=57.14%"
    assert lines[2] == "maglev set 3 be 1 10.244.2.10:8080 positions=3 share=42.86%"
    assert lines[3] == "maglev set 3 positions 0-4: 1x2 2 1 2"
    # the digest follows the addresses, not the ids each node gives them
    renamed = render_maglev({3: [7, 7, 8, 7, 8, 8, 8]}, {7: "10.244.2.10:8080", 8: "10.244.3.11:8080"}, {})
    assert renamed.split()[4] == text.split()[4]
