"""IPv6 and dual-stack Services in both modes, with real TCP through a dual-stack lab.

kube-proxy's behaviours ("should be able to reach pod on ipv4 and ipv6 ip", "should function for
pod-Service: http" on an IPv6 / dual-stack cluster, test/e2e/network/dual_stack.go): an IPv6-only
ClusterIP from a pod and its NodePort from the external client, both over IPv6 (curl -6); a
dual-stack Service answering on both ClusterIPs, each family reaching its own slice's endpoints;
the rest of dual_stack.go's "Granular Checks" on the IPv6 family (UDP from a pod, the node and an
endpoint pod; endpoint updates; ClientIP affinity) and externalTrafficPolicy: Local keeping the
IPv6 client's address; a dual-stack Local load balancer's healthCheckNodePort per family.
Every test runs in both modes (the `dual` fixture is parametrised by mode, as the `cluster` one).
The agent's IPv6 proxier writes ip6tables rules in both: in iptables mode with the backend of its
IPv4 rules; in eBPF mode beside the eBPF data path's IPv6 maps (README, "IPv6 and dual-stack"):
the socket programs translate the connections of the nodes' sockets and their pods' (the agents
run with the default, pods balanced at connect()) to IPv6 Services, and the tc programs' IPv6
path, under the default legacy host routing (the destination at tc ingress, the source at tc
egress, the node's stack between), the flows from outside and the pods' flows the socket
programs leave to the packet path (affinity); ip6tables every other IPv6 packet. `--cleanup` removes the
ip6tables rules in both modes (and the pins in eBPF mode).

The lab (`Lab(ipv6=True)`) puts ULA addresses beside IPv4 on every link, `nodad`; the agents get
an IPv6 --node-ip and an IPv6 pod CIDR (lab/harness.py), which turns their IPv6 proxier on. The
pods' IPv6 HTTP server answers `/` with the pod's name and `/ip` with the client's address.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab import Lab
from lab.harness import Cluster
from lab.objects import Ep, Port, endpoint_slice, service
from tests.conftest import require_kernel
from tests.traffic.conftest import MODES

HTTP6_PORT = 8086
SERVER6 = r"""
import http.server, socket, sys, threading

class Server(http.server.HTTPServer):
    address_family = socket.AF_INET6

    def server_bind(self):
        # IPv6 only (the lab's IPv4 podserver owns IPv4); no getfqdn, a DNS lookup in a namespace
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(self.server_address)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/echo?msg="):
            body = self.path[len("/echo?msg="):] + "\n"
        else:
            body = (sys.argv[1] if self.path == "/" else self.client_address[0]) + "\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass

def udp_echo(port):
    # IPv6 UDP on the same port: answers every datagram with the pod's name
    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind(("::", port))
    while True:
        data, peer = sock.recvfrom(65535)
        sock.sendto(sys.argv[1].encode() if data == b"who" else data, peer)

server = Server(("::", int(sys.argv[2])), Handler)
threading.Thread(target=udp_echo, args=(int(sys.argv[2]),), daemon=True).start()
print("ready", flush=True)
server.serve_forever()
"""

# Sends `count` datagrams to [addr]:port over IPv6, each from a fresh socket (a new flow), and
# prints the names that answered, one a line ("-" for a datagram lost after 1 s).
UDP6_CLIENT = r"""
import socket, sys
addr, port, count, same = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "same"
keep = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
for _ in range(count):
    s = keep if same else socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.settimeout(1.0)
    s.sendto(b"who", (addr, port))
    try:
        print(s.recv(2048).decode())
    except socket.timeout:
        print("-")
    if not same:
        s.close()
