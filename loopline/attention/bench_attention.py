"""Micro benchmark: torch vs triton paged attention on Ouro shapes; triton vs flashinfer.

    python -m loopline.attention.bench_attention [--sweep]
    python -m loopline.attention.bench_attention --compare flashinfer [--rows 1,32,128] [--ctx 1024]

Decode batches (1, 32, 128 rows at context 1024) and one 512-token prefill
chunk, 16 heads x 128 head_dim (Ouro-1.4B, MHA), bf16, block_size 16, pages
shuffled over the pool. Medians over CUDA-event timed runs; decode reports
achieved GB/s (K/V + q + out bytes per call) against the H200's ~4.8 TB/s,
every case the TFLOP/s of the causally visible QK^T + PV work. ``--sweep``
also times the decode kernel's launch parameters (keys per step, warps,
stages, split-KV) inside CUDA graphs, where launch cost does not count.
``--compare flashinfer`` times the two GPU backends side by side (:func:`compare`).
"""
from __future__ import annotations

import subprocess
import sys

import torch

from loopline.attention.base import PagedAttentionMetadata
from loopline.attention.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 16, 128, 16
DTYPE = torch.bfloat16
PEAK_GBPS = 4800.0  # H200 HBM3e, nominal


def make_step(rows: list[tuple[int, int]], device: str = "cuda"):
    """Random bf16 pool and metadata for rows ``[(q_len, seq_len), ...]``."""
    pages = [-(-s // BLOCK_SIZE) for _, s in rows]
    num_blocks = sum(pages)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = torch.zeros(len(rows), max(pages), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(pages):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v_cache = torch.randn_like(k_cache)
    q_lens = [q for q, _ in rows]
    n_tokens = sum(q_lens)
    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor([s for _, s in rows], dtype=torch.int32, device=device),
        block_tables=block_tables,
        slot_mapping=torch.zeros(n_tokens, dtype=torch.int64, device=device),  # unused by attend
        max_query_len=max(q_lens),
        max_seq_len=max(s for _, s in rows),
    )
    q = torch.randn(n_tokens, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    return q, k_cache, v_cache, meta


def time_ms(fn, warmup: int = 5, reps: int = 30) -> float:
    """Median milliseconds of ``fn()`` by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def step_bytes(rows: list[tuple[int, int]]) -> int:
    """Bytes a perfect kernel moves: every row's K/V once, plus q and out."""
    elem = torch.finfo(DTYPE).bits // 8
    kv = sum(s for _, s in rows) * KV_HEADS * HEAD_DIM * 2 * elem
    qo = sum(q for q, _ in rows) * HEADS * HEAD_DIM * 2 * elem
    return kv + qo


def step_flops(rows: list[tuple[int, int]]) -> int:
    """QK^T and PV FLOPs over the causally visible keys only."""
    visible = sum(q * (s - q) + q * (q + 1) // 2 for q, s in rows)
    return 4 * visible * HEADS * HEAD_DIM


def graph_time_us(fns, reps: int = 10) -> float:
    """Median microseconds per call of ``fns`` (called in turn) replayed from one CUDA graph (no launch cost)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return time_ms(graph.replay, warmup=2, reps=reps) * 1e3 / len(fns)


def layer_steps(rows: list[tuple[int, int]], min_bytes: int = 256 * 2**20) -> list:
    """Enough independent pools (like the layers of a model) that their K/V exceed the 50 MB L2 together."""
    copies = max(1, -(-min_bytes // step_bytes(rows)))
    return [make_step(rows) for _ in range(copies)]


def sweep_decode(scale: float) -> None:
    """Launch parameters of decode-only steps (keys per step, warps, stages, splits), timed in graphs.

    Each case cycles over pools of 256 MB or more in total, as a model's layers do, so K/V
    come from HBM (a single 8 MB pool would be served from L2 and flatter the kernel)."""
    from loopline.attention.triton_backend import DecodeLaunch, TritonAttentionBackend

    print("\n# decode launch sweep (us per call, CUDA graph cycling over >= 256 MB of K/V); default rule first")
    cases = [("decode B=1 ctx=1024", [(1, 1024)], (None, 8, 16)),
             ("decode B=32 ctx=1024", [(1, 1024)] * 32, (None, 2, 4)),
             ("decode B=128 ctx=1024", [(1, 1024)] * 128, (None, 2))]
    launches = [None] + [DecodeLaunch(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
    for label, rows, split_choices in cases:
        steps = layer_steps(rows)
        results = []
        for launch in launches:
            for splits in split_choices:
                be = TritonAttentionBackend(num_splits=splits, decode_launch=launch)
                try:
                    us = graph_time_us([lambda s=s: be.attend(s[0], s[1], s[2], s[3], scale) for s in steps])
                except Exception as e:  # e.g. out of shared memory for the largest tiles
                    print(f"  skipped {launch} splits={splits}: {type(e).__name__}")
                    continue
                results.append((us, launch, splits))
        default = results[0][0]
        gbps = step_bytes(rows) / (default * 1e-6) / 1e9
        print(f"{label}: default {default:.1f} us ({gbps:.0f} GB/s, {len(steps)} pools); best:", flush=True)
        for us, launch, splits in sorted(results, key=lambda r: r[0])[:6]:
            print(f"  {us:8.1f} us  {step_bytes(rows) / (us * 1e-6) / 1e9:6.0f} GB/s  {launch}  splits={splits}")


def sweep_prefill(scale: float, rows: list[tuple[int, int]] | None = None) -> None:
    """Launch parameters of prefill steps (query rows, keys per step, warps, stages) over a work list."""
    import itertools

    from loopline.attention.triton_backend import PrefillLaunch, TritonAttentionBackend

    rows = rows or [(1024, 1024)] * 8
    q, k_cache, v_cache, meta = make_step(rows)
    ref = TritonAttentionBackend().attend(q, k_cache, v_cache, with_work(meta, rows, TritonAttentionBackend()), scale)
    tflop = step_flops(rows) / 1e12
    print(f"\n# prefill launch sweep, {len(rows)} x {rows[0][0]} tokens (ms per call, TFLOP/s); default rule first")
    launches = [None] + [PrefillLaunch(bm, bn, w, st) for bm, bn, w, st in
                         itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
    results = []
    for launch in launches:
        be = TritonAttentionBackend(prefill_launch=launch)
        m = with_work(meta, rows, be)
        try:
            got = be.attend(q, k_cache, v_cache, m, scale)
            err = (got.float() - ref.float()).abs().max().item()
            ms = time_ms(lambda: be.attend(q, k_cache, v_cache, m, scale), warmup=2, reps=10)
        except Exception as e:  # e.g. out of shared memory for the largest tiles
            print(f"  skipped {launch}: {type(e).__name__}")
            continue
        results.append((ms, launch, err))
    print(f"default {results[0][0]:.3f} ms ({tflop / (results[0][0] * 1e-3):.0f} TFLOP/s); best:")
    for ms, launch, err in sorted(results, key=lambda r: r[0])[:8]:
        print(f"  {ms:7.3f} ms  {tflop / (ms * 1e-3):5.0f} TFLOP/s  max err {err:.1e}  {launch}")


def with_work(meta: PagedAttentionMetadata, rows, backend, reverse: bool = False) -> PagedAttentionMetadata:
    """``meta`` with the work list the engine builds for prefill steps, at ``backend``'s tile size
    (``reverse``: its entries last to first, each prompt's longest causal tiles first)."""
    import dataclasses

    from loopline.attention.base import build_work_tiles

    tile = backend.work_tile_tokens(HEADS // KV_HEADS)
    tiles = build_work_tiles([n for n, _ in rows], tile)
    work = torch.from_numpy(tiles[:, ::-1].copy() if reverse else tiles).to(meta.seq_lens.device)
    return dataclasses.replace(meta, work_tiles=work)


def model_step(rows: list[tuple[int, int]], layers: int) -> list:
    """``layers`` K/V pools (as a model's layers) read through one step's metadata and queries, as the engine
    does: a backend's per-step work (FlashInfer's page table) is paid once per ``layers`` calls."""
    q, k_cache, v_cache, meta = make_step(rows)
    pools = [(k_cache, v_cache)] + [(torch.randn_like(k_cache), torch.randn_like(v_cache)) for _ in range(layers - 1)]
    return [(q, k, v, meta) for k, v in pools]


def compare(other: str, rows_list: list[int], ctx: int, scale: float) -> None:
    """Triton vs ``other`` (``flashinfer``) on Ouro-1.4B attention shapes.

    Decode steps of each row count in ``rows_list`` at context ``ctx``: one CUDA graph replays a step of
    >= 24 layers (Ouro-1.4B's count; more while their K/V stay under 256 MB), so neither launch cost nor L2
    flatters a backend, and FlashInfer's per-step page table is paid once per step as in the engine. Prompt
    steps (FlashInfer plans them on the host, one sync each) are timed eagerly per call, plan included."""
    from loopline.attention import get_attention_backend

    device = torch.device("cuda")
    triton_be, other_be = get_attention_backend("triton", device), get_attention_backend(other, device)
    print(f"\n# triton vs {other}  (decode: us per layer call in a CUDA graph; prompt steps: eager ms per call)")
    header = f"{'case':34s} {'triton':>9s} {other:>10s} {other + '/triton':>17s} {'triton GB/s':>11s} {other + ' GB/s':>15s} {'max diff':>9s}"
    print(header)
    print("-" * len(header))
    for n in rows_list:
        rows = [(1, ctx)] * n
        layers = max(24, -(-256 * 2**20 // step_bytes(rows)))
        step = model_step(rows, layers)
        diff = max((triton_be.attend(*s, scale).float() - other_be.attend(*s, scale).float()).abs().max().item()
                   for s in step[:2])
        t = [graph_time_us([lambda s=s, be=be: be.attend(*s, scale) for s in step]) for be in (triton_be, other_be)]
        gb = [step_bytes(rows) / (x * 1e-6) / 1e9 for x in t]
        print(f"{f'decode C={n} ctx={ctx} ({layers} layers)':34s} {t[0]:8.1f}u {t[1]:9.1f}u {t[1] / t[0]:16.2f}x "
              f"{gb[0]:11.0f} {gb[1]:15.0f} {diff:9.1e}")
        del step
    for label, rows in (("prefill 512 tok ctx=1024", [(512, 1024)]),
                        ("mixed 127 decode + 512 prefill", [(1, 1024)] * 127 + [(512, 1024)]),
                        ("prefill 8 x 1024 tok", [(1024, 1024)] * 8)):
        q, k_cache, v_cache, meta = make_step(rows)
        diff = (triton_be.attend(q, k_cache, v_cache, meta, scale).float()
                - other_be.attend(q, k_cache, v_cache, meta, scale).float()).abs().max().item()
        t = [time_ms(lambda be=be, s=(q, k_cache, v_cache, meta): be.attend(*s, scale)) for be in (triton_be, other_be)]
        print(f"{label:34s} {t[0]:8.3f}m {t[1]:9.3f}m {t[1] / t[0]:16.2f}x {'-':>11s} {'-':>15s} {diff:9.1e}")


def _flag(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU (the triton kernels have no fast CPU path); nothing to do.")
        sys.exit(0)
    from loopline.attention.triton_backend import TritonAttentionBackend, triton_available

    if not triton_available():
        print("bench_attention needs the `triton` package; nothing to do.")
        sys.exit(0)

    torch.manual_seed(0)
    ref, fast = TorchAttentionBackend(), TritonAttentionBackend()
    scale = HEAD_DIM**-0.5
    if "--compare" in sys.argv:
        print(f"# loopline attention bench  commit={commit()}  gpu={torch.cuda.get_device_name()}  "
              f"torch={torch.__version__}  heads={HEADS} kv_heads={KV_HEADS} head_dim={HEAD_DIM} block={BLOCK_SIZE}")
        compare(_flag("--compare", "flashinfer"), [int(x) for x in _flag("--rows", "1,32,128").split(",")],
                int(_flag("--ctx", "1024")), scale)
        return
    cases = [
        ("decode B=1 ctx=1024", [(1, 1024)]),
        ("decode B=32 ctx=1024", [(1, 1024)] * 32),
        ("decode B=128 ctx=1024", [(1, 1024)] * 128),
        ("prefill 512 tok ctx=1024", [(512, 1024)]),
        ("mixed 127 decode + 512 prefill", [(1, 1024)] * 127 + [(512, 1024)]),
        ("prefill 8 x 1024 tok", [(1024, 1024)] * 8),
    ]
    print(f"# loopline attention bench  commit={commit()}  gpu={torch.cuda.get_device_name()}  "
          f"torch={torch.__version__}  heads={HEADS} kv_heads={KV_HEADS} head_dim={HEAD_DIM} "
          f"block={BLOCK_SIZE} {str(DTYPE).removeprefix('torch.')}")  # fmt: skip
    header = (f"{'case':34s} {'torch ms':>9s} {'triton ms':>10s} {'speedup':>8s} {'GB/s':>8s} {'% peak':>7s} "
              f"{'TFLOP/s':>8s} {'max err':>8s}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for label, rows in cases:
        q, k_cache, v_cache, meta = make_step(rows)
        want = ref.attend(q, k_cache, v_cache, meta, scale)
        got = fast.attend(q, k_cache, v_cache, meta, scale)
        err = (got.float() - want.float()).abs().max().item()
        t_ref = time_ms(lambda: ref.attend(q, k_cache, v_cache, meta, scale), warmup=2, reps=10)
        t_fast = time_ms(lambda: fast.attend(q, k_cache, v_cache, meta, scale))
        gbps = step_bytes(rows) / (t_fast * 1e-3) / 1e9
        tflops = step_flops(rows) / (t_fast * 1e-3) / 1e12
        bw = f"{gbps:8.0f} {100 * gbps / PEAK_GBPS:6.1f}%" if meta.max_query_len == 1 else f"{'-':>8s} {'-':>7s}"
        print(f"{label:34s} {t_ref:9.3f} {t_fast:10.3f} {t_ref / t_fast:7.1f}x {bw} {tflops:8.1f} {err:8.1e}")
    if "--sweep" in sys.argv:
        sweep_decode(scale)
        sweep_prefill(scale)


if __name__ == "__main__":
    main()
