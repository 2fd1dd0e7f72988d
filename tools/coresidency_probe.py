"""Can decode attention share SMs with a prompt GEMM that leaves it room? (GPU)

python3 tools/coresidency_probe.py [--tokens 4096,8192] [--reps 20]

Two streams did not overlap the decode attention with cuBLAS's prompt GEMMs (seventh session): cuBLAS's
Hopper kernels take an SM's whole shared memory and register file, so no attention block fits beside
them, and the blocks of the two kernels take turns. A GEMM with a smaller footprint leaves room.
Examples are a Triton tile of 128 x 128 with two or three stages, or the decode kernels of
``tools/decode_kernel_probe.py`` (114-119 registers, 0-1 KB of shared memory per program). The attention
could then stream K/V on every SM while the tensor cores multiply. This times, with CUDA events:

* one prompt GEMM of Ouro-1.4B's gate/up projection (``--tokens`` x 2,048 @ 2,048 x 11,264, bf16), by
  cuBLAS and by Triton tiles of several footprints, one program per tile or persistent at 1-2 programs per
  SM (so that the grid, not the hardware, caps what an SM holds), alone;
* the decode attention of 128 rows x 1,024 keys (the engine's launch, and the ``lanes`` and ``warp``
  kernels), repeated to last about as long as the GEMM, alone;
* both at once, the attention on a high-priority stream,

and prints how much of the shorter one the concurrent run hid.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from decode_kernel_probe import launch  # noqa: E402
from overlap_probe import HIDDEN, INTER, decode_case, decode_kv_gb, fork, timed  # noqa: E402

from loopline.attention.triton_backend import TritonAttentionBackend  # noqa: E402

GATE_UP = 2 * INTER


@triton.jit
def matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, num_programs,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """``out = x @ w.T`` for row-major x ``[M, K]``, w ``[N, K]``. Persistent: ``num_programs`` programs walk
    the output tiles (grouped along M for L2 reuse of w), so the grid caps how many share an SM."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in range(tl.program_id(0), tiles_m * tiles_n, num_programs):
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * tiles_n)) % rows_in_group
        pid_n = (tile % (GROUP_M * tiles_n)) // rows_in_group
        offs_m = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        offs_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        offs_k = tl.arange(0, BK)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]: w read K-major
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for _ in range(0, K, BK):  # K is a multiple of BK here
            acc = tl.dot(tl.load(x_ptrs, mask=(offs_m < M)[:, None], other=0.0),
                         tl.load(w_ptrs, mask=(offs_n < N)[None, :], other=0.0), acc)
            x_ptrs += BK
            w_ptrs += BK
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def triton_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bm: int, bn: int, bk: int, stages: int,
                  warps: int, per_sm: int) -> None:
    """One launch of ``matmul_kernel`` with ``per_sm`` programs per SM (0: one program per tile)."""
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    programs = tiles if per_sm == 0 else min(tiles, per_sm * sms)
    matmul_kernel[(programs,)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), programs,
                               BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


# (BM, BN, BK, stages, warps, programs per SM; 0: one per tile)
GEMMS = [(128, 256, 64, 3, 8, 0), (128, 256, 64, 3, 8, 1), (128, 128, 64, 3, 8, 0), (128, 128, 64, 3, 8, 1),
         (128, 128, 64, 4, 8, 1), (128, 128, 64, 2, 8, 1), (128, 128, 64, 4, 4, 1), (64, 128, 64, 3, 4, 2)]
ATTENTIONS = ["engine", ("lanes", (1, 1, 2, 0)), ("warp", (1, 1, 0, 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=lambda v: [int(n) for n in v.split(",")], default=[4096, 8192])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    bf16 = torch.bfloat16
    w = torch.randn(GATE_UP, HIDDEN, device="cuda", dtype=bf16) * 0.02
    cases = [decode_case(128, 1024) for _ in range(4)]  # cycled past L2
    backend = TritonAttentionBackend()
    scale = 128 ** -0.5
    out_attn = torch.empty_like(cases[0][0])
    kv_gb = decode_kv_gb(128, 1024)
    hi = torch.cuda.Stream(priority=-1)

    def attention(kind, times: int):
        def run() -> None:
            for i in range(times):
                q, k, v, meta = cases[i % len(cases)]
                if kind == "engine":
                    backend.attend(q, k, v, meta, scale)
                else:
                    launch(kind[0], kind[1], q, k, v, meta, scale, out_attn)
        return run

    for tokens in a.tokens:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=bf16)
        out = torch.empty(tokens, GATE_UP, device="cuda", dtype=bf16)
        ref = torch.nn.functional.linear(x, w)
        flop = 2 * tokens * HIDDEN * GATE_UP / 1e12
        gemms = [("cuBLAS", lambda: torch.nn.functional.linear(x, w, out=out))]
        for cfg in GEMMS:
            fn = (lambda cfg=cfg: triton_linear(x, w, out, *cfg))
            fn()
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)  # a correct GEMM is timed, not garbage
            per = f"{cfg[5]} per SM" if cfg[5] else "one per tile"
            gemms.append((f"Triton {cfg[0]}x{cfg[1]}x{cfg[2]}, {cfg[3]} stages, {cfg[4]} warps, {per}", fn))
        t_one = timed(attention("engine", 1), a.reps)
        times = max(1, round(timed(gemms[0][1], a.reps) / t_one))
        for name, gemm in gemms:
            t_gemm = timed(gemm, a.reps)
            parts = []
            for kind in ATTENTIONS:
                attend = attention(kind, times)
                t_attn = timed(attend, a.reps)
                t_both = timed(lambda: fork(hi, attend, gemm), a.reps)
                hidden = t_gemm + t_attn - t_both
                label = kind if kind == "engine" else f"{kind[0]}{kind[1][:3]}"
                parts.append(f"{label} {t_attn:.3f} ms ({times * kv_gb / t_attn:.2f} TB/s) both {t_both:.3f}: "
                             f"hid {hidden / min(t_gemm, t_attn):.0%}")
            print(f"{tokens} tokens, {name}: {t_gemm:.3f} ms ({flop / t_gemm * 1e3:.0f} TFLOP/s); "
                  + "; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
