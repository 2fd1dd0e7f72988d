"""Where does a decode step's time go? (GPU, Ouro shapes, random weights; ``--config demo``: the bundled model)

python tools/profile_step.py --rows 1 --context 1024 [--eager] [--kernels] [--skinny-max-rows N]
Prints the mean step time, the CUDA-graph replay time alone, and a host profile.
--skinny-max-rows 0 against 16 compares cuBLAS with the skinny kernel for 2..16-row projections.
--prefill times whole-prompt prefill loops; --mixed-prompts P times steps that carry P prompts next
to --rows decoding rows (a C = 128 run's prefill steps).
--speculative-config JSON [--replay-acceptance P0,P1,...] times speculating requests' steps (e.g. the
depth pipeline's, whose --kernels table counts the small ops its rounds launch each step); the summary adds
the output tokens per step, so the time per token compares with plain decoding's at 4 steps a token.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import math
import pstats
import time

import torch
from sm90 import programs_per_sm  # (tools/, beside this script)

from loopline.attention.triton_backend import DecodeLaunch, PrefillLaunch, SplitRule, TritonAttentionBackend
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.kernels import gemv
from loopline.kernels.fused import SkinnyRows, TritonOps
from loopline.kernels.gemv import use_gemv
from loopline.models.loader import load_model
from loopline.models.ouro import OuroForCausalLM
from loopline.models.tiny import default_checkpoint, random_checkpoint_config
from loopline.sampling_params import SamplingParams
from loopline.spec.replay import AcceptanceReplay
from loopline.worker import sampler
from loopline.worker.backends import Backends, select_backends
from loopline.worker.cuda_graphs import bucket_sizes


def output_tokens(engine: LLMEngine) -> int:
    """Tokens the running requests have generated so far."""
    return sum(len(r.output) for r in engine.scheduler.requests.values())


def print_kernel_table(engine: LLMEngine, steps: int) -> None:
    """Device time per kernel name over ``steps`` engine steps (graph replays included where CUPTI sees them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    rows = kernel_rows(p)
    total = sum(e.self_device_time_total for e in rows)
    print(f"device time per step: {total / steps / 1e3:.3f} ms over {steps} steps")
    for e in rows[:25]:
        print(f"  {e.self_device_time_total / steps:9.1f} us/step  {e.count / steps:7.1f} calls/step  {e.key[:90]}")


def print_syncs(engine: LLMEngine, steps: int) -> None:
    """The host-device synchronizations torch reports over ``steps`` engine steps, one line per distinct stack
    (its loopline frames) with its count. Event waits are not reported: the overlap's own read of the step
    before is one."""
    import traceback
    import warnings

    stacks: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "loopline" in f.filename or "tools" in f.filename]
        key = f"{str(message)[:80]} <- " + " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                                                        for f in reversed(frames[-6:]))
        stacks[key] = stacks.get(key, 0) + 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # (restores showwarning on exit)
            warnings.simplefilter("always")
            warnings.showwarning = record
            for _ in range(steps):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(f"host-device synchronizations in {steps} steps: {sum(stacks.values())}")
    for key, n in sorted(stacks.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {n:5d}x {key}")


def print_kernel_resources() -> None:
    """Registers, spills and shared memory of every loopline Triton kernel compiled in this process (one line a
    compiled variant), and the programs an SM they allow on an H100 / H200."""
    import sys

    from triton.runtime.jit import JITFunction

    kernels = {}
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("loopline"):
            continue
        for obj in vars(module).values():
            while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):  # autotuners and heuristics wrap it
                obj = obj.fn
            if isinstance(obj, JITFunction):
                kernels[id(obj)] = obj
    print("compiled Triton kernels: registers a thread, spilled bytes, shared KB, warps -> programs an SM (bound)")
    for fn in sorted(kernels.values(), key=lambda f: f.__name__):
        for caches in getattr(fn, "device_caches", {}).values():
            for compiled in caches[0].values():
                regs, spills = getattr(compiled, "n_regs", 0) or 0, getattr(compiled, "n_spills", 0) or 0
                meta = compiled.metadata
                per_sm, bound = programs_per_sm(regs, meta.shared, meta.num_warps)
                print(f"  {fn.__name__:32s} {regs:4d} regs {spills:5d} spilled {meta.shared / 1024:6.1f} KB "
                      f"{meta.num_warps:2d} warps {meta.num_stages} stages -> {per_sm:2d} ({bound})")


