#!/usr/bin/env bash
# The demo model's training run on one GPU (docs/training.md), packed for the device tool's return limits.
# Usage on the device machine, from the repository root:
#   bash tools/train_demo_gpu.sh "$OUT" [limit_s] [name] [extra `loopline train pretrain` args, e.g. --set ...]
# Writes NAME.log and the exported directory as NAME.tar.* (15 MB parts: one file back is at most 16 MiB).
# If the run outlasts limit_s, the last saved state (every 250 steps) is exported instead, marked partial.
set -u
out=${1:?output folder}
limit=${2:-500}
name=${3:-demo-ouro}
shift 3 || shift $#
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log=$out/$name.log
python3 -c "import sys, sysconfig, torch; print(sys.version.split()[0], sysconfig.get_paths()['stdlib'], torch.__version__,
torch.cuda.get_device_name(0))" | tee "$log"
timeout "$limit" python3 -m loopline.entrypoints.cli train pretrain --preset demo --out "/tmp/$name" --checkpoint-dir "/tmp/$name.state" \
  --save-every 250 --log-every 100 --eval-every 200 "$@" 2>&1 | tee -a "$log"
if [ ! -f "/tmp/$name/MODEL_CARD.md" ]; then
  echo "PARTIAL: the run did not finish in ${limit}s; exporting the last saved state" | tee -a "$log"
  NAME=$name python3 - <<'PY' 2>&1 | tee -a "$log"
import json, os
from loopline.train.trainer import Trainer
name = os.environ["NAME"]
t = Trainer.resume(f"/tmp/{name}.state", device="cuda")
m = t.evaluate()
t.export(f"/tmp/{name}", early_exit_threshold=1.0, metrics=m)
print(json.dumps({"partial_export_step": t.step, "loop_losses": m["loop_losses"]}))
PY
fi
(cd /tmp && tar cf - "$name") | split -b 15M - "$out/$name.tar."
