"""What the engine reports each step -- per request, only what it added -- and the outputs built from it.

The engine's output processor reports every request that changed in a step as one
:class:`OutputDelta`: what each of its changed completions added since the previous report
(tokens, their logprobs, exit depths and weight versions, and text), never the history. The
engine loop sends these to its clients (``loopline/runtime/``: one message per step, over a
thread, a pipe or a Ray call), so a message costs the size of the step, not of the requests.

:class:`OutputBuilder` turns a request's deltas into the ``RequestOutput`` objects its
``SamplingParams.output_kind`` asks for, where a consumer reads them (``LLMEngine.step()``, each
``AsyncLLM`` output stream). Whole outputs are built only for the kinds that want them:
``CUMULATIVE`` copies the completion so far into every output (a consumer may keep an older
output, which must not grow), ``FINAL_ONLY`` builds one at the end; a ``DELTA`` output holds
only what was added since the previous one and costs only that.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from loopline.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from loopline.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class CompletionDelta:
    """What one completion added since its previous delta. ``text`` replaces the completion's text
    from character ``text_start`` on: normally the length of the text reported so far (``text`` is
    appended); earlier when the text changed (an internal error ended the completion: ``text_start``
    0, ``text`` empty)."""

    index: int
    text: str
    text_start: int
    token_ids: list[int]
    exit_depths: list[int]
    weight_versions: list[Any]
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None
    seed: int | None
    error_id: str | None = None


@dataclass
class OutputDelta:
    """One request's progress in one step: the completions that changed (in index order). ``head``
    (prompt, prompt ids, effective sampling params) comes with the request's first delta only;
    ``prompt_logprobs`` (and ``prompt_exit_depths``) with its first delta and whenever more prompt
    positions were filled."""

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    weight_version: Any
    metrics: RequestMetrics | None
    head: tuple[str | None, list[int], SamplingParams] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_exit_depths: list[int | None] | None = None
    num_cached_tokens: int = 0  # prefix-cache hits of the prompt (known once its first token came)


class _Choice:
    """One completion as its consumer has it: all of it (``CUMULATIVE``, ``FINAL_ONLY``) or what was
    added since the consumer's previous output (``DELTA``)."""

    __slots__ = ("index", "pieces", "length", "token_ids", "exit_depths", "weight_versions", "logprobs",
                 "cumulative_logprob", "finish_reason", "stop_reason", "seed", "error_id")

    def __init__(self, index: int, seed: int | None, logprobs: bool) -> None:
        self.index = index
        self.pieces: list[str] = []  # the text (DELTA: the part not output yet)
        self.length = 0  # characters of the whole text (DELTA: the most ever reported)
        self.token_ids: list[int] = []
        self.exit_depths: list[int] = []
        self.weight_versions: list[Any] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if logprobs else None
        self.cumulative_logprob: float | None = 0.0 if logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.seed = seed
        self.error_id: str | None = None

    def add(self, d: CompletionDelta, delta_kind: bool) -> None:
        if delta_kind:
            self._add_new_text(d.text_start, d.text)
            # NOTE: the delta's own lists, not copies, while the consumer has taken everything before them
            # (the usual case: one delta per output); the builder owns a delta once added.
            self.token_ids = _extend(self.token_ids, d.token_ids)
            self.exit_depths = _extend(self.exit_depths, d.exit_depths)
            self.weight_versions = _extend(self.weight_versions, d.weight_versions)
            if d.logprobs is not None:
                self.logprobs = _extend(self.logprobs or [], d.logprobs)
        else:
            self._replace_text(d.text_start, d.text)
            self.token_ids += d.token_ids
            self.exit_depths += d.exit_depths
            self.weight_versions += d.weight_versions
            if d.logprobs is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs += d.logprobs
        self.cumulative_logprob, self.finish_reason, self.stop_reason, self.seed, self.error_id = (
            d.cumulative_logprob, d.finish_reason, d.stop_reason, d.seed, d.error_id)

    def _replace_text(self, start: int, text: str) -> None:
        if start < self.length:  # earlier text changed (rare): keep what stays
            kept = "".join(self.pieces)[:start]
            self.pieces, self.length = [kept], len(kept)
        if text:
            self.pieces.append(text)
            self.length += len(text)

    def _add_new_text(self, start: int, text: str) -> None:
        """Text already output is never taken back: only what extends past it is new."""
        end = start + len(text)
        if end > self.length:
            self.pieces.append(text[max(0, self.length - start):])
            self.length = end

    def text(self) -> str:
        if len(self.pieces) != 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0]

    def whole(self, copy: bool) -> CompletionOutput:
        """The completion so far (``copy``: in lists of the output's own)."""
        lists = (self.token_ids, self.logprobs, self.exit_depths, self.weight_versions)
        if copy:
            lists = tuple(None if x is None else list(x) for x in lists)
        token_ids, logprobs, exit_depths, weight_versions = lists
        return CompletionOutput(self.index, self.text(), token_ids, self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason, exit_depths, self.seed, weight_versions,
                                self.error_id)

    def take_new(self) -> CompletionOutput:
        """What was added since the previous output (handed over: the choice starts empty again)."""
        out = self.whole(copy=False)
        self.pieces, self.token_ids, self.exit_depths, self.weight_versions = [], [], [], []
        if self.logprobs is not None:
            self.logprobs = []
        return out


