"""Desired state -> the iptables-restore text kube-proxy's iptables proxier would write. Pure.

A transcription of the rule-writing half of upstream `syncProxyRules` (pkg/proxy/iptables/
proxier.go, v1.31+ layout): the same chains, the same rule text, the same order of lines for a
given order of services. Nothing here runs a command; `proxier.py` applies the text.

Layout (filter table, then nat table, one `iptables-restore --noflush` input):

* filter: KUBE-SERVICES (REJECT/DROP for service IPs without usable endpoints),
  KUBE-EXTERNAL-SERVICES (the same for external IPs, LB IPs and NodePorts), KUBE-FORWARD (INVALID
  drop, accept marked and established traffic), KUBE-NODEPORTS (health-check node ports),
  KUBE-PROXY-FIREWALL (loadBalancerSourceRanges drops), KUBE-FIREWALL (localhost martian drop).
* nat: KUBE-SERVICES -> KUBE-SVC/KUBE-SVL (cluster IP), KUBE-EXT (external IP, NodePort),
  KUBE-FW (LB IP with source ranges); KUBE-SVC/SVL pick a KUBE-SEP by probability (or by
  `-m recent` affinity); KUBE-SEP DNATs. KUBE-MARK-MASQ sets the mark, KUBE-POSTROUTING
  masquerades marked packets once.

Deliberate choices where upstream is not deterministic or depends on the host:

* Service order: upstream iterates a Go map (random order; its tests sort the output). We write
  service ports sorted by ServicePortName string (`ProxyState.sorted_ports()`), so the text is
  stable and diffable. Within a service upstream's order is kept exactly.
* When the cluster and local endpoint lists must be merged, upstream again iterates a map; we
  keep the model's sorted `ip:port` order.
* `--random-fully` on MASQUERADE, the mark's spelling (`%#08x` gives `0x00004000`), the nfacct
  counters and the INVALID drop depend on the host; they are explicit `RenderOptions` fields. The
  `-m nfacct` matches are written, as upstream writes them, only for counters the proxier created
  (`nfacct.py`); without them the rules are upstream's rules on a kernel without nfnetlink_acct.

IPv6 (`RenderOptions.family`): the same function writes the input for ip6tables-restore, as
upstream's one proxier type serves both families. What differs is what upstream's IPv6 proxier
writes differently: no localhost NodePorts (no KUBE-FIREWALL martian drop, no route_localnet, no
127.0.0.0/8 jumps), the NodePort tail excludes `::1/128`, endpoints are `[ip]:port` (in the DNAT
target, the comments and the hashed KUBE-SEP names), and only the family's --nodeport-addresses
CIDRs and node addresses count. REJECT is written bare in both: ip6tables sends ICMPv6
port-unreachable (`icmp6-port-unreachable`, as ip6tables-save prints it). The mark is the same.

Nothing caller-controlled reaches the text unchecked: a service port with a value the API server
would refuse (a name with a newline or a space, an address that is not a canonical address of the
family, ...) is left out and reported in `Rendered.refused` (`safety.py`); every other port is
rendered as usual.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from agent.config import Config, NodeContext, nodeport_addresses_hold_loopback
from agent.iptables.chains import (
    FILTER_TOP_CHAINS,
    INVALID_DROPPED_COUNTER,
    KUBE_EXTERNAL_SERVICES,
    KUBE_FIREWALL,
    KUBE_FORWARD,
    KUBE_MARK_MASQ,
    KUBE_NODEPORTS,
    KUBE_POSTROUTING,
    KUBE_PROXY_FIREWALL,
    KUBE_SERVICES,
    LOCALHOST_NODEPORTS_COUNTER,
    MARTIAN_COMMENT,
    MASQUERADE_COMMENT,
    NAT_TOP_CHAINS,
    NODEPORTS_TAIL_COMMENT,
    endpoint_chain,
    external_chain,
    firewall_chain,
    is_service_chain,
    local_chain,
    service_chain,
)
from agent.iptables.safety import refusal
from agent.localdetect import LocalDetector
from agent.model.types import (
    Endpoint,
    IPFamily,
    ProxyState,
    ServiceEndpoints,
    ServicePort,
    ServicePortName,
    SessionAffinity,
)

# Above this many endpoints (all endpoints of all service ports, ready or not) upstream drops the
# per-endpoint comments to keep the restore input small ("large cluster mode").
LARGE_CLUSTER_ENDPOINTS_THRESHOLD = 1000

# What the NodePort tail excludes in each family when localhost NodePorts are off (always for IPv6).
_LOOPBACK_TEXT = {IPFamily.IPv4: "127.0.0.0/8", IPFamily.IPv6: "::1/128"}


def masquerade_mark(bit: int) -> str:
    """The mark as kube-proxy spells it in its rules: Go's `%#08x`, e.g. `0x00004000` for bit 14."""
    return f"0x{1 << bit:08x}"


