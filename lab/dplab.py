"""The packet lab of the data path tests: a compiled data path, a private namespace, and `Net`.

Each test module (test_datapath*.py) declares its own fixtures from these pieces, so no conftest
is shared. The namespace holds what the FIB lookups resolve in:

    ext0  192.168.0.11/24   node's external device; neighbours node2 .12, client .100
                            route 10.244.2.0/24 via 192.168.0.12 (pods on node2)
    pod0  10.244.1.1/24     node side of the pods' veth; neighbours for pods .5 .6 .8 .9 .10
                            (10.244.1.7 has none: the bpf_redirect_neigh path)
    small0 10.244.3.1/24    MTU 1280: the path to a backend (.5) and a client (.6) behind a smaller MTU

and, for the tc programs' IPv6 path (`add_ipv6`), IPv6 beside IPv4 on the same devices:

    ext0  fd00:ff::11/64     neighbours node2 ::12, client ::100; fd00:a:2::/64 via node2
    pod0  fd00:a:1::1/64     neighbours for pods ::5 ::6 (backends) and ::9 (a client)
    small0 fd00:a:3::1/64    MTU 1280: a backend (::5) and a client (::6) behind it

Packets from pods run ekp_from_pod with ingress pod0; packets from outside run ekp_from_net with
ingress ext0, or ekp_xdp_net (XDP) on ext0. `assert_balanced` checks each hook's counters after
each test: PACKETS == sum of outcomes.
"""

from __future__ import annotations

import ctypes as ct
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from agent.config import MapSizes
from agent.ebpf import abi, activity
from agent.ebpf.abi import (
    CALLS,
    OUTCOMES,
    BackendFlag,
    CtDir,
    CtFlag,
    FrontendFlag,
    Scope,
    Stat,
    ct_role,
    ip_be,
    port_be,
)
from agent.ebpf.loader import Datapath, write_ring_slots
from agent.ebpf.maps import MapWriter, read_stats, write_config
from lab.packets import Link, link, private_netns, prog_run, sh, xdp_run

NODE, NODE2, CLIENT = "192.168.0.11", "192.168.0.12", "192.168.0.100"
POD_CLIENT, BE1, BE2, BE3, BE4 = "10.244.1.9", "10.244.1.5", "10.244.1.6", "10.244.1.8", "10.244.1.10"
BE_NO_NEIGH, REMOTE_BE = "10.244.1.7", "10.244.2.7"
BE_SMALL_MTU, CLIENT_SMALL_MTU, SMALL_MTU = "10.244.3.5", "10.244.3.6", 1280
VIP = "10.96.0.10"
MAC = {
    NODE2: "02:00:00:00:00:12",
    CLIENT: "02:00:00:00:01:00",
    BE1: "02:00:0a:f4:01:05",
    BE2: "02:00:0a:f4:01:06",
    BE3: "02:00:0a:f4:01:08",
    BE4: "02:00:0a:f4:01:0a",
    POD_CLIENT: "02:00:0a:f4:01:09",
    BE_SMALL_MTU: "02:00:0a:f4:03:05",
    CLIENT_SMALL_MTU: "02:00:0a:f4:03:06",
}
SNAT_MIN, SNAT_MAX = 40000, 40999

