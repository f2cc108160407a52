"""--config (KubeProxyConfiguration v1alpha1), flag precedence and --write-config-to: table tests
for the mapping, the precedence and every error message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import configfile
from agent.cli import main, resolve
from agent.config import Config, ConntrackSettings, Mode
from agent.configfile import ConfigFileError, parse, render_yaml

# pkg/proxy/apis/config/scheme/testdata/KubeProxyConfiguration/after/v1alpha1.yaml: what upstream's
# defaulting produces for an empty v1alpha1 document (and what its --write-config-to writes).
UPSTREAM_DEFAULTS = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 10
  contentType: application/vnd.kubernetes.protobuf
  kubeconfig: ""
  qps: 5
clusterCIDR: ""
configSyncPeriod: 15m0s
conntrack:
  maxPerCore: 32768
  min: 131072
  tcpBeLiberal: false
  tcpCloseWaitTimeout: 1h0m0s
  tcpEstablishedTimeout: 24h0m0s
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: 0.0.0.0:10256
hostnameOverride: ""
iptables:
  localhostNodePorts: true
  masqueradeAll: false
  masqueradeBit: 14
  minSyncPeriod: 1s
  syncPeriod: 30s
ipvs:
  excludeCIDRs: null
  ipSet:
    hashSize: 1024
    maxElements: 65536
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 5s
  format: text
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: 127.0.0.1:10249
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: 14
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: -999
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"""

HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


