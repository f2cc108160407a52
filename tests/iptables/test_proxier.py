"""IptablesProxier against the fake runner: full vs partial syncs, stale chains, failures, canary."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.config import NodeContext
from agent.iptables import IptablesProxier, chains
from agent.iptables.runner import IptablesError, Result
from agent.model.types import Protocol, ProxyState, ServicePortName
from tests.iptables.fakes import FakeRunner
from tests.iptables.objects import CONFIG, NODE, endpoints, service, state

TCP80 = [("http", 80, "TCP")]
DNS = [("dns", 53, "UDP")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def two_services(b_endpoint: str = "10.244.2.6") -> ProxyState:
    return state(
        service("a", "10.96.0.5", ("http", 80, "TCP")),
        endpoints("a", TCP80, "10.244.2.5"),
        service("b", "10.96.0.6", ("http", 80, "TCP")),
        endpoints("b", TCP80, b_endpoint),
    )


def svc(name: str) -> str:
    return chains.service_chain(ServicePortName("ns", name, "http", Protocol.TCP))


def make(clock: Clock | None = None, **kw: float) -> tuple[IptablesProxier, FakeRunner]:
    fake = FakeRunner()
    return IptablesProxier(CONFIG, runner=fake, clock=clock or Clock(), **kw), fake


def test_constructor_touches_nothing() -> None:
    _, fake = make()
    assert fake.restores == [] and fake.commands == [] and fake.iptables_calls == []


def test_first_sync_is_full_and_installs_jumps_canaries_and_route_localnet() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    assert p.last_sync is not None and p.last_sync.full
    assert len(fake.restores) == 1
    assert fake.restores[0].startswith("*filter\n") and "\n*nat\n" in fake.restores[0]
    assert fake.rules("nat", "PREROUTING") == [
        '-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'
    ]
    assert fake.rules("filter", "INPUT") == [
        "-j KUBE-FIREWALL",
        '-m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" '
        "-j KUBE-PROXY-FIREWALL",
        '-m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS',
        '-m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" '
        "-j KUBE-EXTERNAL-SERVICES",
    ]
    for table in ("mangle", "nat", "filter"):
        assert chains.KUBE_PROXY_CANARY in fake.chains(table)
    assert ["sysctl", "-w", "net.ipv4.conf.all.route_localnet=1"] in fake.commands
    assert {svc("a"), svc("b")} <= fake.chains("nat")


def test_repeated_full_syncs_never_duplicate_base_chain_jumps() -> None:
    p, fake = make(full_sync_period_s=0.0)
    for _ in range(3):
        p.sync(two_services(), NODE)
        assert p.last_sync is not None and p.last_sync.full
    for table, chain in (("filter", "INPUT"), ("filter", "FORWARD"), ("filter", "OUTPUT"), ("nat", "OUTPUT")):
        rules = fake.rules(table, chain)
        assert len(rules) == len(set(rules)), (table, chain, rules)
    assert len(fake.rules("nat", "POSTROUTING")) == 1


def test_unchanged_state_gives_a_partial_sync_writing_no_service_chains() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    calls_after_first = len(fake.iptables_calls)
    p.sync(two_services(), NODE)
    assert p.last_sync is not None and not p.last_sync.full
    assert p.last_sync.services_written == 0
    text = fake.restores[-1]
    assert ":KUBE-SVC-" not in text and ":KUBE-SEP-" not in text
    # The top-level chains are always rewritten, and still point at the kept chains.
    assert ":KUBE-SERVICES - [0:0]" in text and ":KUBE-NODEPORTS - [0:0]" in text
    assert ":KUBE-EXTERNAL-SERVICES - [0:0]" in text
    assert f"-j {svc('a')}" in text
    assert len(fake.iptables_calls) == calls_after_first  # no -C/-I on partial syncs
    assert fake.rules("nat", svc("a"))  # kept in the kernel


def test_endpoint_change_rewrites_only_that_service() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    p.sync(two_services(b_endpoint="10.244.2.66"), NODE)
    text = fake.restores[-1]
    assert p.last_sync is not None and not p.last_sync.full and p.last_sync.services_written == 1
    assert f":{svc('b')} - [0:0]" in text
    assert f":{svc('a')} - [0:0]" not in text
    old_sep = chains.endpoint_chain(ServicePortName("ns", "b", "http", Protocol.TCP), "10.244.2.6:80")
    assert f"-X {old_sep}" in text.splitlines()
    assert old_sep not in fake.chains("nat")
    assert any(
        "--to-destination 10.244.2.66:80" in r for c in fake.chains("nat") for r in fake.rules("nat", c)
    )


def test_removed_service_chains_are_deleted() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    only_a = state(service("a", "10.96.0.5", ("http", 80, "TCP")), endpoints("a", TCP80, "10.244.2.5"))
    p.sync(only_a, NODE)
    assert p.last_sync is not None and not p.last_sync.full and p.last_sync.deleted_chains == 2
    assert svc("b") not in fake.chains("nat")
    assert svc("a") in fake.chains("nat")


def test_failed_restore_raises_and_the_next_sync_is_full() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    fake.fail_next_restore = True
    with pytest.raises(IptablesError):
        p.sync(two_services(b_endpoint="10.244.2.66"), NODE)
    p.sync(two_services(b_endpoint="10.244.2.66"), NODE)
    assert p.last_sync is not None and p.last_sync.full
    assert f":{svc('a')} - [0:0]" in fake.restores[-1]


def test_missing_canary_forces_a_full_sync_that_restores_the_jumps() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    # Someone flushes the tables (the canary goes with them, and our jumps).
    for table in ("mangle", "nat", "filter"):
        del fake.tables[table][chains.KUBE_PROXY_CANARY]
    fake.tables["nat"]["PREROUTING"].clear()
    p.sync(two_services(), NODE)
    assert p.last_sync is not None and p.last_sync.full
    assert fake.rules("nat", "PREROUTING") == [
        '-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'
    ]
    assert chains.KUBE_PROXY_CANARY in fake.chains("mangle")


def test_periodic_full_sync() -> None:
    clock = Clock()
    p, _ = make(clock, full_sync_period_s=3600.0)
    p.sync(two_services(), NODE)
    clock.now += 3599
    p.sync(two_services(), NODE)
    assert p.last_sync is not None and not p.last_sync.full
    clock.now += 2
    p.sync(two_services(), NODE)
    assert p.last_sync.full


def test_node_address_change_forces_full_sync() -> None:
    p, _ = make()
    p.sync(two_services(), NODE)
    p.sync(two_services(), NodeContext(node_ips=("192.168.0.12",), primary_ip="192.168.0.12"))
    assert p.last_sync is not None and p.last_sync.full


def test_host_facts_are_read_once_and_used() -> None:
    p, fake = make()
    fake.responses["sysctl"] = lambda argv: Result(0, "1\n") if "-n" in argv else Result(0)
    p.sync(two_services(), NODE)
    p.sync(two_services(), NODE)
    assert sum(1 for c in fake.commands if c[:2] == ["sysctl", "-n"]) == 1
    assert "INVALID" not in fake.restores[-1]  # nf_conntrack_tcp_be_liberal=1


def test_localhost_nodeports_off_skips_route_localnet_and_kube_firewall() -> None:
    fake = FakeRunner()
    p = IptablesProxier(replace(CONFIG, nodeport_addresses=("192.168.0.0/24",)), runner=fake, clock=Clock())
    p.sync(two_services(), NODE)
    assert not any(c[:2] == ["sysctl", "-w"] for c in fake.commands)
    assert "KUBE-FIREWALL" not in fake.chains("filter")
    assert "-j KUBE-FIREWALL" not in fake.rules("filter", "INPUT")


def test_render_is_the_dry_run_text() -> None:
    from agent.iptables import render_dry_run

    p, fake = make()
    assert p.render(two_services(), NODE) == render_dry_run(two_services(), NODE, CONFIG)
    assert fake.restores == []


# ------------------------------------------------------------------------------------- conntrack

KUBE_DNS_ENTRY = (
    "udp      17 29 src=10.244.1.5 dst=10.96.0.10 sport=40000 dport=53 "
    "src={reply} dst=10.244.1.5 sport=53 dport=40000 mark=0 use=1\n"
)


def dns_state(*eps: str) -> ProxyState:
    return state(service("dns", "10.96.0.10", ("dns", 53, "UDP")), endpoints("dns", DNS, *eps))


def test_udp_endpoint_change_clears_entries_to_the_old_endpoint() -> None:
    p, fake = make()
    listed = {"text": ""}
    fake.responses["conntrack"] = lambda argv: Result(0, listed["text"]) if "-L" in argv else Result(0)
    p.sync(dns_state("10.244.2.2"), NODE)
    # The DNS pod is replaced; a client still has an entry to the old one.
    listed["text"] = KUBE_DNS_ENTRY.format(reply="10.244.2.2")
    p.sync(dns_state("10.244.2.3"), NODE)
    deletes = [c for c in fake.commands if c[:2] == ["conntrack", "-D"]]
    assert deletes == [
        [
            "conntrack",
            "-D",
            "-p",
            "udp",
            "-f",
            "ipv4",
            "--orig-dst",
            "10.96.0.10",
            "--orig-port-dst",
            "53",
            "--reply-src",
            "10.244.2.2",
            "--reply-port-src",
            "53",
        ]
    ]
    assert p.last_sync is not None and p.last_sync.conntrack_filters == 1


def test_no_conntrack_work_when_udp_endpoints_did_not_change() -> None:
    p, fake = make()
    p.sync(dns_state("10.244.2.2"), NODE)
    before = [c for c in fake.commands if c[0] == "conntrack"]
    p.sync(dns_state("10.244.2.2"), NODE)
    assert [c for c in fake.commands if c[0] == "conntrack"] == before


def test_conntrack_failure_does_not_fail_the_sync() -> None:
    p, fake = make()
    fake.responses["conntrack"] = lambda argv: Result(1, "", "conntrack: not found")
    p.sync(dns_state("10.244.2.2"), NODE)
    assert p.last_sync is not None and p.last_sync.conntrack_filters == 0
    assert len(fake.restores) == 1


def test_kept_chain_deleted_behind_our_back_turns_the_partial_sync_into_a_full_one() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    # Someone removes service a's chain (and the KUBE-SERVICES jump to it) by hand.
    fake.tables["nat"]["KUBE-SERVICES"] = [r for r in fake.rules("nat", "KUBE-SERVICES") if svc("a") not in r]
    del fake.tables["nat"][svc("a")]
    p.sync(two_services(), NODE)  # nothing changed in the state: would be partial, and fail
    assert p.last_sync is not None and p.last_sync.full
    assert svc("a") in fake.chains("nat")
