"""ebpf-kube-proxy's agent (README.md, "Layout")."""

from agent._pyroute2 import install as _lazy_pyroute2

# Before any agent module imports pyroute2: its package __init__ costs every process about
# 0.055 CPU s for parts the agent never uses (agent/_pyroute2.py).
_lazy_pyroute2()
