"""The FlashInfer backend's CPU-testable parts: the device page table (every plane), selection and input
errors, and the backend's plumbing (one plan per decode row count, an exact plan per prompt step, the page
table rewritten every step) against a stand-in for FlashInfer that attends from the CSR buffers at run time.
The real kernels are compared with Triton in test_flashinfer_gpu.py."""
from __future__ import annotations

import importlib.util
import sys
import types
from typing import ClassVar

import numpy as np
import pytest
import torch

from loopline import EngineArgs
from loopline.attention import (
    auto_attention_backend,
    flashinfer_unavailable_reason,
    get_attention_backend,
    not_provided_reason,
)
from loopline.attention.base import PagedAttentionMetadata
from loopline.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    check_flashinfer_inputs,
    flashinfer_page_table,
    page_table_capacity,
)
from loopline.attention.torch_backend import TorchAttentionBackend
from loopline.errors import InvalidRequestError


def python_page_table(tables: np.ndarray, lens: list[int], block_size: int):
    """The CSR page table built row by row, as FlashInfer's docs describe it."""
    indptr, indices, last = [0], [], []
    for row, n in zip(tables, lens):
        pages = -(-n // block_size)
        indices += [int(b) for b in row[:pages]]
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * block_size)
    return indptr, indices, last


def plane_rows(num_requests, num_planes, block_size, width, seed):
    """Rows as the runner builds them: (request, plane) pairs, each row the table of its own plane (distinct
    pages per plane), lengths including 1, exact page multiples and a full table."""
    rng = np.random.default_rng(seed)
    pages = rng.permutation(num_requests * num_planes * width + 5).astype(np.int32)
    tables, lens, owner = [], [], []
    for r in range(num_requests):
        n = [1, block_size, block_size * width, int(rng.integers(2, block_size * width))][r % 4]
        for p in range(num_planes):
            start = (r * num_planes + p) * width
            tables.append(pages[start:start + width])
            lens.append(n)
            owner.append((r, p))
    return np.stack(tables), lens, owner


@pytest.mark.parametrize("num_planes", [1, 4], ids=["shared", "last_exited"])
@pytest.mark.parametrize("block_size,width", [(4, 5), (16, 3), (1, 7)])
def test_page_table_equals_a_python_construction_for_every_plane(num_planes, block_size, width):
    tables, lens, owner = plane_rows(6, num_planes, block_size, width, seed=block_size)
    rows = len(lens)
    indptr = torch.full((rows + 1,), -7, dtype=torch.int32)
    indices = torch.full((page_table_capacity(rows, width) + 3,), -7, dtype=torch.int32)  # a larger buffer too
    last = torch.full((rows,), -7, dtype=torch.int32)
    flashinfer_page_table(torch.from_numpy(tables), torch.tensor(lens, dtype=torch.int32), block_size, indptr,
                          indices, last)
    want_indptr, want_indices, want_last = python_page_table(tables, lens, block_size)
    assert indptr.tolist() == want_indptr
    assert indices[:want_indptr[-1]].tolist() == want_indices
    assert last.tolist() == want_last
    assert all(1 <= x <= block_size for x in last.tolist())
    # rows of one request at different planes read different pages (their planes' tables)
    by_row = [set(want_indices[want_indptr[i]:want_indptr[i + 1]]) for i in range(rows)]
    for i, (r, p) in enumerate(owner):
        for j, (r2, p2) in enumerate(owner):
            if r == r2 and p != p2:
                assert not by_row[i] & by_row[j]


def test_page_table_of_padded_graph_rows():
    # a graph bucket's padding rows: length 1 on the scratch block; tables wider than any row needs
    tables = torch.tensor([[3, 4, 0, 0], [9, 0, 0, 0], [99, 99, 99, 99], [99, 99, 99, 99]], dtype=torch.int32)
    lens = torch.tensor([5, 2, 1, 1], dtype=torch.int32)
    indptr, indices, last = (torch.zeros(5, dtype=torch.int32), torch.zeros(17, dtype=torch.int32),
                             torch.zeros(4, dtype=torch.int32))
    flashinfer_page_table(tables, lens, 4, indptr, indices, last)
    assert indptr.tolist() == [0, 2, 3, 4, 5]
    assert indices[:5].tolist() == [3, 4, 9, 99, 99]
    assert last.tolist() == [1, 2, 1, 1]


