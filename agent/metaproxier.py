"""The IPv6 half of the agent: kube-proxy's metaproxier (pkg/proxy/metaproxier) beside the IPv4 one.

Upstream runs one proxier per address family and hands every Service to both, every
EndpointSlice to the proxier of its addressType. Here the agent's own sync loop (agent/daemon.py)
keeps the IPv4 model and proxier as before, and `IPv6Family` holds the other family: its own
`ProxyModel` (family IPv6, fed the same records), its own node addresses and frontend guard, its
own proxier and its own retries. The policies are the same code for both (the model, the
renderer); only the family differs.

Which proxier programs IPv6, when the flags describe IPv6 for the node (`Config.ipv6_configured`):

* iptables mode: an `IptablesProxier(family=IPv6)` on ip6tables, with the backend the IPv4 rules
  use.
* eBPF mode: two proxiers for the one family (`EbpfAndIp6tables`). The eBPF data path's IPv6 maps
  (agent/ebpf/family6.py), which the socket programs read: a connection a node process or a pod
  makes to an IPv6 Service is sent to its backend at connect()/sendmsg(), as for IPv4, and its
  packets are never translated. And the ip6tables proxier, for every packet the socket programs
  do not see: external clients, NodePorts and external IPs from outside, the pods' flows the
  socket programs leave to the packet path (affinity, source ranges, SNAT; all of them under
  --bpf-socket-lb-host-namespace-only), and everything when --bpf-socket-lb=false (then the IPv6
  maps are not written). Where the tc programs' IPv6 path serves (Config.tc_ipv6), ip6tables gets
  only the service ports it and the socket programs leave to the stack (agent/model/tc6_leaves.py;
  `EbpfAndIp6tables` says in which order). Its backend is --iptables-backend or the node's (no
  IPv4 rules to follow).

Without IPv6 in the flags no IPv6 proxier runs: the IPv6 state is still computed (so problems with
IPv6 objects are reported the same way), and the first time IPv6 service ports exist the agent
says once, as a warning, that they are not programmed and what turns the IPv6 proxier on. Nor
does one run when the flags ask for IPv6 and the node cannot do it (no ip6tables, or the kernel's
IPv6 turned off: upstream's platformCheckSupported, agent/app.py): the agent runs single-stack
and says so once at start.

Each family's sync is its own: a failure of either never holds back the other (agent/daemon.py
runs the IPv6 sync after a failed IPv4 one too), and the IPv6 proxier is called only when
something is due for it, at most once per its own floor (`IPv6Family`).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Protocol

from agent.config import Config, Mode, NodeContext
from agent.errors import FatalError
from agent.featuregates import node_info
from agent.model.guard import FrontendGuard
from agent.model.tc6_leaves import TC6_LEAVES_HOST_BACKENDS, Tc6Facts, ports_left
from agent.model.tracker import Commit, ProxyModel
from agent.model.types import IPFamily, NodeInfo, ProxyState, ServicePortName
from agent.proxier import Proxier, SyncResult

log = logging.getLogger("agent")

# IPv6 service ports named one by one in the "not programmed" warning.
NAMED = 3


def frontend_guard(config: Config, node: NodeContext) -> FrontendGuard:
    """The node's rules for external frontends (agent/model/guard.py), from the flags and the
    node's addresses (those of one family; the flags' CIDRs of both)."""
    return FrontendGuard.of(
        node_ips=node.node_ips,
        cluster_cidrs=config.cluster_cidr,
        service_cidrs=config.service_cidrs,
        allowed_cidrs=config.external_ip_cidrs,
        node_port_range=config.nodeport_range,
    )


class Ipv6Maps(Proxier, Protocol):
    """The eBPF half of EbpfAndIp6tables (agent/ebpf/proxier.py EbpfIpv6)."""

    def masquerade_apart(self, apart: bool) -> None:
        """`apart`: the ip6tables restore just made succeeded, so its MASQUERADE takes no port of
        --bpf-snat-ports and the tc programs' IPv6 path may source-translate with ports of that
        range (ekp_cfg6); False (it failed): it changed no rule, so a grant already given stays
        (the rules in place were thinned for it) and none is given before a restore succeeds, but
        nf_conntrack is read again at each sync until one does."""

    @property
    def tc_serves(self) -> bool:
        """Whether the tc programs' IPv6 path serves (Config.tc_ipv6 on a node with an IPv6 half)."""

    @property
    def snat_granted(self) -> bool:
        """Whether the last sync granted that path its source translation (ekp_cfg6's address)."""

    def snat_preview(self, node: NodeContext) -> bool:
        """Whether the next sync grants it should the ip6tables restore before it succeed (every
        other reason to refuse is known before that restore); nothing written."""


