"""Pods balanced at connect(): the agent's default in eBPF mode (`--bpf-socket-lb-host-namespace-only`
false, as Cilium's socketLB.hostNamespaceOnly), in both modes.

The lab pins the flag true for every other test (lab/harness.py: their packet-level checks read
the per-packet path's conntrack, SNAT ports and carried flows); here node1's agent runs with the
agent's own default. A pod's TCP connection to a ClusterIP then goes to the backend's address from
its first packet, and the tc programs, which see a pod -> pod IP flow, translate nothing; the
application still sees the address it dialled (getpeername4, recvmsg4), as with kube-proxy, whose
translation happens in packets and never shows in the socket. In iptables mode the flag does not
apply: the same dials are kube-proxy's behaviour the eBPF path must match.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from lab.harness import CLIENT, REPO, Agent, Cluster, ep
from lab.objects import Port, service, with_endpoints

pytestmark = pytest.mark.kernel

VIP = "10.96.51.1"
HTTP = Port("http", 80, 8080)
ECHO = Port("udp", 90, 9000, "UDP")
BACKENDS = ("pod-1-3", "pod-2-4")


@pytest.fixture
def pods_at_connect(cluster: Cluster) -> Iterator[Agent]:
    """node1's agent restarted with the agent's default for pods' sockets, restarted as the lab
    pins it after the test."""
    agent = cluster.agents[0]
    cluster.apply(
        with_endpoints(service("pods-at-connect", VIP, [HTTP, ECHO]), [ep(cluster, b) for b in BACKENDS])
    )
    restart(agent, None, cluster.version)
    try:
        yield agent
    finally:
        restart(agent, False, cluster.version)


def restart(agent: Agent, pods: bool | None, version: str) -> None:
    agent.stop()
    agent.socket_lb_pods = pods
    agent.start()
    agent.wait_version(version)


def client(cluster: Cluster, *args: str) -> dict[str, Any]:
    """lab/client.py in pod-1-1, in the pod's cgroup (under node1's, where the socket programs are)."""
    out: dict[str, Any] = json.loads(cluster.lab.run("pod-1-1", sys.executable, CLIENT, *args).stdout)
    return out


def inspect(agent: Agent, *what: str) -> list[str]:
    res = subprocess.run(
        [sys.executable, "-m", "agent", "inspect", *what, f"--bpf-pin-path={agent.pin_path}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=str(REPO),
    )
    return res.stdout.splitlines()


def test_a_pods_connection_to_a_cluster_ip_shows_the_cluster_ip_and_reaches_a_backend(
    cluster: Cluster, pods_at_connect: Agent
) -> None:
    """A pod dials a ClusterIP (TCP, and UDP with the reply's source checked): getpeername() and
    recvfrom() name the ClusterIP, every backend answers. eBPF mode: the socket programs sent the
    pod's sockets to the backends (counted; their table names the ClusterIP for each UDP socket,
    while a closed TCP socket's entry went with it) and the tc programs translated none of it (no
    conntrack entry through the ClusterIP)."""
    # 32 of each: one of the two backends taking them all by chance is 2^-31 (12 gave 2^-11).
    tcp = client(cluster, "peer", "--addr", VIP, "--port", "80", "--count", "32")
    assert tcp["peers"] == {f"{VIP}:80": 32} and not tcp["errors"], tcp
    assert set(tcp["bodies"]) == set(BACKENDS), tcp
    udp = client(cluster, "udp", "--addr", VIP, "--port", "90", "--count", "32", "--sources")
    assert udp["lost"] == 0 and udp["sources"] == {f"{VIP}:90": 32}, udp
    assert set(udp["replies"]) == set(BACKENDS), udp
    if cluster.mode != "ebpf":
        return
    through_tc = [ln for ln in inspect(pods_at_connect, "conntrack") if f" fe={VIP}:" in ln]
    assert through_tc == [], "the tc programs translated the pod's connections:\n" + "\n".join(through_tc)
    sockets = inspect(pods_at_connect, "sockets", "stats")
    assert any(ln.endswith(" all namespaces") for ln in sockets if ln.startswith("sockcfg ")), sockets
    # The UDP client's unconnected sockets keep their entries (sendto() names no peer the socket
    # holds at close), each naming the backend it was sent to; the closed TCP sockets left none
    # (sock_release), and the counter says the socket programs sent them.
    sent = {ln.split()[2] for ln in sockets if ln.startswith("sock ") and f" shown as {VIP}:" in ln}
    assert sent == {f"{ep(cluster, b).ip}:9000/UDP" for b in BACKENDS}, sockets
    (translated,) = (int(ln.split()[2]) for ln in sockets if ln.startswith("stat sock_translated "))
    assert translated >= 32 + 32, sockets
