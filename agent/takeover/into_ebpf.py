"""eBPF mode taking a node over from kube-proxy or from iptables mode, keeping established flows.

The eBPF proxier calls `before_attach(maps)` once its first sync wrote the service maps (so every
frontend and backend has its id) and before its programs are attached, and `after_attach(maps)`
right after:

1. before: every nf_conntrack entry that is an established flow through one of our frontends
   (agent/takeover/flows.py says which) is written into the eBPF conntrack, REPLY entry then
   FORWARD entry, with BPF_NOEXIST (an entry the data path holds already wins). Until the
   programs are attached, packets still go through netfilter, whose conntrack keeps translating
   these flows (its NAT bindings outlive any rule).
   While the programs are being attached, nf_conntrack_tcp_be_liberal is 1 (below, in the code).
2. after: the same again, for the flows the other data path started in between (milliseconds),
   at once (until then they have no eBPF entry), then the flows of both carries handed to the stack
   in one pass per family, IPv6's first (below); nf_conntrack_tcp_be_liberal back to what it was.
   What it was is kept in the lock directory too (`liberal_path`) while it is 1 for the takeover:
   an agent killed in between leaves the node at 1, and the next start's first attach (a carry
   or none) puts back the node's own value, not the 1 it finds.
   From here the programs see every packet of those flows first and translate them from their
   own entries: same backend, same SNAT source and port.
   With bpf host routing netfilter sees no packet of these flows any more. With legacy host
   routing it sees each one between the two translations, client <-> backend, and the flow's
   NAT entry is in the way (agent/takeover/flows.py, `stack_flow`): its reply tuple is the plain
   flow's, so the stack's NAT gives the packets another source port and the backend resets them
   (seen in the lab: conntrack's `found` counter, plain entries whose reply port differs, created
   and destroyed within microseconds). A flow whose backend is the node's own address
   (CtFlag.HOST) meets the stack under either host routing; for it the NAT entry is no harmless
   stranger: the stack delivers the packet with the other port to the backend's socket, which
   answers with a RST that the data path translates back to the client (seen in the lab).
   So such flows (legacy: all, bpf: HOST) are carried with CtFlag.NFPASS: from the attach the data
   path passes their packets, both directions, untranslated, and their NAT entry goes on
   translating them as before the attach. Then, flow by flow (nfct.replace_flows), the entry is
   replaced by the plain one the stack would have made, in the same state and window-liberal:
   NFPASS swapped for CtFlag.HANDOVER (the data path drops the flow's forward packets: one passed
   untranslated could find no entry and go through the old rules, one translated would meet the
   NAT entry), the NAT entry deleted, then the plain tuple's entry (one made since the attach holds
   another port), the plain entry created (one a packet made in between is kept), HANDOVER
   cleared. A flow's forward packets drop for one send(2) of the three ctnetlink messages, which
   the kernel runs before it returns (0.1 ms typically, 5 ms at most in the lab under three busy
   loops, against 38-67 ms with a pyroute2 request per message) (the sender retransmits;
   its replies are translated meanwhile, and the stack passes them with the right addresses under
   either entry); before NFPASS, the stack reset every flow's packets from the attach until the last
   NAT entry of the batch was gone (129 ms at load 22 in the lab). Both flags expire
   EKP_CT_HANDOVER_S after the entry's created_s, which the agent moves on for the flows still
   waiting every HOLD_RENEW_NS while it replaces (an agent that died in between: the data path
   translates them within EKP_CT_HANDOVER_S, as it did before NFPASS; a flow replaced after its
   hold expired is counted in a warning); a restarted agent finds the NAT entries again, carries the
   flows as there already and replaces them the same way.
   The IPv6 UDP flows the tc IPv6 path hands to the stack (legacy: every carried one; either: one
   to a host backend, not carried) have their NAT entries replaced the same way, without a hold
   (that path reads no NFPASS) and so before the IPv4 ones, whose holds are renewed meanwhile:
   `_to_stack6`. On a node the agent never served the IPv6 maps are empty until the first IPv6
   sync, after the attach: the IPv6 carry and `_to_stack6` run again within it, before its
   ekp_fe6 write (`after_first_sync6`).
3. then, the node being served: the other data path's rules go (agent/iptables/
   kube_proxy_cleanup.py: kube-proxy's iptables chains in both backends, which are also iptables
   mode's, and kube-proxy's nftables tables). Done at every start: an eBPF node has none of them,
   and a kube-proxy still running would only write them again (the programs come first).
   IPv6 is not the eBPF data path's yet: on a node with IPv6 configured the agent's ip6tables
   proxier serves IPv6 Services, so the ip6tables chains (kube-proxy's, iptables mode's: the same
   layout) are left to it, which rewrites them as its own at its first sync, and kube-proxy's
   `ip6 kube-proxy` nftables table is removed by that proxier once its rules are in place.

Nothing here needs to know which data path was there: kube-proxy (iptables or nftables), iptables
mode and a previous eBPF agent all leave their flows in one of the two tables, and the eBPF
conntrack of a restarting eBPF agent is already in place (BPF_NOEXIST).
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from pyroute2.netlink.exceptions import NetlinkError

from agent.config import Config, HostRouting
from agent.ebpf import abi, activity
from agent.ebpf.abi import CtFlag
from agent.ebpf.codec import KEYS, VALUES
from agent.ebpf.maps import MapError, MapWriter, UpdateFlag
from agent.takeover.flows import (
    HOLD_RENEW_NS,
    UDP,
    EbpfIds,
    Ident,
    NatFlow,
    Skip,
    Timeouts,
    Tuple,
    ct_keys,
    ebpf_entries,
    ebpf_entries6,
    host_backend,
    stack_flow,
    why_not_carried,
)
from agent.takeover.out_of_ebpf import timeouts_of

if TYPE_CHECKING:
    from agent.takeover.nfct import Replaced

log = logging.getLogger(__name__)

TCP_BE_LIBERAL = "net/netfilter/nf_conntrack_tcp_be_liberal"
_LIBERAL_MAX = 64  # a sysctl's value: an integer


def liberal_path(directory: str, netns_inode: int) -> str:
    """The file holding the node's own tcp_be_liberal while the takeover has it at 1, for the
    network namespace (its inode, as agent.lock names its lock file: the sysctl is the namespace's,
    and one agent runs per namespace, whatever its --bpf-pin-path), beside the hand-back's marker."""
    return os.path.join(directory, f"takeover-netns-{netns_inode}.liberal")


