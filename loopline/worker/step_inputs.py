"""Host-side preparation of a step's prefill rows, vectorized with numpy.

Decode rows need nothing from the host but their slots and exit rules: the
device derives their positions, KV slots and block tables from its decode
state (``decode_state.py``). Prefill chunks are planned by the host, so their
positions, KV slots and block tables are computed here from the block lists
and copied to the device in one transfer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loopline.attention.base import build_work_tiles
from loopline.core.contracts import ScheduledRow


@dataclass
class PrefillInputs:
    """A step's prefill rows as host arrays."""

    rows: list[ScheduledRow]
    positions: np.ndarray  # [N] int64
    slot_mapping: np.ndarray  # [N] int64, the K/V slot each token writes at this loop
    offsets: np.ndarray  # [B + 1] query_start_loc
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32, of the plane each row's loop reads
    max_query_len: int
    max_seq_len: int

    @property
    def token_offsets(self) -> list[int]:
        return self.offsets.tolist()


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


def build_prefill_inputs(rows: list[ScheduledRow], block_arrays, block_size: int) -> PrefillInputs:
    """``rows``: prefill chunks; ``block_arrays(request_id) -> list[np.ndarray]`` (per plane)."""
    lens = np.fromiter((r.end - r.start for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    n_tok = int(offsets[-1])
    positions = np.empty(n_tok, dtype=np.int64)
    slot_mapping = np.empty(n_tok, dtype=np.int64)
    seq_lens = np.fromiter((r.end for r in rows), dtype=np.int32, count=len(rows))
    max_blocks = int(-(-seq_lens.max() // block_size))
    tables = np.zeros((len(rows), max_blocks), dtype=np.int32)
    for i, r in enumerate(rows):
        assert r.is_prefill
        blocks = block_arrays(r.request_id)[r.plane]
        nb = -(-r.end // block_size)
        tables[i, :nb] = blocks[:nb]
        lo, hi = offsets[i], offsets[i + 1]
        pos = np.arange(r.start, r.end)
        positions[lo:hi] = pos
        slot_mapping[lo:hi] = slot_of(blocks, pos, block_size)
    return PrefillInputs(rows, positions, slot_mapping, offsets, seq_lens, tables, int(lens.max()),
                         int(seq_lens.max()))