def write(tmp_path: Path, body: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def doc(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": configfile.API_VERSION, "kind": configfile.KIND, **fields}


def test_upstreams_default_file_loads_without_a_warning() -> None:
    settings = parse(yaml.safe_load(UPSTREAM_DEFAULTS))
    assert settings.warnings == ()


def test_upstreams_default_file_gives_upstreams_defaults(tmp_path: Path) -> None:
    config = resolve(["--config", write(tmp_path, UPSTREAM_DEFAULTS), "--hostname-override=n1"]).config
    assert config == Config(hostname="n1", mode=Mode.EBPF, min_sync_period_s=1.0), (
        "mode '' is this agent's default; every other field is kube-proxy's default"
    )


@pytest.mark.parametrize(
    ("fields", "expect"),
    [
        ({"mode": "iptables"}, {"mode": Mode.IPTABLES}),
        ({"mode": "ebpf"}, {"mode": Mode.EBPF}),
        ({"hostnameOverride": " Node-1 "}, {"hostname": "node-1"}),
        ({"clientConnection": {"kubeconfig": "/etc/kp/kubeconfig"}}, {"kubeconfig": "/etc/kp/kubeconfig"}),
        ({"clusterCIDR": "10.244.0.0/16,fd00::/48"}, {"cluster_cidr": ("10.244.0.0/16", "fd00::/48")}),
        ({"healthzBindAddress": "0.0.0.0"}, {"healthz_bind_address": "0.0.0.0:10256"}),
        ({"healthzBindAddress": "192.168.0.11:12345"}, {"healthz_bind_address": "192.168.0.11:12345"}),
        ({"healthzBindAddress": ""}, {"healthz_bind_address": "0.0.0.0:10256"}),
        ({"metricsBindAddress": "0.0.0.0:10249"}, {"metrics_bind_address": "0.0.0.0:10249"}),
        ({"metricsBindAddress": "::1"}, {"metrics_bind_address": "[::1]:10249"}),
        ({"bindAddressHardFail": True}, {"bind_address_hard_fail": True}),
        ({"nodePortAddresses": ["192.168.0.0/24"]}, {"nodeport_addresses": ("192.168.0.0/24",)}),
        ({"nodePortAddresses": ["primary", "localhost"]}, {"nodeport_addresses": ("primary", "127.0.0.0/8")}),
        ({"nodePortAddresses": ["all", "10.0.0.0/8"]}, {"nodeport_addresses": ()}),
        (
            {"iptables": {"masqueradeBit": 5, "masqueradeAll": True}},
            {"masquerade_bit": 5, "masquerade_all": True},
        ),
        ({"iptables": {"localhostNodePorts": False}}, {"iptables_localhost_nodeports": False}),
        (
            {"iptables": {"syncPeriod": "1m", "minSyncPeriod": "2s"}},
            {"sync_period_s": 60.0, "min_sync_period_s": 2.0},
        ),
        ({"iptables": {"syncPeriod": "0s"}}, {"sync_period_s": 30.0}),  # 0 = default, as upstream defaulting
        ({"mode": "iptables", "iptables": {"minSyncPeriod": "0s"}}, {"min_sync_period_s": 1.0}),
        ({"iptables": {"minSyncPeriod": "250ms"}}, {"min_sync_period_s": 0.25}),
        (
            {
                "conntrack": {
                    "maxPerCore": 0,
                    "min": 1000,
                    "tcpEstablishedTimeout": "2h",
                    "tcpCloseWaitTimeout": "30m",
                    "tcpBeLiberal": True,
                    "udpTimeout": "30s",
                    "udpStreamTimeout": "5m",
                }
            },
            {"conntrack": ConntrackSettings(0, 1000, 7200.0, 1800.0, True, 30.0, 300.0)},
        ),
        ({"conntrack": {"tcpEstablishedTimeout": None}}, {"conntrack": ConntrackSettings()}),
        ({"iptables": None, "conntrack": {}}, {}),
    ],
)
def test_each_field_maps_to_the_config(
    tmp_path: Path, fields: dict[str, Any], expect: dict[str, Any]
) -> None:
    host = [] if "hostname" in expect else ["--hostname-override=x"]
    resolved = resolve(["--config", write(tmp_path, json.dumps(doc(**fields)), "c.json"), *host])
    assert resolved.warnings == ()
    for key, value in expect.items():
        assert getattr(resolved.config, key) == value, key


def test_logging_verbosity_sets_v(tmp_path: Path) -> None:
    path = write(tmp_path, HEAD + "logging:\n  verbosity: 5\n")
    assert resolve(["--config", path]).values["verbosity"] == 5
    assert resolve(["--config", path, "-v", "1"]).values["verbosity"] == 1


@pytest.mark.parametrize(
    ("body", "argv", "key", "value"),
    [
        ("mode: iptables\n", ["--mode=ebpf"], "mode", Mode.EBPF),
        ("mode: iptables\n", ["--proxy-mode", "ebpf"], "mode", Mode.EBPF),
        ("iptables:\n  minSyncPeriod: 5s\n", ["--iptables-min-sync-period=2s"], "min_sync_period_s", 2.0),
        ("iptables:\n  syncPeriod: 5m\n", ["--sync-period=1m"], "sync_period_s", 60.0),
        ("iptables:\n  masqueradeAll: true\n", ["--masquerade-all=false"], "masquerade_all", False),
        ("iptables:\n  masqueradeAll: true\n", [], "masquerade_all", True),
        ("hostnameOverride: a\n", ["--hostname-override=B"], "hostname", "b"),
        ("metricsBindAddress: 0.0.0.0:1\n", ["--metrics-bind-address="], "metrics_bind_address", ""),
        ("conntrack:\n  min: 5\n", ["--conntrack-min=0"], "conntrack", ConntrackSettings(min=0)),
        ("clusterCIDR: 10.0.0.0/8\n", ["--cluster-cidr=10.1.0.0/16"], "cluster_cidr", ("10.1.0.0/16",)),
    ],
)
def test_a_flag_on_the_command_line_overrides_the_file(
    tmp_path: Path, body: str, argv: list[str], key: str, value: Any
) -> None:
    config = resolve(["--config", write(tmp_path, HEAD + body), *argv]).config
    assert getattr(config, key) == value


def test_min_sync_period_default_depends_on_the_mode(tmp_path: Path) -> None:
    assert resolve([]).config.min_sync_period_s == 0.1
    assert resolve(["--mode=iptables"]).config.min_sync_period_s == 1.0
    assert resolve(["--config", write(tmp_path, HEAD + "mode: iptables\n")]).config.min_sync_period_s == 1.0
    assert (
        resolve(
            ["--config", write(tmp_path, HEAD + "mode: iptables\n"), "--mode=ebpf"]
        ).config.min_sync_period_s
        == 0.1
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("nodePortAdresses: []\n", 'unknown field "nodePortAdresses" (did you mean "nodePortAddresses"?)'),
        (
            "iptables:\n  syncPeriood: 1s\n",
            'unknown field "iptables.syncPeriood" (did you mean "iptables.syncPeriod"?)',
        ),
        ("SyncPeriod: 1s\n", 'unknown field "SyncPeriod"'),
        ("iptables: 5\n", "iptables: Invalid value: 5: must be an object"),
        (
            "mode: ipvs\n",
            'mode: Invalid value: "ipvs": unsupported value; supported values: "", "ebpf", "iptables"',
        ),
        ("mode: nftables\n", "ipvs, nftables and kernelspace are not implemented by this agent"),
        ("detectLocalMode: nodeCIDR\n", 'detectLocalMode: Invalid value: "nodeCIDR": unsupported value'),
        (
            "iptables:\n  masqueradeBit: 32\n",
            "iptables.masqueradeBit: Invalid value: 32: must be within the range [0, 31]",
        ),
        (
            "iptables:\n  masqueradeBit: '14'\n",
            'iptables.masqueradeBit: Invalid value: "14": must be a whole number',
        ),
        (
            "iptables:\n  syncPeriod: 30\n",
            "iptables.syncPeriod: Invalid value: 30: must be a duration string",
        ),
        ("iptables:\n  syncPeriod: 30\n", "e.g. 30s"),
        ("iptables:\n  syncPeriod: 30x\n", "iptables.syncPeriod: Invalid value: \"30x\": unknown unit 'x'"),
        (
            "iptables:\n  syncPeriod: -1s\n",
            'iptables.syncPeriod: Invalid value: "-1s": must be greater than 0',
        ),
        ("iptables:\n  minSyncPeriod: -1s\n", "must be greater than or equal to 0"),
        (
            "conntrack:\n  maxPerCore: -1\n",
            "conntrack.maxPerCore: Invalid value: -1: must be greater than or equal to 0",
        ),
        (
            "conntrack:\n  tcpBeLiberal: 'yes'\n",
            'conntrack.tcpBeLiberal: Invalid value: "yes": must be true or false',
        ),
        (
            "conntrack:\n  udpTimeout: -5s\n",
            'conntrack.udpTimeout: Invalid value: "-5s": must be greater than or',
        ),
        (
            "clusterCIDR: 10.0.0.0/33\n",
            "clusterCIDR: Invalid value: \"10.0.0.0/33\": '10.0.0.0/33' is not a CIDR",
        ),
        ("nodePortAddresses: [eth0]\n", "'eth0' is not a CIDR or one of primary, localhost, all"),
        (
            "nodePortAddresses: 10.0.0.0/8\n",
            'nodePortAddresses: Invalid value: "10.0.0.0/8": must be a list of strings',
        ),
        (
            "healthzBindAddress: node1:10256\n",
            "healthzBindAddress: Invalid value: \"node1:10256\": 'node1:10256': ",
        ),
        ("metricsBindAddress: 127.0.0.1:0\n", "'0' is not a port (1-65535)"),
        ("bindAddress: everywhere\n", 'bindAddress: Invalid value: "everywhere"'),
        ("oomScoreAdj: -1001\n", "oomScoreAdj: Invalid value: -1001: must be within the range [-1000, 1000]"),
        (
            "clientConnection:\n  burst: -1\n",
            "clientConnection.burst: Invalid value: -1: must be greater than or equal to 0",
        ),
        ("featureGates:\n  Foo: 'on'\n", "featureGates: Invalid value"),
        (
            "logging:\n  verbosity: -1\n",
            "logging.verbosity: Invalid value: -1: must be greater than or equal to 0",
        ),
    ],
)
def test_invalid_files_are_refused_with_the_field_path(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigFileError) as exc:
        configfile.load(write(tmp_path, HEAD + body))
    assert message in "\n".join(exc.value.problems)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "kind: KubeProxyConfiguration\n",
            'apiVersion: Unsupported value: null: must be "kubeproxy.config.k8s.io/v1alpha1"',
        ),
        (
            "apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n",
            'apiVersion: Unsupported value: "kubeproxy.config.k8s.io/v1alpha2"',
        ),
        ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: Pod\n", 'kind: Unsupported value: "Pod"'),
        ("- a\n- b\n", "expected a KubeProxyConfiguration object, got list"),
        ("mode: [\n", "not a usable YAML or JSON document: not valid YAML"),
        (HEAD + "mode: iptables\nmode: ebpf\n", 'line 4: the key "mode" is given twice in one mapping'),
        ('{"apiVersion": "x", "apiVersion": "y"}', 'the key "apiVersion" is given twice'),
        (HEAD + "oomScoreAdj: " + "9" * 100_000 + "\n", "a number of 100000 characters (9999999999"),
        (
            HEAD + "conntrack:\n  min: 2147483648\n",
            "conntrack.min: Invalid value: 2147483648: must fit in 32 bits",
        ),
        (
            HEAD + "logging:\n  verbosity: 4294967296\n",
            "must fit in 32 bits (within [-2147483648, 2147483647])",
        ),
        (HEAD + "clientConnection:\n  qps: .inf\n", "must be a finite number that fits in 32 bits"),
        (HEAD + "mode: &m iptables\nhostnameOverride: *m\n", "a YAML alias (*m)"),
        (HEAD + "---\n" + HEAD, "2 YAML documents"),
        ("", "0 YAML documents"),
    ],
)
def test_wrong_documents_are_refused(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigFileError) as exc:
        configfile.load(write(tmp_path, body))
    assert message in "\n".join(exc.value.problems)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError) as exc:
        configfile.load(write(tmp_path, HEAD + "mode: ipvs\nfoo: 1\niptables:\n  masqueradeBit: 99\n"))
    assert len(exc.value.problems) == 3


