"""The tc data path (bpf/ekp_tc.c): its pinned programs and maps, compiled by bcc when needed.

    dp = Datapath("/sys/fs/bpf/ebpf-kube-proxy", MapSizes())
    dp.load()                       # reuse or compile the programs, open the pinned maps
    fd = dp.prog_fd("ekp_from_pod") # attach it with tc (clsact ingress, direct-action)
    dp.maps["fe"].update(key, value)
    for path in stale_pins(dp.pin_path): os.unlink(path)   # maps of an older ABI version
    dp.close()

The agent never compiles in its own process (`agent.ebpf.compile`): a short-lived child compiles
with bcc and exits, once per build on the machine (agent/ebpf/objcache.py keeps what it compiled);
the agent loads that object against its own pinned maps (agent/ebpf/link.py), each created at this
agent's size (the object declares none: compile_cflags), and pins the programs it loads
(`programs()`: the object holds every one) beside them. One build serves every size and either
IPv6 switch. An agent restarted with the same source, sizes, kernel and bcc reuses the pinned
programs without loading anything. The pin directory must be on bpffs (checked before anything is
created; `FatalError` otherwise) and is created 0700 and checked to be ours (agent/ebpf/pindir.py):
/sys/fs/bpf is world-writable. Every map of the registry is pinned under `pin_path`, so conntrack,
affinity and counters survive restarts and upgrades of the agent. A pinned map is reused only when
it is exactly the map about to be created: `load()` first compares every existing pin with the
registry (type, key and value size, max_entries, map_flags) and refuses a mismatch
(`PinMismatchError`), and the link compares each again with the compiled definition; the ABI
version in each map name keeps old layouts apart (`stale_pins` lists them; agent/ebpf/upgrade.py
carries the conntrack of ABI v1 pins over before they are removed).

The conntrack tables' sizes may be derived at start (MapSizes.with_conntrack): `pinned_sizes`
reads the sizes of the tables already pinned, so a restart keeps them rather than refusing to start
on a machine whose CPU count changed.

The map sizes reach the C as a placeholder (`-DEKP_CT_TCP_MAX=1`, SIZE_AT_LOAD) and the Maglev
table size as itself (ekp_maglev's value layout); the early-drop rings' slot counts, the only sizes
code reads, come from their heads at run time (write_ring_slots). `source_text()`
returns the full program as compiled (includes inlined, cflags on top) for debugging, the way bcc
tools print their generated C.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.config import ConntrackSettings, MapSizes
from agent.ebpf import bpfsys
from agent.ebpf.abi import (
    ABI_VERSION,
    CT_QUEUES,
    CTQ_DIVISOR,
    CTQ_HEADS,
    CTQH_POS_SHIFT,
    CTQH_SLOTS_MASK,
    MAPS,
    PREFIX,
    V6_ROLES,
    CtqRing,
    Handover,
    HandoverMode,
    MapSpec,
    maglev_value,
)
from agent.ebpf.bpfobject import BpfObject
from agent.ebpf.btf import vmlinux_has
from agent.ebpf.compile import (
    PROG_PIN_PREFIX,
    build_id,
    compile_in_child,
    open_pinned_programs,
    prog_pin,
    remove_other_builds,
)
from agent.ebpf.link import LinkError, PinnedMapMismatch, link
from agent.ebpf.maps import MAP_FLAGS, MAP_TYPES, BpfMap, MapInfo, map_info, obj_get, obj_pin, possible_cpus
from agent.ebpf.objcache import ObjectCache, default_cache_dir
from agent.ebpf.pindir import ensure_pin_dir
from agent.ebpf.programs import (
    BUILD_MAPS,
    HANDOVER_MAP,
    PROG_EGRESS,
    PROG_EGRESS6,
    PROG_FROM_NET,
    PROG_FROM_POD,
    PROG_SCHED_CLS,
    PROG_XDP,
    PROG_XDP_NET,
    PROG_XDP_NET6,
    PROGRAMS,
    TAIL_CALLS,
    ProgSpec,
    available_programs,
    kernel_needs,
)
from agent.ebpf.snatloop import SnatWalk, decide
from agent.errors import FatalError

log = logging.getLogger(__name__)

# The start of the line logged when a compile begins (lab/harness.py waits it out), and what the
# errors of a compile or a load that failed say (DatapathError, in whatever line logs it).
COMPILING_LOG = "compiling data path "
FAILED_RE = re.compile(r"compiling \S+ failed: |loading the data path \(build \w+\) failed: ")

ENTRY_FILE = "ekp_tc.c"
BPF_DIR_ENV = "EKP_BPF_DIR"  # overrides where bpf/ is found (an installed agent, a dev tree)

# Maps each program's load owns, outside the registry, by program (ekp_tc.c): the IPv4 programs
# of tc and XDP their scratch, their program array (ekp_calls6, ekp_xcalls6) and the hand-over
# mode (ekp_handover), the IPv6 programs their scratch alone, the socket programs none.
# A reused program keeps its own; one with more unknown maps than these still uses a map that was
# unpinned and recreated (compile.open_pinned_programs).
PRIVATE_MAPS: dict[str, int] = {
    name: 0
    if spec.prog_type not in (PROG_SCHED_CLS, PROG_XDP)
    else 3
    if name in (PROG_FROM_POD, PROG_FROM_NET, PROG_EGRESS, PROG_XDP_NET)
    else 1
    if any(name in names for names in TAIL_CALLS.values())
    else 2
    for name, spec in PROGRAMS.items()
}

BPF_F_NO_PREALLOC = 1 << 0
BPF_F_NO_COMMON_LRU = 1 << 1
_U32_MAX = (1 << 32) - 1
# Creation flags of single maps, beyond those every map of its kind has (maps.MAP_FLAGS), exactly as
# declared in bpf/ekp_maps.h (tests/ebpf/test_abi.py compares the two). The LRU maps use the
# kernel's common LRU list, so every CPU can use every entry (ABI v1 had one list per CPU, each CPU
# owning max_entries / CPUs; bpf/README.md, "Conntrack capacity", has the measurement). The
# service addresses are allocated as written: a few thousand entries, read only for fragments; so
# are the Maglev tables (64 KiB each: only the sets of Maglev frontends have one).
# The IPv6 service maps (abi.V6_ROLES) too: sized as their IPv4 twins, they cost an IPv4-only node
# their hash buckets alone.
ROLE_FLAGS: dict[str, int] = {
    "addr": BPF_F_NO_PREALLOC,
    "maglev": BPF_F_NO_PREALLOC,
    "port": BPF_F_NO_PREALLOC,
    **{role: BPF_F_NO_PREALLOC for role in V6_ROLES.values() if MAPS[role].kind == "hash"},
}

# The conntrack tables of the tc programs' IPv6 path (bpf/ekp_tc6.h), its only writer, their
# early-drop rings, its fragment tables and legacy host routing's egress sources (ekp_hostnat6):
# when that path does not serve (MapSizes.ipv6_tc), each is created with IDLE_SIZE entries, and a
# pin of the other size is replaced at load (`replace_resized_ipv6_pins`): what it holds no program
# reads. (Before the path took UDP,
# ekp_ct6_any and its ring stayed idle either way: such a pin is replaced the same way.)
TC6_ROLES = frozenset({"ct6_tcp", "ct6_any", "ctq6_tcp", "ctq6_any", "frag6", "frhold6", "hostnat6"})
IDLE_SIZE = 1
# The programs of that path, reached only through ekp_calls6: loaded, pinned and verified only where
# it serves (Datapath.programs). The switch is the same build (sizes are the load's), but another
# set of programs, so another load id (Datapath.load_id): a start that turns it on or off loads
# its programs from the cached object and pins them beside the last load's, whose program arrays
# stay until the attach (release_older_builds).
TC6_PROGRAMS = frozenset(name for names in TAIL_CALLS.values() for name in names)

_PIN_NAME = re.compile(rf"^{PREFIX}[a-z0-9_]+?_v(\d+)$")
_REMEDY = "run `agent --cleanup` or remove the pin"


@contextlib.contextmanager
def _pinned_fd(path: str) -> Iterator[int]:
    fd = bpfsys.obj_get(path)
    if fd < 0:
        raise DatapathError(f"opening {path}: {os.strerror(-fd)}")
    try:
        yield fd
    finally:
        os.close(fd)


def write_handover(path: str, mode: HandoverMode) -> None:
    """Set the hand-over mode in the pinned ekp_handover map at `path`."""
    with _pinned_fd(path) as fd:
        ret = bpfsys.map_update_elem(fd, ctypes.c_uint32(0), Handover(mode=int(mode)))
    if ret < 0:
        raise DatapathError(f"setting the hand-over mode to {mode.name} in {path}: {os.strerror(-ret)}")


def read_handover(path: str) -> HandoverMode:
    """The hand-over mode in the pinned ekp_handover map at `path`."""
    value = Handover()
    with _pinned_fd(path) as fd:
        ret = bpfsys.map_lookup_elem(fd, ctypes.c_uint32(0), value)
    if ret < 0:
        raise DatapathError(f"reading the hand-over mode in {path}: {os.strerror(-ret)}")
    return HandoverMode(int(value.mode))


def pinned_handover_modes(pin_path: str) -> dict[str, HandoverMode]:
    """load id (Datapath.load_id: a build and the programs it loaded) -> hand-over mode of every one
    pinned under `pin_path` (agent doctor)."""
    suffix = f"_{HANDOVER_MAP}"
    return {
        entry[len(PROG_PIN_PREFIX) : -len(suffix)]: read_handover(os.path.join(pin_path, entry))
        for entry in sorted(os.listdir(pin_path))
        if entry.startswith(PROG_PIN_PREFIX) and entry.endswith(suffix)
    }


def tail_call_order(names: Sequence[str], *, filling: bool) -> list[tuple[int, str]]:
    """The (index, program) slots of a program array in the order `_route_ipv6` writes them:
    ekp_egress6 first when filling, last when emptying (a first start attaches egress before
    ingress, so an IPv6 packet the ingress path handed to the stack under legacy host routing
    never finds its egress half missing)."""
    slots = sorted(enumerate(names), key=lambda slot: slot[1] != PROG_EGRESS6)
    return slots if filling else slots[::-1]


class DatapathError(RuntimeError):
    """The data path could not be compiled or loaded."""


class PinMismatchError(DatapathError, FatalError):
    """An existing pinned map differs from the map about to be compiled. Fatal: a pinned table
    cannot be resized or re-flagged in place, so retrying would fail forever; the operator chooses
    to drop the state (`agent --cleanup`) or to start with the old sizes."""


# MapSizes' size settings: a map whose sized_by is one of them is sized by it (map_size, load_sized).
_SIZE_FIELDS = frozenset(f.name for f in dataclasses.fields(MapSizes))


def default_bpf_dir() -> Path:
    env = os.environ.get(BPF_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "bpf"  # agent/ebpf/loader.py -> <repo>/bpf


def map_size(spec: MapSpec, sizes: MapSizes) -> int:
    """max_entries of a map: from MapSizes when it has the role, else the registry's default. A
    size left to be derived (0) that nobody resolved takes kube-proxy's default conntrack
    settings on this machine's CPUs (the proxier resolves it from Config.conntrack first). An
    early-drop ring follows its conntrack table (a pinned table keeps its size, so its ring does)."""
    if spec.role in TC6_ROLES and not sizes.ipv6_tc:
        return IDLE_SIZE
    table = next((ct for ct, ring in CT_QUEUES.items() if ring == spec.role), None)
    if table is not None:  # an early-drop ring: a quarter of its table's entries
        return max(1, map_size(MAPS[table], sizes) // CTQ_DIVISOR)
    # Only a size setting: a role named like one of MapSizes' methods keeps its default.
    size = int(getattr(sizes, spec.sized_by)) if spec.sized_by in _SIZE_FIELDS else spec.default_size
    if size == 0 and spec.sized_by in _SIZE_FIELDS:
        resolved = sizes.with_conntrack(ConntrackSettings(), os.cpu_count() or 1)
        size = int(getattr(resolved, spec.sized_by))
    return size


def pinned_sizes(pin_path: str) -> dict[str, int]:
    """max_entries of the maps already pinned under `pin_path`, by role (unreadable pins skipped)."""
    out: dict[str, int] = {}
    for role, spec in MAPS.items():
        path = os.path.join(pin_path, spec.name)
        if not os.path.exists(path):
            continue
        try:
            fd = obj_get(path)
        except OSError:
            continue
        try:
            out[role] = map_info(fd).max_entries
        finally:
            os.close(fd)
    return out


def sized_spec(spec: MapSpec, sizes: MapSizes) -> MapSpec:
    """`spec` with the value type it is compiled with: a Maglev table's follows the table size."""
    if spec.role == "maglev":
        return replace(spec, value=maglev_value(sizes.maglev_table_size))
    return spec


