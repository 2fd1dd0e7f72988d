"""Model runner: owns every device tensor and runs one forward per step.

One step (DESIGN.md §4): prelude for rows that start a token, one traversal of
the shared stack + final norm + gate for all rows (each attending its own
plane), exit decisions, the ``last_exited`` exit copy, and coda + sampling for
rows whose token exits -- all in ``execute``.

This is the simple synchronous path: the host reads exit flags and sampled
tokens at the end of each step. It is the reference the fast paths are tested
against.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
from torch import Tensor

from loopline.attention import AttentionBackend
from loopline.attention.paged import PagedAttention
from loopline.core.contracts import (
    ExitParams,
    NewRequestData,
    ResumedRequestData,
    RunnerOutput,
    SampledToken,
    SchedulerOutput,
)
from loopline.core.exit_policy import exit_decision
from loopline.kv.layout import KVLayout
from loopline.models.ouro import OuroForCausalLM
from loopline.sampling_params import SamplingParams
from loopline.attention import PagedAttentionMetadata
from loopline.worker.cuda_graphs import DecodeGraphs, MixedGraphs
from loopline.worker.decode_state import DecodeTensors, DeviceDecodeState, SlotOps
from loopline.worker.sampler import Sampler, SamplerOutput
from loopline.worker.sampling_inputs import ParamsStager, SampleBatch, build_sampling_tensors, has_penalties
from loopline.worker.staging import stage
from loopline.worker.swap import Snapshot
from loopline.worker.step_inputs import DecodeBatch, StepInputs, build_step_inputs, work_list

_SEED_MASK = 2**63 - 1


def _slot_ops(model: OuroForCausalLM) -> SlotOps:
    """The decode state's step ops in the kernels the model's layer ops use: fused Triton kernels with
    ``kernel_backend="triton"``, the torch reference otherwise."""
    if model.ops.name == "triton":
        # NOTE: imported only here: Triton reads TRITON_INTERPRET when it decorates a kernel, and the
        # CPU-interpreted tests set it after the engine modules are imported.
        from loopline.kernels.slot_state import TritonSlotOps

        return TritonSlotOps()
    return SlotOps()


@dataclass
class _RequestState:
    """Device-side state of one running request."""

    params: SamplingParams
    seed: int
    prompt: Tensor  # [T] int64
    block_arrays: list[np.ndarray]  # per plane: physical blocks, int32 (host side; step inputs are built from them)
    prompt_exit: ExitParams
    hidden: Tensor  # [T, H] prefill hidden between loops
    survival: Tensor  # [T] f32 prod(1 - lambda) so far
    sel_hidden: Tensor  # [T, H] hidden at the depth the exit rule picked
    sel_depth: Tensor  # [T] int64, 0 = not yet exited
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)

    def to(self, device: torch.device) -> "_RequestState":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})


class ModelRunner:
    def __init__(self, model: OuroForCausalLM, layout: KVLayout, backend: AttentionBackend, num_blocks: int,
                 block_size: int, max_num_seqs: int, sampler: Sampler, device: torch.device, dtype: torch.dtype) -> None:
        cfg = model.config
        self.model, self.layout, self.backend, self.sampler = model, layout, backend, sampler
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.num_loops = cfg.total_ut_steps
        self.vocab_size = cfg.vocab_size
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # One scratch block and one scratch slot beyond what the scheduler hands out:
        # padding rows of a CUDA graph write there and nowhere else.
        self.scratch_block, self.scratch_slot = num_blocks, max_num_seqs
        shape = (cfg.num_hidden_layers, num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        # Per-slot decode state stays on the device between steps.
        self.slot_hidden = torch.zeros(max_num_seqs + 1, cfg.hidden_size, dtype=dtype, device=device)
        self.slot_survival = torch.ones(max_num_seqs + 1, dtype=torch.float32, device=device)
        self.slot_ops = _slot_ops(model)
        self.max_num_seqs = max_num_seqs
        self.work_tile_tokens = backend.work_tile_tokens(cfg.num_attention_heads // cfg.num_key_value_heads)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.decode_state: DeviceDecodeState | None = None  # async scheduling only
        self._no_refill = False
        self._sampling_params = ParamsStager()  # the sampled rows' parameters, on the device while unchanged
        self._per_token_exits = False
        self._graphs_max_seq_len: int | None = None  # graphs to recapture after a sleep
        self._graphs_max_tokens: int | None = None
        self._kv_shape = shape
        self._copies_on_exit = len(layout.exit_copy_planes(1)) > 0
        self.requests: dict[str, _RequestState] = {}
        self.snapshots: dict[str, Snapshot] = {}

    def enable_async(self, max_model_len: int, no_refill: bool, per_token_exits: bool = False) -> None:
        """Keeps decode slots' loop, position and token on the device (see ``decode_state.py``).

        ``per_token_exits``: the exit rule depends on the token index (``exit_mode="trace"``), which
        only the device knows; requests' recorded depths then live on the device too."""
        max_blocks = -(-(max_model_len + 1) // self.block_size)
        self.decode_state = DeviceDecodeState(self.max_num_seqs + 1, self.layout, self.block_size, max_blocks,
                                              self.scratch_block, self.device, self.slot_ops)
        self._no_refill = no_refill
        self._per_token_exits = per_token_exits
        if per_token_exits:
            self.decode_state.allocate_trace()

    def capture_graphs(self, max_seq_len: int, max_num_batched_tokens: int | None = None) -> None:
        """Captures decode-only steps, and steps with small prefill chunks (given the token budget),
        as CUDA graphs (CUDA and a graph-safe attention backend only)."""
        self.graphs = DecodeGraphs(self, self.max_num_seqs, max_seq_len)
        pool = self.graphs.capture()
        if max_num_batched_tokens is not None and self.work_tile_tokens:
            self.mixed_graphs = MixedGraphs(self, self.max_num_seqs, max_num_batched_tokens, max_seq_len)
            self.mixed_graphs.capture(pool)

    # --- sleep (colocated training) ---------------------------------------------------
    def release_kv_cache(self) -> None:
        """Frees the KV pool. No request may be in flight: leftover request state is dropped.

        CUDA graphs captured on the pool's addresses are dropped too; :meth:`restore_graphs`
        recaptures them once the pool (and the weights) are back.
        """
        self.requests.clear()
        self.snapshots.clear()
        if self.graphs is not None:
            self._graphs_max_seq_len, self.graphs = self.graphs.max_seq_len, None
            self._graphs_max_tokens = self.mixed_graphs.prefill_sizes[-1] if self.mixed_graphs is not None else None
            self.mixed_graphs = None
        self.k_cache = self.v_cache = torch.empty(0, dtype=self.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def allocate_kv_cache(self) -> None:
        """Re-allocates the KV pool released by :meth:`release_kv_cache` (zeroed, new addresses)."""
        self.k_cache = torch.zeros(self._kv_shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(self._kv_shape, dtype=self.dtype, device=self.device)

    def restore_graphs(self) -> None:
        """Recaptures the CUDA graphs dropped by :meth:`release_kv_cache` (a no-op if there were none)."""
        if self._graphs_max_seq_len is not None:
            max_seq_len, self._graphs_max_seq_len = self._graphs_max_seq_len, None
            self.capture_graphs(max_seq_len, self._graphs_max_tokens)

    @staticmethod
    def kv_bytes_per_block(model_cfg, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * model_cfg.num_hidden_layers * block_size * model_cfg.num_key_value_heads * model_cfg.head_dim * elem

    # --- request bookkeeping ----------------------------------------------------------
    def _add(self, new: NewRequestData) -> None:
        t, h = len(new.prompt_token_ids), self.model.config.hidden_size
        dev = self.device
        self.requests[new.request_id] = _RequestState(
            params=new.params, seed=new.seed & _SEED_MASK,
            prompt=stage(dev, (new.prompt_token_ids, np.int64))[0],
            block_arrays=[np.asarray(bt, dtype=np.int32) for bt in new.block_tables],
            prompt_exit=new.prompt_exit,
            hidden=torch.empty(t, h, dtype=self.dtype, device=dev),
            survival=torch.ones(t, dtype=torch.float32, device=dev),
            sel_hidden=torch.empty(t, h, dtype=self.dtype, device=dev),
            sel_depth=torch.zeros(t, dtype=torch.long, device=dev),
            slot=new.slot,
        )
        self._init_decode_slot(self.requests[new.request_id], new.block_tables)

    def _init_decode_slot(self, st: _RequestState, block_tables: list) -> None:
        """A request's per-slot device state before its first token (async scheduling)."""
        ds = self.decode_state
        if ds is None:
            return
        ds.set_tables(st.slot, block_tables)
        if has_penalties(st.params):
            ds.track_penalties(st.slot, st.prompt, self.vocab_size)
        if self._per_token_exits:
            ds.set_trace(st.slot, st.params.exit_depths)

    # --- preemption -------------------------------------------------------------------
    def _blocks_index(self, tables: list[np.ndarray]) -> Tensor:
        """Physical blocks of every plane, plane-major."""
        return torch.from_numpy(np.concatenate(tables).astype(np.int64)).to(self.device)

    def _snapshot(self, request_id: str) -> None:
        """Moves a preempted request to CPU memory: KV of every plane, slot state, request state."""
        st = self.requests.pop(request_id)
        idx = self._blocks_index(st.block_arrays)
        pin = self.device.type == "cuda"

        def to_host(t: Tensor) -> Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            return host

        slot = st.slot
        self.snapshots[request_id] = Snapshot(
            k=to_host(self.k_cache[:, idx]), v=to_host(self.v_cache[:, idx]),
            slot_hidden=to_host(self.slot_hidden[slot]), slot_survival=to_host(self.slot_survival[slot]),
            state=st.to(torch.device("cpu")), blocks_per_plane=len(st.block_arrays[0]),
            decode_state=self.decode_state.save(slot, to_host) if self.decode_state is not None else None)

    def _restore(self, resumed: ResumedRequestData) -> None:
        snap = self.snapshots.pop(resumed.request_id)
        st = snap.state.to(self.device)
        st.block_arrays = [np.asarray(t, dtype=np.int32) for t in resumed.block_tables]
        # The new tables may be longer (room for the next position); the snapshot fills their heads.
        idx = self._blocks_index([t[:snap.blocks_per_plane] for t in st.block_arrays])
        self.k_cache[:, idx] = snap.k.to(self.device, non_blocking=True)
        self.v_cache[:, idx] = snap.v.to(self.device, non_blocking=True)
        self.slot_hidden[resumed.slot] = snap.slot_hidden.to(self.device)
        self.slot_survival[resumed.slot] = snap.slot_survival.to(self.device)
        st.slot = resumed.slot
        if snap.decode_state is not None:
            self.decode_state.load(resumed.slot, snap.decode_state, resumed.block_tables)
        self.requests[resumed.request_id] = st

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.k.nbytes + s.v.nbytes for s in self.snapshots.values())

    # --- one step, async: launch now, read later ---------------------------------------
    def device_decode_rows(self, slots: Tensor, min_loops: Tensor, max_loops: Tensor, threshold: Tensor):
        """Decode rows ``slots`` derived from the device state (async scheduling), without the host.

        Returns ``(DecodeTensors, positions, slot_mapping, seq_lens, block_tables, (loops, run,
        token_index))``; a row with ``run`` False (a ``no_refill`` slot waiting for its cohort) runs
        on scratch and changes nothing. Used eagerly and inside CUDA graphs.
        """
        r = self.slot_ops.decode_rows(self.decode_state, slots, min_loops, max_loops, threshold, self._no_refill,
                                      self._per_token_exits, self.scratch_slot)
        return r.dec, r.positions, r.slot_mapping, r.seq_lens, r.block_tables, (r.loops, r.run, r.token_index)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> Callable[[], RunnerOutput]:
        """Queues a step on the device and returns the call that reads its results.

        Decode rows' loops, positions and tokens come from the device state
        (``DeviceDecodeState``), so the host never waits inside or between steps.
        """
        assert self.decode_state is not None, "enable_async() first"
        self._apply_lifecycle(sched)
        rows = sched.rows
        if not rows:
            return lambda: RunnerOutput([], [])
        dev, ds = self.device, self.decode_state
        nd = sum(1 for r in rows if not r.is_prefill)
        exited = [False] * len(rows)
        prompt_logprobs: dict = {}
        sample_hidden, sample_meta = [], []
        ex = logits = loops = run = tidx = slots = None
        x_parts, pos_parts, map_parts, seq_parts, table_parts, offsets = [], [], [], [], [], [0]
        p_tokens = sum(r.end - r.start for r in rows[nd:])
        p_seq = max((r.end for r in rows[nd:]), default=0)
        graphed = decode_graphed = False
        if nd:
            exits = [r.exit for r in rows[:nd]]
            host_rows = (np.fromiter((r.slot for r in rows[:nd]), np.int64, nd),
                         np.fromiter((e.min_loops for e in exits), np.int64, nd),
                         np.fromiter((e.max_loops for e in exits), np.int64, nd),
                         np.fromiter((e.threshold for e in exits), np.float32, nd))
            bound = max(self.requests[r.request_id].prompt.numel() + (self.requests[r.request_id].params.max_tokens or 0) + 1
                        for r in rows[:nd])
            key = self._mixed_key(rows, nd, p_tokens, max(bound, p_seq))
            if nd == len(rows) and self.graphs is not None and bound <= self.graphs.max_seq_len:
                # the graph derives the rows from the device state itself: one copy of four arrays
                ex, logits, (slots, loops, run, tidx) = self.graphs.run_slots(*host_rows)
                graphed = decode_graphed = True
            else:
                slots, *exit_arrays = stage(dev, *host_rows)
                dec, positions, slot_mapping, seq_lens, tables, (loops, run, tidx) = self.device_decode_rows(
                    slots, *exit_arrays)
                if key is not None:
                    ex, logits = self._run_mixed(key, rows, nd, exited, sample_hidden, sample_meta, prompt_logprobs,
                                                 decode_device=(dec, positions, slot_mapping, seq_lens, tables))
                    graphed = True
            if not graphed:
                x_parts.append(self.decode_inputs(dec))
                pos_parts.append(positions)
                map_parts.append(slot_mapping)
                seq_parts.append(seq_lens)
                table_parts.append(tables)
                offsets += list(range(1, nd + 1))
        elif (key := self._mixed_key(rows, 0, p_tokens, p_seq)) is not None:
            self._run_mixed(key, rows, 0, exited, sample_hidden, sample_meta, prompt_logprobs)
            graphed = True
        if not graphed:  # an eager step: prefill rows (and decode rows unless a graph ran them)
            max_seq = bound if nd else 0
            max_q = 1 if nd else 0
            if nd < len(rows):
                inp = build_step_inputs(rows[nd:], self._block_arrays, self.layout.num_planes, self.block_size)
                x_parts.append(self._gather_inputs(inp, None))
                p_pos, p_meta = inp.to_device(dev)
                pos_parts.append(p_pos)
                map_parts.append(p_meta.slot_mapping)
                seq_parts.append(p_meta.seq_lens)
                table_parts.append(p_meta.block_tables)
                offsets += [nd + o for o in inp.token_offsets[1:]]
                max_seq, max_q = max(max_seq, p_meta.max_seq_len), max(max_q, p_meta.max_query_len)
            width = max(t.shape[1] for t in table_parts)
            tables_all = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=self.scratch_block)
                                    for t in table_parts])
            qsl, *work = stage(dev, (offsets, np.int32), *work_list(offsets, max_q, self.work_tile_tokens, nd))
            meta = PagedAttentionMetadata(
                work_tiles=work[0] if work else None, num_decode_rows=nd if work else 0,
                query_start_loc=qsl, seq_lens=torch.cat(seq_parts),
                block_tables=tables_all, slot_mapping=torch.cat(map_parts), max_query_len=max_q, max_seq_len=max_seq)
            ex, logits = self._run_loop(rows, nd, torch.cat(x_parts), torch.cat(pos_parts), meta, offsets,
                                        dec if nd else None, exited, sample_hidden, sample_meta, prompt_logprobs)
        if ex is not None and not decode_graphed:  # (the decode graph masks its own)
            ex = self.exits_that_ran(ex, run)
        batch = self._sample(rows, nd, ex, logits, sample_hidden, sample_meta, depth=loops, token_index=tidx,
                             slots=slots)
        if batch is None:
            return lambda: RunnerOutput(exited, [None] * len(rows), prompt_logprobs)
        if nd:
            # Without finished prompts the decode rows are every sampled row: the advance packs their
            # results for the readback as it applies them, instead of a stack of its own.
            record = None if sample_meta else torch.empty((3, nd), dtype=torch.int64, device=dev)
            ds.advance(slots, loops, run, ex, batch.out.token_ids[:nd], record)
            batch.packed = record
        if sample_meta:  # prompts that finished: their first token is fed next, at position prompt_len
            done_rows = [rows[m[0]] for m in sample_meta]
            done_slots, done_ends = stage(dev, ([r.slot for r in done_rows], np.int64),
                                          ([r.end for r in done_rows], np.int64))
            ds.start(done_slots, batch.out.token_ids[nd:], done_ends)
        wait = batch.to_host_async()
        return lambda: self._collect(rows, batch, wait(), exited, prompt_logprobs)

    # --- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self._apply_lifecycle(sched)
        rows = sched.rows
        if not rows:
            return RunnerOutput([], [])
        inp = build_step_inputs(rows, self._block_arrays, self.layout.num_planes, self.block_size)
        nd = inp.decode.n
        exited = [False] * len(rows)
        prompt_logprobs: dict = {}
        sample_hidden, sample_meta = [], []  # prefill rows that finished: (row index, depth, token index)
        key = self._mixed_key(rows, nd, int(inp.offsets[-1]) - nd, inp.max_seq_len)
        if self.graphs is not None and inp.decode_only and self.graphs.fits(inp):
            ex, logits = self.graphs.run(inp)
        elif key is not None:
            # the step's inputs hold the decode rows first; the graph reads only those
            ex, logits = self._run_mixed(key, rows, nd, exited, sample_hidden, sample_meta, prompt_logprobs,
                                         decode=inp if nd else None)
        else:
            dec = self._decode_tensors(inp.decode) if nd else None
            x = self._gather_inputs(inp, dec)
            positions, meta = inp.to_device(self.device, self.work_tile_tokens)
            ex, logits = self._run_loop(rows, nd, x, positions, meta, inp.token_offsets, dec, exited, sample_hidden,
                                        sample_meta, prompt_logprobs)
        return self._sample_and_collect(rows, nd, ex, logits, sample_hidden, sample_meta, exited, prompt_logprobs)

    def _mixed_key(self, rows, nd: int, prefill_tokens: int, max_seq_len: int) -> tuple[int, int] | None:
        """The mixed-step graph that runs this step, if any (steps with prefill rows only)."""
        if self.mixed_graphs is None or nd == len(rows):
            return None
        return self.mixed_graphs.bucket(nd, prefill_tokens, len(rows) - nd, max_seq_len)

    def _run_mixed(self, key, rows, nd, exited, sample_hidden, sample_meta, prompt_logprobs, decode=None,
                   decode_device=None) -> tuple[Tensor | None, Tensor | None]:
        """A step with prefill rows through a captured graph; books the prefill rows like ``_run_loop``."""
        prefill = build_step_inputs(rows[nd:], self._block_arrays, self.layout.num_planes, self.block_size)
        ex, logits, h, gate = self.mixed_graphs.run(key, prefill, self._prefill_inputs(rows[nd:]), decode=decode,
                                                    decode_device=decode_device)
        self._book_prefill_rows(rows, nd, h, gate, prefill.token_offsets, exited, sample_hidden, sample_meta,
                                prompt_logprobs)
        return ex, logits

    def _run_loop(self, rows, nd, x, positions, meta, offsets, dec, exited, sample_hidden, sample_meta,
                  prompt_logprobs) -> tuple[Tensor | None, Tensor | None]:
        """One eager traversal for all rows; books prefill rows; returns the decode rows' (exit, logits)."""
        attn = PagedAttention(self.backend, self.k_cache, self.v_cache, meta, self.scale)
        h, gate = self.model.loop(x, positions, attn)
        self._book_prefill_rows(rows, nd, h, gate, offsets[nd:], exited, sample_hidden, sample_meta, prompt_logprobs)
        if dec is None:
            return None, None
        return self._decode_tail(h[:nd], gate[:nd], dec)

    def _apply_lifecycle(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
            self.snapshots.pop(rid, None)
        # Snapshots before any freed block is written, and before a new request resets the
        # device state of a slot a victim just gave up (the scheduler never preempts a request
        # it started or resumed in the same step, nor resumes one it preempted).
        for rid in sched.preempted_request_ids:
            self._snapshot(rid)
        for new in sched.new_requests:
            self._add(new)
        for resumed in sched.resumed_requests:
            self._restore(resumed)
        for rid, added in sched.block_updates.items():
            st = self.requests[rid]
            for plane, blocks in enumerate(added):
                st.block_arrays[plane] = np.concatenate([st.block_arrays[plane], np.asarray(blocks, dtype=np.int32)])
            if self.decode_state is not None:
                self.decode_state.set_tables(st.slot, st.block_arrays)

    def _block_arrays(self, request_id: str) -> list[np.ndarray]:
        return self.requests[request_id].block_arrays

    def _decode_tensors(self, d: DecodeBatch) -> DecodeTensors:
        names = [f.name for f in fields(DecodeTensors)]
        return DecodeTensors(**dict(zip(names, stage(self.device, *(getattr(d, n) for n in names)))))

    def _gather_inputs(self, inp: StepInputs, dec: DecodeTensors | None) -> Tensor:
        parts = [self.decode_inputs(dec)] if dec is not None else []
        parts += self._prefill_inputs(inp.rows[inp.decode.n:])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _prefill_inputs(self, prefill: list) -> list[Tensor]:
        """Each prefill row's input: embeddings at loop 1, the previous loop's hidden state after."""
        starting = [r for r in prefill if r.loop == 1]
        ids = iter(stage(self.device, *((r.input_token_ids, np.int64) for r in starting)))
        return [self.model.embed(next(ids)) if r.loop == 1 else self.requests[r.request_id].hidden[r.start:r.end]
                for r in prefill]

    def exits_that_ran(self, ex: Tensor, run: Tensor) -> Tensor:
        """Exit flags of async decode rows, where only rows that ran exit: a ``no_refill`` row waiting
        for its cohort does not. Without ``no_refill`` every row runs, and the mask would be a launch
        of its own."""
        return ex & run if self._no_refill else ex

    def decode_inputs(self, d: DecodeTensors) -> Tensor:
        """Prelude for rows starting a token, the slot's hidden state for the others. [B, H]"""
        return self.slot_ops.decode_inputs(d, self.model.model.embed_tokens.weight, self.slot_hidden)

    def _decode_tail(self, h: Tensor, gate: Tensor, d: DecodeTensors) -> tuple[Tensor, Tensor]:
        """Exit rule, slot state, the exit copy and the coda for every decode row, without host syncs.

        Returns ``(exit [B] bool, logits [B, V])``; the host reads both once at the end of the step.
        """
        ex = self.slot_ops.exit_and_store(h, gate, d, self.slot_hidden, self.slot_survival)
        if self._copies_on_exit:  # last_exited: a token exiting at loop e fills its deeper planes
            self.backend.copy_exited(self.k_cache, self.v_cache, d.plane_slots, d.loops, ex,
                                     self.scratch_block * self.block_size)
        return ex, self.model.head(h, needed=ex)  # rows not exiting: logits unused (may be zeros)

    def _book_prefill_rows(self, rows, nd, h, gate, offsets, exited, sample_hidden, sample_meta,
                           prompt_logprobs) -> None:
        """Books prefill rows ``rows[nd:]``; the j-th one's tokens are ``h[offsets[j]:offsets[j + 1]]``."""
        for j, i in enumerate(range(nd, len(rows))):
            lo, hi = offsets[j], offsets[j + 1]
            self._finish_prefill_row(i, rows[i], h[lo:hi], gate[lo:hi], exited, sample_hidden, sample_meta,
                                     prompt_logprobs)

    def _finish_prefill_row(self, i, row, h, gate, exited, sample_hidden, sample_meta, prompt_logprobs) -> None:
        st = self.requests[row.request_id]
        lo, hi = row.start, row.end
        ep = st.prompt_exit
        # NOTE: a chunk's rule is one (loop, min, max, threshold) for all its positions, so it
        # goes in as scalars; each op here is a launch per prefill row, which bounds steps
        # that carry many rows.
        if ep.threshold < 1.0:  # the gate decides, position by position
            survival = st.survival[lo:hi] if row.loop > 1 else 1.0
            ex, survival = exit_decision(row.loop, survival, gate, ep.min_loops, ep.max_loops, ep.threshold)
            st.survival[lo:hi] = survival
            newly = ex & (st.sel_depth[lo:hi] == 0)
            # torch.where, not boolean indexing: a mask index would sync with the host
            st.sel_hidden[lo:hi] = torch.where(newly[:, None], h, st.sel_hidden[lo:hi])
            st.sel_depth[lo:hi] = torch.where(newly, row.loop, st.sel_depth[lo:hi])
        elif row.loop == ep.max_loops:  # no early exit: every position exits exactly at max_loops
            st.sel_hidden[lo:hi] = h
            st.sel_depth[lo:hi] = row.loop
        if row.loop < self.num_loops:
            st.hidden[lo:hi] = h
            return
        # The chunk finished its last loop: prompt logprobs, and the first token if last chunk.
        if st.params.prompt_logprobs is not None:
            prompt_logprobs.setdefault(row.request_id, []).extend(self._prompt_logprobs(st, lo, hi))
        if row.is_last_chunk:
            exited[i] = True
            last = st.prompt.numel() - 1
            sample_hidden.append(st.sel_hidden[last])
            sample_meta.append((i, st.sel_depth[last:last + 1], 0))

    def _prompt_logprobs(self, st: _RequestState, lo: int, hi: int) -> list:
        """Position p predicts prompt token p+1 from its hidden at the depth the rule picked."""
        hi = min(hi, st.prompt.numel() - 1)
        if hi <= lo:
            return []
        logp = torch.log_softmax(self.model.head(st.sel_hidden[lo:hi]), dim=-1)
        nxt = st.prompt[lo + 1:hi + 1]
        chosen = logp.gather(1, nxt[:, None]).squeeze(1)
        ranks = (logp > chosen[:, None]).sum(1) + 1
        k = st.params.prompt_logprobs
        top_v, top_i = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
        out = []
        for j, (c, rk, tv, ti) in enumerate(zip(chosen.tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist())):
            out.append((lo + j, c, rk, list(zip(ti, tv))))
        return out

    # --- coda + sampling --------------------------------------------------------------
    def _sample_and_collect(self, rows, nd, ex, logits, sample_hidden, sample_meta, exited, prompt_logprobs) -> RunnerOutput:
        """Samples every decode row (kept only where its token exits) and every finished prompt,
        then reads everything back in one transfer."""
        batch = self._sample(rows, nd, ex, logits, sample_hidden, sample_meta)
        if batch is None:
            return RunnerOutput(exited, [None] * len(rows), prompt_logprobs)
        return self._collect(rows, batch, batch.to_host(), exited, prompt_logprobs)

    def _sample(self, rows, nd, ex, logits, sample_hidden, sample_meta, depth: Tensor | None = None,
                token_index: Tensor | None = None, slots: Tensor | None = None) -> "SampleBatch | None":
        """Coda + sampling for decode rows ``[:nd]`` (logits given) and finished prompts, on the device.

        ``depth`` / ``token_index`` / ``slots``: the decode rows' loops, token indices and slots when
        the device holds their state (async scheduling; penalties then read the device's token
        counts); otherwise the rows and the host's token lists say.
        """
        parts = [logits] if logits is not None else []
        if sample_hidden:
            parts.append(self.model.head(torch.stack(sample_hidden)))
        if not parts:
            return None
        all_logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        row_idx = list(range(nd)) + [m[0] for m in sample_meta]
        states = [self.requests[rows[i].request_id] for i in row_idx]
        index = [rows[i].token_index for i in range(nd)] + [m[2] for m in sample_meta]
        if token_index is not None:  # the device's (async): exact, where the host's lags; no cat without prompts
            index = (torch.cat([token_index, stage(self.device, (index[nd:], np.int64))[0]]) if sample_meta
                     else token_index)
        ds = self.decode_state
        tensors = build_sampling_tensors(states, index, all_logits.shape[-1], self.sampler.logprobs_mode, self.device,
                                         host_penalties=ds is None, params=self._sampling_params)
        if ds is not None and tensors.any_penalties:
            done = stage(self.device, ([rows[m[0]].slot for m in sample_meta], np.int64))[0]
            row_slots = torch.cat([slots, done]) if nd else done
            tensors.output_counts, tensors.seen_mask = ds.counts[row_slots], ds.seen[row_slots]
        out: SamplerOutput = self.sampler(all_logits, tensors)
        depths = [depth if depth is not None else stage(self.device, ([r.loop for r in rows[:nd]], np.int64))[0]] if nd else []
        depths += [m[1] for m in sample_meta]
        flags = [ex] if ex is not None else []
        if sample_meta:
            flags.append(torch.ones(len(sample_meta), dtype=torch.bool, device=self.device))
        # (no cat of a single part: at one decode row each launch is a sizeable part of the step)
        return SampleBatch(row_idx, states, out, *(t[0] if len(t) == 1 else torch.cat(t) for t in (flags, depths)))

    def _collect(self, rows, batch: "SampleBatch", host: dict, exited, prompt_logprobs) -> RunnerOutput:
        sampled: list[SampledToken | None] = [None] * len(rows)
        for j, row_i in enumerate(batch.row_idx):
            if not host["exit"][j]:
                continue
            st = batch.states[j]
            exited[row_i] = True
            k = st.params.logprobs
            top = None
            if k is not None and k > 0 and host["top_ids"] is not None:
                top = list(zip(host["top_ids"][j][:k], host["top_lps"][j][:k]))
            tid = host["ids"][j]
            sampled[row_i] = SampledToken(
                token_id=tid, exit_depth=host["depth"][j],
                logprob=host["lps"][j] if host["lps"] is not None else None,
                rank=host["ranks"][j] if host["ranks"] is not None else None, top=top)
            st.output_ids.append(tid)
        return RunnerOutput(exited, sampled, prompt_logprobs)
