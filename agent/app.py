"""The composition root: picks the parts the flags ask for and hands them to the Agent.

    agent ...                      run(config): pre-flight, node lock, the data path's load started,
                                   build_agent(...).run()
    agent --dry-run                print what would be written for a services file
    agent --cleanup                remove what either mode installed (refused under a live agent)
    agent --cleanup-kube-proxy     remove what a previous kube-proxy left, then exit
    agent --init-only              the privileged node set-up of the mode (sysctls, bpffs), then exit

The only module that knows every layer. The long-running logic lives in agent/daemon.py; this
module only decides which source (the services file, or the API server through `--kubeconfig` /
`--master` / the pod's service account), which backend, and which servers, and turns everything
that no retry can fix into one message and exit status 1 (a `--kubeconfig` that cannot be used is
a bad input, as a bad `--config`: exit status 2). The pre-flight and an unreadable services file
stop it before anything is created; a later failure (credentials, a bind) may come after eBPF
mode's early load pinned maps and set sysctls, as a killed agent leaves them (the next agent
re-adopts them): the load is waited for under the node lock, so nothing outlives it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from prometheus_client import CollectorRegistry

from agent.collector import StartHold, set_thresholds
from agent.config import Config, HostRouting, Mode, NodeContext
from agent.daemon import Agent, EventSink, NodeEvents, NoEvents, Parts, Service
from agent.errors import FatalError
from agent.featuregates import node_info
from agent.metaproxier import frontend_guard, only, tc6_facts
from agent.metrics import Metrics
from agent.model import IPFamily, ProxyState, build_state
from agent.proxier import Proxier
from agent.sources.base import Source
from agent.sources.file import LOAD_ERRORS, load_file

if TYPE_CHECKING:
    from agent.iptables import IptablesProxier
    from agent.iptables.nfacct import Counters
    from agent.iptables.runner import IptablesRunner
    from agent.keptrecords import KeptRecords

log = logging.getLogger("agent")


def make_proxier(config: Config, metrics: Metrics | None = None, *, ipv6: bool) -> Proxier:
    """The IPv4 proxier of the mode. `ipv6`: whether an IPv6 proxier runs beside it (`serves_ipv6`):
    in eBPF mode the tc programs' IPv6 path is built only then (Config.tc_ipv6 AND it)."""
    if config.mode is Mode.IPTABLES:
        from agent.iptables import IptablesProxier

        return IptablesProxier(config, metrics=metrics)
    from agent.ebpf import EbpfProxier
    from agent.lock import LOCK_DIR

    # the planner left for the next start beside the lock files (tmpfs, root's, the chart's hostPath);
    # the IPv6 half's own address read: the load keeps the SNAT grant an earlier run left pinned
    # only while its address is still the node's
    node6 = (lambda: node_context(config, IPFamily.IPv6)) if ipv6 else None
    return EbpfProxier(
        config,
        ipv6=ipv6,
        snapshot_dir=LOCK_DIR,
        node6_reader=node6,
        masquerade6_reader=(lambda: masquerade6_kept_out(config)) if ipv6 else None,
    )


def masquerade6_kept_out(config: Config) -> bool:
    """Whether the IPv6 nat rules in place are eBPF mode's beside the tc IPv6 path (their
    MASQUERADE keeps TCP and UDP out of --bpf-snat-ports): read once at the load, which keeps an
    earlier run's IPv6 SNAT grant only then."""
    from agent.iptables.masquerade_shape import masquerade_kept_out
    from agent.iptables.runner import SubprocessRunner

    runner = SubprocessRunner(config, family=6)
    return masquerade_kept_out(
        runner.save("nat"), config.snat_ports, elsewhere=lambda: ipv6_masquerade_elsewhere(config, runner)
    )


