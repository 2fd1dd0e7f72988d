"""The decode state's fused step ops vs their torch reference (CPU under TRITON_INTERPRET=1, GPU when present).

Each op runs on copies of one random state; every output and every state tensor must be equal (the
exit rule's survival within fp32 rounding: the kernel's sigmoid is not torch's)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_testing import DEVICE

import triton
import triton.language as tl

from loopline.spec.replay import AcceptanceReplay
from loopline.worker.triton_slot_ops import TritonSlotOps, _replay_agrees, _replay_changed
from loopline.kv.layout import make_layout
from loopline.worker.decode_state import DecodeTensors, DeviceDecodeState, SlotOps

SLOTS, BLOCK, MAX_BLOCKS, LOOPS = 40, 4, 9, 4


def _state(g: torch.Generator, layout: str, trace: bool) -> DeviceDecodeState:
    ds = DeviceDecodeState(SLOTS, make_layout(layout, LOOPS), BLOCK, MAX_BLOCKS, scratch_block=99, device=DEVICE)
    ds.loop.copy_(torch.randint(0, LOOPS, (SLOTS,), generator=g))
    ds.pos.copy_(torch.randint(0, MAX_BLOCKS * BLOCK - 1, (SLOTS,), generator=g))
    ds.token.copy_(torch.randint(0, 1000, (SLOTS,), generator=g))
    ds.token_index.copy_(torch.randint(0, 50, (SLOTS,), generator=g))
    ds.tables.copy_(torch.randint(0, 99, ds.tables.shape, generator=g, dtype=torch.int32))
    if trace:
        ds.allocate_trace()
        ds.trace.copy_(torch.randint(1, LOOPS + 1, ds.trace.shape, generator=g, dtype=torch.int8))
    return ds


def _clone(ds: DeviceDecodeState) -> DeviceDecodeState:
    copy = DeviceDecodeState(SLOTS, ds.layout, BLOCK, MAX_BLOCKS, ds.scratch_block, DEVICE)
    for name in ("loop", "pos", "token", "token_index", "tables", "trace"):
        t = getattr(ds, name)
        setattr(copy, name, None if t is None else t.clone())
    return copy


def _same_state(a: DeviceDecodeState, b: DeviceDecodeState) -> None:
    for name in ("loop", "pos", "token", "token_index", "tables"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _rows(g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    slots = torch.randperm(SLOTS - 1, generator=g)[:n].to(DEVICE)  # distinct; the last slot is scratch
    min_loops = torch.randint(1, 3, (n,), generator=g).to(DEVICE)
    max_loops = torch.randint(3, LOOPS + 1, (n,), generator=g).to(DEVICE)
    threshold = torch.rand(n, generator=g).to(DEVICE)
    return slots, min_loops, max_loops, threshold


@pytest.mark.parametrize("layout,no_refill,trace", [("last_exited", False, False), ("last_exited", True, False),
                                                    ("shared", False, True), ("shared", True, False)])
def test_decode_rows_matches_reference(layout, no_refill, trace):
    g = torch.Generator().manual_seed(3)
    ds = _state(g, layout, trace)
    if no_refill:  # half the batch mid-token, half between tokens: the latter wait
        ds.loop[:SLOTS // 2] = 0
    rows = _rows(g, 13)
    ref_ds, fused_ds = _clone(ds), _clone(ds)
    ref = SlotOps().decode_rows(ref_ds, *rows, no_refill, trace, scratch_slot=SLOTS - 1)
    out = TritonSlotOps().decode_rows(fused_ds, *rows, no_refill, trace, scratch_slot=SLOTS - 1)
    for name in DecodeTensors.__dataclass_fields__:
        a, b = getattr(out.dec, name), getattr(ref.dec, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("positions", "slot_mapping", "seq_lens", "block_tables", "loops", "run", "token_index"):
        a, b = getattr(out, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    _same_state(fused_ds, ref_ds)
    assert bool(ref.run.all()) != no_refill  # the case is exercised: waiting rows exist only with no_refill
    if trace:
        assert not torch.equal(ref.dec.max_loops, rows[2])


def test_exit_and_store_matches_reference():
    g = torch.Generator().manual_seed(4)
    n, hidden = 11, 40
    slots, min_loops, max_loops, threshold = _rows(g, n)
    loops = torch.randint(1, LOOPS + 1, (n,), generator=g).to(DEVICE)
    # threshold 1 means no early exit, even for a gate so sure that the survival rounds to 0
    threshold[:3], loops[:3], min_loops[:3], max_loops[:3] = 1.0, 2, 1, LOOPS
    d = DecodeTensors(slots=slots, loops=loops, starts=loops == 1, input_ids=slots, min_loops=min_loops,
                      max_loops=max_loops, threshold=threshold, plane_slots=slots[:, None])
    h = torch.randn(n, hidden, generator=g).to(DEVICE)
    gate = (3 * torch.randn(n, generator=g)).to(DEVICE)
    gate[:3] = 30.0
    hidden0 = torch.randn(SLOTS, hidden, generator=g).to(DEVICE)
    survival0 = torch.rand(SLOTS, generator=g).to(DEVICE)
    ref_h, ref_s, out_h, out_s = hidden0.clone(), survival0.clone(), hidden0.clone(), survival0.clone()
    ex_ref = SlotOps().exit_and_store(h, gate, d, ref_h, ref_s)
    ex = TritonSlotOps().exit_and_store(h, gate, d, out_h, out_s)
    assert torch.equal(ex, ex_ref)
    assert 0 < int(ex.sum()) < n  # both outcomes occur
    assert torch.equal(out_h, ref_h) and not torch.equal(out_h, hidden0)
    torch.testing.assert_close(out_s, ref_s, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("hidden", [40, 4100])  # 4100: more than one column block per row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_inputs_matches_reference(hidden, dtype):
    g = torch.Generator().manual_seed(5)
    n, vocab = 9, 300
    slots = torch.randperm(SLOTS - 1, generator=g)[:n].to(DEVICE)
    loops = torch.randint(1, LOOPS + 1, (n,), generator=g).to(DEVICE)
    loops[:2], loops[2:4] = 1, 3  # both sources occur
    ids = torch.randint(0, vocab, (n,), generator=g).to(DEVICE)
    d = DecodeTensors(slots=slots, loops=loops, starts=loops == 1, input_ids=ids, min_loops=loops,
                      max_loops=loops, threshold=loops.float(), plane_slots=slots[:, None])
    embed = torch.randn(vocab, hidden, generator=g).to(DEVICE, dtype)
    slot_hidden = torch.randn(SLOTS, hidden, generator=g).to(DEVICE, dtype)
    out = TritonSlotOps().decode_inputs(d, embed, slot_hidden)
    assert out.dtype == dtype and torch.equal(out, SlotOps().decode_inputs(d, embed, slot_hidden))
    assert torch.equal(out[0], embed[ids[0]]) and torch.equal(out[2], slot_hidden[slots[2]])
    with pytest.raises(ValueError, match="embed_weight .* and slot_hidden .* must match"):
        TritonSlotOps().decode_inputs(d, embed.float() if dtype != torch.float32 else embed.double(), slot_hidden)
    with pytest.raises(ValueError, match="input_ids must be a contiguous torch.int64"):
        TritonSlotOps().decode_inputs(dataclasses.replace(d, input_ids=ids.int()), embed, slot_hidden)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300: more than one program
def test_advance_matches_reference(rows):
    g = torch.Generator().manual_seed(rows)
    num_slots = 512
    ds = DeviceDecodeState(num_slots, make_layout("last_exited", LOOPS), BLOCK, MAX_BLOCKS, 0, DEVICE)
    for t in (ds.loop, ds.token, ds.pos, ds.token_index):
        t.copy_(torch.randint(0, 1000, (num_slots,), generator=g))
    slots = torch.randperm(num_slots, generator=g)[:rows].to(DEVICE)  # distinct, unordered
    loops = torch.randint(1, 5, (rows,), generator=g).to(DEVICE)
    run = (torch.rand(rows, generator=g) < 0.8).to(DEVICE)
    run[0] = True  # so that something changes
    exited = (torch.rand(rows, generator=g) < 0.5).to(DEVICE)
    sampled = torch.randint(0, 50000, (rows,), generator=g).to(DEVICE)
    before, ref, out, plain = _clone_slots(ds), _clone_slots(ds), _clone_slots(ds), _clone_slots(ds)
    ref_record, record = (torch.full((3, rows), -7, dtype=torch.long, device=DEVICE) for _ in range(2))
    SlotOps().advance(ref, slots, loops, run, exited, sampled, ref_record)
    TritonSlotOps().advance(out, slots, loops, run, exited, sampled, record)
    TritonSlotOps().advance(plain, slots, loops, run, exited, sampled)  # no record: the same state
    _same_state(out, ref)
    _same_state(plain, ref)
    assert any(not torch.equal(getattr(ref, n), getattr(before, n)) for n in ("loop", "pos", "token", "token_index"))
    # the record: what the host reads back, the rows' exits (only rows that ran), loops and tokens
    assert torch.equal(ref_record, torch.stack([(exited & run).long(), loops, sampled]))
    assert torch.equal(record, ref_record)


def _clone_slots(ds: DeviceDecodeState) -> DeviceDecodeState:
    copy = DeviceDecodeState(ds.loop.shape[0], ds.layout, BLOCK, MAX_BLOCKS, 0, DEVICE)
    for name in ("loop", "pos", "token", "token_index", "tables"):
        setattr(copy, name, getattr(ds, name).clone())
    return copy


def test_advance_rejects_bad_operands():
    ds = DeviceDecodeState(4, make_layout("last_exited", LOOPS), BLOCK, MAX_BLOCKS, 0, DEVICE)
    t = torch.zeros(2, dtype=torch.long, device=DEVICE)
    flags = torch.zeros(2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="run must be a contiguous torch.bool"):
        TritonSlotOps().advance(ds, t, t, t, flags, t)
    with pytest.raises(ValueError, match="loops must have one entry per row"):
        TritonSlotOps().advance(ds, t, t[:1], flags, flags, t)
    with pytest.raises(ValueError, match="record must be \\[3, 2\\]"):
        TritonSlotOps().advance(ds, t, t, flags, flags, t, torch.zeros(2, 2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="record must be a contiguous torch.int64"):
        TritonSlotOps().advance(ds, t, t, flags, flags, t, torch.zeros(3, 2, dtype=torch.int32, device=DEVICE))


def _ring(g: torch.Generator, lanes: int, hidden: int, dtype: torch.dtype):
    from loopline.worker.lane_ring import LaneRing

    ring = LaneRing(SLOTS, lanes, hidden, dtype, DEVICE)
    shape = (SLOTS, lanes)
    # few distinct tokens, so lanes follow their predecessors' targets and drafts agree often
    ring.valid.copy_(torch.rand(shape, generator=g) < 0.8)
    ring.token.copy_(torch.randint(0, 3, shape, generator=g))
    ring.loop.copy_(torch.randint(0, LOOPS + 1, shape, generator=g))
    ring.exit_loop.copy_(torch.where(torch.rand(shape, generator=g) < 0.6, ring.loop.cpu(), 0).clamp(min=0))
    ring.draft.copy_(torch.randint(0, 3, shape, generator=g))
    ring.drafted.copy_(torch.rand(shape, generator=g) < 0.5)
    ring.survival.copy_(torch.rand(shape, generator=g))
    ring.hidden.copy_(torch.randn((SLOTS, lanes, hidden), generator=g).to(dtype))
    ring.stop.copy_(torch.where(torch.rand((SLOTS, ring.STOP_WIDTH), generator=g) < 0.1,
                                torch.randint(0, 3, (SLOTS, ring.STOP_WIDTH), generator=g), -1))
    return ring


def _ring_fields(ring) -> dict[str, torch.Tensor]:
    return {name: getattr(ring, name) for name in
            ("valid", "token", "loop", "exit_loop", "draft", "drafted", "survival", "hidden", "limit", "stop")}


@pytest.mark.parametrize("lanes", [1, 3, 4, 5])
@pytest.mark.parametrize("replay, redraft, drafts", [(None, False, False), ("exit", False, False), (None, True, False),
                                                     ("exit", True, False), ("changes", True, False),
                                                     (None, False, True), (None, True, True), ("changes", True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipe_accept_matches_reference(lanes, replay, redraft, drafts, dtype):
    """The depth pipeline's step after sampling: verdicts, commits, the ring's move and the entries (with
    re-drafting lanes; a replay of verdicts at the exit turns re-drafting off, one of the loops' changes
    replays it; with ``drafts`` the lanes at the draft loop draft their targets)."""
    g = torch.Generator().manual_seed(lanes * 10 + (replay is not None))
    hidden = 40 if dtype == torch.float32 else 1100  # 1100: more than one column block per lane
    ds, ring = _state(g, "last_exited", False), _ring(g, lanes, hidden, dtype)
    # max_tokens within a few tokens of each slot's index: lanes at and past it
    ring.limit.copy_(ds.token_index + torch.randint(0, lanes + 2, (SLOTS,), generator=g).to(DEVICE))
    m = 12
    slots = torch.randperm(SLOTS - 1, generator=g)[:m].to(DEVICE)
    target = torch.randint(0, 3, (m * lanes,), generator=g).to(DEVICE)
    # (drawn in the kernel, by the same hash)
    agrees = (None if replay is None else
              AcceptanceReplay([0.7], seed=lanes, loop_changes=[0.3, 0.5] if replay == "changes" else None))
    ref_ds, ref_ring = _clone(ds), _ring(torch.Generator(), lanes, hidden, dtype)
    for name, t in _ring_fields(ring).items():
        getattr(ref_ring, name).copy_(t)
    if redraft and replay != "exit" and lanes > 1:  # the draw has lanes that re-draft and change the step
        plain_ds, plain_ring = _clone(ds), _ring(torch.Generator(), lanes, hidden, dtype)
        for name, t in _ring_fields(ring).items():
            getattr(plain_ring, name).copy_(t)
        SlotOps().pipe_accept(plain_ring, plain_ds, slots, target, 2, agrees, drafts=drafts)
    committed, verdicts = TritonSlotOps().pipe_accept(ring, ds, slots, target, 2, agrees, redraft=redraft,
                                                      drafts=drafts)
    ref_committed, ref_verdicts = SlotOps().pipe_accept(ref_ring, ref_ds, slots, target, 2, agrees, redraft=redraft,
                                                        drafts=drafts)
    if redraft and replay != "exit" and lanes > 1:
        assert any(not torch.equal(getattr(plain_ring, name), getattr(ref_ring, name)) for name in ("valid", "draft"))
    assert torch.equal(committed, ref_committed) and torch.equal(verdicts, ref_verdicts)
    assert ref_committed.any() and (ref_verdicts > 0).any() and not ref_committed.all()  # the draw covers cases
    _same_state(ds, ref_ds)
    for name, t in _ring_fields(ring).items():
        assert torch.equal(t, getattr(ref_ring, name)), name


@pytest.mark.parametrize("lanes", [1, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 12, 36])  # 36: more than one program
def test_pipe_draft_lanes_and_store_match_reference(lanes, m):
    """The depth pipeline's drafting lane of each slot (first lane that ran loop d and still loops; lane 0,
    not due, where none does), its token's completion index, and the store of the drafts."""
    g = torch.Generator().manual_seed(lanes * 100 + m)
    depth = 2
    ds, ring = _state(g, "last_exited", False), _ring(g, lanes, 8, torch.float32)
    ring.loop.copy_(torch.randint(1, 4, ring.loop.shape, generator=g))  # loop == depth often
    ring.exit_loop.copy_(torch.where(torch.rand(ring.loop.shape, generator=g) < 0.3, ring.loop.cpu(), 0))
    ring.limit.copy_(ds.token_index + torch.randint(0, lanes + 2, (SLOTS,), generator=g).to(DEVICE))
    slots = torch.randperm(SLOTS - 1, generator=g)[:m].to(DEVICE)
    ref_ring = _ring(torch.Generator(), lanes, 8, torch.float32)
    for name, t in _ring_fields(ring).items():
        getattr(ref_ring, name).copy_(t)
    got = TritonSlotOps().pipe_draft_lanes(ring, ds, slots, depth)
    want = SlotOps().pipe_draft_lanes(ref_ring, ds, slots, depth)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    lane, due, index = want
    if m >= 12:  # the draw covers due and idle slots, and lanes past 0
        assert due.any() and not due.all() and ((lane > 0).any() or lanes == 1)
    tokens = torch.randint(5, 9, (m,), generator=g).to(DEVICE)
    TritonSlotOps().pipe_store_draft(ring, slots, lane, due, index, tokens)
    SlotOps().pipe_store_draft(ref_ring, slots, lane, due, index, tokens)
    for name, t in _ring_fields(ring).items():
        assert torch.equal(t, getattr(ref_ring, name)), name
    assert (ring.draft >= 5).any() == bool(due.any())


