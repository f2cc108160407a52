"""IPv6 Services through the tc programs' IPv6 path (bpf/ekp_tc6.h), with real traffic through the
dual-stack lab, in both modes.

eBPF mode runs with `--bpf-host-routing=bpf` (the IPv6 path translates under legacy host routing,
the default, too: tests/adversarial/test_host_routing.py and tests/traffic/test_ipv6.py run it
there) and pods' sockets left to
the per-packet path (the harness's default, `--bpf-socket-lb-host-namespace-only=true`), so a
pod's IPv6 connection to a Service is the tc programs' or ip6tables', never the socket programs'.
What each must show in eBPF mode: its TCP flows to a Service (a pod to a ClusterIP, a NodePort of
externalTrafficPolicy Local from outside to the node's own endpoint, a NodePort of policy Cluster,
masqueraded to the node's IPv6 address, whose endpoint may be on the other node) are translated by
tc (its counters move, and the node's nf_conntrack holds no DNAT entry for them), and so are its UDP
flows: DNS with `dig`, a 4,000-byte datagram and its 4,000-byte answer (three fragments each way),
a backend's ICMPv6 port unreachable back to the client (their entries in ekp_ct6_any), an SCTP
association (lab/sctppeer.py over IPv6: its entries in ekp_ct6_any); and its refusals are tc's,
counted as IPv4's: a ClusterIP without endpoints refused at once with ICMPv6 port unreachable
("connection refused", no timeout), a NodePort of policy Local without a local endpoint and a
LoadBalancer IP's client outside loadBalancerSourceRanges dropped. iptables mode, the same
requests: the same answers, every one through ip6tables (whose DNAT entries are in nf_conntrack).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

import pytest

from lab import Lab
from lab.core import PODSERVER, CommandError
from lab.harness import Cluster
from lab.objects import Ep, Port, endpoint_slice, service
from tests.conftest import require_kernel
from tests.traffic.conftest import MODES
from tests.traffic.test_fragments_and_mtu import mtu
from tests.traffic.test_ipv6 import HTTP6_PORT, SERVER6, fetch

VIP = "fd00:10:96::c1"
CLUSTER_PORT, LOCAL_PORT, REMOTE_PORT, UDP_PORT = 30791, 30792, 30793, 53
DNS_VIP, CLOSED_VIP, CLOSED_PORT = "fd00:10:96::c6", "fd00:10:96::c5", 54
PODS = ("pod-1-2", "pod-2-2")  # the IPv6 backends, one per node
# A ClusterIP whose one backend, on node2, takes uploads over IPv6 (lab/podserver.py `--ipv6`,
# POST /sink): the path-MTU test's
PMTU_VIP, PMTU_POD, SINK_PORT = "fd00:10:96::c3", "pod-2-1", 8087
UPLOAD = 2_000_000
DIG_PORT = 23000  # below the pods' ephemeral range (no earlier connection holds one)
TRIES = 20  # each reaches a given one of two backends with p = 1/2: all missing it, 1e-6
# Refusals: a ClusterIP without endpoints; a NodePort of policy Local whose one endpoint is on
# node2; two LoadBalancer IPs (routed to node1 by the client), one whose source ranges leave the
# client out, one whose ranges hold it
NONE_VIP, NO_LOCAL_PORT = "fd00:10:96::c7", 30794
LB_DENY, LB_ALLOW, LB_DENY_PORT, LB_ALLOW_PORT = "fd00:10:97::1", "fd00:10:97::2", 30795, 30796
SCTP_VIP, SCTP_PORT, SCTP_TARGET, SCTP_POD = "fd00:10:96::c9", 5060, 5061, "pod-2-2"
# A ClusterIP whose one endpoint is node1's own IPv6 address (a host-network backend): the tc path
# serves it (EKP_CT_HOST flows, bpf/ekp_tc6.h), so ip6tables keeps no rules for it
HOST_VIP, HOST_PORT = "fd00:10:96::cc", 8097
# What eBPF mode's ip6tables keeps once the IPv6 SNAT is granted (agent/model/tc6_leaves.py):
# SCTP's (the node's own SCTP sockets) and the LB IPs with source ranges' (a node socket bound to
# no address); every other Service of the lab is the eBPF programs' alone
LEFT_VIPS = {SCTP_VIP, "fd00:10:96::ca", "fd00:10:96::cb"}
PEER = str(PODSERVER.parent / "sctppeer.py")


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
        sink = lab.popen(
            lab.pod(PMTU_POD),
            *(sys.executable, "-I", "-S", str(PODSERVER), "--name", PMTU_POD, "--ipv6"),
            *("--http-port", str(SINK_PORT), "--udp-port", str(SINK_PORT)),
            name="sink6",
        )
        lab.wait_log(sink, "podserver ready")
        host = lab.popen(lab.node(1), sys.executable, "-c", SERVER6, "node1", str(HOST_PORT), name="host6")
        lab.wait_log(host, "ready")
        for name in PODS:  # DNS on their IPv6 addresses too, behind DNS_VIP
            lab.start_dns(lab.pod(name), extra_args=[f"--listen-address={lab.pod(name).ip6}"])
        extra = ["--bpf-host-routing=bpf"] if request.param == "ebpf" else []
        c = Cluster(lab, request.param, extra=extra)
        c.start()
        try:
            lab_objects(c)
            if c.mode == "ebpf":
                # every test of the module runs with the rules thinned out (the grant on)
                thinned(c)
            yield c
        finally:
            failures = c.stop()
        assert not failures, f"agent --cleanup failed: {failures}"


def lab_objects(c: Cluster) -> None:
    lab = c.lab
    http = Port("http", 80, HTTP6_PORT, node_port=CLUSTER_PORT)
    dns = Port("dns", UDP_PORT, HTTP6_PORT, "UDP")
    svc = service("tc6", VIP, [http, dns], type="NodePort", ipFamilies=["IPv6"])
    eps = endpoint_slice(
        "tc6", [http, dns], [Ep(lab.pod(p).ip6, f"node{lab.pod(p).node}") for p in PODS], "v6"
    )
    eps["addressType"] = "IPv6"
    lport = Port("http", 80, HTTP6_PORT, node_port=LOCAL_PORT)
    local = service(
        "tc6-local",
        "fd00:10:96::c2",
        [lport],
        type="NodePort",
        ipFamilies=["IPv6"],
        externalTrafficPolicy="Local",
    )
    leps = endpoint_slice("tc6-local", [lport], [Ep(lab.pod("pod-1-2").ip6, "node1")], "v6")
    leps["addressType"] = "IPv6"
    sport = Port("http", 80, SINK_PORT)
    sink = service("tc6-pmtu", PMTU_VIP, [sport], ipFamilies=["IPv6"])
    seps = endpoint_slice("tc6-pmtu", [sport], [Ep(lab.pod(PMTU_POD).ip6, "node2")], "v6")
    seps["addressType"] = "IPv6"
    # policy Cluster, its only endpoint on node2: masqueraded by node1 toward node2
    rport = Port("http", 80, HTTP6_PORT, node_port=REMOTE_PORT)
    remote = service("tc6-remote", "fd00:10:96::c4", [rport], type="NodePort", ipFamilies=["IPv6"])
    reps = endpoint_slice("tc6-remote", [rport], [Ep(lab.pod("pod-2-2").ip6, "node2")], "v6")
    reps["addressType"] = "IPv6"
    # kube-dns' shape over IPv6: dnsmasq in both PODS
    dns_ports = [Port("dns", 53, 53, "UDP"), Port("dns-tcp", 53, 53, "TCP")]
    dns_svc = service("tc6-dns", DNS_VIP, dns_ports, ipFamilies=["IPv6"])
    deps = endpoint_slice(
        "tc6-dns", dns_ports, [Ep(lab.pod(p).ip6, f"node{lab.pod(p).node}") for p in PODS], "v6"
    )
    deps["addressType"] = "IPv6"
    # a UDP port its endpoint does not listen on: the backend answers with a port unreachable
    cport = Port("closed", CLOSED_PORT, 9999, "UDP")
    closed = service("tc6-closed", CLOSED_VIP, [cport], ipFamilies=["IPv6"])
    ceps = endpoint_slice("tc6-closed", [cport], [Ep(lab.pod("pod-2-2").ip6, "node2")], "v6")
    ceps["addressType"] = "IPv6"
    hport = Port("http", 80, HOST_PORT)
    hosted = service("tc6-host", HOST_VIP, [hport], ipFamilies=["IPv6"])
    heps = endpoint_slice("tc6-host", [hport], [Ep(lab.node(1).ip6, "node1")], "v6")
    heps["addressType"] = "IPv6"
    objs = [svc, eps, local, leps, sink, seps, remote, reps, dns_svc, deps, closed, ceps, hosted, heps]
    c.apply([*objs, *refusal_objects(c)])


def thinned(c: Cluster, timeout: float = 60.0) -> None:
    """Until node1's ip6tables sends only LEFT_VIPS to Service chains: the grant came at a sync
    (the tc path serves those Services at once) and the rules went at the next IPv6 sync."""
    deadline = time.monotonic() + timeout
    while (vips := kube_services_vips(c)) != LEFT_VIPS:
        assert time.monotonic() < deadline, f"ip6tables still sends {sorted(vips)} to Service chains"
        time.sleep(0.2)


def kube_services_vips(c: Cluster) -> set[str]:
    """The IPv6 addresses node1's ip6tables KUBE-SERVICES sends to a Service's chain."""
    rules = c.lab.run(c.lab.node(1), "ip6tables-save", "-t", "nat").stdout
    return {
        line.split(" -d ", 1)[1].split("/", 1)[0]
        for line in rules.splitlines()
        if line.startswith("-A KUBE-SERVICES -d ") and " -j KUBE-SVC-" in line
    }


def refusal_objects(c: Cluster) -> list[dict[str, object]]:
    lab = c.lab
    none = service("tc6-none", NONE_VIP, [Port("http", 80, HTTP6_PORT)], ipFamilies=["IPv6"])
    nport = Port("http", 80, HTTP6_PORT, node_port=NO_LOCAL_PORT)
    no_local = service(
        "tc6-no-local",
        "fd00:10:96::c8",
        [nport],
        type="NodePort",
        ipFamilies=["IPv6"],
        externalTrafficPolicy="Local",
    )
    nleps = endpoint_slice("tc6-no-local", [nport], [Ep(lab.pod("pod-2-2").ip6, "node2")], "v6")
    nleps["addressType"] = "IPv6"
    objs = [none, no_local, nleps]
    for name, vip, lb_ip, node_port, ranges in (
        ("tc6-lb-deny", "fd00:10:96::ca", LB_DENY, LB_DENY_PORT, ["fd00:dead::/64"]),
        ("tc6-lb-allow", "fd00:10:96::cb", LB_ALLOW, LB_ALLOW_PORT, [f"{lab.client.ip6}/128"]),
    ):
        lport = Port("http", 80, HTTP6_PORT, node_port=node_port)
        lb = service(
            name,
            vip,
            [lport],
            type="LoadBalancer",
            ipFamilies=["IPv6"],
            loadBalancerSourceRanges=ranges,
            status={"loadBalancer": {"ingress": [{"ip": lb_ip}]}},
        )
        lbeps = endpoint_slice(name, [lport], [Ep(lab.pod("pod-1-2").ip6, "node1")], "v6")
        lbeps["addressType"] = "IPv6"
        objs += [lb, lbeps]
    sctp_port = Port("sip", SCTP_PORT, SCTP_TARGET, "SCTP")
    sctp = service("tc6-sctp", SCTP_VIP, [sctp_port], ipFamilies=["IPv6"])
    sceps = endpoint_slice("tc6-sctp", [sctp_port], [Ep(lab.pod(SCTP_POD).ip6, "node2")], "v6")
    sceps["addressType"] = "IPv6"
    return [*objs, sctp, sceps]


def dnat_flows(c: Cluster, dst: str) -> str:
    """node1's nf_conntrack entries whose original destination is `dst` (an ip6tables DNAT's)."""
    return c.lab.run(c.lab.node(1), "conntrack", "-L", "-f", "ipv6", "--orig-dst", dst, check=False).stdout


def forget_flows(c: Cluster, dst: str) -> None:
    c.lab.run(c.lab.node(1), "conntrack", "-D", "-f", "ipv6", "--orig-dst", dst, check=False)


def new_flows(c: Cluster) -> int:
    return c.bpf_stats(1)["new_flows"] if c.mode == "ebpf" else 0


def ct6_udp_flows(c: Cluster, dst: str, port: int) -> int:
    """eBPF mode: the FORWARD entries of node1's ekp_ct6_any (the tc IPv6 path's UDP and SCTP
    flows) to [dst]:port."""
    from agent.ebpf.abi import MAPS, Ct6Key, CtDir, ip6_words, port_be
    from agent.ebpf.maps import BpfMap

    words = tuple(ip6_words(dst))
    with BpfMap.open_pinned(MAPS["ct6_any"], c.agents[0].pin_path) as table:
        return sum(
            1
            for key, _ in table.items()
            if isinstance(key, Ct6Key)
            and key.dir == CtDir.FORWARD
            and tuple(key.daddr) == words
            and key.dport == port_be(port)
        )


def test_a_pods_ipv6_connections_to_a_cluster_ip_are_translated_by_tc(dual: Cluster) -> None:
    """A pod on node1 reaches both backends (its own node's and node2's) through the IPv6
    ClusterIP: in eBPF mode each connection is a new tc flow and none is in nf_conntrack."""
    forget_flows(dual, VIP)
    before = new_flows(dual)
    seen = {fetch(dual, dual.lab.pod("pod-1-1"), f"http://[{VIP}]:80/") for _ in range(TRIES)}
    assert seen == set(PODS)
    flows = dnat_flows(dual, VIP)
    if dual.mode == "ebpf":
        assert new_flows(dual) - before >= TRIES
        assert flows == "", flows
    else:
        assert "dport=80 " in flows, flows


def test_an_ipv6_node_port_of_policy_local_is_translated_by_tc_keeping_the_client_address(
    dual: Cluster,
) -> None:
    lab = dual.lab
    node = lab.node(1)
    forget_flows(dual, node.ip6)
    before = new_flows(dual)
    url = f"http://[{node.ip6}]:{LOCAL_PORT}"
    assert {fetch(dual, lab.client, f"{url}/") for _ in range(5)} == {"pod-1-2"}
    assert fetch(dual, lab.client, f"{url}/ip") == lab.client.ip6
    flows = dnat_flows(dual, node.ip6)
    if dual.mode == "ebpf":
        assert new_flows(dual) - before >= 6
        assert f"dport={LOCAL_PORT} " not in flows, flows
    else:
        assert f"dport={LOCAL_PORT} " in flows, flows


def test_an_ipv6_node_port_of_policy_cluster_is_masqueraded_by_tc(dual: Cluster) -> None:
    """Masqueraded (policy Cluster), the remote backend and the local one alike: both answer, and
    see a node address. In eBPF mode the tc path translates the source to node1's IPv6 address
    (ekp_cfg6; counted as SNAT), so nf_conntrack holds no DNAT entry; in iptables mode ip6tables'
    does, and its MASQUERADE takes the address of the device towards the backend."""
    lab = dual.lab
    node = lab.node(1)
    forget_flows(dual, node.ip6)
    before = new_flows(dual)
    snat_before = dual.bpf_stats(1)["snat"] if dual.mode == "ebpf" else 0
    url = f"http://[{node.ip6}]:{CLUSTER_PORT}"
    assert {fetch(dual, lab.client, f"{url}/") for _ in range(TRIES)} == set(PODS)
    sources = {fetch(dual, lab.client, f"{url}/ip") for _ in range(TRIES)}
    assert lab.client.ip6 not in sources and all(s.startswith("fd00:") for s in sources), sources
    flows = dnat_flows(dual, node.ip6)
    if dual.mode == "ebpf":
        assert sources == {node.ip6}, "masqueraded by tc to node1's IPv6 address"
        assert new_flows(dual) - before >= 2 * TRIES
        assert dual.bpf_stats(1)["snat"] - snat_before >= 2 * TRIES, "every flow source-translated by tc"
        assert f"dport={CLUSTER_PORT} " not in flows, flows
    else:
        assert f"dport={CLUSTER_PORT} " in flows, "ip6tables' DNAT"


def test_an_external_client_reaches_an_ipv6_node_port_whose_only_endpoint_is_on_the_other_node(
    dual: Cluster,
) -> None:
    """kube-proxy's NodePort of policy Cluster: node1 sends the client's connection on to node2's
    endpoint from its own IPv6 address, and the answer back to the client from the NodePort. eBPF
    mode: the tc path both ways (a new tc flow per connection, no nf_conntrack entry); iptables
    mode: ip6tables' DNAT and MASQUERADE."""
    lab = dual.lab
    node = lab.node(1)
    forget_flows(dual, node.ip6)
    before = new_flows(dual)
    url = f"http://[{node.ip6}]:{REMOTE_PORT}"
    assert {fetch(dual, lab.client, f"{url}/") for _ in range(3)} == {"pod-2-2"}
    assert fetch(dual, lab.client, f"{url}/ip") == node.ip6, "masqueraded to node1's address"
    flows = dnat_flows(dual, node.ip6)
    if dual.mode == "ebpf":
        assert new_flows(dual) - before >= 4
        assert f"dport={REMOTE_PORT} " not in flows, flows
    else:
        assert f"dport={REMOTE_PORT} " in flows, flows


