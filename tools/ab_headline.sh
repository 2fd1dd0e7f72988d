#!/usr/bin/env bash
# A/B of the README headline command (defaults a user gets, no tuning flags) between two source trees,
# interleaved in one device call. Prepare the trees here, then carry .ab:
#   mkdir -p .ab/base .ab/head && git archive OLD loopline tools pyproject.toml | tar -x -C .ab/base \
#     && git archive NEW loopline tools pyproject.toml | tar -x -C .ab/head   (.ab in .git/info/exclude)
# Usage on the device machine, from the repository root: bash tools/ab_headline.sh "$OUT" [rounds=1]
set -u
out=${1:?output folder}
rounds=${2:-1}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
for ((i = 1; i <= rounds; i++)); do
  for t in base head; do
    echo "== $t round $i"
    (cd ".ab/$t" && PYTHONPATH=$PWD LOOPLINE_GIT_COMMIT=$t timeout 200 python3 -m loopline.entrypoints.cli bench \
      --config ouro-1.4b --dtype bfloat16 --input-len 1024 --output-len 128 --concurrency 1,32,128 --no-progress \
      --output-json "$out/headline-$t-$i.json" 2> "$out/err-$t-$i.log" | tail -5; tail -2 "$out/err-$t-$i.log")
  done
done
