"""Paged attention in plain PyTorch: the reference backend, CPU and CUDA.

Correct for every row shape (decode tokens and prefill chunks alike), simple
rather than fast: one small attention per row. The Triton backend is tested
against it. FP8 caches: the write quantizes (:func:`~loopline.attention.base.quantize_fp8`),
attention dequantizes the row's keys and values to fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from loopline.attention.base import (
    AttentionBackend,
    PagedAttentionMetadata,
    check_kv_scales,
    dequantize_fp8,
    quantize_fp8,
)


def gather_positions(block_table: Tensor, seq_len: int, block_size: int) -> Tensor:
    """Physical slots ``[seq_len]`` of positions ``0..seq_len-1`` for one row."""
    pos = torch.arange(seq_len, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, meta: PagedAttentionMetadata, *,
                 k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        if check_kv_scales(k_cache, v_cache, k_scale, v_scale):
            # index_copy_ has no float8 kernels on the CPU: copy the bytes
            flat_k.view(torch.uint8).index_copy_(0, meta.slot_mapping, quantize_fp8(k, k_scale).view(torch.uint8))
            flat_v.view(torch.uint8).index_copy_(0, meta.slot_mapping, quantize_fp8(v, v_scale).view(torch.uint8))
            return
        flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMetadata, scale: float, *,
               k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
        fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
        block_size = k_cache.shape[1]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        groups = q.shape[1] // k_cache.shape[2]
        for b, seq_len in enumerate(seq_lens):
            q_lo, q_hi = starts[b], starts[b + 1]
            if q_hi == q_lo:
                continue
            slots = gather_positions(meta.block_tables[b], seq_len, block_size)
            if fp8:  # gathered as bytes, like the write
                k = dequantize_fp8(flat_k.view(torch.uint8)[slots].view(k_cache.dtype), k_scale)
                v = dequantize_fp8(flat_v.view(torch.uint8)[slots].view(v_cache.dtype), v_scale)
            else:
                k = flat_k[slots].float()  # [S, kvh, D]
                v = flat_v[slots].float()
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            qb = q[q_lo:q_hi].float()  # [Q, h, D]
            n_q = q_hi - q_lo
            scores = torch.einsum("qhd,shd->hqs", qb, k) * scale
            q_pos = torch.arange(seq_len - n_q, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            out[q_lo:q_hi] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), v).to(q.dtype)
        return out