NODE6, NODE2_6, CLIENT6 = "fd00:ff::11", "fd00:ff::12", "fd00:ff::100"
POD6, BE6, BE6_2, REMOTE_BE6 = "fd00:a:1::9", "fd00:a:1::5", "fd00:a:1::6", "fd00:a:2::7"
VIP6 = "fd00:96::10"
BE6_SMALL_MTU, CLIENT6_SMALL_MTU = "fd00:a:3::5", "fd00:a:3::6"  # on small0 (SMALL_MTU)
MAC6 = {
    NODE2_6: "02:00:00:00:06:12",
    CLIENT6: "02:00:00:00:06:64",
    POD6: "02:00:0a:06:01:09",
    BE6: "02:00:0a:06:01:05",
    BE6_2: "02:00:0a:06:01:06",
    BE6_SMALL_MTU: "02:00:0a:06:03:05",
    CLIENT6_SMALL_MTU: "02:00:0a:06:03:06",
}
# Each map a size of its own, none another's (the defaults' fraghold, addr, maglev, hostnat
# besides): tests/ebpf/test_abi.py checks the layout of this build, and a map sized from another's
# macro shows there only when the two sizes differ.
SIZES = MapSizes(
    fe=256,
    slot=768,
    be=384,
    rnat=192,
    member=1536,
    ct_tcp=4096,
    ct_any=2048,
    frag=128,
    aff=320,
    srcr=64,
    sknat=512,
    port=96,
)
TCP, UDP = 6, 17
# Every map the data path reads or writes that a test may have filled.
TEST_ROLES = (
    "fe",
    "slot",
    "be",
    "rnat",
    "member",
    "ct_tcp",
    "ct_any",
    "frag",
    "fraghold",
    "fraglast",
    "addr",
    "ctq_tcp",
    "ctq_any",
    "ctqh",
    "aff",
    "act",
    "srcr",
    "icmprl",
    "stats",
    "maglev",
    "xstats",
    "hostnat",
    *abi.V6_ROLES.values(),
    "aff6",
    "sknat6",
    "ct6_tcp",
    "ct6_any",
    "cfg6",  # zero: no IPv6 SNAT source (the IPv6 path leaves source translations to the stack)
    "cfg6sel",
    "ctq6_tcp",
    "ctq6_any",
    "ctqh6",
    "frag6",
    "frhold6",
    "hostnat6",
)

CFG = abi.Config(
    node_addr=ip_be(NODE),
    snat_port_min=SNAT_MIN,
    snat_port_max=SNAT_MAX,
    tcp_established_s=3600,
    tcp_close_wait_s=600,
    tcp_syn_s=60,
    tcp_closed_s=10,
    udp_s=30,
    udp_stream_s=120,
    icmp_rate=1000,
    icmp_burst=50,
)


@dataclass(frozen=True)
class Lab:
    pod: Link
    ext: Link
    small: Link


@contextmanager
def packet_lab() -> Iterator[Lab]:
    """The namespace above, entered by the calling thread for the duration."""
    with private_netns():
        sh("ip", "link", "add", "ext0", "type", "veth", "peer", "name", "ext0p")
        sh("ip", "link", "add", "pod0", "type", "veth", "peer", "name", "pod0p")
        sh("ip", "link", "add", "small0", "type", "veth", "peer", "name", "small0p")
        sh("ip", "addr", "add", f"{NODE}/24", "dev", "ext0")
        sh("ip", "addr", "add", "10.244.1.1/24", "dev", "pod0")
        sh("ip", "addr", "add", "10.244.3.1/24", "dev", "small0")
        sh("ip", "link", "set", "small0", "mtu", str(SMALL_MTU))
        for dev in ("ext0", "ext0p", "pod0", "pod0p", "small0", "small0p"):
            sh("ip", "link", "set", dev, "up")
        sh("ip", "route", "add", "10.244.2.0/24", "via", NODE2)
        devices = {"192.168.0": "ext0", "10.244.1": "pod0", "10.244.3": "small0"}
        for addr, mac in MAC.items():
            dev = devices[addr.rsplit(".", 1)[0]]
            sh("ip", "neigh", "replace", addr, "lladdr", mac, "dev", dev, "nud", "permanent")
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1")  # bpf_fib_lookup needs forwarding on ingress
        yield Lab(pod=link("pod0"), ext=link("ext0"), small=link("small0"))


def add_ipv6(built: Lab) -> None:
    """The IPv6 addresses, route and neighbours above, on the packet lab's devices."""
    sh("sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")  # bpf_fib_lookup's, as for IPv4
    sh("ip", "-6", "addr", "add", f"{NODE6}/64", "dev", built.ext.name, "nodad")
    sh("ip", "-6", "addr", "add", "fd00:a:1::1/64", "dev", built.pod.name, "nodad")
    sh("ip", "-6", "addr", "add", "fd00:a:3::1/64", "dev", built.small.name, "nodad")
    sh("ip", "-6", "route", "add", "fd00:a:2::/64", "via", NODE2_6)
    devices = {"fd00:ff:": built.ext.name, "fd00:a:1:": built.pod.name, "fd00:a:3:": built.small.name}
    for addr, mac in MAC6.items():
        dev = next(name for prefix, name in devices.items() if addr.startswith(prefix))
        sh("ip", "-6", "neigh", "replace", addr, "lladdr", mac, "dev", dev, "nud", "permanent")


