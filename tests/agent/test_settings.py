"""The settings table: every kube-proxy flag is accepted, no flag is abbreviated, the written
configuration reads back to the same configuration, and the README's flag table is current."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main, resolve
from agent.settings import readme
from agent.settings.flags import parse_flags
from agent.settings.table import BY_PATH, SETTINGS

# kube-proxy v1.31's `--help` on Linux, copied from upstream: the generated reference page for v1.31
# (kubernetes/website content/en/docs/reference/command-line-tools-reference/kube-proxy.md, the
# version whose --feature-gates list ends with WindowsHostNetwork and has ImageVolume as ALPHA),
# checked against cmd/kube-proxy/app/options.go `AddFlags`. That page also lists klog's flags
# (--add_dir_header ... --stderrthreshold): its generator registers them, kube-proxy itself stopped
# in v1.26; they are accepted here all the same. Added from the same AddFlags: the deprecated
# --healthz-port / --metrics-port (hidden from --help) and logsapi's --log-json-* pair, which the
# page lacks because its generator registers only the text format.
UPSTREAM_V1_31_HELP = (
    "--add_dir_header",
    "--alsologtostderr",
    "--bind-address",
    "--bind-address-hard-fail",
    "--cleanup",
    "--cluster-cidr",
    "--config",
    "--config-sync-period",
    "--conntrack-max-per-core",
    "--conntrack-min",
    "--conntrack-tcp-be-liberal",
    "--conntrack-tcp-timeout-close-wait",
    "--conntrack-tcp-timeout-established",
    "--conntrack-udp-timeout",
    "--conntrack-udp-timeout-stream",
    "--detect-local-mode",
    "--feature-gates",
    "--healthz-bind-address",
    "-h",
    "--help",
    "--hostname-override",
    "--init-only",
    "--iptables-localhost-nodeports",
    "--iptables-masquerade-bit",
    "--iptables-min-sync-period",
    "--iptables-sync-period",
    "--ipvs-exclude-cidrs",
    "--ipvs-min-sync-period",
    "--ipvs-scheduler",
    "--ipvs-strict-arp",
    "--ipvs-sync-period",
    "--ipvs-tcp-timeout",
    "--ipvs-tcpfin-timeout",
    "--ipvs-udp-timeout",
    "--kube-api-burst",
    "--kube-api-content-type",
    "--kube-api-qps",
    "--kubeconfig",
    "--log-flush-frequency",
    "--log-text-info-buffer-size",
    "--log-text-split-stream",
    "--log_backtrace_at",
    "--log_dir",
    "--log_file",
    "--log_file_max_size",
    "--logging-format",
    "--logtostderr",
    "--masquerade-all",
    "--master",
    "--metrics-bind-address",
    "--nodeport-addresses",
    "--one_output",
    "--oom-score-adj",
    "--pod-bridge-interface",
    "--pod-interface-name-prefix",
    "--profiling",
    "--proxy-mode",
    "--show-hidden-metrics-for-version",
    "--skip_headers",
    "--skip_log_headers",
    "--stderrthreshold",
    "-v",
    "--v",
    "--version",
    "--vmodule",
    "--write-config-to",
    # from AddFlags, not on the page (see above)
    "--healthz-port",
    "--metrics-port",
    "--log-json-info-buffer-size",
    "--log-json-split-stream",
)

# A valid value for each flag, as an operator would write it (booleans take pflag's `--flag`).
SAMPLE: dict[str, str] = {
    "--bind-address": "192.168.0.11",
    "--cluster-cidr": "10.244.0.0/16",
    "--config-sync-period": "10m",
    "--conntrack-max-per-core": "0",
    "--conntrack-min": "1000",
    "--conntrack-tcp-timeout-close-wait": "30m",
    "--conntrack-tcp-timeout-established": "2h",
    "--conntrack-udp-timeout": "30s",
    "--conntrack-udp-timeout-stream": "2m",
    "--detect-local-mode": "ClusterCIDR",
    "--feature-gates": "AllAlpha=false,LoadBalancerIPMode=true",
    "--healthz-bind-address": "0.0.0.0:10256",
    "--hostname-override": "node1",
    "--iptables-masquerade-bit": "14",
    "--iptables-min-sync-period": "1s",
    "--iptables-sync-period": "30s",
    "--ipvs-exclude-cidrs": "10.0.0.0/8",
    "--ipvs-min-sync-period": "1s",
    "--ipvs-scheduler": "rr",
    "--ipvs-sync-period": "30s",
    "--ipvs-tcp-timeout": "0s",
    "--ipvs-tcpfin-timeout": "0s",
    "--ipvs-udp-timeout": "0s",
    "--kube-api-burst": "20",
    "--kube-api-content-type": "application/json",
    "--kube-api-qps": "10",
    "--kubeconfig": "/var/lib/kube-proxy/kubeconfig.conf",
    "--log-flush-frequency": "5s",
    "--log-json-info-buffer-size": "0",
    "--log-text-info-buffer-size": "1Ki",
    "--log_backtrace_at": ":0",
    "--log_dir": "/var/log",
    "--log_file": "/var/log/kube-proxy.log",
    "--log_file_max_size": "1800",
    "--logging-format": "text",
    "--master": "https://10.0.0.1:6443",
    "--metrics-bind-address": "127.0.0.1:10249",
    "--nodeport-addresses": "primary",
    "--oom-score-adj": "-999",
    "--pod-bridge-interface": "cbr0",
    "--pod-interface-name-prefix": "veth",
    "--proxy-mode": "iptables",
    "--show-hidden-metrics-for-version": "1.30",
    "--stderrthreshold": "2",
    "-v": "2",
    "--v": "2",
    "--vmodule": "proxier*=4",
    "--healthz-port": "10256",
    "--metrics-port": "10249",
}
ACTIONS = ("-h", "--help", "--version", "--write-config-to", "--config", "--cleanup", "--init-only")


@pytest.mark.parametrize("flag", [f for f in UPSTREAM_V1_31_HELP if f not in ACTIONS])
def test_every_kube_proxy_flag_is_accepted(flag: str) -> None:
    arg = f"{flag}={SAMPLE[flag]}" if flag in SAMPLE else flag
    given = parse_flags([arg])
    assert len(given) == 1, f"{arg} set {given}"
    resolve([arg])  # and the whole configuration still resolves


def test_kube_proxy_flags_spelled_with_a_space_work_too() -> None:
    resolved = resolve(["--oom-score-adj", "-500", "--kube-api-qps", "10", "--ipvs-scheduler", "rr"])
    assert resolved.config.oom_score_adj == -500 and resolved.config.api_qps == 10.0


def test_the_action_flags_are_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("-h", "--help"):
        with pytest.raises(SystemExit) as exc:
            main([flag])
        assert exc.value.code == 0
    assert "--oom-score-adj" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("ebpf-kube-proxy ")
    written = tmp_path / "c.yaml"
    assert main(["--write-config-to", str(written)]) == 0
    assert resolve(["--config", str(written), "--cleanup", "--init-only"]).config.cleanup is True


@pytest.mark.parametrize(
    ("argv", "detector"),
    [
        ([], "ClusterCIDR: none (no --cluster-cidr)"),
        (["--cluster-cidr=10.244.0.0/16"], "ClusterCIDR: sources in 10.244.0.0/16"),
        (
            ["--detect-local-mode=NodeCIDR", "--cluster-cidr=10.0.0.0/8"],
            "NodeCIDR: none (no podCIDR on the Node yet)",
        ),
        (
            ["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cbr0"],
            "BridgeInterface: traffic entering on cbr0",
        ),
        (
            [
                "--detect-local-mode=InterfaceNamePrefix",
                "--pod-interface-name-prefix=veth",
                "--cluster-cidr=10.0.0.0/8",
            ],
            "InterfaceNamePrefix: traffic entering on devices named veth*",
        ),
    ],
)
def test_the_local_traffic_detector_flags_choose_the_detector(argv: list[str], detector: str) -> None:
    assert resolve(argv).config.local_detector().describe() == detector


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--detect-local-mode=Bridge"], "invalid choice: 'Bridge'"),
        (
            ["--detect-local-mode=BridgeInterface"],
            "--pod-bridge-interface / detectLocal.bridgeInterface must not be empty",
        ),
        (
            ["--detect-local-mode=InterfaceNamePrefix", "--pod-bridge-interface=cbr0"],
            "--pod-interface-name-prefix / detectLocal.interfaceNamePrefix must not be empty",
        ),
        (
            ["--detect-local-mode=NodeCIDR", "--services-file=/dev/null"],
            "--detect-local-mode=NodeCIDR reads the Node's spec.podCIDRs from the API server",
        ),
    ],
)
def test_a_detector_that_cannot_work_exits_2_saying_why(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert message in line


def test_ignored_flags_are_logged_once_each_with_why(caplog: pytest.LogCaptureFixture) -> None:
    resolved = resolve(["--ipvs-scheduler=rr", "--profiling", "--log_dir=/var/log", "--mode=iptables"])
    assert resolved.notes == (
        "--ipvs-scheduler is accepted and ignored: IPVS mode is not implemented by this agent",
        "--profiling is accepted and ignored: there is no Go profiler in this agent",
        "--log-dir is accepted and ignored: klog's own flags, which kube-proxy stopped registering in "
        "v1.26 (its v1.31 reference page still lists them); the agent logs to stderr",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--host=node9"],
            "unknown flag --host (flags are not abbreviated: did you mean --hostname-override?)",
        ),
        (["--bind-addr=1.2.3.4"], "unknown flag --bind-addr (flags are not abbreviated: did you mean one of"),
        (["--masq"], "unknown flag --masq (flags are not abbreviated: did you mean --masquerade-all?)"),
        (["--hostname-overide=n"], "unknown flag --hostname-overide (did you mean --hostname-override?)"),
        (["--no-such-flag"], "unknown flag --no-such-flag"),
        (["node1"], "unexpected argument 'node1': the agent takes flags only"),
    ],
)
def test_abbreviated_and_unknown_flags_exit_2_saying_what_is_right(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"agent: {message}")


def test_bind_address_is_its_own_flag_not_a_prefix_of_another() -> None:
    # Before the table, argparse's prefix matching read this as --bind-address-hard-fail and failed.
    resolved = resolve(["--bind-address=192.168.0.11"])
    assert resolved.config.bind_address_hard_fail is False
    assert resolved.values["bind_address"] == "192.168.0.11"


def test_underscores_are_dashes_as_in_kube_proxy() -> None:
    assert resolve(["--hostname_override=Node2", "--masquerade_all"]).config.hostname == "node2"
    assert resolve(["--masquerade_all"]).config.masquerade_all is True


def test_feature_gates_take_kubernetes_syntax_and_add_up() -> None:
    config = resolve(["--feature-gates=A=true, B=false", "--feature-gates", "C=t"]).config
    assert dict(config.feature_gates) == {"A": True, "B": False, "C": True}


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("--feature-gates=A", "'A' is not Name=true|false"),
        ("--feature-gates=A=maybe", "'maybe' is not true or false"),
        ("--oom-score-adj=-1001", "is not a whole number within [-1000, 1000]"),
        ("--kube-api-qps=fast", "'fast' is not a number"),
        ("--config-sync-period=soon", "is not a duration"),
        ("--kube-api-burst=-1", "is not a whole number >= 0"),
    ],
)
def test_bad_values_of_the_new_flags_say_what_is_wrong(
    arg: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([arg]) == 2
    assert message in capsys.readouterr().err


def test_config_sync_period_zero_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config-sync-period=0"]) == 2
    assert "--config-sync-period / configSyncPeriod must be greater than 0" in capsys.readouterr().err


ROUND_TRIP: list[list[str]] = [
    [],
    ["--mode=iptables", "--hostname-override=Node7", "--cluster-cidr=10.244.0.0/16,fd00::/48"],
    [
        "--nodeport-addresses=primary,10.0.0.0/8",
        "--healthz-bind-address=192.168.0.11",
        "--masquerade-all",
        "--iptables-masquerade-bit=3",
        "--iptables-localhost-nodeports=false",
        "--conntrack-max-per-core=0",
        "--conntrack-min=1000",
        "--conntrack-tcp-timeout-established=2h",
        "--conntrack-tcp-timeout-close-wait=30m",
        "--conntrack-tcp-be-liberal",
        "--conntrack-udp-timeout=45s",
        "--conntrack-udp-timeout-stream=5m",
        "--sync-period=2m30s",
        "--min-sync-period=0.5",
        "--bind-address-hard-fail=true",
        "-v",
        "3",
    ],
    [
        "--kubeconfig=/etc/kp/kubeconfig",
        "--kube-api-qps=50",
        "--kube-api-burst=100",
        "--kube-api-content-type=application/json",
        "--config-sync-period=5m",
        "--oom-score-adj=-500",
        "--feature-gates=PreferSameTrafficDistribution=false,Foo=true",
        "--metrics-bind-address=0.0.0.0:9999",
    ],
    [
        "--detect-local-mode=InterfaceNamePrefix",
        "--pod-interface-name-prefix=veth",
        "--pod-bridge-interface=cbr0",
    ],
    ["--detect-local-mode=NodeCIDR", "--cluster-cidr=10.244.0.0/16"],
]


@pytest.mark.parametrize("argv", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_write_config_to_round_trips_through_config(tmp_path: Path, argv: list[str]) -> None:
    out = tmp_path / "effective.yaml"
    assert main([*argv, "--write-config-to", str(out)]) == 0
    first = resolve(argv)
    again = resolve(["--config", str(out)])
    assert again.warnings == ()
    assert again.config == first.config
    file_settings = {s.name for s in BY_PATH.values()}
    same = {n: v for n, v in first.values.items() if n in file_settings}
    assert {n: again.values[n] for n in same} == same
    # and writing again gives the same file
    second = tmp_path / "again.yaml"
    assert main(["--config", str(out), "--write-config-to", str(second)]) == 0
    assert second.read_text() == out.read_text()


def test_every_setting_is_reachable_and_named_once() -> None:
    flags = [f for s in SETTINGS for f in s.flags]
    assert len(flags) == len(set(flags))
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    for s in SETTINGS:
        assert s.flags or s.path, f"{s.name}: neither a flag nor a file field"
        assert bool(s.attr) + bool(s.ignored) <= 1, f"{s.name}: both applied to Config and ignored"
        assert s.group, s.name
    for setting in BY_PATH.values():
        value: Any = setting.kind.dump(setting.default)
        if value is not None:
            setting.kind.file(value)  # every default, as written, is a valid file value


def test_the_readme_flag_table_is_generated_from_the_table() -> None:
    text = readme.README.read_text(encoding="utf-8")
    assert readme.rewrite(text) == text, "stale: run python -m agent.settings.readme"
    for setting in SETTINGS:
        if setting.flags:
            assert f"`{setting.flags[0]}`" in readme.render()


def test_logging_is_quiet_about_flags_that_apply(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    assert resolve(["--mode=iptables", "--oom-score-adj=-999"]).notes == ()


def test_a_duration_with_a_ceiling_refuses_more() -> None:
    """--bpf-ct-timeout-tcp-backend-gone fills a 16-bit field of the data path: 65,535 s at most,
    on the command line and in a file alike."""
    from agent.settings.kinds import Duration

    kind = Duration(most=65535.0)
    assert kind.flag("18h12m15s") == 65535.0
    with pytest.raises(ValueError, match="more than"):
        kind.flag("20h")
    with pytest.raises(ValueError, match="at most"):
        kind.file("20h")


def test_every_flag_a_full_agent_written_map_names_is_one_and_sets_that_map_s_size() -> None:
    """A full map's error says which flag to raise (agent/ebpf/maps.py MapFullError): for every
    map the agent writes that can fill, that flag exists and sets the size the map gets (ekp_port_v2's
    named --bpf-port-max before there was one)."""
    from agent.ebpf.abi import MAPS, Writer
    from agent.settings.table import MAP_SIZE_ROLES

    flags = {flag for s in SETTINGS for flag in s.flags}
    for spec in MAPS.values():
        if spec.writer is not Writer.AGENT or spec.kind == "array":
            continue
        assert spec.size_flag in flags, spec.name
        assert spec.sized_by in MAP_SIZE_ROLES, spec.name
        sizes = resolve([f"{spec.size_flag}=777"]).config.map_sizes
        assert getattr(sizes, spec.sized_by) == 777, spec.name
