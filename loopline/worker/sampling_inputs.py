"""What the sampler needs from the host, and what it gives back to the host.

:func:`build_sampling_tensors` turns the sampled rows' requests into
``SamplingTensors``; :class:`SampleBatch` holds a step's sampled rows on the
device and reads them back, at once (sync) or through pinned buffers later
(async scheduling).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from loopline.worker.sampler import SamplerOutput, SamplingTensors
from loopline.worker.staging import stage


@dataclass
class SampleBatch:
    """A step's sampled rows on the device, and their reading back to the host."""

    row_idx: list[int]  # step row of each sampled row
    states: list[Any]  # their request states
    out: SamplerOutput
    exit_flags: Tensor  # [M] bool: the token exited (decode) / the prompt finished
    depth: Tensor  # [M] exit depth

    def _tensors(self) -> dict[str, Tensor | None]:
        o = self.out
        return {"exit": self.exit_flags, "depth": self.depth, "ids": o.token_ids, "lps": o.logprobs, "ranks": o.ranks,
                "top_ids": o.top_ids, "top_lps": o.top_logprobs}

    def to_host(self) -> dict:
        """Reads everything back now (one sync)."""
        if self.exit_flags.device.type == "cuda":
            return self.to_host_async()()
        return {k: t.tolist() if t is not None else None for k, t in self._tensors().items()}

    def to_host_async(self) -> Callable[[], dict]:
        """Starts non-blocking copies to pinned memory; the returned call waits for them."""
        tensors = self._tensors()
        if self.exit_flags.device.type != "cuda":
            host = {k: t.tolist() if t is not None else None for k, t in tensors.items()}
            return lambda: host
        pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if t is not None else None
                  for k, t in tensors.items()}
        for k, t in tensors.items():
            if t is not None:
                pinned[k].copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> dict:
            done.synchronize()
            return {k: t.tolist() if t is not None else None for k, t in pinned.items()}

        return wait


def has_penalties(p) -> bool:
    """Whether sampling params ``p`` use the presence, frequency or repetition penalty."""
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0


def build_sampling_tensors(states: list, token_index: list[int], vocab: int, default_mode: str,
                           device: torch.device, host_penalties: bool = True) -> SamplingTensors:
    """Per-row sampling parameters of the rows sampled this step (``states``: request states).

    Penalties need each row's prompt and generated tokens (``state.prompt``, ``state.output_ids``);
    with ``host_penalties=False`` the caller supplies ``output_counts`` / ``seen_mask`` itself.
    """
    dev = device
    ps = [s.params for s in states]
    f32, i64 = np.float32, np.int64
    (temperature, top_p, min_p, presence, frequency, repetition, top_k, seeds, index) = stage(
        dev, ([p.temperature for p in ps], f32), ([p.top_p for p in ps], f32), ([p.min_p for p in ps], f32),
        ([p.presence_penalty for p in ps], f32), ([p.frequency_penalty for p in ps], f32),
        ([p.repetition_penalty for p in ps], f32), ([max(p.top_k, 0) for p in ps], i64),
        ([s.seed for s in states], i64), (token_index, i64))
    any_pen = any(has_penalties(p) for p in ps)
    counts = seen = None
    if any_pen and host_penalties:
        counts = torch.zeros(len(ps), vocab, dtype=torch.float32, device=dev)
        seen = torch.zeros(len(ps), vocab, dtype=torch.bool, device=dev)
        for j, s in enumerate(states):
            if s.output_ids:
                ids = stage(dev, (s.output_ids, i64))[0]
                counts[j].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
                seen[j, ids] = True
            seen[j, s.prompt] = True
    want = [p.logprobs for p in ps if p.logprobs is not None]
    # Per-request logprobs modes (None: the sampler's): one mode for the batch when the rows that
    # want logprobs agree; a per-row tensor (both distributions computed) only when they differ.
    modes = {p.logprobs_mode or default_mode for p in ps if p.logprobs is not None}
    processed_rows = None
    if len(modes) > 1:
        processed_rows = stage(dev, ([(p.logprobs_mode or default_mode) == "processed_logprobs" for p in ps],
                                     np.bool_))[0]
    return SamplingTensors(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition, seeds=seeds, token_index=index,
        output_counts=counts, seen_mask=seen,
        all_greedy=all(p.greedy for p in ps), any_penalties=any_pen,
        any_top_k=any(p.top_k > 0 for p in ps), any_top_p=any(p.top_p < 1.0 for p in ps),
        any_min_p=any(p.min_p > 0 for p in ps),
        max_num_logprobs=max(want) if want else None,
        logprobs_mode=modes.pop() if len(modes) == 1 else None, processed_rows=processed_rows,
    )
