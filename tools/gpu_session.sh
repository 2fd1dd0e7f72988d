#!/usr/bin/env bash
# One device call that checks and measures everything GPU-side (H200, ~8 minutes).
# Usage on the device machine, from the repository root:
#   bash tools/gpu_session.sh "$OUT" [commit] [parts...]
# parts (default: tests kernels profile bench): tests gpuall slow diag kernels sweep gemm swiglu gemv profile prefill mixed
# wide splits bench headline sync overlap partition hf adaptive phases pd demo serve newpaths huginn spec_replay spec_k
# headline_fp8 lookahead trace_cost flashinfer fp8_one_row fp8_rows rows_breakdown pipe_profile skinny_routes
# splits_rows split_sums last_merges fp8_layout fp8_cuda_core cuda_core_steps cuda_core_e2e cuda_core_splits
# register_caps resources cuda_core_mixed fp8_launches newkernels full_waves full_waves_e2e host_wait
# fp8_full_waves cold_start jit_misses demo_profile demo_grid headline_sampled sampler_cost
# sampling_tests headline_filters filter_cut_cost filter_cut_ab headline_ab; LOOPLINE_BENCH_C
# (default "1 32 128") picks bench's concurrencies. "headline" is the README's command exactly as a user runs it (no tuning flags).
# Writes logs and JSON records under the output folder (device tool: $OUT).
set -u
out=${1:?output folder}
commit=${2:-unknown}
shift 2 || shift $#
parts=${*:-tests kernels profile bench}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} LOOPLINE_GIT_COMMIT=$commit
# The KV pool is sized from free memory (gpu_memory_utilization 0.9): ~120 GiB holds 128 requests of 1,152
# tokens at 4 planes. Runs in one process with the transformers baseline cap it (`--kv-cache-memory-gb`).
bench() { timeout "$1" python3 -m loopline.entrypoints.cli bench --config ouro-1.4b --dtype bfloat16 --no-progress "${@:2}"; }
# the README's headline command (1,024 in / 128 out) with the flags given
readme_bench() { bench "$1" --input-len 1024 --output-len 128 "${@:2}"; }
has() { [[ " $parts " == *" $1 "* ]]; }
# a copy of this tree (loopline/, tools/) at $1 with the files of folder $2 laid over it at their paths: the "old"
# side of the A/B parts
tree_with() { rm -rf "$1" && mkdir -p "$1" && cp -r loopline tools "$1"/ && cp -r "$2"/. "$1"/; }
# the packages the image lacks (server stack, xgrammar, openai, license-expression and boolean.py, which the
# training corpus's license check reads) from a carried .whl/ (tools/gpu_test_wheels.sh)
wheels() {
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_site .whl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/gpu_site
  else
    echo "no .whl/ carried (bash tools/gpu_test_wheels.sh): $1"
  fi
}

if has tests; then  # correctness on the GPU: every kernel test (bf16 cases too), then the GPU engine tests
  timeout 280 python3 -m pytest -q tests/attention tests/kernels > "$out/kernel_tests.log" 2>&1
  echo "kernel tests rc=$? $(tail -1 "$out/kernel_tests.log")"
  # (-n 0: xdist's workers would share the one GPU, and the first engine's KV pool leaves the second no memory)
  timeout 300 python3 -m pytest -q -n 0 -m gpu tests/worker tests/spec tests/entrypoints/test_core_client.py > "$out/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? $(tail -1 "$out/gpu_tests.log")"
  grep -hE "^(FAILED|ERROR)" "$out/kernel_tests.log" "$out/gpu_tests.log" | head -10
fi
if has gpuall; then  # every gpu-marked test in one process (xdist's workers would share the one GPU), one line per
  # test as it ends, so a run cut by its limit still tells what passed and what failed; the packages the image
  # lacks (server stack, xgrammar, openai, license-expression) from a carried .whl/ (tools/gpu_test_wheels.sh)
  wheels "tests that import the server stack, xgrammar or openai fail"
  # LOOPLINE_GPUALL_PATHS: a part of the suite (on a fresh machine, with Triton's cache cold, all of it took more
  # than one call under two workers: split it, e.g. "tests/structured tests/train tests/spec tests/integrations
  # tests/rl tests/distributed tests/entrypoints tests/test_new_paths_gpu.py tests/test_fp8_kv_attention.py", then
  # "tests/worker tests/attention")
  # shellcheck disable=SC2086
  timeout "${LOOPLINE_GPUALL_S:-540}" python3 -m pytest -v -n 0 -p no:randomly -m gpu -rfE --continue-on-collection-errors \
    ${LOOPLINE_GPUALL_PATHS:-tests} > "$out/gpuall.log" 2>&1
  echo "all gpu tests rc=$? $(tail -1 "$out/gpuall.log")"; grep -hE "(FAILED|ERROR)" "$out/gpuall.log" | head -20
fi
if has slow; then  # the tests the CPU run leaves out (Triton-interpreter length there, seconds here)
  timeout 200 python3 -m pytest -q -m slow tests/worker tests/kernels tests/attention > "$out/slow_tests.log" 2>&1
  echo "slow tests rc=$? $(tail -1 "$out/slow_tests.log")"; grep -hE "^(FAILED|ERROR)" "$out/slow_tests.log" | head -5
fi
if has headline; then  # README's headline table: the defaults a user gets, no tuning flags
  # (LOOPLINE_HEADLINE_C: the concurrencies, default 1,32,128)
  timeout 420 python3 -m loopline.entrypoints.cli bench --config ouro-1.4b --dtype bfloat16 --input-len 1024 \
    --output-len 128 --concurrency "${LOOPLINE_HEADLINE_C:-1,32,128}" --no-progress --output-json "$out/headline.json" \
    2> "$out/headline.err" | tail -8 || tail -3 "$out/headline.err"
fi
if has headline_fp8; then  # the same with the one flag a user adds for FP8 KV
  timeout 420 python3 -m loopline.entrypoints.cli bench --config ouro-1.4b --dtype bfloat16 --input-len 1024 \
    --output-len 128 --concurrency "${LOOPLINE_HEADLINE_C:-1,32,128}" --kv-cache-dtype fp8 --no-progress \
    --output-json "$out/headline_fp8.json" 2> "$out/headline_fp8.err" | tail -8 || tail -3 "$out/headline_fp8.err"
fi
if has sampling_tests; then  # the sampler's GPU tests: the Triton draw, top-k by selection, the engine's start-up
  # warm-up of every token-choice kernel (session 36's paths; the warm-up test has not run on a GPU yet)
  timeout 200 python3 -m pytest -q -n 0 -p no:randomly tests/kernels/test_sampling_kernels.py tests/worker/test_sampler.py \
    tests/worker/test_gpu_engine.py -k "sampl or startup or cuda or cut" > "$out/sampling_tests.log" 2>&1
  echo "sampling tests rc=$? $(tail -1 "$out/sampling_tests.log")"; grep -hE "^(FAILED|ERROR)" "$out/sampling_tests.log" | head
