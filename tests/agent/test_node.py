"""node: the node's addresses from the namespace's interfaces."""

from __future__ import annotations

from agent.cli import resolve
from agent.config import NodeContext
from agent.node import AddrInfo, pick_node_addresses, pod_device_patterns

ADDRS = [
    AddrInfo(1, "lo", "127.0.0.1", scope=254),
    AddrInfo(2, "eth0", "10.0.0.11"),
    AddrInfo(3, "eth1", "192.168.0.11"),
    AddrInfo(3, "eth1", "192.168.0.99"),
    AddrInfo(4, "lxc-a", "10.244.1.1"),
    AddrInfo(5, "eth2", "169.254.0.1", scope=253),
]


def test_devices_given_in_order() -> None:
    assert pick_node_addresses(ADDRS, ("eth1", "eth0"), ("lxc*",)) == NodeContext(
        ("192.168.0.11", "192.168.0.99", "10.0.0.11"), "192.168.0.11"
    )


def test_default_route_device_first_pods_and_loopback_left_out() -> None:
    got = pick_node_addresses(ADDRS, (), ("lxc*",), default_route_indexes=(3,))
    assert got == NodeContext(("192.168.0.11", "192.168.0.99", "10.0.0.11"), "192.168.0.11")
    assert pick_node_addresses(ADDRS, (), ("lxc*",)).primary_ip == "10.0.0.11"


def test_nothing_found() -> None:
    assert pick_node_addresses(ADDRS, ("eth9",), ()) == NodeContext((), "")


def test_the_detectors_bridge_and_prefix_devices_are_pod_devices_not_node_addresses() -> None:
    addrs = [
        AddrInfo(2, "eth0", "192.168.0.11"),
        AddrInfo(3, "cni0", "10.244.1.1"),
        AddrInfo(4, "eni9", "10.0.5.5"),
    ]

    def picked(*flags: str) -> tuple[str, ...]:
        config = resolve(list(flags)).config
        return pick_node_addresses(addrs, (), pod_device_patterns(config)).node_ips

    assert picked() == ("192.168.0.11", "10.244.1.1", "10.0.5.5")
    assert picked("--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cni0") == (
        "192.168.0.11",
        "10.0.5.5",
    )
    assert picked("--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix=eni") == (
        "192.168.0.11",
        "10.244.1.1",
    )
