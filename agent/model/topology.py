"""Which endpoints serve cluster traffic and which serve local traffic, as kube-proxy decides.

A transcription of kube-proxy's `CategorizeEndpoints` (pkg/proxy/topology.go) into one pure
function; both backends call it, so a policy difference between modes cannot arise here.

- Cluster traffic goes to ready endpoints, narrowed by topology hints when every ready endpoint
  carries hints and one of them names this node (or its zone). When no endpoint is ready, the
  serving-and-terminating ones are used, and topology is ignored.
- Local traffic goes to this node's ready endpoints, else to its serving-and-terminating ones.
- `all_reachable` is the union the iptables mode writes KUBE-SEP chains for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent.model.types import Endpoint, NodeInfo, ServiceEndpoints, ServicePort

TOPOLOGY_NONE = ""
TOPOLOGY_NODE = "node"
TOPOLOGY_ZONE = "zone"


def topology_mode(endpoints: Sequence[Endpoint], node: NodeInfo) -> str:
    """Node hints win over zone hints; either applies only if every ready endpoint has them."""
    all_node_hints = all_zone_hints = True
    node_match = zone_match = False
    name, zone = node.name, node.zone
    for ep in endpoints:
        if not ep.ready:
            continue
        if not ep.node_hints and not ep.zone_hints:
            return TOPOLOGY_NONE  # the common case: no hints at all
        if not ep.node_hints:
            all_node_hints = False
        elif name in ep.node_hints:
            node_match = True
        if not ep.zone_hints:
            all_zone_hints = False
        elif zone in ep.zone_hints:
            zone_match = True
    if node.node_hints and all_node_hints and node_match:
        return TOPOLOGY_NODE
    if node.zone_hints and all_zone_hints and zone_match:
        return TOPOLOGY_ZONE
    return TOPOLOGY_NONE


def _available(endpoints: Sequence[Endpoint], mode: str, node: NodeInfo) -> tuple[Endpoint, ...]:
    """The ready endpoints the topology mode lets this node use."""
    if mode == TOPOLOGY_NODE:
        return tuple(ep for ep in endpoints if ep.ready and node.name in ep.node_hints)
    if mode == TOPOLOGY_ZONE:
        zone = node.zone
        return tuple(ep for ep in endpoints if ep.ready and zone in ep.zone_hints)
    ready = [ep for ep in endpoints if ep.ready]
    if len(ready) == len(endpoints) and isinstance(endpoints, tuple):
        return endpoints  # all of them (nearly always): the same tuple, not a copy
    return tuple(ready)


def _pick(endpoints: Sequence[Endpoint], keep: Callable[[Endpoint], bool]) -> tuple[Endpoint, ...]:
    return tuple(ep for ep in endpoints if keep(ep))


def categorize_endpoints(endpoints: Sequence[Endpoint], svc: ServicePort, node: NodeInfo) -> ServiceEndpoints:
    """kube-proxy's CategorizeEndpoints. `endpoints` must already carry `is_local`."""
    cluster: tuple[Endpoint, ...] = ()
    local: tuple[Endpoint, ...] = ()
    has_any = False
    use_topology = False

    if svc.uses_cluster_endpoints:
        mode = topology_mode(endpoints, node)
        use_topology = mode != TOPOLOGY_NONE
        cluster = _available(endpoints, mode, node)
        if not cluster:
            # No ready endpoint anywhere (topology never hides every ready one): fall back to
            # endpoints that are terminating but still serving, so connections drain gracefully.
            cluster = _pick(endpoints, lambda ep: ep.serving and ep.terminating)
        has_any = bool(cluster)

    if not svc.uses_local_endpoints:
        return ServiceEndpoints(cluster=cluster, all_reachable=cluster, has_any=has_any)

    local_ready = local_terminating = False
    for ep in endpoints:
        if ep.ready:
            has_any = True
            local_ready = local_ready or ep.is_local
        elif ep.serving and ep.terminating:
            has_any = True
            local_terminating = local_terminating or ep.is_local
    use_terminating = False
    if local_ready:
        local = _pick(endpoints, lambda ep: ep.is_local and ep.ready)
    elif local_terminating:
        use_terminating = True
        local = _pick(endpoints, lambda ep: ep.is_local and ep.serving and ep.terminating)

    if not svc.uses_cluster_endpoints:
        return ServiceEndpoints(local=local, all_reachable=local, has_any=has_any)
    if not use_topology and not use_terminating:
        # `cluster` holds every ready endpoint and `local` only ready ones: a superset already.
        return ServiceEndpoints(cluster=cluster, local=local, all_reachable=cluster, has_any=has_any)
    merged = {str(ep): ep for ep in (*cluster, *local)}
    union = tuple(sorted(merged.values(), key=lambda ep: ep.sort_key))
    return ServiceEndpoints(cluster=cluster, local=local, all_reachable=union, has_any=has_any)
