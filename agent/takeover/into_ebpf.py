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
2. after: the same again, for the flows the other data path started in between (milliseconds),
   once the flows carried before are handed to the stack (below: that ends the window in which
   they lose packets, so nothing comes before it); nf_conntrack_tcp_be_liberal back to what it was.
   From here the programs see every packet of those flows first and translate them from their
   own entries: same backend, same SNAT source and port.
   With bpf host routing netfilter sees no packet of these flows any more. With legacy host
   routing it sees each one between the two translations, client <-> backend, and the flow's
   NAT entry is in the way (agent/takeover/flows.py, `stack_flow`): its reply tuple is the plain
   flow's, so the stack's NAT gives the packets another source port and the backend resets them
   (seen in the lab: conntrack's `found` counter, plain entries whose reply port differs, created
   and destroyed within microseconds). So each carried flow's entry is replaced by the plain one
   the stack would have made, in the same state and window-liberal: the NAT entry deleted, then
   the plain tuple's entry (one made since the attach holds another port), then the plain entry
   created (one a packet made in between is kept). A flow whose backend is the node's own address
   (CtFlag.HOST) meets the stack under either host routing, and its entry is replaced the same way;
   for such a flow the NAT entry is no harmless stranger: the stack delivers the packet with the
   other port to the backend's socket, which answers with a RST that the data path translates
   back to the client (seen in the lab). So the data path drops its forward packets from the
   attach until the replacement is done (CtFlag.HANDOVER, carried with it: the client
   retransmits), and the flag is cleared right after.
3. then, the node being served: the other data path's rules go (agent/iptables/
   kube_proxy_cleanup.py: kube-proxy's iptables chains in both backends, which are also iptables
   mode's, and kube-proxy's nftables tables). Done at every start: an eBPF node has none of them,
   and a kube-proxy still running would only write them again (the programs come first).
   IPv6 is not the eBPF data path's yet: on a node with IPv6 configured the agent's ip6tables
   proxier serves IPv6 Services, so the ip6tables chains (kube-proxy's, iptables mode's: the same
   layout) are left to it, which rewrites them as its own at its first sync, and kube-proxy's
   `ip6 kube-proxy` nftables table is removed by that proxier once its rules are in place.

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

from agent.config import Config, HostRouting
from agent.ebpf import abi
from agent.ebpf.codec import KEYS, VALUES
from agent.ebpf.maps import MapError, MapWriter, UpdateFlag
from agent.takeover.flows import (
    EbpfIds,
    NatFlow,
    Skip,
    Timeouts,
    ct_keys,
    ebpf_entries,
    host_backend,
    stack_flow,
    why_not_carried,
)
from agent.takeover.out_of_ebpf import timeouts_of

log = logging.getLogger(__name__)

TCP_BE_LIBERAL = "net/netfilter/nf_conntrack_tcp_be_liberal"


def ebpf_ids(maps: Mapping[str, MapWriter], flows: Iterable[NatFlow]) -> EbpfIds:
    """The frontend and backend ids the first sync wrote, of the frontends and backends `flows`
    name (their destination, their reply's source). Read from each map's packed dump, one C loop
    of ints, and only what the flows name is kept: an index of every entry as ctypes objects and
    address strings was the agent's peak memory at 50,000 Services (about 250 MiB, twice)."""
    fronts: set[tuple[int, int, int]] = set()
    backs: set[tuple[int, int, int]] = set()
    for flow in flows:
        if ":" in flow.orig[1] or ":" in flow.reply[0]:
            continue  # these maps hold IPv4 frontends and backends only
        fronts.add((abi.ip_be(flow.orig[1]), abi.port_be(flow.orig[3]), flow.proto))
        backs.add((abi.ip_be(flow.reply[0]), abi.port_be(flow.reply[2]), flow.proto))
    services: dict[tuple[str, int, int], int] = {}
    if fronts:
        keys, values = maps["fe"].dump_raw()
        for (addr, port, proto, _scope), value in zip(
            KEYS["fe"].struct.iter_unpack(keys), VALUES["fe"].struct.iter_unpack(values), strict=True
        ):
            if (addr, port, proto) in fronts:
                services[(abi.ip_str(addr), abi.port_host(port), proto)] = value[0]  # svc_id
    backends: dict[tuple[str, int, int], int] = {}
    if backs:
        keys, values = maps["be"].dump_raw()
        for (bid,), (addr, port, proto, _flags) in zip(
            KEYS["be"].struct.iter_unpack(keys), VALUES["be"].struct.iter_unpack(values), strict=True
        ):
            if (addr, port, proto) in backs:
                backends[(abi.ip_str(addr), abi.port_host(port), proto)] = bid
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