def ipv6_masquerade_elsewhere(config: Config, runner: IptablesRunner) -> bool:
    """Whether IPv6 rules besides `runner`'s backend may masquerade: kube-proxy's `ip6 kube-proxy`
    nftables table, or a KUBE-POSTROUTING in the other iptables backend's nat table (kube-proxy's or
    an earlier agent's there; the legacy one read only when /proc/net/ip6_tables_names lists it).
    A check that cannot run counts as yes: it only costs the restart the pinned IPv6 SNAT grant,
    until the first restore grants it again."""
    from agent.iptables.canonical import parse
    from agent.iptables.chains import KUBE_POSTROUTING
    from agent.iptables.runner import SubprocessRunner

    listed = runner.command(["nft", "list", "tables"])
    if listed.returncode == 0 and "table ip6 kube-proxy" in listed.stdout:
        return True
    if listed.returncode not in (0, 127):  # 127: no nft binary, so no nftables kube-proxy either
        return True
    other = "legacy" if runner.backend == "nft" else "nft"
    if shutil.which(f"ip6tables-{other}-save") is None:
        return False
    if other == "legacy":
        # `ip6tables-legacy-save -t nat` makes the kernel create the legacy nat table where there was
        # none, whose nf_nat hooks would then track every IPv6 packet of the node for good.
        names = runner.command(["cat", "/proc/net/ip6_tables_names"])
        if names.returncode == 127:
            # no `cat` to run (runner.command's 127, whose message also says "No such file"): unknown
            return True
        if names.returncode != 0:
            # no file: ip6_tables is not loaded, so there is no legacy table at all
            return "No such file" not in names.stderr
        if "nat" not in names.stdout.split():
            return False
    try:
        saved = SubprocessRunner(dataclasses.replace(config, iptables_backend=other), family=6).save("nat")
    except Exception:
        return True
    return KUBE_POSTROUTING in parse(saved).table("nat")


def ipv6_unsupported(config: Config, missing: Callable[[Config], str] | None = None) -> str:
    """Why this node cannot have the IPv6 proxier the flags ask for, "" when it can or when they
    ask for none. `missing`: the host check (agent.iptables.runner.ipv6_missing)."""
    if not config.ipv6_configured:
        return ""
    if missing is not None:
        return missing(config)
    from agent.iptables.runner import ipv6_missing

    return ipv6_missing(config)


def serves_ipv6(config: Config, missing: Callable[[Config], str] | None = None) -> bool:
    """Whether an IPv6 proxier runs: the flags describe IPv6 and the node can do it."""
    return config.ipv6_configured and not ipv6_unsupported(config, missing)


def single_stack_warning(config: Config, missing: str) -> str:
    """The one line that says the node runs single-stack though the flags describe IPv6, as
    upstream's "No iptables support for family" (kube-proxy then runs one proxier)."""
    ipv4 = "the eBPF data path" if config.mode is Mode.EBPF else "iptables rules"
    return (
        f"no iptables support for family IPv6: {missing}. Running single-stack: IPv6 Services are "
        f"not programmed on this node (IPv4 ones are, by {ipv4}) and /healthz and /livez follow "
        "IPv4 only. IPv6 is asked for by --node-ip, --cluster-cidr or --service-cluster-ip-range: "
        "enable IPv6 in the kernel, install ip6tables (the iptables package) and IPv6 NAT (the "
        "ip6table_nat module for the legacy backend, nf_nat for nft), or leave IPv6 out of them"
    )


def make_proxier6(config: Config, proxier: Proxier, metrics: Metrics | None = None) -> Proxier | None:
    """The IPv6 proxier beside `proxier` (kube-proxy's metaproxier): ip6tables in both modes, when
    the flags describe IPv6 for the node; None otherwise (agent/metaproxier.py). In eBPF mode
    ip6tables serves IPv6 packets, and with socket-level load balancing the eBPF data path's IPv6
    maps are written too: the socket programs translate IPv6 Services where the sockets are, and
    the tc programs' IPv6 path the flows it can, in either host routing (`EbpfAndIp6tables`,
    `Config.tc_ipv6`)."""
    if not config.ipv6_configured:
        return None
    from agent.iptables import IptablesProxier
    from agent.iptables.runner import SubprocessRunner

    if config.mode is Mode.IPTABLES:
        assert isinstance(proxier, IptablesProxier)
        follow = proxier.runner
        # ip6tables with the IPv4 rules' backend; the IPv4 proxier alone takes over from eBPF mode
        # and kube-proxy's nftables tables (both families at once), the eBPF data path once both
        # families' rules are in place.
        return IptablesProxier(
            config,
            family=IPFamily.IPv6,
            runner=SubprocessRunner(config, family=6, follow=lambda: follow.backend),
            take_over=proxier.hand_back_after(IPFamily.IPv6),
            metrics=metrics,
        )
    if not config.socket_lb:
        return ip6tables_beside_ebpf(config, SubprocessRunner(config, family=6), metrics)
    from agent.ebpf import EbpfProxier
    from agent.metaproxier import EbpfAndIp6tables

    assert isinstance(proxier, EbpfProxier)
    ip6tables = ip6tables_beside_ebpf(
        config, SubprocessRunner(config, family=6), metrics, snat6_held=proxier.snat6_held
    )
    return EbpfAndIp6tables(proxier.ipv6(), ip6tables, config, nat_live=lambda: nat6_live(config))


