"""The per-slot decode state's step ops, one kernel each (:class:`TritonSlotOps`).

:class:`loopline.worker.decode_state.SlotOps` is the reference in torch: deriving
a step's decode rows from the state, the loop's input (the
prelude or the slot's hidden state), the exit rule with the slots' hidden state
and survival, and the advance after sampling. There each gather, ``where`` and
scatter of a few elements is a launch of its own, ~40 per step, which at one
decode row cost ~10% of the step; here each op is one launch, one program per
row. Rows are distinct slots (padding rows all use the scratch slot, whose
contents nothing reads), so programs never race on live state.
"""
from __future__ import annotations

import torch
from torch import Tensor

from loopline.kernels import grid_dependency_wait, pdl_options
from loopline.spec.replay import AcceptanceReplay
from loopline.worker.decode_state import DecodeRows, DecodeTensors, DeviceDecodeState, PipeRows, RowsInto, SlotOps
from loopline.worker.lane_ring import LaneRing

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernels are unusable without triton
    triton = None

_I64, _I32, _BOOL = torch.int64, torch.int32, torch.bool


if triton is not None:

    @triton.jit
    def _copy_row(src, dst, n_cols, BLOCK: tl.constexpr):
        """``n_cols`` elements from ``src`` to ``dst``, ``BLOCK`` at a time."""
        for c in range(0, n_cols, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            m = cols < n_cols
            tl.store(dst + cols, tl.load(src + cols, mask=m), mask=m)

    @triton.jit
    def _store_kv_inputs(b, table, pos, run, plane, plane_slots_out, positions_out, slot_map_out, seq_lens_out,
                         tables_out, scratch_block, block_size, max_blocks, out_blocks, stride_tp, stride_to,
                         PLANES: tl.constexpr, PLANES_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
        """Row ``b``'s attention inputs at position ``pos`` through its slot's ``table`` (``[P, max_blocks]``
        rows ``stride_tp`` apart): its KV slot in every plane, the one of ``plane`` (written this loop), its
        position, seq length and ``plane``'s block table; a row that does not ``run`` reads and writes scratch."""
        planes = tl.arange(0, PLANES_PAD)
        pm = planes < PLANES
        blk = pos // block_size
        kv = tl.load(table + planes * stride_tp + blk, mask=pm & run & (blk < max_blocks), other=0).to(tl.int64)
        kv = tl.where(run, kv * block_size + pos % block_size, scratch_block * block_size)
        tl.store(plane_slots_out + b * PLANES + planes, kv, mask=pm)
        tl.store(slot_map_out + b, tl.sum(tl.where(planes == plane, kv, 0), 0))
        tl.store(positions_out + b, tl.where(run, pos, 0))
        tl.store(seq_lens_out + b, tl.where(run, pos + 1, 1).to(tl.int32))
        for t in range(0, out_blocks, BLOCK_T):
            cols = t + tl.arange(0, BLOCK_T)
            cm = cols < out_blocks
            blocks = tl.load(table + plane * stride_tp + cols, mask=cm & run, other=0)
            tl.store(tables_out + b.to(tl.int64) * stride_to + cols, tl.where(run, blocks, scratch_block), mask=cm)

    # NOTE: the row count changes from step to step (eager steps); not specializing on it keeps one
    # compiled variant instead of one per (== 1, divisible by 16) pattern, compiled mid-run.
    # (out_blocks, the written table width, follows the step's max_seq_len: not specialized either)
    @triton.jit(do_not_specialize=["n_rows", "out_blocks"])
    def _decode_rows_kernel(
        slots_ptr, min_in_ptr, max_in_ptr,  # [B] int64, from the host
        loop_s, pos_s, token_s, tidx_s, tables_s, trace_s, plane_of_loop,  # state; plane of each 1-based loop
        d_slots, loops_out, starts_out, ids_out, min_out, max_out, plane_slots_out,  # DecodeTensors fields
        positions_out, slot_map_out, seq_lens_out, tables_out, run_out, tidx_out,
        n_rows, max_blocks, out_blocks, trace_len, scratch_slot, scratch_block, block_size,
        stride_ts, stride_tp, stride_trace,
        PLANES: tl.constexpr, PLANES_PAD: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
        NO_REFILL: tl.constexpr, TRACE: tl.constexpr,
    ):
        b = tl.program_id(0)
        slot = tl.load(slots_ptr + b)
        loop = tl.load(loop_s + slot)
        if NO_REFILL:  # a slot between tokens waits while any slot of the batch is mid-token
            rows = tl.arange(0, ROWS_PAD)
            batch = tl.load(slots_ptr + rows, mask=rows < n_rows, other=0)
            in_flight = tl.max((tl.load(loop_s + batch, mask=rows < n_rows, other=0) > 0).to(tl.int32), 0)
            run = (loop > 0) | (in_flight == 0)
        else:
            run = loop >= 0  # every row runs (a tensor, as the branch above makes)
        loops = loop + 1
        pos = tl.load(pos_s + slot)
        tidx = tl.load(tidx_s + slot)
        if TRACE:
            depth = tl.load(trace_s + slot * stride_trace + tl.minimum(tidx, trace_len - 1)).to(tl.int64)
            min_loops, max_loops = depth, depth
        else:
            min_loops = tl.load(min_in_ptr + b)
            max_loops = tl.load(max_in_ptr + b)
        _store_kv_inputs(b, tables_s + slot.to(tl.int64) * stride_ts, pos, run, tl.load(plane_of_loop + loops),
                         plane_slots_out, positions_out, slot_map_out, seq_lens_out, tables_out, scratch_block,
                         block_size, max_blocks, out_blocks, stride_tp, out_blocks, PLANES, PLANES_PAD, BLOCK_T)
        tl.store(d_slots + b, tl.where(run, slot, scratch_slot))
        tl.store(loops_out + b, loops)
        tl.store(starts_out + b, (loops == 1).to(tl.int8))
        tl.store(ids_out + b, tl.load(token_s + slot))
        tl.store(min_out + b, min_loops)
        tl.store(max_out + b, max_loops)
        tl.store(run_out + b, run.to(tl.int8))
        tl.store(tidx_out + b, tidx)

    @triton.jit
    def _exit_and_store_kernel(
        h_ptr, gate_ptr, slots_ptr, loops_ptr, min_ptr, max_ptr, thr_ptr,  # rows [B]; h [B, H]
        hidden_s, survival_s, ex_out,  # slot state [S, H] / [S]; exit [B] bool
        n_cols, stride_h, stride_hs,
        BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        grid_dependency_wait(PDL)
        b = tl.program_id(0)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        loop = tl.load(loops_ptr + b)
        survival = tl.where(loop == 1, 1.0, tl.load(survival_s + slot))
        lam = tl.sigmoid(tl.load(gate_ptr + b).to(tl.float32))
        survival = survival * (1.0 - lam)
        thr = tl.load(thr_ptr + b)
        early = (thr < 1.0) & (loop >= tl.load(min_ptr + b)) & ((1.0 - survival) >= thr)
        ex = (loop >= tl.load(max_ptr + b)) | early
        tl.store(ex_out + b, ex.to(tl.int8))
        tl.store(survival_s + slot, survival)
        _copy_row(h_ptr + b * stride_h, hidden_s + slot * stride_hs, n_cols, BLOCK)

    @triton.jit
    def _decode_inputs_kernel(
        ids_ptr, starts_ptr, slots_ptr,  # rows [B]: int64, bool, int64
        embed_ptr, hidden_s, out_ptr,  # embedding [V, H], slot hidden state [S, H], out [B, H]
        n_cols, stride_e, stride_hs, stride_o,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        # One source row per program: the fed token's embedding or the slot's hidden state, never both.
        if tl.load(starts_ptr + b) != 0:
            src = embed_ptr + tl.load(ids_ptr + b) * stride_e
        else:
            src = hidden_s + tl.load(slots_ptr + b) * stride_hs
        _copy_row(src, out_ptr + b.to(tl.int64) * stride_o, n_cols, BLOCK)

    # The per-row operands are views into a step's rows (after its prefill rows), so their alignment may change
    # from step to step: the kernel compiled a second specialization at a 16-prompt step after start-up (H100,
    # tools/jit_misses.py, session 34), as the accept kernel did (below). None specializes on its alignment.
    @triton.jit(do_not_specialize=["slots_ptr", "loops_ptr", "run_ptr", "exited_ptr", "sampled_ptr", "record_ptr",
                                   "n_rows"])
    def _advance_kernel(
        loop_ptr, token_ptr, pos_ptr, tidx_ptr,  # per-slot state [S] int64, updated in place
        slots_ptr, loops_ptr, run_ptr, exited_ptr, sampled_ptr,  # per row [B]: int64, int64, bool, bool, int64
        record_ptr,  # [3, B] int64: exit, loop, token per row (RECORD)
        n_rows, BLOCK: tl.constexpr, RECORD: tl.constexpr, PDL: tl.constexpr,
    ):
        grid_dependency_wait(PDL)
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = rows < n_rows
        slot = tl.load(slots_ptr + rows, mask=m, other=0)
        run = tl.load(run_ptr + rows, mask=m, other=0) != 0
        ex = (tl.load(exited_ptr + rows, mask=m, other=0) != 0) & run
        # A row that runs and exits restarts its slot at loop 0, one that runs on takes the loop it
        # just ran; a waiting row (run False) changes nothing.
        ran = tl.load(loops_ptr + rows, mask=m, other=0)
        tl.store(loop_ptr + slot, tl.where(ex, 0, ran), mask=m & run)
        sampled = tl.load(sampled_ptr + rows, mask=m, other=0)
        tl.store(token_ptr + slot, sampled, mask=m & ex)
        if RECORD:
            tl.store(record_ptr + rows, ex.to(tl.int64), mask=m)
            tl.store(record_ptr + n_rows + rows, ran, mask=m)
            tl.store(record_ptr + 2 * n_rows + rows, sampled, mask=m)
        tl.store(pos_ptr + slot, tl.load(pos_ptr + slot, mask=m & ex, other=0) + 1, mask=m & ex)
        tl.store(tidx_ptr + slot, tl.load(tidx_ptr + slot, mask=m & ex, other=0) + 1, mask=m & ex)


    @triton.jit(do_not_specialize=["n_lanes", "max_loops", "out_blocks"])
    def _pipe_rows_kernel(
        slots_ptr, lane_ptr,  # [n] int64: the lane rows (slot, lane)
        valid_r, token_r, loop_r, exit_r, drafted_r, hidden_r,  # the ring's [S, L] fields, its [S, L, H] hidden
        token_s, pos_s, tables_s, plane_of_loop, embed_ptr,  # the decode state; plane of each loop; [V, H]
        loop_out, live_out, plane_slots_out,  # [n] int64 / int8, [n, P] int64
        positions_out, slot_map_out, seq_lens_out, tables_out, x_out,  # the step's attention inputs and input rows
        n_lanes, max_loops, scratch_slot, scratch_block, block_size, max_blocks, out_blocks, hidden_size,
        stride_ts, stride_tp, stride_e, stride_to, stride_x,
        PLANES: tl.constexpr, PLANES_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """``SlotOps.pipe_rows`` for one lane row a program. Rows are distinct (slot, lane) pairs but for the
        scratch slot's padding rows, which store back the values they read."""
        b = tl.program_id(0)
        slot = tl.load(slots_ptr + b)
        lane = tl.load(lane_ptr + b)
        at = slot * n_lanes + lane
        real = slot != scratch_slot
        valid = tl.load(valid_r + at) != 0
        enter = (lane == 0) & ~valid & real
        token = tl.where(enter, tl.load(token_s + slot), tl.load(token_r + at))
        ran = tl.where(enter, 0, tl.load(loop_r + at))
        exit_l = tl.where(enter, 0, tl.load(exit_r + at))
        drafted = (tl.load(drafted_r + at) != 0) & ~enter
        valid = valid | enter
        tl.store(token_r + at, token)
        tl.store(loop_r + at, ran)
        tl.store(exit_r + at, exit_l)
        tl.store(drafted_r + at, drafted.to(tl.int8))
        tl.store(valid_r + at, valid.to(tl.int8))
        live = valid & (exit_l == 0) & real
        loop = tl.minimum(ran + 1, max_loops)
        pos = tl.load(pos_s + slot) + lane
        _store_kv_inputs(b, tables_s + slot.to(tl.int64) * stride_ts, pos, live, tl.load(plane_of_loop + loop),
                         plane_slots_out, positions_out, slot_map_out, seq_lens_out, tables_out, scratch_block,
                         block_size, max_blocks, out_blocks, stride_tp, stride_to, PLANES, PLANES_PAD, BLOCK_T)
        tl.store(loop_out + b, loop)
        tl.store(live_out + b, live.to(tl.int8))
        # the loop's input: the token's embedding at loop 1, else the lane's hidden state (one source a row)
        if loop == 1:
            src = embed_ptr + token * stride_e
        else:
            src = hidden_r + at.to(tl.int64) * hidden_size
        _copy_row(src, x_out + b.to(tl.int64) * stride_x, hidden_size, BLOCK_H)

    @triton.jit(do_not_specialize=["n_lanes"])
    def _pipe_finish_kernel(
        h_ptr, gate_ptr, slots_ptr, lane_ptr, loop_ptr, live_ptr, min_ptr, max_ptr, thr_ptr,  # rows [n]; h [n, H]
        hidden_r, surv_r, loop_r, exit_r, ex_out,  # the ring's fields; exited [n] bool
        n_lanes, n_cols, stride_h,
        BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        """``SlotOps.pipe_finish`` for one lane row a program: the exit rule as ``_exit_and_store_kernel``
        computes it for plain decode rows, stored for live lanes only."""
        grid_dependency_wait(PDL)
        b = tl.program_id(0)
        at = tl.load(slots_ptr + b) * n_lanes + tl.load(lane_ptr + b)
        loop = tl.load(loop_ptr + b)
        live = tl.load(live_ptr + b) != 0
        survival = tl.where(loop == 1, 1.0, tl.load(surv_r + at))
        lam = tl.sigmoid(tl.load(gate_ptr + b).to(tl.float32))
        survival = survival * (1.0 - lam)
        thr = tl.load(thr_ptr + b)
        early = (thr < 1.0) & (loop >= tl.load(min_ptr + b)) & ((1.0 - survival) >= thr)
        exited = live & ((loop >= tl.load(max_ptr + b)) | early)
        tl.store(ex_out + b, exited.to(tl.int8))
        if live:
            tl.store(surv_r + at, survival)
            tl.store(loop_r + at, loop)
            if exited:
                tl.store(exit_r + at, loop)
            _copy_row(h_ptr + b * stride_h, hidden_r + at.to(tl.int64) * n_cols, n_cols, BLOCK)

    @triton.jit
    def _replay_hash(slot, index, salt, seed):
        """``AcceptanceReplay.hash`` of ``(slot, completion index, salt)``: the same 32-bit integer hash."""
        h = (index * 1_000_003 + slot * 7_919 + salt * 15_485_863 + seed.to(tl.int64) * 104_729 + 12_345) & 0xFFFFFFFF
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        return h ^ (h >> 16)

    @triton.jit
    def _replay_agrees(slot, index, seed, bound):
        """``AcceptanceReplay``'s draw for ``(slot, completion index)``, accepted below ``bound``
        (``AcceptanceReplay.threshold``)."""
        return _replay_hash(slot, index, 0, seed) < bound

    @triton.jit
    def _replay_changed(slot, index, loop, depth, seed, bounds_ptr, mask, MAX_LOOPS: tl.constexpr):
        """``AcceptanceReplay.changed``: the head's token at ``loop`` differs from the loop before's, by the
        replay's draw against loop's bound in ``bounds_ptr`` (``AcceptanceReplay.change_bounds``)."""
        bound = tl.load(bounds_ptr + tl.minimum(loop, MAX_LOOPS - 1), mask=mask, other=0)
        return (_replay_hash(slot, index, loop, seed) < bound) & (loop > depth)

    # The pipelining slots and their targets are views into a step's rows (after its decode rows), so their
    # addresses' alignment may change from step to step, and Triton specializes a pointer on its alignment:
    # the accept kernel compiled a second time in the middle of a measured run (H100, tools/spec_speed.py,
    # C = 2: 1.13-1.22x plain in a fresh process, 2.08x once compiled; its other arguments are fixed
    # allocations, constexprs or unspecialized ints). So no slot op specializes on those pointers (not yet
    # timed with this).
    @triton.jit(do_not_specialize=["slots_ptr", "y_ptr", "lanes", "depth", "replay_seed", "replay_bound"])
    def _pipe_accept_kernel(
        slots_ptr, y_ptr,  # [M] int64; [M, L] int64 targets
        valid_r, token_r, loop_r, exit_r, draft_r, drafted_r, surv_r, hidden_r, limit_r, stop_r,  # the ring
        token_s, pos_s, tidx_s,  # the decode state
        committed_ptr, verdicts_ptr,  # [M, L] int8 / int64 out
        lanes, depth, hidden_size, replay_seed, replay_bound, change_bounds_ptr,
        LP: tl.constexpr, SW: tl.constexpr, BLOCK_H: tl.constexpr, REPLAY: tl.constexpr, REDRAFT: tl.constexpr,
        MAX_LOOPS: tl.constexpr, DRAFTS: tl.constexpr,
    ):
        """One program per pipelining slot: ``accept_lanes`` (lane_ring.py) for its ``[L]`` lanes. Every
        value a lane needs of another lane (its predecessor's, or the one the shift brings) is loaded from
        that lane's address, so nothing moves between registers; the stores come after a barrier."""
        m = tl.program_id(0)
        slot = tl.load(slots_ptr + m)
        j = tl.arange(0, LP)
        inl = j < lanes
        base = slot * lanes
        row = m * lanes
        valid = (tl.load(valid_r + base + j, mask=inl, other=0) != 0) & inl
        token = tl.load(token_r + base + j, mask=inl, other=0)
        exit_l = tl.load(exit_r + base + j, mask=inl, other=0)
        draft = tl.load(draft_r + base + j, mask=inl, other=0)
        drafted = tl.load(drafted_r + base + j, mask=inl, other=0) != 0
        y = tl.load(y_ptr + row + j, mask=inl, other=0)
        exited = valid & (exit_l > 0)
        pm = inl & (j >= 1)  # the predecessor's values (lane 0 has none: masked loads give 0)
        valid_before = tl.load(valid_r + base + j - 1, mask=pm, other=0) != 0
        exit_before = tl.load(exit_r + base + j - 1, mask=pm, other=0)
        exited_before = valid_before & (exit_before > 0)
        if REDRAFT:  # a predecessor looping past the draft loop re-drafts: its token judges this lane too
            exited_before = exited_before | (valid_before & (exit_before == 0) & (
                tl.load(loop_r + base + j - 1, mask=pm, other=0) > depth))
        tidx0 = tl.load(tidx_s + slot)  # the slot's token index before this step's commits
        if REPLAY and REDRAFT:  # a lane's draft judged at the loop it ran (AcceptanceReplay.changed)
            loop_j = tl.load(loop_r + base + j, mask=inl, other=0)
            agrees = ~_replay_changed(slot, tidx0 + j, loop_j, depth, replay_seed, change_bounds_ptr, inl, MAX_LOOPS)
            loop_b = tl.load(loop_r + base + j - 1, mask=pm, other=0)
            follows = ~_replay_changed(slot, tidx0 + j - 1, loop_b, depth, replay_seed, change_bounds_ptr, pm,
                                       MAX_LOOPS) | (j == 0)
        elif REPLAY:  # (lane j's draft is for completion index token_index + j + 1; drawn by token_index + j)
            agrees = _replay_agrees(slot, tidx0 + j, replay_seed, replay_bound)
            follows = _replay_agrees(slot, tidx0 + j - 1, replay_seed, replay_bound) | (j == 0)
        else:
            agrees = y == draft
            follows = (token == tl.load(y_ptr + row + j - 1, mask=pm, other=0)) | (j == 0)
        # from the first judged lane that does not follow, every lane is dropped
        drop = tl.min(tl.where(valid & exited_before & ~follows, j, LP), axis=0)
        valid = valid & (j < drop)
        # the leading run of exited lanes that follow commits: c lanes
        c = tl.min(tl.where(valid & exited & follows, LP, j), axis=0)
        committed = j < c
        tl.store(committed_ptr + row + j, committed.to(tl.int8), mask=inl)
        tl.store(verdicts_ptr + row + j, tl.where(committed & drafted, 1 + agrees.to(tl.int64), 0), mask=inl)
        last = tl.load(y_ptr + row + tl.maximum(c - 1, 0))
        token_now = tl.where(c > 0, last, tl.load(token_s + slot))
        pos = tl.load(pos_s + slot) + c
        tidx = tidx0 + c
        # the ring moves past the committed run: lane j takes lane j + c's values (src), the entry rule
        # reads lane j - 1's after the move (prv)
        src = j + c
        ins = inl & (src < lanes)
        valid_n = (tl.load(valid_r + base + src, mask=ins, other=0) != 0) & ins & (src < drop)
        token_n = tl.load(token_r + base + src, mask=ins, other=0)
        loop_n = tl.load(loop_r + base + src, mask=ins, other=0)
        exit_n = tl.load(exit_r + base + src, mask=ins, other=0)
        draft_n = tl.load(draft_r + base + src, mask=ins, other=0)
        if REDRAFT:  # (a lane looping past the draft loop: its token is its draft now)
            draft_n = tl.where(valid_n & (exit_n == 0) & (loop_n > depth),
                               tl.load(y_ptr + row + src, mask=ins, other=0), draft_n)
        drafted_n = (tl.load(drafted_r + base + src, mask=ins, other=0) != 0) & ins
        if DRAFTS:  # a lane at the draft loop drafts its token (lane src's completion index is tidx0 + src)
            due = valid_n & (exit_n == 0) & (loop_n == depth)
            draft_n = tl.where(due, tl.load(y_ptr + row + src, mask=ins, other=0), draft_n)
            drafted_n = drafted_n | (due & (tidx0 + src + 1 < tl.load(limit_r + slot)))
        surv_n = tl.load(surv_r + base + src, mask=ins, other=1.0)
        prv = src - 1
        inp = pm & (prv < lanes)
        valid_p = (tl.load(valid_r + base + prv, mask=inp, other=0) != 0) & inp & (prv < drop)
        exit_p = tl.load(exit_r + base + prv, mask=inp, other=0)
        loop_p = tl.load(loop_r + base + prv, mask=inp, other=0)
        exited_p = valid_p & (exit_p > 0)
        drafted_p = valid_p & (exit_p == 0) & (loop_p >= depth)
        fed_token = exited_p  # the predecessor's token, not its draft, enters behind it
        if REDRAFT:
            fed_token = fed_token | (drafted_p & (loop_p > depth))
        if DRAFTS:  # (its draft at the draft loop is its token)
            fed_token = fed_token | (drafted_p & (loop_p == depth))
        fed = tl.where(fed_token, tl.load(y_ptr + row + prv, mask=inp, other=0),
                       tl.load(draft_r + base + prv, mask=inp, other=0))
        stop = tl.load(stop_r + slot * SW + tl.arange(0, SW))
        stops = tl.sum((fed[:, None] == stop[None, :]).to(tl.int32), axis=1) > 0
        room = tidx + j < tl.load(limit_r + slot)
        enter = pm & ~valid_n & (exited_p | drafted_p) & room & ~stops
        tl.debug_barrier()  # every load above (each thread reads other lanes' addresses) before any store
        tl.store(token_s + slot, token_now)
        tl.store(pos_s + slot, pos)
        tl.store(tidx_s + slot, tidx)
        tl.store(valid_r + base + j, (valid_n | enter).to(tl.int8), mask=inl)
        tl.store(token_r + base + j, tl.where(enter, fed, token_n), mask=inl)
        tl.store(loop_r + base + j, tl.where(enter, 0, loop_n), mask=inl)
        tl.store(exit_r + base + j, tl.where(enter, 0, exit_n), mask=inl)
        tl.store(draft_r + base + j, draft_n, mask=inl)
        tl.store(drafted_r + base + j, (drafted_n & ~enter).to(tl.int8), mask=inl)
        tl.store(surv_r + base + j, surv_n, mask=inl)
        if c > 0:  # hidden states: lane by lane towards lane 0 (a lane's source lies at or after it)
            cols = tl.arange(0, BLOCK_H)
            for lane in tl.static_range(LP):
                if lane < lanes:
                    s_lane = lane + c
                    for h0 in range(0, hidden_size, BLOCK_H):
                        cm = h0 + cols < hidden_size
                        v = tl.load(hidden_r + (base + s_lane) * hidden_size + h0 + cols,
                                    mask=cm & (s_lane < lanes), other=0.0)
                        tl.store(hidden_r + (base + lane) * hidden_size + h0 + cols, v, mask=cm)


    @triton.jit(do_not_specialize=["slots_ptr", "m", "lanes", "depth"])
    def _pipe_draft_lanes_kernel(
        slots_ptr, valid_r, loop_r, exit_r, tidx_s,  # [M] int64; the ring's [S, L] fields; [S] token index
        lane_ptr, due_ptr, index_ptr,  # [M] int64 / int8 / int64 out
        m, lanes, depth, BLOCK_M: tl.constexpr, LP: tl.constexpr,
    ):
        """``SlotOps.pipe_draft_lanes`` for ``BLOCK_M`` slots a program: each slot's first lane that ran loop
        ``depth`` and still loops (lane 0 where none does), as ``argmax`` of the due mask picks it."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rm = rows < m
        slot = tl.load(slots_ptr + rows, mask=rm, other=0)
        j = tl.arange(0, LP)
        mask = rm[:, None] & (j < lanes)[None, :]
        addr = slot[:, None] * lanes + j[None, :]
        valid = tl.load(valid_r + addr, mask=mask, other=0) != 0
        loop = tl.load(loop_r + addr, mask=mask, other=0)
        exit_l = tl.load(exit_r + addr, mask=mask, other=1)
        due = mask & valid & (exit_l == 0) & (loop == depth)
        first = tl.min(tl.where(due, j[None, :], LP), axis=1)
        any_due = first < LP
        lane = tl.where(any_due, first, 0).to(tl.int64)
        tl.store(lane_ptr + rows, lane, mask=rm)
        tl.store(due_ptr + rows, any_due.to(tl.int8), mask=rm)
        tl.store(index_ptr + rows, tl.load(tidx_s + slot, mask=rm, other=0) + lane, mask=rm)

    @triton.jit(do_not_specialize=["slots_ptr", "tok_ptr", "m", "lanes"])
    def _pipe_store_draft_kernel(
        slots_ptr, lane_ptr, due_ptr, index_ptr, tok_ptr,  # [M] each (due int8)
        draft_r, drafted_r, limit_r,  # the ring's [S, L] drafts and flags, its [S] max_tokens
        m, lanes, BLOCK_M: tl.constexpr,
    ):
        """``SlotOps.pipe_store_draft`` for ``BLOCK_M`` slots a program (distinct slots: no two rows write one
        lane)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rm = rows < m
        slot = tl.load(slots_ptr + rows, mask=rm, other=0)
        at = slot * lanes + tl.load(lane_ptr + rows, mask=rm, other=0)
        due = tl.load(due_ptr + rows, mask=rm, other=0) != 0
        room = tl.load(index_ptr + rows, mask=rm, other=0) + 1 < tl.load(limit_r + slot, mask=rm, other=0)
        old = tl.load(draft_r + at, mask=rm, other=0)
        tl.store(draft_r + at, tl.where(due, tl.load(tok_ptr + rows, mask=rm, other=0), old), mask=rm)
        was = tl.load(drafted_r + at, mask=rm, other=0) != 0
        tl.store(drafted_r + at, (was | (due & room)).to(tl.int8), mask=rm)


def _check(op: str, **tensors: tuple[Tensor, torch.dtype]) -> None:
    for name, (t, dtype) in tensors.items():
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous {dtype} tensor, got {t.dtype}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def _int8(t: Tensor) -> Tensor:
    return t.view(torch.int8)


class TritonSlotOps(SlotOps):
    """:class:`SlotOps` with each op one Triton kernel (CUDA, or the CPU interpreter in tests)."""

    name = "triton"

    def __init__(self) -> None:
        if triton is None:
            raise RuntimeError("TritonSlotOps needs the triton package")
        self._plane_of_loop: dict[tuple[int, torch.device], Tensor] = {}

    def _planes(self, ds: DeviceDecodeState) -> Tensor:
        """The layout's plane of every loop ``0 .. num_loops`` as a device table (``plane_index`` for the
        kernel; loop 0 never runs, its entry only keeps the table's index the loop itself)."""
        key = (id(ds.layout), ds.device)
        if key not in self._plane_of_loop:
            loops = torch.arange(1, ds.layout.num_loops + 1, dtype=_I64)
            planes = torch.cat([torch.zeros(1, dtype=_I64), ds.layout.plane_index(loops).to(_I64)])
            self._plane_of_loop[key] = planes.to(ds.device)
        return self._plane_of_loop[key]

    def decode_rows(self, ds: DeviceDecodeState, slots: Tensor, min_loops: Tensor, max_loops: Tensor,
                    threshold: Tensor, no_refill: bool, per_token_exits: bool, scratch_slot: int,
                    into: RowsInto | None = None) -> DecodeRows:
        n = slots.shape[0]
        _check("decode_rows", slots=(slots, _I64), min_loops=(min_loops, _I64), max_loops=(max_loops, _I64))
        planes, max_blocks = ds.layout.num_planes, ds.tables.shape[2]
        dev = slots.device
        i64 = dict(dtype=_I64, device=dev)
        loops, ids, tidx = (torch.empty(n, **i64) for _ in range(3))
        d_slots, mins, maxs = torch.empty(n, **i64), torch.empty(n, **i64), torch.empty(n, **i64)
        starts, run = torch.empty(n, dtype=_BOOL, device=dev), torch.empty(n, dtype=_BOOL, device=dev)
        plane_slots = torch.empty((n, planes), **i64)
        if into is None:
            positions, slot_mapping = torch.empty(n, **i64), torch.empty(n, **i64)
            seq_lens = torch.empty(n, dtype=_I32, device=dev)
            tables = torch.empty((n, max_blocks), dtype=_I32, device=dev)
        else:  # straight into the step's buffers
            positions, slot_mapping, seq_lens, tables = into
            _check("decode_rows", positions=(positions, _I64), slot_mapping=(slot_mapping, _I64),
                   seq_lens=(seq_lens, _I32), block_tables=(tables, _I32))
            if tables.shape[1] > max_blocks:
                raise ValueError(f"decode_rows: block_tables has {tables.shape[1]} columns, the state {max_blocks}")
        if n:
            trace = ds.trace if per_token_exits else ds.loop
            assert trace is not None, "set_trace() first"
            plane_of_loop = self._planes(ds)
            _decode_rows_kernel[(n,)](
                slots, min_loops, max_loops, ds.loop, ds.pos, ds.token, ds.token_index, ds.tables, trace,
                plane_of_loop, d_slots, loops, _int8(starts), ids, mins, maxs, plane_slots,
                positions, slot_mapping, seq_lens, tables, _int8(run), tidx,
                n, max_blocks, tables.shape[1], ds.max_tokens, scratch_slot, ds.scratch_block, ds.block_size,
                ds.tables.stride(0), ds.tables.stride(1), trace.stride(0),
                PLANES=planes, PLANES_PAD=triton.next_power_of_2(planes),
                ROWS_PAD=triton.next_power_of_2(n) if no_refill else 1,  # only no_refill reads the batch
                BLOCK_T=min(triton.next_power_of_2(max_blocks), 256), NO_REFILL=no_refill, TRACE=per_token_exits,
                num_warps=1)
        if per_token_exits:
            mins = maxs  # one tensor, as the reference returns
        dec = DecodeTensors(slots=d_slots, loops=loops, starts=starts, input_ids=ids, min_loops=mins,
                            max_loops=maxs, threshold=threshold, plane_slots=plane_slots)
        return DecodeRows(slots, dec, positions, slot_mapping, seq_lens, tables, loops, run, tidx)

    def decode_inputs(self, d: DecodeTensors, embed_weight: Tensor, slot_hidden: Tensor,
                      out: Tensor | None = None) -> Tensor:
        # One launch instead of the embedding, the gather and the where (3 at one row, ~2 us each). It is
        # a plain launch (no PDL): the layers' first PDL kernels may read what decode_rows wrote before
        # their grid-dependency wait only because a plain launch separates them from it.
        n = d.slots.shape[0]
        cols = slot_hidden.shape[1]
        if embed_weight.dtype != slot_hidden.dtype or embed_weight.shape[1] != cols:
            raise ValueError(f"decode_inputs: embed_weight ({embed_weight.dtype}, {embed_weight.shape[1]} columns) "
                             f"and slot_hidden ({slot_hidden.dtype}, {cols} columns) must match")
        if embed_weight.stride(1) != 1 or slot_hidden.stride(1) != 1:
            raise ValueError("decode_inputs: embed_weight and slot_hidden must have unit column stride")
        if out is None:
            out = torch.empty((n, cols), dtype=slot_hidden.dtype, device=slot_hidden.device)
        elif out.shape != (n, cols) or out.dtype != slot_hidden.dtype or out.stride(1) != 1:
            raise ValueError(f"decode_inputs: out must be [{n}, {cols}] {slot_hidden.dtype} with unit column stride")
        if n == 0:
            return out
        _check("decode_inputs", input_ids=(d.input_ids, _I64), starts=(d.starts, _BOOL), slots=(d.slots, _I64))
        _decode_inputs_kernel[(n,)](
            d.input_ids, _int8(d.starts), d.slots, embed_weight, slot_hidden, out, cols, embed_weight.stride(0),
            slot_hidden.stride(0), out.stride(0), BLOCK=min(triton.next_power_of_2(cols), 4096), num_warps=4)
        return out

    def exit_and_store(self, h: Tensor, gate: Tensor, d: DecodeTensors, slot_hidden: Tensor,
                       slot_survival: Tensor) -> Tensor:
        n, cols = h.shape
        ex = torch.empty(n, dtype=_BOOL, device=h.device)
        if n == 0:
            return ex
        _check("exit_and_store", gate=(gate, torch.float32), slots=(d.slots, _I64), loops=(d.loops, _I64),
               min_loops=(d.min_loops, _I64), max_loops=(d.max_loops, _I64), threshold=(d.threshold, torch.float32),
               slot_survival=(slot_survival, torch.float32))
        if h.stride(1) != 1 or slot_hidden.stride(1) != 1 or slot_hidden.dtype != h.dtype:
            raise ValueError("exit_and_store: h and slot_hidden must share a dtype and have unit column stride")
        _exit_and_store_kernel[(n,)](
            h, gate, d.slots, d.loops, d.min_loops, d.max_loops, d.threshold, slot_hidden, slot_survival, _int8(ex),
            cols, h.stride(0), slot_hidden.stride(0), BLOCK=min(triton.next_power_of_2(cols), 4096),
            **pdl_options(h.device), num_warps=4)
        return ex

    def advance(self, ds: DeviceDecodeState, slots: Tensor, loops: Tensor, run: Tensor, exited: Tensor,
                sampled: Tensor, record: Tensor | None = None) -> None:
        n = slots.shape[0]
        if n == 0:
            return
        _check("advance", slots=(slots, _I64), loops=(loops, _I64), run=(run, _BOOL), exited=(exited, _BOOL),
               sampled=(sampled, _I64), **({"record": (record, _I64)} if record is not None else {}))
        for name, t in (("loops", loops), ("run", run), ("exited", exited), ("sampled", sampled)):
            if t.shape != (n,):
                raise ValueError(f"advance: {name} must have one entry per row ({n}), got {tuple(t.shape)}")
        if record is not None and record.shape != (3, n):
            raise ValueError(f"advance: record must be [3, {n}] (exit, loop, token per row), got {tuple(record.shape)}")
        block = 128
        _advance_kernel[(triton.cdiv(n, block),)](
            ds.loop, ds.token, ds.pos, ds.token_index, slots, loops, _int8(run), _int8(exited), sampled,
            record if record is not None else slots, n, BLOCK=block, RECORD=record is not None,
            **pdl_options(slots.device), num_warps=4)


    def pipe_rows(self, ring: LaneRing, ds: DeviceDecodeState, slots: Tensor, lane: Tensor, max_loops: int,
                  scratch_slot: int, embed_weight: Tensor, into: RowsInto, x: Tensor) -> PipeRows:
        n, dev = slots.shape[0], slots.device
        planes, max_blocks, hidden = ds.layout.num_planes, ds.tables.shape[2], ring.hidden.shape[-1]
        loop, live = torch.empty(n, dtype=_I64, device=dev), torch.empty(n, dtype=_BOOL, device=dev)
        plane_slots = torch.empty((n, planes), dtype=_I64, device=dev)
        if not n:
            return PipeRows(loop, live, plane_slots)
        positions, slot_mapping, seq_lens, tables = into
        _check("pipe_rows", slots=(slots, _I64), lane=(lane, _I64), positions=(positions, _I64),
               slot_mapping=(slot_mapping, _I64), seq_lens=(seq_lens, _I32))
        if tables.dtype != _I32 or tables.stride(1) != 1 or tables.shape[1] > max_blocks:
            raise ValueError(f"pipe_rows: block_tables must be int32 rows of unit stride, at most {max_blocks} wide")
        if (x.shape != (n, hidden) or x.stride(1) != 1 or embed_weight.stride(1) != 1
                or not x.dtype == embed_weight.dtype == ring.hidden.dtype):
            raise ValueError(f"pipe_rows: x must be [{n}, {hidden}] of unit column stride, in the dtype of "
                             "embed_weight and the ring's hidden state")
        _pipe_rows_kernel[(n,)](
            slots, lane, _int8(ring.valid), ring.token, ring.loop, ring.exit_loop, _int8(ring.drafted), ring.hidden,
            ds.token, ds.pos, ds.tables, self._planes(ds), embed_weight, loop, _int8(live), plane_slots,
            positions, slot_mapping, seq_lens, tables, x,
            ring.lanes, max_loops, scratch_slot, ds.scratch_block, ds.block_size, max_blocks, tables.shape[1], hidden,
            ds.tables.stride(0), ds.tables.stride(1), embed_weight.stride(0), tables.stride(0), x.stride(0),
            PLANES=planes, PLANES_PAD=triton.next_power_of_2(planes),
            BLOCK_T=min(triton.next_power_of_2(max_blocks), 256), BLOCK_H=min(triton.next_power_of_2(hidden), 4096),
            num_warps=4)
        return PipeRows(loop, live, plane_slots)

    def pipe_finish(self, ring: LaneRing, h: Tensor, gate: Tensor, slots: Tensor, lane: Tensor, rows: PipeRows,
                    min_loops: Tensor, max_loops: Tensor, threshold: Tensor) -> Tensor:
        n, cols = h.shape
        exited = torch.empty(n, dtype=_BOOL, device=h.device)
        if not n:
            return exited
        _check("pipe_finish", gate=(gate, torch.float32), slots=(slots, _I64), lane=(lane, _I64),
               loop=(rows.loop, _I64), live=(rows.live, _BOOL), min_loops=(min_loops, _I64),
               max_loops=(max_loops, _I64), threshold=(threshold, torch.float32))
        if h.stride(1) != 1 or h.dtype != ring.hidden.dtype or cols != ring.hidden.shape[-1]:
            raise ValueError("pipe_finish: h must have unit column stride and the ring's hidden dtype and width")
        _pipe_finish_kernel[(n,)](
            h, gate, slots, lane, rows.loop, _int8(rows.live), min_loops, max_loops, threshold, ring.hidden,
            ring.survival, ring.loop, ring.exit_loop, _int8(exited), ring.lanes, cols, h.stride(0),
            BLOCK=min(triton.next_power_of_2(cols), 4096), **pdl_options(h.device), num_warps=4)
        return exited

    def pipe_accept(self, ring: LaneRing, ds: DeviceDecodeState, slots: Tensor, target: Tensor, depth: int,
                    replay: AcceptanceReplay | None = None, *, redraft: bool = False,
                    drafts: bool = False) -> tuple[Tensor, Tensor]:
        m, lanes = slots.shape[0], ring.lanes
        dev = slots.device
        committed = torch.empty(m * lanes, dtype=_BOOL, device=dev)
        verdicts = torch.empty(m * lanes, dtype=_I64, device=dev)
        if not m:
            return committed, verdicts
        y = target.long().contiguous()
        _check("pipe_accept", slots=(slots, _I64), target=(y, _I64))
        redraft = self.redrafts(replay, redraft)
        _pipe_accept_kernel[(m,)](
            slots, y, _int8(ring.valid), ring.token, ring.loop, ring.exit_loop, ring.draft,
            _int8(ring.drafted), ring.survival, ring.hidden, ring.limit, ring.stop, ds.token, ds.pos, ds.token_index,
            _int8(committed), verdicts, lanes, depth, ring.hidden.shape[-1],
            replay.seed if replay is not None else 0, replay.threshold() if replay is not None else 0,
            replay.change_bounds(dev) if replay is not None and redraft else ds.pos,  # (ds.pos: unread without them)
            LP=triton.next_power_of_2(lanes), SW=ring.STOP_WIDTH,
            BLOCK_H=min(triton.next_power_of_2(ring.hidden.shape[-1]), 1024), REPLAY=replay is not None,
            REDRAFT=redraft, MAX_LOOPS=AcceptanceReplay.MAX_LOOPS, DRAFTS=drafts, num_warps=4)
        return committed, verdicts

    def pipe_draft_lanes(self, ring: LaneRing, ds: DeviceDecodeState, slots: Tensor,
                         depth: int) -> tuple[Tensor, Tensor, Tensor]:
        m, dev = slots.shape[0], slots.device
        lane = torch.empty(m, dtype=_I64, device=dev)
        due = torch.empty(m, dtype=_BOOL, device=dev)
        index = torch.empty(m, dtype=_I64, device=dev)
        if not m:
            return lane, due, index
        _check("pipe_draft_lanes", slots=(slots, _I64))
        block = 32
        _pipe_draft_lanes_kernel[(triton.cdiv(m, block),)](
            slots, _int8(ring.valid), ring.loop, ring.exit_loop, ds.token_index, lane, _int8(due), index,
            m, ring.lanes, depth, BLOCK_M=block, LP=triton.next_power_of_2(ring.lanes), num_warps=1)
        return lane, due, index

    def pipe_store_draft(self, ring: LaneRing, slots: Tensor, lane: Tensor, due: Tensor, index: Tensor,
                         drafted: Tensor) -> None:
        m = slots.shape[0]
        if not m:
            return
        tok = drafted.long().contiguous()
        _check("pipe_store_draft", slots=(slots, _I64), lane=(lane, _I64), due=(due, _BOOL), index=(index, _I64),
               drafted=(tok, _I64))
        for name, t in (("lane", lane), ("due", due), ("index", index), ("drafted", tok)):
            if t.shape != (m,):
                raise ValueError(f"pipe_store_draft: {name} must have one entry per slot ({m}), got {tuple(t.shape)}")
        block = 32
        _pipe_store_draft_kernel[(triton.cdiv(m, block),)](
            slots, lane, _int8(due), index, tok, ring.draft, _int8(ring.drafted), ring.limit, m, ring.lanes,
            BLOCK_M=block, num_warps=1)


__all__ = ["TritonSlotOps"]
