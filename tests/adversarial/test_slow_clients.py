"""Slow and idle clients against a real agent's health ports, both modes (issue 21, item 1).

Port 10256 listens on every node address, and healthCheckNodePorts are what cloud load balancers
probe: anyone who can reach the node can open connections to them. Before this the agent served
each port from a fixed pool of workers (4 for /healthz, 8 shared by every healthCheckNodePort) with
a timeout per read, so four clients sending one header line every few seconds silenced /healthz for
ever: the chart's liveness probe restarted the agent and load balancers pulled the node. kube-proxy
serves each connection on its own goroutine.

Here, with one agent for node1 of a two-node lab and a `LoadBalancer` Service with
`externalTrafficPolicy: Local` whose endpoint is on node1:

* 64 clients drip a request head to 10256 and 64 to the healthCheckNodePort, one header line every
  0.3 s, while 128 idle keep-alive connections (from four more addresses of the external client)
  sit on each port: /healthz probed from the node itself (as the kubelet does) and the
  healthCheckNodePort probed from node2 (standing in for a load balancer's checker) are answered
  at once (80% within 100 ms, every one within 1 s; before, none within 2 s), and every slow
  client is still connected meanwhile;
* the agent closes the slow and the idle connections at the request-head deadline;
* a source address over its connection cap has its extra connections closed on arrival, with one
  log line, and other sources are served.

The clients, the probe and the lab are lab/slowclients.py's, shared with the bench's health part
(bench/health.py), which measures the probes' latency on a quiet machine. Traffic stays in the lab:
the clients are sockets created in the lab's namespaces.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from agent.httpserve import Limits
from lab import Lab
from lab.harness import Cluster
from lab.slowclients import (
    DRIP_S,
    EXTRA,
    HC_PORT,
    HEALTHZ,
    IDLE_PER_SOURCE,
    N1,
    SLOW,
    Drips,
    connect,
    is_open,
    kept_alive,
    probe,
    set_up,
)
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

LIMITS = Limits()  # the agent's own
ROUNDS = 10  # 3 s of dripping, inside the 5 s head deadline
FAST_S = 0.1


@pytest.fixture(scope="module", params=["ebpf", "iptables"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=2, pods_per_node=1) as lab:
        lab.start_podservers()
        c = Cluster(lab, request.param, agent_nodes=[1])
        c.start()
        try:
            set_up(c)
            yield c
        finally:
            failures = c.stop()
        assert not failures, failures


def test_health_answers_within_100ms_while_64_slow_clients_drip_and_idle_ones_wait(cluster: Cluster) -> None:
    """Before, no probe was answered at all: every worker was held. Now each is answered at once:
    on this shared two-CPU machine single probes were seen taking 100-200 ms while the agent did
    nothing (its log silent, its threads not waiting for a CPU), so the test holds 80% of the
    probes to 100 ms (typically 1-10 ms) and every one to 1 s, rather than each to 100 ms."""
    lab = cluster.lab
    idle = kept_alive(lab, N1, HEALTHZ, "/healthz", EXTRA[:4], IDLE_PER_SOURCE)
    idle |= kept_alive(lab, N1, HC_PORT, "/", EXTRA[:4], IDLE_PER_SOURCE)
    slow = [Drips(lab, N1, HEALTHZ, SLOW), Drips(lab, N1, HC_PORT, SLOW)]
    probes: dict[str, list[tuple[int, float]]] = {"healthz": [], "hc": []}
    try:
        # Inside the request-head deadline, so every slow client stays connected and holds
        # whatever it can hold.
        for _ in range(ROUNDS):
            assert [d.drip() for d in slow] == [SLOW, SLOW], "every slow client is still connected"
            # As the kubelet probes the agent, and as a load balancer's checker probes the node.
            probes["healthz"].append(probe(lab, "node1", "127.0.0.1", HEALTHZ, "/healthz"))
            probes["hc"].append(probe(lab, "node2", N1, HC_PORT, "/"))
            time.sleep(DRIP_S)
        # Every idle connection is held until its head deadline, counted from its answer: the
        # 256 take a while to set up on a loaded machine (the first ones' deadline had passed
        # here when 197 of 256 were open: closed on time, not early).
        now = time.monotonic()
        early = [now - answered for s, answered in idle.items() if not is_open(s)]
        assert len(idle) == 2 * 4 * IDLE_PER_SOURCE
        assert all(age >= LIMITS.head_timeout_s - 0.2 for age in early), (
            f"closed before the deadline: {early}"
        )
        shown = {what: [(status, round(took, 4)) for status, took in got] for what, got in probes.items()}
        print(f"\n{cluster.mode}: (status, seconds) per probe: {shown}")
        for got in probes.values():
            assert all(status == 200 and took < 1.0 for status, took in got), shown
            assert sum(took < FAST_S for _, took in got) >= 0.8 * len(got), shown
    finally:
        for d in slow:
            d.close()
        for s in idle:
            s.close()


def test_slow_and_idle_connections_are_closed_at_the_head_deadline(cluster: Cluster) -> None:
    lab = cluster.lab
    idle = kept_alive(lab, N1, HEALTHZ, "/livez", EXTRA[:2], IDLE_PER_SOURCE)
    slow = Drips(lab, N1, HEALTHZ, SLOW)
    deadline = LIMITS.head_timeout_s
    idle_closed: list[float] = []
    try:
        while (slow.socks or len(idle_closed) < len(idle)) and time.monotonic() - slow.started < deadline + 3:
            slow.drip()
            for s in idle:
                if s.fileno() != -1 and not is_open(s):
                    idle_closed.append(time.monotonic() - idle[s])
                    s.close()
            time.sleep(0.1)
        assert not slow.socks, f"{len(slow.socks)} slow clients still connected after {deadline + 3}s"
        assert deadline - 0.2 <= min(slow.closed_after) and max(slow.closed_after) < deadline + 1.5, (
            slow.closed_after
        )
        assert len(idle_closed) == len(idle), "every idle keep-alive connection is closed"
        assert deadline - 0.2 <= min(idle_closed) and max(idle_closed) < deadline + 1.5, idle_closed
    finally:
        slow.close()
        for s in idle:
            s.close()


def test_a_source_over_its_connection_cap_is_refused_and_others_are_served(cluster: Cluster) -> None:
    lab = cluster.lab
    agent = cluster.agents[0]
    extra = 16
    held = [connect(lab, "client", N1, HEALTHZ, EXTRA[4]) for _ in range(LIMITS.per_source + extra)]
    try:
        time.sleep(0.5)  # far less than the head deadline: only the cap closes anything
        open_now = sum(is_open(s) for s in held)
        assert open_now == LIMITS.per_source, f"{open_now} of {len(held)} open"
        status, took = probe(lab, "node1", "127.0.0.1", HEALTHZ, "/healthz")
        assert status == 200 and took < 1.0, (status, took)
        status, took = probe(lab, "client", N1, HEALTHZ, "/healthz")  # the client's main address
        assert status == 200 and took < 1.0, (status, took)
        assert (
            f"healthz: closing new connections from {EXTRA[4]}: it has {LIMITS.per_source} open already, "
            "the limit per source address" in agent.log()
        ), agent.log()[-2000:]
    finally:
        for s in held:
            s.close()
