"""Flags: kube-proxy names, durations, validation messages that say what is right."""

from __future__ import annotations

import pytest

from agent.cli import build_parser, config_from_args, parse_duration
from agent.config import Mode


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("1m", 60), ("1m30s", 90), ("500ms", 0.5), ("2", 2), ("1h", 3600), ("0", 0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_config_from_flags() -> None:
    ns = build_parser().parse_args(
        [
            "--mode=iptables",
            "--hostname-override=Node1",
            "--cluster-cidr=10.244.0.0/16",
            "--nodeport-addresses=192.168.0.0/24",
            "--node-ip=192.168.0.11",
            "--iptables-min-sync-period=0",
            "--bpf-ct-global-tcp-max=1000",
            "--node-port-range=20000-22767",
            "--bpf-keep-client-ip-for-local-backends=true",
            "--bpf-snat-ports=40000-50000",
            "--devices=eth0,eth1",
        ]
    )
    cfg = config_from_args(ns)
    assert cfg.mode is Mode.IPTABLES
    assert cfg.hostname == "node1"
    assert cfg.cluster_cidr == ("10.244.0.0/16",)
    assert cfg.node_ips == ("192.168.0.11",)
    assert cfg.min_sync_period_s == 0
    assert cfg.map_sizes.ct_tcp == 1000 and cfg.map_sizes.fe == 65536
    assert cfg.map_sizes.ct_any == 0  # derived at start from kube-proxy's conntrack settings
    assert cfg.nodeport_range == (20000, 22767)
    assert cfg.bpf_keep_client_ip_local is True
    assert cfg.snat_ports == (40000, 50000)
    assert cfg.devices == ("eth0", "eth1")
    assert cfg.iptables_localhost_nodeports is True
    off = config_from_args(build_parser().parse_args(["--iptables-localhost-nodeports=false"]))
    assert off.iptables_localhost_nodeports is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode=ipvs"], "invalid choice: 'ipvs'"),
        (["--cluster-cidr=10.244.0.0/33"], "is not a CIDR"),
        (["--node-ip=node1"], "is not an IPv4 address"),
        (["--bpf-ct-global-any-max=0"], "is not a positive whole number"),
        (["--bpf-snat-ports=70000-80000"], "is not a port range"),
        (["--iptables-sync-period=soon"], "is not a duration"),
    ],
)
def test_bad_flags_say_what_is_wrong(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_ends_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert out.rstrip().endswith("decode the live service maps of this node")
    assert "--hostname-override" in out and "--bpf-ct-global-tcp-max" in out and "--bpf-fe-max" in out


def test_dry_run_with_a_missing_file_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    assert main(["--dry-run", "--services-file=/nonexistent/services.yaml"]) == 1
    err = capsys.readouterr().err
    assert "cannot read --services-file /nonexistent/services.yaml" in err
    assert "No such file or directory" in err


def test_dry_run_of_the_examples_needs_no_root(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from agent.cli import main

    examples = Path(__file__).resolve().parents[2] / "examples" / "services.yaml"
    argv = ["--dry-run", f"--services-file={examples}", "--hostname-override=node1"]
    assert main([*argv, "--mode=ebpf", "--node-ip=192.168.0.11"]) == 0
    out = capsys.readouterr().out
    assert "fe 192.168.0.11:30080/TCP external" in out and "flags=NODEPORT|SNAT_ALL" in out
    assert main([*argv, "--mode=iptables"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("*filter\n") and "-A KUBE-SERVICES" in out and out.rstrip().endswith("COMMIT")
