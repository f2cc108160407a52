"""Reading and writing BPF maps: the only module that touches map contents.

`BpfMap` wraps one map file descriptor (usually opened from its pin with `BpfMap.open_pinned`)
and speaks in the ctypes types of `agent.ebpf.abi`: keys and values go in and come out as
`FrontendKey`, `CtEntry`, ... instances, checked against the map's `MapSpec`. The calls go
through the bpf(2) system call (`agent.ebpf.bpfsys`: lookup, update, delete, get_next_key and the
batch commands), never through libbcc, so the agent needs no compiler; batch calls fall back to loops on
map types without batch support (the LPM trie). Per-CPU maps (the stats map) are summed
across CPUs on lookup.

Errors become `MapError` (an OSError with the map's name in the message); a full map becomes
`MapFullError`, which names the flag that sizes it (`--bpf-fe-max`, ...).

`MapWriter` is the protocol the control plane programs against; `FakeMap` is its dict-backed
twin for unit tests (same flags semantics, same size limit, same exceptions), so planners and
backends are tested without root. Nothing here imports bcc.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any, Protocol

from agent.ebpf import bpfsys
from agent.ebpf.abi import CData, Config, Config6, ConfigSel, MapSpec, Stat, copy_struct, maglev_value

ENOTSUPP = 524  # the kernel's internal "operation not supported" for missing batch ops

# Kernel map types (enum bpf_map_type) and creation flags, by MapSpec.kind.
MAP_TYPES: dict[str, int] = {"hash": 1, "array": 2, "percpu_array": 6, "lru_hash": 9, "lpm_trie": 11}
MAP_FLAGS: dict[str, int] = {"lpm_trie": 1}  # BPF_F_NO_PREALLOC (required by the LPM trie)
_PERCPU_KINDS = frozenset({"percpu_array", "percpu_hash", "lru_percpu_hash"})
_ARRAY_KINDS = frozenset({"array", "percpu_array"})
_BATCH_KINDS = frozenset({"hash", "lru_hash", "array"})


class UpdateFlag(IntEnum):
    ANY = 0  # create or replace
    NOEXIST = 1  # create only
    EXIST = 2  # replace only


def size_flag(spec: MapSpec) -> str:
    """The agent flag that sets a map's size, as error messages name it."""
    return spec.size_flag


class MapError(OSError):
    """A BPF map operation failed; `errno` holds the kernel's error."""

    def __init__(self, name: str, op: str, err: int, hint: str = "") -> None:
        msg = f"BPF map {name}: {op} failed: {os.strerror(err)} (errno {err})"
        super().__init__(err, msg + (f"; {hint}" if hint else ""))


class MapFullError(MapError):
    """The map has no room for a new entry."""

    def __init__(self, spec: MapSpec, max_entries: int, op: str, err: int) -> None:
        hint = f"the map is full ({max_entries} entries): raise {size_flag(spec)}"
        super().__init__(spec.name, op, err, hint)
        self.spec = spec
        self.max_entries = max_entries


class MapWriter(Protocol):
    """What the control plane needs from a map; `BpfMap` and `FakeMap` both provide it."""

    @property
    def spec(self) -> MapSpec: ...

    def lookup(self, key: CData) -> CData | None: ...

    def update(self, key: CData, value: CData, flags: UpdateFlag = UpdateFlag.ANY) -> None: ...

    def delete(self, key: CData) -> bool: ...

    def items(self) -> list[tuple[CData, CData]]: ...

    def update_batch(self, entries: Sequence[tuple[CData, CData]]) -> None: ...

    def delete_batch(self, keys: Sequence[CData]) -> int: ...

    def items_raw(self) -> list[tuple[bytes, bytes]]: ...

    def dump_raw(self) -> tuple[bytes, bytes]: ...

    def update_raw(self, keys: Sequence[bytes], values: Sequence[bytes]) -> int: ...

    def delete_raw(self, keys: Sequence[bytes]) -> None: ...

    def update_packed(self, keys: bytes, values: bytes) -> int: ...

    def delete_packed(self, keys: bytes) -> None: ...

    def capacity(self) -> int:
        """max_entries, as the kernel reports it."""

    def count(self) -> int:
        """Entries in the map now; an array is always full (the kernel preallocates every slot)."""


