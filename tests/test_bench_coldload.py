"""bench.coldload's flags reach the sizes it loads with (no kernel: the load itself is replaced)."""

from __future__ import annotations

import pytest

from agent.config import MapSizes
from agent.ebpf.loader import Datapath
from agent.ebpf.programs import PROG_XDP_NET
from bench import coldload


@pytest.mark.parametrize(
    ("flags", "xdp", "ipv6_tc"), [([], True, False), (["--xdp", "off", "--ipv6-tc", "on"], False, True)]
)
def test_the_flags_set_the_sizes_of_every_load(
    flags: list[str],
    xdp: bool,
    ipv6_tc: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--xdp off loads what --bpf-xdp=disabled does: no ekp_xdp_net (MapSizes.xdp)."""
    seen: list[MapSizes] = []

    def cold_load(sizes: MapSizes) -> tuple[float, float, int]:
        seen.append(sizes)
        return 0.5, 0.25, len(Datapath("/unused", sizes).programs())

    monkeypatch.setattr(coldload, "cold_load", cold_load)
    assert coldload.main([*flags, "--runs", "2"]) == 0
    assert len(seen) == 3, "one untimed load to fill the cache, then the runs"
    assert {(s.xdp, s.ipv6_tc) for s in seen} == {(xdp, ipv6_tc)}
    assert (PROG_XDP_NET in Datapath("/unused", seen[0]).programs()) is xdp
    out = capsys.readouterr().out
    assert f"ipv6_tc {'on' if ipv6_tc else 'off'}, xdp {'on' if xdp else 'off'}," in out
    assert "run 2: " in out and "500 ms wall, 250 ms CPU" in out
