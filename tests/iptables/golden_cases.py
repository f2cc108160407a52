"""The golden cases: Kubernetes objects in `golden/<case>.yaml`, expected text in `golden/<case>.rules`.

Every case runs on node "node1" (192.168.0.11) with --cluster-cidr=10.244.0.0/16; a few cases add
flags (CASE_CONFIG) or node addresses (CASE_NODE). Cases named `ipv6-*` are the IPv6 proxier's
(ip6tables-restore input): node "node1" at fd00:192:168::11 with
--cluster-cidr=10.244.0.0/16,fd00:10:244::/56 (the IPv6 detector takes the IPv6 one). Shared by the
golden test and the kernel test that loads every golden file into a real iptables (ip6tables).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from agent.config import Config, Mode, NodeContext
from agent.model import IPFamily, NodeInfo, ProxyState, build_state

GOLDEN_DIR = Path(__file__).parent / "golden"
NODE_NAME = "node1"
NODE_IP = "192.168.0.11"
CLUSTER_CIDR = "10.244.0.0/16"

BASE_CONFIG = Config(mode=Mode.IPTABLES, hostname=NODE_NAME, cluster_cidr=(CLUSTER_CIDR,))
BASE_NODE = NodeContext(node_ips=(NODE_IP,), primary_ip=NODE_IP)
NODE_IP6 = "fd00:192:168::11"
IPV6_PREFIX = "ipv6-"
BASE_CONFIG6 = replace(BASE_CONFIG, cluster_cidr=(CLUSTER_CIDR, "fd00:10:244::/56"))
BASE_NODE6 = NodeContext(node_ips=(NODE_IP6,), primary_ip=NODE_IP6)

CASE_CONFIG: dict[str, dict[str, Any]] = {
    "nodeport-addresses": {"nodeport_addresses": ("192.168.0.0/24", "127.0.0.0/8")},
    "ipv6-nodeport-addresses": {"nodeport_addresses": ("192.168.0.0/24", "fd00:192:168::/64", "::1/128")},
    "masquerade-all": {"masquerade_all": True},
}
CASE_NODE: dict[str, NodeContext] = {
    # A second address outside --nodeport-addresses gets no NodePort jump.
    "nodeport-addresses": NodeContext(node_ips=(NODE_IP, "10.0.2.15"), primary_ip=NODE_IP),
    "ipv6-nodeport-addresses": NodeContext(node_ips=(NODE_IP6, "2001:db8:2::15"), primary_ip=NODE_IP6),
}


def case_names() -> list[str]:
    return sorted(p.stem for p in GOLDEN_DIR.glob("*.yaml"))


def load_objects(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Services and EndpointSlices from a multi-document YAML file (`kind: List` flattened)."""
    services: list[dict[str, Any]] = []
    slices: list[dict[str, Any]] = []
    with path.open() as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    items: list[dict[str, Any]] = []
    for doc in docs:
        items.extend(doc.get("items") or [] if doc.get("kind") == "List" else [doc])
    for obj in items:
        if obj.get("kind") == "Service":
            services.append(obj)
        elif obj.get("kind") == "EndpointSlice":
            slices.append(obj)
        else:
            raise ValueError(f"{path.name}: unexpected kind {obj.get('kind')!r}")
    return services, slices


def case_family(case: str) -> IPFamily:
    return IPFamily.IPv6 if case.startswith(IPV6_PREFIX) else IPFamily.IPv4


def case_inputs(case: str) -> tuple[ProxyState, NodeContext, Config]:
    services, slices = load_objects(GOLDEN_DIR / f"{case}.yaml")
    family = case_family(case)
    result = build_state(services, slices, NodeInfo(NODE_NAME), family=family)
    assert not result.problems, result.problems
    v6 = family is IPFamily.IPv6
    config = replace(BASE_CONFIG6 if v6 else BASE_CONFIG, **CASE_CONFIG.get(case, {}))
    return result.state, CASE_NODE.get(case, BASE_NODE6 if v6 else BASE_NODE), config
