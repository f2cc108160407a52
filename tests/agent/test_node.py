"""node: the node's addresses from the namespace's interfaces."""

from __future__ import annotations

from agent.cli import resolve
from agent.config import NodeContext
from agent.node import (
    IFA_F_DEPRECATED,
    IFA_F_TEMPORARY,
    IFA_F_TENTATIVE,
    TCP_LISTEN,
    UDP_UNCONNECTED,
    AddrInfo,
    parse_proc_net,
    pick_node_addresses,
    pod_device_patterns,
)

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


def test_the_ipv6_primary_address_skips_temporary_deprecated_and_tentative_ones() -> None:
    """The primary address is the IPv6 SNAT source (ekp_cfg6): a privacy address rotates away, a
    deprecated one is going, a tentative one sends nothing. The first stable one is primary; with
    none, a temporary or deprecated one; never a tentative one. Every one is still a node address.
    IPv4's bit 0x01 (a secondary address) changes nothing."""
    addrs = [
        AddrInfo(2, "eth0", "fd00::7", flags=IFA_F_TEMPORARY),
        AddrInfo(2, "eth0", "fd00::8", flags=IFA_F_DEPRECATED),
        AddrInfo(2, "eth0", "fd00::9", flags=IFA_F_TENTATIVE),
        AddrInfo(2, "eth0", "fd00::10", flags=0x80),  # IFA_F_PERMANENT: stable
    ]
    got = pick_node_addresses(addrs, ("eth0",), ())
    assert got == NodeContext(("fd00::7", "fd00::8", "fd00::9", "fd00::10"), "fd00::10")
    assert pick_node_addresses(addrs[:3], ("eth0",), ()).primary_ip == "fd00::7"
    assert pick_node_addresses(addrs[1:3], ("eth0",), ()).primary_ip == "fd00::8"
    assert pick_node_addresses(addrs[2:3], ("eth0",), ()).primary_ip == ""
    secondary = [AddrInfo(2, "eth0", "10.0.0.11", flags=0x01), AddrInfo(2, "eth0", "10.0.0.12")]
    assert pick_node_addresses(secondary, ("eth0",), ()).primary_ip == "10.0.0.11"


def test_listening_sockets_read_from_proc_net() -> None:
    tcp = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "   0: 0A00600A:0035 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0\n"
        "   1: 0B00A8C0:0016 6400A8C0:D431 01 00000000:00000000 00:00000000 00000000     0\n"
    )
    udp = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "  10: 0A00600A:0035 00000000:0000 07 00000000:00000000 00:00000000 00000000     0\n"
        "  11: 0A00600A:9C40 0B00A8C0:0035 01 00000000:00000000 00:00000000 00000000     0\n"
    )
    assert parse_proc_net(tcp, 6, TCP_LISTEN) == {("10.96.0.10", 53, 6)}
    assert parse_proc_net(udp, 17, UDP_UNCONNECTED) == {("10.96.0.10", 53, 17)}


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
