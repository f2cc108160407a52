"""Which loop runs the SNAT port walk's probes on this node (bpf/ekp_snat_af.h).

Two drivers of the same probe code, chosen when the data path is compiled (the cflag
EKP_SNAT_BPF_LOOP, part of the build id like every cflag):

* a bpf_loop callback (Linux 5.17), linked by the loader (agent/ebpf/calls.py): the verifier
  checks the probe once per calling state, a third less of a cold start's verifier work;
* the bounded loop, which the verifier walks once per probe: the data path's minimum kernel
  (agent/ebpf/programs.py MIN_KERNEL) has no bpf_loop.

The running kernel is asked, not its version: distributions backport bpf_loop to older release
numbers (RHEL 9's 5.14), and a kernel built without BTF cannot take the callback's func_info
whatever its number. `probe()` loads a two-instruction program that passes a callback to
bpf_loop, linked the way the data path's programs are, once per process.

EKP_BPF_SNAT_LOOP=bounded (an environment variable, a test knob, not a flag) forces the bounded
loop where the kernel has bpf_loop: the tests run the bounded build on a new kernel with it. An
environment variable rather than a Config field because it must reach every data path a test
process or its agents build (packet-lab fixtures, agents started as subprocesses), and no operator
has a reason to turn the faster driver off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agent.ebpf import bpfsys
from agent.ebpf.bpfobject import EXIT, LD_IMM64, MOV_K, FuncDef, ProgDef, insn
from agent.ebpf.calls import CALLBACK_ARG, HELPER_LOOP, JMP_CALL, func_btf, link_callback

ENV = "EKP_BPF_SNAT_LOOP"
BOUNDED = "bounded"
CFLAG = "-DEKP_SNAT_BPF_LOOP="
_PROG_SCHED_CLS = 3


@dataclass(frozen=True)
class SnatWalk:
    bpf_loop: bool
    why: str  # for the operator: what decided it

    @property
    def cflag(self) -> str:
        return f"{CFLAG}{int(self.bpf_loop)}"

    def describe(self) -> str:
        if self.bpf_loop:
            return f"the SNAT port walk runs in a bpf_loop callback ({self.why})"
        return (
            f"the SNAT port walk runs in a bounded loop ({self.why}): a cold start verifies longer, "
            "about 60% more verifier work in all, three times in the tc ingress programs, than "
            "on a kernel with bpf_loop (Linux 5.17+, or a backport)"
        )


# bpf_loop(1, <callback>, NULL, 0); return 0. The callback returns 0.
_PROGRAM = b"".join(
    [
        insn(MOV_K, dst=1, imm=1),
        insn(LD_IMM64, dst=CALLBACK_ARG),
        insn(0),
        insn(MOV_K, dst=3),
        insn(MOV_K, dst=4),
        insn(JMP_CALL, imm=HELPER_LOOP),
        insn(MOV_K),
        insn(EXIT),
    ]
)
_CALLBACK = insn(MOV_K) + insn(EXIT)
_LOG_BYTES = 1 << 12


def probe() -> str:
    """ "" where the running kernel loads a program that passes a callback to bpf_loop (linked as
    the data path's are: agent/ebpf/calls.py), else why not, from the kernel's words."""
    linked = link_callback(
        ProgDef("ekp_probe_loop", _PROG_SCHED_CLS, _PROGRAM, ()), FuncDef("ekp_probe_cb", _CALLBACK, ())
    )
    btf, func_info = func_btf(linked.func_info)
    btf_fd = bpfsys.btf_load(btf)
    if btf_fd < 0:
        return f"the kernel refuses the callback's BTF: {os.strerror(-btf_fd)}"
    log = ctypes.create_string_buffer(_LOG_BYTES)
    try:
        fd = bpfsys.prog_load(
            _PROG_SCHED_CLS,
            linked.prog.insns,
            "GPL",
            "ekp_probe_loop",
            log=log,
            prog_btf_fd=btf_fd,
            func_info=func_info,
        )
    finally:
        os.close(btf_fd)
    if fd >= 0:
        os.close(fd)
        return ""
    said = log.value.decode(errors="replace").strip().splitlines()
    last = said[-1] if said else os.strerror(-fd)
    if "unknown func" in last or "invalid func" in last:
        return f"this kernel has no bpf_loop helper ({last})"
    return f"this kernel refuses a bpf_loop call: {last}"


@functools.cache
def kernel_probe() -> str:
    """probe(), once per process: the kernel's helpers do not change while it runs."""
    return probe()


def decide(env: Mapping[str, str] | None = None, probe: Callable[[], str] | None = None) -> SnatWalk:
    """The driver for this node: bpf_loop where the kernel loads it, unless the test knob ENV says
    "bounded". Another value of ENV is a mistake: ValueError."""
    forced = (os.environ if env is None else env).get(ENV, "")
    if forced == BOUNDED:
        return SnatWalk(False, f"{ENV}={BOUNDED}, a test knob")
    if forced:
        raise ValueError(f"{ENV}={forced!r}: the only value is {BOUNDED!r} (unset: the kernel decides)")
    why = (probe or kernel_probe)()
    if why:
        return SnatWalk(False, why)
    return SnatWalk(True, "this kernel loads one")


def build_has_bpf_loop(cflags: Sequence[str]) -> bool:
    """Whether a build of `cflags` has the callbacks (its EKP_SNAT_BPF_LOOP; ValueError if none:
    bpf/ekp_snat.h refuses to compile without it)."""
    given = [f[len(CFLAG) :] for f in cflags if f.startswith(CFLAG)]
    if len(given) != 1 or given[0] not in ("0", "1"):
        raise ValueError(f"the cflags give EKP_SNAT_BPF_LOOP {given or 'not at all'}: want one, 0 or 1")
    return given[0] == "1"