fi
if has sampler_cost; then  # one sampler call on CUDA, greedy and T = 1 (the Triton draw), Ouro's vocabulary
  for p in '{"temperature": 0.0}' '{"temperature": 1.0}' '{"temperature": 1.0, "top_p": 0.9}' \
           '{"temperature": 1.0, "top_k": 20}' '{"temperature": 1.0, "top_k": 20, "select": false}'; do
    timeout 60 python3 tools/sampler_cost.py --device cuda --rows 1,8,32,128 --vocab 49152 --params "$p"
  done | tee "$out/sampler_cost.txt"
fi
if has headline_sampled; then  # the README command at T = 1 (a chat or RL user's requests; each seeded by its index),
  # then greedy again in the same call: the sampled draw's cost end to end
  for t in 1.0 0; do
    timeout 300 python3 -m loopline.entrypoints.cli bench --config ouro-1.4b --dtype bfloat16 --input-len 1024 \
      --output-len 128 --concurrency "${LOOPLINE_HEADLINE_C:-1,32,128}" --temperature $t --no-progress \
      --output-json "$out/headline_t$t.json" 2> "$out/headline_sampled.err" | tail -8 || tail -3 "$out/headline_sampled.err"
  done
fi
if has filter_cut_cost; then  # the filters' cuts against the torch filters per call (and the cut's launch shapes)
  timeout 150 python3 tools/filter_cut_cost.py --rows "${LOOPLINE_ROWS_LIST:-1,8,32,128}" --sweep 2>&1 \
    | tee "$out/filter_cut_cost.txt"
fi
if has filter_cut_ab; then  # this tree's filter_cut against an earlier one per call, new / old / new (LOOPLINE_CUT_OLD: a
  # carried copy of the earlier loopline/kernels/sampling.py, e.g. `git show 0eb43f6:loopline/kernels/sampling.py`)
  old=/tmp/cut_old && rm -rf /tmp/cut_files && mkdir -p /tmp/cut_files/loopline/kernels \
    && cp "${LOOPLINE_CUT_OLD:?LOOPLINE_CUT_OLD: the earlier sampling.py}" /tmp/cut_files/loopline/kernels/sampling.py \
    && tree_with $old /tmp/cut_files
  for v in new old new; do
    d=$PWD; [ $v = new ] || d=$old
    echo "== $v"; (cd $d && PYTHONPATH=$d timeout 60 python3 tools/filter_cut_cost.py --rows "${LOOPLINE_ROWS_LIST:-1,8,32,128}") \
      2>&1 | grep -v Warn
  done | tee "$out/filter_cut_ab.txt"
fi
if has headline_ab; then  # the README command, this tree against an earlier one, new / old / new in one call
  # (LOOPLINE_AB_OLD: a carried folder of earlier files at their repository paths, laid over a copy of this tree,
  # e.g. `git show 861f7f3:loopline/worker/loop_stack.py > .ab/old/loopline/worker/loop_stack.py`;
  # LOOPLINE_AB_FLAGS: more bench flags, e.g. "--temperature 1.0 --top-p 0.7")
  old=/tmp/ab_old && tree_with $old "${LOOPLINE_AB_OLD:?LOOPLINE_AB_OLD: a folder of earlier files}"
  i=0
  for v in new old new; do
    i=$((i + 1)); d=$PWD; [ $v = new ] || d=$old
    echo "== $v"
    tag=$commit; [ $v = new ] || tag="$commit with earlier files (LOOPLINE_AB_OLD)"
    # shellcheck disable=SC2086
    (cd $d && PYTHONPATH=$d LOOPLINE_GIT_COMMIT="$tag" readme_bench 200 --concurrency "${LOOPLINE_HEADLINE_C:-1,2,8}" \
      ${LOOPLINE_AB_FLAGS:-} --output-json "$out/headline_ab_${i}_$v.json" 2> "$out/headline_ab.err" \
      | grep -E "^\| loopline|^concurrency") || tail -3 "$out/headline_ab.err"
  done
fi
if has headline_filters; then  # the README command at T = 1 plain, with Ouro's recommended top_p 0.7, with top_k 20
  # (the filters run in torch outside the step: sort, softmax, cumsum; is their host time hidden behind the step?)
  i=0
  for f in "" "--top-p 0.7" "--top-k 20" ""; do
    i=$((i + 1)); echo "== run $i: T = 1 $f"
    # shellcheck disable=SC2086
    readme_bench 200 --concurrency "${LOOPLINE_HEADLINE_C:-1,32,128}" --temperature 1.0 $f \
      --output-json "$out/headline_filters_$i.json" 2> "$out/headline_filters.err" | grep -E "^\| loopline|^concurrency" \
      || tail -3 "$out/headline_filters.err"
  done
fi
if has cuda_core_e2e; then  # the README command with --kv-cache-dtype fp8 under the CUDA-core decode launch
  # (LOOPLINE_CC_LAUNCH, default 16,2,1,0,1; the LOOPLINE_DECODE_LAUNCH timing hook) between two default runs
  i=0
  for l in "" "${LOOPLINE_CC_LAUNCH:-16,2,1,0,1}" ""; do
    i=$((i + 1)); echo "== run $i, decode launch ${l:-default}"
    LOOPLINE_DECODE_LAUNCH=$l timeout 300 python3 -m loopline.entrypoints.cli bench --config ouro-1.4b --dtype bfloat16 \
      --input-len 1024 --output-len 128 --concurrency "${LOOPLINE_HEADLINE_C:-32,128}" --kv-cache-dtype fp8 --no-progress \
      --output-json "$out/cuda_core_e2e_$i.json" 2> "$out/cuda_core_e2e.err" | tail -4 || tail -3 "$out/cuda_core_e2e.err"
  done
fi
if has diag; then  # the GPU engine tests alone, with cuBLAS's own log
  CUBLAS_LOGINFO_DBG=1 CUBLAS_LOGDEST_DBG="$out/cublas.log" timeout 150 python3 -m pytest -q -x -m gpu \
    tests/worker/test_gpu_engine.py > "$out/diag.log" 2>&1
  echo "diag rc=$? $(tail -1 "$out/diag.log")"; grep -iE "error|fail" "$out/cublas.log" 2>/dev/null | head -5
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv
  grep -E "^E .*(Error|bucket)" "$out/diag.log" | head -5
fi
if has kernels; then  # kernel micro-benchmarks
  timeout 120 python3 -m loopline.attention.bench_attention 2>&1 | grep -v Warn | tee "$out/kernels.txt"
fi
if has sweep; then  # decode attention launch parameters and kernels, in CUDA graphs
  timeout 300 python3 -c "from loopline.attention.bench_attention import sweep_decode as d, sweep_prefill as p
