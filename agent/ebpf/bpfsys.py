"""The bpf(2) system call through libc, for what the agent does with maps and pinned objects.

The long-running agent never compiles (a short-lived child does, `agent.ebpf.compile`), so it must
not need libbcc either: loading libbcc maps LLVM into the process, tens of MiB of resident memory
for nothing. It does load what the child compiled (agent.ebpf.link: BTF, maps, programs) and attaches the
socket programs through bpf_links (agent.ebpf.sockattach, sockterm).
These few commands are all the agent uses, each a thin wrapper over one `bpf()` call
with its `union bpf_attr` member packed by hand (layouts from include/uapi/linux/bpf.h; the kernel
accepts an attr shorter than its own union as long as unknown tail bytes are zero).

The functions mirror libbpf's low-level API (`bpf_map_lookup_elem`, `bpf_map_update_batch`, ...):
they return 0 (or an fd) on success and `-errno` on failure, so callers translate errors in one
place (agent.ebpf.maps).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from typing import Any

# enum bpf_cmd
MAP_CREATE = 0
MAP_LOOKUP_ELEM = 1
MAP_UPDATE_ELEM = 2
MAP_DELETE_ELEM = 3
MAP_GET_NEXT_KEY = 4
PROG_LOAD = 5
OBJ_PIN = 6
OBJ_GET = 7
PROG_GET_FD_BY_ID = 13
OBJ_GET_INFO_BY_FD = 15
BTF_LOAD = 18
PROG_QUERY = 16
BTF_GET_FD_BY_ID = 19
MAP_LOOKUP_BATCH = 24
MAP_UPDATE_BATCH = 26
MAP_DELETE_BATCH = 27
LINK_CREATE = 28
LINK_UPDATE = 29
LINK_GET_FD_BY_ID = 30
ITER_CREATE = 33
LINK_DETACH = 34

_SYSCALL_NR = {"x86_64": 321, "aarch64": 280}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# struct { __u32 map_fd; __u32 pad; __aligned_u64 key; __aligned_u64 value/next_key; __u64 flags; }
_ELEM = struct.Struct("=IIQQQ")
# struct { __aligned_u64 in_batch, out_batch, keys, values; __u32 count, map_fd; __u64 elem_flags, flags; }
_BATCH = struct.Struct("=QQQQIIQQ")
# struct { __aligned_u64 pathname; __u32 bpf_fd; __u32 file_flags; __s32 path_fd; __u32 pad; }
_OBJ = struct.Struct("=QIIiI")
# struct { __u32 bpf_fd; __u32 info_len; __aligned_u64 info; }
_INFO = struct.Struct("=IIQ")
# struct { __u32 map_type, key_size, value_size, max_entries, map_flags, inner_map_fd, numa_node;
#          char map_name[16]; __u32 map_ifindex, btf_fd, btf_key_type_id, btf_value_type_id,
#          btf_vmlinux_value_type_id; __u64 map_extra; }
_MAP_CREATE = struct.Struct("=IIIIIII16sIIIIIQ")
# The head of the BPF_PROG_LOAD member, up to attach_btf_id / attach_prog_fd:
# prog_type, insn_cnt, insns, license, log_level, log_size, log_buf, kern_version, prog_flags,
# prog_name[16], prog_ifindex, expected_attach_type, prog_btf_fd, func_info_rec_size, func_info,
# func_info_cnt, line_info_rec_size, line_info, line_info_cnt, attach_btf_id, attach_prog_fd
# (no line info; func_info only for a program that calls functions of its own, whose BTF it is)
_PROG_LOAD = struct.Struct("=IIQQIIQII16sIIIIQIIQIII")
FUNC_INFO_SIZE = 8  # struct bpf_func_info: insn_off, type_id
# link_create: prog_fd, target_fd, attach_type, flags, then (iterators) iter_info, iter_info_len
_LINK_CREATE = struct.Struct("=IIIIQI")
# link_create for tcx (Linux 6.6): prog_fd, target_ifindex, attach_type, flags, then
# tcx.relative_fd (or relative_id), a pad, tcx.expected_revision
_LINK_CREATE_TCX = struct.Struct("=IIIIIIQ")
# prog_query of a tcx hook: target_ifindex, attach_type, query_flags, attach_flags, prog_ids,
# count, pad, prog_attach_flags, link_ids, link_attach_flags, revision
_PROG_QUERY_TCX = struct.Struct("=IIIIQIIQQQQ")
# link_update: link_fd, new_prog_fd, flags, old_prog_fd
_LINK_UPDATE = struct.Struct("=IIII")
# iter_create: link_fd, flags; link_detach: link_fd
_ITER_CREATE = struct.Struct("=II")
_LINK_DETACH = struct.Struct("=I")
# prog_query: target_fd, attach_type, query_flags, attach_flags, prog_ids, prog_cnt
_PROG_QUERY = struct.Struct("=IIIIQI")
# struct { __aligned_u64 btf, btf_log_buf; __u32 btf_size, btf_log_size, btf_log_level; }
_BTF_LOAD = struct.Struct("=QQIII")
# struct { __u32 btf_id, next_id, open_flags; }
_GET_FD_BY_ID = struct.Struct("=III")
# struct bpf_btf_info { __aligned_u64 btf; __u32 btf_size, id; __aligned_u64 name; __u32 name_len,
#                       kernel_btf; }
_BTF_INFO = struct.Struct("=QIIQII")


def _nr() -> int:
    machine = platform.machine()
    if machine not in _SYSCALL_NR:
        raise OSError(f"bpf(2): unknown syscall number on {machine}")
    return _SYSCALL_NR[machine]


def _addr(buf: Any) -> int:
    """The address of a ctypes buffer or object (0 for None)."""
    return 0 if buf is None else ctypes.addressof(buf)


def _call(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    ret = int(_libc.syscall(_nr(), cmd, attr, len(attr.raw)))
    return ret if ret >= 0 else -ctypes.get_errno()


def _attr(layout: struct.Struct, *values: int | bytes) -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(layout.pack(*values), layout.size)


def map_lookup_elem(fd: int, key: Any, value: Any) -> int:
    return _call(MAP_LOOKUP_ELEM, _attr(_ELEM, fd, 0, _addr(key), _addr(value), 0))


def map_update_elem(fd: int, key: Any, value: Any, flags: int = 0) -> int:
    return _call(MAP_UPDATE_ELEM, _attr(_ELEM, fd, 0, _addr(key), _addr(value), flags))


def map_delete_elem(fd: int, key: Any) -> int:
    return _call(MAP_DELETE_ELEM, _attr(_ELEM, fd, 0, _addr(key), 0, 0))


def map_get_next_key(fd: int, key: Any, next_key: Any) -> int:
    return _call(MAP_GET_NEXT_KEY, _attr(_ELEM, fd, 0, _addr(key), _addr(next_key), 0))


def _batch(cmd: int, fd: int, in_batch: Any, out_batch: Any, keys: Any, values: Any, count: Any) -> int:
    """One batch command; `count` (a c_uint32) is updated with how many elements were processed."""
    attr = _attr(_BATCH, _addr(in_batch), _addr(out_batch), _addr(keys), _addr(values), count.value, fd, 0, 0)
    ret = _call(cmd, attr)
    count.value = _BATCH.unpack(attr.raw)[4]
    return ret


def map_lookup_batch(fd: int, in_batch: Any, out_batch: Any, keys: Any, values: Any, count: Any) -> int:
    return _batch(MAP_LOOKUP_BATCH, fd, in_batch, out_batch, keys, values, count)


def map_update_batch(fd: int, keys: Any, values: Any, count: Any) -> int:
    return _batch(MAP_UPDATE_BATCH, fd, None, None, keys, values, count)


def map_delete_batch(fd: int, keys: Any, count: Any) -> int:
    return _batch(MAP_DELETE_BATCH, fd, None, None, keys, None, count)


def obj_pin(fd: int, path: str) -> int:
    name = ctypes.create_string_buffer(os.fsencode(path))
    return _call(OBJ_PIN, _attr(_OBJ, _addr(name), fd, 0, 0, 0))


def obj_get(path: str) -> int:
    name = ctypes.create_string_buffer(os.fsencode(path))
    return _call(OBJ_GET, _attr(_OBJ, _addr(name), 0, 0, 0, 0))


def obj_get_info_by_fd(fd: int, info: Any) -> int:
    """Fill `info` (a ctypes Structure: the head of bpf_map_info or bpf_prog_info)."""
    attr = _attr(_INFO, fd, ctypes.sizeof(info), _addr(info))
    return _call(OBJ_GET_INFO_BY_FD, attr)


def prog_get_fd_by_id(prog_id: int) -> int:
    """An fd of the loaded program `prog_id` (needs CAP_SYS_ADMIN), or -errno."""
    return _call(PROG_GET_FD_BY_ID, _attr(_GET_FD_BY_ID, prog_id, 0, 0))


def map_create(
    map_type: int,
    key_size: int,
    value_size: int,
    max_entries: int,
    flags: int,
    name: str,
    btf_fd: int = 0,
    btf_key_type_id: int = 0,
    btf_value_type_id: int = 0,
) -> int:
    """A new map; its fd. BTF ids are used only with a `btf_fd` (0: a map without BTF)."""
    if not btf_fd:
        btf_key_type_id = btf_value_type_id = 0
    attr = _attr(
        _MAP_CREATE,
        map_type,
        key_size,
        value_size,
        max_entries,
        flags,
        0,
        0,
        name.encode()[:15],
        0,
        btf_fd,
        btf_key_type_id,
        btf_value_type_id,
        0,
        0,
    )
    return _call(MAP_CREATE, attr)


def prog_load(
    prog_type: int,
    insns: bytes,
    license: str,
    name: str,
    kern_version: int = 0,
    log: Any = None,
    *,
    expected_attach_type: int = 0,
    attach_btf_id: int = 0,
    log_level: int = 1,
    prog_btf_fd: int = 0,
    func_info: bytes = b"",
) -> int:
    """Load a program; its fd. `log` (a ctypes char buffer) receives the verifier's log when given,
    at `log_level` (1: the instructions walked, on failure; 4, BPF_LOG_STATS: only the totals,
    "processed N insns ... peak_states N" and "verification time N usec").
    `expected_attach_type`: the hook a cgroup or tracing program is for (the kernel wants it at
    load); `attach_btf_id`: an iterator's target, the BTF id of its bpf_iter_<target> function.
    `prog_btf_fd` and `func_info` (struct bpf_func_info records: instruction offset, FUNC type id in
    that BTF): the functions of a program that calls others (agent/ebpf/calls.py)."""
    code = ctypes.create_string_buffer(insns, len(insns))
    finfo = ctypes.create_string_buffer(func_info, len(func_info)) if func_info else None
    lic = ctypes.create_string_buffer(license.encode())
    attr = _attr(
        _PROG_LOAD,
        prog_type,
        len(insns) // 8,
        _addr(code),
        _addr(lic),
        log_level if log is not None else 0,
        len(log) if log is not None else 0,
        _addr(log),
        kern_version,
        0,
        name.encode()[:15],
        0,
        expected_attach_type,
        prog_btf_fd,
        FUNC_INFO_SIZE if func_info else 0,
        _addr(finfo),
        len(func_info) // FUNC_INFO_SIZE,
        0,
        0,
        0,
        attach_btf_id,
        0,
    )
    return _call(PROG_LOAD, attr)


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    """A bpf_link of `prog_fd` on `target_fd` (a cgroup directory; 0 for an iterator); fd or -errno."""
    return _call(LINK_CREATE, _attr(_LINK_CREATE, prog_fd, target_fd, attach_type, 0, 0, 0))


def tcx_link_create(prog_fd: int, ifindex: int, attach_type: int, flags: int = 0, relative: int = 0) -> int:
    """A tcx bpf_link of `prog_fd` on device `ifindex` of the caller's network namespace
    (BPF_TCX_INGRESS / BPF_TCX_EGRESS); `flags` BPF_F_BEFORE / BPF_F_AFTER place it next to
    `relative` (a link fd with BPF_F_LINK; none: first or last). fd or -errno."""
    return _call(LINK_CREATE, _attr(_LINK_CREATE_TCX, prog_fd, ifindex, attach_type, flags, relative, 0, 0))


def tcx_query(ifindex: int, attach_type: int, prog_ids: Any, link_ids: Any) -> tuple[int, int]:
    """Ids of the programs on one tcx hook of the caller's network namespace, in run order, and of
    their links (0: attached without a link), into two ctypes u32 arrays of one length:
    (ret, count). -EINVAL where the kernel has no tcx; -ENOENT, on kernels without the fix for it,
    for a device with neither tcx nor clsact (an empty hook)."""
    attr = _attr(
        _PROG_QUERY_TCX,
        ifindex,
        attach_type,
        0,
        0,
        _addr(prog_ids),
        len(prog_ids),
        0,
        0,
        _addr(link_ids),
        0,
        0,
    )
    ret = _call(PROG_QUERY, attr)
    return ret, _PROG_QUERY_TCX.unpack(attr.raw)[5]


def link_get_fd_by_id(link_id: int) -> int:
    """An fd of the bpf_link `link_id`, or -errno."""
    return _call(LINK_GET_FD_BY_ID, _attr(_GET_FD_BY_ID, link_id, 0, 0))


def link_update(link_fd: int, new_prog_fd: int) -> int:
    """Swap the program of a link in place (atomically: no moment without one)."""
    return _call(LINK_UPDATE, _attr(_LINK_UPDATE, link_fd, new_prog_fd, 0, 0))


def link_detach(link_fd: int) -> int:
    """Detach a link from its hook (the link object lives on, empty, while fds or pins hold it)."""
    return _call(LINK_DETACH, _attr(_LINK_DETACH, link_fd))


def iter_create(link_fd: int) -> int:
    """An iterator over the iterator link's target, in the caller's network namespace: an fd whose
    read() runs the program over every object."""
    return _call(ITER_CREATE, _attr(_ITER_CREATE, link_fd, 0))


def prog_query(target_fd: int, attach_type: int, ids: Any) -> tuple[int, int]:
    """Ids of the programs attached to a cgroup hook, into `ids` (a ctypes u32 array): (ret, count)."""
    attr = _attr(_PROG_QUERY, target_fd, attach_type, 0, 0, _addr(ids), len(ids))
    ret = _call(PROG_QUERY, attr)
    return ret, _PROG_QUERY.unpack(attr.raw)[5]


def btf_load(data: bytes, log: Any = None) -> int:
    """Load raw BTF (types and strings); its fd. `log` (a ctypes char buffer, at least 128 bytes)
    receives the kernel's BTF checker log when given, as prog_load's does the verifier's."""
    buf = ctypes.create_string_buffer(data, len(data))
    size = len(log) if log is not None else 0
    return _call(BTF_LOAD, _attr(_BTF_LOAD, _addr(buf), _addr(log), len(data), size, 1 if size else 0))


