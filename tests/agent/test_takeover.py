"""Flows carried between nf_conntrack and the eBPF conntrack when a node switches data paths.

Pure: the conversions of agent/takeover/flows.py with literal flows. With fakes: KernelTakeover
over FakeMaps (what is carried, what stays with the kernel, the rules removed after the attach),
EbpfHandback (write, detach, write the late flows, remove the pins, in that order). Kernel: a flow
as nf_conntrack holds it carried into the loaded eBPF programs, whose mid-flow segments then go
to its backend both ways (a segment the programs have no entry for drops as NO_FLOW); a flow of
the eBPF conntrack written into a lab namespace's nf_conntrack with its NAT bindings.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import ipaddress
import logging
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple, NFCTSocket

from agent.config import Config, ConntrackSettings, HostRouting, Mode
from agent.ebpf import abi, activity, attach, snapshot, xdp
from agent.ebpf.abi import MAPS, BackendFlag, CtDir, CtFlag, FrontendFlag, Scope, Stat, ip_be, port_be
from agent.ebpf.loader import Datapath
from agent.ebpf.maps import FakeMap, MapError, MapWriter, UpdateFlag
from agent.keptrecords import records_path
from agent.netns import run_in_netns
from agent.takeover import into_ebpf, nfct, out_of_ebpf
from agent.takeover.flows import (
    HOLD_RENEW_NS,
    IPS_ASSURED,
    IPS_CONFIRMED,
    IPS_DST_NAT,
    IPS_DST_NAT_DONE,
    IPS_SEEN_REPLY,
    IPS_SRC_NAT,
    IPS_SRC_NAT_DONE,
    EbpfIds,
    NatFlow,
    SctpState,
    Skip,
    TcpState,
    Timeouts,
    Tuple,
    ct_keys,
    ebpf_entries,
    ebpf_entries6,
    host_backend,
    kernel_status,
    masqueraded_into,
    nat_flow,
    stack_flow,
    timeout_of,
    why_not_carried,
)
from agent.takeover.into_ebpf import KernelTakeover, ebpf_ids, ebpf_ids6, liberal_path, put_back_liberal
from agent.takeover.nfct import (
    Created,
    Replaced,
    create_flows,
    delete_flows,
    dump_flows,
    replace_flows,
    translated_any,
)
from agent.takeover.out_of_ebpf import EbpfHandback, Holds, StackHolds, Undone
from lab.dplab import (
    BE1,
    CLIENT,
    MAC,
    NODE,
    NODE2,
    POD_CLIENT,
    REMOTE_BE,
    SIZES,
    VIP,
    Lab,
    Net,
    packet_lab,
    reset_maps,
    set_config,
)
from lab.packets import TC_ACT_OK, TC_ACT_SHOT, loaded_datapath, parse, sh, tcp
from tests.conftest import require_kernel

IDS = EbpfIds(
    services={(VIP, 80, 6): 3, (NODE, 30080, 6): 4, (VIP, 53, 17): 5, (VIP, 5060, 132): 6},
    backends={(BE1, 8080, 6): 21, (REMOTE_BE, 8080, 6): 22, (BE1, 53, 17): 23, (BE1, 5061, 132): 24},
)
# pod -> SCTP ClusterIP -> local backend: an association nf_conntrack saw established, its tags
ASSOCIATION = NatFlow(
    132,
    (POD_CLIENT, VIP, 41500, 5060),
    (BE1, POD_CLIENT, 5061, 41500),
    sctp_state=SctpState.ESTABLISHED,
    vtags=(0x5678EF01, 0x1234ABCD),
)
# pod -> ClusterIP -> local backend, client address kept
CLUSTERIP = NatFlow(6, (POD_CLIENT, VIP, 40000, 80), (BE1, POD_CLIENT, 8080, 40000))
# outside -> NodePort -> remote backend, masqueraded to the node's port 61000
NODEPORT = NatFlow(6, (CLIENT, NODE, 5555, 30080), (REMOTE_BE, NODE, 8080, 61000))
NOW = 5_000 * 10**9


@pytest.fixture(autouse=True)
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The hand-back's marker (and the planner it removes) in the test's own lock directory."""
    run = tmp_path / "lock-dir"
    monkeypatch.setattr(out_of_ebpf, "LOCK_DIR", str(run))
    return run


def entries(flow: NatFlow) -> dict[tuple[int, int], tuple[abi.CtKey, abi.CtEntry]]:
    return {(k.dir, k.proto): (k, e) for k, e in ebpf_entries(flow, IDS, NOW)}


def test_a_clusterip_flow_becomes_a_forward_and_a_reply_entry() -> None:
    got = entries(CLUSTERIP)
    fkey, fwd = got[(CtDir.FORWARD, 6)]
    assert (fkey.saddr, fkey.daddr, fkey.sport, fkey.dport) == (
        ip_be(POD_CLIENT),
        ip_be(VIP),
        port_be(40000),
        port_be(80),
    )
    assert (fwd.nat_addr, fwd.nat_port, fwd.snat_addr, fwd.snat_port) == (ip_be(BE1), port_be(8080), 0, 0)
    assert (fwd.fe_addr, fwd.fe_port, fwd.svc_id, fwd.backend_id) == (ip_be(VIP), port_be(80), 3, 21)
    assert fwd.flags == CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED | CtFlag.ADOPTED
    assert fwd.last_seen_ns == NOW
    rkey, rep = got[(CtDir.REPLY, 6)]
    assert (rkey.saddr, rkey.daddr, rkey.sport, rkey.dport) == (
        ip_be(BE1),
        ip_be(POD_CLIENT),
        port_be(8080),
        port_be(40000),
    )
    assert (rep.nat_addr, rep.nat_port, rep.fe_addr, rep.fe_port) == (0, 0, ip_be(VIP), port_be(80))


def test_a_masqueraded_flow_keeps_its_snat_source_and_port() -> None:
    got = entries(NODEPORT)
    _, fwd = got[(CtDir.FORWARD, 6)]
    assert (fwd.snat_addr, fwd.snat_port, fwd.nat_addr) == (ip_be(NODE), port_be(61000), ip_be(REMOTE_BE))
    assert fwd.flags & CtFlag.SNAT
    rkey, rep = got[(CtDir.REPLY, 6)]
    assert (rkey.daddr, rkey.dport) == (ip_be(NODE), port_be(61000))
    assert (rep.nat_addr, rep.nat_port) == (ip_be(CLIENT), port_be(5555))


@pytest.mark.parametrize(
    ("flow", "node", "why"),
    [
        (CLUSTERIP, (), None),
        (NatFlow(6, (POD_CLIENT, BE1, 40000, 8080), (BE1, POD_CLIENT, 8080, 40000)), (), Skip.NOT_A_SERVICE),
        (NatFlow(6, (POD_CLIENT, "10.96.9.9", 1, 80), (BE1, POD_CLIENT, 8080, 1)), (), Skip.NOT_A_SERVICE),
        (NatFlow(6, CLUSTERIP.orig, CLUSTERIP.reply, tcp_state=TcpState.TIME_WAIT), (), Skip.ENDED),
        (
            NatFlow(6, ("192.168.0.11", VIP, 1, 80), (BE1, "192.168.0.11", 8080, 1)),
            ("192.168.0.11",),
            Skip.NODE_CLIENT,
        ),
        (NatFlow(17, (POD_CLIENT, VIP, 1, 53), ("10.244.1.77", POD_CLIENT, 53, 1)), (), Skip.BACKEND_GONE),
        (NatFlow(17, (POD_CLIENT, VIP, 1, 53), (BE1, POD_CLIENT, 53, 1)), (), None),
        (ASSOCIATION, (), None),
        (NatFlow(132, ASSOCIATION.orig, ASSOCIATION.reply, sctp_state=SctpState.CLOSED), (), Skip.ENDED),
        (NatFlow(33, (POD_CLIENT, VIP, 1, 80), (BE1, POD_CLIENT, 8080, 1)), (), Skip.PROTOCOL),
    ],
    ids=[
        "clusterip",
        "no-dnat",
        "no-frontend",
        "time-wait",
        "node-client",
        "udp-backend-gone",
        "udp",
        "sctp",
        "sctp-closed",
        "dccp",
    ],
)
def test_which_kernel_flows_are_carried(flow: NatFlow, node: tuple[str, ...], why: Skip | None) -> None:
    assert why_not_carried(flow, IDS, node) is why


def test_an_sctp_association_is_carried_as_an_established_flow_and_handed_to_the_stack_with_its_tags() -> (
    None
):
    """The eBPF conntrack keeps SCTP in ct_any with the UDP-like states (replied, established);
    the plain entry legacy host routing's stack gets keeps the state and the verification tags
    the kernel checks every chunk but INIT against, and the SCTP established timeout."""
    got = {(k.dir, k.proto): (k, e) for k, e in ebpf_entries(ASSOCIATION, IDS, NOW)}
    _, fwd = got[(CtDir.FORWARD, 132)]
    assert fwd.flags == CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED | CtFlag.ADOPTED
    assert (fwd.svc_id, fwd.backend_id, fwd.nat_port) == (6, 24, port_be(5061))
    assert abi.ct_role(132) == "ct_any"
    plain = stack_flow(ASSOCIATION)
    assert (plain.sctp_state, plain.vtags) == (SctpState.ESTABLISHED, ASSOCIATION.vtags)
    assert timeout_of(plain, Timeouts()) == Timeouts().sctp_established
    key = next(k for k, _ in ebpf_entries(ASSOCIATION, IDS, NOW) if k.dir == CtDir.FORWARD)
    assert nat_flow(key, fwd) is None  # not back into nf_conntrack: the eBPF entry has no tags


def test_a_tcp_flow_to_a_backend_the_maps_do_not_have_keeps_it() -> None:
    gone = NatFlow(6, CLUSTERIP.orig, ("10.244.1.77", POD_CLIENT, 8080, 40000))
    assert why_not_carried(gone, IDS, ()) is None
    _, fwd = entries(gone)[(CtDir.FORWARD, 6)]
    assert (fwd.nat_addr, fwd.backend_id) == (ip_be("10.244.1.77"), 0)


@pytest.mark.parametrize(
    ("flow", "flags"),
    [
        (
            NatFlow(6, CLUSTERIP.orig, CLUSTERIP.reply, IPS_SEEN_REPLY, TcpState.CLOSE_WAIT),
            CtFlag.FIN_FWD | CtFlag.ESTABLISHED | CtFlag.SEEN_REPLY,
        ),
        (NatFlow(6, CLUSTERIP.orig, CLUSTERIP.reply, 0, TcpState.SYN_SENT), 0),
        (NatFlow(17, CLUSTERIP.orig, CLUSTERIP.reply, IPS_SEEN_REPLY, TcpState.NONE), CtFlag.SEEN_REPLY),
        (
            NatFlow(17, CLUSTERIP.orig, CLUSTERIP.reply, IPS_SEEN_REPLY | IPS_ASSURED, TcpState.NONE),
            CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED,
        ),
    ],
    ids=["half-closed", "syn-sent", "udp-replied", "udp-stream"],
)
def test_the_kernel_state_is_carried(flow: NatFlow, flags: int) -> None:
    _, fwd = ebpf_entries(flow, IDS, NOW)[1]
    assert fwd.flags == flags | CtFlag.ADOPTED


def test_an_ebpf_flow_and_back_is_the_same_kernel_flow() -> None:
    for flow in (CLUSTERIP, NODEPORT):
        fkey, fwd = entries(flow)[(CtDir.FORWARD, 6)]
        back = nat_flow(fkey, fwd)
        assert back == NatFlow(6, flow.orig, flow.reply, IPS_SEEN_REPLY | IPS_ASSURED, TcpState.ESTABLISHED)
        rkey, rep = entries(flow)[(CtDir.REPLY, 6)]
        assert nat_flow(rkey, rep) is None  # one kernel entry per flow: from its FORWARD entry


# the tc IPv6 path's flow: outside -> IPv6 NodePort -> remote backend, masqueraded to the node's
# IPv6 address and port 61000 (ekp_ct6_tcp's FORWARD entry)
NODEPORT6 = NatFlow(
    6, ("fd00:ff::100", "fd00:ff::11", 5555, 30080), ("fd00:a:2::7", "fd00:ff::11", 8080, 61000)
)


def test_udp_flows_ip6tables_masqueraded_into_the_tc_ranges_ports_count_as_tcp_ones() -> None:
    """The tc IPv6 path source-translates UDP as it does TCP, so a UDP flow ip6tables masqueraded to
    the node's IPv6 address with a port of --bpf-snat-ports holds a reply tuple its port walk could
    hand another flow (before it took UDP, only TCP flows counted); SCTP's, which it leaves to
    ip6tables whole, never can."""
    udp6 = NatFlow(17, NODEPORT6.orig, NODEPORT6.reply)
    sctp6 = NatFlow(132, NODEPORT6.orig, NODEPORT6.reply)
    assert masqueraded_into([udp6, sctp6, NODEPORT6], (61000, 65535), "fd00:ff::11") == [udp6, NODEPORT6]


def ct6_forward(flow: NatFlow, flags: int) -> tuple[abi.Ct6Key, abi.Ct6Entry]:
    s, d, sp, dp = flow.orig
    rs, rd, rsp, rdp = flow.reply
    key = abi.Ct6Key(
        abi.Addr6(*abi.ip6_words(s)), abi.Addr6(*abi.ip6_words(d)), port_be(sp), port_be(dp), 6, 0
    )
    entry = abi.Ct6Entry(
        last_seen_ns=NOW,
        nat_addr=abi.Addr6(*abi.ip6_words(rs)),
        snat_addr=abi.Addr6(*abi.ip6_words(rd)),
        fe_addr=abi.Addr6(*abi.ip6_words(d)),
        nat_port=port_be(rsp),
        snat_port=port_be(rdp),
        fe_port=port_be(dp),
        flags=flags,
        svc_id=4,
        backend_id=22,
    )
    return key, entry


def test_an_ipv6_tc_flow_is_handed_back_as_the_kernel_flow_it_is() -> None:
    """The tc IPv6 path's FORWARD entries (ekp_ct6_*) go to nf_conntrack as IPv4's do: the same
    fields, 16-byte addresses, the SNAT source the node's IPv6 address."""
    done = CtFlag.SNAT | CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED
    key, entry = ct6_forward(NODEPORT6, done)
    back = nat_flow(key, entry)
    assert back == NatFlow(
        6, NODEPORT6.orig, NODEPORT6.reply, IPS_SEEN_REPLY | IPS_ASSURED, TcpState.ESTABLISHED
    )
    assert back is not None and back.family == 6 and back.dnat and back.snat
    key.dir = CtDir.REPLY
    assert nat_flow(key, entry) is None


def test_closed_ebpf_flows_are_not_exported() -> None:
    fkey, fwd = entries(CLUSTERIP)[(CtDir.FORWARD, 6)]
    fwd.flags |= CtFlag.RST
    assert nat_flow(fkey, fwd) is None
    fwd.flags = CtFlag.FIN_FWD | CtFlag.ESTABLISHED
    assert nat_flow(fkey, fwd) is not None and nat_flow(fkey, fwd).tcp_state == TcpState.CLOSE_WAIT  # type: ignore[union-attr]
    fwd.flags |= CtFlag.FIN_REPLY
    assert nat_flow(fkey, fwd) is None


def test_the_kernel_status_names_the_nat_it_carries() -> None:
    both = IPS_CONFIRMED | IPS_SEEN_REPLY | IPS_ASSURED | IPS_DST_NAT | IPS_DST_NAT_DONE
    assert kernel_status(CLUSTERIP) == both
    assert kernel_status(NODEPORT) == both | IPS_SRC_NAT | IPS_SRC_NAT_DONE
    t = Timeouts(tcp_established=86400, tcp_close_wait=3600, tcp_syn=60, udp=30, udp_stream=120)
    assert timeout_of(CLUSTERIP, t) == 86400
    assert timeout_of(NatFlow(17, CLUSTERIP.orig, CLUSTERIP.reply, IPS_SEEN_REPLY), t) == 30


def test_the_stack_tracks_a_flow_as_client_and_backend() -> None:
    # legacy host routing: between ingress (destination) and egress (source), whatever the NAT
    assert stack_flow(CLUSTERIP) == NatFlow(6, (POD_CLIENT, BE1, 40000, 8080), (BE1, POD_CLIENT, 8080, 40000))
    plain = stack_flow(NODEPORT)
    assert (plain.orig, plain.reply) == ((CLIENT, REMOTE_BE, 5555, 8080), (REMOTE_BE, CLIENT, 8080, 5555))
    assert not plain.dnat and not plain.snat and plain.tcp_state == NODEPORT.tcp_state
    assert kernel_status(plain) == IPS_CONFIRMED | IPS_SEEN_REPLY | IPS_ASSURED  # no NAT set up
    # the clash: a flow whose source was not translated has the plain flow's reply tuple
    assert stack_flow(CLUSTERIP).reply == CLUSTERIP.reply and stack_flow(NODEPORT).reply != NODEPORT.reply


# ---- KernelTakeover and EbpfHandback with fakes --------------------------------------------------


class FakeReplace:
    """nfct.replace_flows' steps as events, `during(flow)` called where the flow's entries are being
    replaced (between its `before` and `after`)."""

    def __init__(self, events: list[str], during: Callable[[NatFlow], None] = lambda flow: None) -> None:
        self.events = events
        self.during = during

    def __call__(
        self,
        netns: str,
        flows: Iterable[NatFlow],
        by: Callable[[NatFlow], NatFlow],
        timeouts: Timeouts,
        *,
        before: Callable[[NatFlow], None],
        after: Callable[[NatFlow], None],
    ) -> Replaced:
        done = Replaced()
        for flow in flows:
            new = by(flow)
            assert not new.dnat and not new.snat
            before(flow)
            self.events += [f"delete {[flow.orig]}", f"delete {[new.orig]}", f"create {[new.orig]}"]
            self.during(flow)
            done.retired += 1
            done.made.created += 1
            after(flow)
        return done


def quiet_takeover(
    dump: Callable[[str], Iterable[NatFlow]],
    replace: Callable[..., Replaced],
    *,
    routing: HostRouting | None = None,
    clock_ns: Callable[[], int] = lambda: NOW,
) -> KernelTakeover:
    """A takeover of node1 (its address NODE) whose rule removal and sysctls do nothing."""
    config = Config(netns="node1") if routing is None else Config(netns="node1", bpf_host_routing=routing)
    return KernelTakeover(
        config,
        dump=dump,
        addresses=lambda netns: {NODE},
        remove_rules=lambda config: None,
        sysctl=lambda netns, path, value: "0",
        read_sysctl=lambda netns, path: "0",
        replace=replace,
        clock_ns=clock_ns,
    )


def fake_maps() -> dict[str, MapWriter]:
    maps: dict[str, MapWriter] = {role: FakeMap(MAPS[role]) for role in ("fe", "be", "ct_tcp", "ct_any")}
    for (addr, port, proto), svc in IDS.services.items():
        maps["fe"].update(
            abi.FrontendKey(ip_be(addr), port_be(port), proto, Scope.INTERNAL), abi.Frontend(svc_id=svc)
        )
    for (addr, port, proto), bid in IDS.backends.items():
        maps["be"].update(abi.BackendKey(bid), abi.Backend(ip_be(addr), port_be(port), proto, 0))
    return maps


def test_the_ids_index_holds_only_what_the_flows_name() -> None:
    # At 50,000 Services an index of every frontend and backend was the first sync's peak memory.
    ids = ebpf_ids(fake_maps(), [CLUSTERIP, NODEPORT])
    assert ids.services == {(VIP, 80, 6): 3, (NODE, 30080, 6): 4}
    assert ids.backends == {(BE1, 8080, 6): 21, (REMOTE_BE, 8080, 6): 22}


def test_with_no_flow_to_carry_the_maps_are_not_read() -> None:
    takeover = KernelTakeover(
        Config(netns="node1"),
        dump=lambda netns: [],
        addresses=lambda netns: {"192.168.0.11"},
        remove_rules=lambda config: None,
        sysctl=lambda netns, path, value: "0",
        read_sysctl=lambda netns, path: "0",
    )
    no_maps: dict[str, MapWriter] = {}  # a read of any map raises KeyError
    takeover.before_attach(no_maps)
    takeover.after_attach(no_maps)
    assert takeover.carried == 0


