"""What one engine loop runs over a step's rows, per looped family (docs/model-families.md).

The step forward (``forward.py``) runs one loop over every row of a step, each row at its own loop. What
that loop is depends on the family behind the seam (``loopline.models.family``); this module holds one
strategy per family, picked by :func:`loop_stack` from the model's ``model_type``, so the runner, the row
kinds, the builder and the graphs never branch on a family:

* :class:`OuroStack`: the loop is ``model.loop`` (every layer, the final norm, the exit gate). A row
  starting a token reads the token's embedding, the others their slot's hidden state; logits are
  ``model.head`` of the loop's output. Nothing beyond what the engine did before the seam.
* :class:`HuginnStack`: rows starting a token run the prelude (attention over the prelude plane) and
  draw the seeded latent initial state; every row then runs one core iteration (adapter injection of the
  token's prelude output, the core block, attention over the loop's plane) and the coda (attention over
  the coda plane), whose output is what the head reads. The prelude output is kept per token (decode:
  per slot; prompts: per position) for the token's later loops. The extra per-token inputs (token ids,
  whether the row starts its token, latent seeds, the kept prelude output, the prelude and coda planes'
  KV slots and block tables) live in buffers of this object, allocated only for Huginn.

Static shapes: every row of a step runs the prelude and the coda (a CUDA graph cannot pick rows on the
device). A row that does not start a token writes its prelude K/V to the scratch slot, so the prelude
plane holds each token's K/V from the step it started in; a row writes its coda K/V at every loop, the
last write (its exit loop's) being the one later tokens read.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from loopline.attention.base import PagedAttentionMetadata
from loopline.attention.paged import PagedAttention
from loopline.models.family import family_of
from loopline.models.ops import Rope
from loopline.worker.decode_state import (
    DecodeRows,
    DecodeTensors,
    DeviceDecodeState,
    SlotOps,
)
from loopline.worker.staging import stage
from loopline.worker.step_inputs import Segment, StepInputs


class OuroStack:
    """Ouro's loop: ``model.loop`` (module docstring). Every hook is what the engine ran before the seam."""

    keeps_injected = False  # (per prompt position: RequestState.injected)

    def __init__(self, model: Any, *, ops: SlotOps, state: DeviceDecodeState, slot_hidden: Tensor,
                 slot_survival: Tensor, requests: dict, **_: Any) -> None:
        self.model, self.ops, self.slot_hidden, self.requests = model, ops, slot_hidden, requests
        self.slot_survival = slot_survival

    def decode_inputs(self, rows: DecodeRows, inp: StepInputs, seg: Segment) -> None:
        """Decode rows' loop inputs: the fed token's embedding for rows starting a token, the slot's hidden
        state for the others."""
        t = seg.tok0
        self.ops.decode_inputs(rows.dec, self.model.model.embed_tokens.weight, self.slot_hidden,
                               out=inp.x[t:t + seg.rows])

    def prefill_inputs(self, rows: list, x: Tensor, inp: StepInputs, seg: Segment) -> None:
        """Prompt chunks' loop inputs: embeddings at loop 1, the previous loop's hidden state after."""
        requests, device = self.requests, x.device
        starting = [row for row in rows if row.loop == 1]
        ids = iter(stage(device, *((row.input_token_ids, np.int64) for row in starting)))
        parts = [self.model.embed(next(ids)) if row.loop == 1 else requests[row.request_id].hidden[row.start:row.end]
                 for row in rows]
        if len(parts) == 1:
            x.copy_(parts[0])
        else:
            torch.cat(parts, out=x)

    def set_slot(self, slot: int, seed: int) -> None:
        """Per-slot state of a request that arrives: none."""

    def __call__(self, inp: StepInputs, attn: PagedAttention) -> tuple[Tensor, Tensor]:
        return self.model.loop(inp.x, inp.positions, attn)

    def head_input(self, h: Tensor, lo: int, hi: int) -> Tensor:
        """What ``model.head`` reads for tokens ``lo:hi`` of the step: the loop's output itself."""
        return h

    def injected(self, lo: int, hi: int) -> Tensor | None:
        return None

    def decode_exit(self, h: Tensor, gate: Tensor, d: DecodeTensors, lo: int, hi: int) -> Tensor:
        """Decode rows' exit after this loop (the gate's rule), their slots' state kept for the next one."""
        return self.ops.exit_and_store(h, gate, d, self.slot_hidden, self.slot_survival)

    def decode_logits(self, h: Tensor, ex: Tensor, lo: int, hi: int) -> Tensor:
        """fp32 logits of the decode rows (rows not exiting: unused, may be zeros)."""
        return self.model.head(h, needed=ex)

    def reserve(self, tokens: int, rows: int, width: int) -> None:
        """Buffers for steps up to this size (before graphs capture views of them): none."""


