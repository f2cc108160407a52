"""150,000 spoofed SYNs must not cut idle established connections, both modes (issue 21, item 2).

The conntrack table holds 131,072 flows here (`--bpf-ct-global-tcp-max=262144` entries, what
kube-proxy's defaults give a 2-CPU node, set explicitly so the case does not depend on the
machine's CPUs); 150,000 spoofed SYNs are more flows than that. They come from a pod to a
ClusterIP, or from the external client to a NodePort with externalTrafficPolicy Local (no
credentials needed), written straight to the device with an AF_PACKET socket (tests/adversarial/
flood.py: 150,000 frames built and sent in a few seconds; a real flood, not BPF_PROG_TEST_RUN, so
the whole path of both modes is under it). Meanwhile two connections sit idle: one from a pod
through the ClusterIP, one from the external client through the NodePort, each to a line echo.

Before: eBPF mode's conntrack was one LRU table; the flood filled it and the least recently used
entries (the idle connections' own) were evicted: their next line was dropped (`no_flow`).
iptables mode kept them (nf_conntrack drops unassured entries first). Now the early-drop queues
(bpf/ekp_ctq.h) delete the flood's flows once a ring of newer ones followed (a flood to a ClusterIP
from sources outside the cluster CIDR is masqueraded, and the SNAT port search takes an unanswered
flow's port first), and both connections answer in both modes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab import Lab
from lab.core import PODSERVER
from lab.harness import CLIENT, Cluster, ep
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

N1 = "192.168.0.11"
VIP = "10.96.6.1"
NODE_PORT = 30700
ECHO = 7000
SYNS = 150_000
CT_TCP_ENTRIES = 262_144  # 131,072 flows
FLOOD = str(Path(__file__).with_name("flood.py"))


@pytest.fixture(scope="module", params=["ebpf", "iptables"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=3) as lab:
        echo = lab.pod("pod-1-2")
        proc = lab.popen(
            echo,
            sys.executable,
            "-I",
            "-S",
            str(PODSERVER),
            f"--name={echo.name}",
            "--http-port=8080",
            "--udp-port=9000",
            f"--tcp-echo-port={ECHO}",
            name="echo",
        )
        lab.wait_tcp(echo, echo.ip, ECHO, proc=proc)
        c = Cluster(lab, request.param, extra=[f"--bpf-ct-global-tcp-max={CT_TCP_ENTRIES}"])
        c.start()
        try:
            clusterip = service("echo", VIP, [Port("echo", ECHO, ECHO)])
            local = service(
                "echo-local",
                "10.96.6.2",
                [Port("echo", ECHO, ECHO, node_port=NODE_PORT)],
                type="NodePort",
                externalTrafficPolicy="Local",
            )
            c.apply(
                [*with_endpoints(clusterip, [ep(c, "pod-1-2")]), *with_endpoints(local, [ep(c, "pod-1-2")])]
            )
            yield c
        finally:
            failures = c.stop()
        assert not failures, failures


def mac(cluster: Cluster, ns: Any, dev: str) -> str:
    return cluster.lab.run(ns, "cat", f"/sys/class/net/{dev}/address").stdout.strip()


class Idle:
    """lab/client.py idle in a namespace: established, then idle until `go()`."""

    def __init__(self, cluster: Cluster, where: str, addr: str, port: int, name: str) -> None:
        tmp = cluster.lab.tmpdir
        assert tmp is not None
        self.lab = cluster.lab
        self.ready, self.go_file, self.out = tmp / f"{name}.ready", tmp / f"{name}.go", tmp / f"{name}.json"
        for path in (self.ready, self.go_file):
            path.unlink(missing_ok=True)
        args = ["idle", "--addr", addr, "--port", str(port), "--ready-file", str(self.ready)]
        args += ["--go-file", str(self.go_file), "--max-s", "120"]
        with open(self.out, "wb") as f:
            self.proc = self.lab.popen(where, sys.executable, CLIENT, *args, name=name, stdout=f)

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            assert self.proc.poll() is None, self.out.read_text()
            assert time.monotonic() < deadline, "the idle connection was not established"
            time.sleep(0.02)

    def finish(self) -> dict[str, Any]:
        self.go_file.touch()
        self.proc.wait(timeout=30)
        result: dict[str, Any] = json.loads(self.out.read_text())
        return result


FLOODS = {
    # from pod-1-3 to the ClusterIP, out of its eth0 to its gateway (the node side of its veth)
    "pod-to-clusterip": ("pod-1-3", VIP, ECHO),
    # from the external client to node1's NodePort (externalTrafficPolicy Local)
    "outside-to-nodeport": ("client", N1, NODE_PORT),
}


@pytest.mark.parametrize("flood", list(FLOODS))
def test_150000_spoofed_syns_do_not_cut_idle_established_connections(cluster: Cluster, flood: str) -> None:
    lab = cluster.lab
    idle = [
        Idle(cluster, "pod-1-1", VIP, ECHO, f"{flood}-clusterip"),
        Idle(cluster, "client", N1, NODE_PORT, f"{flood}-nodeport"),
    ]
    for conn in idle:
        conn.wait_ready()
    before = cluster.bpf_stats() if cluster.mode == "ebpf" else {}
    where, dst, dport = FLOODS[flood]
    gateway = (
        mac(cluster, "node1", lab.pod(where).host_iface)
        if where != "client"
        else mac(cluster, "node1", "eth0")
    )
    res = lab.run(
        where,
        sys.executable,
        FLOOD,
        "syn",
        "--iface=eth0",
        f"--src-mac={mac(cluster, where, 'eth0')}",
        f"--dst-mac={gateway}",
        f"--dst={dst}",
        f"--dport={dport}",
        f"--count={SYNS}",
        timeout=120,
    )
    sent = json.loads(res.stdout)
    assert sent["sent"] == SYNS
    results = [conn.finish() for conn in idle]
    for via, result in zip(("ClusterIP", "NodePort"), results, strict=True):
        assert result["first"] and result["after"], (via, result, sent)
    if cluster.mode == "ebpf":
        after = cluster.bpf_stats()
        delta = {k: after[k] - before[k] for k in after}
        # The flood went through conntrack and all but its last 65,536 flows were deleted early:
        # by the early-drop rings, or, when the flood is source-translated (its spoofed sources
        # are outside the cluster CIDR, so pod-to-ClusterIP is masqueraded as in kube-proxy), by
        # the SNAT port search taking an unanswered flow's port once the range is used up.
        early = delta["evict_unreplied"] + delta["evict_unassured"] + delta["early_drop"]
        assert early > SYNS - CT_TCP_ENTRIES // 4 - 10_000, sorted(delta.items())
        assert delta["drop_no_flow"] == 0, delta
