"""The socket programs (bpf/ekp_sock.h): connect4, sendmsg4, recvmsg4, getpeername4 and the UDP socket
iterator, with real sockets of processes in a lab node's cgroup.

BPF_PROG_TEST_RUN does not run cgroup sock_addr programs (the kernel has no test_run for them), so
these stand where the tc programs have their packet fixtures: the real data path is compiled and
loaded with its maps pinned in a throwaway bpffs, its socket programs linked to the lab node's
cgroup (never the machine's), the maps written by hand (lab/dplab.py add_service), and a client
(lab/client.py) run in the node's namespace and cgroup, or in a pod's, dials. One node, two pods with
podservers (HTTP 8080, UDP echo 9000); no tc program is attached, so what is translated here is the
socket programs' doing alone.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from agent.ebpf import abi
from agent.ebpf.abi import CALLS, OUTCOMES, BackendFlag, FrontendFlag, Stat, ip_be, port_be
from agent.ebpf.loader import Datapath
from agent.ebpf.maps import read_stats, write_config
from agent.ebpf.programs import PROG_SOCK_TERM, SOCK_HOOKS
from agent.ebpf.sockattach import SocketAttacher, detach_all, netns_cookie, sock_config
from agent.ebpf.sockterm import SocketTerminator
from lab import Lab
from lab.dplab import CFG, SIZES, TCP, TEST_ROLES, UDP, add_service, add_service6
from lab.harness import CLIENT
from lab.packets import loaded_datapath

pytestmark = pytest.mark.kernel

VIP = "10.96.0.10"
NODE_IP = "192.168.0.11"


@dataclass
class SockLab:
    lab: Lab
    dp: Datapath
    cookie: int  # the node namespace's

    @property
    def maps(self) -> Any:
        return self.dp.maps

    def settings(self, *, host_only: bool) -> None:
        self.maps["skcfg"].update(ctypes.c_uint32(0), sock_config(self.cookie, host_only))

    def client(self, where: str, *args: str, timeout: float = 30.0) -> dict[str, Any]:
        res = self.lab.run(where, sys.executable, CLIENT, *args, timeout=timeout)
        out: dict[str, Any] = json.loads(res.stdout)
        return out

    def stats(self) -> dict[Stat, int]:
        return read_stats(self.maps["stats"])

    def pod_ip(self, name: str) -> str:
        return self.lab.pod(name).ip


@pytest.fixture(scope="module")
def socklab(lab1: Lab) -> Iterator[SockLab]:
    with loaded_datapath(SIZES) as dp:
        node = lab1.node(1)
        assert node.cgroup_root is not None
        fds = {name: dp.prog_fd(name) for name, _ in SOCK_HOOKS.values()}
        SocketAttacher(dp.pin_path, node.cgroup_root, fds).reconcile()
        try:
            yield SockLab(lab1, dp, netns_cookie(node.ns))
        finally:
            detach_all(dp.pin_path)


@pytest.fixture
def sl(socklab: SockLab) -> Iterator[SockLab]:
    """Empty maps, the node's address in the config, node sockets only; the counters balanced after."""
    for role in (*TEST_ROLES, "sknat"):
        socklab.maps[role].clear()
    write_config(socklab.maps, abi.Config.from_buffer_copy(bytes(CFG)))
    socklab.settings(host_only=True)
    yield socklab
    stats = socklab.stats()
    assert sum(stats[s] for s in CALLS) == sum(stats[s] for s in OUTCOMES), stats


def two_backends(sl: SockLab, proto: int = TCP, port: int = 80, target: int = 8080, **kw: Any) -> None:
    backends = (
        (1, sl.pod_ip("pod-1-1"), target, BackendFlag.LOCAL),
        (2, sl.pod_ip("pod-1-2"), target, BackendFlag.LOCAL),
    )
    add_service(sl.maps, VIP, port, backends, proto=proto, **kw)


def test_connect_goes_to_a_backend_and_getpeername_shows_the_cluster_ip(sl: SockLab) -> None:
    two_backends(sl)
    seen = set()
    for _ in range(12):
        out = sl.client("node1", "peer", "--addr", VIP, "--port", "80")
        assert out["peer"] == f"{VIP}:80", out  # getpeername: the address the client dialled
        seen.add(out["body"])
    assert seen == {"pod-1-1", "pod-1-2"}  # each connect() chooses (random slot)
    stats = sl.stats()
    assert stats[Stat.SOCK_TRANSLATED] == 12 and stats[Stat.SOCK_REVNAT] >= 12
    assert sl.maps["sknat"].items() == []  # each client closed its socket: sock_release took its entry


def test_addresses_that_are_not_frontends_are_left_alone(sl: SockLab) -> None:
    two_backends(sl)
    out = sl.client("node1", "peer", "--addr", sl.pod_ip("pod-1-2"), "--port", "8080")
    assert out == {"peer": f"{sl.pod_ip('pod-1-2')}:8080", "body": "pod-1-2"}
    assert sl.stats()[Stat.SOCK_PASS] >= 1 and sl.stats()[Stat.SOCK_TRANSLATED] == 0