def map_flags(spec: MapSpec) -> int:
    """The map_flags a map is created with (and that an existing pin must have)."""
    return MAP_FLAGS.get(spec.kind, 0) | ROLE_FLAGS.get(spec.role, 0)


def kernel_max_entries(spec: MapSpec, sizes: MapSizes) -> int:
    """max_entries as the kernel reports it. A map with per-CPU LRU lists (BPF_F_NO_COMMON_LRU) is
    rounded up to a multiple of the possible CPUs, each CPU's list getting an equal share, in u32
    arithmetic, and down instead when that wraps: htab_map_alloc's roundup/rounddown."""
    size = map_size(spec, sizes)
    if not map_flags(spec) & BPF_F_NO_COMMON_LRU:
        return size
    cpus = possible_cpus()
    up = ((size + cpus - 1) & _U32_MAX) // cpus * cpus
    return up if up >= size else size // cpus * cpus


def expected_info(spec: MapSpec, sizes: MapSizes) -> dict[str, int]:
    """What bpf_obj_get_info must report for a map compiled with `sizes`."""
    value = maglev_value(sizes.maglev_table_size) if spec.role == "maglev" else spec.value
    return {
        "type": MAP_TYPES[spec.kind],
        "key_size": _sizeof(spec.key),
        "value_size": _sizeof(value),
        "max_entries": kernel_max_entries(spec, sizes),
        "flags": map_flags(spec),
    }


