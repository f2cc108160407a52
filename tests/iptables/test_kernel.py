"""The iptables mode against real iptables (nft and legacy), in a throwaway network namespace.

Each test makes its own namespace `ekpt-<random>` and deletes it in a finally block, so nothing
on the host is touched: iptables rules and conntrack entries are per network namespace.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import replace

import pytest

from agent.config import Config
from agent.iptables import IptablesProxier, canonical, chains
from agent.iptables.conntrack import ConntrackCleaner
from agent.iptables.runner import IptablesError, SubprocessRunner
from agent.model import IPFamily, ProxyState
from agent.model.types import Protocol, ServicePortName
from lab.netns import XTABLES_LOCKFILE, flock_held, scratch_netns
from tests.iptables.golden_cases import case_inputs, case_names
from tests.iptables.objects import CONFIG, NODE, endpoints, service, state

pytestmark = pytest.mark.kernel

BACKENDS = ["nft", "legacy"]
HOST_XTABLES_LOCK = "/run/xtables.lock"  # iptables-legacy's without XTABLES_LOCKFILE


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


def save(ns: str, backend: str, binary: str = "iptables") -> str:
    """iptables-save (ip6tables-save) without comments and counters, for comparisons."""
    out = sh("ip", "netns", "exec", ns, f"{binary}-{backend}-save")
    return "\n".join(line for line in out.splitlines() if not line.startswith("#"))


def rules_of(saved: str, chain: str) -> list[str]:
    return [line for line in saved.splitlines() if line.startswith(f"-A {chain} ")]


def web(endpoint: str = "10.244.2.5") -> object:
    return state(
        service("web", "10.96.0.5", ("http", 80, "TCP"), type="NodePort", node_port=30080),
        endpoints("web", [("http", 80, "TCP")], endpoint),
        service("dns", "10.96.0.10", ("dns", 53, "UDP")),
        endpoints("dns", [("dns", 53, "UDP")], "10.244.2.2"),
    )


def cfg(ns: str, backend: str) -> Config:
    return replace(CONFIG, netns=ns, iptables_backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_is_idempotent_and_cleanup_keeps_foreign_rules(netns: str, backend: str) -> None:
    ipt = ["ip", "netns", "exec", netns, f"iptables-{backend}", "-w", "5"]
    sh(*ipt, "-A", "INPUT", "-s", "1.2.3.4", "-j", "ACCEPT")
    sh(*ipt, "-N", "FOREIGN-CHAIN")
    sh(*ipt, "-A", "FOREIGN-CHAIN", "-p", "tcp", "--dport", "22", "-j", "ACCEPT")
    sh(*ipt, "-t", "nat", "-N", "KUBE-KUBELET-CANARY")  # a KUBE- chain that is not ours

    # Every sync without a change set is a full one: the kernel is read back and compared.
    p = IptablesProxier(cfg(netns, backend))
    p.sync(web(), NODE)  # type: ignore[arg-type]
    first = save(netns, backend)
    svc = chains.service_chain(ServicePortName("ns", "web", "http", Protocol.TCP))
    for chain in (
        "KUBE-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
        svc,
        "KUBE-PROXY-CANARY",
    ):
        assert f":{chain} " in first, chain
    assert "KUBE-SEP-" in first and "KUBE-EXT-" in first
    assert rules_of(first, "PREROUTING") == [
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES'
    ]

    for _ in range(2):
        result = p.sync(web(), NODE)  # type: ignore[arg-type]
        # What iptables-save printed back means what we wrote: nothing to repair or rewrite.
        assert result.full and result.repaired == 0
        assert p.last_sync is not None and not p.last_sync.restored
    assert save(netns, backend) == first  # no duplicated jumps, no drift
    for base in ("INPUT", "FORWARD", "OUTPUT", "PREROUTING", "POSTROUTING"):
        rules = rules_of(first, base)
        assert len(rules) == len(set(rules)), (base, rules)

    p.cleanup()
    after = save(netns, backend)
    assert not re.search(r"^:KUBE-(?!KUBELET-CANARY)", after, re.MULTILINE), after
    assert "-A INPUT -s 1.2.3.4/32 -j ACCEPT" in after
    assert "-A FOREIGN-CHAIN -p tcp -m tcp --dport 22 -j ACCEPT" in after
    assert ":KUBE-KUBELET-CANARY" in after


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_sync_replaces_the_endpoint_chain_in_the_kernel(netns: str, backend: str) -> None:
    p = IptablesProxier(cfg(netns, backend))
    spn = ServicePortName("ns", "web", "http", Protocol.TCP)
    p.sync(web("10.244.2.5"), NODE)  # type: ignore[arg-type]
    p.sync(web("10.244.2.6"), NODE, frozenset({spn}))  # type: ignore[arg-type]
    assert p.last_sync is not None and not p.last_sync.full
    saved = save(netns, backend)
    assert f":{chains.endpoint_chain(spn, '10.244.2.6:80')} " in saved
    assert f":{chains.endpoint_chain(spn, '10.244.2.5:80')} " not in saved
    assert "--to-destination 10.244.2.6:80" in saved


def test_a_legacy_sync_takes_its_namespaces_own_xtables_lock(netns: str) -> None:
    """The proxier's and the test's iptables calls share the namespace's own lock (issue 18):
    held, it holds up a legacy sync, which waits its `-w 5` out and fails naming the lock; so
    the sync does not take the machine's /run/xtables.lock (never touched here: others use it)."""
    own = os.environ[XTABLES_LOCKFILE]
    assert own != HOST_XTABLES_LOCK
    # A private lock held for as long as the block runs: no timing window to race.
    with flock_held(own, 60), pytest.raises(IptablesError, match="xtables lock"):
        IptablesProxier(cfg(netns, "legacy")).sync(web(), NODE)  # type: ignore[arg-type]
    IptablesProxier(cfg(netns, "legacy")).sync(web(), NODE)  # type: ignore[arg-type]
    assert ":KUBE-SERVICES " in save(netns, "legacy")


