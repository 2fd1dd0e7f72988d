"""FP8 (E4M3) KV caches: the torch reference's quantize / dequantize, and the Triton kernels against it
(CPU interpreter or GPU; see triton_testing).

A stored value is ``clamp(x / scale, -448, 448)`` rounded to nearest even, read back as ``stored * scale``
with per-KV-head fp32 scales. The model dtype of the CPU cases is fp32 (the interpreter mis-computes bf16
dots); the kernels then widen the 1-byte K/V tiles to fp32.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from triton_testing import DEVICE, spy_on_kernel

from loopline.attention.base import PagedAttentionMetadata, build_work_tiles, dequantize_fp8, quantize_fp8
from loopline.attention.paged import PagedAttention
from loopline.attention.torch_backend import TorchAttentionBackend
from loopline.attention.triton_backend import DecodeLaunch, SplitRule, TritonAttentionBackend
from loopline.models.ops import Rope, rotary_cos_sin

FP8 = torch.float8_e4m3fn
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Decode rows and prefill chunks, contexts over several pages; G = heads // kv_heads up to 3.
MIXED_ROWS = [(1, 13), (5, 5), (1, 1), (3, 21)]
GQA = [(4, 2), (2, 2), (6, 2)]
GQA_IDS = ["gqa", "mha", "gqa3"]
# The interpreted attention kernels (~2-4 s a case on 2 cores): G = 2 in the default run, G = 1 and 3 slow
# (tests/attention/test_triton_backend.py runs the same kernels without FP8 at every G by default).
GQA_DEFAULT_ONE = [pytest.param(4, 2, id="gqa"), pytest.param(2, 2, id="mha", marks=pytest.mark.slow),
                   pytest.param(6, 2, id="gqa3", marks=pytest.mark.slow)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of an FP8 cache (NaN bytes compare equal, unlike the values)."""
    return t.view(torch.uint8).cpu()


def step_meta(rows, block_tables, slots, device) -> PagedAttentionMetadata:
    q_lens = [q for q, _ in rows]
    return PagedAttentionMetadata(
        query_start_loc=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(device),
        seq_lens=torch.tensor([s for _, s in rows], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat([s[seq - q:] for s, (q, seq) in zip(slots, rows)]).to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(s for _, s in rows),
    )


def write_meta(slots: torch.Tensor) -> PagedAttentionMetadata:
    """Metadata that stores ``len(slots)`` tokens at ``slots`` (what write_kv reads of it)."""
    n = slots.shape[0]
    return PagedAttentionMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                                  seq_lens=torch.tensor([n], dtype=torch.int32, device=DEVICE),
                                  block_tables=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
                                  slot_mapping=slots.to(DEVICE), max_query_len=n, max_seq_len=n)


