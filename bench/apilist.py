"""How fast, and at what memory cost, the agent lists a large cluster from the API server.

`python -m bench.apilist` starts the fake API server (lab/fakeapi) in this process, fills it
with `--services` Services and as many EndpointSlices of `--endpoints` endpoints each
(lab/fakeapi/objects.py: realistic fields, ~0.8 KB and ~3.5 KB of JSON), then lists both kinds
in a fresh child process per run through the real `kubernetes` client, paginated:

* `models`: the client's default, responses deserialised into V1Service/V1EndpointSlice objects;
* `json`: `_preload_content=False`, bytes decoded with the standard json module into dicts;
* `orjson`: the same with orjson;
* `source`: the agent's own path (ApiSource and its reflectors: orjson, reconcile, sink) until
  both kinds report Synced.

Each child reports wall seconds from the first request to the last item, its own CPU seconds
(user + system: the decoding cost, and steadier than wall time on a shared machine), its peak RSS
above what it held before the first request (VmHWM after resetting it; imports and the client
are in the baseline), and the RSS still held at the end with every item kept (as an informer
cache keeps them). The server runs in the
parent, so its CPU and memory are not in the child's figures (its CPU is reported apart: the
parent does nothing else while a child lists); on a 2-CPU machine the two processes each get a
core. The median of `--runs` runs is printed per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

VARIANTS = ("models", "json", "orjson", "source")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> None:
    """Start the high-water mark (VmHWM) from the current RSS (Linux >= 4.0, clear_refs 5).

    getrusage's ru_maxrss would not do: Linux keeps it across exec, so a child forked from the
    server process would start with the server's RSS as its "peak".
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(variant: str, url: str, page_size: int) -> dict[str, Any]:
    import orjson
    from kubernetes import client as k8s

    from agent.config import Config
    from agent.kube.client import api_client
    from agent.kube.reflector import WatchSettings
    from agent.kube.resources import SERVICE_FIELD_SELECTOR, SERVICE_LABEL_SELECTOR, SLICE_LABEL_SELECTOR
    from agent.kube.source import ApiSource
    from agent.sources.base import Event, Kind, Synced

    api = api_client(Config(master=url))
    core, disco = k8s.CoreV1Api(api), k8s.DiscoveryV1Api(api)
    calls: tuple[tuple[Callable[..., Any], dict[str, str]], ...] = (
        (
            core.list_service_for_all_namespaces,
            {"label_selector": SERVICE_LABEL_SELECTOR, "field_selector": SERVICE_FIELD_SELECTOR},
        ),
        (disco.list_endpoint_slice_for_all_namespaces, {"label_selector": SLICE_LABEL_SELECTOR}),
    )
    kept: list[Any] = []
    _reset_peak()
    base = _status_mib("VmRSS")
    cpu0 = os.times()
    start = time.perf_counter()
    if variant == "source":
        done = threading.Event()
        synced: set[Kind] = set()

        def sink(events: Sequence[Event]) -> None:
            kept.extend(events)
            for e in events:
                if isinstance(e, Synced):
                    synced.add(e.kind)
            if synced >= {Kind.SERVICE, Kind.ENDPOINT_SLICE}:
                done.set()

        src = ApiSource(Config(), api, WatchSettings(page_size=page_size))
        src.start(sink)
        done.wait(600)
        elapsed = time.perf_counter() - start
        src.stop()
    else:
        for call, selectors in calls:
            token = None
            while True:
                kw: dict[str, Any] = {**selectors, "limit": page_size or None}
                if token:
                    kw["_continue"] = token
                if variant == "models":
                    page = call(**kw)
                    kept.extend(page.items)
                    token = page.metadata._continue
                else:
                    resp = call(_preload_content=False, **kw)
                    data = resp.data
                    resp.release_conn()
                    body = orjson.loads(data) if variant == "orjson" else json.loads(data)
                    kept.extend(body["items"])
                    token = body["metadata"].get("continue")
                if not token:
                    break
        elapsed = time.perf_counter() - start
    cpu1 = os.times()
    items = sum(1 for k in kept if not isinstance(k, Synced))
    return {
        "cpu_s": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
        "variant": variant,
        "page_size": page_size,
        "seconds": elapsed,
        "peak_mib": _status_mib("VmHWM") - base,
        "held_mib": _status_mib("VmRSS") - base,
        "items": items,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.apilist", description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--page-sizes", default="500", help="comma-separated; 0 = one unpaginated request")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.url, int(args.page_sizes))))
        return 0

    from lab.fakeapi import FakeApiServer
    from lab.fakeapi.objects import scale_objects

    srv = FakeApiServer().start()
    t0 = time.perf_counter()
    for obj in scale_objects(args.services, args.endpoints):
        srv.create(obj)
    print(
        f"fake API server {srv.url}: {args.services} Services + {args.services} EndpointSlices "
        f"x {args.endpoints} endpoints created in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    rows = []
    try:
        for page_size in [int(p) for p in args.page_sizes.split(",")]:
            for variant in args.variants.split(","):
                runs = []
                for _ in range(args.runs):
                    served0 = os.times()  # this process only serves while the child lists
                    out = subprocess.run(
                        [sys.executable, "-m", "bench.apilist", "--child", variant, "--url", srv.url,
                         "--page-sizes", str(page_size)],
                        check=True, capture_output=True, text=True, timeout=900,
                    )  # fmt: skip
                    served1 = os.times()
                    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                    served = (served1.user - served0.user) + (served1.system - served0.system)
                    runs[-1]["server_cpu_s"] = served
                med = {
                    k: statistics.median(r[k] for r in runs)
                    for k in ("seconds", "cpu_s", "server_cpu_s", "peak_mib", "held_mib")
                }
                rows.append((variant, page_size, runs[0]["items"], med))
                print(
                    f"{variant:7} page {page_size or 'all':>5}: {med['seconds']:6.2f} s  "
                    f"cpu {med['cpu_s']:6.2f} s  server cpu {med['server_cpu_s']:6.2f} s  "
                    f"peak +{med['peak_mib']:6.0f} MiB  held +{med['held_mib']:6.0f} MiB  "
                    f"({runs[0]['items']} items, median of {len(runs)})",
                    flush=True,
                )
    finally:
        srv.stop()
    print(
        "\n| decode | page size | items | wall s | client CPU s | server CPU s | peak RSS above baseline "
        "| RSS held with items kept |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for variant, page_size, items, med in rows:
        print(
            f"| {variant} | {page_size or 'all'} | {items:,} | {med['seconds']:.2f} | {med['cpu_s']:.2f} | "
            f"{med['server_cpu_s']:.2f} | "
            f"{med['peak_mib']:.0f} MiB | {med['held_mib']:.0f} MiB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
