"""eBPF mode's start-up checks say what is missing and what to do."""

from __future__ import annotations

import pytest

from agent.ebpf import preflight


def test_all_present_on_this_machine_when_root() -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("checks root")
    assert preflight.check("/sys/fs/bpf/ebpf-kube-proxy").errors == []


def test_missing_pieces_name_the_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.ebpf.preflight.os.geteuid", lambda: 1000)
    monkeypatch.setattr("agent.ebpf.preflight.importlib.util.find_spec", lambda name: None)
    monkeypatch.setattr("agent.ebpf.preflight.platform.release", lambda: "0.0-nonexistent")
    found = preflight.check("relative/pins").errors
    text = "\n".join(found)
    assert "run the agent as root" in text
    assert "install Debian's python3-bpfcc" in text
    assert "no kernel headers at /lib/modules/0.0-nonexistent/build" in text
    assert "--bpf-pin-path must be absolute" in text
    assert all("--mode=iptables" in p for p in found if "bcc" in p or "headers" in p)
