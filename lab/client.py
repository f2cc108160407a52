"""Traffic clients run *inside* lab namespaces (`ip netns exec NS python -m ... client.py ...`).

Standalone on purpose (standard library only): it is executed by path in pod and client
namespaces. Every mode prints one JSON object on stdout.

  http   --url U --count N           N fresh connections, body counts {"bodies": {...}, "errors": n}
                                     (--sport S: each from source port S, one TCP 5-tuple for all:
                                     for probes left unanswered; one this side closed leaves the
                                     tuple in TIME_WAIT, and the next connect fails EADDRNOTAVAIL)
  loop   --url U --stop-file F        new connection per request until F exists (bounded by --max-s);
                                     --ready-file R is created once the first request is answered;
                                     {"ok": n, "errors": n, "error_kinds": {...}, "errors_seen": [the
                                     first ten: wall-clock start, seconds, phase (connect or
                                     response), error], ...}
  udp    --addr A --port P --count N  N request/response pairs, reply counts (--size: datagram bytes;
                                     --sport S: every request from source port S, one flow, as
                                     upstream's `nc -u -p 12345` loops in conntrack.go; --sources:
                                     also the address each reply came from, as recvfrom() says;
                                     --flows: each request's source port and who answered it)
  blob   --url U                      download, {"bytes": n, "sha256": "..."}
  upload --url U --bytes N            POST N bytes to /sink, {"sent": n, "received": n, "seconds": s}
  hold   --addr A --port P --stop-file F   one TCP connection to a line echo server, a line every
                                      --interval s until F exists: {"exchanges": n, "errors": n}
                                      (--ready-file R: created after the first exchange)
  idle   --addr A --port P --ready-file R --go-file G   one TCP connection to a line echo server:
                                      a line, R created, nothing until G exists, one more line:
                                      {"first": ok, "after": ok, "idle_s": s, "error": "..."}
  named  --addr A --port P --stop-file F   one TCP connection to a named line echo, a line every
                                      --interval s until F exists: {"exchanges": n, "errors": n,
                                      "backends": [names in the order they answered]}
  udpflow --addr A --port P --stop-file F   one UDP socket (one source port: one flow) to the UDP
                                      echo, either family, a datagram every --interval s:
                                      {"sent": n, "lost": n, "strangers": n (replies from
                                      another address or port), "backends": [...]}
  dnsloop --addr A --stop-file F      DNS A lookups, a new socket (source port) each, every
                                      --interval s; a lookup is tried again once after --timeout s:
                                      {"lookups": n, "retried": n, "failed": n, "failed_at": [...]}
  frags  --addr A --port P --count N --size S   N UDP datagrams of S bytes to the UDP echo, each
                                      sent as IPv4 fragments in reverse order (last first) through a
                                      raw socket; reply counts as `udp`
  peer   --addr A --port P            one TCP connection: the peer getpeername() reports and the
                                      podserver's answer to GET /, or the errno name it failed with;
                                      --count N: N connections, {"peers", "bodies", "errors"} counted
  resolver --addr A --port P --stop-file F   a long-lived client on one connected UDP socket, as a
                                      resolver holds one: a query every --interval s (a DNS TXT query
                                      for whoami.lab with --dns, else a podserver echo); a failed or
                                      unanswered query opens a new socket and asks again (a resolver's
                                      retry). {"answers": {...}, "failures": {...}, "sockets": n,
                                      "longest_gap": s} (gap: between two answers)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
from collections import Counter
from urllib.parse import urlsplit

# Imported by the modes that use them: a run starts one client process per call (hundreds a
# suite), and urllib.request with http.client, ssl and email was about a third of a start's CPU
# (65-70 CPU ms a start with them, 43-46 without: bench/results/suite/workercpu-2026-11-28.md).


class RemoteDisconnected(ConnectionResetError):
    """The connection closed before a status line: http.client's error of that name."""


