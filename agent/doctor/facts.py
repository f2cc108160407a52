"""What `agent doctor` looks at on the node, gathered into `checks.Facts` (effects, read only).

Each piece reuses what the agent itself runs: agent/ebpf/preflight.py (bcc, headers, the pin
path), agent/caps.py, agent/iptables/runner.py's preflight and kube_proxy_cleanup.py's list of
kube-proxy's chains (looked at, never removed), agent/ebpf/attach.py's device choice and filter
reading, the API client and the pure planner (the map entries the API's objects need). Kernel
features come from `bpftool feature probe kernel`. A piece that cannot be looked at becomes what
the matching check reports; nothing here raises for the node's state.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import urlparse

from pyroute2.netlink.exceptions import NetlinkError

from agent import caps
from agent.config import Config, Mode
from agent.doctor.checks import ApiFacts, BpfFeatures, Facts, ForeignHook
from agent.errors import FatalError
from agent.netns import netns_route, run_in_netns

SIZED_ROLES = ("fe", "slot", "be", "rnat", "member", "srcr")
BPFTOOL_TIMEOUT_S = 30.0
API_TIMEOUT_S = (3.0, 15.0)  # connect, read


def gather(config: Config, environ: Mapping[str, str] | None = None) -> Facts:
    env = os.environ if environ is None else environ
    facts = Facts(
        mode=config.mode,
        node=config.hostname,
        netns=config.netns,
        kernel=platform.release(),
        missing_caps=_missing_caps(config),
        ip_forward=_sysctl(config.netns, "net/ipv4/ip_forward"),
        conntrack=_conntrack(config.netns),
        api=None if config.services_file else _api(config, env),
    )
    chains, tables = _kube_proxy(config)
    facts = replace(facts, kube_proxy_chains=chains, kube_proxy_tables=tables)
    if config.mode is Mode.EBPF:
        from agent.ebpf import preflight

        pin_problems = (
            preflight.pin_path_problems(config.pin_path)
            if config.pin_path.startswith("/")
            else [f"--bpf-pin-path must be absolute, got {config.pin_path!r}: give an absolute path"]
        )
        sizes = config.map_sizes.with_conntrack(config.conntrack, os.cpu_count() or 1)
        facts = replace(
            facts,
            features=_bpf_features(),
            btf=os.path.exists("/sys/kernel/btf/vmlinux"),
            toolchain_problems=tuple(preflight.toolchain_problems()),
            pin_problems=tuple(pin_problems),
            pin_path=config.pin_path,
            cgroup2=_cgroup2_mount(),
            foreign_hooks=_foreign_hooks(config),
            handover_left=_handover_left(config),
            unlocked_route_mtus=unlocked_route_mtus(config.netns),
            map_sizes={role: getattr(sizes, role) for role in SIZED_ROLES},
            xdp=xdp_loaded(config),
            socket_lb=config.socket_lb,
        )
    else:
        from agent.iptables.runner import preflight as iptables_preflight

        try:
            iptables_preflight(config)
            problem = ""
        except FatalError as exc:
            problem = str(exc)
        facts = replace(facts, iptables_problem=problem)
    return facts


RTAX_MTU = 2  # linux/rtnetlink.h: the metric's index, its bit in RTAX_LOCK
RT_TABLE_LOCAL = 255


def unlocked_route_mtus(netns: str) -> tuple[str, ...]:
    """The IPv4 routes (every table but local) whose mtu metric is not locked, "DST dev N mtu M";
    () when the routes cannot be read (the check then has nothing to say), and when
    net.ipv4.ip_forward_use_pmtu is 1 (the route lookup and forwarding then honour the same MTU)."""
    if _sysctl(netns, "net/ipv4/ip_forward_use_pmtu") == "1":
        return ()
    try:
        with netns_route(netns) as ipr:
            routes = list(ipr.route("dump", family=socket.AF_INET))
            names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
    except (OSError, NetlinkError):  # pyroute2's NetlinkError is no OSError
        return ()
    found = []
    for r in routes:
        metrics = r.get_attr("RTA_METRICS")
        mtu = metrics.get_attr("RTAX_MTU") if metrics else None
        table = r.get_attr("RTA_TABLE") or r["table"]
        if not mtu or table == RT_TABLE_LOCAL or (metrics.get_attr("RTAX_LOCK") or 0) & (1 << RTAX_MTU):
            continue
        dst = f"{r.get_attr('RTA_DST') or '0.0.0.0'}/{r['dst_len']}"
        found.append(f"{dst} dev {names.get(r.get_attr('RTA_OIF'), '?')} mtu {mtu}")
    return tuple(found)


def xdp_loaded(config: Config) -> bool:
    """Whether the agent's start loads the XDP programs on this node now: the agent's own rule
    (agent.ebpf.xdp.start_loads_programs, read in the node's namespace), with the IPv6 node
    addresses' devices external where the tc IPv6 path would serve (an IPv6 half runs: the
    settings ask for one and the node has ip6tables, agent/app.py serves_ipv6)."""
    from agent.app import serves_ipv6
    from agent.ebpf import attach, xdp

    def read(config: Config, ipv6: bool) -> Mapping[str, str]:
        return attach.external_kinds(config, ipv6=ipv6)

    tc_ipv6 = config.tc_ipv6 and serves_ipv6(config)
    return xdp.start_loads_programs(config, tc_ipv6, read)[0]


def _missing_caps(config: Config) -> tuple[str, ...]:
    wanted = (caps.CAP_NET_ADMIN, caps.CAP_BPF) if config.mode is Mode.EBPF else (caps.CAP_NET_ADMIN,)
    if config.netns:
        wanted = (*wanted, caps.CAP_SYS_ADMIN)  # setns(2)
    return tuple(caps.missing(wanted, caps.effective()))


def _sysctl(netns: str, path: str) -> str:
    def read() -> str:
        with open(f"/proc/sys/{path}", encoding="ascii") as f:
            return f.read().strip()

    try:
        return run_in_netns(netns, read)
    except OSError:
        return ""


def _conntrack(netns: str) -> tuple[int, int] | None:
    count = _sysctl(netns, "net/netfilter/nf_conntrack_count")
    limit = _sysctl(netns, "net/netfilter/nf_conntrack_max")
    if not (count.isdigit() and limit.isdigit()):
        return None
    return int(count), int(limit)


def parse_bpftool_features(doc: Mapping[str, Any]) -> BpfFeatures:
    """`bpftool -j feature probe kernel` -> the program types, map kinds, and the helpers of
    sched_cls, cgroup_sock_addr and xdp programs."""

    def kinds(section: str, suffix: str) -> frozenset[str]:
        entries = doc.get(section) or {}
        return frozenset(
            key.removeprefix("have_").removesuffix(suffix)
            for key, have in entries.items()
            if have is True and key.startswith("have_") and key.endswith(suffix)
        )

    def helpers(prog_type: str) -> frozenset[str]:
        listed = (doc.get("helpers") or {}).get(f"{prog_type}_available_helpers") or []
        return frozenset(str(h) for h in listed)

    return BpfFeatures(
        program_types=kinds("program_types", "_prog_type"),
        map_kinds=kinds("map_types", "_map_type"),
        helpers=helpers("sched_cls"),
        socket_helpers=helpers("cgroup_sock_addr"),
        xdp_helpers=helpers("xdp"),
    )


def _bpf_features() -> BpfFeatures:
    try:
        out = subprocess.run(
            ["bpftool", "-j", "feature", "probe", "kernel"],
            capture_output=True,
            text=True,
            timeout=BPFTOOL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return BpfFeatures(error=f"bpftool: {exc}")
    if out.returncode != 0:
        return BpfFeatures(error=f"bpftool exited {out.returncode}: {out.stderr.strip()[:200]}")
    try:
        return parse_bpftool_features(json.loads(out.stdout))
    except (ValueError, AttributeError) as exc:
        return BpfFeatures(error=f"bpftool's output is not its JSON: {exc}")


def _cgroup2_mount() -> str:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if "-" in fields and fields[fields.index("-") + 1] == "cgroup2":
                    return fields[4]
    except OSError:
        pass
    return ""


def _kube_proxy(config: Config) -> tuple[dict[str, list[str]], tuple[str, ...]]:
    """kube-proxy's chains per iptables backend that has any, and its nftables tables."""
    from agent.iptables import canonical
    from agent.iptables.kube_proxy_cleanup import NFT_TABLES, kube_proxy_targets
    from agent.iptables.runner import IptablesError, SubprocessRunner

    chains: dict[str, list[str]] = {}
    runner = None
    for backend in ("nft", "legacy"):
        runner = SubprocessRunner(replace(config, iptables_backend=backend))
        try:
            saved = canonical.parse(runner.save())
        except (IptablesError, FatalError):
            continue
        present = [
            chain
            for table, targets in kube_proxy_targets(saved).items()
            for chain in targets
            if chain in saved.table(table)
        ]
        if present:
            chains[backend] = present
    tables: tuple[str, ...] = ()
    if runner is not None:
        listed = runner.command(["nft", "list", "tables"])
        if listed.returncode == 0:
            lines = {line.strip() for line in listed.stdout.splitlines()}
            tables = tuple(f"{fam} {name}" for fam, name in NFT_TABLES if f"table {fam} {name}" in lines)
    return chains, tables


