"""kube-proxy's own iptables tests as our specification (pkg/proxy/iptables/proxier_test.go).

Each test is named after the upstream test function it ports and compares our iptables-restore
text with upstream's expected text, transcribed here, after upstream's own normalisation
(`sort_rules`, since upstream's service order is random). The facts upstream's fake proxier assumes
are in tests/iptables/upstream.py. Where our output is meant to differ from upstream's, the test
says so and why.

Upstream tests that state behaviour as packet traces rather than rule text (TestClusterIPGeneral,
TestLoadBalancer, TestExternalTrafficPolicy*, TestInternalTrafficPolicy, ...) are covered by the
golden files and the lab traffic tests, not ported here.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from agent.config import Mode, NodeContext
from agent.iptables.proxier import IptablesProxier
from agent.iptables.rules import render
from agent.metrics import Metrics
from agent.model import IPFamily, NodeInfo, ProxyState, build_state
from agent.model.types import Protocol, ServicePortName
from tests.iptables.fakes import FakeCounters, FakeRunner
from tests.iptables.upstream import (
    FAKE_CONFIG,
    FAKE_NODE,
    FAKE_NODE6,
    FAKE_OPTIONS,
    FAKE_OPTIONS6,
    NODE_NAME,
    Obj,
    chain_rules,
    check_rule_jumps,
    dedent,
    eps,
    fake_mark,
    lb_status,
    port,
    sort_rules,
    svc,
)

P80 = [("p80", 80, "TCP")]


def build(*objects: Obj, family: IPFamily = IPFamily.IPv4) -> ProxyState:
    result = build_state(
        [o for o in objects if o["kind"] == "Service"],
        [o for o in objects if o["kind"] == "EndpointSlice"],
        NodeInfo(NODE_NAME),
        family=family,
    )
    assert not result.problems, result.problems
    return result.state


def assert_rules_equal(expected: str, result: str, *, consistent: bool = True) -> None:
    """upstream assertIPTablesRulesEqual."""
    assert sort_rules(result) == dedent(expected)
    if consistent:
        check_rule_jumps(dedent(expected))


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def fake_proxier(**config: object) -> tuple[IptablesProxier, FakeRunner, Clock]:
    """upstream NewFakeProxier: its facts, our proxier on the fake iptables."""
    fake = FakeRunner()
    fake.iptables_version = (1, 6, 1)  # upstream's fake iptables has no --random-fully
    clock = Clock()
    proxier = IptablesProxier(
        replace(FAKE_CONFIG, **config),  # type: ignore[arg-type]
        runner=fake,
        counters=FakeCounters(),
        clock=clock,
    )
    return proxier, fake, clock


def last_restore(fake: FakeRunner) -> str:
    return fake_mark(fake.restores[-1])


def nat_rule_count(text: str) -> int:
    nat = dedent(text).split("*nat\n", 1)[1]
    return sum(1 for line in nat.splitlines() if line.startswith("-A "))


# ------------------------------------------------------------------------ TestOverallIPTablesRules

OVERALL_OBJECTS = [
    svc("ns1", "svc1", port("p80", 80), clusterIP="172.30.0.41"),
    svc(
        "ns2",
        "svc2",
        port("p80", 80, nodePort=3001),
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        clusterIP="172.30.0.42",
        externalIPs=["192.168.99.22"],
        healthCheckNodePort=30000,
        status=lb_status("1.2.3.4"),
    ),
    svc("ns3", "svc3", port("p80", 80, nodePort=3003), type="NodePort", clusterIP="172.30.0.43"),
    svc(
        "ns4",
        "svc4",
        port("p80", 80, targetPort=80),
        type="NodePort",
        clusterIP="172.30.0.44",
        externalIPs=["192.168.99.33"],
    ),
    svc(
        "ns5",
        "svc5",
        port("p80", 80, nodePort=3002),
        type="LoadBalancer",
        externalTrafficPolicy="Cluster",
        clusterIP="172.30.0.45",
        healthCheckNodePort=30000,
        # Extra whitespace: upstream keeps it working, for backward compatibility.
        loadBalancerSourceRanges=[" 203.0.113.0/25"],
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 10800}},
        status=lb_status("5.6.7.8"),
    ),
    svc("ns6", "svc6", port("p80", 80, targetPort=80), type="ClusterIP", clusterIP="172.30.0.46"),
    eps("ns1", "svc1", P80, "10.180.0.1"),
    # No nodeName: non-local, so svc2 (Local policy) has no local endpoints.
    eps("ns2", "svc2", P80, "10.180.0.2"),
    eps("ns3", "svc3", P80, "10.180.0.3"),
    eps("ns4", "svc4", P80, "10.180.0.4", ("10.180.0.5", NODE_NAME)),
    eps("ns5", "svc5", P80, "10.180.0.3"),
]

OVERALL_EXPECTED = """
    *filter
    :KUBE-NODEPORTS - [0:0]
    :KUBE-SERVICES - [0:0]
    :KUBE-EXTERNAL-SERVICES - [0:0]
    :KUBE-FIREWALL - [0:0]
    :KUBE-FORWARD - [0:0]
    :KUBE-PROXY-FIREWALL - [0:0]
    -A KUBE-NODEPORTS -m comment --comment "ns2/svc2:p80 health check node port" -m tcp -p tcp --dport 30000 -j ACCEPT
    -A KUBE-SERVICES -m comment --comment "ns6/svc6:p80 has no endpoints" -m tcp -p tcp -d 172.30.0.46 --dport 80 -j REJECT
    -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m tcp -p tcp -d 192.168.99.22 --dport 80 -j DROP
    -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m tcp -p tcp -d 1.2.3.4 --dport 80 -j DROP
    -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3001 -j DROP
    -A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
    -A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP
    -A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
    -A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
    -A KUBE-PROXY-FIREWALL -m comment --comment "ns5/svc5:p80 traffic not accepted by KUBE-FW-NUKIZ6OKUXPJNT4C" -m tcp -p tcp -d 5.6.7.8 --dport 80 -j DROP
    COMMIT
    *nat
    :KUBE-NODEPORTS - [0:0]
    :KUBE-SERVICES - [0:0]
    :KUBE-EXT-4SW47YFZTEDKD3PK - [0:0]
    :KUBE-EXT-GNZBNJ2PO5MGZ6GT - [0:0]
    :KUBE-EXT-NUKIZ6OKUXPJNT4C - [0:0]
    :KUBE-EXT-X27LE4BHSL4DOUIK - [0:0]
    :KUBE-FW-NUKIZ6OKUXPJNT4C - [0:0]
    :KUBE-MARK-MASQ - [0:0]
    :KUBE-POSTROUTING - [0:0]
    :KUBE-SEP-C6EBXVWJJZMIWKLZ - [0:0]
    :KUBE-SEP-I77PXRDZVX7PMWMN - [0:0]
    :KUBE-SEP-OYPFS5VJICHGATKP - [0:0]
    :KUBE-SEP-RS4RBKLTHTF2IUXJ - [0:0]
    :KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
    :KUBE-SEP-UKSFD7AGPMPPLUHC - [0:0]
    :KUBE-SVC-4SW47YFZTEDKD3PK - [0:0]
    :KUBE-SVC-GNZBNJ2PO5MGZ6GT - [0:0]
    :KUBE-SVC-NUKIZ6OKUXPJNT4C - [0:0]
    :KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
    :KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
    -A KUBE-NODEPORTS -m comment --comment ns2/svc2:p80 -m tcp -p tcp -d 127.0.0.0/8 --dport 3001 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
    -A KUBE-NODEPORTS -m comment --comment ns2/svc2:p80 -m tcp -p tcp --dport 3001 -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
    -A KUBE-NODEPORTS -m comment --comment ns3/svc3:p80 -m tcp -p tcp -d 127.0.0.0/8 --dport 3003 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-X27LE4BHSL4DOUIK
    -A KUBE-NODEPORTS -m comment --comment ns3/svc3:p80 -m tcp -p tcp --dport 3003 -j KUBE-EXT-X27LE4BHSL4DOUIK
    -A KUBE-NODEPORTS -m comment --comment ns5/svc5:p80 -m tcp -p tcp -d 127.0.0.0/8 --dport 3002 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-NUKIZ6OKUXPJNT4C
    -A KUBE-NODEPORTS -m comment --comment ns5/svc5:p80 -m tcp -p tcp --dport 3002 -j KUBE-EXT-NUKIZ6OKUXPJNT4C
    -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
    -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 cluster IP" -m tcp -p tcp -d 172.30.0.42 --dport 80 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
    -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 external IP" -m tcp -p tcp -d 192.168.99.22 --dport 80 -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
    -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 loadbalancer IP" -m tcp -p tcp -d 1.2.3.4 --dport 80 -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
    -A KUBE-SERVICES -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
    -A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 172.30.0.44 --dport 80 -j KUBE-SVC-4SW47YFZTEDKD3PK
    -A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 external IP" -m tcp -p tcp -d 192.168.99.33 --dport 80 -j KUBE-EXT-4SW47YFZTEDKD3PK
    -A KUBE-SERVICES -m comment --comment "ns5/svc5:p80 cluster IP" -m tcp -p tcp -d 172.30.0.45 --dport 80 -j KUBE-SVC-NUKIZ6OKUXPJNT4C
    -A KUBE-SERVICES -m comment --comment "ns5/svc5:p80 loadbalancer IP" -m tcp -p tcp -d 5.6.7.8 --dport 80 -j KUBE-FW-NUKIZ6OKUXPJNT4C
    -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
    -A KUBE-EXT-4SW47YFZTEDKD3PK -m comment --comment "masquerade traffic for ns4/svc4:p80 external destinations" -j KUBE-MARK-MASQ
    -A KUBE-EXT-4SW47YFZTEDKD3PK -j KUBE-SVC-4SW47YFZTEDKD3PK
    -A KUBE-EXT-GNZBNJ2PO5MGZ6GT -m comment --comment "pod traffic for ns2/svc2:p80 external destinations" -s 10.0.0.0/8 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
    -A KUBE-EXT-GNZBNJ2PO5MGZ6GT -m comment --comment "masquerade LOCAL traffic for ns2/svc2:p80 external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
    -A KUBE-EXT-GNZBNJ2PO5MGZ6GT -m comment --comment "route LOCAL traffic for ns2/svc2:p80 external destinations" -m addrtype --src-type LOCAL -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
    -A KUBE-EXT-NUKIZ6OKUXPJNT4C -m comment --comment "masquerade traffic for ns5/svc5:p80 external destinations" -j KUBE-MARK-MASQ
    -A KUBE-EXT-NUKIZ6OKUXPJNT4C -j KUBE-SVC-NUKIZ6OKUXPJNT4C
    -A KUBE-EXT-X27LE4BHSL4DOUIK -m comment --comment "masquerade traffic for ns3/svc3:p80 external destinations" -j KUBE-MARK-MASQ
    -A KUBE-EXT-X27LE4BHSL4DOUIK -j KUBE-SVC-X27LE4BHSL4DOUIK
    -A KUBE-FW-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 loadbalancer IP" -s 203.0.113.0/25 -j KUBE-EXT-NUKIZ6OKUXPJNT4C
    -A KUBE-FW-NUKIZ6OKUXPJNT4C -m comment --comment "other traffic to ns5/svc5:p80 will be dropped by KUBE-PROXY-FIREWALL"
    -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
    -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
    -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
    -A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE
    -A KUBE-SEP-C6EBXVWJJZMIWKLZ -m comment --comment ns4/svc4:p80 -s 10.180.0.5 -j KUBE-MARK-MASQ
    -A KUBE-SEP-C6EBXVWJJZMIWKLZ -m comment --comment ns4/svc4:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.5:80
    -A KUBE-SEP-I77PXRDZVX7PMWMN -m comment --comment ns5/svc5:p80 -s 10.180.0.3 -j KUBE-MARK-MASQ
    -A KUBE-SEP-I77PXRDZVX7PMWMN -m comment --comment ns5/svc5:p80 -m recent --name KUBE-SEP-I77PXRDZVX7PMWMN --set -m tcp -p tcp -j DNAT --to-destination 10.180.0.3:80
    -A KUBE-SEP-OYPFS5VJICHGATKP -m comment --comment ns3/svc3:p80 -s 10.180.0.3 -j KUBE-MARK-MASQ
    -A KUBE-SEP-OYPFS5VJICHGATKP -m comment --comment ns3/svc3:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.3:80
    -A KUBE-SEP-RS4RBKLTHTF2IUXJ -m comment --comment ns2/svc2:p80 -s 10.180.0.2 -j KUBE-MARK-MASQ
    -A KUBE-SEP-RS4RBKLTHTF2IUXJ -m comment --comment ns2/svc2:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.2:80
    -A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -s 10.180.0.1 -j KUBE-MARK-MASQ
    -A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80
    -A KUBE-SEP-UKSFD7AGPMPPLUHC -m comment --comment ns4/svc4:p80 -s 10.180.0.4 -j KUBE-MARK-MASQ
    -A KUBE-SEP-UKSFD7AGPMPPLUHC -m comment --comment ns4/svc4:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.4:80
    -A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 172.30.0.44 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
    -A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 -> 10.180.0.4:80" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-UKSFD7AGPMPPLUHC
    -A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 -> 10.180.0.5:80" -j KUBE-SEP-C6EBXVWJJZMIWKLZ
    -A KUBE-SVC-GNZBNJ2PO5MGZ6GT -m comment --comment "ns2/svc2:p80 cluster IP" -m tcp -p tcp -d 172.30.0.42 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
    -A KUBE-SVC-GNZBNJ2PO5MGZ6GT -m comment --comment "ns2/svc2:p80 -> 10.180.0.2:80" -j KUBE-SEP-RS4RBKLTHTF2IUXJ
    -A KUBE-SVC-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 cluster IP" -m tcp -p tcp -d 172.30.0.45 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
    -A KUBE-SVC-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 -> 10.180.0.3:80" -m recent --name KUBE-SEP-I77PXRDZVX7PMWMN --rcheck --seconds 10800 --reap -j KUBE-SEP-I77PXRDZVX7PMWMN
    -A KUBE-SVC-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 -> 10.180.0.3:80" -j KUBE-SEP-I77PXRDZVX7PMWMN
    -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
    -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 -> 10.180.0.3:80" -j KUBE-SEP-OYPFS5VJICHGATKP
    -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
    -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.1:80" -j KUBE-SEP-SXIVWICOYRO3J4NJ
    COMMIT
    """  # noqa: E501


def test_overall_iptables_rules_with_multiple_services() -> None:
    """TestOverallIPTablesRules: a variety of services, the whole ruleset exactly."""
    rendered = render(build(*OVERALL_OBJECTS), FAKE_NODE, FAKE_OPTIONS)
    assert_rules_equal(OVERALL_EXPECTED, rendered.text)
    # upstream also checks the rules metric against the text.
    assert rendered.nat_rules_total == nat_rule_count(OVERALL_EXPECTED)


def test_overall_iptables_rules_through_the_proxier() -> None:
    """TestOverallIPTablesRules again, as the first sync of our proxier writes it."""
    p, fake, _ = fake_proxier()
    p.sync(build(*OVERALL_OBJECTS), FAKE_NODE)
    assert_rules_equal(OVERALL_EXPECTED, last_restore(fake))


# ------------------------------------------------------------------------------------ TestBadIPs


def test_bad_ips() -> None:
    """TestBadIPs (kubernetes PR #126203): IPs with leading zeros, kept in the API from before
    stricter validation, are read as decimal and written canonical."""
    objects = [
        svc(
            "ns1",
            "svc1",
            port("p80", 80, nodePort=3001),
            type="LoadBalancer",
            clusterIP="172.30.0.041",
            externalIPs=["192.168.099.022"],
            loadBalancerSourceRanges=["203.0.113.000/025"],
            status=lb_status("1.2.3.004"),
        ),
        eps("ns1", "svc1", P80, "10.180.00.001"),
    ]
    text = render(build(*objects), FAKE_NODE, FAKE_OPTIONS).text
    nat = text.split("*nat\n", 1)[1]
    assert (
        '-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 '
        "--dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O" in nat
    )
    assert (
        '-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 external IP" -m tcp -p tcp -d 192.168.99.22 '
        "--dport 80 -j KUBE-EXT-XPGD46QRK7WJZT7O" in nat
    )
    assert (
        '-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 loadbalancer IP" -m tcp -p tcp -d 1.2.3.4 '
        "--dport 80 -j KUBE-FW-XPGD46QRK7WJZT7O" in nat
    )
    assert (
        '-A KUBE-FW-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 loadbalancer IP" -s 203.0.113.0/25 '
        "-j KUBE-EXT-XPGD46QRK7WJZT7O" in nat
    )
    assert (
        "-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT "
        "--to-destination 10.180.0.1:80" in nat
    )
    assert "0.04" not in text and "099" not in text and ".00" not in text


# ------------------------------------------------------------------------------- TestNoEndpointsReject


def test_no_endpoints_reject() -> None:
    """TestNoEndpointsReject: a service without endpoints rejects on its cluster IP, external IP,
    NodePort and load-balancer IP (upstream traces packets to REJECT; these are the rules)."""
    objects = [
        svc(
            "ns1",
            "svc1",
            port("p80", 80, nodePort=3001),
            type="LoadBalancer",
            clusterIP="172.30.0.41",
            externalIPs=["192.168.99.11"],
            status=lb_status("1.2.3.4"),
        )
    ]
    text = render(build(*objects), FAKE_NODE, FAKE_OPTIONS).text
    rejects = chain_rules(text, "filter", "KUBE-SERVICES") + chain_rules(
        text, "filter", "KUBE-EXTERNAL-SERVICES"
    )
    assert rejects == dedent(
        """
        -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 has no endpoints" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j REJECT
        -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/svc1:p80 has no endpoints" -m tcp -p tcp -d 192.168.99.11 --dport 80 -j REJECT
        -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/svc1:p80 has no endpoints" -m tcp -p tcp -d 1.2.3.4 --dport 80 -j REJECT
        -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/svc1:p80 has no endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3001 -j REJECT
        """  # noqa: E501
    )
    assert "KUBE-SVC-" not in text and "KUBE-SEP-" not in text


# ------------------------------------------------------------------------------------- TestNodePorts

NODEPORT_OBJECTS = [
    svc("ns1", "svc1", port("p80", 80, nodePort=3001), type="NodePort", clusterIP="172.30.0.41"),
    eps("ns1", "svc1", P80, "10.180.0.1", ("10.180.2.1", NODE_NAME)),
]
FIREWALL_RULE = (
    '-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 '
    "! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n"
)
TAIL = (
    '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; '
    'NOTE: this must be the last rule in this chain"'
)


@pytest.mark.parametrize(
    ("localhost", "addresses", "tail", "firewall"),
    [
        # "ipv4, localhost-nodeports enabled"
        (True, (), [f"{TAIL} -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"], True),
        # "ipv4, localhost-nodeports disabled": localhost to a NodePort is not translated
        (False, (), [f"{TAIL} -m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS"], False),
        # "localhost-nodeports disabled, localhost in nodeport-addresses": 127.0.0.1 is left out
        # (upstream logs it), 192.168.1.2 is outside the CIDRs
        (False, ("192.168.0.0/24", "127.0.0.1/32"), [f"{TAIL} -d 192.168.0.2 -j KUBE-NODEPORTS"], False),
        # "multiple nodeport-addresses": the IPv6 one is not this family's
        (
            False,
            ("192.168.0.0/24", "192.168.1.0/24", "2001:db8::/64"),
            [f"{TAIL} -d 192.168.0.2 -j KUBE-NODEPORTS", f"{TAIL} -d 192.168.1.2 -j KUBE-NODEPORTS"],
            False,
        ),
    ],
    ids=[
        "localhost-enabled",
        "localhost-disabled",
        "localhost-in-addresses-but-disabled",
        "multiple-addresses",
    ],
)
def test_node_ports(localhost: bool, addresses: tuple[str, ...], tail: list[str], firewall: bool) -> None:
    """TestNodePorts (IPv4 cases): which node addresses accept NodePorts, and KUBE-FIREWALL's
    martian drop exactly when localhost NodePorts are on (upstream checks that chain as text)."""
    options = replace(FAKE_OPTIONS, localhost_nodeports=localhost, nodeport_addresses=addresses)
    text = render(build(*NODEPORT_OBJECTS), FAKE_NODE, options).text
    assert chain_rules(text, "filter", "KUBE-FIREWALL") == (FIREWALL_RULE if firewall else "")
    assert [
        line for line in chain_rules(text, "nat", "KUBE-SERVICES").splitlines() if line.startswith(TAIL)
    ] == tail
    # The localhost NodePort jump (and its nfacct counting) only where localhost NodePorts work.
    assert ("-d 127.0.0.0/8 --dport 3001" in text) == localhost


NODEPORT_OBJECTS6 = [
    svc("ns1", "svc1", port("p80", 80, nodePort=3001), type="NodePort", clusterIP="fd00:172:30::41"),
    eps("ns1", "svc1", P80, "fd00:10:180::1", ("fd00:10:180::2:1", NODE_NAME), address_type="IPv6"),
]


@pytest.mark.parametrize(
    ("localhost", "addresses", "tail"),
    [
        # "ipv6, localhost-nodeports enabled": never on IPv6; the tail keeps ::1 out
        (True, (), [f"{TAIL} -m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS"]),
        # "ipv6, localhost-nodeports disabled"
        (False, (), [f"{TAIL} -m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS"]),
        # "ipv6, localhost-nodeports disabled, multiple nodeport-addresses": the IPv4 CIDRs are
        # the other family's; 2001:db8:1::2 is outside 2001:db8::/64 (altNodeIP ignored)
        (
            False,
            ("192.168.0.0/24", "192.168.1.0/24", "2001:db8::/64"),
            [f"{TAIL} -d 2001:db8::1 -j KUBE-NODEPORTS"],
        ),
    ],
    ids=["ipv6-localhost-enabled", "ipv6-localhost-disabled", "ipv6-multiple-addresses"],
)
def test_node_ports_ipv6(localhost: bool, addresses: tuple[str, ...], tail: list[str]) -> None:
    """TestNodePorts (IPv6 cases): no KUBE-FIREWALL martian drop whatever
    --iptables-localhost-nodeports says, no 127.0.0.0/8 NodePort jump, only this family's
    --nodeport-addresses; endpoints are [ip]:port."""
    options = replace(FAKE_OPTIONS6, localhost_nodeports=localhost, nodeport_addresses=addresses)
    st = build(*NODEPORT_OBJECTS6, family=IPFamily.IPv6)
    text = render(st, FAKE_NODE6, options).text
    assert "KUBE-FIREWALL" not in text
    assert "127.0.0.0/8" not in text and "nfacct-name localhost_nps_accepted_pkts" not in text
    assert [
        line for line in chain_rules(text, "nat", "KUBE-SERVICES").splitlines() if line.startswith(TAIL)
    ] == tail
    assert "-d fd00:172:30::41 --dport 80 ! -s fd00:10::/64 -j KUBE-MARK-MASQ" in text
    dnat = [line.split(" -j ", 1)[1] for line in text.splitlines() if "-j DNAT" in line]
    assert dnat == [
        "DNAT --to-destination [fd00:10:180::1]:80",
        "DNAT --to-destination [fd00:10:180::2:1]:80",
    ]


def test_ipv6_proxier_restores_with_its_own_runner_and_no_ipv4_host_setup() -> None:
    """The IPv6 proxier (metaproxier's second): its whole sync goes to its runner, with no
    route_localnet and no KUBE-FIREWALL jumps (upstream sets neither for IPv6), the canaries and
    base jumps as for IPv4; a second full sync finds nothing to repair or write."""
    fake = FakeRunner()
    p = IptablesProxier(FAKE_CONFIG, runner=fake, counters=FakeCounters(), family=IPFamily.IPv6)
    st = build(*NODEPORT_OBJECTS6, family=IPFamily.IPv6)
    p.sync(st, FAKE_NODE6)
    assert "[fd00:10:180::2:1]:80" in fake.restores[-1]
    assert not any("route_localnet" in " ".join(argv) for argv in fake.commands)
    assert fake.rules("filter", "INPUT") and not any(
        "KUBE-FIREWALL" in r for r in fake.rules("filter", "INPUT")
    )
    result = p.sync(st, FAKE_NODE6)
    assert result.repaired == 0 and p.last_sync is not None and not p.last_sync.restored


def test_each_familys_proxier_counts_its_rules_under_its_ip_family() -> None:
    """kube-proxy's iptables metrics carry `ip_family`: the two proxiers fill one label each."""
    registry = CollectorRegistry()
    metrics = Metrics(registry, Mode.IPTABLES)
    for family, objects, node in (
        (IPFamily.IPv4, NODEPORT_OBJECTS, FAKE_NODE),
        (IPFamily.IPv6, NODEPORT_OBJECTS6, FAKE_NODE6),
    ):
        p = IptablesProxier(
            FAKE_CONFIG, runner=FakeRunner(), counters=FakeCounters(), metrics=metrics, family=family
        )
        p.sync(build(*objects, family=family), node)
        assert p.last_sync is not None
        nat = registry.get_sample_value(
            "kubeproxy_sync_proxy_rules_iptables_total", {"ip_family": str(family), "table": "nat"}
        )
        assert nat == p.last_sync.rules - p.last_sync.filter_rules > 0
    v4 = registry.get_sample_value(
        "kubeproxy_sync_proxy_rules_iptables_total", {"ip_family": "IPv4", "table": "filter"}
    )
    v6 = registry.get_sample_value(
        "kubeproxy_sync_proxy_rules_iptables_total", {"ip_family": "IPv6", "table": "filter"}
    )
    assert v4 is not None and v6 is not None and v4 > v6, "IPv4 alone has KUBE-FIREWALL's rule"


def test_health_check_node_port() -> None:
    """TestHealthCheckNodePort: the health-check port is accepted (even with --nodeport-addresses
    only on loopback), and its rule goes with the service."""
    objects = [
        svc(
            "ns1",
            "svc1",
            port("p80", 80, nodePort=3001),
            type="LoadBalancer",
            clusterIP="172.30.0.42",
            healthCheckNodePort=30000,
            externalTrafficPolicy="Local",
        )
    ]
    p, fake, _ = fake_proxier(nodeport_addresses=("127.0.0.0/8",))
    p.sync(build(*objects), FAKE_NODE)
    assert chain_rules(last_restore(fake), "filter", "KUBE-NODEPORTS") == (
        '-A KUBE-NODEPORTS -m comment --comment "ns1/svc1:p80 health check node port" '
        "-m tcp -p tcp --dport 30000 -j ACCEPT\n"
    )
    p.sync(build(), FAKE_NODE, frozenset({ServicePortName("ns1", "svc1", "p80", Protocol.TCP)}))
    assert chain_rules(last_restore(fake), "filter", "KUBE-NODEPORTS") == ""
    assert fake.rules("filter", "KUBE-NODEPORTS") == []


# ------------------------------------------------------------------------------ TestDropInvalidRule

FORWARD_TAIL = dedent(
    """
    -A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
    -A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
    """  # noqa: E501
)


@pytest.mark.parametrize(
    ("nfacct", "liberal", "drop"),
    [
        (False, False, "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n"),
        (
            True,
            False,
            "-A KUBE-FORWARD -m conntrack --ctstate INVALID "
            "-m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP\n",
        ),
        (False, True, ""),
    ],
    ids=["plain", "nfacct", "tcp-liberal"],
)
def test_drop_invalid_rule(nfacct: bool, liberal: bool, drop: str) -> None:
    """TestDropInvalidRule: the INVALID drop, counted with nfacct when the counter exists, and
    left out when nf_conntrack_tcp_be_liberal is set."""
    options = replace(FAKE_OPTIONS, nfacct_invalid_dropped=nfacct, conntrack_tcp_liberal=liberal)
    text = render(build(), FAKE_NODE, options).text
    assert chain_rules(text, "filter", "KUBE-FORWARD") == drop + FORWARD_TAIL


def test_drop_invalid_rule_follows_the_counter_the_proxier_could_create() -> None:
    """TestDropInvalidRule's nfacctEnsured, through the proxier: no counter, no nfacct match."""
    for missing in (False, True):
        fake = FakeRunner()
        p = IptablesProxier(FAKE_CONFIG, runner=fake, counters=FakeCounters(missing=missing))
        p.sync(build(), FAKE_NODE)
        assert ("nfacct" in fake.restores[-1]) is not missing


# ------------------------------------------------------------------------------ TestMasqueradeRule


@pytest.mark.parametrize("random_fully", [False, True])
def test_masquerade_rule(random_fully: bool) -> None:
    """TestMasqueradeRule: MASQUERADE with --random-fully exactly when iptables supports it."""
    expected = dedent(
        """
        -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
        -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
        -A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE%s
        """
    ) % (" --random-fully" if random_fully else "")
    text = render(build(), FAKE_NODE, replace(FAKE_OPTIONS, random_fully=random_fully)).text
    assert chain_rules(text, "nat", "KUBE-POSTROUTING") == expected
    # Through the proxier: the host fact comes from the iptables version (>= 1.6.2).
    p, fake, _ = fake_proxier()
    fake.iptables_version = (1, 8, 9) if random_fully else (1, 6, 1)
    p.sync(build(), FAKE_NODE)
    assert chain_rules(last_restore(fake), "nat", "KUBE-POSTROUTING") == expected


# ------------------------------------------------------------------ TestSyncProxyRulesLargeClusterMode


def dnat_lines(text: str, endpoint: str) -> tuple[str, int, int]:
    """upstream countEndpointsAndComments: the DNAT line of `endpoint`, DNAT lines, and how many
    of them carry a comment."""
    matched, n, comments = "", 0, 0
    for line in text.splitlines():
        if line.startswith("-A KUBE-SEP-") and "-j DNAT" in line:
            n += 1
            comments += "--comment" in line
            if endpoint in line:
                matched = line
    return matched, n, comments


def test_sync_proxy_rules_large_cluster_mode() -> None:
    """TestSyncProxyRulesLargeClusterMode.

    As upstream: above 1000 endpoints the per-endpoint comments go; crossing the threshold does not
    force a full sync; a deleted service's chains stay until a cleanup is due (once per sync
    period). Intended difference: upstream's forced full sync rewrites every chain; ours rewrites
    the chains whose kernel content differs from the desired state (here the 998 endpoints that
    still had comments, not svc3's 3 already without), so the checks look at the kernel too.
    """
    half = 1000 // 2 - 1
    services = [
        svc("ns1", "svc1", port("p80", 80), type="ClusterIP", clusterIP="172.30.0.41"),
        svc("ns2", "svc2", port("p8080", 8080), type="ClusterIP", clusterIP="172.30.0.42"),
        svc("ns3", "svc3", port("p8081", 8081), type="ClusterIP", clusterIP="172.30.0.43"),
    ]
    slices = [
        eps("ns1", "svc1", P80, *[f"10.0.{i % 256}.{i // 256}" for i in range(half)]),
        eps("ns2", "svc2", [("p8080", 8080, "TCP")], *[f"10.1.{i % 256}.{i // 256}" for i in range(half)]),
    ]
    p, fake, clock = fake_proxier(masquerade_all=True)
    p.sync(build(*services, *slices), FAKE_NODE)
    first, n, comments = dnat_lines(last_restore(fake), "10.0.0.0")
    assert first == (
        "-A KUBE-SEP-DKGQUZGBKLTPAR56 -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT "
        "--to-destination 10.0.0.0:80"
    )
    assert n == 2 * half and comments == n

    svc3_slice = eps("ns3", "svc3", [("p8081", 8081, "TCP")], "203.0.113.4", "203.0.113.8", "203.0.113.12")
    svc3 = ServicePortName("ns3", "svc3", "p8081", Protocol.TCP)
    result = p.sync(build(*services, *slices, svc3_slice), FAKE_NODE, frozenset({svc3}))
    assert not result.full  # crossing the threshold does not force a full sync
    first, n, comments = dnat_lines(last_restore(fake), "203.0.113.4")
    assert first == "-A KUBE-SEP-RUVVH7YV3PHQBDOS -m tcp -p tcp -j DNAT --to-destination 203.0.113.4:8081"
    assert (n, comments) == (3, 0)

    # Force a full sync: the older services lose their comments too.
    p.sync(build(*services, *slices, svc3_slice), FAKE_NODE)
    first, n, comments = dnat_lines(last_restore(fake), "10.0.0.0")
    assert first == "-A KUBE-SEP-DKGQUZGBKLTPAR56 -m tcp -p tcp -j DNAT --to-destination 10.0.0.0:80"
    assert (n, comments) == (2 * half, 0)  # upstream: 2 * half + 3 (it rewrites svc3 as well)
    kernel = "\n".join(f"-A {c} {r}" for c in fake.chains("nat") for r in fake.rules("nat", c))
    _, n, comments = dnat_lines(kernel, "10.0.0.0")
    assert (n, comments) == (2 * half + 3, 0)

    svc4 = svc("ns4", "svc4", port("p8082", 8082), type="ClusterIP", clusterIP="172.30.0.44")
    svc4_slice = eps("ns4", "svc4", [("p8082", 8082, "TCP")], "10.4.0.1")
    svc4_port = frozenset({ServicePortName("ns4", "svc4", "p8082", Protocol.TCP)})
    p.sync(build(*services, svc4, *slices, svc3_slice, svc4_slice), FAKE_NODE, svc4_port)
    line, n, _ = dnat_lines(last_restore(fake), "10.4.0.1")
    assert line == "-A KUBE-SEP-SU5STNODRYEWJAUF -m tcp -p tcp -j DNAT --to-destination 10.4.0.1:8082"
    assert n == 1

    # Deleted just after a cleanup: its chains are not resynced, and not deleted yet either.
    clock.now += 1
    p.sync(build(*services, *slices, svc3_slice, svc4_slice), FAKE_NODE, svc4_port)
    line, n, _ = dnat_lines(last_restore(fake), "10.4.0.1")
    assert (line, n) == ("", 0)
    assert "-X " not in last_restore(fake)

    # One sync period later the stale chains go.
    clock.now += 31
    p.sync(build(*services, *slices, svc3_slice, svc4_slice), FAKE_NODE, frozenset())
    assert "-X KUBE-SVC-EBDQOQU5SJFXRIL3" in last_restore(fake).splitlines()
    assert "-X KUBE-SEP-SU5STNODRYEWJAUF" in last_restore(fake).splitlines()
    assert "KUBE-SEP-SU5STNODRYEWJAUF" not in fake.chains("nat")


# ------------------------------------------------------------------------ TestSyncProxyRulesRepeated

FILTER_REPEATED = """
    *filter
    :KUBE-NODEPORTS - [0:0]
    :KUBE-SERVICES - [0:0]
    :KUBE-EXTERNAL-SERVICES - [0:0]
    :KUBE-FIREWALL - [0:0]
    :KUBE-FORWARD - [0:0]
    :KUBE-PROXY-FIREWALL - [0:0]
    {reject}-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
    -A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP
    -A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
    -A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
    COMMIT
    """  # noqa: E501
NAT_TOP = """
    -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
    -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
    -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
    -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
    -A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE
    """  # noqa: E501


def repeated(nat: str, reject: str = "") -> str:
    """One expected text of TestSyncProxyRulesRepeated: the filter table is the same each time."""
    return dedent(FILTER_REPEATED).replace("{reject}", reject) + dedent(nat)


def cluster_ip(ns: str, name: str, port_name: str, number: int, ip: str) -> Obj:
    return svc(ns, name, port(port_name, number), type="ClusterIP", clusterIP=ip)


def test_sync_proxy_rules_repeated() -> None:
    """TestSyncProxyRulesRepeated: add, delete and change services and endpoints; each partial
    sync writes exactly upstream's text. Intended difference at the end: a failed partial restore
    is retried as a complete one in the same sync (upstream retries at its next sync)."""
    s1 = cluster_ip("ns1", "svc1", "p80", 80, "172.30.0.41")
    s2 = cluster_ip("ns2", "svc2", "p8080", 8080, "172.30.0.42")
    e1 = eps("ns1", "svc1", P80, "10.0.1.1")
    e2 = eps("ns2", "svc2", [("p8080", 8080, "TCP")], "10.0.2.1")
    spn = {
        n: ServicePortName(f"ns{n}", f"svc{n}", p, Protocol.TCP)
        for n, p in ((1, "p80"), (2, "p8080"), (3, "p80"), (4, "p80"))
    }
    p, fake, _ = fake_proxier()

    def step(objects: list[Obj], changed: set[int] | None, expected: str, total: int) -> None:
        p.sync(build(*objects), FAKE_NODE, None if changed is None else frozenset(spn[n] for n in changed))
        assert_rules_equal(expected, last_restore(fake), consistent=changed is None)
        assert p.last_sync is not None
        # upstream's rules-synced and rules-total metrics for nat
        assert p.last_sync.nat_rules_written == nat_rule_count(expected)
        assert p.last_sync.rules - p.last_sync.filter_rules == total

    expected = repeated(
        """
        *nat
        :KUBE-NODEPORTS - [0:0]
        :KUBE-SERVICES - [0:0]
        :KUBE-MARK-MASQ - [0:0]
        :KUBE-POSTROUTING - [0:0]
        :KUBE-SEP-SNQ3ZNILQDEJNDQO - [0:0]
        :KUBE-SEP-UHEGFW77JX3KXTOV - [0:0]
        :KUBE-SVC-2VJB64SDSIJUP5T6 - [0:0]
        :KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
        -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
        -A KUBE-SERVICES -m comment --comment "ns2/svc2:p8080 cluster IP" -m tcp -p tcp -d 172.30.0.42 --dport 8080 -j KUBE-SVC-2VJB64SDSIJUP5T6
        """  # noqa: E501
        + NAT_TOP
        + """
        -A KUBE-SEP-SNQ3ZNILQDEJNDQO -m comment --comment ns1/svc1:p80 -s 10.0.1.1 -j KUBE-MARK-MASQ
        -A KUBE-SEP-SNQ3ZNILQDEJNDQO -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.0.1.1:80
        -A KUBE-SEP-UHEGFW77JX3KXTOV -m comment --comment ns2/svc2:p8080 -s 10.0.2.1 -j KUBE-MARK-MASQ
        -A KUBE-SEP-UHEGFW77JX3KXTOV -m comment --comment ns2/svc2:p8080 -m tcp -p tcp -j DNAT --to-destination 10.0.2.1:8080
        -A KUBE-SVC-2VJB64SDSIJUP5T6 -m comment --comment "ns2/svc2:p8080 cluster IP" -m tcp -p tcp -d 172.30.0.42 --dport 8080 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
        -A KUBE-SVC-2VJB64SDSIJUP5T6 -m comment --comment "ns2/svc2:p8080 -> 10.0.2.1:8080" -j KUBE-SEP-UHEGFW77JX3KXTOV
        -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
        -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.0.1.1:80" -j KUBE-SEP-SNQ3ZNILQDEJNDQO
        COMMIT
        """  # noqa: E501
    )
    total = nat_rule_count(expected)
    step([s1, s2, e1, e2], None, expected, total)

    # Add a new service and its endpoints: only its SVC and SEP chains are written.
    s3 = cluster_ip("ns3", "svc3", "p80", 80, "172.30.0.43")
    e3 = eps("ns3", "svc3", P80, "10.0.3.1")
    top3 = """
        -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
        -A KUBE-SERVICES -m comment --comment "ns2/svc2:p8080 cluster IP" -m tcp -p tcp -d 172.30.0.42 --dport 8080 -j KUBE-SVC-2VJB64SDSIJUP5T6
        -A KUBE-SERVICES -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
        """  # noqa: E501
    total += 5
    step(
        [s1, s2, s3, e1, e2, e3],
        {3},
        repeated(
            """
            *nat
            :KUBE-NODEPORTS - [0:0]
            :KUBE-SERVICES - [0:0]
            :KUBE-MARK-MASQ - [0:0]
            :KUBE-POSTROUTING - [0:0]
            :KUBE-SEP-BSWRHOQ77KEXZLNL - [0:0]
            :KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
            """
            + top3
            + NAT_TOP
            + """
            -A KUBE-SEP-BSWRHOQ77KEXZLNL -m comment --comment ns3/svc3:p80 -s 10.0.3.1 -j KUBE-MARK-MASQ
            -A KUBE-SEP-BSWRHOQ77KEXZLNL -m comment --comment ns3/svc3:p80 -m tcp -p tcp -j DNAT --to-destination 10.0.3.1:80
            -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
            -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 -> 10.0.3.1:80" -j KUBE-SEP-BSWRHOQ77KEXZLNL
            COMMIT
            """  # noqa: E501
        ),
        total,
    )

    # Delete a service: its chains are deleted, the others not rewritten.
    top13 = """
        -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
        -A KUBE-SERVICES -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
        """  # noqa: E501
    total -= 5
    step(
        [s1, s3, e1, e3],
        {2},
        repeated(
            """
            *nat
            :KUBE-NODEPORTS - [0:0]
            :KUBE-SERVICES - [0:0]
            :KUBE-MARK-MASQ - [0:0]
            :KUBE-POSTROUTING - [0:0]
            :KUBE-SEP-UHEGFW77JX3KXTOV - [0:0]
            :KUBE-SVC-2VJB64SDSIJUP5T6 - [0:0]
            """
            + top13
            + NAT_TOP
            + """
            -X KUBE-SEP-UHEGFW77JX3KXTOV
            -X KUBE-SVC-2VJB64SDSIJUP5T6
            COMMIT
            """
        ),
        total,
    )

    # Add a service without endpoints: only its REJECT rule.
    s4 = cluster_ip("ns4", "svc4", "p80", 80, "172.30.0.44")
    step(
        [s1, s3, s4, e1, e3],
        {4},
        repeated(
            """
            *nat
            :KUBE-NODEPORTS - [0:0]
            :KUBE-SERVICES - [0:0]
            :KUBE-MARK-MASQ - [0:0]
            :KUBE-POSTROUTING - [0:0]
            """
            + top13
            + NAT_TOP
            + """
            COMMIT
            """,
            reject='-A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 has no endpoints" -m tcp -p tcp '
            "-d 172.30.0.44 --dport 80 -j REJECT\n",
        ),
        total,
    )

    # Its endpoints arrive: now its chains.
    e4 = eps("ns4", "svc4", P80, "10.0.4.1")
    top134 = (
        top13
        + """
        -A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 172.30.0.44 --dport 80 -j KUBE-SVC-4SW47YFZTEDKD3PK
        """  # noqa: E501
    )
    total += 5
    step(
        [s1, s3, s4, e1, e3, e4],
        {4},
        repeated(
            """
            *nat
            :KUBE-NODEPORTS - [0:0]
            :KUBE-SERVICES - [0:0]
            :KUBE-MARK-MASQ - [0:0]
            :KUBE-POSTROUTING - [0:0]
            :KUBE-SEP-AYCN5HPXMIRJNJXU - [0:0]
            :KUBE-SVC-4SW47YFZTEDKD3PK - [0:0]
            """
            + top134
            + NAT_TOP
            + """
            -A KUBE-SEP-AYCN5HPXMIRJNJXU -m comment --comment ns4/svc4:p80 -s 10.0.4.1 -j KUBE-MARK-MASQ
            -A KUBE-SEP-AYCN5HPXMIRJNJXU -m comment --comment ns4/svc4:p80 -m tcp -p tcp -j DNAT --to-destination 10.0.4.1:80
            -A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 172.30.0.44 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
            -A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 -> 10.0.4.1:80" -j KUBE-SEP-AYCN5HPXMIRJNJXU
            COMMIT
            """  # noqa: E501
        ),
        total,
    )

    # Change an endpoint of svc3: its SVC and SEP chains are rewritten, the old SEP deleted.
    e3b = eps("ns3", "svc3", P80, "10.0.3.2")
    step(
        [s1, s3, s4, e1, e3b, e4],
        {3},
        repeated(
            """
            *nat
            :KUBE-NODEPORTS - [0:0]
            :KUBE-SERVICES - [0:0]
            :KUBE-MARK-MASQ - [0:0]
            :KUBE-POSTROUTING - [0:0]
            :KUBE-SEP-BSWRHOQ77KEXZLNL - [0:0]
            :KUBE-SEP-DKCFIS26GWF2WLWC - [0:0]
            :KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
            """
            + top134
            + NAT_TOP
            + """
            -A KUBE-SEP-DKCFIS26GWF2WLWC -m comment --comment ns3/svc3:p80 -s 10.0.3.2 -j KUBE-MARK-MASQ
            -A KUBE-SEP-DKCFIS26GWF2WLWC -m comment --comment ns3/svc3:p80 -m tcp -p tcp -j DNAT --to-destination 10.0.3.2:80
            -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
            -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 -> 10.0.3.2:80" -j KUBE-SEP-DKCFIS26GWF2WLWC
            -X KUBE-SEP-BSWRHOQ77KEXZLNL
            COMMIT
            """  # noqa: E501
        ),
        total,
    )

    # Add an endpoint to svc3.
    e3c = eps("ns3", "svc3", P80, "10.0.3.2", "10.0.3.3")
    svc3_two = """
        -A KUBE-SEP-DKCFIS26GWF2WLWC -m comment --comment ns3/svc3:p80 -s 10.0.3.2 -j KUBE-MARK-MASQ
        -A KUBE-SEP-DKCFIS26GWF2WLWC -m comment --comment ns3/svc3:p80 -m tcp -p tcp -j DNAT --to-destination 10.0.3.2:80
        -A KUBE-SEP-JVVZVJ7BSEPPRNBS -m comment --comment ns3/svc3:p80 -s 10.0.3.3 -j KUBE-MARK-MASQ
        -A KUBE-SEP-JVVZVJ7BSEPPRNBS -m comment --comment ns3/svc3:p80 -m tcp -p tcp -j DNAT --to-destination 10.0.3.3:80
        """  # noqa: E501
    svc3_chain = """
        -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
        -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 -> 10.0.3.2:80" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-DKCFIS26GWF2WLWC
        -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 -> 10.0.3.3:80" -j KUBE-SEP-JVVZVJ7BSEPPRNBS
        """  # noqa: E501
    total += 3
    step(
        [s1, s3, s4, e1, e3c, e4],
        {3},
        repeated(
            """
            *nat
            :KUBE-NODEPORTS - [0:0]
            :KUBE-SERVICES - [0:0]
            :KUBE-MARK-MASQ - [0:0]
            :KUBE-POSTROUTING - [0:0]
            :KUBE-SEP-DKCFIS26GWF2WLWC - [0:0]
            :KUBE-SEP-JVVZVJ7BSEPPRNBS - [0:0]
            :KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
            """
            + top134
            + NAT_TOP
            + svc3_two
            + svc3_chain
            + """
            COMMIT
            """
        ),
        total,
    )

    # Sync with no new changes: no SVC or SEP chain rewritten.
    step(
        [s1, s3, s4, e1, e3c, e4],
        set(),
        repeated(
            """
            *nat
            :KUBE-NODEPORTS - [0:0]
            :KUBE-SERVICES - [0:0]
            :KUBE-MARK-MASQ - [0:0]
            :KUBE-POSTROUTING - [0:0]
            """
            + top134
            + NAT_TOP
            + """
            COMMIT
            """
        ),
        total,
    )

    # A rule jumping from svc3's chain to svc4's endpoint, then svc4 deleted: the partial restore
    # cannot delete the still referenced endpoint chain and fails; the complete one succeeds.
    fake.tables["nat"]["KUBE-SVC-X27LE4BHSL4DOUIK"].append("-j KUBE-SEP-AYCN5HPXMIRJNJXU")
    total -= 5
    step(
        [s1, s3, e1, e3c],
        {4},
        repeated(
            """
            *nat
            :KUBE-NODEPORTS - [0:0]
            :KUBE-SERVICES - [0:0]
            :KUBE-MARK-MASQ - [0:0]
            :KUBE-POSTROUTING - [0:0]
            :KUBE-SEP-AYCN5HPXMIRJNJXU - [0:0]
            :KUBE-SEP-DKCFIS26GWF2WLWC - [0:0]
            :KUBE-SEP-JVVZVJ7BSEPPRNBS - [0:0]
            :KUBE-SEP-SNQ3ZNILQDEJNDQO - [0:0]
            :KUBE-SVC-4SW47YFZTEDKD3PK - [0:0]
            :KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
            :KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
            """
            + top13
            + NAT_TOP
            + svc3_two
            + """
            -A KUBE-SEP-SNQ3ZNILQDEJNDQO -m comment --comment ns1/svc1:p80 -s 10.0.1.1 -j KUBE-MARK-MASQ
            -A KUBE-SEP-SNQ3ZNILQDEJNDQO -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.0.1.1:80
            """  # noqa: E501
            + svc3_chain
            + """
            -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
            -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.0.1.1:80" -j KUBE-SEP-SNQ3ZNILQDEJNDQO
            -X KUBE-SEP-AYCN5HPXMIRJNJXU
            -X KUBE-SVC-4SW47YFZTEDKD3PK
            COMMIT
            """  # noqa: E501
        ),
        total,
    )
    assert p.last_sync is not None and p.last_sync.full
    assert "KUBE-SEP-AYCN5HPXMIRJNJXU" not in fake.chains("nat")
    assert re.search(r"-X KUBE-SEP-AYCN5HPXMIRJNJXU", fake.restores[-2])  # the failed partial tried it


def test_node_addresses_of_the_fake_match_upstream() -> None:
    """The fake's addresses, so the NodePort cases mean what upstream's mean."""
    assert (
        NodeContext(node_ips=("192.168.0.2", "192.168.1.2", "192.168.99.11"), primary_ip="192.168.0.2")
        == FAKE_NODE
    )