class HTTPStatusError(OSError):
    """A status outside 2xx; `reason` its status line's words, as urllib's HTTPError has it."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP Error {status}: {reason}")
        self.reason = reason


def connect(host: str, port: int, timeout: float, sport: int = 0) -> socket.socket:
    """A TCP connection to (host, port); `sport` non-zero: from that source port (SO_REUSEADDR, as
    the UDP mode binds), else one the kernel picks, as `socket.create_connection` does."""
    if not sport:
        return socket.create_connection((host, port), timeout)
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", sport))
        s.settimeout(timeout)
        s.connect((host, port))
    except OSError:
        s.close()
        raise
    return s


def fetch(url: str, timeout: float, sport: int = 0) -> bytes:
    """GET `url` on a new TCP connection and read the answer by http.client's rules, as
    `urllib.request.urlopen(url).read()` did: the same request bytes (HTTP/1.1, `Connection:
    close`, the URL's host and port as written in Host), TCP_NODELAY, `timeout` for the connect
    and each read; lines ended by LF or CRLF, the first of a repeated header taken; a 100 Continue
    skipped (any other 1xx is the answer); a status outside 2xx an `HTTPStatusError` (urllib's
    HTTPError: its class name `str` and words in cmd_http's count) before any body is read; the
    body by chunks (an EOF in the trailer accepted), else none for a 204, else by Content-Length,
    else (none, not a number, negative) to the close. A refused or timed-out connect, a reset or a
    timeout is the OSError itself, as URLError's `reason` or read() had it.

    What urllib did otherwise (no lab server answers so): a connection closed mid-body or a chunk
    size that is not hex is an OSError ("incomplete read", counted) where http.client's
    IncompleteRead crashed the client, and so is a bad status line (BadStatusLine crashed it too);
    a redirect (301, 302, 303, 307 or 308 with a Location) is an error, not followed; http_proxy
    and no_proxy are not read; http.client's limits (64 KiB a line, 100 headers) and its
    HTTP/1.x-only version check are not applied; a folded header line is not joined to the one
    before. Written out because importing urllib.request cost a third of a client's start."""
    parts = urlsplit(url)
    selector = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    request = (
        f"GET {selector} HTTP/1.1\r\nAccept-Encoding: identity\r\nHost: {parts.netloc}\r\n"
        f"User-Agent: Python-urllib/{sys.version_info[0]}.{sys.version_info[1]}\r\n"
        "Connection: close\r\n\r\n"
    )
    with connect(parts.hostname or "", parts.port or 80, timeout, sport) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(request.encode("latin-1"))
        # The buffered reader http.client reads through: lines and exact lengths across segments.
        with s.makefile("rb") as fp:
            cut = f"incomplete read of {url}: the connection closed mid-body"

            def exactly(n: int) -> bytes:
                data = fp.read(n)
                if len(data) < n:
                    raise OSError(cut)
                return data

            while True:
                status_line = fp.readline().decode("iso-8859-1")
                if not status_line:
                    raise RemoteDisconnected("Remote end closed connection without response")
                version, status, reason = [*status_line.split(None, 2), "", ""][:3]
                try:
                    code = int(status)
                except ValueError:
                    code = 0
                if not version.startswith("HTTP/") or not 100 <= code <= 999:
                    raise OSError(f"bad status line from {url}: {status_line!r}")
                headers: dict[str, str] = {}
                while (field := fp.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = field.decode("iso-8859-1").partition(":")
                    headers.setdefault(name.lower(), value.lstrip(" \t").rstrip("\r\n"))
                if code != 100:
                    break
            if not 200 <= code < 300:
                raise HTTPStatusError(code, reason.strip())
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body = b""
                while True:
                    size_line = fp.readline()
                    try:
                        size = int(size_line.split(b";")[0], 16)
                    except ValueError:
                        bad = f"incomplete read of {url}: bad chunk size {size_line!r}"
                        raise OSError(bad if size_line else cut) from None
                    if size == 0:
                        break
                    body += exactly(size)
                    exactly(2)  # the CRLF after a chunk, unchecked as http.client does
                while fp.readline() not in (b"\r\n", b"\n", b""):
                    pass  # the trailer's fields, discarded
                return body
            if code == 204:
                return b""
            try:
                length = int(headers.get("content-length", ""))
            except ValueError:
                length = -1
            return fp.read() if length < 0 else exactly(length)


def cmd_http(a: argparse.Namespace) -> dict[str, object]:
    bodies: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for _ in range(a.count):
        try:
            bodies[fetch(a.url, a.timeout, a.sport).decode().strip()] += 1
        except OSError as exc:
            errors[type(getattr(exc, "reason", exc)).__name__ + ": " + str(getattr(exc, "reason", exc))] += 1
    return {"bodies": dict(bodies), "errors": sum(errors.values()), "error_kinds": dict(errors)}


def fetch_phased(url: str, timeout: float) -> bytes:
    """`fetch`, naming the phase an error came in: "connect" (the handshake: a SYN unanswered) or
    "response" (the request sent, the answer late or cut), as `PhaseError`."""
    import http.client

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout)
    try:
        try:
            conn.connect()
        except OSError as exc:
            raise PhaseError("connect", exc) from exc
        try:
            conn.request("GET", parts.path or "/")
            resp = conn.getresponse()
            if resp.status != 200:
                raise PhaseError("response", OSError(f"HTTP {resp.status}"))
            return resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise PhaseError("response", exc) from exc
    finally:
        conn.close()


class PhaseError(Exception):
    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"{phase}: {cause}")
        self.phase = phase
        self.cause = cause


def cmd_loop(a: argparse.Namespace) -> dict[str, object]:
    ok = 0
    errors: Counter[str] = Counter()
    bodies: Counter[str] = Counter()
    first_error_at: list[float] = []
    # Each of the first errors: when the request began and ended (wall clock, to set beside the
    # agent's log), the phase it failed in and why.
    error_log: list[dict[str, object]] = []
    start = time.monotonic()
    while not os.path.exists(a.stop_file) and time.monotonic() - start < a.max_s:
        began, began_wall = time.monotonic(), time.time()
        try:
            bodies[fetch_phased(a.url, a.timeout).decode().strip()] += 1
            ok += 1
            if ok == 1 and a.ready_file:
                open(a.ready_file, "w").close()  # the loop is running: the caller may go on
        except PhaseError as exc:
            reason = "timed out" if isinstance(exc.cause, TimeoutError) else str(exc.cause)
            errors[reason] += 1
            if len(first_error_at) < 5:
                first_error_at.append(round(time.monotonic() - start, 3))
            if len(error_log) < 10:
                error_log.append(
                    {
                        "began": round(began_wall, 3),
                        "lasted": round(time.monotonic() - began, 3),
                        "phase": exc.phase,
                        "error": reason,
                    }
                )
        if a.interval:
            time.sleep(a.interval)
    return {
        "ok": ok,
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "errors_seen": error_log,
        "bodies": dict(bodies),
        "first_error_at": first_error_at,
        "seconds": round(time.monotonic() - start, 3),
    }


def cmd_udp(a: argparse.Namespace) -> dict[str, object]:
    replies: Counter[str] = Counter()
    sources: Counter[str] = Counter()  # the address each reply came from, as recvfrom() says
    flows: list[tuple[int, str]] = []  # (source port, who answered or "lost"): one flow each
    lost = 0
    for i in range(a.count):
        # A new socket (new source port) per request: a new flow for the proxy each time.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(a.timeout)
            if a.sport:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("", a.sport))
            payload = f"ping-{i}"
            if a.size:  # a large datagram: fragmented on its way (EDNS0, NFS)
                payload = (payload + "-" + "0123456789" * (a.size // 10 + 1))[: a.size]
            s.sendto(payload.encode(), (a.addr, a.port))
            sport = s.getsockname()[1]
            try:
                data, src = s.recvfrom(65535)
            except OSError:
                lost += 1
                flows.append((sport, "lost"))
                continue
            sources[f"{src[0]}:{src[1]}"] += 1
            text = data.decode()
            name, _, echoed = text.partition(" ")
            answer = name if echoed == payload else f"bad:{text}"
            replies[answer] += 1
            flows.append((sport, answer))
    out: dict[str, object] = {"replies": dict(replies), "lost": lost}
    if a.sources:
        out["sources"] = dict(sources)
    if a.flows:
        out["flows"] = flows
    return out


def errno_name(exc: OSError) -> str:
    import errno

    return errno.errorcode.get(exc.errno or 0, type(exc).__name__) if exc.errno else type(exc).__name__


def cmd_peer(a: argparse.Namespace) -> dict[str, object]:
    if a.count == 1:
        return peer_once(a)
    # Many connections from one process: what each got, counted (a check that every backend
    # answers needs enough dials that one backend taking them all by chance is negligible).
    peers: Counter[str] = Counter()
    bodies: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for _ in range(a.count):
        out = peer_once(a)
        if "error" in out:
            errors[str(out["error"])] += 1
        else:
            peers[str(out["peer"])] += 1
            bodies[str(out["body"])] += 1
    return {"peers": dict(peers), "bodies": dict(bodies), "errors": dict(errors)}


def peer_once(a: argparse.Namespace) -> dict[str, object]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(a.timeout)
        try:
            s.connect((a.addr, a.port))
            peer = s.getpeername()
            s.sendall(f"GET / HTTP/1.0\r\nHost: {a.addr}\r\n\r\n".encode())
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except OSError as exc:
            return {"error": errno_name(exc)}
    body = b"".join(chunks).partition(b"\r\n\r\n")[2].decode(errors="replace").strip()
    return {"peer": f"{peer[0]}:{peer[1]}", "body": body}


DNS_A, DNS_TXT = 1, 16


def dns_query(qid: int, name: str, qtype: int = DNS_TXT) -> bytes:
    """A DNS query for `name` (TXT unless `qtype` says otherwise), recursion desired."""
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".") if p)
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\x00" + struct.pack("!HH", qtype, 1)