d(128 ** -0.5); p(128 ** -0.5)" \
    2>&1 | grep -v Warn | tee "$out/sweep.txt"
fi
if has gemm; then  # projection GEMMs at decode row counts: cuBLAS, cuBLASLt, transposed weights, Triton split-K
  timeout 300 python3 tools/bench_gemm.py --sweep 2>&1 | grep -v Warn | tee "$out/gemm.txt"
fi
if has swiglu; then  # the MLP tail at decode row counts: down_proj by cuBLAS vs the skinny split-K kernel
  timeout 120 python3 tools/bench_gemm.py --swiglu 2>&1 | grep -v Warn | tee "$out/swiglu.txt"
fi
if has gemv; then  # one-row products: cuBLAS vs the GEMV kernel's launches, and its fused prologues
  timeout 360 python3 tools/bench_gemm.py --gemv 2>&1 | grep -v Warn | tee "$out/gemv.txt"
fi
if has prefill; then  # one 8 x 1024-token prefill loop per kernel
  timeout 90 python3 tools/profile_step.py --prefill --rows 8 --kernels 2>&1 | grep -v Warn | head -18 | tee "$out/prefill.txt"
fi
if has profile; then  # where a step's time goes
  { timeout 90 python3 tools/profile_step.py --rows 1 --kernels 2>&1 | grep -v Warn | head -32
    timeout 60 python3 tools/profile_step.py --rows 1 --async-scheduling 2>&1 | grep -v Warn | head -1
    timeout 60 python3 tools/profile_step.py --rows 64 --async-scheduling 2>&1 | grep -v Warn | head -1
    timeout 90 python3 tools/profile_step.py --prefill --rows 8 --kernels 2>&1 | grep -v Warn | head -18
  } > "$out/profile.txt"
  cat "$out/profile.txt"
fi
if has mixed; then  # a C = 128 prefill step: 120 rows decoding while 8 prompts of 1,024 tokens prefill
  timeout 150 python3 tools/profile_step.py --rows 120 --mixed-prompts 8 --kernels --async-scheduling 2>&1 \
    | grep -v Warn | head -20 | tee "$out/mixed.txt"
fi
if has wide; then  # decode steps of 32 and 128 rows per kernel; one row with a small and a full-size KV pool
  { timeout 90 python3 tools/profile_step.py --rows 32 --kernels --async-scheduling 2>&1 | grep -v Warn | head -22
    timeout 120 python3 tools/profile_step.py --rows 128 --kernels --async-scheduling 2>&1 | grep -v Warn | head -22
    for gb in 8 110; do timeout 60 python3 tools/profile_step.py --rows 1 --async-scheduling --kv-gb $gb 2>&1 | grep -v Warn | head -1; done
  } > "$out/wide.txt"
  cat "$out/wide.txt"
fi
if has splits; then  # one-row decode steps under other split-KV rules (MAX splits, MIN keys each), graph replay
  for r in 16,64 8,64 4,64 32,32 8,128; do
    echo "splits $r: $(timeout 60 python3 tools/profile_step.py --rows 1 --attn-splits $r 2>&1 | grep '^graph replay')"
  done | tee "$out/splits.txt"
fi
if has bench; then  # full depth, 1024 in / 128 out, async scheduling (sync too with "sync")
  modes=async; has sync && modes="sync async"
  for c in ${LOOPLINE_BENCH_C:-1 32 128}; do
    for mode in $modes; do
      flag=""; [ $mode = async ] && flag=--async-scheduling
      bench 150 --input-len 1024 --output-len 128 --concurrency $c --max-num-batched-tokens 8192 $flag \
            --output-json "$out/fixed-$mode-c$c.json" > /dev/null 2> "$out/fixed-$mode-c$c.err" || tail -3 "$out/fixed-$mode-c$c.err"
    done
  done
  python3 - "$out" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/fixed*.json")):
    m = json.load(open(f))["results"][0]["variants"][0]["median"]
    print(f.rsplit("/", 1)[1], round(m["output_throughput"], 1), "tok/s, TTFT p50", round(m["ttft_ms"]["p50"], 1),
          "ms, TPOT p50", round(m["tpot_ms"]["p50"], 2), "ms, steps", m["steps"], "rows/step", round(m["rows_per_step"], 1),
          "step ms", round(m["mean_step_time_ms"], 2), "prefill steps", m.get("prefill_steps"),
          "prefill s", round(m.get("prefill_step_time_s") or 0, 2), "decode step ms", round(m.get("decode_step_time_ms") or 0, 2))
PY
fi
if has overlap; then  # sync vs async vs eager in one process, interleaved (ratios are the point)
  bench 300 --input-len 1024 --output-len 128 --concurrency 1,32 --compare --variants sync,async,eager --repeats 2 \
        --max-num-batched-tokens 8192 --kv-cache-memory-gb 40 --output-json "$out/overlap.json" 2> "$out/overlap.err" | tail -12
fi
if has partition; then  # how much of HBM N SMs reach (a streaming read, the decode attention) and the split chip
  { timeout 90 python3 tools/overlap_probe.py --reps 5 --stream-read 32,48,66,132 2>&1 | grep -v Warn
    timeout 90 python3 tools/overlap_probe.py --pair prefill --partition 32,48,66 2>&1 | grep -v Warn
  } | tee "$out/partition.txt"
fi
if has hf; then  # against transformers generate() on the same weights, batch 1 / 8 / 32
  bench 420 --input-len 1024 --output-len 128 --concurrency 1,8,32 --variants fixed,hf --compare --repeats 1 \
        --async-scheduling --max-num-batched-tokens 8192 --kv-cache-memory-gb 40 --output-json "$out/hf.json" 2> "$out/hf.err" | tail -12
fi
if has adaptive; then  # continuous depth batching vs cohort vs full depth (synthetic mean 2.5 loops), defaults
  bench 420 --input-len 128 --output-len 512 --concurrency 128 --depth-dist mean2.5 --compare \
        --variants refill,no_refill,fixed --repeats 2 --output-json "$out/adaptive.json" 2> "$out/adaptive.err" | tail -6
fi
if has phases; then  # where refill's and full depth's steps go: host phases, device time per kind of step (#22)
  timeout 300 python3 tools/step_phases.py --config ouro-1.4b --dtype bfloat16 --input-len 128 --output-len 512 \
    --concurrency 128 --depth-dist mean2.5 --variants refill,fixed --repeats 1 --no-progress > "$out/phases.txt" 2>&1
  echo "phases rc=$?"; grep -E "^\[|device,|wait for" "$out/phases.txt"
fi
if has pd; then  # prefill/decode on one GPU: the PD tests (CUDA IPC, in-place page writes), then the transfer benchmark
  timeout 150 python3 -m pytest -q -m gpu tests/worker/test_page_writes.py tests/distributed > "$out/pd_gpu_tests.log" 2>&1
  echo "pd gpu tests rc=$? $(tail -1 "$out/pd_gpu_tests.log")"; grep -hE "^(FAILED|ERROR)" "$out/pd_gpu_tests.log" | head -5
  PD_PARTS="tests transfer" timeout 360 bash tools/pd_gpu_measure.sh "$out/pd" | tail -8
