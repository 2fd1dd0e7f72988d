#!/usr/bin/env bash
# Several demo-model training variants side by side on one GPU (docs/training.md, "The H200 runs").
# Usage on the device machine, from the repository root:
#   bash tools/train_sweep_gpu.sh OUT LIMIT_S "name1:--set a=1 --set b=2" "name2:..." ...
# Every variant is `loopline train pretrain --preset demo` plus its overrides, run as its own process at
# the same time (a 5.5M-parameter model leaves most of an H200 idle). Then the variant whose held-out
# loss falls loop by loop and is lowest at full depth is measured through the engine (`loopline train
# curve`) and returned as WINNER.tar.* (15 MB parts); every log goes back in logs.tgz, one line per
# variant in summary.txt. SWEEP_CURVE=0 skips the winner's curve and weights.
set -u
out=${1:?output folder}
limit=${2:?seconds per variant}
shift 2
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out/logs"
pids=()
for spec in "$@"; do
  name=${spec%%:*}; args=${spec#*:}
  # shellcheck disable=SC2086  # the overrides are words on purpose
  timeout "$limit" python3 -m loopline.entrypoints.cli train pretrain --preset demo --out "/tmp/sweep/$name" \
    --checkpoint-dir "/tmp/sweep/$name.state" --save-every 0 --log-every 100 --eval-every 200 $args \
    > "$out/logs/$name.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
winner=$(python3 - "$out" "$@" <<'PY'
import json, sys
out, specs = sys.argv[1], sys.argv[2:]
best = None
with open(f"{out}/summary.txt", "w") as summary:
    for spec in specs:
        name = spec.split(":", 1)[0]
        final, last_eval = None, None
        for line in open(f"{out}/logs/{name}.log"):
            if line.startswith("{") and '"curve"' in line:
                final = json.loads(line)
            elif line.startswith("{") and '"heldout_loop_losses"' in line:
                last_eval = json.loads(line)
        if final is None:  # cut by the limit: its last held-out evaluation, if any, still compares
            cut = (f"cut; last evaluation at step {last_eval['step']}: {last_eval['heldout_loop_losses']}"
                   if last_eval else "no evaluation")
            print(f"{name}: no final line ({cut})", file=summary)
            continue
        losses = final["heldout"]["loop_losses"] if "heldout" in final else final["loop_losses"]
        falls = all(a > b for a, b in zip(losses, losses[1:]))
        print(f"{name}: loop losses {[round(x, 4) for x in losses]} falls={falls} spec={spec}", file=summary)
        key = (not falls, losses[-1])
        if best is None or key < best[0]:
            best = (key, name)
print(best[1] if best else "")
PY
)
cat "$out/summary.txt"
if [ -n "$winner" ] && [ "${SWEEP_CURVE:-1}" != 0 ]; then
  echo "winner: $winner"
  timeout 200 python3 -m loopline.entrypoints.cli train curve --model "/tmp/sweep/$winner" \
    --out "/tmp/sweep/$winner/exit_curve.json" > /dev/null 2> "$out/logs/curve.err" || tail -3 "$out/logs/curve.err"
  (cd /tmp/sweep && tar cf - "$winner") | split -b 15M - "$out/$winner.tar."
fi
tar -czf "$out/logs.tgz" -C "$out" logs && rm -r "$out/logs"
