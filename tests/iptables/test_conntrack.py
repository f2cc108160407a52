"""Which UDP conntrack entries are stale: upstream's CleanStaleEntries selection, table-tested."""

from __future__ import annotations

import pytest

from agent.iptables.conntrack import (
    ConntrackCleaner,
    ConntrackError,
    FlowEntry,
    StaleFilter,
    parse_entries,
    stale_filters,
    udp_frontends,
)
from agent.iptables.runner import Result
from tests.iptables.objects import endpoints, service, state

DNS = [("dns", 53, "UDP")]

# kube-dns with one serving endpoint (10.244.2.3), an external IP, an LB IP and a NodePort.
STATE = state(
    service(
        "dns",
        "10.96.0.10",
        ("dns", 53, "UDP"),
        type="LoadBalancer",
        node_port=30053,
        externalIPs=["192.168.0.200"],
    )
    | {"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.53"}]}}},
    endpoints("dns", DNS, "10.244.2.3", ("10.244.2.4", "node2", {"ready": False, "serving": False})),
    service("web", "10.96.0.20", ("http", 80, "TCP")),
    endpoints("web", [("http", 80, "TCP")], "10.244.2.9"),
    service("empty", "10.96.0.30", ("dns", 53, "UDP")),
)


def entry(dst: str, dport: int, reply_src: str, reply_sport: int = 53) -> FlowEntry:
    return FlowEntry("10.244.1.5", dst, 40000, dport, reply_src, reply_sport)


def test_frontends_cover_cluster_external_lb_ips_and_node_port_of_udp_ports_only() -> None:
    f = udp_frontends(STATE)
    serving = frozenset({("10.244.2.3", 53)})
    assert dict(f.by_ip_port) == {
        ("10.96.0.10", 53): serving,
        ("192.168.0.200", 53): serving,
        ("198.51.100.53", 53): serving,
    }
    assert dict(f.by_node_port) == {30053: serving}


@pytest.mark.parametrize(
    ("flow", "expected"),
    [
        # Answered by a serving endpoint: kept.
        (entry("10.96.0.10", 53, "10.244.2.3"), []),
        # Answered by an endpoint that is gone (or not serving): cleared.
        (entry("10.96.0.10", 53, "10.244.2.2"), [StaleFilter("10.96.0.10", 53, "10.244.2.2", 53)]),
        (entry("10.96.0.10", 53, "10.244.2.4"), [StaleFilter("10.96.0.10", 53, "10.244.2.4", 53)]),
        # Right IP, wrong port of the endpoint: cleared.
        (entry("10.96.0.10", 53, "10.244.2.3", 5353), [StaleFilter("10.96.0.10", 53, "10.244.2.3", 5353)]),
        # Never DNATed (sent while the service had no endpoints): the reply source is the VIP.
        (entry("10.96.0.10", 53, "10.96.0.10"), [StaleFilter("10.96.0.10", 53, "10.96.0.10", 53)]),
        (entry("192.168.0.200", 53, "10.244.2.2"), [StaleFilter("192.168.0.200", 53, "10.244.2.2", 53)]),
        (entry("198.51.100.53", 53, "10.244.2.2"), [StaleFilter("198.51.100.53", 53, "10.244.2.2", 53)]),
        # NodePort on any address.
        (entry("192.168.0.11", 30053, "10.244.2.2"), [StaleFilter("", 30053, "10.244.2.2", 53)]),
        (entry("192.168.0.11", 30053, "10.244.2.3"), []),
        # Not a UDP frontend with endpoints: the TCP service's IP, the empty service, other ports.
        (entry("10.96.0.20", 80, "10.244.2.2"), []),
        (entry("10.96.0.30", 53, "10.96.0.30"), []),
        (entry("10.96.0.10", 54, "10.244.2.2"), []),
    ],
)
def test_stale_filters(flow: FlowEntry, expected: list[StaleFilter]) -> None:
    assert stale_filters(udp_frontends(STATE), [flow]) == expected


def test_duplicate_entries_give_one_filter() -> None:
    flows = [
        entry("10.96.0.10", 53, "10.244.2.2"),
        FlowEntry("10.244.1.6", "10.96.0.10", 1, 53, "10.244.2.2", 53),
    ]
    assert stale_filters(udp_frontends(STATE), flows) == [StaleFilter("10.96.0.10", 53, "10.244.2.2", 53)]


def test_parse_conntrack_list_output() -> None:
    text = (
        "udp      17 27 src=10.244.1.5 dst=10.96.0.10 sport=40000 dport=53 [UNREPLIED] "
        "src=10.244.2.2 dst=10.244.1.5 sport=53 dport=40000 mark=0 use=1\n"
        "udp      17 3 src=10.244.1.7 dst=10.96.0.10 sport=5000 dport=53 src=10.244.2.3 dst=10.244.1.7 "
        "sport=53 dport=5000 [ASSURED] mark=0 zone=0 use=1\n"
        "garbage line\n"
    )
    assert parse_entries(text) == [
        FlowEntry("10.244.1.5", "10.96.0.10", 40000, 53, "10.244.2.2", 53),
        FlowEntry("10.244.1.7", "10.96.0.10", 5000, 53, "10.244.2.3", 53),
    ]


def test_node_port_filter_has_no_orig_dst() -> None:
    assert StaleFilter("", 30053, "10.244.2.2", 53).delete_args() == [
        "conntrack",
        "-D",
        "-p",
        "udp",
        "-f",
        "ipv4",
        "--orig-port-dst",
        "30053",
        "--reply-src",
        "10.244.2.2",
        "--reply-port-src",
        "53",
    ]


def test_cleaner_lists_then_deletes_and_skips_listing_without_udp_services() -> None:
    calls: list[list[str]] = []

    def command(argv: object) -> Result:
        calls.append(list(argv))  # type: ignore[call-overload]
        if "-L" in calls[-1]:
            return Result(
                0,
                "udp 17 9 src=1.1.1.1 dst=10.96.0.10 sport=9 dport=53 "
                "src=10.244.9.9 dst=1.1.1.1 sport=53 dport=9\n",
            )
        return Result(1, "", "0 flow entries have been deleted.")

    applied = ConntrackCleaner(command).clean(STATE)
    assert applied == [StaleFilter("10.96.0.10", 53, "10.244.9.9", 53)]
    assert calls[0] == ["conntrack", "-L", "-p", "udp", "-f", "ipv4"]
    assert calls[1][:2] == ["conntrack", "-D"]
    calls.clear()
    assert ConntrackCleaner(command).clean(state(service("web", "10.96.0.20", ("http", 80, "TCP")))) == []
    assert calls == []


def test_cleaner_raises_when_listing_fails() -> None:
    with pytest.raises(ConntrackError):
        ConntrackCleaner(lambda argv: Result(2, "", "Operation not permitted")).clean(STATE)