@pytest.mark.parametrize("routing", list(HostRouting))
def test_the_takeover_carries_before_and_after_the_attach_then_removes_the_rules_once_all_serve(
    routing: HostRouting,
) -> None:
    events: list[str] = []
    kernel = [CLUSTERIP, NatFlow(6, ("192.168.0.11", VIP, 1, 80), (BE1, "192.168.0.11", 8080, 1))]

    def dump(netns: str) -> list[NatFlow]:
        events.append(f"dump {netns}")
        return list(kernel)

    takeover = KernelTakeover(
        Config(netns="node1", bpf_host_routing=routing),
        dump=dump,
        addresses=lambda netns: {"192.168.0.11"},
        remove_rules=lambda config: events.append(f"remove rules {config.netns}"),
        sysctl=lambda netns, path, value: events.append(f"{path}={value}") or "0",  # type: ignore[func-returns-value]
        read_sysctl=lambda netns, path: "0",
        replace=FakeReplace(events),
        clock_ns=lambda: NOW,
    )
    maps = fake_maps()
    takeover.before_attach(maps)
    assert takeover.carried == 1 and len(maps["ct_tcp"].items()) == 2  # the node's own client left
    kernel.append(NODEPORT)  # started by the old data path meanwhile
    mine = abi.CtEntry(nat_addr=ip_be(BE1), nat_port=port_be(8080), flags=CtFlag.ESTABLISHED)
    fkey = next(k for k, _ in ebpf_entries(CLUSTERIP, IDS, NOW) if k.dir == CtDir.FORWARD)
    maps["ct_tcp"].update(fkey, mine)  # the programs wrote this one since: it is kept
    takeover.after_attach(maps)
    assert takeover.carried == 2 and len(maps["ct_tcp"].items()) == 4
    assert dict((bytes(k), bytes(v)) for k, v in maps["ct_tcp"].items())[bytes(fkey)] == bytes(mine)
    liberal = "net/netfilter/nf_conntrack_tcp_be_liberal"

    # legacy host routing: the stack sees the carried flows again, as client <-> backend; their NAT
    # entries go (the node's own client keeps its), then the plain tuples' (another source port,
    # made since the attach), then the plain entries are made, for both carries' flows in one pass
    # after the second dump (the flow started meanwhile has no eBPF entry until that dump, the one
    # carried before is netfilter's, NFPASS, meanwhile). bpf routing: netfilter sees none.
    def to_stack(flow: NatFlow) -> list[str]:
        plain = [stack_flow(flow).orig]
        return [f"delete {[flow.orig]}", f"delete {plain}", f"create {plain}"]

    legacy = routing == HostRouting.LEGACY
    assert events == [
        "dump node1",
        f"{liberal}=1",
        "dump node1",
        *(to_stack(CLUSTERIP) if legacy else []),
        *(to_stack(NODEPORT) if legacy else []),
        f"{liberal}=0",
    ]
    takeover.serving()  # the socket programs linked too: kube-proxy's OUTPUT rules no longer needed
    assert events[-1] == "remove rules node1"


class Sysctl:
    """A namespace's sysctls: set returns the value before, as agent's sysctl helper does."""

    def __init__(self, **values: str) -> None:
        self.values = {k.replace("__", "/"): v for k, v in values.items()}

    def __call__(self, netns: str, path: str, value: str) -> str | None:
        was = self.values.get(path)
        self.values[path] = value
        return was

    def read(self, netns: str, path: str) -> str | None:
        return self.values.get(path)


LIBERAL = "net/netfilter/nf_conntrack_tcp_be_liberal"


def test_the_second_carry_failing_to_read_the_nodes_addresses_hands_the_first_over_all_the_same() -> None:
    """The node's addresses unreadable at the second carry (as _carry6 already took): the flows
    carried before the attach still have their NAT entries replaced (their NFPASS would otherwise
    run out with netfilter's entries in place), and the window checks come back."""
    events: list[str] = []
    reads = [frozenset({NODE})]

    def addresses(netns: str) -> frozenset[str]:
        if not reads:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return reads.pop()

    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")
    takeover = KernelTakeover(
        Config(netns="node1", bpf_host_routing=HostRouting.LEGACY),
        dump=lambda netns: [CLUSTERIP],
        addresses=addresses,
        remove_rules=lambda config: None,
        sysctl=sysctl,
        read_sysctl=sysctl.read,
        replace=FakeReplace(events),
        clock_ns=lambda: NOW,
    )
    maps = fake_maps()
    takeover.before_attach(maps)
    assert sysctl.values[LIBERAL] == "1"
    takeover.after_attach(maps)
    assert events == [
        f"delete {[CLUSTERIP.orig]}",
        f"delete {[stack_flow(CLUSTERIP).orig]}",
        f"create {[stack_flow(CLUSTERIP).orig]}",
    ]
    assert sysctl.values[LIBERAL] == "0"


def test_the_first_carry_failing_to_read_the_nodes_addresses_fails_before_the_attach() -> None:
    """Before the attach the sync fails and is tried again: attached with nothing carried, every
    flow of nf_conntrack would have its next segments dropped. The window checks stay on."""
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")

    def addresses(netns: str) -> frozenset[str]:
        raise OSError(errno.EBUSY, "Device or resource busy")

    takeover = KernelTakeover(
        Config(netns="node1", bpf_host_routing=HostRouting.LEGACY),
        dump=lambda netns: [CLUSTERIP],
        addresses=addresses,
        remove_rules=lambda config: None,
        sysctl=sysctl,
        read_sysctl=sysctl.read,
        replace=FakeReplace([]),
        clock_ns=lambda: NOW,
    )
    with pytest.raises(OSError, match="busy"):
        takeover.before_attach(fake_maps())
    assert sysctl.values[LIBERAL] == "0"


PIN = "/sys/fs/bpf/ekp-node1"
INODE = 4026532000


def kept_takeover(
    state_dir: Path | None,
    sysctl: Sysctl,
    flows: list[NatFlow],
    *,
    liberal: bool = False,
    inode: int = INODE,
    pin_path: str = PIN,
) -> KernelTakeover:
    """A takeover of node1 (legacy host routing) over `sysctl`, keeping the node's own
    tcp_be_liberal in `state_dir` (None: in the object alone)."""
    return KernelTakeover(
        Config(
            netns="node1",
            bpf_host_routing=HostRouting.LEGACY,
            pin_path=pin_path,
            conntrack=ConntrackSettings(tcp_be_liberal=liberal),
        ),
        dump=lambda netns: flows,
        addresses=lambda netns: {NODE},
        remove_rules=lambda config: None,
        sysctl=sysctl,
        read_sysctl=sysctl.read,
        replace=FakeReplace([]),
        clock_ns=lambda: NOW,
        state_dir=str(state_dir) if state_dir is not None else "",
        netns_inode=lambda netns: inode,
    )


@pytest.mark.parametrize("end", ["retry", "stop"])
def test_an_attach_aborted_with_programs_on_some_devices_keeps_the_window_checks_off(end: str) -> None:
    """Aborted once a program of ours may be on a device: the flows it translates have one
    direction netfilter never sees, so tcp_be_liberal stays 1; the retry's after_attach puts the
    node's own value back (not the 1 it finds), or the agent's stop does."""
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")
    takeover = kept_takeover(None, sysctl, [CLUSTERIP])
    maps = fake_maps()
    takeover.before_attach(maps)
    takeover.abort(attached=True)
    assert sysctl.values[LIBERAL] == "1", "some devices carry programs: checks stay off"
    if end == "retry":
        takeover.before_attach(maps)
        assert sysctl.values[LIBERAL] == "1"
        takeover.after_attach(maps)
    else:
        takeover.close()
    assert sysctl.values[LIBERAL] == "0"


@pytest.mark.parametrize("carries_again", [True, False])
def test_an_agent_restarted_mid_takeover_puts_the_nodes_own_tcp_be_liberal_back(
    tmp_path: Path, carries_again: bool
) -> None:
    """Killed between before_attach and after_attach, the agent leaves the node at 1: the next
    agent's first attach finds 1 there, and puts back the node's own 0 from the lock directory,
    whether or not it has flows to carry; the file goes once it is back."""
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")

    def takeover(flows: list[NatFlow]) -> KernelTakeover:
        return kept_takeover(tmp_path, sysctl, flows)

    kept = Path(liberal_path(str(tmp_path), INODE))
    takeover([CLUSTERIP]).before_attach(fake_maps())  # then SIGKILL: no after_attach, no close
    assert sysctl.values[LIBERAL] == "1" and kept.read_text() == "0\n"
    restarted = takeover([CLUSTERIP] if carries_again else [])
    maps = fake_maps()
    restarted.before_attach(maps)
    restarted.after_attach(maps)
    assert sysctl.values[LIBERAL] == "0"
    assert not kept.exists()
    clean = takeover([CLUSTERIP])  # a takeover run to its end leaves no file behind
    clean.before_attach(maps)
    assert sysctl.values[LIBERAL] == "1" and kept.read_text() == "0\n"
    clean.after_attach(maps)
    assert sysctl.values[LIBERAL] == "0" and not kept.exists()


def test_a_kept_value_is_not_put_back_when_the_config_asks_for_tcp_be_liberal(tmp_path: Path) -> None:
    """conntrack.tcpBeLiberal: true (setup_conntrack set 1 at this start): a file an earlier agent
    run without it left is removed, not acted on (its 0 would undo the config)."""
    kept = Path(liberal_path(str(tmp_path), INODE))
    kept.write_text("0\n")
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="1")
    takeover = kept_takeover(tmp_path, sysctl, [CLUSTERIP], liberal=True)
    maps = fake_maps()
    takeover.before_attach(maps)
    takeover.after_attach(maps)
    assert sysctl.values[LIBERAL] == "1"
    assert not kept.exists()


def test_a_stale_kept_value_is_removed_not_put_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The node reads 0 (kube-proxy or iptables mode ran since the agent was killed, and set it
    back): the file is stale; it goes, and the 1 this takeover sets is followed by the 0 it read."""
    kept = Path(liberal_path(str(tmp_path), INODE))
    kept.write_text("1\n")  # what the node had then, say; 0 now
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")
    caplog.set_level(logging.INFO)
    takeover = kept_takeover(tmp_path, sysctl, [CLUSTERIP])
    maps = fake_maps()
    takeover.before_attach(maps)
    assert sysctl.values[LIBERAL] == "1" and kept.read_text() == "0\n"  # this takeover's own
    takeover.after_attach(maps)
    assert sysctl.values[LIBERAL] == "0" and not kept.exists()
    assert "the file is stale" in caplog.text


@pytest.mark.parametrize("liberal", [False, True])
def test_a_put_back_without_a_takeover_restores_the_kept_value_and_removes_the_file(
    tmp_path: Path, liberal: bool
) -> None:
    """No takeover follows (put_back_liberal): the node's own value comes back unless the config
    asks for 1, and the file goes either way, so no later eBPF start acts on a stale one; with it
    the temporary file of an agent killed while writing it."""
    kept = Path(liberal_path(str(tmp_path), INODE))
    kept.write_text("0\n")
    leftover = Path(f"{kept}.4242.tmp")
    leftover.write_text("0\n")
    other = Path(f"{liberal_path(str(tmp_path), INODE + 1)}.4242.tmp")  # another namespace's
    other.write_text("0\n")
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="1")
    config = Config(netns="node1", pin_path=PIN, conntrack=ConntrackSettings(tcp_be_liberal=liberal))
    put_back_liberal(
        config, str(tmp_path), read_sysctl=sysctl.read, write_sysctl=sysctl, inode=lambda netns: INODE
    )
    assert sysctl.values[LIBERAL] == ("1" if liberal else "0")
    assert not kept.exists() and not leftover.exists() and other.exists()


def test_an_abort_of_an_attach_that_put_back_a_kept_value_keeps_the_window_checks_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The value came from a killed agent's file: its programs may still be attached, so an abort
    before any of this agent's is (attached=False) leaves 1 as attached=True does, saying that
    cause (this attach put none on); close puts it back."""
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")
    kept_takeover(tmp_path, sysctl, [CLUSTERIP]).before_attach(fake_maps())  # then SIGKILL
    assert sysctl.values[LIBERAL] == "1"
    restarted = kept_takeover(tmp_path, sysctl, [])
    restarted.before_attach(fake_maps())
    with caplog.at_level(logging.WARNING, logger="agent"):
        restarted.abort(attached=False)
    assert sysctl.values[LIBERAL] == "1"
    assert "an earlier agent killed mid-takeover may have left our programs" in caplog.text
    assert "first attach stopped" not in caplog.text
    restarted.close()
    assert sysctl.values[LIBERAL] == "0"


def test_a_kept_value_is_the_namespaces_own(tmp_path: Path) -> None:
    """The sysctl is per network namespace: an agent on another namespace (another inode) with the
    same pin path does not take this one's file."""
    node1 = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")
    kept_takeover(tmp_path, node1, [CLUSTERIP]).before_attach(fake_maps())  # then SIGKILL
    other = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="1")  # set on purpose there
    maps = fake_maps()
    elsewhere = kept_takeover(tmp_path, other, [], inode=INODE + 1)
    elsewhere.before_attach(maps)
    elsewhere.after_attach(maps)
    assert other.values[LIBERAL] == "1"
    assert Path(liberal_path(str(tmp_path), INODE)).read_text() == "0\n"


def test_the_value_is_kept_before_the_takeover_sets_1(tmp_path: Path) -> None:
    """Read, kept, then written: an agent killed between the write and the keep would leave 1 and
    no file."""
    kept = Path(liberal_path(str(tmp_path), INODE))
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")
    seen: list[bool] = []

    class Watched(Sysctl):
        def __call__(self, netns: str, path: str, value: str) -> str | None:
            if value == "1":
                seen.append(kept.exists())
            return sysctl(netns, path, value)

        def read(self, netns: str, path: str) -> str | None:
            return sysctl.read(netns, path)

    kept_takeover(tmp_path, Watched(), [CLUSTERIP]).before_attach(fake_maps())
    assert seen == [True]


def test_a_kept_value_is_found_by_an_agent_with_another_pin_path(tmp_path: Path) -> None:
    """One agent per namespace (agent.lock): the next one, started with another --bpf-pin-path,
    still puts back what a killed one kept."""
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")
    kept_takeover(tmp_path, sysctl, [CLUSTERIP]).before_attach(fake_maps())  # then SIGKILL
    assert sysctl.values[LIBERAL] == "1"
    maps = fake_maps()
    restarted = kept_takeover(tmp_path, sysctl, [], pin_path="/sys/fs/bpf/ekp-elsewhere")
    restarted.before_attach(maps)
    restarted.after_attach(maps)
    assert sysctl.values[LIBERAL] == "0"
    assert not Path(liberal_path(str(tmp_path), INODE)).exists()


class UnreadableSysctl(Sysctl):
    def read(self, netns: str, path: str) -> str | None:
        raise PermissionError(errno.EACCES, "Permission denied")


@pytest.mark.parametrize("broken", ["directory", "sysctl"])
def test_a_kept_file_that_cannot_be_read_is_said_and_kept_and_the_start_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: str
) -> None:
    """A directory at the file's path, or the sysctl unreadable: the first attach (and an iptables
    start's or a cleanup's put-back) goes on as without a file, says which file and what to do by
    hand, and leaves the file for a later start."""
    kept = Path(liberal_path(str(tmp_path), INODE))
    if broken == "directory":
        kept.mkdir()
        sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="1")
    else:
        kept.write_text("0\n")
        sysctl = UnreadableSysctl(net__netfilter__nf_conntrack_tcp_be_liberal="1")
    put_back_liberal(
        Config(netns="node1", pin_path=PIN),
        str(tmp_path),
        read_sysctl=sysctl.read,
        write_sysctl=sysctl,
        inode=lambda netns: INODE,
    )
    assert sysctl.values[LIBERAL] == "1"
    assert f"cannot read {kept}" in caplog.text and "set the node's own value by hand" in caplog.text
    caplog.clear()
    takeover = kept_takeover(tmp_path, sysctl, [])
    maps = fake_maps()
    takeover.before_attach(maps)  # no flow to carry: the sysctl is not read again
    takeover.after_attach(maps)
    assert f"cannot read {kept}" in caplog.text
    assert kept.exists()


def test_a_put_back_whose_netns_cannot_be_stat_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An OSError but a missing namespace (EACCES, say): said with the directory, not raised into
    the start or the cleanup."""

    def denied(netns: str) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="1")
    put_back_liberal(
        Config(netns="node1"), str(tmp_path), read_sysctl=sysctl.read, write_sysctl=sysctl, inode=denied
    )
    assert "cannot find netns node1's inode" in caplog.text


def test_an_attach_retried_after_a_failed_restore_does_not_take_its_own_file_for_a_killed_agents(
    tmp_path: Path,
) -> None:
    """abort(attached=False) whose write back fails leaves the file (for a restart): the retried
    attach is this object's, so its own abort(attached=False) puts the value back, as the first
    would have (read as a killed agent's, the value would stay 1 until close)."""
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")
    refuse = [True]

    class Refusing(Sysctl):
        def __call__(self, netns: str, path: str, value: str) -> str | None:
            if value == "0" and refuse:
                refuse.pop()
                raise OSError(errno.EIO, "Input/output error")
            return sysctl(netns, path, value)

        def read(self, netns: str, path: str) -> str | None:
            return sysctl.read(netns, path)

    takeover = kept_takeover(tmp_path, Refusing(), [CLUSTERIP])
    takeover.before_attach(fake_maps())
    takeover.abort(attached=False)  # the write of 0 refused
    assert sysctl.values[LIBERAL] == "1"
    takeover.before_attach(fake_maps())
    takeover.abort(attached=False)
    assert sysctl.values[LIBERAL] == "0"
    assert not Path(liberal_path(str(tmp_path), INODE)).exists()


def test_an_attach_aborted_after_the_carry_restores_the_window_checks_and_a_failing_restore_hides_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")
    takeover = KernelTakeover(
        Config(netns="node1", bpf_host_routing=HostRouting.LEGACY),
        dump=lambda netns: [CLUSTERIP],
        addresses=lambda netns: {NODE},
        remove_rules=lambda config: None,
        sysctl=sysctl,
        read_sysctl=sysctl.read,
        replace=FakeReplace([]),
        clock_ns=lambda: NOW,
    )
    maps = fake_maps()
    takeover.before_attach(maps)
    assert sysctl.values[LIBERAL] == "1"
    takeover.abort(attached=False)
    assert sysctl.values[LIBERAL] == "0"

    def refusing(netns: str, path: str, value: str) -> str | None:
        if value == "0":
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return sysctl(netns, path, value)

    takeover = KernelTakeover(
        Config(netns="node1", bpf_host_routing=HostRouting.LEGACY),
        dump=lambda netns: [CLUSTERIP],
        addresses=lambda netns: {NODE},
        remove_rules=lambda config: None,
        sysctl=refusing,
        read_sysctl=sysctl.read,
        replace=lambda *a, **k: (_ for _ in ()).throw(RuntimeError("the pass's own error")),
        clock_ns=lambda: NOW,
    )
    takeover.before_attach(maps)
    with pytest.raises(RuntimeError, match="the pass's own error"):
        takeover.after_attach(maps)
    assert f"cannot set {LIBERAL} back to 0 in netns node1" in caplog.text


def test_an_attach_that_failed_after_the_carry_restores_the_window_checks_and_a_retry_keeps_them() -> None:
    """after_attach stopped by an error: the node's tcp_be_liberal comes back all the same; the
    sync retried runs before_attach again, which must not take the "1" it set for the node's own."""
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="0")
    failing = [RuntimeError("anything the pass did not foresee")]

    def replace(*args: Any, **kwargs: Any) -> Replaced:
        if failing:
            raise failing.pop()
        return FakeReplace([])(*args, **kwargs)

    takeover = KernelTakeover(
        Config(netns="node1", bpf_host_routing=HostRouting.LEGACY),
        dump=lambda netns: [CLUSTERIP],
        addresses=lambda netns: {NODE},
        remove_rules=lambda config: None,
        sysctl=sysctl,
        read_sysctl=sysctl.read,
        replace=replace,
        clock_ns=lambda: NOW,
    )
    maps = fake_maps()
    takeover.before_attach(maps)
    with pytest.raises(RuntimeError):
        takeover.after_attach(maps)
    assert sysctl.values[LIBERAL] == "0"
    takeover.before_attach(maps)  # the next sync: not attached once yet
    takeover.before_attach(maps)  # and once more before an after_attach (an attach failed)
    takeover.after_attach(maps)
    assert sysctl.values[LIBERAL] == "0"


# pod -> `kubernetes` ClusterIP -> the API server on the node's own address (a host-network endpoint)
API_FLOW = NatFlow(6, (POD_CLIENT, VIP, 40100, 80), (NODE, POD_CLIENT, 6443, 40100))


def test_a_flow_that_meets_the_stack_is_carried_as_netfilters_and_one_to_the_node_as_a_host_flow() -> None:
    """A flow to the node's own address is handed to the node's stack (CtFlag.HOST, as for a new
    flow to a BackendFlag.HOST backend); one that meets the stack (that one, or any under legacy
    host routing) is still nf_conntrack's (NFPASS) until the agent replaced its NAT entry."""
    assert host_backend(API_FLOW, {NODE}) and not host_backend(CLUSTERIP, {NODE})
    base = CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED | CtFlag.ADOPTED
    for key, entry in ebpf_entries(API_FLOW, IDS, NOW, host=True, nfpass=True):
        assert entry.flags == base | CtFlag.HOST | CtFlag.NFPASS
        assert key in ct_keys(API_FLOW)
    assert [e.flags for _, e in ebpf_entries(CLUSTERIP, IDS, NOW, nfpass=True)] == [base | CtFlag.NFPASS] * 2
    assert [e.flags for _, e in ebpf_entries(CLUSTERIP, IDS, NOW)] == [base] * 2


def flow_flags(maps: Mapping[str, MapWriter], flow: NatFlow) -> dict[int, int]:
    """The flags of `flow`'s entries, by direction."""
    got = {}
    for k, e in maps[abi.ct_role(flow.proto)].items():
        if isinstance(k, abi.CtKey) and isinstance(e, abi.CtEntry) and k in ct_keys(flow):
            got[int(k.dir)] = int(e.flags)
    return got


