"""Compile the data path in a short-lived child, once per build, and reuse what was compiled.

bcc compiles with clang on every `BPF(...)`: about 19 s of CPU on the VM of 2026-11-27, and the
process keeps ~200 MiB of LLVM resident afterwards. The agent therefore never compiles itself, and
compiles at most once per build on a machine:

* `build_id(...)` hashes what decides the programs' bytes: the C source with its headers inlined,
  the cflags that reach the C (the Maglev table size; map sizes are a placeholder, set at load:
  agent/ebpf/loader.py compile_cflags), the ABI version, the programs' names and prog types (the
  compile child records them in the object) and their bpf_loop callbacks, the object's format,
  the kernel release and its headers, and the bcc version. Not the pin directory nor the sizes:
  maps are bound and sized when the programs are loaded (agent.ebpf.link), so two agents with
  different pins or sizes share one build. The object holds every program of the source; a load
  chooses which (loader.Datapath.programs).
* `open_pinned_programs(...)` looks for programs pinned under a load's id (the build and the
  programs it loads: loader.Datapath.load_id; `ekp_prog_<id>_<name>` in the
  pin directory) whose maps are the maps pinned there now, plus the load's private (unpinned) maps
  such as its scratch memory; when they are all present nothing is loaded (an agent restart takes
  milliseconds).
* Otherwise the loader takes the compiled object from the machine's cache (agent.ebpf.objcache) or
  runs `python -m agent.ebpf.compile`, which compiles with bcc, prints the relocatable object
  (agent.ebpf.bpfobject: instructions, map references, map definitions, BTF) and exits, giving its
  memory back; the agent then loads it against its pinned maps and pins the programs. A program
  pinned by an older build is removed once the new one is pinned (an attached one lives on in its
  tc filter until the agent replaces it).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.ebpf import bpfobject, bpfsys
from agent.ebpf.bpfobject import BpfObject, FuncDef, MapDef, ObjectError, ProgDef, find_relocs
from agent.ebpf.programs import callbacks
from agent.ebpf.snatloop import build_has_bpf_loop

log = logging.getLogger(__name__)

PROG_PIN_PREFIX = "ekp_prog_"
COMPILE_TIMEOUT_S = 300


def prog_map_ids(fd: int) -> set[int]:
    """The ids of the maps a loaded program uses."""
    ids = (ctypes.c_uint32 * 64)()
    info = bpfsys.ProgInfo(nr_map_ids=64, map_ids=ctypes.addressof(ids))
    ret = bpfsys.obj_get_info_by_fd(fd, info)
    if ret < 0:
        raise OSError(-ret, f"bpf_obj_get_info(prog fd {fd}): {os.strerror(-ret)}")
    return {int(ids[i]) for i in range(min(info.nr_map_ids, 64))}


def bcc_version() -> str:
    """bcc's version, read from its package without importing it (importing loads libbcc)."""
    spec = importlib.util.find_spec("bcc")
    for where in (spec.submodule_search_locations or []) if spec else []:
        try:
            return Path(where, "version.py").read_text()
        except OSError:
            continue
    return "unknown"


# The files of a kernel's headers trees that change with every build of a kernel or of its
# headers package: the configuration as the compile reads it (autoconf.h, through bcc's
# `-include linux/kconfig.h`) and as kbuild keeps it (auto.conf), the release and version the
# compile sees, and the top Makefile of the source tree (Debian's -common package, which holds the
# headers proper: its VERSION/SUBLEVEL). Their sizes and mtimes, not their contents: a start
# stats 5 files rather than read ~400 KB (or the trees' tens of MB).
HEADER_MARKERS = {
    "build": (
        "include/generated/autoconf.h",
        "include/generated/utsrelease.h",
        "include/generated/uapi/linux/version.h",
        "include/config/auto.conf",
    ),
    "source": ("Makefile",),
}


