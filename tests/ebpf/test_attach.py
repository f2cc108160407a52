"""attach: clsact + our direct-action filter on external and pod devices, a watcher, a careful detach.

Kernel tests: a throwaway namespace `ekpt-<hex>` with veth pairs and two trivial SCHED_CLS programs
named like the real ones (the attach code does not care what the programs do).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import logging
import os
import re
import secrets
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from pyroute2.netlink.exceptions import NetlinkError

from agent.config import Config, HostRouting, NodeContext
from agent.ebpf import abi, attach, tcx, xdp
from agent.ebpf.attach import (
    PROG_EGRESS,
    PROG_FROM_NET,
    PROG_FROM_POD,
    RTM_DELLINK,
    RTM_NEWLINK,
    HandoverState,
    Link,
    detach_all,
    fronts_left,
    hooks_report,
    parse_link_events,
    pod_side_program,
    port_bridge,
)
from agent.ebpf.maps import BpfMap, FakeMap, MapError, MapWriter, UpdateFlag
from agent.ebpf.xdp import PROG_XDP
from agent.localdetect import LocalDetector, LocalMode
from agent.netns import netns_route, run_in_netns
from agent.node import matches_pod_pattern
from lab import hooks as lab_hooks
from lab.tcxold import link_classid_program


def new_attacher(config: Config, progs: Mapping[str, int], ports: MapWriter | None = None) -> attach.Attacher:
    """An Attacher whose bridge-port map is `ports`, else a FakeMap of ekp_port_v2 (these programs
    read none)."""
    return attach.Attacher(config, progs, FakeMap(abi.MAPS["port"]) if ports is None else ports)


def test_pod_patterns() -> None:
    assert matches_pod_pattern("lxc-p1", ("lxc*", "veth*"))
    assert matches_pod_pattern("veth12ab", ("lxc*", "veth*"))
    assert not matches_pod_pattern("eth0", ("lxc*", "veth*"))
    assert not matches_pod_pattern("eth0", ("",))


def test_parse_link_events() -> None:
    def msg(mtype: int, index: int, name: str) -> bytes:
        attr = struct.pack("=HH", 4 + len(name) + 1, 3) + name.encode() + b"\0"
        attr += b"\0" * (-len(attr) % 4)
        body = struct.pack("=BxHiII", 0, 1, index, 0, 0) + struct.pack("=HH", 8, 4) + b"\0" * 4 + attr
        return struct.pack("=IHHII", 16 + len(body), mtype, 0, 0, 0) + body

    data = msg(RTM_NEWLINK, 7, "lxc-a") + msg(RTM_DELLINK, 8, "veth1") + msg(20, 1, "addr")
    assert parse_link_events(data) == [(RTM_NEWLINK, 7, "lxc-a", 0, ""), (RTM_DELLINK, 8, "veth1", 0, "")]
    master = struct.pack("=HHI", 8, 10, 42)  # IFLA_MASTER: a port of the device with ifindex 42
    for kind in ("bridge", "bond"):
        # IFLA_LINKINFO holding IFLA_INFO_KIND "veth", then IFLA_INFO_SLAVE_KIND: the master's kind
        nested = struct.pack("=HH", 9, 1) + b"veth\0" + b"\0" * 3
        nested += struct.pack("=HH", 4 + len(kind) + 1, 4) + kind.encode() + b"\0"
        nested += b"\0" * (-len(nested) % 4)
        info = struct.pack("=HH", 4 + len(nested), 18) + nested
        body = struct.pack("=BxHiII", 0, 1, 9, 0, 0) + master + info
        enslaved = struct.pack("=IHHII", 16 + len(body), RTM_NEWLINK, 0, 0, 0) + body
        assert parse_link_events(enslaved) == [(RTM_NEWLINK, 9, "", 42, kind)]
    # The bridge's own notices (family AF_BRIDGE) are left out: about a port (which its AF_UNSPEC
    # notice tells, RTM_DELLINK there when it only leaves the bridge), and about the bridge itself
    # (`bridge vlan add dev cbr0 vid 10 self`: its own ifindex as IFLA_MASTER; taken as a port of
    # a bridge, the bridge got ekp_from_pod and an entry naming itself)
    for mtype, index in ((RTM_NEWLINK, 9), (RTM_DELLINK, 9), (RTM_NEWLINK, 42)):
        body = struct.pack("=BxHiII", socket.AF_BRIDGE, 1, index, 0, 0) + master
        notice = struct.pack("=IHHII", 16 + len(body), mtype, 0, 0, 0) + body
        assert parse_link_events(notice) == [], (mtype, index)
        assert parse_link_events(notice + enslaved) == [(RTM_NEWLINK, 9, "", 42, "bond")]
    assert parse_link_events(data[:10]) == []


def test_only_a_bridge_s_port_has_a_bridge_for_the_port_map() -> None:
    """bpf host routing accepts a route back by a port's bridge (ekp_port_v2): a pod device whose
    master is a bond or a VRF has none (before, any master's ifindex was written)."""
    assert port_bridge(Link(5, "lxc-a", master=3, master_kind="bridge")) == 3
    assert port_bridge(Link(5, "lxc-a", master=3, master_kind="bond")) == 0
    assert port_bridge(Link(5, "lxc-a", master=3, master_kind="vrf")) == 0
    assert port_bridge(Link(5, "lxc-a")) == 0


PREFIX = LocalDetector(LocalMode.INTERFACE_NAME_PREFIX, prefix="lxc-a")
BRIDGE = LocalDetector(LocalMode.BRIDGE_INTERFACE, interface="cbr0")
BY_CIDR = LocalDetector(LocalMode.CLUSTER_CIDR, cidr="10.244.0.0/16")


@pytest.mark.parametrize(
    ("link", "local", "program"),
    [
        (Link(5, "lxc-a1"), BY_CIDR, PROG_FROM_POD),
        (Link(5, "eth1"), BY_CIDR, None),
        (Link(5, "lxc-a1"), LocalDetector(), PROG_FROM_POD),
        # InterfaceNamePrefix: the prefix makes a device local even outside --pod-interfaces;
        # another pod device is external
        (Link(5, "lxc-a1"), PREFIX, PROG_FROM_POD),
        (Link(5, "lxc-b1"), PREFIX, PROG_FROM_NET),
        (Link(5, "eth1"), PREFIX, None),
        (Link(5, "lxc-a1"), LocalDetector(LocalMode.INTERFACE_NAME_PREFIX, prefix="lxc-"), PROG_FROM_POD),
        # BridgeInterface (the bridge is ifindex 3): its ports are local, whatever their names
        (Link(5, "vethx", master=3), BRIDGE, PROG_FROM_POD),
        (Link(5, "tap0", master=3), BRIDGE, PROG_FROM_POD),
        (Link(5, "lxc-b1"), BRIDGE, PROG_FROM_NET),
        (Link(5, "lxc-b1", master=4), BRIDGE, PROG_FROM_NET),
        (Link(3, "cbr0"), BRIDGE, None),
        (Link(1, "lo"), BY_CIDR, None),
    ],
)
def test_which_program_a_pod_side_device_carries(
    link: Link, local: LocalDetector, program: str | None
) -> None:
    config = Config(pod_interfaces=("lxc*",))
    assert pod_side_program(link, config, local, bridge=3) == program


def bridged_tap(netns: str, **settings: Any) -> Config:
    """A bridge cbr0 in `netns` with a veth port tap0 (peer pod-t), and the BridgeInterface config
    (clsact unless `settings` say otherwise) that makes tap0 a pod device."""
    sh("ip", "-n", netns, "link", "add", "cbr0", "type", "bridge")
    sh("ip", "-n", netns, "link", "add", "tap0", "type", "veth", "peer", "name", "pod-t")
    sh("ip", "-n", netns, "link", "set", "tap0", "master", "cbr0")
    fields: dict[str, Any] = {
        "netns": netns,
        "bpf_tc_attach": "clsact",
        "pod_interfaces": ("lxc*",),
        "detect_local_mode": LocalMode.BRIDGE_INTERFACE,
        "pod_bridge_interface": "cbr0",
    }
    return Config(**(fields | settings))


@pytest.mark.kernel
def test_a_watcher_that_does_not_end_in_time_is_kept_and_said_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """stop_watcher says whether the thread ended: one still in an attach is not forgotten (a
    start_watcher then would run a second one beside it), and the proxier's reload, told it did
    not end, puts nothing in place under it (tests/ebpf/test_proxier.py)."""
    monkeypatch.setattr(attach, "WATCHER_STOP_TIMEOUT", 0.05)
    attacher = new_attacher(Config(), {})
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, args=(30,), name="ekp-link-watcher")
    stuck.start()
    attacher._thread = stuck
    try:
        assert attacher.stop_watcher() is False
        assert attacher.watching
        attacher.start_watcher(timeout=0.05)
        assert attacher._thread is stuck, "no second watcher beside it"
    finally:
        release.set()
        stuck.join(5)
    assert attacher.stop_watcher() is True and not attacher.watching


