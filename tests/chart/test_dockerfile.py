"""What can be checked of the Dockerfile without a container engine (none runs here).

The file parses into instructions; the base is a pinned Debian bookworm slim; the entrypoint is the
`agent` console script; every apt package it installs exists in Debian bookworm (`apt-cache show`
on this bookworm machine), installed without recommends and without leaving lists behind; the
pip install takes requirements/agent.lock with its hashes, then the agent without dependencies; what it
copies exists; EKP_BPF_DIR points where bpf/ is copied.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.chart.render import REPO

DOCKERFILE = REPO / "Dockerfile"


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
    # One apt-cache for all of them (each run reads the whole package cache: 40 s of wall time
    # one by one on a loaded machine): a missing one has no stanza of its own in the output,
    # whatever the exit status says of the others.
    res = subprocess.run(
        ["apt-cache", "show", "--no-all-versions", *pkgs], capture_output=True, text=True, check=False
    )
    shown = set(re.findall(r"^Package: (\S+)$", res.stdout, re.MULTILINE))
    missing = [pkg for pkg in pkgs if pkg not in shown]
    assert not missing, f"not in this machine's apt lists (bookworm): {missing} {res.stderr.strip()}"
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


def test_the_image_installs_the_agent_lock_and_the_agent_without_resolving(
    steps: list[tuple[str, str]],
) -> None:
    """The lock itself is checked by tests/test_locks.py; here, that the image uses it as setup.sh does."""
    run = " ".join(a for w, a in steps if w == "RUN")
    assert re.search(r"pip install --no-cache-dir .*--require-hashes -r /src/agent.lock", run), run
    assert re.search(r"pip install --no-cache-dir .*--no-deps --no-build-isolation /src", run), run
    copied = next(a.split() for w, a in steps if w == "COPY" and "requirements/agent.lock" in a)
    assert copied[-1] == "/src/"