def kernel_headers(modules: str = "") -> str:
    """The kernel headers bcc compiles against, for the build id: where they are (a package
    upgrade moves them) and each of HEADER_MARKERS' size and mtime (a headers package replaced in
    place, same paths: dpkg writes each file anew with the package's own mtime). A header edited
    in a hand-built tree without a rebuild that touches a marker keeps the id: `agent --cleanup`
    or removing the compile cache compiles again. `modules`: /lib/modules/<release> by default."""
    mod = modules or f"/lib/modules/{platform.release()}"
    parts = []
    for tree, markers in HEADER_MARKERS.items():
        root = os.path.realpath(f"{mod}/{tree}")
        parts.append(root)
        for rel in markers:
            try:
                st = os.stat(os.path.join(root, rel))
            except OSError:
                parts.append(f"{rel} -")
                continue
            parts.append(f"{rel} {st.st_size} {st.st_mtime_ns}")
    return "\0".join(parts)


def build_id(source: str, cflags: Sequence[str], abi_version: int, prog_types: Mapping[str, int]) -> str:
    """What decides the compiled programs, hashed (12 hex digits). `-I` flags are left out: the
    source has its local headers inlined, so where the tree lies does not matter. `prog_types`
    (program name -> BPF prog type) is in: the compile child records each program's type in the
    object, so a changed type must not load a cached object of the old one; so are the callbacks
    they pass (agent/ebpf/programs.py), the functions the child puts in the object beside them.
    So is the object's format (bpfobject.FORMAT): two trees of one C source but different formats
    would otherwise share a cache entry, each refusing the other's object and overwriting it."""
    h = hashlib.sha256()
    flags = "\0".join(f for f in cflags if not f.startswith("-I"))
    progs = "\0".join(f"{name}={kind}" for name, kind in sorted(prog_types.items()))
    progs += "\0" + "\0".join(callbacks(prog_types))
    parts = (source, flags, str(abi_version), progs, f"format {bpfobject.FORMAT}")
    for part in (*parts, platform.release(), kernel_headers(), bcc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]


def prog_pin(pin_path: str, build: str, name: str) -> str:
    return os.path.join(pin_path, f"{PROG_PIN_PREFIX}{build}_{name}")


def open_pinned_programs(
    pin_path: str, build: str, names: Sequence[str], map_ids: set[int], private_maps: Mapping[str, int]
) -> dict[str, int] | None:
    """Fds of the programs of `build`, when every one is pinned and uses only maps in `map_ids`
    (the maps pinned now) besides the unpinned ones of its own load (`private_maps`: how many, by
    program; none when unnamed); None when any is missing or stale.

    The private maps cannot be told apart by name without CAP_SYS_ADMIN (BPF_MAP_GET_FD_BY_ID), so
    they are counted: a program still using a map that was unpinned and recreated has one more
    unknown map than its load's own, and is loaded again."""
    fds: dict[str, int] = {}
    ok = False
    try:
        for name in names:
            fd = bpfsys.obj_get(prog_pin(pin_path, build, name))
            if fd < 0:
                return None
            fds[name] = fd
            if not map_ids or len(prog_map_ids(fd) - map_ids) > private_maps.get(name, 0):
                log.info("pinned program %s uses maps that are no longer pinned: loading it again", name)
                return None
        ok = True
        return fds
    finally:
        if not ok:
            for fd in fds.values():
                os.close(fd)


def remove_other_builds(pin_path: str, build: str, keep: Sequence[str] = ()) -> list[str]:
    """Unpin programs of other builds, but for their pins named in `keep`; their names.

    `keep` is for program arrays: the kernel empties a program array when its last user reference
    goes, and attached programs hold none, so an older build's array unpinned while its programs
    are still attached would turn its tail calls into fall-throughs until the new ones attach."""
    removed = []
    for entry in sorted(os.listdir(pin_path)):
        if entry.startswith(PROG_PIN_PREFIX) and not entry.startswith(f"{PROG_PIN_PREFIX}{build}_"):
            if any(entry.endswith(f"_{name}") for name in keep):
                continue
            os.unlink(os.path.join(pin_path, entry))
            removed.append(entry)
    return removed