@pytest.mark.kernel
def test_the_watcher_has_looked_at_every_device_when_it_starts(
    netns: str, progs: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """start_watcher returns once the watcher's own listing of the devices is done: a change the
    caller makes after it then reaches the watcher only as events queued behind that listing. (When
    it returned before the listing, a port's leaving its bridge could come before the listing, whose
    state then went before the leave's queued notices, the first still naming the bridge: the port
    was attached again for a moment; the test above caught it so.)"""
    config = bridged_tap(netns)
    attacher = new_attacher(config, progs, FakeMap(abi.MAPS["port"]))
    attacher.reconcile(NODE, full=True)
    listing = attach.list_links
    listed = threading.Event()

    def slow_listing(ipr: Any) -> list[Link]:
        if threading.current_thread().name == "ekp-link-watcher":
            time.sleep(0.3)  # a watcher thread slow to get the CPU
            links = listing(ipr)
            listed.set()
            return links
        return listing(ipr)

    monkeypatch.setattr(attach, "list_links", slow_listing)
    attacher.start_watcher()
    try:
        assert listed.is_set(), "start_watcher returned before the watcher listed the devices"
    finally:
        attacher.stop_watcher()


@pytest.mark.kernel
@pytest.mark.parametrize("attach_mode", ["clsact", "tcx"])
def test_a_port_leaving_the_bridge_loses_its_entry_and_its_programs_if_it_no_longer_qualifies(
    netns: str, progs: dict[str, int], pin_dir: str, attach_mode: str
) -> None:
    """BridgeInterface: a port that leaves the bridge (the device stays) and matches no pod pattern
    loses its entry and its programs as the watcher sees it leave, not at the next verify (until
    then they translated its packets as a pod's). (Before that, the bridge's AF_BRIDGE RTM_DELLINK
    for the port read as the device gone: the agent forgot it had attached it, and its programs
    stayed until a restart.)"""
    config = bridged_tap(netns, bpf_tc_attach=attach_mode, pin_path=pin_dir)
    ports = FakeMap(abi.MAPS["port"])
    attacher = new_attacher(config, progs, ports)
    attacher.reconcile(NODE, full=True)
    bridge, tap0 = link_index(netns, "cbr0"), link_index(netns, "tap0")
    assert port_entries(ports) == {tap0: bridge}
    assert lab_hooks.ours(netns, "tap0") == [PROG_FROM_POD]
    attacher.start_watcher()
    try:
        sh("ip", "-n", netns, "link", "set", "tap0", "nomaster")
        assert wait_for(lambda: tap0 not in attacher.attached), attacher.attached
        assert port_entries(ports) == {}
        for hook in ("ingress", "egress"):
            assert lab_hooks.ours(netns, "tap0", hook) == [], hook
        assert tcx.pinned(pin_dir, {tap0}) == []
    finally:
        attacher.stop_watcher()


@pytest.mark.kernel
def test_a_verify_leaves_a_port_that_rejoined_the_bridge_after_its_listing_attached(
    netns: str, progs: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """BridgeInterface: a verify whose listing has a port out of the bridge finds it no longer
    wanted; when the watcher sees it back (its entry written) before the verify detaches, the
    port keeps its programs and its entry (the verify detached them and dropped the entry: its
    pods' traffic untranslated until the next verify)."""
    config = bridged_tap(netns)
    ports = FakeMap(abi.MAPS["port"])
    attacher = new_attacher(config, progs, ports)
    attacher.reconcile(NODE, full=True)
    bridge, tap0 = link_index(netns, "cbr0"), link_index(netns, "tap0")
    sh("ip", "-n", netns, "link", "set", "tap0", "nomaster")
    listing = attach.list_links
    listed: list[Link] = []

    def rejoined_after_the_listing(ipr: Any) -> Any:
        # The verify took `known` (tap0 attached) and its mark before its first listing: the
        # watcher's parts (the leave, then the rejoin) land between those and its detach.
        if not listed:
            attacher._on_new_link(ipr, Link(tap0, "tap0"))  # the watcher sees it leave
            assert port_entries(ports) == {}
            listed.extend(listing(ipr))
            sh("ip", "-n", netns, "link", "set", "tap0", "master", "cbr0")
            attacher._on_new_link(ipr, Link(tap0, "tap0", bridge, "bridge"))
        return list(listed)

    monkeypatch.setattr(attach, "list_links", rejoined_after_the_listing)
    attacher.reconcile(NODE, verify=True)
    monkeypatch.setattr(attach, "list_links", listing)
    assert "ekp_from_pod" in ingress(netns, "tap0")
    assert port_entries(ports) == {tap0: bridge}
    assert attacher.attached.get(tap0) == ("tap0", PROG_FROM_POD)


@pytest.mark.kernel
@pytest.mark.parametrize(
    ("code", "level", "words"),
    [
        (errno.ENOENT, logging.INFO, "is already gone or detached"),
        (errno.EBUSY, logging.WARNING, "Device or resource busy'); retried at the next verify"),
    ],
)
def test_a_detach_failing_in_the_watcher_leaves_the_device_to_the_next_verify(
    netns: str,
    progs: dict[str, int],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
    level: int,
    words: str,
) -> None:
    """The watcher's detach of a port that left the bridge fails: said with the device's name, by
    the error (ENOENT, ENODEV: a verify detached it meanwhile, or the device went; another: the
    error, retried), the device still ours for the next verify, which detaches it. (Before, the
    error left `_watch` and the link watcher thread died.)"""
    config = bridged_tap(netns)
    attacher = new_attacher(config, progs, FakeMap(abi.MAPS["port"]))
    attacher.reconcile(NODE, full=True)
    tap0 = link_index(netns, "tap0")
    sh("ip", "-n", netns, "link", "set", "tap0", "nomaster")

    def refused(*args: Any) -> bool:
        raise NetlinkError(code, os.strerror(code))

    caplog.set_level(logging.INFO, logger="agent.ebpf.attach")
    with monkeypatch.context() as patched, netns_route(netns) as ipr:
        patched.setattr(attacher, "_detach", refused)
        attacher._on_new_link(ipr, Link(tap0, "tap0"))  # the watcher's part
    said = [r.getMessage() for r in caplog.records if r.levelno == level]
    assert any("tap0" in m and words in m for m in said), said
    assert attacher.attached.get(tap0) == ("tap0", PROG_FROM_POD)
    assert "ekp_from_pod" in ingress(netns, "tap0")
    attacher.reconcile(NODE, verify=True)
    assert ingress(netns, "tap0") == ""
    assert tap0 not in attacher.attached


@pytest.mark.kernel
def test_the_watchers_detach_says_why_the_device_no_longer_qualifies(
    netns: str, progs: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    """A port whose bridge was deleted (BridgeInterface) is said to have lost its bridge, not to be
    "not a port of bridge cbr0 (ifindex 0)"; a pod device renamed (the CIDR modes) to have been
    renamed, not to be "not a port of bridge" nor a bare "no longer a pod device"."""
    bridged = bridged_tap(netns)
    by_cidr = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",))
    caplog.set_level(logging.INFO, logger="agent.ebpf.attach")
    port_side = new_attacher(bridged, progs, FakeMap(abi.MAPS["port"]))
    port_side.reconcile(NODE, full=True)
    tap0, lxc = link_index(netns, "tap0"), link_index(netns, "lxc-a")
    assert port_side.attached.get(tap0) == ("tap0", PROG_FROM_POD)
    sh("ip", "-n", netns, "link", "del", "cbr0")
    with netns_route(netns) as ipr:  # the watcher's part
        port_side._on_new_link(ipr, Link(tap0, "tap0"))
    # then the CIDR modes' attacher (its full reconcile replaces the bridged one's filters)
    pod_side = new_attacher(by_cidr, progs, FakeMap(abi.MAPS["port"]))
    pod_side.reconcile(NODE, full=True)
    assert pod_side.attached.get(lxc) == ("lxc-a", PROG_FROM_POD)
    sh("ip", "-n", netns, "link", "set", "lxc-a", "down")
    sh("ip", "-n", netns, "link", "set", "lxc-a", "name", "zz-a")
    with netns_route(netns) as ipr:
        pod_side._on_new_link(ipr, Link(lxc, "zz-a"))
    said = {
        m.split(":")[0]: m for m in (r.getMessage() for r in caplog.records) if m.startswith("detached from")
    }
    assert set(said) == {"detached from tap0", "detached from zz-a"}, said
    assert "its bridge cbr0 is gone" in said["detached from tap0"], said
    assert "renamed from lxc-a" in said["detached from zz-a"], said
    assert tap0 not in port_side.attached
    assert lxc not in pod_side.attached


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"ekpt-{secrets.token_hex(3)}"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0")
        sh("ip", "-n", name, "addr", "add", "192.168.0.11/24", "dev", "eth0")
        sh("ip", "-n", name, "link", "add", "lxc-a", "type", "veth", "peer", "name", "pod-a")
        sh("ip", "-n", name, "link", "add", "other1", "type", "veth", "peer", "name", "other2")
        for dev in ("eth0", "peer0", "lxc-a", "pod-a"):
            sh("ip", "-n", name, "link", "set", dev, "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture(scope="module")
def progs() -> Iterator[dict[str, int]]:
    from bcc import BPF

    text = """
#include <uapi/linux/pkt_cls.h>
int ekp_from_net(struct __sk_buff *skb) { return TC_ACT_OK; }
int ekp_from_pod(struct __sk_buff *skb) { return TC_ACT_OK; }
int ekp_egress(struct __sk_buff *skb) { return TC_ACT_OK; }
"""
    bpf: Any = BPF(text=text.encode())
    names = (PROG_FROM_NET, PROG_FROM_POD, PROG_EGRESS)
    fds = {name: bpf.load_func(name.encode(), BPF.SCHED_CLS).fd for name in names}
    yield fds
    bpf.cleanup()


def ingress(ns: str, dev: str) -> str:
    return sh("tc", "-n", ns, "filter", "show", "dev", dev, "ingress")


def egress(ns: str, dev: str) -> str:
    return sh("tc", "-n", ns, "filter", "show", "dev", dev, "egress")


def qdiscs(ns: str, dev: str) -> str:
    return sh("tc", "-n", ns, "qdisc", "show", "dev", dev)


def wait_for(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


NODE = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")


@pytest.mark.kernel
def test_a_device_holding_only_an_ipv6_node_address_is_external(netns: str, progs: dict[str, int]) -> None:
    """A dual-stack node whose IPv6 address is on another device than its IPv4 one (no
    --devices): that device carries ekp_from_net too, or the replies of the IPv6 flows the tc
    path translated come back there untranslated. The address in another spelling matches."""
    sh("ip", "-n", netns, "addr", "add", "fd00:ff::11/64", "dev", "other1", "nodad")
    sh("ip", "-n", netns, "link", "set", "other1", "up")
    attacher = new_attacher(Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",)), progs)
    attacher.reconcile(NodeContext(node_ips=("192.168.0.11", "fd00:ff:0::11")), full=True)
    assert "ekp_from_net" in ingress(netns, "other1")
    assert sorted(attacher.attached.values()) == [
        ("eth0", PROG_FROM_NET),
        ("lxc-a", PROG_FROM_POD),
        ("other1", PROG_FROM_NET),
    ]
    attacher.reconcile(NODE, full=True)
    assert ingress(netns, "other1") == "", "IPv4 node addresses alone: not external"


@pytest.mark.kernel
def test_a_device_whose_ipv6_node_address_went_is_detached_by_the_next_plain_reconcile(
    netns: str, progs: dict[str, int]
) -> None:
    """Not only the first (full) reconcile detaches: the plain one an IPv6 sync runs when the IPv6
    node addresses changed (EbpfProxier._follow_node6) takes ekp_from_net off a device that no
    longer holds a node address."""
    sh("ip", "-n", netns, "addr", "add", "fd00:ff::11/64", "dev", "other1", "nodad")
    sh("ip", "-n", netns, "link", "set", "other1", "up")
    attacher = new_attacher(Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",)), progs)
    attacher.reconcile(NodeContext(node_ips=("192.168.0.11", "fd00:ff::11")), full=True)
    assert "ekp_from_net" in ingress(netns, "other1")
    attacher.reconcile(NODE)
    assert ingress(netns, "other1") == ""
    assert sorted(attacher.attached.values()) == [("eth0", PROG_FROM_NET), ("lxc-a", PROG_FROM_POD)]


@pytest.mark.kernel
def test_a_link_scope_ipv6_address_never_makes_a_device_external(netns: str, progs: dict[str, int]) -> None:
    """Every pod's veth holds an fe80:: address, unique on its link only: a link-local address
    among the node addresses (an operator's --node-ip) does not make the pod device that holds the
    same one external; a global address does."""
    sh("ip", "-n", netns, "addr", "add", "fe80::11/64", "dev", "lxc-a", "nodad")
    sh("ip", "-n", netns, "addr", "add", "fd00:ff::11/64", "dev", "other1", "nodad")
    sh("ip", "-n", netns, "link", "set", "other1", "up")
    attacher = new_attacher(Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",)), progs)
    attacher.reconcile(NodeContext(node_ips=("192.168.0.11", "fe80::11", "fd00:ff::11")), full=True)
    assert sorted(attacher.attached.values()) == [
        ("eth0", PROG_FROM_NET),
        ("lxc-a", PROG_FROM_POD),
        ("other1", PROG_FROM_NET),
    ]


@pytest.mark.kernel
def test_attach_watch_and_detach(netns: str, progs: dict[str, int]) -> None:
    config = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",))
    attacher = new_attacher(config, progs)
    attacher.reconcile(NODE, full=True)
    assert "ekp_from_net" in ingress(netns, "eth0") and "direct-action" in ingress(netns, "eth0")
    assert "pref 17" in ingress(netns, "eth0") and "handle 0xeb" in ingress(netns, "eth0")
    assert "ekp_from_pod" in ingress(netns, "lxc-a")
    assert ingress(netns, "other1") == "" and ingress(netns, "pod-a") == ""
    assert sorted(attacher.attached.values()) == [("eth0", PROG_FROM_NET), ("lxc-a", PROG_FROM_POD)]
    # the replies of the node's own stack leave through ekp_egress on both kinds of device
    for dev in ("eth0", "lxc-a"):
        assert "ekp_egress" in egress(netns, dev) and "direct-action" in egress(netns, dev), dev
    assert egress(netns, "other1") == ""

    # a second reconcile finds everything in place and attaches nothing
    attached = attacher.attachments
    attacher.reconcile(NODE)
    assert attacher.attachments == attached

    # filters removed behind our back: external devices are checked every sync, pods when verifying
    for dev in ("eth0", "lxc-a"):
        sh("tc", "-n", netns, "filter", "del", "dev", dev, "ingress", "prio", "17", "handle", "0xeb", "bpf")
    attacher.reconcile(NODE)
    assert attacher.attachments == attached + 1
    assert "ekp_from_net" in ingress(netns, "eth0") and ingress(netns, "lxc-a") == ""
    attacher.reconcile(NODE, verify=True)
    assert attacher.attachments == attached + 2
    assert "ekp_from_pod" in ingress(netns, "lxc-a")
    # an egress filter removed behind our back comes back at the next check as well
    sh("tc", "-n", netns, "filter", "del", "dev", "eth0", "egress", "prio", "17", "handle", "0xeb", "bpf")
    attacher.reconcile(NODE)
    assert attacher.attachments == attached + 3 and "ekp_egress" in egress(netns, "eth0")

    # the watcher attaches to a new pod device and forgets a deleted one
    attacher.start_watcher()
    try:
        sh("ip", "-n", netns, "link", "add", "lxc-b", "type", "veth", "peer", "name", "pod-b")
        assert wait_for(lambda: "ekp_from_pod" in ingress(netns, "lxc-b")), ingress(netns, "lxc-b")
        assert "ekp_egress" in egress(netns, "lxc-b")
        assert wait_for(lambda: ("lxc-b", PROG_FROM_POD) in attacher.attached.values())
        sh("ip", "-n", netns, "link", "add", "nomatch", "type", "veth", "peer", "name", "nomatch2")
        sh("ip", "-n", netns, "link", "del", "lxc-b")
        assert wait_for(lambda: ("lxc-b", PROG_FROM_POD) not in attacher.attached.values())
        assert ingress(netns, "nomatch") == ""
        # a burst of pods: none is missed
        batch = "".join(f"link add lxc-c{i} type veth peer name pod-c{i}\n" for i in range(20))
        subprocess.run(["ip", "-n", netns, "-batch", "-"], input=batch, text=True, check=True)
        want = {(f"lxc-c{i}", PROG_FROM_POD) for i in range(20)}
        assert wait_for(lambda: want <= set(attacher.attached.values()))
        assert all("ekp_from_pod" in ingress(netns, f"lxc-c{i}") for i in range(20))
    finally:
        attacher.stop_watcher()

    # detach leaves a foreign filter (and so the qdisc) in place
    sh(
        "tc", "-n", netns, "filter", "add", "dev", "eth0", "ingress", "prio", "5", "protocol", "ip",
        "u32", "match", "ip", "dst", "1.2.3.4/32", "flowid", "1:1",
    )  # fmt: skip
    assert sorted(detach_all(netns)) == ["eth0", "lxc-a", *sorted(f"lxc-c{i}" for i in range(20))]
    assert "ekp_" not in ingress(netns, "eth0") and "u32" in ingress(netns, "eth0")
    assert egress(netns, "eth0") == "" and egress(netns, "lxc-a") == ""
    assert "clsact" in qdiscs(netns, "eth0")
    assert "clsact" not in qdiscs(netns, "lxc-a")
    assert detach_all(netns) == []


@pytest.mark.kernel
def test_a_first_full_reconcile_keeping_external_devices_leaves_ekp_from_net_where_it_is(
    netns: str, progs: dict[str, int]
) -> None:
    """A restarted agent's first full reconcile, before its IPv6 sync named the IPv6 node addresses
    (`keep_external`): the device holding only one keeps ekp_from_net, its program replaced, and
    is external (XDP too); the next reconcile with the IPv4 addresses alone detaches it, with the
    IPv6 one it stays."""
    sh("ip", "-n", netns, "addr", "add", "fd00:ff::11/64", "dev", "other1", "nodad")
    sh("ip", "-n", netns, "link", "set", "other1", "up")
    config = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",))
    dual = NodeContext(node_ips=("192.168.0.11", "fd00:ff::11"))
    new_attacher(config, progs).reconcile(dual, full=True)
    assert "ekp_from_net" in ingress(netns, "other1")

    restarted = new_attacher(config, progs)
    restarted.reconcile(NODE, full=True, keep_external=True)
    assert "ekp_from_net" in ingress(netns, "other1"), "kept until the IPv6 addresses are known"
    assert ("other1", PROG_FROM_NET) in restarted.attached.values()
    restarted.reconcile(dual)
    assert "ekp_from_net" in ingress(netns, "other1")
    restarted.reconcile(NODE)
    assert ingress(netns, "other1") == "", "not external once the addresses say so"


@pytest.mark.kernel
def test_replace_keeps_a_filter_in_place_and_full_reconcile_detaches_strays(
    netns: str, progs: dict[str, int]
) -> None:
    config = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*", "other*"))
    new_attacher(config, progs).reconcile(NODE, full=True)
    assert "ekp_from_pod" in ingress(netns, "other1")

    # a restarted agent with other settings: full reconcile swaps programs and drops the stray
    gaps: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if "ekp_from_net" not in ingress(netns, "eth0"):
                gaps.append("eth0 without a filter")
            time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    try:
        new_attacher(Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",)), progs).reconcile(
            NODE, full=True
        )
    finally:
        stop.set()
        t.join()
    assert gaps == []
    assert ingress(netns, "other1") == ""
    assert "ekp_from_pod" in ingress(netns, "lxc-a")


@pytest.mark.kernel
def test_both_host_routings_keep_the_egress_half_on_every_device(netns: str, progs: dict[str, int]) -> None:
    """--bpf-host-routing=legacy: ekp_egress on the egress of every device with an ingress program,
    new pod devices included; the same devices under `bpf` keep it (the replies of backends on the
    node's own address need it there too), and a switch back finds it in place."""
    legacy = Config(
        netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",), bpf_host_routing=HostRouting.LEGACY
    )
    attacher = new_attacher(legacy, progs)
    attacher.reconcile(NODE, full=True)
    for dev in ("eth0", "lxc-a"):
        assert "ekp_egress" in egress(netns, dev) and "direct-action" in egress(netns, dev), dev
    assert egress(netns, "other1") == ""
    attached = attacher.attachments
    attacher.reconcile(NODE, verify=True)
    assert attacher.attachments == attached, "in place: nothing attached again"
    # an egress filter removed behind our back is put back by the check of the external devices
    sh("tc", "-n", netns, "filter", "del", "dev", "eth0", "egress", "prio", "17", "handle", "0xeb", "bpf")
    attacher.reconcile(NODE)
    assert "ekp_egress" in egress(netns, "eth0")
    attacher.start_watcher()
    try:
        sh("ip", "-n", netns, "link", "add", "lxc-e", "type", "veth", "peer", "name", "pod-e")
        assert wait_for(lambda: "ekp_from_pod" in ingress(netns, "lxc-e"))
        assert "ekp_egress" in egress(netns, "lxc-e"), "attached before the ingress program"
    finally:
        attacher.stop_watcher()
        sh("ip", "-n", netns, "link", "del", "lxc-e")

    bpf = Config(
        netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",), bpf_host_routing=HostRouting.BPF
    )
    new_attacher(bpf, progs).reconcile(NODE, full=True)
    for dev in ("eth0", "lxc-a"):
        assert "ekp_egress" in egress(netns, dev) and "ekp_from_" in ingress(netns, dev), dev

    back = new_attacher(legacy, progs)
    back.reconcile(NODE)
    assert back.attachments == 0, "in place under either host routing: nothing attached again"
    assert sorted(detach_all(netns)) == ["eth0", "lxc-a"]
    assert egress(netns, "eth0") == "" and "clsact" not in qdiscs(netns, "lxc-a")


@pytest.mark.kernel
def test_egress_programs_go_everywhere_before_any_ingress_program(netns: str, progs: dict[str, int]) -> None:
    """A node's first start under legacy host routing (the proxier): ekp_egress on every device
    that will carry our programs, and no ingress program yet; the full reconcile then adds them."""
    config = Config(
        netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",), bpf_host_routing=HostRouting.LEGACY
    )
    attacher = new_attacher(config, progs)
    attacher.attach_egress(NODE)
    for dev in ("eth0", "lxc-a"):
        assert "ekp_egress" in egress(netns, dev) and ingress(netns, dev) == "", dev
    assert egress(netns, "other1") == ""
    attacher.reconcile(NODE, full=True)
    assert "ekp_from_net" in ingress(netns, "eth0") and "ekp_from_pod" in ingress(netns, "lxc-a")
    assert sorted(detach_all(netns)) == ["eth0", "lxc-a"]


@pytest.mark.kernel
def test_the_attach_names_the_devices_it_added_a_clsact_qdisc_to_and_a_restart_adds_none(
    netns: str, progs: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    """Adding a clsact qdisc stops the device's transmit queue for an RCU grace period (the kernel's
    qdisc_graft deactivates the device around it; what is sent out of it meanwhile is dropped:
    README "Machine facts"), so the attach says where it did and how long the adds took
    (CLSACT_LOG: tests/traffic/test_switch.py reads it). A restart finds the qdiscs and says
    nothing: replacing a filter drops nothing."""
    caplog.set_level(logging.INFO, logger="agent.ebpf.attach")
    config = Config(
        netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",), bpf_host_routing=HostRouting.LEGACY
    )
    new_attacher(config, progs).attach_egress(NODE)
    said = [r.getMessage() for r in caplog.records if "clsact" in r.getMessage()]
    assert len(said) == 1 and re.match(
        r"added the clsact qdisc to 2 device\(s\) that had none \(eth0, lxc-a\) in [\d.]+ ms: the kernel"
        r" stops a device's transmit queue",
        said[0],
    ), said
    caplog.clear()
    restarted = new_attacher(config, progs)
    restarted.attach_egress(NODE)
    restarted.reconcile(NODE, full=True)
    assert [r.getMessage() for r in caplog.records if "clsact" in r.getMessage()] == []
    # bpf host routing attaches egress with ingress, device by device: each add said on its own
    assert sorted(detach_all(netns)) == ["eth0", "lxc-a"]
    caplog.clear()
    new_attacher(Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",)), progs).reconcile(
        NODE, full=True
    )
    said = [r.getMessage() for r in caplog.records if "clsact" in r.getMessage()]
    assert sorted(re.sub(r" in [\d.]+ ms:.*", "", m) for m in said) == [
        "added the clsact qdisc to 1 device(s) that had none (eth0)",
        "added the clsact qdisc to 1 device(s) that had none (lxc-a)",
    ], said
    detach_all(netns)


@pytest.mark.kernel
def test_interface_modes_attach_by_prefix_and_by_bridge_port_and_follow_enslaving(
    netns: str, progs: dict[str, int]
) -> None:
    sh("ip", "-n", netns, "link", "add", "lxc-c", "type", "veth", "peer", "name", "pod-c")
    prefix = Config(
        netns=netns,
        bpf_tc_attach="clsact",
        pod_interfaces=("lxc*",),
        detect_local_mode=LocalMode.INTERFACE_NAME_PREFIX,
        pod_interface_name_prefix="lxc-a",
    )
    new_attacher(prefix, progs).reconcile(NODE, full=True)
    assert "ekp_from_pod" in ingress(netns, "lxc-a")
    assert "ekp_from_net" in ingress(netns, "lxc-c")

    sh("ip", "-n", netns, "link", "add", "cbr0", "type", "bridge")
    sh("ip", "-n", netns, "link", "set", "lxc-c", "master", "cbr0")
    bridge = Config(
        netns=netns,
        bpf_tc_attach="clsact",
        pod_interfaces=("lxc*",),
        detect_local_mode=LocalMode.BRIDGE_INTERFACE,
        pod_bridge_interface="cbr0",
    )
    attacher = new_attacher(bridge, progs)
    attacher.reconcile(NODE, full=True)
    assert "ekp_from_pod" in ingress(netns, "lxc-c")  # a port of the bridge
    assert "ekp_from_net" in ingress(netns, "lxc-a")  # a pod device outside it
    assert ingress(netns, "cbr0") == ""
    attacher.start_watcher()
    try:
        # a new pod device is external until the CNI makes it a port of the bridge
        sh("ip", "-n", netns, "link", "add", "lxc-d", "type", "veth", "peer", "name", "pod-d")
        assert wait_for(lambda: "ekp_from_net" in ingress(netns, "lxc-d")), ingress(netns, "lxc-d")
        sh("ip", "-n", netns, "link", "set", "lxc-d", "master", "cbr0")
        assert wait_for(lambda: "ekp_from_pod" in ingress(netns, "lxc-d")), ingress(netns, "lxc-d")
        assert wait_for(lambda: attacher.attached.get(link_index(netns, "lxc-d")) == ("lxc-d", PROG_FROM_POD))
    finally:
        attacher.stop_watcher()


def link_index(ns: str, dev: str) -> int:
    return int(sh("ip", "-n", ns, "-o", "link", "show", "dev", dev).split(":", 1)[0])


def port_entries(ports: MapWriter) -> dict[int, int]:
    """ekp_port_v2 as {port ifindex: bridge ifindex}."""
    out = {}
    for k, v in ports.items():
        assert isinstance(k, ctypes.c_uint32) and isinstance(v, abi.Port), (k, v)
        out[int(k.value)] = int(v.bridge)
    return out


@pytest.mark.kernel
def test_a_bridge_port_s_entry_names_its_bridge_and_follows_enslaving(
    netns: str, progs: dict[str, int]
) -> None:
    """bpf host routing's source check (bpf/ekp_redirect.h) accepts a route back by the bridge a
    pod's port belongs to, which ekp_port_v2 holds for the port: no entry for a device of no bridge,
    the bridge's ifindex once the CNI enslaves the veth (the watcher writes it, in any detector
    mode: here the default, where the program stays ekp_from_pod), kept by a full reconcile of a
    restarted agent, gone when the port leaves the bridge and when the device goes; an entry no
    device of ours explains (left by an agent that stopped before the device went) is removed by
    a full reconcile. No external device gets one. (On main the port's filter carried the bridge
    as its classid, which tcx cannot give, and this map did not exist.)"""
    config = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",))
    ports = FakeMap(abi.MAPS["port"])
    sh("ip", "-n", netns, "link", "add", "cbr0", "type", "bridge")
    sh("ip", "-n", netns, "link", "set", "eth0", "master", "cbr0")  # an external device on a bridge
    attacher = new_attacher(config, progs, ports)
    attacher.reconcile(NODE, full=True)
    assert port_entries(ports) == {}
    bridge, lxc_a = link_index(netns, "cbr0"), link_index(netns, "lxc-a")
    attacher.start_watcher()
    try:
        sh("ip", "-n", netns, "link", "set", "lxc-a", "master", "cbr0")
        assert wait_for(lambda: port_entries(ports) == {lxc_a: bridge}), port_entries(ports)
    finally:
        attacher.stop_watcher()
    assert "ekp_from_pod" in ingress(netns, "lxc-a")
    ports.update(ctypes.c_uint32(9999), abi.Port(bridge=bridge))  # a device gone while no agent ran
    restarted = new_attacher(config, progs, ports)
    restarted.reconcile(NODE, full=True)
    assert port_entries(ports) == {lxc_a: bridge}
    restarted.start_watcher()
    try:
        sh("ip", "-n", netns, "link", "set", "lxc-a", "nomaster")
        assert wait_for(lambda: port_entries(ports) == {}), port_entries(ports)
        sh("ip", "-n", netns, "link", "set", "lxc-a", "master", "cbr0")
        assert wait_for(lambda: port_entries(ports) == {lxc_a: bridge}), port_entries(ports)
        sh("ip", "-n", netns, "link", "del", "lxc-a")
        assert wait_for(lambda: port_entries(ports) == {}), port_entries(ports)
    finally:
        restarted.stop_watcher()


def bridged_pod(ns: str, dev: str, bridge: str) -> None:
    sh("ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", f"p-{dev}")
    sh("ip", "-n", ns, "link", "set", dev, "master", bridge)
    sh("ip", "-n", ns, "link", "set", dev, "up")


@pytest.mark.kernel
def test_a_verify_leaves_the_entry_of_a_port_the_watcher_attached_after_its_listing(
    netns: str, progs: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify lists the wanted devices, then removes the entries of every other device; a pod
    port the watcher attaches in between is in no listing of that verify, and its entry stays
    (removed, its pods' Service traffic was dropped as spoofed_source under bpf host routing until
    the next verify)."""
    config = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",))
    ports = FakeMap(abi.MAPS["port"])
    sh("ip", "-n", netns, "link", "add", "cbr0", "type", "bridge")
    sh("ip", "-n", netns, "link", "set", "lxc-a", "master", "cbr0")
    attacher = new_attacher(config, progs, ports)
    attacher.reconcile(NODE, full=True)
    bridge, lxc_a = link_index(netns, "cbr0"), link_index(netns, "lxc-a")
    assert port_entries(ports) == {lxc_a: bridge}
    listing = attach.wanted_devices

    def watcher_attaches_after_the_listing(ipr: Any, *args: Any) -> Any:
        wanted = listing(ipr, *args)
        bridged_pod(netns, "lxc-b", "cbr0")
        attacher._on_new_link(ipr, Link(link_index(netns, "lxc-b"), "lxc-b", bridge, "bridge"))
        return wanted

    monkeypatch.setattr(attach, "wanted_devices", watcher_attaches_after_the_listing)
    attacher.reconcile(NODE, verify=True)
    monkeypatch.setattr(attach, "wanted_devices", listing)
    assert port_entries(ports) == {lxc_a: bridge, link_index(netns, "lxc-b"): bridge}
    assert "ekp_from_pod" in ingress(netns, "lxc-b")


@pytest.mark.kernel
def test_a_tcx_verify_re_attaching_a_port_the_watcher_enslaved_after_its_listing_keeps_its_entry(
    netns: str, progs: dict[str, int], pin_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On tcx a verify re-attaches every device whose link its pins snapshot (taken before the
    listing) lacks: a pod veth listed before the CNI enslaved it, which the watcher then attached
    with its bridge's entry. The re-attach, from the older listing (no bridge), leaves that entry
    (it deleted it: the pod's Service traffic dropped as spoofed_source under bpf host routing
    until the next verify)."""
    config = tcx_config(netns, pin_dir)
    ports = FakeMap(abi.MAPS["port"])
    sh("ip", "-n", netns, "link", "add", "cbr0", "type", "bridge")
    attacher = new_attacher(config, progs, ports)
    attacher.reconcile(NODE, full=True)
    sh("ip", "-n", netns, "link", "add", "lxc-b", "type", "veth", "peer", "name", "p-lxc-b")  # a new pod
    bridge, lxc_b = link_index(netns, "cbr0"), link_index(netns, "lxc-b")
    listing = attach.list_links
    listed: list[Link] = []

    def enslaved_after_the_listing(ipr: Any) -> Any:
        # The verify lists the devices more than once (wanted_devices too): each of its listings
        # is the one taken before the CNI enslaved the veth.
        if not listed:
            listed.extend(listing(ipr))
            sh("ip", "-n", netns, "link", "set", "lxc-b", "master", "cbr0")
            attacher._on_new_link(ipr, Link(lxc_b, "lxc-b", bridge, "bridge"))
        return list(listed)

    monkeypatch.setattr(attach, "list_links", enslaved_after_the_listing)
    attacher.reconcile(NODE, verify=True)
    monkeypatch.setattr(attach, "list_links", listing)
    assert port_entries(ports) == {lxc_b: bridge}
    assert tcx_progs(netns, "lxc-b") == [PROG_FROM_POD]


@pytest.mark.kernel
def test_a_verify_does_not_write_again_the_entry_of_a_device_the_watcher_saw_go_after_its_listing(
    netns: str, progs: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify repairs the entries its listing says the map lacks; one the watcher removed after
    that listing (an RTM_DELLINK: the device went, its ifindex free for another) stays removed.
    Once a later listing is taken, what it says counts again."""
    config = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",))
    ports = FakeMap(abi.MAPS["port"])
    sh("ip", "-n", netns, "link", "add", "cbr0", "type", "bridge")
    sh("ip", "-n", netns, "link", "set", "lxc-a", "master", "cbr0")
    attacher = new_attacher(config, progs, ports)
    attacher.reconcile(NODE, full=True)
    bridge, lxc_a = link_index(netns, "cbr0"), link_index(netns, "lxc-a")
    assert port_entries(ports) == {lxc_a: bridge}
    listing = attach.list_links

    def gone_after_the_listing(ipr: Any) -> Any:
        links = listing(ipr)
        # The watcher's part on an RTM_DELLINK (the device itself stays: the verify then finds
        # its programs in place and attaches nothing).
        attacher._forget_bridge(lxc_a)
        return links

    monkeypatch.setattr(attach, "list_links", gone_after_the_listing)
    attacher.reconcile(NODE, verify=True)
    monkeypatch.setattr(attach, "list_links", listing)
    assert port_entries(ports) == {}
    attacher.reconcile(NODE, verify=True)
    assert port_entries(ports) == {lxc_a: bridge}


@pytest.mark.kernel
def test_a_verify_checks_the_port_map_itself_and_rewrites_an_entry_it_lacks(
    netns: str, progs: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    """The cache of ekp_port_v2 says an entry is there; the map, not the cache, is what a verify
    checks: an entry deleted (or changed) behind the agent's back is written again, with one
    warning each, also where the device lost its program too (written before it is attached
    again, which finds the cache as it was)."""
    config = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",))
    ports = FakeMap(abi.MAPS["port"])
    sh("ip", "-n", netns, "link", "add", "cbr0", "type", "bridge")
    sh("ip", "-n", netns, "link", "set", "lxc-a", "master", "cbr0")
    bridged_pod(netns, "lxc-b", "cbr0")
    attacher = new_attacher(config, progs, ports)
    attacher.reconcile(NODE, full=True)
    bridge, lxc_a, lxc_b = link_index(netns, "cbr0"), link_index(netns, "lxc-a"), link_index(netns, "lxc-b")
    assert port_entries(ports) == {lxc_a: bridge, lxc_b: bridge}
    assert "ekp_port_v2 held" not in caplog.text
    ports.delete(ctypes.c_uint32(lxc_a))
    ports.update(ctypes.c_uint32(lxc_b), abi.Port(bridge=bridge + 100))
    attacher.reconcile(NODE, verify=True)
    assert port_entries(ports) == {lxc_a: bridge, lxc_b: bridge}
    assert caplog.text.count("ekp_port_v2 held") == 2, caplog.text
    ports.delete(ctypes.c_uint32(lxc_a))
    sh("tc", "-n", netns, "filter", "del", "dev", "lxc-a", "ingress")
    attacher.reconcile(NODE, verify=True)
    assert port_entries(ports) == {lxc_a: bridge, lxc_b: bridge}
    assert "ekp_from_pod" in ingress(netns, "lxc-a")


class FailingPorts(FakeMap):
    """ekp_port_v2 whose updates fail with `err` for the ifindexes in `failing`."""

    def __init__(self, err: int) -> None:
        super().__init__(abi.MAPS["port"])
        self.err = err
        self.failing: set[int] = set()

    def update(self, key: Any, value: Any, flags: UpdateFlag = UpdateFlag.ANY) -> None:
        if int(key.value) in self.failing:
            raise MapError(self.spec.name, "update", self.err)
        super().update(key, value, flags)


@pytest.mark.kernel
@pytest.mark.parametrize("attach_mode", ["clsact", "tcx"])
def test_a_port_entry_the_map_refuses_leaves_every_device_attached_and_a_verify_writes_it(
    netns: str, progs: dict[str, int], pin_dir: str, attach_mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A bridge port's entry the map refuses (ENOMEM under memory cgroup pressure: the hash
    allocates each entry as written; or full) is logged as an error saying what it breaks, once
    while refused, and when written at last; the port and every device after it get their programs
    all the same, and the next verify writes the entry. (Before, the MapError left that device and
    every one after it unattached, every sync.)"""
    config = Config(netns=netns, bpf_tc_attach=attach_mode, pin_path=pin_dir, pod_interfaces=("lxc*",))
    ports = FailingPorts(errno.ENOMEM)
    sh("ip", "-n", netns, "link", "add", "cbr0", "type", "bridge")
    sh("ip", "-n", netns, "link", "set", "lxc-a", "master", "cbr0")
    bridged_pod(netns, "lxc-b", "cbr0")
    bridge, lxc_a, lxc_b = link_index(netns, "cbr0"), link_index(netns, "lxc-a"), link_index(netns, "lxc-b")
    ports.failing = {lxc_a}
    attacher = new_attacher(config, progs, ports)
    attacher.reconcile(NODE, full=True)
    for dev, prog in (("eth0", PROG_FROM_NET), ("lxc-a", PROG_FROM_POD), ("lxc-b", PROG_FROM_POD)):
        assert lab_hooks.hook_programs(netns, dev) == [prog], dev
    assert port_entries(ports) == {lxc_b: bridge}
    said = [r for r in caplog.records if r.levelno == logging.ERROR and "ekp_port_v2" in r.getMessage()]
    assert len(said) == 1 and "spoofed_source" in said[0].getMessage(), said
    # The remedy for a full map: a restart alone keeps the pinned map's size.
    assert f"raise --bpf-port-max, remove the pin {pin_dir}/ekp_port_v2" in said[0].getMessage()
    attacher.reconcile(NODE, verify=True)
    attacher.reconcile(NODE, verify=True)
    assert port_entries(ports) == {lxc_b: bridge}  # still refused
    # Said once, as an error: not again on each verify, nor as an entry changed behind the agent's back.
    said = [r for r in caplog.records if r.levelno >= logging.WARNING and "ekp_port_v2" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    ports.failing = set()
    caplog.set_level(logging.INFO, logger=attach.log.name)
    attacher.reconcile(NODE, verify=True)
    assert port_entries(ports) == {lxc_a: bridge, lxc_b: bridge}
    assert f"ekp_port_v2 took ifindex {lxc_a}'s bridge ({bridge}; 0: none) at last" in caplog.text
    detach_all(netns)


@pytest.mark.kernel
def test_missing_netns_is_an_error_not_created() -> None:
    name = f"ekpt-{secrets.token_hex(3)}"
    with pytest.raises(FileNotFoundError), netns_route(name):
        pass
    assert name not in sh("ip", "netns", "list")
    assert detach_all(name) == []


@pytest.mark.kernel
def test_netns_route_forks_no_child(netns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """pyroute2's own IPRoute(netns=...) forks a child for each socket, after which every page of
    the agent's heap faults when next written (agent/netns.py): the socket is made on a thread."""

    def no_fork() -> int:
        raise AssertionError("netns_route forked a child process")

    monkeypatch.setattr(os, "fork", no_fork)
    with netns_route(netns) as ipr:
        names = {link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
    assert names == {"lo", "eth0", "peer0", "lxc-a", "pod-a", "other1", "other2"}


def xdp_of(ns: str, dev: str) -> dict[str, Any]:
    shown: list[dict[str, Any]] = json.loads(sh("ip", "-n", ns, "-j", "-d", "link", "show", "dev", dev))
    xdp_info: dict[str, Any] = shown[0].get("xdp", {})
    return xdp_info


@pytest.mark.kernel
def test_xdp_on_the_external_devices_only_reconciled_and_detached(netns: str, progs: dict[str, int]) -> None:
    """--bpf-xdp: ekp_xdp_net on the external device, not on pod devices (best-effort leaves a veth
    alone; native attaches there); off with `disabled`; removed by detach_all (agent --cleanup) and
    when the device is no longer external."""
    from lab.wire import load_xdp_pass

    fd = load_xdp_pass("ekp_xdp_net")
    try:
        with_xdp = {**progs, PROG_XDP: fd}
        # best-effort (the default) leaves a veth alone
        new_attacher(
            Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",)), with_xdp
        ).reconcile(NODE, full=True)
        assert xdp_of(netns, "eth0") == {}
        attacher = new_attacher(
            Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",), bpf_xdp="native"), with_xdp
        )
        attacher.reconcile(NODE, full=True)
        assert xdp_of(netns, "eth0").get("mode") == 1  # XDP_ATTACHED_DRV
        assert xdp_of(netns, "lxc-a") == {}
        assert list(attacher.xdp_modes.values()) == ["native"]
        # removed behind our back: a verifying reconcile puts it back, a plain one trusts its memory
        sh("ip", "-n", netns, "link", "set", "dev", "eth0", "xdp", "off")
        attacher.reconcile(NODE)
        assert xdp_of(netns, "eth0") == {}
        attacher.reconcile(NODE, verify=True)
        assert xdp_of(netns, "eth0").get("mode") == 1
        # --bpf-xdp=disabled: a restarted agent, which loads no XDP program (MapSizes.xdp), takes
        # ours off, found by name
        new_attacher(
            Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",), bpf_xdp="disabled"),
            progs,
        ).reconcile(NODE, full=True)
        assert xdp_of(netns, "eth0") == {}
        # generic, then gone with the address that made eth0 external
        generic = new_attacher(
            Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",), bpf_xdp="generic"), with_xdp
        )
        generic.reconcile(NODE, full=True)
        assert xdp_of(netns, "eth0").get("mode") == 2  # XDP_ATTACHED_SKB
        assert "eth0" in detach_all(netns)
        assert xdp_of(netns, "eth0") == {}
        generic.reconcile(NODE, full=True)
        sh("ip", "-n", netns, "addr", "del", "192.168.0.11/24", "dev", "eth0")
        generic.reconcile(NODE, full=True)
        assert xdp_of(netns, "eth0") == {}
    finally:
        os.close(fd)


@pytest.mark.kernel
def test_best_effort_without_an_xdp_program_asks_for_one_where_a_device_is_no_veth_and_tries_it_once_given(
    netns: str, progs: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    """A best-effort Attacher given no XDP program (the load left it out: every external device was
    a veth) leaves a veth as it would with one, and names an external device of another kind in
    `xdp_wanted`, found by a plain reconcile: a tap (kind "tun", whose driver takes native XDP;
    the start's read of the kinds, external_kinds, sees it as such), not a bridge (whose driver has
    none: xdp.NO_NATIVE_XDP, said); given a load's programs with XDP (`use_programs`), the full
    reconcile tries native XDP on the tap, where it runs, and asks no more."""
    from lab.wire import load_xdp_pass

    caplog.set_level(logging.INFO, logger=xdp.log.name)
    config = Config(
        netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",), devices=("eth0", "nic0", "br9")
    )
    attacher = new_attacher(config, progs)
    attacher.reconcile(NODE, full=True)
    assert attacher.xdp_wanted == {} and attacher.xdp_modes == {index_of(netns, "eth0"): ""}
    assert "eth0 is a veth: ekp_xdp_net not attached (--bpf-xdp=best-effort" in caplog.text
    assert attach.external_kinds(config, ipv6=False) == {"eth0": "veth"}
    sh("ip", "-n", netns, "tuntap", "add", "mode", "tap", "name", "nic0")
    sh("ip", "-n", netns, "link", "add", "br9", "type", "bridge")
    assert attach.external_kinds(config, ipv6=False) == {"eth0": "veth", "nic0": "tun", "br9": "bridge"}
    attacher.reconcile(NODE)
    nic0, br9 = index_of(netns, "nic0"), index_of(netns, "br9")
    assert attacher.xdp_wanted == {nic0: "nic0"}
    assert "br9: no native XDP in a bridge's driver" in caplog.text
    assert "ekp_from_net" in ingress(netns, "nic0") and xdp_of(netns, "nic0") == {}
    fd = load_xdp_pass("ekp_xdp_net")
    try:
        attacher.use_programs({**progs, PROG_XDP: fd}, FakeMap(abi.MAPS["port"]))
        attacher.reconcile(NODE, full=True)
        assert attacher.xdp_wanted == {}
        assert attacher.xdp_modes == {index_of(netns, "eth0"): "", nic0: "native", br9: ""}
        assert xdp_of(netns, "nic0").get("mode") == 1  # XDP_ATTACHED_DRV
        assert "ekp_from_net" in ingress(netns, "br9")
        assert xdp_of(netns, "eth0") == {}
    finally:
        detach_all(netns)
        os.close(fd)


@pytest.mark.parametrize("bpf_xdp", ["disabled", "native"])
def test_a_failed_xdp_detach_or_attach_is_logged_as_what_failed(
    bpf_xdp: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --bpf-xdp=disabled the Attacher has no XDP fd and only takes an earlier run's program
    off: its failure says that one still runs and how to remove it, not that an attach failed."""
    from pyroute2.netlink.exceptions import NetlinkError

    def refuse(*_args: Any) -> None:
        raise NetlinkError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(xdp, "detach", refuse)
    monkeypatch.setattr(xdp, "attach", refuse)
    fds = {} if bpf_xdp == "disabled" else {PROG_XDP: 99}
    attacher = new_attacher(Config(bpf_xdp=bpf_xdp), fds)
    attacher._xdp_on(None, 7, "eth9", check=True)
    if bpf_xdp == "disabled":
        assert (
            "cannot detach the earlier run's ekp_xdp_net from eth9: (1, 'Operation not permitted'); it "
            "still runs ahead of tc, retried every sync period; `ip link set dev eth9 xdp off` removes it"
        ) in caplog.text
        assert "cannot attach" not in caplog.text
    else:
        assert "cannot attach ekp_xdp_net to eth9 in native mode" in caplog.text
        assert "(--bpf-xdp=best-effort or generic would not fail)" in caplog.text
    assert attacher.xdp_modes == {7: ""}


@pytest.fixture(scope="module")
def newer_progs() -> Iterator[dict[str, int]]:
    """Programs of another generation, named as the real ones (their ids tell them apart)."""
    from bcc import BPF

    text = """
#include <uapi/linux/pkt_cls.h>
int ekp_from_net(struct __sk_buff *skb) { return TC_ACT_UNSPEC; }
int ekp_from_pod(struct __sk_buff *skb) { return TC_ACT_UNSPEC; }
int ekp_egress(struct __sk_buff *skb) { return TC_ACT_UNSPEC; }
"""
    bpf: Any = BPF(text=text.encode())
    names = (PROG_FROM_NET, PROG_FROM_POD, PROG_EGRESS)
    fds = {name: bpf.load_func(name.encode(), BPF.SCHED_CLS).fd for name in names}
    yield fds
    bpf.cleanup()


def ours_by_pref(text: str) -> dict[int, int]:
    """`tc filter show` of one hook -> {priority: program id} of our filters (handle 0xeb)."""
    out = {}
    for line in text.splitlines():
        found = re.search(r"pref (\d+) bpf .*handle 0xeb .*\bekp_\w+ .*\bid (\d+)", line)
        if found:
            out[int(found.group(1))] = int(found.group(2))
    return out


@pytest.mark.kernel
def test_a_hand_over_puts_the_newer_programs_in_front_then_in_the_older_ones_place(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int]
) -> None:
    """An upgrade that carries conntrack over: on every hook where the older generation's filter
    is (priority 17), the newer program goes in front of it (16) and both stay until `rehome`,
    which puts the newer program at 17 (a replace: the hook never lacks one of the newer
    programs) and removes it from 16. A hook without an older filter gets the newer program at
    17 alone. detach_all removes ours at both priorities."""
    from agent.ebpf.sockattach import prog_id

    old = {name: prog_id(fd) for name, fd in progs.items()}
    new = {name: prog_id(fd) for name, fd in newer_progs.items()}
    new_attacher(Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",)), progs).reconcile(
        NODE, full=True
    )
    newer = new_attacher(
        Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*", "other*")), newer_progs
    )
    newer.reconcile(NODE, full=True, front=True)
    assert ours_by_pref(ingress(netns, "eth0")) == {16: new[PROG_FROM_NET], 17: old[PROG_FROM_NET]}
    assert ours_by_pref(ingress(netns, "lxc-a")) == {16: new[PROG_FROM_POD], 17: old[PROG_FROM_POD]}
    for dev in ("eth0", "lxc-a"):
        assert ours_by_pref(egress(netns, dev)) == {16: new[PROG_EGRESS], 17: old[PROG_EGRESS]}, dev
    # the older generation did not serve other1: nothing to hand over from there
    assert ours_by_pref(ingress(netns, "other1")) == {17: new[PROG_FROM_POD]}
    assert ours_by_pref(egress(netns, "other1")) == {17: new[PROG_EGRESS]}
    assert len(newer.fronts) == 4

    gaps: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if new[PROG_FROM_NET] not in ours_by_pref(ingress(netns, "eth0")).values():
                gaps.append("eth0 without the newer program")
            time.sleep(0.005)

    t = threading.Thread(target=watch)
    t.start()
    try:
        newer.rehome()
    finally:
        stop.set()
        t.join()
    assert gaps == []
    assert ours_by_pref(ingress(netns, "eth0")) == {17: new[PROG_FROM_NET]}
    assert ours_by_pref(ingress(netns, "lxc-a")) == {17: new[PROG_FROM_POD]}
    for dev in ("eth0", "lxc-a", "other1"):
        assert ours_by_pref(egress(netns, dev)) == {17: new[PROG_EGRESS]}, dev
    assert newer.fronts == {}

    # cut short (an agent stopped in the middle): both priorities are ours to remove
    new_attacher(Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",)), progs).reconcile(
        NODE, full=True, front=True
    )
    assert set(ours_by_pref(ingress(netns, "eth0"))) == {16, 17}
    assert sorted(detach_all(netns)) == ["eth0", "lxc-a"]  # other1: detached as a stray by that reconcile
    for dev in ("eth0", "lxc-a", "other1"):
        assert ingress(netns, dev) == "" and egress(netns, dev) == "", dev


@pytest.mark.kernel
def test_a_hand_over_resumed_goes_in_front_only_of_an_older_build_and_a_plain_start_clears_fronts(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int]
) -> None:
    """A restarted agent of the same build resuming a hand-over: on a hook rehome already moved
    (ours at 17) it puts nothing at 16 (two copies would share one mode: in PASS both pass the
    packet on untranslated); where the older build still sits at 17 it stays in front. A full
    reconcile that does not hand over removes ours at 16 everywhere (a hand-over cut short, then
    a rollback). handover_state tells the three apart."""
    from agent.ebpf.attach import FILTER_HANDLE, FRONT_PRIO, TC_H_INGRESS, attach
    from agent.ebpf.sockattach import prog_id

    old = {name: prog_id(fd) for name, fd in progs.items()}
    new = {name: prog_id(fd) for name, fd in newer_progs.items()}
    config = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",))
    new_attacher(config, progs).reconcile(NODE, full=True)
    newer = new_attacher(config, newer_progs)
    assert newer.handover_state() == HandoverState(own_front=False, other_front=False, older_behind=True)
    newer.reconcile(NODE, full=True, front=True)
    # rehome moved eth0's ingress hook only, then the agent stopped
    with netns_route(netns) as ipr:
        index = ipr.link_lookup(ifname="eth0")[0]
        attach(ipr, index, PROG_FROM_NET, newer_progs[PROG_FROM_NET])
        ipr.tc("del-filter", "bpf", index, FILTER_HANDLE, parent=TC_H_INGRESS, prio=FRONT_PRIO)
    assert ours_by_pref(ingress(netns, "eth0")) == {17: new[PROG_FROM_NET]}

    restarted = new_attacher(config, newer_progs)
    assert restarted.handover_state() == HandoverState(own_front=True, other_front=False, older_behind=True)
    restarted.reconcile(NODE, full=True, front=True)
    assert ours_by_pref(ingress(netns, "eth0")) == {17: new[PROG_FROM_NET]}
    assert ours_by_pref(egress(netns, "eth0")) == {16: new[PROG_EGRESS], 17: old[PROG_EGRESS]}
    assert ours_by_pref(ingress(netns, "lxc-a")) == {16: new[PROG_FROM_POD], 17: old[PROG_FROM_POD]}
    assert len(restarted.fronts) == 3
    with netns_route(netns) as ipr:
        assert sorted(fronts_left(ipr, netns)) == [
            f"eth0 tc egress: clsact ekp_egress (prog {new[PROG_EGRESS]}, pref 16) in front of clsact "
            f"ekp_egress (prog {old[PROG_EGRESS]}, pref 17)",
            f"lxc-a tc egress: clsact ekp_egress (prog {new[PROG_EGRESS]}, pref 16) in front of clsact "
            f"ekp_egress (prog {old[PROG_EGRESS]}, pref 17)",
            f"lxc-a tc ingress: clsact ekp_from_pod (prog {new[PROG_FROM_POD]}, pref 16) in front of clsact "
            f"ekp_from_pod (prog {old[PROG_FROM_POD]}, pref 17)",
        ]
    # the older build seen from its side: another build of ours in front
    assert new_attacher(config, progs).handover_state() == HandoverState(
        own_front=False, other_front=True, older_behind=True
    )

    # a rollback to the older build, not a hand-over: it serves at 17 alone on every hook
    rollback = new_attacher(config, progs)
    rollback.reconcile(NODE, full=True)
    for dev, prog in (("eth0", PROG_FROM_NET), ("lxc-a", PROG_FROM_POD)):
        assert ours_by_pref(ingress(netns, dev)) == {17: old[prog]}, dev
        assert ours_by_pref(egress(netns, dev)) == {17: old[PROG_EGRESS]}, dev
    assert rollback.handover_state() == HandoverState(own_front=False, other_front=False, older_behind=False)
    with netns_route(netns) as ipr:
        assert fronts_left(ipr, netns) == []


@pytest.mark.kernel
def test_an_attach_egress_of_this_build_gets_no_copy_in_front(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int]
) -> None:
    """Legacy host routing: attach_egress puts this build's ekp_egress at 17 where the older
    generation had none; the hand-over's reconcile leaves it there alone."""
    from agent.ebpf.sockattach import prog_id

    new = {name: prog_id(fd) for name, fd in newer_progs.items()}
    config = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",))
    newer = new_attacher(config, newer_progs)
    newer.attach_egress(NODE)
    newer.reconcile(NODE, full=True, front=True)
    for dev in ("eth0", "lxc-a"):
        assert ours_by_pref(egress(netns, dev)) == {17: new[PROG_EGRESS]}, dev
    assert newer.fronts == {}


@pytest.mark.kernel
def test_a_foreign_filter_at_the_front_priority_gets_the_older_one_replaced_instead(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    """Someone else's filter at 16 (not bpf): going in front there would fail at every sync; the
    new program replaces the older one at 17, with a warning naming that filter."""
    from agent.ebpf.sockattach import prog_id

    old = {name: prog_id(fd) for name, fd in progs.items()}
    new = {name: prog_id(fd) for name, fd in newer_progs.items()}
    config = Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",))
    new_attacher(config, progs).reconcile(NODE, full=True)
    # (this machine's kernel has cls_u32 but no act_gact, matchall, flower or basic: no action)
    sh("tc", "-n", netns, "filter", "add", "dev", "eth0", "ingress", "prio", "16", "protocol", "all",
       "u32", "match", "u32", "0", "0")  # fmt: skip
    new_attacher(config, newer_progs).reconcile(NODE, full=True, front=True)
    assert ours_by_pref(ingress(netns, "eth0")) == {17: new[PROG_FROM_NET]}
    assert re.search(r"pref 16 u32", ingress(netns, "eth0")), "the foreign filter stays where it was"
    assert ours_by_pref(egress(netns, "eth0")) == {16: new[PROG_EGRESS], 17: old[PROG_EGRESS]}
    assert any("u32 on eth0 ingress sits at priority 16" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------- tcx


@pytest.fixture
def pin_dir() -> Iterator[str]:
    path = f"/sys/fs/bpf/ekpt-{secrets.token_hex(3)}"
    os.mkdir(path, 0o700)
    try:
        yield path
    finally:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)


def tcx_config(netns: str, pin_dir: str, **kw: Any) -> Config:
    return Config(netns=netns, pod_interfaces=("lxc*",), pin_path=pin_dir, bpf_tc_attach="tcx", **kw)


def index_of(ns: str, dev: str) -> int:
    with netns_route(ns) as ipr:
        return int(ipr.link_lookup(ifname=dev)[0])


def tcx_progs(ns: str, dev: str, hook: str = "ingress") -> list[str]:
    """Names of the programs on one tcx hook, in the order they run."""
    index = index_of(ns, dev)
    return [tcx.prog_name(prog) for prog, _ in run_in_netns(ns, lambda: tcx.hook_links(index, hook))]


def tcx_ids(ns: str, dev: str, hook: str = "ingress") -> list[int]:
    index = index_of(ns, dev)
    return [prog for prog, _ in run_in_netns(ns, lambda: tcx.hook_links(index, hook))]


@pytest.mark.kernel
def test_tcx_attaches_without_a_qdisc_pins_each_link_by_device_and_hook_and_follows_devices(
    netns: str, progs: dict[str, int], pin_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """--bpf-tc-attach=tcx: the programs go on through tcx links, no qdisc added (so the attach
    never stops a device's transmit queue, and the clsact line is never logged); each hook runs
    exactly one program, ours (no classid program in front of ingress: before ekp_port_v2, one
    ran there on every packet). Each link is pinned under the pin directory, named by hook,
    device and ifindex; the watcher attaches to a new pod device, and a deleted device's defunct
    links lose their pins. detach_all detaches every link of ours."""
    caplog.set_level(logging.INFO, logger="agent.ebpf.attach")
    attacher = new_attacher(tcx_config(netns, pin_dir), progs)
    attacher.reconcile(NODE, full=True)
    assert attacher.use_tcx
    for dev in ("eth0", "lxc-a"):
        assert "clsact" not in qdiscs(netns, dev) and ingress(netns, dev) == "" and egress(netns, dev) == ""
    assert tcx_progs(netns, "eth0") == [PROG_FROM_NET]
    assert tcx_progs(netns, "lxc-a") == [PROG_FROM_POD]
    assert tcx_progs(netns, "eth0", "egress") == [PROG_EGRESS] == tcx_progs(netns, "lxc-a", "egress")
    assert tcx_progs(netns, "other1") == []
    eth0, lxc_a = index_of(netns, "eth0"), index_of(netns, "lxc-a")
    assert sorted(os.listdir(pin_dir)) == sorted(
        [
            f"ekp_tcx_egress_eth0_{eth0}",
            f"ekp_tcx_ingress_eth0_{eth0}",
            f"ekp_tcx_egress_lxc-a_{lxc_a}",
            f"ekp_tcx_ingress_lxc-a_{lxc_a}",
        ]
    )
    assert not [r for r in caplog.records if "clsact" in r.getMessage()]
    # in place: a second reconcile attaches nothing; a link detached behind our back comes back
    attached = attacher.attachments
    attacher.reconcile(NODE)
    assert attacher.attachments == attached
    run_in_netns(netns, lambda: tcx.detach_ours(eth0, "ekp_from_net"))
    attacher.reconcile(NODE)
    assert attacher.attachments == attached + 1
    assert tcx_progs(netns, "eth0") == [PROG_FROM_NET]

    attacher.start_watcher()
    try:
        sh("ip", "-n", netns, "link", "add", "lxc-b", "type", "veth", "peer", "name", "pod-b")
        assert wait_for(lambda: ("lxc-b", PROG_FROM_POD) in attacher.attached.values())
        assert tcx_progs(netns, "lxc-b") == [PROG_FROM_POD]
        assert tcx_progs(netns, "lxc-b", "egress") == [PROG_EGRESS]
        lxc_b = index_of(netns, "lxc-b")
        assert f"ekp_tcx_ingress_lxc-b_{lxc_b}" in os.listdir(pin_dir)
        sh("ip", "-n", netns, "link", "del", "lxc-b")
        assert wait_for(lambda: not [n for n in os.listdir(pin_dir) if n.endswith(f"_lxc-b_{lxc_b}")])
    finally:
        attacher.stop_watcher()
    assert "clsact" not in qdiscs(netns, "lxc-a")

    assert sorted(detach_all(netns)) == ["eth0", "lxc-a"]
    for dev in ("eth0", "lxc-a"):
        assert tcx_progs(netns, dev) == [] and tcx_progs(netns, dev, "egress") == [], dev
    assert detach_all(netns) == []
    # the pins hold defunct links now: a verifying reconcile sweeps them, then attaches anew
    assert {p.live for p in tcx.pinned(pin_dir)} == {False}
    new_attacher(tcx_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    assert {p.live for p in tcx.pinned(pin_dir)} == {True} and len(os.listdir(pin_dir)) == 4
    detach_all(netns)


@pytest.mark.kernel
def test_a_tcx_restart_swaps_the_new_program_into_the_pinned_link_with_no_moment_without_one(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int], pin_dir: str
) -> None:
    """The links outlive the Attacher (the agent's exit): a restarted agent finds them pinned and
    updates them in place (BPF_LINK_UPDATE): the same link, the new program, and at no moment is
    the hook without one of ours. Restarted over the generation before ekp_port_v2 (its classid
    program first on ingress, lab/tcxold.py): the classid link goes only once the new program
    serves (the older one never runs without it), and the hook ends with ours alone."""
    from agent.ebpf.sockattach import prog_id

    new_attacher(tcx_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    eth0 = index_of(netns, "eth0")
    classid = link_classid_program(netns, pin_dir, "eth0", eth0, 0)
    before = {p.path: p.link_id for p in tcx.pinned(pin_dir) if p.path != classid}
    old = prog_id(progs[PROG_FROM_NET])
    new = {name: prog_id(fd) for name, fd in newer_progs.items()}
    classid_prog = tcx_ids(netns, "eth0")[0]
    gaps: list[list[int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            ids = tcx_ids(netns, "eth0")
            if ids not in ([classid_prog, old], [classid_prog, new[PROG_FROM_NET]], [new[PROG_FROM_NET]]):
                gaps.append(ids)

    t = threading.Thread(target=watch)
    t.start()
    try:
        new_attacher(tcx_config(netns, pin_dir), newer_progs).reconcile(NODE, full=True)
    finally:
        stop.set()
        t.join()
    assert gaps == []
    assert {p.path: p.link_id for p in tcx.pinned(pin_dir)} == before
    assert tcx_ids(netns, "eth0") == [new[PROG_FROM_NET]]
    assert tcx_ids(netns, "lxc-a", "egress") == [new[PROG_EGRESS]]
    detach_all(netns)


@pytest.mark.kernel
def test_a_tcx_hand_over_from_a_clsact_generation_runs_in_front_then_removes_its_filters(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int], pin_dir: str
) -> None:
    """Upgrade from an agent on clsact: the new tcx link runs before the older filters (tcx runs
    first; its TC_ACT_UNSPEC falls through to them), both stay until `rehome`, which deletes the
    older filters and leaves the empty clsact qdisc (a qdisc delete grafts, as an add does)."""
    from agent.ebpf.sockattach import prog_id

    old = {name: prog_id(fd) for name, fd in progs.items()}
    new = {name: prog_id(fd) for name, fd in newer_progs.items()}
    new_attacher(
        Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",), pin_path=pin_dir), progs
    ).reconcile(NODE, full=True)
    newer = new_attacher(tcx_config(netns, pin_dir), newer_progs)
    assert newer.handover_state() == HandoverState(own_front=False, other_front=False, older_behind=True)
    newer.reconcile(NODE, full=True, front=True)
    assert ours_by_pref(ingress(netns, "eth0")) == {17: old[PROG_FROM_NET]}
    assert tcx_ids(netns, "eth0") == [new[PROG_FROM_NET]]
    assert len(newer.fronts) == 4
    assert newer.handover_state() == HandoverState(own_front=True, other_front=False, older_behind=True)
    with netns_route(netns) as ipr:
        left = fronts_left(ipr, netns)
    assert len(left) == 4 and re.search(
        rf"^eth0 tc ingress: tcx ekp_from_net \(prog {new[PROG_FROM_NET]}, link \d+\) in front of clsact "
        rf"ekp_from_net \(prog {old[PROG_FROM_NET]}, pref 17\)$",
        "\n".join(left),
        re.M,
    ), left
    newer.rehome()
    assert newer.fronts == {}
    with netns_route(netns) as ipr:
        assert fronts_left(ipr, netns) == []
    for dev in ("eth0", "lxc-a"):
        assert ingress(netns, dev) == "" and egress(netns, dev) == "", dev
        assert "clsact" in qdiscs(netns, dev), dev
    assert tcx_ids(netns, "lxc-a") == [new[PROG_FROM_POD]]
    assert newer.handover_state() == HandoverState(own_front=False, other_front=False, older_behind=False)
    # a plain start of the tcx build over the clsact one removes the filters at once
    new_attacher(
        Config(netns=netns, bpf_tc_attach="clsact", pod_interfaces=("lxc*",), pin_path=pin_dir), progs
    ).reconcile(NODE, full=True)
    assert ours_by_pref(ingress(netns, "eth0")) == {17: old[PROG_FROM_NET]}
    new_attacher(tcx_config(netns, pin_dir), newer_progs).reconcile(NODE, full=True)
    assert ingress(netns, "eth0") == "" and tcx_ids(netns, "eth0") == [new[PROG_FROM_NET]]
    detach_all(netns)


@pytest.mark.kernel
def test_a_tcx_hand_over_from_a_tcx_generation_goes_right_before_its_link_then_takes_it_over(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int], pin_dir: str
) -> None:
    """Upgrade from an agent on tcx: the new program gets a link of its own right before the
    older one's (pinned as ekp_tcxfront_*); `rehome` updates the older link to the new program,
    then removes the one in front. The older generation here is the one before ekp_port_v2, with
    its classid program first on each ingress hook (lab/tcxold.py): it stays there while the older
    program runs behind ours (that program reads what it writes), and goes at the rehome."""
    from agent.ebpf.sockattach import prog_id

    old = {name: prog_id(fd) for name, fd in progs.items()}
    new = {name: prog_id(fd) for name, fd in newer_progs.items()}
    new_attacher(tcx_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    for dev in ("eth0", "lxc-a"):
        link_classid_program(netns, pin_dir, dev, index_of(netns, dev), 0)
    newer = new_attacher(tcx_config(netns, pin_dir), newer_progs)
    assert newer.handover_state() == HandoverState(own_front=False, other_front=False, older_behind=True)
    newer.reconcile(NODE, full=True, front=True)
    newer.reconcile(NODE, verify=True)  # a verifying sync during the hand-over leaves it as it is
    assert tcx_progs(netns, "eth0")[0] == tcx.CLASSID_PROG_NAME == tcx_progs(netns, "lxc-a")[0]
    assert tcx_ids(netns, "eth0")[1:] == [new[PROG_FROM_NET], old[PROG_FROM_NET]]
    assert tcx_ids(netns, "eth0", "egress") == [new[PROG_EGRESS], old[PROG_EGRESS]]
    assert any(n.startswith("ekp_tcxfront_ingress_eth0_") for n in os.listdir(pin_dir))
    assert newer.handover_state() == HandoverState(own_front=True, other_front=False, older_behind=True)
    with netns_route(netns) as ipr:
        left = fronts_left(ipr, netns)
        shown = hooks_report(ipr, netns)
    assert len(left) == 4 and re.search(
        rf"^eth0 tc ingress: tcx ekp_from_net \(prog {new[PROG_FROM_NET]}, link \d+\) in front of tcx "
        rf"ekp_from_net \(prog {old[PROG_FROM_NET]}, link \d+\)$",
        "\n".join(left),
        re.M,
    ), left
    # agent inspect hooks: the classid program, then both generations, in the kernel's order
    assert re.search(
        rf"^eth0 ingress: tcx ekp_tcx_classid \(prog \d+, link \d+\) -> tcx ekp_from_net \(prog "
        rf"{new[PROG_FROM_NET]}, link \d+\) -> tcx ekp_from_net \(prog {old[PROG_FROM_NET]}, link \d+\)$",
        "\n".join(shown),
        re.M,
    ), shown
    newer.rehome()
    with netns_route(netns) as ipr:
        assert fronts_left(ipr, netns) == []
    assert tcx_ids(netns, "eth0") == [new[PROG_FROM_NET]]
    assert tcx_ids(netns, "lxc-a") == [new[PROG_FROM_POD]]
    assert tcx_ids(netns, "lxc-a", "egress") == [new[PROG_EGRESS]]
    assert not any(n.startswith(("ekp_tcxfront_", "ekp_tcxcls_")) for n in os.listdir(pin_dir))
    assert newer.handover_state() == HandoverState(own_front=False, other_front=False, older_behind=False)
    detach_all(netns)


@pytest.mark.kernel
def test_a_tcx_verify_says_it_detached_only_from_devices_whose_links_it_took_off(
    netns: str, progs: dict[str, int], pin_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A device no longer wanted is detached and said so; one deleted since the last reconcile
    (the watcher not running, its links defunct with their pins left) loses its pins quietly: no
    "detached from" for a device that is not there."""
    caplog.set_level(logging.INFO, logger=attach.log.name)
    sh("ip", "-n", netns, "link", "add", "lxc-c", "type", "veth", "peer", "name", "pod-c")
    attacher = new_attacher(tcx_config(netns, pin_dir), progs)
    attacher.reconcile(NODE, full=True)
    lxc_a = index_of(netns, "lxc-a")
    assert tcx_progs(netns, "lxc-c") == [PROG_FROM_POD]
    sh("ip", "-n", netns, "link", "del", "lxc-a")
    sh("ip", "-n", netns, "link", "set", "lxc-c", "name", "other-c")
    attacher.reconcile(NODE, verify=True)
    assert "detached from lxc-c (no longer matches)" in caplog.text
    assert "detached from lxc-a" not in caplog.text, caplog.text
    assert tcx_progs(netns, "other-c") == []
    assert lxc_a not in attacher.attached
    assert not [p for p in tcx.pinned(pin_dir) if p.index == lxc_a]


@pytest.fixture(scope="module")
def bridge_progs() -> Iterator[tuple[dict[str, int], Any, Any]]:
    """Programs that record the bridge ekp_port_v2 names for their ingress device (map `seen`, by
    ifindex; 0: no entry), as bpf/ekp_redirect.h's ekp_port_bridge reads it, from `ports`, a map of
    ekp_port_v2's layout."""
    from bcc import BPF

    text = """
#include <uapi/linux/pkt_cls.h>
BPF_HASH(seen, u32, u32, 64);
BPF_HASH(ports, u32, u32, 64);
static inline int note(struct __sk_buff *skb) {
    u32 k = skb->ingress_ifindex, v = 0;
    u32 *bridge = ports.lookup(&k);
    if (bridge)
        v = *bridge;
    seen.update(&k, &v);
    return TC_ACT_OK;
}
int ekp_from_net(struct __sk_buff *skb) { return note(skb); }
int ekp_from_pod(struct __sk_buff *skb) { return note(skb); }
int ekp_egress(struct __sk_buff *skb) { return TC_ACT_OK; }
"""
    bpf: Any = BPF(text=text.encode())
    names = (PROG_FROM_NET, PROG_FROM_POD, PROG_EGRESS)
    fds = {name: bpf.load_func(name.encode(), BPF.SCHED_CLS).fd for name in names}
    yield fds, bpf[b"seen"], bpf[b"ports"]
    bpf.cleanup()


def send_frame(ns: str, dev: str) -> None:
    """One broadcast IPv4 frame out of `dev` (so into its veth peer's ingress)."""

    def send() -> None:
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
            s.bind((dev, 0))
            s.send(b"\xff" * 6 + b"\x02" * 6 + b"\x08\x00" + b"\x45" + b"\x00" * 19)

    run_in_netns(ns, send)


@pytest.mark.kernel
@pytest.mark.parametrize("attach", ["tcx", "clsact"])
def test_the_ingress_program_alone_on_its_hook_finds_its_bridge_in_the_port_map_with_either_attach(
    netns: str, bridge_progs: tuple[dict[str, int], Any, Any], pin_dir: str, attach: str
) -> None:
    """Each ingress hook runs exactly one program, ours, with either attach (on main tcx put a
    classid program in front of every ingress program, run on every packet, to give it the port's
    bridge in skb->tc_classid as cls_bpf's classid did). The program finds a port's bridge in
    ekp_port_v2 instead, written by the attach: the bridge's ifindex on a port, nothing elsewhere."""
    progs, seen, ports = bridge_progs
    sh("ip", "-n", netns, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", netns, "link", "set", "lxc-a", "master", "br0")
    sh("ip", "-n", netns, "link", "set", "br0", "up")
    config = Config(netns=netns, pod_interfaces=("lxc*",), pin_path=pin_dir, bpf_tc_attach=attach)
    new_attacher(config, progs, BpfMap(abi.MAPS["port"], ports.map_fd, owns_fd=False)).reconcile(
        NODE, full=True
    )
    for dev, prog in (("eth0", PROG_FROM_NET), ("lxc-a", PROG_FROM_POD)):
        assert lab_hooks.hook_programs(netns, dev) == [prog], dev
    seen.clear()
    send_frame(netns, "pod-a")
    send_frame(netns, "peer0")
    got = {int(k.value): int(v.value) for k, v in seen.items()}
    assert got == {index_of(netns, "lxc-a"): index_of(netns, "br0"), index_of(netns, "eth0"): 0}
    detach_all(netns)


class HookRecordingPorts(FakeMap):
    """ekp_port_v2 that records, at each update, the ids of the programs its port's ingress hook
    runs at that moment."""

    def __init__(self, ns: str) -> None:
        super().__init__(abi.MAPS["port"])
        self.ns = ns
        self.seen: list[tuple[int, list[int]]] = []

    def update(self, key: Any, value: Any, flags: UpdateFlag = UpdateFlag.ANY) -> None:
        index = int(key.value)
        with netns_route(self.ns) as ipr:
            self.seen.append(
                (index, [p.prog_id for p in attach.hook_programs(ipr, self.ns, index, tcx.INGRESS)])
            )
        super().update(key, value, flags)


@pytest.mark.kernel
@pytest.mark.parametrize("attach_mode", ["tcx", "clsact"])
def test_a_port_s_entry_is_written_before_its_ingress_program_is_attached_or_replaced(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int], pin_dir: str, attach_mode: str
) -> None:
    """The ingress program of a bridged pod's port drops its Service traffic as spoofed_source
    (bpf host routing) without the port's entry: so the entry is there before the program is, on
    the first attach (the hook runs nothing yet) and on a restart's (a new build's program takes
    the older one's place in the hook: still the older one's at the write)."""
    config = Config(netns=netns, bpf_tc_attach=attach_mode, pin_path=pin_dir, pod_interfaces=("lxc*",))
    sh("ip", "-n", netns, "link", "add", "cbr0", "type", "bridge")
    sh("ip", "-n", netns, "link", "set", "lxc-a", "master", "cbr0")
    lxc_a = link_index(netns, "lxc-a")
    ports = HookRecordingPorts(netns)
    new_attacher(config, progs, ports).reconcile(NODE, full=True)
    assert ports.seen == [(lxc_a, [])]
    older, newer = tcx.prog_id(progs[PROG_FROM_POD]), tcx.prog_id(newer_progs[PROG_FROM_POD])
    ports.seen.clear()
    new_attacher(config, newer_progs, ports).reconcile(NODE, full=True)  # a restart: its cache is empty
    assert ports.seen == [(lxc_a, [older])]
    with netns_route(netns) as ipr:
        assert [p.prog_id for p in attach.hook_programs(ipr, netns, lxc_a, tcx.INGRESS)] == [newer]
    detach_all(netns)


class UdpFlow:
    """Numbered UDP datagrams every `interval` s from `ns` to `dst` in another namespace, counted."""

    def __init__(self, ns: str, peer_ns: str, dst: str, interval: float = 0.001) -> None:
        self.tx = run_in_netns(ns, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        self.rx = run_in_netns(peer_ns, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        self.rx.bind((dst, 9999))
        self.rx.settimeout(0.3)
        self.dst, self.interval = dst, interval
        self.sent = 0
        self.got: set[int] = set()
        self.stop = threading.Event()

    def __enter__(self) -> UdpFlow:
        self.threads = [threading.Thread(target=self._send), threading.Thread(target=self._recv)]
        for t in self.threads:
            t.start()
        assert wait_for(lambda: len(self.got) > 10), "the flow never got through"
        return self

    def _send(self) -> None:
        while not self.stop.is_set():
            self.tx.sendto(struct.pack("!I", self.sent), (self.dst, 9999))
            self.sent += 1
            time.sleep(self.interval)

    def _recv(self) -> None:
        while True:
            try:
                self.got.add(struct.unpack("!I", self.rx.recv(64))[0])
            except TimeoutError:
                if self.stop.is_set():
                    return

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        self.tx.close()
        self.rx.close()

    @property
    def lost(self) -> int:
        return self.sent - len(self.got)


@pytest.fixture
def two_ends(netns: str) -> Iterator[str]:
    """`netns`'s eth0 (192.168.0.11) joined to peer0 in a namespace of its own (192.168.0.12)."""
    peer = f"{netns}-peer"
    sh("ip", "netns", "add", peer)
    try:
        sh("ip", "-n", netns, "link", "set", "peer0", "netns", peer)
        sh("ip", "-n", peer, "addr", "add", "192.168.0.12/24", "dev", "peer0")
        sh("ip", "-n", peer, "link", "set", "peer0", "up")
        yield peer
    finally:
        subprocess.run(["ip", "netns", "del", peer], check=False)


@pytest.mark.kernel
@pytest.mark.parametrize("attach", ["tcx", "clsact"])
def test_a_flow_out_of_a_device_loses_nothing_while_tcx_attaches_and_detaches(
    netns: str, two_ends: str, progs: dict[str, int], pin_dir: str, attach: str
) -> None:
    """A datagram every millisecond out of eth0 while the programs are attached to it and
    detached again, 15 times: with tcx none is lost (no qdisc is grafted); with clsact each add
    and delete of the qdisc stops eth0's transmit queue for an RCU grace period, and datagrams
    sent meanwhile are dropped (README "Machine facts"): the control, that this flow sees it."""
    config = Config(netns=netns, pod_interfaces=("lxc*",), pin_path=pin_dir, bpf_tc_attach=attach)
    with UdpFlow(netns, two_ends, "192.168.0.12") as flow:
        for _ in range(15):
            new_attacher(config, progs).reconcile(NODE, full=True)
            assert ("clsact" in qdiscs(netns, "eth0")) == (attach == "clsact")
            time.sleep(0.02)
            detach_all(netns)
            time.sleep(0.02)
    print(f"\n{attach}: 15 attaches and detaches, {flow.lost} of {flow.sent} datagrams lost")
    if attach == "tcx":
        assert flow.lost == 0, f"{flow.lost} of {flow.sent} lost"
    else:
        assert flow.lost > 0, f"none of {flow.sent} lost"


@pytest.mark.kernel
def test_an_agent_on_clsact_after_one_on_tcx_detaches_the_links_that_would_run_in_front(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int], pin_dir: str
) -> None:
    """--bpf-tc-attach=clsact after an agent on tcx: tcx runs before cls_bpf, so the older links
    would go on deciding every packet; each device's links go once its filters are on."""
    from agent.ebpf.sockattach import prog_id

    new_attacher(tcx_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    config = Config(netns=netns, pod_interfaces=("lxc*",), pin_path=pin_dir, bpf_tc_attach="clsact")
    new_attacher(config, newer_progs).reconcile(NODE, full=True)
    for dev in ("eth0", "lxc-a"):
        assert tcx_progs(netns, dev) == [] and tcx_progs(netns, dev, "egress") == [], dev
    assert ours_by_pref(ingress(netns, "eth0")) == {17: prog_id(newer_progs[PROG_FROM_NET])}
    assert os.listdir(pin_dir) == []
    detach_all(netns)


@pytest.mark.kernel
@pytest.mark.parametrize("attach", ["tcx", "clsact"])
def test_inspect_hooks_lists_what_each_hook_runs_with_either_attach(
    netns: str, progs: dict[str, int], pin_dir: str, attach: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`agent inspect hooks` names the programs of each device's hooks in run order, tcx links
    or clsact filters, and a filter another left behind after our tcx link (it runs after ours)."""
    from agent.ebpf.sockattach import prog_id
    from agent.inspect import main as inspect_main

    ids = {name: prog_id(fd) for name, fd in progs.items()}
    config = Config(netns=netns, pod_interfaces=("lxc*",), pin_path=pin_dir, bpf_tc_attach=attach)
    new_attacher(config, progs).reconcile(NODE, full=True)
    if attach == "tcx":
        sh("tc", "-n", netns, "qdisc", "add", "dev", "eth0", "clsact")
    sh("tc", "-n", netns, "filter", "add", "dev", "eth0", "ingress", "prio", "5", "protocol", "ip",
       "u32", "match", "ip", "dst", "1.2.3.4/32", "flowid", "1:1")  # fmt: skip
    assert inspect_main(["hooks", "--netns", netns]) == 0
    shown = capsys.readouterr().out.splitlines()
    net, egr = f"prog {ids[PROG_FROM_NET]}", f"prog {ids[PROG_EGRESS]}"
    if attach == "tcx":
        want = [
            rf"hook eth0 ingress: tcx ekp_from_net \({net}, link \d+\) -> clsact u32 \(prog 0, pref 5\)",
            rf"hook eth0 egress: tcx ekp_egress \({egr}, link \d+\)",
        ]
    else:
        want = [
            rf"hook eth0 ingress: clsact u32 \(prog 0, pref 5\) -> clsact ekp_from_net \({net}, pref 17\)",
            rf"hook eth0 egress: clsact ekp_egress \({egr}, pref 17\)",
        ]
    assert [line for line in shown if line.startswith("hook eth0 ")] == [
        next((line for line in shown if re.fullmatch(w, line)), w) for w in want
    ], shown
    assert any(line.startswith("hook lxc-a ingress: ") and "ekp_from_pod" in line for line in shown), shown
    detach_all(netns)


# ------------------------------------------------------------------------- tcx: review fixes


def clsact_config(netns: str, pin_dir: str, **kw: Any) -> Config:
    return Config(netns=netns, pod_interfaces=("lxc*",), pin_path=pin_dir, bpf_tc_attach="clsact", **kw)


@pytest.mark.kernel
def test_a_clsact_start_handing_over_from_a_tcx_generation_goes_in_front_of_its_links_until_the_rehome(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int], pin_dir: str
) -> None:
    """--bpf-tc-attach=clsact under a hand-over from an older generation on tcx: a filter of ours
    would run after the older link, and removing that link would leave the older generation's
    flows untranslated (ours returns TC_ACT_UNSPEC for them in PASS, with nothing behind). So the
    new program goes on through a tcx link right before the older one's (the older classid program
    still first) until `rehome`, which puts the filter on, then removes the older link, ours in
    front and the classid program: at no moment is the hook without the new program."""
    from agent.ebpf.sockattach import prog_id

    old = {name: prog_id(fd) for name, fd in progs.items()}
    new = {name: prog_id(fd) for name, fd in newer_progs.items()}
    new_attacher(tcx_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    for dev in ("eth0", "lxc-a"):  # the generation before ekp_port_v2 (lab/tcxold.py)
        link_classid_program(netns, pin_dir, dev, index_of(netns, dev), 0)
    newer = new_attacher(clsact_config(netns, pin_dir), newer_progs)
    assert newer.handover_state() == HandoverState(own_front=False, other_front=False, older_behind=True)
    newer.reconcile(NODE, full=True, front=True)
    for dev, prog in (("eth0", PROG_FROM_NET), ("lxc-a", PROG_FROM_POD)):
        assert tcx_progs(netns, dev)[0] == tcx.CLASSID_PROG_NAME, dev
        assert tcx_ids(netns, dev)[1:] == [new[prog], old[prog]], dev
        assert tcx_ids(netns, dev, "egress") == [new[PROG_EGRESS], old[PROG_EGRESS]], dev
        assert ours_by_pref(ingress(netns, dev)) == {} == ours_by_pref(egress(netns, dev)), dev
    assert len(newer.fronts) == 4
    assert newer.handover_state() == HandoverState(own_front=True, other_front=False, older_behind=True)

    gaps: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            ids = tcx_ids(netns, "eth0")
            filters = ours_by_pref(ingress(netns, "eth0")).values()
            if new[PROG_FROM_NET] not in ids and new[PROG_FROM_NET] not in filters:
                gaps.append(f"eth0 without the newer program: links {ids}, filters {list(filters)}")

    t = threading.Thread(target=watch)
    t.start()
    try:
        newer.rehome()
    finally:
        stop.set()
        t.join()
    assert gaps == []
    assert newer.fronts == {}
    for dev, prog in (("eth0", PROG_FROM_NET), ("lxc-a", PROG_FROM_POD)):
        assert tcx_ids(netns, dev) == [] and tcx_ids(netns, dev, "egress") == [], dev
        assert ours_by_pref(ingress(netns, dev)) == {17: new[prog]}, dev
        assert ours_by_pref(egress(netns, dev)) == {17: new[PROG_EGRESS]}, dev
    assert os.listdir(pin_dir) == []
    assert newer.handover_state() == HandoverState(own_front=False, other_front=False, older_behind=False)
    detach_all(netns)


@pytest.mark.kernel
def test_reading_the_tcx_pins_removes_only_what_holds_no_tcx_link_and_survives_pins_going_meanwhile(
    netns: str, progs: dict[str, int], pin_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tcx.pinned`: a pin that cannot be opened for a reason that says nothing about it (EMFILE)
    stays, its link serving; a pin removed between the listing and its open (another thread's
    sweep, a hand-over's rename) is skipped without an error; a pin of something that is no tcx
    link is removed."""
    from agent.ebpf import bpfsys

    new_attacher(tcx_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    eth0, lxc_a = index_of(netns, "eth0"), index_of(netns, "lxc-a")
    busy = os.path.join(pin_dir, tcx.pin_name(tcx.MAIN, tcx.INGRESS, "eth0", eth0))
    swept = os.path.join(pin_dir, tcx.pin_name(tcx.MAIN, tcx.EGRESS, "lxc-a", lxc_a))
    bogus = os.path.join(pin_dir, tcx.pin_name(tcx.MAIN, tcx.INGRESS, "nolink", 999))
    assert bpfsys.obj_pin(progs[PROG_FROM_POD], bogus) == 0
    real_obj_get = bpfsys.obj_get

    def obj_get(path: str) -> int:
        if path == busy:
            return -errno.EMFILE
        if path == swept:
            os.unlink(path)  # as the watcher's sweep would, right after the listing
            return -errno.ENOENT
        return int(real_obj_get(path))

    monkeypatch.setattr(bpfsys, "obj_get", obj_get)
    got = {os.path.basename(p.path) for p in tcx.pinned(pin_dir)}
    monkeypatch.undo()
    assert os.path.basename(busy) not in got and os.path.basename(swept) not in got
    assert os.path.exists(busy), "a pin that could not be read is left in place"
    assert tcx_progs(netns, "eth0") == [PROG_FROM_NET]
    assert not os.path.exists(bogus), "a pin of a program, not a tcx link, is removed"
    assert len(got) == 2
    detach_all(netns)


@pytest.mark.kernel
def test_a_first_full_reconcile_on_tcx_keeps_a_device_only_a_clsact_filter_made_external(
    netns: str, progs: dict[str, int], pin_dir: str
) -> None:
    """A switch from clsact to tcx, its first full reconcile before the IPv6 sync (`keep_external`):
    a device whose only node address is IPv6 carries ekp_from_net as a filter and has no pin; it
    stays external, now on tcx links, rather than being detached until the IPv6 sync."""
    sh("ip", "-n", netns, "addr", "add", "fd00:ff::11/64", "dev", "other1", "nodad")
    sh("ip", "-n", netns, "link", "set", "other1", "up")
    dual = NodeContext(node_ips=("192.168.0.11", "fd00:ff::11"))
    new_attacher(clsact_config(netns, pin_dir), progs).reconcile(dual, full=True)
    assert "ekp_from_net" in ingress(netns, "other1")
    switched = new_attacher(tcx_config(netns, pin_dir), progs)
    switched.reconcile(NODE, full=True, keep_external=True)
    assert ("other1", PROG_FROM_NET) in switched.attached.values()
    assert tcx_progs(netns, "other1") == [PROG_FROM_NET]
    assert tcx_progs(netns, "other1", "egress") == [PROG_EGRESS]
    detach_all(netns)


@pytest.mark.kernel
def test_a_device_moved_to_another_namespace_loses_our_tcx_links_and_their_pins(
    netns: str, progs: dict[str, int], pin_dir: str
) -> None:
    """`ip link set X netns other` keeps a device's tcx links (the kernel removes them when the
    device is unregistered, not moved) and its ifindex: our programs would go on running in the
    other namespace. The watcher, on the move's RTM_DELLINK, detaches them and removes their pins;
    a verifying reconcile does the same for a move it did not see."""
    other = f"{netns}-other"
    sh("ip", "netns", "add", other)
    try:
        sh("ip", "-n", netns, "link", "add", "lxc-b", "type", "veth", "peer", "name", "pod-b")
        attacher = new_attacher(tcx_config(netns, pin_dir), progs)
        attacher.reconcile(NODE, full=True)
        lxc_a, lxc_b = index_of(netns, "lxc-a"), index_of(netns, "lxc-b")
        assert len([n for n in os.listdir(pin_dir) if n.endswith(f"_{lxc_a}")]) == 2
        attacher.start_watcher()
        try:
            sh("ip", "-n", netns, "link", "set", "lxc-a", "netns", other)
            assert index_of(other, "lxc-a") == lxc_a
            assert wait_for(lambda: not [n for n in os.listdir(pin_dir) if n.endswith(f"_{lxc_a}")])
            assert run_in_netns(other, lambda: tcx.hook_links(lxc_a, "ingress")) == []
            assert run_in_netns(other, lambda: tcx.hook_links(lxc_a, "egress")) == []
        finally:
            attacher.stop_watcher()
        sh("ip", "-n", netns, "link", "set", "lxc-b", "netns", other)  # no watcher now
        attacher.reconcile(NODE, verify=True)
        assert not [n for n in os.listdir(pin_dir) if n.endswith(f"_{lxc_b}")]
        assert run_in_netns(other, lambda: tcx.hook_links(lxc_b, "ingress")) == []
        assert tcx_progs(netns, "eth0") == [PROG_FROM_NET]
        detach_all(netns)
    finally:
        subprocess.run(["ip", "netns", "del", other], check=False)


def hook_snapshots(netns: str, dev: str, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The programs on `dev`'s ingress hook after each create, update, remove and rename of a
    link (attach.py's `tcx` and its `os.rename`), recorded into the list returned."""
    snaps: list[list[str]] = []

    def after(fn: Any) -> Any:
        def wrapped(*args: Any, **kw: Any) -> Any:
            out = fn(*args, **kw)
            snaps.append(tcx_progs(netns, dev))
            return out

        return wrapped

    for name in ("create", "update", "remove"):
        monkeypatch.setattr(tcx, name, after(getattr(tcx, name)))
    monkeypatch.setattr(os, "rename", after(os.rename))
    return snaps


@pytest.mark.kernel
def test_a_tcx_link_left_in_front_by_a_hand_over_cut_short_takes_the_place_with_no_moment_without_one(
    netns: str,
    progs: dict[str, int],
    newer_progs: dict[str, int],
    pin_dir: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hand-over from tcx to tcx cut short after the rehome removed the older link (MAIN gone,
    the newer build's link in front left): the next start, another build, takes that link in front
    over, updated in place to its program and pinned as MAIN, never leaving the hook without a
    program of ours."""
    from agent.ebpf.sockattach import prog_id

    new_attacher(tcx_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    new_attacher(tcx_config(netns, pin_dir), newer_progs).reconcile(NODE, full=True, front=True)
    eth0 = index_of(netns, "eth0")
    main = tcx.find(tcx.pinned(pin_dir), tcx.MAIN, tcx.INGRESS, eth0)
    assert main is not None
    tcx.remove(main)  # the rehome's first step, then the agent stopped
    assert tcx_progs(netns, "eth0") == [PROG_FROM_NET]
    snaps = hook_snapshots(netns, "eth0", monkeypatch)
    new_attacher(tcx_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    monkeypatch.undo()
    assert snaps and all(PROG_FROM_NET in snap for snap in snaps), snaps
    assert tcx_ids(netns, "eth0") == [prog_id(progs[PROG_FROM_NET])]
    assert not any(n.startswith("ekp_tcxfront_") for n in os.listdir(pin_dir))
    assert tcx.find(tcx.pinned(pin_dir), tcx.MAIN, tcx.INGRESS, eth0) is not None
    detach_all(netns)


@pytest.mark.kernel
def test_our_tcx_links_leave_a_device_ingress_first_its_classid_program_next_egress_last(
    netns: str, progs: dict[str, int], pin_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the clsact path removes its filters: no packet translated at ingress lacks its egress
    half, and no older program of ours reads a tc_classid nobody wrote (an older generation's
    classid program, lab/tcxold.py, goes after the ingress program behind it). Both ways ours go: a
    device no longer wanted (its pins) and `detach_all` (every link of ours the hooks hold, the
    classid program counted as ours by its name)."""
    from agent.ebpf import bpfsys

    new_attacher(tcx_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    for dev in ("eth0", "lxc-a"):
        link_classid_program(netns, pin_dir, dev, index_of(netns, dev), 0)
    removed: list[tuple[str, str]] = []
    real_remove = tcx.remove

    def remove(pin: tcx.Pinned) -> None:
        if pin.device == "lxc-a":  # (eth0's classid link goes too: ours serves its ingress)
            removed.append((pin.role, pin.hook))
        real_remove(pin)

    monkeypatch.setattr(tcx, "remove", remove)
    no_pods = Config(netns=netns, pod_interfaces=("none*",), pin_path=pin_dir, bpf_tc_attach="tcx")
    new_attacher(no_pods, progs).reconcile(NODE, full=True)  # lxc-a goes
    monkeypatch.undo()
    assert removed == [(tcx.MAIN, tcx.INGRESS), (tcx.CLASSID, tcx.INGRESS), (tcx.MAIN, tcx.EGRESS)]
    link_classid_program(netns, pin_dir, "eth0", index_of(netns, "eth0"), 0)

    eth0 = index_of(netns, "eth0")
    names = {}
    for hook in (tcx.INGRESS, tcx.EGRESS):
        for prog, link in run_in_netns(netns, functools.partial(tcx.hook_links, eth0, hook)):
            names[link] = tcx.prog_name(prog)
    detached: list[str] = []
    real_by_id = bpfsys.link_get_fd_by_id

    def by_id(link_id: int) -> int:
        detached.append(names.get(link_id, "?"))
        return int(real_by_id(link_id))

    monkeypatch.setattr(bpfsys, "link_get_fd_by_id", by_id)
    detach_all(netns)
    monkeypatch.undo()
    assert detached == [PROG_FROM_NET, tcx.CLASSID_PROG_NAME, PROG_EGRESS]


def test_a_kernel_that_answers_an_empty_hook_with_enoent_has_tcx_and_no_programs_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kernels with tcx but without the fix for it answer a tcx query of a device with neither tcx
    nor clsact with ENOENT: the hook is empty, and the kernel has tcx (EINVAL says it has none)."""
    from agent.ebpf import bpfsys

    answer = [-errno.ENOENT]
    monkeypatch.setattr(bpfsys, "tcx_query", lambda *a: (answer[0], 0))
    assert tcx.hook_links(1, tcx.INGRESS) == []
    assert tcx.probe() == ""
    answer[0] = -errno.EINVAL
    assert tcx.hook_links(1, tcx.INGRESS) == []
    assert "tcx needs Linux 6.6" in tcx.probe()
    answer[0] = -errno.EPERM
    with pytest.raises(OSError):
        tcx.hook_links(1, tcx.INGRESS)


@pytest.mark.kernel
def test_a_clsact_full_reconcile_after_tcx_removes_the_links_of_devices_it_no_longer_wants_and_defunct_pins(
    netns: str, progs: dict[str, int], pin_dir: str
) -> None:
    """In clsact mode `_attach` removes the links a run on tcx left on each device it attaches;
    a full reconcile also removes those on devices it no longer wants (still running in front of
    nothing of ours) and the pins of defunct links (a device deleted while no agent ran)."""
    both = Config(netns=netns, pod_interfaces=("lxc*", "other*"), pin_path=pin_dir, bpf_tc_attach="tcx")
    new_attacher(both, progs).reconcile(NODE, full=True)
    other1 = index_of(netns, "other1")
    sh("ip", "-n", netns, "link", "del", "lxc-a")  # while no agent runs: its pins hold defunct links
    assert tcx_progs(netns, "other1") == [PROG_FROM_POD]
    new_attacher(clsact_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    assert tcx_progs(netns, "other1") == [] and tcx_progs(netns, "other1", "egress") == []
    assert not [n for n in os.listdir(pin_dir) if n.endswith(f"_{other1}")]
    assert not [n for n in os.listdir(pin_dir) if "_lxc-a_" in n], "defunct pins swept"
    assert os.listdir(pin_dir) == []
    detach_all(netns)


@pytest.mark.kernel
def test_a_tcx_attach_racing_another_thread_onto_the_same_hook_goes_on(
    netns: str, progs: dict[str, int], pin_dir: str
) -> None:
    """The watcher and a verifying reconcile may both find a hook without our link and create it:
    the kernel refuses the second (EEXIST: a program once per hook). The second reads the pins
    again and goes on rather than failing the sync."""
    attacher = new_attacher(tcx_config(netns, pin_dir), progs)
    attacher.reconcile(NODE, full=True)
    lxc_a = index_of(netns, "lxc-a")
    with netns_route(netns) as ipr:
        attacher._attach(ipr, lxc_a, "lxc-a", PROG_FROM_POD, 0, pins=[])  # what it read before the other
    assert tcx_progs(netns, "lxc-a") == [PROG_FROM_POD]
    assert len([n for n in os.listdir(pin_dir) if n.endswith(f"_{lxc_a}")]) == 2
    detach_all(netns)


@pytest.fixture(scope="module")
def third_progs() -> Iterator[dict[str, int]]:
    """A third generation's programs (`newer_progs` compiled again: other ids)."""
    from bcc import BPF

    text = """
#include <uapi/linux/pkt_cls.h>
int ekp_from_net(struct __sk_buff *skb) { return TC_ACT_UNSPEC; }
int ekp_from_pod(struct __sk_buff *skb) { return TC_ACT_UNSPEC; }
int ekp_egress(struct __sk_buff *skb) { return TC_ACT_UNSPEC; }
"""
    bpf: Any = BPF(text=text.encode())
    names = (PROG_FROM_NET, PROG_FROM_POD, PROG_EGRESS)
    fds = {name: bpf.load_func(name.encode(), BPF.SCHED_CLS).fd for name in names}
    yield fds
    bpf.cleanup()


@pytest.mark.kernel
def test_a_clsact_start_resuming_a_tcx_hand_over_from_clsact_goes_in_front_of_both_until_the_rehome(
    netns: str, progs: dict[str, int], newer_progs: dict[str, int], third_progs: dict[str, int], pin_dir: str
) -> None:
    """How review 1's case arises: an upgrade from ABI v1 (on clsact) by a build on tcx, cut short
    (its link in front of the v1 filters), then a start of a third build on clsact, still handing
    over from v1: its program goes on a tcx link before the second build's, the v1 filters behind
    all; `rehome` puts its filter in the v1 one's place, then removes every link."""
    from agent.ebpf.sockattach import prog_id

    v1 = {name: prog_id(fd) for name, fd in progs.items()}
    second = {name: prog_id(fd) for name, fd in newer_progs.items()}
    third = {name: prog_id(fd) for name, fd in third_progs.items()}
    new_attacher(clsact_config(netns, pin_dir), progs).reconcile(NODE, full=True)
    new_attacher(tcx_config(netns, pin_dir), newer_progs).reconcile(NODE, full=True, front=True)
    assert tcx_ids(netns, "eth0") == [second[PROG_FROM_NET]]
    assert ours_by_pref(ingress(netns, "eth0")) == {17: v1[PROG_FROM_NET]}
    newer = new_attacher(clsact_config(netns, pin_dir), third_progs)
    assert newer.handover_state() == HandoverState(own_front=False, other_front=True, older_behind=True)
    newer.reconcile(NODE, full=True, front=True)
    assert tcx_ids(netns, "eth0") == [third[PROG_FROM_NET], second[PROG_FROM_NET]]
    assert tcx_ids(netns, "eth0", "egress") == [third[PROG_EGRESS], second[PROG_EGRESS]]
    assert ours_by_pref(ingress(netns, "eth0")) == {17: v1[PROG_FROM_NET]}
    newer.rehome()
    for dev, prog in (("eth0", PROG_FROM_NET), ("lxc-a", PROG_FROM_POD)):
        assert tcx_ids(netns, dev) == [] and tcx_ids(netns, dev, "egress") == [], dev
        assert ours_by_pref(ingress(netns, dev)) == {17: third[prog]}, dev
        assert ours_by_pref(egress(netns, dev)) == {17: third[PROG_EGRESS]}, dev
    assert os.listdir(pin_dir) == []
    detach_all(netns)
