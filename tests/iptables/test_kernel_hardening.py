"""The hardened iptables mode against real iptables, in throwaway network namespaces.

Drift repaired within one full sync, a rejected service port isolated by the real iptables-restore,
nfacct counters created and counting, kube-proxy's conntrack sysctls applied where the kernel
allows, `--cleanup` leaving nothing of ours, and a previous kube-proxy's rules removed.
"""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest

from agent.config import Config
from agent.iptables import IptablesProxier, read_nfacct_counters
from agent.iptables.kube_proxy_cleanup import cleanup_kube_proxy
from agent.iptables.runner import Result, SubprocessRunner
from agent.model import ProxyState
from agent.model.types import Protocol, ServicePortName
from agent.netns import run_in_netns
from agent.nodeinit import setup_conntrack
from lab.netns import scratch_netns
from tests.iptables.objects import CONFIG, NODE, endpoints, service, state

pytestmark = pytest.mark.kernel

BACKENDS = ["nft", "legacy"]
WEB = ServicePortName("ns", "web", "http", Protocol.TCP)


def sh(*argv: str, check: bool = True) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed: {p.stderr}")
    return p.stdout


@pytest.fixture
def netns() -> Iterator[str]:
    # Its own xtables lock: the in-process proxier's iptables-legacy never waits on the host's.
    with scratch_netns("ekpt") as name:
        yield name


def save(ns: str, backend: str) -> str:
    out = sh("ip", "netns", "exec", ns, f"iptables-{backend}-save")
    return "\n".join(
        re.sub(r"\[\d+:\d+\]", "", line) for line in out.splitlines() if not line.startswith("#")
    )


def ipt(ns: str, backend: str, *args: str) -> None:
    sh("ip", "netns", "exec", ns, f"iptables-{backend}", "-w", "5", *args)


def cfg(ns: str, backend: str) -> Config:
    return replace(CONFIG, netns=ns, iptables_backend=backend)