# A 4,000-byte datagram (three IPv6 fragments on the lab's links; the backend echoes it, three
# fragments back), a short one carrying a destination options header and the 4,000 bytes again
# behind it, each from its own socket to [vip]:53, then an HTTP request over a TCP connection
# whose every segment carries that header, to [vip]:80; prints what came back.
DATAGRAMS = r"""
import socket, sys
vip, port = sys.argv[1], int(sys.argv[2])
# a destination options header holding one PadN option (RFC 8200 4.2): 8 bytes
OPTS = bytes([0, 0, 1, 4, 0, 0, 0, 0])
big = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); big.settimeout(3)
sent = bytes(range(256)) * 15 + b"x" * 160
big.sendto(sent, (vip, port)); answer, peer = big.recvfrom(65535)
print(len(answer), answer == sent and peer[0] == vip)
opts = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); opts.settimeout(3)
opts.setsockopt(socket.IPPROTO_IPV6, 59, OPTS)  # IPV6_DSTOPTS
opts.sendto(b"who", (vip, port)); print(opts.recv(100).decode())
# the 4,000 bytes again behind that header, which Linux puts before the fragment header, in every piece
frag_opts = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); frag_opts.settimeout(3)
frag_opts.setsockopt(socket.IPPROTO_IPV6, 59, OPTS)
frag_opts.sendto(sent, (vip, port)); answer, peer = frag_opts.recvfrom(65535)
print(answer == sent and peer[0] == vip)
tcp = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); tcp.settimeout(3)
tcp.setsockopt(socket.IPPROTO_IPV6, 59, OPTS)
tcp.connect((vip, 80)); tcp.sendall(b"GET / HTTP/1.0\r\n\r\n")
answer = b""
while chunk := tcp.recv(4096):
    answer += chunk
print(answer.split(b"\r\n\r\n", 1)[1].decode().strip())
"""