"""

V6_VIP = "fd00:10:96::86"
DUAL_V4, DUAL_V6 = "10.96.86.1", "fd00:10:96::87"
NODE_PORT = 30686
PODS = ("pod-1-2", "pod-2-2")  # the IPv6 backends, one per node
TRIES = 40  # each try reaches a given one of two backends with p = 1/2: all 40 missing it, 1e-12


@pytest.fixture(scope="module", params=MODES)
def dual(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=2, pods_per_node=2, ipv6=True) as lab:
        lab.start_podservers()
        for name in PODS:
            proc = lab.popen(
                lab.pod(name), sys.executable, "-c", SERVER6, name, str(HTTP6_PORT), name="http6"
            )
            lab.wait_log(proc, "ready")
        c = Cluster(lab, request.param)
        for agent in c.agents:
            agent.socket_lb_pods = None  # the agent's default: pods' sockets balanced at connect() too
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
            pins = [a.pin_path for a in c.agents if Path(a.pin_path).exists()]
        assert not failures, f"agent --cleanup failed: {failures}"
        assert not leftover, f"chains left after --cleanup: {leftover}"
        assert not pins, f"pins left after --cleanup: {pins}"


UDP_PORT, UDP_NODE_PORT = 53, 30688


def v6_objects(lab: Lab, backends: tuple[str, ...] = PODS) -> list[dict[str, object]]:
    port = Port("http", 80, HTTP6_PORT, node_port=NODE_PORT)
    udp = Port("dns", UDP_PORT, HTTP6_PORT, "UDP", node_port=UDP_NODE_PORT)
    only6 = service("web6", V6_VIP, [port, udp], type="NodePort", ipFamilies=["IPv6"])
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
    slice6 = endpoint_slice(
        "web6", [port, udp], [Ep(lab.pod(p).ip6, f"node{lab.pod(p).node}") for p in backends], suffix="v6"
    )
    slice6["addressType"] = "IPv6"
    # The dual-stack Service: IPv4 endpoints pod-1-1 (the podserver on 8080), IPv6 endpoints the
    # IPv6 servers (8080 over IPv6 is not served: the IPv6 slice names HTTP6_PORT).
    dual4 = endpoint_slice("dual", [dual_port], [Ep(lab.pod("pod-1-1").ip, "node1")], suffix="v4")
    dual6 = endpoint_slice("dual", [Port("http", 80, HTTP6_PORT)], eps6, suffix="v6")
    dual6["addressType"] = "IPv6"
    return [only6, slice6, both, dual4, dual6]


def fetch(cluster: Cluster, target: object, url: str) -> str:
    return cluster.lab.curl(target, url, timeout=3.0, args=["-g"]).strip()  # type: ignore[arg-type]


def udp6(
    cluster: Cluster, target: object, addr: str, port: int, count: int, *, same: bool = False
) -> list[str]:
    """The names answering `count` IPv6 datagrams (a new flow each, or one socket with `same`)."""
    args = [addr, str(port), str(count), "same" if same else "new"]
    out = cluster.lab.run(target, sys.executable, "-c", UDP6_CLIENT, *args, timeout=count * 1.5 + 10)  # type: ignore[arg-type]
    return out.stdout.split()


def test_an_ipv6_cluster_ip_reaches_every_ipv6_endpoint_from_a_pod(dual: Cluster) -> None:
    """A pod reaches an IPv6-only ClusterIP over IPv6 and is balanced over both nodes' pods."""
    dual.apply(v6_objects(dual.lab))
    seen = {fetch(dual, dual.lab.pod("pod-1-1"), f"http://[{V6_VIP}]:80/") for _ in range(TRIES)}
    assert seen == set(PODS)
    if dual.mode == "iptables":  # eBPF mode's ip6tables keeps only what its programs leave to it
        rules = dual.lab.run(dual.lab.node(1), "ip6tables-save", "-t", "nat").stdout
        assert f"-d {V6_VIP}/128" in rules and "KUBE-SVC-" in rules
    assert V6_VIP not in dual.lab.run(dual.lab.node(1), "iptables-save", "-t", "nat").stdout