def reset_maps(dp: Datapath) -> None:
    """Empty every map a test may have filled, make CFG the live config, and arm the flow-activity
    check (bpf/ekp_act.h) as a running agent has it: packets of no live flow skip conntrack."""
    for role in TEST_ROLES:
        dp.maps[role].clear()
    write_ring_slots(dp.maps)  # the rings' slot counts, cleared with their heads
    write_config(dp.maps, CFG)
    dp.maps["act"].update(ct.c_uint32(activity.ARMED), abi.Act(stamp=1))


def assert_balanced(dp: Datapath) -> None:
    """Each hook's counters balance: PACKETS (and the socket programs' SOCK_CALLS) == sum of the
    outcomes (the tc and socket programs', XDP's)."""
    for role in ("stats", "xstats"):
        stats = read_stats(dp.maps[role])
        assert sum(stats[s] for s in CALLS) == sum(stats[s] for s in OUTCOMES), (role, stats)


def set_config(dp: Datapath, **fields: int) -> abi.Config:
    """CFG with `fields` changed, made live through the double buffer."""
    cfg = abi.Config.from_buffer_copy(bytes(CFG))
    for name, value in fields.items():
        setattr(cfg, name, value)
    write_config(dp.maps, cfg)
    return cfg


def ct_key(
    saddr: str, daddr: str, sport: int, dport: int, proto: int = TCP, reply: bool = False
) -> abi.CtKey:
    direction = CtDir.REPLY if reply else CtDir.FORWARD
    return abi.CtKey(ip_be(saddr), ip_be(daddr), port_be(sport), port_be(dport), proto, direction)


def forward_entries_without_twin(items: Iterable[tuple[Any, Any]]) -> list[object]:
    """The FORWARD keys among a conntrack map's `items` (either family's keys and entries) whose
    REPLY twin is missing or another flow's: bpf/ekp_ct_af.h's ekp_ct_twin_key and ekp_ct_is_twin,
    written again here so that a test checks the data path's tables by a reading of its own."""
    table = {_ct_tuple(k): e for k, e in items}
    lost: list[object] = []
    for key, e in table.items():
        saddr, daddr, sport, dport, proto, direction = key
        if direction != CtDir.FORWARD:
            continue
        snat = bool(e.flags & CtFlag.SNAT)
        rkey = (
            _addr(e.nat_addr),
            _addr(e.snat_addr) if snat else saddr,
            e.nat_port,
            e.snat_port if snat else sport,
            proto,
            CtDir.REPLY,
        )
        r = table.get(rkey)
        back = (
            None
            if r is None
            else (
                _addr(r.nat_addr) if snat else rkey[1],
                _addr(r.fe_addr),
                r.nat_port if snat else rkey[3],
                r.fe_port,
            )
        )
        if (
            r is None
            or (_addr(r.fe_addr), r.fe_port, r.backend_id) != (_addr(e.fe_addr), e.fe_port, e.backend_id)
            or bool(r.flags & CtFlag.SNAT) != snat
            or back != (saddr, daddr, sport, dport)
        ):
            lost.append(key)
    return lost


