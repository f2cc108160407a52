"""`--oom-score-adj`: the agent's OOM score, written as kube-proxy writes its own at start.

kube-proxy (cmd/kube-proxy/app/server.go `ProxyServer.Run`) writes `oomScoreAdj` (default -999,
qos.KubeProxyOOMScoreAdj: the node's proxy is among the last processes the kernel kills) to
/proc/self/oom_score_adj, and only logs when that fails (an unprivileged container cannot lower
it). So do we.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PATH = "/proc/self/oom_score_adj"


def apply_oom_score_adj(value: int, path: str = PATH) -> bool:
    """Write `value`; False (and one log line) when the kernel refuses."""
    try:
        with open(path, "w", encoding="ascii") as f:
            f.write(f"{value}\n")
    except OSError as exc:
        log.warning(
            "cannot set the OOM score adjustment to %d (%s: %s); going on with the current one, as "
            "kube-proxy does (lowering it needs CAP_SYS_RESOURCE)",
            value,
            path,
            exc.strerror or exc,
        )
        return False
    log.info("OOM score adjustment set to %d (--oom-score-adj)", value)
    return True
