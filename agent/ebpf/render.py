"""Map entries as sorted, decoded text: the `--dry-run` output, golden files and `agent inspect`.

Pure. One entry a line, addresses and ports in host notation, flags by name, lines sorted by
their numeric fields (so `10.96.0.2` comes before `10.96.0.10`), sections in a fixed order:

    cfg node=192.168.0.11 snat_ports=61000-65535 tcp=86400s/3600s/60s/10s tcp_backend_gone=300s \
        udp=30s/120s icmp=1000/s,50 host_routing=legacy                 (one line)
    fe 10.96.0.10:53/UDP internal -> svc=2 set=3 count=2 rnat=5 flags=AFFINITY affinity=10800s
    slot 3#1 -> be 7
    be 7 -> 10.244.1.2:53/UDP local
    member svc=2 be 7 -> cluster|local
    rnat 5 -> 10.96.0.10:53
    srcr rnat=5 203.0.113.0/24 -> allow

(tcp= established/close-wait/syn/closed timeouts; tcp_backend_gone= what a TCP flow whose backend
left lives after the backend's last packet; udp= unreplied/stream; icmp= rejects per second and
burst, per CPU; host_routing= --bpf-host-routing.)

The same text comes from a plan (dry run) and from dumping live maps (inspect), so the two can be
compared with `diff`. A dry run may add `# ns/name:port` after each frontend (`names`).
Conntrack, affinity and counters render here too, for `agent inspect`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum

from agent.ebpf.abi import (
    Addr,
    AddrFlag,
    AddrKey,
    Affinity,
    AffinityKey,
    Backend,
    BackendFlag,
    BackendKey,
    ConfigFlag,
    CtDir,
    CtEntry,
    CtFlag,
    CtKey,
    Frontend,
    FrontendFlag,
    FrontendKey,
    Member,
    MemberFlag,
    MemberKey,
    RevNat,
    RevNatKey,
    Scope,
    Slot,
    SlotKey,
    SockConfig,
    SockFlag,
    SockKey,
    SockNat,
    SrcRange,
    SrcRangeKey,
    Stat,
    ip_str,
    port_host,
)
from agent.ebpf.abi import Config as CfgEntry
from agent.ebpf.plan import MapContents

_PROTOS = {6: "TCP", 17: "UDP", 132: "SCTP"}


def proto_name(proto: int) -> str:
    return _PROTOS.get(proto, str(proto))


def flag_names(value: int, flags: type[IntEnum], sep: str = "|") -> str:
    """`NODEPORT|SNAT_REMOTE`; unknown bits as hex; `-` for none."""
    names = [f.name for f in flags if value & f.value]
    rest = value & ~sum(f.value for f in flags)
    if rest:
        names.append(f"{rest:#x}")
    return sep.join(names) or "-"


def _ip_sort(be: int) -> int:
    return int(ipaddress.IPv4Address(ip_str(be)))


def _scope(scope: int) -> str:
    try:
        return Scope(scope).name.lower()
    except ValueError:
        return f"scope{scope}"


def cfg_line(cfg: CfgEntry) -> str:
    line = (
        f"cfg node={ip_str(cfg.node_addr)} snat_ports={cfg.snat_port_min}-{cfg.snat_port_max}"
        f" tcp={cfg.tcp_established_s}s/{cfg.tcp_close_wait_s}s/{cfg.tcp_syn_s}s/{cfg.tcp_closed_s}s"
        f" tcp_backend_gone={cfg.tcp_orphan_s}s"
        f" udp={cfg.udp_s}s/{cfg.udp_stream_s}s icmp={cfg.icmp_rate}/s,{cfg.icmp_burst}"
    )
    if cfg.flags & ConfigFlag.LOCAL_BY_SRC:
        line += f" local_src={ip_str(cfg.local_net)}/{cfg.local_plen}"
    line += " host_routing=" + ("legacy" if cfg.flags & ConfigFlag.HOST_LEGACY else "bpf")
    rest = cfg.flags & ~(ConfigFlag.LOCAL_BY_SRC | ConfigFlag.HOST_LEGACY)
    return line + (f" flags={rest:#x}" if rest else "")


def fe_line(key: FrontendKey, fe: Frontend, name: str = "") -> str:
    line = f"fe {ip_str(key.addr)}:{port_host(key.port)}/{proto_name(key.proto)} {_scope(key.scope)}"
    return line + fe_tail(fe) + (f"  # {name}" if name else "")


def fe_tail(fe: Frontend) -> str:
    """What a frontend line says after its key (both families)."""
    return (
        f" -> svc={fe.svc_id} set={fe.set_id} count={fe.count} rnat={fe.rev_nat_id}"
        f" flags={flag_names(fe.flags, FrontendFlag)} affinity={fe.affinity_timeout}s"
    )


def slot_line(key: SlotKey, slot: Slot) -> str:
    return f"slot {key.set_id}#{key.slot} -> be {slot.backend_id}"


def be_line(key: BackendKey, be: Backend) -> str:
    line = f"be {key.id} -> {ip_str(be.addr)}:{port_host(be.port)}/{proto_name(be.proto)}"
    if be.flags:
        line += " " + flag_names(be.flags, BackendFlag, ",").lower()
    return line


def member_line(key: MemberKey, member: Member) -> str:
    return f"member svc={key.svc_id} be {key.backend_id} -> {flag_names(member.flags, MemberFlag).lower()}"


def rnat_line(key: RevNatKey, rnat: RevNat) -> str:
    return f"rnat {key.id} -> {ip_str(rnat.addr)}:{port_host(rnat.port)}"


def srcr_line(key: SrcRangeKey, value: SrcRange) -> str:
    verdict = "allow" if value.allow else f"allow={value.allow}"
    return f"srcr rnat={key.rev_nat_id} {ip_str(key.addr)}/{key.prefixlen - 32} -> {verdict}"


def addr_line(key: AddrKey, value: Addr) -> str:
    return f"addr {ip_str(key.addr)} -> {flag_names(value.flags, AddrFlag, ',').lower()}"


def render_contents(contents: MapContents, names: Mapping[FrontendKey, str] | None = None) -> str:
    """Every entry of `contents`, one a line, sorted; `names` annotate the frontends."""
    lines: list[str] = []
    if contents.cfg is not None:
        lines.append(cfg_line(contents.cfg))
    for fkey, fe in sorted(
        contents.fe.items(),
        key=lambda kv: (_ip_sort(kv[0].addr), port_host(kv[0].port), kv[0].proto, kv[0].scope),
    ):
        lines.append(fe_line(fkey, fe, (names or {}).get(fkey, "")))
    for skey, slot in sorted(contents.slot.items(), key=lambda kv: (kv[0].set_id, kv[0].slot)):
        lines.append(slot_line(skey, slot))
    for bkey, be in sorted(contents.be.items(), key=lambda kv: kv[0].id):
        lines.append(be_line(bkey, be))
    for mkey, member in sorted(contents.member.items(), key=lambda kv: (kv[0].svc_id, kv[0].backend_id)):
        lines.append(member_line(mkey, member))
    for rkey, rnat in sorted(contents.rnat.items(), key=lambda kv: kv[0].id):
        lines.append(rnat_line(rkey, rnat))
    for srkey, sr in sorted(
        contents.srcr.items(), key=lambda kv: (kv[0].rev_nat_id, _ip_sort(kv[0].addr), kv[0].prefixlen)
    ):
        lines.append(srcr_line(srkey, sr))
    for akey, addr in sorted(contents.addr.items(), key=lambda kv: _ip_sort(kv[0].addr)):
        lines.append(addr_line(akey, addr))
    return "".join(line + "\n" for line in lines)


# ---------------------------------------------------------------------------------- inspect


def _age(last_seen_ns: int, now_ns: int) -> str:
    return f"{max(0, now_ns - last_seen_ns) // 1_000_000_000}s"


def ct_line(key: CtKey, ct: CtEntry, now_ns: int) -> str:
    """One conntrack entry; `now_ns` is CLOCK_MONOTONIC (the clock of bpf_ktime_get_ns)."""
    try:
        direction = CtDir(key.dir).name.lower()
    except ValueError:
        direction = f"dir{key.dir}"
    line = (
        f"ct {ip_str(key.saddr)}:{port_host(key.sport)} -> {ip_str(key.daddr)}:{port_host(key.dport)}"
        f"/{proto_name(key.proto)} {direction} fe={ip_str(ct.fe_addr)}:{port_host(ct.fe_port)}"
    )
    if ct.nat_addr:
        line += f" nat={ip_str(ct.nat_addr)}:{port_host(ct.nat_port)}"
    if ct.snat_addr:
        line += f" snat={ip_str(ct.snat_addr)}:{port_host(ct.snat_port)}"
    return (
        line + f" svc={ct.svc_id} be={ct.backend_id} flags={flag_names(ct.flags, CtFlag)}"
        f" idle={_age(ct.last_seen_ns, now_ns)} age={max(0, now_ns // 1_000_000_000 - ct.created_s)}s"
    )


def render_conntrack(entries: Iterable[tuple[CtKey, CtEntry]], now_ns: int) -> str:
    items = sorted(
        entries,
        key=lambda kv: (
            _ip_sort(kv[0].saddr),
            port_host(kv[0].sport),
            _ip_sort(kv[0].daddr),
            port_host(kv[0].dport),
            kv[0].proto,
            kv[0].dir,
        ),
    )
    return "".join(ct_line(k, v, now_ns) + "\n" for k, v in items)


def aff_line(key: AffinityKey, aff: Affinity, now_ns: int) -> str:
    idle = _age(aff.last_seen_ns, now_ns)
    return f"aff {ip_str(key.client)} svc={key.svc_id} -> be {aff.backend_id} idle={idle}"


def render_affinity(entries: Iterable[tuple[AffinityKey, Affinity]], now_ns: int) -> str:
    items = sorted(entries, key=lambda kv: (kv[0].svc_id, _ip_sort(kv[0].client)))
    return "".join(aff_line(k, v, now_ns) + "\n" for k, v in items)


def render_stats(counters: Mapping[int, int | Sequence[int]], prefix: str = "stat") -> str:
    """Counters by enum ekp_stat index; per-CPU lists are summed. Every known counter is listed,
    each line starting with `prefix` (`stat`: the tc programs', `xdp`: the XDP program's)."""
    lines = []
    for stat in Stat:
        raw = counters.get(int(stat), 0)
        total = raw if isinstance(raw, int) else sum(raw)
        lines.append(f"{prefix} {stat.name.lower()} {total}")
    return "".join(line + "\n" for line in lines)


def _runs(values: Sequence[int]) -> str:
    """`1 2x3 1`: a run of equal values as value x count."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(f"{values[i]}x{j - i}" if j - i > 1 else str(values[i]))
        i = j
    return " ".join(out)