def dns_txt(reply: bytes, qid: int) -> str:
    """The first TXT string of the answer to query `qid` ("" when it is not one)."""
    try:
        return _dns_txt(reply, qid)
    except IndexError:
        return ""  # truncated


def _dns_txt(reply: bytes, qid: int) -> str:
    if len(reply) < 12 or int.from_bytes(reply[:2], "big") != qid or not int.from_bytes(reply[6:8], "big"):
        return ""
    off = 12
    while reply[off]:  # the question's name
        off += reply[off] + 1
    off += 5  # its end, type and class
    if reply[off] & 0xC0 == 0xC0:  # the answer's name: a pointer, or labels
        off += 2
    else:
        while reply[off]:
            off += reply[off] + 1
        off += 1
    rtype = int.from_bytes(reply[off : off + 2], "big")
    off += 10  # type, class, ttl, rdlength
    if rtype != 16:
        return ""
    return reply[off + 1 : off + 1 + reply[off]].decode(errors="replace")


def cmd_resolver(a: argparse.Namespace) -> dict[str, object]:
    answers: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    sockets = 0
    start = last = time.monotonic()
    longest = 0.0
    s: socket.socket | None = None
    qid = 0
    ready = False
    while not os.path.exists(a.stop_file) and time.monotonic() - start < a.max_s:
        qid = (qid + 1) & 0xFFFF
        try:
            if s is None:  # a resolver connects its socket once and keeps it
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.settimeout(a.timeout)
                sockets += 1
                s.connect((a.addr, a.port))
            if a.dns:
                s.send(dns_query(qid, "whoami.lab"))
                answer = dns_txt(s.recv(4096), qid)
            else:
                s.send(f"q{qid}".encode())
                name, _, echoed = s.recv(4096).decode(errors="replace").partition(" ")
                answer = name if echoed == f"q{qid}" else ""
            if not answer:
                raise OSError(0, "a reply that is not the answer")
            answers[answer] += 1
            now = time.monotonic()
            longest = max(longest, now - last)
            last = now
            if not ready and a.ready_file:
                open(a.ready_file, "w").close()
                ready = True
        except OSError as exc:
            failures["timeout" if isinstance(exc, TimeoutError) else errno_name(exc)] += 1
            if s is not None:
                s.close()
            s = None  # a resolver retries on a new socket
            if not isinstance(exc, TimeoutError):
                time.sleep(a.interval)  # a failure at once: not a busy loop
            continue
        time.sleep(a.interval)
    if s is not None:
        s.close()
    longest = max(longest, time.monotonic() - last) if answers else longest
    return {
        "answers": dict(answers),
        "failures": dict(failures),
        "sockets": sockets,
        "longest_gap": round(longest, 3),
    }


