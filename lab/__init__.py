"""The network-namespace lab: a small cluster built from network namespaces, for tests, demo and benchmarks.

This package holds what tests/, bench/ and demo/ share (none of it is shipped or imported by agent/):

    core.py, netns.py   the lab itself (this docstring); podserver.py, client.py run inside it by path
    harness.py          `Cluster`/`Agent`: one real agent process per lab node, fed a services file
    apicluster.py       `ApiCluster`: the same agents following the fake API server
    objects.py          builders for the Services and EndpointSlices the clusters are fed
    fakeapi/            a fake kube-apiserver (real HTTP) the real kubernetes client cannot tell apart
    packets.py, dplab.py  the packet lab: BPF_PROG_TEST_RUN on the data path in a private namespace

Topology (fixed; other code relies on it). Every namespace is `<prefix>-<role>`, prefix = `ekp` + 6 hex:

    <prefix>-net      the switch: bridge br0 (no IP), ports sw-node1, sw-node2, sw-client
    <prefix>-node1    eth0 192.168.0.11/24; lxc-p1, lxc-p2 ... (one per pod, each 10.244.1.1/32)
                      routes 10.244.1.(j+1)/32 dev lxc-p<j>, 10.244.2.0/24 via 192.168.0.12; ip_forward=1
    <prefix>-node2    eth0 192.168.0.12/24; likewise with 10.244.2.0/24, 10.244.1.0/24 via 192.168.0.11
    <prefix>-client   eth0 192.168.0.100/24; only the routes tests add (`add_client_route`)
    <prefix>-pod-N-j  eth0 10.244.N.(j+1)/24 noprefixroute; 10.244.N.1 dev eth0; default via 10.244.N.1

Pods are point-to-point like the CNI ptp plugin (kindnet): even same-node pod traffic goes through the
node. Nothing else is tuned (rp_filter, accept_local, ... keep their defaults). The host namespace gets
no address, route, link or program: veths are created directly inside their namespaces.

Per lab, also: a tmp dir (logs, configs, blobs, and an xtables lock file per namespace,
`Lab.xtables_lock`, that every command run in the namespace takes), cgroup v2 directories when cgroup2
is mounted (`<cgroup2>/<prefix>/node1/{host,hostnet-pod,pod-1-1,...}`, `<prefix>/client`; every process
the lab starts is put in the one of its namespace, so node N's agent attaches its socket programs to
`Node.cgroup_root` (node, host-network pod and pods) without touching other nodes; `Node.hostnet_cgroup`
stands for a hostNetwork pod: the node's namespace, a pod's cgroup), and a bpffs pin directory name per
node (`Node.pin_dir`, not created, removed on teardown).

Use:

    from lab import Lab

    with Lab(nodes=2, pods_per_node=2) as lab:          # up() on enter, down() on exit, always
        lab.start_podservers()                          # HTTP :8080 + UDP echo :9000 on every pod
        p11, p12, p21, p22 = lab.pods
        assert lab.http_get(p11, p21.ip) == "pod-2-1\\n"  # in-process client inside p11's namespace
        assert lab.udp_echo(p11, p22.ip, payload="hi") == "pod-2-2 hi"
        lab.add_client_route("203.0.113.0/24", via_node=1)
        lab.curl(lab.client, "http://192.168.0.11:30080/")
        lab.start_dns(p21); lab.dns_whoami(p11, p21.ip, tcp=True)   # -> "pod-2-1"

In pytest, tests/conftest.py provides the fixtures `lab1`, `lab2`, `make_lab` and `kernel_required`.

Safety net: `down()` is idempotent and also runs from atexit; SIGTERM/SIGHUP become KeyboardInterrupt
once a lab is up. Leftovers of a killed run: `python -m lab cleanup` (or `make clean-lab`).
Manual poking: `python -m lab up --nodes 2`.
"""

from .core import (
    BRIDGE,
    CLIENT_IP,
    CREATED_PREFIXES,
    DNS_PORT,
    DNS_SVC_ADDR,
    DNS_SVC_DOMAIN,
    DNS_TXT_NAME,
    HTTP_PORT,
    NGINX_PORT,
    NODE_SUBNET,
    POD_SUPERNET,
    STARTED,
    UDP_PORT,
    Client,
    CommandError,
    Host,
    Lab,
    LabFactory,
    Node,
    NsLike,
    Pod,
    Process,
    live_labs,
    node_gateway,
    node_ip,
    node_pod_cidr,
    pod_ip,
)
from .netns import LabError, cleanup_leftovers, find_leaks, in_netns, kernel_problem, ns_socket

__all__ = [
    "BRIDGE",
    "CLIENT_IP",
    "CREATED_PREFIXES",
    "DNS_PORT",
    "DNS_SVC_ADDR",
    "DNS_SVC_DOMAIN",
    "DNS_TXT_NAME",
    "HTTP_PORT",
    "NGINX_PORT",
    "NODE_SUBNET",
    "POD_SUPERNET",
    "STARTED",
    "UDP_PORT",
    "Client",
    "CommandError",
    "Host",
    "Lab",
    "LabError",
    "LabFactory",
    "Node",
    "NsLike",
    "Pod",
    "Process",
    "cleanup_leftovers",
    "find_leaks",
    "in_netns",
    "kernel_problem",
    "live_labs",
    "node_gateway",
    "node_ip",
    "node_pod_cidr",
    "ns_socket",
    "pod_ip",
]
