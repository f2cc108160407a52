"""The chart, rendered by the real helm with the default values and six other value sets.

Each set is what an operator would pass with `-f`; the assertions read the parsed manifests:
RBAC verbs and resources exactly, the DaemonSet's mounts, probes, capabilities and tolerations,
and the ConfigMap's KubeProxyConfiguration resolved by the agent's own resolver (agent.cli), plus
one `agent --config FILE --write-config-to OUT` run. The schema rejects typos and wrong types.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli import resolve
from agent.config import Mode, nodeport_addresses_of
from tests.chart import kubelet
from tests.chart.render import CHART, NAMESPACE, REPO, HelmError, Rendered, helm, render

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "iptables": {
        "mode": "iptables",
        "clusterCIDR": "10.244.0.0/16",
        "iptables": {"backend": "legacy"},
        "bpf": {"nodePortRange": "20000-22767"},
        "serviceClusterIPRange": "10.96.0.0/12",
        "externalIPCIDRs": ["203.0.113.0/24", "198.51.100.0/24"],
    },
    # A dual-stack cluster (issue 20): both families' CIDRs, comma-separated as kube-proxy's flags
    # and KubeProxyConfiguration take them, and NodePort addresses of each family.
    "dual-stack": {
        "mode": "iptables",
        "clusterCIDR": "10.244.0.0/16,fd00:10:244::/56",
        "serviceClusterIPRange": "10.96.0.0/12,fd00:10:96::/108",
        "nodePortAddresses": ["192.168.0.0/24", "fd00:192:168::/64"],
    },
    # The same in eBPF mode, whose IPv6 Services are served by ip6tables: the backend passes.
    "dual-stack-ebpf": {
        "clusterCIDR": "10.244.0.0/16,fd00:10:244::/56",
        "iptables": {"backend": "legacy"},
    },
    "monitoring": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "prometheusRule": {"enabled": True},
            "dashboard": {"enabled": True},
        }
    },
    "privileged": {"securityContext": {"privileged": True}, "prepareNode": {"enabled": False}},
    "nodeports": {"nodePortAddresses": ["192.168.0.0/24", "primary"], "bpf": {"devices": ["eth0", "eth1"]}},
    "no-replacement": {"replaceKubeProxy": False, "apiServer": {"host": "10.0.0.1", "port": 443}},
    "socket-lb-off": {"bpf": {"socketLB": {"enabled": False}}},
    "socket-lb-host-only": {"bpf": {"socketLB": {"hostNamespaceOnly": True}, "mapSizes": {"sknat": 131072}}},
    "tuned": {
        "bpf": {
            "mapSizes": {"ctGlobalTcp": 1048576, "fe": 131072},
            "snatPorts": "62000-65000",
            "nodePortRange": "20000-22767",
            "keepClientIpForLocalBackends": True,
            "hostRouting": "bpf",
            "tcAttach": "tcx",
        },
        "conntrack": {"tcpEstablishedTimeout": "2h0m0s", "udpTimeout": "30s"},
        "iptables": {"minSyncPeriod": "250ms"},
        "extraArgs": ["--node-ip=192.168.0.11"],
        "image": {"digest": "sha256:" + "a" * 64},
    },
}
NODE = kubelet.PodFacts(node_name="node-a", host_ip="192.168.0.11")


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    out = {}
    times = []
    for name, values in VALUE_SETS.items():
        start = time.monotonic()
        out[name] = render(values)
        times.append(time.monotonic() - start)
    print(
        f"\nhelm template: {len(times)} value sets, {sum(times) / len(times) * 1000:.0f} ms each on average"
    )
    return out


def values_file(tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_strict(name: str, tmp_path: Path) -> None:
    out = helm("lint", "--strict", str(CHART), "-f", values_file(tmp_path, VALUE_SETS[name]))
    assert "0 chart(s) failed" in out


def test_every_value_set_renders_the_objects_it_asks_for(rendered: dict[str, Rendered]) -> None:
    base = ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "ServiceAccount"]
    for name, r in rendered.items():
        extra = ["ConfigMap", "PrometheusRule", "Service", "ServiceMonitor"] if name == "monitoring" else []
        assert r.kinds() == sorted(base + extra), name


def test_rbac_is_exactly_what_the_agent_uses(rendered: dict[str, Rendered]) -> None:
    role = rendered["default"].one("ClusterRole")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    watch = {"get", "list", "watch"}
    assert granted == (
        {("", "services", v) for v in watch}
        | {("", "nodes", v) for v in watch}
        | {("discovery.k8s.io", "endpointslices", v) for v in watch}
        | {("events.k8s.io", "events", v) for v in ("create", "patch")}
    )
    assert "*" not in json.dumps(role)
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"])
    binding = rendered["default"].one("ClusterRoleBinding")
    sa = rendered["default"].one("ServiceAccount")["metadata"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": NAMESPACE}]


def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def host_paths(r: Rendered) -> dict[str, dict[str, Any]]:
    return {v["name"]: v["hostPath"] for v in r.pod["volumes"] if "hostPath" in v}


def test_default_daemonset(rendered: dict[str, Rendered]) -> None:
    r = rendered["default"]
    ds = r.one("DaemonSet")
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }
    pod = r.pod
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}], "tolerates every taint"
    assert pod["dnsPolicy"] == "Default"
    agent = r.container("agent")
    assert agent["command"] == ["agent"]
    assert agent["args"][:4] == [
        "--config=/etc/ebpf-kube-proxy/config.conf",
        "--mode=ebpf",
        "--hostname-override=$(NODE_NAME)",
        "--v=2",
    ]
    assert agent["env"] == [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    env = kubelet.container_env(agent, NODE)
    assert "--hostname-override=node-a" in kubelet.command_line(agent, env)
    assert agent["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "healthz"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert {p["name"]: p["containerPort"] for p in agent["ports"]} == {"healthz": 10256, "metrics": 10249}
    sc = agent["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {
        "drop": ["ALL"],
        "add": ["BPF", "PERFMON", "NET_ADMIN", "SYS_ADMIN", "NET_RAW"],
    }
    assert sc["seccompProfile"] == {"type": "Unconfined"}, "the default cannot refuse bpf(2)"
    assert sc["readOnlyRootFilesystem"] is True
    assert set(agent["resources"]) == {"requests", "limits"}
    m = mounts(agent)
    assert m["/sys/fs/bpf"]["mountPropagation"] == "HostToContainer" and not m["/sys/fs/bpf"].get("readOnly")
    assert m["/lib/modules"]["readOnly"] is True and m["/usr/src"]["readOnly"] is True
    assert m["/run/ebpf-kube-proxy-cgroup"]["readOnly"] is True
    assert m["/run/ebpf-kube-proxy-cgroup"]["mountPropagation"] == "HostToContainer"
    assert "--bpf-socket-lb-cgroup=/run/ebpf-kube-proxy-cgroup" in agent["args"]
    assert not any(a.startswith("--bpf-socket-lb-host") for a in agent["args"]), "pods too: the default"
    assert pod["hostPID"] is True, "ending pods' UDP sockets whose backend left walks their processes"
    assert {"/run/xtables.lock", "/run/ebpf-kube-proxy", "/etc/ebpf-kube-proxy", "/tmp"} <= set(m)
    hp = host_paths(r)
    assert hp["bpf-maps"] == {"path": "/sys/fs/bpf", "type": "DirectoryOrCreate"}
    assert hp["lock"] == {"path": "/run/ebpf-kube-proxy", "type": "DirectoryOrCreate"}
    assert hp["xtables-lock"] == {"path": "/run/xtables.lock", "type": "FileOrCreate"}
    assert hp["lib-modules"]["path"] == "/lib/modules" and hp["usr-src"]["path"] == "/usr/src"
    assert hp["cgroup"]["path"] == "/sys/fs/cgroup"
    assert r.init_names() == ["prepare-node"], "the agent removes kube-proxy's rules once it serves"
    prepare = r.container("prepare-node")
    assert prepare["securityContext"] == {"privileged": True}
    assert "mount -t bpf bpf /sys/fs/bpf" in prepare["args"][0]
    assert "sysctl -w net.ipv4.ip_forward=1" in prepare["args"][0]
    assert "route_localnet" not in prepare["args"][0]
    assert mounts(prepare)["/sys/fs/bpf"]["mountPropagation"] == "Bidirectional"


def test_socket_lb_values(rendered: dict[str, Rendered]) -> None:
    """Off: no cgroup mount and the flag says so. Host namespace only (for meshes): the flag, and
    not the host's PID namespace (only the node's own sockets are ended, found without it)."""
    off = rendered["socket-lb-off"]
    agent = off.container("agent")
    assert "--bpf-socket-lb=false" in agent["args"]
    assert not any(a.startswith("--bpf-socket-lb-cgroup") for a in agent["args"])
    assert "/run/ebpf-kube-proxy-cgroup" not in mounts(agent) and "cgroup" not in host_paths(off)
    assert "hostPID" not in off.pod
    host_only = rendered["socket-lb-host-only"]
    args = host_only.container("agent")["args"]
    assert {
        "--bpf-socket-lb-cgroup=/run/ebpf-kube-proxy-cgroup",
        "--bpf-socket-lb-host-namespace-only=true",
    } <= set(args)
    assert "--bpf-sknat-max=131072" in args
    assert "hostPID" not in host_only.pod, "the node's own sockets need no view of other processes"
    caps = host_only.container("agent")["securityContext"]["capabilities"]["add"]
    ebpf = rendered["socket-lb-off"].container("agent")["securityContext"]["capabilities"]["add"]
    assert caps == ebpf and "SYS_ADMIN" in caps and "NET_ADMIN" in caps, "no capability beyond eBPF mode's"


def test_iptables_mode(rendered: dict[str, Rendered]) -> None:
    r = rendered["iptables"]
    agent = r.container("agent")
    assert "--mode=iptables" in agent["args"] and "--iptables-backend=legacy" in agent["args"]
    assert not any(a.startswith("--bpf-") for a in agent["args"])
    sc = agent["securityContext"]
    # reading the pinned eBPF conntrack of a node switched from eBPF mode (takeOverFromEbpf)
    assert sc["capabilities"]["add"] == ["NET_ADMIN", "NET_RAW", "BPF"]
    assert sc["seccompProfile"] == {"type": "Unconfined"}
    alone = render({**VALUE_SETS["iptables"], "takeOverFromEbpf": False}).container("agent")[
        "securityContext"
    ]
    assert alone["capabilities"]["add"] == ["NET_ADMIN", "NET_RAW"]
    assert alone["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not {"/lib/modules", "/usr/src", "/run/ebpf-kube-proxy-cgroup"} & set(mounts(agent))
    assert "/run/xtables.lock" in mounts(agent)
    assert r.init_names() == ["prepare-node"], "kube-proxy's chains are the agent's own in this mode"
    assert "sysctl -w net.ipv4.conf.all.route_localnet=1" in r.container("prepare-node")["args"][0]
    with pytest.raises(HelmError, match=r"cleanupKubeProxy\.enabled=true needs mode=ebpf"):
        render({**VALUE_SETS["iptables"], "cleanupKubeProxy": {"enabled": True}})


def test_privileged_fallback(rendered: dict[str, Rendered]) -> None:
    r = rendered["privileged"]
    sc = r.container("agent")["securityContext"]
    assert sc["privileged"] is True and "capabilities" not in sc and "allowPrivilegeEscalation" not in sc
    assert mounts(r.container("agent"))["/sys/fs/bpf"]["mountPropagation"] == "Bidirectional"
    assert r.init_names() == []


def test_no_replacement_and_api_server(rendered: dict[str, Rendered]) -> None:
    r = rendered["no-replacement"]
    assert r.init_names() == ["prepare-node"]
    env = {e["name"]: e.get("value") for e in r.container("agent")["env"]}
    assert env["KUBERNETES_SERVICE_HOST"] == "10.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == "443"
    forced = render({"replaceKubeProxy": False, "cleanupKubeProxy": {"enabled": True}})
    assert forced.init_names() == ["prepare-node", "cleanup-kube-proxy"]
    cleanup = forced.container("cleanup-kube-proxy")
    assert cleanup["command"] == ["agent"] and cleanup["args"][0] == "--cleanup-kube-proxy"
    assert cleanup["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}


def test_monitoring(rendered: dict[str, Rendered]) -> None:
    r = rendered["monitoring"]
    svc = r.one("Service")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 10249, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert svc["spec"]["selector"] == r.one("DaemonSet")["spec"]["selector"]["matchLabels"]
    sm = r.one("ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert set(sm["spec"]["selector"]["matchLabels"].items()) <= set(svc["metadata"]["labels"].items())
    alerts = [rule["alert"] for g in r.one("PrometheusRule")["spec"]["groups"] for rule in g["rules"]]
    assert alerts == [
        "EbpfKubeProxySyncFailing",
        "EbpfKubeProxyServicePortsNotProgrammed",
        "EbpfKubeProxyNetworkProgrammingSlow",
        "EbpfKubeProxyMapNearlyFull",
        "EbpfKubeProxyConntrackEvictingLiveFlows",
        "EbpfKubeProxyWatchRelisting",
        "EbpfKubeProxyWatchRestarting",
    ]
    dashboards = [c for c in r.all("ConfigMap") if "ebpf-kube-proxy.json" in c.get("data", {})]
    assert len(dashboards) == 1 and dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (CHART / "dashboards" / "ebpf-kube-proxy.json").read_text()
    assert json.loads(dashboards[0]["data"]["ebpf-kube-proxy.json"]) == json.loads(shipped)
    assert 'metricsBindAddress: "0.0.0.0:10249"' in r.config_text(), "Prometheus must reach it"
    with pytest.raises(HelmError, match=r"metrics\.host is 127\.0\.0\.1, which Prometheus cannot reach"):
        render({"metrics": {"host": "127.0.0.1", "service": {"enabled": True}}})


def test_nodeports_and_tuned_flags(rendered: dict[str, Rendered]) -> None:
    args = rendered["nodeports"].container("agent")["args"]
    assert "--devices=eth0,eth1" in args
    tuned = rendered["tuned"].container("agent")
    assert {
        "--bpf-ct-global-tcp-max=1048576",
        "--bpf-fe-max=131072",
        "--bpf-snat-ports=62000-65000",
        "--node-port-range=20000-22767",
        "--bpf-keep-client-ip-for-local-backends=true",
        "--bpf-host-routing=bpf",
        "--bpf-tc-attach=tcx",
    } <= set(tuned["args"])
    assert "--bpf-host-routing=legacy" in rendered["default"].container("agent")["args"]
    assert "--bpf-tc-attach=auto" in rendered["default"].container("agent")["args"]
    # The guard of external frontends is both modes'.
    assert {
        "--node-port-range=20000-22767",
        "--service-cluster-ip-range=10.96.0.0/12",
        "--external-ip-cidrs=203.0.113.0/24,198.51.100.0/24",
    } <= set(rendered["iptables"].container("agent")["args"])
    assert not [a for a in rendered["iptables"].container("agent")["args"] if a.startswith("--bpf-")]
    assert tuned["args"][-1] == "--node-ip=192.168.0.11"
    assert tuned["image"] == "ebpf-kube-proxy@sha256:" + "a" * 64


EXPECTED = {
    "default": dict(mode=Mode.EBPF, nodeport_addresses=(), metrics="127.0.0.1:10249", cidr=()),
    "iptables": dict(
        mode=Mode.IPTABLES, nodeport_addresses=(), metrics="127.0.0.1:10249", cidr=("10.244.0.0/16",)
    ),
    "dual-stack": dict(
        mode=Mode.IPTABLES,
        nodeport_addresses=("192.168.0.0/24", "fd00:192:168::/64"),
        metrics="127.0.0.1:10249",
        cidr=("10.244.0.0/16", "fd00:10:244::/56"),
    ),
    "dual-stack-ebpf": dict(
        mode=Mode.EBPF,
        nodeport_addresses=(),
        metrics="127.0.0.1:10249",
        cidr=("10.244.0.0/16", "fd00:10:244::/56"),
    ),
    "monitoring": dict(mode=Mode.EBPF, nodeport_addresses=(), metrics="0.0.0.0:10249", cidr=()),
    "privileged": dict(mode=Mode.EBPF, nodeport_addresses=(), metrics="127.0.0.1:10249", cidr=()),
    "nodeports": dict(
        mode=Mode.EBPF, nodeport_addresses=("192.168.0.0/24", "primary"), metrics="127.0.0.1:10249", cidr=()
    ),
    "no-replacement": dict(mode=Mode.EBPF, nodeport_addresses=(), metrics="127.0.0.1:10249", cidr=()),
    "tuned": dict(mode=Mode.EBPF, nodeport_addresses=(), metrics="127.0.0.1:10249", cidr=()),
    "socket-lb-off": dict(mode=Mode.EBPF, nodeport_addresses=(), metrics="127.0.0.1:10249", cidr=()),
    "socket-lb-host-only": dict(mode=Mode.EBPF, nodeport_addresses=(), metrics="127.0.0.1:10249", cidr=()),
}


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_the_agent_accepts_the_rendered_configuration(
    rendered: dict[str, Rendered], name: str, tmp_path: Path
) -> None:
    """The ConfigMap's file and the container's flags, resolved by the agent's own resolver."""
    r = rendered[name]
    config_file = tmp_path / "config.conf"
    config_file.write_text(r.config_text())
    agent = r.container("agent")
    argv = kubelet.command_line(agent, kubelet.container_env(agent, NODE))
    assert argv[0] == "agent"
    argv = [a.replace("/etc/ebpf-kube-proxy/config.conf", str(config_file)) for a in argv[1:]]
    resolved = resolve(argv)
    assert resolved.warnings == (), "every field the chart writes applies to the agent"
    c = resolved.config
    want = EXPECTED[name]
    assert c.mode is want["mode"]
    assert c.hostname == "node-a"
    assert c.nodeport_addresses == want["nodeport_addresses"]
    assert c.metrics_bind_address == want["metrics"]
    assert c.healthz_bind_address == "0.0.0.0:10256"
    assert c.cluster_cidr == want["cidr"]
    assert c.pin_path == "/sys/fs/bpf/ebpf-kube-proxy"
    socket_lb = {"socket-lb-off": (False, False), "socket-lb-host-only": (True, True)}.get(
        name, (True, False)
    )
    if c.mode is Mode.EBPF:
        assert (c.socket_lb, c.socket_lb_host_only) == socket_lb
        assert c.socket_lb_cgroup == ("/run/ebpf-kube-proxy-cgroup" if c.socket_lb else "")
    if name == "tuned":
        assert c.map_sizes.ct_tcp == 1048576 and c.snat_ports == (62000, 65000)
        assert c.nodeport_range == (20000, 22767) and c.bpf_keep_client_ip_local
        assert c.conntrack.tcp_established_timeout_s == 7200 and c.conntrack.udp_timeout_s == 30
        assert c.min_sync_period_s == 0.25 and c.node_ips == ("192.168.0.11",)
    else:
        assert c.min_sync_period_s == (1.0 if c.mode is Mode.IPTABLES else 0.1)


