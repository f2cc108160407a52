"""Every rule by which kube-proxy ignores a Service, an EndpointSlice or a load-balancer IP, as a
table: the object, and what the proxy programs from it (ports, endpoints, VIPs).

Upstream, read for each row: cmd/kube-proxy/app/server.go (`ProxyServer.Run`: Services watched with
`!service.kubernetes.io/service-proxy-name` and `spec.clusterIP!=None`, EndpointSlices with
`!service.kubernetes.io/headless`), pkg/proxy/util/utils.go (`ShouldSkipService`: no cluster IP,
`None`, ExternalName), pkg/proxy/serviceport.go (`newBaseServiceInfo`: ingress IPs only in VIP mode,
`IsVIPMode`). Each row is also what the EndpointSlice controller would produce: it copies the
Service's labels onto its slices, so a labelled Service comes with labelled slices.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.model import NodeInfo, Protocol, ServicePortName, build_state
from agent.model.parse import parse_endpoint_slice, parse_service, should_skip_service

NODE = NodeInfo("node1")
SPN = ServicePortName("default", "web", "http", Protocol.TCP)
PROXY_NAME = "service.kubernetes.io/service-proxy-name"
HEADLESS = "service.kubernetes.io/headless"


def service(labels: dict[str, str] | None = None, status: Any = None, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "clusterIP": "10.96.0.10",
        "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
    }
    base.update(spec)
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "default", "labels": labels or {}},
        "spec": base,
    }
    if status is not None:
        obj["status"] = status
    return obj


def slice_(labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-1",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": "web", **(labels or {})},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["10.244.1.2"], "conditions": {"ready": True}, "nodeName": "node1"}],
    }


def programmed(svc: dict[str, Any], labels: dict[str, str] | None = None) -> tuple[bool, int]:
    """(is the Service port programmed, how many cluster endpoints it has) for svc + one slice."""
    r = build_state([svc], [slice_(labels)], NODE)
    assert r.problems == ()
    eps = r.state.endpoints.get(SPN)
    return SPN in r.state.services, len(eps.cluster) if eps else 0


@pytest.mark.parametrize(
    ("svc_labels", "slice_labels", "expect"),
    [
        ({}, {}, (True, 1)),
        # Another proxy's Service: the Service informer never receives it, nothing is programmed.
        ({PROXY_NAME: "foo-bar"}, {PROXY_NAME: "foo-bar"}, (False, 0)),
        ({PROXY_NAME: ""}, {}, (False, 0)),  # DoesNotExist: the empty value selects it away too
        # The headless label on a Service with a cluster IP: the Service is programmed, its slices
        # (labelled alike by the controller) are not received: a VIP with no endpoint, which rejects.
        ({HEADLESS: ""}, {HEADLESS: ""}, (True, 0)),
        ({HEADLESS: ""}, {}, (True, 1)),  # the label on the Service alone changes nothing
        ({}, {HEADLESS: ""}, (True, 0)),
        # service-proxy-name on a slice alone: the slice informer does not filter on it.
        ({}, {PROXY_NAME: "foo-bar"}, (True, 1)),
    ],
    ids=[
        "unlabelled",
        "proxy-name",
        "proxy-name-empty-value",
        "headless-label-service-and-slices",
        "headless-label-service-only",
        "headless-label-slice-only",
        "proxy-name-slice-only",
    ],
)
def test_labels_as_kube_proxys_informers_select(
    svc_labels: dict[str, str], slice_labels: dict[str, str], expect: tuple[bool, int]
) -> None:
    assert programmed(service(svc_labels), slice_labels) == expect


@pytest.mark.parametrize(
    ("svc", "reason"),
    [
        (service(clusterIP="None"), "headless (clusterIP None)"),
        (service(clusterIP=None), "no cluster IP allocated"),
        (service(type="ExternalName", clusterIP=None, externalName="db.example.com"), "type ExternalName"),
        (service({PROXY_NAME: "x"}), f"labelled {PROXY_NAME}"),
    ],
    ids=["cluster-ip-none", "no-cluster-ip", "external-name", "proxy-name"],
)
def test_services_kube_proxy_skips(svc: dict[str, Any], reason: str) -> None:
    got = should_skip_service(svc)
    assert got is not None and got.startswith(reason)
    assert parse_service(svc) == []
    assert programmed(svc) == (False, 0)


def test_a_headless_labelled_service_is_not_skipped() -> None:
    assert should_skip_service(service({HEADLESS: ""})) is None


def test_only_the_headless_label_keeps_a_slice_away() -> None:
    assert parse_endpoint_slice(slice_({HEADLESS: ""})) is None
    assert parse_endpoint_slice(slice_({HEADLESS: "true"})) is None
    kept = parse_endpoint_slice(slice_({PROXY_NAME: "other"}))
    assert kept is not None and [e.ip for e in kept.endpoints] == ["10.244.1.2"]


def lb(*ingress: dict[str, Any]) -> dict[str, Any]:
    return service(
        type="LoadBalancer",
        ports=[{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}],
        status={"loadBalancer": {"ingress": list(ingress)}},
    )


@pytest.mark.parametrize(
    ("ingress", "vips"),
    [
        ([{"ip": "203.0.113.9"}], ("203.0.113.9",)),
        ([{"ip": "203.0.113.9", "ipMode": "VIP"}], ("203.0.113.9",)),
        ([{"ip": "203.0.113.9", "ipMode": "Proxy"}], ()),
        ([{"ip": "203.0.113.9", "ipMode": "Proxy"}, {"ip": "203.0.113.10"}], ("203.0.113.10",)),
        ([{"hostname": "lb.example.com"}], ()),
    ],
    ids=["default-vip", "vip", "proxy", "proxy-and-vip", "hostname-only"],
)
def test_load_balancer_ingress_in_proxy_mode_is_not_a_vip(
    ingress: list[dict[str, Any]], vips: tuple[str, ...]
) -> None:
    (port,) = parse_service(lb(*ingress))
    assert port.load_balancer_ips == vips
    assert port.node_port == 30080, "the Service itself stays programmed: only the VIP is left out"
