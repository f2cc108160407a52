"""The agent's own cost of a first sync and of a restart, in CPU seconds: `python -m bench.firstsync`.

The API part of `make bench` times the agent in wall seconds beside a fake API server, on a machine
other jobs share: a load of 10 on 2 vCPUs makes its figures five times slower and says nothing of
where the time goes. This runs the same path in one process and counts CPU time per phase:

* the bench's objects (lab/fakeapi/objects.py: `--services` Services with one EndpointSlice of
  `--endpoints` endpoints, managedFields and all) serialized as the server answers a list: whole
  at resourceVersion=0 (its watch cache, what the reflector asks for first), else in pages of 500;
* **lists**: each list through the real reflector (decode, reconcile), read into the model's
  records as `Agent.deliver` does (agent.daemon._read) and applied to the model;
* **commit**: the model evaluates every Service (conflicts, merge, CategorizeEndpoints);
* **first sync**: the eBPF proxier's first sync over maps that keep what is written as the kernel
  would (raw bytes by key, the batch calls' contract), planner and writer included, and the
  steps around the first attach (the ABI v1 carry-over and the takeover of nf_conntrack's flows,
  here with none to carry);
* **restart**: a new proxier over the same maps (dump read back, ids re-adopted, nothing to write),
  the dump in the order a kernel hash map gives it (`--dump-order hash`, the default: an order
  unrelated to the writes', as the kernel's buckets are; `written` gives it back as written,
  which this tool did before and which hid about 0.3 to 0.5 CPU s of a restart's sync);
* the peak RSS above the process's own before the lists (VmHWM; the pages themselves excluded,
  the maps' bytes included, packed as written: about 20 bytes an entry), and what the restart
  adds to it.

No HTTP, no kernel: the server's cost, TLS and the bpf() calls are not in these figures.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from agent import daemon
from agent.collector import GC_THRESHOLDS
from agent.config import Config, MapSizes, NodeContext
from agent.ebpf.abi import MAPS, HandoverMode, MapSpec
from agent.ebpf.attach import HandoverState
from agent.ebpf.maps import MapWriter
from agent.ebpf.proxier import EbpfProxier, StartSteps
from agent.ebpf.upgrade import Upgrade
from agent.kube.reflector import Reflector, WatchSettings
from agent.kube.resources import Resource
from agent.model.tracker import ProxyModel
from agent.model.types import NodeInfo
from agent.sources.base import Event, Kind, ObjectEvent, Synced
from agent.takeover.into_ebpf import KernelTakeover
from lab.fakeapi.objects import scale_objects

NODE = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")


class KernelMap:
    """A service map as the kernel holds it: raw bytes by key, written and read in batches.

    The kernel keeps a map's entries outside the agent's memory; here they are in the process, so
    they are kept as written, packed (about 20 bytes an entry, where a dict of bytes by key takes
    about 130), and the peak RSS is mostly the agent's own. A deletion turns them into that dict;
    `settle` (between the phases, unmeasured: a dump after it costs nothing more) drops what a
    later write of the same key replaced."""

    def __init__(self, spec: MapSpec, order: str = "hash") -> None:
        self.spec = spec
        self.order = order  # of a dump: "hash" (the kernel's: unrelated to the writes) or "written"
        self.ks, self.vs = ctypes.sizeof(spec.key), ctypes.sizeof(spec.value)
        self._keys, self._values = bytearray(), bytearray()
        self._data: dict[bytes, bytes] | None = None
        self._settled = True  # each key once in the packed bytes
        self.writes = 0

    def _dict(self) -> dict[bytes, bytes]:
        if self._data is None:
            ks, vs, keys, values = self.ks, self.vs, self._keys, self._values
            self._data = {
                bytes(keys[i * ks : (i + 1) * ks]): bytes(values[i * vs : (i + 1) * vs])
                for i in range(len(keys) // ks)
            }  # the last write of a key wins, as in the kernel
            self._keys, self._values = bytearray(), bytearray()
        return self._data

    def settle(self) -> None:
        """Back to packed bytes, each key once, in the dump's order."""
        if self._data is None and self._settled:
            return
        data = self._dict()
        items = list(data.items())
        if self.order == "hash":
            # A kernel hash map dumps bucket by bucket (jhash of the key): an order unrelated to
            # the writes'. Seeded, so two runs read the same order.
            random.Random(len(items)).shuffle(items)
        self._keys = bytearray(b"".join(k for k, _ in items))
        self._values = bytearray(b"".join(v for _, v in items))
        self._data = None
        self._settled = True

    def update_packed(self, keys: bytes, values: bytes) -> int:
        n, ks, vs = len(keys) // self.ks, self.ks, self.vs
        if self._data is None:
            self._keys += keys
            self._values += values
            self._settled = False
        else:
            self._data.update((keys[i * ks : (i + 1) * ks], values[i * vs : (i + 1) * vs]) for i in range(n))
        self.writes += n
        return n

    def update_raw(self, keys: Sequence[bytes], values: Sequence[bytes]) -> int:
        """The per-entry form of the batch write (the planner before packed writes)."""
        return self.update_packed(b"".join(keys), b"".join(values))

    def delete_raw(self, keys: Sequence[bytes]) -> None:
        self.delete_packed(b"".join(keys))

    def delete_packed(self, keys: bytes) -> None:
        data = self._dict()
        for i in range(0, len(keys), self.ks):
            data.pop(keys[i : i + self.ks], None)
            self.writes += 1

    def dump_raw(self) -> tuple[bytes, bytes]:
        self.settle()
        return bytes(self._keys), bytes(self._values)

    def items(self) -> list[tuple[Any, Any]]:
        """Every entry as ctypes objects (BpfMap.items)."""
        key_t, value_t = self.spec.key, self.spec.value
        return [(key_t.from_buffer_copy(k), value_t.from_buffer_copy(v)) for k, v in self._dict().items()]

    def capacity(self) -> int:
        return 1 << 24

    def lookup(self, key: Any) -> Any:
        return None  # the config maps: never written before

    def update(self, key: Any, value: Any, flags: Any = 0) -> None:
        return None


