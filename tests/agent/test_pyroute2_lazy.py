"""agent/_pyroute2.py: an agent process imports the pyroute2 modules it uses, not the whole library.

Each case runs a fresh interpreter: this test process has long imported pyroute2 whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Counts the runs of pyroute2's package __init__ (by the thread that ran it): set before `import
# agent`, whose install() keeps the package's source loader for the full load.
COUNT_LOADS = (
    "import importlib.machinery, threading\n"
    "loads = []\n"
    "_real_exec = importlib.machinery.SourceFileLoader.exec_module\n"
    "def _exec(self, module):\n"
    "    if module.__name__ == 'pyroute2':\n"
    "        loads.append(threading.current_thread().name)\n"
    "        before_load()\n"
    "    return _real_exec(self, module)\n"
    "def before_load():\n"
    "    pass\n"
    "importlib.machinery.SourceFileLoader.exec_module = _exec\n"
)


def run(code: str) -> dict[str, object]:
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )
    assert res.returncode == 0, res.stderr
    out: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def test_the_agents_modules_leave_pyroute2s_other_parts_unimported() -> None:
    # Every agent module (the CLI, both modes' proxiers and the modules they import lazily,
    # doctor, inspect, ...) but `agent.__main__`, which would run the agent: a module that asks
    # the package for a name its __init__ defines pulls in IPDB/NDB (sqlite3) and nl80211.
    out = run(
        "import json, sys, logging, pkgutil, importlib\n"
        "import agent\n"
        "names = [m.name for m in pkgutil.walk_packages(agent.__path__, 'agent.')]\n"
        "for name in names:\n"
        "    if name != 'agent.__main__':\n"
        "        importlib.import_module(name)\n"
        "from agent.netns import IPRoute\n"
        "print(json.dumps({'unused': sorted(m for m in ('pyroute2.ndb', 'pyroute2.ipdb', 'sqlite3',\n"
        "    'pyroute2.netlink.nl80211') if m in sys.modules), 'iproute': IPRoute.__module__,\n"
        "    'lazy': '__getattr__' in vars(sys.modules['pyroute2']),\n"
        "    'entry_points': sorted(n for n in ('agent.cli', 'agent.app', 'agent.doctor',\n"
        "        'agent.ebpf.proxier', 'agent.iptables.proxier', 'agent.takeover.into_ebpf')\n"
        "        if n in sys.modules),\n"
        "    'handlers': [type(h).__name__ for h in logging.getLogger('pyroute2').handlers]}))"
    )
    assert out == {
        "unused": [],
        "iproute": "pyroute2.iproute.linux",
        "lazy": True,
        "entry_points": [
            "agent.app",
            "agent.cli",
            "agent.doctor",
            "agent.ebpf.proxier",
            "agent.iptables.proxier",
            "agent.takeover.into_ebpf",
        ],
        "handlers": ["NullHandler"],
    }


def test_a_name_only_the_package_init_defines_loads_it_once() -> None:
    out = run(
        COUNT_LOADS + "import json, sys\n"
        "import agent.netns\n"
        "from pyroute2 import IPRoute, NDB\n"
        "import pyroute2\n"
        "ipdb = pyroute2.IPDB.__name__\n"
        "from pyroute2 import IPSet\n"
        "print(json.dumps({'same': IPRoute is agent.netns.IPRoute, 'ndb': NDB.__module__,\n"
        "    'ipdb': ipdb, 'lazy_left': '__getattr__' in vars(pyroute2),\n"
        "    'missing': hasattr(pyroute2, 'NoSuchName'), 'loads': loads}))"
    )
    assert out == {
        "same": True,
        "ndb": "pyroute2.ndb.main",
        "ipdb": "IPDB",
        "lazy_left": False,
        "missing": False,
        "loads": ["MainThread"],
    }


def test_the_version_is_answered_without_the_package_init() -> None:
    out = run(
        COUNT_LOADS + "import json\n"
        "import agent, pyroute2\n"
        "from pyroute2.config.version import __version__\n"
        "print(json.dumps({'version': pyroute2.__version__, 'expected': __version__,\n"
        "    'loads': loads}))"
    )
    assert out["version"] == out["expected"]
    assert out["loads"] == []


def test_a_second_threads_first_touch_during_the_load_waits_for_it() -> None:
    # The main thread's load stops before the real __init__ runs until the second thread is
    # inside its own first touch (waiting for the lock) or done with it: that thread must get
    # the name from the one load, not an AttributeError or a second load.
    out = run(
        COUNT_LOADS + "import json, threading\n"
        "import agent, agent._pyroute2 as lazy, pyroute2\n"
        "touched = threading.Event()\n"
        "got = {}\n"
        "class SpyLock:\n"
        "    def __init__(self, lock):\n"
        "        self.lock = lock\n"
        "    def __enter__(self):\n"
        "        if threading.current_thread().name == 'second':\n"
        "            touched.set()\n"
        "        self.lock.acquire()\n"
        "    def __exit__(self, *exc):\n"
        "        self.lock.release()\n"
        "lazy._lock = SpyLock(getattr(lazy, '_lock', threading.RLock()))\n"
        "def second():\n"
        "    try:\n"
        "        got['second'] = pyroute2.NDB.__name__\n"
        "    except Exception as exc:\n"
        "        got['second'] = repr(exc)\n"
        "    touched.set()\n"
        "thread = threading.Thread(target=second, name='second')\n"
        "def before_load():\n"
        "    thread.start()\n"
        "    touched.wait(30)\n"
        "got['main'] = pyroute2.IPDB.__name__\n"
        "thread.join(30)\n"
        "print(json.dumps({'got': got, 'loads': loads}))"
    )
    assert out == {"got": {"main": "IPDB", "second": "NDB"}, "loads": ["MainThread"]}


def test_a_failed_load_raises_its_error_and_leaves_the_package_lazy() -> None:
    # sqlite3 missing (NDB needs it): the error is the real one, the lazy hook stays and none of
    # the half-done __init__'s names are left behind, so a later touch loads the package again.
    out = run(
        COUNT_LOADS + "import json, sys\n"
        "import agent, pyroute2\n"
        "sys.modules['sqlite3'] = None\n"
        "try:\n"
        "    from pyroute2 import NDB\n"
        "    first = 'no error'\n"
        "except ImportError as exc:\n"
        "    first = exc.name\n"
        "after = {'lazy': '__getattr__' in vars(pyroute2), 'Conntrack': 'Conntrack' in vars(pyroute2)}\n"
        "del sys.modules['sqlite3']\n"
        "ndb = pyroute2.NDB.__name__\n"
        "print(json.dumps({'first': first, 'after': after, 'retry': ndb,\n"
        "    'lazy_left': '__getattr__' in vars(pyroute2), 'loads': len(loads)}))"
    )
    assert out == {
        "first": "sqlite3",
        "after": {"lazy": True, "Conntrack": False},
        "retry": "NDB",
        "lazy_left": False,
        "loads": 2,
    }
