#!/usr/bin/env bash
# Prefill/decode disaggregation on one GPU: one engine vs 1 prefill + 1 decode worker (two processes on
# the same GPU, KV over CUDA IPC), at fixed arrival rates with ShareGPT-like lengths, plus the transfer
# micro-benchmark (bandwidth and overlap per chunk size). ~8 minutes on an H200.
# Usage, from the repository root:   bash tools/pd_gpu_measure.sh OUTDIR
# Without a GPU it runs a reduced form on the CPU (tiny checkpoint, gloo, a few requests): the same steps.
# Env: PD_RATES (requests/s, default "4 8 16" on GPU), PD_NUM_PROMPTS (default 120 on GPU),
#      PD_PARTS (default "tests transfer serve": which of the three steps run; one device call may not fit all).
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
parts=" ${PD_PARTS:-tests transfer serve} "
if $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  gpu=1; rates=${PD_RATES:-"4 8 16"}; n=${PD_NUM_PROMPTS:-120}; transport=cuda_ipc
  ckpt=${PD_CHECKPOINT:-/tmp/ouro-1.4b-random}
  [[ -f "$ckpt/config.json" || $parts != *" serve "* ]] || $py tools/write_random_checkpoint.py "$ckpt" --config ouro-1.4b > /dev/null
  transfer=(--transport cuda_ipc --out "$out/transfer.json")
else
  gpu=0; rates=${PD_RATES:-"4"}; n=${PD_NUM_PROMPTS:-6}; transport=gloo
  ckpt=$out/tiny-checkpoint
  [ -f "$ckpt/config.json" ] || $py -c "from loopline.models.tiny import make_tiny_checkpoint as m; m('$ckpt', seed=0)" > /dev/null
  transfer=(--transport gloo --chunk-tokens 16,64 --layers 2 --repeats 3 --out "$out/transfer.json")
fi
echo "gpu=$gpu checkpoint=$ckpt rates=[$rates] prompts=$n transport=$transport"
{ git rev-parse HEAD 2>/dev/null; $py -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"; } > "$out/env.txt"

# 0. correctness first: the PD tests (on a GPU also the CUDA IPC transport and 1P1D over it)
if [[ $parts == *" tests "* ]]; then
timeout 240 $py -m pytest -q -m "gpu or not slow" tests/distributed > "$out/pd_tests.log" 2>&1
echo "pd tests rc=$? $(tail -1 "$out/pd_tests.log")"; grep -hE "^(FAILED|ERROR)" "$out/pd_tests.log" | head -5
fi

# 1. transfer micro-benchmark (two processes, the transport the workers use)
[[ $parts == *" transfer "* ]] && timeout 150 $py tools/pd_transfer_bench.py "${transfer[@]}" 2>&1 | grep -v Warn | tee "$out/transfer.txt"

# 2. serving: one engine vs 1P1D (tools/scaleout_gpu.sh's "one-gpu" group: the same server command with and
# without --prefill-workers 1 --decode-workers 1, ShareGPT-like lengths, initial + replay phases, one table)
if [[ $parts != *" serve "* ]]; then
  :
elif [ "$gpu" = 1 ]; then
  SCALEOUT_CKPT=$ckpt SCALEOUT_PROMPTS=$n SCALEOUT_RATES=${rates// /,} PYTHON=$py bash tools/scaleout_gpu.sh "$out" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" one-gpu
else
  SCALEOUT_DEVICE=cpu SCALEOUT_CKPT=$ckpt SCALEOUT_PROMPTS=$n SCALEOUT_RATES=${rates// /,} \
    PYTHON=$py bash tools/scaleout_gpu.sh "$out" unknown one-gpu
fi