def test_udp_fragments_and_extension_headers_reach_the_cluster_ip(dual: Cluster) -> None:
    """A 4,000-byte datagram to the IPv6 ClusterIP and the backend's 4,000-byte answer (three
    fragments each way), a datagram behind a destination options header, the 4,000 bytes behind
    it too, and a TCP connection behind it. eBPF mode: all four are tc flows (four new flows, the
    later fragments counted as translated, the datagrams' entries in ekp_ct6_any) and nf_conntrack
    holds none of them (before the path took UDP, the datagrams went through ip6tables): Linux puts
    the socket's destination options before the fragment header, in every piece, so the walk
    reaches the fragment header in each (one after it, RFC 8200's order, is the packet tests':
    the stack's whole). iptables mode: ip6tables' DNAT entries for all four."""
    lab = dual.lab
    forget_flows(dual, VIP)
    before = dual.bpf_stats(1) if dual.mode == "ebpf" else {}
    out = lab.run(lab.pod("pod-1-1"), sys.executable, "-c", DATAGRAMS, VIP, str(UDP_PORT), timeout=20).stdout
    size, same, who, same_behind_opts, http = out.split()
    assert (size, same, same_behind_opts) == ("4000", "True", "True") and who in PODS and http in PODS, out
    flows = dnat_flows(dual, VIP)
    if dual.mode == "ebpf":
        after = dual.bpf_stats(1)
        assert after["new_flows"] - before["new_flows"] == 4, "three datagrams and the TCP connection"
        assert after["fragments"] - before["fragments"] >= 8, "two later fragments each way, twice"
        assert ct6_udp_flows(dual, VIP, UDP_PORT) >= 2
        assert flows == "", flows
    else:
        assert flows.count("dport=53 ") == 3 and "dport=80 " in flows, flows


