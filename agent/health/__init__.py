"""kube-proxy's health endpoints: the proxy's own /healthz and /livez, and healthCheckNodePorts.

As upstream's pkg/proxy/healthcheck, two parts:

* `proxy.py`: `ProxyHealth`, the state the sync loop feeds (`updated`, `queued_update`,
  `sync_node`), and the /healthz and /livez answers built from it;
* `services.py`: `ServiceHealthServer`, one listener per `externalTrafficPolicy: Local` load
  balancer's healthCheckNodePort, answering from the local endpoint counts;
* `server.py`: the healthz port itself.

Every answer is a pure function of the state (tested without sockets); `agent.httpserve` moves
the bytes.

Driven from one sync loop in kube-proxy's order (pkg/proxy/iptables/proxier.go):

    health = ProxyHealth(health_timeout_s(config.sync_period_s))
    healthz = healthz_server(config, health, metrics.count_health_probe)
    services = ServiceHealthServer.for_node(config, node, health)
    healthz.start(); services.start()
    health.updated("IPv4")                    # the loop starts (kube-proxy's SyncLoop does this)
    # a Service / EndpointSlice change queued:   health.queued_update(family)  (the families it touches)
    # a Node event for this node:                health.sync_node(obj)  (None once deleted)
    # a family's sync succeeded:                 health.updated(family)
    #     services.sync_services(ports)   # ns/name -> healthCheckNodePort (agent.model Commit)
    #     services.sync_endpoints(local)  # ns/name -> ready local endpoint IPs (Commit)

Dual-stack, as upstream's two proxiers: one ProxyHealth shared by both families (healthy only if
each is), and one ServiceHealthServer per family (`for_node(..., family)`), each fed from its own
family's commits and listening on its own family's sockets only (kubernetes#137370), so a
dual-stack Service's healthCheckNodePort answers IPv4 probes with the IPv4 local endpoints and
IPv6 probes with the IPv6 ones.

The per-Service inputs come from the model (`agent.model.tracker.Commit.health_check_ports` and
`.local_endpoints`), which keeps them up to date for the Services a commit touched, counting
local ready endpoints by IP over all ports as upstream's `LocalReadyEndpoints` does.
"""

from agent.health.proxy import (
    IPV4,
    TO_BE_DELETED_TAINT,
    HealthStatus,
    ProxyHealth,
    ProxyHealthHandlers,
    health_timeout_s,
    node_eligible,
)
from agent.health.server import healthz_server
from agent.health.services import (
    ServiceHealthServer,
    health_check_addresses,
    service_response,
)

__all__ = [
    "IPV4",
    "TO_BE_DELETED_TAINT",
    "HealthStatus",
    "ProxyHealth",
    "ProxyHealthHandlers",
    "ServiceHealthServer",
    "health_check_addresses",
    "health_timeout_s",
    "healthz_server",
    "node_eligible",
    "service_response",
]
