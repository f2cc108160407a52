"""The control plane at scale, through an API server: `python -m bench --parts api`.

One fresh one-node lab per mode and a fake kube-apiserver (lab/fakeapi) holding N Services with
one EndpointSlice of E endpoints each (default 10,000 x 10: 100,000 endpoints, the objects
realistic: managedFields, labels, selectors), served over HTTPS as a real one is (a CA of its own
in the kubeconfig). A real `agent --kubeconfig` acts for the node. Measured:

* **full sync**: from the agent's first list request to its first `sync done` (everything listed,
  decoded, modelled, planned and written to the kernel); and from the process start (imports,
  credentials, the data path compiled or reused, the lists, the sync);
* **one change**: C EndpointSlice changes made one at a time on the server while the N services
  are in place, each adding or removing an 11th endpoint so the frontend's count changes. In eBPF
  mode the bench polls that frontend's entry in the pinned map (one bpf() lookup every `POLL_S`)
  until the new count is there: the time from the server's write to the data path holding the
  change, late by at most one poll interval (`POLL_S` and the sleep's overshoot). In iptables mode
  (and in eBPF mode too, for comparison) it reads the agent's own `sync done` log line that
  includes the change's resourceVersion (millisecond timestamps);
* **peak RSS** of the agent (VmHWM), and the second start: an agent stopped (SIGTERM, given the
  chart's grace period before a kill; how long it took is reported) and restarted over its own pins
  (programs reused, nothing compiled) until its first sync.

The agent's sources are byte-compiled first (`compile_agent`), as the image's `pip install` does:
the agent runs from this tree, where without it every start compiled each of its modules from source
when nothing had written their bytecode (a fresh clone, or `PYTHONDONTWRITEBYTECODE=1` in the
environment, as in the image and the sessions that ran the bench): about 0.25 CPU s a start that no
installed agent pays (bench/results/scale/restart21-bytecode-2026-11-27.txt).
"""

from __future__ import annotations

import compileall
import copy
import multiprocessing
import re
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.ebpf import abi
from bench.report import Table, num
from bench.traffic import percentile
from lab import Lab
from lab.fakeapi import FakeApiServer
from lab.fakeapi.objects import node as node_object
from lab.fakeapi.objects import scale_objects
from lab.harness import Agent

AGENT_DIR = Path(__file__).resolve().parents[1] / "agent"
# What the restart's stop may take before it is killed: the chart's terminationGracePeriodSeconds,
# what a node gives the agent. A stop killed leaves no planner or records for the restart, which
# then reads every map back: the lab's default of 10 s killed a loaded 50,000-Service agent
# mid-write (a stop there costs about 6 CPU s: bench.changecost --stop-dir), so the restart
# measured was not the clean one it is reported as.
STOP_GRACE_S = 30.0
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
    iptables_backend: str = ""  # the iptables-mode agent's --iptables-backend ("" in eBPF mode)
    flags: str = ""  # map sizes passed to the agent (bench.api.map_size_flags)
    listed_s: float = 0.0  # first list request -> both lists complete (the agent's log)
    waited_s: float = 0.0  # both lists complete -> the data path ready, when it came later (compile)
    restart_list_to_sync_s: float = 0.0  # restarted agent: first list request -> first `sync done`
    stop_s: float = 0.0  # the clean stop before the restart: SIGTERM -> the process gone
    stop_killed: bool = False  # that stop outlasted STOP_GRACE_S and was killed (no planner kept)


def compile_agent() -> None:
    """Write the bytecode of the agent's modules that lack an up-to-date one (a no-op when they
    have it): the bench times an installed agent's starts, not Python compiling its source."""
    if not compileall.compile_dir(str(AGENT_DIR), quiet=1):
        raise RuntimeError(f"the agent's sources under {AGENT_DIR} do not compile")


