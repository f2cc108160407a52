"""The SCTP checksum update's constants (bpf/ekp_sctp.h), read from the header and held to a plain
CRC32c (lab/sctppeer.py) for packet lengths the packet tests cannot reach: BPF_PROG_TEST_RUN takes
at most about a page, so the tables of the third and fourth hexadecimal digit of a length (4,096
bytes and more: jumbo frames) are checked here, by the same arithmetic as the C.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from lab.sctppeer import crc32c

HEADER = Path(__file__).resolve().parents[2] / "bpf" / "ekp_sctp.h"
POLY = 0x82F63B78  # reflected; bit 31 is x^0, as zlib's multmodp


def tables() -> list[list[int]]:
    """EKP_CRC32C_X8_0..3: x^(8 j 16^k) mod P for the digits j = 0..15 of each place k."""
    text = HEADER.read_text()
    out = []
    for k in range(4):
        match = re.search(rf"#define EKP_CRC32C_X8_{k} \\\n(.*?)(?:\n\n|\n#)", text, re.S)
        assert match, f"EKP_CRC32C_X8_{k} not found in {HEADER}"
        out.append([int(v, 16) for v in re.findall(r"0x([0-9a-f]{8})u", match.group(1))])
    return out


def mul(a: int, b: int) -> int:
    """a * b modulo P (ekp_crc32c_mul)."""
    p = 0
    for i in range(32):
        p ^= b * ((a >> (31 - i)) & 1)
        b = (b >> 1) ^ (POLY * (b & 1))
    return p


def x8(n: int) -> int:
    """x^(8 n) modulo P, by squaring."""
    r, base = 0x80000000, 0x00800000
    while n:
        if n & 1:
            r = mul(base, r)
        base, n = mul(base, base), n >> 1
    return r


def delta(old_ports: int, new_ports: int, length: int) -> int:
    """ekp_sctp_csum_delta: D * x^(8 L), one table-picked factor per hexadecimal digit of L."""
    r, digits = old_ports ^ new_ports, tables()
    for k in range(4):
        r = mul(digits[k][(length >> (4 * k)) & 0xF], r)
    return r


def test_each_table_holds_the_powers_of_its_digit() -> None:
    for k, table in enumerate(tables()):
        assert table == [x8(j * 16**k) for j in range(16)], f"EKP_CRC32C_X8_{k}"


@pytest.mark.parametrize("length", [16, 1400, 4095, 4096, 4097, 9000, 9216, 40000, 65535])
def test_the_update_gives_the_checksum_a_rewrite_of_the_ports_would(length: int) -> None:
    rng = random.Random(length)
    packet = bytearray(rng.randbytes(length))
    packet[8:12] = bytes(4)  # the checksum field is zero while it is computed
    rewritten = bytearray(packet)
    rewritten[0:4] = rng.randbytes(4)
    old, new = (int.from_bytes(p[0:4], "little") for p in (packet, rewritten))
    assert crc32c(bytes(packet)) ^ crc32c(bytes(rewritten)) == delta(old, new, length)