def netns_inode(netns: str) -> int:
    from agent.lock import netns_path

    return os.stat(netns_path(netns)).st_ino


def kept_liberal(path: str, config: Config, read_sysctl: Callable[[str, str], str | None]) -> str | None:
    """The node's own tcp_be_liberal an agent killed mid-takeover kept in `path`, when it may be
    put back: the config does not ask for 1 (setup_conntrack sets it at every start; a file left
    by an agent run without it would undo that) and the node reads 1 now (anything else: the file
    is stale, the node ran kube-proxy or iptables mode since, or someone set the value). A file
    not used is removed, and said why."""
    fd = -1
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            text = f.read(_LIBERAL_MAX).decode(errors="replace").strip()
        now = read_sysctl(config.netns, TCP_BE_LIBERAL)
    except OSError as exc:
        if fd < 0 and isinstance(exc, FileNotFoundError):
            return None  # the usual case: no takeover was killed
        # The start goes on as without the file (kept: a later start may read it)
        log.error(
            "cannot read %s or %s (%s): if an agent was killed mid-takeover, %s in netns %s may still"
            " be 1 (netfilter's TCP window checks off); check it, set the node's own value by hand"
            " (sysctl -w net.netfilter.nf_conntrack_tcp_be_liberal=0 unless conntrack.tcpBeLiberal is"
            " set) and remove the file",
            path,
            TCP_BE_LIBERAL,
            exc,
            TCP_BE_LIBERAL,
            config.netns or "(own)",
        )
        return None
    why = ""
    if not re.fullmatch(r"[0-9]+", text):
        why = f"{text!r} is no value of {TCP_BE_LIBERAL}"
    elif config.conntrack.tcp_be_liberal:
        why = f"conntrack.tcpBeLiberal asks for {TCP_BE_LIBERAL}=1"
    elif now != "1":
        why = f"{TCP_BE_LIBERAL} is {now} now, not the 1 a takeover left: the file is stale"
    if why:
        log.info("ignored and removed %s (the node's own %s kept by a takeover): %s", path, text, why)
        forget_liberal(path)
        return None
    return text


def forget_liberal(path: str) -> None:
    """The kept value's file, and the `<path>.<pid>.tmp` an agent killed while writing it left."""
    for each in [path, *glob.glob(f"{glob.escape(path)}.*.tmp")]:
        try:
            os.unlink(each)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning(
                "cannot remove %s (%s): a later eBPF start may set %s from it; remove the file by hand",
                each,
                exc,
                TCP_BE_LIBERAL,
            )


def put_back_liberal(
    config: Config,
    directory: str,
    *,
    read_sysctl: Callable[[str, str], str | None] | None = None,
    write_sysctl: Callable[[str, str, str], str | None] | None = None,
    inode: Callable[[str], int] | None = None,
) -> None:
    """Where no eBPF takeover follows, once no program of ours is attached (`agent --cleanup`, iptables
    mode's hand-back out of eBPF mode: EbpfHandback): the
    node's own tcp_be_liberal an agent killed mid-takeover kept (`kept_liberal`) goes back, and its
    file goes, so that no later eBPF start acts on a stale one."""
    try:
        path = liberal_path(directory, (inode or netns_inode)(config.netns))
    except FileNotFoundError:
        return  # no namespace: nothing of its sysctls to put back
    except OSError as exc:
        log.error(
            "cannot find netns %s's inode (%s): a tcp_be_liberal an agent killed mid-takeover left at 1"
            " is not put back from the lock directory %s; check %s there and set it by hand",
            config.netns or "(own)",
            exc,
            directory,
            TCP_BE_LIBERAL,
        )
        return
    was = kept_liberal(path, config, read_sysctl or _default_read_sysctl)
    if was is None:
        return
    try:
        (write_sysctl or _default_sysctl)(config.netns, TCP_BE_LIBERAL, was)
    except OSError as exc:
        log.error(
            "cannot set %s back to %s in netns %s (%s), which an agent killed mid-takeover left at 1:"
            " netfilter's TCP window checks stay off; set it by hand and remove %s",
            TCP_BE_LIBERAL,
            was,
            config.netns or "(own)",
            exc,
            path,
        )
        return
    log.info(
        "set %s back to the node's own %s in netns %s: an agent killed mid-takeover had left it at 1",
        TCP_BE_LIBERAL,
        was,
        config.netns or "(own)",
    )
    forget_liberal(path)


