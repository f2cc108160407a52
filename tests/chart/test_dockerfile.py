"""What can be checked of the Dockerfile without a container engine (none runs here).

The file parses into instructions; the base is a pinned Debian bookworm slim; the entrypoint is the
`agent` console script; every apt package it installs exists in Debian bookworm (`apt-cache show`
on this bookworm machine), installed without recommends and without leaving lists behind; the
pip install names exact versions that satisfy pyproject.toml and resolves with pip; what it
copies exists; EKP_BPF_DIR points where bpf/ is copied.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.chart.render import REPO

DOCKERFILE = REPO / "Dockerfile"
CONSTRAINTS = REPO / "docker" / "constraints.txt"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        current = ""
    assert not current, "a continuation runs past the end of the file"
    return out


@pytest.fixture(scope="module")
def steps() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


KNOWN = {"ARG", "FROM", "ENV", "RUN", "COPY", "ENTRYPOINT", "CMD", "LABEL", "WORKDIR", "USER"}


def test_it_parses_and_the_base_is_pinned_bookworm(steps: list[tuple[str, str]]) -> None:
    assert {word for word, _ in steps} <= KNOWN, steps
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    base = next(a for w, a in steps if w == "FROM")
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"debian:12\.\d+-slim(@sha256:[0-9a-f]{64})?", image), image
    release = Path("/etc/debian_version").read_text().strip()
    assert image.startswith(f"debian:{release}-slim"), f"the image's release is this machine's ({release})"


def test_the_entrypoint_is_the_agent_command(steps: list[tuple[str, str]]) -> None:
    entry = [json.loads(a) for w, a in steps if w == "ENTRYPOINT"]
    assert entry == [["agent"]]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["agent"] == "agent.cli:main"
    path_env = next(a for w, a in steps if w == "ENV" and a.startswith("PATH="))
    assert path_env.startswith("PATH=/opt/ebpf-kube-proxy/venv/bin:"), "where pip puts the agent script"


def apt_packages(steps: list[tuple[str, str]]) -> list[str]:
    pkgs: list[str] = []
    for word, args in steps:
        if word != "RUN":
            continue
        for command in args.split("&&"):
            tokens = command.split()
            if tokens[:2] == ["apt-get", "install"]:
                assert "--no-install-recommends" in tokens, command
                pkgs += [t for t in tokens[2:] if not t.startswith("-")]
    return pkgs


def test_every_apt_package_exists_in_bookworm(steps: list[tuple[str, str]]) -> None:
    os_release = dict(
        line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line
    )
    assert os_release["VERSION_CODENAME"] == "bookworm", "apt-cache answers for this machine's release"
    pkgs = apt_packages(steps)
    assert {"python3-bpfcc", "bpftool", "iptables", "conntrack", "nftables", "iproute2", "procps"} <= set(
        pkgs
    )
    missing = []
    for pkg in pkgs:
        res = subprocess.run(
            ["apt-cache", "show", "--no-all-versions", pkg], capture_output=True, text=True, check=False
        )
        if res.returncode != 0 or f"Package: {pkg}" not in res.stdout:
            missing.append(pkg)
    assert not missing, f"not in this machine's apt lists (bookworm): {missing}"
    run = " ".join(a for w, a in steps if w == "RUN")
    assert "rm -rf /var/lib/apt/lists/*" in run, "no apt lists left in the image"


def test_every_copied_path_exists_and_bpf_dir_matches(steps: list[tuple[str, str]]) -> None:
    copies = [a.split() for w, a in steps if w == "COPY"]
    for *sources, _ in copies:
        for src in sources:
            assert (REPO / src).exists(), src
    bpf_dest = next(dest for *srcs, dest in copies if srcs == ["bpf"])
    env = " ".join(a for w, a in steps if w == "ENV")
    assert f"EKP_BPF_DIR={bpf_dest}" in env
    assert (REPO / "bpf" / "ekp_tc.c").exists()


def test_the_pip_install_resolves_against_pyproject(steps: list[tuple[str, str]]) -> None:
    run = " ".join(a for w, a in steps if w == "RUN")
    assert re.search(r"pip install --no-cache-dir .*--constraint /src/constraints.txt /src", run), run
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            spec = list(req.specifier)
            assert len(spec) == 1 and spec[0].operator == "==", f"not an exact pin: {line}"
            pins[req.name.lower().replace("_", "-")] = spec[0].version
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for text in declared:
        req = Requirement(text)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{name} is a dependency but has no pin in {CONSTRAINTS.name}"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} does not satisfy {req}"
    # pip itself resolves the project with the pins (metadata only, nothing installed).
    res = subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--disable-pip-version-check", "--report", "-", "--constraint", str(CONSTRAINTS), str(REPO),
        ],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    resolved = {
        i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]
    }
    assert (
        resolved.pop("ebpf-kube-proxy")
        == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    )
    assert resolved == pins, "the pins are the whole runtime closure, nothing more, nothing less"
