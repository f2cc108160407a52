"""`--cleanup` removes our chains and jumps and leaves everything else (fake iptables)."""

from __future__ import annotations

from agent.iptables import IptablesProxier
from agent.iptables.chains import KUBE_FIREWALL, is_service_chain
from tests.iptables.fakes import FakeCounters, FakeRunner
from tests.iptables.objects import CONFIG, NODE, endpoints, service, state

FOREIGN = """
-t filter -A INPUT -s 1.2.3.4 -j ACCEPT
-t filter -N FOREIGN-CHAIN
-t filter -A FOREIGN-CHAIN -p tcp --dport 22 -j ACCEPT
-t filter -A FORWARD -j FOREIGN-CHAIN
-t nat -N DOCKER
-t nat -A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER
-t nat -A POSTROUTING -s 172.17.0.0/16 -j MASQUERADE
"""


def synced() -> tuple[IptablesProxier, FakeRunner]:
    fake = FakeRunner()
    fake.load(FOREIGN)
    p = IptablesProxier(CONFIG, runner=fake, backend_runner=lambda _: fake, counters=FakeCounters())
    s = state(
        service("a", "10.96.0.5", ("http", 80, "TCP"), type="NodePort", node_port=30080),
        endpoints("a", [("http", 80, "TCP")], "10.244.2.5"),
    )
    p.sync(s, NODE)
    return p, fake


def test_cleanup_removes_ours_and_keeps_foreign_rules_and_chains() -> None:
    p, fake = synced()
    assert any(c.startswith("KUBE-") for c in fake.chains("nat"))
    p.cleanup()
    for table in ("filter", "nat", "mangle"):
        assert not any(c.startswith("KUBE-") for c in fake.chains(table)), (table, fake.chains(table))
        assert not any(is_service_chain(c) for c in fake.chains(table))
    assert fake.rules("filter", "INPUT") == ["-s 1.2.3.4 -j ACCEPT"]
    assert fake.rules("filter", "FORWARD") == ["-j FOREIGN-CHAIN"]
    assert fake.rules("filter", "FOREIGN-CHAIN") == ["-p tcp --dport 22 -j ACCEPT"]
    assert fake.rules("nat", "PREROUTING") == ["-m addrtype --dst-type LOCAL -j DOCKER"]
    assert fake.rules("nat", "POSTROUTING") == ["-s 172.17.0.0/16 -j MASQUERADE"]
    assert fake.rules("filter", "OUTPUT") == []


def test_cleanup_keeps_kube_firewall_holding_someone_elses_rule() -> None:
    p, fake = synced()
    fake.run("-t", "filter", "-A", KUBE_FIREWALL, "-m", "mark", "--mark", "0x8000/0x8000", "-j", "DROP")
    p.cleanup()
    assert fake.rules("filter", KUBE_FIREWALL) == ["-m mark --mark 0x8000/0x8000 -j DROP"]
    assert "-j KUBE-FIREWALL" in fake.rules("filter", "INPUT")
    assert "KUBE-SERVICES" not in fake.chains("filter")


def test_cleanup_of_a_clean_node_changes_nothing() -> None:
    fake = FakeRunner()
    fake.load(FOREIGN)
    before = fake.save()
    IptablesProxier(CONFIG, runner=fake, backend_runner=lambda _: fake, counters=FakeCounters()).cleanup()
    assert fake.save() == before
    assert fake.restores == []