def cmd_upload(a: argparse.Namespace) -> dict[str, object]:
    import urllib.error
    import urllib.request

    start = time.monotonic()
    body = os.urandom(1 << 20) * (a.bytes >> 20) + os.urandom(a.bytes & ((1 << 20) - 1))
    req = urllib.request.Request(a.url, data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=a.timeout) as resp:
            received = int(resp.read().decode().strip())
    except (OSError, urllib.error.URLError) as exc:
        return {"sent": len(body), "error": str(exc), "seconds": round(time.monotonic() - start, 3)}
    return {"sent": len(body), "received": received, "seconds": round(time.monotonic() - start, 3)}


def cmd_hold(a: argparse.Namespace) -> dict[str, object]:
    """A long-lived connection: one established flow across whatever happens to the proxy."""
    exchanges, errors, first_error = 0, 0, ""
    start = time.monotonic()
    try:
        with socket.create_connection((a.addr, a.port), timeout=a.timeout) as s:
            reader = s.makefile("rb")
            while not os.path.exists(a.stop_file) and time.monotonic() - start < a.max_s:
                line = f"ping-{exchanges}\n".encode()
                s.sendall(line)
                if reader.readline() != line:
                    errors += 1
                    first_error = first_error or f"bad echo at exchange {exchanges}"
                    break
                exchanges += 1
                if exchanges == 1 and a.ready_file:
                    open(a.ready_file, "w").close()
                time.sleep(a.interval)
    except OSError as exc:
        errors += 1
        first_error = first_error or f"{type(exc).__name__}: {exc} after {exchanges} exchanges"
    return {"exchanges": exchanges, "errors": errors, "first_error": first_error}


