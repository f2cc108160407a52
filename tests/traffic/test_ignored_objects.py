"""Labels, ignored objects and type changes on a live Service, through the API server, both modes.

Each test toggles one thing on a Service that is serving and checks that traffic stops and comes
back exactly as kube-proxy would have it (agent/model/parse.py and agent/kube/resources.py give the
upstream rules): the `service-proxy-name` label (Service ignored: its cluster IP is not programmed),
the `headless` label (the Service stays, its slices go: the cluster IP rejects), `ipMode: Proxy`
on an ingress IP (that VIP alone is left out), type changes through ExternalName (no cluster
IP: nothing programmed), NodePort and LoadBalancer, and the health check node port as
externalTrafficPolicy and endpoint conditions change. The fake API server has no EndpointSlice
controller, so a test labels the slices as the controller would: it copies a Service's labels.

Upstream e2e tests these stand for (test/e2e/network/service.go, loadbalancer.go) are named in
each docstring.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Any

import pytest

from lab.apicluster import ApiCluster
from lab.harness import PROBE_SPORT, ep
from lab.objects import Obj, Port, endpoint_slice, service, with_endpoints

pytestmark = pytest.mark.kernel

HTTP = Port("http", 80, 8080)
N1, N2 = "192.168.0.11", "192.168.0.12"
PROXY_NAME = "service.kubernetes.io/service-proxy-name"
HEADLESS = "service.kubernetes.io/headless"


def labelled(obj: Obj, labels: dict[str, str]) -> Obj:
    """A copy of `obj` with exactly these extra labels (beside the slice's service-name label)."""
    out = copy.deepcopy(obj)
    keep = {k: v for k, v in out["metadata"].get("labels", {}).items() if k == "kubernetes.io/service-name"}
    out["metadata"]["labels"] = {**keep, **labels}
    return out


def served(api: ApiCluster, target: str, url: str, count: int = 10) -> set[str]:
    result = api.http(target, url, count=count)
    assert result["errors"] == 0, (url, result)
    return set(result["bodies"])


def not_served(api: ApiCluster, target: str, url: str) -> dict[str, Any]:
    """Two connects left unanswered (or rejected), from PROBE_SPORT: an autobound port could be one
    a later `served` connect of the same address picks, which the probe's conntrack entry (no
    DNAT) would hold untranslated until it timed out."""
    result = api.http(target, url, count=2, timeout=1.0, sport=PROBE_SPORT)
    assert result["errors"] == 2 and not result["bodies"], (url, result)
    return result


def refused(api: ApiCluster, target: str, url: str) -> None:
    """Rejected at once (kube-proxy's REJECT for a Service without endpoints), not a timeout."""
    start = time.monotonic()
    result = not_served(api, target, url)
    assert all("Connection refused" in k for k in result["error_kinds"]), result
    assert time.monotonic() - start < 1.9, "rejected, not dropped"


def test_service_proxy_name_label_toggled_on_a_live_service(api: ApiCluster) -> None:
    """ "should implement service.kubernetes.io/service-proxy-name": a Service created with the
    label is never served; one labelled while serving stops, and serves again once unlabelled."""
    disabled = service("proxy-disabled", "10.96.3.1", [HTTP])
    toggled = service("proxy-toggled", "10.96.3.2", [HTTP])
    other = {PROXY_NAME: "foo-bar"}
    d_svc, d_slice = with_endpoints(disabled, [ep(api, "pod-1-2"), ep(api, "pod-2-2")])
    t_svc, t_slice = with_endpoints(toggled, [ep(api, "pod-1-2"), ep(api, "pod-2-2")])
    both = {"pod-1-2", "pod-2-2"}
    sources = ("pod-1-1", "node1")  # upstream dials from a host-network pod too
    api.apply([labelled(d_svc, other), labelled(d_slice, other), t_svc, t_slice])
    for source in sources:
        assert served(api, source, "http://10.96.3.2/", count=20) == both, source
        not_served(api, source, "http://10.96.3.1/")

    api.apply([labelled(t_svc, other), labelled(t_slice, other)])
    for source in (*sources, "pod-2-1"):
        not_served(api, source, "http://10.96.3.2/")

    api.apply([t_svc, t_slice])
    for source in sources:
        assert served(api, source, "http://10.96.3.2/", count=20) == both, source
        not_served(api, source, "http://10.96.3.1/")
    # The positive control of the silence above: unlabelled, the same cluster IP serves.
    api.apply([d_svc, d_slice])
    for source in sources:
        assert served(api, source, "http://10.96.3.1/", count=20) == both, source
    api.delete([d_svc, t_svc])


def test_headless_label_toggled_on_a_live_service(api: ApiCluster) -> None:
    """ "should implement service.kubernetes.io/headless": labelled, the Service keeps its cluster
    IP but its slices are not watched (`!headless`), so the cluster IP rejects as an empty Service's
    does; unlabelled, it serves again. A Service created with the label never serves."""
    born = service("headless-born", "10.96.3.3", [HTTP], type="NodePort")
    born["spec"]["ports"][0]["nodePort"] = 30310
    toggled = service("headless-toggled", "10.96.3.4", [HTTP])
    flag = {HEADLESS: ""}
    b_svc, b_slice = with_endpoints(born, [ep(api, "pod-2-3")])
    t_svc, t_slice = with_endpoints(toggled, [ep(api, "pod-1-3"), ep(api, "pod-2-3")])
    both = {"pod-1-3", "pod-2-3"}
    sources = ("pod-1-1", "node1")  # upstream dials from a host-network pod too
    api.apply([labelled(b_svc, flag), labelled(b_slice, flag), t_svc, t_slice])
    for source in sources:
        assert served(api, source, "http://10.96.3.4/", count=20) == both, source
        refused(api, source, "http://10.96.3.3/")

    api.apply([labelled(t_svc, flag), labelled(t_slice, flag)])
    for source in (*sources, "pod-2-1"):
        refused(api, source, "http://10.96.3.4/")

    api.apply([t_svc, t_slice])
    for source in ("pod-2-1", "node1"):
        assert served(api, source, "http://10.96.3.4/", count=20) == both, source
    for source in sources:
        refused(api, source, "http://10.96.3.3/")
    # The positive control of the rejects above: unlabelled, the same cluster IP serves.
    api.apply([b_svc, b_slice])
    for source in sources:
        assert served(api, source, "http://10.96.3.3/", count=10) == {"pod-2-3"}, source
    api.delete([b_svc, t_svc])


def test_a_headless_service_programs_nothing_and_its_pods_stay_reachable_directly(api: ApiCluster) -> None:
    """clusterIP None: kube-proxy's Service watch never sees it (`spec.clusterIP!=None`) and the
    slices carry the headless label; the pods answer on their own addresses, as DNS hands out."""
    headless = service("dns-only", "None", [HTTP])
    h_svc, h_slice = with_endpoints(headless, [ep(api, "pod-2-2")])
    # The agents never hear of these two: wait for a visible pair written after them instead.
    api.server.apply(h_svc)
    api.server.apply(labelled(h_slice, {HEADLESS: ""}))
    marker = service("marker", "10.96.3.10", [HTTP])
    api.apply(with_endpoints(marker, [ep(api, "pod-1-2")]))
    assert served(api, "pod-1-1", "http://10.96.3.10/", count=3) == {"pod-1-2"}
    assert served(api, "pod-1-1", f"http://{ep(api, 'pod-2-2').ip}:8080/", count=3) == {"pod-2-2"}
    for node, agent in zip(("node1", "node2"), api.agents, strict=True):
        if api.mode == "iptables":  # the marker's rules are there, named as kube-proxy names them
            rules = api.lab.run(node, "iptables-save", check=False).stdout
            assert "default/marker" in rules and "default/dns-only" not in rules, rules
        else:  # the marker's endpoint is a backend, the headless Service's endpoint is none
            backends = programmed_backends(agent.pin_path)
            assert ep(api, "pod-1-2").ip in backends and ep(api, "pod-2-2").ip not in backends, backends
    api.server.delete("Service", "default", "dns-only")
    api.delete([marker])


def programmed_backends(pin_path: str) -> set[str]:
    """The addresses of every backend in an eBPF-mode agent's maps."""
    from agent.ebpf.abi import MAPS, Backend, ip_str
    from agent.ebpf.maps import BpfMap

    with BpfMap.open_pinned(MAPS["be"], pin_path) as be:
        return {ip_str(v.addr) for _, v in be.items() if isinstance(v, Backend)}


def external_name(name: str, target: str = "db.example.com") -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"type": "ExternalName", "externalName": target},
    }


