# The two commands a newcomer runs (as root): `make demo` and `make test`.
# Both install what they need first (scripts/setup.sh, idempotent).
PY := .venv/bin/python
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup demo demo-api test unit lint golden bench clean-lab lock test-latest

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m demo.files

# The agent following a (fake) API server: create, scale, watch faults, health, metrics, Events.
demo-api: setup
	$(PY) -m demo.api

# Set-up, lint, then the suite on five workers (pytest-xdist), each step's time printed at the end:
# scripts/test.sh. EKP_TEST_WORKERS=1 runs it in one process.
test:
	@bash scripts/test.sh

# Pure tests only: no root, no kernel. The one target where a skip (a test that needs root or a
# compiler) does not fail the run; `make test` and CI allow none (tests/conftest.py).
unit:
	EKP_ALLOW_SKIP=1 $(PY) -m pytest -q tests -m "not kernel"

# Rewrites requirements/dev.lock and requirements/agent.lock from pyproject.toml's ranges (uv, exact
# versions and hashes). Run it after changing a dependency range, and to take newer releases (after
# `make test-latest` is green); review the diff, then `make test`.
lock:
	@bash scripts/lock.sh

# The newest releases inside the ranges, in build/latest-venv, running the pure tests: finds drift
# before a lock update meets it. Not part of `make test` or CI.
test-latest:
	@bash scripts/test-latest.sh

lint:
	.venv/bin/ruff check agent tests bench lab demo
	.venv/bin/ruff format --check agent tests bench lab demo
	.venv/bin/mypy
	.venv/bin/lint-imports

# Regenerates every golden file from the current code; review the diff before committing.
golden:
	EKP_REGEN_GOLDEN=1 $(PY) -m pytest -q tests -k golden

bench: setup
	$(PY) -m bench

# Removes lab namespaces and processes left behind by a killed run (a running lab is left whole:
# its tmp dir names its owner, lab/netns.py owned_tmpdir).
clean-lab:
	$(PY) -m lab cleanup
