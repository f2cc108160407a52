"""EbpfProxier: first sync from the pinned maps, deltas after, restart without churn, careful cleanup.

Unit tests run it over FakeMaps and a recording attacher; the kernel test runs the real data path
(bcc) in a throwaway namespace with a throwaway bpffs.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from agent.config import Config, HostRouting, MapSizes, Mode, NodeContext
from agent.ebpf import EbpfProxier, abi, activity
from agent.ebpf.abi import (
    MAPS,
    Act,
    ConfigFlag,
    ConfigSel,
    CtEntry,
    CtKey,
    FrontendKey,
    HandoverMode,
    MapSpec,
    Scope,
    SockConfig,
    SockFlag,
    Stat,
    ip_be,
    port_be,
)
from agent.ebpf.attach import HandoverState
from agent.ebpf.maps import FakeMap, MapWriter, read_config
from agent.ebpf.plan import MapContents, plan, read_contents
from agent.ebpf.planner import ROLES
from agent.ebpf.programs import (
    PROG_EGRESS,
    PROG_FROM_NET,
    PROG_FROM_POD,
    PROG_SOCK_TERM,
    PROG_XDP_NET,
    PROG_XDP_NET6,
    PROGRAMS,
    SOCK_HOOKS,
)
from agent.ebpf.proxier import INSPECT_SECTIONS, StartSteps, handover_start, remove_pins, render_live_maps
from agent.ebpf.render import render_contents
from agent.ebpf.sockattach import pinned_links
from agent.ebpf.xdp import PROG_XDP
from agent.model.types import IPFamily
from agent.takeover.flows import EbpfIds, NatFlow, TcpState, ebpf_entries6
from lab.hooks import hook_programs, ours
from lab.netns import cgroup2_root, new_prefix, remove_cgroup_tree
from tests.ebpf.support import GOLDEN, NODE, failing_once, state_from_yaml
from tests.ebpf.test_family6 import VIP6, service, slice_, state6

STATE = state_from_yaml((GOLDEN / "loadbalancer-etp-local.yaml").read_text())
NODE6 = NodeContext(node_ips=("fd00:192:168::11",), primary_ip="fd00:192:168::11")  # the IPv6 half's node
MORE = state_from_yaml(
    (GOLDEN / "loadbalancer-etp-local.yaml").read_text()
    + "\n---\n"
    + (GOLDEN / "multi-port-dns.yaml").read_text()
)


class FakeDatapath:
    def __init__(self, maps: dict[str, FakeMap], fd_base: int = 0, open_fds: set[int] | None = None) -> None:
        self._maps = maps
        # Its program fds are PROG_FDS' numbers + fd_base, in `open_fds` (the Rig's, shared by its
        # data paths, as a process's fd table) from here until close()
        self.fd_base = fd_base
        self.open_fds = set() if open_fds is None else open_fds
        self.open_fds.update(n + fd_base for n in PROG_FDS.values())
        self.loads = 0
        self.closed = 0
        self.pin_checks = 0
        self.events: list[str] = []
        self.missing_pins: list[str] = []
        # Programs the kernel could not load. By default the socket programs and their iterator:
        # a proxier over a fake data path then never reaches the real socket attacher (the
        # default one would link to the machine's root cgroup); the Rig gives them explicitly.
        self.unavailable: set[str] = {name for name, _ in SOCK_HOOKS.values()} | {PROG_SOCK_TERM}
        self.handover = [HandoverMode.OFF]  # the build's pinned mode (shared by the Rig's data paths)
        self.load_error: Exception | None = None  # what load() raises
        self.recompile = True  # the last load()'s: whether a cached object that fails is compiled again

    @property
    def maps(self) -> Mapping[str, MapWriter]:
        if self.closed:  # its map fds: a dump through them fails
            raise OSError(errno.EBADF, "Bad file descriptor (the data path was closed)")
        return self._maps

    def load(self, maps_ready: Callable[[], None] | None = None, *, recompile: bool = True) -> None:
        self.loads += 1
        self.recompile = recompile
        if self.load_error is not None:
            raise self.load_error
        if maps_ready is not None:
            maps_ready()

    def prog_fd(self, name: str) -> int:
        if not self.has_program(name):
            raise KeyError(f"no program {name!r} loaded")  # as Datapath.prog_fd
        return PROG_FDS[name] + self.fd_base

    def has_program(self, name: str) -> bool:
        return name in PROG_FDS and name not in self.unavailable

    def repair_pins(self) -> list[str]:
        self.pin_checks += 1
        repaired, self.missing_pins = self.missing_pins, []
        return repaired

    def release_older_builds(self) -> list[str]:
        self.events.append("unpin older builds' program arrays")
        return []

    def set_handover(self, mode: HandoverMode) -> None:
        self.events.append(f"hand-over {mode.name}")
        self.handover[0] = mode

    def handover_mode(self) -> HandoverMode:
        return self.handover[0]

    def close(self) -> None:
        self.closed += 1
        self.open_fds.difference_update(n + self.fd_base for n in PROG_FDS.values())


def check_open(fds: Iterable[int], open_fds: set[int]) -> None:
    """What the kernel answers a program fd closed since (prog_id, bpf_link_create): EBADF."""
    closed = sorted(set(fds) - open_fds)
    if closed:
        raise OSError(errno.EBADF, f"Bad file descriptor (program fds {closed} were closed)")


class FakeAttacher:
    def __init__(self, log: list[str], maps: Mapping[str, MapWriter]) -> None:
        self.log = log
        self.maps = maps
        self.watching = False
        self.armed_at_reconcile: list[bool] = []  # the flow-activity check, when programs changed
        self.nodes: list[NodeContext] = []  # what each reconcile found the external devices by
        self.kept: list[bool] = []  # each reconcile's keep_external
        # What the hooks hold at a start (the Rig's), and the filters a front reconcile puts in front.
        self.state = HandoverState(own_front=False, other_front=False, older_behind=True)
        self.front: dict[tuple[int, int], str] = {}
        self.rehome_error: Exception | None = None  # what the next rehome raises
        # External devices best-effort would try XDP on (the Rig's, found by each reconcile while the
        # attacher has no XDP program)
        self.xdp_devices: dict[int, str] = {}
        self.fds: dict[str, int] = {}  # the programs it attaches (the factory's, then use_programs')
        self.ports: MapWriter | None = None
        self.reconcile_error: Exception | None = None  # what the next reconcile raises
        self.stuck = 0  # how many next stop_watcher calls find the watcher in an attach, not ended

    @property
    def xdp_wanted(self) -> dict[int, str]:
        return {} if PROG_XDP in self.fds else dict(self.xdp_devices)

    def use_programs(self, prog_fds: Mapping[str, int], ports: MapWriter) -> None:
        self.log.append("use programs" + (" with XDP" if PROG_XDP in prog_fds else ""))
        self.fds, self.ports = dict(prog_fds), ports

    def attach_egress(self, node: NodeContext) -> None:
        self.log.append("attach egress")

    def reconcile(
        self,
        node: NodeContext,
        *,
        full: bool = False,
        verify: bool = False,
        keep_external: bool = False,
        front: bool = False,
    ) -> None:
        self.log.append(
            f"reconcile full={full}"
            + (" verify" if verify and not full else "")
            + (" front" if front else "")
        )
        if self.reconcile_error is not None:
            error, self.reconcile_error = self.reconcile_error, None
            raise error
        self.nodes.append(node)
        self.kept.append(keep_external)
        self.armed_at_reconcile.append(activity.armed(self.maps["act"]))
        if front and self.state.older_behind:
            self.front[(2, 0xFFFFFFF2)] = "ekp_from_net"

    def rehome(self) -> None:
        self.log.append("rehome")
        if self.rehome_error is not None:
            error, self.rehome_error = self.rehome_error, None
            raise error
        self.front.clear()

    @property
    def fronts(self) -> dict[tuple[int, int], str]:
        return dict(self.front)

    def handover_state(self) -> HandoverState:
        return replace(self.state, own_front=self.state.own_front or bool(self.front))

    def start_watcher(self, timeout: float = 5.0) -> None:
        self.log.append("watch")
        self.watching = True

    def stop_watcher(self) -> bool:
        self.log.append("stop")
        if self.stuck:
            self.stuck -= 1
            return False  # as Attacher's: still running, told to stop
        self.watching = False
        return True


PROG_FDS = {name: 100 + i for i, name in enumerate(PROGRAMS)}


class FakeSocketAttacher:
    def __init__(self, log: list[str], fds: Mapping[str, int], open_fds: set[int]) -> None:
        self.log = log
        self.fds = dict(fds)
        self.open_fds = open_fds

    @property
    def cgroup(self) -> str:
        return "/cg/node1"

    def reconcile(self) -> list[str]:
        check_open(self.fds.values(), self.open_fds)  # SocketAttacher's prog_id(fd) of each
        self.log.append("link sockets")
        return []


class FakeTerminator:
    def __init__(self, log: list[str], prog_fd: int, ended: Callable[[], int], open_fds: set[int]) -> None:
        self.log = log
        self.prog_fd = prog_fd
        self.ended = ended
        self.open_fds = open_fds

    def run(self) -> int:
        check_open([self.prog_fd], self.open_fds)  # SocketTerminator's bpf_link_create on it
        self.log.append(f"end stale sockets ({self.ended()} so far)")
        return 0

    def close(self) -> None:
        self.log.append("terminator closed")


class FakeUpgrade:
    def __init__(
        self, log: list[str], hands_over: bool = False, carry6_error: Exception | None = None
    ) -> None:
        self.log = log
        self.hands_over = hands_over
        self.carry6_error = carry6_error

    def before_attach(self, maps: Mapping[str, MapWriter]) -> None:
        self.log.append("carry v1 conntrack")

    def after_attach(self, maps: Mapping[str, MapWriter]) -> None:
        self.log.append("carry v1 conntrack again")

    def abort(self, *, attached: bool) -> None:
        self.log.append(f"start steps aborted{' (attached)' if attached else ''}")

    def close(self) -> None:
        self.log.append("start steps closed")

    def after_first_sync6(
        self, maps: Mapping[str, MapWriter], frontends: Mapping[tuple[str, int, int], int] | None = None
    ) -> None:
        if self.carry6_error is not None:
            self.log.append("carry IPv6 flows: raised")
            raise self.carry6_error
        written = f"{len(maps['fe6'].items())} frontends, {len(maps['be6'].items())} backends"
        if frontends is None:
            self.log.append(f"carry IPv6 flows after the first IPv6 sync ({written})")
        else:
            self.log.append(
                f"carry IPv6 flows for the first IPv6 sync's {sorted(frontends.items())} ({written})"
            )

    def serving(self) -> None:
        self.log.append("remove the other data path's rules")


class Rig:
    """One node's kernel state (maps survive proxier instances, as pins do)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.maps = {role: FakeMap(spec) for role, spec in MAPS.items()}
        self.events: list[str] = []
        self.carry6_error: Exception | None = None  # what the upgrade's IPv6 carry raises
        self.sysctls: list[tuple[str, str, str]] = []
        self.datapaths: list[FakeDatapath] = []
        self.attachers: list[FakeAttacher] = []
        self.attacher_fds: list[dict[str, int]] = []  # the program fds each attacher was given
        self.config = Config(netns="node1", pin_path=str(tmp / "pins"))
        self.local_ports = "32768\t60999"  # net.ipv4.ip_local_port_range in the node's namespace
        self.pinned: dict[str, int] = {}
        self.sizes: list[MapSizes] = []  # what each data path was created with
        self.unavailable: set[str] = set()  # programs the kernel cannot load
        self.datapath_type: type[FakeDatapath] = FakeDatapath
        self.conntrack6: list[NatFlow] = []  # IPv6 nf_conntrack's DNAT entries
        self.conntrack6_error: Exception | None = None  # what reading them raises
        self.conntrack6_reads = 0
        self.node6: NodeContext | None = None  # what the next proxier's node6_reader reads (None: no reader)
        # What the next proxier's masquerade6_reader reads: whether the IPv6 nat rules in place keep
        # MASQUERADE out of --bpf-snat-ports (eBPF mode's), or what reading them raises
        self.masquerade6: bool | Exception = True
        self.hands_over = False  # the next proxier's start steps: an older ABI's programs to hand over from
        self.handover = [HandoverMode.OFF]  # the build's pinned hand-over mode, as the pin keeps it
        # What the next proxier's attacher finds on the hooks (an older generation's filters at 17).
        self.hooks = HandoverState(own_front=False, other_front=False, older_behind=True)
        self.rehome_error: Exception | None = None  # what the next proxier's attacher's first rehome raises
        self.snapshot_dir: str | None = None  # where a proxier leaves its planner at close (None: nowhere)
        self.sysctl_values: dict[str, str] = {}  # what sysctl_read answers, but the port range
        # The external devices' kinds a best-effort load reads (a NIC's is ""), or what reading raises
        self.devices: dict[str, str] | Exception = {"eth0": ""}
        self.xdp_load_error: Exception | None = None  # what a load with the XDP programs raises
        self.open_fds: set[int] = set()  # the data paths' program fds not closed yet
        self.now = 1000.0  # the proxiers' monotonic clock

    def proxier(self, *, ipv6: bool = True) -> EbpfProxier:
        def datapath(pin_path: str, sizes: MapSizes) -> FakeDatapath:
            self.sizes.append(sizes)
            # Each its own fd numbers: a holder of a closed one is caught (check_open)
            dp = self.datapath_type(self.maps, 1000 * len(self.datapaths), self.open_fds)
            # As Datapath.programs: the XDP programs are left out where XDP cannot attach.
            dp.unavailable = (
                self.unavailable if sizes.xdp else self.unavailable | {PROG_XDP_NET, PROG_XDP_NET6}
            )
            dp.events = self.events
            dp.handover = self.handover
            dp.load_error = self.xdp_load_error if sizes.xdp else None
            self.datapaths.append(dp)
            return dp

        def sysctl(netns: str, path: str, value: str) -> str:
            self.sysctls.append((netns, path, value))
            return "0"

        def attacher(config: Config, fds: Mapping[str, int], ports: MapWriter) -> FakeAttacher:
            self.attacher_fds.append(dict(fds))
            self.attachers.append(FakeAttacher(self.events, self.maps))
            self.attachers[-1].state = self.hooks
            self.attachers[-1].rehome_error = self.rehome_error
            self.attachers[-1].fds = dict(fds)
            return self.attachers[-1]

        def xdp_devices(config: Config, ipv6: bool) -> dict[str, str]:
            if isinstance(self.devices, Exception):
                raise self.devices
            return dict(self.devices)

        def sysctl_read(netns: str, path: str) -> str:
            assert netns == self.config.netns
            if path == "net/ipv4/ip_local_port_range":
                return self.local_ports
            return self.sysctl_values[path]

        return EbpfProxier(
            self.config,
            datapath_factory=datapath,
            attacher_factory=attacher,
            sysctl_writer=sysctl,
            sysctl_reader=sysctl_read,
            sizes_reader=lambda pin_path: dict(self.pinned),
            upgrade_factory=lambda pin_path: FakeUpgrade(self.events, self.hands_over, self.carry6_error),
            socket_attacher_factory=lambda config, fds: FakeSocketAttacher(self.events, fds, self.open_fds),
            terminator_factory=lambda config, cgroup, fd, ended: FakeTerminator(
                self.events, fd, ended, self.open_fds
            ),
            netns_cookie_reader=lambda netns: 4242,
            socket_detach=self.socket_detach,
            conntrack6_reader=self.read_conntrack6,
            node6_reader=None if self.node6 is None else self.read_node6,
            masquerade6_reader=self.read_masquerade6,
            xdp_devices_reader=xdp_devices,
            clock=lambda: self.now,
            snapshot_dir=self.snapshot_dir,
            ipv6=ipv6,
        )

    def read_node6(self) -> NodeContext:
        assert self.node6 is not None
        return self.node6

    def read_masquerade6(self) -> bool:
        if isinstance(self.masquerade6, Exception):
            raise self.masquerade6
        return self.masquerade6

    def read_conntrack6(self, netns: str) -> list[NatFlow]:
        self.conntrack6_reads += 1
        if self.conntrack6_error is not None:
            raise self.conntrack6_error
        return list(self.conntrack6)

    def socket_detach(self, pin_path: str) -> list[str]:
        self.events.append("unlink sockets")
        return []

    def contents(self) -> MapContents:
        return read_contents(self.maps, read_config(self.maps))


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Rig:
    from agent.ebpf import proxier as ebpf_proxier
    from agent.takeover import into_ebpf

    # cleanup() puts back a kept tcp_be_liberal: the rig's node1 is no namespace of the machine's,
    # and the file kept for it is the test's, never a lab agent's in the host's lock directory
    monkeypatch.setattr(into_ebpf, "netns_inode", lambda netns: 4026532000)
    monkeypatch.setattr(ebpf_proxier, "LOCK_DIR", str(tmp_path / "lock"))
    return Rig(tmp_path)