def masquerade_ports_beside(
    snat: tuple[int, int], held: tuple[int, int] | None = None
) -> tuple[int, int] | None:
    """The source ports ip6tables' MASQUERADE may take beside the tc programs' IPv6 path: the largest
    span of 1024-65535 outside `snat` (--bpf-snat-ports). That path chooses a masqueraded flow's
    port in `snat` by looking at its own conntrack only; nf_nat chooses among 1024-65535 (or, with
    --to-ports, that range alone) by looking at nf_conntrack only. Kept apart, neither can give a
    port the other holds for the same backend, which would hand one flow's replies to the other.

    `held`: the lowest and highest port the tc path's live flows hold outside `snat` (it translated
    them with an earlier run's --bpf-snat-ports): the ports are then the largest span of 1024-65535
    that meets neither, so nf_nat cannot pick one of those either. None when nothing is left (the
    agent refuses a --bpf-snat-ports that leaves nothing: it overlaps the node's local ports, and
    an earlier run's held ports were kept off those by the same check)."""
    taken = sorted(r for r in (snat, held) if r is not None)
    gaps: list[tuple[int, int]] = []
    start = 1024
    for lo, hi in taken:
        if lo > start:
            gaps.append((start, lo - 1))
        start = max(start, hi + 1)
    if start <= 65535:
        gaps.append((start, 65535))
    return max(gaps, key=lambda r: r[1] - r[0]) if gaps else None


