"""eBPF mode's ip6tables beside the tc programs' IPv6 path (agent/metaproxier.py EbpfAndIp6tables):
the rules of the service ports the eBPF programs leave to the stack only (agent/model/tc6_leaves.py),
and the order that never leaves a frontend to neither. Real ip6tables proxier, fake runner."""

from __future__ import annotations

from typing import Any

import pytest

from agent.config import Config, HostRouting, Mode, NodeContext
from agent.iptables import IptablesProxier
from agent.model.state import build_state
from agent.model.types import IPFamily, NodeInfo, ProxyState, ServicePortName
from agent.proxier import SyncResult
from tests.agent.test_daemon import spn
from tests.agent.test_dual_stack_agent import NODE6, V6_CIDRS, HandbackRecorder, dual, slice6
from tests.iptables.fakes import FakeCounters, FakeRunner
from tests.model.test_state import service

CONFIG = Config(mode=Mode.EBPF, hostname="node1", cluster_cidr=V6_CIDRS, bpf_host_routing=HostRouting.BPF)


class Maps:
    """The eBPF half: the tc IPv6 path serves; its sync sets the grant to `grant_next` (and its
    preview says so: every reason but the restore's outcome is known before it), unless `refuse`
    (a reason that came up between the preview and the sync); it fails the ports of `failing` and
    raises `broken`."""

    def __init__(self, calls: list[str], *, serves: bool = True) -> None:
        self.calls = calls
        self.tc_serves = serves
        self.snat_granted = False
        self.grant_next = False
        self.refuse = False
        self.apart = False
        self.failing: dict[ServicePortName, str] = {}
        self.broken: Exception | None = None
        self.preview_error: Exception | None = None

    def prepare(self) -> None:
        pass

    def masquerade_apart(self, apart: bool) -> None:
        self.calls.append("apart" if apart else "not apart")
        self.apart = self.apart or apart  # a failed restore changes no rule (as masquerade6_apart_is)

    def snat_preview(self, node: NodeContext) -> bool:
        if self.preview_error is not None:
            raise self.preview_error
        return self.grant_next

    def sync(self, state: ProxyState, node: NodeContext, changed: Any = None) -> SyncResult:
        self.calls.append("maps")
        self.snat_granted = self.grant_next and self.apart and not self.refuse  # as _snat6_refusal
        if self.broken is not None:
            raise self.broken
        return SyncResult(full=changed is None, failed=dict(self.failing))

    def cleanup(self) -> None:
        pass


class Recorded:
    """The real ip6tables proxier, its calls recorded in the same list as the maps'."""

    def __init__(self, inner: IptablesProxier, calls: list[str]) -> None:
        self.inner, self.calls = inner, calls
        self.fail = 0  # restores to fail (as a failed ip6tables-restore raises)
        self.fail_withdraw = 0  # withdraws to fail

    def prepare(self) -> None:
        self.inner.prepare()

    def sync(self, state: ProxyState, node: NodeContext, changed: Any = None) -> SyncResult:
        self.calls.append("restore")
        if self.fail:
            self.fail -= 1
            raise RuntimeError("ip6tables-restore failed (fake)")
        return self.inner.sync(state, node, changed)

    def withdraw(self, state: ProxyState, *, full: bool) -> SyncResult:
        self.calls.append("withdraw")
        if self.fail_withdraw:
            self.fail_withdraw -= 1
            raise RuntimeError("ip6tables-restore failed (fake)")
        return self.inner.withdraw(state, full=full)

    def cleanup(self) -> None:
        self.inner.cleanup()


WEB, API = spn("web"), spn("kubernetes")


def nat_flow_lives() -> bool:
    """A translated IPv6 flow in nf_conntrack (the rules of an empty state stay for it): these tests
    are about which ports get rules; test_nothing_left_* below about no flow holding them."""
    return True


def kept() -> None:
    """EbpfAndIp6tables `forget` where nf_conntrack is not looked at (a withdraw's flush)."""


def state(api_on_node: bool = True) -> ProxyState:
    """A dual-stack Service (its IPv6 half, a remote endpoint) and one whose endpoint is the node's
    own IPv6 address (a host-network backend, as `kubernetes` on a control-plane node)."""
    api_ip = NODE6.node_ips[0] if api_on_node else "fd00:10:244:2::9"
    return build_state(
        [dual(), service("kubernetes", clusterIP="fd00:10:96::1", ipFamilies=["IPv6"])],
        [
            slice6("web-v6", "fd00:10:244:2::2"),
            slice6("api-v6", api_ip, svc="kubernetes", node="node1" if api_on_node else "node2"),
        ],
        NodeInfo("node1"),
        family=IPFamily.IPv6,
    ).state


def services_chain(runner: FakeRunner) -> list[str]:
    return [line for line in runner.save("nat").splitlines() if line.startswith("-A KUBE-SERVICES ")]