@pytest.mark.parametrize("routing", list(HostRouting))
def test_flows_that_meet_the_stack_are_netfilters_until_each_is_replaced_in_turn(
    routing: HostRouting,
) -> None:
    """Under either host routing the stack sees a host flow's packets, under legacy a pod flow's
    too: both are carried as netfilter's (NFPASS: the data path passes their packets), then each in
    turn held (HANDOVER, NFPASS gone: its forward packets drop) while its NAT entry is replaced by
    the plain one, then released (neither flag), while the next one waits as netfilter's."""
    events: list[str] = []
    maps = fake_maps()
    legacy = routing == HostRouting.LEGACY
    handed = [CLUSTERIP, API_FLOW] if legacy else [API_FLOW]

    def during(flow: NatFlow) -> None:
        flags = {f.orig: list(flow_flags(maps, f).values()) for f in handed}
        held = flags[flow.orig]
        assert len(held) == 2 and all(x & CtFlag.HANDOVER and not x & CtFlag.NFPASS for x in held)
        for f in handed[handed.index(flow) + 1 :]:
            assert all(x & CtFlag.NFPASS and not x & CtFlag.HANDOVER for x in flags[f.orig])
        for f in handed[: handed.index(flow)]:
            assert not any(x & (CtFlag.NFPASS | CtFlag.HANDOVER) for x in flags[f.orig])
        events.append(f"held {flow.orig}")

    def dump(netns: str) -> list[NatFlow]:
        events.append("dump")
        return [CLUSTERIP, API_FLOW]

    takeover = quiet_takeover(dump, FakeReplace(events, during), routing=routing)
    takeover.before_attach(maps)
    flags = flow_flags(maps, API_FLOW)
    assert set(flags) == {CtDir.FORWARD, CtDir.REPLY} and flags[CtDir.FORWARD] == flags[CtDir.REPLY]
    assert all(f & CtFlag.NFPASS and f & CtFlag.HOST and not f & CtFlag.HANDOVER for f in flags.values())
    pod = flow_flags(maps, CLUSTERIP)
    assert all(bool(f & CtFlag.NFPASS) == legacy and not f & CtFlag.HANDOVER for f in pod.values())
    takeover.after_attach(maps)

    def to_stack(flow: NatFlow) -> list[str]:
        plain = [stack_flow(flow).orig]
        return [f"delete {[flow.orig]}", f"delete {plain}", f"create {plain}", f"held {flow.orig}"]

    assert events == ["dump", "dump", *(e for f in handed for e in to_stack(f))]
    for flow in (API_FLOW, CLUSTERIP):
        released = list(flow_flags(maps, flow).values())
        assert len(released) == 2 and not any(f & (CtFlag.HANDOVER | CtFlag.NFPASS) for f in released)
    assert all(f & CtFlag.HOST for f in flow_flags(maps, API_FLOW).values())


def test_an_agent_restarted_mid_switch_replaces_the_entries_its_predecessor_held() -> None:
    """The agent died between the carry and the replacement: its flows are NFPASS in the pinned
    conntrack and their NAT entries still in nf_conntrack. The next agent finds them carried
    already (BPF_NOEXIST), and still replaces their NAT entries and clears the flag."""
    maps = fake_maps()

    def takeover(events: list[str]) -> KernelTakeover:
        return quiet_takeover(lambda netns: [CLUSTERIP], FakeReplace(events))

    first: list[str] = []
    takeover(first).before_attach(maps)  # then killed
    assert first == [] and all(f & CtFlag.NFPASS for f in flow_flags(maps, CLUSTERIP).values())
    events: list[str] = []
    second = takeover(events)
    second.before_attach(maps)
    second.after_attach(maps)
    plain = stack_flow(CLUSTERIP).orig
    assert second.carried == 0 and events == [
        f"delete {[CLUSTERIP.orig]}",
        f"delete {[plain]}",
        f"create {[plain]}",
    ]
    assert not any(f & (CtFlag.NFPASS | CtFlag.HANDOVER) for f in flow_flags(maps, CLUSTERIP).values())


def still_held(entry: abi.CtEntry, now_ns: int) -> bool:
    """ekp_ct_nf_held (bpf/ekp_ct_af.h): whether the data path still treats the entry as held."""
    held = entry.flags & (CtFlag.NFPASS | CtFlag.HANDOVER)
    return bool(held) and now_ns // 10**9 - entry.created_s < abi.CT_HANDOVER_S


def many_flows(count: int) -> list[NatFlow]:
    return [
        NatFlow(6, (POD_CLIENT, VIP, 30000 + i, 80), (BE1, POD_CLIENT, 8080, 30000 + i)) for i in range(count)
    ]


def test_the_flows_waiting_for_their_turn_stay_held_while_the_agent_makes_progress() -> None:
    """The hold runs EKP_CT_HANDOVER_S from the carry; a replacement that takes longer than that
    (thousands of flows, or a starved agent: here 1.5 s per flow) renews it for the flows still
    waiting, so none of them is translated by the data path with its NAT entry in place."""
    maps = fake_maps()
    flows = many_flows(12)
    clock = [NOW]
    waiting_held: list[bool] = []

    def during(flow: NatFlow) -> None:
        later = flows[flows.index(flow) + 1 :]
        table = maps["ct_tcp"]
        for f in later:
            for key in ct_keys(f):
                entry = table.lookup(key)
                assert isinstance(entry, abi.CtEntry)
                waiting_held.append(still_held(entry, clock[0]))
        clock[0] += 1_500_000_000

    takeover = quiet_takeover(
        lambda netns: flows, FakeReplace([], during), routing=HostRouting.LEGACY, clock_ns=lambda: clock[0]
    )
    takeover.before_attach(maps)
    takeover.after_attach(maps)
    assert clock[0] - NOW == 18 * 10**9  # longer than the hold
    assert len(waiting_held) == 2 * 11 * 12 // 2 and all(waiting_held)
    for flow in flows:
        assert not any(f & (CtFlag.NFPASS | CtFlag.HANDOVER) for f in flow_flags(maps, flow).values())


def test_the_first_carrys_holds_are_renewed_before_the_second_read_of_nf_conntrack() -> None:
    """The flows carried before the attach are held from that carry; the second read after the
    attach takes seconds of its own on a node of many flows (here 9 s, after 2 s of attaching):
    renewed before it, none of them is translated with its NAT entry in place at its turn."""
    maps = fake_maps()
    flows = many_flows(4)
    clock = [NOW]
    reads = [0]
    held_at_turn: list[bool] = []

    def dump(netns: str) -> list[NatFlow]:
        reads[0] += 1
        if reads[0] == 2:
            clock[0] += 9 * 10**9  # the second read, of a node with many flows
        return flows

    def during(flow: NatFlow) -> None:
        for f in flows[flows.index(flow) + 1 :]:
            for key in ct_keys(f):
                entry = maps["ct_tcp"].lookup(key)
                assert isinstance(entry, abi.CtEntry)
                held_at_turn.append(still_held(entry, clock[0]))

    takeover = quiet_takeover(
        dump, FakeReplace([], during), routing=HostRouting.LEGACY, clock_ns=lambda: clock[0]
    )
    takeover.before_attach(maps)
    clock[0] += 2 * 10**9  # attaching to every device
    takeover.after_attach(maps)
    assert reads[0] == 2 and clock[0] - NOW == 11 * 10**9  # past the hold counted from the carry
    assert held_at_turn and all(held_at_turn)


def test_flows_replaced_after_their_hold_expired_are_counted_and_not_held_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An agent starved for longer than the hold between the carry and the replacement: the data
    path translated the flows meanwhile; the agent says so, and does not hold them again."""
    maps = fake_maps()
    flows = many_flows(3)
    clock = [NOW]
    renewed: list[bool] = []

    def during(flow: NatFlow) -> None:
        for f in flows[flows.index(flow) + 1 :]:
            for key in ct_keys(f):
                entry = maps["ct_tcp"].lookup(key)
                assert isinstance(entry, abi.CtEntry)
                renewed.append(entry.created_s != NOW // 10**9)

    takeover = quiet_takeover(
        lambda netns: flows, FakeReplace([], during), routing=HostRouting.LEGACY, clock_ns=lambda: clock[0]
    )
    takeover.before_attach(maps)
    clock[0] += (abi.CT_HANDOVER_S + 1) * 10**9
    takeover.after_attach(maps)
    assert renewed and not any(renewed)
    assert "3 of the 3 carried flows had their NAT entries replaced after their hold" in caplog.text


def test_flows_whose_entries_cannot_be_replaced_are_released_to_the_data_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No NET_ADMIN: the flows are not left to netfilter, whose rules go next (nor to the hold's
    expiry), but translated by the data path, as before NFPASS."""

    def refused(*args: object, **kwargs: object) -> Replaced:
        raise PermissionError(1, "Operation not permitted")

    maps = fake_maps()
    takeover = quiet_takeover(lambda netns: [CLUSTERIP, API_FLOW], refused)
    takeover.before_attach(maps)
    assert all(f & CtFlag.NFPASS for flow in (CLUSTERIP, API_FLOW) for f in flow_flags(maps, flow).values())
    takeover.after_attach(maps)
    assert "needs NET_ADMIN" in caplog.text
    for flow in (CLUSTERIP, API_FLOW):
        assert not any(f & (CtFlag.HANDOVER | CtFlag.NFPASS) for f in flow_flags(maps, flow).values())


class RefusingMap(FakeMap):
    """Refuses the first rewrite (BPF_EXIST) of `key`'s entry (EBUSY)."""

    def __init__(self, base: MapWriter, key: abi.CtKey) -> None:
        assert isinstance(base, FakeMap)
        super().__init__(base.spec)
        for k, v in base.items():
            super().update(k, v)
        self.refuse: bytes | None = bytes(key)

    def update(self, key: Any, value: Any, flags: UpdateFlag = UpdateFlag.ANY) -> None:
        if flags == UpdateFlag.EXIST and bytes(key) == self.refuse:
            self.refuse = None
            raise MapError("ekp_ct_tcp", "update", errno.EBUSY)
        super().update(key, value, flags)


def test_a_hold_the_map_refuses_fails_that_flow_alone(caplog: pytest.LogCaptureFixture) -> None:
    """A MapError writing one flow's hold no longer ends the replacement: the other flows are
    replaced and released, and the refused write is logged."""
    events: list[str] = []
    maps = fake_maps()
    takeover = quiet_takeover(
        lambda netns: [CLUSTERIP, API_FLOW], FakeReplace(events), routing=HostRouting.LEGACY
    )
    takeover.before_attach(maps)
    maps["ct_tcp"] = RefusingMap(maps["ct_tcp"], ct_keys(CLUSTERIP)[0])
    takeover.after_attach(maps)
    assert [e for e in events if e.startswith("create")] == [
        f"create {[stack_flow(f).orig]}" for f in (CLUSTERIP, API_FLOW)
    ]
    assert not any(f & (CtFlag.NFPASS | CtFlag.HANDOVER) for f in flow_flags(maps, API_FLOW).values())
    assert "hold could not be written in eBPF conntrack" in caplog.text and "busy" in caplog.text


def test_a_socket_failure_is_worded_as_one_and_counts_the_flows_not_replaced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def fails_at_the_second(
        netns: str, flows: Iterable[NatFlow], by: Any, timeouts: Any, *, before: Any, after: Any
    ) -> Replaced:
        first = next(iter(flows))
        before(first)
        after(first)
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    maps = fake_maps()
    takeover = quiet_takeover(
        lambda netns: [CLUSTERIP, API_FLOW], fails_at_the_second, routing=HostRouting.LEGACY
    )
    takeover.before_attach(maps)
    takeover.after_attach(maps)
    assert "cannot replace the NAT entries of 1 of the 2 flows" in caplog.text
    assert "the ctnetlink socket failed" in caplog.text and "NET_ADMIN" not in caplog.text
    for flow in (CLUSTERIP, API_FLOW):
        assert not any(f & (CtFlag.HANDOVER | CtFlag.NFPASS) for f in flow_flags(maps, flow).values())


def detaching(
    *devices: str, then: Callable[[str], object] = lambda netns: None
) -> Callable[[str, list[str], Callable[[], None]], None]:
    """EbpfHandback's detach: the programs leave `devices`, each appended to the caller's list,
    `between` called before each, as detach_all does."""

    def detach(netns: str, detached: list[str], between: Callable[[], None]) -> None:
        then(netns)
        for device in devices:
            between()
            detached.append(device)

    return detach


@dataclasses.dataclass
class FakeHolds:
    """out_of_ebpf.Holds, recording: create_flows calls hold and release (kernel tests below)."""

    events: list[str]
    held: int = 0
    passed: int = 0
    lapsed: list[NatFlow] = dataclasses.field(default_factory=list)

    def hold(self, flow: NatFlow) -> bool:
        self.events.append(f"hold {flow.orig[0]}")
        return True

    def release(self, flow: NatFlow) -> None:
        self.events.append(f"release {flow.orig[0]}")

    def renew(self) -> None:
        self.events.append("renew")

    def undo(self, delete: Callable[[list[NatFlow]], int]) -> Undone:
        self.events.append("undo")
        return Undone(deleted=delete([]))

    def close(self) -> None:
        self.events.append("close holds")


def test_the_handback_writes_detaches_writes_the_late_flows_and_removes_the_pins(tmp_path: Path) -> None:
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    events: list[str] = []
    reads = [[CLUSTERIP], [CLUSTERIP, NODEPORT]]
    holds = FakeHolds(events)

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        got = list(flows)
        events.append(f"create {netns} {[f.orig[0] for f in got]} {'held' if hold is holds else hold}")
        return Created(created=len(got))

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: reads.pop(0),
        create=create,
        detach=detaching("eth0", then=lambda netns: events.append(f"detach {netns}")),
        remove_pins=lambda pin_path: events.append("remove pins") or ["ekp_ct_tcp_v2"],  # type: ignore[func-returns-value]
        holds=lambda pin_path: holds,
    )
    assert handback.pending
    handback.run()
    assert events == [
        # each flow the stack tracks is held around its own write, then passed to its NAT entry
        f"create node1 {[POD_CLIENT]} held",
        "create node1 [] held",  # none refused: no second round
        "renew",  # the holds outlast the detach
        "detach node1",
        "renew",  # and the walk over the devices, however long
        "close holds",
        f"create node1 {[CLIENT]} None",  # the programs are gone: nothing to hold
        "remove pins",
    ]


def test_the_handback_removes_the_planner_the_ebpf_agent_left_with_the_pins(tmp_path: Path) -> None:
    """A later switch back to eBPF mode must not meet a planner of maps that are gone (its start
    would refuse it, as the maps' read-back differs: the file is removed with the pins it describes)."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    run = tmp_path / "run"
    run.mkdir()
    planner = Path(snapshot.snapshot_path(str(run), str(pins)))
    planner.write_bytes(b"a planner")
    other = Path(snapshot.snapshot_path(str(run), str(tmp_path / "other-pins")))  # another agent's
    other.write_bytes(b"another pin path's planner")
    records = Path(records_path(str(run), str(pins)))
    records.write_bytes(b"the model's records")
    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: [],
        create=lambda netns, flows, timeouts, hold: Created(),
        detach=detaching(),
        remove_pins=lambda pin_path: [],
        holds=lambda pin_path: FakeHolds([]),
        snapshot_dir=str(run),
    )
    handback.run()
    assert not planner.exists() and not records.exists()
    assert other.exists()


def test_flows_whose_write_was_refused_are_written_again_before_and_after_the_detach(tmp_path: Path) -> None:
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    events: list[tuple[str, list[Tuple]]] = []
    # under legacy host routing a packet the programs translated made the plain entry again between
    # its deletion and the write: refused (EEXIST), once for NODEPORT, twice for CLUSTERIP
    refusals = [[CLUSTERIP, NODEPORT], [CLUSTERIP], []]

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        got = list(flows)
        events.append(("create", [f.orig for f in got]))
        taken = refusals.pop(0)
        return Created(created=len(got) - len(taken), present=len(taken), taken=taken)

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: [CLUSTERIP, NODEPORT],
        create=create,
        detach=detaching("eth0", then=lambda netns: events.append(("detach", []))),
        remove_pins=lambda pin_path: [],
        holds=lambda pin_path: FakeHolds([]),
    )
    handback.run()
    assert events == [
        ("create", [CLUSTERIP.orig, NODEPORT.orig]),
        ("create", [CLUSTERIP.orig, NODEPORT.orig]),
        ("detach", []),
        ("create", [CLUSTERIP.orig]),
    ]


def test_a_flow_whose_write_failed_is_written_again_after_the_detach(tmp_path: Path) -> None:
    """A flow create_flows could not write (a netlink error other than EEXIST) is not counted as
    written: the round after the detach tries it again, as it does the refused ones."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    creates: list[list[Tuple]] = []
    rounds = [
        Created(created=1, failed=["NODEPORT: No buffer space available"], unwritten=[NODEPORT]),
        Created(),
        Created(created=1),
    ]

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        creates.append([f.orig for f in flows])
        return rounds.pop(0)

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: [CLUSTERIP, NODEPORT],
        create=create,
        detach=detaching("eth0"),
        remove_pins=lambda pin_path: [],
        holds=lambda pin_path: FakeHolds([]),
    )
    handback.run()
    assert creates == [[CLUSTERIP.orig, NODEPORT.orig], [], [NODEPORT.orig]]


class PinnedMap(FakeMap):
    """A FakeMap StackHolds can close, as it does the pinned maps it opened."""

    def close(self) -> None:
        pass


class RefusingPinnedMap(PinnedMap):
    """Refuses the first rewrite (BPF_EXIST) of `key`'s entry (EBUSY)."""

    refuse: bytes | None = None

    def update(self, key: Any, value: Any, flags: UpdateFlag = UpdateFlag.ANY) -> None:
        if flags == UpdateFlag.EXIST and bytes(key) == self.refuse:
            self.refuse = None
            raise MapError("ekp_ct_tcp", "update", errno.EBUSY)
        super().update(key, value, flags)


def pinned(flows: list[NatFlow], made_ns: int, table: PinnedMap | None = None) -> PinnedMap:
    """The pinned ekp_ct_tcp of an eBPF agent that made `flows` at `made_ns`."""
    table = PinnedMap(MAPS["ct_tcp"]) if table is None else table
    for flow in flows:
        for key, entry in ebpf_entries(flow, IDS, made_ns):
            table.update(key, entry)
    return table


def entries_of(table: PinnedMap, flow: NatFlow) -> list[tuple[abi.CtKey, abi.CtEntry]]:
    found = [(key, table.lookup(key)) for key in ct_keys(flow)]
    return [(k, e) for k, e in found if isinstance(e, abi.CtEntry)]


def stack_holds(table: PinnedMap, clock: list[int], act: PinnedMap | None = None) -> StackHolds:
    """StackHolds on `table` under legacy host routing (every unmasqueraded flow is the stack's);
    `act`: the pinned ekp_act (none: not stamped)."""
    return StackHolds(
        "/pins",
        clock_ns=lambda: clock[0],
        open_table=lambda pin_path, role: act if role == "act" else table,
        legacy=True,
    )


def test_a_flow_passed_to_its_nat_entry_is_passed_both_ways_however_old_it_is() -> None:
    """The data path reads the REPLY entry's created_s for a reply: a flow that began a minute ago
    (every established one) must have its window start at the pass there too."""
    clock = [NOW]
    table = pinned([CLUSTERIP], NOW - 60 * 10**9)
    holds = stack_holds(table, clock)
    holds.hold(CLUSTERIP)
    clock[0] += 10**9
    holds.release(CLUSTERIP)
    forward, reply = (table.lookup(key) for key in ct_keys(CLUSTERIP))
    assert isinstance(forward, abi.CtEntry) and isinstance(reply, abi.CtEntry)
    assert forward.flags & CtFlag.NFPASS and reply.flags & CtFlag.NFPASS
    assert still_held(forward, clock[0]) and still_held(reply, clock[0]), "the reply would be translated"
    assert (holds.held, holds.passed, holds.lapsed) == (1, 1, [])


def test_a_flow_held_or_passed_is_kept_seen_by_each_write() -> None:
    """The data path refreshes no last_seen_ns while a flag holds: each hold, pass and renewal
    does, on an entry holding a flag, and on one holding none (a held flow's REPLY entry sees no
    reply while its forward packets drop) once idle for more than half its state's timeout (60 s
    of a UDP stream's 120 s), so a quiet UDP flow does not expire in eBPF conntrack during a long
    hand-back; its created_s moves only with a flag (the data path reads it for more than the
    window)."""
    udp = dataclasses.replace(CLUSTERIP, proto=socket.IPPROTO_UDP)
    clock = [NOW]
    made = NOW - 100 * 10**9
    table = pinned([udp], made)
    act = PinnedMap(MAPS["act"])
    holds = stack_holds(table, clock, act)
    ends = {
        activity.slot(*end) for key, entry in entries_of(table, udp) for end in activity.endpoints(key, entry)
    }

    def stamps() -> set[int]:
        """The stamps of the flow's endpoints' ekp_act slots (bpf/ekp_act.h: each stamp of an
        entry stamps them too)."""
        return {v.stamp for i in ends if isinstance(v := act.lookup(ctypes.c_uint32(i)), abi.Act)}

    def entries() -> list[abi.CtEntry]:
        found = [table.lookup(key) for key in ct_keys(udp)]
        return [e for e in found if isinstance(e, abi.CtEntry)]

    def seen() -> list[int]:
        return [e.last_seen_ns for e in entries()]

    holds.hold(udp)
    assert seen() == [NOW, NOW] and stamps() == {activity.stamp_of(NOW)}  # REPLY idle 100 s
    assert entries()[1].created_s == made // 10**9  # the REPLY entry holds nothing
    clock[0] += HOLD_RENEW_NS
    holds.renew()
    assert seen() == [clock[0], NOW], "the REPLY entry, stamped 3 s ago, is left alone"
    while clock[0] - NOW <= 60 * 10**9:
        clock[0] += HOLD_RENEW_NS
        holds.renew()
    assert seen() == [clock[0]] * 2 and stamps() == {activity.stamp_of(clock[0])}
    clock[0] += 10**9
    holds.release(udp)
    assert seen() == [clock[0]] * 2 and stamps() == {activity.stamp_of(clock[0])}
    clock[0] += HOLD_RENEW_NS
    holds.renew()
    assert seen() == [clock[0]] * 2 and stamps() == {activity.stamp_of(clock[0])}
    assert holds.lapsed == []