@dataclass
class Case:
    """One step over paged rows; ``k``/``v`` are the model's keys and values of every position of every row
    (``slots`` is where each goes), some tiny (fp8 subnormals) and, with ``saturate``, some past +-448 scales."""

    q: torch.Tensor  # [N, heads, D] fp32
    k: torch.Tensor  # [S, kv_heads, D] fp32
    v: torch.Tensor
    slots: torch.Tensor  # [S] int64
    meta: PagedAttentionMetadata
    num_blocks: int
    block_size: int
    k_scale: torch.Tensor  # [kv_heads] fp32
    v_scale: torch.Tensor

    def empty(self, dtype=FP8) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V caches that read as NaN everywhere: a kernel reading a slot no row may read fails loudly."""
        shape = (self.num_blocks, self.block_size, self.k.shape[1], self.k.shape[2])
        if dtype == FP8:
            nan = torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8)
        else:
            nan = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        return nan, nan.clone()

    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def filled(self, backend=None, dtype=FP8, keep=None):
        """Caches holding the history, written by ``backend`` (torch by default); ``keep`` masks positions."""
        kc, vc = self.empty(dtype)
        keep = slice(None) if keep is None else keep
        (backend or TorchAttentionBackend()).write_kv(kc, vc, self.k[keep], self.v[keep], write_meta(self.slots[keep]),
                                                      **self.scales())
        return kc, vc


def make_case(rows, heads, kv_heads, head_dim=16, block_size=8, seed=0, saturate=True, pow2=False, spread=1.5,
              q_std=0.3) -> Case:
    """Random rows ``[(q_len, seq_len), ...]``. KV head ``h`` has values of about
    ``10 ** (spread * h / (kv_heads - 1))`` (hence its own scales), scaled so the largest clip (``saturate``)
    or just fit; ``pow2``: scales rounded up to powers of two."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-s // block_size) for _, s in rows]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen)  # every row owns distinct, shuffled pages
    block_tables = torch.zeros(len(rows), max(pages), dtype=torch.int32)
    slots, used = [], 0
    for b, (_, seq_len) in enumerate(rows):
        blocks = perm[used: used + pages[b]]
        used += pages[b]
        block_tables[b, : pages[b]] = blocks
        pos = torch.arange(seq_len)
        slots.append(blocks[pos // block_size].long() * block_size + pos % block_size)
    total = sum(s for _, s in rows)
    mags = torch.logspace(0, spread, kv_heads)[None, :, None]
    kv = []
    for _ in range(2):
        x = torch.randn(total, kv_heads, head_dim, generator=gen) * mags
        tiny = torch.rand(x.shape, generator=gen) < 0.1
        kv.append(torch.where(tiny, x * 1e-3, x))  # values under 2**-6 scales: fp8 subnormals
    k_scale, v_scale = (x.abs().amax((0, 2)) / (600.0 if saturate else 440.0) for x in kv)  # 600: the top clips
    if pow2:
        k_scale, v_scale = (2.0 ** torch.ceil(torch.log2(s)) for s in (k_scale, v_scale))
    n = sum(q for q, _ in rows)
    q = torch.randn(n, heads, head_dim, generator=gen) * q_std
    return Case(q.to(DEVICE), kv[0].to(DEVICE), kv[1].to(DEVICE), torch.cat(slots).to(DEVICE),
                step_meta(rows, block_tables, slots, DEVICE), num_blocks, block_size, k_scale.to(DEVICE),
                v_scale.to(DEVICE))


def attend_by_hand(q, k, v, meta, scale, block_size):
    """Causal attention of each row over its keys, from dequantized fp32 caches ``[slots, kv_heads, D]``."""
    out = torch.empty_like(q)
    starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    group = q.shape[1] // k.shape[1]
    for b, seq_len in enumerate(seq_lens):
        lo, hi = starts[b], starts[b + 1]
        rows = []
        for t in range(hi - lo):  # one query at a time: the keys up to its own position
            p = seq_len - (hi - lo) + t
            table = meta.block_tables[b].tolist()
            slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(p + 1)])
            kk = k[slots.to(k.device)].repeat_interleave(group, 1)  # [p + 1, heads, D]
            vv = v[slots.to(v.device)].repeat_interleave(group, 1)
            w = torch.softmax(torch.einsum("hd,shd->hs", q[lo + t].double(), kk.double()) * scale, -1)
            rows.append(torch.einsum("hs,shd->hd", w, vv.double()))
        out[lo:hi] = torch.stack(rows).to(q.dtype)
    return out


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within fp32 rounding of values as large as ``want``'s (heads of magnitude ~30, peaky softmax: the
    kernels fold the scales in elsewhere than torch, which moves near-zero outputs by more than 1e-5)."""
    torch.testing.assert_close(got, want, atol=2e-5 * float(want.abs().max()), rtol=1e-5)


def dequantized(cache, scale):
    return dequantize_fp8(cache.view(-1, *cache.shape[2:]), scale)


# ---------------------------------------------------------------- the torch reference


def test_torch_store_quantizes_within_fp8_error():
    case = make_case(MIXED_ROWS, 4, 2)
    kc, vc = case.filled()
    for cache, x, scale in ((kc, case.k, case.k_scale), (vc, case.v, case.v_scale)):
        stored = cache.view(-1, *cache.shape[2:])[case.slots]
        want = (x / scale[:, None]).clamp(-448, 448).to(FP8)
        assert torch.equal(as_bytes(stored), as_bytes(want))
        back = dequantize_fp8(stored, scale)
        err = (back - x).abs()
        ratio = (x / scale[:, None]).abs()
        clipped = ratio > 448
        assert clipped.any() and (ratio < 2.0**-6).any() and err.max() > 0  # saturation, subnormals, rounding
        # round to nearest: half an ulp, 2**-4 relative (3 mantissa bits), 2**-10 scales among subnormals
        bound = torch.maximum(x.abs() * 2.0**-4, (2.0**-10) * scale[:, None].expand_as(x)) * (1 + 1e-6)
        assert (err[~clipped] <= bound[~clipped]).all()
        assert torch.equal(back[clipped], 448 * scale[:, None].expand_as(x)[clipped] * x[clipped].sign())


@pytest.mark.parametrize("heads,kv_heads", GQA, ids=GQA_IDS)
def test_torch_attend_dequantizes(heads, kv_heads):
    case = make_case(MIXED_ROWS, heads, kv_heads)
    kc, vc = case.filled()
    scale = 16**-0.5
    got = TorchAttentionBackend().attend(case.q, kc, vc, case.meta, scale, **case.scales())
    want = attend_by_hand(case.q, dequantized(kc, case.k_scale), dequantized(vc, case.v_scale), case.meta, scale,
                          case.block_size)
    tol = 1e-5 if DEVICE == "cpu" else 1e-4  # (CUDA's fp32 einsum sums in another order)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # not the unquantized keys and values: the comparison can fail
    plain = torch.full((case.num_blocks * case.block_size, kv_heads, 16), float("nan"), device=DEVICE)
    plain_k, plain_v = plain.clone(), plain.clone()
    plain_k[case.slots], plain_v[case.slots] = case.k, case.v
    unquantized = attend_by_hand(case.q, plain_k, plain_v, case.meta, scale, case.block_size)
    assert not torch.allclose(got, unquantized, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_fp8_cache_needs_both_scales(name):
    backend = TorchAttentionBackend() if name == "torch" else TritonAttentionBackend(num_splits=2)
    case = make_case([(1, 5), (1, 3)], 4, 2)
    kc, vc = case.empty()
    rope = Rope(*rotary_cos_sin(case.meta.seq_lens.long() - 1, 16, 10000.0, torch.float32))
    k, v = case.k[:2], case.v[:2]
    calls = {
        "write_kv": lambda **s: backend.write_kv(kc, vc, k, v, case.meta, **s),
        "rotate_and_write_kv": lambda **s: backend.rotate_and_write_kv(kc, vc, case.q, k, v, rope, case.meta, **s),
        "attend": lambda **s: backend.attend(case.q, kc, vc, case.meta, 0.25, **s),
        "rotate_store_attend": lambda **s: backend.rotate_store_attend(kc, vc, case.q, k, v, rope, case.meta, 0.25,
                                                                       **s),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match="k_scale"):
            call()
        with pytest.raises(ValueError, match="v_scale"):
            call(k_scale=case.k_scale)
        with pytest.raises(ValueError, match="k_scale"):
            call(k_scale=case.k_scale[:1], v_scale=case.v_scale)  # one scale per KV head
        with pytest.raises(ValueError, match="v_scale"):
            call(k_scale=case.k_scale, v_scale=case.v_scale.double())


# ---------------------------------------------------------------- Triton against torch


def test_triton_store_rounds_like_torch():
    """Every fp8 value, the ties between neighbours and the fp32 values next to them, subnormals, saturation
    and signed zeros: the stored bytes equal torch's."""
    codes = torch.arange(0x7F, dtype=torch.uint8).view(FP8).float()
    mids = (codes[1:] + codes[:-1]) / 2
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    x = torch.cat([codes, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                   torch.tensor([448.0, 460.0, 464.0, 470.0, 1e6, 2.0**-10, 3 * 2.0**-11, 1e-30, 0.0])])
    x = torch.cat([x, -x])
    kvh, d = 2, 16
    n = -(-x.numel() // (kvh * d))
    x = torch.cat([x, torch.randn(n * kvh * d - x.numel(), generator=torch.Generator().manual_seed(0))])
    x = x.view(n, kvh, d).to(DEVICE)
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    for scale in (torch.ones(kvh), torch.tensor([0.37, 3.1])):
        scale = scale.to(DEVICE)
        stored = []
        for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
            kc = torch.zeros(n, 1, kvh, d, dtype=FP8, device=DEVICE)
            vc = torch.zeros_like(kc)
            backend.write_kv(kc, vc, x * scale[:, None], x * 0.5, write_meta(slots), k_scale=scale,
                             v_scale=torch.full((kvh,), 0.5, device=DEVICE))
            stored.append((as_bytes(kc), as_bytes(vc)))
        assert torch.equal(stored[0][0], stored[1][0]) and torch.equal(stored[0][1], stored[1][1])


@pytest.mark.parametrize("heads,kv_heads", GQA, ids=GQA_IDS)
def test_triton_rotate_and_write_matches_torch(heads, kv_heads):
    case = make_case(MIXED_ROWS, heads, kv_heads)
    n = case.q.shape[0]
    gen = torch.Generator().manual_seed(3)
    # q/k/v as views of one packed projection, as the engine passes them
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * 16, generator=gen) * 5).to(DEVICE)
    q, k, v = (t.view(n, -1, 16) for t in qkv.split([heads * 16, kv_heads * 16, kv_heads * 16], dim=-1))
    rope = Rope(*rotary_cos_sin(torch.arange(n, device=DEVICE) * 3, 16, 10000.0, torch.float32))
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        kc, vc = case.empty()
        q_out = backend.rotate_and_write_kv(kc, vc, q, k, v, rope, case.meta, **case.scales())
        results.append((q_out, as_bytes(kc), as_bytes(vc)))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
    assert torch.equal(results[1][1], results[0][1]) and torch.equal(results[1][2], results[0][2])
    assert not torch.equal(results[1][1], as_bytes(case.empty()[0]))  # something was stored