def ebpf_ids(maps: Mapping[str, MapWriter], flows: Iterable[NatFlow]) -> EbpfIds:
    """The frontend and backend ids the first sync wrote, of the frontends and backends `flows`
    name (their destination, their reply's source). Read from each map's packed dump, one C loop
    of ints, and only what the flows name is kept: an index of every entry as ctypes objects and
    address strings was the agent's peak memory at 50,000 Services (about 250 MiB, twice)."""
    fronts: set[tuple[int, int, int]] = set()
    backs: set[tuple[int, int, int]] = set()
    for flow in flows:
        if ":" in flow.orig[1] or ":" in flow.reply[0]:
            continue  # these maps hold IPv4 frontends and backends only
        fronts.add((abi.ip_be(flow.orig[1]), abi.port_be(flow.orig[3]), flow.proto))
        backs.add((abi.ip_be(flow.reply[0]), abi.port_be(flow.reply[2]), flow.proto))
    services: dict[tuple[str, int, int], int] = {}
    if fronts:
        keys, values = maps["fe"].dump_raw()
        for (addr, port, proto, _scope), value in zip(
            KEYS["fe"].struct.iter_unpack(keys), VALUES["fe"].struct.iter_unpack(values), strict=True
        ):
            if (addr, port, proto) in fronts:
                services[(abi.ip_str(addr), abi.port_host(port), proto)] = value[0]  # svc_id
    backends: dict[tuple[str, int, int], int] = {}
    if backs:
        keys, values = maps["be"].dump_raw()
        for (bid,), (addr, port, proto, _flags) in zip(
            KEYS["be"].struct.iter_unpack(keys), VALUES["be"].struct.iter_unpack(values), strict=True
        ):
            if (addr, port, proto) in backs:
                backends[(abi.ip_str(addr), abi.port_host(port), proto)] = bid
    return EbpfIds(services=services, backends=backends)


def ebpf_ids6(
    maps: Mapping[str, MapWriter], flows: Iterable[NatFlow], pending: Mapping[Ident, int] | None = None
) -> EbpfIds:
    """`ebpf_ids` for IPv6 flows, from the IPv6 maps (ekp_fe6, ekp_be6). Read entry by entry: only
    when there is an IPv6 flow to carry (the tc IPv6 path's UDP, `_carry6`), seldom many.
    `pending`: frontends about to be written into ekp_fe6 (their svc_id), found as if written: over
    what ekp_fe6 holds, as the write will be (a Service recreated on the same address while no
    agent ran has a new svc_id; the pinned entry's is stale)."""
    flows = list(flows)
    fronts = {(f.orig[1], f.orig[3], f.proto) for f in flows}
    backs = {(f.reply[0], f.reply[2], f.proto) for f in flows}
    services: dict[tuple[str, int, int], int] = {}
    backends: dict[tuple[str, int, int], int] = {}
    if fronts:
        for key, value in maps["fe6"].items():
            if isinstance(key, abi.Frontend6Key) and isinstance(value, abi.Frontend):
                front = (abi.ip6_str(key.addr), abi.port_host(key.port), key.proto)
                if front in fronts:
                    services[front] = value.svc_id
        services.update((front, svc) for front, svc in (pending or {}).items() if front in fronts)
        for bkey, backend in maps["be6"].items():
            if isinstance(bkey, abi.BackendKey) and isinstance(backend, abi.Backend6):
                back = (abi.ip6_str(backend.addr), abi.port_host(backend.port), backend.proto)
                if back in backs:
                    backends[back] = bkey.id
    return EbpfIds(services=services, backends=backends)


def _default_dump(netns: str) -> list[NatFlow]:
    from agent.takeover.nfct import dump_flows

    return dump_flows(netns)


def _default_dump6(netns: str) -> list[NatFlow]:
    import socket

    from agent.takeover.nfct import dump_flows

    return dump_flows(netns, socket.AF_INET6)


def _default_addresses(netns: str) -> frozenset[str]:
    from agent.takeover.nfct import local_addresses

    return local_addresses(netns)


def _default_sysctl(netns: str, path: str, value: str) -> str | None:
    from agent.ebpf.proxier import write_sysctl

    return write_sysctl(netns, path, value)


def _default_read_sysctl(netns: str, path: str) -> str | None:
    from agent.ebpf.proxier import read_sysctl

    return read_sysctl(netns, path)


def _default_replace(
    netns: str,
    flows: Iterable[NatFlow],
    by: Callable[[NatFlow], NatFlow],
    timeouts: Timeouts,
    *,
    before: Callable[[NatFlow], None],
    after: Callable[[NatFlow], None],
) -> Replaced:
    from agent.takeover.nfct import replace_flows

    return replace_flows(netns, flows, by, timeouts, before=before, after=after)


def _default_cleanup(config: Config) -> Any:
    from agent.iptables.kube_proxy_cleanup import cleanup_kube_proxy

    return cleanup_kube_proxy(config, nft_families=nft_families_to_remove(config))


def nft_families_to_remove(config: Config) -> tuple[str, ...]:
    """The families of kube-proxy's nftables tables the eBPF start removes: both, unless the node
    serves IPv6 with its ip6tables proxier, which removes `ip6 kube-proxy` itself once its own
    rules serve (agent/app.py, make_proxier6): IPv6 Services are never left without rules."""
    return ("ip",) if config.ipv6_configured else ("ip", "ip6")


def _replace_stopped(exc: BaseException) -> str:
    """What to do about a replacement of NAT entries that stopped on `exc` (both families' passes)."""
    if isinstance(exc, PermissionError):
        return "the agent needs NET_ADMIN"
    return "the ctnetlink socket failed, so the rest were not tried"


def _nothing(flow: NatFlow) -> None:
    pass