def test_a_busy_entry_that_holds_nothing_is_not_written() -> None:
    """A held flow's REPLY entry the data path stamped within half its state's timeout (its
    replies still go through the programs; an established TCP flow's, 12 h) is left alone: each
    write may lose a change the data path made since the read (a FIN, its own stamp)."""
    clock = [NOW]
    table = pinned([CLUSTERIP], NOW - 60 * 10**9)
    reply_key = ct_keys(CLUSTERIP)[1]
    reply = table.lookup(reply_key)
    assert isinstance(reply, abi.CtEntry)
    reply.last_seen_ns = NOW - 3600 * 10**9  # a reply an hour ago
    table.update(reply_key, reply)
    holds = stack_holds(table, clock)
    holds.hold(CLUSTERIP)
    after = table.lookup(reply_key)
    assert isinstance(after, abi.CtEntry) and bytes(after) == bytes(reply)


def test_a_hold_clears_a_reply_pass_a_killed_hand_back_left() -> None:
    """An earlier hand-back killed (SIGKILL) after a pass leaves NFPASS on the REPLY entry, its
    window long over. The next hold must clear it, not start its window again: the flow's replies
    would pass untranslated with no NAT entry to take them."""
    clock = [NOW]
    table = pinned([CLUSTERIP], NOW - 3600 * 10**9)
    reply_key = ct_keys(CLUSTERIP)[1]
    stale = table.lookup(reply_key)
    assert isinstance(stale, abi.CtEntry)
    stale.flags |= CtFlag.NFPASS
    table.update(reply_key, stale)
    holds = stack_holds(table, clock)
    holds.hold(CLUSTERIP)
    flags = flow_flags({"ct_tcp": table}, CLUSTERIP)
    assert flags[CtDir.FORWARD] & CtFlag.HANDOVER
    assert not flags[CtDir.REPLY] & (CtFlag.NFPASS | CtFlag.HANDOVER)


class FakeCtnetlink:
    """nfct.NFCTSocket for create_flows: each message takes `step_ns` of `clock` and is preceded by
    `before()`; the adds of `refuse` are refused once (EEXIST: a packet made the plain entry again),
    and the deletion of `fail_delete`'s plain entry fails (EPERM)."""

    def __init__(
        self,
        clock: list[int],
        step_ns: int,
        before: Callable[[], None] = lambda: None,
        refuse: Collection[Tuple] = (),
        fail_delete: Tuple | None = None,
        present: Collection[NatFlow] = (),
    ) -> None:
        self.clock, self.step_ns, self.before = clock, step_ns, before
        self.refuse, self.fail_delete = set(refuse), fail_delete
        self.present = {f.orig: f for f in present}  # entries in place (found by their original tuple)
        self.added: list[Tuple] = []

    def __call__(self, nfgen_family: int) -> FakeCtnetlink:
        return self

    def __enter__(self) -> FakeCtnetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def entry(self, op: str, **attrs: Any) -> list[NatFlow] | None:
        self.before()
        self.clock[0] += self.step_ns
        if op in ("del", "get"):
            t = attrs["tuple_orig"]
            found = (t.saddr, t.daddr, t.sport, t.dport)
            if op == "get" and found in self.present:
                return [self.present[found]]  # nfct._flow stands aside (fake_ctnetlink)
            if found == self.fail_delete:
                raise NetlinkError(errno.EPERM)
            raise NetlinkError(errno.ENOENT)
        flow: NatFlow = attrs["flow"]
        if flow.orig in self.present:
            raise NetlinkError(errno.EEXIST)
        if flow.orig in self.refuse:
            self.refuse.discard(flow.orig)
            raise NetlinkError(errno.EEXIST)
        self.added.append(flow.orig)
        return None


def fake_ctnetlink(monkeypatch: pytest.MonkeyPatch, ctnl: FakeCtnetlink) -> None:
    monkeypatch.setattr(nfct, "NFCTSocket", ctnl)
    monkeypatch.setattr(nfct, "run_in_netns", lambda netns, fn: fn())
    monkeypatch.setattr(nfct, "_entry", lambda flow, timeouts: {"flow": flow})
    monkeypatch.setattr(nfct, "_flow", lambda msg: msg)


def test_a_flow_whose_nat_entry_a_killed_hand_back_wrote_is_passed_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hand-back killed (SIGKILL) after writing a flow's NAT entry leaves it there: the next
    one's write of the same entry is refused (EEXIST) twice, and the flow would stay held (its
    forward packets dropped) until the detach. The entry is the flow's own (same tuples, DST_NAT):
    written, so the flow is passed to it at once. A NAT entry to another backend is not."""
    flows = many_flows(2)
    ours = dataclasses.replace(flows[0], status=flows[0].status | IPS_DST_NAT)
    other = NatFlow(6, flows[1].orig, (REMOTE_BE, POD_CLIENT, 8080, flows[1].orig[2]), status=IPS_DST_NAT)
    clock = [NOW]
    table = pinned(flows, NOW)
    holds = stack_holds(table, clock)
    fake_ctnetlink(monkeypatch, FakeCtnetlink(clock, 10**6, present=[ours, other]))
    first = create_flows("node1", flows, Timeouts(), clear_first=stack_flow, hold=holds)
    assert (first.created, first.present, [f.orig for f in first.taken]) == (0, 2, [flows[1].orig])
    passed, held = (flow_flags({"ct_tcp": table}, f) for f in flows)
    assert passed[CtDir.FORWARD] & CtFlag.NFPASS and passed[CtDir.REPLY] & CtFlag.NFPASS
    assert held[CtDir.FORWARD] & CtFlag.HANDOVER and not held[CtDir.REPLY] & CtFlag.NFPASS
    assert (holds.held, holds.passed) == (2, 1)


def test_a_refused_flow_no_hold_took_costs_no_extra_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a flow held (the stack tracks it under its NAT entry's reply tuple) is worth the get
    that tells its own NAT entry from another's: the others lose nothing waiting for the round
    after the detach."""
    flows = many_flows(2)
    ops: list[str] = []

    class Counting(FakeCtnetlink):
        def entry(self, op: str, **attrs: Any) -> list[NatFlow] | None:
            ops.append(op)
            return super().entry(op, **attrs)

    class Unheld(FakeHolds):
        def hold(self, flow: NatFlow) -> bool:
            super().hold(flow)
            return flow == flows[0]

    present = [dataclasses.replace(f, status=f.status | IPS_DST_NAT) for f in flows]
    fake_ctnetlink(monkeypatch, Counting([NOW], 0, present=present))
    events: list[str] = []
    done = create_flows("node1", flows, Timeouts(), hold=Unheld(events))
    assert ops == ["add", "get", "add"]
    assert [f.orig for f in done.taken] == [flows[1].orig]
    assert events.count(f"release {flows[0].orig[0]}") == 1


def test_a_nat_entry_is_told_its_own_whichever_way_the_kernel_writes_its_ipv6_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flow = NatFlow(
        6, ("fd00:10:244::9", "fd00:10:96::a", 40000, 80), ("fd00:10:244::5", "fd00:10:244::9", 8080, 40000)
    )
    written = NatFlow(
        6,
        ("fd00:10:244:0:0:0:0:9", "fd00:10:96:0::a", 40000, 80),
        ("FD00:10:244::5", "fd00:10:244:0::9", 8080, 40000),
        status=IPS_DST_NAT,
    )

    class Ct:
        def entry(self, op: str, **attrs: Any) -> list[NatFlow]:
            return [written]

    monkeypatch.setattr(nfct, "_flow", lambda msg: msg)
    assert nfct._written_before(Ct(), flow)
    other = dataclasses.replace(written, reply=("fd00:10:244::6", "fd00:10:244::9", 8080, 40000))
    monkeypatch.setattr(Ct, "entry", lambda self, op, **attrs: [other])
    assert not nfct._written_before(Ct(), flow)


def test_every_hold_and_pass_outlasts_a_hand_back_longer_than_its_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One netlink message a second (thousands of flows, or a starved agent): two rounds of 30 s
    (each refusal read back) and 12 s, each longer than EKP_CT_HANDOVER_S. At every message and
    at the detach, every flow held or passed so far is still so in the data path's eyes (both
    entries), and none lapsed."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    flows = many_flows(12)
    clock = [NOW]
    table = pinned(flows, NOW - 60 * 10**9)
    holds = stack_holds(table, clock)
    lapses: list[str] = []

    def check() -> None:
        for flow in flows:
            for key in ct_keys(flow):
                entry = table.lookup(key)
                assert isinstance(entry, abi.CtEntry)
                if entry.flags & (CtFlag.NFPASS | CtFlag.HANDOVER) and not still_held(entry, clock[0]):
                    lapses.append(f"{flow.orig[2]}/{key.dir} at {(clock[0] - NOW) // 10**9} s")

    ctnl = FakeCtnetlink(clock, 10**9, check, refuse={f.orig for f in flows[::2]})
    fake_ctnetlink(monkeypatch, ctnl)
    detached: list[int] = []

    def detach(netns: str, devices: list[str], between: Callable[[], None]) -> None:
        check()
        detached.append(clock[0] - NOW)
        devices.append("eth0")

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: flows,
        detach=detach,
        remove_pins=lambda pin_path: [],
        holds=lambda pin_path: holds,
        delete=lambda netns, gone: pytest.fail("nothing to undo"),
    )
    handback.run()
    assert detached == [42 * 10**9]
    assert lapses == []
    assert (holds.held, holds.passed, holds.lapsed) == (12, 12, [])
    assert sorted(ctnl.added) == sorted(f.orig for f in flows)
    assert "run out before the detach" not in caplog.text


def test_a_hold_found_run_out_is_counted_renewed_and_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent starved for longer than the window between two renewals: the flows passed before
    are found run out (the programs translated them meanwhile), counted, named, and passed again."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    flows = many_flows(3)
    clock = [NOW]
    table = pinned(flows, NOW)
    holds = stack_holds(table, clock)
    fake_ctnetlink(monkeypatch, FakeCtnetlink(clock, (abi.CT_HANDOVER_S + 1) * 10**9))
    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: flows,
        detach=detaching("eth0"),
        remove_pins=lambda pin_path: [],
        holds=lambda pin_path: holds,
    )
    handback.run()
    assert [f.orig for f in holds.lapsed] == [f.orig for f in flows]
    assert "3 of the 3 flows the node's stack tracks were found with their hold or pass" in caplog.text
    for flow in flows:
        for key in ct_keys(flow):
            entry = table.lookup(key)
            assert isinstance(entry, abi.CtEntry) and still_held(entry, clock[0])


@pytest.mark.parametrize("where", ["delete", "map", "release", "detach", "detach-none", "interrupt"])
def test_a_hand_back_given_up_before_the_detach_gives_every_flow_back_to_the_programs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """Stopped partway (ctnetlink refuses a deletion, the map refuses a hold, the detach fails):
    the programs stay attached, so the flows passed so far must not be left to translate with their
    NAT entries in place once their window runs out: those entries are deleted and every flow held
    or passed gets both flags cleared (translated by the programs as before the hand-back)."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    flows = many_flows(4)
    clock = [NOW]
    refusing = RefusingPinnedMap(MAPS["ct_tcp"])
    table = pinned(flows, NOW, refusing)
    if where == "map":  # the hold of the third flow
        refusing.refuse = bytes(ct_keys(flows[2])[0])
    if where == "release":  # the pass of the second, its NAT entry written: the REPLY's write
        refusing.refuse = bytes(ct_keys(flows[1])[1])
    holds = stack_holds(table, clock)
    fake_ctnetlink(
        monkeypatch,
        FakeCtnetlink(clock, 10**6, fail_delete=stack_flow(flows[2]).orig if where == "delete" else None),
    )
    deleted: list[list[Tuple]] = []

    def delete(netns: str, gone: list[NatFlow]) -> int:
        # at its NAT entry's deletion a flow's replies must not pass (NFPASS) to the programs
        # untranslated, and its forward packets must drop (HANDOVER)
        for flow in gone:
            flags = flow_flags({"ct_tcp": table}, flow)
            assert not flags[CtDir.REPLY] & CtFlag.NFPASS, flow.describe()
            assert flags[CtDir.FORWARD] & CtFlag.HANDOVER, flow.describe()
        deleted.append([f.orig for f in gone])
        return len(gone)

    def detach(netns: str, devices: list[str], between: Callable[[], None]) -> None:
        if where == "detach":
            raise OSError(errno.EPERM, "Operation not permitted")
        if where == "interrupt":
            raise KeyboardInterrupt
        if where == "detach-none":  # every device refused: none was detached
            raise attach.DetachFailed(errno.EPERM, [], ["eth0: (1, 'Operation not permitted')"])
        pytest.fail("given up before the detach")

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: flows,
        detach=detach,
        remove_pins=lambda pin_path: pytest.fail("the programs stay: so do their pins"),
        holds=lambda pin_path: holds,
        delete=delete,
    )
    if where == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            handback.run()
    else:
        handback.run()
    passed = {"detach": flows, "detach-none": flows, "interrupt": flows}.get(where, flows[:2])
    # flow by flow, passed ones first; a held one's NAT entry too (a hold refused by the map may
    # have landed on FORWARD: registered all the same)
    undone = {"map": flows[:3], "delete": flows[:3]}.get(where, passed)
    assert deleted == [[f.orig] for f in undone]
    for flow in flows:
        assert not any(
            f & (CtFlag.NFPASS | CtFlag.HANDOVER) for f in flow_flags({"ct_tcp": table}, flow).values()
        )
    assert f"are given back to the eBPF programs, the NAT entries of the {len(passed)} passed" in caplog.text
    if where == "detach-none":  # its own error, not the generic one (no CAP_BPF is not why)
        assert "could not detach the programs from any device (eth0: (1" in caplog.text
        assert "CAP_BPF" not in caplog.text
    elif where != "interrupt":
        assert "its programs stay attached" in caplog.text


def test_an_undo_slower_than_the_window_keeps_every_flow_waiting_its_turn_held() -> None:
    """The undo deletes flow by flow, each deletion its own netlink round trip (a thread and a
    setns under --netns): on a starved agent a second each. The flows still waiting their turn
    keep their NAT entries, so they must stay held or passed in the data path's eyes until their
    own turn: renewed at the start (the clock ran on since the last renewal) and as it goes."""
    flows = many_flows(20)
    clock = [NOW]
    table = pinned(flows, NOW - 60 * 10**9)
    holds = stack_holds(table, clock)
    for flow in flows:
        holds.renew()
        holds.hold(flow)
        holds.release(flow)
    clock[0] += HOLD_RENEW_NS - 1 + 2 * 10**9  # no renewal since, and the step that failed took 2 s
    lapses: list[str] = []

    def delete(gone: list[NatFlow]) -> int:
        for flow in flows[flows.index(gone[0]) + 1 :]:
            for key in ct_keys(flow):
                entry = table.lookup(key)
                assert isinstance(entry, abi.CtEntry)
                if not still_held(entry, clock[0]):
                    lapses.append(f"{flow.orig[2]}/{key.dir} at {(clock[0] - NOW) // 10**9} s")
        clock[0] += 10**9
        return 1

    undone = holds.undo(delete)
    assert lapses == []
    assert (undone.undone, undone.deleted, undone.failed, undone.lapsed) == (20, 20, [], 0)
    for flow in flows:
        assert not any(
            f & (CtFlag.NFPASS | CtFlag.HANDOVER) for f in flow_flags({"ct_tcp": table}, flow).values()
        )


def test_a_flow_whose_hold_ran_out_during_its_own_deletion_is_counted() -> None:
    """A deletion slower than the window (a starved agent): the programs translated the flow with
    its NAT entry still in place meanwhile, which the undo counts as it does a lapse found at the
    start."""
    flows = many_flows(2)
    clock = [NOW]
    table = pinned(flows, NOW - 60 * 10**9)
    holds = stack_holds(table, clock)
    for flow in flows:
        holds.hold(flow)
        holds.release(flow)

    def delete(gone: list[NatFlow]) -> int:
        if gone[0] == flows[0]:
            clock[0] += (abi.CT_HANDOVER_S + 1) * 10**9
        return 1

    undone = holds.undo(delete)
    # the second's too, waiting its turn with no renewal through the 11 s deletion
    assert (undone.undone, undone.lapsed) == (2, 2)
    assert holds.lapsed == flows


def test_flows_found_run_out_when_the_undo_starts_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent starved past the window before its undo: the programs translated the passed flows
    with their NAT entries in place meanwhile (strangers, resets): counted in the undo's line."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    flows = many_flows(3)
    clock = [NOW]
    table = pinned(flows, NOW)
    holds = stack_holds(table, clock)
    fake_ctnetlink(monkeypatch, FakeCtnetlink(clock, 10**6))

    def detach(netns: str, devices: list[str], between: Callable[[], None]) -> None:
        clock[0] += (abi.CT_HANDOVER_S + 1) * 10**9
        raise OSError(errno.EPERM, "Operation not permitted")

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: flows,
        detach=detach,
        remove_pins=lambda pin_path: pytest.fail("the programs stay: so do their pins"),
        holds=lambda pin_path: holds,
        delete=lambda netns, gone: len(gone),
    )
    handback.run()
    assert (
        "NAT entries of the 3 passed to them deleted (3 found); 3 found with their window run out"
        in caplog.text
    )


@pytest.mark.parametrize("error", ["netlink", "parse"])
def test_a_deletion_failing_mid_undo_leaves_the_later_flows_undone_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: str
) -> None:
    """One NAT entry's deletion refused (ENOBUFS), or its answer unreadable (any exception), must
    not leave the flows after it with their NAT entries while the programs translate them (TCP's
    lasts a day): every deletion is tried, and the error counts and names the ones that failed."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    flows = many_flows(5)
    clock = [NOW]
    table = pinned(flows, NOW)
    holds = stack_holds(table, clock)
    fake_ctnetlink(monkeypatch, FakeCtnetlink(clock, 10**6))
    asked: list[Tuple] = []

    def delete(netns: str, gone: list[NatFlow]) -> int:
        asked.extend(f.orig for f in gone)
        if gone[0] == flows[1]:
            if error == "parse":
                raise ValueError("a reply pyroute2 cannot parse")
            raise NetlinkError(errno.ENOBUFS, "No buffer space available")
        return len(gone)

    def detach(netns: str, devices: list[str], between: Callable[[], None]) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: flows,
        detach=detach,
        remove_pins=lambda pin_path: pytest.fail("the programs stay: so do their pins"),
        holds=lambda pin_path: holds,
        delete=delete,
    )
    handback.run()
    assert asked == [f.orig for f in flows]
    for flow in flows:
        assert not any(
            f & (CtFlag.NFPASS | CtFlag.HANDOVER) for f in flow_flags({"ct_tcp": table}, flow).values()
        )
    assert "but the NAT entries of 1 could not be deleted" in caplog.text
    why = "(105, 'No buffer space available')"
    if error == "parse":
        why = "ValueError('a reply pyroute2 cannot parse')"
    assert f"4 deleted; first: {flows[1].describe()}: {why}" in caplog.text


def test_a_detach_that_fails_after_detaching_some_devices_keeps_the_nat_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The programs detached from eth0 but not from lxc-a: eth0's flows meet the rules from now
    on and need their NAT entries, so no undo: the entries stay, the flows stay passed, and the
    log names the devices still running the programs."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    flows = many_flows(3)
    clock = [NOW]
    table = pinned(flows, NOW)
    holds = stack_holds(table, clock)
    fake_ctnetlink(monkeypatch, FakeCtnetlink(clock, 10**6))

    def detach(netns: str, devices: list[str], between: Callable[[], None]) -> None:
        devices.append("eth0")
        raise attach.DetachFailed(errno.EBUSY, ["eth0"], ["lxc-a: (16, 'Device or resource busy')"])

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: flows,
        detach=detach,
        remove_pins=lambda pin_path: pytest.fail("the programs stay on lxc-a: so do their pins"),
        holds=lambda pin_path: holds,
        delete=lambda netns, gone: pytest.fail("eth0's flows need their NAT entries"),
    )
    assert handback.run() is False, "tried again at the next sync"
    for flow in flows:
        flags = flow_flags({"ct_tcp": table}, flow)
        assert flags[CtDir.FORWARD] & CtFlag.NFPASS and flags[CtDir.REPLY] & CtFlag.NFPASS
    assert "detached the programs from eth0 but not from all devices (lxc-a: (16" in caplog.text
    assert "given back to the eBPF programs" not in caplog.text
    assert "CAP_BPF" not in caplog.text