def check_attend(rows, heads, kv_heads, num_splits=None, work_pad=None, decode_rows=0, block_n=None, seed=0,
                 cuda_cores=None, split_rule=None):
    """Triton attention over an FP8 cache against torch's over the same bytes."""
    case = make_case(rows, heads, kv_heads, seed=seed)
    kc, vc = case.filled(TritonAttentionBackend())
    assert torch.equal(as_bytes(kc), as_bytes(case.filled()[0]))  # the Triton store wrote torch's bytes
    scale = 16**-0.5
    want = TorchAttentionBackend().attend(case.q, kc, vc, case.meta, scale, **case.scales())
    backend = TritonAttentionBackend(num_splits=num_splits, split_rule=split_rule,
                                     decode_launch=DecodeLaunch(block_n=block_n, cuda_cores=cuda_cores))
    meta = case.meta
    if work_pad is not None:
        tile = backend.work_tile_tokens(heads // kv_heads)
        q_lens = [q for q, _ in rows][decode_rows:]
        needed = sum(-(-q // tile) for q in q_lens)
        meta.work_tiles = torch.from_numpy(build_work_tiles(q_lens, tile, needed + work_pad, decode_rows)).to(DEVICE)
        meta.num_decode_rows = decode_rows
    got = backend.attend(case.q, kc, vc, meta, scale, **case.scales())
    assert got.dtype == case.q.dtype and not got.isnan().any()
    close(got, want)
    return case, got


@pytest.mark.parametrize("heads,kv_heads", GQA_DEFAULT_ONE)
def test_triton_attend_decode_rows(heads, kv_heads):
    check_attend([(1, 13), (1, 1), (1, 30), (1, 17)], heads, kv_heads, block_n=16)


@pytest.mark.parametrize("lanes", [1, 2], ids=["one-softmax", "per-lane"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_cuda_core_decode_reads_fp8(num_splits, lanes):
    """mha_decode_kernel (DecodeLaunch(cuda_cores=1 or 2)) over FP8 pages: the key scale folded into q, the
    value scale into the output, as torch's attention over the dequantized bytes."""
    check_attend([(1, 13), (1, 1), (1, 30), (1, 17)], 2, 2, num_splits=num_splits, block_n=8, cuda_cores=lanes)


def test_fp8_decode_takes_cuda_cores_from_a_full_grid(monkeypatch):
    """DecodeLaunch(cuda_cores=None): unsplit decode-only launches over FP8 pages of an MHA cache with at least
    SplitRule.cuda_core_programs_per_sm (row, head) programs an SM (one SM under the interpreter) take
    mha_decode_kernel; smaller ones, GQA caches and cuda_cores=0 the tensor-core kernel; the output is torch's
    either way."""
    import loopline.attention.triton_backend as tb

    monkeypatch.setattr(tb, "cuda_sm_count", lambda device: 1)  # a GPU of one SM: the thresholds below hold there
    rows = [(1, 13), (1, 1), (1, 30), (1, 17)]  # 4 rows x 2 heads: 8 programs
    launches = []
    with spy_on_kernel("mha_decode_kernel", launches):
        check_attend(rows, 2, 2, split_rule=SplitRule(cuda_core_programs_per_sm=8))
        assert launches == [(4, 2, 1)]
        check_attend(rows, 2, 2, split_rule=SplitRule(cuda_core_programs_per_sm=9))
        check_attend(rows, 2, 2, split_rule=SplitRule(cuda_core_programs_per_sm=8), cuda_cores=0)
        check_attend(rows, 4, 2, split_rule=SplitRule(cuda_core_programs_per_sm=1))  # GQA
        check_attend(rows + [(5, 20)], 2, 2, split_rule=SplitRule(cuda_core_programs_per_sm=1))  # a prefill row
        assert launches == [(4, 2, 1)]


@pytest.mark.parametrize("heads,kv_heads", GQA_DEFAULT_ONE)
def test_triton_attend_mixed_rows(heads, kv_heads):
    check_attend(MIXED_ROWS, heads, kv_heads)


# ~4 s a case, slow: the work-list grid runs without FP8 in test_triton_backend.py, FP8 reads in the tests above
@pytest.mark.parametrize("heads,kv_heads", [pytest.param(4, 2, id="gqa", marks=pytest.mark.slow), GQA_DEFAULT_ONE[1]])
def test_triton_attend_work_list_with_decode_rows(heads, kv_heads):
    # a mixed step as the engine lays it out: decode rows first (their own launch), chunks on the work list
    check_attend([(1, 30), (1, 5), (20, 40), (3, 3)], heads, kv_heads, work_pad=2, decode_rows=2)


@pytest.mark.slow  # ~6 s in the interpreter; default run: the split-KV kernel without FP8
# (tests/attention/test_triton_backend.py::test_attend_split_kv_matches_torch) and FP8 reads in the tests above
def test_triton_attend_split_kv():
    # forced splits: 16-key steps that do not divide evenly, empty splits of short rows
    check_attend([(1, 70), (1, 2), (2, 17), (1, 33)], 4, 2, num_splits=3, block_n=16)


def fused_case(seq_lens, heads, kv_heads, seed=0):
    """Decode rows whose history is in the cache (their own position not yet) and this step's projections."""
    rows = [(1, s) for s in seq_lens]
    case = make_case(rows, heads, kv_heads, seed=seed)
    last = torch.cumsum(torch.tensor(seq_lens), 0) - 1  # each row's own position, stored by the step
    history = torch.ones(case.slots.shape[0], dtype=torch.bool)
    history[last] = False
    n = len(rows)
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * 16, generator=gen) * 2).to(DEVICE)
    q, k, v = (t.view(n, -1, 16) for t in qkv.split([heads * 16, kv_heads * 16, kv_heads * 16], dim=-1))
    rope = Rope(*rotary_cos_sin(case.meta.seq_lens.long() - 1, 16, 10000.0, torch.float32))
    return case, history.to(DEVICE), (q, k, v, rope)


@pytest.mark.parametrize("heads,kv_heads", GQA_DEFAULT_ONE)
def test_triton_fused_decode_matches_torch(heads, kv_heads):
    """``rotate_store_attend`` of decode rows in one kernel (4 splits) against torch's rotary, store and
    attention, and against Triton's store-then-attend path: outputs close, caches byte for byte."""
    case, history, (q, k, v, rope) = fused_case([1, 2, 13, 17, 40], heads, kv_heads)
    scale = 16**-0.5
    results = []
    fused = TritonAttentionBackend(num_splits=4, decode_launch=DecodeLaunch(block_n=16))
    unfused = TritonAttentionBackend(num_splits=1)  # below the fused kernel's 2 splits: store, then attend
    for backend in (TorchAttentionBackend(), fused, unfused):
        kc, vc = case.filled(keep=history)
        launches = []
        with spy_on_kernel("decode_attention_kernel", launches):
            out = backend.rotate_store_attend(kc, vc, q, k, v, rope, case.meta, scale, **case.scales())
        assert len(launches) == (backend is fused)
        results.append((out, as_bytes(kc), as_bytes(vc)))
    for got in results[1:]:
        close(got[0], results[0][0])
        assert torch.equal(got[1], results[0][1]) and torch.equal(got[2], results[0][2])
    assert not results[0][0].isnan().any()


@pytest.mark.slow  # ~4 s in the interpreter; default run: the kernels equal the torch FP8
# reference (above) and test_torch_store_quantizes_within_fp8_error bounds the rounding
def test_fp8_attention_is_close_to_full_precision():
    """Sanity: an FP8 cache scaled to its values' range changes the attention output by a few percent at most."""
    # unit-sized queries and keys, as attention sees them (large logits would magnify any error of the keys)
    case = make_case(MIXED_ROWS + [(1, 40)], 4, 2, saturate=False, pow2=True, spread=0.3, q_std=1.0)
    scale = 16**-0.5
    full = TorchAttentionBackend().attend(case.q, *case.filled(dtype=torch.float32), case.meta, scale)
    kc, vc = case.filled(TritonAttentionBackend())
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        got = backend.attend(case.q, kc, vc, case.meta, scale, **case.scales())
        rel = float((got - full).norm() / full.norm())
        # E4M3 keeps 3 mantissa bits: each value moves by up to 2**-4 relative, ~2.7% RMS (a row that sees one
        # key returns its value, so that is the floor here); a wrong scale or rounding would be far off
        assert 0.01 < rel < 0.05, rel


# ---------------------------------------------------------------- copies move bytes


def random_fp8(shape, seed):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8).to(
        DEVICE).view(FP8)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_copy_exited_and_copy_slots_move_fp8_bytes(name):
    backend = TorchAttentionBackend() if name == "torch" else TritonAttentionBackend()
    shape = (3, 12, 4, 2, 16)  # [layers, blocks, block_size, kv_heads, D]
    k_cache, v_cache = random_fp8(shape, 0), random_fp8(shape, 1)
    flat = lambda t: t.view(torch.uint8).view(shape[0], -1, *shape[3:])  # noqa: E731
    gen = torch.Generator().manual_seed(2)
    slots = torch.randperm(11 * 4, generator=gen)[:16].view(4, 4).to(DEVICE)  # [rows, planes]; last block scratch
    loops = torch.tensor([1, 3, 4, 2], device=DEVICE)
    exits = torch.tensor([True, True, True, False], device=DEVICE)
    want_k, want_v = flat(k_cache).clone(), flat(v_cache).clone()
    for b in range(4):
        e = int(loops[b])
        for p in range(e, 4) if exits[b] else ():
            want_k[:, slots[b, p]] = flat(k_cache)[:, slots[b, e - 1]]
            want_v[:, slots[b, p]] = flat(v_cache)[:, slots[b, e - 1]]
    assert not torch.equal(want_k, flat(k_cache))
    backend.copy_exited(k_cache, v_cache, slots, loops, exits, 11 * 4)
    assert torch.equal(flat(k_cache), want_k) and torch.equal(flat(v_cache), want_v)

    src = torch.tensor([0, 5, 9, 2], device=DEVICE)
    dst = torch.tensor([12, 19, 3, 7], device=DEVICE)
    want_k[:, dst], want_v[:, dst] = want_k[:, src], want_v[:, src]
    backend.copy_slots(k_cache, v_cache, src, dst)
    assert torch.equal(flat(k_cache), want_k) and torch.equal(flat(v_cache), want_v)


# ---------------------------------------------------------------- other caches ignore the scales


@pytest.mark.parametrize("name", ["torch", pytest.param("triton", marks=pytest.mark.slow)])  # (triton: ~4 s, slow)
def test_scales_leave_other_caches_alone(name):
    make = (lambda: TorchAttentionBackend()) if name == "torch" else (
        lambda: TritonAttentionBackend(num_splits=2, decode_launch=DecodeLaunch(block_n=16)))
    case, history, (q, k, v, rope) = fused_case([3, 20, 9], 4, 2)
    runs = []
    for scales in ({}, case.scales()):
        backend = make()
        kc, vc = case.empty(torch.float32)
        backend.write_kv(kc, vc, case.k[history], case.v[history], write_meta(case.slots[history]), **scales)
        launches = []
        with spy_on_kernel("decode_attention_kernel", launches):  # the fused kernel with Triton (2 splits)
            out = backend.rotate_store_attend(kc, vc, q, k, v, rope, case.meta, 0.25, **scales)
        assert len(launches) == (name == "triton")
        again = backend.attend(out, kc, vc, case.meta, 0.25, **scales)
        runs.append([out, again, kc, vc])
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # bit for bit (NaN slots too)


# ---------------------------------------------------------------- the per-layer binding


def test_paged_attention_passes_each_layers_scales():
    case = make_case([(1, 9), (2, 6)], 4, 2)
    layers = 3
    kc = torch.full((layers, case.num_blocks, case.block_size, 2, 16), 0x7F, dtype=torch.uint8, device=DEVICE)
    kc, vc = kc.view(FP8), kc.clone().view(FP8)
    k_scale = torch.stack([case.k_scale * (i + 1) for i in range(layers)])
    v_scale = torch.stack([case.v_scale / (i + 1) for i in range(layers)])
    n = case.q.shape[0]
    k, v = case.k[:n] * 2, case.v[:n] * 2
    rope = Rope(*rotary_cos_sin(torch.arange(n, device=DEVICE), 16, 10000.0, torch.float32))
    backend = TorchAttentionBackend()
    for layer in range(layers):
        kc[layer].view(-1, 2, 16).view(torch.uint8)[case.slots] = quantize_fp8(case.k, k_scale[layer]).view(torch.uint8)
        vc[layer].view(-1, 2, 16).view(torch.uint8)[case.slots] = quantize_fp8(case.v, v_scale[layer]).view(torch.uint8)
    want_k, want_v = kc[1].clone(), vc[1].clone()
    want = backend.rotate_store_attend(want_k, want_v, case.q, k, v, rope, case.meta, 0.25, k_scale=k_scale[1],
                                       v_scale=v_scale[1])
    got = PagedAttention(backend, kc, vc, case.meta, 0.25, k_scale=k_scale, v_scale=v_scale)(1, case.q, k, v, rope)
    assert torch.equal(got, want) and torch.equal(as_bytes(kc[1]), as_bytes(want_k))
    other = backend.rotate_store_attend(want_k, want_v, case.q, k, v, rope, case.meta, 0.25, k_scale=k_scale[0],
                                        v_scale=v_scale[0])
    assert not torch.allclose(got, other)  # another layer's scales give another result
    with pytest.raises(ValueError, match="k_scale"):
        PagedAttention(backend, kc, vc, case.meta, 0.25, k_scale=k_scale[0], v_scale=v_scale)


# ---------------------------------------------------------------- compiled for the GPU


_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loopline.attention import triton_kernels as t

ptrs = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
        "block_tables_ptr": "*i32", "work_tiles_ptr": "*i32", "slot_mapping_ptr": "*i64", "arrivals_ptr": "*i32"}
attn = {"G": 2, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_SIZE": 16, "HEAD_DIM": 128, "D_PAD": 128, "NUM_SPLITS": 2,
        "DOT_PRECISION": "tf32"}
cases = {
    "paged_attention": (t.paged_attention_kernel, {**attn, "TILE_T": 8, "WORK_LIST": True}),
    "decode_attention": (t.decode_attention_kernel, {**attn, "PREFETCH": False, "SPLITS_PAD": 2, "LAST_MERGES": False}),
    "decode_attention_prefetch": (t.decode_attention_kernel, {**attn, "PREFETCH": True, "SPLITS_PAD": 2,
                                                              "LAST_MERGES": False}),
    "rope_write_kv": (t.rope_write_kv_kernel, {"BLOCK_SIZE": 16, "HALF": 64, "HALF_PAD": 64, "BLOCK_H": 4, "ROTATE": True}),
    "write_kv": (t.rope_write_kv_kernel, {"BLOCK_SIZE": 16, "HALF": 64, "HALF_PAD": 64, "BLOCK_H": 4, "ROTATE": False}),
}
out = {}
for name, (kernel, constants) in cases.items():
    signature = {a: "constexpr" if a in constants or a == "PDL" else
                 ptrs.get(a, "*bf16") if a.endswith("_ptr") else "fp32" if a == "qk_scale" else "i32"
                 for a in kernel.arg_names}
    ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs={**constants, "PDL": True}),
                         target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": 2, "launch_pdl": True}).asm["ptx"]
    out[name] = [x.strip() for x in ptx.splitlines()
                 if re.search(r"griddepcontrol|\b(ld|st)\.global|\bret;|\bcvt\.\S*e4m3", x)]