class Ip6tables(Proxier, Protocol):
    """The ip6tables half of EbpfAndIp6tables (agent/iptables/proxier.py IptablesProxier)."""

    def withdraw(self, state: ProxyState, *, full: bool) -> SyncResult:
        """Every rule but the healthCheckNodePorts' ACCEPTs of `state` removed: none that registers
        an nf_conntrack or nf_nat hook. `full`: written even if unchanged since the last call."""


def tc6_facts(config: Config, state: ProxyState, *, serves: bool, granted: bool) -> Tc6Facts:
    """The node-wide inputs of the IPv6 ports left to ip6tables (agent/model/tc6_leaves.py):
    `serves`, the tc IPv6 path serves; `granted`, its source translation is granted."""
    return Tc6Facts(
        serves=serves,
        leaves_host_backends=TC6_LEAVES_HOST_BACKENDS,
        snat_granted=granted,
        masquerade_all=config.masquerade_all,
        detector=config.local_detector(state.node.pod_cidrs, 6).implemented,
    )


def only(state: ProxyState, ports: Collection[ServicePortName]) -> ProxyState:
    """`state` with the service ports `ports` alone (a copy of its mappings when some are left out),
    the others in `ProxyState.elsewhere` (their health-check node ports' ACCEPTs stay)."""
    if len(ports) == len(state.services) and all(spn in state.services for spn in ports):
        return state
    return replace(
        state,
        services={spn: state.services[spn] for spn in ports if spn in state.services},
        endpoints={spn: eps for spn, eps in state.endpoints.items() if spn in ports},
        raw_endpoints={spn: eps for spn, eps in state.raw_endpoints.items() if spn in ports},
        elsewhere={spn: sp for spn, sp in state.services.items() if spn not in ports},
    )