class KernelTakeover:
    """The flows of nf_conntrack carried into eBPF conntrack around the first attach, then the
    other data path's rules removed (module doc). Constructing it does nothing."""

    def __init__(
        self,
        config: Config,
        *,
        dump: Callable[[str], Iterable[NatFlow]] = _default_dump,
        dump6: Callable[[str], Iterable[NatFlow]] = _default_dump6,
        addresses: Callable[[str], Collection[str]] = _default_addresses,
        remove_rules: Callable[[Config], Any] = _default_cleanup,
        sysctl: Callable[[str, str, str], str | None] = _default_sysctl,
        read_sysctl: Callable[[str, str], str | None] = _default_read_sysctl,
        replace: Callable[..., Replaced] = _default_replace,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        state_dir: str = "",
        netns_inode: Callable[[str], int] = netns_inode,
    ) -> None:
        """`state_dir`: where the node's own tcp_be_liberal is kept while it is 1 for the takeover
        (`liberal_path`; the agent's lock directory), so that a restarted agent puts it back; ""
        keeps it in this object alone."""
        self._config = config
        self._state_dir = state_dir
        self._netns_inode = netns_inode
        self._liberal_file_at = ""  # liberal_path, once the first attach needs it
        self._read_sysctl = read_sysctl
        # The value to put back came from an earlier agent's file: its programs may be attached
        self._liberal_from_file = False
        self._dump = dump
        self._dump6 = dump6
        self._replace = replace
        self._addresses = addresses
        self._remove_rules = remove_rules
        self._sysctl = sysctl
        self._clock_ns = clock_ns  # CLOCK_MONOTONIC, as bpf_ktime_get_ns
        self._liberal_was: str | None = None
        self._node: Collection[str] = frozenset()  # the node's addresses, as the last carry read them
        self._carried: list[NatFlow] = []  # before the programs were attached
        # IPv6 UDP flows whose NAT entries are replaced once the programs are attached (_carry6)
        self._stack6: dict[Tuple, NatFlow] = {}
        self._attached_at = 0.0  # monotonic: after_attach began (the programs were just attached)
        self._carried_ns = 0  # clock_ns of the carry whose entries the hold of the waiting flows runs from
        self.carried = 0

    def before_attach(self, maps: Mapping[str, MapWriter]) -> None:
        self._stack6 = {}  # an attach retried after a failure carries afresh
        if self._liberal_was is None and self._liberal_file:
            # An agent killed between its before_attach and after_attach left the node at 1 and
            # its own value in the file: put back at this attach's end, whether or not it carries.
            self._liberal_was = kept_liberal(self._liberal_file, self._config, self._read_sysctl)
            self._liberal_from_file = self._liberal_was is not None
            if self._liberal_from_file:
                log.info(
                    "an earlier agent stopped during its takeover with %s at 1: putting the node's"
                    " own %s back after this attach",
                    TCP_BE_LIBERAL,
                    self._liberal_was,
                )
        self._carried = self._carry(maps, "before the programs are attached", first=True)
        if self._carried:
            # While the programs are attached device by device, a carried flow can have one
            # direction translated by a program (netfilter never sees it) and the other still in
            # netfilter, whose window check then finds acks of data it never saw: INVALID, not
            # translated back, and the client's stack answers with a RST. Window checks are off
            # until every device has its program (kube-proxy's conntrack.tcpBeLiberal, for a
            # moment); once they all have, netfilter's entries no longer translate these flows
            # (but those held for the stack, NFPASS, until after_attach replaced their entries).
            if self._liberal_was is None:  # an attach retried: "1" now is this agent's own
                # Read and kept before it is set: an agent killed in between leaves the file
                was = self._read_sysctl(self._config.netns, TCP_BE_LIBERAL)
                self._keep_liberal(was)
                self._liberal_was = was
            self._sysctl(self._config.netns, TCP_BE_LIBERAL, "1")

    def after_attach(self, maps: Mapping[str, MapWriter]) -> None:
        # The second carry first: a flow started between the first dump and the attach has no
        # eBPF entry until it (its TCP segments drop, its UDP datagrams may pick another backend),
        # while the flows carried before lose nothing waiting (NFPASS: netfilter's NAT entries
        # go on translating them, their hold renewed meanwhile). Then both sets in one pass.
        try:
            self._hand_over(maps)
        finally:
            # whatever stopped the pass: the node's window checks come back (an attach retried
            # sets them off again, and reads back the value restored here)
            self._restore_liberal()

    def abort(self, *, attached: bool) -> None:
        """The first attach failed between before_attach and after_attach: the node's window
        checks come back (the next sync's before_attach turns them off again); not when a program
        of ours may be on some device already (`attached`): the flows it translates have one
        direction netfilter never sees, so the checks stay off until the retry's after_attach
        (or `close`) puts them back."""
        self._carried = []
        if attached or self._liberal_from_file:
            # From the file: the value is an agent's killed mid-takeover, whose programs may still
            # be on devices, whatever this attach got to
            if self._liberal_was is not None and self._liberal_was != "1":
                log.warning(
                    "%s: %s stays 1 in netns %s until the retried attach is done (or the agent"
                    " stops), or the flows they translate would meet netfilter's window checks one"
                    " way only (resets)",
                    "the first attach stopped with our programs on some devices"
                    if attached
                    else "an earlier agent killed mid-takeover may have left our programs on devices",
                    TCP_BE_LIBERAL,
                    self._config.netns or "(own)",
                )
            return
        self._restore_liberal()

    def close(self) -> None:
        """The agent stops: window checks an aborted attach left off come back."""
        self._restore_liberal()

    @property
    def _liberal_file(self) -> str:
        if self._state_dir and not self._liberal_file_at:
            try:
                inode = self._netns_inode(self._config.netns)
            except OSError:
                return ""  # the namespace went: nothing of its sysctls to keep or put back
            self._liberal_file_at = liberal_path(self._state_dir, inode)
        return self._liberal_file_at

    def _restore_liberal(self) -> None:
        was = self._liberal_was
        if was is None:
            return
        if was != "1":
            try:
                self._sysctl(self._config.netns, TCP_BE_LIBERAL, was)
            except OSError as exc:  # said, not raised: the error that stopped the attach matters more
                # Still this object's to put back (a retried attach, `close`): cleared, a retry
                # would read its own file as a killed agent's
                log.error(
                    "cannot set %s back to %s in netns %s (%s): netfilter's TCP window checks stay"
                    " off on the node (kube-proxy's conntrack.tcpBeLiberal); set it by hand (the next"
                    " start tries again from %s)",
                    TCP_BE_LIBERAL,
                    was,
                    self._config.netns or "(own)",
                    exc,
                    self._liberal_file or "nowhere",
                )
                return
        self._liberal_was = None
        self._liberal_from_file = False
        if self._liberal_file:
            forget_liberal(self._liberal_file)

    def _keep_liberal(self, was: str | None) -> None:
        """The node's own value, kept for a restarted agent (renamed over: never half-written)."""
        if not self._liberal_file or was is None or was == "1":
            return
        tmp = f"{self._liberal_file}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self._liberal_file), mode=0o700, exist_ok=True)
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{was}\n")
            os.replace(tmp, self._liberal_file)
        except OSError as exc:  # the takeover goes on: only a restart mid-attach would need it
            log.warning(
                "cannot keep %s's value %s in %s (%s): an agent restarted before this attach ends"
                " would leave it at 1 (netfilter's TCP window checks off); set it back by hand then",
                TCP_BE_LIBERAL,
                was,
                self._liberal_file,
                exc,
            )

    def _hand_over(self, maps: Mapping[str, MapWriter]) -> None:
        self._attached_at = time.monotonic()
        carried, self._carried = self._carried, []
        first = [f for f in carried if f.family == 4 and self._meets_stack(f)]
        # Their hold runs from the first carry: renewed before the second dump, which on a node
        # of many flows takes seconds of its own (about 0.3 ms an entry, more for a starved agent).
        self._renew(maps, first)
        done = {f.orig for f in carried}
        try:
            late = [
                f
                for f in self._carry(maps, "after the programs were attached", first=False)
                if f.orig not in done
            ]
        except MapError as exc:
            # the first set is handed over all the same, or its holds would run out untended
            log.warning(
                "carrying the flows of the second read of nf_conntrack failed (%s): those started"
                " between the first read and the attach may have no eBPF conntrack entry (their"
                " next segments are dropped); the flows carried before are handed over as planned",
                exc,
            )
            late = []
        stack4 = [*first, *(f for f in late if f.family == 4 and self._meets_stack(f))]
        stack6, self._stack6 = list(self._stack6.values()), {}

        def keep_held(flow: NatFlow) -> None:
            if stack4 and self._clock_ns() - self._carried_ns >= HOLD_RENEW_NS:
                self._renew(maps, stack4)

        # IPv6 first: its flows have no hold (the tc IPv6 path reads no NFPASS), so each datagram
        # until its entry is replaced may lose its reply, while IPv4's lose nothing waiting (NFPASS,
        # their holds renewed meanwhile); the IPv4 pass takes about 1 ms a flow, seconds at thousands.
        self._to_stack6(stack6, before=keep_held)
        self._to_stack(maps, stack4)

    def _meets_stack(self, flow: NatFlow) -> bool:
        """Whether the node's stack sees the flow's packets between their translations: every flow
        under legacy host routing, only a flow to the node's own address under bpf host routing."""
        return self._config.bpf_host_routing == HostRouting.LEGACY or host_backend(flow, self._node)

    @property
    def hands_over(self) -> bool:
        """No: nf_conntrack's flows are held for the stack (NFPASS) by our own programs instead."""
        return False

    def serving(self) -> None:
        # Only once the socket programs serve the node's own clients too: kube-proxy's OUTPUT
        # rules are what translated them until then (a connect() meeting neither would send its
        # SYNs to the ClusterIP itself until it timed out).
        self._remove_rules(self._config)

    def _hold(
        self,
        maps: Mapping[str, MapWriter],
        flow: NatFlow,
        *,
        clear: int,
        add: int = 0,
        renew_s: int | None = None,
    ) -> bool:
        """`clear` cleared and `add` set on both entries of `flow` (either may be gone: ended, or
        never written); with `renew_s`, a held entry's created_s moved to it (its hold starts again:
        the data path reads nothing else, and the entry is not written by the data path while held).
        Returns whether an entry was held past its EKP_CT_HANDOVER_S already (as the clock reads it
        now): the data path translated that flow meanwhile."""
        table = maps[abi.ct_role(flow.proto)]
        now_s = self._clock_ns() // 1_000_000_000
        expired = False
        held = CtFlag.NFPASS | CtFlag.HANDOVER
        for key in ct_keys(flow):
            entry = table.lookup(key)
            if not isinstance(entry, abi.CtEntry):
                continue
            late = bool(entry.flags & held) and now_s - entry.created_s >= abi.CT_HANDOVER_S
            expired = expired or late
            flags = (entry.flags & ~clear) | add
            # An entry held past its expiry is left expired: the data path translates that flow
            # since, and the agent that let it expire is not one whose renewals can be counted on.
            renew = renew_s is not None and bool(flags & held) and not late
            created_s = renew_s if renew and renew_s is not None else entry.created_s
            if flags == entry.flags and created_s == entry.created_s:
                continue
            entry.flags = flags
            entry.created_s = created_s
            # Read, then written back: a state change the data path made in between (its replies
            # renew the REPLY entry) is lost, for microseconds, twice per flow.
            try:
                table.update(key, entry, UpdateFlag.EXIST)
            except MapError as exc:
                if exc.errno != errno.ENOENT:  # ended meanwhile
                    raise
        return expired

    def _renew(self, maps: Mapping[str, MapWriter], flows: list[NatFlow]) -> None:
        """The hold of `flows` started again now (a refused write is only logged: that flow's hold
        runs from its carry, as before)."""
        now_ns = self._clock_ns()
        for flow in flows:
            try:
                self._hold(maps, flow, clear=0, renew_s=now_ns // 1_000_000_000)
            except MapError as exc:
                log.warning("the hold of carried flow %s could not be renewed: %s", flow.describe(), exc)
        if flows:
            self._carried_ns = now_ns

    def _to_stack(self, maps: Mapping[str, MapWriter], flows: list[NatFlow]) -> None:
        """Each carried flow's nf_conntrack entry replaced by the plain one the node's stack
        tracks, flow by flow, its packets held meanwhile (module doc, step 2)."""
        if not flows:
            return
        started = time.monotonic()
        netns = self._config.netns
        held = CtFlag.NFPASS | CtFlag.HANDOVER
        released: set[Tuple] = set()
        holds_ns: list[int] = [0, 0]  # the one being held since, the longest hold
        late: list[NatFlow] = []  # replaced after their hold had expired
        unwritten: list[str] = []  # a hold's map write refused (the flow went on all the same)
        renewed_ns = [self._carried_ns]

        def hold(flow: NatFlow, *, clear: int, add: int = 0, renew_s: int | None = None) -> bool:
            try:
                return self._hold(maps, flow, clear=clear, add=add, renew_s=renew_s)
            except MapError as exc:
                unwritten.append(f"{flow.describe()}: {exc}")
                return False

        def renew() -> None:
            # The hold runs EKP_CT_HANDOVER_S from created_s: the carry, then the attach to every
            # device, then the flows one after the other (about 1 ms each, far more for an agent
            # waiting for a CPU) would use it up at a few thousand flows, and the rest would be
            # translated with their NAT entry in place. The flows still waiting get it again while
            # the agent makes progress; an agent that dies leaves them expiring as before.
            now_ns = self._clock_ns()
            if now_ns - renewed_ns[0] < HOLD_RENEW_NS:
                return
            for waiting in flows:
                if waiting.orig not in released:
                    hold(waiting, clear=0, renew_s=now_ns // 1_000_000_000)
            # from the end of the pass: a pass that takes long is not followed by another at once
            renewed_ns[0] = self._clock_ns()

        def before(flow: NatFlow) -> None:
            renew()
            if hold(flow, clear=CtFlag.NFPASS, add=CtFlag.HANDOVER):
                late.append(flow)
            holds_ns[0] = time.monotonic_ns()

        def after(flow: NatFlow) -> None:
            hold(flow, clear=held)
            holds_ns[1] = max(holds_ns[1], time.monotonic_ns() - holds_ns[0])
            released.add(flow.orig)
            renew()  # also ahead of the next flow's read of its state, which may wait for an answer

        try:
            done = self._replace(
                netns, flows, stack_flow, timeouts_of(self._config), before=before, after=after
            )
        except (OSError, NetlinkError) as exc:
            log.warning(
                "cannot replace the NAT entries of %d of the %d flows carried into eBPF conntrack in netns"
                " %s (%s): the node's stack sees their packets as client <-> backend"
                " (--bpf-host-routing=legacy, or a backend on the node's own address), finds those entries"
                " in the way and gives the packets another source port, which the backends reset; %s",
                len(flows) - len(released),
                len(flows),
                netns or "(own)",
                exc,
                _replace_stopped(exc),
            )
            return
        finally:
            # Not left to the data path's expiry: an entry not replaced meets the stack translated
            # (reset, as it would have been without the wait), not netfilter's old rules.
            for flow in flows:
                if flow.orig not in released:
                    hold(flow, clear=held)
            for line in unwritten[:10]:
                log.warning("a carried flow's hold could not be written in eBPF conntrack: %s", line)
        for line in done.made.failed[:10]:
            log.warning("a carried flow's NAT entry could not be replaced: %s", line)
        if late:
            log.warning(
                "%d of the %d carried flows had their NAT entries replaced after their hold (%d s from the"
                " carry, renewed every %d s while the agent went on) expired: the data path translated"
                " them meanwhile with their NAT entries in place, so the node's stack may have reset"
                " them (the agent was starved of CPU for seconds?); first: %s",
                len(late),
                len(flows),
                abi.CT_HANDOVER_S,
                HOLD_RENEW_NS // 1_000_000_000,
                late[0].describe(),
            )
        for new in done.refused[:10]:
            log.warning(
                "a carried flow's plain nf_conntrack entry was refused (EEXIST): another entry holds its"
                " reply tuple, or a packet made one meanwhile; the stack's NAT may give its packets"
                " another source port, which the backend resets: %s",
                new.describe(),
            )
        log.info(
            "handed the %d carried flows to the node's stack (legacy host routing, or a backend on the"
            " node's own address), one by one, nf_conntrack's NAT entries translating each until its turn:"
            " %d NAT entries replaced by client <-> backend entries (%d with another source port removed,"
            " %d refused as another entry held the tuple, %d failed, %d TCP flows made in the state"
            " netfilter moved them to while they waited), %.0f ms, done %.0f ms after the"
            " attach; each flow's forward packets dropped while its entry was replaced, %.2f ms at most",
            len(flows),
            done.retired,
            done.stray,
            len(done.refused),
            len(done.made.failed),
            done.moved_on,
            (time.monotonic() - started) * 1000,
            (time.monotonic() - self._attached_at) * 1000,
            holds_ns[1] / 1e6,
        )

    def after_first_sync6(
        self, maps: Mapping[str, MapWriter], frontends: Mapping[Ident, int] | None = None
    ) -> None:
        """The IPv6 carry and `_to_stack6` once more, for the first IPv6 sync after the attach. On a
        node the agent never served ekp_fe6 and ekp_be6 were empty at the attach, so `_carry6` found
        no flow's frontend and carried none; from the ekp_fe6 write of that sync on, tc decides the
        flows ip6tables translated as new ones (another backend, maybe), and one given the same
        backend meets its NAT entry in the stack (legacy host routing, or a host backend): replies
        lost while datagrams keep it alive. So the proxier calls this between that sync's other
        writes and its ekp_fe6 write, with the frontends it is about to write (`frontends`: their
        svc_id, as ekp_fe6 will hold them): the flows' entries are in ekp_ct6_any and their NAT
        entries replaced before tc can decide any of them (before, it ran after the sync, half a
        second later in the lab's kube-proxy -> eBPF switch: the flow's datagrams in between were
        decided as new, and half the time reached the other backend). Without an ekp_fe6 write
        (a restart over unchanged maps: the attach's carry found them) it runs after the sync.
        Nothing is done twice: a flow carried at the attach keeps its entries (BPF_NOEXIST) and, if
        it was handed to the stack then, has no NAT entry left to find."""
        if not self._config.tc_ipv6:
            return
        self._stack6 = {}
        when = (
            "after the first IPv6 sync, which wrote no IPv6 frontend"
            if frontends is None
            else "before the first IPv6 sync wrote the IPv6 frontends"
        )
        try:
            self._carry6(maps, when, frontends)
        except MapError as exc:
            log.warning(
                "carrying the IPv6 UDP flows ip6tables translated at the first IPv6 sync failed (%s):"
                " their next datagrams may reach another backend; their NAT entries are replaced all the"
                " same",
                exc,
            )
        stack6, self._stack6 = list(self._stack6.values()), {}
        self._to_stack6(stack6)

    def _to_stack6(self, flows: list[NatFlow], *, before: Callable[[NatFlow], None] = _nothing) -> None:
        """The NAT entries of the IPv6 UDP flows the tc IPv6 path hands to the node's stack as
        client <-> backend (`_carry6`) replaced by the plain ones, as IPv4's are (`_to_stack`), but
        with no hold: the IPv6 path has no NFPASS. Without it the NAT entry's reply tuple (backend ->
        client) is the plain flow's, so nf_nat's null binding gives the datagrams another source
        port, the backend answers that port, the replies miss tc's REPLY entry and reach the client
        from the backend, not the ClusterIP: dropped, for as long as datagrams keep the entry alive.
        Deleting the NAT entry alone would do once no datagram came between the attach and the
        delete; one that did made a plain entry with the moved port, which the replacement deletes
        too. The kernel runs a flow's three messages one after another while other CPUs go on
        with packets: a datagram between the deletes and the create makes the plain entry itself
        (the create is refused, EEXIST: that entry is the one wanted). A datagram the data path
        translated before its flow's turn (milliseconds, this pass runs before IPv4's) may still
        lose its reply. `before(flow)` is called ahead of each flow's messages."""
        if not flows:
            return
        started = time.monotonic()
        done_flows: set[Tuple] = set()
        try:
            done = self._replace(
                self._config.netns,
                flows,
                stack_flow,
                timeouts_of(self._config),
                before=before,
                after=lambda flow: done_flows.add(flow.orig),
            )
        except (OSError, NetlinkError) as exc:
            log.warning(
                "cannot replace the NAT entries of %d of the %d IPv6 UDP flows ip6tables translated, now"
                " handed to the node's stack by the tc IPv6 path, in netns %s (%s): their replies reach the"
                " clients from another source port or address until those entries expire (conntrack -D -f"
                " ipv6 -p udp removes them); %s",
                len(flows) - len(done_flows),
                len(flows),
                self._config.netns or "(own)",
                exc,
                _replace_stopped(exc),
            )
            return
        for line in done.made.failed[:10]:
            log.warning("an IPv6 UDP flow's NAT entry could not be replaced: %s", line)
        log.info(
            "replaced the NAT entries of %d IPv6 UDP flows the tc IPv6 path hands to the node's stack"
            " (legacy host routing, or a backend on the node's own address) by client <-> backend"
            " entries: %d replaced (%d with another source port removed, %d refused as a datagram made"
            " the plain entry meanwhile: benign, %d failed), %.0f ms",
            len(flows),
            done.retired,
            done.stray,
            len(done.refused),
            len(done.made.failed),
            (time.monotonic() - started) * 1000,
        )

    def _carry(self, maps: Mapping[str, MapWriter], when: str, *, first: bool) -> list[NatFlow]:
        """Carries what nf_conntrack holds; returns the flows it found to carry (carried now or
        before). Each family on its own: one whose table cannot be read leaves the other's carry
        whole."""
        carried = self._carry4(maps, when, first=first)
        if self._config.tc_ipv6:
            carried += self._carry6(maps, when)
        return carried

    def _carry4(self, maps: Mapping[str, MapWriter], when: str, *, first: bool) -> list[NatFlow]:
        """The IPv4 flows, into the eBPF conntrack's IPv4 tables. The node's addresses unreadable
        fail the first carry (the sync fails before the attach and is tried again: attached with
        nothing carried, every flow would drop), and only skip the second (the first carry's
        flows are handed over all the same)."""
        started = time.monotonic()
        netns = self._config.netns
        try:
            flows = list(self._dump(netns))
        except (OSError, NetlinkError) as exc:  # no nf_conntrack to read, or no NET_ADMIN
            log.warning(
                "cannot read nf_conntrack in netns %s (%s): flows established before this agent"
                " (kube-proxy's, iptables mode's) are not carried over and their next segments are"
                " dropped; the agent needs NET_ADMIN",
                netns or "(own)",
                exc,
            )
            return []
        try:
            node = self._node = self._addresses(netns)
        except (OSError, NetlinkError) as exc:
            if first:
                raise
            log.warning(
                "cannot read the node's addresses in netns %s (%s): the %d flows of nf_conntrack are"
                " not carried into eBPF conntrack (%s), and their next segments are dropped",
                netns or "(own)",
                exc,
                len(flows),
                when,
            )
            return []
        ids = ebpf_ids(maps, flows)
        skipped: Counter[Skip] = Counter()
        inserted = present = 0
        carried: list[NatFlow] = []
        now = self._clock_ns()
        if not self._carried_ns:
            self._carried_ns = now
        for flow in flows:
            why = why_not_carried(flow, ids, node)
            if why is not None:
                skipped[why] += 1
                continue
            carried.append(flow)
            added = False
            host = host_backend(flow, node)
            nfpass = host or self._config.bpf_host_routing == HostRouting.LEGACY
            for key, entry in ebpf_entries(flow, ids, now, host=host, nfpass=nfpass):
                try:
                    maps[abi.ct_role(key.proto)].update(key, entry, UpdateFlag.NOEXIST)
                    added = True
                except MapError as exc:
                    if exc.errno != errno.EEXIST:
                        raise
            if added:
                inserted += 1
                log.debug("took over %s", flow.describe())
            else:
                present += 1
        self.carried += inserted
        if inserted or present or skipped[Skip.NODE_CLIENT] or skipped[Skip.BACKEND_GONE]:
            log.info(
                "took over established flows from nf_conntrack (%s): %d carried into eBPF conntrack, %d there"
                " already; left to the kernel: %d of the node's own clients, %d UDP flows whose backend"
                " left; %d entries read, %.0f ms",
                when,
                inserted,
                present,
                skipped[Skip.NODE_CLIENT],
                skipped[Skip.BACKEND_GONE],
                len(flows),
                (time.monotonic() - started) * 1000,
            )
        return carried

    def _carry6(
        self, maps: Mapping[str, MapWriter], when: str, pending: Mapping[Ident, int] | None = None
    ) -> list[NatFlow]:
        """The UDP flows ip6tables translated, carried into the tc IPv6 path's conntrack (ekp_ct6_any)
        as IPv4's are into its own: that path decides a UDP datagram with no entry as a new flow (a
        UDP flow has no first packet to tell it by), so without its entry a flow ip6tables started
        would go on with another backend. Its TCP flows need no carry: a segment without an entry
        that opens no flow is left to the stack, where nf_conntrack translates it as before. Found
        in ekp_fe6 / ekp_be6 as the pins of an earlier run left them (a restart, an upgrade): on a
        node the agent never served, those are written by the first IPv6 sync, after the attach,
        and this runs again right before its ekp_fe6 write (`after_first_sync6`, `pending`: the
        frontends that write adds). Skipped:
        a host backend (the IPv6 path has no HOST nor NFPASS entry to carry it with: tc decides it
        again), the node's own clients, a backend no longer in ekp_be6. The flows whose datagrams
        tc hands to the stack (every carried one under legacy host routing, a host backend's under
        either) are kept for `_to_stack6`, which replaces their NAT entries after the attach (or the
        first IPv6 sync)."""
        netns = self._config.netns
        try:
            flows = [f for f in self._dump6(netns) if f.proto == UDP and f.family == 6 and f.dnat]
        except (OSError, NetlinkError) as exc:
            log.warning(
                "cannot read IPv6 nf_conntrack in netns %s (%s): UDP flows ip6tables translated are not"
                " carried into the tc IPv6 path, whose next datagrams may reach another backend",
                netns or "(own)",
                exc,
            )
            return []
        if not flows:
            return []
        ids = ebpf_ids6(maps, flows, pending)
        try:
            node = self._addresses(netns)
        except (OSError, NetlinkError) as exc:
            log.warning(
                "cannot read the node's addresses in netns %s (%s): the %d UDP flows ip6tables translated"
                " are not carried into the tc IPv6 path, whose next datagrams may reach another backend",
                netns or "(own)",
                exc,
                len(flows),
            )
            return []
        carried: list[NatFlow] = []
        stamped: list[tuple[abi.Ct6Key, abi.Ct6Entry]] = []
        inserted = skipped = 0
        now = self._clock_ns()
        legacy = self._config.bpf_host_routing == HostRouting.LEGACY
        for flow in flows:
            why, host = why_not_carried(flow, ids, node), host_backend(flow, node)
            if why is None and (legacy or host):
                self._stack6[flow.orig] = flow
            if why is not None or host:
                skipped += 1
                continue
            carried.append(flow)
            entries = ebpf_entries6(flow, ids, now)
            for key, entry in entries:
                try:
                    maps["ct6_any"].update(key, entry, UpdateFlag.NOEXIST)
                    inserted += 1
                except MapError as exc:
                    if exc.errno != errno.EEXIST:
                        raise
            stamped += entries
        if stamped and "act" in maps:
            # After the start armed the activity check (a first IPv6 sync): stamped here, or the
            # flow's replies skip the lookups until a refresh (about 1 s of them in the lab's switch)
            try:
                activity.stamp6(maps["act"], stamped)
            except MapError as exc:
                log.warning(
                    "cannot stamp the endpoints of the %d IPv6 UDP flows carried (%s) for the activity"
                    " check (%s): the flows are carried, but their replies may leave from the backend's"
                    " own address for about a second, until the next refresh of %s",
                    len(carried),
                    when,
                    exc,
                    maps["act"].spec.name,
                )
        log.info(
            "took over IPv6 UDP flows from nf_conntrack (%s): %d carried into the tc IPv6 path's conntrack"
            " (%d entries new), %d left to ip6tables",
            when,
            len(carried),
            inserted,
            skipped,
        )
        return carried
