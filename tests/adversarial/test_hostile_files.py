"""Hostile and careless services files: the source alone, then a real agent per mode.

Every case below was seen to hurt an agent reading the file with PyYAML's loaders: an empty or
half-written file removed every service; a 29-byte alias loop spun the watcher at 100% CPU
forever; a few hundred bytes of "billion laughs" grew past 1 GB; `x-date: 2001-02-30`, a
5,000-digit number and JSON nested 100,000 deep killed the watching thread (the process stayed
up, deaf to every later file), and YAML nested as deep crashed the whole process in libyaml's C
composer. The rest are neighbours of those (a FIFO in place of the file, a sparse 64 MiB file,
foreign tags, bytes that are not UTF-8).

For each case:

* against `FileWatch` alone (no kernel, fast): a refused file delivers nothing, keeps the version in
  force, counts `ekp_services_file_rejected_total{reason}`, costs under a second of CPU and 32 MiB
  of allocations; an accepted one is delivered; the next good file is delivered either way;
* against a real agent in each mode (module-scoped one-node lab): after the hostile file the
  service keeps answering, the agent's CPU time over 2 s stays under 0.5 s and its RSS within
  64 MiB of what it was before the first case, and a later good file is applied.
"""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from agent.metrics.source import FileMetrics
from agent.sources.base import Event, Kind, ObjectEvent
from agent.sources.decode import MAX_FILE_BYTES, Reason
from agent.sources.file import FileWatch, content_version
from lab import Lab
from lab.harness import Agent, Cluster, ep
from lab.objects import Port, service, with_endpoints
from tests.conftest import require_kernel

REGISTRY = CollectorRegistry()
METRICS = FileMetrics(REGISTRY)

VIP = "10.96.0.10"
HTTP = Port("http", 80, 8080)


def web() -> dict[str, Any]:
    return service("web", VIP, [HTTP])


def good_objects(cluster: Cluster | None = None) -> list[dict[str, Any]]:
    """The Service in force: `web` alone for the source, with its two pods for a real agent."""
    if cluster is None:
        return [web()]
    return with_endpoints(web(), [ep(cluster, "pod-1-1"), ep(cluster, "pod-1-2")])


def kubectl_list(objects: Sequence[dict[str, Any]]) -> str:
    """What `kubectl get -o yaml` prints: keys sorted, so `kind: List` comes after the items."""
    return yaml.safe_dump(
        {"apiVersion": "v1", "items": list(objects), "kind": "List", "metadata": {"resourceVersion": ""}}
    )


def billion_laughs() -> bytes:
    """Nine levels of nine aliases each: 9^9 strings (about 387 million) once walked, as a List."""
    lines = ["apiVersion: v1", "kind: List", 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = name
    lines.append("items: *i")
    return ("\n".join(lines) + "\n").encode()


Objects = Sequence[dict[str, Any]]
Maker = Callable[[Path, Objects], None]


def _put(path: Path, data: bytes, *, in_place: bool) -> None:
    if in_place:  # as `kubectl get -o yaml > file` or an editor writes: readers can see it half done
        with open(path, "wb") as f:
            f.write(data)
        return
    tmp = path.with_name(path.name + ".tmp")  # the safe way: only the content is hostile
    tmp.write_bytes(data)
    os.replace(tmp, path)


def replace_with(data: bytes | Callable[[Objects], bytes], *, in_place: bool = False) -> Maker:
    """Put `data` (or what it makes of the objects in force) at the path."""

    def make(path: Path, objects: Objects) -> None:
        _put(path, data(objects) if callable(data) else data, in_place=in_place)

    return make


def remove(path: Path, objects: Objects) -> None:
    path.unlink()


def fifo(path: Path, objects: Objects) -> None:
    tmp = path.with_name(path.name + ".fifo")
    os.mkfifo(tmp)
    os.replace(tmp, path)


def sparse_too_large(path: Path, objects: Objects) -> None:
    tmp = path.with_name(path.name + ".big")
    with open(tmp, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    os.replace(tmp, path)


def as_list(objects: Objects) -> bytes:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}).encode()