@pytest.mark.parametrize("stop", ["oserror", "parse", "interrupt"])
def test_a_detach_stopped_by_anything_after_one_device_keeps_the_nat_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stop: str
) -> None:
    """What decides the undo is whether a program of ours left a device, not the exception: an
    OSError from rtnetlink, a reply pyroute2 cannot parse, a KeyboardInterrupt, after eth0 lost
    its programs, must not delete the NAT entries eth0's flows now need."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    flows = many_flows(3)
    clock = [NOW]
    table = pinned(flows, NOW)
    holds = stack_holds(table, clock)
    fake_ctnetlink(monkeypatch, FakeCtnetlink(clock, 10**6))
    raised: BaseException = {
        "oserror": OSError(errno.EIO, "Input/output error"),
        "parse": ValueError("a reply pyroute2 cannot parse"),
        "interrupt": KeyboardInterrupt(),
    }[stop]

    def detach(netns: str, devices: list[str], between: Callable[[], None]) -> None:
        devices.append("eth0")
        raise raised

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: flows,
        detach=detach,
        remove_pins=lambda pin_path: pytest.fail("the programs stay elsewhere: so do their pins"),
        holds=lambda pin_path: holds,
        delete=lambda netns, gone: pytest.fail("eth0's flows need their NAT entries"),
    )
    if stop == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            handback.run()
    else:
        assert handback.run() is False
    for flow in flows:
        flags = flow_flags({"ct_tcp": table}, flow)
        assert flags[CtDir.FORWARD] & CtFlag.NFPASS and flags[CtDir.REPLY] & CtFlag.NFPASS
    assert "detached the programs from eth0 but not from all devices" in caplog.text


def detaching_in_steps(
    outcomes: list[list[str]], note: Callable[[], None]
) -> Callable[[str, list[str], Callable[[], None]], None]:
    """A detach that takes off, call by call, the devices `outcomes` names (calling `note` first),
    and fails with EBUSY on lxc-a while outcomes are left: a partial detach, then the retry's rest."""

    def detach(netns: str, detached: list[str], between: Callable[[], None]) -> None:
        note()
        devices = outcomes.pop(0)
        detached.extend(devices)
        if outcomes:
            raise attach.DetachFailed(errno.EBUSY, devices, ["lxc-a: (16, 'Device or resource busy')"])

    return detach


def test_a_pending_hand_back_puts_back_a_kept_tcp_be_liberal_only_once_every_device_is_detached(
    tmp_path: Path,
) -> None:
    """An eBPF agent killed mid-takeover kept the node's own 0 and left 1, and its programs may be
    on devices: iptables mode's start leaves 1 (app.run), and the hand-back sets 0 only once its
    programs left every device (a flow they translate one way only meets no window check until
    then): not at a partial detach, at the retry that detaches the rest."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    kept = Path(liberal_path(str(tmp_path), INODE))
    kept.write_text("0\n")
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="1")
    seen: list[str | None] = []
    detach = detaching_in_steps([["eth0"], ["lxc-a"]], lambda: seen.append(sysctl.values[LIBERAL]))

    clock = [1000.0]
    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=30),
        read=lambda pin_path: [],
        create=lambda netns, flows, timeouts, hold: Created(),
        detach=detach,
        remove_pins=lambda pin_path: [],
        holds=lambda pin_path: FakeHolds([]),
        snapshot_dir=str(tmp_path),
        clock=lambda: clock[0],
        put_back_liberal=lambda config, directory: put_back_liberal(
            config, directory, read_sysctl=sysctl.read, write_sysctl=sysctl, inode=lambda netns: INODE
        ),
    )
    assert handback.run() is False  # eth0 detached, lxc-a not
    assert sysctl.values[LIBERAL] == "1" and kept.exists()
    clock[0] += 30
    assert handback.run() is True
    assert seen == ["1", "1"]
    assert sysctl.values[LIBERAL] == "0" and not kept.exists()


def test_a_hand_back_with_nothing_pinned_puts_back_a_kept_tcp_be_liberal(tmp_path: Path) -> None:
    """No pins (an `agent --cleanup` that could not write the sysctl, say): no program of ours is
    left either, so the first hand-back call puts the kept value back."""
    kept = Path(liberal_path(str(tmp_path), INODE))
    kept.write_text("0\n")
    sysctl = Sysctl(net__netfilter__nf_conntrack_tcp_be_liberal="1")
    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(tmp_path / "pins")),
        snapshot_dir=str(tmp_path),
        put_back_liberal=lambda config, directory: put_back_liberal(
            config, directory, read_sysctl=sysctl.read, write_sysctl=sysctl, inode=lambda netns: INODE
        ),
    )
    assert not handback.pending
    assert handback.run() is True
    assert sysctl.values[LIBERAL] == "0" and not kept.exists()


def test_a_partial_detach_writes_the_late_flows_and_is_tried_again_without_an_undo(tmp_path: Path) -> None:
    """After a partial detach the flows the programs started since, and those refused, go to
    their NAT entries (the detached devices' flows meet the rules); the pins stay and the next
    run tries again, where a detach that fails once more on the devices left (none of ours left
    a device this time) still undoes nothing: the first run's detached devices need the
    entries. A later run that detaches the rest finishes the hand-back."""
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    events: list[str] = []
    holds = FakeHolds(events)
    refusals = [[NODEPORT], [NODEPORT], [], [], [], [], [], [], []]

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        got = list(flows)
        events.append(f"create {[f.orig[0] for f in got]} {'held' if hold is holds else hold}")
        taken = refusals.pop(0)
        return Created(created=len(got) - len(taken), present=len(taken), taken=taken)

    detach = detaching_in_steps([["eth0"], [], ["lxc-a"]], lambda: events.append("detach"))

    clock = [1000.0]
    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=30),
        read=lambda pin_path: [CLUSTERIP, NODEPORT],
        create=create,
        detach=detach,
        remove_pins=lambda pin_path: events.append("remove pins") or [],  # type: ignore[func-returns-value]
        holds=lambda pin_path: holds,
        delete=lambda netns, gone: pytest.fail("eth0's flows need their NAT entries"),
        clock=lambda: clock[0],
    )
    assert handback.run() is False
    assert events == [
        f"create {[POD_CLIENT, CLIENT]} held",
        f"create {[CLIENT]} held",
        "renew",
        "detach",
        f"create {[CLIENT]} None",  # refused twice: written after the (partial) detach
        "close holds",
    ]
    events.clear()
    clock[0] += 30
    assert handback.run() is False
    assert "undo" not in events and "remove pins" not in events
    events.clear()
    clock[0] += 60
    assert handback.run() is True
    assert events[-3:] == ["close holds", "create [] None", "remove pins"]


def partial_pins(tmp_path: Path) -> Path:
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_tcp"].name).touch()
    return pins


def eth0_then_none(netns: str, detached: list[str], between: Callable[[], None]) -> None:
    """A detach that leaves eth0 on its first call and nothing more after, lxc-a busy throughout."""
    if "eth0" not in detached:
        detached.append("eth0")
    raise attach.DetachFailed(errno.EBUSY, list(detached), ["lxc-a: (16, 'Device or resource busy')"])


def test_a_retry_that_fails_before_its_detach_keeps_the_nat_entries_and_is_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a partial detach, a retry whose write fails (ENOBUFS) before it reaches the detach
    undoes nothing (eth0's flows need their NAT entries), raises nothing out of the sync, and
    writes what it can for the detached devices."""
    pins = partial_pins(tmp_path)
    creates: list[Created | BaseException] = [
        Created(),
        Created(),
        Created(),
        OSError(errno.ENOBUFS, "No buffer space available"),
        Created(),
    ]
    late: list[list[Tuple]] = []
    reads = [[CLUSTERIP], [CLUSTERIP]]  # then NODEPORT starts

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        got = [f.orig for f in flows]
        c = creates.pop(0)
        if isinstance(c, BaseException):
            raise c
        if hold is None:
            late.append(got)
        return c

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=0),
        read=lambda pin_path: reads.pop(0) if reads else [CLUSTERIP, NODEPORT],
        create=create,
        detach=eth0_then_none,
        remove_pins=lambda pin_path: pytest.fail("the programs stay on lxc-a: so do their pins"),
        holds=lambda pin_path: FakeHolds([]),
        delete=lambda netns, gone: pytest.fail("eth0's flows need their NAT entries"),
    )
    assert handback.run() is False
    caplog.clear()
    assert handback.run() is False
    assert late == [[], [NODEPORT.orig]], "the second run's late round: the flow its failed write left"
    assert "detached the programs from eth0 but not from all devices" in caplog.text
    assert "No buffer space available" in caplog.text


def test_an_agent_restarted_after_a_partial_detach_undoes_nothing_and_tries_again(
    tmp_path: Path, lock_dir: Path
) -> None:
    """The devices a killed or restarted agent detached are not in the new agent's memory: the
    marker in the lock directory says the detach began, so the new agent's detach that leaves no
    device more deletes no NAT entry (eth0's flows need theirs) and the hand-back stays pending.
    The marker goes with the pins."""
    pins = partial_pins(tmp_path)
    outcomes = [["eth0"], [], ["lxc-a"]]

    def detach(netns: str, detached: list[str], between: Callable[[], None]) -> None:
        detached.extend(outcomes.pop(0))
        if outcomes:
            raise attach.DetachFailed(errno.EBUSY, list(detached), ["lxc-a: (16, 'Device or resource busy')"])

    removed: list[str] = []

    def agent() -> EbpfHandback:
        return EbpfHandback(
            Config(netns="node1", pin_path=str(pins), sync_period_s=0),
            read=lambda pin_path: [CLUSTERIP],
            create=lambda netns, flows, timeouts, hold: Created(created=len(list(flows))),
            detach=detach,
            remove_pins=lambda pin_path: removed.append(pin_path) or [],  # type: ignore[func-returns-value]
            holds=lambda pin_path: FakeHolds([]),
            delete=lambda netns, gone: pytest.fail("eth0's flows need their NAT entries"),
        )

    assert agent().run() is False
    restarted = agent()
    assert restarted.run() is False, "tried again: the programs are still on lxc-a"
    marker = Path(out_of_ebpf.marker_path(str(lock_dir), str(pins)))
    assert "eth0" in marker.read_text().splitlines()
    assert restarted.run() is True
    assert removed == [str(pins)] and not marker.exists()


def test_a_marker_about_other_pins_is_removed_and_an_undo_goes_on(tmp_path: Path, lock_dir: Path) -> None:
    """A marker left for pins that were removed since (agent --cleanup) and made again by a later
    eBPF-mode agent says nothing about these: a detach that leaves no device undoes the rest."""
    pins = partial_pins(tmp_path)
    marker = Path(out_of_ebpf.marker_path(str(lock_dir), str(pins)))
    lock_dir.mkdir()
    marker.write_text("pins 1\neth0\n")
    events: list[str] = []
    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: [CLUSTERIP],
        create=lambda netns, flows, timeouts, hold: Created(created=len(list(flows))),
        detach=lambda netns, detached, between: (_ for _ in ()).throw(
            attach.DetachFailed(errno.EPERM, [], ["eth0: (1, 'Operation not permitted')"])
        ),
        remove_pins=lambda pin_path: pytest.fail("the programs stay: so do their pins"),
        holds=lambda pin_path: FakeHolds(events),
        delete=lambda netns, gone: len(gone),
    )
    assert handback.run() is True
    assert "undo" in events and not marker.exists()


def test_retries_write_only_the_flows_not_written_pass_the_others_again_and_back_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A retry after a partial detach writes no NAT entry an earlier run wrote (written again, a
    flow that closed meanwhile would come back established for a day; each costs round trips in
    the sync): it holds and passes those again (map writes), writes the rest, and the tries wait
    one sync period, doubled each time up to RETRY_MAX_S, saying so once a try."""
    pins = partial_pins(tmp_path)
    events: list[str] = []
    holds = FakeHolds(events)
    reads = [[CLUSTERIP], [CLUSTERIP, NODEPORT]]

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        got = list(flows)
        events.append(f"create {[f.orig[0] for f in got]} {'held' if hold is holds else hold}")
        return Created(created=len(got))

    clock = [1000.0]
    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=30),
        read=lambda pin_path: reads[0] if len(reads) == 1 else reads.pop(0),
        create=create,
        detach=eth0_then_none,
        remove_pins=lambda pin_path: pytest.fail("the programs stay on lxc-a: so do their pins"),
        holds=lambda pin_path: holds,
        clock=lambda: clock[0],
    )
    assert handback.run() is False
    events.clear()
    caplog.clear()
    waits = []
    for _ in range(7):
        at = clock[0]
        while not events:
            clock[0] += 1
            assert handback.run() is False
        waits.append(clock[0] - at)
        if len(waits) == 1:
            # both written: CLUSTERIP before the partial detach, NODEPORT (started since) after
            assert events == [
                "renew",
                f"hold {POD_CLIENT}",
                f"release {POD_CLIENT}",
                "renew",
                f"hold {CLIENT}",
                f"release {CLIENT}",
                "create [] held",
                "create [] held",
                "renew",
                "create [] None",
                "close holds",
            ]
        events.clear()
    assert waits == [30, 60, 120, 240, 300, 300, 300]
    assert caplog.text.count("but not from all devices") == 7


@pytest.mark.parametrize("stage", ["late", "pins"])
def test_a_failure_after_a_full_detach_says_so_and_is_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, stage: str
) -> None:
    """The programs left every device, then the late round or the pins' removal failed: nothing
    says they stay attached (nor asks for CAP_BPF), and the next try (which detaches nothing more)
    finishes the hand-back, its pins removed."""
    pins = partial_pins(tmp_path)
    fails = {"late": [False, False, True], "pins": [False, False, False]}[stage]
    removals: list[str] = []

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        if fails and fails.pop(0):
            raise NetlinkError(errno.ENOBUFS, "No buffer space available")
        return Created(created=len(list(flows)))

    def remove_pins(pin_path: str) -> list[str]:
        removals.append(pin_path)
        if stage == "pins" and len(removals) == 1:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return []

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=0),
        read=lambda pin_path: [CLUSTERIP],
        create=create,
        detach=detaching("eth0"),
        remove_pins=remove_pins,
        holds=lambda pin_path: FakeHolds([]),
        delete=lambda netns, gone: pytest.fail("every device is detached: the flows need their NAT entries"),
    )
    assert handback.run() is False
    assert "CAP_BPF" not in caplog.text and "stay attached" not in caplog.text
    what = {"late": "writing the flows the programs started", "pins": "removing the pins"}[stage]
    assert f"stopped {what}" in caplog.text and "after the programs left eth0" in caplog.text
    assert handback.run() is True
    assert removals[-1] == str(pins)


def test_a_renewal_the_map_refuses_between_two_devices_does_not_stop_the_detach(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pins = partial_pins(tmp_path)

    walked: list[str] = []

    class Refusing(FakeHolds):
        def renew(self) -> None:
            if walked:  # the one before the detach goes through
                raise MapError("ekp_ct_tcp", "update", errno.ENOMEM)

    def detach(netns: str, detached: list[str], between: Callable[[], None]) -> None:
        for device in ("eth0", "lxc-a", "lxc-b"):
            if walked:
                between()
            walked.append(device)
            detached.append(device)

    holds = Refusing([])
    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins)),
        read=lambda pin_path: [],
        create=lambda netns, flows, timeouts, hold: Created(),
        detach=detach,
        remove_pins=lambda pin_path: [],
        holds=lambda pin_path: holds,
    )
    assert handback.run() is True
    assert walked == ["eth0", "lxc-a", "lxc-b"]
    assert caplog.text.count("cannot renew the handed-back flows' holds between two devices") == 1


class Hooks:
    """A namespace's devices and which of our programs each runs ("xdp", "ingress", "egress"), for
    detach_all: the tc detach removes ingress then egress, raising at `fail[(device, hook)]`."""

    def __init__(
        self,
        devices: dict[str, list[str]],
        fail: Mapping[tuple[str, str], BaseException],
        lost: Mapping[tuple[str, str], BaseException] | None = None,  # raised once the hook is removed
    ) -> None:
        self.names = list(devices)
        self.hooks = {i: list(h) for i, h in enumerate(devices.values())}
        self.fail = fail
        self.lost = lost or {}
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        links = [dataclasses.make_dataclass("L", ["index", "name"])(i, n) for i, n in enumerate(self.names)]

        class Route:
            def __enter__(self) -> object:
                return self

            def __exit__(self, *exc: object) -> None:
                return None

        monkeypatch.setattr(attach, "netns_route", lambda netns: Route())
        monkeypatch.setattr(attach, "list_links", lambda ipr: links)
        monkeypatch.setattr(xdp, "detach", lambda ipr, index: self._remove(index, ["xdp"]))
        monkeypatch.setattr(xdp, "xdp_state", lambda ipr, index: "xdp" in self.hooks[index])
        monkeypatch.setattr(xdp, "is_ours", lambda state: state)
        monkeypatch.setattr(attach, "detach", lambda ipr, index: self._remove(index, ["ingress", "egress"]))
        monkeypatch.setattr(attach, "_ours", lambda ipr, index: len(set(self.hooks[index]) - {"xdp"}))

    def _remove(self, index: int, hooks: list[str]) -> bool:
        found = False
        for hook in hooks:
            if hook in self.hooks[index]:
                self.calls.append(f"{self.names[index]} {hook}")
                if (self.names[index], hook) in self.fail:
                    raise self.fail[self.names[index], hook]
                self.hooks[index].remove(hook)
                found = True
                if (self.names[index], hook) in self.lost:
                    raise self.lost[self.names[index], hook]
        return found


def test_detach_all_goes_on_past_a_device_that_refuses_and_says_which(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hooks = Hooks(
        {"eth0": ["ingress"], "lxc-a": ["ingress"], "lxc-b": ["ingress"]},
        {("lxc-a", "ingress"): NetlinkError(errno.EBUSY, "Device or resource busy")},
    )
    hooks.install(monkeypatch)
    with pytest.raises(attach.DetachFailed) as failed:
        attach.detach_all("node1")
    assert (failed.value.code, failed.value.detached) == (errno.EBUSY, ["eth0", "lxc-b"])
    assert [f.split(":")[0] for f in failed.value.failed] == ["lxc-a"]


def test_detach_all_counts_a_half_detached_device_as_detached_whatever_stopped_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device that lost one of our programs no longer has them see all of its flows' packets:
    detached, for the hand-back's undo decision, whether XDP went and the tc detach failed, or
    ingress went and egress failed; any exception (a reply pyroute2 cannot parse) fails one device
    and the others go on; and the caller's list holds each device as soon as it is detached, so a
    KeyboardInterrupt partway leaves it true. `between` runs before each device."""
    hooks = Hooks(
        {
            "eth0": ["xdp", "ingress"],
            "lxc-a": ["ingress", "egress"],
            "lxc-b": ["ingress"],
            "lxc-c": ["ingress"],
            "lxc-d": ["ingress"],
        },
        {
            ("eth0", "ingress"): NetlinkError(errno.EBUSY, "Device or resource busy"),
            ("lxc-a", "egress"): ValueError("a reply pyroute2 cannot parse"),
            ("lxc-b", "ingress"): OSError(errno.EIO, "Input/output error"),
        },
    )
    hooks.install(monkeypatch)
    detached: list[str] = []
    between: list[int] = []
    with pytest.raises(attach.DetachFailed) as failed:
        attach.detach_all("node1", detached, between=lambda: between.append(len(hooks.calls)))
    assert failed.value.detached == detached == ["eth0", "lxc-a", "lxc-c", "lxc-d"]
    assert [f.split(":")[0] for f in failed.value.failed] == ["eth0", "lxc-a", "lxc-b"]
    assert failed.value.code == errno.EBUSY
    assert between == [0, 2, 4, 5, 6]

    stopping = Hooks({"eth0": ["ingress"], "lxc-a": ["ingress"]}, {("lxc-a", "ingress"): KeyboardInterrupt()})
    stopping.install(monkeypatch)
    detached = []
    with pytest.raises(KeyboardInterrupt):
        attach.detach_all("node1", detached)
    assert detached == ["eth0"]


