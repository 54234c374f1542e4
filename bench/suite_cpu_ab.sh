#!/bin/bash
# The test suite's CPU with and without what `make test` sets up for it, side by side on one host:
#   A: the project's modules not compiled ahead (each process compiles them where the environment
#      sets PYTHONDONTWRITEBYTECODE), torch's default threads;
#   B: as `make test` runs: compiled ahead (`make setup`: compileall), OMP_NUM_THREADS=1.
# Alternates A and B for ROUNDS rounds over a few test files; prints each run's wall and user+sys.
#   bash bench/suite_cpu_ab.sh [ROUNDS]      (from the repository root, after `make setup`)
set -u
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
SUBSET="tests/test_elastic.py tests/test_live_resize.py tests/test_function.py tests/test_policy.py"
for round in $(seq 1 "$ROUNDS"); do
  for v in A B; do
    find flows tasks training cluster tests -name __pycache__ -type d -exec rm -rf {} +
    if [ "$v" = B ]; then .venv/bin/python -m compileall -q flows tasks training cluster tests; export OMP_NUM_THREADS=1; else unset OMP_NUM_THREADS; fi
    /usr/bin/time -f "$v round $round: %e s wall, %U + %S s user+sys" env PYTHONDONTWRITEBYTECODE=1 \
      .venv/bin/python -m pytest -q -p no:cacheprovider -n 3 $SUBSET 2>&1 | tail -2
  done
done
.venv/bin/python -m compileall -q flows tasks training cluster tests  # as make setup leaves it
