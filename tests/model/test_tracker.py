"""ProxyModel: per-object changes in, only the service ports that really changed out."""

from __future__ import annotations

from typing import Any

from agent.model import NodeInfo, Protocol, ServicePortName, tracker
from agent.model.tracker import MAX_ENDPOINTS_PER_PORT, ProxyModel, claims_of
from agent.model.wire import TRIGGER_TIME_ANNOTATION
from tests.model.test_state import endpoint, service, slice_

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
API = ServicePortName("default", "api", "http", Protocol.TCP)


def model(*objs: dict[str, Any], node: str = "node1") -> ProxyModel:
    m = ProxyModel(NodeInfo(node))
    for o in objs:
        key = f"{o['metadata'].get('namespace', 'default')}/{o['metadata']['name']}"
        if o["kind"] == "Service":
            m.set_service(key, o)
        else:
            m.set_slice(key, o)
    return m


def web_slice(*ips: str, name: str = "web-1", svc: str = "web", **meta: Any) -> dict[str, Any]:
    return slice_(name, svc, endpoints=[endpoint(ip) for ip in ips], **meta)


def test_first_commit_is_full_later_commits_name_what_changed() -> None:
    m = model(service("web"), web_slice("10.244.1.2"), service("api", clusterIP="10.96.0.11"))
    first = m.commit()
    assert first.changed is None
    assert set(m.state.services) == {WEB, API}
    m.set_slice("default/web-1", web_slice("10.244.1.2", "10.244.1.3"))
    second = m.commit()
    assert second.changed == frozenset({WEB})
    assert [e.ip for e in m.state.endpoints[WEB].cluster] == ["10.244.1.2", "10.244.1.3"]
    assert m.commit().changed == frozenset()


def test_a_change_undone_before_the_commit_changes_nothing() -> None:
    m = model(service("web"), web_slice("10.244.1.2"))
    m.commit()
    m.set_slice("default/web-1", web_slice("10.244.1.9"))
    m.set_slice("default/web-1", web_slice("10.244.1.2"))
    m.set_service("default/web", service("web", clusterIP="10.96.0.99"))
    m.set_service("default/web", service("web"))
    result = m.commit()
    assert result.changed == frozenset()
    assert result.services_changed == 0


def test_deleting_a_service_removes_its_ports_and_keeps_its_slices_waiting() -> None:
    m = model(service("web"), web_slice("10.244.1.2"))
    m.commit()
    m.delete_service("default/web")
    assert m.commit().changed == frozenset({WEB})
    assert WEB not in m.state.services and WEB not in m.state.endpoints
    m.set_service("default/web", service("web"))
    assert m.commit().changed == frozenset({WEB})
    assert [e.ip for e in m.state.endpoints[WEB].cluster] == ["10.244.1.2"], "the slice was kept"


def test_a_slice_moving_to_another_service_touches_both() -> None:
    m = model(service("web"), service("api", clusterIP="10.96.0.11"), web_slice("10.244.1.2"))
    m.commit()
    m.set_slice("default/web-1", web_slice("10.244.1.2", svc="api"))
    assert m.commit().changed == frozenset({WEB, API})
    assert m.state.endpoints[WEB].cluster == ()
    assert [e.ip for e in m.state.endpoints[API].cluster] == ["10.244.1.2"]


def test_an_invalid_update_keeps_the_last_valid_version_and_says_so() -> None:
    m = model(service("web"), web_slice("10.244.1.2"))
    m.commit()
    m.set_service("default/web", service("web", clusterIP="not-an-ip"))
    result = m.commit()
    assert result.changed == frozenset()
    assert m.state.services[WEB].cluster_ip == "10.96.0.10"
    (problem,) = result.problems_added
    assert problem.ref == "Service default/web"
    assert "last valid version stays in force" in problem.reason
    m.set_service("default/web", service("web"))
    fixed = m.commit()
    assert fixed.problems_cleared == (problem,)
    assert m.problems() == []


def test_an_object_never_valid_is_absent() -> None:
    m = model(service("web", clusterIP="not-an-ip"))
    result = m.commit()
    assert m.state.services == {}
    assert [p.ref for p in result.problems_added] == ["Service default/web"]


def _older(name: str, created: str, **spec: Any) -> dict[str, Any]:
    svc = service(name, **spec)
    svc["metadata"]["creationTimestamp"] = created
    return svc


def test_two_services_claiming_one_external_ip_the_older_wins_whatever_the_order() -> None:
    ext = {"externalIPs": ["192.168.0.200"]}
    young = _older("aaa", "2024-05-01T00:00:00Z", clusterIP="10.96.0.5", **ext)
    old = _older("zzz", "2023-01-01T00:00:00Z", clusterIP="10.96.0.6", **ext)
    zzz = ServicePortName("default", "zzz", "http", Protocol.TCP)
    for order in ((young, old), (old, young)):
        m = model(*order)
        result = m.commit()
        assert set(m.state.services) == {zzz}, order
        (problem,) = result.problems_added
        assert problem.ref == "Service default/aaa"
        assert "192.168.0.200:80/TCP is already used by the older Service default/zzz" in problem.reason


