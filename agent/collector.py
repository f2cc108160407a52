"""The garbage collector of an agent process: its thresholds, and no automatic collection while it
starts.

A start allocates millions of objects that all live on (the lists' records, the model, the plan):
every automatic collection before the first full sync walked the newest of them once more and
freed next to nothing (about 1,900 objects of cyclic garbage at 10,000 Services x 10 endpoints,
against 88 ms of a restart's lists and sync spent walking). The first full sync freezes the state
(agent.daemon) and lets the collector run again; `StartHold`'s limit does the same when no full
sync comes (an API server that cannot be reached), so the cyclic garbage of lists that keep failing
is not kept for longer than that.
"""

from __future__ import annotations

import gc
import threading

# Generational thresholds for a process that holds a few hundred thousand long-lived tuples: with
# the default (700, 10, 10), collections over the state cost a third of a 10,000-service sync
# (measured: planning 1.4 s -> 0.9 s). Objects here rarely form cycles.
GC_THRESHOLDS = (100_000, 50, 1_000)

# The longest a start keeps the collector off when no full sync comes: a 50,000-Service node lists
# and syncs in under 30 s on this kind of machine, a loaded one in about 90 s.
START_HOLD_S = 120.0


def set_thresholds() -> None:
    gc.set_threshold(*GC_THRESHOLDS)


class StartHold:
    """No automatic collection from here until the first full sync (agent.daemon calls
    `gc.enable()` once it froze the state), `limit_s` at most, or `release()`."""

    def __init__(self, limit_s: float = START_HOLD_S) -> None:
        gc.disable()
        self._timer = threading.Timer(limit_s, gc.enable)
        self._timer.name = "collector-hold"
        self._timer.daemon = True
        self._timer.start()

    def release(self) -> None:
        self._timer.cancel()
        gc.enable()