def btf_get_fd_by_id(btf_id: int) -> int:
    """An fd of the BTF object with this id (CAP_SYS_ADMIN)."""
    return _call(BTF_GET_FD_BY_ID, _attr(_GET_FD_BY_ID, btf_id, 0, 0))


def btf_data(fd: int) -> bytes | int:
    """The raw BTF of a BTF object fd, or -errno."""
    size = 0
    for _ in range(2):  # the first call learns the size, the second copies
        buf = ctypes.create_string_buffer(size) if size else None
        info = ctypes.create_string_buffer(_BTF_INFO.pack(_addr(buf), size, 0, 0, 0, 0), _BTF_INFO.size)
        ret = _call(OBJ_GET_INFO_BY_FD, _attr(_INFO, fd, _BTF_INFO.size, _addr(info)))
        if ret < 0:
            return ret
        have = _BTF_INFO.unpack(info.raw)[1]
        if buf is not None and have <= size:
            return buf.raw[:have]
        size = have
    return -errno.EAGAIN  # the object grew between the two calls: not a BTF object of a program


class MapInfo(ctypes.Structure):
    """struct bpf_map_info up to its BTF ids (what the map-writing and compile code read of a map;
    the kernel fills what fits)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
        ("ifindex", ctypes.c_uint32),
        ("btf_vmlinux_value_type_id", ctypes.c_uint32),
        ("netns_dev", ctypes.c_uint64),
        ("netns_ino", ctypes.c_uint64),
        ("btf_id", ctypes.c_uint32),
        ("btf_key_type_id", ctypes.c_uint32),
        ("btf_value_type_id", ctypes.c_uint32),
    ]


class ProgInfo(ctypes.Structure):
    """struct bpf_prog_info up to its name (what the XDP, tcx and compile code read of a program)."""

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
        ("name", ctypes.c_char * 16),
    ]
