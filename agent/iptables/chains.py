"""kube-proxy's iptables chain names and base-chain jumps, byte for byte.

Pure: no subprocess, no kernel. Everything here is a name or a constant that must match upstream
kube-proxy (pkg/proxy/iptables/proxier.go) exactly, because an operator switching between
kube-proxy and this agent must see the same chains, and kube-proxy's own `--cleanup` must find ours.

Per-service chain names hash the ServicePortName string plus the lowercase protocol (plus
`ip:port` for an endpoint) with sha256, encode the digest in standard base32 and keep the first
16 characters:

    KUBE-SVC-  cluster-policy endpoints        KUBE-SVL-  local-policy endpoints
    KUBE-EXT-  external traffic (NodePort, externalIPs, LB IPs)
    KUBE-FW-   loadBalancerSourceRanges        KUBE-SEP-  one endpoint (DNAT)
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from functools import lru_cache

from agent.model.types import ServicePortName

# Top-level chains (filter and/or nat).
KUBE_SERVICES = "KUBE-SERVICES"
KUBE_EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
KUBE_NODEPORTS = "KUBE-NODEPORTS"
KUBE_POSTROUTING = "KUBE-POSTROUTING"
KUBE_MARK_MASQ = "KUBE-MARK-MASQ"
KUBE_FORWARD = "KUBE-FORWARD"
KUBE_PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
# An empty chain in mangle, nat and filter: when it disappears someone flushed the tables and
# the next sync must be a full one (kube-proxy's iptables.Monitor).
KUBE_PROXY_CANARY = "KUBE-PROXY-CANARY"
# The anti-martian chain. kubelet used to own it; since KEP-3178 (kubelet stopped creating
# iptables rules in 1.28) kube-proxy's iptables proxier writes the localhost-NodePort martian drop
# itself, into this chain, whenever localhost NodePorts are enabled (IPv4, the default). Current
# upstream still does so, hence we do too, under the same condition.
KUBE_FIREWALL = "KUBE-FIREWALL"

# Filter-table chains written on every sync, in the order upstream declares them.
FILTER_TOP_CHAINS = (KUBE_SERVICES, KUBE_EXTERNAL_SERVICES, KUBE_FORWARD, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL)
# Nat-table chains written on every sync, in the order upstream declares them.
NAT_TOP_CHAINS = (KUBE_SERVICES, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_MARK_MASQ)

SVC_PREFIX = "KUBE-SVC-"
SVL_PREFIX = "KUBE-SVL-"
EXT_PREFIX = "KUBE-EXT-"
FW_PREFIX = "KUBE-FW-"
SEP_PREFIX = "KUBE-SEP-"
SERVICE_CHAIN_PREFIXES = (SVC_PREFIX, SVL_PREFIX, SEP_PREFIX, FW_PREFIX, EXT_PREFIX)

# kube-proxy's comment on the hairpin/off-cluster MASQUERADE rule and the NodePort tail rule.
MASQUERADE_COMMENT = "kubernetes service traffic requiring SNAT"
NODEPORTS_TAIL_COMMENT = "kubernetes service nodeports; NOTE: this must be the last rule in this chain"
MARTIAN_COMMENT = "block incoming localnet connections"

# kube-proxy's nfacct counters (pkg/proxy/metrics: IPTablesCTStateInvalidDroppedNFAcctCounter,
# LocalhostNodePortAcceptedNFAcctCounter), read back for the two packet-count metrics.
INVALID_DROPPED_COUNTER = "ct_state_invalid_dropped_pkts"
LOCALHOST_NODEPORTS_COUNTER = "localhost_nps_accepted_pkts"
NFACCT_COUNTERS = (INVALID_DROPPED_COUNTER, LOCALHOST_NODEPORTS_COUNTER)


def _hash16(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:16]


@lru_cache(maxsize=1 << 17)
def port_proto_hash(spn: ServicePortName) -> str:
    """The 16-character hash shared by a service port's SVC/SVL/EXT/FW chains."""
    return _hash16(str(spn) + spn.protocol.value.lower())


