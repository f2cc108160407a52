"""The IPv6 service maps, written by a second planner whose entries keep IPv4's shape.

The planner (agent/ebpf/planner.py) holds every entry as one int in the IPv4 structs' layout, with
a 32-bit address at a fixed place (entries.py). The IPv6 maps (bpf/ekp_abi.h, "IPv6 pairs") are the
same structs with the address 16 bytes wide, and the maps keyed by ids (slots, membership) are the
very same structs. So the IPv6 planner is the IPv4 one, run over the IPv6 family's ProxyState with
`ip` = `Handles.of`: each IPv6 address it meets is interned as a 32-bit handle, its entries are
IPv4-shaped ints holding handles, and `WideMap` turns a handle back into the 16-byte address at the
map boundary (writes, deletions, the read-back at start and at full syncs). One planner, one
writer, one set of delta, re-adoption and capacity rules for both families.

Handles are numbered in the order addresses are first met, from 1, and are never reused while the
planner lives (an int the planner holds may name one). A restart, or `Ipv6Datapath` when the book
has grown well past the addresses in use (churn of pod addresses), starts a new planner and book,
which re-adopt what the maps hold: a re-plan over unchanged state writes nothing.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from agent.config import Config, NodeContext
from agent.ebpf import abi
from agent.ebpf.entries import key_size, value_size
from agent.ebpf.maps import MapWriter, write_config6
from agent.ebpf.planner import ROLES, FlushResult, Planner, RawMap
from agent.model.types import ProxyState, ServicePortName
from agent.proxier import SyncResult

log = logging.getLogger(__name__)

_WIDER = 12  # bytes an IPv6 address adds to an IPv4 struct


class Handles:
    """IPv6 addresses interned as nonzero 32-bit handles (see the module doc)."""

    def __init__(self) -> None:
        self._by_addr: dict[bytes, int] = {}
        self._addrs: list[bytes] = [bytes(16)]  # handle 0: no address

    def __len__(self) -> int:
        return len(self._addrs) - 1

    def of(self, ip: str) -> int:
        """The handle of an IPv6 address in text form (the planner's `ip`)."""
        return self.of_packed(socket.inet_pton(socket.AF_INET6, ip))

    def of_packed(self, packed: bytes) -> int:
        handle = self._by_addr.get(packed)
        if handle is None:
            handle = len(self._addrs)
            if handle > 0xFFFFFFFF:
                raise OverflowError("more than 2**32 IPv6 addresses interned")
            self._by_addr[packed] = handle
            self._addrs.append(packed)
        return handle

    def packed(self, handle: int) -> bytes:
        return self._addrs[handle]


def _addr_offset(narrow: Any, wide: Any) -> int:
    """Where the address of an IPv4 struct is; its IPv6 twin has the same fields with the address
    16 bytes wide (checked: everything after it is 12 bytes further)."""
    off: int = narrow.addr.offset
    assert wide.addr.offset == off and wide.addr.size == 16, wide
    for name, *_ in narrow._fields_:
        if name.startswith("pad") and not hasattr(wide, name):
            continue
        shift = _WIDER if getattr(narrow, name).offset > off else 0
        assert getattr(wide, name).offset == getattr(narrow, name).offset + shift, (wide, name)
    return off


# role -> (address offset in the key, in the value): None where that side holds no address
_WIDENED: dict[str, tuple[int | None, int | None]] = {}
for _role, _role6 in abi.V6_ROLES.items():
    _spec, _spec6 = abi.MAPS[_role], abi.MAPS[_role6]
    _k = _addr_offset(_spec.key, _spec6.key) if _spec.key is not _spec6.key else None
    _v = _addr_offset(_spec.value, _spec6.value) if _spec.value is not _spec6.value else None
    _WIDENED[_role] = (_k, _v)


class WideMap:
    """An IPv6 map seen by the IPv6 planner: IPv4-shaped entries with handles in, the map's 16-byte
    addresses out (and back, for a read). `role` is the IPv4 role the planner knows it by."""

    def __init__(self, role: str, inner: MapWriter, handles: Handles) -> None:
        self.role = role
        self.inner = inner
        self.handles = handles
        self._koff, self._voff = _WIDENED[role]
        self._ks, self._vs = key_size(role), value_size(role)

    def _widen(self, data: bytes, size: int, off: int | None) -> bytes:
        if off is None:
            return data
        packed = self.handles.packed
        out = []
        for i in range(0, len(data), size):
            item = data[i : i + size]
            handle = int.from_bytes(item[off : off + 4], "little")
            out.append(item[:off] + packed(handle) + item[off + 4 :])
        return b"".join(out)

    def _narrow(self, data: bytes, size: int, off: int | None) -> bytes:
        if off is None:
            return data
        of = self.handles.of_packed
        wide = size + _WIDER
        out = []
        for i in range(0, len(data), wide):
            item = data[i : i + wide]
            out.append(item[:off] + of(item[off : off + 16]).to_bytes(4, "little") + item[off + 16 :])
        return b"".join(out)

    def update_packed(self, keys: bytes, values: bytes) -> int:
        return self.inner.update_packed(
            self._widen(keys, self._ks, self._koff), self._widen(values, self._vs, self._voff)
        )

    def delete_packed(self, keys: bytes) -> None:
        self.inner.delete_packed(self._widen(keys, self._ks, self._koff))

    def dump_raw(self) -> tuple[bytes, bytes]:
        keys, values = self.inner.dump_raw()
        return self._narrow(keys, self._ks, self._koff), self._narrow(values, self._vs, self._voff)

    def capacity(self) -> int:
        return self.inner.capacity()


# An IPv6 frontend by (address, port, protocol) -> its svc_id: what a sync is about to write into
# ekp_fe6 (`Ipv6Datapath.sync`'s `before_frontends`)
Frontends6 = dict[tuple[str, int, int], int]


def carry6_guarded(carry: Callable[[], None]) -> None:
    """Runs the first IPv6 sync's carry of nf_conntrack's IPv6 UDP flows (`_FirstFrontends`, and
    EbpfProxier.sync6 when that sync writes no frontend) so that nothing it raises stops the sync:
    raised through the flush, it reset the planner, and every later IPv6 sync (each a first one
    again) failed the same way, the frontends never written. Losing the carry costs those flows
    their backend at worst; losing the frontends costs the tc IPv6 path."""
    try:
        carry()
    except Exception:
        log.warning(
            "IPv6 UDP flows not carried from nf_conntrack at the first IPv6 sync (a bug, please report"
            " the traceback below): their next datagrams may reach another backend; the IPv6"
            " frontends are written all the same",
            exc_info=True,
        )


class _FirstFrontends(WideMap):
    """ekp_fe6 as the planner writes it, calling `hook` once with the frontends of the first write,
    before it (`Ipv6Datapath.sync`'s `before_frontends`). The writer writes ekp_fe6 last (writer.py's
    WRITE_ORDER), so the backends and memberships of those frontends are in their maps then.
    The hook sees that one batch, not what the sync finally writes: on a map that held none it is
    every frontend, but a frontend the write then refuses (ekp_fe6 full: it is taken back out, the
    service port failed) was seen, and one the writer's retry pass writes later was not (its
    flows are carried by no one: tc decides them as new). A flow carried for a frontend then taken
    back out keeps its ekp_ct6_any entries (its backend) until they expire.
    Whatever the hook raises is logged, and the write goes on (`carry6_guarded`)."""

    def __init__(self, wide: WideMap, hook: Callable[[Frontends6], None]) -> None:
        super().__init__(wide.role, wide.inner, wide.handles)
        self._hook: Callable[[Frontends6], None] | None = hook

    def update_packed(self, keys: bytes, values: bytes) -> int:
        if self._hook is not None:
            hook, self._hook = self._hook, None
            carry6_guarded(lambda: hook(self._frontends(keys, values)))
        return super().update_packed(keys, values)

    def _frontends(self, keys: bytes, values: bytes) -> Frontends6:
        wide = self._widen(keys, self._ks, self._koff)
        ksize, vsize = ctypes.sizeof(abi.Frontend6Key), ctypes.sizeof(abi.Frontend)
        out: Frontends6 = {}
        for i in range(len(wide) // ksize):
            key = abi.Frontend6Key.from_buffer_copy(wide, i * ksize)
            value = abi.Frontend.from_buffer_copy(values, i * vsize)
            out[(abi.ip6_str(key.addr), abi.port_host(key.port), key.proto)] = value.svc_id
        return out


def config6_of(node: NodeContext) -> abi.Config6:
    """The IPv6 path's settings (ekp_cfg6) for `node`: its primary address, the source of IPv6 SNAT
    (bpf/ekp_tc6.h), as the IPv4 config takes the IPv4 one. Zero (those flows are left to
    ip6tables' masquerade) when the node has no IPv6 address: an IPv4 node context, as an agent
    without an IPv6 half empties the IPv6 maps with."""
    cfg6 = abi.Config6()
    if node.primary_ip and ipaddress.ip_address(node.primary_ip).version == 6:
        cfg6.node_addr = abi.Addr6(*abi.ip6_words(node.primary_ip))
    return cfg6


def _ipv6_names(text: str) -> str:
    for role, role6 in abi.V6_ROLES.items():
        text = text.replace(abi.MAPS[role].name, abi.MAPS[role6].name)
    return text


def render_plan6(state: ProxyState, node: NodeContext, config: Config) -> str:
    """What a first IPv6 sync on an empty node writes, decoded as `agent inspect maps6` prints it
    (`--dry-run` in eBPF mode)."""
    from agent.ebpf.maps import FakeMap
    from agent.ebpf.render6 import render_contents6

    handles = Handles()
    planner = Planner(config, ip=handles.of)
    planner.update(state, node, None)
    maps = {role6: FakeMap(abi.MAPS[role6]) for role6 in abi.V6_ROLES.values()}
    planner.flush({role: WideMap(role, maps[role6], handles) for role, role6 in abi.V6_ROLES.items()})
    return render_contents6({role6: m.items() for role6, m in maps.items()})


class Ipv6Datapath:
    """The IPv6 service maps of a loaded data path, kept by the IPv6 family's own planner.

    `sync` is EbpfProxier.sync's map half for IPv6: a planner made at the first call re-adopts what
    the pinned maps hold (a restart over unchanged state writes nothing), full syncs read the maps
    back and repair them, partial ones write what the changed ports changed; and the IPv6 path's
    settings (ekp_cfg6: the node's IPv6 address, its SNAT source, while the caller grants it, else
    zero: `snat_source`). Capacity: a map too
    small is logged with the flag that sizes it (its IPv4 twin's), and the ports that do not fit are
    reported as failed, as for IPv4."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._planner: Planner | None = None
        self._handles = Handles()
        self._short: dict[str, int] = {}
        self.last_flush = FlushResult()  # what the last sync wrote, for logs and tests

    @property
    def planner(self) -> Planner | None:
        return self._planner

    def maps(self, maps: Mapping[str, MapWriter]) -> dict[str, WideMap]:
        """The IPv6 maps under the planner's (IPv4) role names."""
        return {role: WideMap(role, maps[abi.V6_ROLES[role]], self._handles) for role in ROLES}

    def sync(
        self,
        maps: Mapping[str, MapWriter],
        state: ProxyState,
        node: NodeContext,
        changed: frozenset[ServicePortName] | None,
        *,
        snat_source: bool = False,
        before_frontends: Callable[[Frontends6], None] | None = None,
    ) -> SyncResult:
        """`snat_source`: ekp_cfg6 gets the node's address (granted: EbpfProxier._snat6_granted);
        without it, zero (no source translation by tc: ip6tables masquerades those flows), also
        over an address written before (a grant lost, or a restart's stale pin).
        `before_frontends`: called once, before the first write to ekp_fe6 (after every other map's
        writes), with the frontends that write adds (all of them on a map that held none: the
        writer writes a first sync's entries in one batch per map); not called when ekp_fe6 gets
        no write."""
        start = self._clock()
        if self._planner is not None and changed is None and self._grown():
            log.info(
                "IPv6 eBPF planner: %d addresses interned for %d in use: a new planner re-adopts the maps",
                len(self._handles),
                len(self._planner.desired["addr"]),
            )
            self._planner = None
        first = self._planner is None
        if first:
            self._handles = Handles()
            self._planner = Planner(self._config, ip=self._handles.of)
        planner = self._planner
        assert planner is not None
        wide = self.maps(maps)
        repaired = 0
        flushed: dict[str, WideMap] = dict(wide)
        if before_frontends is not None:
            flushed["fe"] = _FirstFrontends(wide["fe"], before_frontends)
        if first or changed is None:
            try:
                dump = {role: wide[role].dump_raw() for role in ROLES}
                differ = planner.reconcile(dump, adopt=first)
            except BaseException:
                if first:
                    self._planner = None  # as the IPv4 sync: the retry adopts the maps again
                raise
            repaired = 0 if first else differ
            changed = None
        planner.update(state, node, changed)
        self._check_room(planner, maps)
        cfg6 = config6_of(node) if snat_source else abi.Config6()
        if write_config6(maps, cfg6):
            source = abi.ip6_str(cfg6.node_addr) if any(cfg6.node_addr) else "none (ip6tables masquerades)"
            log.info("IPv6 SNAT source of the tc programs: %s", source)
        try:
            result = planner.flush(cast(Mapping[str, RawMap], flushed))
        except Exception:
            self._planner = None  # what the maps hold is unknown: read them back next time
            raise
        self.last_flush = result
        result.log(
            " (IPv6)",
            first=first,
            frontends=len(planner.desired["fe"]),
            backends=len(planner.desired["be"]),
            repaired=repaired,
            ms=(self._clock() - start) * 1000,
        )
        # the writer names the IPv4 map of the role in a port's failure: name the IPv6 one it wrote
        failed = {spn: _ipv6_names(why) for spn, why in result.failed.items()}
        return SyncResult(full=changed is None, failed=failed, repaired=repaired)

    def _grown(self) -> bool:
        """The book holds far more addresses than the maps use (each frontend and backend address
        is one `addr` entry; source ranges add a few)."""
        assert self._planner is not None
        live = len(self._planner.desired["addr"]) + len(self._planner.desired["srcr"])
        return len(self._handles) > 2 * live + 4096

    def _check_room(self, planner: Planner, maps: Mapping[str, MapWriter]) -> None:
        for role in ROLES:
            spec = abi.MAPS[abi.V6_ROLES[role]]
            wanted, room = len(planner.desired[role]), maps[spec.role].capacity()
            if wanted <= room:
                if self._short.pop(role, None) is not None:
                    log.info("BPF map %s holds the desired state again", spec.name)
                continue
            if wanted > self._short.get(role, 0):
                log.error(
                    "BPF map %s is too small: the IPv6 desired state needs %d entries, it holds %d. IPv6 "
                    "service ports that do not fit are not programmed (every other one is). Start the "
                    "agent with %s=%d or more (it sizes the IPv4 and the IPv6 map); a new size recreates "
                    "the map, so run `agent --cleanup` first",
                    spec.name,
                    wanted,
                    room,
                    spec.size_flag,
                    wanted + wanted // 4,
                )
                self._short[role] = wanted