def _extend(mine: list, new: list) -> list:
    if not mine:
        return new
    mine += new
    return mine


class _Request:
    __slots__ = ("kind", "prompt", "prompt_token_ids", "params", "prompt_logprobs", "prompt_exit_depths",
                 "choices", "changed", "finished", "weight_version", "metrics", "num_cached_tokens")

    def __init__(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.prompt, self.prompt_token_ids, self.params = prompt, prompt_token_ids, params
        self.kind = params.output_kind
        self.prompt_logprobs = self.prompt_exit_depths = None
        logprobs = params.logprobs is not None
        self.choices = [_Choice(i, params.seed + i if params.seed is not None else None, logprobs)
                        for i in range(params.n)]
        self.changed: set[int] = set()  # choices changed since the last output (DELTA)
        self.finished = False
        self.weight_version: Any = None
        self.metrics: RequestMetrics | None = None
        self.num_cached_tokens = 0


class OutputBuilder:
    """Turns deltas into the ``RequestOutput`` objects each request's ``output_kind`` asks for (one builder
    per consumer of a set of requests).

    :meth:`add` books a delta (at the cost of what it adds) and says whether the request has an
    output to take now; :meth:`take` builds it. Deltas added between two takes merge: a slow
    consumer gets one output covering them. A request's state goes with its final output.
    """

    def __init__(self) -> None:
        self._reqs: dict[str, _Request] = {}

    def add(self, delta: OutputDelta) -> bool:
        """Books ``delta`` (the builder owns its lists from now on); returns whether the request has an
        output to take: always, except for ``FINAL_ONLY`` before the request finished."""
        req = self._reqs.get(delta.request_id)
        if req is None:
            assert delta.head is not None, f"first delta of {delta.request_id} has no head"
            req = self._reqs[delta.request_id] = _Request(*delta.head)
        if delta.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_exit_depths = delta.prompt_logprobs, delta.prompt_exit_depths
        delta_kind = req.kind is RequestOutputKind.DELTA
        for d in delta.outputs:
            req.choices[d.index].add(d, delta_kind)
            req.changed.add(d.index)
        req.finished, req.weight_version, req.metrics = delta.finished, delta.weight_version, delta.metrics
        req.num_cached_tokens = max(req.num_cached_tokens, delta.num_cached_tokens)
        return delta.finished or req.kind is not RequestOutputKind.FINAL_ONLY

    def take(self, request_id: str) -> RequestOutput:
        """The request's output now: the whole completions (``CUMULATIVE``, ``FINAL_ONLY``), or the
        completions that changed since the previous output with what they added (``DELTA``)."""
        req = self._reqs[request_id]
        if req.kind is RequestOutputKind.DELTA:
            outputs = [req.choices[i].take_new() for i in sorted(req.changed)]
        else:  # FINAL_ONLY: the last output, so its lists need no copy
            copy = req.kind is RequestOutputKind.CUMULATIVE
            outputs = [c.whole(copy) for c in req.choices]
        req.changed = set()
        if req.finished:
            del self._reqs[request_id]
        return RequestOutput(request_id, req.prompt, req.prompt_token_ids, req.prompt_logprobs, outputs,
                             req.finished, req.weight_version, req.metrics, req.params, req.prompt_exit_depths,
                             req.num_cached_tokens)

    def build(self, deltas: Iterable[OutputDelta]) -> list[RequestOutput]:
        """The outputs of one step's deltas (``LLMEngine.step()``): one per request that has one."""
        ready = {d.request_id: None for d in deltas if self.add(d)}
        return [self.take(rid) for rid in ready]

    def drop(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def __len__(self) -> int:
        """Requests with state here (tests: none is left once every request finished)."""
        return len(self._reqs)

    def held(self, request_id: str) -> int:
        """How many list entries (tokens, exit depths, weight versions, logprobs, text pieces) the builder
        keeps of a request's choices: a ``DELTA`` output hands them over, so none stays (0 for a request
        it has no state of)."""
        req = self._reqs.get(request_id)
        if req is None:
            return 0
        return sum(len(c.token_ids) + len(c.exit_depths) + len(c.weight_versions) + len(c.logprobs or ())
                   + len(c.pieces) for c in req.choices)
