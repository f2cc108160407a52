"""XDP on the external devices and Maglev, in a two-node lab (eBPF mode only: iptables mode has no
XDP; its source ranges and NodePorts are the traffic suite's).

Both agents run `--bpf-xdp=native --bpf-lb-algorithm=maglev --bpf-host-routing=bpf` (under legacy
host routing XDP leaves translations to tc). The IPv6 tests run the same agents in a dual-stack lab
of their own (`dual`, `Lab(ipv6=True)`; apart because eBPF mode still writes ip6tables rules beside
its IPv6 path, which the suite's check of no service rules in eBPF mode looks at for `cluster`):
IPv6 reaches XDP's IPv6 path (ekp_xdp_net6, bpf/ekp_xdp6.h) by a tail call. The lab's switch is a
wire (full checksums, XDP_TX delivered: lab/wire.py). The XDP program's own counters
(ekp_xstats_v3) and the kernel's run count of the program (`bpftool prog show`, with
BPF_ENABLE_STATS held open for the test) show which hook handled what; the tc program's counters
show what it did not see.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab import Lab
from lab.core import PODSERVER, CommandError, Node
from lab.harness import CLIENT as CLIENT_PY
from lab.harness import Cluster, ep, started
from lab.objects import Ep, Port, endpoint_slice, service, with_endpoints
from tests.conftest import require_kernel
from tests.traffic.test_ipv6 import HTTP6_PORT, SERVER6, fetch

pytestmark = pytest.mark.kernel

ECHO = 7000
DISCARD = 9  # no listener on the nodes or the client: a connect is refused
BPF_ENABLE_STATS = 32
CLIENT = "client"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=2, pods_per_node=3, wire=True) as lab:
        lab.start_podservers()
        for pod in (lab.pod("pod-2-1"), lab.pod("pod-2-2")):
            proc = lab.popen(
                pod,
                sys.executable,
                "-I",
                "-S",
                str(PODSERVER),
                f"--name={pod.name}",
                "--http-port=8081",
                "--udp-port=9001",
                f"--tcp-echo-port={ECHO}",
                name=f"echo-{pod.name}",
            )
            lab.wait_tcp(pod, pod.ip, ECHO, proc=proc)
        for node in lab.nodes:  # what the suite's nodes carry (tests/traffic/conftest.py)
            lab.run(
                node, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"
            )
        # bpf host routing: under legacy (the default) XDP leaves translations to the node's stack.
        extra = ["--bpf-xdp=native", "--bpf-lb-algorithm=maglev", "--bpf-host-routing=bpf"]
        c = Cluster(lab, "ebpf", extra=extra)
        with started(c):
            yield c


# NUD_VALID (include/net/neighbour.h): the states in which bpf_fib_lookup returns the neighbour's MAC
NUD_VALID = {"REACHABLE", "STALE", "DELAY", "PROBE", "PERMANENT", "NOARP"}


def resolve_neighbours(lab: Lab, node: Node, addrs: list[str]) -> None:
    """Have `node` resolve the MACs of `addrs` on its eth0, as a node among its peers has them.

    XDP sends a translated packet only to a resolved next hop: bpf_fib_lookup's NO_NEIGH leaves it
    to tc (TO_TC), whose bpf_redirect_neigh resolves it. In a fresh lab node1 has resolved nobody,
    so without this the first flow of whichever test runs first is tc's, not XDP's. A TCP connect
    to a closed port: its RST comes back only once the SYN went out, to a resolved MAC.
    """
    for addr in addrs:
        answer = lab.tcp_probe(node, addr, DISCARD)
        assert answer == "refused", f"{node.name} -> {addr}:{DISCARD}: {answer}"
    shown = json.loads(lab.run(node, "ip", "-j", "neigh", "show", "dev", "eth0").stdout)
    states = {n["dst"]: set(n.get("state", [])) for n in shown}
    assert all(states.get(addr, set()) & NUD_VALID for addr in addrs), (addrs, states)


def resolved(c: Cluster, *, ipv6: bool = False) -> None:
    """node1 resolves node2 and the client right before a test counts XDP's flows. Once per module
    is not enough: bpf_fib_lookup reads a neighbour without marking it used, and once the machine's
    neighbour tables (every namespace's) hold gc_thresh1 (128) entries, the kernel's periodic
    clean-up deletes an entry unused for gc_stale_time (60 s), which only XDP would have used."""
    lab = c.lab
    peers = [lab.node(2).ip6, lab.client.ip6] if ipv6 else [lab.node(2).ip, lab.client.ip]
    resolve_neighbours(lab, lab.node(1), peers)


@pytest.fixture(scope="module")
def dual() -> Iterator[Cluster]:
    """The agents of `cluster` in a dual-stack lab: IPv6 HTTP servers on pod-2-1 and pod-2-2."""
    require_kernel()
    with Lab(nodes=2, pods_per_node=2, wire=True, ipv6=True) as lab:
        for pod in (lab.pod("pod-2-1"), lab.pod("pod-2-2")):
            http6 = lab.popen(pod, sys.executable, "-c", SERVER6, pod.name, str(HTTP6_PORT), name="http6")
            lab.wait_log(http6, "ready")
        c = Cluster(
            lab, "ebpf", extra=["--bpf-xdp=native", "--bpf-lb-algorithm=maglev", "--bpf-host-routing=bpf"]
        )
        with started(c):
            yield c


@pytest.fixture(scope="module")
def run_stats() -> Iterator[None]:
    """The kernel counts programs' runs while an fd of BPF_ENABLE_STATS is open (no sysctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    attr = ctypes.create_string_buffer(struct.pack("=I", 0), 8)  # BPF_STATS_RUN_TIME
    fd = int(libc.syscall(321, BPF_ENABLE_STATS, attr, 8))
    assert fd >= 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        os.close(fd)


def xstats(cluster: Cluster, node: int = 1) -> dict[str, int]:
    from agent.ebpf.abi import MAPS
    from agent.ebpf.maps import BpfMap, read_stats

    with BpfMap.open_pinned(MAPS["xstats"], cluster.agents[node - 1].pin_path) as m:
        return {stat.name.lower(): count for stat, count in read_stats(m).items()}


def xdp_prog(cluster: Cluster, node: int = 1) -> dict[str, object]:
    """`ip -j link show eth0` of the node: the XDP program attached and its mode, and bpftool's view
    of that program (its run count)."""
    out = cluster.lab.run(cluster.lab.node(node), "ip", "-j", "-d", "link", "show", "dev", "eth0").stdout
    xdp = json.loads(out)[0].get("xdp", {})
    prog_id = xdp.get("prog", {}).get("id") or next(
        (p["prog"]["id"] for p in xdp.get("attached", []) if "prog" in p), 0
    )
    assert prog_id, f"no XDP program on node{node} eth0: {xdp}"
    shown = json.loads(
        subprocess.run(
            ["bpftool", "-j", "prog", "show", "id", str(prog_id)], check=True, capture_output=True, text=True
        ).stdout
    )
    return {"mode": xdp.get("mode"), **shown}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_nodeport_to_backends_on_the_other_node_is_handled_at_xdp(cluster: Cluster, run_stats: None) -> None:
    svc = service("xdp-np", "10.96.70.1", [Port("http", 80, 8080, node_port=30970)], type="NodePort")
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-2-1"), ep(cluster, "pod-2-2")]))
    node1 = cluster.lab.node(1)
    prog_before = xdp_prog(cluster)
    assert prog_before["name"] == "ekp_xdp_net" and prog_before["mode"] == 1  # native (XDP_ATTACHED_DRV)
    resolved(cluster)
    x0, t0 = xstats(cluster), cluster.bpf_stats(1)
    res = cluster.http(CLIENT, f"http://{node1.ip}:30970/", count=20)
    assert res["errors"] == 0 and set(res["bodies"]) <= {"pod-2-1", "pod-2-2"}, res
    x, t = delta(xstats(cluster), x0), delta(cluster.bpf_stats(1), t0)
    prog_after = xdp_prog(cluster)
    # 20 connections, both ways through XDP: every SYN a new flow, every reply from node2 restored
    assert x.get("new_flows", 0) == 20, x
    assert x.get("ct_reply", 0) >= 40 and x.get("ct_forward", 0) >= 40, x
    assert x.get("snat", 0) == 20, x
    runs = int(str(prog_after["run_cnt"])) - int(str(prog_before.get("run_cnt", 0)))
    assert runs >= x["packets"] > 0, (runs, x)
    # the tc program behind it saw none of those flows' packets
    assert t.get("new_flows", 0) == 0 and t.get("ct_forward", 0) == 0 and t.get("ct_reply", 0) == 0, t


def test_source_ranges_drop_one_client_at_xdp_and_let_another_through(cluster: Cluster) -> None:
    lab = cluster.lab
    lb_ip = "203.0.113.70"
    svc = service(
        "xdp-lb",
        "10.96.70.2",
        [Port("http", 80, 8080)],
        type="LoadBalancer",
        loadBalancerSourceRanges=["192.168.0.100/32"],
        status={"loadBalancer": {"ingress": [{"ip": lb_ip}]}},
    )
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-2-1"), ep(cluster, "pod-2-2")]))
    lab.add_client_route(f"{lb_ip}/32", via_node=1)
    lab.run(CLIENT, "ip", "addr", "replace", "192.168.0.101/24", "dev", "eth0")
    try:
        resolved(cluster)
        x0, t0 = xstats(cluster), cluster.bpf_stats(1)
        assert lab.curl(CLIENT, f"http://{lb_ip}/").strip() in {"pod-2-1", "pod-2-2"}
        with pytest.raises(CommandError) as denied:
            lab.curl(CLIENT, f"http://{lb_ip}/", timeout=2, args=["--interface", "192.168.0.101"])
        assert denied.value.returncode == 28, denied.value  # timed out: dropped, not refused
        x, t = delta(xstats(cluster), x0), delta(cluster.bpf_stats(1), t0)
        assert x.get("drop_source_range", 0) >= 1 and x.get("new_flows", 0) == 1, x
        assert t.get("drop_source_range", 0) == 0, t  # dropped before tc
    finally:
        lab.run(CLIENT, "ip", "addr", "del", "192.168.0.101/24", "dev", "eth0", check=False)
        lab.del_client_route(f"{lb_ip}/32")


def test_the_tc_path_still_serves_local_backends(cluster: Cluster) -> None:
    svc = service("xdp-local", "10.96.70.3", [Port("http", 80, 8080, node_port=30971)], type="NodePort")
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-1-1")]))
    node1 = cluster.lab.node(1)
    x0, t0 = xstats(cluster), cluster.bpf_stats(1)
    res = cluster.http(CLIENT, f"http://{node1.ip}:30971/", count=10)
    assert res["errors"] == 0 and set(res["bodies"]) == {"pod-1-1"}, res
    x, t = delta(xstats(cluster), x0), delta(cluster.bpf_stats(1), t0)
    assert x.get("to_tc", 0) >= 10 and x.get("new_flows", 0) == 0, x  # left to tc, no entry written
    assert t.get("new_flows", 0) == 10, t


def test_a_tcp_stream_through_a_nodeport_continues_on_its_backend_after_conntrack_is_cleared(
    cluster: Cluster, tmp_path: Path
) -> None:
    from agent.ebpf.abi import MAPS, CtDir, CtEntry, CtKey, port_be
    from agent.ebpf.maps import BpfMap

    lab = cluster.lab
    svc = service("xdp-echo", "10.96.70.4", [Port("echo", ECHO, ECHO, node_port=30972)], type="NodePort")
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-2-1"), ep(cluster, "pod-2-2")]))
    node1 = lab.node(1)
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = lab.popen(
        CLIENT,
        sys.executable,
        "-I",
        CLIENT_PY,
        "idle",
        f"--addr={node1.ip}",
        "--port=30972",
        f"--ready-file={ready}",
        f"--go-file={go}",
        "--max-s=60",
        stdout=subprocess.PIPE,
        name="idle-client",
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, lab.log_of(proc)
        time.sleep(0.05)

    def flow() -> tuple[int, int]:
        """(backend, SNAT port) of the one FORWARD entry to the NodePort on node1."""
        with BpfMap.open_pinned(MAPS["ct_tcp"], cluster.agents[0].pin_path) as ct:
            fwd = [
                v
                for k, v in ct.items()
                if isinstance(k, CtKey) and isinstance(v, CtEntry)
                if k.dir == CtDir.FORWARD and k.dport == port_be(30972)
            ]
            assert len(fwd) == 1, fwd
            return int(fwd[0].nat_addr), int(fwd[0].snat_port)

    before = flow()
    x0 = xstats(cluster)
    with BpfMap.open_pinned(MAPS["ct_tcp"], cluster.agents[0].pin_path) as ct:
        ct.clear()  # every entry of node1's TCP conntrack: the flow's two among them
        assert ct.count() == 0
    go.touch()
    out, _ = proc.communicate(timeout=30)
    result = json.loads(out)
    assert result == {**result, "first": True, "after": True, "error": ""}, result
    # the same backend and SNAT port: resumed by Maglev, not chosen anew
    assert flow() == before
    assert delta(xstats(cluster), x0).get("ct_resumed", 0) == 1


def test_an_agent_restarted_with_xdp_disabled_loads_no_xdp_program_and_takes_ours_off(
    cluster: Cluster,
) -> None:
    """--bpf-xdp=disabled: the restarted agent loads (verifies, pins) no XDP program (MapSizes.xdp),
    takes the one its earlier run attached off eth0 (found by name, not by an fd of its own), and
    its tc program serves the NodePort. Back on native, ours is attached again."""
    lab, agent = cluster.lab, cluster.agents[0]
    svc = service("xdp-off", "10.96.70.5", [Port("http", 80, 8080, node_port=30974)], type="NodePort")
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-2-1"), ep(cluster, "pod-2-2")]))
    assert xdp_prog(cluster)["name"] == "ekp_xdp_net"
    native = list(agent.extra)
    agent.stop()
    agent.extra = ["--bpf-xdp=disabled" if f.startswith("--bpf-xdp=") else f for f in native]
    try:
        agent.start()
        agent.wait_version(cluster.version)
        link = json.loads(lab.run(lab.node(1), "ip", "-j", "-d", "link", "show", "dev", "eth0").stdout)[0]
        assert "xdp" not in link, link["xdp"]
        assert "detached ekp_xdp_net from eth0 (--bpf-xdp=disabled)" in agent.log_since_start()
        pinned = [p for p in os.listdir(agent.pin_path) if p.endswith(("_ekp_xdp_net", "_ekp_xdp_net6"))]
        assert pinned == [], "no XDP program loaded"
        x0, t0 = xstats(cluster), cluster.bpf_stats(1)
        res = cluster.http(CLIENT, f"http://{lab.node(1).ip}:30974/", count=5)
        assert res["errors"] == 0 and set(res["bodies"]) <= {"pod-2-1", "pod-2-2"}, res
        x, t = delta(xstats(cluster), x0), delta(cluster.bpf_stats(1), t0)
        assert x.get("packets", 0) == 0, x
        assert t.get("new_flows", 0) == 5, t
    finally:
        agent.stop()
        agent.extra = native
        agent.start()
        agent.wait_version(cluster.version)
    assert xdp_prog(cluster)["name"] == "ekp_xdp_net"


def ipv6_service(cluster: Cluster, name: str, vip: str, node_port: int, type: str, **spec: object) -> None:
    """An IPv6 Service of HTTP6_PORT on pod-2-1 and pod-2-2 (both on node2)."""
    port = Port("http", 80, HTTP6_PORT, node_port=node_port)
    svc = service(name, vip, [port], type=type, ipFamilies=["IPv6"], **spec)
    pods = [cluster.lab.pod(p) for p in ("pod-2-1", "pod-2-2")]
    eps = endpoint_slice(name, [port], [Ep(p.ip6, f"node{p.node}") for p in pods], "v6")
    eps["addressType"] = "IPv6"
    cluster.apply([svc, eps])


def test_an_ipv6_nodeport_to_backends_on_the_other_node_is_handled_at_xdp(dual: Cluster) -> None:
    ipv6_service(dual, "xdp6-np", "fd00:10:96::70", 30972, type="NodePort")
    lab = dual.lab
    url = f"http://[{lab.node(1).ip6}]:30972/"
    resolved(dual, ipv6=True)
    x0, t0 = xstats(dual), dual.bpf_stats(1)
    answers = {fetch(dual, CLIENT, url) for _ in range(8)}
    assert answers <= {"pod-2-1", "pod-2-2"}, answers
    x, t = delta(xstats(dual), x0), delta(dual.bpf_stats(1), t0)
    # 8 connections, both ways through XDP: every SYN a new flow (masqueraded to node1's IPv6
    # address), every reply from node2 restored
    assert x.get("new_flows", 0) == 8 and x.get("snat", 0) == 8, x
    assert x.get("ct_reply", 0) >= 16 and x.get("ct_forward", 0) >= 16, x
    # the tc program behind it saw none of those flows' packets
    assert t.get("new_flows", 0) == 0 and t.get("ct_forward", 0) == 0 and t.get("ct_reply", 0) == 0, t


def test_ipv6_source_ranges_drop_one_client_at_xdp_and_let_another_through(dual: Cluster) -> None:
    lab = dual.lab
    lb_ip, other = "fd00:10:97::70", "fd00:192:168::101"
    ipv6_service(
        dual,
        "xdp6-lb",
        "fd00:10:96::71",
        30973,
        type="LoadBalancer",
        loadBalancerSourceRanges=[f"{lab.client.ip6}/128"],
        status={"loadBalancer": {"ingress": [{"ip": lb_ip}]}},
    )
    lab.add_client_route(f"{lb_ip}/128", via_node=1)
    lab.run(CLIENT, "ip", "-6", "addr", "replace", f"{other}/64", "dev", "eth0", "nodad")
    try:
        # the client's own address, which the ranges hold (the other would be its source as well)
        allowed = ["-g", "--interface", lab.client.ip6]
        resolved(dual, ipv6=True)
        x0, t0 = xstats(dual), dual.bpf_stats(1)
        assert lab.curl(CLIENT, f"http://[{lb_ip}]/", args=allowed).strip() in {"pod-2-1", "pod-2-2"}
        with pytest.raises(CommandError) as denied:
            lab.curl(CLIENT, f"http://[{lb_ip}]/", timeout=2, args=["-g", "--interface", other])
        assert denied.value.returncode == 28, denied.value  # timed out: dropped, not refused
        x, t = delta(xstats(dual), x0), delta(dual.bpf_stats(1), t0)
        assert x.get("drop_source_range", 0) >= 1 and x.get("new_flows", 0) == 1, x
        assert t.get("drop_source_range", 0) == 0 and t.get("new_flows", 0) == 0, t  # before tc
    finally:
        lab.run(CLIENT, "ip", "-6", "addr", "del", f"{other}/64", "dev", "eth0", check=False)
        lab.del_client_route(f"{lb_ip}/128")