class _Datapath:
    def __init__(self, maps: Mapping[str, KernelMap]) -> None:
        self.maps = maps

    def load(self, maps_ready: Callable[[], None] | None = None, *, recompile: bool = True) -> None:
        if maps_ready is not None:
            maps_ready()

    def prog_fd(self, name: str) -> int:
        return -1

    def has_program(self, name: str) -> bool:
        return False

    def repair_pins(self) -> list[str]:
        return []

    def release_older_builds(self) -> list[str]:
        return []

    def set_handover(self, mode: HandoverMode) -> None:
        return None

    def handover_mode(self) -> HandoverMode:
        return HandoverMode.OFF

    def close(self) -> None:
        return None


class _Attacher:
    watching = True

    def attach_egress(self, node: NodeContext) -> None:
        return None

    def reconcile(
        self,
        node: NodeContext,
        *,
        full: bool = False,
        verify: bool = False,
        keep_external: bool = False,
        front: bool = False,
    ) -> None:
        return None

    def rehome(self) -> None:
        return None

    @property
    def fronts(self) -> dict[tuple[int, int], str]:
        return {}

    def handover_state(self) -> HandoverState:
        return HandoverState(own_front=False, other_front=False, older_behind=False)

    def start_watcher(self, timeout: float = 5.0) -> None:
        return None

    def stop_watcher(self) -> bool:
        return True

    @property
    def xdp_wanted(self) -> dict[int, str]:
        return {}

    def use_programs(self, prog_fds: Mapping[str, int], ports: MapWriter) -> None:
        return None


def start_steps(config: Config) -> StartSteps:
    """The agent's steps around the first attach (agent.ebpf.proxier.default_start_steps) on a node
    whose nf_conntrack holds no flow to carry and no kube-proxy rules: what they cost with nothing
    to do (at 50,000 Services the takeover's index of every frontend and backend was once the
    agent's peak memory, 250 MiB above its steady state)."""
    takeover = KernelTakeover(
        config,
        dump=lambda netns: [],
        addresses=lambda netns: frozenset(),
        remove_rules=lambda config: None,
        sysctl=lambda netns, path, value: None,
        read_sysctl=lambda netns, path: None,
    )
    return StartSteps([Upgrade(config.pin_path), takeover])


class _Response:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, amt: int, decode_content: bool = True) -> Any:
        return iter(())

    def release_conn(self) -> None:
        return None

    def close(self) -> None:
        return None


class _Server:
    """The list call as lab/fakeapi answers it: a list at resourceVersion=0 whole (the watch
    cache), any other in pages of 500; the watch after it stops the reflector."""

    def __init__(self, lists: tuple[bytes, list[bytes]], stopping: threading.Event) -> None:
        (self.whole, self.todo), self.stopping = lists, stopping

    def __call__(self, **kw: Any) -> _Response:
        if kw.get("watch"):
            self.stopping.set()
            return _Response(b"")
        if kw.get("resource_version") == "0" and not kw.get("_continue"):
            return _Response(self.whole)
        return _Response(self.todo.pop(0))


def pages(objects: list[dict[str, Any]], kind: str, size: int = 500) -> tuple[bytes, list[bytes]]:
    """The list of `kind` a server sends whole, and in pages (items without kind/apiVersion, as
    upstream)."""
    items = [o for o in objects if o["kind"] == kind]
    out = []
    for i, obj in enumerate(items):
        obj["metadata"].update(
            uid=f"{kind}-{i:08d}", resourceVersion=str(10 + i), creationTimestamp="2026-01-01T00:00:00Z"
        )
    items = [{k: v for k, v in obj.items() if k not in ("kind", "apiVersion")} for obj in items]
    for start in range(0, len(items), size):
        meta: dict[str, Any] = {"resourceVersion": "100000"}
        if start + size < len(items):
            meta["continue"] = f"c{start}"
        out.append(
            orjson.dumps({"kind": f"{kind}List", "metadata": meta, "items": items[start : start + size]})
        )
    whole = orjson.dumps({"kind": f"{kind}List", "metadata": {"resourceVersion": "100000"}, "items": items})
    return whole, out