def _sizeof(t: Any) -> int:
    return ctypes.sizeof(t)


def info_mismatches(spec: MapSpec, sizes: MapSizes, info: MapInfo) -> list[str]:
    """Human-readable differences between a live map and what we compile; [] when it fits."""
    want = expected_info(spec, sizes)
    have = {k: getattr(info, k) for k in want}
    return [f"{k} is {have[k]}, expected {want[k]}" for k in want if have[k] != want[k]]


def check_pins(pin_path: str, sizes: MapSizes) -> None:
    """Raises PinMismatchError when an existing pin would be silently re-used with another shape."""
    problems = []
    for spec in MAPS.values():
        path = os.path.join(pin_path, spec.name)
        if not os.path.exists(path):
            continue
        try:
            fd = obj_get(path)
        except FileNotFoundError:
            continue  # removed since the listing: it will be created
        except OSError as e:
            # Not a shape to drop with --cleanup: a permission or a foreign file, to look at first.
            raise FatalError(
                f"cannot open the pinned map {path} ({e.strerror}): check what the file is and that "
                "the agent runs as root with CAP_BPF; remove it only if it is not a live map"
            ) from e
        try:
            diffs = info_mismatches(spec, sizes, map_info(fd))
        finally:
            os.close(fd)
        if diffs:
            problems.append(f"{path}: " + ", ".join(diffs))
    if problems:
        for p in problems:
            log.error("pinned map does not match the data path: %s", p)
        raise PinMismatchError(
            "pinned BPF maps do not match this agent's data path (a changed --bpf-*-max flag, or pins "
            "left by an older agent?): "
            + "; ".join(problems)
            + f". To start over: {_REMEDY} (this drops conntrack state)."
        )


