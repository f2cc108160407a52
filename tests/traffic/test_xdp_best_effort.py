"""--bpf-xdp=best-effort (the default) on a node whose external devices are all veths (the lab's,
kind's): no XDP program is loaded (best-effort never attaches one to a veth, so its verification
would buy nothing), and the tc programs serve NodePorts; an external device best-effort would try
that appears later (a tap, whose driver takes native XDP in a namespace) has the agent load the
data path again with the XDP programs and attach them, under a running flow that loses no request;
a restart then reuses what that load pinned, the programs on every hook unchanged.

eBPF mode only (iptables mode has no XDP). One node, its agent following its addresses (no
--node-ip) on `--devices=eth0,nic0`: nic0 is missing at the start, and the address given to it
later is what makes the agent look at its external devices again (agent/nodewatch.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from lab import Lab
from lab.harness import Cluster, Loop, ep, started
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

CLIENT = "client"
NODE_PORT = 30975
XDP_PROGRAMS = ("_ekp_xdp_net", "_ekp_xdp_net6")
LOADED_AGAIN = "data path loaded again with ekp_xdp_net, on every device now"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=2) as lab:
        lab.start_podservers()
        for node in lab.nodes:  # what the suite's nodes carry (tests/traffic/conftest.py)
            lab.run(
                node, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"
            )
        c = Cluster(lab, "ebpf", extra=["--devices=eth0,nic0"], node_ip=False)
        with started(c):
            yield c


def pinned_programs(cluster: Cluster) -> dict[str, list[str]]:
    """Load id -> the programs pinned under it (`ekp_prog_<id>_<name>`, agent/ebpf/compile.py)."""
    out: dict[str, list[str]] = {}
    for entry in sorted(os.listdir(cluster.agents[0].pin_path)):
        if entry.startswith("ekp_prog_"):
            load_id, _, name = entry[len("ekp_prog_") :].partition("_")
            out.setdefault(load_id, []).append(name)
    return out


def hook_ids(cluster: Cluster, dev: str) -> dict[str, int]:
    """The ids of the programs on `dev`'s XDP hook ("xdp", 0 when none) and tc hooks (by hook and
    name, whether through tcx links or filters)."""
    from agent.ebpf import attach, xdp
    from agent.netns import netns_route

    netns = cluster.lab.node(1).ns
    with netns_route(netns) as ipr:
        index = int(ipr.link_lookup(ifname=dev)[0])
        ids = {"xdp": xdp.xdp_state(ipr, index).prog_id}
        for hook in ("ingress", "egress"):
            for prog in attach.hook_programs(ipr, netns, index, hook):
                ids[f"{hook}:{prog.name}"] = prog.prog_id
    return ids


def socket_link_ids(cluster: Cluster) -> dict[str, int]:
    """Hook -> the id of the program its pinned socket link runs (agent/ebpf/sockattach.py)."""
    from agent.ebpf.sockattach import pinned_links

    return {hook: state.prog_id for hook, state in pinned_links(cluster.agents[0].pin_path).items()}


def prog_name(prog_id: int) -> str:
    shown = json.loads(
        subprocess.run(
            ["bpftool", "-j", "prog", "show", "id", str(prog_id)], check=True, capture_output=True, text=True
        ).stdout
    )
    return str(shown["name"])


def test_a_best_effort_agent_on_veths_alone_loads_no_xdp_program_and_serves_nodeports_at_tc(
    cluster: Cluster,
) -> None:
    """What the start pinned is what tests the change (no ekp_xdp_net* program loaded); the
    NodePort served at tc with no XDP run, and eth0's empty XDP hook, held before it too (loaded,
    best-effort attaches nothing to a veth): they guard that the tc path alone serves."""
    from tests.traffic.test_xdp import delta, xstats

    agent = cluster.agents[0]
    assert (
        "all external devices are veths (eth0): ekp_xdp_net not loaded (--bpf-xdp=best-effort" in agent.log()
    )
    loads = pinned_programs(cluster)
    assert len(loads) == 1, loads
    (programs,) = loads.values()
    assert "ekp_from_net" in programs and not [p for p in programs if p.startswith("ekp_xdp_net")], programs
    svc = service("be-np", "10.96.75.1", [Port("http", 80, 8080, node_port=NODE_PORT)], type="NodePort")
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-1-1"), ep(cluster, "pod-1-2")]))
    x0, t0 = xstats(cluster), cluster.bpf_stats(1)
    res = cluster.http(CLIENT, f"http://{cluster.lab.node(1).ip}:{NODE_PORT}/", count=5)
    assert res["errors"] == 0 and set(res["bodies"]) <= {"pod-1-1", "pod-1-2"}, res
    assert delta(cluster.bpf_stats(1), t0).get("new_flows", 0) == 5
    assert delta(xstats(cluster), x0).get("packets", 0) == 0, "no XDP program ran"
    assert hook_ids(cluster, "eth0")["xdp"] == 0


def test_a_device_that_takes_xdp_appearing_later_has_the_xdp_programs_loaded_and_attached_under_traffic(
    cluster: Cluster,
) -> None:
    """A tap (kind "tun": best-effort tries native XDP there, and its driver takes it) becomes an
    external device: the agent loads the data path again with the XDP programs and attaches
    ekp_xdp_net to it, natively, while the tc programs keep serving a client's stream of new
    connections to the NodePort, none of which fails. A restart then loads nothing: it reuses
    the pinned programs, and every hook keeps the very programs it had."""
    lab, agent = cluster.lab, cluster.agents[0]
    node = lab.node(1)
    svc = service("be-np2", "10.96.75.2", [Port("http", 80, 8080, node_port=NODE_PORT + 1)], type="NodePort")
    cluster.apply(with_endpoints(svc, [ep(cluster, "pod-1-1"), ep(cluster, "pod-1-2")]))
    assert [n for names in pinned_programs(cluster).values() for n in names if n.startswith("ekp_xdp")] == []
    before = hook_ids(cluster, "eth0")
    links = socket_link_ids(cluster)
    assert links, "the lab's agents link the socket programs"
    link_names = {hook: prog_name(prog_id) for hook, prog_id in links.items()}
    mark = agent.log_mark()
    loop = Loop(lab, CLIENT, f"http://{node.ip}:{NODE_PORT + 1}/", "xdp-best-effort")
    try:
        lab.run(node, "ip", "tuntap", "add", "mode", "tap", "name", "nic0")
        lab.run(node, "ip", "addr", "add", "192.168.75.11/24", "dev", "nic0")
        agent.wait_logged(LOADED_AGAIN, after=mark)
    finally:
        result = loop.finish()
    assert result["errors"] == 0 and result["ok"] > 0, result
    said = agent.log_since_start(mark)
    assert (
        "nic0 is external and no veth, bridge nor vxlan (--bpf-xdp=best-effort tries native XDP there)"
        in said
    )
    assert "attached ekp_xdp_net to nic0 XDP (native)" in said
    loads = pinned_programs(cluster)
    assert len(loads) == 1, loads
    (programs,) = loads.values()
    assert "ekp_xdp_net" in programs and "ekp_from_net" in programs, programs
    tap = hook_ids(cluster, "nic0")
    assert tap["xdp"] and prog_name(tap["xdp"]) == "ekp_xdp_net"
    now = hook_ids(cluster, "eth0")
    assert now["xdp"] == 0, "a veth keeps none"
    assert now.keys() == before.keys() and all(now[k] != before[k] for k in now if k != "xdp"), (before, now)
    moved = socket_link_ids(cluster)
    assert moved.keys() == links.keys() and all(moved[h] != links[h] for h in moved), (links, moved)
    assert {h: prog_name(i) for h, i in moved.items()} == link_names, "the new load's, hook by hook"
    res = cluster.http(CLIENT, f"http://{node.ip}:{NODE_PORT + 1}/", count=5)
    assert res["errors"] == 0, res

    agent.stop()
    mark = agent.log_mark()
    agent.start()
    agent.wait_version(cluster.version)
    said = agent.log_since_start(mark)
    assert "data path reused (unchanged since it was compiled)" in said, said[-3000:]
    assert "not loaded (--bpf-xdp=best-effort" not in said
    assert hook_ids(cluster, "nic0") == tap and hook_ids(cluster, "eth0") == now, "no program replaced"
    assert socket_link_ids(cluster) == moved
    assert pinned_programs(cluster) == loads
