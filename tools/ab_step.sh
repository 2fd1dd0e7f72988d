#!/usr/bin/env bash
# A/B of whole decode steps between source trees, interleaved in one device call (the ratios are the point:
# the same tree measured twice agreed within ~0.003 ms at one row on an H200, different machines by more).
# Usage, on the device machine: bash tools/ab_step.sh ROWS ROUNDS TREE...
#   each TREE: a copy of the repository, e.g. `git archive <commit> | tar -x -C TREE`, timed with its own
#   tools/profile_step.py (--async-scheduling, 256 steps); prints one line per tree and round.
set -u
rows=${1:?rows}
rounds=${2:?rounds}
shift 2
for ((i = 1; i <= rounds; i++)); do
  for tree in "$@"; do
    line=$(cd "$tree" && PYTHONPATH=$PWD timeout 90 python3 tools/profile_step.py --rows "$rows" \
      --async-scheduling --steps 256 2>&1 | grep -m1 "mean step")
    echo "$tree: ${line:-failed}"
  done
done
