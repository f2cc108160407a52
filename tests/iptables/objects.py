"""Literal Kubernetes objects for the iptables tests, and the state they build on node1."""

from __future__ import annotations

from typing import Any

from agent.config import Config, Mode, NodeContext
from agent.model import NodeInfo, ProxyState, build_state

NODE = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")
CONFIG = Config(mode=Mode.IPTABLES, hostname="node1", cluster_cidr=("10.244.0.0/16",))


def service(
    name: str,
    ip: str,
    *ports: tuple[str, int, str],
    namespace: str = "ns",
    node_port: int = 0,
    **spec: Any,
) -> dict[str, Any]:
    """A Service; each port is (name, port, protocol), extra spec fields as keywords. With
    `node_port`, the ports get node ports node_port, node_port+1, ..."""
    port_list: list[dict[str, Any]] = [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports]
    if node_port:
        for i, port in enumerate(port_list):
            port["nodePort"] = node_port + i
    return {
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterIP": ip, "ports": port_list, **spec},
    }


def endpoints(
    name: str,
    ports: list[tuple[str, int, str]],
    *addresses: str | tuple[str, str] | tuple[str, str, dict[str, bool]],
    namespace: str = "ns",
) -> dict[str, Any]:
    """An EndpointSlice; each address is an IP, (IP, node) or (IP, node, conditions)."""
    eps = []
    for a in addresses:
        ip, node, cond = (a, "node2", {}) if isinstance(a, str) else (a[0], a[1], a[2] if len(a) > 2 else {})
        eps.append({"addresses": [ip], "nodeName": node, "conditions": {"ready": True, **cond}})
    return {
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-1",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
        "endpoints": eps,
    }


def state(*objects: dict[str, Any]) -> ProxyState:
    result = build_state(
        [o for o in objects if o["kind"] == "Service"],
        [o for o in objects if o["kind"] == "EndpointSlice"],
        NodeInfo("node1"),
    )
    assert not result.problems, result.problems
    return result.state
