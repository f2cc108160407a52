"""The Services the benchmark installs: the measured one plus filler, as Kubernetes API objects.

The measured Service `web-bench` (ClusterIP 10.96.0.10:80 -> nginx in the server pod) is named so that
it sorts after every filler Service (`svc-00001` ...): the agent orders service ports by name, so in
iptables mode its rule is the last one of KUBE-SERVICES and every new connection to it walks the
whole chain first (the worst case of the linear walk, kube-proxy's real cost at scale). Filler
Services have one TCP port and one or two endpoints on other nodes (addresses that carry no
traffic); their ClusterIPs are spread over 10.96.0.0/12 by an odd multiplier modulo 2^20 (a
bijection, so no two collide).

With `server_ip6` (a dual-stack lab) every Service is dual-stack (`RequireDualStack`, IPv4 then
IPv6): its IPv6 ClusterIP is its IPv4 one's offset in 10.96.0.0/12 placed in fd00:10:96::/108
(10.96.0.10 -> fd00:10:96::a), and an IPv6 EndpointSlice beside the IPv4 one holds as many
endpoints (fd00:10:244:<16+>::/64, the IPv6 pod CIDRs of the same absent nodes). Each family's
proxier then holds the state the IPv4 one holds in a single-stack run: as many Services, the
measured one sorted last. Dual-stack rather than IPv6-only Services beside the IPv4 ones: the
Service count means what it meant (each family's state is the IPv4-only run's), and it is the
shape of a dual-stack cluster, where Services that want IPv6 usually ask for both families.

The file is written as JSON, which is YAML: the agent's YAML reader parses it like any other
document, and the benchmark does not spend seconds in a YAML dumper.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

from agent.sources.file import content_version
from lab.objects import Ep, Port, endpoint_slice, service, with_endpoints

Obj = dict[str, Any]

MEASURED_NAME = "web-bench"
MEASURED_VIP = "10.96.0.10"
MEASURED_PORT = 80
MEASURED_VIP6 = "fd00:10:96::a"
_RANGE_BITS = 20  # 10.96.0.0/12
_SPREAD = 2654435761  # odd: i -> i * _SPREAD mod 2^20 is a permutation
_BASE = (10 << 24) | (96 << 16)
_BASE6 = int(ipaddress.IPv6Address("fd00:10:96::"))


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


def vip6(vip: str) -> str:
    """The IPv6 twin of a ClusterIP in 10.96.0.0/12: the same offset in fd00:10:96::/108."""
    offset = int(ipaddress.IPv4Address(vip)) - _BASE
    if not 0 <= offset < 1 << _RANGE_BITS:
        raise ValueError(f"{vip} is not in 10.96.0.0/12")
    return str(ipaddress.IPv6Address(_BASE6 + offset))


def _objects(name: str, vip: str, ports: list[Port], eps: list[Ep], eps6: list[Ep] | None) -> list[Obj]:
    """A Service with its IPv4 EndpointSlice; with `eps6`, dual-stack with an IPv6 slice too."""
    if eps6 is None:
        return with_endpoints(service(name, vip, ports), eps)
    svc = service(
        name,
        vip,
        ports,
        clusterIPs=[vip, vip6(vip)],
        ipFamilies=["IPv4", "IPv6"],
        ipFamilyPolicy="RequireDualStack",
    )
    slice6 = endpoint_slice(name, ports, eps6, suffix="v6")
    slice6["addressType"] = "IPv6"
    return [*with_endpoints(svc, eps), slice6]


def measured_objects(server_ip: str, server_port: int, node: str, server_ip6: str = "") -> list[Obj]:
    ports = [Port("http", MEASURED_PORT, server_port)]
    eps6 = [Ep(server_ip6, node)] if server_ip6 else None
    return _objects(MEASURED_NAME, MEASURED_VIP, ports, [Ep(server_ip, node)], eps6)


def filler_objects(count: int, dual_stack: bool = False) -> list[Obj]:
    """`count` Services with 1-2 endpoints each (alternating) on nodes that do not exist here
    (per family, with `dual_stack`)."""
    objs: list[Obj] = []
    ep = 0
    for i, vip in enumerate(filler_vips(count), start=1):
        eps: list[Ep] = []
        eps6: list[Ep] = []
        for _ in range(1 + i % 2):
            # 10.244.16.0/24 and up (fd00:10:244:16::/64 and up): pod CIDRs of nodes 16+, none of
            # them in the lab.
            eps.append(Ep(f"10.244.{16 + ep // 250}.{2 + ep % 250}", f"node{2 + ep % 8}"))
            eps6.append(Ep(f"fd00:10:244:{16 + ep // 250}::{2 + ep % 250:x}", f"node{2 + ep % 8}"))
            ep += 1
        objs += _objects(f"svc-{i:05d}", vip, [Port("http", 80, 8080)], eps, eps6 if dual_stack else None)
    return objs


@dataclass(frozen=True)
class ServicesFile:
    """The bytes to write and the version the agent will log for them."""

    data: bytes
    version: str
    services: int
    endpoints: int


def services_file(
    server_ip: str, server_port: int, node: str, total_services: int, server_ip6: str = ""
) -> ServicesFile:
    """The measured Service plus `total_services - 1` filler Services, as one `kind: List`; every
    one dual-stack with `server_ip6` (the measured Service's IPv6 endpoint)."""
    objs = [
        *measured_objects(server_ip, server_port, node, server_ip6),
        *filler_objects(total_services - 1, dual_stack=bool(server_ip6)),
    ]
    endpoints = sum(len(o["endpoints"]) for o in objs if o["kind"] == "EndpointSlice")
    data = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}, sort_keys=True).encode()
    return ServicesFile(data, content_version(data), total_services, endpoints)
