"""Paged attention contract shared by every backend.

A step's queries are flattened rows: row ``b`` (a decode token or a prefill
chunk at one loop) owns queries ``query_start_loc[b]:query_start_loc[b+1]``,
which sit at the last ``q_len`` positions of a context of ``seq_lens[b]``
tokens. Its keys live in the pages of *its own plane*, listed in
``block_tables[b]``: position ``p`` is at block ``block_tables[b, p // block_size]``,
offset ``p % block_size``. Causal: the query at position ``p`` sees keys
``0..p``.

KV storage (owned by the model runner): ``k_cache``/``v_cache`` of shape
``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``. A physical
slot is ``block * block_size + offset``.

FP8 caches (``torch.float8_e4m3fn``) come with per-layer, per-KV-head fp32 scales
``k_scale``/``v_scale`` (a backend method gets one layer's ``[num_kv_heads]`` row):
a stored value is ``clamp(x / scale, -448, 448)`` rounded to nearest even
(:func:`quantize_fp8`), read back as ``stored * scale`` (:func:`dequantize_fp8`).
Queries and softmax probabilities are never quantized. Other caches ignore the scales.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from loopline.models.ops import Rope

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``): kernel tile widths, plan buckets."""
    return 1 << max(0, x - 1).bit_length()


def is_fp8_kv(cache: Tensor) -> bool:
    """True if ``cache`` stores FP8 (E4M3) values, which need scales."""
    return cache.dtype == FP8_KV_DTYPE


def kv_bytes(cache: Tensor) -> Tensor:
    """An FP8 cache (or page copy) as a ``uint8`` view, others unchanged: copies, gathers and transports
    move FP8 pages as bytes, which every torch op and transport supports (float8 indexing kernels are not
    built on every device); the scales are per layer and head, the same for every page."""
    return cache.view(torch.uint8) if is_fp8_kv(cache) else cache