def test_type_change_from_external_name_to_cluster_ip_and_back(api: ApiCluster) -> None:
    """ "should be able to change the type from ExternalName to ClusterIP" and "should be able to
    change the type from ClusterIP to ExternalName" (conformance): nothing is programmed for an
    ExternalName Service; once ClusterIP it serves; back to ExternalName, its old IP stops."""
    api.apply([external_name("ext-cip"), endpoint_slice("ext-cip", [HTTP], [ep(api, "pod-2-1")])])
    not_served(api, "pod-1-1", "http://10.96.3.5/")
    api.apply([service("ext-cip", "10.96.3.5", [HTTP])])
    assert served(api, "pod-1-1", "http://10.96.3.5/") == {"pod-2-1"}
    api.apply([external_name("ext-cip")])
    not_served(api, "pod-1-1", "http://10.96.3.5/")
    api.delete([external_name("ext-cip")])


def test_type_change_from_external_name_to_node_port_and_back(api: ApiCluster) -> None:
    """ "should be able to change the type from ExternalName to NodePort" and "should be able to
    change the type from NodePort to ExternalName" (conformance): the NodePort serves on both nodes
    while the type is NodePort, and closes on both when it is ExternalName again."""
    np = service("ext-np", "10.96.3.6", [Port("http", 80, 8080, node_port=30311)], type="NodePort")
    api.apply([external_name("ext-np"), endpoint_slice("ext-np", [HTTP], [ep(api, "pod-1-2")])])
    not_served(api, "client", f"http://{N1}:30311/")
    api.apply([np])
    for node_ip in (N1, N2):
        assert served(api, "client", f"http://{node_ip}:30311/") == {"pod-1-2"}
    assert served(api, "pod-2-1", "http://10.96.3.6/") == {"pod-1-2"}
    api.apply([external_name("ext-np")])
    for node_ip in (N1, N2):
        not_served(api, "client", f"http://{node_ip}:30311/")
    not_served(api, "pod-2-1", "http://10.96.3.6/")
    api.delete([external_name("ext-np")])


