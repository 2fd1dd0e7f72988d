"""The one forward of a step, for eager execution and CUDA-graph capture alike.

``StepForward(inputs)`` reads only the step's input views (``step_inputs.py``):
each row kind derives what it derives on the device (decode rows from the slot
state, with the prelude), one traversal of the shared stack + final norm + gate
runs over every row with the attention metadata built from the same views, and
each kind finishes its rows (decode: exit rule, slot state, exit copy, coda).
The runner calls it eagerly on a step's exact-size views; the graph module
captures it once per bucket on that bucket's views and replays it. Its outputs
are a flat tuple of tensors (each kind's ``num_outputs`` in turn), which a graph
can hand back as its captured outputs.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from loopline.attention import AttentionBackend
from loopline.attention.paged import PagedAttention
from loopline.kv.quant import KVScales
from loopline.models.ouro import OuroForCausalLM
from loopline.worker.row_kinds import RowKind
from loopline.worker.step_inputs import StepInputs


class StepForward:
    """``model.loop`` between the row kinds' ``prepare`` and ``finish``. ``kv()`` returns the current
    ``(k_cache, v_cache)`` (sleep re-allocates the pool; graphs are recaptured then)."""

    def __init__(self, model: OuroForCausalLM, backend: AttentionBackend, kv: Callable[[], tuple[Tensor, Tensor]],
                 kinds: Sequence[RowKind], kv_scales: KVScales | None = None, stack: Any = None) -> None:
        """``stack``: the family's loop over the step's rows (``loop_stack.py``; default ``model.loop``)."""
        self.model, self.backend, self.kv, self.kinds = model, backend, kv, tuple(kinds)
        self.stack = stack if stack is not None else (lambda inp, attn: model.loop(inp.x, inp.positions, attn))
        self.kv_scales = kv_scales  # an FP8 pool's (loopline.kv.quant); fixed for the engine's life
        self.scale = 1.0 / math.sqrt(model.config.head_dim)

    def __call__(self, inp: StepInputs) -> tuple[Tensor | None, ...]:
        prepared = [kind.prepare(inp, seg, own) for kind, seg, own in zip(self.kinds, inp.segments, inp.fields)]
        k_cache, v_cache = self.kv()
        scales = self.kv_scales
        attn = PagedAttention(self.backend, k_cache, v_cache, inp.metadata(), self.scale,
                              k_scale=scales.k if scales else None, v_scale=scales.v if scales else None)
        h, gate = self.stack(inp, attn)
        out: list[Tensor | None] = []
        for kind, seg, own, p in zip(self.kinds, inp.segments, inp.fields, prepared):
            lo, hi = seg.tok0, seg.tok0 + seg.tokens
            out += kind.finish(h[lo:hi], gate[lo:hi], p, own)
        return tuple(out)
