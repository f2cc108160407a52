"""Flags: kube-proxy names, durations, validation messages that say what is right."""

from __future__ import annotations

import pytest

from agent.cli import build_parser, main, resolve
from agent.config import Config, Mode
from agent.settings.kinds import Duration


def config_from_args(argv: list[str]) -> Config:
    return resolve(argv).config


def parse_duration(text: str) -> float:
    value: float = Duration().flag(text)
    return value


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("1m", 60), ("1m30s", 90), ("500ms", 0.5), ("2", 2), ("1h", 3600), ("0", 0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_config_from_flags() -> None:
    cfg = config_from_args(
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
    off = config_from_args(["--iptables-localhost-nodeports=false"])
    assert off.iptables_localhost_nodeports is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode=ipvs"], "invalid choice: 'ipvs'"),
        (["--cluster-cidr=10.244.0.0/33"], "is not a CIDR"),
        (["--node-ip=node1"], "is not an IP address"),
        (["--bpf-ct-global-any-max=0"], "is not a positive whole number"),
        (["--bpf-snat-ports=70000-80000"], "is not a port range"),
        (["--iptables-sync-period=soon"], "is not a duration"),
    ],
)
def test_bad_flags_say_what_is_wrong(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


def test_help_ends_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert out.rstrip().endswith("(a checklist, exit 1 on a FAIL)")
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


def test_kube_proxy_flags_map_to_the_config() -> None:
    from agent.cli import resolve
    from agent.config import ConntrackSettings

    cfg = resolve(
        [
            "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf",
            "--master=https://10.0.0.1:6443",
            "--healthz-bind-address=0.0.0.0",
            "--metrics-bind-address=0.0.0.0:9999",
            "--bind-address-hard-fail",
            "--masquerade-all=true",
            "--conntrack-max-per-core=0",
            "--conntrack-min=65536",
            "--conntrack-tcp-timeout-established=12h",
            "--conntrack-tcp-timeout-close-wait=30m",
            "--conntrack-tcp-be-liberal=true",
            "--conntrack-udp-timeout=30s",
            "--conntrack-udp-timeout-stream=2m",
            "--sync-period=45s",
            "--min-sync-period=3s",
            "--nodeport-addresses=primary",
        ]
    ).config
    assert cfg.kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf" and cfg.master == "https://10.0.0.1:6443"
    assert cfg.healthz_bind_address == "0.0.0.0:10256" and cfg.metrics_bind_address == "0.0.0.0:9999"
    assert cfg.bind_address_hard_fail is True and cfg.masquerade_all is True
    assert cfg.conntrack == ConntrackSettings(0, 65536, 43200.0, 1800.0, True, 30.0, 120.0)
    assert (cfg.sync_period_s, cfg.min_sync_period_s) == (45.0, 3.0)
    assert cfg.nodeport_addresses == ("primary",)


def test_empty_bind_address_turns_a_server_off() -> None:
    from agent.cli import resolve

    cfg = resolve(["--healthz-bind-address=", "--metrics-bind-address", ""]).config
    assert cfg.healthz_bind_address == "" and cfg.metrics_bind_address == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--healthz-bind-address=node1"], "'node1' is not IP or IP:port"),
        (["--metrics-bind-address=127.0.0.1:70000"], "'70000' is not a port"),
        (["--conntrack-min=-1"], "is not a whole number >= 0"),
        (["--conntrack-tcp-timeout-established=-1h"], "must not be negative"),
        (["--conntrack-udp-timeout=5x"], "unknown unit 'x'"),
        (["--masquerade-all=maybe"], "'maybe' is not true or false"),
        (["--nodeport-addresses=eth0"], "'eth0' is not a CIDR or one of primary, localhost, all"),
    ],
)
def test_bad_kube_proxy_flags_say_what_is_wrong(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


def test_boolean_flags_take_pflag_forms() -> None:
    for argv, value in (
        (["--cleanup"], True),
        (["--cleanup=true"], True),
        (["--cleanup=false"], False),
        ([], False),
    ):
        assert config_from_args(argv).cleanup is value


def test_given_flags_include_those_equal_to_their_default() -> None:
    from agent.settings.flags import parse_flags

    assert set(parse_flags(["--mode=ebpf", "--sync-period", "30s", "-v", "2"])) == {
        "mode",
        "iptables_sync_period",
        "verbosity",
    }