def test_each_family_is_served_by_its_own_data_path(dual: Cluster) -> None:
    """Which data path serves which family: the IPv6 ClusterIPs are in ip6tables in iptables mode
    (in eBPF mode ip6tables keeps only what the eBPF programs leave to it, agent/model/tc6_leaves.py:
    the tc IPv6 path serves under this lab's legacy host routing too); the IPv4 ones are in
    iptables in iptables mode and nowhere in netfilter in eBPF mode (its programs and maps serve
    them, and the dual-stack Service's IPv4 ClusterIP answers); the agent says at start how IPv6
    is served."""
    lab = dual.lab
    dual.apply(v6_objects(lab))
    node = lab.node(1)
    v6_rules = lab.run(node, "ip6tables-save", "-t", "nat").stdout
    if dual.mode == "iptables":
        assert f"-d {DUAL_V6}/128" in v6_rules and f"-d {V6_VIP}/128" in v6_rules
    v4_rules = lab.run(node, "iptables-save", "-t", "nat").stdout
    assert (f"-d {DUAL_V4}/32" in v4_rules) == (dual.mode == "iptables"), v4_rules
    assert fetch(dual, lab.pod("pod-2-1"), f"http://{DUAL_V4}:80/") == "pod-1-1"
    log = dual.agents[0].log()
    if dual.mode == "ebpf":
        assert "IPv6: the socket programs translate the connections of the node's sockets" in log
        assert "ip6tables rules (kube-proxy's iptables layout) serve every other IPv6 packet" in log
        assert "the eBPF tc programs translate the IPv6 TCP and UDP flows" in log
        assert "through the node's stack (legacy host routing" in log
        assert "not programmed" not in log
        assert "KUBE-" not in v4_rules, "eBPF mode writes no IPv4 rule"
    else:
        assert "ip6tables rules for the node's IPv6 addresses beside the IPv4 ones" in log


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


HC_PORT, HC_NODE_PORT = 32406, 30687


def probe(cluster: Cluster, url: str) -> tuple[int, dict[str, object]]:
    """(HTTP status, JSON body) of a health endpoint, asked by the external client; (0, {}) when
    nothing answers."""
    out = cluster.lab.run(
        cluster.lab.client, "curl", "-s", "-g", "--max-time", "3", "-w", "\n%{http_code}", url, check=False
    ).stdout
    body, _, code = out.rpartition("\n")
    return int(code or 0), (json.loads(body) if body.strip() else {})


def test_a_dual_stack_local_services_health_check_node_port_counts_each_familys_endpoints(
    dual: Cluster,
) -> None:
    """kube-proxy's two proxiers each run a healthCheckNodePort server fed by their own family
    (kubernetes#137370: IPv4 on IPv4 sockets, IPv6 on IPv6 ones): a dual-stack
    externalTrafficPolicy: Local load balancer's health port answers an IPv4 probe with the node's
    IPv4 local endpoints and an IPv6 probe with its IPv6 ones. /healthz answers over IPv6 too
    (Go's 0.0.0.0 listener takes both families) and reports both families healthy."""
    lab = dual.lab
    port = Port("http", 80, HTTP6_PORT, node_port=HC_NODE_PORT)
    lb = service(
        "hc-dual",
        "10.96.86.2",
        [port],
        type="LoadBalancer",
        clusterIPs=["10.96.86.2", "fd00:10:96::88"],
        ipFamilies=["IPv4", "IPv6"],
        ipFamilyPolicy="RequireDualStack",
        externalTrafficPolicy="Local",
        healthCheckNodePort=HC_PORT,
    )
    # IPv4: one endpoint, on node1. IPv6: two on node1, one on node2.
    v4 = endpoint_slice("hc-dual", [port], [Ep(lab.pod("pod-1-1").ip, "node1")], suffix="v4")
    v6 = endpoint_slice(
        "hc-dual",
        [port],
        [Ep(lab.pod(p).ip6, f"node{lab.pod(p).node}") for p in ("pod-1-1", "pod-1-2", "pod-2-2")],
        suffix="v6",
    )
    v6["addressType"] = "IPv6"
    dual.apply([*v6_objects(lab), lb, v4, v6])
    node1, node2 = lab.node(1), lab.node(2)
    counts = {
        (node.name, family): probe(dual, f"http://{addr}:{HC_PORT}/")
        for node in (node1, node2)
        for family, addr in (("IPv4", node.ip), ("IPv6", f"[{node.ip6}]"))
    }
    assert {k: (code, body.get("localEndpoints")) for k, (code, body) in counts.items()} == {
        ("node1", "IPv4"): (200, 1),
        ("node1", "IPv6"): (200, 2),
        ("node2", "IPv4"): (503, 0),
        ("node2", "IPv6"): (200, 1),
    }
    code, body = probe(dual, f"http://[{node1.ip6}]:10256/healthz")
    assert code == 200, body
    status = body["status"]
    assert isinstance(status, dict) and set(status) == {"IPv4", "IPv6"}
    assert all(entry["healthy"] for entry in status.values()), status


