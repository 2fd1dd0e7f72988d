"""The Hugging Face transformers baseline: ``generate()`` on the same weights.

Static batching, as a plain transformers user would run it: the prompts are cut
into batches of ``concurrency`` (all prompts have the same length, so there is
no padding); each batch is submitted when the previous one has finished and runs
``generate(max_new_tokens=output_len, do_sample=False)`` at full depth with eos
disabled. A streamer timestamps every decoding step, so TTFT / TPOT / ITL are
measured exactly as for the engine.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from loopline.bench.env import DeviceTimer
from loopline.bench.metrics import ByteModel, RequestTiming, latency_metrics
from loopline.bench.offline import BenchSpec, ProgressFn, bandwidth_fields, device_fields
from loopline.bench.workload import Workload
from loopline.models.hf_compat import OuroHFForCausalLM
from loopline.models.ouro import OuroForCausalLM


class _TimingStreamer(BaseStreamer):
    """Timestamps each step's tokens for every row of a batch (the first ``put`` is the prompt)."""

    def __init__(self, timings: list[RequestTiming]) -> None:
        self.timings = timings
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        now = time.perf_counter()
        for t in self.timings:
            t.on_tokens(t.num_tokens + 1, now)

    def end(self) -> None:
        pass


def run_hf(model: OuroForCausalLM, spec: BenchSpec, workload: Workload, device: torch.device,
           dtype: torch.dtype, progress: ProgressFn | None = None) -> dict[str, Any]:
    """One measured run of the baseline (after a one-batch warm-up); the record has the engine's fields."""
    hf = OuroHFForCausalLM.from_ouro(model).eval()
    # NOTE: generate() fills every None field of the GenerationConfig it is given from the
    # model's own, so eos must be cleared there too, or a row stops early at eos (ignore_eos).
    hf.generation_config.eos_token_id = None
    timer = DeviceTimer(device, spec.gpu_timing)
    measuring, calls = [False], [0]  # the hooks count and time forwards of the measured part only

    def pre_hook(*_: Any) -> None:
        if measuring[0]:
            calls[0] += 1
            timer.before_step()

    def post_hook(*_: Any) -> None:
        if measuring[0]:
            timer.after_step()

    hooks = [hf.register_forward_pre_hook(pre_hook), hf.register_forward_hook(post_hook)]
    batch = spec.concurrency

    def generate(prompts: list[list[int]], new_tokens: int, timings: list[RequestTiming] | None) -> None:
        ids = torch.tensor(prompts, dtype=torch.long, device=device)
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  use_cache=True)
        streamer = _TimingStreamer(timings) if timings is not None else None
        hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=streamer)

    try:
        warm = workload.head(spec.num_warmup, min(spec.warmup_output_len, workload.output_len))
        for start in range(0, warm.num_prompts, batch):
            generate(warm.prompts[start:start + batch], warm.output_len, None)
        measuring[0] = True
        timings: list[RequestTiming] = []
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timer.start()
        t0 = time.perf_counter()
        for start in range(0, workload.num_prompts, batch):
            prompts = workload.prompts[start:start + batch]
            submitted = time.perf_counter()
            group = [RequestTiming(submit=submitted) for _ in prompts]
            generate(prompts, workload.output_len, group)
            timings += group
            if progress is not None:
                progress(len(group))
        timer.stop()
        duration = time.perf_counter() - t0
    finally:
        measuring[0] = False
        for h in hooks:
            h.remove()

    cfg = model.config
    R = cfg.total_ut_steps
    bytes_model = ByteModel.for_config(cfg, dtype)
    kv = sum(bytes_model.kv_read(len(p), [R] * t.num_tokens, R) for p, t in zip(workload.prompts, timings))
    forwards = calls[0]
    num_batches = -(-workload.num_prompts // batch)
    return {
        "variant": "hf",
        "engine": {"kind": "transformers generate()", "batch_size": batch, "exit_mode": "fixed", "dtype": str(dtype).removeprefix("torch.")},
        **latency_metrics(timings, duration, workload.input_tokens),
        "mean_loops_per_token": float(R),
        "exit_depth_counts": {str(R): sum(t.num_tokens for t in timings)},
        # One generate() forward runs all R loops over the batch; count it as R steps of one loop each.
        "steps": forwards * R,
        "rows_per_step": workload.num_prompts / num_batches,
        "tokens_per_step": None,
        "mean_step_time_ms": duration / (forwards * R) * 1e3 if forwards else None,
        "head_steps": forwards,
        **device_fields(timer, duration),
        **bandwidth_fields(bytes_model.bytes_read(forwards * R, forwards, kv), duration, device),
    }
