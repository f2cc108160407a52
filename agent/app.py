"""Wiring: source -> desired state -> the chosen backend, on a bounded-frequency runner.

The only module that knows every layer. It owns the process lifecycle: start the source, run
syncs until SIGTERM/SIGINT, and stop without removing anything (programs, maps and rules keep
serving traffic while the agent is down; `--cleanup` is the explicit way to remove them).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from agent import metrics
from agent.config import Config, Mode, NodeContext
from agent.errors import FatalError
from agent.model import NodeInfo, ProxyState, build_state
from agent.model.problem import Problem
from agent.proxier import Proxier
from agent.sources.base import Event, EventType, Kind, ObjectEvent, Synced
from agent.sources.file import LOAD_ERRORS, FileSource, Snapshot, load_file

log = logging.getLogger("agent")


def make_proxier(config: Config) -> Proxier:
    if config.mode is Mode.IPTABLES:
        from agent.iptables import IptablesProxier

        return IptablesProxier(config)
    from agent.ebpf import EbpfProxier

    return EbpfProxier(config)


def render_dry_run(config: Config, state: ProxyState, node: NodeContext) -> str:
    if config.mode is Mode.IPTABLES:
        from agent.iptables import render_dry_run as render_iptables

        return render_iptables(state, node, config)
    from agent.ebpf import render_dry_run as render_ebpf

    return render_ebpf(state, node, config)


def static_node(config: Config) -> NodeContext:
    """The node as the flags describe it (--node-ip), without looking at the kernel."""
    return NodeContext(node_ips=config.node_ips, primary_ip=config.node_ips[0] if config.node_ips else "")


def node_context(config: Config) -> NodeContext:
    """The node's addresses: --node-ip, else what the external devices hold."""
    if config.node_ips:
        return static_node(config)
    from agent.node import discover_node

    return discover_node(config)


class ProblemReporter:
    """Logs and counts each malformed object once per distinct problem, not once per sync."""

    def __init__(self) -> None:
        self._seen: set[Problem] = set()

    def report(self, problems: tuple[Problem, ...]) -> None:
        current = set(problems)
        for p in sorted(current - self._seen, key=str):
            log.error("skipping %s (every other object is still programmed)", p)
            metrics.SKIPPED_OBJECTS.labels(kind=p.kind).inc()
        self._seen = current
        metrics.INVALID_OBJECTS.set(len(current))


class ObjectStore:
    """The objects a source delivered, by kind and key, and the first-sync gate.

    The sink of the source (it only stores, under a lock); `snapshot()` is None until every kind
    of the source was `Synced` once, so nothing is synced, and nothing already programmed is
    pruned, before the first complete read.
    """

    def __init__(self, kinds: frozenset[Kind]) -> None:
        self._lock = threading.Lock()
        self._kinds = kinds
        self._objects: dict[Kind, dict[str, Mapping[str, Any]]] = {k: {} for k in kinds}
        self._synced: set[Kind] = set()
        self._version = ""

    def apply(self, events: Sequence[Event]) -> None:
        with self._lock:
            for event in events:
                if isinstance(event, Synced):
                    self._synced.add(event.kind)
                    self._version = event.version
                elif isinstance(event, ObjectEvent) and event.kind in self._objects:
                    if event.type is EventType.DELETED:
                        self._objects[event.kind].pop(event.key, None)
                    else:
                        self._objects[event.kind][event.key] = event.obj

    def snapshot(self) -> Snapshot | None:
        with self._lock:
            if self._synced != set(self._kinds):
                return None
            return Snapshot(
                tuple(self._objects.get(Kind.SERVICE, {}).values()),
                tuple(self._objects.get(Kind.ENDPOINT_SLICE, {}).values()),
                complete=True,
                version=self._version,
            )


def build(config: Config, snap: Snapshot) -> tuple[ProxyState, tuple[Problem, ...]]:
    result = build_state(snap.services, snap.endpoint_slices, NodeInfo(config.hostname))
    return result.state, result.problems


