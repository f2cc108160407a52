"""Upgrading the agent under load drops no connection and fails no request.

The old agent is an older commit of main, run from `git archive` of that commit in a temp
directory (with this checkout's Python environment). It programs node1 and is stopped (SIGTERM:
its programs and pins stay and keep serving); this checkout's agent starts over the same pin path
and replaces the programs. Meanwhile a pod loops over a ClusterIP and the external client over a
NodePort, a new connection per request, and a long-lived connection exchanges a line every 50 ms:
every request must succeed and the long-lived connection must carry on.

* From ABI v1 (the last v1 commit): the v1 conntrack is carried over (agent/ebpf/upgrade.py)
  around replacing the programs, and the v1 pins removed; the v2 programs sit in front of the v1
  ones until it is (the hand-over): no segment dropped as no_flow, and no client retransmits a SYN
  or sends a RST (what a reply that met a program without its flow's entry caused).
* From the last agent before the early-drop queues, the fragment maps and ekp_stats_v3: the
  conntrack tables are the same maps (their layout unchanged), the new maps are created beside
  them, the counters of ekp_stats_v2 are carried into ekp_stats_v3 and its pin removed.
* From the last agent with tcx's classid program (ekp_tcx_classid first on every ingress hook, the
  port's bridge in skb->tc_classid): the same ABI, so the links are updated in place, the new map
  ekp_port_v2 created beside the others, and the classid links removed once ours serve.
* From the last agent before the IPv6 maps, in a dual-stack lab (issue 20): the old agent serves
  IPv6 Services with ip6tables only; the new one adds the IPv6 maps beside the pins it finds
  and its socket programs take the pods' new IPv6 connections over, while the IPv6 connection
  ip6tables translated before goes on through its nf_conntrack DNAT entry. Both families carry
  traffic all along: the IPv4 loops and connection above, an IPv6 ClusterIP loop and a long-lived
  IPv6 connection, every Service dual-stack.

The commits must be in this clone's history: a shallow clone (CI's default fetch depth in some
systems) does not have them, and the test fails saying so rather than skipping.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.ebpf.abi import MAPS
from lab import Lab, hooks
from lab.core import PODSERVER
from lab.harness import CLIENT, REPO, Agent, Cluster, ep
from lab.objects import Ep, Port, endpoint_slice, service, with_endpoints
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel

# The last commit of main with EKP_ABI_VERSION 1 before ABI v2 (git merge-base of this branch and
# main when v2 was written).
V1_COMMIT = "f55b07c1a19a86171a0b7b99a5c93591666582bd"
# The last commit of main before the early-drop queues, ekp_addr, ekp_fraghold and ekp_stats_v3
# (git merge-base of that branch and main when they were written).
V2_STATS_COMMIT = "1a1629f3862fe2ceeb0dda77d5d836c12f55a85c"
# The last commit of main before the IPv6 maps (ekp_fe6_v2 ...) and the IPv6 socket programs: its
# eBPF-mode agent serves IPv6 Services with ip6tables alone (the first parent of the merge of
# v6sock, be397d8).
V6_MAPS_COMMIT = "4604c479822afac7d448688ba54b131be75759ea"
# The last commit of main whose tcx attach put a classid program (ekp_tcx_classid) first on every
# ingress hook, before ekp_port_v2 (git merge-base of that branch, tcxmap, and main).
CLASSID_COMMIT = "ed0964ecb325023da89cd9cf24b7ad0f4b319e4f"
ECHO_PORT = 7000
HTTP2_PORT = 8085  # the second podserver's HTTP port (IPv4, and IPv6 in the dual-stack lab)
WEB6, ECHO6 = "fd00:10:96::5:1", "fd00:10:96::5:2"  # the dual-stack Services' IPv6 ClusterIPs


def old_tree(
    dest: Path, commit: str, what: str, marker: tuple[str, str], lacks: tuple[str, str] | None = None
) -> Path:
    """An older agent's source, from this clone's history (fails loudly when the clone lacks it);
    `marker` is (file, text) the commit must hold, and `lacks` (file, text) one it must not,
    proving it is the agent it is taken for."""
    have = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"],
        capture_output=True,
        check=False,
    )
    if have.returncode != 0:
        pytest.fail(
            f"commit {commit} ({what}) is not in this clone's history: the upgrade test "
            "runs that agent from `git archive`. Clone with full history (git fetch --unshallow).",
            pytrace=False,
        )

    def show(path: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
        ).stdout

    assert marker[1] in show(marker[0]), f"{commit} is not {what}"
    assert lacks is None or lacks[1] not in show(lacks[0]), f"{commit} is not {what}"
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True
    ).stdout
    tar = dest / f"{commit}.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(dest / commit, filter="data")
    return dest / commit


def v1_tree(dest: Path) -> Path:
    return old_tree(dest, V1_COMMIT, "the last ABI v1 agent", ("bpf/ekp_abi.h", "#define EKP_ABI_VERSION 1"))


class OldAgent(Agent):
    """The same flags and node, an older agent's code (its own agent/ and bpf/ directories)."""

    def __init__(self, lab: Lab, agent: Agent, tree: Path, label: str = "v1") -> None:
        super().__init__(lab, agent.node, agent.mode, agent.source, agent.extra)
        self.socket_lb_pods = agent.socket_lb_pods
        self.tree = tree
        self.label = label
        self.log_path = agent.log_path.with_name(f"agent-{label}-{agent.node.name}.log")
        # An agent with socket programs gets their flags: without --bpf-socket-lb-cgroup it would
        # attach them to the machine's root cgroup.
        self.socket_lb = any(
            "--bpf-socket-lb-cgroup" in f.read_text() for f in (tree / "agent").rglob("*.py")
        )

    def flags(self) -> list[str]:
        # the agents before the socket programs have none of their flags (they would refuse to start)
        return [f for f in super().flags() if self.socket_lb or not f.startswith("--bpf-socket-lb")]

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = self.lab.popen(
                None,
                sys.executable,
                "-m",
                "agent",
                *self.source,
                *self.flags(),
                name=f"agent-{self.label}-{self.node.name}",
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(self.tree),
                xtables=self.node,
            )
        finally:
            log.close()


