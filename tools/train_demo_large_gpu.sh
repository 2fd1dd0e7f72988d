#!/usr/bin/env bash
# The demo model on the larger corpus (preset demo-large, docs/training.md), then what it measures: held-out loss
# per loop, the exit curve through the engine, and nats per byte against the bundled demo model on the same files.
# Usage on the device machine, from the repository root:
#   bash tools/train_demo_large_gpu.sh "$OUT" [limit_s] [name] [extra `loopline train pretrain` args, e.g. --set ...]
# The run (~8 minutes of training on an H200 plus ~1 minute building the data) may not fit one device call of
# 10 minutes: training stops after limit_s (default 540), its state saved every 500 steps under
# $STATE_ROOT/NAME.state (default build/demo-large: ignored by git, so it stays on the warm machine between calls).
# Calling the same command again resumes it (the checkpoint's config wins); with REQUIRE_RESUME=1 a call that
# finds no saved state (the machine went cold between calls) stops at once instead of starting over. Once
# trained, in the same or the next call: `loopline train curve` ($EVAL_WINDOWS windows of $EVAL_SEQ_LEN tokens, default 256 x 512), the model
# card, tools/heldout_per_byte.py, then NAME.summary.json, NAME.log and the exported directory as NAME.tar.*
# (15 MB parts); with BENCH=1, refill vs no_refill vs fixed on its exits (NAME.bench.json). A new NAME starts a new
# run. Needs the license-expression package (loopline[train]; on the device
# machine carry its wheel and boolean.py's, both pure Python).
# A reduced form for a CPU (about a minute):
#   EVAL_WINDOWS=2 EVAL_SEQ_LEN=64 bash tools/train_demo_large_gpu.sh /tmp/out 300 cpu-check --device cpu \
#     --set corpus.max_bytes=1500000 --set corpus.heldout_per_mille=100 --set stage1_steps=2 --set stage2_steps=2 --set batch_size=2 --set seq_len=64 \
#     --set warmup_steps=1 --set stage2_warmup_steps=1 --set eval_batches=1
set -u
out=${1:?output folder}
limit=${2:-540}
name=${3:-demo-large}
shift 3 || shift $#
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
root=${STATE_ROOT:-build/demo-large}
windows=${EVAL_WINDOWS:-256}
seq_len=${EVAL_SEQ_LEN:-512}
model=$root/$name
state=$root/$name.state
log=$out/$name.log
mkdir -p "$root" "$out"

$py - <<'PY' 2>&1 | tee -a "$log"
# which of the preset's packages this interpreter has and accepts (the run stops at the data on any error here:
# drop a package with --set 'corpus.packages=[...]')
import sys, sysconfig
import torch
from loopline.train.presets import DEMO_LARGE_PACKAGES
from loopline.train.corpus import CorpusSpec, distribution_source
print(sys.version.split()[0], sysconfig.get_paths()["stdlib"], "torch", torch.__version__,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for name in DEMO_LARGE_PACKAGES:
    try:
        s = distribution_source(name, CorpusSpec())
        print(f"  {name} {s.version}: {len(s.files)} files, {sum((s.root / f).stat().st_size for f in s.files):,} bytes; {s.license}")
    except (LookupError, ValueError) as e:
        print(f"  {name}: ERROR {e}")
PY

if [ ! -f "$model/training_info.json" ]; then
  resume=()
  if [ -f "$state/train_state.pt" ]; then
    resume=(--resume)
    echo "resuming $state" | tee -a "$log"
  elif [ -n "${REQUIRE_RESUME:-}" ]; then  # a follow-up call that landed on a fresh machine: stop, start nothing
    echo "NO STATE: $state is not on this machine (a fresh one); nothing run" | tee -a "$log"
    exit 0
  fi
  timeout "$limit" $py -m loopline.entrypoints.cli train pretrain --preset demo-large --out "$model" --checkpoint-dir "$state" \
    --save-every 500 --log-every 200 --eval-every 1000 "${resume[@]}" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ]; then
    echo "PARTIAL: training did not finish within ${limit}s; run the same command again to resume from the last" \
      "saved step" | tee -a "$log"
    exit 0
  elif [ "$rc" -ne 0 ]; then
    echo "FAILED: loopline train pretrain exited $rc (see $log)" | tee -a "$log"
    exit 1
  fi
fi

# The exported weights go back first: if the call's time runs out in the measurements below, they are
# not lost (the second run's 508 s of training left too little for the rest, and nothing came back).
pack() { rm -f "$out/$name.tar."*; (cd "$root" && tar cf - "$name") | split -b 15M - "$out/$name.tar."; }
pack

if [ ! -f "$model/exit_curve.json" ]; then
  timeout "${CURVE_LIMIT:-300}" $py -m loopline.entrypoints.cli train curve --model "$model" --out "$model/exit_curve.json" \
    --max-windows "$windows" --seq-len "$seq_len" > /dev/null 2> "$out/$name.curve.err" || tail -3 "$out/$name.curve.err"
  $py -c "import sys; from loopline.train.model_card import write_model_card; write_model_card(sys.argv[1])" "$model"
fi
$py tools/heldout_per_byte.py --out "$out/$name.per_byte.json" --max-windows "$windows" --seq-len "$seq_len" \
  demo "$model" 2>&1 | tee -a "$log"

$py - "$model" "$out/$name.per_byte.json" "$out/$name.summary.json" <<'PY' 2>&1 | tee -a "$log"
import json, sys
from pathlib import Path
model, per_byte, dest = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
info = json.loads((model / "training_info.json").read_text())
cfg, corpus, m = info["train_config"], info["corpus"], info["metrics"]
losses = m["loop_losses"]
summary = {
    "step": info["step"], "train_tokens": corpus["train_tokens"], "heldout_tokens": corpus["heldout_tokens"],
    "stage1_epochs": round(cfg["stage1_steps"] * cfg["batch_size"] * cfg["seq_len"] / corpus["train_tokens"], 2),
    "sources": [(s["name"], s["version"], s["bytes"]) for s in corpus.get("sources", [])],
    "train_s": m.get("train_s"), "heldout_loop_losses": [round(x, 4) for x in losses],
    "loop4_minus_loop3": round(losses[-1] - losses[-2], 4), "falls_every_loop": all(a > b for a, b in zip(losses, losses[1:])),
    "chosen_threshold": info["early_exit_threshold"],
}
curve_file = model / "exit_curve.json"
if curve_file.is_file():
    curve = json.loads(curve_file.read_text())
    summary["engine_curve"] = [(p["threshold"], round(p["mean_depth"], 3), round(p["loss"], 4)) for p in curve["engine"]]
    summary["engine_vs_dense_max_abs_loss_diff"] = curve["max_abs_loss_diff"]
if per_byte.is_file():
    summary["stdlib_heldout_nats_per_byte"] = {r["model"]: [round(x, 4) for x in r["loop_nats_per_byte"]]
                                               for r in json.loads(per_byte.read_text())["models"]}
dest.write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
PY
pack  # again, with the curve and the card
if [ -n "${BENCH:-}" ]; then  # its real exits benchmarked as for the bundled model (docs/demo-model.md)
  timeout "${BENCH_LIMIT:-150}" $py -m loopline.entrypoints.cli bench --model "$model" --no-progress --input-len 128 \
    --output-len 256 --concurrency 32,128 --compare --variants refill,no_refill,fixed --repeats 3 \
    --output-json "$out/$name.bench.json" 2>&1 | tail -25 | tee -a "$log"
fi
