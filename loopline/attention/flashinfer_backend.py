"""Paged attention with FlashInfer's FA2 kernels (``attention_backend="flashinfer"``, the ``flashinfer`` extra).

Design (docs/design.md, "Attention backends"): the K/V store, rotary store and the
exit copy are the Triton backend's kernels; ``attend`` runs FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper`` (one-query rows included). Its page table
(CSR ``indptr`` / ``indices`` / ``last_page_len``) is built on the device from the
step's block tables and lengths (:func:`flashinfer_page_table`), so decode rows whose
tables exist only on the device need no host copy. Plans never depend on key lengths
(``disable_split_kv``): decode-only steps plan once per row bucket (graph-safe, no
sync); steps with prompt chunks plan from the device arrays (one host sync, eager).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from loopline.attention.base import (
    AttentionBackend,
    PagedAttentionMetadata,
    is_fp8_kv,
    next_pow2,
)
from loopline.models.ops import Rope

FLASHINFER_VERSION = "0.7.4"  # the version the extra pins and the GPU run uses
FLOAT_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace: split-KV partials of eager plans
_DTYPES = (torch.bfloat16, torch.float16)


def flashinfer_page_table(block_tables: Tensor, seq_lens: Tensor, block_size: int, indptr: Tensor,
                          indices: Tensor, last_page_len: Tensor) -> None:
    """Writes FlashInfer's CSR page table of a step's rows into the given buffers.

    ``block_tables`` ``[B, W]`` (each row's own plane), ``seq_lens`` ``[B]``; outputs: ``indptr`` ``[B + 1]``
    (cumulative page counts), ``indices`` ``[>= B * W + 1]`` (row 0's pages, then row 1's, ...; entries past
    ``indptr[B]`` are unspecified, the last one is a dump slot), ``last_page_len`` ``[B]`` in ``1..block_size``
    (a row's length is ``(pages - 1) * block_size + last_page_len``). Fixed-shape torch ops only: no host
    sync, capturable in a CUDA graph, and the same on the CPU (tests)."""
    rows, width = block_tables.shape
    assert indptr.shape[0] == rows + 1 and last_page_len.shape[0] == rows and indices.shape[0] > rows * width
    lens = seq_lens.to(torch.int32)
    pages = torch.clamp((lens + block_size - 1) // block_size, max=width)
    indptr[:1].zero_()
    torch.cumsum(pages, 0, dtype=torch.int32, out=indptr[1:])
    last_page_len.copy_(lens - (pages - 1) * block_size)
    cols = torch.arange(width, device=block_tables.device, dtype=torch.int32)
    dst = indptr[:-1, None] + cols[None, :]  # [B, W] where each table entry goes, if it is a page of the row
    dump = indices.shape[0] - 1
    dst = torch.where(cols[None, :] < pages[:, None], dst, dump).long()
    indices.scatter_(0, dst.reshape(-1), block_tables.reshape(-1).to(indices.dtype))


def decode_bucket(rows: int) -> int:
    """Rows a decode-only step of ``rows`` rows is planned for: the next power of two. Each planned wrapper holds
    16 MiB of FlashInfer workspace (device + pinned), so plans are kept per bucket, not per row count; padding
    rows attend one key of a real page and their outputs are dropped."""
    return next_pow2(rows)


def page_table_capacity(rows: int, width: int) -> int:
    """Entries of an ``indices`` buffer for ``rows`` rows of up to ``width`` pages (and the dump slot)."""
    return rows * width + 1


@dataclass
class _DecodePlan:
    """A graph-mode wrapper planned for ``rows`` one-query rows, and the page-table buffers it reads."""

    wrapper: Any
    rows: int
    width: int  # pages per row the indices buffer holds
    qo_indptr: Tensor
    indptr: Tensor
    indices: Tensor
    last_page_len: Tensor


class FlashInferAttentionBackend(AttentionBackend):
    """``attend`` on FlashInfer; stores, rotary and the exit copy on the Triton kernels.

    Decode-only steps (every row one query) run a wrapper planned once per row bucket
    (:func:`decode_bucket`); the plan depends on nothing else, so steps and CUDA graphs share it. Steps with
    prompt chunks plan each step from the device arrays (one host sync; refused inside a
    CUDA graph capture)."""

    name = "flashinfer"
    graph_steps = "decode"  # steps with prompt chunks plan on the host (_plan_eager)

    def __init__(self, device: torch.device | str = "cuda") -> None:
        import flashinfer  # lazy: the extra is optional; the caller checked it is installed

        from loopline.attention.triton_backend import TritonAttentionBackend

        self._flashinfer = flashinfer
        self.device = torch.device(device)  # CUDA (get_attention_backend checks it; tests stub FlashInfer on the CPU)
        self._store = TritonAttentionBackend()  # K/V store, rotary store, exit copy
        self._float_workspace = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode_plans: dict[tuple, _DecodePlan] = {}
        self._retired: list[_DecodePlan] = []  # outgrown plans a captured graph may still read
        self._eager = None  # the wrapper of steps with prompt chunks (planned every step)
        # the step's metadata, its wrapper and the rows it was planned for, and whether it was prepared inside a
        # CUDA graph capture
        self._step: tuple[PagedAttentionMetadata | None, tuple[Any, int], bool] = (None, (None, 0), False)

    # ------------------------------------------------------------------ the Triton kernels

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, meta: PagedAttentionMetadata, *,
                 k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
        self._store.write_kv(k_cache, v_cache, k, v, meta, k_scale=k_scale, v_scale=v_scale)

    def rotate_and_write_kv(self, k_cache: Tensor, v_cache: Tensor, q: Tensor, k: Tensor, v: Tensor, rope: Rope,
                            meta: PagedAttentionMetadata, *, k_scale: Tensor | None = None,
                            v_scale: Tensor | None = None) -> Tensor:
        return self._store.rotate_and_write_kv(k_cache, v_cache, q, k, v, rope, meta, k_scale=k_scale,
                                               v_scale=v_scale)

    def copy_exited(self, k_cache: Tensor, v_cache: Tensor, plane_slots: Tensor, loops: Tensor, exits: Tensor,
                    scratch_slot: int) -> None:
        self._store.copy_exited(k_cache, v_cache, plane_slots, loops, exits, scratch_slot)

    # ------------------------------------------------------------------ attend

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMetadata, scale: float, *,
               k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
        check_flashinfer_inputs(q, k_cache, v_cache)
        n, heads, d = q.shape
        out = torch.empty_like(q)
        if n == 0 or meta.seq_lens.shape[0] == 0:
            return out
        # once per step (every layer of a step shares its metadata), and again when a capture begins: a graph
        # must hold the page table's kernels even if the same metadata ran eagerly before
        capturing = _capturing()
        if self._step[0] is not meta or self._step[2] != capturing:
            self._step = (meta, self._prepare(q, k_cache, meta, scale), capturing)
        wrapper, planned = self._step[1]
        if planned > n:  # a decode bucket's padding rows (zero queries, outputs dropped)
            q = torch.cat([q, q.new_zeros(planned - n, heads, d)])
            out = torch.empty_like(q)
        q = q if q.is_contiguous() else q.contiguous()
        # NOTE: no PDL: the Triton kernels launched after this one load step inputs before their grid-dependency
        # wait, which is safe only behind a plain launch (docs/design.md, "A decode row's attention as one kernel")
        wrapper.run(q, (k_cache, v_cache), out=out, enable_pdl=False)
        return out[:n]

    def _prepare(self, q: Tensor, k_cache: Tensor, meta: PagedAttentionMetadata, scale: float) -> tuple[Any, int]:
        """The step's wrapper and the rows it runs, its page table written (and, for steps with prompt chunks,
        planned)."""
        rows, width = meta.block_tables.shape
        if not (meta.max_query_len == 1 and q.shape[0] == rows):
            return self._plan_eager(q, k_cache, meta, scale), rows
        bucket = decode_bucket(rows)
        plan = self._decode_plan(q, k_cache, bucket, width, scale)
        tables, lens = meta.block_tables, meta.seq_lens
        if bucket > rows:  # padding rows: one key of row 0's first page (a real page), length 1
            tables = torch.cat([tables, tables[:1].expand(bucket - rows, -1)])
            lens = torch.cat([lens, lens.new_ones(bucket - rows)])
        flashinfer_page_table(tables, lens, k_cache.shape[1], plan.indptr, plan.indices, plan.last_page_len)
        return plan.wrapper, bucket

    def _plan_args(self, q: Tensor, k_cache: Tensor, scale: float) -> dict:
        _, block_size, kvh, d = k_cache.shape
        return {"num_qo_heads": q.shape[1], "num_kv_heads": kvh, "head_dim_qk": d, "page_size": block_size,
                "causal": True, "sm_scale": scale, "q_data_type": q.dtype, "kv_data_type": k_cache.dtype,
                "disable_split_kv": True}

    def _decode_plan(self, q: Tensor, k_cache: Tensor, rows: int, width: int, scale: float) -> _DecodePlan:
        """The planned wrapper of ``rows`` one-query rows (made and planned on first use, outside any capture)."""
        key = (rows, q.shape[1], k_cache.shape[1:], q.dtype, k_cache.dtype, scale)
        plan = self._decode_plans.get(key)
        if plan is not None and plan.width >= width:
            return plan
        if _capturing():
            raise RuntimeError(f"flashinfer: no plan for {rows} decode rows of {width} pages before CUDA graph "
                               "capture (the warm-up run plans it)")
        if plan is not None:
            self._retired.append(plan)  # a captured graph may read its buffers
        width = next_pow2(width)  # room to grow before the next plan
        dev = self.device
        bufs = {"qo_indptr": torch.arange(rows + 1, dtype=torch.int32, device=dev),
                "indptr": torch.arange(rows + 1, dtype=torch.int32, device=dev),
                "indices": torch.zeros(page_table_capacity(rows, width), dtype=torch.int32, device=dev),
                "last_page_len": torch.ones(rows, dtype=torch.int32, device=dev)}
        wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._float_workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=bufs["qo_indptr"],
            paged_kv_indptr_buf=bufs["indptr"], paged_kv_indices_buf=bufs["indices"],
            paged_kv_last_page_len_buf=bufs["last_page_len"], backend="fa2")
        # The plan reads only the query layout (one query a row) and the row count: one page per row stands in
        # for the lengths, which the kernels read from the page table written each step.
        host = torch.arange(rows + 1, dtype=torch.int32)
        wrapper.plan(host, host, torch.zeros(rows, dtype=torch.int32), torch.ones(rows, dtype=torch.int32),
                     uniform_q_len=1, **self._plan_args(q, k_cache, scale))  # (query tiles sized for one query)
        plan = self._decode_plans[key] = _DecodePlan(wrapper, rows, width, **bufs)
        return plan

    def _plan_eager(self, q: Tensor, k_cache: Tensor, meta: PagedAttentionMetadata, scale: float) -> Any:
        """A step with prompt chunks: page table on the device, then a plan from it (exact lengths, FlashInfer's
        own split-KV). Reading the query offsets is a host sync, so no CUDA graph can hold such a step."""
        if _capturing():
            raise RuntimeError("attention_backend='flashinfer' cannot capture steps with prompt chunks in a CUDA "
                               "graph: their plan needs the query offsets on the host (docs/design.md, "
                               "'Attention backends'); capture decode-only steps or run eagerly")
        rows, width = meta.block_tables.shape
        dev = self.device
        indptr = torch.empty(rows + 1, dtype=torch.int32, device=dev)
        indices = torch.empty(page_table_capacity(rows, width), dtype=torch.int32, device=dev)
        last = torch.empty(rows, dtype=torch.int32, device=dev)
        flashinfer_page_table(meta.block_tables, meta.seq_lens, k_cache.shape[1], indptr, indices, last)
        if self._eager is None:
            self._eager = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._float_workspace, "NHD",
                                                                              backend="fa2")
        args = self._plan_args(q, k_cache, scale) | {"disable_split_kv": False}
        self._eager.plan(meta.query_start_loc.to("cpu", torch.int32), indptr, indices, last, **args)
        return self._eager


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_flashinfer_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """Refuses what the FlashInfer backend does not serve, naming the option to change."""
    if is_fp8_kv(k_cache) or is_fp8_kv(v_cache):
        raise ValueError("attention_backend='flashinfer' does not read FP8 KV pages (their scales are per layer "
                         "and KV head, FlashInfer's per tensor): use kv_cache_dtype='auto' or attention_backend="
                         "'triton'")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"attention_backend='flashinfer' needs dtype bfloat16 or float16 for the model and its KV "
                         f"cache, got q {q.dtype}, KV {k_cache.dtype}: set dtype='bfloat16' or use "
                         "attention_backend='triton'")