def proxier(maps: Mapping[str, KernelMap], snapshot_dir: str | None = None) -> EbpfProxier:
    """`snapshot_dir`: where its `close` leaves the planner (agent.ebpf.snapshot), as the agent's."""

    def datapath(pin_path: str, sizes: MapSizes) -> _Datapath:
        return _Datapath(maps)

    return EbpfProxier(
        # the sync measured, not the socket programs (there is no kernel program here)
        Config(hostname="node1", pin_path="/nonexistent", socket_lb=False),
        # its KernelMap counts writes and is only the part of MapWriter the sync calls
        datapath_factory=datapath,  # type: ignore[arg-type]
        attacher_factory=lambda config, fds, ports: _Attacher(),
        sysctl_writer=lambda netns, path, value: None,
        sysctl_reader=lambda netns, path: "32768\t60999",
        sizes_reader=lambda pin_path: {},
        upgrade_factory=start_steps,
        xdp_devices_reader=lambda config, ipv6: {},  # no device to read: XDP is not what is measured
        ipv6=False,
        snapshot_dir=snapshot_dir,
    )


def vm(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def timed(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def run(services: int, endpoints: int, dump_order: str = "hash", varied: bool = False) -> dict[str, float]:
    gc.set_threshold(*GC_THRESHOLDS)
    objects = scale_objects(services, endpoints, varied)
    by_kind = {kind: pages(objects, kind) for kind in ("Service", "EndpointSlice")}
    del objects
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    base = vm("VmRSS")
    model = ProxyModel(NodeInfo("node1"))

    # The agent reads each object on the source's thread (daemon._read); an agent from before
    # that change (to measure it with the same tool) hands the model the decoded object.
    read = getattr(daemon, "_read", lambda event, hostname: event)

    def deliver(events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, Synced):
                continue
            got = read(event, "node1")
            record = getattr(got, "record", None)
            if isinstance(got, ObjectEvent):
                record = got.obj
            if got.kind is Kind.SERVICE:
                model.set_service(got.key, record)
            elif got.kind is Kind.ENDPOINT_SLICE:
                model.set_slice(got.key, record)

    def lists() -> None:
        for kind, todo in (
            (Kind.SERVICE, by_kind["Service"]),
            (Kind.ENDPOINT_SLICE, by_kind["EndpointSlice"]),
        ):
            stopping = threading.Event()
            Reflector(
                Resource(kind, "v1", _Server((todo[0], list(todo[1])), stopping)),
                deliver,
                WatchSettings(),
                stopping,
            ).run()

    maps = {role: KernelMap(spec, dump_order) for role, spec in MAPS.items()}
    gc.disable()  # as the agent's start does until its first full sync (agent.collector.StartHold)
    out = {"lists": timed(lists), "commit": timed(model.commit)}
    first = proxier(maps)
    out["first sync"] = timed(lambda: first.sync(model.state, NODE, None))
    gc.enable()
    out["peak MiB"] = vm("VmHWM") - base
    out["entries"] = sum(m.writes for m in maps.values())
    first.close()  # a restart is a new process: the first planner goes
    gc.collect()
    for m in maps.values():
        m.settle()
        m.writes = 0
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    held = vm("VmRSS")
    again = proxier(maps)
    gc.disable()
    out["restart"] = timed(lambda: again.sync(model.state, NODE, None))
    gc.enable()
    out["restart writes"] = sum(m.writes for m in maps.values())
    out["restart MiB"] = vm("VmHWM") - held
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.firstsync", description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument(
        "--dump-order",
        choices=("hash", "written"),
        default="hash",
        help="the order the restart reads the maps back in: a hash map's (the kernel's), or as written",
    )
    ap.add_argument(
        "--objects",
        choices=("same", "varied"),
        default="same",
        help="same: one port list for all Services, one for all slices, trigger times in whole "
        "seconds (the best case for the parser's memos); varied: a port per Service, every 20th a "
        "NodePort, a nanosecond trigger time per slice (their worst case)",
    )
    a = ap.parse_args(argv)
    out = run(a.services, a.endpoints, a.dump_order, a.objects == "varied")
    total = out["lists"] + out["commit"] + out["first sync"]
    print(
        f"{a.services:,} services x {a.endpoints} endpoints ({a.objects} objects), CPU seconds: "
        f"lists {out['lists']:.2f} "
        f"(decode, reconcile, read into records), commit {out['commit']:.2f}, first sync "
        f"{out['first sync']:.2f} ({out['entries']:,.0f} entries written); lists to synced "
        f"{total:.2f}; restart sync {out['restart']:.2f} ({out['restart writes']:,.0f} entries "
        f"written); peak RSS above the start {out['peak MiB']:.0f} MiB (the maps' bytes included), the "
        f"restart's own {out['restart MiB']:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
