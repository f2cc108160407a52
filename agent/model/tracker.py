"""The desired proxy state, kept up to date one object at a time (kube-proxy's change trackers).

`ProxyModel` is pure and single-threaded (the agent's sync thread owns it). Sources feed it object
by object (`set_service`, `set_slice`, `delete_service`, `delete_slice`, `set_node`); nothing is
computed until
`commit()`, which re-evaluates only the Services that were touched since the last commit (by their
own events, by an event of one of their EndpointSlices, or by a conflict they take part in) and
returns the service ports whose `ServicePort` or chosen endpoints really changed. As in kube-proxy,
a change that is undone before the commit (a Service edited and edited back) produces nothing, so
a burst of events costs one comparison per Service, and the cost of a commit grows with the change,
not with the cluster. A change of this node's zone label re-evaluates everything (`changed` None).

Cross-object rules live here, because no single object can decide them, and both modes consume
the result, so they cannot resolve them differently:

* **Conflicts.** Two service ports claiming the same frontend: one `IP:port/protocol` (cluster IP,
  external IP or load-balancer IP) or one `nodePort/protocol`. The API server refuses the second
  Service for cluster IPs and nodePorts; nothing refuses two Services with the same external IP.
  The claimant whose Service is oldest (creationTimestamp, then namespace/name, then port name)
  keeps the frontend; every other claimant port is left out whole, with a Problem naming the
  winner, until the winner goes away. Deterministic across restarts and modes.
* **Size.** A service port with more than `MAX_ENDPOINTS_PER_PORT` endpoints programs the first
  that many in kube-proxy's order (by `ip:port` string) and reports a Problem: the eBPF data path
  counts backend slots in 16 bits, and both modes must agree on which endpoints serve.
* **Bad updates lose nothing.** An object that stops being valid keeps its last valid version in
  force (with a Problem saying so) until it is fixed or deleted; an object never valid is absent.
* **Guarded frontends.** externalIPs, load-balancer IPs and node ports that this node's
  `FrontendGuard` refuses (agent/model/guard.py: its own addresses, the pod and Service CIDRs,
  outside `--external-ip-cidrs` or `--node-port-range`) are taken out of the Service's ports before
  anything else looks at them, conflicts included; the rest of the Service is programmed, and a
  Problem with a `refusal` says what was refused. A new guard (the node's addresses changed)
  re-checks every Service.

Problems are kept per object (and per conflict), so `commit()` can report only what appeared or
went away, and `problems()` lists what is wrong now.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agent.model.guard import REFUSED_EXTERNAL_IP, REFUSED_NODE_PORT, FrontendGuard, refuse_ports
from agent.model.parse import (
    ParsedSlice,
    ParseError,
    object_key,
    parse_endpoint_slice,
    parse_service_families,
)
from agent.model.problem import Problem, printable
from agent.model.topology import categorize_endpoints
from agent.model.types import (
    Endpoint,
    IPFamily,
    NodeInfo,
    ProxyState,
    ServiceEndpoints,
    ServicePort,
    ServicePortName,
)
from agent.model.wire import TRIGGER_TIME_ANNOTATION
from agent.sources.base import JSON_MAP_TYPES

# The eBPF frontend counts its backend slots in 16 bits; both modes program at most this many.
MAX_ENDPOINTS_PER_PORT = 65535
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

# A frontend a service port claims: ("ip", address, port, protocol) or ("nodePort", port, protocol).
Claim = tuple[str, ...]
# Older Services win conflicts: (creationTimestamp, namespace, name, port name, protocol).
Seniority = tuple[str, str, str, str, str]
ProblemKey = tuple[str, ...]  # ("Service", key) / ("EndpointSlice", key) / ("Conflict", key, port...)


@dataclass(frozen=True)
class _Service:
    ports: tuple[ServicePort, ...]  # as programmed: what the guard refused taken out
    created: str  # creationTimestamp as the API wrote it ("" when absent)
    parsed: tuple[ServicePort, ...] = ()  # as the object says, for a later guard
    namespace: str = ""
    name: str = ""


@dataclass(frozen=True)
class Commit:
    """What one `ProxyModel.commit()` changed.

    `health_check_ports` and `local_endpoints` cover the Services evaluated in this commit (all of
    them on a full commit), for the healthCheckNodePort servers: 0 closes a port.
    """

    changed: frozenset[ServicePortName] | None  # None: every service port (first commit, zone)
    problems_added: tuple[Problem, ...] = ()
    problems_cleared: tuple[Problem, ...] = ()
    # Epoch seconds from `last-change-trigger-time` of the EndpointSlices whose changes reached the
    # state in this commit (kube-proxy's network programming latency starts there).
    trigger_times: tuple[float, ...] = ()
    services_changed: int = 0  # Services (namespace/name) whose ports or endpoints changed
    health_check_ports: Mapping[str, int] = field(default_factory=dict)  # touched: ns/name -> port or 0
    local_endpoints: Mapping[str, int] = field(default_factory=dict)  # touched: ns/name -> ready local


def _seniority(created: str, sp: ServicePort) -> Seniority:
    return (created, sp.name.namespace, sp.name.name, sp.name.port, str(sp.protocol))


def claims_of(sp: ServicePort) -> tuple[Claim, ...]:
    """The frontends a service port needs to itself (node addresses are not known here), sorted:
    a tuple, kept per port, is a quarter of a frozenset's size (216 bytes)."""
    proto = str(sp.protocol)
    out: set[Claim] = {("ip", sp.cluster_ip, str(sp.port), proto)}
    out.update(("ip", ip, str(sp.port), proto) for ip in (*sp.external_ips, *sp.load_balancer_ips))
    if sp.node_port:
        out.add(("nodePort", str(sp.node_port), proto))
    return tuple(sorted(out))


