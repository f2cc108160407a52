"""The packet lab's data path in its bounded-loop build (the SNAT walk of a kernel without
bpf_loop, bpf/ekp_snat_af.h), forced on this kernel with the test knob EKP_BPF_SNAT_LOOP=bounded
(agent/ebpf/snatloop.py): the modules that run SNAT-walk tests on it define `dp` from this."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from agent.ebpf.loader import Datapath
from agent.ebpf.snatloop import BOUNDED, ENV
from lab.dplab import SIZES
from lab.packets import bpffs


@contextmanager
def bounded_datapath() -> Iterator[Datapath]:
    with bpffs() as root:
        datapath = Datapath(str(root / "ekp"), SIZES)
        # Decided at the load (Datapath.snat_walk) and kept: the variable is this load's alone.
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(ENV, BOUNDED)
            datapath.load()
        try:
            yield datapath
        finally:
            datapath.close()


@pytest.fixture(scope="module")
def dp() -> Iterator[Datapath]:
    """The module's packet lab data path, its bounded-loop build (imported by the modules that use it)."""
    with bounded_datapath() as datapath:
        yield datapath


def test_the_data_path_here_walks_in_a_bounded_loop(dp: Datapath) -> None:
    assert_bounded(dp)


def assert_bounded(dp: Datapath) -> None:
    """The data path under test is the bounded build: no callback in its object, none linked."""
    obj = dp.cache.get(dp.build())
    assert obj is not None and obj.bpf_loop is False and obj.functions == ()
    assert dp.snat_walk().bpf_loop is False