def test_detach_all_counts_a_device_half_detached_when_its_answer_was_lost_or_it_went(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ENOENT/ENODEV after ingress went (the egress filter or the device gone meanwhile) is no
    failure, but the device lost one of our programs: detached. An XDP detach whose answer was
    lost (any exception) is told by reading the device's XDP state again: gone, detached; still
    there, not."""
    enoent = NetlinkError(errno.ENOENT, "No such file or directory")
    hooks = Hooks(
        {
            "eth0": ["ingress", "egress"],
            "eth1": ["xdp", "ingress"],
            "eth2": ["xdp", "ingress"],
        },
        {
            ("eth0", "egress"): enoent,
            ("eth2", "xdp"): OSError(errno.EIO, "Input/output error"),
            ("eth1", "ingress"): NetlinkError(errno.EBUSY, "Device or resource busy"),
        },
        lost={("eth1", "xdp"): ValueError("a reply pyroute2 cannot parse")},
    )
    hooks.install(monkeypatch)
    detached: list[str] = []
    with pytest.raises(attach.DetachFailed) as failed:
        attach.detach_all("node1", detached)
    assert detached == ["eth0", "eth1"]
    assert [f.split(":")[0] for f in failed.value.failed] == ["eth1", "eth2"]


def test_no_handback_without_an_ebpf_conntrack(tmp_path: Path) -> None:
    handback = EbpfHandback(
        Config(pin_path=str(tmp_path / "none")),
        read=lambda pin_path: pytest.fail("nothing to read"),
        create=lambda netns, flows, timeouts, hold: pytest.fail("nothing to write"),
    )
    assert not handback.pending
    handback.run()


# ---- kernel --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dp() -> Iterator[Datapath]:
    require_kernel()
    with loaded_datapath(SIZES) as datapath:
        yield datapath


def leaving(dp: Datapath, verdict: int, frame: bytes) -> tuple[str, int, str, int]:
    """(source, port, destination, port) of a packet an ingress program passed on, as it leaves
    the node: under legacy host routing a packet handed to the stack (TC_ACT_OK) gets its source at
    egress from ekp_hostnat_v2 (bpf/ekp_host.h; the tag itself cannot be set by BPF_PROG_TEST_RUN)."""
    p = parse(frame)
    src, sport = p.src, p.sport
    if verdict == TC_ACT_OK:
        for k, v in dp.maps["hostnat"].items():
            assert isinstance(k, abi.HostNatKey) and isinstance(v, abi.HostNat)
            if (k.saddr, k.daddr, k.sport, k.dport) == (
                ip_be(p.src),
                ip_be(p.dst),
                port_be(p.sport),
                port_be(p.dport),
            ):
                src, sport = abi.ip_str(v.saddr), abi.port_host(v.sport)
    return src, sport, p.dst, p.dport


def clusterip_and_nodeport(dp: Datapath, lab: Lab) -> Net:
    """The frontends of CLUSTERIP (a local backend) and NODEPORT (a remote one, masqueraded) in the
    packet lab, with the ids IDS gives their flows."""
    net = Net(dp, lab)
    net.add_service(backends=((21, BE1, 8080, BackendFlag.LOCAL),), svc_id=3)
    net.add_service(
        NODE,
        30080,
        ((22, REMOTE_BE, 8080, 0),),
        scope=Scope.EXTERNAL,
        flags=FrontendFlag.NODEPORT | FrontendFlag.SNAT_ALL,
        set_id=2,
        svc_id=4,
        rev_nat_id=2,
    )
    return net


@pytest.mark.kernel
@pytest.mark.parametrize("routing", list(HostRouting))
def test_flows_carried_from_nf_conntrack_go_on_through_the_programs(
    dp: Datapath, routing: HostRouting
) -> None:
    """Carried flows are stamped for the flow-activity check (activity.arm) and go on through
    either host routing: under legacy, their packets are handed to the stack and their replies,
    which only the stamps let past the check, get their frontend back at egress."""
    with packet_lab() as lab:
        reset_maps(dp)
        if routing is HostRouting.LEGACY:
            set_config(dp, flags=abi.ConfigFlag.HOST_LEGACY)
        net = clusterip_and_nodeport(dp, lab)
        mid_flow = tcp(POD_CLIENT, VIP, 40000, 80, flags="PA")
        net.from_pod(mid_flow)
        assert net.stats()[Stat.DROP_NO_FLOW] == 1  # before: a flow the programs never saw
        takeover = KernelTakeover(
            Config(bpf_host_routing=routing),
            dump=lambda netns: [CLUSTERIP, NODEPORT],
            addresses=lambda netns: (),
            remove_rules=lambda c: None,
            sysctl=lambda netns, path, value: None,
            read_sysctl=lambda netns, path: None,
            replace=FakeReplace([]),
        )
        takeover.before_attach(dp.maps)
        activity.arm(dp.maps)  # as the proxier does once its programs serve: the carried flows stamped
        assert takeover.carried == 2
        if routing is HostRouting.LEGACY:
            # Still netfilter's (NFPASS) until after_attach replaced their NAT entries, which translate
            # them meanwhile: both directions pass untranslated.
            passed = net.stats()[Stat.PASS]
            for verdict, frame in [
                net.from_pod(mid_flow),
                net.from_pod(tcp(BE1, POD_CLIENT, 8080, 40000, flags="PA")),
                net.from_net(tcp(CLIENT, NODE, 5555, 30080, flags="PA", smac=MAC[CLIENT])),
                net.from_net(tcp(REMOTE_BE, NODE, 8080, 61000, flags="PA", smac=MAC[NODE2])),
            ]:
                p = parse(frame)
                assert verdict == TC_ACT_OK and (p.src, p.sport, p.dst, p.dport) in [
                    (POD_CLIENT, 40000, VIP, 80),
                    (BE1, 8080, POD_CLIENT, 40000),
                    (CLIENT, 5555, NODE, 30080),
                    (REMOTE_BE, 8080, NODE, 61000),
                ]
            assert net.stats()[Stat.PASS] - passed == 4 and net.stats()[Stat.CT_FORWARD] == 0
        takeover.after_attach(dp.maps)
        assert leaving(dp, *net.from_pod(mid_flow))[2:] == (BE1, 8080)
        back = leaving(dp, *net.from_pod(tcp(BE1, POD_CLIENT, 8080, 40000, flags="PA")))
        assert back == (VIP, 80, POD_CLIENT, 40000)
        out = leaving(dp, *net.from_net(tcp(CLIENT, NODE, 5555, 30080, flags="PA", smac=MAC[CLIENT])))
        assert out == (NODE, 61000, REMOTE_BE, 8080)
        back = leaving(dp, *net.from_net(tcp(REMOTE_BE, NODE, 8080, 61000, flags="PA", smac=MAC[NODE2])))
        assert back == (NODE, 30080, CLIENT, 5555)
        stats = net.stats()
        assert (stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY], stats[Stat.DROP_NO_FLOW]) == (2, 2, 1)
        reset_maps(dp)


@pytest.mark.kernel
@pytest.mark.parametrize("late", [False, True], ids=["replaced", "never-replaced"])
def test_a_carried_host_flow_is_netfilters_until_its_handover_then_goes_to_the_stack(
    dp: Datapath, late: bool
) -> None:
    """A carried flow to the node's own address: its packets pass untranslated both ways (NFPASS:
    the kernel's NAT entry translates them; a reply of the stack's leaves as it is) until the agent
    replaces that entry; its forward packets drop meanwhile (HANDOVER); then they go to the node's
    stack translated (TC_ACT_OK, no route lookup: no drop_fib), and the stack's replies leave as the
    ClusterIP's. Flags never cleared (an agent that died in between) hold EKP_CT_HANDOVER_S at most."""
    with packet_lab() as lab:
        reset_maps(dp)
        net = Net(dp, lab)
        net.add_service(backends=((21, NODE, 6443, BackendFlag.HOST | BackendFlag.LOCAL),), svc_id=3)
        made = time.monotonic_ns() - (abi.CT_HANDOVER_S + 1) * 10**9 if late else time.monotonic_ns()
        segment = tcp(POD_CLIENT, VIP, 40100, 80, flags="PA")
        reply = tcp(NODE, POD_CLIENT, 6443, 40100, flags="PA")
        while_replaced: list[int] = []
        takeover = KernelTakeover(
            Config(),
            dump=lambda netns: [API_FLOW],
            addresses=lambda netns: {NODE},
            remove_rules=lambda c: None,
            sysctl=lambda netns, path, value: None,
            read_sysctl=lambda netns, path: None,
            replace=FakeReplace([], lambda flow: while_replaced.append(net.from_pod(segment)[0])),
            clock_ns=lambda: made,
        )
        takeover.before_attach(dp.maps)
        activity.arm(dp.maps)
        # NFPASS, or expired: translated
        verdict, out = net.from_pod(segment)
        p = parse(out)
        assert verdict == TC_ACT_OK and (p.dst, p.dport) == ((NODE, 6443) if late else (VIP, 80))
        p = parse(net.to_pod(reply)[1])
        assert (p.src, p.sport) == ((VIP, 80) if late else (NODE, 6443))
        assert net.stats()[Stat.PASS] == (0 if late else 1)
        takeover.after_attach(dp.maps)
        assert while_replaced == [TC_ACT_OK if late else TC_ACT_SHOT]
        assert net.stats()[Stat.DROP_HANDOVER] == (0 if late else 1)
        verdict, out = net.from_pod(segment)
        p = parse(out)
        assert verdict == TC_ACT_OK and (p.src, p.sport, p.dst, p.dport) == (POD_CLIENT, 40100, NODE, 6443)
        p = parse(net.to_pod(reply)[1])
        assert (p.src, p.sport, p.dst, p.dport) == (VIP, 80, POD_CLIENT, 40100)
        stats = net.stats()
        counts = (stats[Stat.CT_FORWARD], stats[Stat.CT_REPLY], stats[Stat.DROP_FIB])
        assert counts == ((3, 2, 0) if late else (1, 1, 0))
        reset_maps(dp)


@pytest.fixture
def netns() -> Iterator[str]:
    require_kernel()
    name = f"ekpt-{secrets.token_hex(3)}"
    sh("ip", "netns", "add", name)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.mark.kernel
def test_replace_flows_replaces_each_entry_between_its_own_hooks(netns: str) -> None:
    """Flow by flow: at `before` the flow's NAT entry is there, at `after` its plain entry is and
    the next flow's NAT entry still is (each flow held for its own send, not the batch's);
    an entry on the plain tuple already (a packet made it meanwhile) is deleted first, as a stray."""
    t = Timeouts()
    other = NatFlow(6, (POD_CLIENT, VIP, 40001, 80), (BE1, POD_CLIENT, 8080, 40001))
    assert create_flows(netns, [CLUSTERIP, other], t).created == 2
    seen: list[str] = []

    def nat_entries() -> list[Tuple]:
        return sorted(f.orig for f in dump_flows(netns))

    def before(flow: NatFlow) -> None:
        seen.append(f"before {flow.orig[2]}: {[o[2] for o in nat_entries()]}")

    def after(flow: NatFlow) -> None:
        seen.append(f"after {flow.orig[2]}: {[o[2] for o in nat_entries()]}")

    done = replace_flows(netns, [CLUSTERIP, other], stack_flow, t, before=before, after=after)
    assert seen == [
        "before 40000: [40000, 40001]",
        "after 40000: [40001]",
        "before 40001: [40001]",
        "after 40001: []",
    ]
    assert (done.retired, done.stray, done.made.created, done.made.failed) == (2, 0, 2, [])
    assert delete_flows(netns, [stack_flow(CLUSTERIP), stack_flow(other)]) == 2  # the plain entries
    # replaced again: nothing to delete, the plain entries are made
    done = replace_flows(netns, [CLUSTERIP], stack_flow, t, before=before, after=after)
    assert (done.retired, done.stray, done.made.created) == (0, 0, 1)
    done = replace_flows(netns, [CLUSTERIP], stack_flow, t, before=before, after=after)
    assert (done.retired, done.stray, done.made.created) == (0, 1, 1)  # the one there was deleted, made again


@pytest.mark.kernel
def test_a_plain_entry_whose_reply_tuple_another_entry_holds_is_counted_as_refused(netns: str) -> None:
    """The create's EEXIST, once both tuples' entries went in the same send, is another entry on
    the plain flow's reply tuple (here another Service's NAT entry to the same backend and client
    port), not an entry made by packets meanwhile: counted apart."""
    t = Timeouts()
    holder = NatFlow(6, (POD_CLIENT, "10.96.0.11", 40000, 80), (BE1, POD_CLIENT, 8080, 40000))
    assert create_flows(netns, [holder], t).created == 1
    done = replace_flows(netns, [CLUSTERIP], stack_flow, t, before=lambda f: None, after=lambda f: None)
    assert (done.retired, done.stray, done.made.created, done.made.present) == (0, 0, 0, 0)
    assert done.refused == [stack_flow(CLUSTERIP)] and done.made.failed == []
    assert [f.orig for f in dump_flows(netns)] == [holder.orig]


@pytest.mark.kernel
def test_a_flow_that_closed_while_it_waited_is_replaced_in_its_state_now(netns: str) -> None:
    """The dump said ESTABLISHED; netfilter, which alone saw the flow's packets while it waited
    (NFPASS), has it in TIME_WAIT now: the plain entry is made in TIME_WAIT with that state's
    timeout, not ESTABLISHED for a day."""
    t = Timeouts()
    closed = NatFlow(6, CLUSTERIP.orig, CLUSTERIP.reply, tcp_state=TcpState.TIME_WAIT)
    assert create_flows(netns, [closed], t).created == 1
    done = replace_flows(netns, [CLUSTERIP], stack_flow, t, before=lambda f: None, after=lambda f: None)
    assert (done.retired, done.made.created, done.moved_on) == (1, 1, 1)

    def plain() -> tuple[int, int]:
        with NFCTSocket() as ct:
            s, d, sp, dp = stack_flow(CLUSTERIP).orig
            got = ct.entry("get", tuple_orig=NFCTAttrTuple(saddr=s, daddr=d, proto=6, sport=sp, dport=dp))
            msg = next(m for m in got if m.get_attr("CTA_PROTOINFO") is not None)
            tcp = msg.get_attr("CTA_PROTOINFO").get_attr("CTA_PROTOINFO_TCP")
            return int(tcp.get_attr("CTA_PROTOINFO_TCP_STATE")), int(msg.get_attr("CTA_TIMEOUT"))

    state, timeout = run_in_netns(netns, plain)
    assert state == TcpState.TIME_WAIT and timeout <= 120


@pytest.mark.kernel
def test_a_nat_entry_and_the_stacks_plain_entry_exclude_each_other_until_one_is_deleted(netns: str) -> None:
    # why each side of a switch deletes the other's entry under legacy host routing
    t = Timeouts()
    plain = stack_flow(CLUSTERIP)
    assert create_flows(netns, [CLUSTERIP], t).created == 1
    blocked = create_flows(netns, [plain], t)
    assert (blocked.created, blocked.present) == (0, 1)  # its reply tuple is the NAT entry's
    assert delete_flows(netns, [CLUSTERIP, CLUSTERIP]) == 1  # a missing entry is no error
    assert create_flows(netns, [plain], t).created == 1
    # refused, not made with another source port (which the backend would reset): nfct.py pins it
    assert create_flows(netns, [CLUSTERIP], t).taken == [CLUSTERIP]
    assert dump_flows(netns) == []
    assert delete_flows(netns, [plain]) == 1
    assert create_flows(netns, [CLUSTERIP], t).created == 1
    assert [f.reply for f in dump_flows(netns)] == [CLUSTERIP.reply]
    assert delete_flows(netns, [CLUSTERIP]) == 1
    # the handback's write: the plain entry deleted right before the NAT entry is created
    assert create_flows(netns, [plain], t).created == 1
    assert create_flows(netns, [CLUSTERIP], t, clear_first=stack_flow).created == 1
    assert delete_flows(netns, [plain]) == 0
    # a masqueraded flow's plain entry holds no tuple of its NAT entry
    assert create_flows(netns, [NODEPORT, stack_flow(NODEPORT)], t).created == 2
    assert {f.orig for f in dump_flows(netns)} == {CLUSTERIP.orig, NODEPORT.orig}  # DST_NAT only


@pytest.mark.kernel
def test_an_sctp_entry_written_into_nf_conntrack_is_dumped_with_its_state_and_tags(netns: str) -> None:
    assert create_flows(netns, [ASSOCIATION], Timeouts()).created == 1
    kernel = {f.orig: f for f in dump_flows(netns)}[ASSOCIATION.orig]
    assert (kernel.proto, kernel.reply, kernel.sctp_state, kernel.vtags) == (
        132,
        ASSOCIATION.reply,
        SctpState.ESTABLISHED,
        ASSOCIATION.vtags,
    )


@pytest.mark.kernel
def test_an_ipv6_flow_written_into_nf_conntrack_carries_its_nat(netns: str) -> None:
    """A tc IPv6 flow handed back (leaving eBPF mode): an AF_INET6 nf_conntrack entry with both
    NAT bindings, found again on its tuple (EEXIST the second time)."""
    t = Timeouts()
    assert create_flows(netns, [NODEPORT6, CLUSTERIP], t).created == 2
    again = create_flows(netns, [NODEPORT6], t)
    assert (again.created, again.present, again.failed) == (0, 1, [])
    listed = sh("ip", "netns", "exec", netns, "conntrack", "-L", "-f", "ipv6")
    line = next(line for line in listed.splitlines() if "dport=30080" in line)
    assert "src=fd00:ff::100 dst=fd00:ff::11 sport=5555 dport=30080" in line
    assert "src=fd00:a:2::7 dst=fd00:ff::11 sport=8080 dport=61000" in line
    assert "ESTABLISHED" in line
    dumped = dump_flows(netns, socket.AF_INET6)
    assert [(f.orig, f.reply) for f in dumped] == [(NODEPORT6.orig, NODEPORT6.reply)], "IPv6's alone"
    assert masqueraded_into(dumped, (61000, 65535), "fd00:ff::11") == dumped
    assert masqueraded_into(dumped, (62000, 65535), "fd00:ff::11") == [], "its port is 61000"
    assert masqueraded_into(dumped, (61000, 65535), "fd00:ff::12") == [], "another address's"
    assert delete_flows(netns, [NODEPORT6]) == 1


@pytest.mark.kernel
def test_the_handback_reads_the_tc_ipv6_paths_pinned_flows(dp: Datapath) -> None:
    """pinned_flows: the live FORWARD entries of ekp_ct6_tcp beside IPv4's."""
    from agent.takeover.out_of_ebpf import pinned_flows

    reset_maps(dp)
    key, entry = ct6_forward(NODEPORT6, CtFlag.SNAT | CtFlag.SEEN_REPLY | CtFlag.ESTABLISHED)
    dp.maps["ct6_tcp"].update(key, entry)
    fkey, fwd = entries(CLUSTERIP)[(CtDir.FORWARD, 6)]
    dp.maps["ct_tcp"].update(fkey, fwd)
    assert {f.orig for f in pinned_flows(dp.pin_path)} == {CLUSTERIP.orig, NODEPORT6.orig}
    reset_maps(dp)


@pytest.mark.kernel
@pytest.mark.parametrize("routing", list(HostRouting))
def test_a_handed_back_flow_the_stack_tracks_is_held_for_its_write_then_passed_to_its_nat_entry(
    dp: Datapath, routing: HostRouting
) -> None:
    """Out of eBPF mode (out_of_ebpf.StackHolds): under legacy host routing a flow whose source is
    not translated is held while its NAT entry replaces the plain one (its forward packets drop),
    then passed to it (both directions untranslated: that entry translates them). Translated once
    the NAT entry is written, a forward packet would reach the stack as client -> backend, whose
    reply tuple that entry holds: the stack's NAT gives it another source port, and the backend's
    answer reaches the client from the backend's own address. A masqueraded flow (its plain entry
    holds no tuple of its NAT entry), and any pod flow under bpf host routing, goes on translated."""
    legacy = routing is HostRouting.LEGACY
    with packet_lab() as lab:
        reset_maps(dp)
        if legacy:
            set_config(dp, flags=abi.ConfigFlag.HOST_LEGACY)
        net = clusterip_and_nodeport(dp, lab)
        for flow in (CLUSTERIP, NODEPORT):
            for key, entry in ebpf_entries(flow, IDS, time.monotonic_ns()):
                # established a minute ago, longer than EKP_CT_HANDOVER_S: the pass must not lapse at once
                entry.created_s -= 60
                dp.maps["ct_tcp"].update(key, entry)
        activity.arm(dp.maps)  # the flows stamped, as the agent that made them had them
        segment = tcp(POD_CLIENT, VIP, 40000, 80, flags="PA")
        reply = tcp(BE1, POD_CLIENT, 8080, 40000, flags="PA")
        masqueraded = tcp(CLIENT, NODE, 5555, 30080, flags="PA", smac=MAC[CLIENT])
        holds = StackHolds(dp.pin_path)
        try:
            holds.hold(CLUSTERIP)
            holds.hold(NODEPORT)
            while_held = leaving(dp, *net.from_pod(segment))
            masq_held = leaving(dp, *net.from_net(masqueraded))
            holds.release(CLUSTERIP)
            holds.release(NODEPORT)
            out = leaving(dp, *net.from_pod(segment))
            back = leaving(dp, *net.from_pod(reply))
        finally:
            holds.close()
        translated = (POD_CLIENT, 40000, BE1, 8080)
        assert masq_held == (NODE, 61000, REMOTE_BE, 8080)
        assert (holds.held, holds.passed) == ((1, 1) if legacy else (0, 0))
        if legacy:
            assert net.stats()[Stat.DROP_HANDOVER] == 1
            assert out == (POD_CLIENT, 40000, VIP, 80)  # to the NAT entry, untranslated
            assert back == (BE1, 8080, POD_CLIENT, 40000)  # the NAT entry gives it the ClusterIP
        else:
            assert while_held == translated and out == translated
            assert back == (VIP, 80, POD_CLIENT, 40000)
        reset_maps(dp)


