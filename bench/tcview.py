"""What the tc programs saw of a ClusterIP's traffic, read from the lab agent's pins mid-run.

With socket-level load balancing for pods (`--bpf-socket-lb-host-namespace-only=false`) a pod's
TCP connect() to a ClusterIP is sent to the backend's address by the socket programs, so its
packets reach tc as pod -> pod IP traffic: no conntrack entry of the tc programs names the
ClusterIP, and the backend's flow-activity slot (bpf/ekp_act.h) stays unstamped, so pod -> pod IP
packets to that backend leave ekp_from_pod after the two array loads. The socket programs' counter
of calls sent to a backend (stat sock_translated) shows the connections were balanced at
connect(); their table (ekp_sknat: the address each live socket dialled, for getpeername()) holds
what was still open when it was read, its entries going as the sockets close (sock_release).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass

from agent.ebpf import abi
from agent.ebpf.activity import slot
from lab.harness import REPO


@dataclass(frozen=True)
class TcView:
    services: int
    ct_entries: int  # every entry of the tc conntrack tables
    ct_via_vip: int  # those whose frontend is the ClusterIP
    sockets_via_vip: int  # ekp_sknat entries: open sockets the socket programs sent from the ClusterIP
    backend_stamp: int  # the backend's ekp_act slot (0: no translated flow ever stamped it)
    # connect()/sendmsg() calls the socket programs sent to a backend (stat sock_translated); records
    # written before sockets were forgotten at close have none (their sknat count stood for it)
    sockets_translated: int = 0

    @property
    def untouched(self) -> bool:
        balanced = self.sockets_translated > 0 or self.sockets_via_vip > 0
        return self.ct_via_vip == 0 and self.backend_stamp == 0 and balanced

    def _balanced(self) -> str:
        if not self.sockets_translated:  # a record from before sock_release
            return f"{self.sockets_via_vip:,} sockets sent from the ClusterIP at connect()"
        return (
            f"{self.sockets_translated:,} calls sent to a backend at connect(), "
            f"{self.sockets_via_vip:,} of their sockets still open (ekp_sknat)"
        )

    def text(self) -> str:
        return (
            f"socket LB for pods, {self.services:,} services: tc conntrack {self.ct_entries} entries, "
            f"{self.ct_via_vip} through the ClusterIP; {self._balanced()}; the backend's activity slot "
            + ("never stamped" if self.backend_stamp == 0 else f"stamped ({self.backend_stamp})")
            + (
                " -> tc saw the ClusterIP's traffic as pod -> pod IP"
                if self.untouched
                else " -> NOT untouched"
            )
        )


def read(pin_path: str, services: int, vip: str, vip_port: int, backend: str, backend_port: int) -> TcView:
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent",
            "inspect",
            "conntrack",
            "sockets",
            "stats",
            f"--bpf-pin-path={pin_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=str(REPO),
    ).stdout
    ct = [ln for ln in text.splitlines() if ln.startswith("ct ")]
    via = [ln for ln in ct if f" fe={vip}:{vip_port} " in ln]
    socks = [
        ln
        for ln in text.splitlines()
        if re.match(rf"^sock \d+ {re.escape(backend)}:{backend_port}/TCP shown as {re.escape(vip)}:", ln)
    ]
    translated = sum(int(ln.split()[2]) for ln in text.splitlines() if ln.startswith("stat sock_translated "))
    return TcView(
        services, len(ct), len(via), len(socks), act_stamp(pin_path, backend, backend_port), translated
    )


def act_stamp(pin_path: str, addr: str, port: int) -> int:
    """The stamp in an endpoint's ekp_act slot (bpftool reads the pinned array)."""
    i = slot(abi.ip_be(addr), abi.port_be(port), socket.IPPROTO_TCP)
    res = subprocess.run(
        ["bpftool", "-j", "map", "lookup", "pinned", os.path.join(pin_path, abi.MAPS["act"].name), "key"]
        + [str(b) for b in i.to_bytes(4, "little")],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    value = json.loads(res.stdout)
    formatted = value.get("formatted", {}).get("value")
    if isinstance(formatted, dict) and "stamp" in formatted:
        return int(formatted["stamp"])
    return int.from_bytes(bytes(int(b, 16) for b in value["value"][:4]), "little")