@pytest.mark.parametrize("redraft", [False, True])
def test_drafts_in_accept_equal_the_draft_store_before_it(redraft):
    """``pipe_accept(drafts=True)`` (each lane at the draft loop drafts its target token) does what storing the
    targets of ``pipe_draft_lanes``' lanes with ``pipe_store_draft`` and then accepting did (a slot has at most
    one lane at the draft loop: lanes enter one a step)."""
    g = torch.Generator().manual_seed(5 + redraft)
    lanes, depth, m = 4, 2, 30
    ds, ring = _state(g, "last_exited", False), _ring(g, lanes, 8, torch.float32)
    ring.loop.copy_(torch.randint(1, 4, ring.loop.shape, generator=g))
    ring.exit_loop.copy_(torch.where(torch.rand(ring.loop.shape, generator=g) < 0.3, ring.loop.cpu(), 0))
    at_depth = ring.loop == depth
    later = at_depth & (at_depth.long().cumsum(dim=1) > 1)  # (one lane a slot at the draft loop)
    ring.loop.copy_(torch.where(later, depth + 1, ring.loop))
    ring.exit_loop.copy_(torch.where(later & (ring.exit_loop > 0), depth + 1, ring.exit_loop))
    ring.limit.copy_(ds.token_index + torch.randint(0, lanes + 2, (SLOTS,), generator=g).to(DEVICE))
    slots = torch.randperm(SLOTS - 1, generator=g)[:m].to(DEVICE)
    target = torch.randint(0, 3, (m * lanes,), generator=g).to(DEVICE)
    old_ds, old_ring = _clone(ds), _ring(torch.Generator(), lanes, 8, torch.float32)
    for name, t in _ring_fields(ring).items():
        getattr(old_ring, name).copy_(t)
    ops = SlotOps()
    lane, due, index = ops.pipe_draft_lanes(old_ring, old_ds, slots, depth)
    assert due.any() and not due.all()  # the draw covers drafting and idle slots
    ops.pipe_store_draft(old_ring, slots, lane, due, index, target.view(m, lanes)[torch.arange(m), lane])
    want = ops.pipe_accept(old_ring, old_ds, slots, target, depth, redraft=redraft)
    got = ops.pipe_accept(ring, ds, slots, target, depth, redraft=redraft, drafts=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    _same_state(ds, old_ds)
    # a draft means something from its lane's draft loop on (before it, a dropped lane's or a new one's is stale:
    # the lane's own draft replaces it before anything reads it)
    live = {"draft": ring.valid & (ring.loop >= depth), "drafted": ring.valid}
    for name, t in _ring_fields(ring).items():
        if name in live:
            assert torch.equal(t[live[name]], getattr(old_ring, name)[live[name]]), name
        else:
            assert torch.equal(t, getattr(old_ring, name)), name


def test_pipe_store_draft_rejects_bad_operands():
    g = torch.Generator().manual_seed(0)
    ring = _ring(g, 3, 8, torch.float32)
    slots = torch.tensor([1, 2], device=DEVICE)
    lane = torch.zeros(2, dtype=torch.long, device=DEVICE)
    due = torch.ones(2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="due must be a contiguous torch.bool"):
        TritonSlotOps().pipe_store_draft(ring, slots, lane, due.long(), lane, lane)
    with pytest.raises(ValueError, match="index must have one entry per slot"):
        TritonSlotOps().pipe_store_draft(ring, slots, lane, due, lane[:1], lane)


@triton.jit
def _draws_kernel(slot_ptr, index_ptr, out_ptr, n, seed, bound, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    ok = _replay_agrees(tl.load(slot_ptr + i, mask=mask, other=0), tl.load(index_ptr + i, mask=mask, other=0),
                        seed, bound)
    tl.store(out_ptr + i, ok.to(tl.int8), mask=mask)


@pytest.mark.parametrize("p, seed", [(0.0, 3), (0.3, 3), (0.89, 3), (1.0, 3), (0.5, 987_654)])
def test_kernel_replay_draw_is_the_replays(p, seed):
    """``pipe_accept``'s in-kernel draw (``_replay_agrees``) equals ``AcceptanceReplay``'s for every (slot, index)
    of a grid, the integer bound standing exactly for ``uniform < p``."""
    replay = AcceptanceReplay([p], seed=seed)  # (987,654: a seed whose products pass 32 bits)
    slot, index = torch.meshgrid(torch.arange(40), torch.arange(0, 5000, 7), indexing="ij")
    slot, index = slot.flatten().to(DEVICE), index.flatten().to(DEVICE)
    out = torch.empty(slot.shape[0], dtype=torch.int8, device=DEVICE)
    _draws_kernel[(triton.cdiv(slot.shape[0], 1024),)](slot, index, out, slot.shape[0], replay.seed,
                                                       replay.threshold(), BLOCK=1024)
    want = replay.uniform(slot, index) < p
    assert torch.equal(out.bool(), want)
    assert want.float().mean().item() == pytest.approx(p, abs=0.02)


@triton.jit
def _changes_kernel(slot_ptr, index_ptr, loop_ptr, out_ptr, n, depth, seed, bounds_ptr, BLOCK: tl.constexpr,
                    MAX_LOOPS: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    changed = _replay_changed(tl.load(slot_ptr + i, mask=mask, other=0), tl.load(index_ptr + i, mask=mask, other=0),
                              tl.load(loop_ptr + i, mask=mask, other=0), depth, seed, bounds_ptr, mask, MAX_LOOPS)
    tl.store(out_ptr + i, changed.to(tl.int8), mask=mask)


def test_kernel_replay_changes_are_the_replays():
    """The in-kernel draw of a re-drafting lane's change (``_replay_changed``) equals
    ``AcceptanceReplay.changed`` for every (slot, index, loop), each loop at its own probability (the last
    entry for deeper loops, none at or before the draft loop), independent of the exit draw."""
    replay = AcceptanceReplay([0.5], seed=11, loop_changes=[0.1, 0.4, 0.8])
    slot, index, loop = torch.meshgrid(torch.arange(30), torch.arange(0, 1500, 7), torch.arange(8), indexing="ij")
    slot, index, loop = (t.flatten().to(DEVICE) for t in (slot, index, loop))
    out = torch.empty(slot.shape[0], dtype=torch.int8, device=DEVICE)
    _changes_kernel[(triton.cdiv(slot.shape[0], 1024),)](slot, index, loop, out, slot.shape[0], 1, replay.seed,
                                                         replay.change_bounds(DEVICE), BLOCK=1024,
                                                         MAX_LOOPS=replay.MAX_LOOPS)
    want = replay.changed(slot, index, loop, 1)
    assert torch.equal(out.bool(), want)
    rates = [want[loop == lp].float().mean().item() for lp in range(8)]
    assert rates[:2] == [0.0, 0.0]  # (draft loop 1: nothing to change at loops 0 and 1)
    assert rates[2:] == pytest.approx([0.1, 0.4, 0.8, 0.8, 0.8, 0.8], abs=0.03), rates
    exit_draw = replay.uniform(slot, index) < 0.5
    both = (want & exit_draw)[loop == 3].float().mean().item()
    assert both == pytest.approx(0.4 * 0.5, abs=0.03)  # (salted: not the verdict's draw)


@pytest.mark.parametrize("lanes", [1, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipe_rows_and_finish_match_reference(lanes, dtype):
    """The depth pipeline's lane rows inside the step's graph: entries of empty lanes 0, each lane's attention
    inputs and loop input (``pipe_rows``), then each live lane's exit rule and state store (``pipe_finish``),
    including the scratch slot's padding rows, which change nothing."""
    from loopline.worker.decode_state import RowsInto

    g = torch.Generator().manual_seed(lanes * 7 + (dtype == torch.bfloat16))
    hidden = 40 if dtype == torch.float32 else 1100  # 1100: more than one column block
    ds, ring = _state(g, "last_exited", False), _ring(g, lanes, hidden, dtype)
    ds.pos.copy_(torch.randint(0, MAX_BLOCKS * BLOCK - lanes, (SLOTS,), generator=g))  # every lane's position fits
    scratch = SLOTS - 1
    m = 7
    real = torch.randperm(SLOTS - 1, generator=g)[:m]
    slots = torch.cat([real.repeat_interleave(lanes), torch.full((2 * lanes,), scratch)]).to(DEVICE)
    lane = torch.arange(lanes).repeat(m + 2).to(DEVICE)
    n = slots.shape[0]
    embed = torch.randn((50, hidden), generator=g).to(DEVICE, dtype)
    ring.token.clamp_(max=49)
    ds.token.copy_(torch.randint(0, 50, (SLOTS,), generator=g))

    def buffers():
        return (RowsInto(torch.full((n,), -5, dtype=torch.long, device=DEVICE),
                         torch.full((n,), -5, dtype=torch.long, device=DEVICE),
                         torch.full((n,), -5, dtype=torch.int32, device=DEVICE),
                         torch.full((n, MAX_BLOCKS - 2), -5, dtype=torch.int32, device=DEVICE)),
                torch.zeros((n, hidden), dtype=dtype, device=DEVICE))

    ref_ds, ref_ring = _clone(ds), _ring(torch.Generator(), lanes, hidden, dtype)
    for name, t in _ring_fields(ring).items():
        getattr(ref_ring, name).copy_(t)
    (into, x), (ref_into, ref_x) = buffers(), buffers()
    got = TritonSlotOps().pipe_rows(ring, ds, slots, lane, LOOPS, scratch, embed, into, x)
    want = SlotOps().pipe_rows(ref_ring, ref_ds, slots, lane, LOOPS, scratch, embed, ref_into, ref_x)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(into, ref_into):
        assert torch.equal(a, b)
    assert torch.equal(x, ref_x)
    _same_state(ds, ref_ds)
    for name, t in _ring_fields(ring).items():
        assert torch.equal(t, getattr(ref_ring, name)), name
    assert want.live.any() and not want.live.all() and (want.loop == 1).any() and (want.loop > 1).any()

    h = torch.randn((n, hidden), generator=g).to(DEVICE, dtype)
    gate = torch.randn(n, generator=g).to(DEVICE) * 3
    min_loops = torch.randint(1, 3, (n,), generator=g).to(DEVICE)
    max_loops = torch.randint(2, LOOPS + 1, (n,), generator=g).to(DEVICE)
    threshold = torch.rand(n, generator=g).to(DEVICE)
    ex = TritonSlotOps().pipe_finish(ring, h, gate, slots, lane, got, min_loops, max_loops, threshold)
    ex_ref = SlotOps().pipe_finish(ref_ring, h, gate, slots, lane, want, min_loops, max_loops, threshold)
    assert torch.equal(ex, ex_ref) and ex_ref.any() and not ex_ref.all()
    for name, t in _ring_fields(ring).items():
        if name == "survival":  # the kernel's sigmoid is not torch's
            torch.testing.assert_close(t, ref_ring.survival, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(t, getattr(ref_ring, name)), name
