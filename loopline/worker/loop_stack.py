"""What one engine loop runs over a step's rows, per looped family (docs/model-families.md).

The step forward (``forward.py``) runs one loop over every row of a step, each row at its own loop. What
that loop is depends on the family behind the seam (``loopline.models.family``); this module holds one
strategy per family, picked by :func:`loop_stack` from the model's ``model_type``, so the runner, the row
kinds, the builder and the graphs never branch on a family:

* :class:`OuroStack`: the loop is ``model.loop`` (every layer, the final norm, the exit gate). A row
  starting a token reads the token's embedding, the others their slot's hidden state; logits are
  ``model.head`` of the loop's output (its ``lm_head`` read skipped on the device when no row exits). A step
  in which the host knows no decode row exits (``fixed_loops.py``: fixed depth, recorded depths; three steps
  in four at fixed depth and one request) samples nothing and reads nothing back.
* :class:`HuginnStack`: rows starting a token run the prelude (attention over the prelude plane) and
  draw the seeded latent initial state; every row then runs one core iteration (adapter injection of the
  token's prelude output, the core block, attention over the loop's plane) and, where its output matters,
  the coda (attention over the coda plane), whose output is what the head reads. The prelude output is kept per token (decode:
  per slot; prompts: per position) for the token's later loops. The extra per-token inputs (token ids,
  whether the row starts its token, latent seeds, the kept prelude output, the prelude and coda planes'
  KV slots and block tables) live in buffers of this object, allocated only for Huginn.

A stage that runs for a row that does not need it changes nothing: a row that does not start a token
writes its prelude K/V to the scratch slot, so the prelude plane holds each token's K/V from the step it
started in; a row writes its coda K/V each time its coda runs, the last write (its exit loop's) being the
one later tokens read.

Huginn's stages are skipped where no row needs them (docs/model-families.md, 'Cost'): the coda's output
matters only for a row that exits at this loop (its logits; later tokens read the exit loop's coda K/V),
the prelude only for a row that starts a token. The host knows which rows those are for prompt chunks
(their loop) and for decode rows at fixed iterations or replaying recorded depths (``fixed_loops.py``);
every other decode row (the convergence exit reads ``p_r`` at every loop) may. :meth:`HuginnStack.plan` names the stages a step needs
as step features (``STAGED`` plus ``PRELUDE`` / ``CODA``): graph variants without a stage skip it (a graph
runs a stage for all its rows: it cannot pick rows on the device), and an eager step (``COMPACT``) runs each
stage over its rows that need it only, gathered. A shape without ``STAGED`` runs every stage for every row.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from loopline.attention.base import PagedAttentionMetadata, build_work_tiles
from loopline.attention.paged import PagedAttention
from loopline.models.family import family_of
from loopline.models.ops import Rope
from loopline.worker.decode_state import (
    DecodeRows,
    DecodeTensors,
    DeviceDecodeState,
    SlotOps,
)
from loopline.worker.fixed_loops import FixedLoops
from loopline.worker.lookahead_plan import Compacted
from loopline.worker.row_kinds import DecodeOut
from loopline.worker.staging import stage
from loopline.worker.step_inputs import Segment, StepInputs, StepPlan, StepShape

# step features of Huginn's stages (StepShape.features): STAGED says the others are authoritative (a shape
# without it runs every stage); PRELUDE / CODA: some row needs that stage; COMPACT (eager decode-only steps):
# each stage runs over the rows that need it only
STAGED, PRELUDE, CODA, COMPACT = "staged", "prelude", "coda", "compact"
# HuginnStack's step buffers (and their sizes): what a step's inputs are written into and its graph reads
_STEP_BUFFERS = ("ids", "starts", "seeds", "injected_in", "slot_mapping", "_tokens", "tables", "_rows")


class OuroStack:
    """Ouro's loop: ``model.loop`` (module docstring). Every hook is what the engine ran before the seam."""

    keeps_injected = False  # (per prompt position: RequestState.injected)

    def __init__(self, model: Any, *, ops: SlotOps, state: DeviceDecodeState, slot_hidden: Tensor,
                 slot_survival: Tensor, requests: dict, no_refill: bool = False, per_token_exits: bool = False,
                 **_: Any) -> None:
        self.model, self.ops, self.slot_hidden, self.requests = model, ops, slot_hidden, requests
        self.slot_survival = slot_survival
        # which decode rows may exit, counted on the host (fixed depth, recorded depths): a step where none
        # may samples nothing (at fixed depth and one request, three steps in four)
        self.fixed = FixedLoops.for_requests(requests, no_refill=no_refill, per_token_exits=per_token_exits)
        self._any_exit = True

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

    def reserve(self, tokens: int, rows: int, width: int, *, pin: bool = False) -> None:
        """Buffers for steps up to this size; ``pin``: graphs are about to capture views of them (none)."""

    # --- what a step needs of the loop (Ouro: everything, every step) ------------------------------
    graph_variants: tuple[tuple[str, frozenset[str]], ...] = (("", frozenset()),)
    """``(family name suffix, step features)`` of the decode graphs to capture, leanest first; the last runs
    everything (mixed steps' graphs use it)."""

    def plan(self, plan: StepPlan) -> None:
        """A step is launched with these rows: the step features the loop needs (none); whether a decode row
        may exit in it (``fixed_loops.py``; the counts advance: call once per launched step)."""
        dec, chunks = plan.kinds[0], plan.kinds[-1]
        for kind in plan.kinds[1:-1]:  # speculating requests: their loops are the rounds', never counted again
            for row in kind.rows:
                self.fixed.forget(row.request_id)
        _, exits = self.fixed.step(dec.rows, chunks.rows, lambda rid: self.requests[rid].prefill_loops)
        self._any_exit = bool(exits.any())

    def eager(self, shape: StepShape) -> StepShape:
        """The shape an eager step of the planned step runs at (its exact one)."""
        return shape

    def compact(self, dec: DecodeOut | None) -> Compacted:
        """The decode rows that sampling takes: every row (logits were computed for all), or none where the
        host knows that none exits (no token to sample, none to read back)."""
        return Compacted(dec, None, None) if dec is None or self._any_exit else Compacted(None, [], None)

    def forget(self, request_id: str) -> None:
        """The request finished."""
        self.fixed.forget(request_id)


