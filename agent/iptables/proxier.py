"""The iptables-mode Proxier: partial syncs that cost what changed, full syncs that repair drift,
and one rejected service port never keeps the others from being programmed.

`sync(state, node, changed)`:

* **Partial** (`changed` = the service ports changed since the last successful sync): render the
  chains of those Services, plus KUBE-SERVICES, KUBE-NODEPORTS and the filter table (always whole,
  as upstream), and restore. No iptables-save: which chains exist is known from what we programmed
  (`_programmed`, a digest per chain), so stale chains are found without reading the kernel. No
  pass over unchanged services beyond writing their KUBE-SERVICES jumps, which upstream's layout
  needs.
* **Full** (`changed=None`; the runner asks for one every sync period; also the first sync, after a
  failure, and when flags or node addresses change): ensure the jumps from the built-in chains, the
  canaries, route_localnet and the nfacct counters; read the kernel back with one iptables-save;
  compare every chain by meaning (canonical.py) with what we last programmed, and count each chain
  that changed behind our back (`SyncResult.repaired`: a `nat -F` that left KUBE-PROXY-CANARY
  behind, a rule inserted or deleted by hand); then write only the chains whose kernel content
  differs from the desired state (all of them when the previous sync failed). A full sync with
  nothing to repair or change restores nothing.
* **Failure isolation**: when iptables-restore rejects the input, the service ports to blame are
  found with `iptables-restore --test` over halves of them (isolate.py); every other port is
  programmed, and the rejected ones keep their last programmed version, if any, and are returned in
  `SyncResult.failed` with the restore's error, as are ports the renderer refused (safety.py). A
  rejected port is tried again when the caller names it in `changed` (the runner's retry), or at a
  full sync once its version changed. A failed partial restore is retried at once as a complete
  one (upstream retries it one sync later).
* **Large clusters** (more than 1000 endpoints): as upstream, crossing the threshold does not force a
  full sync, and stale chains are deleted at most once per `--iptables-sync-period`.
* After the rules: stale UDP conntrack entries (conntrack.py), only when UDP ports changed.
* After the first sync's rules, on a node switched from eBPF mode: the eBPF conntrack's flows
  handed to nf_conntrack, the programs detached and the pins removed (agent/takeover/out_of_ebpf.py);
  on a node kube-proxy ran in nftables mode, its tables deleted.

kube-proxy's conntrack sysctls (`Config.conntrack`) are applied once, before the first sync reads
nf_conntrack_tcp_be_liberal, as kube-proxy applies them before creating its proxier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

from agent.config import Config, NodeContext
from agent.iptables import canonical
from agent.iptables.chains import (
    CANARY_TABLES,
    FIREWALL_JUMPS,
    INVALID_DROPPED_COUNTER,
    JUMPS,
    KUBE_PROXY_CANARY,
    LOCALHOST_NODEPORTS_COUNTER,
    NFACCT_COUNTERS,
    Jump,
    is_service_chain,
)
from agent.iptables.cleanup import CleanupReport, cleanup, owns_something, withdrawal
from agent.iptables.conntrack import ConntrackCleaner, UdpFrontends, udp_frontends
from agent.iptables.isolate import isolate
from agent.iptables.kube_proxy_cleanup import NftTakeover
from agent.iptables.nfacct import Counters, NetlinkCounters
from agent.iptables.rules import (
    LARGE_CLUSTER_ENDPOINTS_THRESHOLD,
    Rendered,
    RenderOptions,
    health_check_accepts,
    render,
    total_endpoints,
)
from agent.iptables.runner import (
    IptablesError,
    IptablesRunner,
    SubprocessRunner,
    ensure_chain,
    ensure_rule,
    supports_random_fully,
)
from agent.metrics import Metrics
from agent.model.problem import printable
from agent.model.types import (
    Endpoint,
    IPFamily,
    Protocol,
    ProxyState,
    ServiceEndpoints,
    ServicePort,
    ServicePortName,
)
from agent.proxier import SyncResult
from agent.takeover.out_of_ebpf import EbpfHandback

log = logging.getLogger(__name__)

ChainKey = tuple[str, str]  # (table, chain)


@dataclass(frozen=True)
class HostFacts:
    random_fully: bool
    conntrack_tcp_liberal: bool


@dataclass(frozen=True)
class SyncStats:
    """What the last successful sync did (for logs, metrics and the benchmark)."""

    full: bool
    rules: int  # rules in filter + nat after the sync
    filter_rules: int
    nat_rules_written: int
    services_written: int
    deleted_chains: int
    large_cluster: bool
    render_seconds: float
    restore_seconds: float
    conntrack_filters: int
    restored: bool = True  # False: a full sync found nothing to write
    repaired: int = 0
    failed: int = 0


@dataclass(frozen=True)
class _Version:
    """A service port as last programmed, kept to stand in for it while a new version is rejected."""

    port: ServicePort
    endpoints: ServiceEndpoints
    raw: tuple[Endpoint, ...]


def _version(state: ProxyState, spn: ServicePortName) -> _Version | None:
    sp = state.services.get(spn)
    if sp is None:
        return None
    return _Version(sp, state.endpoints.get(spn, ServiceEndpoints()), state.raw_endpoints.get(spn, ()))


def _jump_text(jump: Jump) -> str:
    return " ".join(f'"{a}"' if " " in a else a for a in jump.rule_args())


def _subset(state: ProxyState, ports: Collection[ServicePortName]) -> ProxyState:
    keep = set(ports)
    return ProxyState(
        node=state.node,
        services={k: v for k, v in state.services.items() if k in keep},
        endpoints={k: v for k, v in state.endpoints.items() if k in keep},
        raw_endpoints={k: v for k, v in state.raw_endpoints.items() if k in keep},
        family=state.family,
        elsewhere=state.elsewhere,
    )


class IptablesProxier:
    """agent.proxier.Proxier for `--mode=iptables`, for one address family (`family`: the IPv6
    one runs ip6tables; kube-proxy's metaproxier runs one of each). No side effect at
    construction."""

    def __init__(
        self,
        config: Config,
        *,
        runner: IptablesRunner | None = None,
        backend_runner: Callable[[str], IptablesRunner] | None = None,
        counters: Counters | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
        take_over: Callable[[], bool] | None = None,
        family: IPFamily = IPFamily.IPv4,
        snat6_held: Callable[[], tuple[int, int] | None] | None = None,
    ) -> None:
        """`snat6_held`: eBPF mode's ip6tables beside the tc IPv6 path, the ports that path's live
        flows hold outside --bpf-snat-ports (EbpfProxier.snat6_held), asked at each sync: its
        MASQUERADE keeps off them too (rules.py `masquerade_ports_beside`)."""
        self._config = config
        self.family = family
        self._snat6_held = snat6_held
        self._tool = "ip6tables" if family is IPFamily.IPv6 else "iptables"  # in log lines
        # Once a sync put the rules in place, until it returns True (done: nothing to retry): the
        # eBPF data path's flows, programs and pins (a node switched from eBPF mode),
        # agent/takeover/out_of_ebpf.py, and kube-proxy's nftables tables.
        self._take_over = take_over if take_over is not None else self._take_over_node
        self._taken_over = False
        self._handed_back = False
        # One for the agent's life: a run that detached the programs from some devices only is
        # tried again at the next sync, and must know those devices' flows need their NAT entries.
        self._handback: EbpfHandback | None = None
        # The families whose first restore the hand-back from eBPF mode waits for (`hand_back_after`),
        # and those restored so far: the eBPF programs serve until every family's rules do.
        self._handback_waits: set[IPFamily] = {family}
        self._restored: set[IPFamily] = set()
        # When this family's rules were first in place with the hand-back still waiting for another
        # family's first restore (`_hand_back`): the wait is bounded from then.
        self._handback_waited_since: float | None = None
        self._runner: IptablesRunner = (
            runner if runner is not None else SubprocessRunner(config, family=family.value)
        )
        # A runner for one named backend ("nft", "legacy"), for the cleanup of both.
        self._backend_runner = backend_runner or (
            lambda backend: SubprocessRunner(replace(config, iptables_backend=backend), family=family.value)
        )
        self._nft_takeover = NftTakeover(self._runner)
        self._metrics = metrics
        self._counters: Counters = counters if counters is not None else NetlinkCounters(config.netns)
        self._conntrack = ConntrackCleaner(self._runner.command)
        self._clock = clock
        self._host: HostFacts | None = None
        self._host_lock = threading.Lock()
        self._nfacct = dict.fromkeys(NFACCT_COUNTERS, False)
        # Digest per (table, chain) of every chain of ours as we last wrote it; None before the
        # first successful sync.
        self._programmed: dict[ChainKey, bytes] | None = None
        self._need_complete = True
        self._globals: tuple[object, ...] | None = None
        self._last_cleanup = float("-inf")
        self._last_good: dict[ServicePortName, _Version] = {}
        # Ports iptables-restore rejected: the reason, and the version that was rejected.
        self._rejected: dict[ServicePortName, tuple[str, _Version]] = {}
        self._reported: dict[ServicePortName, str] = {}
        self._udp: UdpFrontends | None = None
        self._digests = canonical.DigestCache()
        # The ACCEPTs `withdraw` put in place (None: the rules in place are a sync's or unknown)
        self._withdrawn: tuple[str, ...] | None = None
        self.last_sync: SyncStats | None = None

    def _take_over_node(self) -> bool:
        """Another data path's state, once our rules serve: eBPF mode's programs and pins (their
        flows handed to nf_conntrack first), kube-proxy's nftables tables (their flows are in
        nf_conntrack already)."""
        self._restored.add(self.family)
        self._hand_back()
        return self._nft_takeover() and self._handed_back

    def hand_back_after(self, family: IPFamily) -> Callable[[], bool]:
        """The take-over step of the proxier of `family` (iptables mode's IPv6 one): the hand-back
        from eBPF mode waits for its first restore too. eBPF mode's ip6tables holds only the ports
        its programs leave to the stack (agent/model/tc6_leaves.py): detached before ip6tables has
        every port, the others would reach a stack with no rule for them."""
        self._handback_waits.add(family)

        def restored() -> bool:
            self._restored.add(family)
            self._hand_back()
            return True

        return restored

    def _hand_back(self) -> None:
        """Once every family's first restore succeeded. While only some did, the eBPF programs
        translate from maps nobody writes any more (backends that leave stay there), so the wait is
        bounded: from the first good restore of this family's rules, for one --iptables-sync-period,
        after which the programs go with a warning and the waiting family's ports that eBPF mode's
        ip6tables left to the tc programs have no rule until its restore succeeds. Both wrong; a
        stale backend for as long as a restore fails is the worse."""
        if self._handed_back:
            return
        if self._handback is None:
            self._handback = EbpfHandback(self._config)
        handback = self._handback
        if not handback.pending:  # no eBPF mode before this one: nothing to wait for, nothing to say
            # run() then only puts back the tcp_be_liberal a killed takeover kept
            self._handed_back = handback.run()
            return
        waiting = sorted(f.name for f in self._handback_waits - self._restored)
        if waiting:
            if self.family not in self._restored:
                return
            now = self._clock()
            if self._handback_waited_since is None:
                self._handback_waited_since = now
                log.warning(
                    "%s rules are in place, but the eBPF programs a switch from eBPF mode left attached "
                    "keep serving until the %s rules' first restore succeeds (eBPF mode's ip6tables "
                    "holds only the ports those programs left to it); they translate from maps no "
                    "agent writes any more. Handed back in %.0fs (--iptables-sync-period) whether or not",
                    self._tool,
                    "/".join(waiting),
                    self._config.sync_period_s,
                )
                return
            if now - self._handback_waited_since < self._config.sync_period_s:
                return
            log.warning(
                "the %s rules' first restore has not succeeded in %.0fs: handing the node back from the "
                "eBPF programs without it. The service ports eBPF mode's ip6tables left to the tc "
                "programs (absent from its KUBE-SERVICES) have no rule until that restore succeeds: "
                "see the %s sync errors",
                "/".join(waiting),
                now - self._handback_waited_since,
                "/".join(waiting),
            )
        # False after a partial detach: the pins stay (`pending`), tried again at the next sync
        self._handed_back = handback.run()

    @property
    def runner(self) -> IptablesRunner:
        return self._runner

    # ------------------------------------------------------------------------------------ render

    def render(self, state: ProxyState, node: NodeContext) -> str:
        """The full restore input a full sync would apply now (host facts as last seen, else a
        modern host's)."""
        host = self._host or HostFacts(random_fully=True, conntrack_tcp_liberal=False)
        return render(state, node, self._options(host, state)).text

    # ----------------------------------------------------------------------------------- Proxier

    def sync(
        self, state: ProxyState, node: NodeContext, changed: frozenset[ServicePortName] | None = None
    ) -> SyncResult:
        start = self._clock()
        self._withdrawn = None
        host = self._host_facts()
        full = changed is None or self._need_complete
        if full:
            self._ensure_counters()
        options = self._options(host, state)
        complete = self._need_complete
        if self._globals is not None and (options, node) != self._globals:
            log.info("%s: flags, host facts or node addresses changed; rewriting every chain", self._tool)
            complete = full = True
        large = total_endpoints(state) > LARGE_CLUSTER_ENDPOINTS_THRESHOLD

        self._need_complete = True  # until this sync succeeds: the kernel may hold anything
        if full:
            outcome = self._full(state, node, options, complete=complete, large=large, start=start)
        else:
            assert changed is not None
            outcome = self._partial(state, node, options, changed, large=large, start=start)
        self._need_complete = False
        self._globals = (options, node)
        if not self._taken_over:
            self._taken_over = self._take_over()
        self._remember_good(state, None if outcome.full else changed)

        filters = self._clean_conntrack(state, changed)
        failed = {**outcome.rendered.refused, **{k: why for k, (why, _) in self._rejected.items()}}
        self._report_failures(failed)
        r = outcome.rendered
        self.last_sync = SyncStats(
            full=outcome.full,
            rules=r.rule_count,
            filter_rules=r.filter_rules,
            nat_rules_written=r.nat_rules if outcome.restored else 0,
            services_written=len(r.written_services) if outcome.restored else 0,
            deleted_chains=len(r.deleted_chains) if outcome.restored else 0,
            large_cluster=r.large_cluster,
            render_seconds=outcome.rendered_at - start,
            restore_seconds=outcome.restored_at - outcome.rendered_at,
            conntrack_filters=filters,
            restored=outcome.restored,
            repaired=outcome.repaired,
            failed=len(failed),
        )
        log.debug("iptables sync (%s): %s", self.family, self.last_sync)
        if self._metrics is not None:
            filter_rules = r.filter_rules
            self._metrics.set_iptables_rules(
                {"filter": filter_rules, "nat": r.rule_count - filter_rules},
                {"filter": filter_rules if outcome.restored else 0, "nat": self.last_sync.nat_rules_written},
                str(self.family),
            )
        return SyncResult(full=outcome.full, failed=failed, repaired=outcome.repaired)

    def withdraw(self, state: ProxyState, *, full: bool) -> SyncResult:
        """eBPF mode's ip6tables when its programs leave nothing to the stack (agent/metaproxier.py):
        every rule of ours removed but the healthCheckNodePorts' ACCEPTs (rules.py
        `health_check_accepts`), so that no conntrack match and no nat chain of ours makes
        nf_conntrack track, and nf_nat look at, every IPv6 packet of the node's netns. One restore
        (cleanup.py `withdrawal`, atomic per table: the ACCEPTs never go missing, INPUT's jump to
        them first), written when the ACCEPTs change or the rules were a sync's; at `full` (the
        periodic resync) the kernel's rules are read back and rewritten only if they drifted. The
        next `sync` writes every chain again. kube-proxy's `ip6 kube-proxy` table is taken over as
        after a restore."""
        accepts = tuple(health_check_accepts(state, self.family.value))
        if full or self._programmed is not None or accepts != self._withdrawn:
            self._need_complete = True  # whatever the kernel holds, the next sync writes it all
            self._programmed = None
            self._globals = None
            was, self._withdrawn = self._withdrawn, None
            text = withdrawal(canonical.parse(self._runner.save()), accepts)
            if text:
                self._runner.restore(text)
            self._withdrawn = accepts
            if self._metrics is not None:
                n = len(accepts)
                self._metrics.set_iptables_rules(
                    {"filter": n, "nat": 0}, {"filter": n, "nat": 0}, str(self.family)
                )
            if was is None and text:
                log.info(
                    "%s: the eBPF programs leave no service port to the stack: removed every rule of ours "
                    "but the health check node ports' ACCEPTs (no nf_conntrack or nf_nat hook for them)",
                    self._tool,
                )
            elif text and was == accepts:
                log.warning(
                    "%s: rules of ours changed behind the agent while withdrawn to the health check node "
                    "ports' ACCEPTs; rewritten (another process editing %s?)",
                    self._tool,
                    self._tool,
                )
        if not self._taken_over:
            self._taken_over = self._take_over()
        return SyncResult(full=True, failed={}, repaired=0)

    def prepare(self) -> None:
        """Learn the host's iptables (version, backend, conntrack leniency) before the first sync."""
        self._host_facts()

    def cleanup(self) -> None:
        """Remove our chains and jumps: from the backend `--iptables-backend` names, or (auto) from
        each backend that holds any of them (an operator may have switched backends since)."""
        if self._config.iptables_backend in ("nft", "legacy"):
            cleanup(self._runner)
            return
        for backend in ("nft", "legacy"):
            runner = self._backend_runner(backend)
            try:
                save = runner.save()
            except IptablesError as exc:
                log.debug("%s-%s not usable here: %s", self._tool, backend, exc)
                continue
            if owns_something(save):
                report: CleanupReport = cleanup(runner)
                log.info("%s-%s: removed %s", self._tool, backend, report.chains_deleted)

    # ------------------------------------------------------------------------------ the two syncs

    def _partial(
        self,
        state: ProxyState,
        node: NodeContext,
        options: RenderOptions,
        changed: frozenset[ServicePortName],
        *,
        large: bool,
        start: float,
    ) -> _Outcome:
        assert self._programmed is not None
        for spn in changed:
            self._rejected.pop(spn, None)  # the caller retries these: try their new version
        services = {spn.service for spn in changed}
        programmed_nat = {c for t, c in self._programmed if t == "nat"}
        cleanup_due = self._cleanup_due(large)
        existing = programmed_nat if cleanup_due else ()
        rendered = self._render(state, node, options, changed=services, existing=existing)
        missing = rendered.kept_chains - programmed_nat
        if missing:
            # Chains we never wrote (a service that failed before): write their services too.
            services |= {rendered.chain_owner[c] for c in missing}
            rendered = self._render(state, node, options, changed=services, existing=existing)
        rendered_at = self._clock()
        try:
            self._runner.restore(rendered.text)
        except IptablesError as exc:
            if self._metrics is not None:
                self._metrics.record_restore_failure(partial=True, family=str(self.family))
            log.warning("%s: partial restore failed, writing every chain instead: %s", self._tool, exc)
            return self._full(state, node, options, complete=True, large=large, start=start)
        self._record(rendered.text, complete=False)
        if cleanup_due:
            self._last_cleanup = start
        return _Outcome(False, rendered, True, 0, rendered_at, self._clock())

    def _full(
        self,
        state: ProxyState,
        node: NodeContext,
        options: RenderOptions,
        *,
        complete: bool,
        large: bool,
        start: float,
    ) -> _Outcome:
        # Retry each rejected port whose version changed since; an unchanged one stays out (its
        # last good version stands in) rather than costing a bisection on every full sync.
        for spn, (_, version) in list(self._rejected.items()):
            if _version(state, spn) != version:
                del self._rejected[spn]
        self._digests.age()
        kernel = canonical.parse(self._runner.save())
        kernel_digests = canonical.chain_digests(kernel, cache=self._digests)
        repaired = self._drift(kernel_digests)
        repaired += self._ensure_base(options, kernel)
        cleanup_due = self._cleanup_due(large)
        existing = (
            {c for t, c in kernel_digests if t == "nat" and is_service_chain(c)} if cleanup_due else set()
        )
        desired = self._render(state, node, options, changed=None, existing=existing)
        rendered_at = self._clock()

        to_write: Rendered | None = desired
        want = canonical.chain_digests(canonical.parse(desired.text), cache=self._digests)
        if not complete:
            differing = {key for key, d in want.items() if kernel_digests.get(key) != d}
            if not differing and not desired.deleted_chains:
                to_write = None
            else:
                # The Services owning a differing chain; KUBE-SERVICES, KUBE-NODEPORTS and the
                # filter table are written in any case.
                owners = {desired.chain_owner[c] for t, c in differing if c in desired.chain_owner}
                to_write = self._render(state, node, options, changed=owners, existing=existing)
        if to_write is None:
            self._programmed = want
            if cleanup_due:
                self._last_cleanup = start
            return _Outcome(True, desired, False, repaired, rendered_at, self._clock())

        complete_text = to_write is desired
        try:
            self._runner.restore(to_write.text)
        except IptablesError as exc:
            if self._metrics is not None:
                self._metrics.record_restore_failure(partial=False, family=str(self.family))
            to_write = self._restore_isolating(state, node, options, existing, desired, exc, complete_text)
            complete_text = True
        self._record(to_write.text, complete=complete_text)
        if cleanup_due:
            self._last_cleanup = start
        return _Outcome(True, to_write, True, repaired, rendered_at, self._clock())

    # ------------------------------------------------------------------------- failure isolation

    def _restore_isolating(
        self,
        state: ProxyState,
        node: NodeContext,
        options: RenderOptions,
        existing: Collection[str],
        desired: Rendered,
        error: IptablesError,
        tried_desired: bool,
    ) -> Rendered:
        """After a rejected restore: restore everything but the service ports iptables-restore
        rejects; their names and errors go to `_rejected`. Raises when no single port is to blame."""
        if not tried_desired:
            log.warning(
                "%s: restore of the differing chains failed, writing every chain: %s", self._tool, error
            )
            try:
                self._runner.restore(desired.text)
                return desired
            except IptablesError as exc:
                error = exc
        ports = sorted((p for p in state.services if p not in desired.refused), key=str)

        def passes(subset: Collection[ServicePortName]) -> bool:
            return self._runner.restore_test(render(_subset(state, subset), node, options).text) is None

        if not passes(()):
            raise IptablesError(f"iptables-restore rejects our rules even without any service: {error}")
        bad = isolate(ports, passes)
        if not bad:
            raise IptablesError(f"iptables-restore failed and no single service port is to blame: {error}")
        for spn in bad:
            reason = self._runner.restore_test(render(_subset(state, [spn]), node, options).text)
            version = _version(state, spn)
            assert version is not None  # `bad` holds ports of `state`
            self._rejected[spn] = (f"iptables-restore rejected its rules: {reason or error}", version)
        rendered = self._render(state, node, options, changed=None, existing=existing)
        try:
            self._runner.restore(rendered.text)
        except IptablesError:
            # A last programmed version that no longer goes in either: leave those ports out.
            kept = _subset(state, [p for p in state.services if p not in self._rejected])
            rendered = render(kept, node, options, existing_nat_chains=existing)
            self._runner.restore(rendered.text)
        log.warning(
            "%s: %s-restore rejected %d service port(s), all others programmed: %s",
            self._tool,
            self._tool,
            len(bad),
            error,
        )
        return rendered

    # ----------------------------------------------------------------------------------- helpers

    def _render(
        self,
        state: ProxyState,
        node: NodeContext,
        options: RenderOptions,
        *,
        changed: Collection[str] | None,
        existing: Collection[str],
    ) -> Rendered:
        """Render, with each rejected port replaced by its last programmed version (or left out)."""
        if self._rejected:
            state = self._with_fallbacks(state)
        return render(state, node, options, changed=changed, existing_nat_chains=existing)

    def _with_fallbacks(self, state: ProxyState) -> ProxyState:
        services = dict(state.services)
        endpoints = dict(state.endpoints)
        raw = dict(state.raw_endpoints)
        for spn in list(self._rejected):
            if spn not in state.services:
                del self._rejected[spn]  # deleted meanwhile: nothing to stand in for
                continue
            old = self._last_good.get(spn)
            if old is None:
                services.pop(spn, None)
                endpoints.pop(spn, None)
                raw.pop(spn, None)
            else:
                services[spn], endpoints[spn], raw[spn] = old.port, old.endpoints, old.raw
        return ProxyState(
            node=state.node,
            services=services,
            endpoints=endpoints,
            raw_endpoints=raw,
            family=state.family,
            elsewhere=state.elsewhere,
        )

    def _remember_good(self, state: ProxyState, changed: Collection[ServicePortName] | None) -> None:
        """Keep each programmed port's version (only the changed ones after a partial sync)."""
        ports = state.services.keys() if changed is None else changed
        for spn in ports:
            version = _version(state, spn)
            if version is None:
                self._last_good.pop(spn, None)
            elif spn not in self._rejected:
                self._last_good[spn] = version
        if changed is None:
            for spn in [s for s in self._last_good if s not in state.services]:
                del self._last_good[spn]

    def _record(self, text: str, *, complete: bool) -> None:
        written = canonical.parse(text)
        digests = canonical.chain_digests(written, cache=self._digests)
        if complete or self._programmed is None:
            self._programmed = digests
            return
        self._programmed.update(digests)
        for table, chains in written.deleted.items():
            for chain in chains:
                self._programmed.pop((table, chain), None)

    def _drift(self, kernel: Mapping[ChainKey, bytes]) -> int:
        """Chains of ours whose kernel content is not what we last wrote (each one a repair)."""
        if self._programmed is None:
            return 0
        drifted = sorted(key for key, d in self._programmed.items() if kernel.get(key) != d)
        if drifted:
            shown = ", ".join(f"{t}/{c}" for t, c in drifted[:8]) + (" ..." if len(drifted) > 8 else "")
            log.warning(
                "%s: %d chain(s) changed behind the agent's back (flushed, edited or deleted by "
                "someone else); rewriting them: %s",
                self._tool,
                len(drifted),
                shown,
            )
        return len(drifted)

    def _ensure_base(self, options: RenderOptions, kernel: canonical.Dump) -> int:
        """Jumps from the built-in chains, the canaries, route_localnet: added when missing
        (`-C` then `-I`, never duplicated). The number added, after the first sync (repairs)."""
        added = 0
        jumps = JUMPS + (FIREWALL_JUMPS if options.localhost_nodeports_enabled else ())
        # A chain the save lists, or one this loop created for an earlier jump, needs no `-N`: an
        # iptables process each (several jumps share a target), about 3 ms of CPU.
        chains = {table: set(kernel.table(table)) for table in {jump.table for jump in jumps}}
        for jump in jumps:
            rules = kernel.table(jump.table).get(jump.src_chain, [])
            want = canonical.canonical_rule(_jump_text(jump))
            if any(canonical.canonical_rule(r) == want for r in rules):
                continue
            if jump.dst_chain not in chains[jump.table]:
                ensure_chain(self._runner, jump.table, jump.dst_chain)
                chains[jump.table].add(jump.dst_chain)
            if not ensure_rule(self._runner, jump.table, jump.src_chain, jump.rule_args(), prepend=True):
                added += 1
        for table in CANARY_TABLES:
            if KUBE_PROXY_CANARY not in kernel.table(table) and not ensure_chain(
                self._runner, table, KUBE_PROXY_CANARY
            ):
                added += 1
        if options.localhost_nodeports_enabled:
            # NodePorts on 127.0.0.1 need the kernel to route loopback-destined DNATed packets;
            # KUBE-FIREWALL's martian drop closes the hole this opens (CVE-2020-8558).
            key = "net.ipv4.conf.all.route_localnet"
            if self._runner.command(["sysctl", "-n", key]).stdout.strip() != "1":
                r = self._runner.command(["sysctl", "-w", f"{key}=1"])
                if r.returncode != 0:
                    raise IptablesError(f"cannot set {key}=1: {r.stderr.strip()}")
                added += 1
        return added if self._programmed is not None else 0

    def _ensure_counters(self) -> None:
        """kube-proxy's nfacct counters, created on every full sync (Ensure is idempotent)."""
        for name in NFACCT_COUNTERS:
            try:
                self._counters.ensure(name)
            except OSError as exc:
                if self._nfacct[name] or self._host is None:
                    log.warning(
                        "nfacct counter %s unavailable (%s): its metric will not be updated and the "
                        "rules go without the nfacct match",
                        name,
                        exc,
                    )
                self._nfacct[name] = False
            else:
                self._nfacct[name] = True

    def _cleanup_due(self, large: bool) -> bool:
        """Delete stale chains now? Always, except in large-cluster mode, where upstream does it at
        most once per sync period (finding them costs an iptables-save of a big table)."""
        return not large or self._clock() - self._last_cleanup > self._config.sync_period_s

    def _options(self, host: HostFacts, state: ProxyState) -> RenderOptions:
        return RenderOptions.from_config(
            self._config,
            family=self.family,
            node_pod_cidrs=state.node.pod_cidrs,
            random_fully=host.random_fully,
            conntrack_tcp_liberal=host.conntrack_tcp_liberal,
            nfacct_invalid_dropped=self._nfacct[INVALID_DROPPED_COUNTER],
            nfacct_localhost_nodeports=self._nfacct[LOCALHOST_NODEPORTS_COUNTER],
            snat6_held=self._snat6_held() if self._snat6_held is not None else None,
        )

    def _host_facts(self) -> HostFacts:
        with self._host_lock:  # `prepare` may run on another thread while the first sync starts
            return self._learn_host()

    def _learn_host(self) -> HostFacts:
        if self._host is None:
            # kube-proxy's conntrack sysctls were written at start (agent.nodeinit.setup_conntrack),
            # so the nf_conntrack_tcp_be_liberal read here is the one in force.
            version = self._runner.version()
            liberal = self._runner.command(["sysctl", "-n", "net.netfilter.nf_conntrack_tcp_be_liberal"])
            self._host = HostFacts(
                random_fully=supports_random_fully(version),
                conntrack_tcp_liberal=liberal.returncode == 0 and liberal.stdout.strip() not in ("", "0"),
            )
            log.info(
                "%s %s (%s): --random-fully %s; INVALID drop %s",
                self._tool,
                ".".join(map(str, version)) or "version unknown",
                self._runner.backend,
                "supported" if self._host.random_fully else "unsupported",
                "off (nf_conntrack_tcp_be_liberal set)" if self._host.conntrack_tcp_liberal else "on",
            )
        return self._host

    def _report_failures(self, failed: Mapping[ServicePortName, str]) -> None:
        for spn in sorted(failed.keys() - self._reported.keys(), key=str):
            log.error(
                "%s: Service %s/%s port %s (%s) not programmed: %s; every other service port is",
                self._tool,
                printable(spn.namespace),
                printable(spn.name),
                printable(spn.port) or "(unnamed)",
                spn.protocol.value,
                failed[spn],
            )
        for spn in sorted(self._reported.keys() - failed.keys(), key=str):
            log.info(
                "%s: Service %s/%s port %s programmed again", self._tool, spn.namespace, spn.name, spn.port
            )
        self._reported = dict(failed)

    def _clean_conntrack(self, state: ProxyState, changed: Collection[ServicePortName] | None) -> int:
        if changed is not None and not any(spn.protocol is Protocol.UDP for spn in changed):
            return 0  # nothing UDP changed: no pass over the services
        frontends = udp_frontends(state)
        if frontends == self._udp:
            return 0
        started = time.monotonic()
        try:
            filters = self._conntrack.clean(state)
        except Exception as exc:
            log.warning("UDP conntrack cleanup failed (retried at the next sync): %s", exc)
            return 0
        if self._metrics is not None:  # kube-proxy's conntrack reconciler metrics
            self._metrics.record_conntrack_cleanup(
                time.monotonic() - started, self._conntrack.deleted, str(self.family)
            )
        self._udp = frontends
        return len(filters)


@dataclass(frozen=True)
class _Outcome:
    full: bool
    rendered: Rendered
    restored: bool
    repaired: int
    rendered_at: float
    restored_at: float