def echo_lab(*, ipv6: bool, pod_bridge: str | None = None) -> Iterator[Lab]:
    """One node, three pods with the HTTP podserver; pod-1-2 also a line echo. Dual-stack: pod-1-2
    and pod-1-3 serve HTTP2_PORT (and the echo) over IPv6 too, the IPv6 endpoints. `pod_bridge`:
    the pods' veths are ports of a Linux bridge of that name (IPv4 only)."""
    require_kernel()
    with Lab(nodes=1, pods_per_node=3, ipv6=ipv6, pod_bridge=pod_bridge) as built:
        built.start_podservers()
        for pod in [built.pod(p) for p in (("pod-1-2", "pod-1-3") if ipv6 else ("pod-1-2",))]:
            proc = built.popen(
                pod,
                sys.executable,
                "-I",
                "-S",
                str(PODSERVER),
                f"--name={pod.name}",
                f"--http-port={HTTP2_PORT}",
                "--udp-port=9005",
                f"--tcp-echo-port={ECHO_PORT}",
                *(["--ipv6"] if ipv6 else []),
                name="echo",
            )
            built.wait_tcp(pod, pod.ip, ECHO_PORT, proc=proc)
            if ipv6:
                built.wait_tcp(pod, pod.ip6, ECHO_PORT, proc=proc)
        yield built


@pytest.fixture
def lab() -> Iterator[Lab]:
    yield from echo_lab(ipv6=False)


@pytest.fixture
def dual_lab() -> Iterator[Lab]:
    yield from echo_lab(ipv6=True)


@pytest.fixture
def bridged_lab() -> Iterator[Lab]:
    yield from echo_lab(ipv6=False, pod_bridge="cbr0")


@dataclass(frozen=True)
class Client:
    """A lab/client.py loop or long-lived connection running in a pod."""

    proc: subprocess.Popen[bytes]
    stop: Path  # created to end it
    out: Path  # its JSON result
    ready: Path  # created by the client once its first request is answered


def start(cluster: Cluster, pod: str, name: str, *args: str) -> Client:
    assert cluster.lab.tmpdir is not None
    tmp = cluster.lab.tmpdir
    stop, out, ready = tmp / f"stop-{name}", tmp / f"{name}.json", tmp / f"ready-{name}"
    with open(out, "wb") as f:
        proc = cluster.lab.popen(
            pod,
            sys.executable,
            CLIENT,
            *args,
            *("--stop-file", str(stop), "--ready-file", str(ready)),
            name=name,
            stdout=f,
        )
    return Client(proc, stop, out, ready)


