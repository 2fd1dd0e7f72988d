"""Offline, in-process benchmark of the engine (vLLM's ``bench throughput/latency`` style).

One *run* builds an ``LLMEngine`` around an in-memory model, warms it up, then
drives a closed loop: ``concurrency`` requests are kept in flight and a finished
request is replaced at once by the next, until ``num_prompts`` have completed.
The harness timestamps every request on each ``step()`` return (first token,
every new token), and reads the engine's counters (steps, rows, loops of
generated tokens) before and after the measured part.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from loopline.bench.env import DeviceTimer
from loopline.bench.metrics import ByteModel, RequestTiming, latency_metrics, peak_gbps
from loopline.bench.workload import Workload, request_seed
from loopline.config import EngineArgs, resolve_device, resolve_dtype
from loopline.engine import EngineStats, LLMEngine
from loopline.errors import InvalidRequestError
from loopline.models.ouro import OuroConfig, OuroForCausalLM
from loopline.runtime.heap import frozen_heap
from loopline.sampling_params import SamplingParams

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
CONFIG_NAMES = ("tiny", "ouro-1.4b", "ouro-2.6b", "huginn-tiny", "huginn-3.5b")

ProgressFn = Callable[[int], None]  # called with the number of requests that just finished


@dataclass(frozen=True)
class BenchSpec:
    """The workload shape and measurement options of one benchmark point."""

    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    seed: int = 0
    exit_threshold: float | None = None  # exit_mode=threshold only
    min_loops: int | None = None  # exit_mode=threshold only
    lookahead_threshold: float | None = None  # exit_mode=lookahead only (None: the head's calibrated one)
    warmup_prompts: int | None = None  # default: concurrency
    warmup_output_len: int = 16
    gpu_timing: str = "events"  # or "profiler" (DeviceTimer)
    # every request's sampling (vLLM's bench names); temperature 0: greedy. Sampled requests are seeded by
    # their index (request_seed), so a run draws the same tokens again.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def num_warmup(self) -> int:
        n = self.concurrency if self.warmup_prompts is None else self.warmup_prompts
        return min(n, self.num_prompts)


@dataclass(frozen=True)
class Variant:
    """One configuration in a comparison: engine-argument overrides, or the HF baseline."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    hf: bool = False
    description: str = ""


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("refill", {"scheduling_mode": "refill"}, description="CDB: an exited slot starts its next token at once"),
    Variant("no_refill", {"scheduling_mode": "no_refill"}, description="cohort baseline: exited rows idle until the cohort exits"),
    Variant("fixed", {"scheduling_mode": "refill", "exit_mode": "fixed"}, description="full depth: every token runs all loops"),
    Variant("lookahead", {"exit_mode": "lookahead"},
            description="the lookahead head beside the weights fixes each exit two loops ahead (docs/lookahead.md)"),
    Variant("shared", {"kv_layout": "shared"}, description="one shared KV plane"),
    Variant("last_exited", {"kv_layout": "last_exited"}, description="one KV plane per loop"),
    Variant("no_prefix_cache", {"enable_prefix_caching": False}, description="prefix caching off"),
    Variant("prefix_cache", {"enable_prefix_caching": True}, description="prefix caching on (full prompt pages reused)"),
    Variant("sync", {"async_scheduling": False}, description="the host reads each step before launching the next"),
    Variant("async", {"async_scheduling": True}, description="step n+1 launches before step n is read"),
    Variant("eager", {"enforce_eager": True}, description="no CUDA graphs"),
    Variant("no_spec", {"speculative_config": None},
            description="speculation off (the run's --speculative-config dropped): --variants no_spec,loopline "
                        "reports speculation's speedup"),
    Variant("triton", {"attention_backend": "triton"}, description="paged attention on loopline's Triton kernels"),
    Variant("flashinfer", {"attention_backend": "flashinfer"},
            description="paged attention on FlashInfer's (pip install 'loopline[flashinfer]')"),
    Variant("hf", hf=True, description="transformers generate(), static batches, full depth"),
)}
DEFAULT_COMPARE = ("refill", "no_refill", "fixed")


