#!/usr/bin/env bash
# Data-parallel replicas on the GPUs of one host (see tools/dp_gpu_measure.py): throughput of 1..G replicas
# against one engine, the front end's routing cost (dp1), exactness, and the prefix-affinity hit rate.
# Usage on the device machine, from the repository root:   bash tools/dp_gpu_measure.sh "$OUT" [extra args]
# (on one GPU it measures single and dp1; the dpN rows appear on a host with N GPUs). CPU check:
#   bash tools/dp_gpu_measure.sh /tmp/dp-smoke --cpu-smoke
set -u
out=${1:?output folder}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpus.csv" 2>/dev/null || true
timeout 1500 python3 tools/dp_gpu_measure.py "$out" "$@" 2>&1 | grep -v Warn | tee "$out/dp_measure.log"
echo "rc=${PIPESTATUS[0]}"
