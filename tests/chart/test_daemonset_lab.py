"""The DaemonSet the chart renders, run for a lab node as the kubelet would run its pod.

The chart is rendered with the values an operator replacing kube-proxy would give
(`apiServer.host/port`), and the pod's containers are started from the rendered spec alone
(tests/chart/kubelet.py): init containers first (prepare-node), each to
completion, then the agent, with the rendered command, args and env, its capabilities, its mounts
and the service-account token. The agent finds the API server through KUBERNETES_SERVICE_HOST
and the pod's token and CA, exactly the in-cluster path.

What differs from a real node, and why:
* the API server is the fake one (lab/fakeapi, TLS, bearer token), listening on 127.0.0.1 inside
  the node's network namespace, so `apiServer.host=127.0.0.1` and its port are the values given;
  nothing is attached to the machine's own interfaces;
* hostPath sources are substituted as a kubelet on another machine would see them: /sys/fs/bpf
  is a per-test bpffs (so pins never touch the machine's), /run/ebpf-kube-proxy a per-test
  directory made 0755 as the kubelet makes it, /run/xtables.lock the lab node's own lock file
  (`Lab.xtables_lock`, the one `lab.run` on that node takes); /lib/modules and /usr/src are the
  machine's own;
* the image's filesystem is the machine's, with the repository's virtualenv first on PATH; the
  byte code its pip install compiled is a PYTHONPYCACHEPREFIX the module writes once before the
  first pod (`compile_image_bytecode`), which the pods read and, with the image's
  PYTHONDONTWRITEBYTECODE, never write (the image's root is read-only): without it every pod
  start, init container and cleanup compiled the agent and its libraries from source, which no
  real pod does;
* the node's compile cache (/run/ebpf-kube-proxy/bpf-objects) starts, when the machine's cache
  holds it, with the data path build the machine's lab agents load (lab/precompile.py's, the same
  build as the pod's), as a node holds what an earlier agent compiled there: the first pod loads it
  instead of compiling it a second time in the run (a compile is about 19 CPU s here; the first
  pod's start and sync went from 17.1 s to 2.1 s), else it compiles, as on a fresh node; the
  rolling update's new image compiles its own, in the pod.
No flag, value or environment variable differs from what the pod gets but PYTHONPYCACHEPREFIX
(where the image's byte code stands); there is no `--netns`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.ebpf.abi import MAPS
from agent.ebpf.loader import Datapath
from agent.ebpf.maps import map_info, obj_get
from agent.ebpf.objcache import ObjectCache
from agent.lock import pin_lock_name
from lab import Lab, in_netns
from lab.core import Node
from lab.dplab import SIZES
from lab.fakeapi import FakeApiServer
from lab.fakeapi.objects import endpoint_slice, node, service
from lab.harness import CLIENT
from tests.chart import kubelet
from tests.chart.render import NAMESPACE, REPO, Rendered, render

pytestmark = pytest.mark.kernel

TOKEN = "chart-lab-token"
VIP = "10.96.0.10"
VIP2 = "10.96.0.11"
HEALTHZ_PORT = 10256
METRICS_PORT = 10249
IMAGE_ENV = {
    "PATH": f"{REPO / '.venv' / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "EKP_BPF_DIR": str(REPO / "bpf"),
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class PodRun:
    """One lab node running the rendered pod."""

    lab: Lab
    node: Node
    api: FakeApiServer
    rendered: Rendered
    bpffs: Path
    lock_dir: Path
    workdir: Path
    agent: subprocess.Popen[bytes] | None = None
    seeded: bool = False  # the node's compile cache held the pod's build before the first pod
    starts: int = 0
    image_env: dict[str, str] = field(default_factory=lambda: dict(IMAGE_ENV))

    def launch(self, name: str, extra_args: tuple[str, ...] = ()) -> kubelet.Launch:
        container = self.rendered.container(name)
        container["args"] = [*container.get("args", []), *extra_args]
        return kubelet.launch(
            self.rendered.pod,
            container,
            pod=kubelet.PodFacts(node_name=self.node.name, host_ip=self.node.ip, namespace=NAMESPACE),
            netns=self.node.ns,
            workdir=self.workdir / f"{name}-{self.starts}",
            hostpaths={
                "/sys/fs/bpf": str(self.bpffs),
                "/run/ebpf-kube-proxy": str(self.lock_dir),
                # the node's own lock, as a node's /run holds: not the machine's, which the
                # bench's long iptables-legacy restores hold for seconds
                "/run/xtables.lock": self.lab.xtables_lock(self.node),
                # cgroupRoot: the lab node's cgroup stands for the node's whole hierarchy (the
                # machine's own root would serve every socket of the machine)
                "/sys/fs/cgroup": str(self.node.cgroup_root),
            },
            config_maps={self.rendered.config_map["metadata"]["name"]: self.rendered.config_map["data"]},
            service_account={
                "token": TOKEN.encode(),
                "ca.crt": self.api.ca_path.read_bytes(),
                "namespace": NAMESPACE.encode(),
            },
            image_env=self.image_env,
            image_dirs=(str(REPO), self.image_env["EKP_BPF_DIR"], self.image_env["PYTHONPYCACHEPREFIX"]),
        )

    def run_init_containers(self) -> dict[str, str]:
        """Each init container to completion, in order, as the kubelet does; their output."""
        out = {}
        for name in self.rendered.init_names():
            res = subprocess.run(
                self.launch(name).argv, capture_output=True, text=True, timeout=120, check=False
            )
            assert res.returncode == 0, (
                f"init container {name} exited {res.returncode}:\n{res.stdout}{res.stderr}"
            )
            out[name] = res.stdout + res.stderr
        return out

    def start(self) -> None:
        self.starts += 1
        self.run_init_containers()
        self.agent = self.lab.popen(None, *self.launch("agent").argv, name="agent", cgroup=self.node.cgroup)

    def log(self) -> str:
        """This run's whole log: the tests look for lines of its start, already 3.6 kB from the end
        at the first sync (the compile, attach and cleanup lines), so a line or two more (a warning
        under load) pushed them out of the lab's usual 4,000-character tail."""
        assert self.agent is not None
        return self.lab.log_of(self.agent, limit=None)

    def wait_synced(self, timeout: float = 90.0) -> None:
        """Until this run of the agent logged a completed sync."""
        assert self.agent is not None
        deadline = time.monotonic() + timeout
        while "sync done" not in self.log():
            assert self.agent.poll() is None, f"agent exited {self.agent.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"no sync in {timeout}s:\n{self.log()}"
            time.sleep(0.1)

    def get(self, port: int, path: str) -> tuple[int, bytes]:
        return self.lab.http_fetch(
            self.node, self.node.ip if port == HEALTHZ_PORT else "127.0.0.1", port, path
        )