def test_ipv6_udp_reaches_every_endpoint_from_a_pod_the_node_an_endpoint_and_outside(dual: Cluster) -> None:
    """UDP over IPv6 (upstream's "should function for pod-Service / node-Service /
    endpoint-Service: udp" on the secondary family): the ClusterIP from a pod, from the node's own
    network namespace and from an endpoint pod, and the NodePort from the external client, each
    balanced over both nodes' IPv6 endpoints; no datagram lost."""
    lab = dual.lab
    dual.apply(v6_objects(lab))
    sources = {"pod": lab.pod("pod-1-1"), "host network": lab.node(1), "endpoint pod": lab.pod("pod-1-2")}
    for what, target in sources.items():
        names = udp6(dual, target, V6_VIP, UDP_PORT, TRIES)
        assert set(names) == set(PODS), (what, names)
    for node in lab.nodes:
        names = udp6(dual, lab.client, node.ip6, UDP_NODE_PORT, TRIES)
        assert set(names) == set(PODS), (node.name, names)


def test_ipv6_tcp_from_the_node_itself_and_from_an_endpoint_pod(dual: Cluster) -> None:
    """node-Service and endpoint-Service over http on the secondary family: the node's own
    network namespace reaches the IPv6 ClusterIP and its own IPv6 NodePort; an endpoint pod
    reaches the ClusterIP (itself included: hairpin) and a node's IPv6 NodePort."""
    lab = dual.lab
    dual.apply(v6_objects(lab))
    node = lab.node(1)
    assert {fetch(dual, node, f"http://[{V6_VIP}]:80/") for _ in range(TRIES)} == set(PODS)
    assert {fetch(dual, node, f"http://[{node.ip6}]:{NODE_PORT}/") for _ in range(TRIES)} == set(PODS)
    ep_pod = lab.pod("pod-1-2")
    assert {fetch(dual, ep_pod, f"http://[{V6_VIP}]:80/") for _ in range(TRIES)} == set(PODS)
    url = f"http://[{lab.node(2).ip6}]:{NODE_PORT}/"
    assert {fetch(dual, lab.pod("pod-1-1"), url) for _ in range(TRIES)} == set(PODS), "pod to NodePort"


def test_ipv6_endpoint_updates_reach_the_rules(dual: Cluster) -> None:
    """ "should update endpoints: http / udp" on the secondary family: an IPv6 endpoint removed
    from the slice stops receiving TCP and UDP at once; added back, it receives again."""
    lab = dual.lab
    dual.apply(v6_objects(lab, backends=("pod-1-2",)))
    pod = lab.pod("pod-2-1")
    assert {fetch(dual, pod, f"http://[{V6_VIP}]:80/") for _ in range(TRIES)} == {"pod-1-2"}
    assert set(udp6(dual, pod, V6_VIP, UDP_PORT, TRIES)) == {"pod-1-2"}
    dual.apply(v6_objects(lab))
    assert {fetch(dual, pod, f"http://[{V6_VIP}]:80/") for _ in range(TRIES)} == set(PODS)


AFFINITY_V6 = "fd00:10:96::89"


