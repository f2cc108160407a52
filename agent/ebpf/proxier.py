"""EbpfProxier: the eBPF mode's Proxier. Plan, write what changed in order, keep the programs attached.

Lifecycle (kube-proxy's contract, agent/proxier.py):

* The constructor only remembers its arguments.
* The first `sync` checks the SNAT port range against the NodePort range and the node's local
  port range (a FatalError naming both), loads the data path (bcc compiles bpf/ekp_tc.c; maps are
  pinned under Config.pin_path and reused when they exist; the conntrack tables keep the size they
  were pinned with), reads the service maps back so the planner re-adopts their ids and writes
  only differences (stale entries are pruned: the agent syncs only once every kind was listed),
  writes the config entry (double-buffered, agent.ebpf.maps.write_config), sets the sysctls it
  needs in Config.netns, carries the conntrack of an ABI v1 agent over (agent/ebpf/upgrade.py) and
  the established flows of nf_conntrack (kube-proxy's, iptables mode's: agent/takeover/into_ebpf.py),
  attaches the programs (replacing older ones atomically), carries over what the old programs or
  netfilter added meanwhile, stamps the flows the conntrack tables hold and arms the flow-activity
  check (agent/ebpf/activity.py; disarmed before the attach), removes pins of other ABI versions,
  writes the socket programs' settings (the node's netns cookie, host-namespace-only) and links them
  to their cgroup (the pinned links an earlier agent left get the new programs,
  agent/ebpf/sockattach.py), then removes the other data path's rules (only now: until the socket
  programs are linked, its OUTPUT rules serve the node's own clients) and starts the pod-device
  watcher.
  Conntrack and affinity are never flushed.
* Later syncs re-plan only the changed service ports (`agent.ebpf.planner`) and write their entries;
  one that removed a backend from a service port ends the connected UDP sockets still sent to it
  (agent/ebpf/sockterm.py). A full sync (`changed` None, every sync period) reads the maps back
  first and repairs whatever differs from the plan, re-pinning maps whose pin was removed (counted
  in SyncResult.repaired), links the socket programs again where they were removed, and ends
  stale UDP sockets too.
  When a write fails outright, what the maps hold is no longer known: the next sync reads them back.
  A map too full for a service port's entries fails that port only (SyncResult.failed).
* With --bpf-xdp=best-effort the load leaves the XDP programs out where every external device is
  a veth, a bridge or a vxlan device (best-effort attaches none there): `_loads_xdp`. A sync
  whose attach then finds an external device best-effort would try (Attacher.xdp_wanted) loads
  the data path again with them (`_load_xdp`: the same build, another load id, from the compile
  cache) and puts the new load's programs on every device in place of the first's, as a restart
  with other sizes does, XDP's first try included; the tc programs serve meanwhile, and a load
  that fails (never compiled again) leaves them serving and is reported, tried again by periodic
  syncs with a backoff (XDP_RETRY_FIRST doubled up to XDP_RETRY_MAX). The first load stays open
  until the reload is finished (`_finish_reload`, by the next sync when its attach failed).
* Stopping the agent removes nothing: `close()` only stops the watcher and lets the fds go;
  pinned maps and attached programs keep serving traffic until the next agent re-adopts them.
* `cleanup()` detaches our filters and socket links, removes our pins and the pin directory, and
  nothing else.

The data path, the attachers and the socket terminator are passed in as factories (real ones by
default) so the tests swap in fakes; there is no test branch in here.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from agent import keptfile
from agent.config import Config, MapSizes, NodeContext
from agent.ebpf import abi, activity, snapshot
from agent.ebpf.abi import HandoverMode, Stat
from agent.ebpf.attach import PROG_EGRESS, PROG_FROM_NET, PROG_FROM_POD, Attacher, HandoverState, detach_all
from agent.ebpf.codec import KEYS, VALUES, Value
from agent.ebpf.family6 import Frontends6, Ipv6Datapath, carry6_guarded, config6_of
from agent.ebpf.maglev_writer import MaglevWriter
from agent.ebpf.maps import MapWriter, read_config, read_config6, read_stats, write_config, write_config6
from agent.ebpf.plan import MapContents, planner_contents, read_contents
from agent.ebpf.planner import ROLES, FlushResult, Planner, RawMap
from agent.ebpf.ports import held_outside, parse_port_range, snat_ports_problem
from agent.ebpf.programs import PROG_SOCK_TERM, SOCK_HOOKS
from agent.ebpf.sockattach import sock_config
from agent.ebpf.upgrade import Upgrade
from agent.ebpf.xdp import PROG_XDP, start_loads_programs
from agent.errors import FatalError
from agent.keptrecords import records_path
from agent.lock import LOCK_DIR
from agent.model.types import IPFamily, NodeInfo, ProxyState, ServicePortName
from agent.netns import run_in_netns
from agent.proxier import SyncResult
from agent.takeover import into_ebpf, out_of_ebpf
from agent.takeover.flows import UDP, NatFlow, Tuple, ct6_keys, masqueraded_into
from agent.takeover.into_ebpf import KernelTakeover

if TYPE_CHECKING:
    from agent.ebpf.maps import BpfMap

log = logging.getLogger(__name__)

LOCAL_PORT_RANGE = "net/ipv4/ip_local_port_range"
NAMED_FLOWS = 3  # flows named in the warning about those the IPv6 SNAT grant waits for
# A failed load with the XDP programs (`_load_xdp`) is tried again by the first periodic sync this
# long after it, doubled at each failure up to XDP_RETRY_MAX: a load that fails costs the verifier's
# seconds under the proxier's lock, and what fails it (the verifier, memlock, ENOSPC) rarely
# changes between two sync periods.
XDP_RETRY_FIRST = 60.0
XDP_RETRY_MAX = 3600.0

# sysctl (as a /proc/sys path) -> (value, why); set in Config.netns at the first sync.
SYSCTLS: dict[str, tuple[str, str]] = {
    "net/ipv4/ip_forward": ("1", "forwarding service traffic between pods, nodes and clients"),
}


class DatapathLike(Protocol):
    """agent.ebpf.loader.Datapath: compile, load, pin; program fds and maps by role."""

    @property
    def maps(self) -> Mapping[str, MapWriter]: ...

    def load(self, maps_ready: Callable[[], None] | None = None, *, recompile: bool = True) -> None:
        """`maps_ready()` once `maps` can be written, maybe before the programs are loaded.
        `recompile` False: a cached object that does not load fails the load (no compile)."""

    def prog_fd(self, name: str) -> int: ...

    def has_program(self, name: str) -> bool:
        """Whether the program was loaded (a kernel lacking what it needs loads the rest)."""

    def repair_pins(self) -> list[str]:
        """Pin again every map whose pin was removed or replaced; the names repaired."""

    def release_older_builds(self) -> list[str]:
        """Unpin what the load kept of older builds until the first attach replaced them."""

    def set_handover(self, mode: HandoverMode) -> None:
        """This build's hand-over mode (struct ekp_handover), read by its programs at each packet."""

    def handover_mode(self) -> HandoverMode:
        """This build's hand-over mode as pinned (what a start cut short left)."""

    def close(self) -> None: ...


class UpgradeLike(Protocol):
    """A step around the first attach (StartSteps): the conntrack of an older ABI carried over
    (agent.ebpf.upgrade.Upgrade), nf_conntrack's flows taken over (agent.takeover.into_ebpf)."""

    def before_attach(self, maps: Mapping[str, MapWriter]) -> None: ...

    def after_attach(self, maps: Mapping[str, MapWriter]) -> None: ...

    def abort(self, *, attached: bool) -> None:
        """The first attach failed after before_attach and before after_attach: what
        before_attach changed on the node for the attach alone is put back (the next sync's
        before_attach starts again), unless `attached` (a program of ours may be on some device
        already): what the attach needs until every device has one stays, put back by the
        retry's after_attach or by `close`."""

    def close(self) -> None:
        """The agent stops: what before_attach changed on the node and nothing put back since is
        put back."""

    def after_first_sync6(
        self, maps: Mapping[str, MapWriter], frontends: Mapping[tuple[str, int, int], int] | None = None
    ) -> None:
        """The first IPv6 sync after the first attach writes the IPv6 maps (frontends the attach's
        steps could not find yet on a node the agent never served): called before its ekp_fe6
        write, with the frontends that write adds (`frontends`, by (address, port, protocol): their
        svc_id), or after the sync (None) when it writes none."""

    @property
    def hands_over(self) -> bool:
        """The older programs keep flows the new ones cannot see until after_attach: the new ones
        go in front of them meanwhile (Attacher.reconcile(front=True))."""

    def serving(self) -> None:
        """Every hook serves: tc, XDP and the socket programs (the other data path's rules go)."""


class SocketAttacherLike(Protocol):
    """agent.ebpf.sockattach.SocketAttacher: the socket programs linked to one cgroup."""

    @property
    def cgroup(self) -> str: ...

    def reconcile(self) -> list[str]: ...


class TerminatorLike(Protocol):
    """agent.ebpf.sockterm.SocketTerminator: ends connected UDP sockets whose backend left."""

    def run(self) -> int: ...

    def close(self) -> None: ...


class AttacherLike(Protocol):
    def attach_egress(self, node: NodeContext) -> None: ...

    def reconcile(
        self,
        node: NodeContext,
        *,
        full: bool = False,
        verify: bool = False,
        keep_external: bool = False,
        front: bool = False,
    ) -> None: ...

    def rehome(self) -> None:
        """Move the filters put in front of an older generation's to our own priority."""

    @property
    def fronts(self) -> Mapping[tuple[int, int], str]:
        """The programs in front of an older generation's, until `rehome` moves them."""

    def handover_state(self) -> HandoverState: ...

    @property
    def watching(self) -> bool: ...

    def start_watcher(self, timeout: float = 5.0) -> None: ...

    def stop_watcher(self) -> bool:
        """Whether the watcher thread is gone (it may still be in an attach when not)."""

    @property
    def xdp_wanted(self) -> Mapping[int, str]:
        """External devices best-effort would try XDP on, which it has no XDP program for."""

    def use_programs(self, prog_fds: Mapping[str, int], ports: MapWriter) -> None:
        """Another load's programs for every attach from here (a full reconcile puts them on)."""