@pytest.mark.parametrize(
    ("body", "warning"),
    [
        (
            "ipvs:\n  scheduler: rr\n",
            'ipvs.scheduler is set to "rr" but does not apply: IPVS mode is not implemented',
        ),
        (
            "enableProfiling: true\n",
            "enableProfiling is set to true but does not apply: there is no Go profiler",
        ),
        ("logging:\n  format: json\n", 'logging.format is set to "json" but does not apply'),
        ("iptables:\n  snatNodeInternalIP: true\n", "iptables.snatNodeInternalIP is set to true"),
    ],
)
def test_fields_that_do_not_apply_warn_only_when_set(tmp_path: Path, body: str, warning: str) -> None:
    resolved = resolve(["--config", write(tmp_path, HEAD + body)])
    (text,) = resolved.warnings
    assert warning in text and text.endswith("; ignored")
    assert text.startswith(f"--config {tmp_path}/config.yaml: ")


@pytest.mark.parametrize(
    ("body", "key", "value"),
    [
        # Accepted and ignored before the settings table (issue 19); they do what kube-proxy does now.
        ("featureGates:\n  Foo: true\n", "feature_gates", (("Foo", True),)),
        ("oomScoreAdj: -500\n", "oom_score_adj", -500),
        ("configSyncPeriod: 1m\n", "config_sync_period_s", 60.0),
        ("clientConnection:\n  qps: 50\n", "api_qps", 50.0),
        ("clientConnection:\n  burst: 0\n", "api_burst", 0),
        ("clientConnection:\n  contentType: application/json\n", "api_content_type", "application/json"),
        # Refused or ignored before the local-traffic detector (issue 19).
        ("detectLocalMode: NodeCIDR\n", "detect_local_mode", "NodeCIDR"),
        ("detectLocalMode: ''\n", "detect_local_mode", "ClusterCIDR"),
        (
            "detectLocalMode: BridgeInterface\ndetectLocal:\n  bridgeInterface: cbr0\n",
            "pod_bridge_interface",
            "cbr0",
        ),
        (
            "detectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  interfaceNamePrefix: veth\n",
            "pod_interface_name_prefix",
            "veth",
        ),
    ],
)
def test_fields_that_apply_now_map_to_the_config(tmp_path: Path, body: str, key: str, value: Any) -> None:
    resolved = resolve(["--config", write(tmp_path, HEAD + body)])
    assert resolved.warnings == ()
    assert getattr(resolved.config, key) == value


