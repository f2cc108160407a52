"""kube-proxy's local-traffic detector: which packets come from a pod on this node. Pure.

`--detect-local-mode` (file: `detectLocalMode`) picks how, as kube-proxy's
pkg/proxy/util/localdetector.go and cmd/kube-proxy/app/server_linux.go `getLocalDetectors`:

* `ClusterCIDR` (the default, also for ""): the source is in `--cluster-cidr` (its first CIDR of
  the proxier's family); with no cluster CIDR of that family there is no detector at all.
* `NodeCIDR`: the source is in the Node's `spec.podCIDRs` (its first CIDR of the family, else
  `spec.podCIDR`); none assigned yet: no detector until the Node gets one. kube-proxy waits for
  the podCIDR at start and restarts when it changes; here the detector follows the Node.
* `BridgeInterface`: the packet entered on the bridge `--pod-bridge-interface`.
* `InterfaceNamePrefix`: it entered on a device whose name starts with `--pod-interface-name-prefix`.

What the detector decides is the same in both modes (kube-proxy's iptables proxier,
pkg/proxy/iptables/proxier.go): traffic to a cluster IP that is *not* local is masqueraded
(`IfNotLocal -j KUBE-MARK-MASQ`), and local traffic to an external destination of a Service with
externalTrafficPolicy Local goes to every endpoint instead of the node's own (`IfLocal -j
KUBE-SVC-*`). Without a detector neither rule exists.

iptables mode writes `if_local()` / `if_not_local()` into its rules. eBPF mode has no such match:
its programs look up frontends of one of two scopes, INTERNAL (from a local pod) and EXTERNAL
(anything else), and the detector decides which scope a packet uses (agent/ebpf/attach.py for the
interface modes, where the device a program is attached to decides; the config entry for the CIDR
modes, where the programs compare the source with `cidr`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class LocalMode(StrEnum):
    CLUSTER_CIDR = "ClusterCIDR"
    NODE_CIDR = "NodeCIDR"
    BRIDGE_INTERFACE = "BridgeInterface"
    INTERFACE_NAME_PREFIX = "InterfaceNamePrefix"


LOCAL_MODES = tuple(m.value for m in LocalMode)


def local_mode(text: str) -> LocalMode:
    """`--detect-local-mode` / `detectLocalMode`; "" is ClusterCIDR, as kube-proxy defaults it."""
    return LocalMode(text) if text else LocalMode.CLUSTER_CIDR


def first_cidr(cidrs: Iterable[str], family: int = 4) -> str:
    """The first CIDR of `cidrs` of IP version `family`, normalised ("10.244.1.0/24",
    "fd00:10:244::/56"), or "": upstream's getLocalDetectors takes the first CIDR of each family
    for that family's proxier."""
    for text in cidrs:
        try:
            net = ipaddress.ip_network(text.strip(), strict=False)
        except ValueError:
            continue
        if net.version == family:
            return str(net)
    return ""


def first_ipv4_cidr(cidrs: Iterable[str]) -> str:
    """The first IPv4 CIDR of `cidrs` (see first_cidr)."""
    return first_cidr(cidrs, 4)


@dataclass(frozen=True)
class LocalDetector:
    """One detector: `cidr` (the CIDR modes), `interface` (BridgeInterface) or `prefix`
    (InterfaceNamePrefix); all empty: no detector (kube-proxy's NewNoOpLocalDetector)."""

    mode: LocalMode = LocalMode.CLUSTER_CIDR
    cidr: str = ""
    interface: str = ""
    prefix: str = ""

    @property
    def implemented(self) -> bool:
        return bool(self.cidr or self.interface or self.prefix)

    @property
    def by_source(self) -> bool:
        """Decided by the packet's source address (ClusterCIDR, NodeCIDR)."""
        return bool(self.cidr)

    @property
    def by_interface(self) -> bool:
        """Decided by the device the packet entered on (BridgeInterface, InterfaceNamePrefix)."""
        return bool(self.interface or self.prefix)

    def if_local(self) -> str:
        """iptables arguments matching local traffic (upstream's IfLocal)."""
        if self.cidr:
            return f"-s {self.cidr}"
        if self.interface:
            return f"-i {self.interface}"
        if self.prefix:
            return f"-i {self.prefix}+"
        return ""

    def if_not_local(self) -> str:
        """iptables arguments matching traffic that is not local (upstream's IfNotLocal)."""
        return f"! {self.if_local()}" if self.implemented else ""

    def is_local_device(self, name: str) -> bool:
        """Whether traffic entering on device `name` is local (the interface modes only)."""
        if self.interface:
            return name == self.interface
        if self.prefix:
            return name.startswith(self.prefix)  # iptables' `-i prefix+`
        return False

    def describe(self) -> str:
        """One phrase for the log: what counts as local traffic."""
        if self.cidr:
            return f"{self.mode.value}: sources in {self.cidr}"
        if self.interface:
            return f"{self.mode.value}: traffic entering on {self.interface}"
        if self.prefix:
            return f"{self.mode.value}: traffic entering on devices named {self.prefix}*"
        return f"{self.mode.value}: none (no {_missing(self.mode)})"


def _missing(mode: LocalMode) -> str:
    if mode is LocalMode.NODE_CIDR:
        return "podCIDR on the Node yet"
    return "--cluster-cidr"


def local_detector(
    mode: str,
    *,
    cluster_cidrs: Iterable[str] = (),
    node_pod_cidrs: Iterable[str] = (),
    bridge_interface: str = "",
    interface_name_prefix: str = "",
    family: int = 4,
) -> LocalDetector:
    """The detector kube-proxy's getLocalDetectors builds for the proxier of IP version `family`
    (the interface modes are the same for both)."""
    m = local_mode(mode)
    if m is LocalMode.CLUSTER_CIDR:
        return LocalDetector(m, cidr=first_cidr(cluster_cidrs, family))
    if m is LocalMode.NODE_CIDR:
        return LocalDetector(m, cidr=first_cidr(node_pod_cidrs, family))
    if m is LocalMode.BRIDGE_INTERFACE:
        return LocalDetector(m, interface=bridge_interface)
    return LocalDetector(m, prefix=interface_name_prefix)
