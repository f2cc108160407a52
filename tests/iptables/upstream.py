"""The fixtures kube-proxy's own iptables tests assume (pkg/proxy/iptables/proxier_test.go), in ours.

Upstream's `NewFakeProxier` stands for a node "test-node" with IPs 192.168.0.2, 192.168.1.2 and
192.168.99.11 (plus 127.0.0.1 on lo), pod CIDR 10.0.0.0/8 as the local-traffic detector, the mark
spelled `0x4000`, localhost NodePorts on, every node address for NodePorts, both nfacct counters
present, and a fake iptables without `--random-fully`. `FAKE_OPTIONS`, `FAKE_NODE` and `FAKE_CONFIG`
are those facts for our renderer and proxier.

`sort_rules` orders restore text as upstream's `sortIPTablesRules` does before comparing (upstream
iterates a Go map, so its output order is random): tables by name; KUBE-NODEPORTS, then
KUBE-SERVICES, then the other KUBE-* chains by name, then the rest; the rules of KUBE-NODEPORTS and
KUBE-SERVICES stably by the service name in their comment, nat's "must be the last rule" rule last;
`-X` lines at the end of their table. `check_rule_jumps` is upstream's `checkIPTablesRuleJumps`.
Both are written from upstream's description, for our text.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from agent.config import Config, Mode, NodeContext
from agent.iptables.rules import RenderOptions
from agent.localdetect import LocalDetector
from agent.model import IPFamily

NODE_NAME = "test-node"
NODE_IP = "192.168.0.2"
FAKE_NODE = NodeContext(node_ips=(NODE_IP, "192.168.1.2", "192.168.99.11"), primary_ip=NODE_IP)
FAKE_OPTIONS = RenderOptions(
    masquerade_mark="0x4000",
    local=LocalDetector(cidr="10.0.0.0/8"),
    random_fully=False,
    nfacct_invalid_dropped=True,
    nfacct_localhost_nodeports=True,
)
FAKE_CONFIG = Config(mode=Mode.IPTABLES, hostname=NODE_NAME, cluster_cidr=("10.0.0.0/8",), sync_period_s=30.0)

# NewFakeProxier(iptablestest.NewIPv6Fake()): pod CIDR fd00:10::/64 as the detector, node
# addresses testNodeIPv6 and testNodeIPv6Alt on eth0 (::1 on lo is never a NodePort address).
NODE_IPV6, NODE_IPV6_ALT = "2001:db8::1", "2001:db8:1::2"
FAKE_NODE6 = NodeContext(node_ips=(NODE_IPV6, NODE_IPV6_ALT), primary_ip=NODE_IPV6)
FAKE_OPTIONS6 = replace(FAKE_OPTIONS, local=LocalDetector(cidr="fd00:10::/64"), family=IPFamily.IPv6)

Obj = dict[str, Any]


def svc(namespace: str, name: str, *ports: dict[str, Any], **spec: Any) -> Obj:
    """upstream makeTestService: ports as {"name", "port", "protocol", "nodePort"?, ...}."""
    status = spec.pop("status", None)
    obj: Obj = {
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {**spec, "ports": list(ports)},
    }
    if status is not None:
        obj["status"] = status
    return obj


def port(name: str, number: int, protocol: str = "TCP", **extra: Any) -> dict[str, Any]:
    return {"name": name, "port": number, "protocol": protocol, **extra}


def lb_status(*ips: str) -> dict[str, Any]:
    return {"loadBalancer": {"ingress": [{"ip": ip} for ip in ips]}}


def eps(
    namespace: str,
    name: str,
    ports: list[tuple[str, int, str]],
    *endpoints: str | tuple[str, str],
    address_type: str = "IPv4",
) -> Obj:
    """upstream makeTestEndpointSlice: an endpoint is an address (no nodeName: not local) or
    (address, nodeName)."""
    items = []
    for e in endpoints:
        address, node = (e, None) if isinstance(e, str) else e
        items.append({"addresses": [address], **({"nodeName": node} if node else {})})
    return {
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-1",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": address_type,
        "ports": [{"name": n, "port": p, "protocol": pr} for n, p, pr in ports],
        "endpoints": items,
    }


def dedent(text: str) -> str:
    """Expected text written indented (and pieced together from blocks indented differently):
    every line stripped, blank lines dropped. No line of a ruleset starts with a space."""
    return "".join(f"{line.strip()}\n" for line in text.splitlines() if line.strip())


def fake_mark(text: str) -> str:
    """Our proxier spells the mark as kube-proxy itself does (`%#08x`: 0x00004000); upstream's fake
    proxier is handed `0x4000`. Only the fake facts differ, so compare in the fake's spelling."""
    return text.replace("0x00004000", "0x4000")