def test_json_files_work(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps(doc(mode="iptables", iptables={"masqueradeBit": 3})), "kp.json")
    config = resolve(["--config", path]).config
    assert (config.mode, config.masquerade_bit) == (Mode.IPTABLES, 3)


def test_cli_refuses_a_bad_file_with_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, HEAD + "mode: ipvs\nnodePortAdresses: []\n")
    assert main(["--config", path]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert err[1] == (
        f'agent: --config {path}: mode: Invalid value: "ipvs": unsupported value; supported values: '
        '"", "ebpf", "iptables" ("" means ebpf here; ipvs, nftables and kernelspace are not implemented '
        "by this agent)"
    )
    assert (
        err[0]
        == f'agent: --config {path}: unknown field "nodePortAdresses" (did you mean "nodePortAddresses"?)'
    )


def test_cli_says_when_the_file_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", "/nonexistent/kube-proxy.yaml"]) == 2
    assert (
        "agent: --config /nonexistent/kube-proxy.yaml: cannot read it: No such file or directory; "
        "give the path of one KubeProxyConfiguration document" in capsys.readouterr().err
    )


def test_min_sync_period_above_the_sync_period_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, HEAD + "iptables:\n  syncPeriod: 10s\n  minSyncPeriod: 20s\n")
    assert main(["--config", path]) == 2
    assert "the minimum sync period (20s) exceeds the sync period (10s)" in capsys.readouterr().err
    assert main(["--iptables-sync-period=1s", "--min-sync-period=2s"]) == 2


# ------------------------------------------------------------------------------ writing


def test_write_config_to_prints_upstreams_layout(tmp_path: Path) -> None:
    out = tmp_path / "written.yaml"
    assert main(["--mode=iptables", "-v", "0", "--write-config-to", str(out)]) == 0
    ours = out.read_text()
    # Upstream's file for the same settings differs in the mode's value and in the ipvs.ipSet
    # block (IPVS sets, which this agent does not write).
    theirs = UPSTREAM_DEFAULTS.replace('mode: ""', "mode: iptables")
    theirs = theirs.replace("  ipSet:\n    hashSize: 1024\n    maxElements: 65536\n", "")
    assert ours == theirs