fi
if has demo; then  # the bundled demo model: the engine-measured exit curve on the held-out split, its real exits benchmarked
  # 160 windows of 512 tokens, as the card's CPU curve: the whole held-out split of the bundled model
  # (1.6M tokens with the packages) ran past 240 s without output
  timeout 240 python3 -m loopline.entrypoints.cli train curve --max-windows 160 --out "$out/demo_curve.json" > /dev/null \
    2> "$out/demo_curve.err" \
    || tail -3 "$out/demo_curve.err"
  python3 -c "import json; r = json.load(open('$out/demo_curve.json')); print('curve', r['python_version'], r['engine_s'], 's',
r['max_abs_loss_diff'], r['depths_equal'], [(p['threshold'], round(p['mean_depth'], 3), round(p['loss'], 4)) for p in r['engine']])"
  timeout 240 python3 -m loopline.entrypoints.cli bench --model loopline/models/demo_ouro --no-progress --input-len 128 \
    --output-len 256 --concurrency 32,128 \
    --compare --variants refill,no_refill,fixed --repeats 3 --output-json "$out/demo_adaptive.json" 2> "$out/demo_adaptive.err" \
    | tail -8
fi
if has serve; then  # loopline serve vs the offline engine, same random Ouro-1.4B checkpoint on disk, C = 32 and 128
  ckpt=/tmp/ouro-1.4b-random
  timeout 300 python3 tools/write_random_checkpoint.py "$ckpt" --config ouro-1.4b || echo "checkpoint write failed"
  # one offline process for both concurrencies (one model load), then the server on the same file
  timeout 200 python3 -m loopline.entrypoints.cli bench --model "$ckpt" --dtype bfloat16 --no-progress --input-len 1024 \
    --output-len 128 --concurrency 32,128 --max-num-seqs 128 --output-json "$out/offline.json" > /dev/null \
    2> "$out/offline.err" || tail -3 "$out/offline.err"
  python3 -m loopline.entrypoints.cli serve --model "$ckpt" --dtype bfloat16 --max-num-seqs 128 --port 8011 \
    > "$out/serve.log" 2>&1 &
  server=$!
  for _ in $(seq 1 240); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 0.5; done
  for c in ${LOOPLINE_SERVE_C:-32 128}; do
    timeout 200 python3 -m loopline.entrypoints.cli bench serve --base-url http://127.0.0.1:8011 --input-len 1024 \
      --output-len 128 --num-prompts $((2 * c)) --concurrency $c --json > "$out/serve-c$c.json" 2> "$out/serve-c$c.err" \
      || tail -3 "$out/serve-c$c.err"
  done
  kill $server; wait $server 2>/dev/null
  python3 - "$out" <<'PY'
import json, sys
for c in (32, 128):
    try:
        off = next(r for r in json.load(open(f"{sys.argv[1]}/offline.json"))["results"]
                   if r["concurrency"] == c)["variants"][0]["median"]
        srv = json.load(open(f"{sys.argv[1]}/serve-c{c}.json"))["results"][0]  # one rate, one phase
    except (OSError, ValueError, KeyError, StopIteration) as e:
        print(f"C={c}: missing ({e})"); continue
    s, o = srv["output_throughput"], off["output_throughput"]
    print(f"C={c}: offline {o:.1f} tok/s (TTFT p50 {off['ttft_ms']['p50']:.0f} ms, TPOT p50 {off['tpot_ms']['p50']:.2f}), "
          f"serve {s:.1f} tok/s (TTFT p50 {srv['ttft_ms']['p50']:.0f} ms, TPOT p50 {srv['tpot_ms']['p50']:.2f}), "
          f"serve/offline {s / o:.3f}, failed {srv['failed']}")
PY
fi
if has newpaths; then  # GPU tests of the newest engine paths: Huginn, lookahead and exit traces in graphs, speculation graphs
  timeout 150 python3 -m pytest -q -x -m gpu tests/test_new_paths_gpu.py tests/spec/test_graphs.py \
    tests/spec/test_pipeline_graphs.py > "$out/newpaths.log" 2>&1
  echo "new-path gpu tests rc=$? $(tail -1 "$out/newpaths.log")"; grep -hE "^(FAILED|ERROR)" "$out/newpaths.log" | head -5
fi
if has huginn; then  # issue #46: Huginn-0125 shapes, fixed 32 and 8 iterations, then refill / no_refill / fixed at mean 8
  h="--config huginn-3.5b --input-len 256 --output-len 64 --concurrency 1,32,128"
  timeout 140 python3 -m loopline.entrypoints.cli bench $h --dtype bfloat16 --no-progress --max-num-loops 32 \
    --output-json "$out/huginn32.json" 2>&1 | tail -6
  timeout 80 python3 -m loopline.entrypoints.cli bench $h --dtype bfloat16 --no-progress --max-num-loops 8 \
    --output-json "$out/huginn8.json" 2>&1 | tail -6
  timeout 160 python3 -m loopline.entrypoints.cli bench $h --dtype bfloat16 --no-progress --max-num-loops 32 \
    --compare --depth-dist mean8 --repeats 1 --output-json "$out/huginn_compare.json" 2>&1 | tail -14
fi
if has flashinfer; then  # issue #40: FlashInfer installed from the carried .fi/, its GPU tests, kernels and engine vs Triton
  bash tools/flashinfer_install.sh install > "$out/fi_install.log" 2>&1; echo "flashinfer install rc=$? $(tail -1 "$out/fi_install.log")"
  # shellcheck disable=SC1090
  source <(bash tools/flashinfer_install.sh env)
  timeout 420 bash tools/flashinfer_install.sh check 2>&1 | grep -v Warn | tee "$out/fi_check.txt" | tail -4
  timeout 240 python3 -m pytest -q tests/attention/test_flashinfer_gpu.py > "$out/fi_tests.log" 2>&1
  echo "flashinfer gpu tests rc=$? $(tail -1 "$out/fi_tests.log")"; grep -hE "^(FAILED|ERROR)|Error" "$out/fi_tests.log" | head -8
  timeout 120 python3 -m loopline.attention.bench_attention --compare flashinfer --rows 1,8,32,128 --ctx 1024 2>&1 \
    | grep -v Warn | tee "$out/fi_kernels.txt" | tail -12
  bench 300 --input-len 1024 --output-len 128 --concurrency ${LOOPLINE_FI_C:-1,32,128} --compare --variants triton,flashinfer \
    --repeats 1 --kv-cache-memory-gb 40 --output-json "$out/fi_engine.json" 2> "$out/fi_engine.err" | tail -12 \
    || tail -5 "$out/fi_engine.err"
