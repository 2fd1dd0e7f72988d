"""Greedy generation of one sequence for any looped family, on dense per-plane KV (no pages, no batching).

The plain path through the family seam (:mod:`loopline.models.family`): it calls only the seam's stages,
the family's :class:`~loopline.models.family.KVStage` list and its exit criterion, so Ouro and Huginn run
through the same code. It is what the engine's paged path is tested against family by family, and the
way to run a family the engine does not serve yet (Huginn).

Per token: the prelude writes its stage's K/V; the core runs loops ``1..`` until the exit criterion fires
(a criterion that reads logits runs the coda after every loop, rewriting the token's coda K/V, so the
coda K/V kept is the exit loop's); when a token exits at loop ``e`` below the deepest plane, its loop-``e``
K/V is copied into planes ``e+1..``, so a later query at loop ``d`` reads loop ``min(d, e)``. A prompt
runs ``family.prefill_loops`` loops; the first token comes from its last position (at the depth the
criterion picks there when ``exits_in_prefill``, else the last loop).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor, nn

from loopline.models.family import FIXED_DEPTH, Family, family_of
from loopline.models.ops import Rope, upcast


class PlaneKV:
    """Dense K/V of one sequence: ``[(stage, plane, layer)] -> [capacity, kv_heads, head_dim]``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.k: dict[tuple[str, int, int], Tensor] = {}
        self.v: dict[tuple[str, int, int], Tensor] = {}

    def write(self, key: tuple[str, int, int], start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Stores rows ``start..start+n`` and returns the keys/values of positions ``0..start+n``."""
        if key not in self.k:
            self.k[key] = k.new_zeros(self.capacity, *k.shape[1:])
            self.v[key] = v.new_zeros(self.capacity, *v.shape[1:])
        end = start + k.shape[0]
        self.k[key][start:end], self.v[key][start:end] = k, v
        return self.k[key][:end], self.v[key][:end]

    def copy_position(self, stage: str, src: int, dst: int, layers: int, position: int) -> None:
        for layer in range(layers):
            for table in (self.k, self.v):
                table[(stage, dst, layer)][position] = table[(stage, src, layer)][position]


class PlaneAttention:
    """Causal attention of rows at positions ``start..start+n`` over one plane of :class:`PlaneKV`."""

    def __init__(self, kv: PlaneKV, stage: str, plane: int, start: int) -> None:
        self.kv, self.stage, self.plane, self.start = kv, stage, plane, start

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope) -> Tensor:
        q, k = rope(q, k)
        keys, values = self.kv.write((self.stage, self.plane, layer), self.start, k, v)
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", upcast(q), upcast(keys)) / math.sqrt(q.shape[-1])
        qpos = torch.arange(self.start, self.start + q.shape[0], device=q.device)
        visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= qpos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, upcast(values)).to(q.dtype)


@dataclass
class PlainOutput:
    """Per generated token: its id, the loop it exited at and its log-probability."""

    tokens: list[int] = field(default_factory=list)
    exit_loops: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class _Sequence:
    """One sequence's KV and the stage calls at given positions."""

    def __init__(self, model: nn.Module, family: Family, capacity: int, planes: int, seed: int,
                 kv: PlaneKV | None = None) -> None:
        self.model, self.family, self.planes, self.seed = model, family, planes, seed
        self.device = next(model.parameters()).device
        self.kv = kv if kv is not None else PlaneKV(capacity)
        stages = family.kv_stages(model.config)
        self.per_loop = [s for s in stages if s.per_loop]
        self.once = {s.name: s for s in stages if not s.per_loop}

    def _attn(self, stage: str | None, plane: int, start: int) -> PlaneAttention | None:
        return None if stage is None else PlaneAttention(self.kv, stage, plane, start)

    def _stage(self, name: str) -> str | None:
        return name if name in self.once else None

    def prelude(self, ids: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
        pos = torch.arange(start, start + ids.shape[0], device=ids.device)
        e = self.model.prelude(ids, pos, self._attn(self._stage("prelude"), 0, start))
        seeds = torch.full_like(pos, self.seed)
        return e, self.model.initial_state(e, pos, seeds), pos

    def core(self, state: Tensor, e: Tensor, pos: Tensor, loop: int) -> tuple[Tensor, Tensor | None]:
        stage = self.per_loop[0].name if self.per_loop else None
        return self.model.core(state, e, pos, self._attn(stage, loop - 1, int(pos[0])))

    def coda(self, state: Tensor, pos: Tensor) -> Tensor:
        return self.model.coda(state, pos, self._attn(self._stage("coda"), 0, int(pos[0])))

    def settle(self, exit_loop: int, position: int) -> None:
        """A token that exited at ``exit_loop``: deeper planes get its exit loop's K/V."""
        for stage in self.per_loop:
            for plane in range(exit_loop, self.planes):
                self.kv.copy_position(stage.name, exit_loop - 1, plane, stage.num_layers, position)


@torch.no_grad()
def plain_generate(model: nn.Module, prompt_ids: Sequence[int], max_tokens: int, *, min_loops: int = 1,
                   max_loops: int | None = None, exit_threshold: float | None = None, seed: int = 0,
                   eos_ids: Sequence[int] = ()) -> PlainOutput:
    """Greedy generation of up to ``max_tokens`` tokens after ``prompt_ids`` (stops after an ``eos_ids``
    token). ``max_loops`` defaults to the checkpoint's depth, ``exit_threshold`` to the family's default
    (1.0, fixed depth, unless an Ouro checkpoint sets another); ``seed`` seeds a random initial state."""
    family = family_of(model)
    config = model.config
    limit = family.loop_limit(config)
    max_loops = config.num_loops if max_loops is None else max_loops
    if isinstance(max_loops, bool) or not isinstance(max_loops, int) or not 1 <= max_loops <= (limit or max_loops):
        raise ValueError(f"max_loops={max_loops!r}; allowed: " + (f"1..{limit}" if limit else "an integer >= 1"))
    if not 1 <= min_loops <= max_loops:
        raise ValueError(f"min_loops={min_loops}; allowed: 1..max_loops ({max_loops})")
    threshold = family.default_threshold(config) if exit_threshold is None else exit_threshold
    if not 0.0 < threshold <= FIXED_DEPTH:
        raise ValueError(f"exit_threshold={threshold}; allowed: (0, 1]")
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}; allowed: an integer >= 1")
    prefill = family.prefill_loops(config, max_loops)
    seq = _Sequence(model, family, len(prompt_ids) + max_tokens, max(prefill, max_loops), seed)
    device = seq.device
    crit = family.exit_criterion
    vocab = family.logits_size(config)

    # Prefill: every prompt position runs `prefill` loops; the last one may pick an earlier exit.
    ids = torch.tensor(list(prompt_ids), device=device)
    e, state, pos = seq.prelude(ids, 0)
    carry, exit_loop, exit_state = crit.initial_carry(1, vocab, device), None, None
    for loop in range(1, prefill + 1):
        state, signal = seq.core(state, e, pos, loop)
        if crit.exits_in_prefill and exit_loop is None:
            done, carry = crit.decide(loop, carry, signal[-1:], min_loops, max_loops, threshold)
            if bool(done):
                exit_loop, exit_state = loop, state[-1:]
    if exit_loop is None:
        exit_loop, exit_state = prefill, state[-1:]
    logits = seq.coda(torch.cat([state[:-1], exit_state]), pos)[-1]
    return greedy_emit(logits, exit_loop, len(prompt_ids), max_tokens, eos_ids,
                       lambda token, position: _decode(seq, token, position, min_loops, max_loops, threshold, vocab))


@torch.no_grad()
def dense_prompt(model: nn.Module, ids: Tensor, kv: PlaneKV, max_loops: int | None = None, seed: int = 0) -> None:
    """Runs ``ids`` (``[T]``) as one prompt through every stage at the family's prefill depth for ``max_loops``
    (default: the checkpoint's depth), writing every stage's K/V of every loop into ``kv`` (FP8 KV calibration
    reads them: ``loopline.kv.quant``). A coda without K/V (Ouro's ``lm_head``) is not run."""
    family, config = family_of(model), model.config
    loops = family.prefill_loops(config, config.num_loops if max_loops is None else max_loops)
    seq = _Sequence(model, family, ids.shape[0], loops, seed, kv)
    e, state, pos = seq.prelude(ids.to(seq.device), 0)
    for loop in range(1, loops + 1):
        state, _ = seq.core(state, e, pos, loop)
    if "coda" in seq.once:
        seq.coda(state, pos)


def greedy_emit(logits: Tensor, exit_loop: int, position: int, max_tokens: int, eos_ids: Collection[int],
                decode: Callable[[int, int], tuple[int, Tensor]]) -> PlainOutput:
    """Greedy tokens from the first token's fp32 ``logits`` and exit loop on: each token is emitted with its
    exit loop and logprob, then ``decode(token, position)`` runs it at ``position`` (the prompt's length
    first) and gives the next ``(exit loop, logits)``, until an EOS id or ``max_tokens`` tokens."""
    out = PlainOutput()
    while True:
        token = int(torch.argmax(logits))
        out.tokens.append(token)
        out.exit_loops.append(exit_loop)
        out.logprobs.append(float(torch.log_softmax(logits.float(), -1)[token]))
        if token in eos_ids or len(out.tokens) >= max_tokens:
            return out
        exit_loop, logits = decode(token, position)
        position += 1


def _decode(seq: _Sequence, token: int, position: int, min_loops: int, max_loops: int, threshold: float,
            vocab: int) -> tuple[int, Tensor]:
    """Runs ``token`` at ``position`` until its exit; ``(exit loop, fp32 logits)``."""
    crit = seq.family.exit_criterion
    ids = torch.tensor([token], device=seq.device)
    e, state, pos = seq.prelude(ids, position)
    carry = crit.initial_carry(1, vocab, ids.device)
    logits = None
    for loop in range(1, max_loops + 1):
        state, signal = seq.core(state, e, pos, loop)
        if crit.reads_logits:
            logits = signal = seq.coda(state, pos)
        done, carry = crit.decide(loop, carry, signal, min_loops, max_loops, threshold)
        if bool(done):
            break
    if logits is None:
        logits = seq.coda(state, pos)
    seq.settle(loop, position)
    return loop, logits[0]
