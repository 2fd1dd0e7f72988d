#!/usr/bin/env bash
# Scale-out measurements (issues #27 and #28): one engine vs data-parallel replicas vs prefill/decode pools, each
# configuration a `loopline serve` driven by `loopline bench serve` with the ShareGPT-like workload.
# Usage on the device machine, from the repository root:
#   bash tools/scaleout_gpu.sh "$OUT" [commit] [parts...]
# parts (default: one-gpu) are configurations or groups of them:
#   one        one engine (GPU 0)                       1p1d-ipc  1P1D on GPU 0, two processes, --kv-transport cuda_ipc
#   dp2        --data-parallel-size 2                   1p1d      1P1D on two GPUs, --kv-transport nccl
#   dp4        --data-parallel-size 4                   1p3d 2p2d 3p1d  P prefill + D decode workers, nccl
#   1p1d-ray   1P1D as Ray actors on two GPUs, nccl     2p2d-ray  2P2D as Ray actors on four GPUs, nccl
#              (--distributed-executor-backend ray: a local Ray started by the server; skipped without ray)
#   groups:    one-gpu = one 1p1d-ipc | x2 = one dp2 1p1d | x4 = dp4 1p3d 2p2d 3p1d
# Each configuration: start the server, wait for /health, run the rates (initial + immediate-replay phase each),
# optionally the peak-capacity search, stop the server (its whole process group), write OUT/NAME.json. At the end,
# `loopline bench compare` tables for the records present (OUT/compare-*.md) and OUT/summary.md.
# Knobs (environment):
#   SCALEOUT_PROMPTS (512)        requests per phase (#28's protocol: 512)
#   SCALEOUT_RATES (4,8)          Poisson rates, req/s
#   SCALEOUT_OUTPUT_LEN (128)     fixed output tokens (#28); "" draws ShareGPT-like output lengths
#   SCALEOUT_CAPACITY_RATES ("")  e.g. 4,8,12,16,24: also search the peak capacity (initial phase only)
#   SCALEOUT_TTFT_BOUND_MS (2000) and SCALEOUT_TTFT_STAT (p99): the capacity's bound
#   SCALEOUT_BUDGET_S (570)       a configuration whose estimated time no longer fits is skipped, not cut short
#   SCALEOUT_CKPT                 checkpoint dir ("bundled": the bundled demo model); default: a random Ouro-1.4B
#                                 checkpoint written to /tmp/ouro-1.4b-random (kept for later calls on the machine)
#   SCALEOUT_DEVICE (cuda)        cpu for the reduced CPU check (float32, gloo transports)
#   SCALEOUT_SERVE_FLAGS (--enable-prefix-caching)  flags every server gets (prefix caching: the replay shows it)
#   SCALEOUT_IPC_FLAGS (--gpu-memory-utilization 0.4)  extra flags of 1p1d-ipc (two processes share one GPU)
#   SCALEOUT_RAY_STOP (1 on cuda, 0 on cpu)  `ray stop --force` after a *-ray part (every Ray process of the host)
# Time per configuration ~ startup + sum over rates of 2 x PROMPTS / rate: 512 prompts at 4 and 8 req/s is
# 256 + 128 s = ~6.5 minutes, so with the protocol's 512 prompts run ONE configuration per device call
# (e.g. parts "dp4", then "1p3d", ...) and compare the records afterwards with `loopline bench compare`.
set -u
out=${1:?output folder}
commit=${2:-unknown}
shift 2 || shift $#
parts=${*:-one-gpu}
mkdir -p "$out"
# NVLink multicast stays off (the device tool's KINDS.md): NCCL NVLS, torch symmetric memory, NVSHMEM.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} LOOPLINE_GIT_COMMIT=$commit
py=${PYTHON:-python3}
cli="$py -m loopline.entrypoints.cli"
prompts=${SCALEOUT_PROMPTS:-512}
rates=${SCALEOUT_RATES:-4,8}
output_len=${SCALEOUT_OUTPUT_LEN-128}
cap_rates=${SCALEOUT_CAPACITY_RATES:-}
budget=${SCALEOUT_BUDGET_S:-570}
device=${SCALEOUT_DEVICE:-cuda}
serve_flags=${SCALEOUT_SERVE_FLAGS---enable-prefix-caching}
ipc_flags=${SCALEOUT_IPC_FLAGS---gpu-memory-utilization 0.4}
ray_stop=${SCALEOUT_RAY_STOP:-$([ "$device" = cpu ] && echo 0 || echo 1)}
start_s=$SECONDS
port=8021

