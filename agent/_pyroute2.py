"""pyroute2 without its package `__init__` until something asks for a name only it defines.

pyroute2's `__init__` imports most of the library (IPDB and NDB with sqlite3, nl80211, ethtool,
IPVS, plan9, ...): 163 of its own modules (the standard library's it pulls in besides: `import
pyroute2` grows `sys.modules` by about 300) and about 0.055 CPU s in every process that imports any
pyroute2 module, while the agent uses a few: `pyroute2.iproute` (IPRoute), `pyroute2.netlink`
(messages, constants, NetlinkError) and `pyroute2.netlink.nfnetlink` (conntrack), 100 of pyroute2's
modules in all. The suite starts hundreds of agent processes
(bench/results/suite/agent-start-cpu-2026-11-28.md).

`install()` (run by `agent/__init__.py`, before any agent module imports pyroute2) puts the
package in `sys.modules` with its `__path__` but its `__init__` not run, so `import
pyroute2.iproute` runs only what that module needs. A submodule asked for as an attribute is
imported; `__version__` is answered from `pyroute2.config.version`, as the `__init__` sets it; any
other name (`from pyroute2 import IPDB`, `pyroute2.NDB`) runs the real `__init__` once, in place,
and the name is answered from it: code written against the whole package (the lab's `from pyroute2
import IPRoute`) works unchanged, it just pays the full import. pyroute2's logger set-up
(`pyroute2.config.log`: a NullHandler on the `pyroute2` logger), the one thing its `__init__` does
at import besides binding names (the public classes, `__version__`, `modules`, `__all__`), is done
at once. A process that imported pyroute2 before is left as it is.

The full load holds a lock: another thread's first touch meanwhile waits for it and is answered
from the loaded package. A load that fails (sqlite3 missing, which NDB needs) raises its own error
and leaves the package lazy as before, so the next touch tries again and raises it again.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType

PACKAGE = "pyroute2"

# One for the process: there is one pyroute2 package. Reentrant, as pyroute2's own modules may
# ask the package for a name while its `__init__` runs (they get AttributeError, as they would
# from a package whose `__init__` is half done).
_lock = threading.RLock()


def install() -> None:
    """Make `pyroute2`'s package `__init__` lazy in this process (a no-op once pyroute2 is in)."""
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not installed: the first real import raises the usual ImportError
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader
    state = {"loaded": False, "loading": False}

    def __getattr__(name: str) -> object:
        if name == "__version__":
            try:
                return importlib.import_module(f"{PACKAGE}.config.version").__version__
            except ImportError:
                return "unknown"  # what pyroute2's __init__ says then
        if name.startswith("__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"{PACKAGE}.{name}") is not None:
            return importlib.import_module(f"{PACKAGE}.{name}")
        with _lock:
            # A thread that waited here for another's load finds the name in place.
            if not state["loaded"] and not state["loading"]:
                state["loading"] = True
                try:
                    _load_whole(module, loader)
                finally:
                    state["loading"] = False
                state["loaded"] = True
                module.__dict__.pop("__getattr__", None)
        try:
            return module.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}") from None

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[PACKAGE] = module
    importlib.import_module(f"{PACKAGE}.config.log")


def _load_whole(module: ModuleType, loader: object) -> None:
    """Run the package's real `__init__` in `module`; on failure put its names back as they were
    (the lazy `__getattr__` among them) and re-raise, so the next touch retries the load."""
    before = dict(module.__dict__)
    exec_module = getattr(loader, "exec_module")  # noqa: B009 - the loader's type is importlib's
    try:
        exec_module(module)
    except BaseException:
        # Key by key, never clear(): another thread reading the package meanwhile must still
        # find `__getattr__` (and through it the lock).
        for key in [k for k in module.__dict__ if k not in before]:
            del module.__dict__[key]
        module.__dict__.update(before)
        raise