def test_auto_backend_follows_the_rules_already_there(netns: str) -> None:
    IptablesProxier(cfg(netns, "legacy")).sync(web(), NODE)  # type: ignore[arg-type]
    assert SubprocessRunner(cfg(netns, "auto")).backend == "legacy"
    IptablesProxier(cfg(netns, "legacy")).cleanup()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", case_names())
def test_every_golden_file_loads_into_real_iptables(netns: str, backend: str, case: str) -> None:
    st, node, config = case_inputs(case)
    p = IptablesProxier(replace(config, netns=netns, iptables_backend=backend), family=st.family)
    p.sync(st, node)
    saved = save(netns, backend, "ip6tables" if st.family is IPFamily.IPv6 else "iptables")
    assert "-A KUBE-SERVICES" in saved
    assert "--or-mark 0x4000" in saved or "--set-xmark 0x4000/0x4000" in saved
    # Every chain read back from the kernel compares equal, by meaning, to the text we wrote.
    written = canonical.chain_digests(canonical.parse(p.render(st, node)))
    kernel = canonical.chain_digests(canonical.parse(saved))
    assert {k for k, d in written.items() if kernel.get(k) != d} == set()
    result = p.sync(st, node)
    assert result.repaired == 0 and p.last_sync is not None and not p.last_sync.restored


