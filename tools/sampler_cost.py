"""Time one call of the engine's sampler on random logits (host and device together).

python tools/sampler_cost.py [--rows 1,8] [--vocab 4096] [--params JSON] [--device cpu|cuda] [--calls 300]

``--params``: the rows' sampling fields as JSON (``temperature``, ``top_p``, ``top_k``, ``min_p``; ``"select": false``
hides the rows' largest top_k, so that top-k sorts whole rows), every row alike; rows are seeded by their index. On CUDA the time includes a synchronize after the calls (the device's share).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from loopline.worker.sampler import SAMPLING_EPS, Sampler, SamplingTensors


def tensors(rows: int, device: str, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
            min_p: float = 0.0, select: bool = True) -> SamplingTensors:
    """The rows' tensors as the engine builds them (``select``: the largest top_k known, as the engine's are)."""
    def col(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=device)

    return SamplingTensors(
        temperature=col(temperature, torch.float32), top_k=col(top_k, torch.int64), top_p=col(top_p, torch.float32),
        min_p=col(min_p, torch.float32), presence_penalty=col(0.0, torch.float32),
        frequency_penalty=col(0.0, torch.float32), repetition_penalty=col(1.0, torch.float32),
        seeds=torch.arange(rows, device=device), token_index=torch.arange(rows, device=device),
        output_counts=None, seen_mask=None, all_greedy=temperature < SAMPLING_EPS, any_penalties=False,
        any_top_k=top_k > 0, any_top_p=top_p < 1.0, any_min_p=min_p > 0.0, max_num_logprobs=None,
        max_top_k=max(top_k, 0) if select else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--params", default='{"temperature": 1.0}', help="sampling fields as JSON")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    params = json.loads(a.params)
    sampler = Sampler()
    for rows in (int(r) for r in a.rows.split(",")):
        x = torch.randn(rows, a.vocab, device=a.device)
        t = tensors(rows, a.device, **params)
        for _ in range(20):
            sampler(x, t)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            sampler(x, t)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / a.calls * 1e3
        print(f"rows={rows} vocab={a.vocab} device={a.device} params={a.params}: {ms:.3f} ms a call")


if __name__ == "__main__":
    main()
