"""The IPv6 service maps (agent/ebpf/family6.py): the IPv6 family's state, planned by the same
planner as IPv4's, written into ekp_fe6, be6, slot6, member6, rnat6, srcr6 and addr6 with their
16-byte addresses; the same delta updates, restart re-adoption and capacity errors; no IPv4 map
touched. Dict-backed maps (FakeMap): the kernel's side is tests/ebpf/test_datapath_sockets.py."""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import logging
from typing import Any, TypeVar

import pytest

from agent.config import Config, NodeContext
from agent.ebpf import abi
from agent.ebpf.abi import MAPS, V6_ROLES, FrontendFlag, Scope, ip6_str, ip6_words, port_be, port_host
from agent.ebpf.family6 import Handles, Ipv6Datapath
from agent.ebpf.maps import FakeMap, read_config6, write_config6
from agent.model import IPFamily, NodeInfo, ProxyState, ServicePortName, build_state
from agent.model.types import Protocol
from tests.ebpf.support import failing_once

NODE6 = NodeContext(node_ips=("fd00:192:168::11",), primary_ip="fd00:192:168::11")
VIP6 = "fd00:10:96::a"
SPN = ServicePortName("default", "web", "http", Protocol.TCP)


def service(name: str = "web", vip: str = VIP6, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "type": "ClusterIP",
        "clusterIP": vip,
        "clusterIPs": [vip],
        "ipFamilies": ["IPv6"],
        "ipFamilyPolicy": "SingleStack",
        "ports": [{"name": "http", "port": 80}],
    }
    base.update(spec)
    return {"kind": "Service", "metadata": {"name": name, "namespace": "default"}, "spec": base}


def slice_(*ips: str, name: str = "web", node: str = "node2") -> dict[str, Any]:
    return {
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-v6",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv6",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "nodeName": node} for ip in ips],
    }


def state6(services: list[dict[str, Any]], slices: list[dict[str, Any]]) -> ProxyState:
    result = build_state(services, slices, NodeInfo("node1"), family=IPFamily.IPv6)
    assert not result.problems, result.problems
    return result.state


def fake_maps(**sizes: int) -> dict[str, FakeMap]:
    return {role: FakeMap(spec, sizes.get(role)) for role, spec in MAPS.items()}


K = TypeVar("K")
V = TypeVar("V")


def entries(m: FakeMap, key: type[K], value: type[V]) -> list[tuple[K, V]]:
    out: list[tuple[K, V]] = []
    for k, v in m.items():
        assert isinstance(k, key) and isinstance(v, value)
        out.append((k, v))
    return out


def frontends(maps: dict[str, FakeMap]) -> dict[tuple[str, int, int], abi.Frontend]:
    out = {}
    for k, v in maps["fe6"].items():
        assert isinstance(k, abi.Frontend6Key) and isinstance(v, abi.Frontend)
        out[(ip6_str(k.addr), port_host(k.port), k.scope)] = v
    return out


def backends(maps: dict[str, FakeMap]) -> dict[int, tuple[str, int]]:
    out = {}
    for k, v in maps["be6"].items():
        assert isinstance(k, abi.BackendKey) and isinstance(v, abi.Backend6)
        out[k.id] = (ip6_str(v.addr), port_host(v.port))
    return out


def test_an_ipv6_cluster_ip_is_written_into_the_ipv6_maps_with_its_addresses() -> None:
    maps = fake_maps()
    state = state6([service()], [slice_("fd00:10:244:1::2", "fd00:10:244:2::3")])
    result = Ipv6Datapath(Config()).sync(maps, state, NODE6, None)
    assert result.failed == {}
    fes = frontends(maps)
    assert set(fes) == {(VIP6, 80, Scope.EXTERNAL), (VIP6, 80, Scope.INTERNAL)}
    fe = fes[(VIP6, 80, Scope.INTERNAL)]
    assert fe.count == 2 and not fe.flags & FrontendFlag.NO_ENDPOINTS
    assert sorted(backends(maps).values()) == [("fd00:10:244:1::2", 8080), ("fd00:10:244:2::3", 8080)]
    slots = {
        k.slot: v.backend_id
        for k, v in entries(maps["slot6"], abi.SlotKey, abi.Slot)
        if k.set_id == fe.set_id
    }
    assert set(slots) == {1, 2} and set(slots.values()) == set(backends(maps))
    assert {(k.svc_id, k.backend_id) for k, _ in entries(maps["member6"], abi.MemberKey, abi.Member)} == {
        (fe.svc_id, bid) for bid in slots.values()
    }
    (rnat,) = [v for k, v in entries(maps["rnat6"], abi.RevNatKey, abi.RevNat6) if k.id == fe.rev_nat_id]
    assert (ip6_str(rnat.addr), rnat.port) == (VIP6, port_be(80))
    assert {ip6_str(k.addr) for k, _ in entries(maps["addr6"], abi.Addr6Key, abi.Addr)} == {
        VIP6,
        "fd00:10:244:1::2",
        "fd00:10:244:2::3",
    }
    # the IPv4 maps are the IPv4 planner's: nothing here touched them
    assert all(len(maps[role]) == 0 for role in V6_ROLES)