def _comment_service(rule: str) -> str | None:
    m = re.search(r'--comment (?:"([^"]*)"|(\S+))', rule)
    if m is None:
        return None
    return re.split(r"[ :]", m.group(1) if m.group(1) is not None else m.group(2), maxsplit=1)[0]


def _chain_order(name: str) -> tuple[int, str]:
    if name == "KUBE-NODEPORTS":
        return (0, "")
    if name == "KUBE-SERVICES":
        return (1, "")
    return (2 if name.startswith("KUBE-") else 3, name)


def sort_rules(text: str) -> str:
    """Restore text in upstream's comparison order (see the module docstring)."""
    tables: dict[str, tuple[list[str], dict[str, list[str]], list[str]]] = {}
    current: tuple[list[str], dict[str, list[str]], list[str]] | None = None
    for line in text.strip().splitlines():
        if line.startswith("*"):
            current = tables.setdefault(line[1:], ([], {}, []))
        elif line == "COMMIT" or current is None:
            continue
        elif line.startswith(":"):
            current[0].append(line[1:].split(" ", 1)[0])
        elif line.startswith("-A "):
            chain = line.split(" ", 2)[1]
            current[1].setdefault(chain, []).append(line)
        elif line.startswith("-X "):
            current[2].append(line)
    out: list[str] = []
    for name in sorted(tables):
        chains, rules, deletions = tables[name]
        order = sorted(dict.fromkeys(chains), key=_chain_order)
        out.append(f"*{name}")
        out += [f":{c} - [0:0]" for c in order]
        for chain in order + sorted(set(rules) - set(order), key=_chain_order):
            chain_rules = rules.get(chain, [])
            if chain in ("KUBE-NODEPORTS", "KUBE-SERVICES"):
                last = [r for r in chain_rules if "must be the last rule" in r]
                rest = [r for r in chain_rules if r not in last]
                rest.sort(key=lambda r: _comment_service(r) or "")
                chain_rules = rest + last
            out += chain_rules
        out += sorted(deletions)
        out.append("COMMIT")
    return "\n".join(out) + "\n"


def chain_rules(text: str, table: str, chain: str) -> str:
    """The rules of one chain, in order (upstream assertIPTablesChainEqual)."""
    out: list[str] = []
    current = ""
    for line in text.splitlines():
        if line.startswith("*"):
            current = line[1:]
        elif current == table and (line.startswith(f"-A {chain} ") or line == f"-A {chain}"):
            out.append(line)
    return "".join(f"{line}\n" for line in out)


def check_rule_jumps(text: str) -> None:
    """upstream checkIPTablesRuleJumps: every jump or rule goes to a created chain, no jump goes to
    a chain without rules (but KUBE-NODEPORTS), no created chain is left unused."""
    builtin_targets = {"ACCEPT", "REJECT", "DROP", "MARK", "RETURN", "DNAT", "SNAT", "MASQUERADE"}
    top = {
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-FORWARD",
        "KUBE-MARK-MASQ",
        "KUBE-PROXY-FIREWALL",
        "KUBE-FIREWALL",
    }
    for table in text.split("COMMIT\n"):
        lines = table.splitlines()
        if not lines:
            continue
        created = {m.group(1) for line in lines if (m := re.match(r"^:(\S+)", line))}
        created -= {m.group(1) for line in lines if (m := re.match(r"^-X (\S+)", line))}
        filled = {m.group(1) for line in lines if (m := re.match(r"^-A (\S+)", line))}
        jumped = {m.group(1) for line in lines if (m := re.search(r"-j (\S+)", line))} - builtin_targets
        missing = (jumped - created) | (filled - created)
        assert not missing, f"{lines[0]}: chains used but not created: {sorted(missing)}"
        empty = jumped - filled - {"KUBE-NODEPORTS"}
        assert not empty, f"{lines[0]}: chains jumped to but without rules: {sorted(empty)}"
        extra = created - jumped - top
        assert not extra, f"{lines[0]}: chains created but not used: {sorted(extra)}"
