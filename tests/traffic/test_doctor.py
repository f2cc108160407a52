"""`agent doctor` on lab nodes: every line ok for a node whose eBPF agent runs against the (fake) API
server, and a FAIL line naming the fix for each thing a namespace lacks for eBPF mode (forwarding
off, kube-proxy's rules present, another tc program first on the uplink, a pin path off bpffs, an
API server that does not answer). The command runs as an operator runs it, with the agent's flags.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from lab import Lab
from lab.apicluster import ApiCluster
from lab.harness import REPO, ep, started
from lab.objects import Port, service, with_endpoints
from lab.tcxold import classid_program
from tests.conftest import require_kernel

pytestmark = pytest.mark.kernel


def doctor(*flags: str) -> tuple[int, list[str]]:
    res = subprocess.run(
        [sys.executable, "-m", "agent", "doctor", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
        check=False,
    )
    return res.returncode, res.stdout.splitlines()


def verdicts(lines: list[str]) -> dict[str, tuple[str, str]]:
    """check -> (verdict, the line and its fix) from the checklist's lines."""
    out: dict[str, tuple[str, str]] = {}
    last = ""
    for line in lines[1:-1]:
        verdict, rest = line[2:7].strip(), line[8:]
        if verdict:
            last = rest[:16].strip()
            if last not in out or verdict == "FAIL":
                out[last] = (verdict, rest)
        elif last:
            out[last] = (out[last][0], out[last][1] + "\n" + rest)
    return out


@pytest.fixture(scope="module")
def running() -> Iterator[ApiCluster]:
    require_kernel()
    with Lab(nodes=2, pods_per_node=2) as lab:
        lab.start_podservers()
        api = ApiCluster(lab, "ebpf")
        with started(api):
            yield api


def test_agent_doctor_in_a_lab_node_whose_agent_runs_is_all_green(running: ApiCluster) -> None:
    svc = service("web", "10.96.6.1", [Port("http", 80, 8080, node_port=30661)], type="NodePort")
    running.apply(with_endpoints(svc, [ep(running, "pod-1-1"), ep(running, "pod-2-1")]))
    agent = running.agents[0]
    rc, lines = doctor(*agent.source, *agent.flags())
    found = verdicts(lines)
    assert rc == 0, "\n".join(lines)
    assert {v for v, _ in found.values()} == {"ok"}, "\n".join(lines)
    assert set(found) >= {
        "privileges",
        "kernel",
        "BPF features",
        "BTF",
        "bcc and headers",
        "bpffs",
        "cgroup2",
        "forwarding",
        "kube-proxy",
        "tc/XDP hooks",
        "API server",
        "map sizes",
        "conntrack",
    }, "\n".join(lines)
    assert "1 Services, 1 service ports, 2 endpoints" in found["map sizes"][1]
    assert lines[-1] == "verdict: ready for ebpf mode"


def foreign_tcx_link(ns: str, dev_index: int) -> int:
    """Another's program on a device's tcx ingress hook (as another CNI's would sit); the link's fd:
    the link lasts while it is open."""
    from agent.ebpf import bpfsys, tcx
    from agent.netns import run_in_netns

    prog = bpfsys.prog_load(tcx.BPF_PROG_TYPE_SCHED_CLS, classid_program(0), "GPL", "foreign_tc")
    assert prog >= 0, prog
    link = run_in_netns(ns, lambda: bpfsys.tcx_link_create(prog, dev_index, tcx.BPF_TCX_INGRESS))
    os.close(prog)
    assert link >= 0, link
    return link


@pytest.mark.parametrize("attach", ["clsact", "auto"])
def test_agent_doctor_names_the_fix_for_each_thing_a_namespace_lacks(tmp_path: object, attach: str) -> None:
    """clsact: another's filter at a lower priority runs before ours; auto (tcx on this kernel):
    every filter runs after our tcx program, and another's tcx program before it."""
    require_kernel()
    link = -1
    with Lab(nodes=1, pods_per_node=1) as lab:
        node = lab.node(1)
        lab.set_sysctl(node, "net.ipv4.ip_forward", "0")
        lab.run(node, "iptables", "-t", "nat", "-N", "KUBE-SERVICES")
        lab.run(node, "iptables", "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES")
        lab.run(node, "tc", "qdisc", "add", "dev", "eth0", "clsact")
        lab.run(
            node, "tc", "filter", "add", "dev", "eth0", "ingress", "prio", "1", "protocol", "ip",
            "u32", "match", "ip", "dst", "1.2.3.4/32", "flowid", "1:1",
        )  # fmt: skip
        assert lab.tmpdir is not None
        off_bpffs = lab.tmpdir / "pins"
        flags = (
            "--mode=ebpf",
            f"--netns={node.ns}",
            "--hostname-override=node1",
            "--devices=eth0",
            "--pod-interfaces=lxc-p*",
            f"--bpf-pin-path={off_bpffs}",
            "--master=http://127.0.0.1:1",
            f"--bpf-tc-attach={attach}",
        )
        if attach != "clsact":
            _, lines = doctor(*flags)
            verdict, line = verdicts(lines)["tc/XDP hooks"]
            assert verdict == "warn" and "after ours: eth0 tc ingress: u32 pref 1" in line, "\n".join(lines)
            index = int(lab.run(node, "cat", "/sys/class/net/eth0/ifindex").stdout)
            link = foreign_tcx_link(node.ns, index)
        try:
            rc, lines = doctor(*flags)
        finally:
            if link >= 0:
                os.close(link)
    found = verdicts(lines)
    text = "\n".join(lines)
    assert rc == 1, text
    expected = {
        "forwarding": "sysctl -w net.ipv4.ip_forward=1",
        "kube-proxy": "agent --cleanup-kube-proxy",
        "tc/XDP hooks": "tc filter del dev DEVICE ingress pref N",
        "bpffs": "mount -t bpf bpf DIR",
        "API server": "check the address",
    }
    for check, fix in expected.items():
        verdict, line = found[check]
        assert verdict == "FAIL", f"{check}:\n{text}"
        assert "-> " in line and fix in line, f"{check}:\n{text}"
    assert "KUBE-SERVICES" in found["kube-proxy"][1]
    assert found["tc/XDP hooks"][1].count("eth0 tc ingress: u32 pref 1") == 1, text
    if attach != "clsact":
        assert re.search(r"eth0 tc ingress: tcx foreign_tc id \d+ link \d+", found["tc/XDP hooks"][1]), text
        assert "bpftool link detach id N" in found["tc/XDP hooks"][1], text
    assert {c for c, (v, _) in found.items() if v == "FAIL"} == set(expected), text
    assert lines[-1].startswith("verdict: 5 FAIL")