# --- the model ----------------------------------------------------------------------------


def build_model(args: EngineArgs, config_name: str | None, seed: int) -> tuple[OuroForCausalLM, torch.device, torch.dtype, str]:
    """The model every run shares: ``--model DIR`` loaded once, or random weights of a named config.

    Returns ``(model, device, dtype, source)``; the model is already on the device in the dtype.
    """
    from loopline.models.loader import load_looped_config, load_looped_model

    device = resolve_device(args.device)
    if args.model:
        cfg = load_looped_config(args.model)
        dtype = resolve_dtype(args.dtype, cfg.torch_dtype, device)
        return load_looped_model(args.model, dtype, device).eval(), device, dtype, args.model
    name = config_name or "tiny"
    if name not in CONFIG_NAMES:
        raise InvalidRequestError(f"config must be one of {list(CONFIG_NAMES)}, got {name!r}", param="config")
    cfg, build, random_weights = random_config(name)
    dtype = resolve_dtype(args.dtype, cfg.torch_dtype, device)
    weights = {k: v.to(dtype) for k, v in random_weights(cfg, seed).items()}
    with torch.device("meta"):
        model = build(cfg)
    if "lm_head.weight" not in weights:  # a tied Huginn head is the embedding
        weights["lm_head.weight"] = weights["transformer.wte.weight"]
    model.load_state_dict(weights, assign=True)
    return model.to(device).eval(), device, dtype, f"random weights, {name} shapes, seed {seed}"


def random_config(name: str) -> tuple[Any, Callable, Callable]:
    """``(config, model class, seeded random weights(config, seed))`` of a named ``--config``: Ouro's
    (``tiny``, ``ouro-1.4b``, ``ouro-2.6b``) or Huginn's (``huginn-tiny``; ``huginn-3.5b``: Huginn-0125's
    shapes, 32 iterations by default)."""
    from loopline.models.huginn import HuginnConfig, HuginnForCausalLM
    from loopline.models.huginn_tiny import random_huginn_state_dict, tiny_huginn_config
    from loopline.models.tiny import random_checkpoint_config, random_state_dict, tiny_config

    if name.startswith("huginn"):
        return (tiny_huginn_config() if name == "huginn-tiny" else HuginnConfig()), HuginnForCausalLM, \
            lambda c, seed: random_huginn_state_dict(c, seed)
    cfg = tiny_config() if name == "tiny" else random_checkpoint_config(name)
    return cfg, OuroForCausalLM, lambda c, seed: random_state_dict(c, seed=seed)


# --- one engine run -----------------------------------------------------------------------


def engine_args_for(base: EngineArgs, variant: Variant, spec: BenchSpec, dtype: torch.dtype) -> EngineArgs:
    """The engine arguments of one run: the CLI's, the variant's overrides, sized for the concurrency.

    ``max_num_seqs`` left as ``None`` by the bench CLI becomes ``concurrency``; the token budget
    stays the engine's default unless given.
    """
    args = dataclasses.replace(base, **variant.overrides)
    seqs = args.max_num_seqs if args.max_num_seqs is not None else spec.concurrency
    return dataclasses.replace(args, skip_tokenizer_init=True, dtype=DTYPE_NAMES[dtype], max_num_seqs=seqs)


def sampling_params_for(exit_mode: str, spec: BenchSpec, workload: Workload, index: int) -> SamplingParams:
    """``ignore_eos``, exactly ``output_len`` tokens, the spec's sampling (greedy by default; sampled requests
    seeded by their index); the exit fields the mode reads."""
    kw: dict[str, Any] = {"temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k,
                          "min_p": spec.min_p, "max_tokens": workload.output_len, "ignore_eos": True}
    if spec.temperature > 0:
        kw["seed"] = request_seed(spec.seed, index)
    if exit_mode == "trace":
        if workload.exit_depths is None:
            raise InvalidRequestError("exit_mode='trace' needs --depth-dist", param="depth_dist")
        kw["exit_depths"] = workload.exit_depths[index]
    elif exit_mode == "lookahead":
        if workload.exit_depths is not None:  # what a ReplayPredictor replays (a trained head ignores them)
            kw["exit_depths"] = workload.exit_depths[index]
        if spec.lookahead_threshold is not None:
            kw["lookahead_threshold"] = spec.lookahead_threshold
        if spec.min_loops is not None:
            kw["min_loops"] = spec.min_loops
    elif exit_mode == "threshold":
        if spec.exit_threshold is not None:
            kw["exit_threshold"] = spec.exit_threshold
        if spec.min_loops is not None:
            kw["min_loops"] = spec.min_loops
    return SamplingParams(**kw)


