"""Where the wall time of a first sync and of a restart goes, through the API server:
`python -m bench.syncphases`.

The API part of `make bench` (bench/api.py) gives list -> synced in wall seconds, which the load of
a shared 2-vCPU machine can double. This runs the same agent against the same fake API server
(10,000 Services x 10 endpoints by default, no changes) and splits each start by the agent's own
log lines into phases, with the agent's CPU seconds (user + system, its own process) at its first
`sync done` (and when it starts listing and has both lists), which other jobs inflate far less
than wall time:

* cold start (a fresh pin directory; the programs loaded from the compile cache, the verifier run):
  **lists** (first list request -> both lists complete), **data path** (process start -> the
  loader's `ready` line), **after both** (the later of the two -> `sync done`: what the sync still
  had to do once it had its lists and its programs);
* restart (the same agent started again over its pins, programs reused): **lists**, **after the
  lists** (-> `sync done`);
* and list -> synced for both, as bench/api.py reports it;
* the CPU seconds of the children the agent has reaped by then (`cpu_children_s`: the first
  EndpointSlice list's child process, agent/kube/childlist.py), which its own figure leaves out.

The agent's maps are sized for the Services it is given, as bench/api.py sizes them
(`agent_flags`: at 50,000 x 10 the defaults are too small, and an agent that finds its maps full
measures something else); the flags are in each output line's `"flags"`.

`--runs` starts per tree; `--label` names the tree in the output (run it from each tree's root to
compare two trees in one session, alternating).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.api import ApiServerProcess, _first, _listed, _stamp, _wait_log, compile_agent, map_size_flags
from lab import Lab
from lab.harness import Agent

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _children_cpu_s(pid: int) -> float:
    """CPU seconds of the agent's children it has reaped (the first list's child process,
    agent/kube/childlist.py, once it has ended: the CPU the agent's own figure leaves out)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / TICK  # cutime, cstime


def _cpu_at(agent: Agent, lines: int, timeout_s: float) -> float:
    """The agent's CPU seconds once its log holds `lines` lines among "watching ", "): listed "
    (Services and EndpointSlices) and "sync done:" (polled every 10 ms)."""
    assert agent.proc is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = agent.log_since_start()
        seen = sum(
            1
            for ln in log.splitlines()
            if "watching " in ln
            or ("): listed " in ln and ("Services (" in ln or "EndpointSlices (" in ln))
            or "sync done:" in ln
        )
        if seen >= lines:
            return _cpu_s(agent.proc.pid)
        if agent.proc.poll() is not None:
            raise RuntimeError(f"agent exited {agent.proc.returncode}:\n{agent.log()[-3000:]}")
        time.sleep(0.01)
    raise RuntimeError(f"the agent's log did not reach line {lines} in {timeout_s} s")


def _start(agent: Agent, timeout_s: float) -> dict[str, float]:
    began = time.time()
    agent.start()
    assert agent.proc is not None
    cpu_watching = _cpu_at(agent, 1, timeout_s)
    cpu_listed = _cpu_at(agent, 3, timeout_s)
    done = _wait_log(agent, "sync done:", timeout_s)
    cpu = _cpu_at(agent, 4, timeout_s)
    children = _children_cpu_s(agent.proc.pid)
    log = agent.log_since_start()
    watching, loader = _first(log, "watching "), _first(log, "data path ")
    listed = _listed(log)
    assert watching is not None and loader is not None and listed is not None
    t_done, t_watch, t_ready = _stamp(done), _stamp(watching), _stamp(loader)
    return {
        "start_to_sync_s": t_done - began,
        "list_to_sync_s": t_done - t_watch,
        "lists_s": listed - t_watch,
        "datapath_s": t_ready - began,
        "after_both_s": t_done - max(listed, t_ready),
        "after_lists_s": t_done - listed,
        "cpu_s": cpu,
        "cpu_start_s": cpu_watching,  # imports, credentials, the proxier's set-up begun
        "cpu_lists_s": cpu_listed - cpu_watching,  # with the verifier's, at a cold start
        "cpu_after_lists_s": cpu - cpu_listed,
        "cpu_children_s": children,
        "compiled": float("compile cache" in loader or "compiled in" in loader),
    }


def agent_flags(services: int, endpoints: int) -> list[str]:
    """The agent's flags: the maps sized as bench/api.py sizes them, so a run at 50,000 Services
    measures a sync rather than an agent that finds its maps too small."""
    return ["--iptables-sync-period=1h", *map_size_flags(services, endpoints)]


def measure(services: int, endpoints: int, timeout_s: float = 600.0) -> dict[str, dict[str, float]]:
    compile_agent()  # as bench/api.py: an installed agent's starts
    server = ApiServerProcess(services, endpoints)
    try:
        with Lab(nodes=1, pods_per_node=1) as lab:
            assert lab.tmpdir is not None
            node = lab.nodes[0]
            server.call("node", node.name, node.ip)
            kubeconfig = server.call("kubeconfig", str(lab.tmpdir / "kubeconfig"))
            agent = Agent(lab, node, "ebpf", [f"--kubeconfig={kubeconfig}"], agent_flags(services, endpoints))
            try:
                cold = _start(agent, timeout_s)
                agent.stop()
                restart = _start(agent, timeout_s)
            finally:
                agent.stop()
                agent.cleanup()
    finally:
        server.close()
    return {"cold": cold, "restart": restart}


def record(
    label: str, services: int, endpoints: int, load: float, out: dict[str, dict[str, float]]
) -> dict[str, object]:
    """One output line: the figures with what they were measured with."""
    flags = agent_flags(services, endpoints)
    return {"label": label, "services": services, "load": load, "flags": flags, **out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.syncphases", description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    for _ in range(args.runs):
        load = os.getloadavg()[0]
        out = measure(args.services, args.endpoints)
        c, r = out["cold"], out["restart"]
        print(json.dumps(record(args.label, args.services, args.endpoints, load, out)), flush=True)
        print(
            f"# {args.label} load {load:.2f}: cold list->synced {c['list_to_sync_s']:.2f} s (lists "
            f"{c['lists_s']:.2f}, data path {c['datapath_s']:.2f}, after both {c['after_both_s']:.2f}, "
            f"CPU {c['cpu_s']:.2f}); restart list->synced {r['list_to_sync_s']:.2f} s (lists "
            f"{r['lists_s']:.2f}, after the lists {r['after_lists_s']:.2f}, CPU {r['cpu_s']:.2f}: "
            f"start {r['cpu_start_s']:.2f}, lists {r['cpu_lists_s']:.2f}, "
            f"after {r['cpu_after_lists_s']:.2f})",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