def test_page_table_buffer_too_small_is_an_internal_error():
    with pytest.raises(AssertionError):
        flashinfer_page_table(torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 4,
                              torch.zeros(3, dtype=torch.int32), torch.zeros(6, dtype=torch.int32),
                              torch.zeros(2, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------- selection


def test_flashinfer_is_a_choice_and_other_spellings_are_named():
    EngineArgs(attention_backend="flashinfer").validate()
    for name in ("FLASHINFER", "flash-infer"):
        with pytest.raises(InvalidRequestError, match="spells it 'flashinfer'") as e:
            EngineArgs(attention_backend=name).validate()
        assert e.value.param == "attention_backend"
    assert not_provided_reason("flashinfer") is None
    with pytest.raises(InvalidRequestError) as e:
        EngineArgs(kernel_backend="flashinfer").validate()
    assert e.value.param == "kernel_backend"
    with pytest.raises(InvalidRequestError, match="no flash_attn backend"):
        EngineArgs(attention_backend="flash_attn").validate()


def test_flashinfer_needs_cuda():
    with pytest.raises(InvalidRequestError, match="needs a CUDA device, got 'cpu'") as e:
        get_attention_backend("flashinfer", torch.device("cpu"))
    assert e.value.param == "attention_backend"


def test_flashinfer_needs_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == "flashinfer" else real(mod, *a))
    why = flashinfer_unavailable_reason(torch.device("cuda"))
    assert "pip install 'loopline[flashinfer]'" in why and "0.7.4" in why
    with pytest.raises(InvalidRequestError, match=r"loopline\[flashinfer\]") as e:
        get_attention_backend("flashinfer", torch.device("cuda"))
    assert e.value.param == "attention_backend"


def test_auto_stays_triton_on_cuda():
    assert auto_attention_backend(torch.device("cuda")) == "triton"
    assert auto_attention_backend(torch.device("cpu")) == "torch"


def test_inputs_it_cannot_serve_are_refused_naming_the_option():
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(3, 4, 2, 64, dtype=torch.bfloat16)
    check_flashinfer_inputs(q, kv, kv)
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
        check_flashinfer_inputs(q, kv.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        check_flashinfer_inputs(q.float(), kv.float(), kv.float())


# ---------------------------------------------------------------------------------------------- plumbing


class FakeWrapper:
    """FlashInfer's paged prefill wrapper as the backend uses it: plan() copies host arrays into caller buffers
    (graph mode) or keeps the given tensors; run() attends from whatever the buffers hold at run time."""

    plans: ClassVar[list] = []  # every plan() of the test: (graph mode, rows, split-KV disabled)

    def __init__(self, float_workspace, kv_layout, use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 backend="auto"):
        assert kv_layout == "NHD" and backend == "fa2"
        self.graph = use_cuda_graph
        self.bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)

    def plan(self, qo_indptr, indptr, indices, last, *, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
             causal, sm_scale, q_data_type, kv_data_type, disable_split_kv, uniform_q_len=None):
        assert causal and qo_indptr.device.type == "cpu"
        assert uniform_q_len in (None, 1) and (uniform_q_len is None) != self.graph
        FakeWrapper.plans.append((self.graph, len(qo_indptr) - 1, disable_split_kv))
        if self.graph:
            assert len(qo_indptr) == len(self.bufs[0])
            for buf, x in zip(self.bufs, (qo_indptr, indptr, indices, last)):
                buf[:len(x)].copy_(x)
        else:
            self.bufs = (qo_indptr, indptr, indices, last)
        self.page_size, self.scale = page_size, sm_scale

    def run(self, q, kv, out, enable_pdl):
        qo, indptr, indices, last = (b.tolist() for b in self.bufs)
        k_cache, v_cache = kv
        ps = self.page_size
        for b in range(len(qo) - 1):
            pages = indices[indptr[b]:indptr[b + 1]]
            n = (len(pages) - 1) * ps + last[b]
            slots = torch.tensor([pages[p // ps] * ps + p % ps for p in range(n)])
            k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].float()
            v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].float()
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            qb = q[qo[b]:qo[b + 1]].float()
            s = torch.einsum("qhd,shd->hqs", qb, k) * self.scale
            qpos = torch.arange(n - qb.shape[0], n)
            s = s.masked_fill(torch.arange(n)[None, None, :] > qpos[None, :, None], float("-inf"))
            out[qo[b]:qo[b + 1]] = torch.einsum("hqs,shd->qhd", s.softmax(-1), v).to(out.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    FakeWrapper.plans = []
    monkeypatch.setitem(sys.modules, "flashinfer",
                        types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=FakeWrapper))
    monkeypatch.setattr("loopline.attention.flashinfer_backend.FLOAT_WORKSPACE_BYTES", 16)


def paged_step(q_lens, seq_lens, block_size=4, heads=4, kv_heads=2, d=16, seed=0, num_blocks=40):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-s // block_size) for s in seq_lens)
    perm = torch.randperm(num_blocks, generator=gen)[:len(seq_lens) * width].view(len(seq_lens), width)
    k = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    q = torch.randn(sum(q_lens), heads, d, generator=gen)
    meta = PagedAttentionMetadata(torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32),
                                  torch.tensor(seq_lens, dtype=torch.int32), perm.to(torch.int32),
                                  torch.zeros(sum(q_lens), dtype=torch.int64), max(q_lens), max(seq_lens))
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), meta