class EbpfAndIp6tables:
    """eBPF mode's IPv6 proxier: ip6tables (every packet the eBPF programs leave to the stack), then
    the eBPF data path's IPv6 maps (read by the socket programs and, in either host routing, by the
    tc programs' IPv6 path: Config.tc_ipv6). Each is synced whatever the other did; a failure of
    either is raised after both ran (the family retries in full), and the ports either could not
    program are reported together.

    ip6tables first because the tc path's source translation waits for it: its MASQUERADE rule
    keeps out of --bpf-snat-ports (agent/iptables/rules.py `masquerade_ports_beside`), and until a
    restore has put that rule in place nf_conntrack may hand out a port of the range the tc path
    would pick for another flow to the same backend. The maps are told after each restore whether it
    succeeded (`masquerade_apart`).

    ip6tables gets only the service ports the eBPF programs leave to it (agent/model/tc6_leaves.py;
    all of them where the tc path does not serve), so that its KUBE-SERVICES walk is as short as
    what is left. No frontend is ever left by both:

    * a port joining that set (a host-network backend came, the grant goes off) gets its rules in
      the restore before the maps that hand it to the stack are written. The grant is written by
      the maps' sync, after the restore; every reason it may go off but the restore's own outcome
      (the node's IPv6 address gone, masqueraded flows holding ports of the range, ekp_config's
      range) is known before (`snat_preview`), so the restore is rendered as if granted only when
      both the grant in force and the preview allow it;
    * a port the maps fail to program (a full map, a planner error) has no frontend: the stack gets
      its packets, so it is left to ip6tables too, restored in the same call and kept until a maps'
      sync programs it (every port when the maps' sync raised: what they hold is not known);
    * a port leaving the set keeps its rules until the sync after the maps that serve it were
      written (`again`: the next IPv6 sync drops them);
    * a failed restore changes no rule, so it does not take the grant back: the rules in place
      (the last good restore's, or the earlier run's whose grant the load kept) keep MASQUERADE
      out of the range and were thinned for that grant. The ports the grant hands back for another
      reason, those the maps failed, and after a failed restore every port needed whose rules are
      not known to be in place, are restored again after the maps' sync, in the same call, with
      every port the rules in place had (nothing is thinned after a failure). If that restore
      fails too, they wait for one that succeeds;
    * the first sync, and the one after a failure, writes every port: maps of an earlier run, or
      of the failed sync, may hand any of them to the stack;
    * no port to restore and no translated flow in IPv6 nf_conntrack (`nat_live`): ip6tables is
      withdrawn to the healthCheckNodePorts' ACCEPTs (`Ip6tables.withdraw`), with no conntrack
      match and no nat rule, so nf_conntrack registers no hook in the node's netns and no IPv6
      packet is tracked (issue 20: those hooks cost a pod -> pod IPv6 connection about 25%). Like
      a restore it comes before the maps' sync, and a port left again gets every rule back in
      the restore before the maps hand it to the stack."""

    def __init__(
        self,
        ebpf: Ipv6Maps,
        ip6tables: Ip6tables,
        config: Config,
        *,
        nat_live: Callable[[], bool],
        forget: Callable[[], None],
    ) -> None:
        """`nat_live`: whether IPv6 nf_conntrack holds a translated entry (source or destination:
        ip6tables' MASQUERADE, kube-proxy's DNAT carried over by a take-over). While one does, an
        empty set of ports still gets the rules of an empty state (KUBE-POSTROUTING's MASQUERADE,
        the conntrack matches), whose nf_nat and nf_conntrack hooks keep translating that flow's
        packets; once none does, it gets no rule that registers them (`Ip6tables.withdraw`). Read
        only on the way from rules to withdrawn: once withdrawn our rules translate no flow, and
        another program's translated flow (Docker's, a CNI's masquerade) must not flap the rules.

        `forget`: IPv6 nf_conntrack's TCP entries deleted, right after a withdraw that took the
        rules away. They would keep their ESTABLISHED timeouts while their connections move on
        untracked; when a port is left to ip6tables again and the hooks return, such a connection's
        next segment is far out of the stale entry's window, which a kernel that marks it INVALID
        turns into a stall (KUBE-FORWARD's `--ctstate INVALID -j DROP`) for as long as the rules
        stay. Linux 6.18 here did not (tests/traffic/test_ipv6_untracked.py's stream moved on
        without it, no INVALID drop counted). Without an entry the hooks pick a connection up
        mid-stream (nf_conntrack_tcp_loose). TCP's alone: UDP and ICMP entries have no window, and
        deleting one would make an answer already on its way NEW to a node firewall that accepts
        only ESTABLISHED ones (agent/takeover/nfct.py `delete_tcp`). None was translated: `nat_live`
        said so just before."""
        self.ebpf = ebpf
        self.ip6tables = ip6tables
        self._config = config
        self._nat_live = nat_live
        self._forget = forget
        self._withdrawn = False  # the last ip6tables write was a withdraw that succeeded
        self._nat_error: str | None = None  # the last failed nat_live read's, said once
        self._forget_error: str | None = None  # the last failed forget's, said once
        self._rendered: frozenset[ServicePortName] | None = None  # the ports ip6tables last got
        self._needed: frozenset[ServicePortName] = frozenset()  # left after the last maps' sync

    def prepare(self) -> None:
        self.ebpf.prepare()
        self.ip6tables.prepare()

    def facts(self, state: ProxyState, *, granted: bool) -> Tc6Facts:
        """The node-wide inputs of the ports left to ip6tables, with the grant `granted`."""
        return tc6_facts(self._config, state, serves=self.ebpf.tc_serves, granted=granted)

    def sync(
        self, state: ProxyState, node: NodeContext, changed: frozenset[ServicePortName] | None = None
    ) -> SyncResult:
        every = frozenset(state.services)
        in_place = self._rendered  # None: not known (the first sync, or the last one failed)
        granted = self._granted_after(node)
        need = ports_left(state, node.node_ips, self.facts(state, granted=granted))
        # A port the maps were last written to hand to the stack keeps its rules one more sync; with
        # the rules in place not known, every port gets them, and `again` thins them out.
        keep = every if in_place is None else need | (in_place & self._needed)
        results: list[SyncResult] = []
        failure: Exception | None = None
        try:
            results.append(self._restore(state, node, changed, keep))
        except FatalError:
            raise
        except Exception as exc:
            failure = exc
        restored = failure is None
        self.ebpf.masquerade_apart(restored)
        maps: SyncResult | None = None
        try:
            maps = self.ebpf.sync(state, node, changed)
            results.append(maps)
        except FatalError:
            raise
        except Exception as exc:
            failure = failure or exc
        # The same inputs as `need` unless the maps' sync changed the grant (O(ports) at each sync).
        after = (
            need
            if self.ebpf.snat_granted == granted
            else ports_left(state, node.node_ips, self.facts(state, granted=self.ebpf.snat_granted))
        )
        # The ports the maps hold no frontend for reach the stack: ip6tables serves them.
        after |= every if maps is None else maps.failed.keys() & every
        # The ports whose rules are known to be in place: a failed restore changed none, and after
        # one that failed before (in_place None) the rules in place may be any earlier sync's.
        have = keep if restored else in_place or frozenset()
        if not after <= have:
            # The grant went off, the maps failed ports or a failed restore left their rules unknown:
            # their rules now; after a failed restore with every port the rules in place had.
            second = keep | after
            if not restored:
                second |= every if in_place is None else in_place
            try:
                results.append(self._restore(state, node, changed, second))
            except FatalError:
                raise
            except Exception as exc:
                failure, restored = failure or exc, False
            else:
                restored = True
            self.ebpf.masquerade_apart(restored)
        self._needed = after
        if failure is not None:
            self._rendered = None  # not known: the retry renders everything that may be needed
            raise failure
        failed: dict[ServicePortName, str] = {}
        for result in results:
            failed.update(result.failed)
        assert self._rendered is not None
        return SyncResult(
            full=all(r.full for r in results),
            failed=failed,
            repaired=sum(r.repaired for r in results),
            again=self._rendered - after,
        )

    def _granted_after(self, node: NodeContext) -> bool:
        """Whether the grant is on now and the maps' sync will leave it on should the restore
        succeed (`snat_preview`). A preview that raises counts as off: the masqueraded ports keep
        their rules this sync, which costs only their walk."""
        if not (self.ebpf.tc_serves and self.ebpf.snat_granted):
            return False
        try:
            return self.ebpf.snat_preview(node)
        except FatalError:
            raise
        except Exception as exc:
            log.warning(
                "cannot tell whether the tc IPv6 path keeps its SNAT grant (%s: %s): ip6tables keeps the "
                "rules of the Services it masquerades for this sync",
                type(exc).__name__,
                exc,
            )
            return False

    def _restore(
        self,
        state: ProxyState,
        node: NodeContext,
        changed: frozenset[ServicePortName] | None,
        ports: frozenset[ServicePortName],
    ) -> SyncResult:
        """ip6tables for `ports` of `state` alone: a port that joins or leaves the set since the
        last restore is synced as a changed one (leaving: its chains go, as a deleted Service's)."""
        if not ports and (self._withdrawn or not self._nat_flows_live()):
            was, self._withdrawn = self._withdrawn, False
            self._rendered = None
            result = self.ip6tables.withdraw(only(state, ports), full=changed is None or not was)
            self._rendered = ports
            self._withdrawn = True
            if not was:
                self._flush()
            return result
        self._withdrawn = False
        if changed is not None:
            before = self._rendered if self._rendered is not None else frozenset(state.services)
            changed = changed | (ports ^ before)
        self._rendered = None
        result = self.ip6tables.sync(only(state, ports), node, changed)
        self._rendered = ports
        return result

    def _nat_flows_live(self) -> bool:
        """`nat_live`; a read that fails counts as live: the rules stay, which costs only speed."""
        try:
            live = self._nat_live()
        except FatalError:
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if error != self._nat_error:
                log.warning(
                    "cannot read IPv6 nf_conntrack for translated flows (%s): ip6tables keeps its "
                    "MASQUERADE and conntrack rules, so every IPv6 packet of the node is tracked until a "
                    "read succeeds (retried at each IPv6 sync; said again only for another error)",
                    error,
                )
            self._nat_error = error
            return True
        if self._nat_error is not None:
            log.info(
                "IPv6 nf_conntrack read again: %s", "a translated flow lives" if live else "none translated"
            )
        self._nat_error = None
        return live

    def _flush(self) -> None:
        """`forget`, after a withdraw that took the rules away; a failure costs only the stall it
        avoids (a connection older than the withdraw, should a port be left to ip6tables again)."""
        try:
            self._forget()
        except FatalError:
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if error != self._forget_error:
                log.warning(
                    "cannot delete IPv6 nf_conntrack's TCP entries after withdrawing ip6tables' rules "
                    "(%s): should a Service be left to ip6tables again, an IPv6 connection older than "
                    "this whose entry is out of date may stall (INVALID, dropped by KUBE-FORWARD); "
                    "`conntrack -D -f ipv6 -p tcp` clears them",
                    error,
                )
            self._forget_error = error
        else:
            self._forget_error = None

    def cleanup(self) -> None:
        self.ebpf.cleanup()
        self.ip6tables.cleanup()


