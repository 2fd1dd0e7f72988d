#!/usr/bin/env bash
# The demo model's training run on one GPU (docs/training.md), packed for the device tool's return limits.
# Usage on the device machine, from the repository root: bash tools/train_demo_gpu.sh "$OUT" [limit_s]
# Writes train.log and the exported directory as demo-ouro.tar.* (15 MB parts: one file back is at most
# 16 MiB). If the run outlasts limit_s, the last saved state (every 250 steps) is exported instead, marked
# partial in train.log.
set -u
out=${1:?output folder}
limit=${2:-500}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import sys, sysconfig, torch; print(sys.version.split()[0], sysconfig.get_paths()['stdlib'], torch.__version__,
torch.cuda.get_device_name(0))" | tee "$out/train.log"
timeout "$limit" python3 -m loopline.train pretrain --preset demo --out /tmp/demo-ouro --checkpoint-dir /tmp/demo-state \
  --save-every 250 --log-every 50 --eval-every 250 2>&1 | tee -a "$out/train.log"
if [ ! -f /tmp/demo-ouro/MODEL_CARD.md ]; then
  echo "PARTIAL: the run did not finish in ${limit}s; exporting the last saved state" | tee -a "$out/train.log"
  python3 - <<'PY' 2>&1 | tee -a "$out/train.log"
import json
from loopline.train.trainer import Trainer
t = Trainer.resume("/tmp/demo-state", device="cuda")
m = t.evaluate()
t.export("/tmp/demo-ouro", early_exit_threshold=1.0, metrics=m)
print(json.dumps({"partial_export_step": t.step, "loop_losses": m["loop_losses"]}))
PY
fi
nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$out/train.log"
(cd /tmp && tar cf - demo-ouro) | split -b 15M - "$out/demo-ouro.tar."
ls -la "$out"
