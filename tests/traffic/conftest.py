"""The traffic suites' labs, each made once per mode and shared by every module that uses it.

* `cluster`: a two-node lab with one agent per node following a services file. Nodes carry the
  distribution's rp_filter defaults, and in eBPF mode also Docker's `FORWARD --ctstate INVALID -j
  DROP` rule (kube-proxy writes the same one into KUBE-FORWARD): the eBPF data path must cope with
  it. Not in iptables mode, where the agent's own INVALID drop is what upstream's "should drop
  INVALID conntrack entries" checks, and a rule of the lab's would hide its absence.
* `api`: a two-node lab (three pods per node) whose agents follow a fake API server
  (lab/apicluster.py): tests/traffic/test_api.py and test_ignored_objects.py.

Both are session-scoped and parametrised by mode, so pytest runs every traffic test against `ebpf`
and then `iptables` on a fresh lab each. Tests sharing them undo what they change in the lab
(routes, pods, servers) and use Service names, IPs and ports no other module uses.
In eBPF mode every test is followed by a check that netfilter holds no service rule (the lab's
INVALID rule its positive control).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lab import Lab
from lab.apicluster import ApiCluster
from lab.harness import Cluster, started
from tests.conftest import require_kernel

MODES = ["ebpf", "iptables"]
PODS_PER_NODE = 6
BLOB_BYTES = 50_000_000


@pytest.fixture(scope="session")
def blob(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    import hashlib
    import os

    path = tmp_path_factory.mktemp("blob") / "blob.bin"
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(BLOB_BYTES // (1 << 20) + 1):
            chunk = os.urandom(min(1 << 20, BLOB_BYTES - f.tell()))
            digest.update(chunk)
            f.write(chunk)
    return str(path), digest.hexdigest()


@pytest.fixture(scope="session")
def blob_path(blob: tuple[str, str]) -> str:
    return blob[0]


@pytest.fixture(scope="session")
def blob_sha256(blob: tuple[str, str]) -> str:
    return blob[1]


@pytest.fixture(scope="session", params=MODES)
def cluster(request: pytest.FixtureRequest, blob: tuple[str, str]) -> Iterator[Cluster]:
    require_kernel()
    mode: str = request.param
    with Lab(nodes=2, pods_per_node=PODS_PER_NODE) as lab:
        lab.start_podservers(blob=blob[0])
        lab.start_dns(lab.pod("pod-2-2"))
        for node in lab.nodes if mode == "ebpf" else ():
            lab.run(
                node, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"
            )
        c = Cluster(lab, mode)
        c.start()
        try:
            yield c
        finally:
            failures = c.stop()
            leftover = [p for a in c.agents if Path(a.pin_path).exists() for p in [a.pin_path]]
        assert not failures, f"agent --cleanup failed: {failures}"
        assert not leftover, f"pins left after cleanup: {leftover}"


@pytest.fixture(scope="session", params=MODES)
def api(request: pytest.FixtureRequest) -> Iterator[ApiCluster]:
    require_kernel()
    with Lab(nodes=2, pods_per_node=3) as lab:
        lab.start_podservers()
        cluster = ApiCluster(lab, request.param)
        with started(cluster):
            yield cluster


@pytest.fixture(autouse=True)
def _no_service_rules_in_ebpf_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    """eBPF mode translates with programs and maps alone: netfilter must show no service rule."""
    yield
    if "cluster" not in request.fixturenames:
        return
    cluster: Cluster = request.getfixturevalue("cluster")
    if cluster.mode != "ebpf":
        return
    for node in cluster.lab.nodes:
        rules = cluster.ruleset(node)
        # The positive control: the reader sees the rule the fixture itself put there.
        assert "--ctstate INVALID -j DROP" in rules, f"{node.name}: netfilter not read:\n{rules}"
        assert "KUBE-" not in rules and "10.96." not in rules, f"{node.name} has service rules:\n{rules}"
