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
  maps are not written). The eBPF tc programs pass IPv6 packets to the stack untouched until they
  have their own IPv6 path; until then ip6tables is what serves those, the step eBPF data planes
  took before their own IPv6 path existed. Its backend is --iptables-backend or the node's (no
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
from collections.abc import Callable
from typing import Protocol

from agent.config import Config, Mode, NodeContext
from agent.errors import FatalError
from agent.featuregates import node_info
from agent.model.guard import FrontendGuard
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
        range (ekp_cfg6); False (it failed: the rules in place are not known to be ours): it may not
        until a restore succeeds again."""


class EbpfAndIp6tables:
    """eBPF mode's IPv6 proxier: ip6tables (every packet the eBPF programs leave to the stack), then
    the eBPF data path's IPv6 maps (read by the socket programs and, with BPF host routing, by the
    tc programs' IPv6 path: Config.tc_ipv6). Each is synced whatever the other did; a failure of
    either is raised after both ran (the family retries in full), and the ports either could not
    program are reported together.

    ip6tables first because the tc path's source translation waits for it: its MASQUERADE rule
    keeps out of --bpf-snat-ports (agent/iptables/rules.py `masquerade_ports_beside`), and until a
    restore has put that rule in place nf_conntrack may hand out a port of the range the tc path
    would pick for another flow to the same backend. The maps are told after each restore whether it
    succeeded (`masquerade_apart`)."""

    def __init__(self, ebpf: Ipv6Maps, ip6tables: Proxier) -> None:
        self.ebpf = ebpf
        self.ip6tables = ip6tables

    def prepare(self) -> None:
        self.ebpf.prepare()
        self.ip6tables.prepare()

    def sync(
        self, state: ProxyState, node: NodeContext, changed: frozenset[ServicePortName] | None = None
    ) -> SyncResult:
        results: list[SyncResult] = []
        failure: Exception | None = None
        for proxier in (self.ip6tables, self.ebpf):
            try:
                results.append(proxier.sync(state, node, changed))
            except FatalError:
                raise
            except Exception as exc:
                failure = failure or exc
            if proxier is self.ip6tables:
                self.ebpf.masquerade_apart(failure is None)
        if failure is not None:
            raise failure
        ip6, ebpf = results
        failed = {**ip6.failed, **ebpf.failed}
        return SyncResult(full=ebpf.full and ip6.full, failed=failed, repaired=ebpf.repaired + ip6.repaired)

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
        """The last sync failed, or left service ports unprogrammed."""
        return self._need_full or bool(self._retry)

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