fi
if has spec_replay; then  # issue #41: both schemes at the demo model's acceptance, replayed on Ouro-1.4B shapes
  # (LOOPLINE_SPEC: the first --spec, default 3,1; 2,1 is speculative_config's default K. The pipeline's re-drafting
  # is replayed at the demo model's loop-change rates, tools/spec_acceptance.py --loop-changes; LOOPLINE_SPEC_CHANGES=
  # "" replays verdicts at the exit only, and turns re-drafting off)
  changes=${LOOPLINE_SPEC_CHANGES-0.069,0.029,0.016}
  # shellcheck disable=SC2086
  timeout "${LOOPLINE_SPEC_S:-300}" python3 tools/spec_speed.py --config ouro-1.4b --spec ${LOOPLINE_SPEC:-3,1} ${LOOPLINE_SPEC_EXTRA:-} --scheme ${LOOPLINE_SPEC_SCHEMES:-draft_verify,pipeline,auto} \
    --concurrency "${LOOPLINE_SPEC_C:-1,8,32,128}" --replay-acceptance 0.89,0.71,0.68 ${changes:+--replay-changes $changes} \
    --json "$out/spec_replay.json" 2>&1 | grep -v Warn | tail -12
fi
if has spec_k; then  # issue #41: a verify step's cost for K = 1..6 (every draft accepted, pinned), the model refitted
  timeout 420 python3 tools/spec_speed.py --config ouro-1.4b --replay-acceptance 1.0 --spec 1,1,pinned --spec 2,1,pinned \
    --spec 3,1,pinned --spec 4,1,pinned --spec 6,1,pinned --concurrency "${LOOPLINE_SPEC_C:-1,4,8}" \
    --json "$out/spec_k.json" 2>&1 | grep -v Warn | tail -8
  python3 tools/fit_verify_cost.py "$out/spec_k.json"
fi
if has fp8_one_row; then  # issue #40: FP8 KV at one row (0.94x bf16): 128-key tiles with as many splits as fill them
  for v in "bf16" "fp8" "fp8 --decode-launch 128,4,1 --attn-num-splits 9" "fp8 --decode-launch 128,4,1 --attn-num-splits 10" \
           "fp8 --decode-launch 128,4,1 --attn-num-splits 12" "fp8 --decode-launch 64,4,1 --attn-num-splits 18" "bf16"; do
    set -- $v
    kv=$1; shift
    [ "$kv" = bf16 ] && kv=auto
    timeout 60 python3 tools/profile_step.py --rows 1 --context 1024 --steps 128 --kv-cache-dtype "$kv" "$@" 2>&1 \
      | grep -E "mean step" | sed "s/^/$v: /"
  done | tee "$out/fp8_one_row.txt"
fi
if has rows_breakdown; then  # issue #40/#41: where a 2-16-row step's time goes beyond one row's. Without PDL
  # (LOOPLINE_PDL=0) every kernel's profiled time is its own, not its wait for the kernel before; the mean step
  # with and without PDL says what PDL buys at each row count; bench_gemm gives the products' bandwidth alone
  for r in ${LOOPLINE_ROWS:-1 2 4 8 16}; do
    for pdl in 1 0; do
      LOOPLINE_PDL=$pdl timeout 60 python3 tools/profile_step.py --rows "$r" --context 1088 --steps 128 2>&1 \
        | grep -E "mean step" | sed "s/^/rows $r pdl $pdl: /"
    done
    LOOPLINE_PDL=0 timeout 90 python3 tools/profile_step.py --rows "$r" --context 1088 --steps 64 --kernels \
      > "$out/rows_kernels_$r.txt" 2>&1
  done | tee "$out/rows_breakdown.txt"
  timeout 200 python3 tools/bench_gemm.py --rows 1,2,4,8,16 --sweep --pdl > "$out/rows_gemm.txt" 2>&1; tail -30 "$out/rows_gemm.txt"
fi
if has pipe_profile; then  # issue #41: a pinned pipeline step at C = 1 (4 lanes) against a plain 4-row step, per kernel:
  # what its rounds launch besides the forward (calls per step) and what that costs
  pipe='{"method": "loop", "num_speculative_tokens": 3, "draft_loops": 1, "scheme": "pipeline", "adaptive": false, "disable_by_batch_size": null}'
  # (LOOPLINE_PIPE_ROWS: the requests pipelining, default 1; each beside a plain step of 4x as many rows)
  for r in ${LOOPLINE_PIPE_ROWS:-1}; do
    timeout 120 python3 tools/profile_step.py --rows "$r" --context 1088 --steps 96 --kernels --speculative-config "$pipe" \
      --replay-acceptance 0.89,0.71,0.68 > "$out/pipe_profile_$r.txt" 2>&1
    timeout 90 python3 tools/profile_step.py --rows $((4 * r)) --context 1088 --steps 96 --kernels \
      > "$out/pipe_profile_plain$((4 * r)).txt" 2>&1
    grep -hE "mean step|device time per step|graph replays|warning" "$out/pipe_profile_$r.txt" \
      "$out/pipe_profile_plain$((4 * r)).txt"
  done
fi
if has demo_profile; then  # issue #41: the bundled demo model's steps, where the host sets the pace: a plain step of 1
  # and 4 rows against one request pipelining (its 4 lanes, real acceptance), per kernel and under cProfile
  pipe='{"method":"loop","num_speculative_tokens":2,"draft_loops":1,"scheme":"pipeline","adaptive":false,"disable_by_batch_size":null}'
  # (--triton-argmax-min-vocab 0: the sampler's Triton argmax, which the rule gives only long rows, A/B)
  for v in "--rows 1" "--rows 1 --triton-argmax-min-vocab 0" "--rows 4" "--rows 1 --sync-debug --speculative-config $pipe" \
           "--rows 8 --speculative-config $pipe" "--rows 8" "--rows 1"; do
    name=$(echo "$v" | cut -c1-24 | tr -c 'a-z0-9\n' '_')
    # shellcheck disable=SC2086
    timeout 120 python3 tools/profile_step.py --config demo --context 512 --steps 96 --kernels $v \
      > "$out/demo_profile_$name.txt" 2>&1
    grep -hE "mean step|graph replays|host under|synchronizations|warning" "$out/demo_profile_$name.txt" | sed "s/^/$name: /"
  done
