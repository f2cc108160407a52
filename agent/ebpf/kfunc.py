"""Calls of kernel functions (kfuncs) patched into compiled BPF instructions. Pure.

bcc 0.26 refuses a call to an `extern ... __ksym` function ("cannot call non-static helper
function"). The C calls a helper through a pointer holding a marker number instead
(`static int (*f)(void *) = (void *)MARKER;`, which clang compiles to `call MARKER` with src_reg 0),
and this turns each such call into the kfunc call the kernel expects: src_reg
BPF_PSEUDO_KFUNC_CALL, imm the function's BTF type id in the running kernel (agent/ebpf/btf.py),
off 0 (vmlinux's BTF). A marker that no call uses, or a call to an unknown helper number left
unpatched, is the verifier's to refuse.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

BPF_JMP_CALL = 0x85  # BPF_JMP | BPF_CALL
BPF_PSEUDO_KFUNC_CALL = 2
_INSN = struct.Struct("<BBhi")  # code, dst_reg:4 src_reg:4, off, imm


def patch_kfunc_calls(insns: bytes, kfuncs: Mapping[int, int]) -> tuple[bytes, dict[int, int]]:
    """`insns` with every helper call to a marker of `kfuncs` (marker -> BTF id) made a kfunc call;
    and how many calls of each marker were patched."""
    if len(insns) % _INSN.size:
        raise ValueError(f"{len(insns)} bytes is not a whole number of instructions")
    out = bytearray(insns)
    patched = dict.fromkeys(kfuncs, 0)
    for off in range(0, len(out), _INSN.size):
        code, regs, _, imm = _INSN.unpack_from(out, off)
        if code == BPF_JMP_CALL and regs >> 4 == 0 and imm in kfuncs:
            _INSN.pack_into(out, off, code, (regs & 0x0F) | (BPF_PSEUDO_KFUNC_CALL << 4), 0, kfuncs[imm])
            patched[imm] += 1
    return bytes(out), patched