def dry_run(config: Config) -> int:
    if not config.services_file:
        print("agent: --dry-run needs --services-file (API server dry runs come later)", file=sys.stderr)
        return 2
    try:
        snap = load_file(config.services_file)
    except LOAD_ERRORS as exc:
        print(f"agent: cannot read --services-file {config.services_file}: {exc}", file=sys.stderr)
        return 1
    state, problems = build(config, snap)
    ProblemReporter().report(problems)
    sys.stdout.write(render_dry_run(config, state, static_node(config)))
    return 0


def cleanup(config: Config) -> int:
    """Both modes' cleanup: an operator switching modes wants no leftovers of either.

    Refused while an agent runs for the same node (namespace or pin path): it would remove what
    that agent serves with.
    """
    from agent.ebpf import EbpfProxier
    from agent.iptables import IptablesProxier
    from agent.lock import acquire

    try:
        node_lock = acquire(config)
    except FatalError as exc:
        log.error("cleanup refused: %s", exc)
        return 1
    with node_lock:
        failed = False
        for proxier in (EbpfProxier(config), IptablesProxier(config)):
            try:
                proxier.cleanup()
            except Exception as exc:
                failed = True
                log.error("cleanup of %s failed: %s", type(proxier).__name__, exc)
        return 1 if failed else 0


def preflight(config: Config) -> None:
    """What no retry fixes, checked before anything is created; raises FatalError."""
    if config.mode is Mode.EBPF:
        from agent.ebpf import preflight as ebpf_preflight

        ebpf_preflight.require(config.pin_path)
    else:
        from agent.iptables.runner import preflight as iptables_preflight

        iptables_preflight(config)


def run(config: Config) -> int:
    if config.dry_run:
        return dry_run(config)
    if config.cleanup:
        return cleanup(config)
    if not config.services_file:
        log.error("no source of Services: pass --services-file FILE (API server watching comes later)")
        return 2

    from agent.lock import acquire

    try:
        preflight(config)
        node_lock = acquire(config)
    except FatalError as exc:
        log.error("%s", exc)
        return 1
    with node_lock:
        return serve(config)


def serve(config: Config) -> int:
    """Run syncs until a signal (0) or a FatalError (1); the node lock is held by the caller."""
    proxier = make_proxier(config)
    node = node_context(config)
    log.info(
        "starting: mode=%s node=%s node IPs=%s netns=%s",
        config.mode.value,
        config.hostname,
        ",".join(node.node_ips) or "none",
        config.netns or "(own)",
    )
    problems = ProblemReporter()
    source = FileSource(config.services_file)
    store = ObjectStore(source.kinds)
    stop = threading.Event()
    fatal: list[FatalError] = []

    def sync() -> None:
        start = time.monotonic()
        snap = store.snapshot()
        if snap is None:
            log.debug("no sync before the first complete read of the services file")
            return
        state, found = build(config, snap)
        problems.report(found)
        try:
            proxier.sync(state, node)
        except FatalError as exc:
            # No retry can fix it: stop the agent with the message (the runner would retry forever).
            fatal.append(exc)
            stop.set()
            return
        elapsed = time.monotonic() - start
        metrics.SYNC_SECONDS.observe(elapsed)
        endpoints = sum(len(e.all_reachable) for e in state.endpoints.values())
        log.info(
            "sync done: version=%s, %d service ports, %d endpoints, %.1f ms",
            snap.version,
            len(state.services),
            endpoints,
            elapsed * 1000,
        )

    from agent.runner import BoundedFrequencyRunner

    runner = BoundedFrequencyRunner(
        sync, min_interval=config.min_sync_period_s, max_interval=config.sync_period_s
    )

    def sink(events: Sequence[Event]) -> None:
        store.apply(events)
        runner.request()

    try:
        source.start(sink)
    except LOAD_ERRORS as exc:
        log.error("cannot read --services-file %s: %s", config.services_file, exc)
        return 1

    agent_pid = os.getpid()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if os.getpid() != agent_pid:
            # A forked helper (pyroute2's netns worker) inherits this handler: let it just exit.
            os._exit(0)
        log.info(
            "received %s: stopping (programs, maps and rules stay in place)", signal.Signals(signum).name
        )
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runner.start()
    stop.wait()
    runner.stop()
    source.stop()
    if fatal:
        log.error("stopping: %s", fatal[0])
        return 1
    return 0
