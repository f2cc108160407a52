"""What the agent watches, and with which selectors: kube-proxy's informers, written down once.

kube-proxy (cmd/kube-proxy/app/server.go, `ProxyServer.Run`) builds one label selector from two
"does not exist" requirements and gives it to the Service and EndpointSlice informers:

* `service.kubernetes.io/service-proxy-name`: the object belongs to another proxy;
* `service.kubernetes.io/headless`: the EndpointSlice controller puts it on slices of headless
  Services, which have no virtual IP to program.

apimachinery's `labels.Selector.String()` sorts requirements by key, so the selector on the wire
is `!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name`. The Node informer
selects this node alone with the field selector `metadata.name=<hostname>`
(`fields.OneTermEqualSelector`), and takes no label selector.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s

from agent.sources.base import Kind

LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_HEADLESS = "service.kubernetes.io/headless"
PROXY_LABEL_SELECTOR = f"!{LABEL_HEADLESS},!{LABEL_SERVICE_PROXY_NAME}"


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
        Resource(Kind.SERVICE, "v1", core.list_service_for_all_namespaces, PROXY_LABEL_SELECTOR),
        Resource(
            Kind.ENDPOINT_SLICE,
            "discovery.k8s.io/v1",
            discovery.list_endpoint_slice_for_all_namespaces,
            PROXY_LABEL_SELECTOR,
        ),
    ]
    if hostname:
        out.append(Resource(Kind.NODE, "v1", core.list_node, field_selector=node_field_selector(hostname)))
    return tuple(out)