@dataclass(frozen=True)
class RenderOptions:
    """Everything besides the state that changes the rule text (flags and host facts)."""

    masquerade_all: bool = False
    masquerade_mark: str = "0x00004000"
    # The local-traffic detector (agent/localdetect.py): `-s CIDR`, `-i BRIDGE` or `-i PREFIX+` is
    # pod traffic; none (as upstream) drops the off-cluster masquerade and the pod short-circuit rules.
    local: LocalDetector = field(default_factory=LocalDetector)
    # --nodeport-addresses: () = every local address (one `--dst-type LOCAL` jump), else CIDRs
    # (or the keyword "primary") giving one `-d IP` jump per matching node address.
    nodeport_addresses: tuple[str, ...] = ()
    # --iptables-localhost-nodeports (upstream default true): NodePorts answer on 127.0.0.1 when
    # the node-port addresses include loopback; needs route_localnet=1 and the martian drop.
    localhost_nodeports: bool = True
    # iptables >= 1.6.2 supports MASQUERADE --random-fully; kube-proxy uses it when available.
    random_fully: bool = True
    # MASQUERADE --to-ports: eBPF mode's ip6tables beside the tc programs' IPv6 path, which takes
    # source ports of --bpf-snat-ports for the node's IPv6 address without seeing nf_conntrack's
    # (`masquerade_ports_beside`); None (kube-proxy's rule) everywhere else.
    masquerade_to_ports: tuple[int, int] | None = None
    # nf_conntrack_tcp_be_liberal=1 on the host: upstream then omits the INVALID drop.
    conntrack_tcp_liberal: bool = False
    # The nfacct counters the proxier created (kube-proxy's nfAcctCounters): the INVALID drop and
    # the localhost NodePort jumps then count their packets (`-m nfacct --nfacct-name ...`).
    nfacct_invalid_dropped: bool = False
    nfacct_localhost_nodeports: bool = False
    # The family of the state and of the restore (iptables-restore or ip6tables-restore).
    family: IPFamily = IPFamily.IPv4

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        node_pod_cidrs: tuple[str, ...] = (),
        random_fully: bool = True,
        conntrack_tcp_liberal: bool = False,
        nfacct_invalid_dropped: bool = False,
        nfacct_localhost_nodeports: bool = False,
        family: IPFamily = IPFamily.IPv4,
        snat6_held: tuple[int, int] | None = None,
    ) -> RenderOptions:
        """`snat6_held`: ports the tc IPv6 path's flows hold outside --bpf-snat-ports
        (`masquerade_ports_beside`)."""
        return cls(
            family=family,
            masquerade_all=config.masquerade_all,
            masquerade_mark=masquerade_mark(config.masquerade_bit),
            local=config.local_detector(node_pod_cidrs, family),
            nodeport_addresses=tuple(config.nodeport_addresses),
            localhost_nodeports=config.iptables_localhost_nodeports,
            random_fully=random_fully,
            masquerade_to_ports=(
                masquerade_ports_beside(config.snat_ports, snat6_held)
                if family is IPFamily.IPv6 and config.tc_ipv6
                else None
            ),
            conntrack_tcp_liberal=conntrack_tcp_liberal,
            nfacct_invalid_dropped=nfacct_invalid_dropped,
            nfacct_localhost_nodeports=nfacct_localhost_nodeports,
        )

    @property
    def nodeport_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """The --nodeport-addresses CIDRs of this family (upstream's NewNodePortAddresses drops the
        other family's; `primary` is resolved against the node, not here)."""
        return tuple(
            ipaddress.ip_network(c.strip(), strict=False)
            for c in self.nodeport_addresses
            if _is_cidr_of(c, self.family)
        )

    @property
    def nodeports_match_all(self) -> bool:
        """No CIDR of this family given (lists of the other family only included), or 0.0.0.0/0
        (::/0) among them: every address."""
        if "primary" in self.nodeport_addresses:
            return False
        nets = self.nodeport_networks
        return not nets or any(n.prefixlen == 0 for n in nets)

    @property
    def localhost_nodeports_enabled(self) -> bool:
        """Upstream turns localhost NodePorts off unless the node-port addresses include loopback
        (`cidr.IP.IsLoopback() || cidr.Contains(127.0.0.0)`, proxy/util/nodeport_addresses.go),
        and always for IPv6 (`ContainsIPv4Loopback` is false for the IPv6 proxier)."""
        return (
            self.family is IPFamily.IPv4
            and self.localhost_nodeports
            and nodeport_addresses_hold_loopback(self.nodeport_addresses)
        )


def _is_cidr_of(text: str, family: IPFamily) -> bool:
    try:
        return ipaddress.ip_network(text.strip(), strict=False).version == family
    except ValueError:
        return False


def nodeport_ips(options: RenderOptions, node: NodeContext) -> list[str]:
    """Addresses that get their own NodePort jump when --nodeport-addresses is set (loopback
    first, as upstream; the selection itself is NodeContext.nodeport_ips, shared by both modes).
    `node` holds the addresses of the options' family."""
    own = tuple(c for c in options.nodeport_addresses if c == "primary" or _is_cidr_of(c, options.family))
    return list(node.nodeport_ips(own, loopback=True)) if own else []


def _probability(n: int) -> str:
    """Upstream's `fmt.Sprintf("%0.10f", 1.0/float64(n))` (both round the exact binary value)."""
    return f"{1.0 / n:0.10f}"


def categorized(state: ProxyState, sp: ServicePort) -> ServiceEndpoints:
    """The endpoints the model chose for this port (kube-proxy's CategorizeEndpoints)."""
    return state.endpoints.get(sp.name, ServiceEndpoints())


def total_endpoints(state: ProxyState) -> int:
    return sum(len(state.raw_endpoints.get(spn, ())) for spn in state.services)


