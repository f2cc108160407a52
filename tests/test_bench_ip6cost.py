"""bench/ip6cost.py measures the walk to the last KUBE-SERVICES rule: its measured Service must sort
last in both families, whatever the number of Services; it cleans up only what it made, and its
server does not outlive it (no kernel needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent.iptables.rules import RenderOptions, render
from agent.model.types import IPFamily
from bench import ip6cost
from bench.iptables_restore import service_name


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


@pytest.mark.parametrize("services", [1, 10, 101, 100_001])
def test_service_names_sort_as_their_indices_at_any_count(services: int) -> None:
    # The first, the last and the indices where a fixed width would have run out.
    indices = sorted({0, services - 1, *(i for i in (9, 99, 999, 9_999, 99_999, 100_000) if i < services)})
    names = [str(service_name(i, services, pad=True)) for i in indices]
    assert names == sorted(names)


def test_the_server_exits_when_the_run_that_started_it_is_gone() -> None:
    # Port 0: any free port of this namespace; stdin closed is what a killed run leaves it.
    server = subprocess.Popen([sys.executable, "-c", ip6cost.SERVER, "0"], stdin=subprocess.PIPE)
    assert server.stdin is not None
    server.stdin.close()
    try:
        assert server.wait(timeout=10) == 0
    finally:
        server.kill()
        server.wait()


def test_a_namespace_name_already_taken_is_not_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    def sh(*argv: str) -> None:
        if argv[:3] == ("ip", "netns", "add") and argv[3].endswith("-srv"):
            raise subprocess.CalledProcessError(1, argv)  # another run's

    monkeypatch.setattr(ip6cost, "sh", sh)
    created: list[str] = []
    with pytest.raises(subprocess.CalledProcessError):
        ip6cost.build("ekp000000-pod", "ekp000000-node-00000000", "ekp000000-srv", created)
    assert created == ["ekp000000-pod"]


def test_a_client_that_never_connected_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match=r"no connection to fd00::1:80 succeeded in 4.0 s \(7 failed\)"):
        ip6cost.parse_probe(json.dumps({"n": 0, "secs": 4.0, "ns": None, "errors": 7}), "fd00::1", 4.0)
