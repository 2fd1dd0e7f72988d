"""Can decode attention (memory-bound) hide under prefill GEMMs (compute-bound) on two streams? (GPU)

python3 tools/overlap_probe.py [--rows 128] [--context 1024] [--tokens 8192] [--reps 20] [--pair gemm|prefill]
                               [--partition 16,32,48 | --stream-read 16,32,66,132] [--decode-launch 64,4,2]
                               [--blas cublas|cublaslt]

A C = 128 run spends its time in two kinds of work that use different limits of the chip: prompt
GEMMs (tensor cores) and decode attention over 1K-token histories (HBM). Run one after the other, as
one forward does, their times add. This times, with CUDA events and Ouro-1.4B shapes:

* the four projection GEMMs of one layer for ``--tokens`` prompt tokens, alone;
* one decode attention launch of ``--rows`` rows over ``--context`` keys (the engine's kernel), alone;
* both issued in one stream (their sum), and
* both issued on two streams (attention on a high-priority stream), with the same work.

and prints how much of the shorter one the concurrent run hid. ``--pair prefill`` pairs the decode
launch with the prefill attention of ``--tokens // 1024`` prompts of 1,024 tokens instead (the two
attention launches of a C = 128 mixed step). It decides whether a two-stream mixed step (decode rows
beside prompt chunks) can beat the serial bound; nothing in the engine uses two streams yet.

``--partition N,...`` splits the chip instead of sharing it: the decode attention runs on a stream of a
CUDA green context of N SMs, and cuBLAS leaves N SMs out of its GEMMs (``torch._C._set_sm_carveout_experimental``),
so neither waits for the other's blocks to drain. It prints the attention's bandwidth on N SMs, the GEMMs'
time on the rest, and the two together against the serial time on the whole chip.

``--stream-read N,...`` asks what such a split could give at best: the read bandwidth of a plain streaming
kernel (each program sums its own contiguous slice of 4 GB) on green contexts of N SMs, at a few
programs per SM and load widths. If memory-bound work needs the whole chip to reach HBM bandwidth, no split
of the SMs can hide it under compute-bound work.
"""
from __future__ import annotations

import argparse

import torch

from loopline.attention.base import PagedAttentionMetadata
from loopline.attention.bench_attention import make_step, step_flops, with_work
from loopline.attention.triton_backend import DecodeLaunch, TritonAttentionBackend


HIDDEN, INTER = 2048, 5632  # Ouro-1.4B


def layer_weights() -> list[torch.Tensor]:
    """One layer's projection weights of Ouro-1.4B (qkv, o, gate/up, down), random bf16 on the GPU."""
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for n, k in ((3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))]


def decode_kv_gb(rows: int, context: int, heads: int = 16, head_dim: int = 128) -> float:
    """GB of bf16 K and V that one launch over ``decode_case(rows, context)`` reads."""
    return rows * context * heads * head_dim * 2 * 2 / 1e9


