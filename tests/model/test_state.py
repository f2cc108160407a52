"""Kubernetes dicts -> ProxyState: parsing, skipping, merging slices, problems."""

from __future__ import annotations

from typing import Any

from agent.model import NodeInfo, Protocol, ServicePortName, SessionAffinity, build_state

NODE = NodeInfo("node1")


def service(name: str = "web", ns: str = "default", **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "clusterIP": "10.96.0.10",
        "ports": [{"name": "http", "port": 80, "targetPort": "web"}],
    }
    base.update(spec)
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns}, "spec": base}


def slice_(
    name: str, svc: str = "web", ns: str = "default", *, ports: Any = None, endpoints: Any = None, **meta: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": svc}, **meta},
        "addressType": "IPv4",
        "ports": ports if ports is not None else [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints if endpoints is not None else [],
    }


def endpoint(ip: str, node: str = "node2", **cond: bool) -> dict[str, Any]:
    return {"addresses": [ip], "conditions": cond, "nodeName": node}


SPN = ServicePortName("default", "web", "http", Protocol.TCP)


def test_named_target_port_resolved_from_slice_ports() -> None:
    r = build_state([service()], [slice_("web-1", endpoints=[endpoint("10.244.1.2")])], NODE)
    (e,) = r.state.endpoints[SPN].cluster
    assert (e.ip, e.port) == ("10.244.1.2", 8080)
    assert str(SPN) == "default/web:http"


def test_slices_merged_deduplicated_and_sorted_like_kube_proxy() -> None:
    slices = [
        slice_("web-b", endpoints=[endpoint("10.244.1.10"), endpoint("10.244.1.2")]),
        slice_("web-a", endpoints=[endpoint("10.244.1.2", node="node1"), endpoint("10.244.1.3")]),
    ]
    r = build_state([service()], slices, NODE)
    eps = r.state.endpoints[SPN].cluster
    # "10.244.1.10:8080" sorts before "10.244.1.2:8080" as strings, as kube-proxy sorts
    assert [e.ip for e in eps] == ["10.244.1.10", "10.244.1.2", "10.244.1.3"]
    dup = next(e for e in eps if e.ip == "10.244.1.2")
    assert dup.is_local, "a duplicate prefers the copy that says it is local"


def test_conditions_defaults() -> None:
    eps = [
        endpoint("10.244.1.2"),  # all absent: ready
        endpoint("10.244.1.3", ready=False),  # serving defaults to ready=false
        endpoint("10.244.1.4", ready=False, serving=True, terminating=True),
    ]
    r = build_state([service()], [slice_("s", endpoints=eps)], NODE)
    raw = {e.ip: e for e in r.state.raw_endpoints[SPN]}
    assert raw["10.244.1.2"].ready and raw["10.244.1.2"].serving and not raw["10.244.1.2"].terminating
    assert not raw["10.244.1.3"].serving
    assert raw["10.244.1.4"].terminating
    assert [e.ip for e in r.state.endpoints[SPN].cluster] == ["10.244.1.2"]


def test_ignored_services() -> None:
    svcs = [
        service("headless", clusterIP="None"),
        service("ext", type="ExternalName", externalName="example.com", clusterIP=""),
        {
            **service("other"),
            "metadata": {
                "name": "other",
                "namespace": "default",
                "labels": {"service.kubernetes.io/service-proxy-name": "x"},
            },
        },
        service("v6", clusterIP="fd00::1", clusterIPs=["fd00::1"]),
    ]
    r = build_state(svcs, [], NODE)
    assert r.state.services == {}
    assert r.problems == ()


def test_malformed_service_skipped_others_kept() -> None:
    bad = [
        service("badport", ports=[{"name": "x", "port": 70000}]),
        service("badproto", ports=[{"name": "x", "port": 80, "protocol": "ICMP"}]),
        service("badip", clusterIP="10.96.0.300"),
        {"kind": "Service", "metadata": {"namespace": "default"}, "spec": {}},
        service("badaffinity", sessionAffinity="Sticky"),
    ]
    r = build_state([*bad, service("good")], [], NODE)
    assert list(r.state.services) == [ServicePortName("default", "good", "http", Protocol.TCP)]
    reasons = {p.ref: p.reason for p in r.problems}
    assert reasons["Service default/badport"].startswith("spec.ports[0].port: 70000 is out of range 1-65535")
    assert reasons["Service default/badproto"].startswith('spec.ports[0].protocol: "ICMP" is not supported')
    assert reasons["Service default/badip"].startswith('spec.clusterIP: "10.96.0.300" must be a valid IP')
    assert reasons["Service default/?"].startswith("metadata.name: is required")
    assert reasons["Service default/badaffinity"].startswith("spec.sessionAffinity: ")


def test_malformed_slice_skipped() -> None:
    good = slice_("web-1", endpoints=[endpoint("10.244.1.2")])
    no_label = slice_("orphan")
    no_label["metadata"]["labels"] = {}
    bad_ip = slice_("web-2", endpoints=[endpoint("not-an-ip")])
    r = build_state([service()], [good, no_label, bad_ip], NODE)
    assert [e.ip for e in r.state.endpoints[SPN].cluster] == ["10.244.1.2"]
    assert {p.ref for p in r.problems} == {"EndpointSlice default/orphan", "EndpointSlice default/web-2"}


def test_service_fields() -> None:
    svc = service(
        "lb",
        type="LoadBalancer",
        ports=[
            {"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"},
            {"name": "dns", "port": 53, "nodePort": 30053, "protocol": "UDP"},
        ],
        externalIPs=["203.0.113.7", "fd00::7"],
        externalTrafficPolicy="Local",
        internalTrafficPolicy="Local",
        healthCheckNodePort=31000,
        loadBalancerSourceRanges=[" 198.51.100.0/24 ", "fd00::/64"],
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
    )
    svc["status"] = {
        "loadBalancer": {
            "ingress": [
                {"ip": "203.0.113.9"},
                {"ip": "203.0.113.10", "ipMode": "Proxy"},
                {"hostname": "lb.example.com"},
            ]
        }
    }
    r = build_state([svc], [], NODE)
    http = r.state.services[ServicePortName("default", "lb", "http", Protocol.TCP)]
    assert http.node_port == 30080
    assert http.external_ips == ("203.0.113.7",)
    assert http.load_balancer_ips == ("203.0.113.9",)
    assert http.load_balancer_source_ranges == ("198.51.100.0/24",)
    assert http.external_policy_local and http.internal_policy_local
    assert http.health_check_node_port == 31000
    assert http.session_affinity is SessionAffinity.CLIENT_IP and http.affinity_timeout == 60
    dns = r.state.services[ServicePortName("default", "lb", "dns", Protocol.UDP)]
    assert dns.protocol is Protocol.UDP and dns.node_port == 30053


def test_affinity_default_timeout() -> None:
    sp = build_state([service(sessionAffinity="ClientIP")], [], NODE).state.services[SPN]
    assert sp.affinity_timeout == 10800


def test_etp_on_a_service_not_reachable_from_outside_is_refused_as_the_api_server_does() -> None:
    r = build_state([service(externalTrafficPolicy="Local")], [], NODE)
    assert r.state.services == {}
    (problem,) = r.problems
    assert problem.reason.startswith("spec.externalTrafficPolicy: may only be set for externally-accessible")


def test_ipv6_slices_and_headless_slices_ignored() -> None:
    v6 = slice_("web-v6", endpoints=[endpoint("fd00::2")])
    v6["addressType"] = "IPv6"
    headless = slice_("web-h", endpoints=[endpoint("10.244.1.9")])
    headless["metadata"]["labels"]["service.kubernetes.io/headless"] = ""
    r = build_state([service()], [v6, headless], NODE)
    assert r.state.endpoints[SPN].cluster == ()
    assert r.problems == ()


def test_local_endpoints_follow_hostname() -> None:
    eps = [endpoint("10.244.1.2", node="node1"), endpoint("10.244.2.2", node="node2")]
    svc = service(
        type="NodePort",
        externalTrafficPolicy="Local",
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
    )
    r1 = build_state([svc], [slice_("s", endpoints=eps)], NodeInfo("node1"))
    r2 = build_state([svc], [slice_("s", endpoints=eps)], NodeInfo("node2"))
    assert [e.ip for e in r1.state.endpoints[SPN].local] == ["10.244.1.2"]
    assert [e.ip for e in r2.state.endpoints[SPN].local] == ["10.244.2.2"]
