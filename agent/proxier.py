"""The interface both backends implement, so the runner and the CLI treat the modes alike.

A Proxier's constructor has no side effects; `sync` makes the kernel match the desired state (it
may be called with the same state again after a failure, and must converge); `cleanup` removes
everything this mode ever installed and nothing else.
"""

from __future__ import annotations

from typing import Protocol

from agent.config import NodeContext
from agent.model.types import ProxyState


class Proxier(Protocol):
    def sync(self, state: ProxyState, node: NodeContext) -> None:
        """Program the kernel for `state`; raise on failure (the runner retries)."""

    def cleanup(self) -> None:
        """Remove every rule, program, map and pin this mode created."""


class DryRun(Protocol):
    def render(self, state: ProxyState, node: NodeContext) -> str:
        """What `sync` would write, as stable text (the --dry-run output and golden files)."""
