"""Turns sampled tokens into per-step output deltas: detokenization, stop strings, logprobs, ``n`` grouping.

Each step, :meth:`OutputProcessor.collect` reports every request that changed as one
:class:`~loopline.engine.deltas.OutputDelta`: what each of its completions added since the
previous report (tokens, logprobs, exit depths, weight versions, text), never the history, so
a report costs the size of the step. Text grows incrementally (``detokenizer.py``) and stop
strings are searched only in the text a token added (plus the few characters before it a stop
string could start in). While a request with stop strings runs, the last
``max(len(stop)) - 1`` characters of its text are held back (not reported), as a stop string
could still start in them: reported text is never taken back.

A failure while booking, finishing or collecting one request (a tokenizer that
raises on its text, say) stays with that request: the engine fails it
(:meth:`OutputProcessor.on_failed`, which never detokenizes) and every other
request's output is built as if it had not been there.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loopline.core.request import Request
from loopline.engine.deltas import CompletionDelta, OutputDelta
from loopline.engine.detokenizer import IncrementalDetokenizer, StreamedText
from loopline.engine.input_processor import parent_request_id
from loopline.outputs import Logprob, RequestMetrics
from loopline.sampling_params import SamplingParams


@dataclass
class _Completion:
    index: int
    seed: int
    # The whole completion (appending costs O(1)); reports slice what follows ``sent``.
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    weight_versions: list[Any] = field(default_factory=list)  # per token: the weights that produced it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    text: StreamedText = field(default_factory=StreamedText)  # visible text (see the module docstring)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detok: IncrementalDetokenizer | None = None  # None: no tokenizer, or detokenize=False
    stopped: bool = False  # a stop string ended the text: later tokens add none
    flushed: bool = False  # finished with its whole text: nothing is held back any more
    error_id: str | None = None  # an internal error ended it (finish_reason "abort")
    sent: int = 0  # tokens reported
    changed: bool = False  # since the last report


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[str]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_exit_depths: list[int | None] | None = None
    prompt_filled: int = 0  # prompt positions with logprobs, and how many of them were reported
    prompt_sent: int = -1  # (-1: the list was never reported)
    dirty: bool = False
    head_sent: bool = False  # the prompt and params went with an earlier report
    weight_version: Any = None  # at add time, then of the newest token (never read at collection time)
    num_cached_tokens: int = -1  # prefix-cache hits at the first admission (-1: no token came yet)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat_end_ids: list[int] = []
        if tokenizer is not None:
            from loopline.models.loader import chat_end_token_ids
            self.chat_end_ids = chat_end_token_ids(tokenizer)
        self._parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, tuple[str, int]] = {}
        self._completions: dict[str, _Completion] = {}
        self._adopted: list[OutputDelta] = []  # see take_adopted
        self._pieces: dict[int, str] = {}  # token id -> its text alone (logprobs entries)

    def has(self, request_id: str) -> bool:
        return request_id in self._parents

    def on_scheduled(self, child_id: str) -> None:
        """A request's first admission (its queue time ends); later ones (resumptions) change nothing."""
        parent = self._parents.get(self._child_parent.get(child_id, (None,))[0])
        if parent is not None and parent.metrics.first_scheduled_time is None:
            parent.metrics.first_scheduled_time = time.time()

    def on_preempted(self, child_id: str) -> None:
        """A request's completion was preempted (its KV snapshotted to host memory)."""
        parent = self._parents.get(self._child_parent.get(child_id, (None,))[0])
        if parent is not None:
            parent.metrics.num_preemptions += 1

    def has_unreported(self) -> bool:
        """Whether some request changed since the last :meth:`collect`."""
        return any(p.dirty for p in self._parents.values())

    def children(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.children) if parent else []

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
            children: list[str], weight_version: Any = None) -> None:
        parent = _Parent(request_id, prompt, prompt_ids, params, children, RequestMetrics(time.time()),
                         weight_version=weight_version)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] + [None] * (len(prompt_ids) - 1)
            parent.prompt_exit_depths = [None] * len(prompt_ids)
        self._parents[request_id] = parent
        for i, cid in enumerate(children):
            self._child_parent[cid] = (request_id, i)
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            self._completions[cid] = _Completion(i, params.seed + i, logprobs=[] if params.logprobs is not None else None,
                                                 detok=detok)

    def detokenizer(self, child_id: str) -> IncrementalDetokenizer | None:
        """A completion's incremental detokenizer (``None``: no such completion, no tokenizer, or
        ``detokenize=False``)."""
        comp = self._completions.get(child_id)
        return comp.detok if comp is not None else None

    def metrics(self, request_id: str) -> RequestMetrics:
        return self._parents[request_id].metrics

    def prompt(self, request_id: str) -> str | None:
        return self._parents[request_id].prompt

    def forget(self, request_id: str) -> None:
        """Drops a request without a final output (it moved to a decode worker, which finishes it)."""
        if request_id in self._parents:
            self._drop(request_id)
            self._adopted = [d for d in self._adopted if d.request_id != request_id]

    def adopt(self, req: Request, prompt: str | None, metrics: RequestMetrics, weight_version: Any) -> str:
        """Takes over a request whose first token another engine (a prefill worker) produced and
        reported: its completion continues from that token (text, logprobs, stop strings), its
        reports continue the prefill worker's (no head, that token and its text not again).
        Returns the text reported so far."""
        request_id = parent_request_id(req.request_id)
        self.add(request_id, prompt, req.prompt_token_ids, req.params, [req.request_id], weight_version)
        parent = self._parents[request_id]
        parent.prompt_logprobs = parent.prompt_exit_depths = None  # the prefill worker reported them
        self.on_token(req, weight_version, check_stop=False)
        comp = self._completions[req.request_id]
        _, text = comp.text.report(self._holdback(req.params))  # what the prefill worker reported
        reported = CompletionDelta(comp.index, text, 0, list(comp.token_ids), list(comp.exit_depths),
                                   list(comp.weight_versions), list(comp.logprobs) if comp.logprobs is not None else None,
                                   comp.cumulative_logprob if comp.logprobs is not None else None, None, None, comp.seed)
        self._adopted.append(OutputDelta(request_id, [reported], False, weight_version, metrics,
                                         (prompt, parent.prompt_token_ids, parent.params)))
        comp.sent, comp.changed = len(comp.token_ids), False
        parent.metrics, parent.dirty, parent.head_sent = metrics, False, True
        return text

    def take_adopted(self) -> list[OutputDelta]:
        """What the prefill workers of the requests adopted since the last call reported (head, first
        token, its text): ``LLMEngine.step()`` builds whole outputs on it; the engine loop drops it (its
        client has it from the prefill worker)."""
        adopted, self._adopted = self._adopted, []
        return adopted

    # --- per token ----------------------------------------------------------------------
    def on_token(self, req: Request, weight_version: Any = None, check_stop: bool = True) -> tuple[str, str] | None:
        """Books ``req``'s newest token; returns ``("stop", stop string)`` when its text hit one
        (the text is cut before it, or after it with ``include_stop_str_in_output``)."""
        comp = self._completions[req.request_id]
        parent = self._parents[self._child_parent[req.request_id][0]]
        tok = req.output[-1]
        comp.token_ids.append(tok.token_id)
        comp.exit_depths.append(tok.exit_depth)
        comp.weight_versions.append(weight_version)
        parent.weight_version = weight_version
        if parent.num_cached_tokens < 0:  # the first token: its prompt's admission is settled
            parent.num_cached_tokens = req.num_cached_tokens
        if tok.logprob is not None:
            comp.cumulative_logprob += tok.logprob
        if comp.logprobs is not None:
            entry = {tok.token_id: Logprob(tok.logprob, tok.rank, self._piece(tok.token_id))}
            custom = req.params.logprob_token_ids is not None  # those ids, not the top k: rank not computed
            for rank, (tid, lp) in enumerate(tok.top or [], start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, None if custom else rank, self._piece(tid))
            comp.logprobs.append(entry)
        now = time.time()
        parent.metrics.first_token_time = parent.metrics.first_token_time or now
        parent.metrics.last_token_time = now
        parent.dirty = comp.changed = True
        if comp.detok is None or comp.stopped:
            return None
        new = comp.detok.push(tok.token_id)
        comp.text.append(new)
        # min_tokens: a stop string ends the request only once it has more tokens than that (vLLM)
        check_stop = check_stop and len(comp.token_ids) > req.params.min_tokens
        return self._find_stop(comp, req.params, len(new)) if check_stop and req.params.stop else None

    @staticmethod
    def _holdback(params: SamplingParams) -> int:
        return max((len(s) for s in params.stop), default=1) - 1 if params.stop else 0

    def _find_stop(self, comp: _Completion, params: SamplingParams, new_len: int) -> tuple[str, str] | None:
        """The earliest stop string that ends in the last ``new_len`` characters of the text.

        NOTE: the characters a stop string could start in (the new ones and the held-back ones
        before them) were never reported, so they are all in ``comp.text.pending``."""
        if not new_len:
            return None
        text = comp.text.pending
        start = max(0, len(text) - new_len - self._holdback(params))
        best = None
        for s in params.stop:
            idx = text.find(s, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        comp.stopped = True
        comp.text.cut(idx + len(s) if params.include_stop_str_in_output else idx)
        return "stop", s

    def on_finished(self, req: Request) -> None:
        comp = self._completions[req.request_id]
        if comp.finish_reason is None:
            # NOTE: text first: if detokenizing fails the completion is not finished, and the
            # engine fails it instead (on_failed).
            if comp.detok is not None and not comp.stopped:  # the whole text, held-back characters too
                comp.text.append(comp.detok.flush())
            comp.finish_reason, comp.stop_reason = req.finish_reason, req.stop_reason
            comp.flushed = comp.changed = True
        parent = self._parents[self._child_parent[req.request_id][0]]
        parent.dirty = True

    def on_failed(self, child_id: str, stop_reason: str, error_id: str) -> bool:
        """Ends an unfinished completion with an internal error (finish reason ``abort``, ``error_id``),
        without detokenizing (that may be what failed); returns whether there was one to end."""
        comp = self._completions.get(child_id)
        if comp is None or comp.finish_reason is not None:
            return False  # finished (or collected and dropped) before the failure
        comp.finish_reason, comp.stop_reason, comp.error_id = "abort", stop_reason, error_id
        comp.changed = True  # (its held-back text stays held back: detokenizing may be what failed)
        self._parents[self._child_parent[child_id][0]].dirty = True
        return True

    def add_prompt_logprobs(self, child_id: str, entries: list) -> None:
        parent = self._parents[self._child_parent[child_id][0]]
        if parent.prompt_logprobs is None or self._child_parent[child_id][1] != 0:
            return
        ids = parent.prompt_token_ids
        for pos, lp, rank, top, depth in entries:
            nxt = ids[pos + 1]
            entry = {nxt: Logprob(lp, rank, self._piece(nxt))}
            for r, (tid, v) in enumerate(top, start=1):
                if tid not in entry:
                    entry[tid] = Logprob(v, r, self._piece(tid))
            parent.prompt_filled += parent.prompt_logprobs[pos + 1] is None
            parent.prompt_logprobs[pos + 1] = entry
            parent.prompt_exit_depths[pos + 1] = depth

    # --- collection ---------------------------------------------------------------------
    def collect(self, on_error: Callable[[str, Exception], tuple[str, str]] | None = None) -> list[OutputDelta]:
        """What every request that changed since the last call added (one delta per request).

        ``on_error(request_id, error) -> (stop_reason, error_id)``: building that request's delta
        failed; the callback fails its choices and the request gets a bare failed delta. Without a
        callback the error propagates.
        """
        outs = []
        for rid in [r for r, p in self._parents.items() if p.dirty]:
            parent = self._parents[rid]
            parent.dirty = False
            try:
                out = self._output(parent)
            except Exception as e:
                if on_error is None:
                    raise
                out = self._failed_output(parent, *on_error(rid, e))
            outs.append(out)
            if out.finished:
                self._drop(rid)
        return outs

    def _output(self, parent: _Parent) -> OutputDelta:
        comps = [self._completions[c] for c in parent.children]
        finished = all(c.finish_reason is not None for c in comps)
        if finished:
            parent.metrics.finished_time = time.time()
        holdback = self._holdback(parent.params)
        changed = [c for c in comps if c.changed]
        deltas = []
        for c in changed:
            start, text = c.text.report(0 if c.flushed or c.stopped else holdback)
            n = c.sent
            deltas.append(CompletionDelta(
                c.index, text, start, c.token_ids[n:], c.exit_depths[n:], c.weight_versions[n:],
                c.logprobs[n:] if c.logprobs is not None else None,
                c.cumulative_logprob if c.logprobs is not None else None,
                c.finish_reason, c.stop_reason, c.seed, c.error_id))
        prompt_logprobs = prompt_depths = None
        if parent.prompt_logprobs is not None and parent.prompt_filled != parent.prompt_sent:
            prompt_logprobs, prompt_depths = list(parent.prompt_logprobs), list(parent.prompt_exit_depths)
        # NOTE: marked reported only once the whole delta is built: a failure above reports the
        # request as failed from its previous report on (_failed_output)
        for c in changed:
            c.sent, c.changed = len(c.token_ids), False
        parent.prompt_sent = parent.prompt_filled
        return OutputDelta(parent.request_id, deltas, finished, parent.weight_version, parent.metrics,
                           self._head(parent), prompt_logprobs, prompt_depths, max(parent.num_cached_tokens, 0))

    def _failed_output(self, parent: _Parent, stop_reason: str, error_id: str) -> OutputDelta:
        """The last delta of a request whose delta could not be built: every choice failed, plain
        fields only (its text becomes empty and no logprobs come: building those may be what failed)."""
        outputs = []
        for c in (self._completions[cid] for cid in parent.children):
            c.finish_reason, c.stop_reason, c.error_id = "abort", stop_reason, error_id
            n = c.sent
            outputs.append(CompletionDelta(c.index, "", 0, c.token_ids[n:], c.exit_depths[n:], c.weight_versions[n:],
                                           None, None, "abort", stop_reason, c.seed, error_id))
        return OutputDelta(parent.request_id, outputs, True, parent.weight_version, parent.metrics, self._head(parent),
                           num_cached_tokens=max(parent.num_cached_tokens, 0))

    @staticmethod
    def _head(parent: _Parent) -> tuple | None:
        """The prompt and effective params, with a request's first report only."""
        if parent.head_sent:
            return None
        parent.head_sent = True
        return parent.prompt, parent.prompt_token_ids, parent.params

    def _drop(self, rid: str) -> None:
        parent = self._parents.pop(rid)
        for c in parent.children:
            self._child_parent.pop(c, None)
            self._completions.pop(c, None)

    # --- text ---------------------------------------------------------------------------
    def _piece(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        # cached: logprobs=-1 asks for every token's piece at every position
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self.tokenizer.decode([token_id])
        return piece
