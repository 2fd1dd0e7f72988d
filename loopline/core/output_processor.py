"""Turns sampled tokens into ``RequestOutput``s: detokenization, stop strings, logprobs, ``n`` grouping."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from loopline.core.request import Request
from loopline.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from loopline.sampling_params import SamplingParams


@dataclass
class _Completion:
    index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    weight_versions: list[Any] = field(default_factory=list)  # per token: the weights that produced it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_text_end: int | None = None  # text truncated here after a stop string


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[str]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    dirty: bool = False
    weight_version: Any = None  # at add time, then of the newest token (never read at collection time)


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

    def has(self, request_id: str) -> bool:
        return request_id in self._parents

    def children(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.children) if parent else []

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
            children: list[str], weight_version: Any = None) -> None:
        parent = _Parent(request_id, prompt, prompt_ids, params, children, RequestMetrics(time.time()),
                         weight_version=weight_version)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] + [None] * (len(prompt_ids) - 1)
        self._parents[request_id] = parent
        for i, cid in enumerate(children):
            self._child_parent[cid] = (request_id, i)
            self._completions[cid] = _Completion(i, params.seed + i, logprobs=[] if params.logprobs is not None else None)

    # --- per token ----------------------------------------------------------------------
    def on_token(self, req: Request, weight_version: Any = None) -> None:
        comp = self._completions[req.request_id]
        parent = self._parents[self._child_parent[req.request_id][0]]
        tok = req.output[-1]
        comp.token_ids.append(tok.token_id)
        comp.exit_depths.append(tok.exit_depth)
        comp.weight_versions.append(weight_version)
        parent.weight_version = weight_version
        if tok.logprob is not None:
            comp.cumulative_logprob += tok.logprob
        if comp.logprobs is not None:
            entry = {tok.token_id: Logprob(tok.logprob, tok.rank, self._piece(tok.token_id))}
            for rank, (tid, lp) in enumerate(tok.top or [], start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self._piece(tid))
            comp.logprobs.append(entry)
        if comp.stop_text_end is None:
            comp.text = self._decode(comp.token_ids, parent.params)
        now = time.time()
        parent.metrics.first_token_time = parent.metrics.first_token_time or now
        parent.metrics.last_token_time = now
        if req.is_finished:
            self.on_finished(req)
        parent.dirty = True

    def check_stop_strings(self, req: Request) -> tuple[str, str] | None:
        """Finishes on a stop string: the text is cut before it (or after, with include_stop_str_in_output)."""
        params = req.params
        if not params.stop:
            return None
        comp = self._completions[req.request_id]
        text = self._decode(comp.token_ids + [req.output[-1].token_id], params)
        best = None
        for s in params.stop:
            idx = text.find(s)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        comp.stop_text_end = idx + len(s) if params.include_stop_str_in_output else idx
        comp.text = text[:comp.stop_text_end]
        return "stop", s

    def on_finished(self, req: Request) -> None:
        comp = self._completions[req.request_id]
        if comp.finish_reason is None:
            comp.finish_reason, comp.stop_reason = req.finish_reason, req.stop_reason
        parent = self._parents[self._child_parent[req.request_id][0]]
        parent.dirty = True

    def add_prompt_logprobs(self, child_id: str, entries: list) -> None:
        parent = self._parents[self._child_parent[child_id][0]]
        if parent.prompt_logprobs is None or self._child_parent[child_id][1] != 0:
            return
        ids = parent.prompt_token_ids
        for pos, lp, rank, top in entries:
            nxt = ids[pos + 1]
            entry = {nxt: Logprob(lp, rank, self._piece(nxt))}
            for r, (tid, v) in enumerate(top, start=1):
                if tid not in entry:
                    entry[tid] = Logprob(v, r, self._piece(tid))
            parent.prompt_logprobs[pos + 1] = entry

    # --- collection ---------------------------------------------------------------------
    def collect(self) -> list[RequestOutput]:
        """Cumulative outputs of every request that changed since the last call."""
        outs = []
        for rid in [r for r, p in self._parents.items() if p.dirty]:
            parent = self._parents[rid]
            parent.dirty = False
            comps = [self._completions[c] for c in parent.children]
            finished = all(c.finish_reason is not None for c in comps)
            if finished:
                parent.metrics.finished_time = time.time()
            outs.append(RequestOutput(
                request_id=rid, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
                prompt_logprobs=parent.prompt_logprobs,
                outputs=[CompletionOutput(
                    index=c.index, text=c.text, token_ids=list(c.token_ids),
                    cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                    logprobs=list(c.logprobs) if c.logprobs is not None else None,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    exit_depths=list(c.exit_depths), seed=c.seed, weight_versions=list(c.weight_versions))
                    for c in comps],
                finished=finished, weight_version=parent.weight_version, metrics=parent.metrics,
                sampling_params=parent.params))
            if finished:
                self._drop(rid)
        return outs

    def _drop(self, rid: str) -> None:
        parent = self._parents.pop(rid)
        for c in parent.children:
            self._child_parent.pop(c, None)
            self._completions.pop(c, None)

    # --- text ---------------------------------------------------------------------------
    def _decode(self, ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None or not params.detokenize:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def _piece(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])