# expand groups
expanded=""
for p in $parts; do
  case $p in
    one-gpu) expanded+=" one 1p1d-ipc" ;;
    x2) expanded+=" one dp2 1p1d" ;;
    x4) expanded+=" dp4 1p3d 2p2d 3p1d" ;;
    *) expanded+=" $p" ;;
  esac
done

if [ "$device" = cpu ]; then
  model_flags="--device cpu --dtype float32"; ipc_transport=gloo; multi_transport=gloo; ipc_flags=""
else
  model_flags="--dtype bfloat16"; ipc_transport=cuda_ipc; multi_transport=nccl
fi
ckpt=${SCALEOUT_CKPT:-/tmp/ouro-1.4b-random}
if [ "$ckpt" != bundled ]; then
  if [ ! -f "$ckpt/config.json" ]; then
    timeout 300 $py tools/write_random_checkpoint.py "$ckpt" --config ouro-1.4b > /dev/null || echo "checkpoint write failed"
    echo "wrote the random Ouro-1.4B checkpoint in $((SECONDS - start_s)) s (counts against the budget)"
  fi
  model_flags="--model $ckpt $model_flags"
fi

# configuration -> (GPUs it needs, its serve flags)
gpus_of() { case $1 in one|1p1d-ipc) echo 1;; dp2|1p1d|1p1d-ray) echo 2;; dp4|1p3d|2p2d|3p1d|2p2d-ray) echo 4;; *) echo 0;; esac; }
flags_of() {
  case $1 in
    one) echo "" ;;
    1p1d-ipc) echo "--prefill-workers 1 --decode-workers 1 --kv-transport $ipc_transport $ipc_flags" ;;
    dp2) echo "--data-parallel-size 2" ;;
    dp4) echo "--data-parallel-size 4" ;;
    1p1d) echo "--prefill-workers 1 --decode-workers 1 --kv-transport $multi_transport" ;;
    1p3d) echo "--prefill-workers 1 --decode-workers 3 --kv-transport $multi_transport" ;;
    2p2d) echo "--prefill-workers 2 --decode-workers 2 --kv-transport $multi_transport" ;;
    3p1d) echo "--prefill-workers 3 --decode-workers 1 --kv-transport $multi_transport" ;;
    1p1d-ray) echo "--prefill-workers 1 --decode-workers 1 --kv-transport $multi_transport --distributed-executor-backend ray" ;;
    2p2d-ray) echo "--prefill-workers 2 --decode-workers 2 --kv-transport $multi_transport --distributed-executor-backend ray" ;;
  esac
}
label_of() { case $1 in one) echo "one engine";; 1p1d-ipc) echo "1P1D ($ipc_transport)";; dp2) echo "DP=2";; dp4) echo "DP=4";;
  1p1d) echo "1P1D";; 1p3d) echo "1P3D";; 2p2d) echo "2P2D";; 3p1d) echo "3P1D";; 1p1d-ray) echo "1P1D (Ray)";;
  2p2d-ray) echo "2P2D (Ray)";; esac; }

serve_help=$($cli serve --help 2>&1)
estimate_s() {  # startup + every phase at every rate (+ the capacity steps, assumed all run)
  $py - "$prompts" "$rates" "$cap_rates" <<'PY'
import sys
n, rates, cap = int(sys.argv[1]), [float(r) for r in sys.argv[2].split(",") if r], [float(r) for r in sys.argv[3].split(",") if r]
print(int(90 + 1.1 * (sum(2 * n / r for r in rates) + sum(n / r for r in cap)) + 10 * len(rates)))
PY
}
need=$(estimate_s)
echo "parts:$expanded | $prompts prompts per phase at $rates req/s${cap_rates:+, capacity over $cap_rates} | ~${need} s per configuration, budget ${budget} s"

