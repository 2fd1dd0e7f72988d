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

**Depth-pipelined speculation** (scheme 2, ``spec.scheme == "pipeline"``) is written as the engine would
step it: a *step* runs one loop of every row in flight, a row being one token position at its own loop.

* A row that reaches loop ``d`` without exiting drafts its successor's token from its loop-``d`` head;
  the successor (the next position) enters at loop 1 in the next step, while the row runs its deep
  loops. A row that exits at ``e <= d`` drafts nothing: its own token, from loop ``e``, enters next.
* At its own exit (the exit rule, loop by loop, as plain decoding applies it) a row judges the draft
  it spawned: greedy, equality with the target's argmax; sampling, :func:`rejection_step` (accept with
  ``min(1, p/q)``, else the correction from ``max(p - q, 0)``). On rejection every row behind it (its
  successor, which started from the wrong token, and the rows that one drafted in turn) is dropped, its
  K/V rolled back (zeroed in every plane, as if never written), and the correction enters next step.
* **Re-drafting** (``spec.redraft``, greedy): a row still looping after loop ``d`` reads its head at each
  further loop; where that token differs from the draft its successor started from, every row behind it is
  dropped (as at a rejection) and the new token enters next step as the row's draft, judged at its exit.
  A deeper loop's token agrees with the target more often, so fewer drafts fail at the exit, where a
  failure costs the most loops. Sampled, the rows keep the one draft of loop ``d``: a new draft would have to
  be a fresh sample of the deeper loop, which disagrees far more often (the engine's drafts share their
  target's noise, so it re-drafts sampled rows too: docs/speculation.md).
* A row's result commits once every row before it committed; a row that exits while an older one is
  still looping waits (its own verdict is conditional on its input, which the older row judges).
* Rows are never started for tokens past ``max_tokens``, nor behind a draft that is an EOS token (a
  rejected EOS draft makes its correction enter as usual).

Every row runs behind its predecessor by at least ``d`` loops, so the K/V it reads at loop ``r`` (plane
``r``: the predecessors' loop-``r`` K/V, or their exit loop's once they exited, ``last_exited``) was
written in an earlier step: the order of the rows inside a step does not matter, and each row computes
exactly what plain decoding computes for its position.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from loopline.models.family import family_of
from loopline.models.ops import Rope, upcast
from loopline.models.plain import PlainOutput, PlaneKV, plain_generate
from loopline.spec.adapter import DraftAdapter
from loopline.spec.config import SpeculativeConfig

__all__ = ["PipelineOutput", "SpecOutput", "rejection_step", "speculative_generate"]


@dataclass
class SpecOutput(PlainOutput):
    """:class:`PlainOutput` plus per-round counts: drafts proposed and accepted in each verify round."""

    drafts: list[int] | None = None
    accepted: list[int] | None = None

    def __post_init__(self) -> None:
        self.drafts = [] if self.drafts is None else self.drafts
        self.accepted = [] if self.accepted is None else self.accepted


@dataclass
class PipelineOutput(PlainOutput):
    """:class:`PlainOutput` of the depth pipeline plus its step counts: ``steps`` (each one loop of every
    row in flight), ``rows[n]`` (steps that ran ``n`` rows, as :class:`loopline.spec.cost.Replay` counts
    them), ``dropped`` (rows dropped behind a rejected draft); per committed token ``drafted`` (its token
    was drafted and judged) and ``matches`` (the draft was accepted, or there was none: a token from a
    row that exited at or before the draft depth, or the first one, from the prompt)."""

    steps: int = 0
    rows: Counter = field(default_factory=Counter)
    dropped: int = 0
    drafted: list[bool] = field(default_factory=list)
    matches: list[bool] = field(default_factory=list)

    @property
    def row_loops(self) -> int:
        """Rows summed over steps: one token position at one loop each (a step, a "loop pass" in
        :mod:`loopline.spec.cost`, reads the weights once for all its rows)."""
        return sum(n * c for n, c in self.rows.items())


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
                         draft_adapter: DraftAdapter | None = None) -> SpecOutput | PipelineOutput:
    """Generates up to ``max_tokens`` tokens after ``prompt_ids`` with loop self-speculation:
    draft-then-verify rounds, or the depth pipeline when ``spec.pipelines`` (module docstring;
    then a :class:`PipelineOutput`, and ``num_speculative_tokens`` is unused).

    ``temperature == 0``: greedy, token for token and exit depth for exit depth what
    :func:`~loopline.models.plain.plain_generate` gives. ``temperature > 0``: every token is distributed as
    plain sampling at that temperature from the target (the token's own exit depth); ``seed`` makes a run
    reproducible. ``logprobs`` are the target's raw log-probabilities of the committed tokens.
    ``draft_adapter``: drafts of positions still looping at the draft depth come from the head of the
    adapted state (:mod:`loopline.spec.adapter`); targets never see it.
    """
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
    # "auto" picks by the engine's load: one request alone pipelines
    out = PipelineOutput() if spec.pipelines else SpecOutput()
    logits = _prefill(loops, prompt_ids, first.exit_loops[0])
    token = _sample(logits, temperature, generator)
    eos = set(eos_ids)
    out.tokens.append(token), out.exit_loops.append(first.exit_loops[0]), out.logprobs.append(_logprob(logits, token))
    if spec.pipelines:
        redraft = spec.redraft and temperature == 0
        return _Pipeline(loops, d, temperature, generator, eos, max_tokens, draft_adapter, redraft).run(out, len(prompt_ids))
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


