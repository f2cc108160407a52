"""Replacing kube-proxy: its rules go, kubelet's and everyone else's stay (fake iptables and nft)."""

from __future__ import annotations

import logging

import pytest

from agent.iptables import IptablesProxier
from agent.iptables.kube_proxy_cleanup import cleanup_kube_proxy
from agent.iptables.runner import IptablesRunner, Result
from tests.iptables.fakes import FakeCounters, FakeRunner
from tests.iptables.objects import CONFIG, NODE, endpoints, service, state

KUBELET_AND_FOREIGN = """
-t mangle -N KUBE-IPTABLES-HINT
-t mangle -N KUBE-KUBELET-CANARY
-t nat -N KUBE-KUBELET-CANARY
-t filter -N KUBE-FIREWALL
-t filter -A KUBE-FIREWALL -m mark --mark 0x8000/0x8000 -j DROP
-t filter -A INPUT -j KUBE-FIREWALL
-t filter -A INPUT -s 1.2.3.4 -j ACCEPT
-t nat -N DOCKER
-t nat -A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER
"""
# A jump as an older kube-proxy spelled it (no comment) and a chain of kube-proxy < 1.24.
OLD_KUBE_PROXY = """
-t nat -I PREROUTING -j KUBE-SERVICES
-t nat -N KUBE-XLB-AAAAAAAAAAAAAAAA
-t nat -A KUBE-XLB-AAAAAAAAAAAAAAAA -j KUBE-MARK-MASQ
"""


def kube_proxy_node() -> FakeRunner:
    """A fake iptables holding what a kube-proxy in iptables mode left (written by our proxier,
    which writes kube-proxy's layout byte for byte), plus kubelet's chains and foreign rules."""
    fake = FakeRunner()
    fake.load(KUBELET_AND_FOREIGN)
    s = state(
        service("a", "10.96.0.5", ("http", 80, "TCP"), type="NodePort", node_port=30080),
        endpoints("a", [("http", 80, "TCP")], "10.244.2.5"),
        service("lonely", "10.96.0.6", ("http", 80, "TCP")),  # no endpoints: filter rules only
    )
    IptablesProxier(CONFIG, runner=fake, backend_runner=lambda _: fake, counters=FakeCounters()).sync(s, NODE)
    fake.load(OLD_KUBE_PROXY)
    return fake


def nft_responder(tables: list[str]) -> tuple[list[list[str]], object]:
    deleted: list[list[str]] = []

    def respond(argv: list[str]) -> Result:
        if argv[1:3] == ["list", "tables"]:
            return Result(0, "".join(f"table {t}\n" for t in tables))
        if argv[1:3] == ["delete", "table"]:
            deleted.append(argv[3:])
            return Result(0)
        return Result(1, "", "unexpected")

    return deleted, respond


def test_kube_proxys_chains_and_tables_go_and_nothing_else() -> None:
    fake = kube_proxy_node()
    legacy = FakeRunner()
    deleted, respond = nft_responder(["ip kube-proxy", "ip6 kube-proxy", "inet filter", "ip nat"])
    fake.responses["nft"] = respond  # type: ignore[assignment]
    runners: dict[str, IptablesRunner] = {"nft": fake, "legacy": legacy}
    firewall = fake.rules("filter", "KUBE-FIREWALL")
    report = cleanup_kube_proxy(CONFIG, runners)

    assert report.errors == []
    for table in ("filter", "nat", "mangle"):
        left = {c for c in fake.chains(table) if c.startswith("KUBE-")}
        assert left <= {"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT"}, (table, left)
    assert fake.chains("mangle") >= {"KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"}
    assert "KUBE-KUBELET-CANARY" in fake.chains("nat")
    # KUBE-FIREWALL is left as it is, as kube-proxy's own cleanup leaves it.
    assert fake.rules("filter", "KUBE-FIREWALL") == firewall != []
    assert fake.rules("filter", "INPUT") == ["-j KUBE-FIREWALL", "-s 1.2.3.4 -j ACCEPT"]
    assert fake.rules("nat", "PREROUTING") == ["-m addrtype --dst-type LOCAL -j DOCKER"]
    assert fake.rules("filter", "FORWARD") == [] and fake.rules("nat", "OUTPUT") == []
    assert "KUBE-XLB-AAAAAAAAAAAAAAAA" in report.iptables["nft"].chains_deleted["nat"]
    assert deleted == [["ip", "kube-proxy"], ["ip6", "kube-proxy"]]
    assert report.nft_tables == ["ip kube-proxy", "ip6 kube-proxy"]
    assert report.iptables["legacy"].chains_deleted == {}


def test_a_clean_node_is_left_as_it_is() -> None:
    fake = FakeRunner()
    fake.load(KUBELET_AND_FOREIGN)
    before = fake.save()
    _, respond = nft_responder(["inet filter"])
    fake.responses["nft"] = respond  # type: ignore[assignment]
    report = cleanup_kube_proxy(CONFIG, {"nft": fake})
    assert not report.removed_anything and report.errors == []
    assert fake.save() == before and fake.restores == []


def test_iptables_mode_retries_kube_proxys_nft_tables_at_each_sync_and_hands_ebpf_back_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """iptables mode's take-over once its rules serve: the eBPF hand-back runs once; kube-proxy's
    nftables tables are tried again at each sync until they are gone, the failure said once."""
    handbacks: list[str] = []

    class Handback:
        pending = True  # a switch from eBPF mode

        def __init__(self, config: object) -> None:
            pass

        def run(self) -> bool:
            handbacks.append("run")
            return True

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", Handback)
    fake = FakeRunner()
    listed: list[int] = []
    answers = [Result(1, "", "netlink: Operation not permitted")]

    def respond(argv: list[str]) -> Result:
        listed.append(1)
        return answers[0] if answers else Result(0, "")

    fake.responses["nft"] = respond
    p = IptablesProxier(CONFIG, runner=fake, backend_runner=lambda _: fake, counters=FakeCounters())
    for _ in range(3):
        p.sync(state(service("web", "10.96.0.10", ("http", 80, "TCP"))), NODE)
    assert handbacks == ["run"] and len(listed) == 3
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "ip kube-proxy and ip6 kube-proxy" in warned[0], warned
    answers.clear()
    for _ in range(2):
        p.sync(state(service("web", "10.96.0.10", ("http", 80, "TCP"))), NODE)
    assert len(listed) == 4, "done at the fourth sync, not tried after"


def test_a_hand_back_that_detached_some_devices_only_is_tried_again_at_the_next_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EbpfHandback.run returns False after a partial detach (the pins stay): the next sync runs
    the same hand-back again (it remembers the devices detached), until it returns True."""
    made: list[object] = []
    outcomes = [False, True]
    runs: list[object] = []

    class Handback:
        pending = True

        def __init__(self, config: object) -> None:
            made.append(self)

        def run(self) -> bool:
            runs.append(self)
            return outcomes.pop(0)

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", Handback)
    fake = FakeRunner()
    fake.responses["nft"] = lambda argv: Result(0, "")
    p = IptablesProxier(CONFIG, runner=fake, backend_runner=lambda _: fake, counters=FakeCounters())
    for _ in range(3):
        p.sync(state(service("web", "10.96.0.10", ("http", 80, "TCP"))), NODE)
    assert len(runs) == 2 and len(made) == 1 and runs == made * 2