for name in $expanded; do
  ngpu=$(gpus_of "$name")
  if [ "$ngpu" = 0 ]; then echo "$name: unknown part"; continue; fi
  flags=$(flags_of "$name")
  missing=""
  for f in $flags; do
    case $f in --*) grep -q -- "$f" <<< "$serve_help" || missing+=" $f";; esac
  done
  if [ -n "$missing" ]; then
    echo "$name: not run (this checkout's loopline serve has no$missing)" | tee "$out/$name.skipped"; continue
  fi
  ray_part=0
  case $name in *-ray) ray_part=1;; esac
  if [ $ray_part = 1 ] && ! $py -c "import ray" 2> /dev/null; then
    echo "$name: not run (ray is not importable by $py: pip install 'loopline[ray]')" | tee "$out/$name.skipped"; continue
  fi
  if [ "$device" != cpu ]; then
    have=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "$have" -lt "$ngpu" ]; then echo "$name: not run (needs $ngpu GPUs, $have here)" | tee "$out/$name.skipped"; continue; fi
  fi
  left=$((budget - (SECONDS - start_s)))
  if [ "$left" -lt "$need" ]; then
    echo "$name: not run (needs ~${need} s, ${left} s of the budget left)" | tee "$out/$name.skipped"; continue
  fi
  visible=$(seq -s, 0 $((ngpu - 1)))
  port=$((port + 1))
  launched=$SECONDS
  # setsid: the server and every process it spawns (replicas, workers) share one process group, stopped as one
  CUDA_VISIBLE_DEVICES=$visible setsid $cli serve $model_flags $serve_flags $flags --port $port \
    > "$out/$name.serve.log" 2>&1 &
  server=$!
  up=0
  for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then up=1; break; fi
    kill -0 $server 2> /dev/null || break
    sleep 0.5
  done
  if [ $up = 1 ]; then
    echo "$name: server up after $((SECONDS - launched)) s (GPUs $visible)"
    cap_args=()
    [ -n "$cap_rates" ] && cap_args=(--capacity-rates "$cap_rates" --ttft-bound-ms "${SCALEOUT_TTFT_BOUND_MS:-2000}"
                                     --ttft-bound-stat "${SCALEOUT_TTFT_STAT:-p99}")
    out_args=()
    [ -n "$output_len" ] && out_args=(--output-len "$output_len")
    left=$((budget - (SECONDS - start_s)))
    timeout $((left > 60 ? left - 20 : 40)) $cli bench serve --base-url "http://127.0.0.1:$port" --dataset sharegpt-synthetic \
      "${out_args[@]}" --num-prompts "$prompts" --request-rate "$rates" --replay "${cap_args[@]}" \
      --label "$(label_of "$name")" --no-progress --output-json "$out/$name.json" > "$out/$name.txt" 2> "$out/$name.err"
    echo "$name: bench rc=$?"; cat "$out/$name.txt"; tail -3 "$out/$name.err"
  else
    echo "$name: the server did not come up"; tail -15 "$out/$name.serve.log"
  fi
  kill -TERM -- -$server 2> /dev/null
  for _ in $(seq 1 60); do kill -0 -- -$server 2> /dev/null || break; sleep 0.5; done
  kill -KILL -- -$server 2> /dev/null
  wait $server 2> /dev/null
  # the local Ray the server started (GCS, raylet, actor workers) may run in sessions of their own
  # (SCALEOUT_RAY_STOP=1, the default on GPUs: `ray stop` ends every Ray process of this host)
  [ $ray_part = 1 ] && [ "$ray_stop" = 1 ] && { $py -m ray.scripts.scripts stop --force > /dev/null 2>&1 || echo "$name: ray stop failed"; }
done

# comparison tables over the records present (records of earlier calls: copy them into OUT first, or run
# `loopline bench compare` on them where they are)
compare() {  # compare NAME BASELINE OTHERS...
  local files=() f
  for f in "${@:2}"; do [ -f "$out/$f.json" ] && files+=("$out/$f.json"); done
  if [ ${#files[@]} -ge 2 ] && [ -f "$out/$2.json" ]; then
    $cli bench compare "${files[@]}" --baseline "$(label_of "$2")" --output-md "$out/compare-$1.md" > /dev/null \
      && echo "wrote compare-$1.md"
  fi
}
compare one-gpu one 1p1d-ipc
compare x2-dp one dp2
compare x2-pd dp2 1p1d
compare x4 dp4 1p3d 2p2d 3p1d
compare x2-ray 1p1d 1p1d-ray
compare x4-ray 2p2d 2p2d-ray
{
  echo "# Scale-out run, commit $commit"
  echo
  echo "parts:$expanded; $prompts prompts per phase at $rates req/s; output ${output_len:-ShareGPT-like} tokens"
  for f in "$out"/*.skipped; do [ -f "$f" ] && echo "- $(cat "$f")"; done
  for f in "$out"/compare-*.md; do [ -f "$f" ] && { echo; echo "## $(basename "$f" .md)"; echo; cat "$f"; }; done
  for f in "$out"/*.txt; do [ -f "$f" ] && { echo; echo "## $(basename "$f" .txt)"; echo; cat "$f"; }; done
} > "$out/summary.md"
echo "wrote summary.md"
# the device returns at most 8 files: everything also goes back in one archive
tar -czf "$out/all.tgz" -C "$out" --exclude all.tgz . 2> /dev/null
