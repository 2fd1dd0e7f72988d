"""Loop self-speculation on the device (docs/speculation.md, scheme 1: draft then verify).

A speculating request runs rounds of a fixed shape that the scheduler spells out step by step
(``loopline.core.speculation``): round positions ``0..K`` at loops ``1..d`` one query at a time (the
draft), then all ``K+1`` positions together at loops ``d+1..R`` (the verify). The round's start
position and input token are the slot's decode state (``DeviceDecodeState.pos`` / ``token``), so
the host never tells the device where a round starts and the overlapped engine needs no sync.

* :class:`SpecRoundState`: per slot and round position, the fed token (position 0: the round's
  input; ``i > 0``: the draft of position ``i - 1``), hidden state, gate survival and exit loop (0:
  still looping).
* :class:`SpecKind`: the row kind of both phases. ``prepare`` derives every query's position, KV slot
  and input from the round state; ``finish`` applies each position's own exit rule, stores its state
  and makes the ``last_exited`` exit copy. A position that already exited (in the draft, or an earlier
  verify loop) runs on scratch and keeps its state and K/V: rows behind it read its exit loop's K/V,
  as plain decoding does.
* :class:`SpecRounds`: after the forward, the draft-end rows sample the next position's token from
  their head (:class:`~loopline.worker.draft_head.DraftHead`: through a trained draft adapter when one
  is installed), and the round's last verify step samples the target's tokens (one sampler call with the
  step's decode rows), accepts the drafts while they equal them, commits that run plus the target's
  token at the first difference (the correction) or after the last draft (the bonus), and moves the
  slot's decode state past it.

Sampling: a draft is drawn with the parameters and the counter-based noise of the token index it
proposes, which the target's token at that index uses too (the sampler's Gumbel-max trick keyed by
seed and token index). The committed tokens are therefore exactly plain seeded sampling's (greedy:
the argmax), so the output distribution is the target's; a draft is accepted when both distributions
put their noisy maximum on the same token (the Gumbel-max coupling, which accepts with probability
at least ``(1 - tv) / (1 + tv)`` for the total variation ``tv`` between draft and target, against
``1 - tv`` for rejection sampling: docs/speculation.md).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from loopline.attention import AttentionBackend
from loopline.core.contracts import ScheduledRow, SpecStep
from loopline.models.ouro import OuroForCausalLM
from loopline.spec.replay import AcceptanceReplay
from loopline.worker.decode_state import DeviceDecodeState
from loopline.worker.draft_head import DraftHead
from loopline.worker.exit_rule import exit_decision
from loopline.worker.request_state import RequestState
from loopline.worker.row_kinds import RowKind, exit_columns
from loopline.worker.sampler import Sampler, SamplingTensors
from loopline.worker.sampling_inputs import (
    FieldsStager,
    ParamsStager,
    build_sampling_tensors,
)
from loopline.worker.staging import stage
from loopline.worker.step_inputs import HostImage, KindRows, Segment, StepInputs

_FIELDS = ("slots", "index", "loop", "min_loops", "max_loops", "threshold")


class SpecRoundState:
    """The round state of every slot (module docstring); ``k`` drafts per round."""

    def __init__(self, num_slots: int, k: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k, self.device = k, device
        i64 = {"dtype": torch.long, "device": device}
        self.tokens = torch.zeros(num_slots, k + 1, **i64)
        self.hidden = torch.zeros(num_slots, k + 1, hidden_size, dtype=dtype, device=device)
        self.survival = torch.ones(num_slots, k + 1, dtype=torch.float32, device=device)
        self.exit_loop = torch.zeros(num_slots, k + 1, **i64)


class DraftSampler:
    """Samples drafts as the target samples the token index each stands for: the same parameters and the
    counter-based noise of the same (seed, token index); a draft's logprobs are never reported."""

    def __init__(self, sampler: Sampler, device: torch.device) -> None:
        self.sampler, self.device = sampler, device
        self._params, self._fields = ParamsStager(), FieldsStager()  # the drafts' own (the target rows' differ)

    def __call__(self, logits: Tensor, states: list[Any], index: Tensor,
                 history: Callable[[SamplingTensors], None] | None = None) -> Tensor:
        """``logits`` ``[M, V]`` fp32, one request state and completion index ``[M]`` a row -> tokens ``[M]``;
        ``history`` gives the rows' generated history where their penalties or bad words read it."""
        tensors = build_sampling_tensors(states, index, self.sampler.logprobs_mode, self.device,
                                         params=self._params, fields=self._fields)
        tensors.max_num_logprobs = None
        if history is not None:
            history(tensors)
        return self.sampler(logits, tensors).token_ids