def wait_ready(clients: Iterable[Client], timeout: float = 30.0) -> None:
    """Until every client has had its first answer (or fail, saying which did not)."""
    deadline = time.monotonic() + timeout
    waiting = list(clients)
    while waiting and time.monotonic() < deadline:
        exited = [c for c in waiting if c.proc.poll() is not None and not c.ready.exists()]
        assert not exited, f"clients ended before their first answer: {[c.out.name for c in exited]}"
        waiting = [c for c in waiting if not c.ready.exists()]
        time.sleep(0.05)
    assert not waiting, f"no first answer in {timeout}s: {[c.out.name for c in waiting]}"


def finish(client: Client) -> dict[str, Any]:
    client.stop.touch()
    client.proc.wait(timeout=30)
    result: dict[str, Any] = json.loads(client.out.read_text())
    return result


def services(cluster: Cluster) -> list[dict[str, Any]]:
    """web (NodePort, two endpoints) and echo (the line echo). In a dual-stack lab both are
    dual-stack Services, their IPv6 EndpointSlices naming the pods' IPv6 servers."""
    lab = cluster.lab
    web_port, echo_port = Port("http", 80, 8080, node_port=30500), Port("echo", ECHO_PORT, ECHO_PORT)
    web4, echo4 = [ep(cluster, "pod-1-2"), ep(cluster, "pod-1-3")], [ep(cluster, "pod-1-2")]
    if not lab.ipv6:
        web = service("web", "10.96.5.1", [web_port], type="NodePort")
        echo = service("echo", "10.96.5.2", [echo_port])
        return [*with_endpoints(web, web4), *with_endpoints(echo, echo4)]
    dual: dict[str, Any] = {"ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack"}
    web = service("web", "10.96.5.1", [web_port], type="NodePort", clusterIPs=["10.96.5.1", WEB6], **dual)
    echo = service("echo", "10.96.5.2", [echo_port], clusterIPs=["10.96.5.2", ECHO6], **dual)
    slices6 = [
        endpoint_slice(
            "web", [Port("http", 80, HTTP2_PORT)], [ep6(lab, "pod-1-2"), ep6(lab, "pod-1-3")], "v6"
        ),
        endpoint_slice("echo", [echo_port], [ep6(lab, "pod-1-2")], "v6"),
    ]
    for s in slices6:
        s["addressType"] = "IPv6"
    return [
        web,
        endpoint_slice("web", [web_port], web4, "v4"),
        echo,
        endpoint_slice("echo", [echo_port], echo4, "v4"),
        *slices6,
    ]


def ep6(lab: Lab, pod: str) -> Ep:
    return Ep(lab.pod(pod).ip6, f"node{lab.pod(pod).node}")


def upgrade_under_load(
    lab: Lab,
    tree: Path,
    label: str,
    observe: Callable[[Cluster, str], None] = lambda c, when: None,
    *,
    extra: Sequence[str] = (),
    new_extra: Sequence[str] = (),
    socket_lb_pods: bool = True,
) -> tuple[Cluster, Agent, dict[str, dict[str, Any]]]:
    """The older agent at `tree` programs node1; under load, it is stopped and this checkout's
    agent started over its pins. `observe(cluster, when)` looks at the node while the loops run:
    "before" (the old agent serving), "synced" (the new one's first sync done) and "after" (3 s
    later). Returns the cluster (with the new agent), the new agent and the loops' results by
    name (clusterip, nodeport, held; in a dual-stack lab also clusterip6 and held6). `extra`: both
    agents' further flags; `socket_lb_pods` (dual-stack lab): the pods' IPv6 connections to
    Services are the socket programs' (else the per-packet path's, as the IPv4 ones are);
    `new_extra`: the new agent's alone (flags the older one does not know)."""
    cluster = Cluster(lab, "ebpf", extra=list(extra))
    new = cluster.agents[0]
    if lab.ipv6 and socket_lb_pods:
        new.socket_lb_pods = True  # the pods' IPv6 connections to Services: the socket programs'
    old = OldAgent(lab, new, tree, label)
    new.extra += new_extra
    cluster.agents = [old]
    cluster.start()
    cluster.apply(services(cluster))
    # Bounded, and ended by their stop files long before: the checks below need them running.
    loop = ["loop", "--interval", "0.01", "--max-s", "300", "--url"]
    hold = ["hold", "--port", str(ECHO_PORT), "--max-s", "300", "--addr"]
    loops = {
        "clusterip": start(cluster, "pod-1-1", "clusterip", *loop, "http://10.96.5.1/"),
        "nodeport": start(cluster, "client", "nodeport", *loop, "http://192.168.0.11:30500/"),
        "held": start(cluster, "pod-1-1", "held", *hold, "10.96.5.2"),
    }
    if lab.ipv6:
        loops["clusterip6"] = start(cluster, "pod-1-1", "clusterip6", *loop, f"http://[{WEB6}]/")
        loops["held6"] = start(cluster, "pod-1-1", "held6", *hold, ECHO6)
    results: dict[str, dict[str, Any]] = {}
    try:
        wait_ready(loops.values())
        time.sleep(2)
        observe(cluster, "before")
        old.stop()  # SIGTERM: the old programs and maps stay and keep serving
        time.sleep(1)
        cluster.agents = [new]
        new.start()
        new.wait_version(cluster.version)
        observe(cluster, "synced")
        time.sleep(3)
        ended = [name for name, client in loops.items() if client.proc.poll() is not None]
        assert not ended, f"clients ended before the upgrade was over (nothing was checked after): {ended}"
        observe(cluster, "after")
    finally:
        results = {name: finish(loop) for name, loop in loops.items()}
    # An error's `began` (epoch seconds) placed against both agents' logs: which step it met.
    logs = "\n".join(f"{a.log_path.name}:\n{a.log_path.read_text()[-4000:]}" for a in (old, new))
    for name in [n for n in results if n.startswith(("clusterip", "nodeport"))]:
        assert results[name]["errors"] == 0 and results[name]["ok"] > 100, (name, results[name], logs)
    for name in [n for n in results if n.startswith("held")]:  # one connection, all along
        assert results[name]["errors"] == 0 and results[name]["exchanges"] > 80, (name, results[name])
    return cluster, new, results


