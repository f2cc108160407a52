"""Which programs a device's tc hooks run, whichever way they were attached (tcx links or clsact
filters: `--bpf-tc-attach`, agent/ebpf/tcx.py).

Tests that grepped `tc filter show` for our programs passed only on clsact: on tcx the filters are
gone and the programs sit on the hook's tcx list. `hook_programs` reads both, through the same code
as `agent inspect hooks` (a tcx query of the device, then its filters), in the kernel's run order.
"""

from __future__ import annotations

from agent.ebpf import attach, tcx
from agent.netns import netns_route


def hook_programs(netns: str, dev: str, hook: str = "ingress") -> list[str]:
    """The names of the programs `dev`'s `hook` ("ingress" or "egress") runs in network namespace
    `netns` ("" = here), in run order, an older generation's tcx classid program included; [] when
    the device has none (or is gone)."""
    with netns_route(netns) as ipr:
        found = ipr.link_lookup(ifname=dev)
        if not found:
            return []
        return [p.name for p in attach.hook_programs(ipr, netns, int(found[0]), hook)]


def ours(netns: str, dev: str, hook: str = "ingress") -> list[str]:
    """Our programs among them (an older generation's classid program, first on tcx ingress, left out)."""
    return [
        name
        for name in hook_programs(netns, dev, hook)
        if name.startswith(attach.OUR_NAME_PREFIX) and name != tcx.CLASSID_PROG_NAME
    ]
