"""What the benchmark calls for the iptables mode: `measure(n_services)`.

Builds a synthetic state (every tenth service a NodePort, `endpoints_per_service` remote
endpoints each), renders it, and, with `apply=True` (root needed), syncs it into a throwaway
network namespace `ekpt-bench-<random>`, with an xtables lock of its own, with the real runner:
a full sync, then a partial sync after one service's endpoint changed, then a full sync with
nothing changed (iptables-save read back and compared chain by chain, nothing restored). The
namespace is deleted afterwards. Returns plain numbers:

    services, endpoints, rules (filter + nat after the sync), restore_bytes, render_seconds,
    and with apply: backend, full_sync_seconds, full_restore_seconds, partial_sync_seconds,
    partial_restore_seconds, partial_services_written, verify_sync_seconds (the first full sync
    with nothing to do), verify_again_seconds (the next one, the steady state).
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import replace

from agent.config import Config, Mode, NodeContext
from agent.iptables.proxier import IptablesProxier
from agent.iptables.rules import RenderOptions, render
from agent.model.topology import categorize_endpoints
from agent.model.types import (
    Endpoint,
    IPFamily,
    NodeInfo,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
)
from lab.netns import scratch_netns

# family -> (the first ClusterIP - 1, the first endpoint - 1)
_BASES = {
    IPFamily.IPv4: (int(ipaddress.ip_address("10.96.0.0")), int(ipaddress.ip_address("10.244.0.0"))),
    IPFamily.IPv6: (int(ipaddress.ip_address("fd00:10:96::")), int(ipaddress.ip_address("fd00:10:245::"))),
}
NODE = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")
CONFIG = Config(mode=Mode.IPTABLES, hostname="node1", cluster_cidr=("10.244.0.0/16",))


def service_name(i: int, n_services: int, *, pad: bool = False) -> ServicePortName:
    """Service `i` of `n_services`; with `pad`, zero-padded to the count's width so that the
    names sort as the indices do (KUBE-SERVICES is written in name order: "svc9" follows "svc49")."""
    if not pad:
        return ServicePortName(f"ns{i // 100}", f"svc{i}", "http", Protocol.TCP)
    ns_width, svc_width = len(str(max(n_services - 1, 0) // 100)), len(str(max(n_services - 1, 0)))
    return ServicePortName(f"ns{i // 100:0{ns_width}d}", f"svc{i:0{svc_width}d}", "http", Protocol.TCP)


def synthetic_state(
    n_services: int,
    endpoints_per_service: int = 2,
    *,
    shift: int = 0,
    family: IPFamily = IPFamily.IPv4,
    last_endpoint: Endpoint | None = None,
    pad: bool = False,
    node_ports: bool = True,
) -> ProxyState:
    """`n_services` single-port TCP services; `shift` moves service 0's endpoints (a change).

    `last_endpoint` replaces the last service's endpoints (bench/ip6cost.py's server), `pad` see
    `service_name`, `node_ports` makes every tenth service a NodePort."""
    service_base, pod_base = _BASES[family]
    node = NodeInfo("node1")
    services: dict[ServicePortName, ServicePort] = {}
    chosen = {}
    raw = {}
    for i in range(n_services):
        spn = service_name(i, n_services, pad=pad)
        node_port = 30000 + i // 10 if node_ports and i % 10 == 0 and i // 10 < 2767 else 0
        sp = ServicePort(
            name=spn,
            cluster_ip=str(ipaddress.ip_address(service_base + i + 1)),
            port=80,
            protocol=Protocol.TCP,
            node_port=node_port,
        )
        first = pod_base + i * endpoints_per_service + 1 + (shift * 7919 if i == 0 else 0)
        eps = tuple(
            sorted(
                (
                    Endpoint(ip=str(ipaddress.ip_address(first + k)), port=8080, node_name="node2")
                    for k in range(endpoints_per_service)
                ),
                key=lambda e: e.sort_key,
            )
        )
        if last_endpoint is not None and i == n_services - 1:
            eps = (last_endpoint,)
        services[spn] = sp
        raw[spn] = eps
        chosen[spn] = categorize_endpoints(eps, sp, node)
    return ProxyState(node=node, services=services, endpoints=chosen, raw_endpoints=raw, family=family)


def measure(
    n_services: int, endpoints_per_service: int = 2, *, apply: bool = True, backend: str = "nft"
) -> dict[str, float | int | str]:
    st = synthetic_state(n_services, endpoints_per_service)
    start = time.perf_counter()
    rendered = render(st, NODE, RenderOptions.from_config(CONFIG))
    result: dict[str, float | int | str] = {
        "services": n_services,
        "endpoints": n_services * endpoints_per_service,
        "rules": rendered.rule_count,
        "restore_bytes": len(rendered.text),
        "render_seconds": time.perf_counter() - start,
    }
    if not apply:
        return result

    # A lock of its own: tens of thousands of rules hold it for seconds, which the host-wide
    # /run/xtables.lock would pass on to every other iptables-legacy user of the machine.
    with scratch_netns("ekpt-bench") as ns:
        proxier = IptablesProxier(replace(CONFIG, netns=ns, iptables_backend=backend))
        start = time.perf_counter()
        proxier.sync(st, NODE)
        full = proxier.last_sync
        result["full_sync_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        shifted = synthetic_state(n_services, endpoints_per_service, shift=1)
        changed = frozenset(k for k in shifted.services if shifted.endpoints[k] != st.endpoints.get(k))
        proxier.sync(shifted, NODE, changed)
        partial = proxier.last_sync
        result["partial_sync_seconds"] = time.perf_counter() - start
        assert full is not None and partial is not None and full.full and not partial.full
        start = time.perf_counter()
        verified = proxier.sync(shifted, NODE)  # a full sync with nothing to repair: read back, compare
        result["verify_sync_seconds"] = time.perf_counter() - start
        assert verified.full and verified.repaired == 0 and proxier.last_sync is not None
        assert not proxier.last_sync.restored
        # The first one canonicalised the kernel's spelling of every chain; later ones hit the cache.
        start = time.perf_counter()
        proxier.sync(shifted, NODE)
        result["verify_again_seconds"] = time.perf_counter() - start
        result["backend"] = backend
        result["rules"] = full.rules
        result["full_restore_seconds"] = full.restore_seconds
        result["partial_restore_seconds"] = partial.restore_seconds
        result["partial_services_written"] = partial.services_written
    return result


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 10000), indent=2))
