"""`make bench`'s traffic rows in eBPF mode, in the order it measures them: the socket LB for pods
first, then an agent with legacy host routing on the same lab (issue 20's IPv6 legacy-routing
errors and 1 s p99s). The client's ports are chosen by the address its socket holds
(`bench.run.client_ports`): with the socket LB a ClusterIP socket holds the backend, so it takes
the pod IP's ports and leaves the backend no TIME_WAIT socket on a 4-tuple the next rows' ClusterIP
sockets (another sequence number and timestamp offset) would reuse."""

from __future__ import annotations

import os
import re

import pytest

from bench.run import PORTS_VIP, Bench, Settings, nginx_workers
from bench.workload import services_file
from lab import NGINX_PORT, Lab, LabFactory
from lab.core import Pod
from lab.harness import Cluster

pytestmark = pytest.mark.kernel

SETTINGS = Settings(
    services=1,
    seconds=2,
    rounds=1,
    threads=1,
    connections=8,
    probes=200,
    modes=("ebpf",),
    iptables_backend=None,
    legacy_compare=False,
    ipv6=True,
)


def serve(lab: Lab, cluster: Cluster, server: Pod) -> None:
    """The bench's measured Service (both families) to nginx on `server`, synced by the agent."""
    f = services_file(server.ip, NGINX_PORT, lab.nodes[0].name, 1, server.ip6)
    tmp = cluster.services_file.with_suffix(".tmp")
    tmp.write_bytes(f.data)
    os.replace(tmp, cluster.services_file)
    cluster.agents[0].wait_version(f.version, timeout=60)


def time_wait_client_ports(lab: Lab, server: Pod) -> set[int]:
    """Client ports of the backend's TIME_WAIT sockets on nginx's port (both families)."""
    out = lab.run(server, "ss", "-Htan", "state", "time-wait", f"( sport = :{NGINX_PORT} )").stdout
    return {int(m.group(1)) for m in re.finditer(r"\S+:(\d+)\s*$", out, re.MULTILINE)}


def syn_retransmits(lab: Lab, pod: Pod) -> int:
    out = lab.run(pod, "nstat", "-az", "TcpExtTCPSynRetrans").stdout
    m = re.search(r"^TcpExtTCPSynRetrans\s+(\d+)", out, re.MULTILINE)
    assert m is not None, out
    return int(m.group(1))


def test_the_socket_lb_rows_leave_the_legacy_rows_no_time_wait_to_meet(make_lab: LabFactory) -> None:
    lab = make_lab(1, 2, servers=False, ipv6=True)
    client, server = lab.pods
    workers = nginx_workers(lab.start_nginx(server).pid)
    runner = Bench(SETTINGS)
    extra = ["--iptables-sync-period=1h", "--bpf-host-routing=legacy"]

    first = Cluster(lab, "ebpf", agent_nodes=[1], extra=extra)
    for a in first.agents:
        a.socket_lb_pods = True
    try:
        first.start()
        serve(lab, first, server)
        runner.measure(lab, client, server, workers, runner.state("ebpf", "1, socket LB", 1), socket_lb=True)
    finally:
        assert first.stop() == []
    lo, hi = (int(p) for p in PORTS_VIP.split())
    left = time_wait_client_ports(lab, server)
    assert left, "the socket LB rows left the backend no TIME_WAIT socket: nothing here could collide"
    met = {p for p in left if lo <= p <= hi}
    assert not met, "the backend holds TIME_WAIT 4-tuples of the ClusterIP rows' ports"

    second = Cluster(lab, "ebpf", agent_nodes=[1], extra=extra)
    try:
        second.start()
        serve(lab, second, server)
        before = syn_retransmits(lab, client)
        runner.measure(lab, client, server, workers, runner.state("ebpf", "1, legacy", 1))
        retransmits = syn_retransmits(lab, client) - before
    finally:
        assert second.stop() == []
    legacy = runner.results.states[-1]
    assert legacy.vip is not None and legacy.vip6 is not None
    # each ClusterIP connect was answered at once: no backend TIME_WAIT sent its SYN an old ACK
    assert retransmits == 0
    assert legacy.vip.errors == legacy.vip6.errors == 0
