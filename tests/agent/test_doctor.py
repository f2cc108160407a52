"""`agent doctor`'s checklist from literal facts: each check's verdict, what it names as the fix,
the exit status, and the helper list against the C source. The lab runs are in
tests/traffic/test_doctor.py."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from agent.config import Mode
from agent.doctor.checks import (
    HELPERS,
    MAP_KINDS,
    OPTIONAL_HELPER,
    SOCKET_HELPERS,
    XDP_HELPERS,
    ApiFacts,
    BpfFeatures,
    Facts,
    ForeignHook,
    Line,
    Verdict,
    checklist,
    render,
)
from agent.doctor.facts import parse_bpftool_features, unlocked_route_mtus
from agent.ebpf.programs import kernel_version

BPF_DIR = Path(__file__).resolve().parents[2] / "bpf"
FEATURES = BpfFeatures(
    program_types=frozenset({"sched_cls", "xdp", "cgroup_sock_addr"}),
    map_kinds=frozenset(MAP_KINDS),
    helpers=frozenset(HELPERS) | {OPTIONAL_HELPER},
    socket_helpers=frozenset(SOCKET_HELPERS),
    xdp_helpers=frozenset(XDP_HELPERS),
)
GOOD_API = ApiFacts(url="https://10.0.0.1:6443", services=3, service_ports=4, endpoints=6, entries={"fe": 8})
GOOD = Facts(
    mode=Mode.EBPF,
    node="node1",
    kernel="6.18.0",
    features=FEATURES,
    pin_path="/sys/fs/bpf/ebpf-kube-proxy",
    cgroup2="/sys/fs/cgroup",
    api=GOOD_API,
    map_sizes={"fe": 65536},
    conntrack=(10, 262144),
)


def by_check(lines: list[Line]) -> dict[str, Line]:
    out: dict[str, Line] = {}
    for line in lines:
        if line.check not in out or line.verdict is Verdict.FAIL:
            out[line.check] = line
    return out


def test_a_good_node_is_all_ok() -> None:
    lines = checklist(GOOD)
    assert {line.verdict for line in lines} == {Verdict.OK}, lines
    assert render(GOOD, lines).endswith("verdict: ready for ebpf mode\n")


def test_xdp_s_missing_helper_is_nothing_to_warn_about_with_xdp_disabled() -> None:
    """--bpf-xdp=disabled loads no XDP program: a kernel lacking what ekp_xdp_net6 needs is fine."""
    facts = replace(GOOD, features=replace(FEATURES, xdp_helpers=frozenset()), xdp=False)
    line = by_check(checklist(facts))["BPF features"]
    assert line.verdict is Verdict.OK, line


def test_the_xdp_programs_count_as_loaded_where_the_agent_loads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Facts.xdp is what the agent's start loads on this node now (agent.ebpf.xdp.loads_programs):
    under best-effort none where every external device is a veth, so `agent doctor` does not warn
    about XDP's helpers there, nor say XDP programs load; a device that cannot be read, or none
    found, counts as one that takes XDP, as the agent's load counts it."""
    from agent.config import Config
    from agent.doctor import facts
    from agent.ebpf import attach

    kinds: dict[str, str] | OSError = {}

    def read(config: Config, *, ipv6: bool) -> dict[str, str]:
        if isinstance(kinds, OSError):
            raise kinds
        return kinds

    monkeypatch.setattr(attach, "external_kinds", read)
    cases: list[tuple[str, dict[str, str] | OSError, bool]] = [
        ("best-effort", {"eth0": "veth"}, False),
        ("best-effort", {"eth0": "veth", "eno1": ""}, True),
        ("best-effort", {}, True),
        ("best-effort", OSError(2, "No such file or directory"), True),
        ("native", {"eth0": "veth"}, True),
        ("disabled", {"eno1": ""}, False),
    ]
    for mode, found, want in cases:
        kinds = found
        assert facts.xdp_loaded(Config(bpf_xdp=mode)) is want, (mode, found)
    line = by_check(checklist(replace(GOOD, xdp=False)))["BPF features"]
    assert "XDP" not in line.found, line


