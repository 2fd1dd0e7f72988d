#!/usr/bin/env bash
# GRPO on the bundled demo model with verl 0.9.1's trainer (main_ppo, FSDP2 actor + reference) and loopline
# rollouts on one GPU (docs/rl.md, section 10), one phase per device call (each at most ~540 s on an H100:
# verl starts in ~2 minutes, an iteration takes ~8 s):
#   PHASE=1  adaptive  exit_threshold 0.5, exit depths carried to the actor/reference (LooplineAgentLoopManager),
#                      ITERS iterations; saves at iteration SAVE_AT (default ITERS/2) and at the last one
#   PHASE=2  fixed     exit_threshold 1.0 (every token at full depth), ITERS iterations
#            resumed   adaptive resumed from its save at SAVE_AT for iteration SAVE_AT+1, compared with adaptive's
#                      (tools/verl_grpo_resume_check.py, samples included); if that save is gone (a fresh
#                      machine), a 3-iteration run saving at 2 is the continued run instead
#            serve     adaptive's last checkpoint exported (python -m loopline.integrations.verl_checkpoint) and
#                      served by `loopline serve`, one completion (tools/verl_serve_check.py)
#   PHASE=3  stock     exit_threshold 0.5 with verl's stock agent-loop manager: the actor recomputes at full depth
#                      (optional: the contrast the depth-aware manager removes)
# Checkpoints, data and verl's logs live in WORK (default /tmp/verl_grpo: it survives between the calls on a
# warm machine); each phase writes its results to OUT: verl_grpo_gpu.json (per run, per iteration: reward,
# rollout-vs-actor mismatch, timings; tools/verl_grpo_summary.py), RUN.log / RUN.jsonl, timing.txt (one line
# per run), resume_check.json, serve.json, and the plots when matplotlib is there (tools/verl_grpo_plot.py).
# Each run has a wall-clock limit (LIMIT1 / LIMIT2 / LIMIT_RESUME / LIMIT3 seconds); a run cut short keeps the
# iterations it logged. EXTRA: more Hydra overrides for every run, space-separated.
#
# No pip install here: the packages of docs/rl.md ("Wheels for the GPU run") are on PYTHONPATH, e.g. from the
# payload of tools/verl_payload.sh (carry .verl):
#   bash tools/verl_payload.sh install; export PYTHONPATH=$PWD:/tmp/site
#   OUT=/tmp/out1 PHASE=1 bash tools/verl_grpo_gpu.sh   (then PHASE=2, and PHASE=3 if wanted, on the same machine)
# On the CPU (a check that the script runs end to end; fp32, tiny batches, no reference model):
#   OUT=/tmp/out DEVICE=cpu ITERS=2 WORK=/tmp/verl_grpo_cpu PHASE=1 bash tools/verl_grpo_gpu.sh   (then 2 and 3)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a directory for the results}
PHASE=${PHASE:?set PHASE to 1, 2 or 3}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
ITERS=${ITERS:-20}
SAVE_AT=${SAVE_AT:-$((ITERS / 2))}
WORK=${WORK:-/tmp/verl_grpo}
LIMIT1=${LIMIT1:-480}
LIMIT2=${LIMIT2:-330}
LIMIT_RESUME=${LIMIT_RESUME:-150}
LIMIT3=${LIMIT3:-480}
EXTRA=${EXTRA:-}
MODEL=$PWD/loopline/models/demo_ouro
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1

if [ "$DEVICE" = cuda ]; then
  SERVE_DTYPE=bfloat16
  DEVICE_ARGS=(trainer.device=cuda
    data.train_batch_size=16 data.max_response_length=8 actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.dtype=bfloat16 actor_rollout_ref.rollout.enforce_eager=True
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16
    actor_rollout_ref.rollout.engine_kwargs.loopline.num_kv_blocks=4096
    # Ray's dashboard is not in the wheels: without this, ray.init waits 60 s for it to fail
    +ray_kwargs.ray_init.include_dashboard=False)
elif [ "$DEVICE" = cpu ]; then
  # verl has no CPU platform: loopline's (loopline/integrations/verl_cpu.py) and a logical GPU for placement
  export VERL_PLATFORM=loopline_cpu OMP_NUM_THREADS=1
  SERVE_DTYPE=float32
  DEVICE_ARGS=(trainer.device=cpu +ray_kwargs.ray_init.num_gpus=1 ray_kwargs.ray_init.num_cpus=16)