@dataclass
class Rendered:
    """One restore input and the facts the proxier and the metrics need about it."""

    text: str
    filter_rules: int  # `-A` lines in the filter table
    nat_rules: int  # `-A` lines in nat as written (partial syncs leave unchanged services out)
    nat_rules_total: int  # `-A` lines nat holds after the restore (written + kept)
    active_nat_chains: frozenset[str]
    deleted_chains: tuple[str, ...]
    large_cluster: bool
    written_services: frozenset[str] = field(default_factory=frozenset)
    # Service chains a partial sync relies on without writing them (they must exist already).
    kept_chains: frozenset[str] = field(default_factory=frozenset)
    # Service ports left out because a value of theirs could break out of its argument (safety.py).
    refused: dict[ServicePortName, str] = field(default_factory=dict)
    # Every active per-service nat chain -> the Service (`namespace/name`) it belongs to.
    chain_owner: dict[str, str] = field(default_factory=dict)

    @property
    def rule_count(self) -> int:
        """Rules programmed in filter and nat after the restore (kube-proxy's rules-total metric)."""
        return self.filter_rules + self.nat_rules_total


class _Writer:
    """Accumulates lines for one sync. Every line is a complete string; one join at the end."""

    def __init__(self) -> None:
        self.filter_chains: list[str] = [f":{c} - [0:0]" for c in FILTER_TOP_CHAINS]
        self.filter_rules: list[str] = []
        self.nat_chains: list[str] = [f":{c} - [0:0]" for c in NAT_TOP_CHAINS]
        self.nat_rules: list[str] = []
        # Chains and rules of services left out of a partial sync: counted, never written.
        self.skipped_chains: list[str] = []
        self.skipped_rules: list[str] = []
        self.active_nat_chains: set[str] = set()
        self.kept_chains: set[str] = set()
        self.chain_owner: dict[str, str] = {}