def test_the_doctor_reads_the_devices_the_agents_load_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The IPv6 node addresses' devices count as external where the agent's tc IPv6 path serves:
    the settings ask for it (Config.tc_ipv6) and the node runs an IPv6 half (ip6tables works,
    agent/app.py serves_ipv6), as EbpfProxier's `_tc_ipv6`; a node fallen back to single-stack
    reads the IPv4 devices only, in the doctor as in the agent."""
    from agent.config import Config
    from agent.doctor import facts
    from agent.ebpf import attach
    from agent.iptables import runner

    asked: list[bool] = []

    def read(config: Config, *, ipv6: bool) -> dict[str, str]:
        asked.append(ipv6)
        return {"eth0": "veth"}

    monkeypatch.setattr(attach, "external_kinds", read)
    dual = Config(bpf_xdp="best-effort", node_ips=("10.0.0.1", "fd00::1"), socket_lb=True)
    assert dual.tc_ipv6
    for missing, want in (("", True), ("ip6tables: not found", False)):
        monkeypatch.setattr(runner, "ipv6_missing", lambda config, missing=missing: missing)
        assert facts.xdp_loaded(dual) is False
        assert asked[-1] is want, missing


def test_the_socket_programs_needs_are_nothing_to_warn_about_with_socket_lb_off() -> None:
    """--bpf-socket-lb=false attaches no socket program: a kernel lacking their helpers, their
    program type or a cgroup2 mount is fine, and the line does not say they load."""
    for features in (
        replace(FEATURES, socket_helpers=frozenset(SOCKET_HELPERS) - {"bpf_set_retval"}),
        replace(FEATURES, program_types=FEATURES.program_types - {"cgroup_sock_addr"}),
    ):
        facts = replace(GOOD, features=features, cgroup2="", socket_lb=False)
        lines = by_check(checklist(facts))
        assert lines["BPF features"].verdict is Verdict.OK, lines["BPF features"]
        assert "socket" not in lines["BPF features"].found, lines["BPF features"]
        assert lines["cgroup2"].verdict is Verdict.OK, lines["cgroup2"]


@pytest.mark.parametrize(("xdp", "socket_lb"), [(False, False), (True, False), (False, True)])
def test_a_missing_optional_program_type_is_said_for_the_hooks_wanted_only(
    xdp: bool, socket_lb: bool
) -> None:
    """Neither hook wanted: nothing to warn about; one wanted: the warning names that hook alone."""
    features = replace(FEATURES, program_types=FEATURES.program_types - {"xdp", "cgroup_sock_addr"})
    facts = replace(
        GOOD, features=features, cgroup2="" if not socket_lb else GOOD.cgroup2, xdp=xdp, socket_lb=socket_lb
    )
    line = by_check(checklist(facts))["BPF features"]
    if not (xdp or socket_lb):
        assert line.verdict is Verdict.OK, line
        assert "XDP" not in line.found and "socket" not in line.found, line
        return
    assert line.verdict is Verdict.WARN, line
    hook, absent = ("XDP", "socket") if xdp else ("socket-level", "XDP")
    assert f"the {hook} hook needs them" in line.found, line
    assert absent not in line.found, line
    # the hint: what the wanted hook's program type needs, or its flag off; nothing of the other's
    # (nor AF_XDP's CONFIG_XDP_SOCKETS, which the xdp program type does not need)
    kernel, off, other = (
        ("the xdp program type", "--bpf-xdp=disabled", "CGROUP")
        if xdp
        else ("CONFIG_CGROUP_BPF", "--bpf-socket-lb=false", "xdp")
    )
    assert kernel in line.fix and off in line.fix, line
    assert other not in line.fix and "XDP_SOCKETS" not in line.fix, line


def test_both_optional_program_types_missing_name_both_hooks() -> None:
    features = replace(FEATURES, program_types=FEATURES.program_types - {"xdp", "cgroup_sock_addr"})
    line = by_check(checklist(replace(GOOD, features=features)))["BPF features"]
    assert "(the XDP and socket-level hooks need them)" in line.found, line
    assert (
        line.fix
        == "a kernel with the xdp program type (4.8+) and CONFIG_CGROUP_BPF, or --bpf-xdp=disabled and"
        " --bpf-socket-lb=false"
    )


@pytest.mark.parametrize(
    ("change", "check", "verdict", "fix"),
    [
        ({"missing_caps": ("CAP_BPF",)}, "privileges", Verdict.FAIL, "run the agent as root"),
        ({"kernel": "5.4.0-150-generic"}, "kernel", Verdict.FAIL, "upgrade the node's kernel to 5.12+"),
        # 5.11's tc route lookup leaves mtu_result as the tot_len given: a black-hole MTU
        ({"kernel": "5.11.22-generic"}, "kernel", Verdict.FAIL, "upgrade the node's kernel to 5.12+"),
        # 5.12-5.16: no bpf_loop, so the SNAT walk is a bounded loop: optional, a WARN
        (
            {"features": replace(FEATURES, helpers=frozenset(HELPERS))},
            "SNAT walk",
            Verdict.WARN,
            "nothing to do; a kernel with bpf_loop (Linux 5.17+, or a backport)",
        ),
        (
            {"features": replace(FEATURES, helpers=FEATURES.helpers - {"bpf_redirect_neigh"})},
            "BPF features",
            Verdict.FAIL,
            "CONFIG_NET_CLS_BPF",
        ),
        (
            {"features": replace(FEATURES, socket_helpers=frozenset(SOCKET_HELPERS) - {"bpf_set_retval"})},
            "BPF features",
            Verdict.WARN,
            "--bpf-socket-lb=false",
        ),
        # 5.12-5.17: no bpf_xdp_load_bytes, so no ekp_xdp_net6; the rest of the data path loads
        (
            {"features": replace(FEATURES, xdp_helpers=frozenset())},
            "BPF features",
            Verdict.WARN,
            "Linux 5.18+ (bpf_xdp_load_bytes)",
        ),
        (
            {"features": BpfFeatures(error="bpftool: not found")},
            "BPF features",
            Verdict.WARN,
            "install bpftool",
        ),
        (
            {"features": replace(FEATURES, program_types=frozenset({"sched_cls"}))},
            "BPF features",
            Verdict.WARN,
            "CONFIG_CGROUP_BPF",
        ),
        ({"btf": False}, "BTF", Verdict.WARN, "CONFIG_DEBUG_INFO_BTF"),
        (
            {"toolchain_problems": ("the bcc Python module is missing: install Debian's python3-bpfcc",)},
            "bcc and headers",
            Verdict.FAIL,
            "install Debian's python3-bpfcc",
        ),
        (
            {
                "pin_problems": (
                    "--bpf-pin-path /tmp/x is not on a bpf filesystem (it is on tmpfs): mount -t bpf",
                )
            },
            "bpffs",
            Verdict.FAIL,
            "mount -t bpf",
        ),
        ({"cgroup2": ""}, "cgroup2", Verdict.WARN, "mount -t cgroup2"),
        ({"ip_forward": "0"}, "forwarding", Verdict.FAIL, "sysctl -w net.ipv4.ip_forward=1"),
        (
            {"kube_proxy_chains": {"legacy": ["KUBE-SERVICES", "KUBE-NODEPORTS"]}},
            "kube-proxy",
            Verdict.FAIL,
            "agent --cleanup-kube-proxy",
        ),
        ({"kube_proxy_tables": ("ip kube-proxy",)}, "kube-proxy", Verdict.FAIL, "agent --cleanup-kube-proxy"),
        (
            {"foreign_hooks": (ForeignHook("eth0", "tc ingress", "cil_from_netdev pref 1", True),)},
            "tc/XDP hooks",
            Verdict.FAIL,
            "tc filter del dev DEVICE ingress pref N",
        ),
        (
            {"foreign_hooks": (ForeignHook("eth0", "xdp", "program id 7", False),)},
            "tc/XDP hooks",
            Verdict.WARN,
            "ends every packet's tc chain",
        ),
        (
            {"handover_left": ("eth0 tc ingress: ekp_from_net pref 16", "load 1a2b: hand-over mode MISS")},
            "hand-over",
            Verdict.WARN,
            "resumes the hand-over",
        ),
        (
            {"api": ApiFacts(url="https://10.96.0.1:443", via_service="KUBERNETES_SERVICE_HOST=10.96.0.1")},
            "API server",
            Verdict.FAIL,
            "--master https://ADDRESS:6443",
        ),
        (
            {"api": ApiFacts(url="https://127.0.0.1:1", error="MaxRetryError: connection refused")},
            "API server",
            Verdict.FAIL,
            "check the address",
        ),
        ({"api": replace(GOOD_API, entries={"fe": 70000})}, "map sizes", Verdict.FAIL, "--bpf-<map>-max"),
        ({"api": replace(GOOD_API, entries={"fe": 60000})}, "map sizes", Verdict.WARN, "--bpf-<map>-max"),
        ({"conntrack": (250000, 262144)}, "conntrack", Verdict.WARN, "--conntrack-max-per-core"),
        ({"unlocked_route_mtus": ("10.8.0.0/24 dev eth1 mtu 1400",)}, "route MTUs", Verdict.WARN, "mtu lock"),
    ],
)
def test_each_problem_is_its_own_line_with_what_to_do(
    change: dict[str, object], check: str, verdict: Verdict, fix: str
) -> None:
    facts = replace(GOOD, **change)  # type: ignore[arg-type]
    lines = checklist(facts)
    line = by_check(lines)[check]
    assert line.verdict is verdict, line
    assert fix in line.fix, line
    others = [x for x in lines if x.check != check]
    assert all(x.verdict is Verdict.OK for x in others), others
    text = render(facts, lines)
    assert f"-> {line.fix}" in text
    if verdict is Verdict.FAIL:
        assert "will not work here until fixed" in text


def test_a_5_15_node_without_bpf_loop_is_ready_with_a_warning_naming_the_bounded_loop() -> None:
    facts = replace(GOOD, kernel="5.15.0-91-generic", features=replace(FEATURES, helpers=frozenset(HELPERS)))
    lines = checklist(facts)
    line = by_check(lines)["SNAT walk"]
    assert (
        line.verdict is Verdict.WARN and "runs in a bounded loop: a cold start verifies longer" in line.found
    )
    assert [x.check for x in lines if x.verdict is not Verdict.OK] == ["SNAT walk"]
    assert "will not work here" not in render(facts, lines)
    ok = by_check(checklist(GOOD))["SNAT walk"]
    assert (ok.verdict, ok.found) == (Verdict.OK, "bpf_loop: the SNAT walk runs in a bpf_loop callback")
    # unprobed (no bpftool): no line of its own; the BPF features line says how to probe
    assert "SNAT walk" not in by_check(checklist(replace(GOOD, features=BpfFeatures(error="no bpftool"))))


def test_iptables_mode_checks_iptables_not_the_bpf_side() -> None:
    facts = replace(GOOD, mode=Mode.IPTABLES, features=None, kernel="4.19.0", cgroup2="")
    checks = {line.check for line in checklist(facts)}
    assert "iptables" in checks and not checks & {
        "kernel",
        "BPF features",
        "bpffs",
        "tc/XDP hooks",
        "map sizes",
    }
    # the chains of a kube-proxy and of this agent in iptables mode have the same names: only a warning
    mine = replace(facts, kube_proxy_chains={"nft": ["KUBE-SERVICES"]})
    assert by_check(checklist(mine))["kube-proxy"].verdict is Verdict.WARN
    missing = replace(facts, iptables_problem="neither iptables-nft nor iptables-legacy is on PATH")
    assert by_check(checklist(missing))["iptables"].verdict is Verdict.FAIL


def test_the_services_file_needs_no_api_server() -> None:
    line = by_check(checklist(replace(GOOD, api=None)))["API server"]
    assert line.verdict is Verdict.OK and "--services-file" in line.found


def test_the_helper_list_is_every_helper_the_data_path_calls() -> None:
    source = "".join(p.read_text() for p in sorted(BPF_DIR.glob("ekp_*.[ch]")))
    called = set(re.findall(r"\b(bpf_[a-z0-9_]+)\(", source))
    called |= {f"bpf_{m}" for m in re.findall(r"BPF_FUNC_([a-z0-9_]+)", source)}
    assert called == set(HELPERS) | set(SOCKET_HELPERS) | set(XDP_HELPERS) | {OPTIONAL_HELPER}
    assert OPTIONAL_HELPER not in HELPERS, "a kernel without bpf_loop runs the bounded loop: no FAIL"
    assert not set(XDP_HELPERS) & set(HELPERS), (
        "probed for xdp alone: a sched_cls probe would FAIL every node"
    )
    sock = (BPF_DIR / "ekp_sock.h").read_text()
    assert set(re.findall(r"\b(bpf_[a-z0-9_]+)\(", sock)) <= set(SOCKET_HELPERS), "the socket programs' own"
    kinds = set(re.findall(r'BPF_(?:F_)?TABLE(?:_PINNED)?\("([a-z_]+)"', source))
    assert kinds == set(MAP_KINDS)


def test_bpftools_json_is_read() -> None:
    doc = {
        "program_types": {"have_sched_cls_prog_type": True, "have_xdp_prog_type": False},
        "map_types": {"have_lru_hash_map_type": True, "have_hash_map_type": True},
        "helpers": {
            "sched_cls_available_helpers": ["bpf_fib_lookup", "bpf_redirect"],
            "cgroup_sock_addr_available_helpers": ["bpf_set_retval"],
            "xdp_available_helpers": ["bpf_xdp_load_bytes"],
        },
    }
    feats = parse_bpftool_features(doc)
    assert feats.program_types == {"sched_cls"}
    assert feats.map_kinds == {"lru_hash", "hash"}
    assert feats.helpers == {"bpf_fib_lookup", "bpf_redirect"}
    assert feats.socket_helpers == {"bpf_set_retval"}
    assert feats.xdp_helpers == {"bpf_xdp_load_bytes"}


@pytest.mark.parametrize(
    ("release", "version"),
    [("6.18.44-fc-v657", (6, 18)), ("5.10.0-28-amd64", (5, 10)), ("5.4", (5, 4)), ("", (0, 0))],
)
def test_kernel_versions(release: str, version: tuple[int, int]) -> None:
    assert kernel_version(release) == version


@pytest.mark.kernel
def test_the_routes_with_an_unlocked_mtu_are_found() -> None:
    """What the route MTUs check reads: an IPv4 route's mtu metric without its lock bit (a locked
    one and a route without the metric are fine; the local table's routes are the kernel's)."""
    from lab.packets import private_netns, sh

    with private_netns():
        sh("ip", "link", "add", "mtu0", "type", "veth", "peer", "name", "mtu0p")
        sh("ip", "link", "set", "mtu0", "up")
        sh("ip", "link", "set", "mtu0p", "up")
        sh("ip", "route", "add", "10.8.0.0/24", "dev", "mtu0", "mtu", "1400")
        sh("ip", "route", "add", "10.7.0.0/24", "dev", "mtu0", "mtu", "lock", "1300")
        sh("ip", "route", "add", "10.6.0.0/24", "dev", "mtu0")
        assert unlocked_route_mtus("") == ("10.8.0.0/24 dev mtu0 mtu 1400",)
        # with ip_forward_use_pmtu forwarding honours what the route lookup does: nothing to say
        sh("sysctl", "-qw", "net.ipv4.ip_forward_use_pmtu=1")
        assert unlocked_route_mtus("") == ()
        sh("sysctl", "-qw", "net.ipv4.ip_forward_use_pmtu=0")
        sh("ip", "route", "change", "10.8.0.0/24", "dev", "mtu0", "mtu", "lock", "1400")
        assert unlocked_route_mtus("") == ()