def test_ipv6_client_ip_session_affinity_holds_for_tcp_and_udp(dual: Cluster) -> None:
    """ "should function for client IP based session affinity: http / udp" on the secondary
    family: every connection (and every new UDP flow) of one IPv6 client reaches one endpoint."""
    lab = dual.lab
    ports = [Port("http", 80, HTTP6_PORT), Port("dns", UDP_PORT, HTTP6_PORT, "UDP")]
    svc = service(
        "sticky6",
        AFFINITY_V6,
        ports,
        ipFamilies=["IPv6"],
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 300}},
    )
    eps = endpoint_slice("sticky6", ports, [Ep(lab.pod(p).ip6, f"node{lab.pod(p).node}") for p in PODS], "v6")
    eps["addressType"] = "IPv6"
    dual.apply([*v6_objects(lab), svc, eps])
    for source in ("pod-1-1", "pod-2-1"):
        pod = lab.pod(source)
        tcp = {fetch(dual, pod, f"http://[{AFFINITY_V6}]:80/") for _ in range(TRIES)}
        assert len(tcp) == 1 and tcp <= set(PODS), (source, tcp)
        udp = set(udp6(dual, pod, AFFINITY_V6, UDP_PORT, TRIES))
        assert len(udp) == 1 and udp <= set(PODS), (source, udp)
    if dual.mode == "iptables":
        rules = lab.run(lab.node(1), "ip6tables-save", "-t", "nat").stdout
        assert "--rcheck --seconds 300 --reap" in rules and "--set" in rules
    else:  # the pods' flows the socket programs leave to the packet path: tc's affinity (ekp_aff6)
        assert dual.bpf_stats(1)["affinity_hit"] > 0


LOCAL_NODE_PORT = 30689


def test_ipv6_external_traffic_policy_local_keeps_the_client_address(dual: Cluster) -> None:
    """externalTrafficPolicy: Local over IPv6: the NodePort on the endpoint's node reaches only the
    local endpoint, which sees the external client's own IPv6 address (no masquerade); on the
    node without one nothing answers."""
    lab = dual.lab
    port = Port("http", 80, HTTP6_PORT, node_port=LOCAL_NODE_PORT)
    svc = service(
        "local6",
        "fd00:10:96::8a",
        [port],
        type="NodePort",
        ipFamilies=["IPv6"],
        externalTrafficPolicy="Local",
    )
    eps = endpoint_slice("local6", [port], [Ep(lab.pod("pod-1-2").ip6, "node1")], "v6")
    eps["addressType"] = "IPv6"
    dual.apply([*v6_objects(lab), svc, eps])
    client = lab.client
    url = f"http://[{lab.node(1).ip6}]:{LOCAL_NODE_PORT}"
    assert {fetch(dual, client, f"{url}/") for _ in range(10)} == {"pod-1-2"}
    assert fetch(dual, client, f"{url}/ip") == client.ip6
    res = lab.run(
        client,
        "curl",
        "-sS",
        "-g",
        "--max-time",
        "2",
        f"http://[{lab.node(2).ip6}]:{LOCAL_NODE_PORT}/",
        check=False,
    )
    assert res.returncode != 0, "no local endpoint on node2: dropped"


def test_ipv6_large_requests_pass_through_for_http_and_udp(dual: Cluster) -> None:
    """ "should be able to handle large requests: http / udp" on the secondary family: a 2,000-byte
    HTTP request line and a 2,000-byte datagram, which leaves the client as two IPv6 fragments on
    the lab's 1,500-byte links and comes back the same way, through the IPv6 ClusterIP."""
    lab = dual.lab
    dual.apply(v6_objects(lab))
    pod = lab.pod("pod-1-1")
    message = "42" * 1000
    for _ in range(5):
        assert fetch(dual, pod, f"http://[{V6_VIP}]:80/echo?msg={message}") == message
    sent = "n" + "o" * 1999
    client = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n"
        "s.settimeout(2.0)\n"
        "for _ in range(5):\n"
        f"    s.sendto(sys.argv[1].encode(), ('{V6_VIP}', {UDP_PORT}))\n"
        "    reply = s.recv(65535)\n"
        "    print('same' if reply == sys.argv[1].encode() else len(reply))\n"
    )
    out = lab.run(pod, sys.executable, "-c", client, sent, timeout=30).stdout.split()
    assert out == ["same"] * 5, out


DNS_V6 = "fd00:10:96::a"

# From a pod: one TCP connection to [vip]:80 (GET /) and one UDP datagram to [vip]:53 ("who"),
# printing the peer each socket shows (getpeername, recvfrom's source) and who answered.
PEERS6 = r"""
import json, socket, sys
vip = sys.argv[1]
t = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); t.settimeout(3)
t.connect((vip, 80)); peer = "[%s]:%d" % t.getpeername()[:2]
t.sendall(b"GET / HTTP/1.0\r\n\r\n"); body = b""
while (c := t.recv(4096)):
    body += c
u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.settimeout(3)
u.sendto(b"who", (vip, 53)); data, src = u.recvfrom(100)
print(json.dumps([peer, body.split(b"\r\n\r\n")[1].decode().strip(), "[%s]:%d" % src[:2], data.decode()]))
"""


