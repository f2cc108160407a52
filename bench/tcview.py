"""What the tc programs saw of a ClusterIP's traffic, read from the lab agent's pins mid-run.

With socket-level load balancing for pods (`--bpf-socket-lb-host-namespace-only=false`) a pod's
TCP connect() to a ClusterIP is sent to the backend's address by the socket programs, so its
packets reach tc as pod -> pod IP traffic: no conntrack entry of the tc programs names the
ClusterIP, and the backend's flow-activity slot (bpf/ekp_act.h) stays unstamped, so pod -> pod IP
packets to that backend leave ekp_from_pod after the two array loads. The socket programs' own
table (ekp_sknat: the address each socket dialled, for getpeername()) shows the connections
were balanced at connect().
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
    sockets_via_vip: int  # ekp_sknat entries: sockets the socket programs sent from the ClusterIP
    backend_stamp: int  # the backend's ekp_act slot (0: no translated flow ever stamped it)

    @property
    def untouched(self) -> bool:
        return self.ct_via_vip == 0 and self.backend_stamp == 0 and self.sockets_via_vip > 0

    def text(self) -> str:
        return (
            f"socket LB for pods, {self.services:,} services: tc conntrack {self.ct_entries} entries, "
            f"{self.ct_via_vip} through the ClusterIP; {self.sockets_via_vip:,} sockets sent from the "
            f"ClusterIP at connect(); the backend's activity slot "
            + ("never stamped" if self.backend_stamp == 0 else f"stamped ({self.backend_stamp})")
            + (
                " -> tc saw the ClusterIP's traffic as pod -> pod IP"
                if self.untouched
                else " -> NOT untouched"
            )
        )


def read(pin_path: str, services: int, vip: str, vip_port: int, backend: str, backend_port: int) -> TcView:
    text = subprocess.run(
        [sys.executable, "-m", "agent", "inspect", "conntrack", "sockets", f"--bpf-pin-path={pin_path}"],
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
    return TcView(services, len(ct), len(via), len(socks), act_stamp(pin_path, backend, backend_port))


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