fi
if has demo_grid; then  # issue #41: the bundled demo model's real acceptance on the GPU over K, d, both schemes, greedy and
  # T = 0.5 (LOOPLINE_GRID_T), pinned (as docs/benchmarks/cpu-2026-12-06-spec-matrix.md on the CPU: 64 in / 64 out, held-out windows),
  # then the trained adapter (LOOPLINE_ADAPTER: its directory, from `loopline train draft`) at K = 3
  dv=""; for k in ${LOOPLINE_GRID_K:-1 2 3 4 6 8}; do dv="$dv --spec $k,1,pinned"; done
  dv="$dv --spec 3,2,pinned --spec 3,3,pinned"
  wheels "--prompts heldout fails (the corpus's license check imports boolean.py)"
  grid() { timeout "$1" python3 tools/spec_speed.py --config demo --prompts heldout --input-len 64 --output-len 64 \
    --concurrency "${LOOPLINE_GRID_C:-1,8,32}" "${@:2}" 2>&1 | grep -E "x  |refused|Error" | sed 's/  */ /g'; }
  for t in ${LOOPLINE_GRID_T:-0 0.5}; do
    # shellcheck disable=SC2086
    grid 200 $dv --scheme draft_verify --temperature $t --json "$out/grid_dv_t$t.json"
    grid 100 --spec 1,1,pinned --spec 1,2,pinned --spec 1,3,pinned --scheme pipeline --temperature $t \
      --json "$out/grid_pipe_t$t.json"
  done
  if [ -n "${LOOPLINE_ADAPTER:-}" ]; then
    grid 100 --spec 3,1,pinned --spec 3,2,pinned --scheme draft_verify --draft-adapter "$LOOPLINE_ADAPTER" \
      --json "$out/grid_adapter.json"
  fi
fi
if has skinny_routes; then  # issue #40: cuBLAS or the skinny split-K kernel per projection at 2-16 rows
  # (bench_gemm alone: skinny with PDL wins o_proj from 2 rows and q/k/v from 4, cuBLAS gate/up), then the pinned
  # pipeline at C = 1 (4 lanes) under each route
  for r in ${LOOPLINE_ROWS:-2 4 8 16}; do for v in 0 qkv=16,o=16 o=16 16 0; do
    timeout 60 python3 tools/profile_step.py --rows "$r" --context 1088 --steps 128 --skinny-max-rows "$v" 2>&1 \
      | grep -E "mean step" | sed "s/^/rows $r skinny $v: /"
  done; done | tee "$out/skinny_routes.txt"
  pipe='{"method": "loop", "num_speculative_tokens": 3, "draft_loops": 1, "scheme": "pipeline", "adaptive": false, "disable_by_batch_size": null}'
  for v in 0 qkv=16,o=16 o=16 0; do
    timeout 60 python3 tools/profile_step.py --rows 1 --context 1088 --steps 128 --skinny-max-rows "$v" \
      --speculative-config "$pipe" --replay-acceptance 0.89,0.71,0.68 2>&1 | grep -E "mean step" | sed "s/^/pipe skinny $v: /"
  done | tee -a "$out/skinny_routes.txt"
fi
if has splits_rows; then  # issue #40: split-KV counts of the fused decode attention at 2 and 4 rows (the rule: 2.5
  # programs per SM, 64-key splits); LOOPLINE_ROWS / LOOPLINE_SPLITS pick others (e.g. 8 16 / 0 2 3 4 6 8);
  # LOOPLINE_SPLITS_EXTRA="--attn-programs-per-sm 100" splits where the rule does not (24 rows and more)
  for r in ${LOOPLINE_ROWS:-2 4}; do for s in ${LOOPLINE_SPLITS:-0 4 6 8 10 12 16}; do
    # shellcheck disable=SC2206
    if [ "$s" = 0 ]; then extra=(); else extra=(--attn-num-splits "$s" ${LOOPLINE_SPLITS_EXTRA:-}); fi
    timeout 60 python3 tools/profile_step.py --rows "$r" --context 1088 --steps 128 "${extra[@]}" 2>&1 \
      | grep -E "mean step" | sed "s/^/rows $r splits ${s/#0/rule}: /"
  done; done | tee "$out/splits_rows.txt"
fi
if has full_waves; then  # issue #40: the fused decode launch's full-wave split counts (4 / 8 / 16 rows of Ouro take
  # 6 / 3 / 3 splits, SplitRule.full_wave_programs_per_sm) against the rule's 4 / 2 / 2 (--no-full-waves), A/B/A
  for r in ${LOOPLINE_ROWS:-4 8 16}; do for v in "" "--no-full-waves" ""; do
    # shellcheck disable=SC2086
    timeout 60 python3 tools/profile_step.py --rows "$r" --context 1088 --steps 128 $v 2>&1 \
      | grep -E "mean step" | sed "s/^/rows $r ${v:-full-waves}: /"
  done; done | tee "$out/full_waves.txt"
fi
if has full_waves_e2e; then  # the README command at 4 / 8 / 16 requests (LOOPLINE_HEADLINE_C) with full waves (the
  # default) and with the rule before (LOOPLINE_SPLIT_RULE, the timing hook), A/B/A
  i=0
  for r in "" "full_wave_programs_per_sm=inf" ""; do
    i=$((i + 1)); echo "== run $i, split rule ${r:-default}"
    LOOPLINE_SPLIT_RULE=$r timeout 240 python3 -m loopline.entrypoints.cli bench --config ouro-1.4b --dtype bfloat16 \
      --input-len 1024 --output-len 128 --concurrency "${LOOPLINE_HEADLINE_C:-4,8,16}" --no-progress \
      --output-json "$out/full_waves_e2e_$i.json" 2> "$out/full_waves_e2e.err" | tail -5 || tail -3 "$out/full_waves_e2e.err"
  done
fi
if has fp8_full_waves; then  # issue #40: FP8 4-row fused decode launches take 2 splits (128 programs, 0.48 of a
  # wave at the 2 programs an SM their 254 registers allow): 3 and 4 splits (a full wave) forced, A/B/A
  for v in "" "--attn-num-splits 4" "--attn-num-splits 3" ""; do
    # shellcheck disable=SC2086
    timeout 60 python3 tools/profile_step.py --rows "${LOOPLINE_ROWS:-4}" --context 1088 --steps 128 --kv-cache-dtype fp8 $v \
      2>&1 | grep -E "mean step" | sed "s/^/fp8 ${v:-default}: /"
  done | tee "$out/fp8_full_waves.txt"
fi
if has cold_start; then  # what a fresh process's first requests pay (Triton compiles of the shapes no graph holds):
  # no warm-up, an empty Triton cache, then the same again with the cache the first run filled; TTFT mean / p50 / p99
  export TRITON_CACHE_DIR; TRITON_CACHE_DIR=$(mktemp -d)
  for run in cold-cache warm-cache; do for c in ${LOOPLINE_COLD_C:-1 4}; do
    bench 200 --input-len 1024 --output-len 16 --concurrency "$c" --num-prompts $((4 * c)) --warmup-prompts 0 \
      --output-json "$out/cold_start_${run}_$c.json" > /dev/null 2> "$out/cold_start.err"
    python3 -c "import json, sys; m = json.load(open(sys.argv[1]))['results'][0]['variants'][0]['median']['ttft_ms']
