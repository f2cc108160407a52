"""The benchmark hook returns sane numbers (pure) and applies into a throwaway netns (kernel)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Any

import pytest

from bench.iptables_restore import measure, synthetic_state


def test_synthetic_state_shape_and_shift() -> None:
    st = synthetic_state(25, 3)
    assert len(st.services) == 25
    assert sum(1 for sp in st.services.values() if sp.node_port) == 3
    assert all(len(e.cluster) == 3 for e in st.endpoints.values())
    moved = synthetic_state(25, 3, shift=1)
    changed = [spn for spn in st.services if st.endpoints[spn] != moved.endpoints[spn]]
    assert [str(spn) for spn in changed] == ["ns0/svc0:http"]


def test_measure_without_apply_counts_rules() -> None:
    r = measure(10, 2, apply=False)
    # Per service: KUBE-SERVICES jump, masquerade, 2 SVC jumps, 2x2 SEP rules = 8; NodePort adds 3.
    # Fixed: 4 POSTROUTING/MARK-MASQ, 1 nodeports tail, 1 martian drop, 3 KUBE-FORWARD.
    assert r["rules"] == 10 * 8 + 3 + 9
    assert r["endpoints"] == 20
    assert isinstance(r["render_seconds"], float)


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["nft", "legacy"])
def test_measure_applies_full_then_partial_and_removes_its_netns(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    renamed: list[str] = []
    real_mkdtemp, real_rename = tempfile.mkdtemp, os.rename

    def recording_mkdtemp(*args: Any, **kwargs: Any) -> str:
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    def recording_rename(src: str, dst: str) -> None:
        real_rename(src, dst)
        if src in made:
            renamed.append(dst)

    # this process's own directories only: another run's scratch namespaces may come and go; the
    # lock dir is made under a staging name, then renamed to a lab's (lab.netns.scratch_netns)
    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    monkeypatch.setattr(os, "rename", recording_rename)
    r = measure(50, 2, backend=backend)
    lock_dirs = [d for d in renamed if "ekpt-bench-" in os.path.basename(d) and "-xtables-" in d]
    assert len(lock_dirs) == 1, f"one xtables lock directory of the scratch namespace: {made} -> {renamed}"
    lock_dir = lock_dirs[0]
    assert not os.path.exists(lock_dir), "the namespace's xtables lock directory is left behind"
    assert not any(os.path.exists(d) for d in made if "ekpt-bench-" in d), "a staging directory is left"
    assert r["backend"] == backend
    assert r["partial_services_written"] == 1
    # A NodePort gets a 4th rule in the netns: the localhost jump that counts packets with nfacct.
    assert r["rules"] == 50 * 8 + 5 * 4 + 9
    assert "ekpt-bench-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