# The clients' TCP counters the hand-over's gap moved: a SYN-ACK that met a program without its
# flow's entry reached the client untranslated (from the backend's own address), was reset, and
# the SYN went again 1 s later. Without the hand-over, 7 of 10 upgrades in the lab retransmitted a
# SYN in a client; with it none of 10 (README, "Restarts and upgrades").
GAP_COUNTERS = ("TcpExtTCPSynRetrans", "TcpOutRsts")


def tcp_counters(lab: Lab, where: str) -> dict[str, int]:
    """GAP_COUNTERS of the client namespace `where` ("client" or a pod's name)."""
    out = lab.run(lab.client if where == "client" else lab.pod(where), "nstat", "-az", *GAP_COUNTERS).stdout
    found = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)", out, re.MULTILINE)}
    assert set(found) == set(GAP_COUNTERS), out
    return found


def gap_observer(seen: dict[str, dict[str, dict[str, int]]]) -> Callable[[Cluster, str], None]:
    """An `observe` for upgrade_under_load: the clients' GAP_COUNTERS before the old agent stops
    and after the upgrade, into `seen[when][client]`."""

    def observe(cluster: Cluster, when: str) -> None:
        seen[when] = {where: tcp_counters(cluster.lab, where) for where in ("pod-1-1", "client")}

    return observe


def assert_no_gap(seen: dict[str, dict[str, dict[str, int]]]) -> None:
    moved = {
        where: {name: seen["after"][where][name] - before[name] for name in GAP_COUNTERS}
        for where, before in seen["before"].items()
    }
    assert all(not any(counts.values()) for counts in moved.values()), moved


@pytest.mark.parametrize("attach", ["clsact", "tcx"])
def test_upgrade_from_abi_v1_under_load_fails_no_request(lab: Lab, tmp_path: Path, attach: str) -> None:
    """With `tcx` the new agent's links run in front of the v1 filters (tcx runs before cls_bpf;
    their TC_ACT_UNSPEC falls through to the v1 programs) until the hand-over ends, then the v1
    filters are deleted: no filter of ours is left, the clsact qdisc is (agent/ebpf/attach.py)."""
    seen: dict[str, dict[str, dict[str, int]]] = {}
    cluster, new, _ = upgrade_under_load(
        lab, v1_tree(tmp_path), "v1", gap_observer(seen), new_extra=[f"--bpf-tc-attach={attach}"]
    )
    pins = Path(new.pin_path)
    log = new.log()
    carried = [
        int(n)
        for n in re.findall(r"upgrade from ABI v1 \(before .*?\): (\d+) conntrack entries carried over", log)
    ]
    assert carried and carried[0] > 0, log[-3000:]  # the live flows of the loops and the held connection
    assert sorted(p.name for p in pins.iterdir() if p.name.endswith("_v1")) == []
    assert (pins / "ekp_ct_tcp_v2").exists()
    # The v2 programs sat in front of the v1 ones (agent/ebpf/attach.py, hand-over) until the
    # second carry-over: a segment or reply of a flow the v1 programs started meanwhile went on to
    # them instead of meeting a v2 program without its entry. Then they took the v1 ones' place.
    if attach == "tcx":
        assert re.search(r"hand-over done: \d+ tcx links in place", log), log[-3000:]
        node = cluster.lab.node(1)
        for hook in ("ingress", "egress"):
            tc = cluster.lab.run(node, "tc", "filter", "show", "dev", "eth0", hook).stdout
            assert "ekp_" not in tc, (hook, tc)
        assert any(p.name.startswith("ekp_tcx_ingress_eth0_") for p in pins.iterdir())
    else:
        assert re.search(r"hand-over done: \d+ filters moved to priority 17", log), log[-3000:]
    stats = cluster.bpf_stats()
    assert stats["drop_no_flow"] == 0, stats
    assert_no_gap(seen)
    assert not cluster.stop(), "agent --cleanup failed"


