"""The network-namespace lab: topology, processes, servers and clients. See `lab` for the overview."""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, Protocol, TypeVar

from . import netns as nx
from .netns import LabError
from .wire import make_wire

T = TypeVar("T")

# Addressing and ports other code relies on.
NODE_SUBNET = "192.168.0.0/24"
CLIENT_IP = "192.168.0.100"
POD_SUPERNET = "10.244.0.0/16"
BRIDGE = "br0"
HTTP_PORT = 8080
UDP_PORT = 9000
NGINX_PORT = 8081
DNS_PORT = 53
DNS_TXT_NAME = "whoami.lab"
DNS_SVC_DOMAIN = "svc.lab"
DNS_SVC_ADDR = "10.0.0.1"
PODSERVER = Path(__file__).with_name("podserver.py")
MAX_NODES = 89
MAX_PODS_PER_NODE = 253

# Every prefix a Lab in this process brought up, and every process any Lab started (pid, start time):
# the session-end leak check (tests/conftest.py) looks for what is left of them.
CREATED_PREFIXES: set[str] = set()
STARTED: list[tuple[int, int | None]] = []


def node_ip(node: int) -> str:
    """IP of node N on the node network: 192.168.0.(10+N)."""
    return f"192.168.0.{10 + node}"


# IPv6 beside IPv4 (`Lab(ipv6=True)`): ULA addresses that read like their IPv4 twins, every one
# added `nodad` so nothing waits for duplicate address detection.
NODE_SUBNET6 = "fd00:192:168::/64"
CLIENT_IP6 = "fd00:192:168::100"
POD_SUPERNET6 = "fd00:10:244::/56"


def node_ip6(node: int) -> str:
    """IPv6 of node N on the node network: fd00:192:168::(10+N)."""
    return f"fd00:192:168::{10 + node}"


def node_pod_cidr6(node: int) -> str:
    return f"fd00:10:244:{node}::/64"


def node_gateway6(node: int) -> str:
    return f"fd00:10:244:{node}::1"


def pod_ip6(node: int, index: int) -> str:
    """IPv6 of pod `index` on node N: fd00:10:244:N::(index+1)."""
    return f"fd00:10:244:{node}::{index + 1}"


def node_pod_cidr(node: int) -> str:
    return f"10.244.{node}.0/24"


def node_gateway(node: int) -> str:
    """The pods' gateway on node N (carried as a /32 by every pod veth of the node)."""
    return f"10.244.{node}.1"


def pod_ip(node: int, index: int) -> str:
    """IP of pod `index` (1-based) on node N: 10.244.N.(index+1)."""
    return f"10.244.{node}.{index + 1}"


@dataclass(eq=False)
class Pod:
    """A pod: its own namespace, `eth0` = `ip`/24, default route via the node's gateway `10.244.N.1`."""

    name: str  # "pod-1-1"
    ns: str  # "<prefix>-pod-1-1"
    ip: str  # "10.244.1.2"
    node: int  # 1-based node number
    index: int  # 1-based pod number on the node
    gateway: str  # "10.244.1.1"
    host_iface: str  # "lxc-p1": the node-side veth, in the node's namespace
    cgroup: str | None  # cgroup v2 directory of processes the lab starts in this pod
    iface: str = "eth0"
    ip6: str = ""  # "fd00:10:244:1::2" in a Lab(ipv6=True), else ""


@dataclass(eq=False)
class Node:
    """A node: `eth0` on the switch with `ip`/24, one `lxc-p<j>` veth per pod, ip_forward=1."""

    index: int  # 1-based
    name: str  # "node1"
    ns: str  # "<prefix>-node1"
    ip: str  # "192.168.0.11"
    pod_cidr: str  # "10.244.1.0/24"
    gateway: str  # "10.244.1.1"
    pin_dir: str  # "/sys/fs/bpf/ebpf-kube-proxy-lab-<prefix>-node1": removed by Lab.down()
    cgroup: str | None  # cgroup of the node's own (host-network) processes started by the lab
    cgroup_root: str | None  # parent of `cgroup` and of the node's pods' cgroups
    # cgroup of a host-network pod's processes (`hostNetwork: true`: the node's namespace, a pod's
    # cgroup under the node's, as the kubelet places one): lab.run(node, ..., cgroup=this)
    hostnet_cgroup: str | None
    iface: str = "eth0"
    pods: list[Pod] = field(default_factory=list)
    ip6: str = ""  # "fd00:192:168::11" in a Lab(ipv6=True), else ""

    @property
    def pod_ifaces(self) -> list[str]:
        """Names of the pod veths (`lxc-p<j>`) in the node's namespace."""
        return [p.host_iface for p in self.pods]


@dataclass(eq=False)
class Client:
    """The external client: `eth0` 192.168.0.100/24 on the switch, no routes beyond that by default."""

    name: str  # "client"
    ns: str
    ip: str
    cgroup: str | None
    iface: str = "eth0"
    ip6: str = ""  # CLIENT_IP6 in a Lab(ipv6=True), else ""


Host = Pod | Node | Client


class HasNs(Protocol):
    @property
    def ns(self) -> str: ...


NsLike = str | HasNs | None
FileArg = int | IO[Any] | None


class CommandError(subprocess.CalledProcessError):
    """A command run with `Lab.run(check=True)` failed; str() shows the namespace and stderr."""

    def __init__(self, returncode: int, cmd: Sequence[str], output: str, stderr: str, ns: str | None) -> None:
        super().__init__(returncode, list(cmd), output, stderr)
        self.ns = ns

    def __str__(self) -> str:
        where = f" in {self.ns}" if self.ns else ""
        out = (self.stderr or "").strip() or (self.output or "").strip()
        return f"{' '.join(self.cmd)}{where} exited with {self.returncode}: {out[-2000:]}"


