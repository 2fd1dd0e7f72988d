#!/usr/bin/env bash
# Prefill/decode disaggregation on one GPU: one engine vs 1 prefill + 1 decode worker (two processes on
# the same GPU, KV over CUDA IPC), at fixed arrival rates with ShareGPT-like lengths, plus the transfer
# micro-benchmark (bandwidth and overlap per chunk size). ~8 minutes on an H200.
# Usage, from the repository root:   bash tools/pd_gpu_measure.sh OUTDIR
# Without a GPU it runs a reduced form on the CPU (tiny checkpoint, gloo, a few requests): the same steps.
# Env: PD_RATES (requests/s, default "4 8 16" on GPU), PD_NUM_PROMPTS (default 120 on GPU), PD_PORT.
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
port=${PD_PORT:-8931}
if $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  gpu=1; rates=${PD_RATES:-"4 8 16"}; n=${PD_NUM_PROMPTS:-120}; transport=cuda_ipc
  ckpt=${PD_CHECKPOINT:-/tmp/ouro-1.4b-random}
  [ -f "$ckpt/config.json" ] || $py tools/write_random_checkpoint.py "$ckpt" --config ouro-1.4b > /dev/null
  engine=(--dtype bfloat16 --max-model-len 4096)
  transfer=(--transport cuda_ipc --out "$out/transfer.json")
else
  gpu=0; rates=${PD_RATES:-"4"}; n=${PD_NUM_PROMPTS:-6}; transport=gloo
  ckpt=$out/tiny-checkpoint
  [ -f "$ckpt/config.json" ] || $py -c "from loopline.models.tiny import make_tiny_checkpoint as m; m('$ckpt', seed=0)" > /dev/null
  engine=(--device cpu --dtype float32 --max-model-len 1024 --max-num-seqs 8)
  transfer=(--transport gloo --chunk-tokens 16,64 --layers 2 --repeats 3 --out "$out/transfer.json")
fi
echo "gpu=$gpu checkpoint=$ckpt rates=[$rates] prompts=$n transport=$transport"
{ git rev-parse HEAD 2>/dev/null; $py -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"; } > "$out/env.txt"

# 0. correctness first: the PD tests (on a GPU also the CUDA IPC transport and 1P1D over it)
timeout 240 $py -m pytest -q -m "gpu or not slow" tests/distributed > "$out/pd_tests.log" 2>&1
echo "pd tests rc=$? $(tail -1 "$out/pd_tests.log")"; grep -hE "^(FAILED|ERROR)" "$out/pd_tests.log" | head -5

# 1. transfer micro-benchmark (two processes, the transport the workers use)
timeout 150 $py tools/pd_transfer_bench.py "${transfer[@]}" 2>&1 | grep -v Warn | tee "$out/transfer.txt"

# 2. serving: the same server command, with and without --prefill-workers 1 --decode-workers 1
# The bench's ShareGPT-like synthetic workload (branch hbench): fall back to fixed lengths if it is absent.
if $py -m loopline.entrypoints.cli bench serve --help 2>/dev/null | grep -q -- "--dataset"; then
  workload=(--dataset sharegpt-synthetic)
else
  workload=(--input-len 256 --output-len 192); echo "note: bench serve has no --dataset here; fixed 256/192 lengths"
fi
serve_and_bench() {  # name, extra serve flags...
  local name=$1; shift
  $py -m loopline.entrypoints.cli serve "$ckpt" --port "$port" "${engine[@]}" "$@" > "$out/server-$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 240); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
  if ! curl -sf "localhost:$port/health" > /dev/null; then echo "$name: server did not start"; tail -5 "$out/server-$name.log"; kill "$pid"; wait "$pid"; return; fi
  for rate in $rates; do
    timeout 200 $py -m loopline.entrypoints.cli bench serve --base-url "http://localhost:$port" "${workload[@]}" \
      --request-rate "$rate" --num-prompts "$n" --no-progress --json > "$out/$name-rate$rate.json" 2> "$out/$name-rate$rate.err" \
      || { echo "$name rate $rate failed"; tail -3 "$out/$name-rate$rate.err"; }
  done
  curl -s "localhost:$port/metrics" > "$out/metrics-$name.txt"
  kill -INT "$pid"; wait "$pid"
}
serve_and_bench single
serve_and_bench pd1p1d --prefill-workers 1 --decode-workers 1 --kv-transport "$transport"

# 3. the table: TTFT / TPOT / ITL / E2E (ms, p50 and p99) and output tok/s per rate, and PD's ratio to one engine
$py - "$out" $rates <<'EOF'
import json, sys, pathlib
out, rates = pathlib.Path(sys.argv[1]), sys.argv[2:]
def load(name, rate):
    try:
        text = (out / f"{name}-rate{rate}.json").read_text()
        record = json.loads(text[text.index("{"):])
        return record.get("results", record)
    except (OSError, ValueError):
        return None
lines = ["| rate (req/s) | layout | done | out tok/s | TTFT p50 / p99 | TPOT p50 / p99 | ITL p50 / p99 | E2E p50 / p99 |",
         "|---|---|---|---|---|---|---|---|"]
summary = {}
for rate in rates:
    for name in ("single", "pd1p1d"):
        r = load(name, rate)
        if r is None:
            lines.append(f"| {rate} | {name} | failed | | | | | |"); continue
        f = lambda k: f"{r[k]['p50']:.1f} / {r[k]['p99']:.1f}" if r[k]["p50"] is not None else "-"
        lines.append(f"| {rate} | {name} | {r['completed']}/{r['completed'] + r['failed']} | {r['output_throughput']:.1f} | "
                     f"{f('ttft_ms')} | {f('tpot_ms')} | {f('itl_ms')} | {f('e2el_ms')} |")
        summary.setdefault(rate, {})[name] = r
    pair = summary.get(rate, {})
    if len(pair) == 2:
        s, p = pair["single"], pair["pd1p1d"]
        lines.append(f"| {rate} | pd/single | | {p['output_throughput'] / s['output_throughput']:.3f}x | "
                     + " | ".join(f"{p[k]['p50'] / s[k]['p50']:.2f}x" if s[k]["p50"] else "-"
                                  for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")) + " |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
