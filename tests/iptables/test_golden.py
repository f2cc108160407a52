"""Golden tests: each realistic cluster state renders to exactly its checked-in restore text.

The `.rules` files are what `agent --mode=iptables --dry-run` prints (render_dry_run), i.e. the
input kube-proxy would give iptables-restore on the same node. Regenerate them only on purpose:
`make golden` (EKP_REGEN_GOLDEN=1), then review the diff.
"""

from __future__ import annotations

import difflib
import os

import pytest

from agent.iptables import render_dry_run
from tests.iptables.golden_cases import GOLDEN_DIR, case_inputs, case_names

REGEN = os.environ.get("EKP_REGEN_GOLDEN") == "1"

REQUIRED_CASES = {
    "kube-dns",
    "kubernetes-api",
    "nodeport",
    "loadbalancer-local",
    "affinity",
    "no-endpoints",
    "multi-port",
    "terminating",
}


def test_required_cases_are_present() -> None:
    assert set(case_names()) >= REQUIRED_CASES


@pytest.mark.parametrize("case", case_names())
def test_golden(case: str) -> None:
    state, node, config = case_inputs(case)
    got = render_dry_run(state, node, config)
    path = GOLDEN_DIR / f"{case}.rules"
    if REGEN:
        path.write_text(got)
    assert path.exists(), f"{path.name} missing: run `make golden` and review it"
    want = path.read_text()
    if got != want:
        diff = "".join(
            difflib.unified_diff(want.splitlines(True), got.splitlines(True), "golden", "rendered")
        )
        pytest.fail(f"{case}: rendered rules differ from {path.name}:\n{diff}")


def test_cli_dry_run_prints_the_golden_text(capsys: pytest.CaptureFixture[str]) -> None:
    """`agent --mode=iptables --dry-run` goes through the same renderer, needs no root."""
    from agent.cli import main

    rc = main(
        [
            "--mode=iptables",
            "--dry-run",
            "--services-file",
            str(GOLDEN_DIR / "loadbalancer-local.yaml"),
            "--hostname-override",
            "node1",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--node-ip",
            "192.168.0.11",
        ]
    )
    assert rc == 0
    assert capsys.readouterr().out == (GOLDEN_DIR / "loadbalancer-local.rules").read_text()