def unserved_reason(config: Config) -> str:
    """Why IPv6 Services are not programmed on this node (no IPv6 proxier runs)."""
    how = (
        "the socket programs (IPv6 maps) and ip6tables (every other packet) program them"
        if config.mode is Mode.EBPF
        else "iptables mode programs them with ip6tables"
    )
    return (
        "no IPv6 proxier runs: give --cluster-cidr, --node-ip or --service-cluster-ip-range an IPv6 "
        f"entry and {how}"
    )


def merged(earlier: Commit, later: Commit) -> Commit:
    """Two commits as one, for the health-check servers and the metrics of the sync that programs
    both (the problems were reported when each was made): the later's values win."""
    changed = None if earlier.changed is None or later.changed is None else earlier.changed | later.changed
    return Commit(
        changed,
        trigger_times=earlier.trigger_times + later.trigger_times,
        services_changed=earlier.services_changed + later.services_changed,
        health_check_ports={**earlier.health_check_ports, **later.health_check_ports},
        local_endpoints={**earlier.local_endpoints, **later.local_endpoints},
    )


class Outcome(enum.Enum):
    """What the IPv6 family did in one of the agent's syncs."""

    UNSERVED = "unserved"  # no IPv6 proxier: the model only
    SYNCED = "synced"  # its proxier programmed it (some ports may have failed: `retry_wanted`)
    FAILED = "failed"  # its proxier raised: retried, in full
    IDLE = "idle"  # nothing changed, no full sync or retry due: its proxier was not called
    HELD = "held"  # something is due, but its own floor has not passed: `due_at`


