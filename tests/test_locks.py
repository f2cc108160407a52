"""The dependency locks: what a fresh machine and the image install is what the tests ran.

`requirements/dev.lock` (setup.sh) and `requirements/agent.lock` (the Dockerfile) are written by
`make lock` (scripts/lock.sh) from pyproject.toml's ranges. Checked here: every entry is an exact
pin with hashes; the pins satisfy the ranges; the agent's lock is the dev lock's runtime part at the
same versions; the virtualenv running this test holds exactly the dev lock's versions (setup.sh
installed it, nothing resolved beside it); and pip accepts the agent lock alone with
--require-hashes, which it does only when the lock is the whole dependency closure.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
DEV_LOCK = REPO / "requirements" / "dev.lock"
AGENT_LOCK = REPO / "requirements" / "agent.lock"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

_ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)\s*$")


def pins(path: Path) -> dict[str, str]:
    """name -> version of a lock; fails on any entry that is not `name==version --hash=...`."""
    text = re.sub(r"\s*\\\n\s*", " ", path.read_text())  # join the continuation lines
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].rstrip() if line.lstrip().startswith("#") else line.rstrip()
        if not line:
            continue
        match = _ENTRY.match(line)
        assert match, f"{path.name}: not an exact pin with hashes: {line[:120]}"
        name = canonicalize_name(match.group(1))
        assert name not in out, f"{path.name}: {name} twice"
        out[name] = match.group(2)
    return out


def _satisfied(requirements: list[str], locked: dict[str, str], where: str) -> None:
    for text in requirements:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in locked, f"{name} ({where}) has no pin"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"{name}=={locked[name]} does not satisfy {req} ({where})"
        )


def test_every_entry_is_an_exact_pin_with_hashes_and_satisfies_pyproject() -> None:
    dev, agent = pins(DEV_LOCK), pins(AGENT_LOCK)
    runtime = PYPROJECT["project"]["dependencies"]
    _satisfied(runtime, agent, "project.dependencies")
    _satisfied(runtime + PYPROJECT["project"]["optional-dependencies"]["dev"], dev, "dev")
    _satisfied(PYPROJECT["build-system"]["requires"], agent, "build-system.requires")
    _satisfied(PYPROJECT["build-system"]["requires"], dev, "build-system.requires")


def test_the_agent_lock_is_the_dev_locks_runtime_part_at_the_same_versions() -> None:
    dev, agent = pins(DEV_LOCK), pins(AGENT_LOCK)
    differing = {
        name: (version, dev.get(name)) for name, version in agent.items() if dev.get(name) != version
    }
    assert not differing, f"agent.lock vs dev.lock: {differing}; run `make lock`"
    assert "pytest" in dev and "pytest" not in agent, "the image carries no test tools"


def test_this_virtualenv_holds_exactly_the_dev_lock() -> None:
    installed: dict[str, str] = {
        canonicalize_name(dist.metadata["Name"]): dist.version
        for dist in metadata.distributions()
        if dist.metadata["Name"]
    }
    wrong = {name: (version, installed.get(name)) for name, version in pins(DEV_LOCK).items()
             if installed.get(name) != version}  # fmt: skip
    assert not wrong, f"(locked, installed) differ: {wrong}; run scripts/setup.sh"
    extra = set(installed) - set(pins(DEV_LOCK)) - {"ebpf-kube-proxy", "pip"}
    assert not extra, f"installed but not locked: {sorted(extra)}"


@pytest.mark.timeout(600)
def test_pip_installs_the_agent_lock_alone_with_require_hashes() -> None:
    # --require-hashes makes pip refuse a lock that misses a dependency of any entry ("all
    # requirements must have their versions pinned"), so passing means the closure is whole.
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--disable-pip-version-check", "--report", "-", "--require-hashes", "-r", str(AGENT_LOCK)],
        capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    resolved = {
        canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
        for i in json.loads(res.stdout)["install"]
    }
    assert resolved == pins(AGENT_LOCK)
