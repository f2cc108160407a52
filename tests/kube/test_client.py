"""Credentials as kube-proxy takes them: kubeconfig, --master, the in-cluster service account.

Every success case makes a real request through the client to the fake server (which checks the
bearer token, and for the in-cluster case serves TLS that the client must verify with the CA).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from agent.config import Config
from agent.errors import FatalError
from agent.kube.client import api_client, client_configuration, describe
from agent.sources.base import Kind
from lab.fakeapi import FakeApiServer
from lab.fakeapi.objects import service
from tests.kube.conftest import FAST, REGISTRY, Recorded, SourceFactory, wait_until


def list_services(api: k8s.ApiClient) -> list[str]:
    resp: Any = k8s.CoreV1Api(api).list_service_for_all_namespaces(_preload_content=False)
    return [i["metadata"]["name"] for i in json.loads(resp.data)["items"]]


def test_kubeconfig_with_token(tmp_path: Path) -> None:
    with FakeApiServer(tokens=("s3cret",)) as server:
        server.create(service("web", "10.96.0.1"))
        good = api_client(Config(kubeconfig=server.write_kubeconfig(tmp_path / "good", token="s3cret")))
        assert list_services(good) == ["web"]
        bad = api_client(Config(kubeconfig=server.write_kubeconfig(tmp_path / "bad", token="wrong")))
        with pytest.raises(k8s.ApiException) as err:
            list_services(bad)
        assert err.value.status == 401
        assert server.requests[0].headers["authorization"] == "Bearer s3cret"
        assert server.requests[0].headers["user-agent"].startswith("ebpf-kube-proxy/")


def test_master_overrides_the_kubeconfig_server(tmp_path: Path) -> None:
    with FakeApiServer(tokens=("s3cret",)) as server:
        server.create(service("web", "10.96.0.1"))
        path = server.write_kubeconfig(tmp_path / "kc", token="s3cret", server="http://127.0.0.1:1")
        api = api_client(Config(kubeconfig=path, master=server.url))
        assert api.configuration.host == server.url
        assert list_services(api) == ["web"], "the kubeconfig's token is kept"


def test_master_alone_has_no_credentials() -> None:
    with FakeApiServer() as server:
        server.create(service("web", "10.96.0.1"))
        api = api_client(Config(master=server.url + "/"))
        assert list_services(api) == ["web"]
        assert "authorization" not in server.requests[0].headers
        assert describe(api) == f"{server.url} (no credentials)"


def service_account(tmp_path: Path, server: FakeApiServer, token: str) -> tuple[Path, dict[str, str]]:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(token + "\n")
    (sa / "ca.crt").write_bytes(server.ca_path.read_bytes())
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.port)}
    return sa, env


def test_in_cluster_with_token_and_ca_and_token_rotation(tmp_path: Path) -> None:
    with FakeApiServer(tls=True, tokens=("token-1",)) as server:
        server.create(service("web", "10.96.0.1"))
        sa, env = service_account(tmp_path, server, "token-1")
        api = api_client(Config(), environ=env, service_account_dir=str(sa))
        assert api.configuration.host == f"https://127.0.0.1:{server.port}"
        assert list_services(api) == ["web"]
        assert describe(api).endswith("(bearer token)")

        # The kubelet rotates the projected token: a new file swapped in. The next request uses it.
        server.tokens = {"token-2"}
        (sa / "token.new").write_text("token-2")
        os.replace(sa / "token.new", sa / "token")
        assert list_services(api) == ["web"]
        assert server.requests[-1].headers["authorization"] == "Bearer token-2"


def test_in_cluster_verifies_the_server_with_the_ca(tmp_path: Path) -> None:
    with FakeApiServer(tls=True) as server:
        sa, env = service_account(tmp_path, server, "t")
        (sa / "ca.crt").write_bytes(Path("/etc/ssl/certs/ca-certificates.crt").read_bytes())  # not our CA
        api = api_client(Config(), environ=env, service_account_dir=str(sa))
        with pytest.raises(Exception) as err:
            list_services(api)
        assert "CERTIFICATE_VERIFY_FAILED" in str(err.value)


def test_in_cluster_source_end_to_end(tmp_path: Path) -> None:
    from agent.kube.source import ApiSource

    with FakeApiServer(tls=True, tokens=("t",)) as server:
        server.create(service("web", "10.96.0.1"))
        sa, env = service_account(tmp_path, server, "t")
        api = api_client(Config(), environ=env, service_account_dir=str(sa))
        source = ApiSource(Config(hostname="node1"), api, FAST)
        sink = Recorded()
        source.start(sink)
        try:
            sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
            wait_until(lambda: server.open_streams("Service") == 1)
            server.create(service("api", "10.96.0.2"))
            sink.wait(lambda: "default/api" in sink.state(Kind.SERVICE))
        finally:
            source.stop()


def test_ipv6_service_host_is_bracketed(tmp_path: Path) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("t")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    cfg = client_configuration(Config(), environ=env, service_account_dir=str(sa))
    assert cfg.host == "https://[fd00::1]:443"


@pytest.mark.parametrize(
    "setup, expected",
    [
        ("no-env", "KUBERNETES_SERVICE_HOST"),
        ("no-token", "cannot read the service account token"),
        ("empty-token", "is empty"),
        ("no-ca", "cannot read the service account CA"),
    ],
)
def test_in_cluster_problems_are_fatal_and_say_what_is_missing(
    tmp_path: Path, setup: str, expected: str
) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    if setup == "no-env":
        env = {}
    if setup != "no-token":
        (sa / "token").write_text("" if setup == "empty-token" else "t")
    if setup != "no-ca":
        (sa / "ca.crt").write_text("pem")
    with pytest.raises(FatalError) as err:
        api_client(Config(), environ=env, service_account_dir=str(sa))
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "cannot read it"),
        ("clusters: [unclosed", "not valid YAML"),
        ("- a\n- list\n", "not a kubeconfig"),
        ("apiVersion: v1\nkind: Config\nclusters: []\nusers: []\ncontexts: []\n", "--kubeconfig"),
        (
            "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
            "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
            "clusters: [{name: c, cluster: {}}]\nusers: [{name: u, user: {}}]\n",
            "server",
        ),
    ],
)
def test_broken_kubeconfig_is_fatal_and_names_the_file(
    tmp_path: Path, content: str | None, expected: str
) -> None:
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content)
    with pytest.raises(FatalError) as err:
        api_client(Config(kubeconfig=str(path)))
    assert str(path) in str(err.value)
    assert expected in str(err.value)


def test_rejected_credentials_are_logged_once_with_a_hint_then_recover(
    start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.kube")
    with FakeApiServer(tokens=("good",)) as server:
        before = REGISTRY.get_sample_value(
            "ekp_api_request_errors_total", {"kind": "Service", "verb": "list", "reason": "http_401"}
        )
        _, sink = start_source(server, token="stale")
        wait_until(
            lambda: (
                (
                    REGISTRY.get_sample_value(
                        "ekp_api_request_errors_total",
                        {"kind": "Service", "verb": "list", "reason": "http_401"},
                    )
                    or 0
                )
                >= (before or 0) + 3
            ),
            what="three rejected lists",
        )
        server.tokens.add("stale")  # the operator fixes the credentials
        sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
        lines = [r for r in caplog.records if r.getMessage().startswith("Service list")]
        assert [r.levelname for r in lines] == ["WARNING", "INFO"]
        assert "rejected the credentials" in lines[0].getMessage()
        assert "recovered after" in lines[1].getMessage()
