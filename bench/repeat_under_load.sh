#!/usr/bin/env bash
# Runs one test file (or node id) N times in a row while busy loops hold every core, and
# prints how many runs passed: the check that a test waits on events and does not race.
#   bash bench/repeat_under_load.sh tests/test_relay.py 50
set -uo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: repeat_under_load.sh TEST [N]}
runs=${2:-50}
py=.venv/bin/python
hogs=()
for _ in $(seq "$(nproc)"); do
  (while :; do :; done) &
  hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
passed=0
start=$(date +%s)
for i in $(seq "$runs"); do
  if "$py" -m pytest -q -p no:cacheprovider -x "$target" >"/tmp/repeat_under_load.$i.log" 2>&1; then
    passed=$((passed + 1))
  else
    echo "run $i failed: /tmp/repeat_under_load.$i.log"
  fi
done
echo "$target: $passed of $runs runs passed under $(nproc) busy loops in $(( $(date +%s) - start )) s"
