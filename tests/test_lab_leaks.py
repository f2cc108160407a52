"""Leak checks for the lab; tests/conftest.py runs this module last.

1. A lab with every kind of server, an added pod, a forking process and a pinned BPF map is torn down
   and must leave no namespace, veth, process, cgroup, pin or tmp dir behind.
2. The leak finder itself reports a leftover namespace (so the checks can fail).
3. Every lab this session created and already tore down left nothing (the session-finish hook in
   conftest.py checks the same again after the last fixture is gone).
4. The machine's own sysctls that the agent's node set-up writes are as the run found them (the
   session-finish hook checks them again, for tests that ran beside or after this one).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from lab import CREATED_PREFIXES, STARTED, Lab, cleanup_leftovers, find_leaks, hostsysctls, live_labs, netns
from tests.conftest import HOST_SYSCTLS_FILE

pytestmark = pytest.mark.kernel


def test_teardown_leaves_nothing() -> None:
    veths_before = netns.host_veths()
    lab = Lab(nodes=2, pods_per_node=2)
    with lab:
        assert netns.host_veths() == veths_before  # nothing is created in the host namespace
        lab.start_podservers()
        lab.start_dns(lab.pods[0])
        lab.start_nginx(lab.pods[1])
        extra = lab.add_pod(2)
        lab.start_podserver(extra)
        # An untracked grandchild: only the namespace/cgroup sweep can find it.
        lab.popen(lab.nodes[0], "sh", "-c", "sleep 600 & sleep 600")
        deadline = time.monotonic() + 5
        while len(netns.netns_pids(lab.nodes[0].ns)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        node = lab.nodes[0]
        os.makedirs(node.pin_dir)
        pin_map = f"bpftool map create {node.pin_dir}/m type array key 4 value 4 entries 1 name ekp_leaktest"
        subprocess.run(pin_map.split(), check=True, capture_output=True)
        assert os.listdir(node.pin_dir) == ["m"]
        namespaces = lab.namespaces
        pids = [p for ns in namespaces for p in netns.netns_pids(ns)]
        assert len(pids) >= 9  # 5 podservers, dnsmasq, nginx master + worker, 2 sleeps
        tmpdir = lab.tmpdir
        cgroup = lab.cgroup_root
    assert not lab.is_up and lab not in live_labs()
    assert not set(namespaces) & set(netns.list_netns())
    assert netns.host_veths() == veths_before
    assert netns.host_lab_links() == []
    assert [p for p in pids if netns.alive(p)] == []
    assert [pid for pid, start in lab.started if netns.alive(pid, start)] == []
    assert not os.path.exists(node.pin_dir)
    assert netns.pin_dirs(lab.prefix) == []
    assert tmpdir is not None and not tmpdir.exists()
    assert cgroup is None or not os.path.exists(cgroup)
    assert find_leaks([lab.prefix], lab.started) == []


def test_leak_finder_reports_leftovers() -> None:
    prefix = netns.new_prefix()
    try:
        subprocess.run(["ip", "netns", "add", f"{prefix}-node1"], check=True)
        assert find_leaks([prefix]) == [f"network namespace {prefix}-node1"]
    finally:
        cleanup_leftovers(prefix)
    assert find_leaks([prefix]) == []


def test_labs_of_this_session_left_nothing() -> None:
    live = {lab.prefix for lab in live_labs()}
    done = CREATED_PREFIXES - live
    assert done, "no lab ran before this check"
    live_pids = {pid for lab in live_labs() for pid, _ in lab.started}
    assert find_leaks(done, [(pid, start) for pid, start in STARTED if pid not in live_pids]) == []


def test_the_machines_own_sysctls_are_as_the_run_found_them(session_dir: str) -> None:
    with open(os.path.join(session_dir, HOST_SYSCTLS_FILE)) as f:
        before = json.load(f)
    assert "net.ipv4.ip_forward" in before and "net.netfilter.nf_conntrack_max" in before
    machine = hostsysctls.Machine()
    try:
        assert hostsysctls.changed(before, machine.snapshot()) == []
    finally:
        machine.close()


def test_the_sysctl_check_reads_the_machines_values_from_a_thread_in_a_lab_namespace() -> None:
    """The snapshot names what differs, and reads the machine's values even when called from a
    thread that joined a lab node's namespace, where they differ."""
    prefix = netns.new_prefix()
    ns = f"{prefix}-node1"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True)
        home = hostsysctls.Machine()
        machine = home.snapshot()
        for key in ("net.ipv4.ip_forward", "net.netfilter.nf_conntrack_tcp_be_liberal"):
            assert key in machine, f"{key} (the eBPF proxier's, the hand-over's) is watched"
        flipped = "0" if machine["net.ipv4.ip_forward"] == "1" else "1"
        subprocess.run(
            ["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.ip_forward={flipped}"], check=True
        )
        try:
            from_lab = netns.in_netns(ns, home.snapshot)
        finally:
            home.close()
        assert from_lab == machine
        in_lab = netns.in_netns(ns, lambda: hostsysctls.read_values(["net.ipv4.ip_forward"]))
        assert hostsysctls.changed(machine, machine | in_lab) == [
            f"net.ipv4.ip_forward: {machine['net.ipv4.ip_forward']} -> {flipped}"
        ]
        # A key no module served yet (nf_conntrack, ipv6 loaded by a later lab) is not a change.
        unread = {"net.netfilter.nf_conntrack_max": "<unreadable: No such file or directory>"}
        assert hostsysctls.changed(unread, {"net.netfilter.nf_conntrack_max": "262144"}) == []
        assert hostsysctls.changed({"k": "1"}, {"k": "<unreadable: Permission denied>"}) != []
    finally:
        cleanup_leftovers(prefix)
