"""A benchmark run as a file: what `make bench` measured, where, on which commit, with which flags.

`make bench` writes `bench/results/<date>-<commit>.json` (and the Markdown it renders beside it,
`.md`). The JSON holds the commit (and whether the tree had uncommitted changes), the host (CPU
model, CPUs, kernel, distribution, tool versions, load at the start), the date, the exact
parameters (the command line and every setting), the iptables backend each part used, and the raw
results: every wrk round, each target's connect-latency percentiles and sample count, every sync,
every program-cost window, the API part and the capacity part.

`render(record)` rebuilds the tables from those raw results: the stdout of the run, the `.md` file
and the README's block (`python -m bench.report --readme`) are all that one function's output, so a
figure in the README is a figure in a file. JSON has no NaN: a value that was not measured is null.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import api, bpfstats, capacity, flood, health
from bench.report import Table
from bench.traffic import Load

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
FORMAT = 1


# --------------------------------------------------------------------------------- facts


def git_commit() -> tuple[str, bool]:
    """(HEAD's full sha, whether the work tree differs from it), or ("unknown", True) outside git."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True
    return sha, bool(status.strip())


def _first_line(argv: Sequence[str]) -> str:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return "not found"
    text = (res.stdout or res.stderr).strip()
    return text.splitlines()[0] if text else "?"


def host_facts() -> dict[str, Any]:
    model = ""
    try:
        m = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        model = m.group(1).strip() if m else ""
    except OSError:
        pass
    distro = ""
    try:
        m = re.search(r'^PRETTY_NAME="?(.*?)"?$', Path("/etc/os-release").read_text(), re.MULTILINE)
        distro = m.group(1) if m else ""
    except OSError:
        pass
    try:
        import bcc  # type: ignore[import-not-found,unused-ignore]

        bcc_version = str(getattr(bcc, "__version__", "?"))
    except ImportError:
        bcc_version = "not found"
    return {
        "cpu_model": model or platform.machine(),
        "cpus": os.cpu_count() or 1,
        "kernel": platform.release(),
        "os": distro,
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "tools": {
            "wrk": _first_line(["wrk", "--version"]),
            "iptables": _first_line(["iptables", "--version"]),
            "nginx": _first_line(["nginx", "-v"]),
            "bcc": bcc_version,
        },
    }


# --------------------------------------------------------------------------------- JSON


def _clean(value: Any) -> Any:
    """NaN and infinities as null (JSON has neither); containers recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _nan(value: Any) -> float:
    return float("nan") if value is None else float(value)


def results_json(results: Any) -> dict[str, Any]:
    """bench.run.Results as plain data (connect samples reduced to percentiles and a count)."""
    from bench.run import LATENCY_QUANTILES, latency_key

    def target(t: Any) -> dict[str, Any]:
        return {
            "loads": [dataclasses.asdict(load) for load in t.loads],
            "probe_errors": dict(t.probe_errors),
            "latency_us": {latency_key(q): t.p(q) for q in LATENCY_QUANTILES},
            "sample_count": len(t.samples_ns) or t.sample_count,
            "unpinned_us": (
                {latency_key(q): t.p_unpinned(q) for q in LATENCY_QUANTILES}
                if t.unpinned_ns or t.unpinned_us
                else {}
            ),
        }

    return {
        "states": [
            {
                "mode": st.mode,
                "label": st.label,
                "services": st.services,
                "pod": target(st.pod),
                "vip": target(st.vip) if st.vip is not None else None,
                "pod6": target(st.pod6) if st.pod6 is not None else None,
                "vip6": target(st.vip6) if st.vip6 is not None else None,
            }
            for st in results.states
        ],
        "syncs": [dataclasses.asdict(f) for f in results.syncs],
        "stats": [
            {**dataclasses.asdict(w), "costs": [dataclasses.asdict(c) for c in w.costs]}
            for w in results.stats
        ],
        "packets": [
            {"services": w.services, "label": w.label, "costs": [dataclasses.asdict(c) for c in w.costs]}
            for w in results.packets
        ],
        "tc_views": [dataclasses.asdict(v) for v in results.tc_views],
        "notes": list(results.notes),
        "stats_sysctl_before": results.stats_sysctl_before,
        "iptables_backend": results.iptables_backend,
    }


def results_from(data: dict[str, Any]) -> Any:
    from bench.progcost import PacketCost
    from bench.run import PacketCosts, Results, State, StatsWindow, SyncFacts, Target
    from bench.tcview import TcView

    def load(d: dict[str, Any]) -> Load:
        return Load(
            conns_per_s=float(d["conns_per_s"]),
            requests=int(d["requests"]),
            errors=int(d["errors"]),
            seconds=float(d["seconds"]),
            server_cpu_pct=_nan(d["server_cpu_pct"]),
            machine_busy_pct=_nan(d["machine_busy_pct"]),
            others_pct=_nan(d["others_pct"]),
            error_kinds=str(d["error_kinds"]),
        )

    def target(d: dict[str, Any]) -> Target:
        return Target(
            loads=[load(x) for x in d["loads"]],
            probe_errors=dict(d["probe_errors"]),
            latency_us={k: _nan(v) for k, v in d["latency_us"].items()},
            sample_count=int(d["sample_count"]),
            # runs before latency was also measured unpinned have none
            unpinned_us={k: _nan(v) for k, v in d.get("unpinned_us", {}).items()},
        )

    def sync(d: dict[str, Any]) -> SyncFacts:
        return SyncFacts(**{**d, "wall_s": _nan(d["wall_s"]), "read_s": _nan(d["read_s"])})

    return Results(
        states=[
            State(
                mode=d["mode"],
                label=d["label"],
                services=d["services"],
                pod=target(d["pod"]),
                vip=target(d["vip"]) if d["vip"] is not None else None,
                # runs before IPv6 was measured have neither
                pod6=target(d["pod6"]) if d.get("pod6") is not None else None,
                vip6=target(d["vip6"]) if d.get("vip6") is not None else None,
            )
            for d in data["states"]
        ],
        syncs=[sync(d) for d in data["syncs"]],
        stats=[
            StatsWindow(
                **{
                    **d,
                    "costs": [bpfstats.Cost(c["name"], c["runs"], _nan(c["ns_per_run"])) for c in d["costs"]],
                }
            )
            for d in data["stats"]
        ],
        packets=[
            PacketCosts(
                d["services"],
                [PacketCost(**{**c, "ns": _nan(c["ns"])}) for c in d["costs"]],
                d.get("label", ""),
            )
            for d in data.get("packets", [])
        ],
        tc_views=[TcView(**v) for v in data.get("tc_views", [])],
        notes=list(data["notes"]),
        stats_sysctl_before=data["stats_sysctl_before"],
        iptables_backend=data["iptables_backend"],
    )


def make(
    *,
    argv: Sequence[str],
    parameters: dict[str, Any],
    parts: Sequence[str],
    started: datetime,
    seconds: float,
    host: dict[str, Any],
    results: Any | None,
    scales: Sequence[api.ApiScale],
    capacity_result: capacity.Result | None,
    flood_result: flood.Result | None = None,
    health_result: health.Result | None = None,
) -> dict[str, Any]:
    sha, dirty = git_commit()
    record = {
        "format": FORMAT,
        "date": started.isoformat(timespec="seconds"),
        "commit": sha,
        "dirty": dirty,
        "host": host,
        "command": "python -m bench " + " ".join(argv),
        "parameters": parameters,
        "parts": list(parts),
        "seconds": round(seconds, 1),
        "iptables_backends": backends(results, scales, parameters),
        "traffic": results_json(results) if results is not None else None,
        "api": [dataclasses.asdict(s) for s in scales],
        "capacity": dataclasses.asdict(capacity_result) if capacity_result is not None else None,
        "flood": flood_result.to_json() if flood_result is not None else None,
        "health": health_result.to_json() if health_result is not None else None,
    }
    cleaned: dict[str, Any] = _clean(record)
    return cleaned


def backends(
    results: Any | None, scales: Sequence[api.ApiScale], parameters: dict[str, Any]
) -> dict[str, str]:
    """Which iptables backend each table's iptables rows used, and who chose it."""
    out = {}
    if results is not None and results.iptables_backend:
        chosen = (
            "--iptables-backend given" if parameters.get("iptables_backend") else "the agent's auto choice"
        )
        out["traffic"] = f"{results.iptables_backend} ({chosen})"
        if any(f.mode.startswith("iptables-legacy") for f in results.syncs):
            out["legacy comparison"] = "legacy (bench/iptables_restore.py, synthetic state)"
    for s in scales:
        if s.mode == "iptables":
            out["api"] = f"{s.iptables_backend} (--api-iptables-backend)"
    return out


# --------------------------------------------------------------------------------- files


def stem(record: dict[str, Any]) -> str:
    return f"{record['date'][:10]}-{record['commit'][:12]}"


def save(record: dict[str, Any], directory: Path = RESULTS) -> Path:
    """Writes <date>-<commit>.json, before anything renders it (a rendering bug loses no run)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem(record)}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=True, allow_nan=False) + "\n")
    return path


def save_markdown(path: Path) -> Path:
    """Writes the rendering of a results file beside it (.md)."""
    out = path.with_suffix(".md")
    out.write_text(render(load(path), path))
    return out


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: results format {data.get('format')!r}, this code reads {FORMAT}")
    return data


def newest(directory: Path = RESULTS, part: str = "traffic") -> Path:
    """The results file of the latest run that measured `part` (by the date inside it, then the
    name): a run of some parts alone (`--parts flood`) does not hide the last full one."""
    files = sorted(
        (p for p in directory.glob("*.json") if load(p).get(part) is not None),
        key=lambda p: (load(p)["date"], p.name),
    )
    if not files:
        raise FileNotFoundError(f"no results with the {part} part in {directory}: run `make bench`")
    return files[-1]


# --------------------------------------------------------------------------------- rendering


def tables(record: dict[str, Any], parts: Sequence[str] | None = None) -> list[Table]:
    """The run's tables, rebuilt from the raw results in the record (only those of `parts`)."""
    from bench.run import Settings
    from bench.run import tables as traffic_tables

    def wanted(part: str) -> bool:
        return parts is None or part in parts

    out: list[Table] = []
    if record["traffic"] is not None and wanted("traffic"):
        p = record["parameters"]
        settings = Settings(
            services=p["services"],
            seconds=p["seconds"],
            rounds=p["rounds"],
            threads=p["threads"],
            connections=p["connections"],
            probes=p["probes"],
            modes=p["modes"],
            iptables_backend=p["iptables_backend"],
            legacy_compare=p["legacy_compare"],
            ipv6=p.get("ipv6", False),
        )
        backend = record["iptables_backends"].get("traffic")
        out += traffic_tables(results_from(record["traffic"]), settings, backend)
    if record["api"] and wanted("api"):
        out.append(api.table([api.ApiScale(**s) for s in record["api"]]))
    if record["capacity"] is not None and wanted("capacity"):
        out.append(capacity.table(capacity.Result(**record["capacity"])))
    if record.get("flood") is not None and wanted("flood"):
        out.append(flood.table(flood.Result.from_json(record["flood"])))
    if record.get("health") is not None and wanted("health"):
        out.append(health.table(health.Result.from_json(record["health"])))
    return out


def header(record: dict[str, Any], path: Path) -> list[str]:
    h = record["host"]
    # versions as the tools print them, without wrk's copyright line or nginx's preamble
    tools = {k: v.split(" Copyright")[0].removeprefix("nginx version: ") for k, v in h["tools"].items()}
    rel = path.relative_to(REPO) if path.is_absolute() and path.is_relative_to(REPO) else path
    dirty = " plus uncommitted changes" if record["dirty"] else ""
    return [
        f"_From `{rel}`: one run of `{record['command']}` on {record['date'].replace('T', ' ')}, commit "
        f"`{record['commit'][:12]}`{dirty}, {record['seconds']:,.0f} s in all._",
        "",
        f"_Host: {h['cpus']} vCPU ({h['cpu_model']}), kernel `{h['kernel']}`, {h['os']}; "
        f"{tools['wrk']}; {tools['iptables']}; {tools['nginx']}; bcc {tools['bcc']}; "
        f"load average {h['load_average_at_start']} at the start._",
        "",
        "_iptables backend: "
        + ("; ".join(f"{part}: {b}" for part, b in record["iptables_backends"].items()) or "no iptables rows")
        + "._",
        "",
    ]


def render(record: dict[str, Any], path: Path, parts: Sequence[str] | None = None) -> str:
    """The Markdown of a run: where and how it ran, then every table (or those of `parts`)."""
    notes = (
        record["traffic"]["notes"]
        if record["traffic"] is not None and (parts is None or "traffic" in parts)
        else []
    )
    return "\n".join(
        header(record, path) + [t.markdown() for t in tables(record, parts)] + [f"- NOTE: {n}" for n in notes]
    )
