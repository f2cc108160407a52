"""The compiler child: programs compiled once, pinned, reused by the next agent; no bcc in the agent."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from agent.config import MapSizes
from agent.ebpf.abi import MAPS
from agent.ebpf.compile import PROG_PIN_PREFIX, build_id, prog_map_ids
from agent.ebpf.loader import PRIVATE_MAPS, Datapath
from agent.ebpf.programs import PROG_SCHED_CLS, PROG_XDP, PROGRAMS
from lab.packets import bpffs

SMALL = MapSizes(
    fe=128, slot=256, be=128, rnat=128, member=256, ct_tcp=1024, ct_any=1024, frag=64, aff=128, srcr=32
)


def test_the_build_id_follows_source_flags_and_abi() -> None:
    base = build_id("int x;", ["-DA=1"], 1)
    assert base == build_id("int x;", ["-DA=1"], 1)
    assert (
        len(
            {
                base,
                build_id("int y;", ["-DA=1"], 1),
                build_id("int x;", ["-DA=2"], 1),
                build_id("int x;", ["-DA=1"], 2),
            }
        )
        == 4
    )


def test_importing_and_using_the_agent_s_ebpf_modules_never_loads_bcc() -> None:
    code = (
        "import sys, agent.cli, agent.ebpf.proxier, agent.ebpf.loader, agent.ebpf.maps, agent.inspect; "
        "assert 'bcc' not in sys.modules, sorted(m for m in sys.modules if m.startswith('bcc'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _prog_pins(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(PROG_PIN_PREFIX))


@pytest.mark.kernel
def test_a_second_load_reuses_the_pinned_programs_and_new_sizes_rebuild(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with bpffs() as root:
        pins = str(root / "ekp")
        loads_without_bcc = (
            "import sys; from agent.ebpf.loader import Datapath; from agent.config import MapSizes; "
            f"d = Datapath({pins!r}, MapSizes(**{SMALL.__dict__!r})); d.load(); d.close(); "
            "assert 'bcc' not in sys.modules, 'compiling must happen in a child process'"
        )
        subprocess.run([sys.executable, "-c", loads_without_bcc], check=True)
        first = Datapath(pins, SMALL)
        first.load()
        try:
            built = _prog_pins(pins)
            assert len(built) == len(PROGRAMS)
            ids = {m.info().id for m in first.maps.values()}
            for name in PROGRAMS:
                used = prog_map_ids(first.prog_fd(name))
                assert used & ids, "the programs use the pinned maps"
                # besides them, the tc programs use their load's own scratch, the others nothing
                private = PRIVATE_MAPS if PROGRAMS[name].prog_type in (PROG_SCHED_CLS, PROG_XDP) else 0
                assert len(used - ids) == private, name
        finally:
            first.close()
        assert "data path reused" in caplog.text, "the first agent compiled; this one (a restart) reuses"
        assert _prog_pins(pins) == built

        # Other sizes make other programs (the sizes are compiled in): rebuilt, old ones unpinned.
        # The existing pins must match the sizes, so start from an empty directory of maps.
        for name in os.listdir(pins):
            if not name.startswith(PROG_PIN_PREFIX):
                os.unlink(os.path.join(pins, name))
        caplog.clear()
        bigger = Datapath(pins, replace(SMALL, fe=256))
        bigger.load()
        bigger.close()
        assert "data path compiled in" in caplog.text
        rebuilt = _prog_pins(pins)
        assert len(rebuilt) == len(PROGRAMS) and not set(rebuilt) & set(built)


@pytest.mark.kernel
def test_programs_whose_maps_were_replaced_are_compiled_again(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with bpffs() as root:
        pins = str(root / "ekp")
        first = Datapath(pins, SMALL)
        first.load()
        first.close()
        os.unlink(os.path.join(pins, MAPS["fe"].name))  # a new, empty map will be made
        caplog.clear()
        second = Datapath(pins, SMALL)
        second.load()
        second.close()
        assert "data path compiled in" in caplog.text