print(json.dumps(out))
"""


@pytest.mark.slow  # a fresh interpreter compiling every kernel for sm_90 (~6 s on 2 cores); default run:
# tests/kernels/test_pdl.py reads the compiled kernels' PTX the same way
def test_fp8_kernels_compile_for_hopper():
    """The FP8 variants as an H100/H200 (sm_90) compiles them, without a GPU: stores round with the hardware
    conversion (round to nearest even, saturating), tiles widen in registers (to fp16: one conversion), and
    before the grid-dependency wait the attention kernels read only what no kernel of a step writes: the
    scales and the row's length (``evict_last``) and the fused decode kernel's prefetched history."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # the compiled kernels, in a fresh process
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = json.loads(run.stdout.strip().splitlines()[-1])
    for name in ("rope_write_kv", "write_kv"):
        assert any(re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", x) for x in ptx[name]), name
    for name in ("paged_attention", "decode_attention", "decode_attention_prefetch"):
        assert any(re.search(r"cvt\.rn\.f16x2\.e4m3x2", x) for x in ptx[name]), name  # the widening
    for name, lines in ptx.items():
        wait = next((i for i, x in enumerate(lines) if "griddepcontrol.wait" in x), None)
        if wait is None:  # a triton without grid dependency control
            continue
        early = [x for x in lines[:wait] if re.search(r"\b(ld|st)\.global|\bret;", x)]
        if name == "decode_attention_prefetch":
            assert early and all("evict_first" in x or "evict_last" in x for x in early), early
        elif name in ("decode_attention", "paged_attention"):
            assert all("evict_last" in x for x in early), early  # the scales (and the row's length)
        else:
            assert not early, (name, early)


# ---------------------------------------------------------------- GPU, bf16 model


@pytest.mark.gpu
@gpu
def test_gpu_bf16_model_fp8_cache():
    """The engine's dtypes on the GPU: a bf16 model over an FP8 cache, fused decode and mixed steps."""
    case, history, (q, k, v, rope) = fused_case([1, 200, 1000, 37], 16, 4)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    rope = Rope(*rotary_cos_sin(case.meta.seq_lens.long() - 1, 16, 10000.0, torch.bfloat16))
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend(num_splits=8)):
        kc, vc = case.filled(keep=history)
        out = backend.rotate_store_attend(kc, vc, q, k, v, rope, case.meta, 0.25, **case.scales())
        results.append((out.float(), as_bytes(kc), as_bytes(vc)))
    # bf16 rounds the probabilities in Triton, and a row's own key may land one FP8 step apart (below): close
    # as a whole, not element by element (measured on an H200: 25 of 1,024 elements beyond 2e-2)
    got, want = results[1][0], results[0][0]
    assert float((got - want).norm() / want.norm()) < 0.02
    assert torch.equal(results[1][2], results[0][2])
    # K within one fp8 step where bf16 rotary rounds differently in Triton than in torch
    assert (results[1][1].int() - results[0][1].int()).abs().max() <= 1
    case = make_case([(1, 700), (300, 900), (1, 5), (64, 64)], 16, 4, head_dim=16, block_size=16)
    kc, vc = case.filled(TritonAttentionBackend())
    q = case.q.bfloat16()
    want = TorchAttentionBackend().attend(q, kc, vc, case.meta, 0.25, **case.scales())
    got = TritonAttentionBackend().attend(q, kc, vc, case.meta, 0.25, **case.scales())
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
