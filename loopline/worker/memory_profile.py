"""The profiling pass that sizes the KV pool on a GPU.

Before the pool is allocated, one loop runs over the largest step the
scheduler can build (``max_num_batched_tokens`` prompt tokens in one chunk)
with a scratch KV pool of just that size, and the peak device memory it
needed on top of the weights is what the pool must leave free.
"""
from __future__ import annotations

import math

import torch

from loopline.attention import AttentionBackend, PagedAttentionMetadata
from loopline.attention.paged import PagedAttention
from loopline.models.ouro import OuroForCausalLM


@torch.inference_mode()
def peak_step_bytes(model: OuroForCausalLM, backend: AttentionBackend, num_tokens: int, num_sampled: int,
                    block_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Peak extra device memory of one loop over ``num_tokens`` positions plus the coda of
    ``num_sampled`` rows (0 where the device reports no memory statistics, i.e. the CPU)."""
    cfg = model.config
    blocks = -(-num_tokens // block_size)
    shape = (cfg.num_hidden_layers, blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = torch.zeros(shape, dtype=dtype, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], **i32), seq_lens=torch.tensor([num_tokens], **i32),
        block_tables=torch.arange(blocks, **i32)[None], slot_mapping=torch.arange(num_tokens, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    positions = torch.arange(num_tokens, device=device)
    x = model.embed(torch.zeros(num_tokens, dtype=torch.long, device=device))
    h, _ = model.loop(x, positions, PagedAttention(backend, k_cache, v_cache, meta, 1.0 / math.sqrt(cfg.head_dim)))
    logits = model.head(h[:num_sampled])
    peak = 0
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    del k_cache, v_cache, x, h, logits
    if cuda:
        torch.cuda.empty_cache()
    return peak