def _foreign_hooks(config: Config) -> tuple[ForeignHook, ...]:
    """Programs of others on the tc ingress and XDP hooks of the devices eBPF mode attaches to.

    Which run before ours is read from the hook itself (`hook_programs`, the kernel's order: tcx
    links, then clsact filters by priority): one listed ahead of our first program runs before it.
    On a hook where none of ours is attached yet, it is guessed from how ours would go on
    (--bpf-tc-attach, probed as the agent does): at the end of the tcx list, or as a filter at
    FILTER_PRIO."""
    from agent.app import node_context
    from agent.ebpf import tcx, xdp
    from agent.ebpf.attach import FILTER_PRIO, OUR_NAME_PREFIX, foreign_filters, hook_programs, wanted_devices
    from agent.netns import netns_route

    on_tcx = config.bpf_tc_attach != "clsact" and not tcx.probe()
    out: list[ForeignHook] = []
    try:
        node = node_context(config)
        with netns_route(config.netns) as ipr:
            for index, (name, _prog) in sorted(wanted_devices(ipr, config, node).items()):
                programs = hook_programs(ipr, config.netns, index, tcx.INGRESS)
                ours_at = next((i for i, p in enumerate(programs) if p.ours), None)
                for i, p in enumerate(programs):
                    if p.kind == "tcx" and not p.name.startswith(OUR_NAME_PREFIX):
                        what = f"tcx {p.name or 'program'} id {p.prog_id} link {p.at}"
                        out.append(ForeignHook(name, "tc ingress", what, ours_at is None or i < ours_at))
                filters_at = {p.at: i for i, p in enumerate(programs) if p.kind == "clsact"}
                for label, prio in foreign_filters(ipr, index):
                    if ours_at is None:
                        first = prio < FILTER_PRIO and not on_tcx
                    else:
                        first = filters_at.get(prio, len(programs)) < ours_at
                    out.append(ForeignHook(name, "tc ingress", f"{label} pref {prio}", first))
                state = xdp.xdp_state(ipr, index)
                if state.prog_id and not xdp.is_ours(state):
                    what = f"{xdp.prog_name(state.prog_id) or 'program'} id {state.prog_id} (runs before tc)"
                    out.append(ForeignHook(name, "xdp", what, False))
    except (OSError, FatalError) as exc:
        out.append(ForeignHook("?", "tc ingress", f"could not be read: {exc}", False))
    return tuple(out)


