"""IPv6 and dual-stack Services in iptables mode, with real TCP through a dual-stack lab.

kube-proxy's behaviours ("should be able to reach pod on ipv4 and ipv6 ip", "should function for
pod-Service: http" on an IPv6 / dual-stack cluster, test/e2e/network/dual_stack.go): an IPv6-only
ClusterIP from a pod and its NodePort from the external client, both over IPv6 (curl -6); a
dual-stack Service answering on both ClusterIPs, each family reaching its own slice's endpoints.
iptables mode only: eBPF mode programs IPv4 only for now (README, "IPv6 and dual-stack"); the
agent's IPv6 proxier writes ip6tables rules with the backend of its IPv4 rules, and `--cleanup`
removes them.

The lab (`Lab(ipv6=True)`) puts ULA addresses beside IPv4 on every link, `nodad`; the agents get
an IPv6 --node-ip and an IPv6 pod CIDR (lab/harness.py), which turns their IPv6 proxier on. The
pods' IPv6 HTTP server answers `/` with the pod's name and `/ip` with the client's address.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from lab import Lab
from lab.harness import Cluster
from lab.objects import Ep, Port, endpoint_slice, service
from tests.conftest import require_kernel

HTTP6_PORT = 8086
SERVER6 = r"""
import http.server, socket, sys

class Server(http.server.HTTPServer):
    address_family = socket.AF_INET6

    def server_bind(self):
        # IPv6 only (the lab's IPv4 podserver owns IPv4); no getfqdn, a DNS lookup in a namespace
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(self.server_address)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (sys.argv[1] if self.path == "/" else self.client_address[0]) + "\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass

server = Server(("::", int(sys.argv[2])), Handler)
print("ready", flush=True)
server.serve_forever()
"""

V6_VIP = "fd00:10:96::86"
DUAL_V4, DUAL_V6 = "10.96.86.1", "fd00:10:96::87"
NODE_PORT = 30686
PODS = ("pod-1-2", "pod-2-2")  # the IPv6 backends, one per node
TRIES = 40  # each try reaches a given one of two backends with p = 1/2: all 40 missing it, 1e-12


@pytest.fixture(scope="module")
def dual() -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=2, pods_per_node=2, ipv6=True) as lab:
        lab.start_podservers()
        for name in PODS:
            proc = lab.popen(
                lab.pod(name), sys.executable, "-c", SERVER6, name, str(HTTP6_PORT), name="http6"
            )
            lab.wait_log(proc, "ready")
        c = Cluster(lab, "iptables")
        c.start()
        try:
            yield c
        finally:
            failures = c.stop()
            leftover = {
                n.name: out
                for n in lab.nodes
                for out in [lab.run(n, "ip6tables-save").stdout + lab.run(n, "iptables-save").stdout]
                if "KUBE-SERVICES" in out
            }
        assert not failures, f"agent --cleanup failed: {failures}"
        assert not leftover, f"chains left after --cleanup: {leftover}"


def v6_objects(lab: Lab) -> list[dict[str, object]]:
    port = Port("http", 80, HTTP6_PORT, node_port=NODE_PORT)
    only6 = service("web6", V6_VIP, [port], type="NodePort", ipFamilies=["IPv6"])
    dual_port = Port("http", 80, 8080)
    both = service(
        "dual",
        DUAL_V4,
        [dual_port],
        clusterIPs=[DUAL_V4, DUAL_V6],
        ipFamilies=["IPv4", "IPv6"],
        ipFamilyPolicy="RequireDualStack",
    )
    eps6 = [Ep(lab.pod(p).ip6, f"node{lab.pod(p).node}") for p in PODS]
    slice6 = endpoint_slice("web6", [port], eps6, suffix="v6")
    slice6["addressType"] = "IPv6"
    # The dual-stack Service: IPv4 endpoints pod-1-1 (the podserver on 8080), IPv6 endpoints the
    # IPv6 servers (8080 over IPv6 is not served: the IPv6 slice names HTTP6_PORT).
    dual4 = endpoint_slice("dual", [dual_port], [Ep(lab.pod("pod-1-1").ip, "node1")], suffix="v4")
    dual6 = endpoint_slice("dual", [Port("http", 80, HTTP6_PORT)], eps6, suffix="v6")
    dual6["addressType"] = "IPv6"
    return [only6, slice6, both, dual4, dual6]


def fetch(cluster: Cluster, target: object, url: str) -> str:
    return cluster.lab.curl(target, url, timeout=3.0, args=["-g"]).strip()  # type: ignore[arg-type]


def test_an_ipv6_cluster_ip_reaches_every_ipv6_endpoint_from_a_pod(dual: Cluster) -> None:
    """A pod reaches an IPv6-only ClusterIP over IPv6 and is balanced over both nodes' pods."""
    dual.apply(v6_objects(dual.lab))
    seen = {fetch(dual, dual.lab.pod("pod-1-1"), f"http://[{V6_VIP}]:80/") for _ in range(TRIES)}
    assert seen == set(PODS)
    rules = dual.lab.run(dual.lab.node(1), "ip6tables-save", "-t", "nat").stdout
    assert f"-d {V6_VIP}/128" in rules and "KUBE-SVC-" in rules
    assert V6_VIP not in dual.lab.run(dual.lab.node(1), "iptables-save", "-t", "nat").stdout


def test_an_ipv6_node_port_answers_the_external_client_on_each_node(dual: Cluster) -> None:
    """NodePort over IPv6 from outside, on each node's IPv6 address, masqueraded (Cluster
    policy): the backend sees a node address, not the client's."""
    dual.apply(v6_objects(dual.lab))
    client = dual.lab.client
    for node in dual.lab.nodes:
        url = f"http://[{node.ip6}]:{NODE_PORT}"
        seen = {fetch(dual, client, f"{url}/") for _ in range(TRIES)}
        assert seen == set(PODS), node.name
        source = fetch(dual, client, f"{url}/ip")
        assert source != client.ip6 and source.startswith("fd00:"), source


def test_a_dual_stack_service_answers_on_both_cluster_ips_each_from_its_own_family(dual: Cluster) -> None:
    dual.apply(v6_objects(dual.lab))
    pod = dual.lab.pod("pod-2-1")
    assert fetch(dual, pod, f"http://{DUAL_V4}:80/") == "pod-1-1"
    seen = {fetch(dual, pod, f"http://[{DUAL_V6}]:80/") for _ in range(TRIES)}
    assert seen == set(PODS)