def render(
    state: ProxyState,
    node: NodeContext,
    options: RenderOptions,
    *,
    changed: Collection[str] | None = None,
    existing_nat_chains: Iterable[str] = (),
) -> Rendered:
    """The restore input for `state`.

    `changed`: for a partial sync, the services (`namespace/name`) whose own chains are rewritten;
    every other service's SVC/SVL/EXT/FW/SEP chains are left out of the text (they stay as they
    are in the kernel) while KUBE-SERVICES, KUBE-NODEPORTS and the filter table are rewritten in
    full. None = full sync.
    `existing_nat_chains`: the nat chains known to exist (iptables-save, or what the proxier
    programmed); service chains among them that the state no longer uses are flushed and deleted
    (`-X`) in the same restore.

    Service ports whose values could break out of their arguments are skipped (`Rendered.refused`).
    """
    w = _Writer()
    mark = options.masquerade_mark
    localhost = options.localhost_nodeports_enabled
    large = total_endpoints(state) > LARGE_CLUSTER_ENDPOINTS_THRESHOLD

    refused: dict[ServicePortName, str] = {}
    w.nat_rules.append(f"-A {KUBE_POSTROUTING} -m mark ! --mark {mark}/{mark} -j RETURN")
    w.nat_rules.append(f"-A {KUBE_POSTROUTING} -j MARK --xor-mark {mark}")
    random = " --random-fully" if options.random_fully else ""
    masq = f'-A {KUBE_POSTROUTING} -m comment --comment "{MASQUERADE_COMMENT}"'
    if options.masquerade_to_ports is not None:
        # --to-ports needs a protocol with ports: one rule each for TCP and UDP, which the tc IPv6
        # path masquerades (SCTP it leaves to ip6tables whole, so no port of its clashes)
        lo, hi = options.masquerade_to_ports
        for proto in ("tcp", "udp"):
            w.nat_rules.append(f"{masq} -p {proto} -j MASQUERADE --to-ports {lo}-{hi}{random}")
    w.nat_rules.append(f"{masq} -j MASQUERADE{random}")
    w.nat_rules.append(f"-A {KUBE_MARK_MASQ} -j MARK --or-mark {mark}")
    if localhost:
        w.filter_chains.append(f":{KUBE_FIREWALL} - [0:0]")
        w.filter_rules.append(
            f'-A {KUBE_FIREWALL} -m comment --comment "{MARTIAN_COMMENT}" -d 127.0.0.0/8 ! -s 127.0.0.0/8 '
            "-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
        )

    written: set[str] = set()
    for sp, whole in _in_order(state):
        if not whole:
            if refusal(sp, (), options.family) is None:
                _health_check_accept(w.filter_rules, sp)
            continue
        eps = categorized(state, sp)
        reason = refusal(sp, (*eps.all_reachable, *eps.cluster, *eps.local), options.family)
        if reason is not None:
            refused[sp.name] = reason
            continue
        write_own = changed is None or sp.name.service in changed
        if write_own:
            written.add(sp.name.service)
        _service_port(w, state, node, options, sp, large=large, write_own=write_own)

    deleted: list[str] = []
    for chain in sorted(set(existing_nat_chains) - w.active_nat_chains):
        if is_service_chain(chain):
            w.nat_chains.append(f":{chain} - [0:0]")
            w.nat_rules.append(f"-X {chain}")
            deleted.append(chain)

    tail = f'-A {KUBE_SERVICES} -m comment --comment "{NODEPORTS_TAIL_COMMENT}"'
    if options.nodeports_match_all:
        dst = "-m addrtype --dst-type LOCAL" + (
            "" if localhost else f" ! -d {_LOOPBACK_TEXT[options.family]}"
        )
        w.nat_rules.append(f"{tail} {dst} -j {KUBE_NODEPORTS}")
    else:
        for ip in nodeport_ips(options, node):
            if ipaddress.ip_address(ip).is_loopback and not localhost:
                continue  # upstream logs that localhost NodePorts are off (never on for IPv6)
            w.nat_rules.append(f"{tail} -d {ip} -j {KUBE_NODEPORTS}")

    if not options.conntrack_tcp_liberal:
        count = (
            f" -m nfacct --nfacct-name {INVALID_DROPPED_COUNTER}" if options.nfacct_invalid_dropped else ""
        )
        w.filter_rules.append(f"-A {KUBE_FORWARD} -m conntrack --ctstate INVALID{count} -j DROP")
    w.filter_rules.append(
        f'-A {KUBE_FORWARD} -m comment --comment "kubernetes forwarding rules" '
        f"-m mark --mark {mark}/{mark} -j ACCEPT"
    )
    w.filter_rules.append(
        f'-A {KUBE_FORWARD} -m comment --comment "kubernetes forwarding conntrack rule" '
        "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
    )

    lines = [
        "*filter",
        *w.filter_chains,
        *w.filter_rules,
        "COMMIT",
        "*nat",
        *w.nat_chains,
        *w.nat_rules,
        "COMMIT",
        "",
    ]
    nat_written = len(w.nat_rules) - len(deleted)  # the `-X` lines are not rules
    return Rendered(
        text="\n".join(lines),
        filter_rules=len(w.filter_rules),
        nat_rules=nat_written,
        nat_rules_total=nat_written + len(w.skipped_rules),
        active_nat_chains=frozenset(w.active_nat_chains),
        deleted_chains=tuple(deleted),
        large_cluster=large,
        written_services=frozenset(written),
        kept_chains=frozenset(w.kept_chains),
        refused=refused,
        chain_owner=w.chain_owner,
    )


def _in_order(state: ProxyState) -> list[tuple[ServicePort, bool]]:
    """The service ports to render in upstream's order, each with whether its rules are written
    whole (False: one of `state.elsewhere`, its health-check ACCEPT alone)."""
    if not state.elsewhere:
        return [(sp, True) for sp in state.sorted_ports()]
    ports = {spn: (sp, False) for spn, sp in state.elsewhere.items() if spn not in state.services}
    ports.update((spn, (sp, True)) for spn, sp in state.services.items())
    return [ports[spn] for spn in sorted(ports, key=lambda n: (str(n), n.protocol))]