def drive_closed_loop(engine: LLMEngine, workload: Workload, params: list[SamplingParams], concurrency: int,
                      tag: str, timer: DeviceTimer | None = None,
                      progress: ProgressFn | None = None) -> tuple[list[RequestTiming], int]:
    """Keeps ``concurrency`` requests in flight until all are done.

    Returns per-request timings and the number of steps in which at least one
    token was produced (those steps ran the ``lm_head``).
    """
    timings: list[RequestTiming | None] = [None] * workload.num_prompts
    index: dict[str, int] = {}
    next_i, in_flight, head_steps = 0, 0, 0

    def submit() -> None:
        nonlocal next_i, in_flight
        rid = f"{tag}-{next_i}"
        index[rid] = next_i
        timings[next_i] = RequestTiming(submit=time.perf_counter())
        engine.add_request(rid, {"prompt_token_ids": workload.prompts[next_i]}, params[next_i])
        next_i += 1
        in_flight += 1

    while next_i < workload.num_prompts and in_flight < concurrency:
        submit()
    while in_flight:
        if timer is not None:
            timer.before_step()
        outputs = engine.step()
        if timer is not None:
            timer.after_step()
        now = time.perf_counter()
        produced = False
        for out in outputs:
            i = index.get(out.request_id)
            if i is None:
                continue
            timing = timings[i]
            before = timing.num_tokens
            timing.on_tokens(len(out.outputs[0].token_ids), now)
            produced |= timing.num_tokens > before
            if out.finished:
                timing.exit_depths = list(out.outputs[0].exit_depths)
                in_flight -= 1
                if progress is not None:
                    progress(1)
        head_steps += produced
        while next_i < workload.num_prompts and in_flight < concurrency:
            submit()
        if in_flight and not engine.has_unfinished_requests():
            raise RuntimeError(f"engine reports no unfinished requests while the harness waits for {in_flight}")
    return [t for t in timings if t is not None], head_steps


def _stats_delta(after: EngineStats, before: EngineStats) -> EngineStats:
    """Counters of the measured part: numbers and dicts of numbers are differenced, anything else is kept."""
    delta = copy.deepcopy(after)
    for f in dataclasses.fields(EngineStats):
        a, b = getattr(after, f.name), getattr(before, f.name)
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            setattr(delta, f.name, a - b)
        elif isinstance(a, dict) and all(isinstance(v, (int, float)) for v in a.values()):
            diff = {k: v - b.get(k, 0) for k, v in sorted(a.items())}
            setattr(delta, f.name, {k: v for k, v in diff.items() if v})
        elif isinstance(a, list) and all(isinstance(v, (int, float)) for v in a):  # per position
            setattr(delta, f.name, [v - (b[i] if i < len(b) else 0) for i, v in enumerate(a)])
    return delta