else
  echo "DEVICE must be cuda or cpu, got $DEVICE" >&2; exit 2
fi

# verl's validation: the 6 held-out prompts, 8 samples each at the training temperature, every 10 iterations
# and after the last (runs that start fresh add trainer.val_before_train=True: iteration 0, before training;
# a resumed run does not, so the engine sees what the continued run's did before the compared iteration)
VAL_ARGS=(trainer.test_freq=10 actor_rollout_ref.rollout.val_kwargs.n=8 actor_rollout_ref.rollout.val_kwargs.do_sample=True
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0)

ray_stop() {  # after a run cut short: its Ray processes would hold the GPU (never on a shared CPU machine)
  if [ "$DEVICE" = cuda ]; then "$PY" -m ray.scripts.scripts stop --force > /dev/null 2>&1 || true; fi
}

run() {  # run LABEL THRESHOLD LIMIT_S ITERATIONS [overrides...]: one main_ppo run, its summary and a timing line
  local label=$1 threshold=$2 limit=$3 iters=$4 rc=0 start=$SECONDS
  shift 4
  rm -rf "$WORK/$label.jsonl" "$WORK/generations/$label"
  VERL_FILE_LOGGER_PATH="$WORK/$label.jsonl" timeout -k 20 "$limit" "$PY" -m verl.trainer.main_ppo \
    --config-path="$PWD/tools" --config-name=verl_grpo_demo \
    actor_rollout_ref.model.path="$MODEL" reward.custom_reward_function.path="$PWD/tools/verl_grpo_reward.py" \
    data.train_files="$WORK/data/train.parquet" data.val_files="$WORK/data/val.parquet" \
    actor_rollout_ref.rollout.engine_kwargs.loopline.exit_threshold="$threshold" \
    trainer.total_training_steps="$iters" "trainer.logger=[console,file]" \
    trainer.experiment_name="demo_${DEVICE}_$label" trainer.default_local_dir="$WORK/ckpt_$label" \
    trainer.rollout_data_dir="$WORK/generations/$label" \
    hydra.run.dir="$WORK/hydra/$label" \
    "${DEVICE_ARGS[@]}" "${VAL_ARGS[@]}" $EXTRA "$@" > "$OUT/$label.log" 2>&1 || rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && ray_stop
  local logged=0
  # (training iterations: a validation before training logs a record of its own)
  [ -f "$WORK/$label.jsonl" ] && logged=$(grep -c '"critic/score/mean"' "$WORK/$label.jsonl")
  echo "$label: rc=$rc, $logged/$iters iterations logged in $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/timing.txt"
  if [ "$logged" -gt 0 ]; then
    cp "$WORK/$label.jsonl" "$OUT/"
    "$PY" tools/verl_grpo_summary.py "$WORK/$label.jsonl" --label "$label" --out "$WORK/verl_grpo_gpu.json"
  else
    grep -E "Error|error" "$OUT/$label.log" | tail -5 | cut -c1-300
  fi
  return "$rc"
}

report() {  # the merged summary, the plots (when matplotlib is there), one line per run
  [ -f "$WORK/verl_grpo_gpu.json" ] || return 0
  cp "$WORK/verl_grpo_gpu.json" "$OUT/"
  if "$PY" -c "import matplotlib" 2> /dev/null; then
    "$PY" tools/verl_grpo_plot.py "$OUT/verl_grpo_gpu.json" --out "$OUT" --prefix "verl_grpo_$DEVICE" \
      --runs fixed,adaptive,stock
  fi
  "$PY" - "$OUT/verl_grpo_gpu.json" <<'EOF'
import json, statistics, sys
sys.path.insert(0, "tools")
from verl_grpo_plot import held_out_key  # (matplotlib only inside its draw)
for label, rows in json.load(open(sys.argv[1])).items():
    steps = [r["timing_s/step"] for r in rows if "timing_s/step" in r]
    key = held_out_key(rows)
    held_out = {r["step"]: round(r[key], 3) for r in rows if key in r} if key else {}
    rows = [r for r in rows if "critic/score/mean" in r]
    print(label, "reward", [round(r["critic/score/mean"], 3) for r in rows],
          "mismatch", [f'{r.get("training/rollout_probs_diff_mean", float("nan")):.1e}' for r in rows],
          f"median step {statistics.median(steps):.2f} s" if steps else "", f"held-out reward {held_out}" if held_out else "")
EOF
}