def lb_status(ip: str, mode: str | None) -> dict[str, Any]:
    ingress: dict[str, Any] = {"ip": ip}
    if mode:
        ingress["ipMode"] = mode
    return {"loadBalancer": {"ingress": [ingress]}}


def test_load_balancer_ingress_ip_mode_proxy_toggled(api: ApiCluster) -> None:
    """`ipMode: Proxy` (KEP-1860): the load balancer delivers to the node itself, so kube-proxy
    installs no rule for that ingress IP (`IsVIPMode`); VIP, or no ipMode, serves on the IP."""
    api.lab.add_client_route("198.51.100.0/24", via_node=1)
    ports = [Port("http", 80, 8080, node_port=30312)]

    def lb(mode: str | None) -> Obj:
        return service(
            "lb-mode", "10.96.3.7", ports, type="LoadBalancer", status=lb_status("198.51.100.7", mode)
        )

    svc, eps = with_endpoints(lb(None), [ep(api, "pod-1-3"), ep(api, "pod-2-2")])
    api.apply([svc, eps])
    assert served(api, "client", "http://198.51.100.7/", count=20) == {"pod-1-3", "pod-2-2"}
    api.apply([lb("Proxy")])
    not_served(api, "client", "http://198.51.100.7/")
    assert served(api, "client", f"http://{N1}:30312/") <= {"pod-1-3", "pod-2-2"}, "the Service stays"
    api.apply([lb("VIP")])
    assert served(api, "client", "http://198.51.100.7/", count=20) == {"pod-1-3", "pod-2-2"}
    api.delete([svc])


