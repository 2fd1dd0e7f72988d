"""Host-side preparation of one step's tensors, vectorized with numpy.

The scheduler puts decode rows first; each is one token. Prefill chunks
follow. Everything a step needs is computed on the host from block lists and
copied to the device in a handful of transfers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from loopline.attention import PagedAttentionMetadata
from loopline.attention.base import build_work_tiles
from loopline.core.contracts import ScheduledRow
from loopline.worker.staging import stage


@dataclass
class DecodeBatch:
    """Decode rows of a step (the first ``n`` rows), host arrays; ``to_device`` pads to ``size``."""

    n: int
    slots: np.ndarray  # [n] decode slot per row
    loops: np.ndarray  # [n] 1-based loop the row runs
    starts: np.ndarray  # [n] bool, loop == 1 (prelude)
    input_ids: np.ndarray  # [n] token fed at loop 1 (0 otherwise)
    positions: np.ndarray  # [n]
    min_loops: np.ndarray
    max_loops: np.ndarray
    threshold: np.ndarray  # [n] f32
    plane_slots: np.ndarray  # [n, planes] physical slot of the row's position in every plane
    row_plane: np.ndarray  # [n] plane read/written this loop


@dataclass
class StepInputs:
    """A step's inputs as host arrays; :meth:`to_device` makes the attention metadata."""

    rows: list[ScheduledRow]
    decode: DecodeBatch
    positions: np.ndarray  # [N]
    slot_mapping: np.ndarray  # [N]
    offsets: np.ndarray  # [B + 1] query_start_loc
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int

    @property
    def token_offsets(self) -> list[int]:
        return self.offsets.tolist()

    @property
    def decode_only(self) -> bool:
        return self.decode.n == len(self.rows)

    def to_device(self, device: torch.device, tile_tokens: int | None = None) -> tuple[Tensor, PagedAttentionMetadata]:
        """Positions and attention metadata; with ``tile_tokens`` prefill steps get a work list."""
        arrays = [self.offsets.astype(np.int32), self.seq_lens, self.block_tables, self.slot_mapping, self.positions]
        work = work_list(self.offsets, self.max_query_len, tile_tokens, self.decode.n)
        offsets, seq_lens, tables, slot_mapping, positions, *work = stage(device, *arrays, *work)
        meta = PagedAttentionMetadata(
            query_start_loc=offsets, seq_lens=seq_lens, block_tables=tables, slot_mapping=slot_mapping,
            max_query_len=self.max_query_len, max_seq_len=self.max_seq_len, work_tiles=work[0] if work else None,
            num_decode_rows=self.decode.n if work else 0)
        return positions, meta


def work_list(offsets, max_query_len: int, tile_tokens: int | None, num_decode_rows: int = 0) -> list[np.ndarray]:
    """The attention work list of a step with prefill chunks (``[]`` for decode-only steps or a
    backend without work lists), as a list to splice into a ``stage`` call. The first
    ``num_decode_rows`` rows (one query each) stay off it: the backend gives them a decode launch."""
    if not tile_tokens or max_query_len <= 1:
        return []
    q_lens = np.diff(np.asarray(offsets))[num_decode_rows:]
    return [build_work_tiles(q_lens, tile_tokens, first_row=num_decode_rows)]


def slot_of(blocks: np.ndarray, pos: np.ndarray | int, block_size: int) -> np.ndarray:
    return blocks[np.asarray(pos) // block_size].astype(np.int64) * block_size + np.asarray(pos) % block_size


def build_decode_batch(rows: list[ScheduledRow], block_arrays, num_planes: int, block_size: int) -> DecodeBatch:
    """``block_arrays(request_id) -> list[np.ndarray]`` (per plane)."""
    dec = [r for r in rows if not r.is_prefill]
    n = len(dec)
    positions = np.fromiter((r.start for r in dec), dtype=np.int64, count=n)
    plane_slots = np.empty((n, num_planes), dtype=np.int64)
    for i, r in enumerate(dec):
        tables = block_arrays(r.request_id)
        blk, off = r.start // block_size, r.start % block_size
        for p in range(num_planes):
            plane_slots[i, p] = int(tables[p][blk]) * block_size + off
    return DecodeBatch(
        n=n,
        slots=np.fromiter((r.slot for r in dec), dtype=np.int64, count=n),
        loops=np.fromiter((r.loop for r in dec), dtype=np.int64, count=n),
        starts=np.fromiter((r.loop == 1 for r in dec), dtype=bool, count=n),
        input_ids=np.fromiter((r.input_token_ids[0] if r.loop == 1 else 0 for r in dec), dtype=np.int64, count=n),
        positions=positions,
        min_loops=np.fromiter((r.exit.min_loops for r in dec), dtype=np.int64, count=n),
        max_loops=np.fromiter((r.exit.max_loops for r in dec), dtype=np.int64, count=n),
        threshold=np.fromiter((r.exit.threshold for r in dec), dtype=np.float32, count=n),
        plane_slots=plane_slots,
        row_plane=np.fromiter((r.plane for r in dec), dtype=np.int64, count=n),
    )


def build_step_inputs(rows: list[ScheduledRow], block_arrays, num_planes: int, block_size: int) -> StepInputs:
    decode = build_decode_batch(rows, block_arrays, num_planes, block_size)
    lens = np.fromiter((r.end - r.start for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    n_tok = int(offsets[-1])
    positions = np.empty(n_tok, dtype=np.int64)
    slot_mapping = np.empty(n_tok, dtype=np.int64)
    nd = decode.n
    positions[:nd] = decode.positions
    slot_mapping[:nd] = decode.plane_slots[np.arange(nd), decode.row_plane]
    seq_lens = np.fromiter((r.end for r in rows), dtype=np.int32, count=len(rows))
    max_blocks = int(-(-seq_lens.max() // block_size))
    tables = np.zeros((len(rows), max_blocks), dtype=np.int32)
    for i, r in enumerate(rows):
        blocks = block_arrays(r.request_id)[r.plane]
        nb = -(-r.end // block_size)
        tables[i, :nb] = blocks[:nb]
        if r.is_prefill:
            lo, hi = offsets[i], offsets[i + 1]
            pos = np.arange(r.start, r.end)
            positions[lo:hi] = pos
            slot_mapping[lo:hi] = slot_of(blocks, pos, block_size)
    return StepInputs(rows, decode, positions, slot_mapping, offsets, seq_lens, tables, int(lens.max()),
                      int(seq_lens.max()))