def test_dual_stack_values_reach_the_agent_as_both_families(
    rendered: dict[str, Rendered], tmp_path: Path
) -> None:
    """Per-family CIDRs pass through the chart unchanged: the agent resolves both families'
    clusterCIDR, Service CIDRs and NodePort addresses, which turns its IPv6 proxier on (iptables
    mode), each family taking its own NodePort CIDRs."""
    r = rendered["dual-stack"]
    assert yaml.safe_load(r.config_text())["clusterCIDR"] == "10.244.0.0/16,fd00:10:244::/56"
    agent = r.container("agent")
    assert "--service-cluster-ip-range=10.96.0.0/12,fd00:10:96::/108" in agent["args"]
    config_file = tmp_path / "config.conf"
    config_file.write_text(r.config_text())
    argv = kubelet.command_line(agent, kubelet.container_env(agent, NODE))
    c = resolve([a.replace("/etc/ebpf-kube-proxy/config.conf", str(config_file)) for a in argv[1:]]).config
    assert c.service_cidrs == ("10.96.0.0/12", "fd00:10:96::/108")
    assert c.ipv6_configured, "an IPv6 clusterCIDR turns the IPv6 proxier on"
    assert nodeport_addresses_of(c.nodeport_addresses, 4) == ("192.168.0.0/24",)
    assert nodeport_addresses_of(c.nodeport_addresses, 6) == ("fd00:192:168::/64",)
    single = resolve([f"--cluster-cidr={VALUE_SETS['iptables']['clusterCIDR']}"]).config
    assert not single.ipv6_configured, "single-stack values: no IPv6 proxier"