def test_change_the_type_and_ports_of_a_tcp_service(api: ApiCluster) -> None:
    """ "should be able to change the type and ports of a TCP service" (loadbalancer.go), with the
    ingress IP a cloud would publish: ClusterIP, NodePort, LoadBalancer, a new NodePort, a new
    port, scaled to 0 (refused) and back to 1, then ClusterIP again (the LB IP and NodePort close)."""
    api.lab.add_client_route("198.51.101.0/24", via_node=2)
    lb_ip = "198.51.101.8"

    def svc(type: str, port: int = 80, node_port: int = 0, lb: bool = False) -> Obj:
        extra: dict[str, Any] = {"status": lb_status(lb_ip, None)} if lb else {}
        return service(
            "mutable", "10.96.3.8", [Port("http", port, 8080, node_port=node_port)], type=type, **extra
        )

    eps = endpoint_slice("mutable", [HTTP], [ep(api, "pod-2-3")])
    api.apply([svc("ClusterIP"), eps])
    assert served(api, "pod-1-1", "http://10.96.3.8/") == {"pod-2-3"}
    api.apply([svc("NodePort", node_port=30313)])
    for node_ip in (N1, N2):
        assert served(api, "client", f"http://{node_ip}:30313/") == {"pod-2-3"}
    api.apply([svc("LoadBalancer", node_port=30313, lb=True)])
    assert served(api, "client", f"http://{lb_ip}/") == {"pod-2-3"}
    api.apply([svc("LoadBalancer", node_port=30314, lb=True)])
    assert served(api, "client", f"http://{N2}:30314/") == {"pod-2-3"}
    not_served(api, "client", f"http://{N2}:30313/")
    api.apply([svc("LoadBalancer", port=81, node_port=30314, lb=True)])
    assert served(api, "client", f"http://{lb_ip}:81/") == {"pod-2-3"}
    assert served(api, "pod-1-1", "http://10.96.3.8:81/") == {"pod-2-3"}
    not_served(api, "pod-1-1", "http://10.96.3.8:80/")
    api.apply([endpoint_slice("mutable", [HTTP], [])])
    refused(api, "pod-1-1", "http://10.96.3.8:81/")
    api.apply([eps])
    assert served(api, "client", f"http://{lb_ip}:81/") == {"pod-2-3"}
    api.apply([svc("ClusterIP", port=81)])
    not_served(api, "client", f"http://{N2}:30314/")
    not_served(api, "client", f"http://{lb_ip}:81/")
    assert served(api, "pod-1-1", "http://10.96.3.8:81/") == {"pod-2-3"}
    api.delete([svc("ClusterIP")])


def test_change_the_type_and_ports_of_a_udp_service(api: ApiCluster) -> None:
    """ "should be able to change the type and ports of a UDP service" (loadbalancer.go): the same
    walk over UDP, answered by the pods' UDP echo on 9000."""
    api.lab.add_client_route("198.51.102.0/24", via_node=1)
    lb_ip = "198.51.102.9"
    echo = Port("udp", 90, 9000, "UDP")

    def svc(type: str, port: int = 90, node_port: int = 0, lb: bool = False) -> Obj:
        extra: dict[str, Any] = {"status": lb_status(lb_ip, None)} if lb else {}
        p = Port("udp", port, 9000, "UDP", node_port=node_port)
        return service("mutable-udp", "10.96.3.9", [p], type=type, **extra)

    api.apply([svc("ClusterIP"), endpoint_slice("mutable-udp", [echo], [ep(api, "pod-1-2")])])
    assert api.udp("pod-2-1", "10.96.3.9", 90, count=5) == {"replies": {"pod-1-2": 5}, "lost": 0}
    api.apply([svc("NodePort", node_port=30315)])
    assert api.udp("client", N2, 30315, count=5)["replies"] == {"pod-1-2": 5}
    api.apply([svc("LoadBalancer", node_port=30316, lb=True)])
    assert api.udp("client", lb_ip, 90, count=5)["replies"] == {"pod-1-2": 5}
    assert api.udp("client", N1, 30316, count=5)["replies"] == {"pod-1-2": 5}
    api.apply([svc("LoadBalancer", port=91, node_port=30316, lb=True)])
    assert api.udp("client", lb_ip, 91, count=5)["replies"] == {"pod-1-2": 5}
    api.apply([svc("ClusterIP", port=91)])
    # New flows from source ports below the ephemeral range: an autobound one may repeat an earlier
    # flow's, whose conntrack entry still forwards it (tests/traffic/test_upstream_e2e.py NEW_FLOW_SPORT)
    assert api.udp("client", lb_ip, 91, count=2, sport=20710)["lost"] == 2
    assert api.udp("client", N1, 30316, count=2, sport=20711)["lost"] == 2
    assert api.udp("pod-2-1", "10.96.3.9", 91, count=5)["replies"] == {"pod-1-2": 5}
    api.delete([svc("ClusterIP")])


