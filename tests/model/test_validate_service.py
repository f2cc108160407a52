"""Services validated as the API server validates them (ValidateService), one rule per row.

Each refused row is a literal object and the start of the Problem it must produce: the field path,
then what would be right. Each accepted row checks what the model then programs (or ignores).
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.model import NodeInfo, Protocol, ServicePortName, build_state
from agent.model.parse import parse_service, should_skip_service
from agent.model.types import IPFamily, ServicePort

NODE = NodeInfo("node1")
HTTP = {"name": "http", "port": 80, "protocol": "TCP"}
DNS = {"name": "dns", "port": 53, "protocol": "UDP"}


def svc(
    spec: dict[str, Any] | None = None, *, meta: dict[str, Any] | None = None, **top: Any
) -> dict[str, Any]:
    """A valid ClusterIP Service `default/web`, with `spec` keys replaced (None deletes a key)."""
    base: dict[str, Any] = {"clusterIP": "10.96.0.10", "ports": [HTTP]}
    for key, value in (spec or {}).items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    metadata: dict[str, Any] = {"name": "web", "namespace": "default", **(meta or {})}
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": base, **top}


NODEPORT = {"type": "NodePort", "ports": [{**HTTP, "nodePort": 30080}]}
LB_LOCAL = {"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 31000}
BIG = 10**5000

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    # metadata
    (
        "namespace upper case",
        svc(meta={"namespace": "Default"}),
        'metadata.namespace: "Default" is not valid: ',
    ),
    ("namespace dot", svc(meta={"namespace": "a.b"}), "metadata.namespace: "),
    ("namespace not a string", svc(meta={"namespace": ["x"]}), "metadata.namespace: must be a string"),
    ("metadata missing", {"kind": "Service", "spec": {}}, "metadata: must be a map, not null"),
    ("object not a map", ["Service"], "object: must be a map, not a list of 1 item"),  # type: ignore[list-item]
    ("name missing", svc(meta={"name": None}), "metadata.name: is required"),
    (
        "name huge int",
        svc(meta={"name": BIG}),
        "metadata.name: must be a string, not an integer of 16,610 bits",
    ),
    ("labels not a map", svc(meta={"labels": "a=b"}), "metadata.labels: must be a map"),
    ("label key", svc(meta={"labels": {"a b": "x"}}), 'metadata.labels: key "a b" is not valid'),
    ("label key prefix", svc(meta={"labels": {"Ex.com/a": "x"}}), "metadata.labels: key "),
    ("label value", svc(meta={"labels": {"app": "a b"}}), 'metadata.labels[app]: "a b" is not valid'),
    (
        "label value type",
        svc(meta={"labels": {"app": False}}),
        "metadata.labels[app]: must be a string, not false",
    ),
    # spec and type
    ("spec not a map", {**svc(), "spec": "x"}, 'spec: must be a map, not "x"'),
    ("type unknown", svc({"type": "Foo"}), 'spec.type: "Foo" is not supported: must be one of ClusterIP,'),
    ("type not a string", svc({"type": 5}), "spec.type: must be a string, not 5"),
    # ports (validateServicePort)
    ("no ports", svc({"ports": None}), "spec.ports: at least one port is required"),
    ("ports not a list", svc({"ports": {"http": 80}}), "spec.ports: must be a list"),
    ("port not a map", svc({"ports": [80]}), "spec.ports[0]: must be a map, not 80"),
    ("unnamed of two", svc({"ports": [HTTP, {**DNS, "name": ""}]}), "spec.ports[1].name: is required when"),
    (
        "name upper case",
        svc({"ports": [{**HTTP, "name": "HTTP"}]}),
        'spec.ports[0].name: "HTTP" is not valid',
    ),
    ("name with space", svc({"ports": [{**HTTP, "name": "a b"}]}), "spec.ports[0].name: "),
    ("name too long", svc({"ports": [{**HTTP, "name": "a" * 64}]}), "spec.ports[0].name: "),
    (
        "name duplicate",
        svc({"ports": [HTTP, {**DNS, "name": "http"}]}),
        'spec.ports[1].name: duplicate name "http"',
    ),
    ("port zero", svc({"ports": [{**HTTP, "port": 0}]}), "spec.ports[0].port: 0 is out of range 1-65535"),
    ("port too big", svc({"ports": [{**HTTP, "port": 65536}]}), "spec.ports[0].port: 65536 is out of range"),
    ("port missing", svc({"ports": [{"name": "http"}]}), "spec.ports[0].port: must be an integer, not null"),
    (
        "port string",
        svc({"ports": [{**HTTP, "port": "80"}]}),
        'spec.ports[0].port: must be an integer, not "80"',
    ),
    (
        "port float",
        svc({"ports": [{**HTTP, "port": 80.0}]}),
        "spec.ports[0].port: must be an integer, not 80.0",
    ),
    (
        "port bool",
        svc({"ports": [{**HTTP, "port": True}]}),
        "spec.ports[0].port: must be an integer, not true",
    ),
    (
        "port huge",
        svc({"ports": [{**HTTP, "port": BIG}]}),
        "spec.ports[0].port: an integer of 16,610 bits is out",
    ),
    (
        "protocol",
        svc({"ports": [{**HTTP, "protocol": "tcp"}]}),
        'spec.ports[0].protocol: "tcp" is not supported',
    ),
    ("target numeric string", svc({"ports": [{**HTTP, "targetPort": "8080"}]}), "spec.ports[0].targetPort: "),
    (
        "target too big",
        svc({"ports": [{**HTTP, "targetPort": 70000}]}),
        "spec.ports[0].targetPort: 70000 is out",
    ),
    ("target --", svc({"ports": [{**HTTP, "targetPort": "web--x"}]}), "spec.ports[0].targetPort: "),
    ("target long", svc({"ports": [{**HTTP, "targetPort": "a" * 16}]}), "spec.ports[0].targetPort: "),
    (
        "target list",
        svc({"ports": [{**HTTP, "targetPort": [1]}]}),
        "spec.ports[0].targetPort: a list of 1 item is",
    ),
    ("appProtocol", svc({"ports": [{**HTTP, "appProtocol": ""}]}), "spec.ports[0].appProtocol: "),
    ("duplicate port", svc({"ports": [HTTP, {**HTTP, "name": "b"}]}), "spec.ports[1]: duplicate port 80/TCP"),
    (
        "nodePort on ClusterIP",
        svc({"ports": [{**HTTP, "nodePort": 30080}]}),
        "spec.ports[0].nodePort: may not be",
    ),
    (
        "nodePort big",
        svc({**NODEPORT, "ports": [{**HTTP, "nodePort": 70000}]}),
        "spec.ports[0].nodePort: 70000 is",
    ),
    (
        "nodePort negative",
        svc({**NODEPORT, "ports": [{**HTTP, "nodePort": -1}]}),
        "spec.ports[0].nodePort: -1 is",
    ),
    (
        "nodePort duplicate",
        svc(
            {
                "type": "NodePort",
                "ports": [{**HTTP, "nodePort": 30080}, {**HTTP, "name": "b", "port": 81, "nodePort": 30080}],
            }
        ),
        "spec.ports[1].nodePort: duplicate nodePort 30080/TCP",
    ),
    # session affinity (validateClientIPAffinityConfig)
    (
        "affinity unknown",
        svc({"sessionAffinity": "Sticky"}),
        'spec.sessionAffinity: "Sticky" is not supported',
    ),
    (
        "affinity config with None",
        svc({"sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 5}}}),
        "spec.sessionAffinityConfig: must not be set when spec.sessionAffinity is None",
    ),
    (
        "affinity timeout zero",
        svc({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}}),
        "spec.sessionAffinityConfig.clientIP.timeoutSeconds: 0 is out of range 1-86400",
    ),
    (
        "affinity timeout above a day",
        svc(
            {"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86401}}}
        ),
        "spec.sessionAffinityConfig.clientIP.timeoutSeconds: 86401 is out of range 1-86400",
    ),
    (
        "affinity timeout string",
        svc({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": "60"}}}),
        'spec.sessionAffinityConfig.clientIP.timeoutSeconds: must be an integer, not "60"',
    ),
    (
        "affinity clientIP not a map",
        svc({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": 60}}),
        "spec.sessionAffinityConfig.clientIP: must be a map, not 60",
    ),
    # cluster IPs (ValidateServiceClusterIPsRelatedFields)
    (
        "clusterIP text",
        svc({"clusterIP": "10.96.0.300"}),
        'spec.clusterIP: "10.96.0.300" must be a valid IP address',
    ),
    (
        "clusterIPs text",
        svc({"clusterIP": "fd00::1", "clusterIPs": ["fd00::1", "10.96.0.256"]}),
        'spec.clusterIPs[1]: "10.96.0.256" must be a valid IP address',
    ),
    (
        "clusterIP not a string",
        svc({"clusterIP": 167772170}),
        "spec.clusterIP: must be a string, not 167772170",
    ),
    (
        "clusterIPs[0] differs",
        svc({"clusterIPs": ["10.96.0.11"]}),
        'spec.clusterIPs: first value "10.96.0.11" must match spec.clusterIP "10.96.0.10"',
    ),
    (
        "clusterIPs[0] differs only in text",
        svc({"clusterIPs": ["10.96.0.010"]}),
        'spec.clusterIPs: first value "10.96.0.010" must match',
    ),
    (
        "clusterIPs alone",
        svc({"clusterIP": None, "clusterIPs": ["10.96.0.10"]}),
        "spec.clusterIPs: must be empty when",
    ),
    (
        "three clusterIPs",
        svc({"clusterIPs": ["10.96.0.10", "fd00::10", "10.96.0.11"]}),
        "spec.clusterIPs: may only hold up to 2 values",
    ),
    (
        "two IPv4",
        svc({"clusterIPs": ["10.96.0.10", "10.96.0.11"]}),
        "spec.clusterIPs: may specify no more than one",
    ),
    (
        "None second",
        svc({"clusterIPs": ["10.96.0.10", "None"]}),
        "spec.clusterIPs[1]: 'None' (headless) must be the first and only value",
    ),
    ("family mismatch", svc({"ipFamilies": ["IPv6"]}), "spec.clusterIPs[0]: expected an IPv6 value"),
    ("family unknown", svc({"ipFamilies": ["IPv5"]}), 'spec.ipFamilies[0]: "IPv5" is not supported'),
    ("family twice", svc({"ipFamilies": ["IPv4", "IPv4"]}), "spec.ipFamilies: may hold each family once"),
    ("family policy", svc({"ipFamilyPolicy": "Dual"}), 'spec.ipFamilyPolicy: "Dual" is not supported'),
    (
        "headless NodePort",
        svc({**NODEPORT, "clusterIP": "None"}),
        "spec.clusterIPs[0]: may not be set to 'None' for",
    ),
    # ExternalName
    (
        "ExternalName with clusterIP",
        svc({"type": "ExternalName", "externalName": "example.com"}),
        "spec.clusterIP: may not be set for ExternalName services",
    ),
    (
        "ExternalName without name",
        svc({"type": "ExternalName", "clusterIP": None}),
        "spec.externalName: is required",
    ),
    (
        "ExternalName bad name",
        svc({"type": "ExternalName", "clusterIP": None, "externalName": "a b"}),
        'spec.externalName: "a b" is not valid',
    ),
    # external IPs (IsValidIP + ValidateNonSpecialIP)
    (
        "externalIP text",
        svc({"externalIPs": ["1.2.3"]}),
        'spec.externalIPs[0]: "1.2.3" must be a valid IP address',
    ),
    (
        "externalIP loopback",
        svc({"externalIPs": ["127.0.0.1"]}),
        'spec.externalIPs[0]: "127.0.0.1" may not be in the',
    ),
    ("externalIP unspecified", svc({"externalIPs": ["0.0.0.0"]}), "spec.externalIPs[0]: "),
    ("externalIP link-local", svc({"externalIPs": ["169.254.1.1"]}), "spec.externalIPs[0]: "),
    ("externalIPs not a list", svc({"externalIPs": "1.2.3.4"}), "spec.externalIPs: must be a list"),
    # traffic policies, health check node port
    (
        "ETP on ClusterIP",
        svc({"externalTrafficPolicy": "Cluster"}),
        "spec.externalTrafficPolicy: may only be set for",
    ),
    (
        "ETP unknown",
        svc({**NODEPORT, "externalTrafficPolicy": "Foo"}),
        'spec.externalTrafficPolicy: "Foo" is not',
    ),
    (
        "HCNP too big",
        svc({**LB_LOCAL, "healthCheckNodePort": 70000}),
        "spec.healthCheckNodePort: 70000 is out of range",
    ),
    (
        "ITP unknown",
        svc({"internalTrafficPolicy": "Node"}),
        'spec.internalTrafficPolicy: "Node" is not supported',
    ),
    # load balancer source ranges and status
    (
        "source ranges on NodePort",
        svc({**NODEPORT, "loadBalancerSourceRanges": ["10.0.0.0/8"]}),
        "spec.loadBalancerSourceRanges: may only be used when spec.type is LoadBalancer",
    ),
    (
        "source range text",
        svc({"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.1"]}),
        'spec.loadBalancerSourceRanges[0]: "10.0.0.1" must be a valid CIDR',
    ),
    (
        "ingress ip",
        svc({"type": "LoadBalancer"}, status={"loadBalancer": {"ingress": [{"ip": "lb"}]}}),
        'status.loadBalancer.ingress[0].ip: "lb" must be a valid IP address',
    ),
    (
        "ingress ipMode",
        svc(
            {"type": "LoadBalancer"},
            status={"loadBalancer": {"ingress": [{"ip": "1.2.3.4", "ipMode": "Direct"}]}},
        ),
        'status.loadBalancer.ingress[0].ipMode: "Direct" is not supported: must be one of VIP, Proxy',
    ),
    (
        "ingress ipMode without ip",
        svc(
            {"type": "LoadBalancer"},
            status={"loadBalancer": {"ingress": [{"hostname": "a.b", "ipMode": "VIP"}]}},
        ),
        "status.loadBalancer.ingress[0].ip: must be specified when ipMode is set",
    ),
    (
        "ingress hostname is an IP",
        svc({"type": "LoadBalancer"}, status={"loadBalancer": {"ingress": [{"hostname": "1.2.3.4"}]}}),
        'status.loadBalancer.ingress[0].hostname: "1.2.3.4" must be a DNS name',
    ),
    (
        "ingress not a list",
        svc({"type": "LoadBalancer"}, status={"loadBalancer": {"ingress": {"ip": "1.2.3.4"}}}),
        "status.loadBalancer.ingress: must be a list",
    ),
    ("status not a map", svc(status=[]), "status: must be a map, not a list of 0 items"),
]


@pytest.mark.parametrize(("obj", "message"), [(o, m) for _, o, m in REFUSED], ids=[i for i, _, _ in REFUSED])
def test_refused_like_the_api_server(obj: dict[str, Any], message: str) -> None:
    r = build_state([obj], [], NODE)
    assert r.state.services == {}
    (problem,) = r.problems
    assert problem.reason.startswith(message), problem.reason


def ports_of(obj: dict[str, Any]) -> list[ServicePort]:
    r = build_state([obj], [], NODE)
    assert r.problems == (), r.problems
    return list(r.state.services.values())


def test_leading_zeros_are_read_as_decimal_and_printed_canonically() -> None:
    (sp,) = ports_of(
        svc(
            {
                "type": "LoadBalancer",
                "clusterIP": "010.096.000.010",
                "externalIPs": ["203.0.113.007"],
                "loadBalancerSourceRanges": [" 198.051.100.000/024 "],
            },
            status={"loadBalancer": {"ingress": [{"ip": "203.0.113.010"}]}},
        )
    )
    assert sp.cluster_ip == "10.96.0.10"
    assert sp.external_ips == ("203.0.113.7",)
    assert sp.load_balancer_ips == ("203.0.113.10",)
    assert sp.load_balancer_source_ranges == ("198.51.100.0/24",)


def test_source_range_host_bits_are_dropped_and_duplicates_kept_once() -> None:
    (sp,) = ports_of(svc({"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.1.2.3/8", "10.0.0.0/8"]}))
    assert sp.load_balancer_source_ranges == ("10.0.0.0/8",)


def test_the_ipv4_cluster_ip_of_a_dual_stack_service_is_programmed() -> None:
    (sp,) = ports_of(svc({"clusterIP": "fd00::10", "clusterIPs": ["fd00::10", "10.96.0.10"]}))
    assert sp.cluster_ip == "10.96.0.10"


def test_an_ipv6_only_service_is_ignored_by_the_ipv4_state_not_reported() -> None:
    obj = svc({"clusterIP": "fd00::10", "externalIPs": ["fd00::20"]})
    assert build_state([obj], [], NODE).problems == ()
    assert build_state([obj], [], NODE).state.services == {}
    assert should_skip_service(obj) == "no IPv4 cluster IP (the IPv4 proxier ignores it)"
    assert should_skip_service(obj, IPFamily.IPv6) is None


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        (svc({"clusterIP": "None"}), "headless (clusterIP None)"),
        (svc({"clusterIP": "None", "ports": None}), "headless (clusterIP None)"),
        (svc({"clusterIP": None}), "no cluster IP allocated"),
        (
            svc({"type": "ExternalName", "clusterIP": None, "externalName": "db.example.com."}),
            "type ExternalName",
        ),
        (
            svc(meta={"labels": {"service.kubernetes.io/service-proxy-name": "x"}}),
            "labelled service.kubernetes.io/",
        ),
    ],
    ids=[
        "headless",
        "headless-no-ports",
        "no-cluster-ip",
        "external-name",
        "proxy-name-label",
    ],
)
def test_ignored_as_kube_proxy_ignores_it(obj: dict[str, Any], reason: str) -> None:
    got = should_skip_service(obj)
    assert got is not None and got.startswith(reason)
    assert parse_service(obj) == []
    assert build_state([obj], [], NODE).problems == ()


def test_a_labelled_away_service_is_never_validated_as_its_informer_never_receives_it() -> None:
    obj = svc({"ports": "bogus"}, meta={"labels": {"service.kubernetes.io/service-proxy-name": "other"}})
    assert build_state([obj], [], NODE).problems == ()


def test_proxy_mode_ingress_skips_that_ip_only() -> None:
    ingress = [
        {"ip": "203.0.113.9"},
        {"ip": "203.0.113.10", "ipMode": "Proxy"},
        {"ip": "203.0.113.11", "ipMode": "VIP"},
    ]
    (sp,) = ports_of(svc({"type": "LoadBalancer"}, status={"loadBalancer": {"ingress": ingress}}))
    assert sp.load_balancer_ips == ("203.0.113.9", "203.0.113.11")


def test_ingress_on_a_service_that_is_not_a_load_balancer_is_not_programmed() -> None:
    (sp,) = ports_of(svc(NODEPORT, status={"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}))
    assert sp.load_balancer_ips == ()


def test_etp_local_on_a_cluster_ip_with_external_ips() -> None:
    (sp,) = ports_of(svc({"externalIPs": ["203.0.113.7"], "externalTrafficPolicy": "Local"}))
    assert sp.external_policy_local


def test_etp_applies_through_external_ips_of_either_family() -> None:
    # apiservice.ExternallyAccessible counts every external IP; only IPv4 ones are programmed.
    (sp,) = ports_of(svc({"externalIPs": ["fd00::7"], "externalTrafficPolicy": "Local"}))
    assert sp.external_ips == () and sp.external_policy_local and not sp.uses_local_endpoints


def test_defaults_the_api_server_would_fill_in() -> None:
    (sp,) = ports_of(
        svc({"ports": [{"port": 80}], "sessionAffinity": "ClientIP", "sessionAffinityConfig": {}})
    )
    assert sp.name == ServicePortName("default", "web", "", Protocol.TCP)
    assert sp.affinity_timeout == 10800
    assert not sp.external_policy_local and not sp.internal_policy_local


def test_unallocated_node_ports_and_health_check_port_are_zero() -> None:
    (sp,) = ports_of(svc({**LB_LOCAL, "healthCheckNodePort": None, "ports": [HTTP]}))
    assert sp.node_port == 0 and sp.health_check_node_port == 0 and sp.external_policy_local


@pytest.mark.parametrize("target", [8080, "web", 0, "", None])
def test_target_ports_the_api_server_accepts(target: object) -> None:
    ports_of(svc({"ports": [{**HTTP, "targetPort": target}]}))


def test_duplicate_external_ips_are_programmed_once() -> None:
    (sp,) = ports_of(svc({"externalIPs": ["203.0.113.7", "203.0.113.007"]}))
    assert sp.external_ips == ("203.0.113.7",)


def test_a_service_name_of_63_characters_is_valid() -> None:
    (sp,) = ports_of(svc(meta={"name": "a" * 63}))
    assert sp.name.name == "a" * 63


@pytest.mark.parametrize(
    "spec",
    [{**NODEPORT, "healthCheckNodePort": 31000}, {**LB_LOCAL, "externalTrafficPolicy": "Cluster"}],
    ids=["on NodePort", "with ETP Cluster"],
)
def test_a_health_check_node_port_nothing_needs_is_ignored_as_kube_proxy_ignores_it(
    spec: dict[str, Any],
) -> None:
    """The API server refuses it; kube-proxy ignores it (its own proxier tests carry one)."""
    ports = parse_service(svc(spec))
    assert ports and all(p.health_check_node_port == 0 for p in ports)
