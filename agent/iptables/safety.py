"""What may reach iptables-restore: every caller-controlled value checked against what the API allows. Pure.

iptables-restore reads one rule per line and splits it into arguments at spaces, honouring double
quotes. A Service name holding a newline therefore ends the rule and starts another one of the
attacker's choosing (`x\\n-I INPUT 1 -s 6.6.6.6/32 -j ACCEPT\\n#` once put that rule into the live nat
table on every sync), and a name holding a space splits an unquoted comment into stray arguments
that make every restore fail. The model refuses such objects too (the API server's own validation);
this module makes the renderer safe on its own, whatever reaches it (defence in depth).

A service port is rendered only when every value of it that is written into a rule is of the form
the API server accepts (pkg/apis/core/validation/validation.go):

* namespace: a DNS-1123 label (`ValidateNamespaceName`), service name: a DNS-1035 label
  (`ValidateServiceName`), port name: empty or a DNS-1123 label (`validateServicePort`);
  so the `ns/name:port` string kube-proxy puts in comments holds only `[a-z0-9-/:]`;
* addresses: canonical addresses of the state's family, dotted-quad IPv4 or RFC 5952 IPv6 as Go's
  `net.IP.String()` prints them (cluster IP, external IPs, load-balancer IPs, endpoints), source
  ranges: CIDRs of that family (re-rendered from their parsed value, as Go's `IPNet.String()` does);
* ports 1-65535 (node ports and health-check node ports 0 = none), affinity timeout 1-86400 s.

Anything else is refused with a reason naming the field, for `SyncResult.failed` and the log; the
other service ports are rendered as usual. Valid names render byte for byte as upstream's.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from agent.model.problem import printable
from agent.model.types import Endpoint, Protocol, ServicePort, SessionAffinity

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
LABEL_MAX = 63
MAX_AFFINITY_SECONDS = 86400


def _label(value: object, pattern: re.Pattern[str]) -> bool:
    return isinstance(value, str) and len(value) <= LABEL_MAX and pattern.fullmatch(value) is not None


_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_CANONICAL_IPV4 = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")


def is_canonical_ipv4(value: object) -> bool:
    """A dotted quad as Go's `net.IP.String()` prints it (no leading zeros, no spaces, no mask)."""
    return isinstance(value, str) and _CANONICAL_IPV4.fullmatch(value) is not None


def is_canonical_ipv6(value: object) -> bool:
    """IPv6 text exactly as Python (and Go's `net.IP.String()`) prints it: RFC 5952, lower case,
    no zone, no mask; an IPv4-mapped address is IPv4 to Kubernetes, never IPv6 here."""
    if not isinstance(value, str) or ":" not in value or not value.isascii():
        return False
    try:
        ip = ipaddress.IPv6Address(value)
    except ValueError:
        return False
    return str(ip) == value and ip.ipv4_mapped is None


def is_canonical(value: object, family: int) -> bool:
    """A canonical address of IP version `family`."""
    return is_canonical_ipv6(value) if family == 6 else is_canonical_ipv4(value)


def is_cidr(value: object, family: int) -> bool:
    """A CIDR of IP version `family` (see is_ipv4_cidr)."""
    if family == 4:
        return is_ipv4_cidr(value)
    if not isinstance(value, str) or not value.isascii() or "/" not in value:
        return False
    try:
        ipaddress.IPv6Network(value.strip(), strict=False)
    except ValueError:
        return False
    return True


def is_ipv4_cidr(value: object) -> bool:
    """An IPv4 CIDR, host bits allowed (Go's ParseCIDR keeps the network), spaces around allowed
    (the API server lets them through in loadBalancerSourceRanges; kube-proxy trims them)."""
    if not isinstance(value, str):
        return False
    try:
        ipaddress.IPv4Network(value.strip(), strict=False)
    except ValueError:
        return False
    return "/" in value


def _port(value: object, *, allow_zero: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (0 if allow_zero else 1) <= value <= 65535


def refusal(sp: ServicePort, endpoints: Iterable[Endpoint], family: int = 4) -> str | None:
    """Why this service port must not be rendered into the rules of IP version `family`, or None
    when every value is safe to write."""
    kind = f"IPv{family}"
    name = sp.name
    if not _label(name.namespace, DNS1123_LABEL):
        return f"namespace '{printable(name.namespace)}' is not a DNS-1123 label"
    if not _label(name.name, DNS1035_LABEL):
        return f"service name '{printable(name.name)}' is not a DNS-1035 label"
    if name.port and not _label(name.port, DNS1123_LABEL):
        return f"port name '{printable(name.port)}' is not a DNS-1123 label"
    if not isinstance(sp.protocol, Protocol) or sp.protocol is not name.protocol:
        return f"protocol {printable(sp.protocol)} is not TCP, UDP or SCTP"
    if not is_canonical(sp.cluster_ip, family):
        return f"cluster IP {printable(sp.cluster_ip)} is not a canonical {kind} address"
    for field, values in (("external IP", sp.external_ips), ("load-balancer IP", sp.load_balancer_ips)):
        for ip in values:
            if not is_canonical(ip, family):
                return f"{field} {printable(ip)} is not a canonical {kind} address"
    for cidr in sp.load_balancer_source_ranges:
        if not is_cidr(cidr, family):
            return f"loadBalancerSourceRange {printable(cidr)} is not an {kind} CIDR"
    if not _port(sp.port):
        return f"port {printable(sp.port)} is not in 1-65535"
    for field, value in (("node port", sp.node_port), ("health check node port", sp.health_check_node_port)):
        if not _port(value, allow_zero=True):
            return f"{field} {printable(value)} is not in 0-65535"
    if sp.session_affinity is SessionAffinity.CLIENT_IP and not (
        isinstance(sp.affinity_timeout_seconds, int)
        and not isinstance(sp.affinity_timeout_seconds, bool)
        and 0 < sp.affinity_timeout_seconds <= MAX_AFFINITY_SECONDS
    ):
        return f"session affinity timeout {printable(sp.affinity_timeout_seconds)} is not in 1-86400"
    for ep in endpoints:
        if not is_canonical(ep.ip, family):
            return f"endpoint address {printable(ep.ip)} is not a canonical {kind} address"
        if not _port(ep.port):
            return f"endpoint port {printable(ep.port)} is not in 1-65535"
    return None
