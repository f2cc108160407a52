"""The agent follows an API server: objects created, scaled and deleted there program the data path,
and watch faults (dropped streams, a 410 relist, a server restarted after being away) leave it
correct, with no failed connection for a service that did not change and nothing flushed while the
API is away. Also kube-proxy's health, healthCheckNodePort and metrics endpoints of a running agent,
and the Event a malformed object gets. Both modes, real traffic, the real kubernetes client.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import pytest

from lab.apicluster import ApiCluster
from lab.fakeapi.objects import node as node_object
from lab.harness import Loop, ep
from lab.objects import Port, endpoint_slice, service, with_endpoints

pytestmark = pytest.mark.kernel

HTTP = Port("http", 80, 8080)
N1, N2 = "192.168.0.11", "192.168.0.12"


def names(result: dict[str, Any]) -> set[str]:
    return set(result["bodies"])


def served(api: ApiCluster, target: str, url: str, count: int) -> set[str]:
    """Who answered `count` new connections, every one of which must have been answered."""
    result = api.http(target, url, count=count)
    assert result["errors"] == 0, (url, result)
    return names(result)


def test_a_service_created_on_the_api_server_serves_scales_and_goes_away(api: ApiCluster) -> None:
    """ "should serve a basic endpoint from pods", driven through the API: create, scale, delete."""
    svc = service("web", "10.96.2.1", [HTTP])
    api.apply(with_endpoints(svc, [ep(api, "pod-1-2")]))
    assert served(api, "pod-1-1", "http://10.96.2.1/", count=10) == {"pod-1-2"}

    api.apply([endpoint_slice("web", [HTTP], [ep(api, "pod-1-2"), ep(api, "pod-2-1"), ep(api, "pod-2-2")])])
    result = api.http("pod-1-1", "http://10.96.2.1/", count=60)
    assert result["errors"] == 0 and names(result) == {"pod-1-2", "pod-2-1", "pod-2-2"}

    api.apply([endpoint_slice("web", [HTTP], [ep(api, "pod-2-2")])])
    assert served(api, "pod-1-1", "http://10.96.2.1/", count=20) == {"pod-2-2"}

    api.delete([svc])
    gone = api.http("pod-1-1", "http://10.96.2.1/", count=1, timeout=1.0)
    assert gone["errors"] == 1 and not gone["bodies"], "a deleted Service is no longer served"


KINDS = ("Service", "EndpointSlice", "Node")


def test_watch_faults_never_disturb_a_service_that_does_not_change(api: ApiCluster) -> None:
    """A dropped watch, a 410 relist, and an API server restart with the server away until every
    agent, its watches broken, has also failed to connect again, for every kind it watches: the
    unchanged service keeps answering every request, the one that moved still answers from where
    it was (nothing is flushed while the API is away), and changes made in between are applied
    after each fault.

    The outage is counted in the agents' own attempts, not in seconds: what it must show is that a
    stream the API ends, and a failed attempt to open another, change nothing on the node. No
    event reaches an agent while it lasts, so the model it syncs from is the one it had (its
    periodic full sync of an unchanged model is tests/agent/test_daemon.py's). The test's length
    is the agents' backoff (client-go's, 0.8 s doubling per failure, reset only after 120 s without
    one): each fault costs one delay twice the last, so the restart and the outage are one fault
    (the server comes back with the same objects and resourceVersions after the failures)."""
    steady = service("steady", "10.96.2.2", [HTTP])
    moving = service("moving", "10.96.2.3", [HTTP])
    api.apply(
        [*with_endpoints(steady, [ep(api, "pod-1-3"), ep(api, "pod-2-3")]), *with_endpoints(moving, [])]
    )
    loop = Loop(api.lab, "pod-1-1", "http://10.96.2.2/", f"faults-{api.mode}")
    # "should work after restarting apiserver" dials from a host-network pod too
    node_loop = Loop(api.lab, "node1", "http://10.96.2.2/", f"faults-node-{api.mode}")
    try:
        backends = ["pod-1-2", "pod-2-1", "pod-2-2"]

        def moved(i: int) -> dict[str, Any]:
            return endpoint_slice("moving", [HTTP], [ep(api, backends[i])])

        def served_by(i: int) -> None:
            assert served(api, "pod-1-1", "http://10.96.2.3/", count=5) == {backends[i]}

        def move_to(i: int) -> None:
            api.apply([moved(i)])
            served_by(i)

        api.server.drop_streams()  # dropped watch: resumed from the last resourceVersion
        move_to(0)
        # Every watch broken (the agents reconnect after a backoff, 0.8 s or more), a change none
        # of them has seen, then its history gone: each resumed watch gets 410 and relists. (With
        # the streams open, a bookmark could carry a watch past the compaction: no 410.)
        api.server.drop_streams()
        wanted = api.apply_nowait([moved(1)])
        api.server.compact()
        api.wait_synced(wanted)
        served_by(1)
        # Restarted (same objects, same resourceVersions), and away meanwhile: nothing is flushed,
        # traffic keeps flowing.
        failed = {node: connect_errors(api, node) for node in NODES}
        api.server.stop()
        try:
            wait_for_retries(api, failed)
            served_by(1)
        finally:
            api.server.start()
        move_to(2)
    finally:
        result = loop.finish()
        node_result = node_loop.finish()
    assert result["errors"] == 0, result
    assert result["ok"] > 500, result
    assert names(result) == {"pod-1-3", "pod-2-3"}
    assert node_result["errors"] == 0 and node_result["ok"] > 500, node_result
    assert names(node_result) == {"pod-1-3", "pod-2-3"}
    for node in ("node1", "node2"):
        relists = scrape(api, node, "ekp_relists_total")
        assert any(labels.get("reason") == "gone" and v >= 1 for labels, v in relists), relists
        restarts = scrape(api, node, "ekp_watch_restarts_total")
        assert sum(v for _, v in restarts) >= 3 * 3, "every kind's watch was reopened after each fault"
    api.delete([steady, moving])  # the lab is shared (tests/traffic/conftest.py): leave it as found


NODES = ("node1", "node2")


def connect_errors(api: ApiCluster, node: str) -> dict[str, float]:
    """Failed connections to the API server a node's agent counted, by kind."""
    out = dict.fromkeys(KINDS, 0.0)
    for labels, value in scrape(api, node, "ekp_api_request_errors_total"):
        if labels.get("reason") == "connect" and labels.get("kind") in out:
            out[labels["kind"]] += value
    return out


