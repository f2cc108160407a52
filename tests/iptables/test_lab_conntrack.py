"""kube-proxy's conntrack settings on a lab node, in the style of upstream's e2e test
"KubeProxy should set TCP CLOSE_WAIT timeout" (test/e2e/network/kube_proxy.go): a real agent in
iptables mode for the node, a client that leaves a connection half-closed by the server, and the
node's conntrack entry for it in CLOSE_WAIT with kube-proxy's one-hour timeout."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import pytest

from lab import LabFactory
from lab.harness import Cluster, ep
from lab.objects import Port, service, with_endpoints

pytestmark = pytest.mark.kernel

# Connects, sends an HTTP/1.0 request (the pod server closes after answering), reads to the end
# and then keeps its side open: the connection stays in CLOSE_WAIT on the client side.
HALF_CLOSED_CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 80), timeout=5)
s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
while s.recv(4096):
    pass
print("half-closed", flush=True)
time.sleep(60)
"""


def test_tcp_close_wait_timeout_is_kube_proxys(make_lab: LabFactory) -> None:
    lab = make_lab(nodes=1, pods_per_node=2)
    node = lab.nodes[0]
    # A lab node reads the machine's nf_conntrack_max and cannot write it. A limit one above the
    # machine's (one flow per CPU never exceeds it) makes the agent try the write whatever the
    # machine holds: with kube-proxy's default wanted and already in place, it tries nothing.
    host_max = int(lab.run(node, "sysctl", "-n", "net.netfilter.nf_conntrack_max").stdout)
    wanted = host_max + 1
    cluster = Cluster(lab, "iptables", extra=["--conntrack-max-per-core=1", f"--conntrack-min={wanted}"])
    cluster.start()
    try:
        sysctl = {
            key: lab.run(node, "sysctl", "-n", f"net.netfilter.{key}").stdout.strip()
            for key in ("nf_conntrack_tcp_timeout_established", "nf_conntrack_tcp_timeout_close_wait")
        }
        assert sysctl == {
            "nf_conntrack_tcp_timeout_established": "86400",
            "nf_conntrack_tcp_timeout_close_wait": "3600",
        }
        # read-only in a lab node's namespace
        assert f"cannot set net.netfilter.nf_conntrack_max={wanted}" in cluster.agents[0].log()

        cluster.apply(
            with_endpoints(service("web", "10.96.0.10", [Port("http", 80, 8080)]), [ep(cluster, "pod-1-2")])
        )
        client = lab.popen(
            "pod-1-1", sys.executable, "-c", HALF_CLOSED_CLIENT, "10.96.0.10", name="half-closed"
        )
        lab.wait_log(client, "half-closed", timeout=10)
        entry = ""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not entry:
            listed = lab.run(
                node, "conntrack", "-L", "-p", "tcp", "--orig-dst", "10.96.0.10", check=False
            ).stdout
            entry = next((line for line in listed.splitlines() if "CLOSE_WAIT" in line), "")
            time.sleep(0.1)
        assert entry, "no CLOSE_WAIT conntrack entry for the connection"
        timeout = int(entry.split()[2])
        # upstream: the timeout must be within the last 100 s below one hour
        assert 3500 < timeout <= 3600, entry
        lab.stop(client)
    finally:
        assert cluster.stop() == []


def test_the_agents_sysctl_reads_see_the_nodes_namespace_without_a_process(make_lab: LabFactory) -> None:
    # agent.nodeinit.reads_in_process: the conntrack settings' reads come from /proc/sys in the
    # node's namespace, as `ip netns exec NS sysctl -n` reads them; a failed read falls back to it
    from agent.iptables.runner import Result
    from agent.nodeinit import reads_in_process

    lab = make_lab(nodes=1, pods_per_node=1)
    node = lab.nodes[0]
    key = "net.netfilter.nf_conntrack_tcp_timeout_close_wait"
    host = lab.run(None, "sysctl", "-n", key).stdout
    mine = str(int(host) + 7)  # another value than the host's: the namespace's own is read
    lab.run(node, "sysctl", "-w", f"{key}={mine}")
    asked: list[list[str]] = []

    def command(argv: Sequence[str]) -> Result:
        asked.append(list(argv))
        return Result(1, "", "sysctl: cannot stat /proc/sys/net/no/such: No such file or directory")

    read = reads_in_process(command, node.ns)
    assert read(["sysctl", "-n", key]) == Result(0, mine + "\n", "")
    assert read(["cat", "/sys/module/nf_conntrack/parameters/hashsize"]).stdout.strip().isdigit()
    assert asked == []
    assert read(["sysctl", "-n", "net.no.such"]).returncode == 1
    assert read(["sysctl", "-w", f"{key}=1"]).returncode == 1
    assert asked == [["sysctl", "-n", "net.no.such"], ["sysctl", "-w", f"{key}=1"]]
