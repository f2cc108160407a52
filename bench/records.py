"""Bytes per endpoint of the forms an endpoint record could take: `python -m bench.records`.

The model keeps one record per endpoint of every service port (issue 18: 100,000 at 10,000
Services of 10 endpoints, 500,000 at 50,000). This measures, with tracemalloc, what 100,000 of
them cost in each candidate form, the address and node strings excluded (they are the same in
every form): the `Endpoint` NamedTuple the model uses (10 fields), a `__slots__` class of the
fields that vary, a plain tuple with the address as an int, and packed bytes per service port
(8 bytes per endpoint: address, port, flags, node index).
"""

from __future__ import annotations

import socket
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

from agent.model.types import Endpoint

N = 100_000


class _Slotted:
    __slots__ = ("flags", "hints", "ip", "node", "port", "zone")

    def __init__(self, ip: str, port: int, flags: int, node: str, zone: str) -> None:
        self.ip, self.port, self.flags, self.node, self.zone, self.hints = ip, port, flags, node, zone, None


def measure(build: Callable[[], Any]) -> float:
    """Bytes per endpoint that `build` allocates (and keeps)."""
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    kept = build()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    size = sum(s.size_diff for s in after.compare_to(before, "filename"))
    del kept
    return size / N


def main() -> None:
    ips = [f"10.{128 + (i >> 12)}.{(i >> 4) & 255}.{i & 255}" for i in range(N)]
    nodes = [f"node{i % 100}" for i in range(100)]
    rec = struct.Struct("=4sHBB")
    forms: dict[str, Callable[[], Any]] = {
        "Endpoint NamedTuple (10 fields)": lambda: [
            Endpoint(ips[i], 8080, True, True, False, nodes[i % 100], "zone-a") for i in range(N)
        ],
        "__slots__ class (6 fields)": lambda: [
            _Slotted(ips[i], 8080, 3, nodes[i % 100], "zone-a") for i in range(N)
        ],
        "tuple (address int, port, flags, node index)": lambda: [
            (int.from_bytes(socket.inet_aton(ips[i]), "little"), 8080, 3, i % 100) for i in range(N)
        ],
        "packed bytes, 10 endpoints per port": lambda: [
            b"".join(rec.pack(socket.inet_aton(ips[j]), 8080, 3, j % 100) for j in range(i, i + 10))
            for i in range(0, N, 10)
        ],
    }
    for name, build in forms.items():
        print(f"{name:46} {measure(build):6.0f} bytes per endpoint")


if __name__ == "__main__":
    main()
