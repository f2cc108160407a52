"""nfct.replace_group and its ack reader against a scripted ctnetlink socket: one send(2) per flow,
each flow's failures its own, the acks however the kernel splits them."""

from __future__ import annotations

import errno
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import pytest
from pyroute2.netlink import NLMSG_ERROR
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_CTNETLINK
from pyroute2.netlink.nfnetlink.nfctsocket import IPCTNL_MSG_CT_GET

from agent.takeover import ctmsg
from agent.takeover.flows import NatFlow, TcpState, Timeouts, stack_flow
from agent.takeover.nfct import Replaced, _acks, replace_group
from lab.dplab import BE1, POD_CLIENT, VIP

HEADER = struct.Struct("=IHHII")
GET = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET


def ack(seq: int, err: int) -> bytes:
    """An NLMSG_ERROR for request `seq` (err 0: success), with the request's header echoed."""
    body = struct.pack("=i", -err) + HEADER.pack(16, 0, 0, seq, 0)
    return HEADER.pack(16 + len(body), NLMSG_ERROR, 0, seq, 0) + body


def seqs_of(batch: bytes) -> list[int]:
    seqs, offset = [], 0
    while offset < len(batch):
        length, _kind, _flags, seq, _pid = HEADER.unpack_from(batch, offset)
        seqs.append(seq)
        offset += (length + 3) & ~3
    return seqs


class ScriptedSock:
    """Answers each send with what `answer(flow number, the send's sequence numbers)` gives: the
    datagrams recv returns, or an exception recv raises."""

    def __init__(self, answer: Callable[[int, list[int]], list[bytes | Exception]]) -> None:
        self.answer = answer
        self.get_answer: Callable[[int], list[bytes | Exception]] = lambda seq: [ack(seq, errno.ENOENT)]
        self.gets: list[int] = []
        self.sent: list[list[int]] = []
        self.batches: list[bytes] = []
        self.queue: deque[bytes | Exception] = deque()

    def send(self, data: bytes, /) -> int:
        seqs = seqs_of(data)
        if HEADER.unpack_from(data)[1] == GET:  # a TCP flow's state read before its batch
            self.gets.append(seqs[0])
            self.queue.extend(self.get_answer(seqs[0]))
            return len(data)
        self.sent.append(seqs)
        self.batches.append(data)
        self.queue.extend(self.answer(len(self.sent) - 1, seqs))
        return len(data)

    def recv(self, size: int, /) -> bytes:
        item = self.queue.popleft() if self.queue else TimeoutError("timed out")
        if isinstance(item, Exception):
            raise item
        return item


FLOWS = [NatFlow(6, (POD_CLIENT, VIP, 40000 + i, 80), (BE1, POD_CLIENT, 8080, 40000 + i)) for i in range(6)]


def run(sock: ScriptedSock, flows: list[NatFlow]) -> tuple[Replaced, list[str]]:
    done, events = Replaced(), []
    replace_group(
        sock,
        socket.AF_INET,
        flows,
        stack_flow,
        Timeouts(),
        done,
        before=lambda f: events.append(f"before {f.orig[2]}"),
        after=lambda f: events.append(f"after {f.orig[2]}"),
    )
    return done, events


def test_each_flow_is_one_send_of_three_requests_and_its_failures_are_its_own() -> None:
    """A delete refused (EBUSY), acks that never come (the 5 s timeout), a socket overrun (ENOBUFS)
    and a create refused otherwise: each fails its flow only; the next flows are replaced, and a
    late ack of a timed-out flow is not taken for the next one's."""

    def answer(n: int, seqs: list[int]) -> list[bytes | Exception]:
        a, b, c = seqs
        if n == 0:  # its NAT entry could not be deleted
            return [ack(a, errno.EBUSY) + ack(b, errno.ENOENT) + ack(c, errno.EEXIST)]
        if n == 1:  # no ack within the wait: they come after, with the next flow's
            return [TimeoutError("timed out")]
        if n == 2:  # flow 1's late acks first, saying success, then flow 2's, in two datagrams
            late = [s - 4 for s in seqs]  # flow 1's: each flow takes 4 numbers (its state read)
            return [
                b"".join(ack(s, 0) for s in late) + ack(a, 0),
                ack(b, errno.ENOENT) + ack(c, errno.ENOMEM),
            ]
        if n == 3:
            return [OSError(errno.ENOBUFS, "No buffer space available")]
        return [ack(a, 0) + ack(b, 0) + ack(c, 0)]

    sock = ScriptedSock(answer)
    done, events = run(sock, FLOWS)
    assert [len(s) for s in sock.sent] == [3] * 6 and len({s for seqs in sock.sent for s in seqs}) == 18
    assert events == [e for f in FLOWS for e in (f"before {f.orig[2]}", f"after {f.orig[2]}")]
    # flow 2's NAT entry went before its create failed
    assert (done.retired, done.stray, done.made.created, done.made.present) == (3, 2, 2, 0)
    failed = done.made.failed
    assert len(failed) == 4
    assert "its NAT entry not deleted: Device or resource busy" in failed[0]
    assert "acks could not be read (timed out)" in failed[1]
    assert "Cannot allocate memory" in failed[2]
    assert "No buffer space available" in failed[3]