def nat6_live(config: Config) -> bool:
    """Whether the node's IPv6 nf_conntrack holds a translated flow (EbpfAndIp6tables `nat_live`)."""
    import socket

    from agent.takeover.nfct import translated_any

    return translated_any(config.netns, socket.AF_INET6)


def ip6tables_beside_ebpf(
    config: Config,
    runner: IptablesRunner,
    metrics: Metrics | None = None,
    counters: Counters | None = None,
    snat6_held: Callable[[], tuple[int, int] | None] | None = None,
) -> IptablesProxier:
    """eBPF mode's IPv6 proxier: kube-proxy's ip6tables layout on `runner`. No IPv4 rules to follow,
    so the backend is --iptables-backend or the one the node already uses (kubelet's hint chains).
    Once its rules serve it removes kube-proxy's `ip6 kube-proxy` nftables table (the eBPF start
    leaves it for this moment, agent/takeover/into_ebpf.py; a failure is a warning, retried at
    each sync until the table is gone), and nothing else: never the eBPF data
    path, which serves IPv4 beside it (iptables mode's proxier hands that back)."""
    from agent.iptables import IptablesProxier
    from agent.iptables.kube_proxy_cleanup import NftTakeover

    return IptablesProxier(
        config,
        family=IPFamily.IPv6,
        runner=runner,
        take_over=NftTakeover(runner, families=("ip6",)),
        metrics=metrics,
        counters=counters,
        snat6_held=snat6_held,
    )


def render_dry_run(config: Config, state: ProxyState, node: NodeContext) -> str:
    if config.mode is Mode.IPTABLES:
        from agent.iptables import render_dry_run as render_iptables

        return render_iptables(state, node, config)
    from agent.ebpf import render_dry_run as render_ebpf

    return render_ebpf(state, node, config)


def static_node(config: Config, family: IPFamily = IPFamily.IPv4) -> NodeContext:
    """The node as the flags describe it (--node-ip of `family`), without looking at the kernel."""
    ips = config.node_ips_of(family)
    return NodeContext(node_ips=ips, primary_ip=ips[0] if ips else "")


def node_context(config: Config, family: IPFamily = IPFamily.IPv4) -> NodeContext:
    """The node's addresses of `family`: --node-ip, else what the external devices hold; and what
    the node listens on at its other addresses (NodeLocal DNSCache, IPv4)."""
    from agent.node import discover_node, local_listeners

    node = static_node(config, family) if config.node_ips_of(family) else discover_node(config, family)
    if family is IPFamily.IPv6:
        return node
    listeners = local_listeners(config.netns, node.node_ips)
    return dataclasses.replace(node, local_listeners=listeners) if listeners else node