def kernel_rows(p) -> list:
    """A profile's entries with device time, longest first."""
    rows = [e for e in p.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    return sorted(rows, key=lambda e: -e.self_device_time_total)


def timed_step(engine: LLMEngine, kernels: bool = False):
    """One engine step between device syncs: ``(ms, profiler or None)``; ``kernels`` records its CUDA kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    p = None
    if kernels:
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            engine.step()
            torch.cuda.synchronize()
    else:
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, p


def print_step_kernels(p, top: int) -> None:
    rows = kernel_rows(p)
    print(f"  one step's device time: {sum(e.self_device_time_total for e in rows) / 1e3:.2f} ms")
    for e in rows[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms  {e.count:5d} calls  {e.key[:90]}")


def profile_prefill(engine: LLMEngine, a: argparse.Namespace, params: SamplingParams) -> None:
    """Times whole-prompt prefill steps (one loop each) and prints where one step's device time goes."""
    profiled = None
    for rep in range(3):
        for i in range(a.rows):
            engine.add_request(f"p{rep}-{i}", list(range(3 + rep, 3 + rep + a.context)), params)
        times = []
        for loop in range(4):
            ms, p = timed_step(engine, kernels=rep == 2 and loop == 1 and a.kernels)
            times.append(ms)
            profiled = profiled if p is None else p
        for rid in list(engine.scheduler.requests):
            engine.abort_request(rid)
        engine.step()
        tokens = a.rows * a.context
        flops = 2 * tokens * sum(p.numel() for n, p in engine.model.named_parameters() if ".layers." in n)
        print(f"prefill {a.rows} x {a.context} tokens, loop steps ms: {[round(t, 2) for t in times]} "
              f"(linear layers alone: {flops / 1e12:.2f} TFLOP per loop -> "
              f"{flops / (min(times[1:]) * 1e-3) / 1e12:.0f} TFLOP/s at the fastest step)")
    if profiled is not None:
        print_step_kernels(profiled, 14)


def profile_mixed(engine: LLMEngine, a: argparse.Namespace, params: SamplingParams) -> None:
    """With ``a.rows`` rows decoding, adds ``a.mixed_prompts`` prompts and times the steps that carry them.

    These are the steps of a C = 128 run that carry prompt chunks next to ~120 decode rows; the kernel
    table is one such step's."""
    vocab = engine.model.config.vocab_size - 8
    for i in range(a.mixed_prompts):  # distinct from the decode rows' prompts
        engine.add_request(f"m{i}", [5 + (i * 104729 + j) % vocab for j in range(a.context)], params)
    times, profiled = [], None
    budget = engine.config.max_num_batched_tokens - a.rows
    replays = engine.runner.graphs.replays["mixed"] if engine.runner.graphs is not None else 0
    for step in range(4 * -(-a.mixed_prompts * a.context // budget) + 4):  # every loop of every chunk, and a few more
        ms, p = timed_step(engine, kernels=step == 2 and a.kernels)
        times.append(ms)
        profiled = profiled if p is None else p
    print(f"mixed: {a.rows} decode rows + {a.mixed_prompts} x {a.context}-token prompts, step ms: "
          f"{[round(t, 1) for t in times]}; budget {engine.config.max_num_batched_tokens}, mixed-graph replays "
          f"{(engine.runner.graphs.replays['mixed'] if engine.runner.graphs is not None else 0) - replays}")
    if profiled is not None:
        print_step_kernels(profiled, 16)


ABLATIONS = ("norms", "merge", "attention", "gemv")
# NOTE: the ablated kernels are no-ops (an empty result of the right shape), so that the step time without them
# shows what they cost inside the PDL chain. The outputs are garbage: timing only.


class AblatedAttention(TritonAttentionBackend):
    """Triton attention without the split merge (``merge``) or without decode attention (``attention``:
    ``rotate_store_attend`` neither stores nor attends)."""

    def __init__(self, kinds: frozenset[str], **backend_args) -> None:
        super().__init__(**backend_args)
        self.kinds = kinds

    def merge(self, num_splits, part_out, part_lse, out) -> None:  # type: ignore[override]
        if "merge" not in self.kinds:
            super().merge(num_splits, part_out, part_lse, out)

    def rotate_store_attend(self, k_cache, v_cache, q, k, v, rope, meta, scale, **scales):
        if "attention" in self.kinds:
            return torch.empty_like(q)
        return super().rotate_store_attend(k_cache, v_cache, q, k, v, rope, meta, scale, **scales)


class AblatedOps(TritonOps):
    """The fused layer kernels without the add + RMSNorm kernels and the norms inside the q/k/v and gate/up
    GEMVs (``norms``), or without the layers' one-row GEMVs (``gemv``; the vocabulary projection still runs)."""

    def __init__(self, kinds: frozenset[str], skinny_max_rows: SkinnyRows | None = None) -> None:
        # (ablated norms hand the projection on as it is: its split-K partials summed by their own kernel)
        super().__init__(skinny_max_rows, split_sums_in_norm=False)
        self.kinds = kinds

    def gemv_ablated(self, x, weight) -> bool:
        return "gemv" in self.kinds and use_gemv(x, weight)  # the calls the GEMV kernel would serve

    @staticmethod
    def empty_out(x, weight):
        return torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)

    def add_rms_norm(self, x, branch, branch_weight, next_weight, eps):
        if "norms" in self.kinds:
            return x, branch
        return super().add_rms_norm(x, branch, branch_weight, next_weight, eps)

    def rms_norm(self, x, weight, eps):
        return x if "norms" in self.kinds else super().rms_norm(x, weight, eps)

    def norm_project_qkv(self, attn, x, branch, branch_weight, weight, eps):
        if "norms" in self.kinds:
            return x, self.project_qkv(attn, x)
        return super().norm_project_qkv(attn, x, branch, branch_weight, weight, eps)

    def norm_project_gate_up(self, mlp, x, branch, branch_weight, weight, eps):
        if "norms" in self.kinds:
            return x, self.project_gate_up(mlp, x)
        return super().norm_project_gate_up(mlp, x, branch, branch_weight, weight, eps)

    def ablated_project(self, module, x, unablated):
        packed = self.packed_weights(module)
        if packed is not None and self.gemv_ablated(x, packed[0]):
            return self.empty_out(x, packed[0]).split(packed[1], dim=-1)
        return unablated(module, x)

    def project_qkv(self, attn, x):
        return self.ablated_project(attn, x, super().project_qkv)

    def project_gate_up(self, mlp, x):
        return self.ablated_project(mlp, x, super().project_gate_up)

    def linear(self, module, x):
        if module.bias is None and self.gemv_ablated(x, module.weight):
            return self.empty_out(x, module.weight)
        return super().linear(module, x)

    def swiglu_down(self, mlp, gate, up):
        down = mlp.down_proj
        if down.bias is None and self.gemv_ablated(gate, down.weight):
            return self.empty_out(gate, down.weight)
        return super().swiglu_down(mlp, gate, up)


def make_backends(a: argparse.Namespace) -> Backends:
    """The engine's CUDA backends with this run's split rule, launch parameters and ablations."""
    kinds = frozenset(k for k in a.ablate.split(",") if k)
    unknown = kinds - set(ABLATIONS)
    if unknown:
        raise SystemExit(f"--ablate: unknown {sorted(unknown)}, choose from {ABLATIONS}")
    rule = SplitRule()
    if a.attn_splits:
        max_splits, min_keys = map(int, a.attn_splits.split(","))
        rule = dataclasses.replace(rule, max_splits=max_splits, min_keys_per_split=min_keys)
    if a.attn_num_splits:
        rule = dataclasses.replace(rule, exact_splits=a.attn_num_splits)
    if a.attn_programs_per_sm:
        rule = dataclasses.replace(rule, programs_per_sm=a.attn_programs_per_sm)
    if a.fused_decode_min_splits is not None:
        rule = dataclasses.replace(rule, fused_decode_min_splits=a.fused_decode_min_splits)
    if a.no_full_waves:
        rule = dataclasses.replace(rule, full_wave_programs_per_sm=math.inf)
    launches = dict(
        split_rule=rule,
        decode_launch=DecodeLaunch.parse(a.decode_launch) if a.decode_launch else None,
        prefill_launch=PrefillLaunch(*map(int, a.prefill_launch.split(","))) if a.prefill_launch else None)
    attention = (AblatedAttention(kinds, **launches) if kinds & {"merge", "attention"}
                 else TritonAttentionBackend(**launches))
    base = select_backends("auto", "auto", torch.device("cuda"))  # the engine's own choice on CUDA
    if kinds & {"norms", "gemv"}:
        layer_ops = AblatedOps(kinds, a.skinny_max_rows)
    elif a.skinny_max_rows is not None or a.split_sums_in_norm is not None:
        sums = {} if a.split_sums_in_norm is None else {"split_sums_in_norm": a.split_sums_in_norm}
        layer_ops = TritonOps(skinny_max_rows=a.skinny_max_rows, **sums)
    else:
        layer_ops = base.layer_ops
    return dataclasses.replace(base, attention=attention, layer_ops=layer_ops)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="ouro-1.4b",
                    help="ouro-1.4b / ouro-2.6b (random weights) or demo (the bundled model's weights: a step "
                         "whose time is the host's)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="overlap steps (the engine's default); --no-async-scheduling reads each step at once")
    ap.add_argument("--prefill", action="store_true",
                    help="profile prefill steps instead: --rows prompts of --context tokens in one step")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's kv_cache_dtype (e.g. fp8)")
    ap.add_argument("--kernels", action="store_true", help="also print device time per kernel name (torch.profiler)")
    ap.add_argument("--resources", action="store_true",
                    help="also print each compiled Triton kernel's registers, spills, shared memory and programs an SM")
    ap.add_argument("--mixed-prompts", type=int, default=0,
                    help="once --rows rows decode, add this many --context-token prompts and time the mixed steps")
    ap.add_argument("--budget", type=int, default=8192,
                    help="max_num_batched_tokens of decode and mixed steps (the engine's token budget)")
    ap.add_argument("--kv-gb", type=float, default=None,
                    help="KV pool in GiB (default: enough for the rows, at least 8)")
    ap.add_argument("--gemv-config", default=None,
                    help="block_n,block_k,num_warps,num_stages for every one-row GEMV (default: the kernel's own); "
                         "N:K=block_n,... for weights of one shape only, several separated by ';'")
    ap.add_argument("--skinny-max-rows", type=SkinnyRows.parse, default=None,
                    help="batches of 2..N rows run q/k/v, gate/up and o_proj through the skinny split-K kernel "
                         "(loopline.kernels.skinny_gemm, PDL) instead of cuBLAS; 0: cuBLAS above one row (down_proj "
                         "keeps the skinny kernel up to 64 rows either way); per projection: qkv=16,o=16 (the "
                         "others 0). Default: fused.SKINNY_MAX_ROWS")
    ap.add_argument("--split-sums-in-norm", action=argparse.BooleanOptionalAction, default=None,
                    help="o_proj's and down_proj's split-K partials (skinny kernel, 2-16 / 2-64 rows) are summed by "
                         "the add + RMSNorm that reads them (TritonOps(split_sums_in_norm=True), the default) or, "
                         "with --no-split-sums-in-norm, by a reduction kernel of their own; --ablate norms/gemv "
                         "always takes the reduction kernel")
    ap.add_argument("--attn-splits", default=None,
                    help="MAX,MIN_KEYS: split-KV rule of decode attention (at most MAX splits of at least "
                         "MIN_KEYS keys; default: the backend's own)")
    ap.add_argument("--attn-num-splits", type=int, default=None,
                    help="every decode launch the split rule splits takes exactly this many splits (any count, "
                         "not only the rule's powers of two: e.g. 24 at one row, 384 programs)")
    ap.add_argument("--attn-programs-per-sm", type=float, default=None,
                    help="the split rule's programs_per_sm (default: the backend's own); with a large value and "
                         "--attn-num-splits every decode launch takes that many splits, also where the rule "
                         "does not split (24 rows and more at 1,088 keys)")
    ap.add_argument("--no-full-waves", action="store_true",
                    help="the fused decode launch keeps the split rule's count where a count filling whole waves "
                         "would replace it (SplitRule.full_wave_programs_per_sm: the rule before full waves)")
    ap.add_argument("--fused-decode-min-splits", type=int, default=None,
                    help="decode-only steps with at least this many key splits take the fused decode attention "
                         "kernel (default: the backend's own; 1: every decode-only step)")
    ap.add_argument("--decode-launch", default=None,
                    help="BLOCK_N,WARPS,STAGES[,LAST_MERGES[,CUDA_CORES[,MAX_REGISTERS]]] of decode-only attention "
                         "launches (0: the backend's own; LAST_MERGES 1: the fused decode kernel's last split merges, "
                         "no merge launch; CUDA_CORES 1: MHA decode rows of unfused launches on mha_decode_kernel, 0: "
                         "never, left out: the rule; MAX_REGISTERS: Triton's maxnreg for the decode launches)")
    ap.add_argument("--prefill-launch", default=None,
                    help="BLOCK_M,BLOCK_N,WARPS,STAGES of attention launches with prefill chunks (with --prefill)")
    ap.add_argument("--triton-argmax-min-vocab", type=int, default=None,
                    help="the sampler's rule: the chunked Triton argmax from this vocabulary size on (default: "
                         "loopline.worker.sampler's; 0: always)")
    ap.add_argument("--speculative-config", default=None,
                    help='the engine\'s speculative_config as JSON, e.g. \'{"method": "loop", "num_speculative_tokens": '
                         '3, "draft_loops": 1, "scheme": "pipeline", "adaptive": false, "disable_by_batch_size": null}\'')
    ap.add_argument("--replay-acceptance", default=None,
                    help="P0,P1,...: with --speculative-config, accept the draft at round position j with probability "
                         "Pj (loopline/spec/replay.py; random weights accept none otherwise)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="after the timing, report the host-device synchronizations of --steps steps with their stacks "
                         "(torch.cuda.set_sync_debug_mode): what stalls the overlap")
    ap.add_argument("--ablate", default="",
                    help=f"comma-separated kernels to replace by no-ops, timing only: {', '.join(ABLATIONS)}")
    a = ap.parse_args()
    if a.replay_acceptance and not a.speculative_config:
        raise SystemExit("--replay-acceptance needs --speculative-config")
    backends = make_backends(a)
    for spec in (a.gemv_config or "").split(";"):
        if "=" in spec:
            shape, launch = spec.split("=")
            gemv.SHAPE_CONFIGS[tuple(map(int, shape.split(":")))] = gemv.GemvConfig(*map(int, launch.split(",")))
        elif spec:
            gemv.DEFAULT_CONFIG = gemv.GemvConfig(*map(int, spec.split(",")))
    if a.triton_argmax_min_vocab is not None:  # (a timing hook: the rule is module state)
        sampler._TRITON_ARGMAX_MIN_VOCAB = a.triton_argmax_min_vocab
    if a.config == "demo":
        model = load_model(default_checkpoint(), dtype=torch.bfloat16, device="cuda")
    else:
        with torch.device("cuda"):
            model = OuroForCausalLM(random_checkpoint_config(a.config)).to(torch.bfloat16)
    vocab = model.config.vocab_size - 8
    engine = LLMEngine(EngineArgs(device="cuda", dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=max(8, a.rows + a.mixed_prompts),
                                  kv_cache_memory_gb=a.kv_gb or max(8.0, (a.rows + a.mixed_prompts) * 0.9), enforce_eager=a.eager, async_scheduling=a.async_scheduling,
                                  kv_cache_dtype=a.kv_cache_dtype,
                                  max_num_batched_tokens=max(2048, a.rows * a.context) if a.prefill else a.budget,
                                  max_model_len=a.context + 512,
                                  speculative_config=json.loads(a.speculative_config) if a.speculative_config else None),
                          model=model, backends=backends)
    if a.replay_acceptance:  # the verdicts are draws: timing only
        engine.runner.spec.replay = AcceptanceReplay([float(p) for p in a.replay_acceptance.split(",")])
    # enough loop steps for every phase (speculation commits several tokens a step)
    params = SamplingParams(max_tokens=400 if a.speculative_config else 96, temperature=0.0, ignore_eos=True)
    if a.prefill:
        return profile_prefill(engine, a, params)
    for i in range(a.rows):  # distinct prompts: shared prefix pages would make KV reads hit L2
        engine.add_request(f"r{i}", [3 + (i * 7919 + j) % min(40000, vocab) for j in range(a.context)], params)
    while any(r.status.value != "decode" for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(8):
        engine.step()
    if a.mixed_prompts:
        return profile_mixed(engine, a, params)
    torch.cuda.synchronize()
    out0 = output_tokens(engine)
    replays0 = sum(engine.runner.graphs.replays.values()) if engine.runner.graphs is not None else 0
    t0 = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / a.steps * 1e3
    if engine.runner.graphs is not None:  # steps no captured graph fits run eagerly (launch-bound)
        replayed = sum(engine.runner.graphs.replays.values()) - replays0
        print(f"graph replays in the timed steps: {replayed} of {a.steps} ({dict(engine.runner.graphs.replays)})")
    if engine.scheduler.num_running < a.rows:  # (and their tokens left the count: fewer --steps)
        print(f"warning: requests finished during the timed steps ({engine.scheduler.num_running} of {a.rows} left)")
    per_step = (output_tokens(engine) - out0) / a.steps
    spec = f" spec={a.speculative_config} replayed={a.replay_acceptance}" if a.speculative_config else ""
    print(f"rows={a.rows} context={a.context} eager={a.eager} async={a.async_scheduling} "
          f"skinny={tuple(getattr(backends.layer_ops, 'skinny_rows', ()))}"
          f"{' split-sums-in-norm' if getattr(backends.layer_ops, 'split_sums_in_norm', False) else ''}"
          f"{spec}: mean step {step_ms:.3f} ms "
          f"-> {a.rows * 1e3 / (step_ms * 4):.1f} output tok/s at 4 loops; {per_step:.3f} output tokens a step "
          f"-> {per_step * 1e3 / step_ms:.1f} tok/s")
    runner = engine.runner
    if runner.graphs is not None and not a.speculative_config:
        # NOTE: replays with the last step's inputs; it rewrites state a step would write anyway (KV of
        # the same positions, slot hidden state), and the timing run ends the profile's engine use.
        b = next(s for s in bucket_sizes(runner.max_num_seqs) if s >= a.rows)
        graph = runner.graphs.graph("decode", (b, 0))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        print(f"graph replay alone: {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms")
    if a.sync_debug:
        print_syncs(engine, a.steps)
    if a.kernels:
        print_kernel_table(engine, a.steps)
    if a.resources:
        print_kernel_resources()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(18)
    stats.sort_stats("cumulative").print_stats("loopline/", 30)  # the engine's own calls: where a step's host time goes
    # the host's wait for the device's results (the overlap reads the step before through an event): near zero,
    # the host, not the GPU, sets the step's pace
    total = stats.total_tt  # (all of it is the steps: the profile holds only them; `step` itself runs wrapped)
    waited = sum(v[2] for k, v in stats.stats.items() if "synchronize" in k[2])
    print(f"host under cProfile: {total / a.steps * 1e3:.3f} ms a step, of which waiting for the device "
          f"{waited / a.steps * 1e3:.3f} ms (Event/stream synchronize)")


if __name__ == "__main__":
    main()