def _stamp(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def killed_at_grace(rc: int | None, stop_s: float) -> bool:
    """Whether the stop itself killed the agent, its grace (STOP_GRACE_S) run out: a SIGKILL
    sooner is someone else's (the OOM killer's), not a stop too slow to keep the planner."""
    return stop_s >= STOP_GRACE_S and rc == -signal.SIGKILL


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


def _listed(log: str) -> float | None:
    """When the first lists of Services and of EndpointSlices had both completed (the reflectors'
    `listed N` lines)."""
    stamps = []
    for kind in ("Services (", "EndpointSlices ("):
        lines = [ln for ln in log.splitlines() if LOG_TIME.match(ln) and kind in ln and "): listed " in ln]
        if lines:
            stamps.append(_stamp(lines[0]))
    return max(stamps) if len(stamps) == 2 else None


def _vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class ApiServerProcess:
    """The fake API server in a process of its own, as a real one is: the bench's polling of a map
    must not share a GIL with the server's watch streams. Commands go over a pipe."""

    def __init__(self, services: int, endpoints: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, services, endpoints), daemon=True)
        self._proc.start()
        self.load_s: float = self.call("ready")

    def call(self, *command: Any) -> Any:
        self._conn.send(command)
        reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        try:
            self.call("stop")
        finally:
            self._proc.join(timeout=10)