def dry_run(config: Config) -> int:
    if not config.services_file:
        print("agent: --dry-run needs --services-file (it prints what a file would program)", file=sys.stderr)
        return 2
    try:
        snap = load_file(config.services_file)
    except LOAD_ERRORS as exc:
        print(f"agent: cannot read --services-file {config.services_file}: {exc}", file=sys.stderr)
        return 1
    node = static_node(config)
    result = build_state(snap.services, snap.endpoint_slices, node_info(config), frontend_guard(config, node))
    for problem in result.problems:
        log.error("%s %s", "refusing part of" if problem.refusal else "skipping", problem)
    sys.stdout.write(render_dry_run(config, result.state, node))
    if config.ipv6_configured:
        # The IPv6 proxier's input follows (ip6tables in both modes), after a comment line
        # (ip6tables-restore skips it).
        node6 = static_node(config, IPFamily.IPv6)
        result6 = build_state(
            snap.services,
            snap.endpoint_slices,
            node_info(config),
            frontend_guard(config, node6),
            family=IPFamily.IPv6,
        )
        reported = set(result.problems)
        for problem in result6.problems:
            if problem not in reported:
                log.error("%s %s", "refusing part of" if problem.refusal else "skipping", problem)
        if config.mode is Mode.EBPF and config.socket_lb:
            # What the socket programs translate IPv6 connections with (agent inspect maps6's lines).
            from agent.ebpf.family6 import render_plan6

            sys.stdout.write("# eBPF IPv6 maps (the socket programs)\n")
            sys.stdout.write(render_plan6(result6.state, node6, config))
        state6 = result6.state
        if config.tc_ipv6:
            from agent.model.tc6_leaves import ports_left

            # What ip6tables holds beside the tc IPv6 path once its source translation is granted
            facts = tc6_facts(config, state6, serves=True, granted=True)
            state6 = only(state6, ports_left(state6, node6.node_ips, facts))
            sys.stdout.write(
                "# ip6tables-restore input (IPv6): the service ports the tc IPv6 path leaves to it once "
                "granted (agent/model/tc6_leaves.py)\n"
            )
        else:
            sys.stdout.write("# ip6tables-restore input (IPv6)\n")
        from agent.iptables import render_dry_run as render_iptables

        sys.stdout.write(render_iptables(state6, node6, config))
    return 0


def cleanup(config: Config) -> int:
    """Both modes' cleanup: an operator switching modes wants no leftovers of either.

    Refused while an agent runs for the same node (namespace or pin path): it would remove what
    that agent serves with.
    """
    from agent.ebpf import EbpfProxier
    from agent.iptables import IptablesProxier
    from agent.lock import LOCK_DIR, acquire

    try:
        node_lock = acquire(config)
    except FatalError as exc:
        log.error("cleanup refused: %s", exc)
        return 1
    with node_lock:
        failed = False
        # ipv6: nothing is loaded; the cleanup removes every pin, the IPv6 maps included
        proxiers: list[Proxier] = [
            # its planner's file and the model's records (agent.keptrecords) removed too
            EbpfProxier(config, ipv6=False, snapshot_dir=LOCK_DIR),
            IptablesProxier(config),
        ]
        if any(shutil.which(f"ip6tables-{backend}") for backend in ("nft", "legacy")):
            proxiers.append(IptablesProxier(config, family=IPFamily.IPv6))  # upstream cleans both
        for proxier in proxiers:
            try:
                proxier.cleanup()
            except Exception as exc:
                failed = True
                log.error("cleanup of %s failed: %s", type(proxier).__name__, exc)
        return 1 if failed else 0


def cleanup_kube_proxy(config: Config) -> int:
    """What a previous kube-proxy left on this node (the Helm chart's init container)."""
    from agent.iptables import cleanup_kube_proxy as remove

    report = remove(config)
    for backend, done in report.iptables.items():
        if done.chains_deleted or done.jumps_deleted:
            log.info(
                "iptables-%s: removed kube-proxy's chains %s and %d jump(s)",
                backend,
                ",".join(done.chains_deleted) or "none",
                done.jumps_deleted,
            )
    for table in report.nft_tables:
        log.info("nftables: removed kube-proxy's table %s", table)
    if not report.removed_anything:
        log.info("no kube-proxy rules found on this node")
    for error in report.errors:
        log.error("cleaning up kube-proxy's rules: %s", error)
    return 1 if report.errors else 0


def preflight(config: Config, ipv6: bool | None = None) -> None:
    """What no retry fixes, checked before anything is created; raises FatalError. `ipv6`:
    whether an IPv6 proxier will run (`serves_ipv6`; None: ask it). A node that cannot do IPv6
    runs single-stack instead (`build_agent` says so): nothing to check for it here."""
    if config.mode is Mode.EBPF:
        from agent.ebpf import preflight as ebpf_preflight

        ebpf_preflight.require(config.pin_path)
        if serves_ipv6(config) if ipv6 is None else ipv6:
            from agent.iptables.runner import IPV6_IN_EBPF_MODE
            from agent.iptables.runner import preflight as iptables_preflight

            iptables_preflight(config, who=IPV6_IN_EBPF_MODE, binary="ip6tables")
    else:
        from agent.iptables.runner import preflight as iptables_preflight

        iptables_preflight(config)