class HuginnStack:
    """Huginn's loop (module docstring): prelude for rows starting a token, one core iteration, the coda.

    ``planes``: the prelude's and the coda's plane (``Family.once_planes``); ``max_num_seqs + 1`` slots."""

    keeps_injected = True

    def __init__(self, model: Any, *, state: DeviceDecodeState, slot_hidden: Tensor, requests: dict,
                 planes: dict[str, int], dtype: torch.dtype, no_refill: bool = False, per_token_exits: bool = False,
                 tile_tokens: int | None = None, **_: Any) -> None:
        self.model, self.state, self.slot_hidden, self.requests = model, state, slot_hidden, requests
        # which decode rows start a token or exit, counted on the host (fixed iterations, recorded depths)
        self.fixed = FixedLoops.for_requests(requests, no_refill=no_refill, per_token_exits=per_token_exits)
        self.tile_tokens = tile_tokens  # the attention's work-tile size (None: no work lists)
        # the planned step, and per stage (prelude, coda) its decode rows and prompt chunks that need it
        self._plan: StepPlan | None = None
        self._need: tuple = ((np.zeros(0, np.int64),) * 2,) * 2
        self._sub: tuple[_Subset | None, _Subset | None] = (None, None)  # the same on the device (COMPACT steps)
        self._coda_rows: Tensor | None = None  # the decode rows the last forward's coda ran for (None: every row)
        #: tokens planned, and of them those an eager run gives the prelude / the coda (what the skip saves)
        self.stage_rows: Counter = Counter()
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
        self._pinned: dict[str, Any] | None = None  # the step buffers graphs read (reserve(pin=True))
        self.reserve(1, 1, 1)
        self.scale = model.config.head_dim ** -0.5
        self._out: tuple[Tensor, Tensor] | None = None  # the last forward's (head input, prelude output)
        # the identity rotation the attention backends get (q and k arrive rotated: _PreRotated)
        d = model.config.head_dim
        self._identity = (torch.ones(1, d, dtype=dtype, device=self.device), torch.zeros(1, d, dtype=dtype, device=self.device))

    def reserve(self, tokens: int, rows: int, width: int, *, pin: bool = False) -> None:
        """Step buffers for ``tokens`` tokens and ``rows x width`` block-table entries. ``pin`` (before graphs
        capture): these become the buffers every later step writes and the graphs read. A graph replays
        fixed addresses and does not keep a tensor alive, so pinned buffers are never replaced: a larger
        (eager) step gets buffers of its own, which :meth:`plan` drops at the next step."""
        if pin:
            self._pinned = None
        # NOTE: new buffers, never a resize (a resize would move what a running step reads)
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
        if pin:
            self._pinned = {name: getattr(self, name) for name in _STEP_BUFFERS}

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

    # --- which stages a step runs (module docstring) ------------------------------------------------
    graph_variants = (("_core", frozenset({STAGED})), ("_prelude", frozenset({STAGED, PRELUDE})),
                      ("_coda", frozenset({STAGED, CODA})), ("", frozenset({STAGED, PRELUDE, CODA})))

    def plan(self, plan: StepPlan) -> None:
        """The stages the step's rows need, as step features: the prelude for prompt chunks at loop 1 and
        decode rows that may start a token, the coda for chunks at their prompt's last loop and decode rows
        that may exit (``fixed_loops.py``; the counts advance: call once per launched step)."""
        if self._pinned is not None:  # (a larger step's own buffers, if the last step had them, go)
            self.__dict__.update(self._pinned)
        dec, chunks, requests = plan.kinds[0], plan.kinds[-1], self.requests
        starts, exits = self.fixed.step(dec.rows, chunks.rows, lambda rid: requests[rid].prefill_loops)
        first = np.fromiter((r.loop == 1 for r in chunks.rows), bool, len(chunks.rows))
        last = np.fromiter((r.loop == requests[r.request_id].prefill_loops for r in chunks.rows), bool, len(chunks.rows))
        self._need = ((np.flatnonzero(starts), np.flatnonzero(first)), (np.flatnonzero(exits), np.flatnonzero(last)))
        features = {STAGED} | {name for name, (d, c) in zip((PRELUDE, CODA), self._need) if len(d) or len(c)}
        plan.features = plan.features | features
        self._plan, self._sub = plan, (None, None)
        self.stage_rows["tokens"] += sum(part.num_tokens for part in plan.kinds)
        for name, (d, c) in zip((PRELUDE, CODA), self._need):  # (as an eager run gathers them)
            self.stage_rows[name] += len(d) + int(_chunk_lens(chunks)[c].sum())

    def eager(self, shape: StepShape) -> StepShape:
        """An eager step (exact sizes) runs each stage for the rows that need it only, gathered
        (``COMPACT``); a graph's bucket runs a stage for all its rows."""
        if STAGED not in shape.features or len(self._plan.kinds) != 2:  # (speculative rows: not Huginn's)
            return shape
        self._sub = tuple(self._subset(shape, d, c) for d, c in self._need)
        return dataclasses.replace(shape, features=shape.features | {COMPACT})

    def _subset(self, shape: StepShape, dec_rows: np.ndarray, chunk_rows: np.ndarray) -> _Subset | None:
        """The step's decode rows ``dec_rows`` and prompt chunks ``chunk_rows`` as one stage's rows and tokens,
        with their attention's query offsets (and work list where the step has one); None: every row."""
        dec, chunks = self._plan.kinds
        nd = dec.num_rows
        if not len(dec_rows) and not len(chunk_rows) or len(dec_rows) + len(chunk_rows) == nd + chunks.num_rows:
            return None
        lens = _chunk_lens(chunks)[chunk_rows]
        starts = chunks.host.offsets[chunk_rows] + nd if len(chunk_rows) else np.zeros(0, np.int64)
        tokens = np.concatenate([dec_rows, *(np.arange(a, a + n) for a, n in zip(starts, lens))]).astype(np.int64)
        q = np.concatenate([np.ones(len(dec_rows), np.int64), lens])
        qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        rows = np.concatenate([dec_rows, nd + chunk_rows]).astype(np.int64)
        work = None
        if shape.work and len(chunk_rows):
            work = build_work_tiles(lens, self.tile_tokens or 64, first_row=len(dec_rows))
        staged = stage(self.device, tokens, rows, qsl, dec_rows.astype(np.int64), *([work] if work is not None else []))
        return _Subset(*staged[:4], int(q.max()), staged[4] if work is not None else None,
                       len(dec_rows) if work is not None else 0, len(dec_rows) == nd)

    def compact(self, dec: DecodeOut | None) -> Compacted:
        """The decode rows sampling takes: those that may exit (their logits were computed for them only in
        a ``COMPACT`` step; gathered here after a graph's)."""
        if dec is None:
            return Compacted(None, None, None)
        rows = self._need[1][0]
        if len(rows) == dec.exit.shape[0]:
            return Compacted(dec, None, None)
        if not len(rows):
            return Compacted(None, [], None)
        sub = self._sub[1]
        idx = sub.dec_rows if sub is not None else stage(self.device, rows.astype(np.int64))[0]
        logits = dec.logits if sub is not None else dec.logits[idx]
        return Compacted(DecodeOut(dec.exit[idx], logits, dec.slots[idx], dec.loops[idx], dec.run[idx],
                                   dec.token_index[idx]), rows.tolist(), idx)

    def forget(self, request_id: str) -> None:
        self.fixed.forget(request_id)

    # --- the loop ----------------------------------------------------------------------------------
    def _attn(self, attn: PagedAttention, stage_index: int, tables: Tensor, sub: _Subset | None) -> PagedAttention:
        """The step's attention on the prelude's (0) or the coda's (1) plane, for ``sub``'s rows (None: all)."""
        meta = attn.meta
        T = meta.slot_mapping.shape[0]
        slots = self.slot_mapping[stage_index, :T]
        if sub is None:
            stage_meta = PagedAttentionMetadata(meta.query_start_loc, meta.seq_lens, tables[stage_index], slots,
                                                meta.max_query_len, meta.max_seq_len, meta.work_tiles,
                                                meta.num_decode_rows)
        else:
            stage_meta = PagedAttentionMetadata(sub.qsl, meta.seq_lens[sub.rows], tables[stage_index][sub.rows],
                                                slots[sub.tokens], sub.max_query_len, meta.max_seq_len, sub.work,
                                                sub.num_decode_rows)
        return PagedAttention(attn.backend, attn.k_cache, attn.v_cache, stage_meta, attn.scale,
                              k_scale=attn.k_scale, v_scale=attn.v_scale)

    def _stage(self, fn: Any, x: Tensor, pos: Tensor, attn: PagedAttention, stage_index: int, tables: Tensor,
               sub: _Subset | None, base: Tensor) -> Tensor:
        """``fn(x, positions, attention)`` (the prelude or the coda) over the step's tokens, or ``sub``'s
        (then scattered into ``base``: the other tokens' values)."""
        if sub is not None:
            x, pos = x[sub.tokens], pos[sub.tokens]
        one, zero = (t.expand(x.shape[0], -1) for t in self._identity)
        out = fn(x, pos, _PreRotated(self._attn(attn, stage_index, tables, sub), one, zero))
        return out if sub is None else base.index_copy(0, sub.tokens, out)

    def __call__(self, inp: StepInputs, attn: PagedAttention) -> tuple[Tensor, Tensor]:
        model, T = self.model, inp.x.shape[0]
        rows, width = inp.block_tables.shape
        self.reserve(T, rows, width)
        tables = self._tables(rows, width)
        pos, starts, features = inp.positions, self.starts[:T, None], inp.shape.features
        staged = STAGED in features
        pre_sub, coda_sub = self._sub if COMPACT in features else (None, None)
        e = self.injected_in[:T]  # a row not starting a token injects its kept prelude output
        if not staged or PRELUDE in features:
            e = torch.where(starts, self._stage(model.prelude, self.ids[:T], pos, attn, 0, tables, pre_sub, e), e)
        s0 = model.initial_state(e, pos, self.seeds[:T])
        s = torch.where(starts, s0, inp.x)
        one, zero = (t.expand(T, -1) for t in self._identity)
        s, _ = model.core(s, e, pos, _PreRotated(attn, one, zero))
        y = None  # (no row needs the coda: none exits, no chunk ends its prompt)
        if not staged or CODA in features:
            # (tokens outside the subset keep the core's output: nothing reads their coda)
            y = self._stage(model.coda_hidden, s, pos, attn, 1, tables, coda_sub, s)
        self._out = (y, e)
        self._coda_rows = None if coda_sub is None or coda_sub.all_decode else coda_sub.dec_rows
        # no exit signal: the fixed-depth rule reads none (the convergence exit reads logits)
        return s, torch.zeros(T, dtype=torch.float32, device=s.device)

    def head_input(self, h: Tensor, lo: int, hi: int) -> Tensor:
        # NOTE: without the coda nothing reads this (no chunk ends its prompt): the core's output stands in
        y = self._out[0]
        return h if y is None else y[lo:hi]

    def injected(self, lo: int, hi: int) -> Tensor | None:
        return self._out[1][lo:hi]

    def decode_exit(self, h: Tensor, gate: Tensor, d: DecodeTensors, lo: int, hi: int) -> Tensor:
        """Decode rows' exit after this loop by the family's criterion on the coda's logits (the
        convergence test: ``KL(p_{r-1} || p_r) < threshold`` from ``min_loops`` on, always at ``max_loops``;
        ``p_0`` uniform), and their slots' latent state, ``log p`` and prelude output kept."""
        y, rows = self._out[0], self._coda_rows
        self.slot_hidden[d.slots] = h
        self.slot_injected[d.slots] = self._out[1][lo:hi]
        fixed = d.loops >= d.max_loops  # the rule of a row without the coda: the host knows it does not exit
        if y is None:
            self._logits = None
            return fixed
        # the rows the coda ran for (a COMPACT step's; the others keep ``fixed``)
        y = y[lo:hi] if rows is None else y[lo:hi][rows]
        slots, loops = (d.slots, d.loops) if rows is None else (d.slots[rows], d.loops[rows])
        self._logits = logits = self.model.head(y)
        prev = torch.where((loops == 1)[:, None], self._uniform, self.slot_logp[slots])
        sub = (d.min_loops, d.max_loops, d.threshold) if rows is None else (d.min_loops[rows], d.max_loops[rows],
                                                                             d.threshold[rows])
        ex, logp = self.criterion.decide(loops, prev, logits, *sub)
        self.slot_logp[slots] = logp
        return ex if rows is None else fixed.index_copy(0, rows, ex)

    def decode_logits(self, h: Tensor, ex: Tensor, lo: int, hi: int) -> Tensor:
        return self._logits

    def set_slot(self, slot: int, seed: int) -> None:
        """A request's latent seed in its decode slot (when it arrives)."""
        self.slot_seed[slot] = seed


class _Subset(NamedTuple):
    """One stage's rows in an eager step (``HuginnStack.eager``): decode rows first, then whole prompt chunks."""

    tokens: Tensor  # [n] int64, the step's tokens
    rows: Tensor  # [r] int64, the step's rows
    qsl: Tensor  # [r + 1] int32, query offsets among the subset's tokens
    dec_rows: Tensor  # [k] int64, its decode rows (the first k rows and tokens)
    max_query_len: int
    work: Tensor | None  # the chunks' work list, where the step's attention has one
    num_decode_rows: int  # (with a work list: the first k rows)
    all_decode: bool  # every decode row of the step is in it


def _chunk_lens(chunks: Any) -> np.ndarray:
    """Tokens of each prompt chunk of a step (``KindRows`` of the prefill kind)."""
    return np.diff(chunks.host.offsets) if chunks.num_rows else np.zeros(0, np.int64)


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