def test_frontends_whose_set_holds_an_endpoint_on_a_node_address_are_marked_host_backend() -> None:
    """HOST_BACKEND: on every frontend whose set holds a host-network endpoint, and on no other;
    it follows the endpoint. XDP's IPv6 path reads it (bpf/ekp_xdp6.h: such a frontend goes whole
    to tc, which serves its host backend since v6legacy)."""
    maps = fake_maps()
    v6 = Ipv6Datapath(Config())
    v6.sync(maps, state6([service()], [slice_("fd00:10:244:1::2", NODE6.node_ips[0])]), NODE6, None)
    assert {key: bool(fe.flags & FrontendFlag.HOST_BACKEND) for key, fe in frontends(maps).items()} == {
        (VIP6, 80, Scope.EXTERNAL): True,
        (VIP6, 80, Scope.INTERNAL): True,
    }
    v6.sync(maps, state6([service()], [slice_("fd00:10:244:1::2")]), NODE6, None)
    assert not any(fe.flags & FrontendFlag.HOST_BACKEND for fe in frontends(maps).values())


def test_the_nodes_ipv6_address_is_written_as_the_snat_source_of_the_ipv6_path() -> None:
    """ekp_cfg6 (bpf/ekp_tc6.h): the IPv6 node's primary address, written at a sync and again
    when it changed; zero for a node context with no IPv6 address (an agent without an IPv6 half
    empties the IPv6 maps with its IPv4 one), which leaves source translations to ip6tables."""
    maps = fake_maps()
    v6 = Ipv6Datapath(Config())
    state = state6([service()], [slice_("fd00:10:244:1::2")])

    def source() -> str:
        cfg6 = read_config6(maps)
        assert cfg6 is not None
        return ip6_str(cfg6.node_addr)

    v6.sync(maps, state, NODE6, None, snat_source=True)
    assert source() == "fd00:192:168::11"
    moved = NodeContext(node_ips=("fd00:192:168::99",), primary_ip="fd00:192:168::99")
    v6.sync(maps, state, moved, frozenset({SPN}), snat_source=True)
    assert source() == "fd00:192:168::99"
    node4 = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")
    Ipv6Datapath(Config()).sync(maps, state6([], []), node4, None)
    assert source() == "::"


def test_the_snat_source_waits_until_ip6tables_masquerade_keeps_out_of_the_snat_range() -> None:
    """ekp_cfg6 gets the node's address only once the caller says ip6tables' MASQUERADE keeps out
    of --bpf-snat-ports (`snat_source`, EbpfAndIp6tables after a restore): before, nf_conntrack may
    hold a port of the range the tc path would hand to another flow to the same backend. Without
    it zero is written, over an address written before too (a grant lost)."""
    maps = fake_maps()
    v6 = Ipv6Datapath(Config())
    state = state6([service()], [slice_("fd00:10:244:1::2")])
    v6.sync(maps, state, NODE6, None)
    cfg6 = read_config6(maps)
    assert cfg6 is not None and not any(cfg6.node_addr), "the node's address not written"
    v6.sync(maps, state, NODE6, None, snat_source=True)
    cfg6 = read_config6(maps)
    assert cfg6 is not None and ip6_str(cfg6.node_addr) == "fd00:192:168::11"
    v6.sync(maps, state, NODE6, frozenset({SPN}))
    cfg6 = read_config6(maps)
    assert cfg6 is not None and not any(cfg6.node_addr), "the grant gone: zero again"


def two_services() -> ProxyState:
    return state6(
        [service(), service("api", "fd00:10:96::b")],
        [slice_("fd00:10:244:1::2", "fd00:10:244:2::3"), slice_("fd00:10:244:1::7", name="api")],
    )