def handover_start(pinned: HandoverMode, state: HandoverState) -> HandoverMode:
    """The mode a first attach that hands over sets before it goes in front. PASS only for a
    hand-over that never started (this build OFF, nothing of ours at FRONT_PRIO): a mode is never
    lowered, for flows this build took in MISS are unknown to the older programs. Another build of
    ours in front (its hand-over cut short, its flows in our shared conntrack): MISS. Nothing of an
    older generation behind and nothing in front: OFF, this build is alone on every hook."""
    if state.own_front:
        return pinned
    if state.other_front:
        return HandoverMode.MISS if pinned == HandoverMode.OFF else pinned
    if not state.older_behind:
        return HandoverMode.OFF
    return HandoverMode.PASS if pinned == HandoverMode.OFF else pinned


class StartSteps:
    """Steps run around the first attach, in order: the ABI v1 conntrack carried over, then the
    flows of nf_conntrack (kube-proxy's, iptables mode's) taken over (agent/takeover/into_ebpf.py)."""

    def __init__(self, steps: Sequence[UpgradeLike]) -> None:
        self._steps = list(steps)

    def before_attach(self, maps: Mapping[str, MapWriter]) -> None:
        for step in self._steps:
            step.before_attach(maps)

    def after_attach(self, maps: Mapping[str, MapWriter]) -> None:
        self._each(lambda step: step.after_attach(maps))

    def abort(self, *, attached: bool) -> None:
        self._each(lambda step: step.abort(attached=attached))

    def close(self) -> None:
        self._each(lambda step: step.close())

    def _each(self, call: Callable[[UpgradeLike], None]) -> None:
        """Every step, whatever an earlier one raised (a later one puts back what its
        before_attach changed on the node: tcp_be_liberal); the first error raised at the end."""
        first: BaseException | None = None
        for step in self._steps:
            try:
                call(step)
            except BaseException as exc:
                if first is None:
                    first = exc
                else:
                    log.error("a start step failed after another had: %r", exc)
        if first is not None:
            raise first

    def after_first_sync6(
        self, maps: Mapping[str, MapWriter], frontends: Mapping[tuple[str, int, int], int] | None = None
    ) -> None:
        for step in self._steps:
            step.after_first_sync6(maps, frontends)

    @property
    def hands_over(self) -> bool:
        return any(step.hands_over for step in self._steps)

    def serving(self) -> None:
        for step in self._steps:
            step.serving()


def default_start_steps(config: Config, state_dir: str = LOCK_DIR) -> UpgradeLike:
    return StartSteps([Upgrade(config.pin_path), KernelTakeover(config, state_dir=state_dir)])


def default_datapath(pin_path: str, sizes: MapSizes) -> DatapathLike:
    from agent.ebpf.loader import Datapath

    datapath: DatapathLike = Datapath(pin_path, sizes)
    return datapath


def default_pinned_sizes(pin_path: str) -> dict[str, int]:
    from agent.ebpf.loader import pinned_sizes

    return pinned_sizes(pin_path)


def read_sysctl(netns: str, path: str) -> str:
    """/proc/sys/`path` in `netns`."""
    return run_in_netns(netns, lambda: (Path("/proc/sys") / path).read_text().strip())


def default_attacher(config: Config, prog_fds: Mapping[str, int], ports: MapWriter) -> AttacherLike:
    return Attacher(config, prog_fds, ports)


def default_xdp_devices(config: Config, ipv6: bool) -> dict[str, str]:
    """Name -> rtnetlink kind of each external device now (agent.ebpf.attach.external_kinds)."""
    from agent.ebpf.attach import external_kinds

    return external_kinds(config, ipv6=ipv6)


def default_socket_attacher(config: Config, prog_fds: Mapping[str, int]) -> SocketAttacherLike:
    from agent.ebpf.sockattach import SocketAttacher, socket_cgroup

    return SocketAttacher(config.pin_path, socket_cgroup(config.socket_lb_cgroup), prog_fds)


def default_terminator(config: Config, cgroup: str, prog_fd: int, ended: Callable[[], int]) -> TerminatorLike:
    from agent.ebpf.sockterm import SocketTerminator

    return SocketTerminator(prog_fd, config.netns, cgroup, pods=not config.socket_lb_host_only, ended=ended)


def _carried6(maps: Mapping[str, MapWriter], flow: NatFlow) -> bool:
    """Whether the tc IPv6 path owns an nf_conntrack UDP flow: the start carried it into ekp_ct6_any
    (its REPLY entry, keyed by the flow's reply tuple, is there)."""
    ct6_any = maps.get("ct6_any")
    return flow.proto == UDP and ct6_any is not None and ct6_any.lookup(ct6_keys(flow)[1]) is not None


def _nothing() -> None:
    pass


def _ignore(held: int) -> None:
    """No gauge to tell (EbpfProxier.on_snat6_held)."""


def default_netns_cookie(netns: str) -> int:
    from agent.ebpf.sockattach import netns_cookie

    return netns_cookie(netns)


def default_conntrack6_reader(netns: str) -> list[NatFlow]:
    from agent.takeover.nfct import dump_flows

    return dump_flows(netns, socket.AF_INET6)


def default_socket_detach(pin_path: str) -> list[str]:
    from agent.ebpf.sockattach import detach_all

    return detach_all(pin_path)