def describe_claim(claim: Claim) -> str:
    if claim[0] == "nodePort":
        return f"nodePort {claim[1]}/{claim[2]}"
    return f"{claim[1]}:{claim[2]}/{claim[3]}"


def _trigger_time(obj: object) -> float | None:
    meta = obj.get("metadata") if isinstance(obj, JSON_MAP_TYPES) else None
    annotations = meta.get("annotations") if isinstance(meta, JSON_MAP_TYPES) else None
    text = annotations.get(TRIGGER_TIME_ANNOTATION) if isinstance(annotations, JSON_MAP_TYPES) else None
    if not isinstance(text, str):
        return None
    # Only a text of a timestamp's length is cached, so the cache holds at most 1024 short
    # strings; a longer one (no RFC3339 time is that long) is parsed each time.
    return _epoch(text) if len(text) <= _TIME_TEXT_MAX else _parse_epoch(text)


# RFC3339Nano with a zone offset ("2026-11-28T06:52:24.123456789+05:30") is 35 characters.
_TIME_TEXT_MAX = 40


def _parse_epoch(text: str) -> float | None:
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return when.timestamp()


# Cached per distinct text: it pays where a list's slices share trigger times (a bulk change, or
# a controller writing whole seconds, as the bench's objects do); upstream's EndpointSlice
# controller writes RFC3339Nano, so on a real cluster most texts differ and this mostly misses.
_epoch = functools.lru_cache(maxsize=1024)(_parse_epoch)


@dataclass(frozen=True)
class ServiceRecord:
    """What the model needs of one Service object, read from it once (`read_service`)."""

    namespace: str
    name: str
    created: str  # creationTimestamp as the API wrote it ("" when absent)
    ports: tuple[ServicePort, ...] = ()  # its IPv4 ports (`ports_of` for either family)
    error: str | None = None  # why the API server would refuse it (ParseError)
    ipv6_ports: tuple[ServicePort, ...] = ()

    def ports_of(self, family: IPFamily) -> tuple[ServicePort, ...]:
        return self.ipv6_ports if family is IPFamily.IPv6 else self.ports