print(f'$run C=$c: TTFT mean {m[\"mean\"]:.1f} p50 {m[\"p50\"]:.1f} p99 {m[\"p99\"]:.1f} ms')" "$out/cold_start_${run}_$c.json" \
      || tail -3 "$out/cold_start.err"
  done; done | tee "$out/cold_start.txt"
fi
if has jit_misses; then  # the Triton kernels an engine compiles after start-up, phase by phase (empty Triton cache)
  TRITON_CACHE_DIR=$(mktemp -d) timeout 300 python3 tools/jit_misses.py --config ouro-1.4b --json "$out/jit_misses.json" \
    2>&1 | grep -v Warn | tee "$out/jit_misses.txt" | head -60
fi
if has host_wait; then  # why 64- and 80-row steps exceed their graph replayed alone (H100, session 31): the KV pool
  # profile_step sizes by rows (0.9 GiB a row) against a fixed 24 GiB, and the syncs torch sees in the steps
  for r in ${LOOPLINE_ROWS:-48 64 80}; do for kv in "" "--kv-gb 24"; do
    # shellcheck disable=SC2086
    timeout 90 python3 tools/profile_step.py --rows "$r" --context 1088 --steps 64 --kv-cache-dtype fp8 $kv --sync-debug \
      2>&1 | grep -E "mean step|graph replay alone|synchronizations|^ +[0-9]+x" | head -8 | sed "s/^/rows $r ${kv:-kv by rows}: /"
  done; done | tee "$out/host_wait.txt"
fi
if has last_merges; then  # issue #40: the fused decode kernel's last split merges (no merge launch), A/B/A at
  # 1-8 rows: its GPU tests first (the arrival counters are a cross-program handshake), then whole steps
  timeout 90 python3 -m pytest -q -n 0 tests/attention/test_triton_backend.py -k "last_split or gpu_fused_decode" \
    > "$out/last_merges_tests.log" 2>&1; echo "last-merges tests rc=$? $(tail -1 "$out/last_merges_tests.log")"
  for r in ${LOOPLINE_ROWS:-1 2 4 8}; do for v in 0 1 0; do
    timeout 60 python3 tools/profile_step.py --rows "$r" --context 1088 --steps 128 --decode-launch "0,0,0,$v" 2>&1 \
      | grep -E "mean step" | sed "s/^/rows $r last_split_merges=$v: /"
  done; done | tee "$out/last_merges.txt"
fi
if has fp8_layout; then  # issue #40: FP8 and bf16 decode attention over token-major pages (the engine's) against
  # head-major ones (strided views), and the reads alone, at 128 and 32 rows
  timeout 200 python3 tools/fp8_decode_probe.py --check --rows 128,32 --only "engine default,head-major,gather hg=1 pages=4" \
    2>&1 | grep -v Warn | tee "$out/fp8_layout.txt"
fi
if has fp8_cuda_core; then  # issue #40: CUDA-core decode kernels (tools/decode_kernel_probe.py's warp / lanes) over
  # FP8 and bf16 pages against the engine's launch and the reads alone, at 128 and 32 rows
  timeout 240 python3 tools/fp8_decode_probe.py --check --rows 128,32 --only "engine default,engine (16,engine (32,cuda-core,gather hg=1 pages=4" \
    2>&1 | grep -v Warn | grep -v "^check" | tee "$out/fp8_cuda_core.txt"
fi
if has cuda_core_steps; then  # issue #40: decode rows of many-row steps on CUDA cores (DecodeLaunch(cuda_cores=1 or 2),
  # --decode-launch BLOCK_N,WARPS,STAGES,0,1) against the tensor-core kernel, FP8 and bf16, whole steps A/B/A
  timeout 120 python3 -m pytest -q -n 0 tests/attention/test_triton_backend.py tests/test_fp8_kv_attention.py -k cuda_core \
    > "$out/cuda_core_tests.log" 2>&1; echo "cuda-core tests rc=$? $(tail -1 "$out/cuda_core_tests.log")"
  # (BLOCK_N,WARPS,STAGES,0,K: K 1 one softmax a program, 2 one a key lane)
  for c in "128 fp8" "32 fp8" "128 auto"; do set -- $c
    for l in "" "16,1,1,0,1" "16,2,1,0,1" "32,4,1,0,1" "16,2,1,0,2" ""; do
      [ "$2" = auto ] && [ "$l" = "16,2,1,0,1" -o "$l" = "32,4,1,0,1" ] && continue
      timeout 90 python3 tools/profile_step.py --rows "$1" --context 1088 --steps 64 --kv-cache-dtype "$2" \
        ${l:+--decode-launch $l} 2>&1 | grep -E "mean step" | sed "s/^/rows $1 $2 launch ${l:-default}: /"
    done
  done | tee "$out/cuda_core_steps.txt"
fi
# step_cases FILE CASES: profile_step's mean step and graph replay for each "rows kv launch splits" case (cases
# separated by ';'; launch "-": the default, else BLOCK_N,WARPS,STAGES,LAST_MERGES,CUDA_CORES[,MAX_REGISTERS];
# splits 0: the rule's, S: --attn-num-splits S with --attn-programs-per-sm 1000, which splits every launch, and
# --fused-decode-min-splits 65, which keeps split launches off the fused decode kernel). Pools over 64 rows take
# 62 GiB (128 rows of FP8 pages fit an H100) unless LOOPLINE_KV_GB says otherwise.
step_cases() {
  local file=$1 c launch split kvgb
  local F="--attn-programs-per-sm 1000 --fused-decode-min-splits 65"
  IFS=';' read -ra cases <<< "$2"
  for c in "${cases[@]}"; do set -- $c
    kvgb=""; [ "$1" -gt 64 ] && kvgb="--kv-gb ${LOOPLINE_KV_GB:-62}"
    launch=""; [ "$3" != "-" ] && launch="--decode-launch $3"
    split=""; [ "$4" != "0" ] && split="--attn-num-splits $4 $F"
    # shellcheck disable=SC2086
    timeout 100 python3 tools/profile_step.py --rows "$1" --context 1088 --steps 64 --kv-cache-dtype "$2" $kvgb \
      $launch $split 2>&1 | grep -E "mean step|graph replay" | sed "s/.*mean step/rows $1 $2 launch $3 splits $4: mean step/" \
      | sed "s/^graph /  graph /"
  done | tee "$out/$file"
}
if has cuda_core_splits; then  # issue #40: whole decode steps over FP8 (and bf16) pages at 32 / 64 / 128 rows,
  # the tensor-core kernel against mha_decode_kernel (DecodeLaunch 16,W,1,0,K) at forced split counts;
  # LOOPLINE_SPLIT_CASES: the cases (step_cases)
  step_cases cuda_core_splits.txt "${LOOPLINE_SPLIT_CASES:-32 fp8 - 0;32 fp8 16,1,1,0,1 0;32 fp8 16,1,1,0,1 4;32 fp8 - 0}"