@dataclass(eq=False)  # rows are compared by identity
class _Lane:
    """One row of the pipeline: position ``start`` of ``rows`` runs token ``index`` and yields token ``index + 1``."""

    index: int
    rows: _Rows
    loop: int = 0  # loops run so far
    draft: int | None = None  # the successor's token, drafted at loop d (None: no draft)
    q: Tensor | None = None  # the draft's distribution
    result: tuple[int, int, float] | None = None  # (token, exit depth, logprob) once the row exited
    accepted: bool = True


class _Pipeline:
    """The depth pipeline over one sequence (module docstring): rows in flight, stepped one loop at a time."""

    def __init__(self, loops: _Loops, d: int, temperature: float, generator: torch.Generator, eos: set[int],
                 max_tokens: int, adapter: DraftAdapter | None, redraft: bool = False) -> None:
        self.loops, self.d, self.temperature, self.generator = loops, d, temperature, generator
        self.eos, self.max_tokens, self.adapter, self.redraft = eos, max_tokens, adapter, redraft
        self.lanes: list[_Lane] = []

    def run(self, out: PipelineOutput, position: int) -> PipelineOutput:
        """Steps from the first generated token (in ``out``, at ``position``) until ``max_tokens`` or EOS."""
        out.drafted.append(False), out.matches.append(True)
        token = out.tokens[0]
        if token in self.eos or self.max_tokens == 1:
            return out
        self._enter(0, token, position)
        while True:
            running = [lane for lane in self.lanes if lane.result is None]
            assert running, "a row in flight until the last token commits"
            out.steps += 1
            out.rows[len(running)] += 1
            for lane in running:
                lane.loop += 1
                self.loops.run(lane.rows, lane.loop, lane.loop)
            for lane in running:  # oldest first: a rejection drops the younger rows before they act
                if lane in self.lanes:
                    self._after_loop(lane, out)
            while self.lanes and self.lanes[0].result is not None:
                lane = self.lanes.pop(0)
                token, depth, logprob = lane.result
                out.tokens.append(token), out.exit_loops.append(depth), out.logprobs.append(logprob)
                out.drafted.append(lane.draft is not None), out.matches.append(lane.accepted)
                if token in self.eos or len(out.tokens) >= self.max_tokens:
                    return out

    def _needed(self, index: int, token: int) -> bool:
        """Whether a row for token ``index`` (fed ``token``) can yield a token the output keeps."""
        return index + 1 < self.max_tokens and token not in self.eos

    def _enter(self, index: int, token: int, position: int) -> None:
        device = self.loops.kv_device
        self.lanes.append(_Lane(index, self.loops.start(torch.tensor([token], device=device), position)))

    def _after_loop(self, lane: _Lane, out: PipelineOutput) -> None:
        """The row's exit (judging its draft) or, at loop d, its draft (past it, a re-draft)."""
        rows = lane.rows
        successor = self.lanes.index(lane) + 1 < len(self.lanes)
        if int(rows.exit_loop[0]):
            p = self.loops.logits(rows)[0]
            if lane.draft is not None:
                lane.accepted, token = _judge(p, lane.q, lane.draft, self.temperature, self.generator)
            else:
                token = _sample(p, self.temperature, self.generator)
            lane.result = (token, int(rows.exit_loop[0]), _logprob(p, token))
            if not lane.accepted:
                self._drop_behind(lane, out)
            if (not lane.accepted or not successor) and self._needed(lane.index + 1, token):
                self._enter(lane.index + 1, token, rows.start + 1)
        elif lane.loop == self.d and lane.index + 2 < self.max_tokens:
            q = (self.loops.logits(rows)[0] if self.adapter is None
                 else _adapted(self.loops, rows, self.adapter, self.d))
            lane.draft = _sample(q, self.temperature, self.generator)
            lane.q = _probs(q, self.temperature)
            if self._needed(lane.index + 1, lane.draft):
                self._enter(lane.index + 1, lane.draft, rows.start + 1)
        elif self.redraft and lane.draft is not None and lane.loop > self.d:
            token = int(self.loops.logits(rows)[0].argmax())
            if token != lane.draft:
                self._drop_behind(lane, out)
                lane.draft, lane.q = token, None  # (greedy: q is not read)
                if self._needed(lane.index + 1, token):
                    self._enter(lane.index + 1, token, rows.start + 1)

    def _drop_behind(self, lane: _Lane, out: PipelineOutput) -> None:
        """Drops every row after ``lane`` and rolls its K/V back: its position is zeroed in every plane, as
        it was before the row ran (the exit copies it made included)."""
        cut = self.lanes.index(lane) + 1
        dropped, self.lanes = self.lanes[cut:], self.lanes[:cut]
        out.dropped += len(dropped)
        kv = self.loops.kv
        for gone in dropped:
            for table in (kv.k, kv.v):
                for tensor in table.values():
                    tensor[gone.rows.start].zero_()