class HuginnStack:
    """Huginn's loop (module docstring): prelude for rows starting a token, one core iteration, the coda.

    ``planes``: the prelude's and the coda's plane (``Family.once_planes``); ``max_num_seqs + 1`` slots."""

    keeps_injected = True

    def __init__(self, model: Any, *, state: DeviceDecodeState, slot_hidden: Tensor, requests: dict,
                 planes: dict[str, int], dtype: torch.dtype, **_: Any) -> None:
        self.model, self.state, self.slot_hidden, self.requests = model, state, slot_hidden, requests
        family = family_of(model)
        self.criterion, vocab = family.exit_criterion, family.logits_size(model.config)
        self.device, self.dtype = state.device, dtype
        num_slots, scratch_block, block_size = state.loop.shape[0], state.scratch_block, state.block_size
        self.pre_plane, self.coda_plane = planes["prelude"], planes["coda"]
        self.scratch_block, self.block_size = scratch_block, block_size
        self.scratch_kv = scratch_block * block_size
        h = model.config.hidden_size
        self.slot_injected = torch.zeros(num_slots, h, dtype=dtype, device=self.device)  # the in-flight token's prelude
        self.slot_seed = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # each slot's latent seed
        # the convergence exit's carry: log p of the slot's previous iteration ([slots, padded vocab] fp32)
        self.slot_logp = torch.zeros(num_slots, vocab, dtype=torch.float32, device=self.device)
        self._uniform = self.criterion.initial_carry(1, vocab, self.device)  # p_0
        self._logits: Tensor | None = None  # the last decode rows' logits (decode_exit computed them)
        # saved and restored with the slot's decode state (preemption)
        state.add_family_rows({"huginn_injected": self.slot_injected, "huginn_seed": self.slot_seed,
                               "huginn_logp": self.slot_logp})
        self._tokens = self._rows = 0
        self.reserve(1, 1, 1)
        self.scale = model.config.head_dim ** -0.5
        self._out: tuple[Tensor, Tensor] | None = None  # the last forward's (head input, prelude output)
        # the identity rotation the attention backends get (q and k arrive rotated: _PreRotated)
        d = model.config.head_dim
        self._identity = (torch.ones(1, d, dtype=dtype, device=self.device), torch.zeros(1, d, dtype=dtype, device=self.device))

    def reserve(self, tokens: int, rows: int, width: int) -> None:
        # NOTE: new buffers, never a resize (graphs captured on the old ones keep reading them)
        if tokens > self._tokens:
            n, h, dev = max(tokens, self._tokens * 3 // 2), self.model.config.hidden_size, self.device
            self.ids = torch.zeros(n, dtype=torch.long, device=dev)
            self.starts = torch.zeros(n, dtype=torch.bool, device=dev)
            self.seeds = torch.zeros(n, dtype=torch.long, device=dev)
            self.injected_in = torch.zeros(n, h, dtype=self.dtype, device=dev)
            self.slot_mapping = torch.full((2, n), self.scratch_kv, dtype=torch.long, device=dev)  # prelude, coda
            self._tokens = n
        if rows * width > self._rows:
            self.tables = torch.full((2, max(rows * width, self._rows * 3 // 2)), self.scratch_block,
                                     dtype=torch.int32, device=self.device)
            self._rows = self.tables.shape[1]

    def _tables(self, rows: int, width: int) -> Tensor:
        """``[2, rows, width]`` views of the prelude's and the coda's block tables for a step's shape."""
        return self.tables[:, :rows * width].view(2, rows, width)

    # --- inputs ------------------------------------------------------------------------------------
    def decode_inputs(self, rows: DecodeRows, inp: StepInputs, seg: Segment) -> None:
        """Decode rows' inputs, on the device from the slot state: the slot's latent state, its token, seed
        and kept prelude output, the prelude plane's slot (scratch unless the row starts a token), the coda
        plane's, and both planes' block tables."""
        self.reserve(inp.x.shape[0], *inp.block_tables.shape)
        d, t, r, n = rows.dec, seg.tok0, seg.row0, seg.rows
        inp.x[t:t + n] = self.slot_hidden[d.slots]
        starts = d.starts & rows.run
        self.ids[t:t + n] = d.input_ids
        self.starts[t:t + n] = starts
        self.seeds[t:t + n] = self.slot_seed[d.slots]
        self.injected_in[t:t + n] = self.slot_injected[d.slots]
        self.slot_mapping[0, t:t + n] = torch.where(starts, d.plane_slots[:, self.pre_plane], self.scratch_kv)
        self.slot_mapping[1, t:t + n] = d.plane_slots[:, self.coda_plane]
        tables = self._tables(*inp.block_tables.shape)
        width = tables.shape[2]
        own = self.state.tables[d.slots]  # (an idle no_refill row's slot is the scratch slot: scratch tables)
        tables[0, r:r + n] = own[:, self.pre_plane, :width]
        tables[1, r:r + n] = own[:, self.coda_plane, :width]

    def prefill_inputs(self, rows: list, x: Tensor, inp: StepInputs, seg: Segment) -> None:
        """Prompt chunks' inputs from the host: the previous loop's state and the kept prelude output (loop
        1: the prelude and the latent replace them), prompt ids, seeds, both planes' slots and tables."""
        self.reserve(inp.x.shape[0], *inp.block_tables.shape)
        requests, t, width = self.requests, seg.tok0, inp.block_tables.shape[1]
        n_tok, bs = x.shape[0], self.block_size
        starts = np.zeros(n_tok, dtype=bool)
        seeds = np.zeros(n_tok, dtype=np.int64)
        slots = np.full((2, n_tok), self.scratch_kv, dtype=np.int64)
        tables = np.full((2, len(rows), width), self.scratch_block, dtype=np.int32)
        states, kept, ids, lo = [], [], [], 0
        for i, row in enumerate(rows):
            st = requests[row.request_id]
            hi = lo + row.end - row.start
            pos = np.arange(row.start, row.end)
            nb = -(-row.end // bs)
            for j, plane in enumerate((self.pre_plane, self.coda_plane)):
                blocks = st.block_arrays[plane]
                tables[j, i, :nb] = blocks[:nb]
                slots[j, lo:hi] = blocks[pos // bs].astype(np.int64) * bs + pos % bs
            if row.loop == 1:
                starts[lo:hi] = True
            else:
                slots[0, lo:hi] = self.scratch_kv  # the prelude ran at loop 1
            seeds[lo:hi] = st.params.latent_seed
            states.append(st.hidden[row.start:row.end])
            kept.append(st.injected[row.start:row.end])
            ids.append(st.prompt[row.start:row.end])
            lo = hi
        s_starts, s_seeds, s_slots, s_tables = stage(x.device, starts, seeds, slots, tables)
        torch.cat(states, out=x)
        torch.cat(ids, out=self.ids[t:t + n_tok])
        torch.cat(kept, out=self.injected_in[t:t + n_tok])
        self.starts[t:t + n_tok] = s_starts
        self.seeds[t:t + n_tok] = s_seeds
        self.slot_mapping[:, t:t + n_tok] = s_slots
        step_tables = self._tables(*inp.block_tables.shape)
        r = seg.row0
        step_tables[:, r:r + len(rows)] = s_tables
        # a graph bucket's padding past the chunks (no row owns it): scratch, never a stale step's slots
        self.slot_mapping[:, t + n_tok:inp.x.shape[0]] = self.scratch_kv
        self.starts[t + n_tok:inp.x.shape[0]] = False
        step_tables[:, r + len(rows):] = self.scratch_block

    # --- the loop ----------------------------------------------------------------------------------
    def _attn(self, attn: PagedAttention, stage_index: int, tables: Tensor) -> PagedAttention:
        """The step's attention on the prelude's (0) or the coda's (1) plane."""
        meta = attn.meta
        T = meta.slot_mapping.shape[0]
        stage_meta = PagedAttentionMetadata(meta.query_start_loc, meta.seq_lens, tables[stage_index],
                                            self.slot_mapping[stage_index, :T], meta.max_query_len, meta.max_seq_len,
                                            meta.work_tiles, meta.num_decode_rows)
        return PagedAttention(attn.backend, attn.k_cache, attn.v_cache, stage_meta, attn.scale,
                              k_scale=attn.k_scale, v_scale=attn.v_scale)

    def __call__(self, inp: StepInputs, attn: PagedAttention) -> tuple[Tensor, Tensor]:
        model, T = self.model, inp.x.shape[0]
        rows, width = inp.block_tables.shape
        self.reserve(T, rows, width)
        tables = self._tables(rows, width)
        pos, starts = inp.positions, self.starts[:T, None]
        one, zero = (t.expand(T, -1) for t in self._identity)
        e = model.prelude(self.ids[:T], pos, _PreRotated(self._attn(attn, 0, tables), one, zero))
        e = torch.where(starts, e, self.injected_in[:T])
        s0 = model.initial_state(e, pos, self.seeds[:T])
        s = torch.where(starts, s0, inp.x)
        s, _ = model.core(s, e, pos, _PreRotated(attn, one, zero))
        y = model.coda_hidden(s, pos, _PreRotated(self._attn(attn, 1, tables), one, zero))
        self._out = (y, e)
        # no exit signal: the fixed-depth rule reads none (the convergence exit reads logits)
        return s, torch.zeros(T, dtype=torch.float32, device=s.device)

    def head_input(self, h: Tensor, lo: int, hi: int) -> Tensor:
        return self._out[0][lo:hi]

    def injected(self, lo: int, hi: int) -> Tensor | None:
        return self._out[1][lo:hi]

    def decode_exit(self, h: Tensor, gate: Tensor, d: DecodeTensors, lo: int, hi: int) -> Tensor:
        """Decode rows' exit after this loop by the family's criterion on the coda's logits (the
        convergence test: ``KL(p_{r-1} || p_r) < threshold`` from ``min_loops`` on, always at ``max_loops``;
        ``p_0`` uniform), and their slots' latent state, ``log p`` and prelude output kept."""
        self._logits = logits = self.model.head(self._out[0][lo:hi])
        prev = torch.where((d.loops == 1)[:, None], self._uniform, self.slot_logp[d.slots])
        ex, logp = self.criterion.decide(d.loops, prev, logits, d.min_loops, d.max_loops, d.threshold)
        self.slot_logp[d.slots] = logp
        self.slot_hidden[d.slots] = h
        self.slot_injected[d.slots] = self._out[1][lo:hi]
        return ex

    def decode_logits(self, h: Tensor, ex: Tensor, lo: int, hi: int) -> Tensor:
        return self._logits

    def set_slot(self, slot: int, seed: int) -> None:
        """A request's latent seed in its decode slot (when it arrives)."""
        self.slot_seed[slot] = seed


class _PreRotated:
    """Attention that rotates q and k by the model's own RoPE (Huginn's interleaved pairs), then hands them
    to ``inner`` with the identity rotation (rotate-half cos 1, sin 0: exact), so every backend, whose fused
    stores rotate with rotate-half RoPE, stores and attends Huginn's keys unchanged."""

    def __init__(self, inner: PagedAttention, one: Tensor, zero: Tensor) -> None:
        self.inner, self.identity = inner, Rope(one, zero)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope) -> Tensor:
        q, k = rope(q, k)
        return self.inner(layer, q, k, v, self.identity)


def loop_stack(model: Any, **kwargs: Any) -> OuroStack | HuginnStack:
    """The loop strategy of ``model``'s family (keyword arguments: what that strategy's constructor takes)."""
    return _STACKS[family_of(model).model_type](model, **kwargs)


_STACKS = {"ouro": OuroStack, "huginn_raven": HuginnStack}
