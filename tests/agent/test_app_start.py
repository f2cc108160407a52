"""agent.app.run's start-up order: the eBPF data path's load runs beside build_agent's work, and
nothing to follow (a services file that cannot be read, no API server) is fatal before the node is
touched (nothing pinned, no sysctl written)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from agent import app, lock, nodeinit
from agent.config import Config, HostRouting, Mode
from agent.ebpf import EbpfProxier
from agent.errors import FatalError
from agent.takeover import into_ebpf
from tests.ebpf.test_proxier import Rig


@dataclass
class Start:
    """What run() did, in order, with the parts it was given."""

    steps: list[str] = field(default_factory=list)
    loading: threading.Event = field(default_factory=threading.Event)  # the proxier's prepare() began
    building: threading.Event = field(default_factory=threading.Event)  # build_agent began
    loaded: threading.Event = field(default_factory=threading.Event)  # prepare() returned
    seen_by_build: object = None
    collecting_in_build: bool | None = None  # gc.isenabled() while build_agent ran
    build_fails: bool = False
    missing6: str = ""  # what the node lacks for IPv6 (agent.app.ipv6_unsupported)
    ipv6_checks: int = 0


class LoadingProxier:
    """A load that ends only once build_agent has begun: run() calling prepare() itself, before
    build_agent, would never get there (the test fails on the wait)."""

    def __init__(self, start: Start) -> None:
        self._start = start

    def prepare(self) -> None:
        self._start.steps.append("load")
        self._start.loading.set()
        assert self._start.building.wait(10), "the load was not beside build_agent"
        self._start.steps.append("loaded")
        self._start.loaded.set()

    def close(self) -> None:
        # EbpfProxier.close waits for a load under way: so does this one.
        assert self._start.loaded.wait(10)
        self._start.steps.append("close")


class FinishedAgent:
    def run(self) -> int:
        return 0


@pytest.fixture
def start(monkeypatch: pytest.MonkeyPatch) -> Iterator[Start]:
    """run() with the node left alone: no pre-flight, lock or conntrack settings; make_proxier
    and build_agent recorded."""
    s = Start()
    monkeypatch.setattr(app, "preflight", lambda config, ipv6=None: None)
    monkeypatch.setattr(lock, "acquire", lambda config: contextlib.nullcontext())
    monkeypatch.setattr(nodeinit, "setup_conntrack", lambda config: None)
    monkeypatch.setattr(
        into_ebpf,
        "put_back_liberal",
        lambda config, directory: s.steps.append(f"put back liberal {directory}"),
    )

    def ipv6_unsupported(config: Config, missing: Any = None) -> str:
        s.ipv6_checks += 1
        return s.missing6

    monkeypatch.setattr(app, "ipv6_unsupported", ipv6_unsupported)

    def make_proxier(config: Config, metrics: Any = None, **kwargs: Any) -> LoadingProxier:
        s.steps.append("make proxier")
        return LoadingProxier(s)

    def build_agent(config: Config, *args: Any, proxier: object = None, **kwargs: Any) -> FinishedAgent:
        # What build_agent takes seconds for (imports, the API client, node discovery): the load
        # must already be under way on its own thread.
        assert s.loading.wait(10), "build_agent began before the data path's load"
        s.steps.append("build agent")
        s.building.set()
        s.seen_by_build = proxier
        s.collecting_in_build = gc.isenabled()
        if s.build_fails:
            raise FatalError("cannot reach the API server: 401 Unauthorized")
        return FinishedAgent()

    monkeypatch.setattr(app, "make_proxier", make_proxier)
    monkeypatch.setattr(app, "build_agent", build_agent)
    yield s


def test_the_ebpf_load_starts_before_build_agent_and_its_proxier_is_the_agents(
    start: Start, tmp_path: Path
) -> None:
    services = tmp_path / "services.yaml"
    services.write_text("")
    config = Config(mode=Mode.EBPF, services_file=str(services), pin_path=str(tmp_path / "pins"))
    assert app.run(config) == 0
    assert start.steps[:3] == ["make proxier", "load", "build agent"]
    assert isinstance(start.seen_by_build, LoadingProxier)


@pytest.mark.parametrize(
    ("socket_lb", "routing", "missing6", "want"),
    [
        (True, HostRouting.BPF, "", True),
        (False, HostRouting.BPF, "", False),
        (True, HostRouting.LEGACY, "", True),
        (False, HostRouting.LEGACY, "", False),
        (True, HostRouting.BPF, "ip6tables is not on PATH", False),
    ],
)
def test_the_early_load_sizes_the_tc_ipv6_path_before_build_agent_makes_the_ipv6_half(
    start: Start,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    socket_lb: bool,
    routing: HostRouting,
    missing6: str,
    want: bool,
) -> None:
    """run()'s real order with a real EbpfProxier: its load (start_loading) runs before
    build_agent makes the IPv6 half (make_proxier6 -> ipv6()), and still sizes and routes the tc
    IPv6 path (MapSizes.ipv6_tc) as the settings say (Config.tc_ipv6) AND the node can serve IPv6:
    one that falls back to single-stack (no ip6tables) gets no full-size IPv6 conntrack and no
    filled tail-call array. The node is asked once; build_agent is told the same answer. A load
    that asked whether the IPv6 half existed read False here at every start, and the path stayed
    off."""
    start.missing6 = missing6
    rig = Rig(tmp_path)
    rig.config = Config(
        mode=Mode.EBPF,
        services_file=str(tmp_path / "services.yaml"),
        pin_path=str(tmp_path / "pins"),
        node_ips=("10.0.0.1", "fd00::1"),
        socket_lb=socket_lb,
        bpf_host_routing=routing,
    )
    (tmp_path / "services.yaml").write_text("")
    made: list[EbpfProxier] = []

    def make_proxier(config: Config, metrics: Any = None, *, ipv6: bool) -> EbpfProxier:
        made.append(rig.proxier(ipv6=ipv6))
        return made[-1]

    def build_agent(
        config: Config, *args: Any, proxier: Any = None, ipv6_check: Any = None, **kwargs: Any
    ) -> FinishedAgent:
        assert proxier is made[0]
        assert ipv6_check(config) == missing6, "build_agent told what the load was"
        proxier.prepare()  # waits for the early load (or loads): the IPv6 half comes after it
        start.steps.append(f"load sized ipv6_tc={rig.sizes[-1].ipv6_tc}")
        proxier.ipv6()
        return FinishedAgent()

    monkeypatch.setattr(app, "make_proxier", make_proxier)
    monkeypatch.setattr(app, "build_agent", build_agent)
    assert app.run(rig.config) == 0
    assert start.steps == [f"load sized ipv6_tc={want}"]
    assert len(rig.sizes) == 1, "one load, before the IPv6 half existed"
    assert start.ipv6_checks == 1


def test_no_automatic_collection_while_the_agent_starts_and_the_collector_back_on_after(
    start: Start, tmp_path: Path
) -> None:
    """agent.collector.StartHold: the collector is off from before build_agent (the lists and the
    first sync follow it, and the first full sync turns it on again) and on again once run() is
    done, however it ended."""
    services = tmp_path / "services.yaml"
    services.write_text("")
    config = Config(mode=Mode.EBPF, services_file=str(services), pin_path=str(tmp_path / "pins"))
    try:
        assert app.run(config) == 0
        assert start.collecting_in_build is False
        assert gc.isenabled()
    finally:
        gc.enable()


def test_a_failed_build_waits_for_the_early_load_under_the_node_lock(
    start: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """build_agent failing (credentials) after the load began: run() closes the proxier, which
    waits for the load, before it leaves the node lock: nothing the load does outlives it."""
    start.build_fails = True
    services = tmp_path / "services.yaml"
    services.write_text("")
    config = Config(mode=Mode.EBPF, services_file=str(services), pin_path=str(tmp_path / "pins"))
    assert app.run(config) == 1
    assert start.steps == ["make proxier", "load", "build agent", "loaded", "close"]
    assert "401 Unauthorized" in caplog.text


def test_iptables_mode_loads_nothing_early(start: Start, tmp_path: Path) -> None:
    start.loading.set()  # build_agent does not wait: nothing loads early in this mode
    services = tmp_path / "services.yaml"
    services.write_text("")
    assert app.run(Config(mode=Mode.IPTABLES, services_file=str(services))) == 0
    # not the tcp_be_liberal an eBPF agent killed mid-takeover kept: its programs may still be
    # attached until the hand-back detaches them, which puts it back (EbpfHandback)
    assert start.steps == ["build agent"] and start.seen_by_build is None


def test_a_services_file_that_cannot_be_read_is_fatal_before_the_load_starts(
    start: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "missing.yaml"
    config = Config(mode=Mode.EBPF, services_file=str(missing), pin_path=str(tmp_path / "pins"))
    assert app.run(config) == 1
    assert start.steps == []
    assert f"--services-file {missing}: No such file or directory" in caplog.text


@pytest.mark.parametrize("source", ["missing file", "no api server", "pod without token"])
def test_nothing_to_follow_is_fatal_before_the_node_is_touched(
    start: Start,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    source: str,
) -> None:
    """A services file that cannot be read, or no API server at all (no --kubeconfig, no --master,
    not a pod, or a pod without its service account's token), exits 1 before the OOM score, the
    conntrack settings or the data path: kube-proxy builds its client before its platform set-up,
    and a mistyped command line must not leave the host's sysctls changed (as `python -m agent`
    with no flags on a host did)."""
    from agent import oom
    from agent.kube import client

    touched: list[str] = []
    monkeypatch.setattr(nodeinit, "setup_conntrack", lambda config: touched.append("conntrack"))
    monkeypatch.setattr(oom, "apply_oom_score_adj", lambda value: touched.append("oom"))
    monkeypatch.setattr(client, "SERVICE_ACCOUNT_DIR", str(tmp_path / "serviceaccount"))  # none there
    if source == "pod without token":
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    else:
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    files = str(tmp_path / "missing.yaml") if source == "missing file" else ""
    config = Config(mode=Mode.EBPF, services_file=files, pin_path=str(tmp_path / "pins"))
    assert app.run(config) == 1
    assert touched == [] and start.steps == []
    expected = {
        "missing file": "--services-file",
        "no api server": "no API server to watch",
        "pod without token": "cannot read the service account token",
    }[source]
    assert expected in caplog.text


def test_a_pods_environment_and_credentials_are_a_source_to_follow(tmp_path: Path) -> None:
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("a-token")
    (account / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    app.check_source(Config(), pod, str(account))
    app.check_source(Config(master="https://192.168.0.1:6443"), {})
    with pytest.raises(FatalError, match="no API server to watch"):
        app.check_source(Config(), {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, str(account))
    (account / "ca.crt").write_text("")
    with pytest.raises(FatalError, match=r"the service account CA .* is empty"):
        app.check_source(Config(), pod, str(account))


def test_the_start_up_line_says_whether_the_tc_programs_translate_ipv6() -> None:
    """The line an operator reads to learn what serves IPv6 (agent/app.py ipv6_served_by): the tc
    programs' IPv6 path where the settings turn it on (Config.tc_ipv6: either host routing, the
    legacy one through the node's stack), what it needs elsewhere."""
    dual = Config(mode=Mode.EBPF, node_ips=("10.0.0.1", "fd00::1"), socket_lb=True)
    assert dual.bpf_host_routing is HostRouting.LEGACY, "the default routing"
    for routing in (HostRouting.BPF, HostRouting.LEGACY):
        on = app.ipv6_served_by(replace(dual, bpf_host_routing=routing))
        assert "the eBPF tc programs translate the IPv6 TCP and UDP flows" in on
        assert "ip6tables rules (kube-proxy's iptables layout) serve every other IPv6 packet (" in on
        assert ("ip6tables FORWARD and nf_conntrack see client <-> backend" in on) is (
            routing is HostRouting.LEGACY
        )
    for routing in (HostRouting.BPF, HostRouting.LEGACY):
        off = replace(dual, bpf_host_routing=routing, socket_lb=False)
        line = app.ipv6_served_by(off)
        assert "tc programs translate" not in line
        assert "IPv6 path needs --bpf-socket-lb)" in line
