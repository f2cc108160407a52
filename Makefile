# The two commands a newcomer runs (as root): `make demo` and `make test`.
# Both install what they need first (scripts/setup.sh, idempotent).
PY := .venv/bin/python
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup demo demo-api test unit kernel lint golden bench clean-lab cleanup

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m demo.files

# The agent following a (fake) API server: create, scale, watch faults, health, metrics, Events.
demo-api: setup
	$(PY) -m demo.api

test: setup lint
	$(PY) -m pytest -q tests

# Pure tests only: no root, no kernel.
unit:
	$(PY) -m pytest -q tests -m "not kernel"

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

# Removes lab namespaces and processes left behind by a killed run.
clean-lab:
	$(PY) -m lab cleanup
