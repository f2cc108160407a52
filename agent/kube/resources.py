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
from typing import Any

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
    list_call: Callable[..., Any]  # a generated client method, e.g. CoreV1Api.list_node
    label_selector: str = ""
    field_selector: str = ""

    def describe(self) -> str:
        sel = ", ".join(s for s in (self.label_selector, self.field_selector) if s)
        return f"{self.kind.value}s ({sel})" if sel else f"{self.kind.value}s"


def node_field_selector(hostname: str) -> str:
    """`metadata.name=<hostname>`, escaped as fields.EscapeValue does (\\, ',' and '=')."""
    escaped = hostname.replace("\\", "\\\\").replace(",", "\\,").replace("=", "\\=")
    return f"metadata.name={escaped}"


def watched_resources(api: k8s.ApiClient, hostname: str) -> tuple[Resource, ...]:
    """Services and EndpointSlices in all namespaces, and this node's Node when `hostname` is set."""
    core = k8s.CoreV1Api(api)
    discovery = k8s.DiscoveryV1Api(api)
    out = [
        Resource(
            Kind.SERVICE,
            "v1",
            core.list_service_for_all_namespaces,
            SERVICE_LABEL_SELECTOR,
            SERVICE_FIELD_SELECTOR,
        ),
        Resource(
            Kind.ENDPOINT_SLICE,
            "discovery.k8s.io/v1",
            discovery.list_endpoint_slice_for_all_namespaces,
            SLICE_LABEL_SELECTOR,
        ),
    ]
    if hostname:
        out.append(Resource(Kind.NODE, "v1", core.list_node, field_selector=node_field_selector(hostname)))
    return tuple(out)
