"""A compiled data path that any agent can load against its own maps: what bcc produced, relocatable.

bcc compiles and loads in one step and binds every map reference to a map it opened itself, so
the pin directory used to be part of the compile (`BPF_TABLE_PINNED(..., "/sys/fs/bpf/X/name")`)
and every new pin directory (every node of every lab, every fresh machine) paid a compile: about
19 s of CPU on the VM of 2026-11-27 (README.md). Instead the compiler child (agent.ebpf.compile)
compiles maps without pins and hands back:

* each program's instructions as bcc would load them, and its map references ("relocations"):
  the `ld_imm64` instructions whose source register says BPF_PSEUDO_MAP_FD, by instruction index
  and map;
* the functions the programs pass to bpf_loop (`functions`: not programs, never loaded, pinned or
  attached alone), with their own map references: bcc leaves a reference to one unresolved, and
  agent.ebpf.calls links it into each program that names it (agent/ebpf/programs.py);
* each map's definition (type, key and value size, max_entries, flags, BTF type ids) and the BTF
  that describes them, so maps created later have the field names `bpftool map dump` shows;
* the license and kernel version the programs were compiled with.

agent.ebpf.link loads it against the maps pinned in one directory (creating those missing), the way
libbpf reuses pinned maps: it writes each map's fd into the instructions that reference it
(`relocate`) before BPF_PROG_LOAD. agent.ebpf.objcache keeps objects by build id, so one compile
serves every agent on the machine. Pure: no system calls here.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Of the JSON form (2: with the bpf_loop callbacks, `functions`, and whether the build has them,
# `bpf_loop`); an object of another format is
# compiled again, never guessed at
FORMAT = 2
INSN = struct.Struct("<BBhi")  # struct bpf_insn: code, dst_reg:4 | src_reg:4, off, imm
LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: a 64-bit immediate over two instruction slots
PSEUDO_MAP_FD = 1  # src_reg of an ld_imm64 whose imm is a map fd
MOV_K = 0xB7  # BPF_ALU64 | BPF_MOV | BPF_K
EXIT = 0x95  # BPF_JMP | BPF_EXIT


def insn(code: int, *, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One `struct bpf_insn`, for programs written by hand (a probe, the tests)."""
    return INSN.pack(code, src << 4 | dst, off, imm)


class ObjectError(ValueError):
    """The object is malformed or does not fit what it is loaded against."""


@dataclass(frozen=True)
class MapDef:
    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    btf_key_type_id: int = 0
    btf_value_type_id: int = 0


@dataclass(frozen=True)
class ProgDef:
    name: str
    type: int
    insns: bytes
    relocs: tuple[tuple[int, int], ...]  # (instruction index, index into BpfObject.maps)


@dataclass(frozen=True)
class FuncDef:
    """A function of the object that programs call (a bpf_loop callback), not a program itself."""

    name: str
    insns: bytes
    relocs: tuple[tuple[int, int], ...]  # (instruction index, index into BpfObject.maps)