def test_udp_replies_come_from_the_cluster_ip_and_a_socket_keeps_its_backend(sl: SockLab) -> None:
    """recvmsg4: an unconnected socket's sendto(VIP) goes to a backend, recvfrom() names the VIP;
    every datagram of one socket goes to one backend (sendmsg4 chooses by socket), new sockets spread."""
    two_backends(sl, UDP, 90, 9000)
    out = sl.client("node1", "udp", "--addr", VIP, "--port", "90", "--count", "20", "--sources")
    assert out["sources"] == {f"{VIP}:90": 20} and out["lost"] == 0
    assert set(out["replies"]) == {"pod-1-1", "pod-1-2"}  # 20 sockets, each choosing
    assert sl.stats()[Stat.SOCK_REVNAT] == 20


def test_one_unconnected_udp_socket_stays_on_one_backend(sl: SockLab) -> None:
    two_backends(sl, UDP, 90, 9000)
    code = (
        "import socket, json\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)\n"
        "seen = []\n"
        "for i in range(10):\n"
        f"    s.sendto(b'x%d' % i, ('{VIP}', 90)); data, src = s.recvfrom(100)\n"
        "    seen.append([data.decode().split()[0], '%s:%d' % src])\n"
        "print(json.dumps(seen))\n"
    )
    seen = json.loads(sl.lab.run("node1", sys.executable, "-c", code).stdout)
    assert len({name for name, _ in seen}) == 1 and {src for _, src in seen} == {f"{VIP}:90"}


def test_no_endpoints_refuses_at_connect_and_sendmsg(sl: SockLab) -> None:
    """kube-proxy's REJECT for a service without endpoints: ECONNREFUSED, at once."""
    add_service(sl.maps, VIP, 80, (), count=0, flags=FrontendFlag.NO_ENDPOINTS)
    add_service(sl.maps, VIP, 90, (), proto=UDP, count=0, flags=FrontendFlag.NO_ENDPOINTS, svc_id=2, set_id=2)
    started = time.monotonic()
    assert sl.client("node1", "peer", "--addr", VIP, "--port", "80") == {"error": "ECONNREFUSED"}
    assert time.monotonic() - started < 2.0
    code = f"import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('{VIP}', 90))\n"
    res = sl.lab.run("node1", sys.executable, "-c", code, check=False)
    assert "ConnectionRefusedError" in res.stderr
    assert sl.stats()[Stat.DROP_NO_ENDPOINTS] == 2


def test_local_policy_without_local_endpoints_fails_unreachable(sl: SockLab) -> None:
    """kube-proxy drops ("has no local endpoints"); a socket learns it at once: EHOSTUNREACH."""
    add_service(sl.maps, VIP, 80, (), count=0, flags=FrontendFlag.LOCAL)
    assert sl.client("node1", "peer", "--addr", VIP, "--port", "80") == {"error": "EHOSTUNREACH"}
    assert sl.stats()[Stat.DROP_NO_LOCAL] == 1


def test_source_ranges_check_the_node_address(sl: SockLab) -> None:
    """An LB frontend with loadBalancerSourceRanges: the node's address (an unbound socket's client)
    is checked against the ranges, as kube-proxy checks the node's source in KUBE-PROXY-FIREWALL."""
    two_backends(sl, flags=FrontendFlag.SOURCE_RANGES | FrontendFlag.LOADBALANCER)
    key = abi.SrcRangeKey(prefixlen=32 + 24, rev_nat_id=1, addr=ip_be("192.168.0.0"))
    sl.maps["srcr"].update(key, abi.SrcRange(allow=1))
    assert sl.client("node1", "peer", "--addr", VIP, "--port", "80")["peer"] == f"{VIP}:80"
    sl.maps["srcr"].clear()
    sl.maps["srcr"].update(
        abi.SrcRangeKey(prefixlen=32 + 8, rev_nat_id=1, addr=ip_be("10.0.0.0")), abi.SrcRange(allow=1)
    )
    assert sl.client("node1", "peer", "--addr", VIP, "--port", "80") == {"error": "EHOSTUNREACH"}
    assert sl.stats()[Stat.DROP_SOURCE_RANGE] == 1


def test_affinity_keeps_the_node_on_one_backend(sl: SockLab) -> None:
    two_backends(sl, flags=FrontendFlag.AFFINITY, affinity_timeout=600)
    bodies = {sl.client("node1", "peer", "--addr", VIP, "--port", "80")["body"] for _ in range(8)}
    assert len(bodies) == 1
    (key,) = sl.maps["aff"].keys()
    assert key == abi.AffinityKey(client=ip_be(NODE_IP), svc_id=1)  # the node's address is the client
    assert sl.stats()[Stat.AFFINITY_HIT] == 7