def test_upgrade_from_the_agent_before_the_early_drop_queues_under_load_fails_no_request(
    lab: Lab, tmp_path: Path
) -> None:
    """The conntrack tables are kept as they are (same names, same layout): every flow goes on, the
    long-lived connection included; the new maps are created beside them and the counters go on
    in ekp_stats_v3."""
    tree = old_tree(
        tmp_path, V2_STATS_COMMIT, "the last agent with ekp_stats_v2", ("bpf/ekp_maps.h", "ekp_stats_v2")
    )
    cluster, new, _ = upgrade_under_load(lab, tree, "stats-v2")
    pins = Path(new.pin_path)
    names = {p.name for p in pins.iterdir() if p.name.startswith("ekp_") and "_v" in p.name}
    assert "ekp_stats_v2" not in names
    assert {"ekp_stats_v3", "ekp_ct_tcp_v2", "ekp_ctq_tcp_v3", "ekp_addr_v2", "ekp_fraghold_v2"} <= names
    carried = re.findall(r"upgrade from ekp_stats_v2: (\d+) counters carried over", new.log())
    assert carried and int(carried[0]) > 5, new.log()[-3000:]
    stats = cluster.bpf_stats()
    assert stats["packets"] > stats["new_flows"] > 200, stats  # counted before the upgrade and after
    assert stats["drop_no_flow"] == 0, stats
    assert not cluster.stop(), "agent --cleanup failed"


def test_upgrade_from_the_classid_generation_on_tcx_under_load_fails_no_request(
    lab: Lab, tmp_path: Path
) -> None:
    """An agent on tcx from before ekp_port_v2 ran a classid program in front of every ingress
    program (agent/ebpf/tcx.py's module doc). The new agent (bpf host routing, whose source check
    reads the port map) swaps its programs into the pinned links in place and then removes those
    links: every request served, the long-lived connection carried on, no client retransmitting a
    SYN or resetting, and afterwards each ingress hook runs one program, ours, with no classid pin
    left; `agent --cleanup` finds nothing foreign."""
    tree = old_tree(
        tmp_path,
        CLASSID_COMMIT,
        "the last agent with tcx's classid program",
        ("agent/ebpf/tcx.py", 'CLASSID_PROG_NAME = "ekp_tcx_classid"'),
        lacks=("bpf/ekp_maps.h", "ekp_port_v2"),
    )
    seen: dict[str, dict[str, dict[str, int]]] = {}
    gaps = gap_observer(seen)
    programs: dict[str, dict[str, list[str]]] = {}

    def observe(cluster: Cluster, when: str) -> None:
        gaps(cluster, when)
        node = cluster.lab.node(1)
        programs[when] = {dev: hooks.hook_programs(node.ns, dev) for dev in ("eth0", node.pods[0].host_iface)}

    flags = ["--bpf-tc-attach=tcx", "--bpf-host-routing=bpf"]
    cluster, new, _ = upgrade_under_load(lab, tree, "classid", observe, extra=flags)
    pod_dev = cluster.lab.node(1).pods[0].host_iface
    assert programs["before"] == {
        "eth0": ["ekp_tcx_classid", "ekp_from_net"],
        pod_dev: ["ekp_tcx_classid", "ekp_from_pod"],
    }, programs
    assert programs["after"] == {"eth0": ["ekp_from_net"], pod_dev: ["ekp_from_pod"]}, programs
    pins = Path(new.pin_path)
    assert not [p.name for p in pins.iterdir() if p.name.startswith("ekp_tcxcls_")]
    assert (pins / "ekp_port_v2").exists()
    # The older generation's v2 early-drop rings and heads go with its programs; ours are v3.
    names = {p.name for p in pins.iterdir()}
    assert not {"ekp_ctqh_v2", "ekp_ctq_tcp_v2", "ekp_ctq6_tcp_v2"} & names, sorted(names)
    assert {"ekp_ctqh_v3", "ekp_ctq_tcp_v3"} <= names, sorted(names)
    assert "removed the older generation's ekp_tcx_classid link on eth0 ingress" in new.log()
    stats = cluster.bpf_stats()
    assert stats["drop_no_flow"] == 0 and stats.get("drop_spoofed", 0) == 0, stats
    assert_no_gap(seen)
    assert not cluster.stop(), "agent --cleanup failed"


