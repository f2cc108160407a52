"""Type ids of the running kernel's BTF (/sys/kernel/btf/vmlinux), for programs that name a kernel
function: an iterator's target (`bpf_iter_udp`, its attach_btf_id) and a kfunc it calls
(`bpf_sock_destroy`, the imm of the call).

Only what that needs: the header, the string section, and a walk over the type records that
knows each kind's length (include/uapi/linux/btf.h), collecting the FUNC records' names. Reading
the whole file takes about 0.3 s here; it is done once per load of the programs that need it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

VMLINUX = Path("/sys/kernel/btf/vmlinux")
BTF_MAGIC = 0xEB9F

# BTF_KIND_* and the bytes that follow a kind's 12-byte `struct btf_type` (vlen = its member count)
KIND_FUNC = 12
_EXTRA_FIXED = {1: 4, 3: 12, 14: 4, 17: 4}  # INT, ARRAY, VAR, DECL_TAG
_EXTRA_PER_VLEN = {
    4: 12,
    5: 12,
    6: 8,
    13: 8,
    15: 12,
    19: 12,
}  # STRUCT, UNION, ENUM, FUNC_PROTO, DATASEC, ENUM64

_HEADER = struct.Struct("<HBBIIIII")
_TYPE = struct.Struct("<III")


class BtfError(RuntimeError):
    """The kernel's BTF could not be read, or lacks a type that is needed."""


def func_ids(data: bytes, names: Iterable[str]) -> dict[str, int]:
    """Type ids of the FUNC records named `names` in the BTF blob `data` (those found)."""
    wanted = set(names)
    if len(data) < _HEADER.size:
        raise BtfError("BTF too short for its header")
    magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = _HEADER.unpack_from(data)
    if magic != BTF_MAGIC:
        raise BtfError(f"not BTF (magic {magic:#x})")
    types = memoryview(data)[hdr_len + type_off : hdr_len + type_off + type_len]
    strings = data[hdr_len + str_off : hdr_len + str_off + str_len]
    found: dict[str, int] = {}
    off, type_id = 0, 0
    while off + _TYPE.size <= len(types) and len(found) < len(wanted):
        type_id += 1
        name_off, info, _size = _TYPE.unpack_from(types, off)
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        if kind == KIND_FUNC:
            end = strings.find(b"\0", name_off)
            name = strings[name_off:end].decode(errors="replace")
            if name in wanted:
                found[name] = type_id
        off += _TYPE.size + _EXTRA_FIXED.get(kind, 0) + _EXTRA_PER_VLEN.get(kind, 0) * vlen
    return found


def vmlinux_has(names: Iterable[str], path: Path = VMLINUX) -> set[str]:
    """Which of the kernel functions `names` the running kernel has (none when its BTF is unreadable:
    what needs them cannot be loaded without it either)."""
    try:
        data = path.read_bytes()
    except OSError:
        return set()
    return set(func_ids(data, names))


def vmlinux_func_ids(names: Iterable[str], path: Path = VMLINUX) -> dict[str, int]:
    """Type ids of kernel functions by name; BtfError names any that the kernel lacks."""
    wanted = list(names)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BtfError(f"cannot read the kernel's BTF at {path}: {exc.strerror}") from exc
    found = func_ids(data, wanted)
    missing = [n for n in wanted if n not in found]
    if missing:
        raise BtfError(f"the kernel's BTF has no function {', '.join(missing)}")
    return found