class IPv6Family:
    """The IPv6 model, and its proxier when this mode programs IPv6 (else None). No side effects
    at construction; `sync` runs on the agent's sync thread only.

    As upstream, where each proxier syncs when its own change tracker took a change, the IPv6
    proxier is called only when something is due for it: IPv6 service ports changed (gathered
    over the agent's syncs), its node addresses moved, its own periodic full sync (every
    sync period, the drift repair), or a retry. And never sooner than `Config.min_sync_period6_s`
    after its last call: ip6tables-restore rewrites the top-level chains at every sync, so eBPF
    mode's 100 ms IPv4 floor is no floor for it."""

    def __init__(
        self,
        config: Config,
        proxier: Proxier | None = None,
        node_context: Callable[[], NodeContext] | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        unserved_said: bool = False,
    ) -> None:
        self._config = config
        self.model = ProxyModel(node_info(config), family=IPFamily.IPv6)
        self.proxier = proxier
        self._node_context = node_context or (lambda: NodeContext())
        self._clock = clock
        self._floor = min(config.min_sync_period6_s, config.sync_period_s)
        self.node: NodeContext | None = None
        self._retry: dict[ServicePortName, str] = {}
        self._announced = unserved_said  # the start said why no IPv6 proxier runs
        self._need_full = False  # the last sync raised: the next one writes everything
        self._changed: set[ServicePortName] = set()  # committed, not yet programmed
        self._again = False  # the last call asked for another (SyncResult.again)
        self._full_due = False  # a commit or the node asked for a full sync not yet made
        self._held: Commit | None = None  # the commits not yet programmed, merged
        self._last_call = float("-inf")
        self._last_full = float("-inf")
        self.outcome = Outcome.UNSERVED
        self.programmed: Commit | None = None  # what the last SYNCED or IDLE outcome settled
        self.due_at = float("-inf")  # HELD: when the floor allows the next call
        self.elapsed = 0.0  # the last proxier call's duration
        self.last_result: SyncResult | None = None
        self.last_full = False  # whether the last call handed the proxier everything

    def set_node(self, node: NodeInfo) -> None:
        self.model.set_node(node)

    def sync(self, *, read_node: bool, now: float) -> Commit:
        """Commit the IPv6 model and, with a proxier and something due (see the class), program
        it: fully when its periodic full sync is due, the model or the node's IPv6 addresses ask
        for it or the last call failed, else the service ports changed since the last call and
        those to retry. `read_node`: re-read the node's IPv6 addresses first (the IPv4 side does
        at the same moments); `now`: when the agent's sync began, on the clock its runner's floor
        is measured with (so with the same floor as IPv4's, iptables mode's, no IPv6 call is ever
        held). `outcome` says what happened; a failed call is logged and retried (`retry_wanted`);
        FatalError propagates."""
        moved = False
        unread: Exception | None = None  # reading the node's IPv6 addresses failed
        self.programmed = None
        if self.proxier is not None and (
            read_node or self.node is None or self._need_full or self.model.full_pending
        ):
            try:
                node = self._node_context()
            except FatalError:
                raise
            except Exception as exc:
                # Not raised: the agent's sync would raise it in place of an IPv4 failure, and the
                # IPv4 side must not wait for this family's addresses.
                unread = exc
            else:
                moved = self.node is not None and node != self.node
                if moved:
                    log.info("node IPv6 addresses changed: %s", ",".join(node.node_ips) or "none")
                self.node = node
                self.model.set_guard(frontend_guard(self._config, node))
        commit = self.model.commit()
        if self.proxier is None:
            self._announce()
            self.outcome = Outcome.UNSERVED
            return commit
        self._held = commit if self._held is None else merged(self._held, commit)
        if commit.changed is None or moved:
            self._full_due = True
        else:
            self._changed |= commit.changed
        if unread is not None:
            log.warning(
                "IPv6 sync failed: cannot read the node's IPv6 addresses (retried soon, in full; IPv4 is "
                "unaffected): %s",
                unread,
            )
            self._need_full = True
            self.outcome = Outcome.FAILED
            return commit
        assert self.node is not None
        full = self._full_due or self._need_full or now - self._last_full >= self._config.sync_period_s
        if not (full or self._changed or self._retry):
            self.outcome = Outcome.IDLE
            self.programmed, self._held = self._held, None
            return commit
        if now - self._last_call < self._floor:
            self.outcome = Outcome.HELD
            self.due_at = self._last_call + self._floor
            return commit
        changed = None if full else frozenset(self._changed | self._retry.keys())
        self.last_full = full
        self._last_call = now
        started = self._clock()
        try:
            result = self.proxier.sync(self.model.state, self.node, changed)
        except FatalError:
            raise
        except Exception as exc:
            # The IPv4 side is not held back; this family catches up at its retry.
            log.warning("IPv6 sync failed (retried soon, in full; IPv4 is unaffected): %s", exc)
            self._need_full = True
            self.outcome = Outcome.FAILED
            return commit
        finally:
            self.elapsed = self._clock() - started
        self._need_full = self._full_due = False
        self._changed.clear()
        self._changed |= result.again
        self._again = bool(result.again)
        if full:
            self._last_full = now
        self._report(result)
        self.last_result = result
        self.outcome = Outcome.SYNCED
        self.programmed, self._held = self._held, None
        return commit

    @property
    def in_step(self) -> bool:
        """Whether the IPv6 rules hold everything committed (or no IPv6 proxier runs): not held
        back by the floor, not failed."""
        return self.outcome not in (Outcome.HELD, Outcome.FAILED)

    @property
    def retry_wanted(self) -> bool:
        """The last sync failed or left service ports unprogrammed (a retry: the runner's backoff)."""
        return self._need_full or bool(self._retry)

    @property
    def again_at(self) -> float | None:
        """When the call the last one asked for (`SyncResult.again`) may run: once the floor has
        passed. None when it asked for none. A step of a hand-over, not a failure: the caller asks
        the runner for a run then (`request_at`), leaving the failure backoff, which IPv4 shares,
        as it was."""
        return self._last_call + self._floor if self._again else None

    def _announce(self) -> None:
        """Once per agent life: IPv6 service ports exist and nothing programs them."""
        ports = self.model.state.services
        if self._announced or not ports:
            return
        self._announced = True
        named = ", ".join(str(spn) for spn in sorted(ports, key=str)[:NAMED])
        more = f" and {len(ports) - NAMED} more" if len(ports) > NAMED else ""
        log.warning(
            "%d IPv6 service port(s) (%s%s) are not programmed on this node: %s",
            len(ports),
            named,
            more,
            unserved_reason(self._config),
        )

    def _report(self, result: SyncResult) -> None:
        for spn, why in sorted(result.failed.items(), key=lambda item: str(item[0])):
            if self._retry.get(spn) != why:
                log.error(
                    "could not program %s (IPv6): %s (retried; every other service is programmed)", spn, why
                )
        for spn in sorted(self._retry.keys() - result.failed.keys(), key=str):
            log.info("programmed %s (IPv6) after all", spn)
        self._retry = dict(result.failed)
