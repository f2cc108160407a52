"""The renderer's behaviours one at a time, beyond what the golden files pin."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cli import resolve
from agent.config import NodeContext
from agent.iptables import chains
from agent.iptables.rules import RenderOptions, categorized, masquerade_mark, render
from agent.localdetect import LocalDetector
from agent.model.types import Protocol, ServicePortName
from tests.iptables.objects import CONFIG, NODE, endpoints, service, state

OPTS = RenderOptions.from_config(CONFIG)
TCP80 = [("http", 80, "TCP")]


def lines(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def svc_chain(name: str, port: str = "http", proto: Protocol = Protocol.TCP) -> str:
    return chains.service_chain(ServicePortName("ns", name, port, proto))


def test_probabilities_are_upstreams_and_the_last_jump_is_unconditional() -> None:
    s = state(
        service("a", "10.96.0.5", ("http", 80, "TCP")),
        endpoints("a", TCP80, *[f"10.244.2.{i}" for i in range(1, 5)]),
    )
    jumps = lines(render(s, NODE, OPTS).text, f'-A {svc_chain("a")} -m comment --comment "ns/a:http -> ')
    assert [
        re.search(r"--probability (\S+)", j).group(1) if "--probability" in j else None  # type: ignore[union-attr]
        for j in jumps
    ] == [
        "0.2500000000",
        "0.3333333333",
        "0.5000000000",
        None,
    ]


def test_endpoint_comments_dropped_above_1000_endpoints() -> None:
    eps = [f"10.244.{i // 250}.{i % 250 + 1}" for i in range(1001)]
    # The API server allows at most 1000 endpoints in one EndpointSlice: two slices.
    second = endpoints("big", TCP80, *eps[1000:])
    second["metadata"]["name"] = "big-2"
    s = state(service("big", "10.96.0.6", ("http", 80, "TCP")), endpoints("big", TCP80, *eps[:1000]), second)
    r = render(s, NODE, OPTS)
    assert r.large_cluster
    sep_rules = [line for line in r.text.splitlines() if line.startswith("-A KUBE-SEP-")]
    assert len(sep_rules) == 2002
    assert not any("--comment" in line for line in sep_rules)
    assert not any("--comment" in line for line in lines(r.text, f"-A {svc_chain('big')} -m statistic"))
    # Service-level comments stay.
    assert lines(r.text, '"ns/big:http cluster IP"')


def test_endpoint_comments_kept_at_exactly_1000_endpoints() -> None:
    eps = [f"10.244.{i // 250}.{i % 250 + 1}" for i in range(1000)]
    s = state(service("big", "10.96.0.6", ("http", 80, "TCP")), endpoints("big", TCP80, *eps))
    r = render(s, NODE, OPTS)
    assert not r.large_cluster
    assert all(
        "--comment ns/big:http" in line for line in r.text.splitlines() if line.startswith("-A KUBE-SEP-")
    )


def test_without_cluster_cidr_no_off_cluster_masquerade_and_no_pod_short_circuit() -> None:
    s = state(
        service(
            "a",
            "10.96.0.5",
            ("http", 80, "TCP"),
            type="NodePort",
            node_port=30001,
            externalTrafficPolicy="Local",
        ),
        endpoints("a", TCP80, ("10.244.1.5", "node1")),
    )
    text = render(s, NODE, replace(OPTS, local=LocalDetector())).text
    assert "! -s 10.244.0.0/16" not in text
    assert "pod traffic for" not in text
    assert lines(text, "route LOCAL traffic for ns/a:http")
    with_cidr = render(s, NODE, OPTS).text
    assert lines(with_cidr, "! -s 10.244.0.0/16 -j KUBE-MARK-MASQ")
    assert lines(with_cidr, "pod traffic for ns/a:http external destinations")


@pytest.mark.parametrize(
    ("flags", "if_local"),
    [
        (["--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix=veth"], "-i veth+"),
        (["--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cbr0"], "-i cbr0"),
        (["--detect-local-mode=ClusterCIDR", "--cluster-cidr=10.244.0.0/16,fd00::/48"], "-s 10.244.0.0/16"),
        (["--detect-local-mode=NodeCIDR", "--cluster-cidr=10.0.0.0/8"], "-s 10.244.1.0/24"),
    ],
)
def test_the_local_traffic_detector_writes_upstreams_matches(flags: list[str], if_local: str) -> None:
    # pkg/proxy/util/localdetector.go: IfNotLocal on the cluster IP's masquerade, IfLocal on the
    # pod short-circuit of an ETP Local service's external chain.
    s = state(
        service(
            "a",
            "10.96.0.5",
            ("http", 80, "TCP"),
            type="NodePort",
            node_port=30001,
            externalTrafficPolicy="Local",
        ),
        endpoints("a", TCP80, ("10.244.1.5", "node1")),
    )
    node = replace(s.node, pod_cidrs=("fd00:1::/64", "10.244.1.0/24"))
    s = replace(s, node=node)
    config = resolve(["--mode=iptables", *flags]).config
    text = render(s, NODE, RenderOptions.from_config(config, node_pod_cidrs=node.pod_cidrs)).text
    assert lines(text, f'-A {svc_chain("a")} -m comment --comment "ns/a:http cluster IP"') == [
        f'-A {svc_chain("a")} -m comment --comment "ns/a:http cluster IP" -m tcp -p tcp -d 10.96.0.5 '
        f"--dport 80 ! {if_local} -j KUBE-MARK-MASQ"
    ]
    ext = f"KUBE-EXT-{svc_chain('a').removeprefix('KUBE-SVC-')}"
    assert lines(text, "pod traffic for ns/a:http external destinations") == [
        f'-A {ext} -m comment --comment "pod traffic for ns/a:http external destinations" '
        f"{if_local} -j {svc_chain('a')}"
    ]


def test_node_cidr_without_a_pod_cidr_on_the_node_is_no_detector() -> None:
    s = state(service("a", "10.96.0.5", ("http", 80, "TCP")), endpoints("a", TCP80, "10.244.2.5"))
    config = resolve(["--mode=iptables", "--detect-local-mode=NodeCIDR", "--cluster-cidr=10.0.0.0/8"]).config
    text = render(s, NODE, RenderOptions.from_config(config)).text
    assert "KUBE-MARK-MASQ" in text  # the chain exists: only the detector's rule is missing
    assert not lines(text, "-d 10.96.0.5 --dport 80 ! -s")


def test_masquerade_all_marks_every_cluster_ip_packet() -> None:
    s = state(service("a", "10.96.0.5", ("http", 80, "TCP")), endpoints("a", TCP80, "10.244.2.5"))
    text = render(s, NODE, replace(OPTS, masquerade_all=True)).text
    assert lines(text, f'-A {svc_chain("a")} -m comment --comment "ns/a:http cluster IP"') == [
        f'-A {svc_chain("a")} -m comment --comment "ns/a:http cluster IP" -m tcp -p tcp -d 10.96.0.5 '
        "--dport 80 -j KUBE-MARK-MASQ"
    ]


def test_host_facts_change_masquerade_and_invalid_drop() -> None:
    s = state()
    text = render(s, NODE, replace(OPTS, random_fully=False, conntrack_tcp_liberal=True)).text
    assert lines(text, "-j MASQUERADE") == [
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE'
    ]
    assert "INVALID" not in text
    default = render(s, NODE, OPTS).text
    assert lines(default, "-j MASQUERADE")[0].endswith("-j MASQUERADE --random-fully")
    assert "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP" in default.splitlines()


def test_masquerade_mark_is_spelled_like_go_percent_hash_08x() -> None:
    assert masquerade_mark(14) == "0x00004000"
    assert masquerade_mark(0) == "0x00000001"
    text = render(state(), NODE, RenderOptions.from_config(replace(CONFIG, masquerade_bit=16))).text
    assert "-A KUBE-MARK-MASQ -j MARK --or-mark 0x00010000" in text.splitlines()
    assert "-A KUBE-POSTROUTING -m mark ! --mark 0x00010000/0x00010000 -j RETURN" in text.splitlines()


def test_localhost_nodeports_off_blocks_loopback_in_the_tail_rule_and_drops_kube_firewall() -> None:
    text = render(state(), NODE, replace(OPTS, localhost_nodeports=False)).text
    assert "KUBE-FIREWALL" not in text
    assert lines(text, "NOTE: this must be the last rule")[0].endswith(
        "-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS"
    )


def test_nodeport_addresses_without_loopback_disable_localhost_nodeports() -> None:
    node = NodeContext(node_ips=("192.168.0.11", "10.0.2.15"), primary_ip="192.168.0.11")
    opts = RenderOptions.from_config(replace(CONFIG, nodeport_addresses=("10.0.0.0/8",)))
    assert not opts.localhost_nodeports_enabled
    text = render(state(), node, opts).text
    assert "KUBE-FIREWALL" not in text
    assert lines(text, "NOTE: this must be the last rule") == [
        '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last '
        'rule in this chain" -d 10.0.2.15 -j KUBE-NODEPORTS'
    ]


def test_nodeport_tail_rule_is_the_last_nat_rule() -> None:
    s = state(
        service("a", "10.96.0.5", ("http", 80, "TCP"), type="NodePort", node_port=30002),
        endpoints("a", TCP80, "10.244.2.5"),
    )
    nat = render(s, NODE, OPTS).text.split("*nat\n", 1)[1].splitlines()
    assert nat[-2].startswith('-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports;')
    assert nat[-1] == "COMMIT"


def test_udp_and_sctp_use_their_match_modules() -> None:
    s = state(
        service("d", "10.96.0.10", ("dns", 53, "UDP"), ("s", 36412, "SCTP")),
        endpoints("d", [("dns", 53, "UDP"), ("s", 36412, "SCTP")], "10.244.2.2"),
    )
    text = render(s, NODE, OPTS).text
    assert lines(text, '"ns/d:dns cluster IP" -m udp -p udp -d 10.96.0.10 --dport 53 -j KUBE-SVC-')
    assert lines(text, '"ns/d:s cluster IP" -m sctp -p sctp -d 10.96.0.10 --dport 36412 -j KUBE-SVC-')
    assert lines(text, "-m udp -p udp -j DNAT --to-destination 10.244.2.2:53")


def test_source_ranges_are_normalised_like_go_ipnet() -> None:
    s = state(
        service(
            "lb",
            "10.96.0.7",
            ("http", 80, "TCP"),
            type="LoadBalancer",
            loadBalancerSourceRanges=[" 10.1.2.3/16 "],
        )
        | {"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.9"}]}}},
        endpoints("lb", TCP80, "10.244.2.5"),
    )
    fw = chains.firewall_chain(ServicePortName("ns", "lb", "http", Protocol.TCP))
    ext = chains.external_chain(ServicePortName("ns", "lb", "http", Protocol.TCP))
    assert lines(render(s, NODE, OPTS).text, f"-A {fw} ") == [
        f'-A {fw} -m comment --comment "ns/lb:http loadbalancer IP" -s 10.1.0.0/16 -j {ext}',
        f'-A {fw} -m comment --comment "other traffic to ns/lb:http will be dropped by KUBE-PROXY-FIREWALL"',
    ]


def test_load_balancer_without_endpoints_rejects_and_has_no_firewall_chain() -> None:
    s = state(
        service(
            "lb",
            "10.96.0.7",
            ("http", 80, "TCP"),
            type="LoadBalancer",
            loadBalancerSourceRanges=["10.0.0.0/8"],
            externalTrafficPolicy="Local",
            healthCheckNodePort=32000,
        )
        | {"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.9"}]}}},
    )
    text = render(s, NODE, OPTS).text
    assert "KUBE-FW-" not in text
    assert "KUBE-PROXY-FIREWALL -m" not in text
    assert lines(text, '"ns/lb:http has no endpoints" -m tcp -p tcp -d 198.51.100.9 --dport 80 -j REJECT')
    # The health-check port is accepted whether or not there are endpoints.
    assert lines(text, '"ns/lb:http health check node port" -m tcp -p tcp --dport 32000 -j ACCEPT')


def test_partial_render_writes_only_changed_services_chains() -> None:
    s = state(
        service("a", "10.96.0.5", ("http", 80, "TCP")),
        endpoints("a", TCP80, "10.244.2.5"),
        service("b", "10.96.0.6", ("http", 80, "TCP")),
        endpoints("b", TCP80, "10.244.2.6"),
    )
    full = render(s, NODE, OPTS)
    part = render(s, NODE, OPTS, changed={"ns/b"})
    assert f":{svc_chain('a')} - [0:0]" not in part.text
    assert f":{svc_chain('b')} - [0:0]" in part.text
    # KUBE-SERVICES is rewritten whole: it still jumps to a's (kept) chain.
    assert lines(part.text, f"--dport 80 -j {svc_chain('a')}")
    assert part.written_services == frozenset({"ns/b"})
    assert part.active_nat_chains == full.active_nat_chains
    assert part.rule_count == full.rule_count
    assert part.nat_rules < full.nat_rules


def test_stale_service_chains_are_deleted_and_foreign_chains_kept() -> None:
    s = state(service("a", "10.96.0.5", ("http", 80, "TCP")), endpoints("a", TCP80, "10.244.2.5"))
    stale = "KUBE-SVC-AAAAAAAAAAAAAAAA"
    existing = {
        svc_chain("a"),
        stale,
        "KUBE-SEP-BBBBBBBBBBBBBBBB",
        "DOCKER",
        "KUBE-KUBELET-CANARY",
        "KUBE-SERVICES",
    }
    r = render(s, NODE, OPTS, existing_nat_chains=existing)
    assert r.deleted_chains == ("KUBE-SEP-BBBBBBBBBBBBBBBB", stale)
    nat = r.text.split("*nat\n", 1)[1].splitlines()
    assert f":{stale} - [0:0]" in nat
    assert nat.index(f"-X {stale}") < next(
        i for i, line in enumerate(nat) if "NOTE: this must be the last" in line
    )
    assert "-X DOCKER" not in nat
    assert "-X KUBE-KUBELET-CANARY" not in nat
    assert f"-X {svc_chain('a')}" not in nat


def test_categorized_gives_cluster_endpoints_when_both_policies_are_local() -> None:
    s = state(
        service(
            "c",
            "10.96.0.8",
            ("redis", 6379, "TCP"),
            type="NodePort",
            node_port=31379,
            externalTrafficPolicy="Local",
            internalTrafficPolicy="Local",
        ),
        endpoints("c", [("redis", 6379, "TCP")], ("10.244.1.8", "node1"), ("10.244.2.8", "node2")),
    )
    sp = next(iter(s.services.values()))
    eps = categorized(s, sp)
    assert [str(e) for e in eps.cluster] == ["10.244.1.8:6379", "10.244.2.8:6379"]
    assert [str(e) for e in eps.local] == ["10.244.1.8:6379"]


# --------------------------------------------------------------------------- structural invariants

_ports = st.sampled_from([("http", 80, "TCP"), ("dns", 53, "UDP"), ("sig", 36412, "SCTP")])
_endpoint = st.tuples(
    st.integers(1, 6),
    st.sampled_from(["node1", "node2"]),
    st.fixed_dictionaries({"ready": st.booleans(), "serving": st.booleans(), "terminating": st.booleans()}),
)


@st.composite
def _service_objects(draw: st.DrawFn, index: int) -> list[dict[str, object]]:
    name = f"s{index}"
    port = draw(_ports)
    kind = draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"]))
    spec: dict[str, Any] = {"type": kind}
    if kind != "ClusterIP":
        spec["externalTrafficPolicy"] = draw(st.sampled_from(["Cluster", "Local"]))
        spec["ports"] = [{"name": port[0], "port": port[1], "protocol": port[2], "nodePort": 30000 + index}]
    if draw(st.booleans()):
        spec["internalTrafficPolicy"] = "Local"
    if draw(st.booleans()):
        spec["externalIPs"] = [f"192.168.0.{200 + index}"]
    if draw(st.booleans()):
        spec["sessionAffinity"] = "ClientIP"
    obj = service(name, f"10.96.1.{index + 1}", port, **spec)
    if kind == "LoadBalancer":
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": f"198.51.100.{index + 1}"}]}}
        if draw(st.booleans()):
            obj["spec"]["loadBalancerSourceRanges"] = ["203.0.113.0/25", "192.168.0.0/24"]
    eps = draw(st.lists(_endpoint, max_size=4, unique_by=lambda e: e[0]))
    if not eps and draw(st.booleans()):
        return [obj]
    addresses = [(f"10.244.{1 if n == 'node1' else 2}.{10 * index + i}", n, c) for i, n, c in eps]
    return [obj, endpoints(name, [port], *addresses)]


@st.composite
def _states(draw: st.DrawFn) -> list[dict[str, object]]:
    n = draw(st.integers(0, 4))
    objs: list[dict[str, object]] = []
    for i in range(n):
        objs += draw(_service_objects(i))
    return objs


@settings(max_examples=150, deadline=None)
@given(_states(), st.booleans())
def test_every_jump_target_is_declared_and_no_chain_twice(
    objs: list[dict[str, object]], masq_all: bool
) -> None:
    text = render(state(*objs), NODE, replace(OPTS, masquerade_all=masq_all)).text
    for table in text.split("COMMIT\n")[:2]:
        declared = [line[1:].split()[0] for line in table.splitlines() if line.startswith(":")]
        assert len(declared) == len(set(declared))
        for line in table.splitlines():
            m = re.search(r" -j (KUBE-\S+)", line)
            if m:
                assert m.group(1) in declared, line
            if line.startswith("-A "):
                assert line.split()[1] in declared, line


def test_nfacct_counters_are_matched_only_when_the_proxier_created_them() -> None:
    s = state(
        service("a", "10.96.0.5", ("http", 80, "TCP"), type="NodePort", node_port=30005),
        endpoints("a", TCP80, "10.244.2.5"),
    )
    plain = render(s, NODE, OPTS).text
    assert "nfacct" not in plain
    counted = render(
        s, NODE, replace(OPTS, nfacct_invalid_dropped=True, nfacct_localhost_nodeports=True)
    ).text
    assert (
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID "
        "-m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP" in counted.splitlines()
    )
    ext = chains.external_chain(ServicePortName("ns", "a", "http", Protocol.TCP))
    assert lines(counted, "-A KUBE-NODEPORTS ") == [
        "-A KUBE-NODEPORTS -m comment --comment ns/a:http -m tcp -p tcp -d 127.0.0.0/8 --dport 30005 "
        f"-m nfacct --nfacct-name localhost_nps_accepted_pkts -j {ext}",
        f"-A KUBE-NODEPORTS -m comment --comment ns/a:http -m tcp -p tcp --dport 30005 -j {ext}",
    ]
    # No localhost NodePorts, no localhost counting rule.
    off = render(s, NODE, replace(OPTS, nfacct_localhost_nodeports=True, localhost_nodeports=False)).text
    assert "localhost_nps_accepted_pkts" not in off


def test_nodeport_addresses_of_the_other_family_or_zero_cidr_mean_every_address() -> None:
    for addresses in (("2001:db8::/64",), ("0.0.0.0/0", "192.168.0.0/24")):
        opts = RenderOptions.from_config(replace(CONFIG, nodeport_addresses=addresses))
        assert opts.nodeports_match_all, addresses
        assert lines(render(state(), NODE, opts).text, "NOTE: this must be the last rule")[0].endswith(
            "-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
        )


def test_ip6tables_masquerade_beside_the_tc_ipv6_path_keeps_out_of_the_bpf_snat_ports() -> None:
    """eBPF mode's ip6tables beside the tc programs' IPv6 path (Config.tc_ipv6), which masquerades
    TCP and UDP with ports of --bpf-snat-ports looking at its own conntrack only: their MASQUERADE
    --to-ports the larger side of 1024-65535 outside that range, so nf_nat (looking at
    nf_conntrack only) never takes a port the tc path may hand to another flow to the same
    backend, in either host routing. kube-proxy's rule everywhere else: IPv4, iptables mode, no
    socket-level load balancing (no tc IPv6 path)."""
    from agent.config import HostRouting, Mode
    from agent.iptables.rules import masquerade_ports_beside
    from agent.model.types import IPFamily

    assert masquerade_ports_beside((61000, 65535)) == (1024, 60999)
    assert masquerade_ports_beside((1024, 2047)) == (2048, 65535)
    assert masquerade_ports_beside((20000, 30000)) == (30001, 65535)
    assert masquerade_ports_beside((40000, 50000)) == (1024, 39999)
    assert masquerade_ports_beside((1024, 65535)) is None
    # Ports an earlier run's range left held by tc flows: the largest span meeting neither.
    assert masquerade_ports_beside((63000, 65535), (61500, 61500)) == (1024, 61499)
    assert masquerade_ports_beside((63000, 65535), (61000, 62500)) == (1024, 60999)
    assert masquerade_ports_beside((1024, 20000), (61000, 65535)) == (20001, 60999)
    assert masquerade_ports_beside((1024, 2047), (2048, 65535)) is None
    ebpf6 = replace(
        CONFIG,
        mode=Mode.EBPF,
        cluster_cidr=("10.244.0.0/16", "fd00:10:244::/56"),
        bpf_host_routing=HostRouting.BPF,
    )
    assert ebpf6.tc_ipv6

    def masquerade(config: Any, family: IPFamily) -> list[str]:
        options = RenderOptions.from_config(config, family=family)
        return lines(render(state(), NODE, options).text, "-j MASQUERADE")

    kube_proxys = (
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE'
    )
    tcp = kube_proxys.replace("-j MASQUERADE", "-p tcp -j MASQUERADE")
    udp = kube_proxys.replace("-j MASQUERADE", "-p udp -j MASQUERADE")
    # --to-ports needs a protocol with ports: TCP and UDP (what the tc path masquerades), then the rest
    assert masquerade(ebpf6, IPFamily.IPv6) == [
        tcp + " --to-ports 1024-60999 --random-fully",
        udp + " --to-ports 1024-60999 --random-fully",
        kube_proxys + " --random-fully",
    ]
    assert masquerade(replace(ebpf6, snat_ports=(40000, 50000)), IPFamily.IPv6)[0] == (
        tcp + " --to-ports 1024-39999 --random-fully"
    )
    assert masquerade(ebpf6, IPFamily.IPv4) == [kube_proxys + " --random-fully"]
    assert masquerade(replace(ebpf6, mode=Mode.IPTABLES), IPFamily.IPv6) == [kube_proxys + " --random-fully"]
    # either host routing: the tc IPv6 path masquerades under legacy routing too (bpf/ekp_host6.h)
    legacy = replace(ebpf6, bpf_host_routing=HostRouting.LEGACY)
    assert masquerade(legacy, IPFamily.IPv6) == masquerade(ebpf6, IPFamily.IPv6)
    assert masquerade(replace(legacy, socket_lb=False), IPFamily.IPv6) == [kube_proxys + " --random-fully"]


def test_ports_served_elsewhere_keep_their_health_check_accept_in_upstreams_place() -> None:
    """`ProxyState.elsewhere` (eBPF mode's IPv6 ports the eBPF programs serve): no rule of theirs
    but the filter table's health-check ACCEPT, in the order the whole state would put it."""
    from agent.metaproxier import only

    def lb(name: str, hc: int) -> dict[str, Any]:
        return service(
            name,
            f"10.96.0.{hc - 32000}",
            ("http", 80, "TCP"),
            type="LoadBalancer",
            externalTrafficPolicy="Local",
            healthCheckNodePort=hc,
        ) | {"status": {"loadBalancer": {"ingress": [{"ip": f"198.51.100.{hc - 32000}"}]}}}

    whole = state(lb("a", 32001), lb("b", 32002), lb("c", 32003))
    a, b, c = sorted(whole.services, key=str)
    thinned = only(whole, [a, c])
    assert set(thinned.elsewhere) == {b}

    def nodeports(text: str) -> list[str]:
        table = text.partition("*nat")[0]
        return [line for line in table.splitlines() if line.startswith("-A KUBE-NODEPORTS ")]

    full = nodeports(render(whole, NODE, OPTS).text)
    assert len(full) == 3 and "--dport 32002 -j ACCEPT" in full[1]
    text = render(thinned, NODE, OPTS).text
    assert nodeports(text) == full
    assert "ns/b:http" not in text.replace('"ns/b:http health check node port"', "")
