"""The healthz port (`--healthz-bind-address`, default 0.0.0.0:10256): /healthz and /livez.

kube-proxy serves them from their own listener, not the metrics one (cmd/kube-proxy/app/server.go,
serveHealthz); kubelet probes, load balancers and node-problem-detector call them. The socket is
created in `Config.netns`; a port that cannot be bound is retried every 5 s, or stops the agent
with `--bind-address-hard-fail`.
"""

from __future__ import annotations

from agent.config import Config
from agent.health.proxy import CodeCounter, ProxyHealth, ProxyHealthHandlers
from agent.httpserve import AddressServer


def healthz_server(config: Config, health: ProxyHealth, count: CodeCounter | None = None) -> AddressServer:
    """The /healthz + /livez server for `config`; `count` is told each answer (the
    kubeproxy_proxy_healthz_total / _livez_total counters: `Metrics.count_health_probe`)."""
    return AddressServer(
        "healthz",
        config.healthz_bind_address,
        ProxyHealthHandlers(health, count),
        netns=config.netns,
        hard_fail=config.bind_address_hard_fail,
    )