def replace_resized_ipv6_pins(pin_path: str, sizes: MapSizes) -> list[str]:
    """Unpin the tc IPv6 path's conntrack tables (TC6_ROLES) whose size is the other side of the
    IPv6 switch (IDLE_SIZE on one side, their IPv4 twins' on the other), so the load creates them
    at this start's size; their names, and the head (ekp_ctqh6) of a ring so replaced. Nothing else
    of theirs may differ (check_pins reports it), and no other map is touched: the IPv4 tables and
    their flows stay. Turned on, the idle tables
    held nothing; turned off, no program of this start reads what the full ones held."""
    doomed = []
    for role in sorted(TC6_ROLES):
        spec = MAPS[role]
        path = os.path.join(pin_path, spec.name)
        try:
            fd = obj_get(path)
        except OSError:
            continue  # missing (created by the load) or unreadable (check_pins says why)
        try:
            info = map_info(fd)
        finally:
            os.close(fd)
        want = expected_info(spec, sizes)
        have = info.max_entries
        others = [k for k in want if k != "max_entries" and getattr(info, k) != want[k]]
        if have == want["max_entries"] or others or IDLE_SIZE not in (have, want["max_entries"]):
            continue
        doomed.append(role)
    # A replaced ring's head goes first (unlink_ring_heads): a crash between the two unlinks leaves
    # the old ring without a head, which the next start recreates, never a kept head beside a new ring.
    removed = unlink_ring_heads(pin_path, [r for r in CT_QUEUES.values() if r in doomed])
    for role in doomed:
        os.unlink(os.path.join(pin_path, MAPS[role].name))
        removed.append(MAPS[role].name)
    return removed


def unlink_ring_heads(pin_path: str, replaced: Collection[str] = ()) -> list[str]:
    """Unpin each early-drop head (CTQ_HEADS) one of whose rings is not pinned, or is in `replaced`
    (roles about to be unpinned), so the load creates it anew, position 0, and writes only fresh
    heads (write_ring_slots). A kept head would be rewritten with the new ring's slot count while
    the last load's programs, attached until ours replace them, still queue in the old ring by the
    head they hold: at a smaller count they would reclaim flows they just queued, and a
    read-modify-write racing their adds loses one. Returns the names unpinned."""
    removed = []
    for head in sorted(set(CTQ_HEADS.values())):
        rings = [CT_QUEUES[t] for t, h in CTQ_HEADS.items() if h == head]
        path = os.path.join(pin_path, MAPS[head].name)
        if not os.path.exists(path):
            continue
        if all(r not in replaced and os.path.exists(os.path.join(pin_path, MAPS[r].name)) for r in rings):
            continue
        os.unlink(path)
        removed.append(MAPS[head].name)
    return removed


def stale_pins(pin_path: str) -> list[str]:
    """Pins in `pin_path` that are ekp maps but not this ABI version's (full paths, sorted)."""
    current = {spec.name for spec in MAPS.values()}
    try:
        names = os.listdir(pin_path)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(pin_path, n) for n in names if _PIN_NAME.match(n) and n not in current)


def mount_type(path: str, mounts: str) -> str:
    """The filesystem type of the mount holding `path` (already resolved), from /proc/self/mounts text.

    The last of equally long mount points wins: a later mount hides an earlier one on the same
    directory. A path that does not exist yet is on the filesystem of its nearest existing
    directory, which is what the longest matching mount point gives.
    """
    best, fstype = "", ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, parts[2]
    return fstype


def fs_type(path: str) -> str:
    """The filesystem type at `path`, or at the nearest existing directory that would hold it."""
    with open("/proc/self/mounts") as f:
        return mount_type(os.path.realpath(path), f.read())


def _on_bpffs(path: str) -> bool:
    """Whether `path` (or the existing directory holding it) is on a bpf filesystem."""
    return fs_type(path) == "bpf"


BPFFS_ROOT = "/sys/fs/bpf"


def ensure_bpffs(pin_path: str) -> bool:
    """Mount bpffs on /sys/fs/bpf when the pins go there and nothing is mounted yet.

    A fresh machine (and many container hosts) boots without it; kube-proxy replacements are
    expected to mount it themselves. Returns True when this call mounted it. Pins elsewhere are
    the operator's business: we only check them (see Datapath.load).
    """
    real = os.path.realpath(pin_path)
    if not (real == BPFFS_ROOT or real.startswith(BPFFS_ROOT + "/")) or _on_bpffs(BPFFS_ROOT):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"bpf", BPFFS_ROOT.encode(), b"bpf", 0, None) != 0:
        err = ctypes.get_errno()
        raise DatapathError(f"cannot mount bpffs on {BPFFS_ROOT}: {os.strerror(err)} (the agent needs root)")
    log.info("mounted bpffs on %s (it was missing; pinned maps live there)", BPFFS_ROOT)
    return True


# What the object declares as max_entries for a map sized at load (`load_sized`): the loader
# creates each with map_size's entries and checks a pin against those (link.link's `sizes`), so
# one compile serves every MapSizes. 1 keeps the compiler child's own maps (bcc creates them to
# compile) as small as they go.
SIZE_AT_LOAD = 1


def load_sized(spec: MapSpec) -> bool:
    """Whether MapSizes decides the map's max_entries (a flag, the tc IPv6 switch, a ring's
    table); the others' sizes are fixed by the C (`_Static_assert`s in bpf/ekp_maps.h)."""
    return spec.role in TC6_ROLES or spec.role in CT_QUEUES.values() or spec.sized_by in _SIZE_FIELDS


def compile_cflags(sizes: MapSizes, bpf_dir: Path, walk: SnatWalk) -> list[str]:
    """The compiler's flags: no size a MapSizes can change reaches the C (SIZE_AT_LOAD), the Maglev
    table size alone, which is ekp_maglev's value layout; and the SNAT walk's driver (`walk`,
    agent/ebpf/snatloop.py), so a node without bpf_loop has a build of its own."""
    flags = [f"-I{bpf_dir}", walk.cflag]
    flags += [
        f"-D{spec.size_macro}={SIZE_AT_LOAD if load_sized(spec) else map_size(spec, sizes)}"
        for spec in MAPS.values()
    ]
    flags.append(f"-DEKP_MAGLEV_TABLE_SIZE={sizes.maglev_table_size}")
    return flags


