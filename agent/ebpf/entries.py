"""Map entries as plain ints: the planner's compact form of every key and value.

A key or value of the service maps is held as the one int whose native-order bytes are the
struct's bytes (`int.from_bytes(bytes(struct), sys.byteorder)`). An int hashes and compares in C,
holds no references (dicts of them are not even tracked by the garbage collector), and a run of
them turns into the bytes a batch syscall takes, and back, in one C call (`array`, `memoryview`)
for the 4- and 8-byte structs that make up nearly all entries. The field positions come from the
ctypes mirror (`agent.ebpf.abi`), so the checked mirror of `bpf/ekp_abi.h` stays the only
description of the layout:

    fe     key  addr | port << 32 | proto << 48 | scope << 56
           val  svc_id | set_id << 32 | count << 64 | flags << 80 | affinity << 96 | rev_nat_id << 128
    slot   key  set_id | slot << 32                 val  backend_id
    be     key  id                                  val  addr | port << 32 | proto << 48 | flags << 56
    member key  svc_id | backend_id << 32           val  flags
    rnat   key  id                                  val  addr | port << 32
    srcr   key  prefixlen | rev_nat_id << 32 | addr << 64      val  allow
    addr   key  addr                                val  flags (AddrFlag)

(`addr` and `port` are the network-order values the structs hold: `abi.ip_be`, `abi.port_be`.)
"""

from __future__ import annotations

import ctypes
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent.ebpf import abi
from agent.ebpf.codec import KEYS, VALUES

Entries = dict[int, int]  # one map's entries: key -> value
ORDER = sys.byteorder
_ARRAY_CODES = {array(code).itemsize: code for code in ("I", "Q")}  # 4 -> "I", 8 -> "Q"


def _shift(struct: type[ctypes.Structure], name: str) -> int:
    offset: int = getattr(struct, name).offset
    return 8 * offset


# Field positions, from the ctypes mirror (asserted below against the table in the module doc).
FE_PORT = _shift(abi.FrontendKey, "port")
FE_PROTO = _shift(abi.FrontendKey, "proto")
FE_SCOPE = _shift(abi.FrontendKey, "scope")
FE_SET = _shift(abi.Frontend, "set_id")
FE_COUNT = _shift(abi.Frontend, "count")
FE_FLAGS = _shift(abi.Frontend, "flags")
FE_AFFINITY = _shift(abi.Frontend, "affinity_timeout")
FE_RNAT = _shift(abi.Frontend, "rev_nat_id")
SLOT_POS = _shift(abi.SlotKey, "slot")
BE_PORT = _shift(abi.Backend, "port")
BE_PROTO = _shift(abi.Backend, "proto")
BE_FLAGS = _shift(abi.Backend, "flags")
MEMBER_BACKEND = _shift(abi.MemberKey, "backend_id")
RNAT_PORT = _shift(abi.RevNat, "port")
SRCR_RNAT = _shift(abi.SrcRangeKey, "rev_nat_id")
SRCR_ADDR = _shift(abi.SrcRangeKey, "addr")
assert (FE_PORT, FE_PROTO, FE_SCOPE) == (32, 48, 56)
assert (FE_SET, FE_COUNT, FE_FLAGS, FE_AFFINITY, FE_RNAT) == (32, 64, 80, 96, 128)
assert (SLOT_POS, BE_PORT, BE_PROTO, BE_FLAGS, MEMBER_BACKEND, RNAT_PORT) == (32, 32, 48, 56, 32, 32)
assert (SRCR_RNAT, SRCR_ADDR) == (32, 64)

U16 = 0xFFFF
U32 = 0xFFFFFFFF
IDENT = (1 << BE_FLAGS) - 1  # addr, port and proto of a backend value: what identifies it


# ---- composing and taking apart ---------------------------------------------------------------


