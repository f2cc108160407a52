"""IptablesProxier against the fake runner: partial and full syncs, repairs, failure isolation, canary."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from agent.config import ConntrackSettings, Mode, NodeContext
from agent.iptables import IptablesProxier, chains
from agent.iptables.runner import Result
from agent.metrics import Metrics
from agent.model.types import Protocol, ProxyState, ServicePortName
from agent.nodeinit import setup_conntrack
from tests.iptables.fakes import FakeCounters, FakeRunner
from tests.iptables.objects import CONFIG, NODE, endpoints, service, state

TCP80 = [("http", 80, "TCP")]
DNS = [("dns", 53, "UDP")]
A = ServicePortName("ns", "a", "http", Protocol.TCP)
B = ServicePortName("ns", "b", "http", Protocol.TCP)
NONE: frozenset[ServicePortName] = frozenset()


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


def make(clock: Clock | None = None, config: object = CONFIG) -> tuple[IptablesProxier, FakeRunner]:
    fake = FakeRunner()
    p = IptablesProxier(config, runner=fake, counters=FakeCounters(), clock=clock or Clock())  # type: ignore[arg-type]
    return p, fake


def dnat_targets(fake: FakeRunner) -> set[str]:
    return {r.rsplit(" ", 1)[1] for c in fake.chains("nat") for r in fake.rules("nat", c) if "DNAT" in r}


def test_constructor_touches_nothing() -> None:
    _, fake = make()
    assert fake.restores == [] and fake.commands == [] and fake.iptables_calls == []


def test_first_sync_is_full_and_installs_jumps_canaries_route_localnet_and_counters() -> None:
    p, fake = make()
    result = p.sync(two_services(), NODE)
    assert result.full and result.failed == {} and result.repaired == 0
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
    # The counters exist, so the INVALID drop counts its packets.
    assert fake.rules("filter", "KUBE-FORWARD")[0] == (
        "-m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP"
    )


def test_without_nfacct_the_rules_go_without_the_match() -> None:
    fake = FakeRunner()
    p = IptablesProxier(CONFIG, runner=fake, counters=FakeCounters(missing=True), clock=Clock())
    p.sync(two_services(), NODE)
    assert "nfacct" not in fake.restores[0]


def test_a_full_sync_with_nothing_changed_restores_nothing_and_never_duplicates_jumps() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    calls = len(fake.iptables_calls)
    for _ in range(3):
        result = p.sync(two_services(), NODE)
        assert result.full and result.repaired == 0
        assert p.last_sync is not None and not p.last_sync.restored
    assert len(fake.restores) == 1
    assert len(fake.iptables_calls) == calls  # jumps seen in the save: no -C/-I
    for table, chain in (("filter", "INPUT"), ("filter", "FORWARD"), ("filter", "OUTPUT"), ("nat", "OUTPUT")):
        rules = fake.rules(table, chain)
        assert len(rules) == len(set(rules)), (table, chain, rules)


def test_the_first_sync_creates_each_jump_target_once_and_none_the_save_lists() -> None:
    # several jumps share a target chain (KUBE-SERVICES from FORWARD and OUTPUT, ...): one `-N`
    # each, and none for a chain already there (an iptables process each)
    p, fake = make()
    fake.run("-t", "filter", "-N", "KUBE-FORWARD")
    fake.iptables_calls.clear()
    p.sync(two_services(), NODE)
    made = [(c[1], c[3]) for c in fake.iptables_calls if c[2] == "-N"]
    assert len(made) == len(set(made)) and made
    assert ("filter", "KUBE-FORWARD") not in made
    assert ("filter", "KUBE-SERVICES") in made and ("nat", "KUBE-SERVICES") in made
    assert fake.rules("filter", "FORWARD") and fake.rules("nat", "PREROUTING")


def test_partial_sync_reads_nothing_back_and_writes_only_the_changed_services_chains() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    saves = fake.saves
    result = p.sync(two_services(b_endpoint="10.244.2.66"), NODE, frozenset({B}))
    assert not result.full
    assert fake.saves == saves
    text = fake.restores[-1]
    assert f":{svc('b')} - [0:0]" in text
    assert f":{svc('a')} - [0:0]" not in text
    assert ":KUBE-SERVICES - [0:0]" in text and f"-j {svc('a')}" in text
    old_sep = chains.endpoint_chain(B, "10.244.2.6:80")
    assert f"-X {old_sep}" in text.splitlines()
    assert old_sep not in fake.chains("nat")
    assert "10.244.2.66:80" in dnat_targets(fake)
    assert fake.rules("nat", svc("a"))  # kept


def test_an_empty_change_set_rewrites_only_the_top_level_chains() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    calls = len(fake.iptables_calls)
    p.sync(two_services(), NODE, NONE)
    assert p.last_sync is not None and not p.last_sync.full and p.last_sync.services_written == 0
    assert ":KUBE-SVC-" not in fake.restores[-1] and ":KUBE-SEP-" not in fake.restores[-1]
    assert len(fake.iptables_calls) == calls  # no -C/-I on partial syncs


def test_removed_service_chains_are_deleted_by_a_partial_sync() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    only_a = state(service("a", "10.96.0.5", ("http", 80, "TCP")), endpoints("a", TCP80, "10.244.2.5"))
    p.sync(only_a, NODE, frozenset({B}))
    assert p.last_sync is not None and not p.last_sync.full and p.last_sync.deleted_chains == 2
    assert svc("b") not in fake.chains("nat")
    assert svc("a") in fake.chains("nat")


def test_a_failed_partial_restore_is_retried_at_once_as_a_complete_one() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    fake.fail_next_restore = True
    result = p.sync(two_services(b_endpoint="10.244.2.66"), NODE, frozenset({B}))
    assert result.full and result.failed == {}
    assert f":{svc('a')} - [0:0]" in fake.restores[-1]  # every chain written
    assert "10.244.2.66:80" in dnat_targets(fake)


def test_nat_flushed_without_delete_is_detected_and_repaired_in_one_full_sync() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    before = {c: fake.rules("nat", c) for c in fake.chains("nat")}
    for chain in fake.tables["nat"]:  # iptables -t nat -F: rules gone, chains (and canary) stay
        fake.tables["nat"][chain] = []
    result = p.sync(two_services(), NODE)
    # Every nat chain of ours that had rules; plus the 3 jumps from PREROUTING, OUTPUT, POSTROUTING.
    ours_with_rules = [c for c, rules in before.items() if rules and c.startswith("KUBE-")]
    assert result.full and result.repaired == len(ours_with_rules) + 3
    assert {c: fake.rules("nat", c) for c in fake.chains("nat")} == before


def test_a_rule_inserted_into_our_chain_is_removed_by_the_next_full_sync() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    fake.tables["nat"]["KUBE-SERVICES"].insert(0, "-s 6.6.6.6/32 -j ACCEPT")
    partial = p.sync(two_services(), NODE, NONE)  # partial syncs rewrite the top-level chains anyway
    assert partial.repaired == 0 and not any("6.6.6.6" in r for r in fake.rules("nat", "KUBE-SERVICES"))
    fake.tables["nat"][svc("a")].insert(0, "-s 6.6.6.6/32 -j ACCEPT")
    assert p.sync(two_services(), NODE, NONE).repaired == 0  # partial syncs do not look
    result = p.sync(two_services(), NODE)
    assert result.repaired == 1
    assert not any("6.6.6.6" in r for r in fake.rules("nat", svc("a")))
    assert f":{svc('b')} - [0:0]" not in fake.restores[-1]  # only the differing service is written


def test_missing_canary_and_jumps_are_restored_by_a_full_sync() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    for table in ("mangle", "nat", "filter"):
        del fake.tables[table][chains.KUBE_PROXY_CANARY]
    fake.tables["nat"]["PREROUTING"].clear()
    result = p.sync(two_services(), NODE)
    assert result.repaired == 4
    assert fake.rules("nat", "PREROUTING") == [
        '-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'
    ]
    assert chains.KUBE_PROXY_CANARY in fake.chains("mangle")


def test_kept_chain_deleted_behind_our_back_is_recreated_by_a_full_sync() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    fake.tables["nat"]["KUBE-SERVICES"] = [r for r in fake.rules("nat", "KUBE-SERVICES") if svc("a") not in r]
    del fake.tables["nat"][svc("a")]
    result = p.sync(two_services(), NODE)
    assert result.repaired == 2  # KUBE-SERVICES and a's service chain
    assert fake.rules("nat", svc("a"))


def test_node_address_change_forces_a_complete_sync_even_when_partial_was_asked() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    p.sync(two_services(), NodeContext(node_ips=("192.168.0.12",), primary_ip="192.168.0.12"), NONE)
    assert p.last_sync is not None and p.last_sync.full
    assert f":{svc('a')} - [0:0]" in fake.restores[-1]


def test_host_facts_are_read_once_and_used() -> None:
    p, fake = make()
    fake.responses["sysctl"] = lambda argv: Result(0, "1\n") if "-n" in argv else Result(0)
    p.sync(two_services(), NODE)
    p.sync(two_services(), NODE, NONE)
    reads = [c for c in fake.commands if c == ["sysctl", "-n", "net.netfilter.nf_conntrack_tcp_be_liberal"]]
    assert len(reads) == 1
    assert "INVALID" not in fake.restores[-1]  # nf_conntrack_tcp_be_liberal=1


def test_localhost_nodeports_off_skips_route_localnet_and_kube_firewall() -> None:
    p, fake = make(config=replace(CONFIG, nodeport_addresses=("192.168.0.0/24",)))
    p.sync(two_services(), NODE)
    assert not any(c[:2] == ["sysctl", "-w"] and "route_localnet" in c[2] for c in fake.commands)
    assert "KUBE-FIREWALL" not in fake.chains("filter")
    assert "-j KUBE-FIREWALL" not in fake.rules("filter", "INPUT")


def test_render_is_the_dry_run_text() -> None:
    from agent.iptables import render_dry_run

    p, fake = make()
    assert p.render(two_services(), NODE) == render_dry_run(two_services(), NODE, CONFIG)
    assert fake.restores == []


# ------------------------------------------------------------------------------- failure isolation


def test_a_rejected_service_port_is_isolated_and_every_other_one_programmed() -> None:
    p, fake = make()
    fake.refuse = {"10.244.2.66"}
    result = p.sync(two_services(b_endpoint="10.244.2.66"), NODE)
    assert set(result.failed) == {B}
    assert "iptables-restore rejected its rules" in result.failed[B]
    assert "10.244.2.5:80" in dnat_targets(fake)  # a is programmed
    assert svc("b") not in fake.chains("nat")  # b never had a good version
    assert fake.tests  # found with --test
    # The runner retries the failed port once it changes; now it goes in.
    fake.refuse = set()
    again = p.sync(two_services(b_endpoint="10.244.2.7"), NODE, frozenset({B}))
    assert again.failed == {}
    assert "10.244.2.7:80" in dnat_targets(fake)


def test_a_rejected_update_keeps_the_last_programmed_version() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    fake.refuse = {"10.244.2.66"}
    result = p.sync(two_services(b_endpoint="10.244.2.66"), NODE, frozenset({B}))
    assert set(result.failed) == {B}
    assert dnat_targets(fake) == {"10.244.2.5:80", "10.244.2.6:80"}
    # A later partial sync of another service does not lose b's old chains.
    p.sync(two_services(b_endpoint="10.244.2.66"), NODE, frozenset({A}))
    assert dnat_targets(fake) == {"10.244.2.5:80", "10.244.2.6:80"}


def test_an_unchanged_rejected_port_is_not_bisected_again_by_every_full_sync() -> None:
    p, fake = make()
    fake.refuse = {"10.244.2.66"}
    p.sync(two_services(b_endpoint="10.244.2.66"), NODE)
    tests = len(fake.tests)
    again = p.sync(two_services(b_endpoint="10.244.2.66"), NODE)
    assert set(again.failed) == {B} and len(fake.tests) == tests
    # A new version of it is tried at the next full sync.
    fake.refuse = set()
    assert p.sync(two_services(b_endpoint="10.244.2.67"), NODE).failed == {}
    assert "10.244.2.67:80" in dnat_targets(fake)


def test_a_rejected_port_deleted_meanwhile_is_not_brought_back() -> None:
    p, fake = make()
    p.sync(two_services(), NODE)
    fake.refuse = {"10.244.2.66"}
    p.sync(two_services(b_endpoint="10.244.2.66"), NODE, frozenset({B}))
    only_a = state(service("a", "10.96.0.5", ("http", 80, "TCP")), endpoints("a", TCP80, "10.244.2.5"))
    result = p.sync(only_a, NODE, frozenset({A}))
    assert result.failed == {}
    assert svc("b") not in fake.chains("nat")
    assert dnat_targets(fake) == {"10.244.2.5:80"}


def test_a_failure_of_the_rules_common_to_all_raises() -> None:
    p, fake = make()
    fake.refuse = {"KUBE-MARK-MASQ -j MARK"}
    with pytest.raises(Exception, match="even without any service"):
        p.sync(two_services(), NODE)


def test_a_refused_name_is_reported_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    p, fake = make()
    good = two_services()
    bad_spn = ServicePortName("ns", "a b", "http", Protocol.TCP)
    bad = replace(
        good,
        services={**good.services, bad_spn: replace(good.services[A], name=bad_spn)},
        endpoints={**good.endpoints, bad_spn: good.endpoints[A]},
    )
    with caplog.at_level(logging.ERROR, logger="agent.iptables.proxier"):
        first = p.sync(bad, NODE)
        second = p.sync(bad, NODE)
    assert set(first.failed) == set(second.failed) == {bad_spn}
    assert "DNS-1035" in first.failed[bad_spn]
    assert len([r for r in caplog.records if "'a b'" in r.getMessage() or "a b" in r.getMessage()]) == 1
    assert "a b" not in "".join(fake.restores)


# --------------------------------------------------------------------------------- conntrack


KUBE_DNS_ENTRY = (
    "udp      17 29 src=10.244.1.5 dst=10.96.0.10 sport=40000 dport=53 "
    "src={reply} dst=10.244.1.5 sport=53 dport=40000 mark=0 use=1\n"
)
DNS_PORT = ServicePortName("ns", "dns", "dns", Protocol.UDP)


def dns_state(*eps: str) -> ProxyState:
    return state(service("dns", "10.96.0.10", ("dns", 53, "UDP")), endpoints("dns", DNS, *eps))


def test_udp_endpoint_change_clears_entries_to_the_old_endpoint() -> None:
    p, fake = make()
    listed = {"text": ""}
    fake.responses["conntrack"] = lambda argv: Result(0, listed["text"]) if "-L" in argv else Result(0)
    p.sync(dns_state("10.244.2.2"), NODE)
    listed["text"] = KUBE_DNS_ENTRY.format(reply="10.244.2.2")
    p.sync(dns_state("10.244.2.3"), NODE, frozenset({DNS_PORT}))
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


def test_conntrack_cleanup_is_measured_as_kube_proxys_reconciler() -> None:
    fake = FakeRunner()
    registry = CollectorRegistry()
    p = IptablesProxier(
        CONFIG,
        runner=fake,
        counters=FakeCounters(),
        clock=Clock(),
        metrics=Metrics(registry, Mode.IPTABLES),
    )
    listed = {"text": ""}

    def conntrack(argv: list[str]) -> Result:
        if "-L" in argv:
            return Result(0, listed["text"])
        return Result(0, "", "conntrack v1.4.7 (conntrack-tools): 2 flow entries have been deleted.\n")

    fake.responses["conntrack"] = conntrack
    p.sync(dns_state("10.244.2.2"), NODE)
    listed["text"] = KUBE_DNS_ENTRY.format(reply="10.244.2.2")
    p.sync(dns_state("10.244.2.3"), NODE, frozenset({DNS_PORT}))
    labels = {"ip_family": "IPv4"}
    assert registry.get_sample_value("kubeproxy_conntrack_reconciler_deleted_entries_total", labels) == 2
    assert (
        registry.get_sample_value("kubeproxy_conntrack_reconciler_sync_duration_seconds_count", labels) == 2
    )


def test_no_conntrack_work_when_no_udp_port_changed() -> None:
    p, fake = make()
    p.sync(dns_state("10.244.2.2"), NODE)
    before = [c for c in fake.commands if c[0] == "conntrack"]
    p.sync(dns_state("10.244.2.2"), NODE)
    p.sync(dns_state("10.244.2.2"), NODE, frozenset({A}))
    assert [c for c in fake.commands if c[0] == "conntrack"] == before


def test_conntrack_failure_does_not_fail_the_sync() -> None:
    p, fake = make()
    fake.responses["conntrack"] = lambda argv: Result(1, "", "conntrack: not found")
    p.sync(dns_state("10.244.2.2"), NODE)
    assert p.last_sync is not None and p.last_sync.conntrack_filters == 0
    assert len(fake.restores) == 1


def test_conntrack_sysctls_written_at_start_are_in_force_when_the_proxier_reads_the_host() -> None:
    settings = ConntrackSettings(max_per_core=32768, min=131072, udp_timeout_s=30.0, tcp_be_liberal=True)
    p, fake = make(config=replace(CONFIG, conntrack=settings))
    setup_conntrack(replace(CONFIG, conntrack=settings), fake.command, cpus=2)  # as agent.app.run does
    p.sync(two_services(), NODE)
    p.sync(two_services(), NODE)
    writes = [c[2] for c in fake.commands if c[:2] == ["sysctl", "-w"] and "netfilter" in c[2]]
    assert writes == [
        "net.netfilter.nf_conntrack_max=131072",  # max(32768 x 2 CPUs, 131072)
        "net.netfilter.nf_conntrack_tcp_timeout_established=86400",
        "net.netfilter.nf_conntrack_tcp_timeout_close_wait=3600",
        "net.netfilter.nf_conntrack_tcp_be_liberal=1",
        "net.netfilter.nf_conntrack_udp_timeout=30",
    ]
    # kube-proxy sets be_liberal before its proxier reads it: then no INVALID drop is written.
    assert "INVALID" not in fake.restores[0]
