"""The step-input builder: one layout per step shape over persistent buffers, rows by kind, the host
range it sends, the graph lookup over its shapes, and decode rows derived straight into its views.

The end-to-end check (graph path == eager path, step for step) is tests/worker/test_cuda_graphs_logic.py.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from triton_testing import DEVICE

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.kv.layout import make_layout
from loopline.worker.decode_state import DeviceDecodeState, RowsInto, SlotOps
from loopline.worker.step_inputs import StepShape


def engine_for(tiny, **kw):
    return LLMEngine(EngineArgs(model=str(tiny.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, **kw))


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def test_a_mixed_step_sends_the_prefill_rows_and_never_the_decode_rows_tables(tiny_gqa):
    runner = engine_for(tiny_gqa).runner
    builder = runner.builder
    scratch_block = runner.scratch_block  # padding rows' pages: the one block the scheduler never hands out
    shape = StepShape(((4, 4), (3, 16)), width=8, work=3 + 16 // 64, max_query_len=16, max_seq_len=32)
    lay = builder.layout(shape)
    tables = lay.fields["block_tables"]
    # the decode rows' tables are derived on the device: the host range starts at the first prefill row's
    assert lay.host_start == tables.offset + 4 * 8 * 4
    v = lay.host_views(lay.padding)
    assert v["block_tables"].shape == (3, 8) and (v["block_tables"] == scratch_block).all()
    # padding: decode rows one query each, prefill padding rows none (their tokens belong to no row)
    assert v["query_start_loc"].tolist() == [0, 1, 2, 3, 4, 4, 4, 4]
    assert (v["slot_mapping"][4:] == scratch_block * runner.block_size).all() and (v["seq_lens"][4:] == 1).all()
    assert v[0, "slots"].tolist() == [runner.scratch_slot] * 4
    assert (v["work_tiles"] == -1).all()


def test_decode_only_and_prefill_only_layouts(tiny_gqa):
    builder = engine_for(tiny_gqa).runner.builder
    decode = builder.layout(StepShape(((3, 3), (0, 0)), 8, 0, 1, 32))
    assert decode.host_start == decode.fields["query_start_loc"].offset  # offsets + the rows' four arrays
    assert set(decode.host_views(decode.padding)) >= {(0, "slots"), (0, "min_loops"), (0, "max_loops"),
                                                      (0, "threshold")}
    prefill = builder.layout(StepShape(((0, 0), (2, 9)), 8, 0, 7, 32))
    assert prefill.host_start == 0  # nothing derived on the device: every byte comes from the host


def test_an_eager_step_reads_views_of_the_same_buffers_every_step(tiny_gqa):
    """The builder's buffers are reused, not reallocated, once they hold the largest step."""
    engine = engine_for(tiny_gqa)
    runner = engine.runner
    seen = []
    forward = runner.forward

    def spy(inp):
        seen.append((inp.buffer.data_ptr(), runner.builder.buffers[1].data_ptr(), inp.shape.counts))
        base, x = runner.builder.buffers
        assert inp.buffer.data_ptr() == base.data_ptr()
        assert x.data_ptr() <= inp.x.data_ptr() < x.data_ptr() + x.numel() * x.element_size()
        return forward(inp)

    runner.forward = spy
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 13, 3)):
        engine.add_request(f"r{i}", ids(n, seed=n), params)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(seen) > 30
    assert {counts[1][0] > 0 for _, _, counts in seen} == {True, False}  # steps with and without prefill rows
    buffers = {(b, x) for b, x, _ in seen[len(seen) // 3:]}
    assert len(buffers) == 1  # after the first steps grew them, every step reuses the same two buffers


@pytest.mark.parametrize("ops", ["torch", "triton"])
@pytest.mark.parametrize("no_refill", [False, True])
def test_decode_rows_written_into_narrower_buffer_views(ops, no_refill):
    """``decode_rows(into=...)`` writes the rows' attention inputs into the step's views (the table cut to
    the step's width), the same values it returns as fresh tensors."""
    if ops == "triton":
        from loopline.worker.triton_slot_ops import TritonSlotOps

        slot_ops = TritonSlotOps()
    else:
        slot_ops = SlotOps()
    g = torch.Generator().manual_seed(7)
    ds = DeviceDecodeState(12, make_layout("last_exited", 4), 4, 9, scratch_block=50, device=DEVICE)
    ds.loop.copy_(torch.randint(0, 4, (12,), generator=g))
    ds.loop[:4] = 0
    ds.pos.copy_(torch.randint(0, 20, (12,), generator=g))
    ds.tables.copy_(torch.randint(0, 50, ds.tables.shape, generator=g, dtype=torch.int32))
    slots = torch.tensor([3, 0, 7, 5, 1], device=DEVICE)
    rules = (torch.ones(5, dtype=torch.long, device=DEVICE), torch.full((5,), 4, device=DEVICE),
             torch.ones(5, device=DEVICE))
    fresh = slot_ops.decode_rows(ds, slots, *rules, no_refill, False, 11)
    buf = torch.full((8, 6), -7, dtype=torch.int32, device=DEVICE)  # 6 of the state's 9 columns
    into = RowsInto(torch.empty(5, dtype=torch.long, device=DEVICE), torch.empty(5, dtype=torch.long, device=DEVICE),
                    torch.empty(5, dtype=torch.int32, device=DEVICE), buf[1:6])
    got = slot_ops.decode_rows(ds, slots, *rules, no_refill, False, 11, into=into)
    assert got.block_tables.data_ptr() == buf[1:6].data_ptr() and got.positions is into.positions
    for name in ("positions", "slot_mapping", "seq_lens"):
        assert torch.equal(getattr(got, name), getattr(fresh, name)), name
    assert torch.equal(buf[1:6], fresh.block_tables[:, :6])
    assert (buf[0] == -7).all() and (buf[6:] == -7).all()  # nothing outside the view
    assert torch.equal(got.loops, fresh.loops) and torch.equal(got.run, fresh.run)
    x = torch.zeros(7, 3, device=DEVICE)
    embed, hidden = torch.randn(30, 3, generator=g).to(DEVICE), torch.randn(12, 3, generator=g).to(DEVICE)
    ds.token.copy_(torch.randint(0, 30, (12,), generator=g))
    rows = slot_ops.decode_rows(ds, slots, *rules, no_refill, False, 11)
    out = slot_ops.decode_inputs(rows.dec, embed, hidden, out=x[2:7])
    assert out.data_ptr() == x[2:7].data_ptr() and (x[:2] == 0).all()
    assert torch.equal(x[2:7], slot_ops.decode_inputs(rows.dec, embed, hidden))
    assert np.asarray(rows.dec.starts.cpu()).any()  # both sources of the loop input occur
