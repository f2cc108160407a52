"""Compile the data path in a short-lived child, pin its programs, and reuse them while they match.

bcc compiles with clang on every `BPF(...)`: about 3 s here, and the process keeps ~200 MiB of
LLVM resident afterwards. The agent therefore never compiles itself:

* `build_id(...)` hashes what decides the programs' bytes: the C source with its headers inlined,
  the cflags (pin directory, map sizes), the ABI version, the kernel release and the bcc version.
* `open_pinned_programs(...)` looks for programs pinned under that id (`ekp_prog_<id>_<name>` in the
  pin directory) whose maps are the maps pinned there now, plus the load's private (unpinned) maps
  such as its scratch memory; when they are all present, nothing is
  compiled (an agent restart takes milliseconds). Otherwise it runs `python -m agent.ebpf.compile`,
  which compiles with bcc, creates or re-adopts the pinned maps, loads and pins the programs, and
  exits, giving its memory back. A program pinned by an older build is removed once the new one is
  pinned (an attached one lives on in its tc filter until the agent replaces it).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.ebpf import bpfsys
from agent.ebpf.btf import vmlinux_func_ids
from agent.ebpf.kfunc import patch_kfunc_calls
from agent.ebpf.programs import ProgSpec

log = logging.getLogger(__name__)

PROG_PIN_PREFIX = "ekp_prog_"
COMPILE_TIMEOUT_S = 300


class _ProgInfo(ctypes.Structure):
    """The head of struct bpf_prog_info, up to the map ids."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
    ]


def prog_map_ids(fd: int) -> set[int]:
    """The ids of the maps a loaded program uses."""
    ids = (ctypes.c_uint32 * 64)()
    info = _ProgInfo(nr_map_ids=64, map_ids=ctypes.addressof(ids))
    ret = bpfsys.obj_get_info_by_fd(fd, info)
    if ret < 0:
        raise OSError(-ret, f"bpf_obj_get_info(prog fd {fd}): {os.strerror(-ret)}")
    return {int(ids[i]) for i in range(min(info.nr_map_ids, 64))}


def build_id(source: str, cflags: Sequence[str], abi_version: int) -> str:
    """What decides the compiled programs, hashed (12 hex digits)."""
    try:
        from importlib.metadata import version

        bcc_version = version("bcc")
    except Exception:
        bcc_version = "unknown"
    h = hashlib.sha256()
    for part in (source, "\0".join(cflags), str(abi_version), platform.release(), bcc_version):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]


def prog_pin(pin_path: str, build: str, name: str) -> str:
    return os.path.join(pin_path, f"{PROG_PIN_PREFIX}{build}_{name}")


def open_pinned_programs(
    pin_path: str, build: str, names: Sequence[str], map_ids: set[int], private_maps: int
) -> dict[str, int] | None:
    """Fds of the programs of `build`, when every one is pinned and uses only maps in `map_ids`
    (the maps pinned now) besides at most `private_maps` unpinned ones of its own load; None when
    any is missing or stale.

    The private maps cannot be told apart by name without CAP_SYS_ADMIN (BPF_MAP_GET_FD_BY_ID), so
    they are counted: a program still using a map that was unpinned and recreated has one more
    unknown map than its load's own, and is compiled again."""
    fds: dict[str, int] = {}
    ok = False
    try:
        for name in names:
            fd = bpfsys.obj_get(prog_pin(pin_path, build, name))
            if fd < 0:
                return None
            fds[name] = fd
            if not map_ids or len(prog_map_ids(fd) - map_ids) > private_maps:
                log.info("pinned program %s uses maps that are no longer pinned: compiling again", name)
                return None
        ok = True
        return fds
    finally:
        if not ok:
            for fd in fds.values():
                os.close(fd)


