"""SCTP through a ClusterIP and a NodePort in iptables mode, on a lab node with a real agent.

The lab kernel has no SCTP sockets (`CONFIG_IP_SCTP` is off) but netfilter's SCTP conntrack, NAT
and `-m sctp` are built in: a client pod sends an SCTP INIT with a raw socket (scapy computes the
CRC32c that conntrack checks), and a raw socket in the backend pod reports the addresses of every
SCTP packet that arrives. kube-proxy's rules must deliver the INIT to the backend's own address
and target port. eBPF mode passes SCTP to the stack untranslated (README's SCTP row): no test here
claims it.
"""

from __future__ import annotations

import json
import sys

import pytest

from lab import LabFactory
from lab.harness import Cluster, ep
from lab.objects import Port, service, with_endpoints

pytestmark = pytest.mark.kernel

VIP, SERVICE_PORT, TARGET_PORT, NODE_PORT = "10.96.6.60", 5060, 5061, 30660

# In the backend pod: every SCTP packet (IP protocol 132) that arrives, as JSON lines:
# source, destination, destination port.
RECEIVER = """
import json, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, 132)
s.settimeout(float(sys.argv[1]))
print(json.dumps({"ready": True}), flush=True)
try:
    while True:
        data = s.recv(65535)
        ihl = (data[0] & 0x0F) * 4
        dport = struct.unpack("!H", data[ihl + 2 : ihl + 4])[0]
        src, dst = socket.inet_ntoa(data[12:16]), socket.inet_ntoa(data[16:20])
        print(json.dumps({"src": src, "dst": dst, "dport": dport}), flush=True)
except socket.timeout:
    pass
"""

# In the client: one SCTP INIT from argv[4] to argv[1]:argv[2], from a fixed source port (the
# source given: scapy's own route lookup finds none in a pod's namespace and sends from 0.0.0.0).
SENDER = """
import sys
from scapy.all import IP, SCTP, SCTPChunkInit, send
send(IP(src=sys.argv[4], dst=sys.argv[1]) / SCTP(sport=40000 + int(sys.argv[3]), dport=int(sys.argv[2]))
     / SCTPChunkInit(init_tag=0x1234, a_rwnd=65535, n_out_streams=1, n_in_streams=1, init_tsn=1),
     verbose=False)
"""


def test_sctp_through_a_cluster_ip_and_a_node_port_reaches_the_backend(make_lab: LabFactory) -> None:
    lab = make_lab(nodes=1, pods_per_node=2, servers=False)
    cluster = Cluster(lab, "iptables")
    cluster.start()
    try:
        port = Port("sip", SERVICE_PORT, TARGET_PORT, "SCTP", node_port=NODE_PORT)
        backend = lab.pod("pod-1-2")
        cluster.apply(with_endpoints(service("sctp", VIP, [port], type="NodePort"), [ep(cluster, "pod-1-2")]))
        receiver = lab.popen(backend, sys.executable, "-c", RECEIVER, "20", name="sctp-receiver")
        lab.wait_log(receiver, "ready", timeout=10)
        targets = [(VIP, SERVICE_PORT), (lab.nodes[0].ip, NODE_PORT)]
        client = lab.pod("pod-1-1").ip
        for n, (addr, dport) in enumerate(targets):
            lab.run("pod-1-1", sys.executable, "-c", SENDER, addr, str(dport), str(n), client, timeout=60)
        lab.stop(receiver, timeout=5)
        seen = [json.loads(line) for line in lab.log_of(receiver).splitlines() if '"dst"' in line]
    finally:
        failures = cluster.stop()
    assert not failures, failures
    # Both INITs arrived translated: to the backend's own address and target port.
    assert {(p["dst"], p["dport"]) for p in seen} == {(backend.ip, TARGET_PORT)}, seen
    assert len(seen) >= len(targets), seen
    # The positive control of the translation: no packet reached the backend untranslated.
    assert all(p["dst"] != VIP for p in seen), seen
    assert client in {p["src"] for p in seen}, seen  # the ClusterIP flow keeps the pod's address
