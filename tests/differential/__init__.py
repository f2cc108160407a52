"""The differential suite: one table of cases run in eBPF and iptables mode, compared case by case.

`cases.py` is the table (Services, sources, destinations, kube-proxy's expected outcome),
`runner.py` runs it in one mode in a two-node lab, `test_differential.py` runs both modes and holds
each to kube-proxy and to the other, `DIFFERENCES.md` lists the intended (or known, unfixed)
differences, read by the test. `probe.py` and `whoami.py` are the client and server it runs in the
lab's namespaces.
"""
