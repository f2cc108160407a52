"""agent/ebpf/xdp.py on real devices in a private network namespace: the modes, atomic replacement
of our program, another's program left alone, detaching ours only. Two-instruction XDP_PASS
programs stand in for ekp_xdp_net (lab/wire.py loads them without a compiler)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from pyroute2 import IPRoute

from agent.ebpf import xdp
from lab.packets import private_netns, sh
from lab.wire import load_xdp_pass

pytestmark = pytest.mark.kernel


@pytest.fixture
def ipr() -> Iterator[IPRoute]:
    with private_netns():
        sh("ip", "link", "add", "ext0", "type", "veth", "peer", "name", "ext0p")
        sh("ip", "link", "add", "br0", "type", "bridge")  # no native XDP in its driver
        sh("ip", "link", "add", "vx0", "type", "vxlan", "id", "42", "dstport", "4789")  # nor in vxlan's
        with IPRoute() as ipr:
            yield ipr


@pytest.fixture
def ours() -> Iterator[int]:
    fd = load_xdp_pass("ekp_xdp_net")
    yield fd
    os.close(fd)


def index(ipr: IPRoute, name: str) -> int:
    return int(ipr.link_lookup(ifname=name)[0])


def test_native_on_a_veth(ipr: IPRoute, ours: int) -> None:
    ext0 = index(ipr, "ext0")
    assert xdp.attach(ipr, ext0, "ext0", ours, "native") == "native"
    state = xdp.xdp_state(ipr, ext0)
    assert (state.mode, state.prog_id) == (xdp.ATTACHED_DRV, xdp.prog_info(ours)[0])


def test_best_effort_leaves_a_veth_alone_and_says_why(
    ipr: IPRoute, ours: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    ext0 = index(ipr, "ext0")
    assert xdp.link_kind(ipr, ext0) == "veth"
    assert xdp.attach(ipr, ext0, "ext0", ours, "best-effort") == ""
    assert xdp.xdp_state(ipr, ext0).prog_id == 0
    assert "ext0 is a veth" in caplog.text


def test_best_effort_without_a_driver_runs_none_and_says_so(
    ipr: IPRoute, ours: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    br0 = index(ipr, "br0")
    assert xdp.attach(ipr, br0, "br0", ours, "best-effort") == ""
    assert xdp.xdp_state(ipr, br0).prog_id == 0
    assert "br0: no native XDP in a bridge's driver" in caplog.text
    assert xdp.attach(ipr, br0, "br0", ours, "generic") == "generic"  # generic runs anywhere
    assert xdp.xdp_state(ipr, br0).mode == xdp.ATTACHED_SKB


def test_native_without_a_driver_fails(ipr: IPRoute, ours: int) -> None:
    """The kinds best-effort counts as taking no native XDP (xdp.NO_NATIVE_XDP, which also keeps
    the XDP programs unloaded where every external device is of them) are those refusing it here."""
    import errno

    from pyroute2.netlink.exceptions import NetlinkError

    by_kind = {"bridge": "br0", "vxlan": "vx0"}
    assert set(by_kind) == xdp.NO_NATIVE_XDP, "each kind listed is shown to refuse it"
    for kind, name in by_kind.items():
        assert xdp.link_kind(ipr, index(ipr, name)) == kind
        with pytest.raises(NetlinkError) as refused:
            xdp.attach(ipr, index(ipr, name), name, ours, "native")
        assert refused.value.code == errno.EOPNOTSUPP, name


def test_a_new_build_of_ours_replaces_the_old_and_a_mode_change_moves_it(ipr: IPRoute, ours: int) -> None:
    ext0 = index(ipr, "ext0")
    xdp.attach(ipr, ext0, "ext0", ours, "native")
    newer = load_xdp_pass("ekp_xdp_net")
    try:
        assert xdp.attach(ipr, ext0, "ext0", newer, "native") == "native"
        assert xdp.xdp_state(ipr, ext0).prog_id == xdp.prog_info(newer)[0]
        assert xdp.attach(ipr, ext0, "ext0", newer, "generic") == "generic"
        assert xdp.xdp_state(ipr, ext0).mode == xdp.ATTACHED_SKB
    finally:
        os.close(newer)


def test_another_program_is_left_alone(ipr: IPRoute, ours: int, caplog: pytest.LogCaptureFixture) -> None:
    ext0 = index(ipr, "ext0")
    theirs = load_xdp_pass("cilium_xdp")
    try:
        ipr.link("set", index=ext0, xdp={"attrs": [("IFLA_XDP_FD", theirs), ("IFLA_XDP_FLAGS", 4)]})
        assert xdp.attach(ipr, ext0, "ext0", ours, "native") == ""
        assert "ext0 has another XDP program" in caplog.text
        assert not xdp.detach(ipr, ext0)  # not ours: not removed
        assert xdp.xdp_state(ipr, ext0).prog_id == xdp.prog_info(theirs)[0]
    finally:
        os.close(theirs)


def test_detach_removes_ours(ipr: IPRoute, ours: int) -> None:
    ext0 = index(ipr, "ext0")
    xdp.attach(ipr, ext0, "ext0", ours, "native")
    assert xdp.detach(ipr, ext0)
    assert xdp.xdp_state(ipr, ext0).prog_id == 0
    assert not xdp.detach(ipr, ext0)