def test_constructor_has_no_side_effects(rig: Rig) -> None:
    rig.proxier()
    assert rig.datapaths == [] and rig.events == [] and rig.sysctls == []


def test_the_flow_activity_check_is_armed_only_once_our_programs_run(rig: Rig) -> None:
    """Disarmed before the first attach (older programs may have left flows without stamps),
    armed after it with the live conntrack entries stamped (agent/ebpf/activity.py); a restarted
    agent does the same."""
    entry = CtEntry(
        last_seen_ns=time.monotonic_ns(), fe_addr=ip_be("10.96.0.10"), fe_port=port_be(80), flags=4
    )
    key = CtKey(ip_be("10.244.1.5"), ip_be("10.244.1.9"), port_be(8080), port_be(40000), 6, 1)
    rig.maps["ct_tcp"].update(key, entry)
    rig.maps["act"].update(ctypes.c_uint32(activity.ARMED), Act(stamp=1))  # an earlier agent's
    for _ in range(2):
        p = rig.proxier()
        p.sync(STATE, NODE)
        assert rig.attachers[-1].armed_at_reconcile == [False]
        assert activity.armed(rig.maps["act"])
        backend = rig.maps["act"].lookup(ctypes.c_uint32(activity.slot(key.saddr, key.sport, 6)))
        assert isinstance(backend, Act) and backend.stamp == activity.stamp_of(time.monotonic_ns())
        p.close()


def test_first_sync_writes_the_plan_then_attaches(rig: Rig) -> None:
    p = rig.proxier()
    p.sync(STATE, NODE)
    want = plan(STATE, NODE, rig.config)
    assert rig.contents().same_entries(want)
    assert render_contents(rig.contents()) == render_contents(want)
    # the conntrack of an ABI v1 agent is carried over before and right after the programs change;
    # the socket programs are linked after that, and only then, every hook serving, are the other
    # data path's rules (kube-proxy's OUTPUT chain for the node's clients) removed; an older
    # build's program arrays (its attached programs' tail calls) are unpinned only once ours are
    # attached; sockets of
    # backends gone meanwhile ended; legacy host routing (the default) gets its egress programs
    # everywhere before the config says legacy and the ingress programs come
    first = [
        "carry v1 conntrack",
        "hand-over OFF",
        "attach egress",
        "reconcile full=True",
        "carry v1 conntrack again",
        "unpin older builds' program arrays",
        "link sockets",
        "remove the other data path's rules",
        "watch",
        "end stale sockets (0 so far)",
    ]
    assert rig.events == first
    assert rig.sysctls == [("node1", "net/ipv4/ip_forward", "1")]
    # the same state again: nothing written; a partial sync leaves the attachments to the watcher
    p.sync(STATE, NODE, frozenset())
    assert p.last_flush.writes == 0
    assert rig.events == first
    assert rig.datapaths[0].loads == 1
    # a full sync (every sync period) checks every device and the socket links
    p.sync(STATE, NODE)
    assert rig.events[-3:] == ["reconcile full=False verify", "link sockets", "end stale sockets (0 so far)"]
    # so does a partial one when the node's addresses changed
    moved = NodeContext(node_ips=("192.168.0.21",), primary_ip="192.168.0.21")
    p.sync(STATE, moved, frozenset())
    assert rig.events[-1] == "reconcile full=False"
    # a watcher that died is restarted, and every device checked
    rig.attachers[0].watching = False
    p.sync(STATE, moved, frozenset())
    assert rig.events[-2:] == ["watch", "reconcile full=False verify"]


