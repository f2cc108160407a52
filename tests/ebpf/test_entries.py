"""Entries as ints: the positions agree with the ctypes mirror, and bytes go both ways in bulk."""

from __future__ import annotations

from agent.ebpf import abi
from agent.ebpf.entries import (
    fe_key,
    fe_sort_key,
    fe_value,
    from_dump,
    ident,
    member_key,
    pack,
    slot_key,
    srcr_key,
    to_ctypes,
    unpack,
)


def test_composed_ints_are_the_structs_bytes() -> None:
    fe = to_ctypes("fe", {fe_key(0x0A000060, 0x5000, 6, 1): fe_value(7, 9, 3, 0x21, 600, 12)})
    [(key, value)] = fe.items()
    assert (key.addr, key.port, key.proto, key.scope) == (0x0A000060, 0x5000, 6, 1)
    assert (value.svc_id, value.set_id, value.count, value.flags) == (7, 9, 3, 0x21)
    assert (value.affinity_timeout, value.rev_nat_id) == (600, 12)
    [(skey, slot)] = to_ctypes("slot", {slot_key(9, 2): 41}).items()
    assert (skey.set_id, skey.slot, slot.backend_id) == (9, 2, 41)
    [(bkey, be)] = to_ctypes("be", {41: ident(0x0B00F40A, 0x901F, 17) | 1 << 56}).items()
    assert (bkey.id, be.addr, be.port, be.proto, be.flags) == (41, 0x0B00F40A, 0x901F, 17, 1)
    [(mkey, member)] = to_ctypes("member", {member_key(7, 41): 2}).items()
    assert (mkey.svc_id, mkey.backend_id, member.flags) == (7, 41, 2)
    [(rkey, srcr)] = to_ctypes("srcr", {srcr_key(56, 12, 0x0064A8C0): 1}).items()
    assert (rkey.prefixlen, rkey.rev_nat_id, rkey.addr, srcr.allow) == (56, 12, 0x0064A8C0, 1)


def test_pack_and_unpack_every_size() -> None:
    for size, values in ((4, [1, 0xFFFFFFFF]), (8, [2, 1 << 63]), (12, [3, 1 << 95]), (20, [4, 1 << 159])):
        data = pack(values, size)
        assert len(data) == 2 * size
        assert unpack(data, size) == values


def test_a_dump_becomes_entries() -> None:
    keys = bytes(abi.SlotKey(set_id=1, slot=2)) + bytes(abi.SlotKey(set_id=3, slot=1))
    values = bytes(abi.Slot(backend_id=5)) + bytes(abi.Slot(backend_id=6))
    assert from_dump("slot", keys, values) == {slot_key(1, 2): 5, slot_key(3, 1): 6}


def test_frontends_sort_by_address_then_scope() -> None:
    keys = [fe_key(2, 80, 6, 0), fe_key(1, 80, 6, 1), fe_key(1, 80, 6, 0)]
    assert sorted(keys, key=fe_sort_key) == [fe_key(1, 80, 6, 0), fe_key(1, 80, 6, 1), fe_key(2, 80, 6, 0)]
