"""The node's addresses through netlink: an address or link change on a node device notifies the
agent at once, one on a pod device does not; the thread stops when told."""

from __future__ import annotations

import secrets
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from agent.config import Config, Mode
from agent.nodewatch import AddressWatcher

pytestmark = pytest.mark.kernel


def ip(ns: str, *argv: str) -> None:
    subprocess.run(["ip", "-n", ns, *argv], check=True, capture_output=True)


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"ekpw-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        ip(name, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0")
        ip(name, "link", "add", "lxc-a", "type", "veth", "peer", "name", "lxc-ap")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


class Notes:
    def __init__(self) -> None:
        self.count = 0
        self.event = threading.Event()

    def __call__(self) -> None:
        self.count += 1
        self.event.set()

    def wait(self, timeout: float) -> bool:
        ok = self.event.wait(timeout)
        self.event.clear()
        return ok


def test_node_address_changes_notify_and_pod_device_changes_do_not(netns: str) -> None:
    watcher = AddressWatcher(Config(netns=netns, pod_interfaces=("lxc*",)))
    notes = Notes()
    watcher.start(notes)
    try:
        ip(netns, "addr", "add", "10.244.1.1/32", "dev", "lxc-a")
        ip(netns, "link", "set", "lxc-a", "up")
        ip(netns, "link", "add", "lxc-b", "type", "veth", "peer", "name", "lxc-bp")
        assert not notes.wait(0.5), "pod devices are not node addresses"
        start = time.monotonic()
        ip(netns, "addr", "add", "192.168.0.211/24", "dev", "eth0")
        assert notes.wait(1.0), "an address added on a node device"
        assert time.monotonic() - start < 1.0
        ip(netns, "addr", "del", "192.168.0.211/24", "dev", "eth0")
        assert notes.wait(1.0), "an address removed"
        ip(netns, "link", "set", "eth0", "up")
        assert notes.wait(1.0), "a node device's link changed"
    finally:
        watcher.stop()
    count = notes.count
    ip(netns, "addr", "add", "192.168.0.212/24", "dev", "eth0")
    time.sleep(0.3)  # a notification a stopped watcher would still send arrives well within this
    assert notes.count == count, "stopped"


@pytest.mark.parametrize("mode", [Mode.EBPF, Mode.IPTABLES])
def test_ipv6_node_addresses_notify_when_an_ipv6_proxier_runs(netns: str, mode: Mode) -> None:
    """With IPv6 configured (either mode: eBPF mode's IPv6 proxier is ip6tables), a global IPv6
    address added on a node device notifies; a link-local one (every device gets one, pod
    devices included) does not."""
    config = Config(mode=mode, netns=netns, pod_interfaces=("lxc*",), cluster_cidr=("fd00:10:244::/56",))
    watcher = AddressWatcher(config)
    notes = Notes()
    watcher.start(notes)
    try:
        ip(netns, "addr", "add", "fe80::99/64", "dev", "lxc-a", "nodad")
        assert not notes.wait(0.5), "a link-local address is no node address"
        ip(netns, "addr", "add", "fd00:192:168::211/64", "dev", "eth0", "nodad")
        assert notes.wait(1.0), "an IPv6 address added on a node device"
    finally:
        watcher.stop()
    ipv4_only = AddressWatcher(Config(mode=mode, netns=netns, pod_interfaces=("lxc*",)))
    notes = Notes()
    ipv4_only.start(notes)
    try:
        ip(netns, "addr", "add", "fd00:192:168::212/64", "dev", "eth0", "nodad")
        assert not notes.wait(0.5), "no IPv6 proxier: IPv6 addresses are not followed"
    finally:
        ipv4_only.stop()


def test_the_discovered_ipv6_primary_address_skips_a_deprecated_one(netns: str) -> None:
    """discover_node reads each address's IFA flags from the kernel: an address given with
    preferred_lft 0 (deprecated) listed first on the device is a node address, not the primary
    one (the IPv6 SNAT source); the stable one after it is."""
    from agent.node import discover_node

    ip(netns, "link", "set", "eth0", "up")
    # the kernel lists a device's IPv6 addresses newest first: the deprecated one is added last
    ip(netns, "-6", "addr", "add", "fd00:77::10/64", "dev", "eth0", "nodad")
    ip(netns, "-6", "addr", "add", "fd00:77::8/64", "dev", "eth0", "nodad", "preferred_lft", "0")
    node = discover_node(Config(mode=Mode.EBPF, netns=netns, devices=("eth0",)), 6)
    assert node.node_ips == ("fd00:77::8", "fd00:77::10")
    assert node.primary_ip == "fd00:77::10"