def test_dns_over_ipv6_with_dig_is_translated_by_tc(dual: Cluster) -> None:
    """DNS over IPv6 with `dig` from a pod (no socket programs: tc's path) to an IPv6 ClusterIP
    answered by dnsmasq in both PODS: each lookup a tc flow in eBPF mode (new flows, entries in
    ekp_ct6_any, none in nf_conntrack), ip6tables' in iptables mode. Over TCP too."""
    lab = dual.lab
    pod = lab.pod("pod-1-1")
    forget_flows(dual, DNS_VIP)
    before = new_flows(dual)
    # each lookup from a port of its own: dig's random ports can repeat within 20 lookups (about
    # 0.7% of runs), and a repeated one is the earlier lookup's live flow, not a new one
    assert {lab.dns_whoami(pod, DNS_VIP, source_port=DIG_PORT + i) for i in range(TRIES)} == set(PODS)
    assert {lab.dns_whoami(pod, DNS_VIP, tcp=True) for _ in range(3)} <= set(PODS)
    flows = dnat_flows(dual, DNS_VIP)
    if dual.mode == "ebpf":
        assert new_flows(dual) - before >= TRIES + 3
        assert ct6_udp_flows(dual, DNS_VIP, 53) >= 1
        assert flows == "", flows
    else:
        assert "dport=53 " in flows, flows