@dataclass(frozen=True)
class BpfObject:
    build: str
    license: str
    kern_version: int
    btf: bytes  # b"" when the compiler's BTF could not be read: maps are then created without it
    maps: tuple[MapDef, ...]
    programs: tuple[ProgDef, ...]
    functions: tuple[FuncDef, ...] = ()
    # Whether the build runs the SNAT walk in bpf_loop callbacks (EKP_SNAT_BPF_LOOP=1,
    # agent/ebpf/snatloop.py): only then does a program's ProgSpec.callback mean anything
    bpf_loop: bool = True

    def map_index(self, name: str) -> int:
        for i, m in enumerate(self.maps):
            if m.name == name:
                return i
        raise ObjectError(f"build {self.build} has no map {name!r}")

    def program(self, name: str) -> ProgDef:
        for p in self.programs:
            if p.name == name:
                return p
        raise ObjectError(f"build {self.build} has no program {name!r}")

    def function(self, name: str) -> FuncDef:
        for f in self.functions:
            if f.name == name:
                return f
        raise ObjectError(f"build {self.build} has no function {name!r}")

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "build": self.build,
            "license": self.license,
            "kern_version": self.kern_version,
            "btf": base64.b64encode(self.btf).decode(),
            "bpf_loop": self.bpf_loop,
            "maps": [m.__dict__ for m in self.maps],
            "programs": [
                {
                    "name": p.name,
                    "type": p.type,
                    "insns": base64.b64encode(p.insns).decode(),
                    "relocs": [list(r) for r in p.relocs],
                }
                for p in self.programs
            ],
            "functions": [
                {
                    "name": f.name,
                    "insns": base64.b64encode(f.insns).decode(),
                    "relocs": [list(r) for r in f.relocs],
                }
                for f in self.functions
            ],
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> BpfObject:
        """Parse and check the JSON form; ObjectError when anything is off."""
        try:
            doc = json.loads(data)
            if doc["format"] != FORMAT:
                raise ObjectError(f"format {doc['format']}, expected {FORMAT}")
            maps = tuple(MapDef(**m) for m in doc["maps"])
            programs = tuple(
                ProgDef(
                    name=str(p["name"]),
                    type=int(p["type"]),
                    insns=base64.b64decode(p["insns"], validate=True),
                    relocs=tuple((int(i), int(m)) for i, m in p["relocs"]),
                )
                for p in doc["programs"]
            )
            functions = tuple(
                FuncDef(
                    name=str(f["name"]),
                    insns=base64.b64decode(f["insns"], validate=True),
                    relocs=tuple((int(i), int(m)) for i, m in f["relocs"]),
                )
                for f in doc["functions"]
            )
            obj = cls(
                build=str(doc["build"]),
                license=str(doc["license"]),
                kern_version=int(doc["kern_version"]),
                btf=base64.b64decode(doc["btf"], validate=True),
                maps=maps,
                programs=programs,
                functions=functions,
                bpf_loop=bool(doc["bpf_loop"]),
            )
        except ObjectError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ObjectError(f"not a compiled data path object: {exc}") from exc
        for p in obj.programs:
            check_relocs(p, len(obj.maps))
        for f in obj.functions:
            check_relocs(f, len(obj.maps))
        if obj.functions and not obj.bpf_loop:
            raise ObjectError(
                "a build without bpf_loop callbacks holds functions: "
                + ", ".join(f.name for f in obj.functions)
            )
        return obj


def find_relocs(insns: bytes, map_of_fd: Mapping[int, int]) -> tuple[tuple[int, int], ...]:
    """The map references in `insns`: (instruction index, map index) for each ld_imm64 of a map fd,
    `map_of_fd` naming the map behind each fd the compiler used. ObjectError for an unknown fd or
    any other kind of pseudo source (bcc emits none: it has no global data)."""
    if len(insns) % INSN.size:
        raise ObjectError(f"{len(insns)} bytes is not a whole number of instructions")
    out = []
    i = 0
    count = len(insns) // INSN.size
    while i < count:
        code, regs, _, imm = INSN.unpack_from(insns, i * INSN.size)
        if code == LD_IMM64:
            src = regs >> 4
            if src == PSEUDO_MAP_FD:
                if imm not in map_of_fd:
                    raise ObjectError(f"instruction {i} loads fd {imm}, which is no map of this build")
                out.append((i, map_of_fd[imm]))
            elif src:
                raise ObjectError(f"instruction {i}: ld_imm64 of pseudo source {src}, which nothing binds")
            i += 2  # the second half of the 64-bit immediate
            continue
        i += 1
    return tuple(out)


def check_relocs(prog: ProgDef | FuncDef, nmaps: int) -> None:
    """Every relocation names an ld_imm64 of a map fd and a map of the object."""
    count = len(prog.insns) // INSN.size
    if len(prog.insns) % INSN.size or not prog.insns:
        raise ObjectError(f"program {prog.name}: {len(prog.insns)} bytes of instructions")
    for insn, m in prog.relocs:
        if not (0 <= insn < count and 0 <= m < nmaps):
            raise ObjectError(f"program {prog.name}: relocation ({insn}, {m}) out of range")
        code, regs, _, _ = INSN.unpack_from(prog.insns, insn * INSN.size)
        if code != LD_IMM64 or regs >> 4 != PSEUDO_MAP_FD:
            raise ObjectError(f"program {prog.name}: instruction {insn} does not load a map")


def relocate(prog: ProgDef | FuncDef, fds: Sequence[int]) -> bytes:
    """The program's instructions with each map reference bound to `fds[map index]`."""
    out = bytearray(prog.insns)
    for insn, m in prog.relocs:
        code, regs, off, _ = INSN.unpack_from(out, insn * INSN.size)
        INSN.pack_into(out, insn * INSN.size, code, regs, off, fds[m])
    return bytes(out)
