"""eBPF mode taking a node over from kube-proxy or from iptables mode, keeping established flows.

The eBPF proxier calls `before_attach(maps)` once its first sync wrote the service maps (so every
frontend and backend has its id) and before its programs are attached, and `after_attach(maps)`
right after:

1. before: every nf_conntrack entry that is an established flow through one of our frontends
   (agent/takeover/flows.py says which) is written into the eBPF conntrack, REPLY entry then
   FORWARD entry, with BPF_NOEXIST (an entry the data path holds already wins). Until the
   programs are attached, packets still go through netfilter, whose conntrack keeps translating
   these flows (its NAT bindings outlive any rule).
   While the programs are being attached, nf_conntrack_tcp_be_liberal is 1 (below, in the code).
2. after: the same again, for the flows the other data path started in between (milliseconds);
   nf_conntrack_tcp_be_liberal back to what it was.
   From here the programs see every packet of those flows first and translate them from their
   own entries: same backend, same SNAT source and port.
3. then, the node being served: the other data path's rules go (agent/iptables/
   kube_proxy_cleanup.py: kube-proxy's iptables chains in both backends, which are also iptables
   mode's, and kube-proxy's nftables tables). Done at every start: an eBPF node has none of them,
   and a kube-proxy still running would only write them again (the programs come first).

Nothing here needs to know which data path was there: kube-proxy (iptables or nftables), iptables
mode and a previous eBPF agent all leave their flows in one of the two tables, and the eBPF
conntrack of a restarting eBPF agent is already in place (BPF_NOEXIST).
"""

from __future__ import annotations

import errno
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

from agent.config import Config
from agent.ebpf import abi
from agent.ebpf.maps import MapError, MapWriter, UpdateFlag
from agent.takeover.flows import EbpfIds, NatFlow, Skip, ebpf_entries, why_not_carried

log = logging.getLogger(__name__)

TCP_BE_LIBERAL = "net/netfilter/nf_conntrack_tcp_be_liberal"


def ebpf_ids(maps: Mapping[str, MapWriter]) -> EbpfIds:
    """Frontend and backend ids as the first sync wrote them."""
    services: dict[tuple[str, int, int], int] = {}
    for k, v in maps["fe"].items():
        if isinstance(k, abi.FrontendKey) and isinstance(v, abi.Frontend):
            services[(abi.ip_str(k.addr), abi.port_host(k.port), k.proto)] = v.svc_id
    backends: dict[tuple[str, int, int], int] = {}
    for k, v in maps["be"].items():
        if isinstance(k, abi.BackendKey) and isinstance(v, abi.Backend):
            backends[(abi.ip_str(v.addr), abi.port_host(v.port), v.proto)] = k.id
    return EbpfIds(services=services, backends=backends)


def _default_dump(netns: str) -> list[NatFlow]:
    from agent.takeover.nfct import dump_flows

    return dump_flows(netns)


def _default_addresses(netns: str) -> frozenset[str]:
    from agent.takeover.nfct import local_addresses

    return local_addresses(netns)


def _default_sysctl(netns: str, path: str, value: str) -> str | None:
    from agent.ebpf.proxier import write_sysctl

    return write_sysctl(netns, path, value)


def _default_cleanup(config: Config) -> Any:
    from agent.iptables.kube_proxy_cleanup import cleanup_kube_proxy

    return cleanup_kube_proxy(config)


class KernelTakeover:
    """The flows of nf_conntrack carried into eBPF conntrack around the first attach, then the
    other data path's rules removed (module doc). Constructing it does nothing."""

    def __init__(
        self,
        config: Config,
        *,
        dump: Callable[[str], Iterable[NatFlow]] = _default_dump,
        addresses: Callable[[str], Collection[str]] = _default_addresses,
        remove_rules: Callable[[Config], Any] = _default_cleanup,
        sysctl: Callable[[str, str, str], str | None] = _default_sysctl,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._config = config
        self._dump = dump
        self._addresses = addresses
        self._remove_rules = remove_rules
        self._sysctl = sysctl
        self._clock_ns = clock_ns  # CLOCK_MONOTONIC, as bpf_ktime_get_ns
        self._liberal_was: str | None = None
        self.carried = 0

    def before_attach(self, maps: Mapping[str, MapWriter]) -> None:
        if self._carry(maps, "before the programs are attached"):
            # While the programs are attached device by device, a carried flow can have one
            # direction translated by a program (netfilter never sees it) and the other still in
            # netfilter, whose window check then finds acks of data it never saw: INVALID, not
            # translated back, and the client's stack answers with a RST. Window checks are off
            # until every device has its program (kube-proxy's conntrack.tcpBeLiberal, for a
            # moment); once they all have, netfilter sees no packet of these flows.
            self._liberal_was = self._sysctl(self._config.netns, TCP_BE_LIBERAL, "1")

    def after_attach(self, maps: Mapping[str, MapWriter]) -> None:
        self._carry(maps, "after the programs were attached")
        if self._liberal_was is not None and self._liberal_was != "1":
            self._sysctl(self._config.netns, TCP_BE_LIBERAL, self._liberal_was)
        self._liberal_was = None

    def serving(self) -> None:
        # Only once the socket programs serve the node's own clients too: kube-proxy's OUTPUT
        # rules are what translated them until then (a connect() meeting neither would send its
        # SYNs to the ClusterIP itself until it timed out).
        self._remove_rules(self._config)

    def _carry(self, maps: Mapping[str, MapWriter], when: str) -> int:
        """Carries what nf_conntrack holds; returns the number of flows it found to carry."""
        started = time.monotonic()
        netns = self._config.netns
        try:
            flows = list(self._dump(netns))
        except (OSError, NetlinkError) as exc:  # no nf_conntrack to read, or no NET_ADMIN
            log.warning(
                "cannot read nf_conntrack in netns %s (%s): flows established before this agent"
                " (kube-proxy's, iptables mode's) are not carried over and their next segments are"
                " dropped; the agent needs NET_ADMIN",
                netns or "(own)",
                exc,
            )
            return 0
        ids = ebpf_ids(maps)
        node = self._addresses(netns)
        skipped: Counter[Skip] = Counter()
        inserted = present = 0
        now = self._clock_ns()
        for flow in flows:
            why = why_not_carried(flow, ids, node)
            if why is not None:
                skipped[why] += 1
                continue
            added = False
            for key, entry in ebpf_entries(flow, ids, now):
                try:
                    maps[abi.ct_role(key.proto)].update(key, entry, UpdateFlag.NOEXIST)
                    added = True
                except MapError as exc:
                    if exc.errno != errno.EEXIST:
                        raise
            if added:
                inserted += 1
                log.debug("took over %s", flow.describe())
            else:
                present += 1
        self.carried += inserted
        if inserted or present or skipped[Skip.NODE_CLIENT] or skipped[Skip.BACKEND_GONE]:
            log.info(
                "took over established flows from nf_conntrack (%s): %d carried into eBPF conntrack, %d there"
                " already; left to the kernel: %d of the node's own clients, %d UDP flows whose backend"
                " left; %d entries read, %.0f ms",
                when,
                inserted,
                present,
                skipped[Skip.NODE_CLIENT],
                skipped[Skip.BACKEND_GONE],
                len(flows),
                (time.monotonic() - started) * 1000,
            )
        return inserted + present
