"""The IPv6 service maps, socket and conntrack entries as text, for `agent inspect maps6`,
`sockets` and `ct`.

The lines of agent/ebpf/render.py with a 6 after the map's word and the address in brackets
(`fe6 [fd00:10:96::a]:80/TCP internal -> ...`); the id-keyed maps (slots, membership) read as
IPv4's, from their IPv6 twins.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from agent.ebpf.abi import (
    Addr,
    Addr6Key,
    AddrFlag,
    Backend6,
    BackendFlag,
    BackendKey,
    Ct6Entry,
    Ct6Key,
    CtDir,
    CtFlag,
    Frontend,
    Frontend6Key,
    Member,
    MemberKey,
    RevNat6,
    RevNatKey,
    Slot,
    SlotKey,
    Sock6Key,
    Sock6Nat,
    SrcRange,
    SrcRange6Key,
    ip6_str,
    port_host,
)
from agent.ebpf.render import _age, _scope, fe_tail, flag_names, member_line, proto_name, slot_line

Items = Iterable[tuple[object, object]]


def _at(words: object, port: int) -> str:
    return f"[{ip6_str(words)}]:{port_host(port)}"


def fe6_line(key: Frontend6Key, fe: Frontend) -> str:
    return f"fe6 {_at(key.addr, key.port)}/{proto_name(key.proto)} {_scope(key.scope)}" + fe_tail(fe)


def be6_line(key: BackendKey, be: Backend6) -> str:
    line = f"be6 {key.id} -> {_at(be.addr, be.port)}/{proto_name(be.proto)}"
    if be.flags:
        line += " " + flag_names(be.flags, BackendFlag, ",").lower()
    return line


def render_contents6(maps: Mapping[str, Items]) -> str:
    """Every entry of the IPv6 service maps (`maps`: role -> its items), one a line, sorted."""
    lines: list[str] = []
    fes = [(k, v) for k, v in maps["fe6"] if isinstance(k, Frontend6Key) and isinstance(v, Frontend)]
    fes.sort(key=lambda kv: (bytes(kv[0].addr), port_host(kv[0].port), kv[0].proto, kv[0].scope))
    lines += [fe6_line(k, v) for k, v in fes]
    slots = [(k, v) for k, v in maps["slot6"] if isinstance(k, SlotKey) and isinstance(v, Slot)]
    lines += [
        "slot6" + slot_line(k, v)[4:] for k, v in sorted(slots, key=lambda kv: (kv[0].set_id, kv[0].slot))
    ]
    bes = [(k, v) for k, v in maps["be6"] if isinstance(k, BackendKey) and isinstance(v, Backend6)]
    lines += [be6_line(k, v) for k, v in sorted(bes, key=lambda kv: kv[0].id)]
    members = [(k, v) for k, v in maps["member6"] if isinstance(k, MemberKey) and isinstance(v, Member)]
    members.sort(key=lambda kv: (kv[0].svc_id, kv[0].backend_id))
    lines += ["member6" + member_line(k, v)[6:] for k, v in members]
    rnats = [(k, v) for k, v in maps["rnat6"] if isinstance(k, RevNatKey) and isinstance(v, RevNat6)]
    lines += [f"rnat6 {k.id} -> {_at(v.addr, v.port)}" for k, v in sorted(rnats, key=lambda kv: kv[0].id)]
    ranges = [(k, v) for k, v in maps["srcr6"] if isinstance(k, SrcRange6Key) and isinstance(v, SrcRange)]
    ranges.sort(key=lambda kv: (kv[0].rev_nat_id, bytes(kv[0].addr), kv[0].prefixlen))
    for rk, rv in ranges:
        verdict = "allow" if rv.allow else f"allow={rv.allow}"
        lines.append(f"srcr6 rnat={rk.rev_nat_id} {ip6_str(rk.addr)}/{rk.prefixlen - 32} -> {verdict}")
    addrs = [(k, v) for k, v in maps["addr6"] if isinstance(k, Addr6Key) and isinstance(v, Addr)]
    for k, v in sorted(addrs, key=lambda kv: bytes(kv[0].addr)):
        lines.append(f"addr6 {ip6_str(k.addr)} -> {flag_names(v.flags, AddrFlag, ',').lower()}")
    return "".join(line + "\n" for line in lines)


def sock6_lines(entries: Items) -> list[str]:
    """Where each IPv6 socket was sent (ekp_sknat6), as render_sockets' `sock` lines."""
    items = [(k, v) for k, v in entries if isinstance(k, Sock6Key) and isinstance(v, Sock6Nat)]
    items.sort(key=lambda kv: (kv[0].cookie, kv[0].proto, bytes(kv[0].addr), kv[0].port))
    return [
        f"sock6 {k.cookie} {_at(k.addr, k.port)}/{proto_name(k.proto)} shown as "
        f"{_at(v.fe_addr, v.fe_port)} svc={v.svc_id} be={v.backend_id}"
        for k, v in items
    ]


def ct6_line(key: Ct6Key, ct: Ct6Entry, now_ns: int) -> str:
    """One entry of the tc programs' IPv6 conntrack, as render.ct_line's (`snat=`: the node's IPv6
    address and port a masqueraded flow leaves with, or the client's own address with a port remapped
    around a live flow's reply tuple); `now_ns` is CLOCK_MONOTONIC."""
    try:
        direction = CtDir(key.dir).name.lower()
    except ValueError:
        direction = f"dir{key.dir}"
    line = (
        f"ct6 {_at(key.saddr, key.sport)} -> {_at(key.daddr, key.dport)}/{proto_name(key.proto)} "
        f"{direction} fe={_at(ct.fe_addr, ct.fe_port)}"
    )
    if any(ct.nat_addr):
        line += f" nat={_at(ct.nat_addr, ct.nat_port)}"
    if any(ct.snat_addr):
        line += f" snat={_at(ct.snat_addr, ct.snat_port)}"
    return (
        line + f" svc={ct.svc_id} be={ct.backend_id} flags={flag_names(ct.flags, CtFlag)}"
        f" idle={_age(ct.last_seen_ns, now_ns)} age={max(0, now_ns // 1_000_000_000 - ct.created_s)}s"
    )


def ct6_lines(entries: Items, now_ns: int) -> list[str]:
    """Every IPv6 conntrack entry (ekp_ct6_tcp, ekp_ct6_any), sorted as render_conntrack's."""
    items = [(k, v) for k, v in entries if isinstance(k, Ct6Key) and isinstance(v, Ct6Entry)]
    items.sort(
        key=lambda kv: (
            bytes(kv[0].saddr),
            port_host(kv[0].sport),
            bytes(kv[0].daddr),
            port_host(kv[0].dport),
            kv[0].proto,
            kv[0].dir,
        )
    )
    return [ct6_line(k, v, now_ns) for k, v in items]
