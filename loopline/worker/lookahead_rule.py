"""The lookahead exit rule on the device (``exit_mode="lookahead"``, docs/lookahead.md).

After loop ``n`` of a token (``n = 0``: its embedding, decided in the step that runs loop 1) the head
reads the features :func:`loopline.train.lookahead.features` defines -- the gate logit, ``F_n``, the
loop's hidden state through the head's fixed projection, its change from the loop's input, the position
feature and the one-hot loop -- and a probability at or above the row's threshold fixes the token's exit
at loop ``n + 2``. A decision counts only where ``min_loops <= n + 2 < max_loops`` (at ``max_loops`` the
token exits anyway, so a later decision changes nothing), only the first one counts, and the head is
never asked about loops it was not trained for (``n > loops - 3``). A token whose exit was never fixed
runs ``max_loops`` loops. Its rows carry threshold 1.0, so the stock rule exits them only at
``max_loops``; the fixed exit is one comparison with the slot's target.

Every op is a tensor op over all the step's decode rows (rows of other policies carry a threshold no
probability reaches), so the rule adds no host sync and captures into the step's CUDA graphs. The
projection of a loop's input (``before``) is the previous loop's projection the change needs: decode
rows' inputs are their slot's hidden state or, at loop 1, the embedding, so nothing more is kept per
slot than the fixed target (``DeviceDecodeState.exit_target``, saved with a preempted slot).

The predictor is any callable ``(LookaheadInputs, PredictorContext) -> probabilities [2B]``:
:class:`HeadPredictor` for a trained head; :class:`ReplayPredictor` replays given depths (benchmarks on
random weights, tools/lookahead_h200.py); tests install oracles that key on the context. A predictor
with a ``start_slot(slot, params)`` method hears of each request as it takes a decode slot.

The head's feature standardisation and the fixed projection are linear, so :class:`HeadPredictor` folds
them into its first layer: a hidden state is multiplied once by ``[H, 2 * hidden]`` (the first layer's
columns for the projected state and for its change, through the projection), the scalar features are
one small product and the one-hot loop is a row of per-loop biases. The rule runs a dozen ops instead of
the ~30 that building the feature vector takes, with the same result to fp32 rounding
(:func:`feature_matrix` builds the unfolded features; tests compare both).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from loopline.models.lookahead_head import (
    DISTANCE,
    HeadConfig,
    LookaheadHead,
    projection,
)
from loopline.worker.decode_state import DecodeRows, DeviceDecodeState
from loopline.worker.exit_rule import exit_decision
from loopline.worker.request_state import RequestState
from loopline.worker.staging import concat, stage

NEVER = 2.0  # the head threshold of rows of other policies: no probability reaches it


class PredictorContext(NamedTuple):
    """Which token each decision row is about (what an oracle keys on; a trained head ignores it)."""

    loop: Tensor  # [M] int64, the loop n the features describe (0: the embedding)
    slots: Tensor  # [M] int64, the row's decode slot
    token_index: Tensor  # [M] int64, the token's index in the completion (prompt positions: <= 0, the last 0)


class LookaheadInputs(NamedTuple):
    """What the rule knows of ``B`` rows after loop ``loop``: the predictor decides for each row twice, about
    loop 0 (its embedding: ``prev``) and about ``loop``, and returns ``[2B]`` probabilities in that order."""

    loop: Tensor  # [B] int64, >= 1
    gate: Tensor  # [B] fp32, the loop's gate logit
    cdf: Tensor  # [B] fp32, the cumulative exit probability F after the loop
    h: Tensor  # [B, K] fp32, the loop's output through the predictor's ``proj``
    prev: Tensor  # [B, K] fp32, the loop's input through ``proj``
    pos: Tensor  # [B] fp32, log1p(position) / log1p(max_position)


def feature_matrix(x: LookaheadInputs, loops: int) -> Tensor:
    """``[2B, F]``: the trainer's feature vectors (loop 0's rows, then loop ``x.loop``'s) from inputs
    projected by the plain seeded projection (``loopline.models.lookahead_head.projection``)."""
    b = x.gate.shape[0]
    onehot = torch.eye(loops, device=x.gate.device)
    pos, zero = x.pos[:, None], torch.zeros_like(x.pos[:, None])
    f0 = torch.cat([zero, zero, x.prev, torch.zeros_like(x.prev), pos, onehot[0].expand(b, -1)], 1)
    fn = torch.cat([x.gate[:, None], x.cdf[:, None], x.h, x.h - x.prev, pos, onehot[x.loop.clamp(max=loops - 1)]], 1)
    return torch.cat([f0, fn])


class HeadPredictor:
    """A trained :class:`LookaheadHead` with its standardisation and projection folded into the first layer
    (fp32, on the device). ``proj`` ``[H, 2 * hidden]``: the first layer's weights for the projected state
    and for its change, through the seeded projection; the rule multiplies hidden states by it."""

    def __init__(self, head: LookaheadHead, config: HeadConfig, hidden_size: int, device: torch.device) -> None:
        k, loops = config.trace_spec.proj_dim, config.loops
        first, second = head.net[0], head.net[2]
        w = (first.weight / head.std).double()  # [hidden, F]: (x - mean) / std folded in
        b = first.bias.double() - w @ head.mean.double()
        p = projection(hidden_size, config.trace_spec).double()  # [H, K]
        on_state, on_change = w[:, 2:2 + k], w[:, 2 + k:2 + 2 * k]
        self.width = first.out_features
        f32 = {"device": device, "dtype": torch.float32}
        self.proj = (p @ torch.cat([on_state, on_change]).T).to(**f32)
        self.scalars = w[:, [0, 1, 2 + 2 * k]].T.to(**f32)  # [3, hidden]: gate, F, position
        self.loop_bias = (w[:, 3 + 2 * k:].T + b).to(**f32)  # [loops, hidden]: one-hot loop + bias
        self.out_w, self.out_b = second.weight.detach().T.to(**f32), second.bias.detach().to(**f32)
        self.loops = loops

    def weights(self) -> Any:
        """The folded layers as the fused rule reads them (``loopline.kernels.lookahead.HeadWeights``)."""
        # NOTE: lazily, as the other Triton kernels
        from loopline.kernels.lookahead import HeadWeights

        return HeadWeights(*(t.contiguous() for t in (self.scalars, self.loop_bias, self.out_w, self.out_b)))

    def __call__(self, x: LookaheadInputs, ctx: PredictorContext) -> Tensor:
        w = self.width
        h_state, h_change = x.h[:, :w], x.h[:, w:]
        p_state, p_change = x.prev[:, :w], x.prev[:, w:]
        scalars = torch.stack([x.gate, x.cdf, x.pos], 1)
        at_n = torch.addmm(self.loop_bias[x.loop.clamp(max=self.loops - 1)], scalars, self.scalars)
        at_n = at_n + h_state + h_change - p_change
        at_0 = torch.addmm(self.loop_bias[0], x.pos[:, None], self.scalars[2:])
        at_0 = at_0 + p_state  # (loop 0: no gate, F 0, no change)
        hidden = torch.nn.functional.gelu(torch.cat([at_0, at_n]))
        return torch.sigmoid(torch.addmm(self.out_b, hidden, self.out_w).squeeze(-1))


class ReplayPredictor:
    """Replays each request's ``SamplingParams.exit_depths`` as the head's decisions: probability 1 after loop
    ``n`` where the token's recorded depth is ``n + 2``, else 0 (past the end of a trace its last depth
    repeats, as under ``exit_mode="trace"``). What a benchmark on random weights installs, labelled as a
    replayed exit pattern: the rule, its targets and the engine's use of them run as with a head. Keyed by
    slot, filled when a request takes one (a request resumed into another slot after preemption is not
    followed). ``cost_of``: a predictor run alongside and ignored (its output times 0), so a step costs what
    it costs with that head."""

    def __init__(self, num_slots: int, max_tokens: int, device: torch.device,
                 cost_of: Callable[[LookaheadInputs, PredictorContext], Tensor] | None = None) -> None:
        self.cost_of = cost_of
        self.depths = torch.zeros(num_slots, max_tokens, dtype=torch.long, device=device)
        self.last = torch.zeros(num_slots, dtype=torch.long, device=device)  # each slot's last trace index

    def start_slot(self, slot: int, params: Any) -> None:
        depths = list(params.exit_depths or [0])[:self.depths.shape[1]]
        row = np.zeros(self.depths.shape[1], dtype=np.int64)
        row[:len(depths)] = depths
        # staged (pinned, asynchronous): a copy from pageable memory would wait for the device at each admission
        self.depths[slot] = stage(self.depths.device, row)[0]
        self.last[slot] = len(depths) - 1

    def __call__(self, x: LookaheadInputs, ctx: PredictorContext) -> Tensor:
        index = torch.minimum(ctx.token_index.clamp(min=0), self.last[ctx.slots])
        want = self.depths[ctx.slots, index]
        prob = ((want == ctx.loop + DISTANCE) & (ctx.token_index >= 0)).float()
        return prob if self.cost_of is None else prob + 0.0 * self.cost_of(x, ctx)


class LookaheadRule:
    """The head, its projection and the per-slot fixed exits, for the decode kind and the runner's prefill
    booking."""

    def __init__(self, head: LookaheadHead, config: HeadConfig, hidden_size: int, state: DeviceDecodeState,
                 device: torch.device) -> None:
        head_predictor = HeadPredictor(head, config, hidden_size, device)
        self.proj = head_predictor.proj  # [H, 2 * hidden] fp32, fixed at capture (a predictor swapped in reads the same)
        self.predictor = head_predictor
        self.loops, self.state = config.loops, state
        self.log_max_position = math.log1p(config.trace_spec.max_position)
        state.allocate_exit_target()
        self._prev: Tensor | None = None  # the decode rows' input projection, from before() to decode()

    @property
    def predictor(self) -> Callable[[LookaheadInputs, PredictorContext], Tensor]:
        """What decides (a trained head, a replay, a test's oracle); installing one re-derives the fused rule."""
        return self._predictor

    @predictor.setter
    def predictor(self, predictor: Callable[[LookaheadInputs, PredictorContext], Tensor]) -> None:
        self._predictor = predictor
        self._kernel = self._fused(self.proj.device)  # (head weights, replay) for the fused rule; False: torch ops

    def _fused(self, device: torch.device) -> tuple | bool:
        """The fused rule's arguments where it applies: on CUDA, for a :class:`HeadPredictor`, or a
        :class:`ReplayPredictor` paying one's cost; ``False`` elsewhere (other predictors run as torch ops)."""
        p = self._predictor
        if device.type != "cuda":
            return False
        from loopline.kernels import lookahead as kernels

        if not kernels.available():
            return False
        if isinstance(p, HeadPredictor):
            return p.weights(), None
        if isinstance(p, ReplayPredictor) and isinstance(p.cost_of, HeadPredictor):
            return p.cost_of.weights(), kernels.Replay(p.depths, p.last)
        return False

    def start_slot(self, slot: int, params: Any) -> None:
        """A request takes decode ``slot``: a predictor that keys on slots (``ReplayPredictor``) learns it."""
        start = getattr(self.predictor, "start_slot", None)
        if start is not None:
            start(slot, params)

    def project(self, h: Tensor) -> Tensor:
        """``[B, H] -> [B, 2 * hidden]`` fp32: the head's view of a hidden state (``HeadPredictor.proj``)."""
        return h.float() @ self.proj

    def _fix(self, target: Tensor, n: Tensor, prob: Tensor, threshold: Tensor, min_loops: Tensor | int,
             max_loops: Tensor | int) -> Tensor:
        """``target`` with the exit at ``n + 2`` fixed where the prediction clears the threshold and the rule
        lets a decision at loop ``n`` count."""
        depth = n + DISTANCE
        ok = (target == 0) & (prob >= threshold) & (depth >= min_loops) & (depth < max_loops) & (
            n <= self.loops - DISTANCE - 1)
        return torch.where(ok, depth, target)

    def decide(self, loop: Tensor, gate: Tensor, cdf: Tensor, h_proj: Tensor, prev: Tensor, positions: Tensor,
               min_loops: Tensor | int, max_loops: Tensor | int, threshold: Tensor, target: Tensor, slots: Tensor,
               token_index: Tensor) -> Tensor:
        """The rows' targets after loop ``loop`` ``[B]`` (and after loop 0 for rows at loop 1), ``B`` rows:
        one predictor call of ``2B`` decision rows (loop 0's, then loop ``loop``'s: static shapes)."""
        if self._kernel:  # on CUDA, a trained head (or one whose cost a replay pays): one launch for all of it
            from loopline.kernels import lookahead as kernels

            head, replay = self._kernel
            return kernels.decide(head, self.loops, self.log_max_position, loop, gate, cdf, h_proj, prev, positions,
                                  min_loops, max_loops, threshold, target, slots, token_index, replay)
        b = gate.shape[0]
        pos = torch.log1p(positions.float()) / self.log_max_position
        zeros = torch.zeros_like(loop)
        ctx = PredictorContext(torch.cat([zeros, loop]), torch.cat([slots, slots]), torch.cat([token_index, token_index]))
        prob = self.predictor(LookaheadInputs(loop, gate.float(), cdf.float(), h_proj, prev, pos), ctx)
        first = torch.where(loop == 1, prob[:b], -1.0)  # (loop 0's decision is taken in the step of loop 1)
        target = self._fix(target, zeros, first, threshold, min_loops, max_loops)
        return self._fix(target, loop, prob[b:], threshold, min_loops, max_loops)

    # --- decode rows (inside the step's forward) ----------------------------------------
    def before(self, x: Tensor) -> None:
        """The decode rows' loop input ``x`` ``[B, H]`` (before the layers run): its projection."""
        self._prev = self.project(x)

    def decode(self, h: Tensor, gate: Tensor, rows: DecodeRows, threshold: Tensor, slot_survival: Tensor,
               exit: Tensor) -> tuple[Tensor, Tensor]:
        """After the stock rule (``exit``: ``max_loops`` only, for these rows): exits at the fixed loop, and
        the new decisions stored per slot. Returns the rows' exit flags and fixed exits (0: none yet; what
        the host reads back to plan the coda: worker/lookahead_plan.py)."""
        d, target_of = rows.dec, self.state.exit_target
        assert self._prev is not None and target_of is not None, "before() first"
        target = torch.where(d.loops == 1, 0, target_of[d.slots])
        exit = exit | (d.loops == target)
        cdf = 1.0 - slot_survival[d.slots]  # (exit_and_store stored this loop's survival)
        target = self.decide(d.loops, gate, cdf, self.project(h), self._prev, rows.positions, d.min_loops,
                             d.max_loops, threshold, target, d.slots, rows.token_index)
        target_of[d.slots] = torch.where(exit, 0, target)
        self._prev = None
        return exit, target

    # --- prompt chunks (the runner's booking, after the forward) ------------------------
    def prefill(self, chunks: list[PromptChunk], h: Tensor, gate: Tensor) -> Tensor:
        """The step's prompt chunks of lookahead requests after their loops, in one batch: ``h`` and ``gate``
        are their outputs, concatenated in ``chunks``' order. Returns the tokens' exit flags under the rule
        (chunk ``j``'s at its offset), with survival and targets kept in each chunk's request state."""
        dev = h.device
        ints, threshold = stage(dev, _chunk_fields(chunks), (np.repeat([c.st.prompt_exit.lookahead for c in chunks],
                                                                        [c.hi - c.lo for c in chunks]), np.float32))
        loop, min_loops, max_loops, slots, positions, token_index = ints
        # loop 1 starts from survival 1 and no target, whatever the request's slices hold
        survival = torch.where(loop == 1, 1.0, concat([c.st.survival[c.lo:c.hi] for c in chunks]))
        exit, survival = exit_decision(loop, survival, gate, min_loops, max_loops, 1.0)
        target = torch.where(loop == 1, 0, concat([c.st.exit_target[c.lo:c.hi] for c in chunks]))
        exit = exit | (target == loop)
        prev = self.project(concat([c.x for c in chunks]))
        target = self.decide(loop, gate, 1.0 - survival, self.project(h), prev, positions, min_loops, max_loops,
                             threshold, target, slots, token_index)
        a = 0
        for c in chunks:  # (a copy each into the request's own tensors: views of the batch)
            b = a + c.hi - c.lo
            c.st.survival[c.lo:c.hi] = survival[a:b]
            c.st.exit_target[c.lo:c.hi] = target[a:b]
            a = b
        return exit


class PromptChunk(NamedTuple):
    """A prompt chunk the rule decides for: positions ``[lo, hi)`` of ``st``'s prompt after ``loop``, its loop
    input ``x`` (the embedding at loop 1, else the kept hidden state)."""

    st: RequestState
    loop: int
    lo: int
    hi: int
    x: Tensor


def _chunk_fields(chunks: list[PromptChunk]) -> np.ndarray:
    """``[6, N]`` int64, per token of the chunks: loop, min and max loops, slot, position, token index (the
    prompt's last position 0): one upload for the step instead of tensors built per chunk."""
    n = [c.hi - c.lo for c in chunks]
    per_chunk = np.array([(c.loop, c.st.prompt_exit.min_loops, c.st.prompt_exit.max_loops, c.st.slot,
                           c.st.prompt.numel() - 1) for c in chunks], dtype=np.int64)
    loop, min_loops, max_loops, slot, last = np.repeat(per_chunk, n, axis=0).T
    positions = np.concatenate([np.arange(c.lo, c.hi, dtype=np.int64) for c in chunks])
    return np.stack([loop, min_loops, max_loops, slot, positions, positions - last])