def health_check_accepts(state: ProxyState, family: int) -> list[str]:
    """The filter table's KUBE-NODEPORTS of eBPF mode's ip6tables when its programs leave no
    service port to the stack (agent/metaproxier.py EbpfAndIp6tables `withdraw`), as rules after
    `-A KUBE-NODEPORTS `: the healthCheckNodePorts' ACCEPTs alone, which INPUT jumps to without a
    conntrack match (agent/iptables/cleanup.py `withdrawal` writes them). Nothing else: no nat
    chain and no conntrack match, so nf_conntrack and nf_nat register no hook in the node's netns
    for IPv6 (IPv4's eBPF mode writes no rule at all). Every port of `state` and of
    `state.elsewhere` counts. Empty when no port has a healthCheckNodePort."""
    ports = {**state.elsewhere, **state.services}
    flt: list[str] = []
    for spn in sorted(ports, key=lambda n: (str(n), n.protocol)):
        sp = ports[spn]
        if refusal(sp, (), family) is None:
            _health_check_accept(flt, sp)
    prefix = f"-A {KUBE_NODEPORTS} "
    return [line.removeprefix(prefix) for line in flt]


def _health_check_accept(flt: list[str], sp: ServicePort) -> None:
    """The filter table's KUBE-NODEPORTS ACCEPT of `sp`'s healthCheckNodePort (none without one)."""
    if sp.health_check_node_port:
        flt.append(
            f'-A {KUBE_NODEPORTS} -m comment --comment "{sp.name} health check node port" '
            f"-m tcp -p tcp --dport {sp.health_check_node_port} -j ACCEPT"
        )