class TupleRace:
    """before_round for lab/cpurace.py's race of two new flows on one reply tuple (a one-port SNAT
    range, the conntrack table `table` emptied before each round): each round must leave exactly
    one flow, whole (its FORWARD entry with its REPLY twin), and count it: every packet counted once
    as NEW_FLOWS or a loss (DROP_TUPLE_TAKEN; DROP_CT_FULL when its REPLY entry was found gone, not
    another flow's), and one flow more than the round early-dropped; none more only when the flow
    early-dropped was still being created and lost its REPLY entry before its own check
    (bpf/ekp_ct_af.h ekp_ct_create: it drops as a loss, its early drop counted too). Call it once
    more after the last round."""

    def __init__(self, net: Net, table: str) -> None:
        self.net, self.table = net, net.dp.maps[table]
        self.rounds = self.raced = 0  # raced: a round one CPU lost (DROP_TUPLE_TAKEN)
        self._last = self._counts()

    def _counts(self) -> tuple[int, int, int]:
        stats = self.net.stats()
        # A REPLY entry found gone, not another flow's, at ekp_ct_create's check counts as
        # DROP_CT_FULL (an LRU eviction, or another CPU between its delete and its claim): a loss.
        lost = stats[Stat.DROP_TUPLE_TAKEN] + stats[Stat.DROP_CT_FULL]
        return stats[Stat.NEW_FLOWS], stats[Stat.EARLY_DROP], lost

    def __call__(self) -> None:
        items = self.table.items()
        counts = self._counts()
        new, early, taken = (now - before for now, before in zip(counts, self._last, strict=True))
        self._last = counts
        if items or new or taken:
            self.rounds += 1
            self.raced += bool(taken)
            lost = forward_entries_without_twin(items)
            flows = sum(_ct_tuple(k)[5] == CtDir.FORWARD for k, _ in items)
            what = (
                f"round {self.rounds}: {flows} FORWARD and {len(items) - flows} REPLY entries, {new} new,"
                f" {early} early drops, {taken} taken"
            )
            assert flows == len(items) - flows == 1 and not lost, f"{what}; without their twin: {lost}"
            assert new + taken == 2, what
            assert new - early == 1 or (new, early, taken) == (1, 1, 1), f"{what}: a flow lost uncounted"
        self.table.clear()


def _ct_tuple(k: Any) -> tuple[Any, ...]:
    return (_addr(k.saddr), _addr(k.daddr), k.sport, k.dport, k.proto, k.dir)


def _addr(a: Any) -> object:
    """An address of either family as a dictionary key (an IPv6 one is a ctypes structure)."""
    return bytes(a) if isinstance(a, ct.Structure | ct.Array) else a


