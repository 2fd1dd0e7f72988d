"""The decode state's advance kernel vs its torch reference (CPU under TRITON_INTERPRET=1, GPU when present)."""
from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE

from loopline.kernels.slot_state import advance_slots
from loopline.worker.decode_state import advance_reference


def _state(g: torch.Generator, slots: int) -> list[torch.Tensor]:
    return [torch.randint(0, 1000, (slots,), generator=g).to(DEVICE) for _ in range(4)]


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300: more than one program
def test_advance_matches_reference(rows):
    g = torch.Generator().manual_seed(rows)
    num_slots = 512
    slots = torch.randperm(num_slots, generator=g)[:rows].to(DEVICE)  # distinct, unordered
    loops = torch.randint(1, 5, (rows,), generator=g).to(DEVICE)
    run = (torch.rand(rows, generator=g) < 0.8).to(DEVICE)
    exited = (torch.rand(rows, generator=g) < 0.5).to(DEVICE)
    sampled = torch.randint(0, 50000, (rows,), generator=g).to(DEVICE)
    state = _state(g, num_slots)
    before = [t.clone() for t in state]
    ref = [t.clone() for t in state]
    advance_reference(*ref, slots, loops, run, exited, sampled)
    advance_slots(*state, slots, loops, run, exited, sampled)
    for name, a, b in zip(("loop", "token", "pos", "token_index"), state, ref):
        assert torch.equal(a, b), name
    # the test can fail: the reference changed something, and a slot outside the rows is untouched
    assert any(not torch.equal(a, b) for a, b in zip(before, ref))
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert all(torch.equal(a[untouched], b[untouched]) for a, b in zip(state, before))


def test_advance_rejects_bad_operands():
    t = torch.zeros(4, dtype=torch.long, device=DEVICE)
    flags = torch.zeros(2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="run must be a contiguous torch.bool"):
        advance_slots(t, t, t, t, t[:2], t[:2], t[:2], flags, t[:2])
    with pytest.raises(ValueError, match="loops must have one entry per row"):
        advance_slots(t, t, t, t, t[:2], t[:3], flags, flags, t[:2])
