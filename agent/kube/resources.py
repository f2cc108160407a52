"""What the agent watches, and with which selectors: kube-proxy's informers, written down once.

kube-proxy (cmd/kube-proxy/app/server.go, `ProxyServer.Run`) gives each kind its own selectors:

* Services: the label selector `!service.kubernetes.io/service-proxy-name` (the Service belongs to
  another proxy) and the field selector `spec.clusterIP!=None` (headless Services have no virtual
  IP: DNS serves them), `fields.OneTermNotEqualSelector` on the wire as `spec.clusterIP!=None`;
* EndpointSlices: the label selector `!service.kubernetes.io/headless`, which the EndpointSlice
  controller puts on the slices of headless Services (and copies from a Service that carries it).

Releases before that split gave both informers one selector, `!headless,!service-proxy-name`; the
difference shows for a Service that carries the headless label itself: programmed without
endpoints now (its cluster IP rejects), ignored whole then. agent/model/parse.py applies the same
rules, so a file source and the API source program the same objects. The Node informer selects
this node alone with the field selector `metadata.name=<hostname>` (`fields.OneTermEqualSelector`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes import client as k8s

from agent.sources.base import Kind

LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_HEADLESS = "service.kubernetes.io/headless"
SERVICE_LABEL_SELECTOR = f"!{LABEL_SERVICE_PROXY_NAME}"
SERVICE_FIELD_SELECTOR = "spec.clusterIP!=None"
SLICE_LABEL_SELECTOR = f"!{LABEL_HEADLESS}"


@dataclass(frozen=True)
class Resource:
    """One watched kind: how to list/watch it and what its list items lack (kind, apiVersion)."""

    kind: Kind
    api_version: str
    list_call: Callable[..., Any]  # ListCall, or a fake in tests
    label_selector: str = ""
    field_selector: str = ""

    def describe(self) -> str:
        sel = ", ".join(s for s in (self.label_selector, self.field_selector) if s)
        return f"{self.kind.value}s ({sel})" if sel else f"{self.kind.value}s"


def node_field_selector(hostname: str) -> str:
    """`metadata.name=<hostname>`, escaped as fields.EscapeValue does (\\, ',' and '=')."""
    escaped = hostname.replace("\\", "\\\\").replace(",", "\\,").replace("=", "\\=")
    return f"metadata.name={escaped}"


class ListCall:
    """A list or watch of one collection, unread (the generated client's `_preload_content=False`):
    the request `CoreV1Api.list_service_for_all_namespaces` and its kin send, through the same
    `ApiClient` (`param_serialize`, `call_api`: credentials, TLS, the agent's request pacing),
    without importing the generated API classes. `kubernetes.client.CoreV1Api` is 63,000 lines
    with a pydantic validator per method: importing it cost 0.35 CPU seconds at every start, in
    front of the first list request (tests/kube/test_resources.py checks the requests match).

    Returns the urllib3 response; a status outside 2xx raises the client's ApiException (its
    subclass for the status, as the generated method's), the response read."""

    def __init__(self, api: k8s.ApiClient, path: str) -> None:
        self._api = api
        self.path = path

    def __call__(
        self,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
        _continue: str | None = None,
        resource_version: str | None = None,
        watch: bool | None = None,
        allow_watch_bookmarks: bool | None = None,
        timeout_seconds: int | None = None,
        _preload_content: Literal[False] = False,
        _request_timeout: float | tuple[float, float] | None = None,
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        # The generated method's order of the query parameters.
        query = [
            (name, value)
            for name, value in (
                ("allowWatchBookmarks", allow_watch_bookmarks),
                ("continue", _continue),
                ("fieldSelector", field_selector),
                ("labelSelector", label_selector),
                ("limit", limit),
                ("resourceVersion", resource_version),
                ("timeoutSeconds", timeout_seconds),
                ("watch", watch),
            )
            if value is not None
        ]
        serialized = self._api.param_serialize(
            method="GET",
            resource_path=self.path,
            path_params={},
            query_params=query,
            header_params={"Accept": "application/json"},
            post_params=[],
            files={},
            auth_settings=["BearerToken"],
            collection_formats={},
        )
        resp: Any = self._api.call_api(*serialized, _request_timeout=_request_timeout)
        if not 200 <= resp.status <= 299:
            resp.read()
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return resp.response


SERVICES_PATH = "/api/v1/services"
ENDPOINT_SLICES_PATH = "/apis/discovery.k8s.io/v1/endpointslices"
NODES_PATH = "/api/v1/nodes"


def watched_resources(api: k8s.ApiClient, hostname: str) -> tuple[Resource, ...]:
    """Services and EndpointSlices in all namespaces, and this node's Node when `hostname` is set."""
    out = [
        Resource(
            Kind.SERVICE,
            "v1",
            ListCall(api, SERVICES_PATH),
            SERVICE_LABEL_SELECTOR,
            SERVICE_FIELD_SELECTOR,
        ),
        Resource(
            Kind.ENDPOINT_SLICE,
            "discovery.k8s.io/v1",
            ListCall(api, ENDPOINT_SLICES_PATH),
            SLICE_LABEL_SELECTOR,
        ),
    ]
    if hostname:
        out.append(
            Resource(Kind.NODE, "v1", ListCall(api, NODES_PATH), field_selector=node_field_selector(hostname))
        )
    return tuple(out)