def bandwidth_fields(bytes_read: int, duration_s: float, device: torch.device) -> dict[str, Any]:
    gbps = bytes_read / duration_s / 1e9 if duration_s > 0 else None
    peak = peak_gbps(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return {"bytes_read": bytes_read, "achieved_gbps": gbps, "peak_gbps": peak,
            "bandwidth_utilization": gbps / peak if gbps is not None and peak else None}


def device_fields(timer: DeviceTimer, duration_s: float) -> dict[str, Any]:
    busy = timer.busy_s()
    fields = {"gpu_timing": timer.method, "gpu_busy_s": busy,
              "gpu_idle_fraction": max(0.0, 1.0 - busy / duration_s) if busy is not None and duration_s > 0 else None}
    kernels = timer.kernel_table()
    if kernels is not None:  # --profile-kernels: where the device time went
        fields["kernels"] = kernels
    return fields


def run_engine(model: OuroForCausalLM, base_args: EngineArgs, spec: BenchSpec, variant: Variant, workload: Workload,
               device: torch.device, dtype: torch.dtype, progress: ProgressFn | None = None,
               setup: Callable[[LLMEngine], None] | None = None) -> dict[str, Any]:
    """Builds a fresh engine for ``variant``, warms it up, measures ``workload``; returns one run's record.
    ``setup``: called with the engine before the warm-up (e.g. a replayed lookahead predictor installed)."""
    args = engine_args_for(base_args, variant, spec, dtype)
    engine = LLMEngine(args, model=model)
    try:
        if setup is not None:
            setup(engine)
        def params(w: Workload) -> list[SamplingParams]:
            return [sampling_params_for(args.exit_mode, spec, w, i) for i in range(w.num_prompts)]

        warm = workload.head(spec.num_warmup, min(spec.warmup_output_len, workload.output_len))
        # A speculating engine's first requests decode plainly while its throughput guard measures plain steps
        # (loopline/core/step_clock.py): a second wave then speculates, so that speculation's own kernels
        # compile before the clock starts.
        if warm.num_prompts:
            for _ in range(2 if engine.scheduler.speculation.clock is not None else 1):
                drive_closed_loop(engine, warm, params(warm), spec.concurrency, tag="warmup")
        before = copy.deepcopy(engine.stats)
        measured_params = params(workload)
        timer = DeviceTimer(device, spec.gpu_timing)
        with frozen_heap():  # as a serving engine process runs (loopline.runtime.heap)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timer.start()
            t0 = time.perf_counter()
            timings, head_steps = drive_closed_loop(engine, workload, measured_params, spec.concurrency,
                                                    tag="run", timer=timer, progress=progress)
            timer.stop()
            duration = time.perf_counter() - t0
        stats = _stats_delta(engine.stats, before)
    finally:
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    bytes_model = ByteModel.for_config(model.config, dtype)
    kv = sum(bytes_model.kv_read(len(p), t.exit_depths or [], model.config.num_loops)
             for p, t in zip(workload.prompts, timings))
    record: dict[str, Any] = {
        "variant": variant.name,
        "engine": {k: getattr(args, k) for k in ("scheduling_mode", "exit_mode", "kv_layout", "max_num_seqs",
                                                  "max_num_batched_tokens", "attention_backend", "enforce_eager",
                                                  "async_scheduling", "block_size", "dtype",
                                                  "speculative_config")},
        **latency_metrics(timings, duration, workload.input_tokens),
        "mean_loops_per_token": stats.mean_exit_depth,
        "exit_depth_counts": {str(d): n for d, n in stats.exit_depth_counts.items()},
        "steps": stats.steps,
        "rows_per_step": stats.rows_per_step,
        "tokens_per_step": stats.scheduled_tokens / stats.steps if stats.steps else None,
        "mean_step_time_ms": stats.step_time_s / stats.steps * 1e3 if stats.steps else None,
        "prefill_steps": stats.prefill_steps,
        "prefill_step_time_s": stats.prefill_step_time_s,
        "decode_step_time_ms": ((stats.step_time_s - stats.prefill_step_time_s) / (stats.steps - stats.prefill_steps)
                                * 1e3 if stats.steps > stats.prefill_steps else None),
        "head_steps": head_steps,
        # loop self-speculation (None when off): vLLM's counters and the mean acceptance length
        "spec_decode": ({**stats.spec_decode_metrics(), "mean_acceptance_length": stats.spec_mean_acceptance_length}
                        if args.speculative_config else None),
        **device_fields(timer, duration),
        **bandwidth_fields(bytes_model.bytes_read(stats.steps, head_steps, kv), duration, device),
    }
    return record
