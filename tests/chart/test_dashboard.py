"""The Grafana dashboard and the alerts query only metrics the agent exports.

The exported names are taken from the registry `agent.app.build_agent` assembles (captured as it
is created), in both modes and with the API-server source, so that Service/EndpointSlice watch
metrics are included: every sample name a scrape of a running agent can show (`_bucket`,
`_total`, ... included), never a hand-written list.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent import app
from agent.config import Config, Mode
from lab.fakeapi import FakeApiServer
from tests.chart.render import CHART, render

DASHBOARD = CHART / "dashboards" / "ebpf-kube-proxy.json"
METRIC = re.compile(r"\b((?:kubeproxy|ekp|process)_[a-z0-9_]+)\b")


def exported_names(mode: Mode, tmp_path: Path) -> set[str]:
    captured: list[CollectorRegistry] = []

    def capture() -> CollectorRegistry:
        registry = CollectorRegistry()
        captured.append(registry)
        return registry

    server = FakeApiServer()  # never started: building the agent opens no connection
    kubeconfig = server.write_kubeconfig(tmp_path / f"kubeconfig-{mode.value}", server="https://127.0.0.1:1")
    config = Config(mode=mode, hostname="node1", kubeconfig=kubeconfig, node_ips=("192.168.0.11",))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(app, "CollectorRegistry", capture)
        app.build_agent(config)
    assert len(captured) == 1
    registry: Any = captured[0]
    # Names the registry knows from each collector's describe(); collectors without one (the
    # process collector) are asked for a scrape of their own, as the metrics server would.
    names = set(registry._names_to_collectors)
    for collector in registry._collector_to_names:
        if not hasattr(collector, "describe"):
            for family in collector.collect():
                names |= {family.name, *(sample.name for sample in family.samples)}
    return names


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    tmp = tmp_path_factory.mktemp("registry")
    return exported_names(Mode.EBPF, tmp) | exported_names(Mode.IPTABLES, tmp)


def queries(dashboard: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return out


def test_the_dashboard_is_valid_json_with_unique_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "ebpf-kube-proxy" and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 8
    for p in dashboard["panels"]:
        assert p["targets"], p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        assert all(t["expr"].count("(") == t["expr"].count(")") for t in p["targets"]), p["title"]
    wanted = ["sync", "programming", "map fill", "drops", "conntrack"]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    assert all(w in titles for w in wanted), titles


def test_every_metric_the_dashboard_queries_is_exported(exported: set[str]) -> None:
    used = {m for q in queries(json.loads(DASHBOARD.read_text())) for m in METRIC.findall(q)}
    assert {
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_network_programming_duration_seconds_bucket",
        "ekp_bpf_map_fill_ratio",
        "ekp_datapath_drops_total",
        "ekp_conntrack_entries",
    } <= used
    assert used - exported == set(), f"queried but not exported: {sorted(used - exported)}"


def test_every_metric_the_alerts_query_is_exported(exported: set[str]) -> None:
    rule = render({"metrics": {"prometheusRule": {"enabled": True}}}).one("PrometheusRule")
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert len(used) >= 5
    assert used - exported == set(), f"queried but not exported: {sorted(used - exported)}"


def test_a_misspelt_metric_would_be_caught(exported: set[str]) -> None:
    """The check above can fail: the names are the registry's, with their suffixes."""
    assert "ekp_datapath_drops_total" in exported
    assert "ekp_datapath_drop_total" not in exported
    assert "kubeproxy_sync_proxy_rules_duration_seconds_bucket" in exported
    assert "process_resident_memory_bytes" in exported
