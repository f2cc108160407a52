"""The relocatable object the compiler child hands over: map references found, bound, checked."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.ebpf.bpfobject import (
    EXIT,
    INSN,
    LD_IMM64,
    MOV_K,
    BpfObject,
    MapDef,
    ObjectError,
    ProgDef,
    check_relocs,
    find_relocs,
    insn,
    relocate,
)

# r1 = map(fd 7); r0 = 0; r2 = map(fd 9); r3 = 64-bit constant 7 (not a map); exit
PROGRAM = b"".join(
    [
        insn(LD_IMM64, src=1, dst=1, imm=7),
        insn(0),
        insn(MOV_K, dst=0, imm=0),
        insn(LD_IMM64, src=1, dst=2, imm=9),
        insn(0),
        insn(LD_IMM64, src=0, dst=3, imm=7),
        insn(0),
        insn(EXIT),
    ]
)

MAPS = (
    MapDef("ekp_a_v2", 1, 4, 8, 16, 0, 3, 4),
    MapDef("ekp_b_v2", 2, 4, 4, 1, 0),
)


def test_map_references_are_found_by_instruction_and_map() -> None:
    assert find_relocs(PROGRAM, {7: 0, 9: 1}) == ((0, 0), (3, 1))


def test_a_constant_that_looks_like_an_fd_is_left_alone() -> None:
    """Instruction 5 loads 7 as a plain 64-bit constant, and the slot after an ld_imm64 is data."""
    tricky = PROGRAM + insn(LD_IMM64, imm=7) + INSN.pack(LD_IMM64, 0x10, 0, 7)  # data slot shaped like a load
    assert find_relocs(tricky, {7: 0, 9: 1}) == ((0, 0), (3, 1))


def test_an_fd_of_no_map_and_other_pseudo_sources_are_refused() -> None:
    with pytest.raises(ObjectError, match="fd 9, which is no map"):
        find_relocs(PROGRAM, {7: 0})
    with pytest.raises(ObjectError, match="pseudo source 2"):
        find_relocs(insn(LD_IMM64, src=2, imm=7) + insn(0), {7: 0})
    with pytest.raises(ObjectError, match="whole number"):
        find_relocs(PROGRAM[:-3], {7: 0, 9: 1})


def test_relocate_writes_each_map_s_fd_and_nothing_else() -> None:
    prog = ProgDef("p", 3, PROGRAM, ((0, 0), (3, 1)))
    out = relocate(prog, [41, 42])
    assert INSN.unpack_from(out, 0) == (LD_IMM64, 1 << 4 | 1, 0, 41)
    assert INSN.unpack_from(out, 3 * INSN.size) == (LD_IMM64, 1 << 4 | 2, 0, 42)
    changed = [i for i in range(len(PROGRAM) // 8) if out[i * 8 : i * 8 + 8] != PROGRAM[i * 8 : i * 8 + 8]]
    assert changed == [0, 3]


def test_the_json_form_round_trips_and_is_checked() -> None:
    obj = BpfObject(
        build="abcdef012345",
        license="GPL",
        kern_version=393664,
        btf=b"\x9f\xeb\x01\x00btf",
        maps=MAPS,
        programs=(ProgDef("ekp_from_pod", 3, PROGRAM, ((0, 0), (3, 1))),),
    )
    assert BpfObject.from_json(obj.to_json()) == obj
    assert obj.map_index("ekp_b_v2") == 1 and obj.program("ekp_from_pod").type == 3
    for bad in (
        replace(obj, programs=(ProgDef("p", 3, PROGRAM, ((2, 0),)),)),  # a mov is no map load
        replace(obj, programs=(ProgDef("p", 3, PROGRAM, ((0, 5),)),)),  # no map 5
        replace(obj, programs=(ProgDef("p", 3, PROGRAM, ((99, 0),)),)),  # past the end
    ):
        with pytest.raises(ObjectError):
            BpfObject.from_json(bad.to_json())
    for junk in (
        b"",
        b"[]",
        b'{"format": 99}',
        obj.to_json().replace(b'"GPL"', b"7").replace(b'"maps": [', b'"maps": [1, '),
    ):
        with pytest.raises(ObjectError):
            BpfObject.from_json(junk)


def test_check_relocs_refuses_an_empty_program() -> None:
    with pytest.raises(ObjectError):
        check_relocs(ProgDef("p", 3, b"", ()), 1)
