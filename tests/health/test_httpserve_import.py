"""agent.httpserve imports aiohttp only when a server starts: importing it (as build_agent does,
before the agent's first list request) costs no aiohttp import."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_servers_module_leaves_aiohttp_unimported() -> None:
    code = (
        "import sys, agent.httpserve, agent.health, agent.metrics.server; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