def remove_other_builds(pin_path: str, build: str) -> list[str]:
    """Unpin programs of other builds; their names."""
    removed = []
    for entry in sorted(os.listdir(pin_path)):
        if entry.startswith(PROG_PIN_PREFIX) and not entry.startswith(f"{PROG_PIN_PREFIX}{build}_"):
            os.unlink(os.path.join(pin_path, entry))
            removed.append(entry)
    return removed


def compile_in_child(
    entry_file: Path, cflags: Sequence[str], pin_path: str, build: str, programs: Mapping[str, ProgSpec]
) -> float:
    """Run the compiler child; returns its wall time. Raises RuntimeError with its stderr."""
    args = {
        "entry_file": str(entry_file),
        "cflags": list(cflags),
        "pin_path": pin_path,
        "build": build,
        "programs": {name: spec.as_json() for name, spec in programs.items()},
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "agent.ebpf.compile", json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=COMPILE_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr or proc.stdout).strip()[-4000:] or f"exit status {proc.returncode}")
    return time.monotonic() - started


def load_patched(
    prog_type: int,
    insns: bytes,
    license: bytes,
    name: str,
    attach_type: int,
    iter_target: str,
    kfuncs: Sequence[tuple[int, str]],
) -> int:
    """Load a program bcc compiled but cannot load itself (an iterator named as we name programs,
    kfunc calls patched in, agent/ebpf/kfunc.py); its fd. RuntimeError with the verifier's log."""
    wanted = [name for _, name in kfuncs] + ([f"bpf_iter_{iter_target}"] if iter_target else [])
    ids = vmlinux_func_ids(wanted)
    code, patched = patch_kfunc_calls(insns, {mark: ids[fn] for mark, fn in kfuncs})
    unused = [fn for mark, fn in kfuncs if not patched[mark]]
    if unused:
        raise RuntimeError(f"{name}: no call of {', '.join(unused)} to patch")
    target = ids[f"bpf_iter_{iter_target}"] if iter_target else 0
    kw = {"expected_attach_type": max(attach_type, 0), "attach_btf_id": target}
    fd = bpfsys.prog_load(prog_type, code, license, name, **kw)
    if fd < 0:
        log = ctypes.create_string_buffer(1 << 20)
        bpfsys.prog_load(prog_type, code, license, name, log=log, **kw)
        raise RuntimeError(
            f"loading {name}: {os.strerror(-fd)}\n{log.value.decode(errors='replace')[-4000:]}"
        )
    return fd


def _child(raw: str) -> int:
    """The child: compile with bcc, pin the programs, exit."""
    from bcc import BPF, libbcc

    args = json.loads(raw)
    bpf = BPF(src_file=args["entry_file"].encode(), cflags=args["cflags"])
    try:
        for name, spec in args["programs"].items():
            kfuncs = [(int(mark), str(fn)) for mark, fn in spec["kfuncs"]]
            if spec["iter"] or kfuncs:
                lib, fname = libbcc.lib, name.encode()
                start, size = (
                    lib.bpf_function_start(bpf.module, fname),
                    lib.bpf_function_size(bpf.module, fname),
                )
                insns = ctypes.string_at(start, size)
                license = lib.bpf_module_license(bpf.module)
                fd = load_patched(spec["type"], insns, license, name, spec["attach"], spec["iter"], kfuncs)
            else:
                fd = bpf.load_func(name.encode(), spec["type"], attach_type=spec["attach"]).fd
            path = prog_pin(args["pin_path"], args["build"], name)
            if os.path.exists(path):
                os.unlink(path)
            ret = bpfsys.obj_pin(fd, path)
            if ret < 0:
                print(f"pinning {name} at {path}: {os.strerror(-ret)}", file=sys.stderr)
                return 1
    finally:
        bpf.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.ebpf.compile", description=__doc__)
    p.add_argument("args", help="JSON: entry_file, cflags, pin_path, build, programs")
    ns = p.parse_args(argv)
    return _child(ns.args)


if __name__ == "__main__":
    sys.exit(main())