def _serve(conn: Any, services: int, endpoints: int) -> None:
    started = time.monotonic()
    server = FakeApiServer(bookmark_interval_s=60.0, tls=True).start()
    objects = scale_objects(services, endpoints)
    for obj in objects:
        server.create(obj)
    slices = [o for o in objects if o["kind"] == "EndpointSlice"]
    vips = {o["metadata"]["name"]: o["spec"]["clusterIP"] for o in objects if o["kind"] == "Service"}
    ready = time.monotonic() - started
    while True:
        command, *args = conn.recv()
        try:
            if command == "ready":
                conn.send(ready)
            elif command == "node":
                conn.send(server.apply(node_object(*args))["metadata"]["resourceVersion"])
            elif command == "kubeconfig":
                conn.send(server.write_kubeconfig(args[0]))
            elif command == "grow":  # (slice index, change number): one more endpoint
                i, n = args
                sl = copy.deepcopy(slices[i % len(slices)])
                extra = {**sl["endpoints"][0], "addresses": [f"10.250.{n >> 8 & 255}.{n & 255}"]}
                sl["endpoints"] = [*sl["endpoints"], extra]
                written_at = time.time()
                rv = int(server.update(sl)["metadata"]["resourceVersion"])
                name = sl["metadata"]["labels"]["kubernetes.io/service-name"]
                conn.send((written_at, rv, vips[name], len(sl["endpoints"])))
            elif command == "shrink":  # back to the slice as listed
                i = args[0]
                base = copy.deepcopy(slices[i % len(slices)])
                base["metadata"].pop("resourceVersion", None)
                current = server.get("EndpointSlice", base["metadata"]["namespace"], base["metadata"]["name"])
                assert current is not None
                base["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                conn.send(int(server.update(base)["metadata"]["resourceVersion"]))
            elif command == "stop":
                server.stop()
                conn.send(None)
                return
        except BaseException as exc:
            conn.send(exc)


# The pause between two lookups of the changed frontend. Polled without one (most likely keeping
# one of this machine's two CPUs busy: inferred), 36 of 200 changes waited 4 to 12 ms before their
# sync started: the whole of the p99 (at the map 10.1 ms, against 3.4 ms with this pause; at the
# agent's log line 9.6 ms, against 5.0 ms with it and 4.3 ms with no poll at all; the same tree,
# bench/results/scale/change-poll-2026-11-28.txt).
POLL_S = 0.0002


def map_size_flags(services: int, endpoints: int) -> list[str]:
    """`--bpf-*-max` for the maps the default sizes cannot hold (50,000 x 10: fe, slot, be, member,
    addr): the entries the state needs, plus the changes' 11th endpoint, rounded up to 65,536."""
    need = {
        "fe": 2 * services,
        "slot": services * (endpoints + 1),
        "be": services * (endpoints + 1),
        "member": services * (endpoints + 1),
        "rnat": services,
        "addr": services * (endpoints + 2),  # each cluster IP and endpoint address (and the node's)
    }
    flags = []
    for role, entries in need.items():
        spec = abi.MAPS[role]
        if entries > spec.default_size:
            flags.append(f"{spec.size_flag}={-(-entries // 65536) * 65536}")
    return flags


def measure(
    mode: str,
    services: int,
    endpoints: int,
    changes: int,
    iptables_backend: str = "legacy",
    timeout_s: float = 900.0,
) -> ApiScale:
    out = ApiScale(mode, services, endpoints, iptables_backend=iptables_backend if mode == "iptables" else "")
    compile_agent()
    server = ApiServerProcess(services, endpoints)
    try:
        with Lab(nodes=1, pods_per_node=1) as lab:
            assert lab.tmpdir is not None
            node = lab.nodes[0]
            out.load_s = server.load_s
            server.call("node", node.name, node.ip)
            kubeconfig = server.call("kubeconfig", str(lab.tmpdir / "kubeconfig"))
            extra = (
                [f"--iptables-backend={iptables_backend}"]
                if mode == "iptables"
                else map_size_flags(services, endpoints)
            )
            out.flags = " ".join(extra) if mode == "ebpf" else ""
            agent = Agent(
                lab, node, mode, [f"--kubeconfig={kubeconfig}"], ["--iptables-sync-period=1h", *extra]
            )
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
                listed = _listed(log)
                if listed is not None:
                    out.listed_s = listed - _stamp(watching)
                    if loader is not None:
                        out.waited_s = max(0.0, _stamp(loader) - listed)
                _changes(out, agent, server, changes, services)
                out.rss_mib = _vm_hwm_mib(agent.proc.pid)
                stopping = time.time()
                rc = agent.stop(timeout=STOP_GRACE_S)
                out.stop_s = time.time() - stopping
                out.stop_killed = killed_at_grace(rc, out.stop_s)
                began = time.time()
                agent.start()
                again = _wait_log(agent, "sync done:", timeout_s)
                out.restart_to_sync_s = _stamp(again) - began
                watching = _first(agent.log_since_start(), "watching ")
                if watching is not None:
                    out.restart_list_to_sync_s = _stamp(again) - _stamp(watching)
            finally:
                agent.stop()
                agent.cleanup()
    finally:
        server.close()
    return out


def _changes(out: ApiScale, agent: Agent, server: ApiServerProcess, n: int, services: int) -> None:
    fe_map = None
    if out.mode == "ebpf":
        from agent.ebpf.maps import BpfMap

        fe_map = BpfMap.open_pinned(abi.MAPS["fe"], agent.pin_path)
    step = max(1, services // n)
    try:
        for i in range(n):
            t0 = time.perf_counter()
            written_at, rv, vip, want = server.call("grow", i * step, i)
            if fe_map is not None:
                key = abi.FrontendKey(
                    addr=abi.ip_be(vip), port=abi.port_be(80), proto=6, scope=int(abi.Scope.INTERNAL)
                )
                deadline = t0 + 10
                while True:
                    value = fe_map.lookup(key)
                    if isinstance(value, abi.Frontend) and value.count == want:
                        # from the server's stamp before its write: the write, the watch event,
                        # the agent's sync and the wait for this lookup (the pipe's reply may be too)
                        out.change_ms.append(max(0.0, (time.time() - written_at) * 1000))
                        break
                    time.sleep(POLL_S)
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"change {i} not in the map after 10 s:\n{agent.log()[-3000:]}")
            agent.wait_resource_versions({"EndpointSlice": rv}, timeout=30)
            line = [ln for ln in agent.log_since_start().splitlines() if "sync done:" in ln][-1]
            out.change_log_ms.append(max(0.0, (_stamp(line) - written_at) * 1000))
            agent.wait_resource_versions({"EndpointSlice": server.call("shrink", i * step)}, timeout=30)
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
            *[
                f"the iptables-mode agent ran with --iptables-backend={r.iptables_backend}"
                for r in results
                if r.iptables_backend
            ],
            *[f"{r.mode}, {num(r.services)} services: {r.flags}" for r in results if r.flags],
            *[
                f"{r.mode}, {num(r.services)} services: both lists complete {r.listed_s:.2f} s after the "
                "first request"
                + (
                    f"; the first sync then waited {r.waited_s:.2f} s for the data path"
                    if r.mode == "ebpf"
                    else ""
                )
                + f"; restart: list -> synced {r.restart_list_to_sync_s:.2f} s"
                + (
                    f"; the stop before it took {r.stop_s:.2f} s"
                    + (f" and was killed at {STOP_GRACE_S:.0f} s" if r.stop_killed else "")
                    if r.stop_s
                    else ""
                )
                for r in results
                if r.listed_s
            ],
        ],
    )