def test_upgrade_from_the_classid_generation_with_bridged_pods_drops_none_as_spoofed(
    bridged_lab: Lab, tmp_path: Path
) -> None:
    """Pods on a bridge (kubenet's cbr0) under bpf host routing, whose source check accepts a pod's
    route back by its port's bridge: the classid generation gave the program the bridge through
    its classid program, this one through ekp_port_v2. The new agent writes each port's entry
    before it swaps its program into the pinned link in place, so no packet of a bridged pod meets
    the new program without its port's entry: none dropped as spoofed_source, every request
    served, and afterwards each port's entry names the bridge."""
    tree = old_tree(
        tmp_path,
        CLASSID_COMMIT,
        "the last agent with tcx's classid program",
        ("agent/ebpf/tcx.py", 'CLASSID_PROG_NAME = "ekp_tcx_classid"'),
        lacks=("bpf/ekp_maps.h", "ekp_port_v2"),
    )
    flags = [
        "--detect-local-mode=BridgeInterface",
        "--pod-bridge-interface=cbr0",
        "--bpf-tc-attach=tcx",
        "--bpf-host-routing=bpf",
    ]
    programs: dict[str, list[str]] = {}

    def observe(cluster: Cluster, when: str) -> None:
        node = cluster.lab.node(1)
        programs[when] = hooks.hook_programs(node.ns, node.pods[0].host_iface)

    cluster, new, results = upgrade_under_load(bridged_lab, tree, "classid-bridged", observe, extra=flags)
    assert programs["before"] == ["ekp_tcx_classid", "ekp_from_pod"], programs
    assert programs["after"] == ["ekp_from_pod"], programs
    stats = cluster.bpf_stats()
    assert stats.get("drop_spoofed", 0) == 0 and stats["drop_no_flow"] == 0, (stats, results)
    node = cluster.lab.node(1)
    bridge = int(cluster.lab.run(node, "cat", "/sys/class/net/cbr0/ifindex").stdout)
    ports = {
        int(cluster.lab.run(node, "cat", f"/sys/class/net/{p.host_iface}/ifindex").stdout) for p in node.pods
    }
    path = str(Path(new.pin_path) / "ekp_port_v2")
    out = subprocess.run(["bpftool", "-j", "map", "dump", "pinned", path], check=True, capture_output=True)
    entries = {
        int.from_bytes(bytes(int(b, 16) for b in e["key"]), "little"): int.from_bytes(
            bytes(int(b, 16) for b in e["value"]), "little"
        )
        for e in json.loads(out.stdout)
    }
    assert entries == dict.fromkeys(ports, bridge), entries
    assert not cluster.stop(), "agent --cleanup failed"


def pinned_map(cluster: Cluster, name: str) -> tuple[int, int]:
    """(map id, entries) of the pinned map `name` of node1's agent, as bpftool shows it."""
    path = str(Path(cluster.agents[0].pin_path) / name)

    def bpftool(*argv: str) -> Any:
        return json.loads(subprocess.run(["bpftool", "-j", *argv], check=True, capture_output=True).stdout)

    return int(bpftool("map", "show", "pinned", path)["id"]), len(bpftool("map", "dump", "pinned", path))


def pinned_keys(cluster: Cluster, name: str) -> set[str]:
    """The keys of node1's pinned map `name`, as bpftool prints them (one string per entry)."""
    path = str(Path(cluster.agents[0].pin_path) / name)
    out = subprocess.run(["bpftool", "-j", "map", "dump", "pinned", path], check=True, capture_output=True)
    return {json.dumps(entry["key"]) for entry in json.loads(out.stdout)}


