"""Addresses read as netutils.ParseIPSloppy / ParseCIDRSloppy read them, printed canonically."""

from __future__ import annotations

import ipaddress

import pytest

from agent.model.addresses import parse_cidr_sloppy, parse_ip_sloppy, special_ip_reason


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("10.96.0.10", "10.96.0.10"),
        ("172.30.0.041", "172.30.0.41"),  # decimal, not octal (041 would be 33)
        ("010.096.000.010", "10.96.0.10"),
        ("0" * 5000 + "1.2.3.4", "1.2.3.4"),  # any run of leading zeros, in linear time
        ("::ffff:10.0.0.1", "10.0.0.1"),  # IPv4-mapped is IPv4, as Go's To4() says
        ("::ffff:010.000.000.001", "10.0.0.1"),
        ("fd00::5", "fd00::5"),
        ("FD00:0:0:0:0:0:0:5", "fd00::5"),
        ("fd00::00005", "fd00::5"),  # Go allows leading zeros in a hex group
        ("2001:db8::1.2.3.4", "2001:db8::102:304"),
    ],
)
def test_accepted_and_canonical(text: str, canonical: str) -> None:
    ip = parse_ip_sloppy(text)
    assert ip is not None and str(ip) == canonical


@pytest.mark.parametrize(
    "text",
    [
        "",
        "10.96.0",
        "10.96.0.10.1",
        "10.96.0.256",
        "10.96.0.-1",
        "10.96.0.1 ",
        " 10.96.0.1",
        "10.96.0.1\n",
        "10.96..1",
        "1.2.3.٣",  # a non-ASCII digit
        "1_0.0.0.1",
        "0x0a.0.0.1",
        "fe80::1%eth0",  # zones are not part of Kubernetes addresses
        "fd00::1::2",
        "fd00::10000",
        "1.2.3.4::",
        "::1.2.3.4:5",
        "None",
        "example.com",
    ],
)
def test_refused(text: str) -> None:
    assert parse_ip_sloppy(text) is None


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("198.51.100.0/24", "198.51.100.0/24"),
        ("198.51.100.7/24", "198.51.100.0/24"),  # host bits dropped, as kube-proxy's *net.IPNet
        ("010.0.0.0/08", "10.0.0.0/8"),
        ("0.0.0.0/0", "0.0.0.0/0"),
        ("fd00::1/64", "fd00::/64"),
    ],
)
def test_cidr_accepted(text: str, canonical: str) -> None:
    net = parse_cidr_sloppy(text)
    assert net is not None and str(net) == canonical


@pytest.mark.parametrize(
    "text", ["198.51.100.0", "198.51.100.0/33", "198.51.100.0/", "x/24", "fd00::/129", "1.2.3.4/2 4"]
)
def test_cidr_refused(text: str) -> None:
    assert parse_cidr_sloppy(text) is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("127.0.0.53", "loopback"),
        ("::1", "loopback"),
        ("169.254.169.254", "link-local range"),
        ("fe80::1", "link-local range"),
        ("224.0.0.251", "link-local multicast"),
        ("ff02::1", "link-local multicast"),
        ("10.0.0.1", None),
        ("224.0.1.1", None),  # global multicast: allowed, as upstream (probably by accident)
    ],
)
def test_special_addresses(text: str, reason: str | None) -> None:
    ip = ipaddress.ip_address(text)
    got = special_ip_reason(ip)
    assert (got is None) if reason is None else (got is not None and reason in got)