def cmd_named(a: argparse.Namespace) -> dict[str, object]:
    """A long-lived connection that says which backend answers each line."""
    exchanges, errors, first_error = 0, 0, ""
    backends: list[str] = []
    start = time.monotonic()
    try:
        with socket.create_connection((a.addr, a.port), timeout=a.timeout) as s:
            reader = s.makefile("rb")
            while not os.path.exists(a.stop_file) and time.monotonic() - start < a.max_s:
                line = f"ping-{exchanges}"
                s.sendall(line.encode() + b"\n")
                name, _, echoed = reader.readline().decode().rstrip("\n").partition(" ")
                if echoed != line:
                    errors += 1
                    first_error = first_error or f"bad echo at exchange {exchanges}: {name} {echoed}"
                    break
                if not backends or backends[-1] != name:
                    backends.append(name)
                exchanges += 1
                time.sleep(a.interval)
    except OSError as exc:
        errors += 1
        first_error = first_error or f"{type(exc).__name__}: {exc} after {exchanges} exchanges"
    return {"exchanges": exchanges, "errors": errors, "first_error": first_error, "backends": backends}


def cmd_udpflow(a: argparse.Namespace) -> dict[str, object]:
    """One UDP flow (one source port) kept alive by a datagram every interval. A reply from another
    address or port than the one sent to (a backend's own, untranslated) is a `stranger`: the
    unconnected socket takes it, a connected one (a resolver's) would not."""
    sent = lost = strangers = 0
    stranger_at: list[float] = []  # wall clock, to hold against the agent's log
    lost_at: list[float] = []  # when the wait for a datagram's reply ran out, the same way
    backends: list[str] = []
    import ipaddress

    start = time.monotonic()
    family = socket.AF_INET6 if ":" in a.addr else socket.AF_INET  # an IPv6 ClusterIP's flow too
    service = (ipaddress.ip_address(a.addr), a.port)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.settimeout(a.timeout)
        while not os.path.exists(a.stop_file) and time.monotonic() - start < a.max_s:
            payload = f"flow-{sent}"
            s.sendto(payload.encode(), (a.addr, a.port))
            sent += 1
            try:
                data, peer = s.recvfrom(65535)
            except OSError:
                lost += 1
                lost_at.append(round(time.time(), 3))
                continue
            if (ipaddress.ip_address(peer[0]), peer[1]) != service:
                strangers += 1
                stranger_at.append(round(time.time(), 3))
            else:
                name, _, echoed = data.decode().partition(" ")
                if echoed == payload and (not backends or backends[-1] != name):
                    backends.append(name)
            time.sleep(a.interval)
    return {
        "sent": sent,
        "lost": lost,
        "strangers": strangers,
        "strangers_at": stranger_at[:3] + stranger_at[-3:],
        "lost_at": lost_at[:3] + lost_at[-3:],
        "backends": backends,
    }