def test_pods_sockets_only_when_not_host_namespace_only(sl: SockLab) -> None:
    """hostNamespaceOnly: a pod's connect() is left to the packet path (nothing attached here on
    tc: it times out); otherwise translated, except frontends that need the pod's address."""
    two_backends(sl)
    add_service(
        sl.maps,
        VIP,
        81,
        ((3, sl.pod_ip("pod-1-2"), 8080, BackendFlag.LOCAL),),
        flags=FrontendFlag.AFFINITY,
        affinity_timeout=600,
        svc_id=2,
        set_id=2,
        rev_nat_id=2,
    )
    timed_out = {"error": "TimeoutError"}
    assert sl.client("pod-1-1", "peer", "--addr", VIP, "--port", "80", "--timeout", "1") == timed_out
    sl.settings(host_only=False)
    out = sl.client("pod-1-1", "peer", "--addr", VIP, "--port", "80")
    assert out["peer"] == f"{VIP}:80" and out["body"] in ("pod-1-1", "pod-1-2")
    assert sl.client("pod-1-1", "peer", "--addr", VIP, "--port", "81", "--timeout", "1") == timed_out


def test_the_nodes_own_sockets_take_the_host_scope_frontend_where_flagged(sl: SockLab) -> None:
    """An ETP Local NodePort with no local-traffic detector: its INTERNAL frontend (local set:
    pod-1-1 here) carries HOST_SCOPE, and the node's own sockets take the HOST frontend at the same
    key (the cluster set: pod-1-2 here), as kube-proxy's `--src-type LOCAL -j KUBE-SVC-*`; a pod's
    socket keeps the INTERNAL one."""
    local = FrontendFlag.NODEPORT | FrontendFlag.LOCAL
    one = ((1, sl.pod_ip("pod-1-1"), 8080, BackendFlag.LOCAL),)
    add_service(sl.maps, NODE_IP, 30090, one, flags=local | FrontendFlag.HOST_SCOPE, set_id=2, rev_nat_id=2)
    other = ((2, sl.pod_ip("pod-1-2"), 8080, BackendFlag.LOCAL),)
    add_service(
        sl.maps, NODE_IP, 30090, other, flags=FrontendFlag.NODEPORT, scope=abi.Scope.HOST, rev_nat_id=2
    )
    sl.settings(host_only=False)
    for _ in range(4):
        assert sl.client("node1", "peer", "--addr", NODE_IP, "--port", "30090")["body"] == "pod-1-2"
        assert sl.client("pod-1-1", "peer", "--addr", NODE_IP, "--port", "30090")["body"] == "pod-1-1"


def test_localhost_frontends_serve_the_node_namespace_alone(sl: SockLab) -> None:
    """localhost:<nodePort> is the node's localhost only in the node's namespace: a pod's 127.0.0.1
    is its own, never translated (with pods' sockets translated too)."""
    add_service(sl.maps, "127.0.0.1", 30080, ((1, sl.pod_ip("pod-1-2"), 8080, BackendFlag.LOCAL),))
    sl.settings(host_only=False)
    out = sl.client("node1", "peer", "--addr", "127.0.0.1", "--port", "30080")
    assert out == {"peer": "127.0.0.1:30080", "body": "pod-1-2"}
    assert sl.client("pod-1-1", "peer", "--addr", "127.0.0.1", "--port", "30080") == {"error": "ECONNREFUSED"}


def test_the_iterator_ends_connected_udp_sockets_of_a_backend_that_left(sl: SockLab) -> None:
    """A connected UDP socket sent to backend pod-1-1 keeps it after connect(); when pod-1-1 leaves
    the service port (its membership goes), the iterator ends the socket (ECONNABORTED) and the
    client's new socket goes to pod-1-2. A socket connected to the pod directly is left alone."""
    add_service(sl.maps, VIP, 90, ((1, sl.pod_ip("pod-1-1"), 9000, BackendFlag.LOCAL),), proto=UDP)
    assert sl.lab.tmpdir is not None
    stop, ready = sl.lab.tmpdir / "resolver-stop", sl.lab.tmpdir / "resolver-ready"
    direct_stop, direct_ready = sl.lab.tmpdir / "direct-stop", sl.lab.tmpdir / "direct-ready"
    for f in (stop, ready, direct_stop, direct_ready):
        f.unlink(missing_ok=True)
    args = ["--port", "90", "--interval", "0.02", "--timeout", "1", "--max-s", "60"]
    via_vip = sl.lab.popen(
        "node1",
        sys.executable,
        CLIENT,
        "resolver",
        "--addr",
        VIP,
        *args,
        "--stop-file",
        str(stop),
        "--ready-file",
        str(ready),
        stdout=subprocess.PIPE,
    )
    direct = sl.lab.popen(
        "node1",
        sys.executable,
        CLIENT,
        "resolver",
        "--addr",
        sl.pod_ip("pod-1-1"),
        "--port",
        "9000",
        "--interval",
        "0.02",
        "--timeout",
        "1",
        "--max-s",
        "60",
        "--stop-file",
        str(direct_stop),
        "--ready-file",
        str(direct_ready),
        stdout=subprocess.PIPE,
    )
    deadline = time.monotonic() + 10
    while not (ready.exists() and direct_ready.exists()):
        assert time.monotonic() < deadline, "the clients got no first answer"
        time.sleep(0.02)
    ended = lambda: read_stats(sl.maps["stats"])[Stat.SOCK_DESTROYED]  # noqa: E731
    node = sl.lab.node(1)
    assert node.cgroup_root is not None
    term = SocketTerminator(sl.dp.prog_fd(PROG_SOCK_TERM), node.ns, node.cgroup_root, pods=False, ended=ended)
    try:
        assert term.run() == 0  # pod-1-1 serves: nothing to end
        # pod-1-2 joins, pod-1-1 leaves (as the planner writes it: slots first, membership last)
        sl.maps["be"].update(
            abi.BackendKey(2), abi.Backend(ip_be(sl.pod_ip("pod-1-2")), port_be(9000), UDP, 1)
        )
        sl.maps["member"].update(abi.MemberKey(1, 2), abi.Member(flags=abi.MemberFlag.CLUSTER))
        sl.maps["slot"].update(abi.SlotKey(1, 1), abi.Slot(2))
        sl.maps["member"].delete(abi.MemberKey(1, 1))
        time.sleep(0.2)
        assert term.run() == 1
        time.sleep(0.3)
    finally:
        term.close()
        stop.touch()
        direct_stop.touch()
    out = json.loads(via_vip.communicate(timeout=30)[0])
    kept = json.loads(direct.communicate(timeout=30)[0])
    # bpf_sock_destroy disconnects the socket with ECONNABORTED pending: a receive reports that, a
    # send first finds the socket unconnected (EDESTADDRREQ); either way the client takes a new one
    assert sum(out["failures"].values()) == 1 and out["sockets"] == 2, out
    assert set(out["failures"]) <= {"ECONNABORTED", "EDESTADDRREQ"}, out
    assert set(out["answers"]) == {"pod-1-1", "pod-1-2"}
    assert out["longest_gap"] < 1.0, out  # no lookup waited for a timeout
    assert kept["failures"] == {} and kept["sockets"] == 1 and set(kept["answers"]) == {"pod-1-1"}, kept