def compile_in_child(
    entry_file: Path, cflags: Sequence[str], build: str, programs: Mapping[str, int]
) -> tuple[BpfObject, float]:
    """Run the compiler child; the object it compiled and its wall time. Raises RuntimeError with
    its stderr. The child is told the callbacks to put in the object, as it is told the programs:
    they are what build_id hashed here, where the child's own PROGRAMS could be another tree's."""
    bpf_loop = build_has_bpf_loop(cflags)
    args = {
        "entry_file": str(entry_file),
        "cflags": list(cflags),
        "build": build,
        "programs": dict(programs),
        "bpf_loop": bpf_loop,
        # None in a build whose walk is a bounded loop (EKP_SNAT_BPF_LOOP=0): the C defines none.
        "callbacks": callbacks(programs) if bpf_loop else [],
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "agent.ebpf.compile", json.dumps(args)],
        capture_output=True,
        timeout=COMPILE_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).decode(errors="replace").strip()
        raise RuntimeError(err[-4000:] or f"exit status {proc.returncode}")
    try:
        obj = BpfObject.from_json(proc.stdout)
    except ObjectError as e:
        raise RuntimeError(f"the compiler child printed no usable object: {e}") from e
    return obj, time.monotonic() - started


def _btf_of(fd: int) -> bytes:
    """The raw BTF bcc loaded for the maps (b"" when there is none or it cannot be read)."""
    info = bpfsys.MapInfo()
    if bpfsys.obj_get_info_by_fd(fd, info) < 0 or not info.btf_id:
        return b""
    btf_fd = bpfsys.btf_get_fd_by_id(info.btf_id)
    if btf_fd < 0:
        return b""
    try:
        data = bpfsys.btf_data(btf_fd)
    finally:
        os.close(btf_fd)
    return data if isinstance(data, bytes) else b""


def _child(raw: str) -> int:
    """The child: compile with bcc, print the relocatable object (JSON) on stdout, exit."""
    from bcc import BPF, lib

    # libbcc's table-by-index calls, which bcc's Python module does not declare.
    lib.bpf_num_tables.restype = ctypes.c_ulonglong
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
    lib.bpf_table_fd_id.restype = ctypes.c_int
    lib.bpf_table_fd_id.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]

    args = json.loads(raw)
    bpf = BPF(src_file=args["entry_file"].encode(), cflags=args["cflags"])
    try:
        maps: list[MapDef] = []
        map_of_fd: dict[int, int] = {}
        btf = b""
        for i in range(lib.bpf_num_tables(bpf.module)):
            fd = lib.bpf_table_fd_id(bpf.module, i)
            info = bpfsys.MapInfo()
            ret = bpfsys.obj_get_info_by_fd(fd, info)
            if ret < 0:
                name = lib.bpf_table_name(bpf.module, i)
                print(f"reading map {name!r}: {os.strerror(-ret)}", file=sys.stderr)
                return 1
            btf = btf or _btf_of(fd)
            map_of_fd[fd] = len(maps)
            maps.append(
                MapDef(
                    name=lib.bpf_table_name(bpf.module, i).decode(),
                    type=info.type,
                    key_size=info.key_size,
                    value_size=info.value_size,
                    max_entries=info.max_entries,
                    flags=info.map_flags,
                    btf_key_type_id=info.btf_key_type_id,
                    btf_value_type_id=info.btf_value_type_id,
                )
            )
        programs = []
        for name, prog_type in args["programs"].items():
            insns = bpf.dump_func(name.encode())
            programs.append(ProgDef(name, int(prog_type), insns, find_relocs(insns, map_of_fd)))
        # The bpf_loop callbacks they pass: functions of their own to bcc (non-static C functions),
        # linked into each program that names one when it is loaded (agent/ebpf/calls.py).
        functions = []
        for name in args["callbacks"]:
            insns = bpf.dump_func(name.encode())
            functions.append(FuncDef(name, insns, find_relocs(insns, map_of_fd)))
        obj = BpfObject(
            build=args["build"],
            license=lib.bpf_module_license(bpf.module).decode(),
            kern_version=int(lib.bpf_module_kern_version(bpf.module)),
            btf=btf,
            maps=tuple(maps),
            programs=tuple(programs),
            functions=tuple(functions),
            bpf_loop=bool(args["bpf_loop"]),
        )
    finally:
        bpf.cleanup()
    sys.stdout.buffer.write(obj.to_json())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.ebpf.compile", description=__doc__)
    p.add_argument("args", help="JSON: entry_file, cflags, build, programs, bpf_loop, callbacks")
    ns = p.parse_args(argv)
    return _child(ns.args)


if __name__ == "__main__":
    sys.exit(main())
