"""bench.changecost at a small scale: every change reaches the maps, and the periodic resync and the
clean stop are timed, the stop leaving the planner and the records where the next start looks."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

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