def round_history(ds: DeviceDecodeState, fed: Tensor, tensors: SamplingTensors, slots: Tensor, position: Tensor) -> None:
    """The next sampling rows of ``tensors`` (after those whose history it holds already, if any) stand for the
    token after position ``position`` of a speculative run of ``slots`` past their last committed token; ``fed``
    ``[n, K]``: each row's tokens fed at positions ``1..K`` (scheme 1: a round's drafts; scheme 2: the lanes'
    input tokens). Their generated history (what penalties and multi-token bad words read) is the slot's
    committed tokens plus ``fed`` before the position. A token committed at a position follows exactly those
    tokens (all of them were accepted), so drafts and targets sampled this way are plain decoding's; a position
    after a rejected draft is never committed, whatever its history."""
    penalties, bad_words = tensors.any_penalties and ds.counts is not None, tensors.any_bad_words and ds.recent is not None
    if not (penalties or bad_words):  # (no launch for the usual request)
        return
    before = torch.arange(fed.shape[1], device=slots.device)[None, :] < position[:, None]
    if penalties:
        extra = torch.zeros(len(slots), ds.counts.shape[1], dtype=ds.counts.dtype, device=slots.device)
        extra.scatter_add_(1, fed, before.to(extra.dtype))
        if tensors.any_count_penalties:  # (as the runner's rows: each only where a row's penalty reads it)
            tensors.output_counts = _after(tensors.output_counts, ds.counts[slots] + extra)
        if tensors.any_repetition:
            tensors.seen_mask = _after(tensors.seen_mask, ds.seen[slots] | (extra > 0))
    if bad_words:
        width, kept = tensors.bad_prefix.shape[1], ds.recent.shape[1]
        # the last `width` tokens of (committed, fed before the position), oldest first
        full = torch.cat([ds.recent[slots], fed], dim=1)
        at = (kept + position)[:, None] - width + torch.arange(width, device=slots.device)[None, :]
        tensors.recent = _after(tensors.recent, full.gather(1, at))


def _after(rows: Tensor | None, more: Tensor) -> Tensor:
    return more if rows is None else torch.cat([rows, more])


class SpecPrepared(NamedTuple):
    """A step's speculative queries as ``prepare`` derived them (``[T]`` each, ``plane_slots`` ``[T, P]``)."""

    slots: Tensor
    offset: Tensor  # round position of each query
    loop: Tensor
    frozen: Tensor  # the position exited earlier: its state and K/V stay
    plane_slots: Tensor
    min_loops: Tensor
    max_loops: Tensor
    threshold: Tensor