def wait_for_retries(api: ApiCluster, before: dict[str, dict[str, float]]) -> None:
    """Until every agent failed to connect once more, for every kind, scraping the agents
    meanwhile (they serve metrics with the API away). The bound is the backoff's cap, 30 s,
    doubled by its jitter."""
    deadline = time.monotonic() + 2 * 30 + 10
    while True:
        now = {node: connect_errors(api, node) for node in NODES}
        waiting = [(node, kind) for node in NODES for kind in KINDS if now[node][kind] <= before[node][kind]]
        if not waiting:
            return
        assert time.monotonic() < deadline, f"no failed connect while the API server was away: {waiting}"
        time.sleep(0.2)


def scrape(api: ApiCluster, node: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one metric family from a node's agent (its metrics port on the node's loopback)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = api.lab.run(node, "curl", "-s", "--max-time", "3", "http://127.0.0.1:10249/metrics").stdout
    return [
        (dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def _curl(api: ApiCluster, target: str, url: str) -> tuple[int, dict[str, str], str]:
    """Status, headers (lower-case names) and body of one GET, from a lab namespace."""
    out = api.lab.run(target, "curl", "-s", "-i", "--max-time", "3", url, check=False).stdout
    head, _, body = out.replace("\r\n", "\n").partition("\n\n")
    lines = head.split("\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def test_health_endpoints_answer_as_kube_proxys(api: ApiCluster) -> None:
    """kube-proxy's /healthz and /livez on 10256 (bound in the node's namespace, on every address):
    from the external client and from the node itself, as upstream's host-network pod asks."""
    for where, path in itertools.product(("client", "node1"), ("/healthz", "/livez")):
        host = N1 if where == "client" else "127.0.0.1"
        status, headers, body = _curl(api, where, f"http://{host}:10256{path}")
        assert status == 200, body
        assert headers["content-type"] == "application/json"
        assert headers["x-content-type-options"] == "nosniff"
        doc = json.loads(body)
        assert set(doc) >= {"lastUpdated", "currentTime", "healthy", "status"}
        assert doc["healthy"] is True and doc["status"]["IPv4"]["healthy"] is True
        assert ("nodeEligible" in doc) == (path == "/healthz")


def _wait_status(api: ApiCluster, url: str, want: int, timeout: float = 30.0) -> str:
    """Until a GET of `url` from the external client answers `want`; the body of that answer."""
    deadline = time.monotonic() + timeout
    while True:
        status, _, body = _curl(api, "client", url)
        if status == want:
            return body
        assert time.monotonic() < deadline, f"{url} still answers {status}, not {want}: {body}"
        time.sleep(0.1)


def test_healthz_turns_503_when_the_nodes_node_object_is_deleted(api: ApiCluster) -> None:
    """kube-proxy's node eligibility (`/healthz` 503 once this node's Node object is gone, so load
    balancers stop sending to a node being removed): node1's Node deleted on the API server, its
    agent's /healthz says 503 and `nodeEligible: false` while /livez and node2's /healthz stay 200;
    the Node recreated, 200 again."""
    healthz, livez = f"http://{N1}:10256/healthz", f"http://{N1}:10256/livez"
    status, _, body = _curl(api, "client", healthz)
    assert status == 200 and json.loads(body)["nodeEligible"] is True, body
    api.server.delete("Node", "", "node1")
    try:
        doc = json.loads(_wait_status(api, healthz, 503))
        assert doc["nodeEligible"] is False and doc["healthy"] is True, doc
        assert _curl(api, "client", livez)[0] == 200, "liveness does not depend on the Node"
        assert _curl(api, "client", f"http://{N2}:10256/healthz")[0] == 200, "node2's Node is still there"
    finally:
        api.server.apply(node_object("node1", N1, pod_cidr=api.lab.node(1).pod_cidr))
    assert json.loads(_wait_status(api, healthz, 200))["nodeEligible"] is True


def test_healthz_turns_503_while_the_node_carries_the_cluster_autoscalers_deletion_taint(
    api: ApiCluster,
) -> None:
    """kube-proxy's node eligibility: the cluster autoscaler taints a node it is about to remove
    with `ToBeDeletedByClusterAutoscaler`, and kube-proxy's /healthz turns 503 (`nodeEligible:
    false`) so load balancers drain it first; /livez stays 200 (the proxy itself is fine), node2
    stays 200; the taint removed (a scale-down cancelled), 200 again."""
    healthz, livez = f"http://{N1}:10256/healthz", f"http://{N1}:10256/livez"
    assert json.loads(_wait_status(api, healthz, 200))["nodeEligible"] is True
    tainted = node_object("node1", N1, pod_cidr=api.lab.node(1).pod_cidr)
    tainted["spec"]["taints"] = [
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1732600000", "effect": "NoSchedule"}
    ]
    api.server.apply(tainted)
    try:
        doc = json.loads(_wait_status(api, healthz, 503))
        assert doc["nodeEligible"] is False and doc["healthy"] is True, doc
        assert _curl(api, "client", livez)[0] == 200, "liveness does not depend on the Node"
        assert _curl(api, "client", f"http://{N2}:10256/healthz")[0] == 200, "node2 is not tainted"
    finally:
        api.server.apply(node_object("node1", N1, pod_cidr=api.lab.node(1).pod_cidr))
    assert json.loads(_wait_status(api, healthz, 200))["nodeEligible"] is True


def test_health_check_node_port_says_which_node_has_a_ready_local_endpoint(api: ApiCluster) -> None:
    """An externalTrafficPolicy: Local load balancer's healthCheckNodePort: 200 with the count on
    the node with a local endpoint, 503 on the other (kube-proxy's body and headers)."""
    lb = service(
        "lb-local",
        "10.96.2.4",
        [Port("http", 80, 8080, node_port=30400)],
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=32400,
    )
    api.apply(with_endpoints(lb, [ep(api, "pod-1-2")]))
    status, headers, body = _curl(api, "client", f"http://{N1}:32400/")
    assert status == 200, body
    assert headers["content-type"] == "application/json"
    assert headers["x-load-balancing-endpoint-weight"] == "1"
    assert json.loads(body) == {
        "service": {"namespace": "default", "name": "lb-local"},
        "localEndpoints": 1,
        "serviceProxyHealthy": True,
    }
    status, _, body = _curl(api, "client", f"http://{N2}:32400/")
    assert status == 503 and json.loads(body)["localEndpoints"] == 0
    # from a pod too, as upstream's test container asks each node
    assert _curl(api, "pod-2-1", f"http://{N1}:32400/")[0] == 200
    assert _curl(api, "pod-2-1", f"http://{N2}:32400/")[0] == 503
    api.delete([lb])
    out = api.lab.run("client", "curl", "-s", "--max-time", "2", f"http://{N1}:32400/", check=False)
    assert out.returncode != 0, "the port closes with its Service"


def test_metrics_and_proxy_mode_on_the_node_loopback(api: ApiCluster) -> None:
    status, headers, body = _curl(api, "node1", "http://127.0.0.1:10249/proxyMode")
    assert status == 200 and body.strip() == api.mode
    status, headers, body = _curl(api, "node1", "http://127.0.0.1:10249/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in (
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "ekp_watch_events_total",
    ):
        assert f"\n{name}" in body, name
    if api.mode == "ebpf":
        assert 'ekp_bpf_map_entries{map="ekp_fe_v2"}' in body
    out = api.lab.run("client", "curl", "-s", "--max-time", "2", f"http://{N1}:10249/metrics", check=False)
    assert out.returncode != 0, "metrics listen on the node's loopback only, as kube-proxy's default"


def test_a_malformed_service_gets_a_warning_event_and_the_others_keep_working(api: ApiCluster) -> None:
    good = service("fine", "10.96.2.5", [HTTP])
    bad = service("broken", "10.96.2.6", [HTTP], sessionAffinity="Sticky")
    api.apply([*with_endpoints(good, [ep(api, "pod-2-1")]), bad])
    assert served(api, "pod-1-1", "http://10.96.2.5/", count=5) == {"pod-2-1"}
    deadline = time.monotonic() + 20
    events: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        events = [e for e in api.server.events() if e.get("regarding", {}).get("name") == "broken"]
        if len(events) >= 1:
            break
        time.sleep(0.2)
    assert events, "no Event about the malformed Service"
    event = events[0]
    assert event["type"] == "Warning" and event["reason"] == "InvalidService"
    assert "spec.sessionAffinity" in event["note"]
    assert event["regarding"]["kind"] == "Service" and event["regarding"]["namespace"] == "default"
    stored = api.server.get("Service", "default", "broken")
    assert stored is not None
    assert event["regarding"]["uid"] == stored["metadata"]["uid"], "kubectl describe matches Events by uid"
    api.delete([good, bad])  # the lab is shared (tests/traffic/conftest.py): leave it as found