# A connected UDP socket's datagram to [vip]:port; what came back: an answer, the ICMPv6 port
# unreachable (ECONNREFUSED) or nothing.
REFUSED = r"""
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); s.settimeout(3)
s.connect((sys.argv[1], int(sys.argv[2])))
s.send(b"anyone?")
try:
    s.recv(100); print("answered")
except ConnectionRefusedError:
    print("refused")
except socket.timeout:
    print("timeout")
"""


def test_a_backends_port_unreachable_reaches_the_client_through_the_cluster_ip(dual: Cluster) -> None:
    """The endpoint (on node2) listens on no UDP port 9999: its ICMPv6 port unreachable quotes the
    datagram as node1 sent it (to the endpoint); node1 translates it back (eBPF: the tc path's
    ekp_tc6_related, counted ct_related; iptables: nf_nat), so the client's connected socket gets
    ECONNREFUSED at once. Untranslated, the error quotes a tuple the socket never used: the stack
    drops it and the client waits out its timeout."""
    lab = dual.lab
    forget_flows(dual, CLOSED_VIP)
    before = dual.bpf_stats(1) if dual.mode == "ebpf" else {}
    out = lab.run(lab.pod("pod-1-1"), sys.executable, "-c", REFUSED, CLOSED_VIP, str(CLOSED_PORT), timeout=20)
    assert out.stdout.strip() == "refused", out.stdout
    flows = dnat_flows(dual, CLOSED_VIP)
    if dual.mode == "ebpf":
        after = dual.bpf_stats(1)
        assert after["new_flows"] > before["new_flows"] and ct6_udp_flows(dual, CLOSED_VIP, CLOSED_PORT) == 1
        assert after["ct_related"] > before["ct_related"], "node1 translated the port unreachable"
        assert flows == "", flows
    else:
        assert f"dport={CLOSED_PORT} " in flows, flows


