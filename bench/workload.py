"""The Services the benchmark installs: the measured one plus filler, as Kubernetes API objects.

The measured Service `web-bench` (ClusterIP 10.96.0.10:80 -> nginx in the server pod) is named so that
it sorts after every filler Service (`svc-00001` ...): the agent orders service ports by name, so in
iptables mode its rule is the last one of KUBE-SERVICES and every new connection to it walks the
whole chain first (the worst case of the linear walk, kube-proxy's real cost at scale). Filler
Services have one TCP port and one or two endpoints on other nodes (addresses that carry no
traffic); their ClusterIPs are spread over 10.96.0.0/12 by an odd multiplier modulo 2^20 (a
bijection, so no two collide).

The file is written as JSON, which is YAML: the agent's YAML reader parses it like any other
document, and the benchmark does not spend seconds in a YAML dumper.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agent.sources.file import content_version
from lab.objects import Ep, Port, service, with_endpoints

Obj = dict[str, Any]

MEASURED_NAME = "web-bench"
MEASURED_VIP = "10.96.0.10"
MEASURED_PORT = 80
_RANGE_BITS = 20  # 10.96.0.0/12
_SPREAD = 2654435761  # odd: i -> i * _SPREAD mod 2^20 is a permutation
_BASE = (10 << 24) | (96 << 16)


def _addr(value: int) -> str:
    return ".".join(str((value >> shift) & 255) for shift in (24, 16, 8, 0))


def filler_vips(count: int) -> list[str]:
    """`count` distinct ClusterIPs spread over 10.96.0.0/12, never the measured one."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        i += 1
        if i >= 1 << _RANGE_BITS:
            raise ValueError(f"10.96.0.0/12 holds fewer than {count} addresses")
        vip = _addr(_BASE + (i * _SPREAD) % (1 << _RANGE_BITS))
        if vip != MEASURED_VIP:
            out.append(vip)
    return out


def measured_objects(server_ip: str, server_port: int, node: str) -> list[Obj]:
    svc = service(MEASURED_NAME, MEASURED_VIP, [Port("http", MEASURED_PORT, server_port)])
    return with_endpoints(svc, [Ep(server_ip, node)])


def filler_objects(count: int) -> list[Obj]:
    """`count` Services with 1-2 endpoints each (alternating) on nodes that do not exist here."""
    objs: list[Obj] = []
    ep = 0
    for i, vip in enumerate(filler_vips(count), start=1):
        svc = service(f"svc-{i:05d}", vip, [Port("http", 80, 8080)])
        eps = []
        for _ in range(1 + i % 2):
            # 10.244.16.0/24 and up: pod CIDRs of nodes 16+, none of them in the lab.
            eps.append(Ep(f"10.244.{16 + ep // 250}.{2 + ep % 250}", f"node{2 + ep % 8}"))
            ep += 1
        objs += with_endpoints(svc, eps)
    return objs


@dataclass(frozen=True)
class ServicesFile:
    """The bytes to write and the version the agent will log for them."""

    data: bytes
    version: str
    services: int
    endpoints: int


def services_file(server_ip: str, server_port: int, node: str, total_services: int) -> ServicesFile:
    """The measured Service plus `total_services - 1` filler Services, as one `kind: List`."""
    objs = [*measured_objects(server_ip, server_port, node), *filler_objects(total_services - 1)]
    endpoints = sum(len(o["endpoints"]) for o in objs if o["kind"] == "EndpointSlice")
    data = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}, sort_keys=True).encode()
    return ServicesFile(data, content_version(data), total_services, endpoints)