def close(got, want):
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_backend_plumbing_against_the_reference(fake_flashinfer):
    backend = FlashInferAttentionBackend("cpu")
    ref = TorchAttentionBackend()
    scale = 0.25
    # decode-only steps: one plan per row bucket (3 and 4 rows: 4, the 3-row steps padded), reused by later steps
    # of other lengths and tables
    for seed, lens in enumerate(([5, 9, 1], [6, 10, 2], [13, 3, 8], [2, 16, 7, 1])):
        q, k, v, meta = paged_step([1] * len(lens), lens, seed=seed)
        for _ in range(2):  # two layers of one step: the page table is written once
            got = backend.attend(q, k, v, meta, scale)
            assert got.shape == q.shape
            close(got, ref.attend(q, k, v, meta, scale))
    assert FakeWrapper.plans == [(True, 4, True)]
    q, k, v, meta = paged_step([1, 1], [4, 7], seed=5)  # another bucket: its own plan
    close(backend.attend(q, k, v, meta, scale), ref.attend(q, k, v, meta, scale))
    assert FakeWrapper.plans[-1] == (True, 2, True)
    # steps with prompt chunks: planned every step from the device arrays (split-KV left to FlashInfer)
    for seed, (q_lens, lens) in enumerate((([1, 5, 3], [9, 5, 12]), ([2, 1], [2, 16]))):
        q, k, v, meta = paged_step(q_lens, lens, seed=10 + seed)
        close(backend.attend(q, k, v, meta, scale), ref.attend(q, k, v, meta, scale))
    assert FakeWrapper.plans[-2:] == [(False, 3, False), (False, 2, False)]


def test_a_wider_decode_step_gets_a_new_plan_and_keeps_the_old(fake_flashinfer):
    backend = FlashInferAttentionBackend("cpu")
    for lens in ([3, 4], [30, 2]):  # 1 page, then 8 pages a row (one bucket of 2 rows)
        q, k, v, meta = paged_step([1, 1], lens, seed=len(lens))
        close(backend.attend(q, k, v, meta, 0.5), TorchAttentionBackend().attend(q, k, v, meta, 0.5))
    assert len(FakeWrapper.plans) == 2 and len(backend._retired) == 1  # a captured graph may still read it


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_engine_steps_through_the_backend(fake_flashinfer, layout):
    """A bf16 engine on the CPU with the backend over the stand-in equals the same engine on the torch reference:
    decode rows whose tables the device derives (every loop's plane), prompt chunks, mixed steps, early exits and
    their copies, arrivals. Both store K/V with the torch backend's ops (the Triton store kernels, which the GPU
    tests cover, take minutes in the CPU interpreter), so only the attention's read path differs."""
    from engine_testing import run_arrivals, small_gqa_model, tokens_depths_logprobs

    from loopline import SamplingParams
    from loopline.engine import LLMEngine
    from loopline.models.ops import TORCH_OPS
    from loopline.worker.backends import Backends
    from loopline.worker.decode_state import SlotOps

    model = small_gqa_model("cpu").bfloat16()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=0.6, logprobs=0)
    requests = {f"r{i}": ([(i * 31 + j) % 250 for j in range(n)], params) for i, n in enumerate([5, 23, 11])}
    out = {}
    flashinfer = FlashInferAttentionBackend("cpu")
    flashinfer._store = TorchAttentionBackend()
    for name, attn in (("flashinfer", flashinfer), ("reference", TorchAttentionBackend())):
        engine = LLMEngine(EngineArgs(device="cpu", dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=3,
                                      num_kv_blocks=80, block_size=4, max_num_batched_tokens=16, max_model_len=64,
                                      kv_layout=layout),
                           model=model, backends=Backends(attn, TORCH_OPS, SlotOps()))
        out[name] = tokens_depths_logprobs(run_arrivals(engine, requests, arrivals={"r2": 3}))
    for rid, (tokens, depths, logprobs) in out["reference"].items():
        assert out["flashinfer"][rid][:2] == (tokens, depths), rid
        torch.testing.assert_close(out["flashinfer"][rid][2], logprobs, atol=1e-3, rtol=1e-3)
    assert any(d < model.config.total_ut_steps for _, ds, _ in out["reference"].values() for d in ds)  # exits ran
    plans = FakeWrapper.plans
    assert any(graph for graph, _, _ in plans) and any(not graph for graph, _, _ in plans)  # both kinds of step
