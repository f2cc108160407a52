#!/usr/bin/env bash
# `make test` (and CI): set up (idempotent), lint, then run the whole suite on three pytest-xdist
# workers (tests/parallel.py says how tests are grouped), and print how long each step took.
# Three on a 2-vCPU machine because the lab tests mostly wait (timeouts, backoffs, request loops):
# the whole run takes about 700 s of CPU (user + sys, labs included), while two workers were busy
# 2 x 619 s in a quiet run, so the CPUs sat idle almost half the time; a third worker fills it.
# EKP_TEST_WORKERS sets the number of workers (1: one process, in the plain order); extra arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

now() { date +%s.%N; }
workers=${EKP_TEST_WORKERS:-3}
start=$(now)
bash scripts/setup.sh
setup_done=$(now)
make --no-print-directory lint
lint_done=$(now)
dist=(-n "$workers")
[[ "$workers" == 1 ]] && dist=()
status=0
.venv/bin/python -m pytest -q "${dist[@]}" tests "$@" || status=$?
end=$(now)
awk -v a="$start" -v b="$setup_done" -v c="$lint_done" -v d="$end" -v w="$workers" -v s="$status" 'BEGIN {
  printf "make test: setup %.0f s, lint %.0f s, tests %.0f s (%d workers); %.0f s (%d min %02d s) in all, exit status %d\n",
    b - a, c - b, d - c, w, d - a, int((d - a) / 60), int(d - a) % 60, s }'
exit "$status"