def render_maglev(
    tables: Mapping[int, Sequence[int]],
    backends: Mapping[int, str],
    frontends: Mapping[int, Sequence[str]],
    head: int = 32,
) -> str:
    """Each Maglev table in a few lines: the frontends that use it, every backend's share, the
    first `head` positions run-length encoded, and a digest of the table by backend *address*
    (ids are each node's own): two nodes whose digests match choose alike for every flow."""
    import hashlib

    lines = []
    for set_id in sorted(tables):
        table = tables[set_id]
        fes = ", ".join(sorted(frontends.get(set_id, ()))) or "no frontend"
        by_name = "\n".join(backends.get(b, f"be{b}") for b in table).encode()
        digest = hashlib.sha256(by_name).hexdigest()[:12]
        lines.append(f"maglev set {set_id} size={len(table)} digest={digest} <- {fes}")
        shares: dict[int, int] = {}
        for b in table:
            shares[b] = shares.get(b, 0) + 1
        for b, n in sorted(shares.items(), key=lambda kv: (-kv[1], kv[0])):
            name = backends.get(b, "missing")
            lines.append(f"maglev set {set_id} be {b} {name} positions={n} share={100 * n / len(table):.2f}%")
        lines.append(f"maglev set {set_id} positions 0-{min(head, len(table)) - 1}: {_runs(table[:head])}")
    return "".join(line + "\n" for line in lines)