def decode_case(rows: int, context: int, heads: int = 16, head_dim: int = 128, block_size: int = 16):
    """Random bf16 paged K/V (distinct pages per row, shuffled) and one query per row."""
    pages = -(-context // block_size)
    num_blocks = rows * pages + 1
    perm = torch.randperm(num_blocks - 1, device="cuda").to(torch.int32)
    k_cache = torch.randn(num_blocks, block_size, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    meta = PagedAttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((rows,), context, dtype=torch.int32, device="cuda"),
        block_tables=perm.view(rows, pages),
        slot_mapping=torch.zeros(rows, dtype=torch.int64, device="cuda"),
        max_query_len=1, max_seq_len=context)
    q = torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    return q, k_cache, v_cache, meta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pair", choices=("gemm", "prefill"), default="gemm")
    ap.add_argument("--partition", type=lambda v: [int(n) for n in v.split(",")], default=None,
                    help="SM counts for the decode attention's green context, e.g. 16,32,48")
    ap.add_argument("--stream-read", type=lambda v: [int(n) for n in v.split(",")], default=None,
                    help="SM counts for the streaming-read ceiling, e.g. 16,32,66,132")
    ap.add_argument("--decode-launch", type=lambda v: [int(n) for n in v.split(",")], default=None,
                    help="the decode attention's BLOCK_N,num_warps,num_stages (default: the engine's)")
    ap.add_argument("--blas", choices=("cublas", "cublaslt"), default=None, help="torch's preferred BLAS library")
    a = ap.parse_args()
    if a.stream_read:  # needs none of the cases below
        stream_read(a)
        return
    if a.blas:
        torch.backends.cuda.preferred_blas_library(a.blas)
    x = torch.randn(a.tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights = layer_weights()
    act = torch.randn(a.tokens, INTER, device="cuda", dtype=torch.bfloat16)
    backend = TritonAttentionBackend(decode_launch=DecodeLaunch(*a.decode_launch) if a.decode_launch else None)
    q, k_cache, v_cache, meta = decode_case(a.rows, a.context)
    scale = 128 ** -0.5

    def layer_gemms() -> None:
        for w in weights:
            torch.nn.functional.linear(act if w.shape[1] == INTER else x, w)

    prompts = [(1024, 1024)] * max(1, a.tokens // 1024)
    pq, pk, pv, pmeta = make_step(prompts)
    pmeta = with_work(pmeta, prompts, backend)

    def prefill_attention() -> None:
        backend.attend(pq, pk, pv, pmeta, scale)

    gemms = layer_gemms if a.pair == "gemm" else prefill_attention
    flops = (2 * a.tokens * sum(w.numel() for w in weights) if a.pair == "gemm" else step_flops(prompts)) / 1e12

    def attention() -> None:
        backend.attend(q, k_cache, v_cache, meta, scale)

    hi = torch.cuda.Stream(priority=-1)  # the highest priority
    kv_gb = decode_kv_gb(a.rows, a.context)
    what = "layer GEMMs" if a.pair == "gemm" else "prefill attention"

    def serial() -> None:
        gemms()
        attention()

    def concurrent() -> None:
        fork(hi, attention, gemms)

    if a.partition:
        partition(a, gemms, attention, what, kv_gb)
        return
    for trial in range(2):
        t_gemm, t_attn, t_serial, t_conc = (timed(f, a.reps) for f in (gemms, attention, serial, concurrent))
        hidden_ms = t_serial - t_conc
        print(f"trial {trial}: {what} {t_gemm:.3f} ms ({flops / t_gemm * 1e3:.0f} TFLOP/s), decode attention "
              f"{t_attn:.3f} ms ({kv_gb / t_attn:.2f} TB/s), one stream {t_serial:.3f} ms, two streams {t_conc:.3f} ms: "
              f"hid {hidden_ms:.3f} ms = {hidden_ms / min(t_gemm, t_attn):.0%} of the shorter")


def timed(fn, reps: int) -> float:
    """Milliseconds per call of ``fn()`` by CUDA events, after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def stream_read(a: argparse.Namespace) -> None:
    """The ``--stream-read`` measurement (see the module docstring)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(x_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * n_per_prog
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(0, n_per_prog, BLOCK * UNROLL):
            for u in tl.static_range(UNROLL):
                offs = base + i + u * BLOCK + tl.arange(0, BLOCK)
                acc += tl.load(x_ptr + offs, eviction_policy="evict_first").to(tl.float32)
        tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), acc)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.ones(1 << 31, device="cuda", dtype=torch.bfloat16)  # 4 GiB
    gb = x.numel() * 2 / 1e9
    main_stream = torch.cuda.current_stream()
    for n in a.stream_read:
        stream = main_stream if n >= sms else green_stream(n)
        results = []
        for per_sm, block, unroll, warps in ((1, 4096, 4, 8), (2, 4096, 4, 8), (4, 2048, 4, 4), (8, 2048, 2, 4),
                                             (2, 8192, 2, 8), (4, 4096, 4, 8)):
            programs = n * per_sm
            n_per_prog = x.numel() // programs // (block * unroll) * (block * unroll)
            out = torch.empty(programs * block, device="cuda", dtype=torch.float32)

            def read(p=programs, m=n_per_prog, o=out, b=block, u=unroll, w=warps) -> None:
                read_kernel[(p,)](x, o, m, BLOCK=b, UNROLL=u, num_warps=w)

            ms = timed(lambda: fork(stream, read), a.reps)
            results.append((gb * n_per_prog * programs / x.numel() / ms, per_sm, block, unroll, warps))
        best = max(results)
        print(f"stream read on {n:3d} SMs: best {best[0]:.2f} TB/s ({best[0] / n * 1e3:.0f} GB/s per SM) at "
              f"{best[1]} programs/SM, {best[2]} x {best[3]} elements per step, {best[4]} warps; all: "
              + ", ".join(f"{r[0]:.2f}" for r in results), flush=True)


def fork(side: torch.cuda.Stream, on_side, on_main=None) -> None:
    """Runs ``on_side()`` on ``side`` after the current stream's work, ``on_main()`` meanwhile, then joins."""
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        on_side()
    if on_main is not None:
        on_main()
    main.wait_stream(side)


def green_stream(num_sms: int) -> torch.cuda.Stream:
    """A stream whose kernels run on ``num_sms`` SMs only (a CUDA green context)."""
    from torch.cuda.green_contexts import GreenContext

    try:
        ctx = GreenContext.create(num_sms=num_sms, device_id=torch.cuda.current_device())
    except TypeError:  # older signature: create(num_sms, device_id)
        ctx = GreenContext.create(num_sms, torch.cuda.current_device())
    green_stream.keep.append(ctx)  # the context must outlive its stream
    return ctx.Stream()


green_stream.keep = []


def partition(a: argparse.Namespace, gemms, attention, what: str, kv_gb: float) -> None:
    """The ``--partition`` measurement (see the module docstring)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t_gemm, t_attn = timed(gemms, a.reps), timed(attention, a.reps)
    print(f"decode launch {a.decode_launch or 'default'}; whole chip ({sms} SMs): {what} {t_gemm:.3f} ms, "
          f"attention {t_attn:.3f} ms ({kv_gb / t_attn:.2f} TB/s), serial {t_gemm + t_attn:.3f} ms")
    for n in a.partition:
        side = green_stream(n)
        torch._C._set_sm_carveout_experimental(n)
        try:
            g = timed(gemms, a.reps)
            attn_n = timed(lambda: fork(side, attention), a.reps)
            t_both = timed(lambda: fork(side, attention, gemms), a.reps)
        finally:
            torch._C._set_sm_carveout_experimental(None)
        print(f"partition {n:3d} SMs: attention alone {attn_n:.3f} ms ({kv_gb / attn_n:.2f} TB/s), {what} on "
              f"{sms - n} SMs {g:.3f} ms, both {t_both:.3f} ms: {t_gemm + t_attn - t_both:+.3f} ms against serial")


if __name__ == "__main__":
    main()