def test_dual_stack_values_in_ebpf_mode_pass_the_iptables_backend_for_the_ipv6_rules(
    rendered: dict[str, Rendered],
) -> None:
    """eBPF mode serves IPv6 Services with ip6tables (until its data path has an IPv6 path): the
    chart passes iptables.backend in eBPF mode too."""
    args = rendered["dual-stack-ebpf"].container("agent")["args"]
    assert "--mode=ebpf" in args and "--iptables-backend=legacy" in args
    assert any(a.startswith("--bpf-pin-path=") for a in args)
    c = resolve([a for a in args if not a.startswith(("--config=", "--hostname-override="))]).config
    assert c.mode is Mode.EBPF and c.iptables_backend == "legacy"


def test_agent_writes_the_effective_configuration_of_the_rendered_file(
    rendered: dict[str, Rendered], tmp_path: Path
) -> None:
    config_file = tmp_path / "config.conf"
    config_file.write_text(rendered["iptables"].config_text())
    out = tmp_path / "effective.yaml"
    res = subprocess.run(
        [sys.executable, "-m", "agent", "--config", str(config_file), "--write-config-to", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    effective = yaml.safe_load(out.read_text())
    assert effective["kind"] == "KubeProxyConfiguration" and effective["mode"] == "iptables"
    assert effective["clusterCIDR"] == "10.244.0.0/16"
    assert effective["conntrack"]["tcpEstablishedTimeout"] == "24h0m0s"


BAD_VALUES = [
    ({"mdoe": "iptables"}, "mdoe"),
    ({"metrics": {"serviceMonitor": {"enabeld": True}}}, "enabeld"),
    ({"healthz": {"port": "10256"}}, "port"),
    ({"mode": "ipvs"}, "mode"),
    ({"iptables": {"syncPeriod": "30 seconds"}}, "syncPeriod"),
    ({"bpf": {"mapSizes": {"ctGlobalTcp": "big"}}}, "ctGlobalTcp"),
    ({"bpf": {"mapSizes": {"ct": 1024}}}, "ct"),
    ({"replaceKubeProxy": "yes"}, "replaceKubeProxy"),
    (
        {
            "securityContext": {
                "privileged": True,
                "capabilities": {"ebpf": ["BPF"], "iptables": [], "nft": []},
            }
        },
        "nft",
    ),
]


@pytest.mark.parametrize(("values", "key"), BAD_VALUES, ids=[k for _, k in BAD_VALUES])
def test_the_schema_rejects_typos_and_wrong_types(values: dict[str, Any], key: str) -> None:
    with pytest.raises(HelmError) as err:
        render(values)
    text = str(err.value)
    assert "values don't meet the specifications of the schema" in text, text
    assert key in text, text


def notes(*sets: str) -> str:
    out = helm("install", "ekp", str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *sets)
    return out[out.index("NOTES:") :]


def test_notes_warn_about_the_api_server_address_and_fit_the_mode() -> None:
    default = notes()
    assert "WARNING: apiServer.host is empty" in default
    assert "once its programs serve" in default and "agent inspect maps" in default
    given = notes("--set", "apiServer.host=10.0.0.1", "--set", "mode=iptables")
    assert "WARNING" not in given
    assert "once its programs serve" not in given and "should be gone before this" in given


def test_notes_say_how_to_roll_back_past_tcx_links_where_the_agent_may_use_them() -> None:
    """A build from before tcx links does not know them: with bpf.tcAttach tcx or auto the notes
    say to switch to clsact (or clean up) before such a rollback; with clsact they say nothing."""
    rule = "Roll back to a build older than tcx links"
    for value in ("tcx", "auto"):
        text = notes("--set", f"bpf.tcAttach={value}")
        assert rule in text and "bpf.tcAttach=clsact" in text, value
        assert "metrics.\n\nRoll back to a build" in text, text
    assert rule not in notes("--set", "bpf.tcAttach=clsact")