def ip6tables_rules_for(cluster: Cluster, *vips: str) -> list[str]:
    """node1's ip6tables rules (every table) that name one of `vips`."""
    out = cluster.lab.run(cluster.lab.node(1), "ip6tables-save").stdout
    return [line for line in out.splitlines() if any(vip in line for vip in vips)]


def dnat6(cluster: Cluster, vip: str, port: int) -> dict[int, str]:
    """The node's nf_conntrack entries of TCP flows to [vip]:port (ip6tables' DNAT: the socket
    programs' flows are tracked to the backend's address), by their client port."""
    out = cluster.lab.run(
        cluster.lab.node(1),
        "conntrack",
        *("-L", "-o", "id", "-f", "ipv6", "-p", "tcp", "--orig-dst", vip, "--dport", str(port)),
    ).stdout
    return {int(m.group(1)): line for line in out.splitlines() if (m := re.search(r"sport=(\d+)", line))}


def entry_id(line: str) -> str:
    """A conntrack entry's id (`-o id`): another id for the same tuple is an entry made again."""
    found = re.search(r" id=(\d+)", line)
    assert found, line
    return found.group(1)


def test_upgrade_from_the_agent_before_the_ipv6_maps_dual_stack_under_load_fails_no_request(
    dual_lab: Lab, tmp_path: Path
) -> None:
    """Dual-stack, from the agent that served IPv6 with ip6tables alone: before the upgrade ip6tables
    translates the pod's IPv6 connections to the ClusterIP (nf_conntrack DNAT entries to it); after
    it the socket programs do (no new DNAT entry while the loop goes on, and their counter moves),
    the IPv6 maps hold the Services, and the IPv6 connection opened before the upgrade goes on
    through its DNAT entry. Every request of both families succeeds."""
    tree = old_tree(
        tmp_path,
        V6_MAPS_COMMIT,
        "the last agent before the IPv6 maps",
        ("bpf/ekp_abi.h", "#define EKP_ABI_VERSION 2"),
        lacks=("bpf/ekp_maps.h", "ekp_fe6"),
    )
    seen: dict[str, tuple[dict[int, str], dict[int, str]]] = {}

    def observe(cluster: Cluster, when: str) -> None:
        seen[when] = dnat6(cluster, WEB6, 80), dnat6(cluster, ECHO6, ECHO_PORT)
        if when == "before":
            assert not (Path(cluster.agents[0].pin_path) / MAPS["fe6"].name).exists(), "no IPv6 maps yet"

    cluster, new, _ = upgrade_under_load(dual_lab, tree, "before-v6-maps", observe)
    loop_before, held_before = seen["before"]
    assert loop_before, "before the upgrade, ip6tables translates the pod's IPv6 connections"
    assert len(held_before) == 1 and " ESTABLISHED " in next(iter(held_before.values())), held_before
    loop_synced, _ = seen["synced"]
    loop_after, held_after = seen["after"]
    synced_ids = {entry_id(line) for line in loop_synced.values()}
    after_ids = {entry_id(line) for line in loop_after.values()}
    # By entry id, not client port: a port the loop used before may come again through ip6tables.
    assert after_ids <= synced_ids, "after the upgrade, no IPv6 connection through ip6tables"
    assert held_after.keys() == held_before.keys(), (held_before, held_after)
    (entry_before,), (entry_after,) = held_before.values(), held_after.values()
    assert entry_id(entry_after) == entry_id(entry_before), ("the same DNAT entry all along", entry_after)
    assert " ESTABLISHED " in entry_after, entry_after

    shown = subprocess.run(
        [sys.executable, "-m", "agent", "inspect", "maps6", f"--bpf-pin-path={new.pin_path}"],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(REPO),
        timeout=60,
    ).stdout
    frontends = {line.split()[1]: line for line in shown.splitlines() if line.startswith("fe6 ")}
    assert " internal -> " in frontends[f"[{WEB6}]:80/TCP"] and " count=2" in frontends[f"[{WEB6}]:80/TCP"], (
        shown
    )
    assert " count=1" in frontends[f"[{ECHO6}]:{ECHO_PORT}/TCP"], shown
    for pod in ("pod-1-2", "pod-1-3"):
        assert f"-> [{dual_lab.pod(pod).ip6}]:{HTTP2_PORT}/TCP" in shown, shown
    before = cluster.bpf_stats()["sock_translated"]
    answered = cluster.http(dual_lab.pod("pod-1-1"), f"http://[{WEB6}]/", count=20)
    assert answered["errors"] == 0 and set(answered["bodies"]) == {"pod-1-2", "pod-1-3"}, answered
    assert cluster.bpf_stats()["sock_translated"] - before >= 20
    now_ids = {entry_id(line) for line in dnat6(cluster, WEB6, 80).values()}
    assert now_ids <= synced_ids, "the socket programs', not ip6tables'"
    stats = cluster.bpf_stats()
    assert stats["drop_no_flow"] == 0, stats
    assert not cluster.stop(), "agent --cleanup failed"