def service_chain(spn: ServicePortName) -> str:
    return SVC_PREFIX + port_proto_hash(spn)


def local_chain(spn: ServicePortName) -> str:
    return SVL_PREFIX + port_proto_hash(spn)


def external_chain(spn: ServicePortName) -> str:
    return EXT_PREFIX + port_proto_hash(spn)


def firewall_chain(spn: ServicePortName) -> str:
    return FW_PREFIX + port_proto_hash(spn)


@lru_cache(maxsize=1 << 18)
def endpoint_chain(spn: ServicePortName, endpoint: str) -> str:
    """KUBE-SEP-... for one endpoint, `endpoint` being its `ip:port` string."""
    return SEP_PREFIX + _hash16(str(spn) + spn.protocol.value.lower() + endpoint)


def is_service_chain(name: str) -> bool:
    """A per-service or per-endpoint chain: ours to delete when no longer used."""
    return name.startswith(SERVICE_CHAIN_PREFIXES)


@dataclass(frozen=True)
class Jump:
    """A rule in a built-in chain that sends traffic into one of ours (kube-proxy's iptablesJumpChain)."""

    table: str
    src_chain: str  # the built-in chain holding the rule (INPUT, PREROUTING, ...)
    dst_chain: str  # our chain
    comment: str = ""
    extra_args: tuple[str, ...] = ()

    def rule_args(self) -> tuple[str, ...]:
        """The rule as iptables argv (after `-t TABLE -I CHAIN`); no shell quoting needed."""
        comment = ("-m", "comment", "--comment", self.comment) if self.comment else ()
        return (*self.extra_args, *comment, "-j", self.dst_chain)


_NEW = ("-m", "conntrack", "--ctstate", "NEW")

# In upstream's order: each missing jump is inserted at the top of its chain, so on a fresh node
# the last one listed for a chain ends up first.
JUMPS: tuple[Jump, ...] = (
    Jump("filter", "INPUT", KUBE_EXTERNAL_SERVICES, "kubernetes externally-visible service portals", _NEW),
    Jump("filter", "FORWARD", KUBE_EXTERNAL_SERVICES, "kubernetes externally-visible service portals", _NEW),
    Jump("filter", "INPUT", KUBE_NODEPORTS, "kubernetes health check service ports"),
    Jump("filter", "FORWARD", KUBE_SERVICES, "kubernetes service portals", _NEW),
    Jump("filter", "OUTPUT", KUBE_SERVICES, "kubernetes service portals", _NEW),
    Jump("filter", "FORWARD", KUBE_FORWARD, "kubernetes forwarding rules"),
    Jump("filter", "INPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", _NEW),
    Jump("filter", "OUTPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", _NEW),
    Jump("filter", "FORWARD", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", _NEW),
    Jump("nat", "OUTPUT", KUBE_SERVICES, "kubernetes service portals"),
    Jump("nat", "PREROUTING", KUBE_SERVICES, "kubernetes service portals"),
    Jump("nat", "POSTROUTING", KUBE_POSTROUTING, "kubernetes postrouting rules"),
)

# The KUBE-FIREWALL jumps (no comment, as kubelet wrote them). Installed only when localhost
# NodePorts are enabled, the only case in which we put a rule into KUBE-FIREWALL.
FIREWALL_JUMPS: tuple[Jump, ...] = (
    Jump("filter", "INPUT", KUBE_FIREWALL),
    Jump("filter", "OUTPUT", KUBE_FIREWALL),
)

CANARY_TABLES = ("mangle", "nat", "filter")

# Chains `--cleanup` flushes and deletes (besides every service chain), per table.
CLEANUP_NAT_CHAINS = (KUBE_SERVICES, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_MARK_MASQ, KUBE_PROXY_CANARY)
CLEANUP_FILTER_CHAINS = (
    KUBE_SERVICES,
    KUBE_EXTERNAL_SERVICES,
    KUBE_FORWARD,
    KUBE_NODEPORTS,
    KUBE_PROXY_FIREWALL,
    KUBE_PROXY_CANARY,
)