def jumped(runner: FakeRunner) -> set[str]:
    """The service ports KUBE-SERVICES sends to a chain of their own (by the comment's name)."""
    return {
        name
        for line in services_chain(runner)
        for name in ("default/web:http", "default/kubernetes:http")
        if f'"{name} cluster IP"' in line
    }


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Maps, FakeRunner, list[str]]:
    from agent.app import ip6tables_beside_ebpf
    from agent.metaproxier import EbpfAndIp6tables

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    calls: list[str] = []
    runner = FakeRunner()
    maps = Maps(calls)
    ip6 = Recorded(ip6tables_beside_ebpf(CONFIG, runner, counters=FakeCounters()), calls)
    both = EbpfAndIp6tables(maps, ip6, CONFIG, nat_live=nat_flow_lives, forget=kept)
    both.recorded = ip6  # type: ignore[attr-defined]
    return both, maps, runner, calls


def test_ip6tables_beside_the_tc_ipv6_path_keeps_only_what_it_leaves_and_hands_over_in_order(
    rig: tuple[Any, Maps, FakeRunner, list[str]],
) -> None:
    both, maps, runner, calls = rig
    s = state()
    # Not granted (every load starts so): with the IPv6 detector, every ClusterIP's non-local
    # traffic is masqueraded, which only ip6tables does then: every port keeps its rules.
    result = both.sync(s, NODE6, None)
    assert calls == ["restore", "apart", "maps"] and result.again == frozenset()
    assert jumped(runner) == {"default/web:http", "default/kubernetes:http"}
    assert "10.96.0.10" not in runner.save(), "the dual-stack Service's IPv4 half is not ip6tables'"
    # The grant comes with this sync's maps: tc serves at once, the rules stay until the next sync.
    calls.clear()
    maps.grant_next = True
    result = both.sync(s, NODE6, frozenset())
    assert calls == ["restore", "apart", "maps"] and result.again == {WEB, API}
    assert jumped(runner) == {"default/web:http", "default/kubernetes:http"}
    calls.clear()
    result = both.sync(s, NODE6, result.again)
    assert calls == ["restore", "apart", "maps"] and result.again == frozenset()
    # Granted: nothing is left to ip6tables, the host-network backend's Service neither (the tc
    # IPv6 path serves it since v6legacy); every Service's chains are gone.
    assert jumped(runner) == set()
    assert "fd00:10:96::a" not in runner.save("nat") and "fd00:10:96::a" not in runner.save("filter")
    assert "-A KUBE-POSTROUTING" in runner.save("nat"), "the masquerade the grant depends on stays"
    # The grant goes off for a reason known before the maps' sync (the node's address gone, flows
    # holding ports of the range): the ports it hands back get their rules in the restore before
    # the maps write ekp_cfg6 zero, one restore.
    calls.clear()
    maps.grant_next = False
    restores = len(runner.restores)
    result = both.sync(s, NODE6, frozenset())
    assert calls == ["restore", "apart", "maps"] and len(runner.restores) == restores + 1
    assert "fd00:10:96::a" in runner.restores[-1], "web's rules in the restore before the maps"
    assert jumped(runner) == {"default/web:http", "default/kubernetes:http"} and result.again == frozenset()
    # A reason that came up between the preview and the maps' sync: restored after the maps.
    maps.grant_next = True
    result = both.sync(s, NODE6, frozenset())
    both.sync(s, NODE6, result.again)
    assert jumped(runner) == set() and maps.snat_granted
    calls.clear()
    maps.refuse = True
    both.sync(s, NODE6, frozenset())
    assert calls == ["restore", "apart", "maps", "restore", "apart"]
    assert jumped(runner) == {"default/web:http", "default/kubernetes:http"}