@pytest.mark.kernel
def test_create_flows_holds_each_flow_from_before_the_plain_entry_goes_until_its_own_is_written(
    netns: str,
) -> None:
    """At `hold` the plain entry the stack tracked the flow under is still there, at `release` the
    NAT entry is; a flow whose write was refused is not released (it stays held until the detach),
    unless the entry in its place is its own NAT entry (a hand-back killed after the write)."""
    t = Timeouts()
    plain = stack_flow(CLUSTERIP)
    assert create_flows(netns, [plain], t).created == 1
    seen: list[tuple[str, bool, bool]] = []

    def entries_now() -> tuple[bool, bool]:
        """(the plain entry is there, the NAT entry is there)"""
        listed = sh("ip", "netns", "exec", netns, "conntrack", "-L", "-p", "tcp")
        return f"dst={BE1} sport=40000 dport=8080 " in listed, [f.orig for f in dump_flows(netns)] == [
            CLUSTERIP.orig
        ]

    class Recorder:
        def hold(self, flow: NatFlow) -> bool:
            seen.append(("hold", *entries_now()))
            return True

        def release(self, flow: NatFlow) -> None:
            seen.append(("release", *entries_now()))

        def renew(self) -> None:
            pass

    assert create_flows(netns, [CLUSTERIP], t, clear_first=stack_flow, hold=Recorder()).created == 1
    assert seen == [("hold", True, False), ("release", False, True)]
    seen.clear()
    again = create_flows(netns, [CLUSTERIP], t, hold=Recorder())
    assert (again.present, again.taken) == (1, [])
    assert seen == [("hold", False, True), ("release", False, True)]
    seen.clear()
    elsewhere = dataclasses.replace(CLUSTERIP, reply=(REMOTE_BE, POD_CLIENT, 8080, 40000))
    refused = create_flows(netns, [elsewhere], t, hold=Recorder())
    assert refused.taken == [elsewhere] and seen == [("hold", False, True)]


@pytest.mark.kernel
def test_flows_written_into_nf_conntrack_carry_their_nat(netns: str) -> None:
    t = Timeouts()
    assert create_flows(netns, [CLUSTERIP, NODEPORT], t).created == 2
    again = create_flows(netns, [NODEPORT], t)
    assert (again.created, again.present, again.failed) == (0, 1, [])
    got = {f.orig: f for f in dump_flows(netns)}
    for flow in (CLUSTERIP, NODEPORT):
        kernel = got[flow.orig]
        assert kernel.reply == flow.reply and kernel.tcp_state == TcpState.ESTABLISHED
        assert kernel.status & kernel_status(flow) == kernel_status(flow), hex(kernel.status)


def test_a_takeover_that_cannot_read_the_other_side_logs_the_fix_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def refused(_: str) -> list[NatFlow]:
        raise PermissionError(1, "Operation not permitted")

    takeover = KernelTakeover(
        Config(netns="node1"),
        dump=refused,
        addresses=lambda netns: (),
        remove_rules=lambda c: None,
        sysctl=lambda netns, path, value: pytest.fail("no window to cover: nothing was carried"),
        read_sysctl=lambda netns, path: pytest.fail("no window to cover: nothing was carried"),
    )
    takeover.before_attach(fake_maps())
    assert takeover.carried == 0 and "needs NET_ADMIN" in caplog.text
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / MAPS["ct_any"].name).touch()
    handback = EbpfHandback(Config(pin_path=str(pins)), read=refused)
    handback.run()
    assert "takeOverFromEbpf" in caplog.text and "its programs stay attached" in caplog.text


# ---- the tc IPv6 path's UDP flows (into_ebpf.KernelTakeover._carry6) ----------------------------

VIP6_T, BE6_T, BE6_GONE, CLIENT6_T, NODE6_T = (
    "fd00:10:96::a",
    "fd00:10:244:2::5",
    "fd00:10:244:2::6",
    "fd00:10:244:1::9",
    "fd00:192:168::11",
)
DNS6 = NatFlow(17, (CLIENT6_T, VIP6_T, 40000, 53), (BE6_T, CLIENT6_T, 53, 40000))
MASQ6 = NatFlow(17, ("fd00:ff::100", NODE6_T, 5555, 30053), (BE6_T, NODE6_T, 53, 61000))
GONE6 = NatFlow(17, (CLIENT6_T, VIP6_T, 40001, 53), (BE6_GONE, CLIENT6_T, 53, 40001))
HOST6 = NatFlow(17, (CLIENT6_T, VIP6_T, 40002, 53), (NODE6_T, CLIENT6_T, 53, 40002))
TCP6 = NatFlow(6, (CLIENT6_T, VIP6_T, 40003, 53), (BE6_T, CLIENT6_T, 53, 40003))


def fake_maps6() -> dict[str, MapWriter]:
    """fake_maps with the IPv6 frontends and backend of the flows above (as an earlier run pinned them)."""
    maps = fake_maps()
    for role in ("fe6", "be6", "ct6_tcp", "ct6_any"):
        maps[role] = FakeMap(MAPS[role])
    for addr, port, svc in ((VIP6_T, 53, 7), (NODE6_T, 30053, 8)):
        key = abi.Frontend6Key(abi.Addr6(*abi.ip6_words(addr)), port_be(port), 17, Scope.INTERNAL)
        maps["fe6"].update(key, abi.Frontend(svc_id=svc))
    backend = abi.Backend6(abi.Addr6(*abi.ip6_words(BE6_T)), port_be(53), 17, 0)
    maps["be6"].update(abi.BackendKey(31), backend)
    return maps


def test_udp_flows_ip6tables_translated_are_carried_into_the_tc_ipv6_paths_conntrack() -> None:
    """Where the tc IPv6 path serves (it decides a UDP datagram without an entry as a new flow), a
    restart over a node whose ip6tables translated UDP flows carries them into ekp_ct6_any, with
    their backend, SNAT source and the frontend's ids: their next datagrams keep their backend.
    Left out as the path leaves them: a backend gone from ekp_be6, a host backend (ip6tables keeps
    such frontends whole); TCP (a mid-flow segment without an entry goes to the stack, whose
    nf_conntrack entry translates it). An entry the data path wrote meanwhile is kept."""
    config = Config(
        netns="node1",
        mode=Mode.EBPF,
        cluster_cidr=("10.244.0.0/16", "fd00:10:244::/56"),
        bpf_host_routing=HostRouting.BPF,
        socket_lb=True,
    )
    assert config.tc_ipv6
    takeover = KernelTakeover(
        config,
        dump=lambda netns: [],
        dump6=lambda netns: [DNS6, MASQ6, GONE6, HOST6, TCP6],
        addresses=lambda netns: {NODE, NODE6_T},
        remove_rules=lambda config: None,
        sysctl=lambda netns, path, value: "0",
        read_sysctl=lambda netns, path: "0",
        clock_ns=lambda: NOW,
    )
    maps = fake_maps6()
    mine_key, _ = ebpf_entries6(DNS6, EbpfIds(services={}, backends={}), NOW)[0]  # its REPLY entry
    mine = abi.Ct6Entry(flags=CtFlag.ESTABLISHED, svc_id=99)
    maps["ct6_any"].update(mine_key, mine)
    takeover.before_attach(maps)
    takeover.after_attach(maps)
    entries = {bytes(k): v for k, v in maps["ct6_any"].items()}
    assert len(entries) == 4 and bytes(entries[bytes(mine_key)]) == bytes(mine), (
        "two flows; the newer entry kept"
    )
    assert maps["ct6_tcp"].items() == []
    dns_forward = entries[bytes(next(k for k, _ in ebpf_entries6(DNS6, IDS, NOW) if k.dir == CtDir.FORWARD))]
    assert isinstance(dns_forward, abi.Ct6Entry)
    assert (abi.ip6_str(dns_forward.nat_addr), abi.port_host(dns_forward.nat_port)) == (BE6_T, 53)
    assert (dns_forward.svc_id, dns_forward.backend_id) == (7, 31)
    assert dns_forward.flags & CtFlag.ADOPTED and not dns_forward.flags & (CtFlag.SNAT | CtFlag.NFPASS)
    masq_forward = entries[
        bytes(next(k for k, _ in ebpf_entries6(MASQ6, IDS, NOW) if k.dir == CtDir.FORWARD))
    ]
    assert isinstance(masq_forward, abi.Ct6Entry) and masq_forward.flags & CtFlag.SNAT
    assert (abi.ip6_str(masq_forward.snat_addr), abi.port_host(masq_forward.snat_port)) == (NODE6_T, 61000)


def tc6_config() -> Config:
    config = Config(
        netns="node1",
        mode=Mode.EBPF,
        cluster_cidr=("10.244.0.0/16", "fd00:10:244::/56"),
        bpf_host_routing=HostRouting.BPF,
        socket_lb=True,
    )
    assert config.tc_ipv6
    return config


@pytest.mark.parametrize("unreadable", ["IPv4", "IPv6"])
def test_each_familys_carry_goes_on_when_the_others_table_cannot_be_read(unreadable: str) -> None:
    """IPv4 nf_conntrack unreadable (a dump that raises) still carries the IPv6 UDP flows into
    ekp_ct6_any, and the other way round: each family's flows would otherwise reach another backend
    (IPv6 UDP) or drop their next segments (IPv4 TCP)."""

    def refused(netns: str) -> list[NatFlow]:
        raise OSError(errno.EPERM, "Operation not permitted")

    takeover = KernelTakeover(
        tc6_config(),
        dump=refused if unreadable == "IPv4" else (lambda netns: [CLUSTERIP]),
        dump6=refused if unreadable == "IPv6" else (lambda netns: [DNS6]),
        addresses=lambda netns: {NODE, NODE6_T},
        remove_rules=lambda config: None,
        sysctl=lambda netns, path, value: "0",
        read_sysctl=lambda netns, path: "0",
        clock_ns=lambda: NOW,
    )
    maps = fake_maps6()
    takeover.before_attach(maps)
    takeover.after_attach(maps)
    assert len(maps["ct6_any"].items()) == (2 if unreadable == "IPv4" else 0)
    assert len(maps["ct_tcp"].items()) == (0 if unreadable == "IPv4" else 2)


@pytest.mark.kernel
def test_the_ipv6_carry_leaves_the_nodes_own_ipv6_clients_and_host_backends_by_default(netns: str) -> None:
    """The real address read (nfct.local_addresses, not injected) lists the node's IPv6 addresses
    too: a UDP flow from the node's IPv6 address (a host-network client, whose datagrams the tc
    path never sees) and one whose backend is that address (ip6tables keeps such frontends whole)
    stay with ip6tables; a pod's flow is carried."""
    sh(
        "ip", "-n", netns, "link", "add", "ekpt0", "type", "veth", "peer", "name", "ekpt1"
    )  # no dummy module here
    sh("ip", "-n", netns, "addr", "add", f"{NODE6_T}/64", "dev", "ekpt0", "nodad")
    sh("ip", "-n", netns, "link", "set", "ekpt0", "up")
    from_node = NatFlow(17, (NODE6_T, VIP6_T, 40010, 53), (BE6_T, NODE6_T, 53, 40010))
    to_node = NatFlow(17, (CLIENT6_T, VIP6_T, 40011, 53), (NODE6_T, CLIENT6_T, 53, 40011))
    takeover = KernelTakeover(
        dataclasses.replace(tc6_config(), netns=netns),
        dump=lambda netns: [],
        dump6=lambda netns: [from_node, to_node, DNS6],
        remove_rules=lambda config: None,
        sysctl=lambda netns, path, value: "0",
        read_sysctl=lambda netns, path: "0",
        clock_ns=lambda: NOW,
    )
    maps = fake_maps6()
    # the host backend is one of the Service's backends, as a host-network endpoint is
    host = abi.Backend6(abi.Addr6(*abi.ip6_words(NODE6_T)), port_be(53), 17, 0)
    maps["be6"].update(abi.BackendKey(32), host)
    takeover.before_attach(maps)
    carried = {bytes(k) for k, _ in maps["ct6_any"].items()}
    assert carried == {bytes(k) for k, _ in ebpf_entries6(DNS6, IDS, NOW)}


@pytest.mark.parametrize("routing", [HostRouting.LEGACY, HostRouting.BPF])
def test_ipv6_udp_flows_the_tc_path_hands_to_the_stack_get_plain_nf_conntrack_entries(
    routing: HostRouting,
) -> None:
    """A UDP flow ip6tables translated whose datagrams the tc IPv6 path now hands to the node's stack
    as client -> backend (under legacy host routing every one; under either, one to a backend on the
    node's own address, which tc serves again and may give the same backend) has its NAT entry
    replaced by the plain one: left in place, its reply tuple (backend -> client) clashes with the
    plain flow's, so the stack's NAT moves the datagrams' source port and the replies miss tc's
    REPLY entry (the client gets them from the backend, not the ClusterIP). A flow whose backend
    left is not touched (tc gives it another backend: no clash), nor a node client's (tc never sees
    it); the IPv6 path has no NFPASS hold, so no eBPF entry is held around the replacement."""
    events: list[str] = []
    takeover = KernelTakeover(
        dataclasses.replace(tc6_config(), bpf_host_routing=routing),
        dump=lambda netns: [],
        dump6=lambda netns: [DNS6, GONE6, HOST6, NatFlow(17, (NODE6_T, VIP6_T, 40010, 53), DNS6.reply)],
        addresses=lambda netns: {NODE, NODE6_T},
        remove_rules=lambda config: None,
        sysctl=lambda netns, path, value: "0",
        read_sysctl=lambda netns, path: "0",
        replace=FakeReplace(events),
        clock_ns=lambda: NOW,
    )
    maps = fake_maps6()
    maps["be6"].update(
        abi.BackendKey(32), abi.Backend6(abi.Addr6(*abi.ip6_words(NODE6_T)), port_be(53), 17, 0)
    )
    takeover.before_attach(maps)
    assert events == [], "replaced only once the programs are attached (ip6tables translates until then)"
    takeover.after_attach(maps)

    def replaced(flow: NatFlow) -> list[str]:
        plain = stack_flow(flow)
        return [f"delete {[flow.orig]}", f"delete {[plain.orig]}", f"create {[plain.orig]}"]

    handed = [DNS6, HOST6] if routing == HostRouting.LEGACY else [HOST6]
    assert events == [e for flow in handed for e in replaced(flow)]
    entries = [v for _, v in maps["ct6_any"].items()]
    assert entries and all(
        isinstance(v, abi.Ct6Entry) and not v.flags & (CtFlag.NFPASS | CtFlag.HANDOVER) for v in entries
    )


@pytest.mark.kernel
def test_replace_flows_gives_an_ipv6_udp_flow_its_plain_entry_and_removes_the_moved_one(netns: str) -> None:
    """What `_to_stack6` asks of ctnetlink, for real: an IPv6 UDP flow's NAT entry (client ->
    ClusterIP, reply backend -> client) and the plain entry a datagram the tc path handed to the
    stack made meanwhile, its reply moved to another port by nf_nat (the entry that kept the
    replies from the client) are replaced by the plain client <-> backend entry alone."""
    t = Timeouts()
    moved = NatFlow(17, (CLIENT6_T, BE6_T, 40000, 53), (BE6_T, CLIENT6_T, 53, 1024))
    assert create_flows(netns, [DNS6, moved], t).created == 2
    done = replace_flows(netns, [DNS6], stack_flow, t, before=lambda f: None, after=lambda f: None)
    assert (done.retired, done.stray, done.made.created, done.made.failed) == (1, 1, 1, [])
    assert dump_flows(netns, socket.AF_INET6) == [], "no NAT entry left"
    listed = sh("ip", "netns", "exec", netns, "conntrack", "-L", "-f", "ipv6", "-p", "udp").splitlines()
    assert len(listed) == 1 and "sport=53 dport=40000" in listed[0], (
        listed
    )  # the reply to the client's own port


def legacy6_takeover(
    dump6: Callable[[str], Iterable[NatFlow]],
    replace: Callable[..., Replaced],
    *,
    dump: Callable[[str], Iterable[NatFlow]] = lambda netns: [],
    clock_ns: Callable[[], int] = lambda: NOW,
) -> KernelTakeover:
    """A takeover of node1 under legacy host routing with the tc IPv6 path serving."""
    return KernelTakeover(
        dataclasses.replace(tc6_config(), bpf_host_routing=HostRouting.LEGACY),
        dump=dump,
        dump6=dump6,
        addresses=lambda netns: {NODE, NODE6_T},
        remove_rules=lambda config: None,
        sysctl=lambda netns, path, value: "0",
        read_sysctl=lambda netns, path: "0",
        replace=replace,
        clock_ns=clock_ns,
    )


def replaced6(flow: NatFlow) -> list[str]:
    """FakeReplace's events for one flow's replacement."""
    plain = stack_flow(flow)
    return [f"delete {[flow.orig]}", f"delete {[plain.orig]}", f"create {[plain.orig]}"]


def test_ipv6_flows_on_a_node_never_served_are_carried_and_replaced_after_the_first_ipv6_sync() -> None:
    """The normal kube-proxy -> eBPF migration: ekp_fe6 / ekp_be6 are empty at the attach (the first
    IPv6 sync writes them after it), so the attach's carry finds no frontend for the IPv6 UDP flows
    ip6tables translated and replaces no NAT entry. Once that sync wrote them (`after_first_sync6`),
    the flows are carried into ekp_ct6_any and their NAT entries replaced: left in place, tc's choice
    of the same backend would meet them in the stack and the replies would be lost."""
    events: list[str] = []
    takeover = legacy6_takeover(lambda netns: [DNS6], FakeReplace(events))
    filled = fake_maps6()
    maps = fake_maps()
    for role in ("fe6", "be6", "ct6_tcp", "ct6_any"):
        maps[role] = FakeMap(MAPS[role])
    takeover.before_attach(maps)
    takeover.after_attach(maps)
    assert events == [] and maps["ct6_any"].items() == [], "no IPv6 frontend known at the attach"
    for role in ("fe6", "be6"):  # what the first sync6 writes
        for key, value in filled[role].items():
            maps[role].update(key, value)
    takeover.after_first_sync6(maps)
    assert events == replaced6(DNS6)
    assert {bytes(k) for k, _ in maps["ct6_any"].items()} == {
        bytes(k) for k, _ in ebpf_entries6(DNS6, IDS, NOW)
    }


def test_ipv6_flows_are_carried_with_the_frontends_the_first_ipv6_sync_is_about_to_write() -> None:
    """The proxier calls `after_first_sync6` between that sync's backend writes and its ekp_fe6
    write, so that tc decides none of the flows ip6tables translated in between: the svc_id of a
    frontend not yet in ekp_fe6 comes with the call, and the flow is carried and replaced as if it
    were there. Without it (ekp_fe6 empty) the flow is not carried at all."""
    filled = fake_maps6()
    frontends = {
        (abi.ip6_str(k.addr), abi.port_host(k.port), k.proto): v.svc_id
        for k, v in filled["fe6"].items()
        if isinstance(k, abi.Frontend6Key) and isinstance(v, abi.Frontend)
    }
    for pending in ({}, frontends):
        events: list[str] = []
        takeover = legacy6_takeover(lambda netns: [DNS6], FakeReplace(events))
        maps = fake_maps()
        for role in ("fe6", "be6", "ct6_tcp", "ct6_any", "act"):
            maps[role] = FakeMap(MAPS[role])
        for key, value in filled["be6"].items():  # written ahead of ekp_fe6
            maps["be6"].update(key, value)
        takeover.before_attach(maps)
        takeover.after_attach(maps)
        takeover.after_first_sync6(maps, pending)
        if not pending:
            assert events == [] and maps["ct6_any"].items() == [] and maps["act"].items() == []
            continue
        assert events == replaced6(DNS6)
        assert {bytes(k) for k, _ in maps["ct6_any"].items()} == {
            bytes(k) for k, _ in ebpf_entries6(DNS6, IDS, NOW)
        }
        # the activity check armed at the start knows nothing of them: both ends stamped here, or
        # the replies (backend -> client) skip the lookups until a refresh (1 s of them in the lab)
        ends = {
            activity.slot(activity.fold6(ipaddress.IPv6Address(addr).packed), port_be(53), 17)
            for addr in (VIP6_T, BE6_T)
        }
        assert {k.value for k, _ in maps["act"].items()} == ends


def test_a_pending_frontends_svc_id_wins_over_the_one_ekp_fe6_still_holds() -> None:
    """A Service deleted and recreated on the same IPv6 address while no agent ran has a new
    svc_id; ekp_fe6 still holds the old one until the first IPv6 sync writes over it. The flow is
    carried with the svc_id that write gives the frontend, not the stale one."""
    maps = fake_maps6()  # VIP6_T:53 pinned with svc_id 7
    ids = ebpf_ids6(maps, [DNS6, MASQ6], {(VIP6_T, 53, 17): 12, ("fd00:10:96::b", 53, 17): 13})
    assert ids.services == {(VIP6_T, 53, 17): 12, (NODE6_T, 30053, 17): 8}
    assert ids.backends == {(BE6_T, 53, 17): 31}


def empty6_maps(*, act: MapWriter | None = None) -> dict[str, MapWriter]:
    """A node the agent never served: its IPv6 maps empty but ekp_be6, which the first IPv6 sync
    writes ahead of ekp_fe6, and the activity map the start armed."""
    maps = fake_maps()
    for role in ("fe6", "be6", "ct6_tcp", "ct6_any"):
        maps[role] = FakeMap(MAPS[role])
    maps["act"] = act if act is not None else FakeMap(MAPS["act"])
    for key, value in fake_maps6()["be6"].items():
        maps["be6"].update(key, value)
    return maps


def pending6() -> dict[tuple[str, int, int], int]:
    return {
        (abi.ip6_str(k.addr), abi.port_host(k.port), k.proto): v.svc_id
        for k, v in fake_maps6()["fe6"].items()
        if isinstance(k, abi.Frontend6Key) and isinstance(v, abi.Frontend)
    }


