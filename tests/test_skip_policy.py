"""The suite's own rule: `make test` never passes with something skipped (tests/conftest.py).

A throwaway test file with one passing and one skipped test is run by pytest in a child process with
this suite's conftest loaded as a plugin: without EKP_ALLOW_SKIP the run fails and names the skipped
test; with EKP_ALLOW_SKIP=1 it passes; under CI it fails even with EKP_ALLOW_SKIP=1. A kernel test on
a machine that cannot run it is a failure, not a skip, in every case but the opt-out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SAMPLE = """
import pytest

def test_runs():
    assert True

def test_skips():
    pytest.skip("no widget here")
"""


def run_sample(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "EKP_ALLOW_SKIP")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_sample.py")],
        cwd=REPO, env=clean | env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_skip_fails_the_run_and_is_named(tmp_path: Path) -> None:
    res = run_sample(tmp_path)
    assert res.returncode == pytest.ExitCode.TESTS_FAILED, res.stdout
    assert "1 passed, 1 skipped" in res.stdout
    assert "1 item(s) skipped, and this run allows none" in res.stdout
    assert "test_sample.py::test_skips: Skipped: no widget here" in res.stdout


def test_the_explicit_opt_out_allows_skips(tmp_path: Path) -> None:
    res = run_sample(tmp_path, EKP_ALLOW_SKIP="1")
    assert res.returncode == pytest.ExitCode.OK, res.stdout
    assert "1 passed, 1 skipped" in res.stdout


def test_ci_allows_no_skip_whatever_the_opt_out_says(tmp_path: Path) -> None:
    res = run_sample(tmp_path, EKP_ALLOW_SKIP="1", CI="true")
    assert res.returncode == pytest.ExitCode.TESTS_FAILED, res.stdout
    assert "this run allows none" in res.stdout


def test_a_kernel_test_without_root_fails_rather_than_skips() -> None:
    """As a user without root: the lab's gate fails the test, it does not skip it."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # pytest's own tmp_path is root's alone
        tmp_path = Path(tmp)
        (tmp_path / "test_sample.py").write_text(
            "import pytest\n\n@pytest.mark.kernel\ndef test_lab():\n    pass\n"
        )
        res = _run_as_nobody(tmp_path)
    assert res.returncode == pytest.ExitCode.TESTS_FAILED, res.stdout + res.stderr
    assert "kernel test cannot run: kernel tests need root" in res.stdout, res.stdout
    assert "1 error" in res.stdout  # failed in setup, before the test body


def _run_as_nobody(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "EKP_ALLOW_SKIP")}
    return subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-m", "pytest",
         "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", "-c", os.devnull,
         "--rootdir", str(tmp_path), "-o", "markers=kernel", str(tmp_path / "test_sample.py")],
        cwd=REPO, env=clean | {"PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
