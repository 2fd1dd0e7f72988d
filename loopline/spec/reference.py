"""Draft-then-verify self-speculation of one sequence in plain PyTorch, on the plain path's dense plane KV.

It is the executable definition of scheme 1 (docs/speculation.md) that an engine integration will be
tested against token for token, as :func:`loopline.models.plain.plain_generate` is for plain decoding;
its own exactness is tested against that and the independent oracle in ``tests/reference.py``.

A round starts from the last committed token ``x_t`` (not yet run) at position ``t``:

1. **Draft**: positions ``t..t+K`` run one at a time at loops ``1..d``, the exit rule applied as usual;
   position ``t+i`` proposes token ``t+i+1`` from the head of its loop-``d`` state. A position whose own
   exit fires at ``e <= d`` is finished: its token comes from loop ``e``, exactly the target's.
2. **Verify**: the ``K+1`` positions run loops ``d+1..R`` together (one forward per loop), starting from
   their loop-``d`` states and reading the K/V the draft wrote for loops ``1..d`` (loop ``r`` reads only
   loop ``r``'s K/V, and those are the target's: same weights, same inputs). Each row stops at its own
   exit; an exited row's later planes hold its exit loop's K/V (``last_exited``), so rows behind it read
   what plain decoding reads.
3. **Accept**: greedy: the longest prefix of drafts equal to the target tokens, then the target's token
   at the first disagreement (the correction) or after the last draft (the bonus). Sampling: standard
   speculative rejection sampling (accept a draft with ``min(1, p/q)``, else sample ``max(p - q, 0)``),
   which makes every committed token's distribution exactly the target's.

Tokens past the first rejected draft leave stale K/V behind; the next round rewrites those positions
before any query reads them (attention reads positions ``<= `` the query's), so the dense KV needs no
explicit rollback. Only Ouro-style families (every KV stage per loop, a gate exit) are supported.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from loopline.models.family import family_of
from loopline.models.ops import Rope, upcast
from loopline.models.plain import PlainOutput, PlaneKV, plain_generate
from loopline.spec.adapter import DraftAdapter
from loopline.spec.config import SpeculativeConfig

__all__ = ["SpecOutput", "rejection_step", "speculative_generate"]


@dataclass
class SpecOutput(PlainOutput):
    """:class:`PlainOutput` plus per-round counts: drafts proposed and accepted in each verify round."""

    drafts: list[int] | None = None
    accepted: list[int] | None = None

    def __post_init__(self) -> None:
        self.drafts = [] if self.drafts is None else self.drafts
        self.accepted = [] if self.accepted is None else self.accepted


class _FrozenAttention:
    """Causal attention over one plane for rows ``start..start+n``; ``frozen`` rows (exited earlier) keep
    the K/V already in the plane (their exit loop's) instead of this loop's."""

    def __init__(self, kv: PlaneKV, plane: int, start: int, frozen: Tensor | None) -> None:
        self.kv, self.plane, self.start, self.frozen = kv, plane, start, frozen

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope) -> Tensor:
        q, k = rope(q, k)
        key = ("loop", self.plane, layer)
        n = q.shape[0]
        if self.frozen is not None and bool(self.frozen.any()):
            old_k = self.kv.k[key][self.start:self.start + n]
            old_v = self.kv.v[key][self.start:self.start + n]
            keep = self.frozen[:, None, None]
            k, v = torch.where(keep, old_k, k), torch.where(keep, old_v, v)
        keys, values = self.kv.write(key, self.start, k, v)
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", upcast(q), upcast(keys)) / math.sqrt(q.shape[-1])
        qpos = torch.arange(self.start, self.start + n, device=q.device)
        visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= qpos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, upcast(values)).to(q.dtype)


@dataclass
class _Rows:
    """Positions ``start..start+n`` mid-token: state, gate survival carry, exit loop (0: still looping)."""

    start: int
    state: Tensor  # [n, hidden]
    carry: Tensor  # [n] fp32
    exit_loop: Tensor  # [n] int64


class _Loops:
    """The model's loops over one sequence's plane KV, with the exit rule of one request."""

    def __init__(self, model: nn.Module, capacity: int, min_loops: int, max_loops: int, threshold: float) -> None:
        family = family_of(model)
        stages = family.kv_stages(model.config)
        if family.exit_criterion.reads_logits or not all(s.per_loop for s in stages):
            raise ValueError(f"speculative_generate supports gate-exit families with per-loop KV only "
                             f"(ouro); got model_type={family.model_type!r}")
        self.model, self.crit, self.layers = model, family.exit_criterion, stages[0].num_layers
        self.kv = PlaneKV(capacity)
        self.min_loops, self.max_loops, self.threshold = min_loops, max_loops, threshold
        self.planes = model.config.total_ut_steps

    def start(self, ids: Tensor, start: int) -> _Rows:
        pos = self._pos(start, ids.shape[0])
        e = self.model.prelude(ids, pos, None)
        n = ids.shape[0]
        seeds = torch.zeros_like(pos)  # Ouro's initial state is the embedding: nothing random
        return _Rows(start, self.model.initial_state(e, pos, seeds), self.crit.initial_carry(n, 0, ids.device),
                     torch.zeros(n, dtype=torch.long, device=ids.device))

    def _pos(self, start: int, n: int) -> Tensor:
        return torch.arange(start, start + n, device=self.kv_device)

    @property
    def kv_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def run(self, rows: _Rows, first: int, last: int) -> None:
        """Loops ``first..last`` for the rows still looping; exited rows keep their state and K/V."""
        pos = self._pos(rows.start, rows.state.shape[0])
        for loop in range(first, last + 1):
            live = rows.exit_loop == 0
            if not bool(live.any()):
                return
            attn = _FrozenAttention(self.kv, loop - 1, rows.start, ~live)
            state, signal = self.model.core(rows.state, None, pos, attn)
            done, carry = self.crit.decide(loop, rows.carry, signal, self.min_loops, self.max_loops, self.threshold)
            rows.state = torch.where(live[:, None], state, rows.state)
            rows.carry = torch.where(live, carry, rows.carry)
            exited = live & done
            rows.exit_loop = torch.where(exited, torch.full_like(rows.exit_loop, loop), rows.exit_loop)
            for i in exited.nonzero().flatten().tolist():
                self._settle(loop, rows.start + i)

    def _settle(self, exit_loop: int, position: int) -> None:
        """Planes deeper than the exit loop get its K/V (the last_exited layout)."""
        for plane in range(exit_loop, self.planes):
            self.kv.copy_position("loop", exit_loop - 1, plane, self.layers, position)

    def logits(self, rows: _Rows) -> Tensor:
        """fp32 logits ``[n, vocab]`` of each row's current state (its exit loop's once exited)."""
        return self.model.coda(rows.state, self._pos(rows.start, rows.state.shape[0]), None).float()


def rejection_step(p: Tensor, q: Tensor, draft: int, generator: torch.Generator) -> tuple[bool, int]:
    """One draft token under speculative rejection sampling: accepted with probability
    ``min(1, p[draft] / q[draft])``; else a token from ``max(p - q, 0)`` renormalised (the correction), so
    the result is distributed exactly as ``p``. ``p``, ``q``: probabilities ``[vocab]``."""
    u = torch.rand((), generator=generator, device=p.device)
    if bool(u * q[draft] <= p[draft]):
        return True, draft
    residual = (p - q).clamp_min(0)
    # p == q up to rounding: nothing left to correct towards, fall back to the target itself.
    residual = residual if float(residual.sum()) > 0 else p
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


@torch.no_grad()
def speculative_generate(model: nn.Module, prompt_ids: Sequence[int], max_tokens: int, spec: SpeculativeConfig, *,
                         temperature: float = 0.0, seed: int = 0, min_loops: int = 1, max_loops: int | None = None,
                         exit_threshold: float | None = None, eos_ids: Sequence[int] = (),
                         draft_adapter: DraftAdapter | None = None) -> SpecOutput:
    """Generates up to ``max_tokens`` tokens after ``prompt_ids`` with draft-then-verify speculation.

    ``temperature == 0``: greedy, token for token and exit depth for exit depth what
    :func:`~loopline.models.plain.plain_generate` gives. ``temperature > 0``: every token is distributed as
    plain sampling at that temperature from the target (the token's own exit depth); ``seed`` makes a run
    reproducible. ``logprobs`` are the target's raw log-probabilities of the committed tokens.
    ``draft_adapter``: drafts of positions still looping at the draft depth come from the head of the
    adapted state (:mod:`loopline.spec.adapter`); targets never see it.
    """
    if spec.scheme != "draft_verify":
        raise ValueError(f"speculative_config.scheme={spec.scheme!r}: the reference implements 'draft_verify'")
    config = model.config
    spec.check_model(config.total_ut_steps)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r}; allowed: a finite number >= 0")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}; allowed: an integer >= 1")
    max_loops = config.total_ut_steps if max_loops is None else max_loops
    threshold = family_of(model).default_threshold(config) if exit_threshold is None else exit_threshold
    # The plain path validates the request fields as plain decoding does and gives the first token's exit
    # depth (prefill is not speculative); the prompt's K/V is then written here, where the rounds read it.
    first = plain_generate(model, prompt_ids, 1, min_loops=min_loops, max_loops=max_loops, exit_threshold=threshold)
    k, d = spec.num_speculative_tokens, spec.draft_loops
    loops = _Loops(model, len(prompt_ids) + max_tokens + k + 1, min_loops, max_loops, threshold)
    generator = torch.Generator(device=loops.kv_device).manual_seed(seed)
    out = SpecOutput()
    logits = _prefill(loops, prompt_ids, first.exit_loops[0])
    token = _sample(logits, temperature, generator)
    eos = set(eos_ids)
    out.tokens.append(token), out.exit_loops.append(first.exit_loops[0]), out.logprobs.append(_logprob(logits, token))
    position = len(prompt_ids)
    while token not in eos and len(out.tokens) < max_tokens:
        committed = _round(loops, token, position, k, d, temperature, generator, out, draft_adapter)
        for tok, depth, logprob in committed:
            out.tokens.append(tok), out.exit_loops.append(depth), out.logprobs.append(logprob)
            token = tok
            if tok in eos or len(out.tokens) >= max_tokens:
                break
        position += len(committed)
    return out


def _prefill(loops: _Loops, prompt_ids: Sequence[int], exit_loop: int) -> Tensor:
    """Every prompt position at every loop (prefill is full depth); the last one's logits at ``exit_loop``."""
    ids = torch.tensor(list(prompt_ids), device=loops.kv_device)
    rows = loops.start(ids, 0)
    states = []
    pos = loops._pos(0, ids.shape[0])
    for loop in range(1, loops.planes + 1):
        rows.state, _ = loops.model.core(rows.state, None, pos, _FrozenAttention(loops.kv, loop - 1, 0, None))
        states.append(rows.state[-1:])
    return loops.model.coda(states[exit_loop - 1], pos[-1:], None).float()[0]


def _round(loops: _Loops, token: int, position: int, k: int, d: int, temperature: float,
           generator: torch.Generator, out: SpecOutput, adapter: DraftAdapter | None = None) -> list[tuple[int, int, float]]:
    """One draft/verify round from committed ``token`` at ``position``: ``(token, exit depth, logprob)`` of
    every token it commits (accepted drafts, then the correction or bonus)."""
    device = loops.kv_device
    drafts, draft_probs, states, carries, exits = [], [], [], [], []
    tok = token
    for i in range(k + 1):
        rows = loops.start(torch.tensor([tok], device=device), position + i)
        loops.run(rows, 1, d)
        states.append(rows.state), carries.append(rows.carry), exits.append(rows.exit_loop)
        if i == k:
            break
        q_logits = loops.logits(rows)[0] if adapter is None or int(rows.exit_loop[0]) else _adapted(loops, rows, adapter, d)
        tok = _sample(q_logits, temperature, generator)
        drafts.append(tok)
        draft_probs.append(_probs(q_logits, temperature))
    verify = _Rows(position, torch.cat(states), torch.cat(carries), torch.cat(exits))
    loops.run(verify, d + 1, loops.max_loops)
    target = loops.logits(verify)  # [k+1, vocab]
    depths = verify.exit_loop.tolist()
    committed = []
    for i, draft in enumerate(drafts):
        ok, tok = _judge(target[i], draft_probs[i], draft, temperature, generator)
        committed.append((tok, depths[i], _logprob(target[i], tok)))
        if not ok:
            break
    else:
        bonus = _sample(target[k], temperature, generator)
        committed.append((bonus, depths[k], _logprob(target[k], bonus)))
    out.drafts.append(len(drafts))
    out.accepted.append(len(committed) - 1)  # the last one is the correction or the bonus
    return committed


def _adapted(loops: _Loops, rows: _Rows, adapter: DraftAdapter, d: int) -> Tensor:
    """fp32 draft logits ``[vocab]`` of a one-row position still looping after loop ``d``."""
    state = adapter.to(rows.state.device)(rows.state.float(), d).to(rows.state.dtype)
    return loops.model.coda(state, loops._pos(rows.start, 1), None).float()[0]


def _judge(target: Tensor, q: Tensor, draft: int, temperature: float, generator: torch.Generator) -> tuple[bool, int]:
    if temperature == 0:
        best = int(torch.argmax(target))
        return best == draft, best
    return rejection_step(_probs(target, temperature), q, draft, generator)


def _probs(logits: Tensor, temperature: float) -> Tensor:
    if temperature == 0:
        return torch.nn.functional.one_hot(torch.argmax(logits), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, -1)


def _sample(logits: Tensor, temperature: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(_probs(logits, temperature), 1, generator=generator))


def _logprob(logits: Tensor, token: int) -> float:
    return float(torch.log_softmax(logits.float(), -1)[token])
