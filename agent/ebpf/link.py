"""Load a compiled object (agent.ebpf.bpfobject) against the maps pinned in one directory.

What bcc's BPF_TABLE_PINNED did at compile time, done at load time so one compile serves every
pin directory (libbpf's pinned-map reuse works the same way):

* a map the agent pins (`pinned`, the registry's names) is opened from `<pin_path>/<name>` when it
  exists and must then be exactly the map the object would create (type, key and value size,
  max_entries, flags: `LinkError` naming both otherwise, never a silent reuse of another shape);
  when missing it is created, with the object's BTF, and pinned there. max_entries is the load's
  (`sizes`, by map name) where it gives one: the object declares a placeholder for the maps sized at
  load (agent/ebpf/loader.py compile_cflags), so one compile serves every size;
* any other map of the object (the programs' scratch memory) is created for this load alone;
* each program of `programs` (default: every one of the object) gets the bpf_loop callback its
  ProgSpec names linked in (agent/ebpf/calls.py), those maps' fds written into its
  instructions, is loaded as its ProgSpec says (agent/ebpf/programs.py: the hook of a socket
  program, an iterator's target, kfunc calls patched in), and is pinned at the path
  `prog_path(name)` gives (replacing an older pin of the same name);
* each program array (agent/ebpf/programs.py TAIL_CALLS) gets its programs and is pinned at
  `prog_path(its name)` too: the kernel empties a program array whose last user reference goes,
  and a pin is one that outlives this process; so is each map of the build the agent writes
  (BUILD_MAPS: the hand-over mode), to be reached when the build is reused.

The map fds are closed at the end: the programs and the pins hold the maps. The caller owns the
returned program fds.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any, TypedDict

from agent.ebpf import bpfsys
from agent.ebpf.bpfobject import BpfObject, FuncDef, MapDef, ObjectError, relocate
from agent.ebpf.btf import BtfError, vmlinux_func_ids
from agent.ebpf.calls import func_btf, link_callback
from agent.ebpf.kfunc import patch_kfunc_calls
from agent.ebpf.maps import map_info
from agent.ebpf.programs import BUILD_MAPS, PROGRAMS, TAIL_CALLS, ProgSpec

log = logging.getLogger(__name__)

VERIFIER_LOG_BYTES = 1 << 20  # asked for only when a load failed, to say why
BTF_LOG_BYTES = 1 << 16  # likewise; a function BTF is a few hundred bytes, its log a few lines


class LinkError(RuntimeError):
    """The object could not be loaded against this pin directory."""


class PinnedMapMismatch(LinkError):
    """A pinned map is not the map the object would create."""


def mismatches(want: MapDef, fd: int) -> list[str]:
    """How the live map behind `fd` differs from `want` ([] when it is that map's shape)."""
    info = map_info(fd)
    have = {
        "type": info.type,
        "key_size": info.key_size,
        "value_size": info.value_size,
        "max_entries": info.max_entries,
        "flags": info.flags,
    }
    return [f"{k} is {v}, expected {getattr(want, k)}" for k, v in have.items() if v != getattr(want, k)]


def _create(m: MapDef, btf_fd: int) -> int:
    args = (m.type, m.key_size, m.value_size, m.max_entries, m.flags, m.name)
    fd = bpfsys.map_create(*args, btf_fd, m.btf_key_type_id, m.btf_value_type_id) if btf_fd > 0 else -1
    if fd < 0:
        fd = bpfsys.map_create(*args)  # a kernel refusing the BTF still gets a working map
    if fd < 0:
        raise LinkError(f"creating map {m.name}: {os.strerror(-fd)}")
    return fd


def _open_or_create(m: MapDef, path: str, btf_fd: int) -> int:
    fd = bpfsys.obj_get(path)
    if fd >= 0:
        diffs = mismatches(m, fd)
        if diffs:
            os.close(fd)
            raise PinnedMapMismatch(f"{path}: " + ", ".join(diffs))
        return fd
    if fd != -errno.ENOENT:  # missing: create it; anything else is not ours to paper over
        raise LinkError(f"opening pinned map {path}: {os.strerror(-fd)}")
    fd = _create(m, btf_fd)
    ret = bpfsys.obj_pin(fd, path)
    if ret < 0:
        os.close(fd)
        raise LinkError(f"pinning map {m.name} at {path}: {os.strerror(-ret)}")
    return fd


class LoadAttrs(TypedDict):
    """The load attributes of a program's spec, spread into bpfsys.prog_load as they are: a key
    added here reaches the kernel, or mypy names the prog_load parameter it lacks."""

    expected_attach_type: int
    attach_btf_id: int


def load_insns(spec: ProgSpec, name: str, insns: bytes) -> tuple[bytes, LoadAttrs]:
    """The instructions and load attributes of a program as its spec says: kfunc calls patched in
    (agent/ebpf/kfunc.py: bcc 0.26 cannot emit one), the hook it is loaded for, an iterator's
    target. LinkError when the running kernel lacks a function it calls or a marker has no call."""
    wanted = [fn for _, fn in spec.kfuncs] + ([f"bpf_iter_{spec.iter_target}"] if spec.iter_target else [])
    try:
        ids = vmlinux_func_ids(wanted) if wanted else {}
    except BtfError as e:
        raise LinkError(f"loading program {name}: {e}") from e
    if spec.kfuncs:
        insns, patched = patch_kfunc_calls(insns, {mark: ids[fn] for mark, fn in spec.kfuncs})
        unused = [fn for mark, fn in spec.kfuncs if not patched[mark]]
        if unused:
            raise LinkError(f"{name}: no call of {', '.join(unused)} to patch")
    attrs = LoadAttrs(
        expected_attach_type=max(spec.attach_type, 0),
        attach_btf_id=ids[f"bpf_iter_{spec.iter_target}"] if spec.iter_target else 0,
    )
    return insns, attrs


def callback_of(obj: BpfObject, spec: ProgSpec) -> FuncDef | None:
    """The callback to link into a program of `spec`: the one it names, in a build with bpf_loop
    callbacks (ObjectError if the build lacks it); none in a build without (EKP_SNAT_BPF_LOOP=0,
    agent/ebpf/snatloop.py), where the same program walks in a bounded loop and an unresolved
    reference in it is then refused like any other (link_callback)."""
    if not obj.bpf_loop or not spec.callback:
        return None
    return obj.function(spec.callback)


def _load_func_btf(name: str, build: str, btf: bytes) -> int:
    """The fd of a linked program's function BTF (calls.func_btf); LinkError with the kernel's BTF
    log when refused (loaded again with a log buffer, as a refused program is)."""
    fd = bpfsys.btf_load(btf)
    if fd >= 0:
        return fd
    buf = ctypes.create_string_buffer(BTF_LOG_BYTES)
    again = bpfsys.btf_load(btf, log=buf)
    if again >= 0:
        return again
    text = buf.value.decode(errors="replace").strip()
    raise LinkError(
        f"loading program {name} (build {build}): the kernel refused the BTF of its functions "
        f"(agent/ebpf/calls.py func_btf): {os.strerror(-fd)}\n{text[-4000:]}"
    )


def load_program(obj: BpfObject, name: str, fds: Sequence[int], log: Any = None, log_level: int = 1) -> int:
    """BPF_PROG_LOAD of program `name` of `obj` with the map fds `fds` (by map index): its bpf_loop
    callback linked in with the BTF that needs (agent/ebpf/calls.py), kfunc calls patched, the
    attributes of its spec (load_insns). The fd, or -errno (the verifier's log in `log` when given).
    LinkError when it cannot be linked."""
    prog = obj.program(name)
    spec = PROGRAMS.get(name, ProgSpec(prog.type))
    try:
        linked = link_callback(prog, callback_of(obj, spec))
    except ObjectError as e:
        raise LinkError(f"linking program {name} (build {obj.build}): {e}") from e
    insns, attrs = load_insns(spec, name, relocate(linked.prog, fds))
    btf_fd, func_info = -1, b""
    if linked.func_info:
        btf, func_info = func_btf(linked.func_info)
        btf_fd = _load_func_btf(name, obj.build, btf)
    try:
        return bpfsys.prog_load(
            prog.type,
            insns,
            obj.license,
            name,
            obj.kern_version,
            log,
            log_level=log_level,
            prog_btf_fd=max(btf_fd, 0),
            func_info=func_info,
            **attrs,
        )
    finally:
        if btf_fd >= 0:
            os.close(btf_fd)


def _load(obj: BpfObject, name: str, fds: list[int]) -> int:
    fd = load_program(obj, name, fds)
    if fd >= 0:
        return fd
    # Again with the verifier's log, for the message (as libbpf does).
    buf = ctypes.create_string_buffer(VERIFIER_LOG_BYTES)
    again = load_program(obj, name, fds, log=buf)
    if again >= 0:
        return again
    text = buf.value.decode(errors="replace").strip()
    raise LinkError(f"loading program {name} (build {obj.build}): {os.strerror(-fd)}\n{text[-4000:]}")


def _fill_tail_calls(name: str, fd: int, progs: dict[str, int], path: str) -> None:
    """Program array `name` (map fd `fd`) holding its programs at their indexes, pinned at `path`.
    A program the build lacks leaves its slot empty: the caller of the tail call goes on without."""
    for index, prog in enumerate(TAIL_CALLS[name]):
        if prog not in progs:
            continue
        ret = bpfsys.map_update_elem(fd, ctypes.c_uint32(index), ctypes.c_uint32(progs[prog]))
        if ret < 0:
            raise LinkError(f"putting {prog} into program array {name}: {os.strerror(-ret)}")
    if os.path.exists(path):
        os.unlink(path)
    ret = bpfsys.obj_pin(fd, path)
    if ret < 0:
        raise LinkError(f"pinning program array {name} at {path}: {os.strerror(-ret)}")


def _pin_build_map(name: str, fd: int, path: str) -> None:
    """A map of the build the agent writes (BUILD_MAPS) pinned at `path`, as its programs are."""
    if os.path.exists(path):
        os.unlink(path)
    ret = bpfsys.obj_pin(fd, path)
    if ret < 0:
        raise LinkError(f"pinning map {name} at {path}: {os.strerror(-ret)}")


def verifier_threads(cpus: int) -> int:
    """How many programs to load at once: every CPU but one. The verifier runs in the loading
    thread's kernel context and bpf() releases the GIL, so programs verify side by side; the CPU
    left is the agent's own, whose Python (one GIL) lists the API server and plans the first sync
    meanwhile. On 2 vCPUs that is one at a time: side by side there, the lists took 1.7 s instead
    of 1.1 to 1.4 and the first sync came later on a quiet machine, though sooner under load."""
    return max(1, cpus - 1)


def link(
    obj: BpfObject,
    pin_path: str,
    pinned: Collection[str],
    prog_path: Callable[[str], str],
    maps_pinned: Callable[[], None] | None = None,
    threads: int | None = None,
    sizes: Mapping[str, int] | None = None,
    programs: Collection[str] | None = None,
) -> dict[str, int]:
    """Open or create the maps (max_entries from `sizes` where it names the map, else the
    object's), load and pin the programs of `obj` named in `programs` (all by default); the program
    fds by name. A program array keeps an empty slot for a program left out.
    `maps_pinned` is called once every pinned map is there, before the first program is loaded
    (the verifier takes seconds: the caller can fill the maps meanwhile). The programs are loaded
    by `threads` threads, the largest first (default: verifier_threads)."""
    missing = sorted(set(pinned) - {m.name for m in obj.maps})
    if missing:
        raise LinkError(f"build {obj.build} declares no map {', '.join(missing)}")
    absent = sorted(set(programs or ()) - {p.name for p in obj.programs})
    if absent:
        raise LinkError(f"build {obj.build} has no program {', '.join(absent)}")
    sizes = sizes or {}
    maps = [replace(m, max_entries=sizes[m.name]) if m.name in sizes else m for m in obj.maps]
    chosen = [p for p in obj.programs if programs is None or p.name in programs]
    btf_fd = -1
    if obj.btf:
        btf_fd = bpfsys.btf_load(obj.btf)
        if btf_fd < 0:
            log.warning(
                "the kernel refused the data path's BTF (%s): maps created now lack field names in "
                "bpftool dumps",
                os.strerror(-btf_fd),
            )
    fds: list[int] = []
    progs: dict[str, int] = {}
    ok = False
    try:
        for m in maps:
            if m.name in pinned:
                fds.append(_open_or_create(m, os.path.join(pin_path, m.name), btf_fd))
            else:
                fds.append(_create(m, btf_fd))
        if maps_pinned is not None:
            maps_pinned()
        order = sorted(chosen, key=lambda p: -len(p.insns))
        workers = verifier_threads(len(os.sched_getaffinity(0))) if threads is None else threads
        with ThreadPoolExecutor(
            max_workers=max(1, min(len(order), workers)), thread_name_prefix="bpf-verifier"
        ) as pool:
            loads = {p.name: pool.submit(_load, obj, p.name, fds) for p in order}
            wait(loads.values())
        for name, done in loads.items():
            if done.exception() is None:
                progs[name] = done.result()
        for p in order:
            loads[p.name].result()  # the first error, once every loaded program is ours to close
        for p in chosen:
            fd = progs[p.name]
            path = prog_path(p.name)
            if os.path.exists(path):
                os.unlink(path)
            ret = bpfsys.obj_pin(fd, path)
            if ret < 0:
                raise LinkError(f"pinning program {p.name} at {path}: {os.strerror(-ret)}")
        for m, fd in zip(maps, fds, strict=True):
            if m.name in TAIL_CALLS:
                _fill_tail_calls(m.name, fd, progs, prog_path(m.name))
            elif m.name in BUILD_MAPS:
                _pin_build_map(m.name, fd, prog_path(m.name))
        ok = True
        return progs
    finally:
        for fd in fds:
            os.close(fd)
        if btf_fd >= 0:
            os.close(btf_fd)
        if not ok:
            for fd in progs.values():
                os.close(fd)
