"""Decode-sized projections on the GPU: which GEMM implementation reads the weights fastest.

python3 tools/bench_gemm.py [--rows 1,32,64,128] [--sweep [--pdl] | --swiglu | --gemv]
Ouro-1.4B's four projection shapes in bf16 at a few token-row counts M. Variants: cuBLAS through
F.linear (torch's default), the same with torch's cuBLASLt backend preferred, x @ W^T with W^T stored
[K, N] (a different cuBLAS layout and kernel family), and --sweep loopline's split-K Triton kernel
(loopline.kernels.skinny_gemm) at M = 2..128: its launch rule (``skinny``, M <= 64) and the best of a grid
of tile shapes (``triton``; at M <= 16 also 32-row tiles). --rows 2,4,8,16 checks the rule at the batches
whose projections the engine may give the kernel (``loopline.kernels.fused.SKINNY_MAX_ROWS``, per projection).
Each time is a CUDA-graph replay of many calls divided by their number (no launch
cost), cycling over enough weight copies that none is served from L2, as in a decode step where a
layer's weights were last read a whole model ago. GB/s counts weight bytes only.

The skinny kernel is timed without programmatic dependent launch (LOOPLINE_PDL=0), like cuBLAS, which
has none; --pdl adds the rule launched with PDL (``skinny_pdl``), where each call in the graph starts
streaming its first weight tile while the call before it still runs. A step chains other kernels
between the projections, so tools/profile_step.py (--skinny-max-rows) is the measure of the route.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import statistics
from typing import Callable, Iterator

import torch

from loopline.kernels.gemv import GemvConfig, gemv
from loopline.kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, skinny_config, skinny_linear

F = torch.nn.functional
SHAPES = {"qkv": (2048, 6144), "o_proj": (2048, 2048), "gate_up": (2048, 11264), "down": (5632, 2048)}  # (K, N)
L2_FLUSH_BYTES = 512 << 20

def weight_copies(k: int, n: int) -> list[torch.Tensor]:
    size = k * n * 2
    first = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
    return [first] + [first.clone() for _ in range(max(1, math.ceil(L2_FLUSH_BYTES / size)) - 1)]


def time_per_call(fn: Callable, x: torch.Tensor, weights: list[torch.Tensor], replays: int = 9) -> float:
    """Microseconds per call of fn(x, w), from graph replays cycling over weights."""
    calls = max(48, len(weights))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x, weights[0])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(x, weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def cublaslt_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library(prev)


@contextlib.contextmanager
def pdl(on: bool) -> Iterator[None]:
    """Kernels launched inside (captured into a graph) take programmatic dependent launch or not:
    ``loopline.kernels.pdl_options`` reads LOOPLINE_PDL at every launch."""
    before = os.environ.get("LOOPLINE_PDL")
    os.environ["LOOPLINE_PDL"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LOOPLINE_PDL"]
        else:
            os.environ["LOOPLINE_PDL"] = before


def tile_grid(k: int, m: int = 64) -> list[SkinnyConfig]:
    """Tiles to sweep; above 64 rows also 64-column steps (a 128-row operand fills shared memory sooner); at 16
    rows or fewer also 32-row tiles (twice the programs: q/k/v's 6,144 rows give 192 instead of 96)."""
    out = []
    steps = ((128, (3, 5)),) if m <= 64 else ((128, (2, 3)), (64, (3, 4, 6)))
    blocks = ((32, 4), (64, 4), (128, 8)) if m <= 16 else ((64, 4), (128, 8))
    for (bn, w), s, (bk, stages) in itertools.product(blocks, (1, 2, 3, 4, 8), steps):
        for st in stages:
            if k % (s * bk) == 0 and k // (s * bk) >= 2:
                out.append(SkinnyConfig(bn, bk, s, w, st))
    return out


def compare_swiglu(rows: list[int]) -> None:
    """The MLP's tail at decode, as the engine runs it: silu_mul, then down_proj by cuBLAS or the skinny kernel."""
    from loopline.kernels.fused import TritonOps

    k, n = SHAPES["down"]
    weights, ops = weight_copies(k, n), TritonOps()
    gb = k * n * 2 / 1e9
    print("down_proj(silu_mul(gate, up)): cuBLAS vs skinny_linear (us per call incl. silu_mul, GB/s of weight)")
    for m in rows:
        gate, up = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16).split([k, k], dim=-1)
        base = time_per_call(lambda x, w: F.linear(ops.silu_mul(gate, up), w), gate, weights)
        with pdl(False):  # as measured before the kernel had PDL (silu_mul has none)
            fast = time_per_call(lambda x, w: skinny_linear(ops.silu_mul(gate, up), w), gate, weights)
        act = ops.silu_mul(gate, up)
        err = (skinny_linear(act, weights[0]).float() - F.linear(act, weights[0]).float()).abs().max().item()
        print(f"  M={m:<3} cuBLAS {base:6.2f} us ({gb / base * 1e6:4.0f})  skinny {fast:6.2f} us "
              f"({gb / fast * 1e6:4.0f})  {base / fast:4.2f}x  max|diff| {err:.1e}", flush=True)
    del weights


def gemv_grid() -> list[GemvConfig]:
    tiles = ((4, 512), (4, 1024), (8, 256), (8, 512), (8, 1024), (16, 256), (16, 512))
    return [GemvConfig(bn, bk, 8 if bn * bk >= 8192 else 4, 3) for bn, bk in tiles]