@pytest.mark.parametrize("backend", BACKENDS)
def test_ip6tables_takes_a_masquerade_kept_out_of_the_bpf_snat_ports_and_reads_it_back_the_same(
    netns: str, backend: str
) -> None:
    """eBPF mode's ip6tables beside the tc IPv6 path (agent/iptables/rules.py
    masquerade_ports_beside): the kernel takes TCP's and UDP's MASQUERADE --to-ports with --random-fully
    before kube-proxy's, and the chain read back is the one written (no repair at the next sync)."""
    from agent.config import HostRouting, Mode

    st, node, config = case_inputs("ipv6-nodeport")
    ebpf6 = replace(config, mode=Mode.EBPF, bpf_host_routing=HostRouting.BPF)
    ebpf6 = replace(ebpf6, netns=netns, iptables_backend=backend)
    assert ebpf6.tc_ipv6
    p = IptablesProxier(ebpf6, family=IPFamily.IPv6)
    p.sync(st, node)
    saved = save(netns, backend, "ip6tables")
    tcp, udp, rest = rules_of(saved, "KUBE-POSTROUTING")[-3:]
    assert "-p tcp" in tcp and tcp.endswith("-j MASQUERADE --to-ports 1024-60999 --random-fully")
    assert "-p udp" in udp and udp.endswith("-j MASQUERADE --to-ports 1024-60999 --random-fully")
    assert rest.endswith("-j MASQUERADE --random-fully")
    written = canonical.chain_digests(canonical.parse(p.render(st, node)))
    kernel = canonical.chain_digests(canonical.parse(saved))
    assert {k for k, d in written.items() if kernel.get(k) != d} == set()
    assert p.sync(st, node).repaired == 0
    # what a restart reads before it keeps an earlier run's IPv6 SNAT grant: this spelling is
    # eBPF mode's shape, iptables mode's rules over it are not
    from agent.app import masquerade6_kept_out

    assert masquerade6_kept_out(ebpf6)
    IptablesProxier(replace(ebpf6, mode=Mode.IPTABLES), family=IPFamily.IPv6).sync(st, node)
    assert not masquerade6_kept_out(ebpf6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ip6tables_withdrawn_to_the_health_check_accepts_keeps_its_jump_ahead_of_a_reject(
    netns: str, backend: str
) -> None:
    """eBPF mode's withdrawn ip6tables (agent/iptables/proxier.py `withdraw`): the kernel takes the
    one restore that deletes our jumps (`-D`), inserts INPUT's jump first (`-I INPUT 1`) and writes
    the ACCEPTs; a node's `-A INPUT -j REJECT` stays after the jump, there and once the rules are
    back; read back, the withdrawn rules are what `withdrawal` wants (no rewrite at a resync)."""
    from agent.config import HostRouting, Mode
    from agent.iptables.cleanup import withdrawal
    from agent.iptables.rules import health_check_accepts

    st, node, config = case_inputs("ipv6-loadbalancer-local")
    ebpf6 = replace(
        config, mode=Mode.EBPF, bpf_host_routing=HostRouting.BPF, netns=netns, iptables_backend=backend
    )
    sh("ip", "netns", "exec", netns, f"ip6tables-{backend}", "-w", "5", "-A", "INPUT", "-j", "REJECT")
    p = IptablesProxier(ebpf6, family=IPFamily.IPv6)
    p.sync(st, node)
    p.withdraw(st, full=False)
    saved = save(netns, backend, "ip6tables")
    accepts = health_check_accepts(st, 6)
    held = [
        canonical.canonical_rule(r.removeprefix("-A KUBE-NODEPORTS "))
        for r in rules_of(saved, "KUBE-NODEPORTS")
    ]
    assert accepts and held == [canonical.canonical_rule(a) for a in accepts]
    assert rules_of(saved, "INPUT") == [
        '-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS',
        "-A INPUT -j REJECT --reject-with icmp6-port-unreachable",
    ]
    assert "conntrack" not in saved and not [
        line for line in saved.splitlines() if line.startswith(":KUBE-SVC")
    ]
    assert withdrawal(canonical.parse(saved), accepts) == ""
    p.withdraw(st, full=True)
    assert save(netns, backend, "ip6tables") == saved
    p.sync(st, node)
    assert rules_of(save(netns, backend, "ip6tables"), "INPUT")[-1].startswith("-A INPUT -j REJECT")


def test_stale_udp_conntrack_entries_are_deleted_and_serving_ones_kept(netns: str) -> None:
    def insert(reply_src: str, sport: int) -> None:
        sh(
            "ip", "netns", "exec", netns, "conntrack", "-I", "-p", "udp",
            "-s", "10.244.1.5", "-d", "10.96.0.10", "--sport", str(sport), "--dport", "53",
            "--reply-src", reply_src, "--reply-dst", "10.244.1.5",
            "--reply-port-src", "53", "--reply-port-dst", str(sport), "-t", "120",
        )  # fmt: skip

    insert("10.244.2.2", 40000)  # the DNS pod that was replaced
    insert("10.244.2.3", 40001)  # the new one
    runner = SubprocessRunner(cfg(netns, "nft"))
    applied = ConntrackCleaner(runner.command).clean(
        state(
            service("dns", "10.96.0.10", ("dns", 53, "UDP")),
            endpoints("dns", [("dns", 53, "UDP")], "10.244.2.3"),
        )
    )
    assert len(applied) == 1
    listed = sh("ip", "netns", "exec", netns, "conntrack", "-L", "-p", "udp")
    assert "sport=40001" in listed
    assert "sport=40000" not in listed


ECHO_SERVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 5353))
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(512)
    s.sendto(sys.argv[1].encode(), peer)
