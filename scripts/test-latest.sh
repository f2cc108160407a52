#!/usr/bin/env bash
# `make test-latest`: the newest releases inside pyproject.toml's ranges, in a virtualenv of their
# own (build/latest-venv), running the pure tests (no root, no kernel). Not part of `make test` or
# CI: it finds drift on purpose (a new PyYAML, kubernetes client or mypy) before a lock update
# meets it. It prints what differs from requirements/dev.lock, then pytest's verdict.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
venv="$top/build/latest-venv"
py=$(command -v python3.11 || command -v python3)
rm -rf "$venv"
"$py" -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[[ -e /usr/lib/python3/dist-packages/bcc ]] && ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
"$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip
"$venv/bin/pip" install -q --disable-pip-version-check --upgrade --upgrade-strategy eager "$top[dev]"

echo "test-latest: versions that differ from requirements/dev.lock (locked -> latest):"
"$venv/bin/python" - "$top/requirements/dev.lock" <<'PY'
import re, sys
from importlib import metadata
from packaging.utils import canonicalize_name
locked = dict(re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", open(sys.argv[1]).read(), re.M))
locked = {canonicalize_name(k): v for k, v in locked.items()}
now = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
# setuptools builds in pip's isolated environment here: the venv's own copy is not the one used.
changed = [f"  {n}: {v} -> {now[n]}" for n, v in sorted(locked.items())
           if n in now and now[n] != v and n != "setuptools"]
print("\n".join(changed) or "  none")
PY
cd "$top"
# The pure tests; the lab's would skip here, which EKP_ALLOW_SKIP permits for this run alone.
EKP_ALLOW_SKIP=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not kernel" tests \
  --deselect tests/test_locks.py::test_this_virtualenv_holds_exactly_the_dev_lock "$@"
