"""A bpf_loop callback linked into a compiled program, and the BTF the kernel wants for it. Pure.

The SNAT port walk runs its probes in a bpf_loop callback (bpf/ekp_snat_af.h): the verifier
checks a callback's body for the states it is called with, where it walked a bounded loop's
body once per iteration. bcc 0.26 compiles such a callback (a non-static C function) as a
function of its own, but leaves the reference to it unresolved: the call site keeps
`ld_imm64 r2, 0` (source register 0, both halves of the immediate 0) ahead of `call bpf_loop`.
libbpf would link it; here `link_callback` does:

* the callback's instructions are appended to the program's, its map references offset with them;
* each call site becomes `ld_imm64 r2, <callback>`: source register BPF_PSEUDO_FUNC, immediate
  the callback's first instruction relative to the one after the `ld_imm64`;
* the kernel wants BTF func_info for a program with a BPF_PSEUDO_FUNC ("missing btf func_info"):
  `func_btf` writes a small BTF of its own (an INT, a PTR, two FUNC_PROTOs with named
  parameters, one static FUNC per function) and `LinkedProg.func_info` the records, (instruction
  offset, FUNC type id) for the program at 0 and the callback after it. No line info.

Which callback a program's sites mean is not guessed: a program names at most one
(agent/ebpf/programs.py ProgSpec.callback), every unresolved reference in it must be a call
site of bpf_loop's callback argument, and a program naming a callback must have one.
CallError says which rule an object breaks.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from agent.ebpf.bpfobject import INSN, LD_IMM64, FuncDef, ObjectError, ProgDef

PSEUDO_FUNC = 4  # src_reg of an ld_imm64 whose imm is a function's offset (BPF_PSEUDO_FUNC)
JMP_CALL = 0x85  # BPF_JMP | BPF_CALL
HELPER_LOOP = 181  # BPF_FUNC_loop
CALLBACK_ARG = 2  # bpf_loop(nr_loops, callback_fn, callback_ctx, flags): the callback is r2
# instruction classes (code & 7)
_LD, _LDX, _STX, _ALU, _JMP, _JMP32, _ALU64 = 0, 1, 3, 4, 5, 6, 7
_ATOMIC = 0xC0  # BPF_ATOMIC mode of a STX
_FETCH = 0x01  # an atomic operation that writes the old value back into its source register


class CallError(ObjectError):
    """A program's unresolved references cannot be mapped to a callback without guessing."""


@dataclass(frozen=True)
class LinkedProg:
    prog: ProgDef  # the program with its callback appended and its call sites patched
    func_info: tuple[tuple[int, str], ...]  # (instruction offset, function name); () without a callback


def unresolved(insns: bytes) -> list[int]:
    """Indexes of the `ld_imm64` of 0 with no pseudo source: references the compiler left for a
    linker (clang loads a constant 0 with a mov, never with a 64-bit load)."""
    out = []
    i, count = 0, len(insns) // INSN.size
    while i < count:
        code, regs, _, imm = INSN.unpack_from(insns, i * INSN.size)
        if code == LD_IMM64:
            high = INSN.unpack_from(insns, (i + 1) * INSN.size)[3] if i + 1 < count else -1
            if regs >> 4 == 0 and imm == 0 and high == 0:
                out.append(i)
            i += 2
            continue
        i += 1
    return out


def _writes_r2(code: int, regs: int, imm: int) -> bool:
    cls, dst, src = code & 7, regs & 0x0F, regs >> 4
    if cls in (_LD, _LDX, _ALU, _ALU64):
        return dst == CALLBACK_ARG
    return cls == _STX and code & 0xE0 == _ATOMIC and bool(imm & _FETCH) and src == CALLBACK_ARG