def test_the_iterator_walks_pods_namespaces_when_pods_are_balanced_too(sl: SockLab) -> None:
    """Without hostNamespaceOnly a pod's connected UDP socket is translated at connect() too: ending
    it when its backend leaves means walking the pod's network namespace (found through the
    processes of the attached cgroup); the node's namespace alone does not hold it."""
    sl.settings(host_only=False)
    add_service(sl.maps, VIP, 90, ((1, sl.pod_ip("pod-1-2"), 9000, BackendFlag.LOCAL),), proto=UDP)
    assert sl.lab.tmpdir is not None
    stop, ready = sl.lab.tmpdir / "pod-resolver-stop", sl.lab.tmpdir / "pod-resolver-ready"
    for f in (stop, ready):
        f.unlink(missing_ok=True)
    proc = sl.lab.popen(
        "pod-1-1",
        sys.executable,
        CLIENT,
        "resolver",
        "--addr",
        VIP,
        "--port",
        "90",
        "--interval",
        "0.02",
        "--timeout",
        "1",
        "--max-s",
        "60",
        "--stop-file",
        str(stop),
        "--ready-file",
        str(ready),
        stdout=subprocess.PIPE,
    )
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert time.monotonic() < deadline, "the pod's client got no first answer"
        time.sleep(0.02)
    node = sl.lab.node(1)
    assert node.cgroup_root is not None

    def terminator(pods: bool) -> SocketTerminator:
        ended = lambda: read_stats(sl.maps["stats"])[Stat.SOCK_DESTROYED]  # noqa: E731
        return SocketTerminator(
            sl.dp.prog_fd(PROG_SOCK_TERM), node.ns, node.cgroup_root or "", pods=pods, ended=ended
        )

    node_only, with_pods = terminator(False), terminator(True)
    try:
        pod1 = abi.Backend(ip_be(sl.pod_ip("pod-1-1")), port_be(9000), UDP, BackendFlag.LOCAL)
        sl.maps["be"].update(abi.BackendKey(2), pod1)
        sl.maps["member"].update(abi.MemberKey(1, 2), abi.Member(flags=abi.MemberFlag.CLUSTER))
        sl.maps["slot"].update(abi.SlotKey(1, 1), abi.Slot(2))
        sl.maps["member"].delete(abi.MemberKey(1, 1))
        assert node_only.run() == 0
        assert with_pods.run() == 1
        time.sleep(0.3)
    finally:
        node_only.close()
        with_pods.close()
        stop.touch()
    out = json.loads(proc.communicate(timeout=30)[0])
    assert set(out["answers"]) == {"pod-1-2", "pod-1-1"} and out["sockets"] == 2, out