def render_sockets(
    config: SockConfig | None,
    links: Mapping[str, tuple[int, int, int]],
    entries: Iterable[tuple[SockKey, SockNat]],
) -> str:
    """The socket programs: their settings, their links (hook -> link id, program id, cgroup id; a
    cgroup id of 0 is a link detached behind our back) and where each socket was sent."""
    if config is None:
        lines = ["sockcfg none (socket-level load balancing never started on this node)"]
    else:
        flags = "host-namespace-only" if config.flags & SockFlag.HOST_ONLY else "all namespaces"
        lines = [f"sockcfg host_netns={config.host_netns} {flags}"]
    for hook, (link_id, prog_id, cgroup_id) in sorted(links.items()):
        lines.append(f"socklink {hook} link={link_id} prog={prog_id} cgroup={cgroup_id}")
    items = sorted(entries, key=lambda kv: (kv[0].cookie, kv[0].proto, _ip_sort(kv[0].addr), kv[0].port))
    for k, v in items:
        proto = {6: "TCP", 17: "UDP"}.get(k.proto, str(k.proto))
        lines.append(
            f"sock {k.cookie} {ip_str(k.addr)}:{port_host(k.port)}/{proto} shown as "
            f"{ip_str(v.fe_addr)}:{port_host(v.fe_port)} svc={v.svc_id} be={v.backend_id}"
        )
    return "".join(line + "\n" for line in lines)