# main before the hand-over (the agent this branch upgrades from): the tc programs' IPv6 path
# (ekp_calls6, bpf/ekp_tc6.h), no ekp_handover.
MAIN_BEFORE_HANDOVER = "267132de2407ad35b4ca07f96b686bf6abfa3bac"


def test_upgrade_from_the_agent_before_the_hand_over_with_the_tc_ipv6_path_under_load_fails_no_request(
    dual_lab: Lab, tmp_path: Path
) -> None:
    """Dual-stack, --bpf-host-routing=bpf, pods' sockets left to the per-packet path: the pod's IPv6
    connections to the ClusterIP are the tc programs' IPv6 path's (no nf_conntrack DNAT entry to
    it, before, during or after the upgrade, though the older agent's ip6tables rules for it are
    there; the socket programs translate none; its conntrack table gains the loop's new flows
    between each pair of observations: before, synced, after the upgrade), in the older
    build and in this one, over the same IPv6 conntrack tables (the same ABI: the programs are
    replaced in place, no hand-over). Every request of both families succeeds, both long-lived
    connections carry on, no segment is dropped as no_flow and no client retransmits a SYN or
    sends a RST."""
    tree = old_tree(
        tmp_path,
        MAIN_BEFORE_HANDOVER,
        "the agent before the hand-over",
        ("bpf/ekp_tc.c", "ekp_calls6"),
        lacks=("bpf/ekp_abi.h", "ekp_handover"),
    )
    seen: dict[str, dict[str, dict[str, int]]] = {}
    rules6: dict[str, list[str]] = {}
    dnat: dict[str, tuple[dict[int, str], dict[int, str]]] = {}
    sock: dict[str, int] = {}
    gaps = gap_observer(seen)

    ct6: dict[str, tuple[int, int]] = {}
    keys6: dict[str, set[str]] = {}

    def observe(cluster: Cluster, when: str) -> None:
        gaps(cluster, when)
        rules6[when] = ip6tables_rules_for(cluster, WEB6, ECHO6)
        dnat[when] = dnat6(cluster, WEB6, 80), dnat6(cluster, ECHO6, ECHO_PORT)
        sock[when] = cluster.bpf_stats()["sock_translated"]
        ct6[when] = pinned_map(cluster, MAPS["ct6_tcp"].name)
        keys6[when] = pinned_keys(cluster, MAPS["ct6_tcp"].name)

    cluster, new, _ = upgrade_under_load(
        dual_lab, tree, "before-hand-over", observe, extra=("--bpf-host-routing=bpf",), socket_lb_pods=False
    )
    assert "hand-over" not in new.log(), "the same conntrack tables: replaced in place"
    # The older agent keeps ip6tables rules for the IPv6 ClusterIPs (its fallback): a connection that
    # reached netfilter untranslated would get a DNAT entry, so their absence says the tc path took it.
    assert rules6["before"], "ip6tables rules for the IPv6 ClusterIPs: the DNAT check below can fail"
    assert all(loop == {} and held == {} for loop, held in dnat.values()), dnat
    assert sock["after"] == sock["before"], "the pods' connections are the per-packet path's"
    # the tc IPv6 path's flows, in the same table all along (the long-lived one's two entries at least)
    assert len({ident for ident, _ in ct6.values()}) == 1 and min(n for _, n in ct6.values()) >= 2, ct6
    # and it made new ones between each pair of observations: the loop's connections were its own
    # before, across and after the upgrade (the socket programs translated none, ip6tables made no DNAT)
    for earlier, later in (("before", "synced"), ("synced", "after")):
        assert keys6[later] - keys6[earlier], f"no new IPv6 conntrack entry between {earlier} and {later}"
    stats = cluster.bpf_stats()
    assert stats["drop_no_flow"] == 0, stats
    assert_no_gap(seen)
    assert not cluster.stop(), "agent --cleanup failed"
