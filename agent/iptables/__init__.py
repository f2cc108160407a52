"""The iptables mode: kube-proxy's iptables chain layout, byte for byte, applied atomically.

* `chains.py`  chain names (kube-proxy's hashing), the built-in-chain jumps; pure.
* `rules.py`   ProxyState + NodeContext + options -> iptables-restore text; pure.
* `safety.py`  refuses service ports whose values could break out of their arguments; pure.
* `canonical.py` rules compared by meaning (ours vs iptables-save's spelling), chain digests; pure.
* `isolate.py` which service ports a restore rejects, by halving; pure.
* `runner.py`  the IptablesRunner interface; SubprocessRunner (netns, `-w`, nft/legacy detection).
* `proxier.py` IptablesProxier: partial syncs, full syncs that repair drift, failure isolation.
* `nfacct.py`  kube-proxy's nfacct counters: created for the rules, `read_nfacct_counters` for metrics.
* `conntrack_sysctls.py` kube-proxy's conntrack settings (nf_conntrack_max, timeouts) on the node.
* `conntrack.py` stale UDP conntrack entries after endpoint changes.
* `cleanup.py` `agent --cleanup`: our chains and every rule jumping to them, nothing else.
* `kube_proxy_cleanup.py` `cleanup_kube_proxy(config)`: what a previous kube-proxy left, nothing else.

The CLI uses `IptablesProxier(config)` (`sync(state, node, changed)`, `cleanup()`) and
`render_dry_run(state, node, config)` for `--dry-run` and the golden tests.
"""

from agent.config import Config, NodeContext
from agent.iptables.kube_proxy_cleanup import KubeProxyCleanupReport, cleanup_kube_proxy
from agent.iptables.nfacct import read_nfacct_counters
from agent.iptables.proxier import IptablesProxier, SyncStats
from agent.iptables.rules import Rendered, RenderOptions, render, render_text
from agent.model.types import ProxyState


def render_dry_run(state: ProxyState, node: NodeContext, config: Config) -> str:
    """The full iptables-restore input (filter table, then nat) a first sync would pass to
    iptables-restore, assuming a modern host (iptables >= 1.6.2, nf_conntrack_tcp_be_liberal
    unset). Touches nothing; needs no root."""
    return render_text(state, node, config)


__all__ = [
    "IptablesProxier",
    "KubeProxyCleanupReport",
    "RenderOptions",
    "Rendered",
    "SyncStats",
    "cleanup_kube_proxy",
    "read_nfacct_counters",
    "render",
    "render_dry_run",
]
