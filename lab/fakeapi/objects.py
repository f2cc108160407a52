"""Services, EndpointSlices and Nodes shaped as kube-apiserver returns them, for the fake cluster.

The fields are those a real 1.3x cluster serves for a ClusterIP Service and the slice the
EndpointSlice controller writes for it (labels, ownerReferences, the last-change-trigger-time
annotation, per-endpoint nodeName/zone/targetRef/conditions, a managedFields entry), so that the
decode measurement reads realistic bytes: about 0.8 KB per Service and 3.5 KB per slice of ten
endpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lab.fakeapi.store import now_rfc3339

Obj = dict[str, Any]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def _managed(manager: str, fields: Obj) -> list[Obj]:
    return [
        {
            "manager": manager,
            "operation": "Update",
            "apiVersion": "v1",
            "time": now_rfc3339(),
            "fieldsType": "FieldsV1",
            "fieldsV1": fields,
        }
    ]


def service(
    name: str,
    cluster_ip: str,
    namespace: str = "default",
    ports: Sequence[tuple[str, int, int]] = (("http", 80, 8080),),
    labels: dict[str, str] | None = None,
    **spec: Any,
) -> Obj:
    """A ClusterIP Service; `ports` are (name, port, targetPort); `spec` overrides fields."""
    body: Obj = {
        "kind": "Service",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app": name, **(labels or {})},
            "managedFields": _managed(
                "kubectl-client-side-apply",
                {
                    "f:metadata": {"f:labels": {".": {}, "f:app": {}}},
                    "f:spec": {"f:ports": {}, "f:selector": {}},
                },
            ),
        },
        "spec": {
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "internalTrafficPolicy": "Cluster",
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "ports": [{"name": n, "port": p, "protocol": "TCP", "targetPort": t} for n, p, t in ports],
            "selector": {"app": name},
            "sessionAffinity": "None",
            "type": "ClusterIP",
            **spec,
        },
        "status": {"loadBalancer": {}},
    }
    return body


def endpoint_slice(
    service_name: str,
    addresses: Sequence[str],
    namespace: str = "default",
    name: str | None = None,
    node: str = "node1",
    ports: Sequence[tuple[str, int]] = (("http", 8080),),
    labels: dict[str, str] | None = None,
    trigger_time: str | None = None,
) -> Obj:
    """The controller's slice for `service_name` with one ready endpoint per address;
    `trigger_time` is the last-change-trigger-time annotation (default: now, whole seconds)."""
    endpoints = [
        {
            "addresses": [ip],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "nodeName": node,
            "targetRef": {
                "kind": "Pod",
                "namespace": namespace,
                "name": f"{service_name}-{i:04d}-7d9f8c6b5-x2k4q",
                "uid": f"00000000-0000-4000-8000-{i:012d}",
            },
            "zone": "zone-a",
        }
        for i, ip in enumerate(addresses)
    ]
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name or f"{service_name}-abcde",
            "generateName": f"{service_name}-",
            "namespace": namespace,
            "labels": {
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                SERVICE_NAME_LABEL: service_name,
                **(labels or {}),
            },
            "annotations": {
                "endpoints.kubernetes.io/last-change-trigger-time": trigger_time or now_rfc3339()
            },
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": service_name,
                    "uid": "11111111-2222-4333-8444-555555555555",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "managedFields": _managed(
                "kube-controller-manager",
                {"f:addressType": {}, "f:endpoints": {}, "f:metadata": {"f:labels": {}}, "f:ports": {}},
            ),
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
    }


def node(
    name: str,
    address: str = "192.168.0.11",
    zone: str = "zone-a",
    pod_cidr: str = "10.244.1.0/24",
    **metadata: Any,
) -> Obj:
    """A Node as the kubelet registers it; `pod_cidr` is what the node IPAM controller assigned."""
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "topology.kubernetes.io/zone": zone,
            },
            **metadata,
        },
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": address},
                {"type": "Hostname", "address": name},
            ]
        },
    }


def scale_objects(services: int, endpoints_per_slice: int, varied: bool = False) -> list[Obj]:
    """`services` Services named svc-00000... each with one slice of `endpoints_per_slice` pods.

    By default every Service has the same one port and every slice the same port and a trigger
    time in whole seconds: the best case for parse.py's memos (one list of ports checked for all,
    a few trigger times). `varied` is their worst case, closer to a real cluster: each Service its
    own port number (so its own list), every 20th a NodePort (nodePort unique, as the API server
    allocates it), and each slice its own RFC3339Nano trigger time, as upstream's EndpointSlice
    controller writes it.
    """
    out: list[Obj] = []
    for i in range(services):
        name = f"svc-{i:05d}"
        namespace = f"ns-{i % 50:02d}"
        vip = f"10.{96 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}"
        ips = [
            f"10.{128 + (i >> 12)}.{(i >> 4) & 255}.{((i & 15) << 4) + j}" for j in range(endpoints_per_slice)
        ]
        if not varied:
            out.append(service(name, vip, namespace=namespace))
            out.append(endpoint_slice(name, ips, namespace=namespace, node=f"node{i % 100}"))
            continue
        number = 10_000 + i % 50_000
        svc = service(name, vip, namespace=namespace, ports=(("http", number, number),))
        if i % 20 == 0:
            svc["spec"].update(type="NodePort", externalTrafficPolicy="Cluster")
            svc["spec"]["ports"][0]["nodePort"] = 30_000 + (i // 20) % 2_768
        out.append(svc)
        stamp = f"2026-11-28T06:{i // 60_000 % 60:02d}:{i // 1_000 % 60:02d}.{(i * 7_919) % 10**9:09d}Z"
        out.append(
            endpoint_slice(
                name,
                ips,
                namespace=namespace,
                node=f"node{i % 100}",
                ports=(("http", number),),
                trigger_time=stamp,
            )
        )
    return out
