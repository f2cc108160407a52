"""The iptables-mode Proxier: render, apply atomically, delete stale chains, clear UDP conntrack.

One `sync(state, node)`:

1. Learn the host facts once (iptables version for `--random-fully`, nf_conntrack_tcp_be_liberal)
   and read the current ruleset with one iptables-save (all tables).
2. Decide full or partial, as kube-proxy does. Full at the first sync, after a failed sync, every
   `full_sync_period_s` (kube-proxy: one hour), when KUBE-PROXY-CANARY is missing from mangle, nat
   or filter (someone flushed the tables), and when anything global to the rules changed (flags,
   node addresses, large-cluster mode). A full sync first ensures the top-level chains, the jumps
   from the built-in chains (`-C`, then `-I` when missing: never duplicated), the canaries, and
   route_localnet=1 when localhost NodePorts are on.
3. Render (rules.py, pure): a partial sync rewrites only the chains of services whose ports or
   chosen endpoints changed; KUBE-SERVICES, KUBE-NODEPORTS, KUBE-EXTERNAL-SERVICES and the rest of
   the filter table always. Service chains that exist but are no longer used are flushed and
   deleted in the same input.
4. Apply: one `iptables-restore --noflush --counters -w 5`, filter then nat, atomic per table.
   On failure the next sync is a full one and the error propagates (the runner retries).
5. When the UDP frontends or their serving endpoints changed, delete the stale UDP conntrack
   entries (conntrack.py). Its failure is logged, not raised: the rules are already right.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from agent.config import Config, NodeContext
from agent.iptables.chains import CANARY_TABLES, FIREWALL_JUMPS, JUMPS, KUBE_PROXY_CANARY
from agent.iptables.cleanup import CleanupReport, cleanup, owns_something
from agent.iptables.conntrack import ConntrackCleaner, UdpFrontends, udp_frontends
from agent.iptables.rules import (
    LARGE_CLUSTER_ENDPOINTS_THRESHOLD,
    RenderOptions,
    categorized,
    render,
    total_endpoints,
)
from agent.iptables.runner import (
    IptablesError,
    IptablesRunner,
    SubprocessRunner,
    chains_by_table,
    ensure_chain,
    ensure_rule,
    supports_random_fully,
)
from agent.model.types import ProxyState, ServiceEndpoints, ServicePort, ServicePortName
from agent.proxier import SyncResult

log = logging.getLogger(__name__)

# kube-proxy's proxyutil.FullSyncPeriod.
FULL_SYNC_PERIOD_S = 3600.0

Fingerprint = tuple[tuple[ServicePort, ServiceEndpoints], ...]


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


def service_fingerprints(state: ProxyState) -> dict[str, Fingerprint]:
    """Per Service (`namespace/name`): everything its own chains are rendered from."""
    parts: dict[str, list[tuple[ServicePort, ServiceEndpoints]]] = {}
    for sp in state.sorted_ports():
        parts.setdefault(sp.name.service, []).append((sp, categorized(state, sp)))
    return {k: tuple(v) for k, v in parts.items()}


class IptablesProxier:
    """agent.proxier.Proxier (and DryRun) for `--mode=iptables`. No side effect at construction."""

    def __init__(
        self,
        config: Config,
        *,
        runner: IptablesRunner | None = None,
        clock: Callable[[], float] = time.monotonic,
        full_sync_period_s: float = FULL_SYNC_PERIOD_S,
    ) -> None:
        self._config = config
        self._runner_given = runner is not None
        self._runner: IptablesRunner = runner if runner is not None else SubprocessRunner(config)
        self._conntrack = ConntrackCleaner(self._runner.command)
        self._clock = clock
        self._full_sync_period_s = full_sync_period_s
        self._host: HostFacts | None = None
        self._need_full = True
        self._last_full = float("-inf")
        self._globals: tuple[object, ...] | None = None
        self._fingerprints: dict[str, Fingerprint] = {}
        self._udp: UdpFrontends | None = None
        self.last_sync: SyncStats | None = None

    @property
    def runner(self) -> IptablesRunner:
        return self._runner

    # ------------------------------------------------------------------------------------ DryRun

    def render(self, state: ProxyState, node: NodeContext) -> str:
        """The full restore input a full sync would apply now (host facts as last seen, else a
        modern host's)."""
        host = self._host or HostFacts(random_fully=True, conntrack_tcp_liberal=False)
        return render(state, node, self._options(host)).text

    # ----------------------------------------------------------------------------------- Proxier

    def sync(
        self, state: ProxyState, node: NodeContext, changed: frozenset[ServicePortName] | None = None
    ) -> SyncResult:
        start = self._clock()
        host = self._host_facts()
        options = self._options(host)
        chains = chains_by_table(self._runner.save())
        missing_canary = [t for t in CANARY_TABLES if KUBE_PROXY_CANARY not in chains.get(t, set())]
        fingerprints = service_fingerprints(state)
        large = total_endpoints(state) > LARGE_CLUSTER_ENDPOINTS_THRESHOLD
        global_inputs: tuple[object, ...] = (options, node, large)

        reason = ""
        if self._need_full:
            reason = "first sync" if self._globals is None else "previous sync failed"
        elif missing_canary and self._globals is not None:
            reason = f"canary chain missing from {','.join(missing_canary)} (tables flushed?)"
        elif global_inputs != self._globals:
            reason = "options or node addresses changed"
        elif start - self._last_full >= self._full_sync_period_s:
            reason = "periodic full sync"
        full = bool(reason)

        changed_services: set[str] | None = None
        if full:
            log.info("iptables full sync: %s", reason)
            self._need_full = True
            self._ensure_base(options)
        else:
            changed_services = {
                k
                for k in fingerprints.keys() | self._fingerprints.keys()
                if fingerprints.get(k) != self._fingerprints.get(k)
            }

        existing_nat = chains.get("nat", set())
        rendered = render(state, node, options, changed=changed_services, existing_nat_chains=existing_nat)
        if not full and not rendered.kept_chains <= existing_nat:
            # Chains of unchanged services vanished behind our back: the partial restore would
            # fail on the jumps to them. Write everything instead.
            log.info("iptables full sync: %d kept chain(s) missing", len(rendered.kept_chains - existing_nat))
            full = True
            self._need_full = True
            self._ensure_base(options)
            rendered = render(state, node, options, existing_nat_chains=existing_nat)
        rendered_at = self._clock()
        try:
            self._runner.restore(rendered.text)
        except Exception:
            self._need_full = True  # the kernel may hold anything now
            raise
        restored_at = self._clock()
        self._need_full = False
        if full:
            self._last_full = start
        self._globals = global_inputs
        self._fingerprints = fingerprints

        filters = self._clean_conntrack(state)
        self.last_sync = SyncStats(
            full=full,
            rules=rendered.rule_count,
            filter_rules=rendered.filter_rules,
            nat_rules_written=rendered.nat_rules,
            services_written=len(rendered.written_services),
            deleted_chains=len(rendered.deleted_chains),
            large_cluster=rendered.large_cluster,
            render_seconds=rendered_at - start,
            restore_seconds=restored_at - rendered_at,
            conntrack_filters=filters,
        )
        log.debug("iptables sync: %s", self.last_sync)
        return SyncResult(full=full)

    def cleanup(self) -> None:
        """Remove our chains and jumps: from the given runner, or from each iptables backend that
        holds any of them (an operator may have switched backends since)."""
        if self._runner_given or self._config.iptables_backend in ("nft", "legacy"):
            cleanup(self._runner)
            return
        for backend in ("nft", "legacy"):
            runner = SubprocessRunner(replace(self._config, iptables_backend=backend))
            try:
                save = runner.save()
            except IptablesError as exc:
                log.debug("iptables-%s not usable here: %s", backend, exc)
                continue
            if owns_something(save):
                report: CleanupReport = cleanup(runner)
                log.info("iptables-%s: removed %s", backend, report.chains_deleted)

    # ------------------------------------------------------------------------------------ helpers

    def _options(self, host: HostFacts) -> RenderOptions:
        return RenderOptions.from_config(
            self._config, random_fully=host.random_fully, conntrack_tcp_liberal=host.conntrack_tcp_liberal
        )

    def _host_facts(self) -> HostFacts:
        if self._host is None:
            version = self._runner.version()
            liberal = self._runner.command(["sysctl", "-n", "net.netfilter.nf_conntrack_tcp_be_liberal"])
            self._host = HostFacts(
                random_fully=supports_random_fully(version),
                conntrack_tcp_liberal=liberal.returncode == 0 and liberal.stdout.strip() not in ("", "0"),
            )
            log.info(
                "iptables %s (%s): --random-fully %s; INVALID drop %s",
                ".".join(map(str, version)) or "version unknown",
                self._runner.backend,
                "supported" if self._host.random_fully else "unsupported",
                "off (nf_conntrack_tcp_be_liberal set)" if self._host.conntrack_tcp_liberal else "on",
            )
        return self._host

    def _ensure_base(self, options: RenderOptions) -> None:
        """Top-level chains, the jumps into them, the canaries, and route_localnet when needed."""
        jumps = JUMPS + (FIREWALL_JUMPS if options.localhost_nodeports_enabled else ())
        for jump in jumps:
            ensure_chain(self._runner, jump.table, jump.dst_chain)
            ensure_rule(self._runner, jump.table, jump.src_chain, jump.rule_args(), prepend=True)
        for table in CANARY_TABLES:
            ensure_chain(self._runner, table, KUBE_PROXY_CANARY)
        if options.localhost_nodeports_enabled:
            # NodePorts on 127.0.0.1 need the kernel to route loopback-destined DNATed packets;
            # KUBE-FIREWALL's martian drop closes the hole this opens (CVE-2020-8558).
            r = self._runner.command(["sysctl", "-w", "net.ipv4.conf.all.route_localnet=1"])
            if r.returncode != 0:
                raise IptablesError(f"cannot set net.ipv4.conf.all.route_localnet=1: {r.stderr.strip()}")

    def _clean_conntrack(self, state: ProxyState) -> int:
        frontends = udp_frontends(state)
        if frontends == self._udp:
            return 0
        try:
            filters = self._conntrack.clean(state)
        except Exception as exc:
            log.warning("UDP conntrack cleanup failed (retried at the next sync): %s", exc)
            return 0
        self._udp = frontends
        return len(filters)