def _handover_left(config: Config) -> tuple[str, ...]:
    """Our filters in front and the loads whose pinned hand-over mode is not OFF."""
    from agent.ebpf.attach import fronts_left
    from agent.ebpf.loader import DatapathError, pinned_handover_modes
    from agent.netns import netns_route

    out: list[str] = []
    try:
        with netns_route(config.netns) as ipr:
            out += fronts_left(ipr, config.netns)
    except OSError as exc:
        out.append(f"the tc hooks could not be read: {exc}")
    try:
        modes = pinned_handover_modes(config.pin_path) if os.path.isdir(config.pin_path) else {}
    except (OSError, DatapathError) as exc:
        out.append(f"the hand-over modes could not be read: {exc}")
        modes = {}
    out += [f"load {load}: hand-over mode {mode.name}" for load, mode in modes.items() if mode.name != "OFF"]
    return tuple(out)


def _api(config: Config, environ: Mapping[str, str]) -> ApiFacts:
    """Where the API server is, whether that is the `kubernetes` Service, and what it holds."""
    from kubernetes import client as k8s

    from agent.kube.client import api_client
    from agent.kube.kubeconfig import KubeconfigError, load_kubeconfig

    via = ""
    if not config.kubeconfig and not config.master and environ.get("KUBERNETES_SERVICE_HOST"):
        via = f"KUBERNETES_SERVICE_HOST={environ['KUBERNETES_SERVICE_HOST']}, the in-cluster default"
    try:
        kubeconfig = load_kubeconfig(config.kubeconfig) if config.kubeconfig else None
        api = api_client(config, environ=environ, kubeconfig=kubeconfig)
    except (FatalError, KubeconfigError) as exc:
        return ApiFacts(
            url=config.master or config.kubeconfig or "in-cluster", via_service=via, error=str(exc)
        )
    url = str(api.configuration.host)
    try:
        # Raw answers (`_preload_content=False`): the client's models would refuse a partial one.
        _read(k8s.VersionApi(api).get_code(_request_timeout=API_TIMEOUT_S, _preload_content=False))
        if not via and _kubernetes_service_ip(api) == urlparse(url).hostname:
            via = "the cluster IP of Service default/kubernetes"
        return _sizing(config, api, ApiFacts(url=url, via_service=via))
    except Exception as exc:  # the client raises urllib3's, ApiException and socket errors alike
        return ApiFacts(url=url, via_service=via, error=_short(exc))


