"""The lab itself: topology, reachability, servers, clients, pod churn, host isolation, cleanup."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from lab import CommandError, Lab, LabError, LabFactory, cleanup_leftovers, netns
from lab.core import PODSERVER
from lab.harness import Agent

pytestmark = pytest.mark.kernel

REPO = Path(__file__).resolve().parents[1]


def ip_json(lab: Lab | None, ns: Any, *args: str) -> list[dict[str, Any]]:
    argv = ["ip", "-j", *args]
    out = lab.run(ns, *argv).stdout if lab else subprocess.run(argv, capture_output=True, text=True).stdout
    result: list[dict[str, Any]] = json.loads(out or "[]")
    return result


def test_build_is_fast_and_named_by_prefix(lab2: Lab) -> None:
    assert lab2.build_seconds is not None and lab2.build_seconds < 2.0
    assert re.fullmatch(r"ekp[0-9a-f]{6}", lab2.prefix)
    roles = [ns.removeprefix(lab2.prefix + "-") for ns in lab2.namespaces]
    assert sorted(roles) == sorted(
        ["net", "client", "node1", "node2", "pod-1-1", "pod-1-2", "pod-2-1", "pod-2-2"]
    )
    existing = set(netns.list_netns())
    assert set(lab2.namespaces) <= existing
    assert [p.name for p in lab2.pods] == ["pod-1-1", "pod-1-2", "pod-2-1", "pod-2-2"]
    assert [p.ip for p in lab2.pods] == ["10.244.1.2", "10.244.1.3", "10.244.2.2", "10.244.2.3"]
    assert lab2.nodes[1].pod_ifaces == ["lxc-p1", "lxc-p2"]
    assert lab2.pod(2, 1) is lab2.pod("pod-2-1") is lab2.pods[2]


def test_addressing_and_routes(lab2: Lab) -> None:
    for node in lab2.nodes:
        eth0 = ip_json(lab2, node, "addr", "show", "dev", "eth0")[0]["addr_info"]
        assert {(a["local"], a["prefixlen"]) for a in eth0 if a["family"] == "inet"} == {(node.ip, 24)}
        routes = {r["dst"]: r for r in ip_json(lab2, node, "route", "show")}
        other = lab2.nodes[1 - (node.index - 1)]
        assert routes[other.pod_cidr]["gateway"] == other.ip
        for pod in node.pods:
            lxc = ip_json(lab2, node, "addr", "show", "dev", pod.host_iface)[0]["addr_info"]
            assert {(a["local"], a["prefixlen"]) for a in lxc if a["family"] == "inet"} == {
                (node.gateway, 32)
            }
            assert routes[pod.ip]["dev"] == pod.host_iface and routes[pod.ip]["scope"] == "link"
        assert lab2.get_sysctl(node, "net.ipv4.ip_forward") == "1"
    for pod in lab2.pods:
        addrs = ip_json(lab2, pod, "addr", "show", "dev", "eth0")[0]["addr_info"]
        assert {(a["local"], a["prefixlen"]) for a in addrs if a["family"] == "inet"} == {(pod.ip, 24)}
        routes = {r["dst"]: r for r in ip_json(lab2, pod, "route", "show")}
        assert routes["default"]["gateway"] == pod.gateway
    client = ip_json(lab2, lab2.client, "addr", "show", "dev", "eth0")[0]["addr_info"]
    assert {(a["local"], a["prefixlen"]) for a in client if a["family"] == "inet"} == {("192.168.0.100", 24)}
    assert lab2.client.ip == "192.168.0.100"


def test_pods_reach_each_other_on_one_node(lab2: Lab) -> None:
    p11, p12 = lab2.nodes[0].pods
    assert lab2.http_get(p11, p12.ip) == "pod-1-2\n"
    assert lab2.http_get(p12, p11.ip, path="/ip") == f"{p12.ip}\n"


def test_pods_reach_each_other_across_nodes(lab2: Lab) -> None:
    for src in lab2.pods:
        for dst in lab2.pods:
            assert lab2.http_get(src, dst.ip) == f"{dst.name}\n"
    # No NAT on the way: the server sees the pod's own address.
    assert lab2.http_get(lab2.pod("pod-1-1"), lab2.pod("pod-2-2").ip, path="/ip") == "10.244.1.2\n"


def test_udp_echo(lab2: Lab) -> None:
    assert lab2.udp_echo(lab2.pod("pod-1-2"), lab2.pod("pod-2-1").ip, payload="hello") == "pod-2-1 hello"
    assert lab2.udp_echo(lab2.nodes[0], lab2.pod("pod-1-1").ip) == "pod-1-1 ping"


def test_the_udp_client_names_each_requests_source_port_and_who_answered_it(lab2: Lab) -> None:
    """lab/client.py udp --flows: one [source port, answer] per request, in order; a new socket
    each (its own ephemeral port) unless --sport pins one; "lost" when nothing answered."""
    client = str(REPO / "lab" / "client.py")

    def udp(*args: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(lab2.run("pod-1-2", sys.executable, client, "udp", *args).stdout)
        return out

    low, high = (
        int(p) for p in lab2.run("pod-1-2", "sysctl", "-n", "net.ipv4.ip_local_port_range").stdout.split()
    )
    echo = udp("--addr", lab2.pod("pod-2-1").ip, "--port", "9000", "--count", "4", "--flows")
    assert echo["replies"] == {"pod-2-1": 4} and [who for _, who in echo["flows"]] == ["pod-2-1"] * 4, echo
    assert all(low <= port <= high for port, _ in echo["flows"]), echo
    pinned = udp(
        "--addr", lab2.pod("pod-2-1").ip, "--port", "9000", "--count", "2", "--flows", "--sport", "40123"
    )
    assert pinned["flows"] == [[40123, "pod-2-1"], [40123, "pod-2-1"]], pinned
    silent = udp(
        "--addr", lab2.pod("pod-2-1").ip, "--port", "9999", "--count", "1", "--timeout", "0.3", "--flows"
    )
    assert silent["lost"] == 1 and [who for _, who in silent["flows"]] == ["lost"], silent
    assert "flows" not in udp("--addr", lab2.pod("pod-2-1").ip, "--port", "9000")  # only when asked


def test_the_peer_client_counts_many_connections_peers_bodies_and_errors(lab2: Lab) -> None:
    """lab/client.py peer --count N: N connections from one process, what getpeername() named and
    what each answered counted, a refused one counted by its errno name; one connection's output
    is as before."""
    client = str(REPO / "lab" / "client.py")
    pod = lab2.pod("pod-2-1")

    def peer(*args: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(lab2.run("pod-1-2", sys.executable, client, "peer", *args).stdout)
        return out

    many = peer("--addr", pod.ip, "--port", "8080", "--count", "3")
    assert many == {"peers": {f"{pod.ip}:8080": 3}, "bodies": {"pod-2-1": 3}, "errors": {}}, many
    refused = peer("--addr", pod.ip, "--port", "1", "--count", "2")
    assert refused == {"peers": {}, "bodies": {}, "errors": {"ECONNREFUSED": 2}}, refused
    assert peer("--addr", pod.ip, "--port", "8080") == {"peer": f"{pod.ip}:8080", "body": "pod-2-1"}


def test_nodes_reach_pods_and_each_other(lab2: Lab) -> None:
    n1, n2 = lab2.nodes
    assert lab2.http_get(n1, lab2.pod("pod-2-1").ip) == "pod-2-1\n"
    assert lab2.tcp_probe(n1, n2.ip, 1) == "refused"


def test_client_reaches_node_ips_only_until_routed(lab2: Lab) -> None:
    for node in lab2.nodes:
        assert lab2.tcp_probe(lab2.client, node.ip, 1) == "refused"  # a RST: the node answered
    pod = lab2.pod("pod-2-1")
    assert lab2.tcp_probe(lab2.client, pod.ip, 8080) == "unreachable"
    lab2.add_client_route("10.244.0.0/16", via_node=2)
    try:
        assert lab2.http_get(lab2.client, pod.ip, path="/ip") == "192.168.0.100\n"
        assert lab2.curl(lab2.client, f"http://{pod.ip}:8080/") == "pod-2-1\n"
    finally:
        lab2.del_client_route("10.244.0.0/16")
    assert lab2.tcp_probe(lab2.client, pod.ip, 8080) == "unreachable"


def test_dns_over_udp_and_tcp(lab2: Lab) -> None:
    server = lab2.pod("pod-2-2")
    dns = lab2.start_dns(server)
    try:
        client = lab2.pod("pod-1-1")
        assert lab2.dig(client, server.ip) == '"pod-2-2"'
        assert lab2.dns_whoami(client, server.ip, tcp=True) == "pod-2-2"
        assert lab2.dig(client, server.ip, "anything.svc.lab", "A") == "10.0.0.1"
        assert lab2.dig(client, server.ip, "pod-2-2.lab", "A", tcp=True) == server.ip
    finally:
        assert lab2.stop(dns) is not None
    with pytest.raises(CommandError):
        lab2.dig(lab2.pod("pod-1-1"), server.ip, timeout=1)


def test_nginx(lab2: Lab) -> None:
    pod = lab2.pod("pod-1-2")
    proc = lab2.start_nginx(pod)
    try:
        assert lab2.curl(lab2.pod("pod-2-1"), f"http://{pod.ip}:8081/") == "pod-1-2\n"
        assert lab2.http_get(lab2.pod("pod-2-1"), pod.ip, 8081, "/ip") == "10.244.2.2\n"
    finally:
        lab2.stop(proc)
    assert lab2.tcp_probe(lab2.pod("pod-2-1"), pod.ip, 8081) == "refused"


def test_server_failure_is_reported_fast(lab2: Lab) -> None:
    pod = lab2.pod("pod-1-1")
    with pytest.raises(LabError, match="Address already in use"):
        lab2.start_podserver(pod, http_ports=(8080,), udp_ports=())


def test_add_and_remove_pod_with_blob(lab2: Lab, tmp_path: Path) -> None:
    node2 = lab2.node(2)
    pod = lab2.add_pod(2)
    assert (pod.name, pod.ip, pod.host_iface) == ("pod-2-3", "10.244.2.4", "lxc-p3")
    blob, digest = lab2.make_blob(3 << 20)
    lab2.start_podserver(pod, blob=blob)
    src = lab2.pod("pod-1-1")
    status, body = lab2.http_fetch(src, pod.ip, path="/blob")
    assert status == 200 and hashlib.sha256(body).hexdigest() == digest
    out = tmp_path / "blob"
    lab2.curl(src, f"http://{pod.ip}:8080/blob", args=["-o", str(out)])
    assert hashlib.sha256(out.read_bytes()).hexdigest() == digest

    lab2.remove_pod(pod)
    assert pod.ns not in netns.list_netns()
    assert "lxc-p3" not in lab2.run(node2, "ip", "-o", "link").stdout
    assert pod not in lab2.pods and not any(p.ns == pod.ns for p in lab2.processes)
    assert lab2.tcp_probe(src, pod.ip, 8080) != "open"

    again = lab2.add_pod(node2, 3)  # the index is free again at once
    try:
        lab2.start_podserver(again)
        assert lab2.http_get(src, again.ip) == "pod-2-3\n"
    finally:
        lab2.remove_pod(again)


def test_processes_tracked_logged_and_in_cgroups(lab2: Lab) -> None:
    node = lab2.nodes[0]
    proc = lab2.popen(node, "sh", "-c", "echo started; exec sleep 60", name="sleeper")
    assert any(p.popen is proc for p in lab2.processes)
    lab2.wait_log(proc, "started")
    assert proc.pid in netns.netns_pids(node.ns)
    assert lab2.stop(proc) == -15
    assert not any(p.popen is proc for p in lab2.processes)
    assert lab2.log_of(proc) == "started\n"
    if lab2.cgroup_root is None:
        pytest.skip("no cgroup2 hierarchy")
    pod = lab2.pod("pod-2-1")
    assert f"0::/{lab2.prefix}/node2/pod-2-1" in lab2.run(pod, "cat", "/proc/self/cgroup").stdout.splitlines()
    assert f"0::/{lab2.prefix}/node1/host" in lab2.run(node, "cat", "/proc/self/cgroup").stdout.splitlines()
    assert node.cgroup_root == os.path.dirname(node.cgroup or "")


def test_each_node_takes_its_own_xtables_lock_and_its_agent_the_same_one(lab2: Lab) -> None:
    """A node's own lock (`Lab.xtables_lock`) holds up that node's commands, its host-namespace
    agent's (`--netns`, `Lab.popen`) and its one-shot host-namespace ones (`agent --cleanup`,
    `Lab.run`), not another node's (issue 18). That they wait on it also shows they do not take
    the machine's /run/xtables.lock, which this test never touches (other labs use it)."""
    node1, node2 = lab2.nodes
    # filter, not nat: a legacy nat table would stay in this module-shared lab's nodes, its NAT
    # hooks on every later test's packets
    probe = ("iptables-legacy", "-w", "1", "-t", "filter", "-N", "EKP-LOCK-PROBE")
    try:
        # A private lock held for as long as the block runs (so no timing window to race): every
        # probe waits its `-w 1` out and fails on it while the lock is held, all at once.
        with netns.flock_held(lab2.xtables_lock(node1), 60):
            mine = lab2.popen(node1, *probe)
            agent = lab2.popen(None, "ip", "netns", "exec", node1.ns, *probe, xtables=node1)
            one_shot = lab2.run(None, "ip", "netns", "exec", node1.ns, *probe, xtables=node1, check=False)
            other = lab2.run(node2, *probe, check=False)
            mine.wait(timeout=30)
            agent.wait(timeout=30)
        assert mine.returncode != 0 and "xtables lock" in lab2.log_of(mine), lab2.log_of(mine)
        assert agent.returncode != 0 and "xtables lock" in lab2.log_of(agent), lab2.log_of(agent)
        assert one_shot.returncode != 0 and "xtables lock" in one_shot.stderr, one_shot
        assert other.returncode == 0, other
    finally:
        for node in (node1, node2):
            lab2.run(node, "iptables-legacy", "-w", "5", "-t", "filter", "-X", "EKP-LOCK-PROBE", check=False)


