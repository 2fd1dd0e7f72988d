#!/usr/bin/env bash
# GRPO on the bundled demo model with verl 0.9.1's trainer (main_ppo, FSDP2 actor + reference) and loopline
# rollouts on one GPU, 20 iterations per run (docs/rl.md, section 10). Three runs:
#   fixed     exit_threshold 1.0 (every token at full depth)
#   adaptive  exit_threshold 0.5, exit depths carried to the actor/reference (LooplineAgentLoopManager)
#   stock     exit_threshold 0.5 with verl's stock agent-loop manager: the actor recomputes at full depth
#             (the mismatch the depth-aware path removes)
# Writes $OUT/verl_grpo_gpu.json: per run, per iteration, the mean reward (critic/score/mean), verl's
# rollout-vs-actor logprob mismatch (training/rollout_probs_diff_mean/max/std, pearson) and timings
# (timing_s/*, weight sync included); plus each run's verl log (JSON lines) and console log.
#
# Needs (offline wheels in $WHEELS, or network): pip install -e ".[verl-train]" -- verl==0.9.1 and its
# requirements (hydra-core, omegaconf, tensordict<=0.10, datasets, pandas, pyarrow, peft, accelerate,
# codetiming, dill, pylatexenc, torchdata, wandb, tensorboard, pybind11, transformers>=5.5.3,<5.11),
# ray>=2.41, cachetools, TransferQueue>=0.1.10, pyzmq, msgspec. No flash-attn, vLLM or SGLang.
#   OUT=/tmp/out ITERS=20 bash tools/verl_grpo_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a directory for the results}
ITERS=${ITERS:-20}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  pip install -q --no-index --find-links "$WHEELS" -e ".[verl-train]"
fi
python tools/verl_grpo_data.py --out "$OUT/data"

run() {  # run LABEL THRESHOLD [extra overrides...]
  local label=$1 threshold=$2
  shift 2
  local start=$SECONDS
  VERL_FILE_LOGGER_PATH="$OUT/$label.jsonl" python -m verl.trainer.main_ppo \
    --config-path="$PWD/tools" --config-name=verl_grpo_demo \
    actor_rollout_ref.model.path="$PWD/loopline/models/demo_ouro" \
    reward.custom_reward_function.path="$PWD/tools/verl_grpo_reward.py" \
    data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/val.parquet" \
    data.train_batch_size=16 data.max_response_length=32 \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.dtype=bfloat16 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16 \
    actor_rollout_ref.rollout.engine_kwargs.loopline.exit_threshold="$threshold" \
    actor_rollout_ref.rollout.engine_kwargs.loopline.num_kv_blocks=4096 \
    trainer.device=cuda trainer.total_training_steps="$ITERS" "trainer.logger=[console,file]" \
    trainer.experiment_name="demo_gpu_$label" trainer.default_local_dir="$OUT/ckpt_$label" \
    "$@" > "$OUT/$label.log" 2>&1
  echo "$label: $((SECONDS - start)) s" | tee -a "$OUT/wall.txt"
  python tools/verl_grpo_summary.py "$OUT/$label.jsonl" --label "$label" --out "$OUT/verl_grpo_gpu.json"
}

run fixed 1.0
run adaptive 0.5
run stock 0.5 actor_rollout_ref.rollout.agent.agent_loop_manager_class=null
python -c "import json, sys; d = json.load(open(sys.argv[1])); [print(k, [round(r.get('critic/score/mean', float('nan')), 3) for r in v], [round(r.get('training/rollout_probs_diff_mean', float('nan')), 5) for r in v]) for k, v in d.items()]" "$OUT/verl_grpo_gpu.json"