"""

CLIENT = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 40000))
s.settimeout(2)
for line in sys.stdin:
    s.sendto(b"q", ("10.96.0.10", 53))
    try:
        print(s.recvfrom(512)[0].decode(), flush=True)
    except socket.timeout:
        print("timeout", flush=True)
"""


def test_udp_client_follows_a_replaced_dns_pod(netns: str) -> None:
    """kube-dns through the rules: a client keeping its source port reaches the new pod after the
    endpoint changes, because the stale conntrack entry is cleared (without the cleanup it would
    keep talking to the old pod)."""
    pods = {"pod1": ("10.244.1.2", f"{netns}-p1"), "pod2": ("10.244.1.3", f"{netns}-p2")}
    procs: list[subprocess.Popen[str]] = []
    try:
        ip = ["ip", "-n", netns]
        sh(*ip, "link", "set", "lo", "up")
        sh(*ip, "addr", "add", "192.168.0.11/32", "dev", "lo")
        for i, (name, (addr, pod_ns)) in enumerate(pods.items()):
            sh("ip", "netns", "add", pod_ns)
            host_if = f"veth{i}"
            sh(*ip, "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", pod_ns)
            sh(*ip, "addr", "add", "10.244.1.1/32", "dev", host_if)
            sh(*ip, "link", "set", host_if, "up")
            sh(*ip, "route", "add", f"{addr}/32", "dev", host_if)
            sh("ip", "-n", pod_ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            sh("ip", "-n", pod_ns, "link", "set", "eth0", "up")
            sh("ip", "-n", pod_ns, "route", "add", "default", "via", "10.244.1.1", "dev", "eth0", "onlink")
            server = subprocess.Popen(
                ["ip", "netns", "exec", pod_ns, "python3", "-c", ECHO_SERVER, name],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(server)
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        sh(*ip, "route", "add", "10.96.0.0/12", "dev", "veth0")  # any route: DNAT re-routes

        def dns(*eps: str) -> ProxyState:
            return state(
                service("dns", "10.96.0.10", ("dns", 53, "UDP"), namespace="kube-system"),
                endpoints("dns", [("dns", 5353, "UDP")], *eps, namespace="kube-system"),
            )

        p = IptablesProxier(cfg(netns, "nft"))
        p.sync(dns("10.244.1.2"), NODE)
        client = subprocess.Popen(
            ["ip", "netns", "exec", netns, "python3", "-c", CLIENT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(client)
        assert client.stdin is not None and client.stdout is not None

        def ask() -> str:
            client.stdin.write("\n")  # type: ignore[union-attr]
            client.stdin.flush()  # type: ignore[union-attr]
            return client.stdout.readline().strip()  # type: ignore[union-attr]

        assert ask() == "pod1"
        assert ask() == "pod1"
        p.sync(dns("10.244.1.3"), NODE)  # the DNS pod is replaced (pod1 still answers if reached)
        assert p.last_sync is not None and p.last_sync.conntrack_filters == 1
        assert ask() == "pod2"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for _, pod_ns in pods.values():
            sh("ip", "netns", "delete", pod_ns, check=False)
