"""The device decode state's step ops on hand-made state: refill and no_refill on the device.

The scheduler names a decode row's slot only; these ops decide what the row runs
(``SlotOps`` is the torch reference; ``TritonSlotOps`` is tested against it in
tests/kernels/test_slot_state.py).
"""
from __future__ import annotations

import pytest
import torch

from loopline.kv.layout import make_layout
from loopline.worker.decode_state import DeviceDecodeState, SlotOps

R, BLOCK, SCRATCH_BLOCK, SCRATCH_SLOT = 4, 4, 99, 3


def state(loops, positions, tokens):
    ds = DeviceDecodeState(4, make_layout("last_exited", R), BLOCK, 8, SCRATCH_BLOCK, torch.device("cpu"))
    for slot, (loop, pos, tok) in enumerate(zip(loops, positions, tokens)):
        ds.loop[slot], ds.pos[slot], ds.token[slot], ds.token_index[slot] = loop, pos, tok, pos - 5
        ds.set_tables(slot, [[10 * slot + p * 4 + b for b in range(4)] for p in range(R)])
    return ds


def rows(ds, no_refill, n=3):
    slots = torch.arange(n)
    ones = torch.ones(n, dtype=torch.long)
    return SlotOps().decode_rows(ds, slots, ones, ones * R, torch.ones(n), no_refill, False, SCRATCH_SLOT)


def test_refill_every_slot_runs_its_next_loop():
    ds = state(loops=[0, 2, 3], positions=[6, 9, 13], tokens=[7, 8, 9])
    r = rows(ds, no_refill=False)
    assert r.run.tolist() == [True, True, True] and r.loops.tolist() == [1, 3, 4]
    assert r.dec.starts.tolist() == [True, False, False] and r.dec.input_ids.tolist() == [7, 8, 9]
    assert r.positions.tolist() == [6, 9, 13] and r.seq_lens.tolist() == [7, 10, 14]
    # the K/V slot of the row's plane: block of position // 4 in that plane's table, offset position % 4
    planes = [0, 2, 3]
    want = [(10 * s + p * 4 + pos // BLOCK) * BLOCK + pos % BLOCK for s, p, pos in zip(range(3), planes, [6, 9, 13])]
    assert r.slot_mapping.tolist() == want


def test_no_refill_exited_slots_wait_for_the_cohort_on_scratch():
    ds = state(loops=[0, 2, 0], positions=[6, 9, 13], tokens=[7, 8, 9])
    r = rows(ds, no_refill=True)
    assert r.run.tolist() == [False, True, False]  # slot 1 is still looping: the exited ones idle
    assert r.dec.slots.tolist() == [SCRATCH_SLOT, 1, SCRATCH_SLOT]
    assert (r.dec.plane_slots[[0, 2]] == SCRATCH_BLOCK * BLOCK).all()
    ds.loop[1] = 0  # the cohort's last token exited: everyone starts the next token together
    r = rows(ds, no_refill=True)
    assert r.run.tolist() == [True, True, True] and r.loops.tolist() == [1, 1, 1]


def test_advance_refills_exited_slots_and_leaves_idle_ones_alone():
    ds = state(loops=[0, 2, 0], positions=[6, 9, 13], tokens=[7, 8, 9])
    r = rows(ds, no_refill=True)
    exited = torch.tensor([True, True, True])  # an idle row's flag is ignored: it did not run
    record = torch.empty(3, 3, dtype=torch.long)
    ds.advance(torch.arange(3), r.loops, r.run, exited, torch.tensor([40, 41, 42]), record)
    assert ds.loop[:3].tolist() == [0, 0, 0]
    assert ds.token[:3].tolist() == [7, 41, 9] and ds.pos[:3].tolist() == [6, 10, 13]
    assert ds.token_index[:3].tolist() == [1, 5, 8]
    assert record.tolist() == [[0, 1, 0], [1, 3, 1], [40, 41, 42]]  # (exited & ran, loop, token) for the host
    r = rows(ds, no_refill=False)
    ds.advance(torch.arange(3), r.loops, r.run, torch.tensor([False, True, False]), torch.tensor([50, 51, 52]))
    assert ds.loop[:3].tolist() == [1, 0, 1] and ds.pos[:3].tolist() == [6, 11, 13]


def test_start_sets_the_first_token_of_each_slot():
    ds = state(loops=[2, 3, 1], positions=[6, 9, 13], tokens=[7, 8, 9])
    ds.start(torch.tensor([0, 2]), torch.tensor([50, 52]), torch.tensor([20, 30]))
    assert ds.loop[:3].tolist() == [0, 3, 0] and ds.token[:3].tolist() == [50, 8, 52]
    assert ds.pos[:3].tolist() == [20, 9, 30] and ds.token_index[:3].tolist() == [1, 4, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_starting_and_tracking_slots_never_waits_for_the_device():
    """A prompt that finishes starts its slot while the next step is in flight: a host sync there makes
    every such step wait for the whole queue (it did: ~8 ms per finished prompt on an H200)."""
    dev = torch.device("cuda")
    ds = DeviceDecodeState(4, make_layout("last_exited", R), BLOCK, 8, SCRATCH_BLOCK, dev)
    slots, tokens, ends = (torch.tensor(v, device=dev) for v in ([0, 2], [50, 52], [20, 30]))
    prompt = torch.tensor([3, 5, 7], device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ds.track_penalties(1, prompt, 64)
        ds.start(slots, tokens, ends)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ds.token[[0, 2]].tolist() == [50, 52] and ds.token_index[[0, 2]].tolist() == [1, 1]
    assert ds.seen[1].nonzero().flatten().tolist() == [3, 5, 7] and ds.counts[[0, 2], [50, 52]].tolist() == [1, 1]