@dataclass(eq=False)
class Process:
    """A process started by the lab; killed by `Lab.down()` at the latest."""

    name: str
    ns: str | None
    popen: subprocess.Popen[bytes]
    log: Path | None
    starttime: int | None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_text(self, limit: int | None = 4000) -> str:
        """The last `limit` characters of the log (all of it when None)."""
        if self.log is None:
            return ""
        try:
            text = self.log.read_text(errors="replace")
            return text if limit is None else text[-limit:]
        except OSError:
            return ""


class Lab:
    """A throw-away cluster of network namespaces; see the `lab` module docstring."""

    def __init__(
        self,
        nodes: int = 1,
        pods_per_node: int = 2,
        *,
        prefix: str | None = None,
        cgroups: bool = True,
        wire: bool = False,
        ipv6: bool = False,
        pod_bridge: str | None = None,
    ) -> None:
        """`wire`: the switch behaves like a NIC's wire (full checksums on the external links, a
        native XDP program's XDP_TX delivered: lab/wire.py), for agents run with --bpf-xdp=native.
        `ipv6`: every link carries IPv6 ULA addresses beside IPv4 (`ip6` of each host), with the
        same routes (pods via their node's gateway, other nodes' pods via those nodes, default via
        the client) and IPv6 forwarding on the nodes.
        `pod_bridge`: each node's pod veths are ports of a Linux bridge of that name in the node's
        namespace, which holds the pods' gateway address on the node's pod /24 (kubenet's cbr0,
        kube-proxy's --detect-local-mode=BridgeInterface); by default each veth is routed alone.
        IPv4 only."""
        if pod_bridge and ipv6:
            raise ValueError("pod_bridge is IPv4 only")
        self.pod_bridge = pod_bridge
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be 1..{MAX_NODES}")
        if not 0 <= pods_per_node <= MAX_PODS_PER_NODE:
            raise ValueError(f"pods_per_node must be 0..{MAX_PODS_PER_NODE}")
        self.wire = wire
        self.ipv6 = ipv6
        self.prefix = prefix or nx.new_prefix()
        if not nx.PREFIX_RE.match(self.prefix):
            raise ValueError(f"prefix must match {nx.PREFIX_RE.pattern}: {self.prefix!r}")
        cg2 = nx.cgroup2_root() if cgroups else None
        self.cgroup_root: str | None = os.path.join(cg2, self.prefix) if cg2 else None
        self.switch_ns = self._ns_name("net")
        self.tmpdir: Path | None = None
        self.build_seconds: float | None = None
        self.started: list[tuple[int, int | None]] = []
        self._procs: list[Process] = []
        self._history: list[Process] = []  # every process ever started, for logs after stop()
        self._roles: dict[str, str] = {"net": self.switch_ns}
        self._cgroups: dict[str, str] = {}
        self._state = "new"
        self._lock = threading.RLock()
        self._seq = 0
        self.nodes: list[Node] = [self._plan_node(n) for n in range(1, nodes + 1)]
        self.client = Client(
            name="client",
            ns=self._ns_name("client"),
            ip=CLIENT_IP,
            cgroup=self._cg("client"),
            ip6=CLIENT_IP6 if ipv6 else "",
        )
        self._add_role("client", self.client.ns, self.client.cgroup)
        for node in self.nodes:
            for j in range(1, pods_per_node + 1):
                self._plan_pod(node, j)

    # ------------------------------------------------------------------------------ planning

    def _ns_name(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    def _cg(self, *parts: str) -> str | None:
        return os.path.join(self.cgroup_root, *parts) if self.cgroup_root else None

    def _add_role(self, role: str, ns: str, cgroup: str | None) -> None:
        self._roles[role] = ns
        if cgroup:
            self._cgroups[ns] = cgroup

    def _plan_node(self, n: int) -> Node:
        name = f"node{n}"
        node = Node(
            index=n,
            name=name,
            ns=self._ns_name(name),
            ip=node_ip(n),
            pod_cidr=node_pod_cidr(n),
            gateway=node_gateway(n),
            pin_dir=os.path.join(nx.BPFFS, f"{nx.PIN_PREFIX}{self.prefix}-{name}"),
            cgroup=self._cg(name, "host"),
            cgroup_root=self._cg(name),
            hostnet_cgroup=self._cg(name, "hostnet-pod"),
            ip6=node_ip6(n) if self.ipv6 else "",
        )
        self._add_role(name, node.ns, node.cgroup)
        return node

    def _plan_pod(self, node: Node, index: int) -> Pod:
        if not 1 <= index <= MAX_PODS_PER_NODE:
            raise ValueError(f"pod index must be 1..{MAX_PODS_PER_NODE}")
        if any(p.index == index for p in node.pods):
            raise LabError(f"pod {index} already exists on {node.name}")
        name = f"pod-{node.index}-{index}"
        pod = Pod(
            name=name,
            ns=self._ns_name(name),
            ip=pod_ip(node.index, index),
            node=node.index,
            index=index,
            gateway=node.gateway,
            host_iface=f"lxc-p{index}",
            cgroup=self._cg(node.name, name),
            ip6=pod_ip6(node.index, index) if self.ipv6 else "",
        )
        node.pods.append(pod)
        node.pods.sort(key=lambda p: p.index)
        self._add_role(name, pod.ns, pod.cgroup)
        return pod

    # ---------------------------------------------------------------------------- accessors

    @property
    def pods(self) -> list[Pod]:
        """Every pod, node by node, in index order."""
        return [p for n in self.nodes for p in n.pods]

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the lab (switch, client, nodes, pods)."""
        return [self.switch_ns, self.client.ns, *(n.ns for n in self.nodes), *(p.ns for p in self.pods)]

    @property
    def processes(self) -> list[Process]:
        """Processes started by the lab and not stopped yet."""
        return list(self._procs)

    @property
    def is_up(self) -> bool:
        return self._state == "up"

    def node(self, n: int | str | Node) -> Node:
        """Node by 1-based number, name ("node2") or object."""
        if isinstance(n, Node):
            return n
        for node in self.nodes:
            if n in (node.index, node.name):
                return node
        raise LabError(f"no node {n!r} in {self.prefix}")

    def pod(self, name_or_node: str | int, index: int | None = None) -> Pod:
        """Pod by name (`lab.pod("pod-2-1")`) or by node number and index (`lab.pod(2, 1)`)."""
        if isinstance(name_or_node, str):
            found = [p for p in self.pods if p.name == name_or_node]
        else:
            found = [p for p in self.node(name_or_node).pods if p.index == index]
        if not found:
            raise LabError(f"no pod {name_or_node!r} {index or ''} in {self.prefix}")
        return found[0]

    def ns(self, target: NsLike) -> str | None:
        """Namespace name of a Node/Pod/Client, a role ("node1", "client", "net"), or a full name."""
        if target is None:
            return None
        if not isinstance(target, str):
            return target.ns
        if target in self._roles:
            return self._roles[target]
        if target.startswith(self.prefix + "-") or target in nx.list_netns():
            return target
        raise LabError(f"unknown namespace or role {target!r} in {self.prefix}")

    def cgroup_of(self, target: NsLike) -> str | None:
        """cgroup v2 directory where the lab places processes it starts in that namespace."""
        ns = self.ns(target)
        return self._cgroups.get(ns) if ns else None

    def __repr__(self) -> str:
        return f"Lab({self.prefix}, nodes={len(self.nodes)}, pods={len(self.pods)}, state={self._state})"

    def describe(self) -> str:
        """Human-readable summary of namespaces and addresses."""
        lines = [f"lab {self.prefix} ({self._state}), tmp {self.tmpdir}"]
        lines.append(f"  {self.switch_ns:<24} switch: bridge {BRIDGE}")
        lines.append(f"  {self.client.ns:<24} client  eth0 {self.client.ip}/24")
        for node in self.nodes:
            lines.append(f"  {node.ns:<24} {node.name:<7} eth0 {node.ip}/24, pods {node.pod_cidr}")
            for pod in node.pods:
                lines.append(f"  {pod.ns:<24} {pod.name:<7} eth0 {pod.ip}/24 (node side {pod.host_iface})")
        return "\n".join(lines)

    # -------------------------------------------------------------------------- life cycle

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.down()
        except LabError:
            if exc is None:
                raise

    def up(self) -> Lab:
        """Create every namespace, link, address and route. Idempotent; a downed Lab cannot come back."""
        with self._lock:
            if self._state == "up":
                return self
            if self._state == "down":
                raise LabError(f"{self.prefix} was torn down; make a new Lab")
            t0 = time.monotonic()
            self._state = "up"
            _register(self)
            try:
                # Marked with its owner before any namespace exists: `python -m lab cleanup`
                # beside this run leaves the whole lab while this process runs.
                self.tmpdir = Path(nx.owned_tmpdir(f"{self.prefix}-", self.prefix))
                (self.tmpdir / "logs").mkdir()
                (self.tmpdir / "xtables").mkdir()
                self._build()
            except BaseException:
                with contextlib.suppress(Exception):
                    self.down()
                raise
            self.build_seconds = time.monotonic() - t0
            return self

    def _make_cgroups(self, paths: Iterable[str | None]) -> None:
        for path in paths:
            if path:
                os.makedirs(path, exist_ok=True)

    def _build(self) -> None:
        self._make_cgroups(
            [
                self.client.cgroup,
                *(n.cgroup for n in self.nodes),
                *(n.hostnet_cgroup for n in self.nodes),
                *(p.cgroup for p in self.pods),
            ]
        )
        host = [f"netns add {ns}" for ns in self.namespaces]
        for node in self.nodes:
            host.append(
                f"link add sw-{node.name} netns {self.switch_ns} type veth peer name eth0 netns {node.ns}"
            )
        host.append(
            f"link add sw-client netns {self.switch_ns} type veth peer name eth0 netns {self.client.ns}"
        )
        for pod in self.pods:
            host.append(self._pod_veth_line(pod))
        nx.ip_batch(host)
        if self.ipv6:
            self._no_dad(self.client.ns, "eth0")
            for node in self.nodes:
                self._no_dad(node.ns, "eth0", *node.pod_ifaces)
            for pod in self.pods:
                self._no_dad(pod.ns, pod.iface)

        switch = ["link set lo up", f"link add {BRIDGE} type bridge", f"link set {BRIDGE} up"]
        for port in [*(f"sw-{n.name}" for n in self.nodes), "sw-client"]:
            switch += [f"link set {port} master {BRIDGE}", f"link set {port} up"]
        client = ["link set lo up", "link set eth0 up", f"addr add {self.client.ip}/24 dev eth0"]
        if self.ipv6:
            client.append(f"addr add {self.client.ip6}/64 dev eth0 nodad")
        batches = {self.switch_ns: switch, self.client.ns: client}
        for node in self.nodes:
            lines = ["link set lo up", "link set eth0 up", f"addr add {node.ip}/24 dev eth0"]
            lines += [f"route add {o.pod_cidr} via {o.ip}" for o in self.nodes if o is not node]
            # Real nodes have a default route, so traffic to an unknown destination (a service VIP
            # without rules) is forwarded through netfilter rather than refused by routing. The
            # external client stands in as the upstream router; it does not forward.
            lines.append(f"route add default via {self.client.ip}")
            if self.ipv6:
                lines.append(f"addr add {node.ip6}/64 dev eth0 nodad")
                others = [o for o in self.nodes if o is not node]
                lines += [f"route add {node_pod_cidr6(o.index)} via {o.ip6}" for o in others]
                lines.append(f"route add ::/0 via {self.client.ip6}")
            if self.pod_bridge:
                prefix = node.pod_cidr.split("/")[1]
                lines += [
                    f"link add {self.pod_bridge} type bridge",
                    f"link set {self.pod_bridge} up",
                    f"addr add {node.gateway}/{prefix} dev {self.pod_bridge}",
                ]
            for pod in node.pods:
                lines += self._node_pod_lines(pod)
            batches[node.ns] = lines
        for pod in self.pods:
            batches[pod.ns] = self._pod_lines(pod)
        nx.ip_batches(batches)
        for node in self.nodes:
            self.set_sysctl(node, "net.ipv4.ip_forward", "1")
            if self.ipv6:
                self.set_sysctl(node, "net.ipv6.conf.all.forwarding", "1")
        if self.wire:  # a NIC's wire: full checksums on the external links, XDP_TX delivered
            ends = [self.client.ns, *(n.ns for n in self.nodes)]
            make_wire(self.switch_ns, [f"sw-{n.name}" for n in self.nodes], ends)

    def _no_dad(self, ns: str, *ifaces: str) -> None:
        """No duplicate address detection on these links (before they come up): `nodad` covers
        the ULA addresses, this the kernel's own link-local ones, without which neighbour
        discovery (and so every first IPv6 packet) waits about a second after the lab comes up."""
        for name in ("all", *ifaces):
            self.set_sysctl(ns, f"net.ipv6.conf.{name}.accept_dad", "0")

    def _pod_veth_line(self, pod: Pod) -> str:
        node = self.node(pod.node)
        return f"link add {pod.host_iface} netns {node.ns} type veth peer name {pod.iface} netns {pod.ns}"

    def _node_pod_lines(self, pod: Pod) -> list[str]:
        if self.pod_bridge:  # the bridge holds the gateway and the route to the node's pods
            return [f"link set {pod.host_iface} master {self.pod_bridge}", f"link set {pod.host_iface} up"]
        lines = [
            f"link set {pod.host_iface} up",
            f"addr add {pod.gateway}/32 dev {pod.host_iface}",
            f"route add {pod.ip}/32 dev {pod.host_iface} scope link",
        ]
        if pod.ip6:
            gateway6 = node_gateway6(pod.node)
            lines += [
                f"addr add {gateway6}/128 dev {pod.host_iface} nodad",
                f"route add {pod.ip6}/128 dev {pod.host_iface}",
            ]
        return lines

    @staticmethod
    def _pod_lines(pod: Pod) -> list[str]:
        # Point-to-point like the CNI ptp plugin (kindnet): the /24 gives the pod its netmask but no
        # on-link subnet route, so every packet, to same-node pods too, goes through the gateway.
        lines = [
            "link set lo up",
            f"link set {pod.iface} up",
            f"addr add {pod.ip}/24 dev {pod.iface} noprefixroute",
            f"route add {pod.gateway}/32 dev {pod.iface} scope link",
            f"route add default via {pod.gateway} dev {pod.iface}",
        ]
        if pod.ip6:
            gateway6 = node_gateway6(pod.node)
            lines += [
                f"addr add {pod.ip6}/64 dev {pod.iface} noprefixroute nodad",
                f"route add {gateway6}/128 dev {pod.iface}",
                f"route add ::/0 via {gateway6} dev {pod.iface}",
            ]
        return lines

    def set_sysctl(self, target: NsLike, key: str, value: str) -> None:
        """Write a sysctl inside a namespace (`net.ipv4.ip_forward` style key), without forking."""
        ns = self._require_ns(target)
        path = "/proc/sys/" + key.replace(".", "/")

        def write() -> None:
            with open(path, "w", encoding="ascii") as f:
                f.write(value + "\n")

        nx.in_netns(ns, write)

    def get_sysctl(self, target: NsLike, key: str) -> str:
        ns = self._require_ns(target)
        path = "/proc/sys/" + key.replace(".", "/")

        def read() -> str:
            with open(path, encoding="ascii") as f:
                return f.read().strip()

        return nx.in_netns(ns, read)

    def add_pod(self, node: int | str | Node, index: int | None = None) -> Pod:
        """Add a pod to a running lab (next free index by default); servers are not started."""
        with self._lock:
            self._require_up()
            n = self.node(node)
            if index is None:
                index = max((p.index for p in n.pods), default=0) + 1
            pod = self._plan_pod(n, index)
            try:
                self._make_cgroups([pod.cgroup])
                nx.ip_batch([f"netns add {pod.ns}", self._pod_veth_line(pod)])
                if self.ipv6:
                    self._no_dad(n.ns, pod.host_iface)
                    self._no_dad(pod.ns, pod.iface)
                nx.ip_batches({n.ns: self._node_pod_lines(pod), pod.ns: self._pod_lines(pod)})
            except BaseException:
                self._remove_pod(pod)
                raise
            return pod

    def remove_pod(self, pod: Pod | str) -> None:
        """Stop the pod's processes and delete its namespace and veth (the node's route goes with it)."""
        with self._lock:
            self._require_up()
            self._remove_pod(pod if isinstance(pod, Pod) else self.pod(pod))

    def _remove_pod(self, pod: Pod) -> None:
        self._stop_procs([p for p in self._procs if p.ns == pod.ns])
        if pod.cgroup:
            nx.remove_cgroup_tree(pod.cgroup)
        if os.path.exists(nx.netns_path(pod.ns)):
            nx.kill_netns(pod.ns)
        node = self.node(pod.node)
        # Deleting the veth first makes it vanish synchronously, so the index can be reused at once.
        nx.ip_batch([f"link del {pod.host_iface}"], ns=node.ns, force=True)
        nx.delete_netns([pod.ns])
        node.pods.remove(pod)
        self._roles.pop(pod.name, None)
        self._cgroups.pop(pod.ns, None)

    def add_client_route(self, cidr: str, via_node: int = 1) -> None:
        """Route `cidr` (a service/external/LB range, or a pod CIDR) from the client via node N (an
        IPv6 one via the node's IPv6 address, in a Lab(ipv6=True))."""
        self._require_up()
        via = self.node(via_node).ip6 if ":" in cidr else self.node(via_node).ip
        nx.ip_batch([f"route replace {cidr} via {via}"], ns=self.client.ns)

    def del_client_route(self, cidr: str) -> None:
        self._require_up()
        nx.ip_batch([f"route del {cidr}"], ns=self.client.ns, force=True)

    def down(self) -> None:
        """Kill every process, delete every namespace, cgroup, pin dir and the tmp dir. Idempotent.

        Raises LabError afterwards if something could not be removed.
        """
        with self._lock, _signals_deferred():
            if self._state != "up":
                self._state = "down"
                return
            self._state = "down"
            problems: list[str] = []

            def attempt(what: str, fn: Callable[[], object]) -> None:
                try:
                    fn()
                except Exception as exc:
                    problems.append(f"{what}: {exc}")

            attempt("stopping processes", lambda: self._stop_procs(list(self._procs)))
            if self.cgroup_root:
                root = self.cgroup_root
                attempt("removing cgroups", lambda: nx.remove_cgroup_tree(root))
            existing = [ns for ns in self.namespaces if os.path.exists(nx.netns_path(ns))]
            for ns in existing:
                attempt(f"killing processes in {ns}", functools.partial(nx.kill_netns, ns))
            attempt("deleting namespaces", lambda: nx.delete_netns(existing))
            for node in self.nodes:
                attempt(f"removing {node.pin_dir}", functools.partial(nx.remove_path, node.pin_dir))
            if self.tmpdir is not None:
                tmp = self.tmpdir
                attempt("removing tmp dir", lambda: shutil.rmtree(tmp, ignore_errors=True))
            _unregister(self)
            problems += nx.find_leaks([self.prefix], self.started, host_links=False)
            if problems:
                raise LabError(f"teardown of {self.prefix} left: " + "; ".join(problems))

    def _require_up(self) -> None:
        if self._state != "up":
            raise LabError(f"{self.prefix} is not up")

    def _require_ns(self, target: NsLike) -> str:
        ns = self.ns(target)
        if ns is None:
            raise LabError("a namespace is required")
        return ns

    # ---------------------------------------------------------------------------- processes

    def xtables_lock(self, target: NsLike) -> str:
        """The xtables lock file of a namespace of the lab (`XTABLES_LOCKFILE`): every command
        `command` builds for it takes this one, none of another namespace's nor the host's
        /run/xtables.lock, as on real nodes, each with its own /run."""
        ns = self._require_ns(target)
        if self.tmpdir is None:
            raise LabError(f"{self.prefix} is not up")
        return str(self.tmpdir / "xtables" / f"{ns.removeprefix(self.prefix + '-')}.lock")

    def command(
        self,
        target: NsLike,
        *argv: str,
        cgroup: str | bool | None = True,
        xtables: NsLike = None,
    ) -> list[str]:
        """The argv that runs `argv` inside a namespace (`ip netns exec`), in the namespace's cgroup.

        `target=None` means the caller's (host) namespace. `cgroup=True` picks the lab cgroup of the
        namespace (Node.cgroup / Pod.cgroup / Client.cgroup), a string names one, False/None: none.
        Note that `ip netns exec` remounts /sys, so /sys/fs/bpf is not visible to the command.
        The command takes the xtables lock of `xtables` (`xtables_lock`), by default its target's
        own: a host-namespace agent that programs a node through `--netns` names that node, so it
        and the node's other processes serialise on one lock, as on a real node.
        """
        ns = self.ns(target)
        cmd = list(argv)
        lock_ns = self.ns(xtables) if xtables is not None else ns
        if lock_ns is not None:
            # xtables_lock raises before `up()`: the host's /run/xtables.lock instead would be the
            # machine-wide wait this lock exists to avoid (issue 18), and silently so.
            cmd = ["env", f"{nx.XTABLES_LOCKFILE}={self.xtables_lock(lock_ns)}", *cmd]
        if ns is not None:
            cmd = ["ip", "netns", "exec", ns, *cmd]
        cg = self._cgroups.get(ns or "") if cgroup is True else (cgroup or None)
        if cg:
            # Join the cgroup before `ip netns exec` (which hides /sys/fs/cgroup behind a new /sys).
            cmd = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cg, *cmd]
        return cmd

    def run(
        self,
        target: NsLike,
        *argv: str,
        check: bool = True,
        timeout: float = 30.0,
        input: str | None = None,
        cgroup: str | bool | None = True,
        xtables: NsLike = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command to completion inside a namespace; capture text output. It takes the
        xtables lock of `xtables` (by default its target's: see `command`).

        Raises CommandError (a CalledProcessError) when `check` and the exit status is not 0, and
        LabError on timeout.
        """
        ns = self.ns(target)
        cmd = self.command(ns, *argv, cgroup=cgroup, xtables=xtables)
        try:
            res = subprocess.run(
                cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise LabError(f"{' '.join(argv)} in {ns} timed out after {timeout}s") from exc
        if check and res.returncode != 0:
            raise CommandError(res.returncode, argv, res.stdout, res.stderr, ns)
        return res

    def popen(
        self,
        target: NsLike,
        *argv: str,
        name: str | None = None,
        stdin: FileArg = subprocess.DEVNULL,
        stdout: FileArg = None,
        stderr: FileArg = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        cgroup: str | bool | None = True,
        xtables: NsLike = None,
    ) -> subprocess.Popen[bytes]:
        """Start a tracked background process inside a namespace (None: host namespace), taking
        the xtables lock of `xtables` (by default its target's: see `command`).

        stdout/stderr default to a log file in the lab's tmp dir (see `log_of`). The process runs in
        its own session (terminal Ctrl-C reaches the test runner, which tears the lab down).
        """
        with self._lock:
            self._require_up()
            assert self.tmpdir is not None
            ns = self.ns(target)
            self._seq += 1
            label = name or os.path.basename(argv[0])
            log: Path | None = None
            log_file: IO[bytes] | None = None
            if stdout is None:
                role = ns.removeprefix(self.prefix + "-") if ns else "host"
                log = self.tmpdir / "logs" / f"{self._seq:03d}-{role}-{label}.log"
                log_file = open(log, "wb")  # noqa: SIM115 - handed to the child, closed below
                stdout = log_file
                if stderr is None:
                    stderr = subprocess.STDOUT
            try:
                proc = subprocess.Popen(
                    self.command(ns, *argv, cgroup=cgroup, xtables=xtables),
                    stdin=stdin,
                    stdout=stdout,
                    stderr=stderr,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
            finally:
                if log_file is not None:
                    log_file.close()
            start = nx.proc_starttime(proc.pid)
            rec = Process(label, ns, proc, log, start)
            self._procs.append(rec)
            self._history.append(rec)
            self.started.append((proc.pid, start))
            STARTED.append((proc.pid, start))
            return proc

    def _record(self, proc: subprocess.Popen[bytes]) -> Process:
        for p in reversed(self._history):
            if p.popen is proc:
                return p
        raise LabError(f"process {proc.pid} is not tracked by {self.prefix}")

    def log_of(self, proc: subprocess.Popen[bytes], limit: int | None = 4000) -> str:
        """The tail of the log file of a process the lab started (stopped ones too, until teardown);
        the whole log with `limit=None`."""
        return self._record(proc).log_text(limit)

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 2.0) -> int | None:
        """SIGTERM a tracked process, SIGKILL after `timeout`; return its exit status."""
        with self._lock:
            rec = self._record(proc)
            if rec in self._procs:
                self._stop_procs([rec], timeout)
            return proc.returncode

    def _stop_procs(self, procs: list[Process], timeout: float = 2.0) -> None:
        for p in procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.popen.terminate()
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
            with contextlib.suppress(ValueError):
                self._procs.remove(p)

    # ------------------------------------------------------------------------------ servers

    def start_podserver(
        self,
        host: Host,
        *,
        blob: str | os.PathLike[str] | None = None,
        http_ports: Sequence[int] = (HTTP_PORT,),
        udp_ports: Sequence[int] = (UDP_PORT,),
        timeout: float = 5.0,
    ) -> subprocess.Popen[bytes]:
        """Start lab/podserver.py in a pod (or node/client): HTTP `/`, `/ip`, `/blob`; UDP echo.

        Returns once every HTTP port accepts connections (UDP ports are bound before that).
        """
        proc = self._spawn_podserver(host, blob, http_ports, udp_ports)
        self._wait_podserver(host, proc, http_ports, timeout)
        return proc

    def start_podservers(
        self,
        hosts: Iterable[Host] | None = None,
        *,
        blob: str | os.PathLike[str] | None = None,
        timeout: float = 5.0,
    ) -> list[subprocess.Popen[bytes]]:
        """Start podservers on many pods (all pods by default) in parallel; wait until all are ready."""
        targets = list(hosts) if hosts is not None else self.pods
        procs = [self._spawn_podserver(h, blob, (HTTP_PORT,), (UDP_PORT,)) for h in targets]
        for h, proc in zip(targets, procs, strict=True):
            self._wait_podserver(h, proc, (HTTP_PORT,), timeout)
        return procs

    def _wait_podserver(
        self, host: Host, proc: subprocess.Popen[bytes], http_ports: Sequence[int], timeout: float
    ) -> None:
        # The ready line proves this very process bound every port (a port poll alone could reach an
        # older server on the same port); the poll then proves the namespace routes to it.
        self.wait_log(proc, "podserver ready", timeout=timeout)
        for port in http_ports:
            self.wait_tcp(host, host.ip, port, proc=proc, timeout=timeout)

    def _spawn_podserver(
        self,
        host: Host,
        blob: str | os.PathLike[str] | None,
        http_ports: Sequence[int],
        udp_ports: Sequence[int],
    ) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-I", "-S", str(PODSERVER), "--name", host.name]
        for port in http_ports:
            argv += ["--http-port", str(port)]
        for port in udp_ports:
            argv += ["--udp-port", str(port)]
        if blob is not None:
            argv += ["--blob", os.fspath(blob)]
        return self.popen(host, *argv, name="podserver")

    def start_dns(
        self,
        host: Host,
        *,
        txt: str | None = None,
        extra_args: Sequence[str] = (),
        timeout: float = 5.0,
    ) -> subprocess.Popen[bytes]:
        """Start dnsmasq on `host.ip`:53 (UDP and TCP).

        Answers `whoami.lab TXT "<txt or host name>"`, `*.svc.lab A 10.0.0.1` and
        `<host name>.lab A <host ip>`. Ask with `dig`/`dns_whoami`.
        """
        dnsmasq = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        argv = [
            dnsmasq,
            "--no-daemon",  # foreground, stays root, answers TCP without forking
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--log-facility=-",
            f"--port={DNS_PORT}",
            f"--listen-address={host.ip}",
            "--bind-interfaces",
            f"--txt-record={DNS_TXT_NAME},{txt or host.name}",
            f"--address=/{DNS_SVC_DOMAIN}/{DNS_SVC_ADDR}",
            f"--host-record={host.name}.lab,{host.ip}",
            *extra_args,
        ]
        self._check_port_free(host, DNS_PORT)
        proc = self.popen(host, *argv, name="dnsmasq")
        self.wait_tcp(host, host.ip, DNS_PORT, proc=proc, timeout=timeout)
        return proc

    def start_nginx(
        self, host: Host, *, port: int = NGINX_PORT, body: str | None = None, timeout: float = 5.0
    ) -> subprocess.Popen[bytes]:
        """Start nginx (1 worker, no access log) on `port`: `/` answers `<host name>\\n`, `/ip` the peer.
        A host with an IPv6 address (a Lab(ipv6=True)) is served on [::]:`port` too."""
        self._require_up()
        assert self.tmpdir is not None
        d = self.tmpdir / f"nginx-{host.name}-{port}"
        d.mkdir(exist_ok=True)
        text = (body if body is not None else host.name + "\n").replace("\\", "\\\\").replace('"', '\\"')
        text = text.replace("\n", "\\n")
        listen6 = f"\n    listen [::]:{port} ipv6only=on backlog=4096;" if host.ip6 else ""
        conf = d / "nginx.conf"
        conf.write_text(
            f"""daemon off;
master_process on;
worker_processes 1;
user root;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 16384; }}
http {{
  access_log off;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  default_type text/plain;
  keepalive_requests 1000000;
  server {{
    listen {port} backlog=4096;{listen6}
    location = / {{ return 200 "{text}"; }}
    location = /ip {{ return 200 "$remote_addr\\n"; }}
  }}
}}
"""
        )
        self._check_port_free(host, port)
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        proc = self.popen(
            host, nginx, "-p", str(d), "-e", str(d / "error.log"), "-c", str(conf), name="nginx"
        )
        self.wait_tcp(host, host.ip, port, proc=proc, timeout=timeout)
        if host.ip6:
            self.wait_tcp(host, host.ip6, port, proc=proc, timeout=timeout)
        return proc

    def wait_log(self, proc: subprocess.Popen[bytes], marker: str, *, timeout: float = 5.0) -> None:
        """Wait until a tracked process's log contains `marker`; LabError if it exits or times out."""
        rec = self._record(proc)
        deadline = time.monotonic() + timeout
        while marker not in rec.log_text(limit=1 << 16):
            if proc.poll() is not None:
                raise LabError(f"{rec.name} in {rec.ns} exited with {proc.returncode}:\n{rec.log_text()}")
            if time.monotonic() > deadline:
                raise LabError(f"{rec.name} in {rec.ns} not ready after {timeout}s:\n{rec.log_text()}")
            time.sleep(0.005)

    def _check_port_free(self, host: Host, port: int) -> None:
        if self.tcp_probe(host, host.ip, port, timeout=0.5) == "open":
            raise LabError(f"something already listens on {host.ip}:{port} in {host.ns}")

    def wait_tcp(
        self,
        target: NsLike,
        ip: str,
        port: int,
        *,
        proc: subprocess.Popen[bytes] | None = None,
        timeout: float = 5.0,
    ) -> None:
        """Poll from inside a namespace until ip:port accepts a TCP connection.

        Fails early, with the log tail, when `proc` exits first.
        """
        ns = self._require_ns(target)
        deadline = time.monotonic() + timeout
        while True:
            if proc is not None and proc.poll() is not None:
                log = self.log_of(proc) if any(p.popen is proc for p in self._history) else ""
                raise LabError(
                    f"process {proc.args!r} exited with {proc.returncode} before {ip}:{port} listened:\n{log}"
                )
            with nx.ns_socket(ns, socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
                s.settimeout(0.5)
                try:
                    s.connect((ip, port))
                    return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise LabError(f"nothing listens on {ip}:{port} in {ns} after {timeout}s")
            time.sleep(0.005)

    # ------------------------------------------------------------------------------ clients

    def in_netns(self, target: NsLike, fn: Callable[[], T]) -> T:
        """Run `fn` on a thread inside the namespace (see `lab.netns.in_netns`)."""
        return nx.in_netns(self._require_ns(target), fn)

    def socket(
        self, target: NsLike, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM
    ) -> socket.socket:
        """A socket living in the namespace, usable from the calling thread."""
        return nx.ns_socket(self._require_ns(target), family, type)

    def http_fetch(
        self, target: NsLike, ip: str, port: int = HTTP_PORT, path: str = "/", *, timeout: float = 5.0
    ) -> tuple[int, bytes]:
        """HTTP/1.0 GET from inside a namespace, in process; returns (status, body).

        Raises OSError (ConnectionRefusedError, TimeoutError, ...) when the connection fails.
        Over IPv6 when `ip` is an IPv6 address.
        """
        v6 = ":" in ip
        with self.socket(target, socket.AF_INET6 if v6 else socket.AF_INET) as s:
            s.settimeout(timeout)
            s.connect((ip, port))
            host = f"[{ip}]" if v6 else ip
            s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
            chunks = []
            while chunk := s.recv(1 << 16):
                chunks.append(chunk)
        data = b"".join(chunks)
        head, sep, body = data.partition(b"\r\n\r\n")
        parts = head.split(b"\r\n", 1)[0].split()
        if not sep or len(parts) < 2 or not parts[1].isdigit():
            raise LabError(f"bad HTTP response from {ip}:{port}: {data[:200]!r}")
        return int(parts[1]), body

    def http_get(
        self, target: NsLike, ip: str, port: int = HTTP_PORT, path: str = "/", *, timeout: float = 2.0
    ) -> str:
        """Body of GET http://ip:port/path from inside a namespace (podserver `/` = "<pod name>\\n").

        Raises LabError on a non-2xx status, OSError when the connection fails.
        """
        status, body = self.http_fetch(target, ip, port, path, timeout=timeout)
        if not 200 <= status < 300:
            raise LabError(f"GET http://{ip}:{port}{path}: HTTP {status}")
        return body.decode(errors="replace")

    def udp_echo(
        self, target: NsLike, ip: str, port: int = UDP_PORT, payload: str = "ping", *, timeout: float = 2.0
    ) -> str:
        """Send one datagram from a connected UDP socket in the namespace; return the reply.

        The podserver replies "<pod name> <payload>". A reply from any other address than ip:port is
        ignored by the kernel (connected socket), as a real client would. Raises TimeoutError.
        """
        with self.socket(target, socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout)
            s.connect((ip, port))
            s.send(payload.encode())
            return s.recv(65535).decode(errors="replace")

    def tcp_probe(self, target: NsLike, ip: str, port: int, *, timeout: float = 1.0) -> str:
        """Try a TCP connect from the namespace: "open", "refused", "unreachable" or "timeout"
        (over IPv6 when `ip` is an IPv6 address)."""
        with self.socket(target, socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.settimeout(timeout)
            try:
                s.connect((ip, port))
                return "open"
            except ConnectionRefusedError:
                return "refused"
            except TimeoutError:
                return "timeout"
            except OSError as exc:
                if exc.errno in (101, 113):  # ENETUNREACH, EHOSTUNREACH
                    return "unreachable"
                return f"error: {exc}"

    def curl(self, target: NsLike, url: str, *, timeout: float = 5.0, args: Sequence[str] = ()) -> str:
        """`curl -sS --fail --max-time T url` inside the namespace; returns the body.

        Raises CommandError on failure (exit status 7: refused, 28: timeout, 22: HTTP error).
        """
        res = self.run(
            target, "curl", "-sS", "--fail", "--max-time", str(timeout), *args, url, timeout=timeout + 5
        )
        return res.stdout

    def dig(
        self,
        target: NsLike,
        server: str,
        name: str = DNS_TXT_NAME,
        rtype: str = "TXT",
        *,
        tcp: bool = False,
        port: int = DNS_PORT,
        timeout: float = 2.0,
        source_port: int | None = None,
    ) -> str:
        """`dig @server name rtype +short` inside the namespace (UDP, or TCP with `tcp=True`), from
        `source_port` when given (else dig's random one).

        Returns dig's short output (TXT answers keep their quotes); raises CommandError when no
        answer came.
        """
        argv = ["dig", f"@{server}", "-p", str(port), name, rtype, "+short"]
        if source_port is not None:
            argv += ["-b", f"{'::' if ':' in server else '0.0.0.0'}#{source_port}"]
        argv += [f"+time={max(1, round(timeout))}", "+tries=1", "+tcp" if tcp else "+notcp"]
        res = self.run(target, *argv, timeout=timeout + 5)
        if res.stdout.startswith(";;"):
            raise CommandError(9, argv, res.stdout, res.stderr, self.ns(target))
        return res.stdout.strip()

    def dns_whoami(
        self,
        target: NsLike,
        server: str,
        *,
        tcp: bool = False,
        timeout: float = 2.0,
        source_port: int | None = None,
    ) -> str:
        """Name of the pod whose dnsmasq answered `whoami.lab TXT` (quotes stripped)."""
        return self.dig(target, server, tcp=tcp, timeout=timeout, source_port=source_port).strip('"')

    def make_blob(self, size: int, name: str = "blob.bin") -> tuple[Path, str]:
        """Write `size` random bytes into the lab's tmp dir; return (path, sha256 hex)."""
        self._require_up()
        assert self.tmpdir is not None
        path = self.tmpdir / name
        digest = hashlib.sha256()
        with open(path, "wb") as f:
            left = size
            while left > 0:
                chunk = os.urandom(min(left, 1 << 20))
                digest.update(chunk)
                f.write(chunk)
                left -= len(chunk)
        return path, digest.hexdigest()


class LabFactory(Protocol):
    """Type of the `make_lab` fixture (tests/conftest.py)."""

    def __call__(
        self, nodes: int = 1, pods_per_node: int = 2, *, servers: bool = True, **kwargs: Any
    ) -> Lab: ...


# ----------------------------------------------------------------------- process-wide safety net

_LIVE: set[Lab] = set()
_LIVE_LOCK = threading.Lock()
_handlers_installed = False
_handlers_pid = 0  # the process that installed the handlers (forked children inherit them)


def live_labs() -> list[Lab]:
    """Labs that are up in this process."""
    with _LIVE_LOCK:
        return list(_LIVE)


def _register(lab: Lab) -> None:
    with _LIVE_LOCK:
        _LIVE.add(lab)
        CREATED_PREFIXES.add(lab.prefix)
    _install_signal_handlers()


def _unregister(lab: Lab) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(lab)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    if os.getpid() != _handlers_pid:
        # A forked child (pyroute2's netns helper) inherits the handler. Raising there would unwind
        # the parent's copied stack in the child and run its `finally`s and fixture teardowns (an
        # `ip netns del`, an `umount`) under the feet of the still-running parent: just exit.
        os._exit(128 + signum)
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


def _install_signal_handlers() -> None:
    """SIGTERM/SIGHUP raise KeyboardInterrupt (so `with`, fixtures and atexit tear labs down)."""
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    global _handlers_pid
    _handlers_pid = os.getpid()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _raise_interrupt)
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _handlers_installed = True


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while tearing down (main thread only); they are delivered after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@atexit.register
def _down_all() -> None:
    for lab in live_labs():
        try:
            lab.down()
        except Exception as exc:
            print(f"lab: teardown at exit: {exc}", file=sys.stderr)
