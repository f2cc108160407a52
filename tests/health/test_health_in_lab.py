"""The health and metrics ports bind inside a lab node's namespace (`Config.netns`) and answer
there, as the lab's agents (which run in the host namespace) need: curl from the external client
and from the node itself, never from the host namespace."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from agent.clock import FakeClock
from agent.config import Config, Mode, NodeContext
from agent.health import ProxyHealth, ServiceHealthServer, healthz_server
from agent.metrics import Metrics
from agent.metrics.server import metrics_server
from lab import Lab
from lab.core import NsLike

pytestmark = pytest.mark.kernel


def curl(lab: Lab, where: NsLike, url: str) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of one GET, or status 0 when the connection was refused."""
    res = lab.run(where, "curl", "-s", "-i", "--max-time", "5", url, check=False)
    if res.returncode != 0:
        return 0, {}, res.stderr
    head, _, body = res.stdout.replace("\r\n", "\n").partition("\n\n")
    status_line, *lines = head.splitlines()
    headers = dict(line.split(": ", 1) for line in lines)
    return int(status_line.split()[1]), headers, body


@pytest.fixture(scope="module")
def lab(kernel_required: None) -> Iterator[Lab]:
    """One node with one pod; no pod servers are needed."""
    lab = Lab(1, 1).up()
    try:
        yield lab
    finally:
        lab.down()


def test_healthz_port_answers_inside_the_node_namespace(lab: Lab) -> None:
    node = lab.node(1)
    health = ProxyHealth(60.0, FakeClock())
    server = healthz_server(Config(netns=node.ns, healthz_bind_address="0.0.0.0:10256"), health)
    server.start()
    try:
        status, headers, body = curl(lab, lab.client, f"http://{node.ip}:10256/healthz")
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert json.loads(body)["nodeEligible"] is True
        assert curl(lab, node, "http://127.0.0.1:10256/livez")[0] == 200
        health.sync_node(None)
        assert curl(lab, lab.client, f"http://{node.ip}:10256/healthz")[0] == 503
        # The socket is the node's: nothing listens on 10256 in the host namespace because of it.
        # As Go's net.Listen("tcp", "0.0.0.0:10256"): one IPv6 socket taking both families.
        assert server.bound == ("::", 10256)
        listening = lab.run(node, "ss", "-Hltn", "sport = :10256").stdout
        assert "*:10256" in listening
    finally:
        server.stop()
    assert curl(lab, node, "http://127.0.0.1:10256/livez")[0] == 0, "stopped: the port is closed"


def test_metrics_port_on_the_node_loopback(lab: Lab) -> None:
    node = lab.node(1)
    registry = CollectorRegistry()
    Metrics(registry, Mode.EBPF).record_sync(True, 0.02)
    server = metrics_server(Config(netns=node.ns, metrics_bind_address="127.0.0.1:10249"), registry)
    server.start()
    try:
        assert curl(lab, node, "http://127.0.0.1:10249/proxyMode")[::2] == (200, "ebpf")
        status, _, body = curl(lab, node, "http://127.0.0.1:10249/metrics")
        assert (
            status == 200 and 'kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"} 1' in body
        )
        assert curl(lab, lab.client, f"http://{node.ip}:10249/metrics")[0] == 0, "loopback only"
    finally:
        server.stop()


def test_health_check_node_ports_on_the_node_address(lab: Lab) -> None:
    node = lab.node(1)
    config = Config(netns=node.ns, nodeport_addresses=("192.168.0.0/24",))
    health = ProxyHealth(60.0, FakeClock())
    hcs = ServiceHealthServer.for_node(config, NodeContext(node_ips=(node.ip,), primary_ip=node.ip), health)
    hcs.start()
    try:
        hcs.sync_services({"default/web": 32000})
        url = f"http://{node.ip}:32000/"
        status, headers, body = curl(lab, lab.client, url)
        assert status == 503 and headers["X-Load-Balancing-Endpoint-Weight"] == "0"
        hcs.sync_endpoints({"default/web": 1})
        status, headers, body = curl(lab, lab.client, url)
        assert status == 200 and headers["X-Load-Balancing-Endpoint-Weight"] == "1"
        assert json.loads(body) == {
            "service": {"namespace": "default", "name": "web"},
            "localEndpoints": 1,
            "serviceProxyHealthy": True,
        }
        # Bound to the node address --nodeport-addresses selects, not to loopback.
        assert curl(lab, node, "http://127.0.0.1:32000/")[0] == 0
        hcs.sync_services({})
        assert curl(lab, lab.client, url)[0] == 0
    finally:
        hcs.stop()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_10000_local_load_balancers_cost_descriptors_not_threads(lab: Lab) -> None:
    """10,000 healthCheckNodePorts: 10,000 listening sockets served by the one thread the server
    started with; ports answer, a change touches only what changed, and closing them all gives
    every descriptor back. (One node address: this machine's open-file limit is 20,000 and the
    agent cannot raise it, CAP_SYS_RESOURCE is not ours; two addresses would double the sockets.)"""
    node = lab.node(1)
    config = Config(netns=node.ns, nodeport_addresses=("192.168.0.0/24",))
    health = ProxyHealth(60.0, FakeClock())
    hcs = ServiceHealthServer.for_node(config, NodeContext(node_ips=(node.ip,), primary_ip=node.ip), health)
    ports = {f"ns/lb-{i}": 20000 + i for i in range(10_000)}
    hcs.start()
    try:
        threads, fds = threading.active_count(), open_fds()
        start = time.perf_counter()
        hcs.sync_services(ports)
        opened = time.perf_counter() - start
        hcs.sync_endpoints({"ns/lb-0": 1, "ns/lb-9999": 2})
        assert hcs.open_services() == ports and hcs.failed_services() == {}
        assert open_fds() - fds == 10_000
        assert threading.active_count() == threads, "no thread per port"
        assert curl(lab, lab.client, f"http://{node.ip}:20000/")[0] == 200
        assert curl(lab, lab.client, f"http://{node.ip}:29999/")[0] == 200
        assert curl(lab, lab.client, f"http://{node.ip}:25000/")[0] == 503
        hcs.sync_services({**ports, "ns/lb-5": 30005})
        assert curl(lab, lab.client, f"http://{node.ip}:20005/")[0] == 0
        assert curl(lab, lab.client, f"http://{node.ip}:30005/")[0] == 503
        print(f"\n10,000 listeners opened in {opened:.2f} s")
        hcs.sync_services({})
        assert open_fds() == fds and threading.active_count() == threads
    finally:
        hcs.stop()