class Net:
    """Runs frames through the programs and reads and writes the maps, in test vocabulary."""

    def __init__(self, dp: Datapath, lab: Lab) -> None:
        self.dp, self.lab = dp, lab

    def from_pod(
        self, frame: bytes, via: Link | None = None, *, csum_complete: bool = False, gso_size: int = 0
    ) -> tuple[int, bytes]:
        """ekp_from_pod on `frame` arriving on pod0, or on the pod device `via` (small0);
        `csum_complete`: a CHECKSUM_COMPLETE skb whose skb->csum is checked after; `gso_size`: a GSO
        skb of segments that size (prog_run)."""
        fd = self.dp.prog_fd("ekp_from_pod")
        return prog_run(
            fd, frame, (via or self.lab.pod).ifindex, csum_complete=csum_complete, gso_size=gso_size
        )

    def from_net(self, frame: bytes, *, csum_complete: bool = False) -> tuple[int, bytes]:
        return prog_run(
            self.dp.prog_fd("ekp_from_net"), frame, self.lab.ext.ifindex, csum_complete=csum_complete
        )

    def to_pod(self, frame: bytes, *, came_in_by: int = 0) -> tuple[int, bytes]:
        """ekp_egress on the pod device: a packet of the node's own stack (`came_in_by` 0), or one
        forwarded from the device of that ifindex."""
        return prog_run(self.dp.prog_fd("ekp_egress"), frame, self.lab.pod.ifindex, came_in_by)

    def to_net(self, frame: bytes, *, came_in_by: int = 0) -> tuple[int, bytes]:
        """ekp_egress on the external device (see to_pod)."""
        return prog_run(self.dp.prog_fd("ekp_egress"), frame, self.lab.ext.ifindex, came_in_by)

    def xdp(self, frame: bytes) -> tuple[int, bytes]:
        """ekp_xdp_net on `frame` arriving on ext0: (XDP verdict, frame out)."""
        verdict, out, _ = xdp_run(self.dp.prog_fd("ekp_xdp_net"), frame, self.lab.ext.ifindex)
        return verdict, out

    def stats(self) -> dict[Stat, int]:
        return read_stats(self.dp.maps["stats"])

    def xstats(self) -> dict[Stat, int]:
        """The XDP program's counters (ekp_xstats_v3)."""
        return read_stats(self.dp.maps["xstats"])

    def set_maglev(self, set_id: int, backend_ids: list[int]) -> None:
        """The Maglev table of `set_id`: position i names backend_ids[i % len(backend_ids)]."""
        table = abi.Maglev()
        for i in range(abi.MAGLEV_TABLE_SIZE):
            table.backend_id[i] = backend_ids[i % len(backend_ids)]
        self.dp.maps["maglev"].update(abi.MaglevKey(set_id), table)

    def ct(
        self, saddr: str, daddr: str, sport: int, dport: int, proto: int = TCP, *, reply: bool = False
    ) -> abi.CtEntry | None:
        """The conntrack entry of this tuple: the FORWARD one, or the REPLY one with reply=True."""
        entry = self.dp.maps[ct_role(proto)].lookup(ct_key(saddr, daddr, sport, dport, proto, reply))
        assert entry is None or isinstance(entry, abi.CtEntry)
        return entry

    def ct_put(
        self,
        saddr: str,
        daddr: str,
        sport: int,
        dport: int,
        entry: abi.CtEntry,
        proto: int = TCP,
        *,
        reply: bool = False,
    ) -> None:
        """Writes an entry behind the data path's back, and stamps its flow's endpoints now as the
        agent does for the entries it finds at start (agent/ebpf/activity.py)."""
        key = ct_key(saddr, daddr, sport, dport, proto, reply)
        self.dp.maps[ct_role(proto)].update(key, entry)
        self.stamp(*activity.endpoints(key, entry))

    def stamp(self, *endpoints: tuple[int, int, int], ago_s: float = 0.0) -> None:
        """Stamps endpoints (address and port as ip_be / port_be, protocol) in ekp_act, `ago_s`
        seconds ago."""
        value = abi.Act(stamp=activity.stamp_of(time.monotonic_ns() - int(ago_s * 1e9)))
        for addr, port, proto in endpoints:
            self.dp.maps["act"].update(ct.c_uint32(activity.slot(addr, port, proto)), value)

    def ct_del(
        self, saddr: str, daddr: str, sport: int, dport: int, proto: int = TCP, *, reply: bool = False
    ) -> bool:
        return self.dp.maps[ct_role(proto)].delete(ct_key(saddr, daddr, sport, dport, proto, reply))

    def ct_count(self, proto: int = TCP) -> int:
        return len(self.dp.maps[ct_role(proto)].keys())

    def add_service(
        self,
        addr: str = VIP,
        port: int = 80,
        backends: tuple[tuple[int, str, int, int], ...] = ((1, BE1, 8080, BackendFlag.LOCAL),),
        **kw: Any,
    ) -> None:
        """`add_service` on this data path's maps."""
        add_service(self.dp.maps, addr, port, backends, **kw)

    def remove_member(self, svc_id: int, backend_id: int) -> None:
        self.dp.maps["member"].delete(abi.MemberKey(svc_id, backend_id))

    def add_address(self, addr: str, flags: int) -> None:
        """`add_address` on this data path's maps."""
        add_address(self.dp.maps, addr, flags)


def add_address(maps: Mapping[str, MapWriter], addr: str, flags: int) -> None:
    """`flags` (abi.AddrFlag) added to the ekp_addr entry of `addr`."""
    key = abi.AddrKey(ip_be(addr))
    old = maps["addr"].lookup(key)
    have = old.flags if isinstance(old, abi.Addr) else 0
    maps["addr"].update(key, abi.Addr(flags=have | flags))


def add_address6(maps: Mapping[str, MapWriter], addr: str, flags: int) -> None:
    """`flags` (abi.AddrFlag) added to the ekp_addr6 entry of `addr`."""
    key = abi.Addr6Key(abi.Addr6(*abi.ip6_words(addr)))
    old = maps["addr6"].lookup(key)
    have = old.flags if isinstance(old, abi.Addr) else 0
    maps["addr6"].update(key, abi.Addr(flags=have | flags))


