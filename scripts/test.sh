#!/usr/bin/env bash
# `make test` (and CI): set up (idempotent), lint, then run the whole suite on five pytest-xdist
# workers (tests/parallel.py says how tests are grouped), and print how long each step took.
# Five on a 2-vCPU machine because the lab tests mostly wait (timeouts, backoffs, request loops).
# Single fresh-clone runs on 2026-11-28 (3,216 tests, an empty compile cache, a quiet machine):
# tests 574 s with five workers and 583 s with six on one tree, 595 s with five and 607 s with four
# on the tree before; two runs of one code differed by 35 s, so five is kept as no worse
# (bench/results/suite/workers-2026-11-28.md).
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
bash scripts/setup.sh
setup_done=$(now)
# The packet lab's data path compiled into the machine's cache on the CPU lint leaves idle (mypy
# runs on one): in a fresh clone the packet-lab modules find it there, or wait for it on the
# entry's lock, instead of compiling it first thing (lab/precompile.py). Not waited for before the
# tests; its own session (setsid), so the exit trap ends it and its compiler child together when
# lint fails or the run is interrupted while it runs; its output in a file, so nothing reading this
# script's output (a pipe in CI) waits for it, printed after the tests.
mkdir -p build
setsid .venv/bin/python -m lab.precompile > build/precompile.log 2>&1 &
precompile=$!
# Every xdist worker collects the whole suite, and in a fresh clone the five start together with
# no bytecode of tests/ or lab/ and no assertion-rewritten test module or pytest plugin under
# build/pycache: each compiles and rewrites all of it (measured: 49.1 and 52.6 CPU s for five cold
# collections, 11.8 and 12.2 for one cold; bench/results/suite/workercpu-2026-11-28.md). One
# collection beside lint writes it once; waited for before the workers start (no more than 10
# minutes: pytest-timeout bounds tests, not a collection). Its own session too, for the exit trap.
setsid timeout -k 10 600 .venv/bin/python -m pytest -q --collect-only -p no:cacheprovider tests > build/collect.log 2>&1 &
collect=$!
# Signalled only while bash lists it as running: once it ended (long before the tests do), the
# kernel may have given its pid to another process, and `kill -- -pid` would reach that one's group.
stop_background() {
  local pid
  for pid in "$precompile" "$collect"; do
    if jobs -rp | grep -qx "$pid"; then kill -- -"$pid" 2>/dev/null || true; fi
    wait "$pid" 2>/dev/null || true
  done
}
trap stop_background EXIT
make --no-print-directory lint
lint_done=$(now)
# A collection error is reported by the run itself; a collection that failed or timed out is
# shown here, so a stall is not silent.
collect_status=0
wait "$collect" || collect_status=$?
if [[ "$collect_status" == 124 || "$collect_status" == 137 ]]; then
  echo "make test: the collection beside lint timed out after 10 minutes; its log's end:"
  tail -n 20 build/collect.log || true
elif [[ "$collect_status" != 0 ]]; then
  echo "make test: the collection beside lint exited with status $collect_status; its log's end:"
  tail -n 20 build/collect.log || true
fi
collected=$(now)
dist=(-n "$workers")
[[ "$workers" == 1 ]] && dist=()
status=0
.venv/bin/python -m pytest -q "${dist[@]}" tests "$@" || status=$?
end=$(now)
cat build/precompile.log 2>/dev/null || true
# "tests" starts when the workers do: the collection's wait beyond lint is its own figure. Runs
# before the collection beside lint (fc1a9d0) had five cold collections inside "tests": compare
# their "tests" with "collection after lint" plus "tests".
awk -v a="$start" -v b="$setup_done" -v c="$lint_done" -v k="$collected" -v d="$end" -v w="$workers" -v s="$status" 'BEGIN {
  printf "make test: setup %.0f s, lint %.0f s, collection after lint %.0f s, tests %.0f s (%d workers); %.0f s (%d min %02d s) in all, exit status %d\n",
    b - a, c - b, k - c, d - k, w, d - a, int((d - a) / 60), int(d - a) % 60, s }'
exit "$status"
