"""The socket programs' cgroup links (agent/ebpf/sockattach.py): which cgroup, and what reconcile does
with the links it finds: none, ours, on another cgroup, detached behind its back, of an older build.

The pure helpers on text and temporary directories; the kernel test with two builds of the real data
path (the second with other map sizes, so other programs) and cgroups of its own, never the
machine's root.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.ebpf import bpfsys
from agent.ebpf.abi import SockConfig, SockFlag
from agent.ebpf.loader import Datapath
from agent.ebpf.programs import SOCK_HOOKS
from agent.ebpf.sockattach import (
    SocketAttacher,
    cgroup2_mount,
    detach_all,
    link_pin,
    netns_cookie,
    pinned_links,
    prog_id,
    sock_config,
    socket_cgroup,
)
from agent.errors import FatalError
from lab.dplab import SIZES
from lab.netns import cgroup2_root, new_prefix, remove_cgroup_tree
from lab.packets import bpffs

MOUNTS = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /sys/fs/cgroup tmpfs ro,nosuid,nodev,noexec,mode=755 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0
"""


def test_the_default_cgroup_is_the_first_cgroup2_mount() -> None:
    assert cgroup2_mount(MOUNTS) == "/sys/fs/cgroup/unified"
    assert cgroup2_mount("cgroup2 /run/my\\040cg cgroup2 rw 0 0\n") == "/run/my cg"
    assert cgroup2_mount("tmpfs /sys/fs/cgroup tmpfs ro 0 0\n") is None


def test_a_cgroup_path_that_is_no_cgroup_is_fatal_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FatalError, match=r"is not a cgroup v2 directory .*--bpf-socket-lb=false"):
        socket_cgroup(str(tmp_path))
    (tmp_path / "cgroup.procs").write_text("")
    assert socket_cgroup(str(tmp_path)) == str(tmp_path)


def test_the_settings_entry() -> None:
    assert sock_config(77, True) == SockConfig(host_netns=77, flags=SockFlag.HOST_ONLY)
    assert sock_config(77, False) == SockConfig(host_netns=77, flags=0)


@pytest.fixture
def cgroups() -> Iterator[tuple[str, str]]:
    root = cgroup2_root()
    assert root is not None, "cgroup2 is not mounted"
    made = [os.path.join(root, new_prefix()) for _ in range(2)]
    for path in made:
        os.mkdir(path)
    try:
        yield made[0], made[1]
    finally:
        for path in made:
            remove_cgroup_tree(path)


def fds(dp: Datapath) -> dict[str, int]:
    return {name: dp.prog_fd(name) for name, _ in SOCK_HOOKS.values()}


@pytest.mark.kernel
def test_reconcile_creates_moves_repairs_and_swaps_links(cgroups: tuple[str, str]) -> None:
    one, two = cgroups
    with bpffs() as mnt:
        # The second load stands for a restarted, upgraded agent's: its programs are new ones (new
        # ids) whatever their build, so it takes the packet lab's build, compiled for the whole run,
        # not a build of its own (a compile, about 19 CPU s, for nothing this test asserts).
        first, second = Datapath(str(mnt / "a"), SIZES), Datapath(str(mnt / "b"), SIZES)
        first.load()
        second.load()
        pins = first.pin_path
        try:
            attacher = SocketAttacher(pins, one, fds(first))
            assert sorted(attacher.reconcile()) == sorted(SOCK_HOOKS)  # created
            links = pinned_links(pins)
            assert {s.cgroup_id for s in links.values()} == {os.stat(one).st_ino}
            assert attacher.reconcile() == []  # ours already: nothing touched

            # another cgroup (the flag changed): every link moved, the old cgroup left empty
            moved = SocketAttacher(pins, two, fds(first))
            assert sorted(moved.reconcile()) == sorted(SOCK_HOOKS)
            now = pinned_links(pins)
            assert {s.cgroup_id for s in now.values()} == {os.stat(two).st_ino}
            assert all(now[h].link_id != links[h].link_id for h in SOCK_HOOKS)

            # one link detached behind our back (bpftool cgroup detach): made again
            fd = bpfsys.obj_get(link_pin(pins, "connect4"))
            assert fd >= 0 and bpfsys.link_detach(fd) == 0
            os.close(fd)
            assert pinned_links(pins)["connect4"].cgroup_id == 0
            assert moved.reconcile() == ["connect4"]
            assert pinned_links(pins)["connect4"].cgroup_id == os.stat(two).st_ino

            # another agent's programs (a restarted, upgraded agent): the same links get them in place
            before = pinned_links(pins)
            upgraded = SocketAttacher(pins, two, fds(second))
            assert sorted(upgraded.reconcile()) == sorted(SOCK_HOOKS)
            after = pinned_links(pins)
            for hook, (name, _) in SOCK_HOOKS.items():
                assert after[hook].link_id == before[hook].link_id, hook
                assert after[hook].prog_id == prog_id(second.prog_fd(name)) != before[hook].prog_id
            assert sorted(detach_all(pins)) == sorted(SOCK_HOOKS)
            assert pinned_links(pins) == {} and detach_all(pins) == []
        finally:
            detach_all(pins)
            first.close()
            second.close()


@pytest.mark.kernel
def test_the_netns_cookie_is_the_namespaces() -> None:
    own = netns_cookie("")
    assert own > 0 and netns_cookie("") == own