def test_agent_cleanup_takes_its_nodes_xtables_lock(lab2: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """`agent --cleanup` (a legacy restore of thousands of Services: seconds) waits on the node's
    own lock, as the agent it cleans up after did, not on the machine's (issue 18)."""
    node = lab2.nodes[0]
    assert lab2.tmpdir is not None
    agent = Agent(lab2, node, "iptables", [f"--services-file={lab2.tmpdir / 'no-services.yaml'}"])
    ran: list[list[str]] = []
    real_run = subprocess.run

    def recording_run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        ran.append(list(argv))
        res: subprocess.CompletedProcess[str] = real_run(argv, **kwargs)
        return res

    monkeypatch.setattr(subprocess, "run", recording_run)
    res = agent.cleanup()
    assert res.returncode == 0, res.stdout + res.stderr
    [argv] = ran
    assert argv[:2] == ["env", f"XTABLES_LOCKFILE={lab2.xtables_lock(node)}"], argv
    assert argv[2:5] == [sys.executable, "-m", "agent"], argv


def test_a_namespace_command_needs_the_lab_up_for_its_xtables_lock(kernel_required: None) -> None:
    """Before `up()` there is no lock file to name: a command for a namespace raises rather than
    fall back to the machine's /run/xtables.lock; a host command with no lock to take is fine."""
    lab = Lab(nodes=1, pods_per_node=1)
    with pytest.raises(LabError, match="is not up"):
        lab.command("node1", "iptables-legacy", "-S")
    with pytest.raises(LabError, match="is not up"):
        lab.command(None, "agent", "--cleanup", xtables="node1")
    assert lab.command(None, "true", cgroup=None) == ["true"]


def test_a_scratch_namespace_has_a_lock_of_its_own_that_lab_cleanup_would_find(kernel_required: None) -> None:
    before = os.environ.get(netns.XTABLES_LOCKFILE)
    with netns.scratch_netns("ekpt-scratch") as name:
        lock = os.environ[netns.XTABLES_LOCKFILE]
        lock_dir = os.path.dirname(lock)
        assert lock != "/run/xtables.lock" and name in lock_dir, lock
        assert lock_dir in netns.tmp_dirs(), "a killed run's lock dir would be nobody's to remove"
        assert name in netns.list_netns()
    assert not os.path.exists(lock_dir)
    assert name not in netns.list_netns()
    assert os.environ.get(netns.XTABLES_LOCKFILE) == before


def test_lab_cleanup_leaves_a_running_scratch_namespaces_lock_dir(kernel_required: None) -> None:
    """`python -m lab cleanup` beside a running scratch namespace leaves its xtables lock dir (its
    iptables-legacy could no longer open the lock), and removes one whose owner is gone."""
    with netns.scratch_netns("ekpt-scratch"):
        lock_dir = os.path.dirname(os.environ[netns.XTABLES_LOCKFILE])
        # The dir's own prefix: this cleanup reaches nothing but it.
        prefix = os.path.basename(lock_dir)[: len("ekp") + 6]
        assert cleanup_leftovers(prefix) == []
        assert os.path.isdir(lock_dir)
    killed = tempfile.mkdtemp(prefix=f"{netns.new_prefix()}-ekpt-scratch-xtables-")
    with open(os.path.join(killed, netns.OWNER_FILE), "w") as f:
        # This process's pid with another start time: a killed run's pid, reused since.
        f.write(f"{os.getpid()} {(netns.proc_starttime(os.getpid()) or 0) + 1}\n")
    prefix = os.path.basename(killed)[: len("ekp") + 6]
    assert cleanup_leftovers(prefix) == [f"temporary directory {killed}"]
    assert not os.path.exists(killed)


def test_a_scratch_lock_dir_has_its_owner_before_it_has_a_lab_name(
    kernel_required: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `python -m lab cleanup` beside scratch_netns's start must never find the lock dir under a
    lab's name without its owner file (it would remove it from under the namespace's process):
    marked under another name, then renamed."""
    marking = netns.mark_owner
    seen: list[tuple[str, list[str]]] = []

    def marked_while_a_cleanup_lists(path: str) -> None:
        seen.append((path, netns.tmp_dirs()))  # what a cleanup at this moment would remove
        marking(path)

    monkeypatch.setattr(netns, "mark_owner", marked_while_a_cleanup_lists)
    with netns.scratch_netns("ekpt-scratch"):
        lock_dir = os.path.dirname(os.environ[netns.XTABLES_LOCKFILE])
        assert netns.owner_alive(lock_dir) == os.getpid()
        assert lock_dir in netns.tmp_dirs()
    [(path, listed)] = seen
    assert path not in listed


def test_lab_cleanup_sweeps_a_killed_runs_scratch_staging_dir_and_no_live_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed between scratch_netns's mkdtemp and its rename leaves `ekp-scratch-*`, which
    has no lab prefix: the whole cleanup removes it once its owner (in its name) is gone, and
    never one whose owner runs, even before its owner file is written."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pid, start = os.getpid(), netns.proc_starttime(os.getpid()) or 0
    dead = tmp_path / f"{netns.STAGING}{pid}.{start + 1}-ekpt-scratch-1a2b3c4d-x1"  # a pid reused since
    live = tmp_path / f"{netns.STAGING}{pid}.{start}-ekpt-scratch-5e6f7a8b-x2"  # no owner file yet
    older_dead = tmp_path / f"{netns.STAGING}ekpt-scratch-9a9a9a9a-x3"  # named the older way
    older_marking = tmp_path / f"{netns.STAGING}ekpt-scratch-8b8b8b8b-x4"  # ... before its mark_owner
    for d in (dead, live, older_dead, older_marking):
        d.mkdir()
    (older_dead / netns.OWNER_FILE).write_text(f"{pid} {start + 1}\n")
    assert netns.sweep_staging(dry_run=True) == [f"temporary directory {d}" for d in (dead, older_dead)]
    assert dead.is_dir() and older_dead.is_dir()
    for nothing in ("list_netns", "lab_cgroups", "pin_dirs"):  # the rest of the machine's left alone
        monkeypatch.setattr(netns, nothing, lambda *args: [])
    monkeypatch.setattr(netns, "AGENT_STATE_DIR", str(tmp_path / "agent-state"))
    assert cleanup_leftovers(None, dry_run=True) == [f"temporary directory {d}" for d in (dead, older_dead)]
    assert netns.sweep_staging() == [f"temporary directory {d}" for d in (dead, older_dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, older_marking.name])


def test_a_scratch_staging_dir_names_its_owner_from_the_start(
    kernel_required: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    marking = netns.mark_owner
    swept: list[list[str]] = []

    def marked_while_a_cleanup_sweeps(path: str) -> None:
        assert os.path.basename(path).startswith(f"{netns.STAGING}{os.getpid()}.")
        swept.append(netns.sweep_staging(dry_run=True))
        marking(path)

    monkeypatch.setattr(netns, "mark_owner", marked_while_a_cleanup_sweeps)
    with netns.scratch_netns("ekpt-scratch"):
        pass
    assert swept == [[]]


def test_mark_owner_refuses_an_unknown_start_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No start time read: an error, not "pid None" (which owner_alive reads as no owner)."""
    monkeypatch.setattr(netns, "proc_starttime", lambda pid: None)
    with pytest.raises(RuntimeError, match="start time"):
        netns.mark_owner(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_lab_tmp_dirs_are_named_by_a_lab_prefix_exactly() -> None:
    """Another test's `ekp-guard-*` dir, or `ekp` and six characters that are not hex, is not a
    lab's: `python -m lab cleanup` would remove it from under its owner."""
    prefix = netns.new_prefix()
    made = [tempfile.mkdtemp(prefix=p) for p in (f"{prefix}-", "ekp-guard-", "ekpzzzzzz-")]
    try:
        found = netns.tmp_dirs()
        assert made[0] in found
        assert made[1] not in found and made[2] not in found, found
    finally:
        for d in made:
            os.rmdir(d)


def test_run_errors(lab2: Lab) -> None:
    with pytest.raises(CommandError, match=lab2.nodes[0].ns):
        lab2.run(lab2.nodes[0], "sh", "-c", "echo oops >&2; exit 3")
    assert lab2.run("node1", "sh", "-c", "exit 4", check=False).returncode == 4


def _host_state() -> tuple[list[str], list[str], set[str]]:
    routes = sorted(
        json.dumps(r, sort_keys=True) for r in ip_json(None, None, "route", "show", "table", "all")
    )
    addrs = sorted(
        f"{i['ifname']} {a['local']}/{a['prefixlen']}"
        for i in ip_json(None, None, "addr")
        for a in i["addr_info"]
    )
    links = {i["ifname"] for i in ip_json(None, None, "link")}
    return routes, addrs, links


def test_host_namespace_untouched(make_lab: LabFactory) -> None:
    before = _host_state()
    lab = make_lab(nodes=2, pods_per_node=1)
    lab.add_client_route("203.0.113.0/24", via_node=1)
    lab.add_pod(1)
    after = _host_state()
    assert after == before
    lab_nets = [ipaddress.ip_network("10.244.0.0/16"), ipaddress.ip_network("192.168.0.0/24")]
    for r in ip_json(None, None, "route", "show", "table", "all"):
        if r["dst"] in ("default", "multicast") or ":" in r["dst"]:
            continue
        dst = ipaddress.ip_network(r["dst"], strict=False)
        assert not any(dst.overlaps(n) for n in lab_nets), r
    assert netns.host_lab_links() == []


def test_cleanup_command_removes_leftovers() -> None:
    prefix = netns.new_prefix()
    ns = f"{prefix}-node1"
    pin = Path(netns.BPFFS) / f"{netns.PIN_PREFIX}{prefix}-node1"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True)
        sleeper = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "60"], start_new_session=True)
        pin.mkdir()
        assert sleeper.pid in netns.netns_pids(ns) or sleeper.poll() is None
        res = subprocess.run(
            [sys.executable, "-m", "lab", "cleanup", "--prefix", prefix],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert res.returncode == 0, res.stderr
        assert f"removed network namespace {ns}" in res.stdout
        assert f"removed bpffs pin {pin}" in res.stdout
        assert sleeper.wait(5) == -9
        assert netns.find_leaks([prefix]) == []
    finally:
        cleanup_leftovers(prefix)


def test_lab_cleanup_leaves_a_running_lab_whole_and_names_it(make_lab: LabFactory) -> None:
    """`python -m lab cleanup` beside a running lab (a test run, `python -m lab up`) leaves its
    namespaces, processes, cgroups, pins and tmp dir: its owner, this process, still runs."""
    lab = make_lab(nodes=1, pods_per_node=1, servers=False)
    assert lab.tmpdir is not None
    assert netns.owner_alive(str(lab.tmpdir)) == os.getpid()
    pin = Path(netns.BPFFS) / f"{netns.PIN_PREFIX}{lab.prefix}-node1"
    pin.mkdir()
    try:
        sleeper = lab.popen(lab.nodes[0], "sleep", "60")
        assert cleanup_leftovers(lab.prefix) == []
        assert set(lab.namespaces) <= set(netns.list_netns())
        assert sleeper.poll() is None and pin.is_dir() and lab.tmpdir.is_dir()
        assert netns.lab_cgroups(lab.prefix) != []
        res = subprocess.run(
            [sys.executable, "-m", "lab", "cleanup", "--prefix", lab.prefix, "--dry-run"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == [
            f"left lab {lab.prefix}: its owner, pid {os.getpid()}, still runs",
            "nothing to clean up",
        ]
    finally:
        pin.rmdir()


def test_lab_cleanup_takes_a_lab_whose_owner_is_gone(make_lab: LabFactory) -> None:
    """The same lab once its owner file names a process gone (a killed run's pid, reused since):
    everything of it is a leftover again (a dry run: the lab's own teardown removes it)."""
    lab = make_lab(nodes=1, pods_per_node=1, servers=False)
    assert lab.tmpdir is not None
    owner = lab.tmpdir / netns.OWNER_FILE
    mine = owner.read_text()
    owner.write_text(f"{os.getpid()} {(netns.proc_starttime(os.getpid()) or 0) + 1}\n")
    try:
        found = cleanup_leftovers(lab.prefix, dry_run=True)
    finally:
        owner.write_text(mine)
    assert sorted(found) == sorted(
        [f"network namespace {ns}" for ns in lab.namespaces]
        + [f"cgroup {cg}" for cg in netns.lab_cgroups(lab.prefix)]
        + [f"temporary directory {lab.tmpdir}"]
    )


def test_a_labs_tmp_dir_names_its_owner_before_any_namespace_exists(
    make_lab: LabFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cleanup beside a lab's start must never find its namespaces, or its tmp dir under the
    lab's name, with no owner named: the dir is marked under a staging name, renamed, and only
    then are the namespaces made."""
    marking = netns.mark_owner
    seen: list[tuple[str, list[str], list[str]]] = []

    def marked_while_a_cleanup_lists(path: str) -> None:
        seen.append((path, netns.tmp_dirs(), netns.list_netns()))
        marking(path)

    monkeypatch.setattr(netns, "mark_owner", marked_while_a_cleanup_lists)
    lab = make_lab(nodes=1, pods_per_node=1, servers=False)
    [(path, dirs, namespaces)] = seen
    assert path not in dirs and str(lab.tmpdir) not in dirs
    assert not any(ns.startswith(f"{lab.prefix}-") for ns in namespaces)
    assert netns.live_prefixes(lab.prefix) == {lab.prefix: os.getpid()}


def test_a_forked_child_killed_by_sigterm_runs_none_of_the_parents_teardown(
    lab2: Lab, tmp_path: Path
) -> None:
    """The lab's SIGTERM handler is inherited by forked children (pyroute2's netns helpers); there it
    must end the child, not raise KeyboardInterrupt through the parent's copied stack, whose
    `finally` blocks are fixture teardowns (`ip netns del`, `umount`) of the running parent."""
    marker = tmp_path / "teardown-ran"
    ready = tmp_path / "child-ready"
    pid = os.fork()
    if pid == 0:  # the child: a `finally` standing for a fixture teardown
        try:
            try:
                ready.touch()
                time.sleep(30)
            finally:
                marker.touch()
        finally:
            os._exit(0)  # never back into pytest's stack in the child
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGTERM
    assert not marker.exists(), "the child ran the parent's teardown"


def test_an_ipv6_lab_carries_ula_addresses_beside_ipv4_and_routes_them(make_lab: LabFactory) -> None:
    """Lab(ipv6=True): every host gets its IPv6 twin (no DAD: usable at once), pods reach pods on
    the other node through both gateways, the client reaches the nodes, IPv4 is as before."""
    lab = make_lab(nodes=2, pods_per_node=1, ipv6=True)
    pod1, pod2 = lab.pod(1, 1), lab.pod(2, 1)
    assert (pod1.ip6, pod2.ip6, lab.node(1).ip6, lab.client.ip6) == (
        "fd00:10:244:1::2",
        "fd00:10:244:2::2",
        "fd00:192:168::11",
        "fd00:192:168::100",
    )
    addrs = ip_json(lab, pod1, "-6", "addr", "show", "dev", "eth0")[0]["addr_info"]
    ula = [a for a in addrs if a["local"] == pod1.ip6]
    assert ula and not ula[0].get("tentative"), ula
    # A closed port answers with a reset: "refused" means the SYN went there and the RST came back.
    # The deadline is past TCP's first SYN retransmission (1 s): a first SYN lost while a new
    # host's neighbours resolve on a loaded machine is retried, as any client's would be.
    assert lab.tcp_probe(pod1, pod2.ip6, 1, timeout=5.0) == "refused"
    assert lab.tcp_probe(lab.client, lab.node(2).ip6, 1, timeout=5.0) == "refused"
    assert lab.tcp_probe(pod1, pod2.ip, 1, timeout=5.0) == "refused"
    added = lab.add_pod(1)
    assert lab.tcp_probe(added, pod2.ip6, 1, timeout=5.0) == "refused"
    assert lab.tcp_probe(pod1, "fd00:10:244:9::2", 1, timeout=0.5) in ("unreachable", "timeout")
    assert lab.get_sysctl(lab.node(1), "net.ipv6.conf.all.forwarding") == "1"


def test_nginx_in_an_ipv6_lab_answers_on_both_families(make_lab: LabFactory) -> None:
    """A host with an IPv6 address gets nginx on [::] too (the benchmark's IPv6 rows reach the same
    server over IPv6); http_get and wait_tcp follow the address's family."""
    lab = make_lab(nodes=1, pods_per_node=2, ipv6=True)
    client, server = lab.pod(1, 1), lab.pod(1, 2)
    proc = lab.start_nginx(server)
    try:
        assert lab.http_get(client, server.ip6, 8081) == "pod-1-2\n"
        assert lab.http_get(client, server.ip6, 8081, "/ip") == f"{client.ip6}\n"
        assert lab.curl(client, f"http://{server.ip}:8081/ip") == f"{client.ip}\n"
    finally:
        lab.stop(proc)
    assert lab.tcp_probe(client, server.ip6, 8081) == "refused"


def test_the_podserver_with_ipv6_answers_http_and_the_line_echo_on_both_families(
    make_lab: LabFactory,
) -> None:
    """`podserver.py --ipv6`: the HTTP and TCP line echo ports listen on [::] beside 0.0.0.0 (the
    dual-stack upgrade test's IPv6 endpoints); without it they are IPv4 only."""
    lab = make_lab(nodes=1, pods_per_node=2, ipv6=True)
    client, server = lab.pod(1, 1), lab.pod(1, 2)
    argv = [sys.executable, "-I", "-S", str(PODSERVER), "--name", server.name, "--http-port=8085"]
    echo = "import socket, sys; s = socket.create_connection((sys.argv[1], 7000), 3); s.sendall(b'hi\\n')"
    echo += "; print(s.recv(64).decode().strip())"
    proc = lab.popen(server, *argv, "--udp-port=9005", "--tcp-echo-port=7000", "--ipv6", name="podserver6")
    try:
        lab.wait_tcp(client, server.ip6, 7000, proc=proc)
        assert lab.http_get(client, server.ip6, 8085, "/ip") == f"{client.ip6}\n"
        assert lab.http_get(client, server.ip, 8085) == "pod-1-2\n"
        for addr in (server.ip6, server.ip):
            assert lab.run(client, sys.executable, "-c", echo, addr).stdout.strip() == "hi", addr
    finally:
        lab.stop(proc)
    proc = lab.popen(server, *argv, "--udp-port=9006", "--tcp-echo-port=7000", name="podserver4")
    try:
        lab.wait_tcp(client, server.ip, 7000, proc=proc)
        assert lab.tcp_probe(client, server.ip6, 7000) == "refused"
        assert lab.tcp_probe(client, server.ip6, 8085) == "refused"
    finally:
        lab.stop(proc)


def test_the_sctp_hold_counts_an_echo_after_its_wait_late_and_a_missing_one_lost(lab2: Lab) -> None:
    """lab/sctppeer.py hold: an echo the peer sends after the chunk's wait ran out (a stalled
    process on a loaded machine) is late, not lost; one that never comes while the hold runs is
    lost."""
    peer = str(REPO / "lab" / "sctppeer.py")
    server_pod = lab2.pod("pod-1-2")
    assert lab2.tmpdir is not None
    stop = lab2.tmpdir / "stop-sctp-hold"
    hold = ["hold", "--addr", server_pod.ip, "--port", "5061", "--sport", "41999", "--stop-file", str(stop)]
    results = []
    for stall in ("0.8", "5"):  # line 3's echo: late (waits are 0.5 s), then after the hold ended
        server = lab2.popen(
            server_pod, sys.executable, peer, "server", "--port", "5061", "--seconds", "20",
            "--stall-on", "line 3", "--stall-s", stall, name=f"sctp-stall-{stall}",
        )  # fmt: skip
        lab2.wait_log(server, "ready", timeout=10)
        out = lab2.run(
            "pod-1-1", sys.executable, peer, *hold, "--timeout", "0.5", "--max-s", "2.5", timeout=30
        )
        results.append(json.loads(out.stdout))
        lab2.stop(server, timeout=5)
    late, lost = results
    assert late["established"] and late["exchanges"] > 10, late
    assert (late["lost"], late["late"]) == (0, [3]), late
    assert lost["established"] and lost["lost"] >= 1 and lost["first_lost"] == 3 and lost["late"] == [], lost


def test_the_http_loop_names_the_phase_each_error_came_in(lab2: Lab) -> None:
    """lab/client.py loop: a refused connection fails in `connect`; a server that accepts (the
    kernel completes the handshake from its backlog) and never answers, in `response`."""
    pod = lab2.pod("pod-1-2")
    listener = lab2.popen(
        pod, sys.executable, "-c",
        "import socket, time\ns = socket.socket()\ns.bind(('', 9999))\ns.listen(8)\n"
        "print('ready', flush=True)\ntime.sleep(30)",
        name="silent-listener",
    )  # fmt: skip
    lab2.wait_log(listener, "ready", timeout=10)
    assert lab2.tmpdir is not None
    client = str(REPO / "lab" / "client.py")
    results = {}
    for port in (9998, 9999):
        argv = ["loop", "--url", f"http://{pod.ip}:{port}/", "--stop-file", str(lab2.tmpdir / "stop-never")]
        out = lab2.run(
            "pod-1-1", sys.executable, client, *argv, "--timeout", "0.5", "--max-s", "1", "--interval", "0.2"
        )
        results[port] = json.loads(out.stdout)
    lab2.stop(listener, timeout=5)
    refused, silent = results[9998], results[9999]
    assert refused["errors"] > 0 and refused["ok"] == 0, refused
    assert {(e["phase"], "refused" in str(e["error"])) for e in refused["errors_seen"]} == {
        ("connect", True)
    }, refused
    assert silent["errors"] > 0 and silent["ok"] == 0, silent
    assert {(e["phase"], e["error"]) for e in silent["errors_seen"]} == {("response", "timed out")}, silent
    assert all(0.4 < float(e["lasted"]) < 1.5 for e in silent["errors_seen"]), silent


def test_lab_cleanup_removes_kept_tcp_be_liberal_files_of_namespaces_gone_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lab agent killed mid-takeover leaves its namespace's tcp_be_liberal in the agents' lock
    directory (and its `.<pid>.tmp` if killed writing it): the whole cleanup removes those named
    by an inode no namespace has (a later namespace given that inode would take the value), and
    leaves a live namespace's (its agent's) and anything else there."""
    from agent.lock import LOCK_DIR
    from agent.takeover.into_ebpf import liberal_path

    assert netns.AGENT_STATE_DIR == LOCK_DIR
    monkeypatch.setattr(netns, "AGENT_STATE_DIR", str(tmp_path))
    live = os.stat("/proc/self/ns/net").st_ino
    gone = 1  # no namespace has inode 1 (the root directory's)
    assert gone not in netns.live_netns_inodes() and live in netns.live_netns_inodes()
    stale = [Path(liberal_path(str(tmp_path), gone)), Path(f"{liberal_path(str(tmp_path), gone)}.77.tmp")]
    kept = [Path(liberal_path(str(tmp_path), live)), Path(f"{liberal_path(str(tmp_path), live)}.77.tmp")]
    other = tmp_path / "netns-1.lock"
    for path in [*stale, *kept, other]:
        path.write_text("0\n")
    assert netns.sweep_kept_liberal(dry_run=True) == [f"kept tcp_be_liberal {p}" for p in stale]
    assert all(p.exists() for p in stale)
    for nothing in ("list_netns", "lab_cgroups", "pin_dirs", "tmp_dirs", "sweep_staging"):  # the machine's
        monkeypatch.setattr(netns, nothing, lambda *args, **kwargs: [])
    assert cleanup_leftovers(None) == [f"kept tcp_be_liberal {p}" for p in stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in [*kept, other])
