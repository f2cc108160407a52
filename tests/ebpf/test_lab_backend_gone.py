"""A TCP flow to a deleted pod frees its conntrack entries and its SNAT port within
--bpf-ct-timeout-tcp-backend-gone (issue 16 item 6), read back with `agent inspect conntrack` from
a real agent's pins.

One node: a pod holds a connection to a line echo in another pod through node1's NodePort
(externalTrafficPolicy Cluster: source-translated to the node, so the flow holds a SNAT port).
The backend pod is then deleted: its endpoint leaves the Service and its device goes down, so the
client's lines go unanswered and TCP retransmits them. Before, such a flow kept both entries and
the port for the 24 h established timeout; now only the backend's packets renew a flow whose
backend left every Service, and tcp_orphan_s (5 s here) after its last one the next packet of the
flow finds it abandoned and deletes it. eBPF mode only: iptables mode's flows are nf_conntrack's,
which has its own unacknowledged-data timeout (300 s) and no such setting of the agent's.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from lab import Lab
from lab.core import PODSERVER
from lab.harness import CLIENT, Cluster, ep
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

N1 = "192.168.0.11"
NODE_PORT = 30720
ECHO = 7000
GONE_S = 5


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=2) as lab:
        c = Cluster(lab, "ebpf", extra=[f"--bpf-ct-timeout-tcp-backend-gone={GONE_S}s"])
        c.start()
        try:
            yield c
        finally:
            assert not c.stop()


def inspect(cluster: Cluster, what: str) -> str:
    """`agent inspect <what>` of node1's agent, from its pins."""
    pins = f"--bpf-pin-path={cluster.agents[0].pin_path}"
    argv = [sys.executable, "-m", "agent", "inspect", what, pins]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


def flow_lines(cluster: Cluster) -> list[str]:
    """`agent inspect conntrack` lines of flows through the NodePort (FORWARD and REPLY entries)."""
    return [line for line in inspect(cluster, "conntrack").splitlines() if f"fe={N1}:{NODE_PORT}" in line]


def test_a_tcp_flow_to_a_deleted_pod_frees_its_conntrack_and_snat_port_within_the_timeout(
    cluster: Cluster,
) -> None:
    lab = cluster.lab
    backend = lab.pod("pod-1-2")
    echo = lab.popen(
        backend,
        sys.executable,
        "-I",
        "-S",
        str(PODSERVER),
        f"--name={backend.name}",
        "--http-port=8080",
        "--udp-port=9000",
        f"--tcp-echo-port={ECHO}",
        name="echo",
    )
    lab.wait_tcp(backend, backend.ip, ECHO, proc=echo)
    svc = service("echo", "10.96.6.20", [Port("echo", ECHO, ECHO, node_port=NODE_PORT)], type="NodePort")
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-1-2")]))
    stop = lab.tmpdir / "hold-stop"  # type: ignore[operator]
    client = lab.popen(
        "pod-1-1",
        sys.executable,
        CLIENT,
        "hold",
        "--addr",
        N1,
        "--port",
        str(NODE_PORT),
        "--stop-file",
        str(stop),
        "--interval",
        "0.2",
        "--max-s",
        "120",
        "--timeout",
        "60",  # the client waits for its echo, retransmitting: the flow stays established
        name="hold",
    )
    try:
        deadline = time.monotonic() + 20
        while len(lines := flow_lines(cluster)) < 2:
            assert time.monotonic() < deadline, f"the flow never showed up: {lines}"
            time.sleep(0.2)
        fwd = next(line for line in lines if " forward " in line)
        snat = fwd.split(" snat=")[1].split()[0]  # node1:port, the SNAT source the flow holds
        assert snat.startswith(f"{N1}:")
        assert any(f"-> {snat}/TCP reply" in line for line in lines), lines  # its REPLY entry

        # The pod is deleted: its endpoint leaves the Service, its device goes, nothing answers.
        cluster.apply([svc])
        lab.run(backend, "ip", "link", "set", "eth0", "down")
        lab.stop(echo)
        gone_at = time.monotonic()
        # The client's retransmissions find the backend unlisted and flag the flow, not renewing it.
        lines = flow_lines(cluster)
        while not any("ORPHAN" in line for line in lines):
            assert lines, "freed before it was flagged"
            assert time.monotonic() - gone_at < GONE_S, f"never flagged: {lines}"
            time.sleep(0.2)
            lines = flow_lines(cluster)
        # Abandoned GONE_S after the backend's last packet; the client's next retransmission
        # (exponential backoff: up to 6.4 s apart by then) finds it and deletes both entries.
        while lines := flow_lines(cluster):
            assert time.monotonic() - gone_at < GONE_S + 15, (
                f"still held: {lines}\n{inspect(cluster, 'maps')}\nclient: {lab.log_of(client)}"
            )
            time.sleep(0.5)
        assert not any(snat in line for line in flow_lines(cluster))
    finally:
        stop.touch()
        lab.stop(client, timeout=10)
