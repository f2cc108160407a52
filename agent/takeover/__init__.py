"""Switching a node's data path while it serves: established flows carried from the data path that
goes to the one that comes (kube-proxy or iptables mode -> eBPF mode: into_ebpf; eBPF mode ->
iptables mode: out_of_ebpf), then the old one's state removed. flows.py is the pure conversion."""
