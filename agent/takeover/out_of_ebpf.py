"""iptables mode taking a node over from eBPF mode, keeping established flows.

A `helm upgrade` that turns `mode` from ebpf to iptables starts an iptables-mode agent on a node
whose eBPF programs are still attached (an agent that stops leaves them serving). Left there, they
would go on translating in front of the new rules; removed without more, every flow they
translated would reach netfilter without a conntrack entry, be taken for a new flow (the kernel
picks TCP up mid-stream) and sent through the Service's rules to a random backend. So, once the
iptables proxier's first sync put its rules in place (`EbpfHandback.run`):

1. every FORWARD entry of the pinned eBPF conntrack that is a live flow (IPv4's, and the tc
   programs' IPv6 path's, `ekp_ct6_*`, as AF_INET6 entries) is written into
   nf_conntrack with its NAT bindings (agent/takeover/flows.py, agent/takeover/nfct.py): the
   kernel translates it to the same backend and SNAT source from its first packet on. Under
   legacy host routing nf_conntrack already tracks each of these flows as a plain client <->
   backend flow (`stack_flow`), whose entry holds the NAT entry's reply tuple when the source
   was not translated: it is deleted right before the flow's NAT entry is written. A packet the
   programs translate in that gap makes it again and the write is refused (EEXIST: nfct.py pins
   the ports); those flows get one more round at once.
   Once a flow's NAT entry is written, a packet the programs translate reaches the stack as a flow
   whose reply tuple that entry holds, and the stack's NAT gives it another source port: the
   backend answers that port, the stack turns the answer back to the client's port, and no eBPF
   entry knows it, so it reaches the client from the backend's own address (a UDP client's
   "stranger", which a connected socket drops) or, from a backend on the node's own address
   (CtFlag.HOST, which reaches the node's stack under either host routing), as a RST. So the
   flows the stack tracks under that reply tuple (HOST ones, and under legacy host routing every
   flow whose source is not translated) are held right before (CtFlag.HANDOVER: the programs drop
   their forward packets) and, once their NAT entries are written, passed (CtFlag.NFPASS on both
   entries: the programs leave their packets untranslated and the NAT entry translates them, as
   after the detach); a held flow whose write was refused twice stays held until the detach. So
   for the tc IPv6 path's flows too (bpf/ekp_tc6.h reads both flags as IPv4's code does). Either
   flag holds EKP_CT_HANDOVER_S from the created_s of the entry the data path reads (the REPLY one
   for a reply), so every write of a flag moves that entry's created_s to now and, between two
   flows, right before the detach and between two of its devices, every flow held or passed gets
   it again each HOLD_RENEW_NS (one found run out meanwhile is counted in a warning). A hold
   clears the flags on the REPLY entry (an NFPASS a hand-back killed before left there), and a
   write refused by the flow's own NAT entry (one such run wrote it) counts as written.
   Stopped before any of our programs left a device (a map, ctnetlink or the detach failing, or
   any other stop), the programs stay attached: flow by flow, passed ones first, each is held
   again with no NFPASS on its REPLY entry (no reply may pass untranslated once its NAT entry is
   gone), its NAT entry deleted (a held flow's too: it may have been written), and it is given
   back to them (both flags cleared); the flows waiting their turn are renewed as it goes, and a
   deletion that fails is counted while the next flow goes on. Then the hand-back is given up
   only when a permission was refused (EPERM, EACCES: no later try gets further); anything else
   is tried again, as a partial detach is. A detach stopped by anything
   after one of our programs left a device undoes nothing: the detached devices' flows need
   their NAT entries; an error names the devices detached, step 3 runs for them, the pins stay
   and `run` says to try again. Right before the first device, a marker in the lock directory
   (`marker_path`, removed with the pins, by an eBPF-mode agent's first attach to every device
   and by `agent --cleanup`: `forget_handback`) records that the detach began: no later try
   undoes anything, an agent restarted since included (a retry that detaches nothing more undoes
   nothing either). A try writes only the NAT entries no earlier try wrote or wrote half their
   timeout ago (the programs still attached translate their flows, so the entries see no packet
   and expire), holds and passes the others again with map writes only, and waits longer after
   each failure, from its end (EbpfHandback);
2. the programs are detached from every device of the node: no plain entry is made any more;
3. the flows the programs started between 1 and 2, and those still refused, are written the same
   way (entries already there kept);
4. the pins go (maps, programs, the directory), as `agent --cleanup` removes them, and with them
   the planner an eBPF-mode agent left for its next start (agent/ebpf/snapshot.py, in the lock
   directory): it describes those maps only; the model's records kept beside it; the
   tcp_be_liberal an eBPF agent killed mid-takeover left at 1 is put back (not before: its
   programs may be on devices until step 2); and the
   marker. A failure in step 3 or 4 (the programs detached everywhere) is said as such and
   tried again.

Nothing happens where no eBPF conntrack is pinned at --bpf-pin-path but that put-back of a
tcp_be_liberal kept, taking no pins for no program of a killed takeover: not always so (one
that ran with another --bpf-pin-path, filters whose pins were removed by hand; README, Left:).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

from pyroute2.netlink.exceptions import NetlinkError

from agent.config import Config
from agent.ebpf import abi
from agent.lock import LOCK_DIR
from agent.takeover.flows import (
    HOLD_RENEW_NS,
    NSEC,
    TCP,
    NatFlow,
    TcpState,
    Timeouts,
    Tuple,
    ct6_keys,
    ct_keys,
    nat_flow,
    stack_flow,
    timeout_of,
)

log = logging.getLogger(__name__)


def timeouts_of(config: Config) -> Timeouts:
    """The timeouts exported flows get (kube-proxy's conntrack settings where set)."""
    c = config.conntrack
    base = Timeouts()
    return Timeouts(
        tcp_established=int(c.tcp_established_timeout_s) or base.tcp_established,
        tcp_close_wait=int(c.tcp_close_wait_timeout_s) or base.tcp_close_wait,
        udp=int(c.udp_timeout_s) or base.udp,
        udp_stream=int(c.udp_stream_timeout_s) or base.udp_stream,
    )


def pinned_flows(pin_path: str) -> list[NatFlow]:
    """The live flows of the eBPF conntrack pinned at `pin_path`, as nf_conntrack entries: IPv4's,
    and the tc IPv6 path's (ekp_ct6_*: ip6tables' nf_conntrack then translates them on)."""
    from agent.ebpf.maps import BpfMap

    flows = []
    for role in (*abi.CT_ROLES, *abi.CT6_ROLES):
        if not os.path.exists(os.path.join(pin_path, abi.MAPS[role].name)):
            continue
        with BpfMap.open_pinned(abi.MAPS[role], pin_path) as table:
            for key, entry in table.items():
                if isinstance(key, abi.CtKey | abi.Ct6Key) and isinstance(entry, abi.CtEntry | abi.Ct6Entry):
                    flow = nat_flow(key, entry)
                    if flow is not None:
                        flows.append(flow)
    return flows


def _pinned_config(pin_path: str) -> Any:
    """The pinned programs' live config (abi.Config), None where none is pinned."""
    from agent.ebpf.maps import BpfMap, read_config

    names = [abi.MAPS[r].name for r in ("cfg", "cfgsel")]
    if not all(os.path.exists(os.path.join(pin_path, n)) for n in names):
        return None
    with (
        BpfMap.open_pinned(abi.MAPS["cfg"], pin_path) as cfg,
        BpfMap.open_pinned(abi.MAPS["cfgsel"], pin_path) as sel,
    ):
        return read_config({"cfg": cfg, "cfgsel": sel})


def _pinned_legacy(pin_path: str) -> bool:
    """Whether the pinned programs run legacy host routing (the live config's flag): the node's
    stack then sees every flow between its two translations (agent/takeover/flows.py)."""
    live = _pinned_config(pin_path)
    return live is not None and bool(live.flags & abi.ConfigFlag.HOST_LEGACY)


def _keys(flow: NatFlow) -> tuple[abi.CtKey, abi.CtKey] | tuple[abi.Ct6Key, abi.Ct6Key]:
    return ct6_keys(flow) if flow.family == 6 else ct_keys(flow)


_HELD = abi.CtFlag.NFPASS | abi.CtFlag.HANDOVER
_U32 = 0xFFFFFFFF  # created_s and the data path's seconds are __u32: their difference wraps


def _open_pinned(pin_path: str, role: str) -> Any:
    from agent.ebpf.maps import BpfMap

    exists = os.path.exists(os.path.join(pin_path, abi.MAPS[role].name))
    return BpfMap.open_pinned(abi.MAPS[role], pin_path) if exists else None


@dataclass
class Undone:
    """What StackHolds.undo did."""

    undone: int = 0  # flows given back to the programs
    deleted: int = 0  # NAT entries deleted
    failed: list[str] = field(default_factory=list)  # flows whose NAT entry's deletion failed
    lapsed: int = 0  # flows found with their window run out while the undo went on


class StackHolds:
    """The hold of the flows the node's stack tracks under the reply tuple their NAT entries take
    (module doc, step 1), one flow at a time on the pinned eBPF conntrack: a backend on the node's
    own address (CtFlag.HOST), and under legacy host routing every flow whose source is not
    translated (`stack_flow`). IPv4's and the tc IPv6 path's (ekp_ct6_*) alike.

    The data path honours either flag EKP_CT_HANDOVER_S from the created_s of the entry it reads
    (the FORWARD one for forward packets, the REPLY one for replies), so each write of a flag
    moves that entry's created_s to now (the pass both entries'), and `renew` does again every
    HOLD_RENEW_NS for every flow held or passed, until the detach: a pass over thousands of flows
    outlasts one window."""

    def __init__(
        self,
        pin_path: str,
        *,
        clock_ns: Callable[[], int] = time.monotonic_ns,  # CLOCK_MONOTONIC, as bpf_ktime_get_ns
        open_table: Callable[[str, str], Any] = _open_pinned,
        legacy: bool | None = None,  # None: read from the pinned config at the first hold
    ) -> None:
        self._pin_path = pin_path
        self._clock_ns = clock_ns
        self._open_table = open_table
        self._legacy = legacy
        self._tables: dict[str, Any] = {}
        self._held: dict[Tuple, NatFlow] = {}  # held, their NAT entries not written (yet)
        self._passed: dict[Tuple, NatFlow] = {}  # passed to their NAT entries
        self._renewed_ns: int | None = None
        self._lapsed: set[Tuple] = set()
        self._act_failed = False
        self._cfg: Any = None  # the pinned programs' live config (their conntrack timeouts)
        self._cfg_read = False
        self.held = 0  # flows held
        self.passed = 0  # of them, passed to their NAT entries
        self.lapsed: list[NatFlow] = []  # flows whose hold or pass the agent found run out

    def _table(self, flow: NatFlow) -> Any:
        role = abi.ct_role(flow.proto)
        if flow.family == 6:
            role = role.replace("ct_", "ct6_")  # the tc IPv6 path's, ekp_ct6_*
        if role not in self._tables:
            self._tables[role] = self._open_table(self._pin_path, role)
        return self._tables[role]

    def _update(self, table: Any, key: abi.CtKey | abi.Ct6Key, entry: abi.CtEntry | abi.Ct6Entry) -> None:
        from agent.ebpf.maps import MapError, UpdateFlag

        try:
            table.update(key, entry, UpdateFlag.EXIST)
        except MapError as exc:
            if exc.errno != errno.ENOENT:  # ended meanwhile
                raise

    def _write(self, flow: NatFlow, forward: tuple[int, int] | None, reply: tuple[int, int] | None) -> bool:
        """(flags cleared, flags set) on each of its FORWARD and REPLY entries; None: no change.
        created_s moves to now on an entry that holds a flag before or after (the window); every
        entry written is stamped seen (the data path stamps no packet it drops or passes, and a
        reply entry of a held flow sees none while its forward packets drop: without this a
        quiet UDP flow could expire in eBPF conntrack during a long hand-back). An entry whose
        flags stay as they are, holding nothing, is written only once idle for more than half its
        state's timeout (`_idle`): each write may lose a change the data path made since the
        read. Returns whether either held already and had run out."""
        table = self._table(flow)
        now_ns = self._clock_ns()
        now_s = now_ns // NSEC
        lapsed = False
        stamped: list[tuple[Any, Any]] = []
        keys: tuple[abi.CtKey | abi.Ct6Key, ...] = _keys(flow)
        for key, change in zip(keys, (forward, reply), strict=True):
            entry = table.lookup(key)
            if not isinstance(entry, abi.CtEntry | abi.Ct6Entry):
                continue
            before = entry.flags
            held = bool(before & _HELD)
            lapsed = lapsed or (held and (now_s - entry.created_s) & _U32 >= abi.CT_HANDOVER_S)
            if change is not None:
                clear, add = change
                entry.flags = (before & ~clear) | add
            if entry.flags == before and not held and not self._idle(flow, entry, now_ns):
                continue
            if held or entry.flags & _HELD:
                entry.created_s = now_s & _U32
            entry.last_seen_ns = max(entry.last_seen_ns, now_ns)
            self._update(table, key, entry)
            stamped.append((key, entry))
        self._stamp_endpoints(flow, stamped, now_ns)
        return lapsed

    def _idle(self, flow: NatFlow, entry: Any, now_ns: int) -> bool:
        """Whether an entry that holds no flag has been idle for more than half its state's
        timeout (the programs' own, bpf/ekp_ct.h): only then is it stamped. A busy one needs no
        stamp to live through the hand-back, and a write may lose a change the data path made
        since the read (a FIN, its own stamp): the longer it has been idle, the less likely."""
        from agent.ebpf.capacity import ct_timeout_s

        if not self._cfg_read:
            self._cfg_read = True
            try:
                self._cfg = _pinned_config(self._pin_path)
            except OSError as exc:  # the programs' defaults: the timeouts of a config never set
                log.warning(
                    "cannot read the pinned config at %s (%s): default timeouts assumed", self._pin_path, exc
                )
        timeout_ns = ct_timeout_s(self._cfg, flow.proto, entry.flags) * NSEC
        return bool(now_ns - entry.last_seen_ns > timeout_ns // 2)

    def _stamp_endpoints(self, flow: NatFlow, stamped: list[tuple[Any, Any]], now_ns: int) -> None:
        """ekp_act's invariant (bpf/ekp_act.h): an entry stamped seen has its flow's endpoints
        stamped too, or the activity check could let its packets leave without a lookup. A failure
        is warned about once: the entries' own stamps matter more than this."""
        from agent.ebpf import activity
        from agent.ebpf.maps import MapError

        if not stamped:
            return
        if "act" not in self._tables:
            self._tables["act"] = self._open_table(self._pin_path, "act")
        act = self._tables["act"]
        if act is None:
            return
        try:
            if flow.family == 6:
                activity.stamp6(act, stamped, now_ns)
            else:
                activity.stamp4(act, stamped, now_ns)
        except MapError as exc:
            if not self._act_failed:
                self._act_failed = True
                log.warning(
                    "cannot stamp the handed-back flows' endpoints in ekp_act (%s): the programs'"
                    " activity check may let a packet of a quiet flow leave untranslated before the"
                    " detach",
                    exc,
                )

    def _ran_out(self, flow: NatFlow) -> None:
        if flow.orig not in self._lapsed:
            self._lapsed.add(flow.orig)
            self.lapsed.append(flow)

    def hold(self, flow: NatFlow) -> bool:
        """CtFlag.HANDOVER on its FORWARD entry: the programs drop its forward packets. Whether
        it is held (registered: a flow the stack tracks under its NAT entry's reply tuple)."""
        if self._legacy is None:
            self._legacy = _pinned_legacy(self._pin_path)
        table = self._table(flow)
        if table is None:
            return False
        entry = table.lookup(_keys(flow)[0])
        if not isinstance(entry, abi.CtEntry | abi.Ct6Entry):
            return False
        tracked = self._legacy and stack_flow(flow).reply == flow.reply
        if not (entry.flags & abi.CtFlag.HOST or tracked):
            return False
        if self._renewed_ns is None:
            self._renewed_ns = self._clock_ns()
        again = flow.orig in self._held  # a second round's
        if not again:  # before the write: one that half lands (FORWARD, not REPLY) is undone too
            self._held[flow.orig] = flow
            self.held += 1
        # a REPLY flag left by a hand-back killed before (SIGKILL) is cleared, not renewed: the
        # flow's replies go to the programs until its NAT entry is written
        if self._write(flow, (abi.CtFlag.NFPASS, abi.CtFlag.HANDOVER), (_HELD, 0)) and again:
            self._ran_out(flow)
        return True

    def release(self, flow: NatFlow) -> None:
        """HANDOVER swapped for CtFlag.NFPASS on both its entries: the programs pass its packets
        untranslated, to the NAT entry just written. The REPLY entry's created_s moves too: it is
        the one the data path reads for a reply, and an established flow's is its real start."""
        if flow.orig not in self._held:
            return
        change = (abi.CtFlag.HANDOVER, abi.CtFlag.NFPASS)
        # before the write: its NAT entry is written, so an undo must delete it even if the write fails
        self._passed[flow.orig] = self._held.pop(flow.orig)
        self.passed += 1
        if self._write(flow, change, change):
            self._ran_out(flow)

    def renew(self, *, force: bool = False) -> None:
        """Every flow held or passed given its window again, at most every HOLD_RENEW_NS (`force`:
        now). One found run out is counted (the programs translated it meanwhile: its NAT entry may
        have given a packet another port) and renewed all the same: until the detach, the pass is
        its only right path, its NAT entry being written (or, held, being written)."""
        now_ns = self._clock_ns()
        if self._renewed_ns is None or (not force and now_ns - self._renewed_ns < HOLD_RENEW_NS):
            return
        for flow in (*self._held.values(), *self._passed.values()):
            if self._write(flow, None, None):
                self._ran_out(flow)
        # from the end of the pass: a pass that takes long is not followed by another at once
        self._renewed_ns = self._clock_ns()

    def undo(self, delete: Callable[[list[NatFlow]], int]) -> Undone:
        """The hand-back given up before the detach: flow by flow, passed ones first, held again
        (its forward packets drop; its replies go to the programs, no NFPASS: while the NAT entry
        exists the stack reverse-NATs them anyway, and once `delete` removed it no reply may pass
        untranslated), its NAT entry deleted (a held flow's too: create_flows may have written it
        before the pass), then given back to the programs (both flags cleared, so they translate
        it as before the hand-back; under legacy host routing the stack tracks it again as client
        <-> backend from its next packet). The flows still waiting their turn keep their windows:
        renewed at the start (the clock ran through the step that failed) and every HOLD_RENEW_NS
        between two flows, so none is translated with its NAT entry in place however slow the
        deletions. A deletion that fails (any exception) is counted and the next flow goes on: the
        later flows' NAT entries must go all the same."""
        from agent.ebpf.maps import MapError

        done = Undone()
        lapsed_before = len(self.lapsed)
        unwritten: list[str] = []

        def write(flow: NatFlow, forward: tuple[int, int], reply: tuple[int, int]) -> None:
            try:
                if self._write(flow, forward, reply):
                    self._ran_out(flow)  # translated by the programs with its NAT entry in place
            except MapError as exc:  # the rest is undone all the same
                unwritten.append(f"{flow.describe()}: {exc}")

        try:
            try:
                self.renew(force=True)
            except MapError as exc:
                unwritten.append(f"the renewal before the undo: {exc}")
            while self._passed or self._held:
                waiting = self._passed if self._passed else self._held
                flow = waiting.pop(next(iter(waiting)))  # no longer renewed: undone from here on
                write(flow, (abi.CtFlag.NFPASS, abi.CtFlag.HANDOVER), (abi.CtFlag.NFPASS, 0))
                try:
                    done.deleted += delete([flow])
                except Exception as exc:  # any: the later flows' NAT entries must go all the same
                    why = exc if isinstance(exc, OSError | NetlinkError) else repr(exc)
                    done.failed.append(f"{flow.describe()}: {why}")
                write(flow, (_HELD, 0), (_HELD, 0))
                done.undone += 1
                try:
                    self.renew()
                except MapError as exc:
                    unwritten.append(f"a renewal during the undo: {exc}")
            return done
        finally:
            # stopped (KeyboardInterrupt, SystemExit): the flows not reached keep their NAT entries
            # either way; cleared, the programs translate them now rather than once the window ends
            for flow in (*self._passed.values(), *self._held.values()):
                write(flow, (_HELD, 0), (_HELD, 0))
            self._held.clear()
            self._passed.clear()
            done.lapsed = len(self.lapsed) - lapsed_before
            for line in unwritten[:10]:
                log.warning("a flow's hold could not be undone in eBPF conntrack: %s", line)

    def close(self) -> None:
        for table in self._tables.values():
            if table is not None:
                table.close()
        self._tables.clear()


class Holds(Protocol):
    """StackHolds' face to EbpfHandback (a fake in the tests)."""

    held: int
    passed: int
    lapsed: list[NatFlow]

    def hold(self, flow: NatFlow) -> bool: ...

    def release(self, flow: NatFlow) -> None: ...

    def renew(self) -> None: ...

    def undo(self, delete: Callable[[list[NatFlow]], int]) -> Undone: ...

    def close(self) -> None: ...


def _create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Any:
    from agent.takeover.nfct import create_flows

    return create_flows(netns, flows, timeouts, clear_first=stack_flow, hold=hold)


def _delete(netns: str, flows: list[NatFlow]) -> int:
    from agent.takeover.nfct import delete_flows

    return delete_flows(netns, flows)


def _detach(netns: str, detached: list[str], between: Callable[[], None]) -> None:
    from agent.ebpf.attach import detach_all

    detach_all(netns, detached, between=between)


def _remove_pins(pin_path: str) -> list[str]:
    from agent.ebpf.proxier import remove_pins

    return remove_pins(pin_path)


def _remove_planner(snapshot_dir: str, pin_path: str) -> None:
    from agent import keptfile
    from agent.ebpf import snapshot
    from agent.keptrecords import records_path

    keptfile.remove(snapshot.snapshot_path(snapshot_dir, pin_path))
    # the model's records kept beside it (agent.keptrecords): still true of their objects, but
    # only an eBPF-mode start reads them, and tmpfs holds them in memory until one does
    keptfile.remove(records_path(snapshot_dir, pin_path))


_MARKER_MAX = 1 << 16
RETRY_MAX_S = 300.0  # the longest wait between two tries of a hand-back a partial detach left


def marker_path(directory: str, pin_path: str) -> str:
    """The hand-back's "detach begun" file for `pin_path` (resolved, as agent.lock names the pin
    path's lock file), beside the planner's in the lock directory."""
    digest = hashlib.sha256(os.path.realpath(pin_path).encode()).hexdigest()[:16]
    return os.path.join(directory, f"handback-{digest}.detached")


def _put_back_liberal(config: Config, directory: str) -> None:
    from agent.takeover.into_ebpf import put_back_liberal

    put_back_liberal(config, directory)


def forget_handback(directory: str, pin_path: str) -> None:
    """The marker of a hand-back out of eBPF mode removed: an eBPF-mode agent attached its
    programs to every device since (or `agent --cleanup` removed them), so the next hand-back
    starts afresh; left there, it would match the same pins and forbid the undo a later
    hand-back that fails before its detach needs."""
    path = marker_path(directory, pin_path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning(
            "cannot remove %s (%s): a later hand-back to iptables mode that fails before its detach"
            " will take it as begun and undo nothing; remove the file by hand",
            path,
            exc,
        )
        return
    log.info("removed %s: the hand-back out of eBPF mode it recorded is over", path)


def _pins_id(pin_path: str) -> str:
    """Which pins a marker is about: the inode of the pinned conntrack (new pins, a new inode)."""
    for role in ("ct_tcp", "ct_any"):
        with suppress(OSError):
            return str(os.stat(os.path.join(pin_path, abi.MAPS[role].name)).st_ino)
    return ""


def _write_marker(path: str, pins: str, detached: list[str]) -> None:
    """The marker (first line `pins <id>`, then the devices known detached), renamed over."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{line}\n" for line in (f"pins {pins}", *sorted(set(detached)))))
    os.replace(tmp, path)


def _read_marker(path: str, pins: str) -> list[str] | None:
    """The devices the marker names ([] when it names none: a detach begun whose devices are not
    known); None when there is none, or it is about other pins (removed then). One that cannot be
    read counts as a detach begun: an undo it wrongly prevents leaves flows to the programs after
    their windows run out (strangers), one it wrongly allows deletes NAT entries detached devices'
    flows need."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s (%s): taken as a hand-back whose detach began", path, exc)
        return []
    with os.fdopen(fd, "rb") as f:
        lines = f.read(_MARKER_MAX).decode(errors="replace").splitlines()
    if lines and lines[0].startswith("pins ") and lines[0] != f"pins {pins}":
        log.info("removed %s: left by a hand-back from pins that are gone", path)
        with suppress(OSError):
            os.unlink(path)
        return None
    return [line for line in lines[1:] if line]


class MarkerFailed(Exception):
    """The "detach begun" marker could not be written before the first device: nothing was
    detached, and a later try may find the lock directory writable."""


def _denied(exc: BaseException) -> bool:
    """A permission refused (EPERM, EACCES: a capability or the seccomp profile missing), which no
    later try gets past; any other error (ENOBUFS, EINTR, EBUSY, a bug) is tried again."""
    code = exc.code if isinstance(exc, NetlinkError) else getattr(exc, "errno", None)
    return code in (errno.EPERM, errno.EACCES)


class PartialDetach(Exception):
    """The programs left some devices (`detached`) and not others, or the hand-back stopped after
    the detach began: it is tried again."""

    def __init__(self, detached: list[str]) -> None:
        super().__init__(f"detached from {','.join(sorted(detached)) or 'devices not recorded'} only")
        self.detached = detached


class EbpfHandback:
    """The eBPF data path's flows handed to nf_conntrack, then its programs and pins removed.

    Once the detach began (this agent's, or a killed one's, as the marker in the lock directory
    says), nothing is undone any more; a failure, then or before (but a permission refused), is
    tried again, waiting from the try's end one --iptables-sync-period, doubled each time, up to
    RETRY_MAX_S. A try writes only the flows no earlier try wrote (created, or found written: kept
    in `_written` with the time, those of the try's read only) or wrote half their timeout ago
    (`_unwritten`), and passes the others again with map writes only: a NAT entry written again
    would bring a flow that closed meanwhile back as established, and each write costs netlink
    round trips inside a sync."""

    def __init__(
        self,
        config: Config,
        *,
        read: Callable[[str], list[NatFlow]] = pinned_flows,
        create: Callable[[str, Iterable[NatFlow], Timeouts, Holds | None], Any] = _create,
        # (netns, the caller's list each device is appended to as soon as a program of ours left
        # it, called between two devices)
        detach: Callable[[str, list[str], Callable[[], None]], None] = _detach,
        remove_pins: Callable[[str], list[str]] = _remove_pins,
        holds: Callable[[str], Holds] = StackHolds,
        delete: Callable[[str, list[NatFlow]], int] = _delete,
        snapshot_dir: str | None = None,  # None: agent.lock.LOCK_DIR
        clock: Callable[[], float] = time.monotonic,
        put_back_liberal: Callable[[Config, str], None] | None = None,  # None: into_ebpf's
    ) -> None:
        self._config = config
        self._read = read
        self._create = create
        self._detach = detach
        self._remove_pins = remove_pins
        self._holds = holds
        self._delete = delete
        # where the eBPF agent left its planner (agent/app.py), and this hand-back its marker
        self._snapshot_dir = LOCK_DIR if snapshot_dir is None else snapshot_dir
        self._clock = clock
        self._put_back_liberal = put_back_liberal or _put_back_liberal
        self._detached: list[str] = []  # the devices our programs left, over every run
        self._begun = False  # the detach began (this agent's or an earlier one's): no undo
        self._marker_read = False
        # (orig, reply) of the flows whose NAT entries a run wrote (or found), with the clock
        # when: an entry idle in nf_conntrack (its flow translated by programs still attached)
        # times out, so an old one counts as unwritten again (`_unwritten`)
        self._written: dict[tuple[Tuple, Tuple], float] = {}
        self._retry_s = 0.0
        self._retry_at: float | None = None

    @property
    def pending(self) -> bool:
        pin_path = self._config.pin_path
        return any(os.path.exists(os.path.join(pin_path, abi.MAPS[r].name)) for r in ("ct_tcp", "ct_any"))

    @property
    def _marker(self) -> str:
        return marker_path(self._snapshot_dir, self._config.pin_path)

    def run(self) -> bool:
        """Whether the hand-back is over (done, nothing to do, or given up with the programs left
        attached, said in an error); False once the detach began and the hand-back did not end (a
        partial detach, or a later step failing): the pins stay, and a later call tries again once
        its wait is over (a call before that does nothing)."""
        if not self.pending:
            # no pins: taken for no program of a killed takeover (see the module's docstring)
            self.put_back_liberal()
            return True
        if self._retry_at is not None and self._clock() < self._retry_at:
            return False
        if not self._marker_read:
            self._marker_read = True
            known = _read_marker(self._marker, _pins_id(self._config.pin_path))
            if known is not None:
                self._begun = True
                self._detached.extend(d for d in known if d not in self._detached)
        try:
            self._run()
            return True
        except PartialDetach:
            pass  # said in _run's error
        except Exception as exc:  # before the detach: undone (the programs serve every device)
            from agent.ebpf.attach import DetachFailed

            if isinstance(exc, DetachFailed):
                what = f"could not detach the programs from any device ({'; '.join(exc.failed)})"
                needs = "CAP_NET_ADMIN"
            else:
                what = f"stopped before the detach ({exc!r})"
                needs = "CAP_BPF, CAP_NET_ADMIN and a seccomp profile that allows bpf(2)"
            if _denied(exc):  # no later try gets further: given up, said once
                log.error(
                    "the hand-back out of eBPF mode at %s %s: its programs stay attached and go on"
                    " translating in front of the rules; the flows held so far are given back to them."
                    " The agent needs %s (the chart's takeOverFromEbpf); or run `agent --cleanup` on the"
                    " node, which drops the established connections",
                    self._config.pin_path,
                    what,
                    needs,
                )
                return True
            log.error(
                "the hand-back out of eBPF mode at %s %s: its programs stay attached and go on"
                " translating in front of the rules; the flows held so far are given back to them;"
                " tried again in %.0f s",
                self._config.pin_path,
                what,
                self._next_wait(),
            )
        self._retry_s = self._next_wait()
        # from the end of the try: a try that took long is not followed by another at once
        self._retry_at = self._clock() + self._retry_s
        return False

    def _next_wait(self) -> float:
        """The wait after this failed try: one sync period, doubled each time, up to RETRY_MAX_S."""
        return min(max(self._config.sync_period_s, self._retry_s * 2), RETRY_MAX_S)

    def _stopped(self, stage: str, exc: BaseException) -> PartialDetach:
        """A step after the detach began failed: said, and tried again."""
        log.error(
            "the hand-back out of eBPF mode stopped %s (%s), after the programs left %s: nothing is"
            " undone (those devices' flows need their NAT entries) and the pins at %s stay; tried"
            " again in %.0f s",
            stage,
            exc,
            ",".join(sorted(self._detached)) or "devices an earlier agent did not record",
            self._config.pin_path,
            self._next_wait(),
        )
        return PartialDetach(self._detached)

    def _note(self, flows: list[NatFlow], created: Any, at: float, *, kept: bool = False) -> None:
        """The flows `created` wrote at `at` (the clock before the write; `kept`: an entry found
        on the tuple counts too)."""
        refused = set() if kept else {f.orig for f in created.taken}
        left = refused | {f.orig for f in created.unwritten}
        self._written.update({(f.orig, f.reply): at for f in flows if f.orig not in left})

    def _unwritten(self, flows: list[NatFlow], timeouts: Timeouts, now: float) -> list[NatFlow]:
        """Of `flows`, those whose NAT entry no run wrote, or wrote so long ago (half its timeout)
        that it may have expired: while some devices keep the programs, they translate the flows
        through them and the NAT entry sees no packet (UDP: 30 s, against retries 30-300 s apart).
        An established TCP flow's entry (a day) stays: written again, one closed meanwhile would
        come back established. Written again, one still there is kept (EEXIST counts as present)."""
        todo = []
        for flow in flows:
            at = self._written.get((flow.orig, flow.reply))
            if at is not None and (
                (flow.proto == TCP and flow.tcp_state == TcpState.ESTABLISHED)
                or now - at < timeout_of(flow, timeouts) / 2
            ):
                continue
            todo.append(flow)
        return todo

    def _renewing(self, holds: Holds) -> Callable[[], None]:
        """holds.renew for the detach's walk: a map error there fails no device (said once)."""
        from agent.ebpf.maps import MapError

        said: list[bool] = []

        def renew() -> None:
            try:
                holds.renew()
            except MapError as exc:
                if not said:
                    said.append(True)
                    log.warning(
                        "cannot renew the handed-back flows' holds between two devices (%s): the"
                        " detach goes on; a hold that runs out before it ends is counted at the end",
                        exc,
                    )

        return renew

    def _run(self) -> None:
        from agent import keptfile
        from agent.ebpf.attach import DetachFailed
        from agent.takeover.nfct import Created

        started = time.monotonic()
        netns, pin_path = self._config.netns, self._config.pin_path
        timeouts = timeouts_of(self._config)
        try:
            first = self._read(pin_path)
            holds = self._holds(pin_path)
        except Exception as exc:
            if self._begun:
                raise self._stopped("reading the pinned eBPF conntrack", exc) from exc
            raise
        # appended by the detach as soon as one of our programs left a device; kept from an earlier
        # run that detached some devices only: their flows need the NAT entries whatever happens now
        detached = self._detached
        # only this read's flows are kept: a new flow reusing an ended one's tuples is written
        current = {(f.orig, f.reply) for f in first}
        self._written = {k: at for k, at in self._written.items() if k in current}
        todo = self._unwritten(first, timeouts, self._clock())
        waiting = {f.orig for f in todo}
        done = Created(unwritten=todo)  # what a stop before the first round ends leaves to step 3
        again = Created()
        begun = self._begun
        try:
            try:
                for flow in first:
                    if flow.orig not in waiting:  # an earlier run wrote its NAT entry: passed again
                        holds.renew()
                        holds.hold(flow)
                        holds.release(flow)
                at = self._clock()
                done = self._create(netns, todo, timeouts, holds)
                self._note(todo, done, at)
                at = self._clock()
                again = self._create(netns, done.taken, timeouts, holds)
                self._note(done.taken, again, at)
                holds.renew()  # the windows must outlast the walk over every device
                if not begun:  # before the first device: a restart must know the detach began
                    try:
                        _write_marker(self._marker, _pins_id(pin_path), detached)
                    except OSError as exc:  # EACCES here is the lock directory's, not a capability
                        raise MarkerFailed(f"cannot write {self._marker}: {exc}") from exc
                self._detach(netns, detached, self._renewing(holds))
            except BaseException as exc:  # any stop before the detach was complete
                if not detached and not begun:  # no flow may stay passed: the programs serve every device
                    with suppress(OSError):
                        os.unlink(self._marker)
                    self._written.clear()
                    self._undo(netns, holds, exc)
                    raise  # said by run()
                self._begun = True
                with suppress(OSError):  # the devices named, for the log of an agent started later
                    _write_marker(self._marker, _pins_id(pin_path), detached)
                # the detached devices' flows meet the rules from now on: whatever stopped the
                # detach, their NAT entries must stay
                refused = "; ".join(exc.failed) if isinstance(exc, DetachFailed) else repr(exc)
                log.error(
                    "the hand-back out of eBPF mode detached the programs from %s but not from all"
                    " devices (%s): the NAT entries written stay (the detached devices' flows need"
                    " them); the flows through the devices still attached are translated by the"
                    " programs with those entries in place once their holds run out (%d s). The pins"
                    " stay and the hand-back is tried again in %.0f s; or run `agent --cleanup` on"
                    " the node to detach them",
                    ",".join(sorted(detached)) or "devices an earlier agent did not record",
                    refused,
                    abi.CT_HANDOVER_S,
                    self._next_wait(),
                )
                if isinstance(exc, Exception):
                    # step 3 for the detached devices: their flows started since, or not written
                    try:
                        late = self._write_late(netns, pin_path, timeouts)
                        failed_lines = [*done.failed, *again.failed, *late.failed]
                    except Exception as late_exc:
                        failed_lines = [f"the flows started since the first read: {late_exc!r}"]
                    for line in failed_lines[:10]:
                        log.warning("an eBPF flow could not be handed to nf_conntrack: %s", line)
                    raise PartialDetach(detached) from exc
                raise  # KeyboardInterrupt, SystemExit: the stop goes on
        finally:
            holds.close()
        self._begun = True  # detached from every device: whatever fails now is tried again
        try:
            more = self._write_late(netns, pin_path, timeouts)
        except Exception as exc:
            raise self._stopped("writing the flows the programs started during the hand-back", exc) from exc
        try:
            removed = self._remove_pins(pin_path)
            _remove_planner(self._snapshot_dir, pin_path)
            keptfile.remove(self._marker)
        except Exception as exc:
            raise self._stopped("removing the pins (the programs left every device)", exc) from exc
        self.put_back_liberal()
        failed = [*done.failed, *again.failed, *more.failed]
        for line in failed[:10]:
            log.warning("an eBPF flow could not be handed to nf_conntrack: %s", line)
        if holds.lapsed:
            log.warning(
                "%d of the %d flows the node's stack tracks were found with their hold or pass (%d s,"
                " renewed every %d s while the agent went on) run out before the detach: the programs"
                " translated them meanwhile, and the stack's NAT may have given a packet another"
                " source port (a stranger or a reset; the agent was starved of CPU for seconds?); first: %s",
                len(holds.lapsed),
                holds.held,
                abi.CT_HANDOVER_S,
                HOLD_RENEW_NS // NSEC,
                holds.lapsed[0].describe(),
            )
        log.info(
            "took over from eBPF mode: %d established flows handed to nf_conntrack (%d before the"
            " programs were detached from %s, %d of them in a second round, %d after; %d there"
            " already, %d failed; %d the node's stack tracks held meanwhile, %d of them passed to"
            " their NAT entries before the detach), %d pins removed from %s, %.0f ms",
            done.created + again.created + more.created,
            done.created + again.created,
            ",".join(sorted(detached)) or "no device",
            again.created,
            more.created,
            more.present,
            len(failed),
            holds.held,
            holds.passed,
            len(removed),
            pin_path,
            (time.monotonic() - started) * 1000,
        )

    def put_back_liberal(self) -> None:
        """The node's own tcp_be_liberal an eBPF agent killed mid-takeover kept (into_ebpf's
        `put_back_liberal`), once no program of ours is on any device: before, a flow the programs
        translate one way only would meet netfilter's window checks (INVALID, dropped: resets)."""
        try:
            self._put_back_liberal(self._config, self._snapshot_dir)
        except Exception as exc:  # the hand-back is done: a sysctl left at 1 is no reason to redo it
            log.error(
                "cannot put back the nf_conntrack_tcp_be_liberal an eBPF agent killed mid-takeover kept in"
                " %s (%r): netfilter's TCP window checks may stay off; check the takeover-netns-*.liberal"
                " file there, set the value by hand and remove the file",
                self._snapshot_dir,
                exc,
            )

    def _write_late(self, netns: str, pin_path: str, timeouts: Timeouts) -> Any:
        """Step 3: the flows the programs started since, and those no run wrote (refused twice,
        or whose write failed) or whose NAT entry may have expired (`_unwritten`), written with
        nothing to hold (detached; an entry already on the tuple kept)."""
        at = self._clock()
        late = self._unwritten(self._read(pin_path), timeouts, at)
        created = self._create(netns, late, timeouts, None)
        self._note(late, created, at, kept=True)
        return created

    def _undo(self, netns: str, holds: Holds, exc: BaseException) -> None:
        """Given up before the detach: the programs stay attached, so no flow may stay passed to a
        NAT entry once its window runs out (they would translate it with that entry in place):
        those entries deleted and the flows given back to the programs (StackHolds.undo)."""
        passed = holds.passed
        undone = holds.undo(lambda flows: self._delete(netns, flows))
        lapsed = (
            f"; {undone.lapsed} found with their window run out meanwhile (translated by the programs"
            " with their NAT entries in place: a stranger or a reset; the agent starved of CPU?)"
            if undone.lapsed
            else ""
        )
        if undone.failed:
            log.error(
                "the hand-back out of eBPF mode stopped (%s): the %d flows held so far are given back"
                " to the eBPF programs, but the NAT entries of %d could not be deleted: the programs"
                " translate those flows with their entries in place, whose stack may give their"
                " packets another source port until the entries time out (run `conntrack -D` on"
                " them); %d deleted%s; first: %s",
                exc,
                undone.undone,
                len(undone.failed),
                undone.deleted,
                lapsed,
                "; ".join(undone.failed[:3]),
            )
            return
        log.warning(
            "the hand-back out of eBPF mode stopped (%s): the %d flows the node's stack tracks held so far"
            " are given back to the eBPF programs, the NAT entries of the %d passed to them deleted (%d"
            " found)%s",
            exc,
            holds.held,
            passed,
            undone.deleted,
            lapsed,
        )