def test_no_net_admin_stops_at_the_first_flow() -> None:
    sock = ScriptedSock(lambda n, seqs: [b"".join(ack(s, errno.EPERM) for s in seqs)])
    with pytest.raises(PermissionError):
        run(sock, FLOWS)
    assert len(sock.sent) == 1


def test_a_later_eperm_fails_that_flow_only() -> None:
    sock = ScriptedSock(lambda n, seqs: [b"".join(ack(s, errno.EPERM if n == 1 else 0) for s in seqs)])
    done, _ = run(sock, FLOWS[:3])
    assert done.made.created == 2 and len(done.made.failed) == 1


def test_the_acks_are_read_over_several_datagrams_other_messages_skipped() -> None:
    sock = ScriptedSock(lambda n, seqs: [])
    sock.queue.extend(
        [ack(7, 0), HEADER.pack(16, 3, 0, 8, 0) + ack(8, errno.ENOENT), ack(99, 0) + ack(9, errno.EEXIST)]
    )
    assert _acks(sock, (7, 8, 9)) == {7: 0, 8: errno.ENOENT, 9: errno.EEXIST}


@pytest.mark.parametrize(
    "data",
    [HEADER.pack(40, NLMSG_ERROR, 0, 1, 0) + b"\0" * 4, HEADER.pack(18, NLMSG_ERROR, 0, 1, 0) + b"\0" * 4],
    ids=["longer-than-the-datagram", "ack-without-its-errno"],
)
def test_a_malformed_ack_is_a_value_error(data: bytes) -> None:
    sock = ScriptedSock(lambda n, seqs: [])
    sock.queue.append(data)
    with pytest.raises(ValueError):
        _acks(sock, (1,))


def test_a_create_refused_with_eexist_is_counted_apart() -> None:
    sock = ScriptedSock(
        lambda n, seqs: [ack(seqs[0], 0) + ack(seqs[1], errno.ENOENT) + ack(seqs[2], errno.EEXIST)]
    )
    done, _ = run(sock, FLOWS[:1])
    assert done.refused == [stack_flow(FLOWS[0])] and (
        done.retired,
        done.made.present,
        done.made.created,
    ) == (1, 0, 0)


def test_a_tcp_flow_is_made_in_the_state_netfilter_holds_now() -> None:
    """The dump said ESTABLISHED; while the flow waited (NFPASS) netfilter saw it close: the plain
    entry is created in TIME_WAIT (its timeout that state's), not ESTABLISHED for a day."""
    flow = FLOWS[0]
    assert flow.tcp_state == TcpState.ESTABLISHED
    now = ctmsg.create_request(0, replace(flow, tcp_state=TcpState.TIME_WAIT), Timeouts())
    sock = ScriptedSock(lambda n, seqs: [b"".join(ack(s, 0) for s in seqs)])
    sock.get_answer = lambda seq: [HEADER.pack(len(now), 0, 0, seq, 0) + now[HEADER.size :] + ack(seq, 0)]
    done, _ = run(sock, [flow])
    assert sock.gets == [1] and sock.sent == [[2, 3, 4]] and done.moved_on == 1
    created = sock.batches[0]
    offset = 0
    for _ in range(2):  # past the two deletes
        offset += (HEADER.unpack_from(created, offset)[0] + 3) & ~3
    assert ctmsg.tcp_state_of(created[offset:]) == TcpState.TIME_WAIT
    assert ctmsg.tcp_state_of(now) == TcpState.TIME_WAIT


def test_no_net_admin_to_read_the_first_flow_stops_too() -> None:
    sock = ScriptedSock(lambda n, seqs: [])
    sock.get_answer = lambda seq: [ack(seq, errno.EPERM)]
    with pytest.raises(PermissionError):
        run(sock, FLOWS)
    assert sock.gets == [1] and sock.sent == []


def test_requests_that_get_no_answer_three_times_in_a_row_end_the_pass() -> None:
    """A socket whose answers stopped coming would cost ACK_WAIT_S for every flow left while the
    waiting flows' holds run out: three timeouts in a row end the pass as a socket failure (the
    caller releases the rest); one now and then only fails its flow."""
    timeouts = {1, 3, 4, 5}

    def answer(n: int, seqs: list[int]) -> list[bytes | Exception]:
        if n in timeouts:
            return [TimeoutError("timed out")]
        return [b"".join(ack(s, 0) for s in seqs)]

    sock = ScriptedSock(answer)
    with pytest.raises(OSError, match="3 ctnetlink requests in a row got no answer"):
        run(sock, FLOWS)
    assert len(sock.sent) == 6  # flow 1 alone failed; 3, 4, 5 in a row ended it