def is_callback_site(insns: bytes, at: int) -> bool:
    """Whether the unresolved `ld_imm64` at `at` loads bpf_loop's callback argument: it loads r2,
    and the first jump or call after it, with r2 untouched on the way, is `call bpf_loop`."""
    _, regs, _, _ = INSN.unpack_from(insns, at * INSN.size)
    if regs & 0x0F != CALLBACK_ARG:
        return False
    for i in range(at + 2, len(insns) // INSN.size):
        code, regs, _, imm = INSN.unpack_from(insns, i * INSN.size)
        if code & 7 in (_JMP, _JMP32):
            return bool(code == JMP_CALL and regs >> 4 == 0 and imm == HELPER_LOOP)
        if _writes_r2(code, regs, imm):
            return False
    return False


def link_callback(prog: ProgDef, callback: FuncDef | None) -> LinkedProg:
    """`prog` with `callback` linked in (see the module's docstring); CallError when its unresolved
    references are not exactly call sites of bpf_loop's callback argument and a callback named."""
    sites = unresolved(prog.insns)
    if callback is None:
        if sites:
            raise CallError(
                f"program {prog.name}: unresolved 64-bit load(s) at instruction(s) "
                f"{', '.join(map(str, sites))} and no callback named for it "
                "(agent/ebpf/programs.py ProgSpec.callback): not loading a reference nobody can map"
            )
        return LinkedProg(prog, ())
    if not sites:
        raise CallError(
            f"program {prog.name} names callback {callback.name}, but passes no function to bpf_loop"
        )
    stray = [i for i in sites if not is_callback_site(prog.insns, i)]
    if stray:
        raise CallError(
            f"program {prog.name}: unresolved 64-bit load(s) at instruction(s) {', '.join(map(str, stray))} "
            f"that are not bpf_loop's callback argument: not linking {callback.name} there"
        )
    if unresolved(callback.insns):
        raise CallError(
            f"callback {callback.name} has unresolved references of its own: only one level is linked"
        )
    start = len(prog.insns) // INSN.size
    out = bytearray(prog.insns)
    for i in sites:
        code, regs, off, _ = INSN.unpack_from(out, i * INSN.size)
        INSN.pack_into(out, i * INSN.size, code, (regs & 0x0F) | (PSEUDO_FUNC << 4), off, start - (i + 1))
    relocs = prog.relocs + tuple((i + start, m) for i, m in callback.relocs)
    linked = ProgDef(prog.name, prog.type, bytes(out) + callback.insns, relocs)
    return LinkedProg(linked, ((0, prog.name), (start, callback.name)))


# BTF (include/uapi/linux/btf.h): header, then `struct btf_type` records (name_off, info, size or
# type), each kind's extra bytes after it; ids count from 1 in record order.
_HEADER = struct.Struct("<HBBIIIII")
_TYPE = struct.Struct("<III")
_BTF_MAGIC, _BTF_VERSION = 0xEB9F, 1
_KIND_INT, _KIND_PTR, _KIND_FUNC_PROTO, _KIND_FUNC = 1, 2, 13, 12
_INT_SIGNED = 1 << 24
_LINKAGE_STATIC = 0  # a FUNC's vlen: a global function would be verified apart from its callers
# The fixed types: 1 int, 2 long, 3 void *, 4 int (void *ctx) (a program), 5 long (long index,
# void *ctx) (a bpf_loop callback); the FUNCs follow from id 6.
FIRST_FUNC_ID = 6


def func_btf(func_info: Sequence[tuple[int, str]]) -> tuple[bytes, bytes]:
    """The BTF for a linked program's functions (`LinkedProg.func_info`: the first a program, the
    others callbacks) and its func_info records (struct bpf_func_info: insn_off, type_id)."""
    strings = bytearray(b"\0")

    def name(text: str) -> int:
        off = len(strings)
        strings.extend(text.encode() + b"\0")
        return off

    types = bytearray()
    types += _TYPE.pack(name("int"), _KIND_INT << 24, 4) + struct.pack("<I", _INT_SIGNED | 32)
    types += _TYPE.pack(name("long"), _KIND_INT << 24, 8) + struct.pack("<I", _INT_SIGNED | 64)
    types += _TYPE.pack(0, _KIND_PTR << 24, 0)
    ctx = name("ctx")
    types += _TYPE.pack(0, _KIND_FUNC_PROTO << 24 | 1, 1) + struct.pack("<II", ctx, 3)
    types += _TYPE.pack(0, _KIND_FUNC_PROTO << 24 | 2, 2) + struct.pack("<IIII", name("index"), 2, ctx, 3)
    records = bytearray()
    for n, (insn_off, fn) in enumerate(func_info):
        proto = 4 if n == 0 else 5
        types += _TYPE.pack(name(fn), _KIND_FUNC << 24 | _LINKAGE_STATIC, proto)
        records += struct.pack("<II", insn_off, FIRST_FUNC_ID + n)
    header = _HEADER.pack(_BTF_MAGIC, _BTF_VERSION, 0, _HEADER.size, 0, len(types), len(types), len(strings))
    return header + bytes(types) + bytes(strings), bytes(records)