@dataclass(frozen=True)
class SliceRecord:
    """What the model needs of one EndpointSlice object, read from it once (`read_slice`)."""

    namespace: str
    name: str
    parsed: ParsedSlice | None = None  # None: not ours (FQDN, headless), or refused
    error: str | None = None
    trigger_time: float | None = None  # epoch seconds of last-change-trigger-time


def read_service(obj: object) -> ServiceRecord:
    """A Service object reduced to what the model keeps; pure, so the thread that decoded it can
    call it and drop the object at once (a list of 10,000 is never held whole as dicts)."""
    ns, name, created = _meta_names(obj)
    try:
        families = parse_service_families(obj)
        return ServiceRecord(
            ns,
            name,
            created,
            tuple(families.get(IPFamily.IPv4, ())),
            ipv6_ports=tuple(families.get(IPFamily.IPv6, ())),
        )
    except ParseError as exc:
        return ServiceRecord(ns, name, created, error=str(exc))


def read_slice(obj: object, node_name: str) -> SliceRecord:
    """An EndpointSlice object reduced to what the model keeps (`read_service`'s twin); `node_name`:
    this node (see parse_endpoint_slice)."""
    ns, name, _ = _meta_names(obj)
    try:
        parsed = parse_endpoint_slice(obj, node_name, family=None)
    except ParseError as exc:
        return SliceRecord(ns, name, error=str(exc))
    return SliceRecord(ns, name, parsed, trigger_time=_trigger_time(obj) if parsed is not None else None)


def _meta_names(obj: object) -> tuple[str, str, str]:
    """(namespace, name, creationTimestamp) of any object, tolerant of every malformation."""
    namespace, name = object_key(obj)
    meta = obj.get("metadata") if isinstance(obj, JSON_MAP_TYPES) else None
    created = meta.get("creationTimestamp") if isinstance(meta, JSON_MAP_TYPES) else None
    return namespace, name, created if isinstance(created, str) else ""