def cut_kubectl_list(objects: Objects) -> bytes:
    return kubectl_list(objects).split("kind: List")[0].encode()


def with_x_date(objects: Objects) -> bytes:
    return as_list(
        [{**o, "x-date": "PLACEHOLDER"} if o["kind"] == "Service" else o for o in objects]
    ).replace(b'"PLACEHOLDER"', b"2001-02-30")


def with_huge_port(objects: Objects) -> bytes:
    return yaml.safe_dump_all(objects).replace("port: 80\n", "port: " + "1" * 5000 + "\n").encode()


def web_twice(objects: Objects) -> bytes:
    second = {**web(), "spec": {**web()["spec"], "clusterIP": "10.96.0.99"}}
    return (yaml.safe_dump_all(objects) + "---\n" + yaml.safe_dump(second)).encode()


@dataclass(frozen=True)
class Case:
    id: str
    make: Maker
    reason: Reason | None  # None: the file is applied
    # For applied cases: checks on the delivered events (source alone).
    check: Callable[[list[Event]], None] | None = None


def _x_date_is_a_string(events: list[Event]) -> None:
    [svc] = [e for e in events if isinstance(e, ObjectEvent) and e.kind is Kind.SERVICE]
    assert svc.obj["x-date"] == "2001-02-30"


def _first_web_wins(events: list[Event]) -> None:
    services = [e for e in events if isinstance(e, ObjectEvent) and e.kind is Kind.SERVICE]
    assert services == [], "the first web is the one in force already: nothing changes"