def _service_port(
    w: _Writer,
    state: ProxyState,
    node: NodeContext,
    options: RenderOptions,
    sp: ServicePort,
    *,
    large: bool,
    write_own: bool,
) -> None:
    """All rules for one service port, in upstream's order."""
    spn = sp.name
    name = str(spn)
    proto = sp.protocol.value.lower()
    match = f"-m {proto} -p {proto}"
    eps = categorized(state, sp)
    has_endpoints = eps.has_any

    cluster_chain = service_chain(spn)
    svl_chain = local_chain(spn)
    ext_chain = external_chain(spn)
    fw_chain = firewall_chain(spn)
    uses_cluster_chain = bool(eps.cluster) and sp.uses_cluster_endpoints
    uses_local_chain = bool(eps.local) and sp.uses_local_endpoints

    internal_chain = cluster_chain
    has_internal = has_endpoints
    if sp.internal_policy_local:
        internal_chain = svl_chain
        has_internal = has_internal and bool(eps.local)
    external_policy_chain = cluster_chain
    has_external = has_endpoints
    if sp.external_policy_local:
        external_policy_chain = svl_chain
        has_external = has_external and bool(eps.local)
    # Built on has_endpoints, not has_external: the short-circuit rules for pod and host traffic
    # are needed even when no local endpoint serves external traffic.
    uses_ext_chain = has_endpoints and sp.externally_accessible
    uses_fw_chain = has_endpoints and bool(sp.load_balancer_ips) and bool(sp.load_balancer_source_ranges)
    lb_chain = fw_chain if uses_fw_chain else ext_chain

    if not has_endpoints:
        internal_target = external_target = "REJECT"
        internal_comment = external_comment = f'"{name} has no endpoints"'
    else:
        internal_target = external_target = "DROP"
        internal_comment = external_comment = f'"{name} has no local endpoints"'

    nat = w.nat_rules
    flt = w.filter_rules
    cluster_ip_match = (
        f'-m comment --comment "{name} cluster IP" {match} -d {sp.cluster_ip} --dport {sp.port}'
    )
    if has_internal:
        nat.append(f"-A {KUBE_SERVICES} {cluster_ip_match} -j {internal_chain}")
    else:
        flt.append(
            f"-A {KUBE_SERVICES} -m comment --comment {internal_comment} {match} "
            f"-d {sp.cluster_ip} --dport {sp.port} -j {internal_target}"
        )

    for ip in sp.external_ips:
        if has_endpoints:
            nat.append(
                f'-A {KUBE_SERVICES} -m comment --comment "{name} external IP" {match} '
                f"-d {ip} --dport {sp.port} -j {ext_chain}"
            )
        if not has_external:
            flt.append(
                f"-A {KUBE_EXTERNAL_SERVICES} -m comment --comment {external_comment} {match} "
                f"-d {ip} --dport {sp.port} -j {external_target}"
            )

    for ip in sp.load_balancer_ips:
        if has_endpoints:
            nat.append(
                f'-A {KUBE_SERVICES} -m comment --comment "{name} loadbalancer IP" {match} '
                f"-d {ip} --dport {sp.port} -j {lb_chain}"
            )
        if uses_fw_chain:
            flt.append(
                f'-A {KUBE_PROXY_FIREWALL} -m comment --comment "{name} traffic not accepted by {fw_chain}" '
                f"{match} -d {ip} --dport {sp.port} -j DROP"
            )
    if not has_external:
        for ip in sp.load_balancer_ips:
            flt.append(
                f"-A {KUBE_EXTERNAL_SERVICES} -m comment --comment {external_comment} {match} "
                f"-d {ip} --dport {sp.port} -j {external_target}"
            )

    if sp.node_port:
        if has_endpoints:
            if options.localhost_nodeports_enabled and options.nfacct_localhost_nodeports:
                # Counted separately, for kubeproxy_iptables_localhost_nodeports_accepted_packets_total.
                nat.append(
                    f"-A {KUBE_NODEPORTS} -m comment --comment {name} {match} -d 127.0.0.0/8 "
                    f"--dport {sp.node_port} -m nfacct --nfacct-name {LOCALHOST_NODEPORTS_COUNTER} "
                    f"-j {ext_chain}"
                )
            nat.append(
                f"-A {KUBE_NODEPORTS} -m comment --comment {name} {match} "
                f"--dport {sp.node_port} -j {ext_chain}"
            )
        if not has_external:
            flt.append(
                f"-A {KUBE_EXTERNAL_SERVICES} -m comment --comment {external_comment} "
                f"-m addrtype --dst-type LOCAL {match} --dport {sp.node_port} -j {external_target}"
            )

    _health_check_accept(flt, sp)

    # From here on: the service's own chains, left out of a partial sync when unchanged.
    if write_own:
        chains, rules = w.nat_chains, w.nat_rules
    else:
        chains, rules = w.skipped_chains, w.skipped_rules
    active: set[str] = set()

    if has_internal:
        if options.masquerade_all:
            rules.append(f"-A {internal_chain} {cluster_ip_match} -j {KUBE_MARK_MASQ}")
        elif options.local.implemented:
            # Off-cluster traffic to a service IP (a static route to any node) may leave this
            # node again, so masquerade it.
            rules.append(
                f"-A {internal_chain} {cluster_ip_match} {options.local.if_not_local()} -j {KUBE_MARK_MASQ}"
            )

    if uses_ext_chain:
        chains.append(f":{ext_chain} - [0:0]")
        active.add(ext_chain)
        if not sp.external_policy_local:
            rules.append(
                f'-A {ext_chain} -m comment --comment "masquerade traffic for {name} external destinations" '
                f"-j {KUBE_MARK_MASQ}"
            )
        else:
            if options.local.implemented:
                # Pod traffic to an external address acts as if it went out to the load
                # balancer and came back: neither traffic policy applies to it.
                rules.append(
                    f'-A {ext_chain} -m comment --comment "pod traffic for {name} external destinations" '
                    f"{options.local.if_local()} -j {cluster_chain}"
                )
            rules.append(
                f'-A {ext_chain} -m comment --comment "masquerade LOCAL traffic for {name} external '
                f'destinations" -m addrtype --src-type LOCAL -j {KUBE_MARK_MASQ}'
            )
            rules.append(
                f'-A {ext_chain} -m comment --comment "route LOCAL traffic for {name} external destinations" '
                f"-m addrtype --src-type LOCAL -j {cluster_chain}"
            )
        if has_external:
            rules.append(f"-A {ext_chain} -j {external_policy_chain}")

    if uses_fw_chain:
        chains.append(f":{fw_chain} - [0:0]")
        active.add(fw_chain)
        fw_args = f'-A {fw_chain} -m comment --comment "{name} loadbalancer IP"'
        allow_from_node = False
        node_ip = ipaddress.ip_address(node.primary_ip) if node.primary_ip else None
        for text in sp.load_balancer_source_ranges:
            cidr = ipaddress.ip_network(text.strip(), strict=False)
            rules.append(f"{fw_args} -s {cidr} -j {ext_chain}")
            if node_ip is not None and node_ip in cidr:
                allow_from_node = True
        # A VIP-like load balancer often makes the LB IP local: the node's own requests to it
        # then loop back with the LB IP as source; let them through.
        if allow_from_node:
            for ip in sp.load_balancer_ips:
                rules.append(f"{fw_args} -s {ip} -j {ext_chain}")
        rules.append(
            f'-A {fw_chain} -m comment --comment "other traffic to {name} will be dropped by '
            f'{KUBE_PROXY_FIREWALL}"'
        )

    if uses_cluster_chain:
        chains.append(f":{cluster_chain} - [0:0]")
        active.add(cluster_chain)
        _endpoint_jumps(rules, sp, cluster_chain, eps.cluster, name, large)
    if uses_local_chain:
        chains.append(f":{svl_chain} - [0:0]")
        active.add(svl_chain)
        _endpoint_jumps(rules, sp, svl_chain, eps.local, name, large)

    comment = "" if large else f" -m comment --comment {name}"
    affinity = sp.session_affinity is SessionAffinity.CLIENT_IP
    for ep in eps.all_reachable:
        sep = endpoint_chain(spn, str(ep))
        chains.append(f":{sep} - [0:0]")
        active.add(sep)
        args = f"-A {sep}{comment}"
        # Hairpin: an endpoint reaching itself through the service must be masqueraded.
        rules.append(f"{args} -s {ep.ip} -j {KUBE_MARK_MASQ}")
        recent = f" -m recent --name {sep} --set" if affinity else ""
        rules.append(f"{args}{recent} {match} -j DNAT --to-destination {ep}")
    w.active_nat_chains |= active
    for chain in active:
        w.chain_owner[chain] = spn.service
    if not write_own:
        w.kept_chains |= active