def _check_type(spec: MapSpec, what: str, obj: object, want: type[Any]) -> None:
    if type(obj) is not want:
        raise TypeError(f"{spec.name}: {what} must be {want.__name__}, not {type(obj).__name__}")


_BATCH_BYTES = 4 << 20  # the largest value buffer of one batch lookup


def _full_error(err: int) -> bool:
    return err in (errno.E2BIG, errno.ENOSPC)


def _split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


# ---- the fake -----------------------------------------------------------------------------


class FakeMap:
    """A dict-backed `MapWriter` with the kernel's semantics: copies in and out, BPF_NOEXIST /
    BPF_EXIST, a size limit raising `MapFullError` (except LRU maps, which evict the oldest)."""

    def __init__(self, spec: MapSpec, max_entries: int | None = None) -> None:
        self.spec = spec
        # a size derived at start (default_size 0, the conntrack tables) gets a fixed stand-in
        self.max_entries = (spec.default_size or 65536) if max_entries is None else max_entries
        self._data: dict[bytes, tuple[CData, CData]] = {}

    def lookup(self, key: CData) -> CData | None:
        _check_type(self.spec, "key", key, self.spec.key)
        hit = self._data.get(bytes(key))
        return None if hit is None else copy_struct(hit[1])

    def update(self, key: CData, value: CData, flags: UpdateFlag = UpdateFlag.ANY) -> None:
        _check_type(self.spec, "key", key, self.spec.key)
        _check_type(self.spec, "value", value, self.spec.value)
        kb = bytes(key)
        exists = kb in self._data
        if flags == UpdateFlag.NOEXIST and exists:
            raise MapError(self.spec.name, "update", errno.EEXIST)
        if flags == UpdateFlag.EXIST and not exists:
            raise MapError(self.spec.name, "update", errno.ENOENT)
        if not exists and len(self._data) >= self.max_entries:
            if self.spec.kind != "lru_hash":
                raise MapFullError(self.spec, self.max_entries, "update", errno.E2BIG)
            del self._data[next(iter(self._data))]
        self._data[kb] = (copy_struct(key), copy_struct(value))

    def delete(self, key: CData) -> bool:
        _check_type(self.spec, "key", key, self.spec.key)
        return self._data.pop(bytes(key), None) is not None

    def items(self) -> list[tuple[CData, CData]]:
        return [(copy_struct(k), copy_struct(v)) for k, v in self._data.values()]

    def update_batch(self, entries: Sequence[tuple[CData, CData]]) -> None:
        for key, value in entries:
            self.update(key, value)

    def delete_batch(self, keys: Sequence[CData]) -> int:
        return sum(self.delete(key) for key in keys)

    def items_raw(self) -> list[tuple[bytes, bytes]]:
        return [(kb, bytes(v)) for kb, (_, v) in self._data.items()]

    def dump_raw(self) -> tuple[bytes, bytes]:
        return b"".join(self._data), b"".join(bytes(v) for _, v in self._data.values())

    def update_raw(self, keys: Sequence[bytes], values: Sequence[bytes]) -> int:
        """Writes in order; stops at the first entry that finds no room and returns the count."""
        for i, (kb, vb) in enumerate(zip(keys, values, strict=True)):
            try:
                self.update(self.spec.key.from_buffer_copy(kb), self.spec.value.from_buffer_copy(vb))
            except MapFullError:
                return i
        return len(keys)

    def delete_raw(self, keys: Sequence[bytes]) -> None:
        for kb in keys:
            self._data.pop(kb, None)

    def update_packed(self, keys: bytes, values: bytes) -> int:
        """`update_raw` of concatenated keys and values."""
        return self.update_raw(
            _split(keys, ct.sizeof(self.spec.key)), _split(values, ct.sizeof(self.spec.value))
        )

    def delete_packed(self, keys: bytes) -> None:
        self.delete_raw(_split(keys, ct.sizeof(self.spec.key)))

    def capacity(self) -> int:
        return self.max_entries

    def count(self) -> int:
        return self.max_entries if self.spec.kind in _ARRAY_KINDS else len(self._data)

    def __len__(self) -> int:
        return len(self._data)


# ---- the kernel ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MapInfo:
    """What the kernel says about a map (bpf_obj_get_info_by_fd)."""

    id: int
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


