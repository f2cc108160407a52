"""kube-proxy's conntrack settings: the values (upstream getConntrackMax) and how refusals are met."""

from __future__ import annotations

import logging

import pytest

from agent.config import ConntrackSettings, conntrack_max
from agent.iptables.conntrack_sysctls import HASHSIZE_PATH, apply_conntrack_settings, plan
from agent.iptables.runner import Result
from tests.iptables.fakes import FakeRunner

DEFAULTS = ConntrackSettings()


def test_conntrack_max_is_per_core_floored_at_min_and_zero_leaves_it() -> None:
    assert conntrack_max(DEFAULTS, 2) == 131072  # 65536 < min
    assert conntrack_max(DEFAULTS, 8) == 262144
    assert conntrack_max(ConntrackSettings(max_per_core=0, min=131072), 8) == 0


def test_plan_follows_kube_proxy_defaults_and_skips_zeros() -> None:
    assert [(s.key.rsplit(".", 1)[1], s.value) for s in plan(DEFAULTS, 2)] == [
        ("nf_conntrack_max", 131072),
        ("nf_conntrack_tcp_timeout_established", 86400),
        ("nf_conntrack_tcp_timeout_close_wait", 3600),
    ]
    nothing = ConntrackSettings(max_per_core=0, tcp_established_timeout_s=0, tcp_close_wait_timeout_s=0)
    assert plan(nothing, 2) == []


def test_values_already_in_place_are_not_written_and_hashsize_grows_to_a_quarter() -> None:
    fake = FakeRunner()
    fake.sysctls["net.netfilter.nf_conntrack_tcp_timeout_established"] = "86400"
    fake.responses["cat"] = lambda argv: Result(0, "16384\n")
    fake.responses["sh"] = lambda argv: Result(0)
    report = apply_conntrack_settings(DEFAULTS, fake.command, cpus=2)
    assert "net.netfilter.nf_conntrack_tcp_timeout_established" in report.unchanged
    assert [k for k, _, _ in report.written] == [
        "net.netfilter.nf_conntrack_max",
        HASHSIZE_PATH,
        "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
    ]
    assert ["sh", "-c", 'echo "$1" > "$2"', "sh", "32768", HASHSIZE_PATH] in fake.commands


def test_a_refused_write_is_logged_and_the_rest_still_applied(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeRunner()
    fake.responses["cat"] = lambda argv: Result(0, "262144\n")

    def sysctl(argv: list[str]) -> Result:
        # The kernel refuses nf_conntrack_max; procps sysctl still exits 0 (seen on this machine).
        if argv[1] == "-w" and "nf_conntrack_max" in argv[2]:
            return Result(0, "", 'sysctl: setting key "net.netfilter.nf_conntrack_max": Invalid argument')
        if argv[1] == "-w":
            key, _, value = argv[2].partition("=")
            fake.sysctls[key] = value
            return Result(0)
        return Result(0, fake.sysctls.get(argv[2], "262144") + "\n")

    fake.responses["sysctl"] = sysctl
    with caplog.at_level(logging.WARNING):
        report = apply_conntrack_settings(DEFAULTS, fake.command, netns="node1", cpus=2)
    assert [k for k, _, _ in report.refused] == ["net.netfilter.nf_conntrack_max"]
    assert "only the initial network namespace" in report.refused[0][2]
    assert fake.sysctls["net.netfilter.nf_conntrack_tcp_timeout_close_wait"] == "3600"
    assert "cannot set net.netfilter.nf_conntrack_max=131072 in netns node1" in caplog.text
