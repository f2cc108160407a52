"""The IPv6 half of the agent: kube-proxy's metaproxier (pkg/proxy/metaproxier) beside the IPv4 one.

Upstream runs one proxier per address family and hands every Service to both, every
EndpointSlice to the proxier of its addressType. Here the agent's own sync loop (agent/daemon.py)
keeps the IPv4 model and proxier as before, and `IPv6Family` holds the other family: its own
`ProxyModel` (family IPv6, fed the same records), its own node addresses and frontend guard, its
own proxier and its own retries. The policies are the same code for both (the model, the
renderer); only the family differs.

Which proxier programs IPv6, when the flags describe IPv6 for the node (`Config.ipv6_configured`):

* iptables mode: an `IptablesProxier(family=IPv6)` on ip6tables, with the backend the IPv4 rules
  use.
* eBPF mode: the same ip6tables proxier, beside the eBPF data path that serves IPv4. The eBPF
  data path has no IPv6 path yet (its tc programs pass IPv6 packets to the stack untouched, its
  socket programs leave real IPv6 addresses alone), so IPv6 Services get kube-proxy's ip6tables
  layout until it has: the step eBPF data planes took before their own IPv6 path existed. Its
  backend is --iptables-backend or the node's (no IPv4 rules to follow).

Without IPv6 in the flags no IPv6 proxier runs: the IPv6 state is still computed (so problems with
IPv6 objects are reported the same way), and the first time IPv6 service ports exist the agent
says once, as a warning, that they are not programmed and what turns the IPv6 proxier on.

A failure of the IPv6 sync never holds back the IPv4 one: it is retried at the next sync.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.config import Config, Mode, NodeContext
from agent.errors import FatalError
from agent.featuregates import node_info
from agent.model.guard import FrontendGuard
from agent.model.tracker import Commit, ProxyModel
from agent.model.types import IPFamily, NodeInfo, ServicePortName
from agent.proxier import Proxier, SyncResult

log = logging.getLogger("agent")

# IPv6 service ports named one by one in the "not programmed" warning.
NAMED = 3


def frontend_guard(config: Config, node: NodeContext) -> FrontendGuard:
    """The node's rules for external frontends (agent/model/guard.py), from the flags and the
    node's addresses (those of one family; the flags' CIDRs of both)."""
    return FrontendGuard.of(
        node_ips=node.node_ips,
        cluster_cidrs=config.cluster_cidr,
        service_cidrs=config.service_cidrs,
        allowed_cidrs=config.external_ip_cidrs,
        node_port_range=config.nodeport_range,
    )


def unserved_reason(config: Config) -> str:
    """Why IPv6 Services are not programmed on this node (no IPv6 proxier runs)."""
    how = (
        "ip6tables programs them, beside the eBPF data path (which has no IPv6 path yet)"
        if config.mode is Mode.EBPF
        else "iptables mode programs them with ip6tables"
    )
    return (
        "no IPv6 proxier runs: give --cluster-cidr, --node-ip or --service-cluster-ip-range an IPv6 "
        f"entry and {how}"
    )


class IPv6Family:
    """The IPv6 model, and its proxier when this mode programs IPv6 (else None). No side effects
    at construction; `sync` runs on the agent's sync thread only."""

    def __init__(
        self,
        config: Config,
        proxier: Proxier | None = None,
        node_context: Callable[[], NodeContext] | None = None,
    ) -> None:
        self._config = config
        self.model = ProxyModel(node_info(config), family=IPFamily.IPv6)
        self.proxier = proxier
        self._node_context = node_context or (lambda: NodeContext())
        self.node: NodeContext | None = None
        self._retry: dict[ServicePortName, str] = {}
        self._announced = False
        self._need_full = False  # the last sync raised: the next one writes everything
        self.last_result: SyncResult | None = None
        self.last_full = False  # whether the last sync handed the proxier everything

    def set_node(self, node: NodeInfo) -> None:
        self.model.set_node(node)

    def sync(self, *, full: bool, read_node: bool) -> tuple[Commit, SyncResult | None]:
        """Commit the IPv6 model and, with a proxier, program it: fully when `full` (or when the
        model or the node's IPv6 addresses ask for it, or the last sync failed), else the changed
        and retried ports. `read_node`: re-read the node's IPv6 addresses first (the IPv4 side
        does at the same moments). A failed sync is logged and returned as None with
        `retry_wanted`; FatalError propagates."""
        moved = False
        if self.proxier is not None and (read_node or self.node is None or self.model.full_pending):
            node = self._node_context()
            moved = self.node is not None and node != self.node
            if moved:
                log.info("node IPv6 addresses changed: %s", ",".join(node.node_ips) or "none")
            self.node = node
            self.model.set_guard(frontend_guard(self._config, node))
        commit = self.model.commit()
        if self.proxier is None:
            self._announce()
            return commit, None
        assert self.node is not None
        changed: frozenset[ServicePortName] | None = None
        if not (full or moved or self._need_full or commit.changed is None):
            changed = (commit.changed or frozenset()) | frozenset(self._retry)
        self.last_full = changed is None
        try:
            result = self.proxier.sync(self.model.state, self.node, changed)
        except FatalError:
            raise
        except Exception as exc:
            # The IPv4 rules are programmed already; this family catches up at the next sync.
            log.warning("IPv6 sync failed (retried soon, in full; IPv4 is programmed): %s", exc)
            self._need_full = True
            return commit, None
        self._need_full = False
        self._report(result)
        self.last_result = result
        return commit, result

    @property
    def retry_wanted(self) -> bool:
        """The last sync failed, or left service ports unprogrammed."""
        return self._need_full or bool(self._retry)

    def _announce(self) -> None:
        """Once per agent life: IPv6 service ports exist and nothing programs them."""
        ports = self.model.state.services
        if self._announced or not ports:
            return
        self._announced = True
        named = ", ".join(str(spn) for spn in sorted(ports, key=str)[:NAMED])
        more = f" and {len(ports) - NAMED} more" if len(ports) > NAMED else ""
        log.warning(
            "%d IPv6 service port(s) (%s%s) are not programmed on this node: %s",
            len(ports),
            named,
            more,
            unserved_reason(self._config),
        )

    def _report(self, result: SyncResult) -> None:
        for spn, why in sorted(result.failed.items(), key=lambda item: str(item[0])):
            if self._retry.get(spn) != why:
                log.error(
                    "could not program %s (IPv6): %s (retried; every other service is programmed)", spn, why
                )
        for spn in sorted(self._retry.keys() - result.failed.keys(), key=str):
            log.info("programmed %s (IPv6) after all", spn)
        self._retry = dict(result.failed)
