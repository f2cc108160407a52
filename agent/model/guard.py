"""Which externalIPs, load-balancer IPs and node ports this node agrees to program.

Anyone who may create a Service may set `spec.externalIPs` to any address, and the proxy then
captures that address's traffic on every node: another pod's address, the node's own address
(its health port 10256 included), a Service's cluster IP, or an outside address pods talk to
(CVE-2020-8554; kube-proxy has the same hole and leaves it to an admission controller such as
DenyServiceExternalIPs or externalip-webhook). A controller that may write a Service's status
can do the same with `status.loadBalancer.ingress[].ip`. And a `nodePort` the API server would
never allocate (outside its `--service-node-port-range`: 10256, 22, ...) captures a node port that
some other process owns. `FrontendGuard` is this node's answer, applied to every Service in the
pure model, so both modes program exactly the same frontends:

* **Protected ranges, always refused** as externalIPs and load-balancer IPs: this node's addresses,
  the pod CIDRs (`--cluster-cidr`) and the Service CIDRs (`--service-cluster-ip-range`). No
  legitimate external address lives there, and capturing one redirects cluster-internal traffic.
* **The allow-list** (`--external-ip-cidrs`): when given, an externalIP or load-balancer IP outside
  every listed CIDR is refused too. Empty (the default) allows any other address, as kube-proxy
  does: a node cannot guess which public ranges an operator's load balancers and externalIPs use,
  and refusing them all would break every LoadBalancer Service of a cluster moving from kube-proxy.
  Operators who want the CVE-2020-8554 mitigation list their ranges here (the same list
  externalip-webhook's `allowed-external-ip-cidrs` takes).
* **Node ports** (`nodePort`, `healthCheckNodePort`) outside `--node-port-range` are refused.

A refusal drops only the refused frontend: the Service's cluster IP, its other addresses and its
other ports keep working. `refuse_ports` says what it dropped, and the model turns that into a
Problem (a log line, an Event, `ekp_refused_frontends_total`).

Pure: plain values in, plain values out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from agent.model.addresses import IPNetwork, parse_cidr_sloppy, parse_ip_sloppy
from agent.model.types import ServicePort

# Event reasons of the two refusals (also the `reason` label of ekp_refused_frontends_total).
REFUSED_EXTERNAL_IP = "RefusedExternalIP"
REFUSED_NODE_PORT = "RefusedNodePort"


@dataclass(frozen=True)
class Refusals:
    """What `refuse_ports` left out of one Service, as text for its Problems ("" when nothing)."""

    external_ips: str = ""
    node_ports: str = ""


_NOTHING_REFUSED = Refusals()


@dataclass(frozen=True)
class FrontendGuard:
    """The node's rules for externally reachable frontends; the default refuses nothing.

    `protected`: (network, what it is) pairs never accepted as an external address.
    `allowed`: the allow-list; empty allows every address outside `protected`.
    `node_ports`: the inclusive range node ports must fall in; None checks nothing.
    """

    protected: tuple[tuple[IPNetwork, str], ...] = ()
    allowed: tuple[IPNetwork, ...] = ()
    node_ports: tuple[int, int] | None = None

    @classmethod
    def of(
        cls,
        *,
        node_ips: Iterable[str] = (),
        cluster_cidrs: Iterable[str] = (),
        service_cidrs: Iterable[str] = (),
        allowed_cidrs: Iterable[str] = (),
        node_port_range: tuple[int, int] | None = None,
    ) -> FrontendGuard:
        """From the flags' text, both families (an address is checked against its own family's
        networks; an allow-list of one family only refuses every external address of the other,
        the safe reading of "only these")."""
        protected = [
            *(
                (net, "an address of this node")
                for net in _nets(f"{ip}/{128 if ':' in ip else 32}" for ip in node_ips)
            ),
            *((net, f"inside --cluster-cidr {net} (pod addresses)") for net in _nets(cluster_cidrs)),
            *(
                (net, f"inside --service-cluster-ip-range {net} (Service addresses)")
                for net in _nets(service_cidrs)
            ),
        ]
        return cls(tuple(protected), tuple(_nets(allowed_cidrs)), node_port_range)

    def refuse_address(self, text: str) -> str | None:
        """Why the external address `text` (canonical, either family) is refused, or None."""
        ip = parse_ip_sloppy(text)
        if ip is None:
            return None
        for net, what in self.protected:
            if ip in net:
                return what
        if self.allowed and not any(ip in net for net in self.allowed):
            return "outside --external-ip-cidrs " + ",".join(str(n) for n in self.allowed)
        return None

    def refuse_node_port(self, port: int) -> str | None:
        """Why the node port `port` (non-zero) is refused, or None."""
        if self.node_ports is None:
            return None
        lo, hi = self.node_ports
        return None if lo <= port <= hi else f"outside --node-port-range {lo}-{hi}"


def _nets(texts: Iterable[str]) -> list[IPNetwork]:
    out: list[IPNetwork] = []
    for text in texts:
        net = parse_cidr_sloppy(text.strip())
        if net is not None and net not in out:
            out.append(net)
    return out


def refuse_ports(
    ports: Sequence[ServicePort], guard: FrontendGuard
) -> tuple[tuple[ServicePort, ...], Refusals]:
    """The ports of one Service with the refused frontends taken out, and what was refused."""
    if not ports:
        return tuple(ports), _NOTHING_REFUSED
    first = ports[0]  # externalIPs and ingress IPs are the Service's, the same on every port
    if not (first.external_ips or first.load_balancer_ips) and not any(
        sp.node_port or sp.health_check_node_port for sp in ports
    ):
        return tuple(ports), _NOTHING_REFUSED  # nothing to guard (a ClusterIP Service)
    kept_ext, refused_ext = _split(first.external_ips, guard)
    kept_lb, refused_lb = _split(first.load_balancer_ips, guard)
    address_text = "; ".join(
        [
            *(f"spec.externalIPs {ip} refused: {why}" for ip, why in refused_ext),
            *(f"status.loadBalancer.ingress IP {ip} refused: {why}" for ip, why in refused_lb),
        ]
    )
    out: list[ServicePort] = []
    port_reasons: list[str] = []
    health_reason = ""  # the Service's one healthCheckNodePort, on every port
    for sp in ports:
        changes: dict[str, object] = {}
        if refused_ext:
            changes["external_ips"] = kept_ext
        if refused_lb:
            changes["load_balancer_ips"] = kept_lb
        why = guard.refuse_node_port(sp.node_port) if sp.node_port else None
        if why:
            changes["node_port"] = 0
            port_reasons.append(f"spec.ports {_port_label(sp)} nodePort {sp.node_port} refused: {why}")
        why = guard.refuse_node_port(sp.health_check_node_port) if sp.health_check_node_port else None
        if why:
            changes["health_check_node_port"] = 0
            health_reason = f"spec.healthCheckNodePort {sp.health_check_node_port} refused: {why}"
        out.append(replace(sp, **changes) if changes else sp)  # type: ignore[arg-type]
    if health_reason:
        port_reasons.append(health_reason)
    suffix = "; not programmed on this node, the Service's other frontends are"
    return tuple(out), Refusals(
        external_ips=address_text + suffix if address_text else "",
        node_ports="; ".join(port_reasons) + suffix if port_reasons else "",
    )


def _split(addresses: Sequence[str], guard: FrontendGuard) -> tuple[tuple[str, ...], list[tuple[str, str]]]:
    kept: list[str] = []
    refused: list[tuple[str, str]] = []
    for ip in addresses:
        why = guard.refuse_address(ip)
        if why is None:
            kept.append(ip)
        else:
            refused.append((ip, why))
    return tuple(kept), refused


def _port_label(sp: ServicePort) -> str:
    return f"port {sp.name.port or '(unnamed)'}/{sp.protocol}"