def test_packet_too_big_from_beyond_the_backends_node_lowers_the_clients_path_mtu(dual: Cluster) -> None:
    """Path-MTU discovery through an IPv6 ClusterIP (issue 20: Packet Too Big through a translated
    flow). node2's veth to the backend carries 1,400 bytes while the pod itself has 1,500, so the
    backend's MSS does not avoid it: node2's stack answers the client's first full-size segment
    with an ICMPv6 Packet Too Big to the client, quoting the segment as node1 sent it (to the
    backend). node1 translates it back (eBPF: the tc IPv6 path, ekp_tc6_related; iptables:
    nf_nat's ICMPv6 translation), the client's stack finds its socket and lowers its path MTU to
    the ClusterIP (`ip -6 route get` shows it), and the upload completes. Untranslated, the error
    quotes a tuple the client never used: its stack drops it, the segments stay too big, and the
    upload stalls until its timeout (a black hole)."""
    lab = dual.lab
    client = lab.pod("pod-1-1")
    forget_flows(dual, PMTU_VIP)
    before = dual.bpf_stats(1) if dual.mode == "ebpf" else {}
    url = f"http://[{PMTU_VIP}]:80/sink"
    with mtu(dual, [("node2", lab.pod(PMTU_POD).host_iface)], 1400):
        sent = dual.client(client, "upload", "--url", url, "--bytes", str(UPLOAD), "--timeout", "20")
        route = lab.run(client, "ip", "-6", "route", "get", PMTU_VIP).stdout
    assert sent.get("received") == UPLOAD, sent
    assert " mtu 1400 " in f"{route} ", route
    flows = dnat_flows(dual, PMTU_VIP)
    if dual.mode == "ebpf":
        after = dual.bpf_stats(1)
        assert after["new_flows"] > before["new_flows"] and flows == "", "the tc IPv6 path's flow"
        assert after["ct_related"] > before["ct_related"], "node1 translated the Packet Too Big"
    else:
        assert "dport=80 " in flows, flows


def test_packet_too_big_from_the_node_when_its_uplink_is_smaller_lowers_the_clients_path_mtu(
    dual: Cluster,
) -> None:
    """node1's uplink (its eth0 and the switch port) carries 1,400 bytes; the pods have 1,500. The
    client's first full-size segment through the IPv6 ClusterIP, to the backend on node2, is too
    big for the device its translation leaves by: node1 answers with a Packet Too Big from the
    ClusterIP quoting the segment as the client sent it (eBPF: the tc IPv6 path on the flow's hit,
    bpf/ekp_icmp6.h, counted `drop_frag_needed`, no nf_conntrack entry made for the flow; before,
    the segment went to the stack, where ip6tables took it for a new flow and translated it again;
    iptables: ip6_forward, through nf_nat). The client lowers its path MTU, the upload completes."""
    lab = dual.lab
    client = lab.pod("pod-1-1")
    forget_flows(dual, PMTU_VIP)
    before = dual.bpf_stats(1) if dual.mode == "ebpf" else {}
    url = f"http://[{PMTU_VIP}]:80/sink"
    with mtu(dual, [("node1", "eth0"), ("net", "sw-node1")], 1400):
        sent = dual.client(client, "upload", "--url", url, "--bytes", str(UPLOAD), "--timeout", "20")
        route = lab.run(client, "ip", "-6", "route", "get", PMTU_VIP).stdout
    assert sent.get("received") == UPLOAD, sent
    assert " mtu 1400 " in f"{route} ", route
    flows = dnat_flows(dual, PMTU_VIP)
    if dual.mode == "ebpf":
        after = dual.bpf_stats(1)
        assert after["drop_frag_needed"] > before["drop_frag_needed"], "node1's tc path answered"
        assert flows == "", f"no flow of ip6tables: {flows}"
    else:
        assert "dport=80 " in flows, flows


# One datagram from each source port of [first, last) to [vip]:port, each from its own socket; the
# answers (the backend's name) in order.
FROM_PORTS = r"""
import socket, sys
vip, port, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
names = []
for sport in range(first, last):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); s.settimeout(3)
    s.bind(("::", sport))
    s.sendto(b"who", (vip, port))
    names.append(s.recv(100).decode())
    s.close()
print(" ".join(names))
"""