class ProxyModel:
    """Services, EndpointSlices and this node in; ProxyState and per-commit changes out.

    One model per address family (kube-proxy's metaproxier runs a proxier per family): every
    Service is fed to each, and each keeps its own family's ports (`ServiceRecord.ports_of`);
    EndpointSlices of the other family's addressType are ignored as if they did not exist.
    """

    def __init__(
        self, node: NodeInfo, guard: FrontendGuard | None = None, family: IPFamily = IPFamily.IPv4
    ) -> None:
        self.family = family
        self._node = node
        self._guard = guard if guard is not None else FrontendGuard()
        self._services: dict[str, _Service] = {}  # "ns/name" -> last valid version
        self._slices: dict[str, ParsedSlice] = {}  # "ns/name" of the slice -> last valid version
        self._slice_owner: dict[str, str] = {}  # slice key -> owning Service key
        # Service key -> its slice keys; a tuple (nearly always of one) where a set took 200 bytes
        # more, 2 MiB at 10,000 Services (so for `_claimed`)
        self._owned: dict[str, tuple[str, ...]] = {}
        self._touched: set[str] = set()  # Service keys to re-evaluate at the next commit
        self._triggers: dict[str, float] = {}  # Service key -> earliest pending trigger time
        self._full = True
        # Problems by (kind, key) for objects, (kind, key, port) for conflicts and sizes; the value
        # each changed key had at the last commit, so a commit reports only real changes.
        self._problems: dict[ProblemKey, Problem] = {}
        self._port_problems: dict[str, set[ProblemKey]] = {}  # Service key -> its port problem keys
        self._problems_then: dict[ProblemKey, Problem | None] = {}
        # Conflicts: the claimants of every claimed frontend, each port's claims, each Service's ports.
        self._claimants: dict[Claim, dict[ServicePortName, Seniority]] = {}
        self._claims: dict[ServicePortName, tuple[tuple[Claim, ...], Seniority]] = {}
        self._claimed: dict[str, tuple[ServicePortName, ...]] = {}
        self._ports_of: dict[str, tuple[ServicePortName, ...]] = {}  # Service key -> ports in state
        # The state's mappings: written here only (consumers get them read-only, see ProxyState).
        self._sp: dict[ServicePortName, ServicePort] = {}
        self._eps: dict[ServicePortName, ServiceEndpoints] = {}
        self._raw: dict[ServicePortName, tuple[Endpoint, ...]] = {}
        self.state = ProxyState(
            node=node, services=self._sp, endpoints=self._eps, raw_endpoints=self._raw, family=family
        )
        # Object events since the last commit, for kube-proxy's pending-change metrics.
        self.pending_service_changes = 0
        self.pending_endpoint_changes = 0

    # ------------------------------------------------------------------ input

    @property
    def node(self) -> NodeInfo:
        return self._node

    def set_node(self, node: NodeInfo) -> None:
        """This node's name, labels and pod CIDRs; a change of name, zone or pod CIDRs (the
        NodeCIDR detector) re-evaluates every service port."""
        if node == self._node:
            return
        if (
            node.zone != self._node.zone
            or node.name != self._node.name
            or node.pod_cidrs != self._node.pod_cidrs
        ):
            self._full = True
        self._node = node
        self.state = ProxyState(
            node=node, services=self._sp, endpoints=self._eps, raw_endpoints=self._raw, family=self.family
        )

    @property
    def guard(self) -> FrontendGuard:
        return self._guard

    @property
    def full_pending(self) -> bool:
        """The next commit re-evaluates every Service (first commit, zone or guard change)."""
        return self._full

    def set_guard(self, guard: FrontendGuard) -> None:
        """New rules for external frontends (the node's addresses changed): every Service is
        checked again against them at the next commit."""
        if guard == self._guard:
            return
        self._guard = guard
        self._full = True
        for key, svc in self._services.items():
            self._services[key] = self._guarded(key, svc.namespace, svc.name, svc.parsed, svc.created)

    def set_service(self, key: str, obj: object) -> None:
        """A Service was added or changed: any JSON value (the parser decides what it is), or what
        `read_service` made of it already (on the thread that received it)."""
        rec = obj if isinstance(obj, ServiceRecord) else read_service(obj)
        self.pending_service_changes += 1
        pkey = ("Service", key)
        if (
            rec.error is None
            and not rec.ports_of(self.family)
            and key not in self._services
            and pkey not in self._problems
        ):
            return  # nothing of this family, now or before (the other family's model has it)
        self._touched.add(key)
        if rec.error is not None:
            kept = "; its last valid version stays in force" if key in self._services else ""
            self._set_problem(pkey, Problem("Service", rec.namespace, rec.name, f"{rec.error}{kept}"))
            return
        self._set_problem(pkey, None)
        ports = rec.ports_of(self.family)
        self._services[key] = self._guarded(key, rec.namespace, rec.name, ports, rec.created)

    def delete_service(self, key: str) -> None:
        self.pending_service_changes += 1
        self._touched.add(key)
        self._services.pop(key, None)
        self._set_problem(("Service", key), None)
        for refusal in (REFUSED_EXTERNAL_IP, REFUSED_NODE_PORT):
            self._set_problem(("Refused", key, refusal), None)

    def _guarded(
        self, key: str, ns: str, name: str, parsed: tuple[ServicePort, ...], created: str
    ) -> _Service:
        """The Service as this node programs it; its refusals become (or stop being) Problems."""
        ports, refused = refuse_ports(parsed, self._guard)
        for refusal, text in (
            (REFUSED_EXTERNAL_IP, refused.external_ips),
            (REFUSED_NODE_PORT, refused.node_ports),
        ):
            problem = Problem("Service", ns, name, text, refusal) if text else None
            self._set_problem(("Refused", key, refusal), problem)
        return _Service(ports, created, parsed, ns, name)

    def set_slice(self, key: str, obj: object) -> None:
        """An EndpointSlice was added or changed: any JSON value (the parser decides), or what
        `read_slice` made of it already."""
        rec = obj if isinstance(obj, SliceRecord) else read_slice(obj, self._node.name)
        self.pending_endpoint_changes += 1
        pkey = ("EndpointSlice", key)
        ours = rec.parsed is not None and rec.parsed.family is self.family
        if rec.error is None and not ours and key not in self._slices and pkey not in self._problems:
            return  # not ours, now or before: as if it did not exist
        if rec.error is not None:
            kept = "; its last valid version stays in force" if key in self._slices else ""
            self._set_problem(pkey, Problem("EndpointSlice", rec.namespace, rec.name, f"{rec.error}{kept}"))
            return
        self._set_problem(pkey, None)
        self._drop_slice(key)
        parsed = rec.parsed
        if parsed is None or parsed.family is not self.family:
            return  # not ours (FQDN, headless, the other family's): as if it did not exist
        owner = f"{parsed.namespace}/{parsed.service}"
        self._slices[key] = parsed
        self._slice_owner[key] = owner
        self._owned[owner] = (*self._owned.get(owner, ()), key)  # _drop_slice took out any old one
        self._touched.add(owner)
        when = rec.trigger_time
        if when is not None:
            self._triggers[owner] = min(when, self._triggers.get(owner, when))

    def delete_slice(self, key: str) -> None:
        self.pending_endpoint_changes += 1
        self._set_problem(("EndpointSlice", key), None)
        self._drop_slice(key)

    def _drop_slice(self, key: str) -> None:
        owner = self._slice_owner.pop(key, None)
        if self._slices.pop(key, None) is None or owner is None:
            return
        self._touched.add(owner)
        keys = tuple(k for k in self._owned[owner] if k != key)
        if keys:
            self._owned[owner] = keys
        else:
            del self._owned[owner]

    # ------------------------------------------------------------------ output

    def problems(self) -> list[Problem]:
        """Every problem that holds now, sorted."""
        return sorted(self._problems.values(), key=str)

    def commit(self) -> Commit:
        """Re-evaluate what was touched; the changed service ports and problems since last time."""
        full = self._full
        self._full = False
        touched = set(self._services) | set(self._ports_of) if full else self._touched
        self._touched = set()
        self.pending_service_changes = self.pending_endpoint_changes = 0

        # 1. Register the claims of the touched Services. Services sharing a claim whose holders
        #    changed are evaluated too: a loser may now win, a winner may now lose.
        evaluate = set(touched)
        for key in touched:
            evaluate |= self._reclaim(key)

        # 2. Evaluate every Service concerned: conflicts, endpoints, size, the state's entries.
        changed: set[ServicePortName] = set()
        services_changed = 0
        hc_ports: dict[str, int] = {}
        local_ready: dict[str, int] = {}
        triggers: list[float] = []
        for key in sorted(evaluate):
            spns = self._evaluate(key)
            if spns:
                changed |= spns
                services_changed += 1
                when = self._triggers.get(key)
                if when is not None:
                    triggers.append(when)
            hc_ports[key], local_ready[key] = self._health_of(key)
        for key in touched:
            self._triggers.pop(key, None)

        added: list[Problem] = []
        cleared: list[Problem] = []
        for pkey, then in self._problems_then.items():
            now = self._problems.get(pkey)
            if now == then:
                continue
            if then is not None:
                cleared.append(then)
            if now is not None:
                added.append(now)
        self._problems_then = {}
        return Commit(
            changed=None if full else frozenset(changed),
            problems_added=tuple(sorted(added, key=str)),
            problems_cleared=tuple(sorted(cleared, key=str)),
            trigger_times=tuple(triggers),
            services_changed=services_changed,
            health_check_ports=hc_ports,
            local_endpoints=local_ready,
        )

    # ------------------------------------------------------------------ internals

    def _set_problem(self, pkey: ProblemKey, problem: Problem | None) -> None:
        if problem is None and pkey not in self._problems:
            return  # none before, none now: nothing for the commit to report (most calls)
        if pkey not in self._problems_then:
            self._problems_then[pkey] = self._problems.get(pkey)
        if problem is None:
            self._problems.pop(pkey, None)
        else:
            self._problems[pkey] = problem

    def _reclaim(self, key: str) -> set[str]:
        """Bring the claims of Service `key` up to date; the other Services this may affect."""
        svc = self._services.get(key)
        wanted = {sp.name: sp for sp in svc.ports} if svc is not None else {}
        affected: set[str] = set()
        for spn in list(self._claimed.get(key, ())):
            sp = wanted.get(spn)
            if (
                sp is not None
                and svc is not None
                and self._claims[spn] == (claims_of(sp), _seniority(svc.created, sp))
            ):
                continue
            self._unclaim(spn, affected)
        for spn, sp in wanted.items():
            if spn in self._claims or svc is None:
                continue
            claims, rank = claims_of(sp), _seniority(svc.created, sp)
            self._claims[spn] = (claims, rank)
            self._claimed[key] = (*self._claimed.get(key, ()), spn)  # not claimed: in no tuple
            for claim in claims:
                holders = self._claimants.setdefault(claim, {})
                affected.update(other.service for other in holders)
                holders[spn] = rank
        affected.discard(key)
        return affected

    def _unclaim(self, spn: ServicePortName, affected: set[str]) -> None:
        claims, _ = self._claims.pop(spn)
        for claim in claims:
            holders = self._claimants[claim]
            del holders[spn]
            affected.update(other.service for other in holders)
            if not holders:
                del self._claimants[claim]
        ports = tuple(p for p in self._claimed[spn.service] if p != spn)
        if ports:
            self._claimed[spn.service] = ports
        else:
            del self._claimed[spn.service]

    def _loses_to(self, spn: ServicePortName) -> tuple[Claim, ServicePortName] | None:
        """The first claim `spn` loses and who wins it; None when it holds all its claims."""
        claims, _ = self._claims[spn]
        for claim in sorted(claims):
            holders = self._claimants[claim]
            if len(holders) == 1:
                continue
            winner = min(holders, key=holders.__getitem__)
            if winner != spn:
                return claim, winner
        return None

    def _set_port_problem(self, key: str, pkey: ProblemKey, problem: Problem) -> None:
        self._set_problem(pkey, problem)
        self._port_problems.setdefault(key, set()).add(pkey)

    def _evaluate(self, key: str) -> set[ServicePortName]:
        """Bring the state of Service `key` up to date; the service ports that changed."""
        svc = self._services.get(key)
        wanted = {sp.name: sp for sp in svc.ports} if svc is not None else {}
        old_problems = self._port_problems.pop(key, set())
        active: dict[ServicePortName, ServicePort] = {}
        for spn, sp in wanted.items():
            lost = self._loses_to(spn)
            if lost is None:
                active[spn] = sp
                continue
            claim, winner = lost
            pkey: ProblemKey = ("Conflict", key, str(spn), str(spn.protocol))
            self._set_port_problem(
                key,
                pkey,
                Problem(
                    "Service",
                    spn.namespace,
                    spn.name,
                    f"port {printable(spn.port or '(unnamed)')}/{spn.protocol}: {describe_claim(claim)} "
                    f"is already used by the older Service {winner.service}; this port is not "
                    "programmed until that one changes or goes away",
                ),
            )
        raw = self._endpoints_of(key, active)
        for pkey in old_problems - self._port_problems.get(key, set()):
            self._set_problem(pkey, None)

        services, endpoints, raw_endpoints = self._sp, self._eps, self._raw
        changed: set[ServicePortName] = set()
        for spn in self._ports_of.get(key, ()):
            if spn not in active:
                del services[spn], endpoints[spn], raw_endpoints[spn]
                changed.add(spn)
        for spn, sp in active.items():
            eps = raw.get(spn, ())
            chosen = categorize_endpoints(eps, sp, self._node)
            if services.get(spn) != sp or endpoints.get(spn) != chosen:
                changed.add(spn)
                services[spn] = sp
                endpoints[spn] = chosen
            # else the records already there stay: consumers see the same objects (cheap to compare)
            raw_endpoints[spn] = eps
        if active:
            self._ports_of[key] = tuple(sorted(active))
        else:
            self._ports_of.pop(key, None)
        return changed

    def _endpoints_of(
        self, key: str, ports: Mapping[ServicePortName, ServicePort]
    ) -> dict[ServicePortName, tuple[Endpoint, ...]]:
        if not ports:
            return {}
        merged = merge_slices((self._slices[k] for k in self._owned.get(key, ())), self._node.name)
        out: dict[ServicePortName, tuple[Endpoint, ...]] = {}
        for spn in ports:
            eps = merged.get(spn, ())
            if len(eps) > MAX_ENDPOINTS_PER_PORT:
                self._set_port_problem(
                    key,
                    ("Size", key, str(spn), str(spn.protocol)),
                    Problem(
                        "Service",
                        spn.namespace,
                        spn.name,
                        f"port {printable(spn.port or '(unnamed)')}/{spn.protocol} has {len(eps)} "
                        f"endpoints; only the first {MAX_ENDPOINTS_PER_PORT} (by address) are programmed",
                    ),
                )
                eps = eps[:MAX_ENDPOINTS_PER_PORT]
            out[spn] = eps
        return out

    def _health_of(self, key: str) -> tuple[int, int]:
        """(healthCheckNodePort, ready local endpoint IPs) of a Service, counted as kube-proxy's
        `LocalReadyEndpoints`: distinct IPs over all its ports, ready ones only (a node whose
        only local endpoints are terminating fails the health check)."""
        hc_port = 0
        ready_local: set[str] = set()
        for spn in self._ports_of.get(key, ()):
            hc_port = hc_port or self.state.services[spn].health_check_node_port
            ready_local.update(e.ip for e in self.state.raw_endpoints[spn] if e.is_local and e.ready)
        return hc_port, len(ready_local)


