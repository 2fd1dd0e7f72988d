"""An engine's constrained requests: one grammar matcher per sequence, and each step's token mask.

The engine (``LLMEngine``) calls, in this order:

* :meth:`StructuredOutputs.add` from ``add_request``, after the input processor compiled (and so
  validated) the constraint: one ``GrammarMatcher`` per child sequence (``n`` of them);
* :meth:`~StructuredOutputs.in_step` on each scheduled step (whether it has constrained rows, whose logits
  are masked), and :meth:`~StructuredOutputs.read_at_once`: a step in which a constrained sequence may
  sample a token *and* may sample its next one in the step after is read as soon as it is launched (no
  overlap with the next step), so that the mask of a request's next token always reflects all its
  previous tokens. A sequence whose next token cannot exit at its first loop (``min_loops >= 2``, or a
  threshold of 1 or more: exits only at ``max_loops``, Ouro's fixed depth) keeps the overlap: the step
  launched before its token is read cannot sample for it (its sample there is discarded), and by the
  step after, the token is read. Steps without constrained rows keep the overlap;
* :meth:`~StructuredOutputs.token_mask`, which the model runner calls with the request ids of the rows it
  samples, on their logits, before the sampler: the host fills the constrained rows' bitmasks from their
  matchers, stages them once and masks the logits on the device (unconstrained rows are not touched);
* :meth:`~StructuredOutputs.accept` for every token booked: the matcher advances; it returns whether the
  grammar terminated (its stop token accepted, or nothing more can follow);
* :meth:`~StructuredOutputs.drop` when a sequence finishes or is aborted (and :meth:`prune` for sequences
  finished some other way).

A matcher lives on the host, keyed by the sequence's id: preemption, resumption, prefix caching and
pauses leave it as it is.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from loopline.errors import InvalidRequestError
from loopline.structured.backend import apply_token_bitmask, backend_for
from loopline.structured.params import StructuredOutputsParams


class GrammarRejected(RuntimeError):
    """A booked token that the request's grammar does not accept (its mask should have prevented it)."""


class StructuredOutputs:
    """The matchers of an engine's constrained sequences (see the module docstring). Sequences are the
    scheduler's ``Request``s and steps its ``SchedulerOutput``s (duck-typed: this package sits below core)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, unsupported: str | None = None) -> None:
        """``unsupported``: why this engine refuses constrained requests (e.g. a prefill worker), or None."""
        self.tokenizer, self.vocab_size, self.unsupported = tokenizer, vocab_size, unsupported
        self.matchers: dict[str, _Sequence] = {}  # child id -> its matcher

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def check_supported(self, params: Any) -> None:
        """Refuses a constrained request this engine cannot serve (before anything else is done with it)."""
        if getattr(params, "structured_outputs", None) is not None:
            self._check_supported()

    def _check_supported(self) -> None:
        if self.unsupported is not None:
            raise InvalidRequestError(f"structured_outputs are not supported {self.unsupported}",
                                      param="structured_outputs")

    def add(self, spec: StructuredOutputsParams | None, children: list[Any]) -> None:
        """Constrains these sequences (one request's children). The compile hits the cache the input
        processor filled; raises ``InvalidRequestError`` (nothing added) if it cannot be served."""
        if spec is None:
            return
        self._check_supported()
        backend = backend_for(self.tokenizer, self.vocab_size)
        compiled = backend.compile(spec)
        made = [_Sequence(backend.matcher(compiled, sorted(c.eos_token_ids)), c) for c in children]
        for seq in made:
            self.matchers[seq.request.request_id] = seq

    def drop(self, child_id: str) -> None:
        self.matchers.pop(child_id, None)

    def prune(self) -> None:
        """Drops the matchers of sequences that finished without :meth:`drop` (e.g. aborted by a pause)."""
        for child_id in [cid for cid, seq in self.matchers.items() if seq.request.is_finished]:
            del self.matchers[child_id]

    def in_step(self, sched: Any) -> bool:
        """Whether a step has rows of constrained sequences (their logits are masked)."""
        m = self.matchers
        return bool(m) and any(row.request_id in m for row in sched.rows)

    def read_at_once(self, sched: Any, per_token_exits: bool = False) -> bool:
        """Whether a step must be read before the next one launches: it has a row of a constrained sequence
        that may sample in it and again in the next step (see the module docstring). ``per_token_exits``:
        the exit rule changes from token to token (a decode row's rule says nothing of the next token's)."""
        m = self.matchers
        return bool(m) and any(row.request_id in m and (per_token_exits or _back_to_back(row.exit))
                               for row in sched.rows)

    def accept(self, req: Any) -> bool:
        """Advances the sequence's matcher with its last booked token; returns whether the grammar
        terminated. Raises :class:`GrammarRejected` if the grammar does not accept it."""
        seq = self.matchers.get(req.request_id)
        if seq is None:
            return False
        token = req.output[-1].token_id
        seq.mask = None  # the next token's mask changes with this one
        if not seq.matcher.accept_token(token):
            raise GrammarRejected(f"token {token} of {req.request_id} does not match its grammar: no token was left "
                                  "(the grammar and the request's other token filters -- allowed_token_ids, bad_words, "
                                  "min_tokens, logit_bias -- exclude each other)")
        return seq.matcher.is_terminated()

    def token_mask(self, logits: Tensor, request_ids: list[str]) -> None:
        """Masks, in place, the rows of ``logits`` (one per id) whose sequence is constrained: every token its
        grammar does not allow next gets ``-inf``. The runner calls it on the rows it samples."""
        m = self.matchers
        rows = [j for j, rid in enumerate(request_ids) if rid in m]
        if not rows:
            return
        backend = backend_for(self.tokenizer, self.vocab_size)
        bitmask = backend.allocate_bitmask(len(rows))
        for k, j in enumerate(rows):
            seq = m[request_ids[j]]
            if seq.mask is None:  # a row that loops on without a new token keeps its mask: filled once
                seq.matcher.fill_next_token_bitmask(bitmask, k)
                seq.mask = bitmask[k].clone()
            else:
                bitmask[k] = seq.mask
        apply_token_bitmask(logits, rows, bitmask)


def _back_to_back(rule: Any) -> bool:
    """Whether a row under exit rule ``rule`` (a decode row's ``ExitParams``; ``None``: a prefill row, whose
    first token's rule is unknown here) may sample a token in two consecutive steps."""
    if rule is None:
        return True
    first_exit = rule.max_loops if rule.threshold >= 1.0 else rule.min_loops
    return first_exit <= 1


class _Sequence:
    """A constrained sequence: its matcher, its request, and its next token's bitmask row once filled."""

    __slots__ = ("matcher", "request", "mask")

    def __init__(self, matcher: Any, request: Any) -> None:
        self.matcher, self.request = matcher, request
        self.mask: Tensor | None = None