def test_udp_flows_ip6tables_translated_before_a_restart_keep_their_backend(dual: Cluster) -> None:
    """Twenty UDP flows ip6tables translated to one of the ClusterIP's two endpoints (written into
    node1's nf_conntrack with their NAT while its agent is stopped, as ip6tables would have left
    them: a node upgraded from an agent whose tc path left UDP to ip6tables) keep that endpoint
    after the restart: eBPF mode carries them into ekp_ct6_any before its programs attach
    (agent/takeover/into_ebpf.py, _carry6), so their next datagrams are no new flows; iptables mode
    through the same nf_conntrack entries. Without the carry the tc path decides each flow again:
    all twenty on the one endpoint by chance, 2**-20."""
    from agent.takeover.flows import NatFlow, Timeouts
    from agent.takeover.nfct import create_flows

    lab = dual.lab
    client, backend = lab.pod("pod-1-1"), lab.pod("pod-2-2")
    ports = range(47000, 47020)
    flows = [
        NatFlow(17, (client.ip6, VIP, p, UDP_PORT), (backend.ip6, client.ip6, HTTP6_PORT, p)) for p in ports
    ]
    forget_flows(dual, VIP)
    agent = dual.agents[0]
    agent.stop()
    assert create_flows(lab.node(1).ns, flows, Timeouts()).created == len(flows)
    mark = agent.log_mark()
    agent.start()
    agent.wait_version(dual.version, after=mark)
    before = new_flows(dual)
    out = lab.run(
        client, sys.executable, "-c", FROM_PORTS, VIP, str(UDP_PORT), str(ports[0]), str(ports[-1] + 1)
    )
    assert out.stdout.split() == ["pod-2-2"] * len(flows), out.stdout
    if dual.mode == "ebpf":
        assert ct6_udp_flows(dual, VIP, UDP_PORT) >= len(flows)
        assert new_flows(dual) == before, "each datagram a carried flow's"


def refusals(c: Cluster) -> dict[str, int]:
    """eBPF mode: node1's refusal counters (IPv4's, which the tc IPv6 path counts under too)."""
    if c.mode != "ebpf":
        return {}
    stats = c.bpf_stats(1)
    return {
        k: stats[k] for k in ("drop_no_endpoints", "drop_no_local", "drop_source_range", "drop_icmp_rate")
    }


# TCP connections to [vip]:port, each from a new socket: what each met (refused, answered, timeout)
# and after how many milliseconds.
CONNECT = r"""
import socket, sys, time
for _ in range(int(sys.argv[3])):
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); s.settimeout(3)
    started = time.monotonic()
    try:
        s.connect((sys.argv[1], int(sys.argv[2]))); kind = "answered"
    except ConnectionRefusedError:
        kind = "refused"
    except OSError:
        kind = "timeout"
    print(kind, round((time.monotonic() - started) * 1000))
    s.close()
"""


def test_an_ipv6_cluster_ip_without_endpoints_refuses_a_connection_at_once(dual: Cluster) -> None:
    """kube-proxy's REJECT: each of five connections from a pod is refused (ECONNREFUSED), not
    timed out: by the answer to the SYN's first retransmission (1 s) at the latest. Both modes
    take that second (about 1.02 s each here): the first SYN is answered too (eBPF mode counts two
    rejects a connection), but not taken; our reading, unverified, is that it comes back while
    connect() still holds the socket, where tcp_v6_err keeps an error as a soft one (README,
    Machine facts). In eBPF mode tc answers every SYN (an ICMPv6 port unreachable from
    the ClusterIP, counted DROP_NO_ENDPOINTS); before, ip6tables beside it did, and the counter
    stayed."""
    before = refusals(dual)
    out = dual.lab.run(
        dual.lab.pod("pod-1-1"), sys.executable, "-c", CONNECT, NONE_VIP, "80", "5", timeout=30
    )
    results = [line.split() for line in out.stdout.splitlines()]
    assert [kind for kind, _ in results] == ["refused"] * 5, out.stdout
    assert all(int(ms) < 2000 for _, ms in results), out.stdout
    if dual.mode == "ebpf":
        after = refusals(dual)
        assert after["drop_no_endpoints"] - before["drop_no_endpoints"] >= 5, (before, after)


def test_an_ipv6_node_port_of_policy_local_without_a_local_endpoint_drops(dual: Cluster) -> None:
    """externalTrafficPolicy Local, the one endpoint on node2: node1 drops the external client's
    connection (kube-proxy's KUBE-MARK-DROP: curl times out, exit 28), node2 serves it. In eBPF
    mode the drop is tc's (DROP_NO_LOCAL)."""
    lab = dual.lab
    before = refusals(dual)
    with pytest.raises(CommandError) as dropped:
        lab.curl(lab.client, f"http://[{lab.node(1).ip6}]:{NO_LOCAL_PORT}/", timeout=2.0, args=["-g"])
    assert dropped.value.returncode == 28, dropped.value
    assert fetch(dual, lab.client, f"http://[{lab.node(2).ip6}]:{NO_LOCAL_PORT}/") == "pod-2-2"
    if dual.mode == "ebpf":
        after = refusals(dual)
        assert after["drop_no_local"] - before["drop_no_local"] >= 1, after