def _default_delete(netns: str, flows: Iterable[NatFlow]) -> int:
    from agent.takeover.nfct import delete_flows

    return delete_flows(netns, flows)


def _default_create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts) -> Any:
    from agent.takeover.nfct import create_flows

    return create_flows(netns, flows, timeouts)


def _default_cleanup(config: Config) -> Any:
    from agent.iptables.kube_proxy_cleanup import cleanup_kube_proxy

    return cleanup_kube_proxy(config, nft_families=nft_families_to_remove(config))


def nft_families_to_remove(config: Config) -> tuple[str, ...]:
    """The families of kube-proxy's nftables tables the eBPF start removes: both, unless the node
    serves IPv6 with its ip6tables proxier, which removes `ip6 kube-proxy` itself once its own
    rules serve (agent/app.py, make_proxier6): IPv6 Services are never left without rules."""
    return ("ip",) if config.ipv6_configured else ("ip", "ip6")


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
        delete: Callable[[str, Iterable[NatFlow]], int] = _default_delete,
        create: Callable[[str, Iterable[NatFlow], Timeouts], Any] = _default_create,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._config = config
        self._dump = dump
        self._delete = delete
        self._create = create
        self._addresses = addresses
        self._remove_rules = remove_rules
        self._sysctl = sysctl
        self._clock_ns = clock_ns  # CLOCK_MONOTONIC, as bpf_ktime_get_ns
        self._liberal_was: str | None = None
        self._node: Collection[str] = frozenset()  # the node's addresses, as the last carry read them
        self._carried: list[NatFlow] = []  # before the programs were attached
        self._attached_at = 0.0  # monotonic: after_attach began (the programs were just attached)
        self.carried = 0

    def before_attach(self, maps: Mapping[str, MapWriter]) -> None:
        self._carried = self._carry(maps, "before the programs are attached")
        if self._carried:
            # While the programs are attached device by device, a carried flow can have one
            # direction translated by a program (netfilter never sees it) and the other still in
            # netfilter, whose window check then finds acks of data it never saw: INVALID, not
            # translated back, and the client's stack answers with a RST. Window checks are off
            # until every device has its program (kube-proxy's conntrack.tcpBeLiberal, for a
            # moment); once they all have, netfilter's entries no longer translate these flows
            # (with legacy host routing it tracks them as plain flows from after_attach on).
            self._liberal_was = self._sysctl(self._config.netns, TCP_BE_LIBERAL, "1")

    def after_attach(self, maps: Mapping[str, MapWriter]) -> None:
        # The flows carried before the attach are handed to the stack before anything else, the
        # second dump included: from the attach on, each packet of theirs the stack sees meets their
        # NAT entry in the way (module doc) until that entry is deleted, so the time to their
        # deletion is a window in which they lose packets (an SCTP chunk, never retransmitted by
        # the lab's crafted peer, was lost twice when a starved agent made it last over 2 s). The flows to
        # the node's own address lead: the data path drops their forward packets until then.
        self._attached_at = time.monotonic()
        carried, self._carried = self._carried, []
        host = [f for f in carried if host_backend(f, self._node)]
        pods = [f for f in carried if not host_backend(f, self._node)] if self._stack_sees_all() else []
        first = host + pods
        self._hand_over(maps, first, host)
        done = {f.orig for f in first}
        flows = [f for f in self._carry(maps, "after the programs were attached") if f.orig not in done]
        host = [f for f in flows if host_backend(f, self._node)]
        self._hand_over(maps, flows if self._stack_sees_all() else host, host)
        if self._liberal_was is not None and self._liberal_was != "1":
            self._sysctl(self._config.netns, TCP_BE_LIBERAL, self._liberal_was)
        self._liberal_was = None

    def _stack_sees_all(self) -> bool:
        """Whether the node's stack sees every translated flow (legacy host routing); under bpf host
        routing only a flow to the node's own address meets it."""
        return self._config.bpf_host_routing == HostRouting.LEGACY

    def _hand_over(self, maps: Mapping[str, MapWriter], flows: list[NatFlow], host: list[NatFlow]) -> None:
        """`flows`' NAT entries replaced by the stack's plain ones, then `host` released: replaced
        or not (then the stack resets them, as it would have without the wait), the data path
        stops dropping their forward packets."""
        try:
            if flows:
                self._to_stack(flows)
        finally:
            self._handed_over(maps, host)

    def serving(self) -> None:
        # Only once the socket programs serve the node's own clients too: kube-proxy's OUTPUT
        # rules are what translated them until then (a connect() meeting neither would send its
        # SYNs to the ClusterIP itself until it timed out).
        self._remove_rules(self._config)

    def _handed_over(self, maps: Mapping[str, MapWriter], flows: list[NatFlow]) -> None:
        """CtFlag.HANDOVER cleared on both entries of each flow (agent/takeover/flows.py): the data
        path translates their forward packets from here on."""
        released = 0
        for flow in flows:
            table = maps[abi.ct_role(flow.proto)]
            for key in ct_keys(flow):
                entry = table.lookup(key)
                if not isinstance(entry, abi.CtEntry) or not entry.flags & abi.CtFlag.HANDOVER:
                    continue
                entry.flags &= ~abi.CtFlag.HANDOVER
                # Read, then written back: a state change the data path made in between (its
                # replies renew the REPLY entry) is lost, for microseconds, once per flow.
                try:
                    table.update(key, entry, UpdateFlag.EXIST)
                except MapError as exc:
                    if exc.errno != errno.ENOENT:  # ended meanwhile
                        raise
                    continue
                released += key.dir == abi.CtDir.FORWARD
        if flows:
            log.info(
                "the %d carried flows to a backend on the node's own address are handed over: eBPF"
                " conntrack translates their packets (%d released)",
                len(flows),
                released,
            )

    def _to_stack(self, flows: list[NatFlow]) -> None:
        """Each carried flow's nf_conntrack entry replaced by the plain one legacy host routing's
        stack tracks (module doc, step 2)."""
        started = time.monotonic()
        netns = self._config.netns
        plain = [stack_flow(f) for f in flows]
        try:
            retired = self._delete(netns, flows)
            gone_ms = (time.monotonic() - self._attached_at) * 1000
            stray = self._delete(netns, plain)
            made = self._create(netns, plain, timeouts_of(self._config))
        except (OSError, NetlinkError) as exc:
            log.warning(
                "cannot replace the NAT entries of the %d flows carried into eBPF conntrack in netns %s (%s):"
                " the node's stack sees their packets as client <-> backend (--bpf-host-routing=legacy, or"
                " a backend on the node's own address), finds those entries in the way and gives the"
                " packets another source port, which the backends reset; the agent needs NET_ADMIN",
                len(flows),
                netns or "(own)",
                exc,
            )
            return
        for line in made.failed[:10]:
            log.warning("a carried flow's plain nf_conntrack entry could not be created: %s", line)
        log.info(
            "handed the %d carried flows to the node's stack (legacy host routing, or a backend on the"
            " node's own address): %d NAT entries of"
            " nf_conntrack replaced by client <-> backend entries (%d made by packets meanwhile, %d with"
            " another source port removed, %d failed), %.0f ms; their NAT entries were gone %.0f ms after"
            " the attach (until then the stack gave their packets another source port)",
            len(flows),
            retired,
            made.present,
            stray,
            len(made.failed),
            (time.monotonic() - started) * 1000,
            gone_ms,
        )

    def _carry(self, maps: Mapping[str, MapWriter], when: str) -> list[NatFlow]:
        """Carries what nf_conntrack holds; returns the flows it found to carry (carried now or
        before)."""
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
            return []
        ids = ebpf_ids(maps, flows)
        node = self._node = self._addresses(netns)
        skipped: Counter[Skip] = Counter()
        inserted = present = 0
        carried: list[NatFlow] = []
        now = self._clock_ns()
        for flow in flows:
            why = why_not_carried(flow, ids, node)
            if why is not None:
                skipped[why] += 1
                continue
            carried.append(flow)
            added = False
            for key, entry in ebpf_entries(flow, ids, now, host=host_backend(flow, node)):
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
        return carried
