"""The service maps read back while the agent starts, for its first sync to re-adopt.

A restart's first sync reads every service map back (440,000 entries at 10,000 Services of 10
endpoints) before it plans: about 0.1 s of batch lookups in the kernel, on the one thread the
sync runs, after the lists. Those lookups are bpf(2) calls made through ctypes, which lets the GIL
go for each call, so the kernel's part can run on another CPU while the source's threads list.
`ReadBack` makes that read on a thread of its own once the source has started listing (the
proxier's `prepare`, called by the Agent then, over the data path agent/app.py loaded early), and
the first sync takes it instead of reading again. Not earlier: started as the early load opened
the maps, among build_agent's imports, the threads' GIL handovers made the start longer than the
read it saved (README, "A restart's read-back beside the lists").

Only raw bytes are read here: the decode into ints stays with the planner, in the sync (decoding
during the lists only moved CPU-bound work into theirs: README, "Start-up overlapped").

Why an early read is the read the sync would make: nothing but this agent writes the service
maps (the node lock keeps a second agent out; the programs only read them), and it writes them
only from a sync. A change made behind its back (bpftool) after the read is the same as one made
just after the sync's own read: the periodic full sync reads the maps again and repairs it.
A read that failed, or one of another data path (a load that failed and was redone), is not used:
the sync reads for itself, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping
from typing import Protocol

log = logging.getLogger(__name__)

Dump = dict[str, tuple[bytes, bytes]]  # role -> (keys, values), each concatenated (`dump_raw`)


class Dumpable(Protocol):
    def dump_raw(self) -> tuple[bytes, bytes]: ...


def read_maps(maps: Mapping[str, Dumpable], roles: Collection[str]) -> Dump:
    """Every map of `roles` that `maps` has, read in batches as raw bytes."""
    return {role: maps[role].dump_raw() for role in roles if role in maps}


class ReadBack:
    """One `read_maps` of `owner`'s maps on a thread of its own (`start`); `take` waits for it.
    `owner`: the data path the maps belong to (`take` gives the read only to a sync of it)."""

    def __init__(self, owner: object, maps: Mapping[str, Dumpable], roles: Collection[str]) -> None:
        self._owner = owner
        self._maps = maps
        self._roles = roles
        self._dump: Dump | None = None
        self._done = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="ekp-readback", daemon=True).start()

    def _run(self) -> None:
        try:
            self._dump = read_maps(self._maps, self._roles)
        except Exception as exc:  # the sync reads again, and meets the error itself
            log.debug("the early read-back of the service maps failed: %s", exc)
        finally:
            self._done.set()

    def wait(self) -> None:
        """Until the read has ended (before its maps' fds are closed)."""
        self._done.wait()

    def take(self, owner: object) -> Dump | None:
        """The read (waited for), once: None when it failed or read another data path's maps."""
        self._done.wait()
        dump, self._dump = self._dump, None
        return dump if owner is self._owner else None