def _errno_of(ret: int) -> int:
    """bpfsys returns -errno."""
    return -ret if ret < 0 else errno.EIO


def possible_cpus() -> int:
    """Number of possible CPUs (the per-CPU value count), from /sys/devices/system/cpu/possible."""
    with open("/sys/devices/system/cpu/possible") as f:
        text = f.read().strip()
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def map_info(fd: int) -> MapInfo:
    info = bpfsys.MapInfo()
    ret = bpfsys.obj_get_info_by_fd(fd, info)
    if ret < 0:
        err = _errno_of(ret)
        raise OSError(err, f"bpf_obj_get_info(fd {fd}): {os.strerror(err)}")
    return MapInfo(
        id=info.id,
        type=info.type,
        key_size=info.key_size,
        value_size=info.value_size,
        max_entries=info.max_entries,
        flags=info.map_flags,
        name=info.name.decode(errors="replace"),
    )


def obj_get(path: str) -> int:
    """Opens a pinned BPF object; returns its fd."""
    fd = bpfsys.obj_get(path)
    if fd < 0:
        err = _errno_of(fd)
        raise OSError(err, f"bpf_obj_get({path}): {os.strerror(err)}", path)
    return fd


def obj_pin(fd: int, path: str) -> None:
    """Pins the BPF object behind `fd` at `path` (which must not exist)."""
    ret = bpfsys.obj_pin(fd, path)
    if ret < 0:
        err = _errno_of(ret)
        raise OSError(err, f"bpf_obj_pin({path}): {os.strerror(err)}", path)