@contextlib.contextmanager
def dns6_service(dual: Cluster) -> Iterator[None]:
    """dnsmasq in each of PODS on its IPv6 address, behind the IPv6-only Service DNS_V6 (UDP and
    TCP port 53), with v6_objects' Services; the servers stopped on the way out."""
    lab = dual.lab
    servers = [lab.start_dns(lab.pod(p), extra_args=[f"--listen-address={lab.pod(p).ip6}"]) for p in PODS]
    try:
        ports = [Port("dns", 53, 53, "UDP"), Port("dns-tcp", 53, 53, "TCP")]
        svc = service("dns6", DNS_V6, ports, ipFamilies=["IPv6"])
        eps = endpoint_slice(
            "dns6", ports, [Ep(lab.pod(p).ip6, f"node{lab.pod(p).node}") for p in PODS], "v6"
        )
        eps["addressType"] = "IPv6"
        dual.apply([*v6_objects(lab), svc, eps])
        yield
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(timeout=10)


def test_a_pods_ipv6_connections_are_translated_by_the_socket_programs_in_ebpf_mode(dual: Cluster) -> None:
    """eBPF mode: a pod's TCP connection, UDP datagram and DNS lookup (`dig`) to an IPv6 ClusterIP
    are sent to a backend by the socket programs at connect()/sendmsg(): their counter moves, and
    the node's nf_conntrack holds no flow to the ClusterIP, so no ip6tables DNAT translated them;
    the application sees the ClusterIP as its peer (getpeername, recvfrom's source; dig, which
    refuses an answer from another address). iptables mode, the same test's other side: ip6tables
    translates, its DNAT flows to the ClusterIP are in nf_conntrack."""
    lab = dual.lab
    with dns6_service(dual):
        node, pod = lab.node(1), lab.pod("pod-1-1")
        for vip in (V6_VIP, DNS_V6):  # flows of earlier tests
            lab.run(node, "conntrack", "-D", "-f", "ipv6", "--orig-dst", vip, check=False)
        before = dual.bpf_stats(1)["sock_translated"] if dual.mode == "ebpf" else 0
        peer, body, src, answer = json.loads(lab.run(pod, sys.executable, "-c", PEERS6, V6_VIP).stdout)
        assert (peer, src) == (f"[{V6_VIP}]:80", f"[{V6_VIP}]:53") and {body, answer} <= set(PODS)
        assert lab.dns_whoami(pod, DNS_V6) in PODS
        flows = {
            vip: lab.run(node, "conntrack", "-L", "-f", "ipv6", "--orig-dst", vip, check=False).stdout
            for vip in (V6_VIP, DNS_V6)
        }
        if dual.mode == "ebpf":
            assert dual.bpf_stats(1)["sock_translated"] - before >= 3
            assert flows == {V6_VIP: "", DNS_V6: ""}, flows
        else:
            assert "dport=80 " in flows[V6_VIP] and "dport=53 " in flows[V6_VIP], flows
            assert "dport=53 " in flows[DNS_V6], flows


def test_dns_over_ipv6_with_dig_through_an_ipv6_cluster_ip(dual: Cluster) -> None:
    """DNS over IPv6 (issue 20's "DNS over IPv6 with dig"): dnsmasq in two pods listening on their
    IPv6 addresses behind an IPv6-only kube-dns-like Service; `dig` from a pod over UDP and over
    TCP gets answers from both."""
    lab = dual.lab
    with dns6_service(dual):
        pod = lab.pod("pod-1-1")
        over_udp = {lab.dns_whoami(pod, DNS_V6) for _ in range(TRIES)}
        assert over_udp == set(PODS)
        over_tcp = {lab.dns_whoami(pod, DNS_V6, tcp=True) for _ in range(TRIES)}
        assert over_tcp == set(PODS)
