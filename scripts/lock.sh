#!/usr/bin/env bash
# Regenerates the dependency locks from pyproject.toml's ranges (`make lock`); review the diff.
#   requirements/dev.lock    the agent's dependencies, the dev tools and the build backend: setup.sh
#   requirements/agent.lock  the agent's dependencies alone, the same versions: the Dockerfile
# Exact versions with the hashes of every file PyPI serves for them, resolved for CPython 3.11 on
# x86-64 Linux (Debian 12's Python, the image's and this machine's), whatever runs this script.
# uv is the resolver: one pinned wheel, and it resolves for a target Python and platform instead of
# the interpreter it runs under (pip-compile resolves for its own), in a second.
set -euo pipefail

UV_VERSION=0.13.8
top=$(cd "$(dirname "$0")/.." && pwd)
tools="$top/build/uv-$UV_VERSION"
if [[ ! -x "$tools/bin/uv" ]]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION"
fi
uv=("$tools/bin/uv" pip compile --quiet --generate-hashes --python-version 3.11
  --python-platform x86_64-unknown-linux-gnu --custom-compile-command "make lock" "$@")
cd "$top"
"${uv[@]}" pyproject.toml requirements/build.in --extra dev -o requirements/dev.lock
# Constrained by the dev lock, so the image runs exactly the versions the tests ran.
"${uv[@]}" pyproject.toml requirements/build.in -c requirements/dev.lock -o requirements/agent.lock