def test_ipv4_addresses_on_ipv6_sockets_are_translated_too(sl: SockLab) -> None:
    """An IPv6 socket dials an IPv4 address as ::ffff:a.b.c.d (Java's default, dual-stack servers):
    connect6/sendmsg6 send it to a backend, getpeername6/recvmsg6 show the ClusterIP, mapped."""
    two_backends(sl)
    add_service(
        sl.maps, VIP, 90, ((3, sl.pod_ip("pod-1-2"), 9000, BackendFlag.LOCAL),), proto=UDP, svc_id=2, set_id=2
    )
    code = (
        "import json, socket\n"
        "t = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); t.settimeout(3)\n"
        f"t.connect(('::ffff:{VIP}', 80)); peer = t.getpeername()[:2]\n"
        "t.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); body = b''\n"
        "while (c := t.recv(4096)): body += c\n"
        "u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.settimeout(3)\n"
        f"u.sendto(b'x', ('::ffff:{VIP}', 90)); data, src = u.recvfrom(100)\n"
        "print(json.dumps([list(peer), body.split(b'\\r\\n\\r\\n')[1].decode().strip(), list(src[:2]),"
        " data.decode().split()[0]]))\n"
    )
    peer, body, src, echoed = json.loads(sl.lab.run("node1", sys.executable, "-c", code).stdout)
    assert peer == [f"::ffff:{VIP}", 80] and body in ("pod-1-1", "pod-1-2")
    assert src == [f"::ffff:{VIP}", 90] and echoed == "pod-1-2"
    stats = sl.stats()
    assert stats[Stat.SOCK_TRANSLATED] == 2 and stats[Stat.SOCK_REVNAT] >= 2


# Connects `n` TCP sockets and one connected UDP socket (VIP:90) through the frontend, closes every
# other TCP socket and the UDP one, prints their cookies (SO_COOKIE, what ekp_sknat is keyed by) and
# what getpeername() shows for the open ones, then holds the open ones until stdin closes (at most
# 30 s). An IPv6 socket dialling the v4-mapped VIP is closed too (sock_release for AF_INET6).
HOLD = """
import json, select, socket, sys
SO_COOKIE = 57
def cookie(s):
    return int.from_bytes(s.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8), "little")
vip, n = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.socket(); s.settimeout(3); s.connect((vip, 80)); socks.append(s)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.connect((vip, 90))
s6 = socket.socket(socket.AF_INET6); s6.settimeout(3); s6.connect(("::ffff:" + vip, 80))
closed = [cookie(s) for s in socks[::2]] + [cookie(u), cookie(s6)]
for s in socks[::2] + [u, s6]:
    s.close()
live = socks[1::2]
print(json.dumps({"closed": closed, "open": [cookie(s) for s in live],
                  "peers": sorted({"%s:%d" % s.getpeername() for s in live})}), flush=True)
select.select([sys.stdin], [], [], 30)
"""