def _kubernetes_service_ip(api: Any) -> str:
    """The cluster IP of Service default/kubernetes, "" when there is none."""
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException

    try:
        resp: Any = k8s.CoreV1Api(api).read_namespaced_service(
            "kubernetes", "default", _request_timeout=API_TIMEOUT_S, _preload_content=False
        )
    except ApiException as exc:
        if exc.status == 404:
            return ""
        raise
    spec = _read(resp).get("spec") or {}
    return str(spec.get("clusterIP") or "")


def _read(resp: Any) -> Any:
    """The JSON of a raw answer, read whole before its connection goes back to the pool (one given
    back unread fails the next request on it: "ResponseNotReady")."""
    import orjson

    try:
        data = resp.data
    finally:
        resp.release_conn()
    return orjson.loads(data)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _sizing(config: Config, api: Any, facts: ApiFacts) -> ApiFacts:
    """Count what the API holds and plan it (the pure planner): the eBPF map entries it needs."""

    from agent.featuregates import node_info
    from agent.kube.resources import watched_resources
    from agent.model import build_state

    listed: dict[str, list[dict[str, Any]]] = {}
    for res in watched_resources(api, ""):
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            resp = res.list_call(
                label_selector=res.label_selector or None,
                field_selector=res.field_selector or None,
                limit=500,
                _continue=token,
                _preload_content=False,
                _request_timeout=API_TIMEOUT_S,
            )
            body = _read(resp)
            for item in body.get("items") or []:
                item.setdefault("kind", res.kind.value)
                item.setdefault("apiVersion", res.api_version)
                items.append(item)
            token = (body.get("metadata") or {}).get("continue") or None
            if not token:
                break
        listed[res.kind.value] = items
    services, slices = listed.get("Service", []), listed.get("EndpointSlice", [])
    state = build_state(services, slices, node_info(config)).state
    endpoints = sum(len(s.get("endpoints") or []) for s in slices)
    entries: dict[str, int] = {}
    if config.mode is Mode.EBPF:
        from agent.app import node_context
        from agent.ebpf.plan import plan

        contents = plan(state, node_context(config), config)
        entries = {role: len(contents.table(role)) for role in SIZED_ROLES}
    return replace(
        facts,
        services=len(services),
        service_ports=len(state.services),
        endpoints=endpoints,
        entries=entries,
    )
