"""The list and watch requests of `ListCall` are the generated client's, byte for byte.

`agent.kube.resources.ListCall` sends what `CoreV1Api.list_service_for_all_namespaces`,
`DiscoveryV1Api.list_endpoint_slice_for_all_namespaces` and `CoreV1Api.list_node` send, without
importing those classes at start. Both go through `ApiClient.call_api` to its REST client; a
recording REST client compares the requests and answers with a chosen status.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client import rest
from kubernetes.client.exceptions import ApiException

from agent.kube.resources import watched_resources
from agent.sources.base import Kind


class _Urllib3Response:
    def __init__(self, status: int) -> None:
        self.status = status
        self.reason = "why"
        self.data = b'{"kind":"Status"}'
        self.headers: dict[str, str] = {}


class _Recorder:
    """The REST client: records each request, answers `status`."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.requests: list[tuple[Any, ...]] = []
        self.answers: list[_Urllib3Response] = []

    def request(self, method: str, url: str, **kw: Any) -> rest.RESTResponse:
        self.requests.append((method, url, sorted(kw.items())))
        answer = _Urllib3Response(self.status)
        self.answers.append(answer)
        return rest.RESTResponse(answer)


def _api(status: int = 200) -> tuple[k8s.ApiClient, _Recorder]:
    cfg = k8s.Configuration(host="https://10.0.0.1:6443")
    cfg.api_key = {"authorization": "tok"}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    api = k8s.ApiClient(cfg)
    api.user_agent = "test-agent"
    recorder = _Recorder(status)
    api.rest_client = recorder  # type: ignore[assignment]
    return api, recorder


def _generated(api: k8s.ApiClient, kind: Kind) -> Any:
    if kind is Kind.SERVICE:
        return k8s.CoreV1Api(api).list_service_for_all_namespaces
    if kind is Kind.ENDPOINT_SLICE:
        return k8s.DiscoveryV1Api(api).list_endpoint_slice_for_all_namespaces
    return k8s.CoreV1Api(api).list_node


CALLS: list[dict[str, Any]] = [
    # the reflector's first list (the watch cache), a continued page, a consistent list, a watch
    {"resource_version": "0", "limit": 500},
    {"_continue": "c500", "limit": 500},
    {},
    {
        "watch": True,
        "resource_version": "12345",
        "allow_watch_bookmarks": True,
        "timeout_seconds": 301,
        "_request_timeout": (10.0, 316.0),
    },
]


@pytest.mark.parametrize("kind", [Kind.SERVICE, Kind.ENDPOINT_SLICE, Kind.NODE])
@pytest.mark.parametrize("call", CALLS, ids=["rv0", "continue", "consistent", "watch"])
def test_requests_are_the_generated_clients(kind: Kind, call: dict[str, Any]) -> None:
    api, recorder = _api()
    res = {r.kind: r for r in watched_resources(api, "node-a")}[kind]
    kw = dict(
        call,
        label_selector=res.label_selector or None,
        field_selector=res.field_selector or None,
        _preload_content=False,
    )
    got = res.list_call(**kw)
    want = _generated(api, kind)(**kw)
    assert len(recorder.requests) == 2
    ours, theirs = recorder.requests
    assert ours == theirs
    assert ours[1].startswith("https://10.0.0.1:6443/api")
    # the unread urllib3 response, as the generated method returns it with _preload_content=False
    assert got is recorder.answers[0]
    assert want is recorder.answers[1]


@pytest.mark.parametrize("status", [401, 403, 404, 410, 429, 500, 504])
def test_a_failed_request_raises_what_the_generated_client_raises(status: int) -> None:
    api, _ = _api(status)
    res = {r.kind: r for r in watched_resources(api, "")}[Kind.SERVICE]
    with pytest.raises(ApiException) as ours:
        res.list_call(limit=500, _preload_content=False)
    with pytest.raises(ApiException) as theirs:
        _generated(api, Kind.SERVICE)(limit=500, _preload_content=False)
    assert type(ours.value) is type(theirs.value)
    assert ours.value.status == theirs.value.status == status
    assert ours.value.body == theirs.value.body


def test_no_node_without_a_hostname() -> None:
    api, _ = _api()
    assert [r.kind for r in watched_resources(api, "")] == [Kind.SERVICE, Kind.ENDPOINT_SLICE]