def cmd_dnsloop(a: argparse.Namespace) -> dict[str, object]:
    """A resolver's lookups: each from a new socket, tried again once after the timeout (glibc's
    `attempts:2`); a lookup fails when both tries go unanswered."""
    lookups = retried = failed = 0
    failed_at: list[float] = []
    start = time.monotonic()
    while not os.path.exists(a.stop_file) and time.monotonic() - start < a.max_s:
        lookups += 1
        answered = False
        for attempt in range(2):
            qid = (lookups * 2 + attempt) & 0xFFFF
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.settimeout(a.timeout)
                s.sendto(dns_query(qid, a.name, DNS_A), (a.addr, a.port))
                try:
                    data, _ = s.recvfrom(65535)
                    answered = len(data) >= 12 and struct.unpack("!H", data[:2])[0] == qid
                except OSError:
                    answered = False
            if answered:
                retried += attempt
                break
        if not answered:
            failed += 1
            failed_at.append(round(time.monotonic() - start, 3))
        time.sleep(a.interval)
    return {"lookups": lookups, "retried": retried, "failed": failed, "failed_at": failed_at[:10]}


def cmd_idle(a: argparse.Namespace) -> dict[str, object]:
    """An established connection left idle: whatever happens meanwhile (a flood), its next line
    must still be echoed."""
    out: dict[str, object] = {"first": False, "after": False, "idle_s": 0.0, "error": ""}
    try:
        with socket.create_connection((a.addr, a.port), timeout=a.timeout) as s:
            reader = s.makefile("rb")
            s.sendall(b"before\n")
            out["first"] = reader.readline() == b"before\n"
            open(a.ready_file, "w").close()
            start = time.monotonic()
            while not os.path.exists(a.go_file) and time.monotonic() - start < a.max_s:
                time.sleep(0.05)
            out["idle_s"] = round(time.monotonic() - start, 3)
            s.sendall(b"after\n")
            out["after"] = reader.readline() == b"after\n"
    except OSError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return int(~total & 0xFFFF)


def reversed_fragments(src: str, dst: str, sport: int, dport: int, payload: bytes, ident: int) -> list[bytes]:
    """The IPv4 fragments (1,480 payload bytes each) of one UDP datagram, last first."""
    saddr, daddr = socket.inet_aton(src), socket.inet_aton(dst)
    length = 8 + len(payload)
    header = struct.pack("!HHHH", sport, dport, length, 0)
    csum = checksum(saddr + daddr + struct.pack("!BBH", 0, 17, length) + header + payload) or 0xFFFF
    datagram = struct.pack("!HHHH", sport, dport, length, csum) + payload
    out = []
    for offset in range(0, len(datagram), 1480):
        piece = datagram[offset : offset + 1480]
        more = 0x2000 if offset + 1480 < len(datagram) else 0
        ip = struct.pack(
            "!BBHHHBBH4s4s", 0x45, 0, 20 + len(piece), ident, more | offset // 8, 64, 17, 0, saddr, daddr
        )
        ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
        out.append(ip + piece)
    return out[::-1]