class _Server:
    """A port the agent serves (healthz, metrics); `--bind-address-hard-fail` makes a bind
    failure fatal, otherwise the server retries on its own."""

    def __init__(self, what: str, server: Any, hard_fail: bool) -> None:
        self._what = what
        self._server = server
        self._hard_fail = hard_fail

    def start(self) -> None:
        try:
            self._server.start()
        except OSError as exc:
            if self._hard_fail:
                raise FatalError(
                    f"cannot bind the {self._what} address: {exc} (--bind-address-hard-fail)"
                ) from exc
            raise

    def stop(self) -> None:
        self._server.stop()


class EarlyProxier(Proxier, Protocol):
    """eBPF mode's proxier as start_loading hands it over: closing it waits for its load."""

    def close(self) -> None: ...


def start_loading(config: Config, *, ipv6: bool) -> EarlyProxier | None:
    """eBPF mode's proxier, its data path's load (the programs from the compile cache through the
    kernel's verifier, which runs with the GIL released) started now on a thread, so that it runs
    beside build_agent's imports, API client and node discovery instead of starting with the
    lists: at a cold start the first sync waits for the programs. None in iptables mode (its
    set-up is quick). The source was checked before (check_source). A failure here is reported
    by the Agent's own prepare(), which loads again (agent/daemon.py). `ipv6`: whether an IPv6
    proxier will run (`make_proxier`)."""
    if config.mode is not Mode.EBPF:
        return None
    proxier = cast(EarlyProxier, make_proxier(config, ipv6=ipv6))

    def prepare() -> None:
        try:
            proxier.prepare()
        except Exception as exc:  # FatalError too: the Agent's prepare() meets it again
            log.info("the early load of the data path failed (the agent loads it again): %s", exc)

    threading.Thread(target=prepare, name="prepare-proxier-early", daemon=True).start()
    return proxier