def add_service6(
    maps: Mapping[str, MapWriter],
    addr: str,
    port: int,
    backends: tuple[tuple[int, str, int, int], ...],
    *,
    proto: int = TCP,
    scope: Scope = Scope.INTERNAL,
    flags: int = 0,
    set_id: int = 1,
    svc_id: int = 1,
    rev_nat_id: int = 1,
    affinity_timeout: int = 0,
    count: int | None = None,
) -> None:
    """`add_service` for an IPv6 frontend, in the IPv6 maps (ekp_fe6, be6, slot6, member6, rnat6,
    and the addresses in ekp_addr6), in the planner's order."""
    member = abi.MemberFlag.LOCAL if flags & FrontendFlag.LOCAL else abi.MemberFlag.CLUSTER
    if any(be_flags & abi.BackendFlag.HOST for _, _, _, be_flags in backends):
        flags |= FrontendFlag.HOST_BACKEND  # as the planner marks it
    for slot, (backend_id, be_addr, be_port, be_flags) in enumerate(backends, 1):
        value = abi.Backend6(abi.Addr6(*abi.ip6_words(be_addr)), port_be(be_port), proto, be_flags)
        maps["be6"].update(abi.BackendKey(backend_id), value)
        maps["member6"].update(abi.MemberKey(svc_id, backend_id), abi.Member(flags=member))
        maps["slot6"].update(abi.SlotKey(set_id, slot), abi.Slot(backend_id))
        add_address6(maps, be_addr, abi.AddrFlag.BACKEND)
    if scope != Scope.HOST:
        add_address6(maps, addr, 1 << scope)
    words = abi.Addr6(*abi.ip6_words(addr))
    maps["rnat6"].update(abi.RevNatKey(rev_nat_id), abi.RevNat6(words, port_be(port)))
    fe = abi.Frontend(
        svc_id=svc_id,
        set_id=set_id,
        count=len(backends) if count is None else count,
        flags=flags,
        affinity_timeout=affinity_timeout,
        rev_nat_id=rev_nat_id,
    )
    maps["fe6"].update(abi.Frontend6Key(words, port_be(port), proto, scope), fe)


def add_service(
    maps: Mapping[str, MapWriter],
    addr: str = VIP,
    port: int = 80,
    backends: tuple[tuple[int, str, int, int], ...] = ((1, BE1, 8080, BackendFlag.LOCAL),),
    *,
    proto: int = TCP,
    scope: Scope = Scope.INTERNAL,
    flags: int = 0,
    set_id: int = 1,
    svc_id: int = 1,
    rev_nat_id: int = 1,
    affinity_timeout: int = 0,
    count: int | None = None,
    slots: bool = True,
) -> None:
    """Backends first, then their membership, slots 1..n, the reverse NAT entry, and the
    frontend last. Members are in the set the frontend uses (LOCAL or CLUSTER). The frontend's
    and backends' addresses go into ekp_addr, as the planner writes them."""
    member = abi.MemberFlag.LOCAL if flags & FrontendFlag.LOCAL else abi.MemberFlag.CLUSTER
    for slot, (backend_id, be_addr, be_port, be_flags) in enumerate(backends, 1):
        value = abi.Backend(ip_be(be_addr), port_be(be_port), proto, be_flags)
        maps["be"].update(abi.BackendKey(backend_id), value)
        maps["member"].update(abi.MemberKey(svc_id, backend_id), abi.Member(flags=member))
        if slots:
            maps["slot"].update(abi.SlotKey(set_id, slot), abi.Slot(backend_id))
        add_address(maps, be_addr, abi.AddrFlag.BACKEND)
    if scope != Scope.HOST:  # the socket programs' alone: the planner gives it no ekp_addr bit
        add_address(maps, addr, 1 << scope)
    maps["rnat"].update(abi.RevNatKey(rev_nat_id), abi.RevNat(ip_be(addr), port_be(port)))
    fe = abi.Frontend(
        svc_id=svc_id,
        set_id=set_id,
        count=len(backends) if count is None else count,
        flags=flags,
        affinity_timeout=affinity_timeout,
        rev_nat_id=rev_nat_id,
    )
    maps["fe"].update(abi.FrontendKey(ip_be(addr), port_be(port), proto, scope), fe)