def test_written_config_round_trips(tmp_path: Path) -> None:
    argv = [
        "--mode=iptables",
        "--hostname-override=Node7",
        "--cluster-cidr=10.244.0.0/16",
        "--nodeport-addresses=primary,10.0.0.0/8",
        "--healthz-bind-address=192.168.0.11",
        "--metrics-bind-address=",
        "--masquerade-all",
        "--iptables-localhost-nodeports=false",
        "--conntrack-tcp-be-liberal",
        "--conntrack-udp-timeout=45s",
        "--sync-period=2m30s",
        "--min-sync-period=0.5",
        "--bind-address-hard-fail=true",
        "-v",
        "3",
    ]
    out = tmp_path / "effective.yaml"
    assert main([*argv, "--write-config-to", str(out)]) == 0
    written = yaml.safe_load(out.read_text())
    assert written["iptables"]["syncPeriod"] == "2m30s" and written["iptables"]["minSyncPeriod"] == "500ms"
    assert written["hostnameOverride"] == "node7" and written["metricsBindAddress"] == ""
    assert written["nodePortAddresses"] == ["primary", "10.0.0.0/8"]
    again = resolve(["--config", str(out)])
    first = resolve(argv)
    assert again.warnings == ()
    # An empty metricsBindAddress in a file means the default (upstream defaulting), so only a flag
    # turns the metrics port off.
    assert again.config == first.config.__class__(
        **{**vars(first.config), "metrics_bind_address": "127.0.0.1:10249"}
    )
    assert again.values["verbosity"] == 3


def test_write_config_keeps_the_files_other_fields(tmp_path: Path) -> None:
    path = write(tmp_path, HEAD + "ipvs:\n  scheduler: rr\nfeatureGates:\n  Foo: true\n")
    doc_ = resolve(["--config", path]).document()
    assert doc_["ipvs"]["scheduler"] == "rr" and doc_["featureGates"] == {"Foo": True}


def test_hostname_is_written_only_when_overridden() -> None:
    assert resolve([]).document()["hostnameOverride"] == ""


def test_yaml_quoting_follows_go_yaml() -> None:
    text = render_yaml(
        {"a": "", "b": "0", "c": "true", "d": "0.0.0.0:10256", "e": "30s", "f": None, "g": [], "h": {}}
    )
    assert text == 'a: ""\nb: "0"\nc: "true"\nd: 0.0.0.0:10256\ne: 30s\nf: null\ng: []\nh: {}\n'


def test_configz_is_the_internal_struct() -> None:
    resolved = resolve(["--mode=iptables", "--cluster-cidr=10.244.0.0/16"])
    view = configfile.configz(resolved.document())
    assert list(view)[:4] == ["Linux", "Windows", "FeatureGates", "ClientConnection"]
    assert view["SyncPeriod"] == "30s" and view["MinSyncPeriod"] == "1s" and view["Mode"] == "iptables"
    assert view["Linux"]["Conntrack"]["TCPEstablishedTimeout"] == "24h0m0s"
    assert view["DetectLocal"]["ClusterCIDRs"] == ["10.244.0.0/16"]
    assert view["HealthzBindAddress"] == "0.0.0.0:10256"


def test_the_ipv6_proxiers_floor_is_iptables_modes_in_both_modes(tmp_path: Path) -> None:
    """The IPv6 proxier writes ip6tables in both modes: iptables mode's floor is both families'
    (upstream's proxiers share minSyncPeriod); in eBPF mode it is 1 s at least, whatever the
    100 ms default or a smaller value says (those are for the eBPF map writes)."""
    floors = {
        argv: (c.min_sync_period_s, c.min_sync_period6_s)
        for argv in ("--mode=ebpf", "--mode=iptables")
        for c in [resolve([argv]).config]
    }
    assert floors == {"--mode=ebpf": (0.1, 1.0), "--mode=iptables": (1.0, 1.0)}
    assert resolve(["--iptables-min-sync-period=250ms"]).config.min_sync_period6_s == 1.0
    assert resolve(["--mode=iptables", "--iptables-min-sync-period=250ms"]).config.min_sync_period6_s == 0.25
    filed = resolve(["--config", write(tmp_path, HEAD + "iptables:\n  minSyncPeriod: 3s\n")]).config
    assert (filed.min_sync_period_s, filed.min_sync_period6_s) == (3.0, 3.0)