def ident(addr: int, port: int, proto: int) -> int:
    """(addr be, port be, proto) of a backend or a frontend, as the low bytes of ekp_be / ekp_fe_key."""
    return addr | port << BE_PORT | proto << BE_PROTO


def fe_key(addr: int, port: int, proto: int, scope: int) -> int:
    return addr | port << FE_PORT | proto << FE_PROTO | scope << FE_SCOPE


def fe_value(svc_id: int, set_id: int, count: int, flags: int, affinity: int, rnat_id: int) -> int:
    return (
        svc_id
        | set_id << FE_SET
        | count << FE_COUNT
        | flags << FE_FLAGS
        | affinity << FE_AFFINITY
        | rnat_id << FE_RNAT
    )


def fe_svc(value: int) -> int:
    return value & U32


def fe_set(value: int) -> int:
    return value >> FE_SET & U32


def fe_count(value: int) -> int:
    return value >> FE_COUNT & U16


def fe_flags(value: int) -> int:
    return value >> FE_FLAGS & U16


def fe_rnat(value: int) -> int:
    return value >> FE_RNAT & U16


def fe_sort_key(key: int) -> tuple[int, int, int, int]:
    """kube-proxy's order of frontends: by address, port, protocol, then scope."""
    return key & U32, key >> FE_PORT & U16, key >> FE_PROTO & 0xFF, key >> FE_SCOPE


def slot_key(set_id: int, pos: int) -> int:
    return set_id | pos << SLOT_POS


def member_key(svc_id: int, backend_id: int) -> int:
    return svc_id | backend_id << MEMBER_BACKEND


def srcr_key(prefixlen: int, rnat_id: int, addr: int) -> int:
    return prefixlen | rnat_id << SRCR_RNAT | addr << SRCR_ADDR


def srcr_rnat(key: int) -> int:
    return key >> SRCR_RNAT & U16


# ---- bytes ------------------------------------------------------------------------------------


def pack(ints: Sequence[int], size: int) -> bytes:
    """Ints of `size` bytes each, concatenated as a batch syscall takes them."""
    code = _ARRAY_CODES.get(size)
    if code is not None:
        return array(code, ints).tobytes()
    return b"".join([i.to_bytes(size, ORDER) for i in ints])


def unpack(data: bytes, size: int) -> list[int]:
    """The inverse of `pack`."""
    code = _ARRAY_CODES.get(size)
    if code is not None:
        return array(code, data).tolist()
    return [int.from_bytes(data[i : i + size], ORDER) for i in range(0, len(data), size)]


def key_size(role: str) -> int:
    return KEYS[role].size


def value_size(role: str) -> int:
    return VALUES[role].size


def from_dump(role: str, keys: bytes, values: bytes) -> Entries:
    """A map's dump (`dump_raw`: every key, every value, each concatenated) as entries."""
    return dict(zip(unpack(keys, key_size(role)), unpack(values, value_size(role)), strict=True))


def to_ctypes(role: str, entries: Mapping[int, int]) -> dict[Any, Any]:
    """Entries as ctypes keys and values (rendering, the typed map API)."""
    kc, vc = KEYS[role].ctype, VALUES[role].ctype
    ks, vs = key_size(role), value_size(role)
    return {
        kc.from_buffer_copy(k.to_bytes(ks, ORDER)): vc.from_buffer_copy(v.to_bytes(vs, ORDER))
        for k, v in entries.items()
    }


def to_tuples(role: str, entries: Iterable[tuple[int, int]]) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Entries as codec tuples (field by field: tests, debugging)."""
    kc, vc = KEYS[role], VALUES[role]
    ks, vs = kc.size, vc.size
    return {kc.unpack(k.to_bytes(ks, ORDER)): vc.unpack(v.to_bytes(vs, ORDER)) for k, v in entries}


def of_ctype(obj: Any) -> int:
    """A ctypes key or value as its int."""
    return int.from_bytes(bytes(obj), ORDER)