def test_a_closed_socket_leaves_no_entry_and_open_ones_keep_the_cluster_ip(sl: SockLab) -> None:
    """sock_release: the entry a socket left in ekp_sknat goes when it is closed (TCP, connected UDP,
    an IPv6 socket on a v4-mapped address), so the table holds the open sockets, not every socket
    that ever dialled a frontend (a full LRU makes every connect() evict); the open ones still show
    the ClusterIP to getpeername()."""
    two_backends(sl)
    add_service(
        sl.maps, VIP, 90, ((3, sl.pod_ip("pod-1-2"), 9000, BackendFlag.LOCAL),), proto=UDP, svc_id=2, set_id=2
    )
    proc = sl.lab.popen(
        "node1", sys.executable, "-c", HOLD, VIP, "20", stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        held = json.loads(proc.stdout.readline())
        entries = sl.maps["sknat"].items()
        assert sorted(k.cookie for k, _ in entries) == sorted(held["open"])  # none of the 12 closed
        assert all(v.fe_addr == ip_be(VIP) and v.fe_port == port_be(80) for _, v in entries)
        assert held["peers"] == [f"{VIP}:80"] and len(held["closed"]) == 12
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    assert len(sl.maps["sknat"].items()) == 0
    stats = sl.stats()
    assert stats[Stat.SOCK_TRANSLATED] == 22 and stats[Stat.SOCK_REVNAT] >= 10


# Real IPv6 frontends. The node's namespace holds the backends itself: two ULA addresses on its
# loopback, each with a TCP server (8080: answers its name) and a UDP echo (9000: its name and the
# datagram), so no IPv6 is needed in the lab's links; the frontends are in no device at all.
VIP6 = "fd00:10:96::a"
BACKENDS6 = ("fd00:10:99::1", "fd00:10:99::2")
SERVERS6 = r"""
import socket, sys, threading
def tcp(srv, name):
    while True:
        conn, _ = srv.accept(); conn.sendall(name.encode()); conn.close()
def udp(s, name):
    while True:
        data, peer = s.recvfrom(100); s.sendto(name.encode() + b" " + data, peer)
for i, addr in enumerate(sys.argv[1:], 1):
    srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); srv.bind((addr, 8080)); srv.listen(64)
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); s.bind((addr, 9000))
    threading.Thread(target=tcp, args=(srv, "be%d" % i), daemon=True).start()
    threading.Thread(target=udp, args=(s, "be%d" % i), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def v6(sl: SockLab) -> Iterator[SockLab]:
    """`sl` with BACKENDS6 on the node's loopback, served (SERVERS6), until the test ends."""
    for addr in BACKENDS6:
        sl.lab.run("node1", "ip", "-6", "addr", "add", f"{addr}/128", "dev", "lo", "nodad")
    proc = sl.lab.popen(
        "node1", sys.executable, "-c", SERVERS6, *BACKENDS6, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == b"ready"
        yield sl
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
        for addr in BACKENDS6:
            sl.lab.run("node1", "ip", "-6", "addr", "del", f"{addr}/128", "dev", "lo")


def two_backends6(
    sl: SockLab, proto: int = TCP, port: int = 80, target: int = 8080, svc_id: int = 1, **kw: Any
) -> None:
    """BACKENDS6 behind [VIP6]:port, backend ids 10 * svc_id + 1, 2 (one pair per service port)."""
    backends = tuple(
        (10 * svc_id + i, addr, target, int(BackendFlag.LOCAL)) for i, addr in enumerate(BACKENDS6, 1)
    )
    add_service6(sl.maps, VIP6, port, backends, proto=proto, svc_id=svc_id, **kw)


def run6(sl: SockLab, code: str) -> Any:
    return json.loads(sl.lab.run("node1", sys.executable, "-c", code).stdout)


def test_a_real_ipv6_cluster_ip_is_translated_counted_and_shown_back(v6: SockLab) -> None:
    """connect6 sends each TCP socket to a backend (both are chosen over twelve), getpeername6
    shows the ClusterIP; sendmsg6 sends an unconnected UDP socket's datagrams to one backend and
    recvmsg6 names the ClusterIP as their source; the counters count each call once; the closed
    sockets left no ekp_sknat6 entry (sock_release), and no IPv4 map was read for them."""
    two_backends6(v6)
    two_backends6(v6, UDP, 90, 9000, svc_id=2, set_id=2, rev_nat_id=2)
    code = (
        "import json, socket\n"
        "peers, bodies = set(), set()\n"
        "for _ in range(12):\n"
        "    t = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); t.settimeout(3)\n"
        f"    t.connect(('{VIP6}', 80)); peers.add('[%s]:%d' % t.getpeername()[:2])\n"
        "    bodies.add(t.recv(100).decode()); t.close()\n"
        "u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.settimeout(3)\n"
        "srcs, names = set(), set()\n"
        "for i in range(5):\n"
        f"    u.sendto(b'x%d' % i, ('{VIP6}', 90)); data, src = u.recvfrom(100)\n"
        "    srcs.add('[%s]:%d' % src[:2]); names.add(data.decode().split()[0])\n"
        "print(json.dumps([sorted(peers), sorted(bodies), sorted(srcs), sorted(names)]))\n"
    )
    peers, bodies, srcs, names = run6(v6, code)
    assert peers == [f"[{VIP6}]:80"] and bodies == ["be1", "be2"]
    assert srcs == [f"[{VIP6}]:90"] and len(names) == 1, "one unconnected socket, one backend"
    stats = v6.stats()
    # and the servers' five replies (sendmsg6 to the client's own address: passed)
    assert stats[Stat.SOCK_CALLS] == 22 and stats[Stat.SOCK_TRANSLATED] == 17 and stats[Stat.SOCK_PASS] == 5
    assert stats[Stat.SOCK_REVNAT] >= 17
    # the TCP sockets' entries went with them; the unconnected UDP socket's one stays (the LRU's)
    assert [k.proto for k, _ in v6.maps["sknat6"].items()] == [UDP]
    assert v6.maps["sknat"].items() == []


# Connects one TCP socket and one UDP socket to the IPv6 ClusterIP and holds them until stdin closes,
# printing their cookies: what ekp_sknat6 holds for them while they are open.
HOLD6 = """
import json, select, socket, sys
def cookie(s):
    return int.from_bytes(s.getsockopt(socket.SOL_SOCKET, 57, 8), "little")
t = socket.socket(socket.AF_INET6); t.settimeout(3); t.connect((sys.argv[1], 80))
u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.connect((sys.argv[1], 90))
print(json.dumps({"tcp": cookie(t), "udp": cookie(u), "peer": "[%s]:%d" % u.getpeername()[:2]}), flush=True)
select.select([sys.stdin], [], [], 30)
"""


def test_an_open_ipv6_socket_keeps_its_entry_and_a_closed_one_leaves_none(v6: SockLab) -> None:
    two_backends6(v6)
    two_backends6(v6, UDP, 90, 9000, svc_id=2, set_id=2, rev_nat_id=2)
    proc = v6.lab.popen(
        "node1", sys.executable, "-c", HOLD6, VIP6, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        held = json.loads(proc.stdout.readline())
        entries = {k.cookie: (k, v) for k, v in v6.maps["sknat6"].items()}
        assert sorted(entries) == sorted([held["tcp"], held["udp"]])
        vip = abi.ip6_words(VIP6)
        assert all(tuple(v.fe_addr) == vip for _, v in entries.values())
        assert {abi.ip6_str(k.addr) for k, _ in entries.values()} <= set(BACKENDS6)
        assert held["peer"] == f"[{VIP6}]:90"
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    assert v6.maps["sknat6"].items() == []


def test_an_ipv6_cluster_ip_without_endpoints_refuses_at_connect_and_sendmsg(v6: SockLab) -> None:
    add_service6(v6.maps, VIP6, 80, (), count=0, flags=FrontendFlag.NO_ENDPOINTS)
    add_service6(
        v6.maps, VIP6, 90, (), proto=UDP, count=0, flags=FrontendFlag.NO_ENDPOINTS, svc_id=2, set_id=2
    )
    code = (
        "import json, socket, time\n"
        "out = []\n"
        "t = socket.socket(socket.AF_INET6); t.settimeout(3); started = time.monotonic()\n"
        f"try:\n    t.connect(('{VIP6}', 80))\nexcept OSError as e:\n    out.append(e.errno)\n"
        "out.append(time.monotonic() - started)\n"
        "u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n"
        f"try:\n    u.sendto(b'x', ('{VIP6}', 90))\nexcept OSError as e:\n    out.append(e.errno)\n"
        "print(json.dumps(out))\n"
    )
    refused_tcp, elapsed, refused_udp = run6(v6, code)
    assert refused_tcp == refused_udp == 111 and elapsed < 2.0  # ECONNREFUSED, at once
    stats = v6.stats()
    assert stats[Stat.DROP_NO_ENDPOINTS] == 2 and stats[Stat.SOCK_CALLS] == 2


def test_ipv6_affinity_keeps_the_node_on_one_backend(v6: SockLab) -> None:
    """ClientIP affinity from the IPv6 maps (ekp_aff6): an unbound node socket is one client."""
    two_backends6(v6, flags=FrontendFlag.AFFINITY, affinity_timeout=600)
    code = (
        "import json, socket\nbodies = []\n"
        "for _ in range(8):\n"
        "    t = socket.socket(socket.AF_INET6); t.settimeout(3)\n"
        f"    t.connect(('{VIP6}', 80)); bodies.append(t.recv(100).decode()); t.close()\n"
        "print(json.dumps(bodies))\n"
    )
    assert len(set(run6(v6, code))) == 1
    stats = v6.stats()
    assert (
        stats[Stat.AFFINITY_HIT] == 7 and len(v6.maps["aff6"].items()) == 1 and v6.maps["aff"].items() == []
    )


def test_the_iterator_ends_connected_ipv6_udp_sockets_of_a_backend_that_left(v6: SockLab) -> None:
    """As for IPv4: a connected IPv6 UDP socket whose backend left the service port (ekp_member6)
    is ended; one whose backend stays is not."""
    add_service6(v6.maps, VIP6, 90, ((1, BACKENDS6[0], 9000, BackendFlag.LOCAL),), proto=UDP)
    code = (
        "import json, socket, sys\n"
        "u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.settimeout(3)\n"
        f"u.connect(('{VIP6}', 90)); u.send(b'a'); first = u.recv(100).decode().split()[0]\n"
        "print(first, flush=True); sys.stdin.readline()\n"
        "try:\n    u.send(b'b'); print(u.recv(100).decode().split()[0])\n"
        "except OSError as e:\n    print(e.errno)\n"
    )
    proc = v6.lab.popen("node1", sys.executable, "-c", code, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    ended = lambda: read_stats(v6.maps["stats"])[Stat.SOCK_DESTROYED]  # noqa: E731
    node = v6.lab.node(1)
    assert node.cgroup_root is not None
    term = SocketTerminator(v6.dp.prog_fd(PROG_SOCK_TERM), node.ns, node.cgroup_root, pods=False, ended=ended)
    try:
        assert proc.stdout.readline().strip() == b"be1"
        assert term.run() == 0  # its backend serves: nothing to end
        v6.maps["member6"].delete(abi.MemberKey(1, 1))
        assert term.run() == 1
    finally:
        term.close()
        proc.stdin.write(b"\n")
        proc.stdin.close()
    after = proc.stdout.read().decode().strip()
    assert proc.wait(timeout=30) == 0
    assert after in ("103", "89"), after  # ECONNABORTED, or EDESTADDRREQ: no longer connected
    assert v6.maps["sknat6"].items() == []


def test_ipv6_addresses_that_are_not_frontends_are_left_alone(sl: SockLab) -> None:
    """An IPv6 socket's connect() and sendmsg() to a real IPv6 address that is no frontend go where
    they name (counted as passed), even when the address's last word is an IPv4 frontend's
    (fd00::VIP), which a check that read only that word would take for ::ffff:VIP; getpeername and
    recvfrom show it as it is."""
    two_backends(sl)
    two_backends(sl, proto=UDP, svc_id=2, set_id=2, rev_nat_id=2)
    addr = str(ipaddress.IPv6Address(int(ipaddress.IPv6Address("fd00::")) | int(ipaddress.IPv4Address(VIP))))
    sl.lab.run("node1", "ip", "-6", "addr", "add", f"{addr}/128", "dev", "lo", "nodad")
    code = (
        "import json, socket, threading\n"
        f"addr = '{addr}'\n"
        "srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)\n"
        "srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); srv.bind((addr, 80)); srv.listen()\n"
        "echo = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); echo.bind((addr, 80))\n"
        "def serve():\n"
        "    conn, _ = srv.accept(); conn.sendall(b'local'); conn.close()\n"
        "    data, peer = echo.recvfrom(100); echo.sendto(b'local ' + data, peer)\n"
        "threading.Thread(target=serve, daemon=True).start()\n"
        "t = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); t.settimeout(3)\n"
        "t.connect((addr, 80)); peer = t.getpeername()[:2]; body = t.recv(100).decode()\n"
        "u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.settimeout(3)\n"
        "u.sendto(b'x', (addr, 80)); data, src = u.recvfrom(100)\n"
        "print(json.dumps([list(peer), body, list(src[:2]), data.decode()]))\n"
    )
    try:
        peer, body, src, echoed = json.loads(sl.lab.run("node1", sys.executable, "-c", code).stdout)
    finally:
        sl.lab.run("node1", "ip", "-6", "addr", "del", f"{addr}/128", "dev", "lo")
    assert (peer, body) == ([addr, 80], "local"), "connect6 left the address alone"
    assert (src, echoed) == ([addr, 80], "local x"), "sendmsg6 and recvmsg6 too"
    stats = sl.stats()
    # the client's connect() and sendto(), and the local server's reply (sendmsg6 to the client)
    assert stats[Stat.SOCK_CALLS] == stats[Stat.SOCK_PASS] == 3
    assert stats[Stat.SOCK_TRANSLATED] == 0 and stats[Stat.SOCK_REVNAT] == 0


def connect6_from(v6: SockLab, source: str | None) -> dict[str, Any]:
    """One TCP connect() of the node to [VIP6]:80, bound to `source` first if given: the peer and
    the body it read, or the errno it failed with."""
    bind = f"t.bind(('{source}', 0))\n" if source else ""
    code = (
        "import json, socket\n"
        "t = socket.socket(socket.AF_INET6); t.settimeout(1)\n"
        f"{bind}"
        f"try:\n    t.connect(('{VIP6}', 80))\n"
        "except OSError as e:\n    print(json.dumps({'errno': e.errno})); raise SystemExit\n"
        "print(json.dumps({'peer': '[%s]:%d' % t.getpeername()[:2], 'body': t.recv(100).decode()}))\n"
    )
    out: dict[str, Any] = run6(v6, code)
    return out


def test_ipv6_source_ranges_check_a_bound_sockets_address_and_leave_an_unbound_one(v6: SockLab) -> None:
    """loadBalancerSourceRanges of an IPv6 LB frontend (ekp_srcr6): a socket bound to an address is
    checked against the ranges (allowed: translated; outside them: EHOSTUNREACH at once, counted);
    an unbound one is passed untranslated, since the config holds no IPv6 node address and
    ip6tables sees the source the route gives it."""
    two_backends6(v6, flags=FrontendFlag.SOURCE_RANGES | FrontendFlag.LOADBALANCER)
    inside, outside = BACKENDS6  # both on the node's loopback: either can be a bound source

    def allow(prefix: str) -> None:
        net = ipaddress.IPv6Network(prefix)
        key = abi.SrcRange6Key(
            prefixlen=32 + net.prefixlen,
            rev_nat_id=1,
            addr=abi.Addr6(*abi.ip6_words(str(net.network_address))),
        )
        v6.maps["srcr6"].update(key, abi.SrcRange(allow=1))

    allow(f"{inside}/128")
    out = connect6_from(v6, inside)
    assert out["peer"] == f"[{VIP6}]:80" and out["body"] in ("be1", "be2")
    assert connect6_from(v6, outside) == {"errno": 113}  # EHOSTUNREACH
    stats = v6.stats()
    assert stats[Stat.SOCK_TRANSLATED] == 1 and stats[Stat.DROP_SOURCE_RANGE] == 1
    connect6_from(v6, None)  # unroutable untranslated: its outcome is the counters'
    after = v6.stats()
    assert after[Stat.SOCK_PASS] == stats[Stat.SOCK_PASS] + 1
    assert after[Stat.SOCK_TRANSLATED] == 1 and after[Stat.DROP_SOURCE_RANGE] == 1
    assert v6.maps["srcr"].items() == [], "the IPv6 ranges live in their own map"


def test_the_nodes_own_ipv6_sockets_take_the_host_scope_frontend_where_flagged(v6: SockLab) -> None:
    """An IPv6 frontend flagged HOST_SCOPE (ETP Local without a local-traffic detector): the node's
    own sockets take the HOST frontend at the same key (its own backend set), as for IPv4."""
    be1, be2 = BACKENDS6
    add_service6(
        v6.maps,
        VIP6,
        80,
        ((11, be1, 8080, BackendFlag.LOCAL),),
        flags=FrontendFlag.LOCAL | FrontendFlag.HOST_SCOPE,
    )
    add_service6(
        v6.maps, VIP6, 80, ((12, be2, 8080, BackendFlag.LOCAL),), scope=abi.Scope.HOST, set_id=2, svc_id=1
    )
    for _ in range(4):
        assert connect6_from(v6, None) == {"peer": f"[{VIP6}]:80", "body": "be2"}