def merge_slices(
    slices: Iterable[ParsedSlice], node_name: str
) -> dict[ServicePortName, tuple[Endpoint, ...]]:
    """Endpoints per service port across all slices, deduplicated and sorted as kube-proxy does.

    Duplicates (the same ip:port in two slices, as during a slice hand-over) collapse to one,
    preferring the copy that says it is on this node. Between copies not on this node kube-proxy
    keeps whichever its walk of a Go map meets first, at random on each sync; we keep the one in
    the slice first by name, so the same slices always give the same programs. The copy kept is
    whole, not the best fields of each: a not-ready or terminating copy in an earlier-named slice
    beats a ready copy in a later-named one, as kube-proxy may on any sync.

    A port whose slices hold no endpoint maps to () where kube-proxy leaves it out; the one caller,
    `ProxyModel._endpoints_of`, reads `.get(spn, ())`: the same either way.
    """
    ordered = list(slices)
    if len(ordered) > 1:  # nearly every Service has one slice: nothing to order
        ordered.sort(key=_slice_order)
    by_port: dict[ServicePortName, dict[str, Endpoint]] = {}
    for sl in ordered:
        v6 = sl.family is IPFamily.IPv6
        for port in sl.ports:
            spn = ServicePortName(sl.namespace, sl.service, port.name, port.protocol)
            seen = by_port.get(spn)
            if seen is None:
                seen = by_port[spn] = {}
            number = port.port
            suffix = f":{number}"
            for ep in sl.endpoints:
                local = ep.node_name == node_name if node_name else False
                key = f"[{ep.ip}]{suffix}" if v6 else ep.ip + suffix
                if local or key not in seen:
                    # the parser's record itself when it says the same (one copy of each endpoint)
                    same = ep.port == number and ep.is_local == local
                    seen[key] = ep if same else ep._replace(port=number, is_local=local)
    # Keys are unique, so sorting the items compares keys alone.
    return {spn: tuple([ep for _, ep in sorted(seen.items())]) for spn, seen in by_port.items()}


def _slice_order(sl: ParsedSlice) -> tuple[str, str, str]:
    return (sl.namespace, sl.service, sl.name)
