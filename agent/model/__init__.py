"""The pure desired-state layer: Kubernetes objects in, frozen proxy state out.

Imports no kernel, API-client or subprocess module (checked by import-linter, see pyproject).
"""

from agent.model.guard import FrontendGuard
from agent.model.parse import ParseError, parse_endpoint_slice, parse_service
from agent.model.problem import Problem
from agent.model.state import BuildResult, build_state
from agent.model.topology import categorize_endpoints
from agent.model.types import (
    Endpoint,
    IPFamily,
    NodeInfo,
    Protocol,
    ProxyState,
    ServiceEndpoints,
    ServicePort,
    ServicePortName,
    SessionAffinity,
)

__all__ = [
    "BuildResult",
    "Endpoint",
    "FrontendGuard",
    "IPFamily",
    "NodeInfo",
    "ParseError",
    "Problem",
    "Protocol",
    "ProxyState",
    "ServiceEndpoints",
    "ServicePort",
    "ServicePortName",
    "SessionAffinity",
    "build_state",
    "categorize_endpoints",
    "parse_endpoint_slice",
    "parse_service",
]