def check_kv_scales(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> bool:
    """Whether the caches are FP8; for FP8 checks that both per-head scales are ``[kv_heads]`` fp32 on the
    caches' device. ``k_cache``/``v_cache`` may be one layer's or all layers' (heads on the second-last axis)."""
    if not is_fp8_kv(k_cache):
        return False
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    kv_heads = k_cache.shape[-2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"{name} is required with a {k_cache.dtype} KV cache")
        if scale.shape != (kv_heads,) or scale.dtype != torch.float32 or scale.device != k_cache.device:
            raise ValueError(f"{name} must be a [{kv_heads}] float32 tensor on {k_cache.device}, got "
                             f"{list(scale.shape)} {scale.dtype} on {scale.device}")
    return True


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` ``[..., kv_heads, D]`` divided by the per-head ``scale`` in fp32, saturated and rounded (to nearest
    even) to FP8 E4M3: what an FP8 cache stores."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """FP8 values ``[..., kv_heads, D]`` back to fp32: ``x * scale`` per head."""
    return x.float() * scale[:, None]


@dataclass
class PagedAttentionMetadata:
    """Where one step's rows read and write KV. Shapes: B rows, N query tokens."""

    query_start_loc: Tensor  # [B + 1] int32, cumulative query offsets
    seq_lens: Tensor  # [B] int32, context length per row (queries are its last q_len positions)
    block_tables: Tensor  # [B, max_blocks_per_row] int32, physical blocks of the row's plane
    slot_mapping: Tensor  # [N] int64, physical slot each query token's K/V is written to
    max_query_len: int  # host ints so backends need not sync
    max_seq_len: int
    # Optional work list [2, T] int32 of (row, query tile) pairs, rows < 0 padding (see
    # ``AttentionBackend.work_tile_tokens``): a backend that tiles queries launches one
    # program per entry instead of rows x max tiles, and a fixed-size list can be captured.
    work_tiles: Tensor | None = None
    # With a work list: the first ``num_decode_rows`` rows have one query each and no work tile;
    # a backend attends them in a decode launch (small query tiles) next to the listed tiles.
    num_decode_rows: int = 0


def build_work_tiles(q_lens: np.ndarray, tile_tokens: int, capacity: int | None = None,
                     first_row: int = 0) -> np.ndarray:
    """``[2, T]`` int32 (row, tile) pairs covering every query of rows ``first_row, first_row + 1, ...``
    (``q_lens`` are theirs); padded with -1 to ``capacity``."""
    tiles = -(-np.asarray(q_lens, dtype=np.int64) // tile_tokens)
    rows = np.repeat(np.arange(first_row, first_row + len(tiles), dtype=np.int32), tiles)
    starts = np.cumsum(tiles) - tiles
    ids = (np.arange(len(rows)) - np.repeat(starts, tiles)).astype(np.int32)
    n = len(rows) if capacity is None else capacity
    if len(rows) > n:
        raise ValueError(f"work tiles: {len(rows)} needed, capacity {n}")
    out = np.full((2, n), -1, dtype=np.int32)
    out[0, :len(rows)], out[1, :len(rows)] = rows, ids
    return out


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and attends over it."""

    name: str
    #: Which steps a CUDA graph may hold: "all"; "decode" (steps whose rows all have one query: the backend
    #: plans steps with prompt chunks on the host); "none" (its calls sync with the host).
    graph_steps: Literal["all", "decode", "none"] = "none"

    @abstractmethod
    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, meta: PagedAttentionMetadata, *,
                 k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
        """k_cache/v_cache: one layer, ``[num_blocks, block_size, kv_heads, D]``; k/v: ``[N, kv_heads, D]``.

        ``k_scale``/``v_scale``: ``[kv_heads]`` fp32, required (only) for FP8 caches, which store
        :func:`quantize_fp8` of k and v."""

    def rotate_and_write_kv(self, k_cache: Tensor, v_cache: Tensor, q: Tensor, k: Tensor, v: Tensor, rope: Rope,
                            meta: PagedAttentionMetadata, *, k_scale: Tensor | None = None,
                            v_scale: Tensor | None = None) -> Tensor:
        """Applies ``rope`` to q and k, stores K/V like :meth:`write_kv`; returns the rotated q.

        Backends with kernels override it to do all of it in one pass over the step's rows."""
        q, k = rope(q, k)
        self.write_kv(k_cache, v_cache, k, v, meta, k_scale=k_scale, v_scale=v_scale)
        return q

    @abstractmethod
    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMetadata, scale: float, *,
               k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
        """q: ``[N, heads, D]`` -> ``[N, heads, D]`` (fp32 accumulation, output in q's dtype).

        FP8 caches are read as ``stored * scale`` (:func:`dequantize_fp8`) and need ``k_scale``/``v_scale``."""

    def rotate_store_attend(self, k_cache: Tensor, v_cache: Tensor, q: Tensor, k: Tensor, v: Tensor, rope: Rope,
                            meta: PagedAttentionMetadata, scale: float, *, k_scale: Tensor | None = None,
                            v_scale: Tensor | None = None) -> Tensor:
        """One layer's attention of a step: :meth:`rotate_and_write_kv`, then :meth:`attend` on the rotated q.

        Backends with kernels may do it in fewer launches where the step's shape allows (decode rows)."""
        q = self.rotate_and_write_kv(k_cache, v_cache, q, k, v, rope, meta, k_scale=k_scale, v_scale=v_scale)
        return self.attend(q, k_cache, v_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)

    def work_tile_tokens(self, group: int) -> int | None:
        """Query tokens per work tile for ``group`` query heads per KV head; None: no work list."""
        return None

    def copy_slots(self, k_cache: Tensor, v_cache: Tensor, src: Tensor, dst: Tensor) -> None:
        """For every layer copy K/V at physical slots ``src[i]`` to ``dst[i]`` (``[M]`` int64).

        Caches here are the full ``[num_layers, num_blocks, block_size, kv_heads, D]``
        tensors. Raw values move (FP8 scales are per layer and head, the same for every slot), so
        no scales. Graph-safe: one gather and one scatter per cache over ``(layer, slot)`` rows.
        (Indexing the slot axis of the 5-D cache directly makes torch split the copy into
        kernels by 32-bit offset ranges of the whole pool: 49 launches per step with a
        110 GiB pool on the H200.)
        """
        if src.shape[0] == 0:
            return
        num_layers, slots = k_cache.shape[0], k_cache.shape[1] * k_cache.shape[2]
        first = torch.arange(num_layers, device=src.device)[:, None] * slots  # row of each layer's slot 0
        src_rows, dst_rows = (first + src[None, :]).reshape(-1), (first + dst[None, :]).reshape(-1)
        for cache in (k_cache, v_cache):
            rows = kv_bytes(cache).view(num_layers * slots, -1)
            rows[dst_rows] = rows[src_rows]

    def copy_exited(self, k_cache: Tensor, v_cache: Tensor, plane_slots: Tensor, loops: Tensor, exits: Tensor,
                    scratch_slot: int) -> None:
        """The ``last_exited`` exit copy of one decode step, decided on the device.

        Row ``b`` with ``exits[b]`` left at loop ``e = loops[b]``: in every layer, its K/V
        at ``plane_slots[b, e - 1]`` (0-based planes) goes to ``plane_slots[b, p]`` for
        every deeper plane ``p >= e``. ``plane_slots``: ``[B, P]`` int64; ``loops``:
        ``[B]``; ``exits``: ``[B]`` bool. No host sync, so it can be captured.

        This generic version copies a fixed ``B x P`` entries: every entry without a copy
        moves ``scratch_slot`` onto itself (a no-op that stays in L2), so its cost grows
        with the batch whether or not anything exits. Backends with kernels override it.
        """
        planes = torch.arange(plane_slots.shape[1], device=plane_slots.device)
        src = plane_slots.gather(1, (loops.long() - 1)[:, None]).expand_as(plane_slots)
        deeper = exits[:, None] & (planes[None, :] >= loops[:, None])
        src = torch.where(deeper, src, scratch_slot)
        dst = torch.where(deeper, plane_slots, scratch_slot)
        self.copy_slots(k_cache, v_cache, src.reshape(-1), dst.reshape(-1))
