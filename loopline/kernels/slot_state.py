"""The per-slot decode state's advance after a step, as one kernel (async scheduling).

:meth:`loopline.worker.decode_state.DeviceDecodeState.advance` updates four
per-slot tensors from a step's exits. Written with torch indexing that is
about fifteen gathers, ``where``s and scatters of a few elements each, which
at one decode row cost more device time than the exit rule itself; this
kernel does it in one launch. Rows are distinct slots, so programs never
write the same element.
"""
from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernel is unusable without triton
    triton = None

_BLOCK = 128


if triton is not None:

    @triton.jit
    def _advance_kernel(
        loop_ptr, token_ptr, pos_ptr, tidx_ptr,  # per-slot state [S] int64, updated in place
        slots_ptr, loops_ptr, run_ptr, exited_ptr, sampled_ptr,  # per row [B]: int64, int64, bool, bool, int64
        n_rows, BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = rows < n_rows
        slot = tl.load(slots_ptr + rows, mask=m, other=0)
        run = tl.load(run_ptr + rows, mask=m, other=0) != 0
        ex = (tl.load(exited_ptr + rows, mask=m, other=0) != 0) & run
        # A row that runs and exits restarts its slot at loop 0, one that runs on takes the loop it
        # just ran; a waiting row (run False) changes nothing.
        loops = tl.where(ex, 0, tl.load(loops_ptr + rows, mask=m, other=0))
        tl.store(loop_ptr + slot, loops, mask=m & run)
        tl.store(token_ptr + slot, tl.load(sampled_ptr + rows, mask=m & ex, other=0), mask=m & ex)
        tl.store(pos_ptr + slot, tl.load(pos_ptr + slot, mask=m & ex, other=0) + 1, mask=m & ex)
        tl.store(tidx_ptr + slot, tl.load(tidx_ptr + slot, mask=m & ex, other=0) + 1, mask=m & ex)


def available() -> bool:
    """Whether :func:`advance_slots` can run (triton is installed; CUDA, or the CPU interpreter)."""
    return triton is not None


def advance_slots(loop: Tensor, token: Tensor, pos: Tensor, token_index: Tensor, slots: Tensor, loops: Tensor,
                  run: Tensor, exited: Tensor, sampled: Tensor) -> None:
    """In place, for every row ``i`` that runs (``run[i]``), at ``s = slots[i]``: where the row's token
    exited, ``loop[s] = 0``, ``token[s] = sampled[i]`` and ``pos[s]``, ``token_index[s]`` move on by
    one; otherwise ``loop[s] = loops[i]``. Slots must be distinct; every tensor on one device."""
    n = slots.shape[0]
    if n == 0:
        return
    for name, t, dtype in (("loop", loop, torch.int64), ("token", token, torch.int64), ("pos", pos, torch.int64),
                           ("token_index", token_index, torch.int64), ("slots", slots, torch.int64),
                           ("loops", loops, torch.int64), ("run", run, torch.bool), ("exited", exited, torch.bool),
                           ("sampled", sampled, torch.int64)):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"advance_slots: {name} must be a contiguous {dtype} tensor, got {t.dtype}")
    for name, t in (("loops", loops), ("run", run), ("exited", exited), ("sampled", sampled)):
        if t.shape != (n,):
            raise ValueError(f"advance_slots: {name} must have one entry per row ({n}), got {tuple(t.shape)}")
    _advance_kernel[(triton.cdiv(n, _BLOCK),)](
        loop, token, pos, token_index, slots, loops, run.view(torch.int8), exited.view(torch.int8), sampled, n,
        BLOCK=_BLOCK, num_warps=4)


__all__ = ["advance_slots", "available"]
