"""`make bench` (`python -m bench`): the data path's and the control plane's cost, in one run.

For each mode (ebpf, iptables) a fresh one-node lab: nginx in pod-1-2 is the server, pod-1-1 the
client, so ClusterIP traffic enters the node through the client's veth (ekp_from_pod in eBPF mode,
PREROUTING's KUBE-SERVICES in iptables mode). One real `agent` process acts for the node
(lab/harness.py). Measured, in this order:

1. the pod IP with no agent running (the direct reference);
1b. eBPF mode: an agent with pods balanced at connect() (`--bpf-socket-lb-host-namespace-only=false`,
   the default; its own pins, removed afterwards), at 1 and N services: pod IP and ClusterIP, then
   what the tc programs saw of the ClusterIP's traffic (bench/tcview.py) and ekp_from_pod's ns per
   packet on the packets it passes (bench/progcost.py). The states below pin the flag true: the
   per-packet path, which meshes and frontends needing the client's address use;
2. 1 service installed: pod IP and ClusterIP, alternately;
3. N services installed (default 10,000: the measured one sorted last, the rest filler with 1-2
   endpoints each, bench/workload.py): pod IP and ClusterIP, alternately;
4. the pod IP again after the agent stopped and cleaned up.

The lab is dual-stack and every Service too (bench/workload.py; `--no-ipv6`: single-stack): in
each state the server pod's IPv6 address and the measured Service's IPv6 ClusterIP are measured
beside the IPv4 targets, alternately in the same rounds, against the IPv6 pod IP with no agent
(issue 20: IPv6 within 5% of IPv4); eBPF mode also times the programs on IPv6 packets (progcost's
IPv6 twins, an IPv6 ClusterIP window of bench/bpfstats.py).

Per target: new TCP connections per second (wrk, `Connection: close`) and connect() latency p50/p99
(bench/probe.py). eBPF mode also reads the programs' own cost per packet with
kernel.bpf_stats_enabled (bench/bpfstats.py). Every sync reports what the agent logged (read time,
sync time, iptables restore time) and what the kernel holds (rule count, map entries).

The second part (`--parts api`, bench/api.py) runs the agent against a fake API server holding
10,000 Services with 10 endpoints each: list -> first sync, start -> first sync, a restart over
its own pins, one EndpointSlice change p50/p99/max over 200 changes, and the agent's peak RSS.
The third part (`--parts capacity`, bench/capacity.py) opens TCP flows through a ClusterIP until
the default conntrack table evicts its first live one. The fourth (`--parts flood`, bench/flood.py)
floods node1 from the external client (trafgen) and compares packets handled per CPU at XDP, at
the tc program and in iptables mode, for source-range drops and NodePort forwarding. The fifth
(`--parts health`, bench/health.py) times probes of /healthz and a healthCheckNodePort with no other
client and while slow clients drip headers (the lab of tests/adversarial/test_slow_clients.py). All
five parts are the default.

Output: aligned tables on stdout, and the run as a file: bench/results/<date>-<commit>.json (commit,
host, date, parameters, iptables backends, raw results; bench/record.py) with its tables rendered
beside it (.md). `python -m bench.report --readme` puts the newest run into the README, and the
newest run with a flood part into its own block.
"""