def test_a_first_attach_that_fails_before_the_start_steps_after_attach_aborts_them(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the start steps set for the attach alone (the node's tcp_be_liberal) is put back when
    the attach fails before their after_attach; the next sync starts them again, and an attach
    that goes through aborts nothing."""
    failing = [OSError(16, "Device or resource busy")]
    reconcile = FakeAttacher.reconcile

    def refusing(self: FakeAttacher, node: NodeContext, **kwargs: bool) -> None:
        reconcile(self, node, **kwargs)
        if failing:
            raise failing.pop()

    monkeypatch.setattr(FakeAttacher, "reconcile", refusing)
    p = rig.proxier()
    with pytest.raises(OSError, match="busy"):
        p.sync(STATE, NODE)
    steps = [e for e in rig.events if "carry v1" in e or "aborted" in e or e.startswith("reconcile")]
    # the reconcile may have put programs on some devices: told so (tcp_be_liberal stays 1)
    assert steps == ["carry v1 conntrack", "reconcile full=True", "start steps aborted (attached)"]
    rig.events.clear()
    p.sync(STATE, NODE)
    assert "start steps aborted" not in rig.events
    assert "carry v1 conntrack" in rig.events and "carry v1 conntrack again" in rig.events
    p.close()


def test_a_first_attach_that_fails_before_any_program_is_attached_says_so_to_the_start_steps(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped before anything of ours went on a device: the start steps put everything back
    (tcp_be_liberal); an attach stopped later keeps it until its retry or the agent's stop."""
    failing = [OSError(12, "Cannot allocate memory")]
    disarm = activity.disarm

    def refusing(table: MapWriter) -> None:
        if failing:
            raise failing.pop()
        disarm(table)

    monkeypatch.setattr(activity, "disarm", refusing)
    p = rig.proxier()
    with pytest.raises(OSError, match="allocate"):
        p.sync(STATE, NODE)
    assert rig.events[-1] == "start steps aborted"
    assert not any(e.startswith("reconcile") or e == "attach egress" for e in rig.events)
    p.close()
    assert rig.events[-1] == "start steps closed", "the agent's stop puts back what is left"


def test_the_start_steps_run_every_after_attach_whatever_an_earlier_one_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: list[str] = []

    class Failing(FakeUpgrade):
        def after_attach(self, maps: Mapping[str, MapWriter]) -> None:
            super().after_attach(maps)
            raise RuntimeError(f"step {len(events)}")

    steps = StartSteps([Failing(events), FakeUpgrade(events), Failing(events)])
    with pytest.raises(RuntimeError, match="step 1"):
        steps.after_attach({})
    assert events == ["carry v1 conntrack again"] * 3
    assert "a start step failed after another had: RuntimeError('step 3')" in caplog.text


def test_an_upgrade_that_carries_conntrack_puts_our_programs_in_front_until_it_is_carried(rig: Rig) -> None:
    """From an older ABI (its conntrack in tables ours do not read): our programs go in front of the
    older ones passing every packet on, then take new flows and leave the misses to the older ones
    while the conntrack is carried over, then decide alone and move to the older ones' priority,
    before anything of the older build is unpinned. A restart of the same build after it: the mode
    is set OFF (one a hand-over cut short left is cleared), no program in front, no rehome."""
    rig.hands_over = True
    p = rig.proxier()
    p.sync(STATE, NODE)
    assert rig.events[: rig.events.index("unpin older builds' program arrays")] == [
        "carry v1 conntrack",
        "hand-over PASS",
        "attach egress",
        "reconcile full=True front",
        "hand-over MISS",
        "carry v1 conntrack again",
        "hand-over OFF",
        "rehome",
    ]
    p.close()
    rig.hands_over = False
    rig.events.clear()
    p = rig.proxier()
    p.sync(STATE, NODE)
    assert [e for e in rig.events if e.startswith(("hand-over", "reconcile", "rehome"))] == [
        "hand-over OFF",
        "reconcile full=True",
    ]
    p.close()


HAND_OVER_EVENTS = ("hand-over", "reconcile", "rehome", "carry")


def test_a_restart_after_miss_resumes_the_hand_over_without_passing_everything_again(rig: Rig) -> None:
    """An agent killed while the conntrack was carried (this build in front, in MISS): the next
    start keeps MISS (PASS again would hand the older programs flows only this build knows),
    reconciles in front, carries again, then OFF and rehome."""
    rig.hands_over = True
    rig.handover[0] = HandoverMode.MISS
    rig.hooks = HandoverState(own_front=True, other_front=False, older_behind=True)
    p = rig.proxier()
    p.sync(STATE, NODE)
    assert [e for e in rig.events if e.startswith(HAND_OVER_EVENTS)] == [
        "carry v1 conntrack",
        "hand-over MISS",
        "reconcile full=True front",
        "carry v1 conntrack again",
        "hand-over OFF",
        "rehome",
    ]
    p.close()


def test_a_restarts_first_read_back_that_fails_is_adopted_again_by_the_retry(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart whose first read-back of the pinned maps fails (ENOMEM at a node's memory
    limit): the retry reads them back and adopts them as a first sync does, keeping every id
    (established flows' conntrack entries name them), and writes nothing over unchanged maps."""
    p = rig.proxier()
    p.sync(STATE, NODE)
    before = rig.contents()
    p.close()
    fe = rig.maps["fe"]
    monkeypatch.setattr(fe, "dump_raw", failing_once(fe.dump_raw, OSError(errno.ENOMEM, "lookup batch")))
    again = rig.proxier()
    with pytest.raises(OSError):
        again.sync(STATE, NODE)
    again.sync(STATE, NODE)
    assert again.last_flush.writes == 0
    assert rig.contents().same_entries(before)
    again.close()


def test_a_failed_rehome_is_finished_by_the_next_sync_without_a_new_pass(rig: Rig) -> None:
    """rehome fails (not ENODEV) after the mode went OFF: the sync fails, and the next one finishes
    it with the mode left OFF (the carry is done: nothing goes back to the older programs)."""
    rig.hands_over = True
    rig.rehome_error = OSError("EBUSY")
    p = rig.proxier()
    with pytest.raises(OSError, match="EBUSY"):
        p.sync(STATE, NODE)
    assert rig.handover[0] == HandoverMode.OFF
    assert rig.attachers[-1].fronts, "the failed rehome left its filters in front"
    rig.events.clear()
    p.sync(STATE, NODE)
    assert [e for e in rig.events if e.startswith(HAND_OVER_EVENTS)] == [
        "carry v1 conntrack",
        "hand-over OFF",
        "reconcile full=True front",
        "carry v1 conntrack again",
        "rehome",
    ]
    assert rig.attachers[-1].fronts == {}
    # any later sync finishes what is still in front (a hook whose move did not happen)
    rig.attachers[-1].front[(3, 0xFFFFFFF3)] = "ekp_egress"
    rig.events.clear()
    p.sync(STATE, NODE)
    assert [e for e in rig.events if e.startswith(HAND_OVER_EVENTS)] == [
        "reconcile full=False verify",
        "rehome",
    ]
    assert rig.attachers[-1].fronts == {}
    p.close()


@pytest.mark.parametrize(
    ("pinned", "state", "mode"),
    [
        (HandoverMode.OFF, HandoverState(False, False, True), HandoverMode.PASS),  # a fresh hand-over
        (HandoverMode.MISS, HandoverState(True, False, True), HandoverMode.MISS),  # resumed: never lowered
        (HandoverMode.OFF, HandoverState(True, False, True), HandoverMode.OFF),  # carried, rehome left
        (HandoverMode.PASS, HandoverState(True, False, True), HandoverMode.PASS),  # killed before MISS
        (HandoverMode.OFF, HandoverState(False, True, True), HandoverMode.MISS),  # another build's, cut short
        (HandoverMode.OFF, HandoverState(False, False, False), HandoverMode.OFF),  # alone everywhere already
        (HandoverMode.MISS, HandoverState(False, False, True), HandoverMode.MISS),  # fronts gone: still MISS
    ],
)
def test_where_a_hand_over_starts(pinned: HandoverMode, state: HandoverState, mode: HandoverMode) -> None:
    assert handover_start(pinned, state) == mode


class SignallingMap(FakeMap):
    """Sets `written` at its first write."""

    def __init__(self, spec: MapSpec) -> None:
        super().__init__(spec)
        self.written = threading.Event()

    def update_packed(self, keys: bytes, values: bytes) -> int:
        self.written.set()
        return super().update_packed(keys, values)


def test_a_first_sync_writes_the_maps_while_the_programs_load_and_attaches_once_they_are(rig: Rig) -> None:
    """prepare() loads the data path while the source lists; the verifier takes seconds after the
    maps are pinned. A first sync coming meanwhile plans and writes the maps then, and attaches
    only once the programs are loaded."""
    verified, opened = threading.Event(), threading.Event()
    fe = rig.maps["fe"] = SignallingMap(MAPS["fe"])

    class Verifying(FakeDatapath):
        def load(self, maps_ready: Callable[[], None] | None = None, *, recompile: bool = True) -> None:
            self.loads += 1
            assert maps_ready is not None
            maps_ready()
            opened.set()
            assert verified.wait(30)  # the programs: until the test says they are loaded
            rig.events.append("programs loaded")

    rig.datapath_type = Verifying
    p = rig.proxier()
    prepare = threading.Thread(target=p.prepare)
    sync = threading.Thread(target=p.sync, args=(STATE, NODE))
    prepare.start()
    # The sync comes while prepare() loads (as the source's lists take longer than the maps'
    # opening): started before, it could take the load itself and wait for it whole.
    assert opened.wait(10)
    sync.start()
    try:
        assert fe.written.wait(10), "the first sync did not write the maps while the programs loaded"
        assert not any("attach" in e for e in rig.events)
    finally:
        verified.set()
        prepare.join(30)
        sync.join(30)
    assert rig.events[0] == "programs loaded" and any("attach" in e for e in rig.events)
    assert rig.contents().same_entries(plan(STATE, NODE, rig.config))
    assert [d.loads for d in rig.datapaths] == [1]  # the sync waited for prepare()'s load


def test_a_first_sync_loads_the_data_path_itself_when_prepare_failed(rig: Rig) -> None:
    class FailingOnce(FakeDatapath):
        def load(self, maps_ready: Callable[[], None] | None = None, *, recompile: bool = True) -> None:
            self.loads += 1
            if len(rig.datapaths) == 1:
                assert maps_ready is not None
                maps_ready()  # its maps were open, then the programs failed to load
                raise RuntimeError("the verifier said no")
            super().load(maps_ready)

    rig.datapath_type = FailingOnce
    p = rig.proxier()
    with pytest.raises(RuntimeError, match="the verifier said no"):
        p.prepare()
    p.sync(STATE, NODE)
    assert len(rig.datapaths) == 2 and any("attach" in e for e in rig.events)
    assert rig.contents().same_entries(plan(STATE, NODE, rig.config))


def refused_once_written(rig: Rig, role: str) -> None:
    """The rig's first data path opens its maps, waits until a sync wrote `role`'s map, then
    fails to load its programs (the verifier refused one); later ones load."""
    written = rig.maps[role] = SignallingMap(MAPS[role])

    class RefusedAfterTheMaps(FakeDatapath):
        def load(self, maps_ready: Callable[[], None] | None = None, *, recompile: bool = True) -> None:
            self.loads += 1
            assert maps_ready is not None
            maps_ready()
            if len(rig.datapaths) == 1:
                assert written.written.wait(30)  # the sync wrote the maps meanwhile
                raise RuntimeError("the verifier said no")

    rig.datapath_type = RefusedAfterTheMaps


def prepare_in_thread(p: EbpfProxier) -> tuple[threading.Thread, list[BaseException]]:
    """prepare() on its own thread, as the agent runs it while the source lists; its error kept."""
    failed: list[BaseException] = []

    def prepare() -> None:
        try:
            p.prepare()
        except RuntimeError as exc:
            failed.append(exc)

    loading = threading.Thread(target=prepare)
    loading.start()
    return loading, failed


def test_a_load_failing_after_the_first_sync_wrote_its_maps_is_done_again_and_the_maps_read_back(
    rig: Rig,
) -> None:
    """The verifier refuses a program after the first sync wrote the maps: that sync fails (its
    maps' fds are gone with the load), the sync loads the data path again, and the next sync reads
    the pinned maps back (what the failed one wrote is there: nothing to write) and attaches."""
    refused_once_written(rig, "fe")
    p = rig.proxier()
    loading, failed = prepare_in_thread(p)
    with pytest.raises(
        RuntimeError, match=r"load failed while its maps were written \(RuntimeError: the verifier said no\)"
    ):
        p.sync(STATE, NODE)
    loading.join(30)
    assert [str(e) for e in failed] == ["the verifier said no"]
    assert len(rig.datapaths) == 2 and not any("attach" in e for e in rig.events)
    # Its maps stayed open while the failed sync wrote through them; the next sync closes them.
    assert rig.datapaths[0].closed == 0
    p.sync(STATE, NODE)
    assert rig.datapaths[0].closed == 1 and rig.datapaths[1].closed == 0
    assert p.last_flush.writes == 0, "the maps were read back: the failed sync had written them"
    assert any("attach" in e for e in rig.events)
    assert rig.contents().same_entries(plan(STATE, NODE, rig.config))


def test_a_load_failing_after_an_ipv6_sync_wrote_its_maps_fails_that_sync_and_the_next_reads_back(
    rig: Rig,
) -> None:
    """As for IPv4: an IPv6 sync that wrote the maps of a load the verifier then refused is not a
    success (those maps' fds are gone with the load); the load is done again and the next IPv6
    sync re-adopts what the pinned maps hold."""
    refused_once_written(rig, "fe6")
    p = rig.proxier()
    half = p.ipv6()
    loading, failed = prepare_in_thread(p)
    state = state6([service()], [slice_("fd00:10:244:1::2")])
    with pytest.raises(RuntimeError, match=r"IPv6 maps were written \(RuntimeError: the verifier said no\)"):
        half.sync(state, NODE6)
    loading.join(30)
    assert [str(e) for e in failed] == ["the verifier said no"] and len(rig.datapaths) == 2
    assert half.sync(state, NODE6).failed == {}
    assert p._v6.last_flush.writes == 0, "read back: the failed sync had written them"
    assert len(rig.maps["fe6"]) == 2
    p.close()


def test_the_socket_programs_get_the_node_namespace_then_their_links(rig: Rig) -> None:
    """Their settings (the node's netns cookie, host-namespace-only) are written before they are
    linked, and they are given the socket program fds. Pods too by default (as Cilium's)."""
    p = rig.proxier()
    p.sync(STATE, NODE)
    assert rig.maps["skcfg"].lookup(ctypes.c_uint32(0)) == SockConfig(host_netns=4242, flags=0)
    rig2 = Rig(rig.tmp)
    rig2.config = replace(rig2.config, socket_lb_host_only=True)
    rig2.proxier().sync(STATE, NODE)
    assert rig2.maps["skcfg"].lookup(ctypes.c_uint32(0)) == SockConfig(
        host_netns=4242, flags=SockFlag.HOST_ONLY
    )


def test_udp_sockets_are_ended_after_a_sync_that_removed_a_backend(rig: Rig) -> None:
    """The socket iterator runs when membership shrank (and at full syncs), not after other syncs."""
    p = rig.proxier()
    p.sync(STATE, NODE)
    runs = sum(e.startswith("end stale sockets") for e in rig.events)
    added = frozenset(MORE.services) - frozenset(STATE.services)
    p.sync(MORE, NODE, added)
    assert sum(e.startswith("end stale sockets") for e in rig.events) == runs  # only added: none
    rig.maps["stats"].update(ctypes.c_uint32(Stat.SOCK_DESTROYED), ctypes.c_uint64(3))
    p.sync(STATE, NODE, added)
    assert p.last_flush.deletes.get("member")
    assert rig.events[-1] == "end stale sockets (3 so far)"


def test_the_ipv6_node_addresses_find_external_devices_where_the_tc_ipv6_path_serves(rig: Rig) -> None:
    """The devices holding the IPv6 node addresses sync6 reads are external devices too (their
    ekp_from_net reverse-translates the tc IPv6 path's replies): checked as soon as sync6 has
    them, and at every sync after. Without the path, the IPv4 addresses alone, as before."""
    dual = replace(rig.config, node_ips=("192.168.0.11", "fd00:192:168::11"), socket_lb=True)
    for config, want in (
        (replace(dual, bpf_host_routing=HostRouting.BPF), (*NODE.node_ips, *NODE6.node_ips)),
        (replace(dual, bpf_host_routing=HostRouting.LEGACY), (*NODE.node_ips, *NODE6.node_ips)),
        (replace(dual, socket_lb=False), NODE.node_ips),
    ):
        rig.config = config
        routing = (config.bpf_host_routing, config.socket_lb)
        p = rig.proxier()
        half = p.ipv6()
        p.sync(STATE, NODE)
        half.sync(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
        attacher = rig.attachers[-1]
        assert attacher.nodes[-1].node_ips == want, routing
        p.sync(STATE, NODE)  # periodic: checked again with both
        assert attacher.nodes[-1].node_ips == want, routing
        p.close()


def test_a_removed_ipv6_node_address_releases_its_device_at_the_ipv6_sync(rig: Rig) -> None:
    """An IPv6 node address that sync6 no longer reads (removed, or moved) leaves the addresses
    the attacher finds external devices by at that sync6, not at the next IPv4 sync: its device,
    holding no IPv4 node address, is no longer external."""
    rig.config = replace(
        rig.config,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        socket_lb=True,
        bpf_host_routing=HostRouting.BPF,
    )
    p = rig.proxier()
    half = p.ipv6()
    p.sync(STATE, NODE)
    state = state6([service()], [slice_("fd00:10:244:1::2")])
    half.sync(state, NodeContext(node_ips=("fd00:192:168::11",), primary_ip="fd00:192:168::11"))
    attacher = rig.attachers[-1]
    assert attacher.nodes[-1].node_ips == (*NODE.node_ips, "fd00:192:168::11")
    half.sync(state, NodeContext(node_ips=("fd00:192:168::12",), primary_ip="fd00:192:168::12"))
    assert attacher.nodes[-1].node_ips == (*NODE.node_ips, "fd00:192:168::12"), "moved"
    half.sync(state, NodeContext())
    assert attacher.nodes[-1].node_ips == NODE.node_ips, "removed"
    p.close()


def test_the_first_attach_before_the_ipv6_sync_keeps_ekp_from_net_where_it_is(rig: Rig) -> None:
    """After a restart the IPv4 sync attaches (full) before the IPv6 family's first sync has told
    the proxier its node addresses: where the tc IPv6 path serves, that reconcile keeps ekp_from_net
    on the devices that carry it (a device holding only an IPv6 node address: detached, the live
    tc flows' replies would leave untranslated until sync6). Once sync6 ran, nothing is kept; the
    reconcile with the IPv6 addresses decides. Without the path, nothing is kept."""
    dual = replace(rig.config, node_ips=("192.168.0.11", "fd00:192:168::11"), socket_lb=True)
    for config, first in (
        (replace(dual, bpf_host_routing=HostRouting.BPF), True),
        (replace(dual, bpf_host_routing=HostRouting.LEGACY), True),
        (replace(dual, socket_lb=False), False),
    ):
        rig.config = config
        routing = (config.bpf_host_routing, config.socket_lb)
        p = rig.proxier()
        half = p.ipv6()
        p.sync(STATE, NODE)
        attacher = rig.attachers[-1]
        assert "reconcile full=True" in attacher.log and attacher.kept == [first], routing
        half.sync(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
        p.sync(STATE, NODE)
        assert len(attacher.kept) > 1 and not any(attacher.kept[1:]), routing
        p.close()


def test_the_tc_ipv6_paths_snat_source_waits_for_ip6tables_masquerades_in_the_snat_range_to_end(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Once ip6tables' rule keeps out of --bpf-snat-ports (masquerade_apart), flows it masqueraded
    before (an upgrade, a switch from iptables mode) may still hold ports of the range: until none
    does (IPv6 nf_conntrack read at each sync6), ekp_cfg6 gets no node address and ip6tables goes on
    masquerading; then it does, and nf_conntrack is not read again. Only a flow a tc flow could
    collide with counts (masqueraded to the node's IPv6 SNAT address, a port of the range, whatever
    address it was sent to, a ClusterIP's too: a long-lived one masqueraded to another address does
    not keep the path's SNAT off, even when sent to the SNAT address); while one does, a
    warning names it and the gauge counts it."""
    from agent.ebpf.maps import read_config6

    rig.config = replace(
        rig.config,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        socket_lb=True,
        bpf_host_routing=HostRouting.BPF,
    )
    held = NatFlow(
        6, ("fd00:ff::100", "fd00:192:168::11", 5555, 30080), ("fd00:a:2::7", "fd00:192:168::11", 8080, 61500)
    )
    outside = NatFlow(
        6, ("fd00:ff::100", "fd00:192:168::11", 5556, 30080), ("fd00:a:2::7", "fd00:192:168::11", 8080, 40000)
    )
    elsewhere = NatFlow(  # masqueraded to the node's other IPv6 address: no tc reply tuple ends there
        6, ("fd00:ff::100", "fd00:192:168::12", 5557, 30080), ("fd00:a:2::7", "fd00:192:168::12", 8080, 61500)
    )
    # To a ClusterIP (and so not to a node address), masqueraded to the SNAT address: held too
    to_cluster_ip = NatFlow(
        6, ("fd00:10:244:1::9", VIP6, 5558, 80), ("fd00:a:2::7", "fd00:192:168::11", 8080, 62000)
    )
    # To the SNAT address (a NodePort), masqueraded to the node's other address: not held
    masqueraded_elsewhere = NatFlow(
        6, ("fd00:ff::100", "fd00:192:168::11", 5559, 30080), ("fd00:a:2::7", "fd00:192:168::12", 8080, 61501)
    )
    rig.conntrack6 = [held, outside, elsewhere, to_cluster_ip, masqueraded_elsewhere]
    p = rig.proxier()
    gauge: list[int] = []
    p.on_snat6_held = gauge.append
    half = p.ipv6()
    p.sync(STATE, NODE)
    state = state6([service()], [slice_("fd00:10:244:1::2")])
    half.masquerade_apart(True)
    with caplog.at_level(logging.WARNING, logger="agent.ebpf.proxier"):
        half.sync(state, NODE6)
        # the same flow closing: its state changes, not which flows hold the ports
        rig.conntrack6 = [replace(held, tcp_state=TcpState.FIN_WAIT), *rig.conntrack6[1:]]
        half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and not any(cfg6.node_addr), "a masqueraded flow holds a port of the range"
    warned = [r.getMessage() for r in caplog.records if "hold ports of that range" in r.getMessage()]
    assert len(warned) == 1, "said once while the same flows hold them, whatever their state"
    assert warned[0].startswith("2 IPv6 TCP and UDP flows"), warned
    assert held.describe() in warned[0] and to_cluster_ip.describe() in warned[0], warned
    assert gauge == [2, 2]
    rig.conntrack6 = [outside, elsewhere, masqueraded_elsewhere]  # they ended; the others never mattered
    half.sync(state, NODE6)
    assert gauge[-1] == 0
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and abi.ip6_str(cfg6.node_addr) == "fd00:192:168::11"
    rig.conntrack6 = [held]  # not read any more: ip6tables' rule keeps new ones out
    half.sync(state, NODE6)
    assert read_config6(rig.maps) == cfg6
    p.close()


def test_a_restart_keeps_the_pinned_snat_grant_only_while_its_address_and_range_still_hold(rig: Rig) -> None:
    """The load keeps the address an earlier run's grant left in ekp_cfg6 when it is still the
    node's primary IPv6 address and ekp_config's SNAT range is this run's --bpf-snat-ports: that
    run's ip6tables, thinned while granted, has no rule for the frontends tc masquerades, so a zero
    there would leave them to a stack without rules until this run's first IPv6 restore. Another
    address, another range, no address read (or one that fails): zero, as before."""
    from agent.ebpf.maps import read_config6

    rig.config = replace(
        rig.config,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        socket_lb=True,
        bpf_host_routing=HostRouting.BPF,
    )
    state = state6([service()], [slice_("fd00:10:244:1::2")])

    def earlier_run_granted() -> None:
        rig.node6 = None
        p = rig.proxier()
        half = p.ipv6()
        p.sync(STATE, NODE)
        half.masquerade_apart(True)
        half.sync(state, NODE6)
        cfg6 = read_config6(rig.maps)
        assert cfg6 is not None and abi.ip6_str(cfg6.node_addr) == "fd00:192:168::11"
        p.close()

    def after_restart() -> str:
        p = rig.proxier()
        p.prepare()
        cfg6 = read_config6(rig.maps)
        p.close()
        assert cfg6 is not None
        return abi.ip6_str(cfg6.node_addr) if any(cfg6.node_addr) else ""

    earlier_run_granted()
    rig.node6 = NODE6
    assert after_restart() == "fd00:192:168::11", "the address and the range still hold: kept"
    earlier_run_granted()
    rig.node6 = NodeContext(node_ips=("fd00:192:168::12",), primary_ip="fd00:192:168::12")
    assert after_restart() == "", "the node's primary IPv6 address moved"
    earlier_run_granted()
    rig.node6 = NODE6
    lo, hi = rig.config.snat_ports
    rig.config = replace(rig.config, snat_ports=(lo + 100, hi))
    assert after_restart() == "", "another --bpf-snat-ports: the rules in place may masquerade into it"
    rig.config = replace(rig.config, snat_ports=(lo, hi))
    earlier_run_granted()
    assert after_restart() == "", "no address read: never kept"
    # The rules in place are not eBPF mode's (an iptables-mode agent's hand-back that left the pins,
    # kube-proxy installed over a stopped agent): their MASQUERADE covers every port.
    earlier_run_granted()
    rig.node6, rig.masquerade6 = NODE6, False
    assert after_restart() == "", "the rules in place masquerade into --bpf-snat-ports"
    earlier_run_granted()
    rig.node6, rig.masquerade6 = NODE6, OSError("ip6tables-save -t nat failed (exit 4)")
    assert after_restart() == "", "the rules could not be read: not known to keep out"
    earlier_run_granted()
    rig.node6, rig.masquerade6 = NODE6, True
    assert after_restart() == "fd00:192:168::11", "read again, in eBPF mode's shape"


def test_a_kept_snat_grant_outlives_failed_restores_and_a_path_turned_off_ends_it_at_the_first_sync(
    rig: Rig,
) -> None:
    """The restart's first restore that fails leaves the earlier run's rules, thinned for the
    grant and keeping MASQUERADE out of the range: the grant the load kept stays (zeroed, the
    frontends they were thinned of would reach a stack with no rule for them, for as long as
    restores fail). A restart with the tc IPv6 path off (--bpf-socket-lb=false) keeps it at the
    load (that run's programs stay attached until this run's replace them), and its first sync,
    with no IPv6 half, empties the IPv6 maps and zeroes it. A flow ip6tables masqueraded to the
    address holding a port of the range zeroes it at the load (the rules in place were full)."""
    from agent.ebpf.maps import read_config6

    on = replace(
        rig.config,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        socket_lb=True,
        bpf_host_routing=HostRouting.BPF,
    )
    state = state6([service()], [slice_("fd00:10:244:1::2")])

    def granted() -> str:
        cfg6 = read_config6(rig.maps)
        assert cfg6 is not None
        return abi.ip6_str(cfg6.node_addr) if any(cfg6.node_addr) else ""

    def earlier_run_granted() -> None:
        rig.config, rig.node6 = on, None
        p = rig.proxier()
        half = p.ipv6()
        p.sync(STATE, NODE)
        half.masquerade_apart(True)
        half.sync(state, NODE6)
        assert granted() == "fd00:192:168::11"
        p.close()

    earlier_run_granted()
    rig.node6 = NODE6
    p = rig.proxier()
    half = p.ipv6()
    p.sync(STATE, NODE)
    for _ in range(2):
        half.masquerade_apart(False)  # the restore failed
        half.sync(state, NODE6)
        assert granted() == "fd00:192:168::11", "the kept grant stays while restores fail"
    assert half.snat_granted
    p.close()

    earlier_run_granted()
    # The path off (--bpf-socket-lb=false) as the agent wires it: the IPv6 proxier is plain
    # ip6tables (agent/app.py make_proxier6), no IPv6 half; the first sync empties the IPv6 maps,
    # ekp_cfg6 with them (the window README "IPv6 and dual-stack" names).
    rig.config, rig.node6 = replace(on, socket_lb=False), NODE6
    p = rig.proxier()
    p.prepare()
    assert granted() == "fd00:192:168::11", "kept at the load: the earlier run's programs are attached"
    p.sync(STATE, NODE)
    assert granted() == "", "no IPv6 half: the first sync empties the IPv6 maps, the source with them"
    assert not rig.maps["fe6"].items(), "and the earlier run's IPv6 frontends"
    p.close()

    earlier_run_granted()
    rig.node6 = NODE6
    rig.conntrack6 = [
        NatFlow(
            6,
            ("fd00:ff::100", "fd00:192:168::11", 5555, 30080),
            ("fd00:a:2::7", "fd00:192:168::11", 8080, 61500),
        )
    ]
    p = rig.proxier()
    p.prepare()
    assert granted() == "", "a masqueraded flow holds a port of the range: reset at the load"
    p.close()


def test_the_ipv6_snat_preview_knows_every_reason_but_the_restores_outcome_and_writes_nothing(
    rig: Rig,
) -> None:
    """`snat6_preview`: what the next sync6 grants should the restore before it succeed, asked
    before that restore (agent/metaproxier.py renders ip6tables for it). A failed last restore does
    not refuse it; the node without an IPv6 address and a masqueraded flow holding a port of the
    range do, as sync6 would; ekp_cfg6 is left as it is."""
    from agent.ebpf.maps import read_config6

    rig.config = replace(
        rig.config,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        socket_lb=True,
        bpf_host_routing=HostRouting.BPF,
    )
    p = rig.proxier()
    half = p.ipv6()
    p.sync(STATE, NODE)
    half.masquerade_apart(False)
    assert half.snat_preview(NODE6), "the restore's own outcome is not known yet"
    assert not half.snat_preview(NodeContext()), "no IPv6 node address"
    rig.conntrack6 = [
        NatFlow(
            6,
            ("fd00:ff::100", "fd00:192:168::11", 5555, 30080),
            ("fd00:a:2::7", "fd00:192:168::11", 8080, 61500),
        )
    ]
    assert not half.snat_preview(NODE6), "a masqueraded flow holds a port of the range"
    cfg6 = read_config6(rig.maps)
    assert cfg6 is None or not any(cfg6.node_addr), "the preview writes nothing"
    p.close()


def test_udp_flows_carried_into_ct6_any_do_not_hold_the_ipv6_snat_grant(rig: Rig) -> None:
    """An upgrade carries the UDP flows ip6tables masqueraded (its MASQUERADE had no --to-ports:
    the client's port, maybe one of --bpf-snat-ports) into ekp_ct6_any (agent/takeover/into_ebpf.py
    `_carry6`); their nf_conntrack entries stay, never refreshed (netfilter sees no datagram of
    theirs any more). The tc path owns them: they do not hold the grant while their REPLY entry is
    there, so new flows to SNAT frontends are not left to ip6tables meanwhile. One not carried
    still does."""
    from agent.ebpf.maps import read_config6

    rig.config = replace(
        rig.config,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        socket_lb=True,
        bpf_host_routing=HostRouting.BPF,
    )
    carried = NatFlow(
        17, ("fd00:ff::100", "fd00:192:168::11", 61500, 30053), ("fd00:a:2::7", "fd00:192:168::11", 53, 61500)
    )
    left = NatFlow(
        17, ("fd00:ff::101", "fd00:192:168::11", 61501, 30053), ("fd00:a:2::7", "fd00:192:168::11", 53, 61501)
    )
    for key, entry in ebpf_entries6(carried, EbpfIds(services={}, backends={}), time.monotonic_ns()):
        rig.maps["ct6_any"].update(key, entry)
    rig.conntrack6 = [carried, left]
    p = rig.proxier()
    gauge: list[int] = []
    p.on_snat6_held = gauge.append
    half = p.ipv6()
    p.sync(STATE, NODE)
    state = state6([service()], [slice_("fd00:10:244:1::2")])
    half.masquerade_apart(True)
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and not any(cfg6.node_addr), "the flow not carried holds its port"
    assert gauge == [1]
    rig.conntrack6 = [carried]  # the other one ended
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and abi.ip6_str(cfg6.node_addr) == "fd00:192:168::11"
    assert gauge == [1, 0]
    p.close()


def test_an_ipv6_nf_conntrack_read_that_raises_anything_leaves_the_ipv6_sync_whole(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """pyroute2's dump of IPv6 nf_conntrack may raise more than OSError (a decoder's ValueError,
    struct.error): the IPv6 maps are still written, the grant waits (ekp_cfg6 zero), a warning
    counts the failures in a row, and the next sync6 reads again."""
    from agent.ebpf.maps import read_config6

    rig.config = replace(
        rig.config,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        socket_lb=True,
        bpf_host_routing=HostRouting.BPF,
    )
    rig.conntrack6_error = ValueError("bad NLA length")
    p = rig.proxier()
    half = p.ipv6()
    p.sync(STATE, NODE)
    half.masquerade_apart(True)
    state = state6([service()], [slice_("fd00:10:244:1::2")])
    with caplog.at_level(logging.WARNING, logger="agent.ebpf.proxier"):
        half.sync(state, NODE6)
        half.sync(state, NODE6)
    assert rig.conntrack6_reads == 2, "read again at the next sync"
    assert rig.maps["fe6"].items(), "the IPv6 maps written all the same"
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and not any(cfg6.node_addr)
    said = [r.getMessage() for r in caplog.records if "cannot read IPv6 nf_conntrack" in r.getMessage()]
    assert len(said) == 2 and "ValueError: bad NLA length; 2 time(s) in a row" in said[1], said
    rig.conntrack6_error = None
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and abi.ip6_str(cfg6.node_addr) == "fd00:192:168::11"
    p.close()


def test_the_tc_ipv6_paths_snat_source_is_zero_until_a_restore_succeeds_or_where_the_path_is_off(
    rig: Rig,
) -> None:
    """ekp_cfg6 holds the node's address only once an ip6tables restore succeeded (its MASQUERADE
    keeps out of --bpf-snat-ports): failed ones before it leave it zero. A failed restore after one
    that succeeded keeps the grant: it changed no rule, those in place keep out of the range, and
    they were thinned for the grant (taking it back would leave its frontends to a stack with no
    rule for them), but reads nf_conntrack again at each sync while restores fail (a read that fails
    then keeps the grant too; one that finds a flow in the range takes it back). Where the tc IPv6
    path does not serve (no socket-level load balancing), it is zero whatever ip6tables did, over
    what a pin held."""
    from agent.ebpf.maps import read_config6, write_config6

    state = state6([service()], [slice_("fd00:10:244:1::2")])
    dual = replace(rig.config, node_ips=("192.168.0.11", "fd00:192:168::11"), socket_lb=True)
    rig.config = replace(dual, bpf_host_routing=HostRouting.BPF)
    p = rig.proxier()
    half = p.ipv6()
    p.sync(STATE, NODE)
    half.masquerade_apart(False)
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and not any(cfg6.node_addr), "no restore succeeded yet"
    half.masquerade_apart(True)
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and abi.ip6_str(cfg6.node_addr) == "fd00:192:168::11"
    reads = rig.conntrack6_reads
    half.masquerade_apart(False)
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and abi.ip6_str(cfg6.node_addr) == "fd00:192:168::11", (
        "a failed restore leaves the granted rules in place: the grant stays"
    )
    assert rig.conntrack6_reads == reads + 1, "nf_conntrack read again: the failure may have let a flow in"
    rig.conntrack6_error = ValueError("bad NLA length")
    half.masquerade_apart(False)
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and abi.ip6_str(cfg6.node_addr) == "fd00:192:168::11", (
        "a read that proves nothing keeps the grant the rules in place were thinned for"
    )
    assert rig.conntrack6_reads == reads + 2
    rig.conntrack6_error = None
    rig.conntrack6 = [
        NatFlow(
            6,
            ("fd00:ff::100", "fd00:192:168::11", 5555, 30080),
            ("fd00:a:2::7", "fd00:192:168::11", 8080, 61500),
        )
    ]
    half.masquerade_apart(False)
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and not any(cfg6.node_addr), "a flow masqueraded into the range: refused"
    rig.conntrack6 = []
    half.masquerade_apart(True)
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and abi.ip6_str(cfg6.node_addr) == "fd00:192:168::11", "it ended: granted"
    p.close()

    rig.config = replace(dual, socket_lb=False)
    p = rig.proxier()
    half = p.ipv6()
    p.sync(STATE, NODE)
    half.masquerade_apart(True)
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and not any(cfg6.node_addr), "no tc IPv6 path: no source for it"
    write_config6(rig.maps, abi.Config6(node_addr=abi.Addr6(*abi.ip6_words("fd00:192:168::11"))))
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and not any(cfg6.node_addr), "what a pin held is written over"
    p.close()


def _tc6_flow(rig: Rig, client: str, node6: str, port: int, *, last_seen_ns: int) -> abi.Ct6Key:
    """A flow the tc IPv6 path source-translated to node6:port (its FORWARD entry)."""
    key = abi.Ct6Key(
        saddr=abi.Addr6(*abi.ip6_words(client)),
        daddr=abi.Addr6(*abi.ip6_words(VIP6)),
        sport=port_be(40001),
        dport=port_be(80),
        proto=6,
        dir=abi.CtDir.FORWARD,
    )
    entry = abi.Ct6Entry(
        last_seen_ns=last_seen_ns,
        nat_addr=abi.Addr6(*abi.ip6_words("fd00:10:244:1::2")),
        snat_addr=abi.Addr6(*abi.ip6_words(node6)),
        fe_addr=abi.Addr6(*abi.ip6_words(VIP6)),
        nat_port=port_be(8080),
        snat_port=port_be(port),
        fe_port=port_be(80),
        flags=abi.CtFlag.ESTABLISHED,
    )
    rig.maps["ct6_tcp"].update(key, entry)
    return key


def test_a_restart_with_another_snat_range_keeps_ip6tables_masquerade_off_the_ports_old_tc_flows_hold(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """--bpf-snat-ports 61000-65535, then a restart with 63000-65535: MASQUERADE's side outside the
    new range (1024-62999) covers the old one, where a flow the tc IPv6 path translated in the earlier
    run still holds node6:61500 (its REPLY entry takes the backend's answers; nf_conntrack knows
    nothing of it). ip6tables' --to-ports keeps off it while it lives, and takes the whole side
    again at the first full sync6 after it ended (its entry gone)."""
    from agent.iptables import IptablesProxier

    state = state6([service()], [slice_("fd00:10:244:1::2")])
    rig.config = replace(
        rig.config,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        socket_lb=True,
        bpf_host_routing=HostRouting.BPF,
        snat_ports=(61000, 65535),
    )
    p = rig.proxier()
    half = p.ipv6()
    p.sync(STATE, NODE)
    half.masquerade_apart(True)
    half.sync(state, NODE6)
    now = time.monotonic_ns()
    held = _tc6_flow(rig, "fd00:ff::100", "fd00:192:168::11", 61500, last_seen_ns=now)
    _tc6_flow(rig, "fd00:ff::101", "fd00:192:168::11", 64000, last_seen_ns=now)  # in both ranges
    _tc6_flow(rig, "fd00:ff::102", "fd00:ff::102", 62000, last_seen_ns=now)  # the client's own address
    assert p.snat6_held() is None, "the flows are in this run's range"
    p.close()

    rig.config = replace(rig.config, snat_ports=(63000, 65535))
    p = rig.proxier()
    half = p.ipv6()
    ip6tables = IptablesProxier(rig.config, family=IPFamily.IPv6, snat6_held=p.snat6_held)
    with caplog.at_level(logging.WARNING, logger="agent.ebpf.proxier"):
        text = ip6tables.render(state, NODE6)
    assert " --to-ports 1024-61499" in text, [ln for ln in text.splitlines() if "MASQUERADE" in ln]
    assert any(
        "hold source ports 61500-61500 outside --bpf-snat-ports 63000-65535" in r.getMessage()
        for r in caplog.records
    )
    p.sync(STATE, NODE)
    half.masquerade_apart(True)
    half.sync(state, NODE6)
    assert p.snat6_held() == (61500, 61500), "held while the flow lives"
    assert rig.maps["ct6_tcp"].delete(held)
    half.sync(state, NODE6, frozenset())
    assert p.snat6_held() == (61500, 61500), "a partial sync6 does not read the tables"
    half.sync(state, NODE6)
    assert p.snat6_held() is None
    assert " --to-ports 1024-62999" in ip6tables.render(state, NODE6)
    p.close()


def test_held_ports_count_live_forward_entries_translated_to_a_node_address_outside_the_range() -> None:
    """agent/ebpf/ports.py held_outside: an entry past its idle timeout holds nothing (as the data
    path's lookup treats it), nor one inside the range, nor one translated to the client's own address."""
    from agent.ebpf.ports import held_outside

    def flow(
        port: int, *, to: str = "fd00:192:168::11", idle_s: int = 0, reply: bool = False
    ) -> tuple[abi.Ct6Key, abi.Ct6Entry]:
        key = abi.Ct6Key(
            saddr=abi.Addr6(*abi.ip6_words("fd00:ff::100")),
            proto=6,
            dir=abi.CtDir.REPLY if reply else abi.CtDir.FORWARD,
        )
        entry = abi.Ct6Entry(
            last_seen_ns=NOW_NS - idle_s * 10**9,
            snat_addr=abi.Addr6(*abi.ip6_words(to)),
            snat_port=port_be(port),
            flags=abi.CtFlag.ESTABLISHED,
        )
        return key, entry

    NOW_NS = 10**15
    cfg = abi.Config(tcp_established_s=3600)
    snat = (63000, 65535)
    assert held_outside([flow(61500), flow(62000), flow(64000)], snat, cfg, NOW_NS) == (61500, 62000)
    assert held_outside([flow(61500, idle_s=3601)], snat, cfg, NOW_NS) is None
    assert held_outside([flow(61500, idle_s=3599)], snat, cfg, NOW_NS) == (61500, 61500)
    assert held_outside([flow(61500, to="fd00:ff::100")], snat, cfg, NOW_NS) is None
    assert held_outside([flow(61500, reply=True)], snat, cfg, NOW_NS) is None


def test_the_ipv6_snat_grant_waits_for_this_runs_snat_range_in_ekp_config(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tc IPv6 path takes its ports from ekp_config's range, which only the IPv4 sync writes: a
    restart with another --bpf-snat-ports whose IPv4 sync failed before writing it leaves the
    earlier range there, which ip6tables' MASQUERADE (outside the new one) may cover. sync6 runs all
    the same: it writes no SNAT source until ekp_config holds this run's range."""
    from agent.ebpf.maps import read_config6, write_config

    state = state6([service()], [slice_("fd00:10:244:1::2")])
    rig.config = replace(
        rig.config,
        node_ips=("192.168.0.11", "fd00:192:168::11"),
        socket_lb=True,
        bpf_host_routing=HostRouting.BPF,
        snat_ports=(61000, 65535),
    )
    p = rig.proxier()
    p.sync(STATE, NODE)
    p.close()

    rig.config = replace(rig.config, snat_ports=(63000, 65535))
    p = rig.proxier()
    half = p.ipv6()

    def refused(maps: Mapping[str, MapWriter], cfg: abi.Config) -> None:
        raise OSError("ENOSPC")

    monkeypatch.setattr("agent.ebpf.proxier.write_config", refused)
    with pytest.raises(OSError):
        p.sync(STATE, NODE)
    half.masquerade_apart(True)
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and not any(cfg6.node_addr), "ekp_config still holds 61000-65535"
    monkeypatch.setattr("agent.ebpf.proxier.write_config", write_config)
    p.sync(STATE, NODE)
    half.sync(state, NODE6)
    cfg6 = read_config6(rig.maps)
    assert cfg6 is not None and abi.ip6_str(cfg6.node_addr) == "fd00:192:168::11"
    p.close()


def test_the_ipv6_snat_grant_is_told_at_each_ipv6_sync_and_its_reason_logged_when_it_changes(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """ekp_ipv6_snat_granted (on_snat6_granted) says 1 or 0 at each sync6; the log says why, once
    per change: a failed restore, no usable IPv6 address, held flows, a failed nf_conntrack read;
    granted. A path off by the flags is 0 without a word (nothing an operator can act on)."""
    no_address = NodeContext(node_ips=(), primary_ip="")
    state = state6([service()], [slice_("fd00:10:244:1::2")])
    held = NatFlow(
        6, ("fd00:ff::100", "fd00:192:168::11", 5555, 30080), ("fd00:a:2::7", "fd00:192:168::11", 8080, 61500)
    )
    dual = replace(rig.config, node_ips=("192.168.0.11", "fd00:192:168::11"), socket_lb=True)
    rig.config = replace(dual, bpf_host_routing=HostRouting.BPF)
    p = rig.proxier()
    granted: list[int] = []
    p.on_snat6_granted = granted.append
    half = p.ipv6()
    p.sync(STATE, NODE)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "the tc IPv6 path " in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        half.masquerade_apart(False)
        half.sync(state, NODE6)
        half.sync(state, NODE6)
        half.masquerade_apart(True)
        half.sync(state, no_address)
        rig.conntrack6 = [held]
        half.sync(state, NODE6)
        rig.conntrack6_error = ValueError("bad NLA length")
        half.sync(state, NODE6)
        rig.conntrack6_error = None
        rig.conntrack6 = []
        half.sync(state, NODE6)
        half.sync(state, NODE6)
    assert granted == [0, 0, 0, 0, 0, 1, 1]
    reasons = [m for m in said() if m.startswith("the tc IPv6 path leaves masqueraded flows")]
    assert [r.split(": ", 1)[1].split(" ")[:3] for r in reasons] == [
        ["no", "ip6tables", "restore"],
        ["the", "node", "has"],
        ["1", "flows", "ip6tables"],
        ["IPv6", "nf_conntrack", "could"],
    ], reasons
    assert sum("source-translates masqueraded flows" in m for m in said()) == 1
    p.close()

    caplog.clear()
    rig.config = replace(dual, socket_lb=False)
    p = rig.proxier()
    granted.clear()
    p.on_snat6_granted = granted.append
    half = p.ipv6()
    p.sync(STATE, NODE)
    with caplog.at_level(logging.INFO, logger="agent.ebpf.proxier"):
        half.masquerade_apart(True)
        half.sync(state, NODE6)
    assert granted == [0] and not [m for m in said() if "leaves masqueraded" in m]
    p.close()


def test_ipv6_udp_sockets_are_ended_after_an_ipv6_sync_that_removed_a_backend(rig: Rig) -> None:
    """The IPv6 family's sync writes the IPv6 maps (not the IPv4 ones) and runs the socket iterator
    when its membership shrank, as the IPv4 sync does; not after other IPv6 syncs."""
    p = rig.proxier()
    p.sync(STATE, NODE)
    two = state6([service()], [slice_("fd00:10:244:1::2", "fd00:10:244:2::3")])
    one = state6([service()], [slice_("fd00:10:244:1::2")])
    v4 = {role: sorted(bytes(k) for k, _ in rig.maps[role].items()) for role in ROLES}

    def runs() -> int:
        return sum(e.startswith("end stale sockets") for e in rig.events)

    before = runs()
    p.sync6(two, NODE6)
    assert runs() == before and len(rig.maps["be6"]) == 2 and len(rig.maps["fe6"]) == 2
    spn = next(iter(two.services))
    p.sync6(one, NODE6, frozenset({spn}))
    assert runs() == before + 1 and len(rig.maps["be6"]) == 1
    assert v4 == {role: sorted(bytes(k) for k, _ in rig.maps[role].items()) for role in ROLES}
    p.close()


def test_the_start_steps_see_the_ipv6_maps_once_the_first_ipv6_sync_after_the_attach_wrote_them(
    rig: Rig,
) -> None:
    """On a node the agent never served, ekp_fe6 is empty at the attach (the first IPv6 sync comes
    after it): the takeover's IPv6 carry runs again within that sync, once its backends are written
    and before its frontends are (given their svc_id), so tc decides none of the flows ip6tables
    translated as a new one in between; and only then. Before, it ran after the sync: in the lab's
    kube-proxy -> eBPF switch half a second later, and an IPv6 UDP flow's datagrams in between
    reached either backend (tests/traffic/test_switch_ipv6.py)."""
    p = rig.proxier()
    p.sync(STATE, NODE)
    assert "carry v1 conntrack again" in rig.events and not [e for e in rig.events if "IPv6 sync" in e]
    p.sync6(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
    p.sync6(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
    p.sync(STATE, NODE)
    frontends = sorted(
        {
            (abi.ip6_str(k.addr), abi.port_host(k.port), k.proto): v.svc_id
            for k, v in rig.maps["fe6"].items()
            if isinstance(k, abi.Frontend6Key) and isinstance(v, abi.Frontend)
        }.items()
    )
    assert len(rig.maps["fe6"]) == 2 and len(frontends) == 1  # both scopes of one frontend
    assert [e for e in rig.events if "IPv6 sync" in e] == [
        f"carry IPv6 flows for the first IPv6 sync's {frontends} (0 frontends, 1 backends)"
    ]
    p.close()


def test_a_restart_whose_first_ipv6_sync_writes_no_frontend_carries_the_ipv6_flows_after_it(rig: Rig) -> None:
    """A restart over unchanged IPv6 maps: the attach's carry found their frontends, the first IPv6
    sync writes none, and the carry runs once after it, as before."""
    p = rig.proxier()
    p.sync(STATE, NODE)
    p.sync6(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
    p.close()
    rig.events.clear()
    again = rig.proxier()
    again.ipv6()  # the agent makes its IPv6 half before the first sync
    again.sync(STATE, NODE)
    again.sync6(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
    assert [e for e in rig.events if "IPv6 sync" in e] == [
        "carry IPv6 flows after the first IPv6 sync (2 frontends, 1 backends)"
    ]
    again.close()


@pytest.mark.parametrize("error", [OSError(1, "Operation not permitted"), ValueError("a bad entry")])
def test_a_carry_that_raises_leaves_the_first_ipv6_sync_to_write_its_frontends(
    rig: Rig, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    """Whatever the takeover's IPv6 carry raises (nf_conntrack's node addresses unreadable, a
    decode error) costs the flows it carries, not the frontends: raised through the flush, it
    reset the IPv6 planner and every later IPv6 sync, each a first one again, failed the same way,
    ekp_fe6 never written."""
    rig.carry6_error = error
    p = rig.proxier()
    p.sync(STATE, NODE)
    with caplog.at_level(logging.WARNING):
        p.sync6(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
    assert len(rig.maps["fe6"]) == 2 and len(rig.maps["be6"]) == 1
    assert "IPv6 UDP flows not carried from nf_conntrack at the first IPv6 sync" in caplog.text
    assert str(error) in caplog.text  # the traceback names it
    assert [e for e in rig.events if e.startswith("carry IPv6")] == ["carry IPv6 flows: raised"]
    p.close()


def test_a_carry_after_a_first_ipv6_sync_without_frontends_that_raises_fails_no_sync(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """The carry that runs after a first IPv6 sync writing no frontend (a restart over unchanged
    maps) is guarded alike: the sync reports success."""
    p = rig.proxier()
    p.sync(STATE, NODE)
    p.sync6(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
    p.close()
    rig.carry6_error = OSError(1, "Operation not permitted")
    again = rig.proxier()
    again.ipv6()
    again.sync(STATE, NODE)
    with caplog.at_level(logging.WARNING):
        result = again.sync6(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
    assert not result.failed and len(rig.maps["fe6"]) == 2
    assert "IPv6 UDP flows not carried from nf_conntrack at the first IPv6 sync" in caplog.text
    again.close()


def test_without_an_ipv6_half_the_ipv6_maps_an_earlier_agent_wrote_are_emptied(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent restarted without IPv6 (its flags, or a node that cannot do it) writes no IPv6
    maps: what a dual-stack agent left there would keep sending the node's IPv6 sockets to
    addresses that may belong to other pods by now. Its first sync empties them, with the socket
    entries and affinities; an agent with an IPv6 half keeps them (they are its own)."""
    earlier = rig.proxier()
    earlier.ipv6()
    earlier.sync(STATE, NODE)
    earlier.sync6(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
    earlier.sync(STATE, NODE)  # a periodic sync of the dual-stack agent keeps its own
    assert len(rig.maps["fe6"]) == 2 and len(rig.maps["be6"]) == 1
    rig.maps["sknat6"].update(abi.Sock6Key(cookie=7), abi.Sock6Nat(svc_id=1))
    earlier.close()
    v4 = {role: sorted(bytes(k) + bytes(v) for k, v in rig.maps[role].items()) for role in ROLES}
    single = rig.proxier()
    with caplog.at_level(logging.WARNING):
        single.sync(STATE, NODE)
    assert all(len(rig.maps[role]) == 0 for role in abi.V6_ROLES.values()), "the IPv6 service maps"
    assert len(rig.maps["sknat6"]) == 0
    assert "IPv6 is not served by this agent: removed the IPv6 service entries" in caplog.text
    assert v4 == {role: sorted(bytes(k) + bytes(v) for k, v in rig.maps[role].items()) for role in ROLES}
    caplog.clear()
    single.sync(STATE, NODE)
    assert "IPv6 is not served" not in caplog.text, "said once: nothing left to remove"
    single.close()


def test_a_kernel_without_the_socket_programs_serves_the_rest(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel older than the socket programs' helpers loads the data path without them: the
    services are written and the tc programs attached, the socket links of an earlier run removed,
    and the log says what the node's own clients lose."""
    rig.unavailable = {name for name, _ in SOCK_HOOKS.values()} | {PROG_SOCK_TERM}
    p = rig.proxier()
    p.sync(STATE, NODE)
    assert rig.contents().same_entries(plan(STATE, NODE, rig.config))
    assert "link sockets" not in rig.events and "unlink sockets" in rig.events
    assert "reconcile full=True" in rig.events
    assert not any(e.startswith("end stale") for e in rig.events)
    assert "cannot load the socket programs" in caplog.text


def test_a_kernel_without_bpf_sock_destroy_links_the_socket_programs_and_says_what_it_lacks(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.unavailable = {PROG_SOCK_TERM}
    p = rig.proxier()
    p.sync(STATE, NODE)
    assert "link sockets" in rig.events and not any(e.startswith("end stale") for e in rig.events)
    assert "no bpf_sock_destroy" in caplog.text


def test_socket_lb_off_unlinks_what_an_earlier_run_left(rig: Rig) -> None:
    rig.config = replace(rig.config, socket_lb=False)
    p = rig.proxier()
    p.sync(STATE, NODE)
    assert "unlink sockets" in rig.events and "link sockets" not in rig.events
    assert not any(e.startswith("end stale") for e in rig.events)
    p.cleanup()
    assert rig.events.count("unlink sockets") == 2


def test_cleanup_puts_back_the_tcp_be_liberal_a_killed_takeover_kept_in_its_own_directory(
    rig: Rig, tmp_path: Path
) -> None:
    """`agent --cleanup`: no takeover follows, so the node's own value an agent killed mid-takeover
    kept goes back and its file goes; the file is the proxier's directory's (snapshot_dir), not
    the host's /run/ebpf-kube-proxy."""
    from agent.takeover import into_ebpf

    rig.snapshot_dir = str(tmp_path / "state")
    os.makedirs(rig.snapshot_dir)
    kept = Path(into_ebpf.liberal_path(rig.snapshot_dir, 4026532000))
    kept.write_text("0\n")
    rig.sysctl_values[into_ebpf.TCP_BE_LIBERAL] = "1"
    rig.proxier().cleanup()
    assert (rig.config.netns, into_ebpf.TCP_BE_LIBERAL, "0") in rig.sysctls
    assert not kept.exists()


def test_later_syncs_write_what_changed(rig: Rig) -> None:
    p = rig.proxier()
    p.sync(STATE, NODE)
    added = frozenset(MORE.services) - frozenset(STATE.services)
    p.sync(MORE, NODE, added)
    assert (
        p.last_flush.summary()
        == "update addr x3, update be x6, update member x6, update rnat x3, update slot x6, update fe x6"
    )
    want = p.contents()
    assert want is not None and rig.contents().same_entries(want)
    p.sync(STATE, NODE, added)
    assert (
        p.last_flush.summary()
        == "delete fe x6, delete slot x6, delete member x6, delete be x6, delete rnat x3, delete addr x3"
    )


def test_a_full_sync_repairs_what_changed_behind_our_back(rig: Rig) -> None:
    p = rig.proxier()
    p.sync(STATE, NODE)
    key, _ = rig.maps["fe"].items_raw()[0]
    rig.maps["fe"].delete_raw([key])
    p.sync(STATE, NODE, frozenset())  # a partial sync trusts what it wrote
    assert p.last_flush.writes == 0 and rig.datapaths[0].pin_checks == 0
    rig.datapaths[0].missing_pins = [MAPS["fe"].name]
    result = p.sync(STATE, NODE)  # the periodic full sync reads the maps back
    assert result.full and result.repaired == 2  # the frontend, and the pin
    assert p.last_flush.summary() == "update fe x1"
    assert rig.datapaths[0].pin_checks == 1
    assert p.sync(STATE, NODE).repaired == 0


def test_restart_re_adopts_ids_and_writes_nothing(rig: Rig) -> None:
    first = rig.proxier()
    first.sync(MORE, NODE)
    before = render_contents(rig.contents())
    first.close()  # the agent stops: nothing removed
    assert render_contents(rig.contents()) == before

    second = rig.proxier()
    second.sync(MORE, NODE)
    assert second.last_flush.writes == 0
    assert render_contents(rig.contents()) == before


def test_restart_prunes_what_went_away_but_keeps_flows(rig: Rig) -> None:
    rig.proxier().sync(MORE, NODE)
    ct_key = CtKey(
        saddr=ip_be("10.244.1.9"),
        daddr=ip_be("10.96.0.10"),
        sport=port_be(40000),
        dport=port_be(53),
        proto=17,
    )
    rig.maps["ct_any"].update(ct_key, CtEntry(backend_id=1, svc_id=1))
    kept = set(plan(STATE, NODE, rig.config).fe)

    second = rig.proxier()  # kube-dns was deleted while the agent was down
    second.sync(STATE, NODE)
    assert second.last_flush.summary() == (
        "delete fe x6, delete slot x6, delete member x6, delete be x6, delete rnat x3, delete addr x3"
    )
    assert set(rig.contents().fe) == kept
    assert rig.maps["ct_any"].lookup(ct_key) is not None


def test_a_failed_write_is_recovered_from_the_maps(rig: Rig) -> None:
    p = rig.proxier()
    p.sync(STATE, NODE)

    class Boom(FakeMap):
        fail = False

        def update_raw(self, keys: Sequence[bytes], values: Sequence[bytes]) -> int:
            if Boom.fail:
                Boom.fail = False
                super().update_raw(keys[:1], values[:1])  # half of the batch went in
                raise OSError(12, "ENOMEM")
            return super().update_raw(keys, values)

    boom = Boom(MAPS["slot"])
    boom.update_batch(rig.maps["slot"].items())
    Boom.fail = True
    rig.maps["slot"] = boom
    rig.datapaths[0]._maps = rig.maps
    added = frozenset(MORE.services) - frozenset(STATE.services)
    with pytest.raises(OSError):
        p.sync(MORE, NODE, added)
    p.sync(MORE, NODE, frozenset())  # reads the maps back, writes what is missing
    want = p.contents()
    assert want is not None and rig.contents().same_entries(want)
    assert p.last_flush.updates["fe"] == 6
    p.sync(MORE, NODE, frozenset())
    assert p.last_flush.writes == 0


def test_cleanup_detaches_and_removes_only_our_pins(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    detached: list[str] = []

    def detach_all(netns: str) -> list[str]:
        detached.append(netns)
        return ["eth0"]

    monkeypatch.setattr("agent.ebpf.proxier.detach_all", detach_all)
    pins = Path(rig.config.pin_path)
    pins.mkdir()
    for name in ("ekp_fe_v1", "ekp_fe_v0", "ekp_ct_v1"):
        (pins / name).write_text("")
    p = rig.proxier()
    p.sync(STATE, NODE)
    p.cleanup()
    assert detached == ["node1"]
    assert not pins.exists()
    assert rig.datapaths[0].closed == 1
    assert "stop" in rig.events

    pins.mkdir()
    (pins / "ekp_fe_v1").write_text("")
    (pins / "theirs").write_text("")
    assert remove_pins(str(pins)) == ["ekp_fe_v1"]
    assert sorted(os.listdir(pins)) == ["theirs"]
    assert remove_pins(str(pins / "nowhere")) == []


# ---------------------------------------------------------------------------------- kernel


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def node_ns() -> Iterator[str]:
    name = f"ekpt-{secrets.token_hex(3)}"
    sh("ip", "netns", "add", name)
    try:
        for cmd in (
            "link add eth0 type veth peer name uplink",
            "addr add 192.168.0.11/24 dev eth0",
            "link add lxc-a type veth peer name pod-a",
            "link set eth0 up",
            "link set lxc-a up",
        ):
            sh("ip", "-n", name, *cmd.split())
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
def bpffs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "bpffs"
    mnt.mkdir()
    sh("mount", "-t", "bpf", "bpf", str(mnt))
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def live(config: Config) -> MapContents:
    from agent.ebpf.maps import BpfMap

    maps = {role: BpfMap.open_pinned(MAPS[role], config.pin_path) for role in (*ROLES, "cfg", "cfgsel")}
    try:
        return read_contents(maps, read_config(maps))
    finally:
        for m in maps.values():
            m.close()


@pytest.fixture
def cgroup() -> Iterator[str]:
    """A cgroup of the test's own (never the machine's root, where the programs would serve every
    socket of the machine)."""
    root = cgroup2_root()
    assert root is not None, "cgroup2 is not mounted"
    path = os.path.join(root, new_prefix())
    os.mkdir(path)
    try:
        yield path
    finally:
        remove_cgroup_tree(path)


def cgroup_programs(path: str) -> dict[str, str]:
    """Hook -> program name of what is attached to a cgroup (bpftool)."""
    out = json.loads(sh("bpftool", "cgroup", "show", path, "-j").strip() or "[]")
    return {item["attach_type"]: item["name"] for item in out}


@pytest.mark.kernel
def test_end_to_end_sync_restart_cleanup(node_ns: str, bpffs: Path, cgroup: str, tmp_path: Path) -> None:
    # The start steps' state (the kept tcp_be_liberal, the hand-back's marker) and the planner go
    # to the test's own directory, not the machine's /run/ebpf-kube-proxy
    state = tmp_path / "state"
    config = Config(
        netns=node_ns,
        pin_path=str(bpffs / "ekp"),
        pod_interfaces=("lxc*",),
        # The default sizes, as a lab's IPv4-only agents have them: the same build, compiled once
        # for the whole run, where sizes of its own were a compile (about 19 CPU s) of their own.
        socket_lb_cgroup=cgroup,
    )
    sockets = {
        "cgroup_inet4_connect": "ekp_sock_conn",
        "cgroup_udp4_sendmsg": "ekp_sock_send",
        "cgroup_udp4_recvmsg": "ekp_sock_recv",
        "cgroup_inet4_getpeername": "ekp_sock_peer",
        "cgroup_inet6_connect": "ekp_sock_conn6",
        "cgroup_udp6_sendmsg": "ekp_sock_send6",
        "cgroup_udp6_recvmsg": "ekp_sock_recv6",
        "cgroup_inet6_getpeername": "ekp_sock_peer6",
        "cgroup_inet_sock_release": "ekp_sock_free",
    }
    node = NodeContext(node_ips=("192.168.0.11",), primary_ip="192.168.0.11")
    sh("ip", "netns", "exec", node_ns, "sysctl", "-qw", "net.ipv4.ip_forward=0")

    first = EbpfProxier(config, ipv6=False, snapshot_dir=str(state))
    try:
        first.sync(STATE, node)
        want = plan(STATE, node, config)
        assert render_contents(live(config)) == render_contents(want)
        assert render_live_maps(config.pin_path) == render_contents(want)
        text = render_live_maps(config.pin_path, INSPECT_SECTIONS)
        assert "stat packets " in text and "stat drop_no_backend 0" in text
        capacity = render_live_maps(config.pin_path, ("capacity",)).splitlines()
        assert [line.split()[0] for line in capacity[:-1]] == [spec.name for spec in MAPS.values()]
        assert capacity[-1] == "early drops unreplied 0 unassured 0 closed 0"
        fe_line = next(line for line in capacity if line.startswith(MAPS["fe"].name))
        assert f"{len(want.fe)}/{MapSizes().fe} " in fe_line
        assert " live 0 0.0%" in next(line for line in capacity if line.startswith(MAPS["ct_tcp"].name))
        assert ours(node_ns, "eth0") == ["ekp_from_net"]
        assert ours(node_ns, "lxc-a") == ["ekp_from_pod"]
        assert sh("ip", "netns", "exec", node_ns, "sysctl", "-n", "net.ipv4.ip_forward").strip() == "1"
        assert cgroup_programs(cgroup) == sockets
        shown = render_live_maps(config.pin_path, ("sockets",))
        assert "sockcfg host_netns=" in shown and " all namespaces" in shown
        assert "socklink connect4 " in shown and f"cgroup={os.stat(cgroup).st_ino}" in shown
        links = pinned_links(config.pin_path)
        assert set(links) == {
            f"{hook}{family}" for hook in ("connect", "sendmsg", "recvmsg", "getpeername") for family in "46"
        } | {"sock_release"}
        # the IPv6 family's state into the IPv6 maps, decoded by `agent inspect maps6`
        first.sync6(state6([service()], [slice_("fd00:10:244:1::2")]), NODE6)
        shown6 = render_live_maps(config.pin_path, ("services6",))
        assert f"fe6 [{VIP6}]:80/TCP internal -> svc=1 set=1 count=1" in shown6
        assert "-> [fd00:10:244:1::2]:8080/TCP" in shown6 and render_live_maps(
            config.pin_path
        ) == render_contents(want)
        first.sync(MORE, node)
        after_more = render_contents(live(config))
    finally:
        first.close()  # the agent stops; everything stays
    assert render_contents(live(config)) == after_more
    assert ours(node_ns, "eth0") == ["ekp_from_net"]
    assert cgroup_programs(cgroup) == sockets  # the pinned links hold them while no agent runs

    second = EbpfProxier(config, ipv6=False, snapshot_dir=str(state))
    try:
        second.sync(MORE, node)
        assert second.last_flush.writes == 0  # same ids, no churn
        assert pinned_links(config.pin_path) == links  # the same links, re-adopted
        assert render_contents(live(config)) == after_more
        second.sync(STATE, node)
        key = FrontendKey(addr=ip_be("10.96.0.10"), port=port_be(53), proto=17, scope=int(Scope.INTERNAL))
        assert key not in live(config).fe
        # The pins of an agent from before the IPv6 maps: inspect shows what is there.
        for role in ("sknat6", "fe6"):
            os.unlink(os.path.join(config.pin_path, MAPS[role].name))
        names = [
            line.split()[0] for line in render_live_maps(config.pin_path, ("capacity",)).splitlines()[:-1]
        ]
        assert MAPS["fe6"].name not in names and MAPS["fe"].name in names and MAPS["be6"].name in names
        assert "socklink connect4 " in render_live_maps(config.pin_path, ("sockets",))
        with pytest.raises(FileNotFoundError, match="eBPF mode"):
            render_live_maps(config.pin_path, ("services6",))
    finally:
        second.cleanup()
    assert not os.path.exists(config.pin_path)
    assert cgroup_programs(cgroup) == {}
    assert hook_programs(node_ns, "eth0") == []
    assert hook_programs(node_ns, "lxc-a") == []


def test_inspect_without_pins_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="eBPF mode"):
        render_live_maps(str(tmp_path))
    with pytest.raises(ValueError, match="known: services"):
        render_live_maps(str(tmp_path), ("nope",))


@pytest.mark.parametrize(
    ("snat", "local", "named"),
    [
        ((31000, 31999), "32768\t60999", "NodePort range 30000-32767"),
        ((50000, 60000), "32768\t60999", "net.ipv4.ip_local_port_range 32768-60999 of netns node1"),
        ((30000, 65535), "32768 60999", "NodePort range 30000-32767 (--node-port-range) and net.ipv4"),
    ],
)
def test_snat_ports_overlapping_nodeports_or_local_ports_stop_the_agent(
    rig: Rig, snat: tuple[int, int], local: str, named: str
) -> None:
    """A clear FatalError at start, naming the range it overlaps; nothing is loaded."""
    from dataclasses import replace

    from agent.errors import FatalError

    rig.config = replace(rig.config, snat_ports=snat)
    rig.local_ports = local
    with pytest.raises(FatalError, match=re.escape(named)):
        rig.proxier().sync(STATE, NODE)
    assert rig.datapaths == []


def test_snat_ports_are_checked_against_the_configured_nodeport_range(rig: Rig) -> None:
    from dataclasses import replace

    rig.config = replace(rig.config, snat_ports=(31000, 31999), nodeport_range=(20000, 22767))
    rig.proxier().sync(STATE, NODE)
    assert rig.datapaths


def test_config_entry_is_written_to_the_spare_slot_then_switched(rig: Rig) -> None:
    """Double buffer: the slot programs read is never rewritten; the selector flips."""
    from dataclasses import replace

    rig.proxier().sync(STATE, NODE)
    sel = rig.maps["cfgsel"].lookup(ctypes.c_uint32(0))
    assert isinstance(sel, ConfigSel)
    first_slot = sel.slot
    first = rig.maps["cfg"].lookup(ctypes.c_uint32(first_slot))
    rig.config = replace(rig.config, snat_ports=(62000, 65535))
    rig.proxier().sync(STATE, NODE)
    sel = rig.maps["cfgsel"].lookup(ctypes.c_uint32(0))
    assert isinstance(sel, ConfigSel) and sel.slot == 1 - first_slot
    assert rig.maps["cfg"].lookup(ctypes.c_uint32(first_slot)) == first  # untouched
    cfg = read_config(rig.maps)
    assert cfg is not None and (cfg.snat_port_min, cfg.snat_port_max) == (62000, 65535)


def test_legacy_host_routing_is_on_before_any_ingress_program_is_attached(rig: Rig) -> None:
    """A packet handed to the stack needs ekp_egress on its way out, and a packet an ingress
    program redirects skips the node's FORWARD chain: the first sync attaches ekp_egress
    everywhere, then writes EKP_CFG_HOST_LEGACY, then attaches the ingress programs, so no
    ingress program ever runs without the flag (on main it was written after the attach, the
    takeover, the socket link and serving()). With bpf host routing, and once legacy is live (a
    restart), the config is written once and nothing is attached twice."""
    seen: list[tuple[str, int]] = []

    class Recording(FakeAttacher):
        def attach_egress(self, node: NodeContext) -> None:
            live = read_config(rig.maps)
            seen.append(("egress", -1 if live is None else live.flags))

        def reconcile(
            self,
            node: NodeContext,
            *,
            full: bool = False,
            verify: bool = False,
            keep_external: bool = False,
            front: bool = False,
        ) -> None:
            live = read_config(rig.maps)
            seen.append(("ingress", -1 if live is None else live.flags))

    def proxier(config: Config) -> EbpfProxier:
        return EbpfProxier(
            config,
            datapath_factory=lambda pin_path, sizes: FakeDatapath(rig.maps),
            attacher_factory=lambda config, fds, ports: Recording(rig.events, rig.maps),
            sysctl_writer=lambda netns, path, value: "1",
            sysctl_reader=lambda netns, path: rig.local_ports,
            sizes_reader=lambda pin_path: {},
            upgrade_factory=lambda pin_path: FakeUpgrade(rig.events),
            xdp_devices_reader=lambda config, ipv6: {},
            ipv6=False,
        )

    legacy = replace(rig.config, bpf_host_routing=HostRouting.LEGACY)
    proxier(legacy).sync(STATE, NODE)
    live = read_config(rig.maps)
    assert seen == [("egress", 0), ("ingress", ConfigFlag.HOST_LEGACY)]
    assert live is not None and live.flags == ConfigFlag.HOST_LEGACY
    # The agent restarted, legacy again: the previous one attached the egress programs.
    seen.clear()
    proxier(legacy).sync(STATE, NODE)
    assert seen == [("ingress", ConfigFlag.HOST_LEGACY)]
    # Back to bpf: the flag goes at once (ekp_egress stays attached; no packet is tagged any more).
    seen.clear()
    proxier(replace(rig.config, bpf_host_routing=HostRouting.BPF)).sync(STATE, NODE)
    live = read_config(rig.maps)
    assert seen == [("ingress", 0)] and live is not None and live.flags == 0


def test_conntrack_sizes_are_derived_or_kept_from_the_pins(rig: Rig) -> None:
    """Unset conntrack sizes: the pinned tables' sizes when they exist (no resize on restart),
    else kube-proxy's max(maxPerCore x CPUs, min) flows, two entries each for TCP."""
    rig.proxier().sync(STATE, NODE)
    flows = max(32768 * (os.cpu_count() or 1), 131072)
    assert (rig.sizes[0].ct_tcp, rig.sizes[0].ct_any) == (2 * flows, flows)
    rig.pinned = {"ct_tcp": 1000, "ct_any": 500}
    rig.proxier().sync(STATE, NODE)
    assert (rig.sizes[1].ct_tcp, rig.sizes[1].ct_any) == (1000, 500)


def test_the_tc_ipv6_path_is_decided_by_the_settings_alone() -> None:
    """Config.tc_ipv6: eBPF mode, IPv6 in the flags and socket-level load balancing (the IPv6 half
    that writes the IPv6 maps exists only with it), in either host routing; any one missing, off."""
    on = Config(node_ips=("10.0.0.1", "fd00::1"), socket_lb=True, bpf_host_routing=HostRouting.BPF)
    assert on.tc_ipv6
    assert replace(on, bpf_host_routing=HostRouting.LEGACY).tc_ipv6, "the default routing too"
    for off in (
        replace(on, mode=Mode.IPTABLES),
        replace(on, node_ips=("10.0.0.1",)),
        replace(on, socket_lb=False),
    ):
        assert not off.tc_ipv6, off
    assert replace(on, node_ips=(), service_cidrs=("10.96.0.0/12", "fd00:96::/112")).tc_ipv6


def test_the_tc_ipv6_path_is_sized_from_the_settings_whether_the_load_runs_before_the_ipv6_half_or_after(
    rig: Rig,
) -> None:
    """main's start order (agent/app.py start_loading): the data path's load runs on a thread
    before build_agent makes the IPv6 half (make_proxier6 -> ipv6()). The load must build the
    same programs and table sizes in either order (MapSizes.ipv6_tc: the IPv6 conntrack at full
    size and ekp_calls6 filled), or the IPv6 path is off at nearly every start and a restart that
    loses the race resizes the tables mid-flow."""
    dual = replace(rig.config, node_ips=("10.0.0.1", "fd00::1"), socket_lb=True)
    for routing, want in (((HostRouting.LEGACY, False), False), ((HostRouting.LEGACY, True), True)):
        rig.config = replace(dual, bpf_host_routing=routing[0], socket_lb=routing[1])
        p = rig.proxier()
        p.prepare()  # the early load, before the IPv6 half exists
        p.ipv6()
        p.sync(STATE, NODE)
        assert rig.sizes[-1].ipv6_tc is want, routing
        p = rig.proxier()
        p.ipv6()  # this branch's order: the IPv6 half first
        p.sync(STATE, NODE)
        assert rig.sizes[-1].ipv6_tc is want, routing
    rig.config = replace(dual, node_ips=("10.0.0.1",), bpf_host_routing=HostRouting.BPF)
    rig.proxier().sync(STATE, NODE)
    assert rig.sizes[-1].ipv6_tc is False, "an IPv4-only node pays for no IPv6 path"


def test_the_xdp_programs_are_loaded_only_where_xdp_attaches(rig: Rig) -> None:
    """MapSizes.xdp follows --bpf-xdp: with XDP disabled nothing runs ekp_xdp_net nor
    ekp_xdp_net6, so their verification (0.4 s of a cold start) is skipped."""
    dual = replace(
        rig.config, node_ips=("10.0.0.1", "fd00::1"), socket_lb=True, bpf_host_routing=HostRouting.BPF
    )
    for mode, want in (("disabled", False), ("best-effort", True), ("native", True), ("generic", True)):
        rig.config = replace(dual, bpf_xdp=mode)
        rig.proxier().sync(STATE, NODE)
        assert rig.sizes[-1].xdp is want, mode
        assert rig.sizes[-1].ipv6_tc is True


def test_with_xdp_disabled_the_attacher_gets_no_xdp_program(rig: Rig) -> None:
    """With --bpf-xdp=disabled the data path loads no ekp_xdp_net (MapSizes.xdp): the first sync
    attaches the tc programs all the same, and the Attacher is given no XDP fd (it takes off any
    of ours an earlier run attached, found by name: tests/ebpf/test_attach.py)."""
    rig.config = replace(rig.config, bpf_xdp="disabled")
    rig.proxier().sync(STATE, NODE)
    assert rig.attacher_fds == [{n: PROG_FDS[n] for n in (PROG_FROM_NET, PROG_FROM_POD, PROG_EGRESS)}]
    assert rig.attachers[-1].nodes, "the tc programs were attached"
    rig.config = replace(rig.config, bpf_xdp="best-effort")
    rig.proxier().sync(STATE, NODE)
    assert rig.attacher_fds[-1][PROG_XDP] == rig.datapaths[-1].prog_fd(PROG_XDP)


def test_best_effort_loads_no_xdp_program_where_every_external_device_is_a_veth(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """--bpf-xdp=best-effort never attaches ekp_xdp_net to a veth (agent/ebpf/xdp.py): where every
    external device is one (kind's nodes, the lab's), the load leaves both XDP programs out and
    says so once; one device of another kind (a NIC, a bond, a dummy), devices that cannot be
    read, or none found (an address that comes later, a bond made later: unknown, and a real
    node's), load them as before; native and generic attach to veths too, so they always do."""
    caplog.set_level(logging.INFO)
    cases: list[tuple[str, dict[str, str] | Exception, bool]] = [
        ("best-effort", {"eth0": "veth", "eth1": "veth"}, False),
        ("best-effort", {}, True),
        ("best-effort", {"eth0": "veth", "eno1": ""}, True),
        ("best-effort", {"bond0": "bond"}, True),
        ("best-effort", {"br0": "bridge", "eth0": "veth", "vx0": "vxlan"}, False),
        ("best-effort", {"br0": "bridge", "tap0": "tun"}, True),
        ("best-effort", OSError(2, "no such namespace"), True),
        ("native", {"eth0": "veth"}, True),
        ("generic", {"eth0": "veth"}, True),
        ("disabled", {"eno1": ""}, False),
    ]
    for mode, devices, want in cases:
        rig.config = replace(rig.config, bpf_xdp=mode)
        rig.devices = devices
        rig.proxier().sync(STATE, NODE)
        assert rig.sizes[-1].xdp is want, (mode, devices)
        assert (PROG_XDP in rig.attacher_fds[-1]) is want
    said = [r.getMessage() for r in caplog.records if "not loaded (--bpf-xdp=best-effort" in r.getMessage()]
    assert said == [
        "all external devices are veths (eth0, eth1): ekp_xdp_net not loaded (--bpf-xdp=best-effort "
        "never attaches it to a veth; native or generic would): it is loaded, with the tc programs "
        "again, once an external device that is no veth appears",
        "no external device takes native XDP (br0 bridge, eth0 veth, vx0 vxlan): ekp_xdp_net not loaded "
        "(--bpf-xdp=best-effort attaches it to no veth, and the bridge and vxlan drivers have none; "
        "generic would run it): it is loaded, with the tc programs again, once an external device of "
        "another kind appears",
    ]
    assert any(
        r.getMessage().startswith("no external device found yet") and "loading ekp_xdp_net" in r.getMessage()
        for r in caplog.records
    )


def test_a_device_best_effort_would_try_loads_the_data_path_again_with_xdp_and_puts_it_everywhere(
    rig: Rig,
) -> None:
    """An external device that is no veth appearing after a load without XDP: the sync whose attach
    found it loads the data path again with the XDP programs (the same build, another load id: the
    sizes differ in `xdp` alone), hands every program to the Attacher with the pod-device watcher
    stopped, reconciles in full (tc replaced in place, XDP tried), links the socket programs of the
    new load (the terminator's iterator too), unpins the first load's program arrays, and closes
    the first load's fds (nothing holds them any more). Later syncs load nothing more."""
    rig.unavailable = set()
    rig.devices = {"eth0": "veth"}
    p = rig.proxier()
    p.sync(STATE, NODE)
    first, attacher = rig.datapaths[-1], rig.attachers[-1]
    assert rig.sizes == [replace(rig.sizes[0], xdp=False)]
    del rig.events[:]
    attacher.xdp_devices = {7: "eno1"}  # a NIC that appeared since, which the reconcile finds
    p.sync(STATE, NODE, frozenset())
    assert [s.xdp for s in rig.sizes] == [False, True]
    assert rig.sizes[1] == replace(rig.sizes[0], xdp=True), "only XDP differs"
    second = rig.datapaths[-1]
    assert second.loads == 1 and first.closed == 1 and second.closed == 0
    assert rig.attachers == [attacher], "the same Attacher, given the new load's programs"
    assert attacher.fds[PROG_XDP] == second.prog_fd(PROG_XDP) and attacher.ports is rig.maps["port"]
    assert rig.events == [
        "hand-over OFF",
        "stop",
        "use programs with XDP",
        "reconcile full=True",
        "watch",
        "terminator closed",
        "link sockets",
        "unpin older builds' program arrays",
    ]
    assert isinstance(p._terminator, FakeTerminator)
    assert p._terminator.prog_fd == second.prog_fd(PROG_SOCK_TERM)
    del rig.events[:]
    p.sync(STATE, NODE, frozenset())
    assert first.closed == 1 and second.closed == 0
    assert len(rig.datapaths) == 2 and rig.events == [], "nothing loaded nor attached again"


def test_a_reload_whose_attach_failed_is_finished_by_the_next_sync(rig: Rig) -> None:
    """The load with XDP went through but its full reconcile failed half way (some devices still
    run the first load's programs): that sync fails, and the next one reconciles in full again
    before the socket programs get the new load and the first load's program arrays are unpinned
    (until then the programs still attached somewhere keep theirs); the watcher runs meanwhile."""
    rig.unavailable = set()
    rig.devices = {"eth0": "veth"}
    p = rig.proxier()
    p.sync(STATE, NODE)
    attacher = rig.attachers[-1]
    attacher.xdp_devices = {7: "eno1"}
    del rig.events[:]

    def fail_after_programs() -> None:
        attacher.reconcile_error = OSError(16, "Device or resource busy")

    real = attacher.use_programs

    def use_programs(prog_fds: Mapping[str, int], ports: MapWriter) -> None:
        real(prog_fds, ports)
        fail_after_programs()

    attacher.use_programs = use_programs  # type: ignore[method-assign]
    with pytest.raises(OSError, match="busy"):
        p.sync(STATE, NODE, frozenset())
    assert rig.events == ["hand-over OFF", "stop", "use programs with XDP", "reconcile full=True", "watch"]
    assert attacher.watching
    del rig.events[:]
    p.sync(STATE, NODE, frozenset())
    assert rig.events == [
        "reconcile full=True",
        "terminator closed",
        "link sockets",
        "unpin older builds' program arrays",
    ]
    assert len(rig.datapaths) == 2, "not loaded a third time"
    del rig.events[:]
    p.sync(STATE, NODE, frozenset())
    assert rig.events == []


def test_a_reload_whose_attach_failed_is_finished_by_a_full_retry_with_the_sockets_on_open_fds(
    rig: Rig,
) -> None:
    """The reload's full reconcile failed in a periodic sync (a retry of a failed load, or the
    device found by the periodic verify), and the retry is periodic too: the first load stays open
    until the socket programs' links and the terminator have the new load's programs (they hold
    its fds until then), and the retry finishes the reload before any periodic socket reconcile.
    Closed early (by the next sync's retired loads), the socket attacher's fds were stale, the
    reload never finished and every later sync failed."""
    rig.unavailable = set()
    rig.devices = {"eth0": "veth"}
    v6 = state6([service()], [slice_("fd00:10:244:1::2")])
    p = rig.proxier()
    p.sync(STATE, NODE)
    p.sync6(v6, NODE6)
    first, attacher = rig.datapaths[-1], rig.attachers[-1]
    attacher.xdp_devices = {7: "eno1"}
    real = attacher.use_programs

    def use_programs(prog_fds: Mapping[str, int], ports: MapWriter) -> None:
        real(prog_fds, ports)
        attacher.reconcile_error = OSError(16, "Device or resource busy")

    attacher.use_programs = use_programs  # type: ignore[method-assign]
    with pytest.raises(OSError, match="busy"):
        p.sync(STATE, NODE)
    p.sync6(v6, NODE6)  # the daemon's same iteration
    second = rig.datapaths[-1]
    assert first.closed == 0, "the socket attacher and the terminator still hold its fds"
    del rig.events[:]
    attacher.use_programs = real  # type: ignore[method-assign]
    p.sync(STATE, NODE)
    assert rig.events == [
        "reconcile full=True",
        "terminator closed",
        "link sockets",
        "unpin older builds' program arrays",
        "end stale sockets (0 so far)",
    ]
    assert first.closed == 1 and second.closed == 0, "closed once nothing holds its fds"
    assert isinstance(p._socket_attacher, FakeSocketAttacher)
    assert set(p._socket_attacher.fds.values()) <= second.open_fds - {n for n in PROG_FDS.values()}
    for _ in range(2):
        p.sync(STATE, NODE)
        p.sync6(v6, NODE6)
    assert len(rig.datapaths) == 2 and second.closed == 0


def test_a_stop_right_after_a_reload_saves_the_planner_through_the_new_load(
    rig: Rig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reload shares the pinned maps, so the planners go on with the new load: no read-back at
    the next syncs, and a clean stop before the next IPv4 sync (after the same iteration's sync6)
    dumps the maps through the new load's fds to save the planner (through the first load's,
    closed by then, the dump failed and the next start read every map back)."""
    from agent.ebpf import snapshot

    rig.snapshot_dir = str(tmp_path / "state")
    os.makedirs(rig.snapshot_dir)
    rig.devices = {"eth0": "veth"}
    v6 = state6([service()], [slice_("fd00:10:244:1::2")])
    p = rig.proxier()
    p.sync(STATE, NODE)
    p.sync6(v6, NODE6)
    rig.attachers[-1].xdp_devices = {7: "eno1"}
    p.sync(STATE, NODE, frozenset())
    p.sync6(v6, NODE6, frozenset())
    assert len(rig.datapaths) == 2 and rig.datapaths[0].closed == 1
    p.close()
    assert not [r for r in caplog.records if "could not save the planner" in r.getMessage()]
    assert Path(snapshot.snapshot_path(rig.snapshot_dir, rig.config.pin_path)).exists()


def test_a_reload_whose_watcher_did_not_stop_is_put_in_place_by_the_next_sync(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """The pod-device watcher still in an attach 5 s after being told to stop (Attacher.stop_watcher
    says it did not end): an attach of its could put the first load's program back after the full
    reconcile, so the programs are not swapped; the load made is kept, and the next sync puts it in
    place without loading again. A stop meanwhile closes it."""
    rig.unavailable = set()
    rig.devices = {"eth0": "veth"}
    p = rig.proxier()
    p.sync(STATE, NODE)
    first, attacher = rig.datapaths[-1], rig.attachers[-1]
    attacher.xdp_devices = {7: "eno1"}
    attacher.stuck = 1
    del rig.events[:]
    p.sync(STATE, NODE, frozenset())
    second = rig.datapaths[-1]
    assert rig.events == ["hand-over OFF", "stop"]
    assert PROG_XDP not in attacher.fds and first.closed == 0 and second.closed == 0
    assert any("put in place by the next sync" in r.getMessage() for r in caplog.records)
    del rig.events[:]
    p.sync(STATE, NODE, frozenset())
    assert len(rig.datapaths) == 2, "not loaded again"
    assert rig.events[:3] == ["stop", "use programs with XDP", "reconcile full=True"]
    assert attacher.fds[PROG_XDP] == second.prog_fd(PROG_XDP) and first.closed == 1

    rig.devices = {"eth0": "veth"}
    p = rig.proxier()
    p.sync(STATE, NODE)
    rig.attachers[-1].xdp_devices = {7: "eno1"}
    rig.attachers[-1].stuck = 1
    p.sync(STATE, NODE, frozenset())
    p.close()
    assert rig.datapaths[-1].closed == 1, "the load not put in place is closed at a stop"


def test_a_failed_xdp_load_leaves_the_tc_programs_serving_and_is_tried_again_with_a_backoff(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """A load with the XDP programs that fails (the verifier, memlock, ENOSPC) fails no sync: the
    first load's tc programs stay on every device, the error names the device and why, and the
    failure is counted (ekp_xdp_load_failures_total). The load never compiles again (the cached
    object loaded the tc programs already), and only periodic syncs try again, the first one 60 s
    after the failure, doubled at each failure up to an hour: each try is seconds under the lock."""
    rig.devices = {"eth0": "veth"}
    rig.xdp_load_error = OSError(28, "No space left on device")
    p = rig.proxier()
    failed: list[int] = []
    p.on_xdp_load_failed = lambda: failed.append(1)
    p.sync(STATE, NODE)
    first, attacher = rig.datapaths[-1], rig.attachers[-1]
    attacher.xdp_devices = {7: "eno1"}
    result = p.sync(STATE, NODE, frozenset())
    assert not result.failed
    assert [s.xdp for s in rig.sizes] == [False, True] and rig.datapaths[-1].closed == 1
    assert rig.datapaths[-1].recompile is False and first.recompile is True
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        "loading ekp_xdp_net for eno1 failed (OSError: [Errno 28] No space left on device, 1 time(s) in "
        "a row): the tc programs serve all of its traffic; tried again by the first periodic sync "
        "after 60s (ekp_xdp_load_failures_total)"
    ]
    assert failed == [1]
    assert PROG_XDP not in attacher.fds and first.closed == 0, "the first load's programs serve"

    def loads_after(seconds: float, *, periodic: bool = True) -> int:
        rig.now += seconds
        before = len(rig.datapaths)
        p.sync(STATE, NODE, None if periodic else frozenset())
        return len(rig.datapaths) - before

    assert loads_after(100, periodic=False) == 0, "a change does not try again"
    waits = []
    for _ in range(9):
        waited = 0
        while not loads_after(30):
            waited += 30
        waits.append(waited + 30)
    # the first: 100 s had passed already (the change sync above)
    assert waits == [30, 120, 240, 480, 960, 1920, 3600, 3600, 3600], "doubled, capped at an hour"
    assert len(failed) == 10
    # weeks of hourly failures: the wait stays an hour (2 ** 1024 would overflow a float and fail
    # every periodic sync from then on, each after a verifier's run under the lock)
    p._xdp_failures = 2000
    rig.now += 3600
    assert not p.sync(STATE, NODE).failed
    assert "2001 time(s) in a row" in caplog.records[-1].getMessage()
    assert "after 3600s" in caplog.records[-1].getMessage()
    rig.xdp_load_error = None
    rig.now += 3600
    p.sync(STATE, NODE)
    assert PROG_XDP in attacher.fds, "the periodic sync after the backoff loaded it"


def test_the_lab_agents_builds_are_those_the_tests_reusing_them_load(rig: Rig, tmp_path: Path) -> None:
    """Tests that load "the lab agents' build", to take it from the machine's cache where the lab's
    agents compiled it, name it by sizes of their own: test_bpf_metrics's MapSizes(ipv6_tc=False)
    (an IPv4-only agent's), test_compile's AGENT (IPv4-only and dual-stack) and
    test_verifier_cost's MapSizes() (dual-stack). A lab agent's flags (lab/harness.py), resolved
    and loaded as the agent does, must make the same build ids: a drift would cost a compile
    (about 19 CPU s) per test and run, silently."""
    from types import SimpleNamespace
    from typing import cast

    from agent.cli import resolve
    from agent.ebpf.loader import Datapath
    from lab.core import Lab, Node
    from lab.harness import Agent
    from tests.ebpf.test_compile import AGENT
    from tests.health.test_bpf_metrics import AGENT_IPV4

    def build(sizes: MapSizes) -> str:
        # the compile cache's key; the sizes no longer reach it (the object's maps are sized at
        # load: tests/ebpf/test_onebuild.py), the Maglev table size and the source still do
        return Datapath(str(tmp_path / "unused"), sizes).build()

    reusing = {False: (AGENT_IPV4, replace(AGENT, ipv6_tc=False)), True: (AGENT, MapSizes())}
    for dual, sizes in reusing.items():
        lab = SimpleNamespace(ipv6=dual, prefix="t", tmpdir=tmp_path)
        node = SimpleNamespace(
            name="node1",
            ns="ekp-t-node1",
            ip="192.168.0.11",
            ip6="fd00:192:168::11" if dual else "",
            cgroup_root="/sys/fs/cgroup/ekp-t/node1",
        )
        agent = Agent(cast(Lab, lab), cast(Node, node), "ebpf", ["--services-file=/dev/null"])
        config = resolve(agent.flags()).config
        rig.config = replace(config, netns=rig.config.netns, pin_path=rig.config.pin_path)
        assert config.ipv6_configured is dual
        rig.proxier(ipv6=dual).sync(STATE, NODE)
        assert rig.sizes[-1].ipv6_tc is dual, "the lab's dual-stack agents serve the tc IPv6 path"
        assert [build(s) for s in sizes] == [build(rig.sizes[-1])] * len(sizes), dual


def test_fixtures_differ() -> None:
    assert set(STATE.services) < set(MORE.services)
    # with the NodePort on localhost (internal), and the node's own (HOST) twins of the ETP Local
    # Service's NodePort and load-balancer IP: Config() has no local-traffic detector
    assert len(plan(MORE, NODE, Config()).fe) == 15


def test_a_map_too_small_is_an_error_naming_the_flag_and_the_size(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    rig.maps["fe"].max_entries = 3
    p = rig.proxier()
    result = p.sync(MORE, NODE)
    assert result.failed, "what does not fit is reported"
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert f"BPF map {MAPS['fe'].name} is too small" in errors[0]
    assert "needs 15 entries, it holds 3" in errors[0] and "--bpf-fe-max=32 or more" in errors[0]
    caplog.clear()
    p.sync(MORE, NODE)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], "said once, not at every sync"
    rig.maps["fe"].max_entries = 65536
    p.sync(MORE, NODE)
    assert any("holds the desired state again" in r.getMessage() for r in caplog.records)
