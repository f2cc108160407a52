"""Which IPv6 service ports eBPF mode still needs ip6tables rules for. Pure.

eBPF mode runs an ip6tables proxier beside the eBPF programs (agent/metaproxier.py,
EbpfAndIp6tables). Where the tc programs' IPv6 path serves (`Config.tc_ipv6`: socket-level load
balancing, in either host routing), a service port's rules are needed only for the packets no eBPF
program translates. Every other port's rules are left out, so that a new IPv6 connection the node
forwards does not walk a KUBE-SERVICES of every IPv6 Service (3,503 conn/s against 24,963 over
IPv4 at 10,000 Services before this).

Who serves what, with the path on:

* the node's own sockets (and its pods' unless host-namespace-only): the socket programs
  (bpf/ekp_sock.h), at connect()/sendmsg(), TCP and UDP only. They pass to the stack, where only
  ip6tables' OUTPUT chain sees the packets (tc ingress never does): an SCTP socket (`SCTP`), and a
  node socket bound to no address calling a frontend with loadBalancerSourceRanges (the socket
  programs hold no IPv6 node address to check the ranges with: `SOURCE_RANGES`);
* every packet entering a device (pods' flows, clients outside): the tc IPv6 path
  (bpf/ekp_tc6.h). It leaves to the stack, whole and before choosing a backend (a frontend
  with a backend on a node IPv6 address no longer: `HOST_BACKEND` only while
  `Tc6Facts.leaves_host_backends`, false since the path serves those), while the IPv6
  source translation is not granted (ekp_cfg6's node address zero, `ekp_ipv6_snat_granted`
  0), a frontend with SNAT_ALL or SNAT_REMOTE (agent/ebpf/layout.py: masquerade-all, the
  detector's non-local ClusterIP traffic, every NodePort, external IP and LB IP of policy
  Cluster: `SNAT`) and any hairpin, a client that chose itself, known only after the choice:
  every port with an endpoint on this node (`HAIRPIN`).

Read from the inputs the IPv6 planner's frontend flags come from (the service port, its
endpoints, the node's IPv6 addresses and the flags), never from the planner's state. A reason
holds for the whole service port, as upstream's chains are per port; a frontend of the port that
the tc path serves never reaches the stack's nat table, so its rules cost nothing but the walk.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass

from agent.model.types import Protocol, ProxyState, ServiceEndpoints, ServicePort, ServicePortName


class Left(enum.Flag):
    """Why a service port's IPv6 rules are still needed (none: the eBPF programs serve it all)."""

    NONE = 0
    UNSERVED = enum.auto()  # the tc IPv6 path is off: ip6tables serves every packet it gets
    SCTP = enum.auto()  # the node's own SCTP sockets: the socket programs take TCP and UDP only
    SOURCE_RANGES = enum.auto()  # an unbound node socket to an LB IP with source ranges
    HOST_BACKEND = enum.auto()  # a backend on a node IPv6 address (EKP_FE_HOST_BACKEND)
    SNAT = enum.auto()  # not granted: a frontend with SNAT_ALL or SNAT_REMOTE
    HAIRPIN = enum.auto()  # not granted: a local endpoint, which may be its own client


@dataclass(frozen=True)
class Tc6Facts:
    """The node-wide inputs of `left_to_ip6tables`.

    `serves`: the tc IPv6 path serves (Config.tc_ipv6 and the node runs an IPv6 half).
    `leaves_host_backends`: the path hands frontends with a host-network backend to the stack
    (bpf/ekp_tc6.h today; TC6_LEAVES_HOST_BACKENDS). `snat_granted`: ekp_cfg6 holds the node's
    IPv6 address (the path masquerades). `masquerade_all`, `detector`: --masquerade-all and
    whether the IPv6 local-traffic detector exists (agent/localdetect.py `implemented`), which
    give ClusterIPs SNAT_ALL as the planner's layout does."""

    serves: bool
    leaves_host_backends: bool
    snat_granted: bool
    masquerade_all: bool = False
    detector: bool = False


# Whether the tc IPv6 path leaves a frontend with a backend on a node address to the stack
# (bpf/ekp_tc6.h, EKP_FE_HOST_BACKEND). The one place to change once the path serves those: it
# does since v6legacy (EKP_CT_HOST flows handed to the stack, their replies translated at egress).
TC6_LEAVES_HOST_BACKENDS = False


def left_to_ip6tables(
    sp: ServicePort, eps: ServiceEndpoints | None, node_ips: Collection[str], facts: Tc6Facts
) -> Left:
    """Why `sp` (an IPv6 service port) needs ip6tables rules beside the eBPF programs; `Left.NONE`
    when they serve all of it. `node_ips`: the node's IPv6 addresses (an endpoint on one of them
    is a host-network one, as the planner flags it)."""
    if not facts.serves:
        return Left.UNSERVED
    why = Left.NONE
    if sp.protocol is Protocol.SCTP:
        why |= Left.SCTP
    if sp.load_balancer_source_ranges and sp.load_balancer_ips:
        why |= Left.SOURCE_RANGES
    endpoints = () if eps is None else (*eps.cluster, *eps.local)
    if facts.leaves_host_backends and any(ep.ip in node_ips for ep in endpoints):
        why |= Left.HOST_BACKEND
    if not facts.snat_granted:
        externals = bool(sp.node_port or sp.external_ips or sp.load_balancer_ips)
        if facts.masquerade_all or facts.detector or (externals and not sp.external_policy_local):
            why |= Left.SNAT
        if any(ep.is_local for ep in endpoints):
            why |= Left.HAIRPIN
    return why


def ports_left(state: ProxyState, node_ips: Collection[str], facts: Tc6Facts) -> frozenset[ServicePortName]:
    """The service ports of `state` (the IPv6 family's) that need ip6tables rules."""
    ips = frozenset(node_ips)
    return frozenset(
        spn
        for spn, sp in state.services.items()
        if left_to_ip6tables(sp, state.endpoints.get(spn), ips, facts) is not Left.NONE
    )
