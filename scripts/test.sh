#!/usr/bin/env bash
# `make test` (and CI): set up (idempotent), lint, then run the whole suite on five pytest-xdist
# workers (tests/parallel.py says how tests are grouped), and print how long each step took.
# Five on a 2-vCPU machine because the lab tests mostly wait (timeouts, backoffs, request loops):
# the machine stays a little idle with four. Fresh clones of one tree on 2026-11-28 (3,216 tests,
# an empty compile cache, a quiet machine): tests 574 s with five workers, 583 s with six; 595 s
# with five and 607 and 622 s with four for the tree before (bench/results/suite/workers-2026-11-28.md).
# EKP_TEST_WORKERS sets the number of workers (1: one process, in the plain order); extra arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

now() { date +%s.%N; }
workers=${EKP_TEST_WORKERS:-5}
# Bytecode kept under build/ (not beside the sources, not committed): with PYTHONDONTWRITEBYTECODE=1
# (this machine's environment and the Makefile set it) every agent a lab test starts compiled each
# agent module from source, about 0.25 CPU s a start (bench/results/scale/restart21-bytecode-2026-11-27.txt),
# and the suite starts hundreds. Written atomically by Python, so parallel workers may share it.
export PYTHONPYCACHEPREFIX="$PWD/build/pycache"
unset PYTHONDONTWRITEBYTECODE
# Bytecode of tests' copies under /tmp: pytest reuses its pytest-of-root/pytest-N paths once /tmp
# is emptied, and old bytecode there would pass for that of the new copy.
rm -rf build/pycache/tmp
start=$(now)
bash scripts/setup.sh --system-only
# The packet lab's data path compiled into the machine's cache on the CPU pip leaves idle while the
# virtualenv is made and filled, with the system's Python (/usr/bin/python3, whose dist-packages
# hold bcc: python3-bpfcc; a `python3` earlier on PATH, pyenv's here, may have none), by path
# (lab/precompile.py needs only the standard library, bcc and agent/ebpf, none of the
# virtualenv's packages). In a fresh clone the packet-lab modules find it there, or wait for it on
# the entry's lock, instead of compiling it first thing. Not waited for before the tests; its own
# session (setsid), so the exit trap ends it and its compiler child together when the run fails
# or is interrupted; its output in a file, so nothing reading this script's output (a pipe in CI)
# waits for it, printed after the tests.
mkdir -p build
PYTHONPATH="$PWD" setsid /usr/bin/python3 lab/precompile.py > build/precompile.log 2>&1 &
precompile=$!
lint=""
trap 'for p in $precompile $lint; do kill -- -"$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done' EXIT
bash scripts/setup.sh --no-system
setup_done=$(now)
# Lint beside the tests, not before them: mypy keeps one CPU busy for its whole run and the suite's
# first minutes have room for it (bench/results/suite/workers-2026-11-28.md). Its output and
# status come after the tests'; a lint failure fails the run as before.
rm -f build/lint.end
setsid bash -c 'make --no-print-directory lint > build/lint.log 2>&1; rc=$?; date +%s.%N > build/lint.end; exit $rc' &
lint=$!
dist=(-n "$workers")
[[ "$workers" == 1 ]] && dist=()
status=0
.venv/bin/python -m pytest -q "${dist[@]}" tests "$@" || status=$?
end=$(now)
lint_status=0
wait "$lint" || lint_status=$?
lint=""
cat build/lint.log
[[ "$lint_status" == 0 ]] || echo "make test: lint failed (exit status $lint_status): its output is above"
lint_end=$(cat build/lint.end 2>/dev/null || now)
finish=$(now)
cat build/precompile.log 2>/dev/null || true
[[ "$status" != 0 || "$lint_status" == 0 ]] || status=$lint_status
awk -v a="$start" -v b="$setup_done" -v c="$lint_end" -v d="$end" -v f="$finish" -v w="$workers" -v s="$status" 'BEGIN {
  printf "make test: setup %.0f s, lint %.0f s (beside the tests), tests %.0f s (%d workers); %.0f s (%d min %02d s) in all, exit status %d\n",
    b - a, c - b, d - b, w, f - a, int((f - a) / 60), int(f - a) % 60, s }'
exit "$status"