class SpecKind(RowKind):
    """Rows of speculating requests: a draft row is one query, a verify row ``K+1`` (module docstring)."""

    derives = True

    def __init__(self, *, model: OuroForCausalLM, backend: AttentionBackend, kv: Callable[[], tuple[Tensor, Tensor]],
                 state: DeviceDecodeState, rounds: SpecRoundState, requests: dict[str, RequestState],
                 scratch_slot: int, copies_on_exit: bool) -> None:
        self.model, self.backend, self.kv, self.state, self.rounds = model, backend, kv, state, rounds
        self.requests, self.scratch_slot, self.copies_on_exit = requests, scratch_slot, copies_on_exit

    def takes(self, row: ScheduledRow) -> bool:
        return isinstance(row.spec, SpecStep)

    def host_fields(self, rows: int) -> dict:
        i64 = np.int64
        return {"slots": (i64, (rows,), self.scratch_slot), "index": (i64, (rows,), 0), "loop": (i64, (rows,), 1),
                "min_loops": (i64, (rows,), 1), "max_loops": (i64, (rows,), 1), "threshold": (np.float32, (rows,), 1.0)}

    def plan(self, rows: list[ScheduledRow]) -> KindRows:
        n = len(rows)
        if not n:
            return KindRows(rows, 0, 0, np.zeros(0, dtype=np.int64), 0, 0)
        # (a verify row's index: -(K + 1), its round's queries; the device reads the round's last position from it)
        host = (np.fromiter((r.slot for r in rows), np.int64, n),
                np.fromiter((r.spec.index if r.spec.index >= 0 else -r.spec.queries for r in rows), np.int64, n),
                np.fromiter((r.spec.loop for r in rows), np.int64, n), *exit_columns(rows))
        queries = np.fromiter((r.spec.queries for r in rows), np.int64, n)
        bound = max(self.requests[r.request_id].max_len for r in rows)
        return KindRows(rows, n, int(queries.sum()), queries, int(queries.max()), bound, host)

    def fill(self, part: KindRows, image: HostImage) -> None:
        n = part.num_rows
        for name, values in zip(_FIELDS, part.host):
            image.own(name)[:n] = values

    def prepare(self, inp: StepInputs, seg: Segment, own: dict[str, Tensor]) -> SpecPrepared | None:
        if not seg.rows:
            return None
        r, t, n, T = seg.row0, seg.tok0, seg.rows, seg.tokens
        ds, st = self.state, self.rounds
        slots, index, loop = own["slots"], own["index"], own["loop"]
        # a round's first step resets its positions: position 0 is fed the slot's last committed token
        start = (index == 0) & (loop == 1)
        st.exit_loop[slots] = torch.where(start[:, None], 0, st.exit_loop[slots])
        st.tokens[slots, 0] = torch.where(start, ds.token[slots], st.tokens[slots, 0])
        # each query's row (the host wrote the rows' query offsets) and round position; a graph's padding
        # tokens (past the last row's queries) belong to no row: they run on the scratch slot, frozen. Beside a
        # prompt's chunk (spec_mixed) the kind's padding tokens fall in its last padding row's range: past a
        # round's K + 1 positions they are padding too
        qsl = inp.query_start_loc[r:r + n + 1].long() - t
        tok = torch.arange(T, device=slots.device)
        row = torch.searchsorted(qsl[1:], tok, right=True)
        pad = row == n
        row = row.clamp(max=n - 1)
        pad |= tok - qsl[row] >= st.exit_loop.shape[1]
        offset = torch.where(pad, 0, tok - qsl[row] + index.clamp(min=0)[row])
        q_slots, q_loop = torch.where(pad, self.scratch_slot, slots[row]), loop[row]
        pos = ds.pos[q_slots] + offset
        frozen = (st.exit_loop[q_slots, offset] > 0) | pad
        bs = ds.block_size
        plane_slots = ds.plane_slots(q_slots, pos)
        plane = ds.layout.plane_index(q_loop)
        scratch_kv = ds.scratch_block * bs
        inp.positions[t:t + T] = pos
        inp.slot_mapping[t:t + T] = torch.where(frozen, scratch_kv, plane_slots.gather(1, plane[:, None]).squeeze(1))
        last = torch.where(index >= 0, index, -index - 1)  # a row's last round position (verify rows: its K)
        inp.seq_lens[r:r + n] = (ds.pos[slots] + last + 1).to(torch.int32)
        width = inp.block_tables.shape[1]
        inp.block_tables[r:r + n] = ds.tables[slots, ds.layout.plane_index(loop)][:, :width]
        ids = st.tokens[q_slots, offset]
        embed = self.model.model.embed_tokens.weight
        inp.x[t:t + T] = torch.where((q_loop == 1)[:, None], embed[ids], st.hidden[q_slots, offset])
        return SpecPrepared(q_slots, offset, q_loop, frozen, plane_slots, own["min_loops"][row], own["max_loops"][row],
                            own["threshold"][row])

    def finish(self, h: Tensor, gate: Tensor, p: SpecPrepared | None, own: dict[str, Tensor]) -> tuple:
        """Each live position's own exit rule after this loop, its state, and the exit copy."""
        if p is None:
            return ()
        st = self.rounds
        key = (p.slots, p.offset)
        live = ~p.frozen
        survival = torch.where(p.loop == 1, torch.ones_like(gate, dtype=torch.float32), st.survival[key])
        ex, survival = exit_decision(p.loop, survival, gate, p.min_loops, p.max_loops, p.threshold)
        st.hidden[key] = torch.where(live[:, None], h, st.hidden[key])
        st.survival[key] = torch.where(live, survival, st.survival[key])
        exited = live & ex
        st.exit_loop[key] = torch.where(exited, p.loop, st.exit_loop[key])
        if self.copies_on_exit:  # last_exited: a position exiting at loop e fills its deeper planes
            k_cache, v_cache = self.kv()
            self.backend.copy_exited(k_cache, v_cache, p.plane_slots, p.loop, exited,
                                     self.state.scratch_block * self.state.block_size)
        return ()


@dataclass
class VerifyPart:
    """The round-ending rows of a step, for the sampler: ``K+1`` target rows each."""

    row_idx: list[int]  # step row of each target row (each round-ending row K+1 times)
    states: list[Any]
    slots: Tensor  # [M] the slots of the round-ending rows
    logits: Tensor  # [M * (K+1), V] fp32 target logits (each position at its own exit)
    token_index: Tensor  # [M * (K+1)] index in the completion of each position's token
    depth: Tensor  # [M * (K+1)] exit depth of each position
    verdicts: Tensor | None = None  # the pipeline's: each target row's draft verdict, set by accept (SampleBatch)
    drafts: Tensor | None = None  # [M] drafts of each round (<= K: positions past a round's are never accepted)