CASES = [
    Case("empty", replace_with(b"", in_place=True), Reason.EMPTY),
    Case("comments only", replace_with(b"# nothing here yet\n\n"), Reason.EMPTY),
    Case("kubectl List cut before kind: List", replace_with(cut_kubectl_list, in_place=True), Reason.SHAPE),
    Case(
        "object cut before metadata",
        replace_with(b"apiVersion: v1\nkind: Service\n", in_place=True),
        Reason.SHAPE,
    ),
    Case("List without items", replace_with(b"apiVersion: v1\nkind: List\nitems:\n"), Reason.SHAPE),
    Case("alias loop (29 bytes)", replace_with(b"&a {kind: List, items: [*a]}\n"), Reason.ALIAS),
    Case("billion laughs", replace_with(billion_laughs()), Reason.ALIAS),
    Case("x-date: 2001-02-30", replace_with(with_x_date), None, _x_date_is_a_string),
    Case("5,000-digit integer", replace_with(with_huge_port), Reason.NUMBER),
    Case(
        "JSON nested 100,000 deep",
        replace_with(
            b'{"apiVersion": "v1", "kind": "List", "items": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        ),
        Reason.DEPTH,
    ),
    Case(
        "YAML nested 100,000 deep",
        replace_with(b"apiVersion: v1\nkind: List\nitems: " + b"[" * 100_000 + b"]" * 100_000 + b"\n"),
        Reason.DEPTH,
    ),
    Case(
        "python tag", replace_with(b"!!python/object/apply:os.system ['touch /tmp/ekp-pwned']\n"), Reason.TAG
    ),
    Case("not UTF-8", replace_with(b"kind: \xff\xfeService\n"), Reason.ENCODING),
    Case("sparse file over the size limit", sparse_too_large, Reason.TOO_LARGE),
    Case("FIFO in place of the file", fifo, Reason.UNREADABLE),
    Case("file removed", remove, Reason.MISSING),
    Case("same Service twice", replace_with(web_twice), None, _first_web_wins),
]
IDS = [c.id for c in CASES]


def rejected(reason: Reason) -> float:
    return REGISTRY.get_sample_value("ekp_services_file_rejected_total", {"reason": reason.value}) or 0.0


class Sink:
    def __init__(self) -> None:
        self.batches: list[list[Event]] = []

    def __call__(self, events: Sequence[Event]) -> None:
        self.batches.append(list(events))


# --------------------------------------------------------------------------------- the source alone


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_source_alone(case: Case, tmp_path: Path) -> None:
    path = tmp_path / "services.yaml"
    objects = good_objects()
    replace_with(as_list(objects))(path, objects)
    watch = FileWatch(str(path), metrics=METRICS)
    sink = Sink()
    assert watch.poll(sink)
    good = watch.version

    case.make(path, objects)
    before = rejected(case.reason) if case.reason else 0.0
    cpu = time.process_time()
    tracemalloc.start()
    try:
        delivered = watch.poll(sink)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    cpu = time.process_time() - cpu
    assert cpu < 1.0, f"{cpu:.2f}s of CPU for one read"
    assert peak < 32 << 20, f"{peak >> 20} MiB allocated for one read"

    if case.reason is None:
        assert delivered and watch.version != good and not watch.stale
        assert case.check is not None
        case.check(sink.batches[-1])
    else:
        assert not delivered and len(sink.batches) == 1, "nothing of a refused file is delivered"
        assert watch.version == good and watch.stale
        assert rejected(case.reason) == before + 1
        assert not watch.poll(sink), "a refused file is judged once"
        assert rejected(case.reason) == before + 1

    later = as_list([])
    replace_with(later)(path, [])
    assert watch.poll(sink), "a later good file is applied"
    assert watch.version == content_version(later) and not watch.stale


# --------------------------------------------------------------------------------- a real agent


@dataclass
class Target:
    cluster: Cluster
    baseline_rss: int
    rounds: int = 0

    @property
    def agent(self) -> Agent:
        return self.cluster.agents[0]


@pytest.fixture(scope="module", params=["ebpf", "iptables"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    require_kernel()
    with Lab(nodes=1, pods_per_node=2) as lab:
        lab.start_podservers()
        cluster = Cluster(lab, request.param)
        cluster.start()
        try:
            cluster.apply(good_objects(cluster))
            assert answers(cluster, VIP)
            agent = cluster.agents[0]
            assert agent.proc is not None
            yield Target(cluster, rss_bytes(agent.proc.pid))
        finally:
            failures = cluster.stop()
        assert not failures, failures


def answers(cluster: Cluster, vip: str, count: int = 4) -> bool:
    bodies = {cluster.lab.http_get("pod-1-1", vip, 80).strip() for _ in range(count)}
    return bodies <= {"pod-1-1", "pod-1-2"} and bool(bodies)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def wait_log(agent: Agent, offset: int, marker: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = agent.log()[offset:]
        if marker in text:
            return text
        assert agent.proc is not None and agent.proc.poll() is None, f"agent died:\n{agent.log()[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {marker!r} in the agent log within {timeout}s:\n{agent.log()[offset:][-3000:]}")


@pytest.mark.kernel
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_real_agent(case: Case, target: Target) -> None:
    cluster, agent = target.cluster, target.agent
    assert agent.proc is not None
    pid = agent.proc.pid
    path = cluster.services_file
    offset = len(agent.log())
    case.make(path, good_objects(cluster))
    if case.reason is None:
        cluster.version = content_version(path.read_bytes())
        agent.wait_version(cluster.version, timeout=30)
    else:
        line = wait_log(agent, offset, "not applied")
        assert f"services file {path}" in line

    start_cpu, start = cpu_seconds(pid), time.monotonic()
    assert answers(cluster, VIP), "the service in force keeps answering"
    time.sleep(max(0.0, 2.0 - (time.monotonic() - start)))
    used = cpu_seconds(pid) - start_cpu
    assert used < 0.5, f"the agent used {used:.2f}s of CPU in 2s after the file"
    rss = rss_bytes(pid)
    assert rss < target.baseline_rss + (64 << 20), f"RSS {rss >> 20} MiB (was {target.baseline_rss >> 20})"
    assert agent.proc.poll() is None, "the agent is still running"

    # A later good file is applied: a Service on a fresh VIP answers.
    target.rounds += 1
    later_vip = f"10.96.1.{target.rounds}"
    later = with_endpoints(service("later", later_vip, [HTTP]), [ep(cluster, "pod-1-2")])
    cluster.apply([*good_objects(cluster), *later], timeout=30)
    assert answers(cluster, later_vip) and answers(cluster, VIP)