class BpfMap:
    """One BPF map, by fd, with keys and values typed by its `MapSpec`."""

    def __init__(self, spec: MapSpec, fd: int, *, owns_fd: bool = True) -> None:
        self.spec = spec
        self.fd = fd
        self._owns_fd = owns_fd
        self._ncpus = possible_cpus() if spec.kind in _PERCPU_KINDS else 1
        self._info: MapInfo | None = None
        self._batch_supported = True

    @classmethod
    def open_pinned(cls, spec: MapSpec, pin_path: str) -> BpfMap:
        return cls(spec, obj_get(os.path.join(pin_path, spec.name)))

    def close(self) -> None:
        if self._owns_fd and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> BpfMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def info(self) -> MapInfo:
        if self._info is None:
            self._info = map_info(self.fd)
        return self._info

    @property
    def percpu(self) -> bool:
        return self.spec.kind in _PERCPU_KINDS

    # -- helpers

    def _error(self, op: str, err: int) -> MapError:
        if _full_error(err) and self.spec.kind not in _ARRAY_KINDS:
            return MapFullError(self.spec, self.info().max_entries, op, err)
        return MapError(self.spec.name, op, err)

    def _value_stride(self) -> int:
        size = ct.sizeof(self.spec.value)
        return (size + 7) & ~7 if self.percpu else size

    def _value_buf(self) -> ct.Array[ct.c_char]:
        return ct.create_string_buffer(self._value_stride() * self._ncpus)

    def _decode_value(self, raw: bytes) -> CData:
        """Per-CPU maps: the sum across CPUs (integer values only)."""
        if not self.percpu:
            return self.spec.value.from_buffer_copy(raw)
        stride = self._value_stride()
        if self.spec.value is not ct.c_uint64:
            raise TypeError(f"{self.spec.name}: per-CPU values are summed only for u64; use lookup_percpu")
        total = sum(int.from_bytes(raw[i * stride : i * stride + 8], "little") for i in range(self._ncpus))
        return ct.c_uint64(total & (2**64 - 1))

    def _encode_value(self, value: CData) -> bytes:
        """Per-CPU maps: the value on CPU 0 and zeros elsewhere, so the sum equals `value`."""
        raw = bytes(value)
        if not self.percpu:
            return raw
        stride = self._value_stride()
        return raw.ljust(stride, b"\0") + b"\0" * (stride * (self._ncpus - 1))

    # -- single elements

    def lookup(self, key: CData) -> CData | None:
        _check_type(self.spec, "key", key, self.spec.key)
        buf = self._value_buf()
        ret = bpfsys.map_lookup_elem(self.fd, key, buf)
        if ret < 0:
            err = _errno_of(ret)
            if err == errno.ENOENT:
                return None
            raise self._error("lookup", err)
        return self._decode_value(buf.raw)

    def lookup_percpu(self, key: CData) -> list[CData]:
        """Per-CPU maps: one value per possible CPU."""
        _check_type(self.spec, "key", key, self.spec.key)
        buf = self._value_buf()
        ret = bpfsys.map_lookup_elem(self.fd, key, buf)
        if ret < 0:
            raise self._error("lookup", _errno_of(ret))
        stride = self._value_stride()
        size = ct.sizeof(self.spec.value)
        raw = buf.raw
        value = self.spec.value
        return [value.from_buffer_copy(raw[i * stride : i * stride + size]) for i in range(self._ncpus)]

    def update(self, key: CData, value: CData, flags: UpdateFlag = UpdateFlag.ANY) -> None:
        _check_type(self.spec, "key", key, self.spec.key)
        _check_type(self.spec, "value", value, self.spec.value)
        raw = ct.create_string_buffer(self._encode_value(value))
        ret = bpfsys.map_update_elem(self.fd, key, raw, int(flags))
        if ret < 0:
            raise self._error("update", _errno_of(ret))

    def delete(self, key: CData) -> bool:
        """Deletes one entry; False when it was not there."""
        _check_type(self.spec, "key", key, self.spec.key)
        ret = bpfsys.map_delete_elem(self.fd, key)
        if ret < 0:
            err = _errno_of(ret)
            if err == errno.ENOENT:
                return False
            raise self._error("delete", err)
        return True

    # -- whole map

    def keys(self) -> list[CData]:
        """Every key, by bpf_get_next_key (a key deleted meanwhile restarts the walk: deduplicated)."""
        seen: dict[bytes, CData] = {}
        cur: CData | None = None
        nxt = self.spec.key()
        limit = 2 * self.info().max_entries + 16
        for _ in range(limit):
            ret = bpfsys.map_get_next_key(self.fd, cur, nxt)
            if ret < 0:
                err = _errno_of(ret)
                if err == errno.ENOENT:
                    break
                raise self._error("get_next_key", err)
            cur = copy_struct(nxt)
            seen.setdefault(bytes(cur), cur)
        return list(seen.values())

    def items(self) -> list[tuple[CData, CData]]:
        key_t, value_t = self.spec.key, self.spec.value
        if self.spec.kind in _BATCH_KINDS:
            batched = self._items_batch()
            if batched is not None:
                return [(key_t.from_buffer_copy(k), value_t.from_buffer_copy(v)) for k, v in batched]
        out = []
        for key in self.keys():
            value = self.lookup(key)
            if value is not None:  # deleted since the walk
                out.append((key, value))
        return out

    def items_raw(self) -> list[tuple[bytes, bytes]]:
        """Every entry as (key bytes, value bytes); per-CPU maps are not supported here."""
        if self.percpu:
            raise TypeError(f"{self.spec.name}: items_raw of a per-CPU map")
        if self.spec.kind in _BATCH_KINDS:
            batched = self._items_batch()
            if batched is not None:
                return batched
        out = []
        for key in self.keys():
            buf = self._value_buf()
            ret = bpfsys.map_lookup_elem(self.fd, key, buf)
            if ret >= 0:
                out.append((bytes(key), buf.raw[: ct.sizeof(self.spec.value)]))
        return out

    def _items_batch(self) -> list[tuple[bytes, bytes]] | None:
        """Every entry by bpf_lookup_batch; None when the kernel has no batch support for this map."""
        ksize, vsize = ct.sizeof(self.spec.key), ct.sizeof(self.spec.value)
        out: list[tuple[bytes, bytes]] = []
        for keys, values, count in self._batches():
            kraw, vraw = keys.raw, values.raw
            for i in range(count):
                out.append((kraw[i * ksize : (i + 1) * ksize], vraw[i * vsize : (i + 1) * vsize]))
        return out if self._batch_supported else None

    def dump_raw(self) -> tuple[bytes, bytes]:
        """Every key, and every value, each concatenated in the same order: what a caller decodes
        with `struct.iter_unpack` in one C loop (a 230,000-entry dump without per-entry slicing)."""
        if self.spec.kind in _BATCH_KINDS and not self.percpu:
            ksize, vsize = ct.sizeof(self.spec.key), ct.sizeof(self.spec.value)
            keys, values = [], []
            for kbuf, vbuf, count in self._batches():
                keys.append(kbuf.raw[: count * ksize])
                values.append(vbuf.raw[: count * vsize])
            if self._batch_supported:
                return b"".join(keys), b"".join(values)
        pairs = self.items_raw()
        return b"".join(k for k, _ in pairs), b"".join(v for _, v in pairs)

    def capacity(self) -> int:
        return self.info().max_entries

    def count(self) -> int:
        """Entries in the map now: arrays are always full; hashes are walked in batches, with
        per-chunk rather than per-entry Python work (250,000 entries in about 0.08 s, as
        test_bpf_metrics prints)."""
        if self.spec.kind in _ARRAY_KINDS:
            return self.info().max_entries
        if self.spec.kind in _BATCH_KINDS:
            total = sum(count for _, _, count in self._batches())
            if self._batch_supported:
                return total
        return len(self.keys())

    def _batches(self, chunk: int = 16384) -> Iterator[tuple[ct.Array[ct.c_char], ct.Array[ct.c_char], int]]:
        """(keys buffer, values buffer, entries in them) per bpf_lookup_batch call, buffers reused;
        sets `_batch_supported` False (and yields nothing) when the kernel cannot batch this map."""
        ksize, vsize = ct.sizeof(self.spec.key), ct.sizeof(self.spec.value)
        # values of 64 KiB (a Maglev table) would make the value buffer a gigabyte: a few MiB at most
        chunk = max(1, min(chunk, _BATCH_BYTES // vsize))
        in_batch, out_batch = ct.c_uint32(0), ct.c_uint32(0)
        first = True
        self._batch_supported = True
        keys = ct.create_string_buffer(ksize * chunk)
        values = ct.create_string_buffer(vsize * chunk)
        while True:
            count = ct.c_uint32(chunk)
            start = None if first else in_batch
            ret = bpfsys.map_lookup_batch(self.fd, start, out_batch, keys, values, count)
            err = _errno_of(ret) if ret < 0 else 0
            if err in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP) and first:
                self._batch_supported = False
                return
            if err == errno.ENOSPC and count.value == 0:  # a hash bucket larger than the chunk
                chunk *= 4
                keys = ct.create_string_buffer(ksize * chunk)
                values = ct.create_string_buffer(vsize * chunk)
                continue
            if err not in (0, errno.ENOENT):
                raise self._error("lookup_batch", err)
            yield keys, values, count.value
            if err == errno.ENOENT:
                return
            in_batch.value = out_batch.value
            first = False

    def update_batch(self, entries: Sequence[tuple[CData, CData]]) -> None:
        """Creates or replaces every entry (BPF_ANY), in one syscall where the map type allows."""
        if not entries:
            return
        for key, value in entries:
            _check_type(self.spec, "key", key, self.spec.key)
            _check_type(self.spec, "value", value, self.spec.value)
        if self.percpu or self.spec.kind not in _BATCH_KINDS:
            for key, value in entries:
                self.update(key, value)
            return
        keys = ct.create_string_buffer(b"".join(bytes(k) for k, _ in entries))
        values = ct.create_string_buffer(b"".join(bytes(v) for _, v in entries))
        count = ct.c_uint32(len(entries))
        ret = bpfsys.map_update_batch(self.fd, keys, values, count)
        if ret < 0:
            err = _errno_of(ret)
            if err in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP) and count.value == 0:
                for key, value in entries:
                    self.update(key, value)
                return
            raise self._error(f"update_batch (entry {count.value} of {len(entries)})", err)

    def delete_batch(self, keys: Sequence[CData]) -> int:
        """Deletes every key that exists; returns how many were deleted."""
        for key in keys:
            _check_type(self.spec, "key", key, self.spec.key)
        if self.spec.kind not in _BATCH_KINDS - _ARRAY_KINDS:
            return sum(self.delete(key) for key in keys)
        deleted, start = 0, 0
        while start < len(keys):
            rest = keys[start:]
            buf = ct.create_string_buffer(b"".join(bytes(k) for k in rest))
            count = ct.c_uint32(len(rest))
            ret = bpfsys.map_delete_batch(self.fd, buf, count)
            done = count.value
            deleted += done
            if ret >= 0:
                break
            err = _errno_of(ret)
            if err == errno.ENOENT:  # the kernel stops at a missing key: skip it, go on
                start += done + 1
                continue
            if err in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP) and done == 0:
                return deleted + sum(self.delete(key) for key in rest)
            raise self._error("delete_batch", err)
        return deleted

    def update_raw(self, keys: Sequence[bytes], values: Sequence[bytes]) -> int:
        """Creates or replaces entries given as raw bytes, in order (BPF_ANY), batched where the map
        type allows. Returns how many were written before one found no room (all on success);
        any other error raises MapError."""
        if not keys:
            return 0
        if len(keys) != len(values):
            raise ValueError("update_raw: as many keys as values")
        if self.percpu:
            raise TypeError(f"{self.spec.name}: update_raw of a per-CPU map")
        if self.spec.kind in _BATCH_KINDS:
            kbuf = ct.create_string_buffer(b"".join(keys))
            vbuf = ct.create_string_buffer(b"".join(values))
            count = ct.c_uint32(len(keys))
            ret = bpfsys.map_update_batch(self.fd, kbuf, vbuf, count)
            if ret >= 0:
                return len(keys)
            err = _errno_of(ret)
            if _full_error(err):
                return int(count.value)
            if not (err in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP) and count.value == 0):
                raise self._error(f"update_batch (entry {count.value} of {len(keys)})", err)
        for i, (kb, vb) in enumerate(zip(keys, values, strict=True)):
            ret = bpfsys.map_update_elem(self.fd, ct.create_string_buffer(kb), ct.create_string_buffer(vb), 0)
            if ret < 0:
                err = _errno_of(ret)
                if _full_error(err):
                    return i
                raise self._error("update", err)
        return len(keys)

    def delete_raw(self, keys: Sequence[bytes]) -> None:
        """Deletes every key given as raw bytes; missing keys are fine."""
        self.delete_packed(b"".join(keys))

    def update_packed(self, keys: bytes, values: bytes) -> int:
        """`update_raw` of concatenated keys and values: one buffer each, as the batch call
        takes them, with no per-entry work here."""
        ksize, vsize = ct.sizeof(self.spec.key), ct.sizeof(self.spec.value)
        n = len(keys) // ksize
        if len(keys) != n * ksize or len(values) != n * vsize:
            raise ValueError(
                f"{self.spec.name}: update_packed of {len(keys)} key and {len(values)} value bytes"
            )
        if not n:
            return 0
        if self.spec.kind in _BATCH_KINDS and not self.percpu:
            count = ct.c_uint32(n)
            kbuf = ct.create_string_buffer(keys, len(keys))
            vbuf = ct.create_string_buffer(values, len(values))
            ret = bpfsys.map_update_batch(self.fd, kbuf, vbuf, count)
            if ret >= 0:
                return n
            err = _errno_of(ret)
            if _full_error(err):
                return int(count.value)
            if not (err in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP) and count.value == 0):
                raise self._error(f"update_batch (entry {count.value} of {n})", err)
        return self.update_raw(_split(keys, ksize), _split(values, vsize))

    def delete_packed(self, keys: bytes) -> None:
        """Deletes every key (concatenated); missing keys are fine."""
        ksize = ct.sizeof(self.spec.key)
        n = len(keys) // ksize
        if not n:
            return
        if self.spec.kind not in _BATCH_KINDS - _ARRAY_KINDS:
            for k in _split(keys, ksize):
                ret = bpfsys.map_delete_elem(self.fd, ct.create_string_buffer(k, ksize))
                if ret < 0 and _errno_of(ret) != errno.ENOENT:
                    raise self._error("delete", _errno_of(ret))
            return
        start = 0
        while start < n:
            count = ct.c_uint32(n - start)
            rest = keys[start * ksize :]
            ret = bpfsys.map_delete_batch(self.fd, ct.create_string_buffer(rest, len(rest)), count)
            if ret >= 0:
                return
            err = _errno_of(ret)
            done = int(count.value)
            if err == errno.ENOENT:  # the kernel stops at a missing key: skip it, go on
                start += done + 1
                continue
            if err in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP) and done == 0:
                for k in _split(keys[start * ksize :], ksize):
                    self.delete(self.spec.key.from_buffer_copy(k))
                return
            raise self._error("delete_batch", err)

    def clear(self) -> None:
        """Empties the map (arrays: every element zeroed, in one batch where the kind allows)."""
        if self.spec.kind in _ARRAY_KINDS:
            n = self.info().max_entries
            if not self.percpu:
                ksize, vsize = ct.sizeof(self.spec.key), ct.sizeof(self.spec.value)
                keys = [i.to_bytes(ksize, sys.byteorder) for i in range(n)]
                self.update_raw(keys, [bytes(vsize)] * n)
                return
            zero = self.spec.value()
            for i in range(n):
                self.update(self.spec.key(i), zero)
            return
        self.delete_batch(self.keys())