def health(api: ApiCluster, node_ip: str, port: int, source: str = "client") -> int:
    """The HTTP status of a healthCheckNodePort, 0 when nothing answers."""
    out = api.lab.run(
        source,
        "curl",
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        "2",
        f"http://{node_ip}:{port}/",
        check=False,
    )
    return int(out.stdout or 0)


def test_health_check_node_port_fails_with_only_terminating_endpoints(api: ApiCluster) -> None:
    """ "should fail health check node port if there are only terminating endpoints": 200 while the
    local endpoint is ready, 503 once it is only terminating, and the NodePort still reaches it
    (the terminating fallback)."""

    def lb(endpoint_ready: bool) -> list[Obj]:
        svc = service(
            "svc-proxy-terminating",
            "10.96.3.11",
            [Port("http", 80, 8080, node_port=30317)],
            type="LoadBalancer",
            externalTrafficPolicy="Local",
            healthCheckNodePort=32401,
        )
        e = ep(api, "pod-1-2")
        if not endpoint_ready:
            e = replace(e, ready=False, serving=True, terminating=True)
        return with_endpoints(svc, [e])

    api.apply(lb(True))
    assert health(api, N1, 32401) == 200
    api.apply(lb(False))
    # from the external client, and from a pod on the endpoint's node as upstream's pause pod
    for source in ("client", "pod-1-1"):
        assert health(api, N1, 32401, source) == 503, source
        assert served(api, source, f"http://{N1}:30317/", count=5) == {"pod-1-2"}, source
    api.delete([lb(False)[0]])


def test_updates_to_the_external_traffic_policy_field(api: ApiCluster) -> None:
    """ESIPP "should handle updates to ExternalTrafficPolicy field": Local, the health port says 200
    on the endpoint's node and the client's address reaches the backend; Cluster, the health port
    closes, the other node forwards and the backend sees a node address; Local again (same health
    port), the client's address is kept again."""

    def svc(policy: str) -> Obj:
        extra: dict[str, Any] = {"healthCheckNodePort": 32402} if policy == "Local" else {}
        return service(
            "external-local-update",
            "10.96.3.12",
            [Port("http", 80, 8080, node_port=30318)],
            type="LoadBalancer",
            externalTrafficPolicy=policy,
            **extra,
        )

    client_ip = api.lab.client.ip
    api.apply(with_endpoints(svc("Local"), [ep(api, "pod-1-3")]))
    assert health(api, N1, 32402) == 200
    assert served(api, "client", f"http://{N1}:30318/ip", count=3) == {client_ip}
    api.apply([svc("Cluster")])
    assert health(api, N1, 32402) == 0, "the health check node port closes with ETP Cluster"
    for source in ("client", "pod-1-1"):  # node2 forwards, as upstream's test container sees it
        assert served(api, source, f"http://{N2}:30318/", count=3) == {"pod-1-3"}, source
    assert client_ip not in served(api, "client", f"http://{N1}:30318/ip", count=3)
    api.apply([svc("Local")])
    assert health(api, N1, 32402) == 200
    assert served(api, "client", f"http://{N1}:30318/ip", count=3) == {client_ip}
    api.delete([svc("Local")])
