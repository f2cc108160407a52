"""Builders for the Kubernetes objects traffic tests feed the agents (plain dicts, API shape)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]
NS = "default"


@dataclass(frozen=True)
class Port:
    name: str
    port: int
    target: int
    protocol: str = "TCP"
    node_port: int = 0


@dataclass(frozen=True)
class Ep:
    """One endpoint address: `node` is the lab node name that runs it ("node1", ...)."""

    ip: str
    node: str
    ready: bool = True
    serving: bool | None = None
    terminating: bool = False


def service(
    name: str, cluster_ip: str, ports: Sequence[Port], *, type: str = "ClusterIP", **spec: Any
) -> Obj:
    svc_ports = []
    for p in ports:
        entry: dict[str, Any] = {
            "name": p.name,
            "port": p.port,
            "protocol": p.protocol,
            "targetPort": p.target,
        }
        if p.node_port:
            entry["nodePort"] = p.node_port
        svc_ports.append(entry)
    status = spec.pop("status", None)
    obj: Obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "type": type,
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ports": svc_ports,
            **spec,
        },
    }
    if status:
        obj["status"] = status
    return obj


def endpoint_slice(
    service_name: str, ports: Sequence[Port], endpoints: Iterable[Ep], suffix: str = "x"
) -> Obj:
    eps = []
    for e in endpoints:
        cond: dict[str, bool] = {"ready": e.ready, "terminating": e.terminating}
        if e.serving is not None:
            cond["serving"] = e.serving
        eps.append({"addresses": [e.ip], "conditions": cond, "nodeName": e.node})
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service_name}-{suffix}",
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": "IPv4",
        "ports": [{"name": p.name, "port": p.target, "protocol": p.protocol} for p in ports],
        "endpoints": eps,
    }


def with_endpoints(svc: Obj, endpoints: Iterable[Ep]) -> list[Obj]:
    """A Service and one EndpointSlice for it (ports taken from the service)."""
    ports = [
        Port(p["name"], p["port"], p["targetPort"], p["protocol"], p.get("nodePort", 0))
        for p in svc["spec"]["ports"]
    ]
    return [svc, endpoint_slice(svc["metadata"]["name"], ports, endpoints)]