CFG_SEL_KEY = 0


def read_config(maps: Mapping[str, MapWriter]) -> Config | None:
    """The config the programs read: the ekp_cfg slot ekp_cfgsel names; None when never written."""
    sel = maps["cfgsel"].lookup(ct.c_uint32(CFG_SEL_KEY))
    slot = int(getattr(sel, "slot", 0)) & 1
    value = maps["cfg"].lookup(ct.c_uint32(slot))
    if not isinstance(value, Config) or not any(value.values()):
        return None
    return value


def write_config(maps: Mapping[str, MapWriter], cfg: Config) -> bool:
    """Makes `cfg` the live config without ever rewriting the slot programs read (a torn read):
    write the other slot, then flip the selector (one aligned 4-byte value). False when `cfg` was
    live already. Two writes in a row are a syscall apart, far longer than a program holds its
    pointer to the old slot (one packet)."""
    sel = maps["cfgsel"].lookup(ct.c_uint32(CFG_SEL_KEY))
    live = int(getattr(sel, "slot", 0)) & 1
    if maps["cfg"].lookup(ct.c_uint32(live)) == cfg and sel is not None:
        return False
    spare = 1 - live
    maps["cfg"].update(ct.c_uint32(spare), cfg)
    maps["cfgsel"].update(ct.c_uint32(CFG_SEL_KEY), ConfigSel(slot=spare))
    return True


