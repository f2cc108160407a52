"""The control plane at scale, through an API server: `python -m bench --parts api`.

One fresh one-node lab per mode and a fake kube-apiserver (tests/fakeapi) holding N Services with
one EndpointSlice of E endpoints each (default 10,000 x 10: 100,000 endpoints, the objects
realistic: managedFields, labels, selectors). A real `agent --kubeconfig` acts for the node.
Measured:

* **full sync**: from the agent's first list request to its first `sync done` (everything listed,
  decoded, modelled, planned and written to the kernel); and from the process start (imports,
  credentials, the data path compiled or reused, the lists, the sync);
* **one change**: C EndpointSlice changes made one at a time on the server while the N services
  are in place, each adding or removing an 11th endpoint so the frontend's count changes. In eBPF
  mode the bench polls that frontend's entry in the pinned map (one bpf() lookup every few
  microseconds) until the new count is there: the time from the server's write to the data path
  holding the change. In iptables mode (and in eBPF mode too, for comparison) it reads the agent's
  own `sync done` log line that includes the change's resourceVersion (millisecond timestamps);
* **peak RSS** of the agent (VmHWM), and the second start: an agent restarted over its own pins
  (programs reused, nothing compiled) until its first sync.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.ebpf import abi
from bench.report import Table, num
from bench.traffic import percentile
from tests.fakeapi import FakeApiServer
from tests.fakeapi.objects import node as node_object
from tests.fakeapi.objects import scale_objects
from tests.lab import Lab
from tests.traffic.harness import Agent

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.M)


@dataclass
class ApiScale:
    mode: str
    services: int
    endpoints: int
    load_s: float = 0.0  # putting the objects into the fake server (not the agent's)
    start_to_sync_s: float = 0.0
    list_to_sync_s: float = 0.0
    datapath: str = ""  # the loader's line: compiled in X s / reused
    restart_to_sync_s: float = 0.0
    rss_mib: float = 0.0
    change_ms: list[float] = field(default_factory=list)  # server write -> data path (map poll)
    change_log_ms: list[float] = field(default_factory=list)  # server write -> agent's sync done line


def _stamp(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _first(log: str, needle: str) -> str | None:
    for line in log.splitlines():
        if needle in line and LOG_TIME.match(line):
            return line
    return None


def _wait_log(agent: Agent, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = _first(agent.log_since_start(), needle)
        if line is not None:
            return line
        if agent.proc is not None and agent.proc.poll() is not None:
            raise RuntimeError(f"agent exited {agent.proc.returncode}:\n{agent.log()[-3000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"no {needle!r} in the agent's log after {timeout}s:\n{agent.log()[-3000:]}")


def _vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _slice_of(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == "EndpointSlice" and o["metadata"]["name"].startswith(name))


def measure(mode: str, services: int, endpoints: int, changes: int, timeout_s: float = 900.0) -> ApiScale:
    out = ApiScale(mode, services, endpoints)
    with Lab(nodes=1, pods_per_node=1) as lab, FakeApiServer(bookmark_interval_s=60.0) as server:
        assert lab.tmpdir is not None
        node = lab.nodes[0]
        started = time.monotonic()
        objects = scale_objects(services, endpoints)
        for obj in objects:
            server.create(obj)
        server.apply(node_object(node.name, node.ip))
        out.load_s = time.monotonic() - started
        kubeconfig = server.write_kubeconfig(lab.tmpdir / "kubeconfig")
        extra = ["--iptables-sync-period=1h", "--iptables-backend=legacy"] if mode == "iptables" else []
        agent = Agent(lab, node, mode, [f"--kubeconfig={kubeconfig}"], ["--iptables-sync-period=1h", *extra])
        try:
            began = time.time()
            agent.start()
            done = _wait_log(agent, "sync done:", timeout_s)
            log = agent.log_since_start()
            watching = _first(log, "watching ")
            loader = _first(log, "data path ")
            assert watching is not None and agent.proc is not None
            out.start_to_sync_s = _stamp(done) - began
            out.list_to_sync_s = _stamp(done) - _stamp(watching)
            out.datapath = loader.split("data path ", 1)[1].split(",")[0] if loader else "n/a"
            _changes(out, agent, server, objects, changes, node.name)
            out.rss_mib = _vm_hwm_mib(agent.proc.pid)
            agent.stop()
            began = time.time()
            agent.start()
            out.restart_to_sync_s = _stamp(_wait_log(agent, "sync done:", timeout_s)) - began
        finally:
            agent.stop()
            agent.cleanup()
    return out


def _changes(
    out: ApiScale, agent: Agent, server: FakeApiServer, objects: list[dict[str, Any]], n: int, node: str
) -> None:
    fe_map = None
    if out.mode == "ebpf":
        from agent.ebpf.maps import BpfMap

        fe_map = BpfMap.open_pinned(abi.MAPS["fe"], agent.pin_path)
    slices = [o for o in objects if o["kind"] == "EndpointSlice"]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    step = max(1, len(slices) // n)
    try:
        for i in range(n):
            sl = copy.deepcopy(slices[(i * step) % len(slices)])
            svc = services[sl["metadata"]["labels"]["kubernetes.io/service-name"]]
            eps = sl["endpoints"]
            extra = {**eps[0], "addresses": [f"10.250.{i >> 8 & 255}.{i & 255}"]}
            sl["endpoints"] = [*eps, extra]  # one more endpoint: the frontend's count changes
            want = len(sl["endpoints"])
            key = abi.FrontendKey(
                addr=abi.ip_be(svc["spec"]["clusterIP"]),
                port=abi.port_be(80),
                proto=6,
                scope=int(abi.Scope.INTERNAL),
            )
            written_at = time.time()
            t0 = time.perf_counter()
            stored = server.update(sl)
            if fe_map is not None:
                deadline = t0 + 10
                while True:
                    value = fe_map.lookup(key)
                    if isinstance(value, abi.Frontend) and value.count == want:
                        out.change_ms.append((time.perf_counter() - t0) * 1000)
                        break
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"change {i} not in the map after 10 s:\n{agent.log()[-3000:]}")
            rv = int(stored["metadata"]["resourceVersion"])
            agent.wait_resource_versions({"EndpointSlice": rv}, timeout=30)
            line = [ln for ln in agent.log_since_start().splitlines() if "sync done:" in ln][-1]
            out.change_log_ms.append(max(0.0, (_stamp(line) - written_at) * 1000))
            server.update({**stored, "endpoints": eps})  # back to E endpoints
            agent.wait_resource_versions({"EndpointSlice": rv + 1}, timeout=30)
    finally:
        if fe_map is not None:
            fe_map.close()


def _pct(xs: list[float]) -> str:
    if not xs:
        return "-"
    s = sorted(xs)
    return f"{num(percentile(s, 0.5), 1)} / {num(percentile(s, 0.99), 1)} / {num(s[-1], 1)} ms"


def table(results: list[ApiScale]) -> Table:
    rows = [
        [
            r.mode,
            num(r.services),
            num(r.services * r.endpoints),
            f"{r.list_to_sync_s:.2f} s",
            f"{r.start_to_sync_s:.2f} s",
            r.datapath,
            f"{r.restart_to_sync_s:.2f} s",
            _pct(r.change_ms) if r.mode == "ebpf" else "-",
            _pct(r.change_log_ms),
            f"{r.rss_mib:.0f} MiB",
        ]
        for r in results
    ]
    return Table(
        "Control plane through the API server",
        [
            "mode",
            "services",
            "endpoints",
            "list -> synced",
            "start -> synced",
            "data path",
            "restart -> synced",
            "one change p50 / p99 / max (map)",
            "(agent's log line)",
            "peak RSS",
        ],
        rows,
        [False, True, True, True, True, False, True, True, True, True],
        notes=[
            "list -> synced: the agent's first list request to its first `sync done` (logged)",
            "start -> synced: the process start to the same line; restart: the agent stopped and "
            "started again over its own pins",
            "one change: an EndpointSlice gains an endpoint on the server; map: until the frontend's "
            "count in the pinned map changes (eBPF); log: until the agent's `sync done` line that "
            "includes it (ms timestamps)",
        ],
    )