class EbpfProxier:
    def __init__(
        self,
        config: Config,
        *,
        datapath_factory: Callable[[str, MapSizes], DatapathLike] = default_datapath,
        attacher_factory: Callable[[Config, Mapping[str, int], MapWriter], AttacherLike] = default_attacher,
        sysctl_writer: Callable[[str, str, str], str | None] | None = None,
        sysctl_reader: Callable[[str, str], str] = read_sysctl,
        sizes_reader: Callable[[str], dict[str, int]] = default_pinned_sizes,
        upgrade_factory: Callable[[Config], UpgradeLike] | None = None,
        socket_attacher_factory: Callable[[Config, Mapping[str, int]], SocketAttacherLike] = (
            default_socket_attacher
        ),
        terminator_factory: Callable[[Config, str, int, Callable[[], int]], TerminatorLike] = (
            default_terminator
        ),
        netns_cookie_reader: Callable[[str], int] = default_netns_cookie,
        socket_detach: Callable[[str], list[str]] = default_socket_detach,
        conntrack6_reader: Callable[[str], list[NatFlow]] = default_conntrack6_reader,
        node6_reader: Callable[[], NodeContext] | None = None,
        masquerade6_reader: Callable[[], bool] | None = None,
        xdp_devices_reader: Callable[[Config, bool], Mapping[str, str]] = default_xdp_devices,
        clock: Callable[[], float] = time.monotonic,
        snapshot_dir: str | None = None,
        ipv6: bool,
    ) -> None:
        """`ipv6`: whether the agent runs an IPv6 half (agent/app.py serves_ipv6, decided before the
        early load): a node that fell back to single-stack gets no tc IPv6 path whatever the
        settings say (no full-size IPv6 conntrack tables, no filled ekp_calls6).

        `snapshot_dir`: where `close` leaves the planner for the next start (agent.ebpf.snapshot;
        the agent's lock directory); None: nowhere, every start reads the maps' ids back.
        `node6_reader`: the node's IPv6 addresses as the IPv6 half reads them, asked once at the
        load to tell whether the SNAT grant an earlier run left pinned still holds
        (`_pinned_grant6`); without it the load always writes ekp_cfg6 zero. `masquerade6_reader`:
        whether the IPv6 nat rules in place keep MASQUERADE out of --bpf-snat-ports (eBPF mode's
        shape, agent/iptables/masquerade_shape.py), asked at the same load; without it the same.
        `xdp_devices_reader(config, ipv6)`: name -> rtnetlink kind of each external device, read by
        a load under --bpf-xdp=best-effort (`_loads_xdp`). `clock`: monotonic seconds, for the
        retries of a failed load with the XDP programs."""
        self._config = config
        self._tc_ipv6 = config.tc_ipv6 and ipv6  # the tc programs' IPv6 path serves
        self._datapath_factory = datapath_factory
        self._attacher_factory = attacher_factory
        self._sysctl_writer = sysctl_writer or write_sysctl
        self._sysctl_reader = sysctl_reader
        self._sizes_reader = sizes_reader
        self._socket_attacher_factory = socket_attacher_factory
        self._terminator_factory = terminator_factory
        self._netns_cookie_reader = netns_cookie_reader
        self._socket_detach = socket_detach
        self._conntrack6_reader = conntrack6_reader
        self._node6_reader = node6_reader
        self._masquerade6_reader = masquerade6_reader
        self._xdp_devices_reader = xdp_devices_reader
        self._clock = clock
        self._snapshot = snapshot.snapshot_path(snapshot_dir, config.pin_path) if snapshot_dir else ""
        # where an iptables-mode agent's hand-back records that its detach began (out_of_ebpf)
        self._handback_dir = snapshot_dir or LOCK_DIR
        # The takeover keeps the node's own tcp_be_liberal there too (None: default_start_steps)
        self._upgrade = (
            upgrade_factory(config) if upgrade_factory else default_start_steps(config, self._handback_dir)
        )
        # The model's records the agent keeps beside the planner (agent.keptrecords): removed with it
        self._records_file = records_path(snapshot_dir, config.pin_path) if snapshot_dir else ""
        # Now, not at close: sources changed under the running agent (an upgrade in place) must not
        # label this run's planner as theirs
        self._snapshot_identity = snapshot.identity(config) if snapshot_dir else b""
        # Told how many flows the IPv6 SNAT grant waits for, at each look (the agent's gauge
        # ekp_ipv6_snat_held_flows: set after construction, as the early load makes the proxier
        # before the metrics exist)
        self.on_snat6_held: Callable[[int], None] = _ignore
        # ... and whether it is granted, 1 or 0, at each IPv6 sync (ekp_ipv6_snat_granted)
        self.on_snat6_granted: Callable[[int], None] = _ignore
        self._socket_attacher: SocketAttacherLike | None = None
        self._terminator: TerminatorLike | None = None
        self._lock = threading.Lock()
        self._datapath: DatapathLike | None = None  # loaded, programs and maps
        # The load runs without self._lock (prepare() while the source lists): a first sync that
        # comes meanwhile waits on this condition for the maps only, plans and writes them while
        # the verifier loads the programs, and waits for the programs before it attaches.
        self._load_cond = threading.Condition()
        self._loading = False  # a thread is in _load()
        self._opened: DatapathLike | None = None  # the data path being loaded, once its maps are open
        self._synced_with: DatapathLike | None = None  # the data path whose maps the planner wrote
        # Data paths whose load failed after their maps were handed to a sync: closed by the next
        # sync (under the lock, so no sync writes through their fds any more), or by close().
        self._retired: list[DatapathLike] = []
        self._load_error = ""  # why the last load that failed did
        self._sizes: MapSizes | None = None  # what the data path was last loaded with
        # Loads with the XDP programs that failed in a row (`_load_xdp`), and the clock before which
        # no sync tries again (then only a periodic one: XDP_RETRY_FIRST)
        self._xdp_failures = 0
        self._xdp_retry_at = 0.0
        # Told of each failed load with the XDP programs (the agent's ekp_xdp_load_failures_total)
        self.on_xdp_load_failed: Callable[[], None] = _nothing
        # The programs of a load with XDP are handed to the Attacher and not yet on every device
        # (its full reconcile failed): the next attach reconciles in full, then `_finish_reload`.
        self._reattach = False
        # The load `_load_xdp` replaced: its programs may still run on some devices, and the socket
        # attacher and terminator hold its fds (the terminator its stats map) until
        # `_finish_reload` gives them the new load's; closed there (or by `_release`), never by a
        # sync's `_close_retired`, which would leave them holding closed fds.
        self._replaced: DatapathLike | None = None
        # A load with the XDP programs not put in place yet: the watcher did not stop (`_load_xdp`)
        self._unswapped: DatapathLike | None = None
        self._attacher: AttacherLike | None = None
        self._planner: Planner | None = None
        self._unsure = True  # what the maps hold is unknown: read them back before writing
        self._cfg_written: Value | None = None
        self._attached_once = False
        self._after_attach_reached = False  # this first attach reached the start steps' after_attach
        self._attach_began = False  # this first attach may have put a program of ours on a device
        # Whether a sync6 has run since the first attach (`_upgrade.after_first_sync6`)
        self._synced6_attached = False
        self._attached_node: NodeContext | None = None  # the node the attachments were checked for
        self.last_flush = FlushResult()  # what the last sync wrote, for logs and tests
        self._short: dict[str, int] = {}  # map role -> entries wanted, while more than it holds
        self._maglev = MaglevWriter(config.map_sizes.maglev_table_size)
        self._v6 = Ipv6Datapath(config)  # the IPv6 family's maps (`sync6`)
        # The ip6tables rules in place keep their MASQUERADE out of --bpf-snat-ports
        # (agent/metaproxier.py EbpfAndIp6tables): a restore of this run succeeded, or the load kept
        # an earlier run's grant (its rules did). A failed restore changes no rule, so it does not
        # turn this off. Without it sync6 writes ekp_cfg6, the tc IPv6 path's SNAT source, zero
        # (`_snat6_granted`)
        self.masquerade6_apart = False
        # ... and no flow ip6tables masqueraded before that (an upgrade, a switch from iptables
        # mode) holds a reply tuple a tc flow could take: the address it was checked for
        self._snat6_free_for = ""
        # the address whose clean read a failed restore made us re-check (masquerade6_apart_is)
        self._snat6_recheck = ""
        self._conntrack6_failures = 0  # reads of IPv6 nf_conntrack that failed in a row
        self._snat6_refused: str | None = None  # why the last sync6 did not grant ("" granted)
        # Those at the last look, by their tuples (logged when they change; their state changes
        # as they live, which is no news)
        self._snat6_held: frozenset[tuple[Tuple, Tuple]] | None = None
        self._v6_with: DatapathLike | None = None  # the data path whose IPv6 maps it wrote
        # The span of ports the tc IPv6 path's live flows hold outside --bpf-snat-ports (an earlier
        # run's range), which ip6tables' MASQUERADE keeps off too (`snat6_held`); read from
        # ekp_ct6_tcp and ekp_ct6_any for `_held6_of` at its first ask and at each full sync6 until
        # none is left (then never again for that data path: the path translates in --bpf-snat-ports
        # only).
        self._held6: tuple[int, int] | None = None
        self._held6_of: DatapathLike | None = None
        self._held6_clear = False
        # Whether an IPv6 half (`ipv6()`) writes the IPv6 maps; without one `sync` empties them at
        # its first and periodic syncs (an earlier dual-stack agent's entries would still steer the
        # node's IPv6 sockets to addresses that may belong to other pods by now).
        self._v6_served = False
        # The IPv6 node addresses the last sync6 read: with the tc IPv6 path, the devices holding
        # them are external devices too (ekp_from_net6 reverse-translates the replies there).
        self._node_ips6: tuple[str, ...] = ()
        self._node6_known = False  # whether sync6 has told `_follow_node6` the IPv6 node addresses

    # ------------------------------------------------------------------ Proxier

    def prepare(self) -> None:
        """Compile (or reuse) and load the data path before the first desired state exists."""
        self._load()

    def sync(
        self, state: ProxyState, node: NodeContext, changed: frozenset[ServicePortName] | None = None
    ) -> SyncResult:
        """Write what changed; with `changed` None, also read the maps back and repair them."""
        with self._lock:
            start = time.monotonic()
            periodic = changed is None
            self._close_retired()
            datapath = self._maps_open()
            if datapath is not self._synced_with:
                self._unsure = True  # another data path's maps (a load that failed and was redone)
                self._synced_with = datapath
            maps = datapath.maps
            first = self._planner is None
            planner = self._planner or Planner(self._config)
            self._planner = planner
            repaired = 0
            if first or self._unsure or changed is None:
                if changed is None and not first:
                    repaired += len(datapath.repair_pins())
                try:
                    dump = self._dump(maps, first)
                    restored = self._restore(dump, state) if first else None
                    if restored is not None:
                        planner = self._planner = restored
                    else:
                        differ = planner.reconcile(dump, adopt=first)
                        repaired += 0 if first or self._unsure else differ
                except BaseException:
                    if first:
                        # Nothing (or half) adopted: the retry must read the maps back and adopt
                        # them as a first sync does. Kept, this planner would take the next
                        # read-back as entries to replace, and give every port, backend and
                        # reverse-NAT entry a new id: the conntrack entries of established flows
                        # name the old ones, and would lose their backends.
                        self._planner = None
                    raise
                del dump
                changed = None
            planner.update(state, node, changed)
            self._check_room(planner, maps)
            self._unsure = True  # until every write went through
            deferred: Value | None = None
            if planner.cfg is not None and planner.cfg != self._cfg_written:
                cfg = VALUES["cfg"].to_ctype(planner.cfg)
                if cfg.flags & abi.ConfigFlag.HOST_LEGACY and not self._legacy_live():
                    # Legacy host routing only once every egress program is attached (a packet
                    # handed to the stack without its egress half would leave half translated),
                    # and before any ingress program is (_attach): none redirects past FORWARD.
                    deferred = planner.cfg
                    cfg.flags &= ~abi.ConfigFlag.HOST_LEGACY
                write_config(maps, cfg)
                self._cfg_written = VALUES["cfg"].of_ctype(cfg)
            result = planner.flush(cast(Mapping[str, RawMap], maps))
            if not self._v6_served and (first or periodic):
                self._empty_ipv6_maps(datapath, node)
            if "maglev" in maps:
                wanted = planner.maglev_tables() if self._config.bpf_lb_algorithm == "maglev" else {}
                repaired += self._maglev.sync(maps["maglev"], wanted, full=periodic and not first)
            self._unsure = False
            self.last_flush = result

            if self._ensure_loaded() is not datapath:
                # The load failed after its maps were open: the next sync writes the new ones.
                raise RuntimeError(
                    f"the data path's load failed while its maps were written ({self._load_error}): "
                    "loaded again, the next sync writes its maps"
                )
            first_attach = not self._attached_once
            self._after_attach_reached = False
            self._attach_began = False
            try:
                self._attach(datapath, node, periodic=periodic, legacy=deferred)
            except BaseException:
                if first_attach and not self._after_attach_reached:
                    self._abort_start()
                raise
            if self._terminator is not None and (periodic or result.deletes.get("member")):
                self._end_stale_sockets()
            result.log(
                "",
                first=first,
                frontends=len(planner.desired["fe"]),
                backends=len(planner.desired["be"]),
                repaired=repaired,
                ms=(time.monotonic() - start) * 1000,
            )
            return SyncResult(full=changed is None, failed=dict(result.failed), repaired=repaired)

    def sync6(
        self, state: ProxyState, node: NodeContext, changed: frozenset[ServicePortName] | None = None
    ) -> SyncResult:
        """The IPv6 family's state into the IPv6 maps, which the socket programs read (the tc
        programs pass IPv6 to the stack: ip6tables serves its packets, agent/metaproxier.py). Its
        own planner, the same rules as `sync`'s (agent/ebpf/family6.py); the programs are loaded
        and attached by `sync`, which the agent runs first. A backend that left an IPv6 service port
        ends the connected UDP sockets sent to it, as for IPv4 (the iterator walks both families)."""
        with self._lock:
            self._v6_served = True
            self._close_retired()
            datapath = self._maps_open()
            if datapath is not self._v6_with:
                self._v6 = Ipv6Datapath(self._config)  # other maps: read them back, re-adopting
                self._v6_with = datapath
            if changed is None and self._tc_ipv6:
                self._read_held6(datapath)  # ip6tables' next sync narrows back once none is left
            snat = self._snat6_granted(node, datapath.maps)
            first6 = self._attached_once and not self._synced6_attached
            carried: list[bool] = []

            def carry(frontends: Frontends6) -> None:
                carried.append(True)
                self._upgrade.after_first_sync6(datapath.maps, frontends)

            result = self._v6.sync(
                datapath.maps,
                state,
                node,
                changed,
                snat_source=snat,
                before_frontends=carry if first6 else None,
            )
            self._follow_node6(node)
            if self._ensure_loaded() is not datapath:
                # As `sync`: the load failed after these maps were open; the next call writes the new ones.
                raise RuntimeError(
                    f"the data path's load failed while its IPv6 maps were written ({self._load_error}): "
                    "loaded again, the next IPv6 sync writes its maps"
                )
            if first6:
                # The attach's takeover found no IPv6 frontend where only this sync wrote them
                # (a node the agent never served): its IPv6 flows were carried before its ekp_fe6
                # write (`carry`), or now if it wrote none there.
                self._synced6_attached = True
                if not carried:
                    carry6_guarded(lambda: self._upgrade.after_first_sync6(datapath.maps))
            if self._terminator is not None and self._v6.last_flush.deletes.get("member"):
                self._end_stale_sockets()
            return result

    def _snat6_granted(self, node6: NodeContext, maps: Mapping[str, MapWriter]) -> bool:
        """Whether ekp_cfg6 may hold the node's IPv6 address (the tc IPv6 path source-translates):
        the path serves, the ip6tables rules in place keep MASQUERADE out of --bpf-snat-ports (a
        restore of this run succeeded, or the load kept an earlier run's grant over such rules:
        `masquerade6_apart`), ekp_config holds that range and no flow ip6tables masqueraded before can
        collide with a tc flow. Otherwise sync6 writes it zero: new flows that need a source
        translation are left to ip6tables, the flows this path translated keep the source their
        entries hold. Told to `on_snat6_granted` each time; the reason logged when it changes."""
        why = self._snat6_refusal(node6, maps)
        self.on_snat6_granted(0 if why else 1)
        if why != self._snat6_refused:
            if not why:
                log.info("the tc IPv6 path source-translates masqueraded flows to the node's IPv6 address")
            elif self._snat6_refused is not None or self._tc_ipv6:  # off by the flags: no news
                log.info("the tc IPv6 path leaves masqueraded flows to ip6tables: %s", why)
        self._snat6_refused = why
        return not why

    def _snat6_refusal(
        self, node6: NodeContext, maps: Mapping[str, MapWriter], *, restored: bool | None = None
    ) -> str:
        """Why the grant is refused ("" when it is not). `restored`: the outcome of the ip6tables
        restore to judge by (None: the last one, `masquerade6_apart`)."""
        if not self._tc_ipv6:
            return "the path is off (no socket-level load balancing or no IPv6 half)"
        if not (self.masquerade6_apart or restored):
            return (
                "no ip6tables restore has succeeded yet: the MASQUERADE in place may take ports of "
                "--bpf-snat-ports"
            )
        if not self._snat_ports_live():
            return "ekp_config does not hold this run's --bpf-snat-ports yet (the IPv4 sync writes it)"
        source = config6_of(node6).node_addr
        if not any(source):
            return "the node has no usable IPv6 address (global, not temporary, deprecated or tentative)"
        # a preview's read is not remembered: it comes before the restore, which may fail
        return self._snat6_ports_held(abi.ip6_str(source), maps, remember=restored is None)

    @property
    def tc6_serves(self) -> bool:
        return self._tc_ipv6

    def snat6_preview(self, node6: NodeContext) -> bool:
        """Whether the next sync6 grants should the ip6tables restore before it succeed: every other
        reason to refuse (the path, ekp_config's range, the node's address, flows holding ports of
        the range) is known before that restore, so ip6tables can be rendered for the grant the
        maps will leave (agent/metaproxier.py EbpfAndIp6tables). Nothing is written."""
        with self._lock:
            return not self._snat6_refusal(node6, self._maps_open().maps, restored=True)

    @property
    def snat6_granted(self) -> bool:
        """Whether the last sync6 wrote the node's IPv6 address into ekp_cfg6 (`_snat6_granted`)."""
        return self._snat6_refused == ""

    def masquerade6_apart_is(self, apart: bool) -> None:
        """What the last ip6tables restore did (agent/metaproxier.py `masquerade_apart`). A failed
        one changes no rule (ip6tables-restore commits a table whole or not at all; a sync that
        raises before it writes nothing): the rules in place are those of the last that succeeded,
        or the earlier run's the load kept the grant for, and keep MASQUERADE out of the range as
        before. Taking the grant back there would hand the frontends those rules were thinned of to
        a stack with no rule for them until a restore succeeds. What it does forget is that
        nf_conntrack held no flow in the range: whatever made the restore fail (another writer of
        the table among them) may have let one in, so each sync6 reads it again until one succeeds."""
        with self._lock:
            if apart:
                self.masquerade6_apart = True
            else:
                self._snat6_recheck = self._snat6_free_for or self._snat6_recheck
                self._snat6_free_for = ""

    def _snat_ports_live(self) -> bool:
        """Whether ekp_config's SNAT range (which the tc IPv6 path's port walk reads too) is this
        run's --bpf-snat-ports, which ip6tables' MASQUERADE keeps out of: until the IPv4 sync wrote
        it (a sync that failed before, a first one yet to run), it may be an earlier run's range,
        which the rule in place may cover."""
        if self._cfg_written is None:
            return False
        live = VALUES["cfg"].to_ctype(self._cfg_written)
        return (live.snat_port_min, live.snat_port_max) == self._config.snat_ports

    def snat6_held(self) -> tuple[int, int] | None:
        """The lowest and highest port the tc IPv6 path's live flows hold outside --bpf-snat-ports,
        None when none does (agent/iptables/rules.py `masquerade_ports_beside`, asked by ip6tables at
        each sync): a restart that changed the range leaves the flows the earlier run translated in
        ekp_ct6_tcp and ekp_ct6_any, their replies taken by their REPLY entries, unknown to
        nf_conntrack; a MASQUERADE range over their ports could give a new flow to the same backend
        the same reply tuple. Read at the first ask, then by each full sync6 until none is left."""
        if not self._tc_ipv6:
            return None
        with self._lock:
            datapath = self._maps_open()
            if datapath is not self._held6_of:
                self._read_held6(datapath)
            return self._held6

    def _read_held6(self, datapath: DatapathLike) -> None:
        """`_held6` from `datapath`'s IPv6 conntrack (under the lock); logged when it changes."""
        if datapath is self._held6_of and self._held6_clear:
            return
        maps = datapath.maps
        # both tables: the path source-translates TCP and UDP (SCTP goes to ip6tables)
        entries = [kv for role in abi.CT6_ROLES if role in maps for kv in maps[role].items()]
        held = held_outside(entries, self._config.snat_ports, read_config(maps), time.monotonic_ns())
        if held != self._held6:
            if held is not None:
                log.warning(
                    "the tc IPv6 path's flows hold source ports %d-%d outside --bpf-snat-ports %d-%d (an "
                    "earlier run's range): ip6tables' MASQUERADE keeps off them too until they end",
                    *held,
                    *self._config.snat_ports,
                )
            else:
                log.info(
                    "no flow of the tc IPv6 path holds a port outside --bpf-snat-ports any more: "
                    "ip6tables' MASQUERADE takes the ports beside the range again"
                )
        self._held6, self._held6_of, self._held6_clear = held, datapath, held is None

    def _snat6_ports_held(self, source: str, maps: Mapping[str, MapWriter], *, remember: bool = True) -> str:
        """Why the grant waits for nf_conntrack ("" when it does not): a TCP or UDP flow ip6tables
        masqueraded to `source` (the node's IPv6 SNAT address) holds a port of --bpf-snat-ports:
        such a flow's reply tuple {backend, source, port} is one the tc path's port walk could give
        a flow to the same backend, whose replies would then reach the other client. Only those
        count: a flow masqueraded to another address or port never collides, so one long-lived
        connection elsewhere does not keep the path's SNAT off. IPv6 nf_conntrack is read at each
        sync6 until none does, then not again for that address (the rule keeps new ones out; a
        failed restore forgets it). Where they stay, a warning names them and the
        `ekp_ipv6_snat_held_flows` gauge counts them: ending them (conntrack -D) grants at the
        next sync; or the read failed. A UDP flow carried into ekp_ct6_any at the start
        (agent/takeover/into_ebpf.py `_carry6`) does not count while its REPLY entry is there: tc
        translates its datagrams both ways from that entry and the port walk sees its reply tuple,
        while its nf_conntrack entry, which netfilter no longer refreshes, would otherwise hold the
        grant back for its whole timeout. Left there rather than deleted: an agent that stops or
        falls back before it expires hands the flow back to ip6tables' NAT binding. `remember`
        False (a preview, before the restore): none holding a port is not remembered."""
        if self._snat6_free_for == source:
            return ""
        ports = self._config.snat_ports
        try:
            held = [
                f
                for f in masqueraded_into(self._conntrack6_reader(self._config.netns), ports, source)
                if not _carried6(maps, f)
            ]
        except Exception as exc:  # pyroute2's decoders raise more than OSError
            # Whatever the dump raised, the IPv6 maps are still written: only the grant waits.
            self._conntrack6_failures += 1
            if self._snat6_recheck == source and self._snat6_refused == "":
                # Re-read only because a restore failed: the rules in place are still the ones
                # thinned for this grant, so taking it back on a read that proves nothing would
                # leave their masqueraded frontends with no rule (as at the load, a failed read keeps
                # a grant the rules were made for).
                log.warning(
                    "cannot read IPv6 nf_conntrack (%s: %s; %d time(s) in a row): the IPv6 SNAT grant "
                    "stands (a restore failed, so the ip6tables rules in place are still those made for "
                    "it) and the next IPv6 sync reads it again",
                    type(exc).__name__,
                    exc,
                    self._conntrack6_failures,
                )
                return ""
            log.warning(
                "cannot read IPv6 nf_conntrack (%s: %s; %d time(s) in a row): the tc IPv6 path leaves "
                "source translations to ip6tables and the next IPv6 sync reads it again",
                type(exc).__name__,
                exc,
                self._conntrack6_failures,
            )
            return f"IPv6 nf_conntrack could not be read ({type(exc).__name__})"
        self._conntrack6_failures = 0
        self._snat6_recheck = ""
        self.on_snat6_held(len(held))
        if not held:
            if not remember:
                return ""
            self._snat6_free_for = source
            if self._snat6_held:
                log.info(
                    "no IPv6 flow masqueraded by ip6tables holds a port of --bpf-snat-ports any more: "
                    "the tc IPv6 path source-translates from now on"
                )
            self._snat6_held = frozenset()
            return ""
        tuples = frozenset((f.orig, f.reply) for f in held)
        if tuples != self._snat6_held:
            log.warning(
                "%d IPv6 TCP and UDP flows ip6tables masqueraded to %s before its rule kept out of "
                "--bpf-snat-ports %d-%d hold ports of that range (%s%s): the tc IPv6 path leaves source "
                "translations to ip6tables until they end (or are deleted: conntrack -D -f ipv6)",
                len(held),
                source,
                *ports,
                "; ".join(f.describe() for f in held[:NAMED_FLOWS]),
                f"; {len(held) - NAMED_FLOWS} more" if len(held) > NAMED_FLOWS else "",
            )
        self._snat6_held = tuples
        return (
            f"{len(held)} flows ip6tables masqueraded hold ports of --bpf-snat-ports (the warning names them)"
        )

    def _follow_node6(self, node6: NodeContext) -> None:
        """With the tc IPv6 path, a device that holds an IPv6 node address and no IPv4 one (no
        --devices) is an external device as well: without ekp_from_net there, the replies of the
        IPv6 flows translated here come back untranslated. Attached once sync has attached."""
        if not self._tc_ipv6:
            return
        known = self._node6_known
        self._node6_known = True
        if known and node6.node_ips == self._node_ips6:
            return
        self._node_ips6 = node6.node_ips
        if self._attacher is not None and self._attached_node is not None:
            node = self._devices_node(self._attached_node)
            self._attacher.reconcile(node)
            self._attached_node = node

    def _devices_node(self, node: NodeContext) -> NodeContext:
        """`node` as the attacher finds the external devices by: where the tc IPv6 path serves,
        its IPv4 node addresses and the IPv6 ones the last sync6 read (`_follow_node6`), none
        other: an IPv6 address sync6 no longer reads (`node` may be the last merge) releases its
        device at that sync6, not at the next IPv4 one."""
        if not self._tc_ipv6:
            return node
        ips4 = (ip for ip in node.node_ips if ":" not in ip)
        return replace(node, node_ips=(*ips4, *self._node_ips6))

    def ipv6(self) -> EbpfIpv6:
        """This data path's IPv6 half, as a Proxier of the IPv6 family (agent/metaproxier.py)."""
        self._v6_served = True
        return EbpfIpv6(self)

    def _empty_ipv6_maps(self, datapath: DatapathLike, node: NodeContext) -> None:
        """No IPv6 half: the IPv6 service maps planned empty (read back, what they hold deleted;
        nothing written when they hold nothing), and the socket entries and affinities the socket
        programs left there dropped with them (under the lock)."""
        if datapath is not self._v6_with:
            self._v6 = Ipv6Datapath(self._config)
            self._v6_with = datapath
        maps = datapath.maps
        self._v6.sync(
            maps, ProxyState(NodeInfo(self._config.hostname), {}, {}, family=IPFamily.IPv6), node, None
        )
        removed = self._v6.last_flush.deletes
        if sum(removed.values()):
            dropped = 0
            for role in ("aff6", "sknat6"):
                keys = [k for k, _ in maps[role].items_raw()]
                maps[role].delete_raw(keys)
                dropped += len(keys)
            log.warning(
                "IPv6 is not served by this agent: removed the IPv6 service entries an earlier agent "
                "left in the eBPF maps (%s; %d socket and affinity entries), so the node's IPv6 "
                "sockets are no longer sent to their old backends",
                ", ".join(f"{n} {r}" for r, n in sorted(removed.items()) if n),
                dropped,
            )

    def cleanup(self) -> None:
        """Detach our filters, remove our pins and the pin directory; nothing else."""
        with self._lock:
            self._stop_watcher()
            self._release()
            detached = detach_all(self._config.netns)
            if detached:
                log.info("detached from %s", ",".join(sorted(detached)))
            hooks = self._socket_detach(self._config.pin_path)
            if hooks:
                log.info("detached the socket programs (%s)", ",".join(hooks))
            removed = remove_pins(self._config.pin_path)
            if removed:
                log.info("removed pins %s", ",".join(removed))
            if self._snapshot:
                keptfile.remove(self._snapshot)
                keptfile.remove(self._records_file)
            out_of_ebpf.forget_handback(self._handback_dir, self._config.pin_path)
            # No takeover follows to put back what one killed mid-attach left
            into_ebpf.put_back_liberal(
                self._config,
                self._handback_dir,
                read_sysctl=self._sysctl_reader,
                write_sysctl=self._sysctl_writer,
            )

    # ------------------------------------------------------------------ keep in place

    def close(self) -> None:
        """Stop the watcher and drop our references; programs and maps stay as they are, and the
        planner is left for the next start when the maps hold what it desired."""
        with self._lock:
            self._keep_planner()
            self._stop_watcher()
            self._release()
            try:  # a first attach that never completed left tcp_be_liberal to its retry: none comes
                self._upgrade.close()
            except Exception as exc:
                log.error("the start steps could not put back what they set on the node: %r", exc)

    def contents(self) -> MapContents | None:
        """What the service maps should hold now, decoded (None before the first sync)."""
        if self._planner is None:
            return None
        return planner_contents(self._planner)

    # ------------------------------------------------------------------ internals

    def _ensure_loaded(self) -> DatapathLike:
        """The loaded data path: loaded now, or by prepare() (waited for)."""
        self._load()
        assert self._datapath is not None
        return self._datapath

    def _maps_open(self) -> DatapathLike:
        """The data path whose maps are open: loaded, or still loading its programs in prepare()
        (waited for until its maps are open), or loaded now when nothing loads it."""
        with self._load_cond:
            while self._loading and self._opened is None:
                self._load_cond.wait()
            if self._opened is not None:
                return self._opened
        return self._ensure_loaded()

    def _load(self) -> None:
        """Load the data path unless it is loaded; when another thread loads it, wait for that
        (its error is its own: this thread then tries once more)."""
        with self._load_cond:
            while self._loading:
                self._load_cond.wait()
            if self._datapath is not None:
                return
            self._loading = True
            self._opened = None
        try:
            pin_path = self._config.pin_path
            self._check_snat_ports()
            self._set_sysctls()
            sizes = self._config.map_sizes.with_conntrack(
                self._config.conntrack, os.cpu_count() or 1, self._sizes_reader(pin_path)
            )
            # From the settings and whether an IPv6 half will run (both known before main's early
            # load), never from whether it exists yet: this load may run before the IPv6 half is
            # made or after it, and a restart must build the same programs and table sizes.
            sizes = replace(sizes, ipv6_tc=self._tc_ipv6, xdp=self._loads_xdp())
            datapath = self._datapath_factory(pin_path, sizes)
            self._sizes = sizes

            def maps_ready() -> None:
                # Before any sync or attach uses these maps: ekp_cfg6 is pinned, and the address an
                # earlier run wrote there was granted against its ip6tables rules and its
                # --bpf-snat-ports. Where both still hold, it stays: that run's ip6tables holds no
                # rule for the frontends the grant lets tc masquerade, so zeroing it would hand them
                # to a stack with no rule for them until this run's first IPv6 restore. Else it is
                # zeroed: the programs attached meanwhile (that run's) leave new source
                # translations to ip6tables (whose rules for them are there: it was not granted, or
                # its rules were rendered for that) until sync6 grants again.
                kept = self._pinned_grant6(datapath.maps)
                if kept:
                    self.masquerade6_apart = True
                    log.info(
                        "IPv6 SNAT source of the tc programs kept at %s %s: the node's primary IPv6 "
                        "address, --bpf-snat-ports and ip6tables' MASQUERADE are those the earlier run "
                        "granted it for",
                        kept,
                        "until the first IPv6 sync"
                        if self._tc_ipv6
                        else "until the first sync empties the IPv6 maps (this run's tc IPv6 path is off)",
                    )
                elif write_config6(datapath.maps, abi.Config6()):
                    log.info(
                        "IPv6 SNAT source of the tc programs reset to none until ip6tables is restored "
                        "and no flow it masqueraded holds a port of --bpf-snat-ports"
                    )
                with self._load_cond:
                    self._opened = datapath
                    self._load_cond.notify_all()

            datapath.load(maps_ready)
        except BaseException as exc:
            with self._load_cond:
                self._load_error = f"{type(exc).__name__}: {exc}"
                if self._opened is not None:  # this load's: a sync may be writing its maps
                    self._retired.append(self._opened)
                self._loading = False
                self._opened = None
                self._load_cond.notify_all()
            raise
        with self._load_cond:
            self._datapath = self._opened = datapath
            self._loading = False
            self._load_cond.notify_all()

    def _loads_xdp(self) -> bool:
        """Whether this load takes the XDP programs (MapSizes.xdp): not with --bpf-xdp=disabled,
        nor with best-effort where every external device is a veth (it attaches none there: their
        verification, 0.15 s of CPU for IPv4's and 0.25 s for IPv6's, would buy nothing; a device
        it would try that appears later loads them then, `_load_xdp`). A restart where such a
        device is external loads them at once, so it reuses what an earlier run's `_load_xdp`
        pinned. Devices that cannot be read, or none found, count as one that takes XDP
        (agent.ebpf.xdp.start_loads_programs, `agent doctor`'s rule too)."""
        loads, why = start_loads_programs(self._config, self._tc_ipv6, self._xdp_devices_reader)
        if why:
            log.info("%s", why)
        return loads

    def _pinned_grant6(self, maps: Mapping[str, MapWriter]) -> str:
        """The address in the pinned ekp_cfg6 when the grant an earlier run gave with it still holds
        for this one ("" when not): ekp_config's SNAT range (that run's --bpf-snat-ports, which its
        ip6tables' MASQUERADE kept out of) is this run's, the address is the node's primary IPv6
        one now, the IPv6 nat rules in place are eBPF mode's for that range (`masquerade6_reader`),
        and no flow ip6tables masqueraded to it holds a port of the range (those exist
        only where the rules in place masquerade into it: not thinned, so zeroing is safe there).
        Whatever this run's tc IPv6 path: that run's programs stay attached until this run's
        replace them. The first sync6 decides again, after the first IPv6 restore (which writes
        every port's rules); with the path off there is none: the first sync empties the IPv6 maps,
        ekp_cfg6 with them (`_empty_ipv6_maps`; README "IPv6 and dual-stack" names the window)."""
        if self._node6_reader is None or self._masquerade6_reader is None:
            return ""
        pinned, cfg = read_config6(maps), read_config(maps)
        if pinned is None or not any(pinned.node_addr) or cfg is None:
            return ""
        cfg_range = (cfg.snat_port_min, cfg.snat_port_max)
        if cfg_range != self._config.snat_ports:
            return ""
        try:
            now = config6_of(self._node6_reader()).node_addr
        except Exception as exc:  # whatever the address read raised, the load goes on, ungranted
            log.warning(
                "cannot read the node's IPv6 addresses at the load (%s): the IPv6 SNAT grant is reset", exc
            )
            return ""
        if bytes(now) != bytes(pinned.node_addr):
            return ""
        source = abi.ip6_str(pinned.node_addr)
        # The rules themselves, not only the maps: an iptables-mode agent whose hand-back did not
        # remove the pins, or kube-proxy installed over a stopped agent, left a MASQUERADE over
        # every port beside them. Those rules are full (no port thinned for a grant), so zeroing
        # hands tc's frontends to rules that serve them; a read that fails cannot tell the shape,
        # and a kept grant over full rules gives two flows one reply tuple, which no restore
        # repairs, while a wrongly zeroed one leaves thinned ports dark until this run's first
        # IPv6 restore writes every port.
        try:
            apart = self._masquerade6_reader()
        except Exception as exc:  # whatever ip6tables-save or its parse raised: not known, not kept
            log.warning(
                "cannot read ip6tables' nat table at the load (%s: %s): the IPv6 SNAT grant is reset "
                "until an IPv6 restore succeeds",
                type(exc).__name__,
                exc,
            )
            return ""
        if not apart:
            log.info(
                "IPv6 SNAT grant of the earlier run reset: ip6tables' KUBE-POSTROUTING MASQUERADE in "
                "place does not keep TCP and UDP out of --bpf-snat-ports %d-%d (iptables mode or "
                "kube-proxy wrote it)",
                *cfg_range,
            )
            return ""
        try:
            held = [
                f
                for f in masqueraded_into(self._conntrack6_reader(self._config.netns), cfg_range, source)
                if not _carried6(maps, f)
            ]
        except Exception as exc:  # pyroute2's decoders raise more than OSError
            # Kept: that run read none at its grant and its rules kept new ones out since; the first
            # sync6 reads again and refuses then.
            log.warning(
                "cannot read IPv6 nf_conntrack at the load (%s: %s): the IPv6 SNAT grant is kept "
                "until the first IPv6 sync reads it again",
                type(exc).__name__,
                exc,
            )
            return source
        if held:
            log.info(
                "IPv6 SNAT grant of the earlier run reset: %d flow(s) ip6tables masqueraded to %s hold "
                "ports of --bpf-snat-ports (%s)",
                len(held),
                source,
                held[0].describe(),
            )
            return ""
        return source

    def _legacy_live(self) -> bool:
        """Legacy host routing is on in the maps, and so every device with our ingress program has
        its egress program: we attached them, or the agent before us did (its config says legacy)."""
        if self._cfg_written is None:
            return False
        live = VALUES["cfg"].to_ctype(self._cfg_written)
        return bool(live.flags & abi.ConfigFlag.HOST_LEGACY)

    def _check_room(self, planner: Planner, maps: Mapping[str, MapWriter]) -> None:
        """An error naming the flag when the desired state has more entries than a map holds
        (logged when it starts, and when it grows; the writer programs what fits, port by port)."""
        for role in ROLES:
            wanted, room = len(planner.desired[role]), maps[role].capacity()
            if wanted <= room:
                if self._short.pop(role, None) is not None:
                    log.info("BPF map %s holds the desired state again", abi.MAPS[role].name)
                continue
            if wanted > self._short.get(role, 0):
                spec = abi.MAPS[role]
                log.error(
                    "BPF map %s is too small: the desired state needs %d entries, it holds %d. Service "
                    "ports that do not fit are not programmed (every other one is). Start the agent with "
                    "%s=%d or more; a new size recreates the map, so run `agent --cleanup` first "
                    "(this drops its conntrack state)",
                    spec.name,
                    wanted,
                    room,
                    spec.size_flag,
                    _room_for(wanted),
                )
                self._short[role] = wanted

    def _check_snat_ports(self) -> None:
        """FatalError when --bpf-snat-ports overlaps the NodePorts or the node's local ports."""
        netns = self._config.netns
        text = self._sysctl_reader(netns, LOCAL_PORT_RANGE)
        try:
            local = parse_port_range(text)
        except ValueError as exc:
            raise FatalError(
                f"cannot read net.ipv4.ip_local_port_range in netns {netns or '(own)'}: {text!r}"
            ) from exc
        problem = snat_ports_problem(self._config.snat_ports, self._config.nodeport_range, local, netns)
        if problem:
            raise FatalError(problem)

    def _dump(self, maps: Mapping[str, MapWriter], first: bool) -> dict[str, tuple[bytes, bytes]]:
        """Every service map's entries, read in batches, as raw bytes (decoded by the planner)."""
        dump = {role: maps[role].dump_raw() for role in ROLES if role in maps}
        if first:
            live = read_config(maps)
            self._cfg_written = VALUES["cfg"].of_ctype(live) if live is not None else None
        return dump

    def _restore(self, dump: Mapping[str, tuple[bytes, bytes]], state: ProxyState) -> Planner | None:
        """The last run's planner when the maps (`dump`) hold exactly what it desired; one log line
        either way, saying what the start does with the maps it found."""
        counts = [len(dump[r][0]) // KEYS[r].size if r in dump else 0 for r in ("fe", "slot", "be", "rnat")]
        found = "pinned maps hold {} frontends, {} slots, {} backends, {} reverse-NAT entries".format(*counts)
        planner, why = (
            snapshot.take(self._snapshot, dump, self._snapshot_identity, self._config, state)
            if self._snapshot
            else (None, "")
        )
        if planner is not None:
            log.info(
                "%s: took the last run's planner from %s, as they hold exactly what it wrote; "
                "only what changed while the agent was down is planned",
                found,
                self._snapshot,
            )
        elif why:
            log.info(
                "%s: re-adopting their ids (the last run's planner in %s is not used: %s)",
                found,
                self._snapshot,
                why,
            )
        else:
            log.info("%s: re-adopting their ids", found)
        return planner

    def _keep_planner(self) -> None:
        """At a clean stop: the planner saved for the next start (agent.ebpf.snapshot) when the
        maps hold what it desired; never fatal (the next start reads the maps back instead)."""
        planner, datapath = self._planner, self._synced_with
        if not self._snapshot or planner is None or datapath is None or self._unsure:
            return
        try:
            dump = self._dump(datapath.maps, False)
            why = snapshot.save(self._snapshot, planner, dump, self._snapshot_identity)
        except Exception as exc:
            log.warning("could not save the planner for the next start in %s: %s", self._snapshot, exc)
            return
        if why:
            log.info("the planner is not saved for the next start: %s", why)

    def _attach(
        self, datapath: DatapathLike, node: NodeContext, *, periodic: bool, legacy: Value | None
    ) -> None:
        """Keep the programs attached. The first sync attaches everywhere (replacing an older
        agent's programs, carrying an older ABI's conntrack over around it); after that, pod
        devices are the watcher's and the attachments are checked only by full syncs (every sync
        period, or when the node's addresses changed), so a one-endpoint change costs no netlink
        round trip into the node's namespace.

        `legacy`: the config with legacy host routing, not live yet. ekp_egress goes on every
        device first, then the config, then the ingress programs: from the first packet an
        ingress program sees, it hands translated packets to the stack (FORWARD, rp_filter), and
        each leaves by a device whose egress program gives it its source."""
        first = not self._attached_once
        full = first
        node = self._devices_node(node)
        handover = first and self._upgrade.hands_over
        if first:
            self._upgrade.before_attach(datapath.maps)
            activity.disarm(datapath.maps["act"])  # until every flow has its stamps (activity.py)
        if self._attacher is None:
            self._attacher = self._attacher_factory(
                self._config, _attach_fds(datapath), datapath.maps["port"]
            )
            full = True
        full = full or self._reattach
        mode = HandoverMode.OFF
        if handover:
            pinned, state = datapath.handover_mode(), self._attacher.handover_state()
            mode = handover_start(pinned, state)
            if pinned != HandoverMode.OFF or state.own_front or state.other_front:
                log.warning(
                    "resuming a hand-over from the older programs that an earlier start cut short "
                    "(this build's mode was %s, now %s; %s in front)",
                    pinned.name,
                    mode.name,
                    "this build" if state.own_front else "another build" if state.other_front else "none",
                )
        if first:
            # Set at every first attach: a reused build keeps the mode a hand-over cut short left.
            datapath.set_handover(mode)
        if first:
            self._attach_began = True  # from here a failure may leave programs on some devices
        if legacy is not None:
            self._attacher.attach_egress(node)
            write_config(datapath.maps, VALUES["cfg"].to_ctype(legacy))
            self._cfg_written = legacy
        restart = self._attached_once and not self._attacher.watching
        if restart:
            log.warning("the pod-device watcher had stopped: restarting it and checking every device")
            self._attacher.start_watcher()
        verify = restart or periodic
        if full or verify or node != self._attached_node:
            # Before the first IPv6 sync `node` lacks the IPv6 node addresses: a device holding
            # only one of them keeps its ekp_from_net, or the replies of the tc IPv6 path's live
            # flows would leave untranslated until sync6 ran (`_follow_node6`).
            keep = self._tc_ipv6 and not self._node6_known
            self._attacher.reconcile(
                node, full=full, verify=verify and not full, keep_external=keep, front=handover
            )
            self._attached_node = node
        if mode == HandoverMode.PASS:
            # In front on every device: from here on, new flows are ours and what our conntrack
            # misses is the older generation's to decide (a flow it translated, carried below).
            datapath.set_handover(HandoverMode.MISS)
            mode = HandoverMode.MISS
            log.info(
                "hand-over: this build's programs take new flows, the older ones theirs until carried over"
            )
        if first:
            # Right after the tc programs changed: flows the old programs made meanwhile are
            # carried over before anything else delays it.
            self._after_attach_reached = True  # it puts back what before_attach set, whatever stops it
            self._upgrade.after_attach(datapath.maps)
        if mode != HandoverMode.OFF:
            # Every flow of the older generation's is in our conntrack now (or left behind: its
            # backend or frontend gone): our programs decide alone, then take its priority.
            datapath.set_handover(HandoverMode.OFF)
        if self._attacher.fronts:
            # Every sync until done: a rehome that failed (not ENODEV) is finished by the next one.
            self._attacher.rehome()
        if first:
            activity.arm(datapath.maps)  # only our programs run now: stamp what the tables hold
            released = datapath.release_older_builds()
            if released:
                log.info(
                    "unpinned the program arrays of another load, its programs detached: %s",
                    ", ".join(released),
                )
            stale = remove_stale_pins(self._config.pin_path)
            if stale:
                log.info("removed pins of other ABI versions: %s", ",".join(stale))
        if first or (periodic and not self._reattach):
            # Not while a reload is unfinished: the socket attacher still holds the replaced load's
            # fds, and `_finish_reload` below gives it the new load's first.
            self._attach_sockets(datapath, first=first)
        if first:
            self._upgrade.serving()
            self._attacher.start_watcher()
            self._attached_once = True
            # our programs on every device: a hand-back's partial detach these pins saw is undone
            out_of_ebpf.forget_handback(self._handback_dir, self._config.pin_path)
            self._synced6_attached = False
        elif self._reattach:
            self._finish_reload(datapath)  # the reconcile above put its programs everywhere
        assert self._sizes is not None
        if self._attacher.xdp_wanted and not self._sizes.xdp and self._xdp_due(periodic):
            self._load_xdp(datapath, node)

    def _xdp_due(self, periodic: bool) -> bool:
        """Whether this sync may load the data path with the XDP programs: the first try at once,
        after a failure only a periodic sync once the backoff has passed."""
        if self._unswapped is not None:
            return True  # loaded already: only its swap is left, which costs no verifier
        return not self._xdp_failures or (periodic and self._clock() >= self._xdp_retry_at)

    def _load_xdp(self, datapath: DatapathLike, node: NodeContext) -> None:
        """The data path loaded again with the XDP programs (another load id of the same build: the
        programs from the compile cache, the pinned maps shared), its programs put on every device
        in place of `datapath`'s, tc's and the socket programs' replaced in place (no moment
        without one, as a restart with other sizes does), and XDP tried on the external devices:
        an external device best-effort would try appeared (Attacher.xdp_wanted). Until it is done
        `datapath`'s tc programs serve; a load that fails leaves them serving, said as an error and
        counted (`on_xdp_load_failed`), and is tried again by a periodic sync after a backoff."""
        assert self._attacher is not None and self._sizes is not None
        names = ", ".join(sorted(self._attacher.xdp_wanted.values()))
        sizes = replace(self._sizes, xdp=True)
        attacher = self._attacher
        # loaded by an earlier sync, whose watcher did not stop in time, else now
        loaded, self._unswapped = self._unswapped, None
        if loaded is None:
            log.info(
                "%s is external and no veth, bridge nor vxlan (--bpf-xdp=best-effort tries native XDP "
                "there): loading the data path again with %s; the tc programs serve meanwhile",
                names,
                PROG_XDP,
            )
            loaded = self._load_with_xdp(sizes, names)
            if loaded is None:
                return
            self._xdp_failures = 0  # loaded: a swap put off below is no failure to back off from
        if not attacher.stop_watcher():
            # Still attaching a pod device with `datapath`'s programs: swapped under it, that
            # attach could put the older program back after the full reconcile. Kept loaded for
            # the next sync (its restart check starts a watcher again once this one ended).
            self._unswapped = loaded
            log.warning(
                "the data path loaded with %s is put in place by the next sync: the pod-device "
                "watcher is still in an attach",
                PROG_XDP,
            )
            return
        self._xdp_failures = 0
        self._sizes = sizes
        with self._load_cond:
            self._replaced = datapath  # closed by `_finish_reload`: its programs may still serve
            self._datapath = self._opened = loaded
        # The same pinned maps, which the planners wrote: the next syncs need not read them back,
        # and a stop before the next sync saves the planner from the load that stays open.
        if self._synced_with is datapath:
            self._synced_with = loaded
        if self._v6_with is datapath:
            self._v6_with = loaded
        if self._held6_of is datapath:
            self._held6_of = loaded
        self._reattach = True
        try:
            attacher.use_programs(_attach_fds(loaded), loaded.maps["port"])
            attacher.reconcile(node, full=True, keep_external=self._tc_ipv6 and not self._node6_known)
            self._attached_node = node
        finally:
            attacher.start_watcher()
        self._finish_reload(loaded)

    def _load_with_xdp(self, sizes: MapSizes, names: str) -> DatapathLike | None:
        """The data path loaded with the XDP programs, or None when that failed (said, counted,
        and the next try put off)."""
        loaded = self._datapath_factory(self._config.pin_path, sizes)
        try:
            # No compile when the cached object does not load: it loaded the tc programs already,
            # so what fails is the load (the verifier, memlock, ENOSPC), which a compile of tens of
            # seconds under the lock would not mend.
            loaded.load(recompile=False)
            # A reused load keeps the mode a hand-over cut short left in its pin: none runs now.
            loaded.set_handover(HandoverMode.OFF)
        except Exception as exc:
            loaded.close()
            self._xdp_failures += 1
            # the exponent capped: 2 ** 1024 (42 days of hourly failures) overflows a float
            wait = min(XDP_RETRY_FIRST * 2 ** min(self._xdp_failures - 1, 16), XDP_RETRY_MAX)
            self._xdp_retry_at = self._clock() + wait
            self.on_xdp_load_failed()
            log.error(
                "loading %s for %s failed (%s, %d time(s) in a row): the tc programs serve all of its "
                "traffic; tried again by the first periodic sync after %.0fs (ekp_xdp_load_failures_total)",
                PROG_XDP,
                names,
                f"{type(exc).__name__}: {exc}",
                self._xdp_failures,
                wait,
            )
            return None
        return loaded

    def _finish_reload(self, datapath: DatapathLike) -> None:
        """After `_load_xdp`'s programs are on every device: the socket programs' links get them
        too (the terminator its iterator), the last load's program arrays are unpinned, and its fds
        closed (nothing holds them any more)."""
        if self._terminator is not None:
            self._terminator.close()
            self._terminator = None
        self._socket_attacher = None
        self._attach_sockets(datapath, first=False)
        released = datapath.release_older_builds()
        self._reattach = False
        self._close_replaced()
        log.info(
            "data path loaded again with %s, on every device now%s",
            PROG_XDP,
            f"; unpinned the program arrays of the load before: {', '.join(released)}" if released else "",
        )

    def _abort_start(self) -> None:
        """The first attach stopped before after_attach: the start steps put back what they set
        for it (tcp_be_liberal); their own failure said, the attach's error the one raised."""
        try:
            self._upgrade.abort(attached=self._attach_began)
        except Exception as exc:
            log.error("the start steps could not undo what they set before the failed attach: %r", exc)

    def _attach_sockets(self, datapath: DatapathLike, *, first: bool) -> None:
        """The socket programs: their settings written, then linked to the cgroup (first sync: a
        restarted agent swaps its build into the links it finds; periodic syncs: put back what
        was removed behind our back). Off (--bpf-socket-lb=false): links of an earlier run removed."""
        names = [name for name, _ in SOCK_HOOKS.values()]
        serving = self._config.socket_lb and all(datapath.has_program(n) for n in names)
        if not serving:
            if first:
                if self._config.socket_lb:
                    log.error(
                        "this kernel cannot load the socket programs (they need Linux 5.18): clients "
                        "on the node's own network (host-network pods, node processes) reach no "
                        "Service; --bpf-socket-lb=false says that is intended"
                    )
                hooks = self._socket_detach(self._config.pin_path)
                if hooks:
                    log.info("detached the socket programs of an earlier run (%s)", ",".join(hooks))
            return
        if self._socket_attacher is None:
            fds = {name: datapath.prog_fd(name) for name, _ in SOCK_HOOKS.values()}
            self._socket_attacher = self._socket_attacher_factory(self._config, fds)
            cookie = self._netns_cookie_reader(self._config.netns)
            datapath.maps["skcfg"].update(
                ctypes.c_uint32(0), sock_config(cookie, self._config.socket_lb_host_only)
            )
            stats = datapath.maps["stats"]
            if datapath.has_program(PROG_SOCK_TERM):
                self._terminator = self._terminator_factory(
                    self._config,
                    self._socket_attacher.cgroup,
                    datapath.prog_fd(PROG_SOCK_TERM),
                    lambda: read_stats(stats)[Stat.SOCK_DESTROYED],
                )
            else:
                log.warning(
                    "this kernel has no bpf_sock_destroy (Linux 6.5): a node's connected UDP socket "
                    "(a resolver's) stays on its backend after that backend leaves its Service, until "
                    "the application opens a new one"
                )
        self._socket_attacher.reconcile()

    def _end_stale_sockets(self) -> None:
        assert self._terminator is not None
        try:
            self._terminator.run()
        except OSError as exc:
            # The sockets stay on their backend until the next try: a sync is not failed for it.
            log.warning("could not end the UDP sockets of backends that left: %s", exc)

    def _close_retired(self) -> None:
        """Close the data paths whose load failed after their maps were open (under the lock)."""
        with self._load_cond:
            retired, self._retired = self._retired, []
        for datapath in retired:
            datapath.close()

    def _close_replaced(self) -> None:
        with self._load_cond:
            replaced, self._replaced = self._replaced, None
        if replaced is not None:
            replaced.close()

    def _close_unswapped(self) -> None:
        unswapped, self._unswapped = self._unswapped, None
        if unswapped is not None:
            unswapped.close()

    def _release(self) -> None:
        self._maglev.forget()
        if self._terminator is not None:
            self._terminator.close()
            self._terminator = None
        self._socket_attacher = None
        self._close_replaced()
        self._close_unswapped()
        with self._load_cond:
            while self._loading:  # a load under way finishes first (its fds are ours to close)
                self._load_cond.wait()
            if self._datapath is not None:
                self._datapath.close()
            self._datapath = self._opened = self._synced_with = None
        self._close_retired()
        self._planner = None
        self._unsure = True

    def _stop_watcher(self) -> None:
        if self._attacher is not None:
            self._attacher.stop_watcher()
            self._attacher = None
        self._attached_once = False
        self._reattach = False

    def _set_sysctls(self) -> None:
        where = self._config.netns or "(own)"
        for path, (value, why) in SYSCTLS.items():
            old = self._sysctl_writer(self._config.netns, path, value)
            if old is not None and old != value:
                log.info(
                    "set sysctl %s=%s in netns %s (needed for %s; was %s)",
                    _dotted(path),
                    value,
                    where,
                    why,
                    old,
                )


class EbpfIpv6:
    """The IPv6 family's Proxier on an EbpfProxier: its maps only (`EbpfProxier.sync6`). The IPv4
    proxier prepares, loads, attaches and cleans up the data path both families share."""

    def __init__(self, ebpf: EbpfProxier) -> None:
        self._ebpf = ebpf

    def prepare(self) -> None:
        """Nothing: the IPv4 proxier loads the data path."""

    def masquerade_apart(self, apart: bool) -> None:
        self._ebpf.masquerade6_apart_is(apart)

    @property
    def tc_serves(self) -> bool:
        """Whether the tc programs' IPv6 path serves (Config.tc_ipv6 and this node's IPv6 half)."""
        return self._ebpf.tc6_serves

    @property
    def snat_granted(self) -> bool:
        """Whether the last IPv6 sync granted the tc IPv6 path its source translation (ekp_cfg6
        holds the node's IPv6 address); False before the first."""
        return self._ebpf.snat6_granted

    def snat_preview(self, node: NodeContext) -> bool:
        return self._ebpf.snat6_preview(node)

    def sync(
        self, state: ProxyState, node: NodeContext, changed: frozenset[ServicePortName] | None = None
    ) -> SyncResult:
        return self._ebpf.sync6(state, node, changed)

    def cleanup(self) -> None:
        """Nothing: the IPv4 proxier's cleanup removes every map and program, these included."""


def _attach_fds(datapath: DatapathLike) -> dict[str, int]:
    """The Attacher's programs of a load. XDP's only where loaded (MapSizes.xdp): without it the
    Attacher takes any of ours an earlier run attached off (found by name, not by our fd), but
    under best-effort, where it asks for a load with it (Attacher.xdp_wanted)."""
    fds = {name: datapath.prog_fd(name) for name in (PROG_FROM_NET, PROG_FROM_POD, PROG_EGRESS)}
    if datapath.has_program(PROG_XDP):
        fds[PROG_XDP] = datapath.prog_fd(PROG_XDP)
    return fds


def _room_for(entries: int) -> int:
    """A map size with a quarter to spare, rounded up to a power of two (as the defaults are)."""
    return 1 << (entries + entries // 4 - 1).bit_length()


def _dotted(path: str) -> str:
    return path.replace("/", ".")


# ---------------------------------------------------------------------------------- sysctls


def write_sysctl(netns: str, path: str, value: str) -> str | None:
    """Set /proc/sys/`path` to `value` in `netns` when it differs; returns the old value."""

    def run() -> str | None:
        proc = Path("/proc/sys") / path
        old = proc.read_text().strip()
        if old != value:
            proc.write_text(value + "\n")
        return old

    return run_in_netns(netns, run)


# ---------------------------------------------------------------------------------- pins


def remove_stale_pins(pin_path: str) -> list[str]:
    """Remove pinned maps of other ABI versions (loader.stale_pins); their names."""
    from agent.ebpf.loader import stale_pins

    removed = []
    for path in stale_pins(pin_path):
        os.unlink(path)
        removed.append(os.path.basename(path))
    return removed


def remove_pins(pin_path: str) -> list[str]:
    """Remove every `ekp_*` pin, then the directory if nothing else is in it."""
    try:
        names = sorted(os.listdir(pin_path))
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        if name.startswith(abi.PREFIX):
            os.unlink(os.path.join(pin_path, name))
            removed.append(name)
    try:
        os.rmdir(pin_path)
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY:
            log.warning("pin directory %s holds files that are not ours: left in place", pin_path)
        elif exc.errno != errno.ENOENT:
            raise
    return removed


# ---------------------------------------------------------------------------------- inspect

INSPECT_SECTIONS = ("services", "services6", "ct", "aff", "stats", "capacity", "maglev", "sockets")


def render_live_maps(
    pin_path: str, sections: Sequence[str] = ("services",), now_ns: int | None = None
) -> str:
    """Decoded text of the pinned maps under `pin_path` (for `agent inspect maps`).

    `services` prints the same lines as `--dry-run` (cfg, fe, slot, be, rnat, srcr), so a live
    node can be diffed against a plan; `services6` the IPv6 maps (fe6, slot6, be6, ...); `ct`,
    `aff` and `stats` print conntrack (IPv4's, then the tc IPv6 path's `ct6` lines), affinity and
    the counters; `sockets` the socket programs'
    settings, links and where each socket was sent. Opens the pins read-only in effect (nothing is
    written); needs no compiler.
    """
    from agent.ebpf.capacity import read_fill, render_capacity
    from agent.ebpf.maps import open_pinned_as_held, read_stats
    from agent.ebpf.render import (
        render_affinity,
        render_conntrack,
        render_contents,
        render_sockets,
        render_stats,
    )
    from agent.ebpf.render6 import ct6_lines, render_contents6, sock6_lines
    from agent.ebpf.sockattach import pinned_links

    unknown = [s for s in sections if s not in INSPECT_SECTIONS]
    if unknown:
        raise ValueError(f"unknown section {','.join(unknown)} (known: {', '.join(INSPECT_SECTIONS)})")
    roles = {
        "services": (*ROLES, "cfg", "cfgsel"),
        "services6": tuple(abi.V6_ROLES.values()),
        "ct": (*abi.CT_ROLES, "ct6_tcp", "ct6_any"),
        "aff": ("aff",),
        "stats": ("stats", "xstats"),
        "capacity": tuple(abi.MAPS),
        "maglev": ("maglev", "fe", "be"),
        "sockets": ("skcfg", "sknat", "sknat6"),
    }
    needed = sorted({role for s in sections for role in roles[s]})
    # The IPv6 maps only where the section is theirs: `capacity` and `sockets` against the pins of
    # an agent from before them (an upgrade in progress, an older image) show what is there.
    required = {role for s in sections for role in roles[s] if s == "services6" or not abi.MAPS[role].pair}
    maps: dict[str, BpfMap] = {}
    try:
        for role in needed:
            path = os.path.join(pin_path, abi.MAPS[role].name)
            if not os.path.exists(path) and role not in required:
                continue
            if not os.path.exists(path):
                raise FileNotFoundError(
                    errno.ENOENT, "no pinned map (is the agent running in eBPF mode?)", path
                )
            maps[role] = open_pinned_as_held(abi.MAPS[role], pin_path)
        now = time.monotonic_ns() if now_ns is None else now_ns
        out: list[str] = []
        for section in sections:
            if section == "services":
                contents = read_contents({r: maps[r] for r in ROLES}, read_config(maps))
                out.append(render_contents(contents))
            elif section == "services6":
                out.append(render_contents6({role: maps[role].items() for role in roles["services6"]}))
            elif section == "ct":
                flows = [kv for role in abi.CT_ROLES for kv in maps[role].items()]
                out.append(render_conntrack(flows, now))  # type: ignore[arg-type]
                flows6 = [kv for role in ("ct6_tcp", "ct6_any") if role in maps for kv in maps[role].items()]
                out.append("".join(line + "\n" for line in ct6_lines(flows6, now)))
            elif section == "capacity":
                capacities = {role: m.info().max_entries for role, m in maps.items()}
                fills = read_fill(maps, capacities, read_config(maps), now)
                out.append(render_capacity(fills, read_stats(maps["stats"])))
            elif section == "sockets":
                cfg = maps["skcfg"].lookup(ctypes.c_uint32(0))
                links = {
                    hook: (state.link_id, state.prog_id, state.cgroup_id)
                    for hook, state in pinned_links(pin_path).items()
                }
                live = cfg if isinstance(cfg, abi.SockConfig) and cfg.host_netns else None
                text = render_sockets(live, links, maps["sknat"].items())  # type: ignore[arg-type]
                sknat6 = maps["sknat6"].items() if "sknat6" in maps else []
                out.append(text + "".join(line + "\n" for line in sock6_lines(sknat6)))
            elif section == "aff":
                out.append(render_affinity(maps["aff"].items(), now))  # type: ignore[arg-type]
            elif section == "maglev":
                out.append(_render_maglev(maps))
            else:
                out.append(render_stats({int(k): v for k, v in read_stats(maps["stats"]).items()}))
                xdp = {int(k): v for k, v in read_stats(maps["xstats"]).items()}
                out.append(render_stats(xdp, prefix="xdp"))
        return "".join(out)
    finally:
        for m in maps.values():
            m.close()


def _render_maglev(maps: Mapping[str, BpfMap]) -> str:
    """`agent inspect maps maglev`: every table, with the frontends that use it."""
    from agent.ebpf.abi import ip_str, port_host
    from agent.ebpf.render import proto_name, render_maglev

    tables: dict[int, list[int]] = {}
    for k, v in maps["maglev"].items():
        if isinstance(k, abi.MaglevKey):
            tables[int(k.set_id)] = list(getattr(v, "backend_id"))  # noqa: B009 (a per-size type)
    backends = {
        int(k.id): f"{ip_str(v.addr)}:{port_host(v.port)}"
        for k, v in maps["be"].items()
        if isinstance(k, abi.BackendKey) and isinstance(v, abi.Backend)
    }
    frontends: dict[int, list[str]] = {}
    for k, v in maps["fe"].items():
        if (
            isinstance(k, abi.FrontendKey)
            and isinstance(v, abi.Frontend)
            and v.flags & abi.FrontendFlag.MAGLEV
        ):
            name = f"{ip_str(k.addr)}:{port_host(k.port)}/{proto_name(k.proto)}"
            frontends.setdefault(int(v.set_id), []).append(name)
    return render_maglev(tables, backends, frontends)