def read_config6(maps: Mapping[str, MapWriter]) -> Config6 | None:
    """The IPv6 path's settings the programs read: the ekp_cfg6 slot ekp_cfg6sel names."""
    sel = maps["cfg6sel"].lookup(ct.c_uint32(CFG_SEL_KEY))
    value = maps["cfg6"].lookup(ct.c_uint32(int(getattr(sel, "slot", 0)) & 1))
    return value if isinstance(value, Config6) else None


def write_config6(maps: Mapping[str, MapWriter], cfg6: Config6) -> bool:
    """Makes `cfg6` the IPv6 path's settings as `write_config` does IPv4's: the slot ekp_cfg6sel does
    not name, then the selector. False, and nothing written, when it is live already."""
    sel = maps["cfg6sel"].lookup(ct.c_uint32(CFG_SEL_KEY))
    live = int(getattr(sel, "slot", 0)) & 1
    if maps["cfg6"].lookup(ct.c_uint32(live)) == cfg6 and sel is not None:
        return False
    spare = 1 - live
    maps["cfg6"].update(ct.c_uint32(spare), cfg6)
    maps["cfg6sel"].update(ct.c_uint32(CFG_SEL_KEY), ConfigSel(slot=spare))
    return True


def read_stats(stats: MapWriter) -> dict[Stat, int]:
    """The counters of ekp_stats, summed across CPUs, by `Stat`."""
    out = dict.fromkeys(Stat, 0)
    for key, value in stats.items():
        index = int(getattr(key, "value", -1))
        if index in Stat._value2member_map_:
            out[Stat(index)] = int(getattr(value, "value", 0))
    return out


def open_pinned_as_held(spec: MapSpec, pin_path: str) -> BpfMap:
    """A pinned map opened with the value size it was created with: a Maglev table's follows
    --bpf-lb-maglev-table-size, which a reader such as `agent inspect` or /metrics does not know."""
    if spec.role == "maglev":
        fd = obj_get(os.path.join(pin_path, spec.name))
        try:
            size = map_info(fd).value_size
        finally:
            os.close(fd)
        spec = replace(spec, value=maglev_value(size // 4))
    return BpfMap.open_pinned(spec, pin_path)