def build_agent(
    config: Config,
    configz: Callable[[], Mapping[str, Any]] | None = None,
    kubeconfig: Mapping[str, Any] | None = None,
    ipv6_check: Callable[[Config], str] | None = None,
    proxier: Proxier | None = None,
) -> Agent:
    """Every part of a running agent for `config`; raises FatalError (credentials, bad flags).
    `kubeconfig`: the `--kubeconfig` file as `run` loaded it (None: read it here). `ipv6_check`:
    what the node lacks for IPv6 (agent.iptables.runner.ipv6_missing): when it lacks something,
    no IPv6 proxier runs and one warning says so. `proxier`: the one `start_loading` made (None:
    made here)."""
    from agent.health import ProxyHealth, ServiceHealthServer, health_timeout_s, healthz_server
    from agent.metrics.server import metrics_server
    from agent.metrics.source import FileMetrics, SourceMetrics

    missing6 = ipv6_unsupported(config, ipv6_check)
    if missing6:
        log.warning("%s", single_stack_warning(config, missing6))
    serve6 = config.ipv6_configured and not missing6
    registry = CollectorRegistry()
    nfacct = None
    # iptables mode's metric families: in eBPF mode too when its ip6tables proxier serves IPv6.
    iptables = config.mode is Mode.IPTABLES or serve6
    if iptables:
        from agent.iptables import read_nfacct_counters

        def nfacct() -> Mapping[str, int]:
            return read_nfacct_counters(config.netns)

    metrics = Metrics(registry, config.mode, nfacct=nfacct, iptables=iptables)
    metrics.serve_families(*((str(IPFamily.IPv4), str(IPFamily.IPv6)) if serve6 else (str(IPFamily.IPv4),)))
    if config.mode is Mode.EBPF:
        from agent.metrics.bpf import BpfMapsCollector, pinned_opener

        registry.register(BpfMapsCollector(pinned_opener(config.pin_path)))

    services: list[Service] = []
    records: KeptRecords | None = None
    if config.services_file:
        from agent.sources.file import FileSource

        source: Source = FileSource(config.services_file, metrics=FileMetrics(registry))
        events: EventSink = NoEvents()
    else:
        from agent.kube.client import api_client, describe
        from agent.kube.events import EventRecorder
        from agent.kube.source import ApiSource

        api = api_client(config, kubeconfig=kubeconfig)
        log.info("API server %s", describe(api))
        source_metrics = SourceMetrics(registry)
        records = _kept_records(config)
        source = ApiSource(config, api, metrics=source_metrics, kept=records)
        recorder = EventRecorder(api, config.hostname, metrics=source_metrics)
        services.append(recorder)
        events = recorder

    node = node_context(config)
    log.info(
        "starting: mode=%s node=%s node IPs=%s netns=%s source=%s",
        config.mode.value,
        config.hostname,
        ",".join(node.node_ips) or "none",
        config.netns or "(own)",
        f"file {config.services_file}" if config.services_file else "API server",
    )
    health = ProxyHealth(health_timeout_s(config.sync_period_s))
    service_health = ServiceHealthServer.for_node(config, node, health)
    hard = config.bind_address_hard_fail
    if config.healthz_bind_address:
        services.append(_Server("healthz", healthz_server(config, health, metrics.count_health_probe), hard))
    if config.metrics_bind_address:
        services.append(_Server("metrics", metrics_server(config, registry, configz=configz), hard))
    services.append(service_health)

    if proxier is None:
        proxier = make_proxier(config, metrics, ipv6=serve6)
    if config.mode is Mode.EBPF and metrics.ipv6_snat_held_flows is not None:
        from agent.ebpf import EbpfProxier

        if isinstance(proxier, EbpfProxier):
            proxier.on_snat6_held = metrics.ipv6_snat_held_flows.set
            if metrics.ipv6_snat_granted is not None:
                proxier.on_snat6_granted = metrics.ipv6_snat_granted.set
            if metrics.xdp_load_failures is not None:
                proxier.on_xdp_load_failed = metrics.xdp_load_failures.inc
    proxier6 = make_proxier6(config, proxier, metrics) if serve6 else None
    service_health6 = None
    if proxier6 is not None:
        log.info("%s", ipv6_served_by(config))
        # As upstream's IPv6 proxier: its own healthCheckNodePort server, on IPv6 sockets, answering
        # with the IPv6 local endpoints; the proxy health is shared (both families must be healthy).
        node6 = node_context(config, IPFamily.IPv6)
        service_health6 = ServiceHealthServer.for_node(config, node6, health, IPFamily.IPv6)
        services.append(service_health6)
    close = getattr(proxier, "close", None)
    return Agent(
        config,
        Parts(
            source=source,
            proxier=proxier,
            node_context=lambda: node_context(config),
            node_events=_address_watcher(config),
            metrics=metrics,
            health=health,
            service_health=service_health,
            events=events,
            services=services,
            close=close,
            proxier6=proxier6,
            node_context6=lambda: node_context(config, IPFamily.IPv6),
            service_health6=service_health6,
            ipv6_unserved_said=bool(missing6),
            records=records,
        ),
    )


def _kept_records(config: Config) -> KeptRecords | None:
    """The model's records the last run left, in eBPF mode with the API source: asked by the
    source's first lists (agent.kube.reflector) and by the Agent, which keeps this run's at its stop."""
    if config.mode is not Mode.EBPF:
        return None
    # eBPF mode's lock on the pin path makes this agent the file's only reader and writer.
    from agent.keptrecords import KeptRecords, identity, records_path
    from agent.lock import LOCK_DIR

    return KeptRecords(records_path(LOCK_DIR, config.pin_path), identity(config))


def ipv6_served_by(config: Config) -> str:
    """The start-up line that says how this node serves IPv6 Services (an IPv6 proxier runs)."""
    if config.mode is Mode.EBPF:
        sockets = (
            "the socket programs translate the connections of the node's sockets (and its pods') to "
            "IPv6 Services, and "
            if config.socket_lb
            else ""
        )
        if config.tc_ipv6:
            tc = (
                "the eBPF tc programs translate the IPv6 TCP and UDP flows to Services that reach them "
                "(from pods and from outside, masqueraded from the node's IPv6 address where IPv4's "
                "would be), their fragments and the ICMPv6 errors about those flows, "
                + (
                    "through the node's stack (legacy host routing: ip6tables FORWARD and nf_conntrack "
                    "see client <-> backend), and "
                    if config.bpf_host_routing is HostRouting.LEGACY
                    else "and "
                )
            )
            rest = (
                "(mid-flow segments of flows ip6tables translated before, ICMPv6 but errors about "
                "translated flows)"
            )
        else:
            tc = ""
            rest = "(the eBPF tc programs' IPv6 path needs --bpf-socket-lb)"
        return (
            f"IPv6: {sockets}{tc}ip6tables rules (kube-proxy's iptables layout) serve every other IPv6 "
            f"packet {rest}; --iptables-* settings apply to the IPv6 rules"
        )
    return "IPv6: ip6tables rules for the node's IPv6 addresses beside the IPv4 ones (dual-stack)"


