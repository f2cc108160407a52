"""`make demo-api`: the agent following an API server, as it runs in a cluster.

A fake kube-apiserver (lab/fakeapi, real HTTP, the real kubernetes client on the agent's side)
and a two-node lab with one `agent --kubeconfig` per node, eBPF mode. The demo creates a Service
and its EndpointSlice on the server, shows which pods answer, scales the endpoints and shows how
fast the change reached the data path (the agent's own log line), drops the watch streams and
forces a 410 relist while traffic flows, answers kube-proxy's health and metrics endpoints, creates
a malformed Service and shows the Event it gets, and tears everything down. Exits non-zero on any
failure.
"""

from __future__ import annotations

import sys

from demo.files import show_counts, teardown, title, verdict
from lab import Lab
from lab.apicluster import ApiCluster
from lab.harness import Loop, ep
from lab.objects import Port, endpoint_slice, service, with_endpoints

MODE = sys.argv[1] if len(sys.argv) > 1 else "ebpf"
HTTP = Port("http", 80, 8080)


def last_sync(cluster: ApiCluster) -> str:
    line = next(ln for ln in cluster.agents[0].log_since_start().splitlines()[::-1] if "sync done" in ln)
    return line.split(" I agent: ", 1)[-1]


def main() -> int:
    failures = 0
    with Lab(nodes=2, pods_per_node=3) as lab:
        title(f"lab {lab.prefix}: 2 nodes, 3 pods each, an external client")
        lab.start_podservers()
        cluster = ApiCluster(lab, MODE)
        cluster.start()
        title(f"a fake kube-apiserver at {cluster.server.url} (real HTTP); one agent per node")
        print("  " + " ".join(["agent", "--kubeconfig=kubeconfig", *cluster.agents[0].flags()]))
        try:
            title("kubectl apply: Service web (10.96.5.1:80) and its EndpointSlice (pod-1-2, pod-2-1)")
            svc = service("web", "10.96.5.1", [HTTP])
            cluster.apply(with_endpoints(svc, [ep(cluster, "pod-1-2"), ep(cluster, "pod-2-1")]))
            print("  node1: " + last_sync(cluster))
            r = cluster.http("pod-1-1", "http://10.96.5.1/", count=20)
            failures += r["errors"]
            show_counts("pod-1-1 -> ClusterIP 10.96.5.1:80", r["bodies"], r["errors"])

            title("scale: the EndpointSlice gains pod-2-2 and pod-1-3")
            backends = [ep(cluster, p) for p in ("pod-1-2", "pod-2-1", "pod-2-2", "pod-1-3")]
            cluster.apply([endpoint_slice("web", [HTTP], backends)])
            print("  node1: " + last_sync(cluster))
            r = cluster.http("pod-1-1", "http://10.96.5.1/", count=40)
            failures += r["errors"]
            show_counts("pod-1-1 -> ClusterIP 10.96.5.1:80", r["bodies"], r["errors"])

            title("watch faults while a client loops: dropped streams, then history compacted (410)")
            loop = Loop(lab, "pod-1-1", "http://10.96.5.1/", "demo")
            cluster.server.drop_streams()
            cluster.apply([endpoint_slice("web", [HTTP], backends[:3])])
            cluster.server.compact()
            cluster.server.drop_streams()
            cluster.apply([endpoint_slice("web", [HTTP], backends)])
            result = loop.finish()
            failures += result["errors"]
            print(f"  {result['ok']} requests during the faults, {result['errors']} failed")

            title("kube-proxy's endpoints: curl 192.168.0.11:10256/healthz, 127.0.0.1:10249/proxyMode")
            health = lab.run("client", "curl", "-s", "http://192.168.0.11:10256/healthz", check=False).stdout
            print("  " + health.strip())
            failures += '"healthy":true' not in health.replace(" ", "")
            mode = lab.run("node1", "curl", "-s", "http://127.0.0.1:10249/proxyMode", check=False).stdout
            print(f"  proxyMode: {mode.strip()}")
            metrics = lab.run("node1", "curl", "-s", "http://127.0.0.1:10249/metrics", check=False).stdout
            families = (
                "kubeproxy_sync_proxy_rules_duration_seconds_count",
                "kubeproxy_network_programming_duration_seconds_count",
                "ekp_relists_total",
            )
            for line in metrics.splitlines():
                if line.startswith(families):
                    print("  " + line)

            title("a malformed Service (sessionAffinity: Sticky): skipped, an Event says why")
            cluster.apply([service("broken", "10.96.5.2", [HTTP], sessionAffinity="Sticky")])
            events = [e for e in cluster.server.events() if e.get("regarding", {}).get("name") == "broken"]
            for event in events[:1]:
                print(f"  {event['type']} {event['reason']}: {event['note']}")
            r = cluster.http("pod-1-1", "http://10.96.5.1/", count=10)
            failures += r["errors"]
            show_counts("web still answers", r["bodies"], r["errors"])
        finally:
            failures += teardown(cluster, "agent --cleanup, lab down, API server stopped")
    return verdict(failures)


if __name__ == "__main__":
    sys.exit(main())
