"""Prefill attention of a few prompts: every launch of the work-list kernel, in two work-list orders.

python3 tools/prefill_sweep.py [LENS]      e.g. 1024 (the C = 1 bench's one prompt) or 1024,1024,512

Each prompt attends to itself only (no history), 16 heads = 16 KV heads x 128 (Ouro-1.4B), bf16. Every
``PrefillLaunch`` (BLOCK_M 16-128, BLOCK_N 32-128, 4/8 warps, 2/3 stages) with the work list in the
engine's order (``asc``: each prompt's query tiles first to last) and reversed (``desc``: the longest
causal tiles first). Times are CUDA-graph replays over >= 64 MB of pools (as a model's layers), per call;
``err`` is the largest difference to the default launch (0 where the tiles add in the same order).
"""
from __future__ import annotations

import itertools
import sys

import torch

from loopline.attention.bench_attention import HEAD_DIM, graph_time_us, layer_steps, step_flops, with_work
from loopline.attention.triton_backend import PrefillLaunch, TritonAttentionBackend


def main() -> None:
    torch.manual_seed(0)
    scale = HEAD_DIM**-0.5
    rows = [(int(a), int(a)) for a in (sys.argv[1] if len(sys.argv) > 1 else "1024").split(",")]
    steps = layer_steps(rows, 64 * 2**20)
    tflop = step_flops(rows) / 1e12
    launches = [None] + [PrefillLaunch(bm, bn, w, st) for bm, bn, w, st in itertools.product(
        (32, 64, 128), (32, 64, 128), (4, 8), (2, 3))] + [PrefillLaunch(16, bn, 4, 2) for bn in (32, 64)]
    ref, results = None, []
    for launch in launches:
        be = TritonAttentionBackend(prefill_launch=launch)
        for order in ("asc", "desc"):
            metas = [with_work(s[3], rows, be, reverse=order == "desc") for s in steps]
            try:
                got = be.attend(steps[0][0], steps[0][1], steps[0][2], metas[0], scale)
                ref = got if ref is None else ref
                err = (got.float() - ref.float()).abs().max().item()
                fns = [lambda s=s, m=m: be.attend(s[0], s[1], s[2], m, scale) for s, m in zip(steps, metas)]
                ms = graph_time_us(fns) / 1e3
            except Exception as e:  # e.g. out of shared memory for the largest tiles
                print(f"skip {launch} {order}: {type(e).__name__}", flush=True)
                break
            results.append((ms, launch, order, err))
    print(f"# prompts {rows}: default {results[0][0]:.4f} ms ({tflop / (results[0][0] * 1e-3):.0f} TFLOP/s) "
          f"order asc; desc {results[1][0]:.4f}")
    for ms, launch, order, err in sorted(results, key=lambda r: r[0])[:14]:
        print(f"  {ms:.4f} ms {tflop / (ms * 1e-3):5.0f} TFLOP/s err {err:.1e} {order} {launch}")


if __name__ == "__main__":
    main()
