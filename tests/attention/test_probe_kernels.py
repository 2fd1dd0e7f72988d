"""The experimental kernels of the GPU probes compute what they claim, so that what a probe times is a correct
kernel: tools/decode_kernel_probe.py's attention kernels (and its gather read), tools/coresidency_probe.py's
GEMM. Interpreted on the CPU, fp32."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from triton_testing import DEVICE  # first: it sets TRITON_INTERPRET before triton is imported

from loopline.attention.base import PagedAttentionMetadata

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
probe = pytest.importorskip("decode_kernel_probe")
coresidency = pytest.importorskip("coresidency_probe")


def paged_case(seq_lens: list[int], heads: int = 4, head_dim: int = 32, block_size: int = 16):
    """fp32 K/V in shuffled pages, one query per row."""
    g = torch.Generator().manual_seed(0)
    pages = -(-max(seq_lens) // block_size)
    rows = len(seq_lens)
    perm = torch.randperm(rows * pages, generator=g).to(torch.int32)
    shape = (rows * pages, block_size, heads, head_dim)
    k_cache, v_cache, q = (torch.randn(s, generator=g).to(DEVICE) for s in (shape, shape, (rows, heads, head_dim)))
    meta = PagedAttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=perm.view(rows, pages).to(DEVICE),
        slot_mapping=torch.zeros(rows, dtype=torch.int64, device=DEVICE), max_query_len=1, max_seq_len=max(seq_lens))
    return q, k_cache, v_cache, meta


SEQ_LENS = [70, 1, 16, 33]  # a ragged last page, a single key, exactly one page, one key past two


@pytest.mark.parametrize("name,params", probe.VARIANTS, ids=[f"{n}{p}" for n, p in probe.VARIANTS])
def test_probe_kernel_matches_reference(name, params):
    q, k_cache, v_cache, meta = paged_case(SEQ_LENS)
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    probe.launch(name, params, q, k_cache, v_cache, meta, scale, out)
    torch.testing.assert_close(out, probe.reference(q, k_cache, v_cache, meta, scale), atol=1e-5, rtol=1e-5)


def test_gather_read_sums_each_rows_pages():
    q, k_cache, v_cache, meta = paged_case(SEQ_LENS)
    sink = probe.gather_read(k_cache, v_cache, meta, hg=2, pages=2, warps=4)
    bs = k_cache.shape[1]
    for r, n in enumerate(SEQ_LENS):
        blocks = meta.block_tables[r, : -(-n // bs)].long()
        want = (k_cache[blocks].flatten(0, 1)[:n] + v_cache[blocks].flatten(0, 1)[:n]).sum(0)  # [heads, d]
        torch.testing.assert_close(sink[r], want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("per_sm", [0, 1], ids=["tile-per-program", "persistent"])
def test_coresidency_gemm_matches_torch(per_sm):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(70, 128, generator=g).to(DEVICE), torch.randn(96, 128, generator=g).to(DEVICE)
    out = torch.full((70, 96), float("nan"), device=DEVICE)
    coresidency.triton_linear(x, w, out, 32, 32, 32, 1, 4, per_sm)  # ragged last tiles in M and N
    ref = x.double() @ w.double().T
    # the interpreter computes in fp32; on a GPU the fp32 dot runs on tensor cores in tf32 (~1e-3 relative)
    tol = dict(atol=1e-4, rtol=1e-5) if DEVICE == "cpu" else dict(atol=0.1, rtol=1e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    assert (out - ref.float()).norm() / ref.norm() < (1e-6 if DEVICE == "cpu" else 2e-3)
