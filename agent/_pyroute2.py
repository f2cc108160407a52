"""pyroute2 without its package `__init__` until something asks for a name only it defines.

pyroute2's `__init__` imports every part of the library (IPDB and NDB with sqlite3, nl80211,
ethtool, IPVS, plan9, ...), 366 modules and about 0.055 CPU s in every process that imports any
pyroute2 module, while the agent uses a few: `pyroute2.iproute` (IPRoute), `pyroute2.netlink`
(messages, constants, NetlinkError) and `pyroute2.netlink.nfnetlink` (conntrack). The suite
starts hundreds of agent processes (bench/results/suite/agent-start-cpu-2026-11-28.md).

`install()` (run by `agent/__init__.py`, before any agent module imports pyroute2) puts the
package in `sys.modules` with its `__path__` but its `__init__` not run, so `import
pyroute2.iproute` runs only what that module needs. A submodule asked for as an attribute is
imported; any other name (`from pyroute2 import IPDB`, `pyroute2.NDB`) runs the real `__init__`
once, in place, and the name is answered from it: code written against the whole package (the
lab's `from pyroute2 import IPRoute`) works unchanged, it just pays the full import. pyroute2's
logger set-up (`pyroute2.config.log`: a NullHandler on the `pyroute2` logger), the one thing its
`__init__` does besides importing, is done at once. A process that imported pyroute2 before is
left as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

PACKAGE = "pyroute2"


def install() -> None:
    """Make `pyroute2`'s package `__init__` lazy in this process (a no-op once pyroute2 is in)."""
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not installed: the first real import raises the usual ImportError
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def __getattr__(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"{PACKAGE}.{name}") is not None:
            return importlib.import_module(f"{PACKAGE}.{name}")
        _load_whole(module, loader)
        return getattr(module, name)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[PACKAGE] = module
    importlib.import_module(f"{PACKAGE}.config.log")


def _load_whole(module: ModuleType, loader: object) -> None:
    """Run the package's real `__init__` in `module` (once: its own names answer afterwards)."""
    module.__dict__.pop("__getattr__", None)
    exec_module = getattr(loader, "exec_module")  # noqa: B009 - the loader's type is importlib's
    exec_module(module)