def held6(maps: Any) -> dict[str, list[bytes]]:
    """Every IPv6 service map's entries, key and value bytes, sorted."""
    return {role: sorted(bytes(k) + bytes(v) for k, v in maps[role].items()) for role in V6_ROLES.values()}


def test_a_restart_over_unchanged_state_writes_nothing_and_keeps_the_ids() -> None:
    maps = fake_maps()
    state = two_services()
    Ipv6Datapath(Config()).sync(maps, state, NODE6, None)
    before = held6(maps)
    again = Ipv6Datapath(Config())  # a new agent: a new planner and a new book of handles
    result = again.sync(maps, state, NODE6, None)
    assert again.last_flush.writes == 0
    after = held6(maps)
    assert after == before and result.repaired == 0
    assert again.sync(maps, state, NODE6, None).repaired == 0


def test_a_restarts_first_read_back_that_fails_is_adopted_again_by_the_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restart whose first read-back of the IPv6 maps fails (ENOMEM at a node's memory limit):
    the retry reads them back and adopts them as a first sync, keeping every id, so established
    flows (their conntrack entries name the ids) keep their backends; it writes nothing."""
    maps = fake_maps()
    state = two_services()
    Ipv6Datapath(Config()).sync(maps, state, NODE6, None)
    before = held6(maps)
    fe = maps[V6_ROLES["fe"]]
    monkeypatch.setattr(fe, "dump_raw", failing_once(fe.dump_raw, OSError(errno.ENOMEM, "lookup batch")))
    again = Ipv6Datapath(Config())
    with pytest.raises(OSError):
        again.sync(maps, state, NODE6, None)
    again.sync(maps, state, NODE6, None)
    assert again.last_flush.writes == 0
    after = held6(maps)
    assert after == before


def test_one_endpoint_change_writes_a_handful_of_ipv6_entries() -> None:
    maps = fake_maps()
    names = [f"s{i}" for i in range(20)]
    services = [service(n, f"fd00:10:96::{i + 1:x}") for i, n in enumerate(names)]
    slices = [slice_(f"fd00:10:244:1::{i + 1:x}", name=n) for i, n in enumerate(names)]
    v6 = Ipv6Datapath(Config())
    v6.sync(maps, state6(services, slices), NODE6, None)
    slices[3] = slice_("fd00:10:244:1::4", "fd00:10:244:9::9", name="s3")
    spn = ServicePortName("default", "s3", "http", Protocol.TCP)
    v6.sync(maps, state6(services, slices), NODE6, frozenset({spn}))
    flushed = v6.last_flush
    assert flushed.updates == {"addr": 1, "be": 1, "member": 1, "rnat": 0, "srcr": 0, "slot": 1, "fe": 2}
    assert sum(flushed.deletes.values()) == 0
    assert ("fd00:10:244:9::9", 8080) in backends(maps).values()


def test_a_full_ipv6_map_reports_the_ports_that_did_not_fit_and_names_the_flag(
    caplog: pytest.LogCaptureFixture,
) -> None:
    maps = fake_maps(fe6=4)  # two service ports' frontends (two scopes each)
    names = ["a", "b", "c"]
    services = [service(n, f"fd00:10:96::{i + 1:x}") for i, n in enumerate(names)]
    slices = [slice_(f"fd00:10:244:1::{i + 1:x}", name=n) for i, n in enumerate(names)]
    with caplog.at_level(logging.ERROR):
        result = Ipv6Datapath(Config()).sync(maps, state6(services, slices), NODE6, None)
    assert set(result.failed) == {ServicePortName("default", "c", "http", Protocol.TCP)}
    assert all("BPF map ekp_fe6_v2 is full" in why for why in result.failed.values()), result.failed
    assert "ekp_fe6_v2 is too small" in caplog.text and MAPS["fe"].size_flag in caplog.text
    assert len(frontends(maps)) == 4


def test_ipv6_source_ranges_go_into_srcr6_with_their_prefix_and_ipv4_ranges_do_not() -> None:
    maps = fake_maps()
    lb = service(
        type="LoadBalancer",
        loadBalancerSourceRanges=["2001:db8:100::/48", "198.51.100.0/24"],
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
    )
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": "2001:db8:1::1"}]}}
    Ipv6Datapath(Config()).sync(maps, state6([lb], [slice_("fd00:10:244:1::2")]), NODE6, None)
    ranges = {
        (k.prefixlen - 32, ip6_str(k.addr)) for k, _ in entries(maps["srcr6"], abi.SrcRange6Key, abi.SrcRange)
    }
    assert ranges == {(48, "2001:db8:100::")}
    lb_fes = [v for (a, _, _), v in frontends(maps).items() if a == "2001:db8:1::1"]
    assert len(lb_fes) == 2 and all(v.flags & FrontendFlag.SOURCE_RANGES for v in lb_fes)
    # no localhost NodePort for IPv6 (kube-proxy's IPv6 proxier has none), whatever the flag
    assert not any(ipaddress.ip_address(a).is_loopback for a, _, _ in frontends(maps))


def test_a_book_grown_far_past_the_addresses_in_use_is_started_again_without_a_write(
    caplog: pytest.LogCaptureFixture,
) -> None:
    maps = fake_maps()
    state = state6([service()], [slice_("fd00:10:244:1::2")])
    v6 = Ipv6Datapath(Config())
    v6.sync(maps, state, NODE6, None)
    first = v6.planner
    for i in range(5000):  # pod addresses that came and went
        v6._handles.of(str(ipaddress.IPv6Address("fd00:10:245::") + i))
    with caplog.at_level(logging.INFO):
        result = v6.sync(maps, state, NODE6, None)
    assert v6.planner is not first and "a new planner re-adopts the maps" in caplog.text
    assert result.repaired == 0 and v6.last_flush.writes == 0
    assert len(v6._handles) == 2  # the ClusterIP and the endpoint


def test_handles_round_trip_and_start_at_one() -> None:
    book = Handles()
    h = book.of(VIP6)
    assert h == 1 and book.of("FD00:10:96:0::A") == h and book.packed(h) == ipaddress.IPv6Address(VIP6).packed
    assert ip6_words(VIP6) == tuple(
        int.from_bytes(book.packed(h)[i : i + 4], "little") for i in range(0, 16, 4)
    )


@pytest.mark.parametrize(
    ("cidrs", "pods_get_every_endpoint"),
    [(("fd00:10:244::/56",), True), (("10.244.0.0/16",), False)],
    ids=["ipv6-cidr-only", "ipv4-cidr-only"],
)
def test_the_ipv6_planner_uses_the_ipv6_local_traffic_detector(
    cidrs: tuple[str, ...], pods_get_every_endpoint: bool
) -> None:
    """kube-proxy's IPv6 proxier detects local traffic with the IPv6 CIDRs alone: with an IPv6
    --cluster-cidr, pods reaching an ETP Local NodePort take every endpoint (its local-traffic
    rule); with only an IPv4 one the IPv6 family has no detector, and pods keep the Local set
    (here none: the one endpoint runs on another node)."""
    maps = fake_maps()
    nodeport = service(
        type="NodePort",
        externalTrafficPolicy="Local",
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
    )
    state = state6([nodeport], [slice_("fd00:10:244:2::3", node="node2")])
    Ipv6Datapath(Config(cluster_cidr=cidrs)).sync(maps, state, NODE6, None)
    internal = frontends(maps)[("fd00:192:168::11", 30080, Scope.INTERNAL)]
    if pods_get_every_endpoint:
        assert not internal.flags & FrontendFlag.LOCAL and internal.count == 1
    else:
        assert internal.flags & FrontendFlag.LOCAL and internal.count == 0


def test_the_ipv6_paths_settings_are_written_to_the_slot_the_programs_do_not_read() -> None:
    """write_config6 as write_config: the spare slot of ekp_cfg6, then ekp_cfg6sel flipped to it;
    the slot the programs read is never rewritten (a 16-byte address read half written would be
    a source of neither address). Nothing is written when the live slot holds it already."""
    maps = fake_maps()
    first = abi.Config6(node_addr=abi.Addr6(*abi.ip6_words("fd00:192:168::11")))
    second = abi.Config6(node_addr=abi.Addr6(*abi.ip6_words("fd00:192:168::99")))
    writes: list[int] = []
    update = maps["cfg6"].update

    def recording(key: Any, value: Any, flags: Any = None) -> None:
        writes.append(int(key.value))
        update(key, value)

    maps["cfg6"].update = recording  # type: ignore[method-assign]
    for cfg6 in (first, second, second, first):
        sel = maps["cfg6sel"].lookup(ctypes.c_uint32(0))
        live = int(getattr(sel, "slot", 0)) & 1 if sel is not None else None
        changed = write_config6(maps, cfg6)
        if changed:
            assert writes[-1] != live, "the live slot rewritten"
        assert read_config6(maps) == cfg6
    assert writes == [1, 0, 1], "one write per change, alternating; none for the repeat"
