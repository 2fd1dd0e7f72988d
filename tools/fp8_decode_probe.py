"""Why FP8 decode attention reads slower than bf16 at many rows, and a kernel that packs heads (GPU; CPU under
TRITON_INTERPRET=1 with --check only).

python3 tools/fp8_decode_probe.py [--rows 128,32] [--context 1088] [--reps 20] [--check]

On an H200 a 128-row decode step over an FP8 cache took 0.84x the bf16 step's time for half the KV bytes
(2026-12-06): bf16 attention reads at the page layout's ceiling (~4.2 TB/s), FP8 at roughly 2.7. An FP8 page
holds a head's key as 128 contiguous bytes (bf16: 256), 2 KB from the next position's. This times, on
Ouro-1.4B's decode shapes (16 heads of 128, 16-token pages, shuffled, one query per row):

* ``engine``: the backend's launch (``TritonAttentionBackend.attend``), bf16 and FP8, at several
  ``DecodeLaunch`` (keys per step, warps, stages);
* ``gather``: the reads alone (``decode_kernel_probe.gather_read_kernel``: pages of HG heads through the
  block tables, summed), bf16 and FP8 bytes: the ceiling of the access pattern;
* ``packed``: HG KV heads per program, the heads' adjacent bytes read as one ``[HG * D, BLOCK_N]`` tile; the
  HG queries sit block-diagonally in a ``[16, HG * D]`` operand, so one tensor-core dot scores all HG heads
  (row m: head m) and one dot accumulates their outputs (row m's block m is head m's). FAST: FP8 widened to
  fp16 by moving its bits (``fp16 bits = sign << 8 | magnitude << 7``, the E4M3 value times 2**-8, exact,
  folded into the scales) instead of the conversion instruction.

Measured on an H100 (docs/benchmarks/h200-2026-12-06.md): FP8's engine launch reads at 85% of its pages'
ceiling, which is itself lower than bf16's (2.7 vs 3.0 TB/s); packing heads and moving bits were slower
(the packed kernel was in the engine at commit 8790251, behind ``DecodeLaunch.heads``). ``head-major``
cases time the engine's kernels over the same pages laid out ``[block, head, slot, D]`` (strided views).

Each line prints microseconds per launch and the KV bytes' rate. ``--check`` first compares every variant
with a dense fp32 reference over the dequantized cache (ragged lengths).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from loopline.attention.base import PagedAttentionMetadata, dequantize_fp8, quantize_fp8  # noqa: E402
from loopline.attention.triton_backend import DecodeLaunch, TritonAttentionBackend  # noqa: E402

HEADS, HEAD_DIM, BLOCK_SIZE = 16, 128, 16
_LOG2E = 1.4426950408889634


@triton.jit
def _fp8_bits_as_f16(x):
    """E4M3 ``x`` as fp16 holding its value times 2**-8 (normals and subnormals alike), by moving bits."""
    b = x.to(tl.uint8, bitcast=True).to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def packed_kernel(q_ptr, k_cache, v_cache, k_scale_ptr, v_scale_ptr, out_ptr, seq_lens, block_tables, qk_scale,
                  stride_qn, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  stride_on, stride_oh, stride_bt,
                  HG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                  FAST: tl.constexpr):
    W: tl.constexpr = HG * D
    FP8: tl.constexpr = k_cache.dtype.element_ty == tl.float8e4nv
    row = tl.program_id(0)
    h0 = tl.program_id(1) * HG
    offs_m = tl.arange(0, 16)
    offs_w = tl.arange(0, W)
    col_head = offs_w // D
    col_d = offs_w % D
    diag = offs_m[:, None] == col_head[None, :]  # [16, W]: row m's own head's columns
    heads_m = h0 + tl.minimum(offs_m, HG - 1)
    zero_m = offs_m[:, None] * 0  # the [16, W] pointers of rows that read and write their own head's columns
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qn + (h0 + col_head)[None, :] * stride_qh + col_d[None, :]
                + zero_m, mask=diag, other=0.0)
    if FP8:
        ks = tl.load(k_scale_ptr + heads_m)
        vs = tl.load(v_scale_ptr + heads_m)
        if FAST:
            ks = ks * 256.0
            vs = vs * 256.0
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    else:
        ks = tl.full([16], 1.0, tl.float32)
        vs = tl.full([16], 1.0, tl.float32)
        q = q.to(k_cache.dtype.element_ty)
    row_scale = qk_scale * ks
    seq_len = tl.load(seq_lens + row)
    table = block_tables + row.to(tl.int64) * stride_bt
    colk = col_head.to(tl.int64) * stride_kh + col_d
    colv = col_head.to(tl.int64) * stride_vh + col_d
    k_base = k_cache + h0.to(tl.int64) * stride_kh
    v_base = v_cache + h0.to(tl.int64) * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([16], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([16], dtype=tl.float32)
    acc = tl.zeros([16, W], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + offs_n
        valid = pos < seq_len
        blk = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = (pos % BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_base + (blk * stride_kb + slot * stride_ks)[None, :] + colk[:, None], mask=valid[None, :],
                    other=0.0)  # [W, BLOCK_N]
        v = tl.load(v_base + (blk * stride_vb + slot * stride_vs)[:, None] + colv[None, :], mask=valid[:, None],
                    other=0.0)  # [BLOCK_N, W]
        if FP8:
            if FAST:
                k = _fp8_bits_as_f16(k)
                v = _fp8_bits_as_f16(v)
            else:
                k = k.to(tl.float16)
                v = v.to(tl.float16)
        s = tl.dot(q, k) * row_scale[:, None]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * vs[:, None]
    tl.store(out_ptr + row.to(tl.int64) * stride_on + (h0 + col_head)[None, :] * stride_oh + col_d[None, :] + zero_m,
             o.to(out_ptr.dtype.element_ty), mask=diag & (offs_m < HG)[:, None])


def packed(q, k_cache, v_cache, scales, meta, scale, out, hg: int, block_n: int, warps: int, stages: int,
           fast: bool) -> None:
    rows = q.shape[0]
    kvh = k_cache.shape[2]
    k_scale, v_scale = scales if scales is not None else (k_cache, v_cache)
    packed_kernel[(rows, kvh // hg)](
        q, k_cache, v_cache, k_scale, v_scale, out, meta.seq_lens, meta.block_tables, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), HG=hg, BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1], D=q.shape[2],
        FAST=fast, num_warps=warps, num_stages=stages)


# CUDA-core kernels of tools/decode_kernel_probe.py (no tensor cores: a tile widens straight to fp32 in
# registers, no shared-memory operand): one (row, head) per program of 1-2 warps (``warp``: PAGES, WARPS,
# PREFETCH, SPLITS) or one online softmax per key lane (``lanes``: HG, PAGES, WARPS, PREFETCH). At bf16 they
# matched the engine on an H200 (2026-11-30); over FP8 pages they skip the widened tile's trip through
# shared memory that the engine's tensor-core dots take.
CUDA_CORE = [("warp", (1, 1, 0, 1)), ("warp", (1, 1, 1, 1)), ("warp", (2, 1, 0, 1)), ("warp", (1, 2, 0, 1)),
             ("warp", (2, 2, 1, 1)), ("lanes", (1, 1, 2, 0)), ("lanes", (1, 2, 4, 0)), ("lanes", (1, 1, 1, 0)),
             ("lanes", (1, 2, 2, 1))]


def cuda_core(name: str, params: tuple, q, k_cache, v_cache, scales, meta, scale: float, out) -> torch.Tensor:
    """``decode_kernel_probe.launch``, with an FP8 cache's per-head scales folded into q (K's) and applied to
    the output (V's), as the engine's kernels fold them; returns ``out``."""
    from decode_kernel_probe import launch

    if scales is not None:
        q = (q.float() * scales[0][None, :, None]).to(q.dtype)
    launch(name, params, q, k_cache, v_cache, meta, scale, out)
    if scales is not None:
        out.mul_(scales[1][None, :, None].to(out.dtype))
    return out


def make_case(seq_lens: list[int], device: str):
    """bf16 pages and their FP8 copy (per-head scales from the amax), shuffled, one query per row."""
    pages = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(pages) + 1
    perm = torch.randperm(num_blocks - 1, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=device)
    used = 0
    for r, n in enumerate(pages):
        tables[r, :n] = perm[used:used + n]
        used += n
    kc = torch.randn(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    vc = torch.randn_like(kc)
    ks = kc.float().abs().amax(dim=(0, 1, 3)) / 448.0
    vs = vc.float().abs().amax(dim=(0, 1, 3)) / 448.0
    kc8, vc8 = quantize_fp8(kc, ks), quantize_fp8(vc, vs)
    rows = len(seq_lens)
    meta = PagedAttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=tables,
        slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device), max_query_len=1,
        max_seq_len=max(seq_lens))
    q = torch.randn(rows, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    return q, (kc, vc, None), (kc8, vc8, (ks, vs)), meta


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` stored ``[block, head, slot, D]``, viewed as ``[block, slot, head, D]``."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def reference(q, k_cache, v_cache, scales, meta, scale: float) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r in range(q.shape[0]):
        n = int(meta.seq_lens[r])
        blocks = meta.block_tables[r, : -(-n // BLOCK_SIZE)].long()
        k = k_cache[blocks].flatten(0, 1)[:n]
        v = v_cache[blocks].flatten(0, 1)[:n]
        k, v = (dequantize_fp8(k, scales[0]), dequantize_fp8(v, scales[1])) if scales else (k.float(), v.float())
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[r].float(), k) * scale, -1)
        out[r] = torch.einsum("hn,nhd->hd", p, v)
    return out


VARIANTS = [(hg, bn, w, st, fast) for hg, bn, w, st, fast in (
    (1, 128, 4, 2, False), (1, 128, 4, 2, True), (2, 64, 4, 2, False), (2, 64, 4, 2, True),
    (2, 128, 4, 2, True), (2, 64, 8, 2, True), (2, 64, 4, 3, True), (4, 32, 4, 2, True), (4, 64, 8, 2, True),
    (2, 32, 4, 3, True))]
# (the tensor-core launches with cuda_cores=0: the default rule would send 128 FP8 rows to the CUDA cores)
ENGINE_LAUNCHES = [None, *(DecodeLaunch(*launch, None, 0) for launch in (
                       (64, 4, 2), (128, 8, 2), (128, 4, 3), (256, 8, 2), (128, 2, 2), (128, 4, 4), (64, 4, 3),
                       (64, 2, 3), (32, 2, 4), (32, 4, 2), (32, 4, 3), (None, None, None))),
                   # the tensor-core kernel's default launch with registers capped (more programs an SM, spills)
                   DecodeLaunch(cuda_cores=0, max_registers=168), DecodeLaunch(cuda_cores=0, max_registers=128),
                   DecodeLaunch(cuda_cores=0, max_registers=96),
                   # the engine's CUDA-core decode kernel (mha_decode_kernel): one softmax a program, then per lane
                   DecodeLaunch(16, 1, 1, None, 1), DecodeLaunch(16, 2, 1, None, 1), DecodeLaunch(32, 4, 1, None, 1),
                   DecodeLaunch(16, 2, 1, None, 2)]
GATHER = [(1, 4, 8), (1, 8, 8), (2, 2, 8), (2, 4, 8), (4, 1, 8), (4, 2, 8)]


def check(device: str) -> None:
    scale = HEAD_DIM ** -0.5
    q, bf16, fp8, meta = make_case([200, 1, 15, 16, 17, 100, 33, 64], device)
    for name, (kc, vc, sc) in (("bf16", bf16), ("fp8", fp8)):
        ref = reference(q, kc, vc, sc, meta, scale)
        for hg, bn, w, st, fast in VARIANTS:
            if fast and name == "bf16":
                continue
            out = torch.empty_like(q)
            packed(q, kc, vc, sc, meta, scale, out, hg, bn, w, st, fast)
            err = (out.float() - ref).abs().max().item()
            print(f"check {name} packed hg={hg} n={bn} fast={fast}: max abs err {err:.2e}", flush=True)
            assert err < 2e-2, (name, hg, bn, fast, err)
        for variant, params in CUDA_CORE:
            out = cuda_core(variant, params, q, kc, vc, sc, meta, scale, torch.empty_like(q))
            err = (out.float() - ref).abs().max().item()
            print(f"check {name} {variant} {params}: max abs err {err:.2e}", flush=True)
            assert err < 2e-2, (name, variant, params, err)
        kw = dict(zip(("k_scale", "v_scale"), sc)) if sc else {}
        for layout, (kx, vx) in (("", (kc, vc)), (" head-major", (head_major(kc), head_major(vc)))):
            eng = TritonAttentionBackend().attend(q, kx, vx, meta, scale, **kw)
            err = (eng.float() - ref).abs().max().item()
            print(f"check {name} engine{layout}: max abs err {err:.2e}", flush=True)
            assert err < 2e-2, (name, layout, err)
        for label, launch in (("cuda_cores=1", DecodeLaunch(16, 2, 1, None, 1)),  # the CUDA-core decode kernel
                              ("cuda_cores=2", DecodeLaunch(16, 2, 1, None, 2)),
                              ("max_registers=128", DecodeLaunch(cuda_cores=0, max_registers=128))):
            eng = TritonAttentionBackend(decode_launch=launch).attend(q, kc, vc, meta, scale, **kw)
            err = (eng.float() - ref).abs().max().item()
            print(f"check {name} engine {label}: max abs err {err:.2e}", flush=True)
            assert err < 2e-2, (name, label, err)


def main() -> None:
    from decode_kernel_probe import gather_read
    from overlap_probe import timed

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128,32")
    ap.add_argument("--context", type=int, default=1088)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--only", default="", help="time only the cases whose label contains one of these (comma list)")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.check:
        if device == "cpu":  # the interpreter's bf16 dots need widening (numpy has no bf16)
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
            from triton_testing import bf16_dot_in_the_interpreter
            with bf16_dot_in_the_interpreter():
                check(device)
            return
        check(device)
    scale = HEAD_DIM ** -0.5
    for rows in map(int, a.rows.split(",")):
        q, bf16, fp8, meta = make_case([a.context] * rows, device)
        out = torch.empty_like(q)
        gb = rows * a.context * HEADS * HEAD_DIM * 2 / 1e9  # K + V at one byte an element
        cases = []
        for name, (kc, vc, sc), elem in (("bf16", bf16, 2), ("fp8", fp8, 1)):
            kw = dict(zip(("k_scale", "v_scale"), sc)) if sc else {}
            for launch in ENGINE_LAUNCHES:
                be = TritonAttentionBackend(decode_launch=launch)
                cases.append((f"{name} engine {dataclasses.astuple(launch) if launch else 'default'}", elem,
                              lambda be=be, kc=kc, vc=vc, kw=kw: be.attend(q, kc, vc, meta, scale, **kw)))
            for hg, bn, w, st, fast in VARIANTS:
                if fast and name == "bf16":
                    continue
                cases.append((f"{name} packed hg={hg} n={bn} w={w} s={st} fast={int(fast)}", elem,
                              lambda kc=kc, vc=vc, sc=sc, p=(hg, bn, w, st, fast):
                              packed(q, kc, vc, sc, meta, scale, out, *p)))
            for variant, params in CUDA_CORE:
                cases.append((f"{name} cuda-core {variant} {params}", elem,
                              lambda kc=kc, vc=vc, sc=sc, v=variant, p=params:
                              cuda_core(v, p, q, kc, vc, sc, meta, scale, out)))
            kb, vb = (kc.view(torch.uint8), vc.view(torch.uint8)) if sc else (kc, vc)
            for hg, pages, w in GATHER:
                cases.append((f"{name} gather hg={hg} pages={pages} w={w}", elem,
                              lambda kb=kb, vb=vb, p=(hg, pages, w): gather_read(kb, vb, meta, *p)))
            # The same pages laid out head-major ([block, head, slot, D]: a head's page is 16 adjacent keys),
            # as strided views the kernels take unchanged
            khm, vhm = (head_major(x) for x in (kc, vc))
            cases.append((f"{name} engine head-major", elem,
                          lambda be=TritonAttentionBackend(), kc=khm, vc=vhm, kw=kw: be.attend(q, kc, vc, meta, scale,
                                                                                              **kw)))
            kb, vb = (khm.view(torch.uint8), vhm.view(torch.uint8)) if sc else (khm, vhm)
            for hg, pages, w in GATHER[:2]:
                cases.append((f"{name} gather head-major hg={hg} pages={pages} w={w}", elem,
                              lambda kb=kb, vb=vb, p=(hg, pages, w): gather_read(kb, vb, meta, *p)))
        print(f"rows {rows}, {a.context} keys: K+V {gb * 2:.3f} GB bf16 / {gb:.3f} GB fp8 per launch", flush=True)
        for label, elem, fn in cases:
            if a.only and not any(o in label for o in a.only.split(",")):
                continue
            try:
                ms = timed(fn, a.reps)
            except Exception as e:  # a launch that does not compile (shared memory) is reported, not fatal
                print(f"  {label:44s} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            print(f"  {label:44s} {ms * 1e3:8.1f} us  {gb * elem / ms:6.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
