"""What kube-proxy's flags do here: --oom-score-adj, --kube-api-qps/--kube-api-burst on the real
API client, --config-sync-period on the watch, --feature-gates, --init-only on a node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from agent.cli import resolve
from agent.config import Config, Mode
from agent.featuregates import log_gates, node_info
from agent.kube.client import RateLimitedApiClient, api_client, kubeconfig_configuration
from agent.kube.source import ApiSource
from agent.kube.tokenbucket import TokenBucket
from agent.nodeinit import init_node
from agent.oom import apply_oom_score_adj
from agent.sources.base import Kind
from lab.fakeapi import FakeApiServer
from lab.fakeapi.objects import service
from tests.kube.conftest import FAST, Recorded, wait_until

# ----------------------------------------------------------------------------- --oom-score-adj


def test_oom_score_adj_is_written_to_proc_self() -> None:
    """In a child process (the test runner keeps its own score). Raised values: lowering one needs
    CAP_SYS_RESOURCE, which this machine's sandbox withholds even from root (kube-proxy's -999 is
    then logged as refused, below)."""
    code = (
        "import sys; from agent.cli import resolve; from agent.oom import apply_oom_score_adj; "
        "ok = apply_oom_score_adj(resolve(sys.argv[1:]).config.oom_score_adj); "
        "print(ok, open('/proc/self/oom_score_adj').read().strip())"
    )
    for value in (500, 600):
        out = subprocess.run(
            [sys.executable, "-c", code, f"--oom-score-adj={value}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert out == ["True", str(value)]
    assert resolve([]).config.oom_score_adj == -999  # kube-proxy's qos.KubeProxyOOMScoreAdj


def test_a_refused_oom_score_is_logged_and_the_agent_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert apply_oom_score_adj(-999, str(tmp_path / "missing" / "oom_score_adj")) is False
    assert "cannot set the OOM score adjustment to -999" in caplog.text


# ------------------------------------------------------------------- --kube-api-qps / -burst


def test_api_client_takes_qps_and_burst_as_client_go_defaults_them() -> None:
    def bucket(**kw: Any) -> tuple[float, int] | None:
        api = api_client(Config(master="https://10.0.0.1:6443", **kw))
        assert isinstance(api, RateLimitedApiClient)
        return None if api.bucket is None else (api.bucket.per_s, api.bucket.burst)

    assert bucket() == (5.0, 10)
    assert bucket(api_qps=50.0, api_burst=100) == (50.0, 100)
    assert bucket(api_qps=0.0, api_burst=0) == (5.0, 10)
    assert bucket(api_qps=-1.0) is None


def test_requests_through_the_real_client_wait_for_their_token(tmp_path: Path) -> None:
    """qps 5, burst 2: two requests go at once, each later one waits 1/5 s for its token."""
    now = [0.0]
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(round(seconds, 6))
        now[0] += seconds

    with FakeApiServer() as server:
        server.create(service("web", "10.96.0.1"))
        cfg = kubeconfig_configuration(server.write_kubeconfig(tmp_path / "kc"))
        api = RateLimitedApiClient(cfg, TokenBucket(5.0, 2, clock=lambda: now[0]), sleep)
        requests = []
        server.on_request(lambda req: requests.append(req))
        for _ in range(6):
            resp: Any = k8s.CoreV1Api(api).list_service_for_all_namespaces(_preload_content=False)
            assert [i["metadata"]["name"] for i in json.loads(resp.data)["items"]] == ["web"]
    assert waits == [0.2, 0.2, 0.2, 0.2]
    assert len(requests) == 6


# ----------------------------------------------------------------------- --config-sync-period


def test_config_sync_period_lists_again_and_sends_only_differences(tmp_path: Path) -> None:
    with FakeApiServer(bookmark_interval_s=0.3) as server:
        server.create(service("web", "10.96.0.1"))
        config = Config(kubeconfig=server.write_kubeconfig(tmp_path / "kc"), config_sync_period_s=1.0)
        source = ApiSource(config, api_client(config), FAST)
        sink = Recorded()
        source.start(sink)
        try:
            wait_until(lambda: source.list_counts().get(Kind.SERVICE, 0) >= 3, what="two resync lists")
            # The relists found nothing new: the one Service was delivered once.
            assert len([e for e in sink.objects(Kind.SERVICE)]) == 1
        finally:
            source.stop()


# ----------------------------------------------------------------------------- --feature-gates


def test_feature_gates_reach_the_model_and_the_rest_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    config = resolve(["--feature-gates=PreferSameTrafficDistribution=false,NFTablesProxyMode=true"]).config
    node = node_info(config)
    assert (node.node_hints, node.zone_hints) == (False, True)
    assert node_info(resolve([]).config).node_hints is True
    off = resolve(["--feature-gates=TopologyAwareHints=false,ServiceTrafficDistribution=false"]).config
    assert node_info(off).zone_hints is False
    assert log_gates(config) == [
        "feature gate NFTablesProxyMode=true does not change this agent; accepted and ignored"
    ]


# --------------------------------------------------------------------------------- --init-only


@pytest.fixture
def netns(kernel_required: None) -> Iterator[str]:
    name = f"ekp-init-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def sysctl(ns: str, key: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "sysctl", "-n", key], capture_output=True, text=True, check=True
    ).stdout.strip()


def set_sysctl(ns: str, key: str, value: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"], check=True)
    assert sysctl(ns, key) == value


@pytest.mark.kernel
def test_init_only_sets_up_the_node_for_iptables_mode(netns: str) -> None:
    # A fresh namespace takes IPv4's settings from the machine's (devconf_inherit_init_net = 0):
    # start from values the set-up must change, whatever the machine holds.
    set_sysctl(netns, "net.ipv4.ip_forward", "0")
    set_sysctl(netns, "net.ipv4.conf.all.route_localnet", "0")
    config = resolve(
        ["--init-only", "--mode=iptables", f"--netns={netns}", "--conntrack-tcp-timeout-close-wait=45m"]
    ).config
    assert init_node(config) == 0
    assert sysctl(netns, "net.ipv4.ip_forward") == "1"
    assert sysctl(netns, "net.ipv4.conf.all.route_localnet") == "1"
    assert sysctl(netns, "net.netfilter.nf_conntrack_tcp_timeout_close_wait") == "2700"


@pytest.mark.kernel
def test_init_only_in_ebpf_mode_leaves_route_localnet_alone(netns: str) -> None:
    config = resolve(["--init-only", f"--netns={netns}", "--bpf-pin-path=/sys/fs/bpf/ebpf-kube-proxy"]).config
    assert config.mode is Mode.EBPF
    set_sysctl(netns, "net.ipv4.ip_forward", "0")  # as above: not what the machine may hold
    set_sysctl(netns, "net.ipv4.conf.all.route_localnet", "0")
    assert init_node(config) == 0
    assert sysctl(netns, "net.ipv4.ip_forward") == "1"
    assert sysctl(netns, "net.ipv4.conf.all.route_localnet") == "0"
    with open("/proc/self/mounts") as f:
        assert any(line.split()[1:3] == ["/sys/fs/bpf", "bpf"] for line in f)