def test_unreadable_node_addresses_carry_no_ipv6_flow_and_raise_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The node's addresses read (nfct.local_addresses) failing inside the first IPv6 sync's carry
    is a warning, as an unreadable nf_conntrack is: raised, it stopped that sync's ekp_fe6 write."""
    events: list[str] = []

    def addresses(netns: str) -> set[str]:
        raise OSError(errno.EPERM, "Operation not permitted")

    takeover = KernelTakeover(
        dataclasses.replace(tc6_config(), bpf_host_routing=HostRouting.LEGACY),
        dump=lambda netns: [],
        dump6=lambda netns: [DNS6],
        addresses=addresses,
        remove_rules=lambda config: None,
        sysctl=lambda netns, path, value: "0",
        read_sysctl=lambda netns, path: "0",
        replace=FakeReplace(events),
        clock_ns=lambda: NOW,
    )
    maps = empty6_maps()
    with caplog.at_level(logging.WARNING):
        takeover.after_first_sync6(maps, pending6())
    assert events == [] and maps["ct6_any"].items() == []
    assert "cannot read the node's addresses in netns node1" in caplog.text
    assert "the 1 UDP flows ip6tables translated are not carried into the tc IPv6 path" in caplog.text


def test_the_carry_after_a_first_ipv6_sync_without_frontends_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The carry runs before that sync's ekp_fe6 write, or after the sync when it wrote none: its
    log line says which."""
    for pending, when in (
        (pending6(), "before the first IPv6 sync wrote"),
        (None, "after the first IPv6 sync"),
    ):
        takeover = legacy6_takeover(lambda netns: [DNS6], FakeReplace([]))
        maps = empty6_maps()
        if pending is None:
            for key, value in fake_maps6()["fe6"].items():
                maps["fe6"].update(key, value)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            takeover.after_first_sync6(maps, pending)
        assert f"took over IPv6 UDP flows from nf_conntrack ({when}" in caplog.text
        assert ": 1 carried into the tc IPv6 path's conntrack" in caplog.text


class BatchRefusingMap(FakeMap):
    def update_batch(self, entries: Sequence[tuple[Any, Any]]) -> None:
        raise MapError(self.spec.name, "update_batch", errno.ENOMEM)


def test_a_failed_activity_stamp_is_its_own_warning_the_flows_carried_and_replaced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Stamping the carried flows' endpoints for the activity check failing leaves the flows
    carried and their NAT entries replaced; said as such, not as a failed carry."""
    events: list[str] = []
    takeover = legacy6_takeover(lambda netns: [DNS6], FakeReplace(events))
    maps = empty6_maps(act=BatchRefusingMap(MAPS["act"]))
    with caplog.at_level(logging.INFO):
        takeover.after_first_sync6(maps, pending6())
    assert events == replaced6(DNS6)
    assert {bytes(k) for k, _ in maps["ct6_any"].items()} == {
        bytes(k) for k, _ in ebpf_entries6(DNS6, IDS, NOW)
    }
    assert "cannot stamp the endpoints of the 1 IPv6 UDP flows carried" in caplog.text
    assert "for about a second" in caplog.text
    assert ": 1 carried into the tc IPv6 path's conntrack" in caplog.text
    assert "carrying the IPv6 UDP flows ip6tables translated at the first IPv6 sync failed" not in caplog.text


def test_the_ipv6_flows_nat_entries_are_replaced_before_the_ipv4_flows_waiting_under_their_hold() -> None:
    """IPv6's flows have no hold (each datagram until its turn may lose its reply), IPv4's lose
    nothing waiting (NFPASS): the IPv6 pass comes first, however many IPv4 flows there are."""
    events: list[str] = []
    takeover = legacy6_takeover(lambda netns: [DNS6], FakeReplace(events), dump=lambda netns: [CLUSTERIP])
    maps = fake_maps6()
    takeover.before_attach(maps)
    takeover.after_attach(maps)
    assert events == [*replaced6(DNS6), *replaced6(CLUSTERIP)]


def test_the_ipv4_holds_are_renewed_while_a_long_ipv6_pass_runs(caplog: pytest.LogCaptureFixture) -> None:
    """An IPv6 pass longer than EKP_CT_HANDOVER_S (thousands of flows, a starved agent) would let
    the holds of the IPv4 flows waiting after it expire: they are renewed every HOLD_RENEW_NS
    while it runs, so the IPv4 flow is replaced still held, not translated with its NAT entry there."""
    clock = [NOW]
    step = HOLD_RENEW_NS + 1_000_000_000  # each IPv6 flow's replacement takes 4 s
    flows6 = [
        NatFlow(17, (CLIENT6_T, VIP6_T, port, 53), (BE6_T, CLIENT6_T, 53, port))
        for port in range(40100, 40104)
    ]
    assert len(flows6) * step > abi.CT_HANDOVER_S * 1_000_000_000

    def slow6(flow: NatFlow) -> None:
        if flow.family == 6:
            clock[0] += step

    held_at_turn: list[bool] = []

    def during(flow: NatFlow) -> None:
        slow6(flow)
        if flow.family == 4:
            table = maps[abi.ct_role(flow.proto)]
            for key in ct_keys(flow):
                entry = table.lookup(key)
                assert isinstance(entry, abi.CtEntry)
                held_at_turn.append(still_held(entry, clock[0]))

    events: list[str] = []
    takeover = legacy6_takeover(
        lambda netns: flows6,
        FakeReplace(events, during),
        dump=lambda netns: [CLUSTERIP],
        clock_ns=lambda: clock[0],
    )
    maps = fake_maps6()
    takeover.before_attach(maps)
    takeover.after_attach(maps)
    assert len(events) == 3 * (len(flows6) + 1)
    assert held_at_turn == [True, True], "both entries still held at the IPv4 flow's turn"
    assert "after their hold" not in caplog.text


def test_an_attach_retried_after_a_failure_replaces_only_the_ipv6_flows_its_own_carry_found() -> None:
    """A first attach that failed after its carry, retried: a flow the first carry kept for the
    stack that ended meanwhile is not replaced by the retry (its tuple may be another flow's by now)."""
    events: list[str] = []
    dumps = [[DNS6], []]
    takeover = legacy6_takeover(lambda netns: dumps.pop(0) if dumps else [], FakeReplace(events))
    maps = fake_maps6()
    takeover.before_attach(maps)
    takeover.before_attach(maps)  # the retry
    takeover.after_attach(maps)
    assert events == []


def test_an_ipv6_socket_failure_is_worded_as_one_and_counts_the_flows_not_replaced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def fails_at_the_second(
        netns: str, flows: Iterable[NatFlow], by: Any, timeouts: Any, *, before: Any, after: Any
    ) -> Replaced:
        first = next(iter(flows))
        before(first)
        after(first)
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    second = NatFlow(17, (CLIENT6_T, VIP6_T, 40005, 53), (BE6_T, CLIENT6_T, 53, 40005))
    takeover = legacy6_takeover(lambda netns: [DNS6, second], fails_at_the_second)
    maps = fake_maps6()
    takeover.before_attach(maps)
    takeover.after_attach(maps)
    assert "cannot replace the NAT entries of 1 of the 2 IPv6 UDP flows" in caplog.text
    assert "the ctnetlink socket failed" in caplog.text and "NET_ADMIN" not in caplog.text


def test_an_ipv6_plain_entry_refused_is_logged_as_benign(caplog: pytest.LogCaptureFixture) -> None:
    """For an IPv6 UDP flow the only entry that can hold the plain tuple once the NAT entry and the
    moved one are gone is the one a datagram made in between: the one wanted."""
    caplog.set_level("INFO")

    def refused(
        netns: str, flows: Iterable[NatFlow], by: Any, timeouts: Any, *, before: Any, after: Any
    ) -> Replaced:
        done = Replaced()
        for flow in flows:
            before(flow)
            done.retired += 1
            done.refused.append(by(flow))
            after(flow)
        return done

    takeover = legacy6_takeover(lambda netns: [DNS6], refused)
    maps = fake_maps6()
    takeover.before_attach(maps)
    takeover.after_attach(maps)
    assert "1 refused as a datagram made the plain entry meanwhile: benign" in caplog.text


@pytest.mark.kernel
def test_translated_any_sees_an_ipv6_entry_with_either_translation_and_no_other(netns: str) -> None:
    """eBPF mode's ip6tables keeps its conntrack and nat rules while IPv6 nf_conntrack holds a
    translated entry (agent/metaproxier.py EbpfAndIp6tables `nat_live`): a source translation alone
    counts (a MASQUERADE of a pod's flow to a remote backend), a destination one too; an IPv4
    entry or an untranslated IPv6 one does not."""
    t = Timeouts()
    assert not translated_any(netns, socket.AF_INET6), "an empty table"
    assert create_flows(netns, [CLUSTERIP], t).created == 1
    plain = NatFlow(
        6, ("fd00:a:1::5", "fd00:a:2::7", 40000, 8080), ("fd00:a:2::7", "fd00:a:1::5", 8080, 40000)
    )
    assert not (plain.snat or plain.dnat)
    assert create_flows(netns, [plain], t).created == 1
    assert not translated_any(netns, socket.AF_INET6), "IPv4's DNAT and an untranslated IPv6 entry"
    masqueraded = NatFlow(
        6, ("fd00:a:1::5", "fd00:a:2::7", 40001, 8080), ("fd00:a:2::7", "fd00:ff::11", 8080, 61001)
    )
    assert masqueraded.snat and not masqueraded.dnat
    assert create_flows(netns, [masqueraded], t).created == 1
    assert translated_any(netns, socket.AF_INET6), "a source translation"
    assert delete_flows(netns, [masqueraded]) == 1
    assert not translated_any(netns, socket.AF_INET6)
    assert create_flows(netns, [NODEPORT6], t).created == 1
    assert translated_any(netns, socket.AF_INET6), "a destination translation"


@pytest.mark.kernel
def test_translated_any_checks_the_status_bit_itself_where_the_kernel_ignores_the_filter(
    netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel before 5.15 ignores a dump's status filter and returns every entry: an untranslated
    IPv6 entry must not count as translated there (the rules would never be withdrawn)."""
    plain = NatFlow(
        6, ("fd00:a:1::5", "fd00:a:2::7", 40000, 8080), ("fd00:a:2::7", "fd00:a:1::5", 8080, 40000)
    )
    assert create_flows(netns, [plain], Timeouts()).created == 1
    unfiltered = NFCTSocket.dump

    def old_kernel(self: NFCTSocket, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("status", None)
        kwargs.pop("status_mask", None)
        return unfiltered(self, *args, **kwargs)

    monkeypatch.setattr(NFCTSocket, "dump", old_kernel)
    assert not translated_any(netns, socket.AF_INET6)
    assert create_flows(netns, [NODEPORT6], Timeouts()).created == 1
    assert translated_any(netns, socket.AF_INET6)


def test_an_ebpf_agent_attached_everywhere_ends_a_partial_hand_back_s_marker(
    tmp_path: Path, lock_dir: Path
) -> None:
    """A partial hand-back leaves its marker; the operator goes back to eBPF mode, whose agent
    adopts the same pins (same conntrack inode) and attaches to every device: the marker goes. A
    later hand-back that detaches nothing (EPERM) must then undo, as if none had begun."""
    from tests.ebpf.support import NODE as NODE_CONTEXT
    from tests.ebpf.test_proxier import STATE as PROXIER_STATE
    from tests.ebpf.test_proxier import Rig

    pins = partial_pins(tmp_path)
    first = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=0),
        read=lambda pin_path: [CLUSTERIP],
        create=lambda netns, flows, timeouts, hold: Created(created=len(list(flows))),
        detach=eth0_then_none,
        remove_pins=lambda pin_path: pytest.fail("the programs stay on lxc-a: so do their pins"),
        holds=lambda pin_path: FakeHolds([]),
        delete=lambda netns, gone: len(gone),
    )
    assert first.run() is False
    marker = Path(out_of_ebpf.marker_path(str(lock_dir), str(pins)))
    assert marker.exists()
    rig = Rig(tmp_path)
    rig.snapshot_dir = str(lock_dir)
    assert rig.config.pin_path == str(pins)
    ebpf_agent = rig.proxier()
    ebpf_agent.sync(PROXIER_STATE, NODE_CONTEXT)
    assert not marker.exists(), "attached to every device: the hand-back it recorded is over"
    ebpf_agent.close()
    events: list[str] = []
    later = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=0),
        read=lambda pin_path: [CLUSTERIP],
        create=lambda netns, flows, timeouts, hold: Created(created=len(list(flows))),
        detach=lambda netns, detached, between: (_ for _ in ()).throw(
            attach.DetachFailed(errno.EPERM, [], ["eth0: (1, 'Operation not permitted')"])
        ),
        remove_pins=lambda pin_path: pytest.fail("the programs stay: so do their pins"),
        holds=lambda pin_path: FakeHolds(events),
        delete=lambda netns, gone: len(gone),
    )
    assert later.run() is True
    assert "undo" in events, "the held flows go back to the programs, which serve every device"


def test_agent_cleanup_removes_the_hand_back_s_marker(
    tmp_path: Path, lock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.ebpf import proxier as ebpf_proxier
    from tests.ebpf.test_proxier import Rig

    pins = partial_pins(tmp_path)
    marker = Path(out_of_ebpf.marker_path(str(lock_dir), str(pins)))
    lock_dir.mkdir()
    marker.write_text("pins 1\neth0\n")
    monkeypatch.setattr(ebpf_proxier, "detach_all", lambda netns: ["eth0", "lxc-a"])
    monkeypatch.setattr(into_ebpf, "netns_inode", lambda netns: INODE)  # node1 is no namespace here
    rig = Rig(tmp_path)
    rig.snapshot_dir = str(lock_dir)
    rig.proxier().cleanup()
    assert not pins.exists() and not marker.exists()


UDP_NODEPORT = dataclasses.replace(NODEPORT, proto=17, tcp_state=TcpState.NONE)


def test_a_written_flow_whose_nat_entry_may_have_expired_is_written_again(tmp_path: Path) -> None:
    """After a partial detach the flows through the devices still attached are translated by the
    programs: their NAT entries see no packet and time out (UDP stream: 120 s) while the tries
    wait. Once half its timeout has passed, a written flow counts as unwritten: the final detach's
    late round writes it (an entry still there would be kept); an established TCP flow's entry
    (a day) is never written again."""
    pins = partial_pins(tmp_path)
    clock = [1000.0]
    rounds: list[tuple[str, list[Tuple]]] = []

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        got = list(flows)
        rounds.append(("held" if hold is not None else "late", [f.orig for f in got]))
        return Created(created=len(got))

    outcomes = [True, False]

    def detach(netns: str, detached: list[str], between: Callable[[], None]) -> None:
        if outcomes.pop(0):
            eth0_then_none(netns, detached, between)
        detached.append("lxc-a")

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=30),
        read=lambda pin_path: [CLUSTERIP, UDP_NODEPORT],
        create=create,
        detach=detach,
        remove_pins=lambda pin_path: [],
        holds=lambda pin_path: FakeHolds([]),
        delete=lambda netns, gone: pytest.fail("eth0's flows need their NAT entries"),
        clock=lambda: clock[0],
    )
    assert handback.run() is False
    assert rounds[0] == ("held", [CLUSTERIP.orig, UDP_NODEPORT.orig])
    rounds.clear()
    clock[0] += Timeouts().udp_stream / 2  # the tries wait; the UDP flow's NAT entry sees nothing
    assert handback.run() is True
    assert ("held", [UDP_NODEPORT.orig]) in rounds, "written again before the detach"
    assert CLUSTERIP.orig not in [t for _, flows in rounds for t in flows], "established TCP: a day"


def test_a_written_flow_that_is_still_fresh_is_not_written_again(tmp_path: Path) -> None:
    pins = partial_pins(tmp_path)
    clock = [1000.0]
    rounds: list[list[Tuple]] = []

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        got = list(flows)
        rounds.append([f.orig for f in got])
        return Created(created=len(got))

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=30),
        read=lambda pin_path: [UDP_NODEPORT],
        create=create,
        detach=eth0_then_none,
        remove_pins=lambda pin_path: pytest.fail("the programs stay on lxc-a: so do their pins"),
        holds=lambda pin_path: FakeHolds([]),
        clock=lambda: clock[0],
    )
    assert handback.run() is False
    rounds.clear()
    clock[0] += Timeouts().udp_stream / 2 - 1
    assert handback.run() is False
    assert all(UDP_NODEPORT.orig not in r for r in rounds), "its NAT entry is still there"


def test_the_written_flows_are_pruned_to_the_current_read(tmp_path: Path) -> None:
    """A flow that ended (absent from a read) is forgotten: a new flow on the same tuples later
    is written, not taken for the one written before."""
    pins = partial_pins(tmp_path)
    clock = [1000.0]
    reads = [[CLUSTERIP], [CLUSTERIP], [], [], [CLUSTERIP], [CLUSTERIP]]
    rounds: list[list[Tuple]] = []

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        got = list(flows)
        rounds.append([f.orig for f in got])
        return Created(created=len(got))

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=30),
        read=lambda pin_path: reads.pop(0),
        create=create,
        detach=eth0_then_none,
        remove_pins=lambda pin_path: pytest.fail("the programs stay on lxc-a: so do their pins"),
        holds=lambda pin_path: FakeHolds([]),
        clock=lambda: clock[0],
    )
    assert handback.run() is False  # written
    clock[0] += 30
    assert handback.run() is False  # ended: no flow
    rounds.clear()
    clock[0] += 60
    assert handback.run() is False  # a new flow on the same tuples
    assert rounds[0] == [CLUSTERIP.orig], "the new flow's NAT entry is written"


def test_the_wait_before_a_retry_runs_from_the_end_of_the_try(tmp_path: Path) -> None:
    pins = partial_pins(tmp_path)
    clock = [1000.0]
    tries: list[float] = []

    def detach(netns: str, detached: list[str], between: Callable[[], None]) -> None:
        tries.append(clock[0])
        clock[0] += 50  # a slow walk over the devices (a loaded node)
        eth0_then_none(netns, detached, between)

    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=30),
        read=lambda pin_path: [CLUSTERIP],
        create=lambda netns, flows, timeouts, hold: Created(created=len(list(flows))),
        detach=detach,
        remove_pins=lambda pin_path: pytest.fail("the programs stay on lxc-a: so do their pins"),
        holds=lambda pin_path: FakeHolds([]),
        clock=lambda: clock[0],
    )
    assert handback.run() is False
    ended = clock[0]
    clock[0] = ended + 29
    assert handback.run() is False and len(tries) == 1, "30 s from the end of the try"
    clock[0] = ended + 30
    assert handback.run() is False and len(tries) == 2


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOBUFS, "No buffer space available"),
        NetlinkError(errno.EINTR, "Interrupted system call"),
        RuntimeError("a bug"),
        "marker",
    ],
    ids=["enobufs", "eintr", "other", "marker"],
)
def test_an_error_before_the_detach_is_undone_and_tried_again_later(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: BaseException | str,
) -> None:
    """Only a permission refused ends the hand-back for the agent's life: anything else before
    the detach (ENOBUFS, EINTR, an unwritable lock directory, any other exception) is undone,
    said as itself (not as a missing CAP_BPF) and tried again after the wait."""
    pins = partial_pins(tmp_path)
    clock = [1000.0]
    events: list[str] = []
    fails = [True]

    def create(netns: str, flows: Iterable[NatFlow], timeouts: Timeouts, hold: Holds | None) -> Created:
        if fails and fails.pop() and isinstance(error, BaseException):
            raise error
        return Created(created=len(list(flows)))

    if error == "marker":  # the lock directory refuses the marker once (EACCES: not a capability)
        write_marker = out_of_ebpf._write_marker
        refusals = [OSError(errno.EACCES, "Permission denied")]

        def refusing(path: str, pins: str, detached: list[str]) -> None:
            if refusals:
                raise refusals.pop()
            write_marker(path, pins, detached)

        monkeypatch.setattr(out_of_ebpf, "_write_marker", refusing)
    removed: list[str] = []
    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=30),
        read=lambda pin_path: [CLUSTERIP],
        create=create,
        detach=detaching("eth0"),
        remove_pins=lambda pin_path: removed.append(pin_path) or [],  # type: ignore[func-returns-value]
        holds=lambda pin_path: FakeHolds(events),
        delete=lambda netns, gone: len(gone),
        clock=lambda: clock[0],
    )
    assert handback.run() is False, "tried again"
    assert "undo" in events
    assert "CAP_BPF" not in caplog.text and "tried again in 30 s" in caplog.text
    said = "cannot write" if isinstance(error, str) else str(error.args[-1])
    assert said in caplog.text, "the real error named"
    clock[0] += 30
    assert handback.run() is True
    assert removed == [str(pins)]


@pytest.mark.parametrize("code", [errno.EPERM, errno.EACCES], ids=["EPERM", "EACCES"])
def test_a_permission_refused_before_the_detach_ends_the_hand_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    pins = partial_pins(tmp_path)
    events: list[str] = []
    handback = EbpfHandback(
        Config(netns="node1", pin_path=str(pins), sync_period_s=30),
        read=lambda pin_path: [CLUSTERIP],
        create=lambda netns, flows, timeouts, hold: (_ for _ in ()).throw(OSError(code, os.strerror(code))),
        detach=lambda netns, detached, between: pytest.fail("no detach"),
        remove_pins=lambda pin_path: pytest.fail("the programs stay: so do their pins"),
        holds=lambda pin_path: FakeHolds(events),
        delete=lambda netns, gone: len(gone),
    )
    assert handback.run() is True
    assert "undo" in events and "CAP_BPF" in caplog.text
