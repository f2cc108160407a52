"""agent/_pyroute2.py: an agent process imports the pyroute2 modules it uses, not the whole library.

Each case runs a fresh interpreter: this test process has long imported pyroute2 whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(code: str) -> dict[str, object]:
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, check=True
    )
    out: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def test_the_agents_modules_leave_pyroute2s_other_parts_unimported() -> None:
    # IPDB/NDB (sqlite3) and nl80211 are what pyroute2's own __init__ imports besides what we use
    out = run(
        "import json, sys, logging\n"
        "import agent.netns, agent.app, agent.ebpf.proxier, agent.iptables.proxier, agent.nodewatch\n"
        "import agent.takeover.into_ebpf, agent.ebpf.tcx\n"
        "from agent.netns import IPRoute\n"
        "print(json.dumps({'unused': sorted(m for m in ('pyroute2.ndb', 'pyroute2.ipdb', 'sqlite3',\n"
        "    'pyroute2.netlink.nl80211') if m in sys.modules), 'iproute': IPRoute.__module__,\n"
        "    'handlers': [type(h).__name__ for h in logging.getLogger('pyroute2').handlers]}))"
    )
    assert out == {"unused": [], "iproute": "pyroute2.iproute.linux", "handlers": ["NullHandler"]}


def test_a_name_only_the_package_init_defines_loads_it_once() -> None:
    out = run(
        "import json, sys\n"
        "import agent.netns\n"
        "from pyroute2 import IPRoute, NDB\n"
        "import pyroute2\n"
        "print(json.dumps({'same': IPRoute is agent.netns.IPRoute, 'ndb': NDB.__module__,\n"
        "    'ipdb': pyroute2.IPDB.__name__, 'lazy_left': '__getattr__' in vars(pyroute2),\n"
        "    'missing': hasattr(pyroute2, 'NoSuchName')}))"
    )
    assert out == {
        "same": True,
        "ndb": "pyroute2.ndb.main",
        "ipdb": "IPDB",
        "lazy_left": False,
        "missing": False,
    }


def test_a_submodule_asked_for_as_an_attribute_is_imported_alone() -> None:
    out = run(
        "import json, sys\n"
        "import agent\n"
        "import pyroute2\n"
        "nl = pyroute2.netlink\n"
        "print(json.dumps({'name': nl.__name__, 'whole': 'pyroute2.ndb' in sys.modules}))"
    )
    assert out == {"name": "pyroute2.netlink", "whole": False}