def _address_watcher(config: Config) -> NodeEvents | None:
    """Netlink events for the node's addresses, unless --node-ip fixes them (for every family in
    use: IPv6 too when an IPv6 proxier runs)."""
    ipv6 = config.ipv6_configured
    if config.node_ips_of(4) and (not ipv6 or config.node_ips_of(6)):
        return None
    from agent.nodewatch import AddressWatcher

    return AddressWatcher(config)


def check_source(
    config: Config, environ: Mapping[str, str] | None = None, service_account_dir: str | None = None
) -> None:
    """FatalError when the agent has nothing to follow: a services file that cannot be read, or no
    API server (no --kubeconfig, no --master, and not a pod, or a pod without its service account's
    token or CA: kube-proxy's client reads them before its platform set-up). No retry makes any of
    them right."""
    if config.services_file:
        from agent.sources.file import check_services_file

        check_services_file(config.services_file)
    elif not config.kubeconfig and not config.master:
        from agent.kube.client import SERVICE_ACCOUNT_DIR, in_cluster_configuration

        in_cluster_configuration(
            os.environ if environ is None else environ, service_account_dir or SERVICE_ACCOUNT_DIR
        )


def run(config: Config, configz: Callable[[], Mapping[str, Any]] | None = None) -> int:
    if config.dry_run:
        return dry_run(config)
    if config.cleanup:
        return cleanup(config)
    if config.cleanup_kube_proxy:
        return cleanup_kube_proxy(config)
    if config.init_only:
        from agent.nodeinit import init_node

        return init_node(config)

    # What the agent follows, before anything on the node is touched (kube-proxy builds its client
    # before its platform set-up): nothing to follow is fatal with no sysctl written, nothing pinned.
    try:
        check_source(config)
    except FatalError as exc:
        log.error("%s", exc)
        return 1
    # A bad --kubeconfig is a bad input file, as a bad --config: exit 2 before anything else.
    kubeconfig = None
    if config.kubeconfig and not config.services_file:
        from agent.kube.kubeconfig import KubeconfigError, load_kubeconfig

        try:
            kubeconfig = load_kubeconfig(config.kubeconfig)
        except KubeconfigError as exc:
            log.error("%s", exc)
            return 2

    from agent.featuregates import log_gates
    from agent.oom import apply_oom_score_adj

    apply_oom_score_adj(config.oom_score_adj)
    log_gates(config)

    set_thresholds()
    hold = StartHold()  # no automatic collection until the first full sync
    try:
        return _run_locked(config, configz, kubeconfig)
    finally:
        hold.release()


def _run_locked(
    config: Config, configz: Callable[[], Mapping[str, Any]] | None, kubeconfig: dict[str, Any] | None
) -> int:
    from agent.lock import acquire

    try:
        # Asked once (it probes ip6tables): the pre-flight, the early load (whether it builds the
        # tc IPv6 path) and build_agent (whether an IPv6 proxier runs) must agree.
        missing6 = ipv6_unsupported(config)
        preflight(config, ipv6=config.ipv6_configured and not missing6)
        node_lock = acquire(config)
    except FatalError as exc:
        log.error("%s", exc)
        return 1
    with node_lock:
        from agent.nodeinit import setup_conntrack

        setup_conntrack(config)  # kube-proxy's platformSetup, before the proxier reads the host
        proxier: EarlyProxier | None = None
        try:
            proxier = start_loading(config, ipv6=config.ipv6_configured and not missing6)
            agent = build_agent(
                config, configz, kubeconfig, ipv6_check=lambda config: missing6, proxier=proxier
            )
        except BaseException as exc:
            if proxier is not None:
                # Waits for the early load: nothing it does (pins, programs) outlives the node lock.
                proxier.close()
            if not isinstance(exc, FatalError):
                raise
            log.error("%s", exc)
            return 1
        return agent.run()
