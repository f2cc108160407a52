"""agent/takeover/ctmsg.py encodes nfct.replace_flows' requests byte for byte as pyroute2 does
(as nfct.create_flows has pyroute2 encode its creates: the same attributes, nfct._entry)."""

from __future__ import annotations

from typing import Any

import pytest
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_CTNETLINK
from pyroute2.netlink.nfnetlink.nfctsocket import (
    IPCTNL_MSG_CT_DELETE,
    IPCTNL_MSG_CT_NEW,
    NFCTAttrTuple,
    nfct_msg,
)

from agent.takeover import ctmsg
from agent.takeover.flows import NatFlow, SctpState, TcpState, Timeouts, stack_flow
from agent.takeover.nfct import _entry

FLOWS = {
    "tcp": NatFlow(6, ("10.244.1.9", "10.96.0.10", 40000, 80), ("10.244.1.5", "10.244.1.9", 8080, 40000)),
    "tcp-time-wait": NatFlow(
        6,
        ("192.168.0.20", "192.168.0.11", 5555, 30080),
        ("10.244.2.7", "192.168.0.11", 8080, 61000),
        tcp_state=TcpState.TIME_WAIT,
    ),
    "udp": NatFlow(17, ("10.244.1.9", "10.96.0.10", 53000, 53), ("10.244.1.5", "10.244.1.9", 53, 53000)),
    "sctp": NatFlow(
        132,
        ("10.244.1.9", "10.96.0.12", 41500, 5060),
        ("10.244.1.5", "10.244.1.9", 5061, 41500),
        sctp_state=SctpState.ESTABLISHED,
        vtags=(0x5678EF01, 0x1234ABCD),
    ),
    "ipv6": NatFlow(6, ("fd00::9", "fd00:96::a", 40000, 80), ("fd00::5", "fd00::9", 8080, 40000)),
}


def pyroute2(family: int, kind: int, flags: int, seq: int, **attrs: Any) -> bytes:
    msg = nfct_msg.create_from(**attrs)
    msg["nfgen_family"] = family
    msg["header"]["type"] = (NFNL_SUBSYS_CTNETLINK << 8) | kind
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | flags
    msg["header"]["sequence_number"] = seq
    msg.encode()
    return bytes(msg.data)


@pytest.mark.parametrize("flow", list(FLOWS.values()), ids=list(FLOWS))
@pytest.mark.parametrize("plain", [False, True], ids=["nat", "plain"])
def test_the_requests_are_pyroute2s_bytes(flow: NatFlow, plain: bool) -> None:
    flow = stack_flow(flow) if plain else flow
    family, t = ctmsg.family_of(flow), Timeouts()
    s, d, sp, dp = flow.orig
    tuple_orig = NFCTAttrTuple(family=family, saddr=s, daddr=d, proto=flow.proto, sport=sp, dport=dp)
    assert ctmsg.delete_request(7, flow) == pyroute2(
        family, IPCTNL_MSG_CT_DELETE, 0, 7, tuple_orig=tuple_orig
    )
    create = pyroute2(family, IPCTNL_MSG_CT_NEW, NLM_F_EXCL | NLM_F_CREATE, 9, **_entry(flow, t))
    assert ctmsg.create_request(9, flow, t) == create