def cmd_frags(a: argparse.Namespace) -> dict[str, object]:
    replies: Counter[str] = Counter()
    lost = 0
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as raw:
        for i in range(a.count):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.settimeout(a.timeout)
                s.connect((a.addr, a.port))  # picks the source address and port; filters the reply
                src, sport = s.getsockname()
                payload = (f"frags-{i}-" + "0123456789" * (a.size // 10 + 1))[: a.size]
                ident = (os.getpid() * 131 + i) & 0xFFFF or 1
                for frame in reversed_fragments(src, a.addr, sport, a.port, payload.encode(), ident):
                    raw.sendto(frame, (a.addr, 0))
                try:
                    data = s.recv(65535)
                except OSError:
                    lost += 1
                    continue
                name, _, echoed = data.decode().partition(" ")
                replies[name if echoed == payload else f"bad:{data[:40]!r}"] += 1
    return {"replies": dict(replies), "lost": lost}


def cmd_blob(a: argparse.Namespace) -> dict[str, object]:
    import hashlib
    import urllib.request

    h = hashlib.sha256()
    n = 0
    with urllib.request.urlopen(a.url, timeout=a.timeout) as resp:
        while chunk := resp.read(1 << 20):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "sha256": h.hexdigest()}


def add_flow_loop(
    p: argparse.ArgumentParser, timeout: float, port: int | None = None
) -> argparse.ArgumentParser:
    """The arguments every long-lived flow (hold, named, udpflow, dnsloop) takes: its target
    (`--port` required unless a default is given), its pace, and the bounds that end it (the stop
    file, or --max-s at the latest)."""
    p.add_argument("--addr", required=True)
    if port is None:
        p.add_argument("--port", type=int, required=True)
    else:
        p.add_argument("--port", type=int, default=port)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=timeout)
    p.add_argument("--max-s", type=float, default=120.0)
    return p


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("http")
    h.add_argument("--url", required=True)
    h.add_argument("--count", type=int, default=1)
    h.add_argument("--timeout", type=float, default=3.0)
    h.add_argument("--sport", type=int, default=0, help="every connection from this source port")
    lp = sub.add_parser("loop")
    lp.add_argument("--url", required=True)
    lp.add_argument("--stop-file", required=True)
    lp.add_argument("--max-s", type=float, default=120.0)
    lp.add_argument("--timeout", type=float, default=3.0)
    lp.add_argument("--interval", type=float, default=0.0)
    lp.add_argument("--ready-file", default="", help="created after the first answered request")
    u = sub.add_parser("udp")
    u.add_argument("--addr", required=True)
    u.add_argument("--port", type=int, required=True)
    u.add_argument("--count", type=int, default=1)
    u.add_argument("--timeout", type=float, default=2.0)
    u.add_argument("--size", type=int, default=0)
    u.add_argument("--sport", type=int, default=0)
    u.add_argument("--sources", action="store_true", help="also count the address each reply came from")
    u.add_argument("--flows", action="store_true", help="also each request's source port and who answered")
    b = sub.add_parser("blob")
    b.add_argument("--url", required=True)
    b.add_argument("--timeout", type=float, default=60.0)
    up = sub.add_parser("upload")
    up.add_argument("--url", required=True)
    up.add_argument("--bytes", type=int, required=True)
    up.add_argument("--timeout", type=float, default=20.0)
    hp = add_flow_loop(sub.add_parser("hold"), timeout=5.0)
    hp.add_argument("--ready-file", default="", help="created after the first exchange")
    add_flow_loop(sub.add_parser("named"), timeout=5.0)
    add_flow_loop(sub.add_parser("udpflow"), timeout=1.0)
    d = add_flow_loop(sub.add_parser("dnsloop"), timeout=1.0, port=53)
    d.add_argument("--name", default="web.svc.lab")
    i = sub.add_parser("idle")
    i.add_argument("--addr", required=True)
    i.add_argument("--port", type=int, required=True)
    i.add_argument("--ready-file", required=True)
    i.add_argument("--go-file", required=True)
    i.add_argument("--timeout", type=float, default=5.0)
    i.add_argument("--max-s", type=float, default=120.0)
    f = sub.add_parser("frags")
    f.add_argument("--addr", required=True)
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--count", type=int, default=1)
    f.add_argument("--size", type=int, default=3000)
    f.add_argument("--timeout", type=float, default=2.0)
    pe = sub.add_parser("peer")
    pe.add_argument("--addr", required=True)
    pe.add_argument("--port", type=int, required=True)
    pe.add_argument("--timeout", type=float, default=3.0)
    pe.add_argument("--count", type=int, default=1, help="connections, each counted (peers, bodies, errors)")
    r = sub.add_parser("resolver")
    r.add_argument("--addr", required=True)
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--stop-file", required=True)
    r.add_argument("--ready-file", default="", help="created after the first answer")
    r.add_argument("--dns", action="store_true", help="DNS TXT queries for whoami.lab (dnsmasq)")
    r.add_argument("--interval", type=float, default=0.05)
    r.add_argument("--timeout", type=float, default=1.0, help="a query unanswered this long is retried")
    r.add_argument("--max-s", type=float, default=120.0)
    a = p.parse_args()
    commands = {
        "http": cmd_http,
        "loop": cmd_loop,
        "udp": cmd_udp,
        "blob": cmd_blob,
        "upload": cmd_upload,
        "hold": cmd_hold,
        "idle": cmd_idle,
        "named": cmd_named,
        "udpflow": cmd_udpflow,
        "dnsloop": cmd_dnsloop,
        "frags": cmd_frags,
        "peer": cmd_peer,
        "resolver": cmd_resolver,
    }
    result = commands[a.cmd](a)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
