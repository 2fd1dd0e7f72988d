"""CPU snapshots of preempted requests (swap space), owned by the model runner."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass
class Snapshot:
    """A preempted request in CPU memory: every plane's KV pages, slot and request state."""

    k: Tensor | None  # [layers, blocks, block_size, kv_heads, D] (blocks: plane-major); None: the
    v: Tensor | None  # pages are in the pool already (a handed-off request's, written as they arrived)
    slot_hidden: Tensor  # [H]
    slot_survival: Tensor  # []
    state: Any  # the request state, moved to the CPU
    blocks_per_plane: int
    decode_state: dict[str, Tensor]  # the slot's device decode state (loop, position, token, counts, trace)




@dataclass
class HandoffState:
    """What a decode worker needs of a request a prefill worker finished (prefill/decode
    disaggregation): its sampling and exit settings and its slot's device state, on the CPU.
    The KV pages travel on their own (``loopline.distributed.kv_transfer``), straight into the
    pages the decode worker reserved (``KVPages.write_pages``)."""

    params: Any  # SamplingParams (effective)
    seed: int
    prompt_token_ids: list[int]
    prompt_exit: Any  # ExitParams
    max_len: int
    blocks_per_plane: int  # KV pages per plane that travel: those covering the prompt
    slot_hidden: Tensor  # [H]
    slot_survival: Tensor  # []
    decode_state: dict[str, Tensor]  # the slot's decode state (loop 0, the first token, position, counts)
    kv_scales: Any = None  # an FP8 pool's KVScales (loopline.kv.quant): the pages mean nothing without them
