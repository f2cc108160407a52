"""Hostile `--config` and `--kubeconfig` files against the real `agent` command (issue 21, item 6).

The red team found: `--config /dev/zero` read without bound (11.3 GB after 30 s), a FIFO as
`--config` or `--kubeconfig` hung the agent at start, a 100,000-digit integer in `--config` ended
in a traceback with exit 1, and duplicate keys were accepted with the last one winning. Each file
below must now end the agent within seconds with exit status 2 and exactly one line on stderr
naming the file, and no traceback.

The agent runs as a user would start it, in iptables mode, inside a network namespace of its own
(`unshare --net`), so that even an agent that wrongly got past its files would program nothing
but an empty namespace; its address space is capped at 2 GiB so an unbounded read fails there
instead of on the machine.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.configfile import MAX_BYTES as CONFIG_MAX
from agent.kube.kubeconfig import MAX_BYTES as KUBECONFIG_MAX
from lab.harness import REPO

pytestmark = pytest.mark.kernel

HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
KUBECONFIG = (
    "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
    "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
    "users: [{name: u, user: {token: t}}]\n"
)
TIMEOUT_S = 30.0


def fifo(path: Path) -> str:
    os.mkfifo(path)
    return str(path)


def text(body: str) -> Callable[[Path], str]:
    def make(path: Path) -> str:
        path.write_text(body)
        return str(path)

    return make


def sparse(size: int) -> Callable[[Path], str]:
    def make(path: Path) -> str:
        with open(path, "wb") as f:
            f.truncate(size)
        return str(path)

    return make


def kubeconfig_naming_a_fifo_as_its_ca(path: Path) -> str:
    os.mkfifo(path.with_name("ca.crt"))
    path.write_text(
        KUBECONFIG + "clusters: [{name: c, cluster: {server: 'https://x', certificate-authority: ca.crt}}]\n"
    )
    return str(path)


# (flag, what the path is, what the one line says)
CASES: dict[str, tuple[str, Callable[[Path], str], str]] = {
    "config /dev/zero": (
        "--config",
        lambda _: "/dev/zero",
        "cannot read it: not a regular file (a character device)",
    ),
    "config FIFO": ("--config", fifo, "cannot read it: not a regular file (a FIFO)"),
    "config 100,000-digit integer": (
        "--config",
        text(HEAD + "oomScoreAdj: " + "1" * 100_000 + "\n"),
        "line 3: a number of 100000 characters (11111111111111111111...), more than 64",
    ),
    "config duplicate keys": (
        "--config",
        text(HEAD + "mode: iptables\nclusterCIDR: 10.244.0.0/16\nmode: ebpf\n"),
        'line 5: the key "mode" is given twice in one mapping',
    ),
    "config over the size limit": (
        "--config",
        sparse(CONFIG_MAX + 1),
        f"cannot read it: {CONFIG_MAX + 1} bytes, over the limit of {CONFIG_MAX}",
    ),
    "config naming a FIFO as the kubeconfig": (
        "--config",
        lambda p: text(HEAD + f"clientConnection:\n  kubeconfig: {fifo(p.with_name('kc'))}\n")(p),
        "/kc: cannot read it: not a regular file (a FIFO)",  # the line names the kubeconfig
    ),
    "kubeconfig FIFO": ("--kubeconfig", fifo, "cannot read it: not a regular file (a FIFO)"),
    "kubeconfig /dev/zero": (
        "--kubeconfig",
        lambda _: "/dev/zero",
        "not a regular file (a character device)",
    ),
    "kubeconfig duplicate keys": (
        "--kubeconfig",
        text(KUBECONFIG + "users: []\nclusters: []\n"),
        'line 6: the key "users" is given twice in one mapping',
    ),
    "kubeconfig over the size limit": (
        "--kubeconfig",
        sparse(KUBECONFIG_MAX + 1),
        f"cannot read it: {KUBECONFIG_MAX + 1} bytes, over the limit of {KUBECONFIG_MAX}",
    ),
    "kubeconfig naming a FIFO as its CA": (
        "--kubeconfig",
        kubeconfig_naming_a_fifo_as_its_ca,
        "certificate-authority",
    ),
}


def cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_file_exits_2_with_one_line(case: str, tmp_path: Path) -> None:
    flag, make, says = CASES[case]
    path = make(tmp_path / "file")
    try:
        res = subprocess.run(
            ["unshare", "--net", sys.executable, "-m", "agent", "--mode=iptables", f"{flag}={path}"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            cwd=str(REPO),
            preexec_fn=cap_memory,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the agent was still running after {TIMEOUT_S}s: {exc.stderr!r}") from None
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert len(lines) == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert f"{flag} {path}: " in lines[0] or f"--kubeconfig {tmp_path}/kc: " in lines[0], lines[0]
    assert says in lines[0], lines[0]