fi
if has register_caps; then  # issue #40: the tensor-core decode launch with its registers capped (DecodeLaunch
  # max_registers, Triton's maxnreg: more programs an SM, spills) and with 32-key FP8 tiles: compiled for sm_90 by
  # Triton 3.6 on the CPU (tools/attention_resources.py), FP8 unsplit launches of 128-key tiles hold 255 registers
  # (two programs of 4 warps an SM), of 32-key tiles 128 (four), bf16's 64-key tiles 114 (four); GPU tests first
  timeout 120 python3 -m pytest -q -n 0 tests/attention/test_triton_backend.py tests/test_fp8_kv_attention.py \
    -k "capped or full_grid or cuda_core" \
    > "$out/register_caps_tests.log" 2>&1; echo "register-cap tests rc=$? $(tail -1 "$out/register_caps_tests.log")"
  step_cases register_caps.txt "${LOOPLINE_CAP_CASES:-32 fp8 0,0,0,0,0 0;32 fp8 0,0,0,0,0,168 0;32 fp8 0,0,0,0,0,128 0;\
32 fp8 0,0,0,0,0,96 0;32 fp8 64,4,2,0,0 0;32 fp8 64,4,2,0,0,128 0;32 fp8 32,4,2,0,0 0;32 fp8 32,4,3,0,0 0;\
32 fp8 0,0,0,0,0 0;128 fp8 32,4,2,0,0 0;128 fp8 0,0,0,0,0 0;128 fp8 0,0,0,0,0,168 0;128 fp8 0,0,0,0,0,128 0;\
128 fp8 - 0;128 fp8 0,0,0,0,0 0;32 auto - 0;32 auto 0,0,0,0,0,96 0;32 auto 0,0,0,0,0,80 0;32 auto - 0}"
  if [ "${LOOPLINE_CAP_PROBE:-1}" = 1 ]; then  # (0: skip the one-launch probe)
    timeout 200 python3 tools/fp8_decode_probe.py --rows 128,32 --only "engine" 2>&1 | grep -v Warn \
      | tee "$out/register_caps_probe.txt"
  fi
fi
if has cuda_core_mixed; then  # issue #40: a C = 128 run's mixed steps (120 decode rows + 8 x 1,024-token prompts,
  # FP8 pages) with their decode launch on the tensor-core kernel (the default: the CUDA-core rule covers
  # decode-only launches) against mha_decode_kernel (DecodeLaunch 0,0,0,0,1), A/B/A
  for l in 0,0,0,0,0 0,0,0,0,1 0,0,0,0,0; do
    timeout 150 python3 tools/profile_step.py --rows 120 --mixed-prompts 8 --context 1024 --kv-cache-dtype fp8 \
      --kv-gb "${LOOPLINE_KV_GB:-62}" --decode-launch "$l" 2>&1 | grep -E "^mixed:" | sed "s/^/launch $l: /"
  done | tee "$out/cuda_core_mixed.txt"
fi
if has resources; then  # every compiled Triton kernel's registers, spills, shared memory and programs an SM, as
  # the decode steps of 1, 2 and 32 rows (bf16) and 32 / 128 rows (FP8) compile them
  for c in "1 auto" "2 auto" "32 auto" "32 fp8" "128 fp8"; do set -- $c
    kvgb=""; [ "$1" -gt 64 ] && kvgb="--kv-gb ${LOOPLINE_KV_GB:-62}"
    echo "== rows $1 $2"
    # shellcheck disable=SC2086
    timeout 100 python3 tools/profile_step.py --rows "$1" --context 1088 --steps 16 --kv-cache-dtype "$2" $kvgb \
      --resources 2>&1 | sed -n '/^compiled Triton kernels/,/^ *$\|function calls/p' | grep -v "^ *$\|function calls"
  done | tee "$out/resources.txt"
fi
if has fp8_launches; then  # issue #40: the unsplit decode launch over FP8 pages (keys per step, warps, stages) at
  # 128 and 32 rows, against the reads alone
  timeout 200 python3 tools/fp8_decode_probe.py --rows 128,32 --only "fp8 engine,fp8 gather hg=1 pages=4" 2>&1 \
    | grep -v Warn | tee "$out/fp8_launches.txt"
fi
if has split_sums; then  # issue #40: o_proj's and down_proj's split-K partials summed by the norm that reads them
  # (TritonOps(split_sums_in_norm=True), the default) against their reduction kernel, at 2-16 rows
  for r in ${LOOPLINE_ROWS:-2 4 8 16}; do for v in "--no-split-sums-in-norm" "--split-sums-in-norm" "--no-split-sums-in-norm"; do
    # shellcheck disable=SC2086
    timeout 60 python3 tools/profile_step.py --rows "$r" --context 1088 --steps 128 $v 2>&1 \
      | grep -E "mean step" | sed "s/^/rows $r ${v:-reduce-kernel}: /"
  done; done | tee "$out/split_sums.txt"
fi
if has fp8_rows; then  # issue #40: FP8 against bf16 steps at 1-16 rows; "--decode-launch 64" is the launch before 38ab60a
  for r in ${LOOPLINE_ROWS:-1 2 4 8 16}; do for v in "auto" "fp8" "fp8 --decode-launch 64" "auto"; do
    set -- $v; kv=$1; shift
    timeout 60 python3 tools/profile_step.py --rows "$r" --context 1088 --steps 128 --kv-cache-dtype "$kv" "$@" 2>&1 \
      | grep -E "mean step" | sed "s/^/rows $r $v: /"
  done; done | tee "$out/fp8_rows.txt"
fi
if has newkernels; then  # kernels written since the last GPU run: their tests on the GPU (fused lookahead rule)
  timeout 90 python3 -m pytest -q tests/kernels/test_lookahead_kernel.py > "$out/newkernels.log" 2>&1
  echo "new kernel tests rc=$? $(tail -1 "$out/newkernels.log")"; grep -hE "^(FAILED|ERROR)" "$out/newkernels.log" | head -5
fi
if has lookahead; then  # issue #44: the lookahead policy vs the stock exit path at the same depths and fixed depth
  mkdir -p "$out/lookahead"
  timeout 300 python3 tools/lookahead_h200.py --config ouro-1.4b --concurrency 1,32,128 --input-len 1024 \
    --output-len 128 --out "$out/lookahead" 2>&1 | tail -20
fi
if has trace_cost; then  # issue #44: the exit-trace recorder off / on / on with labels
  timeout 120 python3 tools/exit_trace_cost.py --config ouro-1.4b --dtype bfloat16 --concurrency 1,32 \
    --input-len 1024 --output-len 128 --repeats 2 --json "$out/trace_cost.json" 2>&1 | tail -9
fi
# the device returns at most 8 files: everything also goes back in one archive
tar -czf "$out/all.tgz" -C "$out" --exclude all.tgz . 2>/dev/null
