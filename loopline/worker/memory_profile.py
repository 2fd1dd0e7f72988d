"""The profiling pass that sizes the KV pool on a GPU.

Before the pool is allocated, one loop runs over the largest step the
scheduler can build (``max_num_batched_tokens`` prompt tokens in one chunk)
with a scratch KV pool of just that size, and the peak device memory it
needed on top of the weights is what the pool must leave free.
"""
from __future__ import annotations

import gc
import math
import os

import torch

from loopline.attention import AttentionBackend, PagedAttentionMetadata
from loopline.attention.paged import PagedAttention
from loopline.errors import CapacityError
from loopline.kv.layout import KVLayout
from loopline.kv.quant import is_fp8
from loopline.models.family import family_of
from loopline.models.ouro import OuroForCausalLM


@torch.inference_mode()
def peak_step_bytes(model: OuroForCausalLM, backend: AttentionBackend, num_tokens: int, num_sampled: int,
                    block_size: int, dtype: torch.dtype, device: torch.device,
                    kv_dtype: torch.dtype | None = None) -> int:
    """Peak extra device memory of one loop over ``num_tokens`` positions plus the coda of
    ``num_sampled`` rows (0 where the device reports no memory statistics, i.e. the CPU).
    ``kv_dtype``: the pool's stored dtype (default ``dtype``)."""
    cfg = model.config
    layers = family_of(cfg).kv_layers(cfg)
    blocks = -(-num_tokens // block_size)
    shape = (layers, blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv_dtype = kv_dtype or dtype
    k_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    v_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    # (unit scales: the values of this pass are never read)
    scales = torch.ones(layers, cfg.num_key_value_heads, device=device) if is_fp8(kv_dtype) else None
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
    # a step's positions are each below the context length even when its tokens are more (several prompts)
    positions = torch.arange(num_tokens, device=device) % cfg.max_position_embeddings
    attn = PagedAttention(backend, k_cache, v_cache, meta, 1.0 / math.sqrt(cfg.head_dim), k_scale=scales, v_scale=scales)
    # one loop through the family seam (Ouro: the embedding, then model.loop)
    x = model.prelude(torch.zeros(num_tokens, dtype=torch.long, device=device), positions, attn)
    h, _ = model.core(model.initial_state(x, positions, torch.zeros_like(positions)), x, positions, attn)
    logits = model.head(h[:num_sampled])
    peak = 0
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    del k_cache, v_cache, x, h, logits
    if cuda:
        torch.cuda.empty_cache()
    return peak


_CPU_KV_GB = 1.0  # the most the CPU pool takes unless told (kv_cache_memory_gb / num_kv_blocks)


def kv_bytes_per_block(model_cfg, block_size: int, dtype: torch.dtype) -> int:
    """K and V bytes of one page at one plane, all layers."""
    return (2 * family_of(model_cfg).kv_layers(model_cfg) * block_size * model_cfg.num_key_value_heads * model_cfg.head_dim
            * dtype.itemsize)


def num_kv_blocks(config, model: OuroForCausalLM, backend: AttentionBackend, layout: KVLayout) -> int:
    """KV pages for the pool (all planes together), from the engine config (``EngineConfig``).

    An explicit ``num_kv_blocks`` or ``kv_cache_memory_gb`` wins. On CUDA the pool takes what
    ``gpu_memory_utilization`` leaves after the weights and the largest step's activations (a
    profiling pass). On the CPU it holds ``max_num_seqs`` requests of ``max_model_len`` tokens at
    every plane, at most 1 GiB: a small model does not reserve memory it can never use.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model.config, config.block_size, config.kv_dtype)
    device = config.device
    if config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 2**30
    elif device.type == "cuda":
        # An engine dropped earlier in this process (a notebook's second LLM, a benchmark's next variant) may
        # hold its pool and graphs in reference cycles: collected now, the profile's empty_cache returns them.
        gc.collect()
        # Profiling pass: the largest step's activations must fit beside the pool.
        peak = peak_step_bytes(model, backend, config.max_num_batched_tokens, config.max_num_seqs,
                               config.block_size, config.dtype, device, config.kv_dtype)
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1.0 - config.gpu_memory_utilization) * total - peak
    else:
        full = config.max_num_seqs * layout.num_planes * -(-config.max_model_len // config.block_size)
        budget = min(_CPU_KV_GB * 2**30, full * per_block)
    blocks = int(budget // per_block)
    if blocks <= 0:
        raise CapacityError(f"no memory left for the KV cache (one block needs {per_block} bytes)", param="kv_cache_memory_gb")
    return blocks


def device_memory_bytes(device: torch.device) -> int:
    """What the engine may use at most: the GPU's memory, or the host's physical memory (CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: no bound known
        return 2**62


# Field values of large served models today: a field far above its value is the likely cause of a footprint that
# cannot fit (which field an error names, not a limit).
_TYPICAL = {"num_hidden_layers": 64, "total_ut_steps": 8, "max_model_len": 131072, "max_position_embeddings": 131072,
            "hidden_size": 8192, "intermediate_size": 32768, "vocab_size": 262144, "num_key_value_heads": 64}


def footprint(model_cfg, *, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device, max_model_len: int,
              max_num_seqs: int, block_size: int, num_planes: int, weights: bool = True
              ) -> dict[str, tuple[dict[str, int], int]]:
    """Bytes the engine allocates from the configuration alone, before any of it is allocated, by what they are
    for: ``{what: ({sizing field: value}, bytes)}``. Weights (when they still have to be loaded), the RoPE
    table of every position (fused GPU kernels), the decode slots' block tables over ``max_model_len``, and one
    request of ``max_model_len`` tokens in the KV pool at every plane (a pool that cannot hold one request of
    the allowed length is refused, as vLLM refuses it)."""
    c = model_cfg
    family = family_of(c)
    params = family.parameter_count(c)
    blocks = -(-(max_model_len + 1) // block_size)
    shape = {"num_hidden_layers": family.kv_layers(c), "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size}
    kv_fields = {"max_model_len": max_model_len, "total_ut_steps": num_planes, "num_hidden_layers": family.kv_layers(c),
                 "num_key_value_heads": c.num_key_value_heads}
    return {
        "weights": (shape, params * dtype.itemsize if weights else 0),
        "RoPE table": ({"max_position_embeddings": c.max_position_embeddings},
                       c.max_position_embeddings * c.head_dim * 2 * dtype.itemsize if device.type == "cuda" else 0),
        "decode block tables": ({"max_model_len": max_model_len, "total_ut_steps": num_planes},
                                (max_num_seqs + 1) * num_planes * blocks * 4),
        "KV of one request at max_model_len": (kv_fields, num_planes * blocks * kv_bytes_per_block(c, block_size, kv_dtype)),
    }


def check_fits(parts: dict[str, tuple[dict[str, int], int]], device: torch.device) -> None:
    """Refuses, before any allocation, a configuration whose :func:`footprint` exceeds the device's memory,
    naming the largest part and the field most likely to blame (the one furthest above today's large models)."""
    have = device_memory_bytes(device)
    need = sum(b for _, b in parts.values())
    if need <= have:
        return
    what, (sizing, size) = max(parts.items(), key=lambda kv: kv[1][1])
    field = max(sizing, key=lambda f: sizing[f] / _TYPICAL.get(f, 1))
    hint = " (max_model_len defaults to the model's max_position_embeddings: pass a smaller max_model_len)" \
        if field == "max_model_len" else ""
    raise CapacityError(
        f"this configuration needs at least {need / 2**30:,.1f} GiB before serving anything, more than the "
        f"{have / 2**30:,.1f} GiB of {device.type} memory here; the largest part is the {what} "
        f"({size / 2**30:,.1f} GiB; {', '.join(f'{k}={v:,}' for k, v in sizing.items())}): {field} is too "
        f"large{hint}", param=field)
