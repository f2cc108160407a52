"""Kubernetes feature gates (`--feature-gates`, `featureGates`): which ones change this agent.

kube-proxy takes the cluster-wide gate set. The gates that change what a proxy does are honoured
where the agent has the behaviour; every other gate is accepted (a kube-proxy command line must
start the agent) and named once in the log at start, so an operator sees it has no effect here.

Honoured, with their v1.31+ defaults:

* `PreferSameTrafficDistribution` (default true from v1.34): same-node topology hints
  (`hints.forNodes`) narrow cluster traffic (pkg/proxy/topology.go `topologyModeFromHints`);
  false ignores node hints.
* `TopologyAwareHints` and `ServiceTrafficDistribution` (default true): zone hints
  (`hints.forZones`) are used while either is on, as v1.31's `canUseTopology`.
"""

from __future__ import annotations

import logging

from agent.config import Config
from agent.model.types import NodeInfo

log = logging.getLogger(__name__)

SAME_NODE = "PreferSameTrafficDistribution"
ZONE_HINTS = ("TopologyAwareHints", "ServiceTrafficDistribution")
HONOURED = {SAME_NODE: True, ZONE_HINTS[0]: True, ZONE_HINTS[1]: True}


def node_info(
    config: Config, labels: tuple[tuple[str, str], ...] = (), pod_cidrs: tuple[str, ...] = ()
) -> NodeInfo:
    """The node as the pure model sees it, with the topology gates applied."""
    return NodeInfo(
        config.hostname,
        labels,
        node_hints=config.gate(SAME_NODE, True),
        zone_hints=any(config.gate(g, True) for g in ZONE_HINTS),
        pod_cidrs=pod_cidrs,
    )


def log_gates(config: Config) -> list[str]:
    """One line per gate set that changes nothing here; returns the lines logged."""
    lines = [
        f"feature gate {name}={'true' if value else 'false'} does not change this agent; accepted and ignored"
        for name, value in config.feature_gates
        if name not in HONOURED
    ]
    for line in lines:
        log.info("%s", line)
    for name, value in config.feature_gates:
        if name in HONOURED:
            log.info("feature gate %s=%s applied", name, "true" if value else "false")
    return lines