def load_sizes(sizes: MapSizes) -> dict[str, int]:
    """max_entries of each map sized at load, by map name, as the load creates it."""
    return {spec.name: map_size(spec, sizes) for spec in MAPS.values() if load_sized(spec)}


def write_ring_slots(maps: Mapping[str, BpfMap]) -> None:
    """Each early-drop ring's slot count into the low half of its head (bpf/ekp_abi.h,
    EKP_CTQH_SLOTS_MASK), read from the ring map's max_entries: the programs take it from there
    (ekp_ctq_af.h). Only a fresh head (count 0) is written: load() unpins a head whose ring is
    replaced or missing (unlink_ring_heads), and a head that holds its count already is left alone
    (every plain restart). A head in use is never meant to be rewritten: a program running
    meanwhile (an older load's, still attached) may lose one position add to this
    read-modify-write, and the next flow it queues then takes the same slot, reclaiming the flow
    just queued there; hence the warning if a non-zero count would change."""
    for ct_role, ring_role in CT_QUEUES.items():
        heads = maps[CTQ_HEADS[ct_role]]
        ring = CtqRing.TCP if ct_role in ("ct_tcp", "ct6_tcp") else CtqRing.ANY
        slots = maps[ring_role].info().max_entries
        key = ctypes.c_uint32(ring)
        old = heads.lookup(key)
        have = int(old.value) if old is not None else 0
        if have & CTQH_SLOTS_MASK == slots:
            continue  # every plain restart: no write races the running programs' adds
        if have & CTQH_SLOTS_MASK:
            # Ours must index the ring by its own size, so the count is written all the same.
            log.warning(
                "early-drop head %s[%s] held %d slots, its ring %s has %d: rewriting a head in use "
                "(the programs still attached may reclaim a flow they just queued); was a ring "
                "replaced behind the agent's back?",
                heads.spec.name,
                ring.name,
                have & CTQH_SLOTS_MASK,
                maps[ring_role].spec.name,
                slots,
            )
        heads.update(key, ctypes.c_uint64(have & ~CTQH_SLOTS_MASK | slots))


def ring_position(value: int) -> int:
    """Flows queued so far in a ring (mod 2^32), from its ekp_ctqh entry (the high half: see
    write_ring_slots)."""
    return value >> CTQH_POS_SHIFT


def ring_slots(value: int) -> int:
    """The slot count the programs take from an ekp_ctqh entry (the low half)."""
    return value & CTQH_SLOTS_MASK