class SpecRounds:
    """What speculating rows do after the forward: drafts at a draft's last loop, and the round's
    acceptance at its last verify step (module docstring)."""

    def __init__(self, model: OuroForCausalLM, state: DeviceDecodeState, rounds: SpecRoundState,
                 requests: dict[str, RequestState], sampler: Sampler, device: torch.device, head: DraftHead) -> None:
        self.model, self.state, self.rounds, self.requests, self.device = model, state, rounds, requests, device
        self.head = head  # the drafts' coda (a trained adapter's, when installed); targets use the model's head
        self.sampler = sampler
        self.drafts = DraftSampler(sampler, device)
        self.replay: AcceptanceReplay | None = None  # a measurement hook (loopline/spec/replay.py); None: real verdicts

    def draft(self, rows: list[ScheduledRow]) -> None:
        """Draft-end rows: the head of each position's state (its exit loop's, if it exited) proposes the
        next round position's token, sampled as the target samples that token: same parameters, and the
        counter-based noise of the same (seed, token index). So a draft equals the target's token whenever
        both distributions put their noisy maximum on it (the Gumbel-max coupling), and the committed
        tokens are exactly those plain decoding samples (greedy: the argmax)."""
        ends = [r for r in rows if r.spec is not None and r.spec.draft_end]
        if not ends:
            return
        slots, index = self._indices(ends)
        st = self.rounds
        logits = self.head(st.hidden[slots, index], st.exit_loop[slots, index] == 0)
        states = [self.requests[r.request_id] for r in ends]
        st.tokens[slots, index + 1] = self.drafts(logits, states, self.state.token_index[slots] + index,
                                                  lambda t: round_history(self.state, st.tokens[slots, 1:], t, slots, index))

    def verify_part(self, rows: list[ScheduledRow], row0: int) -> VerifyPart | None:
        """The target rows of the round-ending rows among ``rows`` (step rows from ``row0``)."""
        last = [(row0 + i, r) for i, r in enumerate(rows) if r.spec.last]
        if not last:
            return None
        k1 = self.rounds.k + 1  # (a round of fewer drafts samples the positions past its own too: never committed)
        slots, drafts = stage(self.device, ([r.slot for _, r in last], np.int64),
                              ([r.spec.queries - 1 for _, r in last], np.int64))
        st = self.rounds
        logits = self.model.head(st.hidden[slots].flatten(0, 1)).float()
        j = torch.arange(k1, device=self.device)
        index = (self.state.token_index[slots][:, None] + j).flatten()
        states = [self.requests[r.request_id] for _, r in last for _ in range(k1)]
        return VerifyPart([i for i, _ in last for _ in range(k1)], states, slots, logits, index,
                          st.exit_loop[slots].flatten(), drafts=drafts)

    def target_history(self, tensors: SamplingTensors, part: VerifyPart) -> None:
        """``part``'s target rows are the sampling rows after those whose history ``tensors`` holds: their
        generated history (:func:`round_history`), where their penalties or bad words read it."""
        k1 = self.rounds.k + 1
        position = torch.arange(k1, device=self.device).repeat(len(part.slots))
        slots = part.slots.repeat_interleave(k1)
        round_history(self.state, self.rounds.tokens[slots, 1:], tensors, slots, position)

    def accept(self, part: VerifyPart, target: Tensor) -> Tensor:
        """Acceptance of the round-ending rows' drafts; ``target`` ``[M * (K+1)]``: the target tokens
        the sampler drew (greedy: the argmax). Drafts are accepted while they equal the target's tokens;
        the target's token at the first difference is the correction, after the last draft the bonus.
        Moves each slot past its committed run; returns the committed mask ``[M * (K+1)]``."""
        st, ds = self.rounds, self.state
        k = st.k
        y = target.view(-1, k + 1)
        match = y[:, :k] == st.tokens[part.slots, 1:]
        if self.replay is not None:  # (cost measurements on random weights: outputs meaningless)
            match = self.replay.accepted(part.slots, ds.token_index[part.slots], k)
        j = torch.arange(k + 1, device=self.device)
        if part.drafts is not None:  # a round of fewer drafts than K: the positions past its own were never drafted
            match = match & (j[None, :k] < part.drafts[:, None])
        accepted = match.long().cumprod(dim=1).sum(dim=1)  # [M] drafts accepted
        committed = j[None, :] <= accepted[:, None]
        ds.take_run(part.slots, y, committed)
        ds.token[part.slots] = y.gather(1, accepted[:, None]).squeeze(1)
        ds.pos[part.slots] = ds.pos[part.slots] + accepted + 1
        ds.token_index[part.slots] = ds.token_index[part.slots] + accepted + 1
        return committed.flatten()

    def _indices(self, rows: list[ScheduledRow]) -> tuple[Tensor, Tensor]:
        return tuple(stage(self.device, ([r.slot for r in rows], np.int64), ([r.spec.index for r in rows], np.int64)))