def test_a_port_whose_host_backend_leaves_keeps_its_rules_until_the_maps_serve_it(
    rig: tuple[Any, Maps, FakeRunner, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-over's order for a port that leaves the set and joins it again, with a path that
    hands host-backend frontends to the stack (Tc6Facts.leaves_host_backends, injected: the tc
    IPv6 path of before v6legacy; today's serves them, TC6_LEAVES_HOST_BACKENDS false)."""
    monkeypatch.setattr("agent.metaproxier.TC6_LEAVES_HOST_BACKENDS", True)
    both, maps, runner, calls = rig
    maps.snat_granted = maps.grant_next = True
    result = both.sync(state(), NODE6, None)
    both.sync(state(), NODE6, result.again)
    assert jumped(runner) == {"default/kubernetes:http"}
    # The backend moves off the node: the maps of the last sync still hand the frontend to the
    # stack (EKP_FE_HOST_BACKEND) until this sync writes them, so its rules stay for one more.
    moved = state(api_on_node=False)
    result = both.sync(moved, NODE6, frozenset({API}))
    assert jumped(runner) == {"default/kubernetes:http"} and result.again == {API}
    both.sync(moved, NODE6, result.again)
    assert jumped(runner) == set()
    # ... and back on the node: its rules come in the restore before the maps hand it over.
    calls.clear()
    both.sync(state(), NODE6, frozenset({API}))
    assert calls[0] == "restore" and jumped(runner) == {"default/kubernetes:http"}


def test_without_the_tc_ipv6_path_ip6tables_gets_every_port(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.app import ip6tables_beside_ebpf
    from agent.metaproxier import EbpfAndIp6tables

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    calls: list[str] = []
    runner = FakeRunner()
    maps = Maps(calls, serves=False)
    maps.grant_next = True  # never granted without the path; even so, nothing is left out
    both = EbpfAndIp6tables(
        maps,
        ip6tables_beside_ebpf(CONFIG, runner, counters=FakeCounters()),
        CONFIG,
        nat_live=nat_flow_lives,
        forget=kept,
    )
    for changed in (None, frozenset[ServicePortName](), frozenset()):
        assert both.sync(state(), NODE6, changed).again == frozenset()
        assert jumped(runner) == {"default/web:http", "default/kubernetes:http"}


def test_the_ipv6_family_calls_its_proxier_again_for_the_ports_it_asked_for() -> None:
    """`SyncResult.again` (the rules of ports the maps now serve go at the next sync): the IPv6
    family asks the runner for another run, after its floor, and names those ports in it."""
    from dataclasses import replace

    from agent.metaproxier import IPv6Family, Outcome
    from tests.agent.test_daemon import FakeProxier

    class Again(FakeProxier):
        ask = frozenset({WEB})

        def sync(self, state: ProxyState, node: NodeContext, changed: Any = None) -> SyncResult:
            asked, self.ask = self.ask, frozenset()
            return replace(super().sync(state, node, changed), again=asked)

    proxier = Again()
    family = IPv6Family(CONFIG, proxier, lambda: NODE6)
    family.sync(read_node=True, now=100.0)
    assert proxier.calls == [None] and not family.retry_wanted, "no failure: the backoff is not touched"
    assert family.again_at == 100.0 + CONFIG.min_sync_period6_s, "once the IPv6 floor has passed"
    family.sync(read_node=False, now=100.1)
    assert family.outcome is Outcome.HELD, "within the IPv6 floor"
    family.sync(read_node=False, now=102.0)
    assert proxier.calls == [None, frozenset({WEB})] and family.again_at is None
    family.sync(read_node=False, now=104.0)
    assert family.outcome is Outcome.IDLE and len(proxier.calls) == 2


def test_a_failed_restore_keeps_the_grant_and_a_grant_lost_with_it_puts_the_rules_back_before_it_raises(
    rig: tuple[Any, Maps, FakeRunner, list[str]],
) -> None:
    """A failed restore changes no rule: the thinned ones in place keep MASQUERADE out of the
    range, so the grant stays and nothing is restored again (the failure is raised: the family
    retries in full). Should the grant go off in the same sync for another reason (a masqueraded
    flow came between the preview and the maps), the ports it hands back to the stack are
    restored again in the same call, after the maps, with every port the rules in place had."""
    both, maps, runner, calls = rig
    maps.grant_next = True
    result = both.sync(state(), NODE6, None)
    both.sync(state(), NODE6, result.again)
    assert jumped(runner) == set() and maps.snat_granted
    calls.clear()
    both.recorded.fail = 1
    with pytest.raises(RuntimeError, match="fake"):
        both.sync(state(), NODE6, frozenset())
    assert calls == ["restore", "not apart", "maps"] and maps.snat_granted
    assert jumped(runner) == set(), "the thinned rules stay, with the grant they were thinned for"
    calls.clear()
    both.recorded.fail = 1
    maps.refuse = True
    with pytest.raises(RuntimeError, match="fake"):
        both.sync(state(), NODE6, frozenset())
    assert calls == ["restore", "not apart", "maps", "restore", "apart"] and not maps.snat_granted
    assert jumped(runner) == {"default/web:http", "default/kubernetes:http"}


def test_ports_the_maps_fail_are_left_to_ip6tables_in_the_same_call_until_the_maps_program_them(
    rig: tuple[Any, Maps, FakeRunner, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port the IPv6 maps could not program (a full map, a planner error) has no frontend: tc and
    the socket programs pass its packets to the stack, so ip6tables serves it, restored in the same
    call after the maps and kept while they fail it; once they program it, its rules go at the next
    sync. A maps' sync that raised leaves every port to ip6tables (what the maps hold is unknown).
    The host backend's port kept throughout (a path that hands those to the stack, injected)."""
    monkeypatch.setattr("agent.metaproxier.TC6_LEAVES_HOST_BACKENDS", True)
    both, maps, runner, calls = rig
    maps.snat_granted = maps.grant_next = True
    result = both.sync(state(), NODE6, None)
    both.sync(state(), NODE6, result.again)
    assert jumped(runner) == {"default/kubernetes:http"}
    calls.clear()
    maps.failing = {WEB: "ekp_svc6 is full"}
    result = both.sync(state(), NODE6, frozenset({WEB}))
    assert calls == ["restore", "apart", "maps", "restore", "apart"]
    assert jumped(runner) == {"default/web:http", "default/kubernetes:http"}
    assert result.failed == {WEB: "ekp_svc6 is full"} and result.again == frozenset()
    result = both.sync(state(), NODE6, frozenset({WEB}))
    assert jumped(runner) == {"default/web:http", "default/kubernetes:http"}, "kept while the maps fail it"
    maps.failing = {}
    result = both.sync(state(), NODE6, frozenset({WEB}))
    assert result.again == {WEB} and jumped(runner) == {"default/web:http", "default/kubernetes:http"}
    both.sync(state(), NODE6, result.again)
    assert jumped(runner) == {"default/kubernetes:http"}
    calls.clear()
    maps.broken = RuntimeError("maps (fake)")
    with pytest.raises(RuntimeError, match="maps"):
        both.sync(state(), NODE6, frozenset())
    assert calls == ["restore", "apart", "maps", "restore", "apart"]
    assert jumped(runner) == {"default/web:http", "default/kubernetes:http"}


def test_after_a_failed_restore_the_second_keeps_every_port_the_rules_in_place_had(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed restore changed nothing: the one after the maps (here for a port the maps failed)
    renders what is needed with every port the rules in place had, a port leaving included (its
    rules would have gone at this sync had the restore succeeded): nothing is thinned on a failure.
    Without the IPv6 detector and not granted: a ClusterIP only port is no SNAT frontend. The port
    leaving is a host backend's that moved off the node (a path that hands those to the stack,
    injected)."""
    monkeypatch.setattr("agent.metaproxier.TC6_LEAVES_HOST_BACKENDS", True)
    from dataclasses import replace

    from agent.app import ip6tables_beside_ebpf
    from agent.metaproxier import EbpfAndIp6tables

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    config = replace(CONFIG, cluster_cidr=("10.244.0.0/16",))
    calls: list[str] = []
    runner = FakeRunner()
    maps = Maps(calls)
    ip6 = Recorded(ip6tables_beside_ebpf(config, runner, counters=FakeCounters()), calls)
    both = EbpfAndIp6tables(maps, ip6, config, nat_live=nat_flow_lives, forget=kept)
    result = both.sync(state(), NODE6, None)
    both.sync(state(), NODE6, result.again)
    assert jumped(runner) == {"default/kubernetes:http"}
    moved = state(api_on_node=False)
    result = both.sync(moved, NODE6, frozenset({API}))
    assert result.again == {API}
    calls.clear()
    ip6.fail = 1
    maps.failing = {WEB: "ekp_svc6 is full"}
    with pytest.raises(RuntimeError, match="fake"):
        both.sync(moved, NODE6, result.again)
    assert calls == ["restore", "not apart", "maps", "restore", "apart"]
    assert jumped(runner) == {"default/web:http", "default/kubernetes:http"}


def test_the_first_sync_writes_every_port_though_granted_and_without_the_detector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first sync (a restart whose load kept the pinned grant) cannot know what the maps of the
    earlier run hand to the stack: every port gets its rules, thinned by `again` at the next sync.
    Granted and without the IPv6 detector, web alone would be left out otherwise (the host
    backend's port kept: a path that hands those to the stack, injected)."""
    monkeypatch.setattr("agent.metaproxier.TC6_LEAVES_HOST_BACKENDS", True)
    from dataclasses import replace

    from agent.app import ip6tables_beside_ebpf
    from agent.metaproxier import EbpfAndIp6tables

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    config = replace(CONFIG, cluster_cidr=("10.244.0.0/16",))
    calls: list[str] = []
    runner = FakeRunner()
    maps = Maps(calls)
    maps.snat_granted = maps.grant_next = True
    both = EbpfAndIp6tables(
        maps,
        ip6tables_beside_ebpf(config, runner, counters=FakeCounters()),
        config,
        nat_live=nat_flow_lives,
        forget=kept,
    )
    result = both.sync(state(), NODE6, None)
    assert jumped(runner) == {"default/web:http", "default/kubernetes:http"} and result.again == {WEB}
    both.sync(state(), NODE6, result.again)
    assert jumped(runner) == {"default/kubernetes:http"}


def test_a_thinned_port_keeps_its_health_check_node_ports_accept(
    rig: tuple[Any, Maps, FakeRunner, list[str]],
) -> None:
    """An ETP Local LoadBalancer whose packets the eBPF programs serve has no rules of its own in
    ip6tables, but its healthCheckNodePort (answered by the agent's IPv6 server) keeps its filter
    ACCEPT in KUBE-NODEPORTS, in upstream's place: on a node whose IPv6 INPUT policy drops, the
    load balancer's checks come in by it alone."""
    both, maps, runner, _ = rig
    lb = service(
        "lb",
        clusterIP="fd00:10:96::b",
        ipFamilies=["IPv6"],
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=32000,
    ) | {"status": {"loadBalancer": {"ingress": [{"ip": "fd00:198:51:100::9"}]}}}
    s = build_state(
        [lb, service("kubernetes", clusterIP="fd00:10:96::1", ipFamilies=["IPv6"])],
        [
            slice6("lb-v6", "fd00:10:244:2::2", svc="lb"),
            slice6("api-v6", NODE6.node_ips[0], svc="kubernetes", node="node1"),
        ],
        NodeInfo("node1"),
        family=IPFamily.IPv6,
    ).state
    maps.snat_granted = maps.grant_next = True
    result = both.sync(s, NODE6, None)
    both.sync(s, NODE6, result.again)
    assert "fd00:10:96::b" not in runner.save("nat"), "the LB's packets are the eBPF programs'"
    accept = (
        '-A KUBE-NODEPORTS -m comment --comment "default/lb:http health check node port" '
        "-m tcp -p tcp --dport 32000 -j ACCEPT"
    )
    assert accept in runner.save("filter").splitlines()


def test_a_preview_that_raises_keeps_the_masqueraded_ports_rules_for_that_sync(
    rig: tuple[Any, Maps, FakeRunner, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    """The grant's preview reads the maps and IPv6 nf_conntrack: should it raise, the sync goes on
    as if the grant were going off (the masqueraded ports' rules restored before the maps), and a
    warning says why; the next sync thins them again."""
    both, maps, runner, _ = rig
    maps.snat_granted = maps.grant_next = True
    result = both.sync(state(), NODE6, None)
    both.sync(state(), NODE6, result.again)
    assert "default/web:http" not in jumped(runner)
    maps.preview_error = OSError("netlink (fake)")
    with caplog.at_level("WARNING", logger="agent"):
        result = both.sync(state(), NODE6, frozenset())
    assert "default/web:http" in jumped(runner) and WEB in result.again
    assert any(
        "cannot tell whether the tc IPv6 path keeps its SNAT grant" in r.getMessage() for r in caplog.records
    )
    maps.preview_error = None
    both.sync(state(), NODE6, result.again)
    assert "default/web:http" not in jumped(runner)


def lb_local_state() -> ProxyState:
    """An ETP Local LoadBalancer with a healthCheckNodePort and a remote endpoint, and `kubernetes`
    on a node address: with the grant, the eBPF programs leave neither to the stack."""
    lb = service(
        "lb",
        clusterIP="fd00:10:96::b",
        ipFamilies=["IPv6"],
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=32000,
    ) | {"status": {"loadBalancer": {"ingress": [{"ip": "fd00:198:51:100::9"}]}}}
    return build_state(
        [lb, service("kubernetes", clusterIP="fd00:10:96::1", ipFamilies=["IPv6"])],
        [
            slice6("lb-v6", "fd00:10:244:2::2", svc="lb"),
            slice6("api-v6", NODE6.node_ips[0], svc="kubernetes", node="node1"),
        ],
        NodeInfo("node1"),
        family=IPFamily.IPv6,
    ).state


HC_ACCEPT = (
    '-A KUBE-NODEPORTS -m comment --comment "default/lb:http health check node port" '
    "-m tcp -p tcp --dport 32000 -j ACCEPT"
)


def hooks_users(runner: FakeRunner) -> list[str]:
    """The rules of ours that make the kernel register nf_conntrack or nf_nat hooks in the netns:
    any in the nat table, any conntrack match (lab: tests/traffic/test_ipv6_tc.py)."""
    nat = [line for line in runner.save("nat").splitlines() if line.startswith("-A ")]
    return nat + [line for line in runner.save("filter").splitlines() if "conntrack" in line]


def test_nothing_left_to_ip6tables_leaves_no_conntrack_or_nat_rule_but_the_health_check_accept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the grant every port is the eBPF programs': once no translated IPv6 flow is left in
    nf_conntrack, ip6tables keeps the healthCheckNodePort's ACCEPT and nothing else (no
    KUBE-POSTROUTING MASQUERADE, no KUBE-FORWARD or ctstate NEW jump), as IPv4's eBPF mode writes
    no rule: each such rule makes nf_conntrack track every IPv6 packet of the node (issue 20: a pod
    -> pod IPv6 connection 25% dearer). While a translated flow lives the rules of an empty state
    stay, for its packets; when a port is left again (the grant goes off) every rule is back."""
    from agent.app import ip6tables_beside_ebpf
    from agent.iptables.masquerade_shape import masquerade_kept_out
    from agent.metaproxier import EbpfAndIp6tables

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    calls: list[str] = []
    runner = FakeRunner()
    maps = Maps(calls)
    live = [True]
    ip6 = Recorded(ip6tables_beside_ebpf(CONFIG, runner, counters=FakeCounters()), calls)
    both = EbpfAndIp6tables(maps, ip6, CONFIG, nat_live=lambda: live[0], forget=kept)
    s = lb_local_state()
    maps.snat_granted = maps.grant_next = True
    result = both.sync(s, NODE6, None)  # the first sync writes every port
    assert result.again == {spn("lb"), API} and any("MASQUERADE" in line for line in hooks_users(runner))
    # every port thinned out; a translated flow still lives: the rules of an empty state stay
    calls.clear()
    result = both.sync(s, NODE6, result.again)
    assert calls == ["restore", "apart", "maps"] and result.again == frozenset()
    assert any("MASQUERADE" in line for line in hooks_users(runner))
    assert any("conntrack" in line for line in hooks_users(runner))
    # the flow is gone: no rule that registers a hook, the ACCEPT kept
    live[0] = False
    calls.clear()
    result = both.sync(s, NODE6, frozenset())
    assert calls == ["withdraw", "apart", "maps"] and result.again == frozenset()
    assert hooks_users(runner) == []
    assert HC_ACCEPT in runner.save("filter").splitlines()
    assert maps.apart, "no MASQUERADE at all takes no port of --bpf-snat-ports"
    assert masquerade_kept_out(runner.save("nat"), CONFIG.snat_ports, elsewhere=lambda: False), (
        "a restart keeps the grant"
    )
    # unchanged: nothing written again until the periodic full sync
    restores = len(runner.restores)
    both.sync(s, NODE6, frozenset())
    assert len(runner.restores) == restores
    both.sync(s, NODE6, None)
    assert hooks_users(runner) == [] and HC_ACCEPT in runner.save("filter").splitlines()
    # the grant goes off: the masqueraded ports are left again, every rule back before the maps
    maps.grant_next = False
    calls.clear()
    both.sync(s, NODE6, frozenset())
    assert calls[:2] == ["restore", "apart"]
    assert jumped_names(runner) >= {"default/lb:http"}
    assert any("MASQUERADE" in line for line in hooks_users(runner))
    assert HC_ACCEPT in runner.save("filter").splitlines()


def jumped_names(runner: FakeRunner) -> set[str]:
    """The service ports with a line in KUBE-SERVICES (by the comment's name)."""
    return {
        name
        for line in services_chain(runner)
        for name in ("default/lb:http", "default/kubernetes:http")
        if f'"{name} ' in line
    }


def test_a_failed_read_of_nf_conntrack_keeps_the_rules(
    rig: tuple[Any, Maps, FakeRunner, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    """Whether a translated IPv6 flow lives is read from nf_conntrack at each sync that would leave
    ip6tables nothing: should that read fail, the rules of an empty state stay for that sync (the
    flow's packets keep their nf_nat hooks) and a warning says what it costs."""
    from agent.app import ip6tables_beside_ebpf
    from agent.metaproxier import EbpfAndIp6tables

    _, maps, runner, calls = rig

    def broken() -> bool:
        raise OSError("netlink (fake)")

    both = EbpfAndIp6tables(
        maps,
        Recorded(ip6tables_beside_ebpf(CONFIG, runner, counters=FakeCounters()), calls),
        CONFIG,
        nat_live=broken,
        forget=kept,
    )
    maps.snat_granted = maps.grant_next = True
    s = lb_local_state()
    result = both.sync(s, NODE6, None)
    with caplog.at_level("WARNING", logger="agent"):
        both.sync(s, NODE6, result.again)
    assert any("MASQUERADE" in line for line in hooks_users(runner))
    assert any("cannot read IPv6 nf_conntrack" in r.getMessage() for r in caplog.records)


class Conntrack:
    """IPv6 nf_conntrack as EbpfAndIp6tables sees it: `nat_live` answers `live` (or raises `error`)
    and counts its reads; `forget` counts its flushes (or raises `flush_error`)."""

    def __init__(self) -> None:
        self.live = False
        self.error: Exception | None = None
        self.flush_error: Exception | None = None
        self.reads = 0
        self.flushes = 0

    def nat_live(self) -> bool:
        self.reads += 1
        if self.error is not None:
            raise self.error
        return self.live

    def forget(self) -> None:
        if self.flush_error is not None:
            raise self.flush_error
        self.flushes += 1


def withdrawn_rig(
    monkeypatch: pytest.MonkeyPatch, runner: FakeRunner | None = None
) -> tuple[Any, Maps, FakeRunner, list[str], Conntrack, Recorded]:
    """lb_local_state's ports all the eBPF programs' (granted), nothing translated in nf_conntrack."""
    from agent.app import ip6tables_beside_ebpf
    from agent.metaproxier import EbpfAndIp6tables

    monkeypatch.setattr("agent.iptables.proxier.EbpfHandback", HandbackRecorder)
    calls: list[str] = []
    runner = runner or FakeRunner()
    maps = Maps(calls)
    maps.snat_granted = maps.grant_next = True
    ct = Conntrack()
    ip6 = Recorded(ip6tables_beside_ebpf(CONFIG, runner, counters=FakeCounters()), calls)
    both = EbpfAndIp6tables(maps, ip6, CONFIG, nat_live=ct.nat_live, forget=ct.forget)
    return both, maps, runner, calls, ct, ip6


def withdraw(both: Any, s: ProxyState) -> None:
    """The first sync (every port) and the next (each thinned out): withdrawn."""
    result = both.sync(s, NODE6, None)
    both.sync(s, NODE6, result.again)


NODEPORTS_JUMP = '-m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS'


def test_the_health_check_jump_stays_ahead_of_a_nodes_input_reject(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's own `-A INPUT -j REJECT`: the withdrawn rules' jump to the healthCheckNodePorts'
    ACCEPTs is first in INPUT, as upstream's prepended jump, not appended after the REJECT (every
    health check refused, and kept there when the rules return: the sync's `-C` finds it). A jump
    an earlier agent left at the bottom is moved up by the next full resync."""
    runner = FakeRunner()
    runner.tables["filter"]["INPUT"].append("-j REJECT")
    both, maps, _, calls, _, _ = withdrawn_rig(monkeypatch, runner)
    s = lb_local_state()
    withdraw(both, s)
    assert calls[-3:] == ["withdraw", "apart", "maps"]
    assert runner.rules("filter", "INPUT") == [NODEPORTS_JUMP, "-j REJECT"]
    # rules back (the grant off): every jump ahead of the REJECT
    maps.grant_next = False
    both.sync(s, NODE6, frozenset())
    inp = runner.rules("filter", "INPUT")
    assert inp[-1] == "-j REJECT" and NODEPORTS_JUMP in inp
    # withdrawn again, then an earlier agent's jump at the bottom: a full resync puts it first
    maps.grant_next = True
    both.sync(s, NODE6, frozenset())
    both.sync(s, NODE6, frozenset())
    assert runner.rules("filter", "INPUT") == [NODEPORTS_JUMP, "-j REJECT"]
    runner.tables["filter"]["INPUT"] = ["-j REJECT", NODEPORTS_JUMP]
    both.sync(s, NODE6, None)
    assert runner.rules("filter", "INPUT") == [NODEPORTS_JUMP, "-j REJECT"]


def test_a_withdraw_is_one_restore_and_a_full_resync_rewrites_only_drift(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The withdraw deletes our jumps and chains and writes the ACCEPTs in one restore (atomic per
    table: the ACCEPTs are never missing, no `-D` of its own that another process's xtables lock
    can hold up); the periodic full resync reads the rules back and writes nothing while they are
    as withdrawn, and repairs them when they drifted. Said once per withdrawal, not at each resync."""
    both, _, runner, calls, _, _ = withdrawn_rig(monkeypatch)
    s = lb_local_state()
    result = both.sync(s, NODE6, None)
    restores, commands = len(runner.restores), len(runner.iptables_calls)
    with caplog.at_level("INFO", logger="agent"):
        both.sync(s, NODE6, result.again)
        for _ in range(3):
            both.sync(s, NODE6, None)  # the periodic full resync
    assert len(runner.restores) == restores + 1 and len(runner.iptables_calls) == commands
    assert HC_ACCEPT.removeprefix("-A KUBE-NODEPORTS ") in runner.rules("filter", "KUBE-NODEPORTS")
    assert runner.chains("nat") == {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"}
    said = [r.getMessage() for r in caplog.records if r.levelname in ("INFO", "WARNING")]
    assert sum("removed every rule of ours" in m for m in said) == 1 and not any("cleanup" in m for m in said)
    # drift: the ACCEPT deleted behind the agent, a stray chain of ours: the full resync repairs both
    runner.tables["filter"]["KUBE-NODEPORTS"] = []
    runner.tables["nat"]["KUBE-MARK-MASQ"] = []
    caplog.clear()
    with caplog.at_level("INFO", logger="agent"):
        both.sync(s, NODE6, None)
    assert len(runner.restores) == restores + 2
    assert HC_ACCEPT.removeprefix("-A KUBE-NODEPORTS ") in runner.rules("filter", "KUBE-NODEPORTS")
    assert "KUBE-MARK-MASQ" not in runner.chains("nat")
    assert any("changed behind the agent" in r.getMessage() for r in caplog.records)
    # a partial sync over unchanged state does not even read the rules back
    saves = runner.saves
    both.sync(s, NODE6, frozenset())
    assert runner.saves == saves and calls[-3:] == ["withdraw", "apart", "maps"]


def test_nf_conntrack_is_read_only_on_the_way_to_withdrawn_and_flushed_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once withdrawn, no rule of ours translates a flow: `nat_live` (a walk of IPv6 nf_conntrack)
    is not read again, and another program's translated flow does not bring the rules back. The
    withdraw that takes the rules away flushes IPv6 nf_conntrack once (entries made under the rules
    would otherwise be stale, INVALID to the hooks when rules return: a stalled connection)."""
    both, maps, runner, _, ct, _ = withdrawn_rig(monkeypatch)
    s = lb_local_state()
    withdraw(both, s)
    assert (ct.reads, ct.flushes) == (1, 1)
    ct.live = True  # Docker's masquerade, say
    for changed in (frozenset[ServicePortName](), None, frozenset[ServicePortName]()):
        both.sync(s, NODE6, changed)
    assert (ct.reads, ct.flushes) == (1, 1) and hooks_users(runner) == []
    # rules back, then withdrawn again: read on the way, and flushed once more
    maps.grant_next = False
    both.sync(s, NODE6, frozenset())
    maps.grant_next = True
    ct.live = False
    both.sync(s, NODE6, frozenset())
    assert hooks_users(runner) != [], "the ports the grant left keep their rules one more sync"
    both.sync(s, NODE6, frozenset())
    assert hooks_users(runner) == [] and (ct.reads, ct.flushes) == (2, 2)


def test_a_failing_read_or_flush_of_nf_conntrack_is_said_once_per_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read of nf_conntrack that fails keeps the rules (counted as live) and is retried at each
    sync, the warning said again only for another error; a flush that fails still leaves the rules
    withdrawn, and is said once too."""
    both, _, runner, _, ct, _ = withdrawn_rig(monkeypatch)
    s = lb_local_state()
    result = both.sync(s, NODE6, None)
    ct.error = OSError("netlink (fake)")
    with caplog.at_level("WARNING", logger="agent"):
        for _ in range(3):
            both.sync(s, NODE6, result.again)
        ct.error = PermissionError("denied (fake)")
        both.sync(s, NODE6, result.again)
    reads = [r.getMessage() for r in caplog.records if "cannot read IPv6 nf_conntrack" in r.getMessage()]
    assert ct.reads == 4 and len(reads) == 2 and "denied" in reads[1]
    assert any("MASQUERADE" in line for line in hooks_users(runner))
    ct.error, ct.flush_error = None, OSError("flush (fake)")
    caplog.clear()
    with caplog.at_level("WARNING", logger="agent"):
        both.sync(s, NODE6, result.again)
    assert hooks_users(runner) == []
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "cannot delete IPv6 nf_conntrack's TCP" in m] != []


def test_withdrawn_with_ports_the_maps_fail_restores_them_in_the_same_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The production path (nothing translated): a withdraw, then the maps fail a port, whose rules
    come back in the same call, after the maps' sync, before it returns."""
    both, maps, runner, calls, _, _ = withdrawn_rig(monkeypatch)
    s = lb_local_state()
    withdraw(both, s)
    maps.failing = {spn("lb"): "full"}
    calls.clear()
    result = both.sync(s, NODE6, frozenset())
    assert calls == ["withdraw", "apart", "maps", "restore", "apart"]
    assert jumped_names(runner) == {"default/lb:http"} and result.failed == {spn("lb"): "full"}
    maps.failing = {}
    calls.clear()
    result = both.sync(s, NODE6, frozenset())
    assert calls == ["restore", "apart", "maps"] and result.again == {spn("lb")}
    calls.clear()
    both.sync(s, NODE6, result.again)
    assert calls == ["withdraw", "apart", "maps"] and hooks_users(runner) == []


def test_a_withdraw_that_raises_leaves_the_maps_synced_and_the_next_sync_writes_every_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A withdraw that fails (its restore refused) is a failed restore: the maps still sync, told
    the rules are not known to keep MASQUERADE apart, the error raised after; the retry writes
    every port (the rules in place are not known) and the one after withdraws, reading nf_conntrack
    again on the way."""
    both, _, runner, calls, ct, ip6 = withdrawn_rig(monkeypatch)
    s = lb_local_state()
    result = both.sync(s, NODE6, None)
    ip6.fail_withdraw = 1
    calls.clear()
    with pytest.raises(RuntimeError, match="fake"):
        both.sync(s, NODE6, result.again)
    assert calls == ["withdraw", "not apart", "maps"] and ct.flushes == 0
    calls.clear()
    result = both.sync(s, NODE6, None)
    assert calls == ["restore", "apart", "maps"] and jumped_names(runner) == {
        "default/lb:http",
        "default/kubernetes:http",
    }
    calls.clear()
    both.sync(s, NODE6, result.again)
    assert calls == ["withdraw", "apart", "maps"] and hooks_users(runner) == []
    assert (ct.reads, ct.flushes) == (2, 1)


def test_a_preview_that_raises_while_withdrawn_brings_the_masqueraded_ports_rules_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """While withdrawn, a preview that raises counts the grant as off for that sync: the ports it
    would leave to ip6tables get their rules in the restore before the maps; withdrawn again once the
    preview answers (nf_conntrack read and flushed on the way)."""
    both, maps, runner, calls, ct, _ = withdrawn_rig(monkeypatch)
    s = lb_local_state()
    withdraw(both, s)
    maps.preview_error = OSError("netlink (fake)")
    calls.clear()
    with caplog.at_level("WARNING", logger="agent"):
        result = both.sync(s, NODE6, frozenset())
    assert calls == ["restore", "apart", "maps"]
    assert jumped_names(runner) == {"default/lb:http", "default/kubernetes:http"}
    maps.preview_error = None
    calls.clear()
    both.sync(s, NODE6, result.again)
    assert calls == ["withdraw", "apart", "maps"] and hooks_users(runner) == []
    assert (ct.reads, ct.flushes) == (2, 2)


def test_the_first_sync_after_a_restart_from_withdrawn_writes_every_port_then_withdraws(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent restarted over withdrawn rules (an earlier run's): its first sync writes every port
    (that run's maps may hand any to the stack), the next withdraws again, reading nf_conntrack and
    flushing it on the way, and the health-check jump is first in INPUT throughout."""
    both, _, runner, _, _, _ = withdrawn_rig(monkeypatch)
    runner.tables["filter"]["INPUT"].append("-j REJECT")
    s = lb_local_state()
    withdraw(both, s)
    withdrawn = runner.save()
    restarted, _, _, calls, ct, _ = withdrawn_rig(monkeypatch, runner)
    result = restarted.sync(s, NODE6, None)
    assert calls == ["restore", "apart", "maps"] and result.again == {spn("lb"), API}
    assert runner.rules("filter", "INPUT")[-1] == "-j REJECT"
    calls.clear()
    restarted.sync(s, NODE6, result.again)
    assert calls == ["withdraw", "apart", "maps"] and (ct.reads, ct.flushes) == (1, 1)
    assert runner.save() == withdrawn
