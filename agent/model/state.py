"""Build the whole desired proxy state at once from Services, EndpointSlices and this node.

`build_state` is the one-shot form of `agent.model.tracker.ProxyModel` (which the daemon keeps
alive and feeds object by object): `--dry-run`, the golden tests and the benchmarks use it, and
since it is the same code, they see exactly what a running agent programs. A malformed object
becomes a Problem and is left out; everything else is still built.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agent.model.guard import FrontendGuard
from agent.model.parse import Obj
from agent.model.problem import Problem
from agent.model.tracker import ProxyModel, merge_slices
from agent.model.types import IPFamily, NodeInfo, ProxyState
from agent.sources.base import JSON_MAP_TYPES, Kind, object_key

__all__ = ["BuildResult", "build_state", "merge_slices"]


@dataclass(frozen=True)
class BuildResult:
    state: ProxyState
    problems: tuple[Problem, ...]


def build_state(
    services: Iterable[Obj],
    slices: Iterable[Obj],
    node: NodeInfo,
    guard: FrontendGuard | None = None,
    family: IPFamily = IPFamily.IPv4,
) -> BuildResult:
    """The state a fresh agent programs for these objects (a later duplicate key replaces an
    earlier one, as a MODIFIED event would; an object without a usable name is its own key).
    `guard`: the node's rules for external frontends (none refused without one). `family`: the
    address family whose state is built (one per family, as kube-proxy's metaproxier)."""
    model = ProxyModel(node, guard, family)
    for i, svc in enumerate(services):
        model.set_service(_key(Kind.SERVICE, svc, i), svc)
    for i, eps in enumerate(slices):
        model.set_slice(_key(Kind.ENDPOINT_SLICE, eps, i), eps)
    model.commit()
    return BuildResult(state=model.state, problems=tuple(model.problems()))


def _key(kind: Kind, obj: object, index: int) -> str:
    meta = obj.get("metadata") if isinstance(obj, JSON_MAP_TYPES) else None
    if not isinstance(meta, JSON_MAP_TYPES) or not isinstance(meta.get("name"), str):
        return f"\0unnamed-{index}"
    if not isinstance(meta.get("namespace"), str | None):
        return f"\0unnamed-{index}"
    return object_key(kind, obj)
