"""Plain tuples <-> the bytes of an ABI struct, derived from the ctypes mirror in `abi.py`.

The planner keeps every map key and value as a tuple of ints (hashing and comparing a tuple of
ints is several times cheaper than a ctypes struct, and 10,000 services mean a quarter of a million
entries); the bytes are made only when an entry is written, and decoded straight from what
`bpf_map_lookup_batch` returns when the maps are read back. The layout comes from the ctypes
class, so the one checked mirror of `bpf/ekp_abi.h` stays the only description of it:

* scalar fields are ints, in declaration order;
* fields whose name starts with `pad` are zero bytes, not part of the tuple;
* other arrays (addresses of a later IPv6 layout, a Maglev table's backend ids) are `bytes` of
  their size, the elements in native order.

Packing uses native byte order and no implicit alignment: the header pads every struct
explicitly, and `Codec.__init__` checks the size against `ctypes.sizeof`.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any

from agent.ebpf.abi import MAPS

Key = tuple[Any, ...]
Value = tuple[Any, ...]

_SCALARS = {
    ctypes.c_uint8: "B",
    ctypes.c_uint16: "H",
    ctypes.c_uint32: "I",
    ctypes.c_uint64: "Q",
}


class Codec:
    """pack / unpack one ctypes Structure (or a bare ctypes integer) as a tuple."""

    def __init__(self, ctype: Any) -> None:
        self.ctype = ctype
        if ctype in _SCALARS:
            fmt, names = _SCALARS[ctype], ["value"]
        else:
            fmt, names = "", []
            for name, ftype, *_ in ctype._fields_:
                if ftype in _SCALARS:
                    code = _SCALARS[ftype]
                    fmt += f"{ctypes.sizeof(ftype)}x" if name.startswith("pad") else code
                    if not name.startswith("pad"):
                        names.append(name)
                elif issubclass(ftype, ctypes.Array) and ftype._type_ in _SCALARS:
                    size = ctypes.sizeof(ftype)
                    fmt += f"{size}x" if name.startswith("pad") else f"{size}s"
                    if not name.startswith("pad"):
                        names.append(name)
                else:
                    raise TypeError(f"{ctype.__name__}.{name}: no codec for {ftype.__name__}")
        self.struct = struct.Struct("=" + fmt)
        self.fields = tuple(names)
        self.size = self.struct.size
        if self.size != ctypes.sizeof(ctype):
            raise TypeError(
                f"{ctype.__name__}: packs to {self.size} bytes, ctypes says {ctypes.sizeof(ctype)}"
            )

    def pack(self, values: Sequence[Any]) -> bytes:
        return self.struct.pack(*values)

    def unpack(self, data: bytes) -> tuple[Any, ...]:
        return self.struct.unpack(data)

    def to_ctype(self, values: Sequence[Any]) -> Any:
        """The ctypes value of a tuple (for rendering and the typed map API)."""
        return self.ctype.from_buffer_copy(self.pack(values))

    def of_ctype(self, obj: Any) -> tuple[Any, ...]:
        return self.unpack(bytes(obj))


KEYS: dict[str, Codec] = {role: Codec(spec.key) for role, spec in MAPS.items()}
VALUES: dict[str, Codec] = {role: Codec(spec.value) for role, spec in MAPS.items()}
