"""The eBPF mode: plan the service maps, write them in a safe order, attach the tc programs.

Layers (pure ones import neither bcc nor pyroute2):

* `abi`     ctypes mirror of bpf/ekp_abi.h and the map registry (pure)
* `plan`    ProxyState + NodeContext + Config (+ previous ids) -> MapContents (pure)
* `delta`   old MapContents, new MapContents -> ordered, batched map writes (pure)
* `render`  MapContents, conntrack, affinity, counters -> sorted text (pure)
* `capacity` fill and pressure of every map, live conntrack entries by state, early drops
  (`agent inspect capacity`)
* `ports`   the SNAT port range against the NodePort and local port ranges (pure)
* `loader`, `maps`   compile, load and pin, typed map access, the double-buffered config
* `compile`, `bpfobject`, `objcache`, `link`   the compiler child (bcc) and what it hands back (a
            relocatable object, pure), kept per build on the machine, loaded against one pin path
* `upgrade` conntrack of an ABI v1 agent carried into the v2 tables around the first attach;
  the counters of ekp_stats_v2 into ekp_stats_v3
* `attach`  clsact + direct-action cls_bpf filters, pod-device watcher (pyroute2)
* `proxier` EbpfProxier: the Proxier of this mode, tying the above together

Importing this package stays cheap: `EbpfProxier` (which pulls in bcc and pyroute2) is loaded on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Under TYPE_CHECKING: agent.config reads the map registry (agent.ebpf.abi) for its defaults,
    # so importing it here at run time would be circular.
    from agent.config import Config, NodeContext
    from agent.ebpf.proxier import EbpfProxier
    from agent.model.types import ProxyState

__all__ = ["EbpfProxier", "render_dry_run"]


def render_dry_run(state: ProxyState, node: NodeContext, config: Config) -> str:
    """What a first sync on an empty node would write, as sorted decoded map entries."""
    from agent.ebpf.plan import plan
    from agent.ebpf.render import render_contents

    contents = plan(state, node, config)
    return render_contents(contents, contents.fe_names)


def __getattr__(name: str) -> Any:
    if name == "EbpfProxier":
        from agent.ebpf.proxier import EbpfProxier

        return EbpfProxier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