def compare_gemv() -> None:
    """One row: cuBLAS vs loopline's GEMV over a grid of launches, and the MLP tail with the fused activation."""
    from loopline.kernels.fused import TritonOps

    ops = TritonOps()
    print("one row: cuBLAS vs gemv (us per call, GB/s of weight); top 3 launches per shape")
    for name, (k, n) in SHAPES.items():
        weights, gb = weight_copies(k, n), k * n * 2 / 1e9
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        ref = F.linear(x, weights[0]).float()
        base = time_per_call(F.linear, x, weights)
        rows = []
        for cfg in gemv_grid():
            if (gemv(x, weights[0], config=cfg).float() - ref).abs().max().item() > 0.05:
                print(f"  WRONG {name} {cfg}")
                continue
            rows.append((time_per_call(lambda x, w, c=cfg: gemv(x, w, config=c), x, weights), cfg))
        rows.sort(key=lambda r: r[0])
        rule = time_per_call(gemv, x, weights)
        print(f"{name:>8} cuBLAS {base:6.2f} us ({gb / base * 1e6:4.0f})  gemv default {rule:6.2f} us "
              f"({gb / rule * 1e6:4.0f}) {base / rule:4.2f}x  best {rows[0][0]:6.2f} us ({gb / rows[0][0] * 1e6:4.0f})",
              flush=True)
        for t, cfg in rows[:3]:
            print(f"           {t:6.2f} us ({gb / t * 1e6:4.0f})  {cfg}")
        if name == "down":  # the MLP tail: silu_mul + cuBLAS vs the activation computed on load
            gate, up = torch.randn(1, 2 * k, device="cuda").to(torch.bfloat16).split([k, k], dim=-1)
            two = time_per_call(lambda x, w: F.linear(ops.silu_mul(gate, up), w), gate, weights)
            one = time_per_call(lambda x, w: gemv(gate, w, up=up), gate, weights)
            print(f"    silu_mul + cuBLAS {two:6.2f} us   gemv(up=) {one:6.2f} us   {two / one:4.2f}x")
        del weights
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,32,64,128")
    p.add_argument("--sweep", action="store_true",
                   help="also time the Triton split-K kernel at M >= 2: its launch rule and a grid of tiles")
    p.add_argument("--pdl", action="store_true", help="with --sweep: also time the rule launched with PDL")
    p.add_argument("--gemv", action="store_true", help="only compare one-row products: cuBLAS vs gemv and its prologues")
    p.add_argument("--swiglu", action="store_true", help="only compare the MLP tail (silu_mul + down_proj by cuBLAS or skinny_linear)")
    a = p.parse_args()
    warm = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):  # lift the clocks before the first timing
        warm @ warm
    del warm
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, us per call in CUDA graphs (GB/s)")
    if a.swiglu:
        return compare_swiglu([1, 4, 8, 16, 32, 64])
    if a.gemv:
        return compare_gemv()
    total = {}
    for name, (k, n) in SHAPES.items():
        weights = weight_copies(k, n)
        transposed = [w.t().contiguous() for w in weights]
        gb = k * n * 2 / 1e9
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = F.linear(x, weights[0]).float()
            res = {"cublas": time_per_call(F.linear, x, weights),
                   "cublaslt": time_per_call(cublaslt_linear, x, weights)}
            res["nn"] = time_per_call(lambda x, wt: x @ wt, x, transposed)
            best = []
            if a.sweep and 1 < m <= 128:
                with pdl(False):
                    if m <= MAX_ROWS:  # the launch rule, as the engine calls it
                        if (skinny_linear(x, weights[0]).float() - ref).abs().max().item() > 0.05:
                            print(f"  WRONG {name} M={m} rule")
                        res["skinny"] = time_per_call(skinny_linear, x, weights)
                    for cfg in tile_grid(k, m):
                        try:
                            got = skinny_linear(x, weights[0], cfg).float()
                            if (got - ref).abs().max().item() > 0.05:
                                print(f"  WRONG {name} M={m} {cfg}")
                                continue
                            best.append((time_per_call(lambda x, w, c=cfg: skinny_linear(x, w, c), x, weights),
                                         cfg))
                        except Exception as e:  # noqa: BLE001 - e.g. shared memory over the limit
                            print(f"  skip {cfg}: {type(e).__name__}")
                if a.pdl and m <= MAX_ROWS:
                    with pdl(True):
                        res["skinny_pdl"] = time_per_call(skinny_linear, x, weights)
                best.sort(key=lambda r: r[0])
                if best:
                    res["triton"] = best[0][0]
            line = "  ".join(f"{v}: {t:6.2f} us ({gb / t * 1e6:4.0f})" for v, t in res.items())
            print(f"{name:>8} M={m:<3} {line}", flush=True)
            if "skinny" in res:
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                print(f"           skinny rule: {skinny_config(n, k, sms)}")
            for t, cfg in best[:3]:
                print(f"           triton {t:6.2f} us ({gb / t * 1e6:4.0f})  {cfg}")
            for v, t in res.items():
                total[(v, m)] = total.get((v, m), 0.0) + t
        del weights, transposed
        torch.cuda.empty_cache()
    print("per layer (sum of the four shapes), us:")
    for (v, m), t in sorted(total.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"  M={m:<3} {v:>8}: {t:7.2f}")


if __name__ == "__main__":
    main()
