"""bench/ip6cost.py measures the walk to the last KUBE-SERVICES rule: its measured Service must sort
last in both families, whatever the number of Services (no kernel needed)."""

from __future__ import annotations

import pytest

from agent.iptables.rules import RenderOptions, render
from agent.model.types import IPFamily
from bench import ip6cost


@pytest.mark.parametrize("family", [IPFamily.IPv4, IPFamily.IPv6])
@pytest.mark.parametrize("services", [1, 50, 120])
def test_the_measured_cluster_ip_is_the_last_service_rule_of_kube_services(
    family: IPFamily, services: int
) -> None:
    options = RenderOptions.from_config(ip6cost.CONFIG, family=family)
    text = render(ip6cost.state(family, services), ip6cost.NODES[family], options).text
    walked = [r for r in text.splitlines() if r.startswith("-A KUBE-SERVICES ") and 'cluster IP"' in r]
    assert len(walked) == services
    assert f" -d {ip6cost.last_cluster_ip(family, services)} " in walked[-1]
