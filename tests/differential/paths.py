"""Which path decided a case's flows: the tc programs' conntrack or the kernel's nf_conntrack NAT.

Read on every node right after a case's probe. `tc` counts the FORWARD entries of the eBPF
conntrack tables (ct_tcp / ct_any, ct6_tcp / ct6_any in IPv6: the tc programs' own, bpf/ekp_tc6.h)
whose key is the case's flow as the source sent it; `nf` counts the nf_conntrack entries of the
same tuple that iptables or ip6tables DNATed (`conntrack -L --dst-nat`). A flow the tc path
translated reaches netfilter already translated, so it is never counted twice. Neither counts a
flow the socket programs translated at connect() (the node's own sockets, in eBPF mode: it dials
the backend itself), a refusal or a drop.

The source narrows both counts to the case when other cases dial the same address and port (a
node's own flows: any of its addresses, the route chooses). Two cases of one source, destination
and protocol count each other's flows: `udp-*` and `frag-*` of one pair (each counts 40, not 20).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct
from dataclasses import dataclass
from typing import cast

from agent.ebpf.abi import MAPS, Ct6Key, CtDir, CtKey
from agent.ebpf.maps import BpfMap
from lab import Lab
from lab.core import CLIENT_IP, CLIENT_IP6, node_gateway, node_gateway6, node_ip, node_ip6
from lab.harness import Cluster
from tests.differential.cases import IPV4, IPV6, Case, in_family, pod_address

ORIG_SRC = re.compile(r"\bsrc=(\S+)")
PROTOCOLS = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": socket.IPPROTO_SCTP}


@dataclass(frozen=True)
class Decided:
    """Per node (name): the case's flows in the tc conntrack and nf_conntrack's DNATed ones."""

    tc: dict[str, int]
    nf: dict[str, int]

    @property
    def tc_total(self) -> int:
        return sum(self.tc.values())

    @property
    def nf_total(self) -> int:
        return sum(self.nf.values())

    def text(self) -> str:
        def per_node(counts: dict[str, int]) -> str:
            return " ".join(f"{n}={c}" for n, c in sorted(counts.items()) if c) or "0"

        return f"tc flows {per_node(self.tc)}, nf_conntrack DNAT {per_node(self.nf)}"


def source_addresses(case: Case) -> frozenset[str]:
    """The addresses the case's source may send from, in either family."""
    if case.source == "client":
        return frozenset({CLIENT_IP, CLIENT_IP6})
    if case.source.startswith("pod-"):
        return frozenset(in_family(pod_address(case.source), f) for f in (IPV4, IPV6))
    n = int(case.source.removeprefix("node"))
    return frozenset({node_ip(n), node_gateway(n), node_ip6(n), node_gateway6(n)})


def _address(raw: bytes) -> str:
    return str(ipaddress.ip_address(raw))


def tc_flows(pin_path: str, case: Case, family: str) -> int:
    """FORWARD entries of the case's tuple in one node's tc conntrack tables (as on the wire)."""
    addr, port = case.address(family)
    sources = source_addresses(case)
    proto = PROTOCOLS[case.protocol]
    tables = ("ct_tcp", "ct_any") if family == IPV4 else ("ct6_tcp", "ct6_any")
    count = 0
    for table in tables:
        with BpfMap.open_pinned(MAPS[table], pin_path) as ct:
            keys = ct.keys()
            for raw in keys:
                key = cast(CtKey | Ct6Key, raw)
                if key.dir != CtDir.FORWARD or key.proto != proto or socket.ntohs(key.dport) != port:
                    continue
                if isinstance(key, CtKey):
                    daddr, saddr = struct.pack("=I", key.daddr), struct.pack("=I", key.saddr)
                else:
                    daddr, saddr = bytes(key.daddr), bytes(key.saddr)
                if _address(daddr) == addr and _address(saddr) in sources:
                    count += 1
    return count


def nf_flows(lab: Lab, node: str, case: Case, family: str) -> int:
    """nf_conntrack entries of the case's tuple on `node` that a DNAT rule translated."""
    addr, port = case.address(family)
    argv = ["conntrack", "-L", "-f", "ipv4" if family == IPV4 else "ipv6", "-p", case.protocol.lower()]
    argv += ["--orig-dst", addr, "--dport", str(port), "--dst-nat"]
    out = lab.run(lab.node(node), *argv).stdout
    # the first src= of an entry is its original tuple's
    origins = (ORIG_SRC.search(line) for line in out.splitlines())
    sources = source_addresses(case)
    return sum(1 for m in origins if m and str(ipaddress.ip_address(m[1])) in sources)


def decided(cluster: Cluster, case: Case, family: str) -> Decided:
    tc = {
        a.node.name: tc_flows(a.pin_path, case, family) if cluster.mode == "ebpf" else 0
        for a in cluster.agents
    }
    nf = {n.name: nf_flows(cluster.lab, n.name, case, family) for n in cluster.lab.nodes}
    return Decided(tc, nf)
