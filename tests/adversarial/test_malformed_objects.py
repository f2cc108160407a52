"""Malformed objects beside valid ones: the valid Services keep answering, later changes still apply.

The three cases found on main, each written into the services file of a real agent (both modes)
together with valid Services:

1. an IPv6 address in an IPv4 EndpointSlice (it broke every sync: the eBPF planner raised, the
   whole iptables-restore was refused), and a Service whose metadata is a string;
2. Service names the API server refuses: one carrying an iptables-restore line
   (`-I INPUT 1 -s 6.6.6.6/32 -j ACCEPT`), one with a space (it made every restore fail);
3. `ready: "false"` (a string), which counted as ready.

For each: the valid Services answer real traffic, the agent logs the bad object once (escaped, on
one line), netfilter in the node holds no trace of the injection (iptables-nft-save,
iptables-legacy-save, nft), and a later change of the file is applied (`Cluster.apply` waits for
the agent's `sync done: version=<hash>` of the new content).

One module-scoped single-node lab per mode (three pods: pod-1-1 is the client, pod-1-2 and pod-1-3
serve), so these tests do not depend on the traffic suite's session-scoped cluster.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab import Lab
from lab.harness import Cluster, ep
from lab.objects import Port, endpoint_slice, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

HTTP = Port("http", 80, 8080)
INJECTION = "x\n-I INPUT 1 -s 6.6.6.6/32 -j ACCEPT\n#"


@pytest.fixture(scope="module", params=["ebpf", "iptables"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=3) as lab:
        lab.start_podservers()
        c = Cluster(lab, request.param)
        c.start()
        try:
            yield c
        finally:
            failures = c.stop()
            leftover = [a.pin_path for a in c.agents if Path(a.pin_path).exists()]
        assert not failures, f"agent --cleanup failed: {failures}"
        assert not leftover, f"pins left after cleanup: {leftover}"


def answers(cluster: Cluster, vip: str, count: int = 20) -> set[str]:
    result = cluster.http("pod-1-1", f"http://{vip}/", count=count)
    assert result["errors"] == 0, result
    return set(result["bodies"])


def assert_no_injected_rule(cluster: Cluster) -> None:
    for node in cluster.lab.nodes:
        rules = cluster.ruleset(node)
        assert "6.6.6.6" not in rules, f"{node.name}: the injection reached netfilter:\n{rules}"


def agent_log(cluster: Cluster) -> str:
    (agent,) = cluster.agents
    return agent.log()


def good(name: str, vip: str, pod: str, cluster: Cluster) -> list[dict[str, Any]]:
    return with_endpoints(service(name, vip, [HTTP]), [ep(cluster, pod)])


def test_ipv6_address_in_an_ipv4_slice_and_a_string_for_metadata(cluster: Cluster) -> None:
    v6 = endpoint_slice("web", [HTTP], [ep(cluster, "pod-1-3")], suffix="v6")
    v6["endpoints"][0]["addresses"] = ["fd00::5"]
    no_meta = {**service("meta", "10.96.3.11", [HTTP]), "metadata": "meta"}
    bad = [v6, no_meta]

    cluster.apply([*good("web", "10.96.3.10", "pod-1-2", cluster), *bad])
    assert answers(cluster, "10.96.3.10") == {"pod-1-2"}
    log = agent_log(cluster)
    assert (
        'skipping EndpointSlice default/web-v6: endpoints[0].addresses[0]: "fd00::5" must be a valid IPv4'
        in log
    )
    assert "skipping Service default/?: metadata: must be a map" in log

    cluster.apply(
        [
            *good("web", "10.96.3.10", "pod-1-2", cluster),
            *good("later", "10.96.3.12", "pod-1-3", cluster),
            *bad,
        ]
    )
    assert answers(cluster, "10.96.3.12") == {"pod-1-3"}
    assert answers(cluster, "10.96.3.10") == {"pod-1-2"}


def test_service_names_the_api_server_refuses(cluster: Cluster) -> None:
    bad = [service(INJECTION, "10.96.4.11", [HTTP]), service("a b", "10.96.4.12", [HTTP])]

    cluster.apply([*good("web", "10.96.4.10", "pod-1-2", cluster), *bad])
    assert answers(cluster, "10.96.4.10") == {"pod-1-2"}
    assert_no_injected_rule(cluster)
    log = agent_log(cluster)
    assert (
        'skipping Service default/x\\n-I INPUT 1 -s 6.6.6.6/32 -j ACCEPT\\n#: metadata.name: "x\\n-I INPUT'
        in log
    )
    assert 'skipping Service default/a b: metadata.name: "a b" is not valid: must be a DNS-1035 label' in log
    assert not any(line.startswith("-I INPUT") for line in log.splitlines()), "a name forged a log line"

    cluster.apply([*good("web", "10.96.4.10", "pod-1-3", cluster), *bad])
    assert answers(cluster, "10.96.4.10") == {"pod-1-3"}
    assert_no_injected_rule(cluster)


def test_ready_as_a_string_is_a_malformed_slice_not_a_ready_endpoint(cluster: Cluster) -> None:
    svc = service("cond", "10.96.5.10", [HTTP])
    first = endpoint_slice("cond", [HTTP], [ep(cluster, "pod-1-2")], suffix="a")
    second = endpoint_slice("cond", [HTTP], [ep(cluster, "pod-1-3")], suffix="b")
    second["endpoints"][0]["conditions"]["ready"] = "false"

    cluster.apply([svc, first, second])
    assert answers(cluster, "10.96.5.10", count=30) == {"pod-1-2"}
    assert (
        "skipping EndpointSlice default/cond-b: endpoints[0].conditions.ready: must be true, false or absent"
        in (agent_log(cluster))
    )

    second["endpoints"][0]["conditions"]["ready"] = True
    cluster.apply([svc, first, second])
    assert answers(cluster, "10.96.5.10", count=30) == {"pod-1-2", "pod-1-3"}