def test_a_client_outside_an_ipv6_load_balancers_source_ranges_is_dropped(dual: Cluster) -> None:
    """loadBalancerSourceRanges: the client outside one LoadBalancer IP's ranges is dropped (curl
    times out), inside the other's it is served. In eBPF mode the drop is tc's (DROP_SOURCE_RANGE)
    and the served connection a new tc flow."""
    lab = dual.lab
    lab.run(lab.client, "ip", "-6", "route", "replace", "fd00:10:97::/64", "via", lab.node(1).ip6)
    before, flows = refusals(dual), new_flows(dual)
    assert fetch(dual, lab.client, f"http://[{LB_ALLOW}]:80/") == "pod-1-2"
    with pytest.raises(CommandError) as dropped:
        lab.curl(lab.client, f"http://[{LB_DENY}]:80/", timeout=2.0, args=["-g"])
    assert dropped.value.returncode == 28, dropped.value
    if dual.mode == "ebpf":
        after = refusals(dual)
        assert after["drop_source_range"] - before["drop_source_range"] >= 1, after
        assert new_flows(dual) - flows >= 1
        assert dnat_flows(dual, LB_ALLOW) == ""


def test_an_sctp_association_through_an_ipv6_cluster_ip(dual: Cluster) -> None:
    """upstream's "should function for pod-Service: sctp" over IPv6 (lab/sctppeer.py: the lab
    kernel has no SCTP sockets): the INIT-ACK and the echo come back from the ClusterIP's address
    and port, the backend sees the pod's own address at its target port, every CRC32c right. In
    eBPF mode the association is tc's (its entry in ekp_ct6_any, none in nf_conntrack); before,
    the path left SCTP to ip6tables."""
    lab = dual.lab
    client, backend = lab.pod("pod-1-1"), lab.pod(SCTP_POD)
    forget_flows(dual, SCTP_VIP)
    server = lab.popen(
        backend,
        *(sys.executable, PEER, "server", "--port", str(SCTP_TARGET), "--seconds", "30", "--ipv6"),
        name="sctp6-server",
    )
    try:
        lab.wait_log(server, "ready", timeout=10)
        res = lab.run(
            client,
            *(sys.executable, PEER, "client", "--addr", SCTP_VIP, "--port", str(SCTP_PORT)),
            *("--sport", "42000"),
            timeout=30,
        )
    finally:
        lab.stop(server, timeout=5)
    got = json.loads(res.stdout)
    for what in ("init_ack", "echo"):
        p = got[what]
        assert p is not None, got
        assert (p["src"], p["sport"], p["dst"], p["dport"], p["crc_ok"]) == (
            SCTP_VIP,
            SCTP_PORT,
            client.ip6,
            42000,
            True,
        ), p
    seen = [
        json.loads(line)
        for line in lab.log_of(server).splitlines()
        if line.startswith("{") and json.loads(line)["dport"] == SCTP_TARGET
    ]
    assert seen and all((p["src"], p["dst"], p["crc_ok"]) == (client.ip6, backend.ip6, True) for p in seen), (
        seen
    )
    flows = dnat_flows(dual, SCTP_VIP)
    if dual.mode == "ebpf":
        assert ct6_udp_flows(dual, SCTP_VIP, SCTP_PORT) >= 1
        assert flows == "", flows
    else:
        assert f"dport={SCTP_PORT} " in flows, flows


def test_ip6tables_keeps_only_the_services_the_ebpf_programs_leave_to_it(dual: Cluster) -> None:
    """eBPF mode, the IPv6 SNAT granted (the fixture waited for it): node1's ip6tables holds no
    KUBE-SVC-* for the Services the tc path and the socket programs serve (every test of the module
    ran with them gone), only for SCTP's and the source ranges' LB IPs' (agent/model/tc6_leaves.py);
    a pod reaches the host-network backend through tc (its flow handed to the node's stack, no
    ip6tables DNAT: before v6legacy ip6tables kept its rules and DNATed it). iptables mode: every
    Service has its rules."""
    pod = dual.lab.pod("pod-1-1")
    forget_flows(dual, HOST_VIP)
    before = new_flows(dual)
    assert fetch(dual, pod, f"http://[{HOST_VIP}]:80/") == "node1"
    assert fetch(dual, pod, f"http://[{HOST_VIP}]:80/ip") == pod.ip6, "the pod's own address"
    vips = kube_services_vips(dual)
    if dual.mode == "ebpf":
        assert vips == LEFT_VIPS
        assert HOST_VIP not in vips
        assert new_flows(dual) - before >= 2, "translated by tc"
        assert dnat_flows(dual, HOST_VIP) == "", "no ip6tables DNAT"
        rules = dual.lab.run(dual.lab.node(1), "ip6tables-save", "-t", "nat").stdout
        assert "-A KUBE-POSTROUTING" in rules and "MASQUERADE" in rules, "the masquerade stays"
    else:
        assert vips >= LEFT_VIPS | {VIP, DNS_VIP, PMTU_VIP, CLOSED_VIP}
