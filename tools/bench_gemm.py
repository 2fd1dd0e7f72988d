"""Decode-sized projections on the GPU: which GEMM implementation reads the weights fastest.

python3 tools/bench_gemm.py [--rows 1,32,64,128] [--sweep]
Ouro-1.4B's four projection shapes in bf16 at a few token-row counts M. Variants: cuBLAS through
F.linear (torch's default), the same with torch's cuBLASLt backend preferred, x @ W^T with W^T stored
[K, N] (a different cuBLAS layout and kernel family), and --sweep a split-K Triton kernel over a grid
of tile shapes. Each time is a CUDA-graph replay of many calls divided by their number (no launch
cost), cycling over enough weight copies that none is served from L2, as in a decode step where a
layer's weights were last read a whole model ago. GB/s counts weight bytes only.
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
from typing import Callable, NamedTuple

import torch

F = torch.nn.functional
SHAPES = {"qkv": (2048, 6144), "o_proj": (2048, 2048), "gate_up": (2048, 11264), "down": (5632, 2048)}  # (K, N)
L2_FLUSH_BYTES = 512 << 20

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_os, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[split] = x[:, ks] @ W[ns, ks]^T over one K range; every x row lives in the program.
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
        rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)
        offs_k = pid_k.to(tl.int64) * k_per_split + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(0, k_per_split, BLOCK_K):
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs)
            acc = tl.dot(w, tl.trans(x), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        ptrs = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))

    @triton.jit
    def _reduce_kernel(ws_ptr, y_ptr, N, stride_ws, stride_wm, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(ws_ptr + s * stride_ws + m * stride_wm + cols, mask=mask, other=0.0)
        tl.store(y_ptr + m * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)
except ImportError:  # pragma: no cover
    triton = None


class TileConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg: TileConfig) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    assert k % (cfg.split_k * cfg.block_k) == 0, (k, cfg)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if cfg.split_k == 1:
        out, s_os, s_om = y, 0, y.stride(0)
    else:
        out = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        s_os, s_om = out.stride(0), out.stride(1)
    _gemm_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, w, out, m, n, k, k // cfg.split_k, x.stride(0), w.stride(0), s_os, s_om,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        _reduce_kernel[(m, triton.cdiv(n, 1024))](out, y, n, out.stride(0), out.stride(1), y.stride(0),
                                                  SPLIT_K=cfg.split_k, BLOCK=1024)
    return y


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


def tile_grid(k: int) -> list[TileConfig]:
    out = []
    for (bn, w), s, st in itertools.product(((64, 4), (128, 8)), (1, 2, 4, 8), (3, 5)):
        if k % (s * 128) == 0 and k // (s * 128) >= 2:
            out.append(TileConfig(bn, 128, s, w, st))
    return out


def compare_swiglu(rows: list[int]) -> None:
    """The MLP's tail at decode, as the engine runs it: silu_mul, then down_proj by cuBLAS or the skinny kernel."""
    from loopline.kernels.fused import TritonOps
    from loopline.kernels.skinny_gemm import skinny_linear

    k, n = SHAPES["down"]
    weights, ops = weight_copies(k, n), TritonOps()
    gb = k * n * 2 / 1e9
    print("down_proj(silu_mul(gate, up)): cuBLAS vs skinny_linear (us per call incl. silu_mul, GB/s of weight)")
    for m in rows:
        gate, up = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16).split([k, k], dim=-1)
        base = time_per_call(lambda x, w: F.linear(ops.silu_mul(gate, up), w), gate, weights)
        fast = time_per_call(lambda x, w: skinny_linear(ops.silu_mul(gate, up), w), gate, weights)
        act = ops.silu_mul(gate, up)
        err = (skinny_linear(act, weights[0]).float() - F.linear(act, weights[0]).float()).abs().max().item()
        print(f"  M={m:<3} cuBLAS {base:6.2f} us ({gb / base * 1e6:4.0f})  skinny {fast:6.2f} us "
              f"({gb / fast * 1e6:4.0f})  {base / fast:4.2f}x  max|diff| {err:.1e}", flush=True)
    del weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,32,64,128")
    p.add_argument("--sweep", action="store_true", help="also time the Triton split-K kernel over a grid of tiles")
    p.add_argument("--swiglu", action="store_true", help="only compare the MLP tail (silu_mul + down_proj by cuBLAS or skinny_linear)")
    a = p.parse_args()
    warm = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):  # lift the clocks before the first timing
        warm @ warm
    del warm
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, us per call in CUDA graphs (GB/s)")
    if a.swiglu:
        return compare_swiglu([1, 4, 8, 16, 32, 64])
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
            if a.sweep and triton is not None and 16 < m <= 64:
                for cfg in tile_grid(k):
                    try:
                        got = triton_linear(x, weights[0], cfg).float()
                        if (got - ref).abs().max().item() > 0.05:
                            print(f"  WRONG {name} M={m} {cfg}")
                            continue
                        best.append((time_per_call(lambda x, w, c=cfg: triton_linear(x, w, c), x, weights), cfg))
                    except Exception as e:  # noqa: BLE001 - e.g. shared memory over the limit
                        print(f"  skip {cfg}: {type(e).__name__}")
                best.sort(key=lambda r: r[0])
                if best:
                    res["triton"] = best[0][0]
            line = "  ".join(f"{v}: {t:6.2f} us ({gb / t * 1e6:4.0f})" for v, t in res.items())
            print(f"{name:>8} M={m:<3} {line}", flush=True)
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
