"""bench.changecost at a small scale: every change reaches the maps, and the periodic resync and the
clean stop are timed, the stop leaving the planner and the records where the next start looks."""

from __future__ import annotations

import gc
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.ebpf import snapshot
from bench import api, changecost


def test_changes_a_resync_and_a_stop_at_a_small_scale(tmp_path: Path) -> None:
    out = changecost.run(40, 3, changes=6, top=2, stop_dir=str(tmp_path), periodic=1)
    assert "6 changes" in out
    assert "periodic resync:" in out and "reconcile" in out
    assert "stop:" in out and "write the planner" in out and "write the records" in out
    kept = sorted(name.split("-")[0] for name in os.listdir(tmp_path))
    assert kept == ["planner", "records"], "the clean stop kept both files for the next start"


def test_the_bench_gives_the_restarts_stop_the_charts_grace_period() -> None:
    # A stop killed before it wrote the planner and the records makes the next start read every
    # map back: the restart measured would not be the clean one it is reported as.
    values = yaml.safe_load((Path(__file__).parents[1] / "charts/ebpf-kube-proxy/values.yaml").read_text())
    assert values["terminationGracePeriodSeconds"] == api.STOP_GRACE_S


def test_a_sigkill_before_the_grace_ran_out_is_not_the_stop_s_kill() -> None:
    assert api.killed_at_grace(-signal.SIGKILL, api.STOP_GRACE_S + 0.2)
    assert not api.killed_at_grace(-signal.SIGKILL, 2.0), "the OOM killer's, not the stop's"
    assert not api.killed_at_grace(0, api.STOP_GRACE_S + 0.2)


class _Shutdown:
    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def shutdown(self) -> None:
        if self.fails:
            raise RuntimeError("the stop failed")


class _Px:
    def _dump(self) -> None: ...


class _Records:
    def save(self) -> None: ...


@pytest.mark.parametrize("fails", [False, True])
def test_the_timed_stop_puts_back_every_patch(fails: bool) -> None:
    """Whatever the stop did, what it wrapped to time is put back (as resync does): a later bench in
    the same process would time, and count in the wrong phase, the wrappers left."""
    px, records = _Px(), _Records()
    before = (px._dump, records.save, vars(snapshot)["from_dump"], snapshot.write, list(gc.callbacks))
    agent: Any = _Shutdown(fails)
    if fails:
        with pytest.raises(RuntimeError):
            changecost.stop(agent, px, records, changecost.Phases())  # type: ignore[arg-type]
    else:
        changecost.stop(agent, px, records, changecost.Phases())  # type: ignore[arg-type]
    assert (px._dump, records.save, vars(snapshot)["from_dump"], snapshot.write, list(gc.callbacks)) == before