def test_the_loser_takes_over_when_the_winner_goes_away() -> None:
    winner = _older(
        "web",
        "2023-01-01T00:00:00Z",
        type="NodePort",
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
    )
    loser = _older(
        "api",
        "2024-01-01T00:00:00Z",
        clusterIP="10.96.0.11",
        type="NodePort",
        ports=[{"name": "http", "port": 81, "nodePort": 30080}],
    )
    m = model(winner, loser)
    m.commit()
    assert set(m.state.services) == {WEB}
    assert "nodePort 30080/TCP" in m.problems()[0].reason
    m.delete_service("default/web")
    result = m.commit()
    assert result.changed == frozenset({WEB, API})
    assert set(m.state.services) == {API}
    assert [p.ref for p in result.problems_cleared] == ["Service default/api"]
    assert m.problems() == []


def test_same_port_number_on_other_protocols_is_no_conflict() -> None:
    tcp = service("web", ports=[{"name": "dns", "port": 53, "protocol": "TCP"}])
    udp = service("api", clusterIP="10.96.0.10", ports=[{"name": "dns", "port": 53, "protocol": "UDP"}])
    m = model(tcp, udp)
    m.commit()
    assert len(m.state.services) == 2
    assert claims_of(m.state.services[ServicePortName("default", "web", "dns", Protocol.TCP)]) == (
        ("ip", "10.96.0.10", "53", "TCP"),
    )


def test_more_endpoints_than_the_data_path_holds_are_cut_the_same_way_for_both_modes() -> None:
    n = MAX_ENDPOINTS_PER_PORT + 1
    ips = [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}" for i in range(1, n + 1)]
    slices = [web_slice(*ips[i : i + 1000], name=f"web-{i}") for i in range(0, n, 1000)]
    m = model(service("web"), *slices)
    result = m.commit()
    eps = m.state.raw_endpoints[WEB]
    assert len(eps) == MAX_ENDPOINTS_PER_PORT
    assert [e.sort_key for e in eps] == sorted(f"{ip}:8080" for ip in ips)[:MAX_ENDPOINTS_PER_PORT]
    (problem,) = result.problems_added
    assert f"has {n} endpoints; only the first {MAX_ENDPOINTS_PER_PORT}" in problem.reason


def test_a_zone_change_re_evaluates_everything() -> None:
    m = model(service("web"), web_slice("10.244.1.2"))
    m.commit()
    m.set_node(NodeInfo("node1", (("topology.kubernetes.io/zone", "b"),)))
    assert m.commit().changed is None
    m.set_node(NodeInfo("node1", (("topology.kubernetes.io/zone", "b"), ("other", "x"))))
    assert m.commit().changed == frozenset(), "labels other than the zone change nothing"


def test_health_counts_distinct_ready_local_ips_over_all_ports() -> None:
    svc = service(
        "web",
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=31000,
        ports=[
            {"name": "http", "port": 80, "nodePort": 30080},
            {"name": "https", "port": 443, "nodePort": 30443},
        ],
    )
    sl = slice_(
        "web-1",
        ports=[{"name": "http", "port": 8080}, {"name": "https", "port": 8443}],
        endpoints=[
            endpoint("10.244.1.2", node="node1"),
            endpoint("10.244.1.3", node="node1", ready=False, serving=True, terminating=True),
            endpoint("10.244.2.2", node="node2"),
        ],
    )
    m = model(svc, sl)
    result = m.commit()
    assert result.health_check_ports == {"default/web": 31000}
    assert result.local_endpoints == {"default/web": 1}, "one IP on two ports; terminating does not count"


def test_trigger_times_of_changed_services_are_reported() -> None:
    m = model(service("web"))
    m.commit()
    sl = web_slice("10.244.1.2")
    sl["metadata"]["annotations"] = {
        "endpoints.kubernetes.io/last-change-trigger-time": "2026-01-02T03:04:05Z"
    }
    m.set_slice("default/web-1", sl)
    result = m.commit()
    assert result.trigger_times == (1767323045.0,)
    assert m.commit().trigger_times == ()
    sl["metadata"]["annotations"] = {"endpoints.kubernetes.io/last-change-trigger-time": "yesterday"}
    sl["endpoints"] = [endpoint("10.244.1.3")]
    m.set_slice("default/web-1", sl)
    unparsable = m.commit()
    assert unparsable.changed and unparsable.trigger_times == ()


def test_only_a_trigger_time_of_a_timestamps_length_is_cached() -> None:
    tracker._epoch.cache_clear()
    meta = {"name": "web-1", "annotations": {TRIGGER_TIME_ANNOTATION: "2026-11-28T06:52:24.123456789Z"}}
    assert tracker._trigger_time({"metadata": meta}) == 1795848744.123456
    long = "2026-11-28T06:52:24" + "0" * 100_000 + "Z"
    assert tracker._trigger_time({"metadata": {"annotations": {TRIGGER_TIME_ANNOTATION: long}}}) is None
    assert tracker._epoch.cache_info().currsize == 1, "the long text is not kept"
