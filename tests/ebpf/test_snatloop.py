"""Which loop runs the SNAT port walk (agent/ebpf/snatloop.py): the kernel's answer to a bpf_loop
load decides the cflag, the test knob forces the bounded loop, and each build links by its own
rules (agent/ebpf/link.py callback_of)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import MapSizes
from agent.ebpf.bpfobject import BpfObject, FuncDef, ObjectError, ProgDef
from agent.ebpf.calls import CallError, link_callback
from agent.ebpf.link import LinkError, callback_of, load_program
from agent.ebpf.loader import Datapath, compile_cflags
from agent.ebpf.programs import PROG_EGRESS, PROG_FROM_POD, PROGRAMS, SNAT_CALLBACK
from agent.ebpf.snatloop import BOUNDED, ENV, SnatWalk, build_has_bpf_loop, decide, kernel_probe, probe
from tests.ebpf.test_calls import CALLBACK, PROGRAM


def test_a_kernel_that_loads_bpf_loop_gets_the_callback_build() -> None:
    walk = decide({}, probe=lambda: "")
    assert walk.bpf_loop and walk.cflag == "-DEKP_SNAT_BPF_LOOP=1"
    assert "bpf_loop callback" in walk.describe()


def test_a_kernel_refusing_the_probe_gets_the_bounded_loop_and_the_kernels_words() -> None:
    why = "this kernel has no bpf_loop helper (invalid func unknown#181)"
    walk = decide({}, probe=lambda: why)
    assert not walk.bpf_loop and walk.cflag == "-DEKP_SNAT_BPF_LOOP=0"
    assert walk.describe().startswith(f"the SNAT port walk runs in a bounded loop ({why}): a cold start")


def test_the_test_knob_forces_the_bounded_loop_without_asking_the_kernel() -> None:
    def never() -> str:
        raise AssertionError("probed")

    assert decide({ENV: BOUNDED}, probe=never) == SnatWalk(False, f"{ENV}={BOUNDED}, a test knob")
    with pytest.raises(ValueError, match="the only value is 'bounded'"):
        decide({ENV: "bpf_loop"}, probe=never)


@pytest.mark.kernel
def test_this_kernel_loads_the_probe_and_the_answer_is_kept() -> None:
    """6.18 has bpf_loop: the probe's program loads (its linking and BTF as the data path's)."""
    assert probe() == ""
    kernel_probe.cache_clear()
    assert kernel_probe() == "" and kernel_probe.cache_info().misses == 1
    assert kernel_probe() == "" and kernel_probe.cache_info().hits == 1


def test_the_cflag_is_in_the_build_id_and_a_data_path_decides_once(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes, bpf_dir = MapSizes(), Path("/nonexistent")
    loop = compile_cflags(sizes, bpf_dir, SnatWalk(True, ""))
    bounded = compile_cflags(sizes, bpf_dir, SnatWalk(False, ""))
    assert build_has_bpf_loop(loop) and not build_has_bpf_loop(bounded)
    with pytest.raises(ValueError, match="EKP_SNAT_BPF_LOOP"):
        build_has_bpf_loop([f for f in loop if "SNAT" not in f])
    monkeypatch.setenv(ENV, BOUNDED)
    dp = Datapath("/sys/fs/bpf/unused", sizes)
    bounded_build = dp.build()
    monkeypatch.delenv(ENV)
    monkeypatch.setattr("agent.ebpf.snatloop.kernel_probe", lambda: "")
    assert dp.build() == bounded_build  # decided once: a loaded data path keeps its build
    assert Datapath("/sys/fs/bpf/unused", sizes).build() != bounded_build


def _obj(bpf_loop: bool, functions: tuple[FuncDef, ...] = ()) -> BpfObject:
    return BpfObject(
        "abcdef012345",
        "GPL",
        0,
        b"",
        (),
        (ProgDef(PROG_FROM_POD, 3, PROGRAM, ()), ProgDef(PROG_EGRESS, 3, PROGRAM, ())),
        functions,
        bpf_loop,
    )


def test_a_bounded_build_links_no_callback_even_for_a_program_naming_one() -> None:
    assert PROGRAMS[PROG_FROM_POD].callback == SNAT_CALLBACK
    assert callback_of(_obj(False), PROGRAMS[PROG_FROM_POD]) is None
    # ...so an unresolved reference in it is refused as in any program naming none
    with pytest.raises(LinkError, match=r"linking program ekp_from_pod .*no callback named"):
        load_program(_obj(False), PROG_FROM_POD, [])


def test_a_bpf_loop_build_without_the_named_callback_is_refused() -> None:
    with pytest.raises(LinkError, match=r"linking program ekp_from_pod .*no function 'ekp_snat_callback'"):
        load_program(_obj(True), PROG_FROM_POD, [])
    cb = FuncDef(SNAT_CALLBACK, CALLBACK, ())
    assert callback_of(_obj(True, (cb,)), PROGRAMS[PROG_FROM_POD]) == cb
    assert callback_of(_obj(True, (cb,)), PROGRAMS[PROG_EGRESS]) is None
    with pytest.raises(CallError, match="no callback named"):
        link_callback(
            _obj(True, (cb,)).program(PROG_EGRESS), callback_of(_obj(True, (cb,)), PROGRAMS[PROG_EGRESS])
        )


def test_a_bounded_build_holding_functions_is_not_an_object_the_compiler_made() -> None:
    cb = FuncDef(SNAT_CALLBACK, CALLBACK, ())
    assert BpfObject.from_json(_obj(False).to_json()).bpf_loop is False
    with pytest.raises(ObjectError, match="without bpf_loop callbacks holds functions: ekp_snat_callback"):
        BpfObject.from_json(_obj(False, (cb,)).to_json())
