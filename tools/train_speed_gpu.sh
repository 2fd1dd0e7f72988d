#!/usr/bin/env bash
# Training throughput of the demo model, eager against torch.compile backends, in one device call (~3 minutes
# on an H200): each run trains STEPS stage-1 steps of PRESET and reports ms per step between the first and the
# last logged step after step 0 (logged every STEPS/4), so a compile in the first steps is left out.
# Usage on the device machine, from the repository root:
#   bash tools/train_speed_gpu.sh "$OUT" [steps=400] [preset=demo] [backends="eager-loss inductor"]
# A CPU check (seconds): bash tools/train_speed_gpu.sh /tmp/speed 6 smoke "eager-loss eager"
# "eager-loss" is the plain eager step (compile=""); any other name is a torch.compile backend.
set -u
out=${1:?output folder}
steps=${2:-400}
preset=${3:-demo}
backends=${4:-eager-loss inductor}
log=$(( steps / 4 ))
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
for b in $backends; do
  c=$b; [ "$b" = eager-loss ] && c=
  timeout "${RUN_LIMIT:-280}" $py -m loopline.entrypoints.cli train pretrain --preset "$preset" --out "$out/model-$b" \
    --set stage1_steps="$steps" --set stage2_steps=1 --set stage2_warmup_steps=0 --set eval_batches=1 \
    --set compile="\"$c\"" --log-every "$log" --save-every 0 > "$out/speed-$b.log" 2>&1
  echo "$b rc=$?"
  $py - "$out/speed-$b.log" "$b" "$log" "$steps" <<'PY'
import json, sys
path, name, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rows = {}
for line in open(path, encoding="utf-8"):
    if line.startswith("{"):
        row = json.loads(line)
        if "step" in row and "elapsed_s" in row and row.get("stage") == 1:
            rows[row["step"]] = row["elapsed_s"]
info = next((json.loads(line) for line in open(path, encoding="utf-8") if line.startswith('{"parameters"')), {})
steps = sorted(s for s in rows if first <= s < last)
if len(steps) < 2:
    sys.exit(f"{name}: fewer than two logged stage-1 steps in {path}")
a, b = steps[0], steps[-1]
print(f"{name}: steps {a}-{b}: {(rows[b] - rows[a]) / (b - a) * 1e3:.1f} ms/step; step 0 done at {rows.get(0)} s "
      f"(data, model and the first step with any compile), {info.get('train_tokens', '?')} training tokens")
PY
done
