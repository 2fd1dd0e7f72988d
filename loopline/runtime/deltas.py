"""Deltas between the engine loop and its clients: only what a request added since the last message.

:class:`DeltaEncoder` (core side) turns the engine's ``RequestOutput``s into :class:`OutputDelta`s;
:class:`OutputAssembler` (client side) rebuilds cumulative outputs from them.
"""
from __future__ import annotations

from typing import Any

from loopline.outputs import CompletionOutput, RequestOutput
from loopline.runtime.protocol import CompletionDelta, OutputDelta


class DeltaEncoder:
    """Core side: turns the engine's cumulative ``RequestOutput``s into :class:`OutputDelta`s."""

    def __init__(self) -> None:
        # request id -> per completion (tokens sent, text sent), and prompt logprob positions sent
        self._sent: dict[str, tuple[list[list[Any]], list[int]]] = {}

    def encode(self, out: RequestOutput) -> OutputDelta:
        state = self._sent.get(out.request_id)
        head = None
        if state is None:
            state = self._sent[out.request_id] = ([[0, ""] for _ in out.outputs], [0])
            head = (out.prompt, out.prompt_token_ids, out.sampling_params)
        comps, prompt_sent = state
        deltas = []
        for comp, sent in zip(out.outputs, comps):
            n, old = sent
            start = len(old) if comp.text.startswith(old) else 0
            deltas.append(CompletionDelta(
                comp.index, comp.text[start:], start, comp.token_ids[n:], comp.exit_depths[n:],
                comp.weight_versions[n:], comp.logprobs[n:] if comp.logprobs is not None else None,
                comp.cumulative_logprob, comp.finish_reason, comp.stop_reason, comp.seed, comp.error_id))
            sent[0], sent[1] = len(comp.token_ids), comp.text
        prompt_logprobs = prompt_depths = None
        if out.prompt_logprobs is not None:
            filled = sum(e is not None for e in out.prompt_logprobs)
            if filled != prompt_sent[0]:
                prompt_sent[0], prompt_logprobs = filled, list(out.prompt_logprobs)
                prompt_depths = list(out.prompt_exit_depths) if out.prompt_exit_depths is not None else None
        if out.finished:
            self.drop(out.request_id)
        return OutputDelta(out.request_id, deltas, out.finished, out.weight_version, out.metrics, head,
                           prompt_logprobs, prompt_depths)

    def drop(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def seed(self, request_id: str, tokens_sent: int, text_sent: str) -> None:
        """A request whose first output another engine sent (a prefill worker's handoff): its
        deltas continue from there, without a head."""
        self._sent[request_id] = ([[tokens_sent, text_sent]], [0])


class _Assembled:
    __slots__ = ("prompt", "prompt_token_ids", "params", "prompt_logprobs", "prompt_exit_depths", "comps")

    def __init__(self, head: tuple, n: int) -> None:
        self.prompt, self.prompt_token_ids, self.params = head
        self.prompt_logprobs = self.prompt_exit_depths = None
        self.comps = [CompletionOutput(i, "", [], None, None) for i in range(n)]


class OutputAssembler:
    """Client side: rebuilds cumulative ``RequestOutput``s (what the server streams from) from deltas."""

    def __init__(self) -> None:
        self._reqs: dict[str, _Assembled] = {}

    def apply(self, delta: OutputDelta) -> RequestOutput:
        req = self._reqs.get(delta.request_id)
        if req is None:
            assert delta.head is not None, f"first delta of {delta.request_id} has no head"
            req = self._reqs[delta.request_id] = _Assembled(delta.head, len(delta.outputs))
        if delta.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_exit_depths = delta.prompt_logprobs, delta.prompt_exit_depths
        outs = []
        for comp, d in zip(req.comps, delta.outputs):
            comp.index, comp.text = d.index, comp.text[:d.text_start] + d.text
            comp.token_ids += d.token_ids
            comp.exit_depths += d.exit_depths
            comp.weight_versions += d.weight_versions
            if d.logprobs is not None:
                comp.logprobs = (comp.logprobs or []) + d.logprobs
            comp.cumulative_logprob, comp.finish_reason, comp.stop_reason, comp.seed, comp.error_id = (
                d.cumulative_logprob, d.finish_reason, d.stop_reason, d.seed, d.error_id)
            # NOTE: copies: a consumer may keep an older output, which must not grow later.
            outs.append(CompletionOutput(comp.index, comp.text, list(comp.token_ids), comp.cumulative_logprob,
                                         list(comp.logprobs) if comp.logprobs is not None else None,
                                         comp.finish_reason, comp.stop_reason, list(comp.exit_depths), comp.seed,
                                         list(comp.weight_versions), comp.error_id))
        if delta.finished:
            self.drop(delta.request_id)
        return RequestOutput(delta.request_id, req.prompt, req.prompt_token_ids, req.prompt_logprobs, outs,
                             delta.finished, delta.weight_version, delta.metrics, req.params, req.prompt_exit_depths)

    def drop(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