class Datapath:
    """The compiled tc programs and their pinned maps. Construction has no side effects."""

    def __init__(
        self,
        pin_path: str,
        sizes: MapSizes | None = None,
        *,
        bpf_dir: str | Path | None = None,
        cache: ObjectCache | None = None,
    ):
        self.pin_path = os.path.abspath(pin_path)
        self.sizes = sizes if sizes is not None else MapSizes()
        self.bpf_dir = Path(bpf_dir) if bpf_dir is not None else default_bpf_dir()
        self.cache = cache if cache is not None else ObjectCache(default_cache_dir())
        self._prog_fds: dict[str, int] = {}
        self._maps: dict[str, BpfMap] = {}
        self._programs: dict[str, ProgSpec] = {}
        self._build: str | None = None
        self._walk: SnatWalk | None = None

    @property
    def entry_file(self) -> Path:
        return self.bpf_dir / ENTRY_FILE

    def snat_walk(self) -> SnatWalk:
        """The SNAT port walk's driver of this data path (agent/ebpf/snatloop.py decide), decided
        once: its build id must not change under a loaded data path."""
        if self._walk is None:
            self._walk = decide()
        return self._walk

    def cflags(self) -> list[str]:
        return compile_cflags(self.sizes, self.bpf_dir, self.snat_walk())

    def programs(self) -> dict[str, ProgSpec]:
        """The programs this data path loads: those this kernel can load (a kernel lacking what the
        socket programs need loads the data path without them, and says so), and the tc programs'
        IPv6 path (TC6_PROGRAMS) only where it serves (MapSizes.ipv6_tc): elsewhere nothing would
        reach them (its slots in ekp_calls6 stay empty), and their verification was a third of a
        cold start's. The XDP programs (ekp_xdp_net, ekp_xdp_net6) likewise only where XDP may
        attach (MapSizes.xdp): with --bpf-xdp=disabled nothing runs them, nor with best-effort
        where every external device is a veth (until one that is no veth appears: the proxier
        loads again with them then)."""
        wanted = set(PROGRAMS)
        if not self.sizes.ipv6_tc:
            wanted -= set(TC6_PROGRAMS)
        if not self.sizes.xdp:
            wanted -= {PROG_XDP_NET, PROG_XDP_NET6}
        has = vmlinux_has(kernel_needs())
        programs = {name: spec for name, spec in available_programs(has).items() if name in wanted}
        # Only what these sizes would load: a program left out anyway is no loss to warn about.
        missing = sorted(wanted - set(programs))
        if missing:
            lacking = {need for name in missing for need in PROGRAMS[name].needs} - has
            log.warning(
                "this kernel lacks %s: loading the data path without %s",
                ", ".join(sorted(lacking)),
                ", ".join(missing),
            )
        return programs

    def build(self) -> str:
        """The build id of what this data path compiles (agent.ebpf.compile.build_id): the object
        holds every program of the source, and no map size but the Maglev table's (compile_cflags),
        so agents of any sizes and either IPv6 switch share it, compiled once."""
        types = {name: spec.prog_type for name, spec in PROGRAMS.items()}
        return build_id(_inline_includes(self.entry_file, set()), self.cflags(), ABI_VERSION, types)

    def load_id(self, programs: Mapping[str, ProgSpec]) -> str:
        """What this load's programs are pinned under (`ekp_prog_<id>_<name>`): the build and which of
        its programs are loaded. A start that loads others (the tc IPv6 path switched on or off)
        pins them beside the last load's, whose program arrays stay until this load's programs
        replaced its attachments (release_older_builds), as a new build's always did."""
        h = hashlib.sha256("\0".join([self.build(), *sorted(programs)]).encode())
        return h.hexdigest()[:12]

    def source_text(self) -> str:
        """The program exactly as bcc compiles it: cflags, then ekp_tc.c with local includes inlined."""
        header = [
            f"// bcc: BPF(src_file={str(self.entry_file)!r}, cflags=[...]) with cflags:",
            *(f"//   {flag}" for flag in self.cflags()),
            "",
        ]
        return "\n".join(header) + _inline_includes(self.entry_file, set())

    @property
    def loaded(self) -> bool:
        return bool(self._prog_fds)

    def _pinned_map_ids(self) -> set[int]:
        """Ids of the maps pinned now (empty when one is missing: the programs must be rebuilt)."""
        ids = set()
        for spec in MAPS.values():
            fd = bpfsys.obj_get(os.path.join(self.pin_path, spec.name))
            if fd < 0:
                return set()
            try:
                ids.add(map_info(fd).id)
            finally:
                os.close(fd)
        return ids

    def load(self, maps_ready: Callable[[], None] | None = None, *, recompile: bool = True) -> None:
        """Compiles, creates or re-adopts the pinned maps, loads both programs, opens the maps.
        `maps_ready` is called once `maps` can be read and written: before the programs are loaded
        when they must be (from the compile cache or compiled now), so a first sync can fill the
        maps while the verifier runs; when the pinned programs are reused, at the end. If the load
        fails after that, its program fds are closed and its maps are left open: a writer the
        callback handed them to may be using them, so the caller closes them (close()) once it is
        done; before the callback, everything is closed. `recompile` False: a cached object that
        does not load is an error, not compiled again (a reload of the build an earlier load of
        this agent took from it: the cause is the load's, the kernel's, and a compile would cost
        tens of seconds to find the same)."""
        if self.loaded:
            if maps_ready is not None:
                maps_ready()
            return
        if not self.entry_file.is_file():
            raise DatapathError(f"{self.entry_file} not found (set {BPF_DIR_ENV} to the bpf/ directory)")
        ensure_bpffs(self.pin_path)
        # Checked before anything is created: a pin path elsewhere is an operator's mistake that no
        # retry fixes (the pre-flight said so already when the agent started).
        if not _on_bpffs(self.pin_path):
            raise FatalError(
                f"--bpf-pin-path {self.pin_path} is not on a bpf filesystem: use a directory under "
                f"{BPFFS_ROOT}, or mount one first (mount -t bpf bpf DIR)"
            )
        ensure_pin_dir(self.pin_path)
        resized = replace_resized_ipv6_pins(self.pin_path, self.sizes)
        if resized:
            heads = {MAPS[r].name for r in CTQ_HEADS.values()}
            log.info(
                "IPv6 conntrack, early-drop ring, fragment and host-routing tables %s recreated at %s "
                "(the tc programs' IPv6 path %s), and their rings' head %s with them (its 2 entries "
                "fresh): the IPv4 tables and their flows are kept",
                ", ".join(n for n in resized if n not in heads),
                "full size" if self.sizes.ipv6_tc else f"{IDLE_SIZE} entry each",
                "serves now" if self.sizes.ipv6_tc else "no longer serves",
                ", ".join(n for n in resized if n in heads) or "(none pinned)",
            )
        check_pins(self.pin_path, self.sizes)
        # A ring whose pin an operator removed (check_pins' remedy after a --bpf-ct-global-*-max
        # change) is created anew by the link: its head goes too, before the link opens it.
        for head in unlink_ring_heads(self.pin_path):
            log.info(
                "early-drop ring head %s recreated: one of its rings' pins was missing (the last "
                "load's programs keep the old head and ring until ours replace them)",
                head,
            )

        handed = False

        def opened() -> None:
            nonlocal handed
            self._open_maps()
            if maps_ready is not None:
                handed = True
                maps_ready()

        started = time.monotonic()
        try:
            programs = self.programs()
            build = self.load_id(programs)
            fds = open_pinned_programs(
                self.pin_path, build, list(programs), self._pinned_map_ids(), PRIVATE_MAPS
            )
            how = "reused (unchanged since it was compiled)"
            if fds is not None and not all(
                os.path.exists(prog_pin(self.pin_path, build, m)) for m in (*TAIL_CALLS, *BUILD_MAPS)
            ):
                # The program array went with its pin: empty, so loaded again with a new one.
                for fd in fds.values():
                    os.close(fd)
                fds = None
            if fds is None:
                fds, how = self._link(build, programs, opened, recompile=recompile)
            self._route_ipv6(build, fds)
            self._prog_fds = fds
            self._programs = programs
            self._build = build
            # Its program arrays stay pinned until our programs replaced its attachments
            # (release_older_builds, after the first attach); its hand-over mode too, read by
            # those programs.
            old = remove_other_builds(self.pin_path, build, keep=(*TAIL_CALLS, *BUILD_MAPS))
            if old:
                log.info("unpinned programs of another load: %s", ", ".join(old))
            log.info(
                "data path %s, build %s (ABI v%d, %d programs pinned as ekp_prog_%s_*, maps under %s), "
                "ready in %.2fs; %s",
                how,
                self.build(),
                ABI_VERSION,
                len(fds),
                build,
                self.pin_path,
                time.monotonic() - started,
                self.snat_walk().describe(),
            )
            if not self._maps:
                opened()
        except Exception:
            if handed:
                self._close_programs()
            else:
                self.close()
            raise

    def release_older_builds(self) -> list[str]:
        """Unpin what load() kept of older builds (their program arrays): to be called once this
        build's programs replaced theirs on every device. The names unpinned."""
        if self._build is None:
            return []
        return remove_other_builds(self.pin_path, self._build)

    def set_handover(self, mode: HandoverMode) -> None:
        """This build's hand-over mode (struct ekp_handover), read by its tc and XDP programs at each
        packet (bpf/ekp_decide.h)."""
        write_handover(self._handover_pin(), mode)

    def handover_mode(self) -> HandoverMode:
        """This build's hand-over mode as pinned: what a hand-over cut short (a failed start, an
        agent killed) left, OFF for a build that never started one."""
        return read_handover(self._handover_pin())

    def _handover_pin(self) -> str:
        if self._build is None:
            raise DatapathError("no build loaded: no hand-over mode")
        return prog_pin(self.pin_path, self._build, HANDOVER_MAP)

    def _route_ipv6(self, build: str, fds: Mapping[str, int]) -> None:
        """Fill the program arrays (TAIL_CALLS) when the tc programs' IPv6 path serves
        (MapSizes.ipv6_tc), empty them otherwise: an IPv6 packet then stops at the IPv4 programs'
        parser (a failed tail call and the parse, instead of the IPv6 program's parse and checks).
        Set at every load, reused programs too: the arrays are pinned with the build. The egress
        half (ekp_egress6) is filled before the ingress programs and emptied after them, as a
        first start attaches egress before ingress: an IPv6 packet the ingress path handed to the
        stack under legacy host routing never finds its egress half missing."""
        for array, names in TAIL_CALLS.items():
            fd = bpfsys.obj_get(prog_pin(self.pin_path, build, array))
            if fd < 0:
                raise DatapathError(f"opening program array {array} of build {build}: {os.strerror(-fd)}")
            slots = tail_call_order(names, filling=self.sizes.ipv6_tc)
            try:
                for index, name in slots:
                    key = ctypes.c_uint32(index)
                    if self.sizes.ipv6_tc and name in fds:
                        ret = bpfsys.map_update_elem(fd, key, ctypes.c_uint32(fds[name]))
                    else:
                        ret = bpfsys.map_delete_elem(fd, key)
                        ret = 0 if ret == -errno.ENOENT else ret
                    if ret < 0:
                        raise DatapathError(
                            f"setting slot {index} of program array {array}: {os.strerror(-ret)}"
                        )
            finally:
                os.close(fd)
        log.info("IPv6 packets on the tc and XDP hooks: %s", self._ipv6_route_text(fds))

    def _ipv6_route_text(self, fds: Mapping[str, int]) -> str:
        """Where IPv6 packets go, as _route_ipv6 set the program arrays: for the log line."""
        if not self.sizes.ipv6_tc:
            return (
                "passed to the stack at the IPv4 programs' parser (the tc programs' IPv6 path needs an "
                "IPv6 half and socket-level load balancing)"
            )
        tc = "continued in ekp_from_pod6 / ekp_from_net6 / ekp_egress6 (the tc programs' IPv6 path)"
        if PROG_XDP_NET6 in fds:
            return f"{tc}, and at XDP in {PROG_XDP_NET6}"
        why = (
            "no XDP program is loaded (--bpf-xdp=disabled, or best-effort with no external device "
            "taking native XDP)"
            if not self.sizes.xdp
            else "this kernel lacks bpf_xdp_load_bytes, Linux 5.18"
        )
        return f"{tc}; at XDP passed on to tc ({PROG_XDP_NET6} not loaded: {why})"

    def _open_maps(self) -> None:
        """Every pinned map on our own fds, each checked against the shape this agent expects."""
        if self._maps:
            return
        for role, spec in MAPS.items():
            m = BpfMap.open_pinned(sized_spec(spec, self.sizes), self.pin_path)
            self._maps[role] = m
            diffs = info_mismatches(spec, self.sizes, m.info())
            if diffs:
                raise PinMismatchError(f"{spec.name}: " + ", ".join(diffs) + f"; {_REMEDY}")
        write_ring_slots(self._maps)

    def _compile(self, build: str) -> tuple[BpfObject, str]:
        # Every program, whatever this load takes: bcc compiles each function whatever the running
        # kernel's helpers (a call is a number until the verifier sees it; kfuncs are patched in at
        # load), so the object serves every load of the build (Datapath.programs chooses).
        types = {name: spec.prog_type for name, spec in PROGRAMS.items()}
        try:
            obj, seconds = compile_in_child(self.entry_file, self.cflags(), build, types)
        except Exception as e:
            raise DatapathError(f"compiling {self.entry_file} failed: {e}") from e
        self.cache.put(obj)
        return obj, f"compiled in {seconds:.1f}s"

    def _link(
        self,
        load_id: str,
        programs: Mapping[str, ProgSpec],
        maps_pinned: Callable[[], None],
        *,
        recompile: bool = True,
    ) -> tuple[dict[str, int], str]:
        """Load `programs` of the build against our pins, pinned under `load_id`: from the cache, else
        compiled now; the program fds and how."""
        build = self.build()
        obj = self.cache.get(build)
        cached = obj is not None
        if obj is None:
            with self.cache.compiling(build):
                # Another agent may have compiled it while this one waited for the lock.
                obj = self.cache.get(build)
                cached = obj is not None
                if obj is None:
                    # Said before it starts: the compile is a cold start's longest step (tens of
                    # seconds on a busy node), and an operator (or the lab) watching the log
                    # should see why nothing is programmed yet.
                    log.info(
                        "%s%s (not in the compile cache): the data path is programmed once it is done",
                        COMPILING_LOG,
                        build,
                    )
                    obj, how = self._compile(build)
        if cached:
            how = "loaded from the compile cache (compiled by an earlier agent)"
        pinned = {spec.name for spec in MAPS.values()}

        def pin_of(name: str) -> str:
            return prog_pin(self.pin_path, load_id, name)

        while True:
            try:
                return link(
                    obj,
                    self.pin_path,
                    pinned,
                    pin_of,
                    maps_pinned if not self._maps else self._write_pinned_ring_slots,
                    sizes=load_sizes(self.sizes),
                    programs=programs,
                ), how
            except PinnedMapMismatch as e:
                raise PinMismatchError(f"{e}; {_REMEDY}") from e
            except (LinkError, OSError) as e:
                if cached and recompile:
                    # Whatever is wrong with the cached object, a fresh compile replaces it.
                    log.warning("cached data path %s did not load: %s; compiling it again", build, e)
                    log.info("%s%s (the cached one did not load)", COMPILING_LOG, build)
                    obj, how = self._compile(build)
                    cached = False
                    continue
                raise DatapathError(f"loading the data path (build {build}) failed: {e}") from e

    def _write_pinned_ring_slots(self) -> None:
        """write_ring_slots on the heads and rings pinned now, which link() opened: on a retry our
        own maps are open already, but a pin removed since was created anew by link(), and a new
        head left without its count would have the programs queue at `pos % 0`."""
        with contextlib.ExitStack() as stack:
            # Each map closed as soon as it is open: a later pin failing to open leaks none.
            opened = {
                role: stack.enter_context(
                    BpfMap.open_pinned(sized_spec(MAPS[role], self.sizes), self.pin_path)
                )
                for role in sorted({*CT_QUEUES.values(), *CTQ_HEADS.values()})
            }
            write_ring_slots(opened)

    def prog_fd(self, name: str) -> int:
        if name not in self._prog_fds:
            raise KeyError(f"no program {name!r} loaded (programs: {', '.join(self._prog_fds)})")
        return self._prog_fds[name]

    def has_program(self, name: str) -> bool:
        """Whether `name` was loaded (a kernel lacking what it needs loads the rest without it)."""
        return name in self._prog_fds

    @property
    def maps(self) -> Mapping[str, BpfMap]:
        """Role ("fe", "ct", ...) -> the pinned map, opened on our own fds."""
        return self._maps

    def repair_pins(self) -> list[str]:
        """Pins again every map whose pin is gone or now names another map (removed or replaced
        behind our back): the programs keep using the maps we hold, so the pins must name them too,
        or a restarted agent would start over with empty maps. Returns the names repaired."""
        repaired = []
        for spec in MAPS.values():
            m = self._maps.get(spec.role)
            if m is None:
                continue
            path = os.path.join(self.pin_path, spec.name)
            try:
                fd = obj_get(path)
            except FileNotFoundError:
                fd = -1
            except OSError as exc:
                log.warning("pin %s cannot be opened (%s): pinning our map again", path, exc.strerror)
                fd = -1
            if fd >= 0:
                try:
                    if map_info(fd).id == m.info().id:
                        continue
                finally:
                    os.close(fd)
                log.warning("pin %s names another map (replaced behind our back): pinning ours again", path)
                os.unlink(path)
            else:
                log.warning("pin %s is missing (removed behind our back): pinning our map again", path)
            os.makedirs(self.pin_path, mode=0o700, exist_ok=True)
            obj_pin(m.fd, path)
            repaired.append(spec.name)
        return repaired

    def close(self) -> None:
        """Closes our fds; pinned maps and attached programs stay in the kernel."""
        for m in self._maps.values():
            m.close()
        self._maps = {}
        self._close_programs()

    def _close_programs(self) -> None:
        for fd in self._prog_fds.values():
            os.close(fd)
        self._prog_fds = {}

    def __enter__(self) -> Datapath:
        self.load()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _inline_includes(path: Path, seen: set[Path]) -> str:
    out = [f"// ---- {path.name} ----"]
    for line in path.read_text().splitlines():
        m = re.match(r'\s*#include\s+"([^"]+)"', line)
        if m:
            inc = path.parent / m.group(1)
            if inc.is_file():
                # a template (no include guard) is compiled once per instance, so it is inlined at
                # each include: per family (bpf/ekp_ct_af.h), per hook (bpf/ekp_decide6_hook.h);
                # any other header once, as its guard says
                if inc not in seen or inc.name.endswith(("_af.h", "_hook.h")):
                    seen.add(inc)
                    out.append(_inline_includes(inc, seen))
                continue
        out.append(line)
    return "\n".join(out)
