"""SCTP through Services, both modes: "should function for pod-Service: sctp" (a pod to a cluster IP
and to a NodePort), "should function for endpoint-Service: sctp" (a backend to its own Service) and
an external client to a NodePort.

The lab kernel has no SCTP sockets (`CONFIG_IP_SCTP` is off), so both ends are lab/sctppeer.py:
raw IP sockets that craft and capture the packets. The client sends an INIT to the Service, the
backend answers it with an INIT-ACK and echoes a DATA chunk; every packet is checked where it
arrives: addresses, ports (the Service's port 5060 differs from the target port 5061, so every
translation rewrites a port) and its CRC32c, by a CRC written apart from both modes' code.
iptables mode gets SCTP from netfilter (nf_nat_proto_sctp recomputes the CRC), eBPF mode from the
data path (bpf/ekp_sctp.h updates it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lab.harness import Cluster, ep
from lab.objects import Port, service, with_endpoints

pytestmark = pytest.mark.kernel

PEER = str(Path(__file__).resolve().parents[2] / "lab" / "sctppeer.py")
N1 = "192.168.0.11"
SERVICE_PORT, TARGET_PORT = 5060, 5061
DATA, INIT, INIT_ACK = 0, 1, 2

# (client, backend, frontend): what upstream's tests dial, and the external client
CASES = [
    ("pod-1-1", "pod-2-1", "clusterip"),  # pod-Service, across the nodes
    ("pod-1-1", "pod-1-2", "clusterip"),  # pod-Service, a backend on the client's node
    ("pod-1-1", "pod-2-1", "nodeport"),  # pod-Service: a pod to node1's NodePort (masqueraded)
    ("pod-2-3", "pod-2-3", "clusterip"),  # endpoint-Service: the backend dials its own Service
    ("client", "pod-2-1", "nodeport"),  # from outside through node1, source translated to node1
]


def peer_log(lab: Any, proc: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lab.log_of(proc).splitlines() if line.startswith("{")]


@pytest.mark.parametrize(("client", "backend", "via"), CASES)
def test_sctp_association_through_a_service_keeps_valid_checksums_both_ways(
    cluster: Cluster, client: str, backend: str, via: str
) -> None:
    n = CASES.index((client, backend, via))
    vip, node_port = f"10.96.6.{60 + n}", 30660 + n
    port = Port("sip", SERVICE_PORT, TARGET_PORT, "SCTP", node_port=node_port)
    cluster.apply(with_endpoints(service(f"sctp-{n}", vip, [port], type="NodePort"), [ep(cluster, backend)]))
    lab = cluster.lab
    addr, dport = (vip, SERVICE_PORT) if via == "clusterip" else (N1, node_port)
    sport = 41000 + n
    server = lab.popen(
        lab.pod(backend),
        sys.executable,
        PEER,
        "server",
        "--port",
        str(TARGET_PORT),
        "--seconds",
        "30",
        name="sctp-server",
    )
    try:
        lab.wait_log(server, "ready", timeout=10)
        res = lab.run(
            client,
            sys.executable,
            PEER,
            "client",
            "--addr",
            addr,
            "--port",
            str(dport),
            "--sport",
            str(sport),
            timeout=30,
        )
    finally:
        lab.stop(server, timeout=5)
    got = json.loads(res.stdout)
    seen = [p for p in peer_log(lab, server) if p["dport"] == TARGET_PORT]
    client_ip = lab.client.ip if client == "client" else lab.pod(client).ip
    backend_ip = lab.pod(backend).ip

    # At the client: the INIT-ACK and the echo come from the address and port it dialled.
    for what, chunk in (("init_ack", INIT_ACK), ("echo", DATA)):
        p = got[what]
        assert p is not None, (what, got, seen)
        assert (p["src"], p["sport"], p["dst"], p["dport"], p["chunk"]) == (
            addr,
            dport,
            client_ip,
            sport,
            chunk,
        )
        assert p["crc_ok"], p
    assert got["echo"]["data"] == "echo hello sctp"

    # At the backend: the INIT and the DATA arrive at its own address and target port.
    kinds = {p["chunk"] for p in seen}
    assert {INIT, DATA} <= kinds, seen
    for p in seen:
        assert (p["dst"], p["dport"]) == (backend_ip, TARGET_PORT) and p["crc_ok"], p
    sources = {(p["src"], p["sport"]) for p in seen}
    assert len(sources) == 1, seen  # one association, one source
    src, src_port = sources.pop()
    if via == "clusterip" and client != backend:
        assert (src, src_port) == (client_ip, sport)  # a cluster IP keeps the pod's address
    elif client == backend:
        assert src != backend_ip  # hairpin: source-translated to the node, or its reply is lost
    else:
        assert src == N1  # a NodePort (ETP Cluster) masquerades to the node it came through
