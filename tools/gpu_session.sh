#!/usr/bin/env bash
# One device call that checks and measures everything GPU-side (H200, ~8 minutes).
# Usage on the device machine, from the repository root:
#   bash tools/gpu_session.sh "$OUT" [commit]
# Writes logs and JSON records under the output folder (device tool: $OUT).
set -u
out=${1:?output folder}
commit=${2:-unknown}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LOOPLINE_GIT_COMMIT=$commit
bench() { timeout "$1" python3 -m loopline.entrypoints.cli bench --config ouro-1.4b --dtype bfloat16 --no-progress \
          --kv-cache-memory-gb 40 "${@:2}"; }

# 1. correctness on the GPU: attention, sampler, fused kernels, engine (graphs, async, backends)
timeout 240 python3 -m pytest -q -m gpu tests/attention tests/kernels tests/worker > "$out/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$out/gpu_tests.log")"
# 2. where a decode step's time goes, sync vs async
timeout 90 python3 tools/profile_step.py --rows 1 --kernels 2>&1 | grep -v Warn | head -34 > "$out/profile.txt"
timeout 60 python3 tools/profile_step.py --rows 1 --async-scheduling 2>&1 | grep -v Warn | head -2 >> "$out/profile.txt"
timeout 60 python3 tools/profile_step.py --rows 64 2>&1 | grep -v Warn | head -4 >> "$out/profile.txt"
timeout 60 python3 tools/profile_step.py --rows 64 --async-scheduling 2>&1 | grep -v Warn | head -2 >> "$out/profile.txt"
cat "$out/profile.txt"
# 3. full depth, 1024 in / 128 out: sync vs async at C = 1 and 32, then C = 128 async
for c in 1 32; do
  bench 150 --input-len 1024 --output-len 128 --concurrency $c --max-num-batched-tokens 8192 \
        --output-json "$out/fixed-c$c.json" > /dev/null 2> "$out/fixed-c$c.err"
  bench 150 --input-len 1024 --output-len 128 --concurrency $c --max-num-batched-tokens 8192 --async-scheduling \
        --output-json "$out/fixed-async-c$c.json" > /dev/null 2> "$out/fixed-async-c$c.err"
done
bench 150 --input-len 1024 --output-len 128 --concurrency 128 --max-num-batched-tokens 8192 --async-scheduling \
      --output-json "$out/fixed-async-c128.json" > /dev/null 2> "$out/fixed-async-c128.err"
python3 - "$out" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/fixed*.json")):
    m = json.load(open(f))["results"][0]["variants"][0]["median"]
    print(f.rsplit("/", 1)[1], round(m["output_throughput"], 1), "tok/s, TPOT p50", round(m["tpot_ms"]["p50"], 2), "ms")
PY
