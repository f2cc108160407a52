"""bench.firstsync at a small scale: every phase runs, the first sync writes every entry, the
restart none."""

from __future__ import annotations

from bench import firstsync


def test_a_small_first_sync_and_restart() -> None:
    out = firstsync.run(40, 3)
    # fe, slot, be, rnat, member, and addr (the cluster IP and the endpoints' addresses) per service
    assert out["entries"] == 40 * (2 + 3 + 3 + 1 + 3 + 1 + 3)
    assert out["restart writes"] == 0
    assert all(out[phase] > 0 for phase in ("lists", "commit", "first sync", "restart"))