def _endpoint_jumps(
    rules: list[str], sp: ServicePort, chain: str, endpoints: tuple[Endpoint, ...], name: str, large: bool
) -> None:
    """Affinity checks first, then one probabilistic jump per endpoint, the last unconditional."""
    seps = [endpoint_chain(sp.name, str(ep)) for ep in endpoints]
    comments = ["" if large else f' -m comment --comment "{name} -> {ep}"' for ep in endpoints]
    if sp.session_affinity is SessionAffinity.CLIENT_IP:
        for sep, comment in zip(seps, comments, strict=True):
            rules.append(
                f"-A {chain}{comment} -m recent --name {sep} --rcheck "
                f"--seconds {sp.affinity_timeout_seconds} --reap -j {sep}"
            )
    n = len(endpoints)
    for i, (sep, comment) in enumerate(zip(seps, comments, strict=True)):
        if i < n - 1:
            rules.append(
                f"-A {chain}{comment} -m statistic --mode random --probability {_probability(n - i)} -j {sep}"
            )
        else:
            rules.append(f"-A {chain}{comment} -j {sep}")


def render_text(state: ProxyState, node: NodeContext, config: Config) -> str:
    """The full restore input a first sync would apply, with the options a modern host gives
    (iptables >= 1.6.2, nf_conntrack_tcp_be_liberal unset). The --dry-run output."""
    options = RenderOptions.from_config(config, node_pod_cidrs=state.node.pod_cidrs, family=state.family)
    return render(state, node, options).text