def cluster(web_endpoint: str = "10.244.2.5") -> ProxyState:
    return state(
        service("web", "10.96.0.5", ("http", 80, "TCP"), type="NodePort", node_port=30080),
        endpoints("web", [("http", 80, "TCP")], web_endpoint),
        service("api", "10.96.0.7", ("https", 443, "TCP")),
        endpoints("api", [("https", 443, "TCP")], "10.244.2.7", "10.244.2.8"),
        service("lonely", "10.96.0.9", ("http", 80, "TCP"), type="NodePort", node_port=30090),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_nat_flushed_without_delete_is_restored_within_one_full_sync(netns: str, backend: str) -> None:
    p = IptablesProxier(cfg(netns, backend))
    p.sync(cluster(), NODE)
    before = save(netns, backend)
    ipt(netns, backend, "-t", "nat", "-F")  # rules gone; chains, KUBE-PROXY-CANARY included, stay
    assert ":KUBE-PROXY-CANARY" in save(netns, backend)
    partial = p.sync(cluster(), NODE, frozenset())
    # A partial sync reads nothing back; it rewrites the top-level chains, and only those.
    assert partial.repaired == 0
    result = p.sync(cluster(), NODE)
    # The 6 service chains that had rules (web: SVC, SEP, EXT; api: SVC, 2 SEP) and the jumps
    # from PREROUTING, OUTPUT and POSTROUTING.
    assert result.full and result.repaired == 6 + 3
    assert save(netns, backend) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_rules_edited_by_hand_are_put_back_and_nothing_else_is_rewritten(netns: str, backend: str) -> None:
    p = IptablesProxier(cfg(netns, backend))
    p.sync(cluster(), NODE)
    before = save(netns, backend)
    svc_chain = next(
        line.split()[0][1:]
        for line in before.splitlines()
        if line.startswith(":KUBE-SVC-") and "api" not in line
    )
    ipt(netns, backend, "-t", "nat", "-I", svc_chain, "1", "-s", "6.6.6.6/32", "-j", "ACCEPT")
    ipt(netns, backend, "-t", "filter", "-D", "KUBE-SERVICES", "1")  # lonely's REJECT
    result = p.sync(cluster(), NODE)
    assert result.repaired == 2
    assert save(netns, backend) == before
    assert p.last_sync is not None and p.last_sync.services_written == 1


class RejectingRunner(SubprocessRunner):
    """Real iptables, fed a value it refuses wherever `marker` appears: a kernel or iptables that
    will not take one service's rules."""

    def __init__(self, config: Config, marker: str, bad: str) -> None:
        super().__init__(config)
        self.marker, self.bad = marker, bad
        self.tests = 0

    def command(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        if stdin is not None:
            stdin = stdin.replace(self.marker, self.bad)
        if "--test" in argv:
            self.tests += 1
        return super().command(argv, stdin)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_service_port_iptables_restore_rejects_is_isolated(netns: str, backend: str) -> None:
    runner = RejectingRunner(cfg(netns, backend), "10.244.2.66", "10.244.2.666")
    p = IptablesProxier(cfg(netns, backend), runner=runner)
    p.sync(cluster(), NODE)
    result = p.sync(cluster(web_endpoint="10.244.2.66"), NODE, frozenset({WEB}))
    assert set(result.failed) == {WEB}
    assert "10.244.2.666" in result.failed[WEB]  # the real iptables-restore's complaint
    assert 0 < runner.tests < 12
    saved = save(netns, backend)
    # web keeps its last programmed endpoint; the others are programmed as asked.
    assert "--to-destination 10.244.2.5:80" in saved
    assert "--to-destination 10.244.2.7:443" in saved and "--to-destination 10.244.2.8:443" in saved
    # The same state again (a full sync): still isolated, nothing else disturbed.
    again = p.sync(cluster(web_endpoint="10.244.2.66"), NODE)
    assert set(again.failed) == {WEB} and save(netns, backend) == saved


def test_nfacct_counters_exist_and_count_localhost_nodeport_packets(netns: str) -> None:
    sh("ip", "-n", netns, "link", "set", "lo", "up")
    p = IptablesProxier(cfg(netns, "nft"))
    p.sync(cluster(), NODE)
    assert read_nfacct_counters(netns) == {
        "ct_state_invalid_dropped_pkts": 0,
        "localhost_nps_accepted_pkts": 0,
    }
    saved = save(netns, "nft")
    assert "-m nfacct --nfacct-name  ct_state_invalid_dropped_pkts -j DROP" in saved
    assert '-d 127.0.0.0/8 -p tcp -m comment --comment "ns/web:http" -m tcp --dport 30080 -m nfacct' in saved

    def connect() -> None:
        s = socket.socket()
        s.settimeout(0.3)
        try:
            s.connect(("127.0.0.1", 30080))  # DNATed to an endpoint nobody answers for
        except OSError:
            pass
        finally:
            s.close()

    run_in_netns(netns, connect)
    assert read_nfacct_counters(netns)["localhost_nps_accepted_pkts"] >= 1
    assert read_nfacct_counters(netns, ["localhost_nps_accepted_pkts"]).keys() == {
        "localhost_nps_accepted_pkts"
    }


def test_conntrack_sysctls_in_a_node_namespace(netns: str, caplog: pytest.LogCaptureFixture) -> None:
    """agent.nodeinit.setup_conntrack (every start, both modes), kube-proxy's defaults: 24 h
    established, 1 h close-wait are written in the namespace;
    nf_conntrack_max is read-only outside the initial namespace: logged, and the sync goes on."""
    host_max = sh("sysctl", "-n", "net.netfilter.nf_conntrack_max").strip()
    setup_conntrack(cfg(netns, "nft"), cpus=64)  # 64 x 32768 > min, and > the host's value
    IptablesProxier(cfg(netns, "nft")).sync(cluster(), NODE)

    def get(key: str) -> str:
        return sh("ip", "netns", "exec", netns, "sysctl", "-n", f"net.netfilter.{key}").strip()

    assert get("nf_conntrack_tcp_timeout_established") == "86400"
    assert get("nf_conntrack_tcp_timeout_close_wait") == "3600"
    assert get("nf_conntrack_max") == host_max
    assert sh("sysctl", "-n", "net.netfilter.nf_conntrack_max").strip() == host_max  # the host untouched
    assert "cannot set net.netfilter.nf_conntrack_max=2097152" in caplog.text
    assert "only the initial network namespace" in caplog.text


@pytest.mark.parametrize("backend", BACKENDS)
def test_cleanup_removes_every_rule_of_ours_including_services_without_endpoints(
    netns: str, backend: str
) -> None:
    ipt(netns, backend, "-A", "FORWARD", "-s", "1.2.3.4", "-j", "ACCEPT")
    ipt(netns, backend, "-t", "nat", "-N", "KUBE-KUBELET-CANARY")
    p = IptablesProxier(cfg(netns, backend))
    p.sync(cluster(), NODE)
    assert "lonely:http has no endpoints" in save(netns, backend)
    # An extra copy of a jump, spelled differently (say, by an older version): goes too.
    ipt(netns, backend, "-t", "nat", "-A", "OUTPUT", "-j", "KUBE-SERVICES")
    p.cleanup()
    after = save(netns, backend)
    assert not re.search(r"KUBE-(?!KUBELET-CANARY)", after), after
    assert "-A FORWARD -s 1.2.3.4/32 -j ACCEPT" in after


def test_cleanup_kube_proxy_removes_its_rules_in_both_backends_and_its_nft_table(netns: str) -> None:
    # kube-proxy in iptables mode on the legacy backend (our proxier writes its layout), kubelet's
    # chains beside it; a kube-proxy nftables-mode table; foreign rules and tables everywhere.
    IptablesProxier(cfg(netns, "legacy")).sync(cluster(), NODE)
    ipt(netns, "legacy", "-t", "nat", "-N", "KUBE-XLB-AAAAAAAAAAAAAAAA")  # kube-proxy < 1.24
    ipt(netns, "legacy", "-t", "nat", "-A", "KUBE-XLB-AAAAAAAAAAAAAAAA", "-j", "KUBE-MARK-MASQ")
    ipt(netns, "legacy", "-t", "nat", "-I", "PREROUTING", "-j", "KUBE-SERVICES")
    ipt(netns, "legacy", "-t", "nat", "-N", "KUBE-KUBELET-CANARY")
    ipt(netns, "legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")
    ipt(netns, "legacy", "-A", "INPUT", "-s", "1.2.3.4", "-j", "ACCEPT")
    nft = ["ip", "netns", "exec", netns, "nft"]
    sh(*nft, "add table ip kube-proxy")
    sh(*nft, "add chain ip kube-proxy services { type nat hook prerouting priority -100 ; }")
    sh(*nft, "add rule ip kube-proxy services ip daddr 10.96.0.5 tcp dport 80 dnat to 10.244.2.5")
    sh(*nft, "add table inet someone-else")
    sh(*nft, "add chain inet someone-else input { type filter hook input priority 0 ; }")

    report = cleanup_kube_proxy(replace(CONFIG, netns=netns))
    assert report.errors == [] and report.nft_tables == ["ip kube-proxy"]
    legacy = save(netns, "legacy")
    left = set(re.findall(r"^:(KUBE-\S+)", legacy, re.MULTILINE))
    assert left == {"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT"}, legacy
    assert "-A INPUT -s 1.2.3.4/32 -j ACCEPT" in legacy
    assert not re.search(r"-j KUBE-(SERVICES|NODEPORTS|POSTROUTING|FORWARD|EXTERNAL|PROXY)", legacy)
    tables = sh(*nft, "list tables")
    assert "kube-proxy" not in tables and "table inet someone-else" in tables
    # Run again: nothing left to do.
    assert not cleanup_kube_proxy(replace(CONFIG, netns=netns)).removed_anything
