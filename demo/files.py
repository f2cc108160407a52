"""`make demo`: the lab, the agent in eBPF mode on node1, real traffic, the maps, and teardown.

Builds a two-node lab of network namespaces, runs `agent --mode=ebpf` for node1 with the Services in
examples/services.yaml, sends HTTP, NodePort and DNS traffic from a pod and from the external
client, prints which pod answered each request, shows the BPF maps (raw through bpftool and decoded
by `agent inspect`), shows that netfilter holds no service rule, and tears everything down.
Exits non-zero if any request fails.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

from agent.ebpf.abi import MAPS
from agent.sources.file import load_file
from lab import Lab
from lab.harness import REPO, Cluster

EXAMPLES = REPO / "examples" / "services.yaml"
MODE = sys.argv[1] if len(sys.argv) > 1 else "ebpf"


def title(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def show_counts(label: str, bodies: dict[str, int], errors: int) -> None:
    spread = ", ".join(f"{name} x{n}" for name, n in sorted(bodies.items()))
    print(f"  {label:<48} -> {spread}" + (f"  ({errors} FAILED)" if errors else ""))


def teardown(cluster: Cluster, what: str) -> int:
    """Stop the cluster (agents clean up), print what failed and the pins left; the failure count."""
    title(f"teardown: {what}")
    cleanup_failures = cluster.stop()
    for text in cleanup_failures:
        print("  cleanup failed:", text)
    print(f"  pins left: {[a.pin_path for a in cluster.agents if Path(a.pin_path).exists()]}")
    return len(cleanup_failures)


def verdict(failures: int) -> int:
    print(f"\n{'demo OK' if failures == 0 else f'demo FAILED ({failures} failures)'}")
    return 0 if failures == 0 else 1


def main() -> int:
    failures = 0
    with Lab(nodes=2, pods_per_node=2) as lab:
        title(f"lab {lab.prefix}: 2 nodes, 2 pods each, an external client")
        print(lab.describe())
        lab.start_podservers()
        lab.start_dns(lab.pod("pod-1-2"))
        lab.start_dns(lab.pod("pod-2-2"))

        cluster = Cluster(lab, MODE, agent_nodes=[1])
        agent = cluster.agents[0]
        title(f"agent --mode={MODE} for node1 with {EXAMPLES.relative_to(REPO)}")
        print("  " + " ".join(["agent", f"--services-file={EXAMPLES.name}", *agent.flags()]))
        cluster.start()
        snap = load_file(str(EXAMPLES))
        cluster.apply([dict(o) for o in (*snap.services, *snap.endpoint_slices)])
        print("  " + next(line for line in agent.log().splitlines()[::-1] if "sync done" in line))

        try:
            title("traffic: which pod answered")
            for label, target, url in [
                ("pod-1-1 -> ClusterIP 10.96.0.10:80 (web)", "pod-1-1", "http://10.96.0.10/"),
                ("pod-1-2 -> ClusterIP 10.96.0.11:80 (both nodes)", "pod-1-2", "http://10.96.0.11/"),
                ("client -> NodePort 192.168.0.11:30080", "client", "http://192.168.0.11:30080/"),
            ]:
                r = cluster.http(target, url, count=20)
                failures += r["errors"]
                show_counts(label, r["bodies"], r["errors"])
            seen = cluster.http("client", "http://192.168.0.11:30080/ip", count=10)
            show_counts("client -> NodePort, source IP the pod saw", seen["bodies"], seen["errors"])
            for transport in ("+notcp", "+tcp"):
                answers: Counter[str] = Counter()
                for _ in range(10):
                    out = (
                        lab.run(
                            "pod-1-1",
                            "dig",
                            "@10.96.0.53",
                            "whoami.lab",
                            "TXT",
                            "+short",
                            "+time=2",
                            "+tries=1",
                            transport,
                            check=False,
                        )
                        .stdout.strip()
                        .strip('"')
                    )
                    answers[out or "NO ANSWER"] += 1
                failures += answers["NO ANSWER"]
                proto = "TCP" if transport == "+tcp" else "UDP"
                show_counts(
                    f"pod-1-1 -> DNS 10.96.0.53:53/{proto} (dig)", dict(answers), answers["NO ANSWER"]
                )

            if MODE == "ebpf":
                # By pin, not by name: every map of that name on the machine would match.
                fe_pin = f"{agent.pin_path}/{MAPS['fe'].name}"
                title(f"the maps, raw: bpftool map dump pinned {fe_pin} (first entries)")
                raw = subprocess.run(
                    ["bpftool", "map", "dump", "pinned", fe_pin],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout
                print("\n".join(raw.splitlines()[:16]) + "\n  ...")
                for what, heading in (
                    ("maps", "the maps, decoded"),
                    ("stats", "counters"),
                    ("capacity", "map fill"),
                ):
                    title(f"{heading}: agent inspect {what}")
                    shown = subprocess.run(
                        [sys.executable, "-m", "agent", "inspect", what, f"--bpf-pin-path={agent.pin_path}"],
                        capture_output=True,
                        text=True,
                        check=False,
                        cwd=str(REPO),
                    )
                    print(shown.stdout or shown.stderr)
                title("netfilter in node1 holds no service rule")
                rules = cluster.ruleset(lab.nodes[0])
                kube = [line for line in rules.splitlines() if "KUBE-" in line or "10.96." in line]
                print(f"  lines mentioning KUBE- or 10.96.: {len(kube)}")
                failures += len(kube)
        finally:
            failures += teardown(cluster, "agent --cleanup, lab down")
    return verdict(failures)


if __name__ == "__main__":
    sys.exit(main())
