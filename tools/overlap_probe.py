"""Can decode attention (memory-bound) hide under prefill GEMMs (compute-bound) on two streams? (GPU)

python3 tools/overlap_probe.py [--rows 128] [--context 1024] [--tokens 8192] [--reps 20] [--pair gemm|prefill]

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
"""
from __future__ import annotations

import argparse

import torch

from loopline.attention.base import PagedAttentionMetadata
from loopline.attention.bench_attention import _with_work, make_step, step_flops
from loopline.attention.triton_backend import TritonAttentionBackend


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
    a = ap.parse_args()
    hidden, inter = 2048, 5632
    x = torch.randn(a.tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for n, k in ((3 * hidden, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter))]
    act = torch.randn(a.tokens, inter, device="cuda", dtype=torch.bfloat16)
    backend = TritonAttentionBackend()
    q, k_cache, v_cache, meta = decode_case(a.rows, a.context)
    scale = 128 ** -0.5

    def layer_gemms() -> None:
        for w in weights:
            torch.nn.functional.linear(act if w.shape[1] == inter else x, w)

    prompts = [(1024, 1024)] * max(1, a.tokens // 1024)
    pq, pk, pv, pmeta = make_step(prompts)
    pmeta = _with_work(pmeta, prompts, backend)

    def prefill_attention() -> None:
        backend.attend(pq, pk, pv, pmeta, scale)

    gemms = layer_gemms if a.pair == "gemm" else prefill_attention
    flops = (2 * a.tokens * sum(w.numel() for w in weights) if a.pair == "gemm" else step_flops(prompts)) / 1e12

    def attention() -> None:
        backend.attend(q, k_cache, v_cache, meta, scale)

    hi = torch.cuda.Stream(priority=-1)  # the highest priority
    main_stream = torch.cuda.current_stream()

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / a.reps

    def serial() -> None:
        gemms()
        attention()

    def concurrent() -> None:
        hi.wait_stream(main_stream)
        with torch.cuda.stream(hi):
            attention()
        gemms()
        main_stream.wait_stream(hi)

    for trial in range(2):
        t_gemm, t_attn, t_serial, t_conc = (timed(f) for f in (gemms, attention, serial, concurrent))
        hidden_ms = t_serial - t_conc
        kv_gb = a.rows * a.context * 16 * 128 * 2 * 2 / 1e9
        what = "layer GEMMs" if a.pair == "gemm" else "prefill attention"
        print(f"trial {trial}: {what} {t_gemm:.3f} ms ({flops / t_gemm * 1e3:.0f} TFLOP/s), decode attention "
              f"{t_attn:.3f} ms ({kv_gb / t_attn:.2f} TB/s), one stream {t_serial:.3f} ms, two streams {t_conc:.3f} ms: "
              f"hid {hidden_ms:.3f} ms = {hidden_ms / min(t_gemm, t_attn):.0%} of the shorter")


if __name__ == "__main__":
    main()