preflight() {  # every module the runs import (docs/rl.md, "Wheels for the GPU run"): all missing ones at once
  "$PY" - 2> "$OUT/preflight.err" <<'EOF' | tee "$OUT/preflight.txt"
import importlib, sys
mods = ("verl ray hydra omegaconf antlr4 tensordict pyvers orjson cloudpickle datasets dill multiprocess xxhash "
        "codetiming torchdata transfer_queue zmq msgspec cachetools fastapi starlette uvicorn pydantic "
        "prometheus_client aiohttp aiohttp_cors colorful colorama opencensus google.api_core opentelemetry.sdk "
        "opentelemetry.exporter.prometheus opentelemetry.exporter.otlp.proto.http "
        "jsonschema msgpack requests grpc tabulate psutil pandas pyarrow peft accelerate transformers safetensors "
        "tokenizers loopline").split()
missing = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:  # report every missing module, then stop
        missing.append(f"{m} ({type(e).__name__}: {e})")
from packaging.version import Version
import transformers
if not Version("5.5.3") <= Version(transformers.__version__) < Version("5.11"):
    missing.append(f"transformers {transformers.__version__} (verl 0.9.1 needs >=5.5.3,<5.11)")
print("preflight:", "ok" if not missing else "MISSING " + "; ".join(missing))
sys.exit(3 if missing else 0)
EOF
}

preflight || exit 3
[ -f "$WORK/data/train.parquet" ] || "$PY" tools/verl_grpo_data.py --out "$WORK/data"
if [ "$PHASE" = 1 ]; then
  rm -f "$WORK/verl_grpo_gpu.json"
  rm -rf "$WORK/ckpt_adaptive"
  run adaptive 0.5 "$LIMIT1" "$ITERS" trainer.save_freq="$SAVE_AT" trainer.val_before_train=True
  report
elif [ "$PHASE" = 2 ]; then
  rm -rf "$WORK/ckpt_fixed"
  run fixed 1.0 "$LIMIT2" "$ITERS" trainer.val_before_train=True
  continued=adaptive k=$SAVE_AT
  if [ ! -d "$WORK/ckpt_adaptive/global_step_$k" ]; then
    echo "no adaptive checkpoint at iteration $k in $WORK: a 3-iteration run saving at 2 is the continued run"
    continued=continued k=2
    rm -rf "$WORK/ckpt_continued"
    run continued 0.5 "$LIMIT_RESUME" 3 trainer.save_freq=2
  fi
  rm -rf "$WORK/ckpt_resumed"
  run resumed 0.5 "$LIMIT_RESUME" "$((k + 1))" trainer.resume_mode=resume_path \
    trainer.resume_from_path="$WORK/ckpt_$continued/global_step_$k"
  "$PY" tools/verl_grpo_resume_check.py "$WORK/$continued.jsonl" "$WORK/resumed.jsonl" --step "$((k + 1))" \
    --out "$OUT/resume_check.json" --generations "$WORK/generations/$continued" "$WORK/generations/resumed" \
    | tee "$OUT/resume_check.txt"
  last=$(cat "$WORK/ckpt_adaptive/latest_checkpointed_iteration.txt" 2> /dev/null || echo "")
  if [ -n "$last" ]; then
    start=$SECONDS
    rm -rf "$WORK/export"
    "$PY" -m loopline.integrations.verl_checkpoint "$WORK/ckpt_adaptive/global_step_$last" "$WORK/export" --base "$MODEL" \
      && timeout 120 "$PY" tools/verl_serve_check.py "$WORK/export" --out "$OUT/serve.json" --device "$DEVICE" --dtype "$SERVE_DTYPE" --ready-timeout 90
    echo "serve (adaptive, iteration $last): rc=$?, $((SECONDS - start)) s" | tee -a "$OUT/timing.txt"
  else
    echo "no adaptive checkpoint in $WORK/ckpt_adaptive: nothing to serve" | tee -a "$OUT/timing.txt"
  fi
  report
elif [ "$PHASE" = 3 ]; then
  rm -rf "$WORK/ckpt_stock"
  run stock 0.5 "$LIMIT3" "$ITERS" trainer.val_before_train=True actor_rollout_ref.rollout.agent.agent_loop_manager_class=null
  report
else
  echo "PHASE must be 1, 2 or 3, got $PHASE" >&2; exit 2
fi
