"""The interface both backends implement, so the runner and the CLI treat the modes alike.

A Proxier's constructor has no side effects. `sync` makes the kernel match the desired state:

* `changed` names the service ports whose Service or endpoints changed since the last successful
  sync (kube-proxy's partial sync); `None` asks for a full sync, which also reads the kernel back
  and repairs whatever differs from the desired state (counted in `SyncResult.repaired`).
* A failure confined to some service ports (a full map, a rejected rule) programs every other
  port and names the failed ones in `SyncResult.failed`; the runner retries them. A failure of the
  whole sync raises (the runner retries it with backoff); `agent.errors.FatalError` ends the agent.
* It may be called with the same state again after a failure, and must converge.

`cleanup` removes everything this mode ever installed and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from agent.config import NodeContext
from agent.model.types import ProxyState, ServicePortName


@dataclass(frozen=True)
class SyncResult:
    full: bool = False
    # Service ports that could not be programmed, with the reason (a full map, a rejected restore).
    failed: Mapping[ServicePortName, str] = field(default_factory=dict)
    # Differences between the kernel and the desired state found and repaired (full syncs only).
    repaired: int = 0
    # Service ports to sync again though nothing changed: a step of a hand-over that needs the
    # sync after this one (eBPF mode's IPv6 rules dropped once the maps that serve them are
    # written, agent/metaproxier.py EbpfAndIp6tables). The caller names them in its next call.
    again: frozenset[ServicePortName] = frozenset()


class Proxier(Protocol):
    def prepare(self) -> None:
        """Slow set-up that needs no desired state (compiling the data path, learning the host's
        iptables): the agent runs it while the source lists (eBPF mode's from right after the node
        lock, agent/app.py `start_loading`), so the first sync does not wait for both one after the
        other. eBPF mode's is called twice (the early load, the Agent's): the second waits for the
        first. Raises like `sync`; `sync` does it itself when it was not run."""

    def sync(
        self, state: ProxyState, node: NodeContext, changed: frozenset[ServicePortName] | None = None
    ) -> SyncResult:
        """Program the kernel for `state`; raise on failure of the whole sync (the runner retries)."""

    def cleanup(self) -> None:
        """Remove every rule, program, map and pin this mode created."""