def pinned_map_ids(pod: PodRun) -> dict[str, int]:
    """The kernel's id of every map pinned for the node (a map made anew gets a new id)."""
    out = {}
    for spec in MAPS.values():
        fd = obj_get(str(pod.bpffs / "ebpf-kube-proxy" / spec.name))
        try:
            out[spec.name] = map_info(fd).id
        finally:
            os.close(fd)
    return out


def wait_for(what: str, check: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")


def compile_image_bytecode(image_env: dict[str, str], prefix: Path) -> None:
    """What the image's pip install compiled, written under `prefix` for the pods to read: the
    byte code of every agent module and of all they import (the kubernetes client, aiohttp,
    pyroute2, bcc, the standard library: with a prefix set, Python looks for byte code nowhere
    else), by one process of the pod's interpreter that imports them. `agent.__main__` is left
    out: importing it runs the agent. bcc (the loader and the compile child import it when they
    run) and the two codecs the pods' C locale uses are what the pods imported beyond the agent's
    modules, seen with pods let write into a prefix of their own: nothing else."""
    script = (
        "import importlib, pkgutil, agent, bcc, encodings.ascii, encodings.utf_8_sig\n"
        "for m in pkgutil.walk_packages(agent.__path__, 'agent.'):\n"
        "    if m.name != 'agent.__main__':\n"
        "        importlib.import_module(m.name)\n"
    )
    env = {k: v for k, v in image_env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(prefix)
    python = REPO / ".venv" / "bin" / "python"
    res = subprocess.run(
        [str(python), "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, f"compiling the image's byte code failed:\n{res.stdout}{res.stderr}"


def seed_compile_cache(path: Path) -> bool:
    """The machine's compiled data path (lab/precompile.py's build, which the pod's settings load
    too) put in the node's cache directory `path`: waited for while the precompile holds its
    lock; left out when the machine's cache has none (the pod then compiles, as on a fresh node).
    Whether it is there now."""
    datapath = Datapath("/sys/fs/bpf/unused", SIZES)  # nothing is loaded or pinned: the build alone
    build = datapath.build()
    with datapath.cache.compiling(build):
        obj = datapath.cache.get(build)
    if obj is None:
        return False
    node_cache = ObjectCache(str(path))
    node_cache.put(obj)
    return node_cache.get(build) is not None


@pytest.fixture(scope="module")
def pod(kernel_required: None) -> Iterator[PodRun]:
    bpffs = Path(tempfile.mkdtemp(prefix="ekp-chart-bpffs-"))
    subprocess.run(["mount", "-t", "bpf", "bpf", str(bpffs)], check=True)
    try:
        with Lab(nodes=1, pods_per_node=2) as lab:
            lab.start_podservers()
            n = lab.nodes[0]
            # What a kube-proxy that ran here would have left: the init container must remove it.
            lab.run(n, "iptables-legacy", "-t", "nat", "-N", "KUBE-SERVICES")
            lab.run(n, "iptables-legacy", "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES")
            api = FakeApiServer(tls=True, tokens=(TOKEN,), bookmark_interval_s=5.0)
            in_netns(n.ns, api.start)  # listens on 127.0.0.1 of the node's namespace
            try:
                api.create(node(n.name, n.ip))
                api.create(service("web", VIP))
                api.create(endpoint_slice("web", [lab.pod("pod-1-2").ip], node=n.name))
                assert lab.tmpdir is not None
                values = {"apiServer": {"host": "127.0.0.1", "port": api.port}}
                host_run = lab.tmpdir / "host-run-ebpf-kube-proxy"
                kubelet.make_hostpath(str(host_run), "DirectoryOrCreate")
                seeded = seed_compile_cache(host_run / "bpf-objects")
                run = PodRun(lab, n, api, render(values), bpffs, host_run, lab.tmpdir / "pod", seeded=seeded)
                # The run's own prefix when it has one (scripts/test.sh's build/pycache: what the
                # suite's processes already compiled is read, not compiled again), else the lab's.
                prefix = Path(os.path.abspath(sys.pycache_prefix or lab.tmpdir / "image-pycache"))
                compile_image_bytecode(run.image_env, prefix)
                run.image_env["PYTHONPYCACHEPREFIX"] = str(prefix)
                yield run
                if run.agent is not None and run.agent.poll() is None:
                    assert lab.stop(run.agent, timeout=30) == 0, run.log()
            finally:
                api.stop()
    finally:
        subprocess.run(["umount", str(bpffs)], check=False)
        os.rmdir(bpffs)


def test_the_rendered_pod_starts_answers_its_probes_and_serves(pod: PodRun) -> None:
    started = time.monotonic()
    planted = pod.lab.run(pod.node, "iptables-legacy-save", "-t", "nat").stdout
    assert ":KUBE-SERVICES" in planted, "the fixture's kube-proxy leftovers are there to remove"
    init = pod.run_init_containers()
    assert list(init) == ["prepare-node"]
    pod.starts += 1
    pod.agent = pod.lab.popen(None, *pod.launch("agent").argv, name="agent", cgroup=pod.node.cgroup)
    pod.wait_synced()
    ruleset = pod.lab.run(pod.node, "iptables-legacy-save", "-t", "nat").stdout
    assert "KUBE-SERVICES" not in ruleset, "the agent removed kube-proxy's leftovers once it served"
    log = pod.log()
    assert "API server https://127.0.0.1:" in log and "(bearer token)" in log, log
    assert f"node={pod.node.name}" in log, "--hostname-override came from spec.nodeName"
    # The node's cache, through the kubelet's hostPath: what the fixture kept there is loaded.
    kept = "data path loaded from the compile cache" if pod.seeded else "data path compiled in"
    assert kept in log, log
    print(f"\nrendered pod: init containers + first sync in {time.monotonic() - started:.1f}s")

    agent = pod.rendered.container("agent")
    for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/healthz")):
        assert agent[probe]["httpGet"]["path"] == path
        status, body = pod.get(HEALTHZ_PORT, path)
        assert status == 200, (path, status, body)
        assert json.loads(body)["healthy"] is True

    assert pod.lab.http_get("pod-1-1", VIP, 80).strip() == "pod-1-2"
    # The node's own processes too: the socket programs, attached through the cgroupRoot mount with
    # the container's capabilities alone (a host-network client, in the node's cgroup).
    peer = pod.lab.run(pod.node, sys.executable, CLIENT, "peer", "--addr", VIP, "--port", "80").stdout
    assert json.loads(peer) == {"peer": f"{VIP}:80", "body": "pod-1-2"}
    # A Service created after the agent started reaches the data path through the watch.
    pod.api.create(service("api", VIP2, ports=(("http", 8080, 8080),)))
    pod.api.create(endpoint_slice("api", [pod.lab.pod("pod-1-2").ip], node=pod.node.name))
    wait_for("the new Service answers", lambda: pod.lab.http_get("pod-1-1", VIP2, 8080).strip() == "pod-1-2")

    status, text = pod.get(METRICS_PORT, "/metrics")
    assert status == 200
    assert b"kubeproxy_sync_proxy_rules_duration_seconds_bucket" in text
    assert b'ekp_bpf_map_up{map="ekp_fe_v2"} 1' in text
    pins = os.listdir(pod.bpffs / "ebpf-kube-proxy")
    assert "ekp_fe_v2" in pins, pins
    locks = os.listdir(pod.lock_dir)
    assert pin_lock_name("/sys/fs/bpf/ebpf-kube-proxy") in locks, (
        "the node lock lives in the host directory the pods share",
        locks,
    )
    assert any(name.startswith("netns-") and name.endswith(".lock") for name in locks), locks


def test_rolling_update_keeps_clusterip_traffic_flowing(pod: PodRun, request: pytest.FixtureRequest) -> None:
    """SIGTERM the pod's agent, start a new pod from the same spec (init containers included),
    while a client in a lab pod opens a new connection to the ClusterIP per request.

    The new pod is a new image: its C source differs (a comment), so it compiles new programs
    against the maps the old pod pinned, with the chart's capabilities, as an upgrade does."""
    assert pod.agent is not None and pod.agent.poll() is None, "runs after the test above"
    assert pod.lab.tmpdir is not None
    # Not under /tmp: the pod's /tmp is its own emptyDir.
    image = Path(tempfile.mkdtemp(prefix="ekp-image-2-", dir="/var/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(image, ignore_errors=True))
    request.addfinalizer(lambda: pod.image_env.update(EKP_BPF_DIR=IMAGE_ENV["EKP_BPF_DIR"]))
    maps_before = pinned_map_ids(pod)
    new_bpf = image / "bpf"
    shutil.copytree(REPO / "bpf", new_bpf)
    with open(new_bpf / "ekp_tc.c", "a") as f:
        f.write("/* image 2 */\n")
    stop_file = pod.lab.tmpdir / "loop.stop"
    ready_file = pod.lab.tmpdir / "loop.ready"
    out_path = pod.lab.tmpdir / "loop.json"
    with open(out_path, "wb") as out:
        client = pod.lab.popen(
            "pod-1-1",
            sys.executable,
            CLIENT,
            "loop",
            "--url",
            f"http://{VIP}/",
            "--stop-file",
            str(stop_file),
            "--ready-file",
            str(ready_file),
            "--max-s",
            "120",
            "--timeout",
            "2",
            "--interval",
            "0.01",
            name="loop",
            stdout=out,
        )
    wait_for("the client loop answering", ready_file.exists)
    time.sleep(1.0)
    old = pod.agent
    stopped = time.monotonic()
    assert pod.lab.stop(old, timeout=30) == 0, "SIGTERM ends the agent cleanly"
    down_s = time.monotonic() - stopped
    time.sleep(2.0)  # the node without an agent for a moment, as between two pods
    pod.image_env["EKP_BPF_DIR"] = str(new_bpf)
    pod.start()
    pod.wait_synced()
    time.sleep(2.0)
    stop_file.touch()
    assert client.wait(timeout=30) == 0
    result = json.loads(out_path.read_text())
    print(
        f"\nrolling update: {result['ok'] + result['errors']} requests in {result['seconds']}s, "
        f"{result['errors']} failed (agent stopped in {down_s:.2f}s, new pod synced)"
    )
    assert result["ok"] > 100, result
    assert result["errors"] == 0, result
    assert set(result["bodies"]) == {"pod-1-2"}, result
    new_log = pod.log()
    assert "already running" not in new_log
    assert "data path compiled in" in new_log, "the new image compiled its own programs"
    assert pinned_map_ids(pod) == maps_before, "...against the maps the old pod pinned, not new ones"


def test_the_rendered_command_with_cleanup_removes_everything(pod: PodRun) -> None:
    """`agent --cleanup` with the pod's own flags (the roll-back step) leaves no pin behind."""
    if pod.agent is not None and pod.agent.poll() is None:
        assert pod.lab.stop(pod.agent, timeout=30) == 0
    # The positive control of the refusal below: with the agent gone, its programs still serve.
    assert pod.lab.http_get("pod-1-1", VIP, 80).strip() == "pod-1-2"
    res = subprocess.run(
        pod.launch("agent", ("--cleanup",)).argv, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (pod.bpffs / "ebpf-kube-proxy").exists()
    with pytest.raises(OSError):
        pod.lab.http_fetch("pod-1-1", VIP, 80, timeout=1.0)
